//! Capacity planning: what a fabric is made of and what it can carry.
//!
//! `Plan::of` describes a built topology (from a file or a generator); `Sizing::new` sizes
//! fabrics for a GPU count from switch radix alone, with closed forms, so that it answers
//! for 200,000 GPUs as fast as for 8. Definitions (also in the README):
//! - hops: links on the path a packet takes (GPU→leaf→GPU = 2);
//! - oversubscription of a tier: capacity of its switches' links downward divided by
//!   their links upward;
//! - bisection bandwidth (one direction): for a full mesh, the links across an even split
//!   of the GPUs; otherwise the smallest of each tier boundary's capacity halved (the
//!   GPU NICs, leaf–spine, spine–core), which is exact for the symmetric Clos the
//!   generators build and an upper bound for custom graphs;
//! - bisection ratio: bisection bandwidth over half the GPUs' NIC capacity (1 = the
//!   fabric carries any half-to-half pattern at NIC rate).

use std::collections::BTreeMap;

use serde::Serialize;

use crate::routing::PortGraph;
use crate::topology::{HostId, LinkClass, Shape, Tier, Topology, Vertex};

/// What a topology is made of.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Plan {
    pub name: String,
    pub kind: String,
    pub gpus: u64,
    pub nodes: u64,
    pub gpus_per_node: u64,
    pub mtu: u32,
    pub tiers: Vec<TierPlan>,
    pub cables: Vec<CablePlan>,
    pub bisection_bps: u64,
    /// Bisection bandwidth over the GPUs' NIC capacity halved: 1.0 is non-blocking.
    pub bisection_ratio: f64,
    pub hops_intra_node: Option<HopStats>,
    pub hops_inter_node: Option<HopStats>,
    /// True when hop counts come from a sample of sources (large fabrics).
    pub hops_sampled: bool,
    pub compare: Alternatives,
    /// What the switch daemon of this fabric may take at most.
    pub daemon_memory: DaemonMemory,
    /// Which time_scale this box needs for the fabric.
    pub time_scale: TimeScaleHint,
    /// What the network is: its preset, frames, flow control, switches.
    pub network: NetworkPlan,
}

/// The network's settings as a preset and the file left them.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct NetworkPlan {
    pub preset: Option<String>,
    pub preset_about: Option<String>,
    pub l2_overhead: u32,
    /// "none", "pfc" or "credit".
    pub flow_control: String,
    pub xoff_bytes: Option<u64>,
    pub xon_bytes: Option<u64>,
    pub deadlock_after_ns: Option<u64>,
    /// Lossless: per link class, the most headroom a switch ingress fed by such a link
    /// needs beyond xoff (what arrives after it asked the sender to stop).
    pub headroom: Vec<(String, u64)>,
    /// Per switch tier: forwarding latency (ns), routing, ECN marking.
    pub switches: Vec<SwitchPlan>,
    /// The GPUs' side: NIC queue, its ECN marking, and their kernel TCP.
    pub gpus: GpuPlan,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct GpuPlan {
    pub nic_buffer_bytes: u64,
    pub nic_ecn: Option<String>,
    /// "fq" (a queue per flow, served fairly) or "fifo".
    pub nic_scheduler: &'static str,
    /// The congestion control every GPU's TCP uses; `None`: the host's default.
    pub tcp_congestion: Option<String>,
    pub tcp_ecn: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SwitchPlan {
    pub tier: String,
    pub latency_ns: u64,
    pub routing: String,
    pub buffer_bytes: u64,
    pub ecn: Option<String>,
}

impl NetworkPlan {
    pub fn of(topo: &Topology) -> NetworkPlan {
        let f = &topo.fabric;
        let pause = f.flow_control.pause();
        let mut headroom: Vec<(String, u64)> = Vec::new();
        if pause.is_some() {
            for class in LinkClass::ALL {
                let worst = topo
                    .links
                    .iter()
                    .filter(|l| l.class == class)
                    .map(|l| {
                        // The far end's latency, for either direction into a switch.
                        let latency = |v: Vertex| match v {
                            Vertex::Switch(sw) => topo.switches[sw.0 as usize].params.latency,
                            Vertex::Host(_) => crate::units::Duration::ZERO,
                        };
                        let lat = latency(l.a).max(latency(l.b));
                        crate::model::headroom_bytes(&l.params, lat, f.l2_overhead)
                    })
                    .max();
                if let Some(h) = worst {
                    headroom.push((class.name().into(), h));
                }
            }
        }
        let switches = Tier::ALL
            .iter()
            .filter_map(|&t| topo.switches.iter().find(|s| s.tier == t))
            .map(|s| SwitchPlan {
                tier: s.tier.name().into(),
                latency_ns: s.params.latency.as_nanos(),
                routing: s.params.routing.name().into(),
                buffer_bytes: s.params.queue.buffer.get(),
                ecn: s.params.queue.ecn.map(ecn_words),
            })
            .collect();
        let gpus = GpuPlan {
            nic_buffer_bytes: f.nic_queue.buffer.get(),
            nic_ecn: f.nic_queue.ecn.map(ecn_words),
            nic_scheduler: f.nic_scheduler.name(),
            tcp_congestion: f.host_tcp.congestion.clone(),
            tcp_ecn: f.host_tcp.ecn,
        };
        let preset = f.preset.and_then(crate::config::presets::find);
        NetworkPlan {
            preset: preset.map(|p| p.name.into()),
            preset_about: preset.map(|p| p.about.into()),
            l2_overhead: f.l2_overhead,
            flow_control: f.flow_control.name().into(),
            xoff_bytes: pause.map(|p| p.xoff.get()),
            xon_bytes: pause.map(|p| p.xon.get()),
            deadlock_after_ns: pause.map(|p| p.deadlock_after.as_nanos()),
            headroom,
            switches,
            gpus,
        }
    }
}

fn ecn_words(e: crate::topology::Ecn) -> String {
    match e {
        crate::topology::Ecn::Step { k } => format!("step at {k}"),
        crate::topology::Ecn::Red { min, max, p_max } => format!("RED {min}–{max}, p {p_max}"),
    }
}

/// What `time_scale` means for this fabric on this box: the load all GPUs offer at once
/// against what the data plane moves (measured on the 2-core dev VM), and the shortest
/// GPU-to-GPU latency on the wall clock against the box's timing precision.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct TimeScaleHint {
    /// In the file (1 when it says "auto").
    pub configured: f64,
    /// The file says "auto": `up` measures the box and chooses.
    pub auto: bool,
    /// Every GPU sending at its fastest link's rate at once (bits/s of fabric time).
    pub offered_bps: u64,
    /// What the box moves at this mtu (bits/s of wall time): `BOX_BITS_PER_S`, or fewer
    /// when frames are small (`BOX_FRAMES_PER_S`).
    pub box_bps: u64,
    /// The time_scale from which the box carries `offered_bps`.
    pub for_load: f64,
    /// A lower bound of the shortest GPU-to-GPU latency (ns of fabric time).
    pub shortest_path_ns: u64,
}

/// Frames a second the data plane carries on the dev VM (2 cores) with TUN offload while
/// the GPUs' own processes share the cores: 8 unmodified torch gloo ranks at mtu 1500
/// moved ~400,000 (and fell behind); one iperf3 flow alone moves ~1,000,000 at mtu 1500.
pub const BOX_FRAMES_PER_S: u64 = 400_000;

/// Bits a second of super-packets the data plane carries on the dev VM, whatever the
/// mtu: 8 GPUs' iperf3 flows at mtu 9000 moved 14.9–15.6 Gbit/s; rounded down for the
/// GPUs' own work.
pub const BOX_BITS_PER_S: u64 = 10_000_000_000;

/// Each GPU's fastest link (its NIC, or its scale-up link), bits/s: what it can offer.
pub fn fastest_host_links(topo: &Topology) -> Vec<u64> {
    let mut fastest = vec![0u64; topo.hosts.len()];
    for l in &topo.links {
        for v in [l.a, l.b] {
            if let Vertex::Host(x) = v {
                let f = &mut fastest[x.0 as usize];
                *f = (*f).max(l.params.rate.bps());
            }
        }
    }
    fastest
}

impl TimeScaleHint {
    pub fn of(topo: &Topology) -> TimeScaleHint {
        let fastest = fastest_host_links(topo);
        let mut min_host_link = u64::MAX;
        let mut min_latency = u64::MAX;
        let mut direct = u64::MAX;
        for l in &topo.links {
            let ends = [l.a, l.b];
            for (i, e) in ends.iter().enumerate() {
                if let Vertex::Host(_) = e {
                    match ends[1 - i] {
                        Vertex::Switch(s) => {
                            min_host_link = min_host_link.min(l.params.delay.as_nanos());
                            min_latency = min_latency.min(topo.switch(s).params.latency.as_nanos());
                        }
                        Vertex::Host(_) => direct = direct.min(l.params.delay.as_nanos()),
                    }
                }
            }
        }
        let via_switch = min_host_link.saturating_mul(2).saturating_add(min_latency);
        let shortest = direct.min(via_switch);
        let shortest = if shortest == u64::MAX { 0 } else { shortest };
        let offered: u64 = fastest.iter().fold(0u64, |a, b| a.saturating_add(*b));
        let box_bps = BOX_BITS_PER_S.min(BOX_FRAMES_PER_S * topo.fabric.mtu as u64 * 8);
        TimeScaleHint {
            configured: topo.fabric.time_scale.get(),
            auto: topo.fabric.time_scale_auto,
            offered_bps: offered,
            box_bps,
            for_load: round_up_125((offered as f64 / box_bps as f64).clamp(1.0, 1e6)),
            shortest_path_ns: shortest,
        }
    }
}

/// The smallest of 1, 2, 5, 10, 20, 50, … at or above `x`.
pub fn round_up_125(x: f64) -> f64 {
    let mut p = 1.0;
    loop {
        for m in [1.0, 2.0, 5.0] {
            if m * p >= x - 1e-9 {
                return m * p;
            }
        }
        p *= 10.0;
    }
}

/// An upper bound on the daemon's memory for a fabric, in bytes, from its declared sizes:
/// `up` refuses a fabric whose bound exceeds the memory the box has available.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct DaemonMemory {
    /// Forwarding tables: (vertex, GPU) entries and their equal-cost groups.
    pub routing: u64,
    /// The topology, ports and their counters.
    pub structures: u64,
    /// Held packets (`[fabric] packet_memory`): enforced by the model, whatever the GPUs
    /// send.
    pub packets: u64,
    /// The process itself: code, thread stacks, histograms, buffers.
    pub base: u64,
    pub total: u64,
}

/// The daemon's own footprint beyond what scales with the fabric (measured idle RSS of a
/// 16-GPU fabric is ~9 MiB; the rest is headroom for the allocator and threads).
const DAEMON_BASE: u64 = 32 << 20;

impl DaemonMemory {
    pub fn of(topo: &Topology) -> DaemonMemory {
        let h = topo.hosts.len() as u64;
        let n = h + topo.switches.len() as u64;
        let l = topo.links.len() as u64;
        // Per (vertex, GPU): a group range (8 bytes) and a distance (4); groups hold at most
        // every out-port per (vertex, GPU), 4 bytes each, doubled for vector growth.
        // And toward the switches GPUs ping (`model::SWITCH_ROUTE_GROUPS`): per switch kept, a
        // group per vertex (24 bytes) and at most every port, 4 bytes each, doubled.
        let pinged = (topo.switches.len() as u64).min(((1u64 << 20) / n.max(1)).max(8));
        let routing = 12 * n * h + 16 * h * l + pinged * (24 * n + 16 * l);
        // ~100 bytes per vertex and link in the topology and port graph, ~300 per port
        // (two per link) in the model.
        let structures = 100 * (n + l) + 600 * l;
        let packets = topo.fabric.packet_memory.get();
        DaemonMemory {
            routing,
            structures,
            packets,
            base: DAEMON_BASE,
            total: routing + structures + packets + DAEMON_BASE,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TierPlan {
    pub tier: String,
    pub switches: u64,
    pub ports_min: u64,
    pub ports_max: u64,
    pub radix: Option<u32>,
    /// Down/up capacity; `None` for the top tier (no uplinks).
    pub oversubscription: Option<f64>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CablePlan {
    pub class: String,
    pub count: u64,
    pub rate_bps: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct HopStats {
    pub min: u32,
    pub avg: f64,
    pub max: u32,
    pub pairs: u64,
}

/// What a full mesh and a single switch would need for the same GPU count.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Alternatives {
    pub full_mesh_ports_per_gpu: u64,
    pub full_mesh_cables: u64,
    pub single_switch_ports: u64,
}

impl Alternatives {
    pub fn for_gpus(n: u64) -> Self {
        Alternatives {
            full_mesh_ports_per_gpu: n.saturating_sub(1),
            full_mesh_cables: n * n.saturating_sub(1) / 2,
            single_switch_ports: n,
        }
    }
}

/// Hop statistics from every source up to this many GPUs, from a spread sample above.
const EXACT_HOPS_LIMIT: usize = 2048;
const HOP_SAMPLE: usize = 256;

impl Plan {
    pub fn of(topo: &Topology) -> Plan {
        let h = topo.hosts.len();
        let (_, degree) = topo.degrees();
        let tier_of = |v: Vertex| match v {
            Vertex::Host(_) => None,
            Vertex::Switch(s) => Some(topo.switch(s).tier),
        };
        // Capacity down and up per switch tier: a link counts as "up" for its lower end.
        let rank = |v: Vertex| match tier_of(v) {
            None => 0,
            Some(t) => t as u32 + 1,
        };
        let mut down = BTreeMap::<Tier, u128>::new();
        let mut up = BTreeMap::<Tier, u128>::new();
        let mut boundary = BTreeMap::<LinkClass, u128>::new();
        let mut cables = BTreeMap::<(LinkClass, u64), u64>::new();
        // The GPUs' own NIC capacity (a full-mesh link has a NIC at both ends).
        let mut nic_capacity = 0u128;
        for l in &topo.links {
            let rate = l.params.rate.bps() as u128;
            *cables.entry((l.class, l.params.rate.bps())).or_default() += 1;
            if l.class == LinkClass::Nvlink {
                continue;
            }
            nic_capacity += rate
                * [l.a, l.b]
                    .iter()
                    .filter(|v| matches!(v, Vertex::Host(_)))
                    .count() as u128;
            *boundary.entry(l.class).or_default() += rate;
            let (lo, hi) = if rank(l.a) <= rank(l.b) {
                (l.a, l.b)
            } else {
                (l.b, l.a)
            };
            if rank(lo) < rank(hi) {
                if let Some(t) = tier_of(lo) {
                    *up.entry(t).or_default() += rate;
                }
                if let Some(t) = tier_of(hi) {
                    *down.entry(t).or_default() += rate;
                }
            }
        }
        let mut tiers = Vec::new();
        for tier in Tier::ALL {
            let ports: Vec<u64> = topo
                .switches
                .iter()
                .zip(&degree)
                .filter(|(s, _)| s.tier == tier)
                .map(|(_, d)| *d as u64)
                .collect();
            if ports.is_empty() {
                continue;
            }
            let radix = topo
                .switches
                .iter()
                .find(|s| s.tier == tier)
                .and_then(|s| s.params.radix);
            // A lone switch of a tier turns all traffic around: nothing goes up from it.
            let oversubscription = match (down.get(&tier), up.get(&tier)) {
                (Some(&d), Some(&u)) if u > 0 && tier != Tier::Node && ports.len() > 1 => {
                    Some(d as f64 / u as f64)
                }
                _ => None,
            };
            tiers.push(TierPlan {
                tier: tier.name().into(),
                switches: ports.len() as u64,
                ports_min: *ports.iter().min().expect("non-empty"),
                ports_max: *ports.iter().max().expect("non-empty"),
                radix,
                oversubscription,
            });
        }
        let nic_half = nic_capacity / 2;
        // A boundary above a lone switch is never crossed (one leaf: no traffic goes to
        // the spines), so it bounds nothing.
        let count = |t: Tier| topo.switches.iter().filter(|s| s.tier == t).count();
        boundary.retain(|class, _| match class {
            LinkClass::LeafSpine => count(Tier::Leaf) > 1,
            LinkClass::SpineCore => count(Tier::Spine) > 1,
            _ => true,
        });
        let bisection = if topo.shape == Shape::FullMesh {
            full_mesh_cut(topo)
        } else {
            boundary.values().map(|c| c / 2).min().unwrap_or(0)
        };
        let (intra, inter, sampled) = hop_stats(topo);
        Plan {
            name: topo.fabric.name.clone(),
            kind: topo.shape.kind().into(),
            gpus: h as u64,
            nodes: topo.nodes() as u64,
            gpus_per_node: topo.gpus_per_node() as u64,
            mtu: topo.fabric.mtu,
            tiers,
            cables: cables
                .into_iter()
                .map(|((c, rate), count)| CablePlan {
                    class: c.name().into(),
                    count,
                    rate_bps: rate,
                })
                .collect(),
            bisection_bps: bisection.min(u64::MAX as u128) as u64,
            bisection_ratio: if nic_half > 0 {
                bisection as f64 / nic_half as f64
            } else {
                0.0
            },
            hops_intra_node: intra,
            hops_inter_node: inter,
            hops_sampled: sampled,
            compare: Alternatives::for_gpus(h as u64),
            daemon_memory: DaemonMemory::of(topo),
            time_scale: TimeScaleHint::of(topo),
            network: NetworkPlan::of(topo),
        }
    }
}

/// NIC capacity between the first and second half of the GPUs (full mesh).
fn full_mesh_cut(topo: &Topology) -> u128 {
    let half = topo.hosts.len() as u32 / 2;
    let side = |v: Vertex| matches!(v, Vertex::Host(HostId(i)) if i < half);
    topo.links
        .iter()
        .filter(|l| l.class != LinkClass::Nvlink && side(l.a) != side(l.b))
        .map(|l| l.params.rate.bps() as u128)
        .sum()
}

#[derive(Default)]
struct Acc {
    min: u32,
    max: u32,
    sum: u64,
    pairs: u64,
}

impl Acc {
    fn add(&mut self, d: u32) {
        if self.pairs == 0 || d < self.min {
            self.min = d;
        }
        self.max = self.max.max(d);
        self.sum += d as u64;
        self.pairs += 1;
    }

    fn stats(&self) -> Option<HopStats> {
        (self.pairs > 0).then(|| HopStats {
            min: self.min,
            avg: self.sum as f64 / self.pairs as f64,
            max: self.max,
            pairs: self.pairs,
        })
    }
}

fn hop_stats(topo: &Topology) -> (Option<HopStats>, Option<HopStats>, bool) {
    let h = topo.hosts.len();
    let graph = PortGraph::new(topo);
    let sampled = h > EXACT_HOPS_LIMIT;
    let sources: Vec<usize> = if sampled {
        (0..HOP_SAMPLE).map(|i| i * h / HOP_SAMPLE).collect()
    } else {
        (0..h).collect()
    };
    let (mut intra, mut inter) = (Acc::default(), Acc::default());
    for s in sources {
        let dist = graph.hops_from(topo, HostId(s as u32));
        for (d, (t, host)) in dist.iter().zip(topo.hosts.iter().enumerate()) {
            if t == s {
                continue;
            }
            if host.node == topo.hosts[s].node {
                intra.add(*d);
            } else {
                inter.add(*d);
            }
        }
    }
    (intra.stats(), inter.stats(), sampled)
}

/// A fabric sized for `gpus` GPUs from switches of `radix` ports, at 1:1 (half of each
/// switch's ports down, half up; the top tier all down).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Sizing {
    pub gpus: u64,
    pub radix: u64,
    pub compare: Alternatives,
    pub leaf_spine: Design,
    pub fat_tree: Design,
    /// For a fabric that does not fit the radix: the smallest even radix for which it
    /// fits, with that design.
    pub fat_tree_min_radix: Option<Box<Design>>,
    pub leaf_spine_min_radix: Option<Box<Design>>,
}

/// One sized design.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Design {
    pub kind: String,
    pub radix: u64,
    /// Most GPUs this design reaches with this radix.
    pub max_gpus: u64,
    pub fits: bool,
    /// Switches per tier, bottom up (when it fits).
    pub switches: Vec<(String, u64)>,
    pub switches_total: u64,
    /// Cables per class (GPU NICs included).
    pub cables: Vec<(String, u64)>,
    pub cables_total: u64,
    /// Inter-GPU hops: min, avg over all ordered pairs, max.
    pub hops: Option<HopStats>,
}

impl Design {
    fn new(kind: &str, radix: u64, max_gpus: u64, n: u64) -> Design {
        Design {
            kind: kind.into(),
            radix,
            max_gpus,
            fits: n <= max_gpus && n > 0,
            switches: vec![],
            switches_total: 0,
            cables: vec![],
            cables_total: 0,
            hops: None,
        }
    }

    fn with_totals(mut self) -> Design {
        self.switches_total = self.switches.iter().map(|s| s.1).sum();
        self.cables_total = self.cables.iter().map(|s| s.1).sum();
        self
    }
}

impl Sizing {
    pub fn new(gpus: u64, radix: u64) -> Sizing {
        let ls = leaf_spine_design(gpus, radix);
        let ft = fat_tree_design(gpus, radix);
        let min_radix = |f: fn(u64, u64) -> Design, fits: bool| {
            (!fits).then(|| {
                let mut k = radix + 2;
                while !f(gpus, k).fits {
                    k += 2;
                }
                Box::new(f(gpus, k))
            })
        };
        Sizing {
            gpus,
            radix,
            compare: Alternatives::for_gpus(gpus),
            fat_tree_min_radix: min_radix(fat_tree_design, ft.fits),
            leaf_spine_min_radix: min_radix(leaf_spine_design, ls.fits),
            leaf_spine: ls,
            fat_tree: ft,
        }
    }
}

/// Two tiers: leaves with up to k/2 GPUs and as many uplinks (1:1), spines enough for
/// every uplink (k ports each). GPUs that fit on one leaf need no spine.
pub fn leaf_spine_design(n: u64, k: u64) -> Design {
    let half = k / 2;
    let leaves = n.div_ceil(half);
    let mut d = Design::new("leaf-spine", k, k * half, n);
    if d.fits {
        if leaves <= 1 {
            d.switches = vec![("leaf".into(), 1)];
            d.cables = vec![("nic".into(), n)];
        } else {
            d.switches = vec![("leaf".into(), leaves), ("spine".into(), n.div_ceil(k))];
            d.cables = vec![("nic".into(), n), ("leaf-spine".into(), n)];
        }
        // Same leaf: 2 links; different leaves: 4.
        let same: u64 = (0..leaves).map(|l| pairs(per_group(n, half, l))).sum();
        d.hops = hop_mix(n, &[(2, same), (4, pairs(n) - same)]);
    }
    d.with_totals()
}

/// Three-tier fat-tree (k pods of k/2 leaves and k/2 spines, (k/2)² cores when full),
/// trimmed to what `n` GPUs need at 1:1: one leaf needs nothing above it, one pod needs
/// no cores, and a leaf has as many uplinks as GPUs.
pub fn fat_tree_design(n: u64, k: u64) -> Design {
    let half = k / 2;
    let pod = half * half;
    let mut d = Design::new("fat-tree", k, k * pod, n);
    if d.fits {
        let pods = n.div_ceil(pod);
        let leaves = n.div_ceil(half);
        if leaves <= 1 {
            d.switches = vec![("leaf".into(), 1)];
            d.cables = vec![("nic".into(), n)];
        } else if pods <= 1 {
            // Every leaf links to every spine once: as many spines as the fullest leaf
            // has GPUs.
            d.switches = vec![("leaf".into(), leaves), ("spine".into(), n.min(half))];
            d.cables = vec![("nic".into(), n), ("leaf-spine".into(), n)];
        } else {
            d.switches = vec![
                ("leaf".into(), leaves),
                ("spine".into(), pods * half),
                ("core".into(), n.div_ceil(k)),
            ];
            d.cables = vec![
                ("nic".into(), n),
                ("leaf-spine".into(), n),
                ("spine-core".into(), n),
            ];
        }
        let same_leaf: u64 = (0..leaves).map(|l| pairs(per_group(n, half, l))).sum();
        let same_pod: u64 = (0..pods).map(|p| pairs(per_group(n, pod, p))).sum();
        d.hops = hop_mix(
            n,
            &[
                (2, same_leaf),
                (4, same_pod - same_leaf),
                (6, pairs(n) - same_pod),
            ],
        );
    }
    d.with_totals()
}

/// Members of group `i` when `n` items fill groups of `size` in order.
fn per_group(n: u64, size: u64, i: u64) -> u64 {
    n.saturating_sub(i * size).min(size)
}

/// Ordered pairs of distinct members among `m`.
fn pairs(m: u64) -> u64 {
    m * m.saturating_sub(1)
}

fn hop_mix(n: u64, mix: &[(u32, u64)]) -> Option<HopStats> {
    let present: Vec<_> = mix.iter().filter(|(_, c)| *c > 0).collect();
    let total: u64 = present.iter().map(|(_, c)| c).sum();
    (n > 1 && total > 0).then(|| HopStats {
        min: present.iter().map(|(h, _)| *h).min().expect("non-empty"),
        max: present.iter().map(|(h, _)| *h).max().expect("non-empty"),
        avg: present
            .iter()
            .map(|(h, c)| *h as f64 * *c as f64)
            .sum::<f64>()
            / total as f64,
        pairs: total,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse;

    #[test]
    fn a_lone_switch_turns_traffic_around() {
        // One leaf under one spine: traffic never goes up, so nothing blocks.
        let t = parse(
            "[fabric]\nname = \"x\"\n[topology]\nkind = \"leaf-spine\"\nleaves = 1\nspines = 1\ngpus_per_leaf = 4\n",
            "t",
        )
        .unwrap();
        let p = Plan::of(&t);
        assert!(
            (p.bisection_ratio - 1.0).abs() < 1e-9,
            "{}",
            p.bisection_ratio
        );
        assert!(p.tiers.iter().all(|t| t.oversubscription.is_none()));
        // The GPUs' side as the defaults leave it.
        let g = &p.network.gpus;
        assert_eq!(g.tcp_congestion.as_deref(), Some("reno"));
        assert_eq!(g.nic_buffer_bytes, 16 << 20);
        assert!(g.tcp_ecn && g.nic_ecn.is_none(), "{g:?}");
        // Sizing: what fits on one switch needs one switch.
        for d in [leaf_spine_design(1, 64), fat_tree_design(32, 64)] {
            assert_eq!(d.switches, vec![("leaf".to_owned(), 1)], "{d:?}");
        }
        // One pod: no cores; 1:1 uplinks.
        let d = fat_tree_design(100, 64);
        assert_eq!(d.switches.len(), 2, "{d:?}");
        assert!(d.cables.contains(&("leaf-spine".to_owned(), 100)), "{d:?}");
    }

    #[test]
    fn two_hundred_thousand_gpus() {
        let s = Sizing::new(200_000, 64);
        assert_eq!(s.compare.full_mesh_ports_per_gpu, 199_999);
        assert_eq!(s.compare.full_mesh_cables, 19_999_900_000);
        assert_eq!(s.compare.single_switch_ports, 200_000);
        assert_eq!(s.leaf_spine.max_gpus, 2_048);
        assert!(!s.leaf_spine.fits);
        assert_eq!(s.fat_tree.max_gpus, 65_536);
        assert!(!s.fat_tree.fits);
        let ft = s.fat_tree_min_radix.unwrap();
        assert_eq!(ft.radix, 94); // 94³/4 = 207,646 ≥ 200,000 > 92³/4
        assert_eq!(ft.max_gpus, 207_646);
    }

    #[test]
    fn sizing_agrees_with_generated_fabrics() {
        // 64 GPUs on radix-16 switches: 8 leaves of 8, 4 spines (two links to each leaf).
        let t = parse(
            "[fabric]\nname = \"x\"\n[topology]\nkind = \"leaf-spine\"\nleaves = 8\nspines = 4\ngpus_per_leaf = 8\nuplinks = 2\n",
            "x",
        )
        .unwrap();
        let p = Plan::of(&t);
        let d = leaf_spine_design(64, 16);
        assert_eq!(d.switches, vec![("leaf".into(), 8), ("spine".into(), 4)]);
        assert_eq!(p.tiers[0].switches + p.tiers[1].switches, d.switches_total);
        assert_eq!(
            p.cables.iter().map(|c| c.count).sum::<u64>(),
            d.cables_total
        );
        assert_eq!(p.hops_inter_node, d.hops);
        assert_eq!(p.tiers[0].oversubscription, Some(1.0));
        assert_eq!(p.bisection_ratio, 1.0);

        // fat-tree k = 4: 16 GPUs, 8 leaves, 8 spines, 4 cores.
        let t = parse(
            "[fabric]\nname = \"x\"\n[topology]\nkind = \"fat-tree\"\nk = 4\n",
            "x",
        )
        .unwrap();
        let p = Plan::of(&t);
        let d = fat_tree_design(16, 4);
        let counts: Vec<u64> = p.tiers.iter().map(|t| t.switches).collect();
        assert_eq!(counts, vec![8, 8, 4]);
        assert_eq!(d.switches.iter().map(|s| s.1).collect::<Vec<_>>(), counts);
        assert_eq!(p.hops_inter_node, d.hops);
        assert_eq!(
            p.tiers.iter().map(|t| t.ports_max).collect::<Vec<_>>(),
            vec![4, 4, 4]
        );
    }

    #[test]
    fn oversubscription_and_bisection_of_a_3_to_1_leaf_spine() {
        let t = parse(
            "[fabric]\nname = \"x\"\n[topology]\nkind = \"leaf-spine\"\nleaves = 4\nspines = 2\ngpus_per_leaf = 12\n[links.nic]\nrate = \"100Gbit\"\n[links.leaf-spine]\nrate = \"200Gbit\"\n",
            "x",
        )
        .unwrap();
        let p = Plan::of(&t);
        assert_eq!(p.tiers[0].oversubscription, Some(3.0));
        assert_eq!(p.tiers[1].oversubscription, None);
        // Leaf uplinks: 4 × 2 × 200G = 1.6T, halved = 800G; NICs 48 × 100G halved = 2.4T.
        assert_eq!(p.bisection_bps, 800_000_000_000);
        assert!((p.bisection_ratio - 1.0 / 3.0).abs() < 1e-9);
    }

    #[test]
    fn full_mesh_and_scale_up() {
        let t = parse(
            "[fabric]\nname = \"x\"\n[topology]\nkind = \"full-mesh\"\ngpus = 8\n[links.nic]\nrate = \"10Gbit\"\n",
            "x",
        )
        .unwrap();
        let p = Plan::of(&t);
        assert_eq!(p.cables[0].count, 28);
        assert_eq!(p.bisection_bps, 16 * 10_000_000_000);
        // Each GPU has 7 NICs: 8 × 7 × 10G / 2 = 280G; the cut carries 160G.
        assert!((p.bisection_ratio - 160.0 / 280.0).abs() < 1e-9);
        assert_eq!(p.hops_inter_node.unwrap().max, 1);

        let t = parse(
            "[fabric]\nname = \"x\"\n[node]\ngpus_per_node = 4\n[topology]\nkind = \"single-switch\"\nnodes = 2\n",
            "x",
        )
        .unwrap();
        let p = Plan::of(&t);
        assert_eq!((p.nodes, p.gpus_per_node), (2, 4));
        let intra = p.hops_intra_node.unwrap();
        assert_eq!((intra.min, intra.max, intra.pairs), (2, 2, 2 * 4 * 3));
        assert_eq!(p.hops_inter_node.unwrap().pairs, 8 * 4);
    }
}
