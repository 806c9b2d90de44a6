//! `up`, `down`, `exec`: the live fabric from the command line, and what `run` and `mpirun`
//! share with them (the fabric a command addresses, GPU selections, environments, clocks).

use std::fs;
use std::io::{IsTerminal, Read, Write};
use std::path::Path;
use std::process::{Command, ExitCode, Stdio};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use closbox_switchd::state::{self, FabricName, GpuState, Phase, State};
use closbox_switchd::{netns, sys, NameTaken};

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
            renamed_ones(&name) + &file_named_like(&name)
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

/// "; its file's fabric is up as t-one (`up --name`)": fabrics up under other names from a
/// file whose fabric is `name` (a `down FILE` or `-f FILE` means the file's own name).
pub(crate) fn renamed_ones(name: &FabricName) -> String {
    let renamed: Vec<FabricName> = state::fabrics()
        .into_iter()
        .filter(|up| up != name)
        .filter(|up| {
            State::load(up)
                .ok()
                .flatten()
                .is_some_and(|st| fabric_of_file(&st.config).is_ok_and(|of_file| &of_file == name))
        })
        .collect();
    if renamed.is_empty() {
        String::new()
    } else {
        format!(
            "; its topology file's fabric is up as {} (`up --name`)",
            join(&renamed)
        )
    }
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

pub fn up(args: crate::cli::UpArgs) -> anyhow::Result<()> {
    let crate::cli::UpArgs {
        file,
        detach,
        name,
        log_to,
        metrics,
        time_scale,
        realtime,
        idle_poll,
        owner,
    } = args;
    let (file, name, log_to) = (file.as_path(), name.as_ref(), log_to.as_deref());
    let sched = closbox_switchd::Scheduling {
        realtime,
        idle_poll,
    };
    let mut topo = closbox_fabric::load(file)?;
    if let Some(name) = name {
        topo.fabric.name = name.to_string();
    }
    match time_scale {
        Some(TimeScaleArg::Auto) => topo.fabric.time_scale_auto = true,
        Some(TimeScaleArg::Fixed(k)) => {
            topo.fabric.time_scale = k;
            topo.fabric.time_scale_auto = false;
        }
        None => {}
    }
    closbox_switchd::require_root("closbox up")?;
    // Checked here too, so that a detached `up` says it before starting the daemon.
    if let Some(pid) = owner {
        closbox_switchd::owner_pidfd(pid)?;
    }
    if sched.idle_poll {
        if let Some(why) = closbox_switchd::sys::idle_poll_unavailable() {
            eprintln!("WARNING: --idle-poll has no effect on this box: {why}");
        }
    }
    // A name already up is said before anything is measured.
    if log_to.is_none() {
        if let Ok(name) = topo.fabric.name.parse::<FabricName>() {
            if let Some(st) = State::load(&name)?.filter(State::daemon_alive) {
                return Err(already_up(&name, &st).into());
            }
        }
    }
    // (The detached daemon, started with --log-to, would say it again into its log.)
    if topo.fabric.time_scale_auto && log_to.is_none() {
        eprintln!(
            "closbox: fabric {}: time_scale \"auto\": measuring what this box carries through the fabric's own data path (1–4 s)",
            topo.fabric.name
        );
    }
    if detach {
        let fabric = topo.fabric.name.parse().map_err(anyhow::Error::msg)?;
        let renamed = name.is_some();
        return up_detached(file, &fabric, renamed, metrics, time_scale, sched, owner);
    }
    let stopped =
        closbox_switchd::run_fabric(&topo, file, log_to, metrics, sched, owner, |st, took| {
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
    println!(
        "fabric {} is down{}",
        topo.fabric.name,
        stopped.said_for_down()
    );
    Ok(())
}

/// The refusal of `up` for a name whose daemon `st` is running.
fn already_up(name: &FabricName, st: &State) -> NameTaken {
    NameTaken(format!(
        "fabric {name} is already up (daemon pid {}); `closbox down {name}` first, or `up --name` another name",
        st.daemon_pid
    ))
}

fn up_detached(
    file: &Path,
    name: &FabricName,
    renamed: bool,
    metrics: Option<std::net::SocketAddr>,
    time_scale: Option<TimeScaleArg>,
    sched: closbox_switchd::Scheduling,
    owner: Option<u32>,
) -> anyhow::Result<()> {
    if let Some(st) = State::load(name)? {
        if st.daemon_alive() {
            return Err(already_up(name, &st).into());
        }
    }
    let log_path = name.log_path();
    let started = Instant::now();
    let exe = std::env::current_exe().context("locating the closbox binary")?;
    // The daemon reads the file again, with other standard streams: `/dev/stdin` (a file
    // redirected with `<`) is the file itself only here.
    let file = &file.canonicalize().unwrap_or_else(|_| file.to_owned());
    // The daemon opens the log itself once it holds the fabric's lock, so that an `up` that
    // loses a race never writes into the winner's log; what it says before that comes
    // through the pipe.
    let mut child = {
        use std::os::unix::process::CommandExt;
        let mut cmd = Command::new(exe);
        cmd.arg("up").arg(file).arg("--log-to").arg(&log_path);
        if renamed {
            cmd.arg("--name").arg(name.as_str());
        }
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
        if let Some(pid) = owner {
            cmd.arg("--owner").arg(pid.to_string());
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
            // Another `up` of the name won the race between the check above and the
            // daemon's lock: the same refusal as the check's.
            if status.code() == Some(NameTaken::EXIT.into()) {
                return Err(NameTaken(text.to_owned()).into());
            }
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

pub fn down(fabrics: &[FabricName], all: bool) -> anyhow::Result<()> {
    closbox_switchd::require_root("closbox down")?;
    let names = match (fabrics, all) {
        ([_, ..], _) => {
            // (Each once, in the order given.)
            let mut names: Vec<FabricName> = Vec::new();
            for n in fabrics {
                if !names.contains(n) {
                    names.push(n.clone());
                }
            }
            names
        }
        ([], true) => state::fabrics(),
        ([], false) => match state::fabrics().as_slice() {
            [] => {
                println!("no fabric is up");
                return Ok(());
            }
            [one] => vec![one.clone()],
            many => bail!(
                "several fabrics are up ({}): name them, or use --all",
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
            renamed_ones(&n) + &file_named_like(&n)
        };
        // Jobs on it end with it: said, since each will report its ranks gone.
        let jobs = crate::jobs::running(n.as_str());
        match state::down(&n) {
            Ok(msg) if jobs.is_empty() => println!("{msg}{hint}"),
            Ok(msg) => {
                println!(
                    "{msg}{hint}; {} running on it lost {}: {}",
                    crate::bench::plural(jobs.len(), "job"),
                    if jobs.len() == 1 {
                        "its GPUs"
                    } else {
                        "their GPUs"
                    },
                    crate::jobs::list(&jobs)
                );
            }
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
pub(crate) fn gpu_env(st: &State, g: &GpuState) -> Vec<(String, String)> {
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

pub(crate) fn spawn_error(e: std::io::Error, program: &str) -> anyhow::Error {
    let (code, message) = if e.kind() == std::io::ErrorKind::NotFound {
        (127, format!("command not found: {program}"))
    } else {
        (126, format!("cannot run {program}: {e}"))
    };
    anyhow::Error::new(crate::CannotRun { code, message })
}

pub(crate) fn exit_code(status: std::process::ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => c as u8,
        (None, Some(sig)) => 128u8.wrapping_add(sig as u8),
        _ => 1,
    }
}

/// How `exec` runs its command.
#[derive(Debug, Default)]
pub struct ExecOptions {
    /// End (passing SIGTERM on) when the process that started `exec` exits.
    pub die_with_parent: bool,
    /// Fabric-time clocks for the command.
    pub fabric_clock: bool,
    /// Stop the command after this long (exit 124).
    pub timeout: Option<Duration>,
}

pub fn exec(
    fabric: Option<&FabricName>,
    gpu: &str,
    cmd: &[String],
    opts: ExecOptions,
) -> anyhow::Result<ExitCode> {
    let ExecOptions {
        die_with_parent,
        fabric_clock,
        timeout,
    } = opts;
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
    let Some(limit) = timeout else {
        let status = child.wait()?;
        return Ok(ExitCode::from(exit_code(status)));
    };
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(ExitCode::from(exit_code(status)));
        }
        if Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(10).min(deadline - Instant::now()));
    }
    // Its group (from a terminal: the command alone, in the terminal's group with closbox).
    struct Timed<'a> {
        child: &'a mut std::process::Child,
        group: bool,
    }
    impl closbox_switchd::stop::Targets for Timed<'_> {
        fn signal(&mut self, sig: libc::c_int) -> Vec<i32> {
            let pid = self.child.id() as i32;
            let running = self.running();
            if !running.is_empty() {
                let _ = sys::kill(if self.group { -pid } else { pid }, sig);
            }
            running
        }

        /// The command until it is reaped, and what it left in its group (zombies aside).
        fn running(&mut self) -> Vec<i32> {
            let pid = self.child.id() as i32;
            let mut left = match self.child.try_wait() {
                Ok(None) => vec![pid],
                _ => Vec::new(),
            };
            if self.group {
                left.extend(sys::group_members(pid).into_iter().filter(|p| *p != pid));
            }
            left
        }
    }
    let stopped = closbox_switchd::stop::terminate(
        &mut Timed {
            child: &mut child,
            group: !interactive,
        },
        Duration::from_secs(3),
        Duration::from_secs(2),
    );
    let _ = child.try_wait();
    eprintln!(
        "closbox: {} in {}: timed out after {}; stopped ({})",
        cmd[0],
        g.name,
        humantime_secs(limit),
        if stopped.killed {
            "SIGKILL after SIGTERM"
        } else {
            "SIGTERM"
        }
    );
    Ok(ExitCode::from(124))
}

/// "90 s", "1.5 s": a wall time as `--timeout` took it (`run`'s and `exec`'s).
pub(crate) fn humantime_secs(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s.fract() == 0.0 {
        format!("{s:.0} s")
    } else {
        format!("{s} s")
    }
}

/// Parses a GPU selection: "all", ranks and ranges ("0-3,6"), or names ("gpu0,gpu5").
/// A GPU named on the command line: one the fabric does not have is bad usage (exit 2).
fn gpu_arg<'a>(st: &'a State, spec: &str) -> anyhow::Result<(usize, &'a GpuState)> {
    st.gpu(spec).map_err(|e| crate::usage(format!("{e:#}")))
}

/// A GPU selection (`closbox_fabric::names::select_gpus`) against the fabric up.
pub fn select(st: &State, sel: &str) -> anyhow::Result<Vec<usize>> {
    let names: Vec<&str> = st.gpus.iter().map(|g| g.name.as_str()).collect();
    let unknown = |part: &str| match st.gpu(part) {
        Err(e) => format!("{e:#}"),
        Ok(_) => format!("GPU {part:?} cannot be selected"),
    };
    closbox_fabric::names::select_gpus(st.fabric.as_str(), &names, sel, &unknown)
        .map_err(crate::usage)
}
