//! The validated fabric graph: GPUs (hosts), switches and links with dense ids.
//!
//! A `Topology` is what a topology file means once parsed and checked (see `config`), or
//! what a generator builds. It holds no runtime state: the model (`model`) and the planner
//! (`plan`) read it. Every link is full duplex: it gives one egress port to each end.

use std::fmt;
use std::net::Ipv4Addr;

use crate::units::{Bandwidth, Bytes, Duration};

/// Index of a GPU in `Topology::hosts`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HostId(pub u32);

/// Index of a switch in `Topology::switches`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SwitchId(pub u32);

/// One end of a link.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Vertex {
    Host(HostId),
    Switch(SwitchId),
}

/// Switch tiers, bottom up. A `Node` switch is a scale-up (NVSwitch-like) domain that only
/// carries traffic between the GPUs of its node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tier {
    Node,
    Leaf,
    Spine,
    Core,
}

impl Tier {
    pub const ALL: [Tier; 4] = [Tier::Node, Tier::Leaf, Tier::Spine, Tier::Core];

    pub fn name(self) -> &'static str {
        match self {
            Tier::Node => "node",
            Tier::Leaf => "leaf",
            Tier::Spine => "spine",
            Tier::Core => "core",
        }
    }

    pub fn from_name(s: &str) -> Option<Tier> {
        Tier::ALL.into_iter().find(|t| t.name() == s)
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Link classes, each configured once in a topology file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LinkClass {
    /// GPU to its node's scale-up switch.
    Nvlink,
    /// GPU NIC to its first scale-out switch (or to another GPU in a full mesh).
    Nic,
    LeafSpine,
    SpineCore,
}

impl LinkClass {
    pub const ALL: [LinkClass; 4] = [
        LinkClass::Nvlink,
        LinkClass::Nic,
        LinkClass::LeafSpine,
        LinkClass::SpineCore,
    ];

    pub fn name(self) -> &'static str {
        match self {
            LinkClass::Nvlink => "nvlink",
            LinkClass::Nic => "nic",
            LinkClass::LeafSpine => "leaf-spine",
            LinkClass::SpineCore => "spine-core",
        }
    }

    pub fn from_name(s: &str) -> Option<LinkClass> {
        LinkClass::ALL.into_iter().find(|c| c.name() == s)
    }
}

impl fmt::Display for LinkClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How a switch picks among equal-cost next hops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Routing {
    /// Per flow: a seeded hash of the 5-tuple; a flow keeps one path.
    Ecmp,
    /// Per packet: seeded random choice.
    Spray,
    /// Per packet: the equal-cost port with the fewest queued bytes (ties by flow hash).
    Adaptive,
}

impl Routing {
    pub fn name(self) -> &'static str {
        match self {
            Routing::Ecmp => "ecmp",
            Routing::Spray => "spray",
            Routing::Adaptive => "adaptive",
        }
    }
}

/// ECN CE marking of ECT packets, decided on enqueue from the instantaneous queue.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Ecn {
    /// DCTCP-style step: mark when the queue (before this packet) holds more than `k`.
    Step { k: Bytes },
    /// RED-like: no mark below `min`, probability rising linearly to `p_max` at `max`,
    /// always above `max`.
    Red { min: Bytes, max: Bytes, p_max: f64 },
}

/// Egress queue settings of a port.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct QueueParams {
    /// Tail-drop limit on queued bytes (IP bytes, including the packet in service).
    pub buffer: Bytes,
    pub ecn: Option<Ecn>,
}

/// How a GPU's NIC serves its flows (`[nic] scheduler`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum NicScheduler {
    /// One FIFO: every packet waits behind the host's whole backlog. The default: the
    /// shipped configs and the predictions are calibrated with it (see docs/design.md).
    #[default]
    Fifo,
    /// A queue per flow, served in turn by TSO bursts, new (sparse) flows first: a host's
    /// `fq_codel` (see `fq`). An ACK or a small message waits behind the burst the NIC
    /// took, not behind the host's whole backlog.
    Fq,
}

impl NicScheduler {
    pub fn name(self) -> &'static str {
        match self {
            NicScheduler::Fq => "fq",
            NicScheduler::Fifo => "fifo",
        }
    }
}

/// Settings shared by the switches of one tier.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SwitchParams {
    /// Forwarding latency added between a packet's full arrival and its enqueue.
    pub latency: Duration,
    pub queue: QueueParams,
    pub routing: Routing,
    /// Port count limit; `None` means unlimited.
    pub radix: Option<u32>,
    /// ICMP answers a second of fabric time (echo replies, time exceeded, unreachables,
    /// TCP resets) its control plane sends at most, in bursts of `ICMP_BURST`: a switch
    /// polices what its CPU answers (CoPP; a Linux host's `icmp_msgs_per_sec`). 0: no
    /// limit.
    pub icmp_rate: u32,
}

/// Answers a switch sends back to back before `SwitchParams::icmp_rate` holds it (Linux's
/// `icmp_msgs_burst`).
pub const ICMP_BURST: u32 = 50;

/// Settings of one link (both directions alike).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkParams {
    pub rate: Bandwidth,
    /// One-way propagation delay.
    pub delay: Duration,
    /// Probability that a packet is lost on the wire, in [0, 1] (topology files: [0, 1)).
    pub loss: f64,
    /// Mean length, in frames, of a run of lost frames (≥ 1). 1: each frame is lost on its
    /// own draw; above 1, losses come in bursts (a Gilbert model, `LossBurst`) at the same
    /// mean rate `loss`.
    pub loss_burst: f64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Host {
    pub name: String,
    pub addr: Ipv4Addr,
    /// Index of the node (scale-up domain) this GPU belongs to.
    pub node: u32,
    /// Index of this GPU within its node.
    pub local_rank: u32,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Switch {
    pub name: String,
    pub tier: Tier,
    pub params: SwitchParams,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Link {
    pub a: Vertex,
    pub b: Vertex,
    pub class: LinkClass,
    pub params: LinkParams,
}

/// Which generator made a topology, with its shape, for reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Shape {
    SingleSwitch,
    FullMesh,
    LeafSpine {
        leaves: u32,
        spines: u32,
        uplinks: u32,
    },
    FatTree {
        k: u32,
    },
    RailOptimized {
        rails: u32,
        spines: u32,
        uplinks: u32,
    },
    SuperpodSu,
    Custom,
}

impl Shape {
    pub fn kind(&self) -> &'static str {
        match self {
            Shape::SingleSwitch => "single-switch",
            Shape::FullMesh => "full-mesh",
            Shape::LeafSpine { .. } => "leaf-spine",
            Shape::FatTree { .. } => "fat-tree",
            Shape::RailOptimized { .. } => "rail-optimized",
            Shape::SuperpodSu => "superpod-su",
            Shape::Custom => "custom",
        }
    }
}

/// Link-level flow control: whether a congested switch holds its upstream neighbour back
/// (lossless) or drops at its buffer (lossy).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum FlowControl {
    /// Every egress queue tail-drops at its buffer (Ethernet without PFC).
    Lossy,
    /// Ethernet Priority Flow Control: a switch counts the bytes it holds per ingress
    /// port; at `xoff` it sends a pause that stops the upstream port one link delay
    /// later, at `xon` a resume (after the link delay too). Each ingress has headroom for
    /// what arrives meanwhile, so nothing is dropped for buffer reasons.
    Pfc(PauseParams),
    /// InfiniBand credit-based flow control: the sender knows the receiver's free buffer
    /// (its credits) and stops at once when the ingress holds `xoff`; credits come back
    /// one link delay after the receiver frees them (resume at `xon`).
    Credit(PauseParams),
}

/// Thresholds of a lossless fabric, per ingress port of a switch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PauseParams {
    /// Held bytes at which the upstream port is stopped.
    pub xoff: Bytes,
    /// Held bytes at or below which it may send again.
    pub xon: Bytes,
    /// A port paused longer than this is reported as a suspected deadlock.
    pub deadlock_after: Duration,
}

impl FlowControl {
    pub fn name(&self) -> &'static str {
        match self {
            FlowControl::Lossy => "none",
            FlowControl::Pfc(_) => "pfc",
            FlowControl::Credit(_) => "credit",
        }
    }

    pub fn pause(&self) -> Option<&PauseParams> {
        match self {
            FlowControl::Lossy => None,
            FlowControl::Pfc(p) | FlowControl::Credit(p) => Some(p),
        }
    }
}

/// Fabric-wide settings.
#[derive(Clone, Debug, PartialEq)]
pub struct FabricParams {
    /// Prefixes every system object (`cb-<name>.<gpu>`, `/run/closbox/fabrics/<name>`).
    pub name: String,
    /// Seeds every random choice (loss, spray, ECMP hash, RED).
    pub seed: u64,
    /// 1 = real time; k > 1 = the fabric runs k times slower than wall time.
    pub time_scale: crate::units::TimeScale,
    /// `time_scale = "auto"`: `up` measures the box and sets `time_scale` (until then
    /// it reads 1).
    pub time_scale_auto: bool,
    pub pool: Ipv4Net,
    /// Largest IP packet a GPU sends, in bytes; larger packets are split into frames.
    pub mtu: u32,
    /// Per-frame bytes on the wire beyond the IP packet (Ethernet: 14 + 4 FCS + 8 preamble
    /// + 12 inter-frame gap = 38).
    pub l2_overhead: u32,
    /// The GPU NIC's egress queue.
    pub nic_queue: QueueParams,
    /// How the GPU NIC's egress queue picks the next packet.
    pub nic_scheduler: NicScheduler,
    /// TCP settings of the GPUs' own network stacks.
    pub host_tcp: HostTcp,
    /// The most memory the fabric's held packets may take (buffers plus per-packet
    /// overhead); beyond it new packets are dropped as `memory_limit`. Bounds the daemon
    /// whatever the GPUs send.
    pub packet_memory: Bytes,
    /// How long the switch at either end of a failed link keeps sending into it
    /// (blackholing) before it stops using it.
    pub detection: Duration,
    /// How long the rest of the fabric keeps routing over a failed (or restored) link
    /// before its routes converge.
    pub convergence: Duration,
    /// Lossy, or lossless by PFC or credits.
    pub flow_control: FlowControl,
    /// The `preset` the file named, if any.
    pub preset: Option<&'static str>,
}

/// Kernel TCP settings applied inside every GPU namespace (they are per namespace).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostTcp {
    /// `net.ipv4.tcp_congestion_control`: "cubic", "bbr", "reno", … (what the kernel
    /// allows as a namespace default); Reno unless the file says otherwise (see
    /// `config::DEFAULT_CONGESTION`); `None` keeps the host's default (`"host"`).
    pub congestion: Option<String>,
    /// `net.ipv4.tcp_ecn = 1`: connections request ECN, so marks slow senders down.
    pub ecn: bool,
    /// `net.ipv4.tcp_slow_start_after_idle`: Linux restarts slow start on a connection
    /// idle for an RTO, which throttles every step of a collective that reuses idle
    /// connections (all-to-all); off by default here.
    pub slow_start_after_idle: bool,
}

/// An IPv4 prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ipv4Net {
    pub addr: Ipv4Addr,
    pub prefix: u8,
}

impl Ipv4Net {
    /// Number of usable host addresses (network and broadcast excluded).
    pub fn host_capacity(self) -> u64 {
        (1u64 << (32 - self.prefix as u32)).saturating_sub(2)
    }

    /// The `i`-th usable address (0-based).
    pub fn host(self, i: u32) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.addr) + 1 + i)
    }

    pub fn contains(self, a: Ipv4Addr) -> bool {
        let mask = if self.prefix == 0 {
            0
        } else {
            u32::MAX << (32 - self.prefix as u32)
        };
        u32::from(a) & mask == u32::from(self.addr) & mask
    }
}

impl std::str::FromStr for Ipv4Net {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (a, p) = s
            .split_once('/')
            .ok_or_else(|| format!("{s:?} is not a CIDR prefix such as \"198.18.0.0/15\""))?;
        let addr: Ipv4Addr = a
            .parse()
            .map_err(|_| format!("{a:?} is not an IPv4 address"))?;
        let prefix: u8 = p
            .parse()
            .ok()
            .filter(|p| *p <= 30)
            .ok_or_else(|| format!("prefix length {p:?} must be 0..=30"))?;
        let mask = if prefix == 0 {
            0
        } else {
            u32::MAX << (32 - prefix)
        };
        if u32::from(addr) & !mask != 0 {
            return Err(format!(
                "{s:?} has host bits set; the network is {}/{prefix}",
                Ipv4Addr::from(u32::from(addr) & mask)
            ));
        }
        Ok(Ipv4Net { addr, prefix })
    }
}

impl fmt::Display for Ipv4Net {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// A validated fabric: every name unique, every link between existing vertices, every GPU
/// able to reach every other, no switch over its radix.
#[derive(Clone, Debug, PartialEq)]
pub struct Topology {
    pub fabric: FabricParams,
    pub shape: Shape,
    pub hosts: Vec<Host>,
    pub switches: Vec<Switch>,
    pub links: Vec<Link>,
}

impl Topology {
    pub fn host(&self, id: HostId) -> &Host {
        &self.hosts[id.0 as usize]
    }

    pub fn switch(&self, id: SwitchId) -> &Switch {
        &self.switches[id.0 as usize]
    }

    /// The address switch `id` answers from (its ICMP errors): the pool's addresses after
    /// the GPUs', in switch order; `None` for a switch the pool has no room left for.
    pub fn switch_addr(&self, id: SwitchId) -> Option<Ipv4Addr> {
        let i = self.hosts.len() as u64 + id.0 as u64;
        (i < self.fabric.pool.host_capacity()).then(|| self.fabric.pool.host(i as u32))
    }

    pub fn host_by_name(&self, name: &str) -> Option<HostId> {
        self.hosts
            .iter()
            .position(|h| h.name == name)
            .map(|i| HostId(i as u32))
    }

    /// Number of nodes (scale-up domains).
    pub fn nodes(&self) -> u32 {
        self.hosts.iter().map(|h| h.node + 1).max().unwrap_or(0)
    }

    /// Largest number of GPUs in one node.
    pub fn gpus_per_node(&self) -> u32 {
        self.hosts
            .iter()
            .map(|h| h.local_rank + 1)
            .max()
            .unwrap_or(0)
    }

    /// Number of link ends at each vertex: (per host, per switch).
    pub fn degrees(&self) -> (Vec<u32>, Vec<u32>) {
        let mut hosts = vec![0; self.hosts.len()];
        let mut switches = vec![0; self.switches.len()];
        for l in &self.links {
            for v in [l.a, l.b] {
                match v {
                    Vertex::Host(h) => hosts[h.0 as usize] += 1,
                    Vertex::Switch(s) => switches[s.0 as usize] += 1,
                }
            }
        }
        (hosts, switches)
    }
}
