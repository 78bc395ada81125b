//! `ava train --memory-trace STEP,…`: the chosen steps recorded allocation by allocation
//! ([`crate::memory::timeline`]) with the profiler's scopes as spans beside them, written
//! into the run directory's `memory/` as `step-N.trace.json` (Chrome's trace-event JSON,
//! for ui.perfetto.dev or chrome://tracing) and `step-N.json` (the peak and what was live
//! then, by owner, which `ava report` reads), and handed to the reporter (the CLI draws
//! the chart). Only rank 0 of a CPU run records; a file that cannot be written is a warning,
//! never the run's failure. A recorded step runs with the profiler on, so its time (in
//! metrics.jsonl and the pace) includes the scopes' timing and the recording's.

use std::path::{Path, PathBuf};

use super::TrainOptions;
use crate::memory::timeline::{self, Timeline};
use crate::profile;
use crate::train::TrainError;
use crate::train::reporter::{Reporter, StepRecord};

/// The directory under the run directory the recordings go to.
pub const MEMORY_DIR: &str = "memory";

/// One step being recorded; dropping it without [`finish`](Self::finish) stops the
/// recording and keeps nothing.
pub(super) struct Recording {
    step: u64,
    /// Whether the profiler was on before (it is put back so).
    profiling: bool,
    /// Whether this recording started the span trace (else one was on, and is left on).
    own_trace: bool,
}

impl Recording {
    /// Starts recording step `step` if `options` asks for it and this process records
    /// (`root`: rank 0 of a CPU run).
    pub(super) fn begin(options: &TrainOptions, step: u64, root: bool) -> Option<Recording> {
        if !root || !options.memory_trace.contains(&step) {
            return None;
        }
        let recording = Recording { step, profiling: profile::is_enabled(), own_trace: !profile::trace::is_on() };
        if recording.own_trace {
            profile::trace::start();
        }
        profile::enable(true);
        timeline::arm(timeline::DEFAULT_CAPACITY);
        Some(recording)
    }

    /// Stops recording at the end of the step (`outcome`) and writes its files into
    /// `out_dir/memory/`, a failed step's too (what it allocated until it failed); tells
    /// `reporter`, with a warning when the step failed or backed off, or when the files could
    /// not be written.
    pub(super) fn finish(self, out_dir: &Path, outcome: &Result<StepRecord, TrainError>, reporter: &mut dyn Reporter) {
        let step = self.step;
        let (timeline, spans) = self.stop();
        let Some(timeline) = timeline else { return };
        let dir = out_dir.join(MEMORY_DIR);
        match write(&dir, step, &timeline, spans.as_ref()) {
            Ok(()) => reporter.memory_timeline(step, &timeline, &dir),
            Err(e) => reporter.warn(&format!(
                "--memory-trace: the recording of step {step} could not be written to {} ({e}); the run goes on",
                dir.display()
            )),
        }
        match outcome {
            Err(e) => reporter.warn(&format!(
                "--memory-trace: step {step} failed ({e}); its recording is what it allocated until then"
            )),
            Ok(record) if !record.backoffs.is_empty() => reporter.warn(&format!(
                "--memory-trace: step {step} backed off {} time(s) to micro-batch {}; its recording covers every \
                 attempt, so its peak can be an abandoned attempt's",
                record.backoffs.len(),
                record.micro_batch
            )),
            Ok(_) => {}
        }
    }

    /// Stops the timeline, puts the profiler back as it was, and takes the span trace if
    /// this recording started it.
    fn stop(self) -> (Option<Timeline>, Option<profile::trace::Trace>) {
        let this = std::mem::ManuallyDrop::new(self);
        this.stopped()
    }

    fn stopped(&self) -> (Option<Timeline>, Option<profile::trace::Trace>) {
        let timeline = timeline::disarm();
        profile::enable(self.profiling);
        let spans = if self.own_trace { profile::trace::take() } else { None };
        (timeline, spans)
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        drop(self.stopped());
    }
}

/// `step-N.trace.json` and `step-N.json` of `step` in `dir`.
pub fn files(dir: &Path, step: u64) -> (PathBuf, PathBuf) {
    (dir.join(format!("step-{step}.trace.json")), dir.join(format!("step-{step}.json")))
}

fn write(dir: &Path, step: u64, timeline: &Timeline, spans: Option<&profile::trace::Trace>) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let (trace, summary) = files(dir, step);
    let chrome = timeline.chrome_trace(spans, "ava train", &format!("step {step}"));
    std::fs::write(&trace, serde_json::to_vec(&chrome).map_err(std::io::Error::other)?)?;
    if let Some(s) = timeline.summary_json(step) {
        std::fs::write(&summary, serde_json::to_vec_pretty(&s).map_err(std::io::Error::other)?)?;
    }
    Ok(())
}
