//! A group of ranks joined by TCP: every pair connected once per channel.
//!
//! Rendezvous is a static peer list (`closbox run` exports it as `CLOSBOX_PEERS`): rank r
//! listens on its own address and connects to every lower rank; a hello names the rank
//! and channel of each connection. Channels are independent TCP connections, so that
//! ECMP can put them on different paths and collectives can run them in parallel.
//!
//! Failure: a peer that dies closes its connections and every rank talking to it gets an
//! error naming it at once; a peer that hangs trips the read timeout. Errors cascade, so
//! no rank waits forever.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};

/// How a group is formed.
#[derive(Clone, Debug)]
pub struct GroupConfig {
    pub rank: usize,
    /// `host:port` of every rank, in rank order.
    pub peers: Vec<String>,
    /// TCP connections per pair of ranks.
    pub channels: usize,
    /// Longest wait for a peer's data (and for the group to form).
    pub timeout: Duration,
}

pub struct Group {
    rank: usize,
    size: usize,
    channels: usize,
    peers: Vec<String>,
    /// conns[peer][channel]; `None` for self.
    conns: Vec<Vec<Option<TcpStream>>>,
    /// Bytes sent to each peer (collectives' payload; the barrier's bytes too).
    sent: Vec<AtomicU64>,
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("channels", &self.channels)
            .finish()
    }
}

const MAGIC: u32 = 0xC105_B0C5;

/// One rank's end of one connection. With the fabric's ECMP hash, `local → remote` names
/// the path this rank's data to `peer` on `channel` takes (`closbox bench` predicts with
/// the paths a run really got).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Endpoint {
    pub peer: usize,
    pub channel: usize,
    pub local: SocketAddr,
    pub remote: SocketAddr,
}

/// What every agent prints once its group has formed (one JSON line on stdout).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Endpoints {
    pub rank: usize,
    pub endpoints: Vec<Endpoint>,
}

fn resolve(addr: &str) -> anyhow::Result<SocketAddr> {
    addr.to_socket_addrs()
        .with_context(|| format!("resolving {addr}"))?
        .find(|a| a.is_ipv4())
        .with_context(|| format!("{addr} has no IPv4 address"))
}

impl Group {
    pub fn connect(cfg: &GroupConfig) -> anyhow::Result<Group> {
        let size = cfg.peers.len();
        let (rank, channels) = (cfg.rank, cfg.channels.max(1));
        if rank >= size {
            bail!("rank {rank} is outside a group of {size}");
        }
        let deadline = Instant::now() + cfg.timeout;
        let me = resolve(&cfg.peers[rank])?;
        let listener =
            bind_retry(me, deadline).with_context(|| format!("rank {rank}: listening on {me}"))?;
        let mut conns: Vec<Vec<Option<TcpStream>>> = (0..size)
            .map(|_| (0..channels).map(|_| None).collect())
            .collect();
        // Connect to every lower rank, once per channel.
        for (peer, addr) in cfg.peers.iter().enumerate().take(rank) {
            let target = resolve(addr)?;
            for (ch, slot) in conns[peer].iter_mut().enumerate() {
                let mut s = connect_retry(target, deadline)
                    .with_context(|| format!("rank {rank}: connecting to rank {peer} ({addr})"))?;
                let mut hello = [0u8; 12];
                hello[..4].copy_from_slice(&MAGIC.to_le_bytes());
                hello[4..8].copy_from_slice(&(rank as u32).to_le_bytes());
                hello[8..].copy_from_slice(&(ch as u32).to_le_bytes());
                s.write_all(&hello)?;
                *slot = Some(s);
            }
        }
        // Accept every higher rank's connections.
        listener.set_nonblocking(true)?;
        let mut expected = (size - rank - 1) * channels;
        while expected > 0 {
            match listener.accept() {
                Ok((mut s, _)) => {
                    s.set_nonblocking(false)?;
                    s.set_read_timeout(Some(cfg.timeout))?;
                    let mut hello = [0u8; 12];
                    s.read_exact(&mut hello).context("reading a peer's hello")?;
                    let magic = u32::from_le_bytes(hello[..4].try_into().expect("4"));
                    let peer = u32::from_le_bytes(hello[4..8].try_into().expect("4")) as usize;
                    let ch = u32::from_le_bytes(hello[8..].try_into().expect("4")) as usize;
                    if magic != MAGIC
                        || peer <= rank
                        || peer >= size
                        || ch >= channels
                        || conns[peer][ch].is_some()
                    {
                        bail!("rank {rank}: unexpected connection (peer {peer}, channel {ch}): is another job using this port?");
                    }
                    conns[peer][ch] = Some(s);
                    expected -= 1;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if Instant::now() > deadline {
                        let missing: Vec<usize> = (rank + 1..size)
                            .filter(|p| conns[*p].iter().any(Option::is_none))
                            .collect();
                        bail!(
                            "rank {rank}: ranks {missing:?} did not connect within {:?}",
                            cfg.timeout
                        );
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(e.into()),
            }
        }
        for s in conns.iter().flatten().flatten() {
            s.set_nodelay(true)?;
            s.set_read_timeout(Some(cfg.timeout))?;
            s.set_write_timeout(Some(cfg.timeout))?;
        }
        Ok(Group {
            rank,
            size,
            channels,
            peers: cfg.peers.clone(),
            conns,
            sent: (0..size).map(|_| AtomicU64::new(0)).collect(),
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    pub fn channels(&self) -> usize {
        self.channels
    }

    /// Every connection of this rank, by peer then channel.
    pub fn endpoints(&self) -> io::Result<Vec<Endpoint>> {
        let mut out = Vec::new();
        for (peer, chans) in self.conns.iter().enumerate() {
            for (channel, s) in chans.iter().enumerate() {
                if let Some(s) = s {
                    out.push(Endpoint {
                        peer,
                        channel,
                        local: s.local_addr()?,
                        remote: s.peer_addr()?,
                    });
                }
            }
        }
        Ok(out)
    }

    fn stream(&self, peer: usize, ch: usize) -> &TcpStream {
        self.conns[peer][ch % self.channels]
            .as_ref()
            .unwrap_or_else(|| panic!("rank {} has no connection to rank {peer}", self.rank))
    }

    fn lost(&self, peer: usize, what: &str, e: io::Error) -> anyhow::Error {
        let why = match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => "timed out".to_owned(),
            io::ErrorKind::UnexpectedEof => "connection closed (did it exit?)".to_owned(),
            _ => e.to_string(),
        };
        anyhow::anyhow!(
            "rank {}: {what} rank {peer} ({}): {why}",
            self.rank,
            self.peers[peer]
        )
    }

    pub fn send(&self, peer: usize, ch: usize, buf: &[u8]) -> anyhow::Result<()> {
        let mut s = self.stream(peer, ch);
        s.write_all(buf)
            .map_err(|e| self.lost(peer, "sending to", e))?;
        self.sent[peer].fetch_add(buf.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Sends what the socket accepts without blocking (none of it if it is full): the
    /// number of bytes sent.
    pub(crate) fn send_ready(&self, peer: usize, ch: usize, buf: &[u8]) -> anyhow::Result<usize> {
        use rustix::net::SendFlags;
        let stream = self.stream(peer, ch);
        let mut off = 0;
        while off < buf.len() {
            match rustix::net::send(
                stream,
                &buf[off..],
                SendFlags::DONTWAIT | SendFlags::NOSIGNAL,
            ) {
                Ok(0) => break,
                Ok(r) => off += r,
                Err(rustix::io::Errno::AGAIN) => break,
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(self.lost(peer, "sending to", e.into())),
            }
        }
        self.sent[peer].fetch_add(off as u64, Ordering::Relaxed);
        Ok(off)
    }

    /// Bytes this rank has sent to each peer so far.
    pub fn bytes_sent(&self) -> Vec<u64> {
        self.sent
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect()
    }

    pub fn recv(&self, peer: usize, ch: usize, buf: &mut [u8]) -> anyhow::Result<()> {
        let mut s = self.stream(peer, ch);
        s.read_exact(buf)
            .map_err(|e| self.lost(peer, "receiving from", e))
    }

    /// Sends `out` to `to` while receiving `inp` from `from` (both on channel `ch`); the
    /// receive is handed to `on_piece` in pieces of at most `piece` bytes as they arrive,
    /// so that work on received data overlaps the transfer.
    pub fn exchange(
        &self,
        ch: usize,
        (to, out): (usize, &[u8]),
        (from, inp): (usize, &mut [u8]),
        piece: usize,
        mut on_piece: impl FnMut(usize, &[u8]),
    ) -> anyhow::Result<()> {
        // What the socket takes at once is sent here: a short message (most steps of a
        // latency-bound collective) then needs no sender thread, whose creation would cost
        // more wall time than the message (the box's wall time, in fabric time ÷ k).
        let now = self.send_ready(to, ch, out)?;
        let out = &out[now..];
        std::thread::scope(|s| {
            let sender = (!out.is_empty()).then(|| s.spawn(|| self.send(to, ch, out)));
            let mut got = Ok(());
            let mut off = 0;
            while off < inp.len() {
                let end = (off + piece.max(1)).min(inp.len());
                if let Err(e) = self.recv(from, ch, &mut inp[off..end]) {
                    got = Err(e);
                    break;
                }
                on_piece(off, &inp[off..end]);
                off = end;
            }
            if got.is_err() {
                // Unblock our sender if the peer is gone: shutting the socket down makes
                // its pending write fail instead of waiting for the timeout.
                let _ = self.stream(to, ch).shutdown(std::net::Shutdown::Both);
            }
            let sent = sender.map_or(Ok(()), |h| h.join().expect("sender thread"));
            got.and(sent)
        })
    }

    /// Shuts a connection down (both directions): a peer blocked on it fails at once.
    pub fn shutdown(&self, peer: usize, ch: usize) -> io::Result<()> {
        self.stream(peer, ch).shutdown(std::net::Shutdown::Both)
    }

    /// Everyone waits for everyone: a dissemination barrier. In round k each rank sends a
    /// byte to rank + 2^k and waits for one from rank − 2^k; after ⌈log2 n⌉ rounds every
    /// rank has heard, through some chain, from every other one, and all leave within
    /// about one hop of each other (benchmarks start their clocks here).
    pub fn barrier(&self) -> anyhow::Result<()> {
        let n = self.size;
        let mut dist = 1;
        while dist < n {
            let (to, from) = ((self.rank + dist) % n, (self.rank + n - dist) % n);
            let mut b = [0u8; 1];
            self.exchange(0, (to, &[1]), (from, &mut b), 1, |_, _| {})?;
            dist *= 2;
        }
        Ok(())
    }

    /// A dissemination barrier that also agrees on a value: each rank brings `mine`, and
    /// every rank leaves with the largest of all (each round's message carries the largest
    /// seen so far; after ⌈log2 n⌉ rounds every rank's value includes every rank's).
    pub fn barrier_max(&self, mine: u64) -> anyhow::Result<u64> {
        let n = self.size;
        let mut best = mine;
        let mut dist = 1;
        while dist < n {
            let (to, from) = ((self.rank + dist) % n, (self.rank + n - dist) % n);
            let mut b = [0u8; 8];
            self.exchange(0, (to, &best.to_le_bytes()), (from, &mut b), 8, |_, _| {})?;
            best = best.max(u64::from_le_bytes(b));
            dist *= 2;
        }
        Ok(best)
    }
}

fn bind_retry(addr: SocketAddr, deadline: Instant) -> io::Result<TcpListener> {
    loop {
        match TcpListener::bind(addr) {
            Ok(l) => return Ok(l),
            // The address may not be configured yet, or a previous job's socket lingers.
            Err(e)
                if Instant::now() < deadline
                    && matches!(
                        e.kind(),
                        io::ErrorKind::AddrNotAvailable | io::ErrorKind::AddrInUse
                    ) =>
            {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(e) => return Err(e),
        }
    }
}

fn connect_retry(addr: SocketAddr, deadline: Instant) -> io::Result<TcpStream> {
    loop {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(e),
        }
    }
}
