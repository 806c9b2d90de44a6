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

use std::cmp::Reverse;
use std::collections::binary_heap::PeekMut;
use std::collections::{BinaryHeap, VecDeque};
use std::net::Ipv4Addr;

use crate::fq::FlowQueues;
use crate::frame::Frame;
use crate::load::{Generator, LoadCounters, LoadSpec};
use crate::packet::{self, FlowKey, Unforwardable, ECN_CE, ECN_NOT_ECT};
use crate::rng::{mix, Rng};
use crate::routing::{scale_out_bfs, vertex_latency, PortId, Routes, VertexIdx};
use crate::topology::{
    Ecn, FlowControl, HostId, LinkParams, NicScheduler, QueueParams, Routing, SwitchId, Topology,
};
use crate::units::{Bandwidth, Bytes, Duration, Instant};

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
    /// Longer than the fabric's MTU: sent by a GPU whose interface MTU was raised above
    /// the fabric's. The switch port it enters drops it, as a real one drops a giant frame
    /// (TCP over such a path stalls on its full-sized segments: a PMTU black hole).
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

/// A load and what it did.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadStatus {
    pub spec: LoadSpec,
    pub started: Instant,
    /// Still sending (not stopped, not done).
    pub active: bool,
    pub counters: LoadCounters,
}

struct LoadState {
    gen: Generator,
    active: bool,
    counters: LoadCounters,
    /// Toward a switch: per vertex, the ports on a shortest path (routing tables hold
    /// only GPU destinations). Empty toward a GPU.
    toward: Vec<Vec<PortId>>,
}

/// A GPU packet seen at a tapped port (`Fabric::set_taps`): as it left the port (after
/// ECN marking, before the next switch decrements its TTL), stamped when its last bit
/// left; or, when the taps want drops, as it was lost there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tapped {
    pub port: PortId,
    pub at: Instant,
    /// IP bytes of the packet (`data` holds at most the snap length of them).
    pub len: u32,
    pub data: Vec<u8>,
    pub dropped: Option<DropReason>,
}

/// Which ports are tapped, and what was seen not yet polled.
struct Taps {
    on: Vec<bool>,
    snaplen: u32,
    drops: bool,
    out: VecDeque<Tapped>,
    /// Records not kept because `out` held `MAX_TAPPED` (the caller polls too rarely).
    overflow: u64,
}

/// Most tapped packets held for `poll_tapped`.
const MAX_TAPPED: usize = 1 << 16;

impl Taps {
    #[inline]
    fn wants(taps: &Option<Box<Taps>>, port: PortId, dropped: Option<DropReason>) -> bool {
        taps.as_ref().is_some_and(|t| {
            t.on.get(port.0 as usize).copied().unwrap_or(false) && (dropped.is_none() || t.drops)
        })
    }

    fn record(&mut self, port: PortId, at: Instant, pkt: &InFlight, dropped: Option<DropReason>) {
        if self.out.len() >= MAX_TAPPED {
            self.overflow += 1;
            return;
        }
        let mut data = pkt.data.prefix(self.snaplen as usize);
        // The TTL it has here (the model counts hops without rewriting the packet).
        if data.len() >= 12 {
            packet::rewrite_ttl(&mut data, pkt.ttl);
        }
        self.out.push_back(Tapped {
            port,
            at,
            len: pkt.len,
            data,
            dropped,
        });
    }
}

/// What the fabric did with one flow's packets (`Fabric::enable_flows`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowCounters {
    pub packets: u64,
    /// IP bytes.
    pub bytes: u64,
    /// Dropped anywhere in the fabric, for any reason.
    pub drops: u64,
    pub ecn_marked: u64,
    pub first: Instant,
    pub last: Instant,
}

/// Hashes the flow map's keys as they are: they are already mixed 64-bit hashes of the
/// 5-tuple, and the map is looked up for every packet a GPU sends.
#[derive(Default)]
pub(crate) struct MixedKey(u64);

impl std::hash::Hasher for MixedKey {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = mix(self.0 ^ b as u64);
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

type FlowMap = std::collections::HashMap<
    u64,
    (FlowKey, FlowCounters),
    std::hash::BuildHasherDefault<MixedKey>,
>;

/// Per-flow counters, keyed by the flow's (unseeded) 5-tuple hash.
struct Flows {
    map: FlowMap,
    max: usize,
    /// Packets of flows beyond `max`.
    untracked: u64,
}

impl Flows {
    #[inline]
    fn drop(flows: &mut Option<Box<Flows>>, flow: u64) {
        if let Some(e) = flows.as_mut().and_then(|f| f.map.get_mut(&flow)) {
            e.1.drops += 1;
        }
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
/// Mixed with a load's index: its flow key in a NIC's flow queues.
const LOAD_FLOW: u64 = 0x6c6f_6164_0000_0000;
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
    /// Synthetic loads, in the order they started (their index is their generator's
    /// event key above the ports').
    loads: Vec<LoadState>,
    /// Loads that ended on their own (their last packet left), with when: for the
    /// event log (`take_ended_loads`).
    ended_loads: Vec<(u32, Instant)>,
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

/// Groups (one per vertex, per switch) `Fabric::switch_routes` keeps at most: every switch's
/// of a fabric of a few thousand vertices, 8 switches' or more of the largest (each one
/// missed is a breadth-first search of the fabric on the next hop of a ping to it). The
/// daemon's memory bound (`plan::DaemonMemory`) counts them.
const SWITCH_ROUTE_GROUPS: usize = 1 << 20;

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
        Fabric {
            routes,
            ports,
            vertices,
            hosts: h,
            addr_base: u32::from(topo.fabric.pool.addr) + 1,
            mtu: topo.fabric.mtu,
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
            ended_loads: Vec::new(),
            load_in_transit: 0,
            seed,
            taps: None,
            flows: None,
            flow_control: topo.fabric.flow_control,
            switch_routes: Vec::new(),
            converged_down: Vec::new(),
            topo: topo.clone(),
        }
    }

    /// Taps `ports` from now on (replacing any taps): their GPU packets, the first
    /// `snaplen` bytes of each, and with `drops` also those lost there; `poll_tapped`
    /// hands them out. An empty list removes the taps.
    pub fn set_taps(&mut self, ports: &[PortId], snaplen: u32, drops: bool) {
        if ports.is_empty() {
            self.taps = None;
            return;
        }
        let mut on = vec![false; self.ports.len()];
        for p in ports {
            on[p.0 as usize] = true;
        }
        let (out, overflow) = self
            .taps
            .take()
            .map_or((VecDeque::new(), 0), |t| (t.out, t.overflow));
        self.taps = Some(Box::new(Taps {
            on,
            snaplen,
            drops,
            out,
            overflow,
        }));
    }

    /// Counts packets, bytes, drops and ECN marks per flow (5-tuple) from now on, for up
    /// to `max` flows (packets of more are counted as untracked).
    pub fn enable_flows(&mut self, max: usize) {
        self.flows.get_or_insert_with(|| {
            Box::new(Flows {
                map: FlowMap::default(),
                max,
                untracked: 0,
            })
        });
    }

    /// Every flow seen since `enable_flows`, with its counters, and the packets of flows
    /// beyond the limit.
    pub fn flows(&self) -> (Vec<(FlowKey, FlowCounters)>, u64) {
        match &self.flows {
            Some(f) => (f.map.values().copied().collect(), f.untracked),
            None => (Vec::new(), 0),
        }
    }

    /// The next packet a tap saw, in the order they were seen.
    pub fn poll_tapped(&mut self) -> Option<Tapped> {
        self.taps.as_mut()?.out.pop_front()
    }

    /// Tapped packets not kept because they were not polled in time.
    pub fn tap_overflow(&self) -> u64 {
        self.taps.as_ref().map_or(0, |t| t.overflow)
    }

    /// Records every port departure from now on (for tests and captures; costs memory).
    pub fn enable_trace(&mut self) {
        self.trace.get_or_insert_with(Vec::new);
    }

    pub fn trace(&self) -> &[TraceEntry] {
        self.trace.as_deref().unwrap_or(&[])
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

    /// The ports every packet of a flow crosses, as `send` routes it: ECMP switches hash
    /// the 5-tuple, so a flow keeps one path. `None` if the destination is not another GPU
    /// of this fabric (or a switch), or a switch on the way sprays or adapts packet by
    /// packet.
    pub fn flow_path(&self, key: &FlowKey) -> Option<Vec<PortId>> {
        let host = |a: Ipv4Addr| {
            let h = u32::from(a).wrapping_sub(self.addr_base);
            (h < self.hosts).then_some(h)
        };
        let to = u32::from(key.dst).wrapping_sub(self.addr_base);
        if to >= self.hosts && to - self.hosts < self.topo.switches.len() as u32 {
            return self.path_to_switch(host(key.src)?, to, flow_key_mix(key));
        }
        let (mut v, dst) = (host(key.src)?, HostId(host(key.dst)?));
        if v == dst.0 {
            return None;
        }
        let flow = flow_key_mix(key);
        let mut path = Vec::new();
        while v != dst.0 {
            let vs = &self.vertices[v as usize];
            // As `forward` does; once converged, every switch knows which links are down.
            let live = self.live.as_ref().unwrap_or(&self.routes).next_hops(v, dst);
            let usable = |p: PortId| self.down_since[self.routes.port(p).link as usize].is_none();
            let p = match (live.iter().filter(|&&p| usable(p)).count(), vs.routing) {
                (0, _) => return None,
                (1, _) => live.iter().copied().find(|&p| usable(p))?,
                (_, Routing::Spray | Routing::Adaptive) => return None,
                (_, Routing::Ecmp) => resilient_pick(
                    self.routes.next_hops(v, dst),
                    live,
                    usable,
                    flow,
                    vs.hash_seed,
                )?,
            };
            path.push(p);
            v = self.routes.port(p).to;
        }
        Some(path)
    }

    /// The ports a packet from GPU `v` to switch vertex `to` crosses (`forward_to_switch`).
    fn path_to_switch(&self, mut v: VertexIdx, to: VertexIdx, flow: u64) -> Option<Vec<PortId>> {
        let toward = self.toward(to);
        let usable = |p: &&PortId| self.down_since[self.routes.port(**p).link as usize].is_none();
        let mut path = Vec::new();
        while v != to {
            let group = &toward[v as usize];
            let n = group.iter().filter(usable).count();
            if n == 0 {
                return None;
            }
            let k = ecmp_index(flow, self.vertices[v as usize].hash_seed, n);
            let p = *group.iter().filter(usable).nth(k)?;
            path.push(p);
            v = self.routes.port(p).to;
        }
        Some(path)
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
            let full = f.map.len() >= f.max;
            match f.map.get_mut(&flow) {
                Some(e) => {
                    e.1.packets += 1;
                    e.1.bytes += headers.len as u64;
                    e.1.last = now;
                }
                None if full => f.untracked += 1,
                None => {
                    let c = FlowCounters {
                        packets: 1,
                        bytes: headers.len as u64,
                        first: now,
                        last: now,
                        ..FlowCounters::default()
                    };
                    f.map.insert(flow, (headers.key, c));
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
        let ttl = data.head()[8];
        let pkt = InFlight {
            ttl,
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
                    let len = self.release(slot).len as u64;
                    let c = &mut self.loads[load as usize].counters;
                    c.delivered_packets += 1;
                    c.delivered_bytes += len;
                } else {
                    let _ = self.forward(t, v, slot);
                }
            } else if v < self.hosts {
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

    /// Applies `change` at `now` (events due by then are processed first). Returns false if
    /// it changes nothing (a link already down, or already up).
    pub fn apply(&mut self, now: Instant, change: Change) -> bool {
        self.advance(now);
        self.converge_by(now);
        let ports = |l: u32| [PortId(2 * l), PortId(2 * l + 1)];
        match change {
            Change::LinkDown(l) => {
                if self.down_since[l as usize].is_some() {
                    return false;
                }
                for p in ports(l) {
                    self.flush(p, now);
                }
                self.down_since[l as usize] = Some(now);
                self.converge_at = Some(now + self.convergence);
                self.degraded = true;
            }
            Change::LinkUp(l) => {
                if self.down_since[l as usize].take().is_none() {
                    return false;
                }
                self.converge_at = Some(now + self.convergence);
            }
            Change::SetLink {
                link,
                dirs,
                rate,
                delay,
                loss,
                loss_burst,
                buffer,
            } => {
                for p in dirs.ports(link) {
                    let port = &mut self.ports[p.0 as usize];
                    settle(port, now);
                    let was = port.link;
                    if let Some(r) = rate {
                        port.link.rate = r;
                    }
                    if let Some(d) = delay {
                        port.link.delay = d;
                    }
                    if let Some(x) = loss {
                        port.link.loss = x;
                    }
                    if let Some(x) = loss_burst {
                        port.link.loss_burst = x;
                    }
                    port.loss_bad = false;
                    if let Some(b) = buffer {
                        port.queue.buffer = b;
                    }
                    self.link_changed(p);
                    self.retime(now, p, was);
                }
            }
            Change::Partition(groups) => {
                assert_eq!(groups.len(), self.hosts as usize, "a group per GPU");
                if self.partition.as_ref() == Some(&groups) {
                    return false;
                }
                self.partition = Some(groups);
            }
            Change::Heal => {
                if self.partition.take().is_none() {
                    return false;
                }
            }
            Change::StartLoad(spec) => {
                let n = self.hosts as usize + self.topo.switches.len();
                assert!(
                    (spec.from as usize) < n && (spec.to as usize) < n && spec.from != spec.to,
                    "a load between two vertices of the fabric"
                );
                assert!(
                    spec.packet > 0 && spec.rate.bps() > 0,
                    "a load sends something"
                );
                if self.loads.iter().any(|l| l.gen.spec.id == spec.id) {
                    return false;
                }
                let i = self.loads.len();
                let rng = Rng::new(self.seed, 2 << 40 | spec.id as u64);
                let mut st = LoadState {
                    gen: Generator::new(spec, now, rng),
                    active: true,
                    counters: LoadCounters::default(),
                    toward: Vec::new(),
                };
                st.toward = self.toward(st.gen.spec.to);
                self.loads.push(st);
                self.events
                    .push(Reverse(pack(now, (self.ports.len() + i) as u32)));
            }
            Change::StopLoad(id) => {
                let Some(st) = self.loads.iter_mut().find(|l| l.gen.spec.id == id) else {
                    return false;
                };
                if !st.active {
                    return false;
                }
                st.active = false;
                st.gen.next = None;
            }
            Change::ResetLink(link) => {
                for p in ports(link) {
                    let buffer = self.original_buffer(p.0);
                    let port = &mut self.ports[p.0 as usize];
                    settle(port, now);
                    let was = port.link;
                    port.link = self.topo.links[link as usize].params;
                    port.loss_bad = false;
                    port.queue.buffer = buffer;
                    self.link_changed(p);
                    self.retime(now, p, was);
                }
            }
        }
        true
    }

    /// Every load started, in order, with its counters.
    pub fn loads(&self) -> Vec<LoadStatus> {
        self.loads
            .iter()
            .map(|l| LoadStatus {
                spec: l.gen.spec.clone(),
                started: l.gen.started,
                active: l.active,
                counters: l.counters,
            })
            .collect()
    }

    /// Loads that ended on their own since the last call (not those stopped), each with
    /// its last packet's departure, in the order they ended.
    pub fn take_ended_loads(&mut self) -> Vec<(u32, Instant)> {
        std::mem::take(&mut self.ended_loads)
    }

    /// The share of a load's packets that crosses each port, as the fabric routes them
    /// now (split evenly at every equal-cost branch): what it takes from each link, for
    /// predictions. Empty for an unknown id.
    pub fn load_shares(&self, id: u32) -> Vec<(PortId, f64)> {
        let Some(st) = self.loads.iter().find(|l| l.gen.spec.id == id) else {
            return Vec::new();
        };
        let n = self.hosts as usize + self.topo.switches.len();
        let mut at = vec![0.0f64; n];
        at[st.gen.spec.from as usize] = 1.0;
        let mut order = vec![st.gen.spec.from];
        let mut out: Vec<(PortId, f64)> = Vec::new();
        let mut i = 0;
        while i < order.len() {
            let v = order[i];
            i += 1;
            let share = std::mem::take(&mut at[v as usize]);
            if v == st.gen.spec.to || share == 0.0 {
                continue;
            }
            let group: Vec<PortId> = self
                .load_group(st, v)
                .iter()
                .copied()
                .filter(|&p| self.down_since[self.routes.port(p).link as usize].is_none())
                .collect();
            for &p in &group {
                let part = share / group.len() as f64;
                match out.iter_mut().find(|(q, _)| *q == p) {
                    Some(e) => e.1 += part,
                    None => out.push((p, part)),
                }
                let u = self.routes.port(p).to;
                if at[u as usize] == 0.0 && !order[i..].contains(&u) {
                    order.push(u);
                }
                at[u as usize] += part;
            }
        }
        out
    }

    /// The ports a load's packets may take at `v` (before taking out dead links).
    fn load_group<'a>(&'a self, st: &'a LoadState, v: VertexIdx) -> &'a [PortId] {
        let to = st.gen.spec.to;
        if to < self.hosts {
            self.live
                .as_ref()
                .unwrap_or(&self.routes)
                .next_hops(v, HostId(to))
        } else {
            &st.toward[v as usize]
        }
    }

    /// Toward switch vertex `to`: per vertex, its ports on a shortest path over the links
    /// that are up (GPUs do not forward). Empty toward a GPU (routes have those).
    fn toward(&self, to: VertexIdx) -> Vec<Vec<PortId>> {
        self.toward_over(to, |l| self.down_since[l as usize].is_none())
    }

    /// `toward` over the links for which `up(link index)` holds.
    fn toward_over(&self, to: VertexIdx, up: impl Fn(u32) -> bool) -> Vec<Vec<PortId>> {
        if to < self.hosts {
            return Vec::new();
        }
        let n = self.hosts as usize + self.topo.switches.len();
        let (ports, out) = (&self.routes.ports, &self.routes.out);
        let alive = |p: PortId| up(ports[p.0 as usize].link);
        let mut dist = vec![u32::MAX; n];
        let mut queue = std::collections::VecDeque::new();
        let h = self.hosts;
        scale_out_bfs(
            out,
            ports,
            to,
            &mut dist,
            &mut queue,
            |v| v < h,
            |p, _| !alive(p),
        );
        (0..n)
            .map(|v| {
                let dv = dist[v];
                if dv == u32::MAX || dv == 0 {
                    return Vec::new();
                }
                out[v]
                    .iter()
                    .copied()
                    .filter(|&p| {
                        let u = ports[p.0 as usize].to;
                        alive(p) && dist[u as usize] == dv - 1 && (u >= h)
                    })
                    .collect()
            })
            .collect()
    }

    /// Load `i`'s packet due at `t` leaves (and its next one is scheduled).
    fn emit(&mut self, t: Instant, i: usize) {
        let key = (self.ports.len() + i) as u32;
        let l2 = self.l2_overhead as u64;
        let st = &mut self.loads[i];
        if !st.active || st.gen.next != Some(t) {
            return;
        }
        let len = st.gen.packet_len();
        let wire_bits = (len as u64 + l2) * 8;
        st.gen.sent(t, len, wire_bits);
        match st.gen.next {
            Some(n) => self.events.push(Reverse(pack(n, key))),
            None => {
                st.active = false;
                self.ended_loads.push((st.gen.spec.id, t));
            }
        }
        st.counters.sent_packets += 1;
        st.counters.sent_bytes += len as u64;
        let (from, to) = (st.gen.spec.from, st.gen.spec.to);
        if let Some(groups) = &self.partition {
            if from < self.hosts && to < self.hosts && groups[from as usize] != groups[to as usize]
            {
                st.counters.drops.add(DropReason::Partitioned);
                return;
            }
        }
        if self.memory_used + PACKET_OVERHEAD > self.memory_limit {
            st.counters.drops.add(DropReason::MemoryLimit);
            return;
        }
        self.memory_used += PACKET_OVERHEAD;
        let pkt = InFlight {
            data: Frame::default(),
            src: HostId(from),
            dst: HostId(to),
            id: self.next_packet,
            len,
            wire_bits,
            ecn: packet::ECN_ECT0,
            flow: 0,
            load: i as u32,
            ingress: NO_PORT,
            // (Not an IP packet: no switch looks at it.)
            ttl: 0,
        };
        self.next_packet += 1;
        let slot = self.hold(pkt);
        let _ = self.forward(t, from, slot);
    }

    /// Forwards load `i`'s packet in `slot` at vertex `v`: a random one of the usable
    /// equal-cost ports (a load is many flows), with the detection rules of GPU traffic.
    fn forward_load(
        &mut self,
        now: Instant,
        v: VertexIdx,
        slot: u32,
        i: usize,
    ) -> Result<(), DropReason> {
        let draw = self.loads[i].gen.rng.next_u64();
        let detection = self.detection;
        let known_dead = |p: PortId| {
            self.down_since[self.routes.port(p).link as usize].is_some_and(|t| now >= t + detection)
        };
        let group = self.load_group(&self.loads[i], v);
        let n = group.iter().filter(|&&p| !known_dead(p)).count();
        let pick = (n > 0).then(|| {
            group
                .iter()
                .copied()
                .filter(|&p| !known_dead(p))
                .nth((draw % n as u64) as usize)
        });
        let Some(Some(p)) = pick else {
            self.release(slot);
            self.loads[i].counters.drops.add(DropReason::NoRoute);
            return Err(DropReason::NoRoute);
        };
        if self.down_since[self.routes.port(p).link as usize].is_some() {
            self.ports[p.0 as usize].counters.load_drops += 1;
            self.loads[i].counters.drops.add(DropReason::LinkDown);
            self.release(slot);
            return Err(DropReason::LinkDown);
        }
        self.enqueue(now, p, slot)
    }

    /// The group of each GPU while a partition holds.
    pub fn partition(&self) -> Option<&[u16]> {
        self.partition.as_deref()
    }

    /// Links that are down or whose parameters differ from the topology's.
    pub fn changed_links(&self) -> Vec<LinkState> {
        (0..self.topo.links.len() as u32)
            .filter_map(|l| {
                let (a, b) = (&self.ports[2 * l as usize], &self.ports[2 * l as usize + 1]);
                let original = &self.topo.links[l as usize].params;
                let down = self.down_since[l as usize];
                let changed = a.link != *original
                    || b.link != *original
                    || a.queue.buffer != self.original_buffer(2 * l)
                    || b.queue.buffer != self.original_buffer(2 * l + 1);
                (down.is_some() || changed).then_some(LinkState {
                    link: l,
                    up: down.is_none(),
                    down_since: down,
                    params: [a.link, b.link],
                    buffers: [a.queue.buffer, b.queue.buffer],
                })
            })
            .collect()
    }

    fn original_buffer(&self, port: u32) -> Bytes {
        let from = self.routes.port(PortId(port)).from;
        let h = self.topo.hosts.len() as u32;
        if from < h {
            self.topo.fabric.nic_queue.buffer
        } else {
            self.topo.switches[(from - h) as usize].params.queue.buffer
        }
    }

    /// Loses everything port `p` holds (queued or on its wire), counted as `LinkDown`.
    fn flush(&mut self, p: PortId, now: Instant) {
        let port = &mut self.ports[p.0 as usize];
        let lost: Vec<u32> = port.transit.drain(..).map(|(_, slot)| slot).collect();
        // What finished serializing is counted as sent (or lost on the wire); a packet
        // lost on the wire (configured loss) whose serialization had not finished is
        // counted as lost now, as `settle` would have; the rest of the backlog is in
        // `transit` too.
        settle(port, now);
        for &(_, _, flags) in &port.backlog {
            if flags & LOST != 0 {
                count_lost(&mut port.counters, flags);
            }
        }
        port.backlog.clear();
        port.backlog_bytes = 0;
        port.busy_until = now;
        port.carry = 0;
        if let Some(since) = port.paused.take() {
            port.counters.paused += now.saturating_since(since);
        }
        let mut waiting: Vec<u32> = port.waiting.drain(..).collect();
        if let Some(fq) = &mut port.fq {
            waiting.extend(fq.drain());
        }
        self.in_transit -= lost.len() as u64;
        // Nothing arrives and nothing waits to start: an arrival still scheduled would
        // take the next frame sent (after the link is back) off the wire early.
        let depart = std::mem::replace(&mut port.depart_pending, false);
        self.unschedule(p.0);
        if depart {
            self.unschedule(DEPART_EVENT | p.0);
        }
        // Lost on the wire (started), or waiting to start (lossless, or a NIC's flows).
        let on_wire = lost.into_iter().map(|s| (s, true));
        for (slot, started) in on_wire.chain(waiting.into_iter().map(|s| (s, false))) {
            let pkt = self.release(slot);
            if pkt.ingress != NO_PORT {
                // What waited here leaves the switch's ingress as it is lost.
                self.free_ingress(now, PortId(pkt.ingress), pkt.len);
            }
            let load = pkt.load;
            let counters = &mut self.ports[p.0 as usize].counters;
            if load == NO_LOAD {
                counters.drops.add(DropReason::LinkDown);
                Flows::drop(&mut self.flows, pkt.flow);
                if Taps::wants(&self.taps, p, Some(DropReason::LinkDown)) {
                    let taps = self.taps.as_mut().expect("tapped");
                    taps.record(p, now, &pkt, Some(DropReason::LinkDown));
                }
            } else {
                counters.load_drops += 1;
                if started {
                    self.load_in_transit -= 1;
                }
                self.loads[load as usize]
                    .counters
                    .drops
                    .add(DropReason::LinkDown);
            }
        }
    }

    /// Routes converge (over the links that are up) if they were due to by `t`.
    fn converge_by(&mut self, t: Instant) {
        let Some(at) = self.converge_at else { return };
        if at > t {
            return;
        }
        self.converge_at = None;
        self.route_epoch += 1;
        self.switch_routes.clear();
        self.converged_down = self.down_since.iter().map(Option::is_some).collect();
        let down = &self.down_since;
        if down.iter().all(Option::is_none) {
            self.live = None;
            self.degraded = false;
        } else {
            self.live = Some(Routes::over_live_links(&self.topo, |l| {
                down[l as usize].is_none()
            }));
            self.degraded = true;
        }
        for i in 0..self.loads.len() {
            if self.loads[i].active && self.loads[i].gen.spec.to >= self.hosts {
                self.loads[i].toward = self.toward(self.loads[i].gen.spec.to);
            }
        }
    }

    /// The next packet that has arrived at its GPU, in arrival order.
    #[must_use]
    pub fn poll_delivery(&mut self) -> Option<Delivery> {
        let (mut d, ttl) = self.deliveries.pop_front()?;
        packet::rewrite_ttl(d.data.head_mut(), ttl);
        Some(d)
    }

    /// Routes the packet in `slot`, standing at vertex `v` at time `now`, onto an egress
    /// port and schedules its arrival at the next vertex.
    fn forward(&mut self, now: Instant, v: VertexIdx, slot: u32) -> Result<(), DropReason> {
        let load = self.slots[slot as usize].as_ref().expect("live slot").load;
        if load != NO_LOAD {
            return self.forward_load(now, v, slot, load as usize);
        }
        let to = self.slots[slot as usize].as_ref().expect("live slot").dst.0;
        if to >= self.hosts && v == to {
            // A packet addressed to this switch: answered, whatever TTL it has left.
            let request = self.release(slot);
            self.delivered += 1;
            self.to_switches += 1;
            self.answer(now, v, &request);
            return Ok(());
        }
        if v >= self.hosts {
            let pkt = self.slots[slot as usize].as_mut().expect("live slot");
            if pkt.ttl <= 1 {
                let expired = self.release(slot);
                Flows::drop(&mut self.flows, expired.flow);
                self.vertex_drops.add(DropReason::TtlExpired);
                self.time_exceeded(now, v, &expired);
                return Err(DropReason::TtlExpired);
            }
            pkt.ttl -= 1;
        }
        if to >= self.hosts {
            return self.forward_to_switch(now, v, slot);
        }
        let pkt = self.slots[slot as usize].as_ref().expect("live slot");
        if self.degraded {
            let port_id = match self.choose_degraded(now, v, pkt.dst, pkt.flow) {
                Some(p) => p,
                None => return Err(self.no_route(slot)),
            };
            if self.down_since[self.routes.port(port_id).link as usize].is_some() {
                return Err(self.blackhole(now, port_id, slot));
            }
            return self.enqueue(now, port_id, slot);
        }
        let group = self.routes.next_hops(v, pkt.dst);
        let port_id = match group.len() {
            0 => return Err(self.no_route(slot)),
            1 => group[0],
            n => {
                let vs = &mut self.vertices[v as usize];
                match vs.routing {
                    Routing::Ecmp => group[ecmp_index(pkt.flow, vs.hash_seed, n)],
                    Routing::Spray => group[vs.rng.below(n as u32) as usize],
                    Routing::Adaptive => {
                        let start = ecmp_index(pkt.flow, vs.hash_seed, n);
                        let mut best = group[start];
                        let mut best_q = u64::MAX;
                        for i in 0..n {
                            let p = group[(start + i) % n];
                            let port = &mut self.ports[p.0 as usize];
                            settle(port, now);
                            if port.backlog_bytes < best_q {
                                best = p;
                                best_q = port.backlog_bytes;
                            }
                        }
                        best
                    }
                }
            }
        };
        self.enqueue(now, port_id, slot)
    }

    /// A GPU's packet to a switch (its `dst` is the switch's vertex) one hop on from `v`: on a
    /// shortest path over the links up when routes last converged (as a load toward a
    /// switch goes), hashed by flow among equal ones, around the dead links `v` has
    /// detected; into a dead link it has not detected yet, lost (blackholed).
    fn forward_to_switch(
        &mut self,
        now: Instant,
        v: VertexIdx,
        slot: u32,
    ) -> Result<(), DropReason> {
        let (to, flow) = {
            let pkt = self.slots[slot as usize].as_ref().expect("live slot");
            (pkt.dst.0, pkt.flow)
        };
        let i = match self.switch_routes.iter().position(|(t, _)| *t == to) {
            Some(i) => i,
            None => {
                let vertices = self.vertices.len().max(1);
                if self.switch_routes.len() >= (SWITCH_ROUTE_GROUPS / vertices).max(8) {
                    self.switch_routes.remove(0);
                }
                // Over the links up when routes last converged, as the GPUs' routes are
                // (`live`): a link down since is used until its switch detects it.
                let down = &self.converged_down;
                let toward =
                    self.toward_over(to, |l| !down.get(l as usize).copied().unwrap_or(false));
                self.switch_routes.push((to, toward));
                self.switch_routes.len() - 1
            }
        };
        let detection = self.detection;
        let (down_since, routes) = (&self.down_since, &self.routes);
        let usable = |p: &&PortId| {
            down_since[routes.port(**p).link as usize].is_none_or(|t| now < t + detection)
        };
        let group = &self.switch_routes[i].1[v as usize];
        let n = group.iter().filter(usable).count();
        let pick = (n > 0).then(|| {
            let k = ecmp_index(flow, self.vertices[v as usize].hash_seed, n);
            *group.iter().filter(usable).nth(k).expect("k < n")
        });
        let Some(p) = pick else {
            return Err(self.no_route(slot));
        };
        if self.down_since[self.routes.port(p).link as usize].is_some() {
            return Err(self.blackhole(now, p, slot));
        }
        self.enqueue(now, p, slot)
    }

    /// The GPU packet in `slot` has no way on from where it is: dropped, counted.
    fn no_route(&mut self, slot: u32) -> DropReason {
        let flow = self.release(slot).flow;
        Flows::drop(&mut self.flows, flow);
        self.vertex_drops.add(DropReason::NoRoute);
        DropReason::NoRoute
    }

    /// The GPU packet in `slot` was sent into port `p`'s dead link before its switch
    /// noticed: lost there (blackholed), counted on the port, and tapped.
    fn blackhole(&mut self, now: Instant, p: PortId, slot: u32) -> DropReason {
        self.ports[p.0 as usize]
            .counters
            .drops
            .add(DropReason::LinkDown);
        if Taps::wants(&self.taps, p, Some(DropReason::LinkDown)) {
            let pkt = self.slots[slot as usize].as_ref().expect("live slot");
            let taps = self.taps.as_mut().expect("tapped");
            taps.record(p, now, pkt, Some(DropReason::LinkDown));
        }
        let flow = self.release(slot).flow;
        Flows::drop(&mut self.flows, flow);
        DropReason::LinkDown
    }

    /// Switch `v` answers `request`, a GPU's packet addressed to it, as a host that runs no
    /// services does (`packet::to_switch`: a ping with an echo reply, TCP with a reset, UDP
    /// and other protocols with ICMP unreachable), from its address, sent back through the
    /// fabric like any packet (at once: a switch's control plane takes its time, which the
    /// model leaves out). None from a switch without an address, toward an address that is
    /// no GPU's, or beyond the packet memory.
    fn answer(&mut self, now: Instant, v: VertexIdx, request: &InFlight) {
        let Some(from) = self.topo.switch_addr(SwitchId(v - self.hosts)) else {
            return;
        };
        let bytes = request.data.to_vec();
        let answer = match packet::to_switch(&bytes) {
            packet::ToSwitch::Echo => packet::echo_reply(from, &bytes),
            packet::ToSwitch::Reset => packet::tcp_reset(from, &bytes),
            packet::ToSwitch::Unreachable(code) => packet::unreachable(from, code, &bytes),
            packet::ToSwitch::Nothing => return,
        };
        self.inject_from_switch(now, v, request.src, Frame::from(answer));
    }

    /// Switch `v` answers the GPU packet `expired`, whose TTL ran out there, with an ICMP
    /// time exceeded (as a router does; `traceroute` and `ping -t` see the hop), sent
    /// from `v`'s address back to the packet's sender through the fabric like any packet.
    /// None for an ICMP error or a later fragment (`packet::time_exceeded`), from a switch
    /// without an address, or beyond the packet memory. It counts among the packets in.
    fn time_exceeded(&mut self, now: Instant, v: VertexIdx, expired: &InFlight) {
        let Some(from) = self.topo.switch_addr(SwitchId(v - self.hosts)) else {
            return;
        };
        // The packet as it arrived here (its bytes carry the TTL it was sent with).
        let mut quoted = expired.data.prefix(60 + 8);
        packet::rewrite_ttl(&mut quoted, expired.ttl);
        let Some(bytes) = packet::time_exceeded(from, &quoted) else {
            return;
        };
        self.inject_from_switch(now, v, expired.src, Frame::from(bytes));
    }

    /// A packet switch `v` makes (an ICMP answer to GPU `src`'s packet) enters the fabric
    /// there, routed to its destination address like any packet. It counts among the
    /// packets in.
    fn inject_from_switch(&mut self, now: Instant, v: VertexIdx, src: HostId, data: Frame) {
        let key = packet::inspect(data.head())
            .expect("a packet built right")
            .key;
        // Routed as any packet, to its destination address: the packet's source, which a
        // GPU may have set to another's (or to none of the fabric's).
        let dst = u32::from(key.dst).wrapping_sub(self.addr_base);
        if dst >= self.hosts {
            return;
        }
        let charge = charge(&data);
        if self.memory_used + charge > self.memory_limit {
            return;
        }
        self.memory_used += charge;
        let len = data.len() as u32;
        let pkt = InFlight {
            // `forward` takes one off at this switch too: it leaves with 64.
            ttl: 65,
            data,
            src,
            dst: HostId(dst),
            id: self.next_packet,
            len,
            wire_bits: (len as u64 + self.l2_overhead as u64) * 8,
            ecn: 0,
            flow: flow_key_mix(&key),
            load: NO_LOAD,
            ingress: NO_PORT,
        };
        self.next_packet += 1;
        self.sent += 1;
        let slot = self.hold(pkt);
        let _ = self.forward(now, v, slot);
    }

    /// With links down or routes changed: the ports `v` may use toward `dst` (the
    /// converged routes, less the adjacent dead links `v` has detected), choosing as the
    /// vertex's routing does. A flow keeps the port of the original ECMP group while it is
    /// usable (resilient hashing); flows on a dead port are rehashed over the survivors.
    fn choose_degraded(
        &mut self,
        now: Instant,
        v: VertexIdx,
        dst: HostId,
        flow: u64,
    ) -> Option<PortId> {
        let detection = self.detection;
        let down_since = &self.down_since;
        let routes = &self.routes;
        let known_dead = |p: PortId| {
            down_since[routes.port(p).link as usize].is_some_and(|t| now >= t + detection)
        };
        let live = self.live.as_ref().unwrap_or(&self.routes).next_hops(v, dst);
        let usable = |p: PortId| !known_dead(p);
        let original = self.routes.next_hops(v, dst);
        let vs = &mut self.vertices[v as usize];
        match vs.routing {
            Routing::Ecmp | Routing::Adaptive => {
                resilient_pick(original, live, usable, flow, vs.hash_seed)
            }
            Routing::Spray => {
                let n = live.iter().filter(|&&p| usable(p)).count();
                let i = (n > 0).then(|| vs.rng.below(n as u32) as usize)?;
                live.iter().copied().filter(|&p| usable(p)).nth(i)
            }
        }
    }

    /// Admits the packet in `slot` to egress port `port_id` at `now`: tail drop (or, in a
    /// lossless fabric, ingress accounting and pauses), ECN, serialization, and its
    /// arrival at the next vertex.
    fn enqueue(&mut self, now: Instant, port_id: PortId, slot: u32) -> Result<(), DropReason> {
        let lossless = self.flow_control.pause().copied();
        let pkt = self.slots[slot as usize].as_ref().expect("live slot");
        let (len, load, ingress, flow) = (pkt.len, pkt.load, pkt.ingress, pkt.flow);
        let port = &mut self.ports[port_id.0 as usize];
        settle(port, now);
        if load == NO_LOAD {
            port.counters.rx_packets += 1;
            port.counters.rx_bytes += len as u64;
        }
        let full = match lossless {
            // A lossless switch holds what its ingress admitted: only more than the
            // headroom allows (too little configured for the link) is dropped.
            Some(pause) if ingress != NO_PORT => {
                let q = &self.ports[ingress as usize];
                q.ingress_bytes + len as u64 > pause.xoff.get() + q.headroom
            }
            // A GPU's NIC queue (or a lossy queue) tail-drops at its buffer.
            _ => port.backlog_bytes + len as u64 > port.queue.buffer.get(),
        };
        if full {
            return Err(self.drop_full(now, port_id, slot));
        }
        self.mark(port_id, slot);
        let port = &mut self.ports[port_id.0 as usize];
        port.backlog_bytes += len as u64;
        port.counters.max_queue_bytes = port.counters.max_queue_bytes.max(port.backlog_bytes);
        if let Some(fq) = &mut port.fq {
            // A GPU's NIC: straight to the wire if nothing waits and it has room ahead of
            // the wire, else into its flow's queue (a load is a flow of its own).
            let ahead = port.backlog_bytes - len as u64;
            if fq.is_empty()
                && (ahead == 0 || ahead < port.nic_ring)
                && port.paused.is_none()
                && !port.depart_pending
            {
                self.transmit(now, port_id, slot);
            } else {
                let key = if load == NO_LOAD {
                    flow
                } else {
                    mix(LOAD_FLOW ^ load as u64)
                };
                fq.push(key, slot, len);
                self.nic_start(now, port_id);
            }
            return Ok(());
        }
        let Some(pause) = lossless else {
            self.transmit(now, port_id, slot);
            return Ok(());
        };
        port.waiting.push_back(slot);
        if ingress != NO_PORT {
            let q = &mut self.ports[ingress as usize];
            q.ingress_bytes += len as u64;
            q.counters.max_ingress_bytes = q.counters.max_ingress_bytes.max(q.ingress_bytes);
            if q.ingress_bytes >= pause.xoff.get() && !q.xoff_sent {
                q.xoff_sent = true;
                match self.flow_control {
                    // The pause frame reaches the upstream port a link delay later.
                    FlowControl::Pfc(_) => {
                        let at = (now + q.link.delay).max(q.control_at);
                        q.control_at = at;
                        self.events.push(Reverse(pack(at, PAUSE_EVENT | ingress)));
                    }
                    // The sender counts its credits: it stops at once.
                    _ => self.pause(now, PortId(ingress)),
                }
            }
        }
        self.try_start(now, port_id);
        Ok(())
    }

    /// Bytes a lossless switch must hold beyond `xoff` for what port `p` still sends after
    /// the switch asked it to stop: its pause (or its last credit) takes a link delay to
    /// arrive and the resume one more; the frame on the wire and the one it had started
    /// finish; the switch's own latency. Frames are up to 64 KiB (TUN offload hands the
    /// fabric super-packets).
    pub fn headroom(&self, p: PortId) -> u64 {
        self.ports[p.0 as usize].headroom
    }

    /// Counts a packet that did not fit at `port_id` and lets it go.
    fn drop_full(&mut self, now: Instant, port_id: PortId, slot: u32) -> DropReason {
        let pkt = self.slots[slot as usize].as_ref().expect("live slot");
        let (id, load) = (pkt.id, pkt.load);
        let port = &mut self.ports[port_id.0 as usize];
        if load != NO_LOAD {
            port.counters.load_drops += 1;
            self.loads[load as usize]
                .counters
                .drops
                .add(DropReason::BufferFull);
        } else {
            port.counters.drops.add(DropReason::BufferFull);
            Flows::drop(&mut self.flows, pkt.flow);
            if Taps::wants(&self.taps, port_id, Some(DropReason::BufferFull)) {
                let taps = self.taps.as_mut().expect("tapped");
                taps.record(port_id, now, pkt, Some(DropReason::BufferFull));
            }
        }
        if let Some(t) = &mut self.trace {
            t.push(TraceEntry {
                port: port_id,
                packet: id,
                start: now,
                finish: now,
                dropped: Some(DropReason::BufferFull),
            });
        }
        self.release(slot);
        DropReason::BufferFull
    }

    /// ECN: marks the ECT packet in `slot` CE if `port_id`'s queue says so (CE packets
    /// stay CE and are not counted again).
    fn mark(&mut self, port_id: PortId, slot: u32) {
        let pkt = self.slots[slot as usize].as_mut().expect("live slot");
        let port = &mut self.ports[port_id.0 as usize];
        if pkt.ecn == ECN_NOT_ECT || pkt.ecn == ECN_CE || !should_mark(port) {
            return;
        }
        pkt.ecn = ECN_CE;
        if pkt.load != NO_LOAD {
            self.loads[pkt.load as usize].counters.ecn_marked += 1;
        } else {
            packet::mark_ce(pkt.data.head_mut());
            port.counters.ecn_marked += 1;
            if let Some(e) = self.flows.as_mut().and_then(|f| f.map.get_mut(&pkt.flow)) {
                e.1.ecn_marked += 1;
            }
        }
    }

    /// Lossless: starts port `p`'s next waiting packet at `now` if it is free and not
    /// paused, or schedules the instant it frees (a GPU's NIC with `fq`: `nic_start`).
    fn try_start(&mut self, now: Instant, p: PortId) {
        let port = &mut self.ports[p.0 as usize];
        if port.fq.is_some() {
            return self.nic_start(now, p);
        }
        if port.paused.is_some() || port.depart_pending {
            return;
        }
        let Some(&slot) = port.waiting.front() else {
            return;
        };
        if port.busy_until > now {
            self.schedule_depart(p);
            return;
        }
        port.waiting.pop_front();
        let pkt = self.slots[slot as usize].as_mut().expect("live slot");
        let (len, ingress) = (pkt.len, std::mem::replace(&mut pkt.ingress, NO_PORT));
        if ingress != NO_PORT {
            self.free_ingress(now, PortId(ingress), len);
        }
        self.transmit(now, p, slot);
        if !self.ports[p.0 as usize].waiting.is_empty() {
            self.schedule_depart(p);
        }
    }

    /// A GPU's NIC with `fq`: takes packets off its flow queues, fairly, while it has
    /// room ahead of the wire (`Port::size_nic`; they start back to back), else schedules
    /// the instant the wire has sent what it took.
    fn nic_start(&mut self, now: Instant, p: PortId) {
        let port = &mut self.ports[p.0 as usize];
        if port.paused.is_some() || port.depart_pending {
            return;
        }
        settle(port, now);
        let (ring, backlog) = (port.nic_ring, port.backlog_bytes);
        let fq = port.fq.as_mut().expect("a NIC's flow queues");
        // The packets it takes (what it sends does not leave the backlog before `now`).
        let mut burst = std::mem::take(&mut self.nic_burst);
        while !fq.is_empty() {
            let ahead = backlog - fq.bytes();
            if ahead > 0 && ahead >= ring {
                break;
            }
            burst.push(fq.pop().expect("a waiting packet"));
        }
        let more = !fq.is_empty();
        // Their slots are read in a pass of their own, then they are sent: they waited in
        // the queue and are often out of the cache, and independent reads in a short loop
        // are fetched together, where `transmit` would wait for each in turn.
        let mut sent = std::mem::take(&mut self.nic_sent);
        sent.extend(burst.drain(..).map(|slot| self.to_send(slot)));
        for s in sent.drain(..) {
            self.transmit_read(now, p, s);
        }
        self.nic_burst = burst;
        self.nic_sent = sent;
        if more {
            self.schedule_depart(p);
        }
    }

    /// Port `p` looks at its waiting packets again when it frees.
    fn schedule_depart(&mut self, p: PortId) {
        let port = &mut self.ports[p.0 as usize];
        port.depart_pending = true;
        self.events
            .push(Reverse(pack(port.busy_until, DEPART_EVENT | p.0)));
    }

    /// Lossless: `len` bytes that came through port `q` left the switch's ingress; below
    /// `xon` the switch lets `q` send again (the resume, or the credits, arrive a link
    /// delay later).
    fn free_ingress(&mut self, now: Instant, q: PortId, len: u32) {
        let xon = self.flow_control.pause().map_or(0, |p| p.xon.get());
        let port = &mut self.ports[q.0 as usize];
        port.ingress_bytes -= len as u64;
        if port.xoff_sent && port.ingress_bytes <= xon {
            port.xoff_sent = false;
            let at = (now + port.link.delay).max(port.control_at);
            port.control_at = at;
            self.events.push(Reverse(pack(at, RESUME_EVENT | q.0)));
        }
    }

    /// Port `p` is stopped by its neighbour from `now` on (it finishes the packet it is
    /// sending).
    fn pause(&mut self, now: Instant, p: PortId) {
        let port = &mut self.ports[p.0 as usize];
        if port.paused.is_none() {
            port.paused = Some(now);
            port.counters.pause_events += 1;
        }
    }

    /// A lossless port's event at `t`: it frees, or a pause or resume arrives.
    fn port_event(&mut self, t: Instant, p: PortId, kind: u32) {
        match kind {
            DEPART_EVENT => {
                self.ports[p.0 as usize].depart_pending = false;
                self.try_start(t, p);
            }
            PAUSE_EVENT => {
                if self.down_since[self.routes.port(p).link as usize].is_none() {
                    self.pause(t, p);
                }
            }
            _ => {
                let port = &mut self.ports[p.0 as usize];
                if let Some(since) = port.paused.take() {
                    port.counters.paused += t.saturating_since(since);
                }
                self.try_start(t, p);
            }
        }
    }

    /// Ports paused now, with since when: a port paused for long while its neighbour's
    /// queue does not drain is a deadlock (a cyclic buffer dependency).
    pub fn paused_ports(&self) -> Vec<(PortId, Instant)> {
        self.ports
            .iter()
            .enumerate()
            .filter_map(|(i, p)| p.paused.map(|s| (PortId(i as u32), s)))
            .collect()
    }

    /// Lossless: bytes the vertex port `p` leads to holds from it now (its ingress
    /// occupancy), and whether it asked `p` to stop.
    pub fn ingress_held(&self, p: PortId) -> (u64, bool) {
        let port = &self.ports[p.0 as usize];
        (port.ingress_bytes, port.xoff_sent)
    }

    /// Lossy, or lossless (PFC, credits).
    pub fn flow_control(&self) -> &FlowControl {
        &self.flow_control
    }

    /// Serializes the packet in `slot` on `port_id` (from when the port frees) and
    /// schedules its arrival at the next vertex, or loses it on the wire.
    fn transmit(&mut self, now: Instant, port_id: PortId, slot: u32) {
        let sent = self.to_send(slot);
        self.transmit_read(now, port_id, sent);
    }

    /// What `transmit` reads of the packet in `slot`.
    #[inline]
    fn to_send(&self, slot: u32) -> ToSend {
        let pkt = self.slots[slot as usize].as_ref().expect("live slot");
        ToSend {
            slot,
            len: pkt.len,
            load: pkt.load,
            wire_bits: pkt.wire_bits,
        }
    }

    /// `transmit`, with the packet's slot already read.
    #[inline]
    fn transmit_read(&mut self, now: Instant, port_id: PortId, sent: ToSend) {
        let ToSend {
            slot,
            len,
            load,
            wire_bits,
        } = sent;
        let synthetic = load != NO_LOAD;
        let port = &mut self.ports[port_id.0 as usize];
        // Back to back: the serialization remainder carries over, so long runs are exact.
        let start = port.busy_until.max(now);
        let carry = if port.busy_until >= now {
            port.carry
        } else {
            0
        };
        let (ser, carry) = port.link.rate.transmit_time(wire_bits, carry);
        let finish = start + ser;
        port.carry = carry;
        port.busy_until = finish;
        port.counters.busy += ser;
        let lost = lose(port);
        let flags = if lost { LOST } else { 0 } | if synthetic { SYNTHETIC } else { 0 };
        port.backlog.push_back((finish, len, flags));
        if let Some(t) = &mut self.trace {
            t.push(TraceEntry {
                port: port_id,
                packet: self.slots[slot as usize].as_ref().expect("live slot").id,
                start,
                finish,
                dropped: lost.then_some(DropReason::Loss),
            });
        }
        if lost {
            if synthetic {
                self.loads[load as usize]
                    .counters
                    .drops
                    .add(DropReason::Loss);
            } else if Taps::wants(&self.taps, port_id, Some(DropReason::Loss)) {
                let pkt = self.slots[slot as usize].as_ref().expect("live slot");
                let taps = self.taps.as_mut().expect("tapped");
                taps.record(port_id, finish, pkt, Some(DropReason::Loss));
            }
            let flow = self.release(slot).flow;
            if !synthetic {
                Flows::drop(&mut self.flows, flow);
            }
        } else {
            if synthetic {
                self.load_in_transit += 1;
            }
            // No overtaking on a link, even if its delay was lowered meanwhile.
            let mut arrive = finish + port.link.delay + port.next_latency;
            if let Some(&(last, _)) = port.transit.back() {
                arrive = arrive.max(last);
            } else {
                self.events.push(Reverse(pack(arrive, port_id.0)));
            }
            port.transit.push_back((arrive, slot));
            self.in_transit += 1;
        }
    }

    fn release(&mut self, slot: u32) -> InFlight {
        self.free.push(slot);
        let pkt = self.slots[slot as usize].take().expect("live slot");
        self.memory_used -= charge(&pkt.data);
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

    /// Link parameters of a port (rate, delay, loss).
    pub fn link_of(&self, p: PortId) -> LinkParams {
        self.ports[p.0 as usize].link
    }

    /// What the topology gives port `p`: its link's parameters and its egress buffer (what
    /// `Change::ResetLink` returns it to).
    pub fn original_of(&self, p: PortId) -> (LinkParams, Bytes) {
        (
            self.topo.links[(p.0 / 2) as usize].params,
            self.original_buffer(p.0),
        )
    }

    /// A link's new rate or delay applied to what port `p` holds at `now` (settled), where
    /// it was `was`: the frame on the wire sends the rest of its bits at the new rate, the
    /// frames queued behind it follow back to back, and each goes on the link with the
    /// delay it has now; only what finished leaving the port keeps its arrival. (The
    /// schedule was fixed as frames were admitted: without this, a queue built at a
    /// degraded rate kept draining at it after the link was reset — a frame sent at 1
    /// bit/s held its port for minutes.)
    fn retime(&mut self, now: Instant, p: PortId, was: LinkParams) {
        let port = &mut self.ports[p.0 as usize];
        let (old, new) = (was.rate.bps() as u128, port.link.rate.bps().max(1) as u128);
        if (old == new && was.delay == port.link.delay) || port.backlog.is_empty() {
            return;
        }
        // The backlog finishes after `now`: its first frame started by then (a frame
        // starts at its admission or when the one before it finishes, and every one
        // before it had finished), the others follow back to back.
        let (mut before, mut after) = (now, now);
        let mut finishes = std::mem::take(&mut self.retimed);
        for e in port.backlog.iter_mut() {
            let ns = e.0.saturating_since(before).as_nanos() as u128 * old / new;
            before = e.0;
            after = after + Duration::from_nanos(ns.min(u64::MAX as u128) as u64);
            e.0 = after;
            if e.2 & LOST == 0 {
                finishes.push(after);
            }
        }
        let ahead = before.saturating_since(now).as_nanos();
        let busy = port.counters.busy.as_nanos().saturating_sub(ahead);
        port.counters.busy = Duration::from_nanos(busy) + after.saturating_since(now);
        port.busy_until = after;
        port.carry = 0;
        // The frames not lost are the last of those in transit, in the same order.
        let head = port.transit.front().map(|t| t.0);
        let first = port.transit.len() - finishes.len();
        let mut last = first.checked_sub(1).map(|i| port.transit[i].0);
        let prop = port.link.delay + port.next_latency;
        for (t, &f) in port.transit.range_mut(first..).zip(&finishes) {
            let at = last.map_or(f + prop, |l| (f + prop).max(l));
            t.0 = at;
            last = Some(at);
        }
        finishes.clear();
        self.retimed = finishes;
        let (head_now, depart) = (port.transit.front().map(|t| t.0), port.depart_pending);
        if head_now != head {
            self.unschedule(p.0);
            if let Some(at) = head_now {
                self.events.push(Reverse(pack(at, p.0)));
            }
        }
        if depart {
            self.unschedule(DEPART_EVENT | p.0);
            self.events.push(Reverse(pack(after, DEPART_EVENT | p.0)));
        }
    }

    /// Takes the events keyed `key` (a port's next arrival or its departure) off the
    /// schedule: rare (a link changed or went down), so a pass over the heap.
    fn unschedule(&mut self, key: u32) {
        self.events.retain(|&Reverse(e)| e as u32 != key);
    }

    /// What port `p` derives from its link (PFC headroom, a NIC's flow scheduling), after
    /// the link changed.
    fn link_changed(&mut self, p: PortId) {
        let lossless = self.flow_control != FlowControl::Lossy;
        let port = &mut self.ports[p.0 as usize];
        port.headroom = headroom_bytes(&port.link, port.next_latency, self.l2_overhead);
        port.size_nic(self.mtu, lossless);
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

/// Headroom of a switch ingress fed by `link` (see `Fabric::headroom`): what the link
/// carries in two delays and the switch's `latency`, and three of the largest frames.
pub fn headroom_bytes(link: &LinkParams, latency: Duration, l2_overhead: u32) -> u64 {
    let window = link.delay + link.delay + latency;
    let on_wire = link.rate.bps() as u128 * window.as_nanos() as u128 / 8_000_000_000;
    on_wire as u64 + 3 * (MAX_PACKET + l2_overhead as u64)
}

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

/// A TSO burst at `rate`: what TCP's TSO autosizing hands a real NIC at once, about 1 ms
/// of line rate, at most a 64 KiB super-packet, and at least two frames (which wins with
/// frames above 32 KiB).
fn tso_burst(rate: Bandwidth, mtu: u32) -> u64 {
    (rate.bps() / 8 / 1000).min(64 << 10).max(2 * mtu as u64)
}

impl Port {
    /// Sizes a GPU NIC's flow scheduling to its link rate: a flow sends a TSO burst per
    /// round (`tso_burst`), as a host's fq_codel dequeues a whole super-packet at once; in
    /// a lossy fabric the NIC takes a burst ahead of the wire (its ring: a packet of
    /// another flow waits for that much, as behind a TSO burst), in a lossless one a frame
    /// at a time, so that a pause stops it after the frame it is sending.
    fn size_nic(&mut self, mtu: u32, lossless: bool) {
        let burst = tso_burst(self.link.rate, mtu);
        self.nic_ring = if lossless { 0 } else { burst };
        if let Some(fq) = &mut self.fq {
            fq.set_quantum(burst);
        }
    }
}

/// Retires packets that finished by `now`.
#[inline]
fn settle(port: &mut Port, now: Instant) {
    while let Some(&(finish, len, flags)) = port.backlog.front() {
        if finish > now {
            break;
        }
        port.backlog.pop_front();
        port.backlog_bytes -= len as u64;
        match (flags & LOST != 0, flags & SYNTHETIC != 0) {
            (true, _) => count_lost(&mut port.counters, flags),
            (false, false) => {
                port.counters.tx_packets += 1;
                port.counters.tx_bytes += len as u64;
            }
            (false, true) => {
                port.counters.load_tx_packets += 1;
                port.counters.load_tx_bytes += len as u64;
            }
        }
    }
}

/// Whether the frame a port starts now is lost on the wire. Independent draws, or with
/// `loss_burst` L above 1 a Gilbert model: a port in a burst loses every frame and leaves
/// it with probability r = 1/L per frame (bursts of L frames on average); out of one it
/// enters one with probability p = loss·r/(1−loss), so a share loss of frames is lost.
/// Where that p would exceed 1 (loss above L/(L+1): a spell without loss lasts a frame at
/// least), p is 1 and the bursts are longer, loss/(1−loss) frames, at the same rate.
#[inline]
fn lose(port: &mut Port) -> bool {
    let (loss, burst) = (port.link.loss, port.link.loss_burst);
    if loss <= 0.0 {
        return false;
    }
    if burst <= 1.0 || loss >= 1.0 {
        return port.rng.next_f64() < loss;
    }
    let odds = loss / (1.0 - loss);
    let (enter, leave) = if odds / burst <= 1.0 {
        (odds / burst, 1.0 / burst)
    } else {
        (1.0, 1.0 / odds)
    };
    let flip = if port.loss_bad { leave } else { enter };
    if port.rng.next_f64() < flip {
        port.loss_bad = !port.loss_bad;
    }
    port.loss_bad
}

/// A packet lost on the wire (`LOST`), counted on its port: a GPU's as a loss drop, a
/// load's among the load's drops.
fn count_lost(c: &mut PortCounters, flags: u8) {
    if flags & SYNTHETIC != 0 {
        c.load_drops += 1;
    } else {
        c.drops.add(DropReason::Loss);
    }
}

#[inline]
fn should_mark(port: &mut Port) -> bool {
    let q = port.backlog_bytes;
    match port.queue.ecn {
        None => false,
        Some(Ecn::Step { k }) => q > k.get(),
        Some(Ecn::Red { min, max, p_max }) => {
            if q < min.get() {
                false
            } else if q >= max.get() {
                true
            } else {
                let p = p_max * (q - min.get()) as f64 / (max.get() - min.get()) as f64;
                port.rng.next_f64() < p
            }
        }
    }
}

/// Resilient ECMP: a flow keeps its port of the `original` group while that port is among
/// the `live` ports that are `usable`; otherwise it is rehashed over those. `None` when
/// none is. Allocates nothing (it runs per packet on a degraded fabric).
fn resilient_pick(
    original: &[PortId],
    live: &[PortId],
    usable: impl Fn(PortId) -> bool,
    flow: u64,
    seed: u64,
) -> Option<PortId> {
    if !original.is_empty() {
        let p = original[ecmp_index(flow, seed, original.len())];
        if usable(p) && live.contains(&p) {
            return Some(p);
        }
    }
    let n = live.iter().filter(|&&p| usable(p)).count();
    if n == 0 {
        return None;
    }
    live.iter()
        .copied()
        .filter(|&p| usable(p))
        .nth(ecmp_index(flow, mix(seed), n))
}

/// Which of `n` equal-cost next hops a flow takes at a switch with `seed`.
#[inline]
fn ecmp_index(flow: u64, seed: u64, n: usize) -> usize {
    (mix(flow ^ seed) % n as u64) as usize
}

/// The seed-independent part of a flow's ECMP hash (each switch mixes in its own seed,
/// so paths do not polarize), computed once per packet.
#[inline]
fn flow_key_mix(k: &FlowKey) -> u64 {
    let a = (u32::from(k.src) as u64) << 32 | u32::from(k.dst) as u64;
    let b = (k.proto as u64) << 32 | (k.sport as u64) << 16 | k.dport as u64;
    mix(mix(a) ^ b)
}
