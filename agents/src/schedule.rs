//! What the collectives send, described once: the shapes of the double binary tree and of
//! recursive halving-doubling, the piece size, the split of a buffer across channels, the
//! bucket split and the forward/backward split of a training step.
//!
//! The agents execute these (`coll`, `train`); the predictor (`closbox`'s `predict`)
//! walks the same functions, so an algorithm changed here is changed for both. Pure: no
//! I/O, no threads; lengths are in elements (any unit: the predictor uses bytes).
//! `tests/schedule.rs` runs the agents over loopback and checks that the bytes every rank
//! sends to every other are what these functions say.

use std::ops::Range;

/// Bytes moved per piece: the pipelining granularity of streaming rings, trees and chains.
pub const PIECE: usize = 256 << 10;

/// Balanced partition: the `i`-th of `n` parts of `0..len`.
pub fn part(len: usize, n: usize, i: usize) -> Range<usize> {
    (len * i / n)..(len * (i + 1) / n)
}

/// Channels a buffer of `count` elements is spread over: each channel (a TCP connection
/// per pair of ranks) moves its part (`part(count, channels, c)`), at most one per element.
pub fn channels_for(count: usize, channels: usize) -> usize {
    channels.min(count.max(1))
}

// ---- double binary tree ----------------------------------------------------------------

/// The two trees of a double binary tree over `n` ranks, as heap orders: tree 0 over the
/// ranks in order, tree 1 over them reversed, so that the leaves of one are the interior
/// of the other. Each tree carries half of the buffer (`part(count, 2, t)`).
pub fn tree_order(n: usize, t: usize) -> Vec<usize> {
    if t == 0 {
        (0..n).collect()
    } else {
        (0..n).rev().collect()
    }
}

/// `rank`'s parent and children in tree `t`.
pub fn tree_links(n: usize, t: usize, rank: usize) -> (Option<usize>, Vec<usize>) {
    let order = tree_order(n, t);
    let pos = order
        .iter()
        .position(|&x| x == rank)
        .expect("rank is a member");
    let parent = (pos > 0).then(|| order[(pos - 1) / 2]);
    let children = [2 * pos + 1, 2 * pos + 2]
        .into_iter()
        .filter(|&c| c < n)
        .map(|c| order[c])
        .collect();
    (parent, children)
}

/// Levels of a binary heap of `n` ranks (the pipeline depth of a tree).
pub fn tree_depth(n: usize) -> u32 {
    usize::BITS - n.leading_zeros()
}

// ---- rings ------------------------------------------------------------------------------

/// Steps of a ring among `n` members, each moving one of n chunks to the next member:
/// reduce-scatter or all-gather alone take n − 1, an all-reduce (both) 2(n − 1).
pub fn ring_steps(n: usize, reduce_scatter: bool, all_gather: bool) -> usize {
    n.saturating_sub(1) * (reduce_scatter as usize + all_gather as usize)
}

/// `hier`'s rings, ranks numbered node by node (`per` GPUs a node): the ring inside
/// node `node`, and the ring across nodes of the GPUs with local rank `local`.
pub fn hier_local_ring(node: usize, per: usize) -> Vec<usize> {
    (0..per).map(|l| node * per + l).collect()
}

pub fn hier_cross_ring(nodes: usize, per: usize, local: usize) -> Vec<usize> {
    (0..nodes).map(|k| k * per + local).collect()
}

// ---- chains and pairwise exchanges ----------------------------------------------------

/// The pipelined chain of broadcast and reduce: the ranks in order starting at `root`
/// (broadcast flows down it, reduce up it toward the root).
pub fn chain(n: usize, root: usize) -> Vec<usize> {
    (0..n).map(|i| (root + i) % n).collect()
}

/// `rank`'s place in the chain from `root`: the rank before it and the rank after it.
pub fn chain_links(n: usize, root: usize, rank: usize) -> (Option<usize>, Option<usize>) {
    let pos = (rank + n - root) % n;
    let prev = (pos > 0).then(|| (rank + n - 1) % n);
    let next = (pos + 1 < n).then(|| (rank + 1) % n);
    (prev, next)
}

/// All-to-all in n − 1 pairwise steps: in step k (1 ≤ k < n) rank r sends its block for
/// r + k and receives the block of r − k. Returns `(to, from)`.
pub fn all_to_all_peers(n: usize, rank: usize, k: usize) -> (usize, usize) {
    ((rank + k) % n, (rank + n - k) % n)
}

/// Every rank's transfers per all-to-all step, as `(from, to, block)`.
pub fn all_to_all_stages(n: usize, block: usize) -> Vec<Vec<(usize, usize, usize)>> {
    (1..n)
        .map(|k| {
            (0..n)
                .map(|r| (r, all_to_all_peers(n, r, k).0, block))
                .collect()
        })
        .collect()
}

// ---- recursive halving-doubling --------------------------------------------------------

/// Recursive halving-doubling (Rabenseifner) over `n` ranks, any `n`: the first
/// 2·`extra` ranks fold pairwise (odd ones take their even neighbour's data) so that a
/// power of two, `pow`, of "virtual" ranks halve and double; then they unfold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rhd {
    pub n: usize,
    pub pow: usize,
    pub extra: usize,
}

/// One halving step of a virtual rank: the partner (virtual), the range owned before the
/// step, and the halves kept (reduced into) and given (sent). Doubling retraces them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Halving {
    pub partner: usize,
    pub owned: Range<usize>,
    pub keep: Range<usize>,
    pub give: Range<usize>,
}

impl Rhd {
    pub fn new(n: usize) -> Rhd {
        assert!(n > 0, "rhd needs a rank");
        let pow = 1usize << (usize::BITS - 1 - n.leading_zeros());
        Rhd {
            n,
            pow,
            extra: n - pow,
        }
    }

    /// The real rank of virtual rank `v`.
    pub fn real(&self, v: usize) -> usize {
        if v < self.extra {
            2 * v + 1
        } else {
            v + self.extra
        }
    }

    /// Among the folded ranks (below 2·extra), the even ones hand their data to the odd
    /// neighbour and sit out: `None`. Everyone else is a virtual rank.
    pub fn virtual_rank(&self, r: usize) -> Option<usize> {
        if r < 2 * self.extra {
            (r % 2 == 1).then_some(r / 2)
        } else {
            Some(r - self.extra)
        }
    }

    /// The halving steps of virtual rank `v` over `len` elements, in order.
    pub fn halving(&self, v: usize, len: usize) -> Vec<Halving> {
        let (mut lo, mut hi) = (0, len);
        let mut steps = Vec::new();
        let mut dist = self.pow / 2;
        while dist >= 1 {
            let partner = v ^ dist;
            let mid = lo + (hi - lo) / 2;
            let (keep, give) = if v < partner {
                (lo..mid, mid..hi)
            } else {
                (mid..hi, lo..mid)
            };
            steps.push(Halving {
                partner,
                owned: lo..hi,
                keep: keep.clone(),
                give,
            });
            (lo, hi) = (keep.start, keep.end);
            dist /= 2;
        }
        steps
    }

    /// Every real rank's transfers, stage by stage (fold, halving steps, doubling steps,
    /// unfold), as `(from, to, elements)`: what the predictor simulates.
    pub fn stages(&self, len: usize) -> Vec<Vec<(usize, usize, usize)>> {
        let mut stages = Vec::new();
        if self.extra > 0 {
            stages.push((0..self.extra).map(|i| (2 * i, 2 * i + 1, len)).collect());
        }
        let plans: Vec<Vec<Halving>> = (0..self.pow).map(|v| self.halving(v, len)).collect();
        let depth = plans.first().map_or(0, Vec::len);
        // Per halving step: every virtual rank gives one half; when doubling retraces
        // the step, it sends back what it kept.
        let (halving, doubling): (Vec<_>, Vec<_>) = (0..depth)
            .map(|step| {
                let flows = |half: fn(&Halving) -> usize| -> Vec<(usize, usize, usize)> {
                    plans
                        .iter()
                        .enumerate()
                        .map(|(v, plan)| {
                            let h = &plan[step];
                            (self.real(v), self.real(h.partner), half(h))
                        })
                        .collect()
                };
                (flows(|h| h.give.len()), flows(|h| h.keep.len()))
            })
            .unzip();
        stages.extend(halving);
        stages.extend(doubling.into_iter().rev());
        if self.extra > 0 {
            stages.push((0..self.extra).map(|i| (2 * i + 1, 2 * i, len)).collect());
        }
        stages
    }
}

// ---- training steps --------------------------------------------------------------------

/// A model's gradients (`model` elements) split into buckets of `bucket` elements, in
/// the order backward produces them (the last one smaller).
pub fn buckets(model: usize, bucket: usize) -> Vec<usize> {
    assert!(bucket > 0, "buckets of at least one element");
    (0..model.div_ceil(bucket))
        .map(|b| bucket.min(model - b * bucket))
        .collect()
}

/// Forward's share of a step's compute: a third (backward, two thirds, produces the
/// buckets, one after another in equal shares).
pub const FORWARD_SHARE: f64 = 1.0 / 3.0;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rhd_folds_any_rank_count_onto_a_power_of_two() {
        for n in 1..=12 {
            let r = Rhd::new(n);
            assert!(r.pow.is_power_of_two() && r.pow <= n && n < 2 * r.pow);
            let virtuals: Vec<usize> = (0..n).filter_map(|x| r.virtual_rank(x)).collect();
            assert_eq!(virtuals, (0..r.pow).collect::<Vec<_>>(), "n {n}");
            for v in 0..r.pow {
                assert_eq!(r.virtual_rank(r.real(v)), Some(v));
            }
        }
    }

    #[test]
    fn halving_leaves_each_rank_its_own_share() {
        let r = Rhd::new(8);
        let len = 1001;
        let owned: Vec<Range<usize>> = (0..8)
            .map(|v| r.halving(v, len).last().unwrap().keep.clone())
            .collect();
        // The final shares tile the buffer.
        let mut tiles = owned.clone();
        tiles.sort_by_key(|x| x.start);
        assert_eq!(tiles.first().unwrap().start, 0);
        assert_eq!(tiles.last().unwrap().end, len);
        assert!(tiles.windows(2).all(|w| w[0].end == w[1].start));
        // Every stage pairs partners both ways with matching sizes.
        for stage in r.stages(len) {
            for &(a, b, x) in &stage {
                let back = stage.iter().find(|f| f.0 == b && f.1 == a).unwrap();
                assert!(back.2.abs_diff(x) <= 1, "{a}->{b} {x} vs {}", back.2);
            }
        }
    }

    #[test]
    fn buckets_cover_the_model() {
        assert_eq!(buckets(10, 4), vec![4, 4, 2]);
        assert_eq!(buckets(8, 8), vec![8]);
        assert_eq!(buckets(3, 8), vec![3]);
    }

    #[test]
    fn the_two_trees_swap_leaves_and_interior() {
        let n = 7;
        for r in 0..n {
            let (_, c0) = tree_links(n, 0, r);
            let (_, c1) = tree_links(n, 1, r);
            // Interior in at most one of the two trees.
            assert!(c0.is_empty() || c1.is_empty(), "rank {r}");
        }
    }
}
