//! Ports and forwarding tables: shortest paths with equal-cost groups.
//!
//! Every link gives two egress ports (one per direction). For each vertex and destination
//! GPU the table holds the ports on a shortest path. Scale-up ("node") switches carry only
//! traffic between the GPUs of their node, and GPUs never forward for others; so traffic
//! between GPUs of one node takes the node switch, and all other traffic the scale-out
//! fabric. Choosing among the group (ECMP, spray, adaptive) is the model's business.

use std::collections::VecDeque;

use crate::topology::{HostId, LinkClass, Tier, Topology, Vertex};
use crate::units::Duration;

/// Index of an egress port: link `i` gives port `2i` (a→b) and `2i + 1` (b→a).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PortId(pub u32);

/// Dense vertex index: hosts `0..H`, then switches.
pub type VertexIdx = u32;

/// Forwarding latency of vertex `v` (GPUs first, then switches): a switch's configured
/// latency, nothing for a GPU.
pub fn vertex_latency(topo: &Topology, v: VertexIdx) -> Duration {
    let h = topo.hosts.len() as u32;
    if v < h {
        Duration::ZERO
    } else {
        topo.switches[(v - h) as usize].params.latency
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortEnds {
    pub from: VertexIdx,
    pub to: VertexIdx,
    pub link: u32,
}

/// Egress ports of a topology and, per vertex, its ports.
#[derive(Clone, Debug)]
pub struct PortGraph {
    pub ports: Vec<PortEnds>,
    pub out: Vec<Vec<PortId>>,
}

impl PortGraph {
    pub fn new(topo: &Topology) -> PortGraph {
        let h = topo.hosts.len() as u32;
        let vidx = |v: Vertex| match v {
            Vertex::Host(x) => x.0,
            Vertex::Switch(s) => h + s.0,
        };
        let mut ports = Vec::with_capacity(topo.links.len() * 2);
        let mut out = vec![Vec::new(); h as usize + topo.switches.len()];
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
        PortGraph { ports, out }
    }

    /// Links on a shortest path from GPU `src` to every GPU (`u32::MAX` if unreachable),
    /// by the fabric's rules: through the node switch within a node, else scale-out.
    pub fn hops_from(&self, topo: &Topology, src: HostId) -> Vec<u32> {
        let h = topo.hosts.len() as u32;
        let is_node_switch = |v: u32| v >= h && topo.switches[(v - h) as usize].tier == Tier::Node;
        let nvlink = |p: PortId| {
            topo.links[self.ports[p.0 as usize].link as usize].class == LinkClass::Nvlink
        };
        let mut dist = vec![u32::MAX; self.out.len()];
        let mut queue = VecDeque::new();
        scale_out_bfs(
            &self.out,
            &self.ports,
            src.0,
            &mut dist,
            &mut queue,
            |v| v < h && v != src.0,
            |p, u| nvlink(p) || is_node_switch(u),
        );
        let has_nvlink = self.out[src.0 as usize].iter().any(|&p| nvlink(p));
        let node = topo.hosts[src.0 as usize].node;
        dist.truncate(h as usize);
        for (d, host) in dist.iter_mut().zip(&topo.hosts) {
            if has_nvlink && host.node == node && *d != 0 {
                *d = 2;
            }
        }
        dist
    }
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
        Routes::over_live_links(topo, |_| true)
    }

    /// Shortest paths over the links for which `alive(link index)` holds: what a fabric
    /// converges to after failures.
    pub fn over_live_links(topo: &Topology, alive: impl Fn(u32) -> bool) -> Routes {
        let h = topo.hosts.len() as u32;
        let n = h as usize + topo.switches.len();
        let PortGraph { ports, out } = PortGraph::new(topo);
        let is_node_switch = |v: u32| v >= h && topo.switches[(v - h) as usize].tier == Tier::Node;
        let nvlink =
            |p: PortId| topo.links[ports[p.0 as usize].link as usize].class == LinkClass::Nvlink;

        let mut table = vec![(0, 0); n * h as usize];
        let mut groups = Vec::new();
        let mut dist_all = vec![u32::MAX; n * h as usize];
        let mut dist = vec![u32::MAX; n];
        let mut queue = VecDeque::new();
        for d in 0..h {
            scale_out_bfs(
                &out,
                &ports,
                d,
                &mut dist,
                &mut queue,
                |v| v < h && v != d,
                |p, u| nvlink(p) || is_node_switch(u) || !alive(ports[p.0 as usize].link),
            );
            let d_node = topo.hosts[d as usize].node;
            for v in 0..n as u32 {
                let start = groups.len() as u32;
                let mut best = dist[v as usize];
                let same_node = v < h && v != d && topo.hosts[v as usize].node == d_node;
                let live = |p: PortId| alive(ports[p.0 as usize].link);
                if same_node && out[v as usize].iter().any(|&p| nvlink(p) && live(p)) {
                    groups.extend(
                        out[v as usize]
                            .iter()
                            .copied()
                            .filter(|&p| nvlink(p) && live(p)),
                    );
                    best = 2;
                } else if is_node_switch(v) {
                    let direct = out[v as usize]
                        .iter()
                        .copied()
                        .filter(|&p| ports[p.0 as usize].to == d && live(p));
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
                        live(p) && !nvlink(p) && dist[u as usize] == dv - 1 && (u >= h || u == d)
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

/// Breadth-first distances (in links) from `start` over the scale-out fabric: vertices for
/// which `stop` holds are reached but not expanded (GPUs do not forward), ports for which
/// `skip(port, to)` holds are not taken (nvlinks, node switches).
pub(crate) fn scale_out_bfs(
    out: &[Vec<PortId>],
    ports: &[PortEnds],
    start: VertexIdx,
    dist: &mut [u32],
    queue: &mut VecDeque<VertexIdx>,
    stop: impl Fn(VertexIdx) -> bool,
    skip: impl Fn(PortId, VertexIdx) -> bool,
) {
    dist.fill(u32::MAX);
    dist[start as usize] = 0;
    queue.clear();
    queue.push_back(start);
    while let Some(v) = queue.pop_front() {
        if stop(v) {
            continue;
        }
        for &p in &out[v as usize] {
            let u = ports[p.0 as usize].to;
            if dist[u as usize] == u32::MAX && !skip(p, u) {
                dist[u as usize] = dist[v as usize] + 1;
                queue.push_back(u);
            }
        }
    }
}
