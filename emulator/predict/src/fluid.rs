//! A flow-level (fluid) simulation for predictions: each transfer starts when the
//! transfers it depends on have left their source or arrived, and ports serve transfers
//! first come, first served: a transfer gets what those that started before it leave
//! free on its path. That is what a deep FIFO queue does when senders' windows fill it
//! (the dilated fabrics' 64 MiB buffers): bytes leave in the order they came, so the
//! transfer that came first finishes first instead of all finishing together, as fair
//! sharing would have it. Compared on the same runs (AllToAll and rhd, 1:1 and 3:1
//! fabrics, one run each), first come first served predicted within 0.98–1.11 where
//! max-min fair sharing gave 0.77–1.09.
//!
//! Used where an algorithm's steps do not run in lockstep: in an AllToAll each rank and
//! channel moves to its next peer as soon as its own exchange is done, so light steps of
//! some ranks overlap heavy steps of others. A phase-by-phase model (every phase lasts
//! as long as its most loaded link) cannot see that and overestimates such collectives.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// What a transfer waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dep {
    /// The last byte of transfer `i` has left its source (the sender may move on).
    Sent(usize),
    /// The last byte of transfer `i` has arrived (the receiver may move on).
    Arrived(usize),
}

#[derive(Clone, Debug)]
pub struct Transfer {
    /// Port indices from source to destination.
    pub path: Vec<u32>,
    pub bytes: f64,
    /// Seconds from a byte leaving the source to its arrival.
    pub latency: f64,
    /// Transfers this one waits for; all of them have smaller indices.
    pub after: Vec<Dep>,
    /// Port indices its acknowledgements cross (the connection's way back), and what they
    /// take there per byte of the transfer's: moving at rate r, it also takes r ×
    /// `ack_share` of each of those ports.
    pub ack_path: Vec<u32>,
    pub ack_share: f64,
}

/// Seconds until every transfer has arrived. `cap` is each port's rate in bytes/s.
/// `lossless`: the fabric pauses links as a whole (PFC, credits), so no transfer crosses
/// a link faster than the slowest one held back beyond it (see `Shares`).
pub fn makespan(cap: &[f64], transfers: &[Transfer], lossless: bool) -> f64 {
    let mut sim = Sim::new(transfers);
    let mut remaining: Vec<f64> = transfers.iter().map(|t| t.bytes.max(0.0)).collect();
    let mut rate = vec![0.0f64; transfers.len()];
    // Transfers on the wire, in the order they started.
    let mut active: Vec<usize> = Vec::new();
    let mut started = vec![0.0f64; transfers.len()];
    let (mut now, mut end) = (0.0f64, 0.0f64);
    let mut share = Shares::new(cap.len(), lossless);
    let mut changed = false;
    loop {
        // Start what is ready; zero-byte transfers are sent as they start.
        while let Some(i) = sim.ready.pop() {
            if remaining[i] > 0.0 {
                // `active` stays in start order: ties by index.
                let at = active.partition_point(|&j| j < i || started[j] < now);
                active.insert(at, i);
                started[i] = now;
                changed = true;
            } else {
                sim.sent(i, now);
            }
        }
        if changed {
            share.compute(cap, transfers, &active, &mut rate);
            changed = false;
        }
        let next_done = active
            .iter()
            .map(|&i| now + remaining[i] / rate[i])
            .fold(f64::INFINITY, f64::min);
        let next = next_done.min(sim.next_arrival());
        if next == f64::INFINITY {
            break;
        }
        let dt = next - now;
        for &i in &active {
            // A transfer that crosses no port is not limited by the fabric.
            remaining[i] = if rate[i].is_finite() {
                remaining[i] - rate[i] * dt
            } else {
                0.0
            };
        }
        now = next;
        let mut k = 0;
        while k < active.len() {
            let i = active[k];
            // Done when what is left would take less than a picosecond, or less than
            // `now` can resolve: after hours of fabric time (slow links, large sizes) a
            // rounding remainder's end time rounds to `now` itself, and it would never
            // end.
            if remaining[i] <= rate[i] * 1e-12 || now + remaining[i] / rate[i] <= now {
                active.remove(k);
                sim.sent(i, now);
                changed = true;
            } else {
                k += 1;
            }
        }
        end = end.max(sim.arrive_until(now));
    }
    assert!(
        sim.waiting.iter().all(|&w| w == 0),
        "transfers left waiting: a dependency cycle"
    );
    end
}

/// Who waits for whom, and the arrivals to come.
struct Sim<'a> {
    transfers: &'a [Transfer],
    /// Dependencies not yet met, per transfer.
    waiting: Vec<usize>,
    on_sent: Vec<Vec<usize>>,
    on_arrived: Vec<Vec<usize>>,
    /// Arrivals by time: f64 bits of non-negative times order like the times.
    arrivals: BinaryHeap<Reverse<(u64, usize)>>,
    /// Transfers whose dependencies are met, not started yet.
    ready: Vec<usize>,
}

impl<'a> Sim<'a> {
    fn new(transfers: &'a [Transfer]) -> Sim<'a> {
        let n = transfers.len();
        let (mut on_sent, mut on_arrived) = (vec![Vec::new(); n], vec![Vec::new(); n]);
        for (i, t) in transfers.iter().enumerate() {
            for &d in &t.after {
                let j = match d {
                    Dep::Sent(j) => {
                        on_sent[j].push(i);
                        j
                    }
                    Dep::Arrived(j) => {
                        on_arrived[j].push(i);
                        j
                    }
                };
                assert!(j < i, "transfer {i} waits for a later one ({j})");
            }
        }
        let waiting: Vec<usize> = transfers.iter().map(|t| t.after.len()).collect();
        let ready = (0..n).filter(|&i| waiting[i] == 0).collect();
        Sim {
            transfers,
            waiting,
            on_sent,
            on_arrived,
            arrivals: BinaryHeap::new(),
            ready,
        }
    }

    /// Transfer `i`'s last byte left its source at `now`.
    fn sent(&mut self, i: usize, now: f64) {
        let at = now + self.transfers[i].latency;
        self.arrivals.push(Reverse((at.to_bits(), i)));
        Self::release(&self.on_sent[i], &mut self.waiting, &mut self.ready);
    }

    fn next_arrival(&self) -> f64 {
        self.arrivals
            .peek()
            .map_or(f64::INFINITY, |&Reverse((t, _))| f64::from_bits(t))
    }

    /// Processes the arrivals due by `now`; returns the latest (0 if none).
    fn arrive_until(&mut self, now: f64) -> f64 {
        let mut last = 0.0f64;
        while let Some(&Reverse((t, i))) = self.arrivals.peek() {
            if f64::from_bits(t) > now {
                break;
            }
            self.arrivals.pop();
            last = last.max(f64::from_bits(t));
            Self::release(&self.on_arrived[i], &mut self.waiting, &mut self.ready);
        }
        last
    }

    fn release(dependents: &[usize], waiting: &mut [usize], ready: &mut Vec<usize>) {
        for &d in dependents {
            waiting[d] -= 1;
            if waiting[d] == 0 {
                ready.push(d);
            }
        }
    }
}

/// Passes that settle the ports' capacity left by acknowledgements (`Shares::compute`):
/// their share is a few % of the data's (half of one frame's headers per two frames), so
/// the rates move by a few % of a few % after the first. Each pass is one more sharing of
/// the ports per event: with 2, predicting a 32-rank AllToAll, rhd and tree took 3 times as
/// long as without ACKs, with 1 twice (results 0.2 % apart).
const ACK_PASSES: usize = 1;

/// First come, first served: in start order, each transfer takes what is left on the
/// most loaded port of its path.
///
/// On a lossless fabric transfers cannot pass each other on a link: the switch at its far
/// end pauses the link as a whole once what it holds from it exceeds its threshold,
/// whichever transfer's bytes those are, so a transfer held back further on holds back
/// every transfer crossing the links before that point (head-of-line blocking, and
/// congestion spreading upstream): none crosses them faster than it. The shares are then
/// taken again with that rate as a cap, which frees capacity for other transfers, until
/// no cap falls.
struct Shares {
    left: Vec<f64>,
    lossless: bool,
    /// Per transfer, the most it may get (lossless: the slowest rate of the transfers held
    /// back beyond a port it crosses).
    cap: Vec<f64>,
    /// Per port, the slowest rate of the transfers held back beyond it.
    held: Vec<f64>,
}

impl Shares {
    fn new(ports: usize, lossless: bool) -> Shares {
        Shares {
            left: vec![0.0; ports],
            lossless,
            cap: Vec::new(),
            held: vec![f64::INFINITY; ports],
        }
    }

    /// `active` is in start order. Acknowledgements go first: a FIFO port serves them as
    /// they come, whichever transfer came first, so each port keeps what the ACKs
    /// crossing it take at the rates of the pass before (`ACK_PASSES`) and the transfers
    /// share the rest.
    fn compute(&mut self, cap: &[f64], transfers: &[Transfer], active: &[usize], rate: &mut [f64]) {
        let acked = active.iter().any(|&i| transfers[i].ack_share > 0.0);
        if !acked {
            return self.compute_once(cap, transfers, active, rate);
        }
        let mut free = cap.to_vec();
        for _ in 0..ACK_PASSES {
            self.compute_once(&free, transfers, active, rate);
            free.copy_from_slice(cap);
            for &i in active {
                let t = &transfers[i];
                if rate[i].is_finite() {
                    for &p in &t.ack_path {
                        free[p as usize] -= rate[i] * t.ack_share;
                    }
                }
            }
            // A floor, so that no transfer's rate is zero: ACKs take a few % of a port,
            // and only one-frame transfers acknowledged one for one (at most ~40 %)
            // come near it.
            for (f, c) in free.iter_mut().zip(cap) {
                *f = f.max(c * 1e-3);
            }
        }
        self.compute_once(&free, transfers, active, rate);
    }

    fn compute_once(
        &mut self,
        cap: &[f64],
        transfers: &[Transfer],
        active: &[usize],
        rate: &mut [f64],
    ) {
        if self.cap.len() < transfers.len() {
            self.cap.resize(transfers.len(), f64::INFINITY);
        }
        // Caps are only ever lowered on a lossless fabric: lossy, they stay unbounded.
        if self.lossless {
            for &i in active {
                self.cap[i] = f64::INFINITY;
            }
        }
        // Caps only fall, each pass lowering some to a rate a transfer got: a few passes
        // in practice (bounded here by one more than the active transfers).
        for _ in 0..=active.len() {
            self.left.copy_from_slice(cap);
            for &i in active {
                let path = &transfers[i].path;
                // The rate, and where on the path it is decided (the first port at it).
                let (mut r, mut at) = (self.cap[i], None);
                for (k, &p) in path.iter().enumerate() {
                    if self.left[p as usize] < r {
                        (r, at) = (self.left[p as usize], Some(k));
                    }
                }
                rate[i] = r;
                if let (true, Some(k)) = (self.lossless, at) {
                    for &p in &path[..k] {
                        let h = &mut self.held[p as usize];
                        *h = h.min(r);
                    }
                }
                for &p in path {
                    self.left[p as usize] -= r;
                }
            }
            if !self.lossless {
                return;
            }
            let mut lowered = false;
            for &i in active {
                let path = &transfers[i].path;
                let h = path
                    .iter()
                    .map(|&p| self.held[p as usize])
                    .fold(f64::INFINITY, f64::min);
                if rate[i] > h * (1.0 + 1e-12) {
                    self.cap[i] = h;
                    lowered = true;
                }
            }
            for &i in active {
                for &p in &transfers[i].path {
                    self.held[p as usize] = f64::INFINITY;
                }
            }
            if !lowered {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(path: &[u32], bytes: f64, latency: f64, after: &[Dep]) -> Transfer {
        Transfer {
            path: path.to_vec(),
            bytes,
            latency,
            after: after.to_vec(),
            ack_path: Vec::new(),
            ack_share: 0.0,
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * b.abs().max(1.0)
    }

    #[test]
    fn one_flow_takes_bytes_over_rate_plus_latency() {
        let got = makespan(&[100.0], &[t(&[0], 1000.0, 0.5, &[])], false);
        assert!(close(got, 10.5), "{got}");
    }

    #[test]
    fn acknowledgements_take_their_share_of_the_way_back() {
        // T0 (port 0, 1000 B) acknowledged over port 1 at half its rate: 50 B/s of port
        // 1 while it runs (10 s), so T1 (port 1, 1000 B) gets 50 B/s until then and 100
        // after: 500 B by 10 s, the rest by 15 s.
        let mut t0 = t(&[0], 1000.0, 0.0, &[]);
        (t0.ack_path, t0.ack_share) = (vec![1], 0.5);
        let got = makespan(&[100.0, 100.0], &[t0, t(&[1], 1000.0, 0.0, &[])], false);
        assert!(close(got, 15.0), "{got}");
    }

    #[test]
    fn a_port_serves_the_first_transfer_first() {
        // Port 0 (100 B/s): T0 (1000 B) and T1 (100 B) start together, T0 first: it ends
        // at 10 s, T1 at 11 s; T2 (port 1, 1000 B) waits for T1 to arrive: 21 s. (Fair
        // sharing would end T1 at 2 s and everything at 12 s.)
        let got = makespan(
            &[100.0, 100.0],
            &[
                t(&[0], 1000.0, 0.0, &[]),
                t(&[0], 100.0, 0.0, &[]),
                t(&[1], 1000.0, 0.0, &[Dep::Arrived(1)]),
            ],
            false,
        );
        assert!(close(got, 21.0), "{got}");
    }

    #[test]
    fn later_transfers_get_what_earlier_ones_leave() {
        // Port 0 (100 B/s) carries a and b; a, first, is held to 30 by port 1, so b gets
        // the remaining 70 of port 0.
        let cap = [100.0, 30.0];
        let tr = [t(&[0, 1], 3000.0, 0.0, &[]), t(&[0], 700.0, 0.0, &[])];
        let mut rate = vec![0.0; 2];
        Shares::new(2, false).compute(&cap, &tr, &[0, 1], &mut rate);
        assert!(close(rate[0], 30.0) && close(rate[1], 70.0), "{rate:?}");
        assert!(close(makespan(&cap, &tr, false), 100.0));
    }

    #[test]
    fn a_lossless_source_sends_at_its_slowest_transfers_rate() {
        // Source port 0 (100 B/s) carries a, held to 30 by port 1, and b. Lossy, b takes
        // the 70 left; lossless, the pauses that hold a back hold b too: both at 30.
        let cap = [100.0, 30.0];
        let tr = [t(&[0, 1], 3000.0, 0.0, &[]), t(&[0], 700.0, 0.0, &[])];
        let mut rate = vec![0.0; 2];
        Shares::new(2, true).compute(&cap, &tr, &[0, 1], &mut rate);
        assert!(close(rate[0], 30.0) && close(rate[1], 30.0), "{rate:?}");
        // b then ends at 700 / 30 s instead of 7 s; then a, alone, is still held to 30.
        let after_b = t(&[0], 0.0, 0.0, &[Dep::Sent(1)]);
        let tr = [tr[0].clone(), tr[1].clone(), after_b];
        assert!(close(makespan(&cap, &tr, true), 100.0));
        // Where the source itself is the bottleneck, one rate is what they had anyway.
        let even = [t(&[0], 500.0, 0.0, &[]), t(&[0], 500.0, 0.0, &[])];
        assert!(close(makespan(&[100.0], &even, true), 10.0));
    }

    #[test]
    fn a_lossless_pause_holds_a_shared_link_inside_the_fabric() {
        // a (source 0) and b (source 1) share link 2; a is held to 20 at its destination
        // port 3, b goes on to port 4. Lossy, b takes the 80 link 2 has left; lossless,
        // the switch after link 2 pauses it for a's bytes and b's wait with them.
        let cap = [100.0, 100.0, 100.0, 20.0, 100.0];
        let tr = [
            t(&[0, 2, 3], 2000.0, 0.0, &[]),
            t(&[1, 2, 4], 1000.0, 0.0, &[]),
        ];
        let mut rate = vec![0.0; 2];
        Shares::new(5, false).compute(&cap, &tr, &[0, 1], &mut rate);
        assert!(
            close(rate[0], 20.0) && close(rate[1], 80.0),
            "lossy {rate:?}"
        );
        Shares::new(5, true).compute(&cap, &tr, &[0, 1], &mut rate);
        assert!(
            close(rate[0], 20.0) && close(rate[1], 20.0),
            "lossless {rate:?}"
        );
    }

    #[test]
    fn a_lossless_pause_frees_what_the_paused_source_no_longer_sends() {
        // Source 0 sends a over port 1 (held to 20 by port 2) and b over port 3; source 4
        // sends c over port 3 too, having started after b. Lossy, b takes what a leaves of
        // source 0 (80) and c port 3's remaining 20; lossless, b is held to a's 20, and c gets the 80 left on port 3.
        let cap = [100.0, 100.0, 20.0, 100.0, 100.0];
        let tr = [
            t(&[0, 1, 2], 2000.0, 0.0, &[]),
            t(&[0, 3], 1000.0, 0.0, &[]),
            t(&[4, 3], 800.0, 0.0, &[]),
        ];
        let mut rate = vec![0.0; 3];
        Shares::new(5, false).compute(&cap, &tr, &[0, 1, 2], &mut rate);
        assert!(
            close(rate[1], 80.0) && close(rate[2], 20.0),
            "lossy {rate:?}"
        );
        Shares::new(5, true).compute(&cap, &tr, &[0, 1, 2], &mut rate);
        assert!(
            close(rate[0], 20.0) && close(rate[1], 20.0) && close(rate[2], 80.0),
            "lossless {rate:?}"
        );
    }

    #[test]
    fn a_transfer_started_later_waits_behind_earlier_ones() {
        // T1 may start only once T0 (port 1) has arrived, at 1 s; by then T2 (1000 B)
        // holds port 0 until 10 s, and T1 (100 B), although its index is lower, ends at 11 s.
        let got = makespan(
            &[100.0, 100.0],
            &[
                t(&[1], 100.0, 0.0, &[]),
                t(&[0], 100.0, 0.0, &[Dep::Arrived(0)]),
                t(&[0], 1000.0, 0.0, &[]),
            ],
            false,
        );
        assert!(close(got, 11.0), "{got}");
    }

    #[test]
    fn dependencies_wait_for_sending_or_arrival() {
        let cap = [100.0, 100.0];
        // The second starts when the first has left (1 s) or arrived (1 s + 2 s latency).
        let sent = makespan(
            &cap,
            &[
                t(&[0], 100.0, 2.0, &[]),
                t(&[1], 100.0, 0.0, &[Dep::Sent(0)]),
            ],
            false,
        );
        let arrived = makespan(
            &cap,
            &[
                t(&[0], 100.0, 2.0, &[]),
                t(&[1], 100.0, 0.0, &[Dep::Arrived(0)]),
            ],
            false,
        );
        assert!(close(sent, 3.0), "{sent}");
        assert!(close(arrived, 4.0), "{arrived}");
    }

    #[test]
    fn zero_byte_transfers_cost_their_latency() {
        let got = makespan(
            &[100.0],
            &[
                t(&[0], 0.0, 1.0, &[]),
                t(&[0], 0.0, 1.0, &[Dep::Arrived(0)]),
            ],
            false,
        );
        assert!(close(got, 2.0), "{got}");
    }
    #[test]
    fn transfers_ending_after_years_of_fabric_time_still_end() {
        // 8 bit/s and 3 B/s ports (a "1B" rate is a valid one): by the third transfer
        // `now` is ~4e9 s, where the remainder left by subtracting rate × dt ends within
        // less than now's resolution; it looped for ever. Each transfer here waits for the
        // one before it to be sent, so they run one after another.
        let a = 2_017_744_408.0 + 2.0 / 3.0;
        let b = 263_701_168.0 + 1.0 / 3.0;
        let c = 2_111_009_482.0 + 1.0 / 3.0;
        let transfers = [
            t(&[0], a, 4e-6, &[]),
            t(&[1], b, 3.5e-6, &[Dep::Sent(0)]),
            t(&[0], c, 3.6e-6, &[Dep::Sent(1)]),
            t(&[1], b, 2e-6, &[Dep::Sent(2)]),
        ];
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || tx.send(makespan(&[1.0, 3.0], &transfers, false)));
        let got = rx
            .recv_timeout(std::time::Duration::from_secs(60))
            .expect("makespan did not end");
        let want = a + b / 3.0 + c + b / 3.0 + 2e-6;
        assert!((got - want).abs() <= 1e-6 * want, "{got} against {want}");
    }
}
