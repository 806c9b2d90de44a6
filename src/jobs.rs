//! Jobs that share a fabric. Each `run`, `mpirun`, `bench` and `train` makes itself known
//! to the other jobs on its fabric while it runs, so that what a job reports about the
//! fabric (packet counts, lateness, predictions that assume it alone on the fabric and the
//! box's CPUs) can say when another job's traffic was there too, and `status` can list
//! the jobs running.
//!
//! A job listens on an abstract Unix socket named `closbox/<fabric>/job/<pid>.<n>/<kind>/<gpus>`
//! (no file: the name goes with the process however it ends). At its start it finds the
//! jobs already there in `/proc/net/unix` and connects to each, writing its own name; at
//! its end it takes those connections. So it knows every job whose run overlapped its own:
//! those there when it started and those that started after it, also one that started and
//! ended within it. Best effort: a job that cannot register (no `/proc`, a name in use)
//! runs as before, said in the debug log.

use std::io::Read;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use closbox_switchd::state::State;

/// Longest abstract socket name (`sun_path` less the leading NUL).
const MAX_NAME: usize = 107;

/// How long a look at the jobs that connected waits, in all, for names not there yet:
/// each is written right after its connection, so only a job stopped between the two
/// (or a local process that connects and writes nothing) makes it wait.
const NAME_WAIT: Duration = Duration::from_millis(100);
/// Connections a look takes at most (a listener's backlog is 4,096 here).
const MAX_TOLD: usize = 4096;

/// A job running on a fabric (as another job or `status` sees it).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct JobInfo {
    pub kind: String,
    pub pid: u32,
    /// Its GPUs as `--gpus` takes them ("all", "0-3,6"), "…" at the end if cut.
    pub gpus: String,
}

impl std::fmt::Display for JobInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (pid {}, GPUs {})", self.kind, self.pid, self.gpus)
    }
}

/// This process's job while it runs; dropped, it is gone from the fabric.
pub struct Job {
    listener: Option<UnixListener>,
    /// Its own name, to tell it from the others.
    name: String,
    /// The other jobs seen so far: there when it began, or told since.
    seen: Vec<(String, JobInfo)>,
}

/// The prefix of every job socket's name of fabric `fabric`.
fn prefix(fabric: &str) -> String {
    format!("closbox/{fabric}/job/")
}

/// GPU indices as `--gpus` takes them: "all" for every GPU in order, else ranges of
/// indices ("0-3,6"), cut to `room` characters with "…" at the end.
pub fn describe(count: usize, sel: &[usize], room: usize) -> String {
    if sel.len() == count && sel.iter().enumerate().all(|(i, &g)| i == g) {
        return "all".into();
    }
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < sel.len() {
        let mut j = i;
        while j + 1 < sel.len() && sel[j + 1] == sel[j] + 1 {
            j += 1;
        }
        parts.push(if j > i {
            format!("{}-{}", sel[i], sel[j])
        } else {
            sel[i].to_string()
        });
        i = j + 1;
    }
    let all = parts.join(",");
    if all.chars().count() <= room {
        return all;
    }
    // Whole parts that fit with the mark.
    let mut out = String::new();
    for p in parts {
        let extra = if out.is_empty() { 0 } else { 1 };
        if out.chars().count() + extra + p.chars().count() + 1 > room {
            break;
        }
        if !out.is_empty() {
            out.push(',');
        }
        out.push_str(&p);
    }
    out.push('…');
    out
}

/// A job socket's name (after the fabric's prefix) read back: `<pid>.<n>/<kind>/<gpus>`.
fn parse(rest: &str) -> Option<JobInfo> {
    let mut it = rest.splitn(3, '/');
    let id = it.next()?;
    let kind = it.next()?;
    let gpus = it.next()?;
    let pid = id.split('.').next()?.parse().ok()?;
    // What closbox writes, nothing else (any local process may bind such a name, and it
    // is printed): a kind in lowercase letters, GPUs as `describe` gives them.
    let digits = gpus.strip_suffix('…').unwrap_or(gpus);
    let gpus_ok = gpus == "all"
        || (!digits.is_empty()
            && digits
                .bytes()
                .all(|b| b.is_ascii_digit() || b == b',' || b == b'-'))
        || gpus == "…";
    let kind_ok =
        !kind.is_empty() && kind.len() <= 16 && kind.bytes().all(|b| b.is_ascii_lowercase());
    (kind_ok && gpus_ok).then(|| JobInfo {
        kind: kind.into(),
        pid,
        gpus: gpus.into(),
    })
}

/// The job sockets listening in `table` (`/proc/net/unix`'s text) of fabric `fabric`:
/// (full name, job), each once.
fn listening(table: &str, fabric: &str) -> Vec<(String, JobInfo)> {
    let prefix = prefix(fabric);
    let mut out: Vec<(String, JobInfo)> = Vec::new();
    for line in table.lines().skip(1) {
        // "Num: RefCount Protocol Flags Type St Inode Path"; abstract paths start with
        // '@'. Listening sockets have __SO_ACCEPTCON (0x10000) in their flags (accepted
        // connections show their listener's path too).
        let mut fields = line.split_whitespace();
        let Some(flags) = fields.nth(3) else { continue };
        if u32::from_str_radix(flags, 16).map_or(true, |f| f & 0x1_0000 == 0) {
            continue;
        }
        let Some(at) = line.find(" @") else { continue };
        let name = &line[at + 2..];
        let Some(rest) = name.strip_prefix(&prefix) else {
            continue;
        };
        if let Some(job) = parse(rest) {
            if !out.iter().any(|(n, _)| n == name) {
                out.push((name.to_owned(), job));
            }
        }
    }
    out
}

/// The jobs running on fabric `fabric` (empty if `/proc/net/unix` cannot be read).
pub fn running(fabric: &str) -> Vec<JobInfo> {
    let table = std::fs::read_to_string("/proc/net/unix").unwrap_or_default();
    listening(&table, fabric)
        .into_iter()
        .map(|(_, j)| j)
        .collect()
}

impl Job {
    /// Registers a job of `kind` ("run", "bench", …) on the GPUs `sel` of fabric `st`.
    pub fn begin(st: &State, sel: &[usize], kind: &str) -> Job {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let id = format!(
            "{}.{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let head = format!("{}{id}/{kind}/", prefix(st.fabric.as_str()));
        let room = MAX_NAME.saturating_sub(head.len()).max(1);
        // ("…" is 3 bytes: the room is counted in characters, the name in bytes.)
        let name = format!(
            "{head}{}",
            describe(st.gpus.len(), sel, room.saturating_sub(2))
        );
        let before: Vec<(String, JobInfo)> = listening(
            &std::fs::read_to_string("/proc/net/unix").unwrap_or_default(),
            st.fabric.as_str(),
        )
        .into_iter()
        .filter(|(n, _)| *n != name)
        .collect();
        let listener = SocketAddr::from_abstract_name(name.as_bytes())
            .and_then(|a| UnixListener::bind_addr(&a))
            .and_then(|l| l.set_nonblocking(true).map(|()| l));
        let listener = match listener {
            Ok(l) => Some(l),
            Err(e) => {
                tracing::debug!("job {name}: not made known to the fabric's other jobs: {e}");
                None
            }
        };
        if listener.is_some() {
            for (other, _) in &before {
                announce(other, &name);
            }
        }
        Job {
            listener,
            name,
            seen: before,
        }
    }

    /// Every other job whose run overlapped this one's so far: those there when it began
    /// and those that began since.
    pub fn others(&mut self) -> Vec<JobInfo> {
        if let Some(l) = self.listener.take() {
            self.take_told(&l);
            self.listener = Some(l);
        }
        self.seen.iter().map(|(_, j)| j.clone()).collect()
    }

    /// The names of the jobs that connected since the last look: read as they are (each
    /// is written right after its connection), then, for connections without one yet,
    /// waited for up to `NAME_WAIT` in all.
    fn take_told(&mut self, l: &UnixListener) {
        let mut waiting = Vec::new();
        for _ in 0..MAX_TOLD {
            let Ok((s, _)) = l.accept() else {
                break;
            };
            let mut buf = Vec::new();
            // (Accepted sockets block: nothing there yet is an error, `WouldBlock`.)
            let _ = s.set_nonblocking(true);
            let _ = (&s).take(MAX_NAME as u64 + 1).read_to_end(&mut buf);
            if !self.told(&buf) {
                waiting.push((s, buf));
            }
        }
        let until = std::time::Instant::now() + NAME_WAIT;
        for (s, mut buf) in waiting {
            let left = until.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                break;
            }
            let _ = s.set_nonblocking(false);
            let _ = s.set_read_timeout(Some(left));
            let room = (MAX_NAME + 1).saturating_sub(buf.len()) as u64;
            let _ = (&s).take(room).read_to_end(&mut buf);
            self.told(&buf);
        }
    }

    /// Takes a connection's bytes as a job's name: whether they were one.
    fn told(&mut self, bytes: &[u8]) -> bool {
        let Ok(name) = std::str::from_utf8(bytes) else {
            return false;
        };
        let Some(job) = name.strip_prefix(&prefix_of(&self.name)).and_then(parse) else {
            return false;
        };
        if name != self.name && !self.seen.iter().any(|(n, _)| n == name) {
            self.seen.push((name.to_owned(), job));
        }
        true
    }
}

/// The fabric prefix of a job socket's name (`closbox/<fabric>/job/`).
fn prefix_of(name: &str) -> String {
    let fabric = name
        .strip_prefix("closbox/")
        .and_then(|r| r.split('/').next())
        .unwrap_or("");
    prefix(fabric)
}

/// Tells the job listening on `other` that job `me` began: a connection that carries the
/// name, left in its queue until it ends. Never blocks (a full queue: it is not told).
fn announce(other: &str, me: &str) {
    use rustix::net::{connect, socket_with, AddressFamily, SocketAddrUnix, SocketFlags};
    let sent = (|| -> rustix::io::Result<()> {
        let fd = socket_with(
            AddressFamily::UNIX,
            rustix::net::SocketType::STREAM,
            SocketFlags::NONBLOCK | SocketFlags::CLOEXEC,
            None,
        )?;
        connect(&fd, &SocketAddrUnix::new_abstract_name(other.as_bytes())?)?;
        let mut rest = me.as_bytes();
        while !rest.is_empty() {
            let n = rustix::io::write(&fd, rest)?;
            rest = &rest[n..];
        }
        Ok(())
    })();
    if let Err(e) = sent {
        tracing::debug!("job {me}: telling {other}: {e}");
    }
}

/// Says on stderr which other jobs ran on the fabric during `job` (a `run` or `mpirun`
/// that has ended), if any.
pub fn say_shared(st: &State, job: &mut Job) {
    if let Some(line) = shared_with(st.fabric.as_str(), &job.others()) {
        eprintln!("closbox: {line}: its traffic shared the fabric and the box's CPUs");
    }
}

/// Jobs as one line ("run (pid 4242, GPUs 0-3); bench (pid 4250, GPUs all)").
pub fn list(jobs: &[JobInfo]) -> String {
    let each: Vec<String> = jobs.iter().map(ToString::to_string).collect();
    each.join("; ")
}

/// One line naming the other jobs (`others`), for a job's report.
pub fn shared_with(fabric: &str, others: &[JobInfo]) -> Option<String> {
    if others.is_empty() {
        return None;
    }
    Some(format!(
        "{} on fabric {fabric} ran during this one: {}",
        if others.len() == 1 {
            "another job".to_owned()
        } else {
            format!("{} other jobs", others.len())
        },
        list(others)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_selections_are_described_as_gpus_takes_them_and_cut_whole() {
        assert_eq!(describe(8, &[0, 1, 2, 3, 4, 5, 6, 7], 40), "all");
        assert_eq!(describe(8, &[0, 1, 2, 3], 40), "0-3");
        assert_eq!(describe(8, &[4, 5, 6, 7, 0], 40), "4-7,0");
        assert_eq!(describe(16, &[0, 2, 3, 9], 40), "0,2-3,9");
        // Every GPU but not in order: not "all".
        assert_eq!(describe(3, &[2, 1, 0], 40), "2,1,0");
        assert_eq!(describe(100, &[0, 10, 20, 30, 40], 9), "0,10,20…");
        assert_eq!(describe(100, &[12345], 3), "…");
    }

    #[test]
    fn names_told_are_taken_and_a_silent_connection_hides_none() {
        let pid = std::process::id();
        let fabric = format!("jt{pid}");
        let name = format!("closbox/{fabric}/job/{pid}.0/run/all");
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let l = UnixListener::bind_addr(&addr).unwrap();
        l.set_nonblocking(true).unwrap();
        let mut job = Job {
            listener: Some(l),
            name: name.clone(),
            seen: Vec::new(),
        };
        // Connected, nothing written (a job stopped at once, or another local process).
        let silent = std::os::unix::net::UnixStream::connect_addr(&addr).unwrap();
        announce(&name, &format!("closbox/{fabric}/job/1.0/bench/0-3"));
        announce(&name, &format!("closbox/{fabric}/job/2.0/run/\x1b[2J"));
        announce(&name, "closbox/other/job/3.0/run/all");
        announce(&name, &name);
        announce(&name, &format!("closbox/{fabric}/job/4.0/train/all"));
        announce(&name, &format!("closbox/{fabric}/job/1.0/bench/0-3"));
        let told: Vec<String> = job.others().iter().map(ToString::to_string).collect();
        assert_eq!(told, ["bench (pid 1, GPUs 0-3)", "train (pid 4, GPUs all)"]);
        drop(silent);
        // Taken once: a second look adds nothing new.
        assert_eq!(job.others().len(), 2);
    }

    #[test]
    fn listening_job_sockets_of_one_fabric_are_read_from_proc_net_unix() {
        let table = "\
Num       RefCount Protocol Flags    Type St Inode Path
0000000000000000: 00000002 00000000 00010000 0001 01 2179510 /run/closbox/fabrics/ls16/control.sock
0000000000000000: 00000002 00000000 00010000 0001 01 2179511 @closbox/ls16/job/4242.0/bench/4-7
0000000000000000: 00000003 00000000 00000000 0001 03 2179512 @closbox/ls16/job/4242.0/bench/4-7
0000000000000000: 00000002 00000000 00010000 0001 01 2179513 @closbox/ls16/job/4250.1/run/all
0000000000000000: 00000002 00000000 00010000 0001 01 2179514 @closbox/ls1/job/4260.0/run/all
0000000000000000: 00000002 00000000 00010000 0001 01 2179515 @closbox/ls16/job/x/run/all
0000000000000000: 00000002 00000000 00010000 0001 01 2179516 @closbox/ls16/gpu0/rendezvous/29500
0000000000000000: 00000002 00000000 00010000 0001 01 2179517 @closbox/ls16/job/4270.0/run/\x1b[2J
0000000000000000: 00000002 00000000 00010000 0001 01 2179518 @closbox/ls16/job/4271.0/Run!/0-3
";
        let jobs: Vec<String> = listening(table, "ls16")
            .into_iter()
            .map(|(_, j)| j.to_string())
            .collect();
        assert_eq!(
            jobs,
            ["bench (pid 4242, GPUs 4-7)", "run (pid 4250, GPUs all)"]
        );
    }
}
