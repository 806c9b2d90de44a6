//! Every system call closbox makes that std does not wrap: TUN devices, interface
//! ioctls, namespaces, mounts, epoll, eventfd. The only module with `unsafe`; each block
//! passes valid pointers to buffers it owns and checks the return value.

use std::ffi::CString;
use std::io;
use std::mem;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn cstr(p: &Path) -> io::Result<CString> {
    use std::os::unix::ffi::OsStrExt;
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains NUL"))
}

fn ifreq(name: &str) -> io::Result<libc::ifreq> {
    if name.is_empty() || name.len() >= libc::IFNAMSIZ {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("interface name {name:?} must be 1..15 bytes"),
        ));
    }
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(name.bytes()) {
        *d = s as libc::c_char;
    }
    Ok(req)
}

/// Creates TUN interface `name` (no packet-info header) in the calling thread's network
/// namespace, non-blocking.
pub fn tun_create(name: &str) -> io::Result<OwnedFd> {
    let path = c"/dev/net/tun";
    // SAFETY: valid C string; flags are constants.
    let fd = cvt(unsafe {
        libc::open(
            path.as_ptr(),
            libc::O_RDWR | libc::O_NONBLOCK | libc::O_CLOEXEC,
        )
    })?;
    // SAFETY: fd was just opened and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut req = ifreq(name)?;
    req.ifr_ifru.ifru_flags = (libc::IFF_TUN | libc::IFF_NO_PI) as libc::c_short;
    // SAFETY: TUNSETIFF reads and writes a struct ifreq we own.
    cvt(unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNSETIFF as _, &mut req) })?;
    // Persistent: closing the fd then does not unregister the device on the spot (~16 ms
    // of RCU waiting per TUN); it goes with its namespace, in one batch per teardown.
    // SAFETY: TUNSETPERSIST takes an integer argument.
    cvt(unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNSETPERSIST as _, 1 as libc::c_ulong) })?;
    Ok(fd)
}

fn sockaddr_in(addr: Ipv4Addr) -> libc::sockaddr {
    // SAFETY: sockaddr_in fits in sockaddr (16 bytes both); zeroed is valid.
    let mut sa: libc::sockaddr_in = unsafe { mem::zeroed() };
    sa.sin_family = libc::AF_INET as libc::sa_family_t;
    sa.sin_addr.s_addr = u32::from(addr).to_be();
    // SAFETY: same size, both plain data.
    unsafe { mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sa) }
}

/// Configures interface `name` in the calling thread's network namespace: IPv4 address
/// and prefix (the kernel adds the connected route), MTU, transmit queue length, up.
pub fn if_configure(
    name: &str,
    addr: Option<(Ipv4Addr, u8)>,
    mtu: Option<u32>,
    txqueuelen: Option<u32>,
) -> io::Result<()> {
    // SAFETY: plain socket(2) call.
    let s = cvt(unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: s was just created.
    let s = unsafe { OwnedFd::from_raw_fd(s) };
    let ioctl = |req: libc::c_ulong, r: &mut libc::ifreq| -> io::Result<()> {
        // SAFETY: each request reads/writes the ifreq we pass.
        cvt(unsafe { libc::ioctl(s.as_raw_fd(), req as _, r as *mut libc::ifreq) }).map(drop)
    };
    if let Some((a, prefix)) = addr {
        let mut r = ifreq(name)?;
        r.ifr_ifru.ifru_addr = sockaddr_in(a);
        ioctl(libc::SIOCSIFADDR, &mut r)?;
        let mask = if prefix == 0 {
            0
        } else {
            u32::MAX << (32 - prefix as u32)
        };
        let mut r = ifreq(name)?;
        r.ifr_ifru.ifru_netmask = sockaddr_in(Ipv4Addr::from(mask));
        ioctl(libc::SIOCSIFNETMASK, &mut r)?;
    }
    if let Some(mtu) = mtu {
        let mut r = ifreq(name)?;
        r.ifr_ifru.ifru_mtu = mtu as libc::c_int;
        ioctl(libc::SIOCSIFMTU, &mut r)?;
    }
    if let Some(q) = txqueuelen {
        let mut r = ifreq(name)?;
        r.ifr_ifru.ifru_metric = q as libc::c_int; // ifr_qlen shares the union slot
        ioctl(libc::SIOCSIFTXQLEN, &mut r)?;
    }
    let mut r = ifreq(name)?;
    ioctl(libc::SIOCGIFFLAGS, &mut r)?;
    // SAFETY: SIOCGIFFLAGS filled the flags member.
    unsafe { r.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short };
    ioctl(libc::SIOCSIFFLAGS, &mut r)?;
    Ok(())
}

/// Moves the calling thread into new namespaces (`libc::CLONE_NEW*` flags).
pub fn unshare(flags: libc::c_int) -> io::Result<()> {
    // SAFETY: plain syscall.
    cvt(unsafe { libc::unshare(flags) }).map(drop)
}

/// Moves the calling thread into the namespace `fd` refers to.
pub fn setns(fd: RawFd, nstype: libc::c_int) -> io::Result<()> {
    // SAFETY: plain syscall; the kernel validates fd.
    cvt(unsafe { libc::setns(fd, nstype) }).map(drop)
}

pub fn sethostname(name: &str) -> io::Result<()> {
    // SAFETY: pointer and length describe `name`.
    cvt(unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) }).map(drop)
}

/// `mount --bind src dst`.
pub fn bind_mount(src: &Path, dst: &Path) -> io::Result<()> {
    let (s, d) = (cstr(src)?, cstr(dst)?);
    // SAFETY: valid C strings; null fstype/data are allowed for MS_BIND.
    cvt(unsafe {
        libc::mount(
            s.as_ptr(),
            d.as_ptr(),
            std::ptr::null(),
            libc::MS_BIND,
            std::ptr::null(),
        )
    })
    .map(drop)
}

/// Changes the propagation of the mount at `path` (MS_SHARED, MS_SLAVE, … | MS_REC).
pub fn set_propagation(path: &Path, flags: libc::c_ulong) -> io::Result<()> {
    let p = cstr(path)?;
    // SAFETY: valid C string; propagation changes take no source or data.
    cvt(unsafe {
        libc::mount(
            std::ptr::null(),
            p.as_ptr(),
            std::ptr::null(),
            flags,
            std::ptr::null(),
        )
    })
    .map(drop)
}

/// Lazily unmounts `path`; `Ok(false)` if nothing was mounted there.
pub fn umount(path: &Path) -> io::Result<bool> {
    let p = cstr(path)?;
    // SAFETY: valid C string.
    match cvt(unsafe { libc::umount2(p.as_ptr(), libc::MNT_DETACH) }) {
        Ok(_) => Ok(true),
        Err(e)
            if e.raw_os_error() == Some(libc::EINVAL) || e.raw_os_error() == Some(libc::ENOENT) =>
        {
            Ok(false)
        }
        Err(e) => Err(e),
    }
}

/// Reads one packet; `Ok(None)` when the device has nothing (EAGAIN).
#[inline]
pub fn read_packet(fd: RawFd, buf: &mut [u8]) -> io::Result<Option<usize>> {
    // SAFETY: buf is valid for buf.len() bytes.
    let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::EAGAIN) => Ok(None),
            _ => Err(e),
        };
    }
    Ok(Some(n as usize))
}

/// Writes one packet.
#[inline]
pub fn write_packet(fd: RawFd, buf: &[u8]) -> io::Result<()> {
    // SAFETY: buf is valid for buf.len() bytes.
    let n = unsafe { libc::write(fd, buf.as_ptr().cast(), buf.len()) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// An epoll instance whose waits take a nanosecond timeout (epoll_pwait2).
#[derive(Debug)]
pub struct Epoll {
    fd: OwnedFd,
    events: Vec<libc::epoll_event>,
}

impl Epoll {
    pub fn new(capacity: usize) -> io::Result<Epoll> {
        // SAFETY: plain syscall.
        let fd = cvt(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) })?;
        Ok(Epoll {
            // SAFETY: fd was just created.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            events: vec![libc::epoll_event { events: 0, u64: 0 }; capacity.max(1)],
        })
    }

    /// Watches `fd` for input, reported with `token`.
    pub fn add(&self, fd: RawFd, token: u64) -> io::Result<()> {
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: token,
        };
        // SAFETY: ev is a valid epoll_event.
        cvt(unsafe { libc::epoll_ctl(self.fd.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) })
            .map(drop)
    }

    /// Waits up to `timeout_ns` (`None`: forever; 0: poll); returns the ready tokens.
    pub fn wait(&mut self, timeout_ns: Option<u64>) -> io::Result<impl Iterator<Item = u64> + '_> {
        let ts = timeout_ns.map(|ns| libc::timespec {
            tv_sec: (ns / 1_000_000_000) as libc::time_t,
            tv_nsec: (ns % 1_000_000_000) as libc::c_long,
        });
        let tsp = ts
            .as_ref()
            .map_or(std::ptr::null(), |t| t as *const libc::timespec);
        // SAFETY: events buffer holds `len` entries; tsp is null or points to ts.
        let n = unsafe {
            libc::epoll_pwait2(
                self.fd.as_raw_fd(),
                self.events.as_mut_ptr(),
                self.events.len() as libc::c_int,
                tsp,
                std::ptr::null(),
            )
        };
        let n = match cvt(n) {
            Ok(n) => n as usize,
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => 0,
            Err(e) => return Err(e),
        };
        Ok(self.events[..n].iter().map(|e| e.u64))
    }
}

/// An eventfd: a counter other threads bump to wake an epoll waiter.
#[derive(Debug)]
pub struct EventFd(OwnedFd);

impl EventFd {
    pub fn new() -> io::Result<EventFd> {
        // SAFETY: plain syscall.
        let fd = cvt(unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) })?;
        // SAFETY: fd was just created.
        Ok(EventFd(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    pub fn notify(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from `one`. A full counter (EAGAIN) already wakes.
        unsafe { libc::write(self.0.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    pub fn drain(&self) {
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into `v`; EAGAIN when already drained is fine.
        unsafe { libc::read(self.0.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
    }

    pub fn raw(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// Lets timers of this thread fire within 1 ns of their deadline instead of the default
/// 50 µs slack.
pub fn set_timer_slack_ns(ns: u64) {
    // SAFETY: PR_SET_TIMERSLACK takes an integer.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, ns as libc::c_ulong, 0, 0, 0) };
}

/// Sets the calling thread's nice value (lower = more CPU share under contention).
pub fn set_thread_nice(nice: i32) -> io::Result<()> {
    // SAFETY: gettid cannot fail; setpriority on our own thread id.
    let tid = unsafe { libc::gettid() };
    cvt(unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice) }).map(drop)
}

/// Sends `sig` to `pid` (negative: a process group). `Ok(false)` if it does not exist.
pub fn kill(pid: i32, sig: libc::c_int) -> io::Result<bool> {
    // SAFETY: plain syscall.
    match cvt(unsafe { libc::kill(pid, sig) }) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ESRCH) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Things a forked child does before exec to become a GPU: join its network and UTS
/// namespaces, get a private mount namespace with the GPU's /etc/hosts and a sysfs of its
/// network namespace (as `ip netns exec` does), and lead a new process group.
#[derive(Debug)]
pub struct EnterGpu {
    pub net: OwnedFd,
    pub uts: OwnedFd,
    hosts_src: CString,
    hosts_dst: CString,
    root: CString,
    sys: CString,
    sysfs: CString,
    /// Lead a new process group (for `run`); `exec` stays in the terminal's group.
    pub new_group: bool,
}

impl EnterGpu {
    pub fn new(net: OwnedFd, uts: OwnedFd, hosts_file: &Path) -> io::Result<EnterGpu> {
        Ok(EnterGpu {
            net,
            uts,
            hosts_src: cstr(hosts_file)?,
            hosts_dst: CString::from(c"/etc/hosts"),
            root: CString::from(c"/"),
            sys: CString::from(c"/sys"),
            sysfs: CString::from(c"sysfs"),
            new_group: false,
        })
    }

    /// Runs in the forked child: only async-signal-safe system calls, no allocation.
    pub fn enter(&self) -> io::Result<()> {
        setns(self.net.as_raw_fd(), libc::CLONE_NEWNET)?;
        setns(self.uts.as_raw_fd(), libc::CLONE_NEWUTS)?;
        unshare(libc::CLONE_NEWNS)?;
        let null: *const libc::c_char = std::ptr::null();
        let no_data: *const libc::c_void = std::ptr::null();
        // SAFETY: C strings owned by self; null fstype/data allowed for these flags.
        unsafe {
            cvt(libc::mount(
                null,
                self.root.as_ptr(),
                null,
                libc::MS_SLAVE | libc::MS_REC,
                no_data,
            ))?;
            cvt(libc::mount(
                self.hosts_src.as_ptr(),
                self.hosts_dst.as_ptr(),
                null,
                libc::MS_BIND,
                no_data,
            ))?;
            // A sysfs that shows this namespace's interfaces; failing that, keep the old.
            if libc::umount2(self.sys.as_ptr(), libc::MNT_DETACH) == 0 {
                libc::mount(
                    self.sysfs.as_ptr(),
                    self.sys.as_ptr(),
                    self.sysfs.as_ptr(),
                    0,
                    no_data,
                );
            }
            if self.new_group {
                cvt(libc::setpgid(0, 0))?;
            }
        }
        Ok(())
    }

    /// Spawns `cmd` inside the GPU. With `new_group`, it leads its own process group so
    /// that it and its children can be stopped together.
    pub fn spawn(
        self: &std::sync::Arc<Self>,
        cmd: &mut std::process::Command,
    ) -> io::Result<std::process::Child> {
        use std::os::unix::process::CommandExt;
        let me = std::sync::Arc::clone(self);
        // SAFETY: `enter` only makes async-signal-safe system calls on data prepared
        // before fork, and allocates nothing.
        unsafe { cmd.pre_exec(move || me.enter()) };
        cmd.spawn()
    }
}

/// Restores the default SIGPIPE action (Rust ignores it), so that `closbox … | head`
/// ends quietly like other command-line tools instead of failing on a closed pipe.
pub fn default_sigpipe() {
    // SAFETY: installs the default disposition; no handler code runs.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
}

pub fn is_root() -> bool {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Takes an exclusive `flock` on `file` without waiting; `Ok(false)` if another open file
/// description holds it.
pub fn try_flock_exclusive(file: &std::fs::File) -> io::Result<bool> {
    // SAFETY: plain syscall on a descriptor we own.
    match cvt(unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EWOULDBLOCK) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Makes `file` the process's stdout and stderr (dup2).
pub fn redirect_stdout_stderr(file: &std::fs::File) -> io::Result<()> {
    for target in [libc::STDOUT_FILENO, libc::STDERR_FILENO] {
        // SAFETY: dup2 on a descriptor we own onto the standard ones.
        cvt(unsafe { libc::dup2(file.as_raw_fd(), target) })?;
    }
    Ok(())
}

/// Sets the process's file mode creation mask; returns the previous one.
pub fn umask(mask: u32) -> u32 {
    // SAFETY: umask cannot fail.
    unsafe { libc::umask(mask as libc::mode_t) as u32 }
}

/// A process handle that cannot be confused with a later process of the same pid: signals
/// sent through it reach the process it was opened on, or nobody.
#[derive(Debug)]
pub struct Pidfd(OwnedFd);

impl Pidfd {
    /// `Ok(None)` if no process has that pid.
    pub fn open(pid: i32) -> io::Result<Option<Pidfd>> {
        // SAFETY: pidfd_open(2) takes a pid and flags and returns a new descriptor.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            let e = io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::ESRCH) => Ok(None),
                _ => Err(e),
            };
        }
        // SAFETY: the kernel just returned this descriptor to us.
        Ok(Some(Pidfd(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })))
    }

    /// Sends `sig`; `Ok(false)` if the process has exited.
    pub fn signal(&self, sig: libc::c_int) -> io::Result<bool> {
        // SAFETY: pidfd_send_signal(2) with a null siginfo behaves as kill(2).
        let r = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.0.as_raw_fd(),
                sig,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        if r < 0 {
            let e = io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::ESRCH) => Ok(false),
                _ => Err(e),
            };
        }
        Ok(true)
    }
}
