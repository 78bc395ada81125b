//! Reading a run's `metrics.jsonl` back: one metric's values by step, so runs can be put
//! side by side, or a whole run's steps and evaluations ([`read_run`]) for its report
//! (`ava report`). Each line is `{"type": "step"|"eval"|"sample", "data": {...}}`, the data being a
//! [`StepRecord`](super::StepRecord) or an [`EvalRecord`](super::EvalRecord).

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

use serde_json::Value;

/// The metrics file's name inside a run directory (`train.out_dir`).
pub const METRICS_FILE: &str = "metrics.jsonl";

/// Why a run's metrics could not be read.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// The file is missing or unreadable.
    #[error("{}: {message}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What went wrong, with a hint.
        message: String,
    },
    /// A line is not a metrics record.
    #[error("{}:{line}: {message}; the file should hold one JSON record per line as `ava train` writes them", path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// 1-based line.
        line: usize,
        /// What is wrong with it.
        message: String,
    },
    /// No record carries the metric.
    #[error(
        "{}: no record has a numeric '{metric}'; its records have: {}",
        path.display(),
        if available.is_empty() { "nothing (the file is empty)".to_string() } else { available.join(", ") }
    )]
    NoSuchMetric {
        /// The file.
        path: PathBuf,
        /// The metric asked for.
        metric: String,
        /// The numeric fields the records do have (dotted for nested ones).
        available: Vec<String>,
    },
}

/// The metrics file of `run`: `run/metrics.jsonl` for a directory, `run` itself otherwise.
pub fn metrics_file(run: &Path) -> PathBuf {
    if run.is_dir() { run.join(METRICS_FILE) } else { run.to_path_buf() }
}

/// The values of `metric` (a field of the step or eval records; `memory.peak` reaches into
/// nested ones) by step, sorted by step. A step logged twice keeps its last value.
pub fn read_series(file: &Path, metric: &str) -> Result<Vec<(u64, f64)>, MetricsError> {
    let text = read(file)?;
    let mut by_step = BTreeMap::new();
    let mut available = BTreeSet::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let parse = |message: String| MetricsError::Parse { path: file.to_path_buf(), line: i + 1, message };
        let record: Value = serde_json::from_str(line).map_err(|e| parse(format!("not JSON ({e})")))?;
        let data = &record["data"];
        let Some(step) = data["step"].as_u64() else {
            return Err(parse("no data.step".into()));
        };
        numeric_fields(data, String::new(), &mut available);
        if let Some(v) = metric.split('.').try_fold(data, |v, key| v.get(key)).and_then(Value::as_f64) {
            by_step.insert(step, v);
        }
    }
    if by_step.is_empty() {
        available.remove("step");
        return Err(MetricsError::NoSuchMetric {
            path: file.to_path_buf(),
            metric: metric.to_string(),
            available: available.into_iter().collect(),
        });
    }
    Ok(by_step.into_iter().collect())
}

/// A step as the report needs it.
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
pub struct StepPoint {
    /// 1-based step.
    pub step: u64,
    /// Training loss.
    pub loss: f64,
    /// The micro-batch it ran at.
    pub micro_batch: u64,
    /// Measured memory by component.
    pub memory: crate::memory::Breakdown,
    /// What the memory policy and the out-of-memory back-off did at this step.
    #[serde(default)]
    pub memory_events: Vec<String>,
    /// Attempts of this step abandoned for crossing `memory.hard_limit`, each retried at half
    /// the micro-batch (so `micro_batch` is the last retry's).
    #[serde(default)]
    pub backoffs: Vec<BackoffPoint>,
}

/// A step's abandoned attempt as the report needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
pub struct BackoffPoint {
    /// The micro-batch of the abandoned attempt.
    pub micro_batch: u64,
    /// The micro-batch of the retry.
    pub retry_micro_batch: u64,
}

/// An evaluation as the report needs it.
#[derive(Debug, Clone, Copy, PartialEq, serde::Deserialize)]
pub struct EvalPoint {
    /// After this step.
    pub step: u64,
    /// Validation loss.
    pub val_loss: f64,
    /// The data's entropy floor, when known.
    #[serde(default)]
    pub entropy_floor: Option<f64>,
}

/// A run's steps and evaluations, in file order (a step logged twice, by a resumed run,
/// keeps its last record).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RunMetrics {
    /// The logged steps, by step.
    pub steps: Vec<StepPoint>,
    /// The evaluations, by step.
    pub evals: Vec<EvalPoint>,
}

/// Reads every step and eval record of a metrics file.
pub fn read_run(file: &Path) -> Result<RunMetrics, MetricsError> {
    let text = read(file)?;
    let (mut steps, mut evals) = (BTreeMap::new(), BTreeMap::new());
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let parse = |message: String| MetricsError::Parse { path: file.to_path_buf(), line: i + 1, message };
        let record: Value = serde_json::from_str(line).map_err(|e| parse(format!("not JSON ({e})")))?;
        let data = record["data"].clone();
        match record["type"].as_str() {
            Some("step") => {
                let p: StepPoint =
                    serde_json::from_value(data).map_err(|e| parse(format!("not a step record ({e})")))?;
                steps.insert(p.step, p);
            }
            Some("eval") => {
                let p: EvalPoint =
                    serde_json::from_value(data).map_err(|e| parse(format!("not an eval record ({e})")))?;
                evals.insert(p.step, p);
            }
            // A text sample (`train.sample_every`): nothing to chart.
            Some("sample") => {}
            _ => return Err(parse("its type is none of \"step\", \"eval\" and \"sample\"".into())),
        }
    }
    Ok(RunMetrics { steps: steps.into_values().collect(), evals: evals.into_values().collect() })
}

fn read(file: &Path) -> Result<String, MetricsError> {
    // Bounded: only the file type matters (a FIFO would hang the read); metrics can be long.
    ava_plugins::bounded::read_to_string(file, ava_plugins::bounded::limits::LARGE).map_err(|e| MetricsError::Io {
        path: file.to_path_buf(),
        message: if e.is_missing() {
            format!("not found: give a run directory (train.out_dir) holding {METRICS_FILE}, or the file itself")
        } else {
            let full = e.to_string();
            full.strip_prefix(&format!("{}: ", file.display())).map(str::to_string).unwrap_or(full)
        },
    })
}

/// Adds the dotted names of `v`'s numeric leaves under `prefix` to `out`.
fn numeric_fields(v: &Value, prefix: String, out: &mut BTreeSet<String>) {
    match v {
        Value::Number(_) => {
            out.insert(prefix);
        }
        Value::Object(map) => {
            for (k, v) in map {
                let name = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                numeric_fields(v, name, out);
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_with(lines: &[&str]) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(METRICS_FILE);
        std::fs::write(&path, lines.join("\n")).unwrap();
        (dir, path)
    }

    #[test]
    fn reads_a_metric_by_step_from_either_record_type_and_nested_fields() {
        let (dir, path) = file_with(&[
            r#"{"type":"step","data":{"step":1,"loss":5.5,"memory":{"peak":100}}}"#,
            r#"{"type":"step","data":{"step":2,"loss":4.0,"memory":{"peak":120}}}"#,
            r#"{"type":"eval","data":{"step":2,"val_loss":4.25}}"#,
            "",
            r#"{"type":"step","data":{"step":3,"loss":3.5,"memory":{"peak":90}}}"#,
            r#"{"type":"step","data":{"step":3,"loss":3.25,"memory":{"peak":90}}}"#,
        ]);
        assert_eq!(metrics_file(dir.path()), path);
        assert_eq!(metrics_file(&path), path);
        assert_eq!(read_series(&path, "val_loss").unwrap(), vec![(2, 4.25)]);
        assert_eq!(read_series(&path, "loss").unwrap(), vec![(1, 5.5), (2, 4.0), (3, 3.25)]);
        assert_eq!(read_series(&path, "memory.peak").unwrap(), vec![(1, 100.0), (2, 120.0), (3, 90.0)]);
    }

    #[test]
    fn a_whole_run_reads_back_with_its_memory_and_events() {
        let memory = r#""memory":{"params":1,"grads":2,"optimizer":3,"data":4,"activations":5,"peak":15,"budget":0}"#;
        let (_dir, path) = file_with(&[
            &format!(r#"{{"type":"step","data":{{"step":1,"loss":5.5,"micro_batch":8,{memory}}}}}"#),
            &format!(
                r#"{{"type":"step","data":{{"step":2,"loss":4.5,"micro_batch":4,{memory},"memory_events":["shrink"]}}}}"#
            ),
            r#"{"type":"eval","data":{"step":2,"val_loss":4.25,"entropy_floor":1.5}}"#,
            &format!(r#"{{"type":"step","data":{{"step":2,"loss":4.0,"micro_batch":4,{memory}}}}}"#),
        ]);
        let run = read_run(&path).unwrap();
        assert_eq!(
            run.steps.iter().map(|s| (s.step, s.loss, s.micro_batch)).collect::<Vec<_>>(),
            [(1, 5.5, 8), (2, 4.0, 4)]
        );
        assert_eq!(run.steps[0].memory.activations, 5);
        assert!(run.steps[1].memory_events.is_empty(), "the last record of step 2 wins");
        assert_eq!(run.evals, [EvalPoint { step: 2, val_loss: 4.25, entropy_floor: Some(1.5) }]);
        let (_dir, path) = file_with(&[r#"{"type":"step","data":{"step":1}}"#]);
        let e = read_run(&path).unwrap_err().to_string();
        assert!(e.contains(":1: not a step record (missing field `loss`"), "{e}");
    }

    #[test]
    fn errors_name_the_file_the_line_and_what_there_is() {
        let (_dir, path) = file_with(&[r#"{"type":"step","data":{"step":1,"loss":5.5,"memory":{"peak":1}}}"#]);
        let e = read_series(&path, "val_los").unwrap_err().to_string();
        assert!(e.contains("no record has a numeric 'val_los'; its records have: loss, memory.peak"), "{e}");

        let (_dir, path) = file_with(&[r#"{"type":"step","data":{"step":1}}"#, "{oops"]);
        let e = read_series(&path, "loss").unwrap_err().to_string();
        assert!(e.contains(&format!("{}:2: not JSON", path.display())), "{e}");

        let e = read_series(Path::new("/nonexistent/run/metrics.jsonl"), "loss").unwrap_err().to_string();
        assert!(e.contains("not found: give a run directory"), "{e}");
    }
}
