//! Changes to a running fabric (`Fabric::apply`): links down and up, rates, delays, losses
//! and buffers set, partitions; the flush of a failed link and the convergence of routes.

use std::cmp::Reverse;

use crate::load::{Generator, LoadCounters};
use crate::rng::Rng;
use crate::routing::{PortId, Routes};
use crate::topology::{FlowControl, LinkParams};
use crate::units::{Bytes, Duration, Instant};

use super::{
    count_lost, headroom_bytes, pack, settle, Change, DropReason, Fabric, Flows, LinkState,
    LoadState, Taps, DEPART_EVENT, LOST, NO_LOAD, NO_PORT,
};

impl Fabric {
    /// Applies `change` at `now` (events due by then are processed first). Returns false if
    /// it changes nothing (a link already down, or already up).
    pub fn apply(&mut self, now: Instant, change: Change) -> bool {
        self.advance(now);
        self.converge_by(now);
        let ports = |l: u32| [PortId(2 * l), PortId(2 * l + 1)];
        match change {
            Change::LinkDown(l) => {
                if self.down_since[l as usize].is_some() {
                    return false;
                }
                for p in ports(l) {
                    self.flush(p, now);
                }
                self.down_since[l as usize] = Some(now);
                self.converge_at = Some(now + self.convergence);
                self.degraded = true;
            }
            Change::LinkUp(l) => {
                if self.down_since[l as usize].take().is_none() {
                    return false;
                }
                self.converge_at = Some(now + self.convergence);
            }
            Change::SetLink {
                link,
                dirs,
                rate,
                delay,
                loss,
                loss_burst,
                buffer,
            } => {
                for p in dirs.ports(link) {
                    let port = &mut self.ports[p.0 as usize];
                    settle(port, now);
                    let was = port.link;
                    if let Some(r) = rate {
                        port.link.rate = r;
                    }
                    if let Some(d) = delay {
                        port.link.delay = d;
                    }
                    if let Some(x) = loss {
                        port.link.loss = x;
                    }
                    if let Some(x) = loss_burst {
                        port.link.loss_burst = x;
                    }
                    port.loss_bad = false;
                    if let Some(b) = buffer {
                        port.queue.buffer = b;
                    }
                    self.link_changed(p);
                    self.retime(now, p, was);
                }
            }
            Change::Partition(groups) => {
                assert_eq!(groups.len(), self.hosts as usize, "a group per GPU");
                if self.partition.as_ref() == Some(&groups) {
                    return false;
                }
                self.partition = Some(groups);
            }
            Change::Heal => {
                if self.partition.take().is_none() {
                    return false;
                }
            }
            Change::StartLoad(spec) => {
                let n = self.hosts as usize + self.topo.switches.len();
                assert!(
                    (spec.from as usize) < n && (spec.to as usize) < n && spec.from != spec.to,
                    "a load between two vertices of the fabric"
                );
                assert!(
                    spec.packet > 0 && spec.rate.bps() > 0,
                    "a load sends something"
                );
                if self
                    .loads
                    .iter()
                    .any(|l| !l.retired && l.gen.spec.id == spec.id)
                {
                    return false;
                }
                let rng = Rng::new(self.seed, 2 << 40 | spec.id as u64);
                let mut st = LoadState {
                    gen: Generator::new(spec, now, rng),
                    active: true,
                    counters: LoadCounters::default(),
                    toward: Vec::new(),
                    held: 0,
                    retired: false,
                };
                st.toward = self.toward(st.gen.spec.to);
                let i = match self.free_loads.pop() {
                    Some(i) => {
                        self.loads[i as usize] = st;
                        i as usize
                    }
                    None => {
                        self.loads.push(st);
                        self.loads.len() - 1
                    }
                };
                self.events
                    .push(Reverse(pack(now, (self.ports.len() + i) as u32)));
            }
            Change::StopLoad(id) => {
                let Some(i) = self
                    .loads
                    .iter()
                    .position(|l| !l.retired && l.gen.spec.id == id)
                else {
                    return false;
                };
                let st = &mut self.loads[i];
                if !st.active {
                    return false;
                }
                st.active = false;
                st.gen.next = None;
                self.load_done(i);
            }
            Change::ResetLink(link) => {
                for p in ports(link) {
                    let buffer = self.original_buffer(p.0);
                    let port = &mut self.ports[p.0 as usize];
                    settle(port, now);
                    let was = port.link;
                    port.link = self.topo.links[link as usize].params;
                    port.loss_bad = false;
                    port.queue.buffer = buffer;
                    self.link_changed(p);
                    self.retime(now, p, was);
                }
            }
        }
        true
    }

    /// The group of each GPU while a partition holds.
    pub fn partition(&self) -> Option<&[u16]> {
        self.partition.as_deref()
    }

    /// Links that are down or whose parameters differ from the topology's.
    pub fn changed_links(&self) -> Vec<LinkState> {
        (0..self.topo.links.len() as u32)
            .filter_map(|l| {
                let (a, b) = (&self.ports[2 * l as usize], &self.ports[2 * l as usize + 1]);
                let original = &self.topo.links[l as usize].params;
                let down = self.down_since[l as usize];
                let changed = a.link != *original
                    || b.link != *original
                    || a.queue.buffer != self.original_buffer(2 * l)
                    || b.queue.buffer != self.original_buffer(2 * l + 1);
                (down.is_some() || changed).then_some(LinkState {
                    link: l,
                    up: down.is_none(),
                    down_since: down,
                    params: [a.link, b.link],
                    buffers: [a.queue.buffer, b.queue.buffer],
                })
            })
            .collect()
    }

    fn original_buffer(&self, port: u32) -> Bytes {
        let from = self.routes.port(PortId(port)).from;
        let h = self.topo.hosts.len() as u32;
        if from < h {
            self.topo.fabric.nic_queue.buffer
        } else {
            self.topo.switches[(from - h) as usize].params.queue.buffer
        }
    }

    /// Loses everything port `p` holds (queued or on its wire), counted as `LinkDown`.
    fn flush(&mut self, p: PortId, now: Instant) {
        let port = &mut self.ports[p.0 as usize];
        let lost: Vec<u32> = port.transit.drain(..).map(|(_, slot)| slot).collect();
        // What finished serializing is counted as sent (or lost on the wire); a packet
        // lost on the wire (configured loss) whose serialization had not finished is
        // counted as lost now, as `settle` would have; the rest of the backlog is in
        // `transit` too.
        settle(port, now);
        for &(_, _, flags) in &port.backlog {
            if flags & LOST != 0 {
                count_lost(&mut port.counters, flags);
            }
        }
        port.backlog.clear();
        port.backlog_bytes = 0;
        port.busy_until = now;
        port.carry = 0;
        if let Some(since) = port.paused.take() {
            port.counters.paused += now.saturating_since(since);
        }
        let mut waiting: Vec<u32> = port.waiting.drain(..).collect();
        if let Some(fq) = &mut port.fq {
            waiting.extend(fq.drain());
        }
        self.in_transit -= lost.len() as u64;
        // Nothing arrives and nothing waits to start: an arrival still scheduled would
        // take the next frame sent (after the link is back) off the wire early.
        let depart = std::mem::replace(&mut port.depart_pending, false);
        self.unschedule(p.0);
        if depart {
            self.unschedule(DEPART_EVENT | p.0);
        }
        // Lost on the wire (started), or waiting to start (lossless, or a NIC's flows).
        let on_wire = lost.into_iter().map(|s| (s, true));
        for (slot, started) in on_wire.chain(waiting.into_iter().map(|s| (s, false))) {
            let pkt = self.release(slot);
            if pkt.ingress != NO_PORT {
                // What waited here leaves the switch's ingress as it is lost.
                self.free_ingress(now, PortId(pkt.ingress), pkt.len);
            }
            let load = pkt.load;
            let counters = &mut self.ports[p.0 as usize].counters;
            if load == NO_LOAD {
                counters.drops.add(DropReason::LinkDown);
                Flows::drop(&mut self.flows, pkt.flow);
                if Taps::wants(&self.taps, p, Some(DropReason::LinkDown)) {
                    let taps = self.taps.as_mut().expect("tapped");
                    taps.record(p, now, &pkt, Some(DropReason::LinkDown));
                }
            } else {
                counters.load_drops += 1;
                if started {
                    self.load_in_transit -= 1;
                }
                self.loads[load as usize]
                    .counters
                    .drops
                    .add(DropReason::LinkDown);
            }
        }
    }

    /// Routes converge (over the links that are up) if they were due to by `t`.
    pub(super) fn converge_by(&mut self, t: Instant) {
        let Some(at) = self.converge_at else { return };
        if at > t {
            return;
        }
        self.converge_at = None;
        self.route_epoch += 1;
        self.switch_routes.clear();
        self.converged_down = self.down_since.iter().map(Option::is_some).collect();
        let down = &self.down_since;
        if down.iter().all(Option::is_none) {
            self.live = None;
            self.degraded = false;
        } else {
            self.live = Some(Routes::over_live_links(&self.topo, |l| {
                down[l as usize].is_none()
            }));
            self.degraded = true;
        }
        for i in 0..self.loads.len() {
            if self.loads[i].active && self.loads[i].gen.spec.to >= self.hosts {
                self.loads[i].toward = self.toward(self.loads[i].gen.spec.to);
            }
        }
    }

    /// Link parameters of a port (rate, delay, loss).
    pub fn link_of(&self, p: PortId) -> LinkParams {
        self.ports[p.0 as usize].link
    }

    /// What the topology gives port `p`: its link's parameters and its egress buffer (what
    /// `Change::ResetLink` returns it to).
    pub fn original_of(&self, p: PortId) -> (LinkParams, Bytes) {
        (
            self.topo.links[(p.0 / 2) as usize].params,
            self.original_buffer(p.0),
        )
    }

    /// A link's new rate or delay applied to what port `p` holds at `now` (settled), where
    /// it was `was`: the frame on the wire sends the rest of its bits at the new rate, the
    /// frames queued behind it follow back to back, and each goes on the link with the
    /// delay it has now; only what finished leaving the port keeps its arrival. (The
    /// schedule was fixed as frames were admitted: without this, a queue built at a
    /// degraded rate kept draining at it after the link was reset — a frame sent at 1
    /// bit/s held its port for minutes.)
    fn retime(&mut self, now: Instant, p: PortId, was: LinkParams) {
        let port = &mut self.ports[p.0 as usize];
        let (old, new) = (was.rate.bps() as u128, port.link.rate.bps().max(1) as u128);
        if (old == new && was.delay == port.link.delay) || port.backlog.is_empty() {
            return;
        }
        // The backlog finishes after `now`: its first frame started by then (a frame
        // starts at its admission or when the one before it finishes, and every one
        // before it had finished), the others follow back to back.
        let (mut before, mut after) = (now, now);
        let mut finishes = std::mem::take(&mut self.retimed);
        for e in port.backlog.iter_mut() {
            let ns = e.0.saturating_since(before).as_nanos() as u128 * old / new;
            before = e.0;
            after = after + Duration::from_nanos(ns.min(u64::MAX as u128) as u64);
            e.0 = after;
            if e.2 & LOST == 0 {
                finishes.push(after);
            }
        }
        let ahead = before.saturating_since(now).as_nanos();
        let busy = port.counters.busy.as_nanos().saturating_sub(ahead);
        port.counters.busy = Duration::from_nanos(busy) + after.saturating_since(now);
        port.busy_until = after;
        port.carry = 0;
        // The frames not lost are the last of those in transit, in the same order.
        let head = port.transit.front().map(|t| t.0);
        let first = port.transit.len() - finishes.len();
        let mut last = first.checked_sub(1).map(|i| port.transit[i].0);
        let prop = port.link.delay + port.next_latency;
        for (t, &f) in port.transit.range_mut(first..).zip(&finishes) {
            let at = last.map_or(f + prop, |l| (f + prop).max(l));
            t.0 = at;
            last = Some(at);
        }
        finishes.clear();
        self.retimed = finishes;
        let (head_now, depart) = (port.transit.front().map(|t| t.0), port.depart_pending);
        if head_now != head {
            self.unschedule(p.0);
            if let Some(at) = head_now {
                self.events.push(Reverse(pack(at, p.0)));
            }
        }
        if depart {
            self.unschedule(DEPART_EVENT | p.0);
            self.events.push(Reverse(pack(after, DEPART_EVENT | p.0)));
        }
    }

    /// Takes the events keyed `key` (a port's next arrival or its departure) off the
    /// schedule: rare (a link changed or went down), so a pass over the heap.
    fn unschedule(&mut self, key: u32) {
        self.events.retain(|&Reverse(e)| e as u32 != key);
    }

    /// What port `p` derives from its link (PFC headroom, a NIC's flow scheduling), after
    /// the link changed.
    fn link_changed(&mut self, p: PortId) {
        let lossless = self.flow_control != FlowControl::Lossy;
        let port = &mut self.ports[p.0 as usize];
        port.headroom = headroom_bytes(&port.link, port.next_latency, self.l2_overhead);
        port.size_nic(self.mtu, lossless);
    }
}
