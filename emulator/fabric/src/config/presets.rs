//! `[fabric] preset = "..."`: the defaults of a scale-out family, each value overridable
//! by the file (documented with sources in the README).

use crate::topology::{Ecn, Routing};
use crate::units::{Bandwidth, Bytes, Duration};

/// What a preset sets: defaults for the scale-out links (NIC, leaf–spine, spine–core),
/// the switches of the leaf, spine and core tiers, the MTU and the flow control.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Preset {
    pub name: &'static str,
    pub about: &'static str,
    pub rate: Bandwidth,
    pub mtu: u32,
    pub l2_overhead: u32,
    pub switch_latency: Duration,
    pub ecn: Option<Ecn>,
    pub routing: Routing,
    /// "none", "pfc" or "credit".
    pub flow_control: &'static str,
}

/// DCQCN-style RED marking on RoCE switches (probability rising from 100 KiB to 400 KiB).
const ROCE_ECN: Ecn = Ecn::Red {
    min: Bytes::new(100 << 10),
    max: Bytes::new(400 << 10),
    p_max: 0.2,
};

pub const PRESETS: [Preset; 4] = [
    Preset {
        name: "ethernet-lossy",
        about: "400 Gbit/s Ethernet without PFC or ECN: queues tail-drop (closbox's defaults)",
        rate: Bandwidth::from_gbps(400),
        mtu: 1500,
        l2_overhead: 38,
        switch_latency: Duration::from_nanos(600),
        ecn: None,
        routing: Routing::Ecmp,
        flow_control: "none",
    },
    Preset {
        name: "roce-400g",
        about: "RoCEv2 on 400 Gbit/s Ethernet: jumbo frames, PFC, ECN marking for DCQCN, ECMP",
        rate: Bandwidth::from_gbps(400),
        mtu: 9000,
        l2_overhead: 38,
        switch_latency: Duration::from_nanos(600),
        ecn: Some(ROCE_ECN),
        routing: Routing::Ecmp,
        flow_control: "pfc",
    },
    Preset {
        name: "spectrum-x",
        about: "RoCE with per-packet adaptive routing (NVIDIA Spectrum-X): roce-400g, routing adaptive",
        rate: Bandwidth::from_gbps(400),
        mtu: 9000,
        l2_overhead: 38,
        switch_latency: Duration::from_nanos(600),
        ecn: Some(ROCE_ECN),
        routing: Routing::Adaptive,
        flow_control: "pfc",
    },
    Preset {
        name: "infiniband-ndr",
        about: "InfiniBand NDR: 400 Gbit/s, 4 KiB MTU, ~130 ns switches, credit flow control, adaptive routing",
        rate: Bandwidth::from_gbps(400),
        // IPoIB datagram mode: the 4096-byte IB MTU less the 4-byte IPoIB header.
        mtu: 4092,
        // LRH 8 + BTH 12 + DETH 8 + IPoIB 4 + ICRC 4 + VCRC 2.
        l2_overhead: 38,
        switch_latency: Duration::from_nanos(130),
        ecn: None,
        routing: Routing::Adaptive,
        flow_control: "credit",
    },
];

pub fn find(name: &str) -> Option<&'static Preset> {
    PRESETS.iter().find(|p| p.name == name)
}
