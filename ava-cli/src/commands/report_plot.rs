//! The charts of `ava report`, each written as SVG and PNG with plotters: a run's loss
//! (train and validation, with the synthetic data's entropy floor) and its memory by
//! component, both with the micro-batch changes marked; and one metric of several runs.
//! Also one step's memory timeline by owner (`ava bench train --memory-trace`).
//! Text is laid out and drawn with the embedded DejaVu Sans, so no system font is needed.

use std::path::{Path, PathBuf};

use ava_train::memory::Breakdown;
use ava_train::train::metrics::{RunMetrics, StepPoint};
use plotters::coord::Shift;
use plotters::prelude::*;

/// Pixels of every chart.
const SIZE: (u32, u32) = (960, 540);

/// Colours of the runs and series, in order.
const PALETTE: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(127, 127, 127),
];
/// Micro-batch change markers.
const MARKER: RGBColor = RGBColor(255, 127, 14);

type Result<T> = std::result::Result<T, String>;

/// One line of a chart.
pub struct Series {
    /// Legend label.
    pub label: String,
    /// (x, y) points, by x.
    pub points: Vec<(f64, f64)>,
}

/// Where the micro-batch changed: (step, from, to), as read from every step record.
pub fn micro_batch_changes(run: &RunMetrics) -> Vec<(u64, u64, u64)> {
    run.changes.clone()
}

/// The micro-batch the run started at: the first logged step's, or the first attempt's
/// when that step backed off.
pub fn first_micro_batch(run: &RunMetrics) -> Option<u64> {
    let first = run.steps.first()?;
    Some(first.backoffs.first().map_or(first.micro_batch, |b| b.micro_batch))
}

/// Writes `loss.{svg,png}` and `memory.{svg,png}` of one run into `dir`; returns the files.
pub fn run_charts(run: &RunMetrics, name: &str, dir: &Path) -> Result<Vec<PathBuf>> {
    let steps = |f: &dyn Fn(&StepPoint) -> f64| -> Vec<(f64, f64)> {
        run.steps.iter().map(|s| (s.step as f64, f(s))).collect()
    };
    let changes: Vec<(f64, String)> =
        micro_batch_changes(run).into_iter().map(|(step, from, to)| (step as f64, format!("{from}→{to}"))).collect();
    let mut loss = vec![Series { label: "train loss".into(), points: steps(&|s| s.loss) }];
    if !run.evals.is_empty() {
        loss.push(Series {
            label: "validation loss".into(),
            points: run.evals.iter().map(|e| (e.step as f64, e.val_loss)).collect(),
        });
    }
    let floor = run.evals.iter().find_map(|e| e.entropy_floor);
    let loss_chart = Chart {
        title: format!("{name}: loss"),
        y_label: "nats/token".into(),
        series: loss,
        stacked: false,
        horizontal: floor.map(|f| ("entropy floor (the best possible)".to_string(), f)),
        marks: changes.clone(),
        ..Chart::over_steps()
    };
    // Memory: components stacked from the bottom, in MiB or GiB as the peaks are.
    let most = run.steps.iter().map(|s| s.memory.peak).max().unwrap_or(0);
    let (unit, div) = byte_unit(most as f64);
    let mib = |b: u64| b as f64 / div;
    type Component = (&'static str, fn(&Breakdown) -> u64);
    let components: [Component; 5] = [
        ("parameters", |m| m.params),
        ("gradients", |m| m.grads),
        ("optimizer state", |m| m.optimizer),
        ("data", |m| m.data),
        ("activations and the rest", |m| m.activations),
    ];
    let memory = components
        .iter()
        .map(|(label, f)| Series { label: label.to_string(), points: steps(&|s| mib(f(&s.memory))) })
        .collect();
    let budget = run.steps.last().map(|s| s.memory.budget).filter(|&b| b > 0);
    let memory_chart = Chart {
        title: format!("{name}: peak memory by component"),
        y_label: unit.into(),
        series: memory,
        stacked: true,
        horizontal: budget.map(|b| ("memory.budget".to_string(), mib(b))),
        marks: changes,
        ..Chart::over_steps()
    };
    let mut files = loss_chart.write(dir, "loss")?;
    files.extend(memory_chart.write(dir, "memory")?);
    Ok(files)
}

/// The unit a chart of byte counts up to `most` reads best in, and its size.
fn byte_unit(most: f64) -> (&'static str, f64) {
    match most {
        m if m >= (4u64 << 30) as f64 => ("GiB", (1u64 << 30) as f64),
        m if m >= (4u64 << 20) as f64 => ("MiB", (1u64 << 20) as f64),
        _ => ("KiB", 1024.0),
    }
}

/// Writes `{file_stem}.{svg,png}`: `metric` of each run by step (`bytes`: a byte count,
/// drawn in the unit that suits it).
pub fn metric_chart(
    metric: &str,
    bytes: bool,
    mut runs: Vec<Series>,
    dir: &Path,
    file_stem: &str,
) -> Result<Vec<PathBuf>> {
    let mut y_label = metric.to_string();
    if bytes {
        let most = runs.iter().flat_map(|r| r.points.iter().map(|p| p.1)).fold(0.0, f64::max);
        let (unit, div) = byte_unit(most);
        for r in &mut runs {
            r.points.iter_mut().for_each(|p| p.1 /= div);
        }
        y_label = format!("{metric} ({unit})");
    }
    Chart { title: format!("{metric} by step"), y_label, series: runs, ..Chart::over_steps() }.write(dir, file_stem)
}

/// Writes `{file_stem}.{svg,png}`: one step's memory over time, `series` of (milliseconds
/// into the step, bytes) stacked from the bottom in order, with a vertical mark at `peak`
/// (milliseconds, its label) and a dashed line at `estimate` (its label, bytes), both drawn
/// in the unit the bytes read best in.
pub fn timeline_chart(
    title: String,
    mut series: Vec<Series>,
    peak: (f64, String),
    estimate: Option<(String, u64)>,
    dir: &Path,
    file_stem: &str,
) -> Result<Vec<PathBuf>> {
    let top: f64 = (0..series.first().map_or(0, |s| s.points.len()))
        .map(|i| series.iter().map(|s| s.points[i].1).sum::<f64>())
        .fold(0.0, f64::max);
    let (unit, div) = byte_unit(top.max(estimate.as_ref().map_or(0.0, |e| e.1 as f64)));
    for s in &mut series {
        s.points.iter_mut().for_each(|p| p.1 /= div);
    }
    // When what was held before the step is most of the chart (a 7B model's weights under a
    // step's activations), the axis starts just under it, so the step's own memory shows.
    let lowest = series.first().map_or(0.0, |s| s.points.iter().map(|p| p.1).fold(f64::INFINITY, f64::min));
    let y_from = (lowest.is_finite() && lowest > 0.5 * top / div).then(|| (lowest * 0.9).floor());
    let y_label = match y_from {
        Some(y) => format!("{unit} (the axis starts at {y})"),
        None => unit.into(),
    };
    Chart {
        title,
        y_label,
        y_from,
        series,
        stacked: true,
        horizontal: estimate.map(|(label, bytes)| (label, bytes as f64 / div)),
        marks: vec![peak],
        mark_legend: "the peak",
        x_desc: "ms into the step",
        whole_x: false,
    }
    .write(dir, file_stem)
}

/// A line chart over steps.
struct Chart {
    title: String,
    y_label: String,
    series: Vec<Series>,
    /// Each series drawn on top of the ones before (areas), not from zero.
    stacked: bool,
    /// A labelled horizontal line (the entropy floor, the budget).
    horizontal: Option<(String, f64)>,
    /// Vertical markers at x, each with its label (micro-batch changes `from→to`).
    marks: Vec<(f64, String)>,
    /// The markers' legend entry.
    mark_legend: &'static str,
    /// The x axis's name.
    x_desc: &'static str,
    /// Whether x is whole numbers (steps): labels only at whole values.
    whole_x: bool,
    /// Where a stacked chart's y axis starts (None: at zero).
    y_from: Option<f64>,
}

impl Chart {
    /// A chart over steps with nothing in it yet (fill in the rest).
    fn over_steps() -> Chart {
        Chart {
            title: String::new(),
            y_label: String::new(),
            series: Vec::new(),
            stacked: false,
            horizontal: None,
            marks: Vec::new(),
            mark_legend: "micro-batch change",
            x_desc: "step",
            whole_x: true,
            y_from: None,
        }
    }

    fn write(&self, dir: &Path, stem: &str) -> Result<Vec<PathBuf>> {
        std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        let (svg, png) = (dir.join(format!("{stem}.svg")), dir.join(format!("{stem}.png")));
        register_font();
        self.draw(SVGBackend::new(&svg, SIZE).into_drawing_area()).map_err(|e| format!("{}: {e}", svg.display()))?;
        self.draw(BitMapBackend::new(&png, SIZE).into_drawing_area()).map_err(|e| format!("{}: {e}", png.display()))?;
        Ok(vec![svg, png])
    }

    /// The series as drawn: cumulative sums when stacked.
    fn lines(&self) -> Vec<Vec<(f64, f64)>> {
        let mut lines: Vec<Vec<(f64, f64)>> = Vec::new();
        for s in &self.series {
            let line = match (self.stacked, lines.last()) {
                (true, Some(below)) => s.points.iter().zip(below).map(|(&(x, y), &(_, b))| (x, y + b)).collect(),
                _ => s.points.clone(),
            };
            lines.push(line);
        }
        lines
    }

    fn draw<DB: DrawingBackend>(&self, root: DrawingArea<DB, Shift>) -> Result<()>
    where
        DB::ErrorType: 'static,
    {
        let e = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
        root.fill(&WHITE).map_err(e)?;
        let lines = self.lines();
        let xs = lines.iter().flatten().map(|p| p.0);
        let (x0, x1) = xs.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| (a.min(x), b.max(x)));
        let span = |ys: &mut dyn Iterator<Item = f64>| {
            ys.filter(|y| y.is_finite()).fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), y| (a.min(y), b.max(y)))
        };
        let (d0, d1) = span(&mut lines.iter().flatten().map(|p| p.1));
        // The chart scales to the data: a horizontal line far above it (a budget of GiB over
        // a run of MiB) is named in the legend instead of flattening the data to the floor.
        let horizontal = self.horizontal.as_ref().map(|(label, y)| {
            let shown = !d1.is_finite() || *y <= d1 + 0.5 * (d1 - d0.min(0.0)).max(1e-9);
            let label =
                if shown { label.clone() } else { format!("{label} = {y:.1} {} (above the chart)", self.y_label) };
            (label, *y, shown)
        });
        let (y0, y1) =
            span(&mut lines.iter().flatten().map(|p| p.1).chain(horizontal.iter().filter(|h| h.2).map(|h| h.1)));
        if !x0.is_finite() || !y0.is_finite() {
            return Err("nothing to plot: the run has no records".into());
        }
        let x1 = if x1 > x0 { x1 } else { x0 + 1.0 };
        let y0 = if self.stacked { self.y_from.unwrap_or(0.0) } else { y0 - 0.05 * (y1 - y0).max(1e-9) };
        let y1 = y1 + 0.08 * (y1 - y0).max(1e-9);
        let mut chart = ChartBuilder::on(&root)
            .caption(&self.title, ("sans-serif", 22))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(x0..x1, y0..y1)
            .map_err(e)?;
        // Whole steps: a short run gets one label per step, never two that read the same.
        let x_labels = if self.whole_x { ((x1 - x0).round() as usize + 1).clamp(2, 10) } else { 10 };
        let (whole, decimals) = (self.whole_x, if x1 - x0 >= 20.0 { 0 } else { 1 });
        chart
            .configure_mesh()
            .x_desc(self.x_desc)
            .y_desc(self.y_label.as_str())
            .x_labels(x_labels)
            .x_label_formatter(&|x| match whole {
                true if (x - x.round()).abs() < 1e-6 => format!("{x:.0}"),
                true => String::new(),
                false => format!("{x:.decimals$}"),
            })
            .light_line_style(WHITE.mix(0.0))
            .draw()
            .map_err(e)?;
        // Stacked areas are drawn from the top one down, so each lower one lies over the
        // one above it from zero; lines in order, so the legend reads in order.
        let mut order: Vec<usize> = (0..lines.len()).collect();
        if self.stacked {
            order.reverse();
        }
        for i in order {
            let (s, line) = (&self.series[i], &lines[i]);
            let colour = PALETTE[i % PALETTE.len()];
            if self.stacked {
                chart
                    .draw_series(AreaSeries::new(line.iter().copied(), 0.0, tint(colour)).border_style(colour))
                    .map_err(e)?
                    .label(s.label.as_str())
                    .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 16, y + 5)], colour.filled()));
            } else {
                chart
                    .draw_series(LineSeries::new(line.iter().copied(), colour.stroke_width(2)))
                    .map_err(e)?
                    .label(s.label.as_str())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], colour.stroke_width(2)));
            }
        }
        if let Some((label, y, shown)) = &horizontal {
            let grey = RGBColor(90, 90, 90);
            // Off the chart: no line, only the legend's entry naming it.
            let points = if *shown { vec![(x0, *y), (x1, *y)] } else { Vec::new() };
            chart
                .draw_series(DashedLineSeries::new(points, 8, 5, grey.stroke_width(1)))
                .map_err(e)?
                .label(label.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], grey));
        }
        for (i, (x, text)) in self.marks.iter().enumerate() {
            let x = *x;
            let drawn = chart.draw_series(LineSeries::new([(x, y0), (x, y1)], MARKER.stroke_width(1))).map_err(e)?;
            if i == 0 {
                drawn
                    .label(self.mark_legend)
                    .legend(move |(x, y)| PathElement::new(vec![(x + 8, y - 6), (x + 8, y + 6)], MARKER));
            }
            // Alternate heights, so the labels of close marks do not overlap.
            let y = y1 - if i % 2 == 0 { 0.0 } else { 0.05 * (y1 - y0) };
            chart
                .draw_series([Text::new(text.clone(), (x, y), ("sans-serif", 13).into_font().color(&MARKER))])
                .map_err(e)?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperRight)
            .draw()
            .map_err(e)?;
        root.present().map_err(e)?;
        Ok(())
    }
}

/// `c` halfway to white: opaque, so stacked areas drawn over each other keep their colours.
fn tint(c: RGBColor) -> RGBColor {
    let half = |v: u8| ((u16::from(v) + 255) / 2) as u8;
    RGBColor(half(c.0), half(c.1), half(c.2))
}

/// Text is laid out (both backends) and drawn (PNG) with the font registered here.
fn register_font() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // The embedded font is a valid TrueType file; if it were refused, text would be
        // missing from the PNGs and the error would say so when drawing.
        let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular());
    });
}
