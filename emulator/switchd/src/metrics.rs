//! Prometheus metrics (`closbox up --metrics ADDR`): `GET /metrics` on a loopback address
//! answers with the fabric's counters in the OpenMetrics text format, encoded by
//! `prometheus-client` from a status snapshot (the same numbers as `status --json`).
//!
//! A thread per connection, at most `MAX_CONNECTIONS` at once, each bounded by a deadline
//! (a client trickling its request a byte at a time is cut off): connections a browser
//! opens ahead and leaves idle, or a stuck client, do not hold up a scrape. Beyond the
//! bound a connection is answered 503 at once.

use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context};
use prometheus_client::encoding::{EncodeLabelSet, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::{Registry, Unit};

use crate::dataplane::{Ctl, Status};
use crate::sys::EventFd;

/// Binds the metrics address (loopback only: the metrics describe the box's fabric, and
/// nothing of closbox listens beyond the box).
pub fn bind(addr: SocketAddr) -> anyhow::Result<TcpListener> {
    if !addr.ip().is_loopback() {
        bail!("--metrics {addr}: a loopback address only (127.0.0.1:PORT or [::1]:PORT)");
    }
    TcpListener::bind(addr).with_context(|| format!("--metrics {addr}: cannot listen"))
}

/// The GPUs whose kernels' drop counters a scrape adds (`control::add_kernel_drops`), and
/// each one's interface index.
type Gpus = Arc<(Vec<crate::state::GpuState>, Vec<u32>)>;

/// Serves `/metrics` from `listener` until the data plane stops. `gpus` and `ifindex`:
/// each GPU and its interface's index, for the drops its kernel counts.
pub fn serve(
    listener: TcpListener,
    ctl: Sender<Ctl>,
    wake: Arc<EventFd>,
    gpus: Vec<crate::state::GpuState>,
    ifindex: Vec<u32>,
) -> anyhow::Result<()> {
    let ctl = Arc::new(Mutex::new(ctl));
    let gpus: Gpus = Arc::new((gpus, ifindex));
    let open = Arc::new(AtomicUsize::new(0));
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            for mut conn in listener.incoming().flatten() {
                if open.fetch_add(1, Ordering::AcqRel) >= MAX_CONNECTIONS {
                    open.fetch_sub(1, Ordering::AcqRel);
                    let _ = conn.set_write_timeout(Some(REQUEST_DEADLINE));
                    let _ = respond(
                        &mut conn,
                        "503 Service Unavailable",
                        "text/plain",
                        "too many connections\n",
                        false,
                    );
                    continue;
                }
                let (ctl, wake, done) = (ctl.clone(), wake.clone(), open.clone());
                let gpus = gpus.clone();
                let spawned = std::thread::Builder::new()
                    .name("metrics-conn".into())
                    .spawn(move || {
                        if let Err(e) = answer(conn, &ctl, &wake, &gpus) {
                            tracing::debug!("metrics: {e:#}");
                        }
                        done.fetch_sub(1, Ordering::AcqRel);
                    });
                if let Err(e) = spawned {
                    // The connection went with the closure: closed unanswered.
                    tracing::warn!("metrics: cannot start a thread for a connection: {e}");
                    open.fetch_sub(1, Ordering::AcqRel);
                }
            }
        })?;
    Ok(())
}

/// Connections served at once; a scrape every few seconds is the real load.
const MAX_CONNECTIONS: usize = 16;

/// The time a client has to send its request head, and a response to be written: the
/// one thread serves one connection at a time, so a client that sends slowly (a byte now
/// and then) must not keep scrapes waiting longer.
const REQUEST_DEADLINE: Duration = Duration::from_secs(2);

fn answer(
    mut conn: TcpStream,
    ctl: &Mutex<Sender<Ctl>>,
    wake: &EventFd,
    gpus: &Gpus,
) -> anyhow::Result<()> {
    conn.set_write_timeout(Some(REQUEST_DEADLINE))?;
    // The request head, up to 8 KiB.
    let head = match crate::head::read_head(&mut conn, b"\r\n\r\n", 8192, REQUEST_DEADLINE) {
        Ok(h) => h,
        Err(crate::head::HeadError::TooLong(_)) => {
            write!(
                conn,
                "HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            )?;
            return Ok(());
        }
        Err(e) => return Err(e.into()),
    };
    let line = String::from_utf8_lossy(&head);
    let mut words = line.split_whitespace();
    let (method, path) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    // Prometheus asks for OpenMetrics; other clients (curl, promtool) get the classic
    // text format.
    let openmetrics = line.lines().any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("accept:") && l.contains("application/openmetrics-text")
    });
    // HEAD is GET without the body (RFC 9110 9.3.2).
    let head_only = method == "HEAD";
    let get = method == "GET" || head_only;
    let (status, kind, body) = match (get, path.split('?').next().unwrap_or("")) {
        (true, "/metrics") => match snapshot(ctl, wake).map(|mut s| {
            crate::control::add_kernel_drops(&mut s, &gpus.0, &gpus.1, false);
            s
        }) {
            Some(s) if openmetrics => (
                "200 OK",
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                encode(&s),
            ),
            Some(s) => (
                "200 OK",
                "text/plain; version=0.0.4; charset=utf-8",
                classic_text(&encode(&s)),
            ),
            None => (
                "503 Service Unavailable",
                "text/plain",
                "the data plane did not answer\n".to_owned(),
            ),
        },
        (true, _) => (
            "404 Not Found",
            "text/plain",
            "only /metrics here\n".to_owned(),
        ),
        _ => (
            "405 Method Not Allowed",
            "text/plain",
            "GET or HEAD /metrics\n".to_owned(),
        ),
    };
    respond(&mut conn, status, kind, &body, head_only)
}

fn respond(
    conn: &mut TcpStream,
    status: &str,
    kind: &str,
    body: &str,
    head_only: bool,
) -> anyhow::Result<()> {
    let mut out = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    if status.starts_with("405") {
        out += "Allow: GET, HEAD\r\n";
    }
    out += "\r\n";
    if !head_only {
        out += body;
    }
    conn.write_all(out.as_bytes())?;
    Ok(())
}

fn snapshot(ctl: &Mutex<Sender<Ctl>>, wake: &EventFd) -> Option<Status> {
    let (tx, rx) = std::sync::mpsc::channel();
    ctl.lock().ok()?.send(Ctl::Status(tx)).ok()?;
    wake.notify();
    rx.recv_timeout(Duration::from_secs(5)).ok()
}

/// A per-port gauge: name, help, unit, value.
type PortGauge<'a> = (
    &'a str,
    &'a str,
    Option<Unit>,
    &'a dyn Fn(&crate::dataplane::PortStatus) -> i64,
);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PortLabels {
    fabric: String,
    port: String,
    from: String,
    to: String,
    tier: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PortReason {
    fabric: String,
    port: String,
    from: String,
    to: String,
    tier: String,
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FabricLabel {
    fabric: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FabricReason {
    fabric: String,
    reason: String,
}

/// A histogram from counts already kept elsewhere (the data plane's lateness histogram):
/// per upper bound (seconds), the samples in that bucket alone; labelled with its fabric,
/// as every other sample is (without it a dashboard's fabric filter missed it, and two
/// fabrics' histograms scraped into one Prometheus summed into one).
#[derive(Debug)]
struct FixedHistogram {
    fabric: FabricLabel,
    sum: f64,
    count: u64,
    buckets: Vec<(f64, u64)>,
}

impl TypedMetric for FixedHistogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for FixedHistogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        encoder
            .encode_family(&self.fabric)?
            .encode_histogram::<prometheus_client::encoding::NoLabelSet>(
                self.sum,
                self.count,
                &self.buckets,
                None,
            )
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

/// Upper bounds of the lateness histogram, seconds of wall time.
const LATENESS_BOUNDS: [f64; 16] = [
    1e-6, 2e-6, 5e-6, 10e-6, 20e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 20e-3,
    50e-3, 100e-3,
];

fn lateness(fabric: FabricLabel, buckets: &[(u64, u64)]) -> FixedHistogram {
    let mut out: Vec<(f64, u64)> = LATENESS_BOUNDS.iter().map(|&b| (b, 0)).collect();
    out.push((f64::MAX, 0));
    let (mut sum, mut count) = (0.0, 0);
    for &(ns, n) in buckets {
        let s = ns as f64 / 1e9;
        sum += s * n as f64;
        count += n;
        let i = LATENESS_BOUNDS
            .iter()
            .position(|&b| s <= b)
            .unwrap_or(LATENESS_BOUNDS.len());
        out[i].1 += n;
    }
    FixedHistogram {
        fabric,
        sum,
        count,
        buckets: out,
    }
}

/// The snapshot in the OpenMetrics text format.
pub fn encode(s: &Status) -> String {
    let mut reg = Registry::with_prefix("closbox");
    let fabric = FabricLabel {
        fabric: s.fabric.clone(),
    };
    let port_family = |reg: &mut Registry,
                       name: &str,
                       help: &str,
                       unit: Option<Unit>,
                       f: &dyn Fn(&crate::dataplane::PortStatus) -> u64| {
        let fam = Family::<PortLabels, Counter>::default();
        for p in &s.ports {
            fam.get_or_create(&labels(s, p)).inc_by(f(p));
        }
        match unit {
            Some(u) => reg.register_with_unit(name, help, u, fam),
            None => reg.register(name, help, fam),
        }
    };
    port_family(
        &mut reg,
        "port_tx_packets",
        "GPU packets sent by an egress port",
        None,
        &|p| p.tx_packets,
    );
    port_family(
        &mut reg,
        "port_tx",
        "GPU bytes (IP) sent by an egress port",
        Some(Unit::Bytes),
        &|p| p.tx_bytes,
    );
    port_family(
        &mut reg,
        "port_ecn_marked",
        "GPU packets an egress port set CE on",
        None,
        &|p| p.ecn_marked,
    );
    port_family(
        &mut reg,
        "port_load_tx",
        "Synthetic load bytes sent by an egress port",
        Some(Unit::Bytes),
        &|p| p.load_tx_bytes,
    );
    port_family(
        &mut reg,
        "port_load_drops",
        "Synthetic load packets dropped at an egress port",
        None,
        &|p| p.load_drops,
    );
    // Fabric seconds per port, as f64 counters.
    let port_seconds = |reg: &mut Registry,
                        name: &str,
                        help: &str,
                        f: &dyn Fn(&crate::dataplane::PortStatus) -> f64| {
        let fam = Family::<PortLabels, Counter<f64, std::sync::atomic::AtomicU64>>::default();
        for p in &s.ports {
            fam.get_or_create(&labels(s, p)).inc_by(f(p));
        }
        reg.register_with_unit(name, help, Unit::Seconds, fam);
    };
    // Fabric seconds a port spent sending (GPU packets and load): its utilization over a
    // window is rate(...) × time_scale (rate() is per wall second).
    port_seconds(
        &mut reg,
        "port_busy",
        "Fabric time an egress port spent sending",
        &|p| p.utilization * s.fabric_time_s,
    );
    port_family(
        &mut reg,
        "port_pause_events",
        "Lossless fabrics: times the next switch stopped an egress port (PFC pause, or credits out)",
        None,
        &|p| p.pause_events,
    );
    port_seconds(
        &mut reg,
        "port_paused",
        "Lossless fabrics: fabric time an egress port was stopped by the next switch",
        &|p| p.paused_s,
    );
    let drops = Family::<PortReason, Counter>::default();
    for p in &s.ports {
        let l = labels(s, p);
        for (reason, v) in [
            ("buffer_full", p.drops_buffer),
            ("loss", p.drops_loss),
            ("link_down", p.drops_link_down),
            ("over_mtu", p.drops_over_mtu),
        ] {
            drops
                .get_or_create(&PortReason {
                    fabric: l.fabric.clone(),
                    port: l.port.clone(),
                    from: l.from.clone(),
                    to: l.to.clone(),
                    tier: l.tier.clone(),
                    reason: reason.into(),
                })
                .inc_by(v);
        }
    }
    reg.register(
        "port_drops",
        "GPU packets dropped at an egress port, by reason",
        drops,
    );
    let gauges: [PortGauge; 4] = [
        (
            "port_queue",
            "Bytes queued at an egress port now",
            Some(Unit::Bytes),
            &|p| p.queue_bytes as i64,
        ),
        (
            "port_queue_peak",
            "Most bytes queued at an egress port since the fabric came up",
            Some(Unit::Bytes),
            &|p| p.max_queue_bytes as i64,
        ),
        (
            "port_rate",
            "Rate of an egress port's link now, bit/s",
            None,
            &|p| p.rate_bps as i64,
        ),
        ("port_up", "1 if an egress port's link is up", None, &|p| {
            i64::from(p.up)
        }),
    ];
    for (name, help, unit, f) in gauges {
        let fam = Family::<PortLabels, Gauge>::default();
        for p in &s.ports {
            fam.get_or_create(&labels(s, p)).set(f(p));
        }
        match unit {
            Some(u) => reg.register_with_unit(name, help, u, fam),
            None => reg.register(name, help, fam),
        }
    }
    let one = |reg: &mut Registry, name: &str, help: &str, v: u64| {
        let fam = Family::<FabricLabel, Counter>::default();
        fam.get_or_create(&fabric).inc_by(v);
        reg.register(name, help, fam);
    };
    one(
        &mut reg,
        "packets_in",
        "Packets that entered the fabric: from the GPUs, and the ICMP time exceeded its switches answered with",
        s.packets_in,
    );
    one(
        &mut reg,
        "packets_delivered",
        "Packets the fabric delivered to GPUs",
        s.delivered,
    );
    one(
        &mut reg,
        "events",
        "Changes applied to the fabric (closbox events)",
        s.events,
    );
    one(
        &mut reg,
        "icmp_limited",
        "ICMP answers the switches' control-plane policers held back (icmp_rate): never sent",
        s.icmp_limited.iter().map(|(_, n)| n).sum(),
    );
    one(
        &mut reg,
        "io_errors",
        "Failed TUN reads, writes and waits (a coalesced write counts once)",
        s.io_errors,
    );
    one(
        &mut reg,
        "writes_handed_off",
        "TUN writes the data plane handed to its writer threads (CLOSBOX_TUN_WRITERS; only writes 20 us late or more)",
        s.writes_handed_off,
    );
    let fabric_drops = Family::<FabricReason, Counter>::default();
    for (reason, v) in &s.drops {
        fabric_drops
            .get_or_create(&FabricReason {
                fabric: s.fabric.clone(),
                reason: reason.clone(),
            })
            .inc_by(*v);
    }
    for (reason, count) in s.kernel_drops() {
        if let Some(c) = count {
            fabric_drops
                .get_or_create(&FabricReason {
                    fabric: s.fabric.clone(),
                    reason: reason.into(),
                })
                .inc_by(c);
        }
    }
    reg.register(
        "drops",
        "Packets dropped, fabric-wide, by reason",
        fabric_drops,
    );
    let gauge_f = |reg: &mut Registry, name: &str, help: &str, unit: Option<Unit>, v: f64| {
        let fam = Family::<FabricLabel, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
        fam.get_or_create(&fabric).set(v);
        match unit {
            Some(u) => reg.register_with_unit(name, help, u, fam),
            None => reg.register(name, help, fam),
        }
    };
    gauge_f(
        &mut reg,
        "fabric_time",
        "Fabric time since the fabric came up",
        Some(Unit::Seconds),
        s.fabric_time_s,
    );
    gauge_f(
        &mut reg,
        "uptime",
        "Wall time since the fabric came up",
        Some(Unit::Seconds),
        s.uptime_s,
    );
    gauge_f(
        &mut reg,
        "time_scale",
        "Wall seconds per fabric second",
        None,
        s.time_scale.get(),
    );
    gauge_f(
        &mut reg,
        "queued_packets",
        "GPU packets queued in the fabric now",
        None,
        s.queued as f64,
    );
    gauge_f(
        &mut reg,
        "packet_memory",
        "Bytes held for packets in the fabric now",
        Some(Unit::Bytes),
        s.packet_memory as f64,
    );
    gauge_f(
        &mut reg,
        "loads_active",
        "Synthetic loads running",
        None,
        s.loads.iter().filter(|l| l.active).count() as f64,
    );
    gauge_f(
        &mut reg,
        "timelines_running",
        "Chaos scenarios (timelines) with changes pending or loads running",
        None,
        s.timelines.len() as f64,
    );
    gauge_f(
        &mut reg,
        "timelines_waiting",
        "Of those, scenarios waiting for the GPUs' packets to start them",
        None,
        s.timelines.iter().filter(|t| t.waiting.is_some()).count() as f64,
    );
    gauge_f(
        &mut reg,
        "changes_pending",
        "Scheduled changes not made yet (scenarios, flaps)",
        None,
        s.pending_changes as f64,
    );
    gauge_f(
        &mut reg,
        "partitioned",
        "1 while a partition cuts GPUs off from each other",
        None,
        f64::from(u8::from(!s.partition.is_empty())),
    );
    gauge_f(
        &mut reg,
        "behind",
        "1 if the box is not keeping up (recent p99 lateness above the bar)",
        None,
        f64::from(u8::from(s.behind)),
    );
    if let Some(c) = &s.cpu_recent {
        gauge_f(
            &mut reg,
            "dataplane_busy",
            "Share of a CPU the data-plane thread ran, over the recent window",
            None,
            c.busy,
        );
        gauge_f(
            &mut reg,
            "dataplane_cpu_wait",
            "Share of the recent window the data-plane thread was runnable but waiting for a CPU",
            None,
            c.waited_ms / 1e3 / c.window_s.max(1e-9),
        );
        gauge_f(
            &mut reg,
            "box_cpu_steal",
            "Share of the box's CPU time the hypervisor gave to other machines (steal), over the recent window",
            None,
            c.steal,
        );
    }
    reg.register_with_unit(
        "write_lateness",
        "How late packets left the fabric (write start minus scheduled departure, wall time)",
        Unit::Seconds,
        lateness(fabric.clone(), &s.lateness_buckets),
    );
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &reg).expect("writing to a String");
    out
}

/// The Prometheus text format (0.0.4) of an OpenMetrics text: a counter's HELP and TYPE
/// name its samples' `_total` name, and there are no UNIT or EOF lines.
pub fn classic_text(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line.starts_with("# UNIT ") || line == "# EOF" {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .into_iter()
            .find(|p| line.starts_with(p));
        match meta {
            Some(prefix) => {
                let rest = &line[prefix.len()..];
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                if counters.contains(name) {
                    out.push_str(&format!("{prefix}{name}_total {tail}"));
                } else {
                    out.push_str(line);
                }
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

fn labels(s: &Status, p: &crate::dataplane::PortStatus) -> PortLabels {
    let (from, to) = crate::chaos::port_ends(&p.port);
    PortLabels {
        fabric: s.fabric.clone(),
        port: p.port.clone(),
        from: from.to_owned(),
        to: to.to_owned(),
        tier: p.class.clone(),
    }
}
