//! A GPU NIC's egress scheduler: a queue per flow, served by deficit round robin, new
//! (sparse) flows first — the scheduler of Linux's `fq_codel` (RFC 8290 §4.2, without the
//! CoDel drop law), which is what a host's default qdisc does with several sockets'
//! packets. A flow's backlog stands for what its socket has not sent yet (a TUN gives the
//! sender no backpressure, so it is held here); an ACK or a small message of another flow
//! waits behind what the NIC already took ahead of the wire (`Port::size_nic` in the
//! model), not behind the whole backlog.
//!
//! A flow's quantum (what it may send per round) is set by the model to the NIC's TSO
//! burst: fq_codel dequeues a whole super-packet (up to 64 KiB) at once, so flows take
//! turns by bursts, not frames; the model holds frames, and a flow sends frames until it
//! has spent its quantum.
//!
//! Allocation-free once warm: queues that empty are kept for the next new flow.

use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasherDefault;

use crate::model::MixedKey;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum List {
    None,
    New,
    Old,
}

#[derive(Debug)]
struct FlowQueue {
    flow: u64,
    /// (slot, IP bytes), oldest first.
    packets: VecDeque<(u32, u32)>,
    deficit: i64,
    list: List,
}

/// Packets waiting at one port, a queue per flow (keyed by the flow's mixed 5-tuple hash).
#[derive(Debug)]
pub(crate) struct FlowQueues {
    quantum: i64,
    index: HashMap<u64, u32, BuildHasherDefault<MixedKey>>,
    queues: Vec<FlowQueue>,
    free: Vec<u32>,
    new: VecDeque<u32>,
    old: VecDeque<u32>,
    len: usize,
    bytes: u64,
}

impl FlowQueues {
    /// `quantum`: bytes a flow may send per round.
    pub(crate) fn new(quantum: u32) -> FlowQueues {
        FlowQueues {
            quantum: quantum.max(1) as i64,
            index: HashMap::default(),
            queues: Vec::new(),
            free: Vec::new(),
            new: VecDeque::new(),
            old: VecDeque::new(),
            len: 0,
            bytes: 0,
        }
    }

    /// Bytes a flow may send per round from now on.
    pub(crate) fn set_quantum(&mut self, quantum: u64) {
        self.quantum = quantum.max(1) as i64;
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Packets waiting.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Bytes waiting.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Queues packet `slot` of `len` bytes of flow `flow`.
    pub(crate) fn push(&mut self, flow: u64, slot: u32, len: u32) {
        let q = match self.index.get(&flow) {
            Some(&q) => q,
            None => {
                let q = match self.free.pop() {
                    Some(q) => {
                        self.queues[q as usize].flow = flow;
                        q
                    }
                    None => {
                        self.queues.push(FlowQueue {
                            flow,
                            packets: VecDeque::new(),
                            deficit: 0,
                            list: List::None,
                        });
                        self.queues.len() as u32 - 1
                    }
                };
                self.index.insert(flow, q);
                q
            }
        };
        let fq = &mut self.queues[q as usize];
        fq.packets.push_back((slot, len));
        if fq.list == List::None {
            // A flow with nothing queued is new: it goes first, with a quantum to spend.
            fq.list = List::New;
            fq.deficit = self.quantum;
            self.new.push_back(q);
        }
        self.len += 1;
        self.bytes += len as u64;
    }

    /// The packet to send next, taken off its queue.
    pub(crate) fn pop(&mut self) -> Option<u32> {
        loop {
            let (q, from_new) = match self.new.front() {
                Some(&q) => (q, true),
                None => (*self.old.front()?, false),
            };
            let list = if from_new {
                &mut self.new
            } else {
                &mut self.old
            };
            let fq = &mut self.queues[q as usize];
            if fq.deficit <= 0 {
                // Spent its quantum: another round, at the back of the old flows.
                fq.deficit += self.quantum;
                fq.list = List::Old;
                list.pop_front();
                self.old.push_back(q);
                continue;
            }
            let Some((slot, len)) = fq.packets.pop_front() else {
                list.pop_front();
                if from_new {
                    // An emptied new flow goes to the old list once, so that a flow
                    // sending one packet at a time cannot starve the old ones.
                    fq.list = List::Old;
                    self.old.push_back(q);
                } else {
                    fq.list = List::None;
                    self.index.remove(&fq.flow);
                    self.free.push(q);
                }
                continue;
            };
            fq.deficit -= len as i64;
            self.len -= 1;
            self.bytes -= len as u64;
            return Some(slot);
        }
    }

    /// Takes every waiting packet (a link going down loses them).
    pub(crate) fn drain(&mut self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.len);
        for (i, fq) in self.queues.iter_mut().enumerate() {
            out.extend(fq.packets.drain(..).map(|(slot, _)| slot));
            if fq.list != List::None {
                fq.list = List::None;
                self.index.remove(&fq.flow);
                self.free.push(i as u32);
            }
        }
        self.new.clear();
        self.old.clear();
        self.len = 0;
        self.bytes = 0;
        out
    }

    /// Every waiting packet's slot, in no particular order.
    pub(crate) fn slots(&self) -> impl Iterator<Item = u32> + '_ {
        self.queues
            .iter()
            .flat_map(|fq| fq.packets.iter().map(|&(slot, _)| slot))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(q: &mut FlowQueues) -> Vec<u32> {
        std::iter::from_fn(|| q.pop()).collect()
    }

    #[test]
    fn one_flow_is_a_fifo() {
        let mut q = FlowQueues::new(1500);
        for s in 0..5 {
            q.push(7, s, 1500);
        }
        assert_eq!(q.len(), 5);
        assert_eq!(order(&mut q), [0, 1, 2, 3, 4]);
        assert!(q.is_empty());
    }

    #[test]
    fn backlogged_flows_alternate_by_bytes() {
        let mut q = FlowQueues::new(1500);
        // Flow 1: six 1500 B frames; flow 2: twelve 750 B frames, queued after.
        for s in 0..6 {
            q.push(1, s, 1500);
        }
        for s in 100..112 {
            q.push(2, s, 750);
        }
        let o = order(&mut q);
        // Equal bytes per round: one frame of flow 1, then two of flow 2.
        assert_eq!(&o[..6], [0, 100, 101, 1, 102, 103]);
        assert_eq!(o.len(), 18);
    }

    #[test]
    fn a_new_sparse_flow_goes_ahead_of_a_backlog() {
        let mut q = FlowQueues::new(1500);
        for s in 0..100 {
            q.push(1, s, 1500);
        }
        assert_eq!(q.pop(), Some(0));
        assert_eq!(q.pop(), Some(1));
        // An ACK of another flow: next, not after 98 frames.
        q.push(2, 500, 52);
        assert_eq!(q.pop(), Some(500));
        assert_eq!(q.pop(), Some(2));
        // Still sparse later: goes first again once its queue emptied and it was retired.
        for _ in 0..3 {
            q.pop();
        }
        q.push(2, 501, 52);
        assert_eq!(q.pop(), Some(501));
    }

    #[test]
    fn a_flow_that_keeps_sending_small_packets_cannot_starve_a_backlog() {
        let mut q = FlowQueues::new(1500);
        for s in 0..100 {
            q.push(1, s, 1500);
        }
        let mut backlog = 0;
        for i in 0..40 {
            // Flow 2 queues a packet before every dequeue.
            q.push(2, 1000 + i, 1500);
            if q.pop().unwrap() < 1000 {
                backlog += 1;
            }
        }
        // Half the frames each (equal bytes).
        assert!((19..=21).contains(&backlog), "{backlog}");
    }

    #[test]
    fn drain_takes_everything_and_queues_are_reused() {
        let mut q = FlowQueues::new(1500);
        for f in 0..4u64 {
            for s in 0..3 {
                q.push(f, (f * 10 + s) as u32, 1000);
            }
        }
        q.pop();
        let mut d = q.drain();
        d.sort_unstable();
        assert_eq!(d, [1, 2, 10, 11, 12, 20, 21, 22, 30, 31, 32]);
        assert!(q.is_empty() && q.pop().is_none());
        assert_eq!(q.slots().count(), 0);
        let n = q.queues.len();
        q.push(9, 1, 100);
        q.push(8, 2, 100);
        assert_eq!(q.queues.len(), n, "emptied queues are reused");
        assert_eq!(order(&mut q), [1, 2]);
    }
}
