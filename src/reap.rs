//! What stops a job when the command that ran it ends without doing so: killed by SIGKILL
//! (a harness's timeout), nothing in it runs. A `run` (`mpirun`, `bench`, `train`) leaves
//! its ranks' sessions in the GPUs and its scenario; a foreground `chaos` its scenario.

use std::process::{Child, Command, ExitCode, Stdio};
use std::time::Duration;

use anyhow::bail;
use closbox_switchd::state::{FabricName, State};

/// The environment variable that marks a job's processes: every rank gets a token of
/// its job's, and what the ranks start inherits it, also in sessions of their own (where
/// the reaper's sessions do not reach) and through `closbox exec` in other GPUs.
pub(crate) const JOB_ENV: &str = "CLOSBOX_JOB";

/// A token for this process's job: its pid and the time, unique on the box.
pub(crate) fn job_token() -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    format!("{}.{}", std::process::id(), now.as_nanos())
}

/// The closbox command this process runs (`run`, `mpirun`, `chaos`, …), for what the
/// reaper says.
fn command_name() -> String {
    std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .unwrap_or_else(|| "closbox".into())
}

/// A `closbox reap` process that stops the job's ranks, what they started, and the rest
/// of its scenario if this process ends without saying `end` (killed: a harness's
/// SIGKILL). It reads what it is to stop on its standard input, so it sees this process
/// end however it ends (the pipe's other end closes), in a process group of its own so
/// that a Ctrl-C for the job does not end it first.
pub(crate) struct Reaper {
    child: Child,
    tell: Option<std::process::ChildStdin>,
}

impl Reaper {
    /// Best effort: a job runs as before without one (said in the debug log).
    pub(crate) fn start(fabric: &FabricName) -> Option<Reaper> {
        use std::os::unix::process::CommandExt;
        let started = std::env::current_exe().and_then(|exe| {
            Command::new(exe)
                .args(["reap", "--fabric", fabric.as_str(), "--job"])
                .arg(std::process::id().to_string())
                .arg("--command")
                .arg(command_name())
                .stdin(Stdio::piped())
                .stdout(Stdio::null())
                .process_group(0)
                .spawn()
        });
        match started {
            Ok(mut child) => Some(Reaper {
                tell: child.stdin.take(),
                child,
            }),
            Err(e) => {
                tracing::debug!("no reaper for the job: {e}");
                None
            }
        }
    }

    pub(crate) fn tell(&mut self, line: &str) {
        use std::io::Write;
        if let Some(w) = &mut self.tell {
            if writeln!(w, "{line}").is_err() {
                self.tell = None;
            }
        }
    }
}

impl Drop for Reaper {
    /// The job ended here: the reaper ends without doing anything.
    fn drop(&mut self) {
        self.tell("end");
        self.tell = None;
        let _ = self.child.wait();
    }
}

/// `closbox reap` (started by `run` and `chaos`, see `Reaper`): reads `session SID`, `job
/// TOKEN`, `timeline ID` and `end` lines; at the end of its input without `end`, cancels
/// the timelines and stops the job's processes in the fabric's GPUs: those of the ranks'
/// sessions (the ranks, what they started there, and what they started in other GPUs
/// through `closbox exec`: a launcher's remote daemons) and those started with the job's
/// token in their environment (what left its session: daemons, torchrun's workers).
pub fn reap(fabric: &FabricName, job: u32, command: &str) -> anyhow::Result<ExitCode> {
    use std::io::{BufRead, Write};
    let mut job_marks = closbox_switchd::state::JobMarks::default();
    let mut timelines = Vec::new();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        match line.split_once(' ') {
            _ if line == "end" => return Ok(ExitCode::SUCCESS),
            Some(("session", g)) => job_marks
                .sessions
                .extend(g.parse::<i32>().ok().filter(|g| *g > 1)),
            Some(("job", token)) if !token.is_empty() => {
                job_marks.env = Some(format!("{JOB_ENV}={token}").into_bytes());
            }
            Some(("timeline", t)) => timelines.extend(t.parse::<u64>().ok()),
            _ => bail!(
                "closbox reap: {line:?} is not `session SID`, `job TOKEN`, `timeline ID` or `end`"
            ),
        }
    }
    let mut said = Vec::new();
    for id in timelines {
        let req = closbox_switchd::control::Request::Cancel { timeline: Some(id) };
        if let Ok(closbox_switchd::control::Reply::Cancelled { .. }) =
            closbox_switchd::control::request(fabric, &req)
        {
            said.push(format!(
                "cancelled the rest of its scenario (timeline {id})"
            ));
        }
    }
    if let Some(st) = State::load(fabric).ok().flatten() {
        let stopped =
            closbox_switchd::state::kill_job_in_gpus(&st, job_marks, Duration::from_secs(3));
        if !stopped.stopped.is_empty() {
            said.push(format!(
                "stopped {} process(es) its ranks left in the GPUs: {:?}",
                stopped.stopped.len(),
                stopped.stopped
            ));
        }
        if !stopped.survivors.is_empty() {
            said.push(format!(
                "{} process(es) did not exit after SIGKILL: {:?}",
                stopped.survivors.len(),
                stopped.survivors
            ));
        }
    }
    if !said.is_empty() {
        // Its standard error may be a pipe nobody reads any more.
        let _ = writeln!(
            std::io::stderr(),
            "closbox: `closbox {command}` (pid {job}) ended on fabric {fabric} without stopping what it started: {}",
            said.join("; ")
        );
    }
    Ok(ExitCode::SUCCESS)
}
