//! A data-parallel training step: forward, backward producing gradient buckets, gradients
//! all-reduced either after backward or overlapped with it (as DDP does).
//!
//! GPU compute is modelled as time passing (a sleep, scaled by `time_scale`): on a GPU it
//! would not occupy the CPU either. Communication is real: every bucket is all-reduced
//! over the fabric and checked.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::bail;
use closbox_fabric::TimeScale;
use serde::{Deserialize, Serialize};

use crate::coll::{Algo, Comm};
use crate::dtype::{DType, ReduceOp};

#[derive(Clone, Debug)]
pub struct Spec {
    /// Gradient bytes per step (the model's parameters × bytes per gradient).
    pub model_bytes: usize,
    pub bucket_bytes: usize,
    /// Forward + backward compute per step, fabric time.
    pub compute: Duration,
    pub steps: usize,
    pub overlap: bool,
    pub algo: Algo,
    pub dtype: DType,
    pub time_scale: TimeScale,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub overlap: bool,
    pub ranks: usize,
    pub buckets: usize,
    pub model_bytes: usize,
    /// Mean over the measured steps (the first is a warm-up), fabric milliseconds.
    pub step_ms: f64,
    pub compute_ms: f64,
    /// Step time not hidden behind compute: step − compute.
    pub exposed_comm_ms: f64,
    /// Time spent in all-reduce calls (overlapped or not).
    pub comm_ms: f64,
    /// compute / step: 1.0 means communication is fully hidden.
    pub efficiency: f64,
}

/// A gradient bucket: its index and bytes.
type Bucket = (usize, Vec<u8>);

fn sleep_fabric(d: Duration, time_scale: TimeScale) {
    std::thread::sleep(time_scale.stretch(d));
}

/// The least memory one rank holds to train a model of `model_bytes` in buckets of
/// `bucket_bytes`: a step's gradients (the whole model, bucket by bucket) and one
/// bucket's working copy in the AllReduce.
pub fn memory_floor(model_bytes: usize, bucket_bytes: usize) -> u64 {
    model_bytes as u64 + bucket_bytes as u64
}

/// Runs the steps; every rank returns the same report (times agreed as the slowest).
pub fn run(comm: &Comm, spec: &Spec) -> anyhow::Result<Report> {
    let esz = spec.dtype.size();
    if spec.bucket_bytes == 0 || spec.model_bytes == 0 {
        bail!("model and bucket sizes must be positive");
    }
    if spec.bucket_bytes % esz != 0 || spec.model_bytes % esz != 0 {
        bail!("model and bucket sizes must be whole numbers of {esz}-byte elements");
    }
    if spec.bucket_bytes > spec.model_bytes {
        bail!("the bucket is larger than the model");
    }
    if spec.steps == 0 {
        bail!("at least one step");
    }
    let n = comm.g.size();
    let bucket_el = spec.bucket_bytes / esz;
    let total_el = spec.model_bytes / esz;
    let buckets = crate::schedule::buckets(total_el, bucket_el);
    let forward = spec.compute.mul_f64(crate::schedule::FORWARD_SHARE);
    let backward_per_bucket = (spec.compute - forward) / buckets.len() as u32;
    let rank = comm.g.rank();
    let fill = |b: usize, len: usize| -> Vec<u8> {
        let mut v = vec![0u8; len * esz];
        for i in 0..len {
            spec.dtype.put(&mut v, i, ((rank + b + i) % 5) as f32);
        }
        v
    };
    let expect = |b: usize, i: usize| -> f32 { (0..n).map(|r| ((r + b + i) % 5) as f32).sum() };

    let (mut step_total, mut comm_total) = (0.0f64, 0.0f64);
    let measured = spec.steps;
    for step in 0..=measured {
        comm.g.barrier()?;
        let t0 = Instant::now();
        let mut grads: Vec<Vec<u8>> = Vec::with_capacity(buckets.len());
        let mut comm_secs = 0.0f64;
        sleep_fabric(forward, spec.time_scale);
        if spec.overlap {
            // Buckets are all-reduced by a communication thread as backward produces them.
            let (tx, rx) = mpsc::channel::<Bucket>();
            let done = std::thread::scope(|s| -> anyhow::Result<(Vec<Bucket>, f64)> {
                let worker = s.spawn(move || -> anyhow::Result<(Vec<Bucket>, f64)> {
                    let mut out = Vec::new();
                    let mut busy = 0.0;
                    for (b, mut g) in rx {
                        let t = Instant::now();
                        comm.all_reduce(&mut g, spec.dtype, ReduceOp::Sum, spec.algo)?;
                        busy += t.elapsed().as_secs_f64();
                        out.push((b, g));
                    }
                    Ok((out, busy))
                });
                for (b, &len) in buckets.iter().enumerate().rev() {
                    sleep_fabric(backward_per_bucket, spec.time_scale);
                    if tx.send((b, fill(b, len))).is_err() {
                        break; // the worker failed; its error is reported below
                    }
                }
                drop(tx);
                worker.join().expect("communication thread")
            })?;
            comm_secs += done.1;
            let mut sorted = done.0;
            sorted.sort_by_key(|(b, _)| *b);
            grads.extend(sorted.into_iter().map(|(_, g)| g));
        } else {
            for (b, &len) in buckets.iter().enumerate().rev() {
                sleep_fabric(backward_per_bucket, spec.time_scale);
                grads.push(fill(b, len));
            }
            grads.reverse();
            let t = Instant::now();
            for g in &mut grads {
                comm.all_reduce(g, spec.dtype, ReduceOp::Sum, spec.algo)?;
            }
            comm_secs += t.elapsed().as_secs_f64();
        }
        let elapsed = t0.elapsed().as_secs_f64();
        if step == 0 {
            // Warm-up step: check the gradients once.
            for (b, g) in grads.iter().enumerate() {
                for i in (0..buckets[b]).step_by(997) {
                    let (got, want) = (spec.dtype.get(g, i), expect(b, i));
                    if got != want {
                        bail!("rank {rank}: bucket {b} element {i} is {got} after all-reduce, expected {want}");
                    }
                }
            }
        } else {
            step_total += elapsed;
            comm_total += comm_secs;
        }
    }
    let mut v = vec![0u8; 8];
    DType::F32.put(&mut v, 0, (step_total / measured as f64 * 1e6) as f32);
    DType::F32.put(&mut v, 1, (comm_total / measured as f64 * 1e6) as f32);
    comm.all_reduce(&mut v, DType::F32, ReduceOp::Max, Algo::Ring)?;
    let to_fabric_ms = |us: f32| spec.time_scale.fabric_of(us as f64 / 1e3);
    let step_ms = to_fabric_ms(DType::F32.get(&v, 0));
    let compute_ms = spec.compute.as_secs_f64() * 1e3;
    Ok(Report {
        overlap: spec.overlap,
        ranks: n,
        buckets: buckets.len(),
        model_bytes: spec.model_bytes,
        step_ms,
        compute_ms,
        exposed_comm_ms: (step_ms - compute_ms).max(0.0),
        comm_ms: to_fabric_ms(DType::F32.get(&v, 1)),
        efficiency: if step_ms > 0.0 {
            (compute_ms / step_ms).min(1.0)
        } else {
            0.0
        },
    })
}
