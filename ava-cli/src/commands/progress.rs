//! The training reporter of the CLI: a progress bar (indicatif, shown on a terminal) with
//! loss, tokens/s and memory, and the dashboard lines through the printer.

use std::path::Path;
use std::time::Instant;

use ava_train::memory::size;
use ava_train::memory::timeline::Timeline;
use ava_train::train::{EvalRecord, Reporter, RunHeader, RunSummary, StepRecord, memory_trace_files};
use indicatif::{ProgressBar, ProgressStyle};

use crate::output::{Format, Printer};

/// Reports a run on stderr.
pub struct CliReporter<'a> {
    printer: &'a Printer,
    bar: Option<ProgressBar>,
    log_every: u64,
    /// `train.max_steps`, the step this invocation stops at, and when and at which step
    /// it started (for the ETA).
    max_steps: u64,
    last_step: u64,
    started: Option<(Instant, u64)>,
    /// The first memory line said what its RSS is.
    rss_said: bool,
    /// `ava estimate`'s peak, drawn on the charts of recorded steps.
    memory_estimate: Option<u64>,
}

impl<'a> CliReporter<'a> {
    /// A reporter printing a dashboard line every `log_every` steps.
    pub fn new(printer: &'a Printer, log_every: u64) -> Self {
        Self {
            printer,
            bar: None,
            log_every: log_every.max(1),
            max_steps: 0,
            last_step: 0,
            started: None,
            rss_said: false,
            memory_estimate: None,
        }
    }

    /// Draws `estimate` (bytes) on the charts of the steps `--memory-trace` records.
    pub fn with_memory_estimate(mut self, estimate: Option<u64>) -> Self {
        self.memory_estimate = estimate;
        self
    }

    /// `3/300, eta 1m 12s`: where the run is, and when this invocation should end at the mean
    /// rate so far (the first step, which warms up, counts once a second one is done).
    fn position(&self, step: u64) -> String {
        let eta = match self.started {
            Some((at, first)) if step > first && step < self.last_step => {
                let per_step = at.elapsed().as_secs_f64() / (step - first) as f64;
                format!(", eta {}", duration((self.last_step - step) as f64 * per_step))
            }
            _ => String::new(),
        };
        format!("{step}/{}{eta}", self.max_steps)
    }

    fn line(&self, text: &str) {
        match &self.bar {
            Some(bar) if !bar.is_hidden() => bar.println(text),
            _ => self.printer.note(text),
        }
    }
}

impl Reporter for CliReporter<'_> {
    fn start(&mut self, h: &RunHeader) {
        (self.max_steps, self.last_step) = (h.max_steps, h.last_step);
        crate::signals::step_under_way(h.first_step);
        let mut lines = vec![format!(
            "training {:.2}M parameters on {} — effective batch {} sequences ({} tokens/step), {} threads",
            h.params as f64 / 1e6,
            h.data,
            h.effective_batch,
            h.tokens_per_step,
            h.threads
        )];
        let plugins: Vec<String> = h.plugins.iter().map(|(k, v)| format!("{k} {v}")).collect();
        lines.push(format!("plugins: {}", plugins.join(", ")));
        lines.push(format!("checkpoint plan: {}", h.plan.join(" ")));
        if let Some(ranks) = &h.ranks {
            lines.push(ranks.clone());
        }
        if let Some(offload) = &h.offload {
            lines.push(offload.clone());
        }
        lines.extend(h.model_notes.iter().cloned());
        if let Some(floor) = h.entropy_floor {
            lines.push(format!("entropy floor of the data: {floor:.4} nats/token (the best possible loss)"));
        }
        if let Some(v) = h.validation {
            let what = if v.reads < v.split {
                format!("the first {} of the validation split's {} sequences", v.reads, v.split)
            } else {
                format!("{} sequences, going round the validation split's {} more than once", v.reads, v.split)
            };
            lines.push(format!(
                "validation loss: {what} (train.eval_batches × train.eval_batch_size); `ava eval {}` reads each once",
                super::train::shell_quote(&h.out_dir)
            ));
        }
        if let Some(from) = &h.resumed_from {
            lines.push(format!("resumed from {from}: continuing at step {}", h.first_step));
        }
        lines.push(format!("run directory: {}", h.out_dir));
        for l in lines {
            self.printer.note(&l);
        }
        for w in &h.warnings {
            self.printer.warn(w);
        }
        if self.printer.verbosity >= 1 && self.printer.format == Format::Text && h.max_steps >= h.first_step {
            let bar = ProgressBar::new(h.max_steps);
            bar.set_style(
                ProgressStyle::with_template("{bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}")
                    .expect("a valid template"),
            );
            bar.set_position(h.first_step - 1);
            self.bar = Some(bar);
        }
    }

    fn step(&mut self, r: &StepRecord) {
        // The clock starts after the first step of this invocation (it warms up).
        if self.started.is_none() {
            self.started = Some((Instant::now(), r.step));
        }
        crate::signals::step_under_way(r.step + 1);
        if let Some(bar) = &self.bar {
            bar.set_position(r.step);
            bar.set_message(format!(
                "loss {:.4} | {} tok/s | mem {}",
                r.loss,
                rate(r.tokens_per_sec),
                size(r.memory.peak)
            ));
        }
        if r.step.is_multiple_of(self.log_every) || r.step == 1 {
            let skipped = if r.skipped {
                format!(" (skipped: overflow, loss scale now {})", r.loss_scale)
            } else {
                String::new()
            };
            // What the RSS is, said on the first memory line only.
            let mut memory = r.memory.line(&r.memory_status);
            if std::mem::replace(&mut self.rss_said, true) {
                memory = memory.replace(ava_train::memory::RSS_NOTE, "");
            }
            self.line(&format!(
                "[step {}] loss {:.4} lr {:.2e} grad-norm {:.3} {} tok/s{skipped}\n[step {}] {}{}",
                self.position(r.step),
                r.loss,
                r.lr,
                r.grad_norm,
                rate(r.tokens_per_sec),
                r.step,
                memory,
                r.device_memory.map(|d| d.line()).unwrap_or_default()
            ));
        }
    }

    fn eval(&mut self, r: &EvalRecord) {
        let gap = match (r.entropy_floor, r.gap) {
            (Some(f), Some(g)) => format!(" — floor {f:.4}, {:.1}% above it", 100.0 * g),
            _ => String::new(),
        };
        self.line(&format!("[step {}] validation loss {:.4}{gap}", r.step, r.val_loss));
    }

    fn sample(&mut self, step: u64, text: &str, ended: bool) {
        let end = if ended { " (end of text)" } else { "" };
        let body: Vec<String> = text.lines().map(|l| format!("  | {l}")).collect();
        self.line(&format!("[step {step}] sample{end}:\n{}", body.join("\n")));
    }

    fn checkpoint(&mut self, step: u64, dir: &Path) {
        self.line(&format!("[step {step}] checkpoint {}", dir.display()));
    }

    fn warn(&mut self, message: &str) {
        match &self.bar {
            Some(bar) if !bar.is_hidden() => bar.println(format!("warning: {message}")),
            _ => self.printer.warn(message),
        }
    }

    fn memory_timeline(&mut self, step: u64, timeline: &Timeline, dir: &Path) {
        let (trace, _) = memory_trace_files(dir, step);
        let mut files = vec![trace.display().to_string()];
        let chart =
            super::memory_timeline::chart(step, timeline, self.memory_estimate, dir, &format!("step-{step}.memory"));
        if let Ok(charts) = &chart {
            files.extend(charts.iter().map(|f| f.display().to_string()));
        }
        let summary = super::memory_timeline::summary(step, timeline);
        self.line(&format!("{summary}\n  files: {}", files.join(", ")));
        if let Err(e) = chart {
            self.warn(&format!("--memory-trace: step {step}'s {e}; the run goes on"));
        }
    }

    fn finish(&mut self, _summary: &RunSummary) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }
}

/// `45s`, `3m 05s`, `2h 14m`.
pub(crate) fn duration(seconds: f64) -> String {
    let s = seconds.max(0.0).round() as u64;
    match s {
        s if s < 60 => format!("{s}s"),
        s if s < 3600 => format!("{}m {:02}s", s / 60, s % 60),
        s => format!("{}h {:02}m", s / 3600, (s % 3600) / 60),
    }
}

/// A rate with the digits that matter: 5693, 12.4, 0.33 (a 7B step on 2 cores is minutes).
pub(crate) fn rate(per_second: f64) -> String {
    match per_second {
        r if r >= 100.0 => format!("{r:.0}"),
        r if r >= 10.0 => format!("{r:.1}"),
        r => format!("{r:.2}"),
    }
}
