//! closbox's switch daemon: brings a fabric up on this box (a network namespace, UTS
//! namespace and TUN per GPU), drives the fabric model in real time between the TUNs, and
//! takes it down again, removing exactly what it made.
//!
//! All OS access goes through `sys` (the only module with `unsafe`); the model
//! (`closbox_fabric`) stays free of I/O and clocks.

pub mod control;
pub mod dataplane;
pub mod histogram;
pub mod netns;
pub mod state;
#[allow(unsafe_code)]
pub mod sys;

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use closbox_fabric::Topology;

use crate::dataplane::{Ctl, DataPlane};
use crate::state::{GpuState, Phase, State, TUN_NAME};
use crate::sys::EventFd;

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
pub fn plan_state(topo: &Topology, config: &Path) -> State {
    let name = &topo.fabric.name;
    State {
        fabric: name.clone(),
        config: config.canonicalize().unwrap_or_else(|_| config.to_owned()),
        phase: Phase::Creating,
        daemon_pid: std::process::id(),
        daemon_start: state::process_start_time(std::process::id()).unwrap_or(0),
        time_scale: topo.fabric.time_scale,
        prefix_len: topo.fabric.pool.prefix,
        tun: TUN_NAME.into(),
        tcp_congestion: topo.fabric.host_tcp.congestion.clone(),
        tcp_ecn: topo.fabric.host_tcp.ecn,
        tcp_slow_start_after_idle: topo.fabric.host_tcp.slow_start_after_idle,
        gpus: topo
            .hosts
            .iter()
            .map(|h| GpuState {
                name: h.name.clone(),
                addr: h.addr,
                node: h.node,
                local_rank: h.local_rank,
                netns: format!("cb-{name}-{}", h.name),
            })
            .collect(),
    }
}

/// Brings the fabric up and runs its daemon in this process until SIGINT/SIGTERM or a
/// stop request, then tears everything down. `ready` is called once the fabric carries
/// traffic, with the time setup took.
pub fn run_fabric(
    topo: &Topology,
    config: &Path,
    ready: impl FnOnce(&State, Duration),
) -> anyhow::Result<()> {
    require_root("closbox up")?;
    let name = &topo.fabric.name;
    if let Some(old) = State::load(name)? {
        if old.daemon_alive() {
            bail!(
                "fabric {name} is already up (daemon pid {}); `closbox down {name}` first, or give the fabric another name",
                old.daemon_pid
            );
        }
        tracing::warn!("fabric {name}: a previous run left state behind; cleaning it up");
        state::kill_gpu_processes(&old, Duration::from_secs(2));
        state::remove_objects(&old)?;
    }
    let stop = stop_on_signals()?;

    let started = Instant::now();
    let mut st = plan_state(topo, config);
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
        state::kill_gpu_processes(st, Duration::from_secs(2));
        state::remove_objects(st)
    };
    let tuns = match netns::create_all(&st, topo.fabric.mtu) {
        Ok(t) => t,
        Err(e) => {
            if let Err(e2) = teardown(&st) {
                tracing::error!("cleaning up after a failed up: {e2:#}");
            }
            return Err(e.context(format!("bringing fabric {name} up")));
        }
    };
    let wake = Arc::new(EventFd::new()?);
    let (ctl_tx, ctl_rx) = mpsc::channel();
    let dp = DataPlane::new(topo, tuns, Arc::clone(&wake), ctl_rx)?;
    control::serve(st.clone(), ctl_tx.clone(), Arc::clone(&wake))?;
    st.phase = Phase::Ready;
    st.save()?;

    // Signals set a flag; this watcher turns it into a stop request.
    let watcher = {
        let (stop, wake) = (Arc::clone(&stop), Arc::clone(&wake));
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = ctl_tx.send(Ctl::Stop);
            wake.notify();
        })
    };
    if stop.load(Ordering::Relaxed) {
        tracing::info!("stopping before start: signal received");
    } else {
        ready(&st, started.elapsed());
    }
    let dataplane = std::thread::Builder::new()
        .name("dataplane".into())
        .spawn(move || dp.run())
        .context("starting the data plane")?;
    let tuns = dataplane.join().unwrap_or_default();
    stop.store(true, Ordering::Relaxed);
    let _ = watcher.join();

    st.phase = Phase::Stopping;
    let _ = st.save();
    let result = teardown(&st);
    drop(tuns);
    result
}
