//! The offload baseline of `make bench-live`: the least a TUN-based fabric can do on this
//! box. Two network namespaces (made by the caller, e.g. `ip netns add`), a TUN in each
//! with the virtio-net header and TSO (64 KiB super-packets), and one thread per direction
//! copying whatever one TUN hands over into the other, headers untouched. No model, no
//! queues, no timing: a copy loop.
//!
//! With `--one-thread`, one thread does both directions as closbox's data plane does:
//! non-blocking reads of whatever is ready, after a `poll` of both TUNs. On the 2-core dev
//! VM this is the faster relay (no thread sleeps and is woken per packet), so it is the
//! baseline closbox's own loop is held to.
//!
//! Usage: tun_relay NETNS_A ADDR_A NETNS_B ADDR_B MTU [--one-thread]   (runs until killed)

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::Arc;

use closbox_switchd::sys;

fn side(netns: &str, addr: std::net::Ipv4Addr, mtu: u32) -> std::io::Result<OwnedFd> {
    let ns = std::fs::File::open(format!("/run/netns/{netns}"))?;
    sys::enter_netns(ns.as_fd())?;
    let tun = sys::tun_create_offload("relay0")?;
    sys::if_configure("relay0", Some((addr, 24)), Some(mtu), Some(1000))?;
    Ok(tun)
}

fn main() -> std::io::Result<()> {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let one_thread = a.len() == 6 && a[5] == "--one-thread";
    if a.len() != 5 && !one_thread {
        eprintln!("usage: tun_relay NETNS_A ADDR_A NETNS_B ADDR_B MTU [--one-thread]");
        std::process::exit(2);
    }
    let mtu: u32 = a[4].parse().expect("mtu");
    let parse = |s: &str| s.parse::<std::net::Ipv4Addr>().expect("IPv4 address");
    // Each TUN is made by a thread inside its namespace; the fds work from anywhere.
    let (na, aa, nb, ab) = (a[0].clone(), parse(&a[1]), a[2].clone(), parse(&a[3]));
    let ta = std::thread::spawn(move || side(&na, aa, mtu))
        .join()
        .expect("thread")?;
    let tb = std::thread::spawn(move || side(&nb, ab, mtu))
        .join()
        .expect("thread")?;
    if one_thread {
        eprintln!("tun_relay: relaying (one thread)");
        return relay_one_thread(&ta, &tb);
    }
    let (ta, tb) = (Arc::new(ta), Arc::new(tb));
    let copy = |from: Arc<OwnedFd>, to: Arc<OwnedFd>| {
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 65_536 + 10];
            loop {
                // Blocking reads: the TUNs were opened without O_NONBLOCK.
                let n = match rustix::io::read(from.as_fd(), &mut buf) {
                    Ok(n) => n,
                    Err(e) => {
                        eprintln!("read fd {}: {e}", from.as_raw_fd());
                        return;
                    }
                };
                let _ = sys::write_packet(to.as_fd(), &buf[..n]);
            }
        })
    };
    let x = copy(Arc::clone(&ta), Arc::clone(&tb));
    let y = copy(tb, ta);
    eprintln!("tun_relay: relaying");
    let _ = x.join();
    let _ = y.join();
    Ok(())
}

/// Both directions on this thread: wait until either TUN has something, then copy what
/// each has until it has nothing more.
fn relay_one_thread(ta: &OwnedFd, tb: &OwnedFd) -> std::io::Result<()> {
    use rustix::event::{poll, PollFd, PollFlags};
    for fd in [ta, tb] {
        rustix::io::ioctl_fionbio(fd, true)?;
    }
    let mut buf = vec![0u8; 65_536 + 10];
    loop {
        let mut fds = [
            PollFd::new(ta, PollFlags::IN),
            PollFd::new(tb, PollFlags::IN),
        ];
        poll(&mut fds, None)?;
        for (from, to) in [(ta, tb), (tb, ta)] {
            while let Some(n) = sys::read_packet(from.as_fd(), &mut buf)? {
                let _ = sys::write_packet(to.as_fd(), &buf[..n]);
            }
        }
    }
}
