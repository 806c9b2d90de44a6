//! Packets addressed to a switch, and the switches' own answers: echo replies, resets,
//! ICMP unreachable and time exceeded, routed back over the fabric like any packet.

use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use governor::clock::{Clock, Reference};
use governor::middleware::NoOpMiddleware;
use governor::nanos::Nanos;
use governor::state::{InMemoryState, NotKeyed};
use governor::{Quota, RateLimiter};

use crate::frame::Frame;
use crate::packet;
use crate::routing::{scale_out_bfs, PortId, VertexIdx};
use crate::topology::{HostId, SwitchId, SwitchParams, ICMP_BURST};
use crate::units::Instant;

use super::{charge, ecmp_index, flow_key_mix, DropReason, Fabric, InFlight, NO_LOAD, NO_PORT};

/// Groups (one per vertex, per switch) `Fabric::switch_routes` keeps at most: every switch's
/// of a fabric of a few thousand vertices, 8 switches' or more of the largest (each one
/// missed is a breadth-first search of the fabric on the next hop of a ping to it). The
/// daemon's memory bound (`plan::DaemonMemory`) counts them.
const SWITCH_ROUTE_GROUPS: usize = 1 << 20;

/// Fabric time as `governor`'s clock: the model sets it (`FabricClock::set`) before it asks
/// a policer, so that policing follows fabric time and reads no clock of the box.
#[derive(Clone, Debug, Default)]
pub(super) struct FabricClock(Arc<AtomicU64>);

/// A reading of `FabricClock`: fabric ns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct FabricNanos(u64);

impl std::ops::Add<Nanos> for FabricNanos {
    type Output = FabricNanos;
    fn add(self, d: Nanos) -> FabricNanos {
        FabricNanos(self.0.saturating_add(d.as_u64()))
    }
}

impl Reference for FabricNanos {
    fn duration_since(&self, earlier: Self) -> Nanos {
        Nanos::from(self.0.saturating_sub(earlier.0))
    }

    fn saturating_sub(&self, d: Nanos) -> Self {
        FabricNanos(self.0.checked_sub(d.as_u64()).unwrap_or(self.0))
    }
}

impl Clock for FabricClock {
    type Instant = FabricNanos;
    fn now(&self) -> FabricNanos {
        FabricNanos(self.0.load(Ordering::Relaxed))
    }
}

impl FabricClock {
    fn set(&self, now: Instant) {
        self.0.store(now.as_nanos(), Ordering::Relaxed);
    }
}

/// A switch's control-plane policer: its ICMP answers at most `icmp_rate` a second of
/// fabric time, `ICMP_BURST` back to back (GCRA, `governor`).
pub(super) struct Policer {
    limiter: RateLimiter<NotKeyed, InMemoryState, FabricClock, NoOpMiddleware<FabricNanos>>,
    /// Answers it held back.
    pub(super) limited: u64,
}

impl Policer {
    /// For a switch with `params` (`None` where it answers without limit).
    pub(super) fn new(params: &SwitchParams, clock: &FabricClock) -> Option<Policer> {
        let rate = NonZeroU32::new(params.icmp_rate)?;
        let burst = NonZeroU32::new(ICMP_BURST).expect("a burst above 0");
        let quota = Quota::per_second(rate).allow_burst(burst);
        Some(Policer {
            limiter: RateLimiter::direct_with_clock(quota, clock.clone()),
            limited: 0,
        })
    }
}

impl Fabric {
    /// Whether switch vertex `v`'s control plane may send an answer at `now`; one held
    /// back is counted (`icmp_limited`).
    fn may_answer(&mut self, now: Instant, v: VertexIdx) -> bool {
        let Some(p) = self
            .policers
            .get_mut((v - self.hosts) as usize)
            .and_then(Option::as_mut)
        else {
            return true;
        };
        self.policer_clock.set(now);
        let ok = p.limiter.check().is_ok();
        if !ok {
            p.limited += 1;
        }
        ok
    }

    /// Per switch (in switch order), the ICMP answers its policer held back
    /// (`SwitchParams::icmp_rate`).
    pub fn icmp_limited(&self) -> Vec<u64> {
        self.policers
            .iter()
            .map(|p| p.as_ref().map_or(0, |p| p.limited))
            .collect()
    }

    /// Toward switch vertex `to`: per vertex, its ports on a shortest path over the links
    /// that are up (GPUs do not forward). Empty toward a GPU (routes have those).
    pub(super) fn toward(&self, to: VertexIdx) -> Vec<Vec<PortId>> {
        self.toward_over(to, |l| self.down_since[l as usize].is_none())
    }

    /// `toward` over the links for which `up(link index)` holds.
    fn toward_over(&self, to: VertexIdx, up: impl Fn(u32) -> bool) -> Vec<Vec<PortId>> {
        if to < self.hosts {
            return Vec::new();
        }
        let n = self.hosts as usize + self.topo.switches.len();
        let (ports, out) = (&self.routes.ports, &self.routes.out);
        let alive = |p: PortId| up(ports[p.0 as usize].link);
        let mut dist = vec![u32::MAX; n];
        let mut queue = std::collections::VecDeque::new();
        let h = self.hosts;
        scale_out_bfs(
            out,
            ports,
            to,
            &mut dist,
            &mut queue,
            |v| v < h,
            |p, _| !alive(p),
        );
        (0..n)
            .map(|v| {
                let dv = dist[v];
                if dv == u32::MAX || dv == 0 {
                    return Vec::new();
                }
                out[v]
                    .iter()
                    .copied()
                    .filter(|&p| {
                        let u = ports[p.0 as usize].to;
                        alive(p) && dist[u as usize] == dv - 1 && (u >= h)
                    })
                    .collect()
            })
            .collect()
    }

    /// A GPU's packet to a switch (its `dst` is the switch's vertex) one hop on from `v`: on a
    /// shortest path over the links up when routes last converged (as a load toward a
    /// switch goes), hashed by flow among equal ones, around the dead links `v` has
    /// detected; into a dead link it has not detected yet, lost (blackholed).
    pub(super) fn forward_to_switch(
        &mut self,
        now: Instant,
        v: VertexIdx,
        slot: u32,
    ) -> Result<(), DropReason> {
        let (to, flow) = {
            let pkt = self.slots[slot as usize].as_ref().expect("live slot");
            (pkt.dst.0, pkt.flow)
        };
        let i = match self.switch_routes.iter().position(|(t, _)| *t == to) {
            Some(i) => i,
            None => {
                let vertices = self.vertices.len().max(1);
                if self.switch_routes.len() >= (SWITCH_ROUTE_GROUPS / vertices).max(8) {
                    self.switch_routes.remove(0);
                }
                // Over the links up when routes last converged, as the GPUs' routes are
                // (`live`): a link down since is used until its switch detects it.
                let down = &self.converged_down;
                let toward =
                    self.toward_over(to, |l| !down.get(l as usize).copied().unwrap_or(false));
                self.switch_routes.push((to, toward));
                self.switch_routes.len() - 1
            }
        };
        let detection = self.detection;
        let (down_since, routes) = (&self.down_since, &self.routes);
        let usable = |p: &&PortId| {
            down_since[routes.port(**p).link as usize].is_none_or(|t| now < t + detection)
        };
        let group = &self.switch_routes[i].1[v as usize];
        let n = group.iter().filter(usable).count();
        let pick = (n > 0).then(|| {
            let k = ecmp_index(flow, self.vertices[v as usize].hash_seed, n);
            *group.iter().filter(usable).nth(k).expect("k < n")
        });
        let Some(p) = pick else {
            return Err(self.no_route(slot));
        };
        if self.down_since[self.routes.port(p).link as usize].is_some() {
            return Err(self.blackhole(now, p, slot));
        }
        self.enqueue(now, p, slot)
    }

    /// Switch `v` answers `request`, a GPU's packet addressed to it, as a host that runs no
    /// services does (`packet::to_switch`: a ping with an echo reply, TCP with a reset, UDP
    /// and other protocols with ICMP unreachable), from its address, sent back through the
    /// fabric like any packet (at once: a switch's control plane takes its time, which the
    /// model leaves out). A datagram in fragments is answered once whole (`reassembly`),
    /// an answer longer than the MTU sent in fragments. None from a switch without an
    /// address, toward an address that is no GPU's, or beyond the packet memory.
    pub(super) fn answer(&mut self, now: Instant, v: VertexIdx, request: &InFlight) {
        let Some(from) = self.topo.switch_addr(SwitchId(v - self.hosts)) else {
            return;
        };
        let mut bytes = request.data.to_vec();
        if packet::is_fragment(&bytes) {
            // Answered once whole, as a host's stack does.
            match self.reassembly.add(now, v, &bytes) {
                Some(whole) => bytes = whole,
                None => return,
            }
        }
        let kind = packet::to_switch(&bytes);
        if matches!(kind, packet::ToSwitch::Nothing) || !self.may_answer(now, v) {
            return;
        }
        // A Timestamp option gets the switch's entry as it receives the request (and
        // another as the answer leaves, if it is echoed), as a Linux host's does.
        let ms = self.ip_timestamp(now);
        packet::timestamp(&mut bytes, Some(from), ms);
        let answer = match kind {
            packet::ToSwitch::Echo => packet::echo_reply(from, &bytes),
            packet::ToSwitch::Timestamp => packet::timestamp_reply(from, &bytes, ms),
            packet::ToSwitch::Reset => packet::tcp_reset(from, &bytes),
            packet::ToSwitch::Unreachable(code) => packet::unreachable(from, code, &bytes),
            packet::ToSwitch::Nothing => return,
        };
        // An echo reply to a long ping is as long: in fragments that fit the links.
        for piece in packet::fragment(&answer, self.mtu as usize) {
            self.inject_from_switch(now, v, request.src, Frame::from(piece));
        }
    }

    /// Switch `v` answers the GPU packet `expired`, whose TTL ran out there, with an ICMP
    /// time exceeded (as a router does; `traceroute` and `ping -t` see the hop), sent
    /// from `v`'s address back to the packet's sender through the fabric like any packet.
    /// None for an ICMP error or a later fragment (`packet::time_exceeded`), from a switch
    /// without an address, or beyond the packet memory. It counts among the packets in.
    pub(super) fn time_exceeded(&mut self, now: Instant, v: VertexIdx, expired: &InFlight) {
        let Some(from) = self.topo.switch_addr(SwitchId(v - self.hosts)) else {
            return;
        };
        // The packet as it arrived here (its bytes carry the TTL it was sent with).
        let mut quoted = expired.data.prefix(60 + 8);
        packet::rewrite_ttl(&mut quoted, expired.ttl);
        let Some(bytes) = packet::time_exceeded(from, &quoted) else {
            return;
        };
        if !self.may_answer(now, v) {
            return;
        }
        self.inject_from_switch(now, v, expired.src, Frame::from(bytes));
    }

    /// A packet switch `v` makes (an ICMP answer to GPU `src`'s packet) enters the fabric
    /// there, routed to its destination address like any packet. It counts among the
    /// packets in.
    fn inject_from_switch(&mut self, now: Instant, v: VertexIdx, src: HostId, data: Frame) {
        let key = packet::inspect(data.head())
            .expect("a packet built right")
            .key;
        // Routed as any packet, to its destination address: the packet's source, which a
        // GPU may have set to another's (or to none of the fabric's).
        let dst = u32::from(key.dst).wrapping_sub(self.addr_base);
        if dst >= self.hosts {
            return;
        }
        let charge = charge(&data);
        if self.memory_used + charge > self.memory_limit {
            return;
        }
        self.memory_used += charge;
        let len = data.len() as u32;
        let pkt = InFlight {
            // `forward` takes one off at this switch too: it leaves with 64.
            ttl: 65,
            // An echo reply's Record Route (`packet::echo_reply`): `forward` adds this
            // switch, then each on the way.
            options: data.head()[0] & 0x0f > 5,
            data,
            src,
            dst: HostId(dst),
            id: self.next_packet,
            len,
            wire_bits: (len as u64 + self.l2_overhead as u64) * 8,
            ecn: 0,
            flow: flow_key_mix(&key),
            load: NO_LOAD,
            ingress: NO_PORT,
        };
        self.next_packet += 1;
        self.sent += 1;
        let slot = self.hold(pkt);
        let _ = self.forward(now, v, slot);
    }
}
