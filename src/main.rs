//! `closbox`: the command line. Parses arguments, calls into the fabric crate, prints.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

mod plan;

/// A GPU-cluster network fabric (leaf-spine, fat-tree, scale-up) on one Linux box.
#[derive(Debug, Parser)]
#[command(name = "closbox", version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// What a fabric is made of: switches per tier, ports, cables, oversubscription,
    /// bisection bandwidth, hop counts; or size a fabric for a GPU count.
    #[command(
        after_help = "Examples:\n  closbox plan configs/leaf-spine-16.toml\n  closbox plan --gpus 200000 --topology fat-tree --radix 64\n  closbox plan configs/superpod-su.toml --json"
    )]
    Plan(PlanArgs),
}

#[derive(Debug, clap::Args)]
struct PlanArgs {
    /// Topology file to describe.
    #[arg(conflicts_with_all = ["gpus", "topology"], required_unless_present = "gpus")]
    file: Option<PathBuf>,
    /// Size fabrics for this many GPUs instead of reading a file.
    #[arg(long, requires = "topology", value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
    gpus: Option<u64>,
    /// Which fabric to size for --gpus.
    #[arg(long, value_enum)]
    topology: Option<SizeKind>,
    /// Ports per switch for --gpus (even).
    #[arg(long, default_value_t = 64, value_parser = parse_radix)]
    radix: u64,
    /// Print JSON instead of tables.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum SizeKind {
    LeafSpine,
    FatTree,
    FullMesh,
    SingleSwitch,
}

fn parse_radix(s: &str) -> Result<u64, String> {
    let k: u64 = s.parse().map_err(|_| format!("{s:?} is not a number"))?;
    if !(4..=4096).contains(&k) || k % 2 != 0 {
        return Err(format!("radix {k} must be even and in 4..=4096"));
    }
    Ok(k)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("CLOSBOX_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let result = match cli.command {
        Command::Plan(args) => run_plan(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("closbox: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run_plan(args: PlanArgs) -> anyhow::Result<()> {
    let out = match (&args.file, args.gpus, args.topology) {
        (Some(file), _, _) => {
            let topo = closbox_fabric::load(file)?;
            let p = closbox_fabric::plan::Plan::of(&topo);
            if args.json {
                serde_json::to_string_pretty(&p)?
            } else {
                plan::render_plan(&p)
            }
        }
        (None, Some(gpus), Some(kind)) => {
            let s = closbox_fabric::plan::Sizing::new(gpus, args.radix);
            if args.json {
                serde_json::to_string_pretty(&s)?
            } else {
                plan::render_sizing(&s, kind)
            }
        }
        _ => unreachable!("clap requires a file or --gpus with --topology"),
    };
    println!("{out}");
    Ok(())
}
