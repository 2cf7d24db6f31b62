//! SVG figures (plotters, SVG backend only).
//!
//! Every figure has the same frame: a title, a context line under it (model,
//! trace, capacity), the chart, and, where there are several series, a
//! legend in a column right of the plot area, so that it never covers data.
//! Axes are padded so that markers on the first and last values are drawn
//! whole, ticks are chosen here (1-2-5 steps; on log axes 1-2-5 per decade,
//! or the caller's values) and labelled with [`number`]: whole numbers as
//! integers with thousands separators.

use std::ops::Range;
use std::path::Path;

use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::replay::Policy;

type PlotResult = Result<(), String>;
type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;
type Chart<'b, 'a> = ChartContext<'b, SVGBackend<'a>, Cartesian2d<Ticked, Ticked>>;

/// A linear axis whose labelled ticks are chosen here (plotters' own f64
/// axis picks them itself, and its key-point wrapper loses the label
/// formatter).
#[derive(Clone, Debug)]
struct Ticked {
    range: Range<f64>,
    ticks: Vec<f64>,
}

impl Ranged for Ticked {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, v: &f64, limit: (i32, i32)) -> i32 {
        let span = self.range.end - self.range.start;
        let frac = if span > 0.0 {
            (v - self.range.start) / span
        } else {
            0.5
        };
        limit.0 + (f64::from(limit.1 - limit.0) * frac).round() as i32
    }

    fn key_points<H: KeyPointHint>(&self, hint: H) -> Vec<f64> {
        // No unlabelled light grid lines.
        if hint.weight().allow_light_points() {
            Vec::new()
        } else {
            self.ticks.clone()
        }
    }

    fn range(&self) -> Range<f64> {
        self.range.clone()
    }
}

fn err<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

/// Figure size in pixels.
const SIZE: (u32, u32) = (960, 540);
/// Width of the legend column right of the plot area.
const LEGEND_WIDTH: u32 = 200;
const FONT: &str = "sans-serif";
const GRID: RGBColor = RGBColor(222, 222, 222);

const COLORS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// A series' color: that of the policy its name starts with, the same in
/// every figure (marconi blue, `marconi - sglang-plus` too), otherwise one
/// per series index after the policies'.
fn color(name: &str, i: usize) -> RGBColor {
    // Every policy, the opt-in ones after those `compare` runs by default.
    let all: Vec<Policy> = Policy::ALL
        .into_iter()
        .chain([Policy::MarconiShadow, Policy::MarconiHinted])
        .collect();
    let first = name.split_whitespace().next().unwrap_or("");
    let k = all
        .iter()
        .position(|p| p.name() == first)
        .unwrap_or(all.len() + i);
    COLORS[k % COLORS.len()]
}

/// A tick or value label: whole numbers as integers with thousands
/// separators (`45,000`, never `45000.0`), others with at most three
/// decimals and no trailing zeros (`0.25`).
pub fn number(v: f64) -> String {
    if !v.is_finite() {
        return v.to_string();
    }
    let r = v.round();
    if (v - r).abs() <= 1e-9 * v.abs().max(1.0) && r.abs() < 9e15 {
        let digits = (r.abs() as u64).to_string();
        let mut s = String::with_capacity(digits.len() + digits.len() / 3 + 1);
        if r < 0.0 {
            s.push('-');
        }
        for (i, ch) in digits.chars().enumerate() {
            if i > 0 && (digits.len() - i) % 3 == 0 {
                s.push(',');
            }
            s.push(ch);
        }
        s
    } else {
        let s = format!("{v:.3}");
        let s = s.trim_end_matches('0').trim_end_matches('.');
        if s == "-0" {
            "0".to_owned()
        } else {
            s.to_owned()
        }
    }
}

/// Ticks at multiples of a 1, 2, 2.5 or 5 × 10^k step, about `target` of
/// them, within `lo..=hi`.
fn linear_ticks(lo: f64, hi: f64, target: usize) -> Vec<f64> {
    let span = hi - lo;
    if !(span > 0.0 && span.is_finite()) {
        return vec![lo];
    }
    let raw = span / target.max(1) as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|&s| s >= raw * (1.0 - 1e-9))
        .unwrap_or(10.0 * mag);
    let (first, last) = ((lo / step).ceil() as i64, (hi / step).floor() as i64);
    // `+ 0.0` turns -0 into 0.
    (first..=last).map(|i| i as f64 * step + 0.0).collect()
}

/// 1, 2 and 5 × 10^k within `lo..=hi` (both positive); every integer
/// multiple of 10^k when that gives fewer than three.
fn log_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let decades = lo.log10().floor() as i32..=hi.log10().ceil() as i32;
    let within = |v: f64| v >= lo * (1.0 - 1e-9) && v <= hi * (1.0 + 1e-9);
    let pick = |mults: &[f64]| -> Vec<f64> {
        decades
            .clone()
            .flat_map(|e| mults.iter().map(move |m| m * 10f64.powi(e)))
            .filter(|&v| within(v))
            .collect()
    };
    let t = pick(&[1.0, 2.0, 5.0]);
    if t.len() >= 3 {
        t
    } else {
        pick(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0])
    }
}

/// `lo..hi` widened by `frac` of its span on both sides (by 1 when empty).
fn padded(lo: f64, hi: f64, frac: f64) -> Range<f64> {
    if hi > lo {
        let pad = (hi - lo) * frac;
        lo - pad..hi + pad
    } else {
        lo - 1.0..hi + 1.0
    }
}

/// Fills the background, draws the title and the context line, and returns
/// the area for the chart and, when `legend`, the column for the legend.
fn frame<'a>(
    root: &Area<'a>,
    title: &str,
    context: &str,
    legend: bool,
) -> Result<(Area<'a>, Option<Area<'a>>), String> {
    root.fill(&WHITE).map_err(err)?;
    let (w, _) = root.dim_in_pixel();
    let centred = |size: u32| {
        TextStyle::from((FONT, size).into_font()).pos(Pos::new(HPos::Center, VPos::Top))
    };
    root.draw(&Text::new(
        title.to_owned(),
        (w as i32 / 2, 10),
        centred(22),
    ))
    .map_err(err)?;
    let mut top = 42;
    if !context.is_empty() {
        root.draw(&Text::new(
            context.to_owned(),
            (w as i32 / 2, 40),
            centred(15).color(&RGBColor(70, 70, 70)),
        ))
        .map_err(err)?;
        top = 64;
    }
    let body = root.margin(top, 0, 0, 0);
    if legend {
        let (chart, legend) = body.split_horizontally(w - LEGEND_WIDTH);
        Ok((chart, Some(legend)))
    } else {
        Ok((body, None))
    }
}

/// How a legend entry shows its series: as the chart draws it.
#[derive(Clone, Copy)]
enum Mark {
    /// A line of this stroke width, with a marker when the chart draws
    /// markers on the series.
    Line {
        width: u32,
        marker: bool,
        dashed: bool,
    },
    /// A patch filled at this opacity (bars 1.0, boxes less), outlined.
    Patch { opacity: f64 },
}

/// Stroke width of line series `i` of `n`: the first drawn widest, so that a
/// curve drawn later on top of an equal one leaves it visible.
fn line_width(i: usize, n: usize) -> u32 {
    if n <= 1 {
        2
    } else {
        2 + (4 * (n - 1 - i) / (n - 1)) as u32
    }
}

/// One entry per name, top-down in the legend column.
fn legend<S: AsRef<str>>(area: &Area<'_>, names: &[S], marks: &[Mark]) -> PlotResult {
    let style = TextStyle::from((FONT, 14).into_font()).pos(Pos::new(HPos::Left, VPos::Center));
    for (i, (name, mark)) in names.iter().zip(marks).enumerate() {
        let (c, y) = (color(name.as_ref(), i), 30 + 24 * i as i32);
        match *mark {
            Mark::Line {
                width,
                marker,
                dashed,
            } => {
                let segments: &[(i32, i32)] = if dashed {
                    &[(4, 12), (15, 23), (26, 30)]
                } else {
                    &[(4, 30)]
                };
                for &(a, b) in segments {
                    area.draw(&PathElement::new([(a, y), (b, y)], c.stroke_width(width)))
                        .map_err(err)?;
                }
                if marker {
                    area.draw(&Circle::new((17, y), 4, c.filled()))
                        .map_err(err)?;
                }
            }
            Mark::Patch { opacity } => {
                area.draw(&Rectangle::new(
                    [(6, y - 7), (28, y + 7)],
                    c.mix(opacity).filled(),
                ))
                .map_err(err)?;
                area.draw(&Rectangle::new(
                    [(6, y - 7), (28, y + 7)],
                    c.stroke_width(1),
                ))
                .map_err(err)?;
            }
        }
        area.draw(&Text::new(name.as_ref().to_owned(), (38, y), style.clone()))
            .map_err(err)?;
    }
    Ok(())
}

/// The chart in `area`: `x` and `y` ranges with the given ticks.
fn chart<'b, 'a>(
    area: &'b Area<'a>,
    x: Range<f64>,
    x_ticks: Vec<f64>,
    y: Range<f64>,
    y_ticks: Vec<f64>,
) -> Result<Chart<'b, 'a>, String> {
    ChartBuilder::on(area)
        .margin_top(8)
        .margin_left(8)
        .margin_bottom(8)
        // Room for half of the last x tick label.
        .margin_right(36)
        .x_label_area_size(48)
        .y_label_area_size(70)
        .build_cartesian_2d(
            Ticked {
                range: x,
                ticks: x_ticks,
            },
            Ticked {
                range: y,
                ticks: y_ticks,
            },
        )
        .map_err(err)
}

/// Axes, tick labels and a light grid (none across categorical x).
fn mesh(
    chart: &mut Chart<'_, '_>,
    x_desc: &str,
    y_desc: &str,
    x_fmt: &dyn Fn(&f64) -> String,
    x_grid: bool,
) -> PlotResult {
    let y_fmt = |v: &f64| number(*v);
    let mut m = chart.configure_mesh();
    m.bold_line_style(GRID)
        .light_line_style(TRANSPARENT)
        .label_style((FONT, 13))
        .axis_desc_style((FONT, 14))
        .x_label_formatter(x_fmt)
        .y_label_formatter(&y_fmt)
        .x_desc(x_desc)
        .y_desc(y_desc);
    if !x_grid {
        m.disable_x_mesh();
    }
    m.draw().map_err(err)
}

/// The x axis of a line chart.
#[derive(Clone, Debug, Default)]
pub struct XAxis<'a> {
    /// Description under the axis.
    pub label: &'a str,
    /// Logarithmic scale (values ≤ 0 are left out).
    pub log: bool,
    /// Where to put labelled ticks (e.g. the swept values); empty: 1-2-5
    /// steps chosen here.
    pub ticks: Vec<f64>,
}

/// Lines through `(x, y)` points, one series per `(name, points)`, with
/// markers where a series has at most 40 points. `context` is the line
/// under the title (model, trace, capacity), empty for none.
pub fn lines(
    path: &Path,
    title: &str,
    context: &str,
    x_axis: &XAxis<'_>,
    y_label: &str,
    series: &[(String, Vec<(f64, f64)>)],
) -> PlotResult {
    lines_with(
        path,
        title,
        context,
        x_axis,
        y_label,
        series,
        &LineOpts::default(),
    )
}

/// How [`lines_with`] draws its series.
#[derive(Clone, Debug, Default)]
pub struct LineOpts {
    /// Earlier series wider (CDFs that may coincide), instead of all 2 px.
    pub wide_first: bool,
    /// Names of reference series (a value that does not depend on x): a
    /// thin line without markers.
    pub references: Vec<String>,
    /// Names of series drawn dashed, 2 px, over the others: variants that
    /// may coincide with a solid series and must stay visible on it.
    pub dashed: Vec<String>,
}

/// [`lines`] with drawing options.
pub fn lines_with(
    path: &Path,
    title: &str,
    context: &str,
    x_axis: &XAxis<'_>,
    y_label: &str,
    series: &[(String, Vec<(f64, f64)>)],
    opts: &LineOpts,
) -> PlotResult {
    let is_reference = |name: &str| opts.references.iter().any(|r| r == name);
    let is_dashed = |name: &str| opts.dashed.iter().any(|r| r == name);
    // A log axis is drawn as a linear one over log10(x): one coordinate
    // type for both, ticks where they are asked for.
    let log = x_axis.log;
    let to_x = |x: f64| if log { x.log10() } else { x };
    let series: Vec<(&str, Vec<(f64, f64)>)> = series
        .iter()
        .map(|(name, p)| {
            let p = p
                .iter()
                .filter(|(x, y)| x.is_finite() && y.is_finite() && (!log || *x > 0.0))
                .map(|&(x, y)| (to_x(x), y))
                .collect();
            (name.as_str(), p)
        })
        .collect();
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in series.iter().flat_map(|(_, p)| p) {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if x0 > x1 {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    let xr = padded(x0, x1, 0.03);
    let yr = padded(y0.min(0.0), y1, 0.04);
    let x_ticks: Vec<f64> = if !x_axis.ticks.is_empty() {
        x_axis
            .ticks
            .iter()
            .filter(|&&t| !log || t > 0.0)
            .map(|&t| to_x(t))
            .filter(|t| xr.contains(t))
            .collect()
    } else if log {
        log_ticks(10f64.powf(xr.start), 10f64.powf(xr.end))
            .into_iter()
            .map(f64::log10)
            .collect()
    } else {
        linear_ticks(xr.start, xr.end, 8)
    };
    let y_ticks = linear_ticks(yr.start, yr.end, 8);
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    let (area, legend_area) = frame(&root, title, context, series.len() > 1)?;
    let mut chart = chart(&area, xr, x_ticks, yr, y_ticks)?;
    let x_fmt = |v: &f64| number(if log { 10f64.powf(*v) } else { *v });
    mesh(&mut chart, x_axis.label, y_label, &x_fmt, true)?;
    let mut marks = vec![None; series.len()];
    // Dashed series last, on top of the solid ones they may coincide with.
    let mut order: Vec<usize> = (0..series.len()).collect();
    order.sort_by_key(|&i| is_dashed(series[i].0));
    for i in order {
        let (name, p) = &series[i];
        let c = color(name, i);
        let reference = is_reference(name);
        let dashed = is_dashed(name);
        let width = match (reference, dashed, opts.wide_first) {
            (true, _, _) => 1,
            (false, true, _) => 2,
            (false, false, true) => line_width(i, series.len()),
            (false, false, false) => 2,
        };
        if dashed {
            // Each dashed series its own pattern, so that two that coincide
            // both show.
            let k = opts.dashed.iter().position(|d| d == name).unwrap_or(0);
            let (size, gap) = [(10, 6), (3, 5), (6, 3)][k % 3];
            chart
                .draw_series(DashedLineSeries::new(
                    p.iter().copied(),
                    size,
                    gap,
                    c.stroke_width(width),
                ))
                .map_err(err)?;
        } else {
            chart
                .draw_series(LineSeries::new(p.iter().copied(), c.stroke_width(width)))
                .map_err(err)?;
        }
        let marker = !reference && p.len() <= 40;
        if marker {
            chart
                .draw_series(p.iter().map(|&q| Circle::new(q, 4, c.filled())))
                .map_err(err)?;
        }
        marks[i] = Some(Mark::Line {
            width,
            marker,
            dashed,
        });
    }
    if let Some(l) = legend_area {
        let names: Vec<&str> = series.iter().map(|(n, _)| *n).collect();
        let marks: Vec<Mark> = marks.into_iter().flatten().collect();
        legend(&l, &names, &marks)?;
    }
    root.present().map_err(err)
}

/// Empirical CDFs on a log x axis, one per `(name, values)` (values need not
/// be sorted); at most 400 points per series are drawn.
pub fn cdf(
    path: &Path,
    title: &str,
    context: &str,
    x_label: &str,
    series: &[(String, Vec<f64>)],
    dashed: &[String],
) -> PlotResult {
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
    let x = XAxis {
        label: x_label,
        log: true,
        ticks: Vec::new(),
    };
    let opts = LineOpts {
        wide_first: true,
        dashed: dashed.to_vec(),
        ..LineOpts::default()
    };
    lines_with(
        path,
        title,
        context,
        &x,
        "fraction of requests",
        &curves,
        &opts,
    )
}

/// Bars over categories: `values[series][group]`, `None` for no bar; one
/// color per series, or per group when `per_group_color`. `label` writes
/// a value above (below, when negative) each bar, centred on it.
#[allow(clippy::too_many_arguments)]
fn bar_chart(
    path: &Path,
    title: &str,
    context: &str,
    x_label: &str,
    y_label: &str,
    groups: &[String],
    series: &[(String, Vec<Option<f64>>)],
    per_group_color: bool,
    label: Option<&dyn Fn(f64) -> String>,
    bounds_from: Option<usize>,
) -> PlotResult {
    let n = groups.len().max(1);
    let k = series.len().max(1);
    let values = series.iter().flat_map(|(_, v)| v.iter().flatten().copied());
    let (lo, hi) = values.fold((0.0f64, 0.0f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
    let hi = if hi <= lo { lo + 1.0 } else { hi };
    // Headroom for the value labels.
    let room = (hi - lo) * if label.is_some() { 0.10 } else { 0.04 };
    let yr = (if lo < 0.0 { lo - room } else { lo })..hi + room;
    let y_ticks = linear_ticks(yr.start, yr.end, 8);
    let x_ticks = (0..n).map(|i| i as f64 + 0.5).collect();
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    let (area, legend_area) = frame(&root, title, context, k > 1)?;
    let mut chart = chart(&area, 0.0..n as f64, x_ticks, yr.clone(), y_ticks)?;
    let x_fmt = |v: &f64| groups.get(v.floor() as usize).cloned().unwrap_or_default();
    mesh(&mut chart, x_label, y_label, &x_fmt, false)?;
    if lo < 0.0 {
        chart
            .draw_series([PathElement::new([(0.0, 0.0), (n as f64, 0.0)], BLACK)])
            .map_err(err)?;
    }
    let width = 0.8 / k as f64;
    let font = if k > 1 { 11 } else { 14 };
    for (si, (name, vals)) in series.iter().enumerate() {
        for (gi, v) in vals.iter().enumerate() {
            let Some(v) = *v else { continue };
            let c = if per_group_color {
                color(&groups[gi], gi)
            } else {
                color(name, si)
            };
            let l = gi as f64 + 0.1 + si as f64 * width;
            let (l, r) = (l + width * 0.06, l + width * 0.94);
            if bounds_from.is_some_and(|b| gi >= b) {
                // A bound, not a policy: light, outlined.
                chart
                    .draw_series([Rectangle::new([(l, 0.0), (r, v)], c.mix(0.3).filled())])
                    .map_err(err)?;
                chart
                    .draw_series([Rectangle::new([(l, 0.0), (r, v)], c.stroke_width(2))])
                    .map_err(err)?;
            } else {
                chart
                    .draw_series([Rectangle::new([(l, 0.0), (r, v)], c.filled())])
                    .map_err(err)?;
            }
            if let Some(f) = label {
                let (y, vpos) = if v < 0.0 {
                    (v - (hi - lo) * 0.01, VPos::Top)
                } else {
                    (v + (hi - lo) * 0.01, VPos::Bottom)
                };
                let style =
                    TextStyle::from((FONT, font).into_font()).pos(Pos::new(HPos::Center, vpos));
                chart
                    .draw_series([Text::new(f(v), ((l + r) / 2.0, y), style)])
                    .map_err(err)?;
            }
        }
    }
    if let Some(b) = bounds_from.filter(|&b| b > 0 && b < n) {
        // Policies to the left, bounds (not policies) to the right.
        let x = b as f64;
        chart
            .draw_series(DashedLineSeries::new(
                [(x, yr.start), (x, yr.end)],
                6,
                4,
                BLACK.mix(0.5).stroke_width(1),
            ))
            .map_err(err)?;
    }
    if let Some(la) = legend_area {
        let names: Vec<&str> = series.iter().map(|(n, _)| n.as_str()).collect();
        legend(
            &la,
            &names,
            &vec![Mark::Patch { opacity: 1.0 }; names.len()],
        )?;
    }
    root.present().map_err(err)
}

/// A bar per `(label, value)`, each in its own color, the value written
/// above it with one decimal.
///
/// Items from `bounds_from` on are bounds rather than policies (the
/// clairvoyant, the unbounded oracle): drawn light and outlined, to the
/// right of a dashed separator.
pub fn bars(
    path: &Path,
    title: &str,
    context: &str,
    y_label: &str,
    items: &[(String, f64)],
    bounds_from: Option<usize>,
) -> PlotResult {
    let groups: Vec<String> = items.iter().map(|(l, _)| l.clone()).collect();
    let values = items.iter().map(|(_, v)| Some(*v)).collect();
    bar_chart(
        path,
        title,
        context,
        "",
        y_label,
        &groups,
        &[(String::new(), values)],
        true,
        Some(&|v| format!("{v:.1}")),
        bounds_from,
    )
}

/// Grouped bars over categories (e.g. input-length bins): for each group
/// one bar per series, `None` where a series has no value there; a legend
/// when there are several series. `label` writes each bar's value.
#[allow(clippy::too_many_arguments)]
pub fn grouped_bars(
    path: &Path,
    title: &str,
    context: &str,
    x_label: &str,
    y_label: &str,
    groups: &[String],
    series: &[(String, Vec<Option<f64>>)],
    label: Option<&dyn Fn(f64) -> String>,
) -> PlotResult {
    bar_chart(
        path, title, context, x_label, y_label, groups, series, false, label, None,
    )
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
    context: &str,
    y_label: &str,
    groups: &[String],
    series: &[(String, Vec<Vec<f64>>)],
) -> PlotResult {
    let stats: Vec<Vec<Option<[f64; 5]>>> = series
        .iter()
        .map(|(_, per_group)| per_group.iter().map(|v| five_numbers(v)).collect())
        .collect();
    let (mut y0, mut y1) = (0.0f64, f64::MIN);
    for s in stats.iter().flatten().flatten() {
        y0 = y0.min(s[0]);
        y1 = y1.max(s[4]);
    }
    if y1 <= y0 {
        y1 = y0 + 1.0;
    }
    let yr = padded(y0, y1, 0.04);
    let yr = if y0 >= 0.0 { 0.0..yr.end } else { yr };
    let y_ticks = linear_ticks(yr.start, yr.end, 8);
    let n = groups.len().max(1);
    let x_ticks = (0..n).map(|i| i as f64 + 0.5).collect();
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    let (area, legend_area) = frame(&root, title, context, true)?;
    let mut chart = chart(&area, 0.0..n as f64, x_ticks, yr, y_ticks)?;
    let x_fmt = |v: &f64| groups.get(v.floor() as usize).cloned().unwrap_or_default();
    mesh(&mut chart, "", y_label, &x_fmt, false)?;
    let k = series.len().max(1) as f64;
    let width = 0.7 / k;
    for (si, ((name, _), per_group)) in series.iter().zip(&stats).enumerate() {
        let c = color(name, si);
        for (gi, s) in per_group.iter().enumerate() {
            let Some([p5, q1, med, q3, p95]) = *s else {
                continue;
            };
            let left = gi as f64 + 0.15 + si as f64 * width;
            let (l, r, mid) = (left + width * 0.1, left + width * 0.9, left + width * 0.5);
            chart
                .draw_series([
                    Rectangle::new([(l, q1), (r, q3)], c.mix(BOX_OPACITY).filled()),
                    Rectangle::new([(l, q1), (r, q3)], c.stroke_width(2)),
                ])
                .map_err(err)?;
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
    if let Some(la) = legend_area {
        let names: Vec<&str> = series.iter().map(|(n, _)| n.as_str()).collect();
        legend(
            &la,
            &names,
            &vec![
                Mark::Patch {
                    opacity: BOX_OPACITY
                };
                names.len()
            ],
        )?;
    }
    root.present().map_err(err)
}

/// Opacity of a box's fill (its outline is opaque); its legend swatch too.
const BOX_OPACITY: f64 = 0.35;

/// A signed value with one decimal for bar labels: `+1.2`, `-0.4`, and `0.0`
/// (not `+0.0` or `-0.0`) for what rounds to zero.
pub fn signed(v: f64) -> String {
    let r = (v * 10.0).round() / 10.0;
    if r == 0.0 {
        "0.0".to_owned()
    } else {
        format!("{r:+.1}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signed_labels_have_no_signed_zero() {
        assert_eq!(signed(0.04), "0.0");
        assert_eq!(signed(-0.04), "0.0");
        assert_eq!(signed(-0.0), "0.0");
        assert_eq!(signed(1.25), "+1.3");
        assert_eq!(signed(-0.06), "-0.1");
    }

    #[test]
    fn earlier_lines_are_wider() {
        assert_eq!(line_width(0, 1), 2);
        assert_eq!((line_width(0, 8), line_width(7, 8)), (6, 2));
        assert!((0..7).all(|i| line_width(i, 8) >= line_width(i + 1, 8)));
    }

    #[test]
    fn numbers_read_as_people_write_them() {
        assert_eq!(number(45_000.0), "45,000");
        assert_eq!(number(1_234_567.0), "1,234,567");
        assert_eq!(number(-2_000.0), "-2,000");
        assert_eq!(number(100.0), "100");
        assert_eq!(number(-0.0), "0");
        assert_eq!(number(0.25), "0.25");
        assert_eq!(number(0.1 + 0.2), "0.3");
        assert_eq!(number(10f64.powf(64f64.log10())), "64");
    }

    #[test]
    fn ticks() {
        assert_eq!(linear_ticks(0.0, 100.0, 8), [0., 20., 40., 60., 80., 100.]);
        let cdf: Vec<String> = linear_ticks(-0.04, 1.04, 8)
            .into_iter()
            .map(number)
            .collect();
        assert_eq!(cdf, ["0", "0.2", "0.4", "0.6", "0.8", "1"]);
        assert_eq!(
            log_ticks(15.0, 3_000.0),
            [20., 50., 100., 200., 500., 1_000., 2_000.]
        );
        assert_eq!(log_ticks(16.0, 128.0), [20., 50., 100.]);
        assert_eq!(log_ticks(2.0, 8.0), [2., 3., 4., 5., 6., 7., 8.]);
    }
}
