//! Rendering of `bench` results: the nccl-tests-style table, CSV rows, an SVG plot.
//! Nothing here runs anything.

use std::fmt::Write as _;

use closbox_agents::bench::Row;
use closbox_fabric::TimeScale;

/// A byte count as topology files write it ("4MiB").
pub fn human(bytes: usize) -> String {
    closbox_fabric::Bytes::new(bytes as u64).to_string()
}

pub const CSV_HEADER: &str = "op,algo,ranks,channels,size,count,type,redop,root,time_us,algbw_gbs,busbw_gbs,wrong,predicted_us,measured_over_predicted,min_us,max_us";

pub fn csv_row(row: &Row, p: f64) -> String {
    format!(
        "{},{},{},{},{},{},{},{},{},{:.2},{:.4},{:.4},{},{:.2},{},{},{}",
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
        ratio(row.time_us, p).map_or(String::new(), |x| format!("{x:.3}")),
        extreme(&row.iter_us, f64::min),
        extreme(&row.iter_us, f64::max),
    )
}

/// The least or greatest of a row's iteration times, to 2 decimals; empty without any
/// (rows from agents that did not report them).
fn extreme(iters: &[f64], pick: fn(f64, f64) -> f64) -> String {
    iters
        .iter()
        .copied()
        .reduce(pick)
        .map_or(String::new(), |x| format!("{x:.2}"))
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
        "# closbox bench: fabric {fabric}, {}, {} channels, time_scale {time_scale} (times are fabric time)",
        crate::bench::plural(ranks, "rank"),
        channels
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

/// Line colours of plots (matplotlib's first eight).
pub const PALETTE: [plotters::style::RGBColor; 8] = [
    plotters::style::RGBColor(31, 119, 180),
    plotters::style::RGBColor(214, 39, 40),
    plotters::style::RGBColor(44, 160, 44),
    plotters::style::RGBColor(255, 127, 14),
    plotters::style::RGBColor(148, 103, 189),
    plotters::style::RGBColor(140, 86, 75),
    plotters::style::RGBColor(227, 119, 194),
    plotters::style::RGBColor(23, 190, 207),
];

/// busbw against size (log₂ axis): per operation and algorithm, measured (solid, dots)
/// and predicted (dashed, crosses), with a ceiling (a dotted line: the GPUs' NIC line
/// rate) and a title. `predicted` is per row, in µs.
pub fn plot(rows: &[Row], predicted: &[f64], title: &str, ceiling: Option<(f64, &str)>) -> String {
    use plotters::prelude::*;
    let mut svg = String::new();
    let measured = series(rows, |r| r.busbw);
    let predicted_busbw: Vec<Row> = rows
        .iter()
        .zip(predicted)
        .map(|(r, &p)| Row {
            busbw: if p > 0.0 {
                r.busbw * r.time_us / p
            } else {
                0.0
            },
            ..r.clone()
        })
        .collect();
    let predicted = series(&predicted_busbw, |r| r.busbw);
    let xs: Vec<f64> = rows.iter().map(|r| (r.size as f64).log2()).collect();
    let (x0, x1) = (
        xs.iter().copied().fold(f64::MAX, f64::min).floor(),
        xs.iter().copied().fold(f64::MIN, f64::max).ceil(),
    );
    let (x0, x1) = if x1 > x0 {
        (x0, x1)
    } else {
        (x0 - 1.0, x1 + 1.0)
    };
    let top = measured
        .iter()
        .chain(&predicted)
        .flat_map(|(_, p)| p.iter().map(|q| q.1))
        .chain(ceiling.map(|c| c.0))
        .fold(0.0, f64::max)
        .max(1e-3)
        * 1.12;
    // At most one label per whole power of two (plotters picks 1-2-5 steps).
    let labels = ((x1 - x0) as usize + 1).min(12);
    {
        let root = SVGBackend::with_string(&mut svg, (800, 480)).into_drawing_area();
        let _ = root.fill(&WHITE);
        let chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 17))
            .margin(12)
            .margin_right(36)
            .x_label_area_size(42)
            .y_label_area_size(62)
            .build_cartesian_2d(x0..x1, 0.0..top);
        let Ok(mut chart) = chart else {
            return svg_fallback(title);
        };
        let size_label = |x: &f64| {
            if (x - x.round()).abs() < 1e-9 {
                human(2f64.powf(x.round()) as usize)
            } else {
                String::new()
            }
        };
        let _ = chart
            .configure_mesh()
            .x_desc("message size (bytes)")
            .y_desc("busbw (GB/s, fabric time)")
            .x_labels(labels)
            .x_label_formatter(&size_label)
            .y_label_formatter(&|y| format!("{y}"))
            .light_line_style(WHITE.mix(0.0))
            .draw();
        let palette = PALETTE;
        if let Some((rate, label)) = ceiling {
            let grey = RGBColor(110, 110, 110);
            if let Ok(a) = chart.draw_series(DashedLineSeries::new(
                vec![(x0, rate), (x1, rate)],
                2,
                4,
                grey.stroke_width(1),
            )) {
                a.label(label.to_owned())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], grey));
            }
        }
        for (i, (name, pts)) in measured.iter().enumerate() {
            let c = palette[i % palette.len()];
            if let Ok(a) = chart.draw_series(LineSeries::new(pts.clone(), c.stroke_width(2))) {
                a.label(format!("{name} measured")).legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2))
                });
            }
            let _ = chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, c.filled())));
            if let Some((_, pp)) = predicted.iter().find(|(n, _)| n == name) {
                if let Ok(a) =
                    chart.draw_series(DashedLineSeries::new(pp.clone(), 6, 4, c.stroke_width(1)))
                {
                    a.label(format!("{name} predicted")).legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 8, y)], c.stroke_width(1))
                    });
                }
                let _ = chart.draw_series(pp.iter().map(|&p| Cross::new(p, 4, c.stroke_width(1))));
            }
        }
        let _ = chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(RGBColor(200, 200, 200))
            .draw();
        let _ = root.present();
    }
    svg
}

/// (op (algo), points (log₂ size, value)) per operation and algorithm, in row order.
fn series(rows: &[Row], value: impl Fn(&Row) -> f64) -> Vec<(String, Vec<(f64, f64)>)> {
    let mut out: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for r in rows {
        let key = format!("{} ({})", r.op.name(), r.algo);
        let point = ((r.size as f64).log2(), value(r));
        match out.iter_mut().find(|(k, _)| *k == key) {
            Some((_, pts)) => pts.push(point),
            None => out.push((key, vec![point])),
        }
    }
    out
}

/// An SVG that says the plot could not be drawn (a degenerate range).
fn svg_fallback(title: &str) -> String {
    format!("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"800\" height=\"60\"><text x=\"10\" y=\"30\">{title}: nothing to plot</text></svg>\n")
}
