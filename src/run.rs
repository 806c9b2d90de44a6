//! `closbox run`: a command once per GPU, concurrently, with launcher variables; every
//! rank's output read by one thread and prefixed; a failing rank stops the others.

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use closbox_switchd::state::State;
use closbox_switchd::stop::{terminate, Targets};
use closbox_switchd::{netns, sys};

use crate::live::{exit_code, gpu_env, spawn_error};

/// Where ranks' output lines go: `(rank, is_stderr, line)`.
pub type Sink = Arc<dyn Fn(usize, bool, &str) + Send + Sync>;

/// A job: a command in every selected GPU of a resolved fabric.
pub struct RunArgs<'a> {
    pub st: &'a State,
    /// Indexes into `st.gpus`, in rank order (see `select`).
    pub sel: &'a [usize],
    pub timeout: Option<Duration>,
    /// None: `DEFAULT_MASTER_PORT`, or the first port after it free for this job
    /// (`rendezvous_port`).
    pub master_port: Option<u16>,
    pub cmd: &'a [String],
    /// Default: print with a `[rank]` prefix.
    pub sink: Option<Sink>,
    /// A chaos timeline to start with the job (its time 0 is when every rank is started)
    /// and whose rest is cancelled when the job ends.
    pub chaos: Option<&'a crate::chaos::Timeline>,
}

/// MASTER_PORT unless asked otherwise: torchrun's.
pub const DEFAULT_MASTER_PORT: u16 = 29500;
/// Ports tried after it.
const MASTER_PORTS: u16 = 100;

/// The rendezvous port of a job whose first GPU is `master`: the first from
/// `DEFAULT_MASTER_PORT` that no other `run` with the same first GPU holds (an abstract
/// Unix socket named after the fabric, that GPU and the port, held for the job's life and
/// gone with its process: no file) and that nothing in `master`'s namespace listens on. Two jobs on one GPU at
/// once otherwise share port 29500: the second's rank 0 cannot bind it, and its other
/// ranks join the first job's rendezvous.
fn rendezvous_port(
    st: &State,
    master: &closbox_switchd::state::GpuState,
) -> anyhow::Result<(u16, std::os::unix::net::UnixListener)> {
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr, UnixListener};
    let net = netns::open_gpu(st, master)?.net;
    for port in DEFAULT_MASTER_PORT..DEFAULT_MASTER_PORT + MASTER_PORTS {
        let name = format!("closbox/{}/{}/rendezvous/{port}", st.fabric, master.name);
        let addr = SocketAddr::from_abstract_name(name.as_bytes())?;
        let Ok(held) = UnixListener::bind_addr(&addr) else {
            continue;
        };
        let fd = net.try_clone()?;
        // (A thread of its own enters the namespace, and ends with the check.)
        let free = std::thread::spawn(move || -> std::io::Result<bool> {
            sys::enter_netns(std::os::fd::AsFd::as_fd(&fd))?;
            match std::net::TcpListener::bind(("0.0.0.0", port)) {
                Ok(_) => Ok(true),
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => Ok(false),
                Err(e) => Err(e),
            }
        })
        .join()
        .map_err(|_| anyhow::anyhow!("the port check in {} panicked", master.name))?
        .with_context(|| format!("checking port {port} in {}", master.name))?;
        if free {
            return Ok((port, held));
        }
    }
    bail!(
        "no rendezvous port free in {} among {DEFAULT_MASTER_PORT}–{}: name one with --master-port",
        master.name,
        DEFAULT_MASTER_PORT + MASTER_PORTS - 1
    )
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

/// How often a chaos timeline's new events are looked for (`Timeline::live`).
const FOLLOW_EVERY: Duration = Duration::from_millis(100);

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
    // Held until the job ends: another `run` of this fabric takes another port.
    let (master_port, _held) = match a.master_port {
        Some(p) => (p, None),
        None => {
            let (p, held) = rendezvous_port(st, master)?;
            if p != DEFAULT_MASTER_PORT {
                eprintln!(
                    "closbox: MASTER_PORT {p}: {DEFAULT_MASTER_PORT} is taken in {} (another job's rendezvous?); --master-port chooses",
                    master.name
                );
            }
            (p, Some(held))
        }
    };
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
    // The scenario starts just before the first rank: its changes at time 0 are in place
    // before any rank sends (a ping started with a partition at "0ms" got its first
    // reply when the timeline started after the ranks).
    if a.chaos.is_some() {
        // A program that cannot start is said before the scenario starts, not after its
        // first lines and its cancel.
        crate::mpirun::runnable(&a.cmd[0].replace("{rank}", "0"))
            .map_err(|e| fabric_hint(e, a.cmd, st))?;
    }
    // What stops the job if this process ends without doing so (SIGKILL): its ranks get
    // SIGTERM as their parent dies, but not what they started.
    let mut reaper = crate::reap::Reaper::start(&st.fabric);
    let job_token = crate::reap::job_token();
    if let Some(r) = &mut reaper {
        r.tell(&format!("job {job_token}"));
    }
    let mut timeline = a.chaos.map(|t| t.start()).transpose()?;
    if let (Some(r), Some(t)) = (&mut reaper, &timeline) {
        r.tell(&format!("timeline {}", t.id()));
    }
    let mut ranks: Vec<Rank> = Vec::new();
    let mut pipes = Vec::new();
    let started = Instant::now();
    let spawned = (|| -> anyhow::Result<()> {
        // Rank 0 reads closbox's standard input, as mpirun gives it to its rank 0 (the
        // others read nothing), through a pipe a thread fills: a rank in a session
        // of its own has no controlling terminal to read. Nothing where
        // closbox itself may not read it (in the background of a terminal).
        let mut stdin_pipe = if sys::stdin_readable_here() {
            let (r, w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
                .context("a pipe for rank 0's standard input")?;
            Some((r, std::fs::File::from(w)))
        } else {
            None
        };
        for (rank, &i) in sel.iter().enumerate() {
            let g = &st.gpus[i];
            let peers = &nodes[&g.node];
            let local = peers
                .iter()
                .position(|r| *r == rank)
                .expect("rank in its node");
            let mut enter = netns::open_gpu(st, g)?;
            enter.new_session = true;
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
                .env("MASTER_PORT", master_port.to_string())
                .env("CLOSBOX_PEERS", peer_names.join(","))
                .env("CLOSBOX_NODES", node_list.join(","))
                .env(crate::reap::JOB_ENV, &job_token)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            let (reader, writer) = stdin_pipe.take().unzip();
            command.stdin(reader.map_or_else(Stdio::null, Stdio::from));
            let mut child = match enter.spawn(&mut command) {
                Ok(c) => c,
                Err(e) => return Err(fabric_hint(spawn_error(e, &args[0]), &args, st)),
            };
            drop(command);
            if let Some(r) = &mut reaper {
                // Each rank leads a session of its own (`new_session`).
                r.tell(&format!("session {}", child.id()));
            }
            if let Some(mut writer) = writer {
                // Ends at the end of closbox's input, or when rank 0 closes its end.
                std::thread::Builder::new()
                    .name("stdin".into())
                    .spawn(move || {
                        // A rank 0 that stops reading must not end closbox (EPIPE).
                        if sys::block_sigpipe_in_this_thread().is_ok() {
                            let _ = std::io::copy(&mut std::io::stdin().lock(), &mut writer);
                        }
                    })
                    .context("a thread for rank 0's standard input")?;
            }
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
        Ok(())
    })();
    if let Err(e) = spawned {
        stop_all(&mut ranks);
        if let (Some(t), Some(started)) = (a.chaos, &mut timeline) {
            t.finish(started, "the job did not start");
        }
        return Err(e);
    }

    // One thread reads every rank's output, started once all are: a thread per pipe made
    // each later fork copy more of this process and fault more of it in on both CPUs
    // (256 ranks of `true` took 4.4 s).
    let reader = read_outputs(pipes, sink);
    let mut failure: Option<String> = None;
    // Ranks that failed on their own after the first, in the order seen.
    let mut also_failed: Vec<String> = Vec::new();
    // Once a rank failed, when the others are stopped if they have not ended by then.
    let mut grace_until: Option<Instant> = None;
    let mut stopped = false;
    let mut code = 0u8;
    let mut next_follow = Instant::now();
    let mut lost: Option<anyhow::Error> = None;
    loop {
        let mut running = 0;
        for r in ranks.iter_mut().filter(|r| r.done.is_none()) {
            let waited = r.child.try_wait();
            let waited = match waited {
                Ok(w) => w,
                Err(e) => {
                    lost = Some(
                        anyhow::Error::new(e)
                            .context(format!("waiting for rank {} ({})", r.rank, r.gpu)),
                    );
                    break;
                }
            };
            match waited {
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
        if let Some(e) = lost {
            // (Never seen: the ranks are this process's children.) Nothing is left behind.
            stop_all(&mut ranks);
            if let (Some(t), Some(started)) = (a.chaos, &mut timeline) {
                t.finish(started, "closbox lost track of the job");
            }
            return Err(e);
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
                    "timed out after {}",
                    crate::live::humantime_secs(a.timeout.expect("checked"))
                ));
                code = 124;
            }
            stop_all(&mut ranks);
            stopped = true;
            break;
        }
        if let (Some(t), Some(started)) = (a.chaos, &mut timeline) {
            if next_follow.elapsed() >= FOLLOW_EVERY {
                t.follow(started);
                next_follow = Instant::now();
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    if let (Some(t), Some(started)) = (a.chaos, &mut timeline) {
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

/// A program that cannot run, named `args[0]`: where that is the fabric's name or a
/// topology file (`closbox run FABRIC CMD`, as `status FABRIC` is written), how to say it.
fn fabric_hint(mut err: anyhow::Error, args: &[String], st: &State) -> anyhow::Error {
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
    err
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

#[cfg(test)]
mod tests {
    use std::io::Write;

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
