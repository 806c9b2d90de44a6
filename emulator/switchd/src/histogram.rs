//! Lateness percentiles: `hdrhistogram` (2 significant digits, 1 ns to an hour) behind
//! the few operations the data plane and `status` need, and `Recent`, a sliding window
//! of them. Snapshots export recorded (value, count) pairs so that another process can
//! take the difference of two (`since`).

/// Values tracked: 1 ns to an hour (a lateness beyond that is recorded as an hour).
const HIGHEST_NS: u64 = 3_600_000_000_000;
const SIGNIFICANT_DIGITS: u8 = 2;

#[derive(Clone, Debug)]
pub struct Histogram {
    h: hdrhistogram::Histogram<u64>,
    /// The largest sample exactly (the histogram knows it to 2 digits).
    max: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Self::new()
    }
}

impl Histogram {
    pub fn new() -> Histogram {
        Histogram {
            h: hdrhistogram::Histogram::new_with_bounds(1, HIGHEST_NS, SIGNIFICANT_DIGITS)
                .expect("valid histogram bounds"),
            max: 0,
        }
    }

    pub fn record(&mut self, v: u64) {
        self.h.saturating_record(v);
        self.max = self.max.max(v);
    }

    pub fn count(&self) -> u64 {
        self.h.len()
    }

    pub fn max(&self) -> u64 {
        self.max
    }

    /// The recorded values as (value, count): what `status` exports, so that a client can
    /// take the difference of two snapshots (`since`).
    pub fn buckets(&self) -> Vec<(u64, u64)> {
        self.h
            .iter_recorded()
            .map(|v| (v.value_iterated_to(), v.count_at_value()))
            .collect()
    }

    /// The samples recorded between snapshot `earlier` and snapshot `later` (both from
    /// `buckets` of one histogram).
    pub fn since(earlier: &[(u64, u64)], later: &[(u64, u64)]) -> Histogram {
        let from = |b: &[(u64, u64)]| {
            let mut h = Histogram::new();
            for &(v, c) in b {
                let _ = h.h.record_n(v.min(HIGHEST_NS), c);
            }
            h
        };
        let mut h = from(later);
        // A snapshot that is not an earlier state of `later` leaves nothing to subtract.
        if h.h.subtract(&from(earlier).h).is_err() {
            h.h.reset();
        }
        // Only the bucket is known now: its highest value.
        h.max = if h.h.is_empty() { 0 } else { h.h.max() };
        h
    }

    /// Adds `other`'s samples to these.
    pub fn merge(&mut self, other: &Histogram) {
        let _ = self.h.add(&other.h);
        self.max = self.max.max(other.max);
    }

    fn clear(&mut self) {
        self.h.reset();
        self.max = 0;
    }

    /// The value below which a fraction `q` of samples fall (to 2 significant digits,
    /// never above the largest sample); 0 when empty.
    pub fn quantile(&self, q: f64) -> u64 {
        if self.h.is_empty() {
            return 0;
        }
        self.h.value_at_quantile(q).min(self.max)
    }
}

/// The samples of the last `window`: a ring of histograms, one per slot of
/// `window / slots`, so that "recent" always means the most recent stretch of time (to
/// within one slot), not the last completed block. Time is a parameter (nanoseconds since
/// any epoch), so the window is tested without a clock.
#[derive(Clone, Debug)]
pub struct Recent {
    slot_ns: u64,
    ring: Vec<Histogram>,
    /// Number of the slot now being filled (time / slot_ns).
    current: u64,
}

impl Recent {
    pub fn new(window_ns: u64, slots: usize) -> Recent {
        Recent {
            slot_ns: (window_ns / slots as u64).max(1),
            ring: vec![Histogram::new(); slots.max(1)],
            current: 0,
        }
    }

    fn advance(&mut self, now_ns: u64) {
        let slot = now_ns / self.slot_ns;
        if slot <= self.current {
            return;
        }
        let n = self.ring.len() as u64;
        if slot - self.current >= n {
            self.ring.iter_mut().for_each(Histogram::clear);
        } else {
            for s in self.current + 1..=slot {
                self.ring[(s % n) as usize].clear();
            }
        }
        self.current = slot;
    }

    pub fn record(&mut self, now_ns: u64, v: u64) {
        self.advance(now_ns);
        let n = self.ring.len() as u64;
        self.ring[(self.current % n) as usize].record(v);
    }

    /// The samples of the window ending at `now_ns`.
    pub fn snapshot(&mut self, now_ns: u64) -> Histogram {
        self.advance(now_ns);
        let mut h = Histogram::new();
        for slot in &self.ring {
            h.merge(slot);
        }
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    #[test]
    fn recent_is_the_last_window_not_the_last_completed_block() {
        let mut r = Recent::new(5 * S, 10);
        // A burst at t = 1 s is recent until t = 6 s, then gone.
        for _ in 0..40 {
            r.record(S, 1_000);
        }
        assert_eq!(r.snapshot(S).count(), 40);
        assert_eq!(r.snapshot(5 * S).count(), 40);
        assert_eq!(r.snapshot(6 * S + S / 2).count(), 0);
        // Lateness that starts now shows now, not after the next block closes.
        for _ in 0..200 {
            r.record(7 * S, 900_000);
        }
        let h = r.snapshot(7 * S + 1);
        assert_eq!(h.count(), 200);
        assert!(h.quantile(0.99) >= 850_000);
        // A long quiet spell empties it; time going backwards changes nothing.
        assert_eq!(r.snapshot(100 * S).count(), 0);
        r.record(50 * S, 5);
        assert_eq!(r.snapshot(100 * S).count(), 1);
    }

    #[test]
    fn quantiles() {
        let mut h = Histogram::new();
        for v in 1..=1000u64 {
            h.record(v * 1000);
        }
        let p50 = h.quantile(0.5) as f64;
        let p99 = h.quantile(0.99) as f64;
        assert!((p50 / 500_000.0 - 1.0).abs() < 0.04, "{p50}");
        assert!((p99 / 990_000.0 - 1.0).abs() < 0.04, "{p99}");
        assert_eq!(h.quantile(1.0), 1_000_000);
        assert_eq!(Histogram::new().quantile(0.5), 0);
    }

    #[test]
    fn the_difference_of_snapshots_is_what_came_between() {
        let mut h = Histogram::new();
        for v in 1..=1000u64 {
            h.record(v);
        }
        let before = h.buckets();
        for _ in 0..1000 {
            h.record(50_000);
        }
        let between = Histogram::since(&before, &h.buckets());
        assert_eq!(between.count(), 1000);
        let p50 = between.quantile(0.5) as f64;
        assert!((p50 / 50_000.0 - 1.0).abs() < 0.04, "{p50}");
        assert!(between.max() >= 50_000 && between.max() < 52_000);
        assert_eq!(Histogram::since(&h.buckets(), &h.buckets()).count(), 0);
    }
}
