//! `closbox status`: asks each fabric's daemon for its typed status and renders it.

use std::process::ExitCode;

use anyhow::bail;
use closbox_fabric::TimeScale;
use closbox_switchd::control::{self, Lateness, PortStatus, Reply, Request, Status};
use closbox_switchd::dataplane::{holders, LoadInfo, LoadsEarlier};
use closbox_switchd::state::{self, FabricName, State};
use serde::Serialize;

use crate::plan::{approx_bytes, thousands};

/// Finished loads `status` lists one by one, the latest; earlier ones get a line in all.
const SHOWN_DONE_LOADS: usize = 8;

/// One fabric's answer: its status, or why there is none.
#[derive(Debug, Serialize)]
#[serde(untagged)]
enum Answer {
    Status {
        #[serde(flatten)]
        status: Box<Status>,
        /// The jobs (`run`, `mpirun`, `bench`, `train`) running on the fabric.
        jobs: Vec<crate::jobs::JobInfo>,
        /// `up --owner`: the process whose end takes the fabric down.
        #[serde(skip_serializing_if = "Option::is_none")]
        owner: Option<u32>,
    },
    Error {
        fabric: String,
        error: String,
    },
}

pub fn status(
    fabric: Option<&FabricName>,
    json: bool,
    ports: Option<&str>,
) -> anyhow::Result<ExitCode> {
    // (Fabrics' state is root's alone: without root none would be seen, and "no fabric
    // is up" said while one is.)
    closbox_switchd::require_root("closbox status")?;
    let names = match fabric {
        Some(n) => vec![n.clone()],
        None => state::fabrics(),
    };
    if names.is_empty() {
        println!("{}", if json { "[]" } else { "no fabric is up" });
        return Ok(ExitCode::SUCCESS);
    }
    let mut out = Vec::new();
    let mut healthy = true;
    for n in names {
        let Some(st) = State::load(&n)? else {
            bail!("fabric {n} is not up{}", crate::live::file_named_like(&n));
        };
        let reply = if st.daemon_alive() {
            control::request(&n, &Request::Status { tcp: true })
                .unwrap_or_else(|e| Reply::error(format!("{e:#}")))
        } else {
            Reply::error(format!(
                "daemon not running (crashed or killed); `closbox down {n}` cleans up (its log, if it was detached: {})",
                n.log_path().display()
            ))
        };
        let mut dead = Vec::new();
        let answer = match reply {
            Reply::Status(mut s) => {
                healthy &= !s.behind && s.deadlocked.is_empty();
                dead = dead_vertices(
                    s.ports.iter().map(|p| (p.port.as_str(), p.up)),
                    &s.changed_links,
                );
                // Busy ports only, unless asked for all or some.
                s.ports.retain(|p| match ports {
                    Some(pattern) => p.port.contains(pattern),
                    None => p.rx_packets > 0 || p.load_tx_bytes > 0 || p.load_drops > 0,
                });
                Answer::Status {
                    status: s,
                    jobs: crate::jobs::running(n.as_str()),
                    owner: st.owner,
                }
            }
            Reply::Error { message } => Answer::Error {
                fabric: n.to_string(),
                error: message,
            },
            Reply::Stopping => Answer::Error {
                fabric: n.to_string(),
                error: "stopping".into(),
            },
            Reply::Changed { .. }
            | Reply::Events { .. }
            | Reply::Scheduled { .. }
            | Reply::Cancelled { .. }
            | Reply::Capturing { .. }
            | Reply::Flows(_)
            | Reply::Recording { .. } => Answer::Error {
                fabric: n.to_string(),
                error: "the daemon answered something else than its status".into(),
            },
        };
        if matches!(answer, Answer::Error { .. }) {
            healthy = false;
        }
        if !json {
            print!("{}", render(&st, &answer, ports.is_some(), &dead));
        }
        out.push(answer);
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&out)?);
    }
    Ok(if healthy {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(3)
    })
}

/// A drop count by its reason's name (0 if the daemon does not count that reason).
pub fn drops(s: &Status, reason: &str) -> u64 {
    s.drops
        .iter()
        .find(|(r, _)| r == reason)
        .map_or(0, |(_, c)| *c)
}

/// Links (as the daemon names them, "leaf0-spine1 #3") with their states, grouped by state
/// in the order states first appear: each group's links named compactly (parallel links
/// as "leaf0-spine1 #0-#7", the first `SHOWN_LINK_RUNS` such runs and "and N more"), how
/// many, and the state.
pub fn link_groups<'a>(
    links: impl IntoIterator<Item = (&'a str, String)>,
) -> Vec<(String, usize, String)> {
    /// Parallel links between the same ends: (ends, first index, last index); a name
    /// without an index has `u32::MAX`.
    type Run<'a> = (&'a str, u32, u32);
    // (state, its runs, its links)
    let mut groups: Vec<(String, Vec<Run>, usize)> = Vec::new();
    for (link, state) in links {
        let (ends, index) = match link.rsplit_once(" #").map(|(e, i)| (e, i.parse::<u32>())) {
            Some((e, Ok(i))) => (e, i),
            _ => (link, u32::MAX),
        };
        let g = match groups.iter().position(|(s, _, _)| *s == state) {
            Some(g) => g,
            None => {
                groups.push((state, Vec::new(), 0));
                groups.len() - 1
            }
        };
        let (_, runs, n) = &mut groups[g];
        *n += 1;
        match runs.last_mut() {
            Some((e, _, last))
                if *e == ends && index != u32::MAX && last.checked_add(1) == Some(index) =>
            {
                *last = index;
            }
            _ => runs.push((ends, index, index)),
        }
    }
    groups
        .into_iter()
        .map(|(state, runs, n)| {
            let name = |&(ends, first, last): &Run| match (first, last) {
                (u32::MAX, _) => ends.to_owned(),
                (f, l) if f == l => format!("{ends} #{f}"),
                (f, l) => format!("{ends} #{f}-#{l}"),
            };
            let shown: Vec<String> = runs.iter().take(SHOWN_LINK_RUNS).map(name).collect();
            let more = runs.len().saturating_sub(shown.len());
            let mut names = shown.join(", ");
            if more > 0 {
                names += &format!(" and {more} more");
            }
            (names, n, state)
        })
        .collect()
}

/// Vertices (switches, GPUs) every port of which is down, with their links' count and
/// since when the last of them is down, most links first; one whose links all lead to
/// vertices listed already is left out (a GPU under a dead leaf).
fn dead_vertices<'a>(
    ports: impl IntoIterator<Item = (&'a str, bool)>,
    changed: &[closbox_switchd::dataplane::LinkStatus],
) -> Vec<Dead> {
    let mut by: std::collections::BTreeMap<&str, (usize, bool)> = Default::default();
    for (port, up) in ports {
        let from = port.split("->").next().unwrap_or_default();
        let e = by.entry(from).or_insert((0, true));
        e.0 += 1;
        e.1 &= !up;
    }
    let mut dead: Vec<(&str, usize)> = by
        .into_iter()
        .filter(|(_, (n, down))| *down && *n > 0)
        .map(|(v, (n, _))| (v, n))
        .collect();
    dead.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    let mut out: Vec<Dead> = Vec::new();
    for (v, n) in dead {
        let links = changed
            .iter()
            .filter(|l| !l.up && l.ends.iter().any(|e| e == v));
        let mut others = links.clone().map(|l| {
            let [a, b] = &l.ends;
            if a == v {
                b
            } else {
                a
            }
        });
        if others.all(|o| out.iter().any(|d| d.name == *o)) {
            continue;
        }
        let since = links
            .clone()
            .filter_map(|l| l.down_since_s)
            .fold(0.0, f64::max);
        let mut by: Vec<u64> = links.clone().flat_map(|l| l.down_by.clone()).collect();
        if links.clone().any(|l| l.down_by_host) {
            by.push(closbox_switchd::dataplane::HOST);
        }
        by.sort();
        by.dedup();
        out.push(Dead {
            name: v.to_owned(),
            links: n,
            since,
            by,
        });
    }
    out
}

/// A switch or GPU whose every link is down (`dead_vertices`).
#[derive(Debug, PartialEq)]
struct Dead {
    name: String,
    /// How many links it has.
    links: usize,
    /// Fabric time (s) since which the last of them is down.
    since: f64,
    /// Who holds its links down (`LinkStatus::down_by`; `HOST`: the GPU's host).
    by: Vec<u64>,
}

/// "gpu1 1000, gpu3 9000 (and 2 more)": GPUs with what their hosts set, the first 8.
fn gpus_with<T: std::fmt::Display>(list: &[(String, T)]) -> String {
    const SHOWN: usize = 8;
    let shown: Vec<String> = list
        .iter()
        .take(SHOWN)
        .map(|(g, v)| format!("{g} {v}"))
        .collect();
    match list.len().saturating_sub(SHOWN) {
        0 => shown.join(", "),
        more => format!("{} (and {more} more)", shown.join(", ")),
    }
}

/// Runs of links a line of `status` or a bench footer names before "and N more".
const SHOWN_LINK_RUNS: usize = 4;

fn lateness(l: &Lateness, time_scale: TimeScale) -> String {
    // Lateness is wall time; in dilated time it shifts fabric timings by lateness / k.
    let fabric = if time_scale > TimeScale::REAL_TIME {
        format!(
            ", p99 = {:.3} µs of fabric time",
            time_scale.fabric_of(l.p99_us)
        )
    } else {
        String::new()
    };
    format!(
        "p50 {:.1} µs  p99 {:.1} µs  max {:.1} µs ({} frames{fabric})",
        l.p50_us,
        l.p99_us,
        l.max_us,
        thousands(l.samples)
    )
}

/// Every running load; of those done, the latest few (incasts and scenarios make
/// hundreds), the earlier ones summed in one line with those the daemon summed already
/// (`status --json` lists the last 20 done in `loads`, sums the rest in `loads_earlier`).
fn render_loads(o: &mut String, loads: &[LoadInfo], summed: &LoadsEarlier) {
    use std::fmt::Write as _;
    let hidden = loads
        .iter()
        .filter(|l| !l.active)
        .count()
        .saturating_sub(SHOWN_DONE_LOADS);
    let earlier = loads.iter().filter(|l| !l.active).take(hidden);
    let count = hidden as u64 + summed.loads;
    if count > 0 {
        let dropped: u64 = summed.drops.iter().map(|d| d.1).sum();
        let _ = writeln!(
            o,
            "  loads     {} done earlier: {} sent, {} delivered, {} dropped (`status --json`: `loads_earlier`)",
            thousands(count),
            approx_bytes(earlier.clone().map(|l| l.sent_bytes).sum::<u64>() + summed.sent_bytes),
            approx_bytes(
                earlier.clone().map(|l| l.delivered_bytes).sum::<u64>() + summed.delivered_bytes
            ),
            thousands(earlier.flat_map(|l| &l.drops).map(|d| d.1).sum::<u64>() + dropped)
        );
    }
    let mut done = 0;
    for l in loads {
        if !l.active {
            done += 1;
            if done <= hidden {
                continue;
            }
        }
        let dropped: u64 = l.drops.iter().map(|d| d.1).sum();
        let _ = writeln!(
            o,
            "  load {:<4} {} -> {} {} {}: {} sent, {} delivered, {} dropped{}{}",
            l.id,
            l.from,
            l.to,
            closbox_fabric::Bandwidth::from_bps(l.rate_bps),
            l.pattern,
            approx_bytes(l.sent_bytes),
            approx_bytes(l.delivered_bytes),
            thousands(dropped),
            if l.ecn_marked > 0 {
                format!(", {} ECN marks", thousands(l.ecn_marked))
            } else {
                String::new()
            },
            if l.active { "" } else { " (done)" }
        );
    }
}

/// The GPUs' TCP, when it is not the default (Reno requesting ECN): as their kernels have
/// it now (`Status::gpu_tcp`: a GPU's host may have changed it since `up`), or as `up`
/// set it where that could not be read.
fn gpu_tcp_line(st: &State, s: &Status) -> Option<String> {
    let set_cc = st.tcp_congestion.clone();
    let set_ecn = if st.tcp_ecn { 1 } else { 2 };
    let name = |cc: Option<&str>| match cc {
        Some(closbox_switchd::bpf::NAME) => {
            "closbox_dctcp (DCTCP, closbox's BPF congestion control)".to_owned()
        }
        Some(c) if Some(c) == st.host_congestion.as_deref() && set_cc.is_none() => {
            format!("the host's default congestion control ({c})")
        }
        Some(c) => c.to_owned(),
        None => match &st.host_congestion {
            Some(h) => format!("the host's default congestion control ({h})"),
            None => "the host's default congestion control".to_owned(),
        },
    };
    let ecn = |e: u8| match e {
        1 => "ECN requested",
        2 => "ECN not requested (accepted)",
        0 => "ECN off",
        _ => "ECN (tcp_ecn other)",
    };
    let as_set_cc = set_cc.clone().or_else(|| st.host_congestion.clone());
    match s.gpu_tcp.as_slice() {
        [] => (set_cc.as_deref() != Some("reno") || set_ecn != 1)
            .then(|| format!("{}, {}", name(set_cc.as_deref()), ecn(set_ecn))),
        [one] => {
            let changed = Some(&one.congestion) != as_set_cc.as_ref() || one.ecn != set_ecn;
            (one.congestion != "reno" || one.ecn != 1 || changed).then(|| {
                let mut l = format!("{}, {}", name(Some(&one.congestion)), ecn(one.ecn));
                if changed {
                    l.push_str(&format!(
                        " (changed in the GPUs since up, which set {}, {})",
                        name(set_cc.as_deref()),
                        ecn(set_ecn)
                    ));
                }
                l
            })
        }
        many => Some(format!(
            "{} (not alike: changed in some GPUs since up, which set {}, {})",
            many.iter()
                .map(|t| format!(
                    "{}, {}: {}",
                    name(Some(&t.congestion)),
                    ecn(t.ecn),
                    some_gpus(&t.gpus)
                ))
                .collect::<Vec<_>>()
                .join("; "),
            name(set_cc.as_deref()),
            ecn(set_ecn)
        )),
    }
}

/// A few GPU names: all up to 6, else the first 4 and how many more.
fn some_gpus(gpus: &[String]) -> String {
    if gpus.len() <= 6 {
        gpus.join(", ")
    } else {
        format!("{} and {} more", gpus[..4].join(", "), gpus.len() - 4)
    }
}

/// `dead`: `dead_vertices` of the status (before its ports were filtered).
fn render(st: &State, answer: &Answer, all_ports: bool, dead: &[Dead]) -> String {
    use std::fmt::Write as _;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "fabric {} ({}, time_scale {}, config {})",
        st.fabric,
        crate::bench::plural(st.gpus.len(), "GPU"),
        st.time_scale,
        st.config.display()
    );
    if let Some(why) = &st.time_scale_note {
        let _ = writeln!(o, "  time_scale chosen at up (auto): {why}");
    }
    let (s, jobs) = match answer {
        Answer::Error { error, .. } => {
            let _ = writeln!(o, "  daemon    ERROR: {error}");
            return o;
        }
        Answer::Status { status, jobs, .. } => (status, jobs),
    };
    let _ = writeln!(
        o,
        "  daemon    pid {}, up {:.1} s (fabric time {:.3} s){}",
        st.daemon_pid,
        s.uptime_s,
        s.fabric_time_s,
        st.owner.map_or(String::new(), |p| format!(
            "; goes down when pid {p} ends (--owner)"
        ))
    );
    if !jobs.is_empty() {
        let _ = writeln!(o, "  jobs      {}", crate::jobs::list(jobs));
    }
    let _ = writeln!(
        o,
        "  packets   in {}  delivered {}  queued {}  in flight {}",
        thousands(s.packets_in),
        thousands(s.delivered),
        thousands(s.queued),
        thousands(s.in_flight)
    );
    let mut drop_list: Vec<String> = s
        .drops
        .iter()
        .map(|(r, c)| format!("{r} {}", thousands(*c)))
        .collect();
    for (what, count) in s.kernel_drops() {
        drop_list.push(match count {
            Some(d) => format!("{what} {}", thousands(d)),
            None => format!("{what} ?"),
        });
    }
    let _ = writeln!(o, "  drops     {}", drop_list.join("  "));
    if !s.flow_control.is_empty() && s.flow_control != "none" {
        let paused: Vec<&PortStatus> = s.ports.iter().filter(|p| p.pause_events > 0).collect();
        let events: u64 = paused.iter().map(|p| p.pause_events).sum();
        // (Not `sum`: an empty f64 sum is -0.0, which prints as "-0.000".)
        let total = paused.iter().fold(0.0, |t, p| t + p.paused_s);
        let _ = writeln!(
            o,
            "  lossless  {}: {} pause events on {} ports, {:.3} ms paused in all (fabric time), {} paused now",
            s.flow_control,
            thousands(events),
            paused.len(),
            total * 1e3,
            s.ports.iter().filter(|p| p.paused_now).count()
        );
    }
    if !s.deadlocked.is_empty() {
        let list: Vec<String> = s
            .deadlocked
            .iter()
            .map(|(p, t)| format!("{p} ({:.1} ms)", t * 1e3))
            .collect();
        let _ = writeln!(
            o,
            "  DEADLOCK  {} ports paused longer than deadlock_after ({:.1} ms): {} — a cyclic buffer dependency holds their traffic for good (routes that cross the cycle, or go lossy)",
            s.deadlocked.len(),
            s.deadlock_after_s * 1e3,
            list.join(", ")
        );
    }
    let _ = writeln!(o, "  lateness  {}", lateness(&s.lateness, st.time_scale));
    let _ = writeln!(
        o,
        "  recent    {}",
        lateness(&s.lateness_recent, st.time_scale)
    );
    if s.behind {
        let _ = writeln!(
            o,
            "  WARNING   packets leave the fabric late (recent p99 above {:.0} µs): {}",
            s.behind_threshold_us,
            closbox_switchd::dataplane::behind_advice(
                st.time_scale.get(),
                s.full_load_time_scale,
                s.cpu_recent.as_ref(),
                s.realtime,
                closbox_switchd::sys::idle_poll_would_help()
            )
        );
    } else if !s.deadlocked.is_empty() {
        let _ = writeln!(o, "  health    DEADLOCK (above)");
    } else {
        let _ = writeln!(o, "  health    ok");
    }
    if !s.scheduling.is_empty() {
        let writers = match s.tun_writers {
            0 => String::new(),
            n => format!(
                "; {n} writer thread{} ({} writes handed to them)",
                if n == 1 { "" } else { "s" },
                thousands(s.writes_handed_off)
            ),
        };
        let _ = writeln!(o, "  data plane {}{writers}", s.scheduling);
        if !s.gpu_pacing {
            let why = st.pacing_off.as_deref().unwrap_or("see the daemon's log");
            let _ = writeln!(
                o,
                "  pacing    OFF: {}; `up` could not install the qdisc: {why}",
                closbox_switchd::pace::OFF
            );
        }
    }
    if let Some(c) = &s.cpu_recent {
        let _ = writeln!(
            o,
            "  cpu       last {:.1} s: busy {:.0} % of a CPU, waited {:.1} ms for one{}",
            c.window_s,
            c.busy * 100.0,
            c.waited_ms,
            closbox_switchd::sys::steal_note(c.steal, |p| format!(
                "; the hypervisor took {p:.0} % of the box's CPUs (steal)"
            ))
        );
    }
    let _ = writeln!(
        o,
        "  memory    packets hold {} of {} (packet_memory)",
        approx_bytes(s.packet_memory),
        approx_bytes(s.packet_memory_limit),
    );
    if let Some(line) = gpu_tcp_line(st, s) {
        let _ = writeln!(o, "  gpu tcp   {line}");
    }
    let memory_drops = drops(s, "memory_limit");
    if memory_drops > 0 {
        let _ = writeln!(
            o,
            "  WARNING   {} packets dropped at the fabric's packet-memory limit: the GPUs offered more than the box lets the fabric hold (raise [fabric] packet_memory, or lower buffers)",
            thousands(memory_drops)
        );
    }
    if !s.gpu_mtus.is_empty() {
        let _ = writeln!(
            o,
            "  mtu       fabric {}; set otherwise by their hosts: {}",
            s.mtu,
            gpus_with(&s.gpu_mtus)
        );
    }
    if !s.gpu_qdiscs.is_empty() {
        let _ = writeln!(
            o,
            "  qdisc     their hosts' own, left as they are: {} (closbox's htb held their non-TCP packets to their links' rates; above it such packets now drop in their NIC queues)",
            gpus_with(&s.gpu_qdiscs)
        );
    }
    if !s.gpu_interfaces.is_empty() {
        let _ = writeln!(
            o,
            "  interface set by their hosts: {} (their links held down until they are up again; gone: for good)",
            gpus_with(&s.gpu_interfaces)
        );
    }
    if let Some(n) = s.gpu_socket_dropped.filter(|&n| n > 0) {
        let _ = writeln!(
            o,
            "  sockets   {} UDP datagrams dropped inside the GPUs at receiving sockets whose buffers were full (gpu_socket: delivered by the fabric, then dropped because the programs read too slowly: on a box with few cores their processes wait for CPUs they share with the other GPUs and the data plane, even well below line rate; a larger receive buffer, e.g. `iperf3 -w 4M`, absorbs the waits; `nstat` in a GPU shows UdpRcvbufErrors)",
            thousands(n)
        );
    }
    let giants = drops(s, "over_mtu");
    if giants > 0 {
        let _ = writeln!(
            o,
            "  WARNING   {} packets longer than an MTU on their way dropped: a GPU's interface MTU differs from the fabric's{} (raised: its longer frames are dropped where they enter; lowered: its NIC drops longer frames sent to it; TCP stalls on such segments; `closbox flows` names the flows, `closbox events` the changes)",
            thousands(giants),
            if s.mtu > 0 { format!(" ({})", s.mtu) } else { String::new() }
        );
    }
    // A switch or GPU whose every link is down: one line, not its links'.
    for Dead {
        name: v,
        links,
        since,
        by,
    } in dead
    {
        let what = if st.gpus.iter().any(|g| g.name == *v) {
            "gpu    "
        } else {
            "switch "
        };
        let _ = writeln!(
            o,
            "  {what}   {v} DOWN since fabric time {since:.6} s ({}{})",
            if *links == 1 {
                "its link".to_owned()
            } else {
                format!("its {links} links")
            },
            match by.as_slice() {
                [] => String::new(),
                by => format!("; by {}", holders(by.iter().copied())),
            }
        );
    }
    let mut states = Vec::new();
    for l in &s.changed_links {
        if !l.up && l.ends.iter().any(|e| dead.iter().any(|d| d.name == *e)) {
            continue;
        }
        let mut what = Vec::new();
        if !l.up {
            let host = l.down_by_host.then_some(closbox_switchd::dataplane::HOST);
            let by = match l.down_by.iter().copied().chain(host).collect::<Vec<_>>() {
                by if by.is_empty() => String::new(),
                by => format!(" (by {})", holders(by)),
            };
            what.push(format!(
                "DOWN since fabric time {:.6} s{by}",
                l.down_since_s.unwrap_or(0.0)
            ));
        }
        let dir = |rate_bps: u64, delay_ns: u64, loss: f64, burst: f64| {
            let runs = if burst > 1.0 && loss > 0.0 {
                format!(" (in runs of {burst} frames)")
            } else {
                String::new()
            };
            format!(
                "{} {} loss {loss}{runs}",
                closbox_fabric::Bandwidth::from_bps(rate_bps),
                closbox_fabric::Duration::from_nanos(delay_ns),
            )
        };
        let a_to_b = dir(l.rate_bps, l.delay_ns, l.loss, l.loss_burst);
        let params = match &l.b_to_a {
            None => a_to_b,
            Some(r) => {
                let [a, b] = &l.ends;
                format!(
                    "{a}->{b} {a_to_b}, {b}->{a} {}",
                    dir(r.rate_bps, r.delay_ns, r.loss, r.loss_burst)
                )
            }
        };
        what.push(format!(
            "{params} buffers {}/{}",
            closbox_fabric::Bytes::new(l.buffer_bytes[0]),
            closbox_fabric::Bytes::new(l.buffer_bytes[1])
        ));
        if !l.degraded_by.is_empty() {
            what.push(format!(
                "degraded by {}",
                holders(l.degraded_by.iter().copied())
            ));
        }
        states.push((l.link.as_str(), what.join("; ")));
    }
    // Links in the same state share a line (a switch down: one line, not one per link).
    for (names, count, state) in link_groups(states) {
        let count = if count > 1 {
            format!(" ({count} links)")
        } else {
            String::new()
        };
        let _ = writeln!(o, "  link      {names}{count}: {state}");
    }
    if !s.partition.is_empty() {
        let sides: Vec<String> = s.partition.iter().map(|g| g.join(",")).collect();
        let _ = writeln!(
            o,
            "  partition {} (`closbox heal` ends it)",
            sides.join(" | ")
        );
    }
    render_loads(&mut o, &s.loads, &s.loads_earlier);
    if s.events > 0 || s.pending_changes > 0 {
        let _ = writeln!(
            o,
            "  changes   {} since up, {} pending (`closbox events`)",
            thousands(s.events),
            thousands(s.pending_changes as u64)
        );
    }
    for t in &s.timelines {
        let mut what = Vec::new();
        if t.pending > 0 {
            what.push(format!(
                "{} pending",
                crate::bench::plural(t.pending, "change")
            ));
        }
        if let Some(waiting) = &t.waiting {
            what.push(format!("waiting for {waiting} to start"));
        }
        if !t.loads.is_empty() {
            let ids: Vec<String> = t.loads.iter().map(u32::to_string).collect();
            what.push(format!(
                "load{} {} running",
                if ids.len() == 1 { "" } else { "s" },
                ids.join(", ")
            ));
        }
        let name = match t.id {
            0 => "flaps".to_owned(),
            id => format!("timeline {id}"),
        };
        let _ = writeln!(
            o,
            "  chaos     {name}: {} (`closbox cancel {}` ends it, repairing what it broke)",
            what.join(", "),
            t.id
        );
    }
    // The busiest ports, and any that dropped or marked; or all that were asked for.
    let mut ports: Vec<&PortStatus> = s.ports.iter().collect();
    let shown = if all_ports {
        ports.len()
    } else {
        ports.sort_by_key(|p| {
            std::cmp::Reverse((
                p.drops_buffer + p.drops_loss + p.drops_over_mtu + p.load_drops,
                p.pause_events,
                p.ecn_marked,
                (p.utilization * 1e6) as u64,
            ))
        });
        5
    };
    let lossless = !s.flow_control.is_empty() && s.flow_control != "none";
    if !ports.is_empty() {
        let _ = writeln!(
            o,
            "  ports     {:<22} {:>12} {:>10} {:>9} {:>10} {:>8} {:>10} {:>10}{}",
            if all_ports { "(egress)" } else { "(top 5)" },
            "tx packets",
            "drops",
            "ecn",
            "max queue",
            "busy",
            "load tx",
            "load drops",
            if lossless {
                format!(" {:>8} {:>10}", "pauses", "paused")
            } else {
                String::new()
            }
        );
    }
    for p in ports.iter().take(shown) {
        let pauses = if lossless {
            format!(
                " {:>8} {:>7.3} ms{}",
                thousands(p.pause_events),
                p.paused_s * 1e3,
                if p.paused_now { " (now)" } else { "" }
            )
        } else {
            String::new()
        };
        let _ = writeln!(
            o,
            "            {:<22} {:>12} {:>10} {:>9} {:>10} {:>7.1}% {:>10} {:>10}{pauses}",
            p.port,
            thousands(p.tx_packets),
            thousands(p.drops_buffer + p.drops_loss + p.drops_over_mtu),
            thousands(p.ecn_marked),
            thousands(p.max_queue_bytes),
            p.utilization * 100.0,
            approx_bytes(p.load_tx_bytes),
            thousands(p.load_drops)
        );
    }
    if !s.icmp_limited.is_empty() {
        let total: u64 = s.icmp_limited.iter().map(|(_, n)| n).sum();
        let each: Vec<String> = s
            .icmp_limited
            .iter()
            .take(8)
            .map(|(sw, n)| format!("{sw} {}", thousands(*n)))
            .collect();
        let more = s.icmp_limited.len().saturating_sub(8);
        let _ = writeln!(
            o,
            "  switches  {} ICMP answers held back by the switches' icmp_rate ({}{}): pings to switches and traceroute's time exceeded beyond it go unanswered",
            thousands(total),
            each.join(", "),
            if more > 0 { format!(" and {more} more") } else { String::new() }
        );
    }
    if !s.closed_ports.is_empty() {
        let _ = writeln!(
            o,
            "  WARNING   port closed: {} (reading the TUN failed: its interface deleted inside the GPU's namespace?); nothing from it enters the fabric, and its links are down for good (`closbox events`)",
            s.closed_ports.join(", ")
        );
    }
    if s.io_errors > 0 {
        let _ = writeln!(o, "  io errors {}", thousands(s.io_errors));
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_switch_or_gpu_with_every_link_down_is_one_line() {
        use closbox_switchd::dataplane::LinkStatus;
        // leaf1 and spine1 down (leaf1's GPU gpu2 with them: left out), gpu1's link down;
        // leaf0 and spine0 keep links up.
        let link = |a: &str, b: &str, up: bool, since: f64| LinkStatus {
            link: format!("{a}-{b} #0"),
            id: 0,
            up,
            down_since_s: (!up).then_some(since),
            rate_bps: 1,
            delay_ns: 0,
            loss: 0.0,
            loss_burst: 1.0,
            buffer_bytes: [0, 0],
            b_to_a: None,
            ends: [a.to_owned(), b.to_owned()],
            down_by: Vec::new(),
            down_by_host: a == "gpu1",
            degraded_by: Vec::new(),
        };
        let links = [
            ("gpu0", "leaf0", true),
            ("gpu1", "leaf0", false),
            ("gpu2", "leaf1", false),
            ("leaf0", "spine0", true),
            ("leaf0", "spine1", false),
            ("leaf1", "spine0", false),
            ("leaf1", "spine1", false),
        ];
        let ports: Vec<(String, bool)> = links
            .iter()
            .flat_map(|&(a, b, up)| [(format!("{a}->{b}"), up), (format!("{b}->{a}"), up)])
            .collect();
        let changed: Vec<LinkStatus> = links
            .iter()
            .enumerate()
            .filter(|(_, l)| !l.2)
            .map(|(i, &(a, b, up))| link(a, b, up, i as f64))
            .collect();
        let dead = dead_vertices(ports.iter().map(|(p, up)| (p.as_str(), *up)), &changed);
        let dead: Vec<(&str, usize, f64, &[u64])> = dead
            .iter()
            .map(|d| (d.name.as_str(), d.links, d.since, d.by.as_slice()))
            .collect();
        let host = closbox_switchd::dataplane::HOST;
        assert_eq!(
            dead,
            [
                ("leaf1", 3, 6.0, &[][..]),
                ("spine1", 2, 6.0, &[]),
                ("gpu1", 1, 1.0, &[host])
            ]
        );
        assert!(dead_vertices(ports.iter().map(|(p, _)| (p.as_str(), true)), &[]).is_empty());
    }

    #[test]
    fn links_in_one_state_share_a_line_with_parallel_links_as_runs() {
        let down = || "DOWN".to_owned();
        let mut links: Vec<(String, String)> = Vec::new();
        for leaf in 0..6 {
            for i in 0..2 {
                links.push((format!("leaf{leaf}-spine1 #{i}"), down()));
            }
        }
        links.insert(3, ("gpu0-leaf0 #0".into(), "100Mbit/s".into()));
        links.push(("leaf0-spine2 #0".into(), down()));
        links.push(("leaf0-spine2 #2".into(), down()));
        let groups = link_groups(links.iter().map(|(l, s)| (l.as_str(), s.clone())));
        assert_eq!(
            groups,
            [
                (
                    "leaf0-spine1 #0-#1, leaf1-spine1 #0-#1, leaf2-spine1 #0-#1, leaf3-spine1 #0-#1 and 4 more".to_owned(),
                    14,
                    down()
                ),
                ("gpu0-leaf0 #0".to_owned(), 1, "100Mbit/s".to_owned()),
            ]
        );
        // A gap in the indices starts a new run; a name without an index stands alone.
        let groups = link_groups([
            ("a-b #0", down()),
            ("a-b #2", down()),
            ("a-b #3", down()),
            ("odd", down()),
        ]);
        assert_eq!(groups[0].0, "a-b #0, a-b #2-#3, odd");
        assert_eq!(groups[0].1, 4);
    }

    fn load(id: u32, active: bool) -> LoadInfo {
        LoadInfo {
            id,
            from: format!("gpu{id}"),
            to: "gpu0".into(),
            rate_bps: 1_000_000_000,
            mean_bps: 1e9,
            pattern: "one burst of 64KiB".into(),
            active,
            started_s: 0.0,
            sent_bytes: 1000,
            delivered_bytes: 900,
            ecn_marked: 0,
            drops: vec![("buffer_full".into(), 2)],
            port_shares: Vec::new(),
        }
    }

    #[test]
    fn lateness_counts_frames_and_gives_dilated_p99_in_fabric_time() {
        let l = Lateness {
            samples: 1_191_115,
            p50_us: 126.5,
            p99_us: 401.4,
            max_us: 4113.6,
        };
        assert_eq!(
            lateness(&l, TimeScale::REAL_TIME),
            "p50 126.5 µs  p99 401.4 µs  max 4113.6 µs (1,191,115 frames)"
        );
        let dilated = lateness(&l, TimeScale::new(1000.0).expect("a time scale"));
        assert!(
            dilated.ends_with("(1,191,115 frames, p99 = 0.401 µs of fabric time)"),
            "{dilated}"
        );
    }

    #[test]
    fn hundreds_of_finished_loads_take_one_line_beside_the_latest() {
        // 300 incast bursts done, one load still running among them.
        let mut loads: Vec<LoadInfo> = (1..=300).map(|id| load(id, false)).collect();
        loads[149].active = true;
        let mut o = String::new();
        render_loads(&mut o, &loads, &LoadsEarlier::default());
        let lines: Vec<&str> = o.lines().collect();
        assert_eq!(lines.len(), 1 + 1 + SHOWN_DONE_LOADS, "{o}");
        assert!(
            lines[0].starts_with(
                "  loads     291 done earlier: 284 KiB sent, 256 KiB delivered, 582 dropped"
            ),
            "{}",
            lines[0]
        );
        // With 5,000 the daemon summed before (the model lets go of them).
        let summed = LoadsEarlier {
            loads: 5_000,
            sent_bytes: 5_000_000,
            delivered_bytes: 4_000_000,
            ecn_marked: 0,
            drops: vec![("buffer_full".into(), 700), ("link_down".into(), 18)],
        };
        let mut with = String::new();
        render_loads(&mut with, &loads, &summed);
        assert!(
            with.starts_with(
                "  loads     5,291 done earlier: 5.0 MiB sent, 4.1 MiB delivered, 1,300 dropped"
            ),
            "{with}"
        );
        assert_eq!(with.lines().skip(1).collect::<Vec<_>>(), lines[1..]);
        assert!(lines[1].starts_with("  load 150 ") && !lines[1].contains("(done)"));
        let shown: Vec<&str> = lines[2..].iter().map(|l| &l[7..11]).collect();
        assert_eq!(
            shown,
            ["293 ", "294 ", "295 ", "296 ", "297 ", "298 ", "299 ", "300 "]
        );

        // Few loads: each has its line.
        let mut o = String::new();
        render_loads(&mut o, &loads[292..], &LoadsEarlier::default());
        assert_eq!(o.lines().count(), SHOWN_DONE_LOADS);
        assert!(!o.contains("earlier"));
    }
}
