//! `up`, `down`, `status`, `exec`, `run`: the live fabric from the command line.

use std::collections::BTreeMap;
use std::fs;
use std::io::{IsTerminal, Read, Write};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use closbox_switchd::state::{self, FabricName, GpuState, Phase, State};
use closbox_switchd::stop::{terminate, Targets};
use closbox_switchd::{netns, sys};

/// The fabric a command addresses: the one named, or the only one up.
pub fn resolve(fabric: Option<&FabricName>) -> anyhow::Result<State> {
    let name = match fabric {
        Some(n) => n.clone(),
        None => match state::fabrics().as_slice() {
            [] => bail!("no fabric is up; start one with `closbox up FILE`"),
            [one] => one.clone(),
            many => bail!(
                "several fabrics are up ({}): name one with --fabric",
                join(many)
            ),
        },
    };
    let Some(st) = State::load(&name)? else {
        let up = state::fabrics();
        bail!(
            "fabric {name} is not up{}{}",
            if up.is_empty() {
                String::new()
            } else {
                format!(" (up: {})", join(&up))
            },
            file_named_like(&name)
        );
    };
    if !st.daemon_alive() {
        bail!("the daemon of fabric {name} is not running (crashed or killed); `closbox down {name}` cleans up");
    }
    if st.phase != Phase::Ready {
        bail!("fabric {name} is {:?}, not ready", st.phase);
    }
    Ok(st)
}

/// "; configs/single-switch-8.toml is fabric ss8": a name that is not up but is the stem
/// of a topology file here or in `configs/` whose fabric has another name (the name a
/// newcomer reaches for).
pub(crate) fn file_named_like(name: &FabricName) -> String {
    for dir in [Path::new("."), Path::new("configs")] {
        let file = dir.join(format!("{name}.toml"));
        if !file.is_file() {
            continue;
        }
        if let Ok(fabric) = fabric_of_file(&file) {
            if &fabric != name {
                return format!(
                    "; {} is fabric {fabric} (a topology file's path names its fabric too)",
                    file.display()
                );
            }
        }
    }
    String::new()
}

/// The fabric a topology file describes (its `[fabric] name`); its errors name the file
/// and line.
pub fn fabric_of_file(path: &Path) -> Result<FabricName, String> {
    let topo = closbox_fabric::load(path).map_err(|e| format!("{e:#}"))?;
    topo.fabric.name.parse()
}

fn join(names: &[FabricName]) -> String {
    names
        .iter()
        .map(FabricName::as_str)
        .collect::<Vec<_>>()
        .join(", ")
}

/// `up --time-scale`.
#[derive(Clone, Copy, Debug)]
pub enum TimeScaleArg {
    Auto,
    Fixed(closbox_fabric::TimeScale),
}

impl std::fmt::Display for TimeScaleArg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TimeScaleArg::Auto => f.write_str("auto"),
            TimeScaleArg::Fixed(k) => write!(f, "{}", k.get()),
        }
    }
}

/// "time_scale 2000 (auto: …why…)".
fn time_scale_note(st: &State) -> String {
    match &st.time_scale_note {
        Some(why) => format!("time_scale {} (auto: {why})", st.time_scale),
        None => format!("time_scale {}", st.time_scale),
    }
}

pub fn up(
    file: &Path,
    detach: bool,
    log_to: Option<&Path>,
    metrics: Option<std::net::SocketAddr>,
    time_scale: Option<TimeScaleArg>,
    sched: closbox_switchd::Scheduling,
) -> anyhow::Result<()> {
    let mut topo = closbox_fabric::load(file)?;
    match time_scale {
        Some(TimeScaleArg::Auto) => topo.fabric.time_scale_auto = true,
        Some(TimeScaleArg::Fixed(k)) => {
            topo.fabric.time_scale = k;
            topo.fabric.time_scale_auto = false;
        }
        None => {}
    }
    closbox_switchd::require_root("closbox up")?;
    // (The detached daemon, started with --log-to, would say it again into its log.)
    if topo.fabric.time_scale_auto && log_to.is_none() {
        eprintln!(
            "closbox: fabric {}: time_scale \"auto\": measuring what this box carries through the fabric's own data path (1–4 s)",
            topo.fabric.name
        );
    }
    if detach {
        let name = topo.fabric.name.parse().map_err(anyhow::Error::msg)?;
        return up_detached(file, &name, metrics, time_scale, sched);
    }
    closbox_switchd::run_fabric(&topo, file, log_to, metrics, sched, |st, took| {
        let how = if log_to.is_some() {
            format!(
                "detached daemon pid {}; `closbox down {}` to stop",
                std::process::id(),
                st.fabric
            )
        } else {
            format!("Ctrl-C or `closbox down {}` to stop", st.fabric)
        };
        println!(
            "fabric {} up: {} in {:.2} s, {} (namespaces {} … {}); {how}",
            st.fabric,
            crate::bench::plural(st.gpus.len(), "GPU"),
            took.as_secs_f64(),
            time_scale_note(st),
            st.gpus.first().map_or("", |g| &g.netns),
            st.gpus.last().map_or("", |g| &g.netns),
        );
        let _ = std::io::stdout().flush();
    })?;
    println!("fabric {} is down", topo.fabric.name);
    Ok(())
}

fn up_detached(
    file: &Path,
    name: &FabricName,
    metrics: Option<std::net::SocketAddr>,
    time_scale: Option<TimeScaleArg>,
    sched: closbox_switchd::Scheduling,
) -> anyhow::Result<()> {
    if let Some(st) = State::load(name)? {
        if st.daemon_alive() {
            bail!(
                "fabric {name} is already up (daemon pid {}); `closbox down {name}` first",
                st.daemon_pid
            );
        }
    }
    let log_path = name.log_path();
    let started = Instant::now();
    let exe = std::env::current_exe().context("locating the closbox binary")?;
    // The daemon opens the log itself once it holds the fabric's lock, so that an `up` that
    // loses a race never writes into the winner's log; what it says before that comes
    // through the pipe.
    let mut child = {
        use std::os::unix::process::CommandExt;
        let mut cmd = Command::new(exe);
        cmd.arg("up").arg(file).arg("--log-to").arg(&log_path);
        if let Some(addr) = metrics {
            cmd.arg("--metrics").arg(addr.to_string());
        }
        if let Some(k) = time_scale {
            cmd.arg("--time-scale").arg(k.to_string());
        }
        if sched.realtime {
            cmd.arg("--realtime");
        }
        if sched.idle_poll {
            cmd.arg("--idle-poll");
        }
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .process_group(0)
            .spawn()
            .context("starting the daemon")?
    };
    let deadline = started + Duration::from_secs(300);
    loop {
        if let Some(status) = child.try_wait()? {
            let mut text = String::new();
            if let Some(mut pipe) = child.stderr.take() {
                let _ = pipe.read_to_string(&mut text);
            }
            if text.trim().is_empty() {
                text = fs::read_to_string(&log_path).unwrap_or_default();
            }
            let text = text.trim().trim_start_matches("closbox: ");
            bail!("the daemon exited ({status}) before the fabric was ready: {text}");
        }
        if let Ok(Some(st)) = State::load(name) {
            if st.phase == Phase::Ready && st.daemon_pid == child.id() {
                println!(
                    "fabric {name} up: {} in {:.2} s, {} (daemon pid {}, log {}); `closbox down {name}` to stop",
                    crate::bench::plural(st.gpus.len(), "GPU"),
                    started.elapsed().as_secs_f64(),
                    time_scale_note(&st),
                    child.id(),
                    log_path.display()
                );
                if let Some(why) = &st.pacing_off {
                    eprintln!("WARNING: {}: {why}", closbox_switchd::pace::OFF);
                }
                return Ok(());
            }
        }
        if Instant::now() > deadline {
            let _ = sys::kill(child.id() as i32, libc::SIGTERM);
            bail!(
                "the fabric was not ready within 300 s; see {}",
                log_path.display()
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

pub fn down(fabric: Option<&FabricName>, all: bool) -> anyhow::Result<()> {
    closbox_switchd::require_root("closbox down")?;
    let names = match (fabric, all) {
        (Some(n), _) => vec![n.clone()],
        (None, true) => state::fabrics(),
        (None, false) => match state::fabrics().as_slice() {
            [] => {
                println!("no fabric is up");
                return Ok(());
            }
            [one] => vec![one.clone()],
            many => bail!(
                "several fabrics are up ({}): name one, or use --all",
                join(many)
            ),
        },
    };
    if names.is_empty() {
        println!("no fabric is up");
    }
    // Each fabric on its own: one that cannot come down does not keep the others up.
    let mut failed = Vec::new();
    let up = state::fabrics();
    for n in names {
        // `down single-switch-8` of a fabric up as `ss8` is "nothing to do": say which
        // fabric the file of that name is.
        let hint = if up.contains(&n) {
            String::new()
        } else {
            file_named_like(&n)
        };
        match state::down(&n) {
            Ok(msg) => println!("{msg}{hint}"),
            Err(e) => {
                eprintln!("closbox: fabric {n}: {e:#}");
                failed.push(n.to_string());
            }
        }
    }
    if !failed.is_empty() {
        bail!("could not take down: {}", failed.join(", "));
    }
    Ok(())
}

/// Environment every command run as a GPU gets.
fn gpu_env(st: &State, g: &GpuState) -> Vec<(String, String)> {
    let mut env = vec![
        ("CLOSBOX_FABRIC".into(), st.fabric.to_string()),
        ("CLOSBOX_GPU".into(), g.name.clone()),
        ("CLOSBOX_TIME_SCALE".into(), st.time_scale.to_string()),
        ("GLOO_SOCKET_IFNAME".into(), st.tun.clone()),
        ("NCCL_SOCKET_IFNAME".into(), st.tun.clone()),
    ];
    env.extend(fabric_clock_env(st));
    env
}

/// The library that gives programs fabric-time clocks (`--fabric-clock`): named by
/// `CLOSBOX_CLOCK_LIB`, or beside the closbox binary (as cargo builds them), or in
/// `../lib/closbox/` from it (as installed).
pub fn clock_lib() -> anyhow::Result<std::path::PathBuf> {
    if let Some(p) = std::env::var_os("CLOSBOX_CLOCK_LIB") {
        let p = std::path::PathBuf::from(p);
        if p.is_file() {
            return Ok(p);
        }
        bail!("CLOSBOX_CLOCK_LIB={}: no such file", p.display());
    }
    let exe = std::env::current_exe().context("locating the closbox binary")?;
    let dir = exe.parent().context("the closbox binary's directory")?;
    for p in [
        dir.join("libclosbox_clock.so"),
        dir.join("../lib/closbox/libclosbox_clock.so"),
    ] {
        if p.is_file() {
            return Ok(p);
        }
    }
    bail!(
        "--fabric-clock: libclosbox_clock.so is not beside {} (build it with `make build`, i.e. cargo build --release --workspace, or name it with CLOSBOX_CLOCK_LIB)",
        exe.display()
    )
}

/// Turns fabric-time clocks on for the GPU commands this process starts (`--fabric-clock`):
/// one anchor for all of them, so that their clocks agree. Kept if a dilated parent (e.g.
/// mpirun starting `closbox rsh`) already set one. Does nothing on a real-time fabric.
pub fn enable_fabric_clock(st: &State) -> anyhow::Result<()> {
    if st.time_scale.get() <= 1.0 {
        return Ok(());
    }
    let lib = clock_lib()?;
    if std::env::var("CLOSBOX_CLOCK")
        .ok()
        .and_then(|v| clock_anchor(&v))
        .is_none()
    {
        let (mono, real) = sys::clock_anchor_ns();
        std::env::set_var("CLOSBOX_CLOCK", format!("1 {mono} {real}"));
    }
    std::env::set_var("CLOSBOX_CLOCK_LIB", lib);
    Ok(())
}

/// The anchor (monotonic and realtime ns) in a `CLOSBOX_CLOCK` value "K MONO REAL".
fn clock_anchor(v: &str) -> Option<(i128, i128)> {
    let w: Vec<&str> = v.split_whitespace().collect();
    match w[..] {
        [_, m, r] => Some((m.parse().ok()?, r.parse().ok()?)),
        _ => None,
    }
}

/// `LD_PRELOAD` and `CLOSBOX_CLOCK` for a GPU command, when fabric clocks are on (this
/// process has an anchor) and the fabric is dilated.
fn fabric_clock_env(st: &State) -> Vec<(String, String)> {
    let anchor = std::env::var("CLOSBOX_CLOCK")
        .ok()
        .and_then(|v| clock_anchor(&v));
    let (Some((mono, real)), true) = (anchor, st.time_scale.get() > 1.0) else {
        return Vec::new();
    };
    let Ok(lib) = clock_lib() else {
        return Vec::new();
    };
    let mut preload = lib.display().to_string();
    if let Ok(other) = std::env::var("LD_PRELOAD") {
        if !other.is_empty() {
            preload = format!("{preload}:{other}");
        }
    }
    vec![
        ("LD_PRELOAD".into(), preload),
        (
            "CLOSBOX_CLOCK".into(),
            format!("{} {mono} {real}", st.time_scale.get()),
        ),
    ]
}

/// closbox itself never runs on a fabric clock: started by a dilated program (mpirun's
/// `closbox rsh`), it drops the library from `LD_PRELOAD` and starts again, keeping
/// `CLOSBOX_CLOCK` so that the commands it starts in GPUs are dilated like their parent.
pub fn undilate_self() {
    use std::os::unix::process::CommandExt;
    let Some(preload) = std::env::var_os("LD_PRELOAD") else {
        return;
    };
    let preload = preload.to_string_lossy().into_owned();
    if !preload.contains("libclosbox_clock") {
        return;
    }
    let rest: Vec<&str> = preload
        .split([':', ' '])
        .filter(|p| !p.is_empty() && !p.contains("libclosbox_clock"))
        .collect();
    let mut cmd = Command::new("/proc/self/exe");
    cmd.args(std::env::args_os().skip(1));
    if let Some(a0) = std::env::args_os().next() {
        cmd.arg0(a0);
    }
    if rest.is_empty() {
        cmd.env_remove("LD_PRELOAD");
    } else {
        cmd.env("LD_PRELOAD", rest.join(":"));
    }
    let e = cmd.exec();
    eprintln!("closbox: cannot restart without the fabric clock: {e}");
    std::process::exit(1);
}

fn spawn_error(e: std::io::Error, program: &str) -> anyhow::Error {
    let (code, message) = if e.kind() == std::io::ErrorKind::NotFound {
        (127, format!("command not found: {program}"))
    } else {
        (126, format!("cannot run {program}: {e}"))
    };
    anyhow::Error::new(crate::CannotRun { code, message })
}

fn exit_code(status: std::process::ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => c as u8,
        (None, Some(sig)) => 128u8.wrapping_add(sig as u8),
        _ => 1,
    }
}

pub fn exec(
    fabric: Option<&FabricName>,
    gpu: &str,
    cmd: &[String],
    die_with_parent: bool,
    fabric_clock: bool,
) -> anyhow::Result<ExitCode> {
    closbox_switchd::require_root("closbox exec")?;

    let st = resolve(fabric)?;
    let (_, g) = gpu_arg(&st, gpu)?;
    if fabric_clock {
        enable_fabric_clock(&st)?;
    }
    let mut enter = netns::open_gpu(&st, g)?;
    // From a terminal, the command stays in the terminal's foreground group (Ctrl-C and
    // job control reach it); otherwise it leads a group of its own, and signals passed on
    // reach everything it started there.
    let interactive = std::io::stdin().is_terminal();
    enter.new_group = !interactive;
    let enter = Arc::new(enter);
    let mut command = Command::new(&cmd[0]);
    command.args(&cmd[1..]).envs(gpu_env(&st, g));
    // SIGTERM and SIGHUP sent to `exec` go on to the command (as a remote shell's would),
    // so that whoever stops `exec` stops what it runs; SIGINT from a terminal reaches
    // the command directly (same process group), and is passed on if it is still there
    // a moment later. (Registered before the spawn: no signal finds `exec` defenceless.)
    let pid = Arc::new(std::sync::atomic::AtomicI32::new(0));
    let mut signals =
        signal_hook::iterator::Signals::new([libc::SIGINT, libc::SIGTERM, libc::SIGHUP])?;
    if die_with_parent {
        // SIGTERM when the parent goes, handled like any SIGTERM: passed on.
        sys::die_with_parent()?;
    }
    let target = Arc::clone(&pid);
    std::thread::spawn(move || {
        for sig in signals.forever() {
            if sig == libc::SIGINT {
                std::thread::sleep(Duration::from_millis(200));
            }
            let p = target.load(Ordering::Acquire);
            if p > 0 {
                let _ = sys::kill(if interactive { p } else { -p }, sig);
            }
        }
    });
    let mut child = enter
        .spawn(&mut command)
        .map_err(|e| spawn_error(e, &cmd[0]))?;
    pid.store(child.id() as i32, Ordering::Release);
    let status = child.wait()?;
    Ok(ExitCode::from(exit_code(status)))
}

/// Parses a GPU selection: "all", ranks and ranges ("0-3,6"), or names ("gpu0,gpu5").
/// A GPU named on the command line: one the fabric does not have is bad usage (exit 2).
fn gpu_arg<'a>(st: &'a State, spec: &str) -> anyhow::Result<(usize, &'a GpuState)> {
    st.gpu(spec).map_err(|e| crate::usage(format!("{e:#}")))
}

pub fn select(st: &State, sel: &str) -> anyhow::Result<Vec<usize>> {
    if sel == "all" {
        return Ok((0..st.gpus.len()).collect());
    }
    let mut out = Vec::new();
    for part in sel.split(',').map(str::trim) {
        match part
            .split_once('-')
            .map(|(a, b)| (a.parse::<usize>(), b.parse::<usize>()))
        {
            Some((Ok(a), Ok(b))) => {
                if a > b {
                    return Err(crate::usage(format!(
                        "GPU range {part:?} goes downward; write {b}-{a}"
                    )));
                }
                if b >= st.gpus.len() {
                    return Err(crate::usage(format!(
                        "GPU range {part:?} goes past the last GPU: fabric {} has ranks 0 to {}",
                        st.fabric,
                        st.gpus.len() - 1
                    )));
                }
                out.extend(a..=b);
            }
            _ => out.push(gpu_arg(st, part)?.0),
        }
    }
    let mut seen = std::collections::BTreeSet::new();
    if let Some(dup) = out.iter().find(|i| !seen.insert(**i)) {
        return Err(crate::usage(format!(
            "GPU {} is selected twice",
            st.gpus[*dup].name
        )));
    }
    if out.is_empty() {
        return Err(crate::usage("no GPU selected"));
    }
    Ok(out)
}

/// Where ranks' output lines go: `(rank, is_stderr, line)`.
pub type Sink = Arc<dyn Fn(usize, bool, &str) + Send + Sync>;

/// A job: a command in every selected GPU of a resolved fabric.
pub struct RunArgs<'a> {
    pub st: &'a State,
    /// Indexes into `st.gpus`, in rank order (see `select`).
    pub sel: &'a [usize],
    pub timeout: Option<Duration>,
    pub master_port: u16,
    pub cmd: &'a [String],
    /// Default: print with a `[rank]` prefix.
    pub sink: Option<Sink>,
    /// A chaos timeline to start with the job (its time 0 is when every rank is started)
    /// and whose rest is cancelled when the job ends.
    pub chaos: Option<&'a crate::chaos::Timeline>,
}

/// Prints a rank's line with its rank as prefix.
pub fn print_sink() -> Sink {
    let lock = Arc::new(Mutex::new(()));
    Arc::new(move |rank, is_err, line| {
        let _g = lock.lock();
        if is_err {
            eprintln!("[{rank}] {line}");
        } else {
            println!("[{rank}] {line}");
        }
    })
}

struct Rank {
    rank: usize,
    gpu: String,
    child: Child,
    done: Option<std::process::ExitStatus>,
}

/// How long the other ranks of a job may take to end on their own after one failed.
const FAILURE_GRACE: Duration = Duration::from_secs(1);

pub fn run(a: RunArgs) -> anyhow::Result<ExitCode> {
    closbox_switchd::require_root("closbox run")?;
    let (st, sel) = (a.st, a.sel);
    let world = sel.len();
    // Node ranks and local ranks among the selected GPUs.
    let mut nodes: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
    for (rank, &i) in sel.iter().enumerate() {
        nodes.entry(st.gpus[i].node).or_default().push(rank);
    }
    // Nodes numbered in the order the selection first reaches them, so that rank order
    // and node order agree: RANK = NODE_RANK × LOCAL_WORLD_SIZE + LOCAL_RANK when the
    // selection lists whole nodes one after the other.
    let mut node_rank: BTreeMap<u32, usize> = BTreeMap::new();
    for &i in sel {
        let next = node_rank.len();
        node_rank.entry(st.gpus[i].node).or_insert(next);
    }
    let master = &st.gpus[sel[0]];
    let peer_names: Vec<&str> = sel.iter().map(|&i| st.gpus[i].name.as_str()).collect();
    let node_list: Vec<String> = sel.iter().map(|&i| st.gpus[i].node.to_string()).collect();
    let sink = a.sink.clone().unwrap_or_else(print_sink);

    // Each rank's stdout and stderr stay open here until it ends (1,024 ranks ran out of
    // the usual 1,024 files, "cannot run: Too many open files" after starting 500).
    let files = 2 * world as u64 + 64;
    if let Err(hard) = sys::allow_open_files(files).context("raising the open-file limit")? {
        bail!(
            "{world} ranks need up to {files} open files (each rank's output), but this process may open at most {hard} (`ulimit -Hn`); raise the limit (as root: `ulimit -n {files}`) or select fewer GPUs (--gpus)"
        );
    }
    let stop = closbox_switchd::stop_on_signals()?;
    let mut ranks: Vec<Rank> = Vec::new();
    let mut pipes = Vec::new();
    let started = Instant::now();
    for (rank, &i) in sel.iter().enumerate() {
        let g = &st.gpus[i];
        let peers = &nodes[&g.node];
        let local = peers
            .iter()
            .position(|r| *r == rank)
            .expect("rank in its node");
        let mut enter = netns::open_gpu(st, g)?;
        enter.new_group = true;
        let enter = Arc::new(enter);
        let args: Vec<String> = a
            .cmd
            .iter()
            .map(|s| s.replace("{rank}", &rank.to_string()))
            .collect();
        let mut command = Command::new(&args[0]);
        command
            .args(&args[1..])
            .envs(gpu_env(st, g))
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", peers.len().to_string())
            .env("NODE_RANK", node_rank[&g.node].to_string())
            .env("MASTER_ADDR", &master.name)
            .env("MASTER_PORT", a.master_port.to_string())
            .env("CLOSBOX_PEERS", peer_names.join(","))
            .env("CLOSBOX_NODES", node_list.join(","))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = match enter.spawn(&mut command) {
            Ok(c) => c,
            Err(e) => {
                stop_all(&mut ranks);
                let mut err = spawn_error(e, &args[0]);
                // `closbox run FABRIC CMD`, as `status FABRIC` is written.
                if args[0] == st.fabric.to_string() || args[0].ends_with(".toml") {
                    let rest: Vec<&str> = args[1..]
                        .iter()
                        .map(String::as_str)
                        .skip_while(|a| *a == "--")
                        .collect();
                    if let Some(c) = err.downcast_mut::<crate::CannotRun>() {
                        c.message += &format!(
                            "; `closbox run` takes its fabric with -f: `closbox run -f {} -- {}`",
                            args[0],
                            rest.join(" ")
                        );
                    }
                }
                return Err(err);
            }
        };
        for (pipe, is_err) in [
            (child.stdout.take().map(OwnedFd::from), false),
            (child.stderr.take().map(OwnedFd::from), true),
        ] {
            if let Some(fd) = pipe {
                pipes.push(Output::new(rank, is_err, fd));
            }
        }
        ranks.push(Rank {
            rank,
            gpu: g.name.clone(),
            child,
            done: None,
        });
    }

    // One thread reads every rank's output, started once all are: a thread per pipe made
    // each later fork copy more of this process and fault more of it in on both CPUs
    // (256 ranks of `true` took 4.4 s).
    let reader = read_outputs(pipes, sink);
    let timeline = match a.chaos.map(|t| t.start()).transpose() {
        Ok(t) => t,
        Err(e) => {
            stop_all(&mut ranks);
            return Err(e);
        }
    };
    let mut failure: Option<String> = None;
    // Ranks that failed on their own after the first, in the order seen.
    let mut also_failed: Vec<String> = Vec::new();
    // Once a rank failed, when the others are stopped if they have not ended by then.
    let mut grace_until: Option<Instant> = None;
    let mut stopped = false;
    let mut code = 0u8;
    loop {
        let mut running = 0;
        for r in ranks.iter_mut().filter(|r| r.done.is_none()) {
            match r.child.try_wait()? {
                Some(status) => {
                    r.done = Some(status);
                    if !status.success() {
                        if failure.is_none() {
                            code = exit_code(status).max(1);
                            failure = Some(format!("rank {} ({}) failed: {status}", r.rank, r.gpu));
                        } else {
                            also_failed.push(format!("rank {} ({}): {status}", r.rank, r.gpu));
                        }
                    }
                }
                None => running += 1,
            }
        }
        if running == 0 {
            break;
        }
        if failure.is_some() {
            // The first rank to fail is often not where the job broke: a rank whose
            // transfer timed out closes its connections, and its neighbour fails on that
            // first. The others get a moment to end (and say why) on their own.
            let until = *grace_until.get_or_insert_with(|| Instant::now() + FAILURE_GRACE);
            if Instant::now() >= until {
                stop_all(&mut ranks);
                stopped = true;
                break;
            }
        }
        if stop.load(Ordering::Relaxed) {
            failure = Some("interrupted".into());
            code = 130;
            stop_all(&mut ranks);
            stopped = true;
            break;
        }
        if a.timeout.is_some_and(|t| started.elapsed() > t) {
            if failure.is_none() {
                failure = Some(format!(
                    "timed out after {:.0} s",
                    a.timeout.expect("checked").as_secs_f64()
                ));
                code = 124;
            }
            stop_all(&mut ranks);
            stopped = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    if let (Some(t), Some(started)) = (a.chaos, &timeline) {
        t.finish(started, "the job ended");
    }
    // The ranks are gone; their output is read to its end, unless something they started
    // outside their process groups (a launcher's remote daemons) still holds their pipes.
    let deadline = Instant::now() + Duration::from_secs(3);
    while !reader.is_finished() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    if !reader.is_finished() {
        eprintln!(
            "closbox: the ranks exited but processes they started still hold their output open; not waiting for them"
        );
    }
    match failure {
        None => Ok(ExitCode::SUCCESS),
        Some(why) => {
            // Every rank that failed is named (a few, then a count): the first is often
            // not where the job broke.
            const NAMED: usize = 4;
            let also = match also_failed.len() {
                0 => String::new(),
                n => format!(
                    "; then {}{}",
                    also_failed[..n.min(NAMED)].join(", "),
                    if n > NAMED {
                        format!(" and {} more ranks", n - NAMED)
                    } else {
                        String::new()
                    }
                ),
            };
            let others = match (stopped, also_failed.len() + 1 == ranks.len()) {
                (true, _) => "the other ranks were stopped",
                (false, true) => "no rank succeeded",
                (false, false) => "the other ranks ended on their own",
            };
            eprintln!("closbox: {why}{also}; {others}");
            Ok(ExitCode::from(code))
        }
    }
}

/// A rank's stdout or stderr, and what it has sent of a line not ended yet.
struct Output {
    rank: usize,
    is_err: bool,
    fd: OwnedFd,
    partial: Vec<u8>,
}

impl Output {
    /// A line longer than this is passed on in pieces of this size.
    const MAX_LINE: usize = 1 << 20;

    fn new(rank: usize, is_err: bool, fd: OwnedFd) -> Output {
        Output {
            rank,
            is_err,
            fd,
            partial: Vec::new(),
        }
    }

    /// Takes `data` read from the pipe and passes on each line it completes (without its
    /// `\n` or `\r\n`; bytes that are not UTF-8 as U+FFFD).
    fn take(&mut self, data: &[u8], sink: &Sink) {
        let mut rest = data;
        while let Some(n) = rest.iter().position(|&b| b == b'\n') {
            let line = if self.partial.is_empty() {
                &rest[..n]
            } else {
                self.partial.extend_from_slice(&rest[..n]);
                &self.partial[..]
            };
            self.emit(line.strip_suffix(b"\r").unwrap_or(line), sink);
            self.partial.clear();
            rest = &rest[n + 1..];
        }
        self.partial.extend_from_slice(rest);
        while self.partial.len() >= Self::MAX_LINE {
            let piece: Vec<u8> = self.partial.drain(..Self::MAX_LINE).collect();
            self.emit(&piece, sink);
        }
    }

    /// The pipe closed: what is left is the last line.
    fn finish(&mut self, sink: &Sink) {
        if !self.partial.is_empty() {
            let rest = std::mem::take(&mut self.partial);
            self.emit(&rest, sink);
        }
    }

    fn emit(&self, line: &[u8], sink: &Sink) {
        sink(self.rank, self.is_err, &String::from_utf8_lossy(line));
    }
}

/// Reads every pipe in `outputs` in one thread until all have closed, passing on their
/// lines to `sink` as they come.
fn read_outputs(mut outputs: Vec<Output>, sink: Sink) -> std::thread::JoinHandle<()> {
    use rustix::event::{poll, PollFd, PollFlags};
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 * 1024];
        while !outputs.is_empty() {
            let mut fds: Vec<PollFd<'_>> = outputs
                .iter()
                .map(|o| PollFd::new(&o.fd, PollFlags::IN))
                .collect();
            match poll(&mut fds, None) {
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => {
                    eprintln!("closbox: reading the ranks' output: {e}");
                    return;
                }
            }
            let ready: Vec<bool> = fds.iter().map(|f| !f.revents().is_empty()).collect();
            drop(fds);
            let mut i = 0;
            outputs.retain_mut(|o| {
                let was_ready = ready[i];
                i += 1;
                if !was_ready {
                    return true;
                }
                // Readable, or hung up: a read does not block.
                match rustix::io::read(&o.fd, &mut buf[..]) {
                    Err(rustix::io::Errno::INTR | rustix::io::Errno::AGAIN) => true,
                    Ok(0) | Err(_) => {
                        o.finish(&sink);
                        false
                    }
                    Ok(n) => {
                        o.take(&buf[..n], &sink);
                        true
                    }
                }
            });
        }
    })
}

/// Stops every running rank and its children (SIGTERM to their process groups, SIGKILL
/// after 3 s), then reaps them.
fn stop_all(ranks: &mut [Rank]) {
    struct Groups<'a>(&'a mut [Rank]);
    impl Targets for Groups<'_> {
        fn signal(&mut self, sig: libc::c_int) -> Vec<i32> {
            let running = self.running();
            for &pid in &running {
                let _ = sys::kill(-pid, sig);
            }
            running
        }

        fn running(&mut self) -> Vec<i32> {
            self.0
                .iter_mut()
                .filter_map(|r| match r.child.try_wait() {
                    Ok(None) => Some(r.child.id() as i32),
                    _ => None,
                })
                .collect()
        }
    }
    let _ = terminate(
        &mut Groups(ranks),
        Duration::from_secs(3),
        Duration::from_secs(2),
    );
    for r in ranks.iter_mut() {
        let _ = r.child.wait();
    }
}

/// Which MPI's launcher `closbox mpirun` drives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum MpiImpl {
    /// Open MPI (`mpirun.openmpi`, Debian `openmpi-bin`).
    Openmpi,
    /// MPICH with its hydra launcher (`mpiexec.hydra`, Debian `mpich`).
    Mpich,
}

impl MpiImpl {
    /// The launcher's program: the implementation's own name for it first (Debian installs
    /// both side by side behind one `mpirun` alternative), the generic one otherwise.
    fn launcher(self) -> anyhow::Result<String> {
        let (own, generic, package) = match self {
            MpiImpl::Openmpi => ("mpirun.openmpi", "mpirun", "openmpi-bin"),
            MpiImpl::Mpich => ("mpiexec.hydra", "mpiexec", "mpich"),
        };
        if which(own).is_some() {
            return Ok(own.into());
        }
        // The generic name is used only if it is that implementation's.
        let generic_is_it = which(generic).is_some_and(|p| {
            let target = std::fs::canonicalize(&p).unwrap_or(p);
            let t = target.to_string_lossy();
            match self {
                MpiImpl::Openmpi => t.contains("openmpi") || t.ends_with("orterun"),
                MpiImpl::Mpich => t.contains("hydra") || t.contains("mpich"),
            }
        });
        if generic_is_it {
            return Ok(generic.into());
        }
        bail!(
            "{own} not found: install {} (Debian: apt-get install {package})",
            match self {
                MpiImpl::Openmpi => "Open MPI",
                MpiImpl::Mpich => "MPICH",
            }
        )
    }

    /// The implementation to use when none is named: Open MPI if it is installed, MPICH
    /// otherwise, Open MPI (and its install hint) if neither is.
    fn detect() -> MpiImpl {
        if MpiImpl::Openmpi.launcher().is_ok() || MpiImpl::Mpich.launcher().is_err() {
            MpiImpl::Openmpi
        } else {
            MpiImpl::Mpich
        }
    }
}

/// `closbox mpirun`.
pub struct MpirunArgs<'a> {
    pub fabric: Option<&'a FabricName>,
    pub gpus: &'a str,
    pub timeout: Option<Duration>,
    /// None: detected (`MpiImpl::detect`).
    pub implementation: Option<MpiImpl>,
    /// KEY VALUE pairs (Open MPI only).
    pub mca: &'a [String],
    pub export: &'a [String],
    pub dry_run: bool,
    pub fabric_clock: bool,
    pub cmd: &'a [String],
}

/// Whether the user told the ranks to busy-poll (never yield the core while they wait).
fn ranks_spin(a: &MpirunArgs, imp: MpiImpl) -> bool {
    match imp {
        MpiImpl::Openmpi => a
            .mca
            .chunks(2)
            .any(|kv| kv[0] == "mpi_yield_when_idle" && kv.get(1).is_some_and(|v| v == "0")),
        // MPICH: 0 polls before a yield disables yielding.
        MpiImpl::Mpich => a
            .export
            .iter()
            .any(|x| x.replace(' ', "") == "MPIR_CVAR_POLLS_BEFORE_YIELD=0"),
    }
}

/// The CPU of each of `ranks` ranks that busy-poll: round robin over the CPUs this process
/// may use. Each GPU looks like a node of its own to the launchers, which would bind every
/// rank to "its" first core (Open MPI: core 0 for all) or leave them to the scheduler;
/// busy-polling ranks on one core take turns of a scheduler slice (3.3 ms a message,
/// measured with both on one CPU), and nothing keeps the scheduler from putting two there.
fn spinning_cpus(ranks: usize) -> anyhow::Result<Vec<usize>> {
    let cpus = closbox_switchd::sys::allowed_cpus().context("reading this process's CPUs")?;
    if cpus.is_empty() {
        bail!("this process may run on no CPU");
    }
    if ranks > cpus.len() {
        eprintln!(
            "closbox mpirun: warning: {ranks} busy-polling ranks on {} CPUs: ranks that share a \
             CPU wait a scheduler slice (milliseconds) for each other; let them yield \
             (closbox's default) unless each has a core",
            cpus.len()
        );
    }
    Ok((0..ranks).map(|r| cpus[r % cpus.len()]).collect())
}

/// The launcher line for a job on `st`'s GPUs `sel` (rank i on the i-th), run in the first
/// selected GPU. `pins`: the CPU of each rank (busy-polling ranks), applied by `closbox rsh`
/// to the ranks it starts and by the caller to the launcher (whose own rank it starts).
fn mpirun_line(
    st: &State,
    sel: &[usize],
    a: &MpirunArgs,
    imp: MpiImpl,
    launcher: String,
    pins: Option<&[usize]>,
) -> anyhow::Result<Vec<String>> {
    let exe = std::env::current_exe().context("locating the closbox binary")?;
    let hosts: Vec<&str> = sel.iter().map(|&i| st.gpus[i].name.as_str()).collect();
    // `closbox rsh --fabric F [--cpu-map gpu0=0,gpu15=1]`, without the executable.
    let mut rsh = format!("rsh --fabric {}", st.fabric);
    if let Some(p) = pins {
        let map: Vec<String> = hosts
            .iter()
            .zip(p)
            .map(|(h, c)| format!("{h}={c}"))
            .collect();
        rsh += &format!(" --cpu-map {}", map.join(","));
    }
    match imp {
        MpiImpl::Openmpi => {
            let mut line: Vec<String> = vec![
                launcher,
                "--allow-run-as-root".into(),
                "--host".into(),
                hosts.join(","),
                "-np".into(),
                sel.len().to_string(),
                // Ranks placed in the order of --gpus, one per GPU.
                "--map-by".into(),
                "node".into(),
            ];
            // The user's --mca settings replace closbox's for the same key (Open MPI
            // refuses a key given twice).
            let user: Vec<&str> = a.mca.chunks(2).map(|kv| kv[0].as_str()).collect();
            let mut mca = |k: &str, v: &str| {
                if !user.contains(&k) {
                    line.extend(["--mca".into(), k.into(), v.into()])
                }
            };
            // closbox starts each remote daemon in its GPU (and ends it with mpirun).
            mca("plm_rsh_agent", &format!("{} {rsh}", exe.display()));
            // TCP over the GPUs' fabric interface; no shared memory or RDMA paths around it.
            mca("pml", "ob1");
            mca("btl", "tcp,self");
            mca("btl_tcp_if_include", &st.tun);
            mca("oob_tcp_if_include", &st.tun);
            // Ranks share the box's cores with the fabric: they must not spin while they wait.
            mca("mpi_yield_when_idle", "1");
            // The TCP BTL receives through Open MPI's event library, which opal_progress
            // ticks at every call only while a component counts itself a user of it, and
            // otherwise every 10 ms (the default tick rate). A race in connection setup
            // sometimes leaves that count at 0: then every message waits for the tick
            // (NetPIPE: exactly 5.0 ms one way, a 10 ms round trip; seen in CI). A 1 µs
            // tick rate is what a counted user gets anyway.
            mca("mpi_event_tick_rate", "1");
            // Each GPU looks like a node of its own to mpirun, which binds every rank to
            // "its" first core: the same core 0 for all of them. Yielding ranks take turns
            // on it quickly (measured: as fast as unbound, and steadier: unbound yielding
            // ranks met 5 ms stalls in 2 of 8 NetPIPE runs); busy-polling ranks keep the
            // CPUs closbox pinned them to (`spinning_cpus`).
            if pins.is_some() {
                mca("hwloc_base_binding_policy", "none");
            }
            // The job's session directories (mpirun's and its daemons') in one place that
            // `closbox mpirun` removes when the job ends: a launcher killed at a timeout
            // cannot clean its own (Open MPI's default, /tmp/ompi.<host>.<uid>/pid.<pid>).
            mca("orte_tmpdir_base", &mpi_job_dir().display().to_string());
            for kv in a.mca.chunks(2) {
                line.extend(["--mca".into(), kv[0].clone(), kv[1].clone()]);
            }
            for x in a.export {
                line.extend(["-x".into(), x.clone()]);
            }
            line.extend(a.cmd.iter().cloned());
            Ok(line)
        }
        MpiImpl::Mpich => {
            if !a.mca.is_empty() {
                bail!("--mca is for Open MPI; MPICH takes its settings as environment variables (-x MPIR_CVAR_...=...)");
            }
            // hydra runs `EXE $HYDRA_LAUNCHER_EXTRA_ARGS HOST PROXY...` for each host: the
            // extra words make that `closbox rsh --fabric F HOST PROXY...` (a fabric name
            // has no spaces).
            let mut line: Vec<String> = vec![
                "env".into(),
                format!("HYDRA_LAUNCHER_EXTRA_ARGS={rsh}"),
                launcher,
                "-launcher".into(),
                "rsh".into(),
                "-launcher-exec".into(),
                exe.display().to_string(),
                "-iface".into(),
                st.tun.clone(),
                "-hosts".into(),
                hosts.join(","),
                "-n".into(),
                sel.len().to_string(),
                "-ppn".into(),
                "1".into(),
            ];
            let genv = |line: &mut Vec<String>, k: &str, v: &str| {
                line.extend(["-genv".into(), k.into(), v.into()])
            };
            // Debian's MPICH is ch4:ucx: UCX over TCP on the fabric interface only (its
            // shared-memory transports would reach the other GPUs' memory directly), and
            // no rank counted local to another.
            // The user's -x settings replace closbox's for the same variable.
            let user: Vec<&str> = a
                .export
                .iter()
                .map(|x| x.split_once('=').map_or(x.as_str(), |(k, _)| k))
                .collect();
            let defaults = [
                ("UCX_TLS", "tcp,self"),
                ("UCX_NET_DEVICES", st.tun.as_str()),
                ("MPIR_CVAR_NOLOCAL", "1"),
                // Yield the core at every poll of a busy wait (the default: every 1000).
                ("MPIR_CVAR_POLLS_BEFORE_YIELD", "1"),
            ];
            for (k, v) in defaults {
                if !user.contains(&k) {
                    genv(&mut line, k, v);
                }
            }
            for x in a.export {
                match x.split_once('=') {
                    Some((k, v)) => genv(&mut line, k, v),
                    None => line.extend(["-genvlist".into(), x.clone()]),
                }
            }
            line.extend(a.cmd.iter().cloned());
            Ok(line)
        }
    }
}

/// Open MPI session directories of `closbox mpirun` jobs, one per job (by its pid).
const MPI_JOBS_DIR: &str = "/run/closbox/mpi";

/// This `closbox mpirun`'s job directory (see `orte_tmpdir_base` above).
fn mpi_job_dir() -> PathBuf {
    Path::new(MPI_JOBS_DIR).join(std::process::id().to_string())
}

/// Makes this job's session directory, first removing those of jobs whose `closbox
/// mpirun` is gone (killed before it could remove its own); removes it when dropped.
struct MpiJobDir(PathBuf);

impl MpiJobDir {
    fn create() -> anyhow::Result<MpiJobDir> {
        use std::os::unix::fs::DirBuilderExt;
        if let Ok(rd) = fs::read_dir(MPI_JOBS_DIR) {
            for e in rd.flatten() {
                let stale = e
                    .file_name()
                    .to_str()
                    .and_then(|n| n.parse::<u32>().ok())
                    .is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists());
                if stale && e.file_type().is_ok_and(|t| t.is_dir()) {
                    let _ = fs::remove_dir_all(e.path());
                }
            }
        }
        let dir = mpi_job_dir();
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .with_context(|| format!("creating {}", dir.display()))?;
        Ok(MpiJobDir(dir))
    }
}

impl Drop for MpiJobDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// `closbox mpirun`: the launcher runs in the first selected GPU (as rank 0 of `run`, with
/// its exit status, timeout and clean-up) and starts the other ranks through `closbox rsh`.
pub fn mpirun(a: MpirunArgs) -> anyhow::Result<ExitCode> {
    closbox_switchd::require_root("closbox mpirun")?;
    let st = resolve(a.fabric)?;
    let sel = select(&st, a.gpus)?;
    let imp = a.implementation.unwrap_or_else(MpiImpl::detect);
    let launcher = match imp.launcher() {
        Ok(l) => l,
        // A dry run shows the line even where the MPI is not installed.
        Err(_) if a.dry_run => match imp {
            MpiImpl::Openmpi => "mpirun".into(),
            MpiImpl::Mpich => "mpiexec.hydra".into(),
        },
        Err(e) => return Err(e),
    };
    let pins = if ranks_spin(&a, imp) {
        Some(spinning_cpus(sel.len())?)
    } else {
        None
    };
    let line = mpirun_line(&st, &sel, &a, imp, launcher, pins.as_deref())?;
    if a.fabric_clock {
        enable_fabric_clock(&st)?;
    }
    if a.dry_run {
        let quoted: Vec<String> = line
            .iter()
            .map(|w| {
                if w.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./,=:".contains(c))
                {
                    w.clone()
                } else {
                    format!("'{}'", w.replace('\'', "'\\''"))
                }
            })
            .collect();
        // The launcher and the first rank run on the first rank's CPU.
        let pin = pins
            .as_ref()
            .map_or(String::new(), |p| format!("taskset -c {} ", p[0]));
        println!(
            "{pin}closbox exec --fabric {} {} -- {}",
            st.fabric,
            st.gpus[sel[0]].name,
            quoted.join(" ")
        );
        return Ok(ExitCode::SUCCESS);
    }
    // The launchers report a program they cannot start in their own ways (Open MPI: a
    // banner and exit 132): said here as `run` and shells say it.
    if let Some(program) = a.cmd.first() {
        runnable(program)?;
    }
    if let Some(p) = &pins {
        // The launcher starts the first rank itself; it and its rank run on that CPU.
        closbox_switchd::sys::pin_to_cpu(p[0]).context("pinning the launcher")?;
    }
    let _sessions = match imp {
        MpiImpl::Openmpi => Some(MpiJobDir::create()?),
        MpiImpl::Mpich => None,
    };
    run(RunArgs {
        st: &st,
        sel: &sel[..1],
        timeout: a.timeout,
        master_port: 29500,
        cmd: &line,
        sink: Some(Arc::new(|_, is_err, line: &str| {
            if is_err {
                eprintln!("{line}");
            } else {
                println!("{line}");
            }
        })),
        chaos: None,
    })
}

/// Whether `program` (a path, or a name looked up on PATH) can be started: 127 "command
/// not found", 126 "cannot run" as shells say them, else nothing.
fn runnable(program: &str) -> anyhow::Result<()> {
    use std::io::{Error, ErrorKind};
    use std::os::unix::fs::PermissionsExt;
    let path = if program.contains('/') {
        Some(std::path::PathBuf::from(program))
    } else {
        which(program)
    };
    let path = path.ok_or_else(|| Error::from(ErrorKind::NotFound));
    let checked = path.and_then(fs::metadata).and_then(|m| match m {
        m if m.is_file() && m.permissions().mode() & 0o111 != 0 => Ok(()),
        m if m.is_dir() => Err(Error::other("a directory")),
        _ => Err(Error::other("not executable")),
    });
    checked.map_err(|e| spawn_error(e, program))
}

/// The path of `program` on PATH.
fn which(program: &str) -> Option<std::path::PathBuf> {
    std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(program))
            .find(|f| f.is_file())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `Output` passes on for `reads` (then the pipe closing), as (rank, is_err, line).
    fn lines_of(reads: &[&[u8]]) -> Vec<(usize, bool, String)> {
        let got = Arc::new(Mutex::new(Vec::new()));
        let sink: Sink = {
            let got = Arc::clone(&got);
            Arc::new(move |rank, is_err, line: &str| {
                got.lock().unwrap().push((rank, is_err, line.to_owned()))
            })
        };
        let (fd, _other) = rustix::pipe::pipe().expect("a pipe");
        let mut out = Output::new(7, true, fd);
        for r in reads {
            out.take(r, &sink);
        }
        out.finish(&sink);
        let got = got.lock().unwrap().clone();
        got
    }

    #[test]
    fn output_lines_are_whole_whatever_the_reads() {
        let l = |s: &str| (7, true, s.to_owned());
        // Lines cut anywhere by the reads, CRLF, an empty line, a last line without `\n`.
        assert_eq!(
            lines_of(&[b"one\ntw", b"o\r", b"\n\nthr", b"ee"]),
            [l("one"), l("two"), l(""), l("three")]
        );
        // Bytes that are not UTF-8 do not end the output.
        assert_eq!(
            lines_of(&[b"a\xffb\n", b"next\n"]),
            [l("a\u{fffd}b"), l("next")]
        );
        assert_eq!(lines_of(&[]), []);
        // A line without end is passed on in pieces, not held whole.
        let long = vec![b'x'; Output::MAX_LINE + 5];
        let got = lines_of(&[&long, b"\n"]);
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].2.len(), Output::MAX_LINE);
        assert_eq!(got[1].2, "xxxxx");
    }

    #[test]
    fn outputs_of_many_pipes_are_read_to_their_ends_in_one_thread() {
        let got = Arc::new(Mutex::new(Vec::new()));
        let sink: Sink = {
            let got = Arc::clone(&got);
            Arc::new(move |rank, is_err, line: &str| {
                got.lock().unwrap().push((rank, is_err, line.to_owned()))
            })
        };
        let mut outputs = Vec::new();
        let mut writers = Vec::new();
        for rank in 0..50 {
            for is_err in [false, true] {
                let (r, w) = rustix::pipe::pipe().expect("a pipe");
                outputs.push(Output::new(rank, is_err, r));
                writers.push((rank, is_err, std::fs::File::from(w)));
            }
        }
        let reader = read_outputs(outputs, sink);
        for (rank, is_err, mut w) in writers {
            writeln!(w, "{rank} {is_err}").unwrap();
            write!(w, "last").unwrap();
        }
        reader
            .join()
            .expect("the reader ends once every pipe closed");
        let mut got = got.lock().unwrap().clone();
        got.sort();
        assert_eq!(got.len(), 200);
        for rank in 0..50 {
            for is_err in [false, true] {
                assert!(got.contains(&(rank, is_err, format!("{rank} {is_err}"))));
                assert!(got.contains(&(rank, is_err, "last".to_owned())));
            }
        }
    }
}
