//! The state file of a fabric that is up, and removing exactly what `up` made.
//!
//! `up` writes the state file *before* it creates anything, naming every object it will
//! create; `down` (and a daemon shutting down) removes those objects, whichever exist. So
//! a fabric whose `up` died half-way, or whose daemon was SIGKILLed, still comes down
//! completely, and nothing is ever removed by name pattern.

use std::fs;
use std::io;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};

use crate::sys;

/// Where fabric state lives.
pub const RUN_DIR: &str = "/run/closbox";
pub const NETNS_DIR: &str = "/run/netns";
pub const ETC_NETNS_DIR: &str = "/etc/netns";
/// The TUN interface inside every GPU namespace.
pub const TUN_NAME: &str = "cb0";

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    Creating,
    Ready,
    Stopping,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GpuState {
    pub name: String,
    pub addr: Ipv4Addr,
    pub node: u32,
    pub local_rank: u32,
    /// Network namespace name (`cb-<fabric>-<gpu>`).
    pub netns: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct State {
    pub fabric: String,
    pub config: PathBuf,
    pub phase: Phase,
    pub daemon_pid: u32,
    /// Start time of the daemon process (clock ticks since boot), against pid reuse.
    pub daemon_start: u64,
    pub time_scale: f64,
    pub prefix_len: u8,
    pub tun: String,
    /// TCP congestion control and ECN inside the GPU namespaces.
    #[serde(default)]
    pub tcp_congestion: Option<String>,
    #[serde(default)]
    pub tcp_ecn: bool,
    #[serde(default)]
    pub tcp_slow_start_after_idle: bool,
    pub gpus: Vec<GpuState>,
}

pub fn fabric_dir(fabric: &str) -> PathBuf {
    Path::new(RUN_DIR).join(fabric)
}

pub fn state_path(fabric: &str) -> PathBuf {
    fabric_dir(fabric).join("state.json")
}

pub fn control_path(fabric: &str) -> PathBuf {
    fabric_dir(fabric).join("control.sock")
}

/// Log of a daemon started with `up --detach` (outside the fabric directory, which a
/// stale-state cleanup removes while the new daemon is already logging).
pub fn log_path(fabric: &str) -> PathBuf {
    Path::new(RUN_DIR)
        .join("logs")
        .join(format!("{fabric}.log"))
}

impl GpuState {
    pub fn netns_path(&self) -> PathBuf {
        Path::new(NETNS_DIR).join(&self.netns)
    }

    pub fn uts_path(&self, fabric: &str) -> PathBuf {
        fabric_dir(fabric).join("uts").join(&self.name)
    }

    pub fn etc_dir(&self) -> PathBuf {
        Path::new(ETC_NETNS_DIR).join(&self.netns)
    }

    pub fn hosts_path(&self) -> PathBuf {
        self.etc_dir().join("hosts")
    }
}

impl State {
    /// Objects this fabric would create that already exist (made by someone else, or left
    /// by a fabric whose state is gone): `up` refuses rather than take them over.
    pub fn conflicts(&self) -> Vec<PathBuf> {
        self.gpus
            .iter()
            .flat_map(|g| [g.netns_path(), g.etc_dir()])
            .filter(|p| p.symlink_metadata().is_ok())
            .collect()
    }

    pub fn load(fabric: &str) -> anyhow::Result<Option<State>> {
        let p = state_path(fabric);
        match fs::read(&p) {
            Ok(b) => {
                Ok(Some(serde_json::from_slice(&b).with_context(|| {
                    format!("corrupt state file {}", p.display())
                })?))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).with_context(|| format!("reading {}", p.display())),
        }
    }

    /// Writes atomically (temporary file + rename).
    pub fn save(&self) -> anyhow::Result<()> {
        let dir = fabric_dir(&self.fabric);
        fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let tmp = dir.join("state.json.tmp");
        fs::write(&tmp, serde_json::to_vec_pretty(self)?)?;
        fs::rename(&tmp, state_path(&self.fabric))?;
        Ok(())
    }

    pub fn gpu(&self, spec: &str) -> anyhow::Result<(usize, &GpuState)> {
        let found = self
            .gpus
            .iter()
            .enumerate()
            .find(|(i, g)| g.name == spec || spec.parse::<usize>().ok() == Some(*i));
        match found {
            Some(x) => Ok(x),
            None => bail!(
                "fabric {} has no GPU {spec:?} (it has {} GPUs: {} … {}, or ranks 0..{})",
                self.fabric,
                self.gpus.len(),
                self.gpus.first().map_or("", |g| &g.name),
                self.gpus.last().map_or("", |g| &g.name),
                self.gpus.len()
            ),
        }
    }

    /// True if the recorded daemon process is still the one that wrote this state.
    pub fn daemon_alive(&self) -> bool {
        process_start_time(self.daemon_pid) == Some(self.daemon_start)
    }
}

/// Start time of a running process in clock ticks since boot (field 22 of /proc/PID/stat);
/// `None` if there is no such process or it has exited.
pub fn process_start_time(pid: u32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may contain spaces; fields resume after the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let mut fields = rest.split(' ');
    // A zombie (state Z) or dead (X) process is not running, whoever reaps it.
    if matches!(fields.next()?, "Z" | "X") {
        return None;
    }
    fields.nth(18)?.parse().ok()
}

/// Names of fabrics with a state directory.
pub fn fabrics() -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(RUN_DIR)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter(|e| e.path().join("state.json").exists())
                .filter_map(|e| e.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// Pids of processes (other than this one) in any of the network namespaces at `paths`,
/// matched by namespace inode: exact, never by name. One pass over /proc.
pub fn pids_in_netns(paths: &[PathBuf]) -> Vec<i32> {
    let inodes: std::collections::BTreeSet<u64> =
        paths.iter().filter_map(|p| sys::ns_inode(p).ok()).collect();
    if inodes.is_empty() {
        return Vec::new();
    }
    let me = std::process::id() as i32;
    let Ok(rd) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| pid != me)
        .filter(|&pid| {
            sys::ns_inode(Path::new(&format!("/proc/{pid}/ns/net")))
                .is_ok_and(|ino| inodes.contains(&ino))
        })
        .collect()
}

/// Stops every process inside the fabric's namespaces: SIGTERM, then SIGKILL after
/// `grace`.
pub fn kill_gpu_processes(state: &State, grace: Duration) -> usize {
    let paths: Vec<PathBuf> = state.gpus.iter().map(|g| g.netns_path()).collect();
    let pids = pids_in_netns(&paths);
    if pids.is_empty() {
        return 0;
    }
    for &p in &pids {
        let _ = sys::kill(p, libc::SIGTERM);
    }
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if pids_in_netns(&paths).is_empty() {
            return pids.len();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for p in pids_in_netns(&paths) {
        let _ = sys::kill(p, libc::SIGKILL);
    }
    // Reaped by their parents or init; wait until the kernel lets go of them.
    let deadline = Instant::now() + Duration::from_secs(2);
    while !pids_in_netns(&paths).is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    pids.len()
}

/// Removes the namespaces, UTS files, /etc/netns entries and state of a fabric, whichever
/// exist. Processes inside must be gone first (see `kill_gpu_processes`). Idempotent.
pub fn remove_objects(state: &State) -> anyhow::Result<()> {
    let mut errors = Vec::new();
    let mut note = |what: &Path, r: io::Result<()>| {
        if let Err(e) = r {
            if e.kind() != io::ErrorKind::NotFound {
                errors.push(format!("{}: {e}", what.display()));
            }
        }
    };
    for g in &state.gpus {
        for p in [g.netns_path(), g.uts_path(&state.fabric)] {
            note(&p, sys::umount(&p).map(drop));
            note(&p, fs::remove_file(&p));
        }
        note(&g.etc_dir(), fs::remove_dir_all(g.etc_dir()));
    }
    let dir = fabric_dir(&state.fabric);
    note(&dir, fs::remove_dir_all(&dir));
    let log = log_path(&state.fabric);
    note(&log, fs::remove_file(&log));
    if errors.is_empty() {
        Ok(())
    } else {
        bail!("could not remove: {}", errors.join("; "))
    }
}

/// Brings a fabric down from outside its daemon: asks the daemon to stop, kills it if it
/// does not, then removes whatever is left. Returns what it did, for the user.
pub fn down(fabric: &str) -> anyhow::Result<String> {
    let Some(state) = State::load(fabric)? else {
        let dir = fabric_dir(fabric);
        if dir.exists() {
            // `up --detach` died before writing state: only its log is there.
            fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
            return Ok(format!(
                "fabric {fabric}: removed a state directory without state"
            ));
        }
        return Ok(format!("fabric {fabric} is not up; nothing to do"));
    };
    let mut how = "stopped";
    if state.daemon_alive() {
        let _ = sys::kill(state.daemon_pid as i32, libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(10);
        while state.daemon_alive() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        if state.daemon_alive() {
            let _ = sys::kill(state.daemon_pid as i32, libc::SIGKILL);
            how = "killed (it did not stop within 10 s)";
            while state.daemon_alive() {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    } else {
        how = "was not running; cleaned up after it";
    }
    // The daemon removes everything when it stops cleanly; finish the job otherwise.
    if let Some(state) = State::load(fabric)? {
        kill_gpu_processes(&state, Duration::from_secs(2));
        remove_objects(&state)?;
    }
    Ok(format!("fabric {fabric} is down (daemon {how})"))
}
