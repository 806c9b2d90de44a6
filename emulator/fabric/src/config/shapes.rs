//! The generated topology kinds: which keys each takes, their sizes checked from the
//! declared numbers before anything is built, then the generator.

use toml::Spanned;

use super::raw::*;
use super::*;
use crate::generate::{self, Builder};
use crate::topology::{Shape, Topology};

/// The `kind` of a `[topology]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    SingleSwitch,
    FullMesh,
    LeafSpine,
    FatTree,
    RailOptimized,
    SuperpodSu,
    Custom,
}

impl Kind {
    const ALL: [Kind; 7] = [
        Kind::SingleSwitch,
        Kind::FullMesh,
        Kind::LeafSpine,
        Kind::FatTree,
        Kind::RailOptimized,
        Kind::SuperpodSu,
        Kind::Custom,
    ];

    pub(super) fn name(self) -> &'static str {
        match self {
            Kind::SingleSwitch => "single-switch",
            Kind::FullMesh => "full-mesh",
            Kind::LeafSpine => "leaf-spine",
            Kind::FatTree => "fat-tree",
            Kind::RailOptimized => "rail-optimized",
            Kind::SuperpodSu => "superpod-su",
            Kind::Custom => "custom",
        }
    }

    fn from_name(s: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.name() == s)
    }

    /// The `[topology]` keys this kind takes (others present are errors).
    fn keys(self) -> &'static [&'static str] {
        match self {
            Kind::SingleSwitch | Kind::FullMesh => &["gpus", "nodes"],
            Kind::LeafSpine => &[
                "leaves",
                "spines",
                "gpus_per_leaf",
                "nodes_per_leaf",
                "uplinks",
            ],
            Kind::FatTree => &["k"],
            Kind::RailOptimized => &["nodes", "spines", "uplinks"],
            Kind::SuperpodSu | Kind::Custom => &[],
        }
    }

    /// "\"single-switch\", … or \"custom\"", for errors.
    fn all_names() -> String {
        let names: Vec<String> = Kind::ALL
            .iter()
            .map(|k| format!("{:?}", k.name()))
            .collect();
        format!(
            "{} or {}",
            names[..names.len() - 1].join(", "),
            names[names.len() - 1]
        )
    }
}

/// What a topology declares, counted before anything is built (u64: no product wraps).
#[derive(Clone, Copy, Debug)]
pub(super) struct Declared {
    pub(super) hosts: u64,
    pub(super) switches: u64,
    pub(super) links: u64,
}

impl Declared {
    /// `nodes` nodes of `gpn` GPUs: their GPUs, node switches and nvlinks.
    fn nodes(nodes: u64, gpn: u32) -> Declared {
        let hosts = nodes.saturating_mul(gpn as u64);
        let multi = gpn > 1;
        Declared {
            hosts,
            switches: if multi { nodes } else { 0 },
            links: if multi { hosts } else { 0 },
        }
    }

    fn plus(self, switches: u64, links: u64) -> Declared {
        Declared {
            hosts: self.hosts,
            switches: self.switches.saturating_add(switches),
            links: self.links.saturating_add(links),
        }
    }

    /// Refuses sizes above the limits, at `at`, before generating.
    pub(super) fn check<T>(self, cx: &Cx, at: &Spanned<T>, kind: &str) -> Result<(), ConfigError> {
        for (what, n, max) in [
            ("GPUs", self.hosts, MAX_GPUS),
            ("switches", self.switches, MAX_SWITCHES),
            ("links", self.links, MAX_LINKS),
        ] {
            if n > max {
                return Err(cx.err(
                    at,
                    format!("this {kind} topology has {n} {what}; closbox models at most {max}"),
                ));
            }
        }
        Ok(())
    }
}

pub(super) fn generate_shape(
    cx: &Cx,
    raw: &RawFile,
    b: Builder,
    gpn: u32,
) -> Result<Topology, ConfigError> {
    let t = raw.topology.get_ref();
    let kind_name = t.kind.get_ref().as_str();
    let kind = Kind::from_name(kind_name).ok_or_else(|| {
        cx.err(
            &t.kind,
            format!(
                "unknown topology kind {kind_name:?}; expected {}",
                Kind::all_names()
            ),
        )
    })?;
    let allowed = kind.keys();
    let present: [(&str, &Option<Spanned<i64>>); 8] = [
        ("gpus", &t.gpus),
        ("nodes", &t.nodes),
        ("leaves", &t.leaves),
        ("spines", &t.spines),
        ("gpus_per_leaf", &t.gpus_per_leaf),
        ("nodes_per_leaf", &t.nodes_per_leaf),
        ("uplinks", &t.uplinks),
        ("k", &t.k),
    ];
    for (key, v) in present {
        if let (Some(v), false) = (v, allowed.contains(&key)) {
            let hint = if allowed.is_empty() {
                "it takes none".to_owned()
            } else {
                format!("it takes {}", allowed.join(", "))
            };
            return Err(cx.err(
                v,
                format!("`{key}` does not apply to topology kind {kind_name:?}: {hint}"),
            ));
        }
    }
    if kind != Kind::Custom {
        if let Some(first) = raw.switch_list.first() {
            return Err(cx.err(
                first,
                format!("[[switch]] is only for kind \"custom\", not {kind_name:?}"),
            ));
        }
        if let Some(first) = raw.host_list.first() {
            return Err(cx.err(
                first,
                format!("[[host]] is only for kind \"custom\", not {kind_name:?}"),
            ));
        }
        if let Some(first) = raw.link_list.first() {
            return Err(cx.err(
                first,
                format!("[[link]] is only for kind \"custom\", not {kind_name:?}"),
            ));
        }
    }
    let need =
        |v: &Option<Spanned<i64>>, key: &str, min: i64, max: i64| -> Result<u32, ConfigError> {
            match v {
                Some(v) => count(cx, v, key, min, max),
                None => Err(cx.err(
                    &raw.topology,
                    format!("topology kind {kind_name:?} needs `{key}`"),
                )),
            }
        };
    let opt = |v: &Option<Spanned<i64>>, key: &str, default: u32| -> Result<u32, ConfigError> {
        v.as_ref()
            .map_or(Ok(default), |v| count(cx, v, key, 1, 1 << 20))
    };
    // A count of GPUs given where whole nodes are expected (no more than a fabric holds).
    let whole_nodes = |v: &Spanned<i64>, key: &str| -> Result<u32, ConfigError> {
        if *v.get_ref() > MAX_GPUS as i64 {
            return Err(cx.err(
                v,
                format!(
                    "`{key}` = {}: closbox models at most {MAX_GPUS} GPUs",
                    v.get_ref()
                ),
            ));
        }
        let g = count(cx, v, key, 1, MAX_GPUS as i64)?;
        if g % gpn != 0 {
            return Err(cx.err(
                v,
                format!("`{key}` = {g} is not a multiple of gpus_per_node = {gpn}"),
            ));
        }
        Ok(g / gpn)
    };
    let node_count = |what: &str| -> Result<u32, ConfigError> {
        match (&t.gpus, &t.nodes) {
            (Some(g), None) => whole_nodes(g, "gpus"),
            (None, Some(n)) => count(cx, n, "nodes", 1, 1 << 20),
            (Some(_), Some(n)) => Err(cx.err(n, "give `gpus` or `nodes`, not both")),
            (None, None) => Err(cx.err(&raw.topology, format!("{what} needs `gpus` or `nodes`"))),
        }
    };
    let topo = match kind {
        Kind::SingleSwitch => {
            let nodes = node_count("single-switch")?;
            let d = Declared::nodes(nodes as u64, gpn);
            d.plus(1, d.hosts).check(cx, &raw.topology, kind.name())?;
            generate::single_switch(b, nodes, gpn)
        }
        Kind::FullMesh => {
            let nodes = node_count("full-mesh")?;
            let d = Declared::nodes(nodes as u64, gpn);
            if d.hosts > 2048 {
                return Err(cx.err(
                    &raw.topology,
                    format!(
                        "full-mesh is limited to 2048 GPUs (2 million links); this one has {}",
                        d.hosts
                    ),
                ));
            }
            generate::full_mesh(b, nodes, gpn)
        }
        Kind::LeafSpine => {
            let leaves = need(&t.leaves, "leaves", 1, 65_536)?;
            let spines = need(&t.spines, "spines", 1, 65_536)?;
            let npl = match (&t.gpus_per_leaf, &t.nodes_per_leaf) {
                (Some(g), None) => whole_nodes(g, "gpus_per_leaf")?,
                (None, Some(n)) => count(cx, n, "nodes_per_leaf", 1, 65_536)?,
                (Some(_), Some(n)) => {
                    return Err(cx.err(n, "give `gpus_per_leaf` or `nodes_per_leaf`, not both"))
                }
                (None, None) => {
                    return Err(cx.err(
                        &raw.topology,
                        "leaf-spine needs `gpus_per_leaf` or `nodes_per_leaf`",
                    ))
                }
            };
            let uplinks = opt(&t.uplinks, "uplinks", 1)?;
            let d = Declared::nodes(leaves as u64 * npl as u64, gpn);
            let fabric_links = (leaves as u64 * spines as u64).saturating_mul(uplinks as u64);
            d.plus(
                leaves as u64 + spines as u64,
                d.hosts.saturating_add(fabric_links),
            )
            .check(cx, &raw.topology, kind.name())?;
            generate::leaf_spine(b, leaves, spines, npl, gpn, uplinks)
        }
        Kind::FatTree => {
            let k = need(&t.k, "k", 2, 1024)?;
            let kv = t.k.as_ref().expect("checked by need");
            if k % 2 != 0 {
                return Err(cx.err(kv, format!("fat-tree `k` = {k} must be even")));
            }
            if (k / 2) % gpn != 0 {
                return Err(cx.err(
                    kv,
                    format!("fat-tree leaves have k/2 = {} GPU ports, not a multiple of gpus_per_node = {gpn}", k / 2),
                ));
            }
            let k64 = k as u64;
            let hosts = k64 * k64 * k64 / 4;
            if hosts > MAX_GPUS {
                return Err(cx.err(
                    kv,
                    format!("fat-tree k = {k} has {hosts} GPUs; closbox models at most {MAX_GPUS} (k ≤ 64)"),
                ));
            }
            let d = Declared::nodes(hosts / gpn as u64, gpn);
            d.plus(5 * k64 * k64 / 4, hosts + k64 * k64 * k64 / 2)
                .check(cx, &raw.topology, kind.name())?;
            generate::fat_tree(b, k, gpn)
        }
        Kind::RailOptimized => {
            if gpn < 2 {
                return Err(cx.err(
                    &raw.topology,
                    "rail-optimized needs [node] gpus_per_node ≥ 2 (one rail per GPU of a node)",
                ));
            }
            let nodes = need(&t.nodes, "nodes", 1, 65_536)?;
            let spines = need(&t.spines, "spines", 1, 65_536)?;
            let uplinks = opt(&t.uplinks, "uplinks", 1)?;
            let d = Declared::nodes(nodes as u64, gpn);
            let fabric_links = (gpn as u64 * spines as u64).saturating_mul(uplinks as u64);
            d.plus(
                gpn as u64 + spines as u64,
                d.hosts.saturating_add(fabric_links),
            )
            .check(cx, &raw.topology, kind.name())?;
            let shape = Shape::RailOptimized {
                rails: gpn,
                spines,
                uplinks,
            };
            generate::rail_optimized(b, nodes, gpn, spines, uplinks, shape)
        }
        Kind::SuperpodSu => {
            let want = generate::SUPERPOD_SU.1;
            if let Some(g) = raw.node.as_ref().and_then(|n| n.gpus_per_node.as_ref()) {
                if *g.get_ref() != want as i64 {
                    return Err(cx.err(g, format!("superpod-su nodes have {want} GPUs")));
                }
            }
            generate::superpod_su(b)
        }
        Kind::Custom => super::custom::custom(cx, raw, b)?,
    };
    Ok(topo)
}
