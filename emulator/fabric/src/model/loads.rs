//! Synthetic loads: cross-traffic generated inside the fabric, along its routes.

use std::cmp::Reverse;

use crate::frame::Frame;
use crate::load::{Generator, LoadCounters, LoadSpec};
use crate::packet;
use crate::routing::{PortId, VertexIdx};
use crate::topology::HostId;
use crate::units::Instant;

use super::{pack, DropReason, Fabric, InFlight, NO_PORT, PACKET_OVERHEAD};

/// A load and what it did.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadStatus {
    pub spec: LoadSpec,
    pub started: Instant,
    /// Still sending (not stopped, not done).
    pub active: bool,
    pub counters: LoadCounters,
}

pub(super) struct LoadState {
    pub(super) gen: Generator,
    pub(super) active: bool,
    pub(super) counters: LoadCounters,
    /// Toward a switch: per vertex, the ports on a shortest path (routing tables hold
    /// only GPU destinations). Empty toward a GPU.
    pub(super) toward: Vec<Vec<PortId>>,
    /// Its packets the fabric holds (in slots): a load done and holding none can be
    /// retired.
    pub(super) held: u32,
    /// Retired (`Fabric::load_done`): its counters are in `RetiredLoads`, and its
    /// index is free for the next load that starts.
    pub(super) retired: bool,
}

/// Finished loads the model keeps one by one; beyond them the oldest are summed into
/// `RetiredLoads` and their state let go, so that a fabric up for weeks of scenarios and
/// incasts holds what runs now (a load toward a switch holds a route per vertex: ~13 KB
/// on `superpod-su`).
pub const KEPT_DONE_LOADS: usize = 64;

/// Loads let go after they finished, beyond the last `KEPT_DONE_LOADS`: how many, and
/// their counters summed.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RetiredLoads {
    pub loads: u64,
    pub counters: LoadCounters,
}

/// Mixed with a load's index: its flow key in a NIC's flow queues.
pub(super) const LOAD_FLOW: u64 = 0x6c6f_6164_0000_0000;

impl Fabric {
    /// Every load running, and the last `KEPT_DONE_LOADS` done, in the order they
    /// started, with their counters (the others: `retired_loads`).
    pub fn loads(&self) -> Vec<LoadStatus> {
        let mut out: Vec<LoadStatus> = self
            .loads
            .iter()
            .filter(|l| !l.retired)
            .map(|l| LoadStatus {
                spec: l.gen.spec.clone(),
                started: l.gen.started,
                active: l.active,
                counters: l.counters,
            })
            .collect();
        // Indices are reused, so their order is not the loads'.
        out.sort_by_key(|l| (l.started, l.spec.id));
        out
    }

    /// How many loads' states the fabric holds (running, kept, and retired ones whose
    /// index is free): bounded by the most that ran and were kept at once.
    pub fn load_states(&self) -> usize {
        self.loads.len()
    }

    /// Loads done earlier than the last `KEPT_DONE_LOADS`, summed.
    pub fn retired_loads(&self) -> RetiredLoads {
        self.retired_loads
    }

    /// Load `i` is done (ended, or stopped): the oldest done beyond the last
    /// `KEPT_DONE_LOADS` that hold no packet any more are retired.
    pub(super) fn load_done(&mut self, i: usize) {
        self.done_loads.push_back(i as u32);
        let mut excess = self.done_loads.len().saturating_sub(KEPT_DONE_LOADS);
        if excess == 0 {
            return;
        }
        let (loads, retired, free) = (
            &mut self.loads,
            &mut self.retired_loads,
            &mut self.free_loads,
        );
        self.done_loads.retain(|&i| {
            let st = &mut loads[i as usize];
            if excess == 0 || st.held > 0 {
                return true;
            }
            excess -= 1;
            retired.loads += 1;
            retired.counters.add(&st.counters);
            st.retired = true;
            st.toward = Vec::new();
            free.push(i);
            false
        });
    }

    /// Loads that ended on their own since the last call (not those stopped), each with
    /// its last packet's departure and the bytes it sent, in the order they ended (a
    /// load may be let go before this is called: `KEPT_DONE_LOADS`).
    pub fn take_ended_loads(&mut self) -> Vec<(u32, Instant, u64)> {
        std::mem::take(&mut self.ended_loads)
    }

    /// The share of a load's packets that crosses each port, as the fabric routes them
    /// now (split evenly at every equal-cost branch): what it takes from each link, for
    /// predictions. Empty for an unknown id.
    pub fn load_shares(&self, id: u32) -> Vec<(PortId, f64)> {
        let Some(st) = self
            .loads
            .iter()
            .find(|l| !l.retired && l.gen.spec.id == id)
        else {
            return Vec::new();
        };
        let n = self.hosts as usize + self.topo.switches.len();
        let mut at = vec![0.0f64; n];
        at[st.gen.spec.from as usize] = 1.0;
        let mut order = vec![st.gen.spec.from];
        let mut out: Vec<(PortId, f64)> = Vec::new();
        let mut i = 0;
        while i < order.len() {
            let v = order[i];
            i += 1;
            let share = std::mem::take(&mut at[v as usize]);
            if v == st.gen.spec.to || share == 0.0 {
                continue;
            }
            let group: Vec<PortId> = self
                .load_group(st, v)
                .iter()
                .copied()
                .filter(|&p| self.down_since[self.routes.port(p).link as usize].is_none())
                .collect();
            for &p in &group {
                let part = share / group.len() as f64;
                match out.iter_mut().find(|(q, _)| *q == p) {
                    Some(e) => e.1 += part,
                    None => out.push((p, part)),
                }
                let u = self.routes.port(p).to;
                if at[u as usize] == 0.0 && !order[i..].contains(&u) {
                    order.push(u);
                }
                at[u as usize] += part;
            }
        }
        out
    }

    /// The ports a load's packets may take at `v` (before taking out dead links).
    fn load_group<'a>(&'a self, st: &'a LoadState, v: VertexIdx) -> &'a [PortId] {
        let to = st.gen.spec.to;
        if to < self.hosts {
            self.live
                .as_ref()
                .unwrap_or(&self.routes)
                .next_hops(v, HostId(to))
        } else {
            &st.toward[v as usize]
        }
    }

    /// Load `i`'s packet due at `t` leaves (and its next one is scheduled).
    pub(super) fn emit(&mut self, t: Instant, i: usize) {
        let key = (self.ports.len() + i) as u32;
        let l2 = self.l2_overhead as u64;
        let st = &mut self.loads[i];
        if !st.active || st.gen.next != Some(t) {
            return;
        }
        let len = st.gen.packet_len();
        let wire_bits = (len as u64 + l2) * 8;
        st.gen.sent(t, len, wire_bits);
        match st.gen.next {
            Some(n) => self.events.push(Reverse(pack(n, key))),
            None => st.active = false,
        }
        let ended = !st.active;
        self.send_load_packet(t, i, len, wire_bits);
        if ended {
            let st = &self.loads[i];
            let sent = st.counters.sent_bytes;
            self.ended_loads.push((st.gen.spec.id, t, sent));
            // After its last packet is held: a load holding packets stays.
            self.load_done(i);
        }
    }

    /// Load `i`'s packet of `len` bytes leaves at `t`.
    fn send_load_packet(&mut self, t: Instant, i: usize, len: u32, wire_bits: u64) {
        let st = &mut self.loads[i];
        st.counters.sent_packets += 1;
        st.counters.sent_bytes += len as u64;
        let (from, to) = (st.gen.spec.from, st.gen.spec.to);
        if let Some(groups) = &self.partition {
            if from < self.hosts && to < self.hosts && groups[from as usize] != groups[to as usize]
            {
                st.counters.drops.add(DropReason::Partitioned);
                return;
            }
        }
        if self.memory_used + PACKET_OVERHEAD > self.memory_limit {
            st.counters.drops.add(DropReason::MemoryLimit);
            return;
        }
        self.memory_used += PACKET_OVERHEAD;
        let pkt = InFlight {
            data: Frame::default(),
            src: HostId(from),
            dst: HostId(to),
            id: self.next_packet,
            len,
            wire_bits,
            ecn: packet::ECN_ECT0,
            flow: 0,
            load: i as u32,
            ingress: NO_PORT,
            // (Not an IP packet: no switch looks at it.)
            ttl: 0,
            options: false,
        };
        self.next_packet += 1;
        let slot = self.hold(pkt);
        let _ = self.forward(t, from, slot);
    }

    /// Forwards load `i`'s packet in `slot` at vertex `v`: a random one of the usable
    /// equal-cost ports (a load is many flows), with the detection rules of GPU traffic.
    pub(super) fn forward_load(
        &mut self,
        now: Instant,
        v: VertexIdx,
        slot: u32,
        i: usize,
    ) -> Result<(), DropReason> {
        let draw = self.loads[i].gen.rng.next_u64();
        let detection = self.detection;
        let known_dead = |p: PortId| {
            self.down_since[self.routes.port(p).link as usize].is_some_and(|t| now >= t + detection)
        };
        let group = self.load_group(&self.loads[i], v);
        let n = group.iter().filter(|&&p| !known_dead(p)).count();
        let pick = (n > 0).then(|| {
            group
                .iter()
                .copied()
                .filter(|&p| !known_dead(p))
                .nth((draw % n as u64) as usize)
        });
        let Some(Some(p)) = pick else {
            self.release(slot);
            self.loads[i].counters.drops.add(DropReason::NoRoute);
            return Err(DropReason::NoRoute);
        };
        if self.down_since[self.routes.port(p).link as usize].is_some() {
            self.ports[p.0 as usize].counters.load_drops += 1;
            self.loads[i].counters.drops.add(DropReason::LinkDown);
            self.release(slot);
            return Err(DropReason::LinkDown);
        }
        self.enqueue(now, p, slot)
    }
}
