//! Holding a GPU's non-TCP senders to its links' rates, as a host's qdisc does.
//!
//! A host's qdisc keeps a packet charged to its socket until the NIC takes it, so a UDP
//! sender above its link blocks in `sendmsg` once its send buffer is queued. A TUN
//! releases each packet as it takes it (`tun_net_xmit` orphans it): without help, a UDP
//! sender at 2 Gbit/s on a 1 Gbit/s link fills the GPU's NIC queue in the model and loses
//! the excess there (and with one fragment lost, the whole datagram).
//!
//! So each GPU's TUN gets an htb qdisc, installed over rtnetlink in its namespace:
//! - TCP goes to htb's direct queue, unshaped, as before (its own congestion control and
//!   the model's NIC queue pace it; every calibrated prediction was measured that way);
//! - every other packet (UDP and its fragments, ICMP) goes to a class at the rate of the
//!   link(s) it leaves on, divided by the time scale, with the fabric's per-frame framing
//!   as htb's overhead: a class per distinct set of first-hop ports (the NIC, a scale-up
//!   link, each direct link of a mesh; ECMP over several NIC links: their sum). The class
//!   with the most destinations is htb's default; the others are chosen by destination
//!   address (u32 filters).
//!
//! The model still serializes every frame; the qdisc only stops the sender from offering
//! more than the link carries. Rate changes on a GPU's link (`closbox link set`, `link
//! reset`) follow: the data plane tells a `Pacer` thread, which changes the classes.

use std::collections::HashMap;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::AsFd;
use std::sync::{mpsc, Arc, Mutex};

use anyhow::Context;
use closbox_fabric::routing::Routes;
use closbox_fabric::{HostId, Topology};

use crate::links::RootQdisc;
use crate::state::State;
use crate::sys;

/// What `status` names as a GPU's root qdisc once its host deleted closbox's (the
/// kernel's default then, which it does not announce).
pub const REMOVED: &str = "none (deleted)";

/// What `up`, its log and `status` say where the qdisc could not be installed.
pub const OFF: &str = "the GPUs' UDP and ICMP are not held to their links' rates (a sender above its link loses the excess in its NIC queue)";

/// What one GPU's qdisc holds its non-TCP packets to.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// The links of each class's first-hop ports (class `1:(i + 1)`).
    pub links: Vec<Vec<u32>>,
    /// Wall-time rate of each class in bytes/s: its links' rates summed, ÷ time scale.
    pub rates: Vec<u64>,
    /// The class of packets no destination filter picks.
    pub default: usize,
    /// Destinations whose packets leave on another class than the default.
    pub by_dst: Vec<(Ipv4Addr, usize)>,
    /// Bytes htb adds to each packet (the fabric's framing per frame).
    pub overhead: u16,
    time_scale: f64,
}

/// A class without links (a GPU that reaches nobody) is not held back: 8 Tbit/s.
const UNPACED: u64 = 1 << 40;

/// The plan for GPU `gpu`, from the routes' first hops and the links' rates
/// (`rate_of(link index)` in bits/s of fabric time), at `time_scale`.
pub fn plan(
    topo: &Topology,
    routes: &Routes,
    gpu: HostId,
    time_scale: f64,
    rate_of: impl Fn(u32) -> u64,
) -> Plan {
    // First-hop link sets, in order of first appearance; destinations of each.
    let mut sets: Vec<(Vec<u32>, Vec<Ipv4Addr>)> = Vec::new();
    for (i, h) in topo.hosts.iter().enumerate() {
        if i == gpu.0 as usize {
            continue;
        }
        let mut links: Vec<u32> = routes
            .next_hops(gpu.0, HostId(i as u32))
            .iter()
            .map(|p| routes.port(*p).link)
            .collect();
        if links.is_empty() {
            continue;
        }
        links.sort_unstable();
        links.dedup();
        match sets.iter_mut().find(|(l, _)| *l == links) {
            Some((_, dsts)) => dsts.push(h.addr),
            None => sets.push((links, vec![h.addr])),
        }
    }
    if sets.is_empty() {
        sets.push((Vec::new(), Vec::new()));
    }
    let default = sets
        .iter()
        .enumerate()
        .max_by_key(|(i, (_, d))| (d.len(), std::cmp::Reverse(*i)))
        .map_or(0, |(i, _)| i);
    let by_dst = sets
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != default)
        .flat_map(|(i, (_, dsts))| dsts.iter().map(move |a| (*a, i)))
        .collect();
    let mut p = Plan {
        links: sets.into_iter().map(|(l, _)| l).collect(),
        rates: Vec::new(),
        default,
        by_dst,
        overhead: topo.fabric.l2_overhead.min(u16::MAX as u32) as u16,
        time_scale: time_scale.max(1.0),
    };
    p.rerate(rate_of);
    p
}

impl Plan {
    /// Recomputes the classes' rates from the links' (`rate_of`, bits/s of fabric time);
    /// true if one changed.
    pub fn rerate(&mut self, rate_of: impl Fn(u32) -> u64) -> bool {
        let rates: Vec<u64> = self
            .links
            .iter()
            .map(|links| {
                if links.is_empty() {
                    return UNPACED;
                }
                let bps = links
                    .iter()
                    .map(|&l| rate_of(l))
                    .fold(0u64, u64::saturating_add);
                ((bps as f64 / 8.0 / self.time_scale) as u64).max(1)
            })
            .collect();
        let changed = rates != self.rates;
        self.rates = rates;
        changed
    }

    /// Whether the classes, once at rates `was` (bytes/s), would hold their packets past
    /// their new rates: htb keeps a class's debt (what it sent beyond its tokens, in time,
    /// up to 60 s) across a rate change, so a class raised from a rate at which one frame
    /// of `frame` bytes takes more than `HELD_OVER` waits out the old rate's debt first (a
    /// GPU's link set to 1 bit/s and reset held its pings for a minute). Such a qdisc is
    /// laid anew instead, which drops what it holds.
    fn held_over(&self, was: &[u64], frame: u64) -> bool {
        let bytes = frame + self.overhead as u64;
        self.rates.iter().zip(was).any(|(&now, &was)| {
            now > was && bytes.saturating_mul(1_000_000_000) / was.max(1) > HELD_OVER_NS
        })
    }
}

/// See `Plan::held_over`: a frame's time at a class's old rate (wall time) beyond which a
/// raised rate lays the qdisc anew.
const HELD_OVER_NS: u64 = 1_000_000;

/// Installs `plan` on interface `ifindex` of the calling thread's network namespace,
/// replacing whatever root qdisc it had. (By its index, which a rename keeps: a GPU's host
/// may rename its interface.)
pub fn install(ifindex: u32, plan: &Plan) -> io::Result<()> {
    let mut nl = Netlink::open()?;
    let ifindex = ifindex as i32;
    // The root qdisc, 1:, htb; unclassified packets to the default class.
    let mut a = Attrs::default();
    a.put(TCA_KIND, b"htb\0");
    let opts = a.begin(TCA_OPTIONS);
    let mut glob = Vec::with_capacity(20);
    for v in [3u32, 10, plan.default as u32 + 1, 0, 0] {
        glob.extend_from_slice(&v.to_ne_bytes());
    }
    a.put(TCA_HTB_INIT, &glob);
    a.end(opts);
    nl.request(
        RTM_NEWQDISC,
        NLM_F_CREATE | NLM_F_REPLACE,
        tcmsg(ifindex, 0x0001_0000, TC_H_ROOT, 0),
        &a.0,
    );
    classes(&mut nl, ifindex, plan);
    filters(&mut nl, ifindex, plan);
    nl.flush()
}

/// Lays `plan` anew on interface `ifindex`: the root qdisc is deleted first (a replace of
/// an htb root by an htb with the same handle is taken as a change of it, which keeps its
/// filters). A root already gone (a GPU's program may delete it) is not an error.
pub fn reinstall(ifindex: u32, plan: &Plan) -> io::Result<()> {
    let mut nl = Netlink::open()?;
    nl.request(RTM_DELQDISC, 0, tcmsg(ifindex as i32, 0, TC_H_ROOT, 0), &[]);
    let _ = nl.flush();
    install(ifindex, plan)
}

/// closbox's root qdisc: htb, handle 1:.
const ROOT_HANDLE: u32 = 0x0001_0000;

/// The root qdisc of interface `ifindex` in the calling thread's network namespace: its
/// handle and kind. A dump of the namespace's qdiscs (`RTM_GETQDISC`): a request for one
/// qdisc is answered to its sender only with `NLM_F_ECHO` on some kernels.
pub fn root_qdisc(ifindex: u32) -> io::Result<(u32, String)> {
    let sock = sys::RouteSocket::open()?;
    let mut m = Vec::with_capacity(36);
    m.extend_from_slice(&36u32.to_ne_bytes());
    m.extend_from_slice(&RTM_GETQDISC.to_ne_bytes());
    m.extend_from_slice(&(NLM_F_REQUEST | NLM_F_DUMP).to_ne_bytes());
    m.extend_from_slice(&1u32.to_ne_bytes()); // sequence
    m.extend_from_slice(&0u32.to_ne_bytes());
    m.extend_from_slice(&tcmsg(0, 0, 0, 0));
    sock.send(&m)?;
    let mut buf = vec![0u8; 32 << 10];
    let mut root = None;
    loop {
        let n = sock.recv(&mut buf)?;
        if qdiscs_in(&buf[..n], ifindex, &mut root)? {
            break;
        }
    }
    root.ok_or_else(|| io::Error::from_raw_os_error(libc::ENODEV))
}

/// Reads one datagram of a qdisc dump: the root qdisc of `ifindex` into `root` (its
/// handle and `TCA_KIND`); true once the dump is done.
fn qdiscs_in(buf: &[u8], ifindex: u32, root: &mut Option<(u32, String)>) -> io::Result<bool> {
    let word = |at: usize| u32::from_ne_bytes(buf[at..at + 4].try_into().expect("4 bytes"));
    let mut at = 0;
    while at + 16 <= buf.len() {
        let len = (word(at) as usize).min(buf.len() - at);
        let ty = u16::from_ne_bytes([buf[at + 4], buf[at + 5]]);
        if len < 16 {
            break;
        }
        match ty {
            NLMSG_DONE => return Ok(true),
            NLMSG_ERROR if len >= 20 => {
                let err = word(at + 16) as i32;
                return Err(io::Error::from_raw_os_error(-err));
            }
            RTM_NEWQDISC if len >= 36 => {
                let (index, handle, parent) = (word(at + 20), word(at + 24), word(at + 28));
                if index == ifindex && parent == TC_H_ROOT {
                    *root = Some((handle, kind_of(&buf[at + 36..at + len])));
                }
            }
            _ => {}
        }
        at += (len + 3) & !3;
    }
    Ok(false)
}

/// The `TCA_KIND` among a qdisc message's attributes ("" if none).
fn kind_of(mut attrs: &[u8]) -> String {
    while attrs.len() >= 4 {
        let alen = u16::from_ne_bytes([attrs[0], attrs[1]]) as usize;
        let aty = u16::from_ne_bytes([attrs[2], attrs[3]]);
        if alen < 4 || alen > attrs.len() {
            break;
        }
        if aty == TCA_KIND {
            let v = &attrs[4..alen];
            let v = v.split(|&b| b == 0).next().unwrap_or(v);
            return String::from_utf8_lossy(v).into_owned();
        }
        attrs = &attrs[((alen + 3) & !3).min(attrs.len())..];
    }
    String::new()
}

/// Changes the rates of the classes `install` made for `plan` (the same classes, new
/// rates): what they hold stays queued.
pub fn set_rates(ifindex: u32, plan: &Plan) -> io::Result<()> {
    let mut nl = Netlink::open()?;
    classes(&mut nl, ifindex as i32, plan);
    nl.flush()
}

fn classes(nl: &mut Netlink, ifindex: i32, plan: &Plan) {
    for (i, &rate) in plan.rates.iter().enumerate() {
        let mut a = Attrs::default();
        a.put(TCA_KIND, b"htb\0");
        let opts = a.begin(TCA_OPTIONS);
        a.put(TCA_HTB_PARMS, &htb_opt(rate, plan.overhead));
        if rate > u32::MAX as u64 {
            a.put(TCA_HTB_RATE64, &rate.to_ne_bytes());
            a.put(TCA_HTB_CEIL64, &rate.to_ne_bytes());
        }
        a.end(opts);
        nl.request(
            RTM_NEWTCLASS,
            NLM_F_CREATE | NLM_F_REPLACE,
            tcmsg(ifindex, 0x0001_0000 | (i as u32 + 1), 0x0001_0000, 0),
            &a.0,
        );
    }
}

/// TCP to the direct queue (class 1:0) first, then destinations (on a qdisc just made:
/// there are none from before).
fn filters(nl: &mut Netlink, ifindex: i32, plan: &Plan) {
    // tcm_info: the filter's priority, and the protocol (ETH_P_IP) in network order.
    let info = |prio: u32| (prio << 16) | 0x0800u16.to_be() as u32;
    nl.request(
        RTM_NEWTFILTER,
        NLM_F_CREATE | NLM_F_EXCL,
        tcmsg(ifindex, 0, 0x0001_0000, info(1)),
        &u32_filter(0x0001_0000, &[(8, 0x00ff_0000, 0x0006_0000)]),
    );
    for (addr, class) in &plan.by_dst {
        nl.request(
            RTM_NEWTFILTER,
            NLM_F_CREATE | NLM_F_EXCL,
            tcmsg(ifindex, 0, 0x0001_0000, info(2)),
            &u32_filter(
                0x0001_0000 | (*class as u32 + 1),
                &[(16, u32::MAX, u32::from(*addr))],
            ),
        );
    }
}

/// Follows the fabric's changes into the GPUs' classes, on a thread of its own (it moves
/// between the GPUs' namespaces; the data plane only says what changed): a link's new
/// rate, and the routes the fabric converged to after links went down or came up (a GPU
/// whose packets to some destination now leave on other links gets classes for those).
#[derive(Clone, Debug)]
pub struct Pacer {
    tx: mpsc::Sender<Change>,
    /// Per GPU, the kind of the root qdisc its host put in place of closbox's (`tc qdisc
    /// replace dev cb0 root tbf …`), as the pacer found it when a change of the fabric
    /// would have rewritten it: left alone.
    hosts_own: Arc<Mutex<Vec<Option<String>>>>,
}

/// What the data plane tells the pacer.
#[derive(Debug)]
enum Change {
    /// Link `.0` now runs at `.1` bits/s of fabric time.
    Rate(u32, u64),
    /// Routes converged over the links marked up.
    Routes(Vec<bool>),
    /// GPU `.0`'s interface is gone (deleted, or moved out of its namespace): nothing to
    /// pace there any more.
    Gone(usize),
}

/// The pacer thread's view: the links' rates and states, and each GPU's plan.
struct Plans {
    topo: Topology,
    time_scale: f64,
    rates: Vec<u64>,
    plans: Vec<Plan>,
    /// Per link: the GPUs whose classes it is in.
    users: HashMap<u32, Vec<usize>>,
    /// GPUs whose interface is gone.
    gone: Vec<bool>,
}

impl Plans {
    fn new(topo: &Topology, plans: Vec<Plan>) -> Plans {
        let mut p = Plans {
            topo: topo.clone(),
            time_scale: topo.fabric.time_scale.get(),
            rates: topo.links.iter().map(|l| l.params.rate.bps()).collect(),
            gone: vec![false; plans.len()],
            plans,
            users: HashMap::new(),
        };
        p.index();
        p
    }

    fn index(&mut self) {
        self.users.clear();
        for (i, p) in self.plans.iter().enumerate() {
            for &l in p.links.iter().flatten() {
                let u = self.users.entry(l).or_default();
                if u.last() != Some(&i) {
                    u.push(i);
                }
            }
        }
    }

    /// Applies `change`; the GPUs whose qdisc must change, and whether only its rates
    /// did and may change in place (else its classes and filters are laid anew). Never
    /// a GPU whose interface is gone.
    fn apply(&mut self, change: Change) -> Vec<(usize, bool)> {
        let mut out = self.changed_by(change);
        out.retain(|&(i, _)| !self.gone.get(i).copied().unwrap_or(false));
        out
    }

    fn changed_by(&mut self, change: Change) -> Vec<(usize, bool)> {
        match change {
            Change::Gone(i) => {
                if let Some(g) = self.gone.get_mut(i) {
                    *g = true;
                }
                Vec::new()
            }
            Change::Rate(link, bps) => {
                let Some(r) = self.rates.get_mut(link as usize) else {
                    return Vec::new();
                };
                *r = bps;
                let rates = &self.rates;
                let frame = self.topo.fabric.mtu as u64;
                let mut out = Vec::new();
                for &i in self.users.get(&link).map_or(&[][..], |v| &v[..]) {
                    let plan = &mut self.plans[i];
                    let was = plan.rates.clone();
                    if plan.rerate(|l| rates[l as usize]) {
                        out.push((i, !plan.held_over(&was, frame)));
                    }
                }
                out
            }
            Change::Routes(up) => {
                let routes = Routes::over_live_links(&self.topo, |l| {
                    up.get(l as usize).copied().unwrap_or(true)
                });
                let mut out = Vec::new();
                for i in 0..self.plans.len() {
                    let new = plan(
                        &self.topo,
                        &routes,
                        HostId(i as u32),
                        self.time_scale,
                        |l| self.rates[l as usize],
                    );
                    let old = &self.plans[i];
                    if new == *old {
                        continue;
                    }
                    let same_classes = new.links.len() == old.links.len()
                        && new.default == old.default
                        && new.by_dst == old.by_dst;
                    out.push((i, same_classes));
                    self.plans[i] = new;
                }
                self.index();
                out
            }
        }
    }
}

/// Adds `more` (GPU, rates only) to `todo`: a GPU once, rewritten whole if either says so.
fn merge(todo: &mut Vec<(usize, bool)>, more: Vec<(usize, bool)>) {
    for (i, rates_only) in more {
        match todo.iter_mut().find(|(j, _)| *j == i) {
            Some(t) => t.1 &= rates_only,
            None => todo.push((i, rates_only)),
        }
    }
}

impl Pacer {
    /// Starts the thread for the plans `install_all` installed on the interfaces
    /// `ifindex` (a GPU's each).
    pub fn start(
        state: &State,
        topo: &Topology,
        plans: Vec<Plan>,
        ifindex: Vec<u32>,
    ) -> io::Result<Pacer> {
        let (tx, rx) = mpsc::channel::<Change>();
        let mut plans = Plans::new(topo, plans);
        let gpus = state.gpus.clone();
        let hosts_own = Arc::new(Mutex::new(vec![None; gpus.len()]));
        let found = Arc::clone(&hosts_own);
        // The thread goes back here after each change: a namespace is not held by it
        // once its GPU's fabric is down.
        let home = std::fs::File::open("/proc/thread-self/ns/net")?;
        std::thread::Builder::new()
            .name("pacer".into())
            .spawn(move || {
                while let Ok(first) = rx.recv() {
                    // What queued meanwhile, at once: rates in order, then only the
                    // latest routes (each laid from scratch at the rates then), so a fast
                    // flap on a large fabric does not pile up work; every GPU a step
                    // changed is rewritten once, whole if any step changed its classes.
                    let mut routes = None;
                    let mut todo: Vec<(usize, bool)> = Vec::new();
                    for change in std::iter::once(first).chain(rx.try_iter()) {
                        match change {
                            Change::Routes(up) => routes = Some(up),
                            other => merge(&mut todo, plans.apply(other)),
                        }
                    }
                    if let Some(up) = routes {
                        merge(&mut todo, plans.apply(Change::Routes(up)));
                    }
                    for (i, rates_only) in todo {
                        let g = &gpus[i];
                        let p = &plans.plans[i];
                        let done = std::fs::File::open(g.netns_path())
                            .and_then(|ns| sys::enter_netns(ns.as_fd()))
                            .and_then(|()| {
                                // A qdisc the GPU's host put in place of closbox's
                                // (as root in its namespace may) is the host's: left as
                                // it made it. The kernel's default (handle 0:, what a
                                // `tc qdisc del dev cb0 root` leaves) is no qdisc of
                                // anyone's: closbox's comes back.
                                let (handle, kind) = root_qdisc(ifindex[i])?;
                                let ours = handle == ROOT_HANDLE && kind == "htb";
                                if !ours && handle != 0 {
                                    return Ok(Some(kind));
                                }
                                // Rates alone where the classes are as laid; laid anew
                                // where they are not.
                                if !(ours && rates_only && set_rates(ifindex[i], p).is_ok()) {
                                    reinstall(ifindex[i], p)?;
                                }
                                Ok(None)
                            });
                        match done {
                            Ok(host) => {
                                let mut own = found.lock().unwrap_or_else(|e| e.into_inner());
                                if host.is_some() && own[i] != host {
                                    tracing::info!(
                                        "{}: its host replaced the qdisc closbox paces its non-TCP packets with (now {}): left as it is; such packets above its link's rate now drop in its NIC queue",
                                        g.name,
                                        host.as_deref().unwrap_or("?")
                                    );
                                }
                                own[i] = host;
                            }
                            // Deleted, or moved away, before the data plane said so.
                            Err(e) if e.raw_os_error() == Some(libc::ENODEV) => {
                                plans.apply(Change::Gone(i));
                                tracing::info!(
                                    "{}: its interface is gone; its pacing with it",
                                    g.name
                                );
                            }
                            Err(e) => tracing::warn!(
                                "{}: pacing its non-TCP packets after a change of the fabric: {e}",
                                g.name
                            ),
                        }
                        if let Err(e) = sys::enter_netns(home.as_fd()) {
                            tracing::warn!("pacer: back to the daemon's namespace: {e}");
                        }
                    }
                }
            })?;
        Ok(Pacer { tx, hosts_own })
    }

    /// GPUs whose host's own root qdisc the pacer found and left (`Pacer::hosts_own`),
    /// with its kind.
    pub fn hosts_own(&self) -> Vec<(usize, String)> {
        let own = self.hosts_own.lock().unwrap_or_else(|e| e.into_inner());
        own.iter()
            .enumerate()
            .filter_map(|(i, k)| k.clone().map(|k| (i, k)))
            .collect()
    }

    /// GPU `gpu`'s root qdisc is now `root` (`None`: deleted), as a notice from its
    /// namespace said: recorded as closbox's (`None`), the host's own (its kind), or
    /// `REMOVED`, which it returns.
    pub fn heard_root(&self, gpu: usize, root: Option<RootQdisc>) -> Option<String> {
        let is = match root {
            Some(q) if q.handle == ROOT_HANDLE && q.kind() == "htb" => None,
            Some(q) => Some(q.kind()),
            None => Some(REMOVED.to_owned()),
        };
        let mut own = self.hosts_own.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(slot) = own.get_mut(gpu) {
            slot.clone_from(&is);
        }
        is
    }

    /// Link `link` now runs at `bps` (bits/s of fabric time).
    pub fn link_rate(&self, link: u32, bps: u64) {
        // The thread ends only with the process.
        let _ = self.tx.send(Change::Rate(link, bps));
    }

    /// Routes converged over the links for which `up[link]` holds.
    pub fn routes(&self, up: Vec<bool>) {
        let _ = self.tx.send(Change::Routes(up));
    }

    /// GPU `gpu`'s interface is gone: no more pacing (or warnings) for it.
    pub fn gone(&self, gpu: usize) {
        let _ = self.tx.send(Change::Gone(gpu));
    }
}

/// Installs every GPU's plan on its interface (`ifindex`, a GPU's each), at the
/// topology's link rates and time scale (once `up` has settled it), and returns the
/// plans. Each worker thread moves between the GPUs' namespaces.
pub fn install_all(state: &State, topo: &Topology, ifindex: &[u32]) -> anyhow::Result<Vec<Plan>> {
    let routes = Routes::new(topo);
    let k = topo.fabric.time_scale.get();
    let plans: Vec<Plan> = (0..state.gpus.len())
        .map(|i| {
            plan(topo, &routes, HostId(i as u32), k, |l| {
                topo.links[l as usize].params.rate.bps()
            })
        })
        .collect();
    let chunk = state.gpus.len().div_ceil(PARALLEL).max(1);
    std::thread::scope(|s| {
        let workers: Vec<_> = state
            .gpus
            .chunks(chunk)
            .zip(plans.chunks(chunk))
            .zip(ifindex.chunks(chunk))
            .map(|((gpus, plans), ifindex)| {
                s.spawn(move || -> anyhow::Result<()> {
                    for ((g, p), &i) in gpus.iter().zip(plans).zip(ifindex) {
                        let ns = std::fs::File::open(g.netns_path())
                            .with_context(|| format!("opening {}", g.netns_path().display()))?;
                        sys::enter_netns(ns.as_fd())
                            .with_context(|| format!("entering {}", g.netns))?;
                        install(i, p).with_context(|| {
                            format!(
                                "{}: an htb qdisc on {} (pacing its non-TCP packets)",
                                g.name, state.tun
                            )
                        })?;
                    }
                    Ok(())
                })
            })
            .collect();
        workers.into_iter().try_for_each(|w| {
            w.join()
                .map_err(|_| anyhow::anyhow!("pacing thread panicked"))?
        })
    })?;
    Ok(plans)
}

/// Threads installing the GPUs' qdiscs at once.
const PARALLEL: usize = 4;

const RTM_NEWQDISC: u16 = 36;
const RTM_DELQDISC: u16 = 37;
const RTM_GETQDISC: u16 = 38;
const RTM_NEWTCLASS: u16 = 40;
const RTM_NEWTFILTER: u16 = 44;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_REPLACE: u16 = 0x100;
const NLM_F_EXCL: u16 = 0x200;
const NLM_F_CREATE: u16 = 0x400;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_DUMP: u16 = 0x300;
const TC_H_ROOT: u32 = 0xFFFF_FFFF;
const TCA_KIND: u16 = 1;
const TCA_OPTIONS: u16 = 2;
const TCA_HTB_PARMS: u16 = 1;
const TCA_HTB_INIT: u16 = 2;
const TCA_HTB_RATE64: u16 = 6;
const TCA_HTB_CEIL64: u16 = 7;
const TCA_U32_CLASSID: u16 = 1;
const TCA_U32_SEL: u16 = 5;
const TC_U32_TERMINAL: u8 = 1;
const TC_LINKLAYER_ETHERNET: u8 = 1;

/// `struct tcmsg`.
fn tcmsg(ifindex: i32, handle: u32, parent: u32, info: u32) -> [u8; 20] {
    let mut m = [0u8; 20];
    // family AF_UNSPEC and padding stay 0.
    m[4..8].copy_from_slice(&ifindex.to_ne_bytes());
    m[8..12].copy_from_slice(&handle.to_ne_bytes());
    m[12..16].copy_from_slice(&parent.to_ne_bytes());
    m[16..20].copy_from_slice(&info.to_ne_bytes());
    m
}

/// `struct tc_htb_opt` for a class at `rate` bytes/s (rate and ceil alike), with a bucket
/// of a millisecond at that rate but at least two 64 KiB packets (what a GSO packet may
/// be): a sender that paused may burst that much, as a host's NIC ring takes a burst.
fn htb_opt(rate: u64, overhead: u16) -> [u8; 44] {
    let spec = |m: &mut [u8]| {
        m[0] = 0; // cell_log: no rate table (linklayer set)
        m[1] = TC_LINKLAYER_ETHERNET;
        m[2..4].copy_from_slice(&overhead.to_ne_bytes());
        // cell_align 0, mpu 0
        m[8..12].copy_from_slice(&(rate.min(u32::MAX as u64) as u32).to_ne_bytes());
    };
    let burst = (rate / 1000).max(2 * 65536) as f64;
    // htb's buckets are in psched ticks of 64 ns.
    let ticks = (burst / rate as f64 * 1e9 / 64.0).min((u32::MAX / 2) as f64) as u32;
    let mut m = [0u8; 44];
    spec(&mut m[0..12]);
    spec(&mut m[12..24]);
    m[24..28].copy_from_slice(&ticks.to_ne_bytes());
    m[28..32].copy_from_slice(&ticks.to_ne_bytes());
    m[32..36].copy_from_slice(&65536u32.to_ne_bytes()); // quantum
    m
}

/// A u32 filter's options: all `keys` (offset into the IP header, mask, value; host
/// order) must match, then the packet goes to `classid`.
fn u32_filter(classid: u32, keys: &[(i32, u32, u32)]) -> Vec<u8> {
    let mut a = Attrs::default();
    a.put(TCA_KIND, b"u32\0");
    let opts = a.begin(TCA_OPTIONS);
    a.put(TCA_U32_CLASSID, &classid.to_ne_bytes());
    // struct tc_u32_sel (16 bytes) and its keys (16 bytes each).
    let mut sel = vec![0u8; 16];
    sel[0] = TC_U32_TERMINAL;
    sel[2] = keys.len() as u8;
    for &(off, mask, val) in keys {
        sel.extend_from_slice(&mask.to_be_bytes());
        sel.extend_from_slice(&(val & mask).to_be_bytes());
        sel.extend_from_slice(&off.to_ne_bytes());
        sel.extend_from_slice(&0i32.to_ne_bytes());
    }
    a.put(TCA_U32_SEL, &sel);
    a.end(opts);
    a.0
}

/// Netlink attributes, appended with their 4-byte alignment.
#[derive(Default)]
struct Attrs(Vec<u8>);

impl Attrs {
    fn put(&mut self, ty: u16, payload: &[u8]) {
        self.0
            .extend_from_slice(&((4 + payload.len()) as u16).to_ne_bytes());
        self.0.extend_from_slice(&ty.to_ne_bytes());
        self.0.extend_from_slice(payload);
        self.pad();
    }

    /// Starts a nested attribute; `end` with what it returns.
    fn begin(&mut self, ty: u16) -> usize {
        let at = self.0.len();
        self.0.extend_from_slice(&[0, 0]);
        self.0.extend_from_slice(&ty.to_ne_bytes());
        at
    }

    fn end(&mut self, at: usize) {
        let len = (self.0.len() - at) as u16;
        self.0[at..at + 2].copy_from_slice(&len.to_ne_bytes());
    }

    fn pad(&mut self) {
        while self.0.len() % 4 != 0 {
            self.0.push(0);
        }
    }
}

/// rtnetlink requests to the calling thread's network namespace, batched.
struct Netlink {
    sock: sys::RouteSocket,
    /// Requests not sent yet, and how many wait for an acknowledgement.
    out: Vec<u8>,
    pending: u32,
}

impl Netlink {
    fn open() -> io::Result<Netlink> {
        Ok(Netlink {
            sock: sys::RouteSocket::open()?,
            out: Vec::new(),
            pending: 0,
        })
    }

    /// Queues one request (sent by `flush`, acknowledged one by one).
    fn request(&mut self, ty: u16, flags: u16, header: [u8; 20], attrs: &[u8]) {
        let len = 16 + header.len() + attrs.len();
        self.pending += 1;
        let m = &mut self.out;
        m.extend_from_slice(&(len as u32).to_ne_bytes());
        m.extend_from_slice(&ty.to_ne_bytes());
        m.extend_from_slice(&(flags | NLM_F_REQUEST | NLM_F_ACK).to_ne_bytes());
        m.extend_from_slice(&self.pending.to_ne_bytes()); // sequence
        m.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel assigns
        m.extend_from_slice(&header);
        m.extend_from_slice(attrs);
        // Each message is a multiple of 4 bytes long already (header 36, attributes
        // padded).
    }

    /// Sends the queued requests in one datagram (the kernel runs them in order) and
    /// reads an acknowledgement for each: the first error, if any.
    fn flush(&mut self) -> io::Result<()> {
        self.sock.send(&self.out)?;
        self.out.clear();
        let mut first_err = None;
        let mut buf = vec![0u8; 16384];
        while self.pending > 0 {
            let n = self.sock.recv(&mut buf)?;
            let mut at = 0;
            while at + 16 <= n {
                let mlen =
                    u32::from_ne_bytes(buf[at..at + 4].try_into().expect("4 bytes")) as usize;
                let mty = u16::from_ne_bytes([buf[at + 4], buf[at + 5]]);
                if mty == NLMSG_ERROR && at + 20 <= n {
                    self.pending -= 1;
                    let err =
                        i32::from_ne_bytes(buf[at + 16..at + 20].try_into().expect("4 bytes"));
                    if err != 0 && first_err.is_none() {
                        first_err = Some(io::Error::from_raw_os_error(-err));
                    }
                }
                if mlen < 16 {
                    break;
                }
                at += (mlen + 3) & !3;
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn topo(body: &str) -> Topology {
        closbox_fabric::parse(&format!("[fabric]\nname = \"t\"\n{body}"), "t.toml").unwrap()
    }

    fn plan_of(t: &Topology, gpu: u32, k: f64) -> Plan {
        let routes = Routes::new(t);
        plan(t, &routes, HostId(gpu), k, |l| {
            t.links[l as usize].params.rate.bps()
        })
    }

    const LS: &str = "[topology]\nkind = \"leaf-spine\"\nleaves = 2\nspines = 2\ngpus_per_leaf = 2\n[links.nic]\nrate = \"1Gbit\"\n[links.leaf-spine]\nrate = \"10Gbit\"\n";

    #[test]
    fn a_gpu_with_one_nic_paces_everything_at_its_rate() {
        let t = topo(LS);
        let p = plan_of(&t, 0, 1.0);
        assert_eq!(p.rates, vec![125_000_000]);
        assert_eq!((p.default, p.by_dst.len()), (0, 0));
        assert_eq!(p.overhead as u32, t.fabric.l2_overhead);
        // Dilated: the wall rate is the fabric's ÷ time scale.
        assert_eq!(plan_of(&t, 3, 1000.0).rates, vec![125_000]);
    }

    #[test]
    fn scale_up_peers_get_their_own_class_and_the_nic_is_the_default() {
        let t = topo(
            "[topology]\nkind = \"leaf-spine\"\nleaves = 2\nspines = 1\ngpus_per_leaf = 8\n[node]\ngpus_per_node = 4\nrate = \"900Gbit\"\n[links.nic]\nrate = \"400Gbit\"\n[links.leaf-spine]\nrate = \"400Gbit\"\n",
        );
        let p = plan_of(&t, 5, 1.0);
        // 3 node peers over the scale-up link, 12 others over the NIC.
        assert_eq!(p.rates.len(), 2);
        let nic = p.default;
        assert_eq!(p.rates[nic], 50_000_000_000);
        assert_eq!(p.rates[1 - nic], 112_500_000_000);
        let mut peers: Vec<Ipv4Addr> = p.by_dst.iter().map(|(a, _)| *a).collect();
        peers.sort();
        let want: Vec<Ipv4Addr> = [4, 6, 7].iter().map(|&i| t.hosts[i].addr).collect();
        assert_eq!(peers, want);
        assert!(p.by_dst.iter().all(|(_, c)| *c == 1 - nic));
    }

    #[test]
    fn a_rate_raised_from_a_crawl_lays_the_qdisc_anew() {
        let t = topo(LS);
        let plans = (0..4).map(|g| plan_of(&t, g, 1.0)).collect();
        let mut p = Plans::new(&t, plans);
        let nic = p.plans[0].links[0][0];
        // Down to 100 Mbit/s and back: changed in place (a frame takes 0.12 ms).
        assert_eq!(p.apply(Change::Rate(nic, 100_000_000)), vec![(0, true)]);
        assert_eq!(p.apply(Change::Rate(nic, 1_000_000_000)), vec![(0, true)]);
        // Down to 1 Mbit/s: in place; back up from it (a frame took 12 ms): anew.
        assert_eq!(p.apply(Change::Rate(nic, 1_000_000)), vec![(0, true)]);
        assert_eq!(p.apply(Change::Rate(nic, 1_000_000_000)), vec![(0, false)]);
        assert_eq!(p.apply(Change::Rate(nic, 1_000_000_000)), vec![]);
    }

    #[test]
    fn a_mesh_has_a_class_per_direct_link() {
        let t = topo("[topology]\nkind = \"full-mesh\"\ngpus = 4\n[links.nic]\nrate = \"2Gbit\"\n");
        let p = plan_of(&t, 0, 1.0);
        assert_eq!(p.rates, vec![250_000_000; 3]);
        assert_eq!(p.by_dst.len(), 2);
        assert!(p.by_dst.iter().all(|(_, c)| *c != p.default));
    }

    #[test]
    fn a_rate_change_reaches_only_the_classes_over_that_link() {
        let t = topo(LS);
        let mut p = plan_of(&t, 0, 10.0);
        let nic = p.links[0][0];
        assert!(!p.rerate(|l| t.links[l as usize].params.rate.bps()));
        assert!(p.rerate(|l| if l == nic { 100_000_000 } else { 1 }));
        assert_eq!(p.rates, vec![1_250_000]);
    }

    /// Two GPUs, each with a NIC link to both of two switches (ECMP over its NICs).
    const DUAL: &str = "[topology]\nkind = \"custom\"\n[links.nic]\nrate = \"100Mbit\"\n[[switch]]\nname = \"s0\"\ntier = \"leaf\"\n[[switch]]\nname = \"s1\"\ntier = \"leaf\"\n[[host]]\nname = \"a\"\n[[host]]\nname = \"b\"\n[[link]]\na = \"a\"\nb = \"s0\"\n[[link]]\na = \"a\"\nb = \"s1\"\n[[link]]\na = \"b\"\nb = \"s0\"\n[[link]]\na = \"b\"\nb = \"s1\"\n";

    fn plans_of(t: &Topology) -> Plans {
        let routes = Routes::new(t);
        let plans = (0..t.hosts.len() as u32)
            .map(|g| {
                plan(t, &routes, HostId(g), 1.0, |l| {
                    t.links[l as usize].params.rate.bps()
                })
            })
            .collect();
        Plans::new(t, plans)
    }

    #[test]
    fn a_gpu_whose_nic_link_fails_is_paced_at_the_links_it_has_left() {
        // Links: 0 a-s0, 1 a-s1, 2 b-s0, 3 b-s1.
        let t = topo(DUAL);
        let mut p = plans_of(&t);
        assert_eq!(p.plans[0].rates, vec![25_000_000]);
        // a-s1 down: routes converge over a-s0 alone, and b reaches a through s0 only.
        let mut up = vec![true; t.links.len()];
        up[1] = false;
        assert_eq!(p.apply(Change::Routes(up)), vec![(0, true), (1, true)]);
        assert_eq!(p.plans[0].links, vec![vec![0]]);
        assert_eq!(p.plans[1].links, vec![vec![2]]);
        assert_eq!(p.plans[0].rates, vec![12_500_000]);
        // A rate change on the link that failed reaches nobody now; on a-s0, a.
        assert_eq!(p.apply(Change::Rate(1, 50_000_000)), vec![]);
        assert_eq!(p.apply(Change::Rate(0, 50_000_000)), vec![(0, true)]);
        assert_eq!(p.plans[0].rates, vec![6_250_000]);
        // Back up: both links again, at the rates they have now.
        let all = vec![true; t.links.len()];
        assert_eq!(
            p.apply(Change::Routes(all.clone())),
            vec![(0, true), (1, true)]
        );
        assert_eq!(
            (p.plans[0].rates[0], p.plans[1].rates[0]),
            (12_500_000, 25_000_000)
        );
        assert_eq!(p.apply(Change::Routes(all)), vec![]);
        // a's interface gone: nothing more is laid there (it warned at every change).
        assert_eq!(p.apply(Change::Gone(0)), vec![]);
        let mut up = vec![true; t.links.len()];
        up[1] = false;
        assert_eq!(p.apply(Change::Routes(up)), vec![(1, true)]);
        assert_eq!(p.apply(Change::Rate(0, 1_000_000)), vec![]);
    }

    #[test]
    fn a_destination_that_moves_to_other_links_gets_its_classes_laid_anew() {
        // Full mesh of 4: gpu0 reaches gpu1 over their direct link; with it down, gpu0
        // reaches gpu1 some other way or not at all, and gpu0's classes change.
        let t = topo("[topology]\nkind = \"full-mesh\"\ngpus = 4\n[links.nic]\nrate = \"2Gbit\"\n");
        let mut p = plans_of(&t);
        let direct = t
            .links
            .iter()
            .position(|l| {
                use closbox_fabric::topology::Vertex::Host;
                let ends = [l.a, l.b];
                ends.contains(&Host(HostId(0))) && ends.contains(&Host(HostId(1)))
            })
            .unwrap();
        let mut up = vec![true; t.links.len()];
        up[direct] = false;
        let changed = p.apply(Change::Routes(up));
        assert!(changed.contains(&(0, false)), "{changed:?}");
        assert!(p.plans[0]
            .links
            .iter()
            .all(|l| !l.contains(&(direct as u32))));
        // Nobody's classes use the failed link any more.
        assert!(!p.users.contains_key(&(direct as u32)));
    }

    #[test]
    fn the_root_qdisc_of_an_interface_is_read_from_a_dump() {
        // Messages as the kernel lays them: header, tcmsg, attributes.
        let msg = |ty: u16, ifindex: i32, handle: u32, parent: u32, kind: &[u8]| {
            let mut a = Attrs::default();
            if !kind.is_empty() {
                a.put(TCA_KIND, kind);
            }
            a.put(TCA_OPTIONS, &[0; 8]);
            let mut m = Vec::new();
            m.extend_from_slice(&((36 + a.0.len()) as u32).to_ne_bytes());
            m.extend_from_slice(&ty.to_ne_bytes());
            m.extend_from_slice(&[0; 10]);
            m.extend_from_slice(&tcmsg(ifindex, handle, parent, 0));
            m.extend_from_slice(&a.0);
            m
        };
        let mut dump = msg(RTM_NEWQDISC, 1, 0, TC_H_ROOT, b"noqueue\0");
        dump.extend(msg(RTM_NEWQDISC, 2, 0x8001_0000, 0x0001_0001, b"pfifo\0"));
        dump.extend(msg(RTM_NEWQDISC, 2, ROOT_HANDLE, TC_H_ROOT, b"htb\0"));
        let mut root = None;
        assert!(!qdiscs_in(&dump, 2, &mut root).unwrap());
        assert_eq!(root, Some((ROOT_HANDLE, "htb".to_string())));
        // The end of the dump, in a datagram of its own; another interface's root.
        let mut done = vec![0u8; 20];
        done[0] = 20;
        done[4..6].copy_from_slice(&NLMSG_DONE.to_ne_bytes());
        let mut root = None;
        assert!(!qdiscs_in(&dump, 1, &mut root).unwrap());
        assert!(qdiscs_in(&done, 1, &mut root).unwrap());
        assert_eq!(root, Some((0, "noqueue".to_string())));
        // An error ends it with the error; a cut message is not read past its end.
        let mut err = vec![0u8; 20];
        err[0] = 20;
        err[4..6].copy_from_slice(&NLMSG_ERROR.to_ne_bytes());
        err[16..20].copy_from_slice(&(-libc::EPERM).to_ne_bytes());
        let e = qdiscs_in(&err, 1, &mut None).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPERM));
        let cut = &dump[..40];
        let mut root = None;
        assert!(!qdiscs_in(cut, 1, &mut root).unwrap());
        assert_eq!(root, Some((0, String::new())));
    }

    #[test]
    fn netlink_messages_are_laid_out_as_the_kernel_reads_them() {
        // tc_htb_opt: rate and ceil specs (linklayer ethernet, overhead), then buffer and
        // cbuffer in 64 ns ticks, quantum.
        let o = htb_opt(125_000_000, 38);
        assert_eq!((o[1], u16::from_ne_bytes([o[2], o[3]])), (1, 38));
        assert_eq!(
            u32::from_ne_bytes(o[8..12].try_into().unwrap()),
            125_000_000
        );
        assert_eq!(o[12..24], o[0..12]);
        let ticks = u32::from_ne_bytes(o[24..28].try_into().unwrap()) as f64;
        // The bucket: 2 x 64 KiB at 1 Gbit/s is 1.05 ms.
        assert!((ticks * 64.0 - 1_048_576.0).abs() < 100.0, "{ticks}");
        // A u32 filter: kind, then options nesting classid and a selector with one key.
        let f = u32_filter(0x0001_0002, &[(16, u32::MAX, 0xc612_0001)]);
        assert_eq!(&f[4..8], b"u32\0");
        let opts_len = u16::from_ne_bytes([f[8], f[9]]) as usize;
        assert_eq!(opts_len, f.len() - 8);
        assert_eq!(
            u32::from_ne_bytes(f[16..20].try_into().unwrap()),
            0x0001_0002
        );
        let sel = &f[24..];
        assert_eq!((sel[0], sel[2]), (TC_U32_TERMINAL, 1));
        assert_eq!(&sel[16..20], &[0xff; 4]);
        assert_eq!(&sel[20..24], &[0xc6, 0x12, 0, 1]);
        assert_eq!(i32::from_ne_bytes(sel[24..28].try_into().unwrap()), 16);
    }
}
