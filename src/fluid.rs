//! A flow-level (fluid) simulation for predictions: transfers share links max-min fairly,
//! as long-lived TCP flows with similar round-trip times roughly do, and each starts when
//! the transfers it depends on have left their source or arrived.
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
}

/// Seconds until every transfer has arrived. `cap` is each port's rate in bytes/s.
pub fn makespan(cap: &[f64], transfers: &[Transfer]) -> f64 {
    let mut sim = Sim::new(transfers);
    let mut remaining: Vec<f64> = transfers.iter().map(|t| t.bytes.max(0.0)).collect();
    let mut rate = vec![0.0f64; transfers.len()];
    let mut active: Vec<usize> = Vec::new();
    let (mut now, mut end) = (0.0f64, 0.0f64);
    let mut share = FairShare::new(cap.len());
    let mut changed = false;
    loop {
        // Start what is ready; zero-byte transfers are sent as they start.
        while let Some(i) = sim.ready.pop() {
            if remaining[i] > 0.0 {
                active.push(i);
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
            remaining[i] -= rate[i] * dt;
        }
        now = next;
        let mut k = 0;
        while k < active.len() {
            let i = active[k];
            // Done when what is left would take less than a picosecond.
            if remaining[i] <= rate[i] * 1e-12 {
                active.swap_remove(k);
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

/// Max-min fair rates by progressive filling: the port with the smallest fair share
/// fixes the rate of every flow through it, its flows leave, repeat.
struct FairShare {
    left: Vec<f64>,
    flows: Vec<u32>,
}

impl FairShare {
    fn new(ports: usize) -> FairShare {
        FairShare {
            left: vec![0.0; ports],
            flows: vec![0; ports],
        }
    }

    fn compute(&mut self, cap: &[f64], transfers: &[Transfer], active: &[usize], rate: &mut [f64]) {
        self.left.copy_from_slice(cap);
        self.flows.iter_mut().for_each(|c| *c = 0);
        for &i in active {
            for &p in &transfers[i].path {
                self.flows[p as usize] += 1;
            }
        }
        let mut open: Vec<usize> = active.to_vec();
        while !open.is_empty() {
            let (port, fair) = self
                .flows
                .iter()
                .enumerate()
                .filter(|(_, &c)| c > 0)
                .map(|(p, &c)| (p, self.left[p] / c as f64))
                .fold(
                    (usize::MAX, f64::INFINITY),
                    |a, b| if b.1 < a.1 { b } else { a },
                );
            if port == usize::MAX {
                // Flows that cross no port (empty paths) are not limited by the fabric.
                for &i in &open {
                    rate[i] = f64::INFINITY;
                }
                break;
            }
            open.retain(|&i| {
                let path = &transfers[i].path;
                if !path.contains(&(port as u32)) {
                    return true;
                }
                rate[i] = fair;
                for &p in path {
                    self.left[p as usize] -= fair;
                    self.flows[p as usize] -= 1;
                }
                false
            });
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
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * b.abs().max(1.0)
    }

    #[test]
    fn one_flow_takes_bytes_over_rate_plus_latency() {
        let got = makespan(&[100.0], &[t(&[0], 1000.0, 0.5, &[])]);
        assert!(close(got, 10.5), "{got}");
    }

    #[test]
    fn flows_on_a_port_share_it_and_the_survivor_speeds_up() {
        // 2 flows on a 100 B/s port: 50 B/s each; the 500-byte one ends at 10 s, then the
        // other has 1000 bytes left alone: 10 s more.
        let got = makespan(
            &[100.0],
            &[t(&[0], 500.0, 0.0, &[]), t(&[0], 1500.0, 0.0, &[])],
        );
        assert!(close(got, 20.0), "{got}");
    }

    #[test]
    fn max_min_fairness_gives_the_unbottlenecked_flow_the_rest() {
        // Port 0 (100 B/s) carries flows a and b; port 1 (30 B/s) carries b only.
        // b is held to 30 by port 1, a gets the remaining 70 of port 0.
        let cap = [100.0, 30.0];
        let tr = [t(&[0], 700.0, 0.0, &[]), t(&[0, 1], 3000.0, 0.0, &[])];
        let mut rate = vec![0.0; 2];
        FairShare::new(2).compute(&cap, &tr, &[0, 1], &mut rate);
        assert!(close(rate[0], 70.0) && close(rate[1], 30.0), "{rate:?}");
        assert!(close(makespan(&cap, &tr), 100.0));
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
        );
        let arrived = makespan(
            &cap,
            &[
                t(&[0], 100.0, 2.0, &[]),
                t(&[1], 100.0, 0.0, &[Dep::Arrived(0)]),
            ],
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
        );
        assert!(close(got, 2.0), "{got}");
    }
}
