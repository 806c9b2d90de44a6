//! Streams to clients: packet captures (taps on the model's ports, pcapng) and recordings
//! of queue depth and utilization sampled at a fabric-time interval.

use std::sync::Arc;
use std::time::Instant as StdInstant;

use closbox_fabric::Instant;

use super::{DataPlane, Ports, MAX_RECORD_SAMPLES_PER_WALL_S, SHORT_RECORD_SAMPLES};

/// Why a capture or recording ended, as the data plane saw it: the stream that writes it
/// out says so at its end (the file records it, the client tells its user).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum StreamEnd {
    /// Not ended, or by its client (which then knows why).
    Open = 0,
    /// `--count` packets were captured.
    Count = 1,
    /// `--duration` of fabric time passed.
    Duration = 2,
    /// The fabric went down.
    FabricDown = 3,
}

impl StreamEnd {
    /// The words for "ended: …", or none for an open stream.
    pub fn words(self) -> Option<&'static str> {
        match self {
            StreamEnd::Open => None,
            StreamEnd::Count => Some("its count was reached"),
            StreamEnd::Duration => Some("its duration of fabric time passed"),
            StreamEnd::FabricDown => Some("the fabric went down"),
        }
    }

    /// Read back from `words`.
    pub fn from_words(s: &str) -> Option<StreamEnd> {
        [StreamEnd::Count, StreamEnd::Duration, StreamEnd::FabricDown]
            .into_iter()
            .find(|e| e.words() == Some(s))
    }
}

/// Where the data plane says why a stream ended (shared with the thread writing it out;
/// the first reason set stays).
#[derive(Clone, Debug, Default)]
pub struct EndReason(Arc<std::sync::atomic::AtomicU8>);

impl EndReason {
    pub fn set(&self, why: StreamEnd) {
        use std::sync::atomic::Ordering;
        let _ = self.0.compare_exchange(
            StreamEnd::Open as u8,
            why as u8,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }

    pub fn get(&self) -> StreamEnd {
        match self.0.load(std::sync::atomic::Ordering::Acquire) {
            1 => StreamEnd::Count,
            2 => StreamEnd::Duration,
            3 => StreamEnd::FabricDown,
            _ => StreamEnd::Open,
        }
    }
}

/// What a recording asks for.
#[derive(Debug)]
pub struct RecordSpec {
    /// Port names.
    pub ports: Vec<String>,
    pub interval_ns: u64,
    pub duration_ns: Option<u64>,
    /// Per sample time: (fabric ns, per port (queue bytes, busy share of the interval)).
    pub tx: std::sync::mpsc::SyncSender<(u64, Vec<(u64, f64)>)>,
    pub ended: EndReason,
}

pub(super) struct Recording {
    pub(super) id: u64,
    ports: Vec<closbox_fabric::routing::PortId>,
    interval: closbox_fabric::Duration,
    pub(super) next: Instant,
    until: Option<Instant>,
    tx: std::sync::mpsc::SyncSender<(u64, Vec<(u64, f64)>)>,
    pub(super) ended: EndReason,
    last_busy: Vec<u64>,
    done: bool,
    /// Port samples a second of wall time it takes (0 for a short one), for the budget.
    samples_per_wall_s: f64,
}

/// Shortest sampling interval, fabric time.
pub const MIN_RECORD_INTERVAL_NS: u64 = 100;

/// What a capture asks for.
#[derive(Debug)]
pub struct CaptureSpec {
    /// Port names ("leaf0->spine1").
    pub ports: Vec<String>,
    pub snaplen: u32,
    /// Also packets dropped at those ports, with their reason.
    pub drops: bool,
    /// Ends after this many packets.
    pub count: Option<u64>,
    /// Ends after this much fabric time.
    pub duration_ns: Option<u64>,
    /// Where tapped packets go: (index in `ports`, packet).
    pub tx: std::sync::mpsc::SyncSender<(u32, closbox_fabric::model::Tapped)>,
    pub ended: EndReason,
}

/// A capture, started.
#[derive(Debug)]
pub struct CaptureStart {
    pub id: u64,
    /// Wall clock (ns since the Unix epoch) at fabric time 0: packet times are this plus
    /// their fabric time, so a dilated capture reads in fabric time.
    pub epoch_ns: u64,
    /// Per captured port: packets seen, and not kept (the channel was full).
    pub counters: Arc<Vec<[std::sync::atomic::AtomicU64; 2]>>,
}

pub(super) struct Capture {
    pub(super) id: u64,
    /// Per port of the fabric: its index in the capture, if captured.
    index_of: Vec<Option<u32>>,
    tx: std::sync::mpsc::SyncSender<(u32, closbox_fabric::model::Tapped)>,
    pub(super) ended: EndReason,
    counters: Arc<Vec<[std::sync::atomic::AtomicU64; 2]>>,
    left: Option<u64>,
    pub(super) until: Option<Instant>,
    drops: bool,
    snaplen: u32,
    done: bool,
}

impl<P: Ports> DataPlane<P> {
    pub(super) fn start_recording(&mut self, spec: RecordSpec) -> Result<u64, String> {
        let mut ports = Vec::new();
        for name in &spec.ports {
            let p = self
                .port_names
                .iter()
                .position(|n| n == name)
                .ok_or_else(|| format!("no port {name:?}"))?;
            ports.push(closbox_fabric::routing::PortId(p as u32));
        }
        if ports.is_empty() {
            return Err("no port to record".into());
        }
        if spec.interval_ns < MIN_RECORD_INTERVAL_NS {
            return Err(format!(
                "--interval must be at least {MIN_RECORD_INTERVAL_NS} ns of fabric time"
            ));
        }
        if let Some(d) = spec.duration_ns.filter(|&d| d < spec.interval_ns) {
            return Err(format!(
                "--interval {} is longer than --duration {}: no sample would be taken",
                closbox_fabric::Duration::from_nanos(spec.interval_ns),
                closbox_fabric::Duration::from_nanos(d)
            ));
        }
        let short = spec.duration_ns.is_some_and(|d| {
            ports.len() as f64 * (d / spec.interval_ns) as f64 <= SHORT_RECORD_SAMPLES
        });
        let asked = if short {
            0.0
        } else {
            ports.len() as f64 * 1e9 / spec.interval_ns as f64 / self.time_scale.get()
        };
        let others: f64 = self.recordings.iter().map(|r| r.samples_per_wall_s).sum();
        if asked + others > MAX_RECORD_SAMPLES_PER_WALL_S {
            let running = if others > 0.0 {
                format!(" ({:.0} with the recordings running)", asked + others)
            } else {
                String::new()
            };
            // The longest recording held to no budget (`short`) at this interval.
            let rounds = (SHORT_RECORD_SAMPLES / ports.len() as f64).floor() as u64;
            let duration = if rounds >= 1 {
                format!(
                    ", or a --duration of at most {} (a recording of at most {SHORT_RECORD_SAMPLES} port samples in all is taken at any rate)",
                    closbox_fabric::Duration::from_nanos(rounds.saturating_mul(spec.interval_ns))
                )
            } else {
                String::new()
            };
            return Err(format!(
                "{} ports every {} of fabric time at time_scale {} are {asked:.0} port samples a second of wall time{running}, more than the {MAX_RECORD_SAMPLES_PER_WALL_S} the data plane takes beside its packets: a longer --interval, fewer --ports, a larger time_scale{duration}",
                ports.len(),
                closbox_fabric::Duration::from_nanos(spec.interval_ns),
                self.time_scale,
            ));
        }
        let now = self.fabric_now(self.ports.now());
        self.next_capture += 1;
        let last_busy = ports
            .iter()
            .map(|&p| self.model.port_sample(p, now).1.as_nanos())
            .collect();
        let interval = closbox_fabric::Duration::from_nanos(spec.interval_ns);
        self.recordings.push(Recording {
            id: self.next_capture,
            ports,
            interval,
            next: now + interval,
            until: spec
                .duration_ns
                .map(|d| now + closbox_fabric::Duration::from_nanos(d)),
            tx: spec.tx,
            ended: spec.ended,
            last_busy,
            done: false,
            samples_per_wall_s: asked,
        });
        Ok(self.next_capture)
    }

    /// Takes the samples that are due, each at its own fabric time (the model is advanced
    /// to it first), and ends recordings that are done.
    pub(super) fn sample_due(&mut self, wall: StdInstant) {
        use std::sync::mpsc::TrySendError;
        if self.recordings.is_empty() {
            return;
        }
        let now = self.fabric_now(wall);
        while let Some(i) = (0..self.recordings.len())
            .filter(|&i| !self.recordings[i].done && self.recordings[i].next <= now)
            .min_by_key(|&i| self.recordings[i].next)
        {
            let t = self.recordings[i].next;
            let model_now = t.max(self.model.now());
            let r = &mut self.recordings[i];
            let mut row = Vec::with_capacity(r.ports.len());
            for (k, &p) in r.ports.iter().enumerate() {
                let (queue, busy) = self.model.port_sample(p, model_now);
                let busy = busy.as_nanos();
                let share = (busy - r.last_busy[k].min(busy)) as f64 / r.interval.as_nanos() as f64;
                r.last_busy[k] = busy;
                row.push((queue, share.min(1.0)));
            }
            match r.tx.try_send((t.as_nanos(), row)) {
                Ok(()) | Err(TrySendError::Full(_)) => {}
                Err(TrySendError::Disconnected(_)) => r.done = true,
            }
            r.next = t + r.interval;
            if r.until.is_some_and(|u| r.next > u) {
                r.ended.set(StreamEnd::Duration);
                r.done = true;
            }
        }
        self.recordings.retain(|r| !r.done);
    }

    /// Hands tapped packets to the captures that want them; ends captures that are done.
    pub(super) fn drain_taps(&mut self) {
        use std::sync::atomic::Ordering;
        use std::sync::mpsc::TrySendError;
        if self.captures.is_empty() {
            return;
        }
        while let Some(t) = self.model.poll_tapped() {
            for c in self.captures.iter_mut().filter(|c| !c.done) {
                let Some(i) = c.index_of[t.port.0 as usize] else {
                    continue;
                };
                if t.dropped.is_some() && !c.drops {
                    continue;
                }
                c.counters[i as usize][0].fetch_add(1, Ordering::Relaxed);
                let mut copy = t.clone();
                // What the wire would carry: offloaded frames hold partial checksums.
                crate::offload::fill_checksum(&mut copy.data);
                copy.data.truncate(c.snaplen as usize);
                match c.tx.try_send((i, copy)) {
                    Ok(()) => {
                        if let Some(left) = &mut c.left {
                            *left -= 1;
                            if *left == 0 {
                                c.ended.set(StreamEnd::Count);
                                c.done = true;
                            }
                        }
                    }
                    Err(TrySendError::Full(_)) => {
                        c.counters[i as usize][1].fetch_add(1, Ordering::Relaxed);
                    }
                    Err(TrySendError::Disconnected(_)) => c.done = true,
                }
            }
        }
        let now = self.fabric_now(self.ports.now());
        for c in self.captures.iter_mut().filter(|c| !c.done) {
            if c.until.is_some_and(|u| now >= u) {
                c.ended.set(StreamEnd::Duration);
                c.done = true;
            }
        }
        if self.captures.iter().any(|c| c.done) {
            self.captures.retain(|c| !c.done);
            self.retap();
        }
    }

    /// Taps the union of what the captures want.
    pub(super) fn retap(&mut self) {
        let mut ports = Vec::new();
        let (mut snaplen, mut drops) = (0, false);
        for c in &self.captures {
            for (p, i) in c.index_of.iter().enumerate() {
                if i.is_some() {
                    ports.push(closbox_fabric::routing::PortId(p as u32));
                }
            }
            snaplen = snaplen.max(c.snaplen);
            drops |= c.drops;
        }
        ports.sort();
        ports.dedup();
        self.model.set_taps(&ports, snaplen, drops);
    }

    pub(super) fn start_capture(&mut self, spec: CaptureSpec) -> Result<CaptureStart, String> {
        let mut index_of = vec![None; self.port_names.len()];
        for (i, name) in spec.ports.iter().enumerate() {
            let p = self
                .port_names
                .iter()
                .position(|n| n == name)
                .ok_or_else(|| {
                    format!(
                        "no port {name:?} (ports are named like {:?})",
                        self.port_names[0]
                    )
                })?;
            if index_of[p].is_some() {
                return Err(format!("port {name} is listed twice"));
            }
            index_of[p] = Some(i as u32);
        }
        if spec.ports.is_empty() {
            return Err("no port to capture".into());
        }
        if spec.count == Some(0) || spec.duration_ns == Some(0) {
            return Err("--count and --duration must be above 0".into());
        }
        self.next_capture += 1;
        let counters: Arc<Vec<[std::sync::atomic::AtomicU64; 2]>> =
            Arc::new((0..spec.ports.len()).map(|_| Default::default()).collect());
        let now = self.fabric_now(self.ports.now());
        self.captures.push(Capture {
            id: self.next_capture,
            index_of,
            tx: spec.tx,
            ended: spec.ended,
            counters: Arc::clone(&counters),
            left: spec.count,
            until: spec
                .duration_ns
                .map(|d| now + closbox_fabric::Duration::from_nanos(d)),
            drops: spec.drops,
            snaplen: spec.snaplen,
            done: false,
        });
        self.retap();
        Ok(CaptureStart {
            id: self.next_capture,
            epoch_ns: self.epoch_ns,
            counters,
        })
    }
}
