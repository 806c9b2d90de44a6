//! Typed quantities: fabric time, data rates and byte counts.
//!
//! Owns the integer representations every other module uses (nanoseconds, bits per second,
//! bytes) and their parsing from the strings topology files contain ("400Gbit", "50GB/s",
//! "1us", "32MiB"). No floating point survives parsing except where a ratio is the natural
//! unit (loss probabilities, time scale).

use std::fmt;
use std::ops::{Add, AddAssign, Sub};
use std::str::FromStr;

use serde::de::{self, Deserialize, Deserializer};

/// A point in fabric time, in nanoseconds since the model's epoch.
///
/// The model never reads a clock: whoever drives it passes `now`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Instant(u64);

impl Instant {
    /// The model's epoch.
    pub const ZERO: Instant = Instant(0);

    pub const fn from_nanos(ns: u64) -> Self {
        Instant(ns)
    }

    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    /// Time elapsed since `earlier`; zero if `earlier` is later.
    pub fn saturating_since(self, earlier: Instant) -> Duration {
        Duration(self.0.saturating_sub(earlier.0))
    }
}

impl Add<Duration> for Instant {
    type Output = Instant;
    /// Saturates at the end of time (584 years), which no fabric reaches: a time sum
    /// never wraps into the past, in release builds either.
    fn add(self, d: Duration) -> Instant {
        Instant(self.0.saturating_add(d.0))
    }
}

impl Sub<Instant> for Instant {
    type Output = Duration;
    /// Panics (in debug builds) if `rhs` is later: that is a bug in the caller.
    fn sub(self, rhs: Instant) -> Duration {
        Duration(self.0 - rhs.0)
    }
}

impl fmt::Display for Instant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "t={}", Duration(self.0))
    }
}

/// How many times slower than wall time the fabric runs (k ≥ 1; 1 is real time): the one
/// place where wall-clock and fabric time convert. Rates are divided by k and delays
/// multiplied by k on the wall clock; reports divide wall times by k.
#[derive(Clone, Copy, Debug, PartialEq, PartialOrd, serde::Serialize)]
#[serde(transparent)]
pub struct TimeScale(f64);

impl TimeScale {
    pub const REAL_TIME: TimeScale = TimeScale(1.0);
    /// The largest dilation a topology file may ask for.
    pub const MAX: f64 = 1e6;

    /// `None` unless `k` is a finite number in 1..=10⁶.
    pub fn new(k: f64) -> Option<TimeScale> {
        (k.is_finite() && (1.0..=Self::MAX).contains(&k)).then_some(TimeScale(k))
    }

    pub fn get(self) -> f64 {
        self.0
    }

    /// The wall time a span of fabric time takes.
    pub fn to_wall(self, fabric: Duration) -> std::time::Duration {
        // Real time converts on every frame's way in and out: no float round trip.
        if self.0 == 1.0 {
            return std::time::Duration::from_nanos(fabric.as_nanos());
        }
        std::time::Duration::from_nanos((fabric.as_nanos() as f64 * self.0) as u64)
    }

    /// The fabric time that passes in a span of wall time.
    pub fn to_fabric(self, wall: std::time::Duration) -> Duration {
        // Through u64 (584 years of nanoseconds): a u128 to f64 conversion is a library call.
        if self.0 == 1.0 {
            return Duration::from_nanos(wall.as_nanos() as u64);
        }
        Duration::from_nanos((wall.as_nanos() as u64 as f64 / self.0) as u64)
    }

    /// `to_wall` for a span given as a std duration (compute time in the agents).
    pub fn stretch(self, fabric: std::time::Duration) -> std::time::Duration {
        fabric.mul_f64(self.0)
    }

    /// A wall-clock quantity in any time unit (µs, s), as fabric time in the same unit.
    pub fn fabric_of(self, wall: f64) -> f64 {
        wall / self.0
    }

    /// A fabric-time quantity in any time unit, as wall time in the same unit.
    pub fn wall_of(self, fabric: f64) -> f64 {
        fabric * self.0
    }
}

impl fmt::Display for TimeScale {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl<'de> Deserialize<'de> for TimeScale {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let k = f64::deserialize(d)?;
        TimeScale::new(k).ok_or_else(|| {
            de::Error::custom(format!("time scale {k} is not between 1 and {}", Self::MAX))
        })
    }
}

/// A span of fabric time in nanoseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Duration(u64);

impl Duration {
    pub const ZERO: Duration = Duration(0);

    pub const fn from_nanos(ns: u64) -> Self {
        Duration(ns)
    }

    pub const fn from_micros(us: u64) -> Self {
        Duration(us * 1_000)
    }

    pub const fn from_millis(ms: u64) -> Self {
        Duration(ms * 1_000_000)
    }

    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    pub fn as_secs_f64(self) -> f64 {
        self.0 as f64 / 1e9
    }
}

impl Add for Duration {
    type Output = Duration;
    fn add(self, rhs: Duration) -> Duration {
        Duration(self.0.saturating_add(rhs.0))
    }
}

impl AddAssign for Duration {
    fn add_assign(&mut self, rhs: Duration) {
        self.0 = self.0.saturating_add(rhs.0);
    }
}

impl fmt::Display for Duration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ns = self.0;
        if ns == 0 {
            write!(f, "0s")
        } else if ns % 1_000_000_000 == 0 {
            write!(f, "{}s", ns / 1_000_000_000)
        } else if ns % 1_000_000 == 0 {
            write!(f, "{}ms", ns / 1_000_000)
        } else if ns % 1_000 == 0 {
            write!(f, "{}us", ns / 1_000)
        } else {
            write!(f, "{ns}ns")
        }
    }
}

impl FromStr for Duration {
    type Err = UnitError;

    /// Accepts a number followed by `ns`, `us` (or `µs`), `ms` or `s`: "1us", "2.5ms", "0".
    fn from_str(s: &str) -> Result<Self, UnitError> {
        let (value, unit) = split_number(s, "duration")?;
        let scale: f64 = match unit {
            "ns" => 1.0,
            // MICRO SIGN (U+00B5) and GREEK SMALL LETTER MU (U+03BC) look the same.
            "us" | "\u{b5}s" | "\u{3bc}s" => 1e3,
            "ms" => 1e6,
            "s" => 1e9,
            "" if value == 0.0 => 1.0,
            _ => {
                return Err(UnitError::new(
                    s,
                    "duration",
                    "expected a unit: ns, us, ms or s (e.g. \"1us\")",
                ))
            }
        };
        let ns = value * scale;
        if ns.fract().abs() > 1e-6 {
            return Err(UnitError::new(
                s,
                "duration",
                "finer than the model's 1 ns resolution",
            ));
        }
        if ns > u64::MAX as f64 / 4.0 {
            return Err(UnitError::new(s, "duration", "too large"));
        }
        Ok(Duration(ns.round() as u64))
    }
}

/// A data rate in bits per second.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Bandwidth(u64);

impl Bandwidth {
    pub const fn from_bps(bps: u64) -> Self {
        Bandwidth(bps)
    }

    pub const fn from_gbps(gbps: u64) -> Self {
        Bandwidth(gbps * 1_000_000_000)
    }

    pub const fn bps(self) -> u64 {
        self.0
    }

    /// Time to send `bits` at this rate, rounded down, plus the remainder in units of
    /// `1/rate` ns (so that back-to-back transmissions can carry it and stay exact).
    #[inline]
    pub fn transmit_time(self, bits: u64, carry: u64) -> (Duration, u64) {
        // Packets are far below 2^34 bits and rates below 2^54 bit/s, so this fits in
        // u64 (a 64-bit division is several times cheaper than a 128-bit one).
        match bits
            .checked_mul(1_000_000_000)
            .and_then(|n| n.checked_add(carry))
        {
            Some(num) => (Duration(num / self.0), num % self.0),
            None => {
                let num = bits as u128 * 1_000_000_000 + carry as u128;
                let rate = self.0 as u128;
                (Duration((num / rate) as u64), (num % rate) as u64)
            }
        }
    }
}

impl fmt::Display for Bandwidth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        for (div, unit) in [
            (1_000_000_000_000u64, "Tbit/s"),
            (1_000_000_000, "Gbit/s"),
            (1_000_000, "Mbit/s"),
            (1_000, "kbit/s"),
        ] {
            if b >= div {
                return if b % div == 0 {
                    write!(f, "{}{unit}", b / div)
                } else {
                    write!(f, "{:.3}{unit}", b as f64 / div as f64)
                };
            }
        }
        write!(f, "{b}bit/s")
    }
}

impl FromStr for Bandwidth {
    type Err = UnitError;

    /// Bits: "400Gbit", "400Gbps", "400Gbit/s", "100Mbit", "10kbit"; bytes: "50GB/s",
    /// "50GBps" (×8). Decimal prefixes (k, M, G, T) as link rates use them; also written
    /// in lower case before "bit", as `tc` writes rates ("1gbit", "100mbit").
    fn from_str(s: &str) -> Result<Self, UnitError> {
        let (value, unit) = split_number(s, "rate")?;
        let unit_l = unit.strip_suffix("/s").unwrap_or(unit);
        let (prefix, base) = match unit_l.char_indices().next() {
            Some((_, c @ ('k' | 'K' | 'M' | 'G' | 'T' | 'm' | 'g' | 't'))) => {
                (Some(c), &unit_l[1..])
            }
            _ => (None, unit_l),
        };
        if matches!(prefix, Some('m' | 'g' | 't')) && base != "bit" {
            // `tc` reads "1gbps" as bytes a second, most people as bits: neither is guessed.
            return Err(UnitError::new(
                s,
                "rate",
                "a lower-case prefix is taken before \"bit\" only (\"1gbit\", as tc writes \
                 it); write \"1Gbps\" for bits or \"1GB/s\" for bytes a second",
            ));
        }
        let mult: f64 = match prefix {
            None => 1.0,
            Some('k' | 'K') => 1e3,
            Some('M' | 'm') => 1e6,
            Some('G' | 'g') => 1e9,
            Some('T' | 't') => 1e12,
            Some(_) => unreachable!(),
        };
        let per_second = unit.ends_with("/s");
        let bits_per_unit =
            match (base, per_second) {
                ("bit" | "b", _) | ("bps", false) => 1.0,
                ("B", _) | ("Bps", false) => 8.0,
                _ => return Err(UnitError::new(
                    s,
                    "rate",
                    "expected a unit such as \"400Gbit\", \"100Mbit/s\", \"10Gbps\" or \"50GB/s\"",
                )),
            };
        let bps = value * mult * bits_per_unit;
        if bps < 1.0 {
            return Err(UnitError::new(s, "rate", "must be at least 1 bit/s"));
        }
        if bps > 1e16 {
            return Err(UnitError::new(s, "rate", "too large (limit 10 Pbit/s)"));
        }
        Ok(Bandwidth(bps.round() as u64))
    }
}

/// A number of bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Bytes(u64);

impl Bytes {
    pub const fn new(bytes: u64) -> Self {
        Bytes(bytes)
    }

    pub const fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for Bytes {
    /// Exact, in the unit that says it shortest: binary ("512KiB", "1GiB"), or from a
    /// megabyte up decimal ("1TB", "1MB"; a terabyte was "976562500KiB"), else bytes.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        let binary = [
            (1u64 << 40, "TiB"),
            (1 << 30, "GiB"),
            (1 << 20, "MiB"),
            (1 << 10, "KiB"),
        ];
        let decimal = [
            (1_000_000_000_000, "TB"),
            (1_000_000_000, "GB"),
            (1_000_000, "MB"),
        ];
        let best = binary
            .into_iter()
            .chain(decimal)
            .filter(|&(div, _)| b >= div && b % div == 0)
            .min_by_key(|&(div, _)| b / div);
        match best {
            Some((div, unit)) => write!(f, "{}{unit}", b / div),
            None => write!(f, "{b}B"),
        }
    }
}

/// A byte count for people: "1.3 GiB", "512 MiB", "40 KiB".
pub fn approx_bytes(b: u64) -> String {
    for (div, unit) in [(1u64 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")] {
        if b >= div {
            let v = b as f64 / div as f64;
            return if v >= 100.0 || b % div == 0 {
                format!("{v:.0} {unit}")
            } else {
                format!("{v:.1} {unit}")
            };
        }
    }
    format!("{b} B")
}

/// A duration for people, to 3 significant digits at most: "218 ms", "1.5 s", "5.2 µs",
/// "40 ns" (the exact `Display`, "217999914ns", is for files and command lines).
pub fn approx_duration(d: Duration) -> String {
    let ns = d.as_nanos();
    for (div, unit) in [(1_000_000_000u64, "s"), (1_000_000, "ms"), (1_000, "µs")] {
        if ns >= div {
            let v = ns as f64 / div as f64;
            let text = if v >= 100.0 {
                format!("{v:.0}")
            } else if v >= 10.0 {
                format!("{v:.1}")
            } else {
                format!("{v:.2}")
            };
            let text = if text.contains('.') {
                text.trim_end_matches('0').trim_end_matches('.')
            } else {
                &text
            };
            return format!("{text} {unit}");
        }
    }
    format!("{ns} ns")
}

impl FromStr for Bytes {
    type Err = UnitError;

    /// One grammar for topology files and the command line: "1500", "1500B"; binary
    /// "64K" = "64KiB", "32M" = "32MiB", "1G" = "1GiB", "1T" = "1TiB"; decimal "100KB",
    /// "1.5MB", "1GB". Fractions are fine when the result is whole: "1.5M".
    fn from_str(s: &str) -> Result<Self, UnitError> {
        let (value, unit) = split_number(s, "size")?;
        const KI: f64 = 1024.0;
        let mult: f64 = match unit {
            "" | "B" => 1.0,
            "K" | "k" | "KiB" => KI,
            "M" | "MiB" => KI * KI,
            "G" | "GiB" => KI * KI * KI,
            "T" | "TiB" => KI * KI * KI * KI,
            "KB" | "kB" => 1e3,
            "MB" => 1e6,
            "GB" => 1e9,
            "TB" => 1e12,
            _ => {
                return Err(UnitError::new(
                    s,
                    "size",
                    "expected a unit: B; K, M, G, T or KiB, MiB, GiB, TiB (binary); KB, MB, GB, TB (decimal)",
                ))
            }
        };
        let bytes = value * mult;
        if bytes.fract().abs() > 1e-6 {
            return Err(UnitError::new(s, "size", "not a whole number of bytes"));
        }
        if bytes > 1e15 {
            return Err(UnitError::new(s, "size", "too large"));
        }
        Ok(Bytes(bytes.round() as u64))
    }
}

/// A quantity string that did not parse.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid {what} {input:?}: {reason}")]
pub struct UnitError {
    pub input: String,
    pub what: &'static str,
    pub reason: &'static str,
}

impl UnitError {
    fn new(input: &str, what: &'static str, reason: &'static str) -> Self {
        UnitError {
            input: input.to_owned(),
            what,
            reason,
        }
    }
}

/// Splits "2.5ms" into (2.5, "ms"). The number must be finite and non-negative.
fn split_number<'a>(s: &'a str, what: &'static str) -> Result<(f64, &'a str), UnitError> {
    let t = s.trim();
    if t.starts_with('-') {
        return Err(UnitError::new(s, what, "must not be negative"));
    }
    let end = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
        .unwrap_or(t.len());
    // An exponent ("1e-3s", "2.5E9bit"; no unit starts with an e): not taken, and said so
    // (it read as the number 1 before a unit "e-3s").
    if end > 0 && t[end..].starts_with(['e', 'E']) {
        let rest = t[end + 1..].trim_start_matches(['+', '-']);
        if rest.starts_with(|c: char| c.is_ascii_digit()) {
            return Err(UnitError::new(
                s,
                what,
                match what {
                    "duration" => {
                        "write the number without an exponent (\"1500us\", not \"1.5e3us\")"
                    }
                    "rate" => "write the number without an exponent (\"400Gbit\", not \"4e2Gbit\")",
                    _ => "write the number without an exponent (\"2MB\", not \"2e6B\")",
                },
            ));
        }
    }
    let (num, unit) = t.split_at(end);
    if num.is_empty() {
        return Err(UnitError::new(s, what, "expected a number first"));
    }
    let value: f64 = num
        .replace('_', "")
        .parse()
        .map_err(|_| UnitError::new(s, what, "malformed number"))?;
    if !value.is_finite() {
        return Err(UnitError::new(s, what, "not a finite number"));
    }
    Ok((value, unit.trim()))
}

/// Deserializes from a string with units or, for sizes, a bare integer (bytes); a
/// duration may be a bare 0. Errors carry the text's position through the TOML
/// deserializer.
macro_rules! deserialize_from_str {
    ($ty:ident, $what:literal, $example:literal, $int:expr) => {
        impl<'de> Deserialize<'de> for $ty {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct V;
                impl de::Visitor<'_> for V {
                    type Value = $ty;
                    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                        write!(f, "a {} such as \"{}\"", $what, $example)
                    }
                    fn visit_str<E: de::Error>(self, v: &str) -> Result<$ty, E> {
                        v.parse().map_err(E::custom)
                    }
                    fn visit_i64<E: de::Error>(self, v: i64) -> Result<$ty, E> {
                        let int: fn(u64) -> Option<$ty> = $int;
                        match u64::try_from(v).ok().map(|v| (v, int(v))) {
                            Some((_, Some(x))) => Ok(x),
                            None => Err(E::custom(format!("a {} cannot be negative", $what))),
                            Some((_, None)) => Err(E::custom(format!(
                                "a {} needs a unit, written as a string (e.g. \"{}\")",
                                $what, $example
                            ))),
                        }
                    }
                }
                d.deserialize_any(V)
            }
        }
    };
}

deserialize_from_str!(Duration, "duration", "1us", |ns| (ns == 0)
    .then_some(Duration::ZERO));
deserialize_from_str!(Bandwidth, "rate", "400Gbit", |_| None);
deserialize_from_str!(Bytes, "size", "32MiB", |b| Some(Bytes::new(b)));

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_scale_converts_both_ways() {
        let k = TimeScale::new(4000.0).unwrap();
        let fabric = Duration::from_micros(1);
        assert_eq!(k.to_wall(fabric), std::time::Duration::from_millis(4));
        assert_eq!(k.to_fabric(std::time::Duration::from_millis(4)), fabric);
        assert_eq!(k.fabric_of(8.0), 0.002);
        assert_eq!(k.wall_of(0.002), 8.0);
        for bad in [0.5, f64::NAN, f64::INFINITY, 2e6] {
            assert!(TimeScale::new(bad).is_none(), "{bad}");
        }
        assert_eq!(parse_scale("4000"), k);
    }

    #[test]
    fn durations_for_people_keep_three_digits() {
        let d = |ns| approx_duration(Duration::from_nanos(ns));
        assert_eq!(d(217_999_914), "218 ms");
        assert_eq!(d(31_000_000), "31 ms");
        assert_eq!(d(1_500_000_000), "1.5 s");
        assert_eq!(d(5_240), "5.24 µs");
        assert_eq!(d(12_345_678), "12.3 ms");
        assert_eq!(d(1_000), "1 µs");
        assert_eq!(d(40), "40 ns");
        assert_eq!(d(0), "0 ns");
    }

    /// A TimeScale through serde (from TOML).
    fn parse_scale(n: &str) -> TimeScale {
        #[derive(serde::Deserialize)]
        struct W {
            k: TimeScale,
        }
        toml::from_str::<W>(&format!("k = {n}")).unwrap().k
    }

    #[test]
    fn parses_rates() {
        let g = |s: &str| s.parse::<Bandwidth>().unwrap().bps();
        assert_eq!(g("400Gbit"), 400_000_000_000);
        assert_eq!(g("400Gbit/s"), 400_000_000_000);
        assert_eq!(g("10Gbps"), 10_000_000_000);
        assert_eq!(g("100Mbit"), 100_000_000);
        assert_eq!(g("50GB/s"), 400_000_000_000);
        assert_eq!(g("450GBps"), 3_600_000_000_000);
        assert_eq!(g("2.5Gbit"), 2_500_000_000);
        assert_eq!(g("1kbit"), 1_000);
        // As tc writes them.
        assert_eq!(g("1gbit"), 1_000_000_000);
        assert_eq!(g("100mbit"), 100_000_000);
        assert_eq!(g("1tbit/s"), 1_000_000_000_000);
        for ambiguous in ["1gbps", "1gb", "1gB/s", "100mbps"] {
            let e = ambiguous.parse::<Bandwidth>().unwrap_err().to_string();
            assert!(
                e.contains("\"1Gbps\" for bits or \"1GB/s\" for bytes"),
                "{e}"
            );
        }
        for bad in [
            "",
            "1gBit",
            "1mBit",
            "Gbit",
            "10",
            "10 furlongs",
            "10Xbit",
            "-1Gbit",
            "0bit",
            "10Gbps/s",
        ] {
            assert!(bad.parse::<Bandwidth>().is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn parses_durations() {
        let g = |s: &str| s.parse::<Duration>().unwrap().as_nanos();
        assert_eq!(g("1us"), 1_000);
        assert_eq!(g("1µs"), 1_000);
        assert_eq!(g("2.5ms"), 2_500_000);
        assert_eq!(g("700ns"), 700);
        assert_eq!(g("1s"), 1_000_000_000);
        assert_eq!(g("0"), 0);
        for bad in ["1", "1.5ns", "ms", "1h", "1e3us"] {
            assert!(bad.parse::<Duration>().is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn parses_sizes() {
        let g = |s: &str| s.parse::<Bytes>().unwrap().get();
        assert_eq!(g("1500"), 1500);
        assert_eq!(g("64KiB"), 65_536);
        assert_eq!(g("32MiB"), 32 << 20);
        assert_eq!(g("100KB"), 100_000);
        assert_eq!(g("1.5MB"), 1_500_000);
        for bad in ["1.5", "12 parsecs", "KiB"] {
            assert!(bad.parse::<Bytes>().is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn exponents_are_refused_as_such() {
        for (text, what) in [
            ("1e3us", "duration"),
            ("1e400Gbit", "rate"),
            ("2.5E+6B", "size"),
        ] {
            let e = match what {
                "duration" => text.parse::<Duration>().unwrap_err().to_string(),
                "rate" => text.parse::<Bandwidth>().unwrap_err().to_string(),
                _ => text.parse::<Bytes>().unwrap_err().to_string(),
            };
            assert!(
                e.starts_with(&format!(
                    "invalid {what} \"{text}\": write the number without an exponent"
                )),
                "{e}"
            );
        }
    }

    #[test]
    fn negative_values_are_named_as_such() {
        let e = "-1us".parse::<Duration>().unwrap_err().to_string();
        assert_eq!(e, "invalid duration \"-1us\": must not be negative");
        let e = " -5Gbit".parse::<Bandwidth>().unwrap_err().to_string();
        assert!(e.ends_with("must not be negative"), "{e}");
        let e = "-1M".parse::<Bytes>().unwrap_err().to_string();
        assert!(e.ends_with("must not be negative"), "{e}");
    }

    #[test]
    fn transmit_time_carries_remainder_exactly() {
        // 3 bits at 1 Gbit/s = 3 ns; 1 bit at 3 Gbit/s = 0.333 ns: three of them = 1 ns.
        let r = Bandwidth::from_bps(3_000_000_000);
        let (mut total, mut carry) = (Duration::ZERO, 0);
        for _ in 0..3 {
            let (d, c) = r.transmit_time(1, carry);
            total += d;
            carry = c;
        }
        assert_eq!(total, Duration::from_nanos(1));
        assert_eq!(carry, 0);
    }

    #[test]
    fn displays_round_trip() {
        for s in [
            "400Gbit/s",
            "100Mbit/s",
            "1us",
            "2ms",
            "32MiB",
            "1500B",
            "9000B",
            "512KiB",
            "1TB",
            "3MB",
            "1TiB",
            "1000001B",
        ] {
            let shown = match s {
                s if s.ends_with("bit/s") => s.parse::<Bandwidth>().unwrap().to_string(),
                s if s.ends_with('B') => s.parse::<Bytes>().unwrap().to_string(),
                s => s.parse::<Duration>().unwrap().to_string(),
            };
            assert_eq!(shown, s);
        }
    }
}
