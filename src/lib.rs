//! closbox as a test fixture for other projects (and for its own live tests): bring a fabric
//! up from a topology file, run programs in its GPUs, read its counters, change its links,
//! and have it taken down when the guard is dropped.
//!
//! ```no_run
//! // As root (network namespaces), with the `closbox` binary built (see `Fabric::binary`).
//! let fabric = closbox::Fabric::up("configs/leaf-spine-16.toml")?;
//! let out = fabric.exec("gpu0", &["ping", "-c", "1", "gpu15"])?;
//! assert!(out.status.success());
//! // Every GPU runs the program as one rank (RANK, WORLD_SIZE, MASTER_ADDR, ... set).
//! let job = fabric.run(&["/usr/bin/python3", "allreduce.py"])?;
//! assert!(job.status.success());
//! let st = fabric.status()?;
//! assert_eq!(st.drops.iter().map(|(_, n)| n).sum::<u64>(), 0);
//! fabric.link_down("leaf0", "spine1")?;
//! fabric.down()?; // or let it drop: the fabric goes down either way
//! # Ok::<(), anyhow::Error>(())
//! ```
//!
//! Tests that run at once may bring one file up: without [`Options::name`], a fabric whose
//! file's name is taken comes up as `NAME-2`, `NAME-3`, … ([`Fabric::name`] says which).
//! A fabric is bound to the process that brought it up (`closbox up --owner`): it goes
//! down when its guard is dropped, and also when the process ends without dropping it (a
//! test killed by its harness's timeout).
//!
//! The guard drives the `closbox` binary for what runs processes (`up`, `exec`, `run`,
//! `mpirun`, `down`): a GPU's process must start in a fresh process inside the namespaces.
//! Status and link changes go straight to the fabric's daemon over its control socket, typed
//! (`closbox_switchd::dataplane::Status`, `closbox_switchd::chaos::ChangeRequest`).

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

use anyhow::{bail, Context};
pub use closbox_switchd::chaos::{ChangeRequest, ChaosEnd, Event, Meanwhile};
use closbox_switchd::control::{self, Reply, Request};
pub use closbox_switchd::dataplane::Status;
use closbox_switchd::state::FabricName;

/// A scenario run by [`Fabric::chaos`]: its events, how it ended, what the fabric did
/// meanwhile.
#[derive(Clone, Debug, PartialEq)]
pub struct Chaos {
    /// Its own events, oldest first (not other scenarios' or changes by hand).
    pub events: Vec<Event>,
    pub timeline: u64,
    pub end: ChaosEnd,
    /// Packets delivered, drops by reason, ECN marks, links left changed (all the
    /// fabric's traffic over the scenario's span).
    pub meanwhile: Option<Meanwhile>,
}

/// A live fabric, taken down when dropped (errors then are printed, not raised: call
/// [`Fabric::down`] to see them).
#[derive(Debug)]
pub struct Fabric {
    name: FabricName,
    binary: PathBuf,
    /// A topology written for `from_toml`, removed with the fabric.
    temp_config: Option<PathBuf>,
    up: bool,
}

/// How to bring a fabric up: [`Fabric::options`].
#[derive(Debug, Clone, Default)]
pub struct Options {
    binary: Option<PathBuf>,
    name: Option<String>,
    args: Vec<String>,
    env: Vec<(String, String)>,
}

impl Options {
    /// The `closbox` binary to drive (default: [`Fabric::binary`]).
    pub fn binary(mut self, path: impl Into<PathBuf>) -> Options {
        self.binary = Some(path.into());
        self
    }

    /// The fabric's name instead of its file's `[fabric] name` (`closbox up --name`): tests
    /// that run at once (cargo's default) can each bring the same file up under a name
    /// of their own (1 to 16 characters of a-z, 0-9 and '-', starting with a letter).
    pub fn name(mut self, name: impl Into<String>) -> Options {
        self.name = Some(name.into());
        self
    }

    /// More arguments for `closbox up` (e.g. `["--metrics", "127.0.0.1:9464"]`).
    pub fn args<I, S>(mut self, args: I) -> Options
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// An environment variable for `closbox up` and the daemon it starts (e.g.
    /// `CLOSBOX_TUN_WRITERS`, `CLOSBOX_OFFLOAD`: the data plane's knobs, README "The data
    /// plane").
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Options {
        self.env.push((key.into(), value.into()));
        self
    }

    /// Brings up the fabric of topology file `config`, bound to this process: it goes
    /// down when the guard is dropped, or when the process ends however it ends (`up
    /// --owner`; a test killed by a harness's timeout leaves no fabric behind).
    ///
    /// Without [`Options::name`], under the file's `[fabric] name`, or, where that name is
    /// up already (another test of the crate bringing the same file up at once: cargo runs
    /// tests in threads, nextest in processes), under the first of `NAME-2`, `NAME-3`, …
    /// that is free (cut to closbox's 16 characters); [`Fabric::name`] says which. With a
    /// name, a name already up is an error.
    pub fn up(mut self, config: impl AsRef<Path>) -> anyhow::Result<Fabric> {
        let config = config.as_ref();
        // `--name` and `--detach` among the arguments are what the fixture passes itself:
        // a name there is the fabric's name (it was the file's, with `--name` twice once
        // the file's was taken), a `--detach` is one already given.
        if let Some(n) = take_up_flags(&mut self.args)? {
            if self.name.as_ref().is_some_and(|m| *m != n) {
                bail!("two names for one fabric: Options::name({:?}) and --name {n:?} in Options::args", self.name.unwrap_or_default());
            }
            self.name = Some(n);
        }
        // Checked here first: a bad file is an error naming file:line, before any process.
        let topo = closbox_fabric::load(config).map_err(|e| anyhow::anyhow!("{e}"))?;
        let (first, chosen): (FabricName, bool) = match &self.name {
            Some(n) => (n.parse().map_err(anyhow::Error::msg)?, true),
            None => (
                topo.fabric
                    .name
                    .parse()
                    .map_err(|e| anyhow::anyhow!("{}: {e}", config.display()))?,
                false,
            ),
        };
        let binary = match &self.binary {
            Some(b) => b.clone(),
            None => Fabric::binary()?,
        };
        // The fabric goes down with this process, however it ends (a test killed by a
        // harness's timeout runs no `Drop`), unless the caller said otherwise.
        let owner = (!self
            .args
            .iter()
            .any(|a| a == "--owner" || a.starts_with("--owner=")))
        .then(|| ["--owner".to_owned(), std::process::id().to_string()]);
        let mut name = first.clone();
        for n in 2..=AUTO_NAMES + 1 {
            let renamed = chosen || name != first;
            let out = Command::new(&binary)
                .arg("up")
                .arg(config)
                .arg("--detach")
                .args(
                    renamed
                        .then(|| ["--name", name.as_str()])
                        .into_iter()
                        .flatten(),
                )
                .args(owner.iter().flatten())
                .args(&self.args)
                .envs(self.env.iter().map(|(k, v)| (k, v)))
                .stdin(Stdio::null())
                .output()
                .with_context(|| format!("running {}", binary.display()))?;
            if out.status.success() {
                return Ok(Fabric {
                    name,
                    binary,
                    temp_config: None,
                    up: true,
                });
            }
            let taken = out.status.code() == Some(closbox_switchd::NameTaken::EXIT.into());
            if !taken || chosen || n > AUTO_NAMES {
                bail!(
                    "closbox up {}: {}",
                    config.display(),
                    String::from_utf8_lossy(&out.stderr).trim()
                );
            }
            name = numbered(&first, n);
        }
        unreachable!("the loop returns")
    }

    /// Brings up the fabric described by `toml` (a topology file's text).
    pub fn from_toml(self, toml: &str) -> anyhow::Result<Fabric> {
        let path = std::env::temp_dir().join(format!(
            "closbox-fixture-{}-{}.toml",
            std::process::id(),
            next_id()
        ));
        std::fs::write(&path, toml).with_context(|| format!("writing {}", path.display()))?;
        let r = self.up(&path);
        match r {
            Ok(mut f) => {
                f.temp_config = Some(path);
                Ok(f)
            }
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                Err(e)
            }
        }
    }
}

/// Takes `--name NAME` / `--name=NAME` (returned; given twice, the last, as clap takes
/// it) and `--detach` out of `closbox up`'s arguments.
fn take_up_flags(args: &mut Vec<String>) -> anyhow::Result<Option<String>> {
    let mut name = None;
    let mut kept = Vec::with_capacity(args.len());
    let mut it = std::mem::take(args).into_iter();
    while let Some(a) = it.next() {
        if a == "--name" {
            match it.next() {
                Some(v) => name = Some(v),
                None => bail!("--name in Options::args without a name after it"),
            }
        } else if let Some(v) = a.strip_prefix("--name=") {
            name = Some(v.to_owned());
        } else if a == "--" {
            kept.push(a);
            kept.extend(it.by_ref());
        } else if a != "--detach" {
            kept.push(a);
        }
    }
    *args = kept;
    Ok(name)
}

/// How many names the fixture tries after a file's own is taken.
const AUTO_NAMES: usize = 64;

/// `base-n`, `base` cut so that the whole is a valid fabric name (16 characters).
fn numbered(base: &FabricName, n: usize) -> FabricName {
    let suffix = format!("-{n}");
    let keep = closbox_fabric::names::MAX_FABRIC_NAME.saturating_sub(suffix.len());
    let cut = base.as_str()[..base.as_str().len().min(keep)].trim_end_matches('-');
    format!("{cut}{suffix}")
        .parse()
        .expect("a valid name's prefix and a number")
}

fn next_id() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

impl Fabric {
    /// Brings up the fabric of topology file `config` with the default options.
    pub fn up(config: impl AsRef<Path>) -> anyhow::Result<Fabric> {
        Options::default().up(config)
    }

    /// Brings up the fabric described by `toml` with the default options.
    pub fn from_toml(toml: &str) -> anyhow::Result<Fabric> {
        Options::default().from_toml(toml)
    }

    /// Options for `up`: the binary, more `closbox up` arguments.
    pub fn options() -> Options {
        Options::default()
    }

    /// Why a fabric cannot be brought up here, if it cannot: not root, no TUN device, or
    /// no `closbox` binary ([`Fabric::binary`]). For a test that should skip itself where
    /// it cannot run (the pytest fixture skips without root):
    ///
    /// ```no_run
    /// if let Some(why) = closbox::Fabric::unavailable() {
    ///     eprintln!("skipped: {why}");
    ///     return;
    /// }
    /// ```
    pub fn unavailable() -> Option<String> {
        if !closbox_switchd::sys::is_root() {
            return Some("closbox fabrics need root (network namespaces, TUN devices)".into());
        }
        if !Path::new("/dev/net/tun").exists() {
            return Some("no /dev/net/tun: this kernel or container has no TUN device".into());
        }
        Fabric::binary().err().map(|e| format!("{e:#}"))
    }

    /// The `closbox` binary the fixture drives by default: `$CLOSBOX_BIN`; else a
    /// `closbox` in the directory of the running program or its parent (cargo puts
    /// integration tests in `target/<profile>/deps/` and binaries in `target/<profile>/`);
    /// else `closbox` on `PATH`.
    pub fn binary() -> anyhow::Result<PathBuf> {
        if let Some(b) = std::env::var_os("CLOSBOX_BIN") {
            return Ok(PathBuf::from(b));
        }
        if let Ok(exe) = std::env::current_exe() {
            for dir in exe.ancestors().skip(1).take(2) {
                let p = dir.join("closbox");
                if p.is_file() && p != exe {
                    return Ok(p);
                }
            }
        }
        if let Some(path) = std::env::var_os("PATH") {
            for dir in std::env::split_paths(&path) {
                let p = dir.join("closbox");
                if p.is_file() {
                    return Ok(p);
                }
            }
        }
        bail!("no closbox binary: set CLOSBOX_BIN, or put closbox on PATH (cargo install --path . in closbox's repository)")
    }

    /// The fabric's name: its file's `[fabric] name`, the one given to
    /// [`Options::name`], or the one the fixture chose where the file's was taken
    /// ([`Options::up`]).
    pub fn name(&self) -> &str {
        self.name.as_str()
    }

    /// `closbox <args>` for this fabric's binary.
    fn closbox<S: AsRef<OsStr>>(&self, args: &[S]) -> Command {
        let mut c = Command::new(&self.binary);
        c.args(args).stdin(Stdio::null());
        c
    }

    /// Runs `cmd` in GPU `gpu` (a name or a rank) and waits for it.
    pub fn exec(&self, gpu: &str, cmd: &[&str]) -> anyhow::Result<Output> {
        self.exec_with(&[], gpu, cmd)
    }

    /// As `exec`, with `closbox exec` options (`["--timeout", "30"]`: stopped with what it
    /// started after 30 s, exit status 124; `["--fabric-clock"]`).
    pub fn exec_with(&self, opts: &[&str], gpu: &str, cmd: &[&str]) -> anyhow::Result<Output> {
        let mut args = vec!["exec", "--fabric", self.name()];
        args.extend_from_slice(opts);
        args.extend_from_slice(&[gpu, "--"]);
        args.extend_from_slice(cmd);
        self.closbox(&args).output().context("running closbox exec")
    }

    /// Starts `cmd` in GPU `gpu` without waiting (a server, say); it ends at the latest
    /// with the fabric. Its output is discarded. To stop it earlier with what it started,
    /// send the child SIGTERM (`closbox exec` passes it on to the command's process
    /// group); `Child::kill` sends SIGKILL, after which the command gets SIGTERM but what
    /// it started runs on until the fabric goes down.
    pub fn spawn(&self, gpu: &str, cmd: &[&str]) -> anyhow::Result<Child> {
        let mut args = vec!["exec", "--fabric", self.name(), gpu, "--"];
        args.extend_from_slice(cmd);
        self.closbox(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("running closbox exec")
    }

    /// Runs `cmd` as one rank per GPU on all of them (`closbox run`), waits for all.
    pub fn run(&self, cmd: &[&str]) -> anyhow::Result<Output> {
        self.run_with(&[], cmd)
    }

    /// As `run`, with `closbox run` options (`["--gpus", "0-3", "--timeout", "60"]`).
    pub fn run_with(&self, opts: &[&str], cmd: &[&str]) -> anyhow::Result<Output> {
        let mut args = vec!["run", "--fabric", self.name()];
        args.extend_from_slice(opts);
        args.push("--");
        args.extend_from_slice(cmd);
        self.closbox(&args).output().context("running closbox run")
    }

    /// Runs an MPI program (`closbox mpirun`, options such as `["--impl", "mpich"]`).
    pub fn mpirun(&self, opts: &[&str], cmd: &[&str]) -> anyhow::Result<Output> {
        let mut args = vec!["mpirun", "--fabric", self.name()];
        args.extend_from_slice(opts);
        args.push("--");
        args.extend_from_slice(cmd);
        self.closbox(&args)
            .output()
            .context("running closbox mpirun")
    }

    /// The daemon's counters: packets, drops by reason, per-port counters, lateness.
    pub fn status(&self) -> anyhow::Result<Status> {
        match self.ask(&Request::Status { tcp: true })? {
            Reply::Status(s) => Ok(*s),
            _ => bail!("fabric {}: the daemon answered something else", self.name),
        }
    }

    /// Applies a change now (links, switches, GPUs, partitions; see `ChangeRequest`).
    pub fn change(&self, change: ChangeRequest) -> anyhow::Result<()> {
        match self.ask(&Request::Change(change))? {
            Reply::Changed { .. } => Ok(()),
            _ => bail!("fabric {}: the daemon answered something else", self.name),
        }
    }

    /// Every change since the fabric came up, oldest first (what `closbox events` lists):
    /// changes applied, and loads that started, were stopped or ended.
    pub fn events(&self) -> anyhow::Result<Vec<Event>> {
        match self.ask(&Request::Events { after: 0 })? {
            Reply::Events { events } => Ok(events),
            _ => bail!("fabric {}: the daemon answered something else", self.name),
        }
    }

    /// The daemon's reply to `req`; its refusal (`Reply::Error`) as an error naming the
    /// fabric.
    fn ask(&self, req: &Request) -> anyhow::Result<Reply> {
        match control::request(&self.name, req)? {
            Reply::Error { message } => bail!("fabric {}: {message}", self.name),
            reply => Ok(reply),
        }
    }

    /// Runs a scenario file on the fabric (`closbox chaos FILE`) and waits for its end:
    /// its last change made and the loads it started ended, or until `cancel`/`reset`
    /// from elsewhere ends it (a file with `start = "first-packet"` or `"every-gpu"` first
    /// waits for the fabric's GPUs to send: traffic from another thread or process). A bad
    /// file is an error naming its line.
    pub fn chaos(&self, scenario: impl AsRef<Path>) -> anyhow::Result<Chaos> {
        let file = scenario.as_ref();
        let out = self
            .closbox(&[
                OsStr::new("chaos"),
                file.as_os_str(),
                OsStr::new("--json"),
                OsStr::new("--fabric"),
                OsStr::new(self.name()),
            ])
            .output()
            .context("running closbox chaos")?;
        if !out.status.success() {
            bail!(
                "closbox chaos {}: {}",
                file.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let mut lines: Vec<&str> = text.lines().collect();
        let last = lines.pop().context("closbox chaos printed nothing")?;
        let run: closbox_switchd::chaos::ChaosRun = serde_json::from_str(last)
            .with_context(|| format!("closbox chaos ended with {last:?}"))?;
        let events = lines
            .into_iter()
            .map(|l| serde_json::from_str(l).with_context(|| format!("an event: {l:?}")))
            .collect::<anyhow::Result<_>>()?;
        Ok(Chaos {
            events,
            timeline: run.timeline,
            end: run.end,
            meanwhile: run.meanwhile,
        })
    }

    /// Takes every link between `a` and `b` down.
    pub fn link_down(&self, a: &str, b: &str) -> anyhow::Result<()> {
        self.change(ChangeRequest::LinkDown {
            a: a.into(),
            b: b.into(),
            index: None,
        })
    }

    /// Brings every link between `a` and `b` back up.
    pub fn link_up(&self, a: &str, b: &str) -> anyhow::Result<()> {
        self.change(ChangeRequest::LinkUp {
            a: a.into(),
            b: b.into(),
            index: None,
        })
    }

    /// Puts the fabric back as its topology made it (`closbox reset`): scenarios and flaps
    /// cancelled, loads stopped, the partition healed, every link up at the topology's
    /// values. What runs in the GPUs is left alone: a fabric shared by several tests can
    /// be reset between them.
    pub fn reset(&self) -> anyhow::Result<()> {
        self.change(ChangeRequest::Reset)
    }

    /// Takes the fabric down, and says why if it could not.
    pub fn down(mut self) -> anyhow::Result<()> {
        self.take_down()
    }

    fn take_down(&mut self) -> anyhow::Result<()> {
        if !self.up {
            return Ok(());
        }
        self.up = false;
        let out = self.closbox(&["down", self.name.as_str()]).output();
        if let Some(p) = self.temp_config.take() {
            let _ = std::fs::remove_file(p);
        }
        let out = out.context("running closbox down")?;
        if !out.status.success() {
            bail!(
                "closbox down {}: {}",
                self.name,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    }
}

impl Drop for Fabric {
    fn drop(&mut self) {
        if let Err(e) = self.take_down() {
            eprintln!("closbox fixture: {e:#}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strs(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_name_among_the_arguments_is_the_fabrics_name() {
        let mut a = strs(&[
            "--metrics",
            "127.0.0.1:9464",
            "--name",
            "lfix-a",
            "--detach",
        ]);
        assert_eq!(take_up_flags(&mut a).unwrap().as_deref(), Some("lfix-a"));
        assert_eq!(a, strs(&["--metrics", "127.0.0.1:9464"]));

        let mut a = strs(&["--name=one", "--time-scale", "auto", "--name=two"]);
        assert_eq!(take_up_flags(&mut a).unwrap().as_deref(), Some("two"));
        assert_eq!(a, strs(&["--time-scale", "auto"]));

        let mut a = strs(&["--realtime"]);
        assert_eq!(take_up_flags(&mut a).unwrap(), None);
        assert_eq!(a, strs(&["--realtime"]));

        let mut a = strs(&["--idle-poll", "--name"]);
        let e = take_up_flags(&mut a).unwrap_err().to_string();
        assert!(e.contains("without a name"), "{e}");
    }

    #[test]
    fn two_names_for_one_fabric_are_refused_before_any_process() {
        let e = Fabric::options()
            .name("lfix-a")
            .args(["--name", "lfix-b"])
            .binary("/nonexistent/closbox")
            .up("configs/leaf-spine-16.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("two names") && e.contains("lfix-b"), "{e}");
    }
}
