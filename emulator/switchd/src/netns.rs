//! GPU namespaces: a network namespace (compatible with `ip netns`), a TUN interface with
//! the GPU's address, and an /etc/netns hosts file. (Its hostname is set in each process
//! that enters it: `sys::EnterGpu`.)
//!
//! Each GPU is built by a short-lived thread that unshares into a fresh namespace, pins
//! it with a bind mount, and creates and configures its TUN with ioctls from inside.
//! No `ip` process is forked and no interface is moved between namespaces (a move costs
//! ~16 ms; this costs well under 1 ms per GPU).

use std::fs;
use std::io::{self, Write as _};
use std::os::fd::OwnedFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::thread;

use anyhow::Context;
use closbox_fabric::topology::SwitchId;
use closbox_fabric::Topology;

use crate::links::LinkWatch;
use crate::state::{GpuState, State, NETNS_DIR};
use crate::sys;

/// Transmit queue of each TUN (packets the kernel holds for the daemon to read).
const TUN_TXQUEUELEN: u32 = 8192;
/// GPUs set up at once.
const PARALLEL: usize = 4;

/// Makes /run/netns a shared mount point as `ip netns add` does, so that namespace mounts
/// made here are seen by tools in other mount namespaces.
fn prepare_netns_dir() -> anyhow::Result<()> {
    let dir = Path::new(NETNS_DIR);
    fs::create_dir_all(dir).with_context(|| format!("creating {NETNS_DIR}"))?;
    if sys::make_shared(dir).is_err() {
        sys::bind_mount(dir, dir)
            .with_context(|| format!("bind-mounting {NETNS_DIR} on itself"))?;
        sys::make_shared(dir).with_context(|| format!("making {NETNS_DIR} shared"))?;
    }
    Ok(())
}

/// An empty file to bind-mount a namespace on; it must not exist yet.
fn mount_point(path: &Path) -> anyhow::Result<()> {
    fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o444)
        .open(path)
        .map(drop)
        .with_context(|| format!("creating {}", path.display()))
}

/// Builds one GPU in the calling thread, which it leaves in the GPU's namespaces.
fn build_gpu(state: &State, g: &GpuState, mtu: u32, offload: bool) -> anyhow::Result<Built> {
    let netns = g.netns_path();
    mount_point(&netns)?;
    sys::unshare_net().context("unshare(net)")?;
    sys::bind_mount(Path::new("/proc/thread-self/ns/net"), &netns)
        .with_context(|| format!("pinning {}", netns.display()))?;
    sys::if_configure("lo", None, None, None).context("bringing lo up")?;
    let tun =
        sys::tun_create(&state.tun, offload).context("creating TUN (is /dev/net/tun there?)")?;
    // The GPUs' TCP, as the topology file asks (these sysctls are per namespace).
    // A new namespace starts with the host's default; the kernel lets a namespace pick
    // only algorithms the host lists in tcp_allowed_congestion_control.
    if let Some(want) = &state.tcp_congestion {
        let cc = "/proc/sys/net/ipv4/tcp_congestion_control";
        if fs::read_to_string(cc).unwrap_or_default().trim() != want {
            fs::write(cc, want).map_err(|e| {
                let allowed = fs::read_to_string("/proc/sys/net/ipv4/tcp_allowed_congestion_control").unwrap_or_default();
                anyhow::anyhow!(
                    "tcp_congestion = {want:?}: {e}; a GPU namespace may use only what the host allows ({}), see net.ipv4.tcp_allowed_congestion_control",
                    allowed.trim()
                )
            })?;
        }
    }
    fs::write(
        "/proc/sys/net/ipv4/tcp_ecn",
        if state.tcp_ecn { "1" } else { "2" },
    )
    .context("writing tcp_ecn")?;
    let idle = if state.tcp_slow_start_after_idle {
        "1"
    } else {
        "0"
    };
    fs::write("/proc/sys/net/ipv4/tcp_slow_start_after_idle", idle)
        .context("writing tcp_slow_start_after_idle")?;
    // Sockets start with their largest buffers (the maxima stay the host's): a
    // collective's connection carries a block at a time, often fewer round trips than
    // receive and send buffer autotuning take to grow from 128 KiB and 16 KiB, and the
    // predictions assume windows that do not limit it (1:1 AllToAll 8 MiB on default.toml:
    // 1.07-1.24 x the model with the host's start, 0.93-1.06 x with this; docs/design.md).
    for key in ["tcp_rmem", "tcp_wmem"] {
        let path = format!("/proc/sys/net/ipv4/{key}");
        let now = fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
        let v: Vec<&str> = now.split_whitespace().collect();
        if let [min, _, max] = v[..] {
            fs::write(&path, format!("{min} {max} {max}"))
                .with_context(|| format!("writing {path}"))?;
        }
    }
    // The fabric carries IPv4 only: keep the kernel's IPv6 chatter off the TUN. The
    // namespace's default too: an MTU set below 1,280 and back makes the kernel give the
    // interface a new IPv6 configuration, from the default (lo keeps its ::1).
    for dev in ["default", state.tun.as_str()] {
        let v6 = format!("/proc/sys/net/ipv6/conf/{dev}/disable_ipv6");
        if Path::new(&v6).exists() {
            fs::write(&v6, "1").with_context(|| format!("writing {v6}"))?;
        }
    }
    sys::if_configure(
        &state.tun,
        Some((g.addr, state.prefix_len)),
        Some(mtu),
        Some(TUN_TXQUEUELEN),
    )
    .with_context(|| format!("configuring {}", state.tun))?;
    let watch = LinkWatch::open(&state.tun, mtu)
        .with_context(|| format!("watching {}'s MTU", state.tun))?;
    Ok((tun, watch))
}

/// Each GPU's /etc/hosts (the GPUs, and the switches by the addresses their ICMP errors
/// come from: `traceroute` and `ping -t` name the hop) and /etc/hostname.
fn write_etc(state: &State, topo: &Topology) -> anyhow::Result<()> {
    let mut text = String::from("# written by closbox for fabric ");
    text += state.fabric.as_str();
    text += "\n127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n";
    for g in &state.gpus {
        text += &format!("{}\t{}\n", g.addr, g.name);
    }
    for (i, sw) in topo.switches.iter().enumerate() {
        if let Some(a) = topo.switch_addr(SwitchId(i as u32)) {
            text += &format!("{a}\t{}\n", sw.name);
        }
    }
    for g in &state.gpus {
        fs::create_dir_all(g.etc_dir())
            .with_context(|| format!("creating {}", g.etc_dir().display()))?;
        let mut f = fs::File::create(g.hosts_path())?;
        f.write_all(text.as_bytes())?;
        fs::write(g.hostname_path(), format!("{}\n", g.name))
            .with_context(|| format!("writing {}", g.hostname_path().display()))?;
    }
    Ok(())
}

/// Creates every GPU of `state` (which must already be saved); returns the TUN fds in GPU
/// order. On error, what was created stays recorded in the state for removal.
/// A GPU built: its TUN, and a watch on its interface (`links`).
type Built = (OwnedFd, LinkWatch);

/// Builds every GPU, in GPU order.
pub fn create_all(
    state: &State,
    topo: &Topology,
    offload: bool,
) -> anyhow::Result<(Vec<OwnedFd>, Vec<LinkWatch>)> {
    let mtu = topo.fabric.mtu;
    prepare_netns_dir()?;
    crate::state::prepare_fabric_dir(&state.fabric)?;
    write_etc(state, topo)?;
    let mut built: Vec<Option<Built>> = (0..state.gpus.len()).map(|_| None).collect();
    let chunk = state.gpus.len().div_ceil(PARALLEL).max(1);
    let results: Vec<anyhow::Result<Vec<(usize, Built)>>> = thread::scope(|s| {
        let handles: Vec<_> = (0..state.gpus.len())
            .step_by(chunk)
            .map(|start| {
                s.spawn(move || {
                    let mut out = Vec::new();
                    for i in start..(start + chunk).min(state.gpus.len()) {
                        let g = &state.gpus[i];
                        // A fresh thread per GPU: unshare moves the thread for good.
                        let fd = thread::scope(|inner| {
                            inner.spawn(|| build_gpu(state, g, mtu, offload)).join()
                        })
                        .map_err(|_| anyhow::anyhow!("GPU setup thread panicked"))?
                        .with_context(|| format!("setting up {}", g.name))?;
                        tracing::debug!("{}: namespace {} ready", g.name, g.netns);
                        out.push((i, fd));
                    }
                    Ok(out)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("worker joins"))
            .collect()
    });
    for r in results {
        for (i, gpu) in r? {
            built[i] = Some(gpu);
        }
    }
    Ok(built
        .into_iter()
        .map(|t| t.expect("every GPU built"))
        .unzip())
}

/// Opens a GPU's namespaces for entering (exec/run), checking they exist.
pub fn open_gpu(state: &State, g: &GpuState) -> anyhow::Result<sys::EnterGpu> {
    let open = |p: &Path| -> anyhow::Result<OwnedFd> {
        Ok(fs::File::open(p)
            .with_context(|| format!("{} is missing: is fabric {} up?", p.display(), state.fabric))?
            .into())
    };
    let net = open(&g.netns_path())?;
    Ok(sys::EnterGpu::new(
        net,
        &g.name,
        &g.hosts_path(),
        &g.hostname_path(),
    )?)
}

/// A GPU's TUN drop counters, from its kernel.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TunDrops {
    /// Sent by the GPU, dropped before the daemon read them (its queue was full).
    pub tx: u64,
    /// Written by the daemon (delivered), dropped by the GPU's kernel: the interface down,
    /// its backlog full.
    pub rx: u64,
    /// UDP datagrams the GPU's kernel dropped at a receiving socket whose buffer was full
    /// (`RcvbufErrors` of `Udp` in its `/proc/net/snmp`; of the whole namespace, so also
    /// those that went over `lo`): the program read too slowly, the fabric had delivered
    /// them. `None` where the file could not be read.
    pub udp_rcvbuf: Option<u64>,
    /// Its TCP now: congestion control and `tcp_ecn` (per namespace: the fabric sets them
    /// at `up`, and the GPU's host, root there, may change them). `None` where unread.
    pub tcp: Option<(String, u8)>,
}

/// TUNs that a process in their GPU moved out of its namespace (`ip link set cb0 netns
/// 1`, which root in a GPU may do), made to go with their descriptor: the others go with
/// their namespaces at teardown, these would outlive it (persistent, in another
/// namespace). Each such GPU, with the error if it could not be done. `tuns[i]` is GPU
/// `i`'s; a device already deleted is skipped.
pub fn moved_tuns(state: &State, tuns: &[OwnedFd]) -> Vec<(String, Option<String>)> {
    use std::os::fd::AsFd;
    let mut moved = Vec::new();
    for (g, tun) in state.gpus.iter().zip(tuns) {
        let (Ok(now), Ok(home)) = (sys::tun_netns(tun.as_fd()), sys::netns_id(&g.netns_path()))
        else {
            continue;
        };
        if now != home {
            let err = sys::tun_not_persistent(tun.as_fd()).err();
            moved.push((g.name.clone(), err.map(|e| e.to_string())));
        }
    }
    moved
}

/// Reads the TUN's kernel-side drop counters of every GPU in `gpus` (interface
/// `ifindex[i]` of GPU `i`; none where it is gone), from inside each one's namespace: one
/// thread enters them in turn (a thread per GPU cost a status of
/// 1,024 GPUs ~0.5 s, and made the daemon map and unmap a stack for each).
/// With `tcp`, also each GPU's TCP settings (`TunDrops::tcp`; ~60 µs a GPU more).
pub fn tun_dropped(
    gpus: &[GpuState],
    ifindex: &[u32],
    tcp: bool,
) -> io::Result<Vec<Option<TunDrops>>> {
    thread::scope(|s| {
        s.spawn(|| {
            gpus.iter()
                .zip(ifindex)
                .map(|(g, &i)| {
                    use std::os::fd::AsFd;
                    let ns = fs::File::open(g.netns_path())?;
                    sys::enter_netns(ns.as_fd())?;
                    // By its index: its host may have renamed it, or deleted it (then
                    // none: its counters went with it).
                    let Ok(name) = sys::if_name(i) else {
                        return Ok(None);
                    };
                    let dev = fs::read_to_string("/proc/thread-self/net/dev")?;
                    let udp_rcvbuf = fs::read_to_string("/proc/thread-self/net/snmp")
                        .ok()
                        .and_then(|t| parse_udp_rcvbuf_errors(&t));
                    // (Net sysctls are those of the reading thread's namespace.)
                    let tcp = if tcp {
                        read_tcp_sysctls().ok().flatten()
                    } else {
                        None
                    };
                    Ok(parse_tun_drops(&dev, &name).map(|d| TunDrops {
                        udp_rcvbuf,
                        tcp,
                        ..d
                    }))
                })
                .collect()
        })
        .join()
        .map_err(|_| io::Error::other("thread panicked"))?
    })
}

/// The calling thread's namespace's TCP congestion control and `tcp_ecn` (net sysctls are
/// those of the reading thread's namespace). Both files are opened from their directory:
/// the walk to `/proc/sys/net/ipv4` is what costs in a namespace just entered (~60 µs a
/// path; a status of 1,024 GPUs read them in 125 ms by full paths).
fn read_tcp_sysctls() -> io::Result<Option<(String, u8)>> {
    use rustix::fs::{openat, Mode, OFlags};
    let dir = openat(
        rustix::fs::CWD,
        "/proc/sys/net/ipv4",
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let read = |name: &str| -> io::Result<String> {
        let fd = openat(&dir, name, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())?;
        let mut buf = [0u8; 64];
        let n = rustix::io::read(&fd, &mut buf)?;
        Ok(String::from_utf8_lossy(&buf[..n]).trim().to_owned())
    };
    let cc = read("tcp_congestion_control")?;
    Ok(read("tcp_ecn")?.parse().ok().map(|ecn| (cc, ecn)))
}

/// The drop counters of interface `tun` in `/proc/net/dev`'s text.
fn parse_tun_drops(dev: &str, tun: &str) -> Option<TunDrops> {
    // "  cb0: rx_bytes rx_packets rx_errs rx_drop ... | tx_bytes tx_packets tx_errs tx_drop ..."
    dev.lines().find_map(|l| {
        let (name, rest) = l.split_once(':')?;
        let field = |i| rest.split_whitespace().nth(i)?.parse().ok();
        (name.trim() == tun).then(|| {
            Some(TunDrops {
                tx: field(11)?,
                rx: field(3)?,
                udp_rcvbuf: None,
                tcp: None,
            })
        })?
    })
}

/// `RcvbufErrors` of the `Udp` table in `/proc/net/snmp`'s text (a line of names, then a
/// line of values, both starting `Udp:`; `UdpLite:` is another table).
fn parse_udp_rcvbuf_errors(snmp: &str) -> Option<u64> {
    let mut udp = snmp.lines().filter(|l| l.starts_with("Udp: "));
    let names = udp.next()?;
    let values = udp.next()?;
    let i = names.split_whitespace().position(|n| n == "RcvbufErrors")?;
    values.split_whitespace().nth(i)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tun_drops_are_read_from_proc_net_dev() {
        let dev = "\
Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo:       0       0    0    0    0     0          0         0        0       0    0    0    0     0       0          0
   cb0: 9876543   12345    0    7    0     0          0         0  1234567    4321    0   42    0     0       0          0
";
        assert_eq!(
            parse_tun_drops(dev, "cb0"),
            Some(TunDrops {
                tx: 42,
                rx: 7,
                udp_rcvbuf: None,
                tcp: None,
            })
        );
        assert_eq!(parse_tun_drops(dev, "cb1"), None);
        assert_eq!(parse_tun_drops("   cb0: 1 2 3\n", "cb0"), None);
    }

    #[test]
    fn udp_receive_buffer_drops_are_read_from_proc_net_snmp() {
        let snmp = "\
Ip: Forwarding DefaultTTL InReceives
Ip: 2 64 215000
Udp: InDatagrams NoPorts InErrors OutDatagrams RcvbufErrors SndbufErrors InCsumErrors IgnoredMulti MemErrors
Udp: 214813 0 31245 5 31244 0 1 0 0
UdpLite: InDatagrams NoPorts InErrors OutDatagrams RcvbufErrors SndbufErrors InCsumErrors IgnoredMulti MemErrors
UdpLite: 0 0 0 0 7 0 0 0 0
";
        assert_eq!(parse_udp_rcvbuf_errors(snmp), Some(31244));
        assert_eq!(parse_udp_rcvbuf_errors("Ip: Forwarding\nIp: 1\n"), None);
        assert_eq!(parse_udp_rcvbuf_errors("Udp: RcvbufErrors\n"), None);
    }
}
