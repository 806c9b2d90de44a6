//! The packet-level fabric model: sans-IO, deterministic, driven by the caller's clock.
//!
//! A packet's way: `send` at a GPU → the GPU's NIC port → at each egress port: FIFO
//! queue (tail drop, ECN marking), serialization at the link rate, propagation delay, the
//! next switch's forwarding latency → … → the destination GPU, where it becomes a
//! `Delivery` with its arrival time.
//!
//! FIFO egress at a fixed rate makes every departure computable on enqueue: a packet starts
//! when the port is free and finishes `wire bits / rate` later. So a hop costs one event (the
//! arrival at the next vertex); a port's queue is the list of admitted packets not yet
//! finished, settled lazily against `now`. Packets cannot overtake each other on a link, so
//! each port's arrivals are already in time order: the event queue holds only each port's
//! next arrival (a heap as small as the number of busy ports). Ties in time are broken by
//! port number, and every random draw comes from a generator seeded from the fabric seed:
//! the same config and packets give the same trace.
//!
//! Must not: read clocks, sleep, do I/O, allocate per hop.
//!
//! Here: the fabric's state, a GPU's `send`, the event loop (`advance`) and the accounts.
//! Each hop's parts live beside it, all `impl Fabric`: `forward` (next hops, ECMP),
//! `ports` (queues, serialization, loss, ECN, pauses), `switches` (packets addressed to
//! a switch and its ICMP answers), `loads` (synthetic cross-traffic), `changes` (links
//! and partitions changed while it runs, route convergence) and `observe` (taps, flows,
//! trace, paths).

use std::cmp::Reverse;
use std::collections::binary_heap::PeekMut;
use std::collections::{BinaryHeap, VecDeque};

use crate::fq::FlowQueues;
use crate::frame::Frame;
use crate::load::LoadSpec;
use crate::packet::{self, Unforwardable};
use crate::rng::{mix, Rng};
use crate::routing::{vertex_latency, PortId, Routes, VertexIdx};
use crate::topology::{
    FlowControl, HostId, LinkParams, NicScheduler, QueueParams, Routing, Topology,
};
use crate::units::{Bandwidth, Bytes, Duration, Instant};

mod changes;
mod forward;
mod loads;
mod observe;
mod ports;
mod switches;

pub use loads::{LoadStatus, RetiredLoads, KEPT_DONE_LOADS};
pub(crate) use observe::MixedKey;
pub use observe::{FlowCounters, Retired, Tapped};
pub use ports::headroom_bytes;

use forward::{ecmp_index, flow_key_mix, resilient_pick};
use loads::{LoadState, LOAD_FLOW};
use observe::{Flows, Taps};
use ports::{count_lost, settle};
use switches::{FabricClock, Policer};

/// Why the fabric dropped a packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DropReason {
    /// Not a parseable IPv4 packet.
    Malformed,
    /// Not IPv4 (e.g. IPv6).
    Unsupported,
    /// Destination is no GPU of this fabric, or unreachable from the source.
    NoRoute,
    /// Egress buffer full (tail drop).
    BufferFull,
    /// Lost on the wire (the link's loss probability).
    Loss,
    /// Its TTL ran out at a switch (every switch is a routed hop and decrements it).
    TtlExpired,
    /// On a link that went down: queued at either end, on the wire, or sent into it before
    /// the switch noticed (blackholed).
    LinkDown,
    /// Between GPUs a partition separates (`Change::Partition`).
    Partitioned,
    /// The fabric already holds its packet-memory budget (`Fabric::memory_limit`): the
    /// box's limit, not a switch's, so that no traffic pattern exhausts the box.
    MemoryLimit,
    /// Longer than an MTU on its way: sent by a GPU whose interface MTU was raised above
    /// the fabric's, the switch port it enters drops it, as a real one drops a giant frame
    /// (TCP over such a path stalls on its full-sized segments: a PMTU black hole); sent
    /// to a GPU whose interface MTU was lowered below it (`Fabric::set_gpu_mtu`), that
    /// GPU's NIC drops it as it arrives, counted on the port into the GPU.
    OverMtu,
}

impl DropReason {
    pub const ALL: [DropReason; 10] = [
        DropReason::Malformed,
        DropReason::Unsupported,
        DropReason::NoRoute,
        DropReason::BufferFull,
        DropReason::Loss,
        DropReason::TtlExpired,
        DropReason::LinkDown,
        DropReason::Partitioned,
        DropReason::MemoryLimit,
        DropReason::OverMtu,
    ];

    pub fn name(self) -> &'static str {
        match self {
            DropReason::Malformed => "malformed",
            DropReason::Unsupported => "unsupported",
            DropReason::NoRoute => "no_route",
            DropReason::BufferFull => "buffer_full",
            DropReason::Loss => "loss",
            DropReason::TtlExpired => "ttl_expired",
            DropReason::LinkDown => "link_down",
            DropReason::Partitioned => "partitioned",
            DropReason::MemoryLimit => "memory_limit",
            DropReason::OverMtu => "over_mtu",
        }
    }
}

/// Drop counts by reason.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Drops([u64; DropReason::ALL.len()]);

impl Drops {
    pub fn get(&self, r: DropReason) -> u64 {
        self.0[r as usize]
    }

    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }

    pub(crate) fn add(&mut self, r: DropReason) {
        self.0[r as usize] += 1;
    }

    pub(crate) fn add_all(&mut self, o: &Drops) {
        for (a, b) in self.0.iter_mut().zip(o.0) {
            *a += b;
        }
    }
}

/// Counters of one egress port. "rx" is what was offered to the port's queue.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PortCounters {
    pub rx_packets: u64,
    pub rx_bytes: u64,
    pub tx_packets: u64,
    pub tx_bytes: u64,
    pub drops: Drops,
    /// Packets this port set CE on.
    pub ecn_marked: u64,
    /// Highest queue occupancy seen, in IP bytes, including the packet in service.
    pub max_queue_bytes: u64,
    /// Time spent serializing (fabric time), synthetic load included.
    pub busy: Duration,
    /// Synthetic load (`Change::StartLoad`) through this port: sent, and dropped for any
    /// reason (not in the counters above, which are the GPUs' packets).
    pub load_tx_packets: u64,
    pub load_tx_bytes: u64,
    pub load_drops: u64,
    /// Lossless fabrics: times this port was stopped by its downstream neighbour (a PFC
    /// pause, or credits run out), and for how long in all (fabric time).
    pub pause_events: u64,
    pub paused: Duration,
    /// Lossless fabrics: the most bytes the next switch held at once that came through
    /// this port (its ingress occupancy).
    pub max_ingress_bytes: u64,
}

/// Result of offering a packet to the fabric.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use]
pub enum Verdict {
    Accepted,
    Dropped(DropReason),
}

/// A packet that reached its destination GPU at `at`.
#[derive(Debug)]
pub struct Delivery {
    pub at: Instant,
    /// The GPU that sent it; for an ICMP error a switch answered with, the GPU whose
    /// packet it answers.
    pub src: HostId,
    pub dst: HostId,
    pub data: Frame,
}

/// A change to a running fabric (`Fabric::apply`), at an instant of fabric time.
#[derive(Clone, Debug, PartialEq)]
pub enum Change {
    /// Link `i` (both directions) goes down: what is queued at either end or on the wire
    /// is lost. The switch at each end stops using it after the detection time; the rest
    /// of the fabric reroutes after the convergence time.
    LinkDown(u32),
    /// Link `i` comes back; routes use it again after the convergence time.
    LinkUp(u32),
    /// New parameters for link `i`, in the directions `dirs` (`None`: unchanged). A rate
    /// or delay applies at once to what the sending end holds (`Fabric::retime`: the frame
    /// on the wire sends its remaining bits at the new rate); loss and buffer to frames
    /// enqueued from now on. The buffer is that of the egress queue at the sending end of
    /// each direction.
    SetLink {
        link: u32,
        dirs: Directions,
        rate: Option<Bandwidth>,
        delay: Option<Duration>,
        loss: Option<f64>,
        /// Mean frames per run of losses (`LinkParams::loss_burst`).
        loss_burst: Option<f64>,
        buffer: Option<Bytes>,
    },
    /// Link `i` back to the topology's parameters (at once, as `SetLink`).
    ResetLink(u32),
    /// GPUs in different groups (one group number per GPU) can no longer reach each
    /// other: their packets are dropped as they enter the fabric, both ways.
    Partition(Vec<u16>),
    /// No partition any more.
    Heal,
    /// Synthetic traffic starts (see `load`); false if its id is taken.
    StartLoad(LoadSpec),
    /// The load with this id stops (its packets in the fabric go on).
    StopLoad(u32),
}

/// Which directions of a link a change applies to: both, or the one from the link's end
/// `a` (its port `2i`) or from its end `b` (port `2i + 1`) only.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Directions {
    #[default]
    Both,
    FromA,
    FromB,
}

impl Directions {
    /// The ports of link `l` in these directions.
    pub fn ports(self, l: u32) -> impl Iterator<Item = PortId> {
        let (first, last) = match self {
            Directions::Both => (0, 1),
            Directions::FromA => (0, 0),
            Directions::FromB => (1, 1),
        };
        (2 * l + first..=2 * l + last).map(PortId)
    }
}

/// `InFlight::load` of a GPU's packet.
const NO_LOAD: u32 = u32::MAX;
/// `InFlight::ingress` of a packet at a GPU.
const NO_PORT: u32 = u32::MAX;
/// Event keys (below `1 << 30`: a port's next arrival, then the loads' next packets;
/// with these flags: a lossless port's departure, pause, resume).
const DEPART_EVENT: u32 = 1 << 30;
const PAUSE_EVENT: u32 = 2 << 30;
const RESUME_EVENT: u32 = 3 << 30;
const EVENT_KIND: u32 = 3 << 30;
/// Backlog entry flags.
const LOST: u8 = 1;
const SYNTHETIC: u8 = 2;

/// A link as it is now, where it differs from the topology.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkState {
    pub link: u32,
    pub up: bool,
    /// Since when it is down (fabric time).
    pub down_since: Option<Instant>,
    /// The a→b direction's rate, delay and loss, and the b→a direction's.
    pub params: [LinkParams; 2],
    /// Egress buffer of the a→b and b→a ports.
    pub buffers: [Bytes; 2],
}

/// One event in the trace (when tracing is on): a packet finishing on a port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceEntry {
    pub port: PortId,
    pub packet: u64,
    pub start: Instant,
    pub finish: Instant,
    pub dropped: Option<DropReason>,
}

struct Port {
    link: LinkParams,
    queue: QueueParams,
    /// Forwarding latency of the vertex this port leads to.
    next_latency: Duration,
    to: VertexIdx,
    busy_until: Instant,
    /// Serialization remainder in units of 1/rate ns, carried across back-to-back packets.
    carry: u64,
    /// Admitted packets not yet finished: (finish, IP bytes, `LOST` | `SYNTHETIC`).
    backlog: VecDeque<(Instant, u32, u8)>,
    /// Packets that will arrive at `to`, in arrival order: (arrival, slot).
    transit: VecDeque<(Instant, u32)>,
    backlog_bytes: u64,
    counters: PortCounters,
    rng: Rng,
    /// In a burst of losses (`LinkParams::loss_burst` above 1).
    loss_bad: bool,
    /// Lossless fabrics: admitted packets that have not started (their bytes are in
    /// `backlog_bytes`); they start one by one as the port frees and is not paused.
    waiting: VecDeque<u32>,
    /// A GPU's NIC with the `fq` scheduler: its admitted packets that have not started,
    /// a queue per flow (then `waiting` stays empty), taken off in turn as the NIC has
    /// room ahead of the wire (`nic_ring`).
    fq: Option<Box<FlowQueues>>,
    /// A GPU's NIC with `fq`: bytes it takes off its flow queues ahead of the wire (see
    /// `Port::size_nic`).
    nic_ring: u64,
    /// Stopped by the downstream neighbour, since when.
    paused: Option<Instant>,
    /// A departure event (the port frees) is scheduled.
    depart_pending: bool,
    /// Bytes held at the vertex this port leads to that came through it, not yet started
    /// on their way out (a switch's ingress occupancy), and whether it asked this port to
    /// stop.
    ingress_bytes: u64,
    xoff_sent: bool,
    /// When the last pause or resume sent to this port arrives: the next one arrives no
    /// earlier (control frames do not overtake one another on a link whose delay was
    /// lowered meanwhile; a resume ahead of its pause left the port paused for good).
    control_at: Instant,
    /// `headroom_bytes` of this port's link and next latency (kept off the per-packet
    /// path; recomputed when the link changes).
    headroom: u64,
}

struct InFlight {
    data: Frame,
    src: HostId,
    dst: HostId,
    id: u64,
    len: u32,
    wire_bits: u64,
    ecn: u8,
    /// Unseeded mix of the 5-tuple; each switch mixes in its own seed.
    flow: u64,
    /// Index of the load that made it (then `data` is empty and `dst` its target
    /// vertex), or `NO_LOAD`.
    load: u32,
    /// Lossless fabrics: the port it arrived through at the switch holding it, whose
    /// ingress occupancy it counts in; `NO_PORT` at a GPU.
    ingress: u32,
    /// Its IP TTL now: each switch takes one off here, and the packet's bytes are
    /// rewritten once, when it is delivered or captured (`packet::rewrite_ttl`), so that a
    /// hop does not touch them.
    ttl: u8,
    /// Its IP header has options: each switch looks for Record Route and Timestamp in it
    /// (`packet::record_route`, `packet::timestamp`); other packets' bytes are not touched
    /// on the way.
    options: bool,
}

/// What `transmit` needs of a packet: read from its slot apart from sending it (see
/// `Fabric::nic_start`).
#[derive(Clone, Copy)]
struct ToSend {
    slot: u32,
    len: u32,
    load: u32,
    wire_bits: u64,
}

struct VertexState {
    routing: Routing,
    hash_seed: u64,
    rng: Rng,
}

/// The fabric model.
pub struct Fabric {
    routes: Routes,
    ports: Vec<Port>,
    vertices: Vec<VertexState>,
    hosts: u32,
    addr_base: u32,
    mtu: u32,
    /// Datagrams addressed to switches, in fragments, waiting for the rest
    /// (`switches::answer`).
    reassembly: crate::reassembly::Reassembly,
    /// Each GPU's interface MTU where it differs from the fabric's (`set_gpu_mtu`): its
    /// NIC drops a longer frame as it arrives. Empty while every GPU has the fabric's.
    gpu_mtu: Vec<u32>,
    /// Each switch's control-plane policer (`SwitchParams::icmp_rate`; `None`: no limit),
    /// in switch order, and the fabric-time clock they read.
    policers: Vec<Option<Policer>>,
    policer_clock: FabricClock,
    l2_overhead: u32,
    slots: Vec<Option<InFlight>>,
    free: Vec<u32>,
    /// Each port's next arrival, packed for cheap comparison: time (ns) << 32 | port.
    events: BinaryHeap<Reverse<u128>>,
    in_transit: u64,
    next_packet: u64,
    now: Instant,
    /// Packets delivered and not polled yet, with the TTL their bytes get when polled:
    /// a packet's headers were last touched when it entered, often long ago, and the
    /// caller's loop over `poll_delivery` fetches them together (one read of memory
    /// after another, overlapped) where the event loop would wait for each in turn.
    deliveries: VecDeque<(Delivery, u8)>,
    /// Reused by `nic_start`.
    nic_burst: Vec<u32>,
    nic_sent: Vec<ToSend>,
    /// Reused by `retime`.
    retimed: Vec<Instant>,
    /// Drops that are no port's: at a GPU's ingress, at a switch (TTL), the memory budget.
    vertex_drops: Drops,
    /// Bytes charged for the packets the fabric holds (`charge`), and the most it may.
    memory_used: u64,
    memory_limit: u64,
    sent: u64,
    delivered: u64,
    /// Of `delivered`, packets addressed to a switch (and answered there).
    to_switches: u64,
    trace: Option<Vec<TraceEntry>>,
    /// The topology as built (for routes over what is left, and resets).
    topo: Topology,
    /// The box's clock at fabric time 0, ns since the Unix epoch (`set_epoch`).
    epoch_ns: u64,
    /// Per link: since when it is down.
    down_since: Vec<Option<Instant>>,
    /// Routes the fabric converged to over the links that are up; `None`: the original.
    live: Option<Routes>,
    /// When routes converge next (after a link went down or came up).
    converge_at: Option<Instant>,
    /// How many times routes converged (`route_epoch`).
    route_epoch: u64,
    /// How long the switch at a failed link's end takes to stop using it, and the rest
    /// of the fabric to reroute.
    detection: Duration,
    convergence: Duration,
    /// A link is down or routes differ: take the slower forwarding path that checks.
    degraded: bool,
    /// Group of each GPU while a partition holds.
    partition: Option<Vec<u16>>,
    /// Synthetic loads (their index is their generator's event key above the ports');
    /// a retired load's index is reused (`free_loads`).
    loads: Vec<LoadState>,
    /// Indices of the loads done and not retired, in the order they were done.
    done_loads: VecDeque<u32>,
    /// Indices of retired loads, for the next loads to start.
    free_loads: Vec<u32>,
    retired_loads: RetiredLoads,
    /// Loads that ended on their own (their last packet left), with when and what they
    /// sent: for the event log (`take_ended_loads`).
    ended_loads: Vec<(u32, Instant, u64)>,
    /// Of `in_transit`, synthetic packets.
    load_in_transit: u64,
    seed: u64,
    /// Packet taps (captures), when any port is tapped.
    taps: Option<Box<Taps>>,
    /// Per-flow counters, when enabled.
    flows: Option<Box<Flows>>,
    /// Lossy, or lossless (PFC, credits).
    flow_control: FlowControl,
    /// Toward the switches GPUs pinged lately (`toward`, as loads to a switch go): a few,
    /// computed at first use and dropped when routes converge.
    switch_routes: Vec<(VertexIdx, Vec<Vec<PortId>>)>,
    /// Per link: down when routes last converged (empty: all up, as at the start).
    converged_down: Vec<bool>,
}

impl std::fmt::Debug for Fabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fabric")
            .field("ports", &self.ports.len())
            .field("in_transit", &self.in_transit)
            .field("now", &self.now)
            .finish()
    }
}

impl Fabric {
    pub fn new(topo: &Topology) -> Fabric {
        let routes = Routes::new(topo);
        let h = topo.hosts.len() as u32;
        let seed = topo.fabric.seed;
        let mut ports = routes
            .ports
            .iter()
            .enumerate()
            .map(|(i, p)| Port {
                link: topo.links[p.link as usize].params,
                queue: if p.from < h {
                    topo.fabric.nic_queue
                } else {
                    topo.switches[(p.from - h) as usize].params.queue
                },
                next_latency: vertex_latency(topo, p.to),
                to: p.to,
                busy_until: Instant::ZERO,
                carry: 0,
                backlog: VecDeque::new(),
                transit: VecDeque::new(),
                backlog_bytes: 0,
                counters: PortCounters::default(),
                rng: Rng::new(seed, 1 << 40 | i as u64),
                loss_bad: false,
                waiting: VecDeque::new(),
                fq: (p.from < h && topo.fabric.nic_scheduler == NicScheduler::Fq)
                    .then(|| Box::new(FlowQueues::new(topo.fabric.mtu))),
                nic_ring: 0,
                paused: None,
                depart_pending: false,
                ingress_bytes: 0,
                xoff_sent: false,
                control_at: Instant::from_nanos(0),
                headroom: headroom_bytes(
                    &topo.links[p.link as usize].params,
                    vertex_latency(topo, p.to),
                    topo.fabric.l2_overhead,
                ),
            })
            .collect::<Vec<Port>>();
        let lossless = topo.fabric.flow_control != FlowControl::Lossy;
        for port in &mut ports {
            port.size_nic(topo.fabric.mtu, lossless);
        }
        assert!(
            routes.ports.len() < (1 << 29),
            "port numbers fit below the event flags"
        );
        let vertices = (0..h as usize + topo.switches.len())
            .map(|v| VertexState {
                routing: if v < h as usize {
                    Routing::Ecmp
                } else {
                    topo.switches[v - h as usize].params.routing
                },
                hash_seed: mix(seed ^ mix(v as u64 + 1)),
                rng: Rng::new(seed, v as u64),
            })
            .collect();
        let policer_clock = FabricClock::default();
        let policers = topo
            .switches
            .iter()
            .map(|s| Policer::new(&s.params, &policer_clock))
            .collect();
        Fabric {
            routes,
            ports,
            vertices,
            hosts: h,
            addr_base: u32::from(topo.fabric.pool.addr) + 1,
            mtu: topo.fabric.mtu,
            reassembly: Default::default(),
            gpu_mtu: Vec::new(),
            policers,
            policer_clock,
            l2_overhead: topo.fabric.l2_overhead,
            slots: Vec::new(),
            free: Vec::new(),
            events: BinaryHeap::new(),
            in_transit: 0,
            next_packet: 0,
            now: Instant::ZERO,
            deliveries: VecDeque::new(),
            nic_burst: Vec::new(),
            nic_sent: Vec::new(),
            retimed: Vec::new(),
            vertex_drops: Drops::default(),
            memory_used: 0,
            memory_limit: topo.fabric.packet_memory.get(),
            sent: 0,
            delivered: 0,
            to_switches: 0,
            trace: None,
            down_since: vec![None; topo.links.len()],
            live: None,
            converge_at: None,
            route_epoch: 0,
            detection: topo.fabric.detection,
            convergence: topo.fabric.convergence,
            degraded: false,
            partition: None,
            loads: Vec::new(),
            done_loads: VecDeque::new(),
            free_loads: Vec::new(),
            retired_loads: RetiredLoads::default(),
            ended_loads: Vec::new(),
            load_in_transit: 0,
            seed,
            taps: None,
            flows: None,
            flow_control: topo.fabric.flow_control,
            switch_routes: Vec::new(),
            converged_down: Vec::new(),
            topo: topo.clone(),
            epoch_ns: 0,
        }
    }

    pub fn routes(&self) -> &Routes {
        &self.routes
    }

    /// Counts the times routes converged (after links went down or came up): when it
    /// moves, the fabric forwards over `Routes::over_live_links` of the links up then
    /// (`changed_links`), or over `routes()` again once every link is up.
    pub fn route_epoch(&self) -> u64 {
        self.route_epoch
    }

    /// GPU `src` sends `data` (an IPv4 packet) at `now`. Events due by `now` are processed
    /// first, so `now` must not go backwards.
    pub fn send(&mut self, now: Instant, src: HostId, data: impl Into<Frame>) -> Verdict {
        let data = data.into();
        self.advance(now);
        self.sent += 1;
        let headers = match packet::inspect_head(data.head(), data.len()) {
            Ok(h) => h,
            Err(e) => {
                let r = match e {
                    Unforwardable::Malformed => DropReason::Malformed,
                    Unforwardable::NotIpv4 => DropReason::Unsupported,
                };
                self.vertex_drops.add(r);
                return Verdict::Dropped(r);
            }
        };
        let flow = flow_key_mix(&headers.key);
        if let Some(f) = &mut self.flows {
            match f.map.get_mut(&flow) {
                Some(e) => {
                    e.1.packets += 1;
                    e.1.bytes += headers.len as u64;
                    e.1.last = now;
                }
                None => {
                    let c = FlowCounters {
                        packets: 1,
                        bytes: headers.len as u64,
                        first: now,
                        last: now,
                        ..FlowCounters::default()
                    };
                    f.insert(flow, headers.key, c);
                }
            }
        }
        if headers.len as u32 > self.mtu {
            self.vertex_drops.add(DropReason::OverMtu);
            Flows::drop(&mut self.flows, flow);
            return Verdict::Dropped(DropReason::OverMtu);
        }
        let dst = u32::from(headers.key.dst).wrapping_sub(self.addr_base);
        // A packet to a switch's address goes to that switch, which answers it as a host
        // that runs no services (`packet::to_switch`).
        let to_switch = dst >= self.hosts && dst - self.hosts < self.topo.switches.len() as u32;
        if (dst >= self.hosts && !to_switch) || dst == src.0 {
            self.vertex_drops.add(DropReason::NoRoute);
            Flows::drop(&mut self.flows, flow);
            return Verdict::Dropped(DropReason::NoRoute);
        }
        if let Some(groups) = self.partition.as_ref().filter(|_| !to_switch) {
            if groups[src.0 as usize] != groups[dst as usize] {
                self.vertex_drops.add(DropReason::Partitioned);
                Flows::drop(&mut self.flows, flow);
                return Verdict::Dropped(DropReason::Partitioned);
            }
        }
        let charge = charge(&data);
        if self.memory_used + charge > self.memory_limit {
            self.vertex_drops.add(DropReason::MemoryLimit);
            Flows::drop(&mut self.flows, flow);
            return Verdict::Dropped(DropReason::MemoryLimit);
        }
        self.memory_used += charge;
        let len = headers.len as u32;
        let (ttl, options) = (data.head()[8], data.head()[0] & 0x0f > 5);
        let pkt = InFlight {
            ttl,
            options,
            data,
            src,
            dst: HostId(dst),
            id: self.next_packet,
            len,
            wire_bits: (len as u64 + self.l2_overhead as u64) * 8,
            ecn: headers.ecn,
            flow,
            load: NO_LOAD,
            ingress: NO_PORT,
        };
        self.next_packet += 1;
        let slot = self.hold(pkt);
        match self.forward(now, src.0, slot) {
            Ok(()) => Verdict::Accepted,
            Err(r) => Verdict::Dropped(r),
        }
    }

    fn hold(&mut self, pkt: InFlight) -> u32 {
        if pkt.load != NO_LOAD {
            self.loads[pkt.load as usize].held += 1;
        }
        match self.free.pop() {
            Some(s) => {
                // A free slot holds `None`: nothing to drop, so the old value is forgotten
                // rather than dropped, and the slot is written without being read first.
                // It was freed a while ago and is often out of the cache (the data
                // plane's copies run megabytes through it): a store does not wait for
                // the line, the load of a drop check would (1.5 % of the data plane's
                // thread in 8 gloo ranks' all_reduce, 0.5 % with this).
                let cell = &mut self.slots[s as usize];
                debug_assert!(cell.is_none(), "slot {s} is free");
                std::mem::forget(cell.replace(pkt));
                s
            }
            None => {
                self.slots.push(Some(pkt));
                self.slots.len() as u32 - 1
            }
        }
    }

    /// When the next event is due, if any.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.events.peek().map(|&Reverse(e)| unpack(e).0)
    }

    /// Processes every event due at or before `now`.
    pub fn advance(&mut self, now: Instant) {
        debug_assert!(now >= self.now, "time went backwards: {now} < {}", self.now);
        self.now = self.now.max(now);
        loop {
            let (t, slot, v, port) = {
                let Some(mut top) = self.events.peek_mut() else {
                    break;
                };
                let (t, port) = unpack(top.0);
                if t > now {
                    break;
                }
                if port & EVENT_KIND != 0 {
                    PeekMut::pop(top);
                    self.port_event(t, PortId(port & !EVENT_KIND), port & EVENT_KIND);
                    continue;
                }
                if port as usize >= self.ports.len() {
                    PeekMut::pop(top);
                    self.emit(t, port as usize - self.ports.len());
                    continue;
                }
                let p = &mut self.ports[port as usize];
                // A link that went down lost what it carried: nothing arrives.
                let Some((_at, slot)) = p.transit.pop_front() else {
                    PeekMut::pop(top);
                    continue;
                };
                // A port's one arrival event is always its next frame's (`flush` and
                // `retime` take it off the schedule when that frame changes).
                debug_assert_eq!(_at, t, "port {port}: an arrival event out of step");
                match p.transit.front() {
                    Some(&(next, _)) => top.0 = pack(next, port),
                    None => {
                        PeekMut::pop(top);
                    }
                }
                (t, slot, p.to, PortId(port))
            };
            self.in_transit -= 1;
            self.converge_by(t);
            if v >= self.hosts && self.flow_control != FlowControl::Lossy {
                // Held at this switch, it counts against the ingress it came through.
                self.slots[slot as usize]
                    .as_mut()
                    .expect("live slot")
                    .ingress = port.0;
            }
            let pkt = self.slots[slot as usize].as_ref().expect("live slot");
            let load = pkt.load;
            if load == NO_LOAD && Taps::wants(&self.taps, port, None) {
                let p = &self.ports[port.0 as usize];
                let left = Instant::from_nanos(
                    t.as_nanos()
                        .saturating_sub((p.link.delay + p.next_latency).as_nanos()),
                );
                let taps = self.taps.as_mut().expect("tapped");
                taps.record(port, left, pkt, None);
            }
            if load != NO_LOAD {
                self.load_in_transit -= 1;
                let st = &self.loads[load as usize];
                if v == st.gen.spec.to {
                    let len = self.release(slot).len;
                    let c = &mut self.loads[load as usize].counters;
                    // A GPU whose host lowered its MTU drops longer frames (`set_gpu_mtu`).
                    if self.gpu_mtu.get(v as usize).is_some_and(|&m| len > m) {
                        c.drops.add(DropReason::OverMtu);
                        self.ports[port.0 as usize].counters.load_drops += 1;
                        continue;
                    }
                    c.delivered_packets += 1;
                    c.delivered_bytes += len as u64;
                } else {
                    let _ = self.forward(t, v, slot);
                }
            } else if v < self.hosts {
                if self.gpu_mtu.get(v as usize).is_some_and(|&m| pkt.len > m) {
                    self.nic_drop_long(t, port, slot);
                    continue;
                }
                let pkt = self.release(slot);
                debug_assert_eq!(pkt.dst.0, v);
                self.delivered += 1;
                let d = Delivery {
                    at: t,
                    src: pkt.src,
                    dst: pkt.dst,
                    data: pkt.data,
                };
                self.deliveries.push_back((d, pkt.ttl));
            } else {
                // Drops inside the fabric are counted on the port.
                let _ = self.forward(t, v, slot);
            }
        }
        // Routes due to converge by now do, even when no packet is moving.
        self.converge_by(now);
    }

    /// Whether link `l` is up (not down since a `Change::LinkDown`); a link that loses
    /// every frame (`loss` 1) is up.
    pub fn link_up(&self, l: u32) -> bool {
        self.down_since[l as usize].is_none()
    }

    /// The box's clock read `epoch_ns` (ns since the Unix epoch) at fabric time 0: the
    /// switches' entries in IP Timestamp options (`ping -T`) are then the box's clock as
    /// the packet passed (fabric time dilated by the time scale), as the GPUs' own
    /// stamps are; before, fabric time itself.
    pub fn set_epoch(&mut self, epoch_ns: u64) {
        self.epoch_ns = epoch_ns;
    }

    /// An IP timestamp (ms since midnight UT) for fabric time `t` (`set_epoch`).
    pub(crate) fn ip_timestamp(&self, t: Instant) -> u32 {
        let wall = self
            .topo
            .fabric
            .time_scale
            .to_wall(t.saturating_since(Instant::ZERO));
        packet::ms_since_midnight(self.epoch_ns.saturating_add(wall.as_nanos() as u64))
    }

    /// GPU `gpu`'s interface MTU is now `mtu` (bytes of IP packet), as its host set it: a
    /// frame longer than that arriving at the GPU is dropped by its NIC (`OverMtu`, on the
    /// port into it), as a real NIC sized for its MTU drops it. Frames the GPU sends are
    /// held to the fabric's MTU whatever its own (a switch drops longer ones). Applies to
    /// frames arriving from now on.
    pub fn set_gpu_mtu(&mut self, gpu: HostId, mtu: u32) {
        let i = gpu.0 as usize;
        if i >= self.hosts as usize {
            return;
        }
        if self.gpu_mtu.is_empty() {
            if mtu == self.mtu {
                return;
            }
            self.gpu_mtu = vec![self.mtu; self.hosts as usize];
        }
        self.gpu_mtu[i] = mtu;
        if self.gpu_mtu.iter().all(|&m| m >= self.mtu) {
            // Longer frames than the fabric's never arrive: nothing to check.
            self.gpu_mtu.clear();
        }
    }

    /// GPU `gpu`'s interface MTU as the model knows it (`set_gpu_mtu`; the fabric's until
    /// then), or `None` past the last GPU.
    pub fn gpu_mtu(&self, gpu: HostId) -> Option<u32> {
        let i = gpu.0 as usize;
        (i < self.hosts as usize).then(|| self.gpu_mtu.get(i).copied().unwrap_or(self.mtu))
    }

    /// The frame in `slot`, arrived at `t` through `port` at a GPU whose interface MTU it
    /// exceeds: dropped there, counted on the port (and tapped, and the flow's).
    fn nic_drop_long(&mut self, t: Instant, port: PortId, slot: u32) {
        let pkt = self.release(slot);
        self.ports[port.0 as usize]
            .counters
            .drops
            .add(DropReason::OverMtu);
        Flows::drop(&mut self.flows, pkt.flow);
        if Taps::wants(&self.taps, port, Some(DropReason::OverMtu)) {
            let taps = self.taps.as_mut().expect("tapped");
            taps.record(port, t, &pkt, Some(DropReason::OverMtu));
        }
    }

    /// The next packet that has arrived at its GPU, in arrival order.
    #[must_use]
    pub fn poll_delivery(&mut self) -> Option<Delivery> {
        let (mut d, ttl) = self.deliveries.pop_front()?;
        packet::rewrite_ttl(d.data.head_mut(), ttl);
        Some(d)
    }

    fn release(&mut self, slot: u32) -> InFlight {
        self.free.push(slot);
        let pkt = self.slots[slot as usize].take().expect("live slot");
        self.memory_used -= charge(&pkt.data);
        if pkt.load != NO_LOAD {
            self.loads[pkt.load as usize].held -= 1;
        }
        pkt
    }

    /// Bytes charged for the packets the fabric holds now, and its budget
    /// (`[fabric] packet_memory`): each packet costs its buffer plus `PACKET_OVERHEAD`.
    pub fn memory(&self) -> (u64, u64) {
        (self.memory_used, self.memory_limit)
    }

    /// Per-port counters as of `now` (settles queues first). `busy` counts only
    /// serialization done by `now`, not that of packets still queued.
    pub fn port_counters(&mut self, now: Instant) -> Vec<PortCounters> {
        self.advance(now);
        self.ports
            .iter_mut()
            .map(|p| {
                settle(p, now);
                let mut c = p.counters;
                let ahead = p.busy_until.saturating_since(now).as_nanos();
                c.busy = Duration::from_nanos(c.busy.as_nanos().saturating_sub(ahead));
                if let Some(since) = p.paused {
                    c.paused += now.saturating_since(since);
                }
                c
            })
            .collect()
    }

    /// The time the model has been advanced to.
    pub fn now(&self) -> Instant {
        self.now
    }

    /// One port as of `now` (events due are processed first): bytes queued (GPU packets
    /// and load, the one in service included) and serialization time done so far.
    pub fn port_sample(&mut self, p: PortId, now: Instant) -> (u64, Duration) {
        self.advance(now);
        let port = &mut self.ports[p.0 as usize];
        settle(port, now);
        let ahead = port.busy_until.saturating_since(now).as_nanos();
        let busy = Duration::from_nanos(port.counters.busy.as_nanos().saturating_sub(ahead));
        (port.backlog_bytes, busy)
    }

    /// Packets and bytes queued (admitted, not finished) at a port as of the last settle.
    pub fn queued(&self, p: PortId) -> (usize, u64) {
        let port = &self.ports[p.0 as usize];
        let waiting = port.waiting.len() + port.fq.as_ref().map_or(0, |fq| fq.len());
        (port.backlog.len() + waiting, port.backlog_bytes)
    }

    /// Fabric-wide totals as of `now`.
    pub fn totals(&mut self, now: Instant) -> Totals {
        let counters = self.port_counters(now);
        let mut drops = self.vertex_drops;
        for c in &counters {
            for r in DropReason::ALL {
                drops.0[r as usize] += c.drops.get(r);
            }
        }
        Totals {
            sent: self.sent,
            delivered: self.delivered,
            to_switches: self.to_switches,
            drops,
            queued: self
                .ports
                .iter()
                .flat_map(|p| p.backlog.iter())
                .filter(|e| e.2 & SYNTHETIC == 0)
                .count() as u64
                + self
                    .ports
                    .iter()
                    .flat_map(|p| {
                        let fq = p.fq.iter().flat_map(|fq| fq.slots());
                        p.waiting.iter().copied().chain(fq)
                    })
                    .filter(|&s| {
                        self.slots[s as usize]
                            .as_ref()
                            .is_some_and(|p| p.load == NO_LOAD)
                    })
                    .count() as u64,
            // Finished on a port, not yet arrived (propagation, switch latency).
            in_flight: self.in_transit
                - self.load_in_transit
                - self
                    .ports
                    .iter()
                    .flat_map(|p| p.backlog.iter())
                    .filter(|e| e.2 == 0)
                    .count() as u64,
        }
    }
}

/// Fabric-wide packet accounting: `sent = delivered + drops + queued + in_flight`
/// (`sent`: what GPUs sent, and the ICMP errors switches answered with).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Totals {
    pub sent: u64,
    /// To their GPU, or to the switch they were addressed to (`to_switches` of them).
    pub delivered: u64,
    pub to_switches: u64,
    pub drops: Drops,
    pub queued: u64,
    pub in_flight: u64,
}

/// What one held packet costs beyond its buffer: its slot, queue and transit entries
/// (with the slack of growable queues) and the allocator's header. Measured against the
/// daemon's peak RSS under a flood of minimum-size packets (see the README).
pub const PACKET_OVERHEAD: u64 = 256;

/// Largest packet the fabric is handed (an IPv4 packet; with TUN offload, a super-packet
/// of many frames).
const MAX_PACKET: u64 = 65_535;

/// The memory charged for holding a packet.
#[inline]
fn charge(data: &Frame) -> u64 {
    data.charge() as u64 + PACKET_OVERHEAD
}

fn pack(t: Instant, port: u32) -> u128 {
    (t.as_nanos() as u128) << 32 | port as u128
}

fn unpack(e: u128) -> (Instant, u32) {
    (Instant::from_nanos((e >> 32) as u64), e as u32)
}
