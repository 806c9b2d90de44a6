//! Custom graphs: `[[host]]`, `[[switch]]`, `[[link]]` as given, with names checked,
//! node membership inferred, and every pair of GPUs reachable without GPU transit.

use toml::Spanned;

use super::raw::*;
use super::shapes::Declared;
use super::*;
use crate::generate::Builder;
use crate::topology::{LinkClass, Shape, Tier, Topology, Vertex};

pub(super) fn custom(cx: &Cx, raw: &RawFile, mut b: Builder) -> Result<Topology, ConfigError> {
    use std::collections::BTreeMap;
    if let Some(g) = raw.node.as_ref().and_then(|n| n.gpus_per_node.as_ref()) {
        return Err(cx.err(
            g,
            "custom topologies form nodes from their links to \"node\"-tier switches; drop `gpus_per_node`",
        ));
    }
    if raw.host_list.is_empty() {
        return Err(cx.err(
            &raw.topology,
            "a custom topology needs at least one [[host]]",
        ));
    }
    let links = raw
        .link_list
        .iter()
        .map(|l| {
            l.get_ref()
                .count
                .as_ref()
                .map_or(1, |c| (*c.get_ref()).clamp(1, 1024) as u64)
        })
        .fold(0u64, u64::saturating_add);
    Declared {
        hosts: raw.host_list.len() as u64,
        switches: raw.switch_list.len() as u64,
        links,
    }
    .check(cx, &raw.topology, super::shapes::Kind::Custom.name())?;
    let mut names: BTreeMap<&str, Vertex> = BTreeMap::new();
    let check_name = |names: &BTreeMap<&str, Vertex>, n: &Spanned<String>| {
        let s = n.get_ref();
        crate::names::check_host_name(s).map_err(|e| cx.err(n, e))?;
        if names.contains_key(s.as_str()) {
            return Err(cx.err(n, format!("duplicate name {s:?}")));
        }
        Ok(())
    };
    // Hosts first so that their addresses follow file order; node membership is settled
    // after the links are known.
    let mut host_ids = Vec::new();
    for h in &raw.host_list {
        let n = &h.get_ref().name;
        check_name(&names, n)?;
        let id = b.host(n.get_ref().clone(), 0, 0);
        names.insert(n.get_ref(), Vertex::Host(id));
        host_ids.push(id);
    }
    let mut tiers = Vec::new();
    for s in &raw.switch_list {
        let s = s.get_ref();
        check_name(&names, &s.name)?;
        let tier = Tier::from_name(s.tier.get_ref()).ok_or_else(|| {
            cx.err(
                &s.tier,
                format!(
                    "unknown tier {:?}; expected \"node\", \"leaf\", \"spine\" or \"core\"",
                    s.tier.get_ref()
                ),
            )
        })?;
        let id = b.switch(s.name.get_ref().clone(), tier);
        names.insert(s.name.get_ref(), Vertex::Switch(id));
        tiers.push(tier);
    }
    let tier_of = |v: Vertex| match v {
        Vertex::Host(_) => None,
        Vertex::Switch(s) => Some(tiers[s.0 as usize]),
    };
    let mut node_of: Vec<Option<(u32, &Spanned<RawLink>)>> = vec![None; host_ids.len()];
    let mut linked = vec![false; tiers.len()];
    for l in &raw.link_list {
        let r = l.get_ref();
        let end = |n: &Spanned<String>| {
            names.get(n.get_ref().as_str()).copied().ok_or_else(|| {
                cx.err(
                    n,
                    format!("link end {:?} is not a [[host]] or [[switch]]", n.get_ref()),
                )
            })
        };
        let (a, b_end) = (end(&r.a)?, end(&r.b)?);
        if a == b_end {
            return Err(cx.err(l, format!("link from {:?} to itself", r.a.get_ref())));
        }
        for v in [a, b_end] {
            if let Vertex::Switch(s) = v {
                linked[s.0 as usize] = true;
            }
        }
        let inferred = match (tier_of(a), tier_of(b_end)) {
            (None, Some(Tier::Node)) | (Some(Tier::Node), None) => Some(LinkClass::Nvlink),
            (None, _) | (_, None) => Some(LinkClass::Nic),
            (Some(Tier::Leaf), Some(Tier::Spine)) | (Some(Tier::Spine), Some(Tier::Leaf)) => {
                Some(LinkClass::LeafSpine)
            }
            (Some(Tier::Spine), Some(Tier::Core)) | (Some(Tier::Core), Some(Tier::Spine)) => {
                Some(LinkClass::SpineCore)
            }
            _ => None,
        };
        let node_tier =
            matches!(tier_of(a), Some(Tier::Node)) || matches!(tier_of(b_end), Some(Tier::Node));
        let class = match &r.class {
            Some(c) => {
                let class = LinkClass::from_name(c.get_ref()).ok_or_else(|| {
                    cx.err(c, format!("unknown link class {:?}; expected \"nvlink\", \"nic\", \"leaf-spine\" or \"spine-core\"", c.get_ref()))
                })?;
                if (class == LinkClass::Nvlink) != (inferred == Some(LinkClass::Nvlink)) {
                    return Err(cx.err(c, "class \"nvlink\" is for links, and the only links, between a host and a \"node\"-tier switch"));
                }
                class
            }
            None => inferred.ok_or_else(|| {
                cx.err(
                    l,
                    format!(
                        "cannot infer the class of a link between {:?} and {:?}; set `class`",
                        r.a.get_ref(),
                        r.b.get_ref()
                    ),
                )
            })?,
        };
        if node_tier && class != LinkClass::Nvlink {
            return Err(cx.err(l, "a \"node\"-tier switch links only to its GPUs"));
        }
        let params = link_params(
            cx,
            r.rate,
            &r.delay,
            (&r.loss, &r.loss_burst),
            b.settings().link(class),
        )?;
        let times = r
            .count
            .as_ref()
            .map_or(Ok(1), |c| count(cx, c, "count", 1, 1024))?;
        for _ in 0..times {
            b.link_with(a, b_end, class, params);
        }
        if class == LinkClass::Nvlink {
            let ((Vertex::Host(h), Vertex::Switch(s)) | (Vertex::Switch(s), Vertex::Host(h))) =
                (a, b_end)
            else {
                unreachable!("nvlink class checked above")
            };
            match node_of[h.0 as usize] {
                Some((other, _)) if other != s.0 => {
                    return Err(cx.err(
                        l,
                        format!(
                            "host {:?} is linked to two node switches",
                            names_of(raw, h.0)
                        ),
                    ))
                }
                _ => node_of[h.0 as usize] = Some((s.0, l)),
            }
        }
    }
    // A switch no link reaches carries nothing, and links cannot be added to a running
    // fabric: a name misspelt in a [[link]], most likely.
    if let Some(i) = linked.iter().position(|l| !l) {
        let name = &raw.switch_list[i].get_ref().name;
        return Err(cx.err(
            name,
            format!(
                "switch {:?} has no links (is a [[link]] end misspelt?); link it or remove it",
                name.get_ref()
            ),
        ));
    }
    let mut topo = b.finish(Shape::Custom);
    // Number nodes: one per node switch in use, then one per host without a node switch.
    let mut node_index: BTreeMap<u32, (u32, u32)> = BTreeMap::new(); // switch -> (node, next local)
    let mut next_node = 0;
    for (i, n) in node_of.iter().enumerate() {
        let (node, local) = match n {
            Some((sw, _)) => {
                let e = node_index.entry(*sw).or_insert_with(|| {
                    next_node += 1;
                    (next_node - 1, 0)
                });
                e.1 += 1;
                (e.0, e.1 - 1)
            }
            None => {
                next_node += 1;
                (next_node - 1, 0)
            }
        };
        topo.hosts[i].node = node;
        topo.hosts[i].local_rank = local;
    }
    check_connected(cx, raw, &topo)?;
    Ok(topo)
}

pub(super) fn names_of(raw: &RawFile, host: u32) -> String {
    raw.host_list[host as usize]
        .get_ref()
        .name
        .get_ref()
        .clone()
}

/// Every pair of GPUs must be able to reach each other: through their node switch when in
/// one node, else over scale-out links through switches, or over a direct link. GPUs
/// never forward for others, so a GPU reachable only through another GPU is an error.
pub(super) fn check_connected(cx: &Cx, raw: &RawFile, topo: &Topology) -> Result<(), ConfigError> {
    use std::collections::{BTreeMap, BTreeSet};
    const PAIRWISE_LIMIT: usize = 2048;
    let h = topo.hosts.len();
    if h < 2 {
        return Ok(());
    }
    let mut parent: Vec<usize> = (0..topo.switches.len()).collect();
    fn find(p: &mut [usize], mut x: usize) -> usize {
        while p[x] != x {
            p[x] = p[p[x]];
            x = p[x];
        }
        x
    }
    let scale_out_switch = |v: Vertex| match v {
        Vertex::Switch(s) if topo.switch(s).tier != Tier::Node => Some(s.0 as usize),
        _ => None,
    };
    let scale_out = topo.links.iter().filter(|l| l.class != LinkClass::Nvlink);
    for l in scale_out.clone() {
        if let (Some(a), Some(b)) = (scale_out_switch(l.a), scale_out_switch(l.b)) {
            let (a, b) = (find(&mut parent, a), find(&mut parent, b));
            parent[a] = b;
        }
    }
    // Per host: the switch components it attaches to; and direct host-host links.
    let mut comps: Vec<BTreeSet<usize>> = vec![BTreeSet::new(); h];
    let mut direct: BTreeSet<(usize, usize)> = BTreeSet::new();
    for l in scale_out {
        match (l.a, l.b) {
            (Vertex::Host(x), Vertex::Host(y)) => {
                direct.insert((x.0.min(y.0) as usize, x.0.max(y.0) as usize));
            }
            (Vertex::Host(x), s) | (s, Vertex::Host(x)) => {
                if let Some(s) = scale_out_switch(s) {
                    let c = find(&mut parent, s);
                    comps[x.0 as usize].insert(c);
                }
            }
            _ => {}
        }
    }
    let mut touched: BTreeMap<usize, usize> = BTreeMap::new();
    for c in comps.iter().flatten() {
        *touched.entry(*c).or_default() += 1;
    }
    if touched.values().any(|&n| n == h) {
        return Ok(());
    }
    let unreachable = |i: usize, j: usize| {
        cx.err(
            &raw.host_list[j],
            format!(
                "host {:?} cannot reach host {:?}: no path over scale-out links through switches, nor a direct link (GPUs do not forward for others)",
                topo.hosts[j].name, topo.hosts[i].name
            ),
        )
    };
    if h > PAIRWISE_LIMIT {
        // Too many for a pairwise check: ask for the common case, one switch fabric.
        let lonely = (0..h).find(|&i| comps[i].is_empty()).unwrap_or(h - 1);
        return Err(cx.err(
            &raw.host_list[lonely],
            format!(
                "with more than {PAIRWISE_LIMIT} hosts, every host must attach to one connected switch fabric; host {:?} does not",
                topo.hosts[lonely].name
            ),
        ));
    }
    for j in 1..h {
        for i in 0..j {
            // Hosts without a node switch each have a node of their own.
            let same_node = topo.hosts[i].node == topo.hosts[j].node;
            if same_node
                || direct.contains(&(i, j))
                || comps[i].intersection(&comps[j]).next().is_some()
            {
                continue;
            }
            return Err(unreachable(i, j));
        }
    }
    Ok(())
}
