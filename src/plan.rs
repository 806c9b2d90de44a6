//! Text rendering of `closbox plan`.

use std::fmt::Write as _;

use closbox_fabric::plan::{Design, HopStats, Plan, Sizing};
use closbox_fabric::{Bandwidth, Bytes};

use crate::cli::SizeKind;

pub use closbox_fabric::units::approx_bytes;

/// "1 GPU", "1,024 GPUs".
pub fn count(n: u64, what: &str) -> String {
    if n == 1 {
        format!("1 {what}")
    } else {
        format!("{} {what}s", thousands(n))
    }
}

pub fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn hops(h: &Option<HopStats>) -> String {
    match h {
        Some(h) => format!(
            "min {}, avg {:.2}, max {} ({} pairs)",
            h.min,
            h.avg,
            h.max,
            thousands(h.pairs)
        ),
        None => "-".into(),
    }
}

pub fn render_plan(p: &Plan) -> String {
    let mut s = String::new();
    let nodes = if p.gpus_per_node > 1 {
        format!(
            " in {} of up to {} (scale-up domains)",
            count(p.nodes, "node"),
            p.gpus_per_node
        )
    } else {
        String::new()
    };
    let _ = writeln!(
        s,
        "fabric {} ({}): {}{nodes}",
        p.name,
        p.kind,
        count(p.gpus, "GPU")
    );
    if p.tiers.is_empty() {
        let _ = writeln!(s, "\nswitches: none");
    } else {
        let _ = writeln!(s, "\nswitches");
        let _ = writeln!(
            s,
            "  {:<6} {:>8} {:>12} {:>6} {:>17}",
            "tier", "count", "ports used", "radix", "oversubscription"
        );
    }
    for t in &p.tiers {
        let ports = if t.ports_min == t.ports_max {
            t.ports_max.to_string()
        } else {
            format!("{}..{}", t.ports_min, t.ports_max)
        };
        let radix = t.radix.map_or("-".into(), |r| r.to_string());
        let over = t
            .oversubscription
            .map_or("-".into(), |o| format!("{o:.2}:1"));
        let _ = writeln!(
            s,
            "  {:<6} {:>8} {:>12} {:>6} {:>17}",
            t.tier,
            thousands(t.switches),
            ports,
            radix,
            over
        );
    }
    let _ = writeln!(s, "\ncables");
    let _ = writeln!(s, "  {:<11} {:>8}  rate", "class", "count");
    for c in &p.cables {
        let _ = writeln!(
            s,
            "  {:<11} {:>8}  {}",
            c.class,
            thousands(c.count),
            Bandwidth::from_bps(c.rate_bps)
        );
    }
    let verdict = if p.kind == "custom" {
        "a tier-cut upper bound for a custom graph".to_owned()
    } else if p.kind == "full-mesh" {
        "every pair of GPUs has a link of its own; the cut is below a GPU's total link capacity"
            .to_owned()
    } else if p.bisection_ratio >= 0.999 {
        "non-blocking".to_owned()
    } else {
        format!("{:.2}:1 blocking", 1.0 / p.bisection_ratio.max(1e-12))
    };
    let _ = writeln!(
        s,
        "\nbisection bandwidth  {} ({:.2} × half the GPUs' NIC capacity: {verdict})",
        Bandwidth::from_bps(p.bisection_bps),
        p.bisection_ratio
    );
    let sampled = if p.hops_sampled {
        " (from 256 sampled sources)"
    } else {
        ""
    };
    let _ = writeln!(s, "hops (links on the path){sampled}");
    let _ = writeln!(s, "  intra-node  {}", hops(&p.hops_intra_node));
    let _ = writeln!(s, "  inter-node  {}", hops(&p.hops_inter_node));
    let t = &p.time_scale;
    if t.auto {
        let _ = writeln!(
            s,
            "time_scale           auto: `up` measures this box through the fabric's own data path and chooses (see the README); the estimate below is for time_scale {}",
            t.for_load
        );
    }
    let k = if t.auto { t.for_load } else { t.configured };
    let load = if k >= t.for_load {
        format!("the box keeps up (it does from time_scale {})", t.for_load)
    } else {
        format!(
            "more than the box moves: expect it to fall behind under full load below time_scale {}",
            t.for_load
        )
    };
    let _ = writeln!(
        s,
        "time_scale           {k}: all GPUs at full rate offer {} on the wall clock, against ~{} this box moves at mtu {}: {load}",
        Bandwidth::from_bps((t.offered_bps as f64 / k) as u64),
        Bandwidth::from_bps(t.box_bps),
        p.mtu,
    );
    let _ = writeln!(
        s,
        "                     the shortest GPU-to-GPU path takes {:.1} µs on the wall clock (the box's writes run 1–50 µs late, more under load)",
        t.shortest_path_ns as f64 * k / 1e3
    );
    network(&mut s, p);
    let m = &p.daemon_memory;
    let _ = writeln!(
        s,
        "daemon memory        at most {} (routing {}, structures {}, packets {}, process {})",
        approx_bytes(m.total),
        approx_bytes(m.routing),
        approx_bytes(m.structures),
        approx_bytes(m.packets),
        approx_bytes(m.base)
    );
    let _ = writeln!(s, "\nthe same {} without a hierarchy", count(p.gpus, "GPU"));
    let _ = writeln!(
        s,
        "  full mesh      {} ports per GPU, {} cables",
        thousands(p.compare.full_mesh_ports_per_gpu),
        thousands(p.compare.full_mesh_cables)
    );
    let _ = write!(
        s,
        "  single switch  one switch with {}",
        count(p.compare.single_switch_ports, "port")
    );
    s
}

/// The network's settings: what the preset set (if any), flow control, switches.
fn network(s: &mut String, p: &Plan) {
    let n = &p.network;
    let by = match (&n.preset, &n.preset_about) {
        (Some(name), Some(about)) => format!("preset {name} ({about}); the file's values win"),
        _ => "no preset: closbox's defaults and the file's values".into(),
    };
    let _ = writeln!(s, "network              {by}");
    let _ = writeln!(
        s,
        "  frames             mtu {} + {} bytes per frame on the wire",
        p.mtu, n.l2_overhead
    );
    let fc = match (n.flow_control.as_str(), n.xoff_bytes, n.xon_bytes) {
        ("none", ..) => "none: lossy, queues tail-drop at their buffer".to_owned(),
        (mode, Some(xoff), Some(xon)) => {
            let how = if mode == "pfc" {
                "PFC: a pause reaches the sender a link delay after xoff"
            } else {
                "credits: the sender stops at once at xoff"
            };
            let head: Vec<String> = n
                .headroom
                .iter()
                .map(|(c, b)| format!("{} ({c} links)", approx_bytes(*b)))
                .collect();
            format!(
                "{mode}, lossless ({how}): xoff {}, xon {} per switch ingress (in place of the egress buffers), headroom beyond xoff {}; a port paused over {} is reported as a deadlock",
                Bytes::new(xoff),
                Bytes::new(xon),
                head.join(", "),
                closbox_fabric::Duration::from_nanos(n.deadlock_after_ns.unwrap_or(0))
            )
        }
        (mode, ..) => mode.to_owned(),
    };
    let _ = writeln!(s, "  flow control       {fc}");
    // A queue deeper than what the fabric may hold in all fills only that far.
    let packets = p.daemon_memory.packets;
    let past_memory = |bytes: u64| {
        if bytes > packets {
            format!(
                " (more than the fabric's packet_memory, {}: packets past it are dropped as memory_limit)",
                approx_bytes(packets)
            )
        } else {
            String::new()
        }
    };
    for sw in &n.switches {
        let ecn = sw
            .ecn
            .as_deref()
            .map_or("no ECN".to_owned(), |e| format!("ECN {e}"));
        let buffer = if n.flow_control == "none" {
            format!(
                "buffer {} per port{}, ",
                Bytes::new(sw.buffer_bytes),
                past_memory(sw.buffer_bytes)
            )
        } else {
            String::new()
        };
        let _ = writeln!(
            s,
            "  {:<18} latency {} ns, routing {}, {buffer}{ecn}",
            format!("{} switches", sw.tier),
            sw.latency_ns,
            sw.routing,
        );
    }
    let g = &n.gpus;
    let _ = writeln!(
        s,
        "  GPUs               NIC queue {}{}{}{}, TCP {}{}",
        Bytes::new(g.nic_buffer_bytes),
        past_memory(g.nic_buffer_bytes),
        g.nic_ecn
            .as_deref()
            .map_or(String::new(), |e| format!(" (ECN {e})")),
        if g.nic_scheduler == "fq" {
            ", flows served in turn (fq)"
        } else {
            ", one FIFO"
        },
        g.tcp_congestion
            .as_deref()
            .unwrap_or("the host's default congestion control"),
        if g.tcp_ecn {
            " with ECN"
        } else {
            " without ECN"
        }
    );
}

fn design(s: &mut String, d: &Design, gpus: u64) {
    let title = match d.kind.as_str() {
        "fat-tree" => "3-tier fat-tree",
        _ => "2-tier leaf-spine",
    };
    let _ = writeln!(
        s,
        "{title}, radix {}: reaches at most {} GPUs at 1:1",
        d.radix,
        thousands(d.max_gpus)
    );
    if !d.fits {
        let _ = writeln!(s, "  {} GPUs do not fit", thousands(gpus));
        return;
    }
    let switches: Vec<String> = d
        .switches
        .iter()
        .map(|(t, n)| format!("{} {t}", thousands(*n)))
        .collect();
    let cables: Vec<String> = d
        .cables
        .iter()
        .map(|(c, n)| format!("{} {c}", thousands(*n)))
        .collect();
    let _ = writeln!(
        s,
        "  switches  {} = {}",
        switches.join(" + "),
        thousands(d.switches_total)
    );
    let _ = writeln!(
        s,
        "  cables    {} = {}",
        cables.join(" + "),
        thousands(d.cables_total)
    );
    let _ = writeln!(s, "  hops      {}", hops(&d.hops));
}

pub fn render_sizing(z: &Sizing, kind: SizeKind) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "{}, radix-{} switches\n", count(z.gpus, "GPU"), z.radix);
    let mesh = format!(
        "full mesh: {} ports per GPU, {} cables\n",
        thousands(z.compare.full_mesh_ports_per_gpu),
        thousands(z.compare.full_mesh_cables)
    );
    let single = format!(
        "single switch: one switch with {} ports{}\n",
        thousands(z.compare.single_switch_ports),
        if z.compare.single_switch_ports > z.radix {
            format!(" (a radix-{} switch has {})", z.radix, z.radix)
        } else {
            String::new()
        }
    );
    let mut fabrics = String::new();
    let (first, second, first_min, second_min) = match kind {
        SizeKind::FatTree => (
            &z.fat_tree,
            &z.leaf_spine,
            &z.fat_tree_min_radix,
            &z.leaf_spine_min_radix,
        ),
        _ => (
            &z.leaf_spine,
            &z.fat_tree,
            &z.leaf_spine_min_radix,
            &z.fat_tree_min_radix,
        ),
    };
    for (d, min) in [(first, first_min), (second, second_min)] {
        design(&mut fabrics, d, z.gpus);
        if let Some(m) = min {
            let _ = writeln!(
                fabrics,
                "  needs radix ≥ {} for {} GPUs:",
                m.radix,
                thousands(z.gpus)
            );
            let mut sub = String::new();
            design(&mut sub, m, z.gpus);
            for line in sub.lines().skip(1) {
                let _ = writeln!(fabrics, "  {line}");
            }
        }
        fabrics.push('\n');
    }
    match kind {
        SizeKind::FullMesh => {
            s += &mesh;
            s += &single;
            s.push('\n');
            s += &fabrics;
        }
        SizeKind::SingleSwitch => {
            s += &single;
            s += &mesh;
            s.push('\n');
            s += &fabrics;
        }
        _ => {
            s += &fabrics;
            s += &mesh;
            s += &single;
        }
    }
    s.trim_end().to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_thousands() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1_000), "1,000");
        assert_eq!(thousands(19_999_900_000), "19,999,900,000");
    }

    #[test]
    fn prints_the_issue_figures_for_200k_gpus() {
        let out = render_sizing(&Sizing::new(200_000, 64), SizeKind::FatTree);
        assert!(
            out.contains("full mesh: 199,999 ports per GPU, 19,999,900,000 cables"),
            "{out}"
        );
        assert!(
            out.contains("2-tier leaf-spine, radix 64: reaches at most 2,048 GPUs"),
            "{out}"
        );
        assert!(
            out.contains("3-tier fat-tree, radix 64: reaches at most 65,536 GPUs"),
            "{out}"
        );
        assert!(out.contains("needs radix ≥ 94"), "{out}");
    }

    #[test]
    fn a_buffer_beyond_the_packet_memory_says_so() {
        let file = |buffer: &str| {
            format!("[fabric]\nname = \"p\"\npacket_memory = \"64MiB\"\n[topology]\nkind = \"single-switch\"\ngpus = 2\n[switches.leaf]\nbuffer = \"{buffer}\"\n")
        };
        let render = |buffer: &str| {
            let topo = closbox_fabric::config::parse(&file(buffer), "t").unwrap();
            render_plan(&Plan::of(&topo))
        };
        let deep = render("1TB");
        assert!(
            deep.contains("buffer 1TB per port (more than the fabric's packet_memory, 64 MiB"),
            "{deep}"
        );
        let fits = render("1MiB");
        assert!(
            !fits.contains("more than the fabric's packet_memory"),
            "{fits}"
        );
    }
}
