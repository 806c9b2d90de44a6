//! Checks of the built topology against the file: address pool, switch radix, settings
//! that apply to nothing, buffers below a packet, congestion controls the host forbids
//! (but DCTCP, which closbox brings where BTF lets it).

use std::ops::Range;

use toml::Spanned;

use super::raw::*;
use super::*;
use crate::topology::{LinkClass, Tier, Topology};

/// A namespace may use only the congestion controls the host allows
/// (`net.ipv4.tcp_allowed_congestion_control`): checked here, with a position, rather
/// than when `up` is half-way. Skipped where the host does not say (not Linux).
pub(super) fn check_congestion(cx: &Cx, kind: &Spanned<String>) -> Result<(), ConfigError> {
    let Ok(allowed) = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_allowed_congestion_control")
    else {
        return Ok(());
    };
    let want = kind.get_ref();
    if allowed.split_whitespace().any(|a| a == want) {
        return Ok(());
    }
    // Without the kernel's own, `up` registers closbox's (a BPF program, which libbpf
    // fits to the running kernel by its BTF).
    let btf = std::path::Path::new("/sys/kernel/btf/vmlinux").exists();
    if want == "dctcp" {
        if btf {
            return Ok(());
        }
        return Err(cx.err(
            kind,
            "`tcp_congestion` = \"dctcp\": this kernel lets network namespaces use no dctcp of its own (net.ipv4.tcp_allowed_congestion_control) and has no BTF (/sys/kernel/btf/vmlinux) for closbox's BPF one".to_string(),
        ));
    }
    let dctcp = if btf && !allowed.split_whitespace().any(|a| a == "dctcp") {
        ", or \"dctcp\" (closbox's own)"
    } else {
        ""
    };
    let hint = if want == "closbox_dctcp" && btf {
        ": write \"dctcp\", and `up` registers closbox_dctcp for the fabric's life"
    } else {
        ""
    };
    Err(cx.err(
        kind,
        format!(
            "`tcp_congestion` = {want:?} is not one this host lets a network namespace use ({}{dctcp}; see net.ipv4.tcp_allowed_congestion_control){hint}",
            allowed.split_whitespace().collect::<Vec<_>>().join(", ")
        ),
    ))
}

/// Ranges a fabric's addresses must stay out of: they mean something else to every host.
pub(super) const FORBIDDEN_POOLS: [(&str, [u8; 4], u8); 4] = [
    ("\"this network\" (0.0.0.0/8)", [0, 0, 0, 0], 8),
    ("loopback (127.0.0.0/8)", [127, 0, 0, 0], 8),
    ("multicast (224.0.0.0/4)", [224, 0, 0, 0], 4),
    (
        "reserved (240.0.0.0/4, with the broadcast address)",
        [240, 0, 0, 0],
        4,
    ),
];

pub(super) fn check_pool(cx: &Cx, raw: &RawFile, topo: &Topology) -> Result<(), ConfigError> {
    let pool = topo.fabric.pool;
    let overlaps = |base: [u8; 4], prefix: u8| {
        // Two prefixes overlap when they agree on the shorter one's bits.
        let shorter = prefix.min(pool.prefix) as u32;
        let mask = if shorter == 0 {
            0
        } else {
            u32::MAX << (32 - shorter)
        };
        (u32::from(pool.addr) & mask) == (u32::from_be_bytes(base) & mask)
    };
    if let Some((what, _, _)) = FORBIDDEN_POOLS.iter().find(|(_, b, p)| overlaps(*b, *p)) {
        let at = raw.fabric.address_pool.as_ref().map(|p| p.span());
        return Err(cx.err_at(
            at,
            format!("address pool {pool} overlaps the {what} range; use a private or benchmarking range such as {DEFAULT_POOL}"),
        ));
    }
    if topo.hosts.len() as u64 > pool.host_capacity() {
        let at = raw
            .fabric
            .address_pool
            .as_ref()
            .map(|p| p.span())
            .unwrap_or(raw.topology.span());
        return Err(cx.err_at(
            Some(at),
            format!(
                "{} GPUs do not fit in address pool {pool} ({} addresses)",
                topo.hosts.len(),
                pool.host_capacity()
            ),
        ));
    }
    Ok(())
}

/// Where a `[switches.<tier>]` table is: its first key's position (implicit tables carry
/// none of their own), else the `[topology]` table's.
pub(super) fn tier_span(raw: &RawFile, t: &Option<RawSwitchTier>) -> Option<Range<usize>> {
    let t = t.as_ref()?;
    [
        t.latency.as_ref().map(|v| v.span()),
        t.buffer.as_ref().map(|v| v.span()),
    ]
    .into_iter()
    .flatten()
    .chain(t.ecn.as_ref().map(|v| v.span()))
    .chain(t.routing.as_ref().map(|v| v.span()))
    .chain(t.radix.as_ref().map(|v| v.span()))
    .min_by_key(|s| s.start)
    .or(Some(raw.topology.span()))
}

/// Where a `[links.<class>]` table is: its first positioned key, else `[topology]`.
pub(super) fn link_span(raw: &RawFile, l: &Option<RawLinkClass>) -> Option<Range<usize>> {
    let l = l.as_ref()?;
    l.delay
        .as_ref()
        .map(|v| v.span())
        .into_iter()
        .chain(l.loss.as_ref().map(|v| v.span()))
        .chain(l.loss_burst.as_ref().map(|v| v.span()))
        .min_by_key(|s| s.start)
        .or(Some(raw.topology.span()))
}

/// Settings for parts the topology does not have are mistakes, not silently ignored; and
/// every buffer holds at least one packet.
pub(super) fn check_applies(cx: &Cx, raw: &RawFile, topo: &Topology) -> Result<(), ConfigError> {
    let kind = topo.shape.kind();
    let has_class = |c: LinkClass| topo.links.iter().any(|l| l.class == c);
    let has_tier = |t: Tier| topo.switches.iter().any(|s| s.tier == t);
    for (section, span, present) in [
        (
            "[links.nic]",
            link_span(raw, &raw.links.nic),
            has_class(LinkClass::Nic),
        ),
        (
            "[links.leaf-spine]",
            link_span(raw, &raw.links.leaf_spine),
            has_class(LinkClass::LeafSpine),
        ),
        (
            "[links.spine-core]",
            link_span(raw, &raw.links.spine_core),
            has_class(LinkClass::SpineCore),
        ),
        (
            "[switches.leaf]",
            tier_span(raw, &raw.switches.leaf),
            has_tier(Tier::Leaf),
        ),
        (
            "[switches.spine]",
            tier_span(raw, &raw.switches.spine),
            has_tier(Tier::Spine),
        ),
        (
            "[switches.core]",
            tier_span(raw, &raw.switches.core),
            has_tier(Tier::Core),
        ),
    ] {
        if let (Some(span), false) = (span, present) {
            return Err(cx.err_at(
                Some(span),
                format!(
                    "{section} does not apply: this {kind} topology has no such links or switches"
                ),
            ));
        }
    }
    if let Some(n) = &raw.node {
        let set = n.rate.is_some()
            || n.delay.is_some()
            || n.latency.is_some()
            || n.buffer.is_some()
            || n.ecn.is_some()
            || n.loss.is_some()
            || n.loss_burst.is_some();
        if set && !has_tier(Tier::Node) {
            // The first key set (sub-tables carry no position of their own).
            let at = [&n.delay, &n.latency]
                .into_iter()
                .flatten()
                .map(|d| d.span())
                .chain(n.buffer.as_ref().map(|b| b.span()))
                .chain(n.ecn.as_ref().map(|e| e.span()))
                .chain(n.loss.as_ref().map(|l| l.span()))
                .chain(n.loss_burst.as_ref().map(|l| l.span()))
                .min_by_key(|s| s.start)
                .unwrap_or(raw.topology.span());
            return Err(cx.err_at(
                Some(at),
                "[node] settings other than `gpus_per_node` apply to the scale-up switch of nodes of more than one GPU, and this topology has none (set gpus_per_node > 1)",
            ));
        }
    }
    let mtu = topo.fabric.mtu as u64;
    let buffers = [
        raw.nic.as_ref().and_then(|n| n.buffer.as_ref()),
        raw.node.as_ref().and_then(|n| n.buffer.as_ref()),
        raw.switches.leaf.as_ref().and_then(|t| t.buffer.as_ref()),
        raw.switches.spine.as_ref().and_then(|t| t.buffer.as_ref()),
        raw.switches.core.as_ref().and_then(|t| t.buffer.as_ref()),
    ];
    for b in buffers.into_iter().flatten() {
        if b.get_ref().get() < mtu {
            return Err(cx.err(
                b,
                format!(
                    "`buffer` = {} cannot hold one packet of the fabric's mtu ({mtu} bytes)",
                    b.get_ref()
                ),
            ));
        }
    }
    Ok(())
}

pub(super) fn check_radix(cx: &Cx, raw: &RawFile, topo: &Topology) -> Result<(), ConfigError> {
    let (_, deg) = topo.degrees();
    for (s, d) in topo.switches.iter().zip(deg) {
        if let Some(radix) = s.params.radix {
            if d > radix {
                let tier_raw = match s.tier {
                    Tier::Leaf => &raw.switches.leaf,
                    Tier::Spine => &raw.switches.spine,
                    Tier::Core => &raw.switches.core,
                    Tier::Node => &None,
                };
                let at = tier_raw
                    .as_ref()
                    .and_then(|t| t.radix.as_ref().map(|r| r.span()));
                return Err(cx.err_at(
                    at,
                    format!(
                        "switch {:?} needs {d} ports but [switches.{}] radix is {radix}",
                        s.name, s.tier
                    ),
                ));
            }
        }
    }
    Ok(())
}
