//! `ava report`: one run's summary and charts (loss, memory by component, micro-batch
//! changes), or one metric of several runs side by side, by step, as a table, JSON, a CSV
//! file or a chart (e.g. the validation loss curves of one config under each optimizer).

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

use ava_core::format_size;
use ava_train::train::metrics::{MAX_POINTS, RunMetrics, metrics_file, read_run, read_series};
use serde_json::json;

use super::report_plot::{self, Series};

use crate::{CmdResult, Failure, cli::ReportArgs, output::Printer};

/// One run's column.
struct Run {
    name: String,
    file: PathBuf,
    points: BTreeMap<u64, f64>,
}

pub fn run(p: &Printer, args: &ReportArgs) -> CmdResult {
    if let ([run], None, None) = (args.runs.as_slice(), &args.metric, &args.csv) {
        return summary(p, run, args.plots.clone().unwrap_or_else(|| run_dir(run).join("report")));
    }
    let metric = args.metric.as_deref().unwrap_or("val_loss");
    // Read every run first and report every problem at once.
    let mut runs = Vec::new();
    let mut problems = Vec::new();
    for path in &args.runs {
        let file = metrics_file(path);
        match read_series(&file, metric) {
            Ok(series) => {
                for w in &series.warnings {
                    p.warn(w);
                }
                if series.stride > 1 {
                    p.note(&format!(
                        "{}: more than {MAX_POINTS} steps; every {}th step is kept (and the first and last)",
                        file.display(),
                        series.stride
                    ));
                }
                runs.push(Run { name: column_name(path), file, points: series.points.into_iter().collect() })
            }
            Err(e) => problems.push(e.to_string()),
        }
    }
    if !problems.is_empty() {
        return Err(Failure::Usage(anyhow::anyhow!("cannot report '{}':\n  - {}", metric, problems.join("\n  - "))));
    }
    // Two runs in directories of the same name are told apart by the paths given.
    let names: Vec<String> = runs.iter().map(|r| r.name.clone()).collect();
    for (run, path) in runs.iter_mut().zip(&args.runs) {
        if names.iter().filter(|n| **n == run.name).count() > 1 {
            run.name = path.display().to_string();
        }
    }
    let steps: BTreeSet<u64> = runs.iter().flat_map(|r| r.points.keys().copied()).collect();

    if let Some(csv) = &args.csv {
        std::fs::write(csv, to_csv(&runs, &steps))
            .map_err(|e| Failure::Runtime(anyhow::anyhow!("cannot write {}: {e}", csv.display())))?;
        p.note(&format!("wrote {} ({} steps × {} runs)", csv.display(), steps.len(), runs.len()));
    }
    let mut charts = Vec::new();
    if let Some(dir) = &args.plots {
        let series = runs
            .iter()
            .map(|r| Series { label: r.name.clone(), points: r.points.iter().map(|(&s, &v)| (s as f64, v)).collect() });
        let stem: String = metric.chars().map(|c| if c.is_alphanumeric() || c == '_' { c } else { '-' }).collect();
        charts =
            report_plot::metric_chart(metric, is_bytes(metric), series.collect(), dir, &stem).map_err(chart_failure)?;
        p.note(&format!("wrote {}", file_list(&charts)));
    }
    p.result(
        || render(metric, &runs, &steps),
        || {
            json!({
                "metric": metric,
                "charts": charts.iter().map(|c| c.display().to_string()).collect::<Vec<_>>(),
                "runs": runs.iter().map(|r| json!({
                    "name": r.name,
                    "file": r.file.display().to_string(),
                    "points": r.points.iter().map(|(s, v)| json!([s, v])).collect::<Vec<_>>(),
                    "last": r.points.iter().next_back().map(|(s, v)| json!({"step": s, "value": v})),
                    "min": min_point(r).map(|(s, v)| json!({"step": s, "value": v})),
                })).collect::<Vec<_>>(),
            })
        },
    );
    Ok(())
}

fn chart_failure(message: String) -> Failure {
    Failure::Runtime(anyhow::anyhow!("cannot write the charts: {message}"))
}

fn file_list(files: &[PathBuf]) -> String {
    files.iter().map(|f| f.display().to_string()).collect::<Vec<_>>().join(", ")
}

/// The directory of a run given as a directory or as its metrics file.
fn run_dir(run: &Path) -> PathBuf {
    if run.is_dir() { run.to_path_buf() } else { run.parent().map_or_else(|| PathBuf::from("."), Path::to_path_buf) }
}

/// One run: its summary, and its charts written to `plots`.
fn summary(p: &Printer, run: &Path, plots: PathBuf) -> CmdResult {
    let file = metrics_file(run);
    let metrics = read_run(&file).map_err(|e| Failure::Usage(anyhow::anyhow!("cannot report: {e}")))?;
    if metrics.steps.is_empty() {
        return Err(Failure::Usage(anyhow::anyhow!(
            "cannot report: {} has no step records yet; train first (ava train), or wait for the first logged step",
            file.display()
        )));
    }
    for w in &metrics.warnings {
        p.warn(w);
    }
    if metrics.stride > 1 {
        p.note(&format!(
            "{}: {} step records; the charts keep every {}th step (and the first and last), the summary reads all",
            file.display(),
            metrics.step_records,
            metrics.stride
        ));
    }
    let name = column_name(run);
    let charts = report_plot::run_charts(&metrics, &name, &plots).map_err(chart_failure)?;
    let facts = Facts::of(&metrics);
    let timelines = memory_timelines(p, &run_dir(run));
    p.result(
        || {
            let mut lines = facts.lines(&name, &file);
            lines.push(format!("charts: {}", file_list(&charts)));
            lines.extend(timelines.iter().map(Timeline::line));
            lines.join("\n")
        },
        || {
            json!({
                "run": name,
                "file": file.display().to_string(),
                "steps": facts.steps,
                "first_loss": facts.first_loss,
                "last_loss": facts.last_loss,
                "best_val_loss": facts.best_val.map(|(s, v)| json!({"step": s, "value": v})),
                "entropy_floor": facts.floor,
                "peak_bytes": facts.peak.1,
                "peak_step": facts.peak.0,
                "budget": facts.budget,
                "micro_batch_changes": facts.changes.iter().map(|&(s, f, t)| json!({"step": s, "from": f, "to": t})).collect::<Vec<_>>(),
                "memory_events": facts.events.iter().map(|(s, m)| json!({"step": s, "message": m})).collect::<Vec<_>>(),
                "charts": charts.iter().map(|c| c.display().to_string()).collect::<Vec<_>>(),
                "memory_timelines": timelines.iter().map(Timeline::json).collect::<Vec<_>>(),
            })
        },
    );
    Ok(())
}

/// A step recorded by `ava train --memory-trace`: its summary (`step-N.json`) and files.
struct Timeline {
    summary: serde_json::Value,
    trace: PathBuf,
    chart: PathBuf,
}

impl Timeline {
    /// `memory timeline of step 2: peak 278.3 MiB at 116.1 ms, made in `backward: swiglu`;
    /// most at the peak: ...; chart ..., trace ...`.
    fn line(&self) -> String {
        let s = &self.summary;
        let bytes = |v: &serde_json::Value| ava_train::memory::size(v.as_u64().unwrap_or(0));
        let owners: Vec<String> = s["live_by_owner"]
            .as_array()
            .map(|a| {
                a.iter()
                    .take(3)
                    .map(|o| format!("{} ({})", bytes(&o["bytes"]), o["owner"].as_str().unwrap_or("?")))
                    .collect()
            })
            .unwrap_or_default();
        format!(
            "memory timeline of step {}: peak {} at {:.1} ms, made in `{}`; held before the step {}; most at the \
             peak: {}{}; {}",
            s["step"],
            bytes(&s["peak_bytes"]),
            s["peak_ms"].as_f64().unwrap_or(f64::NAN),
            s["made_in"].as_str().unwrap_or("?"),
            bytes(&s["held_before_bytes"]),
            owners.join(", "),
            match s["dropped"].as_u64().unwrap_or(0) {
                0 => String::new(),
                n => format!(" ({n} events past the recording's capacity not kept: the peak may be higher)"),
            },
            file_list(&self.files())
        )
    }

    /// The chart and the trace, those that exist.
    fn files(&self) -> Vec<PathBuf> {
        [&self.chart, &self.trace].into_iter().filter(|f| f.is_file()).cloned().collect()
    }

    fn json(&self) -> serde_json::Value {
        let mut v = self.summary.clone();
        let path = |f: &PathBuf| f.is_file().then(|| f.display().to_string());
        v["chart"] = path(&self.chart).into();
        v["trace"] = path(&self.trace).into();
        v
    }
}

/// The run's recorded steps (`<run>/memory/step-N.json`), by step; a file that cannot be
/// read is warned of and left out.
fn memory_timelines(p: &Printer, dir: &Path) -> Vec<Timeline> {
    let memory = dir.join(ava_train::train::MEMORY_DIR);
    let Ok(entries) = std::fs::read_dir(&memory) else { return Vec::new() };
    let mut found: Vec<(u64, PathBuf)> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter_map(|path| {
            let name = path.file_name()?.to_str()?;
            let step = name.strip_prefix("step-")?.strip_suffix(".json")?.parse().ok()?;
            Some((step, path))
        })
        .collect();
    found.sort();
    found
        .into_iter()
        .filter_map(|(step, path)| {
            let read = std::fs::read(&path).map_err(|e| e.to_string());
            match read.and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).map_err(|e| e.to_string())) {
                Ok(summary) => {
                    let (trace, _) = ava_train::train::memory_trace_files(&memory, step);
                    Some(Timeline { summary, trace, chart: memory.join(format!("step-{step}.memory.svg")) })
                }
                Err(e) => {
                    p.warn(&format!("{}: not a memory timeline's summary ({e}); left out", path.display()));
                    None
                }
            }
        })
        .collect()
}

/// What the summary says of a run.
struct Facts {
    steps: u64,
    first_loss: (u64, f64),
    last_loss: (u64, f64),
    best_val: Option<(u64, f64)>,
    floor: Option<f64>,
    /// (step, bytes) of the highest peak.
    peak: (u64, u64),
    budget: u64,
    /// The components at the highest peak: params, grads, optimizer, data, activations.
    at_peak: [u64; 5],
    micro_batch: u64,
    changes: Vec<(u64, u64, u64)>,
    /// The first memory events (the metrics reader keeps a bounded number).
    events: Vec<(u64, String)>,
    /// Memory events in all.
    event_count: u64,
}

impl Facts {
    /// `run` has at least one step.
    fn of(run: &RunMetrics) -> Self {
        let (first, last) = (&run.steps[0], &run.steps[run.steps.len() - 1]);
        let top = run.peak.as_ref().unwrap_or(first);
        let m = &top.memory;
        Self {
            steps: last.step,
            first_loss: (first.step, first.loss),
            last_loss: (last.step, last.loss),
            best_val: run.best_eval.map(|e| (e.step, e.val_loss)),
            floor: run.evals.iter().find_map(|e| e.entropy_floor),
            peak: (top.step, m.peak),
            budget: last.memory.budget,
            at_peak: [m.params, m.grads, m.optimizer, m.data, m.activations],
            micro_batch: report_plot::first_micro_batch(run).unwrap_or(first.micro_batch),
            changes: report_plot::micro_batch_changes(run),
            events: run.events.clone(),
            event_count: run.event_count,
        }
    }

    fn lines(&self, name: &str, file: &Path) -> Vec<String> {
        let mut lines = vec![format!("run {name} ({}): {} steps", file.display(), self.steps)];
        lines.push(format!(
            "loss {:.4} at step {} -> {:.4} at step {}",
            self.first_loss.1, self.first_loss.0, self.last_loss.1, self.last_loss.0
        ));
        match (self.best_val, self.floor) {
            (Some((s, v)), Some(f)) => lines.push(format!(
                "validation loss: best {v:.4} at step {s}; entropy floor {f:.4} nats/token, {:.1}% above it",
                100.0 * (v / f - 1.0)
            )),
            (Some((s, v)), None) => lines.push(format!("validation loss: best {v:.4} at step {s}")),
            _ => lines.push("validation loss: no evaluation logged".into()),
        }
        let [params, grads, optimizer, data, activations] = self.at_peak.map(format_size);
        let budget = if self.budget > 0 {
            format!(
                " ({:.0}% of memory.budget {})",
                100.0 * self.peak.1 as f64 / self.budget as f64,
                format_size(self.budget)
            )
        } else {
            String::new()
        };
        lines.push(format!(
            "peak memory {} at step {}{budget}: params {params}, grads {grads}, optimizer {optimizer}, data {data}, \
             activations {activations}",
            format_size(self.peak.1),
            self.peak.0
        ));
        if self.changes.is_empty() {
            lines.push(format!("micro-batch {} throughout", self.micro_batch));
        } else {
            let changes: Vec<String> = self.changes.iter().map(|(s, f, t)| format!("step {s}: {f} -> {t}")).collect();
            lines.push(format!("micro-batch changes ({}): {}", changes.len(), changes.join(", ")));
        }
        for (step, message) in self.events.iter().take(5) {
            lines.push(format!("  [step {step}] {message}"));
        }
        if self.event_count > 5 {
            lines.push(format!("  ... {} more memory events in the metrics file", self.event_count - 5));
        }
        lines
    }
}

/// A run's column name: its directory's name (for a metrics file, the directory holding it).
fn column_name(path: &Path) -> String {
    let dir = if path.is_dir() { Some(path) } else { path.parent() };
    dir.and_then(|d| d.file_name())
        .or(path.file_name())
        .map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into_owned())
}

/// The smallest value and its step (the first such step on ties).
fn min_point(run: &Run) -> Option<(u64, f64)> {
    run.points.iter().fold(None, |best, (&s, &v)| match best {
        Some((_, b)) if b <= v => best,
        _ => Some((s, v)),
    })
}

/// `step,name,...` then one row per step; full precision, empty cells where a run has no
/// value. Names holding commas or quotes are quoted.
fn to_csv(runs: &[Run], steps: &BTreeSet<u64>) -> String {
    let quote = |s: &str| {
        if s.contains([',', '"', '\n']) { format!("\"{}\"", s.replace('"', "\"\"")) } else { s.to_string() }
    };
    let mut out = String::from("step");
    for r in runs {
        out.push(',');
        out.push_str(&quote(&r.name));
    }
    out.push('\n');
    for s in steps {
        out.push_str(&s.to_string());
        for r in runs {
            out.push(',');
            if let Some(v) = r.points.get(s) {
                out.push_str(&v.to_string());
            }
        }
        out.push('\n');
    }
    out
}

/// Whether a metric counts bytes (the memory breakdown's fields, the tier's bytes).
pub(crate) fn is_bytes(metric: &str) -> bool {
    metric.starts_with("memory.") || metric.ends_with("_bytes")
}

/// The table for people: one row per step, then each run's last and smallest value. Byte
/// counts are written in the unit that suits each (`70.00 MiB`).
fn render(metric: &str, runs: &[Run], steps: &BTreeSet<u64>) -> String {
    let bytes = is_bytes(metric);
    let number = |v: f64| if bytes && v >= 0.0 { ava_train::memory::size(v as u64) } else { number(v) };
    let mut headers = vec!["step"];
    headers.extend(runs.iter().map(|r| r.name.as_str()));
    let mut rows: Vec<Vec<String>> = steps
        .iter()
        .map(|s| {
            let mut row = vec![s.to_string()];
            row.extend(runs.iter().map(|r| r.points.get(s).map_or_else(|| "-".into(), |&v| number(v))));
            row
        })
        .collect();
    let mut last = vec!["last".to_string()];
    last.extend(runs.iter().map(|r| r.points.values().next_back().map_or_else(String::new, |&v| number(v))));
    let mut min = vec!["min".to_string()];
    min.extend(runs.iter().map(|r| min_point(r).map_or_else(String::new, |(s, v)| format!("{} @{s}", number(v)))));
    rows.extend([last, min]);
    let unit = if bytes { " (bytes; the CSV and --format json keep them exact)" } else { "" };
    format!("{metric} by step{unit}\n{}", crate::output::table(&headers, &rows))
}

/// Four decimals for losses and rates, whole numbers for byte counts and throughputs.
fn number(v: f64) -> String {
    if v.abs() >= 1000.0 { format!("{v:.0}") } else { format!("{v:.4}") }
}
