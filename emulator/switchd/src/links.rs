//! What a GPU's host does to its own interface that the fabric follows: its MTU, and
//! whether it is up. A real NIC sized for a lowered MTU drops longer frames as they
//! arrive, while a TUN takes whatever it is written; a NIC set down is a link the switch
//! sees go down, while a TUN set down only fails the writes into it. A netlink socket in
//! each GPU's namespace hears of the change when `ip link set cb0 mtu N` (or `down`)
//! makes it; the data plane tells the model: `Fabric::set_gpu_mtu`, whose port into that
//! GPU then drops longer frames as its NIC would (`over_mtu`), or the GPU's links down,
//! held by its host (`dataplane::layers`). The fabric sets the interface's carrier too
//! (off while every link of the GPU is down: `dataplane::Ports::set_carrier`), the same
//! flag as `ip link set cb0 carrier off`: the watch tells the two apart
//! (`LinkWatch::fabric_carrier`).

use std::io;
use std::os::fd::BorrowedFd;

use crate::sys::RouteSocket;

/// Receive buffer for link messages (an `RTM_NEWLINK` with its statistics and per-family
/// attributes is 1–2 KiB).
pub const BUF: usize = 16 << 10;

/// A change a GPU's host made to its interface.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostLink {
    /// Its MTU is now this.
    Mtu(u32),
    /// It is now in this state.
    State(IfState),
    /// Its root qdisc is now this one (`tc qdisc replace dev cb0 root …`: the host's, or
    /// closbox's own laid anew), or, with `None`, was deleted (`tc qdisc del dev cb0
    /// root`: the kernel's default in its place, which it does not announce).
    Root(Option<RootQdisc>),
}

/// An interface's root qdisc, as a notice of it says: its handle and kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RootQdisc {
    pub handle: u32,
    /// `TCA_KIND` (at most 15 bytes and a NUL, as the kernel's `IFNAMSIZ`).
    kind: [u8; 16],
}

impl RootQdisc {
    pub fn new(handle: u32, kind: &[u8]) -> RootQdisc {
        let mut k = [0u8; 16];
        let kind = kind.split(|&b| b == 0).next().unwrap_or(kind);
        let n = kind.len().min(15);
        k[..n].copy_from_slice(&kind[..n]);
        RootQdisc { handle, kind: k }
    }

    pub fn kind(&self) -> String {
        let n = self.kind.iter().position(|&b| b == 0).unwrap_or(16);
        String::from_utf8_lossy(&self.kind[..n]).into_owned()
    }
}

/// Whether a GPU's interface carries frames, as its host left it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IfState {
    Up,
    /// Set down (`ip link set cb0 down`).
    Down,
    /// Up, with its carrier off (`ip link set cb0 carrier off`): a NIC whose link is lost.
    NoCarrier,
    /// Deleted, or moved to another namespace: gone from the GPU's for good.
    Gone,
}

/// One GPU's interface, watched from inside its namespace.
#[derive(Debug)]
pub struct LinkWatch {
    sock: RouteSocket,
    index: u32,
    mtu: u32,
    state: IfState,
    /// The carrier the fabric gives the interface (`fabric_carrier`): off while every
    /// link of its GPU is down. A carrier off then is the fabric's doing, not the host's.
    fabric_carrier: bool,
    /// The sequence number of our last request (`RTM_GETLINK`), and whether its answer
    /// is still to come: what was heard before it is not taken (`fabric_carrier`).
    seq: u32,
    awaiting: bool,
    /// The last message heard said the carrier is on while the fabric has it off (its
    /// host set it on: `ip link set cb0 carrier on`).
    carrier_forced: bool,
    /// The root qdisc the last notice of one said (`None` before any).
    root: Option<Option<RootQdisc>>,
}

impl LinkWatch {
    /// Watches interface `name`, up and of MTU `mtu` now, in the calling thread's network
    /// namespace (opened where nothing else can change it meanwhile: the GPU's build).
    pub fn open(name: &str, mtu: u32) -> io::Result<LinkWatch> {
        let sock = RouteSocket::watch_links()?;
        let index = sock.if_index(name)?;
        sock.only_link(index)?;
        Ok(LinkWatch {
            sock,
            index,
            mtu,
            state: IfState::Up,
            fabric_carrier: true,
            seq: 0,
            awaiting: false,
            carrier_forced: false,
            root: None,
        })
    }

    /// The interface's index: it keeps it when its host renames it (`ip link set cb0
    /// name eth0`), so the daemon finds it by this, never by its name.
    pub fn index(&self) -> u32 {
        self.index
    }

    /// Asks for the interface's state now (an answer numbered `seq`).
    fn ask(&self) -> io::Result<()> {
        self.sock.send(&get_link(self.index, self.seq))
    }

    /// The fabric has just set the interface's carrier `on` or off (the GPU's links came
    /// up, or all went down: `sys::tun_set_carrier`). The kernel's notices of that come
    /// later, and any heard before now may tell of the carrier as it was before: read as
    /// the host's doing, a notice from before a link came back up would hold it down. So
    /// what was heard before is dropped and the state is asked for afresh (the kernel
    /// answers a request as it is made, behind what it had queued); `out` gets what
    /// differs from what was reported, as `drain`.
    pub fn fabric_carrier(
        &mut self,
        on: bool,
        buf: &mut [u8],
        out: &mut Vec<HostLink>,
    ) -> io::Result<()> {
        self.fabric_carrier = on;
        if self.state == IfState::Gone {
            return Ok(());
        }
        self.seq = self.seq.wrapping_add(1).max(1);
        self.awaiting = true;
        self.ask()?;
        self.drain(buf, out)
    }

    /// Whether the last message heard had the carrier on while the fabric has it off:
    /// the host set it on (`ip link set cb0 carrier on`), and the fabric sets it off again.
    pub fn carrier_forced_on(&self) -> bool {
        self.carrier_forced
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.sock.fd()
    }

    /// Reads what the kernel said since the last call (`buf`: scratch of `BUF` bytes) and
    /// adds to `out` what differs from what earlier calls reported: the interface's MTU,
    /// whether it is up (its carrier off is the host's doing only while the fabric has it
    /// on). Where messages were lost (the socket's buffer overflowed), asks again.
    pub fn drain(&mut self, buf: &mut [u8], out: &mut Vec<HostLink>) -> io::Result<()> {
        let mut latest = None;
        let mut root = None;
        loop {
            match self.sock.try_recv(buf) {
                Ok(Some(n)) => {
                    let (index, seq) = (self.index, self.seq);
                    let awaiting = &mut self.awaiting;
                    each_message(&buf[..n.min(buf.len())], index, |heard| match heard {
                        Heard::Root(q) => root = Some(q),
                        // Before the answer to our request: only a deletion counts.
                        Heard::Link(n, s) if *awaiting && n != seq && !s.deleted => {}
                        Heard::Link(n, s) => {
                            if n == seq {
                                *awaiting = false;
                            }
                            latest = Some(s);
                        }
                        Heard::Error(n) if n == seq => *awaiting = false,
                        Heard::Error(_) => {}
                    });
                }
                Ok(None) => break,
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => self.ask()?,
                Err(e) => return Err(e),
            }
        }
        if let Some(q) = root.filter(|q| self.root != Some(*q)) {
            self.root = Some(q);
            out.push(HostLink::Root(q));
        }
        let Some(s) = latest.filter(|_| self.state != IfState::Gone) else {
            return Ok(());
        };
        if let Some(m) = s.mtu.filter(|&m| m != self.mtu && !s.deleted) {
            self.mtu = m;
            out.push(HostLink::Mtu(m));
        }
        self.carrier_forced = !self.fabric_carrier && s.up && s.carrier;
        let state = match s.state() {
            // The fabric's own doing: to the host, the interface is up.
            IfState::NoCarrier if !self.fabric_carrier => IfState::Up,
            state => state,
        };
        if state != self.state {
            self.state = state;
            out.push(HostLink::State(state));
        }
        Ok(())
    }
}

/// What the last link message about an interface says of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinkState {
    /// Its MTU, where the message gives it.
    pub mtu: Option<u32>,
    /// Administratively up (`IFF_UP`).
    pub up: bool,
    /// With its carrier (`IFF_LOWER_UP`).
    pub carrier: bool,
    /// Deleted (`RTM_DELLINK`).
    pub deleted: bool,
}

impl LinkState {
    pub fn state(&self) -> IfState {
        match (self.deleted, self.up, self.carrier) {
            (true, ..) => IfState::Gone,
            (false, false, _) => IfState::Down,
            (false, true, false) => IfState::NoCarrier,
            (false, true, true) => IfState::Up,
        }
    }
}

/// An `RTM_GETLINK` request for interface `index`, numbered `seq`: a netlink header and
/// an `ifinfomsg`.
fn get_link(index: u32, seq: u32) -> [u8; 32] {
    let mut m = [0u8; 32];
    m[0..4].copy_from_slice(&32u32.to_ne_bytes());
    m[4..6].copy_from_slice(&libc::RTM_GETLINK.to_ne_bytes());
    m[6..8].copy_from_slice(&(libc::NLM_F_REQUEST as u16).to_ne_bytes());
    m[8..12].copy_from_slice(&seq.to_ne_bytes());
    // Port id 0 (the kernel's); ifinfomsg: family AF_UNSPEC, type 0, then the index.
    m[20..24].copy_from_slice(&index.to_ne_bytes());
    m
}

/// One message of a netlink datagram, as `each_message` reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Heard {
    /// An `RTM_NEWLINK` or `RTM_DELLINK` about the interface, with its sequence number
    /// (0 for the kernel's notices, a request's for its answer).
    Link(u32, LinkState),
    /// An error answering the request of this sequence number.
    Error(u32),
    /// An `RTM_NEWQDISC` (`Some`) or `RTM_DELQDISC` (`None`) of the interface's root.
    Root(Option<RootQdisc>),
}

/// What the last `RTM_NEWLINK` or `RTM_DELLINK` message about interface `index` in `buf`
/// (one netlink datagram, perhaps several messages) says; `None` if none is about it.
/// Short or malformed messages end the walk.
pub fn link_state(buf: &[u8], index: u32) -> Option<LinkState> {
    let mut found = None;
    each_message(buf, index, |h| {
        if let Heard::Link(_, s) = h {
            found = Some(s);
        }
    });
    found
}

/// Calls `f` with each message of `buf` (one netlink datagram) about interface `index`,
/// and each error, in order. Short or malformed messages end the walk.
fn each_message(buf: &[u8], index: u32, mut f: impl FnMut(Heard)) {
    const NLMSG_HDR: usize = 16;
    const IFINFOMSG: usize = 16;
    const TCMSG: usize = 20;
    const TC_H_ROOT: u32 = 0xFFFF_FFFF;
    const TCA_KIND: u16 = 1;
    let u16_at = |b: &[u8], i: usize| u16::from_ne_bytes([b[i], b[i + 1]]);
    let u32_at = |b: &[u8], i: usize| u32::from_ne_bytes(b[i..i + 4].try_into().expect("4"));
    let mut at = 0;
    while at + NLMSG_HDR <= buf.len() {
        let len = u32_at(buf, at) as usize;
        if len < NLMSG_HDR || at + len > buf.len() {
            break;
        }
        let msg = &buf[at..at + len];
        let kind = u16_at(msg, 4);
        let seq = u32_at(msg, 8);
        if kind == libc::NLMSG_ERROR as u16 {
            f(Heard::Error(seq));
        } else if (kind == libc::RTM_NEWQDISC || kind == libc::RTM_DELQDISC)
            && msg.len() >= NLMSG_HDR + TCMSG
            && u32_at(msg, NLMSG_HDR + 4) == index
            && u32_at(msg, NLMSG_HDR + 12) == TC_H_ROOT
        {
            // tcmsg: family, pads (3), ifindex (4), handle (4), parent (4), info (4).
            let handle = u32_at(msg, NLMSG_HDR + 8);
            let mut kind_attr: &[u8] = &[];
            let mut a = NLMSG_HDR + TCMSG;
            while a + 4 <= msg.len() {
                let alen = u16_at(msg, a) as usize;
                if alen < 4 || a + alen > msg.len() {
                    break;
                }
                if u16_at(msg, a + 2) & 0x3fff == TCA_KIND {
                    kind_attr = &msg[a + 4..a + alen];
                }
                a += (alen + 3) & !3;
            }
            f(Heard::Root(
                (kind == libc::RTM_NEWQDISC).then(|| RootQdisc::new(handle, kind_attr)),
            ));
        } else if (kind == libc::RTM_NEWLINK || kind == libc::RTM_DELLINK)
            && msg.len() >= NLMSG_HDR + IFINFOMSG
            && u32_at(msg, NLMSG_HDR + 4) == index
        {
            // ifinfomsg: family, pad, type (2), index (4), flags (4), change (4).
            let flags = u32_at(msg, NLMSG_HDR + 8);
            let deleted = kind == libc::RTM_DELLINK;
            let mut s = LinkState {
                mtu: None,
                up: !deleted && flags & libc::IFF_UP as u32 != 0,
                carrier: !deleted && flags & libc::IFF_LOWER_UP as u32 != 0,
                deleted,
            };
            let mut a = NLMSG_HDR + IFINFOMSG;
            while a + 4 <= msg.len() {
                let alen = u16_at(msg, a) as usize;
                if alen < 4 || a + alen > msg.len() {
                    break;
                }
                // The type's top bits are flags (nested, byte order).
                if u16_at(msg, a + 2) & 0x3fff == libc::IFLA_MTU && alen >= 8 {
                    s.mtu = Some(u32_at(msg, a + 4));
                }
                a += (alen + 3) & !3;
            }
            f(Heard::Link(seq, s));
        }
        at += (len + 3) & !3;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    /// The MTU that `link_state` reads.
    fn link_mtu(buf: &[u8], index: u32) -> Option<u32> {
        link_state(buf, index).and_then(|s| s.mtu)
    }

    /// An RTM_NEWLINK message for `index`, up, with the given (type, payload) attributes.
    fn newlink(index: u32, attrs: &[(u16, &[u8])]) -> Vec<u8> {
        message(libc::RTM_NEWLINK, index, libc::IFF_UP as u32, attrs)
    }

    fn message(kind: u16, index: u32, flags: u32, attrs: &[(u16, &[u8])]) -> Vec<u8> {
        let mut m = vec![0u8; 32];
        m[4..6].copy_from_slice(&kind.to_ne_bytes());
        m[20..24].copy_from_slice(&index.to_ne_bytes());
        m[24..28].copy_from_slice(&flags.to_ne_bytes());
        for (ty, data) in attrs {
            m.extend_from_slice(&((4 + data.len()) as u16).to_ne_bytes());
            m.extend_from_slice(&ty.to_ne_bytes());
            m.extend_from_slice(data);
            while m.len() % 4 != 0 {
                m.push(0);
            }
        }
        let len = m.len() as u32;
        m[0..4].copy_from_slice(&len.to_ne_bytes());
        m
    }

    #[test]
    fn the_mtu_of_the_watched_interface_is_read_from_link_messages() {
        let name: &[u8] = b"cb0\0";
        let a = newlink(
            7,
            &[
                (libc::IFLA_IFNAME, name),
                (libc::IFLA_MTU, &1000u32.to_ne_bytes()),
            ],
        );
        assert_eq!(link_mtu(&a, 7), Some(1000));
        // Another interface's, or none given: nothing.
        assert_eq!(link_mtu(&a, 8), None);
        assert_eq!(link_mtu(&newlink(7, &[(libc::IFLA_IFNAME, name)]), 7), None);
        // Several messages in one datagram: the last one about the interface wins.
        let mut two = a.clone();
        two.extend(newlink(7, &[(libc::IFLA_MTU, &9000u32.to_ne_bytes())]));
        two.extend(newlink(3, &[(libc::IFLA_MTU, &68u32.to_ne_bytes())]));
        assert_eq!(link_mtu(&two, 7), Some(9000));
        assert_eq!(link_mtu(&two, 3), Some(68));
        // Cut short anywhere, or with lengths that lie: no panic, no made-up value.
        for cut in 0..two.len() {
            let got = link_mtu(&two[..cut], 7);
            assert!(
                got.is_none() || got == Some(1000) || got == Some(9000),
                "{cut}: {got:?}"
            );
        }
        let mut liar = a.clone();
        liar[32..34].copy_from_slice(&200u16.to_ne_bytes());
        assert_eq!(link_mtu(&liar, 7), None);
        liar[0..4].copy_from_slice(&4u32.to_ne_bytes());
        assert_eq!(link_mtu(&liar, 7), None);
    }

    #[test]
    fn whether_the_interface_is_up_is_read_from_its_flags() {
        let mtu = 1500u32.to_ne_bytes();
        let attrs: &[(u16, &[u8])] = &[(libc::IFLA_MTU, &mtu)];
        let up = LinkState {
            mtu: Some(1500),
            up: true,
            carrier: true,
            deleted: false,
        };
        let up_flags = (libc::IFF_UP | libc::IFF_RUNNING | libc::IFF_LOWER_UP) as u32;
        let set_down = libc::IFF_POINTOPOINT as u32;
        let no_carrier = libc::IFF_UP as u32;
        let read = |kind, flags| link_state(&message(kind, 7, flags, attrs), 7).unwrap();
        assert_eq!(read(libc::RTM_NEWLINK, up_flags), up);
        assert_eq!(up.state(), IfState::Up);
        assert_eq!(read(libc::RTM_NEWLINK, set_down).state(), IfState::Down);
        assert_eq!(
            read(libc::RTM_NEWLINK, no_carrier).state(),
            IfState::NoCarrier
        );
        // Deleted: gone, whatever its flags said.
        let gone = link_state(&message(libc::RTM_DELLINK, 7, up_flags, &[]), 7);
        let deleted = LinkState {
            mtu: None,
            up: false,
            carrier: false,
            deleted: true,
        };
        assert_eq!(gone, Some(deleted));
        assert_eq!(deleted.state(), IfState::Gone);
        // Another kind of message about it (an address's): nothing.
        assert_eq!(
            link_state(&message(libc::RTM_NEWADDR, 7, 0, attrs), 7),
            None
        );
        // Down then up again in one datagram: the last one wins.
        let mut both = message(libc::RTM_NEWLINK, 7, set_down, attrs);
        both.extend(message(libc::RTM_NEWLINK, 7, up_flags, attrs));
        assert_eq!(link_state(&both, 7), Some(up));
    }

    /// Runs `body` on a thread in a network namespace of its own (root only: skipped
    /// otherwise), with `ip` (forked from that thread, so run in that namespace).
    fn in_own_netns(body: impl FnOnce(&dyn Fn(&str)) + Send + 'static) {
        if !crate::sys::is_root() {
            eprintln!("skipped: needs root (a network namespace)");
            return;
        }
        std::thread::spawn(|| {
            crate::sys::unshare_net().expect("unshare(net)");
            let ip = |args: &str| {
                let out = std::process::Command::new("ip")
                    .args(args.split(' '))
                    .output()
                    .expect("ip");
                assert!(out.status.success(), "ip {args}: {out:?}");
            };
            body(&ip);
        })
        .join()
        .expect("the test's thread");
    }

    /// In a network namespace of its own (root only: skipped otherwise), a watch hears of
    /// its interface's root qdisc as it is replaced and deleted, and of nothing else of
    /// traffic control: not its classes (the pacer's rate changes), not another
    /// interface's qdisc.
    #[test]
    fn a_watch_hears_of_its_root_qdisc_only() {
        in_own_netns(|ip| {
            let tc = |args: &str| {
                let out = std::process::Command::new("tc")
                    .args(args.split(' '))
                    .output()
                    .expect("tc");
                assert!(out.status.success(), "tc {args}: {out:?}");
            };
            ip("link add cbt0 type veth peer name cbt1");
            ip("link set cbt0 up");
            let mut w = LinkWatch::open("cbt0", 1500).expect("a watch of cbt0");
            let mut buf = vec![0u8; BUF];
            let mut heard = Vec::new();
            w.drain(&mut buf, &mut heard).expect("drain");
            heard.clear();
            tc("qdisc replace dev cbt0 root handle 1: htb default 1");
            w.drain(&mut buf, &mut heard).expect("drain");
            let htb = RootQdisc::new(0x1_0000, b"htb\0");
            assert_eq!(heard, [HostLink::Root(Some(htb))]);
            assert_eq!(htb.kind(), "htb");
            tc("class add dev cbt0 parent 1: classid 1:1 htb rate 1mbit");
            tc("class change dev cbt0 parent 1: classid 1:1 htb rate 2mbit");
            tc("qdisc replace dev cbt1 root tbf rate 1mbit burst 32k latency 10ms");
            assert_eq!(w.sock.try_recv(&mut buf).expect("recv"), None);
            heard.clear();
            tc("qdisc replace dev cbt0 root tbf rate 1mbit burst 32k latency 10ms");
            w.drain(&mut buf, &mut heard).expect("drain");
            match heard.as_slice() {
                [HostLink::Root(Some(q))] => assert_eq!(q.kind(), "tbf"),
                other => panic!("{other:?}"),
            }
            heard.clear();
            tc("qdisc del dev cbt0 root");
            w.drain(&mut buf, &mut heard).expect("drain");
            assert_eq!(heard, [HostLink::Root(None)]);
        });
    }

    /// In a network namespace of its own (root only: skipped otherwise), a watch of `lo`
    /// hears of `lo` and of nothing about another interface, however often it changes.
    #[test]
    fn a_watch_hears_of_its_interface_only() {
        in_own_netns(|ip| {
            // Up, as a GPU's interface is when its watch opens.
            ip("link set lo up");
            let mut w = LinkWatch::open("lo", 65536).expect("a watch of lo");
            ip("link add cbt0 type veth peer name cbt1");
            for mtu in [1400, 1500, 1400, 9000] {
                ip(&format!("link set cbt0 mtu {mtu}"));
            }
            ip("link set cbt1 up");
            let mut buf = vec![0u8; BUF];
            let mut heard = Vec::new();
            // Nothing queued for the watch: the other interface's news were dropped.
            assert_eq!(w.sock.try_recv(&mut buf).expect("recv"), None);
            ip("link set lo mtu 1500");
            w.drain(&mut buf, &mut heard).expect("drain");
            assert_eq!(heard, [HostLink::Mtu(1500)]);
            ip("link set lo down");
            heard.clear();
            w.drain(&mut buf, &mut heard).expect("drain");
            assert_eq!(heard, [HostLink::State(IfState::Down)]);
        });
    }

    /// In a network namespace of its own (root only), with a real TUN: the carrier the
    /// fabric sets off is not its host's, even when the kernel's notice of an earlier
    /// change is still queued; the host's own carrier changes are.
    #[test]
    fn a_carrier_the_fabric_sets_is_not_the_hosts() {
        in_own_netns(|ip| {
            let tun = crate::sys::tun_create("cbt0", false).expect("a TUN");
            ip("link set cbt0 up");
            let mut w = LinkWatch::open("cbt0", 1500).expect("a watch");
            let mut buf = vec![0u8; BUF];
            let mut heard = Vec::new();
            // The kernel tells of a carrier change up to a second later (linkwatch).
            let settle = |w: &mut LinkWatch, heard: &mut Vec<HostLink>, buf: &mut [u8]| {
                heard.clear();
                let until = std::time::Instant::now() + std::time::Duration::from_millis(1300);
                while std::time::Instant::now() < until {
                    w.drain(buf, heard).expect("drain");
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
            };
            let fabric =
                |w: &mut LinkWatch, on: bool, heard: &mut Vec<HostLink>, buf: &mut [u8]| {
                    crate::sys::tun_set_carrier(tun.as_fd(), on).expect("TUNSETCARRIER");
                    heard.clear();
                    w.fabric_carrier(on, buf, heard).expect("fabric_carrier");
                };
            fabric(&mut w, false, &mut heard, &mut buf);
            assert!(heard.is_empty(), "{heard:?}");
            settle(&mut w, &mut heard, &mut buf);
            assert!(heard.is_empty(), "{heard:?}");
            // Off, its notice left queued, then on: the stale notice is not the host's.
            crate::sys::tun_set_carrier(tun.as_fd(), true).expect("on");
            w.fabric_carrier = true;
            fabric(&mut w, false, &mut heard, &mut buf);
            std::thread::sleep(std::time::Duration::from_millis(1500));
            fabric(&mut w, true, &mut heard, &mut buf);
            assert!(heard.is_empty(), "{heard:?}");
            settle(&mut w, &mut heard, &mut buf);
            assert!(heard.is_empty(), "{heard:?}");
            // The host's carrier off and on are its own.
            ip("link set cbt0 carrier off");
            settle(&mut w, &mut heard, &mut buf);
            assert_eq!(heard, [HostLink::State(IfState::NoCarrier)]);
            ip("link set cbt0 carrier on");
            settle(&mut w, &mut heard, &mut buf);
            assert_eq!(heard, [HostLink::State(IfState::Up)]);
            // Its carrier on while the fabric has it off: said, for the fabric to undo.
            fabric(&mut w, false, &mut heard, &mut buf);
            assert!(!w.carrier_forced_on());
            ip("link set cbt0 carrier on");
            settle(&mut w, &mut heard, &mut buf);
            assert!(heard.is_empty(), "{heard:?}");
            assert!(w.carrier_forced_on());
        });
    }

    #[test]
    fn the_request_asks_for_one_interface() {
        let r = get_link(42, 7);
        assert_eq!(u32::from_ne_bytes(r[0..4].try_into().unwrap()), 32);
        assert_eq!(u16::from_ne_bytes([r[4], r[5]]), libc::RTM_GETLINK);
        assert_eq!(u32::from_ne_bytes(r[8..12].try_into().unwrap()), 7);
        assert_eq!(u32::from_ne_bytes(r[20..24].try_into().unwrap()), 42);
    }
}
