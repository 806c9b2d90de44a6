//! The command line's arguments: every command and option (clap), the parsers of their
//! values, and the joining of negative values to their options.

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};
use closbox_switchd::scenario::Start;
use closbox_switchd::state::FabricName;

use crate::{bench, live, mpirun, record};

/// A GPU-cluster network fabric (leaf-spine, fat-tree, scale-up) on one Linux box.
#[derive(Debug, Parser)]
#[command(name = "closbox", version, about, propagate_version = true)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// What a fabric is made of: switches per tier, ports, cables, oversubscription,
    /// bisection bandwidth, hop counts; or size a fabric for a GPU count.
    #[command(
        after_help = "Examples:\n  closbox plan configs/leaf-spine-16.toml\n  closbox plan --gpus 200000 --topology fat-tree --radix 64\n  closbox plan configs/superpod-su.toml --json"
    )]
    Plan(PlanArgs),
    /// Bring a fabric up: a namespace, hostname and TUN per GPU, and the switch daemon.
    /// Runs in the foreground (Ctrl-C tears it down) unless --detach. Exit 4 if the name
    /// is already up.
    Up(UpArgs),
    /// Take fabrics down: exactly what `up` made, also after a crash. Idempotent.
    Down {
        /// Fabric names, or the topology files they were brought up from (default: the
        /// only fabric up).
        #[arg(value_parser = fabric_ref)]
        fabric: Vec<FabricName>,
        /// The same, as other commands take it.
        #[arg(long = "fabric", short = 'f', value_name = "FABRIC", value_parser = fabric_ref, conflicts_with = "fabric")]
        fabric_flag: Option<FabricName>,
        /// Every fabric that is up.
        #[arg(long, conflicts_with_all = ["fabric", "fabric_flag"])]
        all: bool,
    },
    /// Fabrics up, daemon health, packets, drops, lateness. Exit 3 if a fabric is unhealthy.
    Status {
        /// Fabric name, or the topology file it was brought up from (default: all).
        #[arg(value_parser = fabric_ref)]
        fabric: Option<FabricName>,
        /// The same, as other commands take it.
        #[arg(long = "fabric", short = 'f', value_name = "FABRIC", value_parser = fabric_ref, conflicts_with = "fabric")]
        fabric_flag: Option<FabricName>,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
        /// Every port's counters (idle ones too), or only ports whose name contains
        /// PATTERN ("leaf0->", "spine1"; one that starts with '-' goes after '=':
        /// --ports=->gpu0); without it, the five busiest or most dropping.
        #[arg(long, value_name = "PATTERN", num_args = 0..=1, default_missing_value = "")]
        ports: Option<String>,
    },
    /// Run a command as one GPU (its network, hostname and /etc/hosts); exit code passed through.
    #[command(after_help = "Example:\n  closbox exec gpu3 -- ping -c 3 gpu0")]
    Exec {
        /// GPU name (gpu3) or rank (3).
        gpu: String,
        /// Fabric (default: the only fabric up).
        #[arg(long, short, value_parser = fabric_ref)]
        fabric: Option<FabricName>,
        /// Stop the command (SIGTERM) when the process that started `exec` exits: for
        /// remote launchers such as mpirun's rsh agent, so that a killed mpirun leaves
        /// nothing running in the GPUs.
        #[arg(long)]
        die_with_parent: bool,
        /// Fabric-time clocks for the command on a dilated fabric: its clock reads and
        /// deadline waits run time_scale times slower (see "Fabric time" in the README;
        /// nothing changes on a real-time fabric).
        #[arg(long)]
        fabric_clock: bool,
        /// Stop the command after this many seconds, or 1.5m, 2h: SIGTERM to it and what
        /// it started in its process group, SIGKILL 3 s later (exit 124, as `timeout(1)`).
        #[arg(long, value_parser = seconds, allow_negative_numbers = true)]
        timeout: Option<std::time::Duration>,
        /// The command and its arguments (after `--` if they could be taken for closbox's
        /// own options).
        #[arg(trailing_var_arg = true, required = true, value_name = "CMD")]
        cmd: Vec<String>,
    },
    /// nccl-tests-style benchmark: agents in every GPU, a table with predictions.
    #[command(
        after_help = "Example:\n  closbox bench allreduce alltoall --sizes 1M:64M --iters 5"
    )]
    Bench {
        /// Operations: allreduce, broadcast, reduce, allgather, reducescatter, alltoall,
        /// sendrecv (default allreduce).
        ops: Vec<String>,
        #[command(flatten)]
        target: TargetArgs,
        #[command(flatten)]
        opts: BenchOpts,
    },
    /// Data-parallel training steps: gradients all-reduced after backward, and overlapped
    /// with it; step time, exposed communication, scaling efficiency. The defaults finish
    /// in well under a minute on configs/default.toml.
    Train {
        #[command(flatten)]
        target: TargetArgs,
        /// Gradient bytes per step, e.g. 256M (a whole number of f32 elements).
        #[arg(long, default_value = "16M", value_parser = one_size)]
        model: usize,
        /// Bucket size, e.g. 25M (at most --model) [default: 4M, or --model if smaller].
        #[arg(long, value_parser = one_size)]
        bucket: Option<usize>,
        /// Forward + backward compute per step, in ms of fabric time [default: the
        /// predicted time of the step's all-reduces on this fabric, so that overlap can
        /// hide up to half the step]. At most an hour.
        #[arg(long, conflicts_with_all = ["flops", "gpu_tflops"], value_parser = non_negative, allow_negative_numbers = true)]
        compute_ms: Option<f64>,
        /// Model FLOPs per step per GPU (with --gpu-tflops instead of --compute-ms).
        #[arg(long, requires = "gpu_tflops", value_parser = positive)]
        flops: Option<f64>,
        /// GPU throughput in TFLOP/s.
        #[arg(long, requires = "flops", value_parser = positive)]
        gpu_tflops: Option<f64>,
        /// Timed steps per mode.
        #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=10_000))]
        steps: u32,
        /// AllReduce algorithm: auto, ring, tree, rhd, hier.
        #[arg(long, default_value = "auto", value_parser = parse_algo)]
        algo: closbox_agents::Algo,
        /// Print JSON instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// Change a live fabric's links: down, up, set (rate, delay, loss, buffer), reset.
    #[command(
        subcommand,
        after_help = "Examples:\n  closbox link down leaf0 spine1\n  closbox link set leaf0 spine1 --rate 100Gbit --loss 0.001\n  closbox link set leaf0 spine1 --loss 0.01 --loss-burst 16   # losses in bursts\n  closbox link set gpu0 leaf0 --from gpu0 --loss 1            # a one-way gray failure\n  closbox link up leaf0 spine1"
    )]
    Link(LinkCmd),
    /// A switch down, up or flapping (all its links): a dead or rebooting leaf or spine.
    #[command(
        subcommand,
        after_help = "Examples:\n  closbox switch down spine1\n  closbox switch flap leaf0 --down 5ms --up 20ms --count 3\n  closbox switch up spine1"
    )]
    Switch(UpDown),
    /// A GPU's links down, up or flapping (its NIC and scale-up link): a dead host port.
    #[command(subcommand)]
    Gpu(UpDown),
    /// Cut GPUs off from each other: traffic between the groups is dropped, both ways;
    /// GPUs in no group form one more.
    #[command(
        after_help = "Examples:\n  closbox partition 0-3          # gpu0..gpu3 | the rest\n  closbox partition gpu0 gpu1    # gpu0 | gpu1 | the rest"
    )]
    Partition {
        /// GPU selections as `run --gpus` takes them, one per group.
        #[arg(required = true)]
        groups: Vec<String>,
        /// Fabric (default: the only fabric up).
        #[arg(long, short, value_parser = fabric_ref)]
        fabric: Option<FabricName>,
    },
    /// End a partition.
    Heal {
        #[command(flatten)]
        fabric: FabricChoice,
    },
    /// Put the fabric back as its topology file made it: every scenario and flap
    /// cancelled, every load stopped, the partition healed, every link up at the file's
    /// values (those set by hand forgotten), as one event. The GPUs and what runs in them
    /// are left alone (`down` and `up` would end them).
    Reset {
        #[command(flatten)]
        fabric: FabricChoice,
    },
    /// End a running chaos scenario (a timeline `status` lists; 0: the pending flaps):
    /// its pending changes are dropped, the repairs among them of what it broke are made
    /// at once, its loads stop. Without TIMELINE: every one.
    Cancel {
        /// The timeline's number (`closbox chaos` and `status` give it).
        timeline: Option<u64>,
        /// Fabric (default: the only fabric up).
        #[arg(long, short, value_parser = fabric_ref)]
        fabric: Option<FabricName>,
    },
    /// The changes made to a fabric since it came up, with their fabric and wall times.
    Events {
        #[command(flatten)]
        fabric: FabricChoice,
        /// Print JSON instead of lines.
        #[arg(long)]
        json: bool,
        /// Keep printing new events as they happen (JSON lines with --json).
        #[arg(long)]
        follow: bool,
    },
    /// Synthetic cross-traffic inside the fabric from a GPU or switch to another, along
    /// the fabric's routes (spread over equal-cost paths), competing with the GPUs'
    /// packets in every queue on the way; no TUN I/O. `--stop` ends loads.
    #[command(
        after_help = "Examples:\n  closbox load leaf0 leaf1 --rate 200Gbit          # half of a 400G leaf's two uplinks\n  closbox load gpu4 gpu0 --rate 100Gbit --on 1ms --off 3ms --for 1s\n  closbox load --stop 3\n  closbox load --stop                              # every load"
    )]
    Load {
        /// Where the traffic enters: a GPU or switch name.
        #[arg(required_unless_present = "stop")]
        from: Option<String>,
        /// Where it leaves the fabric.
        #[arg(required_unless_present = "stop")]
        to: Option<String>,
        /// Rate on the wire while it sends, e.g. 200Gbit.
        #[arg(long, required_unless_present = "stop")]
        rate: Option<closbox_fabric::Bandwidth>,
        /// Stop after this long (fabric time), e.g. 500ms.
        #[arg(long = "for", value_name = "DURATION")]
        duration: Option<closbox_fabric::Duration>,
        /// Send for this long, then pause for --off, again.
        #[arg(long, requires = "off")]
        on: Option<closbox_fabric::Duration>,
        /// Pause for this long between the --on periods.
        #[arg(long, requires = "on")]
        off: Option<closbox_fabric::Duration>,
        /// IP bytes per packet [default: the fabric's mtu].
        #[arg(long)]
        packet: Option<closbox_fabric::Bytes>,
        /// Stop load ID (as `status` lists them), or every load.
        #[arg(long, value_name = "ID", num_args = 0..=1, conflicts_with_all = ["from", "to", "rate", "duration", "on", "off", "packet"])]
        stop: Option<Option<u32>>,
        /// Fabric (default: the only fabric up).
        #[arg(long, short, value_parser = fabric_ref)]
        fabric: Option<FabricName>,
    },
    /// Synthetic bursts from many GPUs converging on one GPU's port (the queue a
    /// many-to-one phase builds): each source sends --bytes at its link's rate.
    #[command(
        after_help = "Examples:\n  closbox incast gpu0 --bytes 4MiB\n  closbox incast gpu0 --from 4-7 --bytes 1MiB --every 10ms --count 20"
    )]
    Incast {
        /// The GPU the bursts converge on.
        gpu: String,
        /// Sources, as `run --gpus` takes them (the target itself is left out).
        #[arg(long, default_value = "all")]
        from: String,
        /// Bytes per source per burst, e.g. 4MiB.
        #[arg(long)]
        bytes: closbox_fabric::Bytes,
        /// Time between bursts (fabric time).
        #[arg(long)]
        every: Option<closbox_fabric::Duration>,
        /// Number of bursts.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
        count: u32,
        /// Fabric (default: the only fabric up).
        #[arg(long, short, value_parser = fabric_ref)]
        fabric: Option<FabricName>,
    },
    /// Capture packets as they leave fabric ports into a pcapng file (`-w -`: stdout):
    /// one interface per port, fabric-time timestamps; with --drops also the packets
    /// dropped there, their reason in a comment. Ctrl-C ends it.
    #[command(
        after_help = "Examples:\n  closbox capture --port leaf0->gpu0 -w /tmp/gpu0.pcapng --count 1000\n  closbox capture --link leaf0 spine1 --drops --duration 10ms -w /tmp/up.pcapng\n  closbox capture --gpu gpu3 -w - | tshark -r - -q -z conv,tcp"
    )]
    Capture {
        /// A port as `status` names it: FROM->TO (repeatable).
        #[arg(long = "port", value_name = "A->B")]
        ports: Vec<String>,
        /// Both directions of the link(s) between A and B (repeatable).
        #[arg(long = "link", num_args = 2, value_names = ["A", "B"])]
        links: Vec<String>,
        /// Every port into and out of a GPU (repeatable).
        #[arg(long = "gpu", value_name = "GPU")]
        gpus: Vec<String>,
        /// Every port of the fabric.
        #[arg(long, conflicts_with_all = ["ports", "links", "gpus"])]
        all: bool,
        /// Output file (pcapng), or - for stdout.
        #[arg(short = 'w', long = "write", value_name = "FILE")]
        file: PathBuf,
        /// Stop after this many packets.
        #[arg(long, value_parser = at_least_one)]
        count: Option<u64>,
        /// Stop after this much fabric time, e.g. 10ms.
        #[arg(long)]
        duration: Option<closbox_fabric::Duration>,
        /// Bytes kept of each packet.
        #[arg(long, default_value_t = 262_144, value_parser = clap::value_parser!(u32).range(20..=262_144))]
        snaplen: u32,
        /// Also the packets the fabric drops at those ports (buffer full, loss, link
        /// down), each with its reason as a packet comment.
        #[arg(long)]
        drops: bool,
        #[command(flatten)]
        fabric: FabricChoice,
    },
    /// Flows (5-tuples) through the fabric, heaviest first: packets, bytes, drops, ECN
    /// marks, and the path the fabric hashes each onto (ECMP collisions show as heavy
    /// flows sharing an uplink).
    #[command(
        after_help = "Examples:\n  closbox flows\n  closbox flows --top 5 --since 10ms\n  closbox flows --json"
    )]
    Flows {
        /// Show this many flows (the heaviest; 0: all of them).
        #[arg(long, default_value_t = 20)]
        top: usize,
        /// Only flows with a packet in the last DURATION of fabric time.
        #[arg(long, value_name = "DURATION")]
        since: Option<closbox_fabric::Duration>,
        /// Print JSON instead of the table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        fabric: FabricChoice,
    },
    /// Sample per-port queue depth and utilization at a fabric-time interval into a CSV
    /// file (the daemon samples, so the interval can be microseconds under dilation).
    #[command(
        after_help = "Examples:\n  closbox record -o /tmp/q.csv --interval 10us --ports leaf0-> --duration 5ms\n  closbox plot /tmp/q.csv -o /tmp/q.svg"
    )]
    Record {
        /// Output CSV: fabric_time_s,port,queue_bytes,utilization (after a # comment line;
        /// a last line "# ended: …" says why, when the fabric ended it).
        #[arg(short = 'o', long = "output", value_name = "FILE")]
        file: PathBuf,
        /// Fabric time between samples.
        #[arg(long, default_value = "100us")]
        interval: closbox_fabric::Duration,
        /// Only ports whose name contains one of these (comma-separated), e.g. "leaf0->,->gpu0".
        #[arg(long, value_name = "PATTERNS", allow_hyphen_values = true)]
        ports: Option<String>,
        /// Stop after this much fabric time (default: Ctrl-C).
        #[arg(long)]
        duration: Option<closbox_fabric::Duration>,
        #[command(flatten)]
        fabric: FabricChoice,
    },
    /// Draw a `closbox record` file as an SVG: queue depth (or utilization) over fabric
    /// time for the busiest ports.
    Plot {
        /// A CSV written by `closbox record`.
        file: PathBuf,
        /// The SVG file to write.
        #[arg(short = 'o', long = "output", value_name = "FILE.svg")]
        out: PathBuf,
        /// Queue depth (bytes) or utilization (of the port's rate) over fabric time.
        #[arg(long, value_enum, default_value = "queue")]
        metric: record::Metric,
        /// How many ports (those with the highest values).
        #[arg(long, default_value_t = 8, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1000))]
        top: usize,
    },
    /// A live view of a fabric: health, leaf x spine uplink utilization, the busiest
    /// ports (queue, drops/s, ECN/s), recent events; refreshed every second, q quits.
    Top {
        /// Print one frame (80x24) as text and exit (also what `top` does when its output
        /// is not a terminal).
        #[arg(long)]
        once: bool,
        #[command(flatten)]
        fabric: FabricChoice,
    },
    /// Run an MPI program (Open MPI or MPICH) with one rank per selected GPU: the launcher
    /// built in (closbox starts the remote daemons in their GPUs), TCP over the GPUs'
    /// interface, no busy-polling; exit status and a failing rank reported like `run`.
    #[command(
        after_help = "Examples:\n  closbox mpirun -- /usr/bin/python3 -m mpi4py.bench helloworld\n  closbox mpirun --gpus 0,15 --timeout 120 -- NPopenmpi -u 4194304\n  closbox mpirun --impl mpich --gpus 0,15 -- NPmpich2 -u 4194304\n  closbox mpirun --dry-run -- ./allreduce"
    )]
    Mpirun {
        /// Fabric (default: the only fabric up).
        #[arg(long, short, value_parser = fabric_ref)]
        fabric: Option<FabricName>,
        /// GPUs: "all", ranks and ranges ("0-3,6"), names and their ranges ("gpu0,gpu4-gpu7"); rank i runs on the i-th.
        #[arg(long, default_value = "all")]
        gpus: String,
        /// Ranks on the first N GPUs, as mpirun's `-np N` (which is taken too): `--gpus
        /// 0-(N-1)`.
        #[arg(short = 'n', long = "np", value_name = "N", conflicts_with = "gpus")]
        np: Option<usize>,
        /// Stop the job after this many seconds, or 1.5m, 2h (exit 124).
        #[arg(long, value_parser = seconds, allow_negative_numbers = true)]
        timeout: Option<std::time::Duration>,
        /// The MPI whose launcher to use (default: Open MPI if installed, else MPICH).
        #[arg(long = "impl", value_name = "IMPL")]
        implementation: Option<mpirun::MpiImpl>,
        /// More MCA parameters for Open MPI's mpirun (repeatable): --mca btl_tcp_eager_limit
        /// 65536.
        #[arg(long, num_args = 2, value_names = ["KEY", "VALUE"])]
        mca: Vec<String>,
        /// Environment variables for the ranks (repeatable, as mpirun's -x).
        #[arg(short = 'x', value_name = "VAR[=VALUE]")]
        export: Vec<String>,
        /// Print the launcher's command line and run nothing.
        #[arg(long)]
        dry_run: bool,
        /// A chaos scenario (`closbox chaos`) to run with the job, as `run --chaos`: its
        /// time 0 is the launcher's start (or as --chaos-start says); cancelled when the
        /// job ends.
        #[arg(long, value_name = "FILE")]
        chaos: Option<PathBuf>,
        /// The scenario's time 0, instead of its file's `start`: now, first-packet,
        /// every-gpu (the launcher's daemons in each GPU send first).
        #[arg(long, value_name = "WHEN", requires = "chaos", value_parser = scenario_start)]
        chaos_start: Option<Start>,
        /// Fabric-time clocks for the command on a dilated fabric: its clock reads and
        /// deadline waits run time_scale times slower (see "Fabric time" in the README;
        /// nothing changes on a real-time fabric).
        #[arg(long)]
        fabric_clock: bool,

        /// The command and its arguments (after `--` if they could be taken for closbox's
        /// own options).
        #[arg(trailing_var_arg = true, required = true, value_name = "CMD")]
        cmd: Vec<String>,
    },
    /// (Internal) the remote-shell agent of `closbox mpirun`: runs CMD in GPU HOST, ended
    /// with its launcher.
    #[command(hide = true)]
    Rsh {
        /// Fabric (default: the only fabric up).
        #[arg(long, short, value_parser = fabric_ref)]
        fabric: Option<FabricName>,
        /// HOST=CPU,...: run the command of a listed host on that CPU (busy-polling ranks).
        #[arg(long)]
        cpu_map: Option<String>,
        host: String,
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
        cmd: Vec<String>,
    },
    /// (Internal) what `run` leaves to stop its job if it ends without doing so (killed):
    /// reads `group PGID`, `timeline ID` and `end` lines from standard input; at its end
    /// without `end`, cancels the timelines and stops the groups' processes in the GPUs.
    #[command(hide = true)]
    Reap {
        #[arg(long)]
        fabric: FabricName,
        /// The process it stands in for, and its command (for what it says).
        #[arg(long)]
        job: u32,
        #[arg(long, default_value = "run")]
        command: String,
    },
    /// Run a chaos scenario file on a live fabric: changes at fabric times, repeated
    /// changes, seeded random faults of links, switches and GPUs (see the README). Prints
    /// events as they happen, until its last change and the end of its loads; Ctrl-C
    /// cancels it as `closbox cancel` does.
    #[command(
        after_help = "Examples:\n  closbox chaos configs/chaos/spine-failure.toml\n  closbox chaos configs/chaos/flaky-uplinks.toml --dry-run --topology configs/default.toml\n  closbox bench allreduce --chaos configs/chaos/spine-failure.toml"
    )]
    Chaos {
        /// Scenario file (TOML).
        file: PathBuf,
        /// Print the timeline, run nothing.
        #[arg(long)]
        dry_run: bool,
        /// With --dry-run: check against this topology file instead of the live fabric.
        #[arg(long, requires = "dry_run")]
        topology: Option<PathBuf>,
        /// Return once the timeline is scheduled.
        #[arg(long, conflicts_with = "dry_run")]
        detach: bool,
        /// Events as JSON lines on stdout (as `events --json`), then one object: the
        /// timeline, how it ended (followed, cancelled, interrupted, detached) and what the
        /// fabric did meanwhile.
        #[arg(long, conflicts_with = "dry_run")]
        json: bool,
        /// A scenario with `start = "first-packet"` or `"every-gpu"`: the GPUs whose
        /// packets start it (as `run --gpus` takes them; default: every GPU).
        #[arg(long, conflicts_with = "dry_run")]
        gpus: Option<String>,
        /// Its time 0, instead of the file's `start`: now, first-packet, every-gpu.
        #[arg(long, value_name = "WHEN", value_parser = scenario_start)]
        start: Option<Start>,
        /// Fabric (default: the only fabric up).
        #[arg(long, short, value_parser = fabric_ref)]
        fabric: Option<FabricName>,
    },
    /// Run a command once per GPU, concurrently, with RANK, WORLD_SIZE, MASTER_ADDR, …
    /// set; `{rank}` in arguments becomes the rank.
    #[command(after_help = "Example:\n  closbox run -- /usr/bin/python3 train.py --rank {rank}")]
    Run {
        /// Fabric (default: the only fabric up).
        #[arg(long, short, value_parser = fabric_ref)]
        fabric: Option<FabricName>,
        /// GPUs: "all", ranks and ranges ("0-3,6"), names and their ranges ("gpu0,gpu4-gpu7").
        #[arg(long, default_value = "all")]
        gpus: String,
        /// Stop every rank after this many seconds, or 1.5m, 2h (exit 124).
        #[arg(long, value_parser = seconds, allow_negative_numbers = true)]
        timeout: Option<std::time::Duration>,
        /// MASTER_PORT for torch.distributed-style rendezvous (default: 29500, or the
        /// first port after it that another job on the first GPU does not hold).
        #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
        master_port: Option<u16>,
        /// A chaos scenario (`closbox chaos`) to run with the job: its time 0 is the job's
        /// start (or as its `start` or --chaos-start says); it is cancelled when the job
        /// ends, as `closbox cancel` does (repairs of what it broke made at once, its loads
        /// stopped).
        #[arg(long, value_name = "FILE")]
        chaos: Option<PathBuf>,
        /// The scenario's time 0, instead of its file's `start`: now (the job's start),
        /// first-packet (the job's first packet into the fabric), every-gpu (once each of
        /// its GPUs has sent one).
        #[arg(long, value_name = "WHEN", requires = "chaos", value_parser = scenario_start)]
        chaos_start: Option<Start>,
        /// Fabric-time clocks for the command on a dilated fabric: its clock reads and
        /// deadline waits run time_scale times slower (see "Fabric time" in the README;
        /// nothing changes on a real-time fabric).
        #[arg(long)]
        fabric_clock: bool,
        /// The command and its arguments (after `--` if they could be taken for closbox's
        /// own options).
        #[arg(trailing_var_arg = true, required = true, value_name = "CMD")]
        cmd: Vec<String>,
    },
}

/// Which parallel link(s) between two vertices.
#[derive(Debug, clap::Args)]
pub(crate) struct LinkArgs {
    /// A GPU or switch name, as `plan` and `status` show them.
    pub(crate) a: String,
    /// The GPU or switch at the other end.
    pub(crate) b: String,
    /// One of several parallel links (from 0); default: all of them.
    #[arg(long)]
    pub(crate) index: Option<u32>,
    /// Fabric (default: the only fabric up).
    #[arg(long, short, value_parser = fabric_ref)]
    pub(crate) fabric: Option<FabricName>,
}

#[derive(Debug, Subcommand)]
pub(crate) enum LinkCmd {
    /// Take the link(s) down: what they carry is lost; the switches at the ends stop using
    /// them after `failure_detection`, the fabric reroutes after `route_convergence`.
    Down(LinkArgs),
    /// Bring the link(s) back; routes use them again after `route_convergence`.
    Up(LinkArgs),
    /// Degrade or change the link(s), both directions (or the one `--from` names): rate and delay at once (what a port holds drains at the new rate), loss and buffer for packets from now on.
    Set {
        #[command(flatten)]
        link: LinkArgs,
        /// e.g. 100Gbit.
        #[arg(long)]
        rate: Option<closbox_fabric::Bandwidth>,
        /// e.g. 5us.
        #[arg(long)]
        delay: Option<closbox_fabric::Duration>,
        /// Probability a packet is lost on the wire, in [0, 1]; 1 loses every frame while
        /// the link stays up (a gray failure: routing keeps using it).
        #[arg(long, value_parser = probability, allow_negative_numbers = true)]
        loss: Option<f64>,
        /// Mean run of lost frames: 1 (independent losses), or more for losses in bursts
        /// at the same mean rate (e.g. 8; a Gilbert model).
        #[arg(long, value_parser = loss_burst, allow_negative_numbers = true)]
        loss_burst: Option<f64>,
        /// Only the direction leaving this end (A or B): a failing transmitter, a
        /// one-way gray failure. Both directions when absent.
        #[arg(long, value_name = "END")]
        from: Option<String>,
        /// Egress buffer at both ends (or the `--from` end), e.g. 1MiB.
        #[arg(long)]
        buffer: Option<closbox_fabric::Bytes>,
    },
    /// Back to the topology file's rate, delay, loss and buffers (for good: a scenario's
    /// later reset returns the link to them too).
    Reset(LinkArgs),
    /// Down for --down, up for --up, --count times (fabric time), starting now.
    Flap {
        #[command(flatten)]
        link: LinkArgs,
        #[command(flatten)]
        flap: FlapArgs,
    },
}

/// A flap's timing: `link flap`, `switch flap`, `gpu flap`.
#[derive(Debug, clap::Args)]
pub(crate) struct FlapArgs {
    /// How long the links stay down each time (fabric time), e.g. 10ms.
    #[arg(long)]
    pub(crate) down: closbox_fabric::Duration,
    /// How long they stay up before the next time.
    #[arg(long)]
    pub(crate) up: closbox_fabric::Duration,
    /// How many times.
    #[arg(long, default_value_t = 1)]
    pub(crate) count: u32,
}

#[derive(Debug, Subcommand)]
pub(crate) enum UpDown {
    /// Every link of it goes down.
    Down {
        /// Its name, as `plan` and `status` show it (spine1, gpu3).
        name: String,
        /// Fabric (default: the only fabric up).
        #[arg(long, short, value_parser = fabric_ref)]
        fabric: Option<FabricName>,
    },
    /// Every link of it comes back, whoever took it down, but a GPU's links its own host
    /// holds down (its interface set down or its carrier off: `status` says so).
    Up {
        /// Its name, as `plan` and `status` show it (spine1, gpu3).
        name: String,
        /// Fabric (default: the only fabric up).
        #[arg(long, short, value_parser = fabric_ref)]
        fabric: Option<FabricName>,
    },
    /// Every link of it goes down for D, comes back for U, N times, in fabric time,
    /// starting now (a switch that reboots, a host port that flaps).
    Flap {
        /// The switch (`closbox switch`) or GPU (`closbox gpu`).
        name: String,
        #[command(flatten)]
        flap: FlapArgs,
        /// Fabric (default: the only fabric up).
        #[arg(long, short, value_parser = fabric_ref)]
        fabric: Option<FabricName>,
    },
}

#[derive(Debug, clap::Args)]
pub(crate) struct TargetArgs {
    /// Fabric (default: the only fabric up).
    #[arg(long, short, value_parser = fabric_ref)]
    pub(crate) fabric: Option<FabricName>,
    /// GPUs: "all", ranks and ranges ("0-3,6"), names and their ranges ("gpu4-gpu7").
    #[arg(long, default_value = "all")]
    pub(crate) gpus: String,
    /// Parallel TCP connections per pair of ranks (ECMP can spread them).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub(crate) channels: u32,
    /// Stop the agents after this many seconds of wall time, or 1.5m, 2h (default: no limit; each
    /// agent gives up on its own when a peer is silent for 60 s).
    #[arg(long, value_parser = seconds, allow_negative_numbers = true)]
    pub(crate) timeout: Option<std::time::Duration>,
    /// A chaos scenario (`closbox chaos`) to run with the job: its time 0 is the job's
    /// start; it is cancelled when the job ends, as `closbox cancel` does (repairs of what it broke made at once, its loads stopped).
    #[arg(long, value_name = "FILE")]
    pub(crate) chaos: Option<PathBuf>,
    /// The scenario's time 0, instead of its file's `start`: now (the job's start),
    /// first-packet (the job's first packet into the fabric), every-gpu (once each of its
    /// GPUs has sent one).
    #[arg(long, value_name = "WHEN", requires = "chaos", value_parser = scenario_start)]
    pub(crate) chaos_start: Option<Start>,
}

#[derive(Debug, clap::Args)]
pub(crate) struct BenchOpts {
    #[command(flatten)]
    pub(crate) agent: closbox_agents::bench::Options,
    /// Print the rows as a JSON array instead of the table.
    #[arg(long, conflicts_with = "csv")]
    pub(crate) json: bool,
    /// Print CSV instead of the table.
    #[arg(long)]
    pub(crate) csv: bool,
    /// Write busbw against size as an SVG.
    #[arg(long)]
    pub(crate) plot: Option<PathBuf>,
}

impl TargetArgs {
    pub(crate) fn target(&self) -> bench::Target<'_> {
        bench::Target {
            fabric: self.fabric.as_ref(),
            gpus: &self.gpus,
            channels: self.channels as usize,
            timeout: self.timeout,
            chaos: self.chaos.as_deref(),
            chaos_start: self.chaos_start,
        }
    }
}

/// `--chaos-start`, `chaos --start`: when a scenario's time 0 is.
pub(crate) fn scenario_start(s: &str) -> Result<Start, String> {
    Start::parse(s).ok_or_else(|| {
        format!("{s:?}: now, first-packet (the first packet of the job's GPUs into the fabric) or every-gpu (once each of them has sent one)")
    })
}

pub(crate) fn time_scale_arg(s: &str) -> Result<live::TimeScaleArg, String> {
    if s == "auto" {
        return Ok(live::TimeScaleArg::Auto);
    }
    s.parse::<f64>()
        .ok()
        .and_then(closbox_fabric::TimeScale::new)
        .map(live::TimeScaleArg::Fixed)
        .ok_or_else(|| format!("{s:?}: a time scale from 1 to 1000000, or \"auto\""))
}

pub(crate) fn loopback_addr(s: &str) -> Result<std::net::SocketAddr, String> {
    let a: std::net::SocketAddr = s
        .parse()
        .map_err(|_| format!("{s:?} is not an address with a port, e.g. 127.0.0.1:9464"))?;
    if !a.ip().is_loopback() {
        return Err(format!(
            "{a}: metrics are served on a loopback address only (127.0.0.1:PORT or [::1]:PORT)"
        ));
    }
    Ok(a)
}

pub(crate) fn parse_algo(s: &str) -> Result<closbox_agents::Algo, String> {
    closbox_agents::Algo::from_name(s)
        .ok_or_else(|| format!("unknown algorithm {s:?}: auto, ring, tree, rhd or hier"))
}

pub(crate) fn one_size(s: &str) -> Result<usize, String> {
    match closbox_agents::bench::parse_sizes(s)?.as_slice() {
        [one] => Ok(*one),
        _ => Err("takes one size, such as 64M".into()),
    }
}

pub(crate) fn number(s: &str) -> Result<f64, String> {
    s.parse::<f64>()
        .ok()
        .filter(|v| v.is_finite())
        .ok_or_else(|| format!("{s:?} is not a number"))
}

/// `train`'s compute per step at most (ms of fabric time): an hour.
pub(crate) const MAX_COMPUTE_MS: f64 = 3_600_000.0;

pub(crate) fn positive(s: &str) -> Result<f64, String> {
    number(s).and_then(|v| {
        if v > 0.0 {
            Ok(v)
        } else {
            Err("must be above 0".into())
        }
    })
}

/// A loss probability, as topology files give it: 0.001 for 0.1 %. A live link may take 1:
/// every frame lost while the link stays up (a gray failure the switches never detect).
pub(crate) fn probability(s: &str) -> Result<f64, String> {
    let hint = |why: &str| {
        format!("{why}: a probability in [0, 1] such as 0.001 (0.1 %); 1 loses every frame")
    };
    match s.parse::<f64>() {
        Ok(p) if (0.0..=1.0).contains(&p) => Ok(p),
        Ok(_) => Err(hint("out of range")),
        Err(_) => Err(hint("not a number")),
    }
}

/// A mean run of lost frames, 1 to `MAX_LOSS_BURST`.
pub(crate) fn loss_burst(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(b) if closbox_fabric::config::loss_burst_ok(b) => Ok(b),
        _ => Err(format!(
            "a mean run of lost frames from 1 to {}, such as 8",
            closbox_fabric::config::MAX_LOSS_BURST
        )),
    }
}

/// A count of 1 or more (clap's own range names u64::MAX as its end).
pub(crate) fn at_least_one(s: &str) -> Result<u64, String> {
    match s.parse::<u64>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("{s:?} is not a whole number")),
    }
}

pub(crate) fn non_negative(s: &str) -> Result<f64, String> {
    number(s).and_then(|v| {
        if v >= 0.0 {
            Ok(v)
        } else {
            Err("must not be negative".into())
        }
    })
}

/// Wall-time seconds, as `timeout(1)` takes them: a number, or one with the suffix s, m, h
/// or d ("90", "1.5m", "2h"), or ms as closbox's other durations take it.
pub(crate) fn seconds(s: &str) -> Result<std::time::Duration, String> {
    let t = s.trim();
    let (n, unit) = match t.char_indices().last() {
        _ if t.ends_with("ms") => (&t[..t.len() - 2], 'u'),
        Some((i, c @ ('s' | 'm' | 'h' | 'd'))) => (&t[..i], c),
        _ => (s, 's'),
    };
    let v = number(n)
        .map_err(|_| format!("{s:?} is not a time: seconds, or with a suffix: 90, 1.5m, 2h"))?;
    if v <= 0.0 {
        return Err("must be above 0".into());
    }
    let per = match unit {
        'u' => 1e-3,
        'm' => 60.0,
        'h' => 3600.0,
        'd' => 86400.0,
        _ => 1.0,
    };
    std::time::Duration::try_from_secs_f64(v * per).map_err(|_| "too long".into())
}

#[derive(Debug, clap::Args)]
pub(crate) struct UpArgs {
    /// Topology file.
    pub(crate) file: PathBuf,
    /// Return once the fabric is ready; the daemon keeps running.
    #[arg(long)]
    pub(crate) detach: bool,
    /// Bring the file's fabric up under this name instead of its `[fabric] name`
    /// (namespaces, state, logs and commands' `-f` go by it): one topology file up
    /// twice at once, e.g. by tests that run in parallel.
    #[arg(long, value_name = "NAME")]
    pub(crate) name: Option<FabricName>,
    /// (Internal, used by --detach) once the fabric's lock is taken, send all output
    /// to this file.
    #[arg(long, hide = true, conflicts_with = "detach")]
    pub(crate) log_to: Option<PathBuf>,
    /// Serve Prometheus metrics at http://ADDR/metrics (a loopback address, e.g.
    /// 127.0.0.1:9464).
    #[arg(long, value_name = "ADDR", value_parser = loopback_addr)]
    pub(crate) metrics: Option<std::net::SocketAddr>,
    /// Override the file's time_scale: a number from 1 to 1000000, or "auto" (measure
    /// this box at up and choose).
    #[arg(long, value_name = "auto|K", value_parser = time_scale_arg)]
    pub(crate) time_scale: Option<live::TimeScaleArg>,
    /// Run the data plane's thread in the real-time class (SCHED_FIFO 10): it wakes
    /// without waiting for a CPU when the GPUs' processes keep every CPU busy (MPI
    /// ranks that poll). Safety valve: it drops back to nice -15 whenever it runs 10 ms
    /// without sleeping.
    #[arg(long)]
    pub(crate) realtime: bool,
    /// Keep idle CPUs polling instead of halting while the fabric is up (a CPU
    /// latency of 0 asked of the kernel through /dev/cpu_dma_latency, dropped at down
    /// or however the daemon ends). Where idle CPUs halt (VMs), a wake-up of the data
    /// plane or of a GPU's process then takes microseconds, not tens of them, and
    /// most of what a busy host steals (the time to run a halted CPU again) is taken
    /// back. Costs the CPUs' idle time: power, and on a VM the host's CPU. Only a
    /// kernel with a cpuidle driver honours it (`up` warns where there is none).
    #[arg(long)]
    pub(crate) idle_poll: bool,
    /// Take the fabric down when process PID ends, however it ends (a test harness
    /// passes its own pid, as closbox's Rust and pytest fixtures do: a test process
    /// killed by a timeout leaves no fabric behind).
    #[arg(long, value_name = "PID")]
    pub(crate) owner: Option<u32>,
}

#[derive(Debug, clap::Args)]
#[command(
    override_usage = "closbox plan FILE [--json]\n       closbox plan --gpus N --topology KIND [--radix K] [--json]"
)]
pub(crate) struct PlanArgs {
    /// Topology file to describe.
    #[arg(conflicts_with_all = ["gpus", "topology", "radix"], required_unless_present_any = ["gpus", "topology"])]
    pub(crate) file: Option<PathBuf>,
    /// Size fabrics for this many GPUs instead of reading a file.
    #[arg(long, requires = "topology", value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
    pub(crate) gpus: Option<u64>,
    /// Which fabric to size for --gpus.
    #[arg(long, value_enum, requires = "gpus")]
    pub(crate) topology: Option<SizeKind>,
    /// Ports per switch for --gpus (even) [default: 64].
    #[arg(long, value_parser = parse_radix, requires = "gpus")]
    pub(crate) radix: Option<u64>,
    /// Print JSON instead of tables.
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum SizeKind {
    LeafSpine,
    FatTree,
    FullMesh,
    SingleSwitch,
}

pub(crate) fn parse_radix(s: &str) -> Result<u64, String> {
    let k: u64 = s.parse().map_err(|_| format!("{s:?} is not a number"))?;
    if !(4..=4096).contains(&k) || k % 2 != 0 {
        return Err(format!("radix {k} must be even and in 4..=4096"));
    }
    Ok(k)
}

/// A fabric on the command line: its name, or the topology file it was brought up from
/// (`closbox down configs/default.toml`), whose `[fabric] name` it is. A valid name is a
/// name even if a file of that name exists; anything else that is a file, or ends in
/// `.toml`, is read as a topology file (its errors name the file and line).
pub(crate) fn fabric_ref(s: &str) -> Result<FabricName, String> {
    if let Ok(name) = s.parse() {
        return Ok(name);
    }
    let path = std::path::Path::new(s);
    if !(path.is_file() || s.ends_with(".toml")) {
        return s.parse();
    }
    live::fabric_of_file(path)
}

/// A fabric positional, or with `-f` as every command takes it: for commands with no
/// other positional argument whose default is the only fabric up.
#[derive(Debug, clap::Args)]
pub(crate) struct FabricChoice {
    /// Fabric: a name or its topology file (default: the only fabric up).
    #[arg(value_name = "FABRIC", value_parser = fabric_ref)]
    pub(crate) positional: Option<FabricName>,
    /// The same, as other commands take it.
    #[arg(long = "fabric", short = 'f', value_name = "FABRIC", value_parser = fabric_ref, conflicts_with = "positional")]
    pub(crate) flag: Option<FabricName>,
}

impl FabricChoice {
    pub(crate) fn get(&self) -> Option<&FabricName> {
        self.positional.as_ref().or(self.flag.as_ref())
    }
}

/// How many words an option takes after it for sure: none for a flag or an optional
/// value (`load --stop [ID]`), 2 for `--mca KEY VALUE`.
fn values_taken(arg: &clap::Arg) -> usize {
    if !arg.get_action().takes_values() {
        return 0;
    }
    arg.get_num_args().map_or(1, |r| r.min_values())
}

/// `--delay -1us`: clap takes a value starting with '-' for options ("unexpected argument
/// '-1' found"); joined as `--delay=-1us` it reaches the option's parser, which says what
/// is wrong with it ("must not be negative"). Only for long options that take a value,
/// and only before `--` and before the command a subcommand passes on (exec, run, …),
/// whose arguments are the program's.
pub(crate) fn join_negative_values(
    mut cmd: &clap::Command,
    args: Vec<std::ffi::OsString>,
) -> Vec<std::ffi::OsString> {
    let mut out = Vec::with_capacity(args.len());
    let mut it = args.into_iter();
    out.extend(it.next()); // the program's name
    let mut rest = it.peekable();
    while let Some(a) = rest.next() {
        let Some(s) = a.to_str() else {
            out.push(a);
            continue;
        };
        if s == "--" {
            out.push(a);
            break;
        }
        // mpirun's single-dash `-np N`, which clap would read as `-n p`.
        if s == "-np" && cmd.get_name() == "mpirun" {
            out.push("--np".into());
            continue;
        }
        if let Some(name) = s.strip_prefix("--").filter(|n| !n.contains('=')) {
            let values = cmd
                .get_arguments()
                .find(|arg| arg.get_long() == Some(name))
                .map_or(0, values_taken);
            let negative = rest.peek().and_then(|v| v.to_str()).is_some_and(|v| {
                v.strip_prefix('-')
                    .is_some_and(|n| n.starts_with(|c: char| c.is_ascii_digit() || c == '.'))
            });
            if values == 1 && negative {
                let v = rest.next().expect("peeked");
                out.push(format!("--{name}={}", v.to_str().expect("peeked as str")).into());
                continue;
            }
            out.push(a);
            // Its values are its own, not a command's first word (`-f ls16 -np 2`).
            out.extend(rest.by_ref().take(values));
            continue;
        }
        // A short option that takes its value from the next word (`-f ls16`).
        if let Some(c) = s.strip_prefix('-').and_then(|f| {
            let mut chars = f.chars();
            chars.next().filter(|_| chars.next().is_none())
        }) {
            let values = cmd
                .get_arguments()
                .find(|arg| arg.get_short() == Some(c))
                .map_or(0, values_taken);
            out.push(a);
            out.extend(rest.by_ref().take(values));
            continue;
        }
        if !s.starts_with('-') {
            if let Some(sub) = cmd.find_subcommand(s) {
                cmd = sub;
            } else if cmd.get_arguments().any(|arg| arg.is_trailing_var_arg_set()) {
                // An operand of a command that passes the rest on: not ours to touch.
                out.push(a);
                break;
            }
        }
        out.push(a);
    }
    out.extend(rest);
    out
}
