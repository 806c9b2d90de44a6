//! Rendering of `bench` results: the nccl-tests-style table, CSV rows, an SVG plot.
//! Nothing here runs anything.

use std::fmt::Write as _;

use closbox_agents::bench::Row;
use closbox_fabric::TimeScale;

/// A byte count as topology files write it ("4MiB").
pub fn human(bytes: usize) -> String {
    closbox_fabric::Bytes::new(bytes as u64).to_string()
}

pub const CSV_HEADER: &str = "op,algo,ranks,channels,size,count,type,redop,root,time_us,algbw_gbs,busbw_gbs,wrong,predicted_us,measured_over_predicted";

pub fn csv_row(row: &Row, p: f64) -> String {
    format!(
        "{},{},{},{},{},{},{},{},{},{:.2},{:.4},{:.4},{},{:.2},{}",
        row.op.name(),
        row.algo,
        row.ranks,
        row.channels,
        row.size,
        row.count,
        row.dtype.name(),
        row.redop.map_or("", |o| o.name()),
        row.root.map_or(String::new(), |x| x.to_string()),
        row.time_us,
        row.algbw,
        row.busbw,
        row.wrong,
        p,
        ratio(row.time_us, p).map_or(String::new(), |x| format!("{x:.3}"))
    )
}

/// Measured over predicted; `None` where there is nothing to compare with (one rank: no
/// communication predicted).
pub fn ratio(measured: f64, predicted: f64) -> Option<f64> {
    (predicted > 0.0).then(|| measured / predicted)
}

pub fn table_header(
    fabric: &str,
    time_scale: TimeScale,
    ranks: usize,
    channels: usize,
    real_paths: bool,
) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# closbox bench: fabric {fabric}, {ranks} ranks, {channels} channels, time_scale {time_scale} (times are fabric time)"
    );
    let _ = writeln!(
        s,
        "# predicted: fabric model on {}",
        if real_paths {
            "the ECMP paths this run's connections took"
        } else {
            "ECMP paths drawn at random (averaged)"
        }
    );
    let _ = writeln!(s, "#");
    let _ = writeln!(
        s,
        "# {:>10} {:>11} {:>8} {:>6} {:>5} {:>12} {:>8} {:>8} {:>7} {:>12} {:>9}  algo",
        "size",
        "count",
        "type",
        "redop",
        "root",
        "time",
        "algbw",
        "busbw",
        "#wrong",
        "predicted",
        "meas/pred"
    );
    let _ = writeln!(
        s,
        "# {:>10} {:>11} {:>8} {:>6} {:>5} {:>12} {:>8} {:>8} {:>7} {:>12} {:>9}",
        "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", ""
    );
    s
}

pub fn table_row(r: &Row, p: f64) -> String {
    format!(
        "  {:>10} {:>11} {:>8} {:>6} {:>5} {:>12.1} {:>8.3} {:>8.3} {:>7} {:>12.1} {:>9}  {}",
        r.size,
        r.count,
        r.dtype.name(),
        r.redop.map_or("-", |o| o.name()),
        r.root.map_or("-".into(), |x| x.to_string()),
        r.time_us,
        r.algbw,
        r.busbw,
        r.wrong,
        p,
        ratio(r.time_us, p).map_or("-".into(), |x| format!("{x:.2}")),
        r.algo
    )
}

/// busbw against size (log₂ axis), one line per operation and algorithm.
pub fn plot(rows: &[Row]) -> String {
    let (w, h, l, b) = (720.0, 420.0, 70.0, 50.0);
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for r in rows {
        let key = format!("{} ({})", r.op.name(), r.algo);
        let point = ((r.size as f64).log2(), r.busbw);
        match series.iter_mut().find(|(k, _)| *k == key) {
            Some((_, pts)) => pts.push(point),
            None => series.push((key, vec![point])),
        }
    }
    let xs = rows.iter().map(|r| (r.size as f64).log2());
    let (x0, x1) = (
        xs.clone().fold(f64::MAX, f64::min),
        xs.fold(f64::MIN, f64::max).max(1.0),
    );
    let y1 = rows.iter().map(|r| r.busbw).fold(0.0, f64::max).max(1e-9) * 1.1;
    let px = |x: f64| l + (x - x0) / (x1 - x0).max(1.0) * (w - l - 20.0);
    let py = |y: f64| h - b - y / y1 * (h - b - 20.0);
    let colors = [
        "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
    ];
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    );
    let _ = writeln!(
        s,
        "<line x1=\"{l}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>",
        h - b,
        w - 20.0,
        h - b
    );
    let _ = writeln!(
        s,
        "<line x1=\"{l}\" y1=\"20\" x2=\"{l}\" y2=\"{}\" stroke=\"black\"/>",
        h - b
    );
    for i in 0..=4 {
        let y = y1 * i as f64 / 4.0;
        let _ = writeln!(
            s,
            "<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{y:.3}</text>",
            l - 6.0,
            py(y) + 4.0
        );
    }
    let mut x = x0.ceil();
    while x <= x1 {
        let _ = writeln!(
            s,
            "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{}</text>",
            px(x),
            h - b + 16.0,
            human(2f64.powf(x) as usize)
        );
        x += ((x1 - x0) / 8.0).ceil().max(1.0);
    }
    let _ = writeln!(
        s,
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">message size</text>",
        (l + w) / 2.0,
        h - 10.0
    );
    let _ = writeln!(s, "<text x=\"16\" y=\"{}\" transform=\"rotate(-90 16 {})\" text-anchor=\"middle\">busbw (GB/s, fabric time)</text>", h / 2.0, h / 2.0);
    for (i, (name, pts)) in series.iter().enumerate() {
        let c = colors[i % colors.len()];
        let path: Vec<String> = pts
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
            .collect();
        let _ = writeln!(
            s,
            "<polyline fill=\"none\" stroke=\"{c}\" stroke-width=\"2\" points=\"{}\"/>",
            path.join(" ")
        );
        let _ = writeln!(
            s,
            "<text x=\"{}\" y=\"{}\" fill=\"{c}\">{name}</text>",
            l + 10.0,
            34 + 16 * i
        );
    }
    s.push_str("</svg>\n");
    s
}
