//! Changes to a running fabric, by name: what `closbox link|switch|gpu …` ask the daemon
//! for, resolved against the topology into the model's `Change`s, and the event log of
//! what was applied when.

use serde::{Deserialize, Serialize};

use closbox_fabric::load::{LoadSpec, Pattern};
use closbox_fabric::model::{Change, Directions};
use closbox_fabric::topology::{LinkClass, Topology, Vertex};
use closbox_fabric::{Bandwidth, Bytes, Duration};

/// How a `link reset` is logged; a scenario's reset of a link set by hand says instead
/// `RESET_TO_HAND` (`DataPlane::apply`).
pub const RESET_TO_TOPOLOGY: &str = "reset to the topology's values";
/// A scenario's reset of a link whose values were set by hand: back to those.
pub const RESET_TO_HAND: &str = "reset to the values set by hand";

/// A change, as a client names it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "change", rename_all = "kebab-case")]
pub enum ChangeRequest {
    /// All parallel links between `a` and `b`, or the `index`-th (from 0).
    LinkDown {
        a: String,
        b: String,
        index: Option<u32>,
    },
    LinkUp {
        a: String,
        b: String,
        index: Option<u32>,
    },
    LinkSet {
        a: String,
        b: String,
        index: Option<u32>,
        rate_bps: Option<u64>,
        delay_ns: Option<u64>,
        loss: Option<f64>,
        /// Mean frames per run of losses (1: independent losses).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        loss_burst: Option<f64>,
        buffer_bytes: Option<u64>,
        /// Only the direction leaving this end (`a` or `b`); both when absent.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        from: Option<String>,
    },
    LinkReset {
        a: String,
        b: String,
        index: Option<u32>,
    },
    /// Every link of a switch (a dead leaf or spine), or of a GPU (its NIC and scale-up
    /// link: a dead host port).
    SwitchDown {
        name: String,
    },
    SwitchUp {
        name: String,
    },
    GpuDown {
        name: String,
    },
    GpuUp {
        name: String,
    },
    /// The link(s) go down for `down_ns`, come back for `up_ns`, `count` times.
    LinkFlap {
        a: String,
        b: String,
        index: Option<u32>,
        down_ns: u64,
        up_ns: u64,
        count: u32,
    },
    /// Every link of a switch (a leaf or spine that reboots), or of a GPU (`gpu: true`),
    /// down for `down_ns`, back for `up_ns`, `count` times.
    SwitchFlap {
        name: String,
        #[serde(default)]
        gpu: bool,
        down_ns: u64,
        up_ns: u64,
        count: u32,
    },
    /// GPUs in different groups cannot reach each other; GPUs in no group form one more.
    Partition {
        groups: Vec<Vec<String>>,
    },
    Heal,
    /// Synthetic traffic from `from` to `to` (GPU or switch names) at `rate_bps` on the
    /// wire, inside the model: it takes buffer space and link time on its way.
    Load {
        from: String,
        to: String,
        rate_bps: u64,
        /// IP bytes per packet (default: the fabric's mtu).
        packet_bytes: Option<u32>,
        /// It stops after this long (default: when stopped).
        for_ns: Option<u64>,
        /// Sends for `on_ns`, pauses for `off_ns`, again (both or neither).
        on_ns: Option<u64>,
        off_ns: Option<u64>,
    },
    /// Stops load `id`, or every load.
    LoadStop {
        id: Option<u32>,
    },
    /// The whole fabric back to its topology: every timeline cancelled (its pending
    /// changes and flaps dropped, nothing repaired one by one), every load stopped, the
    /// partition healed, every link up at the topology's values (those set by hand
    /// forgotten), as one event.
    Reset,
    /// Every GPU of `from` sends `bytes` to GPU `to` at its link's rate, `count` times,
    /// `every_ns` apart: synthetic bursts converging on `to`'s port.
    Incast {
        to: String,
        from: Vec<String>,
        bytes: u64,
        every_ns: Option<u64>,
        count: u32,
    },
}

impl ChangeRequest {
    /// Fabric ns from a request's start to the last change it schedules: a flap's last
    /// return (`(count − 1) × (down + up) + down`); 0 for what applies at once.
    pub fn span_ns(&self) -> u64 {
        match self {
            ChangeRequest::LinkFlap {
                down_ns,
                up_ns,
                count,
                ..
            }
            | ChangeRequest::SwitchFlap {
                down_ns,
                up_ns,
                count,
                ..
            } => down_ns
                .saturating_add(*up_ns)
                .saturating_mul(u64::from(count.saturating_sub(1)))
                .saturating_add(*down_ns),
            _ => 0,
        }
    }
}

/// What was applied, when.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// Fabric time, ns since the fabric came up.
    pub fabric_ns: u64,
    /// Wall clock, ms since the Unix epoch.
    pub wall_ms: u64,
    /// "link leaf0-spine0 #0 down".
    pub what: String,
    /// Number of the event since the fabric came up (from 1).
    #[serde(default)]
    pub seq: u64,
    /// The scenario's timeline it belongs to (a change, repair or cancel of it, the end of
    /// a load it started); none for changes by hand and a fabric reset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeline: Option<u64>,
}

/// A fabric's counters at one moment, of which a scenario's `Meanwhile` is the
/// difference.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Counts {
    pub delivered: u64,
    pub drops: Vec<(String, u64)>,
    pub ecn_marked: u64,
    pub changed_links: usize,
}

impl Counts {
    pub fn of(s: &crate::dataplane::Status) -> Counts {
        Counts {
            delivered: s.delivered,
            drops: s.drops.clone(),
            ecn_marked: s.ports.iter().map(|p| p.ecn_marked).sum(),
            changed_links: s.changed_links.len(),
        }
    }
}

/// What the fabric did while a scenario ran (all its traffic): `closbox chaos` ends with
/// it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Meanwhile {
    pub delivered: u64,
    pub dropped: u64,
    /// Drops by reason, those above 0, in `status`'s order.
    pub drops: Vec<(String, u64)>,
    pub ecn_marked: u64,
    /// Links left down or changed at the end.
    pub changed_links: usize,
}

impl Meanwhile {
    pub fn between(before: &Counts, after: &Counts) -> Meanwhile {
        let d = |a: u64, b: u64| b.saturating_sub(a);
        let drops: Vec<(String, u64)> = after
            .drops
            .iter()
            .filter_map(|(reason, n)| {
                let was = before
                    .drops
                    .iter()
                    .find(|(r, _)| r == reason)
                    .map_or(0, |d| d.1);
                let n = d(was, *n);
                (n > 0).then(|| (reason.clone(), n))
            })
            .collect();
        Meanwhile {
            delivered: d(before.delivered, after.delivered),
            dropped: drops.iter().map(|d| d.1).sum(),
            drops,
            ecn_marked: d(before.ecn_marked, after.ecn_marked),
            changed_links: after.changed_links,
        }
    }
}

/// How a followed scenario ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ChaosEnd {
    /// Its last change made and its loads ended.
    Followed,
    /// `closbox cancel` or `closbox reset` ended it.
    Cancelled,
    /// Ctrl-C (the rest cancelled).
    Interrupted,
    /// Left running (`--detach`).
    Detached,
}

/// `closbox chaos --json`'s last line: the timeline, how it ended, what the fabric did
/// meanwhile (none when detached).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChaosRun {
    pub timeline: u64,
    pub end: ChaosEnd,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub meanwhile: Option<Meanwhile>,
}

/// The vertex called `name`.
fn vertex(topo: &Topology, name: &str) -> Result<Vertex, String> {
    if let Some(i) = topo.hosts.iter().position(|h| h.name == name) {
        return Ok(Vertex::Host(closbox_fabric::HostId(i as u32)));
    }
    if let Some(i) = topo.switches.iter().position(|s| s.name == name) {
        return Ok(Vertex::Switch(closbox_fabric::topology::SwitchId(i as u32)));
    }
    Err(format!("no GPU or switch {name:?}; {}", nearby(topo, name)))
}

/// `name`'s vertex index in the model (GPUs, then switches).
pub(crate) fn vertex_index(topo: &Topology, name: &str) -> Result<u32, String> {
    Ok(match vertex(topo, name)? {
        Vertex::Host(h) => h.0,
        Vertex::Switch(s) => topo.hosts.len() as u32 + s.0,
    })
}

fn name(topo: &Topology, v: Vertex) -> &str {
    match v {
        Vertex::Host(h) => &topo.hosts[h.0 as usize].name,
        Vertex::Switch(s) => &topo.switches[s.0 as usize].name,
    }
}

/// Names sharing `name`'s letters (its non-digit prefix), to say what exists; else every
/// name, switches first (fewer, and what a scenario written for another fabric names:
/// "spine1" on a single switch got "gpu0, …, gpu7 and 1 more").
pub fn nearby(topo: &Topology, name: &str) -> String {
    let stem: String = name.chars().take_while(|c| !c.is_ascii_digit()).collect();
    let all = topo
        .switches
        .iter()
        .map(|s| s.name.as_str())
        .chain(topo.hosts.iter().map(|h| h.name.as_str()));
    let mut near: Vec<&str> = all
        .clone()
        .filter(|n| !stem.is_empty() && n.starts_with(&stem))
        .collect();
    if near.is_empty() {
        near = all.collect();
    }
    let shown: Vec<&str> = near.iter().take(8).copied().collect();
    let more = near.len().saturating_sub(shown.len());
    format!(
        "names here: {}{}",
        shown.join(", "),
        if more > 0 {
            format!(" and {more} more")
        } else {
            String::new()
        }
    )
}

/// The links between `a` and `b` (all parallel ones, or the `index`-th).
pub fn links_between(
    topo: &Topology,
    a: &str,
    b: &str,
    index: Option<u32>,
) -> Result<Vec<u32>, String> {
    let (va, vb) = (vertex(topo, a)?, vertex(topo, b)?);
    let all: Vec<u32> = topo
        .links
        .iter()
        .enumerate()
        .filter(|(_, l)| (l.a == va && l.b == vb) || (l.a == vb && l.b == va))
        .map(|(i, _)| i as u32)
        .collect();
    if all.is_empty() {
        let neighbours: Vec<&str> = topo
            .links
            .iter()
            .filter_map(|l| match (l.a == va, l.b == va) {
                (true, _) => Some(name(topo, l.b)),
                (_, true) => Some(name(topo, l.a)),
                _ => None,
            })
            .collect();
        let mut neighbours = neighbours;
        neighbours.sort();
        neighbours.dedup();
        return Err(format!(
            "no link between {a} and {b}; {a} links to {}",
            neighbours.join(", ")
        ));
    }
    match index {
        None => Ok(all),
        Some(i) => all.get(i as usize).map(|&l| vec![l]).ok_or_else(|| {
            format!(
                "{a}-{b} has {} parallel link{} (index 0 to {})",
                all.len(),
                if all.len() == 1 { "" } else { "s" },
                all.len() - 1
            )
        }),
    }
}

/// The links of a switch or a GPU.
fn links_of(topo: &Topology, name: &str, want_switch: bool) -> Result<Vec<u32>, String> {
    let v = vertex(topo, name)?;
    match (v, want_switch) {
        (Vertex::Host(_), true) => return Err(format!("{name} is a GPU: use `closbox gpu`")),
        (Vertex::Switch(_), false) => {
            return Err(format!("{name} is a switch: use `closbox switch`"))
        }
        _ => {}
    }
    Ok(topo
        .links
        .iter()
        .enumerate()
        .filter(|(_, l)| l.a == v || l.b == v)
        .map(|(i, _)| i as u32)
        .collect())
}

/// A link as clients name it: (a, b, index among the parallel links a-b).
pub fn link_ref(topo: &Topology, l: u32) -> (String, String, u32) {
    let link = &topo.links[l as usize];
    (
        name(topo, link.a).to_owned(),
        name(topo, link.b).to_owned(),
        parallel_index(topo, l) as u32,
    )
}

/// "leaf0-spine1 #0".
pub fn link_name(topo: &Topology, l: u32) -> String {
    let link = &topo.links[l as usize];
    format!(
        "{}-{} #{}",
        name(topo, link.a),
        name(topo, link.b),
        parallel_index(topo, l)
    )
}

/// Every egress port's name, in the model's order (port `2l` leaves link `l`'s end a,
/// `2l + 1` its end b): "leaf0->spine1", or where parallel links join the two,
/// "leaf0->spine1 #3", the link's index as `link_name` gives it (`status`, `capture`,
/// `record` and the metrics' labels must tell every port apart).
pub fn port_names(topo: &Topology) -> Vec<String> {
    let ends = |l: &closbox_fabric::topology::Link| (l.a.min(l.b), l.a.max(l.b));
    let mut parallel: std::collections::BTreeMap<(Vertex, Vertex), usize> = Default::default();
    let index: Vec<usize> = topo
        .links
        .iter()
        .map(|l| {
            let n = parallel.entry(ends(l)).or_default();
            *n += 1;
            *n - 1
        })
        .collect();
    let mut out = Vec::with_capacity(2 * topo.links.len());
    for (l, link) in topo.links.iter().enumerate() {
        let suffix = if parallel[&ends(link)] > 1 {
            format!(" #{}", index[l])
        } else {
            String::new()
        };
        let (a, b) = (name(topo, link.a), name(topo, link.b));
        out.push(format!("{a}->{b}{suffix}"));
        out.push(format!("{b}->{a}{suffix}"));
    }
    out
}

/// The ends of a port named as `port_names` names it: ("leaf0", "spine1") of
/// "leaf0->spine1 #3"; the name itself and "" for what is no port name.
pub fn port_ends(port: &str) -> (&str, &str) {
    let bare = port.split_once(" #").map_or(port, |(p, _)| p);
    bare.split_once("->").unwrap_or((bare, ""))
}

/// Link `l`'s index among the parallel links between its ends (from 0).
fn parallel_index(topo: &Topology, l: u32) -> usize {
    let link = &topo.links[l as usize];
    let (a, b) = (link.a, link.b);
    topo.links[..l as usize]
        .iter()
        .filter(|x| (x.a == a && x.b == b) || (x.a == b && x.b == a))
        .count()
}

/// Most cycles one flap may schedule.
pub const MAX_FLAPS: u32 = 10_000;
/// Most bursts of one incast.
pub const MAX_BURSTS: u32 = 1_000_000;

/// What a request does at one instant: the model's changes, applied together, and the one
/// line the event log gets for them (a switch going down is one event, not one per link).
#[derive(Clone, Debug, PartialEq)]
pub struct Step {
    pub changes: Vec<Change>,
    pub what: String,
    /// Which fault of its timeline the step belongs to: 0 for the timeline's own steps,
    /// else one that repairs itself (a flap, a scenario's random fault), whose changes
    /// undo only each other (`dataplane::layers`).
    pub fault: u32,
}

impl Step {
    /// A step of one change.
    pub fn one(change: Change, what: String) -> Step {
        Step {
            changes: vec![change],
            what,
            fault: 0,
        }
    }
}

/// The steps a request makes, each with when (fabric ns after now). Loads it starts are
/// numbered from `next_load` on (which it advances).
pub fn schedule(
    topo: &Topology,
    req: &ChangeRequest,
    next_load: &mut u32,
) -> Result<Vec<(u64, Step)>, String> {
    // A flap: the requests that take its target down and bring it back, repeated.
    let (down, up, down_ns, up_ns, count) = match req {
        ChangeRequest::LinkFlap {
            a,
            b,
            index,
            down_ns,
            up_ns,
            count,
        } => {
            let (a, b, index) = (a.clone(), b.clone(), *index);
            (
                ChangeRequest::LinkDown {
                    a: a.clone(),
                    b: b.clone(),
                    index,
                },
                ChangeRequest::LinkUp { a, b, index },
                down_ns,
                up_ns,
                count,
            )
        }
        ChangeRequest::SwitchFlap {
            name,
            gpu,
            down_ns,
            up_ns,
            count,
        } => {
            let name = name.clone();
            let (d, u) = if *gpu {
                (
                    ChangeRequest::GpuDown { name: name.clone() },
                    ChangeRequest::GpuUp { name },
                )
            } else {
                (
                    ChangeRequest::SwitchDown { name: name.clone() },
                    ChangeRequest::SwitchUp { name },
                )
            };
            (d, u, down_ns, up_ns, count)
        }
        _ => {
            return Ok(resolve(topo, req, next_load)?
                .into_iter()
                .map(|step| (0, step))
                .collect())
        }
    };
    if *down_ns == 0 || *up_ns == 0 {
        return Err("a flap needs --down and --up above 0".into());
    }
    if *count == 0 || *count > MAX_FLAPS {
        return Err(format!("--count must be 1 to {MAX_FLAPS}"));
    }
    let (down, up) = (
        resolve(topo, &down, next_load)?,
        resolve(topo, &up, next_load)?,
    );
    let mut out = Vec::new();
    let period = down_ns.saturating_add(*up_ns);
    for k in 0..*count as u64 {
        let start = period.saturating_mul(k);
        let flap = |steps: &[Step], at: u64, out: &mut Vec<(u64, Step)>| {
            for s in steps {
                let what = format!("{} (flap {} of {count})", s.what, k + 1);
                out.push((at, Step { what, ..s.clone() }));
            }
        };
        flap(&down, start, &mut out);
        flap(&up, start.saturating_add(*down_ns), &mut out);
    }
    Ok(out)
}

/// "link leaf0-spine1 #0", or for parallel links "links leaf0-spine1 #0, #1".
fn links_label(topo: &Topology, links: &[u32]) -> String {
    match links {
        [l] => format!("link {}", link_name(topo, *l)),
        _ => {
            let l = &topo.links[links[0] as usize];
            let indices: Vec<String> = links
                .iter()
                .map(|&x| format!("#{}", parallel_index(topo, x)))
                .collect();
            format!(
                "links {}-{} {}",
                name(topo, l.a),
                name(topo, l.b),
                indices.join(", ")
            )
        }
    }
}

/// "switch spine1 down (4 links, to leaf0, leaf1, leaf2, leaf3)": a switch's or a GPU's
/// links, named by the vertices at their other ends (the first 8; parallel links as ×N).
fn vertex_label(topo: &Topology, v: Vertex, links: &[u32], what: &str) -> String {
    let mut far: Vec<(&str, usize)> = Vec::new();
    for &l in links {
        let link = &topo.links[l as usize];
        let other = name(topo, if link.a == v { link.b } else { link.a });
        match far.iter_mut().find(|(n, _)| *n == other) {
            Some((_, k)) => *k += 1,
            None => far.push((other, 1)),
        }
    }
    let shown: Vec<String> = far
        .iter()
        .take(8)
        .map(|&(n, k)| {
            if k > 1 {
                format!("{n} ×{k}")
            } else {
                n.to_owned()
            }
        })
        .collect();
    let more = far.len().saturating_sub(shown.len());
    let kind = match v {
        Vertex::Host(_) => "GPU",
        Vertex::Switch(_) => "switch",
    };
    format!(
        "{kind} {} {what} ({} link{}, to {}{})",
        name(topo, v),
        links.len(),
        if links.len() == 1 { "" } else { "s" },
        shown.join(", "),
        if more > 0 {
            format!(" and {more} more")
        } else {
            String::new()
        }
    )
}

/// The model's changes for a request, as steps applied now, each with its line for the
/// event log. Loads it starts are numbered from `next_load` on.
pub fn resolve(
    topo: &Topology,
    req: &ChangeRequest,
    next_load: &mut u32,
) -> Result<Vec<Step>, String> {
    let each = |links: Vec<u32>, f: &dyn Fn(u32) -> Change, what: &str| {
        vec![Step {
            what: format!("{} {what}", links_label(topo, &links)),
            changes: links.into_iter().map(f).collect(),
            fault: 0,
        }]
    };
    // Every link of a switch or of a GPU, as one step.
    let all = |name: &str, switch: bool, f: fn(u32) -> Change, what: &str| {
        let links = links_of(topo, name, switch)?;
        let what = vertex_label(topo, vertex(topo, name)?, &links, what);
        Ok::<_, String>(vec![Step {
            changes: links.into_iter().map(f).collect(),
            what,
            fault: 0,
        }])
    };
    Ok(match req {
        ChangeRequest::LinkDown { a, b, index } => each(
            links_between(topo, a, b, *index)?,
            &Change::LinkDown,
            "down",
        ),
        ChangeRequest::LinkUp { a, b, index } => {
            each(links_between(topo, a, b, *index)?, &Change::LinkUp, "up")
        }
        ChangeRequest::LinkReset { a, b, index } => each(
            links_between(topo, a, b, *index)?,
            &Change::ResetLink,
            RESET_TO_TOPOLOGY,
        ),
        ChangeRequest::LinkSet {
            a,
            b,
            index,
            rate_bps,
            delay_ns,
            loss,
            loss_burst,
            buffer_bytes,
            from,
        } => {
            if rate_bps.is_some_and(|r| r == 0) {
                return Err("--rate must be above 0".into());
            }
            // 1 is a gray failure: the link stays up and loses every frame, and the
            // switches, which only detect links going down, keep routing onto it.
            if loss.is_some_and(|p| !(0.0..=1.0).contains(&p)) {
                return Err("--loss must be a probability in [0, 1] (1 loses every frame)".into());
            }
            if loss_burst.is_some_and(|b| !closbox_fabric::config::loss_burst_ok(b)) {
                return Err(format!(
                    "--loss-burst must be a mean run of lost frames from 1 to {}",
                    closbox_fabric::config::MAX_LOSS_BURST
                ));
            }
            if delay_ns.is_some_and(|d| d > closbox_fabric::config::MAX_DELAY.as_nanos()) {
                return Err("--delay must be at most 1 s".into());
            }
            if buffer_bytes.is_some_and(|b| b < topo.fabric.mtu as u64) {
                return Err(format!(
                    "--buffer must hold one packet of the fabric's mtu ({} bytes)",
                    topo.fabric.mtu
                ));
            }
            if rate_bps.is_none()
                && delay_ns.is_none()
                && loss.is_none()
                && loss_burst.is_none()
                && buffer_bytes.is_none()
            {
                return Err(
                    "nothing to set: give --rate, --delay, --loss, --loss-burst or --buffer".into(),
                );
            }
            let mut what = Vec::new();
            if let Some(r) = rate_bps {
                what.push(format!("rate {}", Bandwidth::from_bps(*r)));
            }
            if let Some(d) = delay_ns {
                what.push(format!("delay {}", Duration::from_nanos(*d)));
            }
            if let Some(p) = loss {
                what.push(format!("loss {p}"));
            }
            if let Some(b) = loss_burst {
                what.push(format!("losses in runs of {b} frames on average"));
            }
            if let Some(b) = buffer_bytes {
                // A lossless switch holds per ingress (xoff + headroom), not per egress
                // buffer: only the GPU NIC queues on this link would take it.
                let mut note = if topo.fabric.flow_control.pause().is_some() {
                    " (lossless fabric: switch ports hold per ingress, only a GPU's NIC queue takes it)".to_string()
                } else {
                    String::new()
                };
                // The fabric holds no more than its packet memory in all: a queue
                // beyond it fills only that far, the rest dropped as `memory_limit`.
                let memory = topo.fabric.packet_memory;
                if *b > memory.get() {
                    note.push_str(&format!(
                        " (more than the fabric's packet_memory, {memory}: packets past it are dropped as memory_limit)"
                    ));
                }
                what.push(format!("buffer {}{note}", Bytes::new(*b)));
            }
            // One direction: the one leaving `from`, which must be one of the ends.
            let from = match from {
                None => None,
                Some(f) if f == a || f == b => Some(vertex(topo, f)?),
                Some(f) => {
                    return Err(format!(
                        "--from {f}: a direction of the link between {a} and {b} is from {a} or from {b}"
                    ))
                }
            };
            let dirs = |link: u32| match from {
                None => Directions::Both,
                Some(v) if topo.links[link as usize].a == v => Directions::FromA,
                Some(_) => Directions::FromB,
            };
            let set = |link| Change::SetLink {
                link,
                dirs: dirs(link),
                rate: rate_bps.map(Bandwidth::from_bps),
                delay: delay_ns.map(Duration::from_nanos),
                loss: *loss,
                loss_burst: *loss_burst,
                buffer: buffer_bytes.map(Bytes::new),
            };
            let what = match from {
                Some(v) => format!(
                    "set {} ({}->{} only)",
                    what.join(", "),
                    name(topo, v),
                    if name(topo, v) == a { b } else { a }
                ),
                None => format!("set {}", what.join(", ")),
            };
            each(links_between(topo, a, b, *index)?, &set, &what)
        }
        ChangeRequest::SwitchDown { name } => all(name, true, Change::LinkDown, "down")?,
        ChangeRequest::SwitchUp { name } => all(name, true, Change::LinkUp, "up")?,
        ChangeRequest::GpuDown { name } => all(name, false, Change::LinkDown, "down")?,
        ChangeRequest::GpuUp { name } => all(name, false, Change::LinkUp, "up")?,
        ChangeRequest::Partition { groups } => {
            let rest = groups.len() as u16;
            let mut of = vec![rest; topo.hosts.len()];
            for (g, names) in groups.iter().enumerate() {
                for n in names {
                    let i = topo
                        .hosts
                        .iter()
                        .position(|h| &h.name == n)
                        .ok_or_else(|| format!("no GPU {n:?}; {}", nearby(topo, n)))?;
                    if of[i] != rest {
                        return Err(format!("GPU {n} is in two groups"));
                    }
                    of[i] = g as u16;
                }
            }
            let mut used = of.clone();
            used.sort();
            used.dedup();
            if used.len() < 2 {
                return Err("a partition needs GPUs on two sides".into());
            }
            let mut sides: Vec<String> = groups.iter().map(|g| g.join(",")).collect();
            if of.contains(&rest) {
                sides.push("the rest".into());
            }
            vec![Step::one(
                Change::Partition(of),
                format!("partition {}", sides.join(" | ")),
            )]
        }
        ChangeRequest::Heal => vec![Step::one(Change::Heal, "heal: partition removed".into())],
        ChangeRequest::LinkFlap { .. } | ChangeRequest::SwitchFlap { .. } => {
            return Err("a flap is a schedule: see `schedule`".into())
        }
        ChangeRequest::LoadStop { .. } => {
            return Err(
                "stopping a load depends on the loads running: the data plane does it".into(),
            )
        }
        ChangeRequest::Reset => {
            return Err("a reset depends on the fabric's state: the data plane does it".into())
        }
        ChangeRequest::Load {
            from,
            to,
            rate_bps,
            packet_bytes,
            for_ns,
            on_ns,
            off_ns,
        } => {
            let (f, t) = (vertex_index(topo, from)?, vertex_index(topo, to)?);
            if f == t {
                return Err(format!("a load from {from} to itself"));
            }
            if *rate_bps == 0 {
                return Err("a load's rate must be above 0".into());
            }
            // Its packets leave FROM through FROM's links: more than they carry together
            // would be dropped at the first queue, and generating it costs the data plane
            // per packet (1 Tbit/s from a GPU of a 1 Gbit/s fabric at real time kept it
            // from ever answering again).
            let v = vertex(topo, from)?;
            let carry: u64 = topo
                .links
                .iter()
                .filter(|l| l.a == v || l.b == v)
                .map(|l| l.params.rate.bps())
                .sum();
            if *rate_bps > carry {
                return Err(format!(
                    "a load from {from} at {} is more than its links carry together ({})",
                    Bandwidth::from_bps(*rate_bps),
                    Bandwidth::from_bps(carry)
                ));
            }
            let mtu = topo.fabric.mtu;
            let packet = packet_bytes.unwrap_or(mtu);
            if !(64..=mtu).contains(&packet) {
                return Err(format!(
                    "a load's packets must be 64 bytes to the fabric's mtu ({mtu})"
                ));
            }
            if *for_ns == Some(0) {
                return Err("--for must be above 0".into());
            }
            let pattern = match (on_ns, off_ns) {
                (None, None) => Pattern::Steady,
                (Some(on), Some(off)) if *on > 0 && *off > 0 => Pattern::OnOff {
                    on: Duration::from_nanos(*on),
                    off: Duration::from_nanos(*off),
                },
                (Some(_), Some(_)) => return Err("--on and --off must be above 0".into()),
                _ => return Err("--on and --off go together".into()),
            };
            let id = take(next_load);
            let mut what = format!(
                "load {id} started: {from} -> {to} at {}",
                Bandwidth::from_bps(*rate_bps)
            );
            if let Pattern::OnOff { on, off } = pattern {
                what += &format!(", on {on} / off {off}");
            }
            if let Some(d) = for_ns {
                what += &format!(", for {}", Duration::from_nanos(*d));
            }
            vec![Step::one(
                Change::StartLoad(LoadSpec {
                    id,
                    from: f,
                    to: t,
                    rate: Bandwidth::from_bps(*rate_bps),
                    packet,
                    pattern,
                    duration: for_ns.map(Duration::from_nanos),
                }),
                what,
            )]
        }
        ChangeRequest::Incast {
            to,
            from,
            bytes,
            every_ns,
            count,
        } => {
            let t = topo.host_by_name(to).ok_or_else(|| {
                format!(
                    "no GPU {to:?} (an incast converges on a GPU); {}",
                    nearby(topo, to)
                )
            })?;
            if *bytes == 0 {
                return Err("--bytes must be above 0".into());
            }
            if *count == 0 || *count > MAX_BURSTS {
                return Err(format!("--count must be 1 to {MAX_BURSTS}"));
            }
            let every = match every_ns {
                Some(0) => return Err("--every must be above 0".into()),
                Some(e) => Duration::from_nanos(*e),
                None if *count > 1 => return Err("--count above 1 needs --every".into()),
                None => Duration::from_nanos(1),
            };
            let mut out = Vec::new();
            for src in from {
                let s = topo
                    .host_by_name(src)
                    .ok_or_else(|| format!("no GPU {src:?}; {}", nearby(topo, src)))?;
                if s == t {
                    continue;
                }
                let rate = gpu_rate_toward(topo, s.0, t.0);
                let id = take(next_load);
                out.push(Step::one(
                    Change::StartLoad(LoadSpec {
                        id,
                        from: s.0,
                        to: t.0,
                        rate,
                        packet: topo.fabric.mtu,
                        pattern: Pattern::Bursts {
                            bytes: *bytes,
                            every,
                            count: *count,
                        },
                        duration: None,
                    }),
                    format!(
                        "load {id} started: incast {src} -> {to}, {} at {rate}{}",
                        Bytes::new(*bytes),
                        if *count > 1 {
                            format!(" every {every}, {count} times")
                        } else {
                            String::new()
                        }
                    ),
                ));
            }
            if out.is_empty() {
                return Err(format!(
                    "an incast into {to} needs a source other than {to}"
                ));
            }
            out
        }
    })
}

fn take(next: &mut u32) -> u32 {
    let id = *next;
    *next += 1;
    id
}

/// The rate GPU `s` sends toward GPU `t` at: its scale-up link within a node that has one,
/// else its fastest NIC.
fn gpu_rate_toward(topo: &Topology, s: u32, t: u32) -> Bandwidth {
    let v = Vertex::Host(closbox_fabric::HostId(s));
    let same_node = topo.hosts[s as usize].node == topo.hosts[t as usize].node;
    let of = |nvlink: bool| {
        topo.links
            .iter()
            .filter(|l| (l.a == v || l.b == v) && (l.class == LinkClass::Nvlink) == nvlink)
            .map(|l| l.params.rate)
            .max()
    };
    (if same_node { of(true) } else { None })
        .or_else(|| of(false))
        .or_else(|| of(true))
        .expect("a GPU has a link")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn topo() -> Topology {
        closbox_fabric::parse(
            "[fabric]\nname = \"c\"\n[topology]\nkind = \"leaf-spine\"\nleaves = 2\nspines = 2\ngpus_per_leaf = 2\nuplinks = 2\n",
            "c.toml",
        )
        .unwrap()
    }

    /// The `index`-th link between leaf0 and spine1.
    fn one_link(t: &Topology, index: u32) -> u32 {
        links_between(t, "leaf0", "spine1", Some(index)).unwrap()[0]
    }

    #[test]
    fn ports_of_parallel_links_are_told_apart_by_the_links_index() {
        let t = topo();
        let names = port_names(&t);
        assert_eq!(names.len(), 2 * t.links.len());
        let mut sorted = names.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), names.len(), "unique: {names:?}");
        let l = one_link(&t, 1) as usize;
        let (a, b, i) = link_ref(&t, l as u32);
        assert_eq!(names[2 * l], format!("{a}->{b} #{i}"));
        assert_eq!(names[2 * l + 1], format!("{b}->{a} #{i}"));
        assert_eq!(port_ends(&names[2 * l]), (a.as_str(), b.as_str()));
        // A GPU's single link keeps the plain name.
        assert!(names.contains(&"gpu0->leaf0".to_owned()), "{names:?}");
        assert_eq!(port_ends("gpu0->leaf0"), ("gpu0", "leaf0"));
    }

    #[test]
    fn a_flap_of_parallel_links_is_one_step_each_way() {
        let t = topo();
        let flap = ChangeRequest::LinkFlap {
            a: "leaf0".into(),
            b: "spine1".into(),
            index: None,
            down_ns: 10,
            up_ns: 20,
            count: 2,
        };
        let steps = schedule(&t, &flap, &mut 1).unwrap();
        let got: Vec<(u64, usize, &str)> = steps
            .iter()
            .map(|(at, s)| (*at, s.changes.len(), s.what.as_str()))
            .collect();
        assert_eq!(
            got,
            [
                (0, 2, "links leaf0-spine1 #0, #1 down (flap 1 of 2)"),
                (10, 2, "links leaf0-spine1 #0, #1 up (flap 1 of 2)"),
                (30, 2, "links leaf0-spine1 #0, #1 down (flap 2 of 2)"),
                (40, 2, "links leaf0-spine1 #0, #1 up (flap 2 of 2)"),
            ]
        );
    }

    #[test]
    fn a_switch_or_a_gpu_flaps_all_its_links_as_one_step_each_way() {
        let t = topo();
        let flap = |name: &str, gpu| ChangeRequest::SwitchFlap {
            name: name.into(),
            gpu,
            down_ns: 5,
            up_ns: 7,
            count: 2,
        };
        let steps = schedule(&t, &flap("spine0", false), &mut 1).unwrap();
        let got: Vec<(u64, usize, &str)> = steps
            .iter()
            .map(|(at, s)| (*at, s.changes.len(), s.what.as_str()))
            .collect();
        let what = |dir: &str, k| {
            format!("switch spine0 {dir} (4 links, to leaf0 ×2, leaf1 ×2) (flap {k} of 2)")
        };
        assert_eq!(
            got,
            [
                (0, 4, what("down", 1).as_str()),
                (5, 4, what("up", 1).as_str()),
                (12, 4, what("down", 2).as_str()),
                (17, 4, what("up", 2).as_str()),
            ]
        );
        assert!(matches!(steps[0].1.changes[0], Change::LinkDown(_)));
        assert!(matches!(steps[1].1.changes[0], Change::LinkUp(_)));
        let gpu = schedule(&t, &flap("gpu2", true), &mut 1).unwrap();
        assert_eq!(
            gpu[0].1.what,
            "GPU gpu2 down (1 link, to leaf1) (flap 1 of 2)"
        );
        let e = schedule(&t, &flap("gpu2", false), &mut 1).unwrap_err();
        assert!(e.contains("is a GPU: use `closbox gpu`"), "{e}");
        let e = schedule(&t, &flap("spine0", true), &mut 1).unwrap_err();
        assert!(e.contains("is a switch"), "{e}");
    }

    #[test]
    fn a_switch_with_many_neighbours_names_the_first_eight() {
        let t = closbox_fabric::parse(
            "[fabric]\nname = \"c\"\n[topology]\nkind = \"leaf-spine\"\nleaves = 10\nspines = 1\ngpus_per_leaf = 1\n",
            "c.toml",
        )
        .unwrap();
        let s = resolve(
            &t,
            &ChangeRequest::SwitchDown {
                name: "spine0".into(),
            },
            &mut 1,
        )
        .unwrap();
        assert_eq!(
            s[0].what,
            "switch spine0 down (10 links, to leaf0, leaf1, leaf2, leaf3, leaf4, leaf5, leaf6, leaf7 and 2 more)"
        );
    }

    #[test]
    fn names_resolve_to_links_and_mistakes_say_what_exists() {
        let t = topo();
        let down = |a: &str, b: &str, index| ChangeRequest::LinkDown {
            a: a.into(),
            b: b.into(),
            index,
        };
        let resolve = |t: &Topology, r: &ChangeRequest| resolve(t, r, &mut 1);
        // Both parallel links, one step and one line.
        let both = resolve(&t, &down("leaf0", "spine1", None)).unwrap();
        assert_eq!(both.len(), 1);
        assert_eq!(both[0].changes.len(), 2);
        assert_eq!(both[0].what, "links leaf0-spine1 #0, #1 down");
        let one = resolve(&t, &down("spine1", "leaf0", Some(1))).unwrap();
        assert_eq!(one.len(), 1);
        assert_eq!(one[0].changes, [Change::LinkDown(one_link(&t, 1))]);
        assert_eq!(one[0].what, "link leaf0-spine1 #1 down");
        let e = resolve(&t, &down("leaf0", "spine7", None)).unwrap_err();
        assert!(
            e.contains("no GPU or switch \"spine7\"") && e.contains("spine0"),
            "{e}"
        );
        // Nothing shares the letters: every name, switches first.
        let e = resolve(&t, &down("leaf0", "core3", None)).unwrap_err();
        assert!(
            e.contains("names here: spine0, spine1, leaf0, leaf1, gpu0, gpu1, gpu2, gpu3"),
            "{e}"
        );
        let e = resolve(&t, &down("leaf0", "leaf1", None)).unwrap_err();
        assert!(
            e.contains("no link between leaf0 and leaf1; leaf0 links to"),
            "{e}"
        );
        let e = resolve(&t, &down("leaf0", "spine0", Some(5))).unwrap_err();
        assert!(e.contains("index 0 to 1"), "{e}");
        let spine = resolve(
            &t,
            &ChangeRequest::SwitchDown {
                name: "spine0".into(),
            },
        )
        .unwrap();
        assert_eq!(spine.len(), 1, "one step: {spine:?}");
        assert_eq!(spine[0].changes.len(), 4, "2 uplinks from each of 2 leaves");
        assert_eq!(
            spine[0].what,
            "switch spine0 down (4 links, to leaf0 ×2, leaf1 ×2)"
        );
        let gpu = resolve(
            &t,
            &ChangeRequest::GpuUp {
                name: "gpu3".into(),
            },
        )
        .unwrap();
        assert_eq!(gpu[0].what, "GPU gpu3 up (1 link, to leaf1)");
        let e = resolve(
            &t,
            &ChangeRequest::SwitchDown {
                name: "gpu0".into(),
            },
        )
        .unwrap_err();
        assert!(e.contains("is a GPU"), "{e}");
        let e = resolve(
            &t,
            &ChangeRequest::LinkSet {
                a: "gpu0".into(),
                b: "leaf0".into(),
                index: None,
                rate_bps: Some(0),
                delay_ns: None,
                loss: None,
                loss_burst: None,
                buffer_bytes: None,
                from: None,
            },
        )
        .unwrap_err();
        assert!(e.contains("above 0"), "{e}");
        // A buffer beyond what the fabric may hold in all is set, and says so.
        let set_buffer = |bytes: u64| ChangeRequest::LinkSet {
            a: "gpu0".into(),
            b: "leaf0".into(),
            index: None,
            rate_bps: None,
            delay_ns: None,
            loss: None,
            loss_burst: None,
            buffer_bytes: Some(bytes),
            from: None,
        };
        let memory = t.fabric.packet_memory.get();
        let big = resolve(&t, &set_buffer(memory + 1)).unwrap();
        assert!(
            big[0].what.contains("more than the fabric's packet_memory"),
            "{}",
            big[0].what
        );
        let fits = resolve(&t, &set_buffer(memory)).unwrap();
        assert!(!fits[0].what.contains("packet_memory"), "{}", fits[0].what);
    }
}
