//! What the fabric model predicts a collective takes, built from the topology.
//!
//! Each flow (rank → rank, bytes) is `channels` TCP connections, each on one path: the
//! path the fabric's ECMP hash gives the connection's real 5-tuple when the agents have
//! reported their endpoints (`use_paths`), else a path drawn at random as a hash would,
//! predictions then averaging over draws, so collisions count either way.
//!
//! Most algorithms are sequences of phases of concurrent flows (rings stream: see
//! `stream`). A phase lasts as long as its most loaded link needs to carry its bytes,
//! plus the longest path latency:
//!
//!   t(phase) = max over flows (Σ hops: propagation + switch latency + one frame's
//!              serialization, but the slowest hop's) + max over links (bytes on link /
//!              effective rate)
//!
//! (store and forward frame by frame: the slowest hop's frame is in its bytes' time).
//! Pairwise schedules (AllToAll, rhd) and the tree, whose ranks do not move in lockstep,
//! are simulated flow by flow instead (`pairwise`, `tree`, `crate::fluid`).
//!
//! The effective rate is the link rate × TCP payload per frame / wire bytes per frame
//! ((mtu − 52) / (mtu + l2_overhead): 99.0 % for 9000-byte frames, 94.1 % for 1500); a
//! message shorter than a frame pays its frame's headers whole (`wire_load`). The
//! GPUs' TCP acknowledges every second frame, and a short message as the program reads
//! it: those ACKs load the ports of each connection's way back (`ack_load`) — in a
//! ring every link carries one way's data and the other way's ACKs. It is a
//! fabric-and-TCP, loss-free prediction: host software costs are not in it, so
//! measured/predicted above 1 is what the hosts (and the box emulating them) add.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;

use closbox_agents::coll::{auto_choice, hier_shape};
use closbox_agents::schedule;
use closbox_agents::{Algo, Endpoints, Op};
use closbox_fabric::model::{Change, Fabric};
use closbox_fabric::packet::FlowKey;
use closbox_fabric::rng::Rng;
use closbox_fabric::routing::{vertex_latency, PortId, Routes};
use closbox_fabric::{Bandwidth, Duration, HostId, Topology};

use crate::fluid::{self, Dep, Transfer};

/// Bytes per piece the agents pipeline with (`Comm::piece`).
const PIECE: f64 = schedule::PIECE as f64;

pub struct Predictor {
    routes: Routes,
    /// Host index of each rank.
    ranks: Vec<u32>,
    /// Node of each rank.
    nodes: Vec<usize>,
    /// Effective bytes/s of each port.
    cap: Vec<f64>,
    /// Seconds a port adds to a packet's latency besides serializing it (propagation,
    /// the next switch).
    hop_delay: Vec<f64>,
    /// TCP payload of a full frame, and the bytes a frame adds to its payload on the wire
    /// (IP and TCP headers with timestamps, framing).
    frame_payload: f64,
    frame_extra: f64,
    /// TCP connections per pair of ranks: each is hashed onto one path.
    channels: usize,
    /// The path of each connection (from rank, to rank, channel) when known: the one the
    /// fabric's hash gives the connection's real 5-tuple. Otherwise paths are drawn at
    /// random, as a hash would, and predictions average over the draws.
    known: Option<HashMap<(usize, usize, usize), Vec<PortId>>>,
    /// Links down (their ports carry nothing).
    down: Vec<u32>,
    /// Wire rate of each port, bit/s.
    rate: Vec<f64>,
    /// PFC or credits: links are paused as a whole (`fluid::makespan`).
    lossless: bool,
}

impl std::fmt::Debug for Predictor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Predictor")
            .field("ranks", &self.ranks.len())
            .field("channels", &self.channels)
            .field("run_paths", &self.known.is_some())
            .finish()
    }
}

/// Largest AllToAll (in transfers: n(n−1) × channels) simulated flow by flow; larger ones
/// are predicted phase by phase (no overlap between steps: an upper bound).
const FLUID_MAX_TRANSFERS: usize = 4096;

/// A flow: from rank, to rank, bytes.
type Flow = (usize, usize, f64);

impl Predictor {
    pub fn new(topo: &Topology, ranks: Vec<u32>, channels: usize) -> Predictor {
        Predictor::with_links_down(topo, ranks, channels, Vec::new())
    }

    /// On a fabric whose links `down` are down (and whose other changes are in `topo`'s
    /// link parameters): routes converged over the links left, flows rehashed as the
    /// fabric's resilient ECMP does.
    pub fn with_links_down(
        topo: &Topology,
        ranks: Vec<u32>,
        channels: usize,
        down: Vec<u32>,
    ) -> Predictor {
        let routes = Routes::over_live_links(topo, |l| !down.contains(&l));
        let f = &topo.fabric;
        let eff = (f.mtu as f64 - 52.0) / (f.mtu as f64 + f.l2_overhead as f64);
        let (cap, hop_delay) = routes
            .ports
            .iter()
            .map(|p| {
                let link = topo.links[p.link as usize].params;
                let rate = link.rate.bps() as f64;
                let next = vertex_latency(topo, p.to).as_secs_f64();
                (rate / 8.0 * eff, link.delay.as_secs_f64() + next)
            })
            .unzip();
        let nodes = ranks
            .iter()
            .map(|&r| topo.hosts[r as usize].node as usize)
            .collect();
        let rate = routes
            .ports
            .iter()
            .map(|p| topo.links[p.link as usize].params.rate.bps() as f64)
            .collect();
        Predictor {
            routes,
            ranks,
            nodes,
            cap,
            hop_delay,
            frame_payload: f.mtu as f64 - 52.0,
            frame_extra: 52.0 + f.l2_overhead as f64,
            channels: channels.max(1),
            known: None,
            down,
            rate,
            lossless: f.flow_control.pause().is_some(),
        }
    }

    /// Seconds port `p` adds to the latency of a message of `bytes` on one connection:
    /// propagation, the next switch, and its first frame's serialization (store and
    /// forward: a frame leaves a hop only once it has all arrived) — a full frame, or the
    /// whole message when it is shorter.
    fn hop_latency(&self, p: usize, bytes: f64) -> f64 {
        self.hop_delay[p] + self.frame_time(p, bytes)
    }

    /// Seconds port `p` takes to serialize one frame of a message of `bytes`: a full
    /// frame, or the whole message when it is shorter.
    fn frame_time(&self, p: usize, bytes: f64) -> f64 {
        let first = bytes.min(self.frame_payload).max(0.0) + self.frame_extra;
        first * 8.0 / self.rate[p]
    }

    /// Seconds from a message's last byte leaving its source to its arrival over `path`
    /// (store and forward, frame by frame): every hop's delay, and one frame's
    /// serialization at every hop but the slowest, where the message's own transfer time
    /// (its bytes at that rate, which the callers count) already holds it. Counting that
    /// frame again made a single-frame step of a ring on `single-switch-8` one
    /// serialization (12 µs at 1 Gbit/s) too long.
    fn path_latency(&self, path: impl IntoIterator<Item = usize>, bytes: f64) -> f64 {
        let (mut sum, mut slowest) = (0.0, 0.0f64);
        for p in path {
            sum += self.hop_latency(p, bytes);
            slowest = slowest.max(self.frame_time(p, bytes));
        }
        sum - slowest
    }

    /// Port `port` (one direction of a link) at `rate` and `delay` where they differ from
    /// its link's parameters in the topology: a change made in that direction only.
    /// Before `add_background`, which takes a share of what this leaves.
    pub fn set_port_link(&mut self, topo: &Topology, port: u32, rate: Bandwidth, delay: Duration) {
        let p = port as usize;
        if p >= self.cap.len() || rate.bps() == 0 {
            return;
        }
        let f = &topo.fabric;
        let eff = (f.mtu as f64 - 52.0) / (f.mtu as f64 + f.l2_overhead as f64);
        let to = self.routes.port(PortId(port)).to;
        self.rate[p] = rate.bps() as f64;
        self.cap[p] = self.rate[p] / 8.0 * eff;
        self.hop_delay[p] = delay.as_secs_f64() + vertex_latency(topo, to).as_secs_f64();
    }

    /// Background traffic of `bps` on the wire through `port` (a synthetic load): the
    /// collective gets what is left of the port (TCP backs off; the load does not).
    pub fn add_background(&mut self, port: u32, bps: f64) {
        let p = port as usize;
        if p >= self.cap.len() || bps <= 0.0 {
            return;
        }
        let left = ((self.rate[p] - bps) / self.rate[p]).max(1e-3);
        self.cap[p] *= left;
    }

    /// Predicts with the paths this run's connections really take: each agent's
    /// endpoints give the 5-tuples, the fabric's hash gives the paths. Returns false (and
    /// keeps drawing paths at random) unless every connection of every pair is known and
    /// hashed onto a single path (spraying and adaptive switches have none).
    pub fn use_paths(&mut self, topo: &Topology, reports: &[Endpoints]) -> bool {
        let mut fabric = Fabric::new(topo);
        for &l in &self.down {
            fabric.apply(closbox_fabric::Instant::ZERO, Change::LinkDown(l));
        }
        // Converged: every switch knows.
        fabric.advance(closbox_fabric::Instant::from_nanos(1 << 60));
        let n = self.n();
        let mut known = HashMap::new();
        for rep in reports.iter().filter(|r| r.rank < n) {
            for e in &rep.endpoints {
                let (SocketAddr::V4(local), SocketAddr::V4(remote)) = (e.local, e.remote) else {
                    return false;
                };
                let key = FlowKey {
                    src: *local.ip(),
                    dst: *remote.ip(),
                    proto: 6,
                    sport: local.port(),
                    dport: remote.port(),
                };
                let Some(path) = fabric.flow_path(&key) else {
                    return false;
                };
                known.insert((rep.rank, e.peer, e.channel), path);
            }
        }
        if known.len() != n * (n - 1) * self.channels {
            return false;
        }
        self.known = Some(known);
        true
    }

    /// The path of each channel from rank a to rank b: known, or drawn with `rng`.
    fn channel_paths(&self, a: usize, b: usize, rng: &mut Rng) -> Vec<Vec<PortId>> {
        (0..self.channels)
            .map(|ch| match &self.known {
                Some(k) => k[&(a, b, ch)].clone(),
                None => self.sample_path(a, b, rng),
            })
            .collect()
    }

    /// A pair of ranks (from, to) with no route between them over the links up: the
    /// first found, if any. Predictions assume every rank reaches every other.
    pub fn unreachable(&self) -> Option<(usize, usize)> {
        let n = self.n();
        (0..n)
            .flat_map(|a| (0..n).map(move |b| (a, b)))
            .find(|&(a, b)| {
                self.ranks[a] != self.ranks[b]
                    && self
                        .routes
                        .next_hops(self.ranks[a], HostId(self.ranks[b]))
                        .is_empty()
            })
    }

    /// Draws of paths to average over: one when the paths are known.
    fn samples(&self, random: usize) -> usize {
        if self.known.is_some() {
            1
        } else {
            random
        }
    }

    fn n(&self) -> usize {
        self.ranks.len()
    }

    /// Share of a flow a→b on each port (even split over equal-cost next hops).
    fn spread(&self, a: usize, b: usize) -> Vec<(PortId, f64)> {
        let (src, dst) = (self.ranks[a], HostId(self.ranks[b]));
        let mut out = BTreeMap::<PortId, f64>::new();
        let mut layer = BTreeMap::from([(src, 1.0f64)]);
        while !layer.is_empty() {
            let mut next = BTreeMap::new();
            for (v, f) in layer {
                let group = self.routes.next_hops(v, dst);
                for &p in group {
                    let share = f / group.len() as f64;
                    *out.entry(p).or_default() += share;
                    let to = self.routes.port(p).to;
                    if to != dst.0 {
                        *next.entry(to).or_default() += share;
                    }
                }
            }
            layer = next;
        }
        out.into_iter().collect()
    }

    /// Frames a message of `bytes` on one connection is sent in.
    fn frames(&self, bytes: f64) -> f64 {
        (bytes / self.frame_payload).ceil().max(1.0)
    }

    /// What a message of `bytes` on one connection takes of a port, in the bytes `cap`
    /// counts (payload in full frames): its payload and its frames' headers and framing.
    /// A message of full frames takes its bytes; a short one more (128 bytes in one
    /// frame at mtu 1500: 1.6 × 128).
    fn wire_load(&self, bytes: f64) -> f64 {
        if bytes <= 0.0 {
            return 0.0;
        }
        (bytes + self.frames(bytes) * self.frame_extra) * self.frame_payload
            / (self.frame_payload + self.frame_extra)
    }

    /// What the acknowledgements of a message of `bytes` on one connection take of each
    /// port on the connection's way back, in `cap`'s bytes. The GPUs' TCP (Linux)
    /// acknowledges every second full frame at once, and what is left when the program
    /// reads it: a one-frame message gets an ACK of its own, sent as the receiving
    /// program reads it — in a ring, on the NIC just ahead of the piece the program then
    /// forwards. At mtu 1500 ACKs add 2.9 % to a port that also carries data, at 9000 0.5
    /// %; to a ring's step of one frame on `single-switch-8`, one ACK's serialization
    /// (0.72 µs at 1 Gbit/s, measured in the fabric's captures at time_scale 1000).
    fn ack_load(&self, bytes: f64) -> f64 {
        if bytes <= 0.0 {
            return 0.0;
        }
        (self.frames(bytes) / 2.0).ceil() * self.frame_extra * self.frame_payload
            / (self.frame_payload + self.frame_extra)
    }

    /// `ack_load` per byte of `wire_load`: what a transfer's ACKs take on its way back for
    /// each byte it moves (`fluid::Transfer::ack_share`).
    fn ack_share(&self, bytes: f64) -> f64 {
        match self.wire_load(bytes) {
            w if w > 0.0 => self.ack_load(bytes) / w,
            _ => 0.0,
        }
    }

    /// (transfer seconds of the most loaded link, mean path latency) for concurrent flows:
    /// on the known paths, or spread evenly over equal-cost paths. A flow's ACKs load the
    /// ports of its connections' way back.
    fn loads(&self, flows: &[Flow]) -> (f64, f64) {
        self.loads_over(flows, self.channels)
    }

    /// `loads` with each flow on its first `connections` channels only.
    fn loads_over(&self, flows: &[Flow], connections: usize) -> (f64, f64) {
        let mut load = vec![0.0f64; self.cap.len()];
        let (mut lat_sum, mut k) = (0.0, 0);
        for &(a, b, bytes) in flows.iter().filter(|f| f.0 != f.1 && f.2 > 0.0) {
            let per = bytes / connections as f64;
            let (data, acks) = (self.wire_load(per), self.ack_load(per));
            // (port, share of the flow's connections crossing it) there and back.
            let (shares, back) = match &self.known {
                Some(known) => {
                    let (mut shares, mut back) = (Vec::new(), Vec::new());
                    let share = 1.0 / connections as f64;
                    for ch in 0..connections {
                        shares.extend(known[&(a, b, ch)].iter().map(|&p| (p, share)));
                        back.extend(known[&(b, a, ch)].iter().map(|&p| (p, share)));
                    }
                    (shares, back)
                }
                None => (self.spread(a, b), self.spread(b, a)),
            };
            let connections = connections as f64;
            for (p, share) in back {
                load[p.0 as usize] += acks * connections * share;
            }
            let mut slowest = 0.0f64;
            for (p, share) in shares {
                load[p.0 as usize] += data * connections * share;
                lat_sum += share * self.hop_latency(p.0 as usize, per);
                slowest = slowest.max(self.frame_time(p.0 as usize, per));
            }
            // The slowest hop's frame is in the transfer time (`path_latency`).
            lat_sum -= slowest;
            k += 1;
        }
        let transfer = load
            .iter()
            .zip(&self.cap)
            .map(|(l, c)| l / c)
            .fold(0.0, f64::max);
        (transfer, if k > 0 { lat_sum / k as f64 } else { 0.0 })
    }

    /// A streaming ring of `steps` steps, `chunk` bytes each (the agents' ring: a piece
    /// is forwarded as soon as it arrives). Each step starts when the previous one's first
    /// piece has come round (latency) or the link is free (transfer), whichever is later.
    /// Channels are independent pipelines, each with its share of the chunk cut in
    /// pieces: while one waits for its piece to come round, the others use the link, so
    /// a piece moves at the full rate. The last step ends when its chunk has crossed the
    /// link and its last byte come round: a latency-bound ring pays a step's latency
    /// `steps` times, not once more.
    fn stream(&self, members: &[usize], steps: usize, chunk: f64) -> f64 {
        if steps == 0 {
            return 0.0;
        }
        let (transfer, alpha) = self.loads(&self.ring(members, chunk));
        let piece = PIECE.min(chunk / self.channels as f64);
        // One connection's piece: its frames and the ACK ahead of it on the link.
        let (piece_time, _) = self.loads_over(&self.ring(members, piece), 1);
        (steps - 1) as f64 * transfer.max(alpha + piece_time) + transfer + alpha
    }

    /// One path from rank a to rank b, choosing uniformly among equal-cost next hops (what
    /// a seeded per-connection hash does, seen from outside).
    fn sample_path(&self, a: usize, b: usize, rng: &mut Rng) -> Vec<PortId> {
        let (mut v, dst) = (self.ranks[a], HostId(self.ranks[b]));
        let mut path = Vec::new();
        while v != dst.0 {
            let group = self.routes.next_hops(v, dst);
            let p = group[rng.below(group.len() as u32) as usize];
            path.push(p);
            v = self.routes.port(p).to;
        }
        path
    }

    /// Seconds for one phase of concurrent flows. Each flow is `channels` connections,
    /// each hashed onto one equal-cost path; the phase lasts until its most loaded link is
    /// done (plus the longest path latency), averaged over random hash outcomes: ECMP
    /// collisions are part of the prediction.
    fn phase(&self, flows: &[Flow]) -> f64 {
        self.phase_over(flows, self.channels)
    }

    /// `phase` with each flow on its first `connections` channels only.
    fn phase_over(&self, flows: &[Flow], connections: usize) -> f64 {
        let samples = self.samples(32);
        let mut rng = Rng::new(0x5EED, flows.len() as u64);
        let mut total = 0.0;
        for _ in 0..samples {
            let mut load = vec![0.0f64; self.cap.len()];
            let mut latency = 0.0f64;
            for &(a, b, bytes) in flows.iter().filter(|f| f.0 != f.1 && f.2 > 0.0) {
                let per = bytes / connections as f64;
                let (data, acks) = (self.wire_load(per), self.ack_load(per));
                for path in self.channel_paths(a, b, &mut rng).iter().take(connections) {
                    for p in path {
                        load[p.0 as usize] += data;
                    }
                    let lat = self.path_latency(path.iter().map(|p| p.0 as usize), per);
                    latency = latency.max(lat);
                }
                // Their ACKs, on the connections' way back.
                for back in self.channel_paths(b, a, &mut rng).iter().take(connections) {
                    for p in back {
                        load[p.0 as usize] += acks;
                    }
                }
            }
            total += latency
                + load
                    .iter()
                    .zip(&self.cap)
                    .map(|(l, c)| l / c)
                    .fold(0.0, f64::max);
        }
        total / samples as f64
    }

    fn ring(&self, members: &[usize], bytes: f64) -> Vec<Flow> {
        let m = members.len();
        (0..m)
            .map(|i| (members[i], members[(i + 1) % m], bytes))
            .collect()
    }

    /// Predicted seconds (fabric time) for `op` on `size` bytes.
    pub fn predict(&self, op: Op, algo: Algo, size: usize, root: usize) -> f64 {
        let n = self.n();
        if n < 2 {
            return 0.0;
        }
        let s = size as f64;
        let all: Vec<usize> = (0..n).collect();
        match op {
            Op::AllReduce => {
                let algo = match algo {
                    Algo::Auto => auto_choice(size, &self.nodes),
                    a => a,
                };
                match algo {
                    Algo::Tree => self.tree(s),
                    Algo::Rhd => self.rhd(s),
                    Algo::Hier => self.hier(s).unwrap_or_else(|| {
                        self.stream(&all, schedule::ring_steps(n, true, true), s / n as f64)
                    }),
                    Algo::Ring | Algo::Auto => {
                        self.stream(&all, schedule::ring_steps(n, true, true), s / n as f64)
                    }
                }
            }
            Op::AllGather => self.stream(&all, schedule::ring_steps(n, false, true), s / n as f64),
            Op::ReduceScatter => {
                self.stream(&all, schedule::ring_steps(n, true, false), s / n as f64)
            }
            Op::Broadcast | Op::Reduce => {
                // A pipelined chain: every hop carries everything, all at once, plus the
                // time for the first piece to reach the end: each hop's piece time, of
                // which the phase of all hops already paid the longest. Each channel is
                // a chain of its own (its part of the buffer, in pieces), and the channels
                // drift apart: a hop forwards one channel's piece while the next one's
                // still arrives, so a hop's fill is one channel's piece on the link.
                let order = schedule::chain(n, root);
                let hops: Vec<Flow> = order.windows(2).map(|w| (w[0], w[1], s)).collect();
                let piece = PIECE.min(s / self.channels as f64);
                let pieces: Vec<f64> = hops
                    .iter()
                    .map(|&(a, b, _)| self.phase_over(&[(a, b, piece)], 1))
                    .collect();
                let longest = pieces.iter().copied().fold(0.0, f64::max);
                self.phase(&hops) + pieces.iter().sum::<f64>() - longest
            }
            Op::AllToAll => {
                let block = (size / n) as f64;
                if n * (n - 1) * self.channels <= FLUID_MAX_TRANSFERS {
                    self.all_to_all(block)
                } else {
                    schedule::all_to_all_stages(n, block as usize)
                        .iter()
                        .map(|stage| self.phase(&flows(stage)))
                        .sum()
                }
            }
            Op::SendRecv => self.phase(&self.ring(&all, s)),
        }
    }

    /// Pairwise AllToAll as the agents run it: in step k, rank r sends a block to r + k
    /// and receives one from r − k.
    fn all_to_all(&self, block: f64) -> f64 {
        let stages: Vec<Vec<Flow>> = schedule::all_to_all_stages(self.n(), block as usize)
            .iter()
            .map(|stage| flows(stage))
            .collect();
        self.pairwise(&stages)
    }

    /// A schedule of pairwise stages (each rank sends to one peer and receives from one
    /// in a stage, as the agents' `exchange` does), flow by flow: on each channel, a rank
    /// starts its next send once its previous send has left (socket buffers take it) and
    /// its previous receive has arrived (what it sends next depends on it). Channels and
    /// ranks do not wait for each other, so light stages of some ranks overlap heavy
    /// stages of others.
    fn pairwise(&self, stages: &[Vec<Flow>]) -> f64 {
        let (n, chans) = (self.n(), self.channels);
        let samples = self.samples(8);
        let mut rng = Rng::new(0xA2A, n as u64);
        let mut total = 0.0;
        for _ in 0..samples {
            let mut paths: HashMap<(usize, usize), Vec<Vec<PortId>>> = HashMap::new();
            let mut transfers = Vec::new();
            // Per rank and channel: its last send and its last receive.
            let mut last_sent = vec![None; n * chans];
            let mut last_recv = vec![None; n * chans];
            for stage in stages {
                let first = transfers.len();
                for ch in 0..chans {
                    for &(a, b, bytes) in stage.iter().filter(|f| f.0 != f.1) {
                        paths
                            .entry((a, b))
                            .or_insert_with(|| self.channel_paths(a, b, &mut rng));
                        let after = [
                            last_sent[a * chans + ch].map(Dep::Sent),
                            last_recv[a * chans + ch].map(Dep::Arrived),
                        ];
                        let back = &paths
                            .entry((b, a))
                            .or_insert_with(|| self.channel_paths(b, a, &mut rng))[ch];
                        let back: Vec<u32> = back.iter().map(|p| p.0).collect();
                        let path = &paths[&(a, b)][ch];
                        let per = bytes / chans as f64;
                        transfers.push(Transfer {
                            path: path.iter().map(|p| p.0).collect(),
                            bytes: self.wire_load(per),
                            latency: self.path_latency(path.iter().map(|p| p.0 as usize), per),
                            after: after.into_iter().flatten().collect(),
                            ack_path: back,
                            ack_share: self.ack_share(per),
                        });
                    }
                }
                // A stage's own transfers do not wait for each other.
                let mut id = first;
                for ch in 0..chans {
                    for &(a, b, _) in stage.iter().filter(|f| f.0 != f.1) {
                        last_sent[a * chans + ch] = Some(id);
                        last_recv[b * chans + ch] = Some(id);
                        id += 1;
                    }
                }
            }
            total += fluid::makespan(&self.cap, &transfers, self.lossless);
        }
        total / samples as f64
    }

    /// Double binary tree as the agents run it, piece by piece and flow by flow (see
    /// `pairwise`): in each tree (its own channel, `t % channels`; the trees one after
    /// the other on one channel) a rank sends piece k to its parent once piece k has
    /// arrived from each child and its previous send has left; then it takes piece k
    /// from its parent and sends it to each child in turn. A rank that is interior in
    /// one tree is a leaf in the other, and both trees' pieces meet on its links.
    /// Beyond `FLUID_MAX_TRANSFERS` pieces are simulated in fewer, larger ones (more
    /// pipeline fill); beyond that for one piece a tree, phase by phase (`tree_phases`).
    fn tree(&self, s: f64) -> f64 {
        let n = self.n();
        let per_piece = 2 * 2 * (n - 1);
        if per_piece > FLUID_MAX_TRANSFERS {
            return self.tree_phases(s);
        }
        let half = s / 2.0;
        let pieces = ((half / PIECE).ceil() as usize).clamp(1, FLUID_MAX_TRANSFERS / per_piece);
        let piece = half / pieces as f64;
        let samples = self.samples(8);
        let mut rng = Rng::new(0x7EE, n as u64);
        let mut total = 0.0;
        for _ in 0..samples {
            let mut paths: HashMap<(usize, usize), Vec<Vec<PortId>>> = HashMap::new();
            let mut transfers: Vec<Transfer> = Vec::new();
            // What each rank's thread (per channel in use) last waited for: a send (its
            // bytes have left) and the receives since.
            let threads = self.channels.min(2);
            let mut waited: Vec<Vec<Dep>> = vec![Vec::new(); n * threads];
            let mut add = |transfers: &mut Vec<Transfer>,
                           waited: &mut Vec<Vec<Dep>>,
                           (a, b, ch): (usize, usize, usize),
                           after: Vec<Dep>| {
                paths
                    .entry((a, b))
                    .or_insert_with(|| self.channel_paths(a, b, &mut rng));
                let back: Vec<u32> = paths
                    .entry((b, a))
                    .or_insert_with(|| self.channel_paths(b, a, &mut rng))[ch]
                    .iter()
                    .map(|p| p.0)
                    .collect();
                let path = &paths[&(a, b)][ch];
                let id = transfers.len();
                transfers.push(Transfer {
                    path: path.iter().map(|p| p.0).collect(),
                    bytes: self.wire_load(piece),
                    latency: self.path_latency(path.iter().map(|p| p.0 as usize), piece),
                    after,
                    ack_path: back,
                    ack_share: self.ack_share(piece),
                });
                waited[a * threads + ch % threads] = vec![Dep::Sent(id)];
                id
            };
            for t in 0..2 {
                let ch = t % self.channels;
                let links: Vec<_> = (0..n).map(|r| schedule::tree_links(n, t, r)).collect();
                // up[r][k]: rank r's piece k to its parent.
                let mut up = vec![Vec::new(); n];
                // Children before their parents: the heap order, reversed.
                for &r in schedule::tree_order(n, t).iter().rev() {
                    let (parent, children) = &links[r];
                    for k in 0..pieces {
                        let th = r * threads + ch % threads;
                        let mut after = std::mem::take(&mut waited[th]);
                        after.extend(children.iter().map(|&c| Dep::Arrived(up[c][k])));
                        match parent {
                            Some(p) => {
                                let id = add(&mut transfers, &mut waited, (r, *p, ch), after);
                                up[r].push(id);
                            }
                            None => waited[th] = after,
                        }
                    }
                }
                // down[r][k]: piece k as rank r received it from its parent.
                let mut down: Vec<Vec<usize>> = vec![Vec::new(); n];
                for &r in schedule::tree_order(n, t).iter() {
                    let (parent, children) = &links[r];
                    for k in 0..pieces {
                        let th = r * threads + ch % threads;
                        if parent.is_some() {
                            let got = down[r][k];
                            waited[th].push(Dep::Arrived(got));
                        }
                        for &c in children {
                            let after = std::mem::take(&mut waited[th]);
                            let id = add(&mut transfers, &mut waited, (r, c, ch), after);
                            down[c].push(id);
                        }
                    }
                }
            }
            total += fluid::makespan(&self.cap, &transfers, self.lossless);
        }
        total / samples as f64
    }

    /// Double binary tree, phase by phase: both trees reduce half the data up, then
    /// broadcast it down (for fabrics too large to simulate flow by flow).
    fn tree_phases(&self, s: f64) -> f64 {
        let n = self.n();
        let mut up = Vec::new();
        for t in 0..2 {
            for r in 0..n {
                if let (Some(parent), _) = schedule::tree_links(n, t, r) {
                    up.push((r, parent, s / 2.0));
                }
            }
        }
        // A piece crosses `levels − 1` links from a leaf to the root: the phase above
        // pays one of them, the pipeline's fill the others.
        let links = schedule::tree_depth(n).saturating_sub(1);
        let down: Vec<Flow> = up.iter().map(|&(a, b, x)| (b, a, x)).collect();
        let piece = PIECE.min(s / 2.0);
        let fill =
            (links.saturating_sub(1)) as f64 * self.phase_over(&[(up[0].0, up[0].1, piece)], 1);
        self.phase(&up) + self.phase(&down) + 2.0 * fill
    }

    /// Recursive halving-doubling with the fold for non-powers of two, as a pairwise
    /// schedule: fold the first 2·extra ranks, halve (exchanging half of what is owned
    /// with the partner at distance pow/2, pow/4, …), double back, unfold.
    fn rhd(&self, s: f64) -> f64 {
        let stages: Vec<Vec<Flow>> = schedule::Rhd::new(self.n())
            .stages(s as usize)
            .iter()
            .map(|stage| flows(stage))
            .collect();
        self.pairwise(&stages)
    }

    fn hier(&self, s: f64) -> Option<f64> {
        let (nodes, per) = hier_shape(&self.nodes).ok()?;
        if per == 1 {
            // One GPU per node: no intra-node phases, and the inter-node all-reduce is the
            // agents' streaming ring over every rank.
            let all: Vec<usize> = (0..nodes).collect();
            return Some(self.stream(
                &all,
                schedule::ring_steps(nodes, true, true),
                s / nodes as f64,
            ));
        }
        let local: Vec<Flow> = (0..nodes)
            .flat_map(|k| self.ring(&schedule::hier_local_ring(k, per), s / per as f64))
            .collect();
        let cross: Vec<Flow> = (0..per)
            .flat_map(|l| {
                self.ring(
                    &schedule::hier_cross_ring(nodes, per, l),
                    s / (per * nodes) as f64,
                )
            })
            .collect();
        // Reduce-scatter inside the node, all-reduce across, all-gather inside.
        let intra = if per > 1 {
            schedule::ring_steps(per, true, false) as f64 * self.phase(&local)
        } else {
            0.0
        };
        let inter = if nodes > 1 {
            schedule::ring_steps(nodes, true, true) as f64 * self.phase(&cross)
        } else {
            0.0
        };
        Some(2.0 * intra + inter)
    }
}

/// A schedule's stage (`(from, to, bytes)`) as the predictor's flows.
fn flows(stage: &[(usize, usize, usize)]) -> Vec<Flow> {
    stage.iter().map(|&(a, b, x)| (a, b, x as f64)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn topo(body: &str) -> Topology {
        closbox_fabric::parse(
            &format!("[fabric]\nname = \"p\"\nl2_overhead = 0\nmtu = 1552\n{body}"),
            "t",
        )
        .unwrap()
    }

    #[test]
    fn ring_all_reduce_on_a_single_switch_is_textbook() {
        // 1552-byte frames carry 1500 bytes: efficiency 1500/1552; 8 ranks at 1 Gbit/s.
        let t = topo("[topology]\nkind = \"single-switch\"\ngpus = 8\n[links.nic]\nrate = \"1Gbit\"\ndelay = \"0ns\"\n[switches.leaf]\nlatency = \"0ns\"\n");
        let p = Predictor::new(&t, (0..8).collect(), 2);
        let s = 8e6;
        let frame = 1552.0 * 8.0 / 1e9;
        // A rank's link to the switch carries its 1 MB chunk (two connections of 500 KB:
        // 334 frames each, the last short) and the ACKs of the chunk it receives (one per
        // two frames: 167 of 52 bytes per connection); its link from the switch, the
        // same. Streaming: 14 steps of that (transfer-bound), plus one latency: the last
        // frame's second hop (its first is in the transfer time).
        let data = (500e3 + 334.0 * 52.0) * 8.0 / 1e9;
        let acks = 167.0 * 52.0 * 8.0 / 1e9;
        let want = 14.0 * 2.0 * (data + acks) + frame;
        let got = p.predict(Op::AllReduce, Algo::Ring, s as usize, 0);
        assert!((got / want - 1.0).abs() < 1e-9, "{got} vs {want}");
    }

    /// An 8-byte `op` over `ranks` ranks of a fabric whose NIC links are 100 µs long and
    /// fast enough that serialization does not count (`body` sets other tiers alike): its
    /// time is a count of links.
    fn links_crossed(body: &str, ranks: u32, op: Op, algo: Algo) -> f64 {
        let t = topo(&format!("{body}[links.nic]\nrate = \"100Gbit\"\ndelay = \"100us\"\n[switches.leaf]\nlatency = \"0ns\"\n"));
        let p = Predictor::new(&t, (0..ranks).collect(), 1);
        p.predict(op, algo, 8, 0) / 100e-6
    }

    #[test]
    fn a_tiny_tree_all_reduce_pays_its_trees_depth_in_links_both_ways() {
        // 8 ranks: a binary heap of 4 levels, 3 links from the deepest leaf to the root;
        // up then down: 6 GPU-to-GPU paths of 2 links each, the two trees at once (a
        // channel each).
        let single = "[topology]\nkind = \"single-switch\"\ngpus = 8\n";
        let two = |ranks| {
            let t = topo(&format!("{single}[links.nic]\nrate = \"100Gbit\"\ndelay = \"100us\"\n[switches.leaf]\nlatency = \"0ns\"\n"));
            Predictor::new(&t, (0..ranks).collect(), 2).predict(Op::AllReduce, Algo::Tree, 8, 0)
                / 100e-6
        };
        let got = two(8);
        assert!((got / 12.0 - 1.0).abs() < 0.01, "{got} links");
        // On one channel each rank runs tree 1 after its part of tree 0 (the agents' own
        // order): tree 0's last piece reaches rank 7 after 6 paths, and rank 7 is tree 1's
        // root: its children's pieces reach it one path later, then 3 paths down: 10
        // paths, 20 links.
        let got = links_crossed(single, 8, Op::AllReduce, Algo::Tree);
        assert!((got / 20.0 - 1.0).abs() < 0.01, "{got} links");
    }

    #[test]
    fn a_large_tree_all_reduce_is_held_by_its_busiest_links() {
        // 8 ranks on one switch, 2 channels (the trees at once): a rank interior in one
        // tree takes s/2 from each of two children and s/2 from its parent, and as a leaf
        // of the other s/2 more: 2s on its link from the switch. Pieces pipeline, so the
        // prediction is that link's time and some fill.
        let t =
            topo("[topology]\nkind = \"single-switch\"\ngpus = 8\n[links.nic]\nrate = \"1Gbit\"\n");
        let p = Predictor::new(&t, (0..8).collect(), 2);
        let s = 16 << 20;
        // (`topo`: mtu 1552, no framing.)
        let cap = 1e9 / 8.0 * (1552.0 - 52.0) / 1552.0;
        let bound = 2.0 * s as f64 / cap;
        let got = p.predict(Op::AllReduce, Algo::Tree, s, 0);
        assert!(
            got > bound && got < 1.2 * bound,
            "{got} s against {bound} s"
        );
    }

    #[test]
    fn a_tiny_broadcast_pays_every_hop_of_its_chain_once() {
        // 2 leaves × 2 GPUs: the chain gpu0 → gpu1 (one leaf: 2 links) → gpu2 (across a
        // spine: 4 links) → gpu3 (2 links), 8 links in all.
        let ls = "[topology]\nkind = \"leaf-spine\"\nleaves = 2\nspines = 1\ngpus_per_leaf = 2\n[links.leaf-spine]\nrate = \"100Gbit\"\ndelay = \"100us\"\n[switches.spine]\nlatency = \"0ns\"\n";
        let got = links_crossed(ls, 4, Op::Broadcast, Algo::Auto);
        assert!((got / 8.0 - 1.0).abs() < 0.01, "{got} links");
    }

    #[test]
    fn a_ring_of_single_frames_pays_store_and_forward_once_per_step() {
        // 8 ranks on one switch, one channel, AllGather of 1,000-byte chunks (a frame
        // each): every step is the frame serialized on both links, both delays and the
        // switch, and the ACK of the frame a rank received, which its TCP sends as the
        // agent reads it, just ahead of the frame it forwards — exactly; the steps follow
        // one another. The first link's serialization was counted twice per step (as the
        // transfer and in the path's latency), and a step's latency once more at the end:
        // 1.44 × this. (Captured on `single-switch-8` at time_scale 1000: a step of 128
        // bytes took 15.28 µs, 2 frames of 1.744, the ACK's 0.72, 11 µs, and 0.075 of the
        // box's wall time.)
        let t = topo("[topology]\nkind = \"single-switch\"\ngpus = 8\n[links.nic]\nrate = \"1Gbit\"\ndelay = \"5us\"\n[switches.leaf]\nlatency = \"1us\"\n");
        let p = Predictor::new(&t, (0..8).collect(), 1);
        let frame = (1000.0 + 52.0) * 8.0 / 1e9;
        let ack = 52.0 * 8.0 / 1e9;
        let step = 2.0 * frame + ack + 2.0 * 5e-6 + 1e-6;
        let got = p.predict(Op::AllGather, Algo::Auto, 8000, 0);
        assert!(
            (got / (7.0 * step) - 1.0).abs() < 1e-9,
            "{got} vs {}",
            7.0 * step
        );
    }

    #[test]
    fn a_spine_down_is_predicted_as_the_capacity_left() {
        // 2 leaves × 4 GPUs, 4 spines at the NIC rate: 1:1. With spine0's links down,
        // each leaf has 3 uplinks for 4 GPUs: an all-to-all slows where all four cross.
        let t = topo("[topology]\nkind = \"leaf-spine\"\nleaves = 2\nspines = 4\ngpus_per_leaf = 4\n[links.nic]\nrate = \"1Gbit\"\n[links.leaf-spine]\nrate = \"1Gbit\"\n");
        let spine0 = t.hosts.len() as u32
            + t.switches.iter().position(|s| s.name == "spine0").unwrap() as u32;
        let routes = Routes::new(&t);
        let down: Vec<u32> = routes
            .ports
            .iter()
            .filter(|p| p.to == spine0)
            .map(|p| p.link)
            .collect();
        assert_eq!(down.len(), 2);
        let s = 8 << 20;
        let healthy = Predictor::new(&t, (0..8).collect(), 8);
        let degraded = Predictor::with_links_down(&t, (0..8).collect(), 8, down);
        let slower = degraded.predict(Op::AllToAll, Algo::Auto, s, 0)
            / healthy.predict(Op::AllToAll, Algo::Auto, s, 0);
        // Only the step where all four cross at once needs more than three uplinks.
        assert!(slower > 1.02, "{slower}");
        // No path crosses a dead link.
        for a in 0..8 {
            for b in 0..8 {
                if a != b {
                    let mut rng = Rng::new(1, 1);
                    let path = degraded.sample_path(a, b, &mut rng);
                    assert!(path.iter().all(|p| degraded.routes.port(*p).to != spine0));
                }
            }
        }
    }

    #[test]
    fn hier_on_single_gpu_nodes_is_the_ring() {
        // The agents' hier with one GPU per node is a streaming ring over all ranks.
        let t =
            topo("[topology]\nkind = \"leaf-spine\"\nleaves = 2\nspines = 2\ngpus_per_leaf = 4\n");
        let p = Predictor::new(&t, (0..8).collect(), 2);
        for s in [1 << 16, 4 << 20, 64 << 20] {
            let ring = p.predict(Op::AllReduce, Algo::Ring, s, 0);
            let hier = p.predict(Op::AllReduce, Algo::Hier, s, 0);
            assert!(
                (hier / ring - 1.0).abs() < 1e-9,
                "{s}: hier {hier} ring {ring}"
            );
        }
    }

    #[test]
    fn oversubscription_slows_all_to_all_but_not_the_ring() {
        let ls = |spines: u32| {
            topo(&format!("[topology]\nkind = \"leaf-spine\"\nleaves = 2\nspines = {spines}\ngpus_per_leaf = 6\n[links.nic]\nrate = \"1Gbit\"\n[links.leaf-spine]\nrate = \"1Gbit\"\n"))
        };
        let (full, over) = (ls(6), ls(2));
        let (pf, po) = (
            Predictor::new(&full, (0..12).collect(), 16),
            Predictor::new(&over, (0..12).collect(), 16),
        );
        let s = 12 << 20;
        let ring = po.predict(Op::AllReduce, Algo::Ring, s, 0)
            / pf.predict(Op::AllReduce, Algo::Ring, s, 0);
        let a2a =
            po.predict(Op::AllToAll, Algo::Auto, s, 0) / pf.predict(Op::AllToAll, Algo::Auto, s, 0);
        // The ring crosses each leaf's uplinks once per direction: 2 flows on 2 uplinks.
        assert!((ring - 1.0).abs() < 0.01, "ring {ring}");
        // All-to-all: in step k, min(k, 12 − k) flows leave each leaf over 2 uplinks. In
        // lockstep that is Σ max(1, c/2) = 19 block times against 11 without
        // oversubscription; ranks that move on as soon as they can overlap light and heavy
        // steps, down to 36 leaf-crossing blocks over 2 uplinks = 18. (With 16 channels,
        // hashing spreads flows almost evenly.)
        assert!(
            (18.0 / 11.0 - 0.02..19.0 / 11.0 + 0.02).contains(&a2a),
            "alltoall {a2a}"
        );
    }

    #[test]
    fn a_lossless_fabric_holds_a_sources_transfers_to_its_slowest() {
        // The 3:1 AllToAll of `configs/roce-3to1.toml`, lossy and with PFC: a GPU whose
        // leaf-crossing block is held back at the uplinks holds back its same-leaf block
        // with it (10 % slower at 8 MiB, for random paths). A ring, whose every source sends
        // to one peer at a time, is predicted as before.
        let fabric = |fc: &str| {
            closbox_fabric::parse(
                &format!(
                    "[fabric]\nname = \"p\"\nmtu = 9000\nflow_control = \"{fc}\"\n\
                     [topology]\nkind = \"leaf-spine\"\nleaves = 2\nspines = 2\ngpus_per_leaf = 6\n\
                     [links.nic]\nrate = \"400Gbit\"\n[links.leaf-spine]\nrate = \"400Gbit\"\n"
                ),
                "t",
            )
            .unwrap()
        };
        let (lossy, pfc) = (
            Predictor::new(&fabric("none"), (0..12).collect(), 2),
            Predictor::new(&fabric("pfc"), (0..12).collect(), 2),
        );
        let s = 8 << 20;
        let a2a = pfc.predict(Op::AllToAll, Algo::Auto, s, 0)
            / lossy.predict(Op::AllToAll, Algo::Auto, s, 0);
        assert!((1.03..1.15).contains(&a2a), "alltoall pfc / lossy {a2a}");
        let ring = pfc.predict(Op::AllReduce, Algo::Ring, s, 0)
            / lossy.predict(Op::AllReduce, Algo::Ring, s, 0);
        assert!((ring - 1.0).abs() < 1e-9, "ring pfc / lossy {ring}");
    }

    /// Endpoints for every connection of `n` ranks on hosts 0..n, each with a source port
    /// that the fabric hashes through spine `spine(a, b, ch)`.
    fn endpoints_via(
        t: &Topology,
        n: usize,
        channels: usize,
        spine: impl Fn(usize, usize, usize) -> usize,
    ) -> Vec<Endpoints> {
        let f = Fabric::new(t);
        let h = t.hosts.len() as u32;
        (0..n)
            .map(|a| Endpoints {
                rank: a,
                endpoints: (0..n)
                    .filter(|&b| b != a)
                    .flat_map(|b| (0..channels).map(move |ch| (b, ch)))
                    .map(|(b, ch)| {
                        let (src, dst) = (t.hosts[a].addr, t.hosts[b].addr);
                        let want = h + spine(a, b, ch) as u32;
                        let sport = (40_000u16..)
                            .find(|&sport| {
                                let key = FlowKey {
                                    src,
                                    dst,
                                    proto: 6,
                                    sport,
                                    dport: 29600,
                                };
                                let path = f.flow_path(&key).unwrap();
                                // Crossing leaves: host, leaf, spine, leaf. Within a
                                // leaf, any port will do.
                                path.len() < 4 || f.routes().port(path[1]).to == want
                            })
                            .unwrap();
                        closbox_agents::Endpoint {
                            peer: b,
                            channel: ch,
                            local: SocketAddr::from((src, sport)),
                            remote: SocketAddr::from((dst, 29600)),
                        }
                    })
                    .collect(),
            })
            .collect()
    }

    #[test]
    fn predictions_follow_the_paths_the_run_got() {
        let t = topo("[topology]\nkind = \"leaf-spine\"\nleaves = 2\nspines = 2\ngpus_per_leaf = 6\n[links.nic]\nrate = \"1Gbit\"\n[links.leaf-spine]\nrate = \"1Gbit\"\n");
        let s = 12 << 20;
        let predict = |eps: &[Endpoints]| {
            let mut p = Predictor::new(&t, (0..12).collect(), 2);
            assert!(p.use_paths(&t, eps));
            p.predict(Op::AllToAll, Algo::Auto, s, 0)
        };
        // Each channel on its own spine: even. Every connection on spine 0: one uplink
        // per leaf carries all 36 leaf-crossing blocks, twice the even time or nearly.
        let even = predict(&endpoints_via(&t, 12, 2, |_, _, ch| ch));
        let piled = predict(&endpoints_via(&t, 12, 2, |_, _, _| 0));
        assert!(piled / even > 1.7, "{piled} vs {even}");
        // Known paths or none: a missing rank means drawing paths at random.
        let mut eps = endpoints_via(&t, 12, 2, |_, _, ch| ch);
        eps.pop();
        let mut p = Predictor::new(&t, (0..12).collect(), 2);
        assert!(!p.use_paths(&t, &eps));
    }
}
