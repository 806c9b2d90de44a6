//! Topology generators: single switch, full mesh, leaf-spine, 3-tier fat-tree,
//! rail-optimized and the SuperPOD scalable-unit preset.
//!
//! Generators only place GPUs, switches and links with the settings they are given; shape
//! checks that depend on the file (which key was wrong, where) live in `config`.

use crate::topology::{
    FabricParams, Host, HostId, Link, LinkClass, LinkParams, Shape, Switch, SwitchId, SwitchParams,
    Tier, Topology, Vertex,
};

/// Per-class link settings and per-tier switch settings a generator applies.
#[derive(Clone, Copy, Debug)]
pub struct Settings {
    pub links: [LinkParams; 4],
    pub tiers: [SwitchParams; 4],
}

impl Settings {
    pub fn link(&self, class: LinkClass) -> LinkParams {
        self.links[class as usize]
    }

    pub fn tier(&self, tier: Tier) -> SwitchParams {
        self.tiers[tier as usize]
    }
}

/// Places vertices and links; hosts get consecutive pool addresses in creation order.
#[derive(Debug)]
pub struct Builder {
    fabric: FabricParams,
    settings: Settings,
    hosts: Vec<Host>,
    switches: Vec<Switch>,
    links: Vec<Link>,
    nodes: u32,
}

impl Builder {
    pub fn new(fabric: FabricParams, settings: Settings) -> Self {
        Builder {
            fabric,
            settings,
            hosts: Vec::new(),
            switches: Vec::new(),
            links: Vec::new(),
            nodes: 0,
        }
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// Adds one node of `gpus` GPUs; with more than one GPU, also its scale-up switch
    /// `node<n>` and one nvlink per GPU. GPUs are named `gpu<i>` by global index.
    pub fn node(&mut self, gpus: u32) -> Vec<HostId> {
        let n = self.nodes;
        self.nodes += 1;
        let ids: Vec<HostId> = (0..gpus)
            .map(|local| self.host(format!("gpu{}", self.hosts.len()), n, local))
            .collect();
        if gpus > 1 {
            let sw = self.switch(format!("node{n}"), Tier::Node);
            for &h in &ids {
                self.link(Vertex::Host(h), Vertex::Switch(sw), LinkClass::Nvlink);
            }
        }
        ids
    }

    pub fn host(&mut self, name: String, node: u32, local_rank: u32) -> HostId {
        let id = HostId(self.hosts.len() as u32);
        let addr = self.fabric.pool.host(id.0);
        self.hosts.push(Host {
            name,
            addr,
            node,
            local_rank,
        });
        self.nodes = self.nodes.max(node + 1);
        id
    }

    pub fn switch(&mut self, name: String, tier: Tier) -> SwitchId {
        let id = SwitchId(self.switches.len() as u32);
        self.switches.push(Switch {
            name,
            tier,
            params: self.settings.tier(tier),
        });
        id
    }

    pub fn link(&mut self, a: Vertex, b: Vertex, class: LinkClass) {
        let params = self.settings.link(class);
        self.link_with(a, b, class, params);
    }

    pub fn link_with(&mut self, a: Vertex, b: Vertex, class: LinkClass, params: LinkParams) {
        self.links.push(Link {
            a,
            b,
            class,
            params,
        });
    }

    pub fn finish(self, shape: Shape) -> Topology {
        Topology {
            fabric: self.fabric,
            shape,
            hosts: self.hosts,
            switches: self.switches,
            links: self.links,
        }
    }
}

fn nodes(b: &mut Builder, count: u32, gpus_per_node: u32) -> Vec<Vec<HostId>> {
    (0..count).map(|_| b.node(gpus_per_node)).collect()
}

/// All GPUs on one leaf-tier switch `sw0`.
pub fn single_switch(mut b: Builder, node_count: u32, gpus_per_node: u32) -> Topology {
    let all = nodes(&mut b, node_count, gpus_per_node);
    let sw = b.switch("sw0".into(), Tier::Leaf);
    for h in all.into_iter().flatten() {
        b.link(Vertex::Host(h), Vertex::Switch(sw), LinkClass::Nic);
    }
    b.finish(Shape::SingleSwitch)
}

/// A NIC link between every pair of GPUs (and nvlinks inside nodes).
pub fn full_mesh(mut b: Builder, node_count: u32, gpus_per_node: u32) -> Topology {
    let all: Vec<HostId> = nodes(&mut b, node_count, gpus_per_node)
        .into_iter()
        .flatten()
        .collect();
    for (i, &x) in all.iter().enumerate() {
        for &y in &all[i + 1..] {
            b.link(Vertex::Host(x), Vertex::Host(y), LinkClass::Nic);
        }
    }
    b.finish(Shape::FullMesh)
}

/// Two-tier Clos: `nodes_per_leaf` whole nodes under each leaf, every leaf linked to every
/// spine by `uplinks` parallel links.
pub fn leaf_spine(
    mut b: Builder,
    leaves: u32,
    spines: u32,
    nodes_per_leaf: u32,
    gpus_per_node: u32,
    uplinks: u32,
) -> Topology {
    let groups = nodes(&mut b, leaves * nodes_per_leaf, gpus_per_node);
    let spine_ids: Vec<SwitchId> = (0..spines)
        .map(|s| b.switch(format!("spine{s}"), Tier::Spine))
        .collect();
    for l in 0..leaves {
        let leaf = b.switch(format!("leaf{l}"), Tier::Leaf);
        let under = &groups[(l * nodes_per_leaf) as usize..((l + 1) * nodes_per_leaf) as usize];
        for &h in under.iter().flatten() {
            b.link(Vertex::Host(h), Vertex::Switch(leaf), LinkClass::Nic);
        }
        for &s in &spine_ids {
            for _ in 0..uplinks {
                b.link(
                    Vertex::Switch(leaf),
                    Vertex::Switch(s),
                    LinkClass::LeafSpine,
                );
            }
        }
    }
    b.finish(Shape::LeafSpine {
        leaves,
        spines,
        uplinks,
    })
}

/// Three-tier k-ary fat-tree (Al-Fares et al.): k pods of k/2 leaf (edge) and k/2 spine
/// (aggregation) switches, (k/2)² core switches, k³/4 GPUs. Spine `a` of every pod links
/// to cores `a·k/2 … a·k/2 + k/2 − 1`.
pub fn fat_tree(mut b: Builder, k: u32, gpus_per_node: u32) -> Topology {
    let half = k / 2;
    let per_leaf_nodes = half / gpus_per_node;
    let cores: Vec<SwitchId> = (0..half * half)
        .map(|c| b.switch(format!("core{c}"), Tier::Core))
        .collect();
    for p in 0..k {
        let aggs: Vec<SwitchId> = (0..half)
            .map(|a| b.switch(format!("spine{}", p * half + a), Tier::Spine))
            .collect();
        for e in 0..half {
            let groups = nodes(&mut b, per_leaf_nodes, gpus_per_node);
            let leaf = b.switch(format!("leaf{}", p * half + e), Tier::Leaf);
            for &h in groups.iter().flatten() {
                b.link(Vertex::Host(h), Vertex::Switch(leaf), LinkClass::Nic);
            }
            for &a in &aggs {
                b.link(
                    Vertex::Switch(leaf),
                    Vertex::Switch(a),
                    LinkClass::LeafSpine,
                );
            }
        }
        for (a, &agg) in aggs.iter().enumerate() {
            for c in 0..half {
                let core = cores[a * half as usize + c as usize];
                b.link(
                    Vertex::Switch(agg),
                    Vertex::Switch(core),
                    LinkClass::SpineCore,
                );
            }
        }
    }
    b.finish(Shape::FatTree { k })
}

/// Rail-optimized: one leaf ("rail") per GPU index; GPU i of every node on rail i; every
/// rail linked to every spine by `uplinks` parallel links.
pub fn rail_optimized(
    mut b: Builder,
    node_count: u32,
    gpus_per_node: u32,
    spines: u32,
    uplinks: u32,
    shape: Shape,
) -> Topology {
    let groups = nodes(&mut b, node_count, gpus_per_node);
    let spine_ids: Vec<SwitchId> = (0..spines)
        .map(|s| b.switch(format!("spine{s}"), Tier::Spine))
        .collect();
    for r in 0..gpus_per_node {
        let rail = b.switch(format!("leaf{r}"), Tier::Leaf);
        for g in &groups {
            b.link(
                Vertex::Host(g[r as usize]),
                Vertex::Switch(rail),
                LinkClass::Nic,
            );
        }
        for &s in &spine_ids {
            for _ in 0..uplinks {
                b.link(
                    Vertex::Switch(rail),
                    Vertex::Switch(s),
                    LinkClass::LeafSpine,
                );
            }
        }
    }
    b.finish(shape)
}

/// NVIDIA SuperPOD scalable unit as closbox models it: 32 nodes × 8 GPUs, rail-optimized
/// onto 8 leaves, each leaf with 32 uplinks spread over 4 spines (8 each): 1:1.
pub const SUPERPOD_SU: (u32, u32, u32, u32) = (32, 8, 4, 8);

pub fn superpod_su(b: Builder) -> Topology {
    let (nodes, gpus, spines, uplinks) = SUPERPOD_SU;
    rail_optimized(b, nodes, gpus, spines, uplinks, Shape::SuperpodSu)
}
