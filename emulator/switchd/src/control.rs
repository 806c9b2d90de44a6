//! The control socket: `/run/closbox/fabrics/<fabric>/control.sock`, mode 0600 in a 0700
//! directory, one JSON request per line (`{"cmd":"status"}`, `{"cmd":"stop"}`), one JSON
//! reply per line.
//!
//! Each connection is served by a thread of its own (at most `MAX_CLIENTS` at once), so a
//! client that connects and says nothing delays nobody; a request is at most
//! `MAX_REQUEST` bytes (a scenario's timeline is one request) and must arrive whole within
//! 5 s (a client sending a byte now and then is cut off there).

use std::io::{BufRead, BufReader, Read as _, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};

pub use crate::chaos::{ChangeRequest, Event};
use crate::dataplane::{CaptureSpec, CaptureStart, Ctl, EndReason, RecordSpec};
pub use crate::dataplane::{FlowInfo, Flows, Lateness, LinkStatus, PortStatus, Status};
use crate::state::{FabricName, State};
use crate::sys::EventFd;

/// The control API's version: every request and reply carries it as `"v"`. A daemon
/// answers a request of another version with an error saying so, and a client refuses a
/// reply of another version, so an old CLI and a newer daemon (or the reverse) never
/// misread each other.
pub const API_VERSION: u32 = 1;

fn is_zero(n: &u64) -> bool {
    *n == 0
}

fn is_zero_usize(n: &usize) -> bool {
    *n == 0
}

/// A timeline that starts with the GPUs' traffic rather than at once (`Request::Schedule`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Trigger {
    /// The GPUs whose packets it waits for (names, as `plan` gives them).
    pub gpus: Vec<String>,
    /// Wait until each of them has sent a packet (not only one of them).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub every: bool,
}

/// What a client asks: `{"v":1,"cmd":"status"}`, `{"v":1,"cmd":"stop"}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "lowercase")]
pub enum Request {
    /// `{"v":1,"cmd":"status"}`; `"tcp":true` also reads each GPU's TCP settings
    /// (`Status::gpu_tcp`, empty without): ~60 µs a GPU (a status of 1,024 GPUs 111-118 ms
    /// with them, 49-56 without), so what polls (`top`, a scenario's follower) leaves them.
    Status {
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        tcp: bool,
    },
    /// `{"v":1,"cmd":"change","change":"link-down","a":"leaf0","b":"spine1","index":null}`
    Change(ChangeRequest),
    /// `{"v":1,"cmd":"events"}`: the log of changes; `"after":N` only those numbered
    /// above N (what a client following the log has not seen: the log holds up to 10,000).
    Events {
        #[serde(default, skip_serializing_if = "is_zero")]
        after: u64,
    },
    /// `{"v":1,"cmd":"schedule","items":[[2000000,{"change":"link-down",…}],…]}`: changes
    /// at fabric ns after now, as one timeline.
    Schedule {
        items: Vec<(u64, ChangeRequest)>,
        /// The fault each item belongs to (none: every item 0): items of one fault undo
        /// only each other (a random fault's repair its own fault), 0 being the
        /// timeline's own steps (those of a switch or GPU a fault of that switch or GPU);
        /// below 2^30.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        faults: Vec<u32>,
        /// When it starts (none: now): `{"gpus":["gpu0","gpu1"],"every":false}`, at the
        /// first packet one of those GPUs sends into the fabric (`every`: once each of
        /// them has sent one). Until then it waits, armed; `cancel` drops it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        start: Option<Trigger>,
    },
    /// Drops a timeline's pending changes (`null`: every timeline's and flap's); those
    /// that repair what the timeline broke are made at once.
    Cancel {
        timeline: Option<u64>,
    },
    /// Per-flow counters and paths: `{"v":1,"cmd":"flows","top":20,"since_ns":1000000}`,
    /// the `top` heaviest (0 or none: all) of those active in the last `since_ns` of
    /// fabric time (none: all). Paths are worked out for those sent only: the data
    /// plane's thread does it, and 65,536 flows' paths took it ~0.3 s.
    Flows {
        #[serde(default, skip_serializing_if = "is_zero_usize")]
        top: usize,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        since_ns: Option<u64>,
    },
    /// Samples ports' queue depth and utilization every `interval_ns` of fabric time;
    /// the reply line (`recording`) is followed by CSV rows until the recording ends
    /// (duration, the fabric stopping) or the client shuts down its side.
    Record {
        ports: Vec<String>,
        interval_ns: u64,
        duration_ns: Option<u64>,
    },
    /// `{"v":1,"cmd":"capture","ports":["leaf0->spine1"],"snaplen":262144,"drops":false,
    /// "count":null,"duration_ns":null}`: the reply line (`capturing`) is followed by a
    /// pcapng stream until the capture ends (count, duration, the fabric stopping) or the
    /// client shuts down its side of the connection.
    Capture {
        ports: Vec<String>,
        snaplen: u32,
        drops: bool,
        count: Option<u64>,
        duration_ns: Option<u64>,
    },
    Stop,
}

/// What the daemon answers: `{"v":1,"reply":"status", …the Status fields…}`,
/// `{"v":1,"reply":"stopping"}`, `{"v":1,"reply":"error","message":"…"}`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "lowercase")]
pub enum Reply {
    Status(Box<Status>),
    /// What a change applied.
    Changed {
        events: Vec<Event>,
    },
    Events {
        events: Vec<Event>,
    },
    /// A timeline was scheduled: its id, what it applied at once, and its start (fabric
    /// ns since up; its changes are due at their times after it), `null` while it waits
    /// for its `start` trigger (its start is then the event "timeline N started: …").
    Scheduled {
        timeline: u64,
        events: Vec<Event>,
        #[serde(default)]
        start_ns: Option<u64>,
    },
    /// Pending steps dropped, and the repairs among them made at once (of what the
    /// timeline had broken).
    Cancelled {
        changes: usize,
        #[serde(default)]
        repaired: Vec<Event>,
    },
    /// A capture started: a pcapng stream follows the line.
    Capturing {
        ports: Vec<String>,
    },
    Flows(Box<Flows>),
    /// A recording started: CSV follows the line.
    Recording {
        ports: Vec<String>,
    },
    Stopping,
    Error {
        message: String,
    },
}

impl Reply {
    pub fn error(message: impl Into<String>) -> Reply {
        Reply::Error {
            message: message.into(),
        }
    }
}

/// A request or reply with the API version beside it.
#[derive(Debug, Serialize, Deserialize)]
struct Versioned<T> {
    v: u32,
    #[serde(flatten)]
    body: T,
}

/// Reads the version of a message before its body, so that a message of another version
/// is reported as such rather than as a malformed body.
fn version_of(line: &str) -> Option<u64> {
    #[derive(Deserialize)]
    struct V {
        v: Option<u64>,
    }
    serde_json::from_str::<V>(line)
        .ok()
        .map(|x| x.v.unwrap_or(0))
}

/// Clients served at once; more are told to come back (`BUSY`), and closbox's own
/// clients do, for a while (`exchange`).
pub const MAX_CLIENTS: usize = 24;
/// Streams (captures, recordings) served at once, among the `MAX_CLIENTS`: the others
/// are kept for commands, so that `status`, `link down` or `down` are answered while
/// the streams run. One more stream is told to come back, as a client beyond the
/// `MAX_CLIENTS` is.
pub const MAX_STREAMS: usize = 16;
/// How a "come back later" reply starts.
const BUSY: &str = "busy:";
/// Longest request line.
pub const MAX_REQUEST: u64 = 4 << 20;
/// The time a client has to send its whole request line.
const REQUEST_DEADLINE: Duration = Duration::from_secs(5);

/// Starts serving fabric `state`'s control socket (`ifindex`: each GPU's interface's
/// index); the listener thread lives as long as the process.
pub fn serve(
    state: State,
    ifindex: Vec<u32>,
    ctl: Sender<Ctl>,
    wake: Arc<EventFd>,
) -> anyhow::Result<()> {
    let path = state.fabric.control_path();
    let _ = std::fs::remove_file(&path);
    // The socket is born 0600 (no window in which others could connect); its directory
    // is 0700 besides.
    let old = crate::sys::umask(0o177);
    let bound = UnixListener::bind(&path);
    crate::sys::umask(old);
    let listener = bound.with_context(|| format!("binding {}", path.display()))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
    let streams = Arc::new(AtomicUsize::new(0));
    let shared = Arc::new((state, ifindex, Mutex::new(ctl), wake, streams));
    let count = Arc::new(AtomicUsize::new(0));
    std::thread::Builder::new()
        .name("control".into())
        .spawn(move || {
            for mut conn in listener.incoming().flatten() {
                // Held by the client's thread: its slot is given back however the thread
                // ends (a panic too), or here if the thread cannot start.
                let Some(slot) = Slot::take(&count, MAX_CLIENTS) else {
                    let _ = reply(
                        &mut conn,
                        &Reply::error(format!("{BUSY} it serves {MAX_CLIENTS} clients at once")),
                    );
                    continue;
                };
                let shared = Arc::clone(&shared);
                let spawned = std::thread::Builder::new()
                    .name("control-client".into())
                    .spawn(move || {
                        let _slot = slot;
                        let (state, ifindex, ctl, wake, streams) = &*shared;
                        let request = read_request(&mut conn);
                        tracing::debug!("control: {request:?}");
                        // A stream holds one of the `MAX_STREAMS` as long as it runs.
                        let _stream = match request {
                            Ok(Request::Capture { .. } | Request::Record { .. }) => {
                                match Slot::take(streams, MAX_STREAMS) {
                                    Some(s) => Some(s),
                                    None => {
                                        let _ = reply(
                                            &mut conn,
                                            &Reply::error(format!(
                                                "{BUSY} it runs {MAX_STREAMS} captures and recordings at once"
                                            )),
                                        );
                                        return;
                                    }
                                }
                            }
                            _ => None,
                        };
                        match request {
                            Ok(Request::Capture {
                                ports,
                                snaplen,
                                drops,
                                count,
                                duration_ns,
                            }) => {
                                let (tx, rx) = mpsc::sync_channel(CAPTURE_QUEUE);
                                let ended = EndReason::default();
                                let spec = CaptureSpec {
                                    ports: ports.clone(),
                                    snaplen,
                                    drops,
                                    count,
                                    duration_ns,
                                    tx,
                                    ended: ended.clone(),
                                };
                                serve_stream(
                                    &mut conn,
                                    ctl,
                                    wake,
                                    |r| Ctl::Capture(spec, r),
                                    Reply::Capturing {
                                        ports: ports.clone(),
                                    },
                                    |c, start| {
                                        stream_capture(c, &ports, snaplen, start, rx, &ended)
                                    },
                                    |start| Ctl::EndCapture(start.id),
                                );
                                return;
                            }
                            Ok(Request::Record {
                                ports,
                                interval_ns,
                                duration_ns,
                            }) => {
                                let (tx, rx) = mpsc::sync_channel(RECORD_QUEUE);
                                let ended = EndReason::default();
                                let spec = RecordSpec {
                                    ports: ports.clone(),
                                    interval_ns,
                                    duration_ns,
                                    tx,
                                    ended: ended.clone(),
                                };
                                serve_stream(
                                    &mut conn,
                                    ctl,
                                    wake,
                                    |r| Ctl::Record(spec, r),
                                    Reply::Recording {
                                        ports: ports.clone(),
                                    },
                                    |c, _| stream_record(c, &ports, rx, &ended),
                                    |id| Ctl::EndRecord(*id),
                                );
                                return;
                            }
                            _ => {}
                        }
                        let answer = match request {
                            Ok(Request::Status { tcp }) => {
                                status(state, ifindex, ctl, wake, tcp)
                            }
                            Ok(Request::Change(req)) => ask(ctl, wake, |tx| Ctl::Change(req, tx))
                                .and_then(|r| r.map_err(|e| e.to_string()))
                                .map_or_else(Reply::error, |events| Reply::Changed { events }),
                            Ok(Request::Events { after }) => {
                                ask(ctl, wake, |tx| Ctl::Events(after, tx))
                                    .map_or_else(Reply::error, |events| Reply::Events { events })
                            }
                            Ok(Request::Schedule {
                                items,
                                faults,
                                start,
                            }) => {
                                let req = crate::dataplane::Schedule {
                                    items,
                                    faults,
                                    start,
                                };
                                ask(ctl, wake, |tx| Ctl::Schedule(req, tx))
                                    .and_then(|r| r.map_err(|e| e.to_string()))
                                    .map_or_else(Reply::error, |(timeline, events, start_ns)| {
                                        Reply::Scheduled {
                                            timeline,
                                            events,
                                            start_ns,
                                        }
                                    })
                            }
                            Ok(Request::Cancel { timeline }) => {
                                ask(ctl, wake, |tx| Ctl::Cancel(timeline, tx))
                                    .map_or_else(Reply::error, |(changes, repaired)| {
                                        Reply::Cancelled { changes, repaired }
                                    })
                            }
                            Ok(Request::Capture { .. } | Request::Record { .. }) => {
                                unreachable!("served above")
                            }
                            Ok(Request::Flows { top, since_ns }) => {
                                ask(ctl, wake, |tx| Ctl::Flows(top, since_ns, tx))
                                    .map_or_else(Reply::error, |f| Reply::Flows(Box::new(f)))
                            }
                            Ok(Request::Stop) => {
                                let _ = ctl.lock().expect("control lock").send(Ctl::Stop);
                                wake.notify();
                                Reply::Stopping
                            }
                            Err(e) => Reply::error(format!("{e:#}")),
                        };
                        let _ = reply(&mut conn, &answer);
                    });
                if spawned.is_err() {
                    // (The connection and the slot went with the closure.)
                    tracing::warn!("control: could not start a client thread");
                }
            }
        })?;
    Ok(())
}

/// A client's place among the `MAX_CLIENTS` (or a stream's among the `MAX_STREAMS`),
/// given back when dropped.
struct Slot(Arc<AtomicUsize>);

impl Slot {
    /// One of `max` places counted by `count`, if one is free.
    fn take(count: &Arc<AtomicUsize>, max: usize) -> Option<Slot> {
        if count.fetch_add(1, Ordering::AcqRel) >= max {
            count.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(Slot(Arc::clone(count)))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A streaming request: asks the data plane to `start` it, answers with `header` (or
/// the error), streams until the stream ends, then tells the data plane to `end` it.
fn serve_stream<S>(
    conn: &mut UnixStream,
    ctl: &Mutex<Sender<Ctl>>,
    wake: &EventFd,
    start: impl FnOnce(Sender<Result<S, String>>) -> Ctl,
    header: Reply,
    stream: impl FnOnce(&mut UnixStream, &S) -> std::io::Result<()>,
    end: impl FnOnce(&S) -> Ctl,
) {
    match ask(ctl, wake, start).and_then(|r| r) {
        Ok(started) => {
            let _ = reply(conn, &header);
            if let Err(e) = stream(conn, &started) {
                tracing::debug!("control: a stream ended: {e}");
            }
            let _ = ctl.lock().expect("control lock").send(end(&started));
            wake.notify();
        }
        Err(e) => {
            let _ = reply(conn, &Reply::error(e));
        }
    }
}

/// Tapped packets a capture's connection may lag behind by before they are counted as
/// the capture's drops.
const CAPTURE_QUEUE: usize = 16_384;

/// Writes a capture as pcapng to the client until it ends: the data plane drops its
/// channel (count or duration reached, the fabric stopping), or the client shuts down
/// its side (or goes away). Ends with each interface's statistics, saying why the
/// fabric ended it.
fn stream_capture(
    conn: &mut UnixStream,
    ports: &[String],
    snaplen: u32,
    start: &CaptureStart,
    rx: mpsc::Receiver<(u32, closbox_fabric::model::Tapped)>,
    ended: &EndReason,
) -> std::io::Result<()> {
    use std::sync::atomic::Ordering as O;
    conn.set_write_timeout(Some(Duration::from_secs(5)))?;
    let mut buf = Vec::with_capacity(4096);
    let interfaces: Vec<(String, String)> = ports
        .iter()
        .map(|p| (p.clone(), format!("closbox egress port {p} (fabric time)")))
        .collect();
    crate::pcapng::header(&interfaces, snaplen, &mut buf);
    conn.write_all(&buf)?;
    let mut out = CaptureOut {
        epoch_ns: start.epoch_ns,
        written: vec![0; ports.len()],
        first: None,
        last: start.epoch_ns,
        buf,
    };
    let mut probe = conn.try_clone()?;
    let mut checked = std::time::Instant::now();
    loop {
        // Whether the client asked to end, also while packets keep coming.
        if checked.elapsed() >= Duration::from_millis(100) {
            checked = std::time::Instant::now();
            if peer_closed(&mut probe) {
                break;
            }
        }
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(packet) => out.write(conn, packet)?,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if peer_closed(&mut probe) {
                    break;
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    // Ended by the client (or the fabric): what the tap had handed over by then, still in
    // the channel, is written too (up to CAPTURE_QUEUE packets were left out), so that
    // each interface's statistics add up: seen = written + dropped. The data plane hands
    // packets over in the order it counts them, so those counted by now come first.
    let counted: Vec<(u64, u64)> = start
        .counters
        .iter()
        .map(|c| (c[0].load(O::Relaxed), c[1].load(O::Relaxed)))
        .collect();
    let owed = |written: &[u64]| {
        counted
            .iter()
            .zip(written)
            .any(|(&(seen, dropped), &w)| seen > dropped + w)
    };
    while owed(&out.written) {
        // (A packet counted as handed over and then found the channel full is counted
        // as dropped a moment later: not waited for long.)
        let Ok(packet) = rx.recv_timeout(Duration::from_millis(20)) else {
            break;
        };
        out.write(conn, packet)?;
    }
    let CaptureOut {
        written,
        first,
        last,
        mut buf,
        ..
    } = out;
    buf.clear();
    let why = ended.get().words();
    for (i, w) in written.iter().enumerate() {
        let (seen, dropped) = counted[i];
        let c = &start.counters[i];
        let stats = crate::pcapng::Stats {
            seen,
            // (Counted after `counted` was read: see above.)
            dropped: dropped
                .max(c[1].load(O::Relaxed))
                .min(seen.saturating_sub(*w)),
            written: *w,
        };
        crate::pcapng::statistics(i as u32, first.unwrap_or(last), last, stats, why, &mut buf);
    }
    conn.write_all(&buf)?;
    conn.shutdown(std::net::Shutdown::Write)
}

/// A capture's stream as written so far: packets per interface, the first and last
/// timestamps, and the buffer blocks are built in.
struct CaptureOut {
    epoch_ns: u64,
    written: Vec<u64>,
    first: Option<u64>,
    last: u64,
    buf: Vec<u8>,
}

impl CaptureOut {
    fn write(
        &mut self,
        conn: &mut UnixStream,
        (i, t): (u32, closbox_fabric::model::Tapped),
    ) -> std::io::Result<()> {
        let ns = self.epoch_ns + t.at.as_nanos();
        self.first.get_or_insert(ns);
        self.last = self.last.max(ns);
        self.buf.clear();
        let why = t.dropped.map(|r| r.name());
        crate::pcapng::packet(i, ns, &t.data, t.len, why, &mut self.buf);
        conn.write_all(&self.buf)?;
        self.written[i as usize] += 1;
        Ok(())
    }
}

/// Sample rows a recording's connection may lag behind by (then samples are skipped).
const RECORD_QUEUE: usize = 4096;

/// Writes a recording as CSV until it ends; a comment line last says why the fabric ended
/// it (`# ended: …`).
fn stream_record(
    conn: &mut UnixStream,
    ports: &[String],
    rx: mpsc::Receiver<(u64, Vec<(u64, f64)>)>,
    ended: &EndReason,
) -> std::io::Result<()> {
    use std::fmt::Write as _;
    conn.set_write_timeout(Some(Duration::from_secs(5)))?;
    conn.write_all(b"fabric_time_s,port,queue_bytes,utilization\n")?;
    let mut probe = conn.try_clone()?;
    let mut buf = String::new();
    let mut checked = std::time::Instant::now();
    let mut write = |conn: &mut UnixStream, (t, row): (u64, Vec<(u64, f64)>)| {
        buf.clear();
        for (name, (queue, util)) in ports.iter().zip(row) {
            let _ = writeln!(buf, "{:.9},{name},{queue},{util:.4}", t as f64 / 1e9);
        }
        conn.write_all(buf.as_bytes())
    };
    loop {
        if checked.elapsed() >= Duration::from_millis(100) {
            checked = std::time::Instant::now();
            if peer_closed(&mut probe) {
                break;
            }
        }
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(sample) => write(conn, sample)?,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if peer_closed(&mut probe) {
                    break;
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    // Ended by the client: the samples taken by then are written too.
    while let Ok(sample) = rx.try_recv() {
        write(conn, sample)?;
    }
    if let Some(why) = ended.get().words() {
        conn.write_all(format!("{RECORD_ENDED}{why}\n").as_bytes())?;
    }
    conn.shutdown(std::net::Shutdown::Write)
}

/// How a recording's last line says why the fabric ended it.
pub const RECORD_ENDED: &str = "# ended: ";

/// The client shut down its side of the connection (or it is gone).
fn peer_closed(conn: &mut UnixStream) -> bool {
    if conn.set_nonblocking(true).is_err() {
        return true;
    }
    let mut b = [0u8; 64];
    let closed = match conn.read(&mut b) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    };
    let _ = conn.set_nonblocking(false);
    closed
}

fn reply(conn: &mut UnixStream, r: &Reply) -> std::io::Result<()> {
    conn.set_write_timeout(Some(Duration::from_secs(5)))?;
    write_line(conn, r)
}

/// Writes `body` (versioned) as one JSON line, in one piece: `serde_json` writes each
/// token on its own, which on a socket was a system call per token (a status of 1,024
/// GPUs took ~0.45 s, mostly sends of a few bytes and the client's reads of them).
fn write_line<T: Serialize>(conn: &mut UnixStream, body: &T) -> std::io::Result<()> {
    conn.write_all(&encode(body)?)
}

fn encode<T: Serialize>(body: &T) -> std::io::Result<Vec<u8>> {
    let mut line = serde_json::to_vec(&Versioned {
        v: API_VERSION,
        body,
    })?;
    line.push(b'\n');
    Ok(line)
}

/// How long `req` is on the wire, and whether the daemon takes it (`MAX_REQUEST`).
pub fn request_fits(req: &Request) -> (usize, bool) {
    let len = encode(req).map_or(usize::MAX, |l| l.len());
    (len, len as u64 <= MAX_REQUEST)
}

/// A request line the daemon takes, or an error that says why not (the daemon would
/// close the connection half-way, and the client see a broken pipe).
fn request_line(req: &Request) -> anyhow::Result<Vec<u8>> {
    let line = encode(req)?;
    if line.len() as u64 > MAX_REQUEST {
        bail!(
            "a request of {} is longer than the {} the daemon takes",
            closbox_fabric::units::approx_bytes(line.len() as u64),
            closbox_fabric::units::approx_bytes(MAX_REQUEST)
        );
    }
    Ok(line)
}

fn read_request(conn: &mut UnixStream) -> anyhow::Result<Request> {
    let line = crate::head::read_head(conn, b"\n", MAX_REQUEST as usize, REQUEST_DEADLINE)?;
    let line = std::str::from_utf8(&line).context("a request that is not UTF-8")?;
    parse_request(line.trim())
}

/// A request line, checked for this daemon's API version.
fn parse_request(line: &str) -> anyhow::Result<Request> {
    match version_of(line) {
        Some(v) if v == API_VERSION as u64 => {}
        Some(v) => bail!(
            "this daemon speaks control API v{API_VERSION}, the client v{v}: use the closbox that started the fabric (or `closbox down` it and `up` it again)"
        ),
        None => bail!("not a JSON request"),
    }
    let r: Versioned<Request> = serde_json::from_str(line)?;
    Ok(r.body)
}

/// A reply line, checked for this client's API version.
fn parse_reply(fabric: &FabricName, line: &str) -> anyhow::Result<Reply> {
    match version_of(line) {
        Some(v) if v == API_VERSION as u64 => {}
        Some(v) => bail!(
            "the daemon of fabric {fabric} speaks control API v{v}, this closbox v{API_VERSION}: use the closbox binary that started it (or `closbox down {fabric}` and `up` it again)"
        ),
        None => bail!("the daemon of fabric {fabric} sent something that is not JSON"),
    }
    let r: Versioned<Reply> = serde_json::from_str(line)
        .with_context(|| format!("reading the reply of fabric {fabric}'s daemon"))?;
    Ok(r.body)
}

/// Asks the data plane and waits (up to 5 s) for its answer.
fn ask<T>(
    ctl: &Mutex<Sender<Ctl>>,
    wake: &EventFd,
    make: impl FnOnce(Sender<T>) -> Ctl,
) -> Result<T, String> {
    let (tx, rx) = mpsc::channel();
    if ctl.lock().expect("control lock").send(make(tx)).is_err() {
        return Err("the data plane has stopped".into());
    }
    wake.notify();
    rx.recv_timeout(Duration::from_secs(5))
        .map_err(|_| "the data plane did not answer within 5 s".into())
}

fn status(
    state: &State,
    ifindex: &[u32],
    ctl: &Mutex<Sender<Ctl>>,
    wake: &EventFd,
    tcp: bool,
) -> Reply {
    let (tx, rx) = mpsc::channel();
    if ctl
        .lock()
        .expect("control lock")
        .send(Ctl::Status(tx))
        .is_err()
    {
        return Reply::error("the data plane has stopped");
    }
    wake.notify();
    let mut s: Status = match rx.recv_timeout(Duration::from_secs(5)) {
        Ok(s) => s,
        Err(_) => return Reply::error("the data plane did not answer within 5 s"),
    };
    add_kernel_drops(&mut s, &state.gpus, ifindex, tcp);
    Reply::Status(Box::new(s))
}

/// Adds to a status from the data plane the drops the GPUs' kernels counted (`status`
/// and `/metrics`): at their TUNs (`ifindex[i]`: GPU `i`'s), and at their sockets. Of the
/// interfaces still there: a GPU's host may have deleted its own.
///
/// With `tcp`, also the GPUs' TCP settings (`Status::gpu_tcp`): `closbox status` asks for
/// them, a scrape and what polls do not (they cost ~60 µs a GPU to read, the walk to
/// `/proc/sys/net/ipv4` in each namespace: a status of 1,024 GPUs took 111-118 ms with
/// them, 49-56 without).
pub(crate) fn add_kernel_drops(
    s: &mut Status,
    gpus: &[crate::state::GpuState],
    ifindex: &[u32],
    tcp: bool,
) {
    if let Ok(d) = crate::netns::tun_dropped(gpus, ifindex, tcp) {
        s.tun_tx_dropped = Some(d.iter().flatten().map(|d| d.tx).sum());
        s.gpu_rx_dropped = Some(d.iter().flatten().map(|d| d.rx).sum());
        s.gpu_socket_dropped = Some(d.iter().flatten().filter_map(|d| d.udp_rcvbuf).sum());
        if !tcp {
            return;
        }
        let mut groups: Vec<crate::dataplane::GpuTcp> = Vec::new();
        for (g, d) in gpus.iter().zip(&d) {
            let Some((cc, ecn)) = d.as_ref().and_then(|d| d.tcp.as_ref()) else {
                continue;
            };
            match groups
                .iter_mut()
                .find(|t| t.congestion == *cc && t.ecn == *ecn)
            {
                Some(t) => t.gpus.push(g.name.clone()),
                None => groups.push(crate::dataplane::GpuTcp {
                    congestion: cc.clone(),
                    ecn: *ecn,
                    gpus: vec![g.name.clone()],
                }),
            }
        }
        s.gpu_tcp = groups;
    }
}

/// How long a client waits for the daemon's reply.
const REPLY_DEADLINE: Duration = Duration::from_secs(15);

/// A reply that did not come: past the deadline, what the daemon's process is doing
/// (stopped by a signal or a debugger, gone), else the error as it is.
fn unanswered(fabric: &FabricName, e: std::io::Error) -> anyhow::Error {
    use std::io::ErrorKind;
    if !matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) {
        return e.into();
    }
    let secs = REPLY_DEADLINE.as_secs();
    let Ok(Some(st)) = State::load(fabric) else {
        return anyhow::anyhow!("the daemon of fabric {fabric} did not answer within {secs} s");
    };
    let pid = st.daemon_pid;
    let why = match crate::state::process_state(pid) {
        _ if !st.daemon_alive() => {
            format!("it is gone; `closbox down {fabric}` cleans up after it")
        }
        Some('T' | 't') => format!(
            "it is stopped (a SIGSTOP, Ctrl-Z or a debugger): `kill -CONT {pid}` resumes it"
        ),
        Some('D') => "it is waiting in the kernel (uninterruptible sleep)".to_owned(),
        _ => format!(
            "it is running but busy; its log: {}",
            fabric.log_path().display()
        ),
    };
    anyhow::anyhow!(
        "the daemon of fabric {fabric} (pid {pid}) did not answer within {secs} s: {why}"
    )
}

/// Sends one request to a fabric's daemon.
pub fn request(fabric: &FabricName, req: &Request) -> anyhow::Result<Reply> {
    let sent = request_line(req)?;
    let (reply, _) = exchange(fabric, &sent, 64 << 20)?;
    Ok(reply)
}

/// Starts a streaming request (capture, record): the daemon's reply, and the connection,
/// read past the reply line, from which the stream follows. Shutting down the
/// connection's write side asks the daemon to end it.
pub fn open_stream(
    fabric: &FabricName,
    req: &Request,
) -> anyhow::Result<(Reply, BufReader<UnixStream>)> {
    let sent = request_line(req)?;
    let (reply, reader) = exchange(fabric, &sent, 1 << 20)?;
    reader.get_ref().set_read_timeout(None)?;
    Ok((reply, reader))
}

/// How long a client keeps asking a daemon that serves `MAX_CLIENTS` already.
const BUSY_FOR: Duration = Duration::from_secs(10);

/// Sends a request line and reads the reply line (at most `limit` bytes), asking again
/// while the daemon is busy with `MAX_CLIENTS` others: it then answers "busy" without
/// reading the request, so the request was not acted on (the write may fail, or the
/// read be reset, for the bytes it left unread); or with `MAX_STREAMS` streams, when
/// the request is one more: "busy" again, having read it but not acted on it.
fn exchange(
    fabric: &FabricName,
    sent: &[u8],
    limit: u64,
) -> anyhow::Result<(Reply, BufReader<UnixStream>)> {
    use std::io::ErrorKind;
    let path = fabric.control_path();
    let began = std::time::Instant::now();
    let mut pause = Duration::from_millis(5);
    // What the daemon said last (a refusal it could not write says nothing).
    let mut why =
        format!("it serves {MAX_CLIENTS} clients at once (commands, captures, recordings, `top`s)");
    loop {
        let conn = UnixStream::connect(&path).with_context(|| {
            format!(
                "connecting to the daemon of fabric {fabric} ({})",
                path.display()
            )
        })?;
        conn.set_read_timeout(Some(REPLY_DEADLINE))?;
        let refused = |e: &std::io::Error| {
            matches!(e.kind(), ErrorKind::BrokenPipe | ErrorKind::ConnectionReset)
        };
        // Every arm that does not return is the daemon saying it is busy.
        match (&conn).write_all(sent) {
            Err(e) if refused(&e) => {}
            Err(e) => return Err(e.into()),
            Ok(()) => {
                let mut reader = BufReader::new(conn);
                let mut line = String::new();
                match (&mut reader).take(limit).read_line(&mut line) {
                    Err(e) if refused(&e) => {}
                    Err(e) => return Err(unanswered(fabric, e)),
                    Ok(_) if line.is_empty() => {
                        bail!("the daemon of fabric {fabric} closed the connection")
                    }
                    Ok(_) => match parse_reply(fabric, &line)? {
                        Reply::Error { message } if message.starts_with(BUSY) => {
                            why = message[BUSY.len()..].trim().to_string();
                        }
                        reply => return Ok((reply, reader)),
                    },
                }
            }
        }
        if began.elapsed() >= BUSY_FOR {
            bail!(
                "the daemon of fabric {fabric} stayed busy for {} s: {why}",
                BUSY_FOR.as_secs()
            );
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(200));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recording_ended_by_its_client_keeps_the_samples_taken() {
        // Samples queued for a client that reads slowly and then ends the recording.
        let (tx, rx) = mpsc::sync_channel(RECORD_QUEUE);
        let ports: Vec<String> = (0..64).map(|i| format!("sw0->gpu{i}")).collect();
        for k in 0..RECORD_QUEUE as u64 {
            tx.try_send((k * 1_000, vec![(1500, 0.5); ports.len()]))
                .unwrap();
        }
        let (mut daemon, mut client) = UnixStream::pair().unwrap();
        client.shutdown(std::net::Shutdown::Write).unwrap();
        let ended = EndReason::default();
        let served = std::thread::spawn(move || stream_record(&mut daemon, &ports, rx, &ended));
        std::thread::sleep(Duration::from_millis(300));
        let mut text = String::new();
        client.read_to_string(&mut text).unwrap();
        served.join().unwrap().unwrap();
        drop(tx);
        let rows = text.lines().filter(|l| l.contains(",sw0->gpu0,")).count();
        assert_eq!(rows, RECORD_QUEUE);
    }

    #[test]
    fn a_capture_ended_by_its_client_keeps_what_it_was_handed() {
        // A capture behind its port (its channel full, the client reading slowly) that
        // the client ends: the packets still in the channel were left out, counted as
        // seen but neither written nor dropped.
        use std::sync::atomic::Ordering as O;
        let (tx, rx) = mpsc::sync_channel(CAPTURE_QUEUE);
        let start = CaptureStart {
            id: 1,
            epoch_ns: 0,
            counters: Arc::new(vec![Default::default()]),
        };
        // The data plane's side, as `drain_taps` does it: counted, then handed over.
        let sent = CAPTURE_QUEUE as u64 + 1_000;
        for k in 0..sent {
            let c = &start.counters[0];
            c[0].fetch_add(1, O::Relaxed);
            let t = closbox_fabric::model::Tapped {
                port: closbox_fabric::routing::PortId(0),
                at: closbox_fabric::Instant::from_nanos(k),
                len: 1000,
                data: vec![0x45; 1000],
                dropped: None,
            };
            if tx.try_send((0, t)).is_err() {
                c[1].fetch_add(1, O::Relaxed);
            }
        }
        let (mut daemon, client) = UnixStream::pair().unwrap();
        // Ctrl-C before reading anything: the daemon's writes block on the full socket
        // meanwhile, and it sees the end while packets are still queued.
        client.shutdown(std::net::Shutdown::Write).unwrap();
        let ended = EndReason::default();
        let served = std::thread::spawn(move || {
            stream_capture(&mut daemon, &["sw0->gpu0".into()], 128, &start, rx, &ended)
        });
        std::thread::sleep(Duration::from_millis(300));
        let mut bytes = Vec::new();
        let mut client = client;
        client.read_to_end(&mut bytes).unwrap();
        served.join().unwrap().unwrap();
        drop(tx);
        let (packets, dropped) = crate::pcapng::summarize(&bytes);
        assert_eq!(dropped, 1_000);
        assert_eq!(packets + dropped, sent, "{packets} written");
    }

    #[test]
    fn requests_carry_the_version_and_others_are_refused() {
        let line = serde_json::to_string(&Versioned {
            v: API_VERSION,
            body: &Request::Status { tcp: false },
        })
        .unwrap();
        assert_eq!(line, r#"{"v":1,"cmd":"status"}"#);
        assert_eq!(
            parse_request(&line).unwrap(),
            Request::Status { tcp: false }
        );
        assert_eq!(
            parse_request(r#"{"v":1,"cmd":"status","tcp":true}"#).unwrap(),
            Request::Status { tcp: true }
        );
        // An unversioned (older) client, and a newer one.
        for old in [r#"{"cmd":"status"}"#, r#"{"v":2,"cmd":"status"}"#] {
            let e = parse_request(old).unwrap_err().to_string();
            assert!(e.contains("control API v1"), "{e}");
        }
        assert!(parse_request(r#"{"v":1,"cmd":"reboot"}"#).is_err());
    }

    #[test]
    fn change_requests_round_trip() {
        let req = Request::Change(ChangeRequest::LinkDown {
            a: "leaf0".into(),
            b: "spine1".into(),
            index: Some(1),
        });
        let line = serde_json::to_string(&Versioned {
            v: API_VERSION,
            body: &req,
        })
        .unwrap();
        assert_eq!(
            line,
            r#"{"v":1,"cmd":"change","change":"link-down","a":"leaf0","b":"spine1","index":1}"#
        );
        assert_eq!(parse_request(&line).unwrap(), req);
    }

    #[test]
    fn events_requests_take_where_to_start_and_default_to_the_whole_log() {
        assert_eq!(
            parse_request(r#"{"v":1,"cmd":"events"}"#).unwrap(),
            Request::Events { after: 0 }
        );
        assert_eq!(
            parse_request(r#"{"v":1,"cmd":"events","after":42}"#).unwrap(),
            Request::Events { after: 42 }
        );
        for (req, line) in [
            (Request::Events { after: 0 }, r#"{"v":1,"cmd":"events"}"#),
            (
                Request::Events { after: 7 },
                r#"{"v":1,"cmd":"events","after":7}"#,
            ),
        ] {
            let sent = serde_json::to_string(&Versioned {
                v: API_VERSION,
                body: &req,
            })
            .unwrap();
            assert_eq!(sent, line);
        }
    }

    /// A schedule without `start` starts now (as before the field was there); with it,
    /// the GPUs' packets start it.
    #[test]
    fn schedule_requests_start_now_or_at_the_gpus_packets() {
        let now = parse_request(r#"{"v":1,"cmd":"schedule","items":[]}"#).unwrap();
        assert!(
            matches!(now, Request::Schedule { start: None, .. }),
            "{now:?}"
        );
        let armed = Request::Schedule {
            items: Vec::new(),
            faults: Vec::new(),
            start: Some(Trigger {
                gpus: vec!["gpu0".into(), "gpu1".into()],
                every: true,
            }),
        };
        let line = serde_json::to_string(&Versioned {
            v: API_VERSION,
            body: &armed,
        })
        .unwrap();
        assert_eq!(
            line,
            r#"{"v":1,"cmd":"schedule","items":[],"start":{"gpus":["gpu0","gpu1"],"every":true}}"#
        );
        assert_eq!(parse_request(&line).unwrap(), armed);
        let first =
            parse_request(r#"{"v":1,"cmd":"schedule","items":[],"start":{"gpus":["gpu3"]}}"#)
                .unwrap();
        assert!(
            matches!(
                &first,
                Request::Schedule {
                    start: Some(Trigger { every: false, .. }),
                    ..
                }
            ),
            "{first:?}"
        );
        // A reply's start: null while it waits; a number (or nothing, from an older daemon).
        let r: Reply = serde_json::from_str(
            r#"{"reply":"scheduled","timeline":2,"events":[],"start_ns":null}"#,
        )
        .unwrap();
        assert!(matches!(r, Reply::Scheduled { start_ns: None, .. }));
        let r: Reply =
            serde_json::from_str(r#"{"reply":"scheduled","timeline":2,"events":[],"start_ns":5}"#)
                .unwrap();
        assert!(matches!(
            r,
            Reply::Scheduled {
                start_ns: Some(5),
                ..
            }
        ));
    }

    #[test]
    fn replies_of_another_version_are_refused() {
        let name: FabricName = "f".parse().unwrap();
        let line = serde_json::to_string(&Versioned {
            v: API_VERSION,
            body: &Reply::error("x"),
        })
        .unwrap();
        assert_eq!(line, r#"{"v":1,"reply":"error","message":"x"}"#);
        assert!(matches!(parse_reply(&name, &line), Ok(Reply::Error { .. })));
        let e = parse_reply(&name, r#"{"status":{}}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("speaks control API v0, this closbox v1"), "{e}");
    }
}
