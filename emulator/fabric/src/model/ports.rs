//! Egress ports: admission (tail drop, ECN marking, lossless pauses), serialization at
//! the link rate, loss on the wire, a GPU NIC's flow queues, and departures.

use std::cmp::Reverse;

use crate::packet::{self, ECN_CE, ECN_NOT_ECT};
use crate::rng::mix;
use crate::routing::PortId;
use crate::topology::{Ecn, FlowControl, LinkParams};
use crate::units::{Bandwidth, Duration, Instant};

use super::{
    pack, DropReason, Fabric, Flows, Port, PortCounters, Taps, ToSend, TraceEntry, DEPART_EVENT,
    LOAD_FLOW, LOST, MAX_PACKET, NO_LOAD, NO_PORT, PAUSE_EVENT, RESUME_EVENT, SYNTHETIC,
};

impl Fabric {
    /// Admits the packet in `slot` to egress port `port_id` at `now`: tail drop (or, in a
    /// lossless fabric, ingress accounting and pauses), ECN, serialization, and its
    /// arrival at the next vertex.
    pub(super) fn enqueue(
        &mut self,
        now: Instant,
        port_id: PortId,
        slot: u32,
    ) -> Result<(), DropReason> {
        let lossless = self.flow_control.pause().copied();
        let pkt = self.slots[slot as usize].as_ref().expect("live slot");
        let (len, load, ingress, flow) = (pkt.len, pkt.load, pkt.ingress, pkt.flow);
        let port = &mut self.ports[port_id.0 as usize];
        settle(port, now);
        if load == NO_LOAD {
            port.counters.rx_packets += 1;
            port.counters.rx_bytes += len as u64;
        }
        let full = match lossless {
            // A lossless switch holds what its ingress admitted: only more than the
            // headroom allows (too little configured for the link) is dropped.
            Some(pause) if ingress != NO_PORT => {
                let q = &self.ports[ingress as usize];
                q.ingress_bytes + len as u64 > pause.xoff.get() + q.headroom
            }
            // A GPU's NIC queue (or a lossy queue) tail-drops at its buffer.
            _ => port.backlog_bytes + len as u64 > port.queue.buffer.get(),
        };
        if full {
            return Err(self.drop_full(now, port_id, slot));
        }
        self.mark(port_id, slot);
        let port = &mut self.ports[port_id.0 as usize];
        port.backlog_bytes += len as u64;
        port.counters.max_queue_bytes = port.counters.max_queue_bytes.max(port.backlog_bytes);
        if let Some(fq) = &mut port.fq {
            // A GPU's NIC: straight to the wire if nothing waits and it has room ahead of
            // the wire, else into its flow's queue (a load is a flow of its own).
            let ahead = port.backlog_bytes - len as u64;
            if fq.is_empty()
                && (ahead == 0 || ahead < port.nic_ring)
                && port.paused.is_none()
                && !port.depart_pending
            {
                self.transmit(now, port_id, slot);
            } else {
                let key = if load == NO_LOAD {
                    flow
                } else {
                    mix(LOAD_FLOW ^ load as u64)
                };
                fq.push(key, slot, len);
                self.nic_start(now, port_id);
            }
            return Ok(());
        }
        let Some(pause) = lossless else {
            self.transmit(now, port_id, slot);
            return Ok(());
        };
        port.waiting.push_back(slot);
        if ingress != NO_PORT {
            let q = &mut self.ports[ingress as usize];
            q.ingress_bytes += len as u64;
            q.counters.max_ingress_bytes = q.counters.max_ingress_bytes.max(q.ingress_bytes);
            if q.ingress_bytes >= pause.xoff.get() && !q.xoff_sent {
                q.xoff_sent = true;
                match self.flow_control {
                    // The pause frame reaches the upstream port a link delay later.
                    FlowControl::Pfc(_) => {
                        let at = (now + q.link.delay).max(q.control_at);
                        q.control_at = at;
                        self.events.push(Reverse(pack(at, PAUSE_EVENT | ingress)));
                    }
                    // The sender counts its credits: it stops at once.
                    _ => self.pause(now, PortId(ingress)),
                }
            }
        }
        self.try_start(now, port_id);
        Ok(())
    }

    /// Bytes a lossless switch must hold beyond `xoff` for what port `p` still sends after
    /// the switch asked it to stop: its pause (or its last credit) takes a link delay to
    /// arrive and the resume one more; the frame on the wire and the one it had started
    /// finish; the switch's own latency. Frames are up to 64 KiB (TUN offload hands the
    /// fabric super-packets).
    pub fn headroom(&self, p: PortId) -> u64 {
        self.ports[p.0 as usize].headroom
    }

    /// Counts a packet that did not fit at `port_id` and lets it go.
    fn drop_full(&mut self, now: Instant, port_id: PortId, slot: u32) -> DropReason {
        let pkt = self.slots[slot as usize].as_ref().expect("live slot");
        let (id, load) = (pkt.id, pkt.load);
        let port = &mut self.ports[port_id.0 as usize];
        if load != NO_LOAD {
            port.counters.load_drops += 1;
            self.loads[load as usize]
                .counters
                .drops
                .add(DropReason::BufferFull);
        } else {
            port.counters.drops.add(DropReason::BufferFull);
            Flows::drop(&mut self.flows, pkt.flow);
            if Taps::wants(&self.taps, port_id, Some(DropReason::BufferFull)) {
                let taps = self.taps.as_mut().expect("tapped");
                taps.record(port_id, now, pkt, Some(DropReason::BufferFull));
            }
        }
        if let Some(t) = &mut self.trace {
            t.push(TraceEntry {
                port: port_id,
                packet: id,
                start: now,
                finish: now,
                dropped: Some(DropReason::BufferFull),
            });
        }
        self.release(slot);
        DropReason::BufferFull
    }

    /// ECN: marks the ECT packet in `slot` CE if `port_id`'s queue says so (CE packets
    /// stay CE and are not counted again).
    fn mark(&mut self, port_id: PortId, slot: u32) {
        let pkt = self.slots[slot as usize].as_mut().expect("live slot");
        let port = &mut self.ports[port_id.0 as usize];
        if pkt.ecn == ECN_NOT_ECT || pkt.ecn == ECN_CE || !should_mark(port) {
            return;
        }
        pkt.ecn = ECN_CE;
        if pkt.load != NO_LOAD {
            self.loads[pkt.load as usize].counters.ecn_marked += 1;
        } else {
            packet::mark_ce(pkt.data.head_mut());
            port.counters.ecn_marked += 1;
            if let Some(e) = self.flows.as_mut().and_then(|f| f.map.get_mut(&pkt.flow)) {
                e.1.ecn_marked += 1;
            }
        }
    }

    /// Lossless: starts port `p`'s next waiting packet at `now` if it is free and not
    /// paused, or schedules the instant it frees (a GPU's NIC with `fq`: `nic_start`).
    fn try_start(&mut self, now: Instant, p: PortId) {
        let port = &mut self.ports[p.0 as usize];
        if port.fq.is_some() {
            return self.nic_start(now, p);
        }
        if port.paused.is_some() || port.depart_pending {
            return;
        }
        let Some(&slot) = port.waiting.front() else {
            return;
        };
        if port.busy_until > now {
            self.schedule_depart(p);
            return;
        }
        port.waiting.pop_front();
        let pkt = self.slots[slot as usize].as_mut().expect("live slot");
        let (len, ingress) = (pkt.len, std::mem::replace(&mut pkt.ingress, NO_PORT));
        if ingress != NO_PORT {
            self.free_ingress(now, PortId(ingress), len);
        }
        self.transmit(now, p, slot);
        if !self.ports[p.0 as usize].waiting.is_empty() {
            self.schedule_depart(p);
        }
    }

    /// A GPU's NIC with `fq`: takes packets off its flow queues, fairly, while it has
    /// room ahead of the wire (`Port::size_nic`; they start back to back), else schedules
    /// the instant the wire has sent what it took.
    fn nic_start(&mut self, now: Instant, p: PortId) {
        let port = &mut self.ports[p.0 as usize];
        if port.paused.is_some() || port.depart_pending {
            return;
        }
        settle(port, now);
        let (ring, backlog) = (port.nic_ring, port.backlog_bytes);
        let fq = port.fq.as_mut().expect("a NIC's flow queues");
        // The packets it takes (what it sends does not leave the backlog before `now`).
        let mut burst = std::mem::take(&mut self.nic_burst);
        while !fq.is_empty() {
            let ahead = backlog - fq.bytes();
            if ahead > 0 && ahead >= ring {
                break;
            }
            burst.push(fq.pop().expect("a waiting packet"));
        }
        let more = !fq.is_empty();
        // Their slots are read in a pass of their own, then they are sent: they waited in
        // the queue and are often out of the cache, and independent reads in a short loop
        // are fetched together, where `transmit` would wait for each in turn.
        let mut sent = std::mem::take(&mut self.nic_sent);
        sent.extend(burst.drain(..).map(|slot| self.to_send(slot)));
        for s in sent.drain(..) {
            self.transmit_read(now, p, s);
        }
        self.nic_burst = burst;
        self.nic_sent = sent;
        if more {
            self.schedule_depart(p);
        }
    }

    /// Port `p` looks at its waiting packets again when it frees.
    fn schedule_depart(&mut self, p: PortId) {
        let port = &mut self.ports[p.0 as usize];
        port.depart_pending = true;
        self.events
            .push(Reverse(pack(port.busy_until, DEPART_EVENT | p.0)));
    }

    /// Lossless: `len` bytes that came through port `q` left the switch's ingress; below
    /// `xon` the switch lets `q` send again (the resume, or the credits, arrive a link
    /// delay later).
    pub(super) fn free_ingress(&mut self, now: Instant, q: PortId, len: u32) {
        let xon = self.flow_control.pause().map_or(0, |p| p.xon.get());
        let port = &mut self.ports[q.0 as usize];
        port.ingress_bytes -= len as u64;
        if port.xoff_sent && port.ingress_bytes <= xon {
            port.xoff_sent = false;
            let at = (now + port.link.delay).max(port.control_at);
            port.control_at = at;
            self.events.push(Reverse(pack(at, RESUME_EVENT | q.0)));
        }
    }

    /// Port `p` is stopped by its neighbour from `now` on (it finishes the packet it is
    /// sending).
    fn pause(&mut self, now: Instant, p: PortId) {
        let port = &mut self.ports[p.0 as usize];
        if port.paused.is_none() {
            port.paused = Some(now);
            port.counters.pause_events += 1;
        }
    }

    /// A lossless port's event at `t`: it frees, or a pause or resume arrives.
    pub(super) fn port_event(&mut self, t: Instant, p: PortId, kind: u32) {
        match kind {
            DEPART_EVENT => {
                self.ports[p.0 as usize].depart_pending = false;
                self.try_start(t, p);
            }
            PAUSE_EVENT => {
                if self.down_since[self.routes.port(p).link as usize].is_none() {
                    self.pause(t, p);
                }
            }
            _ => {
                let port = &mut self.ports[p.0 as usize];
                if let Some(since) = port.paused.take() {
                    port.counters.paused += t.saturating_since(since);
                }
                self.try_start(t, p);
            }
        }
    }

    /// Ports paused now, with since when: a port paused for long while its neighbour's
    /// queue does not drain is a deadlock (a cyclic buffer dependency).
    pub fn paused_ports(&self) -> Vec<(PortId, Instant)> {
        self.ports
            .iter()
            .enumerate()
            .filter_map(|(i, p)| p.paused.map(|s| (PortId(i as u32), s)))
            .collect()
    }

    /// Lossless: bytes the vertex port `p` leads to holds from it now (its ingress
    /// occupancy), and whether it asked `p` to stop.
    pub fn ingress_held(&self, p: PortId) -> (u64, bool) {
        let port = &self.ports[p.0 as usize];
        (port.ingress_bytes, port.xoff_sent)
    }

    /// Lossy, or lossless (PFC, credits).
    pub fn flow_control(&self) -> &FlowControl {
        &self.flow_control
    }

    /// Serializes the packet in `slot` on `port_id` (from when the port frees) and
    /// schedules its arrival at the next vertex, or loses it on the wire.
    fn transmit(&mut self, now: Instant, port_id: PortId, slot: u32) {
        let sent = self.to_send(slot);
        self.transmit_read(now, port_id, sent);
    }

    /// What `transmit` reads of the packet in `slot`.
    #[inline]
    fn to_send(&self, slot: u32) -> ToSend {
        let pkt = self.slots[slot as usize].as_ref().expect("live slot");
        ToSend {
            slot,
            len: pkt.len,
            load: pkt.load,
            wire_bits: pkt.wire_bits,
        }
    }

    /// `transmit`, with the packet's slot already read.
    #[inline]
    fn transmit_read(&mut self, now: Instant, port_id: PortId, sent: ToSend) {
        let ToSend {
            slot,
            len,
            load,
            wire_bits,
        } = sent;
        let synthetic = load != NO_LOAD;
        let port = &mut self.ports[port_id.0 as usize];
        // Back to back: the serialization remainder carries over, so long runs are exact.
        let start = port.busy_until.max(now);
        let carry = if port.busy_until >= now {
            port.carry
        } else {
            0
        };
        let (ser, carry) = port.link.rate.transmit_time(wire_bits, carry);
        let finish = start + ser;
        port.carry = carry;
        port.busy_until = finish;
        port.counters.busy += ser;
        let lost = lose(port);
        let flags = if lost { LOST } else { 0 } | if synthetic { SYNTHETIC } else { 0 };
        port.backlog.push_back((finish, len, flags));
        if let Some(t) = &mut self.trace {
            t.push(TraceEntry {
                port: port_id,
                packet: self.slots[slot as usize].as_ref().expect("live slot").id,
                start,
                finish,
                dropped: lost.then_some(DropReason::Loss),
            });
        }
        if lost {
            if synthetic {
                self.loads[load as usize]
                    .counters
                    .drops
                    .add(DropReason::Loss);
            } else if Taps::wants(&self.taps, port_id, Some(DropReason::Loss)) {
                let pkt = self.slots[slot as usize].as_ref().expect("live slot");
                let taps = self.taps.as_mut().expect("tapped");
                taps.record(port_id, finish, pkt, Some(DropReason::Loss));
            }
            let flow = self.release(slot).flow;
            if !synthetic {
                Flows::drop(&mut self.flows, flow);
            }
        } else {
            if synthetic {
                self.load_in_transit += 1;
            }
            // No overtaking on a link, even if its delay was lowered meanwhile.
            let mut arrive = finish + port.link.delay + port.next_latency;
            if let Some(&(last, _)) = port.transit.back() {
                arrive = arrive.max(last);
            } else {
                self.events.push(Reverse(pack(arrive, port_id.0)));
            }
            port.transit.push_back((arrive, slot));
            self.in_transit += 1;
        }
    }
}

/// Headroom of a switch ingress fed by `link` (see `Fabric::headroom`): what the link
/// carries in two delays and the switch's `latency`, and three of the largest frames.
pub fn headroom_bytes(link: &LinkParams, latency: Duration, l2_overhead: u32) -> u64 {
    let window = link.delay + link.delay + latency;
    let on_wire = link.rate.bps() as u128 * window.as_nanos() as u128 / 8_000_000_000;
    on_wire as u64 + 3 * (MAX_PACKET + l2_overhead as u64)
}

/// A TSO burst at `rate`: what TCP's TSO autosizing hands a real NIC at once, about 1 ms
/// of line rate, at most a 64 KiB super-packet, and at least two frames (which wins with
/// frames above 32 KiB).
fn tso_burst(rate: Bandwidth, mtu: u32) -> u64 {
    (rate.bps() / 8 / 1000).min(64 << 10).max(2 * mtu as u64)
}

impl Port {
    /// Sizes a GPU NIC's flow scheduling to its link rate: a flow sends a TSO burst per
    /// round (`tso_burst`), as a host's fq_codel dequeues a whole super-packet at once; in
    /// a lossy fabric the NIC takes a burst ahead of the wire (its ring: a packet of
    /// another flow waits for that much, as behind a TSO burst), in a lossless one a frame
    /// at a time, so that a pause stops it after the frame it is sending.
    pub(super) fn size_nic(&mut self, mtu: u32, lossless: bool) {
        let burst = tso_burst(self.link.rate, mtu);
        self.nic_ring = if lossless { 0 } else { burst };
        if let Some(fq) = &mut self.fq {
            fq.set_quantum(burst);
        }
    }
}

/// Retires packets that finished by `now`.
#[inline]
pub(super) fn settle(port: &mut Port, now: Instant) {
    while let Some(&(finish, len, flags)) = port.backlog.front() {
        if finish > now {
            break;
        }
        port.backlog.pop_front();
        port.backlog_bytes -= len as u64;
        match (flags & LOST != 0, flags & SYNTHETIC != 0) {
            (true, _) => count_lost(&mut port.counters, flags),
            (false, false) => {
                port.counters.tx_packets += 1;
                port.counters.tx_bytes += len as u64;
            }
            (false, true) => {
                port.counters.load_tx_packets += 1;
                port.counters.load_tx_bytes += len as u64;
            }
        }
    }
}

/// Whether the frame a port starts now is lost on the wire. Independent draws, or with
/// `loss_burst` L above 1 a Gilbert model: a port in a burst loses every frame and leaves
/// it with probability r = 1/L per frame (bursts of L frames on average); out of one it
/// enters one with probability p = loss·r/(1−loss), so a share loss of frames is lost.
/// Where that p would exceed 1 (loss above L/(L+1): a spell without loss lasts a frame at
/// least), p is 1 and the bursts are longer, loss/(1−loss) frames, at the same rate.
#[inline]
fn lose(port: &mut Port) -> bool {
    let (loss, burst) = (port.link.loss, port.link.loss_burst);
    if loss <= 0.0 {
        return false;
    }
    if burst <= 1.0 || loss >= 1.0 {
        return port.rng.next_f64() < loss;
    }
    let odds = loss / (1.0 - loss);
    let (enter, leave) = if odds / burst <= 1.0 {
        (odds / burst, 1.0 / burst)
    } else {
        (1.0, 1.0 / odds)
    };
    let flip = if port.loss_bad { leave } else { enter };
    if port.rng.next_f64() < flip {
        port.loss_bad = !port.loss_bad;
    }
    port.loss_bad
}

/// A packet lost on the wire (`LOST`), counted on its port: a GPU's as a loss drop, a
/// load's among the load's drops.
pub(super) fn count_lost(c: &mut PortCounters, flags: u8) {
    if flags & SYNTHETIC != 0 {
        c.load_drops += 1;
    } else {
        c.drops.add(DropReason::Loss);
    }
}

#[inline]
fn should_mark(port: &mut Port) -> bool {
    let q = port.backlog_bytes;
    match port.queue.ecn {
        None => false,
        Some(Ecn::Step { k }) => q > k.get(),
        Some(Ecn::Red { min, max, p_max }) => {
            if q < min.get() {
                false
            } else if q >= max.get() {
                true
            } else {
                let p = p_max * (q - min.get()) as f64 / (max.get() - min.get()) as f64;
                port.rng.next_f64() < p
            }
        }
    }
}
