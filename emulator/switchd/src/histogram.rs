//! A log-linear histogram of nanosecond values (HDR-style, ~3% resolution): constant
//! memory, O(1) record, for lateness percentiles.

/// Sub-buckets per power of two.
const SUB: u64 = 32;
const SUB_BITS: u32 = 5;
const BUCKETS: usize = (64 - SUB_BITS as usize + 1) * SUB as usize;

#[derive(Clone, Debug)]
pub struct Histogram {
    counts: Vec<u64>,
    total: u64,
    max: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Self::new()
    }
}

fn index(v: u64) -> usize {
    if v < SUB {
        return v as usize;
    }
    let exp = 63 - v.leading_zeros(); // ≥ SUB_BITS
    let shift = exp - SUB_BITS;
    let mantissa = (v >> shift) - SUB; // 0..SUB
    ((shift as u64 + 1) * SUB + mantissa) as usize
}

/// Upper bound of the values in bucket `i`.
fn upper(i: usize) -> u64 {
    let i = i as u64;
    if i < SUB {
        return i;
    }
    let shift = i / SUB - 1;
    let mantissa = i % SUB + SUB;
    ((mantissa + 1) << shift) - 1
}

impl Histogram {
    pub fn new() -> Histogram {
        Histogram {
            counts: vec![0; BUCKETS],
            total: 0,
            max: 0,
        }
    }

    pub fn record(&mut self, v: u64) {
        self.counts[index(v)] += 1;
        self.total += 1;
        self.max = self.max.max(v);
    }

    pub fn count(&self) -> u64 {
        self.total
    }

    pub fn max(&self) -> u64 {
        self.max
    }

    /// The non-empty buckets as (bucket, count): what `status` exports, so that a client
    /// can take the difference of two snapshots (`since`).
    pub fn buckets(&self) -> Vec<(u32, u64)> {
        self.counts
            .iter()
            .enumerate()
            .filter(|(_, &c)| c > 0)
            .map(|(i, &c)| (i as u32, c))
            .collect()
    }

    /// The samples recorded between snapshot `earlier` and snapshot `later` (both from
    /// `buckets` of one histogram). The maximum is the upper bound of the highest bucket.
    pub fn since(earlier: &[(u32, u64)], later: &[(u32, u64)]) -> Histogram {
        let mut h = Histogram::new();
        for &(i, c) in later {
            if let Some(slot) = h.counts.get_mut(i as usize) {
                *slot += c;
            }
        }
        for &(i, c) in earlier {
            if let Some(slot) = h.counts.get_mut(i as usize) {
                *slot = slot.saturating_sub(c);
            }
        }
        h.total = h.counts.iter().sum();
        h.max = h.counts.iter().rposition(|&c| c > 0).map_or(0, upper);
        h
    }

    /// Adds `other`'s samples to these.
    pub fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.total += other.total;
        self.max = self.max.max(other.max);
    }

    fn clear(&mut self) {
        self.counts.iter_mut().for_each(|c| *c = 0);
        self.total = 0;
        self.max = 0;
    }

    /// The value below which a fraction `q` of samples fall (bucket upper bound, capped
    /// at the maximum seen); 0 when empty.
    pub fn quantile(&self, q: f64) -> u64 {
        if self.total == 0 {
            return 0;
        }
        let rank = ((q * self.total as f64).ceil() as u64).clamp(1, self.total);
        let mut seen = 0;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return upper(i).min(self.max);
            }
        }
        self.max
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
    fn buckets_are_ordered_and_tight() {
        let mut last = 0;
        for v in (0..2_000_000u64).step_by(7).chain([u64::MAX / 2, u64::MAX]) {
            let i = index(v);
            assert!(i >= last || v < 2_000_000, "index not monotonic at {v}");
            last = i;
            assert!(upper(i) >= v, "{v} above its bucket's bound {}", upper(i));
            assert!(upper(i) - v <= v / 16 + 1, "bucket of {v} too wide");
        }
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
