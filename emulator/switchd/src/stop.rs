//! Stopping processes, one way for everything closbox stops (a job's ranks, processes left
//! in a fabric's GPUs, a fabric's daemon): SIGTERM, a bounded wait for everything to
//! exit, SIGKILL to what is left, another bounded wait, and a report of what was stopped
//! and what survived.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

/// What `terminate` stops: a set that can be signalled as a whole and tells which of its
/// processes still run. Implementations decide how a process is reached (a process group,
/// a pidfd) and what "gone" means (reaped, out of a namespace, a lock released).
pub trait Targets {
    /// Sends `sig` to every process still running; returns the pids it reached.
    fn signal(&mut self, sig: libc::c_int) -> Vec<i32>;
    /// The pids still running.
    fn running(&mut self) -> Vec<i32>;
}

/// What `terminate` did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Stopped {
    /// Processes that were signalled and are gone.
    pub stopped: Vec<i32>,
    /// Processes still there after SIGKILL and the bounded wait (e.g. in uninterruptible
    /// sleep).
    pub survivors: Vec<i32>,
    /// Whether it took SIGKILL.
    pub killed: bool,
}

impl Stopped {
    /// Adds what a later round stopped (a process that survived one round and was gone by
    /// the next counts as stopped).
    pub fn add(&mut self, later: Stopped) {
        self.survivors.retain(|p| !later.stopped.contains(p));
        for p in later.stopped {
            if !self.stopped.contains(&p) {
                self.stopped.push(p);
            }
        }
        for p in later.survivors {
            if !self.survivors.contains(&p) {
                self.survivors.push(p);
            }
        }
        self.killed |= later.killed;
    }

    /// What `down` says of it: nothing, or "; stopped 2 process(es) left in its GPUs: [..]"
    /// and the survivors.
    pub fn said_for_down(&self) -> String {
        let mut msg = String::new();
        if !self.stopped.is_empty() {
            msg += &format!(
                "; stopped {} process(es) left in its GPUs: {:?}",
                self.stopped.len(),
                self.stopped
            );
        }
        if !self.survivors.is_empty() {
            msg += &format!(
                "; {} process(es) did not exit after SIGKILL: {:?}",
                self.survivors.len(),
                self.survivors
            );
        }
        msg
    }
}

/// SIGTERM to all, up to `grace` for them to exit, SIGKILL to the rest, up to `kill_wait`
/// for the kernel to let go of them.
pub fn terminate(t: &mut impl Targets, grace: Duration, kill_wait: Duration) -> Stopped {
    let mut seen: BTreeSet<i32> = t.signal(libc::SIGTERM).into_iter().collect();
    let mut left = wait_until_gone(t, grace);
    let mut killed = false;
    if !left.is_empty() {
        killed = true;
        seen.extend(t.signal(libc::SIGKILL));
        left = wait_until_gone(t, kill_wait);
    }
    Stopped {
        stopped: seen.iter().copied().filter(|p| !left.contains(p)).collect(),
        survivors: left,
        killed,
    }
}

fn wait_until_gone(t: &mut impl Targets, limit: Duration) -> Vec<i32> {
    let deadline = Instant::now() + limit;
    loop {
        let left = t.running();
        if left.is_empty() || Instant::now() >= deadline {
            return left;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Processes that exit after `needs` signals of at least `sig`.
    struct Fake {
        procs: Vec<(i32, libc::c_int)>,
        sent: Vec<libc::c_int>,
    }

    impl Targets for Fake {
        fn signal(&mut self, sig: libc::c_int) -> Vec<i32> {
            self.sent.push(sig);
            let hit = self.procs.iter().map(|p| p.0).collect();
            self.procs.retain(|&(_, needs)| needs != sig);
            hit
        }

        fn running(&mut self) -> Vec<i32> {
            self.procs.iter().map(|p| p.0).collect()
        }
    }

    #[test]
    fn term_first_kill_only_what_is_left() {
        let mut f = Fake {
            procs: vec![(1, libc::SIGTERM), (2, libc::SIGTERM)],
            sent: Vec::new(),
        };
        let s = terminate(&mut f, Duration::ZERO, Duration::ZERO);
        assert_eq!(f.sent, [libc::SIGTERM]);
        assert_eq!((s.stopped, s.killed), (vec![1, 2], false));

        let mut f = Fake {
            procs: vec![(1, libc::SIGTERM), (2, libc::SIGKILL), (3, 0)],
            sent: Vec::new(),
        };
        let s = terminate(&mut f, Duration::ZERO, Duration::ZERO);
        assert_eq!(f.sent, [libc::SIGTERM, libc::SIGKILL]);
        assert_eq!(s.stopped, vec![1, 2]);
        assert_eq!(s.survivors, vec![3]);
        assert!(s.killed);
    }

    #[test]
    fn rounds_add_up_and_a_survivor_gone_later_counts_as_stopped() {
        let mut s = Stopped {
            stopped: vec![1],
            survivors: vec![2],
            killed: true,
        };
        assert_eq!(
            s.said_for_down(),
            "; stopped 1 process(es) left in its GPUs: [1]; 1 process(es) did not exit after SIGKILL: [2]"
        );
        s.add(Stopped {
            stopped: vec![2, 1, 3],
            survivors: Vec::new(),
            killed: false,
        });
        assert_eq!(
            (&s.stopped[..], &s.survivors[..], s.killed),
            (&[1, 2, 3][..], &[][..], true)
        );
        assert_eq!(Stopped::default().said_for_down(), "");
    }
}
