//! `closbox mpirun`: an MPI program (Open MPI or MPICH) with one rank per selected GPU,
//! through the MPI's own launcher with closbox starting its remote daemons in the GPUs.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use closbox_switchd::state::{FabricName, State};

use crate::live::{enable_fabric_clock, resolve, select, spawn_error};
use crate::run::{run, RunArgs};

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
            self.name()
        )
    }

    fn name(self) -> &'static str {
        match self {
            MpiImpl::Openmpi => "Open MPI",
            MpiImpl::Mpich => "MPICH",
        }
    }

    /// As `--impl` takes it.
    fn flag(self) -> &'static str {
        match self {
            MpiImpl::Openmpi => "openmpi",
            MpiImpl::Mpich => "mpich",
        }
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
    /// `-np N`: the first N GPUs instead of `gpus`.
    pub np: Option<usize>,
    pub timeout: Option<Duration>,
    /// None: detected (`MpiImpl::detect`).
    pub implementation: Option<MpiImpl>,
    /// KEY VALUE pairs (Open MPI only).
    pub mca: &'a [String],
    pub export: &'a [String],
    pub dry_run: bool,
    /// A scenario file to run with the job (`--chaos`), and its time 0 instead of the
    /// file's (`--chaos-start`).
    pub chaos: Option<&'a std::path::Path>,
    pub chaos_start: Option<closbox_switchd::scenario::Start>,
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
    let sel = match a.np {
        None => select(&st, a.gpus)?,
        Some(n) if (1..=st.gpus.len()).contains(&n) => (0..n).collect(),
        Some(n) => bail!(
            "-np {n}: fabric {} has {} GPUs, and closbox runs one rank per GPU (1 to {})",
            st.fabric,
            st.gpus.len(),
            st.gpus.len()
        ),
    };
    // A bad scenario is a usage error before anything runs (also on a dry run).
    let timeline = a
        .chaos
        .map(|f| crate::chaos::Timeline::load(&st, f, a.chaos_start))
        .transpose()?
        .map(|mut t| {
            t.live = true;
            // (The job's GPUs: `run` starts the launcher in the first alone.)
            t.gpus = sel.iter().map(|&i| st.gpus[i].name.clone()).collect();
            t
        });
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
        if let Some((what, built)) = built_for(a.cmd).filter(|(_, b)| *b != imp) {
            eprintln!(
                "closbox: warning: {what} is built for {} but launched by {} (--impl): each rank would start alone, in a COMM_WORLD of 1; `--impl {}` launches it",
                built.name(),
                imp.name(),
                built.flag()
            );
        }
    }
    if let Some(p) = &pins {
        // The launcher starts the first rank itself; it and its rank run on that CPU.
        closbox_switchd::sys::pin_to_cpu(p[0]).context("pinning the launcher")?;
    }
    let _sessions = match imp {
        MpiImpl::Openmpi => Some(MpiJobDir::create()?),
        MpiImpl::Mpich => None,
    };
    let mut job = crate::jobs::Job::begin(&st, &sel, "mpirun");
    let code = run(RunArgs {
        st: &st,
        sel: &sel[..1],
        timeout: a.timeout,
        master_port: Some(crate::run::DEFAULT_MASTER_PORT),
        cmd: &line,
        sink: Some(Arc::new(|_, is_err, line: &str| {
            if is_err {
                eprintln!("{line}");
            } else {
                println!("{line}");
            }
        })),
        chaos: timeline.as_ref(),
    })?;
    crate::jobs::say_shared(&st, &mut job);
    Ok(code)
}

/// Whether `program` (a path, or a name looked up on PATH) can be started: 127 "command
/// not found", 126 "cannot run" as shells say them, else nothing.
pub fn runnable(program: &str) -> anyhow::Result<()> {
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

/// Which MPI a command is linked with, and what says so: the program's own dynamic
/// libraries (`libmpich.so.N` or `libmpi.so.12`: MPICH; other `libmpi.so.N`: Open MPI),
/// or for a Python program that uses mpi4py, mpi4py's. None when it does not say (static,
/// or no MPI at all).
fn built_for(cmd: &[String]) -> Option<(String, MpiImpl)> {
    let program = cmd.first()?;
    let path = if program.contains('/') {
        std::path::PathBuf::from(program)
    } else {
        which(program)?
    };
    if let Some(imp) = linked_mpi(&path) {
        return Some((path.display().to_string(), imp));
    }
    let name = path.file_name()?.to_str()?;
    if !name.starts_with("python") {
        return None;
    }
    // `-m mpi4py…`, or a script (its first argument that is a readable file) naming it.
    let uses = cmd[1..].iter().any(|a| a.contains("mpi4py"))
        || cmd[1..]
            .iter()
            .find(|a| !a.starts_with('-'))
            .and_then(|s| read_prefix(std::path::Path::new(s), 1 << 20))
            .is_some_and(|text| contains(&text, b"mpi4py"));
    if !uses {
        return None;
    }
    let out = std::process::Command::new(&path)
        .args([
            "-c",
            "import importlib.util as u; s = u.find_spec('mpi4py.MPI'); print(s.origin if s else '')",
        ])
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output()
        .ok()?;
    let module = String::from_utf8(out.stdout).ok()?;
    let module = module.trim();
    (!module.is_empty())
        .then(|| linked_mpi(std::path::Path::new(module)))
        .flatten()
        .map(|imp| (format!("{program}'s mpi4py ({module})"), imp))
}

/// The MPI whose library an ELF file names (in its dynamic string table).
fn linked_mpi(path: &std::path::Path) -> Option<MpiImpl> {
    let bytes = read_prefix(path, 64 << 20)?;
    if !bytes.starts_with(b"\x7fELF") {
        return None;
    }
    // (MPICH's library is also installed as `libmpi.so.12` by some distributions; Open
    // MPI's have been `.1`, `.20`, `.40`.)
    if contains(&bytes, b"libmpich.so") || contains(&bytes, b"libmpi.so.12\0") {
        Some(MpiImpl::Mpich)
    } else if contains(&bytes, b"libmpi.so.") {
        Some(MpiImpl::Openmpi)
    } else {
        None
    }
}

/// At most `limit` bytes of a regular file's beginning.
fn read_prefix(path: &std::path::Path, limit: u64) -> Option<Vec<u8>> {
    use std::io::Read;
    // (Not opened unless a regular file: opening a FIFO would wait for a writer.)
    if !fs::metadata(path).ok()?.is_file() {
        return None;
    }
    let f = fs::File::open(path).ok()?;
    let mut bytes = Vec::new();
    f.take(limit).read_to_end(&mut bytes).ok()?;
    Some(bytes)
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
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

    #[test]
    fn a_program_says_which_mpi_it_is_linked_with() {
        let dir = std::env::temp_dir().join(format!("closbox-mpi-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let file = |name: &str, bytes: &[u8]| {
            let p = dir.join(name);
            fs::write(&p, bytes).unwrap();
            p
        };
        // Names in an ELF's dynamic string table.
        let ompi = file("ompi", b"\x7fELF\x02\x01\x01\0libc.so.6\0libmpi.so.40\0");
        let mpich = file("mpich", b"\x7fELF\x02\x01\x01\0libmpich.so.12\0libc.so.6\0");
        let mpich_as_libmpi = file("mpich12", b"\x7fELF\x02\x01\x01\0libmpi.so.12\0");
        let neither = file("plain", b"\x7fELF\x02\x01\x01\0libc.so.6\0");
        let script = file("script.sh", b"#!/bin/sh\n# libmpi.so.40\n");
        assert_eq!(linked_mpi(&ompi), Some(MpiImpl::Openmpi));
        assert_eq!(linked_mpi(&mpich), Some(MpiImpl::Mpich));
        assert_eq!(linked_mpi(&mpich_as_libmpi), Some(MpiImpl::Mpich));
        assert_eq!(linked_mpi(&neither), None);
        assert_eq!(linked_mpi(&script), None, "not an ELF file");
        assert_eq!(linked_mpi(&dir.join("missing")), None);
        assert_eq!(linked_mpi(&dir), None, "a directory");
        let cmd = |p: &std::path::Path| vec![p.display().to_string(), "-x".into()];
        assert_eq!(
            built_for(&cmd(&ompi)),
            Some((ompi.display().to_string(), MpiImpl::Openmpi))
        );
        assert_eq!(built_for(&cmd(&neither)), None);
        fs::remove_dir_all(&dir).unwrap();
    }
}
