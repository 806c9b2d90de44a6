//! Topology files (TOML): parse, validate, build a `Topology`.
//!
//! Parse into raw structs that reject unknown keys, validate every value against its key's
//! position in the file, then hand settled numbers to a generator. Every error names the
//! file, line and column and what is wrong; nothing here panics on input.

use std::fmt;
use std::ops::Range;
use std::path::Path;

use serde::Deserialize;
use toml::Spanned;

use crate::generate::{self, Builder, Settings};
use crate::topology::{
    Ecn, FabricParams, Ipv4Net, LinkClass, LinkParams, QueueParams, Routing, Shape, SwitchParams,
    Tier, Topology, Vertex,
};
use crate::units::{Bandwidth, Bytes, Duration, TimeScale};

/// A topology file that cannot be used, with where and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct ConfigError {
    pub file: String,
    /// 1-based line and column; `None` when the problem is the file as a whole.
    pub position: Option<(usize, usize)>,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.position {
            Some((line, col)) => write!(f, "{}:{line}:{col}: {}", self.file, self.message),
            None => write!(f, "{}: {}", self.file, self.message),
        }
    }
}

/// Reads and validates a topology file: a regular file of at most `MAX_FILE_BYTES`
/// (a FIFO, device or directory is refused without reading it).
pub fn load(path: &Path) -> Result<Topology, ConfigError> {
    let file = path.display().to_string();
    let text = read_limited(path).map_err(|message| ConfigError {
        file: file.clone(),
        position: None,
        message,
    })?;
    parse(&text, &file)
}

fn read_limited(path: &Path) -> Result<String, String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    // O_NONBLOCK: opening a FIFO must not wait for a writer; regular files ignore it.
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| format!("cannot read: {e}"))?;
    let meta = f.metadata().map_err(|e| format!("cannot read: {e}"))?;
    if !meta.is_file() {
        return Err("not a regular file (a topology file is a TOML text file)".into());
    }
    if meta.len() > MAX_FILE_BYTES {
        return Err(format!(
            "{} bytes is too large for a topology file (at most {} bytes)",
            meta.len(),
            MAX_FILE_BYTES
        ));
    }
    let mut bytes = Vec::new();
    f.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read: {e}"))?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(format!(
            "too large for a topology file (at most {MAX_FILE_BYTES} bytes)"
        ));
    }
    String::from_utf8(bytes).map_err(|e| {
        format!(
            "not UTF-8 text (invalid byte at offset {})",
            e.utf8_error().valid_up_to()
        )
    })
}

/// Validates topology text; `file` names it in errors.
pub fn parse(text: &str, file: &str) -> Result<Topology, ConfigError> {
    let cx = Cx { text, file };
    let raw: RawFile = toml::from_str(text).map_err(|e| {
        let msg = plain_words(e.message().trim_end());
        cx.err_at(e.span(), msg)
    })?;
    if let Some(kind) = raw.nic.as_ref().and_then(|n| n.tcp_congestion.as_ref()) {
        check_congestion(&cx, kind)?;
    }
    build(&cx, raw)
}

/// Serde's words for what it expected, in the words of topology files: no Rust types.
fn plain_words(msg: &str) -> String {
    let mut out = msg.to_owned();
    for (rust, plain) in [
        ("expected f64", "expected a number"),
        ("expected i64", "expected a whole number"),
        ("expected u64", "expected a whole number (0 or more)"),
        ("expected u32", "expected a whole number (0 or more)"),
        (
            "expected struct RawEcn",
            "expected a table such as { k = \"100KiB\" } or { min = \"50KiB\", max = \"200KiB\" }",
        ),
    ] {
        out = out.replace(rust, plain);
    }
    // Any other raw struct is a table of this file.
    if let Some(i) = out.find("expected struct Raw") {
        out.truncate(i);
        out += "expected a table";
    }
    out
}

/// A namespace may use only the congestion controls the host allows
/// (`net.ipv4.tcp_allowed_congestion_control`): checked here, with a position, rather
/// than when `up` is half-way. Skipped where the host does not say (not Linux).
fn check_congestion(cx: &Cx, kind: &Spanned<String>) -> Result<(), ConfigError> {
    let Ok(allowed) = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_allowed_congestion_control")
    else {
        return Ok(());
    };
    let want = kind.get_ref();
    if allowed.split_whitespace().any(|a| a == want) {
        return Ok(());
    }
    Err(cx.err(
        kind,
        format!(
            "`tcp_congestion` = {want:?} is not one this host lets a network namespace use ({}; see net.ipv4.tcp_allowed_congestion_control)",
            allowed.split_whitespace().collect::<Vec<_>>().join(", ")
        ),
    ))
}

/// Default address pool: RFC 2544 benchmarking range, never routed on the internet.
pub const DEFAULT_POOL: &str = "198.18.0.0/15";
pub const DEFAULT_MTU: u32 = 1500;
pub const DEFAULT_L2_OVERHEAD: u32 = 38;
/// Largest topology file read: a custom file of ~25,000 hosts and links (parsing takes
/// ~45 bytes of memory per byte of such a file).
pub const MAX_FILE_BYTES: u64 = 1 << 20;
/// Most GPUs a topology may declare (a namespace and a TUN each, on one box).
pub const MAX_GPUS: u64 = 65_536;
/// Most switches a topology may declare (node switches included).
pub const MAX_SWITCHES: u64 = 65_536;
/// Most links a topology may declare (a full mesh of 2048 GPUs has 2,096,128).
pub const MAX_LINKS: u64 = 1 << 22;
/// Longest link delay or switch latency: fabric time must not overflow, and no GPU fabric
/// has cables a second long.
pub const MAX_DELAY: Duration = Duration::from_millis(1_000);

struct Cx<'a> {
    text: &'a str,
    file: &'a str,
}

impl Cx<'_> {
    fn err_at(&self, span: Option<Range<usize>>, message: impl Into<String>) -> ConfigError {
        ConfigError {
            file: self.file.to_owned(),
            position: span.map(|s| line_col(self.text, s.start)),
            message: message.into(),
        }
    }

    fn err<T>(&self, at: &Spanned<T>, message: impl Into<String>) -> ConfigError {
        self.err_at(Some(at.span()), message)
    }
}

fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
    (line, col)
}

// ---- raw file ------------------------------------------------------------------------

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    fabric: RawFabric,
    topology: Spanned<RawTopology>,
    node: Option<RawNode>,
    nic: Option<RawQueue>,
    #[serde(default)]
    links: RawLinks,
    #[serde(default)]
    switches: RawSwitches,
    #[serde(default, rename = "switch")]
    switch_list: Vec<Spanned<RawSwitch>>,
    #[serde(default, rename = "host")]
    host_list: Vec<Spanned<RawHost>>,
    #[serde(default, rename = "link")]
    link_list: Vec<Spanned<RawLink>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFabric {
    name: Spanned<String>,
    #[serde(default)]
    seed: u64,
    time_scale: Option<Spanned<f64>>,
    address_pool: Option<Spanned<String>>,
    mtu: Option<Spanned<i64>>,
    l2_overhead: Option<Spanned<Bytes>>,
    packet_memory: Option<Spanned<Bytes>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTopology {
    kind: Spanned<String>,
    gpus: Option<Spanned<i64>>,
    nodes: Option<Spanned<i64>>,
    leaves: Option<Spanned<i64>>,
    spines: Option<Spanned<i64>>,
    gpus_per_leaf: Option<Spanned<i64>>,
    nodes_per_leaf: Option<Spanned<i64>>,
    uplinks: Option<Spanned<i64>>,
    k: Option<Spanned<i64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNode {
    gpus_per_node: Option<Spanned<i64>>,
    rate: Option<Bandwidth>,
    delay: Option<Spanned<Duration>>,
    latency: Option<Spanned<Duration>>,
    buffer: Option<Spanned<Bytes>>,
    ecn: Option<Spanned<RawEcn>>,
    loss: Option<Spanned<f64>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawQueue {
    buffer: Option<Spanned<Bytes>>,
    ecn: Option<Spanned<RawEcn>>,
    tcp_congestion: Option<Spanned<String>>,
    tcp_ecn: Option<bool>,
    tcp_slow_start_after_idle: Option<bool>,
}

#[derive(Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawEcn {
    k: Option<Spanned<Bytes>>,
    min: Option<Spanned<Bytes>>,
    max: Option<Spanned<Bytes>>,
    p_max: Option<Spanned<f64>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawLinkClass {
    rate: Option<Bandwidth>,
    delay: Option<Spanned<Duration>>,
    loss: Option<Spanned<f64>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawLinks {
    nic: Option<RawLinkClass>,
    #[serde(rename = "leaf-spine")]
    leaf_spine: Option<RawLinkClass>,
    #[serde(rename = "spine-core")]
    spine_core: Option<RawLinkClass>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawSwitchTier {
    latency: Option<Spanned<Duration>>,
    buffer: Option<Spanned<Bytes>>,
    ecn: Option<Spanned<RawEcn>>,
    routing: Option<Spanned<String>>,
    radix: Option<Spanned<i64>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawSwitches {
    leaf: Option<RawSwitchTier>,
    spine: Option<RawSwitchTier>,
    core: Option<RawSwitchTier>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSwitch {
    name: Spanned<String>,
    tier: Spanned<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHost {
    name: Spanned<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLink {
    a: Spanned<String>,
    b: Spanned<String>,
    class: Option<Spanned<String>>,
    count: Option<Spanned<i64>>,
    rate: Option<Bandwidth>,
    delay: Option<Spanned<Duration>>,
    loss: Option<Spanned<f64>>,
}

// ---- defaults ------------------------------------------------------------------------

/// Default link settings per class (documented in the README).
pub fn default_link(class: LinkClass) -> LinkParams {
    let (rate, delay) = match class {
        LinkClass::Nvlink => (Bandwidth::from_bps(3_600_000_000_000), 0),
        LinkClass::Nic => (Bandwidth::from_gbps(400), 100),
        LinkClass::LeafSpine => (Bandwidth::from_gbps(400), 500),
        LinkClass::SpineCore => (Bandwidth::from_gbps(400), 1_000),
    };
    LinkParams {
        rate,
        delay: Duration::from_nanos(delay),
        loss: 0.0,
    }
}

/// Default switch settings per tier (documented in the README).
pub fn default_switch(tier: Tier) -> SwitchParams {
    SwitchParams {
        latency: Duration::from_nanos(if tier == Tier::Node { 300 } else { 600 }),
        queue: QueueParams {
            buffer: Bytes::new(if tier == Tier::Node { 4 << 20 } else { 1 << 20 }),
            ecn: None,
        },
        routing: Routing::Ecmp,
        radix: None,
    }
}

pub const DEFAULT_NIC_BUFFER: Bytes = Bytes::new(2 << 20);

/// Bounds of `[fabric] packet_memory`, and of its default.
pub const MIN_PACKET_MEMORY: u64 = 16 << 20;
pub const MAX_PACKET_MEMORY: u64 = 16 << 30;
pub const DEFAULT_PACKET_MEMORY_CAP: u64 = 1 << 30;

/// Default packet memory: every port's buffer full of full-size packets (plus a quarter
/// for per-packet overhead and packets on the wire), at least 32 MiB, at most 1 GiB.
pub fn default_packet_memory(topo: &Topology) -> Bytes {
    let buffer_of = |v: Vertex| match v {
        Vertex::Host(_) => topo.fabric.nic_queue.buffer.get(),
        Vertex::Switch(s) => topo.switches[s.0 as usize].params.queue.buffer.get(),
    };
    let total = topo
        .links
        .iter()
        .map(|l| buffer_of(l.a).saturating_add(buffer_of(l.b)))
        .fold(0u64, u64::saturating_add);
    Bytes::new(
        total
            .saturating_add(total / 4)
            .clamp(32 << 20, DEFAULT_PACKET_MEMORY_CAP),
    )
}

// ---- validation ----------------------------------------------------------------------

fn count(cx: &Cx, v: &Spanned<i64>, key: &str, min: i64, max: i64) -> Result<u32, ConfigError> {
    let n = *v.get_ref();
    if n < min || n > max {
        return Err(cx.err(v, format!("`{key}` = {n} is out of range {min}..={max}")));
    }
    Ok(n as u32)
}

/// A delay or latency, at most `MAX_DELAY`.
fn duration(
    cx: &Cx,
    v: &Option<Spanned<Duration>>,
    key: &str,
) -> Result<Option<Duration>, ConfigError> {
    match v {
        Some(d) if *d.get_ref() > MAX_DELAY => Err(cx.err(
            d,
            format!(
                "`{key}` = {} is longer than the {MAX_DELAY} closbox allows",
                d.get_ref()
            ),
        )),
        Some(d) => Ok(Some(*d.get_ref())),
        None => Ok(None),
    }
}

fn probability(cx: &Cx, v: &Spanned<f64>, key: &str) -> Result<f64, ConfigError> {
    let p = *v.get_ref();
    if !(0.0..1.0).contains(&p) {
        return Err(cx.err(v, format!("`{key}` = {p} must be in [0, 1)")));
    }
    Ok(p)
}

fn ecn(cx: &Cx, table: &Spanned<RawEcn>) -> Result<Ecn, ConfigError> {
    let e = table.get_ref();
    let at = [&e.k, &e.min, &e.max]
        .into_iter()
        .flatten()
        .map(|b| b.span())
        .chain(e.p_max.as_ref().map(|p| p.span()))
        .min_by_key(|s| s.start)
        .or(Some(table.span()));
    let v = |b: &Option<Spanned<Bytes>>| b.as_ref().map(|b| *b.get_ref());
    match (v(&e.k), v(&e.min), v(&e.max), &e.p_max) {
        (Some(k), None, None, None) => Ok(Ecn::Step { k }),
        (None, Some(min), Some(max), p) => {
            if min >= max {
                return Err(cx.err_at(at, format!("ecn: min ({min}) must be below max ({max})")));
            }
            let p_max = match p {
                Some(p) if *p.get_ref() > 0.0 && *p.get_ref() <= 1.0 => *p.get_ref(),
                Some(p) => return Err(cx.err(p, "ecn: `p_max` must be in (0, 1]")),
                None => 1.0,
            };
            Ok(Ecn::Red { min, max, p_max })
        }
        _ => Err(cx.err_at(
            at,
            "ecn: give either `k` (step marking) or `min` and `max` (RED-like, optional `p_max`)",
        )),
    }
}

fn queue(
    cx: &Cx,
    buffer: &Option<Spanned<Bytes>>,
    ecn_raw: &Option<Spanned<RawEcn>>,
    default: QueueParams,
) -> Result<QueueParams, ConfigError> {
    let buffer = match buffer {
        Some(b) if b.get_ref().get() == 0 => return Err(cx.err(b, "`buffer` must be above 0")),
        Some(b) => *b.get_ref(),
        None => default.buffer,
    };
    let ecn = ecn_raw.as_ref().map(|e| ecn(cx, e)).transpose()?;
    let first_mark = match ecn {
        Some(Ecn::Step { k }) => Some(k),
        Some(Ecn::Red { min, .. }) => Some(min),
        None => None,
    };
    if let (Some(at), Some(mark)) = (ecn_raw, first_mark) {
        if mark >= buffer {
            return Err(cx.err(
                at,
                format!("ecn: marking starts at {mark}, not below the buffer of {buffer}: no packet would ever be marked"),
            ));
        }
    }
    Ok(QueueParams { buffer, ecn })
}

fn link_params(
    cx: &Cx,
    rate: Option<Bandwidth>,
    delay: &Option<Spanned<Duration>>,
    loss: &Option<Spanned<f64>>,
    base: LinkParams,
) -> Result<LinkParams, ConfigError> {
    Ok(LinkParams {
        rate: rate.unwrap_or(base.rate),
        delay: duration(cx, delay, "delay")?.unwrap_or(base.delay),
        loss: match loss {
            Some(p) => probability(cx, p, "loss")?,
            None => base.loss,
        },
    })
}

fn switch_tier(
    cx: &Cx,
    raw: &Option<RawSwitchTier>,
    tier: Tier,
) -> Result<SwitchParams, ConfigError> {
    let d = default_switch(tier);
    let Some(r) = raw else { return Ok(d) };
    let routing = match &r.routing {
        None => d.routing,
        Some(s) => match s.get_ref().as_str() {
            "ecmp" => Routing::Ecmp,
            "spray" => Routing::Spray,
            "adaptive" => Routing::Adaptive,
            other => {
                return Err(cx.err(
                    s,
                    format!(
                        "unknown routing {other:?}; expected \"ecmp\", \"spray\" or \"adaptive\""
                    ),
                ))
            }
        },
    };
    Ok(SwitchParams {
        latency: duration(cx, &r.latency, "latency")?.unwrap_or(d.latency),
        queue: queue(cx, &r.buffer, &r.ecn, d.queue)?,
        routing,
        radix: r
            .radix
            .as_ref()
            .map(|v| count(cx, v, "radix", 1, 65_536))
            .transpose()?,
    })
}

fn build(cx: &Cx, raw: RawFile) -> Result<Topology, ConfigError> {
    let fabric = fabric_params(cx, &raw)?;

    let mut links = LinkClass::ALL.map(default_link);
    for (class, r) in [
        (LinkClass::Nic, &raw.links.nic),
        (LinkClass::LeafSpine, &raw.links.leaf_spine),
        (LinkClass::SpineCore, &raw.links.spine_core),
    ] {
        if let Some(r) = r {
            links[class as usize] =
                link_params(cx, r.rate, &r.delay, &r.loss, links[class as usize])?;
        }
    }
    let mut tiers = [
        default_switch(Tier::Node),
        switch_tier(cx, &raw.switches.leaf, Tier::Leaf)?,
        switch_tier(cx, &raw.switches.spine, Tier::Spine)?,
        switch_tier(cx, &raw.switches.core, Tier::Core)?,
    ];
    let mut gpus_per_node = 1;
    if let Some(n) = &raw.node {
        if let Some(g) = &n.gpus_per_node {
            gpus_per_node = count(cx, g, "gpus_per_node", 1, 1024)?;
        }
        let nv = &mut links[LinkClass::Nvlink as usize];
        *nv = link_params(cx, n.rate, &n.delay, &n.loss, *nv)?;
        let sw = &mut tiers[Tier::Node as usize];
        sw.latency = duration(cx, &n.latency, "latency")?.unwrap_or(sw.latency);
        sw.queue = queue(cx, &n.buffer, &n.ecn, sw.queue)?;
    }
    let settings = Settings { links, tiers };
    let builder = Builder::new(fabric, settings);

    let mut topo = generate_shape(cx, &raw, builder, gpus_per_node)?;
    topo.fabric.packet_memory = match &raw.fabric.packet_memory {
        Some(m) if !(MIN_PACKET_MEMORY..=MAX_PACKET_MEMORY).contains(&m.get_ref().get()) => {
            return Err(cx.err(
                m,
                format!(
                    "`packet_memory` must be between {} and {}",
                    Bytes::new(MIN_PACKET_MEMORY),
                    Bytes::new(MAX_PACKET_MEMORY)
                ),
            ))
        }
        Some(m) => *m.get_ref(),
        None => default_packet_memory(&topo),
    };
    check_pool(cx, &raw, &topo)?;
    check_radix(cx, &raw, &topo)?;
    check_applies(cx, &raw, &topo)?;
    Ok(topo)
}

fn fabric_params(cx: &Cx, raw: &RawFile) -> Result<FabricParams, ConfigError> {
    let f = &raw.fabric;
    let name = f.name.get_ref();
    crate::names::check_fabric_name(name).map_err(|e| cx.err(&f.name, e))?;
    let time_scale = match &f.time_scale {
        Some(t) if !(t.get_ref().is_finite() && *t.get_ref() >= 1.0 && *t.get_ref() <= 1e6) => {
            return Err(cx.err(
                t,
                "`time_scale` must be between 1 (real time) and 1000000 (the fabric runs that many times slower than wall time)",
            ))
        }
        Some(t) => TimeScale::new(*t.get_ref()).expect("checked above"),
        None => TimeScale::REAL_TIME,
    };
    let pool = match &f.address_pool {
        Some(p) => p.get_ref().parse::<Ipv4Net>().map_err(|e| cx.err(p, e))?,
        None => DEFAULT_POOL.parse().expect("default pool parses"),
    };
    let mtu = match &f.mtu {
        Some(m) => count(cx, m, "mtu", 576, 65_535)?,
        None => DEFAULT_MTU,
    };
    let l2_overhead = match &f.l2_overhead {
        Some(o) if o.get_ref().get() > 1024 => {
            return Err(cx.err(
                o,
                "`l2_overhead` above 1024 bytes per frame is not plausible",
            ))
        }
        Some(o) => o.get_ref().get() as u32,
        None => DEFAULT_L2_OVERHEAD,
    };
    let nic = raw.nic.as_ref();
    let nic_queue = queue(
        cx,
        &nic.and_then(|n| n.buffer.clone()),
        &nic.and_then(|n| n.ecn.clone()),
        QueueParams {
            buffer: DEFAULT_NIC_BUFFER,
            ecn: None,
        },
    )?;
    let congestion = match nic.and_then(|n| n.tcp_congestion.as_ref()) {
        Some(c) => {
            let v = c.get_ref();
            if v.is_empty()
                || v.len() > 15
                || !v.chars().all(|ch| ch.is_ascii_alphanumeric() || ch == '_')
            {
                return Err(cx.err(c, format!("`tcp_congestion` {v:?} is not a congestion control name (cubic, bbr, reno, …)")));
            }
            Some(v.clone())
        }
        None => None,
    };
    Ok(FabricParams {
        host_tcp: crate::topology::HostTcp {
            congestion,
            ecn: nic.and_then(|n| n.tcp_ecn).unwrap_or(true),
            slow_start_after_idle: nic
                .and_then(|n| n.tcp_slow_start_after_idle)
                .unwrap_or(false),
        },
        name: name.clone(),
        seed: f.seed,
        time_scale,
        pool,
        mtu,
        l2_overhead,
        nic_queue,
        // Settled in `build` once the ports are known.
        packet_memory: Bytes::new(0),
    })
}

/// The topology keys each kind accepts (others present are errors).
fn allowed_keys(kind: &str) -> Option<&'static [&'static str]> {
    Some(match kind {
        "single-switch" | "full-mesh" => &["gpus", "nodes"],
        "leaf-spine" => &[
            "leaves",
            "spines",
            "gpus_per_leaf",
            "nodes_per_leaf",
            "uplinks",
        ],
        "fat-tree" => &["k"],
        "rail-optimized" => &["nodes", "spines", "uplinks"],
        "superpod-su" | "custom" => &[],
        _ => return None,
    })
}

const KINDS: &str =
    "\"single-switch\", \"full-mesh\", \"leaf-spine\", \"fat-tree\", \"rail-optimized\", \"superpod-su\" or \"custom\"";

/// What a topology declares, counted before anything is built (u64: no product wraps).
#[derive(Clone, Copy, Debug)]
struct Declared {
    hosts: u64,
    switches: u64,
    links: u64,
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
    fn check<T>(self, cx: &Cx, at: &Spanned<T>, kind: &str) -> Result<(), ConfigError> {
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

fn generate_shape(cx: &Cx, raw: &RawFile, b: Builder, gpn: u32) -> Result<Topology, ConfigError> {
    let t = raw.topology.get_ref();
    let kind = t.kind.get_ref().as_str();
    let allowed = allowed_keys(kind).ok_or_else(|| {
        cx.err(
            &t.kind,
            format!("unknown topology kind {kind:?}; expected {KINDS}"),
        )
    })?;
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
                format!("`{key}` does not apply to topology kind {kind:?}: {hint}"),
            ));
        }
    }
    if kind != "custom" {
        if let Some(first) = raw.switch_list.first() {
            return Err(cx.err(
                first,
                format!("[[switch]] is only for kind \"custom\", not {kind:?}"),
            ));
        }
        if let Some(first) = raw.host_list.first() {
            return Err(cx.err(
                first,
                format!("[[host]] is only for kind \"custom\", not {kind:?}"),
            ));
        }
        if let Some(first) = raw.link_list.first() {
            return Err(cx.err(
                first,
                format!("[[link]] is only for kind \"custom\", not {kind:?}"),
            ));
        }
    }
    let need =
        |v: &Option<Spanned<i64>>, key: &str, min: i64, max: i64| -> Result<u32, ConfigError> {
            match v {
                Some(v) => count(cx, v, key, min, max),
                None => Err(cx.err(
                    &raw.topology,
                    format!("topology kind {kind:?} needs `{key}`"),
                )),
            }
        };
    let opt = |v: &Option<Spanned<i64>>, key: &str, default: u32| -> Result<u32, ConfigError> {
        v.as_ref()
            .map_or(Ok(default), |v| count(cx, v, key, 1, 1 << 20))
    };
    // A count of GPUs given where whole nodes are expected.
    let whole_nodes = |v: &Spanned<i64>, key: &str| -> Result<u32, ConfigError> {
        let g = count(cx, v, key, 1, 1 << 20)?;
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
        "single-switch" => {
            let nodes = node_count("single-switch")?;
            let d = Declared::nodes(nodes as u64, gpn);
            d.plus(1, d.hosts).check(cx, &raw.topology, kind)?;
            generate::single_switch(b, nodes, gpn)
        }
        "full-mesh" => {
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
        "leaf-spine" => {
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
            .check(cx, &raw.topology, kind)?;
            generate::leaf_spine(b, leaves, spines, npl, gpn, uplinks)
        }
        "fat-tree" => {
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
                .check(cx, &raw.topology, kind)?;
            generate::fat_tree(b, k, gpn)
        }
        "rail-optimized" => {
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
            .check(cx, &raw.topology, kind)?;
            let shape = Shape::RailOptimized {
                rails: gpn,
                spines,
                uplinks,
            };
            generate::rail_optimized(b, nodes, gpn, spines, uplinks, shape)
        }
        "superpod-su" => {
            let want = generate::SUPERPOD_SU.1;
            if let Some(g) = raw.node.as_ref().and_then(|n| n.gpus_per_node.as_ref()) {
                if *g.get_ref() != want as i64 {
                    return Err(cx.err(g, format!("superpod-su nodes have {want} GPUs")));
                }
            }
            generate::superpod_su(b)
        }
        "custom" => custom(cx, raw, b)?,
        _ => unreachable!("allowed_keys knows every kind"),
    };
    Ok(topo)
}

fn custom(cx: &Cx, raw: &RawFile, mut b: Builder) -> Result<Topology, ConfigError> {
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
    .check(cx, &raw.topology, "custom")?;
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
        let params = link_params(cx, r.rate, &r.delay, &r.loss, b.settings().link(class))?;
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

fn names_of(raw: &RawFile, host: u32) -> String {
    raw.host_list[host as usize]
        .get_ref()
        .name
        .get_ref()
        .clone()
}

/// Every pair of GPUs must be able to reach each other: through their node switch when in
/// one node, else over scale-out links through switches, or over a direct link. GPUs
/// never forward for others, so a GPU reachable only through another GPU is an error.
fn check_connected(cx: &Cx, raw: &RawFile, topo: &Topology) -> Result<(), ConfigError> {
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

/// Ranges a fabric's addresses must stay out of: they mean something else to every host.
const FORBIDDEN_POOLS: [(&str, [u8; 4], u8); 4] = [
    ("\"this network\" (0.0.0.0/8)", [0, 0, 0, 0], 8),
    ("loopback (127.0.0.0/8)", [127, 0, 0, 0], 8),
    ("multicast (224.0.0.0/4)", [224, 0, 0, 0], 4),
    (
        "reserved (240.0.0.0/4, with the broadcast address)",
        [240, 0, 0, 0],
        4,
    ),
];

fn check_pool(cx: &Cx, raw: &RawFile, topo: &Topology) -> Result<(), ConfigError> {
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
fn tier_span(raw: &RawFile, t: &Option<RawSwitchTier>) -> Option<Range<usize>> {
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
fn link_span(raw: &RawFile, l: &Option<RawLinkClass>) -> Option<Range<usize>> {
    let l = l.as_ref()?;
    l.delay
        .as_ref()
        .map(|v| v.span())
        .into_iter()
        .chain(l.loss.as_ref().map(|v| v.span()))
        .min_by_key(|s| s.start)
        .or(Some(raw.topology.span()))
}

/// Settings for parts the topology does not have are mistakes, not silently ignored; and
/// every buffer holds at least one packet.
fn check_applies(cx: &Cx, raw: &RawFile, topo: &Topology) -> Result<(), ConfigError> {
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
            || n.loss.is_some();
        if set && !has_tier(Tier::Node) {
            // The first key set (sub-tables carry no position of their own).
            let at = [&n.delay, &n.latency]
                .into_iter()
                .flatten()
                .map(|d| d.span())
                .chain(n.buffer.as_ref().map(|b| b.span()))
                .chain(n.ecn.as_ref().map(|e| e.span()))
                .chain(n.loss.as_ref().map(|l| l.span()))
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

fn check_radix(cx: &Cx, raw: &RawFile, topo: &Topology) -> Result<(), ConfigError> {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str) -> String {
        parse(text, "t.toml").unwrap_err().to_string()
    }

    const LS: &str = r#"
[fabric]
name = "ls"
[topology]
kind = "leaf-spine"
leaves = 2
spines = 2
gpus_per_leaf = 4
"#;

    #[test]
    fn leaf_spine_loads_with_defaults() {
        let t = parse(LS, "t.toml").unwrap();
        assert_eq!(t.hosts.len(), 8);
        assert_eq!(t.switches.len(), 4);
        assert_eq!(t.links.len(), 8 + 4);
        assert_eq!(t.hosts[0].addr.to_string(), "198.18.0.1");
        assert_eq!(t.fabric.mtu, 1500);
    }

    #[test]
    fn unknown_key_names_line() {
        let e = err(&format!("{LS}bogus = 1\n"));
        assert!(e.starts_with("t.toml:9:1: "), "{e}");
        assert!(e.contains("bogus"), "{e}");
    }

    #[test]
    fn bad_unit_names_line() {
        let e = err(&format!("{LS}[links.nic]\nrate = \"10 furlongs\"\n"));
        assert!(e.starts_with("t.toml:10:8: "), "{e}");
        assert!(e.contains("invalid rate"), "{e}");
    }

    #[test]
    fn key_foreign_to_kind_is_rejected() {
        let e = err(
            "[fabric]\nname = \"x\"\n[topology]\nkind = \"single-switch\"\ngpus = 4\nspines = 2\n",
        );
        assert!(e.starts_with("t.toml:6:10: "), "{e}");
        assert!(e.contains("`spines` does not apply"), "{e}");
    }

    #[test]
    fn radix_exceeded_is_an_error() {
        let e = err(&format!("{LS}[switches.leaf]\nradix = 5\n"));
        assert!(e.contains("leaf0\" needs 6 ports"), "{e}");
        assert!(e.starts_with("t.toml:10:9"), "{e}");
    }

    #[test]
    fn custom_dangling_and_duplicate_names() {
        let base = "[fabric]\nname = \"c\"\n[topology]\nkind = \"custom\"\n[[host]]\nname = \"a\"\n[[host]]\nname = \"b\"\n[[switch]]\nname = \"s\"\ntier = \"leaf\"\n";
        let e = err(&format!("{base}[[link]]\na = \"a\"\nb = \"t\"\n"));
        assert!(e.contains("\"t\" is not a [[host]]"), "{e}");
        assert!(e.starts_with("t.toml:14:5"), "{e}");
        let e = err(&format!("{base}[[host]]\nname = \"s\"\n"));
        assert!(e.contains("duplicate name \"s\""), "{e}");
        let e = err(&format!("{base}[[link]]\na = \"a\"\nb = \"s\"\n"));
        assert!(e.contains("\"b\" cannot reach host \"a\""), "{e}");
        let ok = parse(&format!("{base}[[link]]\na = \"a\"\nb = \"s\"\n[[link]]\na = \"b\"\nb = \"s\"\nrate = \"1Gbit\"\n"), "t.toml").unwrap();
        assert_eq!(ok.links[1].params.rate, Bandwidth::from_gbps(1));
    }

    #[test]
    fn wrong_types_and_ranges_never_panic() {
        for (text, needle) in [
            ("[fabric]\nname = \"Bad Name\"\n[topology]\nkind = \"full-mesh\"\ngpus = 2\n", "fabric name"),
            ("[fabric]\nname = \"x\"\n[topology]\nkind = \"full-mesh\"\ngpus = -2\n", "out of range"),
            ("[fabric]\nname = \"x\"\n[topology]\nkind = \"fat-tree\"\nk = 5\n", "must be even"),
            ("[fabric]\nname = \"x\"\n[topology]\nkind = \"mesh\"\n", "unknown topology kind"),
            ("[fabric]\nname = \"x\"\n[topology]\nkind = \"leaf-spine\"\nleaves = 2\n", "needs `spines`"),
            ("[fabric]\nname = \"x\"\ntime_scale = 0.5\n[topology]\nkind = \"full-mesh\"\ngpus = 2\n", "time_scale"),
            ("[fabric]\nname = \"x\"\naddress_pool = \"198.18.0.1/15\"\n[topology]\nkind = \"full-mesh\"\ngpus = 2\n", "host bits"),
            ("[fabric]\nname = \"x\"\naddress_pool = \"198.18.0.0/30\"\n[topology]\nkind = \"full-mesh\"\ngpus = 3\n", "do not fit"),
            ("[fabric]\nname = \"x\"\n[topology]\nkind = \"full-mesh\"\ngpus = 2\n[links.nic]\nloss = 1.5\n", "[0, 1)"),
            ("[fabric]\nname = \"x\"\n[topology]\nkind = \"full-mesh\"\ngpus = 2\n[links.nic]\nrate = 100\n", "needs a unit"),
            ("[fabric]\nname = \"x\"\n[topology]\nkind = \"full-mesh\"\ngpus = 2\n[switches.leaf.ecn]\nk = \"1KiB\"\nmin = \"1KiB\"\n", "either `k`"),
            ("[fabric]\nname = \"x\"\n[node]\ngpus_per_node = 8\n[topology]\nkind = \"single-switch\"\ngpus = 12\n", "not a multiple"),
            ("[fabric]\nname = \"x\"\n[topology]\nkind = \"rail-optimized\"\nnodes = 2\nspines = 1\n", "gpus_per_node ≥ 2"),
            ("[fabric\n", "t.toml:1:"),
            ("", "missing field `fabric`"),
        ] {
            let e = err(text);
            assert!(e.contains(needle), "{text:?} gave {e:?}, wanted {needle:?}");
            assert!(e.starts_with("t.toml"), "{e}");
        }
    }
}
