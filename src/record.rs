//! `closbox record`: per-port queue depth and utilization sampled by the daemon at a
//! fabric-time interval, as CSV; `closbox plot`: draws such a file.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::process::ExitCode;

use anyhow::{bail, Context};
use closbox_switchd::control::{self, Reply, Request};
use closbox_switchd::state::FabricName;

use crate::live;

pub struct RecordArgs<'a> {
    pub fabric: Option<&'a FabricName>,
    pub file: &'a Path,
    pub interval: closbox_fabric::Duration,
    pub ports: Option<&'a str>,
    pub duration: Option<closbox_fabric::Duration>,
}

pub fn record(a: RecordArgs) -> anyhow::Result<ExitCode> {
    closbox_switchd::require_root("closbox record")?;
    let st = live::resolve(a.fabric)?;
    let all: Vec<String> = match control::request(&st.fabric, &Request::Status { tcp: false })? {
        Reply::Status(s) => s.ports.iter().map(|p| p.port.clone()).collect(),
        Reply::Error { message } => bail!("{message}"),
        other => bail!("unexpected reply from the daemon: {other:?}"),
    };
    let ports: Vec<String> = match a.ports {
        None => all.clone(),
        Some(list) => {
            let pats: Vec<&str> = list
                .split(',')
                .map(str::trim)
                .filter(|p| !p.is_empty())
                .collect();
            all.iter()
                .filter(|p| pats.iter().any(|pat| p.contains(pat)))
                .cloned()
                .collect()
        }
    };
    if ports.is_empty() {
        return Err(crate::usage(format!(
            "--ports {:?} matches no port; ports are named like {:?}",
            a.ports.unwrap_or(""),
            all.first().map_or("", String::as_str)
        )));
    }
    let stop = closbox_switchd::stop_on_signals()?;
    let req = Request::Record {
        ports: ports.clone(),
        interval_ns: a.interval.as_nanos(),
        duration_ns: a.duration.map(|d| d.as_nanos()),
    };
    let (reply, mut stream) = control::open_stream(&st.fabric, &req)?;
    match reply {
        Reply::Recording { .. } => {}
        Reply::Error { message } => return Err(crate::usage(message)),
        other => bail!("unexpected reply from the daemon: {other:?}"),
    }
    // Created once the daemon took the request: a refused one leaves an existing file as
    // it was (it was truncated first).
    let mut out = std::io::BufWriter::new(
        std::fs::File::create(a.file).with_context(|| format!("creating {}", a.file.display()))?,
    );
    writeln!(
        out,
        "# closbox record: fabric {}, {} port{}, every {} of fabric time (time_scale {})",
        st.fabric,
        ports.len(),
        if ports.len() == 1 { "" } else { "s" },
        a.interval,
        st.time_scale
    )?;
    eprintln!(
        "closbox: recording {} port{} of fabric {} every {} of fabric time into {}{}",
        ports.len(),
        if ports.len() == 1 { "" } else { "s" },
        st.fabric,
        a.interval,
        a.file.display(),
        if a.duration.is_none() {
            "; Ctrl-C ends it"
        } else {
            ""
        }
    );
    let tail =
        crate::capture::copy_stream(&mut stream, &mut out, &a.file.display().to_string(), &stop)?;
    // The daemon's last line says why it ended the recording, if it did.
    let why = String::from_utf8_lossy(&tail)
        .lines()
        .last()
        .and_then(|l| l.strip_prefix(control::RECORD_ENDED))
        .and_then(closbox_switchd::dataplane::StreamEnd::from_words);
    let down = crate::capture::went_down(&st.fabric, why);
    if !down.is_empty() {
        eprintln!("closbox: recording into {} ended{down}", a.file.display());
    }
    Ok(ExitCode::SUCCESS)
}

/// What to plot from a recording.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Metric {
    Queue,
    Utilization,
}

/// A recording, read back: per port, (fabric seconds, queue bytes, utilization).
struct Recorded {
    title: String,
    series: BTreeMap<String, Vec<(f64, f64, f64)>>,
}

/// The longest line a recording holds (a row, or its header's comment) is far shorter.
const MAX_LINE: u64 = 64 * 1024;

/// Reads a recording line by line (a pipe or FIFO works; a file that is not one fails at
/// its first bad line, and an endless one such as `/dev/zero` at `MAX_LINE` bytes).
fn read(file: &Path) -> anyhow::Result<Recorded> {
    use std::io::{BufRead, Read};
    let reading = || format!("reading {}", file.display());
    let mut input = std::io::BufReader::new(std::fs::File::open(file).with_context(reading)?);
    let mut title = String::new();
    let mut series: BTreeMap<String, Vec<(f64, f64, f64)>> = BTreeMap::new();
    let mut raw = Vec::new();
    for n in 0.. {
        raw.clear();
        (&mut input)
            .take(MAX_LINE + 1)
            .read_until(b'\n', &mut raw)
            .with_context(reading)?;
        if raw.is_empty() {
            break;
        }
        if raw.len() as u64 > MAX_LINE {
            return Err(crate::usage(format!(
                "{}:{}: a line longer than {MAX_LINE} bytes: not a recording of `closbox record`",
                file.display(),
                n + 1
            )));
        }
        let Ok(line) = std::str::from_utf8(&raw) else {
            return Err(crate::usage(format!(
                "{}:{}: not text: not a recording of `closbox record`",
                file.display(),
                n + 1
            )));
        };
        let line = line.trim_end_matches(['\n', '\r']);
        if let Some(c) = line.strip_prefix("# closbox record: ") {
            title = c.to_owned();
            continue;
        }
        if line.starts_with('#') || line.starts_with("fabric_time_s,") || line.is_empty() {
            continue;
        }
        let f: Vec<&str> = line.split(',').collect();
        let bad = || {
            crate::usage(format!(
                "{}:{}: not a row of `closbox record` (fabric_time_s,port,queue_bytes,utilization)",
                file.display(),
                n + 1
            ))
        };
        if f.len() != 4 {
            return Err(bad());
        }
        // Fabric seconds, bytes and a share: finite and not negative (a float parser also
        // takes "nan", "inf" and "-1", which no recording holds and no axis can show).
        let number = |v: &str, what: &str| match v.parse::<f64>() {
            Ok(x) if x.is_finite() && x >= 0.0 => Ok(x),
            _ => Err(crate::usage(format!(
                "{}:{}: {what} {v:?} is not a number ≥ 0",
                file.display(),
                n + 1
            ))),
        };
        let (t, q, u) = (
            number(f[0], "fabric_time_s")?,
            number(f[2], "queue_bytes")?,
            number(f[3], "utilization")?,
        );
        series.entry(f[1].to_owned()).or_default().push((t, q, u));
    }
    if series.is_empty() {
        return Err(crate::usage(format!("{}: no samples", file.display())));
    }
    Ok(Recorded { title, series })
}

/// Draws the `top` ports (by their highest value) of a recording as lines over time.
pub fn plot(file: &Path, out: &Path, metric: Metric, top: usize) -> anyhow::Result<ExitCode> {
    use plotters::prelude::*;
    let rec = read(file)?;
    let value = |s: &(f64, f64, f64)| match metric {
        Metric::Queue => s.1,
        Metric::Utilization => s.2 * 100.0,
    };
    let mut ranked: Vec<(&String, f64)> = rec
        .series
        .iter()
        .map(|(k, v)| (k, v.iter().map(value).fold(0.0, f64::max)))
        .collect();
    ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(b.0)));
    ranked.truncate(top.max(1));
    let (t0, t1) = rec
        .series
        .values()
        .flatten()
        .fold((f64::MAX, f64::MIN), |(a, b), s| (a.min(s.0), b.max(s.0)));
    // Time in ms or µs of fabric time, whichever reads better.
    let (scale, unit) = if t1 - t0 >= 2e-3 {
        (1e3, "ms")
    } else {
        (1e6, "µs")
    };
    let peak = ranked.iter().map(|r| r.1).fold(0.0, f64::max);
    let (ydiv, yunit) = match metric {
        Metric::Utilization => (1.0, "utilization (%)"),
        Metric::Queue if peak >= 4.0 * 1048576.0 => (1048576.0, "queue (MiB)"),
        Metric::Queue if peak >= 4096.0 => (1024.0, "queue (KiB)"),
        Metric::Queue => (1.0, "queue (bytes)"),
    };
    let ytop = match metric {
        Metric::Utilization => 105.0,
        Metric::Queue => (peak / ydiv * 1.1).max(1.0),
    };
    let title = format!(
        "{} per port{}",
        match metric {
            Metric::Queue => "queue depth",
            Metric::Utilization => "utilization",
        },
        if rec.title.is_empty() {
            String::new()
        } else {
            format!(" ({})", rec.title.split(',').next().unwrap_or(""))
        }
    );
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (900, 480)).into_drawing_area();
        let _ = root.fill(&WHITE);
        let mut chart = ChartBuilder::on(&root)
            .caption(&title, ("sans-serif", 17))
            .margin(12)
            .margin_right(30)
            .x_label_area_size(42)
            .y_label_area_size(66)
            .build_cartesian_2d((t0 * scale)..(t1 * scale).max(t0 * scale + 1e-9), 0.0..ytop)
            .map_err(|e| anyhow::anyhow!("plotting: {e}"))?;
        chart
            .configure_mesh()
            .x_desc(format!("fabric time ({unit})"))
            .y_desc(yunit)
            .light_line_style(WHITE.mix(0.0))
            .draw()
            .map_err(|e| anyhow::anyhow!("plotting: {e}"))?;
        let palette = crate::render::PALETTE;
        for (i, (port, _)) in ranked.iter().enumerate() {
            let c = palette[i % palette.len()];
            let pts: Vec<(f64, f64)> = rec.series[*port]
                .iter()
                .map(|s| (s.0 * scale, value(s) / ydiv))
                .collect();
            chart
                .draw_series(LineSeries::new(pts, c.stroke_width(2)))
                .map_err(|e| anyhow::anyhow!("plotting: {e}"))?
                .label(port.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(RGBColor(200, 200, 200))
            .draw()
            .map_err(|e| anyhow::anyhow!("plotting: {e}"))?;
        root.present()
            .map_err(|e| anyhow::anyhow!("plotting: {e}"))?;
    }
    std::fs::write(out, svg).with_context(|| format!("writing {}", out.display()))?;
    eprintln!(
        "closbox: {} of {} port{} written to {}",
        match metric {
            Metric::Queue => "queue depth",
            Metric::Utilization => "utilization",
        },
        ranked.len(),
        if ranked.len() == 1 { "" } else { "s" },
        out.display()
    );
    Ok(ExitCode::SUCCESS)
}
