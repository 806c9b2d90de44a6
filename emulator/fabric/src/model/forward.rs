//! Forwarding at a switch: the next hop of a GPU's packet, by ECMP over the routes (resilient
//! on a degraded fabric), or why there is none.

use crate::packet::{self, FlowKey};
use crate::rng::mix;
use crate::routing::{PortId, VertexIdx};
use crate::topology::{HostId, Routing, SwitchId};
use crate::units::Instant;

use super::{settle, DropReason, Fabric, Flows, Taps, NO_LOAD};

impl Fabric {
    /// Routes the packet in `slot`, standing at vertex `v` at time `now`, onto an egress
    /// port and schedules its arrival at the next vertex.
    pub(super) fn forward(
        &mut self,
        now: Instant,
        v: VertexIdx,
        slot: u32,
    ) -> Result<(), DropReason> {
        let load = self.slots[slot as usize].as_ref().expect("live slot").load;
        if load != NO_LOAD {
            return self.forward_load(now, v, slot, load as usize);
        }
        let to = self.slots[slot as usize].as_ref().expect("live slot").dst.0;
        if to >= self.hosts && v == to {
            // A packet addressed to this switch: answered, whatever TTL it has left.
            let request = self.release(slot);
            self.delivered += 1;
            self.to_switches += 1;
            self.answer(now, v, &request);
            return Ok(());
        }
        if v >= self.hosts {
            let pkt = self.slots[slot as usize].as_mut().expect("live slot");
            if pkt.ttl <= 1 {
                let expired = self.release(slot);
                Flows::drop(&mut self.flows, expired.flow);
                self.vertex_drops.add(DropReason::TtlExpired);
                self.time_exceeded(now, v, &expired);
                return Err(DropReason::TtlExpired);
            }
            pkt.ttl -= 1;
            if pkt.options {
                // Record Route: the switch's address, as a router's (none without one);
                // Timestamp: the time it passed, with that address where asked.
                let addr = self.topo.switch_addr(SwitchId(v - self.hosts));
                let ms = self.ip_timestamp(now);
                let pkt = self.slots[slot as usize].as_mut().expect("live slot");
                if let Some(addr) = addr {
                    packet::record_route(pkt.data.head_mut(), addr);
                }
                packet::timestamp(pkt.data.head_mut(), addr, ms);
            }
        }
        if to >= self.hosts {
            return self.forward_to_switch(now, v, slot);
        }
        let pkt = self.slots[slot as usize].as_ref().expect("live slot");
        if self.degraded {
            let port_id = match self.choose_degraded(now, v, pkt.dst, pkt.flow) {
                Some(p) => p,
                None => return Err(self.no_route(slot)),
            };
            if self.down_since[self.routes.port(port_id).link as usize].is_some() {
                return Err(self.blackhole(now, port_id, slot));
            }
            return self.enqueue(now, port_id, slot);
        }
        let group = self.routes.next_hops(v, pkt.dst);
        let port_id = match group.len() {
            0 => return Err(self.no_route(slot)),
            1 => group[0],
            n => {
                let vs = &mut self.vertices[v as usize];
                match vs.routing {
                    Routing::Ecmp => group[ecmp_index(pkt.flow, vs.hash_seed, n)],
                    Routing::Spray => group[vs.rng.below(n as u32) as usize],
                    Routing::Adaptive => {
                        let start = ecmp_index(pkt.flow, vs.hash_seed, n);
                        let mut best = group[start];
                        let mut best_q = u64::MAX;
                        for i in 0..n {
                            let p = group[(start + i) % n];
                            let port = &mut self.ports[p.0 as usize];
                            settle(port, now);
                            if port.backlog_bytes < best_q {
                                best = p;
                                best_q = port.backlog_bytes;
                            }
                        }
                        best
                    }
                }
            }
        };
        self.enqueue(now, port_id, slot)
    }

    /// The GPU packet in `slot` has no way on from where it is: dropped, counted.
    pub(super) fn no_route(&mut self, slot: u32) -> DropReason {
        let flow = self.release(slot).flow;
        Flows::drop(&mut self.flows, flow);
        self.vertex_drops.add(DropReason::NoRoute);
        DropReason::NoRoute
    }

    /// The GPU packet in `slot` was sent into port `p`'s dead link before its switch
    /// noticed: lost there (blackholed), counted on the port, and tapped.
    pub(super) fn blackhole(&mut self, now: Instant, p: PortId, slot: u32) -> DropReason {
        self.ports[p.0 as usize]
            .counters
            .drops
            .add(DropReason::LinkDown);
        if Taps::wants(&self.taps, p, Some(DropReason::LinkDown)) {
            let pkt = self.slots[slot as usize].as_ref().expect("live slot");
            let taps = self.taps.as_mut().expect("tapped");
            taps.record(p, now, pkt, Some(DropReason::LinkDown));
        }
        let flow = self.release(slot).flow;
        Flows::drop(&mut self.flows, flow);
        DropReason::LinkDown
    }

    /// With links down or routes changed: the ports `v` may use toward `dst` (the
    /// converged routes, less the adjacent dead links `v` has detected), choosing as the
    /// vertex's routing does. A flow keeps the port of the original ECMP group while it is
    /// usable (resilient hashing); flows on a dead port are rehashed over the survivors.
    fn choose_degraded(
        &mut self,
        now: Instant,
        v: VertexIdx,
        dst: HostId,
        flow: u64,
    ) -> Option<PortId> {
        let detection = self.detection;
        let down_since = &self.down_since;
        let routes = &self.routes;
        let known_dead = |p: PortId| {
            down_since[routes.port(p).link as usize].is_some_and(|t| now >= t + detection)
        };
        let live = self.live.as_ref().unwrap_or(&self.routes).next_hops(v, dst);
        let usable = |p: PortId| !known_dead(p);
        let original = self.routes.next_hops(v, dst);
        let vs = &mut self.vertices[v as usize];
        match vs.routing {
            Routing::Ecmp | Routing::Adaptive => {
                resilient_pick(original, live, usable, flow, vs.hash_seed)
            }
            Routing::Spray => {
                let n = live.iter().filter(|&&p| usable(p)).count();
                let i = (n > 0).then(|| vs.rng.below(n as u32) as usize)?;
                live.iter().copied().filter(|&p| usable(p)).nth(i)
            }
        }
    }
}

/// Resilient ECMP: a flow keeps its port of the `original` group while that port is among
/// the `live` ports that are `usable`; otherwise it is rehashed over those. `None` when
/// none is. Allocates nothing (it runs per packet on a degraded fabric).
pub(super) fn resilient_pick(
    original: &[PortId],
    live: &[PortId],
    usable: impl Fn(PortId) -> bool,
    flow: u64,
    seed: u64,
) -> Option<PortId> {
    if !original.is_empty() {
        let p = original[ecmp_index(flow, seed, original.len())];
        if usable(p) && live.contains(&p) {
            return Some(p);
        }
    }
    let n = live.iter().filter(|&&p| usable(p)).count();
    if n == 0 {
        return None;
    }
    live.iter()
        .copied()
        .filter(|&p| usable(p))
        .nth(ecmp_index(flow, mix(seed), n))
}

/// Which of `n` equal-cost next hops a flow takes at a switch with `seed`.
#[inline]
pub(super) fn ecmp_index(flow: u64, seed: u64, n: usize) -> usize {
    (mix(flow ^ seed) % n as u64) as usize
}

/// The seed-independent part of a flow's ECMP hash (each switch mixes in its own seed,
/// so paths do not polarize), computed once per packet.
#[inline]
pub(super) fn flow_key_mix(k: &FlowKey) -> u64 {
    let a = (u32::from(k.src) as u64) << 32 | u32::from(k.dst) as u64;
    let b = (k.proto as u64) << 32 | (k.sport as u64) << 16 | k.dport as u64;
    mix(mix(a) ^ b)
}
