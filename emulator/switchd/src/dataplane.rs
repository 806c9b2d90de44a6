//! The real-time data plane: one plain thread that reads every TUN, drives the fabric
//! model with the wall clock (scaled by `time_scale`), and writes each packet to its
//! destination TUN at its departure time.
//!
//! Waiting: `epoll_pwait2` with a nanosecond timeout until `SPIN` (or, where the box's
//! timed wake-ups run later, more: `WakeMargin`) before the next departure (timer slack
//! 1 ns), then polling the TUNs without blocking until it is due.
//! Each write's lateness (actual − scheduled, wall time) goes into a histogram: it is the
//! fidelity signal, and status warns when it says the box cannot keep up.
//!
//! Here: the loop (`run`, `step`), reads, departures and the control messages. Beside it:
//! `tun` (the real ports), `changes` and `layers` (what changes the fabric, and what
//! holds each link's state), `status` (what the loop reports, and its advice), and
//! `telemetry` (captures and recordings streamed to clients).

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::io;
use std::sync::mpsc::{Receiver, Sender};
use std::time::{Duration as StdDuration, Instant as StdInstant};

use closbox_fabric::model::Fabric;
use closbox_fabric::routing::{vertex_latency, Routes};
use closbox_fabric::{Frame, HostId, Instant, TimeScale, Topology};

use crate::chaos::{self, ChangeRequest, Event};
use crate::histogram::{Histogram, Recent};
use crate::links::{HostLink, IfState};
use crate::sys;

mod changes;
mod layers;
mod status;
mod telemetry;
mod tun;

use changes::Broken;
pub use changes::{ends_early, starts};
pub use layers::{holders, HOST};
use status::CpuSample;
pub use status::{
    behind_advice, steal_remedy, stolen, CpuUse, DirectionStatus, FlowInfo, Flows, GpuTcp,
    LateCause, Lateness, LinkStatus, LoadInfo, LoadsEarlier, PortStatus, Status, TimelineStatus,
    MAX_FLOWS,
};
use telemetry::{Capture, Recording};
pub use telemetry::{
    CaptureSpec, CaptureStart, EndReason, RecordSpec, StreamEnd, MIN_RECORD_INTERVAL_NS,
};
pub use tun::TunPorts;

/// How long before a departure the loop stops sleeping and polls: at least `SPIN` (the
/// ~25 µs a timer wakeup overshoots on this class of VM), at most `MAX_SPIN`; between them
/// as the box's timed wake-ups need (`WakeMargin`).
const SPIN: StdDuration = StdDuration::from_micros(40);
const MAX_SPIN: StdDuration = StdDuration::from_micros(500);

/// Frames read from one TUN before looking at the others (fairness) and writing what
/// fell due meanwhile: at most `READ_BATCH`, and no more than `READ_BYTES` (what a read
/// turn costs is mostly its copies: 64 frames of 9000 bytes are ~9 super-packets, whose
/// reads held back every write due meanwhile; 128 KiB is about two).
const READ_BATCH: usize = 64;
const READ_BYTES: usize = 128 << 10;
/// Lateness above which the fabric is reported as not keeping up (p99 of the last window),
/// in real time; with dilated time the bar is also a quarter of the shortest GPU-to-GPU
/// latency in fabric time (whichever is larger): lateness shifts fabric timings by
/// lateness / k, once per path (the model times every hop exactly; only the ends, where
/// packets enter and leave through TUNs, run late).
pub const BEHIND_P99: StdDuration = StdDuration::from_micros(200);
/// Length of the "recent" lateness window (a sliding window of `WINDOW_SLOTS` slots).
const WINDOW: StdDuration = StdDuration::from_secs(5);

/// Packets a second of wall time that the fabric's loads may generate together. Each is
/// model work at every hop, on the data plane's thread, beside the GPUs' traffic: a
/// leaf-to-leaf load of 667 k packets/s (8 Gbit/s of 1500-byte packets at real time) kept
/// the thread 97 % busy on the 2-core dev VM, and one the thread cannot keep up with
/// grows its backlog without end (1 Tbit/s from a GPU: no control answer, ever).
const MAX_LOAD_PACKETS_PER_WALL_S: f64 = 250_000.0;

/// Port samples a second of wall time that the fabric's recordings may take together:
/// the data plane takes every one at its own fabric time, so an interval of 100 ns over
/// 64 ports at real time (640 M a second) would keep it catching up for ever.
const MAX_RECORD_SAMPLES_PER_WALL_S: f64 = 1_000_000.0;

/// A recording that ends within this many port samples is not held to that budget.
const SHORT_RECORD_SAMPLES: f64 = 100_000.0;

/// A load that ends within this many packets (an incast's burst from one source) is not
/// held to that budget: the data plane catches up once it has ended.
const SHORT_LOAD_PACKETS: f64 = 100_000.0;
const WINDOW_SLOTS: usize = 10;
const WAKE_TOKEN: u64 = u64::MAX;
/// Epoll token bit of a GPU's link watch (`links`; the GPU's index below it).
const LINK_TOKEN: u64 = 1 << 40;
/// Nice value of the data-plane thread.
const DATAPLANE_NICE: i32 = -15;
/// `closbox up --realtime`: the data-plane thread's priority in the real-time FIFO class.
pub const RT_PRIORITY: i32 = 10;
/// The real-time safety valve: a thread that has run this long without sleeping (busy, or
/// polling for departures) goes back to the normal class (nice −15), so that it never
/// keeps a CPU from the GPUs' processes for longer; it returns to the FIFO class when it
/// sleeps again, `RT_COOLDOWN` later at the earliest (under sustained load it would
/// otherwise take the CPU for 10 ms at every pause: one bulk flow lost 12 %).
pub const RT_MAX_RUN: StdDuration = StdDuration::from_millis(10);
pub const RT_COOLDOWN: StdDuration = StdDuration::from_secs(1);
/// A wait that took this long slept (one that returns at once takes ~1 µs).
const SLEPT: StdDuration = StdDuration::from_micros(20);

/// The data-plane thread's scheduling with `--realtime`: in the FIFO class while it
/// sleeps now and then, in the normal class while it runs without sleeping.
#[derive(Debug)]
struct Realtime {
    /// In the FIFO class now.
    on: bool,
    /// When the thread last slept.
    slept: StdInstant,
    /// Times the valve took it out of the FIFO class, and when it last did.
    fallbacks: u64,
    fell_back: Option<StdInstant>,
    /// Why the thread could not be put in the FIFO class.
    refused: Option<String>,
}

impl Realtime {
    /// After a wait that began at `began` and ended at `now`: `Some(true)` to enter the
    /// FIFO class, `Some(false)` to leave it, `None` to stay.
    fn after_wait(&mut self, began: StdInstant, now: StdInstant) -> Option<bool> {
        if self.refused.is_some() {
            return None;
        }
        if now.saturating_duration_since(began) >= SLEPT {
            self.slept = now;
            let cooled = self
                .fell_back
                .is_none_or(|t| now.saturating_duration_since(t) >= RT_COOLDOWN);
            return (!self.on && cooled).then_some(true);
        }
        if self.on && now.saturating_duration_since(self.slept) > RT_MAX_RUN {
            self.fallbacks += 1;
            self.fell_back = Some(now);
            return Some(false);
        }
        None
    }
}

/// A timeline scheduled: its id, what it applied at once, its start (fabric ns since up;
/// none while it waits for its trigger).
pub type ScheduledTimeline = (u64, Vec<Event>, Option<u64>);

/// A timeline to schedule (`control::Request::Schedule`): changes at fabric ns after its
/// start, the fault each belongs to (empty: all 0), and what starts it (none: now).
#[derive(Debug)]
pub struct Schedule {
    pub items: Vec<(u64, ChangeRequest)>,
    pub faults: Vec<u32>,
    pub start: Option<crate::control::Trigger>,
}

/// Requests from the control plane.
#[derive(Debug)]
pub enum Ctl {
    Status(Sender<Status>),
    /// A change to apply now; the reply lists what was applied.
    Change(ChangeRequest, Sender<Result<Vec<Event>, String>>),
    /// Changes at fabric times after its start (a scenario's timeline): checked all at
    /// once, then scheduled as one timeline, from now or armed until its trigger; the
    /// reply has its id, what was applied now, and its start (fabric ns since up: its
    /// items are due that long after; none while armed).
    Schedule(Schedule, Sender<Result<ScheduledTimeline, String>>),
    /// Drops the changes of a timeline (or of every one) not applied yet; the reply says
    /// how many.
    Cancel(Option<u64>, Sender<(usize, Vec<Event>)>),
    /// Starts a capture: tapped packets go to the channel (when it is full they are
    /// counted as the capture's drops); the reply has what it captures.
    Capture(CaptureSpec, Sender<Result<CaptureStart, String>>),
    /// Ends a capture (its client went away).
    EndCapture(u64),
    /// Per-flow counters and paths: the heaviest (0: all) of those active in the last
    /// ns of fabric time (none: all).
    Flows(usize, Option<u64>, Sender<Flows>),
    /// Starts sampling ports' queues and utilization at a fabric-time interval.
    Record(RecordSpec, Sender<Result<u64, String>>),
    /// Ends a recording (its client went away).
    EndRecord(u64),
    /// The events numbered above the first field.
    Events(u64, Sender<Vec<Event>>),
    Stop,
}

/// Events kept for `closbox events` (the oldest go first).
const MAX_EVENTS: usize = 10_000;
/// Changes scheduled and not applied yet, at most.
pub const MAX_PENDING: usize = 100_000;

/// Where packets enter and leave the fabric (one port per GPU), and the wall clock they
/// do it by: TUN devices and the system clock in the daemon (`TunPorts`), in-memory
/// queues and a virtual clock in tests. The loop above it (reading, the model,
/// departures, lateness) is the same either way.
pub trait Ports {
    fn count(&self) -> usize;
    /// The wall clock.
    fn now(&self) -> StdInstant;
    /// Waits until input may be there or `timeout` has passed; `ready` gets the ports that
    /// may have input (a wake-up with none is fine: the loop looks at its control queue).
    fn wait(&mut self, timeout: StdDuration, ready: &mut Vec<usize>) -> io::Result<()>;
    /// One packet (a frame the fabric carries) from `port` and the wall time it was read
    /// (frames cut from one super-packet share it); `Ok(None)` when it has none. An error
    /// closes the port for good: it is not waited on or read again.
    fn recv(&mut self, port: usize) -> io::Result<Option<(Frame, StdInstant)>>;
    /// Packets due now, each to its port at its wall time `due` (the buffers are the
    /// ports' now; `out` is left empty). Writes may happen later, on other threads, and
    /// several frames of a flow to one port may go as one super-packet: each frame's
    /// lateness (from `due` to the start of the write carrying it) and whether that write
    /// failed come back through `finished`.
    fn send(&mut self, out: &mut Vec<Outgoing>);
    /// Writes done since the last call, a line per frame: (lateness in wall ns, failed).
    fn finished(&mut self, done: &mut Vec<(u64, bool)>);
    /// The calling (data-plane) thread's CPU time and run-queue wait so far, in ns, where
    /// the clock is the real one (`None` with a virtual clock).
    fn thread_cpu(&self) -> Option<(u64, u64)> {
        None
    }
    /// What GPUs' hosts did to their interfaces since the last call (`links`): a GPU's
    /// index and a change each, in the order they came; nothing where no one watches.
    fn link_changes(&mut self, _out: &mut Vec<(usize, HostLink)>) {}
    /// The fabric's end of GPU `port`'s cable: off while every link of the GPU is down,
    /// so that its interface loses its carrier as a NIC's does (`NO-CARRIER`: its stack
    /// stops sending into it); on again when one comes back. Not a change its host made:
    /// `link_changes` does not report it as one.
    fn set_carrier(&mut self, _port: usize, _on: bool) {}
    /// Writer threads taking writes off the data plane's thread, and the writes handed to
    /// them so far (each a packet or a run of frames written as one).
    fn writers(&self) -> (usize, u64) {
        (0, 0)
    }
}

/// A packet leaving the fabric.
#[derive(Debug)]
pub struct Outgoing {
    pub port: usize,
    pub data: Frame,
    pub due: StdInstant,
}

impl AsRef<Frame> for Outgoing {
    fn as_ref(&self) -> &Frame {
        &self.data
    }
}

/// How early the loop wakes for a departure: `SPIN`, or more when the box's timed waits
/// return later than that (on this VM, in slow phases, a ~1 ms wait returned 40–110 µs
/// late at the median: a 1 ms path measured 1,038–1,137 µs one way). It follows a
/// decaying peak of the recent overshoots (a late wake-up raises it at once; each one on
/// time takes 1/64 of it away), plus 10 µs, within `SPIN`..=`MAX_SPIN`: the price is
/// polling that much longer before each timed departure.
#[derive(Debug, Default)]
struct WakeMargin {
    peak_ns: u64,
}

impl WakeMargin {
    fn get(&self) -> StdDuration {
        (StdDuration::from_nanos(self.peak_ns) + StdDuration::from_micros(10)).clamp(SPIN, MAX_SPIN)
    }

    /// A timed wait that ended `late` after its timeout.
    fn observe(&mut self, late: StdDuration) {
        let late = late.as_nanos().min(MAX_SPIN.as_nanos()) as u64;
        self.peak_ns = late.max(self.peak_ns - self.peak_ns / 64);
    }
}

pub struct DataPlane<P: Ports> {
    name: String,
    /// Steps due at fabric times (flaps, scenarios): (when, order) → the step, its
    /// timeline (0: a flap).
    scheduled: std::collections::BTreeMap<(Instant, u64), (chaos::Step, u64)>,
    scheduled_seq: u64,
    timelines: u64,
    /// Per timeline with steps pending: what it broke and has not repaired yet.
    broken: std::collections::HashMap<u64, Broken>,
    /// Timelines waiting for the GPUs' traffic to start them (`Schedule::start`), in the
    /// order they were armed.
    armed: Vec<changes::Armed>,
    /// Who holds each changed link down or degraded, and the values set by hand: what a
    /// timeline's repair returns a link to.
    layers: layers::Layers,
    /// Id of the next load started.
    next_load: u32,
    /// The last fault number given to a flap (`changes::AUTO_FAULT` and up).
    next_fault: u32,
    /// What the faults of running timelines take down ("switch spine0"), said where one
    /// holds a link another of its timeline's steps would bring up.
    fault_labels: std::collections::HashMap<(u64, u32), String>,
    /// The running loads a scenario started: its timeline, which their end is logged for.
    load_timelines: std::collections::HashMap<u32, u64>,
    captures: Vec<Capture>,
    next_capture: u64,
    recordings: Vec<Recording>,
    /// Wall clock at fabric time 0, ns since the Unix epoch.
    epoch_ns: u64,
    topo: Topology,
    events: Vec<Event>,
    events_total: u64,
    port_names: Vec<String>,
    model: Fabric,
    ports: P,
    ready: Vec<usize>,
    /// Reused by `account_writes`.
    done: Vec<(u64, bool)>,
    /// Reused by `deliver_due`.
    outgoing: Vec<Outgoing>,
    ctl: Receiver<Ctl>,
    time_scale: TimeScale,
    start: StdInstant,
    lateness: Histogram,
    recent: Recent,
    /// When the recent window was last checked for a warning.
    checked: StdInstant,
    io_errors: u64,
    warned: Option<StdInstant>,
    /// p99 lateness (wall ns) above which the fabric is behind.
    behind_ns: u64,
    /// `--realtime` (None: the normal class at nice −15).
    realtime: Option<Realtime>,
    wake: WakeMargin,
    /// `--idle-poll`: the daemon holds a CPU latency of 0 (for `status`).
    idle_poll: bool,
    /// Why `idle_poll` cannot work on this box (no cpuidle driver), if it cannot.
    idle_poll_unavailable: Option<String>,
    /// `Status::full_load_time_scale`.
    full_load: f64,
    /// The thread (and the box's steal), sampled each window slot, the last `WINDOW` of
    /// them (`CpuUse`).
    cpu: std::collections::VecDeque<CpuSample>,
    /// Told the new rate of a link whose rate changes (GPUs' non-TCP pacing).
    pacer: Option<crate::pace::Pacer>,
    /// The model's `route_epoch` the pacer last heard of.
    route_epoch: u64,
    /// Each GPU's interface MTU as its host last set it (`Ports::link_changes`; 0 until
    /// one changes), and the changes taken from the ports, reused.
    gpu_mtus: Vec<u32>,
    link_changes: Vec<(usize, HostLink)>,
    /// What each GPU's host last did to its interface: where down or deleted, its links
    /// are held down by it (`Layers`).
    host_if: Vec<IfState>,
    /// Each GPU's root qdisc as its namespace's notices last said: closbox's (`None`), its
    /// host's (its kind), or deleted (`pace::REMOVED`). Events follow these, not the
    /// pacer's record, which the pacer also writes when it lays closbox's anew.
    heard_roots: Vec<Option<String>>,
    /// Each GPU's links (NIC, scale-up), the carrier the fabric gives its interface (off
    /// while all are down: `sync_carriers`), and whether a link's state changed since.
    gpu_links: Vec<Vec<u32>>,
    carrier: Vec<bool>,
    carrier_check: bool,
    /// GPUs whose carrier loss the event log told (their carrier's return is told too).
    carrier_said: Vec<bool>,
    /// GPUs whose port closed (a read of it failed: `Ports::recv`), in the order they did.
    closed: Vec<usize>,
}

impl<P: Ports> std::fmt::Debug for DataPlane<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataPlane")
            .field("name", &self.name)
            .field("ports", &self.ports.count())
            .finish()
    }
}

impl<P: Ports> DataPlane<P> {
    pub fn new(topo: &Topology, ports: P, ctl: Receiver<Ctl>) -> Self {
        assert_eq!(ports.count(), topo.hosts.len(), "a port per GPU");
        let now = ports.now();
        let mut model = Fabric::new(topo);
        model.enable_flows(MAX_FLOWS);
        let epoch_ns = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        model.set_epoch(epoch_ns);
        let port_names = chaos::port_names(topo);
        debug_assert_eq!(port_names.len(), model.routes().ports.len());
        let behind_ns = (BEHIND_P99.as_nanos() as u64).max(
            topo.fabric
                .time_scale
                .to_wall(closbox_fabric::Duration::from_nanos(
                    shortest_gpu_path(topo, model.routes()) / 4,
                ))
                .as_nanos() as u64,
        );
        DataPlane {
            name: topo.fabric.name.clone(),
            scheduled: Default::default(),
            scheduled_seq: 0,
            timelines: 0,
            broken: Default::default(),
            armed: Vec::new(),
            layers: Default::default(),
            next_fault: 0,
            fault_labels: std::collections::HashMap::new(),
            load_timelines: Default::default(),
            next_load: 1,
            captures: Vec::new(),
            next_capture: 0,
            recordings: Vec::new(),
            epoch_ns,
            topo: topo.clone(),
            events: Vec::new(),
            events_total: 0,
            port_names,
            model,
            ports,
            ready: Vec::new(),
            done: Vec::new(),
            outgoing: Vec::new(),
            ctl,
            time_scale: topo.fabric.time_scale,
            start: now,
            lateness: Histogram::new(),
            recent: Recent::new(WINDOW.as_nanos() as u64, WINDOW_SLOTS),
            checked: now,
            io_errors: 0,
            warned: None,
            behind_ns,
            full_load: closbox_fabric::plan::TimeScaleHint::of(topo).for_load,
            realtime: None,
            wake: WakeMargin::default(),
            idle_poll: false,
            idle_poll_unavailable: None,
            cpu: Default::default(),
            pacer: None,
            route_epoch: 0,
            gpu_mtus: Vec::new(),
            link_changes: Vec::new(),
            host_if: vec![IfState::Up; topo.hosts.len()],
            heard_roots: vec![None; topo.hosts.len()],
            gpu_links: gpu_links(topo),
            carrier: vec![true; topo.hosts.len()],
            carrier_check: false,
            carrier_said: vec![false; topo.hosts.len()],
            closed: Vec::new(),
        }
    }

    /// Says in `status` that idle CPUs poll while the fabric is up (the daemon holds the
    /// request; see `Scheduling::idle_poll`).
    pub fn idle_poll(mut self, on: bool) -> Self {
        self.idle_poll = on;
        self.idle_poll_unavailable = if on {
            crate::sys::idle_poll_unavailable()
        } else {
            None
        };
        self
    }

    /// Follows the links' rate changes into the GPUs' pacing qdiscs (see `pace`).
    pub fn pacer(mut self, pacer: Option<crate::pace::Pacer>) -> Self {
        self.pacer = pacer;
        self
    }

    /// Runs the data-plane thread in the real-time FIFO class (`RT_PRIORITY`), with the
    /// safety valve `RT_MAX_RUN`.
    pub fn realtime(mut self, on: bool) -> Self {
        self.realtime = on.then(|| Realtime {
            on: false,
            slept: self.ports.now(),
            fallbacks: 0,
            fell_back: None,
            refused: None,
        });
        self
    }

    /// Enters (`true`) or leaves the FIFO class.
    fn set_realtime(&mut self, on: bool) {
        let Some(rt) = &mut self.realtime else {
            return;
        };
        let r = if on {
            sys::set_thread_fifo(RT_PRIORITY)
        } else {
            sys::set_thread_normal()
        };
        match r {
            Ok(()) => rt.on = on,
            Err(e) if on => {
                tracing::warn!("the data plane stays in the normal class: real-time refused: {e}");
                rt.refused = Some(e.to_string());
            }
            Err(e) => tracing::warn!("leaving the real-time class: {e}"),
        }
    }

    /// How the data-plane thread is scheduled, for `status`.
    fn scheduling(&self) -> String {
        let normal = format!("normal class, nice {DATAPLANE_NICE}");
        let thread = match &self.realtime {
            None => normal,
            Some(Realtime {
                refused: Some(e), ..
            }) => format!("{normal} (real-time refused: {e})"),
            Some(rt) => format!(
                "real-time (SCHED_FIFO {RT_PRIORITY}); {normal} for {} s after {} ms without sleeping: {} time(s){}",
                RT_COOLDOWN.as_secs(),
                RT_MAX_RUN.as_millis(),
                rt.fallbacks,
                if rt.on { "" } else { ", now" }
            ),
        };
        match (self.idle_poll, &self.idle_poll_unavailable) {
            (true, None) => format!("{thread}; idle CPUs poll (CPU latency 0 held while up)"),
            (true, Some(why)) => format!(
                "{thread}; CPU latency 0 held while up (--idle-poll), without effect: {why}"
            ),
            (false, _) => thread,
        }
    }

    fn fabric_now(&self, wall: StdInstant) -> Instant {
        let since = self
            .time_scale
            .to_fabric(wall.saturating_duration_since(self.start));
        Instant::ZERO + since
    }

    fn wall_of(&self, t: Instant) -> StdInstant {
        self.start + self.time_scale.to_wall(t.saturating_since(Instant::ZERO))
    }

    /// Runs until a `Ctl::Stop` arrives; hands the ports back (the daemon closes its TUNs
    /// only after their namespaces are gone: closing a TUN in a live namespace unregisters
    /// it synchronously, ~16 ms each; namespace teardown unregisters them in one batch).
    pub fn run(mut self) -> P {
        sys::set_timer_slack_ns(1);
        // GPU processes compete for the same cores; the fabric must not be the one that
        // waits. A nice value (not a real-time class) keeps a busy box responsive.
        if let Err(e) = sys::set_thread_nice(DATAPLANE_NICE) {
            tracing::warn!("could not raise the data plane's priority: {e}");
        }
        if self.realtime.is_some() {
            self.set_realtime(true);
        }
        tracing::info!(
            "data plane of {}: {} ports, time_scale {}, behind above p99 {} µs",
            self.name,
            self.ports.count(),
            self.time_scale,
            self.behind_ns / 1_000
        );
        while self.step() {}
        self.ports
    }

    /// One turn of the loop: deliver what is due, answer control requests, wait for input
    /// or the next departure (until `SPIN` before it, then poll), read what came. False
    /// once asked to stop.
    pub fn step(&mut self) -> bool {
        let wall = self.ports.now();
        self.sample_due(wall);
        self.apply_due(wall);
        self.deliver_due(wall);
        if !self.handle_ctl() {
            return false;
        }
        self.follow_routes();
        // (Changes log what they do to carriers themselves: this is a fallback.)
        let said = self.sync_carriers();
        if !said.is_empty() {
            let now = self.fabric_now(self.ports.now());
            self.log_event(now, said.trim_start_matches("; ").to_owned());
        }
        self.sample_cpu(wall);
        self.rotate_window(wall);
        // What this turn tapped (departures, a link's flush) goes to the captures before
        // the wait: the last packet of an exchange would wait up to its second for them,
        // and be lost to a capture ended meanwhile. (Reads tap drops at entry: they go
        // at the next turn, which comes at once.)
        self.drain_taps();
        // No departure pending: sleep until input, or a second for housekeeping.
        let next = [
            self.model.poll_timeout(),
            self.scheduled.keys().next().map(|k| k.0),
            self.recordings.iter().map(|r| r.next).min(),
            // (A capture's --duration ends it on an idle fabric too, on time.)
            self.captures.iter().filter_map(|c| c.until).min(),
        ]
        .into_iter()
        .flatten()
        .min();
        let began = self.ports.now();
        let timeout = match next {
            Some(t) => self
                .wall_of(t)
                .saturating_duration_since(began)
                .saturating_sub(self.wake.get()),
            None => StdDuration::from_secs(1),
        };
        let mut ready = std::mem::take(&mut self.ready);
        ready.clear();
        if let Err(e) = self.ports.wait(timeout, &mut ready) {
            tracing::error!("waiting for input: {e}");
            self.io_errors += 1;
        }
        let woke = self.ports.now();
        // A timed wait for a departure that nothing cut short: how late it returned.
        if next.is_some() && !timeout.is_zero() && ready.is_empty() {
            self.wake
                .observe(woke.saturating_duration_since(began + timeout));
        }
        if let Some(rt) = &mut self.realtime {
            if let Some(on) = rt.after_wait(began, woke) {
                self.set_realtime(on);
            }
        }
        self.ports.link_changes(&mut self.link_changes);
        if !self.link_changes.is_empty() {
            self.follow_links(woke);
        }
        for &port in &ready {
            self.read_port(port);
        }
        self.ready = ready;
        true
    }

    fn read_port(&mut self, host: usize) {
        let mut bytes = 0;
        for _ in 0..READ_BATCH {
            if bytes >= READ_BYTES {
                return;
            }
            match self.ports.recv(host) {
                Ok(Some((buf, at))) => {
                    bytes += buf.len();
                    // Not before what the model has seen (a frame cut from an earlier read).
                    let now = self.fabric_now(at).max(self.model.now());
                    // A timeline waiting for this GPU's traffic starts before its packet
                    // enters (a partition at its time 0 holds that packet too).
                    if !self.armed.is_empty() {
                        self.gpu_sent(host, now);
                    }
                    // Drops are counted by the model; nothing else to do with the verdict.
                    let _ = self.model.send(now, HostId(host as u32), buf);
                }
                Ok(None) => return,
                Err(e) => {
                    // The port is closed (`Ports::recv`): said once, in the log of events.
                    self.io_errors += 1;
                    let name = self.topo.hosts.get(host).map_or("?", |h| h.name.as_str());
                    let what = format!(
                        "{name}'s port closed: reading its TUN failed: {e} (its interface deleted inside its namespace?)"
                    );
                    tracing::warn!("fabric {}: {what}", self.name);
                    let now = self.fabric_now(self.ports.now());
                    self.log_event(now, what);
                    if !self.closed.contains(&host) {
                        self.closed.push(host);
                    }
                    // Its links down for good (if the link watch has not said so first).
                    self.host_sets(now, host, IfState::Gone);
                    return;
                }
            }
        }
    }

    fn deliver_due(&mut self, wall: StdInstant) {
        let now = self.fabric_now(wall);
        self.model.advance(now);
        // Lateness is taken when the write starts: the write itself runs the receiver's
        // network stack, which is the GPU's time, not the fabric's.
        let mut out = std::mem::take(&mut self.outgoing);
        while let Some(d) = self.model.poll_delivery() {
            out.push(Outgoing {
                port: d.dst.0 as usize,
                due: self.wall_of(d.at),
                data: d.data,
            });
        }
        if !out.is_empty() {
            self.ports.send(&mut out);
        }
        self.outgoing = out;
        self.account_writes(wall);
    }

    /// Lateness and errors of the writes done since the last call.
    fn account_writes(&mut self, wall: StdInstant) {
        let mut done = std::mem::take(&mut self.done);
        self.ports.finished(&mut done);
        let at = wall.saturating_duration_since(self.start).as_nanos() as u64;
        for &(late, failed) in &done {
            if failed {
                self.io_errors += 1;
            }
            self.lateness.record(late);
            self.recent.record(at, late);
        }
        done.clear();
        self.done = done;
    }

    /// Answers control requests; false when asked to stop.
    fn handle_ctl(&mut self) -> bool {
        while let Ok(req) = self.ctl.try_recv() {
            match req {
                Ctl::Stop => {
                    // Their channels close as the data plane goes.
                    for c in &self.captures {
                        c.ended.set(StreamEnd::FabricDown);
                    }
                    for r in &self.recordings {
                        r.ended.set(StreamEnd::FabricDown);
                    }
                    return false;
                }
                Ctl::Status(reply) => {
                    let _ = reply.send(self.status());
                }
                Ctl::Change(req, reply) => {
                    let _ = reply.send(self.change(&req));
                }
                Ctl::Schedule(req, reply) => {
                    let now = self.fabric_now(self.ports.now());
                    let _ = reply.send(self.schedule_request(req, now));
                }
                Ctl::Cancel(timeline, reply) => {
                    let _ = reply.send(self.cancel(timeline));
                }
                Ctl::Capture(spec, reply) => {
                    let _ = reply.send(self.start_capture(spec));
                }
                Ctl::EndCapture(id) => {
                    self.captures.retain(|c| c.id != id);
                    self.retap();
                }
                Ctl::Flows(top, since_ns, reply) => {
                    let _ = reply.send(self.flows(top, since_ns));
                }
                Ctl::Record(spec, reply) => {
                    let _ = reply.send(self.start_recording(spec));
                }
                Ctl::EndRecord(id) => {
                    self.recordings.retain(|r| r.id != id);
                }
                Ctl::Events(after, reply) => {
                    // (Numbered in order: only the new ones are copied.)
                    let from = self.events.partition_point(|e| e.seq <= after);
                    let _ = reply.send(self.events[from..].to_vec());
                }
            }
        }
        true
    }
}

/// Each GPU's links (NIC, scale-up), by topology index.
fn gpu_links(topo: &Topology) -> Vec<Vec<u32>> {
    use closbox_fabric::topology::Vertex;
    let mut links = vec![Vec::new(); topo.hosts.len()];
    for (l, link) in topo.links.iter().enumerate() {
        for end in [link.a, link.b] {
            if let Vertex::Host(h) = end {
                if let Some(v) = links.get_mut(h.0 as usize) {
                    v.push(l as u32);
                }
            }
        }
    }
    links
}

/// The shortest one-way latency from a GPU to another (link delays and switch latencies,
/// nanoseconds of fabric time): Dijkstra from each GPU, stopping at the first other GPU.
fn shortest_gpu_path(topo: &Topology, routes: &Routes) -> u64 {
    let h = topo.hosts.len() as u32;
    let vertices = h as usize + topo.switches.len();
    let mut out: Vec<Vec<(u32, u64)>> = vec![Vec::new(); vertices];
    for p in &routes.ports {
        let delay = topo.links[p.link as usize].params.delay + vertex_latency(topo, p.to);
        out[p.from as usize].push((p.to, delay.as_nanos()));
    }
    let mut best = u64::MAX;
    let mut dist = vec![u64::MAX; vertices];
    for src in 0..h {
        dist.iter_mut().for_each(|d| *d = u64::MAX);
        dist[src as usize] = 0;
        let mut heap = BinaryHeap::from([Reverse((0u64, src))]);
        while let Some(Reverse((d, v))) = heap.pop() {
            if d > dist[v as usize] || d >= best {
                continue;
            }
            if v < h && v != src {
                best = d;
                break;
            }
            for &(to, w) in &out[v as usize] {
                let nd = d + w;
                if nd < dist[to as usize] {
                    dist[to as usize] = nd;
                    heap.push(Reverse((nd, to)));
                }
            }
        }
    }
    if best == u64::MAX {
        0
    } else {
        best
    }
}

#[cfg(test)]
mod tests;
