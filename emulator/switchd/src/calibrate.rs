//! `time_scale = "auto"`: at `up`, before the fabric serves, find the smallest time scale
//! at which this box carries every GPU sending at its line rate, through the real data
//! path (the fabric's own TUNs, namespaces, kernel TCP stacks and model).
//!
//! Each trial runs a data plane at a candidate scale for a moment with TCP streams between
//! the fabric's GPUs (opened by threads inside their namespaces): up to 16 GPUs, each
//! sending to its neighbour (GPUs 2j and 2j+1, under one leaf in generated fabrics, so
//! that no two streams share a link and an ECMP collision cannot pass for a slow box), run
//! at a scale `k × m / n` so that m streams load the box as n GPUs would at k. A candidate
//! holds when the streams get at least `CARRIED` of what their NICs allow: the box, not
//! the fabric, would otherwise be the bottleneck. Candidates go up in 1-2-5 steps from a
//! decade under the plan's estimate; the first that holds, one step more for headroom
//! (bursts, the GPUs' own work on the same cores), is the choice — or real time, when
//! real time holds.
//!
//! It is a throughput criterion. The precision of short operations is another matter:
//! the write lateness of bulk TCP at line rate on 2 cores is ~0.5–1.5 ms p99 at any scale
//! (the senders' kernel work holds the cores), so a lateness criterion would drive every
//! fabric to huge scales; `bench` judges lateness against the operations it measured
//! instead, and names the time scale that would have held them.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use anyhow::Context;
use closbox_fabric::plan::round_up_125;
use closbox_fabric::{TimeScale, Topology};

use crate::dataplane::{Ctl, DataPlane, TunPorts};
use crate::state::State;
use crate::sys::{self, EventFd};

/// Share of the streams' line rate a trial must carry.
const CARRIED: f64 = 0.85;
/// Senders at most.
const MAX_STREAMS: usize = 16;
/// Trials at most (1-2-5 steps: 1 → 1000 in 9).
const MAX_TRIALS: usize = 10;
/// A trial: ramp-up, then the measured window.
const RAMP: Duration = Duration::from_millis(150);
const WINDOW: Duration = Duration::from_millis(300);
/// First port of the calibration streams (inside the GPUs, before any user job runs).
const PORT: u16 = 47_000;

/// What calibration chose, and why (for the log, `up` and `status`).
#[derive(Debug, Clone)]
pub struct Choice {
    pub time_scale: f64,
    pub why: String,
}

/// One trial's outcome.
#[derive(Debug)]
struct Trial {
    carried: f64,
    p99_us: f64,
}

impl Trial {
    fn holds(&self) -> bool {
        self.carried >= CARRIED
    }
}

/// The next 1-2-5 value above `k`.
fn next_125(k: f64) -> f64 {
    round_up_125(k * 1.0001)
}

/// Runs the trials on the fabric's TUNs (returned, for the real data plane) and chooses.
pub fn choose(
    topo: &Topology,
    st: &State,
    tuns: Vec<OwnedFd>,
    offload: bool,
    writers: usize,
) -> anyhow::Result<(Choice, Vec<OwnedFd>)> {
    let n = topo.hosts.len();
    let hint = closbox_fabric::plan::TimeScaleHint::of(topo);
    if n < 2 {
        let why = "one GPU: nothing to carry".to_owned();
        return Ok((
            Choice {
                time_scale: 1.0,
                why,
            },
            tuns,
        ));
    }
    let m = n.min(MAX_STREAMS);
    let rates = closbox_fabric::plan::fastest_host_links(topo);
    // Frames carry mtu − 52 bytes of TCP payload (IP, TCP and timestamps) for mtu + the
    // framing overhead on the wire.
    let mtu = topo.fabric.mtu as f64;
    let payload_share = (mtu - 52.0) / (mtu + topo.fabric.l2_overhead as f64);
    let netns: Vec<Arc<OwnedFd>> = st
        .gpus
        .iter()
        .map(|g| {
            std::fs::File::open(g.netns_path())
                .map(|f| Arc::new(OwnedFd::from(f)))
                .with_context(|| format!("opening {}", g.netns_path().display()))
        })
        .collect::<anyhow::Result<_>>()?;
    let mut tuns = tuns;
    // Start a decade under the plan's throughput estimate (it is a rough figure for this
    // box class), never under 1.
    let mut k = round_up_125((hint.for_load / 10.0).max(1.0));
    let mut tried = Vec::new();
    for _ in 0..MAX_TRIALS {
        let scaled = (k * m as f64 / n as f64).max(1.0);
        let (trial, back) = trial(
            topo,
            &netns,
            tuns,
            offload,
            writers,
            scaled,
            m,
            &rates,
            payload_share,
        )?;
        tuns = back;
        tracing::info!(
            "time_scale auto: trial at {k} ({m} streams at {scaled}): carried {:.0} % of line rate, write lateness p99 {:.0} µs",
            trial.carried * 100.0,
            trial.p99_us
        );
        tried.push(format!(
            "{k}: {:.0} % carried, p99 {:.0} µs",
            trial.carried * 100.0,
            trial.p99_us
        ));
        if trial.holds() {
            // Real time is kept when it holds (programs' own clocks and timeouts stay
            // right); otherwise one step more for headroom.
            let (chosen, headroom) = if k <= 1.0 {
                (1.0, "real time kept")
            } else {
                (next_125(k), "one 1-2-5 step more for headroom")
            };
            let why = format!(
                "the box carried {m} streams loading it as all {n} GPUs at line rate would from time_scale {k} (trials: {}); {headroom}",
                tried.join("; ")
            );
            return Ok((
                Choice {
                    time_scale: chosen.min(TimeScale::MAX),
                    why,
                },
                tuns,
            ));
        }
        if k >= TimeScale::MAX {
            break;
        }
        k = next_125(k);
    }
    let why = format!(
        "no trial held up to time_scale {k} (trials: {}); using it",
        tried.join("; ")
    );
    Ok((
        Choice {
            time_scale: k.min(TimeScale::MAX),
            why,
        },
        tuns,
    ))
}

/// One trial at `scaled`: a data plane on the TUNs, m streams for `RAMP + WINDOW`.
#[allow(clippy::too_many_arguments)]
fn trial(
    topo: &Topology,
    netns: &[Arc<OwnedFd>],
    tuns: Vec<OwnedFd>,
    offload: bool,
    writers: usize,
    scaled: f64,
    m: usize,
    rates: &[u64],
    payload_share: f64,
) -> anyhow::Result<(Trial, Vec<OwnedFd>)> {
    let n = topo.hosts.len();
    let mut t = topo.clone();
    t.fabric.time_scale = TimeScale::new(scaled).context("trial time scale")?;
    let wake = Arc::new(EventFd::new()?);
    let (ctl_tx, ctl_rx) = mpsc::channel();
    let dp = DataPlane::new(
        &t,
        TunPorts::new(tuns, Arc::clone(&wake), offload, writers)?,
        ctl_rx,
    );
    let plane = std::thread::Builder::new()
        .name("calibration".into())
        .spawn(move || dp.run().into_tuns())?;

    let stop = Arc::new(AtomicBool::new(false));
    let received: Vec<Arc<AtomicU64>> = (0..m).map(|_| Arc::new(AtomicU64::new(0))).collect();
    let mut threads = Vec::new();
    let mut expected = 0.0;
    for i in 0..m {
        let dst = if i ^ 1 < n { i ^ 1 } else { (i + 1) % n };
        let addr = SocketAddrV4::new(topo.hosts[dst].addr, PORT + i as u16);
        expected += rates[i].min(rates[dst]) as f64 * payload_share / scaled / 8.0;
        let (ready_tx, ready_rx) = mpsc::channel::<std::io::Result<()>>();
        // The receiver, in the destination GPU.
        let (ns, stop_r, got) = (
            Arc::clone(&netns[dst]),
            Arc::clone(&stop),
            Arc::clone(&received[i]),
        );
        threads.push(std::thread::spawn(move || {
            let listener = sys::enter_netns(ns.as_fd()).and_then(|()| {
                TcpListener::bind(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, addr.port()))
            });
            let listener = match listener {
                Ok(l) => {
                    let _ = ready_tx.send(Ok(()));
                    l
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            let _ = listener.set_nonblocking(true);
            let deadline = Instant::now() + Duration::from_secs(2);
            let mut conn = loop {
                match listener.accept() {
                    Ok((c, _)) => break c,
                    Err(_) if Instant::now() < deadline && !stop_r.load(Ordering::Relaxed) => {
                        std::thread::sleep(Duration::from_millis(1))
                    }
                    Err(_) => return,
                }
            };
            let _ = conn.set_nonblocking(false);
            let _ = conn.set_read_timeout(Some(Duration::from_millis(50)));
            let mut buf = vec![0u8; 1 << 16];
            while !stop_r.load(Ordering::Relaxed) {
                match conn.read(&mut buf) {
                    Ok(0) => break,
                    Ok(r) => {
                        got.fetch_add(r as u64, Ordering::Relaxed);
                    }
                    Err(_) => {}
                }
            }
        }));
        ready_rx
            .recv()
            .context("calibration receiver")?
            .context("calibration receiver: listening in a GPU")?;
        // The sender, in GPU i.
        let (ns, stop_s) = (Arc::clone(&netns[i]), Arc::clone(&stop));
        threads.push(std::thread::spawn(move || {
            if sys::enter_netns(ns.as_fd()).is_err() {
                return;
            }
            let Ok(mut conn) = TcpStream::connect_timeout(&addr.into(), Duration::from_secs(1))
            else {
                return;
            };
            let _ = conn.set_write_timeout(Some(Duration::from_millis(50)));
            let buf = vec![0x5au8; 1 << 16];
            while !stop_s.load(Ordering::Relaxed) {
                let _ = conn.write(&buf);
            }
        }));
    }
    std::thread::sleep(RAMP);
    let before: u64 = received.iter().map(|r| r.load(Ordering::Relaxed)).sum();
    let (status_tx, status_rx) = mpsc::channel();
    let _ = ctl_tx.send(Ctl::Status(status_tx));
    wake.notify();
    let at_ramp = status_rx.recv_timeout(Duration::from_secs(2)).ok();
    let started = Instant::now();
    std::thread::sleep(WINDOW);
    let after: u64 = received.iter().map(|r| r.load(Ordering::Relaxed)).sum();
    let window = started.elapsed().as_secs_f64();
    let (status_tx, status_rx) = mpsc::channel();
    let _ = ctl_tx.send(Ctl::Status(status_tx));
    wake.notify();
    let at_end = status_rx.recv_timeout(Duration::from_secs(2)).ok();
    stop.store(true, Ordering::Relaxed);
    for th in threads {
        let _ = th.join();
    }
    let _ = ctl_tx.send(Ctl::Stop);
    wake.notify();
    let tuns = plane
        .join()
        .map_err(|_| anyhow::anyhow!("calibration data plane panicked"))?;
    // Lateness over the measured window: the difference of the two histograms.
    let p99_us = match (at_ramp, at_end) {
        (Some(a), Some(b)) => {
            let h = crate::histogram::Histogram::since(&a.lateness_buckets, &b.lateness_buckets);
            h.quantile(0.99) as f64 / 1e3
        }
        _ => f64::INFINITY,
    };
    let carried = (after - before) as f64 / window / expected;
    Ok((Trial { carried, p99_us }, tuns))
}
