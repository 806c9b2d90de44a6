//! Every system call closbox makes that std does not wrap: TUN devices, interface
//! ioctls, rtnetlink, namespaces, mounts, epoll, eventfd, locks, pidfds. Through `rustix`
//! where it covers the call (safe wrappers, raw syscalls: nothing allocates, so they are
//! fine between fork and exec too); `libc` and `unsafe` only for the interface ioctls,
//! `unshare` (unsafe in rustix too), `TCP_INFO` and the SIGPIPE disposition. The only
//! module with `unsafe`; each block passes valid pointers to buffers it owns and checks
//! the result.

use std::ffi::CString;
use std::io;
use std::mem;
use std::net::Ipv4Addr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::path::Path;

use rustix::event::epoll;
use rustix::io::Errno;
use rustix::process::{self, Pid, Signal};
use rustix::time::Timespec;
use rustix::{mount, thread};

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
/// namespace, non-blocking. With `offload`: a 10-byte `virtio_net_hdr` before every packet
/// each way, and checksum and TCPv4 segmentation offload (with ECN), so that the GPU's
/// stack hands over TCP super-packets of up to 64 KiB (see `offload`).
pub fn tun_create(name: &str, offload: bool) -> io::Result<OwnedFd> {
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
    let vnet = if offload { libc::IFF_VNET_HDR } else { 0 };
    req.ifr_ifru.ifru_flags = (libc::IFF_TUN | libc::IFF_NO_PI | vnet) as libc::c_short;
    // SAFETY: TUNSETIFF reads and writes a struct ifreq we own.
    cvt(unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNSETIFF as _, &mut req) })?;
    if offload {
        let hdr: libc::c_int = crate::offload::VNET_HDR_LEN as libc::c_int;
        // SAFETY: TUNSETVNETHDRSZ reads an int we own.
        cvt(unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNSETVNETHDRSZ as _, &hdr) })?;
        let f = (libc::TUN_F_CSUM | libc::TUN_F_TSO4 | libc::TUN_F_TSO_ECN) as libc::c_ulong;
        // SAFETY: TUNSETOFFLOAD takes an integer argument.
        cvt(unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNSETOFFLOAD as _, f) })?;
    }
    // Persistent: closing the fd then does not unregister the device on the spot (~16 ms
    // of RCU waiting per TUN); it goes with its namespace, in one batch per teardown.
    // SAFETY: TUNSETPERSIST takes an integer argument.
    cvt(unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNSETPERSIST as _, 1 as libc::c_ulong) })?;
    Ok(fd)
}

/// The network namespace TUN `fd`'s device is in now (`TUNGETDEVNETNS`), as the
/// (device, inode) pair that names a namespace; an error once the device is gone.
pub fn tun_netns(fd: BorrowedFd<'_>) -> io::Result<(u64, u64)> {
    // SAFETY: TUNGETDEVNETNS takes no argument and returns a new descriptor.
    let ns = cvt(unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNGETDEVNETNS as _) })?;
    // SAFETY: the kernel just opened it for us; nobody else owns it.
    let ns = unsafe { OwnedFd::from_raw_fd(ns) };
    let st = rustix::fs::fstat(&ns)?;
    Ok((st.st_dev, st.st_ino))
}

/// The (device, inode) pair of the namespace file at `path` (a pinned namespace, or
/// `/proc/self/ns/net`), as `tun_netns` gives it.
pub fn netns_id(path: &Path) -> io::Result<(u64, u64)> {
    let st = rustix::fs::stat(path)?;
    Ok((st.st_dev, st.st_ino))
}

/// Makes TUN `fd`'s device go when `fd` is closed (it was made persistent).
pub fn tun_not_persistent(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: TUNSETPERSIST takes an integer argument.
    cvt(unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNSETPERSIST as _, 0 as libc::c_ulong) })?;
    Ok(())
}

/// `TUNSETCARRIER` (`_IOW('T', 226, int)`, Linux 5.0), which the libc crate lacks.
const TUNSETCARRIER: libc::c_ulong = 0x4004_54e2;

/// Sets TUN `fd`'s carrier: off, its interface shows `NO-CARRIER` and its stack stops
/// sending into it, as a NIC whose cable is pulled; on again, it carries.
pub fn tun_set_carrier(fd: BorrowedFd<'_>, on: bool) -> io::Result<()> {
    let on = libc::c_int::from(on);
    // SAFETY: TUNSETCARRIER reads an int we own.
    cvt(unsafe { libc::ioctl(fd.as_raw_fd(), TUNSETCARRIER as _, &on) })?;
    Ok(())
}

/// Creates TUN interface `name` (blocking, not persistent) with the virtio-net header and
/// checksum and TSO offload: the kernel hands over and takes super-packets of up to 64 KiB,
/// each behind a 10-byte `virtio_net_hdr`. For the bare relay of `make bench-live`
/// (`examples/tun_relay.rs`), which reads blocking: `tun_create` is what the data plane
/// uses.
pub fn tun_create_offload(name: &str) -> io::Result<OwnedFd> {
    let path = c"/dev/net/tun";
    // SAFETY: valid C string; flags are constants.
    let fd = cvt(unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) })?;
    // SAFETY: fd was just opened and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut req = ifreq(name)?;
    req.ifr_ifru.ifru_flags =
        (libc::IFF_TUN | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as libc::c_short;
    // SAFETY: TUNSETIFF reads and writes a struct ifreq we own.
    cvt(unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNSETIFF as _, &mut req) })?;
    let hdr: libc::c_int = 10;
    // SAFETY: TUNSETVNETHDRSZ reads an int we own.
    cvt(unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNSETVNETHDRSZ as _, &hdr) })?;
    let offload = (libc::TUN_F_CSUM | libc::TUN_F_TSO4 | libc::TUN_F_TSO6) as libc::c_ulong;
    // SAFETY: TUNSETOFFLOAD takes an integer argument.
    cvt(unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNSETOFFLOAD as _, offload) })?;
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

/// Moves the calling thread into a new network namespace.
pub fn unshare_net() -> io::Result<()> {
    // SAFETY: only NEWNET: the file table (the unsound case) is not unshared.
    unsafe { thread::unshare_unsafe(thread::UnshareFlags::NEWNET) }.map_err(io::Error::from)
}

/// A NETLINK_ROUTE socket, in the calling thread's network namespace (for good: a
/// netlink socket stays in the namespace it was made in).
#[derive(Debug)]
pub struct RouteSocket(OwnedFd);

impl RouteSocket {
    pub fn open() -> io::Result<RouteSocket> {
        use rustix::net::{socket_with, AddressFamily, SocketFlags, SocketType};
        let fd = socket_with(
            AddressFamily::NETLINK,
            SocketType::RAW,
            SocketFlags::CLOEXEC,
            None, // NETLINK_ROUTE
        )?;
        // The kernel answers a request before `send` returns; an answer that does not
        // come (a request this kernel answers only to listeners) is an error, not a thread
        // blocked for good (the pacer's, say).
        rustix::net::sockopt::set_socket_timeout(
            &fd,
            rustix::net::sockopt::Timeout::Recv,
            Some(std::time::Duration::from_secs(5)),
        )?;
        Ok(RouteSocket(fd))
    }

    /// Sends `msg` (one or more netlink messages) to the kernel.
    pub fn send(&self, msg: &[u8]) -> io::Result<()> {
        rustix::net::send(&self.0, msg, rustix::net::SendFlags::empty())?;
        Ok(())
    }

    /// Receives one datagram from the kernel; its length.
    pub fn recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        match rustix::net::recv(&self.0, buf, rustix::net::RecvFlags::empty()) {
            Ok((n, _)) => Ok(n),
            Err(Errno::AGAIN) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "rtnetlink gave no answer within 5 s",
            )),
            Err(e) => Err(e.into()),
        }
    }

    /// The index of interface `name` in this socket's namespace.
    pub fn if_index(&self, name: &str) -> io::Result<u32> {
        Ok(rustix::net::netdevice::name_to_index(&self.0, name)?)
    }

    /// Lets through only link and qdisc messages (`RTM_NEWLINK`, `RTM_DELLINK`,
    /// `RTM_NEWQDISC`, `RTM_DELQDISC`) about interface `index`, and netlink's own
    /// (acknowledgements, errors): a classic BPF filter, so
    /// that the kernel drops the rest before it wakes the reader. (A GPU that changes
    /// another interface of its namespace 80,000 times a second kept a third of the data
    /// plane's CPU busy reading and discarding the news.)
    pub fn only_link(&self, index: u32) -> io::Result<()> {
        // Absolute loads read big-endian; netlink's fields are in host order.
        let be16 = |v: u16| u32::from(u16::from_be_bytes(v.to_ne_bytes()));
        let be32 = |v: u32| u32::from_be_bytes(v.to_ne_bytes());
        let op = |code: u32, jt: u8, jf: u8, k: u32| libc::sock_filter {
            code: code as u16,
            jt,
            jf,
            k,
        };
        let (ld, abs, h, w) = (libc::BPF_LD, libc::BPF_ABS, libc::BPF_H, libc::BPF_W);
        let (jeq, k, ret) = (libc::BPF_JMP | libc::BPF_JEQ, libc::BPF_K, libc::BPF_RET);
        let jgt = libc::BPF_JMP | libc::BPF_JGT;
        let mut prog = [
            // nlmsg_type: links and root qdiscs go on to their index; netlink's own
            // messages (errors, below 16) pass; the rest (classes and filters, which the
            // pacer's rate changes make) are dropped.
            op(ld | h | abs, 0, 0, 4),
            op(jeq | k, 5, 0, be16(libc::RTM_NEWLINK)),
            op(jeq | k, 4, 0, be16(libc::RTM_DELLINK)),
            op(jeq | k, 3, 0, be16(libc::RTM_NEWQDISC)),
            op(jeq | k, 2, 0, be16(libc::RTM_DELQDISC)),
            // (Types below 256 load as type << 8: the order holds.)
            op(jgt | k, 4, 0, be16(15)),
            op(ret | k, 0, 0, u32::MAX),
            // ifinfomsg.ifi_index and tcmsg.tcm_ifindex, after the 16-byte header
            op(ld | w | abs, 0, 0, 20),
            op(jeq | k, 0, 1, be32(index)),
            op(ret | k, 0, 0, u32::MAX),
            op(ret | k, 0, 0, 0),
        ];
        let fprog = libc::sock_fprog {
            len: prog.len() as u16,
            filter: prog.as_mut_ptr(),
        };
        // SAFETY: the kernel copies the program (fprog and what it points to) during the
        // call; both outlive it.
        cvt(unsafe {
            libc::setsockopt(
                self.0.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_ATTACH_FILTER,
                &fprog as *const libc::sock_fprog as *const libc::c_void,
                std::mem::size_of::<libc::sock_fprog>() as libc::socklen_t,
            )
        })
        .map(drop)
    }

    /// A nonblocking socket that hears of every change to the links of the calling
    /// thread's namespace (the `RTMGRP_LINK` group: an `RTM_NEWLINK` message each).
    pub fn watch_links() -> io::Result<RouteSocket> {
        use rustix::net::{
            netlink::SocketAddrNetlink, socket_with, AddressFamily, SocketFlags, SocketType,
        };
        const RTMGRP_LINK: u32 = 1;
        // Qdiscs too: a GPU's host replacing the one closbox paces with is heard at once.
        const RTMGRP_TC: u32 = 8;
        let fd = socket_with(
            AddressFamily::NETLINK,
            SocketType::RAW,
            SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            None, // NETLINK_ROUTE
        )?;
        rustix::net::bind(&fd, &SocketAddrNetlink::new(0, RTMGRP_LINK | RTMGRP_TC))?;
        Ok(RouteSocket(fd))
    }

    /// Receives one datagram if one is there (a nonblocking socket): its length, or
    /// `None`.
    pub fn try_recv(&self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        match rustix::net::recv(&self.0, buf, rustix::net::RecvFlags::empty()) {
            Ok((n, _)) => Ok(Some(n)),
            Err(Errno::AGAIN) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

/// Moves the calling thread into the network namespace `fd` refers to.
pub fn enter_netns(fd: BorrowedFd<'_>) -> io::Result<()> {
    thread::move_into_link_name_space(fd, Some(thread::LinkNameSpaceType::Network))
        .map_err(io::Error::from)
}

/// `mount --bind src dst`.
pub fn bind_mount(src: &Path, dst: &Path) -> io::Result<()> {
    mount::mount_bind(src, dst).map_err(io::Error::from)
}

/// Makes the mount at `path` shared, recursively (as `ip netns` does with /run/netns).
pub fn make_shared(path: &Path) -> io::Result<()> {
    mount::mount_change(
        path,
        mount::MountPropagationFlags::SHARED | mount::MountPropagationFlags::REC,
    )
    .map_err(io::Error::from)
}

/// Lazily unmounts `path`; `Ok(false)` if nothing was mounted there.
pub fn umount(path: &Path) -> io::Result<bool> {
    match mount::unmount(path, mount::UnmountFlags::DETACH) {
        Ok(()) => Ok(true),
        Err(e) if e == Errno::INVAL || e == Errno::NOENT => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Reads one packet; `Ok(None)` when the device has nothing (EAGAIN).
#[inline]
pub fn read_packet(fd: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<Option<usize>> {
    match rustix::io::read(fd, buf) {
        Ok(n) => Ok(Some(n)),
        Err(Errno::AGAIN) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Reads and drops whatever `fd` (a non-blocking TUN) has queued; returns how many
/// packets that was.
pub fn discard_queued(fd: BorrowedFd<'_>) -> io::Result<u64> {
    // Room for the largest packet and its virtio header: whether a read too short for a
    // packet cuts it or fails has changed between kernels.
    let mut buf = vec![0u8; (64 << 10) + 64];
    let mut n = 0;
    while read_packet(fd, &mut buf)?.is_some() {
        n += 1;
    }
    Ok(n)
}

/// The payload bytes TCP socket `fd` has received in order (`TCP_INFO`'s
/// `tcpi_bytes_received`, counted as they arrive, not as they are read).
pub fn tcp_bytes_received(fd: BorrowedFd<'_>) -> io::Result<u64> {
    let mut info: libc::tcp_info = unsafe { mem::zeroed() };
    let mut len = mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    cvt(unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    })?;
    // (Kernels before 4.1 fill a shorter struct, without the field.)
    if (len as usize) < mem::offset_of!(libc::tcp_info, tcpi_bytes_received) + 8 {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "TCP_INFO without tcpi_bytes_received (a kernel before 4.1)",
        ));
    }
    Ok(info.tcpi_bytes_received)
}

/// Makes closing the TCP socket `fd` abort its connection (`SO_LINGER` on, 0 s): the
/// kernel sends a reset and forgets the socket at once, with no FIN handshake, TIME_WAIT
/// or retransmissions left behind it, and saves no TCP metrics for its peer.
pub fn abort_on_close(fd: BorrowedFd<'_>) -> io::Result<()> {
    rustix::net::sockopt::set_socket_linger(fd, Some(std::time::Duration::ZERO))
        .map_err(io::Error::from)
}

/// Writes one packet.
#[inline]
pub fn write_packet(fd: BorrowedFd<'_>, buf: &[u8]) -> io::Result<()> {
    rustix::io::write(fd, buf)
        .map(drop)
        .map_err(io::Error::from)
}

/// Writes one packet gathered from `parts` (a virtio header, headers, payloads).
#[inline]
pub fn write_packet_vectored(fd: BorrowedFd<'_>, parts: &[std::io::IoSlice<'_>]) -> io::Result<()> {
    rustix::io::writev(fd, parts)
        .map(drop)
        .map_err(io::Error::from)
}

/// An epoll instance whose waits take a nanosecond timeout (`epoll_pwait2`: rustix's
/// `linux_5_11` feature; without it, timeouts would be rounded to milliseconds).
#[derive(Debug)]
pub struct Epoll {
    fd: OwnedFd,
    /// The tokens of the last wait (rustix's events hold a pointer-sized union and are
    /// not `Send`; the tokens are).
    tokens: Vec<u64>,
}

/// Events taken from the kernel per wait; more stay ready for the next one.
const EPOLL_BATCH: usize = 256;

impl Epoll {
    pub fn new(capacity: usize) -> io::Result<Epoll> {
        Ok(Epoll {
            fd: epoll::create(epoll::CreateFlags::CLOEXEC)?,
            tokens: Vec::with_capacity(capacity.clamp(1, EPOLL_BATCH)),
        })
    }

    /// Watches `fd` for input, reported with `token`.
    pub fn add(&self, fd: BorrowedFd<'_>, token: u64) -> io::Result<()> {
        epoll::add(
            &self.fd,
            fd,
            epoll::EventData::new_u64(token),
            epoll::EventFlags::IN,
        )
        .map_err(io::Error::from)
    }

    /// Stops watching `fd`.
    pub fn remove(&self, fd: BorrowedFd<'_>) -> io::Result<()> {
        epoll::delete(&self.fd, fd).map_err(io::Error::from)
    }

    /// Waits up to `timeout_ns` (`None`: forever; 0: poll); returns the ready tokens.
    pub fn wait(&mut self, timeout_ns: Option<u64>) -> io::Result<impl Iterator<Item = u64> + '_> {
        let ts = timeout_ns.map(|ns| Timespec {
            tv_sec: (ns / 1_000_000_000) as _,
            tv_nsec: (ns % 1_000_000_000) as _,
        });
        self.tokens.clear();
        let mut buf = [std::mem::MaybeUninit::<epoll::Event>::uninit(); EPOLL_BATCH];
        match epoll::wait(&self.fd, &mut buf, ts.as_ref()) {
            Ok((ready, _)) => self.tokens.extend(ready.iter().map(|e| e.data.u64())),
            Err(Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
        Ok(self.tokens.iter().copied())
    }
}

/// An eventfd: a counter other threads bump to wake an epoll waiter.
#[derive(Debug)]
pub struct EventFd(OwnedFd);

impl EventFd {
    pub fn new() -> io::Result<EventFd> {
        Ok(EventFd(rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::NONBLOCK | rustix::event::EventfdFlags::CLOEXEC,
        )?))
    }

    pub fn notify(&self) {
        // A full counter (EAGAIN) already wakes.
        let _ = rustix::io::write(&self.0, &1u64.to_ne_bytes());
    }

    pub fn drain(&self) {
        // EAGAIN when already drained is fine.
        let _ = rustix::io::read(&self.0, &mut [0u8; 8]);
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

/// Lets timers of this thread fire within 1 ns of their deadline instead of the default
/// 50 µs slack.
pub fn set_timer_slack_ns(ns: u64) {
    let _ = thread::set_current_timer_slack(std::num::NonZeroU64::new(ns));
}

/// Sets the calling thread's nice value (lower = more CPU share under contention).
pub fn set_thread_nice(nice: i32) -> io::Result<()> {
    process::setpriority_process(Some(thread::gettid()), nice).map_err(io::Error::from)
}

/// The calling thread's CPU time so far and its time spent runnable but waiting for a CPU
/// (run-queue delay), in ns: the first two fields of `/proc/thread-self/schedstat`.
pub fn thread_cpu_ns() -> io::Result<(u64, u64)> {
    parse_schedstat(&std::fs::read_to_string("/proc/thread-self/schedstat")?)
}

/// "run_ns wait_ns slices\n" → (run_ns, wait_ns).
fn parse_schedstat(s: &str) -> io::Result<(u64, u64)> {
    let mut f = s.split_ascii_whitespace().map(str::parse::<u64>);
    match (f.next(), f.next()) {
        (Some(Ok(run)), Some(Ok(wait))) => Ok((run, wait)),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("unexpected schedstat {s:?}"),
        )),
    }
}

/// The box's CPU time so far, all CPUs together, and of it the time the hypervisor gave
/// this machine's virtual CPUs to others ("steal"), in clock ticks: the `cpu` line of
/// `/proc/stat`. Two readings apart give the share stolen meanwhile (`steal_share`).
pub fn box_cpu_ticks() -> io::Result<(u64, u64)> {
    parse_proc_stat(&std::fs::read_to_string("/proc/stat")?)
}

/// `/proc/stat` → (all ticks, steal ticks): user nice system idle iowait irq softirq steal
/// (guest time is already in user).
fn parse_proc_stat(s: &str) -> io::Result<(u64, u64)> {
    let bad = || io::Error::new(io::ErrorKind::InvalidData, "unexpected /proc/stat");
    let line = s.lines().find(|l| l.starts_with("cpu ")).ok_or_else(bad)?;
    let f: Vec<u64> = line
        .split_ascii_whitespace()
        .skip(1)
        .take(8)
        .map(str::parse)
        .collect::<Result<_, _>>()
        .map_err(|_| bad())?;
    if f.len() < 4 {
        return Err(bad());
    }
    Ok((f.iter().sum(), f.get(7).copied().unwrap_or(0)))
}

/// Steal from this share of the box's CPU time on is worth a mention beside a measurement.
pub const STEAL_SHOWN: f64 = 0.01;

/// `say(steal in %)` where `steal` (a share) is worth a mention (`STEAL_SHOWN`), else
/// nothing.
pub fn steal_note(steal: f64, say: impl FnOnce(f64) -> String) -> String {
    if steal >= STEAL_SHOWN {
        say(steal * 100.0)
    } else {
        String::new()
    }
}

/// The share of the box's CPU time stolen between two `box_cpu_ticks` readings.
pub fn steal_share(before: (u64, u64), after: (u64, u64)) -> f64 {
    let all = after.0.saturating_sub(before.0);
    after.1.saturating_sub(before.1) as f64 / all.max(1) as f64
}

/// The kernel's PM QoS CPU latency interface: a request (µs an idle CPU may take to wake)
/// held for as long as the file is open.
const CPU_LATENCY: &str = "/dev/cpu_dma_latency";

/// Asks the kernel to keep the CPUs' idle wake-up latency at `us` µs while the returned
/// file is open; at 0 idle CPUs poll instead of halting. The kernel drops the request when
/// the file is closed, however the process ends.
pub fn hold_cpu_latency(us: i32) -> io::Result<std::fs::File> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new().write(true).open(CPU_LATENCY)?;
    f.write_all(&us.to_ne_bytes())?;
    Ok(f)
}

/// Where the kernel names its cpuidle driver.
const CPUIDLE_DRIVER: &str = "/sys/devices/system/cpu/cpuidle/current_driver";

/// Why a CPU latency request (`hold_cpu_latency`) cannot keep this box's idle CPUs
/// polling, if it cannot. Only a cpuidle driver's governor reads the request: without a
/// driver (`none`, as on Firecracker VMs that have no haltpoll driver, or no cpuidle in
/// the kernel) an idle CPU runs the architecture's default idle, a halt, whatever is
/// asked.
pub fn idle_poll_unavailable() -> Option<String> {
    match std::fs::read_to_string(CPUIDLE_DRIVER) {
        Ok(d) if !d.trim().is_empty() && d.trim() != "none" => None,
        Ok(_) => Some(format!(
            "this kernel has no cpuidle driver ({CPUIDLE_DRIVER}: none): its idle CPUs halt whatever CPU latency is asked"
        )),
        Err(e) => Some(format!(
            "this kernel shows no cpuidle driver ({CPUIDLE_DRIVER}: {e}): its idle CPUs halt whatever CPU latency is asked"
        )),
    }
}

/// Whether `up --idle-poll` would change how this box's idle CPUs wait: it has a
/// cpuidle driver (`idle_poll_unavailable`) and nobody holds a CPU latency under the
/// driver's halt state's (1 µs), which would have them poll already.
pub fn idle_poll_would_help() -> bool {
    idle_poll_unavailable().is_none() && cpu_latency_target().map_or(true, |us| us >= 1)
}

/// The idle wake-up latency the kernel keeps now (the smallest request held), µs;
/// 2,000,000,000 when nobody asked for one.
pub fn cpu_latency_target() -> io::Result<i32> {
    use std::io::Read;
    let mut b = [0u8; 4];
    std::fs::File::open(CPU_LATENCY)?.read_exact(&mut b)?;
    Ok(i32::from_ne_bytes(b))
}

/// Puts the calling thread in the real-time FIFO class at `priority` (1–99): it runs
/// whenever it is runnable, ahead of every normal thread.
pub fn set_thread_fifo(priority: i32) -> io::Result<()> {
    let param = libc::sched_param {
        sched_priority: priority,
    };
    // SAFETY: pid 0 is the calling thread; `param` is a valid sched_param.
    cvt(unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) }).map(drop)
}

/// Puts the calling thread back in the normal class (its nice value is kept).
pub fn set_thread_normal() -> io::Result<()> {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: as in `set_thread_fifo`.
    cvt(unsafe { libc::sched_setscheduler(0, libc::SCHED_OTHER, &param) }).map(drop)
}

/// The CPUs the calling thread may run on, in order.
pub fn allowed_cpus() -> io::Result<Vec<usize>> {
    let set = thread::sched_getaffinity(None)?;
    Ok((0..thread::CpuSet::MAX_CPU)
        .filter(|&c| set.is_set(c))
        .collect())
}

/// Binds the calling thread (and what it spawns from now on) to one CPU.
pub fn pin_to_cpu(cpu: usize) -> io::Result<()> {
    let mut set = thread::CpuSet::new();
    set.set(cpu);
    thread::sched_setaffinity(None, &set).map_err(io::Error::from)
}

fn signal(sig: libc::c_int) -> io::Result<Signal> {
    Signal::from_named_raw(sig).ok_or_else(|| io::Error::other(format!("signal {sig}")))
}

/// Sends `sig` to `pid` (negative: the process group `-pid`). `Ok(false)` if it does not
/// exist.
pub fn kill(pid: i32, sig: libc::c_int) -> io::Result<bool> {
    let sig = signal(sig)?;
    let target = Pid::from_raw(pid.abs()).ok_or_else(|| io::Error::other("pid 0"))?;
    let sent = if pid < 0 {
        process::kill_process_group(target, sig)
    } else {
        process::kill_process(target, sig)
    };
    match sent {
        Ok(()) => Ok(true),
        Err(Errno::SRCH) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Things a forked child does before exec to become a GPU: join its network namespace,
/// get a UTS namespace of its own with the GPU's hostname and a private mount namespace
/// with the GPU's /etc/hosts, /etc/hostname and a sysfs of its network namespace (as `ip
/// netns exec` does), and lead a new process group.
///
/// The UTS namespace is the process's, not one per GPU kept by a mount: each mount of a
/// GPU is copied into every process's mount namespace, for every GPU of every fabric up.
#[derive(Debug)]
pub struct EnterGpu {
    pub net: OwnedFd,
    hostname: CString,
    hosts_src: CString,
    hostname_src: CString,
    /// Lead a new process group (`exec` away from a terminal); `exec` from a terminal
    /// stays in the terminal's group.
    pub new_group: bool,
    /// Lead a new session, and so a new process group (`run`'s ranks): everything the
    /// command starts, in this GPU or through `closbox exec` in others (a launcher's
    /// remote daemons and their ranks), stays in its session unless it leaves it itself,
    /// so a job's processes can be found after their parents are gone.
    pub new_session: bool,
    /// The process that spawns: its command gets SIGTERM when it dies, however it dies.
    parent: Option<Pid>,
}

impl EnterGpu {
    pub fn new(
        net: OwnedFd,
        hostname: &str,
        hosts_file: &Path,
        hostname_file: &Path,
    ) -> io::Result<EnterGpu> {
        Ok(EnterGpu {
            net,
            hostname: CString::new(hostname)
                .map_err(|_| io::Error::other("a hostname with a NUL byte"))?,
            hosts_src: cstr(hosts_file)?,
            hostname_src: cstr(hostname_file)?,
            new_group: false,
            new_session: false,
            parent: Some(process::getpid()),
        })
    }

    /// Runs in the forked child: only system calls, no allocation (paths are C strings
    /// prepared before the fork, or literals).
    pub fn enter(&self) -> io::Result<()> {
        thread::move_into_link_name_space(
            self.net.as_fd(),
            Some(thread::LinkNameSpaceType::Network),
        )?;
        // SAFETY: new mount and UTS namespaces only; the file table is not unshared.
        unsafe {
            thread::unshare_unsafe(thread::UnshareFlags::NEWNS | thread::UnshareFlags::NEWUTS)
        }?;
        rustix::system::sethostname(self.hostname.as_bytes())?;
        mount::mount_change(
            c"/",
            mount::MountPropagationFlags::DOWNSTREAM | mount::MountPropagationFlags::REC,
        )?;
        mount::mount_bind(self.hosts_src.as_c_str(), c"/etc/hosts")?;
        // Programs that read the file rather than ask the kernel; a host without one (a
        // container), or a fabric brought up before closbox wrote it, keeps its own.
        let _ = mount::mount_bind(self.hostname_src.as_c_str(), c"/etc/hostname");
        // A sysfs that shows this namespace's interfaces; failing that, keep the old.
        if mount::unmount(c"/sys", mount::UnmountFlags::DETACH).is_ok() {
            let _ = mount::mount(
                c"sysfs",
                c"/sys",
                c"sysfs",
                mount::MountFlags::empty(),
                None,
            );
        }
        if self.new_session {
            process::setsid()?;
        } else if self.new_group {
            process::setpgid(None, None)?;
        }
        // A GPU's command does not outlive the closbox that started it (killed, even by
        // SIGKILL, it would leave the command running in the namespace): SIGTERM then,
        // as a remote shell's hang-up would. Its own children are its business.
        process::set_parent_process_death_signal(Some(Signal::TERM))?;
        if process::getppid() != self.parent {
            return Err(io::Error::other(
                "closbox exited before the command started",
            ));
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
        // SAFETY: `enter` only makes system calls on data prepared before fork, and
        // allocates nothing.
        unsafe { cmd.pre_exec(move || me.enter()) };
        cmd.spawn()
    }
}

/// The processes of process group `pgid` that have not exited (zombies are not counted:
/// they have, and only their parents' wait takes them away).
pub fn group_members(pgid: i32) -> Vec<i32> {
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|st| stat_state_and_group(&st))
                .is_some_and(|(state, group)| group == pgid && state != 'Z' && state != 'X')
        })
        .collect()
}

/// A `/proc/PID/stat` line's state and process group (after the command's closing
/// parenthesis, which may itself contain spaces and parentheses).
fn stat_state_and_group(stat: &str) -> Option<(char, i32)> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut f = rest.split_ascii_whitespace();
    let state = f.next()?.chars().next()?;
    let _ppid = f.next()?;
    Some((state, f.next()?.parse().ok()?))
}

/// This process gets SIGTERM when its parent exits (or at once, if it already has).
pub fn die_with_parent() -> io::Result<()> {
    let parent = process::getppid();
    process::set_parent_process_death_signal(Some(Signal::TERM))?;
    if process::getppid() != parent {
        process::kill_process(process::getpid(), Signal::TERM)?;
    }
    Ok(())
}

/// Restores the default SIGPIPE action (Rust ignores it), so that `closbox … | head`
/// ends quietly like other command-line tools instead of failing on a closed pipe.
pub fn default_sigpipe() {
    // SAFETY: installs the default disposition; no handler code runs.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
}

/// Lets this process keep `need` files open: raises the soft `RLIMIT_NOFILE` to `need`
/// if it is lower. `Err(hard)` when the hard limit is lower than `need` (nothing changed).
pub fn allow_open_files(need: u64) -> io::Result<Result<(), u64>> {
    let lim = process::getrlimit(process::Resource::Nofile);
    let soft = lim.current.unwrap_or(u64::MAX);
    let hard = lim.maximum.unwrap_or(u64::MAX);
    if soft >= need {
        return Ok(Ok(()));
    }
    if hard < need {
        return Ok(Err(hard));
    }
    process::setrlimit(
        process::Resource::Nofile,
        process::Rlimit {
            current: Some(need),
            maximum: lim.maximum,
        },
    )?;
    Ok(Ok(()))
}

pub fn is_root() -> bool {
    process::geteuid().is_root()
}

/// Takes an exclusive `flock` on `file` without waiting; `Ok(false)` if another open file
/// description holds it.
pub fn try_flock_exclusive(file: &std::fs::File) -> io::Result<bool> {
    match rustix::fs::flock(file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(true),
        Err(Errno::WOULDBLOCK) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Makes `file` the process's stdout and stderr (dup2).
pub fn redirect_stdout_stderr(file: &std::fs::File) -> io::Result<()> {
    rustix::stdio::dup2_stdout(file)?;
    rustix::stdio::dup2_stderr(file)?;
    Ok(())
}

/// Sets the process's file mode creation mask; returns the previous one.
pub fn umask(mask: u32) -> u32 {
    process::umask(rustix::fs::Mode::from_raw_mode(mask)).as_raw_mode()
}

/// A process handle that cannot be confused with a later process of the same pid: signals
/// sent through it reach the process it was opened on, or nobody.
#[derive(Debug)]
pub struct Pidfd(OwnedFd);

impl Pidfd {
    /// `Ok(None)` if no process has that pid.
    pub fn open(pid: i32) -> io::Result<Option<Pidfd>> {
        let Some(pid) = Pid::from_raw(pid) else {
            return Ok(None);
        };
        match process::pidfd_open(pid, process::PidfdFlags::empty()) {
            Ok(fd) => Ok(Some(Pidfd(fd))),
            Err(Errno::SRCH) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Whether the process has exited (a pidfd is readable from then on, zombie or reaped).
    pub fn exited(&self) -> bool {
        use rustix::event::{poll, PollFd, PollFlags};
        let mut fds = [PollFd::new(&self.0, PollFlags::IN)];
        let zero = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        matches!(poll(&mut fds, Some(&zero)), Ok(n) if n > 0)
    }

    /// Sends `sig`; `Ok(false)` if the process has exited.
    pub fn signal(&self, sig: libc::c_int) -> io::Result<bool> {
        match process::pidfd_send_signal(&self.0, signal(sig)?) {
            Ok(()) => Ok(true),
            Err(Errno::SRCH) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }
}

/// `CLOCK_MONOTONIC` and `CLOCK_REALTIME` now, in ns: the anchor of a fabric clock
/// (`closbox-clock`).
pub fn clock_anchor_ns() -> (i128, i128) {
    use rustix::time::{clock_gettime, ClockId};
    let ns = |t: rustix::time::Timespec| t.tv_sec as i128 * 1_000_000_000 + t.tv_nsec as i128;
    (
        ns(clock_gettime(ClockId::Monotonic)),
        ns(clock_gettime(ClockId::Realtime)),
    )
}

/// The name of interface `index` in the calling thread's network namespace (which may
/// have been renamed since it was made).
pub fn if_name(index: u32) -> io::Result<String> {
    use rustix::net::{socket_with, AddressFamily, SocketFlags, SocketType};
    let fd = socket_with(
        AddressFamily::INET,
        SocketType::DGRAM,
        SocketFlags::CLOEXEC,
        None,
    )?;
    Ok(rustix::net::netdevice::index_to_name(&fd, index)?)
}

/// Whether this process may read its standard input without being stopped: it is not a
/// terminal, or this process's group is the terminal's foreground group (a background
/// group reading its terminal gets SIGTTIN, which stops it).
pub fn stdin_readable_here() -> bool {
    use std::io::IsTerminal;
    if !io::stdin().is_terminal() {
        return true;
    }
    // SAFETY: plain calls on descriptor 0 and this process; no memory is passed.
    let (fg, own) = unsafe { (libc::tcgetpgrp(0), libc::getpgrp()) };
    fg == own
}

/// Blocks SIGPIPE in the calling thread: a write of its to a pipe whose reader is gone
/// fails with EPIPE instead of ending the process (`default_sigpipe` made that the
/// process's default). The signal the kernel then directs at this thread stays pending
/// on it and goes with it.
pub fn block_sigpipe_in_this_thread() -> io::Result<()> {
    // SAFETY: a zeroed sigset_t is a valid argument to sigemptyset; both sets live on
    // this stack for the calls.
    unsafe {
        let mut set: libc::sigset_t = mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGPIPE);
        match libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) {
            0 => Ok(()),
            e => Err(io::Error::from_raw_os_error(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcp_counts_bytes_received_as_they_arrive_not_as_they_are_read() {
        use std::io::{Read, Write};
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut tx = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut rx, _) = l.accept().unwrap();
        assert_eq!(tcp_bytes_received(rx.as_fd()).unwrap(), 0);
        tx.write_all(&[7u8; 100_000]).unwrap();
        // Unread, on its way in over loopback.
        let t = std::time::Instant::now();
        while tcp_bytes_received(rx.as_fd()).unwrap() < 100_000 {
            assert!(t.elapsed().as_secs() < 10, "100,000 bytes not received");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(tcp_bytes_received(rx.as_fd()).unwrap(), 100_000);
        let mut buf = vec![0u8; 100_000];
        rx.read_exact(&mut buf).unwrap();
        assert_eq!(tcp_bytes_received(rx.as_fd()).unwrap(), 100_000);
        // The sender's own count is of what it received: nothing.
        assert_eq!(tcp_bytes_received(tx.as_fd()).unwrap(), 0);
        // Not a TCP socket: an error, not a count.
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        assert!(tcp_bytes_received(udp.as_fd()).is_err());
    }

    #[test]
    fn a_threads_cpu_time_grows_while_it_runs() {
        let (run0, _) = thread_cpu_ns().expect("schedstat (CONFIG_SCHED_INFO)");
        let t = std::time::Instant::now();
        let mut x = 0u64;
        while t.elapsed() < std::time::Duration::from_millis(20) {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        let (run1, _) = thread_cpu_ns().expect("schedstat");
        // 20 ms of wall time spinning: some of it on a CPU, however busy the box.
        assert!(run1 > run0, "{run0} -> {run1}");
        assert!(run1 - run0 <= 1_000_000_000, "{run0} -> {run1}");
    }

    #[test]
    fn a_stat_line_gives_state_and_group_whatever_the_command() {
        assert_eq!(
            stat_state_and_group("42 (sleep) S 1 42 42 0 -1 4194560 95 0"),
            Some(('S', 42))
        );
        assert_eq!(
            stat_state_and_group("43 (a) b) (c) Z 42 7 7 0"),
            Some(('Z', 7))
        );
        assert_eq!(stat_state_and_group("44 (x"), None);
        let me = rustix::process::getpgrp().as_raw_nonzero().get();
        assert!(group_members(me).contains(&(std::process::id() as i32)));
    }

    #[test]
    fn proc_stat_gives_all_ticks_and_steal() {
        let s = "cpu  100 5 50 800 10 1 4 30 0 0\ncpu0 50 2 25 400 5 0 2 15 0 0\nintr 1\n";
        let (all, steal) = parse_proc_stat(s).unwrap();
        assert_eq!((all, steal), (1000, 30));
        assert!((steal_share((1000, 30), (2000, 230)) - 0.2).abs() < 1e-12);
        // Old kernels without a steal column; then garbage.
        assert_eq!(parse_proc_stat("cpu  1 2 3 4\n").unwrap(), (10, 0));
        assert!(parse_proc_stat("cpu0 1 2 3 4\n").is_err());
        assert!(parse_proc_stat("cpu  1 x 3 4\n").is_err());
        assert_eq!(steal_share((5, 1), (5, 1)), 0.0);
        // Mentioned from 1 % on.
        assert_eq!(steal_note(0.2, |p| format!("{p:.0} %")), "20 %");
        assert_eq!(steal_note(0.009, |p| format!("{p:.0} %")), "");
    }

    #[test]
    fn schedstat_is_parsed_or_refused() {
        assert_eq!(parse_schedstat("123 45 6\n").unwrap(), (123, 45));
        assert!(parse_schedstat("123\n").is_err());
        assert!(parse_schedstat("a b c\n").is_err());
    }
}
