//! `closbox link|switch|gpu|partition|load|incast …`, `closbox chaos FILE` and
//! `closbox events`: changes to a live fabric through its daemon, timelines of them, and
//! the log of what changed when.

use std::path::Path;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::time::{Duration as StdDuration, Instant as StdInstant};

use anyhow::{bail, Context};
use closbox_fabric::Topology;
use closbox_switchd::chaos::{ChaosEnd, ChaosRun, Counts, Meanwhile};
use closbox_switchd::control::{self, ChangeRequest, Event, Reply, Request};
use closbox_switchd::scenario::{self, Scenario};
use closbox_switchd::state::{FabricName, State};

use crate::live;

/// Asks the daemon of the fabric for `req`; prints what it applied.
pub fn change(fabric: Option<&FabricName>, req: ChangeRequest) -> anyhow::Result<ExitCode> {
    let what = match &req {
        ChangeRequest::SwitchDown { .. } | ChangeRequest::SwitchUp { .. } => "closbox switch",
        ChangeRequest::SwitchFlap { gpu: false, .. } => "closbox switch",
        ChangeRequest::GpuDown { .. } | ChangeRequest::GpuUp { .. } => "closbox gpu",
        ChangeRequest::SwitchFlap { gpu: true, .. } => "closbox gpu",
        ChangeRequest::Partition { .. } => "closbox partition",
        ChangeRequest::Heal => "closbox heal",
        ChangeRequest::Reset => "closbox reset",
        ChangeRequest::Load { .. } | ChangeRequest::LoadStop { .. } => "closbox load",
        ChangeRequest::Incast { .. } => "closbox incast",
        ChangeRequest::LinkDown { .. }
        | ChangeRequest::LinkUp { .. }
        | ChangeRequest::LinkSet { .. }
        | ChangeRequest::LinkReset { .. }
        | ChangeRequest::LinkFlap { .. } => "closbox link",
    };
    closbox_switchd::require_root(what)?;
    let st = live::resolve(fabric)?;
    match control::request(&st.fabric, &Request::Change(req))? {
        Reply::Changed { events } => {
            for e in &events {
                println!("{}", line(e));
            }
            Ok(ExitCode::SUCCESS)
        }
        // Names and values are checked by the daemon against the fabric: bad arguments.
        Reply::Error { message } => Err(crate::usage(message)),
        other => bail!("unexpected reply from the daemon: {other:?}"),
    }
}

/// `closbox partition SEL…`: selections resolved against the fabric, sent as names.
pub fn partition(fabric: Option<&FabricName>, sels: &[String]) -> anyhow::Result<ExitCode> {
    closbox_switchd::require_root("closbox partition")?;
    let st = live::resolve(fabric)?;
    let groups = sels
        .iter()
        .map(|sel| {
            Ok(live::select(&st, sel)?
                .into_iter()
                .map(|i| st.gpus[i].name.clone())
                .collect())
        })
        .collect::<anyhow::Result<Vec<Vec<String>>>>()?;
    change(Some(&st.fabric), ChangeRequest::Partition { groups })
}

/// `closbox cancel [TIMELINE]`: ends a timeline (or every one) as a job's end does.
pub fn cancel(fabric: Option<&FabricName>, timeline: Option<u64>) -> anyhow::Result<ExitCode> {
    closbox_switchd::require_root("closbox cancel")?;
    let st = live::resolve(fabric)?;
    match control::request(&st.fabric, &Request::Cancel { timeline })? {
        Reply::Cancelled { changes, repaired } => {
            let which = timeline.map_or("every timeline".to_owned(), |t| format!("timeline {t}"));
            if changes == 0 && repaired.is_empty() {
                if let Some(t) = timeline {
                    return left_behind(&st.fabric, t);
                }
                println!("{which}: nothing pending or running (`closbox status` lists what is)");
            } else {
                println!(
                    "{which}: {} dropped{}",
                    crate::bench::plural(changes, "pending change"),
                    if repaired.is_empty() { "" } else { "; now:" }
                );
            }
            for e in &repaired {
                println!("{}", line(e));
            }
            Ok(ExitCode::SUCCESS)
        }
        Reply::Error { message } => bail!("{message}"),
        other => bail!("unexpected reply from the daemon: {other:?}"),
    }
}

/// Timeline `t` had nothing to cancel: says so, and what it left broken for good and
/// what undoes it, or that there is no such timeline (a usage error, exit 2).
fn left_behind(fabric: &FabricName, t: u64) -> anyhow::Result<ExitCode> {
    let Reply::Status(s) = control::request(fabric, &Request::Status { tcp: false })? else {
        bail!("the daemon did not answer a status request");
    };
    if t > s.timelines_started {
        return Err(crate::usage(match s.timelines_started {
            0 => format!("no timeline {t}: no scenario was started on fabric {fabric}"),
            n => format!(
                "no timeline {t}: {} started on fabric {fabric} (`closbox status` lists those running)",
                if n == 1 { "timeline 1 was".to_owned() } else { format!("timelines 1 to {n} were") }
            ),
        }));
    }
    if t == 0 {
        // (What is held by timeline 0 is held by hand, not by the flaps.)
        println!("the flaps: nothing pending (`closbox status` lists what is)");
        return Ok(ExitCode::SUCCESS);
    }
    println!("timeline {t}: nothing pending or running (`closbox status` lists what is)");
    let down = s
        .changed_links
        .iter()
        .filter(|l| l.down_by.contains(&t))
        .count();
    let degraded = s
        .changed_links
        .iter()
        .filter(|l| l.degraded_by.contains(&t))
        .count();
    let mut held = Vec::new();
    if down > 0 {
        held.push(format!("{} down", crate::bench::plural(down, "link")));
    }
    if degraded > 0 {
        held.push(format!(
            "{} degraded",
            crate::bench::plural(degraded, "link")
        ));
    }
    if !held.is_empty() {
        println!(
            "timeline {t} ended and left {}: a later scenario's repair of them, `closbox link up|reset` or `closbox reset` undoes it",
            held.join(" and ")
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Whether timeline `id` has changes pending or loads running.
fn running(fabric: &FabricName, id: u64) -> anyhow::Result<bool> {
    match control::request(fabric, &Request::Status { tcp: false })? {
        Reply::Status(s) => Ok(s.timelines.iter().any(|t| t.id == id)),
        Reply::Error { message } => bail!("{message}"),
        other => bail!("unexpected reply from the daemon: {other:?}"),
    }
}

/// An event as `events` prints it: a line, or a JSON line.
fn print_event(e: &Event, json: bool) {
    if json {
        match serde_json::to_string(e) {
            Ok(j) => println!("{j}"),
            Err(err) => eprintln!("closbox: {err}"),
        }
    } else {
        println!("{}", line(e));
    }
}

fn counts(fabric: &FabricName) -> anyhow::Result<Counts> {
    match control::request(fabric, &Request::Status { tcp: false })? {
        Reply::Status(s) => Ok(Counts::of(&s)),
        Reply::Error { message } => bail!("{message}"),
        other => bail!("unexpected reply from the daemon: {other:?}"),
    }
}

/// What the fabric did while a scenario ran, for people: "the fabric delivered 1,100
/// packets and dropped 104 (8.6 %): link_down 98, no_route 6; ECN-marked 40".
fn meanwhile_text(m: &Meanwhile) -> String {
    use crate::plan::thousands;
    let mut out = format!(
        "the fabric delivered {} packets and ",
        thousands(m.delivered)
    );
    if m.dropped == 0 {
        out += "dropped none";
    } else {
        let each: Vec<String> = m
            .drops
            .iter()
            .map(|(r, n)| format!("{r} {}", thousands(*n)))
            .collect();
        let share = 100.0 * m.dropped as f64 / (m.dropped + m.delivered) as f64;
        out += &format!(
            "dropped {} ({}): {}",
            thousands(m.dropped),
            percent(share),
            each.join(", ")
        );
    }
    if m.ecn_marked > 0 {
        out += &format!("; ECN-marked {}", thousands(m.ecn_marked));
    }
    match m.changed_links {
        0 => {}
        1 => out += "; 1 link is still changed (`closbox status`)",
        n => out += &format!("; {n} links are still changed (`closbox status`)"),
    }
    out
}

/// A change's fabric time after its timeline's start, as a job's reader counts it:
/// "+0.000 ms", "+300.000 ms", "+2.500000 s".
fn offset(ns: u64) -> String {
    if ns < 1_000_000_000 {
        format!("+{:.3} ms", ns as f64 / 1e6)
    } else {
        format!("+{:.6} s", ns as f64 / 1e9)
    }
}

/// "8.6 %", "0.004 %": a share with two significant digits or so.
fn percent(p: f64) -> String {
    match p {
        p if p >= 10.0 => format!("{p:.0} %"),
        p if p >= 1.0 => format!("{p:.1} %"),
        p if p >= 0.1 => format!("{p:.2} %"),
        p => format!("{p:.3} %"),
    }
}

/// The events with a number above `after`.
fn events_after(fabric: &FabricName, after: u64) -> anyhow::Result<Vec<Event>> {
    match control::request(fabric, &Request::Events { after })? {
        Reply::Events { events } => Ok(events),
        Reply::Error { message } => bail!("{message}"),
        other => bail!("unexpected reply from the daemon: {other:?}"),
    }
}

/// Why a fabric's daemon stopped answering one that follows it.
enum Gone {
    /// Taken down (`down`, Ctrl-C of its `up`), or down and up again since.
    Down,
    /// Its daemon ended without taking the fabric down (killed, crashed).
    Died,
    /// Neither: it is still up, and the error is the answer.
    No,
}

/// Why the daemon `was` stopped answering; a stopping daemon gets up to 2 s to say so
/// (it stops serving before its state says "stopping").
fn why_gone(was: &State) -> Gone {
    use closbox_switchd::state::Phase;
    let deadline = StdInstant::now() + StdDuration::from_secs(2);
    loop {
        match State::load(&was.fabric).ok().flatten() {
            None => return Gone::Down,
            Some(s) if (s.daemon_pid, s.daemon_start) != (was.daemon_pid, was.daemon_start) => {
                return Gone::Down
            }
            Some(s) if s.phase == Phase::Stopping => return Gone::Down,
            Some(s) if !s.daemon_alive() => return Gone::Died,
            Some(_) if StdInstant::now() > deadline => return Gone::No,
            Some(_) => std::thread::sleep(StdDuration::from_millis(20)),
        }
    }
}

/// What a follower says when the daemon stopped answering with `err`: `Ok` when the
/// fabric went down (`while` says during what), an error otherwise.
fn gone(was: &State, err: anyhow::Error, while_: &str) -> anyhow::Result<()> {
    match why_gone(was) {
        Gone::Down => {
            eprintln!("closbox: fabric {} went down{while_}", was.fabric);
            Ok(())
        }
        Gone::Died => bail!(
            "the daemon of fabric {} (pid {}) ended without taking the fabric down{while_}: `closbox down {}` removes what it left",
            was.fabric,
            was.daemon_pid,
            was.fabric
        ),
        Gone::No => Err(err),
    }
}

pub fn events(fabric: Option<&FabricName>, json: bool, follow: bool) -> anyhow::Result<ExitCode> {
    closbox_switchd::require_root("closbox events")?;
    let st = live::resolve(fabric)?;
    if follow {
        // New events as they come, one per line (JSON lines with --json), until
        // interrupted or the fabric goes away.
        let stop = closbox_switchd::stop_on_signals()?;
        let mut last = 0;
        while !stop.load(Ordering::Relaxed) {
            // A fabric taken down ends what follows it, as it ends a capture.
            let new = match events_after(&st.fabric, last) {
                Ok(new) => new,
                Err(e) => return gone(&st, e, "").map(|()| ExitCode::SUCCESS),
            };
            for e in &new {
                if json {
                    println!("{}", serde_json::to_string(e)?);
                } else {
                    println!("{}", tagged_line(e));
                }
                last = last.max(e.seq);
            }
            std::thread::sleep(StdDuration::from_millis(100));
        }
        return Ok(ExitCode::SUCCESS);
    }
    match control::request(&st.fabric, &Request::Events { after: 0 })? {
        Reply::Events { events } => {
            if json {
                println!("{}", serde_json::to_string_pretty(&events)?);
            } else if events.is_empty() {
                println!("fabric {}: no changes since it came up", st.fabric);
            } else {
                for e in &events {
                    println!("{}", tagged_line(e));
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Reply::Error { message } => bail!("{message}"),
        other => bail!("unexpected reply from the daemon: {other:?}"),
    }
}

/// `line`, with the scenario's timeline an event belongs to (`closbox events` lists every
/// scenario's and the changes by hand together): "… UTC)  [timeline 2] link … down".
fn tagged_line(e: &Event) -> String {
    match e.timeline {
        Some(t) => {
            let tagged = Event {
                what: format!("[timeline {t}] {}", e.what),
                ..e.clone()
            };
            line(&tagged)
        }
        None => line(e),
    }
}

/// "fabric time 1.234567 s  (wall 12:34:56.789)  link leaf0-spine0 #0 down".
pub fn line(e: &Event) -> String {
    let ms = e.wall_ms % 86_400_000;
    format!(
        "fabric time {:.6} s  (wall {:02}:{:02}:{:02}.{:03} UTC)  {}",
        e.fabric_ns as f64 / 1e9,
        ms / 3_600_000,
        ms / 60_000 % 60,
        ms / 1000 % 60,
        ms % 1000,
        e.what
    )
}

/// `closbox load FROM TO --rate R …` and `closbox load --stop [ID]`.
pub fn load(fabric: Option<&FabricName>, req: ChangeRequest) -> anyhow::Result<ExitCode> {
    change(fabric, req)
}

/// `closbox incast GPU --from SEL …`: the selection resolved against the fabric.
pub fn incast(
    fabric: Option<&FabricName>,
    to: String,
    from: &str,
    bytes: u64,
    every_ns: Option<u64>,
    count: u32,
) -> anyhow::Result<ExitCode> {
    closbox_switchd::require_root("closbox incast")?;
    let st = live::resolve(fabric)?;
    let from = live::select(&st, from)?
        .into_iter()
        .map(|i| st.gpus[i].name.clone())
        .collect();
    change(
        Some(&st.fabric),
        ChangeRequest::Incast {
            to,
            from,
            bytes,
            every_ns,
            count,
        },
    )
}

/// A scenario file checked against a live fabric, to run as a timeline.
pub struct Timeline {
    fabric: FabricName,
    file: String,
    scenario: Scenario,
    time_scale: closbox_fabric::TimeScale,
    /// Events as JSON lines on stdout (`closbox chaos --json`), not "# chaos:" lines.
    json: bool,
    /// Its events said as they happen (`follow`) and what the fabric did meanwhile said
    /// at its end (`run --chaos`, `mpirun --chaos`: the job's output, interleaved); off,
    /// the caller reports (`bench` and `train` in their footers).
    pub live: bool,
    /// `closbox chaos` in text: its events on stdout, each with its time into it.
    follower: bool,
    /// The GPUs whose packets start it, for a scenario with `start = "first-packet"` or
    /// `"every-gpu"` (names; `load`: every GPU of the fabric, a job's callers its own).
    pub gpus: Vec<String>,
}

/// A timeline the daemon is running.
pub struct Started {
    id: u64,
    at: StdInstant,
    /// The last event it printed (at first: what it applied at once).
    seen: u64,
    /// The fabric's counters when it started (`live`).
    counts: Option<Counts>,
    /// Its start, in fabric ns since up (none while it waits for the GPUs' packets, until
    /// its "started" event is seen).
    start_ns: Option<u64>,
}

impl Started {
    /// The timeline's id in the daemon (`closbox cancel --timeline`).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Whether event `e` is this timeline's: one of its changes, or what ended it early
    /// (its cancel, the repairs the cancel made, a reset).
    fn owns(&self, e: &Event) -> bool {
        e.timeline == Some(self.id) || closbox_switchd::dataplane::ends_early(&e.what, self.id)
    }

    /// Takes its start from event `e` of it, if `e` is what started it (the GPUs'
    /// packets, for a scenario that waited for them); whether it was.
    fn saw(&mut self, e: &Event) -> bool {
        let starts = self.start_ns.is_none()
            && e.timeline == Some(self.id)
            && closbox_switchd::dataplane::starts(&e.what, self.id);
        if starts {
            self.start_ns = Some(e.fabric_ns);
        }
        starts
    }
}

impl Timeline {
    /// Reads `file` and checks it against the fabric's topology: a bad file is a usage
    /// error (exit 2) before anything runs. `start` replaces the file's (`--chaos-start`).
    pub fn load(
        st: &State,
        file: &Path,
        start: Option<scenario::Start>,
    ) -> anyhow::Result<Timeline> {
        let topo = fabric_topology(st)?;
        let mut scenario = scenario::load(file, &topo).map_err(|e| crate::usage(e.to_string()))?;
        if let Some(start) = start {
            scenario.start = start;
        }
        Ok(Timeline {
            fabric: st.fabric.clone(),
            file: file.display().to_string(),
            scenario,
            time_scale: st.time_scale,
            json: false,
            live: false,
            follower: false,
            gpus: st.gpus.iter().map(|g| g.name.clone()).collect(),
        })
    }

    /// Prints an event of the timeline: a JSON line on stdout, or a "# chaos:" line.
    /// `start_ns`: the timeline's start, whose offset a job's reader is told (`live`;
    /// none before it started).
    fn say(&self, e: &Event, start_ns: Option<u64>) {
        if self.json {
            print_event(e, true);
            return;
        }
        let at = match start_ns {
            Some(s) if self.live || self.follower => {
                format!("{}  ", offset(e.fabric_ns.saturating_sub(s)))
            }
            _ => String::new(),
        };
        if self.follower {
            println!("{at}{}", line(e));
        } else {
            eprintln!("# chaos: {at}{}", line(e));
        }
    }

    /// Fabric time from start to the last change.
    pub fn span(&self) -> closbox_fabric::Duration {
        closbox_fabric::Duration::from_nanos(self.scenario.end_ns)
    }

    /// Hands the timeline to the daemon: its time 0 is now.
    pub fn start(&self) -> anyhow::Result<Started> {
        let counts = if self.live {
            Some(counts(&self.fabric)?)
        } else {
            None
        };
        let req = Request::Schedule {
            items: self.scenario.items.clone(),
            faults: self.scenario.faults.clone(),
            start: self.scenario.start.trigger(self.gpus.clone()),
        };
        match control::request(&self.fabric, &req)? {
            Reply::Scheduled {
                timeline,
                events,
                start_ns,
            } => {
                let n = self.scenario.items.len();
                let changes = format!("{n} change{}", if n == 1 { "" } else { "s" });
                let when = match self.span().as_nanos() {
                    0 => "at its start".to_owned(),
                    _ => format!(
                        "over {} of fabric time",
                        closbox_fabric::units::approx_duration(self.span())
                    ),
                };
                match start_ns {
                    Some(ns) => eprintln!(
                        "# chaos: {} started at fabric time {:.6} s: {changes} {when} (timeline {timeline})",
                        self.file,
                        ns as f64 / 1e9
                    ),
                    None => eprintln!(
                        "# chaos: {} armed (start = \"{}\"): {changes} {when} from its start (timeline {timeline})",
                        self.file,
                        self.scenario.start.name()
                    ),
                }
                for e in &events {
                    self.say(e, start_ns);
                }
                Ok(Started {
                    id: timeline,
                    at: StdInstant::now(),
                    seen: events.iter().map(|e| e.seq).max().unwrap_or(0),
                    counts,
                    start_ns,
                })
            }
            // Refused by the daemon as a whole (loads beyond its budget together, too
            // many changes pending): bad input, as the same refusal of `closbox load` is.
            Reply::Error { message } => Err(crate::usage(format!("{}: {message}", self.file))),
            other => bail!("unexpected reply from the daemon: {other:?}"),
        }
    }

    /// Says the timeline's events since the last said (`live`; a daemon that does not
    /// answer is for the job's end to report).
    pub fn follow(&self, started: &mut Started) {
        if !self.live {
            return;
        }
        let Ok(new) = events_after(&self.fabric, started.seen) else {
            return;
        };
        for e in &new {
            if started.owns(e) {
                started.saw(e);
                self.say(e, started.start_ns);
            }
            started.seen = started.seen.max(e.seq);
        }
    }

    /// The job is over (`why`: "the job ended", "interrupted"): what of the timeline is
    /// still pending is dropped but for its repairs, and said so; `live`, with its last
    /// events and what the fabric did meanwhile.
    pub fn finish(&self, started: &mut Started, why: &str) {
        self.follow(started);
        let mut said = Vec::new();
        let cancelled = control::request(
            &self.fabric,
            &Request::Cancel {
                timeline: Some(started.id),
            },
        );
        // What it did between the last look and the cancel, said below (after the cancel
        // and its repairs): first, whether it had started by then.
        let new = events_after(&self.fabric, started.seen).unwrap_or_default();
        for e in &new {
            started.saw(e);
        }
        match cancelled {
            // (Its changes counted as its first line counted them: the file's.)
            Ok(Reply::Cancelled { .. }) if started.start_ns.is_none() => {
                let waited = match self.scenario.start {
                    scenario::Start::EveryGpu => "not every GPU it waited for sent a packet",
                    _ => "no GPU it waited for sent a packet",
                };
                eprintln!(
                    "# chaos: {why} before {} started (start = \"{}\": {waited}): cancelled, its {} dropped",
                    self.file,
                    self.scenario.start.name(),
                    crate::bench::plural(self.scenario.items.len(), "change")
                );
            }
            Ok(Reply::Cancelled { changes, repaired }) if changes > 0 || !repaired.is_empty() => {
                let what = match changes {
                    0 => format!(": {} cancelled", self.file),
                    // The daemon's steps (a flap is one change of the file, and a step
                    // per transition), as its cancel event counts them.
                    n => format!(
                        " with {n} step{} of {} pending: cancelled",
                        if n == 1 { "" } else { "s" },
                        self.file
                    ),
                };
                eprintln!(
                    "# chaos: {why}{what}; {}",
                    if repaired.is_empty() {
                        "nothing it broke was waiting for a repair, no load of it runs"
                    } else {
                        "repaired or stopped at once:"
                    }
                );
                for e in &repaired {
                    self.say(e, started.start_ns);
                    said.push(e.seq);
                }
            }
            Ok(_) => {}
            Err(e) => eprintln!("# chaos: could not cancel the rest of {}: {e:#}", self.file),
        }
        if !self.live {
            return;
        }
        for e in new.iter().filter(|e| !said.contains(&e.seq)) {
            if e.timeline == Some(started.id)
                && !closbox_switchd::dataplane::ends_early(&e.what, started.id)
            {
                self.say(e, started.start_ns);
            }
        }
        if let (Some(before), Ok(after)) = (&started.counts, counts(&self.fabric)) {
            eprintln!(
                "# chaos: {} during the job: {}",
                self.file,
                meanwhile_text(&Meanwhile::between(before, &after))
            );
        }
    }
}

/// The topology of a live fabric (from the file it came up with).
pub fn fabric_topology(st: &State) -> anyhow::Result<Topology> {
    closbox_fabric::load(&st.config).with_context(|| {
        format!(
            "reading the topology of fabric {} ({})",
            st.fabric,
            st.config.display()
        )
    })
}

/// `closbox chaos FILE`'s arguments.
pub struct ScenarioArgs<'a> {
    pub fabric: Option<&'a FabricName>,
    pub file: &'a Path,
    /// Print the timeline without running it (against `topology`, or the live fabric).
    pub dry_run: bool,
    pub topology: Option<&'a Path>,
    /// Return once it is scheduled.
    pub detach: bool,
    pub json: bool,
    /// The GPUs whose packets start a scenario that waits for them (default: all).
    pub gpus: Option<&'a str>,
    /// Its time 0, instead of the file's `start`.
    pub start: Option<scenario::Start>,
}

/// `closbox chaos FILE`: runs a scenario on a live fabric and prints its events as they
/// happen (Ctrl-C cancels the rest); `--detach` returns once it is scheduled; `--dry-run`
/// prints the timeline without running it (against `--topology`, or the live fabric).
pub fn scenario_cmd(a: ScenarioArgs) -> anyhow::Result<ExitCode> {
    let (fabric, file, json, detach) = (a.fabric, a.file, a.json, a.detach);
    if a.dry_run {
        let topo = match a.topology {
            Some(t) => closbox_fabric::load(t).map_err(|e| crate::usage(e.to_string()))?,
            None => {
                closbox_switchd::require_root("closbox chaos --dry-run (or give --topology)")?;
                fabric_topology(&live::resolve(fabric)?)?
            }
        };
        let sc = scenario::load(file, &topo).map_err(|e| crate::usage(e.to_string()))?;
        match a.start.unwrap_or(sc.start) {
            scenario::Start::Now => {}
            scenario::Start::FirstPacket => println!(
                "# time 0: the first packet one of the job's GPUs sends into the fabric (start = \"first-packet\")"
            ),
            scenario::Start::EveryGpu => println!(
                "# time 0: once each of the job's GPUs has sent a packet into the fabric (start = \"every-gpu\")"
            ),
        }
        let mut next = 1;
        for (at, req) in &sc.items {
            let steps = closbox_switchd::chaos::schedule(&topo, req, &mut next)
                .map_err(anyhow::Error::msg)?;
            for (after, step) in steps {
                println!("{:>14.6} ms  {}", (at + after) as f64 / 1e6, step.what);
            }
        }
        return Ok(ExitCode::SUCCESS);
    }
    closbox_switchd::require_root("closbox chaos")?;
    let st = live::resolve(fabric)?;
    let mut timeline = Timeline::load(&st, file, a.start)?;
    timeline.json = json;
    timeline.follower = !json;
    if let Some(sel) = a.gpus {
        if timeline.scenario.start == scenario::Start::Now {
            return Err(crate::usage(format!(
                "--gpus {sel}: {} starts now (it has no `start`, and no --start); --gpus names the GPUs whose packets start a scenario with start = \"first-packet\" or \"every-gpu\"",
                file.display()
            )));
        }
        let sel = live::select(&st, sel)?;
        timeline.gpus = sel.iter().map(|&i| st.gpus[i].name.clone()).collect();
    }
    let stop = closbox_switchd::stop_on_signals()?;
    let before = events_after(&st.fabric, 0)?
        .iter()
        .map(|e| e.seq)
        .max()
        .unwrap_or(0);
    // (What the fabric does meanwhile, said at the end: a detached scenario has none.)
    let counted = if detach {
        None
    } else {
        Some(counts(&st.fabric)?)
    };
    // Killed (SIGKILL: no Ctrl-C's cancel), a followed scenario is cancelled by its
    // reaper, as Ctrl-C cancels it; a detached one runs on, as asked.
    let mut reaper = (!detach)
        .then(|| crate::reap::Reaper::start(&st.fabric))
        .flatten();
    let mut started = timeline.start()?;
    let id = started.id;
    if let Some(r) = &mut reaper {
        r.tell(&format!("timeline {id}"));
    }
    // How it ended and what the fabric did meanwhile: a last line, a JSON object with
    // --json.
    let report = |end: ChaosEnd| {
        let meanwhile = match (&counted, counts(&st.fabric)) {
            (Some(before), Ok(after)) => Some(Meanwhile::between(before, &after)),
            _ => None,
        };
        if let Some(m) = &meanwhile {
            eprintln!("# chaos: meanwhile {}", meanwhile_text(m));
        }
        if json {
            let end = ChaosRun {
                timeline: id,
                end,
                meanwhile,
            };
            match serde_json::to_string(&end) {
                Ok(j) => println!("{j}"),
                Err(e) => eprintln!("closbox: {e}"),
            }
        }
    };
    if detach {
        eprintln!(
            "# chaos: detached; `closbox events --follow` shows it, `closbox status` counts what is pending"
        );
        report(ChaosEnd::Detached);
        return Ok(ExitCode::SUCCESS);
    }
    // Follow until the last change is due (plus a moment to see it) and its loads have
    // ended, printing events; a timeline waiting for the GPUs' packets, from its start.
    let last_due = |from: StdInstant| {
        from + timeline.time_scale.to_wall(timeline.span()) + StdDuration::from_millis(300)
    };
    let mut end = started.start_ns.map(|_| last_due(started.at));
    // (What it applied at once, `start` printed.)
    let mut last = before.max(started.seen);
    let mut said = false;
    let mut cancelled = false;
    loop {
        let new = match events_after(&st.fabric, last) {
            Ok(new) => new,
            // Its scenario did not run to its end.
            Err(e) => return gone(&st, e, " while its scenario ran").map(|()| ExitCode::FAILURE),
        };
        // Its own events (other scenarios and changes by hand: `closbox events`).
        for e in &new {
            if !started.owns(e) {
                continue;
            }
            if started.saw(e) {
                end = Some(last_due(StdInstant::now()));
            }
            timeline.say(e, started.start_ns);
            cancelled |= closbox_switchd::dataplane::ends_early(&e.what, started.id);
        }
        last = new.iter().map(|e| e.seq).max().unwrap_or(last);
        // Ended from elsewhere (`closbox cancel`, `closbox reset`), which its log says.
        if cancelled && !running(&st.fabric, started.id)? {
            eprintln!(
                "# chaos: timeline {} was cancelled before its end (`closbox cancel` or `closbox reset`)",
                started.id
            );
            report(ChaosEnd::Cancelled);
            return Ok(ExitCode::SUCCESS);
        }
        if stop.load(Ordering::Relaxed) {
            timeline.finish(&mut started, "interrupted");
            report(ChaosEnd::Interrupted);
            return Ok(ExitCode::from(130));
        }
        // Past its last change, it lasts while loads it started run.
        if end.is_some_and(|end| StdInstant::now() >= end) {
            if !running(&st.fabric, started.id)? {
                // What it logged as it ended (a load's end).
                for e in events_after(&st.fabric, last)?
                    .iter()
                    .filter(|e| started.owns(e))
                {
                    timeline.say(e, started.start_ns);
                }
                break;
            }
            if !said {
                eprintln!(
                    "# chaos: its last change is made; following its loads until they end (Ctrl-C stops them, `--detach` would leave them running)"
                );
                said = true;
            }
        }
        std::thread::sleep(StdDuration::from_millis(100));
    }
    timeline.finish(&mut started, "followed to its end");
    report(ChaosEnd::Followed);
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_of_scenarios_are_tagged_with_their_timeline() {
        let mut e = Event {
            fabric_ns: 1_500_000_000,
            wall_ms: 3_600_000 + 61_001,
            what: "link leaf0-spine0 #0 down".into(),
            seq: 4,
            timeline: None,
        };
        let by_hand = "fabric time 1.500000 s  (wall 01:01:01.001 UTC)  link leaf0-spine0 #0 down";
        assert_eq!(tagged_line(&e), by_hand);
        e.timeline = Some(2);
        assert_eq!(
            tagged_line(&e),
            "fabric time 1.500000 s  (wall 01:01:01.001 UTC)  [timeline 2] link leaf0-spine0 #0 down"
        );
        assert_eq!(line(&e), by_hand);
    }

    #[test]
    fn meanwhile_says_what_changed() {
        let before = Counts {
            delivered: 990,
            drops: vec![("link_down".into(), 5), ("loss".into(), 5)],
            ecn_marked: 7,
            changed_links: 0,
        };
        let after = Counts {
            delivered: 3_300,
            drops: vec![
                ("link_down".into(), 105),
                ("loss".into(), 5),
                ("no_route".into(), 12),
            ],
            ecn_marked: 7,
            changed_links: 2,
        };
        let m = Meanwhile::between(&before, &after);
        assert_eq!(
            meanwhile_text(&m),
            "the fabric delivered 2,310 packets and dropped 112 (4.6 %): link_down 100, \
             no_route 12; 2 links are still changed (`closbox status`)"
        );
        assert_eq!(
            meanwhile_text(&Meanwhile::between(&before, &before)),
            "the fabric delivered 0 packets and dropped none"
        );
        assert_eq!(percent(0.0043), "0.004 %");
        let run = ChaosRun {
            timeline: 3,
            end: ChaosEnd::Followed,
            meanwhile: Some(m),
        };
        assert_eq!(
            serde_json::to_value(&run).unwrap(),
            serde_json::json!({
                "timeline": 3,
                "end": "followed",
                "meanwhile": {
                    "delivered": 2310,
                    "dropped": 112,
                    "drops": [["link_down", 100], ["no_route", 12]],
                    "ecn_marked": 0,
                    "changed_links": 2,
                },
            })
        );
    }
}
