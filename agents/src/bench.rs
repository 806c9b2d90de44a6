//! The nccl-tests-style benchmark: for each operation and size, warm up, time `iters`
//! runs, check every element, and report time, algorithm and bus bandwidth.
//!
//! Each run starts from a pristine copy of the input (out-of-place semantics, as
//! nccl-tests), copied outside the timed region; all ranks start it at one instant agreed
//! in a barrier. Times are per operation, averaged over iterations, the slowest rank's,
//! converted to fabric time (wall ÷ time_scale).

use std::time::{Duration, Instant};

use closbox_fabric::TimeScale;
use serde::{Deserialize, Serialize};

use crate::coll::{elem_range, Algo, Comm, Op};
use crate::dtype::{DType, ReduceOp};

#[derive(Clone, Debug)]
pub struct Spec {
    pub ops: Vec<Op>,
    pub sizes: Vec<usize>,
    pub iters: usize,
    pub warmup: usize,
    pub algo: Algo,
    pub dtype: DType,
    pub redop: ReduceOp,
    pub root: usize,
    pub time_scale: TimeScale,
}

/// One line of results (nccl-tests columns plus the algorithm).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Row {
    pub op: Op,
    pub algo: String,
    pub ranks: usize,
    pub channels: usize,
    pub size: usize,
    pub count: usize,
    pub dtype: DType,
    pub redop: Option<ReduceOp>,
    pub root: Option<usize>,
    /// Fabric-time microseconds per operation: the slowest rank's mean over the timed
    /// iterations.
    pub time_us: f64,
    /// Fabric-time microseconds of each timed iteration, each the slowest rank's in it
    /// (every rank starts an iteration at one agreed instant). Their mean can exceed
    /// `time_us` a little: a different rank may be the slowest in each.
    #[serde(default)]
    pub iter_us: Vec<f64>,
    /// GB/s (10⁹ bytes).
    pub algbw: f64,
    pub busbw: f64,
    pub wrong: u64,
}

/// Benchmark options, shared by `closbox bench` (which forwards them with `to_args`) and
/// `closbox-agent bench` (which runs them): one definition, one validation.
#[derive(Clone, Debug, clap::Args)]
pub struct Options {
    /// Sizes in bytes: "8:256M" (doubling), "1M", "4K,64K"; each a whole number of
    /// elements of --dtype.
    #[arg(long, default_value = "8:64M", value_parser = check_sizes)]
    pub sizes: String,
    /// Timed runs per size (the mean is reported).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub iters: u32,
    /// Untimed runs per size before the timed ones.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    pub warmup: u32,
    /// AllReduce algorithm: auto, ring, tree, rhd, hier.
    #[arg(long, default_value = "auto", value_parser = check_algo)]
    pub algo: String,
    /// f32 or bf16.
    #[arg(long, default_value = "f32", value_parser = check_dtype)]
    pub dtype: String,
    /// sum, max, min, avg.
    #[arg(long, default_value = "sum", value_parser = check_redop)]
    pub redop: String,
    /// Root of broadcast and reduce: an index into the selected GPUs (0 = the first of
    /// --gpus), below the number of ranks.
    #[arg(long, default_value_t = 0)]
    pub root: usize,
}

fn check_sizes(s: &str) -> Result<String, String> {
    parse_sizes(s).map(|_| s.to_owned())
}

fn check_algo(s: &str) -> Result<String, String> {
    Algo::from_name(s)
        .map(|_| s.to_owned())
        .ok_or_else(|| format!("unknown algorithm {s:?}: auto, ring, tree, rhd or hier"))
}

fn check_dtype(s: &str) -> Result<String, String> {
    s.parse::<DType>().map(|_| s.to_owned())
}

fn check_redop(s: &str) -> Result<String, String> {
    s.parse::<ReduceOp>().map(|_| s.to_owned())
}

/// Parses operation names, comma-separated or not ("allreduce,alltoall").
pub fn parse_ops<S: AsRef<str>>(names: &[S]) -> anyhow::Result<Vec<Op>> {
    names
        .iter()
        .flat_map(|o| o.as_ref().split(','))
        .map(|o| {
            Op::from_name(o.trim()).ok_or_else(|| {
                let all: Vec<&str> = Op::ALL.iter().map(|o| o.name()).collect();
                anyhow::anyhow!("unknown operation {o:?}; one of: {}", all.join(", "))
            })
        })
        .collect()
}

impl Options {
    /// Checks every option and builds the run.
    pub fn spec(&self, ops: Vec<Op>, time_scale: TimeScale) -> anyhow::Result<Spec> {
        let dtype: DType = self.dtype.parse().map_err(anyhow::Error::msg)?;
        let sizes = parse_sizes(&self.sizes).map_err(|e| anyhow::anyhow!("--sizes: {e}"))?;
        if let Some(bad) = sizes.iter().find(|s| *s % dtype.size() != 0) {
            anyhow::bail!(
                "--sizes: {bad} bytes is not a whole number of {} elements ({} bytes each)",
                dtype.name(),
                dtype.size()
            );
        }
        Ok(Spec {
            ops,
            sizes,
            iters: self.iters as usize,
            warmup: self.warmup as usize,
            algo: Algo::from_name(&self.algo).ok_or_else(|| {
                anyhow::anyhow!(
                    "unknown algorithm {:?}: auto, ring, tree, rhd or hier",
                    self.algo
                )
            })?,
            dtype,
            redop: self.redop.parse().map_err(anyhow::Error::msg)?,
            root: self.root,
            time_scale,
        })
    }

    /// The same options as command-line arguments.
    pub fn to_args(&self) -> Vec<String> {
        [
            ("--sizes", self.sizes.clone()),
            ("--iters", self.iters.to_string()),
            ("--warmup", self.warmup.to_string()),
            ("--algo", self.algo.clone()),
            ("--dtype", self.dtype.clone()),
            ("--redop", self.redop.clone()),
            ("--root", self.root.to_string()),
        ]
        .into_iter()
        .flat_map(|(k, v)| [k.to_owned(), v])
        .collect()
    }
}

/// Parses "8:256M" (sizes doubling from 8 B to 256 MiB), "1M", or "4K,64K,1M"; each size
/// in the grammar of topology files (`closbox_fabric::Bytes`: "1M" = "1MiB", "1MB" = 10⁶).
pub fn parse_sizes(s: &str) -> Result<Vec<usize>, String> {
    fn one(s: &str) -> Result<usize, String> {
        let b: closbox_fabric::Bytes = s.trim().parse().map_err(|e| format!("{e}"))?;
        match usize::try_from(b.get()) {
            Ok(0) => Err(format!("size {s:?} must be above 0")),
            Ok(n) if n <= 1 << 40 => Ok(n),
            _ => Err(format!("size {s:?} is too large")),
        }
    }
    if let Some((a, b)) = s.split_once(':') {
        let (mut lo, hi) = (one(a)?, one(b)?);
        if lo > hi {
            return Err(format!("size range {s:?} goes downward"));
        }
        let mut out = Vec::new();
        while lo <= hi {
            out.push(lo);
            lo *= 2;
        }
        return Ok(out);
    }
    s.split(',').map(one).collect()
}

/// Input value of element `i` on rank `r`: small integers, exact in bf16 sums of up to
/// 36 ranks.
fn input(r: usize, i: usize) -> f32 {
    ((r + 3 * i) % 7) as f32
}

/// Input of the all-to-all: element `i` of the block rank `r` sends to rank `to`.
fn a2a(r: usize, to: usize, i: usize) -> f32 {
    ((5 * r + 3 * to + i) % 11) as f32
}

fn reduce_all(op: ReduceOp, n: usize, i: usize) -> f32 {
    let vals = (0..n).map(|r| input(r, i));
    match op {
        ReduceOp::Sum => vals.sum(),
        ReduceOp::Avg => vals.sum::<f32>() / n as f32,
        ReduceOp::Max => vals.fold(f32::MIN, f32::max),
        ReduceOp::Min => vals.fold(f32::MAX, f32::min),
    }
}

/// The least memory one rank holds to run `spec`: for its largest size, the input and
/// the working copy (`prepare`'s buffer and its clone) and the expected value of every
/// element (`Option<f32>`, 8 bytes). Scratch buffers some algorithms add come on top.
/// Measured: a 2-rank ring AllReduce of 128 MiB (f32) peaked at 4.3 × the size
/// resident, this floor 4 ×.
pub fn memory_floor(spec: &Spec) -> u64 {
    let largest = spec.sizes.iter().copied().max().unwrap_or(0) as u64;
    let count = largest / spec.dtype.size() as u64;
    2 * largest + count * std::mem::size_of::<Option<f32>>() as u64
}

/// Input and expected output of `op` for this rank (`None`: not checked here).
fn prepare(
    op: Op,
    dtype: DType,
    redop: ReduceOp,
    n: usize,
    r: usize,
    root: usize,
    count: usize,
) -> (Vec<u8>, Vec<Option<f32>>) {
    let mut buf = vec![0u8; count * dtype.size()];
    let mut want = vec![None; count];
    match op {
        Op::AllReduce | Op::Reduce => {
            for (i, w) in want.iter_mut().enumerate() {
                dtype.put(&mut buf, i, input(r, i));
                if op == Op::AllReduce || r == root {
                    *w = Some(reduce_all(redop, n, i));
                }
            }
        }
        Op::Broadcast => {
            for (i, w) in want.iter_mut().enumerate() {
                dtype.put(&mut buf, i, if r == root { input(root, i) } else { -1.0 });
                *w = Some(input(root, i));
            }
        }
        Op::AllGather => {
            for j in 0..n {
                for i in elem_range(count, n, j) {
                    dtype.put(&mut buf, i, if j == r { input(j, i) } else { -1.0 });
                    want[i] = Some(input(j, i));
                }
            }
        }
        Op::ReduceScatter => {
            for i in 0..count {
                dtype.put(&mut buf, i, input(r, i));
            }
            for i in elem_range(count, n, r) {
                want[i] = Some(reduce_all(redop, n, i));
            }
        }
        Op::AllToAll => {
            let c = count / n;
            for j in 0..n {
                for k in 0..c {
                    dtype.put(&mut buf, j * c + k, a2a(r, j, k));
                    want[j * c + k] = Some(a2a(j, r, k));
                }
            }
        }
        Op::SendRecv => {
            for (i, w) in want.iter_mut().enumerate() {
                dtype.put(&mut buf, i, input(r, i));
                *w = Some(input((r + n - 1) % n, i));
            }
        }
    }
    (buf, want)
}

fn wrong(dtype: DType, got: &[u8], want: &[Option<f32>], tolerance: f32) -> u64 {
    want.iter()
        .enumerate()
        .filter(|(i, w)| {
            w.is_some_and(|w| (dtype.get(got, *i) - w).abs() > tolerance * w.abs().max(1.0))
        })
        .count() as u64
}

/// The implementation an operation uses, for the report.
fn algo_name(comm: &Comm, op: Op, algo: Algo, bytes: usize) -> String {
    match op {
        Op::AllReduce => match algo {
            Algo::Auto => comm.auto_algo(bytes).name().to_owned(),
            a => a.name().to_owned(),
        },
        Op::Broadcast | Op::Reduce => "chain".into(),
        Op::AllGather | Op::ReduceScatter => "ring".into(),
        Op::AllToAll => "pairwise".into(),
        Op::SendRecv => "shift".into(),
    }
}

/// What to run: an operation with its parameters.
#[derive(Clone, Copy, Debug)]
pub struct Call {
    pub op: Op,
    pub algo: Algo,
    pub dtype: DType,
    pub redop: ReduceOp,
    pub root: usize,
}

/// Runs one operation on `buf` (in place; `scratch` receives for out-of-place ops).
pub fn run_op(comm: &Comm, c: Call, buf: &mut [u8], scratch: &mut [u8]) -> anyhow::Result<()> {
    let Call {
        op,
        algo,
        dtype,
        redop,
        root,
    } = c;
    match op {
        Op::AllReduce => comm.all_reduce(buf, dtype, redop, algo),
        Op::Broadcast => comm.broadcast(buf, dtype, root),
        Op::Reduce => comm.reduce(buf, dtype, redop, root),
        Op::AllGather => comm.all_gather(buf, dtype),
        Op::ReduceScatter => comm.reduce_scatter(buf, dtype, redop),
        Op::AllToAll => {
            comm.all_to_all(buf, scratch, dtype)?;
            buf.copy_from_slice(scratch);
            Ok(())
        }
        Op::SendRecv => {
            comm.send_recv(buf, scratch, dtype)?;
            buf.copy_from_slice(scratch);
            Ok(())
        }
    }
}

/// Runs the benchmark; `on_row` sees each row (every rank computes the same rows).
pub fn run(comm: &Comm, spec: &Spec, mut on_row: impl FnMut(&Row)) -> anyhow::Result<Vec<Row>> {
    let (n, r) = (comm.g.size(), comm.g.rank());
    let mut rows = Vec::new();
    for &op in &spec.ops {
        for &size in &spec.sizes {
            let count = size / spec.dtype.size();
            anyhow::ensure!(
                spec.root < n,
                "--root {} is not one of the {n} ranks",
                spec.root
            );
            let root = spec.root;
            let (input_buf, want) = prepare(op, spec.dtype, spec.redop, n, r, root, count);
            let mut buf = input_buf.clone();
            let mut scratch = vec![0u8; buf.len()];
            let call = Call {
                op,
                algo: spec.algo,
                dtype: spec.dtype,
                redop: spec.redop,
                root,
            };
            // Every rank starts at one instant of the box's monotonic clock (one kernel,
            // shared by all namespaces), agreed in a barrier: a barrier alone lets ranks
            // leave up to a hop apart, and the first to leave would time that skew too.
            // The start is set far enough ahead that every rank is out of the barrier by
            // then (twice the longest barrier seen, measured in the warm-up).
            let mut ahead = Duration::ZERO;
            for _ in 0..spec.warmup.max(1) {
                let t = Instant::now();
                comm.g.barrier()?;
                ahead = ahead.max(2 * t.elapsed());
                buf.copy_from_slice(&input_buf);
                if spec.warmup > 0 {
                    run_op(comm, call, &mut buf, &mut scratch)?;
                }
            }
            let mut iter_secs = Vec::with_capacity(spec.iters);
            for _ in 0..spec.iters {
                buf.copy_from_slice(&input_buf);
                let entered = Instant::now();
                let proposed = clock::now_ns() + (ahead + START_MARGIN).as_nanos() as u64;
                let start = comm.g.barrier_max(proposed)?;
                ahead = ahead.max(2 * entered.elapsed());
                // Late (out of the barrier after the agreed start): time from now, as a
                // plain barrier would.
                let from = clock::wait_until_ns(start);
                run_op(comm, call, &mut buf, &mut scratch)?;
                iter_secs.push(clock::now_ns().saturating_sub(from) as f64 / 1e9);
            }
            let tolerance = if spec.redop == ReduceOp::Avg {
                1e-2
            } else {
                0.0
            };
            let my_wrong = wrong(spec.dtype, &buf, &want, tolerance);
            let mean = iter_secs.iter().sum::<f64>() / spec.iters as f64;
            // The slowest rank's times and everyone's errors, agreed by all.
            let (slowest, slowest_iters, all_wrong) = agree(comm, mean, &iter_secs, my_wrong)?;
            let time_us = spec.time_scale.fabric_of(slowest * 1e6);
            let iter_us = slowest_iters
                .iter()
                .map(|s| spec.time_scale.fabric_of(s * 1e6))
                .collect();
            let algbw = if time_us > 0.0 {
                size as f64 / (time_us * 1e3)
            } else {
                0.0
            };
            let row = Row {
                op,
                algo: algo_name(comm, op, spec.algo, size),
                ranks: n,
                channels: comm.g.channels(),
                size,
                count,
                dtype: spec.dtype,
                redop: op.reduces().then_some(spec.redop),
                root: op.rooted().then_some(root),
                time_us,
                iter_us,
                algbw,
                busbw: algbw * op.bus_factor(n),
                wrong: all_wrong,
            };
            on_row(&row);
            rows.push(row);
        }
    }
    Ok(rows)
}

/// Max of `secs` and of each of `iters` (seconds) and sum of `wrong` over all ranks,
/// agreed by all (f32 microseconds: seven significant digits are plenty).
fn agree(
    comm: &Comm,
    secs: f64,
    iters: &[f64],
    wrong: u64,
) -> anyhow::Result<(f64, Vec<f64>, u64)> {
    let mut a: Vec<u8> = std::iter::once(secs)
        .chain(iters.iter().copied())
        .flat_map(|s| ((s * 1e6) as f32).to_le_bytes())
        .collect();
    let mut b = (wrong as f32).to_le_bytes().to_vec();
    comm.all_reduce(&mut a, DType::F32, ReduceOp::Max, Algo::Ring)?;
    comm.all_reduce(&mut b, DType::F32, ReduceOp::Sum, Algo::Ring)?;
    let mut us = a
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")) as f64 / 1e6);
    let mean = us.next().expect("the mean");
    let w = f32::from_le_bytes(b[..4].try_into().expect("4 bytes"));
    Ok((mean, us.collect(), w as u64))
}

/// Wall time added to every agreed start beyond twice the longest barrier (the ranks'
/// own scheduling on a shared box).
const START_MARGIN: Duration = Duration::from_micros(500);

/// The box's monotonic clock as nanoseconds: one clock for every namespace, so ranks in
/// different GPUs can agree on an instant.
mod clock {
    use std::time::Duration;

    pub fn now_ns() -> u64 {
        let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
        t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
    }

    /// Waits until `at` (sleeping, then yielding for the last stretch, which a sleep
    /// would overshoot); returns the instant timing starts from: `at`, or now if it had
    /// already passed.
    pub fn wait_until_ns(at: u64) -> u64 {
        const SPIN: u64 = 300_000;
        let now = now_ns();
        if now > at {
            return now;
        }
        if at - now > SPIN {
            std::thread::sleep(Duration::from_nanos(at - now - SPIN));
        }
        while now_ns() < at {
            std::thread::yield_now();
        }
        at
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_size_ranges() {
        assert_eq!(parse_sizes("8:64").unwrap(), vec![8, 16, 32, 64]);
        assert_eq!(parse_sizes("1K,1M").unwrap(), vec![1024, 1 << 20]);
        assert_eq!(parse_sizes("8:256M").unwrap().len(), 26);
        assert!(parse_sizes("64:8").is_err());
        assert!(parse_sizes("x").is_err());
        assert!(parse_sizes("0").is_err());
        // One grammar with topology files.
        assert_eq!(parse_sizes("64MiB").unwrap(), vec![64 << 20]);
        assert_eq!(parse_sizes("1.5M").unwrap(), vec![3 << 19]);
        assert_eq!(parse_sizes("1MB").unwrap(), vec![1_000_000]);
    }
}
