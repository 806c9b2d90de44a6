//! `closbox-agent`: one per GPU. Joins its group from the environment `closbox run` sets,
//! prints its connections' endpoints (one JSON line, every rank), runs a benchmark or
//! training steps, and (rank 0) prints one JSON object per result line on stdout.
//! `closbox bench` / `closbox train` start it in every GPU and render tables.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use closbox_agents::env::{JobEnv, DEFAULT_PORT};
use closbox_agents::{bench, train, Algo, Comm, DType, Endpoints, Group, Output};

#[derive(Debug, Parser)]
#[command(
    name = "closbox-agent",
    version,
    about = "closbox GPU agent (started by closbox bench/train)"
)]
struct Cli {
    /// Parallel TCP connections per pair of ranks.
    #[arg(long, default_value_t = 2, global = true)]
    channels: usize,
    /// Port every agent listens on (on its own GPU address).
    #[arg(long, default_value_t = DEFAULT_PORT, global = true)]
    port: u16,
    /// Seconds to wait for peers (forming the group, or any single transfer).
    #[arg(long, default_value_t = 60.0, global = true)]
    timeout: f64,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// nccl-tests-style sweep.
    Bench {
        /// Operations (comma-separated): allreduce, broadcast, reduce, allgather,
        /// reducescatter, alltoall, sendrecv.
        #[arg(long, default_value = "allreduce")]
        ops: String,
        #[command(flatten)]
        opts: bench::Options,
    },
    /// Data-parallel training steps.
    Train {
        #[arg(long, default_value_t = 64 << 20)]
        model_bytes: usize,
        #[arg(long, default_value_t = 8 << 20)]
        bucket_bytes: usize,
        /// Forward + backward compute per step, milliseconds of fabric time.
        #[arg(long, default_value_t = 200.0)]
        compute_ms: f64,
        #[arg(long, default_value_t = 3)]
        steps: usize,
        /// "on", "off" or "both".
        #[arg(long, default_value = "both")]
        overlap: String,
        #[arg(long, default_value = "auto")]
        algo: String,
        #[arg(long, default_value = "f32")]
        dtype: String,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("closbox-agent: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    if cli.timeout.is_nan() || cli.timeout <= 0.0 {
        anyhow::bail!("--timeout must be positive");
    }
    let env = JobEnv::from_env(cli.channels, cli.port, Duration::from_secs_f64(cli.timeout))?;
    let group = Group::connect(&env.group)?;
    // Every rank says which connections it holds: `closbox bench` works out the paths
    // the fabric gives them.
    let eps = Endpoints {
        rank: group.rank(),
        endpoints: group.endpoints()?,
    };
    println!("{}", Output::Endpoints(eps).to_line());
    let comm = Comm::new(&group, env.nodes.clone());
    let leader = group.rank() == 0;
    let algo = |s: &str| {
        Algo::from_name(s)
            .ok_or_else(|| anyhow::anyhow!("unknown algorithm {s:?}: auto, ring, tree, rhd, hier"))
    };
    match cli.cmd {
        Cmd::Bench { ops, opts } => {
            let spec = opts.spec(bench::parse_ops(&[ops])?, env.time_scale)?;
            bench::run(&comm, &spec, |row| {
                if leader {
                    println!("{}", Output::Row(row.clone()).to_line());
                }
            })?;
        }
        Cmd::Train {
            model_bytes,
            bucket_bytes,
            compute_ms,
            steps,
            overlap,
            algo: a,
            dtype,
        } => {
            let modes: &[bool] = match overlap.as_str() {
                "on" => &[true],
                "off" => &[false],
                "both" => &[false, true],
                o => anyhow::bail!("--overlap {o:?}: on, off or both"),
            };
            if compute_ms.is_nan() || compute_ms < 0.0 {
                anyhow::bail!("--compute-ms must be non-negative");
            }
            let compute = Duration::try_from_secs_f64(compute_ms / 1e3)
                .map_err(|_| anyhow::anyhow!("--compute-ms {compute_ms}: too long"))?;
            for &ov in modes {
                let spec = train::Spec {
                    model_bytes,
                    bucket_bytes,
                    compute,
                    steps,
                    overlap: ov,
                    algo: algo(&a)?,
                    dtype: dtype.parse::<DType>().map_err(anyhow::Error::msg)?,
                    time_scale: env.time_scale,
                };
                let report = train::run(&comm, &spec)?;
                if leader {
                    println!("{}", Output::Report(report).to_line());
                }
            }
        }
    }
    group.barrier()?;
    Ok(())
}
