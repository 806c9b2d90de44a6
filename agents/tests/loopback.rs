//! Every collective and algorithm, checked element by element, for 1, 2, odd and even
//! rank counts and sizes that do not divide by the rank count — over loopback, no root.

mod common;

use std::time::{Duration, Instant};

use common::{ports, with_group};

use closbox_agents::bench::{self, Spec};
use closbox_agents::{Algo, Comm, DType, Group, GroupConfig, Op, ReduceOp};

/// What one `check` runs.
struct Case<'a> {
    ops: &'a [Op],
    algo: Algo,
    dtype: DType,
    redop: ReduceOp,
}

fn check(n: usize, channels: usize, nodes: Vec<usize>, case: Case, sizes: &[usize]) {
    let Case {
        ops,
        algo,
        dtype,
        redop,
    } = case;
    let results = with_group(n, channels, nodes, |comm| {
        let mut c = Comm::new(comm.g, comm.nodes.clone());
        c.piece = 4096; // many pieces even for small sizes
        let spec = Spec {
            ops: ops.to_vec(),
            sizes: sizes.to_vec(),
            iters: 2,
            warmup: 1,
            algo,
            dtype,
            redop,
            root: n / 2,
            time_scale: closbox_fabric::TimeScale::REAL_TIME,
        };
        bench::run(&c, &spec, |_| {}).expect("bench runs")
    });
    for rows in &results {
        // Every rank reports the same agreed rows.
        assert_eq!(rows, &results[0]);
        for row in rows {
            assert_eq!(
                row.wrong, 0,
                "n={n} ch={channels} {:?} {} {dtype:?} {redop:?} size {}: {} wrong",
                row.op, row.algo, row.size, row.wrong
            );
            // Each iteration's slowest rank took at least that rank's own time in it, so
            // on average at least the slowest rank's mean (to f32's precision).
            assert_eq!(row.iter_us.len(), 2, "{row:?}");
            let mean = row.iter_us.iter().sum::<f64>() / 2.0;
            assert!(row.iter_us.iter().all(|&t| t > 0.0), "{row:?}");
            assert!(mean >= row.time_us * (1.0 - 1e-5), "{row:?}");
        }
    }
}

/// Byte sizes: 1 element, a few, not divisible by ranks or channels, several pieces.
fn sizes(dtype: DType) -> Vec<usize> {
    [1usize, 7, 1000, 30_011]
        .iter()
        .map(|e| e * dtype.size())
        .collect()
}

#[test]
fn all_reduce_every_algorithm_and_rank_count() {
    for n in [1, 2, 3, 4, 5, 8] {
        for algo in [Algo::Ring, Algo::Tree, Algo::Rhd, Algo::Auto] {
            check(
                n,
                2,
                (0..n).collect(),
                Case {
                    ops: &[Op::AllReduce],
                    algo,
                    dtype: DType::F32,
                    redop: ReduceOp::Sum,
                },
                &sizes(DType::F32),
            );
        }
    }
}

#[test]
fn all_reduce_hierarchical() {
    for (n, nodes) in [
        (4, vec![0, 0, 1, 1]),
        (6, vec![0, 0, 0, 1, 1, 1]),
        (8, vec![0, 0, 0, 0, 1, 1, 1, 1]),
        (3, vec![0, 1, 2]),
    ] {
        check(
            n,
            2,
            nodes,
            Case {
                ops: &[Op::AllReduce],
                algo: Algo::Hier,
                dtype: DType::F32,
                redop: ReduceOp::Sum,
            },
            &sizes(DType::F32),
        );
    }
}

#[test]
fn every_reduction_and_bf16() {
    for redop in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::Avg] {
        for dtype in [DType::F32, DType::Bf16] {
            check(
                5,
                2,
                (0..5).collect(),
                Case {
                    ops: &[Op::AllReduce, Op::Reduce, Op::ReduceScatter],
                    algo: Algo::Ring,
                    dtype,
                    redop,
                },
                &sizes(dtype),
            );
        }
        check(
            4,
            1,
            (0..4).collect(),
            Case {
                ops: &[Op::AllReduce],
                algo: Algo::Rhd,
                dtype: DType::Bf16,
                redop,
            },
            &sizes(DType::Bf16),
        );
        check(
            3,
            2,
            (0..3).collect(),
            Case {
                ops: &[Op::AllReduce],
                algo: Algo::Tree,
                dtype: DType::Bf16,
                redop,
            },
            &sizes(DType::Bf16),
        );
    }
}

#[test]
fn every_other_collective() {
    let others = &Op::ALL[1..]; // all but AllReduce
    for n in [1, 2, 3, 4, 7] {
        for channels in [1, 3] {
            check(
                n,
                channels,
                (0..n).collect(),
                Case {
                    ops: others,
                    algo: Algo::Auto,
                    dtype: DType::F32,
                    redop: ReduceOp::Sum,
                },
                &sizes(DType::F32),
            );
        }
    }
    check(
        6,
        2,
        (0..6).collect(),
        Case {
            ops: others,
            algo: Algo::Auto,
            dtype: DType::Bf16,
            redop: ReduceOp::Max,
        },
        &sizes(DType::Bf16),
    );
}

#[test]
fn a_dead_rank_fails_the_others_quickly() {
    let base = ports(3);
    let peers: Vec<String> = (0..3).map(|i| format!("127.0.0.1:{}", base + i)).collect();
    let started = Instant::now();
    let errors: Vec<Option<String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..3)
            .map(|rank| {
                let peers = peers.clone();
                s.spawn(move || {
                    // A long timeout: the failure must come from the closed connection.
                    let g = Group::connect(&GroupConfig {
                        rank,
                        peers,
                        channels: 2,
                        timeout: Duration::from_secs(60),
                    })
                    .unwrap();
                    if rank == 2 {
                        return None; // dies: its sockets close
                    }
                    let comm = Comm::new(&g, vec![0, 1, 2]);
                    let mut buf = vec![0u8; 4 << 20];
                    comm.all_reduce(&mut buf, DType::F32, ReduceOp::Sum, Algo::Ring)
                        .err()
                        .map(|e| format!("{e:#}"))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "took {:?}",
        started.elapsed()
    );
    for (rank, e) in errors.iter().enumerate().take(2) {
        let e = e
            .as_ref()
            .unwrap_or_else(|| panic!("rank {rank} did not fail"));
        assert!(e.contains("rank "), "{e}");
    }
    assert!(
        errors[..2].iter().flatten().any(|e| e.contains("rank 2")),
        "{errors:?}"
    );
}

#[test]
fn endpoints_pair_up_across_ranks() {
    let eps = with_group(3, 2, vec![0, 0, 0], |comm| comm.g.endpoints().unwrap());
    for (a, mine) in eps.iter().enumerate() {
        // Every other rank, every channel, once.
        assert_eq!(mine.len(), 2 * 2);
        for e in mine {
            assert_ne!(e.peer, a);
            let theirs = eps[e.peer]
                .iter()
                .find(|o| o.peer == a && o.channel == e.channel)
                .expect("the peer has the other end");
            assert_eq!((theirs.local, theirs.remote), (e.remote, e.local));
        }
    }
}

#[test]
fn barrier_waits_for_every_rank() {
    // The last rank arrives late; nobody may leave before it has arrived. (An ordering,
    // not a speed: exits are compared with the late rank's arrival.)
    for n in [2, 3, 5, 8] {
        let arrived = std::sync::Mutex::new(None::<Instant>);
        let exits = with_group(n, 1, vec![0; n], |comm| {
            if comm.g.rank() == n - 1 {
                std::thread::sleep(Duration::from_millis(100));
                *arrived.lock().unwrap() = Some(Instant::now());
            }
            comm.g.barrier().unwrap();
            Instant::now()
        });
        let arrived = arrived.lock().unwrap().unwrap();
        for (r, e) in exits.iter().enumerate() {
            assert!(
                *e >= arrived,
                "{n} ranks: rank {r} left before rank {} arrived",
                n - 1
            );
        }
    }
}

/// A ring's first sends come before its first receive, so a rank's own chunk larger than
/// what the sockets hold must go through a sender thread: sent from the receiving thread,
/// every rank would block in its send with no one receiving.
#[test]
fn ring_chunks_beyond_what_sockets_hold() {
    for n in [2, 3] {
        check(
            n,
            2,
            (0..n).collect(),
            Case {
                ops: &[Op::AllReduce, Op::AllGather, Op::ReduceScatter],
                algo: Algo::Ring,
                dtype: DType::F32,
                redop: ReduceOp::Sum,
            },
            &[64 << 20],
        );
    }
}
