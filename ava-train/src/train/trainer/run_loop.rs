//! The run loop ([`Trainer::run`]), a stage per concern: the steps until `train.max_steps`
//! (or `--steps` more), what the ranks agree on after each (stop, checkpoint), its events
//! and metrics line (and TensorBoard event), evaluation and samples when due, the
//! checkpoints, how a run that runs out of memory or is stopped in a wait ends, and the run's
//! summary.

use super::*;
use crate::train::tensorboard::{self, Board};

/// The run's tokens/s: the first step (which warms up caches and threads) is left out of
/// the mean unless it is the only one.
#[derive(Default)]
struct Pace {
    /// Seconds and tokens of the steps after the first.
    timed: (f64, usize),
    /// The first step's.
    first: Option<(f64, usize)>,
}

impl Pace {
    fn add(&mut self, seconds: f64, tokens: usize) {
        if self.first.is_none() {
            self.first = Some((seconds, tokens));
        } else {
            self.timed.0 += seconds;
            self.timed.1 += tokens;
        }
    }

    /// No step has completed yet in this run.
    fn before_first_step(&self) -> bool {
        self.first.is_none()
    }

    fn tokens_per_sec(&self) -> f64 {
        let (seconds, tokens) = if self.timed.0 == 0.0 { self.first.unwrap_or_default() } else { self.timed };
        if seconds > 0.0 { tokens as f64 / seconds } else { 0.0 }
    }
}

/// What the ranks agreed on once a step was done.
struct AfterStep {
    /// Stop the run, for this reason (a memory policy's, this rank's or another's).
    stop: Option<String>,
    /// A stop was asked for (a signal) before the last step: save and stop.
    interrupted: bool,
    /// A memory policy asked for a checkpoint now.
    checkpoint: bool,
}

impl Trainer {
    /// Runs until `train.max_steps` (or `options.steps` more steps), evaluating and saving
    /// checkpoints on the way, and writes the final weights as a Hugging Face folder.
    pub fn run(&mut self, options: &TrainOptions, reporter: &mut dyn Reporter) -> Result<RunSummary, TrainError> {
        let last = match options.steps {
            Some(n) => (self.step + n).min(self.config.train.max_steps),
            None => self.config.train.max_steps,
        };
        // Rank 0 writes the run's files; the others train and take part in its collectives.
        let root = self.zero.is_root();
        if root {
            self.check_checkpoint_room()?;
        }
        let mut metrics = if root { Some(self.open_metrics()?) } else { None };
        reporter.start(&RunHeader { last_step: last, ..self.header() });
        let mut board = if root { self.open_tensorboard(reporter) } else { Board::new(None) };
        let mut summary = RunSummary {
            step: self.step,
            loss: f64::NAN,
            val_loss: None,
            entropy_floor: self.dataset.entropy_floor_nats(),
            tokens_per_sec: 0.0,
            peak_bytes: 0,
            rank_peak_bytes: Vec::new(),
            checkpoint: None,
            model_dir: None,
            stopped: None,
            interrupted: false,
            interrupted_while: None,
            tokens_by_source: Vec::new(),
        };
        let stop_requested = || options.stop.as_ref().is_some_and(|s| s.load(Ordering::SeqCst));
        self.watch_stop(options);
        let mut pace = Pace::default();
        let mut saved_at = None;
        let mut prev_micro_batch = None;
        while self.step < last {
            if pace.before_first_step() && self.agreed_flags([stop_requested() as u64])?[0] > 0 {
                // Asked before this step started (e.g. while the run was being built): the
                // last completed step is saved already, or nothing ran.
                summary.interrupted = true;
                break;
            }
            let recording =
                memory_trace::Recording::begin(options, self.step + 1, root && !self.config.train.device.is_cuda());
            let stepped = self.train_step();
            if let Some(recording) = recording {
                recording.finish(&self.out_dir, &stepped, reporter);
            }
            let mut record = match stepped {
                Ok(record) => record,
                // With several ranks the others are waiting in this step's collectives: the
                // error ends the job (the last checkpoint is intact).
                // Out of memory at the smallest micro-batch, the host's limit or the device's
                // (outside backward: a step inside it wraps the error as FailedInBackward).
                Err(e @ (TrainError::OutOfMemory { .. } | TrainError::DeviceOutOfMemory { step: Some(_), .. }))
                    if self.zero.size() == 1 =>
                {
                    summary.checkpoint = self.checkpoint_after_running_out(reporter)?;
                    summary.stopped = Some(e.to_string());
                    break;
                }
                Err(e) if stopped_waiting(&e) => {
                    summary.checkpoint = self.checkpoint_after_stopped_wait(&e, reporter)?;
                    summary.interrupted_while = Some(e.to_string());
                    summary.interrupted = true;
                    break;
                }
                Err(e) => return Err(e),
            };
            report_events(&mut record, reporter);
            let after = self.apply_policy_and_agree(&mut record, reporter, &stop_requested, last)?;
            add_step(&mut summary, &record);
            pace.add(record.step_seconds, self.global_batch() * self.config.data.seq_len);
            // Off the log_every grid too: a step where the memory policy or the back-off acted,
            // and the first step at a new micro-batch, so `ava report` sees every change.
            let changed = prev_micro_batch.is_some_and(|m| m != record.micro_batch);
            prev_micro_batch = Some(record.micro_batch);
            let eventful = !record.memory_events.is_empty()
                || !record.backoffs.is_empty()
                || changed
                || record.nonfinite.is_some()
                || after.interrupted;
            if record.step % self.config.train.log_every == 0 || record.step == last || eventful {
                let line = serde_json::json!({"type": "step", "data": record});
                write_line(metrics.as_mut(), &self.metrics_path(), &line)?;
                board.log(record.step, tensorboard::step_values(&record), reporter);
            }
            reporter.step(&record);
            let logs = Logs { metrics: metrics.as_mut(), board: &mut board };
            self.evaluate_and_sample(record.step, last, logs, reporter, &mut summary)?;
            let every = self.config.checkpoints.every;
            if (every > 0 && record.step % every == 0)
                || record.step == last
                || after.stop.is_some()
                || after.checkpoint
                || after.interrupted
            {
                let dir = self.save_checkpoint()?;
                reporter.checkpoint(record.step, &dir);
                summary.checkpoint = Some(dir.display().to_string());
                saved_at = Some(record.step);
            }
            if let Some(reason) = after.stop {
                summary.stopped = Some(reason);
                break;
            }
            if after.interrupted {
                summary.interrupted = true;
                break;
            }
        }
        if saved_at.is_none() && self.step > 0 && root {
            // Nothing ran (already at max_steps): still point at the latest checkpoint.
            summary.checkpoint = self.store.latest()?.map(|p| p.display().to_string());
        }
        if self.step == self.config.train.max_steps && summary.stopped.is_none() && !summary.interrupted {
            summary.model_dir = self.save_final_model(reporter)?.map(|dir| dir.display().to_string());
        }
        summary.tokens_per_sec = pace.tokens_per_sec();
        reporter.finish(&summary);
        Ok(summary)
    }

    /// Waits outside a step's work give up once `options.stop` is set (see `stopped_waiting`);
    /// the loader's only where the other ranks' waits can give up too (not over MPI, whose
    /// collectives would then wait for good for the rank that left).
    fn watch_stop(&mut self, options: &TrainOptions) {
        if let Some(stop) = &options.stop {
            let ranks_give_up = self.zero.group().watch_stop(Some(stop.clone()));
            if ranks_give_up || self.zero.size() == 1 {
                self.loader.watch(stop.clone());
            }
        }
    }

    /// A run that ran out of memory at its smallest micro-batch: nothing of the step was
    /// applied, so what the last step left is saved (unless it is saved already, e.g. the
    /// checkpoint this run resumed from), and the run stops. Returns that checkpoint.
    fn checkpoint_after_running_out(&mut self, reporter: &mut dyn Reporter) -> Result<Option<String>, TrainError> {
        let existing = self.store.root().join(crate::save::step_dir_name(self.step));
        if existing.is_dir() {
            return Ok(Some(existing.display().to_string()));
        }
        if self.step == 0 {
            return Ok(None);
        }
        let dir = self.save_checkpoint()?;
        reporter.checkpoint(self.step, &dir);
        Ok(Some(dir.display().to_string()))
    }

    /// The checkpoint a run stopped in a wait ends with. Stopped waiting for the data loader,
    /// alone, nothing of the step was applied: the last completed step is saved (unless it
    /// is already). Stopped waiting for other ranks, the step may be half applied (and a save
    /// would wait for them again): nothing is written, the latest checkpoint stays the one.
    fn checkpoint_after_stopped_wait(
        &mut self,
        e: &TrainError,
        reporter: &mut dyn Reporter,
    ) -> Result<Option<String>, TrainError> {
        let consistent = matches!(e, TrainError::Data(_)) && self.zero.size() == 1;
        let existing = self.store.root().join(crate::save::step_dir_name(self.step));
        if consistent && self.step > 0 && !existing.is_dir() {
            let dir = self.save_checkpoint()?;
            reporter.checkpoint(self.step, &dir);
            return Ok(Some(dir.display().to_string()));
        }
        if !self.zero.is_root() {
            return Ok(None);
        }
        Ok(self.store.latest()?.map(|p| p.display().to_string()))
    }

    /// The memory policy's decision on the step, then what the ranks agree on: one asked to
    /// stop (a signal, its memory policy) stops them all, and from here the waits for the
    /// other ranks (the agreement, the save) complete. The step under way always completes
    /// and is saved.
    fn apply_policy_and_agree(
        &mut self,
        record: &mut StepRecord,
        reporter: &mut dyn Reporter,
        stop_requested: &dyn Fn() -> bool,
        last: u64,
    ) -> Result<AfterStep, TrainError> {
        let policy = self.apply_memory_policy(record, reporter);
        if stop_requested() {
            self.zero.group().watch_stop(None);
        }
        let [interrupted, stopped, policy_checkpoint] =
            self.agreed_flags([stop_requested() as u64, policy.stop.is_some() as u64, policy.checkpoint as u64])?;
        let stop = match policy.stop {
            Some(reason) => Some(reason),
            None if stopped > 0 => Some("another rank's memory policy stopped the run".to_string()),
            None => None,
        };
        Ok(AfterStep { stop, interrupted: interrupted > 0 && record.step < last, checkpoint: policy_checkpoint > 0 })
    }

    /// Evaluation (every `train.eval_every` steps and at the last, when the data has a
    /// validation split) and a sample (every `train.sample_every`, rank 0), each written to
    /// the metrics and the event file, and reported.
    fn evaluate_and_sample(
        &mut self,
        step: u64,
        last: u64,
        logs: Logs<'_>,
        reporter: &mut dyn Reporter,
        summary: &mut RunSummary,
    ) -> Result<(), TrainError> {
        let Logs { mut metrics, board } = logs;
        let t = &self.config.train;
        let due = (t.eval_every > 0 && step.is_multiple_of(t.eval_every)) || step == last;
        let sample_due = t.sample_every > 0 && step.is_multiple_of(t.sample_every) && self.zero.is_root();
        if due && self.dataset.missing_validation().is_none() {
            let limit = self.meter.device_limit();
            let eval = self.evaluate().map_err(|e| TrainError::device_out_of_memory(Some(step), limit, e))?;
            summary.val_loss = Some(eval.val_loss);
            let line = serde_json::json!({"type": "eval", "data": eval});
            write_line(metrics.as_deref_mut(), &self.metrics_path(), &line)?;
            board.log(step, tensorboard::eval_values(&eval), reporter);
            reporter.eval(&eval);
        }
        if sample_due {
            let (text, stop) = self.sample()?;
            let line = serde_json::json!({"type": "sample", "data": {"step": step, "text": text}});
            write_line(metrics, &self.metrics_path(), &line)?;
            board.log(step, vec![tensorboard::text("samples/text", &text)], reporter);
            reporter.sample(step, &text, stop);
        }
        Ok(())
    }
}

/// The step's out-of-memory back-offs, each reported as a warning and kept with the step's
/// memory events; a skipped non-finite step's warning.
fn report_events(record: &mut StepRecord, reporter: &mut dyn Reporter) {
    for b in &record.backoffs {
        let event = format!(
            "out of memory at step {} (an allocation took the count to {} over memory.hard_limit): the micro-step was \
             abandoned and the step retried at micro-batch {} -> {}, gradient accumulation doubled, the same samples",
            record.step,
            ava_core::format_size(b.crossed_at),
            b.micro_batch,
            b.retry_micro_batch
        );
        reporter.warn(&event);
        record.memory_events.push(event);
    }
    if let Some(warning) = &record.nonfinite {
        reporter.warn(warning);
    }
}

/// The step into the run's summary: its loss, its data sources, and the peaks.
fn add_step(summary: &mut RunSummary, record: &StepRecord) {
    summary.step = record.step;
    summary.loss = record.loss;
    summary.tokens_by_source.clone_from(&record.tokens_by_source);
    summary.peak_bytes = summary.peak_bytes.max(record.memory.peak);
    summary.rank_peak_bytes.resize(record.rank_peaks.len(), 0);
    for (most, &p) in summary.rank_peak_bytes.iter_mut().zip(&record.rank_peaks) {
        *most = (*most).max(p);
    }
}

/// Where a step's records are written (rank 0; the others hold none): `metrics.jsonl` and the
/// TensorBoard event file.
struct Logs<'a> {
    metrics: Option<&'a mut std::fs::File>,
    board: &'a mut Board,
}

/// Appends one JSON line and flushes it (so a killed run keeps its metrics); nothing on a
/// rank that does not write the run's files.
fn write_line(file: Option<&mut std::fs::File>, path: &Path, value: &Value) -> Result<(), TrainError> {
    let Some(file) = file else { return Ok(()) };
    let mut line = serde_json::to_string(value).expect("a JSON value serializes");
    line.push('\n');
    file.write_all(line.as_bytes()).and_then(|_| file.flush()).map_err(|e| TrainError::io(path, e))
}
