//! closbox's switch daemon: brings a fabric up on this box (a network namespace, UTS
//! namespace and TUN per GPU), drives the fabric model in real time between the TUNs, and
//! takes it down again, removing exactly what it made.
//!
//! All OS access goes through `sys` (with `bpf`, which loads the GPUs' DCTCP through
//! libbpf, the only modules with `unsafe`); the model (`closbox_fabric`) stays free of
//! I/O and clocks.

#[allow(unsafe_code)]
pub mod bpf;
pub mod calibrate;
pub mod chaos;
pub mod control;
pub mod dataplane;
pub mod head;
pub mod histogram;
pub mod links;
pub mod metrics;
pub mod netns;
pub mod offload;
pub mod pace;
pub mod pcapng;
pub mod scenario;
pub mod state;
pub mod stop;
#[allow(unsafe_code)]
pub mod sys;

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use closbox_fabric::{TimeScale, Topology};

use crate::dataplane::{Ctl, DataPlane, TunPorts};
use crate::links::LinkWatch;
use crate::state::{FabricLock, FabricName, GpuState, LockAttempt, Phase, State, TUN_NAME};
use crate::stop::Stopped;
use crate::sys::EventFd;

/// `MemAvailable` of /proc/meminfo, in bytes.
pub fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// `up` of a fabric name that is already up (or being brought up or down): a refusal of
/// its own, which `closbox up` exits with as status 4 ([`NameTaken::EXIT`]), so that a
/// caller (the test fixtures) can try another name instead of failing.
#[derive(Debug)]
pub struct NameTaken(pub String);

impl NameTaken {
    /// `closbox up`'s exit status for this refusal.
    pub const EXIT: u8 = 4;
}

impl std::fmt::Display for NameTaken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for NameTaken {}

/// The process `up --owner PID` binds a fabric to, held as a pidfd (a later process of the
/// same pid cannot be taken for it); refused where there is none, or it has ended.
pub fn owner_pidfd(pid: u32) -> anyhow::Result<sys::Pidfd> {
    match i32::try_from(pid).ok().map(sys::Pidfd::open).transpose()? {
        Some(Some(fd)) if fd.exited() => bail!("--owner {pid}: that process has ended"),
        Some(Some(fd)) => Ok(fd),
        _ => bail!("--owner {pid}: no process has that pid"),
    }
}

/// Fails unless running as root (namespaces, mounts and TUN need it).
pub fn require_root(what: &str) -> anyhow::Result<()> {
    if !sys::is_root() {
        bail!("{what} needs root (network namespaces, mounts and TUN devices)");
    }
    Ok(())
}

/// A flag that SIGINT, SIGTERM or SIGHUP set (instead of killing the process), so that a
/// command can clean up what it started.
pub fn stop_on_signals() -> anyhow::Result<Arc<AtomicBool>> {
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGHUP,
    ] {
        signal_hook::flag::register(sig, Arc::clone(&stop))?;
    }
    Ok(stop)
}

/// The state a topology will have once up, recording this process as its daemon.
pub fn plan_state(topo: &Topology, config: &Path) -> anyhow::Result<State> {
    let name: FabricName = topo.fabric.name.parse().map_err(anyhow::Error::msg)?;
    Ok(State {
        fabric: name.clone(),
        config: config.canonicalize().unwrap_or_else(|_| config.to_owned()),
        phase: Phase::Creating,
        daemon_pid: std::process::id(),
        daemon_start: state::process_start_time(std::process::id()).unwrap_or(0),
        time_scale: topo.fabric.time_scale,
        prefix_len: topo.fabric.pool.prefix,
        tun: TUN_NAME.into(),
        tcp_congestion: topo.fabric.host_tcp.congestion.clone(),
        // A new network namespace starts with the host's default congestion control.
        host_congestion: match topo.fabric.host_tcp.congestion {
            Some(_) => None,
            None => std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control")
                .ok()
                .map(|c| c.trim().to_owned())
                .filter(|c| !c.is_empty() && c.len() <= 15),
        },
        tcp_ecn: topo.fabric.host_tcp.ecn,
        tcp_slow_start_after_idle: topo.fabric.host_tcp.slow_start_after_idle,
        time_scale_note: None,
        pacing_off: None,
        owner: None,
        gpus: topo
            .hosts
            .iter()
            .map(|h| GpuState {
                name: h.name.clone(),
                addr: h.addr,
                node: h.node,
                local_rank: h.local_rank,
                netns: closbox_fabric::names::netns_name(name.as_str(), &h.name),
            })
            .collect(),
    })
}

/// How the data plane gets a CPU (`closbox up --realtime`, `--idle-poll`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Scheduling {
    /// The data-plane thread in the real-time FIFO class, with its safety valve.
    pub realtime: bool,
    /// Idle CPUs poll instead of halting while the fabric is up (a PM QoS CPU latency of
    /// 0, held by the daemon): a wake-up of the data plane, or of a GPU's process, then
    /// does not wait for a halted CPU to be woken (tens of µs on a VM).
    pub idle_poll: bool,
}

/// Brings the fabric up and runs its daemon in this process until SIGINT/SIGTERM or a
/// stop request, then tears everything down. `ready` is called once the fabric carries
/// traffic, with the time setup took.
/// The data plane's knobs from `up`'s environment, checked before anything is made: TUN
/// offload (super-packets each way; see `offload`) unless `CLOSBOX_OFFLOAD=0`, and
/// `CLOSBOX_TUN_WRITERS` writer threads (default: by the box's cores).
fn tuning_from_env() -> anyhow::Result<(bool, usize)> {
    let var = |name: &str| match std::env::var(name) {
        Ok(v) => Ok(Some(v)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(v)) => Err(anyhow!("{name}={v:?} is not text")),
    };
    let offload = match var("CLOSBOX_OFFLOAD")?.as_deref() {
        None | Some("1") => true,
        Some("0") => false,
        Some(v) => bail!(
            "CLOSBOX_OFFLOAD={v:?}: 1 (TUN offload, the default) or 0 (a packet per system call)"
        ),
    };
    let writers = match var("CLOSBOX_TUN_WRITERS")? {
        None => TunPorts::writers_for(std::thread::available_parallelism().map_or(1, |n| n.get())),
        Some(v) => match v.parse::<usize>() {
            Ok(n) if n <= 1024 => n,
            _ => bail!("CLOSBOX_TUN_WRITERS={v:?}: a number of writer threads, 0 to 1024 (0: the data plane's thread writes)"),
        },
    };
    Ok((offload, writers))
}

pub fn run_fabric(
    topo: &Topology,
    config: &Path,
    log_to: Option<&Path>,
    metrics: Option<std::net::SocketAddr>,
    sched: Scheduling,
    owner: Option<u32>,
    ready: impl FnOnce(&State, Duration),
) -> anyhow::Result<Stopped> {
    require_root("closbox up")?;
    let started = Instant::now();
    let (offload, writers) = tuning_from_env()?;
    let mut st = plan_state(topo, config)?;
    let name = st.fabric.clone();
    // The owner's end takes the fabric down (`up --owner`).
    let owner = match owner {
        Some(pid) => Some((pid, owner_pidfd(pid)?)),
        None => None,
    };
    st.owner = owner.as_ref().map(|(pid, _)| *pid);
    // Held from the first check to the end of teardown: a second `up` of this name, or a
    // `down`, waits or refuses instead of racing this one.
    let _lock = match FabricLock::try_acquire(&name)? {
        LockAttempt::Acquired(l) => l,
        LockAttempt::Held(pid) => {
            return Err(NameTaken(format!(
                "fabric {name} is already up, or being brought up or down ({}); `closbox down {name}` first, or `up --name` another name",
                pid.map_or("its lock is held".to_owned(), |p| format!("lock held by pid {p}"))
            ))
            .into())
        }
    };
    if let Some(log) = log_to {
        state::redirect_output_to_log(log)?;
    }
    // Refused before anything is created: a fabric whose tables cannot fit would abort
    // half-way otherwise.
    let need = closbox_fabric::plan::DaemonMemory::of(topo);
    if let Some(avail) = mem_available() {
        if need.total > avail {
            bail!(
                "fabric {name} needs up to {} MiB for its daemon (routing tables {} MiB, packets {} MiB) but this box has {} MiB available; use a smaller fabric, or a smaller [fabric] packet_memory",
                need.total >> 20,
                need.routing >> 20,
                need.packets >> 20,
                avail >> 20
            );
        }
    }
    // The daemon keeps each GPU's TUN and a netlink socket in its namespace open
    // (`links`), and while `auto` measures the box each GPU's namespace too: a fabric beyond the open-file limit failed half-way ("Too many open
    // files" at GPU 888 of 1,280 under the usual 1,024), so the soft limit is raised to
    // what it needs, and a fabric the hard limit cannot hold is refused here.
    let files = 3 * topo.hosts.len() as u64 + 64;
    if let Err(hard) = sys::allow_open_files(files).context("raising the open-file limit")? {
        bail!(
            "fabric {name} has {} GPUs: its daemon needs up to {files} open files (a TUN and a netlink socket per GPU, and its namespace while time_scale auto measures), but this process may open at most {hard} (`ulimit -Hn`); raise the limit (as root: `ulimit -n {files}`) or use a smaller fabric",
            topo.hosts.len()
        );
    }
    // Bound before anything is created: a taken address fails `up` cleanly.
    let metrics = metrics.map(metrics::bind).transpose()?;
    // Held to the end of teardown (the calibration below measures with it); the kernel
    // drops the request when the daemon exits, whatever ends it.
    let _cpu_latency = sched
        .idle_poll
        .then(|| {
            sys::hold_cpu_latency(0).context(
                "--idle-poll: asking the kernel to keep idle CPUs polling (/dev/cpu_dma_latency)",
            )
        })
        .transpose()?;
    if let Some(why) = _cpu_latency
        .as_ref()
        .and_then(|_| sys::idle_poll_unavailable())
    {
        tracing::warn!("fabric {name}: --idle-poll has no effect on this box: {why}");
    }
    // `tcp_congestion = "dctcp"` on a kernel without its own: closbox's, registered for
    // as long as this daemon lives (`bpf`), and the GPUs are given its name.
    let _dctcp = match st.tcp_congestion.as_deref() {
        Some("dctcp") => {
            let d = bpf::dctcp()?;
            st.tcp_congestion = Some(d.name().to_owned());
            Some(d)
        }
        _ => None,
    };
    if let Some(old) = State::load(&name)? {
        tracing::warn!("fabric {name}: a previous run left state behind; cleaning it up");
        state::kill_gpu_processes(&old, Duration::from_secs(2));
        state::remove_objects(&old)?;
    }
    let stop = stop_on_signals()?;

    let taken = st.conflicts();
    if !taken.is_empty() {
        let names: Vec<String> = taken
            .iter()
            .take(5)
            .map(|p| p.display().to_string())
            .collect();
        bail!(
            "fabric {name} would create objects that already exist: {}{}; remove them or rename the fabric",
            names.join(", "),
            if taken.len() > 5 { format!(" (and {} more)", taken.len() - 5) } else { String::new() }
        );
    }
    st.save()?;
    let teardown = |st: &State| {
        let stopped = state::kill_gpu_processes(st, Duration::from_secs(2));
        state::remove_objects(st).map(|()| stopped)
    };
    let (tuns, watches) = match netns::create_all(&st, topo, offload) {
        Ok(t) => t,
        Err(e) => {
            if let Err(e2) = teardown(&st) {
                tracing::error!("cleaning up after a failed up: {e2:#}");
            }
            return Err(e.context(format!("bringing fabric {name} up")));
        }
    };
    // time_scale = "auto": measured now, through this fabric's own data path.
    let calibrated;
    let (topo, tuns) = if topo.fabric.time_scale_auto {
        let (choice, tuns) =
            match calibrate::choose(topo, &st, tuns, offload, writers, sched.realtime) {
                Ok(r) => r,
                Err(e) => {
                    if let Err(e2) = teardown(&st) {
                        tracing::error!("cleaning up after a failed calibration: {e2:#}");
                    }
                    return Err(e.context(format!("choosing fabric {name}'s time_scale")));
                }
            };
        tracing::info!(
            "fabric {name}: time_scale auto → {}: {}",
            choice.time_scale,
            choice.why
        );
        let mut t = topo.clone();
        t.fabric.time_scale = TimeScale::new(choice.time_scale).context("chosen time scale")?;
        st.time_scale = t.fabric.time_scale;
        st.time_scale_note = Some(choice.why);
        st.save()?;
        calibrated = t;
        (&calibrated, tuns)
    } else {
        (topo, tuns)
    };
    // Non-TCP senders held to their links' rates (see `pace`): a host without htb or u32
    // keeps going without.
    // Each GPU's interface by its index (its host may rename it).
    let ifindex: Vec<u32> = watches.iter().map(LinkWatch::index).collect();
    let pacer = match pace::install_all(&st, topo, &ifindex)
        .and_then(|plans| Ok(pace::Pacer::start(&st, topo, plans, ifindex.clone())?))
    {
        Ok(p) => Some(p),
        Err(e) => {
            tracing::warn!("fabric {name}: {}: {e:#}", pace::OFF);
            st.pacing_off = Some(format!("{e:#}"));
            None
        }
    };
    let wake = Arc::new(EventFd::new()?);
    let (ctl_tx, ctl_rx) = mpsc::channel();
    // Each GPU's interface MTU followed, as its NIC would be (`links`).
    let ports = TunPorts::new(tuns, Arc::clone(&wake), offload, writers)?.watch_links(watches)?;
    let dp = DataPlane::new(topo, ports, ctl_rx)
        .realtime(sched.realtime)
        .idle_poll(sched.idle_poll)
        .pacer(pacer);
    control::serve(
        st.clone(),
        ifindex.clone(),
        ctl_tx.clone(),
        Arc::clone(&wake),
    )?;
    if let Some(listener) = metrics {
        let addr = listener.local_addr()?;
        let gpus = st.gpus.clone();
        metrics::serve(listener, ctl_tx.clone(), Arc::clone(&wake), gpus, ifindex)?;
        tracing::info!("fabric {name}: metrics on http://{addr}/metrics");
    }
    st.phase = Phase::Ready;
    st.save()?;
    tracing::info!(
        "fabric {name}: {} GPUs ready in {:.3} s (time_scale {}, packet memory {})",
        st.gpus.len(),
        started.elapsed().as_secs_f64(),
        st.time_scale,
        topo.fabric.packet_memory
    );

    // Signals set a flag, an owner ends; this watcher turns either into a stop request.
    let watcher = {
        let (stop, wake, name) = (Arc::clone(&stop), Arc::clone(&wake), name.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                if let Some((pid, _)) = owner.as_ref().filter(|(_, fd)| fd.exited()) {
                    tracing::warn!("fabric {name}: its owner, pid {pid}, ended: taking it down");
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = ctl_tx.send(Ctl::Stop);
            wake.notify();
        })
    };
    // The data plane runs before `up` is told the fabric is ready: whoever `up` returns
    // to finds its thread (one CI run read /proc in between and found none).
    let dataplane = std::thread::Builder::new()
        .name("dataplane".into())
        .spawn(move || dp.run().into_tuns())
        .context("starting the data plane")?;
    if stop.load(Ordering::Relaxed) {
        tracing::info!("stopping before start: signal received");
    } else {
        ready(&st, started.elapsed());
    }
    let tuns = dataplane.join().unwrap_or_default();
    stop.store(true, Ordering::Relaxed);
    let _ = watcher.join();

    st.phase = Phase::Stopping;
    let _ = st.save();
    tracing::info!("fabric {name}: stopping; removing what up made");
    let moved = netns::moved_tuns(&st, &tuns);
    let result = teardown(&st);
    drop(tuns);
    for (gpu, err) in moved {
        match err {
            None => {
                tracing::info!("fabric {name}: {gpu}'s TUN, moved out of its namespace, removed")
            }
            Some(e) => tracing::warn!(
                "fabric {name}: {gpu}'s TUN was moved out of its namespace and may be left: {e}"
            ),
        }
    }
    result
}
