//! `closbox bench` and `closbox train`: agents in every GPU of a fabric that is up, results
//! as nccl-tests tables next to what the fabric model predicts.

use std::fmt::Write as _;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context};
use closbox_agents::bench::{Options, Row};
use closbox_agents::schedule;
use closbox_agents::train::Report;
use closbox_agents::{Algo, Endpoints, Op, Output};
use closbox_fabric::{TimeScale, Topology};
use closbox_switchd::control::{self, Reply, Request, Status};
use closbox_switchd::dataplane::{steal_remedy, stolen, CpuUse, LateCause, Lateness};
use closbox_switchd::histogram::Histogram;
use closbox_switchd::state::{FabricName, State};

use crate::live;
use crate::plan::thousands;
use crate::render;
use crate::run::{self, RunArgs};
use closbox_predict::{predict_step, Predictor};

/// What both commands share: where to run and how agents connect.
pub struct Target<'a> {
    pub fabric: Option<&'a FabricName>,
    pub gpus: &'a str,
    pub channels: usize,
    pub timeout: Option<Duration>,
    /// A chaos scenario to run with the job (`--chaos FILE`), and its time 0 instead of
    /// the file's (`--chaos-start`).
    pub chaos: Option<&'a std::path::Path>,
    pub chaos_start: Option<closbox_switchd::scenario::Start>,
}

impl Target<'_> {
    /// The fabric, the selected GPUs (two or more: `one` says why a job needs them) and
    /// the chaos timeline (checked) of a job.
    fn open(
        &self,
        what: &str,
        one: &str,
    ) -> anyhow::Result<(State, Vec<usize>, Option<crate::chaos::Timeline>)> {
        closbox_switchd::require_root(what)?;
        let st = live::resolve(self.fabric)?;
        let sel = live::select(&st, self.gpus)?;
        if let [gpu] = sel[..] {
            // `--gpus 3` reads as "three GPUs" to many; it is GPU 3 alone, whose
            // collectives are a local copy (algbw of thousands of GB/s, no packet).
            let n = st.gpus.len();
            let first = match self.gpus.parse::<usize>() {
                Ok(k) if (2..=n).contains(&k) => format!("--gpus 0-{} for the first {k}, ", k - 1),
                _ => String::new(),
            };
            return Err(crate::usage(format!(
                "--gpus {} selects one GPU ({}): {one}; select two or more ({first}--gpus all for all {n})",
                self.gpus, st.gpus[gpu].name
            )));
        }
        let timeline = self
            .chaos
            .map(|f| crate::chaos::Timeline::load(&st, f, self.chaos_start))
            .transpose()?
            .map(|mut t| {
                t.gpus = sel.iter().map(|&i| st.gpus[i].name.clone()).collect();
                t
            });
        Ok((st, sel, timeline))
    }
}

pub struct BenchArgs<'a> {
    pub target: Target<'a>,
    pub ops: Vec<Op>,
    pub opts: Options,
    pub json: bool,
    pub csv: bool,
    pub plot: Option<PathBuf>,
}

pub struct TrainArgs<'a> {
    pub target: Target<'a>,
    pub model_bytes: usize,
    pub bucket_bytes: usize,
    /// `None`: as long as the step's predicted communication.
    pub compute_ms: Option<f64>,
    pub steps: usize,
    pub algo: Algo,
    pub json: bool,
}

/// The agent binary, installed next to `closbox`.
fn agent_path() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("locating closbox")?;
    let agent = exe.with_file_name("closbox-agent");
    if !agent.exists() {
        bail!(
            "{} not found: build the whole workspace (`make build`)",
            agent.display()
        );
    }
    Ok(agent)
}

/// The fabric's topology as it was brought up, and the host index of each selected rank.
fn topology_of(st: &State, sel: &[usize]) -> anyhow::Result<(Topology, Vec<u32>)> {
    let topo = closbox_fabric::load(&st.config).with_context(|| {
        format!(
            "re-reading the topology of fabric {} for predictions",
            st.fabric
        )
    })?;
    let same = topo.hosts.len() == st.gpus.len()
        && topo
            .hosts
            .iter()
            .zip(&st.gpus)
            .all(|(h, g)| h.name == g.name && h.addr == g.addr);
    if !same {
        bail!(
            "{} changed since fabric {} came up; bring it down and up again",
            st.config.display(),
            st.fabric
        );
    }
    let ranks = sel.iter().map(|&i| i as u32).collect();
    Ok((topo, ranks))
}

/// The fabric as it is now.
struct Now {
    /// `topo` with the changed links' parameters.
    topo: Topology,
    /// Links down.
    down: Vec<u32>,
    /// The GPUs whose own host holds their links down (its interface down or gone), and
    /// those links.
    host_down: Vec<String>,
    host_held: Vec<u32>,
    /// Ports (b→a directions) whose rate and delay differ from their link's a→b ones.
    reverse: Vec<(u32, closbox_fabric::Bandwidth, closbox_fabric::Duration)>,
    /// The load each port carries from running synthetic loads (port, bit/s on the wire).
    background: Vec<(u32, f64)>,
    /// While a partition holds: the GPUs of each side (GPUs in none form one more).
    partition: Vec<Vec<String>>,
}

fn fabric_now(st: &State, topo: &Topology) -> Now {
    let mut now = Now {
        topo: topo.clone(),
        down: Vec::new(),
        host_down: Vec::new(),
        host_held: Vec::new(),
        reverse: Vec::new(),
        background: Vec::new(),
        partition: Vec::new(),
    };
    if let Some(s) = RunHealth::snapshot(&st.fabric) {
        for l in s.loads.iter().filter(|l| l.active) {
            for &(port, share) in &l.port_shares {
                now.background.push((port, l.mean_bps * share));
            }
        }
        for l in &s.changed_links {
            let Some(link) = now.topo.links.get_mut(l.id as usize) else {
                continue;
            };
            link.params.rate = closbox_fabric::Bandwidth::from_bps(l.rate_bps);
            link.params.delay = closbox_fabric::Duration::from_nanos(l.delay_ns);
            link.params.loss = l.loss;
            link.params.loss_burst = l.loss_burst;
            if let Some(r) = &l.b_to_a {
                now.reverse.push((
                    2 * l.id + 1,
                    closbox_fabric::Bandwidth::from_bps(r.rate_bps),
                    closbox_fabric::Duration::from_nanos(r.delay_ns),
                ));
            }
            if !l.up {
                now.down.push(l.id);
            }
            if l.down_by_host {
                now.host_held.push(l.id);
                let gpu = l
                    .ends
                    .iter()
                    .find(|e| st.gpus.iter().any(|g| &g.name == *e));
                if let Some(g) = gpu.filter(|g| !now.host_down.contains(g)) {
                    now.host_down.push(g.clone());
                }
            }
        }
        now.partition = s.partition;
    }
    now
}

/// The fabric as it is now (links down or changed, loads running), and a predictor for it.
/// Refused when a selected GPU cannot reach another, through links down or across a
/// partition: the agents would wait for it until their timeout.
fn predictor_now(
    st: &State,
    topo: &Topology,
    ranks: Vec<u32>,
    channels: usize,
) -> anyhow::Result<(Topology, Predictor)> {
    let now = fabric_now(st, topo);
    let names: Vec<String> = ranks
        .iter()
        .map(|&h| st.gpus[h as usize].name.clone())
        .collect();
    // A GPU in no group of a partition is on the side of the rest.
    let side = |name: &str| {
        now.partition
            .iter()
            .position(|g| g.iter().any(|n| n == name))
    };
    if !now.partition.is_empty() {
        if let Some(b) = names.iter().position(|n| side(n) != side(&names[0])) {
            bail!(
                "{} and {} are on two sides of a partition of fabric {}; `closbox heal` ends it, or choose GPUs of one side with --gpus",
                names[0],
                names[b],
                st.fabric
            );
        }
    }
    let down_names: Vec<String> = now
        .down
        .iter()
        .map(|&l| closbox_switchd::chaos::link_name(&now.topo, l))
        .collect();
    let others = now.down.iter().any(|l| !now.host_held.contains(l));
    let mut p = Predictor::with_links_down(&now.topo, ranks, channels, now.down);
    if let Some((a, b)) = p.unreachable() {
        // Links a GPU's own host holds down come up only when it says so.
        let hosts = match now.host_down.as_slice() {
            [] => String::new(),
            [g] => format!("; {g}'s own host set its interface down (or its carrier off), and only it brings its links up (`closbox exec {g} ip link set cb0 up`)"),
            gs => format!("; the hosts of {} set their interfaces down (or their carriers off), and only they bring their links up (`closbox exec GPU ip link set cb0 up`)", gs.join(", ")),
        };
        let bring = match (others, down_names.len()) {
            (false, _) => "",
            (true, 1) => "; bring it up (`closbox link up`, `closbox gpu up`, `closbox switch up`, `closbox link reset`)",
            (true, _) => "; bring them up (`closbox link up`, `closbox gpu up`, `closbox switch up`, `closbox link reset`)",
        };
        bail!(
            "{} cannot reach {} on fabric {}: {} down ({}){hosts}{bring}, or leave the GPUs cut off out with --gpus",
            names[a],
            names[b],
            st.fabric,
            if down_names.len() == 1 { "link" } else { "links" },
            down_names.join(", "),
        );
    }
    for &(port, rate, delay) in &now.reverse {
        p.set_port_link(&now.topo, port, rate, delay);
    }
    for (port, bps) in now.background {
        p.add_background(port, bps);
    }
    Ok((now.topo, p))
}

/// What the fabric and the box did during a run, from status snapshots before and after.
pub struct RunHealth {
    packets: u64,
    /// Dropped by the modelled fabric (full buffers, configured loss).
    fabric_drops: u64,
    /// Packets the kernel dropped because the daemon did not read its TUNs in time.
    tun_drops: u64,
    /// Write lateness during the run (wall time).
    lateness: Lateness,
    time_scale: TimeScale,
    /// Drops of every other reason during the run (link_down, no_route, …), by name.
    other_drops: Vec<(String, u64)>,
    /// Events during the run (`closbox events`: the changes made to the fabric, and
    /// loads that ended), and links that are down or changed at its end.
    changes: u64,
    changed_links: Vec<String>,
    /// The changes during the run, as `closbox events` prints them.
    events: Vec<String>,
    /// Synthetic loads running during the run.
    loads: Vec<String>,
    /// The lateness histogram once every rank had connected (at the run's start if that
    /// is unknown), and at its end: windows inside the run are taken between them.
    buckets_connected: Vec<(u64, u64)>,
    buckets_after: Vec<(u64, u64)>,
    /// Lossless fabrics: the flow control, pause events and paused fabric seconds (all
    /// ports) during the run, and the ports deadlocked at its end.
    pauses: Option<(String, u64, f64)>,
    deadlocked: Vec<String>,
    /// What the data plane's thread did during the run (from a daemon that says, and not
    /// started with `--realtime`).
    cpu: Option<CpuUse>,
    /// Share of the box's CPU time the hypervisor took during the run (steal).
    steal: f64,
    /// Whether `up --idle-poll` would have the box's idle CPUs poll at the run's end
    /// (`sys::idle_poll_would_help`): most of a VM's steal is then taken back.
    idle_poll_would_help: bool,
    /// Packets the fabric's ports marked ECN CE during the run.
    ecn_marks: u64,
    /// The GPUs' congestion control as the fabric set it (`None`: the host's default).
    congestion: Option<String>,
    /// Other jobs on the fabric during the run (`jobs::shared_with`).
    shared: Option<String>,
}

/// A lateness histogram snapshot, as `status` exports it (`Histogram::since`).
type Buckets = Vec<(u64, u64)>;

/// Results the box's lateness could have changed, and by how much.
pub struct Late {
    /// What was affected ("allreduce 64 KiB, 128 KiB" or "operations as short as …").
    what: String,
    /// The worst case: lateness could add `added_us` to an operation of `op_us` (fabric).
    added_us: f64,
    op_us: f64,
    steps: usize,
    /// Messages in flight at once in a step (the GPUs).
    parallel: usize,
    /// The smallest time scale that would have held them all.
    holding: f64,
}

/// Writes a window's lateness p99 is judged on at least (fewer: the window is widened to
/// its neighbours').
const WINDOW_SAMPLES: u64 = 100;

/// Most events a footer lists.
const FOOTER_EVENTS: usize = 20;

/// How much lateness may add to an operation before results are flagged: 5 %.
const LATENESS_SHARE: f64 = 0.05;

/// How the GPUs' TCP answers ECN marks, by its congestion control.
fn mark_reaction(congestion: Option<&str>) -> String {
    match congestion {
        Some("reno") => "the GPUs' TCP slows down at marks (Reno halves its window)".into(),
        Some("cubic") => "the GPUs' TCP slows down at marks (Cubic cuts its window by 30 %)".into(),
        Some("dctcp" | closbox_switchd::bpf::NAME) => {
            "the GPUs' TCP slows down at marks (DCTCP cuts its window by half its running estimate of the share marked)".into()
        }
        Some("bbr") => "the GPUs' TCP (BBR) does not slow down at marks, but queues and pauses still add".into(),
        Some(cc) => format!("the GPUs' TCP ({cc}) slows down at marks as it does"),
        None => "the GPUs' TCP (the host's default) slows down at marks as it does".into(),
    }
}

impl RunHealth {
    fn snapshot(fabric: &FabricName) -> Option<Status> {
        match control::request(fabric, &Request::Status { tcp: true }) {
            Ok(Reply::Status(s)) => Some(*s),
            _ => None,
        }
    }

    fn between(fabric: &FabricName, before: &Status, after: &Status) -> RunHealth {
        let events = match control::request(
            fabric,
            &Request::Events {
                after: before.events,
            },
        ) {
            Ok(Reply::Events { events }) => events.iter().map(crate::chaos::line).collect(),
            _ => Vec::new(),
        };
        let mut loads: Vec<String> = Vec::new();
        for l in before.loads.iter().chain(&after.loads) {
            let running_then = before.loads.iter().any(|b| b.id == l.id && b.active);
            let new = !before.loads.iter().any(|b| b.id == l.id);
            if (running_then || new)
                && !loads
                    .iter()
                    .any(|s| s.starts_with(&format!("load {} ", l.id)))
            {
                loads.push(format!(
                    "load {} {} -> {} {} {}",
                    l.id,
                    l.from,
                    l.to,
                    closbox_fabric::Bandwidth::from_bps(l.rate_bps),
                    l.pattern
                ));
            }
        }
        let fabric_drops =
            |s: &Status| crate::status::drops(s, "buffer_full") + crate::status::drops(s, "loss");
        let hist = Histogram::since(&before.lateness_buckets, &after.lateness_buckets);
        let marks = |s: &Status| s.ports.iter().map(|p| p.ecn_marked).sum::<u64>();
        RunHealth {
            congestion: None,
            shared: None,
            ecn_marks: marks(after).saturating_sub(marks(before)),
            packets: after.packets_in.saturating_sub(before.packets_in),
            fabric_drops: fabric_drops(after).saturating_sub(fabric_drops(before)),
            tun_drops: after
                .tun_tx_dropped
                .unwrap_or(0)
                .saturating_sub(before.tun_tx_dropped.unwrap_or(0)),
            lateness: Lateness::of(&hist),
            time_scale: after.time_scale,
            other_drops: after
                .drops
                .iter()
                .filter(|(r, _)| r != "buffer_full" && r != "loss")
                .map(|(r, c)| (r.clone(), c.saturating_sub(crate::status::drops(before, r))))
                .filter(|(_, c)| *c > 0)
                .collect(),
            changes: after.events.saturating_sub(before.events),
            changed_links: crate::status::link_groups(after.changed_links.iter().map(|l| {
                let state = if l.up { "changed" } else { "down" };
                (l.link.as_str(), state.to_owned())
            }))
            .into_iter()
            .map(|(names, _, state)| format!("{names} ({state})"))
            .collect(),
            events,
            loads,
            buckets_connected: before.lateness_buckets.clone(),
            buckets_after: after.lateness_buckets.clone(),
            pauses: (!after.flow_control.is_empty() && after.flow_control != "none").then(|| {
                let sum = |s: &Status| {
                    s.ports.iter().fold((0u64, 0f64), |(n, t), p| {
                        (n + p.pause_events, t + p.paused_s)
                    })
                };
                let (b, a) = (sum(before), sum(after));
                (
                    after.flow_control.clone(),
                    a.0.saturating_sub(b.0),
                    (a.1 - b.1).max(0.0),
                )
            }),
            deadlocked: after.deadlocked.iter().map(|d| d.0.clone()).collect(),
            // Already in the real-time class (`up --realtime`): nothing to advise there.
            cpu: before
                .thread_cpu_ns
                .zip(after.thread_cpu_ns)
                .filter(|_| !after.realtime)
                .map(|(b, a)| {
                    CpuUse::over(
                        after.uptime_s - before.uptime_s,
                        a.0.saturating_sub(b.0),
                        a.1.saturating_sub(b.1),
                    )
                }),
            steal: before
                .box_cpu_ticks
                .zip(after.box_cpu_ticks)
                .map_or(0.0, |(b, a)| closbox_switchd::sys::steal_share(b, a)),
            idle_poll_would_help: closbox_switchd::sys::idle_poll_would_help(),
        }
    }

    /// Fabric time a step lateness of `step_us` (wall) could add to one operation of
    /// `steps` sequential steps: µs.
    fn added_us(&self, step_us: f64, steps: usize) -> f64 {
        self.time_scale.fabric_of(steps as f64 * step_us)
    }

    /// The smallest time scale (1-2-5 steps) at which a step lateness of `step_us` would have
    /// stayed under `LATENESS_SHARE` of an operation of `op_us` with `steps` messages:
    /// lateness is a wall-time cost of the box, so in fabric time it scales as
    /// 1/time_scale. (At a higher scale the box also has fewer packets per wall second,
    /// so its lateness tends to fall: this is enough, not a minimum.)
    fn holding_time_scale(&self, step_us: f64, op_us: f64, steps: usize) -> f64 {
        let k = self.time_scale.get();
        let needed = k * self.added_us(step_us, steps) / (LATENESS_SHARE * op_us);
        closbox_fabric::plan::round_up_125(needed.max(k * 1.0001))
    }

    /// The lateness (wall µs) a step of `parallel` concurrent messages waits for: the
    /// latest of them, whose expected value is about the `parallel / (parallel + 1)`
    /// quantile of single writes (the p50 for one message, the p89 for 8, the p99 for 99).
    fn step_lateness_us(h: &Histogram, parallel: usize) -> f64 {
        let q = parallel.max(1) as f64 / (parallel.max(1) + 1) as f64;
        h.quantile(q) as f64 / 1e3
    }

    /// Whether lateness in `h` may add more than `LATENESS_SHARE` to an operation of
    /// `op_us` (fabric time) with `steps` sequential steps of `parallel` messages; the
    /// step lateness if so.
    fn late_for(&self, h: &Histogram, op_us: f64, steps: usize, parallel: usize) -> Option<f64> {
        let step = Self::step_lateness_us(h, parallel);
        (h.count() >= WINDOW_SAMPLES && self.added_us(step, steps) > LATENESS_SHARE * op_us)
            .then_some(step)
    }

    /// The whole run judged against its shortest operation (`shortest_us`, fabric time,
    /// of `steps` sequential steps of `parallel` messages).
    pub fn late_whole(&self, shortest_us: f64, steps: usize, parallel: usize) -> Option<Late> {
        let h = Histogram::since(&self.buckets_connected, &self.buckets_after);
        self.late_for(&h, shortest_us, steps, parallel)
            .map(|step| Late {
                what: format!("operations as short as {shortest_us:.2} µs"),
                added_us: self.added_us(step, steps),
                op_us: shortest_us,
                steps,
                parallel,
                holding: self.holding_time_scale(step, shortest_us, steps),
            })
    }

    /// Each result judged against the lateness while it was measured: `snaps[i]` is the
    /// lateness histogram when result i arrived (the window of result i runs from the
    /// one before). A window with fewer than `WINDOW_SAMPLES` writes is widened to its
    /// neighbours'. Returns which results lateness could have changed (by index) and the
    /// finding.
    pub fn late_rows(
        &self,
        rows: &[(String, f64)],
        snaps: &[Vec<(u64, u64)>],
        steps: usize,
        parallel: usize,
    ) -> (Vec<bool>, Option<Late>) {
        let n = rows.len().min(snaps.len());
        let at = |i: usize| -> &[(u64, u64)] {
            if i == 0 {
                &self.buckets_connected
            } else {
                &snaps[i - 1]
            }
        };
        let end = |i: usize| -> &[(u64, u64)] {
            if i + 1 >= n {
                // The last window runs to the run's end.
                &self.buckets_after
            } else {
                &snaps[i]
            }
        };
        let mut flags = vec![false; rows.len()];
        let mut worst: Option<(f64, f64, f64)> = None; // added, op, holding
        let mut affected = Vec::new();
        for i in 0..n {
            let (mut lo, mut hi) = (i, i);
            let mut h = Histogram::since(at(lo), end(hi));
            while h.count() < WINDOW_SAMPLES && (lo > 0 || hi + 1 < n) {
                lo = lo.saturating_sub(1);
                hi = (hi + 1).min(n - 1);
                h = Histogram::since(at(lo), end(hi));
            }
            let op_us = rows[i].1;
            if let Some(step) = self.late_for(&h, op_us, steps, parallel) {
                flags[i] = true;
                affected.push(rows[i].0.clone());
                let added = self.added_us(step, steps);
                let needed = self.holding_time_scale(step, op_us, steps);
                if worst.is_none_or(|(_, _, h)| needed > h) {
                    worst = Some((added, op_us, needed));
                }
            }
        }
        let late = worst.map(|(added_us, op_us, holding)| Late {
            what: format!(
                "{} of {} results: {}",
                affected.len(),
                rows.len(),
                affected.join(", ")
            ),
            added_us,
            op_us,
            steps,
            parallel,
            holding,
        });
        (flags, late)
    }

    fn footer(&self, late: Option<&Late>) -> String {
        let mut s = format!(
            "# fabric during the run: {} packets, {} dropped by the fabric (buffers, loss); box: write lateness p50 {:.1} µs p99 {:.1} µs wall (p99 = {:.3} µs of fabric time), {} TUN drops\n",
            thousands(self.packets),
            thousands(self.fabric_drops),
            self.lateness.p50_us,
            self.lateness.p99_us,
            self.time_scale.fabric_of(self.lateness.p99_us),
            thousands(self.tun_drops),
        );
        if self.ecn_marks > 0 {
            let _ = writeln!(
                s,
                "# ECN: the fabric marked {} packets during the run; {}, which the model leaves out: a result above the model may be that",
                thousands(self.ecn_marks),
                mark_reaction(self.congestion.as_deref())
            );
        }
        if let Some((mode, events, paused_s)) = &self.pauses {
            let _ = writeln!(
                s,
                "# lossless ({mode}) during the run: {} pause events, {:.3} ms paused in all (fabric time, summed over ports)",
                thousands(*events),
                paused_s * 1e3
            );
        }
        if !self.deadlocked.is_empty() {
            let _ = writeln!(
                s,
                "# DEADLOCK at the end of the run: {} paused beyond deadlock_after (`closbox status`)",
                self.deadlocked.join(", ")
            );
        }
        if !self.other_drops.is_empty() {
            let list: Vec<String> = self
                .other_drops
                .iter()
                .map(|(r, c)| format!("{r} {}", thousands(*c)))
                .collect();
            let _ = writeln!(s, "# other drops during the run: {}", list.join(", "));
        }
        if self.changes > 0 || !self.changed_links.is_empty() {
            let _ = writeln!(
                s,
                "# the fabric changed: {} event(s) during the run (`closbox events`){}",
                self.changes,
                if self.changed_links.is_empty() {
                    String::new()
                } else {
                    format!("; at its end: {}", self.changed_links.join(", "))
                }
            );
            for e in self.events.iter().take(FOOTER_EVENTS) {
                let _ = writeln!(s, "#   {e}");
            }
            if self.events.len() > FOOTER_EVENTS {
                let _ = writeln!(
                    s,
                    "#   … and {} more (`closbox events`)",
                    self.events.len() - FOOTER_EVENTS
                );
            }
        }
        for l in &self.loads {
            let _ = writeln!(s, "# synthetic load during the run: {l}");
        }
        if let Some(line) = &self.shared {
            let _ = writeln!(
                s,
                "# shared: {line}; the counts above are the fabric's (its traffic too), and the predictions assume this job alone on the fabric and the box's CPUs"
            );
        }
        let why_advice = if self.tun_drops > 0 {
            Some((
                "the kernel dropped packets the daemon read too late".to_owned(),
                "raise time_scale (the GPUs offered more than the box moves) or use fewer GPUs"
                    .to_owned(),
            ))
        } else {
            late.map(|l| {
                // A thread with time to spare that waited for a CPU: the scheduler's
                // doing (`CpuUse::preempted`), which the real-time class prevents.
                // (`cpu` is `None` in the real-time class already.)
                let waited = match LateCause::of(self.cpu.as_ref(), self.steal, false) {
                    LateCause::Stolen(steal) => format!(
                        "{}: {}run on a quieter host; or ",
                        stolen(steal, "the run"),
                        steal_remedy(self.idle_poll_would_help)
                    ),
                    LateCause::Preempted(c) => format!(
                        "the data plane's thread was busy only {:.0} % of a CPU during the run but waited {:.0} ms for one (the GPUs' processes held the CPUs): `closbox up --realtime` keeps it on a CPU; or ",
                        c.busy * 100.0,
                        c.waited_ms
                    ),
                    LateCause::Work => String::new(),
                };
                (
                    format!(
                        "{}: lateness may add up to {:.2} µs ({} sequential steps × the latest of {} messages' lateness while they ran) to operations of {:.2} µs",
                        l.what, l.added_us, l.steps, l.parallel, l.op_us
                    ),
                    format!(
                        "{waited}time_scale {} would have held them under {:.0} % (it is wall time: it shrinks in fabric time as time_scale grows), or use fewer GPUs or larger sizes",
                        l.holding,
                        LATENESS_SHARE * 100.0
                    ),
                )
            })
        };
        if let Some((why, advice)) = why_advice {
            let _ = writeln!(
                s,
                "# WARNING: this box fell behind the fabric's schedule enough to change results ({why}); {advice}"
            );
        }
        s
    }
}

/// A result this many times the model's time or more, on a fabric that kept its schedule,
/// gets a note (`far_from_model_note`).
const FAR_FROM_MODEL: f64 = 2.0;

/// Results (`named`: name, measured µs) of `FAR_FROM_MODEL` × the model's time or more that
/// the box's lateness does not explain (`late`: those it may): the time went to the
/// endpoints, which the model leaves out. Measured on the 2-core VM: an agent's thread
/// start-up costs 30–56 µs of wall time and every collective starts one or two per
/// channel, so 1 KiB AllGathers between 2 GPUs took 10.7–13.8 × the model at 64 channels
/// even at time_scale 100.
///
/// `signals`: packets the fabric dropped (full buffers, loss) and ECN-marked during the
/// run. With any, TCP backing off is named first: a 16 MiB AllToAll on `single-switch-8`
/// took 2.15 × the model with 314 drops and 56,532 marks, and the note blamed the
/// endpoints alone.
fn far_from_model_note(
    named: &[(String, f64)],
    predicted: &[f64],
    late: &[bool],
    signals: (u64, u64),
    shared: bool,
) -> Option<String> {
    const NAMED: usize = 4;
    let far: Vec<String> = named
        .iter()
        .zip(predicted)
        .zip(late)
        .filter(|(_, &is_late)| !is_late)
        .filter_map(|(((name, m), &p), _)| {
            let x = render::ratio(*m, p)?;
            (x >= FAR_FROM_MODEL).then(|| format!("{name} {x:.1} ×"))
        })
        .collect();
    if far.is_empty() {
        return None;
    }
    let more = match far.len() {
        n if n > NAMED => format!(", … {} more", n - NAMED),
        _ => String::new(),
    };
    let endpoints = "the agents' system calls, thread start-ups and wake-ups per channel, wall time that a larger time_scale shrinks in fabric time";
    let why = match signals {
        // Its traffic was in the queues and its processes on the CPUs: said first.
        _ if shared => format!("another job ran on the fabric during the run (`# shared` above): its packets shared the fabric's queues and its processes the box's CPUs, which the model (this job alone) leaves out; the rest is at the endpoints ({endpoints})"),
        (0, 0) => format!("the difference is at the endpoints, which the model leaves out ({endpoints}; and their TCP)"),
        (drops, marks) => format!(
            "the fabric dropped {} and ECN-marked {} packets during the run, and the GPUs' TCP slows down at both, which the model (loss-free, without TCP's reaction) leaves out; the rest is at the endpoints ({endpoints})",
            thousands(drops),
            thousands(marks)
        ),
    };
    Some(format!(
        "# NOTE: {} of {} results took {FAR_FROM_MODEL} × the model's time or more while the fabric kept its schedule ({}{more}): {why}\n",
        far.len(),
        named.len(),
        far[..far.len().min(NAMED)].join(", ")
    ))
}

/// What `run_agents` learns besides the results.
struct Ran {
    /// Every rank's connection endpoints.
    endpoints: Vec<Endpoints>,
    /// What the fabric and the box did meanwhile (None if the daemon did not answer).
    health: Option<RunHealth>,
}

/// Every rank's connection endpoints, as their lines arrive.
type SharedEndpoints = Arc<Mutex<Vec<Endpoints>>>;

/// How long the agents wait for a peer's data: a minute of wall time, plus twice a
/// millisecond and the chaos scenario's span (`chaos_span`) of fabric time at the fabric's
/// time scale. A path cut for fabric time d stalls a TCP flow for up to about 2·d after it
/// (retransmissions back off, doubling); and on a dilated fabric round trips, and so
/// retransmission timeouts, are long in wall time too. (`make demo` failed at time_scale
/// 50,000: a spine's 1 ms failure is 50 s of wall time there, and a rank gave up on its
/// peer after the agents' fixed 60 s.)
fn agent_timeout(
    time_scale: closbox_fabric::TimeScale,
    chaos_span: closbox_fabric::Duration,
) -> std::time::Duration {
    let fabric = chaos_span + closbox_fabric::Duration::from_millis(1);
    std::time::Duration::from_secs(60) + 2 * time_scale.to_wall(fabric)
}

/// Runs the agent in every selected GPU: rank 0's results go to `on_output`, with the
/// endpoints reported so far.
fn run_agents(
    st: &State,
    sel: &[usize],
    kind: &str,
    t: &Target,
    chaos: Option<&crate::chaos::Timeline>,
    agent_args: Vec<String>,
    mut on_output: impl FnMut(Output, &SharedEndpoints) + Send + 'static,
) -> anyhow::Result<Ran> {
    let agent = agent_path()?;
    let span = chaos.map_or(closbox_fabric::Duration::ZERO, |c| c.span());
    let mut cmd = vec![
        agent.display().to_string(),
        "--channels".into(),
        t.channels.to_string(),
        "--timeout".into(),
        format!("{:.3}", agent_timeout(st.time_scale, span).as_secs_f64()),
    ];
    cmd.extend(agent_args);
    let endpoints: SharedEndpoints = Arc::default();
    let collected = Arc::clone(&endpoints);
    let for_rows = Arc::clone(&endpoints);
    let on_output = Arc::new(Mutex::new(move |o: Output| on_output(o, &for_rows)));
    // The lateness histogram once every rank has connected (its start-up is not part of
    // any result).
    let connected: Arc<Mutex<Option<Buckets>>> = Arc::default();
    let (connected_in, fabric, ranks) = (Arc::clone(&connected), st.fabric.clone(), sel.len());
    let sink: run::Sink =
        Arc::new(
            move |rank, is_err, line: &str| match (is_err, Output::parse(line)) {
                (false, Some(Output::Endpoints(e))) => {
                    let mut all = collected.lock().expect("endpoints");
                    all.push(e);
                    if all.len() == ranks {
                        *connected_in.lock().expect("connected") =
                            RunHealth::snapshot(&fabric).map(|s| s.lateness_buckets);
                    }
                }
                (false, Some(o)) if rank == 0 => (on_output.lock().expect("sink lock"))(o),
                (false, Some(_)) => {}
                _ if is_err || rank == 0 => eprintln!("[{rank}] {line}"),
                _ => {}
            },
        );
    let mut job = crate::jobs::Job::begin(st, sel, kind);
    let before = RunHealth::snapshot(&st.fabric);
    let code = run::run(RunArgs {
        st,
        sel,
        timeout: t.timeout,
        master_port: Some(crate::run::DEFAULT_MASTER_PORT),
        cmd: &cmd,
        sink: Some(sink),
        chaos,
    })?;
    if code == ExitCode::from(130) {
        // `run` said it ("interrupted; the other ranks were stopped"): not a failure.
        return Err(anyhow::Error::new(crate::Interrupted));
    }
    if code != ExitCode::SUCCESS {
        bail!("the agents failed (see above)");
    }
    let after = RunHealth::snapshot(&st.fabric);
    let shared = crate::jobs::shared_with(st.fabric.as_str(), &job.others());
    let endpoints = std::mem::take(&mut *endpoints.lock().expect("endpoints lock"));
    let connected = connected.lock().expect("connected").take();
    Ok(Ran {
        endpoints,
        health: before.zip(after).map(|(b, a)| {
            let mut h = RunHealth::between(&st.fabric, &b, &a);
            // As the GPUs' kernels had it at the end (their hosts may have changed it
            // since `up`), else as `up` set it.
            h.congestion = match a.gpu_tcp.as_slice() {
                [] => st
                    .tcp_congestion
                    .clone()
                    .or_else(|| st.host_congestion.clone()),
                [one] => Some(one.congestion.clone()),
                many => Some(
                    many.iter()
                        .map(|t| format!("{} on {}", t.congestion, plural(t.gpus.len(), "GPU")))
                        .collect::<Vec<_>>()
                        .join(", "),
                ),
            };
            if let Some(c) = connected {
                h.buckets_connected = c;
            }
            h.shared = shared;
            h
        }),
    })
}

/// Refuses, before any agent starts, a job whose agents would together hold more memory
/// than the box has available (`per_rank`: the least each holds, for `what`): they would
/// abort one by one on allocation failures (`--sizes 1T` did), or push the box into swap.
fn enough_memory(per_rank: u64, ranks: usize, what: &str) -> anyhow::Result<()> {
    let Some(available) = closbox_switchd::mem_available() else {
        return Ok(());
    };
    let need = per_rank.saturating_mul(ranks as u64);
    if need > available {
        return Err(crate::usage(format!(
            "{what}: the {ranks} agents would hold at least {} together ({} each), more than the {} this box has available",
            crate::plan::approx_bytes(need),
            crate::plan::approx_bytes(per_rank),
            crate::plan::approx_bytes(available)
        )));
    }
    Ok(())
}

pub fn bench(a: BenchArgs) -> anyhow::Result<()> {
    let (st, sel, timeline) = a.target.open(
        "closbox bench",
        "a collective over one rank sends nothing through the fabric",
    )?;
    let (topo, ranks) = topology_of(&st, &sel)?;
    // Validated here, before any agent starts, by the agents' own rules.
    let spec = a
        .opts
        .spec(a.ops.clone(), st.time_scale)
        .map_err(|e| crate::usage(format!("{e:#}")))?;
    if spec.root >= sel.len() {
        return Err(crate::usage(format!(
            "--root {} is not one of the {} selected GPUs: it indexes --gpus (0 = {})",
            spec.root,
            sel.len(),
            st.gpus[sel[0]].name
        )));
    }
    enough_memory(
        closbox_agents::bench::memory_floor(&spec),
        sel.len(),
        &format!(
            "--sizes up to {}",
            crate::plan::approx_bytes(spec.sizes.iter().copied().max().unwrap_or(0) as u64)
        ),
    )?;
    // Predictions on the fabric as it is (links down or changed by `closbox link …`).
    let (topo, predictor) = predictor_now(&st, &topo, ranks, a.target.channels)?;
    let total = a.ops.len() * spec.sizes.len();
    // What the sweep should take on the wall clock, from the model (random paths).
    let runs = (spec.iters + spec.warmup) as f64;
    let expected: f64 = a
        .ops
        .iter()
        .flat_map(|&op| spec.sizes.iter().map(move |&size| (op, size)))
        .map(|(op, size)| {
            st.time_scale
                .wall_of(predictor.predict(op, spec.algo, size, spec.root) * runs)
        })
        .sum();
    // Beyond an hour, in units a reader takes in (slow links, huge sizes, high scales).
    let long = match expected {
        e if e >= 86_400.0 => format!(" ({:.1} days; --timeout bounds it)", e / 86_400.0),
        e if e >= 3_600.0 => format!(" ({:.1} hours; --timeout bounds it)", e / 3_600.0),
        _ => String::new(),
    };
    eprintln!(
        "# {} ({} × {}), {} each: about {:.0} s{long} of wall time by the model, plus start-up",
        plural(total, "result"),
        plural(a.ops.len(), "op"),
        plural(spec.sizes.len(), "size"),
        plural(spec.iters + spec.warmup, "run"),
        expected.ceil()
    );
    let ops: Vec<&str> = a.ops.iter().map(|o| o.name()).collect();
    let mut args = vec!["bench".to_owned(), "--ops".to_owned(), ops.join(",")];
    args.extend(a.opts.to_args());
    let format = if a.json {
        Format::Json
    } else if a.csv {
        Format::Csv
    } else {
        Format::Table
    };
    let sweep = Arc::new(Mutex::new(Sweep {
        predictor,
        topo: topo.clone(),
        ranks: sel.len(),
        algo: spec.algo,
        root: spec.root,
        format,
        fabric: st.fabric.to_string(),
        time_scale: st.time_scale,
        channels: a.target.channels,
        real_paths: None,
        rows: Vec::new(),
        predicted: Vec::new(),
        // Tables and CSV stream their rows; JSON comes at the end, so it gets a bar.
        progress: (format == Format::Json && std::io::stderr().is_terminal()).then(|| {
            let bar = indicatif::ProgressBar::new(total as u64);
            bar.set_style(
                indicatif::ProgressStyle::with_template("[{bar:30}] {pos}/{len} {msg}")
                    .expect("template"),
            );
            bar
        }),
    }));
    let streaming = Arc::clone(&sweep);
    // The lateness histogram as each result arrives: each result is judged on the box's
    // lateness while it was measured (a sweep's bulk sizes load the box more than its
    // small ones, whose timing lateness affects most).
    let snaps: Arc<Mutex<Vec<Buckets>>> = Arc::default();
    let snapping = Arc::clone(&snaps);
    let fabric = st.fabric.clone();
    let ran = run_agents(
        &st,
        &sel,
        "bench",
        &a.target,
        timeline.as_ref(),
        args,
        move |out, endpoints| {
            if let Output::Row(row) = out {
                let buckets = RunHealth::snapshot(&fabric)
                    .map(|s| s.lateness_buckets)
                    .unwrap_or_default();
                snapping.lock().expect("snapshots").push(buckets);
                streaming.lock().expect("sweep").add(row, endpoints);
            }
        },
    )?;
    let snaps = std::mem::take(&mut *snaps.lock().expect("snapshots"));
    let mut sweep = Arc::try_unwrap(sweep)
        .map_err(|_| anyhow::anyhow!("sweep still shared"))?
        .into_inner()
        .expect("sweep");
    if let Some(bar) = &sweep.progress {
        bar.finish();
    }
    if sweep.rows.len() != total {
        bail!(
            "the agents reported {} of {total} results",
            sweep.rows.len()
        );
    }
    // Paths are known for certain now (every rank's endpoints are in).
    let real_paths = sweep.predictor.use_paths(&topo, &ran.endpoints);
    if sweep.real_paths != Some(real_paths) && format != Format::Json {
        eprintln!("# (the first predictions were made before every rank had reported its paths)");
    }
    let (rows, predicted) = (sweep.rows, sweep.predicted);
    // Ring all-reduce passes 2(n − 1) messages one after another: the most of any op.
    let steps = 2 * sel.len().saturating_sub(1).max(1);
    let named: Vec<(String, f64)> = rows
        .iter()
        .map(|r| {
            (
                format!("{} {}", r.op.name(), render::human(r.size)),
                r.time_us,
            )
        })
        .collect();
    let (late_flags, late) = match &ran.health {
        Some(h) => h.late_rows(&named, &snaps, steps, sel.len()),
        None => (vec![false; rows.len()], None),
    };
    let tun_drops = ran.health.as_ref().is_some_and(|h| h.tun_drops > 0);
    if let Some(path) = &a.plot {
        let mut names: Vec<String> = Vec::new();
        for r in &rows {
            let n = format!("{} ({})", r.op.name(), r.algo);
            if !names.contains(&n) {
                names.push(n);
            }
        }
        let title = format!(
            "busbw on fabric {}, {}: {}",
            st.fabric,
            plural(sel.len(), "rank"),
            names.join(", ")
        );
        // The GPUs' NIC line rate: what one GPU can put into the scale-out fabric.
        let nic = sel
            .iter()
            .flat_map(|&i| {
                let v = closbox_fabric::topology::Vertex::Host(closbox_fabric::HostId(i as u32));
                topo.links
                    .iter()
                    .filter(move |l| {
                        (l.a == v || l.b == v)
                            && l.class == closbox_fabric::topology::LinkClass::Nic
                    })
                    .map(|l| l.params.rate)
            })
            .max();
        let label = nic.map(|r| format!("NIC line rate ({r} = {:.0} GB/s)", r.bps() as f64 / 8e9));
        let ceiling = nic
            .zip(label.as_deref())
            .map(|(r, l)| (r.bps() as f64 / 8e9, l));
        std::fs::write(path, render::plot(&rows, &predicted, &title, ceiling))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if a.json {
        let out: Vec<serde_json::Value> = rows
            .iter()
            .zip(&predicted)
            .map(|(r, p)| {
                let mut v = serde_json::to_value(r).expect("row");
                v["predicted_us"] = (*p).into();
                v["measured_over_predicted"] = render::ratio(r.time_us, *p).into();
                v["predicted_on"] = if real_paths {
                    "run_paths"
                } else {
                    "random_paths"
                }
                .into();
                v
            })
            .zip(&late_flags)
            .map(|(mut v, late)| {
                v["box_behind"] = (tun_drops || *late).into();
                v
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&out)?);
    }
    if let Some(h) = &ran.health {
        // Comments after a table; on stderr where stdout is JSON or CSV.
        let mut f = h.footer(late.as_ref());
        if h.tun_drops == 0 {
            let signals = (h.fabric_drops, h.ecn_marks);
            if let Some(note) =
                far_from_model_note(&named, &predicted, &late_flags, signals, h.shared.is_some())
            {
                f += &note;
            }
        }
        if a.json || a.csv {
            eprint!("{f}");
        } else {
            print!("{f}");
        }
    }
    let wrong: u64 = rows.iter().map(|r| r.wrong).sum();
    if wrong > 0 {
        bail!("{wrong} elements were wrong");
    }
    Ok(())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Format {
    Table,
    Csv,
    Json,
}

/// A sweep's results as they arrive: each row is predicted and (as a table or CSV)
/// printed at once.
struct Sweep {
    predictor: Predictor,
    topo: Topology,
    ranks: usize,
    algo: Algo,
    root: usize,
    format: Format,
    fabric: String,
    time_scale: TimeScale,
    channels: usize,
    /// Whether predictions use the run's own paths; decided at the first row.
    real_paths: Option<bool>,
    rows: Vec<Row>,
    predicted: Vec<f64>,
    progress: Option<indicatif::ProgressBar>,
}

impl Sweep {
    fn add(&mut self, row: Row, endpoints: &SharedEndpoints) {
        if self.real_paths.is_none() {
            // Every rank reports its endpoints before the first result, but on its own
            // pipe: give the other ranks' lines a moment to arrive.
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
            while endpoints.lock().expect("endpoints").len() < self.ranks
                && std::time::Instant::now() < deadline
            {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            let known = endpoints.lock().expect("endpoints").clone();
            let real = self.predictor.use_paths(&self.topo, &known);
            self.real_paths = Some(real);
            match self.format {
                Format::Table => print!(
                    "{}",
                    render::table_header(
                        &self.fabric,
                        self.time_scale,
                        row.ranks,
                        self.channels,
                        real
                    )
                ),
                Format::Csv => println!("{}", render::CSV_HEADER),
                Format::Json => {}
            }
        }
        let p = self.predictor.predict(
            row.op,
            Algo::from_name(&row.algo).unwrap_or(self.algo),
            row.size,
            self.root,
        ) * 1e6;
        match self.format {
            Format::Table => {
                if self.rows.last().map(|r| r.op) != Some(row.op) {
                    println!("# {}", row.op.name());
                }
                println!("{}", render::table_row(&row, p));
            }
            Format::Csv => println!("{}", render::csv_row(&row, p)),
            Format::Json => {}
        }
        let _ = std::io::Write::flush(&mut std::io::stdout());
        if let Some(bar) = &self.progress {
            bar.set_message(format!("{} {}", row.op.name(), render::human(row.size)));
            bar.inc(1);
        }
        self.rows.push(row);
        self.predicted.push(p);
    }
}

pub fn train(a: TrainArgs) -> anyhow::Result<()> {
    let (st, sel, timeline) = a.target.open(
        "closbox train",
        "data-parallel training needs 2 GPUs or more (one GPU has no gradients to exchange)",
    )?;
    let (topo, ranks) = topology_of(&st, &sel)?;
    enough_memory(
        closbox_agents::train::memory_floor(a.model_bytes, a.bucket_bytes),
        sel.len(),
        &format!(
            "--model {}",
            crate::plan::approx_bytes(a.model_bytes as u64)
        ),
    )?;
    let (topo, mut predictor) = predictor_now(&st, &topo, ranks, a.target.channels)?;
    let buckets = bucket_sizes(a.model_bytes, a.bucket_bytes);
    let compute_ms = a.compute_ms.unwrap_or_else(|| {
        bucket_times_ms(&mut predictor, a.algo, &buckets)
            .iter()
            .sum()
    });
    let args: Vec<String> = [
        "train",
        "--model-bytes",
        &a.model_bytes.to_string(),
        "--bucket-bytes",
        &a.bucket_bytes.to_string(),
        "--compute-ms",
        &compute_ms.to_string(),
        "--steps",
        &a.steps.to_string(),
        "--overlap",
        "both",
        "--algo",
        a.algo.name(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let reports: Arc<Mutex<Vec<Report>>> = Arc::default();
    let collected = Arc::clone(&reports);
    let ran = run_agents(
        &st,
        &sel,
        "train",
        &a.target,
        timeline.as_ref(),
        args,
        move |out, _| {
            if let Output::Report(r) = out {
                collected.lock().expect("reports").push(r);
            }
        },
    )?;
    predictor.use_paths(&topo, &ran.endpoints);
    let reports = reports.lock().expect("reports").clone();
    if reports.len() != 2 {
        bail!("the agents reported {} of 2 training modes", reports.len());
    }
    // Each bucket's ring all-reduce passes 2(n − 1) messages one after another.
    let steps = buckets.len() * 2 * sel.len().saturating_sub(1).max(1);
    let shortest = reports
        .iter()
        .map(|r| r.step_ms * 1e3)
        .fold(f64::MAX, f64::min);
    let late = ran
        .health
        .as_ref()
        .and_then(|h| h.late_whole(shortest, steps, sel.len()));
    let behind = late.is_some() || ran.health.as_ref().is_some_and(|h| h.tun_drops > 0);
    let comm = bucket_times_ms(&mut predictor, a.algo, &buckets);
    let predicted: Vec<f64> = reports
        .iter()
        .map(|r| predict_step(compute_ms, &comm, r.overlap))
        .collect();
    if a.json {
        let out: Vec<serde_json::Value> = reports
            .iter()
            .zip(&predicted)
            .map(|(r, p)| {
                let mut v = serde_json::to_value(r).expect("report");
                v["predicted_step_ms"] = (*p).into();
                v["box_behind"] = behind.into();
                v
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&out)?);
        if let Some(h) = &ran.health {
            eprint!("{}", h.footer(late.as_ref()));
        }
        return Ok(());
    }
    println!(
        "# closbox train: fabric {}, {}, {} of gradients in {} of {}, {:.2} ms compute per step (fabric time)",
        st.fabric,
        plural(reports[0].ranks, "rank"),
        render::human(a.model_bytes),
        plural(reports[0].buckets, "bucket"),
        render::human(a.bucket_bytes),
        compute_ms
    );
    println!(
        "# {:<12} {:>10} {:>12} {:>14} {:>10} {:>11} {:>15}",
        "mode",
        "step (ms)",
        "compute (ms)",
        "exposed comm",
        "comm (ms)",
        "efficiency",
        "predicted step"
    );
    for (r, p) in reports.iter().zip(&predicted) {
        println!(
            "  {:<12} {:>10.1} {:>12.1} {:>14.1} {:>10.1} {:>10.1}% {:>15.1}",
            if r.overlap { "overlapped" } else { "after bwd" },
            r.step_ms,
            r.compute_ms,
            r.exposed_comm_ms,
            r.comm_ms,
            r.efficiency * 100.0,
            p
        );
    }
    let (off, on) = (&reports[0], &reports[1]);
    println!(
        "# overlap hides {:.1} ms of {:.1} ms exposed communication per step ({:.0}% → {:.0}% scaling efficiency)",
        (off.exposed_comm_ms - on.exposed_comm_ms).max(0.0),
        off.exposed_comm_ms,
        off.efficiency * 100.0,
        on.efficiency * 100.0
    );
    if let Some(h) = &ran.health {
        print!("{}", h.footer(late.as_ref()));
    }
    Ok(())
}

/// A model's gradients split into buckets as the agents split them (f32 elements; sizes
/// are checked to be whole elements), in bytes.
fn bucket_sizes(model: usize, bucket: usize) -> Vec<usize> {
    const F32: usize = 4;
    schedule::buckets(model / F32, bucket / F32)
        .into_iter()
        .map(|b| b * F32)
        .collect()
}

/// Each bucket's predicted all-reduce time (ms), one prediction per distinct size: the
/// buckets are all of one size but the last, and there can be millions of them.
fn bucket_times_ms(predictor: &mut Predictor, algo: Algo, buckets: &[usize]) -> Vec<f64> {
    let mut known: Vec<(usize, f64)> = Vec::new();
    buckets
        .iter()
        .map(|&b| match known.iter().find(|(size, _)| *size == b) {
            Some(&(_, ms)) => ms,
            None => {
                let ms = predictor.predict(Op::AllReduce, algo, b, 0) * 1e3;
                known.push((b, ms));
                ms
            }
        })
        .collect()
}

/// "1 bucket", "3 buckets".
pub fn plural(n: usize, what: &str) -> String {
    if n == 1 {
        format!("1 {what}")
    } else {
        format!("{n} {what}s")
    }
}

/// For `--plot`: checks the file can be written before a long sweep.
pub fn check_plot_path(p: &Path) -> anyhow::Result<()> {
    let dir = p
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    if !dir.is_dir() {
        bail!(
            "--plot {}: directory {} does not exist",
            p.display(),
            dir.display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agents_wait_longer_on_dilated_fabrics_and_through_chaos() {
        use closbox_fabric::Duration as Fabric;
        let secs = |k: f64, span_ms: u64| {
            let k = TimeScale::new(k).unwrap();
            agent_timeout(k, Fabric::from_millis(span_ms)).as_secs_f64()
        };
        // Real time: the minute, and nothing noticeable beyond it.
        assert!((secs(1.0, 0) - 60.002).abs() < 1e-9);
        // `make demo`'s chaos step (a spine down from 1 to 31 ms) at time_scale 50,000:
        // 60 s + 2 × 32 ms × 50,000.
        assert!((secs(50_000.0, 31) - 3260.0).abs() < 1e-6);
        assert!((secs(2000.0, 0) - 64.0).abs() < 1e-9);
    }

    /// A run at scale `k` whose every write was `late_us` late (wall).
    fn health(k: f64, late_us: f64, tun_drops: u64) -> RunHealth {
        let mut h = Histogram::new();
        for _ in 0..10_000 {
            h.record((late_us * 1e3) as u64);
        }
        RunHealth {
            packets: 10_000,
            fabric_drops: 0,
            tun_drops,
            lateness: Lateness::of(&h),
            time_scale: TimeScale::new(k).unwrap(),
            other_drops: Vec::new(),
            changes: 0,
            changed_links: Vec::new(),
            events: Vec::new(),
            loads: Vec::new(),
            buckets_connected: Vec::new(),
            buckets_after: h.buckets(),
            pauses: None,
            deadlocked: Vec::new(),
            cpu: None,
            steal: 0.0,
            idle_poll_would_help: false,
            ecn_marks: 0,
            congestion: Some("reno".into()),
            shared: None,
        }
    }

    #[test]
    fn other_jobs_on_the_fabric_are_said_only_when_there_were_any() {
        let mut h = health(100.0, 1.0, 0);
        assert!(!h.footer(None).contains("shared"));
        let other = crate::jobs::JobInfo {
            kind: "run".into(),
            pid: 4242,
            gpus: "4-7".into(),
        };
        h.shared = crate::jobs::shared_with("ls16", &[other]);
        let f = h.footer(None);
        assert!(
            f.contains("# shared: another job on fabric ls16 ran during this one: run (pid 4242, GPUs 4-7); the counts above are the fabric's (its traffic too), and the predictions assume this job alone"),
            "{f}"
        );
    }

    #[test]
    fn ecn_marks_during_a_run_are_said_only_when_there_are_any() {
        let mut h = health(100.0, 1.0, 0);
        assert!(!h.footer(None).contains("ECN"));
        h.ecn_marks = 3142;
        let f = h.footer(None);
        assert!(f.contains("# ECN: the fabric marked 3,142 packets"), "{f}");
        assert!(f.contains("(Reno halves its window)"), "{f}");
        h.congestion = Some("closbox_dctcp".into());
        let f = h.footer(None);
        assert!(
            f.contains("(DCTCP cuts its window by half its running estimate of the share marked)"),
            "{f}"
        );
    }

    #[test]
    fn a_late_run_names_the_time_scale_that_would_have_held_it() {
        // 14 steps × 778 µs of wall lateness at k = 100 is 109 µs of fabric time on a
        // 180 µs operation: 5 % of it needs k ≥ 1210, hence 2000 (1-2-5 steps).
        let h = health(100.0, 778.2, 0);
        let late = h.late_whole(180.3, 14, 8).expect("late");
        assert_eq!(late.holding, 2000.0);
        let f = h.footer(Some(&late));
        assert!(f.contains("time_scale 2000 would have held"), "{f}");
        // At 2000 the same wall lateness is within 5 %.
        assert!(health(2000.0, 778.2, 0).late_whole(180.3, 14, 8).is_none());
        // Kernel drops: no figure to offer, only the direction.
        let f = health(100.0, 1.0, 3).footer(None);
        assert!(f.contains("raise time_scale (the GPUs offered more"), "{f}");
        assert!(!f.contains("would have held"), "{f}");
        assert!(!health(100.0, 1.0, 0).footer(None).contains("WARNING"));
    }

    #[test]
    fn a_late_run_whose_data_plane_waited_for_a_cpu_is_pointed_to_realtime() {
        let mut h = health(100.0, 778.2, 0);
        let late = h.late_whole(180.3, 14, 8).expect("late");
        // 10 s of run, 6 s on a CPU and 250 ms waiting: not saturated, kept off its CPU.
        h.cpu = Some(CpuUse::over(10.0, 6_000_000_000, 250_000_000));
        let f = h.footer(Some(&late));
        assert!(
            f.contains("busy only 60 % of a CPU during the run but waited 250 ms"),
            "{f}"
        );
        assert!(
            f.contains(
                "`closbox up --realtime` keeps it on a CPU; or time_scale 2000 would have held"
            ),
            "{f}"
        );
        // Saturated: the time scale alone.
        h.cpu = Some(CpuUse::over(10.0, 9_800_000_000, 250_000_000));
        let f = h.footer(Some(&late));
        assert!(!f.contains("--realtime"), "{f}");
        assert!(f.contains("time_scale 2000 would have held"), "{f}");
        // The hypervisor took a fifth of the box: named instead of the scheduler.
        h.cpu = Some(CpuUse::over(10.0, 6_000_000_000, 250_000_000));
        h.steal = 0.2;
        let f = h.footer(Some(&late));
        assert!(
            f.contains("the hypervisor gave this machine's CPUs to others for 20 % of the run (steal time: its virtual CPUs stood still while the wall clock ran): run on a quieter host; or time_scale 2000 would have held"),
            "{f}"
        );
        assert!(!f.contains("--realtime"), "{f}");
        // Idle CPUs that halt, which `up --idle-poll` would have poll: said first.
        h.idle_poll_would_help = true;
        let f = h.footer(Some(&late));
        assert!(
            f.contains("wall clock ran): `closbox up --idle-poll` (its idle CPUs then poll instead of halting, and most of what a VM's host takes is the time to run a halted CPU again), run on a quieter host; or time_scale 2000"),
            "{f}"
        );
    }

    #[test]
    fn a_step_waits_for_the_latest_of_its_messages_not_for_the_worst_write() {
        // 95 % of writes on time, 5 % (one burst) 2 ms late, k = 1000, a 20 µs operation
        // of 14 steps: a step of one message expects the median (on time); a step of 8
        // the p89 (on time); a step of 99 messages the p99 (2 ms: 28 µs added, late).
        let mut hist = Histogram::new();
        for i in 0..10_000 {
            hist.record(if i % 20 == 0 { 2_000_000 } else { 1_000 });
        }
        let mut h = health(1000.0, 1.0, 0);
        h.buckets_after = hist.buckets();
        assert!(h.late_whole(20.0, 14, 1).is_none());
        assert!(h.late_whole(20.0, 14, 8).is_none());
        let late = h.late_whole(20.0, 14, 99).expect("late");
        assert!((late.added_us - 28.0).abs() < 0.5, "{}", late.added_us);
    }

    /// Cumulative lateness histograms after each of `windows` (each: samples of one value).
    fn snapshots(windows: &[(u64, u64)]) -> Vec<Vec<(u64, u64)>> {
        let mut h = Histogram::new();
        windows
            .iter()
            .map(|&(ns, n)| {
                for _ in 0..n {
                    h.record(ns);
                }
                h.buckets()
            })
            .collect()
    }

    #[test]
    fn results_far_from_the_model_on_time_get_a_note_naming_them() {
        let named: Vec<(String, f64)> = [
            ("allgather 1KiB", 1129.5),
            ("allgather 64KiB", 1160.8),
            ("allgather 1MiB", 500.0),
        ]
        .iter()
        .map(|&(n, us)| (n.to_owned(), us))
        .collect();
        // 2 × and more, on time: named; late ones are the warning's; near the model, none.
        let predicted = [25.2, 299.0, 480.0];
        let note = far_from_model_note(&named, &predicted, &[false, false, false], (0, 0), false)
            .expect("a note");
        assert!(
            note.starts_with("# NOTE: 2 of 3 results took 2 × the model's time or more while the fabric kept its schedule (allgather 1KiB 44.8 ×, allgather 64KiB 3.9 ×): the difference is at the endpoints"),
            "{note}"
        );
        // Drops or marks during the run: TCP's backing off is named first.
        let note = far_from_model_note(
            &named,
            &predicted,
            &[false, false, false],
            (314, 56_532),
            false,
        )
        .expect("a note");
        assert!(
            note.contains(
                "3.9 ×): the fabric dropped 314 and ECN-marked 56,532 packets during the run"
            ),
            "{note}"
        );
        // Another job on the fabric meanwhile: named as the likelier cause.
        let note = far_from_model_note(&named, &predicted, &[false, false, false], (314, 0), true)
            .expect("a note");
        assert!(
            note.contains(
                "3.9 ×): another job ran on the fabric during the run (`# shared` above)"
            ),
            "{note}"
        );
        let none = far_from_model_note(&named, &predicted, &[true, true, false], (0, 0), false);
        assert_eq!(none, None);
        // No prediction (one rank): nothing to compare.
        assert_eq!(
            far_from_model_note(&named[..1], &[0.0], &[false], (0, 0), false),
            None
        );
    }

    #[test]
    fn each_result_is_judged_on_the_lateness_while_it_ran() {
        // k = 1000, 14 steps: 5 % of a 20 µs operation is 1 µs of fabric time, so the
        // step lateness may reach 71 µs of wall time. The small sizes ran while lateness
        // was 20 µs, the bulk ones at 2 ms (but they last 10 ms).
        let snaps = snapshots(&[(20_000, 500), (20_000, 500), (2_000_000, 500)]);
        let mut h = health(1000.0, 2000.0, 0);
        h.buckets_after = snaps[2].clone();
        let rows = vec![
            ("allreduce 64KiB".to_owned(), 20.0),
            ("allreduce 128KiB".to_owned(), 22.0),
            ("allreduce 32MiB".to_owned(), 10_000.0),
        ];
        let (flags, late) = h.late_rows(&rows, &snaps, 14, 8);
        assert_eq!(flags, [false, false, false]);
        assert!(late.is_none());
        // Judged on the whole run, the small ones would have been flagged.
        assert!(h.late_whole(20.0, 14, 8).is_some());
        // The same small sizes while lateness was 200 µs: flagged, by name.
        let snaps = snapshots(&[(200_000, 500), (20_000, 500), (2_000_000, 500)]);
        h.buckets_after = snaps[2].clone();
        let (flags, late) = h.late_rows(&rows, &snaps, 14, 8);
        assert_eq!(flags, [true, false, false]);
        let late = late.expect("late");
        assert!(
            late.what.contains("1 of 3 results: allreduce 64KiB"),
            "{}",
            late.what
        );
        // 14 × 200 µs / 1000 = 2.8 µs on 20 µs: 5 % needs k ≥ 2800, hence 5000.
        assert_eq!(late.holding, 5000.0);
        // A window with too few writes borrows its neighbours'.
        let snaps = snapshots(&[(200_000, 4), (20_000, 500), (2_000_000, 500)]);
        h.buckets_after = snaps[2].clone();
        let (flags, _) = h.late_rows(&rows, &snaps, 14, 8);
        assert_eq!(flags, [false, false, false]);
    }
}
