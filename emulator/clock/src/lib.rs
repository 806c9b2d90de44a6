//! closbox's fabric clock: loaded with `LD_PRELOAD` into an unmodified program (by `closbox
//! run|exec|mpirun --fabric-clock`), it makes the program's clocks run `k` times slower than
//! the box's, so that a program timing itself on a fabric dilated by `time_scale = k` reads
//! fabric time.
//!
//! What it changes, given `CLOSBOX_CLOCK="K MONO_NS REAL_NS"` (the dilation and the anchor:
//! `CLOCK_MONOTONIC` and `CLOCK_REALTIME` at one instant, shared by every process of a job
//! so that their clocks agree):
//! - **Clock reads**: `clock_gettime` (the realtime, monotonic and boot-time clocks, not the
//!   CPU-time ones), `gettimeofday`, `time`, `timespec_get` return
//!   `anchor + (now - anchor) / K`.
//! - **Deadline waits** end at their deadline in fabric time: a deadline read from the
//!   dilated clock is converted back to the box's clock (`pthread_cond_timedwait` and
//!   `_clockwait`, `sem_timedwait` and `_clockwait`, `pthread_mutex_timedlock` and
//!   `_clocklock`, `pthread_rwlock_timed*lock` and `_clock*lock`). So a library's timeout
//!   ("wait 30 s for the peer") lasts 30 s of fabric time.
//! - **Sleeps and relative timeouts stay in wall time**: `nanosleep`, `usleep`, `sleep`,
//!   `clock_nanosleep` (an absolute one keeps its remaining length as wall time), `poll`,
//!   `epoll_wait`, `select`, socket timeouts. Rendezvous loops (torch's store, MPI's wire-up)
//!   back off with sleeps of milliseconds to seconds: dilated k = 4000 times they would take
//!   hours. A program that loops "until the clock passes a deadline" still ends in fabric
//!   time, since it re-reads the (dilated) clock.
//!
//! Not covered: programs that read clocks without libc (Go binaries, raw `syscall`), timers
//! (`timerfd`, `timer_settime`, `alarm`, `setitimer`) and the kernel's own (TCP
//! retransmission and keep-alive timers run in wall time).
//!
//! Without `CLOSBOX_CLOCK` (or with K = 1) every call passes through unchanged.
#![allow(unsafe_code)]

use std::ffi::{c_int, c_void, CStr};
use std::sync::OnceLock;

use libc::{clockid_t, time_t, timespec, timeval};

const NS: i128 = 1_000_000_000;

/// C11's `TIME_UTC` (glibc's value).
const TIME_UTC: c_int = 1;

/// The highest clock id handled (CLOCK_TAI = 11).
const CLOCKS: usize = 12;

/// The dilation of this process's clocks.
#[derive(Debug)]
struct Dilation {
    k: f64,
    /// Per clock id: the clock's value at the anchor instant (ns), or None for clocks left
    /// alone (CPU time).
    base: [Option<i128>; CLOCKS],
}

/// Parses `CLOSBOX_CLOCK`'s value: "K MONO_NS REAL_NS".
fn parse(v: &str) -> Option<(f64, i128, i128)> {
    let mut it = v.split_whitespace();
    let k: f64 = it.next()?.parse().ok()?;
    let mono: i128 = it.next()?.parse().ok()?;
    let real: i128 = it.next()?.parse().ok()?;
    if it.next().is_some() || !(k.is_finite() && k >= 1.0) {
        return None;
    }
    Some((k, mono, real))
}

/// Which clocks are dilated, and from which anchor: the realtime family from the realtime
/// anchor, the monotonic family from the monotonic one.
fn family(clock: clockid_t) -> Option<bool> {
    match clock {
        libc::CLOCK_REALTIME
        | libc::CLOCK_REALTIME_COARSE
        | libc::CLOCK_REALTIME_ALARM
        | libc::CLOCK_TAI => Some(true),
        libc::CLOCK_MONOTONIC
        | libc::CLOCK_MONOTONIC_RAW
        | libc::CLOCK_MONOTONIC_COARSE
        | libc::CLOCK_BOOTTIME
        | libc::CLOCK_BOOTTIME_ALARM => Some(false),
        _ => None,
    }
}

fn to_ns(ts: &timespec) -> i128 {
    ts.tv_sec as i128 * NS + ts.tv_nsec as i128
}

fn from_ns(ns: i128) -> timespec {
    let ns = ns.max(0);
    timespec {
        tv_sec: (ns / NS) as time_t,
        tv_nsec: (ns % NS) as _,
    }
}

impl Dilation {
    /// The fabric-time reading of `clock` whose box reading is `ns`.
    fn dilate(&self, clock: clockid_t, ns: i128) -> i128 {
        match self.base.get(clock as usize).copied().flatten() {
            Some(b) => b + ((ns - b) as f64 / self.k) as i128,
            None => ns,
        }
    }

    /// The box-clock deadline at which `clock` reads `deadline` in fabric time, given the
    /// box's reading `now` of that clock.
    fn undilate_deadline(&self, clock: clockid_t, deadline: i128, now: i128) -> i128 {
        if self.base.get(clock as usize).copied().flatten().is_none() {
            return deadline;
        }
        let left = deadline - self.dilate(clock, now);
        if left <= 0 {
            return now;
        }
        now.saturating_add((left as f64 * self.k).min(1e30) as i128)
    }
}

type ClockGettime = unsafe extern "C" fn(clockid_t, *mut timespec) -> c_int;

/// The next definition of `name` (libc's), looked up once.
macro_rules! real {
    ($name:literal, $ty:ty) => {{
        static F: OnceLock<usize> = OnceLock::new();
        let p = *F.get_or_init(|| {
            let sym = CStr::from_bytes_with_nul(concat!($name, "\0").as_bytes()).unwrap();
            // SAFETY: dlsym with a NUL-terminated name; RTLD_NEXT finds libc's definition.
            unsafe { libc::dlsym(libc::RTLD_NEXT, sym.as_ptr()) as usize }
        });
        assert!(p != 0, concat!("closbox-clock: no ", $name, " in libc"));
        // SAFETY: the symbol is libc's function of that name, whose C type is `$ty`.
        unsafe { std::mem::transmute::<usize, $ty>(p) }
    }};
}

fn real_now(clock: clockid_t) -> i128 {
    let f = real!("clock_gettime", ClockGettime);
    let mut ts = timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: libc's clock_gettime writing into a timespec we own.
    unsafe { f(clock, &mut ts) };
    to_ns(&ts)
}

/// This process's dilation, read once from the environment.
fn dilation() -> Option<&'static Dilation> {
    static D: OnceLock<Option<Dilation>> = OnceLock::new();
    D.get_or_init(|| {
        let (k, mono0, real0) = parse(&std::env::var("CLOSBOX_CLOCK").ok()?)?;
        if k == 1.0 {
            return None;
        }
        // Each clock's base: its family's anchor, shifted by how far that clock is from
        // its family's reference clock now (boot time vs monotonic, TAI vs UTC).
        let (mono_now, real_now_) = (
            real_now(libc::CLOCK_MONOTONIC),
            real_now(libc::CLOCK_REALTIME),
        );
        let mut base = [None; CLOCKS];
        for (c, b) in base.iter_mut().enumerate() {
            if let Some(realtime) = family(c as clockid_t) {
                let now = real_now(c as clockid_t);
                *b = Some(if realtime {
                    real0 + (now - real_now_)
                } else {
                    mono0 + (now - mono_now)
                });
            }
        }
        Some(Dilation { k, base })
    })
    .as_ref()
}

/// # Safety
/// As libc's `clock_gettime`.
#[no_mangle]
pub unsafe extern "C" fn clock_gettime(clock: clockid_t, ts: *mut timespec) -> c_int {
    let f = real!("clock_gettime", ClockGettime);
    // SAFETY: the caller's arguments, passed on.
    let r = unsafe { f(clock, ts) };
    if r == 0 && !ts.is_null() {
        if let Some(d) = dilation() {
            // SAFETY: libc just filled *ts.
            unsafe { *ts = from_ns(d.dilate(clock, to_ns(&*ts))) };
        }
    }
    r
}

/// # Safety
/// As libc's `gettimeofday`.
#[no_mangle]
pub unsafe extern "C" fn gettimeofday(tv: *mut timeval, tz: *mut c_void) -> c_int {
    type F = unsafe extern "C" fn(*mut timeval, *mut c_void) -> c_int;
    let f = real!("gettimeofday", F);
    // SAFETY: the caller's arguments, passed on.
    let r = unsafe { f(tv, tz) };
    if r == 0 && !tv.is_null() {
        if let Some(d) = dilation() {
            // SAFETY: libc just filled *tv.
            let t = unsafe { &mut *tv };
            let ns = d.dilate(
                libc::CLOCK_REALTIME,
                t.tv_sec as i128 * NS + t.tv_usec as i128 * 1000,
            );
            t.tv_sec = (ns / NS) as time_t;
            t.tv_usec = ((ns % NS) / 1000) as _;
        }
    }
    r
}

/// # Safety
/// As libc's `time`.
#[no_mangle]
pub unsafe extern "C" fn time(out: *mut time_t) -> time_t {
    let t = match dilation() {
        Some(d) => (d.dilate(libc::CLOCK_REALTIME, real_now(libc::CLOCK_REALTIME)) / NS) as time_t,
        None => (real_now(libc::CLOCK_REALTIME) / NS) as time_t,
    };
    if !out.is_null() {
        // SAFETY: the caller's pointer to a time_t.
        unsafe { *out = t };
    }
    t
}

/// # Safety
/// As libc's `timespec_get`.
#[no_mangle]
pub unsafe extern "C" fn timespec_get(ts: *mut timespec, base: c_int) -> c_int {
    if base != TIME_UTC || ts.is_null() {
        return 0;
    }
    // SAFETY: the caller's timespec.
    unsafe { clock_gettime(libc::CLOCK_REALTIME, ts) };
    base
}

/// The box deadline for a fabric `deadline` on `clock` (a copy for libc's function).
///
/// # Safety
/// `deadline` is null or points to a timespec.
unsafe fn box_deadline(clock: clockid_t, deadline: *const timespec) -> Option<timespec> {
    let d = dilation()?;
    if deadline.is_null() {
        return None;
    }
    // SAFETY: non-null, the caller's timespec.
    let fabric = to_ns(unsafe { &*deadline });
    Some(from_ns(d.undilate_deadline(clock, fabric, real_now(clock))))
}

/// Which clock an absolute deadline of a function without a clock argument is on: the one
/// whose fabric reading it is nearer (realtime readings are ~1.7e9 s, monotonic ones the
/// uptime), for condition variables whose clock lives in their attributes.
fn clock_of(deadline: *const timespec) -> clockid_t {
    let Some(d) = dilation() else {
        return libc::CLOCK_REALTIME;
    };
    if deadline.is_null() {
        return libc::CLOCK_REALTIME;
    }
    // SAFETY: non-null, the caller's timespec.
    let x = to_ns(unsafe { &*deadline });
    let r = d.dilate(libc::CLOCK_REALTIME, real_now(libc::CLOCK_REALTIME));
    let m = d.dilate(libc::CLOCK_MONOTONIC, real_now(libc::CLOCK_MONOTONIC));
    if (x - r).abs() <= (x - m).abs() {
        libc::CLOCK_REALTIME
    } else {
        libc::CLOCK_MONOTONIC
    }
}

/// Defines a deadline wait `$name(args.., deadline)` on a fixed or given clock.
macro_rules! deadline_wait {
    ($name:ident, $sym:literal, ($($a:ident: $t:ty),*), $dl:ident, clock = $clock:expr) => {
        /// # Safety
        /// As libc's function of this name.
        #[no_mangle]
        pub unsafe extern "C" fn $name($($a: $t,)* $dl: *const timespec) -> c_int {
            type F = unsafe extern "C" fn($($t,)* *const timespec) -> c_int;
            let f = real!($sym, F);
            let clock: clockid_t = $clock;
            // SAFETY: the caller's arguments, with the deadline moved to the box's clock.
            unsafe {
                match box_deadline(clock, $dl) {
                    Some(ts) => f($($a,)* &ts),
                    None => f($($a,)* $dl),
                }
            }
        }
    };
}

deadline_wait!(pthread_cond_timedwait, "pthread_cond_timedwait",
    (cond: *mut libc::pthread_cond_t, m: *mut libc::pthread_mutex_t), deadline, clock = clock_of(deadline));
deadline_wait!(pthread_cond_clockwait, "pthread_cond_clockwait",
    (cond: *mut libc::pthread_cond_t, m: *mut libc::pthread_mutex_t, c: clockid_t), deadline, clock = c);
deadline_wait!(sem_timedwait, "sem_timedwait", (s: *mut libc::sem_t), deadline, clock = libc::CLOCK_REALTIME);
deadline_wait!(sem_clockwait, "sem_clockwait", (s: *mut libc::sem_t, c: clockid_t), deadline, clock = c);
deadline_wait!(pthread_mutex_timedlock, "pthread_mutex_timedlock",
    (m: *mut libc::pthread_mutex_t), deadline, clock = libc::CLOCK_REALTIME);
deadline_wait!(pthread_mutex_clocklock, "pthread_mutex_clocklock",
    (m: *mut libc::pthread_mutex_t, c: clockid_t), deadline, clock = c);
deadline_wait!(pthread_rwlock_timedrdlock, "pthread_rwlock_timedrdlock",
    (l: *mut libc::pthread_rwlock_t), deadline, clock = libc::CLOCK_REALTIME);
deadline_wait!(pthread_rwlock_timedwrlock, "pthread_rwlock_timedwrlock",
    (l: *mut libc::pthread_rwlock_t), deadline, clock = libc::CLOCK_REALTIME);
deadline_wait!(pthread_rwlock_clockrdlock, "pthread_rwlock_clockrdlock",
    (l: *mut libc::pthread_rwlock_t, c: clockid_t), deadline, clock = c);
deadline_wait!(pthread_rwlock_clockwrlock, "pthread_rwlock_clockwrlock",
    (l: *mut libc::pthread_rwlock_t, c: clockid_t), deadline, clock = c);

/// A sleep until a deadline keeps its remaining length in wall time (see the crate docs).
///
/// # Safety
/// As libc's `clock_nanosleep`.
#[no_mangle]
pub unsafe extern "C" fn clock_nanosleep(
    clock: clockid_t,
    flags: c_int,
    req: *const timespec,
    rem: *mut timespec,
) -> c_int {
    type F = unsafe extern "C" fn(clockid_t, c_int, *const timespec, *mut timespec) -> c_int;
    let f = real!("clock_nanosleep", F);
    if flags & libc::TIMER_ABSTIME != 0 && !req.is_null() {
        if let Some(d) = dilation() {
            if family(clock).is_some() {
                let now = real_now(clock);
                // SAFETY: non-null, the caller's timespec.
                let left = to_ns(unsafe { &*req }) - d.dilate(clock, now);
                let ts = from_ns(now + left.max(0));
                // SAFETY: libc's clock_nanosleep with a deadline we own.
                return unsafe { f(clock, flags, &ts, rem) };
            }
        }
    }
    // SAFETY: the caller's arguments, passed on.
    unsafe { f(clock, flags, req, rem) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dil(k: f64) -> Dilation {
        let mut base = [None; CLOCKS];
        base[libc::CLOCK_REALTIME as usize] = Some(1_700_000_000 * NS);
        base[libc::CLOCK_MONOTONIC as usize] = Some(5_000 * NS);
        Dilation { k, base }
    }

    #[test]
    fn parses_the_environment_value() {
        assert_eq!(parse("4000 12 34"), Some((4000.0, 12, 34)));
        assert_eq!(parse("2.5 1 2"), Some((2.5, 1, 2)));
        for bad in [
            "", "4000", "4000 1", "0.5 1 2", "x 1 2", "4 1 2 3", "inf 1 2",
        ] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn clocks_run_k_times_slower_from_the_anchor() {
        let d = dil(4000.0);
        let m = libc::CLOCK_MONOTONIC;
        assert_eq!(d.dilate(m, 5_000 * NS), 5_000 * NS);
        // 4 s of box time after the anchor is 1 ms of fabric time.
        assert_eq!(d.dilate(m, 5_004 * NS), 5_000 * NS + 1_000_000);
        // CPU-time clocks are left alone.
        assert_eq!(d.dilate(libc::CLOCK_PROCESS_CPUTIME_ID, 77), 77);
    }

    #[test]
    fn a_fabric_deadline_becomes_k_times_further_on_the_box() {
        let d = dil(4000.0);
        let m = libc::CLOCK_MONOTONIC;
        let now = 5_004 * NS; // fabric: 5000 s + 1 ms
        let fabric_now = d.dilate(m, now);
        // A 30 ms fabric timeout ends 120 s later on the box...
        let at = d.undilate_deadline(m, fabric_now + 30_000_000, now);
        assert_eq!(at, now + 120 * NS);
        // ... where the dilated clock reads the deadline.
        assert_eq!(d.dilate(m, at), fabric_now + 30_000_000);
        // A deadline already past is now.
        assert_eq!(d.undilate_deadline(m, fabric_now - 1, now), now);
        // Left alone on an undilated clock.
        assert_eq!(
            d.undilate_deadline(libc::CLOCK_THREAD_CPUTIME_ID, 9, now),
            9
        );
    }
}
