//! The state file of a fabric that is up, its lock, and removing exactly what `up` made.
//!
//! `up` writes the state file *before* it creates anything, naming every object it will
//! create; `down` (and a daemon shutting down) removes those objects, whichever exist. So
//! a fabric whose `up` died half-way, or whose daemon was SIGKILLed, still comes down
//! completely, and nothing is ever removed by name pattern.
//!
//! Must not: touch anything closbox did not make. Every path here is derived from a
//! validated `FabricName` and validated GPU names under closbox's own directories; a state
//! file read back is validated as hostile input; processes are signalled only through
//! pidfds, after checking what they are.
//!
//! Layout:
//! - `/run/closbox/fabrics/<fabric>/` (mode 0700): `state.json`, `control.sock` (and
//!   `uts/<gpu>` from a closbox before the twentieth landing)
//! - `/run/closbox/locks/<fabric>.lock`: held by `up` and the daemon for their whole life,
//!   and by `down`; removed by its holder as it lets go (a holder that was killed leaves
//!   it, and the next `down` or `up` of the name removes it)
//! - `/run/closbox/logs/<fabric>.log`: the log of a daemon started with `up --detach`,
//!   kept after `down` for post-mortems
//! - `/run/netns/cb-<fabric>.<gpu>` and `/etc/netns/cb-<fabric>.<gpu>/hosts`

use std::collections::BTreeSet;
use std::fmt;
use std::fs;
use std::io::{self, Read as _, Write as _};
use std::net::Ipv4Addr;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use closbox_fabric::names;
use serde::{Deserialize, Serialize};

use crate::stop::{terminate, Targets};
use crate::sys::{self, Pidfd};

/// Where fabric state lives.
pub const RUN_DIR: &str = "/run/closbox";
pub const NETNS_DIR: &str = "/run/netns";
pub const ETC_NETNS_DIR: &str = "/etc/netns";
/// The TUN interface inside every GPU namespace.
pub const TUN_NAME: &str = "cb0";
/// Largest state file read back (256 GPUs take ~50 KB).
const MAX_STATE_BYTES: u64 = 64 << 20;
/// Most GPUs a state file may list.
const MAX_STATE_GPUS: usize = 65_536;
/// How long `down` waits for a daemon after SIGTERM, then after SIGKILL.
const DAEMON_GRACE: Duration = Duration::from_secs(10);
const KILL_WAIT: Duration = Duration::from_secs(5);

fn fabrics_dir() -> PathBuf {
    Path::new(RUN_DIR).join("fabrics")
}

/// A fabric name that passed `names::check_fabric_name`: safe to join onto a directory.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(transparent)]
pub struct FabricName(String);

impl FromStr for FabricName {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        names::check_fabric_name(s)?;
        Ok(FabricName(s.to_owned()))
    }
}

impl<'de> Deserialize<'de> for FabricName {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl fmt::Display for FabricName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FabricName {
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// `/run/closbox/fabrics/<name>`.
    pub fn dir(&self) -> PathBuf {
        fabrics_dir().join(&self.0)
    }

    pub fn state_path(&self) -> PathBuf {
        self.dir().join("state.json")
    }

    pub fn control_path(&self) -> PathBuf {
        self.dir().join("control.sock")
    }

    /// Where a closbox before the twentieth landing pinned each GPU's UTS namespace: `down`
    /// still removes what such a fabric left there.
    fn uts_dir(&self) -> PathBuf {
        self.dir().join("uts")
    }

    /// Log of a daemon started with `up --detach` (outside the fabric directory, and kept
    /// after `down`).
    pub fn log_path(&self) -> PathBuf {
        Path::new(RUN_DIR)
            .join("logs")
            .join(format!("{}.log", self.0))
    }

    pub fn lock_path(&self) -> PathBuf {
        Path::new(RUN_DIR)
            .join("locks")
            .join(format!("{}.lock", self.0))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    Creating,
    Ready,
    Stopping,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuState {
    pub name: String,
    pub addr: Ipv4Addr,
    pub node: u32,
    pub local_rank: u32,
    /// Network namespace name (`cb-<fabric>.<gpu>`, see `names::netns_name`).
    pub netns: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct State {
    pub fabric: FabricName,
    pub config: PathBuf,
    pub phase: Phase,
    pub daemon_pid: u32,
    /// Start time of the daemon process (clock ticks since boot), against pid reuse.
    pub daemon_start: u64,
    pub time_scale: closbox_fabric::TimeScale,
    pub prefix_len: u8,
    pub tun: String,
    /// TCP congestion control and ECN inside the GPU namespaces.
    #[serde(default)]
    pub tcp_congestion: Option<String>,
    /// With `tcp_congestion` unset (`"host"`): the host's default, which each GPU's
    /// namespace started with, as read at `up`.
    #[serde(default)]
    pub host_congestion: Option<String>,
    #[serde(default)]
    pub tcp_ecn: bool,
    #[serde(default)]
    pub tcp_slow_start_after_idle: bool,
    /// With `time_scale = "auto"`: why `up` chose `time_scale` (its calibration).
    #[serde(default)]
    pub time_scale_note: Option<String>,
    /// Why the GPUs' non-TCP packets are not held to their links' rates, where `up`
    /// could not install the qdisc (`pace`).
    #[serde(default)]
    pub pacing_off: Option<String>,
    /// `up --owner`: the process whose end takes the fabric down. (Left out when none:
    /// the state of a fabric without one reads as before the field.)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<u32>,
    pub gpus: Vec<GpuState>,
}

impl GpuState {
    pub fn netns_path(&self) -> PathBuf {
        Path::new(NETNS_DIR).join(&self.netns)
    }

    pub fn uts_path(&self, fabric: &FabricName) -> PathBuf {
        fabric.uts_dir().join(&self.name)
    }

    pub fn etc_dir(&self) -> PathBuf {
        Path::new(ETC_NETNS_DIR).join(&self.netns)
    }

    pub fn hosts_path(&self) -> PathBuf {
        self.etc_dir().join("hosts")
    }

    /// The GPU's `/etc/hostname` (its name), as `ip netns exec` would bind it too.
    pub fn hostname_path(&self) -> PathBuf {
        self.etc_dir().join("hostname")
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

    /// Reads and validates the state of fabric `name`; `None` if there is none. A state
    /// file that is not closbox's own (a symlink, too large, names that do not derive from
    /// the fabric's) is an error, and nothing is done with it.
    pub fn load(name: &FabricName) -> anyhow::Result<Option<State>> {
        check_bases(name)?;
        let p = name.state_path();
        let f = match fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(&p)
        {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e).with_context(|| format!("reading {}", p.display())),
        };
        let meta = f.metadata()?;
        if !meta.is_file() || meta.len() > MAX_STATE_BYTES {
            bail!(
                "{} is not a state file closbox wrote (not a regular file, or too large); nothing was done with it",
                p.display()
            );
        }
        let mut bytes = Vec::new();
        f.take(MAX_STATE_BYTES).read_to_end(&mut bytes)?;
        let st: State = serde_json::from_slice(&bytes)
            .with_context(|| format!("corrupt state file {}", p.display()))?;
        st.validate(name).with_context(|| {
            format!(
                "invalid state file {}; nothing was done with it",
                p.display()
            )
        })?;
        Ok(Some(st))
    }

    /// Every name in the state is one closbox would derive for this fabric.
    fn validate(&self, name: &FabricName) -> anyhow::Result<()> {
        if &self.fabric != name {
            bail!("it names fabric {:?}, not {name:?}", self.fabric.as_str());
        }
        if self.tun != TUN_NAME {
            bail!("interface {:?} is not closbox's ({TUN_NAME})", self.tun);
        }
        if self.gpus.len() > MAX_STATE_GPUS {
            bail!("{} GPUs is more than any fabric has", self.gpus.len());
        }
        if self.prefix_len > 32 {
            bail!("prefix length out of range");
        }
        for cc in self.tcp_congestion.iter().chain(&self.host_congestion) {
            if cc.is_empty()
                || cc.len() > 15
                || !cc.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            {
                bail!("tcp_congestion {cc:?} is not a congestion control name");
            }
        }
        let mut seen = BTreeSet::new();
        for g in &self.gpus {
            names::check_host_name(&g.name).map_err(anyhow::Error::msg)?;
            let want = names::netns_name(name.as_str(), &g.name);
            if g.netns != want {
                bail!("GPU {:?} has namespace {:?}, not {want:?}", g.name, g.netns);
            }
            if !seen.insert(&g.name) {
                bail!("GPU {:?} is listed twice", g.name);
            }
        }
        Ok(())
    }

    /// Writes atomically: a temporary file of a unique name, then a rename. Creates the
    /// fabric directory (mode 0700) if needed.
    pub fn save(&self) -> anyhow::Result<()> {
        let dir = self.fabric.dir();
        make_private_dir(&dir)?;
        let tmp = dir.join(format!(
            "state.json.tmp.{}.{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos())
        ));
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .with_context(|| format!("creating {}", tmp.display()))?;
        let written = f
            .write_all(&serde_json::to_vec_pretty(self)?)
            .and_then(|()| f.sync_data())
            .and_then(|()| fs::rename(&tmp, self.fabric.state_path()));
        if let Err(e) = written {
            let _ = fs::remove_file(&tmp);
            return Err(e)
                .with_context(|| format!("writing {}", self.fabric.state_path().display()));
        }
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
                "fabric {} has no GPU {spec:?} (it has {} GPUs: {} … {}, or ranks 0 to {})",
                self.fabric,
                self.gpus.len(),
                self.gpus.first().map_or("", |g| &g.name),
                self.gpus.last().map_or("", |g| &g.name),
                self.gpus.len().saturating_sub(1)
            ),
        }
    }

    /// True if the recorded daemon process is still the one that wrote this state.
    pub fn daemon_alive(&self) -> bool {
        process_start_time(self.daemon_pid) == Some(self.daemon_start)
    }
}

/// Creates `dir` (and missing parents) and makes sure it is a real directory of mode 0700.
fn make_private_dir(dir: &Path) -> anyhow::Result<()> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("creating {}", dir.display()))?;
    let meta = dir.symlink_metadata()?;
    if !meta.is_dir() {
        bail!("{} is not a directory", dir.display());
    }
    if meta.mode() & 0o077 != 0 {
        fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
    }
    Ok(())
}

/// Sends this process's stdout and stderr to `log` (created or truncated, mode 0600, in a
/// 0700 directory): a detached daemon's log.
pub fn redirect_output_to_log(log: &Path) -> anyhow::Result<()> {
    make_private_dir(log.parent().context("log path")?)?;
    let f = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(log)
        .with_context(|| format!("opening {}", log.display()))?;
    sys::redirect_stdout_stderr(&f).with_context(|| format!("logging to {}", log.display()))
}

/// Creates the directory a fabric's state and control socket live in (mode 0700).
pub fn prepare_fabric_dir(name: &FabricName) -> anyhow::Result<()> {
    make_private_dir(&name.dir())
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

/// A process's state letter (field 3 of /proc/PID/stat: R, S, D, T, t, Z …).
pub fn process_state(pid: u32) -> Option<char> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat[stat.rfind(')')? + 2..].chars().next()
}

/// Fabrics with a state file (directories with invalid names are not closbox's: skipped).
pub fn fabrics() -> Vec<FabricName> {
    let mut names: Vec<FabricName> = fs::read_dir(fabrics_dir())
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().into_string().ok()?.parse::<FabricName>().ok())
                .filter(|n| n.state_path().symlink_metadata().is_ok())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

// ---- the lock ------------------------------------------------------------------------

/// The per-fabric lock (`flock` on `/run/closbox/locks/<fabric>.lock`), held by `up` from
/// its first check through the daemon's whole life, and by `down`. Released on drop, and
/// the file removed then, so that names once up leave nothing behind. That is safe because
/// every taker checks, once it holds the lock, that the path still names the file it
/// locked (a taker that opened the file before its holder removed it, and locked it
/// after, holds a lock nobody else can see: it tries again on the new file).
#[derive(Debug)]
pub struct FabricLock {
    file: fs::File,
    path: PathBuf,
}

impl Drop for FabricLock {
    fn drop(&mut self) {
        // Only the holder of the file the path names removes it, and only while holding
        // it: a path that names another file (never, while we hold ours) is left alone.
        if same_file(&self.file, &self.path) {
            let _ = fs::remove_file(&self.path);
        }
    }
}

/// Whether `path` (not followed) names the file `file` has open.
fn same_file(file: &fs::File, path: &Path) -> bool {
    match (file.metadata(), fs::symlink_metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// The outcome of trying to take a fabric's lock.
#[derive(Debug)]
pub enum LockAttempt {
    Acquired(FabricLock),
    /// Another process holds it: its pid as /proc/locks shows it, if it does.
    Held(Option<u32>),
}

impl FabricLock {
    pub fn try_acquire(name: &FabricName) -> anyhow::Result<LockAttempt> {
        let path = name.lock_path();
        make_private_dir(path.parent().expect("lock dir"))?;
        // A holder removes the file as it lets go: a lock taken on a file removed meanwhile
        // is no lock, and the next try opens (or makes) the file the path names now. Each
        // retry follows another holder's whole tenure, so a few suffice.
        for _ in 0..100 {
            let file = fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&path)
                .with_context(|| format!("opening {}", path.display()))?;
            if !sys::try_flock_exclusive(&file)? {
                return Ok(LockAttempt::Held(lock_holder(&file)));
            }
            if same_file(&file, &path) {
                return Ok(LockAttempt::Acquired(FabricLock { file, path }));
            }
        }
        bail!(
            "fabric {name}'s lock file {} keeps being replaced; try again",
            path.display()
        )
    }

    /// Waits up to `timeout` for the lock.
    pub fn acquire_within(
        name: &FabricName,
        timeout: Duration,
    ) -> anyhow::Result<Option<FabricLock>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let LockAttempt::Acquired(l) = FabricLock::try_acquire(name)? {
                return Ok(Some(l));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// The pid holding a `flock` on `file`, from /proc/locks (matched by device and inode).
fn lock_holder(file: &fs::File) -> Option<u32> {
    let meta = file.metadata().ok()?;
    let (dev, ino) = (meta.dev(), meta.ino());
    let want = format!("{:02x}:{:02x}:{ino}", libc::major(dev), libc::minor(dev));
    let locks = fs::read_to_string("/proc/locks").ok()?;
    // "1: FLOCK  ADVISORY  WRITE 1234 00:1a:5678 0 EOF"
    locks.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        (f.get(1) == Some(&"FLOCK") && f.get(5) == Some(&want.as_str()))
            .then(|| f.get(4)?.parse().ok())?
    })
}

/// What a process is, for deciding whether closbox may signal it: the closbox command it
/// runs (`up`, `down`, …), if it is a closbox binary at all.
/// Whether process `pid` is exiting: it still is, but has no executable any more (a
/// process's memory, and with it its executable, goes before its open files; kernel
/// threads hold no locks).
fn exiting(pid: u32) -> bool {
    let exe = fs::read_link(format!("/proc/{pid}/exe"));
    matches!(exe, Err(e) if e.kind() == std::io::ErrorKind::NotFound)
        && Path::new(&format!("/proc/{pid}")).exists()
}

fn closbox_command(pid: u32) -> Option<String> {
    let link = format!("/proc/{pid}/exe");
    let exe = fs::read_link(&link).ok()?;
    let file = exe.file_name()?.to_str()?;
    // This very program, whatever it is called (installed or copied under another name),
    // or "closbox", or "closbox (deleted)" after a rebuild, or a test copy "closbox-<hash>".
    let this_program = match (fs::metadata(&link), fs::metadata("/proc/self/exe")) {
        (Ok(a), Ok(b)) => (a.dev(), a.ino()) == (b.dev(), b.ino()),
        _ => false,
    };
    if !this_program && (!file.starts_with("closbox") || file.starts_with("closbox-agent")) {
        return None;
    }
    let cmdline = fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
    Some(String::from_utf8_lossy(args.get(1)?).into_owned())
}

// ---- stopping processes --------------------------------------------------------------

pub use crate::stop::Stopped;

/// (device, inode) of a network namespace file, if it is one (an nsfs file). `path` is not
/// followed if it is a symlink: a planted link cannot point the scan elsewhere.
fn netns_id(path: &Path, nsfs_dev: u64) -> Option<(u64, u64)> {
    let meta = path.symlink_metadata().ok()?;
    (meta.dev() == nsfs_dev && !meta.file_type().is_symlink()).then(|| (meta.dev(), meta.ino()))
}

/// The processes whose network namespace is one of a fabric's (identified by device and
/// inode), and, if `job` is given, that are the job's.
struct InNamespaces {
    targets: BTreeSet<(u64, u64)>,
    job: Option<JobMarks>,
}

/// What tells a job's processes (`kill_job_in_gpus`): their session is one of its ranks',
/// or they were started with its `CLOSBOX_JOB` in their environment.
#[derive(Debug, Default)]
pub struct JobMarks {
    pub sessions: BTreeSet<i32>,
    /// `CLOSBOX_JOB=<token>`, as the environment's entry reads.
    pub env: Option<Vec<u8>>,
}

impl JobMarks {
    fn marks(&self, pid: i32) -> bool {
        let in_session = rustix::process::Pid::from_raw(pid)
            .and_then(|p| rustix::process::getsid(Some(p)).ok())
            .is_some_and(|s| self.sessions.contains(&s.as_raw_nonzero().get()));
        in_session
            || self.env.as_ref().is_some_and(|entry| {
                // The environment it was started with (what it set since is not there).
                fs::read(format!("/proc/{pid}/environ"))
                    .is_ok_and(|env| env.split(|&b| b == 0).any(|e| e == entry.as_slice()))
            })
    }

    fn is_empty(&self) -> bool {
        self.sessions.is_empty() && self.env.is_none()
    }
}

impl InNamespaces {
    /// The namespaces of `state`'s GPUs that exist; never the host's own (this process's
    /// or init's). None if there are none.
    fn of(state: &State, job: Option<JobMarks>) -> Option<InNamespaces> {
        let nsfs = fs::metadata("/proc/self/ns/net").ok()?;
        let host = (nsfs.dev(), nsfs.ino());
        let init = fs::metadata("/proc/1/ns/net")
            .map(|m| (m.dev(), m.ino()))
            .ok();
        let targets: BTreeSet<(u64, u64)> = state
            .gpus
            .iter()
            .filter_map(|g| netns_id(&g.netns_path(), nsfs.dev()))
            .filter(|id| *id != host && Some(*id) != init)
            .collect();
        (!targets.is_empty()).then_some(InNamespaces { targets, job })
    }

    /// Pids (other than this process) that are targets. A zombie is not: its namespaces
    /// are gone with it.
    fn pids(&self) -> Vec<i32> {
        let me = std::process::id() as i32;
        let Ok(rd) = fs::read_dir("/proc") else {
            return Vec::new();
        };
        rd.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
            .filter(|&pid| pid != me && self.is_target(pid))
            .collect()
    }

    fn is_target(&self, pid: i32) -> bool {
        // /proc/PID/ns/net is a magic link: stat (not lstat) gives the namespace's identity.
        let inside = fs::metadata(format!("/proc/{pid}/ns/net"))
            .is_ok_and(|m| self.targets.contains(&(m.dev(), m.ino())));
        inside && self.job.as_ref().is_none_or(|job| job.marks(pid))
    }
}

impl Targets for InNamespaces {
    /// Signals every target through a pidfd opened before the check (so a reused pid is
    /// never signalled).
    fn signal(&mut self, sig: libc::c_int) -> Vec<i32> {
        let mut hit = Vec::new();
        for pid in self.pids() {
            let Ok(Some(fd)) = Pidfd::open(pid) else {
                continue;
            };
            if self.is_target(pid) && fd.signal(sig).unwrap_or(false) {
                hit.push(pid);
            }
        }
        hit
    }

    fn running(&mut self) -> Vec<i32> {
        self.pids()
    }
}

/// Stops every process inside the fabric's namespaces: SIGTERM, SIGKILL after `grace`,
/// then waits (bounded) for the kernel to let go of them. Namespaces are identified by
/// device and inode; the host's own namespace is never a target.
pub fn kill_gpu_processes(state: &State, grace: Duration) -> Stopped {
    let Some(mut targets) = InNamespaces::of(state, None) else {
        return Stopped::default();
    };
    let stopped = terminate(&mut targets, grace, KILL_WAIT);
    if !stopped.stopped.is_empty() || !stopped.survivors.is_empty() {
        tracing::info!(
            "fabric {}: processes in its GPUs: stopped {:?}, surviving {:?}",
            state.fabric,
            stopped.stopped,
            stopped.survivors
        );
    }
    stopped
}

/// Stops the processes in the fabric's GPUs that are a job's (`JobMarks`: the ranks, each
/// the leader of its own session, what they started, and what left its session but kept
/// the job's environment, as a server that daemonizes or torchrun's workers in sessions
/// of their own), as `kill_gpu_processes` does. A session's number reused on the host is
/// never reached.
pub fn kill_job_in_gpus(state: &State, job: JobMarks, grace: Duration) -> Stopped {
    if job.is_empty() {
        return Stopped::default();
    }
    match InNamespaces::of(state, Some(job)) {
        Some(mut targets) => terminate(&mut targets, grace, KILL_WAIT),
        None => Stopped::default(),
    }
}

/// A fabric's daemon, reached through a pidfd; gone once the fabric's lock is free (and
/// then the lock is ours).
struct Daemon<'a> {
    name: &'a FabricName,
    fd: Pidfd,
    pid: i32,
    lock: Option<FabricLock>,
}

impl Targets for Daemon<'_> {
    fn signal(&mut self, sig: libc::c_int) -> Vec<i32> {
        if self.lock.is_some() {
            return Vec::new();
        }
        tracing::info!(
            "fabric {}: signal {sig} to its daemon, pid {}",
            self.name,
            self.pid
        );
        match self.fd.signal(sig) {
            Ok(true) => vec![self.pid],
            _ => Vec::new(),
        }
    }

    fn running(&mut self) -> Vec<i32> {
        if self.lock.is_none() {
            if let Ok(LockAttempt::Acquired(l)) = FabricLock::try_acquire(self.name) {
                self.lock = Some(l);
            }
        }
        // Gone, with the lock ours; or gone, and the lock taken by another process (an
        // `up` of the name run meanwhile), which the caller deals with.
        if self.lock.is_some() || self.fd.exited() {
            Vec::new()
        } else {
            vec![self.pid]
        }
    }
}

// ---- removing objects ----------------------------------------------------------------

/// Whether `path` is a real directory: `Ok(false)` if absent, an error if something else
/// (a symlink, a file) stands there — closbox made directories only, and never follows a
/// link planted where one of them belongs.
fn real_dir(path: &Path) -> io::Result<bool> {
    match path.symlink_metadata() {
        Ok(m) if m.is_dir() => Ok(true),
        Ok(_) => Err(io::Error::other(format!(
            "{} is not a directory closbox made (a symlink or a file); left as it is",
            path.display()
        ))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// The directories closbox's paths run through, each a real directory (or absent).
fn check_bases(name: &FabricName) -> anyhow::Result<()> {
    for dir in [
        Path::new(RUN_DIR).to_path_buf(),
        fabrics_dir(),
        name.dir(),
        Path::new(NETNS_DIR).to_path_buf(),
        Path::new(ETC_NETNS_DIR).to_path_buf(),
    ] {
        real_dir(&dir)?;
    }
    Ok(())
}

/// Removes `path` if it is a plain file (never a directory; a symlink itself, not its
/// target). Absent is fine.
fn remove_plain_file(path: &Path) -> io::Result<()> {
    match path.symlink_metadata() {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
        Ok(m) if m.is_dir() => Err(io::Error::other("is a directory, not closbox's file")),
        Ok(_) => fs::remove_file(path),
    }
}

fn remove_empty_dir(path: &Path) -> io::Result<()> {
    match fs::remove_dir(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        r => r,
    }
}

/// Removes the namespaces, UTS files, /etc/netns entries and state of a fabric, whichever
/// exist: exactly the paths its validated state names, and directories only when empty.
/// Processes inside must be gone first (see `kill_gpu_processes`). Idempotent.
pub fn remove_objects(state: &State) -> anyhow::Result<()> {
    check_bases(&state.fabric)?;
    let mut errors = Vec::new();
    fn note(errors: &mut Vec<String>, what: &Path, r: io::Result<()>) {
        if let Err(e) = r {
            errors.push(format!("{}: {e}", what.display()));
        }
    }
    let nsfs_dev = fs::metadata("/proc/self/ns/net").map(|m| m.dev()).ok();
    for g in &state.gpus {
        for p in [g.netns_path(), g.uts_path(&state.fabric)] {
            // Unmount only what is a namespace pin (an nsfs mount); a plain file is left
            // to remove_plain_file, anything else is not ours.
            let pinned = p
                .symlink_metadata()
                .is_ok_and(|m| Some(m.dev()) == nsfs_dev || m.file_type().is_file());
            if pinned {
                note(&mut errors, &p, sys::umount(&p).map(drop));
            }
            note(&mut errors, &p, remove_plain_file(&p));
        }
        // Inside /etc/netns/<ns> only if that is a real directory: a symlink planted there
        // must not lead to another `hosts`.
        match real_dir(&g.etc_dir()) {
            Ok(true) => {
                for file in [g.hosts_path(), g.hostname_path()] {
                    note(&mut errors, &file, remove_plain_file(&file));
                }
                note(&mut errors, &g.etc_dir(), remove_empty_dir(&g.etc_dir()));
            }
            Ok(false) => {}
            Err(e) => note(&mut errors, &g.etc_dir(), Err(e)),
        }
    }
    note(
        &mut errors,
        &state.fabric.uts_dir(),
        remove_empty_dir(&state.fabric.uts_dir()),
    );
    if !errors.is_empty() {
        // The state stays: it lists what is left, for another `down` once that is sorted.
        bail!(
            "could not remove: {}; the state file stays, for `closbox down {}` once that is sorted",
            errors.join("; "),
            state.fabric
        );
    }
    let dir = state.fabric.dir();
    note(&mut errors, &dir, remove_own_files(&state.fabric).map(drop));
    note(&mut errors, &dir, remove_empty_dir(&dir));
    tracing::debug!(
        "fabric {}: removed the objects of {} GPUs ({} errors)",
        state.fabric,
        state.gpus.len(),
        errors.len()
    );
    if errors.is_empty() {
        Ok(())
    } else {
        bail!("could not remove: {}", errors.join("; "))
    }
}

/// Removes closbox's own files from a fabric directory (state, temporaries, control
/// socket, an empty `uts`); returns the entries it left because they are not closbox's.
fn remove_own_files(name: &FabricName) -> io::Result<Vec<String>> {
    let dir = name.dir();
    if !real_dir(&dir)? {
        return Ok(Vec::new());
    }
    let rd = match fs::read_dir(&dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut foreign = Vec::new();
    for e in rd {
        let e = e?;
        let file = e.file_name().to_string_lossy().into_owned();
        let ft = e.file_type()?;
        let own = match file.as_str() {
            "state.json" => ft.is_file(),
            "control.sock" => ft.is_socket(),
            "uts" => ft.is_dir(),
            f => f.starts_with("state.json.tmp.") && ft.is_file(),
        };
        if !own {
            foreign.push(file);
            continue;
        }
        let p = e.path();
        let r = if ft.is_dir() {
            fs::remove_dir(&p)
        } else {
            fs::remove_file(&p)
        };
        if r.is_err() {
            foreign.push(file);
        }
    }
    Ok(foreign)
}

/// Brings a fabric down from outside its daemon: takes the fabric's lock (asking the daemon
/// that holds it to stop first, killing it if it does not), then removes whatever is left.
/// Returns what it did, for the user.
pub fn down(name: &FabricName) -> anyhow::Result<String> {
    // A name never brought up on this boot (no lock file: `up` makes it first, before
    // anything else) has nothing to take down, and `down` leaves no lock file of it.
    if name.lock_path().symlink_metadata().is_err() && name.dir().symlink_metadata().is_err() {
        return Ok(format!("fabric {name} is not up; nothing to do"));
    }
    // Processes a running daemon's GPUs still hold are stopped by `down` itself, before
    // the daemon (which would do it silently), so that it can say which.
    let mut stopped = Stopped::default();
    let (lock, how) = take_from_daemon(name, &mut stopped)?;
    // With the lock held, no daemon of this fabric runs, and no `up` of it is under way.
    let out = match State::load(name)? {
        Some(state) => {
            stopped.add(kill_gpu_processes(&state, Duration::from_secs(2)));
            remove_objects(&state)?;
            format!("fabric {name} is down ({how}){}", stopped.said_for_down())
        }
        None if name.dir().symlink_metadata().is_ok() => {
            let foreign = remove_own_files(name)?;
            if !foreign.is_empty() {
                bail!(
                    "fabric {name} has no state, and {} holds files closbox did not make ({}); left as it is",
                    name.dir().display(),
                    foreign.join(", ")
                );
            }
            remove_empty_dir(&name.dir())
                .with_context(|| format!("removing {}", name.dir().display()))?;
            format!("fabric {name}: removed its state directory (it held no state)")
        }
        None if how == DownHow::NotRunning => format!("fabric {name} is not up; nothing to do"),
        None => format!("fabric {name} is down ({how}){}", stopped.said_for_down()),
    };
    drop(lock);
    Ok(out)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DownHow {
    NotRunning,
    Stopped,
    Killed,
}

impl fmt::Display for DownHow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DownHow::NotRunning => "no daemon was running; cleaned up after it",
            DownHow::Stopped => "daemon stopped",
            DownHow::Killed => "daemon killed: it did not stop within 10 s of SIGTERM",
        })
    }
}

/// Takes the fabric's lock; if a closbox daemon holds it, stops that daemon first. An `up`
/// of the name that takes the lock as its daemon lets go (run at the same time as this
/// `down`) is stopped in turn: `down` ends with the fabric down, a few times over at most.
/// The processes in the fabric's GPUs are stopped (into `stopped`) once the lock holder is
/// known to be a closbox `up`, before it is signalled.
fn take_from_daemon(
    name: &FabricName,
    stopped: &mut Stopped,
) -> anyhow::Result<(FabricLock, DownHow)> {
    let mut how = DownHow::NotRunning;
    for _ in 0..3 {
        match take_once(name, stopped)? {
            Taken::Lock(l, h) => return Ok((l, if h == DownHow::NotRunning { how } else { h })),
            Taken::Retaken(h) => how = h,
        }
    }
    bail!("fabric {name} keeps being brought up while it is taken down; try again")
}

enum Taken {
    Lock(FabricLock, DownHow),
    /// The daemon ended (as `DownHow` says), and another process took the lock meanwhile.
    Retaken(DownHow),
}

fn take_once(name: &FabricName, stopped: &mut Stopped) -> anyhow::Result<Taken> {
    let deadline = Instant::now() + Duration::from_secs(1);
    let pid = loop {
        match FabricLock::try_acquire(name)? {
            LockAttempt::Acquired(l) => return Ok(Taken::Lock(l, DownHow::NotRunning)),
            LockAttempt::Held(Some(pid)) => break pid,
            // Let go between the attempt and the look at /proc/locks: a holder exiting (a
            // daemon killed a moment ago, closing its descriptors). A CI run's `down`
            // right after a SIGKILL failed here. Looked at again for a second.
            LockAttempt::Held(None) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            LockAttempt::Held(None) => {
                bail!("fabric {name} is locked by a process /proc/locks does not show; try again")
            }
        }
    };
    let fd = Pidfd::open(pid as i32)?;
    let lock_path = name.lock_path();
    let still_holder = || {
        fs::File::open(&lock_path)
            .ok()
            .and_then(|f| lock_holder(&f))
            == Some(pid)
    };
    // Checked after the pidfd is open: the pidfd is the process that was checked.
    let command = closbox_command(pid);
    let Some(fd) = fd.filter(|_| still_holder()) else {
        // The holder went away meanwhile: try once more.
        return match FabricLock::acquire_within(name, Duration::from_secs(1))? {
            Some(l) => Ok(Taken::Lock(l, DownHow::NotRunning)),
            // /proc/locks names the process that took a lock; one that exited leaves it to
            // the children that inherited its descriptor (`flock FILE CMD` does).
            None if Pidfd::open(pid as i32)?.is_none() && still_holder() => bail!(
                "fabric {name}'s lock ({}) is held by a process that inherited it from pid {pid}, which has exited; nothing was signalled (`fuser {}` names the holder)",
                lock_path.display(),
                lock_path.display()
            ),
            None => bail!("fabric {name} is busy (its lock changed hands); try again"),
        };
    };
    match command.as_deref() {
        Some("up") => {}
        Some(other) => {
            // Another `down` (or a `closbox` command that holds the lock): wait for it.
            return match FabricLock::acquire_within(name, DAEMON_GRACE + KILL_WAIT)? {
                Some(l) => Ok(Taken::Lock(l, DownHow::NotRunning)),
                None => bail!("fabric {name} is held by `closbox {other}` (pid {pid}), which did not finish within 15 s"),
            };
        }
        // A process on its way out (killed, or ending) has let go of its memory, and so
        // of its executable, before its files: its lock goes when its descriptors are
        // closed, which for a daemon's TUNs takes milliseconds each. Waited for.
        None if exiting(pid) => {
            return match FabricLock::acquire_within(name, KILL_WAIT)? {
                Some(l) => Ok(Taken::Lock(l, DownHow::NotRunning)),
                None => bail!(
                    "fabric {name}'s lock is held by pid {pid}, which is exiting and did not let go of it within {} s; nothing was removed",
                    KILL_WAIT.as_secs()
                ),
            };
        }
        None => bail!(
            "fabric {name}'s lock is held by pid {pid}, which is not a closbox daemon; it was not signalled"
        ),
    }
    // The daemon is closbox's: its GPUs' processes first (a state that cannot be read is
    // left to the checks after the lock).
    if let Ok(Some(state)) = State::load(name) {
        stopped.add(kill_gpu_processes(&state, Duration::from_secs(2)));
    }
    let mut daemon = Daemon {
        name,
        fd,
        pid: pid as i32,
        lock: None,
    };
    let ended = terminate(&mut daemon, DAEMON_GRACE, KILL_WAIT);
    let how = if ended.killed {
        DownHow::Killed
    } else {
        DownHow::Stopped
    };
    match daemon.lock {
        Some(l) => Ok(Taken::Lock(l, how)),
        None if daemon.fd.exited() => Ok(Taken::Retaken(how)),
        None => bail!(
            "the daemon of fabric {name} (pid {pid}) did not exit within {} s of SIGKILL; nothing was removed",
            KILL_WAIT.as_secs()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state_json(fabric: &str, gpu: &str, netns: &str) -> String {
        format!(
            r#"{{"fabric":"{fabric}","config":"/x.toml","phase":"ready","daemon_pid":1,"daemon_start":1,
               "time_scale":1.0,"prefix_len":15,"tun":"cb0",
               "gpus":[{{"name":"{gpu}","addr":"198.18.0.1","node":0,"local_rank":0,"netns":"{netns}"}}]}}"#
        )
    }

    fn check(fabric: &str, json: &str) -> anyhow::Result<State> {
        let name: FabricName = fabric.parse().map_err(anyhow::Error::msg)?;
        let st: State = serde_json::from_str(json)?;
        st.validate(&name)?;
        Ok(st)
    }

    #[test]
    fn names_that_leave_the_directory_are_refused() {
        for bad in ["/tmp/x", "..", ".", "/", "a/../..", ""] {
            assert!(bad.parse::<FabricName>().is_err(), "{bad:?}");
        }
        let n: FabricName = "ls16".parse().unwrap();
        assert_eq!(n.dir(), Path::new("/run/closbox/fabrics/ls16"));
        assert_eq!(n.lock_path(), Path::new("/run/closbox/locks/ls16.lock"));
    }

    #[test]
    fn a_state_file_is_validated_as_hostile_input() {
        assert!(check("t", &state_json("t", "gpu0", "cb-t.gpu0")).is_ok());
        // Namespace path elsewhere, or the host's namespace.
        for netns in ["/proc/1/ns/net", "../../etc", "cb-other.gpu0", "cb-t.gpu1"] {
            let e = check("t", &state_json("t", "gpu0", netns)).unwrap_err();
            assert!(e.to_string().contains("namespace"), "{netns}: {e}");
        }
        // GPU names that are paths.
        for gpu in ["..", ".", "a/b"] {
            let netns = format!("cb-t.{gpu}");
            assert!(check("t", &state_json("t", gpu, &netns)).is_err(), "{gpu}");
        }
        // A state file of another fabric, or an invalid fabric name inside.
        assert!(check("t", &state_json("u", "gpu0", "cb-u.gpu0")).is_err());
        assert!(check("t", &state_json("/tmp", "gpu0", "cb-/tmp.gpu0")).is_err());
        // Unknown fields are not silently accepted.
        let extra = state_json("t", "gpu0", "cb-t.gpu0").replacen('{', r#"{"rm":"/","#, 1);
        assert!(check("t", &extra).is_err());
    }
}
