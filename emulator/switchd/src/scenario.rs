//! Chaos scenario files (`closbox chaos FILE`, `run --chaos`, `bench --chaos`): a timeline
//! of changes at fabric times, repeated events and seeded random faults, checked against
//! the topology and expanded into `(fabric ns after start, ChangeRequest)` items that the
//! daemon schedules as one timeline. Errors name file:line:col.
//!
//! ```toml
//! seed = 7                       # for [[random]] faults (default 1)
//! start = "first-packet"         # or "every-gpu"; default "now" (see `Start`)
//!
//! [[event]]
//! at = "2ms"                     # fabric time after the timeline starts
//! do = "link-down"
//! a = "leaf0"
//! b = "spine0"
//!
//! [[event]]
//! at = "1ms"
//! every = "10ms"                 # again every 10 ms, 5 times in all
//! count = 5
//! do = "load"
//! from = "leaf0"
//! to = "leaf1"
//! rate = "200Gbit"
//! for = "5ms"
//!
//! [[random]]
//! do = "link-flap"              # or "link-degrade" (rate, delay, loss: set, then reset),
//!                                # "switch-flap" (switches = a tier or names), "gpu-flap"
//!                                # (gpus = a selection)
//! links = "leaf-spine"           # every link of a class, or a = …, b = …
//! mtbf = "20ms"                  # mean time between failures, per link
//! mttr = "2ms"                   # mean time to repair
//! until = "100ms"
//! ```

use std::ops::Range;
use std::path::Path;

use serde::Deserialize;
use toml::Spanned;

use closbox_fabric::config::{line_col, read_limited, toml_words, unknown_field};
use closbox_fabric::rng::Rng;
use closbox_fabric::topology::{LinkClass, Tier, Topology};
use closbox_fabric::{Bandwidth, Bytes, ConfigError, Duration};

use crate::chaos::{self, ChangeRequest};
use crate::dataplane::MAX_PENDING;

/// A scenario, checked and expanded.
#[derive(Clone, Debug, PartialEq)]
pub struct Scenario {
    /// Changes at fabric ns after the timeline's start, in time order.
    pub items: Vec<(u64, ChangeRequest)>,
    /// When the last change is due (ns after start), a flap's last return included.
    pub end_ns: u64,
    /// The fault each item belongs to (`chaos::Step::fault`): 0 for `[[event]]`s, one
    /// number per random fault's stream (a link, switch or GPU of one `[[random]]`), so
    /// that a random fault's repair undoes only that fault.
    pub faults: Vec<u32>,
    /// When its timeline starts.
    pub start: Start,
}

/// When a scenario's timeline starts, its time 0 (`start = …` in the file).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Start {
    /// As it is handed to the daemon (`"now"`): `closbox chaos`'s start, or just before a
    /// job's first rank for `run|mpirun|bench|train --chaos`.
    #[default]
    Now,
    /// At the first packet one of the job's GPUs sends into the fabric (`"first-packet"`;
    /// `closbox chaos`: one of the fabric's GPUs, or of `--gpus`): a job's start-up
    /// before it communicates (`import torch`, MPI's start) does not take the scenario's
    /// time.
    FirstPacket,
    /// Once each of the job's GPUs has sent a packet (`"every-gpu"`): every rank has
    /// reached its communication (a torch job's ranks connect to their store when their
    /// imports end, one by one).
    EveryGpu,
}

impl Start {
    /// The words of the file: "now", "first-packet", "every-gpu".
    pub fn name(self) -> &'static str {
        match self {
            Start::Now => "now",
            Start::FirstPacket => "first-packet",
            Start::EveryGpu => "every-gpu",
        }
    }

    /// The start a word of the file names ("now", "first-packet", "every-gpu").
    pub fn parse(word: &str) -> Option<Start> {
        [Start::Now, Start::FirstPacket, Start::EveryGpu]
            .into_iter()
            .find(|s| s.name() == word)
    }

    /// What the daemon is asked to wait for, on `gpus` (names), if anything.
    pub fn trigger(self, gpus: Vec<String>) -> Option<crate::control::Trigger> {
        match self {
            Start::Now => None,
            Start::FirstPacket => Some(crate::control::Trigger { gpus, every: false }),
            Start::EveryGpu => Some(crate::control::Trigger { gpus, every: true }),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawScenario {
    seed: Option<Spanned<u64>>,
    start: Option<Spanned<String>>,
    #[serde(default)]
    event: Vec<Spanned<RawEvent>>,
    #[serde(default)]
    random: Vec<Spanned<RawRandom>>,
}

/// One `[[event]]`: `do` says which change; the other keys are its arguments.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEvent {
    at: Spanned<Duration>,
    every: Option<Spanned<Duration>>,
    count: Option<Spanned<u32>>,
    #[serde(rename = "do")]
    action: Spanned<String>,
    a: Option<Spanned<String>>,
    b: Option<Spanned<String>>,
    index: Option<Spanned<u32>>,
    name: Option<Spanned<String>>,
    rate: Option<Spanned<Bandwidth>>,
    delay: Option<Spanned<Duration>>,
    loss: Option<Spanned<f64>>,
    loss_burst: Option<Spanned<f64>>,
    buffer: Option<Spanned<Bytes>>,
    down: Option<Spanned<Duration>>,
    up: Option<Spanned<Duration>>,
    flaps: Option<Spanned<u32>>,
    groups: Option<Spanned<Vec<String>>>,
    from: Option<Spanned<String>>,
    to: Option<Spanned<String>>,
    #[serde(rename = "for")]
    for_: Option<Spanned<Duration>>,
    on: Option<Spanned<Duration>>,
    off: Option<Spanned<Duration>>,
    packet: Option<Spanned<Bytes>>,
    bytes: Option<Spanned<Bytes>>,
    bursts: Option<Spanned<u32>>,
    burst_every: Option<Spanned<Duration>>,
}

/// One `[[random]]`: faults drawn from a seeded generator.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRandom {
    #[serde(rename = "do")]
    action: Spanned<String>,
    links: Option<Spanned<String>>,
    a: Option<Spanned<String>>,
    b: Option<Spanned<String>>,
    mtbf: Spanned<Duration>,
    mttr: Spanned<Duration>,
    start: Option<Spanned<Duration>>,
    until: Spanned<Duration>,
    seed: Option<Spanned<u64>>,
    /// `link-degrade`: what a fault sets (one at least); repaired, the link is reset.
    rate: Option<Spanned<Bandwidth>>,
    delay: Option<Spanned<Duration>>,
    loss: Option<Spanned<f64>>,
    loss_burst: Option<Spanned<f64>>,
    /// `switch-flap`: a tier, or switch names.
    switches: Option<Spanned<String>>,
    /// `gpu-flap`: a GPU selection.
    gpus: Option<Spanned<String>>,
}

/// What each `do` takes besides `at`, `every`, `count`.
const ACTIONS: &[(&str, &[&str])] = &[
    ("link-down", &["a", "b", "index"]),
    ("link-up", &["a", "b", "index"]),
    (
        "link-set",
        &[
            "a",
            "b",
            "index",
            "rate",
            "delay",
            "loss",
            "loss_burst",
            "buffer",
            "from",
        ],
    ),
    ("link-reset", &["a", "b", "index"]),
    ("link-flap", &["a", "b", "index", "down", "up", "flaps"]),
    ("switch-down", &["name"]),
    ("switch-up", &["name"]),
    ("switch-flap", &["name", "down", "up", "flaps"]),
    ("gpu-down", &["name"]),
    ("gpu-up", &["name"]),
    ("gpu-flap", &["name", "down", "up", "flaps"]),
    ("partition", &["groups"]),
    ("heal", &[]),
    (
        "load",
        &["from", "to", "rate", "for", "on", "off", "packet"],
    ),
    ("incast", &["to", "from", "bytes", "bursts", "burst_every"]),
];

/// The daemon's message `m` about a change, in a scenario file's words: each `--flag` of
/// the command line becomes the file's key for it (`link-flap`'s `--count` is `flaps`,
/// `incast`'s `--count` and `--every` are `bursts` and `burst_every`), and the key it is
/// about: the first such flag, or else the name key whose value it quotes.
fn in_file_words(
    action: &str,
    m: &str,
    names: &[(&'static str, &Option<Spanned<String>>)],
) -> (String, Option<&'static str>) {
    let key_of = |flag: &str| -> Option<&'static str> {
        let flag = flag.replace('-', "_");
        let renamed = match (action, flag.as_str()) {
            ("link-flap" | "switch-flap" | "gpu-flap", "count") => Some("flaps"),
            ("incast", "count") => Some("bursts"),
            ("incast", "every") => Some("burst_every"),
            _ => None,
        };
        renamed.or_else(|| {
            ACTIONS
                .iter()
                .flat_map(|(_, keys)| keys.iter().copied())
                .find(|k| *k == flag)
        })
    };
    let mut out = String::with_capacity(m.len());
    let mut first = None;
    let mut rest = m;
    while let Some(i) = rest.find("--") {
        out.push_str(&rest[..i]);
        let after = &rest[i + 2..];
        let end = after
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '_'))
            .unwrap_or(after.len());
        match key_of(&after[..end]) {
            Some(key) => {
                out.push_str(&format!("`{key}`"));
                first = first.or(Some(key));
            }
            None => out.push_str(&rest[i..i + 2 + end]),
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    let quoted = || {
        names.iter().find_map(|(key, v)| {
            let v = v.as_ref()?.get_ref();
            m.contains(&format!("{v:?}")).then_some(*key)
        })
    };
    (out, first.or_else(quoted))
}

/// What each `[[random]]` fault takes besides `mtbf`, `mttr`, `start`, `until`, `seed`.
const RANDOM: &[(&str, &[&str])] = &[
    ("link-flap", &["links", "a", "b"]),
    (
        "link-degrade",
        &["links", "a", "b", "rate", "delay", "loss", "loss_burst"],
    ),
    ("switch-flap", &["switches"]),
    ("gpu-flap", &["gpus"]),
];

/// Most `[[random]]` faults expanded per scenario, and the longest a scenario may run.
const MAX_SPAN: Duration = Duration::from_millis(3_600_000);

struct Cx<'a> {
    text: &'a str,
    file: &'a str,
}

impl Cx<'_> {
    fn at(&self, span: Range<usize>, message: impl Into<String>) -> ConfigError {
        ConfigError {
            file: self.file.to_owned(),
            position: Some(line_col(self.text, span.start)),
            message: message.into(),
        }
    }

    fn err<T>(&self, v: &Spanned<T>, message: impl Into<String>) -> ConfigError {
        self.at(v.span(), message)
    }
}

/// Reads and checks a scenario file against `topo`.
pub fn load(path: &Path, topo: &Topology) -> Result<Scenario, ConfigError> {
    let file = path.display().to_string();
    let text = read_limited(path, "a scenario file").map_err(|message| ConfigError {
        file: file.clone(),
        position: None,
        message,
    })?;
    parse(&text, &file, topo)
}

/// Checks scenario text against `topo`; `file` names it in errors.
pub fn parse(text: &str, file: &str, topo: &Topology) -> Result<Scenario, ConfigError> {
    let cx = Cx { text, file };
    let raw: RawScenario = toml::from_str(text).map_err(|e| {
        let mut message = toml_words(text, &e);
        // A topology file's top-level keys where a scenario's were expected.
        const TOPOLOGY_KEYS: [&str; 9] = [
            "fabric", "topology", "node", "nic", "links", "switches", "switch", "host", "link",
        ];
        if unknown_field(&message).is_some_and(|k| TOPOLOGY_KEYS.contains(&k))
            && message.contains("`random`")
        {
            message += "; this looks like a topology file, not a scenario file \
                        (a scenario has [[event]] and [[random]] tables): bring it up with \
                        `closbox up FILE`";
        }
        // The scenario's `start` word where a [[random]]'s `start` (a duration) is.
        if ["now", "first-packet", "every-gpu"]
            .iter()
            .any(|w| message.starts_with(&format!("invalid duration \"{w}\"")))
        {
            message += "; a [[random]]'s `start` is when its faults begin; the scenario's time 0 is the `start` above the first [[event]] or [[random]]";
        }
        // A scenario-wide key written under a table (after an [[event]] line, TOML puts
        // it in that event).
        if let Some(k) = unknown_field(&message).filter(|k| ["seed", "start"].contains(k)) {
            if !message.contains("`random`") {
                message += &format!(
                    "; `{k}` is a key of the whole scenario: write it above the first [[event]] or [[random]]"
                );
            }
        }
        ConfigError {
            file: file.to_owned(),
            position: e.span().map(|s| line_col(text, s.start)),
            message,
        }
    })?;
    if raw.event.is_empty() && raw.random.is_empty() {
        return Err(ConfigError {
            file: file.to_owned(),
            position: None,
            message: "no [[event]] and no [[random]]: the scenario does nothing".into(),
        });
    }
    let seed = raw.seed.as_ref().map_or(1, |s| *s.get_ref());
    let start = match &raw.start {
        None => Start::Now,
        Some(v) => Start::parse(v.get_ref()).ok_or_else(|| {
                cx.err(
                    v,
                    format!(
                        "start is \"now\" (the default), \"first-packet\" (the first packet of the job's GPUs into the fabric) or \"every-gpu\" (once each of them has sent one), not {:?}",
                        v.get_ref()
                    ),
                )
            })?,
    };
    let mut items = Vec::new();
    for ev in &raw.event {
        event(&cx, topo, ev, &mut items)?;
    }
    let mut faults = vec![0; items.len()];
    for (i, r) in raw.random.iter().enumerate() {
        random(&cx, topo, r, seed, i as u64, &mut items, &mut faults)?;
    }
    // Stable: events at the same time keep the file's order.
    let mut both: Vec<_> = items.into_iter().zip(faults).collect();
    both.sort_by_key(|((t, _), _)| *t);
    let (items, faults): (Vec<_>, Vec<_>) = both.into_iter().unzip();
    // A flap's changes come after its start: `closbox chaos` follows the scenario, and
    // then cancels what is left of it, until the last of them.
    let end_ns = items
        .iter()
        .map(|(t, req)| t.saturating_add(req.span_ns()))
        .max()
        .unwrap_or(0);
    // The timeline goes to the daemon as one request, which it bounds.
    use crate::control::{request_fits, Request, MAX_REQUEST};
    // (Started by the traffic of at most every GPU of the fabric.)
    let schedule = Request::Schedule {
        items,
        faults,
        start: start.trigger(topo.hosts.iter().map(|h| h.name.clone()).collect()),
    };
    let (len, fits) = request_fits(&schedule);
    let Request::Schedule { items, faults, .. } = schedule else {
        unreachable!("built above")
    };
    if !fits {
        use closbox_fabric::units::approx_bytes;
        return Err(ConfigError {
            file: file.to_owned(),
            position: None,
            message: format!(
                "its {} changes take {} to send, more than the {} the daemon takes in one request: fewer changes (raise mtbf, shorten until, fewer links), or two scenarios",
                items.len(),
                approx_bytes(len as u64),
                approx_bytes(MAX_REQUEST)
            ),
        });
    }
    Ok(Scenario {
        items,
        end_ns,
        faults,
        start,
    })
}

fn event(
    cx: &Cx,
    topo: &Topology,
    ev: &Spanned<RawEvent>,
    items: &mut Vec<(u64, ChangeRequest)>,
) -> Result<(), ConfigError> {
    let e = ev.get_ref();
    let action = e.action.get_ref().as_str();
    let Some((_, takes)) = ACTIONS.iter().find(|(a, _)| *a == action) else {
        let all: Vec<&str> = ACTIONS.iter().map(|a| a.0).collect();
        return Err(cx.err(
            &e.action,
            format!("unknown change {action:?}; one of: {}", all.join(", ")),
        ));
    };
    // Keys that are not this change's.
    let given: [(&str, Option<Range<usize>>); 23] = [
        ("a", e.a.as_ref().map(Spanned::span)),
        ("b", e.b.as_ref().map(Spanned::span)),
        ("index", e.index.as_ref().map(Spanned::span)),
        ("name", e.name.as_ref().map(Spanned::span)),
        ("rate", e.rate.as_ref().map(Spanned::span)),
        ("delay", e.delay.as_ref().map(Spanned::span)),
        ("loss", e.loss.as_ref().map(Spanned::span)),
        ("loss_burst", e.loss_burst.as_ref().map(Spanned::span)),
        ("buffer", e.buffer.as_ref().map(Spanned::span)),
        ("down", e.down.as_ref().map(Spanned::span)),
        ("up", e.up.as_ref().map(Spanned::span)),
        ("flaps", e.flaps.as_ref().map(Spanned::span)),
        ("groups", e.groups.as_ref().map(Spanned::span)),
        ("from", e.from.as_ref().map(Spanned::span)),
        ("to", e.to.as_ref().map(Spanned::span)),
        ("for", e.for_.as_ref().map(Spanned::span)),
        ("on", e.on.as_ref().map(Spanned::span)),
        ("off", e.off.as_ref().map(Spanned::span)),
        ("packet", e.packet.as_ref().map(Spanned::span)),
        ("bytes", e.bytes.as_ref().map(Spanned::span)),
        ("bursts", e.bursts.as_ref().map(Spanned::span)),
        ("burst_every", e.burst_every.as_ref().map(Spanned::span)),
        ("count", None),
    ];
    for (key, span) in &given {
        if let Some(span) = span {
            if !takes.contains(key) {
                return Err(cx.at(
                    span.clone(),
                    format!(
                        "{action} does not take `{key}`{}",
                        if takes.is_empty() {
                            String::new()
                        } else {
                            format!(" (it takes {})", takes.join(", "))
                        }
                    ),
                ));
            }
        }
    }
    let need = |v: &Option<Spanned<String>>, key: &str| {
        v.as_ref()
            .map(|s| s.get_ref().clone())
            .ok_or_else(|| cx.err(&e.action, format!("{action} needs `{key}`")))
    };
    let index = e.index.as_ref().map(|i| *i.get_ref());
    let flap_time = |v: &Option<Spanned<Duration>>, key: &str| {
        v.as_ref()
            .map(|d| d.get_ref().as_nanos())
            .ok_or_else(|| cx.err(&e.action, format!("{action} needs `{key}`")))
    };
    let req = match action {
        "link-down" | "link-up" | "link-reset" => {
            let (a, b) = (need(&e.a, "a")?, need(&e.b, "b")?);
            match action {
                "link-down" => ChangeRequest::LinkDown { a, b, index },
                "link-up" => ChangeRequest::LinkUp { a, b, index },
                _ => ChangeRequest::LinkReset { a, b, index },
            }
        }
        "link-set" => ChangeRequest::LinkSet {
            a: need(&e.a, "a")?,
            b: need(&e.b, "b")?,
            index,
            rate_bps: e.rate.as_ref().map(|r| r.get_ref().bps()),
            delay_ns: e.delay.as_ref().map(|d| d.get_ref().as_nanos()),
            loss: e.loss.as_ref().map(|l| *l.get_ref()),
            loss_burst: e.loss_burst.as_ref().map(|l| *l.get_ref()),
            buffer_bytes: e.buffer.as_ref().map(|b| b.get_ref().get()),
            from: e.from.as_ref().map(|f| f.get_ref().clone()),
        },
        "link-flap" => ChangeRequest::LinkFlap {
            a: need(&e.a, "a")?,
            b: need(&e.b, "b")?,
            index,
            down_ns: flap_time(&e.down, "down")?,
            up_ns: flap_time(&e.up, "up")?,
            count: e.flaps.as_ref().map_or(1, |c| *c.get_ref()),
        },
        "switch-flap" | "gpu-flap" => ChangeRequest::SwitchFlap {
            name: need(&e.name, "name")?,
            gpu: action == "gpu-flap",
            down_ns: flap_time(&e.down, "down")?,
            up_ns: flap_time(&e.up, "up")?,
            count: e.flaps.as_ref().map_or(1, |c| *c.get_ref()),
        },
        "switch-down" => ChangeRequest::SwitchDown {
            name: need(&e.name, "name")?,
        },
        "switch-up" => ChangeRequest::SwitchUp {
            name: need(&e.name, "name")?,
        },
        "gpu-down" => ChangeRequest::GpuDown {
            name: need(&e.name, "name")?,
        },
        "gpu-up" => ChangeRequest::GpuUp {
            name: need(&e.name, "name")?,
        },
        "partition" => {
            let g = e
                .groups
                .as_ref()
                .ok_or_else(|| cx.err(&e.action, "partition needs `groups`"))?;
            let groups = g
                .get_ref()
                .iter()
                .map(|sel| select(topo, sel))
                .collect::<Result<Vec<_>, String>>()
                .map_err(|m| cx.err(g, m))?;
            ChangeRequest::Partition { groups }
        }
        "heal" => ChangeRequest::Heal,
        "load" => ChangeRequest::Load {
            from: need(&e.from, "from")?,
            to: need(&e.to, "to")?,
            rate_bps: e
                .rate
                .as_ref()
                .ok_or_else(|| cx.err(&e.action, "load needs `rate`"))?
                .get_ref()
                .bps(),
            packet_bytes: match &e.packet {
                Some(p) => Some(
                    u32::try_from(p.get_ref().get())
                        .map_err(|_| cx.err(p, "a packet of at most the mtu"))?,
                ),
                None => None,
            },
            for_ns: e.for_.as_ref().map(|d| d.get_ref().as_nanos()),
            on_ns: e.on.as_ref().map(|d| d.get_ref().as_nanos()),
            off_ns: e.off.as_ref().map(|d| d.get_ref().as_nanos()),
        },
        "incast" => {
            let from = need(&e.from, "from")?;
            let from_names =
                select(topo, &from).map_err(|m| cx.err(e.from.as_ref().expect("given"), m))?;
            ChangeRequest::Incast {
                to: need(&e.to, "to")?,
                from: from_names,
                bytes: e
                    .bytes
                    .as_ref()
                    .ok_or_else(|| cx.err(&e.action, "incast needs `bytes`"))?
                    .get_ref()
                    .get(),
                every_ns: e.burst_every.as_ref().map(|d| d.get_ref().as_nanos()),
                count: e.bursts.as_ref().map_or(1, |c| *c.get_ref()),
            }
        }
        _ => unreachable!("every action of ACTIONS is handled"),
    };
    // Names and values, checked as the daemon will; its words for the command line's
    // flags become the file's keys, at the key the message is about.
    chaos::schedule(topo, &req, &mut 1).map_err(|m| {
        let names = [
            ("a", &e.a),
            ("b", &e.b),
            ("name", &e.name),
            ("from", &e.from),
            ("to", &e.to),
        ];
        let (message, key) = in_file_words(action, &m, &names);
        let span = key
            .and_then(|k| given.iter().find(|(g, _)| *g == k))
            .and_then(|(_, span)| span.clone());
        match span {
            Some(span) => cx.at(span, message),
            None => cx.err(ev, message),
        }
    })?;
    let at = *e.at.get_ref();
    if at > MAX_SPAN {
        return Err(cx.err(&e.at, format!("at most {MAX_SPAN} into a scenario")));
    }
    let count = match (&e.every, &e.count) {
        (None, None) => 1,
        (Some(_), None) => return Err(cx.err(ev, "`every` needs `count`")),
        (None, Some(c)) => return Err(cx.err(c, "`count` needs `every`")),
        (Some(every), Some(c)) => {
            if every.get_ref().as_nanos() == 0 {
                return Err(cx.err(every, "`every` must be above 0"));
            }
            let n = *c.get_ref();
            if n == 0 || n as usize > MAX_PENDING {
                return Err(cx.err(c, format!("`count` must be 1 to {MAX_PENDING}")));
            }
            if at + Duration::from_nanos(every.get_ref().as_nanos() * (n as u64 - 1)) > MAX_SPAN {
                return Err(cx.err(c, format!("repeats past {MAX_SPAN}")));
            }
            n
        }
    };
    let every = e.every.as_ref().map_or(0, |d| d.get_ref().as_nanos());
    for k in 0..count as u64 {
        items.push((at.as_nanos() + k * every, req.clone()));
        if items.len() > MAX_PENDING {
            return Err(cx.err(ev, format!("more than {MAX_PENDING} changes")));
        }
    }
    Ok(())
}

fn random(
    cx: &Cx,
    topo: &Topology,
    r: &Spanned<RawRandom>,
    seed: u64,
    nth: u64,
    items: &mut Vec<(u64, ChangeRequest)>,
    faults: &mut Vec<u32>,
) -> Result<(), ConfigError> {
    let raw = r.get_ref();
    let action = raw.action.get_ref().as_str();
    let Some((_, takes)) = RANDOM.iter().find(|(a, _)| *a == action) else {
        let all: Vec<&str> = RANDOM.iter().map(|a| a.0).collect();
        return Err(cx.err(
            &raw.action,
            format!(
                "unknown random fault {action:?}; one of: {}",
                all.join(", ")
            ),
        ));
    };
    let set_keys = [
        ("rate", raw.rate.as_ref().map(Spanned::span)),
        ("delay", raw.delay.as_ref().map(Spanned::span)),
        ("loss", raw.loss.as_ref().map(Spanned::span)),
        ("loss_burst", raw.loss_burst.as_ref().map(Spanned::span)),
    ];
    let given = [
        ("links", raw.links.as_ref().map(Spanned::span)),
        ("a", raw.a.as_ref().map(Spanned::span)),
        ("b", raw.b.as_ref().map(Spanned::span)),
        ("switches", raw.switches.as_ref().map(Spanned::span)),
        ("gpus", raw.gpus.as_ref().map(Spanned::span)),
    ];
    for (key, span) in given.iter().chain(&set_keys) {
        if let (Some(span), false) = (span, takes.contains(key)) {
            let which: Vec<&str> = RANDOM
                .iter()
                .filter(|(_, t)| t.contains(key))
                .map(|(a, _)| *a)
                .collect();
            let verb = if which.len() == 1 { "does" } else { "do" };
            return Err(cx.at(
                span.clone(),
                format!(
                    "{action} does not take `{key}` ({} {verb})",
                    which.join(", ")
                ),
            ));
        }
    }
    // What each fault does and what repairs it, per link, switch or GPU it may hit, with
    // the random stream it draws from: a link's topology index (the streams link faults
    // had before switches and GPUs had faults), else its place in the entry.
    let targets: Vec<(u64, ChangeRequest, ChangeRequest)> = match action {
        "link-flap" | "link-degrade" => {
            let degrade = action == "link-degrade";
            if degrade && set_keys.iter().all(|(_, s)| s.is_none()) {
                return Err(cx.err(
                    &raw.action,
                    "link-degrade needs what a fault sets: `rate`, `delay`, `loss` or `loss_burst`",
                ));
            }
            let links = random_links(cx, topo, raw)?;
            if degrade {
                degrades(cx, topo, raw, &links)?;
            }
            let targets: Vec<_> = links
                .into_iter()
                .map(|l| {
                    let (a, b, index) = chaos::link_ref(topo, l);
                    let index = Some(index);
                    if degrade {
                        let set = ChangeRequest::LinkSet {
                            a: a.clone(),
                            b: b.clone(),
                            index,
                            rate_bps: raw.rate.as_ref().map(|r| r.get_ref().bps()),
                            delay_ns: raw.delay.as_ref().map(|d| d.get_ref().as_nanos()),
                            loss: raw.loss.as_ref().map(|l| *l.get_ref()),
                            loss_burst: raw.loss_burst.as_ref().map(|l| *l.get_ref()),
                            buffer_bytes: None,
                            from: None,
                        };
                        (l as u64, set, ChangeRequest::LinkReset { a, b, index })
                    } else {
                        let down = ChangeRequest::LinkDown {
                            a: a.clone(),
                            b: b.clone(),
                            index,
                        };
                        (l as u64, down, ChangeRequest::LinkUp { a, b, index })
                    }
                })
                .collect();
            if degrade {
                // The values, checked as the daemon will, at the key they are about.
                chaos::schedule(topo, &targets[0].1, &mut 1).map_err(|m| {
                    let (message, key) = in_file_words("link-set", &m, &[]);
                    match key.and_then(|k| set_keys.iter().find(|(g, _)| *g == k)?.1.clone()) {
                        Some(span) => cx.at(span, message),
                        None => cx.err(&raw.action, message),
                    }
                })?;
            }
            targets
        }
        "switch-flap" => {
            let sel = raw.switches.as_ref().ok_or_else(|| {
                cx.err(
                    &raw.action,
                    "switch-flap needs `switches`: a tier (\"spine\") or names (\"spine0,leaf1\")",
                )
            })?;
            let names: Vec<String> = match Tier::from_name(sel.get_ref()) {
                Some(tier) => topo
                    .switches
                    .iter()
                    .filter(|s| s.tier == tier)
                    .map(|s| s.name.clone())
                    .collect(),
                None => sel
                    .get_ref()
                    .split(',')
                    .map(|n| n.trim().to_owned())
                    .collect(),
            };
            if names.is_empty() {
                return Err(cx.err(sel, format!("this fabric has no {} switch", sel.get_ref())));
            }
            names
                .into_iter()
                .enumerate()
                .map(|(i, name)| {
                    let down = ChangeRequest::SwitchDown { name: name.clone() };
                    chaos::schedule(topo, &down, &mut 1).map_err(|m| cx.err(sel, m))?;
                    Ok((i as u64, down, ChangeRequest::SwitchUp { name }))
                })
                .collect::<Result<_, ConfigError>>()?
        }
        "gpu-flap" => {
            let sel = raw.gpus.as_ref().ok_or_else(|| {
                cx.err(
                    &raw.action,
                    "gpu-flap needs `gpus`: a selection such as \"all\", \"0-3,6\" or \"gpu5\"",
                )
            })?;
            select(topo, sel.get_ref())
                .map_err(|m| cx.err(sel, m))?
                .into_iter()
                .enumerate()
                .map(|(i, name)| {
                    let down = ChangeRequest::GpuDown { name: name.clone() };
                    (i as u64, down, ChangeRequest::GpuUp { name })
                })
                .collect()
        }
        _ => unreachable!("every fault of RANDOM is handled"),
    };
    let (mtbf, mttr) = (raw.mtbf.get_ref().as_nanos(), raw.mttr.get_ref().as_nanos());
    if mtbf == 0 {
        return Err(cx.err(&raw.mtbf, "`mtbf` must be above 0"));
    }
    if mttr == 0 {
        return Err(cx.err(&raw.mttr, "`mttr` must be above 0"));
    }
    let start = raw.start.as_ref().map_or(0, |s| s.get_ref().as_nanos());
    let until = raw.until.get_ref().as_nanos();
    if until <= start {
        return Err(cx.err(&raw.until, "`until` must come after `start`"));
    }
    if *raw.until.get_ref() > MAX_SPAN {
        return Err(cx.err(&raw.until, format!("at most {MAX_SPAN} into a scenario")));
    }
    let seed = raw.seed.as_ref().map_or(seed, |s| *s.get_ref());
    // Each stream's own fault number (its faults never overlap one another).
    let first = faults.iter().max().map_or(1, |m| m + 1);
    for (number, (stream, fault, repair)) in (first..).zip(&targets) {
        let mut rng = Rng::new(seed, nth << 32 | stream);
        let mut t = start;
        loop {
            t = t.saturating_add(exponential(&mut rng, mtbf));
            if t >= until {
                break;
            }
            let down = exponential(&mut rng, mttr).max(1);
            items.push((t, fault.clone()));
            // The repair comes even past `until`: the fabric is left whole.
            items.push((t.saturating_add(down), repair.clone()));
            faults.extend([number, number]);
            t = t.saturating_add(down);
            if items.len() > MAX_PENDING {
                return Err(cx.err(
                    r,
                    format!("more than {MAX_PENDING} changes: raise mtbf or shorten until"),
                ));
            }
        }
    }
    Ok(())
}

/// The links a `[[random]]` link fault may hit: a class's, or those between `a` and `b`.
/// A `link-degrade` makes every link it may hit worse, never better: a rate above a
/// link's, a delay below it, a loss below it would be an upgrade (a scenario written for
/// a 400 Gbit/s fabric, run on a 1 Gbit/s one, would speed its links up a hundredfold).
fn degrades(cx: &Cx, topo: &Topology, raw: &RawRandom, links: &[u32]) -> Result<(), ConfigError> {
    use std::fmt::Display;
    for &l in links {
        let p = &topo.links[l as usize].params;
        let better = |span, what: &str, given: &dyn Display, has: &dyn Display, how: &str| {
            let link = chaos::link_name(topo, l);
            Err(cx.at(
                span,
                format!("link-degrade's {what} {given} is {how} the {has} of {link} (a link it picks): a degrade must not make a link better"),
            ))
        };
        if let Some(r) = raw
            .rate
            .as_ref()
            .filter(|r| r.get_ref().bps() > p.rate.bps())
        {
            return better(r.span(), "rate", r.get_ref(), &p.rate, "above");
        }
        if let Some(d) = raw.delay.as_ref().filter(|d| *d.get_ref() < p.delay) {
            return better(d.span(), "delay", d.get_ref(), &p.delay, "below");
        }
        if let Some(x) = raw.loss.as_ref().filter(|x| *x.get_ref() < p.loss) {
            return better(x.span(), "loss", x.get_ref(), &p.loss, "below");
        }
    }
    Ok(())
}

fn random_links(cx: &Cx, topo: &Topology, raw: &RawRandom) -> Result<Vec<u32>, ConfigError> {
    Ok(match (&raw.links, &raw.a, &raw.b) {
        (Some(class), None, None) => {
            let want = LinkClass::ALL
                .iter()
                .copied()
                .find(|c| c.name() == class.get_ref())
                .ok_or_else(|| {
                    let all: Vec<&str> = LinkClass::ALL.iter().map(|c| c.name()).collect();
                    cx.err(
                        class,
                        format!(
                            "no link class {:?}; one of: {}",
                            class.get_ref(),
                            all.join(", ")
                        ),
                    )
                })?;
            let of: Vec<u32> = (0..topo.links.len() as u32)
                .filter(|&l| topo.links[l as usize].class == want)
                .collect();
            if of.is_empty() {
                return Err(cx.err(class, format!("this fabric has no {} link", want.name())));
            }
            of
        }
        (None, Some(a), Some(b)) => {
            chaos::links_between(topo, a.get_ref(), b.get_ref(), None).map_err(|m| cx.err(a, m))?
        }
        _ => {
            return Err(cx.err(
                &raw.action,
                "give `links` (a link class) or both `a` and `b`",
            ))
        }
    })
}

/// An exponentially distributed draw with mean `mean` (ns).
fn exponential(rng: &mut Rng, mean: u64) -> u64 {
    let u = rng.next_f64();
    (-(1.0 - u).ln() * mean as f64).round() as u64
}

/// GPU names of a selection as `run --gpus` takes it (`names::select_gpus`).
pub fn select(topo: &Topology, sel: &str) -> Result<Vec<String>, String> {
    let names: Vec<&str> = topo.hosts.iter().map(|h| h.name.as_str()).collect();
    let unknown = |part: &str| format!("no GPU {part:?}; {}", chaos::nearby(topo, part));
    let picked = closbox_fabric::names::select_gpus(&topo.fabric.name, &names, sel, &unknown)?;
    Ok(picked.into_iter().map(|i| names[i].to_owned()).collect())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn topo() -> Topology {
        closbox_fabric::parse(
            "[fabric]\nname = \"c\"\n[topology]\nkind = \"leaf-spine\"\nleaves = 2\nspines = 4\ngpus_per_leaf = 2\n",
            "c.toml",
        )
        .unwrap()
    }

    fn err(text: &str) -> String {
        parse(text, "s.toml", &topo()).unwrap_err().to_string()
    }

    /// `start` says when its time 0 is: now by default, or the GPUs' packets; any other
    /// word is refused at its place.
    #[test]
    fn a_scenario_starts_now_or_with_the_gpus_packets() {
        let body = "[[event]]\nat = \"1ms\"\ndo = \"switch-down\"\nname = \"spine0\"\n";
        let start =
            |head: &str| parse(&format!("{head}{body}"), "s.toml", &topo()).map(|s| s.start);
        assert_eq!(start(""), Ok(Start::Now));
        assert_eq!(start("start = \"now\"\n"), Ok(Start::Now));
        assert_eq!(start("start = \"first-packet\"\n"), Ok(Start::FirstPacket));
        assert_eq!(start("start = \"every-gpu\"\n"), Ok(Start::EveryGpu));
        assert_eq!(
            err(&format!("seed = 2\nstart = \"first packet\"\n{body}")),
            "s.toml:2:9: start is \"now\" (the default), \"first-packet\" (the first packet of the job's GPUs into the fabric) or \"every-gpu\" (once each of them has sent one), not \"first packet\""
        );
        // Written under a table, it is said where it goes.
        let e = err(&format!("{body}start = \"first-packet\"\n"));
        assert!(
            e.starts_with("s.toml:5:1: unknown field `start`")
                && e.ends_with("`start` is a key of the whole scenario: write it above the first [[event]] or [[random]]"),
            "{e}"
        );
        let e = err("[[random]]\ndo = \"link-flap\"\nlinks = \"leaf-spine\"\nmtbf = \"5ms\"\nmttr = \"1ms\"\nuntil = \"20ms\"\nstart = \"every-gpu\"\n");
        assert!(
            e.starts_with("s.toml:7:9: invalid duration \"every-gpu\"")
                && e.ends_with(
                    "the scenario's time 0 is the `start` above the first [[event]] or [[random]]"
                ),
            "{e}"
        );
        let trigger = Start::EveryGpu.trigger(vec!["gpu0".into()]).unwrap();
        assert!(trigger.every);
        assert_eq!(Start::Now.trigger(vec!["gpu0".into()]), None);
    }

    /// A timeline within the change bound whose request the daemon would not take is
    /// refused with the file, not a broken pipe half-way through sending it.
    #[test]
    fn a_scenario_the_daemon_would_not_take_in_one_request_is_refused() {
        let e = err("[[event]]\nat = \"0s\"\nevery = \"1us\"\ncount = 99000\ndo = \"link-down\"\na = \"leaf0\"\nb = \"spine0\"\n");
        assert!(
            e.starts_with("s.toml: its 99000 changes take ") && e.contains("more than the 4 MiB"),
            "{e}"
        );
        // Half of it fits.
        parse(
            "[[event]]\nat = \"0s\"\nevery = \"1us\"\ncount = 40000\ndo = \"link-down\"\na = \"leaf0\"\nb = \"spine0\"\n",
            "s.toml",
            &topo(),
        )
        .unwrap();
    }

    #[test]
    fn events_expand_in_time_order_with_repeats() {
        let s = parse(
            r#"
[[event]]
at = "5ms"
do = "link-up"
a = "leaf0"
b = "spine0"

[[event]]
at = "2ms"
do = "link-down"
a = "leaf0"
b = "spine0"

[[event]]
at = "1ms"
every = "2ms"
count = 3
do = "load"
from = "leaf0"
to = "leaf1"
rate = "10Gbit"
for = "1ms"
"#,
            "s.toml",
            &topo(),
        )
        .unwrap();
        let times: Vec<u64> = s.items.iter().map(|i| i.0 / 1_000_000).collect();
        assert_eq!(times, [1, 2, 3, 5, 5]);
        assert!(matches!(s.items[1].1, ChangeRequest::LinkDown { .. }));
        assert_eq!(s.end_ns, 5_000_000);
    }

    #[test]
    fn a_flap_lasts_until_its_last_return_and_switches_and_gpus_flap_too() {
        let s = parse(
            r#"
[[event]]
at = "1ms"
do = "link-flap"
a = "leaf0"
b = "spine0"
down = "200ms"
up = "200ms"
flaps = 3

[[event]]
at = "2ms"
do = "switch-flap"
name = "spine1"
down = "5ms"
up = "5ms"

[[event]]
at = "3ms"
do = "gpu-flap"
name = "gpu2"
down = "1ms"
up = "1ms"
flaps = 2
"#,
            "s.toml",
            &topo(),
        )
        .unwrap();
        // The link's third return: 1 ms + 2 × 400 ms + 200 ms (`closbox chaos` followed
        // only to 1 ms, then cancelled the flap's other four changes).
        assert_eq!(s.end_ns, 1_001_000_000);
        assert!(matches!(
            &s.items[1].1,
            ChangeRequest::SwitchFlap { name, gpu: false, count: 1, .. } if name == "spine1"
        ));
        assert!(matches!(
            &s.items[2].1,
            ChangeRequest::SwitchFlap { name, gpu: true, count: 2, .. } if name == "gpu2"
        ));
        let e =
            err("[[event]]\nat = \"1ms\"\ndo = \"switch-flap\"\nname = \"spine1\"\nup = \"1ms\"\n");
        assert!(e.starts_with("s.toml:3:6: switch-flap needs `down`"), "{e}");
        let e = err("[[event]]\nat = \"1ms\"\ndo = \"gpu-flap\"\nname = \"spine1\"\ndown = \"1ms\"\nup = \"1ms\"\n");
        assert!(e.contains("spine1 is a switch"), "{e}");
        let e = err("[[event]]\nat = \"1ms\"\ndo = \"switch-flap\"\nname = \"spine1\"\ndown = \"1ms\"\nup = \"1ms\"\nflaps = 0\n");
        assert!(e.starts_with("s.toml:7:9: `flaps` must be 1 to"), "{e}");
    }

    #[test]
    fn random_flaps_are_seeded_and_reproducible() {
        let text = |seed: u64| {
            format!("seed = {seed}\n[[random]]\ndo = \"link-flap\"\nlinks = \"leaf-spine\"\nmtbf = \"10ms\"\nmttr = \"1ms\"\nuntil = \"100ms\"\n")
        };
        let a = parse(&text(3), "s.toml", &topo()).unwrap();
        let b = parse(&text(3), "s.toml", &topo()).unwrap();
        let c = parse(&text(4), "s.toml", &topo()).unwrap();
        assert_eq!(a, b);
        assert_ne!(a, c);
        // 8 links for 100 ms at one failure per ~11 ms each: about 70 failures.
        let downs = a
            .items
            .iter()
            .filter(|i| matches!(i.1, ChangeRequest::LinkDown { .. }))
            .count();
        assert!((35..=110).contains(&downs), "{downs}");
        let ups = a.items.len() - downs;
        assert_eq!(ups, downs, "every failure is repaired");
        // Each link's stream is a fault of its own: its downs and ups carry its number.
        assert_eq!(a.faults.len(), a.items.len());
        let mut of_link = BTreeMap::new();
        for ((_, req), &fault) in a.items.iter().zip(&a.faults) {
            let (ChangeRequest::LinkDown { a, b, .. } | ChangeRequest::LinkUp { a, b, .. }) = req
            else {
                panic!("{req:?}")
            };
            assert_eq!(
                *of_link.entry((a.clone(), b.clone())).or_insert(fault),
                fault
            );
        }
        let numbers: std::collections::BTreeSet<_> = of_link.values().collect();
        assert_eq!(numbers.len(), of_link.len(), "{of_link:?}");
        assert!(!numbers.contains(&0));
        // Events are the timeline's own.
        let e = parse(
            "[[event]]\nat = \"1ms\"\ndo = \"link-down\"\na = \"leaf0\"\nb = \"spine0\"\n",
            "s.toml",
            &topo(),
        )
        .unwrap();
        assert_eq!(e.faults, [0]);
    }

    #[test]
    fn random_degradations_set_then_reset_each_link_in_turn() {
        let text = "[[random]]\ndo = \"link-degrade\"\nlinks = \"leaf-spine\"\nmtbf = \"10ms\"\nmttr = \"1ms\"\nuntil = \"100ms\"\nrate = \"10Gbit\"\nloss = 0.01\n";
        let s = parse(text, "s.toml", &topo()).unwrap();
        let mut open: BTreeMap<(String, String), bool> = BTreeMap::new();
        let mut faults = 0;
        for (_, req) in &s.items {
            match req {
                ChangeRequest::LinkSet {
                    a,
                    b,
                    rate_bps,
                    delay_ns,
                    loss,
                    buffer_bytes,
                    ..
                } => {
                    assert_eq!(
                        (*rate_bps, *delay_ns, *loss, *buffer_bytes),
                        (Some(10_000_000_000), None, Some(0.01), None)
                    );
                    let was = open.insert((a.clone(), b.clone()), true);
                    assert_ne!(was, Some(true), "a link degraded twice at once");
                    faults += 1;
                }
                ChangeRequest::LinkReset { a, b, .. } => {
                    let was = open.insert((a.clone(), b.clone()), false);
                    assert_eq!(was, Some(true), "a reset without a fault");
                }
                other => panic!("{other:?}"),
            }
        }
        assert!((35..=110).contains(&faults), "{faults}");
        assert!(open.values().all(|o| !o), "every fault is repaired");
        let base = "[[random]]\nlinks = \"leaf-spine\"\nmtbf = \"10ms\"\nmttr = \"1ms\"\nuntil = \"100ms\"\n";
        let e = err(&format!("{base}do = \"link-degrade\"\n"));
        assert!(
            e.starts_with("s.toml:6:6: link-degrade needs what a fault sets"),
            "{e}"
        );
        // A degrade that would make a link better: a file written for a faster fabric.
        let e = err(&format!("{base}do = \"link-degrade\"\nrate = \"1Tbit\"\n"));
        assert!(
            e.starts_with("s.toml:7:8: link-degrade's rate 1Tbit/s is above the 400Gbit/s of leaf0-spine0 #0 (a link it picks): a degrade must not make a link better"),
            "{e}"
        );
        let e = err(&format!("{base}do = \"link-degrade\"\ndelay = \"1ns\"\n"));
        assert!(
            e.starts_with("s.toml:7:9: link-degrade's delay 1ns is below"),
            "{e}"
        );
        let e = err(&format!("{base}do = \"link-degrade\"\nloss = 1.5\n"));
        assert!(
            e.starts_with("s.toml:7:8: `loss` must be a probability in [0, 1]"),
            "{e}"
        );
        let e = err(&format!("{base}do = \"link-flap\"\nrate = \"1Gbit\"\n"));
        assert!(
            e.starts_with("s.toml:7:8: link-flap does not take `rate`"),
            "{e}"
        );
        let e = err(&format!("{base}do = \"link-melt\"\n"));
        assert!(
            e.contains("one of: link-flap, link-degrade, switch-flap, gpu-flap"),
            "{e}"
        );
    }

    #[test]
    fn switches_and_gpus_fail_at_random_too() {
        let times = "mtbf = \"10ms\"\nmttr = \"1ms\"\nuntil = \"100ms\"\n";
        let s = parse(
            &format!("[[random]]\ndo = \"switch-flap\"\nswitches = \"spine\"\n{times}"),
            "s.toml",
            &topo(),
        )
        .unwrap();
        let mut hit = std::collections::BTreeSet::new();
        let mut down: BTreeMap<String, bool> = BTreeMap::new();
        for (_, req) in &s.items {
            match req {
                ChangeRequest::SwitchDown { name } => {
                    assert!(name.starts_with("spine"), "{name}");
                    assert_ne!(down.insert(name.clone(), true), Some(true), "{name} twice");
                    hit.insert(name.clone());
                }
                ChangeRequest::SwitchUp { name } => {
                    assert_eq!(down.insert(name.clone(), false), Some(true), "{name}");
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(
            hit.len(),
            4,
            "each of the 4 spines fails in 100 ms: {hit:?}"
        );
        assert!(down.values().all(|d| !d), "every switch comes back");
        let s = parse(
            &format!("[[random]]\ndo = \"gpu-flap\"\ngpus = \"0-1\"\n{times}"),
            "s.toml",
            &topo(),
        )
        .unwrap();
        assert!(s.items.iter().all(|(_, r)| matches!(
            r,
            ChangeRequest::GpuDown { name } | ChangeRequest::GpuUp { name }
                if name == "gpu0" || name == "gpu1"
        )));
        assert!(!s.items.is_empty());
        let e = err(&format!(
            "[[random]]\ndo = \"switch-flap\"\nswitches = \"spine9\"\n{times}"
        ));
        assert!(
            e.starts_with("s.toml:3:12: no GPU or switch \"spine9\""),
            "{e}"
        );
        let e = err(&format!(
            "[[random]]\ndo = \"switch-flap\"\nswitches = \"gpu0\"\n{times}"
        ));
        assert!(e.contains("gpu0 is a GPU"), "{e}");
        let e = err(&format!("[[random]]\ndo = \"switch-flap\"\n{times}"));
        assert!(
            e.starts_with("s.toml:2:6: switch-flap needs `switches`"),
            "{e}"
        );
        let e = err(&format!(
            "[[random]]\ndo = \"gpu-flap\"\ngpus = \"0-1\"\nlinks = \"nic\"\n{times}"
        ));
        assert!(
            e.starts_with(
                "s.toml:4:9: gpu-flap does not take `links` (link-flap, link-degrade do)"
            ),
            "{e}"
        );
        let e = err(&format!(
            "[[random]]\ndo = \"gpu-flap\"\ngpus = \"0-9\"\n{times}"
        ));
        assert!(e.starts_with("s.toml:3:8:") && e.contains("0 to 3"), "{e}");
    }

    #[test]
    fn mistakes_are_positioned_and_say_what_exists() {
        let e = err("[[event]]\nat = \"1ms\"\ndo = \"link-dwn\"\na = \"leaf0\"\nb = \"spine0\"\n");
        assert!(
            e.starts_with("s.toml:3:6: unknown change \"link-dwn\""),
            "{e}"
        );
        let e = err("[[event]]\nat = \"1ms\"\ndo = \"link-down\"\na = \"leaf0\"\nb = \"spine9\"\n");
        assert!(e.starts_with("s.toml:5:5:") && e.contains("spine0"), "{e}");
        // The daemon's checks, in the file's words and at the key they are about.
        let set = "[[event]]\nat = \"1ms\"\ndo = \"link-set\"\na = \"leaf0\"\nb = \"spine0\"\n";
        let e = err(&format!("{set}loss = 2.0\n"));
        assert!(
            e.starts_with("s.toml:6:8: `loss` must be a probability in [0, 1]"),
            "{e}"
        );
        let e = err(&format!("{set}rate = \"1Gbit\"\nfrom = \"spine1\"\n"));
        assert!(
            e.starts_with(
                "s.toml:7:8: `from` spine1: a direction of the link between leaf0 and spine0"
            ),
            "{e}"
        );
        let s = parse(
            &format!("{set}rate = \"1Gbit\"\nfrom = \"spine0\"\n"),
            "s.toml",
            &topo(),
        );
        assert!(s.is_ok(), "{s:?}");
        let e = err(&format!("{set}delay = \"2s\"\n"));
        assert!(
            e.starts_with("s.toml:6:9: `delay` must be at most 1 s"),
            "{e}"
        );
        let e = err(set);
        assert!(
            e.starts_with(
                "s.toml:1:1: nothing to set: give `rate`, `delay`, `loss`, `loss_burst` or `buffer`"
            ),
            "{e}"
        );
        let e = err("[[event]]\nat = \"1ms\"\ndo = \"link-flap\"\na = \"leaf0\"\nb = \"spine0\"\ndown = \"1ms\"\nup = \"1ms\"\nflaps = 0\n");
        assert!(e.starts_with("s.toml:8:9: `flaps` must be 1 to"), "{e}");
        let e = err("[[event]]\nat = \"1ms\"\ndo = \"incast\"\nto = \"gpu0\"\nfrom = \"1-3\"\nbytes = \"1MiB\"\nbursts = 3\n");
        assert!(
            e.starts_with("s.toml:7:10: `bursts` above 1 needs `burst_every`"),
            "{e}"
        );
        let e = err("[[event]]\nat = \"1ms\"\ndo = \"heal\"\nrate = \"1Gbit\"\n");
        assert!(
            e.starts_with("s.toml:4:8: heal does not take `rate`"),
            "{e}"
        );
        let e = err("[[event]]\nat = \"soon\"\ndo = \"heal\"\n");
        assert!(e.starts_with("s.toml:2:6:"), "{e}");
        let e = err("[[event]]\nat = \"1ms\"\ndo = \"load\"\nfrom = \"leaf0\"\nto = \"leaf1\"\nrate = \"0bit\"\n");
        assert!(
            e.starts_with("s.toml:6:8:") && e.contains("at least 1 bit/s"),
            "{e}"
        );
        let e = err("[[event]]\nat = \"1ms\"\ncount = 3\ndo = \"heal\"\n");
        assert!(e.starts_with("s.toml:3:9: `count` needs `every`"), "{e}");
        let e = err("[[random]]\ndo = \"link-flap\"\nlinks = \"spine-leaf\"\nmtbf = \"1ms\"\nmttr = \"1ms\"\nuntil = \"1s\"\n");
        assert!(
            e.starts_with("s.toml:3:9: no link class") && e.contains("leaf-spine"),
            "{e}"
        );
        let e = err("[[random]]\ndo = \"link-flap\"\nlinks = \"leaf-spine\"\nmtbf = \"1ns\"\nmttr = \"1ns\"\nuntil = \"1s\"\n");
        assert!(e.contains("more than"), "{e}");
        let e = err("seed = 1\n");
        assert!(e.contains("does nothing"), "{e}");
        let e = err("[fabric]\nname = \"c\"\n[topology]\nkind = \"single-switch\"\ngpus = 2\n");
        assert!(
            e.starts_with("s.toml:1:2: unknown field `fabric`")
                && e.contains("looks like a topology file")
                && e.contains("closbox up FILE"),
            "{e}"
        );
        let e = err("[[event]]\nat = \"1ms\"\ndo = \"heal\"\nfabric = \"x\"\n");
        assert!(!e.contains("topology file"), "{e}");
        let e = err("[[event]]\nat = \"1ms\"\ndo = \"link-set\"\ndealy = \"1us\"\n");
        assert!(e.ends_with("did you mean `delay`?"), "{e}");
        let e = err("[[event]]\nat = \"1ms\"\ndo = \"partition\"\ngroups = [\"0-9\"]\n");
        assert!(e.starts_with("s.toml:4:10:") && e.contains("0 to 3"), "{e}");
    }
}
