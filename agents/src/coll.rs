//! Collective operations on real data over a `Group`.
//!
//! Every operation splits its buffer over the group's channels (parallel TCP connections,
//! one thread each) and moves data in pieces, so that receiving, reducing and forwarding
//! overlap. Sizes need not divide by the rank or channel count: blocks are balanced
//! partitions of whole elements.
//!
//! AllReduce algorithms: `ring` (reduce-scatter + all-gather, 2(n−1) steps of S/n),
//! `tree` (double binary tree: two trees, each reducing and broadcasting half the data,
//! a rank interior in at most one of them), `rhd` (Rabenseifner's recursive halving then
//! doubling, with the usual fold for non-powers of two), `hier` (intra-node
//! reduce-scatter → inter-node all-reduce per local rank → intra-node all-gather).

use std::ops::Range;

use anyhow::{bail, Context};

use crate::comm::Group;
use crate::dtype::{reduce_into, scale, DType, ReduceOp};

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    AllReduce,
    Broadcast,
    Reduce,
    AllGather,
    ReduceScatter,
    AllToAll,
    SendRecv,
}

impl Op {
    pub const ALL: [Op; 7] = [
        Op::AllReduce,
        Op::Broadcast,
        Op::Reduce,
        Op::AllGather,
        Op::ReduceScatter,
        Op::AllToAll,
        Op::SendRecv,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "allreduce",
            Op::Broadcast => "broadcast",
            Op::Reduce => "reduce",
            Op::AllGather => "allgather",
            Op::ReduceScatter => "reducescatter",
            Op::AllToAll => "alltoall",
            Op::SendRecv => "sendrecv",
        }
    }

    pub fn from_name(s: &str) -> Option<Op> {
        Op::ALL.into_iter().find(|o| o.name() == s)
    }

    /// nccl-tests' bus bandwidth factor for `n` ranks.
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Op::AllReduce => 2.0 * (n - 1.0) / n,
            Op::AllGather | Op::ReduceScatter | Op::AllToAll => (n - 1.0) / n,
            Op::Broadcast | Op::Reduce | Op::SendRecv => 1.0,
        }
    }

    /// Whether the operation reduces (has a meaningful reduction operator).
    pub fn reduces(self) -> bool {
        matches!(self, Op::AllReduce | Op::Reduce | Op::ReduceScatter)
    }

    /// Whether the operation has a root rank.
    pub fn rooted(self) -> bool {
        matches!(self, Op::Broadcast | Op::Reduce)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Algo {
    Auto,
    Ring,
    Tree,
    Rhd,
    Hier,
}

impl Algo {
    pub fn name(self) -> &'static str {
        match self {
            Algo::Auto => "auto",
            Algo::Ring => "ring",
            Algo::Tree => "tree",
            Algo::Rhd => "rhd",
            Algo::Hier => "hier",
        }
    }

    pub fn from_name(s: &str) -> Option<Algo> {
        [Algo::Auto, Algo::Ring, Algo::Tree, Algo::Rhd, Algo::Hier]
            .into_iter()
            .find(|a| a.name() == s)
    }
}

/// `auto`: latency-bound sizes take the tree (log n steps), mid sizes halving-doubling,
/// large sizes the ring (bandwidth-optimal), or the hierarchical ring when the ranks span
/// several multi-GPU nodes of equal size (`nodes`: node of each rank).
pub fn auto_choice(bytes: usize, nodes: &[usize]) -> Algo {
    if bytes < 64 << 10 {
        Algo::Tree
    } else if bytes < 1 << 20 {
        Algo::Rhd
    } else if hier_shape(nodes).is_ok_and(|(k, per)| k > 1 && per > 1) {
        Algo::Hier
    } else {
        Algo::Ring
    }
}

/// (nodes, ranks per node) when every node has the same number of ranks and each node's
/// ranks are consecutive.
pub fn hier_shape(nodes: &[usize]) -> anyhow::Result<(usize, usize)> {
    let n = nodes.len();
    let mut distinct: Vec<usize> = nodes.to_vec();
    distinct.dedup();
    let mut sorted = distinct.clone();
    sorted.sort_unstable();
    sorted.dedup();
    if n == 0 || sorted.len() != distinct.len() {
        bail!("hier needs the ranks of each node to be consecutive");
    }
    let per = n / distinct.len();
    if per * distinct.len() != n
        || distinct
            .iter()
            .any(|d| nodes.iter().filter(|x| *x == d).count() != per)
    {
        bail!("hier needs the same number of ranks on every node");
    }
    Ok((distinct.len(), per))
}

pub use crate::schedule::part;
use crate::schedule::{self, Rhd};

/// Elements of block `i` when `count` elements are cut into `n` blocks (all-gather,
/// reduce-scatter: rank i's block).
pub fn elem_range(count: usize, n: usize, i: usize) -> Range<usize> {
    part(count, n, i)
}

/// A byte range of `count` elements' `i`-th of `n` parts.
fn elem_part(dtype: DType, base: usize, count: usize, n: usize, i: usize) -> Range<usize> {
    let r = part(count, n, i);
    (base + r.start * dtype.size())..(base + r.end * dtype.size())
}

/// `(&buf[a], &mut buf[b])` for disjoint ranges.
fn split2(buf: &mut [u8], a: Range<usize>, b: Range<usize>) -> (&[u8], &mut [u8]) {
    assert!(
        a.end <= b.start || b.end <= a.start,
        "overlapping ranges {a:?} {b:?}"
    );
    if a.end <= b.start {
        let (x, y) = buf.split_at_mut(b.start);
        (&x[a], &mut y[..b.end - b.start])
    } else {
        let (x, y) = buf.split_at_mut(a.start);
        let out = &y[..a.end - a.start];
        (out, &mut x[b])
    }
}

/// Cuts `buf` (`count` elements) into `blocks` balanced blocks, each into `ch` balanced
/// parts; returns, per channel, its part of every block (disjoint slices).
fn carve(
    buf: &mut [u8],
    dtype: DType,
    count: usize,
    blocks: usize,
    ch: usize,
) -> Vec<Vec<&mut [u8]>> {
    let mut out: Vec<Vec<&mut [u8]>> = (0..ch).map(|_| Vec::with_capacity(blocks)).collect();
    let mut rest = buf;
    for b in 0..blocks {
        let blk = part(count, blocks, b);
        let n_el = blk.end - blk.start;
        for (c, o) in out.iter_mut().enumerate() {
            let len = part(n_el, ch, c).len() * dtype.size();
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(len);
            o.push(head);
            rest = tail;
        }
    }
    out
}

/// The collectives of one rank.
#[derive(Debug)]
pub struct Comm<'g> {
    pub g: &'g Group,
    /// Node (scale-up domain) of each rank, for `hier`.
    pub nodes: Vec<usize>,
    /// Bytes moved per piece (pipelining granularity).
    pub piece: usize,
}

impl<'g> Comm<'g> {
    pub fn new(g: &'g Group, nodes: Vec<usize>) -> Self {
        Comm {
            g,
            nodes,
            piece: schedule::PIECE,
        }
    }

    fn n(&self) -> usize {
        self.g.size()
    }

    fn r(&self) -> usize {
        self.g.rank()
    }

    /// Runs `f(channel, parts)` for each channel in parallel, where `parts` is the
    /// channel's share of each of `blocks` balanced element blocks of `buf`.
    fn per_channel(
        &self,
        buf: &mut [u8],
        dtype: DType,
        blocks: usize,
        f: impl Fn(usize, Vec<&mut [u8]>) -> anyhow::Result<()> + Sync,
    ) -> anyhow::Result<()> {
        let count = buf.len() / dtype.size();
        let ch = schedule::channels_for(count, self.g.channels());
        let mut parts = carve(buf, dtype, count, blocks, ch);
        // The last channel runs on this thread: a thread fewer to start per collective,
        // which for a short message costs more wall time than its transfer.
        let last = parts.pop().expect("channels");
        std::thread::scope(|s| {
            let f = &f;
            let handles: Vec<_> = parts
                .into_iter()
                .enumerate()
                .map(|(c, p)| s.spawn(move || f(c, p)))
                .collect();
            let here = f(ch - 1, last);
            handles
                .into_iter()
                .map(|h| h.join().expect("channel thread"))
                .collect::<anyhow::Result<Vec<()>>>()
                .map(drop)
                .and(here)
        })
    }

    // ---- ring primitives over a subset of ranks -------------------------------------

    /// Streaming ring: reduce-scatter (with `reduce`) and/or all-gather among `members`,
    /// moving pieces instead of whole steps. A piece received and reduced in one step is
    /// exactly what the next step sends, so it is forwarded at once: every link carries a
    /// continuous stream and the per-step latency is paid once, not 2(n−1) times.
    fn ring_stream(
        &self,
        members: &[usize],
        ch: usize,
        chunks: &mut [&mut [u8]],
        dtype: DType,
        reduce: Option<ReduceOp>,
        all_gather: bool,
    ) -> anyhow::Result<()> {
        let m = members.len();
        if m == 1 {
            return Ok(());
        }
        let p = members.iter().position(|&x| x == self.r()).expect("member");
        let (next, prev) = (members[(p + 1) % m], members[(p + m - 1) % m]);
        let piece = (self.piece / dtype.size()).max(1) * dtype.size();
        std::thread::scope(|s| {
            let mut out = Forward::new(self.g, next, ch);
            let received = (|| -> anyhow::Result<()> {
                let first = if reduce.is_some() { (p + m - 1) % m } else { p };
                for part in chunks[first].chunks(piece) {
                    if !out.send(s, part)? {
                        return Ok(()); // the sender failed: its error is reported
                    }
                }
                if let Some(op) = reduce {
                    // A piece at most, and no larger than the largest chunk: a short
                    // collective does not map and zero a whole piece's pages.
                    let longest = chunks.iter().map(|c| c.len()).max().unwrap_or(0);
                    let mut tmp = vec![0u8; piece.min(longest)];
                    for step in 0..m - 1 {
                        let c = (p + 2 * m - step - 2) % m;
                        let forward = step < m - 2 || all_gather;
                        let chunk = &mut *chunks[c];
                        let mut off = 0;
                        while off < chunk.len() {
                            let end = (off + piece).min(chunk.len());
                            let t = &mut tmp[..end - off];
                            self.g.recv(prev, ch, t)?;
                            reduce_into(dtype, op, &mut chunk[off..end], t);
                            if forward && !out.send(s, &chunk[off..end])? {
                                return Ok(());
                            }
                            off = end;
                        }
                    }
                }
                if all_gather {
                    for step in 0..m - 1 {
                        let c = (p + 2 * m - step - 1) % m;
                        let forward = step < m - 2;
                        let chunk = &mut *chunks[c];
                        let mut off = 0;
                        while off < chunk.len() {
                            let end = (off + piece).min(chunk.len());
                            self.g.recv(prev, ch, &mut chunk[off..end])?;
                            if forward && !out.send(s, &chunk[off..end])? {
                                return Ok(());
                            }
                            off = end;
                        }
                    }
                }
                Ok(())
            })();
            if received.is_err() {
                // Unblock the sender if the next rank is gone or stuck.
                let _ = self.g.shutdown(next, ch);
            }
            received.and(out.finish())
        })
    }

    // ---- AllReduce --------------------------------------------------------------------

    /// In-place all-reduce of `buf` (whole elements of `dtype`).
    pub fn all_reduce(
        &self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        algo: Algo,
    ) -> anyhow::Result<()> {
        let count = buf.len() / dtype.size();
        let algo = match algo {
            Algo::Auto => self.auto_algo(buf.len()),
            a => a,
        };
        if self.n() > 1 && count > 0 {
            match algo {
                Algo::Ring | Algo::Auto => self.ring_all(buf, dtype, Some(op), true)?,
                Algo::Tree => self.all_reduce_tree(buf, dtype, op, count)?,
                Algo::Rhd => self.all_reduce_rhd(buf, dtype, op)?,
                Algo::Hier => self.all_reduce_hier(buf, dtype, op)?,
            }
        }
        if op == ReduceOp::Avg {
            scale(dtype, buf, self.n());
        }
        Ok(())
    }

    /// The algorithm `auto` picks for this group (see `auto_choice`).
    pub fn auto_algo(&self, bytes: usize) -> Algo {
        auto_choice(bytes, &self.nodes)
    }

    /// The streaming ring over all ranks: reduce-scatter (with `reduce`) and/or
    /// all-gather, on every channel.
    fn ring_all(
        &self,
        buf: &mut [u8],
        dtype: DType,
        reduce: Option<ReduceOp>,
        all_gather: bool,
    ) -> anyhow::Result<()> {
        let members: Vec<usize> = (0..self.n()).collect();
        self.per_channel(buf, dtype, self.n(), |ch, mut chunks| {
            self.ring_stream(&members, ch, &mut chunks, dtype, reduce, all_gather)
        })
    }

    fn all_reduce_tree(
        &self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        count: usize,
    ) -> anyhow::Result<()> {
        let n = self.n();
        let split = part(count, 2, 0).end * dtype.size();
        let (h0, h1) = buf.split_at_mut(split);
        let run = |t: usize, buf: &mut [u8]| -> anyhow::Result<()> {
            let (parent, children) = schedule::tree_links(n, t, self.r());
            let ch = t % self.g.channels();
            let mut tmp = vec![0u8; self.piece.min(buf.len())];
            let pieces = buf.len().div_ceil(self.piece.max(1)).max(1);
            for k in 0..pieces {
                let r = (k * self.piece)..((k + 1) * self.piece).min(buf.len());
                for &c in &children {
                    let t = &mut tmp[..r.len()];
                    self.g.recv(c, ch, t)?;
                    reduce_into(dtype, op, &mut buf[r.clone()], t);
                }
                if let Some(p) = parent {
                    self.g.send(p, ch, &buf[r])?;
                }
            }
            for k in 0..pieces {
                let r = (k * self.piece)..((k + 1) * self.piece).min(buf.len());
                if let Some(p) = parent {
                    self.g.recv(p, ch, &mut buf[r.clone()])?;
                }
                for &c in &children {
                    self.g.send(c, ch, &buf[r.clone()])?;
                }
            }
            Ok(())
        };
        if self.g.channels() >= 2 {
            std::thread::scope(|s| {
                let h = s.spawn(|| run(1, h1));
                let a = run(0, h0);
                a.and(h.join().expect("tree thread"))
            })
        } else {
            run(0, h0)?;
            run(1, h1)
        }
    }

    fn all_reduce_rhd(&self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> anyhow::Result<()> {
        self.per_channel(buf, dtype, 1, |ch, mut parts| {
            self.rhd(ch, parts[0], dtype, op)
        })
    }

    /// Recursive halving-doubling on one channel's contiguous region.
    fn rhd(&self, ch: usize, buf: &mut [u8], dtype: DType, op: ReduceOp) -> anyhow::Result<()> {
        let r = self.r();
        let plan = Rhd::new(self.n());
        let count = buf.len() / dtype.size();
        let bytes = |e: &Range<usize>| (e.start * dtype.size())..(e.end * dtype.size());
        // Fold: among the first 2·extra ranks, odd ones take their even neighbour's data.
        let mut tmp = vec![0u8; buf.len()];
        let vrank = plan.virtual_rank(r);
        if r < 2 * plan.extra {
            if vrank.is_none() {
                self.g.send(r + 1, ch, buf)?;
            } else {
                self.g.recv(r - 1, ch, &mut tmp)?;
                reduce_into(dtype, op, buf, &tmp);
            }
        }
        if let Some(v) = vrank {
            let steps = plan.halving(v, count);
            // Halving: send the half given, reduce the half kept.
            for h in &steps {
                let (out, acc) = split2(buf, bytes(&h.give), bytes(&h.keep));
                let t = &mut tmp[..acc.len()];
                self.g.exchange(
                    ch,
                    (plan.real(h.partner), out),
                    (plan.real(h.partner), t),
                    self.piece,
                    |off, piece| reduce_into(dtype, op, &mut acc[off..off + piece.len()], piece),
                )?;
            }
            // Doubling: retrace the steps, sending what is owned, receiving the rest.
            for h in steps.iter().rev() {
                let (out, inp) = split2(buf, bytes(&h.keep), bytes(&h.give));
                self.g.exchange(
                    ch,
                    (plan.real(h.partner), out),
                    (plan.real(h.partner), inp),
                    self.piece,
                    |_, _| {},
                )?;
            }
        }
        // Unfold: even ranks of the fold get the result back.
        if r < 2 * plan.extra {
            if r % 2 == 1 {
                self.g.send(r - 1, ch, buf)?;
            } else {
                self.g.recv(r + 1, ch, buf)?;
            }
        }
        Ok(())
    }

    fn hier_shape(&self) -> anyhow::Result<(usize, usize)> {
        if self.nodes.len() != self.n() {
            bail!(
                "hier needs the node of every rank ({} given for {} ranks)",
                self.nodes.len(),
                self.n()
            );
        }
        hier_shape(&self.nodes)
    }

    fn all_reduce_hier(&self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> anyhow::Result<()> {
        let (nodes, per) = self.hier_shape().context("algorithm hier")?;
        let r = self.r();
        let (node, local) = (r / per, r % per);
        let local_ring = schedule::hier_local_ring(node, per);
        let cross_ring = schedule::hier_cross_ring(nodes, per, local);
        self.per_channel(buf, dtype, per, |ch, mut chunks| {
            // 1. Intra-node reduce-scatter: local rank l owns chunks[l].
            self.ring_stream(&local_ring, ch, &mut chunks, dtype, Some(op), false)?;
            // 2. Inter-node all-reduce of the owned shard among equal local ranks.
            {
                let mine = &mut *chunks[local];
                let n_el = mine.len() / dtype.size();
                let mut sub = carve(mine, dtype, n_el, nodes, 1)
                    .pop()
                    .expect("one channel");
                self.ring_stream(&cross_ring, ch, &mut sub, dtype, Some(op), true)?;
            }
            // 3. Intra-node all-gather.
            self.ring_stream(&local_ring, ch, &mut chunks, dtype, None, true)
        })
    }

    // ---- the other collectives ---------------------------------------------------------

    /// Pipelined chain from `root` through the ranks in order.
    pub fn broadcast(&self, buf: &mut [u8], dtype: DType, root: usize) -> anyhow::Result<()> {
        let n = self.n();
        if n == 1 || buf.is_empty() {
            return Ok(());
        }
        let (prev, next) = schedule::chain_links(n, root, self.r());
        self.per_channel(buf, dtype, 1, |ch, mut parts| {
            let buf = &mut *parts[0];
            for k in 0..buf.len().div_ceil(self.piece).max(1) {
                let r = (k * self.piece)..((k + 1) * self.piece).min(buf.len());
                if let Some(prev) = prev {
                    self.g.recv(prev, ch, &mut buf[r.clone()])?;
                }
                if let Some(next) = next {
                    self.g.send(next, ch, &buf[r])?;
                }
            }
            Ok(())
        })
    }

    /// Pipelined chain toward `root`: the rank after the root in order ends the chain.
    pub fn reduce(
        &self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        root: usize,
    ) -> anyhow::Result<()> {
        let n = self.n();
        if n > 1 && !buf.is_empty() {
            // The chain from the root, walked backwards: data flows toward the root.
            let (prev, next) = schedule::chain_links(n, root, self.r());
            self.per_channel(buf, dtype, 1, |ch, mut parts| {
                let buf = &mut *parts[0];
                let mut tmp = vec![0u8; self.piece.min(buf.len())];
                for k in 0..buf.len().div_ceil(self.piece).max(1) {
                    let r = (k * self.piece)..((k + 1) * self.piece).min(buf.len());
                    if let Some(next) = next {
                        let t = &mut tmp[..r.len()];
                        self.g.recv(next, ch, t)?;
                        reduce_into(dtype, op, &mut buf[r.clone()], t);
                    }
                    if let Some(prev) = prev {
                        self.g.send(prev, ch, &buf[r])?;
                    }
                }
                Ok(())
            })?;
        }
        if op == ReduceOp::Avg && self.r() == root {
            scale(dtype, buf, n);
        }
        Ok(())
    }

    /// Ring all-gather: rank i contributes block i of `buf` (blocks: balanced partition).
    pub fn all_gather(&self, buf: &mut [u8], dtype: DType) -> anyhow::Result<()> {
        self.ring_all(buf, dtype, None, true)
    }

    /// Ring reduce-scatter: afterwards rank i holds the reduced block i of `buf`.
    pub fn reduce_scatter(&self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> anyhow::Result<()> {
        let n = self.n();
        self.ring_all(buf, dtype, Some(op), false)?;
        if op == ReduceOp::Avg {
            let mine = elem_part(dtype, 0, buf.len() / dtype.size(), n, self.r());
            scale(dtype, &mut buf[mine], n);
        }
        Ok(())
    }

    /// Pairwise exchange: block j of `send` goes to rank j, arriving as block `self` of
    /// its `recv`. Blocks hold ⌊count / n⌋ elements; a remainder is not sent (as in
    /// nccl-tests, whose all-to-all sizes are multiples of the rank count).
    pub fn all_to_all(&self, send: &[u8], recv: &mut [u8], dtype: DType) -> anyhow::Result<()> {
        let (n, r) = (self.n(), self.r());
        assert_eq!(send.len(), recv.len());
        let block = send.len() / dtype.size() / n;
        let bytes = block * dtype.size();
        recv[r * bytes..(r + 1) * bytes].copy_from_slice(&send[r * bytes..(r + 1) * bytes]);
        if n == 1 || block == 0 {
            return Ok(());
        }
        // The send side is cut like the receive side, so that what a channel sends for
        // block j is exactly what the peer's same channel expects.
        // per_channel cuts with min(channels, elements): so must we.
        let chans = self.g.channels().min(n * block);
        self.per_channel(&mut recv[..n * bytes], dtype, n, |ch, mut blocks| {
            let mine = elem_part(dtype, 0, block, chans, ch);
            for k in 1..n {
                let (to, from) = schedule::all_to_all_peers(n, r, k);
                let out = &send[to * bytes + mine.start..to * bytes + mine.end];
                self.g
                    .exchange(ch, (to, out), (from, blocks[from]), self.piece, |_, _| {})?;
            }
            Ok(())
        })
    }

    /// Ring shift: `send` goes to rank r+1, `recv` comes from rank r−1.
    pub fn send_recv(&self, send: &[u8], recv: &mut [u8], dtype: DType) -> anyhow::Result<()> {
        let (n, r) = (self.n(), self.r());
        if n == 1 {
            recv.copy_from_slice(send);
            return Ok(());
        }
        let count = send.len() / dtype.size();
        let ch_count = self.g.channels().min(count.max(1));
        self.per_channel(recv, dtype, 1, |ch, mut parts| {
            let range = elem_part(dtype, 0, count, ch_count, ch);
            self.g.exchange(
                ch,
                ((r + 1) % n, &send[range]),
                ((r + n - 1) % n, parts[0]),
                self.piece,
                |_, _| {},
            )
        })
    }
}

/// What one rank forwards to the next on a channel, in order. A piece the socket takes at
/// once is sent from the calling thread; from the first piece it does not take whole on,
/// a sender thread (started then) sends the rest, so that the caller never blocks on a
/// send (its ring neighbours may be blocked sending to it). A short collective then
/// starts no thread and hands no piece across threads: each would cost more wall time
/// than the message's transfer.
///
/// The queue to the thread is unbounded: a ring's ranks all send their own chunk before
/// they receive, so each must hold up to a chunk the next rank has not taken yet, and a
/// caller blocked on a full queue receives nothing (with a queue of 64 pieces, a 512 MiB
/// AllGather of 2 ranks, 128 MiB per channel, waited until the peers timed out).
struct Forward<'scope, 'g> {
    g: &'g Group,
    to: usize,
    ch: usize,
    /// The sender thread's queue and handle, once started.
    thread: Option<SenderThread<'scope>>,
}

type SenderThread<'scope> = (
    std::sync::mpsc::Sender<Vec<u8>>,
    std::thread::ScopedJoinHandle<'scope, anyhow::Result<()>>,
);

impl<'scope, 'g: 'scope> Forward<'scope, 'g> {
    fn new(g: &'g Group, to: usize, ch: usize) -> Self {
        Forward {
            g,
            to,
            ch,
            thread: None,
        }
    }

    /// Sends `data` after what was sent before; `false` if the sender thread has failed
    /// (`finish` returns its error).
    fn send<'env>(
        &mut self,
        s: &'scope std::thread::Scope<'scope, 'env>,
        data: &[u8],
    ) -> anyhow::Result<bool> {
        if let Some((tx, _)) = &self.thread {
            return Ok(tx.send(data.to_vec()).is_ok());
        }
        let now = self.g.send_ready(self.to, self.ch, data)?;
        if now == data.len() {
            return Ok(true);
        }
        let (tx, rx) = std::sync::mpsc::channel::<Vec<u8>>();
        let (g, to, ch) = (self.g, self.to, self.ch);
        let h = s.spawn(move || -> anyhow::Result<()> {
            for d in rx {
                g.send(to, ch, &d)?;
            }
            Ok(())
        });
        let ok = tx.send(data[now..].to_vec()).is_ok();
        self.thread = Some((tx, h));
        Ok(ok)
    }

    /// Waits for the sender thread, if one was started, to send everything; its error.
    fn finish(self) -> anyhow::Result<()> {
        match self.thread {
            Some((tx, h)) => {
                drop(tx);
                h.join().expect("sender thread")
            }
            None => Ok(()),
        }
    }
}
