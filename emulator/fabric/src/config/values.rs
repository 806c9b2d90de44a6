//! One value or table at a time: counts, durations, probabilities, ECN, queues, links,
//! switch tiers, each checked with its position.

use toml::Spanned;

use super::raw::*;
use super::*;
use crate::topology::{Ecn, LinkParams, QueueParams, Routing, SwitchParams};
use crate::units::{Bandwidth, Bytes, Duration};

pub(super) fn count(
    cx: &Cx,
    v: &Spanned<i64>,
    key: &str,
    min: i64,
    max: i64,
) -> Result<u32, ConfigError> {
    let n = *v.get_ref();
    if n < min || n > max {
        return Err(cx.err(v, format!("`{key}` = {n} is out of range {min}..={max}")));
    }
    Ok(n as u32)
}

/// A delay or latency, at most `MAX_DELAY`.
pub(super) fn duration(
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

pub(super) fn probability(cx: &Cx, v: &Spanned<f64>, key: &str) -> Result<f64, ConfigError> {
    let p = *v.get_ref();
    if !(0.0..1.0).contains(&p) {
        return Err(cx.err(v, format!("`{key}` = {p} must be in [0, 1)")));
    }
    Ok(p)
}

pub(super) fn ecn(cx: &Cx, table: &Spanned<RawEcn>) -> Result<Ecn, ConfigError> {
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

pub(super) fn queue(
    cx: &Cx,
    buffer: &Option<Spanned<Bytes>>,
    ecn_raw: &Option<Spanned<RawEcn>>,
    default: QueueParams,
) -> Result<QueueParams, ConfigError> {
    let buffer_at = buffer;
    let buffer = match buffer {
        Some(b) if b.get_ref().get() == 0 => return Err(cx.err(b, "`buffer` must be above 0")),
        Some(b) => *b.get_ref(),
        None => default.buffer,
    };
    // A file's ecn table replaces the default's (a preset's marking).
    let ecn = match ecn_raw {
        Some(e) => Some(ecn(cx, e)?),
        None => default.ecn,
    };
    let first_mark = match ecn {
        Some(Ecn::Step { k }) => Some(k),
        Some(Ecn::Red { min, .. }) => Some(min),
        None => None,
    };
    // Where the file set either, the error points there.
    let at = ecn_raw
        .as_ref()
        .map(|e| e.span())
        .or(buffer_at.as_ref().map(|b| b.span()));
    if let (Some(at), Some(mark)) = (at, first_mark) {
        if mark >= buffer {
            return Err(cx.err_at(
                Some(at),
                format!("ecn: marking starts at {mark}, not below the buffer of {buffer}: no packet would ever be marked"),
            ));
        }
    }
    Ok(QueueParams { buffer, ecn })
}

pub(super) fn link_params(
    cx: &Cx,
    rate: Option<Bandwidth>,
    delay: &Option<Spanned<Duration>>,
    (loss, loss_burst): (&Option<Spanned<f64>>, &Option<Spanned<f64>>),
    base: LinkParams,
) -> Result<LinkParams, ConfigError> {
    Ok(LinkParams {
        rate: rate.unwrap_or(base.rate),
        delay: duration(cx, delay, "delay")?.unwrap_or(base.delay),
        loss: match loss {
            Some(p) => probability(cx, p, "loss")?,
            None => base.loss,
        },
        loss_burst: match loss_burst {
            Some(b) if !loss_burst_ok(*b.get_ref()) => {
                return Err(cx.err(
                    b,
                    format!(
                        "`loss_burst` = {} must be a mean run of lost frames from 1 to {MAX_LOSS_BURST}",
                        b.get_ref()
                    ),
                ))
            }
            Some(b) => *b.get_ref(),
            None => base.loss_burst,
        },
    })
}

/// A tier's settings: `d` (the tier's defaults, or a preset's) with what the file says.
pub(super) fn switch_tier(
    cx: &Cx,
    raw: &Option<RawSwitchTier>,
    d: SwitchParams,
) -> Result<SwitchParams, ConfigError> {
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
        icmp_rate: r
            .icmp_rate
            .as_ref()
            .map(|v| count(cx, v, "icmp_rate", 0, 1_000_000_000))
            .transpose()?
            .unwrap_or(d.icmp_rate),
    })
}
