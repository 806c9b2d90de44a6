//! The real-time data plane: one plain thread that reads every TUN, drives the fabric
//! model with the wall clock (scaled by `time_scale`), and writes each packet to its
//! destination TUN at its departure time.
//!
//! Waiting: `epoll_pwait2` with a nanosecond timeout until `SPIN` (or, where the box's
//! timed wake-ups run later, more: `WakeMargin`) before the next departure (timer slack
//! 1 ns), then polling the TUNs without blocking until it is due.
//! Each write's lateness (actual − scheduled, wall time) goes into a histogram: it is the
//! fidelity signal, and status warns when it says the box cannot keep up.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::io;
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration as StdDuration, Instant as StdInstant};

use closbox_fabric::model::{DropReason, Fabric};
use closbox_fabric::routing::{vertex_latency, Routes};
use closbox_fabric::{Frame, HostId, Instant, TimeScale, Topology};
use serde::{Deserialize, Serialize};

use crate::chaos::{self, ChangeRequest, Event};
use crate::histogram::{Histogram, Recent};
use crate::sys;

mod changes;
mod layers;
mod tun;

pub use changes::ends_early;
use changes::Broken;
pub use layers::holders;
pub use tun::TunPorts;

/// How long before a departure the loop stops sleeping and polls: at least `SPIN` (the
/// ~25 µs a timer wakeup overshoots on this class of VM), at most `MAX_SPIN`; between them
/// as the box's timed wake-ups need (`WakeMargin`).
const SPIN: StdDuration = StdDuration::from_micros(40);
const MAX_SPIN: StdDuration = StdDuration::from_micros(500);

/// Packets read from one TUN before looking at the others (fairness).
const READ_BATCH: usize = 64;
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

/// Requests from the control plane.
#[derive(Debug)]
pub enum Ctl {
    Status(Sender<Status>),
    /// A change to apply now; the reply lists what was applied.
    Change(ChangeRequest, Sender<Result<Vec<Event>, String>>),
    /// Changes at fabric times after now (a scenario's timeline): checked all at once,
    /// then scheduled as one timeline; the reply has its id and what was applied now.
    Schedule(
        Vec<(u64, ChangeRequest)>,
        Vec<u32>,
        Sender<Result<(u64, Vec<Event>), String>>,
    ),
    /// Drops the changes of a timeline (or of every one) not applied yet; the reply says
    /// how many.
    Cancel(Option<u64>, Sender<(usize, Vec<Event>)>),
    /// Starts a capture: tapped packets go to the channel (when it is full they are
    /// counted as the capture's drops); the reply has what it captures.
    Capture(CaptureSpec, Sender<Result<CaptureStart, String>>),
    /// Ends a capture (its client went away).
    EndCapture(u64),
    /// Per-flow counters and paths.
    Flows(Sender<Flows>),
    /// Starts sampling ports' queues and utilization at a fabric-time interval.
    Record(RecordSpec, Sender<Result<u64, String>>),
    /// Ends a recording (its client went away).
    EndRecord(u64),
    Events(Sender<Vec<Event>>),
    Stop,
}

/// Most flows counted one by one (packets of more are counted as untracked).
pub const MAX_FLOWS: usize = 65_536;

/// One flow (5-tuple) and what the fabric did with it, for `closbox flows`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FlowInfo {
    pub src: String,
    pub dst: String,
    /// "tcp", "udp", "icmp" or the protocol number.
    pub proto: String,
    pub sport: u16,
    pub dport: u16,
    /// GPU names of the addresses (empty if not the fabric's).
    pub src_gpu: String,
    pub dst_gpu: String,
    /// The switch the destination address is (a GPU pinging it), or empty.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub dst_switch: String,
    pub packets: u64,
    pub bytes: u64,
    pub drops: u64,
    pub ecn_marked: u64,
    /// Fabric seconds of its first and last packet.
    pub first_s: f64,
    pub last_s: f64,
    /// The vertices its packets cross now, as the fabric hashes it (empty when a switch
    /// on the way sprays or adapts packet by packet, or there is no route).
    pub path: Vec<String>,
    /// The egress ports between them, as `status` names them ("leaf0->spine1 #4" where
    /// parallel links join two switches: which of them the flow is hashed onto).
    #[serde(default)]
    pub ports: Vec<String>,
}

/// The flows reply.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Flows {
    pub fabric_time_s: f64,
    pub flows: Vec<FlowInfo>,
    /// Packets of flows beyond `MAX_FLOWS`.
    pub untracked_packets: u64,
}

/// Why a capture or recording ended, as the data plane saw it: the stream that writes it
/// out says so at its end (the file records it, the client tells its user).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum StreamEnd {
    /// Not ended, or by its client (which then knows why).
    Open = 0,
    /// `--count` packets were captured.
    Count = 1,
    /// `--duration` of fabric time passed.
    Duration = 2,
    /// The fabric went down.
    FabricDown = 3,
}

impl StreamEnd {
    /// The words for "ended: …", or none for an open stream.
    pub fn words(self) -> Option<&'static str> {
        match self {
            StreamEnd::Open => None,
            StreamEnd::Count => Some("its count was reached"),
            StreamEnd::Duration => Some("its duration of fabric time passed"),
            StreamEnd::FabricDown => Some("the fabric went down"),
        }
    }

    /// Read back from `words`.
    pub fn from_words(s: &str) -> Option<StreamEnd> {
        [StreamEnd::Count, StreamEnd::Duration, StreamEnd::FabricDown]
            .into_iter()
            .find(|e| e.words() == Some(s))
    }
}

/// Where the data plane says why a stream ended (shared with the thread writing it out;
/// the first reason set stays).
#[derive(Clone, Debug, Default)]
pub struct EndReason(Arc<std::sync::atomic::AtomicU8>);

impl EndReason {
    pub fn set(&self, why: StreamEnd) {
        use std::sync::atomic::Ordering;
        let _ = self.0.compare_exchange(
            StreamEnd::Open as u8,
            why as u8,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }

    pub fn get(&self) -> StreamEnd {
        match self.0.load(std::sync::atomic::Ordering::Acquire) {
            1 => StreamEnd::Count,
            2 => StreamEnd::Duration,
            3 => StreamEnd::FabricDown,
            _ => StreamEnd::Open,
        }
    }
}

/// What a recording asks for.
#[derive(Debug)]
pub struct RecordSpec {
    /// Port names.
    pub ports: Vec<String>,
    pub interval_ns: u64,
    pub duration_ns: Option<u64>,
    /// Per sample time: (fabric ns, per port (queue bytes, busy share of the interval)).
    pub tx: std::sync::mpsc::SyncSender<(u64, Vec<(u64, f64)>)>,
    pub ended: EndReason,
}

struct Recording {
    id: u64,
    ports: Vec<closbox_fabric::routing::PortId>,
    interval: closbox_fabric::Duration,
    next: Instant,
    until: Option<Instant>,
    tx: std::sync::mpsc::SyncSender<(u64, Vec<(u64, f64)>)>,
    ended: EndReason,
    last_busy: Vec<u64>,
    done: bool,
    /// Port samples a second of wall time it takes (0 for a short one), for the budget.
    samples_per_wall_s: f64,
}

/// Shortest sampling interval, fabric time.
pub const MIN_RECORD_INTERVAL_NS: u64 = 100;

/// What a capture asks for.
#[derive(Debug)]
pub struct CaptureSpec {
    /// Port names ("leaf0->spine1").
    pub ports: Vec<String>,
    pub snaplen: u32,
    /// Also packets dropped at those ports, with their reason.
    pub drops: bool,
    /// Ends after this many packets.
    pub count: Option<u64>,
    /// Ends after this much fabric time.
    pub duration_ns: Option<u64>,
    /// Where tapped packets go: (index in `ports`, packet).
    pub tx: std::sync::mpsc::SyncSender<(u32, closbox_fabric::model::Tapped)>,
    pub ended: EndReason,
}

/// A capture, started.
#[derive(Debug)]
pub struct CaptureStart {
    pub id: u64,
    /// Wall clock (ns since the Unix epoch) at fabric time 0: packet times are this plus
    /// their fabric time, so a dilated capture reads in fabric time.
    pub epoch_ns: u64,
    /// Per captured port: packets seen, and not kept (the channel was full).
    pub counters: Arc<Vec<[std::sync::atomic::AtomicU64; 2]>>,
}

struct Capture {
    id: u64,
    /// Per port of the fabric: its index in the capture, if captured.
    index_of: Vec<Option<u32>>,
    tx: std::sync::mpsc::SyncSender<(u32, closbox_fabric::model::Tapped)>,
    ended: EndReason,
    counters: Arc<Vec<[std::sync::atomic::AtomicU64; 2]>>,
    left: Option<u64>,
    until: Option<Instant>,
    drops: bool,
    snaplen: u32,
    done: bool,
}

/// Events kept for `closbox events` (the oldest go first).
const MAX_EVENTS: usize = 10_000;
/// Changes scheduled and not applied yet, at most.
pub const MAX_PENDING: usize = 100_000;
/// Finished loads `status` still lists.
const MAX_DONE_LOADS: usize = 20;

/// A timeline still running, for `status`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TimelineStatus {
    pub id: u64,
    /// Steps not applied yet.
    pub pending: usize,
    /// Loads it started that still run.
    pub loads: Vec<u32>,
}

/// A link that is down or changed, for `status`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LinkStatus {
    /// "leaf0-spine1 #0".
    pub link: String,
    /// Index of the link in the topology (as the model numbers links).
    pub id: u32,
    pub up: bool,
    /// Fabric seconds since it went down.
    pub down_since_s: Option<f64>,
    /// Rate, delay and loss of the a→b direction, and of b→a unless `b_to_a` says
    /// otherwise.
    pub rate_bps: u64,
    pub delay_ns: u64,
    pub loss: f64,
    /// Mean frames per run of losses (1: independent losses).
    #[serde(default = "one")]
    pub loss_burst: f64,
    /// Buffers of the a→b and b→a egress queues.
    pub buffer_bytes: [u64; 2],
    /// The b→a direction, where it differs from a→b (a change made in one direction).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub b_to_a: Option<DirectionStatus>,
    /// Names of the ends a and b.
    #[serde(default)]
    pub ends: [String; 2],
    /// The timelines (scenarios; 0: by hand) holding it down: it comes up when the last
    /// lets go, or by hand.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub down_by: Vec<u64>,
    /// The scenarios' timelines whose degrades are in place on it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub degraded_by: Vec<u64>,
}

/// One direction of a link: rate, delay, loss.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DirectionStatus {
    pub rate_bps: u64,
    pub delay_ns: u64,
    pub loss: f64,
    pub loss_burst: f64,
}

impl DirectionStatus {
    fn of(p: &closbox_fabric::topology::LinkParams) -> DirectionStatus {
        DirectionStatus {
            rate_bps: p.rate.bps(),
            delay_ns: p.delay.as_nanos(),
            loss: p.loss,
            loss_burst: p.loss_burst,
        }
    }
}

fn one() -> f64 {
    1.0
}

/// A snapshot for `closbox status` (the control API's status reply).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Status {
    pub fabric: String,
    pub gpus: usize,
    pub time_scale: closbox_fabric::TimeScale,
    pub uptime_s: f64,
    pub fabric_time_s: f64,
    /// Packets that entered the fabric: from the GPUs, and the switches' ICMP errors.
    pub packets_in: u64,
    pub delivered: u64,
    pub queued: u64,
    pub in_flight: u64,
    pub drops: Vec<(String, u64)>,
    pub lateness: Lateness,
    pub lateness_recent: Lateness,
    /// The lateness histogram since start, as (bucket, count): clients diff two snapshots
    /// for the lateness of a run (`Histogram::since`).
    pub lateness_buckets: Vec<(u64, u64)>,
    pub behind: bool,
    /// The p99 lateness (µs, wall) above which `behind` is set.
    pub behind_threshold_us: f64,
    /// The time_scale from which this box carries every GPU sending at full rate, as
    /// `closbox plan` estimates it (`TimeScaleHint`); 0 from a daemon that did not say.
    #[serde(default)]
    pub full_load_time_scale: f64,
    /// Failed TUN reads, writes and waits (a failed write of a coalesced run counts once).
    pub io_errors: u64,
    /// Bytes charged for the packets the fabric holds, and the budget (`packet_memory`).
    pub packet_memory: u64,
    pub packet_memory_limit: u64,
    /// Kernel-side TUN drops (packets the daemon did not read in time), filled in by the
    /// control plane.
    pub tun_tx_dropped: Option<u64>,
    /// Packets the fabric delivered that the GPUs' kernels dropped (an interface set down,
    /// a full backlog), filled in by the control plane.
    #[serde(default)]
    pub gpu_rx_dropped: Option<u64>,
    /// Per egress port counters, every port in port order.
    pub ports: Vec<PortStatus>,
    /// Links that are down or whose parameters were changed.
    pub changed_links: Vec<LinkStatus>,
    /// How many changes were applied since the fabric came up.
    pub events: u64,
    /// While a partition holds: the GPUs of each side.
    pub partition: Vec<Vec<String>>,
    /// Synthetic loads (`closbox load`, `closbox incast`), running or done.
    #[serde(default)]
    pub loads: Vec<LoadInfo>,
    /// Changes scheduled and not applied yet (flaps, scenarios).
    #[serde(default)]
    pub pending_changes: usize,
    /// Timelines (scenarios, flaps: timeline 0) with changes pending or loads running:
    /// what `closbox cancel` would end.
    #[serde(default)]
    pub timelines: Vec<TimelineStatus>,
    /// Scenarios' timelines started since the fabric came up (numbered 1 to this).
    #[serde(default)]
    pub timelines_started: u64,
    /// "none" (lossy), "pfc" or "credit".
    #[serde(default)]
    pub flow_control: String,
    /// Lossless: ports paused now for longer than `deadlock_after` (fabric time), with how
    /// long: a pause that does not end is a deadlock (a cyclic buffer dependency).
    #[serde(default)]
    pub deadlocked: Vec<(String, f64)>,
    #[serde(default)]
    pub deadlock_after_s: f64,
    /// How the data-plane thread is scheduled (`closbox up --realtime`).
    #[serde(default)]
    pub scheduling: String,
    /// Started with `--realtime` (the thread may be in the normal class for a while: the
    /// safety valve, or real time refused; `scheduling` says).
    #[serde(default)]
    pub realtime: bool,
    /// Started with `--idle-poll`: idle CPUs poll instead of halting while it is up.
    #[serde(default)]
    pub idle_poll: bool,
    /// The GPUs' non-TCP packets are held to their links' rates by a qdisc (`pace`);
    /// false where `up` could not install it (its log says why).
    #[serde(default)]
    pub gpu_pacing: bool,
    /// The data-plane thread over about the last `WINDOW` (see `CpuUse`).
    #[serde(default)]
    pub cpu_recent: Option<CpuUse>,
    /// The data-plane thread's CPU time and run-queue wait since it started, ns: clients
    /// diff two snapshots for a run (`CpuUse::over`).
    #[serde(default)]
    pub thread_cpu_ns: Option<(u64, u64)>,
    /// The box's CPU ticks so far, all and stolen (`sys::box_cpu_ticks`), where the clock
    /// is the real one: clients diff two snapshots for the steal during a run.
    #[serde(default)]
    pub box_cpu_ticks: Option<(u64, u64)>,
}

impl Status {
    /// The drops the GPUs' kernels counted at their TUNs, by the name `status` and the
    /// metrics give them: `None` where they could not be read.
    pub fn kernel_drops(&self) -> [(&'static str, Option<u64>); 2] {
        [
            ("tun_kernel", self.tun_tx_dropped),
            ("gpu_kernel", self.gpu_rx_dropped),
        ]
    }
}

/// A synthetic load, for `status` and predictions.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LoadInfo {
    pub id: u32,
    pub from: String,
    pub to: String,
    /// Wire rate while it sends.
    pub rate_bps: u64,
    /// Its long-run average wire rate while active (on/off and bursts included).
    pub mean_bps: f64,
    /// "steady", "on 1ms / off 1ms", "bursts of 1 MiB every 1ms x 10".
    pub pattern: String,
    pub active: bool,
    pub started_s: f64,
    pub sent_bytes: u64,
    pub delivered_bytes: u64,
    pub ecn_marked: u64,
    /// Drops by reason (only reasons with drops).
    pub drops: Vec<(String, u64)>,
    /// Share of its packets crossing each port (port index, share), as routed now.
    pub port_shares: Vec<(u32, f64)>,
}

/// One egress port's counters.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PortStatus {
    /// "leaf0->spine1".
    pub port: String,
    pub rx_packets: u64,
    pub tx_packets: u64,
    pub tx_bytes: u64,
    pub drops_buffer: u64,
    pub drops_loss: u64,
    pub ecn_marked: u64,
    pub max_queue_bytes: u64,
    /// Busy fraction of fabric time since start (synthetic load included).
    pub utilization: f64,
    /// Synthetic load through the port: bytes sent, packets dropped.
    #[serde(default)]
    pub load_tx_bytes: u64,
    #[serde(default)]
    pub load_drops: u64,
    /// Lost because its link went down (queued, on the wire, or blackholed).
    #[serde(default)]
    pub drops_link_down: u64,
    /// Bytes queued now (GPU packets and load), as of the snapshot.
    #[serde(default)]
    pub queue_bytes: u64,
    /// The link's class (nic, nvlink, leaf-spine, spine-core), rate now, and whether up.
    #[serde(default)]
    pub class: String,
    #[serde(default)]
    pub rate_bps: u64,
    #[serde(default)]
    pub up: bool,
    /// Lossless fabrics: times the next switch stopped this port, and for how long in all
    /// (fabric seconds, a pause still on included).
    #[serde(default)]
    pub pause_events: u64,
    #[serde(default)]
    pub paused_s: f64,
    /// Paused right now.
    #[serde(default)]
    pub paused_now: bool,
    /// The most bytes the next switch held at once from this port (its ingress).
    #[serde(default)]
    pub max_ingress_bytes: u64,
}

/// Why a fabric runs late at `time_scale` and what to do about it, given the scale from
/// which `closbox plan` estimates the box carries every GPU at full rate (0: unknown), and
/// what the data plane's thread did meanwhile (`cpu`; `realtime`: `up --realtime`).
pub fn behind_advice(
    time_scale: f64,
    full_load: f64,
    cpu: Option<&CpuUse>,
    realtime: bool,
) -> String {
    // Steal is known only with the thread's CPU use, over the same window.
    let (steal, window_s) = cpu.map_or((0.0, 0.0), |c| (c.steal, c.window_s));
    match LateCause::of(cpu, steal, realtime) {
        LateCause::Stolen(steal) => format!(
            "{}: raise time_scale (the same wall-clock delays then shift fabric time less), or run on a quieter host",
            stolen(steal, &format!("the last {window_s:.1} s"))
        ),
        LateCause::Preempted(c) => format!(
            "the data plane's thread was busy only {:.0} % of a CPU but waited {:.0} ms for one in the last {:.1} s (the GPUs' processes held the CPUs): `closbox up --realtime` keeps it on a CPU, or raise time_scale (the same wall-clock delays then shift fabric time less)",
            c.busy * 100.0,
            c.waited_ms,
            c.window_s
        ),
        LateCause::Work => format!(
            "this box cannot keep up with the configured rates; {}",
            time_scale_advice(time_scale, full_load)
        ),
    }
}

/// Why a fabric ran late, the likeliest cause first; each place that says so (`status`'s
/// warning, `bench`'s footer, `top`) words it in its own length.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LateCause {
    /// The hypervisor took this share of the box's CPU time (`CpuUse::STOLEN` or more).
    Stolen(f64),
    /// The data plane's thread had time to spare but waited for a CPU
    /// (`CpuUse::preempted`), outside the real-time class, which would prevent it.
    Preempted(CpuUse),
    /// More work than the box does in time: a larger time scale.
    Work,
}

impl LateCause {
    /// From the thread's CPU use (if known), the box's steal share over the same span,
    /// and whether the thread runs in the real-time class (`up --realtime`).
    pub fn of(cpu: Option<&CpuUse>, steal: f64, realtime: bool) -> LateCause {
        if steal >= CpuUse::STOLEN {
            LateCause::Stolen(steal)
        } else if let Some(c) = cpu.filter(|c| !realtime && c.preempted()) {
            LateCause::Preempted(*c)
        } else {
            LateCause::Work
        }
    }
}

/// Steal time (`steal`, a share of the box's CPU time) over `span`, as the cause of
/// lateness (`behind_advice`, `bench`).
pub fn stolen(steal: f64, span: &str) -> String {
    format!(
        "the hypervisor gave this machine's CPUs to others for {:.0} % of {span} (steal time: its virtual CPUs stood still while the wall clock ran), which nothing inside the box gets back",
        steal * 100.0
    )
}

fn time_scale_advice(time_scale: f64, full_load: f64) -> String {
    if full_load > time_scale {
        format!(
            "raise time_scale to at least {full_load} (`closbox plan`'s estimate for every GPU at full rate on this box; more where small frames each wake a GPU's process: `up --time-scale auto` measures it), or lower the rates"
        )
    } else if full_load > 0.0 {
        format!(
            "raise time_scale above {time_scale} (`closbox plan` estimated {full_load} for every GPU at full rate: this traffic costs the box more; `up --time-scale auto` measures what it needs), or lower the rates"
        )
    } else {
        "raise time_scale (`up --time-scale auto` measures what this box needs), or lower the rates"
            .to_owned()
    }
}

/// Write lateness in wall-clock microseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Lateness {
    /// Frames written: a coalesced write counts each of its frames, each late by its own
    /// due time.
    pub samples: u64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
}

impl Lateness {
    /// Enough frames written, and their p99 above `threshold_us`: the box is not keeping up.
    pub fn behind(&self, threshold_us: f64) -> bool {
        self.samples >= 100 && self.p99_us > threshold_us
    }

    pub fn of(h: &Histogram) -> Lateness {
        Lateness {
            samples: h.count(),
            p50_us: h.quantile(0.5) as f64 / 1e3,
            p99_us: h.quantile(0.99) as f64 / 1e3,
            max_us: h.max() as f64 / 1e3,
        }
    }
}

/// The data plane's thread over the recent window (`status`): how busy it was and how
/// long it was runnable but kept off a CPU (its run-queue delay, from the kernel's
/// schedstat). Late writes from a busy thread mean the box cannot do the work in time;
/// from a thread that was not busy but waited, they mean the scheduler gave its CPU to
/// other processes (the GPUs' own, under load), which `--realtime` prevents.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CpuUse {
    pub window_s: f64,
    /// Share of one CPU it ran, over the window and in its busiest slot (half a second).
    pub busy: f64,
    #[serde(default)]
    pub peak_busy: f64,
    pub waited_ms: f64,
    /// Share of the whole box's CPU time the hypervisor gave to other machines over the
    /// window (steal time, `sys::box_cpu_ticks`): the vCPUs stood still, the wall clock
    /// did not.
    #[serde(default)]
    pub steal: f64,
}

impl CpuUse {
    /// Busy for less than this share of a CPU, the thread had time to spare.
    pub const SATURATED: f64 = 0.9;
    /// Waiting for a CPU this share of the window or more is the scheduler's doing (one
    /// flow at a third of this box's speed, normal class: 2.3 % and write lateness p99
    /// 0.7–1.1 ms; in the real-time class 0.5 % and 59 µs; bursts beyond the box's speed,
    /// late from work alone: 0.3 %).
    pub const WAITED_SHARE: f64 = 0.01;
    /// Steal from this share on is named as the cause of lateness: a host whose steal rose
    /// to ~20 % made every fabric late (p99 9 ms at time_scale 20000, the thread busy 31 %).
    pub const STOLEN: f64 = 0.05;

    /// Never saturated in the window (not even in a slot: a job that saturated it for a
    /// second and ended is work-bound), but kept off a CPU for a noticeable share of it.
    pub fn preempted(&self) -> bool {
        self.peak_busy < Self::SATURATED
            && self.waited_ms / 1e3 >= Self::WAITED_SHARE * self.window_s
    }

    /// Over `window_s` of wall time in which the thread ran `run_ns` and waited `wait_ns`
    /// (two `Status::thread_cpu_ns` apart); no slots, so the busiest is the average.
    pub fn over(window_s: f64, run_ns: u64, wait_ns: u64) -> CpuUse {
        let busy = run_ns as f64 / 1e9 / window_s.max(1e-9);
        CpuUse {
            window_s,
            busy,
            peak_busy: busy,
            waited_ms: wait_ns as f64 / 1e6,
            steal: 0.0,
        }
    }

    /// From samples of the thread, oldest first (at least two); the busiest slot among
    /// intervals of at least `min_slot`.
    fn of(samples: &[CpuSample], min_slot: StdDuration) -> CpuUse {
        let share = |a: &CpuSample, b: &CpuSample| {
            let span = b.wall.saturating_duration_since(a.wall).as_secs_f64();
            b.run_ns.saturating_sub(a.run_ns) as f64 / 1e9 / span.max(1e-9)
        };
        let (first, last) = (samples[0], samples[samples.len() - 1]);
        let busy = share(&first, &last);
        let peak_busy = samples
            .windows(2)
            .filter(|w| w[1].wall.saturating_duration_since(w[0].wall) >= min_slot)
            .map(|w| share(&w[0], &w[1]))
            .fold(busy, f64::max);
        CpuUse {
            window_s: last
                .wall
                .saturating_duration_since(first.wall)
                .as_secs_f64(),
            busy,
            peak_busy,
            waited_ms: last.wait_ns.saturating_sub(first.wait_ns) as f64 / 1e6,
            steal: sys::steal_share(first.box_ticks, last.box_ticks),
        }
    }
}

/// The data-plane thread at `wall`: its CPU time and run-queue wait (`Ports::thread_cpu`),
/// and the box's CPU ticks, all and stolen (`sys::box_cpu_ticks`; zeros where
/// unreadable).
#[derive(Clone, Copy, Debug)]
struct CpuSample {
    wall: StdInstant,
    run_ns: u64,
    wait_ns: u64,
    box_ticks: (u64, u64),
}

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
    /// (frames cut from one super-packet share it); `Ok(None)` when it has none.
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
    /// `Status::full_load_time_scale`.
    full_load: f64,
    /// The thread (and the box's steal), sampled each window slot, the last `WINDOW` of
    /// them (`CpuUse`).
    cpu: std::collections::VecDeque<CpuSample>,
    /// Told the new rate of a link whose rate changes (GPUs' non-TCP pacing).
    pacer: Option<crate::pace::Pacer>,
    /// The model's `route_epoch` the pacer last heard of.
    route_epoch: u64,
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
            layers: Default::default(),
            next_fault: 0,
            fault_labels: std::collections::HashMap::new(),
            load_timelines: Default::default(),
            next_load: 1,
            captures: Vec::new(),
            next_capture: 0,
            recordings: Vec::new(),
            epoch_ns: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64),
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
            cpu: Default::default(),
            pacer: None,
            route_epoch: 0,
        }
    }

    /// Says in `status` that idle CPUs poll while the fabric is up (the daemon holds the
    /// request; see `Scheduling::idle_poll`).
    pub fn idle_poll(mut self, on: bool) -> Self {
        self.idle_poll = on;
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
        match self.idle_poll {
            true => format!("{thread}; idle CPUs poll (CPU latency 0 held while up)"),
            false => thread,
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
        self.sample_cpu(wall);
        self.rotate_window(wall);
        // No departure pending: sleep until input, or a second for housekeeping.
        let next = [
            self.model.poll_timeout(),
            self.scheduled.keys().next().map(|k| k.0),
            self.recordings.iter().map(|r| r.next).min(),
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
        for &port in &ready {
            self.read_port(port);
        }
        self.ready = ready;
        self.drain_taps();
        true
    }

    fn start_recording(&mut self, spec: RecordSpec) -> Result<u64, String> {
        let mut ports = Vec::new();
        for name in &spec.ports {
            let p = self
                .port_names
                .iter()
                .position(|n| n == name)
                .ok_or_else(|| format!("no port {name:?}"))?;
            ports.push(closbox_fabric::routing::PortId(p as u32));
        }
        if ports.is_empty() {
            return Err("no port to record".into());
        }
        if spec.interval_ns < MIN_RECORD_INTERVAL_NS {
            return Err(format!(
                "--interval must be at least {MIN_RECORD_INTERVAL_NS} ns of fabric time"
            ));
        }
        let short = spec.duration_ns.is_some_and(|d| {
            ports.len() as f64 * (d / spec.interval_ns) as f64 <= SHORT_RECORD_SAMPLES
        });
        let asked = if short {
            0.0
        } else {
            ports.len() as f64 * 1e9 / spec.interval_ns as f64 / self.time_scale.get()
        };
        let others: f64 = self.recordings.iter().map(|r| r.samples_per_wall_s).sum();
        if asked + others > MAX_RECORD_SAMPLES_PER_WALL_S {
            return Err(format!(
                "{} ports every {} of fabric time at time_scale {} are {asked:.0} port samples a second of wall time ({:.0} with the recordings running), more than the {MAX_RECORD_SAMPLES_PER_WALL_S} the data plane takes beside its packets: a longer --interval, fewer --ports, a --duration, or a larger time_scale",
                ports.len(),
                closbox_fabric::Duration::from_nanos(spec.interval_ns),
                self.time_scale,
                asked + others
            ));
        }
        let now = self.fabric_now(self.ports.now());
        self.next_capture += 1;
        let last_busy = ports
            .iter()
            .map(|&p| self.model.port_sample(p, now).1.as_nanos())
            .collect();
        let interval = closbox_fabric::Duration::from_nanos(spec.interval_ns);
        self.recordings.push(Recording {
            id: self.next_capture,
            ports,
            interval,
            next: now + interval,
            until: spec
                .duration_ns
                .map(|d| now + closbox_fabric::Duration::from_nanos(d)),
            tx: spec.tx,
            ended: spec.ended,
            last_busy,
            done: false,
            samples_per_wall_s: asked,
        });
        Ok(self.next_capture)
    }

    /// Takes the samples that are due, each at its own fabric time (the model is advanced
    /// to it first), and ends recordings that are done.
    fn sample_due(&mut self, wall: StdInstant) {
        use std::sync::mpsc::TrySendError;
        if self.recordings.is_empty() {
            return;
        }
        let now = self.fabric_now(wall);
        while let Some(i) = (0..self.recordings.len())
            .filter(|&i| !self.recordings[i].done && self.recordings[i].next <= now)
            .min_by_key(|&i| self.recordings[i].next)
        {
            let t = self.recordings[i].next;
            let model_now = t.max(self.model.now());
            let r = &mut self.recordings[i];
            let mut row = Vec::with_capacity(r.ports.len());
            for (k, &p) in r.ports.iter().enumerate() {
                let (queue, busy) = self.model.port_sample(p, model_now);
                let busy = busy.as_nanos();
                let share = (busy - r.last_busy[k].min(busy)) as f64 / r.interval.as_nanos() as f64;
                r.last_busy[k] = busy;
                row.push((queue, share.min(1.0)));
            }
            match r.tx.try_send((t.as_nanos(), row)) {
                Ok(()) | Err(TrySendError::Full(_)) => {}
                Err(TrySendError::Disconnected(_)) => r.done = true,
            }
            r.next = t + r.interval;
            if r.until.is_some_and(|u| r.next > u) {
                r.ended.set(StreamEnd::Duration);
                r.done = true;
            }
        }
        self.recordings.retain(|r| !r.done);
    }

    /// Hands tapped packets to the captures that want them; ends captures that are done.
    fn drain_taps(&mut self) {
        use std::sync::atomic::Ordering;
        use std::sync::mpsc::TrySendError;
        if self.captures.is_empty() {
            return;
        }
        while let Some(t) = self.model.poll_tapped() {
            for c in self.captures.iter_mut().filter(|c| !c.done) {
                let Some(i) = c.index_of[t.port.0 as usize] else {
                    continue;
                };
                if t.dropped.is_some() && !c.drops {
                    continue;
                }
                c.counters[i as usize][0].fetch_add(1, Ordering::Relaxed);
                let mut copy = t.clone();
                // What the wire would carry: offloaded frames hold partial checksums.
                crate::offload::fill_checksum(&mut copy.data);
                copy.data.truncate(c.snaplen as usize);
                match c.tx.try_send((i, copy)) {
                    Ok(()) => {
                        if let Some(left) = &mut c.left {
                            *left -= 1;
                            if *left == 0 {
                                c.ended.set(StreamEnd::Count);
                                c.done = true;
                            }
                        }
                    }
                    Err(TrySendError::Full(_)) => {
                        c.counters[i as usize][1].fetch_add(1, Ordering::Relaxed);
                    }
                    Err(TrySendError::Disconnected(_)) => c.done = true,
                }
            }
        }
        let now = self.fabric_now(self.ports.now());
        for c in self.captures.iter_mut().filter(|c| !c.done) {
            if c.until.is_some_and(|u| now >= u) {
                c.ended.set(StreamEnd::Duration);
                c.done = true;
            }
        }
        if self.captures.iter().any(|c| c.done) {
            self.captures.retain(|c| !c.done);
            self.retap();
        }
    }

    /// Taps the union of what the captures want.
    fn retap(&mut self) {
        let mut ports = Vec::new();
        let (mut snaplen, mut drops) = (0, false);
        for c in &self.captures {
            for (p, i) in c.index_of.iter().enumerate() {
                if i.is_some() {
                    ports.push(closbox_fabric::routing::PortId(p as u32));
                }
            }
            snaplen = snaplen.max(c.snaplen);
            drops |= c.drops;
        }
        ports.sort();
        ports.dedup();
        self.model.set_taps(&ports, snaplen, drops);
    }

    fn start_capture(&mut self, spec: CaptureSpec) -> Result<CaptureStart, String> {
        let mut index_of = vec![None; self.port_names.len()];
        for (i, name) in spec.ports.iter().enumerate() {
            let p = self
                .port_names
                .iter()
                .position(|n| n == name)
                .ok_or_else(|| {
                    format!(
                        "no port {name:?} (ports are named like {:?})",
                        self.port_names[0]
                    )
                })?;
            if index_of[p].is_some() {
                return Err(format!("port {name} is listed twice"));
            }
            index_of[p] = Some(i as u32);
        }
        if spec.ports.is_empty() {
            return Err("no port to capture".into());
        }
        if spec.count == Some(0) || spec.duration_ns == Some(0) {
            return Err("--count and --duration must be above 0".into());
        }
        self.next_capture += 1;
        let counters: Arc<Vec<[std::sync::atomic::AtomicU64; 2]>> =
            Arc::new((0..spec.ports.len()).map(|_| Default::default()).collect());
        let now = self.fabric_now(self.ports.now());
        self.captures.push(Capture {
            id: self.next_capture,
            index_of,
            tx: spec.tx,
            ended: spec.ended,
            counters: Arc::clone(&counters),
            left: spec.count,
            until: spec
                .duration_ns
                .map(|d| now + closbox_fabric::Duration::from_nanos(d)),
            drops: spec.drops,
            snaplen: spec.snaplen,
            done: false,
        });
        self.retap();
        Ok(CaptureStart {
            id: self.next_capture,
            epoch_ns: self.epoch_ns,
            counters,
        })
    }

    fn read_port(&mut self, host: usize) {
        for _ in 0..READ_BATCH {
            match self.ports.recv(host) {
                Ok(Some((buf, at))) => {
                    // Not before what the model has seen (a frame cut from an earlier read).
                    let now = self.fabric_now(at).max(self.model.now());
                    // Drops are counted by the model; nothing else to do with the verdict.
                    let _ = self.model.send(now, HostId(host as u32), buf);
                }
                Ok(None) => return,
                Err(e) => {
                    self.io_errors += 1;
                    tracing::warn!("reading the port of GPU {host}: {e}");
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

    /// The thread's CPU time and run-queue wait, and the box's ticks, at `wall`; `None`
    /// with a virtual clock.
    fn cpu_sample(&self, wall: StdInstant) -> Option<CpuSample> {
        let (run_ns, wait_ns) = self.ports.thread_cpu()?;
        Some(CpuSample {
            wall,
            run_ns,
            wait_ns,
            box_ticks: sys::box_cpu_ticks().unwrap_or_default(),
        })
    }

    /// A sample of the thread's CPU use each window slot (a file read every 0.5 s).
    fn sample_cpu(&mut self, wall: StdInstant) {
        let slot = WINDOW / WINDOW_SLOTS as u32;
        if self
            .cpu
            .back()
            .is_some_and(|s| wall.saturating_duration_since(s.wall) < slot)
        {
            return;
        }
        let Some(sample) = self.cpu_sample(wall) else {
            return;
        };
        self.cpu.push_back(sample);
        // The oldest kept is the youngest at least `WINDOW` old.
        while self
            .cpu
            .get(1)
            .is_some_and(|s| wall.saturating_duration_since(s.wall) >= WINDOW)
        {
            self.cpu.pop_front();
        }
    }

    /// The thread's CPU use from the oldest sample kept (about `WINDOW` ago) to `now` (a
    /// `cpu_sample`); `None` before a slot has passed, or with a virtual clock.
    fn cpu_recent(&self, now: Option<CpuSample>) -> Option<CpuUse> {
        let now = now?;
        let wall = now.wall;
        let first = self.cpu.front()?;
        let slot = WINDOW / WINDOW_SLOTS as u32;
        if wall.saturating_duration_since(first.wall) < slot {
            return None;
        }
        let mut samples: Vec<_> = self.cpu.iter().copied().collect();
        samples.push(now);
        Some(CpuUse::of(&samples, slot / 2))
    }

    fn rotate_window(&mut self, wall: StdInstant) {
        if wall.duration_since(self.checked) < WINDOW {
            return;
        }
        self.checked = wall;
        let recent = self.recent_lateness(wall);
        let p99 = recent.quantile(0.99);
        tracing::debug!(
            "fabric {}: last {} s: {} writes, lateness p99 {:.1} µs, {} bytes of packets held",
            self.name,
            WINDOW.as_secs(),
            recent.count(),
            p99 as f64 / 1e3,
            self.model.memory().0
        );
        if recent.count() > 100 && p99 > self.behind_ns {
            let quiet = self
                .warned
                .is_none_or(|w| wall.duration_since(w) > StdDuration::from_secs(30));
            if quiet {
                tracing::warn!(
                    "fabric {}: packets leave {:.0} µs late (p99, last {} s): {}",
                    self.name,
                    p99 as f64 / 1e3,
                    WINDOW.as_secs(),
                    behind_advice(
                        self.time_scale.get(),
                        self.full_load,
                        self.cpu_recent(self.cpu_sample(wall)).as_ref(),
                        self.realtime.is_some()
                    )
                );
                self.warned = Some(wall);
            }
        }
    }

    fn recent_lateness(&mut self, wall: StdInstant) -> Histogram {
        self.recent
            .snapshot(wall.saturating_duration_since(self.start).as_nanos() as u64)
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
                Ctl::Schedule(items, faults, reply) => {
                    let _ = reply.send(self.schedule_faults(&items, &faults));
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
                Ctl::Flows(reply) => {
                    let _ = reply.send(self.flows());
                }
                Ctl::Record(spec, reply) => {
                    let _ = reply.send(self.start_recording(spec));
                }
                Ctl::EndRecord(id) => {
                    self.recordings.retain(|r| r.id != id);
                }
                Ctl::Events(reply) => {
                    let _ = reply.send(self.events.clone());
                }
            }
        }
        true
    }

    /// A snapshot of counters and lateness (what `closbox status` shows).
    pub fn status(&mut self) -> Status {
        let wall = self.ports.now();
        // One read of the thread's schedstat (and the box's ticks) for both the window and
        // the totals.
        let cpu = self.cpu_sample(wall);
        let now = self.fabric_now(wall);
        let totals = self.model.totals(now);
        let elapsed = now.as_nanos().max(1) as f64;
        let mut ports = self
            .model
            .port_counters(now)
            .iter()
            .zip(&self.port_names)
            .map(|(c, name)| PortStatus {
                port: name.clone(),
                rx_packets: c.rx_packets,
                tx_packets: c.tx_packets,
                tx_bytes: c.tx_bytes,
                drops_buffer: c.drops.get(DropReason::BufferFull),
                drops_loss: c.drops.get(DropReason::Loss),
                ecn_marked: c.ecn_marked,
                max_queue_bytes: c.max_queue_bytes,
                utilization: c.busy.as_nanos() as f64 / elapsed,
                load_tx_bytes: c.load_tx_bytes,
                load_drops: c.load_drops,
                drops_link_down: c.drops.get(DropReason::LinkDown),
                queue_bytes: 0,
                class: String::new(),
                rate_bps: 0,
                up: true,
                pause_events: c.pause_events,
                paused_s: c.paused.as_nanos() as f64 / 1e9,
                paused_now: false,
                max_ingress_bytes: c.max_ingress_bytes,
            })
            .collect::<Vec<_>>();
        let paused = self.model.paused_ports();
        let deadlock_after = self.model.flow_control().pause().map(|p| p.deadlock_after);
        let mut deadlocked = Vec::new();
        for (p, since) in &paused {
            ports[p.0 as usize].paused_now = true;
            let held = now.saturating_since(*since);
            if deadlock_after.is_some_and(|d| held > d) {
                deadlocked.push((
                    ports[p.0 as usize].port.clone(),
                    held.as_nanos() as f64 / 1e9,
                ));
            }
        }
        let changed = self.model.changed_links();
        for (i, p) in ports.iter_mut().enumerate() {
            let id = closbox_fabric::routing::PortId(i as u32);
            let link = self.model.routes().port(id).link;
            p.queue_bytes = self.model.queued(id).1;
            p.class = self.topo.links[link as usize].class.name().to_owned();
            p.rate_bps = self.model.link_of(id).rate.bps();
            p.up = !changed.iter().any(|l| l.link == link && !l.up);
        }
        let loads = self.load_info();
        let lateness_recent = Lateness::of(&self.recent_lateness(wall));
        Status {
            fabric: self.name.clone(),
            gpus: self.ports.count(),
            time_scale: self.time_scale,
            uptime_s: wall.duration_since(self.start).as_secs_f64(),
            fabric_time_s: now.as_nanos() as f64 / 1e9,
            packets_in: totals.sent,
            delivered: totals.delivered,
            queued: totals.queued,
            in_flight: totals.in_flight,
            drops: DropReason::ALL
                .iter()
                .map(|r| (r.name().to_owned(), totals.drops.get(*r)))
                .collect(),
            lateness: Lateness::of(&self.lateness),
            lateness_buckets: self.lateness.buckets(),
            behind: lateness_recent.behind(self.behind_ns as f64 / 1e3),
            behind_threshold_us: self.behind_ns as f64 / 1e3,
            full_load_time_scale: self.full_load,
            lateness_recent,
            io_errors: self.io_errors,
            packet_memory: self.model.memory().0,
            packet_memory_limit: self.model.memory().1,
            tun_tx_dropped: None,
            gpu_rx_dropped: None,
            ports,
            changed_links: self
                .model
                .changed_links()
                .into_iter()
                .map(|l| LinkStatus {
                    link: chaos::link_name(&self.topo, l.link),
                    id: l.link,
                    up: l.up,
                    down_since_s: l.down_since.map(|t| t.as_nanos() as f64 / 1e9),
                    rate_bps: l.params[0].rate.bps(),
                    delay_ns: l.params[0].delay.as_nanos(),
                    loss: l.params[0].loss,
                    loss_burst: l.params[0].loss_burst,
                    buffer_bytes: [l.buffers[0].get(), l.buffers[1].get()],
                    b_to_a: (l.params[1] != l.params[0]).then(|| DirectionStatus::of(&l.params[1])),
                    ends: {
                        let (a, b, _) = chaos::link_ref(&self.topo, l.link);
                        [a, b]
                    },
                    down_by: self.layers.down_by(l.link),
                    degraded_by: self.layers.degraded_by(l.link),
                })
                .collect(),
            events: self.events_total,
            partition: self.model.partition().map_or_else(Vec::new, |groups| {
                let sides = groups.iter().max().map_or(0, |m| *m as usize + 1);
                let mut out = vec![Vec::new(); sides];
                for (h, &g) in groups.iter().enumerate() {
                    out[g as usize].push(self.topo.hosts[h].name.clone());
                }
                out.retain(|s| !s.is_empty());
                out
            }),
            loads,
            pending_changes: self.scheduled.len(),
            timelines: {
                let mut t: Vec<TimelineStatus> = self
                    .broken
                    .iter()
                    .map(|(&id, b)| TimelineStatus {
                        id,
                        pending: b.pending,
                        loads: b.loads.clone(),
                    })
                    .collect();
                t.sort_by_key(|t| t.id);
                t
            },
            timelines_started: self.timelines,
            flow_control: self.model.flow_control().name().to_owned(),
            deadlocked,
            deadlock_after_s: deadlock_after.map_or(0.0, |d| d.as_nanos() as f64 / 1e9),
            scheduling: self.scheduling(),
            realtime: self.realtime.is_some(),
            idle_poll: self.idle_poll,
            gpu_pacing: self.pacer.is_some(),
            cpu_recent: self.cpu_recent(cpu),
            thread_cpu_ns: cpu.map(|c| (c.run_ns, c.wait_ns)),
            box_cpu_ticks: cpu.map(|c| c.box_ticks),
        }
    }

    /// Per-flow counters, heaviest first, with their paths as vertex names.
    pub fn flows(&mut self) -> Flows {
        let now = self.fabric_now(self.ports.now());
        self.model.advance(now);
        let (flows, untracked) = self.model.flows();
        let h = self.topo.hosts.len() as u32;
        let vname = |v: u32| {
            if v < h {
                self.topo.hosts[v as usize].name.clone()
            } else {
                self.topo.switches[(v - h) as usize].name.clone()
            }
        };
        let gpu = |a: std::net::Ipv4Addr| {
            self.topo
                .hosts
                .iter()
                .find(|x| x.addr == a)
                .map_or(String::new(), |x| x.name.clone())
        };
        let switch = |a: std::net::Ipv4Addr| {
            (0..self.topo.switches.len() as u32)
                .find(|&i| self.topo.switch_addr(closbox_fabric::topology::SwitchId(i)) == Some(a))
                .map_or(String::new(), |i| {
                    self.topo.switches[i as usize].name.clone()
                })
        };
        let mut out: Vec<FlowInfo> = flows
            .into_iter()
            .map(|(k, c)| {
                let hops = self.model.flow_path(&k).unwrap_or_default();
                let routes = self.model.routes();
                let mut path = Vec::with_capacity(hops.len() + 1);
                if let Some(first) = hops.first() {
                    path.push(vname(routes.port(*first).from));
                }
                path.extend(hops.iter().map(|p| vname(routes.port(*p).to)));
                let ports = hops
                    .iter()
                    .map(|p| self.port_names[p.0 as usize].clone())
                    .collect();
                FlowInfo {
                    src: k.src.to_string(),
                    dst: k.dst.to_string(),
                    proto: match k.proto {
                        6 => "tcp".into(),
                        17 => "udp".into(),
                        1 => "icmp".into(),
                        p => p.to_string(),
                    },
                    sport: k.sport,
                    dport: k.dport,
                    src_gpu: gpu(k.src),
                    dst_gpu: gpu(k.dst),
                    dst_switch: switch(k.dst),
                    packets: c.packets,
                    bytes: c.bytes,
                    drops: c.drops,
                    ecn_marked: c.ecn_marked,
                    first_s: c.first.as_nanos() as f64 / 1e9,
                    last_s: c.last.as_nanos() as f64 / 1e9,
                    path,
                    ports,
                }
            })
            .collect();
        out.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.src.cmp(&b.src)));
        Flows {
            fabric_time_s: now.as_nanos() as f64 / 1e9,
            flows: out,
            untracked_packets: untracked,
        }
    }

    fn load_info(&self) -> Vec<LoadInfo> {
        let vname = |v: u32| {
            let h = self.topo.hosts.len() as u32;
            if v < h {
                self.topo.hosts[v as usize].name.clone()
            } else {
                self.topo.switches[(v - h) as usize].name.clone()
            }
        };
        self.model
            .loads()
            .into_iter()
            .map(|l| {
                use closbox_fabric::load::Pattern;
                let rate = l.spec.rate.bps();
                let (mean, pattern) = match l.spec.pattern {
                    Pattern::Steady => (rate as f64, "steady".to_owned()),
                    Pattern::OnOff { on, off } => (
                        rate as f64 * on.as_nanos() as f64 / (on + off).as_nanos() as f64,
                        format!("on {on} / off {off}"),
                    ),
                    Pattern::Bursts {
                        bytes,
                        every,
                        count,
                    } => (
                        (rate as f64).min(bytes as f64 * 8.0 / every.as_secs_f64()),
                        if count == 1 {
                            format!("one burst of {}", closbox_fabric::Bytes::new(bytes))
                        } else {
                            format!(
                                "bursts of {} every {every} x {count}",
                                closbox_fabric::Bytes::new(bytes)
                            )
                        },
                    ),
                };
                let c = l.counters;
                LoadInfo {
                    id: l.spec.id,
                    from: vname(l.spec.from),
                    to: vname(l.spec.to),
                    rate_bps: rate,
                    mean_bps: mean,
                    pattern,
                    active: l.active,
                    started_s: l.started.as_nanos() as f64 / 1e9,
                    sent_bytes: c.sent_bytes,
                    delivered_bytes: c.delivered_bytes,
                    ecn_marked: c.ecn_marked,
                    drops: DropReason::ALL
                        .iter()
                        .filter(|r| c.drops.get(**r) > 0)
                        .map(|r| (r.name().to_owned(), c.drops.get(*r)))
                        .collect(),
                    port_shares: if l.active {
                        self.model
                            .load_shares(l.spec.id)
                            .into_iter()
                            .map(|(p, s)| (p.0, s))
                            .collect()
                    } else {
                        Vec::new()
                    },
                }
            })
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .scan(0usize, |done, l| {
                // Every running load, and the last few finished ones.
                *done += usize::from(!l.active);
                Some((*done <= MAX_DONE_LOADS || l.active).then_some(l))
            })
            .flatten()
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect()
    }
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
mod tests {
    use super::*;

    fn shortest(body: &str) -> u64 {
        let t =
            closbox_fabric::parse(&format!("[fabric]\nname = \"t\"\n{body}"), "t.toml").unwrap();
        shortest_gpu_path(&t, &Routes::new(&t))
    }

    /// Ports in memory on a virtual clock: packets are queued to arrive at given times;
    /// a wait jumps the clock to the next arrival or the timeout (at least 1 µs, as the
    /// real loop's polling would take), never sleeping.
    struct MemPorts {
        start: StdInstant,
        elapsed: StdDuration,
        inbox: Vec<std::collections::VecDeque<(StdDuration, Vec<u8>)>>,
        sent: Vec<(usize, StdDuration, Frame)>,
        done: Vec<(u64, bool)>,
    }

    impl MemPorts {
        fn new(n: usize) -> MemPorts {
            MemPorts {
                start: StdInstant::now(),
                elapsed: StdDuration::ZERO,
                inbox: vec![Default::default(); n],
                sent: Vec::new(),
                done: Vec::new(),
            }
        }
    }

    impl Ports for MemPorts {
        fn count(&self) -> usize {
            self.inbox.len()
        }

        fn now(&self) -> StdInstant {
            self.start + self.elapsed
        }

        fn wait(&mut self, timeout: StdDuration, ready: &mut Vec<usize>) -> io::Result<()> {
            let until = self.elapsed + timeout.max(StdDuration::from_micros(1));
            let next = self
                .inbox
                .iter()
                .filter_map(|q| q.front().map(|p| p.0))
                .min();
            match next {
                Some(t) if t <= until => self.elapsed = self.elapsed.max(t),
                _ => self.elapsed = until,
            }
            for (i, q) in self.inbox.iter().enumerate() {
                if q.front().is_some_and(|p| p.0 <= self.elapsed) {
                    ready.push(i);
                }
            }
            Ok(())
        }

        fn recv(&mut self, port: usize) -> io::Result<Option<(Frame, StdInstant)>> {
            let q = &mut self.inbox[port];
            if q.front().is_none_or(|p| p.0 > self.elapsed) {
                return Ok(None);
            }
            Ok(q.pop_front()
                .map(|(_, p)| (p.into(), self.start + self.elapsed)))
        }

        fn send(&mut self, out: &mut Vec<Outgoing>) {
            for o in out.drain(..) {
                let late = self.now().saturating_duration_since(o.due).as_nanos() as u64;
                self.done.push((late, false));
                self.sent.push((o.port, self.elapsed, o.data));
            }
        }

        fn finished(&mut self, done: &mut Vec<(u64, bool)>) {
            done.append(&mut self.done);
        }
    }

    fn plane(body: &str) -> (DataPlane<MemPorts>, Topology) {
        let t =
            closbox_fabric::parse(&format!("[fabric]\nname = \"t\"\n{body}"), "t.toml").unwrap();
        let (_tx, rx) = std::sync::mpsc::channel();
        (DataPlane::new(&t, MemPorts::new(t.hosts.len()), rx), t)
    }

    fn udp(t: &Topology, from: usize, to: usize, len: usize) -> Vec<u8> {
        closbox_fabric::packet::build_udp(t.hosts[from].addr, t.hosts[to].addr, 1, 2, 0, len)
    }

    const TWO: &str = "[topology]\nkind = \"single-switch\"\ngpus = 2\n[links.nic]\nrate = \"1Gbit\"\ndelay = \"1us\"\n[switches.leaf]\nlatency = \"500ns\"\n";

    #[test]
    fn a_packet_leaves_at_its_fabric_time_scaled_to_the_wall_clock() {
        for k in [1u64, 1000] {
            let (mut dp, t) = plane(&format!("time_scale = {k}\n{TWO}"));
            // 1000 B + 38 B of framing = 8304 ns a hop at 1 Gbit/s, twice; 1 µs a link,
            // twice; 500 ns in the switch.
            let fabric_ns = 2 * 8304 + 2 * 1000 + 500;
            let sent_at = StdDuration::from_micros(3);
            dp.ports.inbox[0].push_back((sent_at, udp(&t, 0, 1, 1000)));
            for _ in 0..10_000 {
                dp.step();
                if !dp.ports.sent.is_empty() {
                    break;
                }
            }
            let (port, at, data) = dp.ports.sent[0].clone();
            assert_eq!(port, 1);
            assert_eq!(data.len(), 1000);
            let want = sent_at + StdDuration::from_nanos(fabric_ns * k);
            // The loop polls in 1 µs steps once it is within SPIN of the departure.
            assert!(
                at >= want && at <= want + StdDuration::from_micros(1),
                "k {k}: {at:?} vs {want:?}"
            );
            let st = dp.status();
            assert_eq!((st.packets_in, st.delivered), (1, 1));
            assert_eq!(st.lateness.samples, 1);
            assert!(st.lateness.max_us <= 1.0, "{:?}", st.lateness);
        }
    }

    #[test]
    fn the_wake_margin_follows_late_wake_ups_and_decays() {
        let mut m = WakeMargin::default();
        assert_eq!(m.get(), SPIN);
        m.observe(StdDuration::from_micros(200));
        assert_eq!(m.get(), StdDuration::from_micros(210));
        // On time for a while: back down to SPIN.
        for _ in 0..400 {
            m.observe(StdDuration::ZERO);
        }
        assert_eq!(m.get(), SPIN);
        m.observe(StdDuration::from_secs(1));
        assert_eq!(m.get(), MAX_SPIN);
    }

    #[test]
    fn the_loop_counts_drops_and_stops_on_request() {
        let (mut dp, t) = plane(TWO);
        // Not IPv4, a packet to nowhere, TTL 1 (expires in the switch): all dropped.
        let mut ttl1 = udp(&t, 0, 1, 100);
        closbox_fabric::packet::set_ttl(&mut ttl1, 1);
        for p in [vec![0x60; 40], udp(&t, 0, 0, 100), ttl1] {
            dp.ports.inbox[0].push_back((StdDuration::ZERO, p));
        }
        for _ in 0..100 {
            dp.step();
        }
        let st = dp.status();
        let drops: std::collections::BTreeMap<String, u64> = st.drops.into_iter().collect();
        assert_eq!(drops["unsupported"], 1);
        assert_eq!(drops["no_route"], 1);
        assert_eq!(drops["ttl_expired"], 1);
        // Nothing reached gpu1; gpu0 got the switch's ICMP time exceeded.
        assert_eq!(dp.ports.sent.len(), 1, "{:?}", dp.ports.sent);
        let (port, _, icmp) = &dp.ports.sent[0];
        let icmp = icmp.to_vec();
        assert_eq!((*port, icmp[9], icmp[20]), (0, 1, 11));
        // A stop request ends the loop.
        let (tx, rx) = std::sync::mpsc::channel();
        dp.ctl = rx;
        tx.send(Ctl::Stop).unwrap();
        assert!(!dp.step());
    }

    #[test]
    fn a_flap_is_applied_on_schedule_in_fabric_time() {
        let (mut dp, _t) = plane(&format!("time_scale = 10\n{TWO}"));
        let now = dp.applied_now();
        let applied = dp
            .change(&ChangeRequest::LinkFlap {
                a: "gpu0".into(),
                b: "sw0".into(),
                index: None,
                down_ns: 10_000,
                up_ns: 5_000,
                count: 2,
            })
            .unwrap();
        assert_eq!(applied.len(), 1, "the first down is now");
        for _ in 0..100_000 {
            dp.step();
            if dp.events.len() == 4 {
                break;
            }
        }
        let got: Vec<(u64, &str)> = dp
            .events
            .iter()
            .map(|e| (e.fabric_ns - now, e.what.as_str()))
            .collect();
        let whats: Vec<&str> = got.iter().map(|g| g.1).collect();
        assert_eq!(
            whats,
            [
                "link gpu0-sw0 #0 down (flap 1 of 2)",
                "link gpu0-sw0 #0 up (flap 1 of 2)",
                "link gpu0-sw0 #0 down (flap 2 of 2)",
                "link gpu0-sw0 #0 up (flap 2 of 2)"
            ]
        );
        // On time to within the loop's 1 µs polling (0.1 µs of fabric time at k = 10).
        for ((at, _), want) in got.iter().zip([0u64, 10_000, 15_000, 25_000]) {
            assert!(*at >= want && *at <= want + 200, "{at} vs {want}");
        }
        let e = dp
            .change(&ChangeRequest::LinkFlap {
                a: "gpu0".into(),
                b: "sw0".into(),
                index: None,
                down_ns: 0,
                up_ns: 5_000,
                count: 2,
            })
            .unwrap_err();
        assert!(e.contains("above 0"), "{e}");
    }

    /// A leaf-spine of 4 GPUs under 2 spines, 1 Gbit/s, detection 20 µs, convergence
    /// 100 µs.
    const LS: &str = "failure_detection = \"20us\"\nroute_convergence = \"100us\"\n[topology]\nkind = \"leaf-spine\"\nleaves = 2\nspines = 2\ngpus_per_leaf = 2\n[links.nic]\nrate = \"1Gbit\"\n[links.leaf-spine]\nrate = \"1Gbit\"\n";

    /// Event log (fabric ns since start, what), drops by reason, the load's drops.
    type Replay = (Vec<(u64, String)>, Vec<(String, u64)>, u64);

    /// Runs a seeded random-flap scenario with a load and GPU traffic across the spines:
    /// the event log (fabric times relative to the start) and the drop counts.
    fn flap_run(seed: u64) -> Replay {
        let (mut dp, t) = plane(LS);
        let scenario = crate::scenario::parse(
            &format!(
                "seed = {seed}\n[[event]]\nat = \"0ns\"\ndo = \"load\"\nfrom = \"gpu2\"\nto = \"leaf0\"\nrate = \"300Mbit\"\nfor = \"5ms\"\n[[random]]\ndo = \"link-flap\"\nlinks = \"leaf-spine\"\nmtbf = \"1ms\"\nmttr = \"200us\"\nuntil = \"5ms\"\n"
            ),
            "s.toml",
            &t,
        )
        .unwrap();
        // gpu0 → gpu2 and gpu3 → gpu1: a 1000-byte packet every 20 µs each, 250 of them,
        // several flows so that ECMP uses both spines.
        for i in 0..250u64 {
            let at = StdDuration::from_micros(20 * i + 3);
            let flow = |from: usize, to: usize| {
                let (a, b) = (t.hosts[from].addr, t.hosts[to].addr);
                closbox_fabric::packet::build_udp(a, b, 1 + (i % 7) as u16, 2, 0, 1000)
            };
            dp.ports.inbox[0].push_back((at, flow(0, 2)));
            dp.ports.inbox[3].push_back((at, flow(3, 1)));
        }
        let start = dp.applied_now();
        let (_, applied) = dp.schedule(&scenario.items).unwrap();
        assert_eq!(applied.len(), 1, "the load starts at once");
        while dp.ports.elapsed < StdDuration::from_millis(8) {
            dp.step();
        }
        let st = dp.status();
        assert_eq!(st.pending_changes, 0);
        assert!(st.delivered > 250, "most get through: {}", st.delivered);
        let load_drops: u64 = st
            .loads
            .iter()
            .flat_map(|l| l.drops.iter())
            .map(|d| d.1)
            .sum();
        let log = dp
            .events
            .iter()
            .map(|e| (e.fabric_ns - start, e.what.clone()))
            .collect();
        (log, st.drops, load_drops)
    }

    #[test]
    fn a_seeded_flap_scenario_replays_exactly() {
        let (log, drops, load_drops) = flap_run(11);
        assert_eq!(flap_run(11), (log.clone(), drops.clone(), load_drops));
        let downs = log.iter().filter(|e| e.1.ends_with(" down")).count();
        assert!(downs >= 5, "{log:?}");
        let lost = |r: &str| drops.iter().find(|d| d.0 == r).unwrap().1;
        assert!(lost("link_down") + lost("no_route") > 0, "{drops:?}");
        assert!(load_drops > 0);
        let (other, _, _) = flap_run(12);
        assert_ne!(other, log, "another seed, other faults");
    }

    /// Random changes by hand and by scenarios (downs, ups, sets, resets, flaps, switch
    /// failures, partitions, cancels) on a small fabric, time passing between them: after
    /// each, a link is down exactly while someone holds it down, and every link is at its
    /// own values under the degrades in place; a reset leaves nothing held.
    #[test]
    fn holds_follow_the_fabric_under_random_changes() {
        use closbox_fabric::routing::PortId;
        const LINKS: [(&str, &str); 5] = [
            ("leaf0", "spine0"),
            ("leaf0", "spine1"),
            ("leaf1", "spine0"),
            ("leaf1", "spine1"),
            ("gpu0", "leaf0"),
        ];
        let mut checked = 0;
        for seed in 0..12 {
            let (mut dp, t) = plane(LS);
            let mut rng = closbox_fabric::rng::Rng::new(seed, 7);
            let ms = |rng: &mut closbox_fabric::rng::Rng| (1 + rng.below(3) as u64) * 1_000_000;
            let random = |rng: &mut closbox_fabric::rng::Rng| {
                let (a, b) = LINKS[rng.below(LINKS.len() as u32) as usize];
                let from = (a == "leaf0" && rng.below(3) == 0).then(|| "leaf0".to_owned());
                let (a, b) = (a.to_owned(), b.to_owned());
                let spine = format!("spine{}", rng.below(2));
                match rng.below(9) {
                    0 => ChangeRequest::LinkDown { a, b, index: None },
                    1 => ChangeRequest::LinkUp { a, b, index: None },
                    2 => ChangeRequest::LinkSet {
                        a,
                        b,
                        index: None,
                        rate_bps: (rng.below(2) == 0)
                            .then(|| 1_000_000 * (1 + rng.below(900) as u64)),
                        delay_ns: (rng.below(2) == 0).then(|| 1_000 * rng.below(50) as u64),
                        loss: Some(rng.below(10) as f64 / 100.0),
                        loss_burst: None,
                        buffer_bytes: None,
                        from,
                    },
                    3 => ChangeRequest::LinkReset { a, b, index: None },
                    4 => ChangeRequest::SwitchDown { name: spine },
                    5 => ChangeRequest::SwitchUp { name: spine },
                    6 => ChangeRequest::LinkFlap {
                        a,
                        b,
                        index: None,
                        down_ns: ms(rng),
                        up_ns: ms(rng),
                        count: 1 + rng.below(3),
                    },
                    7 => ChangeRequest::Partition {
                        groups: vec![vec![format!("gpu{}", rng.below(4))]],
                    },
                    _ => ChangeRequest::Heal,
                }
            };
            for _ in 0..200 {
                match rng.below(6) {
                    0 | 1 => {
                        let req = random(&mut rng);
                        let _ = dp.change(&req);
                    }
                    2 | 3 => {
                        let items: Vec<(u64, ChangeRequest)> = (0..1 + rng.below(3))
                            .map(|_| (rng.below(4) as u64 * 1_000_000, random(&mut rng)))
                            .collect();
                        let faults: Vec<u32> = items.iter().map(|_| rng.below(3)).collect();
                        let _ = dp.schedule_faults(&items, &faults);
                    }
                    4 => {
                        let t = rng.below(dp.timelines as u32 + 1) as u64;
                        dp.cancel((rng.below(5) != 0).then_some(t));
                    }
                    _ => {}
                }
                let until = dp.ports.elapsed + StdDuration::from_micros(rng.below(3_000) as u64);
                while dp.ports.elapsed < until {
                    dp.step();
                }
                for l in 0..t.links.len() as u32 {
                    let up = dp.model.changed_links().iter().all(|c| c.link != l || c.up);
                    assert_eq!(up, !dp.layers.held_down(l), "seed {seed}: link {l}");
                    for end in 0..2 {
                        let model = &dp.model;
                        let want = dp
                            .layers
                            .expected(l, end, |l, e| model.original_of(PortId(2 * l + e as u32)));
                        let port = PortId(2 * l + end as u32);
                        assert_eq!(dp.model.link_of(port), want.0, "seed {seed}: link {l}");
                        checked += 1;
                    }
                }
            }
            dp.change(&ChangeRequest::Reset).unwrap();
            assert!(dp.status().changed_links.is_empty(), "seed {seed}");
            assert!(dp.status().partition.is_empty(), "seed {seed}");
            assert!(dp.layers.is_empty(), "seed {seed}");
        }
        assert!(checked > 10_000);
    }

    /// Schedules scenario `text` (checked against `t`) on `dp`: its timeline.
    fn run_scenario(dp: &mut DataPlane<MemPorts>, t: &Topology, text: &str) -> u64 {
        let scenario = crate::scenario::parse(text, "s.toml", t).unwrap();
        dp.schedule_faults(&scenario.items, &scenario.faults)
            .unwrap()
            .0
    }

    /// Random faults of one scenario that overlap: while a random spine failure lasts,
    /// every link of that spine stays down, whatever the random link flaps over its links
    /// do; and the fabric is whole at the end.
    #[test]
    fn random_faults_of_one_scenario_overlap_faithfully() {
        let (mut dp, t) = plane(LS);
        let timeline = run_scenario(
            &mut dp,
            &t,
            "seed = 3\n[[random]]\ndo = \"switch-flap\"\nswitches = \"spine\"\nmtbf = \"2ms\"\nmttr = \"1ms\"\nuntil = \"30ms\"\n\
             [[random]]\ndo = \"link-flap\"\nlinks = \"leaf-spine\"\nmtbf = \"500us\"\nmttr = \"200us\"\nuntil = \"30ms\"\n",
        );
        let spine_links = |spine: &str| -> Vec<u32> {
            (0..t.links.len() as u32)
                .filter(|&l| chaos::link_name(&t, l).contains(spine))
                .collect()
        };
        let (mut seen, mut checked, mut held) = (0, 0, 0);
        let mut dead = std::collections::BTreeSet::new();
        while dp.ports.elapsed < StdDuration::from_millis(40) {
            dp.step();
            for e in &dp.events[seen..] {
                for spine in ["spine0", "spine1"] {
                    if e.what.starts_with(&format!("switch {spine} down")) {
                        dead.insert(spine);
                    }
                    if e.what.starts_with(&format!("switch {spine} up")) {
                        dead.remove(spine);
                    }
                }
                // A link flap's return under a dead spine names the spine; a spine's
                // return with one of its links failed names a link failure.
                if let Some(rest) = e.what.strip_suffix(&format!(" of timeline {timeline})")) {
                    match rest.split_once(" up (held down by switch ") {
                        Some((link, by)) => {
                            assert!(dead.contains(by), "{}: {by} is not down", e.what);
                            assert!(link.contains(by), "{}", e.what);
                        }
                        None => assert!(
                            e.what.starts_with("switch ")
                                && rest.ends_with(" held down by a link failure"),
                            "{}",
                            e.what
                        ),
                    }
                    held += 1;
                }
            }
            seen = dp.events.len();
            let down: Vec<u32> = dp
                .status()
                .changed_links
                .iter()
                .filter(|l| !l.up)
                .map(|l| l.id)
                .collect();
            for spine in &dead {
                for l in spine_links(spine) {
                    assert!(down.contains(&l), "{spine} is down, its link {l} is up");
                    checked += 1;
                }
            }
        }
        assert!(
            checked > 0 && held > 0,
            "the faults overlapped: {checked}, {held}"
        );
        assert_eq!(dp.status().pending_changes, 0);
        assert!(dp.status().changed_links.is_empty());
        assert!(dp.layers.is_empty());
    }

    /// A scenario's own steps (`[[event]]`s) that overlap: a link down, then its spine,
    /// then the link up: the link stays down until the spine is back (the link's up undoes
    /// the link's down only). And a spine's up does not bring up a link its leaf's failure
    /// holds down.
    #[test]
    fn a_scenarios_own_steps_overlap_faithfully() {
        let (mut dp, t) = plane(LS);
        let timeline = run_scenario(
            &mut dp,
            &t,
            "[[event]]\nat = \"1ms\"\ndo = \"link-down\"\na = \"leaf0\"\nb = \"spine0\"\n\
             [[event]]\nat = \"2ms\"\ndo = \"switch-down\"\nname = \"spine0\"\n\
             [[event]]\nat = \"3ms\"\ndo = \"link-up\"\na = \"leaf0\"\nb = \"spine0\"\n\
             [[event]]\nat = \"4ms\"\ndo = \"switch-down\"\nname = \"leaf0\"\n\
             [[event]]\nat = \"5ms\"\ndo = \"switch-up\"\nname = \"spine0\"\n\
             [[event]]\nat = \"6ms\"\ndo = \"switch-up\"\nname = \"leaf0\"\n",
        );
        let link = (0..t.links.len() as u32)
            .find(|&l| chaos::link_name(&t, l) == "leaf0-spine0 #0")
            .unwrap();
        let down = |dp: &mut DataPlane<MemPorts>| {
            dp.status()
                .changed_links
                .iter()
                .any(|l| l.id == link && !l.up)
        };
        let at = |dp: &mut DataPlane<MemPorts>, us: u64| {
            while dp.ports.elapsed < StdDuration::from_micros(us) {
                dp.step();
            }
            down(dp)
        };
        assert!(at(&mut dp, 1_500), "the link's own down");
        assert!(at(&mut dp, 3_500), "the link came up under its dead spine");
        let held =
            format!("link leaf0-spine0 #0 up (held down by switch spine0 of timeline {timeline})");
        assert!(dp.events.iter().any(|e| e.what == held), "{:#?}", dp.events);
        assert!(at(&mut dp, 5_500), "the link came up under its dead leaf");
        let held = format!("(1 of 2 held down by switch leaf0 of timeline {timeline})");
        assert!(
            dp.events
                .iter()
                .any(|e| e.what.starts_with("switch spine0 up") && e.what.ends_with(&held)),
            "{:#?}",
            dp.events
        );
        assert!(!at(&mut dp, 6_500), "both ends back: the link is up");
        assert!(dp.status().changed_links.is_empty());
        assert!(dp.layers.is_empty());
    }

    #[test]
    fn a_switch_going_down_is_one_event_that_says_what_was_down_already() {
        let (mut dp, _t) = plane(LS);
        let links_down = |dp: &mut DataPlane<MemPorts>| {
            dp.status().changed_links.iter().filter(|l| !l.up).count()
        };
        let one = ChangeRequest::LinkDown {
            a: "leaf0".into(),
            b: "spine0".into(),
            index: None,
        };
        assert_eq!(dp.change(&one).unwrap().len(), 1);
        let spine = ChangeRequest::SwitchDown {
            name: "spine0".into(),
        };
        let events = dp.change(&spine).unwrap();
        let what: Vec<&str> = events.iter().map(|e| e.what.as_str()).collect();
        assert_eq!(
            what,
            ["switch spine0 down (2 links, to leaf0, leaf1) (1 of 2 already so)"]
        );
        assert_eq!(links_down(&mut dp), 2, "every link of spine0");
        let events = dp.change(&spine).unwrap();
        assert!(events[0].what.ends_with(") (already so)"), "{events:?}");
        let up = ChangeRequest::SwitchUp {
            name: "spine0".into(),
        };
        assert_eq!(
            dp.change(&up).unwrap()[0].what,
            "switch spine0 up (2 links, to leaf0, leaf1)"
        );
        assert_eq!(links_down(&mut dp), 0);
        assert_eq!(dp.status().events, 4, "one event per request");
        // What may be pending is counted in the model's changes, a link each here.
        let many: Vec<(u64, ChangeRequest)> = (0..MAX_PENDING as u64 / 2 + 1)
            .map(|i| (1_000 + i, spine.clone()))
            .collect();
        let e = dp.schedule(&many).unwrap_err();
        assert_eq!(
            e,
            format!(
                "{} changes would be pending; at most {MAX_PENDING} may be",
                MAX_PENDING + 2
            )
        );
        assert_eq!(dp.status().pending_changes, 0);
    }

    #[test]
    fn a_timeline_is_checked_whole_and_can_be_cancelled() {
        let (mut dp, _t) = plane(LS);
        let down = |b: &str| ChangeRequest::LinkDown {
            a: "leaf0".into(),
            b: b.into(),
            index: None,
        };
        let e = dp
            .schedule(&[(1_000, down("spine0")), (2_000, down("spine9"))])
            .unwrap_err();
        assert!(
            e.starts_with("change 2 of 2: no GPU or switch \"spine9\""),
            "{e}"
        );
        assert_eq!(dp.status().pending_changes, 0, "none of it");
        let (a, _) = dp.schedule(&[(1_000_000, down("spine0"))]).unwrap();
        let (b, _) = dp.schedule(&[(1_000_000, down("spine1"))]).unwrap();
        assert_ne!(a, b);
        assert_eq!(dp.cancel(Some(a)).0, 1);
        assert_eq!(dp.status().pending_changes, 1);
        assert_eq!(dp.cancel(None).0, 1);
        let e = dp
            .change(&ChangeRequest::LoadStop { id: None })
            .unwrap_err();
        assert_eq!(e, "no load is running");
    }

    /// `reset` undoes everything at once, as one event that says what it took, and forgets
    /// what was set by hand; a second one has nothing to undo.
    #[test]
    fn a_reset_puts_the_fabric_back_as_its_topology_made_it() {
        let (mut dp, _t) = plane(LS);
        let link = |b: &str| ("leaf0".to_owned(), b.to_owned());
        let (a, b) = link("spine0");
        dp.change(&ChangeRequest::LinkDown { a, b, index: None })
            .unwrap();
        let (a, b) = link("spine1");
        dp.change(&ChangeRequest::LinkSet {
            a,
            b,
            index: None,
            rate_bps: Some(100_000_000),
            delay_ns: None,
            loss: Some(0.1),
            loss_burst: None,
            buffer_bytes: None,
            from: None,
        })
        .unwrap();
        dp.change(&ChangeRequest::Partition {
            groups: vec![vec!["gpu0".into()]],
        })
        .unwrap();
        dp.change(&ChangeRequest::Load {
            from: "leaf0".into(),
            to: "leaf1".into(),
            rate_bps: 1_000_000,
            packet_bytes: None,
            for_ns: None,
            on_ns: None,
            off_ns: None,
        })
        .unwrap();
        let s = 1_000_000_000;
        let (a, b) = link("spine1");
        let flap = ChangeRequest::LinkFlap {
            a,
            b,
            index: None,
            down_ns: s,
            up_ns: s,
            count: 2,
        };
        dp.schedule(&[(s, flap.clone())]).unwrap();
        dp.change(&flap).unwrap();
        assert_eq!(dp.status().pending_changes, 7);
        let e = dp.change(&ChangeRequest::Reset).unwrap();
        assert_eq!(
            e[0].what,
            "fabric reset: 2 links up, 1 link reset to the topology's values, partition healed, \
             1 load stopped, 7 pending steps dropped (1 timeline cancelled)"
        );
        let st = dp.status();
        assert!(st.changed_links.is_empty(), "{:?}", st.changed_links);
        assert!(st.partition.is_empty());
        assert!(st.loads.iter().all(|l| !l.active));
        assert!(st.timelines.is_empty());
        assert_eq!(st.pending_changes, 0);
        assert!(dp.layers.is_empty());
        // A scenario whose changes are all made but whose load still runs.
        let load = ChangeRequest::Load {
            from: "leaf0".into(),
            to: "leaf1".into(),
            rate_bps: 1_000_000,
            packet_bytes: None,
            for_ns: Some(10 * s),
            on_ns: None,
            off_ns: None,
        };
        dp.schedule(&[(0, load)]).unwrap();
        let e = dp.change(&ChangeRequest::Reset).unwrap();
        assert_eq!(
            e[0].what,
            "fabric reset: 1 load stopped, 1 timeline cancelled"
        );
        assert!(ends_early(&e[0].what, 2));
        let e = dp.change(&ChangeRequest::Reset).unwrap();
        assert_eq!(e[0].what, "fabric reset: nothing to undo");
    }

    /// A scenario's reset (a degrade's repair, made at once by a cancel too) returns a
    /// link set by hand to the values set by hand, direction by direction, not to the
    /// topology's; a reset by hand forgets them.
    #[test]
    fn a_scenario_reset_returns_a_link_to_what_was_set_by_hand() {
        use closbox_fabric::routing::PortId;
        let (mut dp, _t) = plane(LS);
        let set =
            |rate_bps: Option<u64>, loss: Option<f64>, from: Option<&str>| ChangeRequest::LinkSet {
                a: "gpu0".into(),
                b: "leaf0".into(),
                index: None,
                rate_bps,
                delay_ns: None,
                loss,
                loss_burst: None,
                buffer_bytes: from.map(|_| 64_000),
                from: from.map(Into::into),
            };
        let reset = || ChangeRequest::LinkReset {
            a: "gpu0".into(),
            b: "leaf0".into(),
            index: None,
        };
        // By hand: the gpu0→leaf0 direction at 100 Mbit/s with a 64 kB buffer.
        dp.change(&set(Some(100_000_000), None, Some("gpu0")))
            .unwrap();
        let l = dp.status().changed_links[0].id;
        let (gpu_end, leaf_end) = (PortId(2 * l), PortId(2 * l + 1));
        let hand = (dp.model.link_of(gpu_end), dp.model.link_of(leaf_end));
        assert_eq!(hand.0.rate.bps(), 100_000_000);
        assert_eq!(hand.1.rate.bps(), 1_000_000_000);
        let s = 1_000_000_000;
        let degrade = |dp: &mut DataPlane<MemPorts>| {
            let (t, _) = dp
                .schedule(&[(0, set(Some(10_000_000), Some(0.5), None)), (s, reset())])
                .unwrap();
            assert_eq!(dp.model.link_of(gpu_end).rate.bps(), 10_000_000);
            assert_eq!(dp.model.link_of(leaf_end).loss, 0.5);
            let (_, repaired) = dp.cancel(Some(t));
            assert_eq!(repaired.len(), 1);
            repaired[0].what.clone()
        };
        let what = degrade(&mut dp);
        assert_eq!(
            what,
            "link gpu0-leaf0 #0 reset to the values set by hand (now: timeline 1 cancelled)"
        );
        assert_eq!(
            (dp.model.link_of(gpu_end), dp.model.link_of(leaf_end)),
            hand
        );
        let buffers = dp.status().changed_links[0].buffer_bytes;
        assert_eq!(buffers[0], 64_000, "{buffers:?}");
        // A set by hand during a degrade changes what the repair returns to, with what it
        // sets only: the degrade's loss is not taken for the link's own.
        let (t, _) = dp
            .schedule(&[(0, set(None, Some(0.5), None)), (s, reset())])
            .unwrap();
        dp.change(&set(Some(200_000_000), None, None)).unwrap();
        dp.cancel(Some(t));
        assert_eq!(dp.model.link_of(gpu_end).rate.bps(), 200_000_000);
        assert_eq!(dp.model.link_of(leaf_end).rate.bps(), 200_000_000);
        assert_eq!(dp.model.link_of(gpu_end).loss, 0.0);
        // Reset by hand: the topology's values, to which a scenario's reset returns too.
        dp.change(&reset()).unwrap();
        assert!(dp.status().changed_links.is_empty());
        let what = degrade(&mut dp);
        assert!(what.contains("reset to the topology's values"), "{what}");
        assert!(dp.status().changed_links.is_empty());
    }

    /// Faults of several timelines on one link are undone one by one: a degrade's repair
    /// leaves another timeline's degrade in place, a flap's "up" leaves a link down while
    /// its switch is down.
    #[test]
    fn overlapping_faults_are_undone_one_by_one() {
        use closbox_fabric::routing::PortId;
        let (mut dp, _t) = plane(LS);
        let set = |rate_bps: Option<u64>, loss: Option<f64>| ChangeRequest::LinkSet {
            a: "leaf0".into(),
            b: "spine0".into(),
            index: None,
            rate_bps,
            delay_ns: None,
            loss,
            loss_burst: None,
            buffer_bytes: None,
            from: None,
        };
        let reset = || ChangeRequest::LinkReset {
            a: "leaf0".into(),
            b: "spine0".into(),
            index: None,
        };
        let s = 1_000_000_000;
        // A schedule refused takes no timeline id.
        assert!(dp.schedule(&[(0, set(Some(0), None))]).is_err());
        let (one, _) = dp
            .schedule(&[(0, set(Some(500_000_000), None)), (10 * s, reset())])
            .unwrap();
        assert_eq!(one, 1);
        let (two, _) = dp
            .schedule(&[(0, set(None, Some(0.25))), (20 * s, reset())])
            .unwrap();
        let l = dp.status().changed_links[0].id;
        let link = |dp: &DataPlane<MemPorts>| dp.model.link_of(PortId(2 * l));
        assert_eq!((link(&dp).rate.bps(), link(&dp).loss), (500_000_000, 0.25));
        let (_, repaired) = dp.cancel(Some(one));
        assert_eq!(
            repaired[0].what,
            format!(
                "link leaf0-spine0 #0 reset to the topology's values \
                 (now: timeline {one} cancelled) (still degraded by timeline {two})"
            )
        );
        assert!(ends_early(&repaired[0].what, one));
        assert_eq!(
            (link(&dp).rate.bps(), link(&dp).loss),
            (1_000_000_000, 0.25)
        );
        dp.cancel(Some(two));
        assert!(dp.status().changed_links.is_empty());
        // A switch down for one timeline; another flaps one of its links: the flap's "up"
        // leaves the link down, and the switch's own "up" brings every link back.
        let (_, now) = dp
            .schedule(&[
                (
                    0,
                    ChangeRequest::SwitchDown {
                        name: "spine0".into(),
                    },
                ),
                (
                    10 * s,
                    ChangeRequest::SwitchUp {
                        name: "spine0".into(),
                    },
                ),
            ])
            .unwrap();
        let down = dp.status().changed_links.len();
        assert!(
            now[0].what.starts_with("switch spine0 down"),
            "{}",
            now[0].what
        );
        let (flap, now) = dp
            .schedule(&[(
                0,
                ChangeRequest::LinkFlap {
                    a: "leaf0".into(),
                    b: "spine0".into(),
                    index: None,
                    down_ns: s / 1000,
                    up_ns: s / 1000,
                    count: 1,
                },
            )])
            .unwrap();
        assert_eq!(
            now[0].what,
            "link leaf0-spine0 #0 down (flap 1 of 1) (already so)"
        );
        while dp.ports.elapsed < StdDuration::from_millis(3) {
            dp.step();
        }
        let log: Vec<&str> = dp.events.iter().map(|e| e.what.as_str()).collect();
        assert!(
            log.contains(&"link leaf0-spine0 #0 up (flap 1 of 1) (held down by timeline 3)"),
            "timeline {flap}: {log:?}"
        );
        let changed = dp.status().changed_links;
        assert_eq!(changed.len(), down);
        assert!(changed.iter().all(|l| l.down_by == [3]), "{changed:?}");
        dp.cancel(None);
        assert!(dp.status().changed_links.is_empty());
        // Two partitions: both in place, then the first's heal leaves the second's.
        let cut = |gpus: &[&str]| ChangeRequest::Partition {
            groups: vec![gpus.iter().map(|g| g.to_string()).collect()],
        };
        let (halves, _) = dp
            .schedule(&[(0, cut(&["gpu0", "gpu1"])), (10 * s, ChangeRequest::Heal)])
            .unwrap();
        let (lone, now) = dp
            .schedule(&[(0, cut(&["gpu3"])), (10 * s, ChangeRequest::Heal)])
            .unwrap();
        assert_eq!(
            now[0].what,
            format!("partition gpu3 | the rest (with the partition by timeline {halves})")
        );
        assert_eq!(dp.status().partition.len(), 3);
        let (_, repaired) = dp.cancel(Some(halves));
        assert_eq!(
            repaired[0].what,
            format!(
                "heal: partition removed (now: timeline {halves} cancelled) \
                 (partition by timeline {lone} stays)"
            )
        );
        assert_eq!(
            dp.status().partition,
            [vec!["gpu3"], vec!["gpu0", "gpu1", "gpu2"]]
        );
        dp.cancel(Some(lone));
        assert!(dp.status().partition.is_empty());
        assert!(dp.layers.is_empty());
    }

    /// A timeline cancelled in the middle repairs at once what it broke and would have
    /// repaired, drops the faults still to come, and leaves alone what others broke.
    #[test]
    fn a_cancelled_timeline_repairs_what_it_broke() {
        let (mut dp, _t) = plane(LS);
        let down = |b: &str| ChangeRequest::LinkDown {
            a: "leaf0".into(),
            b: b.into(),
            index: None,
        };
        let up = |b: &str| ChangeRequest::LinkUp {
            a: "leaf0".into(),
            b: b.into(),
            index: None,
        };
        let load = |for_ns| ChangeRequest::Load {
            from: "leaf0".into(),
            to: "leaf1".into(),
            rate_bps: 1_000_000,
            packet_bytes: None,
            for_ns: Some(for_ns),
            on_ns: None,
            off_ns: None,
        };
        // Down by hand: the timeline's later "up" of it is not its repair to make.
        dp.change(&down("spine1")).unwrap();
        let slow = ChangeRequest::LinkSet {
            a: "gpu0".into(),
            b: "leaf0".into(),
            index: None,
            rate_bps: Some(1_000_000),
            delay_ns: None,
            loss: None,
            loss_burst: None,
            buffer_bytes: None,
            from: None,
        };
        let reset = ChangeRequest::LinkReset {
            a: "gpu0".into(),
            b: "leaf0".into(),
            index: None,
        };
        let s = 1_000_000_000;
        let (t, now) = dp
            .schedule(&[
                (0, load(10 * s)),
                (0, down("spine0")),
                (0, slow),
                (s, up("spine0")),
                (2 * s, down("spine0")),
                (3 * s, up("spine0")),
                (3 * s, reset),
                (3 * s, up("spine1")),
                (4 * s, down("spine1")),
            ])
            .unwrap();
        assert_eq!(now.len(), 3);
        assert_eq!(dp.status().changed_links.len(), 3);
        assert_eq!(
            dp.status().timelines,
            [TimelineStatus {
                id: t,
                pending: 6,
                loads: vec![1]
            }]
        );
        let (dropped, repaired) = dp.cancel(Some(t));
        assert_eq!(dropped, 6);
        // Each is the timeline's event, as is the line saying it was cancelled.
        assert!(
            repaired.iter().all(|e| e.timeline == Some(t)),
            "{repaired:?}"
        );
        let last = dp.events.len() - repaired.len() - 1;
        assert_eq!(dp.events[last].timeline, Some(t), "{:?}", dp.events[last]);
        let what: Vec<&str> = repaired.iter().map(|e| e.what.as_str()).collect();
        assert_eq!(
            what,
            [
                format!("link leaf0-spine0 #0 up (now: timeline {t} cancelled)"),
                format!("link gpu0-leaf0 #0 reset to the topology's values (now: timeline {t} cancelled)"),
                format!("load 1 stopped (now: timeline {t} cancelled)"),
            ]
        );
        // The log says the timeline ended, and with how much to come, before the repairs.
        let log: Vec<&str> = dp.events.iter().map(|e| e.what.as_str()).collect();
        let at = log
            .iter()
            .position(|w| *w == format!("timeline {t} cancelled with 6 steps pending"))
            .expect("the cancel is logged");
        assert_eq!(log[at + 1], what[0]);
        assert!(log[at..].iter().all(|w| ends_early(w, t)), "{log:?}");
        assert!(!log[..at].iter().any(|w| ends_early(w, t)), "{log:?}");
        assert!(dp.status().loads.iter().all(|l| !l.active));
        assert!(dp.status().timelines.is_empty());
        let changed = dp.status().changed_links;
        assert_eq!(changed.len(), 1, "{changed:?}");
        assert_eq!(changed[0].ends, ["leaf0", "spine1"]);
        assert_eq!(dp.status().pending_changes, 0);
        assert!(dp.broken.is_empty());
        // A timeline's "up" of a link down by hand leaves it down: the hand holds it.
        let (t, now) = dp.schedule(&[(0, up("spine1"))]).unwrap();
        assert_eq!(
            now[0].what, "link leaf0-spine1 #0 up (held down by hand)",
            "timeline {t}"
        );
        assert_eq!(dp.status().changed_links.len(), 1);
        dp.change(&up("spine1")).unwrap();
        // A timeline run to its end keeps nothing: its changes applied, its load ended
        // (logged as the timeline's; changes by hand are nobody's).
        assert_eq!(dp.events.last().map(|e| e.timeline), Some(None));
        let (t, _) = dp
            .schedule(&[(0, load(100_000)), (1, down("spine1")), (2, up("spine1"))])
            .unwrap();
        assert_eq!(dp.status().timelines.len(), 1);
        while dp.ports.elapsed < StdDuration::from_millis(1) {
            dp.step();
        }
        assert_eq!(dp.status().pending_changes, 0);
        assert!(dp.broken.is_empty());
        assert!(dp.status().changed_links.is_empty());
        let done = dp.events.iter().find(|e| e.what.starts_with("load 2 done"));
        assert_eq!(done.map(|e| e.timeline), Some(Some(t)), "{:?}", dp.events);
        assert!(dp.load_timelines.is_empty());
    }

    /// The real-time valve: out of the FIFO class after running `RT_MAX_RUN` without
    /// sleeping, back in when it sleeps, not before `RT_COOLDOWN`.
    #[test]
    fn the_realtime_valve_lets_go_of_a_busy_cpu() {
        let t0 = StdInstant::now();
        let at = |us: u64| t0 + StdDuration::from_micros(us);
        let mut rt = Realtime {
            on: true,
            slept: t0,
            fallbacks: 0,
            fell_back: None,
            refused: None,
        };
        // Busy (waits that return at once) for 10 ms: stays; past it: leaves.
        assert_eq!(rt.after_wait(at(5_000), at(5_001)), None);
        assert_eq!(rt.after_wait(at(9_998), at(9_999)), None);
        assert_eq!(rt.after_wait(at(10_001), at(10_002)), Some(false));
        rt.on = false;
        assert_eq!(rt.fallbacks, 1);
        // Sleeping again within the cool-down: stays out; after it: back in.
        assert_eq!(rt.after_wait(at(20_000), at(20_100)), None);
        let later = 10_002 + RT_COOLDOWN.as_micros() as u64;
        assert_eq!(
            rt.after_wait(at(later), at(later + 15)),
            None,
            "not a sleep"
        );
        assert_eq!(rt.after_wait(at(later), at(later + 30)), Some(true));
        rt.on = true;
        // A thread that sleeps now and then stays in.
        for i in 1..100u64 {
            let t = later + i * 5_000;
            assert_eq!(rt.after_wait(at(t), at(t + 100)), None);
        }
        // Refused: never asks again.
        rt.refused = Some("EPERM".into());
        assert_eq!(rt.after_wait(at(10_000_000), at(20_000_000)), None);
    }

    #[test]
    fn advice_for_a_late_fabric_names_the_time_scale_to_try() {
        // leaf-spine-16's file at real time: plan's estimate for a full load is 5.
        let a = behind_advice(1.0, 5.0, None, false);
        assert!(a.starts_with("this box cannot keep up with the configured rates; raise time_scale to at least 5 "), "{a}");
        // Already at or above the estimate (8 gloo ranks on leaf-spine-16 were still late
        // at 5, on time at 20): the traffic costs more than the estimate assumes.
        let a = behind_advice(10.0, 5.0, None, false);
        assert!(
            a.starts_with(
                "this box cannot keep up with the configured rates; raise time_scale above 10 "
            ),
            "{a}"
        );
        assert!(a.contains("estimated 5 for every GPU"), "{a}");
        // From a daemon that did not say.
        let a = behind_advice(1.0, 0.0, None, false);
        assert!(
            a.ends_with("; raise time_scale (`up --time-scale auto` measures what this box needs), or lower the rates"),
            "{a}"
        );
        let (p, _) = plane(TWO);
        assert_eq!(p.full_load, 1.0, "2 GPUs of 1 Gbit/s: real time holds");
    }

    #[test]
    fn a_thread_kept_off_its_cpu_is_told_to_use_realtime_a_busy_one_time_scale() {
        let use_of = |busy: f64, waited_ms: f64| CpuUse {
            window_s: 5.0,
            busy,
            peak_busy: busy,
            waited_ms,
            steal: 0.0,
        };
        // One flow at a third of the box's speed, normal class (measured: 68 % busy,
        // 115 ms waiting, p99 lateness 0.7 ms).
        let waited = use_of(0.68, 115.0);
        assert!(waited.preempted());
        let a = behind_advice(1.0, 5.0, Some(&waited), false);
        assert!(
            a.contains("busy only 68 % of a CPU but waited 115 ms"),
            "{a}"
        );
        assert!(a.contains("`closbox up --realtime`"), "{a}");
        // Already asked for: the time-scale advice.
        let a = behind_advice(1.0, 5.0, Some(&waited), true);
        assert!(a.starts_with("this box cannot keep up with the configured rates; raise time_scale to at least 5 "), "{a}");
        // Saturated (it waited too, but it had no time to spare), or bursts beyond the
        // box's speed (13 ms waiting): the work is the cause.
        // A job that saturated it for a while and ended (8 gloo ranks: busy 40 % over
        // the window, 58 ms waiting): work-bound too.
        let ended = CpuUse {
            peak_busy: 0.99,
            ..use_of(0.4, 58.0)
        };
        for c in [use_of(0.98, 200.0), use_of(0.66, 13.0), ended] {
            assert!(!c.preempted(), "{c:?}");
            let a = behind_advice(1.0, 5.0, Some(&c), false);
            assert!(a.starts_with("this box cannot keep up with the configured rates; raise time_scale to at least 5 "), "{a}");
        }
        // The hypervisor took a fifth of the CPUs (measured: the thread busy 31 %, 56 ms
        // waiting, p99 9 ms): named before the scheduler or the work, `--realtime` or not.
        let stolen = CpuUse {
            steal: 0.2,
            ..use_of(0.31, 56.0)
        };
        for realtime in [false, true] {
            let a = behind_advice(20000.0, 5000.0, Some(&stolen), realtime);
            assert!(
                a.starts_with(
                    "the hypervisor gave this machine's CPUs to others for 20 % of the last 5.0 s"
                ),
                "{a}"
            );
        }
        let a = behind_advice(
            1.0,
            5.0,
            Some(&CpuUse {
                steal: 0.02,
                ..waited
            }),
            false,
        );
        assert!(a.contains("busy only 68 % of a CPU"), "{a}");
    }

    #[test]
    fn cpu_use_is_taken_from_samples_over_the_window_and_its_busiest_slot() {
        let t0 = StdInstant::now();
        let at = |ms: u64| t0 + StdDuration::from_millis(ms);
        let sample = |wall, run_ns, wait_ns, box_ticks| CpuSample {
            wall,
            run_ns,
            wait_ns,
            box_ticks,
        };
        let slot = StdDuration::from_millis(250);
        let c = CpuUse::of(
            &[
                sample(at(0), 1_000, 50, (10_000, 100)),
                sample(at(5000), 2_500_001_000, 60_000_050, (11_000, 150)),
            ],
            slot,
        );
        assert_eq!(c.window_s, 5.0);
        assert!((c.busy - 0.5).abs() < 1e-6, "{c:?}");
        assert!((c.peak_busy - 0.5).abs() < 1e-6, "{c:?}");
        assert_eq!(c.waited_ms, 60.0);
        assert!((c.steal - 0.05).abs() < 1e-12, "{c:?}");
        assert!(c.preempted());
        // The same CPU time in its first half second: saturated then, work-bound.
        let c = CpuUse::of(
            &[
                sample(at(0), 0, 0, (0, 0)),
                sample(at(500), 480_000_000, 10_000_000, (0, 0)),
                sample(at(4900), 2_500_000_000, 60_000_000, (0, 0)),
                // A short last interval does not count as a slot.
                sample(at(5000), 2_600_000_000, 60_000_000, (0, 0)),
            ],
            slot,
        );
        assert!((c.busy - 0.52).abs() < 1e-6, "{c:?}");
        assert!((c.peak_busy - 0.96).abs() < 1e-6, "{c:?}");
        assert!(!c.preempted(), "{c:?}");
    }

    #[test]
    fn shortest_gpu_path_is_through_one_leaf_or_one_link() {
        // GPU → leaf (100 ns + 600 ns of switch) → GPU (100 ns); spines are further.
        let ls = "[topology]\nkind = \"leaf-spine\"\nleaves = 2\nspines = 2\ngpus_per_leaf = 2\n[links.nic]\ndelay = \"100ns\"\n[links.leaf-spine]\ndelay = \"500ns\"\n[switches.leaf]\nlatency = \"600ns\"\n";
        assert_eq!(shortest(ls), 800);
        let mesh = "[topology]\nkind = \"full-mesh\"\ngpus = 3\n[links.nic]\ndelay = \"2us\"\n";
        assert_eq!(shortest(mesh), 2000);
    }
}
