//! Topology files (TOML): parse, validate, build a `Topology`.
//!
//! Parse into raw structs that reject unknown keys, validate every value against its key's
//! position in the file, then hand settled numbers to a generator. Every error names the
//! file, line and column and what is wrong; nothing here panics on input.

use std::fmt;
use std::ops::Range;
use std::path::Path;

use toml::Spanned;

use crate::generate::{Builder, Settings};
use crate::topology::{
    FabricParams, Ipv4Net, LinkClass, NicScheduler, QueueParams, Tier, Topology,
};
use crate::units::{Bytes, Duration, TimeScale};

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
    let text = read_limited(path, "a topology file").map_err(|message| ConfigError {
        file: file.clone(),
        position: None,
        message,
    })?;
    parse(&text, &file)
}

/// Reads a TOML text file of at most `MAX_FILE_BYTES` that is `what` ("a topology
/// file"): a FIFO, device or directory is refused without reading it.
pub fn read_limited(path: &Path, what: &str) -> Result<String, String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    if path.as_os_str() == "-" && !path.exists() {
        return Err(format!(
            "standard input is not read: give the path of {what} (it is read again by path)"
        ));
    }
    // O_NONBLOCK: opening a FIFO must not wait for a writer; regular files ignore it.
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| format!("cannot read: {e}"))?;
    let meta = f.metadata().map_err(|e| format!("cannot read: {e}"))?;
    if !meta.is_file() {
        return Err(format!("not a regular file ({what} is a TOML text file)"));
    }
    if meta.len() > MAX_FILE_BYTES {
        return Err(format!(
            "{} bytes is too large for {what} (at most {} bytes)",
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
            "too large for {what} (at most {MAX_FILE_BYTES} bytes)"
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
        let mut msg = toml_words(text, &e);
        // A scenario file's top-level keys where a topology file's were expected.
        if unknown_field(&msg).is_some_and(|k| ["event", "random", "seed"].contains(&k))
            && msg.contains("`topology`")
        {
            msg += "; this looks like a chaos scenario file, not a topology file: \
                    run it on a fabric that is up with `closbox chaos FILE` or `--chaos FILE`";
        }
        cx.err_at(e.span(), msg)
    })?;
    if let Some(kind) = raw.nic.as_ref().and_then(|n| n.tcp_congestion.as_ref()) {
        if kind.get_ref() != HOST_CONGESTION {
            check_congestion(&cx, kind)?;
        }
    }
    build(&cx, raw)
}

/// What the TOML parser says of `text`, in the words of these files (`plain_words`), a
/// duplicate key named with where it was first set.
pub fn toml_words(text: &str, e: &toml::de::Error) -> String {
    let mut msg = plain_words(e.message().trim_end());
    // `gpus = "8"`: a number in quotes.
    if let Some(quoted) = msg
        .strip_prefix("invalid type: string \"")
        .and_then(|r| r.split_once("\", expected a"))
        .map(|(q, _)| q.trim().to_owned())
    {
        if quoted.parse::<f64>().is_ok() && msg.contains("number") {
            msg += &format!(" (write {quoted} without quotes)");
        }
    }
    // A misspelt key: the expected one it is nearest to.
    if let Some(near) = unknown_field(&msg).and_then(|k| nearest_expected(k, &msg)) {
        msg += &format!("; did you mean `{near}`?");
    }
    match e.span() {
        Some(span) if msg == "duplicate key" => duplicate_key(text, span).unwrap_or(msg),
        Some(span) if msg.starts_with("string values must be quoted") => {
            unquoted(text, span).unwrap_or(msg)
        }
        _ => msg,
    }
}

/// What to write for the bare word at `span` (`rate = 1Gbit`), or that a value is
/// missing (`rate =`, `[1, ]`).
fn unquoted(text: &str, span: Range<usize>) -> Option<String> {
    let rest = text.get(span.start..)?;
    let word = rest
        .split(|c: char| c.is_whitespace() || matches!(c, '#' | ',' | ']' | '}'))
        .next()?;
    Some(if word.is_empty() {
        "a value is missing here".to_owned()
    } else {
        format!(
            "`{word}` is not quoted: write \"{word}\" (rates, sizes, times and names are strings)"
        )
    })
}

/// "duplicate key `rate` (first set at line 7): …" for the key at `span`, whose line is
/// a table header or a `key = value` line.
fn duplicate_key(text: &str, span: Range<usize>) -> Option<String> {
    // Keys and headers compared without spaces and quotes (`[ a . "b" ]` is `[a.b]`).
    let norm = |s: &str| -> String {
        s.split('#')
            .next()
            .unwrap_or("")
            .chars()
            .filter(|c| !c.is_whitespace() && !matches!(c, '"' | '\''))
            .collect()
    };
    let line_start = text.get(..span.start)?.rfind('\n').map_or(0, |i| i + 1);
    let line_end = text
        .get(span.start..)?
        .find('\n')
        .map_or(text.len(), |i| span.start + i);
    let line = text[line_start..line_end].trim();
    let earlier = text[..line_start].split_inclusive('\n');
    let number = |offset: usize| text[..offset].matches('\n').count() + 1;
    if line.starts_with('[') && !line.starts_with("[[") {
        // A table header: the same header earlier in the file.
        let header = norm(line);
        let mut offset = 0;
        for l in earlier {
            if norm(l) == header {
                return Some(format!(
                    "table {header} appears twice (first at line {}): a table's keys go under one header",
                    number(offset)
                ));
            }
            offset += l.len();
        }
        return Some(format!(
            "table {header} is defined twice (also by a dotted key or an inline table above it)"
        ));
    }
    // A key of an inline table (after the line's `=`): named as it is.
    let eq = line_start + text[line_start..line_end].find('=')?;
    if span.start > eq {
        let key = norm(text.get(span)?);
        return Some(format!(
            "duplicate key `{key}` in an inline table: a key is set once per table"
        ));
    }
    // A key (dotted or not): the same key earlier in its table (after its header).
    let key = norm(line.split('=').next()?);
    let (mut first, mut offset) = (None, 0);
    for l in earlier {
        if l.trim_start().starts_with('[') {
            first = None;
        } else if first.is_none() && l.contains('=') && norm(l.split('=').next()?) == key {
            first = Some(number(offset));
        }
        offset += l.len();
    }
    Some(match first {
        Some(n) => {
            format!("duplicate key `{key}` (first set at line {n}): a key is set once per table")
        }
        None => format!("duplicate key `{key}`: a key is set once per table"),
    })
}

/// The key of serde's "expected one of `a`, `b`, …" list within two edits of `key`
/// (one for keys of up to 4 letters), the nearest, if one is.
fn nearest_expected<'a>(key: &str, msg: &'a str) -> Option<&'a str> {
    let list = msg.split_once("expected one of ")?.1;
    let budget = if key.chars().count() <= 4 { 1 } else { 2 };
    list.split(", ")
        .filter_map(|k| k.strip_prefix('`')?.strip_suffix('`'))
        .map(|k| (edit_distance(key, k), k))
        .filter(|&(d, _)| d <= budget)
        .min_by_key(|&(d, _)| d)
        .map(|(_, k)| k)
}

/// Levenshtein distance (insertions, deletions, substitutions) in characters.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diag = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let next = (diag + usize::from(ca != cb))
                .min(row[j] + 1)
                .min(row[j + 1] + 1);
            diag = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}

/// The key named by serde's "unknown field `KEY`, expected ..." message.
pub fn unknown_field(msg: &str) -> Option<&str> {
    msg.strip_prefix("unknown field `")?.split('`').next()
}

/// Serde's words for what it expected, in the words of topology files: no Rust types.
pub fn plain_words(msg: &str) -> String {
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
    // A whole number beyond 64 bits: "invalid type: integer `N` as i128, expected …".
    if let Some((n, rest)) = out
        .strip_prefix("invalid type: integer `")
        .and_then(|r| r.split_once("` as i128"))
    {
        out = format!("`{n}` is too large{rest}");
    }
    // Beyond a signed 64-bit whole number, within 64 bits unsigned.
    if let Some((n, rest)) = out
        .strip_prefix("invalid value: integer `")
        .and_then(|r| r.split_once('`'))
        .filter(|(n, _)| n.parse::<u64>().is_ok_and(|n| n > i64::MAX as u64))
    {
        out = format!("`{n}` is too large{rest}");
    }
    out
}

/// Default address pool: RFC 2544 benchmarking range, never routed on the internet.
pub const DEFAULT_POOL: &str = "198.18.0.0/15";
pub const DEFAULT_MTU: u32 = 1500;
pub const DEFAULT_L2_OVERHEAD: u32 = 38;
/// A failed link's neighbours stop using it after this: loss of signal is seen by the
/// PHY within microseconds to a millisecond.
pub const DEFAULT_DETECTION: Duration = Duration::from_millis(1);
/// The rest of the fabric reroutes after this: eBGP with BFD in a tuned Clos fabric.
pub const DEFAULT_CONVERGENCE: Duration = Duration::from_millis(10);
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

/// The longest mean run of lost frames a link may be given (`loss_burst`).
pub const MAX_LOSS_BURST: f64 = 1e6;

/// A mean run of lost frames a link may have: 1 (independent losses) to `MAX_LOSS_BURST`.
pub fn loss_burst_ok(frames: f64) -> bool {
    (1.0..=MAX_LOSS_BURST).contains(&frames)
}

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

/// 1-based line and column of byte `offset` in `text`.
pub fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
    (line, col)
}

mod checks;
mod custom;
mod defaults;
pub mod presets;
mod raw;
mod shapes;
mod values;

use checks::*;
pub use defaults::{
    default_link, default_packet_memory, default_switch, DEFAULT_CONGESTION, DEFAULT_NIC_BUFFER,
    DEFAULT_PACKET_MEMORY_CAP, HOST_CONGESTION, MAX_PACKET_MEMORY, MIN_PACKET_MEMORY,
};
use raw::RawFile;
use shapes::generate_shape;
use values::*;

fn build(cx: &Cx, raw: RawFile) -> Result<Topology, ConfigError> {
    let preset = match &raw.fabric.preset {
        Some(p) => Some(presets::find(p.get_ref()).ok_or_else(|| {
            let names: Vec<&str> = presets::PRESETS.iter().map(|p| p.name).collect();
            cx.err(
                p,
                format!(
                    "unknown preset {:?}; expected one of {}",
                    p.get_ref(),
                    names.join(", ")
                ),
            )
        })?),
        None => None,
    };
    let fabric = fabric_params(cx, &raw, preset)?;

    let mut links = LinkClass::ALL.map(default_link);
    if let Some(p) = preset {
        for c in [LinkClass::Nic, LinkClass::LeafSpine, LinkClass::SpineCore] {
            links[c as usize].rate = p.rate;
        }
    }
    // A preset's switch settings for the scale-out tiers.
    let base = |tier: Tier| {
        let mut d = default_switch(tier);
        if let Some(p) = preset {
            d.latency = p.switch_latency;
            d.queue.ecn = p.ecn;
            d.routing = p.routing;
        }
        d
    };
    for (class, r) in [
        (LinkClass::Nic, &raw.links.nic),
        (LinkClass::LeafSpine, &raw.links.leaf_spine),
        (LinkClass::SpineCore, &raw.links.spine_core),
    ] {
        if let Some(r) = r {
            links[class as usize] = link_params(
                cx,
                r.rate,
                &r.delay,
                (&r.loss, &r.loss_burst),
                links[class as usize],
            )?;
        }
    }
    let mut tiers = [
        default_switch(Tier::Node),
        switch_tier(cx, &raw.switches.leaf, base(Tier::Leaf))?,
        switch_tier(cx, &raw.switches.spine, base(Tier::Spine))?,
        switch_tier(cx, &raw.switches.core, base(Tier::Core))?,
    ];
    let mut gpus_per_node = 1;
    if let Some(n) = &raw.node {
        if let Some(g) = &n.gpus_per_node {
            gpus_per_node = count(cx, g, "gpus_per_node", 1, 1024)?;
        }
        let nv = &mut links[LinkClass::Nvlink as usize];
        *nv = link_params(cx, n.rate, &n.delay, (&n.loss, &n.loss_burst), *nv)?;
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

fn fabric_params(
    cx: &Cx,
    raw: &RawFile,
    preset: Option<&'static presets::Preset>,
) -> Result<FabricParams, ConfigError> {
    let f = &raw.fabric;
    let name = f.name.get_ref();
    crate::names::check_fabric_name(name).map_err(|e| cx.err(&f.name, e))?;
    let bad_scale = "`time_scale` must be between 1 (real time) and 1000000 (the fabric runs that many times slower than wall time), or \"auto\" (chosen at `up` by measuring this box)";
    let (time_scale, time_scale_auto) = match f.time_scale.as_ref().map(|t| (t, t.get_ref())) {
        Some((t, raw::RawTimeScale::Number(k))) => {
            if !(k.is_finite() && *k >= 1.0 && *k <= 1e6) {
                return Err(cx.err(t, bad_scale));
            }
            (TimeScale::new(*k).expect("checked above"), false)
        }
        Some((_, raw::RawTimeScale::Word(w))) if w == "auto" => (TimeScale::REAL_TIME, true),
        Some((t, raw::RawTimeScale::Word(_))) => return Err(cx.err(t, bad_scale)),
        None => (TimeScale::REAL_TIME, false),
    };
    let pool = match &f.address_pool {
        Some(p) => p.get_ref().parse::<Ipv4Net>().map_err(|e| cx.err(p, e))?,
        None => DEFAULT_POOL.parse().expect("default pool parses"),
    };
    let mtu = match &f.mtu {
        Some(m) => count(cx, m, "mtu", 576, 65_535)?,
        None => preset.map_or(DEFAULT_MTU, |p| p.mtu),
    };
    let l2_overhead = match &f.l2_overhead {
        Some(o) if o.get_ref().get() > 1024 => {
            return Err(cx.err(
                o,
                "`l2_overhead` above 1024 bytes per frame is not plausible",
            ))
        }
        Some(o) => o.get_ref().get() as u32,
        None => preset.map_or(DEFAULT_L2_OVERHEAD, |p| p.l2_overhead),
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
    let nic_scheduler = match nic.and_then(|n| n.scheduler.as_ref()) {
        None => NicScheduler::default(),
        Some(v) => match v.get_ref().as_str() {
            "fq" => NicScheduler::Fq,
            "fifo" => NicScheduler::Fifo,
            other => {
                return Err(cx.err(
                    v,
                    format!("`scheduler` {other:?} is not a NIC scheduler (\"fq\" or \"fifo\")"),
                ))
            }
        },
    };
    let congestion = match nic.and_then(|n| n.tcp_congestion.as_ref()) {
        Some(c) => {
            let v = c.get_ref();
            if v.is_empty()
                || v.len() > 15
                || !v.chars().all(|ch| ch.is_ascii_alphanumeric() || ch == '_')
            {
                return Err(cx.err(c, format!("`tcp_congestion` {v:?} is not a congestion control name (cubic, bbr, reno, …)")));
            }
            (v != HOST_CONGESTION).then(|| v.clone())
        }
        None => Some(DEFAULT_CONGESTION.to_string()),
    };
    let tcp_ecn = nic.and_then(|n| n.tcp_ecn.as_ref());
    // DCTCP negotiates ECN on every connection whatever net.ipv4.tcp_ecn says (the kernel's
    // and closbox's alike: it cannot work without the marks), so `false` would be a lie.
    if let (Some(e), Some("dctcp")) = (tcp_ecn, congestion.as_deref()) {
        if !*e.get_ref() {
            return Err(cx.err(
                e,
                "`tcp_ecn` = false with `tcp_congestion` = \"dctcp\": DCTCP requests ECN on every connection whatever tcp_ecn says (it works from the marks); leave tcp_ecn out, or pick a congestion control that does not need ECN (\"reno\")",
            ));
        }
    }
    Ok(FabricParams {
        host_tcp: crate::topology::HostTcp {
            congestion,
            ecn: tcp_ecn.is_none_or(|e| *e.get_ref()),
            slow_start_after_idle: nic
                .and_then(|n| n.tcp_slow_start_after_idle)
                .unwrap_or(false),
        },
        name: name.clone(),
        seed: f.seed,
        time_scale,
        time_scale_auto,
        pool,
        mtu,
        l2_overhead,
        nic_queue,
        nic_scheduler,
        // Settled in `build` once the ports are known.
        packet_memory: Bytes::new(0),
        detection: duration(cx, &f.failure_detection, "failure_detection")?
            .unwrap_or(DEFAULT_DETECTION),
        convergence: duration(cx, &f.route_convergence, "route_convergence")?
            .unwrap_or(DEFAULT_CONVERGENCE),
        flow_control: flow_control(cx, f, mtu, preset.map_or("none", |p| p.flow_control))?,
        preset: preset.map(|p| p.name),
    })
}

/// Default lossless thresholds per switch ingress port (documented in the README).
pub const DEFAULT_XOFF: Bytes = Bytes::new(256 << 10);
pub const DEFAULT_DEADLOCK_AFTER: Duration = Duration::from_millis(10);

/// `flow_control = "none" | "pfc" | "credit"` with `xoff`, `xon`, `deadlock_after`.
fn flow_control(
    cx: &Cx,
    f: &raw::RawFabric,
    mtu: u32,
    preset: &str,
) -> Result<crate::topology::FlowControl, ConfigError> {
    use crate::topology::{FlowControl, PauseParams};
    let mode = f.flow_control.as_ref();
    let chosen = mode.map_or(preset, |m| m.get_ref().as_str());
    let lossless = match mode.map(|m| (m, m.get_ref().as_str())) {
        None if preset == "none" => false,
        None => true,
        Some((_, "none")) => false,
        Some((_, "pfc" | "credit")) => true,
        Some((m, other)) => {
            return Err(cx.err(
                m,
                format!("unknown `flow_control` {other:?}: \"none\" (lossy), \"pfc\" (Ethernet PFC) or \"credit\" (InfiniBand credits)"),
            ))
        }
    };
    if !lossless {
        for (key, span) in [
            ("xoff", f.xoff.as_ref().map(|v| v.span())),
            ("xon", f.xon.as_ref().map(|v| v.span())),
            (
                "deadlock_after",
                f.deadlock_after.as_ref().map(|v| v.span()),
            ),
        ] {
            if let Some(span) = span {
                return Err(cx.err_at(
                    Some(span),
                    format!("`{key}` applies to a lossless fabric (`flow_control = \"pfc\"` or \"credit\")"),
                ));
            }
        }
        return Ok(FlowControl::Lossy);
    }
    let xoff = f.xoff.as_ref().map_or(DEFAULT_XOFF, |v| *v.get_ref());
    // At least two full frames: a pause per packet would be no flow control.
    if xoff.get() < 2 * mtu as u64 {
        let span = f.xoff.as_ref().map(|v| v.span());
        return Err(cx.err_at(
            span,
            format!("`xoff` = {xoff} is below two frames of the {mtu}-byte MTU"),
        ));
    }
    let xon = match &f.xon {
        Some(v) if v.get_ref().get() > xoff.get() => {
            return Err(cx.err(
                v,
                format!("`xon` = {} is above `xoff` = {xoff}", v.get_ref()),
            ))
        }
        Some(v) => *v.get_ref(),
        None => Bytes::new(xoff.get() / 2),
    };
    let deadlock_after =
        duration(cx, &f.deadlock_after, "deadlock_after")?.unwrap_or(DEFAULT_DEADLOCK_AFTER);
    if deadlock_after == Duration::ZERO {
        let v = f.deadlock_after.as_ref().expect("only a written zero");
        return Err(cx.err(v, "`deadlock_after` must be longer than 0"));
    }
    let p = PauseParams {
        xoff,
        xon,
        deadlock_after,
    };
    Ok(match chosen {
        "credit" => FlowControl::Credit(p),
        _ => FlowControl::Pfc(p),
    })
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

    /// Each of `cases` (text after LS, the error's start) is refused so.
    fn errors_after_ls(cases: &[(&str, &str)]) {
        for (tail, want) in cases {
            let e = err(&format!("{LS}{tail}"));
            assert!(e.starts_with(want), "{tail:?}: {e}");
        }
    }

    #[test]
    fn a_duplicate_key_is_named_with_where_it_was_first_set() {
        // LS's lines: 2 [fabric], 3 name, 4 [topology], 5 kind, …, 8 gpus_per_leaf; then 9.
        errors_after_ls(&[
            (
                "spines = 4\n",
                "t.toml:9:1: duplicate key `spines` (first set at line 7)",
            ),
            (
                "[ fabric ]  # again\nseed = 2\n",
                "t.toml:9:3: table [fabric] appears twice (first at line 2)",
            ),
            (
                "[links]\nnic.rate = \"1Gbit\"\nnic . rate = \"2Gbit\"\n",
                "t.toml:11:7: duplicate key `nic.rate` (first set at line 10)",
            ),
            (
                "[links]\nnic = { rate = \"1Gbit\", rate = \"2Gbit\" }\n",
                "t.toml:10:25: duplicate key `rate` in an inline table",
            ),
            (
                "[links]\nnic = { rate = \"1Gbit\" }\n[links.nic]\n",
                "t.toml:11:8: table [links.nic] is defined twice (also by a dotted key",
            ),
        ]);
        // A key of the same name in another table is not the first one.
        let e = err("[fabric]\nname = \"a\"\n[topology]\nname = 1\nname = 2\n");
        assert!(
            e.starts_with("t.toml:5:1: duplicate key `name` (first set at line 4)"),
            "{e}"
        );
    }

    #[test]
    fn a_misspelt_key_is_told_the_nearest_one() {
        assert_eq!(edit_distance("gpus_per_leave", "gpus_per_leaf"), 2);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        let e = err(&LS.replace("gpus_per_leaf", "gpus_per_leave"));
        assert!(e.ends_with("; did you mean `gpus_per_leaf`?"), "{e}");
        let e = err(&LS.replace("spines", "spine"));
        assert!(e.ends_with("; did you mean `spines`?"), "{e}");
        // Nothing near: no guess.
        let e = err(&format!("{LS}[links.nic]\nbandwidth = \"1Gbit\"\n"));
        assert!(
            e.contains("unknown field `bandwidth`") && !e.contains("did you mean"),
            "{e}"
        );
    }

    #[test]
    fn a_bare_word_is_shown_quoted_and_a_missing_value_said() {
        errors_after_ls(&[
            (
                "[links.nic]\nrate = 1Gbit  # x\n",
                "t.toml:10:8: `1Gbit` is not quoted: write \"1Gbit\"",
            ),
            (
                "[links.nic]\nrate =\n",
                "t.toml:10:7: a value is missing here",
            ),
        ]);
        let e = err("[fabric]\nname = \"a\"\n[topology]\nkind = leaf-spine\n");
        assert!(
            e.starts_with("t.toml:4:8: `leaf-spine` is not quoted"),
            "{e}"
        );
        // And the other way round: a number in quotes.
        let e = err(&LS.replace("leaves = 2", "leaves = \"2\""));
        assert!(
            e.ends_with("expected a whole number (write 2 without quotes)"),
            "{e}"
        );
    }

    #[test]
    fn losses_in_bursts_are_read_per_link_class_and_checked() {
        let t = parse(
            &format!("{LS}[links.leaf-spine]\nloss = 0.01\nloss_burst = 8\n"),
            "t.toml",
        )
        .unwrap();
        let up = t.links.iter().find(|l| l.class == LinkClass::LeafSpine);
        let nic = t.links.iter().find(|l| l.class == LinkClass::Nic);
        assert_eq!(up.unwrap().params.loss_burst, 8.0);
        assert_eq!(nic.unwrap().params.loss_burst, 1.0, "the default");
        for bad in ["0.5", "0", "-3", "nan", "2e6"] {
            let e = err(&format!("{LS}[links.nic]\nloss_burst = {bad}\n"));
            assert!(
                e.starts_with("t.toml:10:14: `loss_burst` =")
                    && e.contains("must be a mean run of lost frames from 1 to"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn unknown_key_names_line() {
        let e = err(&format!("{LS}bogus = 1\n"));
        assert!(e.starts_with("t.toml:9:1: "), "{e}");
        assert!(e.contains("bogus"), "{e}");
    }

    #[test]
    fn a_scenario_file_is_named_as_such() {
        let e = err(
            "# spine fails\n[[event]]\nat = \"1ms\"\ndo = \"switch-down\"\nname = \"spine1\"\n",
        );
        assert!(e.starts_with("t.toml:2:3: unknown field `event`"), "{e}");
        assert!(
            e.contains("chaos scenario file") && e.contains("closbox chaos FILE"),
            "{e}"
        );
        // An unknown `event` inside a table is only a wrong key.
        let e = err(&format!("{LS}[links.nic]\nevent = 1\n"));
        assert!(
            e.contains("unknown field `event`") && !e.contains("scenario"),
            "{e}"
        );
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
    fn icmp_rate_is_a_count_with_a_default() {
        let e = err(&format!("{LS}[switches.spine]\nicmp_rate = -1\n"));
        assert!(e.starts_with("t.toml:10:13"), "{e}");
        assert!(
            e.contains("`icmp_rate` = -1 is out of range 0..=1000000000"),
            "{e}"
        );
        let e = err(&format!("{LS}[switches.spine]\nicmp_rate = \"1000/s\"\n"));
        assert!(e.starts_with("t.toml:10:13"), "{e}");
        let t = parse(&format!("{LS}[switches.spine]\nicmp_rate = 0\n"), "t.toml").unwrap();
        for s in &t.switches {
            let want = if s.tier == Tier::Spine { 0 } else { 1000 };
            assert_eq!(s.params.icmp_rate, want, "{}", s.name);
        }
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
        // Hosts linked to each other, the switch to nothing.
        let e = err(&format!("{base}[[link]]\na = \"a\"\nb = \"b\"\n"));
        assert!(
            e.starts_with("t.toml:10:8: switch \"s\" has no links"),
            "{e}"
        );
        let ok = parse(&format!("{base}[[link]]\na = \"a\"\nb = \"s\"\n[[link]]\na = \"b\"\nb = \"s\"\nrate = \"1Gbit\"\n"), "t.toml").unwrap();
        assert_eq!(ok.links[1].params.rate, crate::Bandwidth::from_gbps(1));
    }

    #[test]
    fn gpu_tcp_is_reno_unless_the_file_says() {
        let t = parse(LS, "t.toml").unwrap();
        assert_eq!(t.fabric.host_tcp.congestion.as_deref(), Some("reno"));
        let t = parse(&format!("{LS}[nic]\ntcp_congestion = \"host\"\n"), "t.toml").unwrap();
        assert_eq!(t.fabric.host_tcp.congestion, None);
        let e = err(&format!("{LS}[nic]\ntcp_congestion = \"no-such\"\n"));
        assert!(e.starts_with("t.toml:10:18: "), "{e}");
        // DCTCP: the kernel's, or closbox's own where the kernel has BTF to load it by.
        let dctcp = format!("{LS}[nic]\ntcp_congestion = \"dctcp\"\n");
        let allowed = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_allowed_congestion_control");
        let kernel = allowed
            .as_deref()
            .map_or(true, |a| a.split_whitespace().any(|c| c == "dctcp"));
        if kernel || std::path::Path::new("/sys/kernel/btf/vmlinux").exists() {
            let t = parse(&dctcp, "t.toml").unwrap();
            assert_eq!(t.fabric.host_tcp.congestion.as_deref(), Some("dctcp"));
            // It negotiates ECN whatever tcp_ecn says: `false` is refused where it stands.
            let e = err(&format!("{dctcp}tcp_ecn = false\n"));
            assert!(
                e.starts_with("t.toml:11:11: `tcp_ecn` = false")
                    && e.contains("DCTCP requests ECN"),
                "{e}"
            );
            let t = parse(&format!("{dctcp}tcp_ecn = true\n"), "t.toml").unwrap();
            assert!(t.fabric.host_tcp.ecn);
            let t = parse(&format!("{LS}[nic]\ntcp_ecn = false\n"), "t.toml").unwrap();
            assert!(!t.fabric.host_tcp.ecn);
            // Its registered name is not what a file asks for.
            if !kernel {
                let e = err(&format!("{LS}[nic]\ntcp_congestion = \"closbox_dctcp\"\n"));
                assert!(e.contains("write \"dctcp\""), "{e}");
            }
        } else {
            let e = err(&dctcp);
            assert!(
                e.starts_with("t.toml:10:18: ") && e.contains("no BTF"),
                "{e}"
            );
        }
    }

    #[test]
    fn a_nic_is_one_fifo_unless_the_file_says_fq() {
        let t = parse(LS, "t.toml").unwrap();
        assert_eq!(t.fabric.nic_scheduler, NicScheduler::Fifo);
        let t = parse(&format!("{LS}[nic]\nscheduler = \"fq\"\n"), "t.toml").unwrap();
        assert_eq!(t.fabric.nic_scheduler, NicScheduler::Fq);
        let e = err(&format!("{LS}[nic]\nscheduler = \"wfq\"\n"));
        assert!(e.starts_with("t.toml:10:13: "), "{e}");
        assert!(e.contains("\"wfq\" is not a NIC scheduler"), "{e}");
    }

    #[test]
    fn time_scale_is_a_number_or_auto() {
        let t = parse(
            &LS.replace("name = \"ls\"", "name = \"ls\"\ntime_scale = \"auto\""),
            "t.toml",
        )
        .unwrap();
        assert!(t.fabric.time_scale_auto);
        assert_eq!(t.fabric.time_scale.get(), 1.0, "1 until up measures");
        let t = parse(
            &LS.replace("name = \"ls\"", "name = \"ls\"\ntime_scale = 250"),
            "t.toml",
        )
        .unwrap();
        assert!(!t.fabric.time_scale_auto);
        assert_eq!(t.fabric.time_scale.get(), 250.0);
        assert!(!parse(LS, "t.toml").unwrap().fabric.time_scale_auto);
    }

    #[test]
    fn presets_set_defaults_the_file_overrides() {
        use crate::topology::{FlowControl, Routing};
        let with = |fabric: &str, rest: &str| {
            parse(
                &LS.replace("name = \"ls\"", &format!("name = \"ls\"\n{fabric}"))
                    .replace("gpus_per_leaf = 4\n", &format!("gpus_per_leaf = 4\n{rest}")),
                "t.toml",
            )
        };
        let t = with("preset = \"roce-400g\"", "").unwrap();
        assert_eq!(t.fabric.preset, Some("roce-400g"));
        assert_eq!(t.fabric.mtu, 9000);
        assert!(matches!(t.fabric.flow_control, FlowControl::Pfc(p) if p.xoff == DEFAULT_XOFF));
        let leaf = &t
            .switches
            .iter()
            .find(|s| s.name == "leaf0")
            .unwrap()
            .params;
        assert!(leaf.queue.ecn.is_some());
        assert_eq!(leaf.routing, Routing::Ecmp);
        let t = with("preset = \"infiniband-ndr\"", "").unwrap();
        assert!(matches!(t.fabric.flow_control, FlowControl::Credit(_)));
        assert_eq!(t.switches[0].params.latency, Duration::from_nanos(130));
        assert_eq!(t.switches[0].params.routing, Routing::Adaptive);
        assert_eq!(t.fabric.mtu, 4092);
        // Every value stays the file's to change.
        let t = with(
            "preset = \"spectrum-x\"\nmtu = 1500\nflow_control = \"none\"",
            "[switches.leaf]\nrouting = \"ecmp\"\nlatency = \"1us\"\n[links.nic]\nrate = \"100Gbit\"\n",
        )
        .unwrap();
        assert_eq!(t.fabric.mtu, 1500);
        assert_eq!(t.fabric.flow_control, FlowControl::Lossy);
        let sw = |name: &str| t.switches.iter().find(|s| s.name == name).unwrap().params;
        assert_eq!(sw("leaf0").routing, Routing::Ecmp);
        assert_eq!(sw("leaf0").latency, Duration::from_micros(1));
        assert_eq!(sw("spine0").routing, Routing::Adaptive, "spine0 keeps it");
        for l in &t.links {
            let gbps = if l.class == LinkClass::Nic { 100 } else { 400 };
            assert_eq!(
                l.params.rate,
                crate::Bandwidth::from_gbps(gbps),
                "{:?}",
                l.class
            );
        }
        let lossy = with("preset = \"ethernet-lossy\"", "").unwrap();
        assert_eq!(lossy.fabric.flow_control, FlowControl::Lossy);
        assert_eq!(lossy.fabric.mtu, 1500);
    }

    #[test]
    fn lossless_packet_memory_counts_what_switches_hold_per_ingress() {
        // 2 leaves × 4 GPUs, 2 spines: 12 links, 24 ports, 16 of them on switches. Small
        // buffers, so that xoff + headroom is the larger.
        let small = LS.replace(
            "gpus_per_leaf = 4\n",
            "gpus_per_leaf = 4\n[nic]\nbuffer = \"64KiB\"\n[switches.leaf]\nbuffer = \"64KiB\"\n[switches.spine]\nbuffer = \"64KiB\"\n",
        );
        let lossy = parse(&small, "t.toml").unwrap();
        let pfc = parse(
            &small.replace(
                "name = \"ls\"",
                "name = \"ls\"\nflow_control = \"pfc\"\nxoff = \"8MiB\"",
            ),
            "t.toml",
        )
        .unwrap();
        assert_eq!(lossy.fabric.packet_memory.get(), 32 << 20, "the floor");
        // 16 switch ports × (8 MiB + headroom) × 1.25 > 160 MiB.
        assert!(
            pfc.fabric.packet_memory.get() > 160 << 20,
            "{}",
            pfc.fabric.packet_memory
        );
    }

    #[test]
    fn flow_control_settings_are_checked_where_written() {
        for (fabric, needle) in [
            (
                "preset = \"roce\"",
                "t.toml:4:10: unknown preset \"roce\"; expected one of ethernet-lossy, roce-400g",
            ),
            (
                "flow_control = \"lossless\"",
                "t.toml:4:16: unknown `flow_control` \"lossless\"",
            ),
            (
                "xoff = \"64KiB\"",
                "t.toml:4:8: `xoff` applies to a lossless fabric",
            ),
            (
                "flow_control = \"pfc\"\nxoff = \"2KiB\"",
                "t.toml:5:8: `xoff` = 2KiB is below two frames",
            ),
            (
                "flow_control = \"pfc\"\nxoff = \"64KiB\"\nxon = \"65KiB\"",
                "t.toml:6:7: `xon` = 65KiB is above `xoff` = 64KiB",
            ),
            (
                "flow_control = \"credit\"\ndeadlock_after = \"0ns\"",
                "t.toml:5:18: `deadlock_after` must be longer than 0",
            ),
            (
                "preset = \"roce-400g\"\n[switches.leaf]\nbuffer = \"64KiB\"",
                "t.toml:11:10: ecn: marking starts at 100KiB, not below the buffer of 64KiB",
            ),
        ] {
            let text = LS.replace("name = \"ls\"", &format!("name = \"ls\"\n{fabric}"));
            // The last case puts a table inside [fabric]'s place: move it after the topology.
            let text = if let Some((f, rest)) = fabric.split_once("\n[switches") {
                LS.replace("name = \"ls\"", &format!("name = \"ls\"\n{f}"))
                    + "[switches"
                    + rest
                    + "\n"
            } else {
                text
            };
            let e = err(&text);
            assert!(
                e.contains(needle),
                "{fabric:?} gave {e:?}, wanted {needle:?}"
            );
        }
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
            ("[fabric]\nname = \"x\"\ntime_scale = \"fast\"\n[topology]\nkind = \"full-mesh\"\ngpus = 2\n", "t.toml:3:14: `time_scale` must be"),
            ("[fabric]\nname = \"x\"\ntime_scale = true\n[topology]\nkind = \"full-mesh\"\ngpus = 2\n", "t.toml:3:14: invalid type: boolean `true`, expected a number (1 is real time) or \"auto\""),
            ("[fabric]\nname = \"x\"\ntime_scale = []\n[topology]\nkind = \"full-mesh\"\ngpus = 2\n", "t.toml:3:14: invalid type: sequence, expected a number (1 is real time) or \"auto\""),
            ("[fabric]\nname = \"x\"\ntime_scale = 18446744073709551616\n[topology]\nkind = \"full-mesh\"\ngpus = 2\n", "t.toml:3:14: `18446744073709551616` is too large, expected a number"),
            ("[fabric]\nname = \"x\"\n[topology]\nkind = \"full-mesh\"\ngpus = 99999999999999999999\n", "t.toml:5:8: `99999999999999999999` is too large, expected a whole number"),
            ("[fabric]\nname = \"x\"\n[topology]\nkind = \"full-mesh\"\ngpus = 18446744073709551615\n", "t.toml:5:8: `18446744073709551615` is too large, expected a whole number"),
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
