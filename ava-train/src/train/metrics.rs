//! Reading a run's `metrics.jsonl` back: one metric's values by step, so runs can be put
//! side by side, or a whole run's steps and evaluations ([`read_run`]) for its report
//! (`ava report`). Each line is `{"type": "step"|"eval"|"sample", "data": {...}}`, the data being a
//! [`StepRecord`](super::StepRecord) or an [`EvalRecord`](super::EvalRecord).
//!
//! The file grows with the run and is outside input, so it is never read whole: lines are
//! read one at a time, each of at most [`LINE_LIMIT`] bytes (a longer one is skipped with a
//! warning naming the file and line), and what is kept per series is thinned to at most
//! [`MAX_POINTS`] points (every step while they fit, then every 2nd, 4th, ... step, the first
//! and last always). A resumed run drops the records after its checkpoint by reading the file
//! backwards from its end ([`keep_steps_up_to`]).

use std::{
    collections::{BTreeMap, BTreeSet},
    fs::File,
    io::{self, BufRead, BufReader},
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
};

use serde_json::Value;

/// The metrics file's name inside a run directory (`train.out_dir`).
pub const METRICS_FILE: &str = "metrics.jsonl";

/// The longest line read; a record `ava train` writes is a few hundred bytes.
pub const LINE_LIMIT: usize = 1 << 20;

/// The most points kept of one series (a chart is 960 pixels wide).
pub const MAX_POINTS: usize = 4096;

/// Warnings kept (each skipped line gives one); later ones are counted.
const MAX_WARNINGS: usize = 20;

/// Memory events kept for the summary; later ones are counted.
const MAX_EVENTS: usize = 1000;

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

/// One metric of a run, as [`read_series`] reads it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Series {
    /// (step, value), by step.
    pub points: Vec<(u64, f64)>,
    /// 1 when every step is kept; else the points are every `stride`-th step (and the first
    /// and last).
    pub stride: u64,
    /// Lines skipped, each with the file and line number.
    pub warnings: Vec<String>,
}

/// The values of `metric` (a field of the step or eval records; `memory.peak` reaches into
/// nested ones) by step, sorted by step and thinned to [`MAX_POINTS`]. A step logged twice
/// keeps its last value.
pub fn read_series(file: &Path, metric: &str) -> Result<Series, MetricsError> {
    let mut lines = Lines::open(file)?;
    let mut by_step = Thinned::default();
    let mut available = BTreeSet::new();
    while let Some((n, line)) = lines.next_line()? {
        let parse = |message: String| MetricsError::Parse { path: file.to_path_buf(), line: n, message };
        let record: Value = serde_json::from_str(line).map_err(|e| parse(format!("not JSON ({e})")))?;
        let data = &record["data"];
        let Some(step) = data["step"].as_u64() else {
            return Err(parse("no data.step".into()));
        };
        if available.len() < 1000 {
            numeric_fields(data, String::new(), &mut available);
        }
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
    let stride = by_step.stride;
    Ok(Series { points: by_step.into_points(), stride, warnings: lines.warnings() })
}

/// Points by step, at most about [`MAX_POINTS`]: steps that are multiples of `stride`, which
/// doubles (dropping the others) whenever they grow past the bound, plus the first and last
/// step always. A step given again replaces its point.
#[derive(Debug)]
struct Thinned<T> {
    kept: BTreeMap<u64, T>,
    stride: u64,
    first: Option<(u64, T)>,
    last: Option<(u64, T)>,
}

impl<T> Default for Thinned<T> {
    fn default() -> Self {
        Self { kept: BTreeMap::new(), stride: 1, first: None, last: None }
    }
}

impl<T: Clone> Thinned<T> {
    fn insert(&mut self, step: u64, value: T) {
        if self.first.as_ref().is_none_or(|f| step <= f.0) {
            self.first = Some((step, value.clone()));
        }
        if self.last.as_ref().is_none_or(|l| step >= l.0) {
            self.last = Some((step, value.clone()));
        }
        if !step.is_multiple_of(self.stride) {
            return;
        }
        self.kept.insert(step, value);
        while self.kept.len() > MAX_POINTS {
            self.stride = self.stride.saturating_mul(2);
            let stride = self.stride;
            self.kept.retain(|s, _| s % stride == 0);
        }
    }

    fn is_empty(&self) -> bool {
        self.first.is_none()
    }

    fn into_points(mut self) -> Vec<(u64, T)> {
        for (step, value) in self.first.into_iter().chain(self.last) {
            self.kept.insert(step, value);
        }
        self.kept.into_iter().collect()
    }
}

/// The lines of a metrics file, read one at a time: each at most [`LINE_LIMIT`] bytes (a
/// longer one is skipped, with a warning), blank ones skipped.
struct Lines {
    path: PathBuf,
    reader: BufReader<File>,
    buf: Vec<u8>,
    number: usize,
    warnings: Vec<String>,
    more_warnings: usize,
}

impl Lines {
    fn open(file: &Path) -> Result<Self, MetricsError> {
        // Bounded: only the file type matters (a FIFO would hang the read); metrics can be long.
        let (handle, _) =
            ava_fs::bounded::open_regular(file, ava_fs::bounded::limits::LARGE).map_err(|e| io_error(file, e))?;
        Ok(Self {
            path: file.to_path_buf(),
            reader: BufReader::with_capacity(1 << 16, handle),
            buf: Vec::new(),
            number: 0,
            warnings: Vec::new(),
            more_warnings: 0,
        })
    }

    /// The next non-blank line and its 1-based number, or `None` at the end.
    fn next_line(&mut self) -> Result<Option<(usize, &str)>, MetricsError> {
        loop {
            self.number += 1;
            self.buf.clear();
            let (read, whole) = self.read_line().map_err(|e| MetricsError::Io {
                path: self.path.clone(),
                message: format!("{e} (line {})", self.number),
            })?;
            if read == 0 {
                return Ok(None);
            }
            if !whole {
                self.warn(format!(
                    "{}:{}: a line of more than {} bytes, skipped (ava train writes records of a few hundred)",
                    self.path.display(),
                    self.number,
                    LINE_LIMIT
                ));
                continue;
            }
            if self.buf.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            return match std::str::from_utf8(&self.buf) {
                Ok(text) => Ok(Some((self.number, text))),
                Err(_) => Err(MetricsError::Parse {
                    path: self.path.clone(),
                    line: self.number,
                    message: "not UTF-8 text".into(),
                }),
            };
        }
    }

    /// Reads one line into `buf` (without its newline), keeping at most [`LINE_LIMIT`] bytes
    /// of it: returns the bytes consumed (0 at the end) and whether the line fitted.
    fn read_line(&mut self) -> io::Result<(usize, bool)> {
        let (mut consumed, mut whole) = (0, true);
        loop {
            let available = self.reader.fill_buf()?;
            if available.is_empty() {
                return Ok((consumed, whole));
            }
            let (piece, done) = match memchr(available) {
                Some(i) => (&available[..i], i + 1),
                None => (available, available.len()),
            };
            if whole && self.buf.len() + piece.len() <= LINE_LIMIT {
                self.buf.extend_from_slice(piece);
            } else {
                whole = false;
                self.buf.clear();
            }
            let newline = done > piece.len();
            self.reader.consume(done);
            consumed += done;
            if newline {
                return Ok((consumed, whole));
            }
        }
    }

    fn warn(&mut self, message: String) {
        if self.warnings.len() < MAX_WARNINGS {
            self.warnings.push(message);
        } else {
            self.more_warnings += 1;
        }
    }

    fn warnings(&self) -> Vec<String> {
        let mut all = self.warnings.clone();
        if self.more_warnings > 0 {
            all.push(format!("{}: {} more lines skipped", self.path.display(), self.more_warnings));
        }
        all
    }
}

fn memchr(bytes: &[u8]) -> Option<usize> {
    bytes.iter().position(|&b| b == b'\n')
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

/// A run's steps and evaluations as its report needs them: the points to chart (thinned to
/// [`MAX_POINTS`] each, a step logged twice keeping its last record), and what the summary
/// says, taken from every record as it is read.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RunMetrics {
    /// The logged steps to chart, by step: all of them, or every `stride`-th (and the first
    /// and last).
    pub steps: Vec<StepPoint>,
    /// The evaluations to chart, by step.
    pub evals: Vec<EvalPoint>,
    /// 1 when every step is kept (see `steps`).
    pub stride: u64,
    /// Step records read.
    pub step_records: u64,
    /// The step with the highest memory peak.
    pub peak: Option<StepPoint>,
    /// The evaluation with the lowest validation loss (the first such).
    pub best_eval: Option<EvalPoint>,
    /// Where the micro-batch changed, (step, from, to), in file order; at most [`MAX_POINTS`].
    pub changes: Vec<(u64, u64, u64)>,
    /// Memory events by step, the first [`MAX_EVENTS`](self) of them.
    pub events: Vec<(u64, String)>,
    /// Memory events in all.
    pub event_count: u64,
    /// Lines skipped, each with the file and line number.
    pub warnings: Vec<String>,
}

/// Reads every step and eval record of a metrics file, line by line (see the module doc).
pub fn read_run(file: &Path) -> Result<RunMetrics, MetricsError> {
    let mut lines = Lines::open(file)?;
    let (mut steps, mut evals) = (Thinned::default(), Thinned::default());
    let mut run = RunMetrics::default();
    let mut micro: Option<u64> = None;
    while let Some((n, line)) = lines.next_line()? {
        let parse = |message: String| MetricsError::Parse { path: file.to_path_buf(), line: n, message };
        let mut record: Value = serde_json::from_str(line).map_err(|e| parse(format!("not JSON ({e})")))?;
        let data = record["data"].take();
        match record["type"].as_str() {
            Some("step") => {
                let p: StepPoint =
                    serde_json::from_value(data).map_err(|e| parse(format!("not a step record ({e})")))?;
                run.add_step(&p, &mut micro);
                steps.insert(p.step, p);
            }
            Some("eval") => {
                let p: EvalPoint =
                    serde_json::from_value(data).map_err(|e| parse(format!("not an eval record ({e})")))?;
                // A NaN evaluation is never the best (and never stays it).
                if run.best_eval.is_none_or(|b| p.val_loss < b.val_loss || b.val_loss.is_nan()) {
                    run.best_eval = Some(p);
                }
                evals.insert(p.step, p);
            }
            // A text sample (`train.sample_every`): nothing to chart.
            Some("sample") => {}
            _ => return Err(parse("its type is none of \"step\", \"eval\" and \"sample\"".into())),
        }
    }
    run.stride = steps.stride;
    run.steps = steps.into_points().into_iter().map(|p| p.1).collect();
    run.evals = evals.into_points().into_iter().map(|p| p.1).collect();
    run.warnings = lines.warnings();
    Ok(run)
}

impl RunMetrics {
    /// Takes what the summary says from one step record, in file order. A step logged again
    /// (a resumed run) first drops the changes and events logged from that step on.
    fn add_step(&mut self, p: &StepPoint, micro: &mut Option<u64>) {
        self.step_records += 1;
        if self.changes.last().is_some_and(|c| c.0 >= p.step) || self.events.last().is_some_and(|e| e.0 >= p.step) {
            self.changes.retain(|c| c.0 < p.step);
            let before = self.events.len();
            self.events.retain(|e| e.0 < p.step);
            self.event_count = self.event_count.saturating_sub((before - self.events.len()) as u64);
        }
        if self.peak.as_ref().is_none_or(|top| p.memory.peak > top.memory.peak) {
            self.peak = Some(p.clone());
        }
        // A back-off within the step, then a change between logged steps (the memory policy's).
        let start = p.backoffs.first().map_or(p.micro_batch, |b| b.micro_batch);
        let mut changes: Vec<(u64, u64, u64)> =
            micro.filter(|&m| m != start).map(|m| (p.step, m, start)).into_iter().collect();
        changes.extend(p.backoffs.iter().map(|b| (p.step, b.micro_batch, b.retry_micro_batch)));
        for change in changes {
            if self.changes.len() < MAX_POINTS {
                self.changes.push(change);
            }
        }
        *micro = Some(p.micro_batch);
        for message in &p.memory_events {
            self.event_count += 1;
            if self.events.len() < MAX_EVENTS {
                self.events.push((p.step, message.clone()));
            }
        }
    }
}

fn io_error(file: &Path, e: ava_fs::bounded::ReadError) -> MetricsError {
    MetricsError::Io {
        path: file.to_path_buf(),
        message: if e.is_missing() {
            format!("not found: give a run directory (train.out_dir) holding {METRICS_FILE}, or the file itself")
        } else {
            let full = e.to_string();
            full.strip_prefix(&format!("{}: ", file.display())).map(str::to_string).unwrap_or(full)
        },
    }
}

/// Keeps the records of steps up to `step` in the metrics file open as `handle` (read and
/// write) and drops the rest, as a resumed run starts (step 0: a fresh run, nothing kept).
/// The file is read backwards from its end, a piece at a time, to the last line whose step is
/// at most `step`, and cut after it: a resume reads only the records it drops, whatever the
/// file's length. Records are in step order, as `ava train` writes them (each resume cuts
/// what came after).
pub fn keep_steps_up_to(handle: &File, step: u64) -> io::Result<()> {
    let meta = handle.metadata()?;
    if !meta.file_type().is_file() {
        return Err(io::Error::other("not a regular file; remove it, or train with another train.out_dir"));
    }
    let keep = if step == 0 { 0 } else { kept_length(handle, meta.len(), step)? };
    handle.set_len(keep)?;
    if keep > 0 {
        let mut last = [0u8];
        handle.read_exact_at(&mut last, keep - 1)?;
        if last[0] != b'\n' {
            handle.write_all_at(b"\n", keep)?;
        }
    }
    Ok(())
}

/// The length of `file` up to and including the last line whose `data.step` is at most
/// `step` (0 when there is none); lines longer than [`LINE_LIMIT`] are not read.
fn kept_length(file: &File, len: u64, step: u64) -> io::Result<u64> {
    const PIECE: u64 = 1 << 16;
    let mut end = len; // the end of the line being looked at (its newline, or the file's end)
    let mut piece = vec![0u8; PIECE as usize];
    loop {
        // Where the line ending at `end` starts: after the newline before it.
        let mut start = end;
        loop {
            let from = start.saturating_sub(PIECE);
            let got = &mut piece[..(start - from) as usize];
            file.read_exact_at(got, from)?;
            match got.iter().rposition(|&b| b == b'\n') {
                Some(i) => {
                    start = from + i as u64 + 1;
                    break;
                }
                None if from == 0 => {
                    start = 0;
                    break;
                }
                None => start = from,
            }
        }
        if end - start <= LINE_LIMIT as u64 && end > start {
            let mut line = vec![0u8; (end - start) as usize];
            file.read_exact_at(&mut line, start)?;
            let logged = serde_json::from_slice::<Value>(&line).ok().and_then(|v| v["data"]["step"].as_u64());
            if logged.is_some_and(|s| s <= step) {
                return Ok((end + 1).min(len));
            }
        }
        if start == 0 {
            return Ok(0);
        }
        end = start - 1;
    }
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
        assert_eq!(read_series(&path, "val_loss").unwrap().points, vec![(2, 4.25)]);
        assert_eq!(read_series(&path, "loss").unwrap().points, vec![(1, 5.5), (2, 4.0), (3, 3.25)]);
        assert_eq!(read_series(&path, "memory.peak").unwrap().points, vec![(1, 100.0), (2, 120.0), (3, 90.0)]);
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

    /// A step record as `ava train` writes it (the fields the report reads).
    fn step_line(step: u64, loss: f64, micro: u64, peak: u64) -> String {
        format!(
            r#"{{"type":"step","data":{{"step":{step},"loss":{loss:?},"micro_batch":{micro},"memory":{{"params":1,"grads":2,"optimizer":3,"data":4,"activations":5,"peak":{peak},"budget":0}}}}}}"#
        )
    }

    #[test]
    fn an_overlong_line_is_skipped_with_a_warning_naming_the_file_and_line() {
        let huge = format!(r#"{{"type":"step","data":{{"step":2,"loss":1.0,"pad":"{}"}}}}"#, "x".repeat(3 << 20));
        let (_dir, path) = file_with(&[&step_line(1, 5.5, 8, 1), &huge, &step_line(3, 3.5, 8, 2)]);
        let expected = format!("{}:2: a line of more than 1048576 bytes, skipped", path.display());
        let series = read_series(&path, "loss").unwrap();
        assert_eq!(series.points, vec![(1, 5.5), (3, 3.5)]);
        assert!(series.warnings.len() == 1 && series.warnings[0].starts_with(&expected), "{:?}", series.warnings);
        let run = read_run(&path).unwrap();
        assert_eq!(run.steps.iter().map(|s| s.step).collect::<Vec<_>>(), [1, 3]);
        assert!(run.warnings[0].starts_with(&expected), "{:?}", run.warnings);
    }

    #[test]
    fn a_long_run_keeps_a_bounded_number_of_points_and_exact_facts() {
        let n = 5 * MAX_POINTS as u64 + 3;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(METRICS_FILE);
        let mut text = String::new();
        for step in 1..=n {
            let (micro, peak) = (if step > n / 2 { 4 } else { 8 }, if step == 777 { 1000 } else { step % 100 });
            text.push_str(&step_line(step, 1.0 / step as f64, micro, peak));
            text.push('\n');
            if step % 10 == 0 {
                text.push_str(&format!(
                    "{{\"type\":\"eval\",\"data\":{{\"step\":{step},\"val_loss\":{}}}}}\n",
                    step % 7
                ));
            }
        }
        std::fs::write(&path, text).unwrap();
        let run = read_run(&path).unwrap();
        assert!(run.steps.len() <= MAX_POINTS + 2 && run.evals.len() <= MAX_POINTS + 2, "{}", run.steps.len());
        assert!(run.stride >= 8, "{}", run.stride);
        assert_eq!((run.steps[0].step, run.steps.last().unwrap().step, run.step_records), (1, n, n));
        assert_eq!(run.peak.as_ref().map(|p| (p.step, p.memory.peak)), Some((777, 1000)));
        assert_eq!(run.best_eval.map(|e| (e.step, e.val_loss)), Some((70, 0.0)));
        assert_eq!(run.changes, [(n / 2 + 1, 8, 4)]);
        let series = read_series(&path, "loss").unwrap();
        assert!(series.points.len() <= MAX_POINTS + 2 && series.stride == run.stride);
        assert_eq!(series.points.last(), Some(&(n, 1.0 / n as f64)));
    }

    #[test]
    fn a_resume_keeps_the_records_up_to_its_step_reading_from_the_end() {
        let lines: Vec<String> = (1..=6)
            .flat_map(|s| {
                [format!(r#"{{"type":"step","data":{{"step":{s},"loss":1.0}}}}"#)]
                    .into_iter()
                    .chain((s % 2 == 0).then(|| format!(r#"{{"type":"eval","data":{{"step":{s},"val_loss":2.0}}}}"#)))
            })
            .collect();
        let huge = "y".repeat(2 * LINE_LIMIT);
        let mut all: Vec<&str> = lines.iter().map(String::as_str).collect();
        all.extend([huge.as_str(), r#"{"type":"step","data":{"st"#]);
        let (_dir, path) = file_with(&all);
        let keep = |step| {
            let file = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
            keep_steps_up_to(&file, step).unwrap();
        };
        keep(4);
        let kept = std::fs::read_to_string(&path).unwrap();
        assert_eq!(kept, format!("{}\n", lines[..6].join("\n")), "steps 1-4 and the evals of 2 and 4");
        keep(9);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), kept, "nothing after step 4 to drop");
        // Its last record unterminated: the next one starts on a line of its own.
        std::fs::write(&path, &lines[0]).unwrap();
        keep(1);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), format!("{}\n", lines[0]));
        keep(0);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "");
    }
}
