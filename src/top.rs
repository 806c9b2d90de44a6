//! `closbox top`: a live view of a fabric in the terminal (ratatui), refreshed every
//! second: health and totals, leaf × spine uplink utilization, the busiest ports with
//! their queues and drop and ECN rates, recent chaos events. `q` (or Esc, Ctrl-C) quits.

use std::io::IsTerminal;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use closbox_switchd::chaos::port_ends;
use closbox_switchd::control::{self, Event, Reply, Request, Status};
use closbox_switchd::dataplane::{CpuUse, LateCause};
use closbox_switchd::state::FabricName;
use ratatui::crossterm::event::{self, Event as TermEvent, KeyCode, KeyModifiers};
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Cell, Paragraph, Row, Table};
use ratatui::Frame;

use crate::live;
use crate::plan::approx_bytes;

/// One port between two snapshots.
#[derive(Clone, Debug)]
struct PortRate {
    name: String,
    class: String,
    /// Busy share of fabric time between the snapshots (GPU packets and load).
    util: f64,
    queue: u64,
    drops_per_s: f64,
    ecn_per_s: f64,
    /// Lossless fabrics: share of the span the next switch kept it paused.
    paused: f64,
}

/// What the view shows, from two status snapshots.
struct View {
    status: Status,
    ports: Vec<PortRate>,
    events: Vec<Event>,
    /// Fabric seconds between the snapshots.
    span_s: f64,
    /// Jobs running on the fabric (`jobs::running`).
    jobs: usize,
}

fn snapshot(fabric: &FabricName) -> anyhow::Result<Status> {
    match control::request(fabric, &Request::Status { tcp: false })? {
        Reply::Status(s) => Ok(*s),
        Reply::Error { message } => bail!("{message}"),
        other => bail!("unexpected reply from the daemon: {other:?}"),
    }
}

fn view(prev: &Status, now: Status, events: Vec<Event>) -> View {
    let span = (now.fabric_time_s - prev.fabric_time_s).max(1e-12);
    let ports = now
        .ports
        .iter()
        .map(|p| {
            let before = prev.ports.iter().find(|q| q.port == p.port);
            let busy = |s: &Status, u: f64| u * s.fabric_time_s;
            let paused = before.map_or(0.0, |b| (p.paused_s - b.paused_s).max(0.0) / span);
            let (util, drops, ecn) = match before {
                Some(b) => (
                    (busy(&now, p.utilization) - busy(prev, b.utilization)) / span,
                    p.drops().saturating_sub(b.drops()),
                    p.ecn_marked.saturating_sub(b.ecn_marked),
                ),
                None => (0.0, 0, 0),
            };
            PortRate {
                name: p.port.clone(),
                class: p.class.clone(),
                util: util.clamp(0.0, 1.0),
                queue: p.queue_bytes,
                drops_per_s: drops as f64 / span,
                ecn_per_s: ecn as f64 / span,
                paused: paused.clamp(0.0, 1.0),
            }
        })
        .collect();
    View {
        jobs: crate::jobs::running(now.fabric.as_str()).len(),
        status: now,
        ports,
        events,
        span_s: span,
    }
}

/// Events `top` asks for: more than it shows, in case some came between the status and
/// the request.
const RECENT_EVENTS: u64 = 8;

pub fn top(fabric: Option<&FabricName>, once: bool) -> anyhow::Result<ExitCode> {
    closbox_switchd::require_root("closbox top")?;
    let st = live::resolve(fabric)?;
    let mut prev = snapshot(&st.fabric)?;
    std::thread::sleep(Duration::from_millis(500));
    // The last few (the view shows 2), not the whole log (up to 10,000) every second.
    let events = |f: &FabricName, s: &Status| {
        let after = s.events.saturating_sub(RECENT_EVENTS);
        match control::request(f, &Request::Events { after }) {
            Ok(Reply::Events { events }) => events,
            _ => Vec::new(),
        }
    };
    // Without a terminal to draw on (a pipe, a script, a CI log), one frame as text.
    if once || !std::io::stdout().is_terminal() {
        let now = snapshot(&st.fabric)?;
        let recent = events(&st.fabric, &now);
        let v = view(&prev, now, recent);
        let backend = ratatui::backend::TestBackend::new(80, 24);
        let mut term = ratatui::Terminal::new(backend)?;
        term.draw(|f| draw(f, &v))?;
        let buf = term.backend().buffer().clone();
        for y in 0..buf.area.height {
            let line: String = (0..buf.area.width)
                .map(|x| buf[(x, y)].symbol().to_owned())
                .collect();
            println!("{}", line.trim_end());
        }
        return Ok(ExitCode::SUCCESS);
    }
    let mut term = ratatui::try_init()
        .context("closbox top: cannot use this terminal (--once prints one frame as text)")?;
    let result = (|| -> anyhow::Result<()> {
        let mut next = Instant::now();
        let mut current: Option<View> = None;
        loop {
            if Instant::now() >= next {
                let now = snapshot(&st.fabric)?;
                let recent = events(&st.fabric, &now);
                let v = view(&prev, now.clone(), recent);
                prev = now;
                current = Some(v);
                next = Instant::now() + Duration::from_secs(1);
            }
            if let Some(v) = &current {
                term.draw(|f| draw(f, v))?;
            }
            if event::poll(next.saturating_duration_since(Instant::now()))? {
                if let TermEvent::Key(k) = event::read()? {
                    let ctrl_c =
                        k.code == KeyCode::Char('c') && k.modifiers.contains(KeyModifiers::CONTROL);
                    if matches!(k.code, KeyCode::Char('q') | KeyCode::Esc) || ctrl_c {
                        return Ok(());
                    }
                }
            }
        }
    })();
    ratatui::restore();
    result.map(|()| ExitCode::SUCCESS)
}

fn util_style(u: f64) -> Style {
    let c = if u >= 0.9 {
        Color::Red
    } else if u >= 0.6 {
        Color::Yellow
    } else if u >= 0.05 {
        Color::Green
    } else {
        Color::DarkGray
    };
    Style::default().fg(c)
}

fn draw(f: &mut Frame, v: &View) {
    let s = &v.status;
    let drops: u64 = s.drops.iter().map(|d| d.1).sum();
    // The fabric, then its health and counts, each packed into the frame's width (an
    // 80-column `--once` cut "drops 0  loads 0  changes 0" off after a long BEHIND).
    let mut about = vec![
        Span::styled(
            format!("fabric {}", s.fabric),
            Style::default().add_modifier(Modifier::BOLD),
        ),
        Span::raw(crate::bench::plural(s.gpus, "GPU")),
        Span::raw(format!("time_scale {}", s.time_scale)),
        Span::raw(format!("fabric time {:.6} s", s.fabric_time_s)),
    ];
    // Scenarios waiting for the GPUs' packets are not running yet.
    let waiting = s.timelines.iter().filter(|t| t.waiting.is_some()).count();
    match (s.timelines.len(), waiting) {
        (0, _) => {}
        (n, 0) => about.push(Span::raw(format!("chaos {n} running"))),
        (n, w) => about.push(Span::raw(format!("chaos {n} ({w} waiting)"))),
    }
    if v.jobs > 0 {
        about.push(Span::raw(crate::bench::plural(v.jobs, "job")));
    }
    let health = if !s.deadlocked.is_empty() {
        Span::styled(
            format!("DEADLOCK ({} ports paused for good)", s.deadlocked.len()),
            Style::default().fg(Color::Red).add_modifier(Modifier::BOLD),
        )
    } else if s.behind {
        let hint = behind_hint(
            s.cpu_recent.as_ref(),
            s.realtime,
            s.full_load_time_scale,
            s.time_scale.get(),
            closbox_switchd::sys::idle_poll_would_help(),
        );
        Span::styled(
            hint,
            Style::default().fg(Color::Red).add_modifier(Modifier::BOLD),
        )
    } else {
        Span::styled("health ok", Style::default().fg(Color::Green))
    };
    let counts = vec![
        health,
        Span::raw(format!("lateness p99 {:.1} us", s.lateness_recent.p99_us)),
        Span::raw(format!("packets {}", crate::plan::thousands(s.packets_in))),
        Span::raw(format!("drops {}", crate::plan::thousands(drops))),
        Span::raw(format!(
            "loads {}",
            s.loads.iter().filter(|l| l.active).count()
        )),
        Span::raw(format!("changes {}", s.events)),
    ];
    let width = f.area().width as usize;
    let mut header = pack(about, width);
    header.extend(pack(counts, width));
    let matrix = uplink_matrix(v);
    let rows = Layout::vertical([
        Constraint::Length(header.len() as u16),
        Constraint::Length(matrix.as_ref().map_or(0, |m| m.1 as u16 + 2)),
        Constraint::Min(5),
        Constraint::Length(4),
    ])
    .split(f.area());
    f.render_widget(Paragraph::new(header), rows[0]);
    if let Some((table, _)) = matrix {
        f.render_widget(table, rows[1]);
    }
    // The busiest ports.
    let mut ports: Vec<&PortRate> = v.ports.iter().collect();
    ports.sort_by(|a, b| {
        (b.util, b.drops_per_s, b.queue)
            .partial_cmp(&(a.util, a.drops_per_s, a.queue))
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    let height = rows[2].height.saturating_sub(3) as usize;
    // Lossless fabrics: a column for the share of time each port was paused.
    let lossless = !s.flow_control.is_empty() && s.flow_control != "none";
    let body: Vec<Row> = ports
        .iter()
        .take(height)
        .map(|p| {
            let mut cells = vec![
                Cell::from(p.name.clone()),
                Cell::from(p.class.clone()),
                Cell::from(format!("{:>5.1}%", p.util * 100.0)).style(util_style(p.util)),
                Cell::from(format!("{:>9}", approx_bytes(p.queue))),
                Cell::from(format!("{:>8.0}", p.drops_per_s)),
                Cell::from(format!("{:>8.0}", p.ecn_per_s)),
            ];
            if lossless {
                cells.push(Cell::from(format!("{:>5.1}%", p.paused * 100.0)));
            }
            Row::new(cells)
        })
        .collect();
    let mut widths = vec![
        Constraint::Length(20),
        Constraint::Length(10),
        Constraint::Length(7),
        Constraint::Length(10),
        Constraint::Length(9),
        Constraint::Length(9),
    ];
    let mut head = vec![
        "port",
        "link",
        "  busy",
        "    queue",
        " drops/s",
        "   ecn/s",
    ];
    if lossless {
        widths.push(Constraint::Length(7));
        head.push("paused");
    }
    let table = Table::new(body, widths)
        .header(Row::new(head).style(Style::default().add_modifier(Modifier::BOLD)))
        .block(Block::bordered().title(format!(
            " busiest ports (last {:.3} ms of fabric time) ",
            v.span_s * 1e3
        )));
    f.render_widget(table, rows[2]);
    let recent: Vec<Line> = v
        .events
        .iter()
        .rev()
        .take(2)
        .map(|e| Line::from(format!("{:.6} s  {}", e.fabric_ns as f64 / 1e9, e.what)))
        .collect();
    f.render_widget(
        Paragraph::new(if recent.is_empty() {
            vec![Line::from("no changes since up")]
        } else {
            recent
        })
        .block(Block::bordered().title(" recent events (q quits) ")),
        rows[3],
    );
}

/// Leaf → spine utilization as a matrix (leaves down, spines across), when the fabric
/// has leaf-spine links; and its row count.
fn uplink_matrix(v: &View) -> Option<(Table<'static>, usize)> {
    let up: Vec<&PortRate> = v
        .ports
        .iter()
        .filter(|p| p.class == "leaf-spine" && p.name.starts_with("leaf"))
        .collect();
    if up.is_empty() {
        return None;
    }
    let mut leaves: Vec<&str> = Vec::new();
    let mut spines: Vec<&str> = Vec::new();
    for p in &up {
        let (a, b) = port_ends(&p.name);
        if !leaves.contains(&a) {
            leaves.push(a);
        }
        if !spines.contains(&b) {
            spines.push(b);
        }
    }
    // What fits in 80 columns: 8 spines, 6 leaves.
    spines.truncate(8);
    leaves.truncate(6);
    let rows: Vec<Row> = leaves
        .iter()
        .map(|l| {
            let mut cells = vec![Cell::from(format!("{l} up"))];
            for s in &spines {
                let links = up.iter().filter(|p| port_ends(&p.name) == (l, s));
                let u = links.clone().map(|p| p.util).fold(0.0, f64::max);
                // Parallel links between the two that are down now.
                let down = v
                    .status
                    .changed_links
                    .iter()
                    .filter(|c| {
                        !c.up && c.ends.iter().any(|e| e == l) && c.ends.iter().any(|e| e == s)
                    })
                    .count();
                cells.push(match down {
                    0 => Cell::from(format!("{:>5.0}%", u * 100.0)).style(util_style(u)),
                    d if d >= links.count() => {
                        Cell::from(format!("{:>6}", "down")).style(Style::default().fg(Color::Red))
                    }
                    d => Cell::from(format!("{:>5.0}%{d}↓", u * 100.0))
                        .style(Style::default().fg(Color::Red)),
                });
            }
            Row::new(cells)
        })
        .collect();
    let n = rows.len();
    let mut widths = vec![Constraint::Length(12)];
    widths.extend(spines.iter().map(|_| Constraint::Length(8)));
    let mut head = vec![String::new()];
    head.extend(spines.iter().map(|s| format!("{s:>7}")));
    let table = Table::new(rows, widths)
        .header(Row::new(head).style(Style::default().add_modifier(Modifier::BOLD)))
        .block(Block::bordered().title(" leaf -> spine utilization "));
    Some((table, n + 1))
}

/// What `top` says of a fabric that is behind, from its data plane's recent CPU use,
/// `up --realtime`, `plan`'s full-load time scale and its own: the likeliest cause first
/// (as `dataplane::behind_advice` words it at length).
/// `spans` in lines of at most `width` columns, two spaces apart; a span is never cut
/// between lines (one wider than a line stands alone, and the frame cuts it).
fn pack(spans: Vec<Span<'static>>, width: usize) -> Vec<Line<'static>> {
    let mut lines = Vec::new();
    let mut line: Vec<Span> = Vec::new();
    let mut used = 0;
    for span in spans {
        let w = span.width();
        if !line.is_empty() && used + 2 + w > width {
            lines.push(Line::from(std::mem::take(&mut line)));
            used = 0;
        }
        if !line.is_empty() {
            line.push(Span::raw("  "));
            used += 2;
        }
        used += w;
        line.push(span);
    }
    if !line.is_empty() {
        lines.push(Line::from(line));
    }
    lines
}

fn behind_hint(
    cpu: Option<&CpuUse>,
    realtime: bool,
    full_load: f64,
    time_scale: f64,
    idle_poll_would_help: bool,
) -> String {
    match LateCause::of(cpu, cpu.map_or(0.0, |c| c.steal), realtime) {
        LateCause::Stolen(steal) => format!(
            "BEHIND (hypervisor took {:.0} % of the CPUs{})",
            steal * 100.0,
            if idle_poll_would_help {
                ": up --idle-poll"
            } else {
                ""
            }
        ),
        LateCause::Preempted(_) => "BEHIND (waited for a CPU: up --realtime)".to_owned(),
        LateCause::Work if full_load > time_scale => {
            format!("BEHIND (time_scale {full_load}+ estimated)")
        }
        LateCause::Work => "BEHIND (raise time_scale)".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_spans_are_packed_into_the_width_never_cut() {
        let spans = || {
            [
                "BEHIND (hypervisor took 24 % of the CPUs)",
                "lateness p99 14614.5 us",
            ]
            .into_iter()
            .chain(["packets 228,294", "drops 0", "loads 0", "changes 0"])
            .map(Span::raw)
            .collect::<Vec<_>>()
        };
        let text =
            |lines: Vec<Line>| -> Vec<String> { lines.iter().map(|l| l.to_string()).collect() };
        assert_eq!(
            text(pack(spans(), 80)),
            [
                "BEHIND (hypervisor took 24 % of the CPUs)  lateness p99 14614.5 us",
                "packets 228,294  drops 0  loads 0  changes 0",
            ]
        );
        assert_eq!(text(pack(spans(), 200)).len(), 1);
        // Narrower than a span: it stands alone on its line.
        let narrow = text(pack(spans(), 10));
        assert_eq!(narrow.len(), 6);
        assert_eq!(narrow[0], "BEHIND (hypervisor took 24 % of the CPUs)");
        assert!(pack(Vec::new(), 80).is_empty());
    }

    #[test]
    fn behind_names_the_hypervisor_then_the_scheduler_then_the_scale() {
        let cpu = |busy: f64, waited_ms: f64, steal: f64| CpuUse {
            steal,
            ..CpuUse::over(5.0, (busy * 5e9) as u64, (waited_ms * 1e6) as u64)
        };
        let stolen = cpu(0.31, 56.0, 0.2);
        assert_eq!(
            behind_hint(Some(&stolen), true, 5000.0, 20000.0, false),
            "BEHIND (hypervisor took 20 % of the CPUs)"
        );
        // Idle CPUs that halt, and `up --idle-poll` would have them poll.
        assert_eq!(
            behind_hint(Some(&stolen), false, 5000.0, 20000.0, true),
            "BEHIND (hypervisor took 20 % of the CPUs: up --idle-poll)"
        );
        let waited = cpu(0.7, 111.0, 0.01);
        assert_eq!(
            behind_hint(Some(&waited), false, 5000.0, 20000.0, true),
            "BEHIND (waited for a CPU: up --realtime)"
        );
        assert_eq!(
            behind_hint(Some(&waited), true, 5000.0, 1000.0, true),
            "BEHIND (time_scale 5000+ estimated)"
        );
        assert_eq!(
            behind_hint(None, false, 5000.0, 20000.0, true),
            "BEHIND (raise time_scale)"
        );
    }
}
