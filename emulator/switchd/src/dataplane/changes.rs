//! Changes to the running fabric: made by hand, scheduled as a scenario's timeline,
//! applied when due, cancelled with the repairs of what a timeline broke; and the event
//! log they are written to.

use std::time::{Duration as StdDuration, Instant as StdInstant};

use closbox_fabric::model::Change;
use closbox_fabric::Instant;

use crate::links::{HostLink, IfState, RootQdisc};
use crate::pace;

use super::{
    layers, DataPlane, Ports, MAX_EVENTS, MAX_LOAD_PACKETS_PER_WALL_S, MAX_PENDING,
    SHORT_LOAD_PACKETS,
};
use crate::chaos::{self, ChangeRequest, Event};

/// What a timeline broke and has not repaired yet (see `DataPlane::cancel`), while it has
/// steps pending or loads running.
#[derive(Debug, Default)]
pub(super) struct Broken {
    /// Steps still to come.
    pub(super) pending: usize,
    down: std::collections::BTreeSet<u32>,
    degraded: std::collections::BTreeSet<u32>,
    partition: bool,
    /// Loads it started that still run.
    pub(super) loads: Vec<u32>,
}

/// What a change does to what `Broken` keeps.
#[derive(Clone, Copy)]
enum Target {
    Down(u32),
    Up(u32),
    Set(u32),
    Reset(u32),
    Partition,
    Heal,
    Load(u32),
    Other,
}

impl Target {
    fn of(change: &Change) -> Target {
        match change {
            Change::LinkDown(l) => Target::Down(*l),
            Change::LinkUp(l) => Target::Up(*l),
            Change::SetLink { link, .. } => Target::Set(*link),
            Change::ResetLink(l) => Target::Reset(*l),
            Change::Partition(_) => Target::Partition,
            Change::Heal => Target::Heal,
            Change::StartLoad(spec) => Target::Load(spec.id),
            Change::StopLoad(_) => Target::Other,
        }
    }
}

impl Broken {
    /// `target` was applied (and changed the fabric).
    fn record(&mut self, target: Target) {
        match target {
            Target::Down(l) => {
                self.down.insert(l);
            }
            Target::Up(l) => {
                self.down.remove(&l);
            }
            Target::Set(l) => {
                self.degraded.insert(l);
            }
            Target::Reset(l) => {
                self.degraded.remove(&l);
            }
            Target::Partition => self.partition = true,
            Target::Heal => self.partition = false,
            Target::Load(id) => self.loads.push(id),
            Target::Other => {}
        }
    }

    /// Whether `change` repairs something this timeline broke.
    fn repaired_by(&self, change: &Change) -> bool {
        match Target::of(change) {
            Target::Up(l) => self.down.contains(&l),
            Target::Reset(l) => self.degraded.contains(&l),
            Target::Heal => self.partition,
            _ => false,
        }
    }

    /// Nothing pending and nothing running: nothing left to cancel.
    fn done(&self) -> bool {
        self.pending == 0 && self.loads.is_empty()
    }
}

/// Whether a logged event's text ends `timeline` early: its cancel's own line or one of
/// its repairs or stops, or a fabric reset (which cancels every timeline). For clients
/// following a timeline, which see it end and must tell a cancel from a natural end.
pub fn ends_early(what: &str, timeline: u64) -> bool {
    what.starts_with(RESET)
        || what.starts_with(&format!("timeline {timeline} cancelled with "))
        || what.contains(&format!("(now: timeline {timeline} cancelled)"))
}

/// Timelines that may wait for the GPUs' packets at once: each is looked at for every
/// packet read while it waits, and holds a flag per GPU.
pub(super) const MAX_ARMED: usize = 64;

/// A timeline's steps checked and resolved but not scheduled yet (`DataPlane::prepare`):
/// at fabric ns after its start, and what its faults take down (`fault_labels`).
#[derive(Debug)]
pub(super) struct Prepared {
    steps: Vec<(u64, chaos::Step)>,
    labels: Vec<((u64, u32), String)>,
}

/// A timeline waiting for the GPUs' packets to start it (`Schedule::start`).
#[derive(Debug)]
pub(super) struct Armed {
    pub(super) id: u64,
    plan: Prepared,
    /// Per GPU: one it waits for that has not sent yet.
    waiting: Vec<bool>,
    /// How many more must send before it starts.
    left: usize,
    /// Each GPU watched must send (not only one of them).
    every: bool,
    /// How many GPUs it watches, and the one when it is one.
    watched: usize,
    only: Option<String>,
}

impl Armed {
    /// What it waits for: "the first packet from one of its 8 GPUs", "a packet from each
    /// of its 8 GPUs (3 still to send)", "a packet from gpu3".
    pub(super) fn waits_for(&self) -> String {
        match (&self.only, self.every) {
            (Some(gpu), _) => format!("a packet from {gpu}"),
            (None, false) => format!("the first packet from one of its {} GPUs", self.watched),
            (None, true) if self.left == self.watched => {
                format!("a packet from each of its {} GPUs", self.watched)
            }
            (None, true) => format!(
                "a packet from each of its {} GPUs ({} still to send)",
                self.watched, self.left
            ),
        }
    }

    /// Its steps (each one pending while it waits).
    pub(super) fn steps(&self) -> usize {
        self.plan.steps.len()
    }
}

/// A schedule's faults are one per item, or none, and a scenario's own (below
/// `OWN_FAULT`).
fn check_faults(items: &[(u64, ChangeRequest)], faults: &[u32]) -> Result<(), String> {
    if !faults.is_empty() && faults.len() != items.len() {
        return Err(format!(
            "{} faults for {} items: one per item, or none",
            faults.len(),
            items.len()
        ));
    }
    if let Some(f) = faults.iter().find(|&&f| f >= OWN_FAULT) {
        return Err(format!(
            "fault {f}: a scenario's faults are below {OWN_FAULT}"
        ));
    }
    Ok(())
}

/// Whether a logged event's text is `timeline`'s start: one that waited for the GPUs'
/// packets logs it ("timeline 2 started: …") at the packet that started it, its time 0.
pub fn starts(what: &str, timeline: u64) -> bool {
    what.starts_with(&format!("timeline {timeline} started: "))
}

/// What a fault whose step is `req` takes down, for the log: "switch spine0", "GPU gpu3",
/// "a link failure", "a link flap".
fn fault_label(req: &ChangeRequest) -> Option<String> {
    Some(match req {
        ChangeRequest::SwitchDown { name } | ChangeRequest::SwitchUp { name } => {
            format!("switch {name}")
        }
        ChangeRequest::GpuDown { name } | ChangeRequest::GpuUp { name } => format!("GPU {name}"),
        ChangeRequest::SwitchFlap { name, gpu, .. } => {
            format!("{} {name}'s flap", if *gpu { "GPU" } else { "switch" })
        }
        ChangeRequest::LinkDown { .. } | ChangeRequest::LinkUp { .. } => "a link failure".into(),
        ChangeRequest::LinkFlap { .. } => "a link flap".into(),
        _ => return None,
    })
}

/// The fault a timeline's own step `req` belongs to (see `OWN_FAULT`).
fn own_fault(topo: &closbox_fabric::Topology, req: &ChangeRequest) -> u32 {
    match req {
        ChangeRequest::SwitchDown { name }
        | ChangeRequest::SwitchUp { name }
        | ChangeRequest::GpuDown { name }
        | ChangeRequest::GpuUp { name } => chaos::vertex_index(topo, name)
            .ok()
            .and_then(|v| v.checked_add(1))
            .filter(|&v| v < OWN_FAULT)
            .map_or(0, |v| OWN_FAULT | v),
        _ => 0,
    }
}

/// Faults from here up are the data plane's own numbering of flaps; a scenario numbers
/// its faults below `OWN_FAULT`.
const AUTO_FAULT: u32 = 1 << 31;

/// A timeline's own steps (fault 0) that take a switch or a GPU down or up are a fault of
/// that switch or GPU, numbered from here: `OWN_FAULT | 1 + its vertex`. A scenario that
/// takes a link down, then its spine, then the link up leaves the link down until the
/// spine is back (the link's own up undoes the link's own down only); with one fault for
/// all its steps the link came up under the dead spine. Its links' own steps stay fault 0
/// (a `link-down` of every parallel link pairs with a `link-up` of one).
const OWN_FAULT: u32 = 1 << 30;

/// How a reset's event begins.
const RESET: &str = "fabric reset: ";

impl<P: Ports> DataPlane<P> {
    /// Applies a change now (or schedules it, for a flap), all of it or (a name or value
    /// wrong) none of it. Returns what was applied now.
    pub fn change(&mut self, req: &ChangeRequest) -> Result<Vec<Event>, String> {
        match req {
            ChangeRequest::LoadStop { id } => return self.stop_loads(*id),
            ChangeRequest::Reset => return Ok(vec![self.reset()]),
            _ => {}
        }
        let now = self.fabric_now(self.ports.now());
        self.schedule_at(&[(0, req.clone())], &[], 0, now)
    }

    /// Schedules `items` (fabric ns after now, request) as a new timeline: all of them or,
    /// if one is wrong, none.
    pub fn schedule(
        &mut self,
        items: &[(u64, ChangeRequest)],
    ) -> Result<(u64, Vec<Event>), String> {
        self.schedule_faults(items, &[])
    }

    /// `schedule`, with the fault each item belongs to (`chaos::Step::fault`; empty: all
    /// the timeline's own, 0). A flap of fault 0 is given a fault of its own.
    pub fn schedule_faults(
        &mut self,
        items: &[(u64, ChangeRequest)],
        faults: &[u32],
    ) -> Result<(u64, Vec<Event>), String> {
        let now = self.fabric_now(self.ports.now());
        self.schedule_faults_from(items, faults, now)
    }

    /// `schedule_faults` with the timeline's start (`now`, the fabric's time now) given:
    /// its items are due that long after it.
    pub(super) fn schedule_faults_from(
        &mut self,
        items: &[(u64, ChangeRequest)],
        faults: &[u32],
        now: Instant,
    ) -> Result<(u64, Vec<Event>), String> {
        check_faults(items, faults)?;
        // (A schedule refused takes no id: timelines are numbered as they run.)
        let id = self.timelines + 1;
        let applied = self.schedule_at(items, faults, id, now)?;
        self.timelines = id;
        Ok((id, applied))
    }

    /// Packets a second of wall time a load generates while it sends: 0 for one short
    /// load or burst (`SHORT_LOAD_PACKETS`), the average of repeated short bursts.
    fn load_packets_per_wall_s(&self, spec: &closbox_fabric::load::LoadSpec) -> f64 {
        use closbox_fabric::load::Pattern;
        let bits = 8.0 * (spec.packet + self.topo.fabric.l2_overhead) as f64;
        let sending = spec.rate.bps() as f64 / bits;
        let secs = |d: closbox_fabric::Duration| d.as_nanos() as f64 / 1e9;
        let per_fabric_s = match (&spec.pattern, spec.duration) {
            (
                &Pattern::Bursts {
                    bytes,
                    every,
                    count,
                },
                _,
            ) => {
                let burst = (bytes as f64 / spec.packet as f64).ceil();
                match (burst <= SHORT_LOAD_PACKETS, count) {
                    (true, 1) => 0.0,
                    (true, _) => sending.min(burst / secs(every).max(1e-9)),
                    (false, _) => sending,
                }
            }
            (_, Some(d)) if sending * secs(d) <= SHORT_LOAD_PACKETS => 0.0,
            _ => sending,
        };
        per_fabric_s / self.time_scale.get()
    }

    /// The loads scenarios will start (their ids are given as they are scheduled), each
    /// with its timeline.
    fn scheduled_loads(&self) -> impl Iterator<Item = (&closbox_fabric::load::LoadSpec, u64)> {
        self.scheduled
            .values()
            .map(|(step, t)| (step, *t))
            .chain(
                self.armed
                    .iter()
                    .flat_map(|a| a.plan.steps.iter().map(move |(_, s)| (s, a.id))),
            )
            .flat_map(|(step, t)| step.changes.iter().map(move |c| (c, t)))
            .filter_map(|(c, t)| match c {
                Change::StartLoad(spec) => Some((spec, t)),
                _ => None,
            })
    }

    /// Refuses loads that, with those running and those scheduled, could generate more than
    /// `MAX_LOAD_PACKETS_PER_WALL_S` at once (counted as if all sent together).
    fn loads_within_budget<'a>(&self, new: impl Iterator<Item = &'a Change>) -> Result<(), String> {
        let running = self.model.loads().into_iter().filter(|l| l.active);
        let scheduled = self.scheduled_loads().map(|(spec, _)| spec);
        let mut added = 0.0;
        for c in new {
            if let Change::StartLoad(spec) = c {
                added += self.load_packets_per_wall_s(spec);
            }
        }
        if added == 0.0 {
            return Ok(());
        }
        let others: f64 = running
            .map(|l| self.load_packets_per_wall_s(&l.spec))
            .sum::<f64>()
            + scheduled
                .map(|spec| self.load_packets_per_wall_s(spec))
                .sum::<f64>();
        if added + others > MAX_LOAD_PACKETS_PER_WALL_S {
            let running = if others > 0.0 {
                format!(" ({:.0} with those running or scheduled)", added + others)
            } else {
                String::new()
            };
            return Err(format!(
                "loads would generate {added:.0} packets a second of wall time{running}, more than the {MAX_LOAD_PACKETS_PER_WALL_S} the data plane generates beside the GPUs' traffic: use slower or fewer loads (an incast: fewer bytes or sources), larger packets (--packet, up to the mtu), or a larger time_scale",
            ));
        }
        Ok(())
    }

    fn schedule_at(
        &mut self,
        items: &[(u64, ChangeRequest)],
        faults: &[u32],
        timeline: u64,
        now: Instant,
    ) -> Result<Vec<Event>, String> {
        let plan = self.prepare(items, faults, timeline)?;
        Ok(self.commit(plan, timeline, now))
    }

    /// Checks and resolves `items` of `timeline` into steps (load and fault numbers taken
    /// now), without scheduling them: all of them or, if one is wrong, none.
    fn prepare(
        &mut self,
        items: &[(u64, ChangeRequest)],
        faults: &[u32],
        timeline: u64,
    ) -> Result<Prepared, String> {
        let mut next_load = self.next_load;
        let mut next_fault = self.next_fault;
        let mut steps = Vec::new();
        let mut labels = Vec::new();
        for (i, (at, req)) in items.iter().enumerate() {
            let fault = match faults.get(i) {
                Some(&f) if f != 0 => f,
                _ if matches!(
                    req,
                    ChangeRequest::LinkFlap { .. } | ChangeRequest::SwitchFlap { .. }
                ) =>
                {
                    next_fault = next_fault.wrapping_add(1);
                    AUTO_FAULT | (next_fault & (AUTO_FAULT - 1))
                }
                _ if timeline != 0 => own_fault(&self.topo, req),
                _ => 0,
            };
            if matches!(req, ChangeRequest::LoadStop { .. }) {
                return Err("a load stop cannot be scheduled: give the load a duration".into());
            }
            let resolved = chaos::schedule(&self.topo, req, &mut next_load).map_err(|e| {
                if items.len() > 1 {
                    format!("change {} of {}: {e}", i + 1, items.len())
                } else {
                    e
                }
            })?;
            steps.extend(
                resolved
                    .into_iter()
                    .map(|(after, step)| (at.saturating_add(after), chaos::Step { fault, ..step })),
            );
            if timeline != 0 && fault != 0 {
                if let Some(label) = fault_label(req) {
                    labels.push(((timeline, fault), label));
                }
            }
        }
        self.loads_within_budget(steps.iter().flat_map(|(_, step)| &step.changes))?;
        // The bound is on the model's changes (a switch's step holds one per link), so that
        // memory stays bounded whatever a step holds.
        let changes = |s: &chaos::Step| s.changes.len();
        let pending = self
            .scheduled
            .values()
            .map(|(s, _)| changes(s))
            .sum::<usize>()
            + self
                .armed
                .iter()
                .flat_map(|a| &a.plan.steps)
                .map(|(_, s)| changes(s))
                .sum::<usize>()
            + steps.iter().map(|(_, s)| changes(s)).sum::<usize>();
        if pending > MAX_PENDING {
            return Err(format!(
                "{pending} changes would be pending; at most {MAX_PENDING} may be"
            ));
        }
        self.next_load = next_load;
        self.next_fault = next_fault;
        Ok(Prepared { steps, labels })
    }

    /// Schedules what `prepare` made of `timeline`'s items from `now` (its start): applies
    /// those due at once, returned.
    fn commit(&mut self, plan: Prepared, timeline: u64, now: Instant) -> Vec<Event> {
        self.fault_labels.extend(plan.labels);
        let mut applied = Vec::new();
        // Pending first: what the steps applied now break is kept only for a timeline
        // with more to come (the repairs a cancel would make).
        let mut now_steps = Vec::new();
        for (after, step) in plan.steps {
            if after == 0 {
                now_steps.push(step);
            } else {
                self.scheduled_seq += 1;
                let at = now + closbox_fabric::Duration::from_nanos(after);
                self.scheduled
                    .insert((at, self.scheduled_seq), (step, timeline));
                self.broken.entry(timeline).or_default().pending += 1;
            }
        }
        if timeline != 0 {
            // A scenario's loads are its to stop when it is cancelled, whenever they start.
            self.broken.entry(timeline).or_default();
            self.layers.begin(timeline);
        }
        for step in now_steps {
            applied.push(self.apply(now, step, Some(timeline)));
        }
        if self.broken.get(&timeline).is_some_and(Broken::done) {
            self.broken.remove(&timeline);
            self.timelines_ended();
        }
        applied
    }

    /// Schedules a timeline as `control::Request::Schedule` asks: from `now`, or armed
    /// until the packets of its trigger's GPUs start it (`gpu_sent`).
    pub(super) fn schedule_request(
        &mut self,
        req: super::Schedule,
        now: Instant,
    ) -> Result<super::ScheduledTimeline, String> {
        let Some(start) = req.start else {
            return self
                .schedule_faults_from(&req.items, &req.faults, now)
                .map(|(id, events)| (id, events, Some(now.as_nanos())));
        };
        check_faults(&req.items, &req.faults)?;
        if self.armed.len() >= MAX_ARMED {
            return Err(format!(
                "{MAX_ARMED} timelines already wait for the GPUs' packets to start them: end some first (`closbox cancel N`; `closbox status` lists them)"
            ));
        }
        if start.gpus.is_empty() {
            return Err("a timeline's start names no GPU whose packets start it".into());
        }
        let mut waiting = vec![false; self.topo.hosts.len()];
        for name in &start.gpus {
            let Some(h) = self.topo.hosts.iter().position(|h| &h.name == name) else {
                return Err(format!(
                    "no GPU {name} on fabric {} to start a timeline with its packets",
                    self.name
                ));
            };
            waiting[h] = true;
        }
        let watched = waiting.iter().filter(|&&w| w).count();
        let id = self.timelines + 1;
        let plan = self.prepare(&req.items, &req.faults, id)?;
        self.timelines = id;
        let only = (watched == 1).then(|| start.gpus[0].clone());
        let armed = Armed {
            id,
            plan,
            waiting,
            left: if start.every { watched } else { 1 },
            every: start.every,
            watched,
            only,
        };
        let n = armed.plan.steps.len();
        let what = format!(
            "timeline {id} waits for {} to start ({} step{})",
            armed.waits_for(),
            n,
            if n == 1 { "" } else { "s" }
        );
        let event = self.log(now, StdDuration::ZERO, what, Some(id));
        self.armed.push(armed);
        Ok((id, vec![event], None))
    }

    /// GPU `host` sent a packet into the fabric at `now`: the armed timelines it was the
    /// last to wait for start, from `now`.
    pub(super) fn gpu_sent(&mut self, host: usize, now: Instant) {
        let mut i = 0;
        while i < self.armed.len() {
            let a = &mut self.armed[i];
            if a.waiting.get(host).copied().unwrap_or(false) {
                a.waiting[host] = false;
                a.left -= 1;
                if a.left == 0 {
                    let a = self.armed.remove(i);
                    let gpu = self.topo.hosts[host].name.clone();
                    let why = match (a.every, a.watched) {
                        (_, 1) => format!("{gpu} sent a packet"),
                        (false, n) => format!("the first packet of its {n} GPUs, from {gpu}"),
                        (true, n) => {
                            format!("each of its {n} GPUs has sent a packet, the last {gpu}")
                        }
                    };
                    self.log(
                        now,
                        StdDuration::ZERO,
                        format!("timeline {} started: {why}", a.id),
                        Some(a.id),
                    );
                    self.commit(a.plan, a.id, now);
                    continue;
                }
            }
            i += 1;
        }
    }

    /// Drops the pending steps of `timeline` (or of all), and makes at once the repairs
    /// among them of what the timeline broke: a link it took down comes up, a link it
    /// degraded is reset, its partition healed (a job that ends in the middle of a
    /// scenario leaves the fabric as the scenario would have, not with its faults in
    /// place). Faults still pending are dropped; a link it broke for good stays broken.
    /// How many steps were pending, and the repairs' events.
    pub fn cancel(&mut self, timeline: Option<u64>) -> (usize, Vec<Event>) {
        let keys: Vec<(Instant, u64)> = self
            .scheduled
            .iter()
            .filter(|(_, (_, t))| timeline.is_none_or(|want| *t == want))
            .map(|(k, _)| *k)
            .collect();
        let now = self.fabric_now(self.ports.now());
        // The log says what ended, and with how much still to come, before its repairs.
        let mut pending = std::collections::BTreeMap::<u64, usize>::new();
        for k in &keys {
            *pending.entry(self.scheduled[k].1).or_default() += 1;
        }
        // Timelines still waiting for their start are dropped whole: nothing of them ran.
        let mut unstarted = std::collections::BTreeMap::<u64, String>::new();
        let mut dropped = keys.len();
        let armed = std::mem::take(&mut self.armed);
        for a in armed {
            if timeline.is_none_or(|want| a.id == want) {
                *pending.entry(a.id).or_default() += a.steps();
                dropped += a.steps();
                unstarted.insert(a.id, a.waits_for());
            } else {
                self.armed.push(a);
            }
        }
        for (t, n) in pending {
            let steps = format!("{n} step{} pending", if n == 1 { "" } else { "s" });
            let what = match (t, unstarted.get(&t)) {
                (0, _) => format!("flaps cancelled with {steps}"),
                (t, None) => format!("timeline {t} cancelled with {steps}"),
                (t, Some(waited)) => format!(
                    "timeline {t} cancelled with {steps}, before it started (it waited for {waited})"
                ),
            };
            self.log(now, StdDuration::ZERO, what, Some(t));
        }
        let mut repaired = Vec::new();
        for k in &keys {
            let (step, t) = self.scheduled.remove(k).expect("a pending step");
            let Some(b) = self.broken.get(&t) else {
                continue;
            };
            let changes: Vec<Change> = step
                .changes
                .into_iter()
                .filter(|c| b.repaired_by(c))
                .collect();
            if !changes.is_empty() {
                let what = match t {
                    0 => format!("{} (now: cancelled)", step.what),
                    t => format!("{} (now: timeline {t} cancelled)", step.what),
                };
                let fault = step.fault;
                let step = chaos::Step {
                    changes,
                    what,
                    fault,
                };
                repaired.push(self.apply(now, step, Some(t)));
            }
        }
        // Its loads still running stop (another job's traffic ends with the experiment).
        let ended: Vec<(u64, Broken)> = match timeline {
            Some(t) => self.broken.remove(&t).map(|b| (t, b)).into_iter().collect(),
            None => self.broken.drain().collect(),
        };
        self.timelines_ended();
        let running = self.running_loads();
        for (t, b) in ended {
            for id in b.loads.into_iter().filter(|id| running.contains(id)) {
                let what = format!("load {id} stopped (now: timeline {t} cancelled)");
                let stop = chaos::Step::one(Change::StopLoad(id), what);
                repaired.push(self.apply(now, stop, Some(t)));
            }
        }
        (dropped, repaired)
    }

    /// The fabric back to its topology, as one event saying what that took (see
    /// `ChangeRequest::Reset`).
    fn reset(&mut self) -> Event {
        use closbox_fabric::routing::PortId;
        // (Timelines waiting for their start are cancelled with all their steps.)
        let pending = self.scheduled.len() + self.armed.iter().map(Armed::steps).sum::<usize>();
        let timelines = self.broken.keys().filter(|&&t| t != 0).count() + self.armed.len();
        self.scheduled.clear();
        self.broken.clear();
        self.armed.clear();
        let mut changes = Vec::new();
        let mut said = Vec::new();
        let (mut up, mut reset) = (0, 0);
        for l in self.model.changed_links() {
            if !l.up {
                changes.push(Change::LinkUp(l.link));
                up += 1;
            }
            let own = [0, 1].map(|end| self.model.original_of(PortId(2 * l.link + end)));
            if own != [0, 1].map(|end| (l.params[end], l.buffers[end])) {
                changes.push(Change::ResetLink(l.link));
                reset += 1;
            }
        }
        let plural =
            |n: usize, one: &str, many: &str| format!("{n} {}", if n == 1 { one } else { many });
        if up > 0 {
            said.push(format!("{} up", plural(up, "link", "links")));
        }
        if reset > 0 {
            let what = plural(reset, "link", "links");
            said.push(format!("{what} reset to the topology's values"));
        }
        if self.model.partition().is_some() {
            changes.push(Change::Heal);
            said.push("partition healed".into());
        }
        let loads = self.running_loads();
        if !loads.is_empty() {
            said.push(format!("{} stopped", plural(loads.len(), "load", "loads")));
        }
        changes.extend(loads.into_iter().map(Change::StopLoad));
        // (A timeline whose changes are all made may still run loads.)
        let cancelled = format!("{} cancelled", plural(timelines, "timeline", "timelines"));
        match (pending, timelines) {
            (0, 0) => {}
            (0, _) => said.push(cancelled),
            (n, 0) => said.push(format!(
                "{} dropped",
                plural(n, "pending step", "pending steps")
            )),
            (n, _) => said.push(format!(
                "{} dropped ({cancelled})",
                plural(n, "pending step", "pending steps")
            )),
        }
        self.layers.clear();
        self.fault_labels.clear();
        self.load_timelines.clear();
        let what = if said.is_empty() {
            format!("{RESET}nothing to undo")
        } else {
            format!("{RESET}{}", said.join(", "))
        };
        let now = self.fabric_now(self.ports.now());
        let step = chaos::Step {
            changes,
            what,
            fault: 0,
        };
        self.apply(now, step, Some(0))
    }

    /// Timelines that ended (nothing pending, no loads) let go: their holds become
    /// anyone's (`Layers::end_unless`), their faults' labels go.
    fn timelines_ended(&mut self) {
        let broken = &self.broken;
        self.layers.end_unless(|t| broken.contains_key(&t));
        self.fault_labels.retain(|(t, _), _| broken.contains_key(t));
    }

    /// The ids of the loads still sending.
    fn running_loads(&self) -> Vec<u32> {
        let loads = self.model.loads().into_iter();
        loads.filter(|l| l.active).map(|l| l.spec.id).collect()
    }

    fn stop_loads(&mut self, id: Option<u32>) -> Result<Vec<Event>, String> {
        let loads = self.model.loads();
        let running = self.running_loads();
        // The timeline of a scenario that starts it later.
        let later = id.and_then(|id| {
            self.scheduled_loads()
                .find(|(s, _)| s.id == id)
                .map(|(_, t)| t)
        });
        let stop = match id {
            Some(id) if running.contains(&id) => vec![id],
            // (`if let` guards need Rust 1.88; the MSRV is 1.85.)
            Some(id) if later.is_some() => {
                let timeline = later.expect("scheduled");
                return Err(format!(
                    "load {id} has not started yet: its scenario starts it later (`closbox cancel {timeline}` ends the scenario)"
                ));
            }
            // Loads done long ago are summed and let go (`Fabric::retired_loads`); ids
            // are given in order.
            Some(id)
                if loads.iter().any(|l| l.spec.id == id) || (1..self.next_load).contains(&id) =>
            {
                return Err(format!("load {id} is not running any more"))
            }
            Some(id) => {
                return Err(format!(
                    "no load {id}; {}",
                    if running.is_empty() {
                        "no load is running".to_owned()
                    } else {
                        format!("running: {running:?}")
                    }
                ))
            }
            None if running.is_empty() => return Err("no load is running".into()),
            None => running,
        };
        let now = self.fabric_now(self.ports.now());
        Ok(stop
            .into_iter()
            .map(|id| {
                let stop = chaos::Step::one(Change::StopLoad(id), format!("load {id} stopped"));
                self.apply(now, stop, None)
            })
            .collect())
    }

    /// Fabric time now.
    #[cfg(test)]
    pub(super) fn applied_now(&self) -> u64 {
        self.fabric_now(self.ports.now()).as_nanos()
    }

    /// Logs the loads that ended on their own (before now, so first), then applies the
    /// scheduled changes that are due.
    pub(super) fn apply_due(&mut self, wall: StdInstant) {
        let now = self.fabric_now(wall);
        let ended = self.model.take_ended_loads();
        if !ended.is_empty() && !self.broken.is_empty() {
            for b in self.broken.values_mut() {
                b.loads.retain(|id| !ended.iter().any(|(e, _, _)| e == id));
            }
            self.broken.retain(|_, b| !b.done());
            self.timelines_ended();
        }
        if !ended.is_empty() {
            for (id, at, sent) in ended {
                let ago = self.time_scale.to_wall(now.saturating_since(at));
                let sent = closbox_fabric::units::approx_bytes(sent);
                let timeline = self.load_timelines.remove(&id);
                self.log(at, ago, format!("load {id} done: {sent} sent"), timeline);
            }
        }
        while let Some(entry) = self.scheduled.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let (step, timeline) = entry.remove();
            self.apply(now, step, Some(timeline));
            if let std::collections::hash_map::Entry::Occupied(mut b) = self.broken.entry(timeline)
            {
                b.get_mut().pending -= 1;
                if b.get().done() {
                    b.remove();
                    self.timelines_ended();
                }
            }
        }
    }

    /// Routes converged since the last turn (links went down or came up): the pacer lays
    /// the GPUs' classes over the links their packets now leave on.
    pub(super) fn follow_routes(&mut self) {
        let epoch = self.model.route_epoch();
        if epoch == self.route_epoch {
            return;
        }
        self.route_epoch = epoch;
        if let Some(p) = &self.pacer {
            let mut up = vec![true; self.topo.links.len()];
            for l in self.model.changed_links() {
                up[l.link as usize] = l.up;
            }
            p.routes(up);
        }
    }

    /// Applies a step's changes at `now` and logs it as one event, saying which of its
    /// changes found the fabric already so (a link already down) and which were held by
    /// other timelines (`Layers`). What it breaks and repairs is kept for `timeline`
    /// while that has steps pending.
    fn apply(&mut self, now: Instant, step: chaos::Step, timeline: Option<u64>) -> Event {
        use closbox_fabric::routing::PortId;
        use layers::Outcome;
        let total = step.changes.len();
        let mut done = 0;
        let mut to_hand = false;
        let mut notes = Notes::default();
        for change in step.changes {
            let target = Target::of(&change);
            if let Change::StopLoad(id) = change {
                self.load_timelines.remove(&id);
            }
            let outcome = match timeline {
                Some(t) => {
                    let model = &self.model;
                    let holder = layers::Holder {
                        timeline: t,
                        fault: step.fault,
                    };
                    self.layers.take(holder, &change, |l, end| {
                        model.original_of(PortId(2 * l + end as u32))
                    })
                }
                None => Outcome::AsIs,
            };
            let applied = match (outcome, change) {
                (Outcome::AsIs, change) => self.apply_change(now, change),
                (Outcome::HeldDown(by), change) => {
                    notes.held += 1;
                    notes.held_by.extend(by);
                    // Of the step's own timeline, the switches and GPUs whose failures hold it.
                    if let (Change::LinkUp(l), Some(t)) = (change, timeline) {
                        for h in self.layers.down_holders(l).filter(|h| h.timeline == t) {
                            match self.fault_labels.get(&(t, h.fault)) {
                                Some(name) => {
                                    notes.held_by_own.insert(name.clone());
                                }
                                // Fault 0: the timeline's own `[[event]]` steps of links.
                                None if h.fault == 0 => notes.held_by_own_step = true,
                                None => notes.held_by_other_fault = true,
                            }
                        }
                    }
                    false
                }
                (
                    Outcome::Restore {
                        values,
                        hand,
                        degraded_by: by,
                    },
                    Change::ResetLink(l),
                ) => {
                    to_hand |= hand;
                    if !by.is_empty() {
                        notes.degraded += 1;
                        notes.degraded_by.extend(by);
                    }
                    restore(l, values)
                        .into_iter()
                        .fold(false, |any, c| self.apply_change(now, c) | any)
                }
                (Outcome::Regroup { groups, others }, change) => {
                    notes.healing = matches!(change, Change::Heal);
                    notes.partitions_by = others;
                    let regroup = groups.map_or(Change::Heal, Change::Partition);
                    self.apply_change(now, regroup)
                }
                (Outcome::Restore { .. }, change) => unreachable!("a restore for {change:?}"),
            };
            // A timeline holds what it takes down or degrades whether or not the fabric
            // was already so, and lets go of it the same way.
            let held_as_such = matches!(
                target,
                Target::Down(_)
                    | Target::Up(_)
                    | Target::Set(_)
                    | Target::Reset(_)
                    | Target::Partition
                    | Target::Heal
            );
            if let (true, Target::Load(id), Some(t @ 1..)) = (applied, target, timeline) {
                // Its end is logged as the timeline's.
                self.load_timelines.insert(id, t);
            }
            if applied || held_as_such {
                done += usize::from(applied);
                // (Loads started by hand, timeline 0, are not a flap's to stop.)
                let ours = timeline.filter(|&t| t != 0 || !matches!(target, Target::Load(_)));
                if let Some(b) = ours.and_then(|t| self.broken.get_mut(&t)) {
                    b.record(target);
                }
            }
        }
        let mut what = if to_hand {
            step.what
                .replace(chaos::RESET_TO_TOPOLOGY, chaos::RESET_TO_HAND)
        } else {
            step.what
        };
        what += &notes.said(total, done, timeline);
        what += &self.sync_carriers();
        self.log(now, StdDuration::ZERO, what, timeline)
    }

    /// Applies one change to the model (and the GPUs' pacing it concerns); false if it
    /// changed nothing.
    fn apply_change(&mut self, now: Instant, change: Change) -> bool {
        let rated = match &change {
            Change::SetLink {
                link,
                rate: Some(_),
                ..
            }
            | Change::ResetLink(link) => Some(*link),
            _ => None,
        };
        let up_down = matches!(change, Change::LinkUp(_) | Change::LinkDown(_));
        let done = self.model.apply(now, change);
        self.carrier_check |= done && up_down;
        if let (true, Some(link), Some(p)) = (done, rated, &self.pacer) {
            // The pacer holds a GPU's sending to its NIC links: the rate of the direction
            // leaving the GPU (a change may have been made in the other one only).
            use closbox_fabric::topology::Vertex;
            let l = &self.topo.links[link as usize];
            let from_b = !matches!(l.a, Vertex::Host(_)) && matches!(l.b, Vertex::Host(_));
            let port = closbox_fabric::routing::PortId(2 * link + u32::from(from_b));
            let bps = self.model.link_of(port).rate.bps();
            p.link_rate(link, bps);
        }
        done
    }

    /// What GPUs' hosts did to their interfaces (`link_changes`), in order: the model
    /// follows (`follow_mtu`, `host_sets`) and the event log says so.
    pub(super) fn follow_links(&mut self, wall: StdInstant) {
        let now = self.fabric_now(wall);
        let mut changes = std::mem::take(&mut self.link_changes);
        for (gpu, change) in changes.drain(..) {
            if gpu >= self.topo.hosts.len() {
                continue;
            }
            match change {
                HostLink::Mtu(mtu) => self.follow_mtu(now, gpu, mtu),
                HostLink::State(state) => self.host_sets(now, gpu, state),
                HostLink::Root(root) => self.heard_root(now, gpu, root),
            }
        }
        self.link_changes = changes;
    }

    /// GPU `gpu`'s root qdisc is now `root` (`None`: deleted), as its namespace announced:
    /// one its host put in place of closbox's pacing qdisc (or took away) is said at once,
    /// in `status` and the events, not at the pacer's next change.
    fn heard_root(&mut self, now: Instant, gpu: usize, root: Option<RootQdisc>) {
        let Some(pacer) = &self.pacer else {
            return;
        };
        let is = pacer.heard_root(gpu, root);
        let Some(slot) = self.heard_roots.get_mut(gpu) else {
            return;
        };
        if *slot == is {
            return;
        }
        let was = std::mem::replace(slot, is.clone());
        let name = &self.topo.hosts[gpu].name;
        let what = match (was, is) {
            (_, Some(kind)) if kind == pace::REMOVED => format!(
                "{name} root qdisc deleted by its host: its non-TCP packets are not held to its links' rates (above them they drop in its NIC queue) until a change of the fabric lays closbox's pacing anew"
            ),
            (_, Some(kind)) => format!(
                "{name} root qdisc {kind}, its host's in place of closbox's pacing: left as it is (its non-TCP packets above its links' rates drop in its NIC queue)"
            ),
            (Some(_), None) => {
                format!("{name} root qdisc closbox's pacing again")
            }
            (None, None) => return,
        };
        self.log_event(now, what);
    }

    /// GPU `gpu`'s host set its interface's MTU to `mtu`: the model's port into it
    /// follows (its NIC drops longer frames).
    fn follow_mtu(&mut self, now: Instant, gpu: usize, mtu: u32) {
        let fabric = self.topo.fabric.mtu;
        if self.gpu_mtus.len() < self.topo.hosts.len() {
            self.gpu_mtus.resize(self.topo.hosts.len(), 0);
        }
        let was = match self.gpu_mtus[gpu] {
            0 => fabric,
            m => m,
        };
        self.gpu_mtus[gpu] = mtu;
        if mtu == was {
            return;
        }
        self.model
            .set_gpu_mtu(closbox_fabric::topology::HostId(gpu as u32), mtu);
        let name = &self.topo.hosts[gpu].name;
        let what = match mtu.cmp(&fabric) {
            std::cmp::Ordering::Less => format!(
                "{name} interface mtu {mtu} (was {was}; the fabric's {fabric}): its NIC drops frames longer than {mtu} bytes (over_mtu)"
            ),
            std::cmp::Ordering::Equal => {
                format!("{name} interface mtu {mtu} (was {was}): the fabric's again")
            }
            std::cmp::Ordering::Greater => format!(
                "{name} interface mtu {mtu} (was {was}; the fabric's {fabric}): its frames longer than {fabric} bytes are dropped where they enter (over_mtu)"
            ),
        };
        self.log_event(now, what);
    }

    /// GPU `gpu`'s host left its interface in `state`: set down, its carrier off, gone
    /// (deleted or moved away), or up again. Its links (NIC, scale-up) go down as a NIC's
    /// would, held by the host (`Layers`: nobody else brings them up), or it lets go of
    /// them. Frames on their way to it are then dropped as `link_down` where the fabric
    /// would, not written to a TUN that refuses them.
    pub(super) fn host_sets(&mut self, now: Instant, gpu: usize, state: IfState) {
        use closbox_fabric::routing::PortId;
        use layers::Outcome;
        if self.host_if.len() < self.topo.hosts.len() {
            self.host_if.resize(self.topo.hosts.len(), IfState::Up);
        }
        let was = self.host_if[gpu];
        if was == state || was == IfState::Gone {
            return;
        }
        self.host_if[gpu] = state;
        if let (IfState::Gone, Some(p)) = (state, &self.pacer) {
            p.gone(gpu);
        }
        let name = &self.topo.hosts[gpu].name;
        if was != IfState::Up && state != IfState::Up {
            // From one way of down to another: its links stay down (`ip link del` sets
            // an interface down first).
            let now_so = match state {
                IfState::Gone => format!("gone: {GONE}"),
                IfState::Down => "set down by its host".into(),
                _ => "up, without its carrier".into(),
            };
            self.log_event(
                now,
                format!("{name}'s interface is {now_so} (its links stay down)"),
            );
            return;
        }
        let up = state == IfState::Up;
        // Its carrier follows its links again, or no longer (`sync_carriers`).
        self.carrier_check = true;
        let links = self.gpu_links[gpu].clone();
        let holder = layers::Holder::host(gpu);
        let (mut done, mut notes) = (0, Notes::default());
        for &l in &links {
            let change = if up {
                Change::LinkUp(l)
            } else {
                Change::LinkDown(l)
            };
            let model = &self.model;
            let outcome = self.layers.take(holder, &change, |l, end| {
                model.original_of(PortId(2 * l + end as u32))
            });
            match outcome {
                Outcome::AsIs => done += usize::from(self.apply_change(now, change)),
                Outcome::HeldDown(by) => {
                    notes.held += 1;
                    notes.held_by.extend(by);
                }
                o => unreachable!("{o:?} for a link's up or down"),
            }
        }
        let name = &self.topo.hosts[gpu].name;
        let n = links.len();
        let them = if n == 1 {
            "link".into()
        } else {
            format!("{n} links")
        };
        let what = match (state, was) {
            (IfState::Down, _) => format!("{name}'s {them} down: its host set its interface down (held down until it sets it up)"),
            (IfState::NoCarrier, _) => format!("{name}'s {them} down: its host set its interface's carrier off (held down until it is on again)"),
            (IfState::Gone, _) => format!("{name}'s {them} down for good: its interface is gone: {GONE}"),
            (IfState::Up, IfState::NoCarrier) => format!("{name}'s {them} up: its interface's carrier is on again"),
            (IfState::Up, _) => format!("{name}'s {them} up: its host set its interface up"),
        };
        let what = what + &notes.said(n, done, None) + &self.sync_carriers();
        self.log_event(now, what);
    }

    /// Gives each GPU's interface the carrier of its links (`Ports::set_carrier`): off
    /// while every one is down (its cable pulled, its switch dead, `closbox gpu down`),
    /// on while one is up. A link that loses every frame is up (a gray failure: no NIC
    /// sees it). Left as its host set it where its host holds its carrier off (the same
    /// flag) or it is gone. Only after a link went up or down (`carrier_check`). Returns
    /// what to add to the event that changed the links ("; gpu1 lost its carrier …"),
    /// empty where none changed but by its host's doing.
    pub(super) fn sync_carriers(&mut self) -> String {
        if !std::mem::take(&mut self.carrier_check) {
            return String::new();
        }
        let (mut off, mut on) = (Vec::new(), Vec::new());
        for gpu in 0..self.topo.hosts.len() {
            let host = self.host_if.get(gpu).copied().unwrap_or(IfState::Up);
            if matches!(host, IfState::NoCarrier | IfState::Gone) || self.closed.contains(&gpu) {
                continue;
            }
            let links = &self.gpu_links[gpu];
            let carrier = links.is_empty() || links.iter().any(|&l| self.model.link_up(l));
            if carrier == self.carrier[gpu] {
                continue;
            }
            self.carrier[gpu] = carrier;
            self.ports.set_carrier(gpu, carrier);
            // Said where the fabric's links did it, not its host (whose down took them
            // down, and whose up brings them back).
            let name = self.topo.hosts[gpu].name.clone();
            if !carrier && host == IfState::Up {
                self.carrier_said[gpu] = true;
                off.push(name);
            } else if carrier && std::mem::take(&mut self.carrier_said[gpu]) {
                on.push(name);
            }
        }
        let its = |n: usize| if n == 1 { "its" } else { "their" };
        let mut said = String::new();
        if !off.is_empty() {
            let its = its(off.len());
            said += &format!(
                "; {} lost {its} carrier (NO-CARRIER: none of {its} links is up)",
                names_list(&off)
            );
        }
        if !on.is_empty() {
            said += &format!("; {} got {} carrier back", names_list(&on), its(on.len()));
        }
        said
    }

    /// Adds `what`, which the fabric did of its own at fabric time `at`, to the event log.
    pub(super) fn log_event(&mut self, at: Instant, what: String) {
        self.log(at, StdDuration::ZERO, what, None);
    }

    /// Adds to the event log what happened at fabric time `at`, `ago` of wall time ago,
    /// for `timeline` (0 or none: by hand, or the fabric's own).
    fn log(&mut self, at: Instant, ago: StdDuration, what: String, timeline: Option<u64>) -> Event {
        let event = Event {
            fabric_ns: at.as_nanos(),
            wall_ms: std::time::SystemTime::now()
                .checked_sub(ago)
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_millis() as u64),
            what,
            seq: self.events_total + 1,
            timeline: timeline.filter(|&t| t != 0),
        };
        tracing::info!("fabric {}: {}", self.name, event.what);
        self.events_total += 1;
        self.events.push(event.clone());
        if self.events.len() > MAX_EVENTS {
            let extra = self.events.len() - MAX_EVENTS;
            self.events.drain(..extra);
        }
        event
    }
}

/// What a GPU whose interface is gone has: its links down for good.
const GONE: &str = "deleted or moved out of its namespace, or its TUN failed; its links stay down until `closbox down`";

/// Why a step's changes did less than it says, for its event's line.
#[derive(Default)]
struct Notes {
    /// Links left down for others: how many, by whom.
    held: usize,
    held_by: std::collections::BTreeSet<u64>,
    /// Of those of the step's own timeline: the switches and GPUs it took down ("switch
    /// spine0"), and whether faults of its own that name nothing hold some too.
    held_by_own: std::collections::BTreeSet<String>,
    held_by_other_fault: bool,
    /// Whether a link-down step of its own (not a fault that repairs itself) holds some.
    held_by_own_step: bool,
    /// Links left degraded by others.
    degraded: usize,
    degraded_by: std::collections::BTreeSet<u64>,
    /// Others' partitions in place beside the step's (`healing`: its heal).
    partitions_by: std::collections::BTreeSet<u64>,
    healing: bool,
}

impl Notes {
    /// " (1 of 2 already so) (1 of 2 held down by timeline 3)": what follows the step's
    /// line, `done` of its `total` changes having changed the fabric, for `timeline`
    /// (whose other faults are said as such).
    fn said(self, total: usize, done: usize, timeline: Option<u64>) -> String {
        let of_total = |n: usize| match total {
            1 => String::new(),
            _ => format!("{n} of {total} "),
        };
        let own = timeline.filter(|&t| t != 0);
        let by = |mut ids: std::collections::BTreeSet<u64>| {
            let ours = own.is_some_and(|t| ids.remove(&t));
            let mut who = Vec::new();
            if !ids.is_empty() {
                who.push(layers::holders(ids));
            }
            if let (true, Some(t)) = (ours, own) {
                who.push(format!("another fault of timeline {t}"));
            }
            who.join(" and ")
        };
        let mut out = match total - done - self.held {
            0 => String::new(),
            n if n == total => " (already so)".into(),
            n => format!(" ({n} of {total} already so)"),
        };
        if self.held > 0 {
            let mut ids = self.held_by;
            let mut who = Vec::new();
            if let Some(t) = own.filter(|t| ids.remove(t)) {
                let named: Vec<String> = self.held_by_own.into_iter().collect();
                if !named.is_empty() {
                    who.push(format!("{} of timeline {t}", named.join(" and ")));
                }
                if self.held_by_own_step {
                    who.push(format!("a link-down step of timeline {t}"));
                }
                if self.held_by_other_fault || (named.is_empty() && !self.held_by_own_step) {
                    who.push(format!("another fault of timeline {t}"));
                }
            }
            if !ids.is_empty() {
                who.insert(0, by(ids));
            }
            out += &format!(
                " ({}held down by {})",
                of_total(self.held),
                who.join(" and ")
            );
        }
        if self.degraded > 0 {
            let by = by(self.degraded_by);
            out += &format!(" ({}still degraded by {by})", of_total(self.degraded));
        }
        if !self.partitions_by.is_empty() {
            let n = self.partitions_by.len();
            let by = by(self.partitions_by);
            let (s, stay) = if n == 1 { ("", "stays") } else { ("s", "stay") };
            out += &match self.healing {
                true => format!(" (partition{s} by {by} {stay})"),
                false => format!(" (with the partition{s} by {by})"),
            };
        }
        out
    }
}

/// The changes that set link `l` to `values`, a direction each (full sets: what is left
/// when a timeline's degrade ends).
fn restore(l: u32, values: [layers::Values; 2]) -> Vec<Change> {
    use closbox_fabric::model::Directions;
    [Directions::FromA, Directions::FromB]
        .into_iter()
        .zip(values)
        .map(|(dirs, (link, buffer))| Change::SetLink {
            link: l,
            dirs,
            rate: Some(link.rate),
            delay: Some(link.delay),
            loss: Some(link.loss),
            loss_burst: Some(link.loss_burst),
            buffer: Some(buffer),
        })
        .collect()
}

/// "gpu1", "gpu1 and gpu2", "gpu1, gpu2 and gpu3"; past 8, "gpu1, …, gpu8 and N more".
fn names_list(names: &[String]) -> String {
    match names {
        [] => String::new(),
        [one] => one.clone(),
        _ if names.len() > 8 => format!("{} and {} more", names[..8].join(", "), names.len() - 8),
        [rest @ .., last] => format!("{} and {last}", rest.join(", ")),
    }
}
