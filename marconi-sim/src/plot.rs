//! SVG figures (plotters, SVG backend only).

use std::path::Path;

use plotters::prelude::*;

type PlotResult = Result<(), String>;

fn err<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

/// A color per series index.
fn color(i: usize) -> RGBColor {
    COLORS[i % COLORS.len()]
}

/// A bar per `(label, value)`, values in percent of `scale` (e.g. hit rates
/// with scale 100).
pub fn bars(path: &Path, title: &str, y_label: &str, items: &[(String, f64)]) -> PlotResult {
    let root = SVGBackend::new(path, (800, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let ymax = items.iter().map(|(_, v)| *v).fold(0.0, f64::max).max(1e-9) * 1.15;
    let n = items.len().max(1);
    let labels: Vec<String> = items.iter().map(|(l, _)| l.clone()).collect();
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((0..n - 1).into_segmented(), 0.0..ymax)
        .map_err(err)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .y_desc(y_label)
        .x_label_formatter(&|x| match x {
            SegmentValue::CenterOf(i) => labels.get(*i).cloned().unwrap_or_default(),
            _ => String::new(),
        })
        .draw()
        .map_err(err)?;
    chart
        .draw_series(items.iter().enumerate().map(|(i, (_, v))| {
            let mut r = Rectangle::new(
                [
                    (SegmentValue::Exact(i), 0.0),
                    (SegmentValue::Exact(i + 1), *v),
                ],
                color(i).filled(),
            );
            r.set_margin(0, 0, 12, 12);
            r
        }))
        .map_err(err)?;
    chart
        .draw_series(items.iter().enumerate().map(|(i, (_, v))| {
            Text::new(
                format!("{v:.1}"),
                (SegmentValue::CenterOf(i), *v + ymax * 0.02),
                ("sans-serif", 14),
            )
        }))
        .map_err(err)?;
    root.present().map_err(err)
}

/// Lines through `(x, y)` points, one series per `(name, points)`.
pub fn lines(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    log_x: bool,
    series: &[(String, Vec<(f64, f64)>)],
) -> PlotResult {
    let root = SVGBackend::new(path, (800, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let pts = series.iter().flat_map(|(_, p)| p.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in pts {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if x0 > x1 {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    let y0 = y0.min(0.0);
    let y1 = if y1 <= y0 { y0 + 1.0 } else { y1 * 1.05 };
    let mut builder = ChartBuilder::on(&root);
    builder
        .caption(title, ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60);
    macro_rules! finish {
        ($chart:expr) => {{
            let mut chart = $chart;
            chart
                .configure_mesh()
                .x_desc(x_label)
                .y_desc(y_label)
                .draw()
                .map_err(err)?;
            for (i, (name, p)) in series.iter().enumerate() {
                let c = color(i);
                chart
                    .draw_series(LineSeries::new(p.iter().copied(), c.stroke_width(2)))
                    .map_err(err)?
                    .label(name.as_str())
                    .legend(move |(x, y)| {
                        PathElement::new([(x, y), (x + 20, y)], c.stroke_width(2))
                    });
                if p.len() <= 40 {
                    chart
                        .draw_series(p.iter().map(|&q| Circle::new(q, 3, c.filled())))
                        .map_err(err)?;
                }
            }
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .position(SeriesLabelPosition::UpperLeft)
                .draw()
                .map_err(err)?;
        }};
    }
    if log_x && x0 > 0.0 {
        finish!(builder
            .build_cartesian_2d((x0..x1).log_scale(), y0..y1)
            .map_err(err)?);
    } else {
        finish!(builder.build_cartesian_2d(x0..x1, y0..y1).map_err(err)?);
    }
    root.present().map_err(err)
}

/// Empirical CDFs, one per `(name, values)` (values need not be sorted);
/// at most 400 points per series are drawn.
pub fn cdf(path: &Path, title: &str, x_label: &str, series: &[(String, Vec<f64>)]) -> PlotResult {
    let curves: Vec<(String, Vec<(f64, f64)>)> = series
        .iter()
        .map(|(name, v)| {
            let mut v = v.clone();
            v.sort_by(f64::total_cmp);
            let n = v.len();
            let step = n.div_ceil(400).max(1);
            let mut pts: Vec<(f64, f64)> = (0..n)
                .step_by(step)
                .map(|i| (v[i], (i + 1) as f64 / n as f64))
                .collect();
            if let Some(&last) = v.last() {
                pts.push((last, 1.0));
            }
            (name.clone(), pts)
        })
        .collect();
    lines(path, title, x_label, "fraction of requests", true, &curves)
}

/// Quartiles and P5/P95 whiskers of `values` (paper Figs. 7–9 draw these).
pub fn five_numbers(values: &[f64]) -> Option<[f64; 5]> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    // Linear interpolation between closest ranks.
    let q = |p: f64| {
        let r = p * (v.len() - 1) as f64;
        let (lo, hi) = (r.floor() as usize, r.ceil() as usize);
        v[lo] + (v[hi] - v[lo]) * (r - lo as f64)
    };
    Some([q(0.05), q(0.25), q(0.5), q(0.75), q(0.95)])
}

/// Box plots: for each group (x axis) one box per series: the box spans the
/// quartiles, a line marks the median, whiskers reach P5 and P95.
pub fn boxes(
    path: &Path,
    title: &str,
    y_label: &str,
    groups: &[String],
    series: &[(String, Vec<Vec<f64>>)],
) -> PlotResult {
    let root = SVGBackend::new(path, (800, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let stats: Vec<Vec<Option<[f64; 5]>>> = series
        .iter()
        .map(|(_, per_group)| per_group.iter().map(|v| five_numbers(v)).collect())
        .collect();
    let all = stats.iter().flatten().flatten();
    let (mut y0, mut y1) = (0.0f64, f64::MIN);
    for s in all {
        y0 = y0.min(s[0]);
        y1 = y1.max(s[4]);
    }
    if y1 <= y0 {
        y1 = y0 + 1.0;
    }
    let pad = (y1 - y0) * 0.08;
    let n = groups.len().max(1);
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..n as f64, (y0 - pad.min(y0.abs()))..(y1 + pad))
        .map_err(err)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n * 2 + 1)
        .x_label_formatter(&|x| {
            let i = x.floor() as usize;
            if (x - i as f64 - 0.5).abs() < 1e-9 {
                groups.get(i).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_desc(y_label)
        .draw()
        .map_err(err)?;
    let k = series.len().max(1) as f64;
    let width = 0.7 / k;
    for (si, (name, _)) in series.iter().enumerate() {
        let c = color(si);
        let mut first = true;
        for (gi, s) in stats[si].iter().enumerate() {
            let Some([p5, q1, med, q3, p95]) = *s else {
                continue;
            };
            let left = gi as f64 + 0.15 + si as f64 * width;
            let (l, r, mid) = (left + width * 0.1, left + width * 0.9, left + width * 0.5);
            let drawn = chart
                .draw_series([
                    Rectangle::new([(l, q1), (r, q3)], c.mix(0.35).filled()),
                    Rectangle::new([(l, q1), (r, q3)], c.stroke_width(2)),
                ])
                .map_err(err)?;
            if first {
                drawn.label(name.as_str()).legend(move |(x, y)| {
                    Rectangle::new([(x, y - 5), (x + 16, y + 5)], c.mix(0.5).filled())
                });
                first = false;
            }
            chart
                .draw_series([
                    PathElement::new([(l, med), (r, med)], BLACK.stroke_width(2)),
                    PathElement::new([(mid, p5), (mid, q1)], c.stroke_width(1)),
                    PathElement::new([(mid, q3), (mid, p95)], c.stroke_width(1)),
                    PathElement::new([(l, p5), (r, p5)], c.stroke_width(1)),
                    PathElement::new([(l, p95), (r, p95)], c.stroke_width(1)),
                ])
                .map_err(err)?;
        }
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}
