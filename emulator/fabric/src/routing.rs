//! Ports and forwarding tables: shortest paths with equal-cost groups.
//!
//! Every link gives two egress ports (one per direction). For each vertex and destination
//! GPU the table holds the ports on a shortest path. Scale-up ("node") switches carry only
//! traffic between the GPUs of their node, and GPUs never forward for others; so traffic
//! between GPUs of one node takes the node switch, and all other traffic the scale-out
//! fabric. Choosing among the group (ECMP, spray, adaptive) is the model's business.

use std::collections::VecDeque;

use crate::topology::{HostId, LinkClass, Tier, Topology, Vertex};

/// Index of an egress port: link `i` gives port `2i` (a→b) and `2i + 1` (b→a).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PortId(pub u32);

/// Dense vertex index: hosts `0..H`, then switches.
pub type VertexIdx = u32;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortEnds {
    pub from: VertexIdx,
    pub to: VertexIdx,
    pub link: u32,
}

#[derive(Clone, Debug)]
pub struct Routes {
    hosts: u32,
    pub ports: Vec<PortEnds>,
    /// Per vertex: its egress ports.
    pub out: Vec<Vec<PortId>>,
    /// Per (vertex, destination host): range into `groups`.
    table: Vec<(u32, u32)>,
    groups: Vec<PortId>,
    /// Per (vertex, destination host): links on the path; `u32::MAX` when unreachable.
    dist: Vec<u32>,
}

impl Routes {
    pub fn new(topo: &Topology) -> Routes {
        let h = topo.hosts.len() as u32;
        let n = h as usize + topo.switches.len();
        let vidx = |v: Vertex| match v {
            Vertex::Host(x) => x.0,
            Vertex::Switch(s) => h + s.0,
        };
        let mut ports = Vec::with_capacity(topo.links.len() * 2);
        let mut out = vec![Vec::new(); n];
        for (i, l) in topo.links.iter().enumerate() {
            let (a, b) = (vidx(l.a), vidx(l.b));
            for (from, to) in [(a, b), (b, a)] {
                out[from as usize].push(PortId(ports.len() as u32));
                ports.push(PortEnds {
                    from,
                    to,
                    link: i as u32,
                });
            }
        }
        let is_node_switch = |v: u32| v >= h && topo.switches[(v - h) as usize].tier == Tier::Node;
        let nvlink =
            |p: PortId| topo.links[ports[p.0 as usize].link as usize].class == LinkClass::Nvlink;

        let mut table = vec![(0, 0); n * h as usize];
        let mut groups = Vec::new();
        let mut dist_all = vec![u32::MAX; n * h as usize];
        let mut dist = vec![u32::MAX; n];
        let mut queue = VecDeque::new();
        for d in 0..h {
            // Reverse BFS from d over scale-out links; hosts other than d are not expanded.
            dist.fill(u32::MAX);
            dist[d as usize] = 0;
            queue.push_back(d);
            while let Some(v) = queue.pop_front() {
                if v < h && v != d {
                    continue;
                }
                for &p in &out[v as usize] {
                    if nvlink(p) {
                        continue;
                    }
                    let u = ports[p.0 as usize].to;
                    if dist[u as usize] == u32::MAX && !is_node_switch(u) {
                        dist[u as usize] = dist[v as usize] + 1;
                        queue.push_back(u);
                    }
                }
            }
            let d_node = topo.hosts[d as usize].node;
            for v in 0..n as u32 {
                let start = groups.len() as u32;
                let mut best = dist[v as usize];
                let same_node = v < h && v != d && topo.hosts[v as usize].node == d_node;
                if same_node && out[v as usize].iter().any(|&p| nvlink(p)) {
                    groups.extend(out[v as usize].iter().copied().filter(|&p| nvlink(p)));
                    best = 2;
                } else if is_node_switch(v) {
                    let direct = out[v as usize]
                        .iter()
                        .copied()
                        .filter(|&p| ports[p.0 as usize].to == d);
                    groups.extend(direct);
                    best = if groups.len() as u32 > start {
                        1
                    } else {
                        u32::MAX
                    };
                } else if v != d && dist[v as usize] != u32::MAX {
                    let dv = dist[v as usize];
                    groups.extend(out[v as usize].iter().copied().filter(|&p| {
                        let u = ports[p.0 as usize].to;
                        !nvlink(p) && dist[u as usize] == dv - 1 && (u >= h || u == d)
                    }));
                }
                let i = v as usize * h as usize + d as usize;
                table[i] = (start, groups.len() as u32 - start);
                dist_all[i] = if v == d { 0 } else { best };
            }
        }
        Routes {
            hosts: h,
            ports,
            out,
            table,
            groups,
            dist: dist_all,
        }
    }

    /// Equal-cost egress ports from `v` toward `dst`; empty if unreachable or `v == dst`.
    #[inline]
    pub fn next_hops(&self, v: VertexIdx, dst: HostId) -> &[PortId] {
        let (s, len) = self.table[v as usize * self.hosts as usize + dst.0 as usize];
        &self.groups[s as usize..(s + len) as usize]
    }

    /// Links on a shortest path from host `a` to host `b` (`None` if unreachable).
    pub fn hops(&self, a: HostId, b: HostId) -> Option<u32> {
        let d = self.dist[a.0 as usize * self.hosts as usize + b.0 as usize];
        (d != u32::MAX).then_some(d)
    }

    pub fn port(&self, p: PortId) -> PortEnds {
        self.ports[p.0 as usize]
    }
}
