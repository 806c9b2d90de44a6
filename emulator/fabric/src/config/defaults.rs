//! What a file may leave out: link and switch settings per class and tier, the NIC
//! buffer, the packet-memory budget (documented in the README).

use crate::topology::{
    LinkClass, LinkParams, QueueParams, Routing, SwitchParams, Tier, Topology, Vertex,
};
use crate::units::{Bandwidth, Bytes, Duration};

/// Default link settings per class (documented in the README).
pub fn default_link(class: LinkClass) -> LinkParams {
    let (rate, delay) = match class {
        LinkClass::Nvlink => (Bandwidth::from_bps(3_600_000_000_000), 0),
        LinkClass::Nic => (Bandwidth::from_gbps(400), 100),
        LinkClass::LeafSpine => (Bandwidth::from_gbps(400), 500),
        LinkClass::SpineCore => (Bandwidth::from_gbps(400), 1_000),
    };
    LinkParams {
        rate,
        delay: Duration::from_nanos(delay),
        loss: 0.0,
        loss_burst: 1.0,
    }
}

/// Default switch settings per tier (documented in the README).
pub fn default_switch(tier: Tier) -> SwitchParams {
    SwitchParams {
        latency: Duration::from_nanos(if tier == Tier::Node { 300 } else { 600 }),
        queue: QueueParams {
            buffer: Bytes::new(if tier == Tier::Node { 4 << 20 } else { 1 << 20 }),
            ecn: None,
        },
        routing: Routing::Ecmp,
        radix: None,
        icmp_rate: DEFAULT_ICMP_RATE,
    }
}

/// A switch's ICMP answers a second, by default: Linux's `icmp_msgs_per_sec` (switches'
/// control-plane policers are set in the same range, hundreds to thousands a second).
pub const DEFAULT_ICMP_RATE: u32 = 1000;

/// A GPU's NIC queue, deep enough for what its TCP can have unsent: four connections'
/// full send buffers (Linux's `tcp_wmem` maximum, 4 MiB). A host's qdisc pushes back on
/// its own TCP (TCP small queues, local congestion) rather than losing its packets; a TUN
/// cannot push back, so the model's NIC queue holds that backlog instead. At 2 MiB (the
/// default until then) Reno's windows overflowed it in every 16 MiB ring: 6 % of the
/// frames of `rail-optimized-32`'s ring across nodes were lost in their own NICs, 1.13–1.15
/// × the model; with 16 MiB no drop (at most 4.3 MB queued) and 1.04 ×.
pub const DEFAULT_NIC_BUFFER: Bytes = Bytes::new(16 << 20);

/// The GPUs' TCP congestion control unless the file names one. Reno is driven by ACKs
/// alone, so it behaves the same at every `time_scale`: its state advances per round
/// trip, and a round trip dilates with the fabric. Algorithms with wall-clock timers do
/// not dilate: BBR (many hosts' default) drains its window to 4 packets for 200 ms every
/// 10 s to probe the round trip, which at time scale k costs k times its share of fabric
/// time — measured on fat-tree-k4 (1 Gbit/s, 1500-byte frames, time_scale 50), a 4 MiB ring
/// AllReduce ran 1.10–1.14 × the model with BBR and 1.03 × with Reno. Cubic's window
/// grows with wall time since its last loss. Always allowed in a namespace.
pub const DEFAULT_CONGESTION: &str = "reno";

/// `tcp_congestion = "host"`: keep the host's default.
pub const HOST_CONGESTION: &str = "host";

/// Bounds of `[fabric] packet_memory`, and of its default.
pub const MIN_PACKET_MEMORY: u64 = 16 << 20;
pub const MAX_PACKET_MEMORY: u64 = 16 << 30;
pub const DEFAULT_PACKET_MEMORY_CAP: u64 = 1 << 30;

/// Default packet memory: every port's buffer full of full-size packets (plus a quarter
/// for per-packet overhead and packets on the wire), at least 32 MiB, at most 1 GiB. In a
/// lossless fabric a switch holds up to `xoff` + headroom per ingress instead, when more.
pub fn default_packet_memory(topo: &Topology) -> Bytes {
    let pause = topo.fabric.flow_control.pause();
    let buffer_of = |v: Vertex, link: &crate::topology::LinkParams| match v {
        Vertex::Host(_) => topo.fabric.nic_queue.buffer.get(),
        Vertex::Switch(s) => {
            let sw = &topo.switches[s.0 as usize].params;
            let held = pause.map_or(0, |p| {
                p.xoff.get()
                    + crate::model::headroom_bytes(link, sw.latency, topo.fabric.l2_overhead)
            });
            sw.queue.buffer.get().max(held)
        }
    };
    let total = topo
        .links
        .iter()
        .map(|l| buffer_of(l.a, &l.params).saturating_add(buffer_of(l.b, &l.params)))
        .fold(0u64, u64::saturating_add);
    Bytes::new(
        total
            .saturating_add(total / 4)
            .clamp(32 << 20, DEFAULT_PACKET_MEMORY_CAP),
    )
}
