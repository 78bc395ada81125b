//! TensorBoard event files: a run's scalars and texts where `tensorboard --logdir runs/` (and
//! every tool that reads its files) finds them, beside `metrics.jsonl`.
//!
//! The format is TensorFlow's: a file named `events.out.tfevents.{seconds}.{host}.{pid}.ava`
//! of records, each `u64` length (little-endian), the masked CRC32C of those 8 bytes, the
//! bytes of one `Event` protocol buffer, and the masked CRC32C of the bytes
//! (`tensorflow/core/lib/io/record_writer.cc`; the mask is `((crc >> 15) | (crc << 17)) +
//! 0xa282ead8`). The first event names the file version (`brain.Event:2`); each later one
//! holds a step's `Summary`: scalars as `simple_value`, texts as string tensors tagged for
//! the text plugin. The messages below are the fields of `event.proto`, `summary.proto`,
//! `tensor.proto` and `tensor_shape.proto` that this writer sets, with their numbers; the
//! encoding is `prost`'s.
//!
//! A resumed run first rewrites the run directory's event files (its own, `*.ava`) without
//! the events of steps after its checkpoint (the abandoned continuation's), as
//! `metrics.jsonl` drops its lines; a fresh run removes them. So each step is in the files once. Failures to write never fail
//! the run: the trainer warns once and writes no more events (`metrics.jsonl` is the record
//! of the run).

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use ava_fs::dirfd::Dir;
use prost::Message;

use super::reporter::{EvalRecord, Reporter, StepRecord};
use crate::memory::mib;

/// `Event` (`tensorflow/core/util/event.proto`).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Event {
    /// Seconds since the Unix epoch.
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    /// The training step.
    #[prost(int64, tag = "2")]
    pub step: i64,
    /// What the event holds.
    #[prost(oneof = "What", tags = "3, 5")]
    pub what: Option<What>,
}

/// `Event.what`: the two kinds this writer uses.
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum What {
    /// The file's version, in its first event.
    #[prost(string, tag = "3")]
    FileVersion(String),
    /// A step's values.
    #[prost(message, tag = "5")]
    Summary(Summary),
}

/// `Summary` (`tensorflow/core/framework/summary.proto`).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Summary {
    /// The values, each under its tag.
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<Value>,
}

/// `Summary.Value`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Value {
    /// The series' name, e.g. `train/loss`.
    #[prost(string, tag = "1")]
    pub tag: String,
    /// Which plugin shows it (set for texts).
    #[prost(message, optional, tag = "9")]
    pub metadata: Option<SummaryMetadata>,
    /// The value.
    #[prost(oneof = "Kind", tags = "2, 8")]
    pub kind: Option<Kind>,
}

/// `Summary.Value.value`: a scalar or a tensor.
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Kind {
    /// A scalar.
    #[prost(float, tag = "2")]
    SimpleValue(f32),
    /// A tensor (a text: one string).
    #[prost(message, tag = "8")]
    Tensor(TensorProto),
}

/// `SummaryMetadata`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SummaryMetadata {
    /// The plugin that shows the value.
    #[prost(message, optional, tag = "1")]
    pub plugin_data: Option<PluginData>,
}

/// `SummaryMetadata.PluginData`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PluginData {
    /// `text` for texts.
    #[prost(string, tag = "1")]
    pub plugin_name: String,
}

/// `TensorProto` (`tensorflow/core/framework/tensor.proto`): a string scalar.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TensorProto {
    /// `DT_STRING` (7).
    #[prost(int32, tag = "1")]
    pub dtype: i32,
    /// A scalar's shape: no dimensions.
    #[prost(message, optional, tag = "2")]
    pub tensor_shape: Option<TensorShapeProto>,
    /// The strings.
    #[prost(bytes = "vec", repeated, tag = "8")]
    pub string_val: Vec<Vec<u8>>,
}

/// `TensorShapeProto` with no dimensions.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TensorShapeProto {}

/// TensorFlow's `DT_STRING`.
const DT_STRING: i32 = 7;
/// The version the first event names.
pub const FILE_VERSION: &str = "brain.Event:2";
/// What names an event file (TensorBoard reads the files whose names contain it).
pub const MARK: &str = "tfevents";
/// The most bytes of an existing event file read back on resume (a run logs about 700 bytes
/// a step: this is some 380,000 logged steps).
const READ_LIMIT: u64 = 256 << 20;

/// TensorFlow's masked CRC32C of `bytes` (stored so that a CRC of data holding CRCs stays
/// meaningful).
pub fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// One record of `data`, framed.
pub fn record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
    out
}

/// The whole records of `bytes`, in order: the data of each, up to the first one that is cut
/// short or fails its checksums (a run killed mid-write leaves at most one such at the end).
pub fn records(bytes: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    let mut at = 0;
    while bytes.len() - at >= 12 {
        let len_bytes = &bytes[at..at + 8];
        let len = u64::from_le_bytes(len_bytes.try_into().expect("8 bytes"));
        let len_crc = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().expect("4 bytes"));
        // A length past the bytes left (a torn record, or a forged one) ends the file.
        let left = bytes.len() - at - 12;
        let Some(len) = usize::try_from(len).ok().filter(|&l| l <= left.saturating_sub(4)) else { break };
        let end = at + 12 + len;
        if len_crc != masked_crc(len_bytes) || left < len + 4 {
            break;
        }
        let data = &bytes[at + 12..end];
        if u32::from_le_bytes(bytes[end..end + 4].try_into().expect("4 bytes")) != masked_crc(data) {
            break;
        }
        out.push(data);
        at = end + 4;
    }
    out
}

/// A scalar value.
pub fn scalar(tag: &str, value: f64) -> Value {
    Value { tag: tag.to_string(), metadata: None, kind: Some(Kind::SimpleValue(value as f32)) }
}

/// A text value, shown by TensorBoard's text plugin.
pub fn text(tag: &str, text: &str) -> Value {
    Value {
        tag: tag.to_string(),
        metadata: Some(SummaryMetadata { plugin_data: Some(PluginData { plugin_name: "text".into() }) }),
        kind: Some(Kind::Tensor(TensorProto {
            dtype: DT_STRING,
            tensor_shape: Some(TensorShapeProto {}),
            string_val: vec![text.as_bytes().to_vec()],
        })),
    }
}

/// Seconds since the Unix epoch, now.
fn now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// This machine's name for the file name (TensorBoard's convention), only the characters a
/// file name keeps everywhere; `localhost` if none are left.
fn host_name() -> String {
    let name: String =
        ava_fs::dir_lock::hostname().chars().filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_')).collect();
    if name.is_empty() { "localhost".into() } else { name }
}

/// A temp file a rewrite of an event file leaves if it crashes (`Dir::replace`'s
/// `.{name}.tmp-{pid}-{n}`).
fn is_temp(name: &str) -> bool {
    name.starts_with(".events.out.tfevents.") && name.contains(".ava.tmp-")
}

/// The name of an event file opened at `secs` by process `pid` on `host`: the `n`th of that
/// second and process (a run resumed within the second) takes the next number. TensorBoard
/// reads a run's files in the order of their names, so a later file's name sorts later.
pub fn file_name(secs: u64, host: &str, pid: u32, n: usize) -> String {
    format!("events.out.{MARK}.{secs:010}.{host}.{pid}.{n:03}.ava")
}

/// The run's event file, open for appending.
pub struct EventWriter {
    file: File,
    path: PathBuf,
}

impl EventWriter {
    /// Opens a new event file in the run directory `dir` (an opened handle: nothing is
    /// followed through a link), after rewriting the event files there without the events
    /// of steps after `keep_up_to`: none are left for a fresh run (0), and a resumed run
    /// keeps what its checkpoint's steps logged. Returns the writer and how many old events
    /// were dropped.
    pub fn open(dir: &Dir, keep_up_to: u64) -> io::Result<(Self, usize)> {
        let dropped = keep_steps_up_to(dir, keep_up_to)?;
        let started = now();
        let (secs, host, pid) = (started as u64, host_name(), std::process::id());
        let mut n = 0;
        let (name, file) = loop {
            let name = file_name(secs, &host, pid, n);
            match dir.create_new(&name, 0o644) {
                Ok(file) => break (name, file),
                Err(_) if n < 16 && dir.lstat(&name).ok().flatten().is_some() => n += 1,
                Err(e) => return Err(io::Error::other(e.to_string())),
            }
        };
        let mut writer = Self { file, path: dir.path().join(&name) };
        let version = Event { wall_time: started, step: 0, what: Some(What::FileVersion(FILE_VERSION.into())) };
        writer.write(&version)?;
        Ok((writer, dropped))
    }

    /// Where the events go.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends `values` as the event of `step`, and flushes it (a killed run keeps them).
    pub fn values(&mut self, step: u64, values: Vec<Value>) -> io::Result<()> {
        if values.is_empty() {
            return Ok(());
        }
        let event = Event { wall_time: now(), step: step as i64, what: Some(What::Summary(Summary { value: values })) };
        self.write(&event)
    }

    fn write(&mut self, event: &Event) -> io::Result<()> {
        self.file.write_all(&record(&event.encode_to_vec()))?;
        self.file.flush()
    }
}

/// Rewrites each of Ava's event files in `dir` (named `events.out.tfevents.*.ava`; another
/// tool's are not touched) without the events of steps after `step`, the file's version event
/// kept with what remains; how many events were dropped. A file left with no step's events
/// (a fresh run's, or a run's that stopped before logging) is removed, and so is a temp file
/// a crashed rewrite left (`.events.out.tfevents.*.ava.tmp-*`, as far as it can be). A file
/// over 256 MiB is left as it is, and so is one with no whole record or whose records are not
/// events. A file is read up to its first damaged record (a killed run's torn last one; the
/// events after a damage elsewhere are lost, as TensorBoard's reader stops there too).
pub fn keep_steps_up_to(dir: &Dir, step: u64) -> io::Result<usize> {
    let mut names: Vec<String> = std::fs::read_dir(dir.path())?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.contains(MARK) && (n.ends_with(".ava") || is_temp(n)))
        .collect();
    names.sort();
    let mut dropped = 0;
    let is_step = |e: &Event| matches!(e.what, Some(What::Summary(_)));
    for name in names {
        let other = |e: ava_fs::dirfd::DirError| io::Error::other(e.to_string());
        if is_temp(&name) {
            let _ = dir.remove_file(&name); // best effort: what cannot go stays, as it was
            continue;
        }
        if name.starts_with('.') {
            continue;
        }
        let bytes = match dir.read(&name, READ_LIMIT) {
            Ok(bytes) => bytes,
            // Larger than any run logs: not rewritten (its steps may then show twice).
            Err(ava_fs::dirfd::DirError::Read(ava_fs::bounded::ReadError::TooLarge { .. })) => continue,
            Err(e) => return Err(other(e)),
        };
        let records = records(&bytes);
        if records.is_empty() && !bytes.is_empty() {
            continue;
        }
        let Some(events) = records.iter().map(|r| Event::decode(*r).ok()).collect::<Option<Vec<_>>>() else {
            continue;
        };
        let kept: Vec<&Event> = events.iter().filter(|e| !is_step(e) || e.step <= step as i64).collect();
        dropped += events.len() - kept.len();
        let whole = records.iter().map(|r| r.len() + 16).sum::<usize>() == bytes.len();
        if !kept.iter().any(|e| is_step(e)) {
            dir.remove_file(&name).map_err(other)?;
        } else if kept.len() < events.len() || !whole {
            dir.replace(&name, 0o644, |file| kept.iter().try_for_each(|e| file.write_all(&record(&e.encode_to_vec()))))
                .map_err(other)?;
        }
    }
    Ok(dropped)
}

/// The run's event file while it is written: the first failure warns and stops it, as the
/// run itself never fails because of its logs.
pub struct Board {
    writer: Option<EventWriter>,
}

impl Board {
    /// Writes to `writer`, or (None) nothing.
    pub fn new(writer: Option<EventWriter>) -> Self {
        Self { writer }
    }

    /// Appends `values` as step `step`'s event; a failure is warned about through
    /// `reporter` once, and no more events are written.
    pub fn log(&mut self, step: u64, values: Vec<Value>, reporter: &mut dyn Reporter) {
        let Some(writer) = &mut self.writer else { return };
        if let Err(e) = writer.values(step, values) {
            reporter.warn(&format!(
                "TensorBoard events: writing {} failed ({e}); the run goes on without them (metrics.jsonl has \
                 every metric)",
                writer.path().display()
            ));
            self.writer = None;
        }
    }
}

/// A step's scalars and texts, as `metrics.jsonl`'s step line has them: `train/*` (loss, lr,
/// grad norm, tokens/s, step time, micro-batch, loss scale, MoE's auxiliary loss, skipped),
/// `memory/*_mib` (the breakdown by component, the peak, the budget, the device's and the
/// offload tier's use when there are any), and as text the memory policy's events and a
/// non-finite step's warning.
pub fn step_values(r: &StepRecord) -> Vec<Value> {
    let m = &r.memory;
    let mut values = vec![
        scalar("train/loss", r.loss),
        scalar("train/lr", r.lr),
        scalar("train/grad_norm", r.grad_norm),
        scalar("train/tokens_per_sec", r.tokens_per_sec),
        scalar("train/step_seconds", r.step_seconds),
        scalar("train/micro_batch", r.micro_batch as f64),
        scalar("train/loss_scale", r.loss_scale),
        scalar("train/skipped", f64::from(u8::from(r.skipped))),
        scalar("memory/params_mib", mib(m.params)),
        scalar("memory/grads_mib", mib(m.grads)),
        scalar("memory/optimizer_mib", mib(m.optimizer)),
        scalar("memory/data_mib", mib(m.data)),
        scalar("memory/activations_mib", mib(m.activations)),
        scalar("memory/peak_mib", mib(m.peak)),
        scalar("memory/budget_mib", mib(m.budget)),
    ];
    if let Some(aux) = r.aux_loss {
        values.push(scalar("train/aux_loss", aux));
    }
    if let Some(d) = &r.device_memory {
        values.push(scalar("memory/device_used_mib", mib(d.used)));
        values.push(scalar("memory/device_peak_mib", mib(d.peak)));
    }
    if r.offload_bytes > 0 {
        values.push(scalar("memory/offload_mib", mib(r.offload_bytes)));
    }
    if !r.memory_events.is_empty() {
        values.push(text("memory/events", &r.memory_events.join("\n\n")));
    }
    if let Some(warning) = &r.nonfinite {
        values.push(text("train/nonfinite", warning));
    }
    values
}

/// An evaluation's scalars: `eval/val_loss`, and with a known entropy floor `eval/entropy_floor`
/// and `eval/gap` (`val_loss / floor − 1`).
pub fn eval_values(e: &EvalRecord) -> Vec<Value> {
    let mut values = vec![scalar("eval/val_loss", e.val_loss)];
    if let Some(floor) = e.entropy_floor {
        values.push(scalar("eval/entropy_floor", floor));
    }
    if let Some(gap) = e.gap {
        values.push(scalar("eval/gap", gap));
    }
    values
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_is_the_castagnoli_checksum_masked_as_tensorflow_does() {
        // The CRC-32C check value of "123456789" is 0xE3069283 (the CRC catalogue's
        // CRC-32/ISCSI); masked by hand, ((c >> 15) | (c << 17)) + 0xa282ead8 mod 2³², it is
        // 0xC78AB0E5.
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(masked_crc(b"123456789"), 0xC78A_B0E5);
    }

    #[test]
    fn a_forged_length_ends_the_file_without_a_panic() {
        // usize::MAX − 12 at offset 0 puts the record's end 4 short of usize::MAX.
        for len in [u64::MAX, u64::MAX - 3, (usize::MAX - 12) as u64, (usize::MAX - 11) as u64, 1 << 40, 5] {
            let mut bytes = len.to_le_bytes().to_vec();
            bytes.extend(masked_crc(&len.to_le_bytes()).to_le_bytes());
            bytes.extend([0u8; 4]);
            assert!(records(&bytes).is_empty(), "length {len}");
        }
    }

    #[test]
    fn later_files_of_a_second_sort_after_earlier_ones() {
        let names =
            [file_name(5, "h", 7, 0), file_name(5, "h", 7, 1), file_name(5, "h", 7, 12), file_name(6, "h", 7, 0)];
        let mut sorted = names.clone();
        sorted.sort();
        assert_eq!(sorted, names);
        assert!(names.iter().all(|n| n.contains(MARK) && n.ends_with(".ava")));
    }

    #[test]
    fn records_read_back_up_to_a_torn_tail() {
        let mut bytes = record(b"first");
        bytes.extend(record(b""));
        bytes.extend(record(b"third"));
        assert_eq!(records(&bytes), [&b"first"[..], b"", b"third"]);
        let whole = bytes.len();
        bytes.extend(&record(b"cut short")[..10]);
        assert_eq!(records(&bytes).len(), 3, "a torn last record is not read");
        bytes[whole - 5] ^= 1; // a byte of "third"
        assert_eq!(records(&bytes), [&b"first"[..], b""], "a record failing its checksum ends the file");
    }

    fn steps_in(path: &Path) -> Vec<i64> {
        let bytes = std::fs::read(path).unwrap();
        records(&bytes)
            .iter()
            .map(|r| Event::decode(*r).unwrap())
            .filter(|e| matches!(e.what, Some(What::Summary(_))))
            .map(|e| e.step)
            .collect()
    }

    #[test]
    fn a_resume_keeps_the_steps_up_to_its_checkpoint_and_a_fresh_run_none() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = Dir::open(tmp.path()).unwrap();
        let (mut w, dropped) = EventWriter::open(&dir, 0).unwrap();
        assert_eq!(dropped, 0);
        for step in 1..=6 {
            w.values(step, vec![scalar("train/loss", 1.0 / step as f64)]).unwrap();
        }
        let first = w.path().to_path_buf();
        drop(w);
        let (mut w, dropped) = EventWriter::open(&dir, 4).unwrap();
        assert_eq!(dropped, 2, "steps 5 and 6 belonged to the abandoned continuation");
        assert_eq!(steps_in(&first), [1, 2, 3, 4]);
        for step in 5..=7 {
            w.values(step, vec![scalar("train/loss", 0.5), text("memory/policy", "shrank the micro-batch")]).unwrap();
        }
        assert_eq!(steps_in(w.path()), [5, 6, 7]);
        let second = w.path().to_path_buf();
        drop(w);
        let (w, dropped) = EventWriter::open(&dir, 0).unwrap();
        assert_eq!(dropped, 7);
        let files: Vec<PathBuf> = std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().path()).collect();
        assert_eq!(files, [w.path().to_path_buf()], "a fresh run leaves no earlier event file");
        assert!(steps_in(w.path()).is_empty());
        assert!(second > first, "a later file's name sorts later");

        // Another tool's event file is not Ava's to cut, nor a file with no whole record; a
        // file of only its version event (a run that logged nothing) and a crashed rewrite's
        // temp file go.
        let planted = |name: &str, bytes: &[u8]| std::fs::write(tmp.path().join(name), bytes).unwrap();
        planted("events.out.tfevents.1.other.1", b"not ours");
        planted("events.out.tfevents.2.h.1.000.ava", b"torn");
        planted(".events.out.tfevents.3.h.1.000.ava.tmp-1-0", &record(b"half a rewrite"));
        planted(".events.out.tfevents.4.h.1.000.ava", b"hidden, not a temp file");
        drop(w); // its file holds only its version event
        let (w, _) = EventWriter::open(&dir, 0).unwrap();
        let mut left: Vec<PathBuf> = std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().path()).collect();
        left.sort();
        let mut expected = vec![
            tmp.path().join(".events.out.tfevents.4.h.1.000.ava"),
            tmp.path().join("events.out.tfevents.1.other.1"),
            tmp.path().join("events.out.tfevents.2.h.1.000.ava"),
            w.path().to_path_buf(),
        ];
        expected.sort();
        assert_eq!(left, expected, "the version-only file and the temp file went");
    }
}
