//! What the data plane reports: `status` (packets, drops, lateness, the thread's CPU use,
//! links, ports, loads, timelines) with its advice when the box fell behind, and `flows`.

use std::time::{Duration as StdDuration, Instant as StdInstant};

use closbox_fabric::model::DropReason;
use serde::{Deserialize, Serialize};

use super::{DataPlane, Ports, WINDOW, WINDOW_SLOTS};
use crate::histogram::Histogram;
use crate::links::IfState;
use crate::{chaos, sys};

/// Most flows counted one by one at once (beyond, the least recently active are let go).
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
    /// How many flows there were before `top` cut them (those active in `since_ns`).
    #[serde(default)]
    pub flows_total: u64,
    /// Flows let go to make room for new ones beyond `MAX_FLOWS` (the least recently
    /// active first), and their packets while counted.
    #[serde(default)]
    pub retired_flows: u64,
    #[serde(default)]
    pub retired_packets: u64,
}

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
    /// What it waits for before it starts (`Schedule::start`): "the first packet from one
    /// of its 8 GPUs"; none once started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting: Option<String>,
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
    /// Held down by its GPU's host too: its interface is down (or gone). Only the host
    /// brings it up, by setting its interface up.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub down_by_host: bool,
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

/// GPUs whose TCP is set alike (`Status::gpu_tcp`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuTcp {
    pub congestion: String,
    /// `net.ipv4.tcp_ecn`.
    pub ecn: u8,
    pub gpus: Vec<String>,
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
    /// UDP datagrams the GPUs' kernels dropped at receiving sockets whose buffers were
    /// full (the programs read too slowly; delivered by the fabric), filled in by the
    /// control plane.
    #[serde(default)]
    pub gpu_socket_dropped: Option<u64>,
    /// The GPUs' TCP as their kernels have it now, GPUs grouped by it (congestion
    /// control, `tcp_ecn`: 1 requests ECN, 2 only accepts it, 0 never): the fabric sets
    /// it at `up`, and a GPU's host (root in its namespace) may change it. Filled in by
    /// the control plane; empty where unread.
    #[serde(default)]
    pub gpu_tcp: Vec<GpuTcp>,
    /// Per egress port counters, every port in port order.
    pub ports: Vec<PortStatus>,
    /// Links that are down or whose parameters were changed.
    pub changed_links: Vec<LinkStatus>,
    /// How many changes were applied since the fabric came up.
    pub events: u64,
    /// While a partition holds: the GPUs of each side.
    pub partition: Vec<Vec<String>>,
    /// Synthetic loads (`closbox load`, `closbox incast`): every one running, and the
    /// last `MAX_DONE_LOADS` done.
    #[serde(default)]
    pub loads: Vec<LoadInfo>,
    /// The loads done before those, summed.
    #[serde(default)]
    pub loads_earlier: LoadsEarlier,
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
    /// Writer threads for the TUN writes (`CLOSBOX_TUN_WRITERS`; 0: the data plane's
    /// thread writes), and the writes handed to them so far: only writes due 20 µs ago
    /// or more go to them (`TunPorts::dispatch`), so a count that grows says the data
    /// plane was behind and shared its writes.
    #[serde(default)]
    pub tun_writers: usize,
    #[serde(default)]
    pub writes_handed_off: u64,
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
    /// The fabric's MTU (bytes of IP packet; 0 from a daemon that did not say).
    #[serde(default)]
    pub mtu: u32,
    /// GPUs whose host set their interface's MTU to other than the fabric's, with that
    /// MTU: a lower one's NIC drops longer frames as they arrive, a higher one's longer
    /// frames are dropped where they enter the fabric (both `over_mtu`).
    #[serde(default)]
    pub gpu_mtus: Vec<(String, u32)>,
    /// GPUs whose host put its own root qdisc in place of the one closbox paces their
    /// non-TCP packets with (`tc qdisc replace dev cb0 root …`), with its kind, as found
    /// when a change of the fabric would have rewritten it: the fabric leaves it, and such
    /// packets above the link's rate drop in the GPU's NIC queue.
    #[serde(default)]
    pub gpu_qdiscs: Vec<(String, String)>,
    /// GPUs whose port the data plane closed because reading their TUN failed (its
    /// interface deleted inside the GPU's namespace): nothing from them enters the fabric,
    /// and their links are down for good.
    #[serde(default)]
    pub closed_ports: Vec<String>,
    /// GPUs whose host left their interface other than up, and how: "down" (set down),
    /// "no-carrier" (up, its carrier off), "gone" (deleted or moved out of its namespace).
    /// Their links are held down by their host (`LinkStatus::down_by_host`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpu_interfaces: Vec<(String, String)>,
    /// Switches whose control plane held back ICMP answers (`[switches.<tier>]
    /// icmp_rate`), with how many: never sent, so in no other count.
    #[serde(default)]
    pub icmp_limited: Vec<(String, u64)>,
}

impl Status {
    /// The drops the GPUs' kernels counted at their TUNs, by the name `status` and the
    /// metrics give them: `None` where they could not be read.
    pub fn kernel_drops(&self) -> [(&'static str, Option<u64>); 3] {
        [
            ("tun_kernel", self.tun_tx_dropped),
            ("gpu_kernel", self.gpu_rx_dropped),
            ("gpu_socket", self.gpu_socket_dropped),
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

/// Loads done before those `Status::loads` lists, summed (a fabric up for long makes
/// thousands: scenarios and incasts start a load per source).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LoadsEarlier {
    pub loads: u64,
    pub sent_bytes: u64,
    pub delivered_bytes: u64,
    pub ecn_marked: u64,
    /// Drops by reason (only reasons with drops).
    pub drops: Vec<(String, u64)>,
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
    /// Longer than the interface MTU of the GPU it leads to (a port into a GPU whose host
    /// lowered its MTU: the GPU's NIC dropped them).
    #[serde(default)]
    pub drops_over_mtu: u64,
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

impl PortStatus {
    /// Its drops of every kind, the load's included.
    pub fn drops(&self) -> u64 {
        self.drops_buffer
            + self.drops_loss
            + self.drops_link_down
            + self.drops_over_mtu
            + self.load_drops
    }
}

/// Why a fabric runs late at `time_scale` and what to do about it, given the scale from
/// which `closbox plan` estimates the box carries every GPU at full rate (0: unknown), and
/// what the data plane's thread did meanwhile (`cpu`; `realtime`: `up --realtime`).
pub fn behind_advice(
    time_scale: f64,
    full_load: f64,
    cpu: Option<&CpuUse>,
    realtime: bool,
    idle_poll_would_help: bool,
) -> String {
    // Steal is known only with the thread's CPU use, over the same window.
    let (steal, window_s) = cpu.map_or((0.0, 0.0), |c| (c.steal, c.window_s));
    match LateCause::of(cpu, steal, realtime) {
        LateCause::Stolen(steal) => format!(
            "{}: {}raise time_scale (the same wall-clock delays then shift fabric time less), or run on a quieter host",
            stolen(steal, &format!("the last {window_s:.1} s")),
            steal_remedy(idle_poll_would_help)
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
        "the hypervisor gave this machine's CPUs to others for {:.0} % of {span} (steal time: its virtual CPUs stood still while the wall clock ran)",
        steal * 100.0
    )
}

/// What takes steal back, where idle CPUs halt and `up --idle-poll` would have them poll
/// (`sys::idle_poll_would_help`): on a VM most of what the host takes is the time it
/// takes to run a halted virtual CPU again. Ends with ", " (or is empty), for the advice
/// that follows it.
pub fn steal_remedy(idle_poll_would_help: bool) -> &'static str {
    if idle_poll_would_help {
        "`closbox up --idle-poll` (its idle CPUs then poll instead of halting, and most of what a VM's host takes is the time to run a halted CPU again), "
    } else {
        ""
    }
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
    pub(super) fn of(samples: &[CpuSample], min_slot: StdDuration) -> CpuUse {
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
pub(super) struct CpuSample {
    pub(super) wall: StdInstant,
    pub(super) run_ns: u64,
    pub(super) wait_ns: u64,
    pub(super) box_ticks: (u64, u64),
}

impl<P: Ports> DataPlane<P> {
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
    pub(super) fn sample_cpu(&mut self, wall: StdInstant) {
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

    pub(super) fn rotate_window(&mut self, wall: StdInstant) {
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
                        self.realtime.is_some(),
                        crate::sys::idle_poll_would_help()
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
                drops_over_mtu: c.drops.get(DropReason::OverMtu),
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
        let (loads, loads_earlier) = self.load_info();
        let (tun_writers, writes_handed_off) = self.ports.writers();
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
            gpu_socket_dropped: None,
            gpu_tcp: Vec::new(),
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
                    down_by_host: self.layers.down_by_host(l.link),
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
            loads_earlier,
            pending_changes: self.scheduled.len()
                + self.armed.iter().map(|a| a.steps()).sum::<usize>(),
            timelines: {
                let mut t: Vec<TimelineStatus> = self
                    .broken
                    .iter()
                    .map(|(&id, b)| TimelineStatus {
                        id,
                        pending: b.pending,
                        loads: b.loads.clone(),
                        waiting: None,
                    })
                    .chain(self.armed.iter().map(|a| TimelineStatus {
                        id: a.id,
                        pending: a.steps(),
                        loads: Vec::new(),
                        waiting: Some(a.waits_for()),
                    }))
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
            tun_writers,
            writes_handed_off,
            gpu_pacing: self.pacer.is_some(),
            cpu_recent: self.cpu_recent(cpu),
            thread_cpu_ns: cpu.map(|c| (c.run_ns, c.wait_ns)),
            box_cpu_ticks: cpu.map(|c| c.box_ticks),
            mtu: self.topo.fabric.mtu,
            gpu_mtus: self
                .gpu_mtus
                .iter()
                .enumerate()
                .filter(|&(_, &m)| m != 0 && m != self.topo.fabric.mtu)
                .map(|(h, &m)| (self.topo.hosts[h].name.clone(), m))
                .collect(),
            gpu_qdiscs: self.pacer.as_ref().map_or_else(Vec::new, |p| {
                p.hosts_own()
                    .into_iter()
                    .filter_map(|(h, kind)| Some((self.topo.hosts.get(h)?.name.clone(), kind)))
                    .collect()
            }),
            gpu_interfaces: self
                .host_if
                .iter()
                .enumerate()
                .filter_map(|(h, s)| {
                    let how = match s {
                        IfState::Up => return None,
                        IfState::Down => "down",
                        IfState::NoCarrier => "no-carrier",
                        IfState::Gone => "gone",
                    };
                    Some((self.topo.hosts[h].name.clone(), how.to_owned()))
                })
                .collect(),
            closed_ports: self
                .closed
                .iter()
                .map(|&h| self.topo.hosts[h].name.clone())
                .collect(),
            icmp_limited: self
                .model
                .icmp_limited()
                .into_iter()
                .enumerate()
                .filter(|&(_, n)| n > 0)
                .map(|(i, n)| (self.topo.switches[i].name.clone(), n))
                .collect(),
        }
    }

    /// Per-flow counters, heaviest first, with their paths as vertex names: the `top`
    /// heaviest (0: all) of those active in the last `since_ns` of fabric time (none:
    /// all). Sorted and cut before the paths, which cost the most.
    pub fn flows(&mut self, top: usize, since_ns: Option<u64>) -> Flows {
        let now = self.fabric_now(self.ports.now());
        self.model.advance(now);
        let (mut flows, retired) = self.model.flows();
        if let Some(d) = since_ns {
            let from = now.as_nanos().saturating_sub(d);
            flows.retain(|(_, c)| c.last.as_nanos() >= from);
        }
        // Heaviest first; ties by source, then the rest of the 5-tuple (a stable order).
        flows.sort_unstable_by(|(ka, a), (kb, b)| {
            b.bytes.cmp(&a.bytes).then_with(|| {
                (ka.src, ka.sport, ka.dst, ka.dport, ka.proto)
                    .cmp(&(kb.src, kb.sport, kb.dst, kb.dport, kb.proto))
            })
        });
        let total = flows.len();
        if top > 0 {
            flows.truncate(top);
        }
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
        let out: Vec<FlowInfo> = flows
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
        Flows {
            fabric_time_s: now.as_nanos() as f64 / 1e9,
            flows: out,
            flows_total: total as u64,
            retired_flows: retired.flows,
            retired_packets: retired.packets,
        }
    }

    /// Every load running and the last `MAX_DONE_LOADS` done; the loads done before
    /// them (those the model retired too), summed.
    fn load_info(&self) -> (Vec<LoadInfo>, LoadsEarlier) {
        let vname = |v: u32| {
            let h = self.topo.hosts.len() as u32;
            if v < h {
                self.topo.hosts[v as usize].name.clone()
            } else {
                self.topo.switches[(v - h) as usize].name.clone()
            }
        };
        let retired = self.model.retired_loads();
        let mut earlier = retired.counters;
        let mut earlier_loads = retired.loads;
        let mut loads = self.model.loads();
        let mut done = loads.iter().filter(|l| !l.active).count();
        loads.retain(|l| {
            if l.active || done <= MAX_DONE_LOADS {
                return true;
            }
            done -= 1;
            earlier_loads += 1;
            earlier.add(&l.counters);
            false
        });
        let drops = |c: &closbox_fabric::load::LoadCounters| {
            DropReason::ALL
                .iter()
                .filter(|r| c.drops.get(**r) > 0)
                .map(|r| (r.name().to_owned(), c.drops.get(*r)))
                .collect::<Vec<_>>()
        };
        let summed = LoadsEarlier {
            loads: earlier_loads,
            sent_bytes: earlier.sent_bytes,
            delivered_bytes: earlier.delivered_bytes,
            ecn_marked: earlier.ecn_marked,
            drops: drops(&earlier),
        };
        let listed = loads
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
                    drops: drops(&c),
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
            .collect();
        (listed, summed)
    }
}
