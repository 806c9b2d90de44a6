//! Synthetic traffic generated inside the fabric model (`Change::StartLoad`): another
//! job's cross-traffic, or the bursts of an incast. Its packets carry no payload and cost
//! no I/O, but take buffer space and link time in every queue on their way like any
//! packet (tail drop, ECN marks); they do not react to drops or marks (constant rate,
//! like UDP).
//!
//! This module is the timing of a load (when its next packet leaves); the model forwards
//! the packets.

use crate::rng::Rng;
use crate::routing::VertexIdx;
use crate::units::{Bandwidth, Duration, Instant};

/// When a load sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pattern {
    /// At its rate, without pause.
    Steady,
    /// At its rate for `on`, then silent for `off`, again.
    OnOff { on: Duration, off: Duration },
    /// `bytes` at its rate at the start of every period of `every`, `count` times.
    Bursts {
        bytes: u64,
        every: Duration,
        count: u32,
    },
}

/// A load, as the caller asks for it.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadSpec {
    /// The caller's name for it (unique among the fabric's loads).
    pub id: u32,
    /// Where its packets enter (a GPU's or a switch's egress) and where they leave the
    /// fabric: vertices as `Routes` numbers them (GPUs, then switches).
    pub from: VertexIdx,
    pub to: VertexIdx,
    /// Rate on the wire (with L2 overhead, as link rates count) while it sends.
    pub rate: Bandwidth,
    /// IP bytes per packet (the last packet of a burst may be shorter).
    pub packet: u32,
    pub pattern: Pattern,
    /// It ends this long after it started (`None`: when stopped).
    pub duration: Option<Duration>,
}

/// Counters of one load.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoadCounters {
    pub sent_packets: u64,
    pub sent_bytes: u64,
    pub delivered_packets: u64,
    pub delivered_bytes: u64,
    pub drops: crate::model::Drops,
    pub ecn_marked: u64,
}

impl LoadCounters {
    /// Adds `o`'s counts to these.
    pub fn add(&mut self, o: &LoadCounters) {
        self.sent_packets += o.sent_packets;
        self.sent_bytes += o.sent_bytes;
        self.delivered_packets += o.delivered_packets;
        self.delivered_bytes += o.delivered_bytes;
        self.drops.add_all(&o.drops);
        self.ecn_marked += o.ecn_marked;
    }
}

/// A load's clock: when its next packet leaves.
#[derive(Debug)]
pub(crate) struct Generator {
    pub spec: LoadSpec,
    pub started: Instant,
    /// The next packet's departure; `None` once it is done.
    pub next: Option<Instant>,
    period_start: Instant,
    /// Bytes sent in this burst, bursts finished.
    in_burst: u64,
    bursts: u32,
    carry: u64,
    pub rng: Rng,
}

impl Generator {
    pub fn new(spec: LoadSpec, now: Instant, rng: Rng) -> Generator {
        Generator {
            spec,
            started: now,
            next: Some(now),
            period_start: now,
            in_burst: 0,
            bursts: 0,
            carry: 0,
            rng,
        }
    }

    /// IP bytes of the packet due now.
    pub fn packet_len(&self) -> u32 {
        match self.spec.pattern {
            Pattern::Bursts { bytes, .. } => {
                (bytes - self.in_burst).min(self.spec.packet as u64) as u32
            }
            _ => self.spec.packet,
        }
    }

    /// The packet due at `t` left with `len` IP bytes and `wire_bits` on the wire: when
    /// does the next one.
    pub fn sent(&mut self, t: Instant, len: u32, wire_bits: u64) {
        let (gap, carry) = self.spec.rate.transmit_time(wire_bits, self.carry);
        self.carry = carry;
        let mut next = t + gap;
        match self.spec.pattern {
            Pattern::Steady => {}
            Pattern::OnOff { on, off } => {
                if next >= self.period_start + on {
                    self.period_start = self.period_start + on + off;
                    self.carry = 0;
                    next = next.max(self.period_start);
                }
            }
            Pattern::Bursts {
                bytes,
                every,
                count,
            } => {
                self.in_burst += len as u64;
                if self.in_burst >= bytes {
                    self.in_burst = 0;
                    self.bursts += 1;
                    self.carry = 0;
                    if self.bursts >= count {
                        self.next = None;
                        return;
                    }
                    self.period_start = self.period_start + every;
                    next = next.max(self.period_start);
                }
            }
        }
        let ended = self.spec.duration.is_some_and(|d| next >= self.started + d);
        self.next = (!ended).then_some(next);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(pattern: Pattern, duration: Option<Duration>) -> LoadSpec {
        LoadSpec {
            id: 1,
            from: 0,
            to: 1,
            rate: Bandwidth::from_bps(8_000_000_000), // 1 byte per ns
            packet: 1000,
            pattern,
            duration,
        }
    }

    /// Departure times until done or `limit` packets.
    fn departures(mut g: Generator, limit: usize) -> Vec<(u64, u32)> {
        let mut out = Vec::new();
        while let Some(t) = g.next {
            if out.len() == limit {
                break;
            }
            let len = g.packet_len();
            out.push((t.as_nanos(), len));
            g.sent(t, len, len as u64 * 8);
        }
        out
    }

    #[test]
    fn steady_paces_at_rate_and_ends_after_its_duration() {
        let g = Generator::new(
            spec(Pattern::Steady, Some(Duration::from_nanos(5_000))),
            Instant::from_nanos(100),
            Rng::new(1, 1),
        );
        let d = departures(g, 100);
        assert_eq!(d.len(), 5);
        assert_eq!(d[0].0, 100);
        assert_eq!(d[4].0, 4_100);
    }

    #[test]
    fn on_off_pauses() {
        let on_off = Pattern::OnOff {
            on: Duration::from_nanos(2_000),
            off: Duration::from_nanos(3_000),
        };
        let d = departures(
            Generator::new(spec(on_off, None), Instant::ZERO, Rng::new(1, 1)),
            5,
        );
        let t: Vec<u64> = d.iter().map(|x| x.0).collect();
        assert_eq!(t, [0, 1_000, 5_000, 6_000, 10_000]);
    }

    #[test]
    fn bursts_send_their_bytes_then_wait_for_the_next_period() {
        let bursts = Pattern::Bursts {
            bytes: 2_500,
            every: Duration::from_nanos(10_000),
            count: 2,
        };
        let d = departures(
            Generator::new(spec(bursts, None), Instant::ZERO, Rng::new(1, 1)),
            100,
        );
        assert_eq!(
            d,
            [
                (0, 1000),
                (1_000, 1000),
                (2_000, 500),
                (10_000, 1000),
                (11_000, 1000),
                (12_000, 500)
            ]
        );
    }
}
