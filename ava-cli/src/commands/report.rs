//! `ava report`: one metric of several runs side by side, by step, as a table, JSON or a
//! CSV file to plot (e.g. the validation loss curves of one config under each optimizer).

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

use ava_train::train::metrics::{metrics_file, read_series};
use serde_json::json;

use crate::{CmdResult, Failure, cli::ReportArgs, output::Printer};

/// One run's column.
struct Run {
    name: String,
    file: PathBuf,
    points: BTreeMap<u64, f64>,
}

pub fn run(p: &Printer, args: &ReportArgs) -> CmdResult {
    // Read every run first and report every problem at once.
    let mut runs = Vec::new();
    let mut problems = Vec::new();
    for path in &args.runs {
        let file = metrics_file(path);
        match read_series(&file, &args.metric) {
            Ok(points) => runs.push(Run { name: column_name(path), file, points: points.into_iter().collect() }),
            Err(e) => problems.push(e.to_string()),
        }
    }
    if !problems.is_empty() {
        return Err(Failure::Usage(anyhow::anyhow!(
            "cannot report '{}':\n  - {}",
            args.metric,
            problems.join("\n  - ")
        )));
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
    p.result(
        || render(&args.metric, &runs, &steps),
        || {
            json!({
                "metric": args.metric,
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

/// The table for people: one row per step, then each run's last and smallest value.
fn render(metric: &str, runs: &[Run], steps: &BTreeSet<u64>) -> String {
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
    format!("{metric} by step\n{}", crate::output::table(&headers, &rows))
}

/// Four decimals for losses and rates, whole numbers for byte counts and throughputs.
fn number(v: f64) -> String {
    if v.abs() >= 1000.0 { format!("{v:.0}") } else { format!("{v:.4}") }
}
