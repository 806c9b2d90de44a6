//! What the fabric lets its callers see: packet taps (captures), per-flow counters, the
//! trace of departures, and the path a flow takes.

use std::collections::VecDeque;
use std::net::Ipv4Addr;

use crate::packet::{self, FlowKey};
use crate::rng::mix;
use crate::routing::{PortId, VertexIdx};
use crate::topology::{HostId, Routing};
use crate::units::Instant;

use super::{ecmp_index, flow_key_mix, resilient_pick, DropReason, Fabric, InFlight, TraceEntry};

/// A GPU packet seen at a tapped port (`Fabric::set_taps`): as it left the port (after
/// ECN marking, before the next switch decrements its TTL), stamped when its last bit
/// left; or, when the taps want drops, as it was lost there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tapped {
    pub port: PortId,
    pub at: Instant,
    /// IP bytes of the packet (`data` holds at most the snap length of them).
    pub len: u32,
    pub data: Vec<u8>,
    pub dropped: Option<DropReason>,
}

/// Which ports are tapped, and what was seen not yet polled.
pub(super) struct Taps {
    on: Vec<bool>,
    snaplen: u32,
    drops: bool,
    out: VecDeque<Tapped>,
    /// Records not kept because `out` held `MAX_TAPPED` (the caller polls too rarely).
    overflow: u64,
}

/// Most tapped packets held for `poll_tapped`.
const MAX_TAPPED: usize = 1 << 16;

impl Taps {
    #[inline]
    pub(super) fn wants(
        taps: &Option<Box<Taps>>,
        port: PortId,
        dropped: Option<DropReason>,
    ) -> bool {
        taps.as_ref().is_some_and(|t| {
            t.on.get(port.0 as usize).copied().unwrap_or(false) && (dropped.is_none() || t.drops)
        })
    }

    pub(super) fn record(
        &mut self,
        port: PortId,
        at: Instant,
        pkt: &InFlight,
        dropped: Option<DropReason>,
    ) {
        if self.out.len() >= MAX_TAPPED {
            self.overflow += 1;
            return;
        }
        let mut data = pkt.data.prefix(self.snaplen as usize);
        // The TTL it has here (the model counts hops without rewriting the packet).
        if data.len() >= 12 {
            packet::rewrite_ttl(&mut data, pkt.ttl);
        }
        self.out.push_back(Tapped {
            port,
            at,
            len: pkt.len,
            data,
            dropped,
        });
    }
}

/// What the fabric did with one flow's packets (`Fabric::enable_flows`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowCounters {
    pub packets: u64,
    /// IP bytes.
    pub bytes: u64,
    /// Dropped anywhere in the fabric, for any reason.
    pub drops: u64,
    pub ecn_marked: u64,
    pub first: Instant,
    pub last: Instant,
}

/// Hashes the flow map's keys as they are: they are already mixed 64-bit hashes of the
/// 5-tuple, and the map is looked up for every packet a GPU sends.
#[derive(Default)]
pub(crate) struct MixedKey(u64);

impl std::hash::Hasher for MixedKey {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = mix(self.0 ^ b as u64);
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

type FlowMap = std::collections::HashMap<
    u64,
    (FlowKey, FlowCounters),
    std::hash::BuildHasherDefault<MixedKey>,
>;

/// Flows no longer counted one by one: let go, about the least recently active first, to
/// make room for new ones once `max` were counted (`Fabric::enable_flows`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Retired {
    pub flows: u64,
    /// Their packets while they were counted.
    pub packets: u64,
}

/// Per-flow counters, keyed by the flow's (unseeded) 5-tuple hash.
pub(super) struct Flows {
    pub(super) map: FlowMap,
    pub(super) max: usize,
    pub(super) retired: Retired,
    /// Every counted flow once, in the order it was counted or last passed over, with
    /// when: the clock `retire_one` turns.
    order: VecDeque<(u64, Instant)>,
}

/// Flows passed over for having been active, at most, before one goes whatever it did.
const SECOND_CHANCES: usize = 64;

impl Flows {
    /// Counts a packet of a flow not counted yet (`key` its mixed 5-tuple): when the table
    /// is full, one flow goes first, so that a long-lived fabric lists what runs now, not
    /// its first `max` flows.
    pub(super) fn insert(&mut self, flow: u64, key: FlowKey, c: FlowCounters) {
        if self.map.len() >= self.max {
            self.retire_one(c.first);
        }
        self.map.insert(flow, (key, c));
        self.order.push_back((flow, c.first));
    }

    /// Lets go the flow counted or passed over longest ago that was not active since
    /// (those that were get a second chance: the clock algorithm, close to "the least
    /// recently active" at a constant cost a flow, where a pass over 65,536 flows to find
    /// the idlest quarter held the data plane's thread 2.3 ms). After `SECOND_CHANCES`
    /// passed over, the next goes.
    fn retire_one(&mut self, now: Instant) {
        let mut passed = 0;
        while let Some((flow, since)) = self.order.pop_front() {
            let Some(e) = self.map.get(&flow) else {
                debug_assert!(false, "a flow in the clock's order is counted");
                continue;
            };
            if e.1.last > since && passed < SECOND_CHANCES {
                passed += 1;
                self.order.push_back((flow, now));
                continue;
            }
            let (_, c) = self.map.remove(&flow).expect("counted");
            self.retired.flows += 1;
            self.retired.packets += c.packets;
            return;
        }
    }

    #[inline]
    pub(super) fn drop(flows: &mut Option<Box<Flows>>, flow: u64) {
        if let Some(e) = flows.as_mut().and_then(|f| f.map.get_mut(&flow)) {
            e.1.drops += 1;
        }
    }
}

impl Fabric {
    /// Taps `ports` from now on (replacing any taps): their GPU packets, the first
    /// `snaplen` bytes of each, and with `drops` also those lost there; `poll_tapped`
    /// hands them out. An empty list removes the taps.
    pub fn set_taps(&mut self, ports: &[PortId], snaplen: u32, drops: bool) {
        if ports.is_empty() {
            self.taps = None;
            return;
        }
        let mut on = vec![false; self.ports.len()];
        for p in ports {
            on[p.0 as usize] = true;
        }
        let (out, overflow) = self
            .taps
            .take()
            .map_or((VecDeque::new(), 0), |t| (t.out, t.overflow));
        self.taps = Some(Box::new(Taps {
            on,
            snaplen,
            drops,
            out,
            overflow,
        }));
    }

    /// Counts packets, bytes, drops and ECN marks per flow (5-tuple) from now on, for up
    /// to `max` flows at once (beyond, the least recently active are let go: `Retired`).
    pub fn enable_flows(&mut self, max: usize) {
        self.flows.get_or_insert_with(|| {
            Box::new(Flows {
                // Room for every flow at once: growing the table moved 57,000 flows in
                // one go (5 ms of the data plane's thread).
                map: FlowMap::with_capacity_and_hasher(max.max(1), Default::default()),
                max: max.max(1),
                retired: Retired::default(),
                order: VecDeque::with_capacity(max.max(1)),
            })
        });
    }

    /// Every flow counted since `enable_flows` and not let go since, with its counters,
    /// and what was let go.
    pub fn flows(&self) -> (Vec<(FlowKey, FlowCounters)>, Retired) {
        match &self.flows {
            Some(f) => (f.map.values().copied().collect(), f.retired),
            None => (Vec::new(), Retired::default()),
        }
    }

    /// The next packet a tap saw, in the order they were seen.
    pub fn poll_tapped(&mut self) -> Option<Tapped> {
        self.taps.as_mut()?.out.pop_front()
    }

    /// Tapped packets not kept because they were not polled in time.
    pub fn tap_overflow(&self) -> u64 {
        self.taps.as_ref().map_or(0, |t| t.overflow)
    }

    /// Records every port departure from now on (for tests and captures; costs memory).
    pub fn enable_trace(&mut self) {
        self.trace.get_or_insert_with(Vec::new);
    }

    pub fn trace(&self) -> &[TraceEntry] {
        self.trace.as_deref().unwrap_or(&[])
    }

    /// The ports every packet of a flow crosses, as `send` routes it: ECMP switches hash
    /// the 5-tuple, so a flow keeps one path. `None` if the destination is not another GPU
    /// of this fabric (or a switch), or a switch on the way sprays or adapts packet by
    /// packet.
    pub fn flow_path(&self, key: &FlowKey) -> Option<Vec<PortId>> {
        let host = |a: Ipv4Addr| {
            let h = u32::from(a).wrapping_sub(self.addr_base);
            (h < self.hosts).then_some(h)
        };
        let to = u32::from(key.dst).wrapping_sub(self.addr_base);
        if to >= self.hosts && to - self.hosts < self.topo.switches.len() as u32 {
            return self.path_to_switch(host(key.src)?, to, flow_key_mix(key));
        }
        let (mut v, dst) = (host(key.src)?, HostId(host(key.dst)?));
        if v == dst.0 {
            return None;
        }
        let flow = flow_key_mix(key);
        let mut path = Vec::new();
        while v != dst.0 {
            let vs = &self.vertices[v as usize];
            // As `forward` does; once converged, every switch knows which links are down.
            let live = self.live.as_ref().unwrap_or(&self.routes).next_hops(v, dst);
            let usable = |p: PortId| self.down_since[self.routes.port(p).link as usize].is_none();
            let p = match (live.iter().filter(|&&p| usable(p)).count(), vs.routing) {
                (0, _) => return None,
                (1, _) => live.iter().copied().find(|&p| usable(p))?,
                (_, Routing::Spray | Routing::Adaptive) => return None,
                (_, Routing::Ecmp) => resilient_pick(
                    self.routes.next_hops(v, dst),
                    live,
                    usable,
                    flow,
                    vs.hash_seed,
                )?,
            };
            path.push(p);
            v = self.routes.port(p).to;
        }
        Some(path)
    }

    /// The ports a packet from GPU `v` to switch vertex `to` crosses (`forward_to_switch`).
    fn path_to_switch(&self, mut v: VertexIdx, to: VertexIdx, flow: u64) -> Option<Vec<PortId>> {
        let toward = self.toward(to);
        let usable = |p: &&PortId| self.down_since[self.routes.port(**p).link as usize].is_none();
        let mut path = Vec::new();
        while v != to {
            let group = &toward[v as usize];
            let n = group.iter().filter(usable).count();
            if n == 0 {
                return None;
            }
            let k = ecmp_index(flow, self.vertices[v as usize].hash_seed, n);
            let p = *group.iter().filter(usable).nth(k)?;
            path.push(p);
            v = self.routes.port(p).to;
        }
        Some(path)
    }
}
