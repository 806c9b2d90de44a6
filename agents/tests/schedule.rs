//! The executor and the schedule agree: the bytes every rank sends to every other during
//! an all-reduce, counted on the agents' connections over loopback, are what
//! `closbox_agents::schedule` says — the functions the predictor walks. Change how the
//! agents run an algorithm without changing its schedule (or the reverse) and this fails.

mod common;

use std::collections::BTreeMap;

use closbox_agents::schedule::{self, Rhd};
use closbox_agents::{Algo, DType, ReduceOp};
use common::with_group;

type Pairs = BTreeMap<(usize, usize), u64>;

/// Bytes each rank sent to each other during one all-reduce of `count` f32 elements.
fn measured(n: usize, channels: usize, algo: Algo, count: usize) -> Pairs {
    let sent = with_group(n, channels, vec![0; n], |comm| {
        let mut buf = vec![0u8; count * 4];
        comm.g.barrier().expect("barrier");
        let before = comm.g.bytes_sent();
        comm.all_reduce(&mut buf, DType::F32, ReduceOp::Sum, algo)
            .expect("all-reduce");
        let after = comm.g.bytes_sent();
        (comm.g.rank(), before, after)
    });
    let mut pairs = Pairs::new();
    for (r, before, after) in sent {
        for (peer, (b, a)) in before.iter().zip(&after).enumerate() {
            if a > b {
                pairs.insert((r, peer), a - b);
            }
        }
    }
    pairs
}

/// The same from the schedule: each channel runs the algorithm on its part.
fn scheduled(n: usize, channels: usize, algo: Algo, count: usize) -> Pairs {
    let mut pairs = Pairs::new();
    let mut add = |a: usize, b: usize, elems: usize| {
        if elems > 0 {
            *pairs.entry((a, b)).or_default() += elems as u64 * 4;
        }
    };
    match algo {
        Algo::Rhd => {
            let ch = schedule::channels_for(count, channels);
            for c in 0..ch {
                let len = schedule::part(count, ch, c).len();
                for stage in Rhd::new(n).stages(len) {
                    for (a, b, elems) in stage {
                        add(a, b, elems);
                    }
                }
            }
        }
        Algo::Tree => {
            for t in 0..2 {
                let half = schedule::part(count, 2, t).len();
                for r in 0..n {
                    if let (Some(parent), _) = schedule::tree_links(n, t, r) {
                        add(r, parent, half); // reduce up
                        add(parent, r, half); // broadcast down
                    }
                }
            }
        }
        other => panic!("no schedule check for {other:?}"),
    }
    pairs
}

#[test]
fn rhd_and_tree_send_what_their_schedules_say() {
    for algo in [Algo::Rhd, Algo::Tree] {
        for n in [2, 3, 5, 6, 8] {
            for channels in [1, 2] {
                let count = 1003;
                let got = measured(n, channels, algo, count);
                let want = scheduled(n, channels, algo, count);
                assert_eq!(got, want, "{algo:?}, {n} ranks, {channels} channels");
            }
        }
    }
}
