//! The executor and the schedule agree: the bytes every rank sends to every other during
//! a collective (rhd and tree all-reduce, broadcast and reduce chains, all-to-all), counted on the agents' connections over loopback, are what
//! `closbox_agents::schedule` says — the functions the predictor walks. Change how the
//! agents run an algorithm without changing its schedule (or the reverse) and this fails.

mod common;

use std::collections::BTreeMap;

use closbox_agents::schedule::{self, Rhd};
use closbox_agents::{Algo, DType, ReduceOp};
use common::with_group;

type Pairs = BTreeMap<(usize, usize), u64>;

/// What a case runs.
#[derive(Clone, Copy, Debug)]
enum Case {
    AllReduce(Algo),
    Broadcast(usize),
    Reduce(usize),
    AllToAll,
}

/// Bytes each rank sent to each other during one operation on `count` f32 elements.
fn measured(n: usize, channels: usize, case: Case, count: usize) -> Pairs {
    let sent = with_group(n, channels, vec![0; n], |comm| {
        let mut buf = vec![0u8; count * 4];
        let mut out = vec![0u8; count * 4];
        comm.g.barrier().expect("barrier");
        let before = comm.g.bytes_sent();
        let f32 = DType::F32;
        match case {
            Case::AllReduce(algo) => comm.all_reduce(&mut buf, f32, ReduceOp::Sum, algo),
            Case::Broadcast(root) => comm.broadcast(&mut buf, f32, root),
            Case::Reduce(root) => comm.reduce(&mut buf, f32, ReduceOp::Sum, root),
            Case::AllToAll => comm.all_to_all(&buf, &mut out, f32),
        }
        .expect("collective");
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
fn scheduled(n: usize, channels: usize, case: Case, count: usize) -> Pairs {
    let mut pairs = Pairs::new();
    let mut add = |a: usize, b: usize, elems: usize| {
        if elems > 0 {
            *pairs.entry((a, b)).or_default() += elems as u64 * 4;
        }
    };
    match case {
        Case::AllReduce(Algo::Rhd) => {
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
        Case::AllReduce(Algo::Tree) => {
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
        Case::Broadcast(root) | Case::Reduce(root) => {
            for w in schedule::chain(n, root).windows(2) {
                match case {
                    Case::Broadcast(_) => add(w[0], w[1], count),
                    _ => add(w[1], w[0], count),
                }
            }
        }
        Case::AllToAll => {
            for stage in schedule::all_to_all_stages(n, count / n) {
                for (a, b, elems) in stage {
                    add(a, b, elems);
                }
            }
        }
        other => panic!("no schedule check for {other:?}"),
    }
    pairs
}

#[test]
fn collectives_send_what_their_schedules_say() {
    for case in [
        Case::AllReduce(Algo::Rhd),
        Case::AllReduce(Algo::Tree),
        Case::Broadcast(2),
        Case::Reduce(1),
        Case::AllToAll,
    ] {
        for n in [2, 3, 5, 6, 8] {
            for channels in [1, 2] {
                // All-to-all moves whole blocks: a multiple of n elements.
                let count = if matches!(case, Case::AllToAll) {
                    120 * n
                } else {
                    1003
                };
                let got = measured(n, channels, case, count);
                let want = scheduled(n, channels, case, count);
                assert_eq!(got, want, "{case:?}, {n} ranks, {channels} channels");
            }
        }
    }
}
