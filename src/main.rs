//! `closbox`: the command line. Parses arguments, calls into the fabric crate, prints.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use closbox_switchd::control::ChangeRequest;
use closbox_switchd::state::FabricName;

mod bench;
mod capture;
mod chaos;
mod flows;
mod live;
mod plan;
mod record;
mod render;
mod status;
mod top;

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
    /// Bring a fabric up: a namespace, hostname and TUN per GPU, and the switch daemon.
    /// Runs in the foreground (Ctrl-C tears it down) unless --detach.
    Up {
        /// Topology file.
        file: PathBuf,
        /// Return once the fabric is ready; the daemon keeps running.
        #[arg(long)]
        detach: bool,
        /// (Internal, used by --detach) once the fabric's lock is taken, send all output
        /// to this file.
        #[arg(long, hide = true, conflicts_with = "detach")]
        log_to: Option<PathBuf>,
        /// Serve Prometheus metrics at http://ADDR/metrics (a loopback address, e.g.
        /// 127.0.0.1:9464).
        #[arg(long, value_name = "ADDR", value_parser = loopback_addr)]
        metrics: Option<std::net::SocketAddr>,
        /// Override the file's time_scale: a number from 1 to 1000000, or "auto" (measure
        /// this box at up and choose).
        #[arg(long, value_name = "auto|K", value_parser = time_scale_arg)]
        time_scale: Option<live::TimeScaleArg>,
        /// Run the data plane's thread in the real-time class (SCHED_FIFO 10): it wakes
        /// without waiting for a CPU when the GPUs' processes keep every CPU busy (MPI
        /// ranks that poll). Safety valve: it drops back to nice -15 whenever it runs 10 ms
        /// without sleeping.
        #[arg(long)]
        realtime: bool,
        /// Keep idle CPUs polling instead of halting while the fabric is up (a CPU
        /// latency of 0 asked of the kernel through /dev/cpu_dma_latency, dropped at down
        /// or however the daemon ends). Where idle CPUs halt (VMs), a wake-up of the data
        /// plane or of a GPU's process then takes microseconds, not tens of them. Costs
        /// the CPUs' idle time: power, and on a VM the host's CPU.
        #[arg(long)]
        idle_poll: bool,
    },
    /// Take fabrics down: exactly what `up` made, also after a crash. Idempotent.
    Down {
        /// Fabric name, or the topology file it was brought up from (default: the only
        /// fabric up).
        #[arg(value_parser = fabric_ref)]
        fabric: Option<FabricName>,
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
        /// PATTERN ("leaf0->", "spine1"); without it, the five busiest or most dropping.
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
        /// Bucket size, e.g. 25M (at most --model).
        #[arg(long, default_value = "4M", value_parser = one_size)]
        bucket: usize,
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
        /// Show this many flows.
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
        #[arg(long, default_value_t = 8)]
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
        /// GPUs: "all", ranks and ranges ("0-3,6") or names; rank i runs on the i-th.
        #[arg(long, default_value = "all")]
        gpus: String,
        /// Stop the job after this many seconds, or 1.5m, 2h (exit 124).
        #[arg(long, value_parser = seconds, allow_negative_numbers = true)]
        timeout: Option<std::time::Duration>,
        /// The MPI whose launcher to use (default: Open MPI if installed, else MPICH).
        #[arg(long = "impl", value_name = "IMPL")]
        implementation: Option<live::MpiImpl>,
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
        /// GPUs: "all", ranks and ranges ("0-3,6") or names ("gpu0,gpu5").
        #[arg(long, default_value = "all")]
        gpus: String,
        /// Stop every rank after this many seconds, or 1.5m, 2h (exit 124).
        #[arg(long, value_parser = seconds, allow_negative_numbers = true)]
        timeout: Option<std::time::Duration>,
        /// MASTER_PORT for torch.distributed-style rendezvous.
        #[arg(long, default_value_t = 29500, value_parser = clap::value_parser!(u16).range(1..))]
        master_port: u16,
        /// A chaos scenario (`closbox chaos`) to run with the job: its time 0 is the job's
        /// start; it is cancelled when the job ends, as `closbox cancel` does (repairs of what it broke made at once, its loads stopped).
        #[arg(long, value_name = "FILE")]
        chaos: Option<PathBuf>,
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
struct LinkArgs {
    /// A GPU or switch name, as `plan` and `status` show them.
    a: String,
    /// The GPU or switch at the other end.
    b: String,
    /// One of several parallel links (from 0); default: all of them.
    #[arg(long)]
    index: Option<u32>,
    /// Fabric (default: the only fabric up).
    #[arg(long, short, value_parser = fabric_ref)]
    fabric: Option<FabricName>,
}

#[derive(Debug, Subcommand)]
enum LinkCmd {
    /// Take the link(s) down: what they carry is lost; the switches at the ends stop using
    /// them after `failure_detection`, the fabric reroutes after `route_convergence`.
    Down(LinkArgs),
    /// Bring the link(s) back; routes use them again after `route_convergence`.
    Up(LinkArgs),
    /// Degrade or change the link(s), both directions: rate and delay at once (what a port holds drains at the new rate), loss and buffer for packets from now on.
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
        /// Egress buffer at both ends, e.g. 1MiB.
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
struct FlapArgs {
    /// How long the links stay down each time (fabric time), e.g. 10ms.
    #[arg(long)]
    down: closbox_fabric::Duration,
    /// How long they stay up before the next time.
    #[arg(long)]
    up: closbox_fabric::Duration,
    /// How many times.
    #[arg(long, default_value_t = 1)]
    count: u32,
}

#[derive(Debug, Subcommand)]
enum UpDown {
    /// Every link of it goes down.
    Down {
        /// Its name, as `plan` and `status` show it (spine1, gpu3).
        name: String,
        /// Fabric (default: the only fabric up).
        #[arg(long, short, value_parser = fabric_ref)]
        fabric: Option<FabricName>,
    },
    /// Every link of it comes back.
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
struct TargetArgs {
    /// Fabric (default: the only fabric up).
    #[arg(long, short, value_parser = fabric_ref)]
    fabric: Option<FabricName>,
    /// GPUs: "all", ranks and ranges ("0-3,6") or names.
    #[arg(long, default_value = "all")]
    gpus: String,
    /// Parallel TCP connections per pair of ranks (ECMP can spread them).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=64))]
    channels: u32,
    /// Stop the agents after this many seconds of wall time, or 1.5m, 2h (default: no limit; each
    /// agent gives up on its own when a peer is silent for 60 s).
    #[arg(long, value_parser = seconds, allow_negative_numbers = true)]
    timeout: Option<std::time::Duration>,
    /// A chaos scenario (`closbox chaos`) to run with the job: its time 0 is the job's
    /// start; it is cancelled when the job ends, as `closbox cancel` does (repairs of what it broke made at once, its loads stopped).
    #[arg(long, value_name = "FILE")]
    chaos: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
struct BenchOpts {
    #[command(flatten)]
    agent: closbox_agents::bench::Options,
    /// Print the rows as a JSON array instead of the table.
    #[arg(long, conflicts_with = "csv")]
    json: bool,
    /// Print CSV instead of the table.
    #[arg(long)]
    csv: bool,
    /// Write busbw against size as an SVG.
    #[arg(long)]
    plot: Option<PathBuf>,
}

impl TargetArgs {
    fn target(&self) -> bench::Target<'_> {
        bench::Target {
            fabric: self.fabric.as_ref(),
            gpus: &self.gpus,
            channels: self.channels as usize,
            timeout: self.timeout,
            chaos: self.chaos.as_deref(),
        }
    }
}

/// A usage error found after parsing (bad combinations, values checked against the
/// fabric): exit 2, as clap's own.
#[derive(Debug)]
pub(crate) struct Usage(pub String);

impl std::fmt::Display for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Usage {}

pub(crate) fn usage(msg: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(Usage(msg.into()))
}

/// A program `exec` or `run` could not start: exit 127 when it was not found, 126 when it
/// was found but could not be run (as POSIX shells, `env` and `timeout` exit), so that a
/// caller that passes exit codes through (an MPI launcher's remote shell) sees which.
#[derive(Debug)]
pub(crate) struct CannotRun {
    pub code: u8,
    pub message: String,
}

impl std::fmt::Display for CannotRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for CannotRun {}

fn time_scale_arg(s: &str) -> Result<live::TimeScaleArg, String> {
    if s == "auto" {
        return Ok(live::TimeScaleArg::Auto);
    }
    s.parse::<f64>()
        .ok()
        .and_then(closbox_fabric::TimeScale::new)
        .map(live::TimeScaleArg::Fixed)
        .ok_or_else(|| format!("{s:?}: a time scale from 1 to 1000000, or \"auto\""))
}

fn loopback_addr(s: &str) -> Result<std::net::SocketAddr, String> {
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

fn parse_algo(s: &str) -> Result<closbox_agents::Algo, String> {
    closbox_agents::Algo::from_name(s)
        .ok_or_else(|| format!("unknown algorithm {s:?}: auto, ring, tree, rhd or hier"))
}

fn one_size(s: &str) -> Result<usize, String> {
    match closbox_agents::bench::parse_sizes(s)?.as_slice() {
        [one] => Ok(*one),
        _ => Err("takes one size, such as 64M".into()),
    }
}

fn number(s: &str) -> Result<f64, String> {
    s.parse::<f64>()
        .ok()
        .filter(|v| v.is_finite())
        .ok_or_else(|| format!("{s:?} is not a number"))
}

/// `train`'s compute per step at most (ms of fabric time): an hour.
const MAX_COMPUTE_MS: f64 = 3_600_000.0;

fn positive(s: &str) -> Result<f64, String> {
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
fn probability(s: &str) -> Result<f64, String> {
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
fn loss_burst(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(b) if closbox_fabric::config::loss_burst_ok(b) => Ok(b),
        _ => Err(format!(
            "a mean run of lost frames from 1 to {}, such as 8",
            closbox_fabric::config::MAX_LOSS_BURST
        )),
    }
}

/// A count of 1 or more (clap's own range names u64::MAX as its end).
fn at_least_one(s: &str) -> Result<u64, String> {
    match s.parse::<u64>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("{s:?} is not a whole number")),
    }
}

fn non_negative(s: &str) -> Result<f64, String> {
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
fn seconds(s: &str) -> Result<std::time::Duration, String> {
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

fn run_bench(ops: Vec<String>, target: &TargetArgs, o: BenchOpts) -> anyhow::Result<()> {
    let ops = if ops.is_empty() {
        vec!["allreduce".to_owned()]
    } else {
        ops
    };
    let ops = closbox_agents::bench::parse_ops(&ops).map_err(|e| usage(e.to_string()))?;
    if let Some(p) = &o.plot {
        bench::check_plot_path(p)?;
    }
    bench::bench(bench::BenchArgs {
        target: target.target(),
        ops,
        opts: o.agent,
        json: o.json,
        csv: o.csv,
        plot: o.plot,
    })
}

#[derive(Debug, clap::Args)]
#[command(
    override_usage = "closbox plan FILE [--json]\n       closbox plan --gpus N --topology KIND [--radix K] [--json]"
)]
struct PlanArgs {
    /// Topology file to describe.
    #[arg(conflicts_with_all = ["gpus", "topology", "radix"], required_unless_present_any = ["gpus", "topology"])]
    file: Option<PathBuf>,
    /// Size fabrics for this many GPUs instead of reading a file.
    #[arg(long, requires = "topology", value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
    gpus: Option<u64>,
    /// Which fabric to size for --gpus.
    #[arg(long, value_enum, requires = "gpus")]
    topology: Option<SizeKind>,
    /// Ports per switch for --gpus (even) [default: 64].
    #[arg(long, value_parser = parse_radix, requires = "gpus")]
    radix: Option<u64>,
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

/// A fabric positional, or with `-f` as every command takes it: for commands with no
/// other positional argument whose default is the only fabric up.
#[derive(Debug, clap::Args)]
struct FabricChoice {
    /// Fabric: a name or its topology file (default: the only fabric up).
    #[arg(value_name = "FABRIC", value_parser = fabric_ref)]
    positional: Option<FabricName>,
    /// The same, as other commands take it.
    #[arg(long = "fabric", short = 'f', value_name = "FABRIC", value_parser = fabric_ref, conflicts_with = "positional")]
    flag: Option<FabricName>,
}

impl FabricChoice {
    fn get(&self) -> Option<&FabricName> {
        self.positional.as_ref().or(self.flag.as_ref())
    }
}

/// `closbox switch|gpu down|up|flap`: every link of a switch, or of a GPU.
fn up_down(cmd: UpDown, gpu: bool) -> anyhow::Result<ExitCode> {
    let (fabric, req) = match cmd {
        UpDown::Down { name, fabric } if gpu => (fabric, ChangeRequest::GpuDown { name }),
        UpDown::Down { name, fabric } => (fabric, ChangeRequest::SwitchDown { name }),
        UpDown::Up { name, fabric } if gpu => (fabric, ChangeRequest::GpuUp { name }),
        UpDown::Up { name, fabric } => (fabric, ChangeRequest::SwitchUp { name }),
        UpDown::Flap { name, flap, fabric } => (
            fabric,
            ChangeRequest::SwitchFlap {
                name,
                gpu,
                down_ns: flap.down.as_nanos(),
                up_ns: flap.up.as_nanos(),
                count: flap.count,
            },
        ),
    };
    chaos::change(fabric.as_ref(), req)
}

/// A fabric on the command line: its name, or the topology file it was brought up from
/// (`closbox down configs/default.toml`), whose `[fabric] name` it is. A valid name is a
/// name even if a file of that name exists; anything else that is a file, or ends in
/// `.toml`, is read as a topology file (its errors name the file and line).
fn fabric_ref(s: &str) -> Result<FabricName, String> {
    if let Ok(name) = s.parse() {
        return Ok(name);
    }
    let path = std::path::Path::new(s);
    if !(path.is_file() || s.ends_with(".toml")) {
        return s.parse();
    }
    live::fabric_of_file(path)
}

/// `--delay -1us`: clap takes a value starting with '-' for options ("unexpected argument
/// '-1' found"); joined as `--delay=-1us` it reaches the option's parser, which says what
/// is wrong with it ("must not be negative"). Only for long options that take a value,
/// and only before `--` and before the command a subcommand passes on (exec, run, …),
/// whose arguments are the program's.
fn join_negative_values(
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
        if let Some(name) = s.strip_prefix("--").filter(|n| !n.contains('=')) {
            let takes_value = cmd
                .get_arguments()
                .any(|arg| arg.get_long() == Some(name) && arg.get_action().takes_values());
            let negative = rest.peek().and_then(|v| v.to_str()).is_some_and(|v| {
                v.strip_prefix('-')
                    .is_some_and(|n| n.starts_with(|c: char| c.is_ascii_digit() || c == '.'))
            });
            if takes_value && negative {
                let v = rest.next().expect("peeked");
                out.push(format!("--{name}={}", v.to_str().expect("peeked as str")).into());
                continue;
            }
            out.push(a);
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

fn main() -> ExitCode {
    live::undilate_self();
    closbox_switchd::sys::default_sigpipe();
    let cli = {
        use clap::CommandFactory;
        let cmd = Cli::command();
        Cli::parse_from(join_negative_values(&cmd, std::env::args_os().collect()))
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("CLOSBOX_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let result = match cli.command {
        Command::Plan(args) => run_plan(args).map(|()| ExitCode::SUCCESS),
        Command::Up {
            file,
            detach,
            log_to,
            metrics,
            time_scale,
            realtime,
            idle_poll,
        } => live::up(
            &file,
            detach,
            log_to.as_deref(),
            metrics,
            time_scale,
            closbox_switchd::Scheduling {
                realtime,
                idle_poll,
            },
        )
        .map(|()| ExitCode::SUCCESS),
        Command::Down {
            fabric,
            fabric_flag,
            all,
        } => live::down(fabric.or(fabric_flag).as_ref(), all).map(|()| ExitCode::SUCCESS),
        Command::Status {
            fabric,
            fabric_flag,
            json,
            ports,
        } => status::status(fabric.or(fabric_flag).as_ref(), json, ports.as_deref()),
        Command::Link(cmd) => {
            // The link(s) a command names, as the request's three fields.
            let named = |l: &LinkArgs| (l.a.clone(), l.b.clone(), l.index);
            let (l, req) = match cmd {
                LinkCmd::Down(l) => {
                    let (a, b, index) = named(&l);
                    (l, ChangeRequest::LinkDown { a, b, index })
                }
                LinkCmd::Up(l) => {
                    let (a, b, index) = named(&l);
                    (l, ChangeRequest::LinkUp { a, b, index })
                }
                LinkCmd::Reset(l) => {
                    let (a, b, index) = named(&l);
                    (l, ChangeRequest::LinkReset { a, b, index })
                }
                LinkCmd::Flap { link: l, flap } => {
                    let (a, b, index) = named(&l);
                    let r = ChangeRequest::LinkFlap {
                        a,
                        b,
                        index,
                        down_ns: flap.down.as_nanos(),
                        up_ns: flap.up.as_nanos(),
                        count: flap.count,
                    };
                    (l, r)
                }
                LinkCmd::Set {
                    link: l,
                    rate,
                    delay,
                    loss,
                    loss_burst,
                    from,
                    buffer,
                } => {
                    let (a, b, index) = named(&l);
                    let r = ChangeRequest::LinkSet {
                        a,
                        b,
                        index,
                        rate_bps: rate.map(|r| r.bps()),
                        delay_ns: delay.map(|d| d.as_nanos()),
                        loss,
                        loss_burst,
                        buffer_bytes: buffer.map(|b| b.get()),
                        from,
                    };
                    (l, r)
                }
            };
            chaos::change(l.fabric.as_ref(), req)
        }
        Command::Switch(cmd) => up_down(cmd, false),
        Command::Gpu(cmd) => up_down(cmd, true),
        Command::Events {
            fabric,
            json,
            follow,
        } => chaos::events(fabric.get(), json, follow),
        Command::Load {
            from,
            to,
            rate,
            duration,
            on,
            off,
            packet,
            stop,
            fabric,
        } => (|| {
            let req = match stop {
                Some(id) => ChangeRequest::LoadStop { id },
                None => ChangeRequest::Load {
                    from: from.expect("clap requires it"),
                    to: to.expect("clap requires it"),
                    rate_bps: rate.expect("clap requires it").bps(),
                    packet_bytes: match packet {
                        Some(p) => Some(u32::try_from(p.get()).map_err(|_| {
                            usage("--packet must be at most the fabric's mtu")
                        })?),
                        None => None,
                    },
                    for_ns: duration.map(|d| d.as_nanos()),
                    on_ns: on.map(|d| d.as_nanos()),
                    off_ns: off.map(|d| d.as_nanos()),
                },
            };
            chaos::load(fabric.as_ref(), req)
        })(),
        Command::Incast {
            gpu,
            from,
            bytes,
            every,
            count,
            fabric,
        } => chaos::incast(
            fabric.as_ref(),
            gpu,
            &from,
            bytes.get(),
            every.map(|d| d.as_nanos()),
            count,
        ),
        Command::Capture {
            ports,
            links,
            gpus,
            all,
            file,
            count,
            duration,
            snaplen,
            drops,
            fabric,
        } => capture::capture(capture::Args {
            fabric: fabric.get(),
            select: capture::Selection {
                ports: &ports,
                links: &links,
                gpus: &gpus,
                all,
            },
            file: &file,
            count,
            duration_ns: duration.map(|d| d.as_nanos()),
            snaplen,
            drops,
        }),
        Command::Flows {
            top,
            since,
            json,
            fabric,
        } => flows::flows(fabric.get(), top, since, json),
        Command::Record {
            file,
            interval,
            ports,
            duration,
            fabric,
        } => record::record(record::RecordArgs {
            fabric: fabric.get(),
            file: &file,
            interval,
            ports: ports.as_deref(),
            duration,
        }),
        Command::Plot {
            file,
            out,
            metric,
            top,
        } => record::plot(&file, &out, metric, top),
        Command::Top { once, fabric } => top::top(fabric.get(), once),
        Command::Mpirun {
            fabric,
            gpus,
            timeout,
            implementation,
            mca,
            export,
            dry_run,
            fabric_clock,
            cmd,
        } => live::mpirun(live::MpirunArgs {
            fabric: fabric.as_ref(),
            gpus: &gpus,
            timeout,
            implementation,
            mca: &mca,
            export: &export,
            dry_run,
            fabric_clock,
            cmd: &cmd,
        }),
        Command::Rsh {
            fabric,
            cpu_map,
            host,
            cmd,
        } => rsh(fabric.as_ref(), cpu_map.as_deref(), &host, &cmd),
        Command::Chaos {
            file,
            dry_run,
            topology,
            detach,
            json,
            fabric,
        } => chaos::scenario_cmd(
            fabric.as_ref(),
            &file,
            dry_run,
            topology.as_deref(),
            detach,
            json,
        ),
        Command::Partition { groups, fabric } => chaos::partition(fabric.as_ref(), &groups),
        Command::Heal { fabric } => chaos::change(fabric.get(), ChangeRequest::Heal),
        Command::Reset { fabric } => chaos::change(fabric.get(), ChangeRequest::Reset),
        Command::Cancel { timeline, fabric } => chaos::cancel(fabric.as_ref(), timeline),
        Command::Exec {
            gpu,
            fabric,
            die_with_parent,
            fabric_clock,
            cmd,
        } => live::exec(fabric.as_ref(), &gpu, &cmd, die_with_parent, fabric_clock),
        Command::Bench { ops, target, opts } => {
            run_bench(ops, &target, opts).map(|()| ExitCode::SUCCESS)
        }
        Command::Train {
            target,
            model,
            bucket,
            compute_ms,
            flops,
            gpu_tflops,
            steps,
            algo,
            json,
        } => (|| {
            let compute_ms = match (compute_ms, flops, gpu_tflops) {
                (Some(ms), _, _) => Some(ms),
                (None, Some(f), Some(t)) => Some(f / (t * 1e12) * 1e3),
                _ => None,
            };
            if let Some(ms) = compute_ms.filter(|&ms| ms.is_nan() || ms > MAX_COMPUTE_MS) {
                let given = if flops.is_some() {
                    "--flops / --gpu-tflops"
                } else {
                    "--compute-ms"
                };
                return Err(usage(format!(
                    "{given}: {ms:e} ms of compute per step; at most {MAX_COMPUTE_MS} ms (one hour of fabric time)"
                )));
            }
            if model % 4 != 0 || bucket % 4 != 0 {
                return Err(usage(
                    "--model and --bucket must be whole numbers of f32 elements (multiples of 4 bytes)",
                ));
            }
            if bucket > model {
                return Err(usage(format!(
                    "--bucket ({bucket} bytes) is larger than --model ({model} bytes)"
                )));
            }
            bench::train(bench::TrainArgs {
                target: target.target(),
                model_bytes: model,
                bucket_bytes: bucket,
                compute_ms,
                steps: steps as usize,
                algo,
                json,
            })
        })()
        .map(|()| ExitCode::SUCCESS),
        Command::Run {
            fabric,
            gpus,
            timeout,
            master_port,
            chaos,
            fabric_clock,
            cmd,
        } => (|| {
            closbox_switchd::require_root("closbox run")?;
            let st = live::resolve(fabric.as_ref())?;
            let sel = live::select(&st, &gpus)?;
            if fabric_clock {
                live::enable_fabric_clock(&st)?;
            }
            let timeline = chaos
                .as_deref()
                .map(|f| chaos::Timeline::load(&st, f))
                .transpose()?;
            live::run(live::RunArgs {
                st: &st,
                sel: &sel,
                timeout,
                master_port,
                cmd: &cmd,
                sink: None,
                chaos: timeline.as_ref(),
            })
        })(),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("closbox: {e:#}");
            if e.downcast_ref::<Usage>().is_some() {
                ExitCode::from(2)
            } else if let Some(c) = e.downcast_ref::<CannotRun>() {
                ExitCode::from(c.code)
            } else {
                ExitCode::FAILURE
            }
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
            let s = closbox_fabric::plan::Sizing::new(gpus, args.radix.unwrap_or(64));
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

/// `host`'s CPU in a `--cpu-map` (`gpu0=0,gpu15=1`); an error if it is malformed or lacks
/// the host.
fn cpu_of(map: &str, host: &str) -> anyhow::Result<usize> {
    for pair in map.split(',') {
        let (h, c) = pair
            .split_once('=')
            .with_context(|| format!("--cpu-map: {pair:?} is not HOST=CPU"))?;
        if h == host {
            return c
                .parse()
                .with_context(|| format!("--cpu-map: {c:?} is not a CPU number"));
        }
    }
    anyhow::bail!("--cpu-map {map:?} has no CPU for {host}")
}

/// `closbox rsh`: `cmd` (words of one shell line, as ssh would run it) in GPU `host`,
/// ended with its launcher; on its CPU if `cpu_map` lists one for `host`.
fn rsh(
    fabric: Option<&FabricName>,
    cpu_map: Option<&str>,
    host: &str,
    cmd: &[String],
) -> anyhow::Result<ExitCode> {
    if let Some(cpu) = cpu_map.map(|m| cpu_of(m, host)).transpose()? {
        closbox_switchd::sys::pin_to_cpu(cpu)
            .with_context(|| format!("pinning {host}'s command to CPU {cpu}"))?;
    }
    let line = format!("exec {}", cmd.join(" "));
    live::exec(
        fabric,
        host,
        &["sh".to_owned(), "-c".to_owned(), line],
        true,
        false,
    )
}

#[cfg(test)]
mod tests {
    use super::cpu_of;

    #[test]
    fn cpu_map_gives_the_hosts_cpu_or_names_the_problem() {
        assert_eq!(cpu_of("gpu0=0,gpu15=1", "gpu15").unwrap(), 1);
        assert_eq!(cpu_of("gpu0=0,gpu15=1", "gpu0").unwrap(), 0);
        let e = cpu_of("gpu0=0", "gpu1").unwrap_err().to_string();
        assert!(e.contains("no CPU for gpu1"), "{e}");
        let e = cpu_of("gpu0:0", "gpu0").unwrap_err().to_string();
        assert!(e.contains("is not HOST=CPU"), "{e}");
        let e = cpu_of("gpu0=x", "gpu0").unwrap_err().to_string();
        assert!(e.contains("\"x\" is not a CPU number"), "{e}");
    }

    /// `--help` says what every argument of every command is for (hidden ones aside).
    #[test]
    fn every_argument_has_help() {
        use clap::CommandFactory;
        fn walk(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
            if cmd.is_hide_set() {
                return;
            }
            let path = format!("{path} {}", cmd.get_name());
            for a in cmd.get_arguments() {
                let builtin = matches!(a.get_id().as_str(), "help" | "version");
                if !builtin && !a.is_hide_set() && a.get_help().is_none() {
                    missing.push(format!("{path} {}", a.get_id()));
                }
            }
            for sub in cmd.get_subcommands() {
                walk(sub, &path, missing);
            }
        }
        let mut missing = Vec::new();
        walk(&crate::Cli::command(), "", &mut missing);
        assert!(missing.is_empty(), "no help for: {missing:?}");
    }

    #[test]
    fn negative_values_are_joined_to_their_option_and_programs_args_left_alone() {
        use clap::CommandFactory;
        let cmd = crate::Cli::command();
        let join = |args: &[&str]| -> Vec<String> {
            crate::join_negative_values(&cmd, args.iter().map(|a| (*a).into()).collect())
                .into_iter()
                .map(|a| a.into_string().unwrap())
                .collect()
        };
        assert_eq!(
            join(&["closbox", "link", "set", "a", "b", "--delay", "-1us", "--rate", "-.5G"]),
            [
                "closbox",
                "link",
                "set",
                "a",
                "b",
                "--delay=-1us",
                "--rate=-.5G"
            ]
        );
        // Not a value: a flag, or an option that is not a number.
        for args in [
            &["closbox", "up", "x.toml", "--detach", "-5"][..],
            &[
                "closbox", "link", "set", "a", "b", "--rate", "--delay", "1us",
            ],
            // A program's arguments: after exec's GPU, after `--`.
            &["closbox", "exec", "gpu0", "tool", "--delay", "-1"],
            &["closbox", "run", "--", "tool", "--delay", "-1"],
            &["closbox", "mpirun", "-n", "2", "prog", "--delay", "-1"],
        ] {
            assert_eq!(join(args), args, "{args:?}");
        }
    }
}
