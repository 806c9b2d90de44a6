//! The daemon's ports on a real box: a TUN per GPU (with the virtio header and offloads,
//! or without), epoll, a pool of read buffers, and optional writer threads.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration as StdDuration, Instant as StdInstant};

use closbox_fabric::Frame;

use super::{Outgoing, Ports, DATAPLANE_NICE, LINK_TOKEN, WAKE_TOKEN};
use crate::links::{self, HostLink, IfState, LinkWatch};
use crate::sys::{self, Epoll, EventFd};

/// The daemon's ports: a TUN per GPU, waited on with epoll (nanosecond timeouts), and an
/// eventfd that control requests use to wake the loop.
///
/// With offload (`offload`), TUNs carry a virtio header each way: TCP super-packets read
/// are cut into frames (kept per port until taken), and frames of a flow due together are
/// written back as one super-packet. A super-packet is read into a buffer of a pool and
/// its frames' payloads stay there (`Frame::split`) until they are written: no payload
/// is copied in user space; a buffer is read into again once none of its frames is held.
///
/// Writes into the TUNs run the receiving GPU's network stack (the costly half of a
/// packet's way): with more than one core they may go to writer threads, each owning a
/// fixed share of the TUNs (so that every GPU's packets stay in order), while the data
/// plane's thread reads and runs the model.
#[derive(Debug)]
pub struct TunPorts {
    tuns: Vec<Arc<OwnedFd>>,
    offload: bool,
    epoll: Epoll,
    wake: Arc<EventFd>,
    tokens: Vec<u64>,
    /// Frames cut from a super-packet and not taken yet, per port, and when it was read.
    rx_frames: Vec<std::collections::VecDeque<Frame>>,
    rx_at: Vec<StdInstant>,
    /// Ports with frames in `rx_frames`.
    rx_waiting: usize,
    /// The read buffer without offload: each packet (frame) is then copied into a buffer
    /// of its own size, so a held packet costs what it carries, not an MTU.
    scratch: Vec<u8>,
    /// Buffers super-packets are read into (offload).
    read_bufs: ReadBufs,
    /// Reused by `recv` and `send`.
    cut: Vec<Frame>,
    /// Heads of frames written, for the frames cut next (`Frame::into_head`).
    heads: Vec<Vec<u8>>,
    lens: Vec<usize>,
    /// Empty: writes happen inline (one core).
    writers: Vec<Writer>,
    /// Writes handed to the writer threads so far (`Ports::writers`).
    handed_off: u64,
    done_rx: Option<std::sync::mpsc::Receiver<(u64, bool)>>,
    /// Writes done inline, not reported yet.
    inline_done: Vec<(u64, bool)>,
    /// Each GPU's interface (`watch_links`; empty: not followed), a buffer to read what
    /// they say, and the changes heard and not taken yet.
    links: Vec<LinkWatch>,
    link_buf: Vec<u8>,
    link_changed: Vec<(usize, HostLink)>,
    /// The carrier the fabric gives each GPU's interface (`Ports::set_carrier`; empty:
    /// on for all).
    carrier: Vec<bool>,
    /// Ports whose TUN failed a read (its device deleted inside the GPU's namespace
    /// makes every read fail): no longer waited on or read.
    closed: Vec<bool>,
}

/// Buffers super-packets are read into (offload): those whose frames may still be held,
/// oldest first, and those free again, the most recently freed last (reused first: its
/// bytes were just written out, so it is likely still in the CPU's cache).
#[derive(Debug, Default)]
struct ReadBufs {
    busy: std::collections::VecDeque<Arc<Vec<u8>>>,
    free: Vec<Arc<Vec<u8>>>,
}

impl ReadBufs {
    /// A buffer no frame holds.
    fn take(&mut self) -> Arc<Vec<u8>> {
        for _ in 0..self.busy.len().min(READ_BUF_TRIES) {
            let b = self.busy.pop_front().expect("not empty");
            if Arc::strong_count(&b) == 1 {
                self.free.push(b);
            } else {
                self.busy.push_back(b);
            }
        }
        self.free
            .pop()
            .unwrap_or_else(|| Arc::new(vec![0; MAX_READ]))
    }

    /// `b` back, unread (no frame holds it).
    fn unused(&mut self, b: Arc<Vec<u8>>) {
        if self.busy.len() + self.free.len() < READ_BUFS {
            self.free.push(b);
        }
    }

    /// `b` back, read into (frames may hold it).
    fn used(&mut self, b: Arc<Vec<u8>>) {
        if self.busy.len() + self.free.len() < READ_BUFS {
            self.busy.push_back(b);
        }
    }
}

/// What a writer thread writes: a TUN, whether it takes virtio headers, and frames that
/// go as one packet (several only with offload).
type WriteJob = (Arc<OwnedFd>, bool, Vec<Outgoing>);

#[derive(Debug)]
struct Writer {
    tx: std::sync::mpsc::SyncSender<WriteJob>,
    /// Jobs handed over and not written yet.
    pending: Arc<std::sync::atomic::AtomicUsize>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// A write runs on the data plane's own thread unless the data plane is already this late
/// (then it has more to do than it can, and a writer thread takes the write): at light
/// load no thread is woken (the lowest latency), under load the cores share the work.
const HANDOFF_LATE: StdDuration = StdDuration::from_micros(20);

/// Jobs a writer may have queued before the data plane waits for it.
const WRITE_QUEUE: usize = 4096;

/// Largest read from a TUN: a 64 KiB super-packet and its virtio header.
const MAX_READ: usize = 65_535 + crate::offload::VNET_HDR_LEN;

/// Heads of written frames kept for reuse (offload): a few super-packets' worth, of at
/// most `MAX_HEAD` bytes (an IPv4 and a TCP header with options are at most 120).
const HEADS_KEPT: usize = 1024;
const MAX_HEAD: usize = 128;

/// Read buffers kept for reuse (offload): 16 MiB. More may be in use (frames held by the
/// model keep theirs); those are freed with their last frame.
const READ_BUFS: usize = 256;
/// Buffers in use looked at, per read, for ones free again: the oldest are the likeliest
/// free (their frames have left); a frame held long makes its buffer skipped.
const READ_BUF_TRIES: usize = 4;

/// Writes `frames` (one packet, or a run from `offload::mergeable_run`) into `fd`; a
/// (lateness, failed) per frame into `done`, failed on the first frame of a failed write
/// only (one system call failed, however many frames it carried).
fn write_job(fd: &OwnedFd, offload: bool, frames: &[Outgoing], done: &mut Vec<(u64, bool)>) {
    use crate::offload;
    use std::io::IoSlice;
    let now = StdInstant::now();
    let failed = match frames {
        [one] if !offload && one.data.shared().is_none() => {
            sys::write_packet(fd.as_fd(), one.data.head()).is_err()
        }
        [one] => {
            let v = offload.then(|| offload::single_hdr(one.data.head()).bytes());
            let iov = [
                IoSlice::new(v.as_ref().map_or(&[][..], |v| &v[..])),
                IoSlice::new(one.data.head()),
                IoSlice::new(one.data.body()),
            ];
            sys::write_packet_vectored(fd.as_fd(), &iov).is_err()
        }
        run => {
            let (v, h) = offload::coalesced_headers(run);
            let v = v.bytes();
            let mut iov = Vec::with_capacity(4);
            iov.push(IoSlice::new(&v));
            iov.push(IoSlice::new(&h));
            offload::payloads(run, h.len(), &mut iov);
            sys::write_packet_vectored(fd.as_fd(), &iov).is_err()
        }
    };
    done.extend(frames.iter().enumerate().map(|(i, o)| {
        (
            now.saturating_duration_since(o.due).as_nanos() as u64,
            failed && i == 0,
        )
    }));
}

impl TunPorts {
    /// `offload`: the TUNs were made with virtio headers (`sys::tun_create`). `writers`:
    /// threads for TUN writes (0: write inline).
    pub fn new(
        tuns: Vec<OwnedFd>,
        wake: Arc<EventFd>,
        offload: bool,
        writers: usize,
    ) -> io::Result<TunPorts> {
        let epoll = Epoll::new(tuns.len() + 1)?;
        for (i, t) in tuns.iter().enumerate() {
            epoll.add(t.as_fd(), i as u64)?;
        }
        epoll.add(wake.fd(), WAKE_TOKEN)?;
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let writers = (0..writers.min(tuns.len()))
            .map(|i| {
                let (tx, rx) = std::sync::mpsc::sync_channel::<WriteJob>(WRITE_QUEUE);
                let done_tx = done_tx.clone();
                let pending = Arc::new(std::sync::atomic::AtomicUsize::new(0));
                let left = Arc::clone(&pending);
                let thread = std::thread::Builder::new()
                    .name(format!("tun-writer-{i}"))
                    .spawn(move || {
                        sys::set_timer_slack_ns(1);
                        let _ = sys::set_thread_nice(DATAPLANE_NICE);
                        let mut done = Vec::new();
                        for (fd, offload, frames) in rx {
                            write_job(&fd, offload, &frames, &mut done);
                            left.fetch_sub(1, std::sync::atomic::Ordering::Release);
                            for d in done.drain(..) {
                                if done_tx.send(d).is_err() {
                                    return;
                                }
                            }
                        }
                    })?;
                Ok(Writer {
                    tx,
                    pending,
                    thread: Some(thread),
                })
            })
            .collect::<io::Result<Vec<_>>>()?;
        Ok(TunPorts {
            rx_frames: vec![Default::default(); tuns.len()],
            rx_waiting: 0,
            rx_at: vec![StdInstant::now(); tuns.len()],
            scratch: vec![0; MAX_READ],
            read_bufs: Default::default(),
            cut: Vec::new(),
            heads: Vec::new(),
            lens: Vec::new(),
            tuns: tuns.into_iter().map(Arc::new).collect(),
            offload,
            epoll,
            wake,
            tokens: Vec::new(),
            writers,
            handed_off: 0,
            done_rx: Some(done_rx),
            inline_done: Vec::new(),
            links: Vec::new(),
            link_buf: Vec::new(),
            link_changed: Vec::new(),
            carrier: Vec::new(),
            closed: Vec::new(),
        })
    }

    /// Follows each GPU's interface, `watches[i]` GPU `i`'s (`Ports::link_changes`).
    pub fn watch_links(mut self, watches: Vec<LinkWatch>) -> io::Result<TunPorts> {
        for (i, w) in watches.iter().enumerate() {
            self.epoll.add(w.fd(), LINK_TOKEN | i as u64)?;
        }
        self.links = watches;
        self.link_buf = vec![0; links::BUF];
        Ok(self)
    }

    /// Reads what GPU `i`'s link watch heard.
    fn read_link(&mut self, i: usize) {
        let Some(w) = self.links.get_mut(i) else {
            return;
        };
        let mut heard = Vec::new();
        let r = w.drain(&mut self.link_buf, &mut heard);
        if w.carrier_forced_on() && self.carrier.get(i) == Some(&false) {
            // Its host set the carrier on while every link of the GPU is down: the
            // cable is the fabric's (a host cannot plug one in by command).
            if let Some(tun) = self.tuns.get(i) {
                let _ = sys::tun_set_carrier(tun.as_fd(), false);
            }
        }
        self.take_heard(i, heard, r);
    }

    /// Takes what GPU `i`'s link watch heard (`r`: how reading it went). A watch that
    /// fails is dropped from the wait (it would wake it for ever), said once in the log.
    fn take_heard(&mut self, i: usize, heard: Vec<HostLink>, r: io::Result<()>) {
        if heard.contains(&HostLink::State(IfState::Gone)) {
            // Gone from its namespace: deleted, or moved out (`ip link set cb0 netns 1`),
            // where it would outlive the fabric (persistent) if the daemon were killed
            // before its teardown: it now goes when its descriptor closes, however the
            // daemon ends. (A deleted one refuses: EBADFD, nothing to do.)
            if let Some(tun) = self.tuns.get(i) {
                let _ = sys::tun_not_persistent(tun.as_fd());
            }
        }
        self.link_changed.extend(heard.into_iter().map(|c| (i, c)));
        if let Err(e) = r {
            tracing::warn!("port {i}: no longer following its interface (MTU, up): {e}");
            if let Some(w) = self.links.get(i) {
                let _ = self.epoll.remove(w.fd());
            }
        }
    }

    /// The writer threads a box with `cores` cores gets: a core for the data plane's
    /// thread and one for the GPUs' processes first, at most 4; none on 2 cores, where
    /// measured (`make bench-live`, offload on) inline writes beat a writer thread on
    /// every figure: one flow 14.7–17.1 vs 12.7–14.6 Gbit/s, 8 GPUs 14.9–15.6 vs
    /// 12.4–13.8, because the thread competes with the GPUs for the same two cores.
    pub fn writers_for(cores: usize) -> usize {
        cores.saturating_sub(2).min(4)
    }

    /// The TUN descriptors, to be closed after their namespaces are gone (the writer
    /// threads are stopped first).
    pub fn into_tuns(mut self) -> Vec<OwnedFd> {
        for w in &mut self.writers {
            // Closing the queue ends the thread once it has written what it holds.
            let (tx, _) = std::sync::mpsc::sync_channel(0);
            drop(std::mem::replace(&mut w.tx, tx));
            if let Some(t) = w.thread.take() {
                let _ = t.join();
            }
        }
        self.writers.clear();
        self.tuns
            .into_iter()
            .map(|t| Arc::try_unwrap(t).expect("writers are gone"))
            .collect()
    }

    /// Writes one job (a run of `out`) here or hands it to its port's writer.
    fn dispatch(&mut self, port: usize, job: &mut [Outgoing], alone: bool) {
        use std::sync::atomic::Ordering;
        let w = match self.writers.len() {
            0 => None,
            n => Some(&self.writers[port % n]),
        };
        // Inline when nothing else waits: a lone packet is written at once (no thread to
        // wake, the lowest latency), provided its writer has nothing queued ahead of it
        // (order kept); inline too while the data plane is on time.
        let inline = match w {
            None => true,
            Some(w) => {
                w.pending.load(Ordering::Acquire) == 0
                    && (alone
                        || StdInstant::now().saturating_duration_since(job[0].due) < HANDOFF_LATE)
            }
        };
        if inline {
            write_job(&self.tuns[port], self.offload, job, &mut self.inline_done);
            return;
        }
        let job: Vec<Outgoing> = job
            .iter_mut()
            .map(|o| Outgoing {
                port: o.port,
                data: std::mem::take(&mut o.data),
                due: o.due,
            })
            .collect();
        let w = w.expect("not inline");
        self.handed_off += 1;
        w.pending.fetch_add(1, Ordering::AcqRel);
        let n = job.len();
        if w.tx
            .send((Arc::clone(&self.tuns[port]), self.offload, job))
            .is_err()
        {
            w.pending.fetch_sub(1, Ordering::AcqRel);
            self.inline_done.extend((0..n).map(|_| (0, true)));
        }
    }

    /// The next frame from `port` (`Ports::recv`).
    fn read_frame(&mut self, port: usize) -> io::Result<Option<(Frame, StdInstant)>> {
        if let Some(f) = self.rx_frames[port].pop_front() {
            if self.rx_frames[port].is_empty() {
                self.rx_waiting -= 1;
            }
            return Ok(Some((f, self.rx_at[port])));
        }
        if !self.offload {
            let Some(n) = sys::read_packet(self.tuns[port].as_fd(), &mut self.scratch)? else {
                return Ok(None);
            };
            return Ok(Some((self.scratch[..n].to_vec().into(), StdInstant::now())));
        }
        use crate::offload::{segment, VnetHdr, VNET_HDR_LEN};
        let mut buf = self.read_bufs.take();
        let read = sys::read_packet(
            self.tuns[port].as_fd(),
            Arc::get_mut(&mut buf).expect("a free buffer"),
        );
        let n = match read {
            Ok(Some(n)) => n,
            other => {
                self.read_bufs.unused(buf);
                return other.map(|_| None);
            }
        };
        let Some(hdr) = VnetHdr::parse(&buf[..n]) else {
            // Shorter than its header: nothing the kernel sends; the model counts it.
            self.read_bufs.unused(buf);
            return Ok(Some((Frame::default(), StdInstant::now())));
        };
        let at = StdInstant::now();
        let mut frames = std::mem::take(&mut self.cut);
        let first = match segment(&hdr, &buf, VNET_HDR_LEN..n, &mut frames, &mut self.heads) {
            Ok(()) => {
                let mut it = frames.drain(..);
                let first = it.next();
                let q = &mut self.rx_frames[port];
                q.extend(it);
                if !q.is_empty() {
                    self.rx_waiting += 1;
                    self.rx_at[port] = at;
                }
                first
            }
            Err(e) => {
                // Handed on as it is: the model judges (and counts) it.
                tracing::debug!("GPU {port}: super-packet not cut into frames: {e}");
                frames.clear();
                Some(buf[VNET_HDR_LEN..n].to_vec().into())
            }
        };
        self.cut = frames;
        // A packet without GSO (an ACK) was copied out whole: no frame holds the buffer.
        if Arc::strong_count(&buf) == 1 {
            self.read_bufs.unused(buf);
        } else {
            self.read_bufs.used(buf);
        }
        Ok(first.map(|f| (f, at)))
    }
}

impl Ports for TunPorts {
    fn count(&self) -> usize {
        self.tuns.len()
    }

    fn writers(&self) -> (usize, u64) {
        (self.writers.len(), self.handed_off)
    }

    fn now(&self) -> StdInstant {
        StdInstant::now()
    }

    fn wait(&mut self, timeout: StdDuration, ready: &mut Vec<usize>) -> io::Result<()> {
        // Frames already cut and waiting: no sleeping, and their ports are ready.
        let timeout = if self.rx_waiting > 0 {
            StdDuration::ZERO
        } else {
            timeout
        };
        self.tokens.clear();
        self.tokens
            .extend(self.epoll.wait(Some(timeout.as_nanos() as u64))?);
        for k in 0..self.tokens.len() {
            let t = self.tokens[k];
            if t == WAKE_TOKEN {
                self.wake.drain();
            } else if t & LINK_TOKEN != 0 {
                self.read_link((t & !LINK_TOKEN) as usize);
            } else {
                ready.push(t as usize);
            }
        }
        if self.rx_waiting > 0 {
            for (p, q) in self.rx_frames.iter().enumerate() {
                if !q.is_empty() && !ready.contains(&p) {
                    ready.push(p);
                }
            }
        }
        Ok(())
    }

    fn recv(&mut self, port: usize) -> io::Result<Option<(Frame, StdInstant)>> {
        if self.closed.get(port).copied().unwrap_or(false) {
            return Ok(None);
        }
        let got = self.read_frame(port);
        if got.is_err() {
            // A TUN read fails only for good (its device was deleted: EBADFD): the port
            // is closed, or the level-triggered wait would report it ready for ever.
            if self.closed.len() < self.tuns.len() {
                self.closed.resize(self.tuns.len(), false);
            }
            self.closed[port] = true;
            let _ = self.epoll.remove(self.tuns[port].as_fd());
        }
        got
    }

    fn send(&mut self, out: &mut Vec<Outgoing>) {
        // Each port's frames together, in their order (a stable sort), then cut into jobs:
        // one frame each, or with offload a run of frames that continue one flow.
        out.sort_by_key(|o| o.port);
        let mut lens = std::mem::take(&mut self.lens);
        lens.clear();
        let mut i = 0;
        while i < out.len() {
            let port = out[i].port;
            let mut end = i + 1;
            while end < out.len() && out[end].port == port {
                end += 1;
            }
            let len = if self.offload && end - i > 1 {
                crate::offload::mergeable_run(&out[i..end])
            } else {
                1
            };
            lens.push(len);
            i += len;
        }
        let alone = lens.len() == 1;
        let mut at = 0;
        for &len in &lens {
            let port = out[at].port;
            self.dispatch(port, &mut out[at..at + len], alone);
            at += len;
        }
        for o in out.drain(..) {
            // Heads of frames cut from super-packets, and small packets copied whole (ACKs).
            // (Frames handed to a writer thread left `Frame::default()` behind.)
            if self.offload && self.heads.len() < HEADS_KEPT {
                let h = o.data.into_head();
                if (1..=MAX_HEAD).contains(&h.capacity()) {
                    self.heads.push(h);
                }
            }
        }
        self.lens = lens;
    }

    fn finished(&mut self, done: &mut Vec<(u64, bool)>) {
        done.append(&mut self.inline_done);
        if let Some(rx) = &self.done_rx {
            done.extend(rx.try_iter());
        }
    }

    fn thread_cpu(&self) -> Option<(u64, u64)> {
        sys::thread_cpu_ns().ok()
    }

    fn link_changes(&mut self, out: &mut Vec<(usize, HostLink)>) {
        out.append(&mut self.link_changed);
    }

    fn set_carrier(&mut self, port: usize, on: bool) {
        if port >= self.tuns.len() || self.closed.get(port) == Some(&true) {
            return;
        }
        if self.carrier.len() < self.tuns.len() {
            self.carrier.resize(self.tuns.len(), true);
        }
        self.carrier[port] = on;
        if let Err(e) = sys::tun_set_carrier(self.tuns[port].as_fd(), on) {
            // Its interface deleted (EBADFD): nothing to carry.
            tracing::debug!("port {port}: setting its carrier: {e}");
        }
        if let Some(w) = self.links.get_mut(port) {
            let mut heard = Vec::new();
            let r = w.fabric_carrier(on, &mut self.link_buf, &mut heard);
            self.take_heard(port, heard, r);
        }
    }
}

#[cfg(test)]
mod tun_ports_tests {
    use super::*;
    use crate::offload::{self, VnetHdr, VNET_HDR_LEN};
    use std::os::unix::net::UnixDatagram;

    /// Ports over datagram socket pairs standing in for TUNs (a datagram is a packet):
    /// ours for the ports, theirs for the GPUs' side.
    fn ports(n: usize, offload: bool, writers: usize) -> (TunPorts, Vec<UnixDatagram>) {
        let (ours, theirs): (Vec<_>, Vec<_>) =
            (0..n).map(|_| UnixDatagram::pair().unwrap()).unzip();
        let fds: Vec<OwnedFd> = ours.into_iter().map(OwnedFd::from).collect();
        for t in &theirs {
            t.set_nonblocking(true).unwrap();
        }
        for f in &fds {
            rustix::fs::fcntl_setfl(f, rustix::fs::OFlags::NONBLOCK).unwrap();
        }
        let wake = Arc::new(EventFd::new().unwrap());
        (TunPorts::new(fds, wake, offload, writers).unwrap(), theirs)
    }

    fn wait_done(ports: &mut TunPorts, n: usize) -> Vec<(u64, bool)> {
        let mut done = Vec::new();
        let deadline = StdInstant::now() + StdDuration::from_secs(10);
        while done.len() < n && StdInstant::now() < deadline {
            ports.finished(&mut done);
            std::thread::sleep(StdDuration::from_millis(1));
        }
        done
    }

    /// Writer threads keep each port's packets in order, deliver every one, and report
    /// every write; late packets go to the writers, a lone one due now is written inline.
    #[test]
    fn writer_threads_keep_each_ports_order_and_report_every_write() {
        for writers in [0, 1, 2] {
            let (mut ports, theirs) = ports(3, false, writers);
            let late = StdInstant::now() - StdDuration::from_millis(5);
            let n = 300u32;
            let mut out: Vec<Outgoing> = (0..n)
                .map(|i| Outgoing {
                    port: (i % 3) as usize,
                    data: i.to_be_bytes().to_vec().into(),
                    due: late,
                })
                .collect();
            ports.send(&mut out);
            assert!(out.is_empty());
            let mut lone = vec![Outgoing {
                port: 0,
                data: n.to_be_bytes().to_vec().into(),
                due: StdInstant::now(),
            }];
            ports.send(&mut lone);
            let done = wait_done(&mut ports, n as usize + 1);
            assert_eq!(done.len(), n as usize + 1, "writers {writers}");
            assert!(done.iter().all(|&(_, failed)| !failed));
            assert!(done.iter().filter(|d| d.0 >= 5_000_000).count() >= n as usize);
            for (port, sock) in theirs.iter().enumerate() {
                let mut got = Vec::new();
                let mut b = [0u8; 4];
                while let Ok(4) = sock.recv(&mut b) {
                    got.push(u32::from_be_bytes(b));
                }
                let mut want: Vec<u32> = (0..n).filter(|i| (i % 3) as usize == port).collect();
                if port == 0 {
                    want.push(n);
                }
                assert_eq!(got, want, "port {port}, writers {writers}");
            }
            drop(ports.into_tuns());
        }
    }

    /// A TCP packet 10.0.0.1 -> 10.0.0.2 of `payload` bytes from `seq` (ACK|PSH).
    fn tcp(seq: u32, payload: usize) -> Vec<u8> {
        let mut p = vec![0u8; 40];
        p[0] = 0x45;
        p[2..4].copy_from_slice(&((40 + payload) as u16).to_be_bytes());
        p[6] = 0x40;
        p[8] = 64;
        p[9] = 6;
        p[12..16].copy_from_slice(&[10, 0, 0, 1]);
        p[16..20].copy_from_slice(&[10, 0, 0, 2]);
        p[20..22].copy_from_slice(&1u16.to_be_bytes());
        p[22..24].copy_from_slice(&2u16.to_be_bytes());
        p[24..28].copy_from_slice(&seq.to_be_bytes());
        p[32] = 5 << 4;
        p[33] = 0x18;
        p.extend((0..payload).map(|i| i as u8));
        closbox_fabric::packet::set_header_checksum(&mut p);
        p
    }

    /// With offload: a super-packet read from a port comes out as its frames; frames
    /// written together go back as one super-packet, and a gap splits them.
    #[test]
    fn offload_cuts_super_packets_and_coalesces_what_continues() {
        let (mut ports, mut theirs) = ports(2, true, 0);
        let gso = VnetHdr {
            flags: offload::F_NEEDS_CSUM,
            gso_type: offload::GSO_TCPV4,
            hdr_len: 40,
            gso_size: 1000,
            csum_start: 20,
            csum_offset: 16,
        };
        let mut msg = gso.bytes().to_vec();
        msg.extend(tcp(100, 3500));
        theirs[0].send(&msg).unwrap();
        let mut frames = Vec::new();
        while let Some((f, _)) = ports.recv(0).unwrap() {
            frames.push(f);
        }
        assert_eq!(
            frames.iter().map(Frame::len).collect::<Vec<_>>(),
            [1040, 1040, 1040, 540]
        );
        // Its frames hold the buffer it was read into (the read that found nothing more
        // gave its buffer back unread); a packet without GSO is copied out whole and its
        // buffer is free again at once, not kept among those frames may hold.
        assert_eq!(
            (ports.read_bufs.busy.len(), ports.read_bufs.free.len()),
            (1, 1)
        );
        let mut plain = VnetHdr::default().bytes().to_vec();
        plain.extend(tcp(4000, 10));
        theirs[0].send(&plain).unwrap();
        let (ack, _) = ports.recv(0).unwrap().expect("a frame");
        assert!(ack.shared().is_none() && ack.len() == 50);
        assert_eq!(
            (ports.read_bufs.busy.len(), ports.read_bufs.free.len()),
            (1, 1)
        );
        // Frames 0, 1, 3 (frame 2 lost): 0+1 go as one super-packet, 3 alone.
        let due = StdInstant::now();
        let gap = |frames: &[Frame]| -> Vec<Outgoing> {
            [0, 1, 3]
                .iter()
                .map(|&i| Outgoing {
                    port: 1,
                    data: frames[i].clone(),
                    due,
                })
                .collect()
        };
        ports.send(&mut gap(&frames));
        assert_eq!(wait_done(&mut ports, 3).len(), 3);
        let mut b = vec![0u8; 70_000];
        let n = theirs[1].recv(&mut b).unwrap();
        let v = VnetHdr::parse(&b[..n]).unwrap();
        assert_eq!((v.gso_type, v.gso_size), (offload::GSO_TCPV4, 1000));
        let sp = &b[VNET_HDR_LEN..n];
        assert_eq!(sp.len(), 40 + 2000);
        assert_eq!(
            sp[40..],
            frames[0].to_vec()[40..]
                .iter()
                .chain(&frames[1].to_vec()[40..])
                .copied()
                .collect::<Vec<_>>()[..]
        );
        let n = theirs[1].recv(&mut b).unwrap();
        let v = VnetHdr::parse(&b[..n]).unwrap();
        assert_eq!(v.gso_type, offload::GSO_NONE);
        assert_eq!(v.flags, offload::F_NEEDS_CSUM);
        assert_eq!(&b[VNET_HDR_LEN..n], &frames[3].to_vec()[..]);
        assert!(theirs[1].recv(&mut b).is_err(), "nothing more");
        // The written frames' heads are kept, and the next super-packet's frames take them.
        assert_eq!(ports.heads.len(), 3);
        theirs[0].send(&msg).unwrap();
        let again: Vec<Frame> =
            std::iter::from_fn(|| ports.recv(0).unwrap().map(|f| f.0)).collect();
        assert_eq!(ports.heads.len(), 0);
        assert_eq!(again, frames, "the same frames, in reused heads");
        // The GPU's side gone, the same two writes fail: two errors, not one per frame.
        drop(theirs.pop().expect("port 1's peer"));
        ports.send(&mut gap(&again));
        let done = wait_done(&mut ports, 3);
        assert_eq!(done.iter().filter(|d| d.1).count(), 2, "{done:?}");
        drop(ports.into_tuns());
    }
}
