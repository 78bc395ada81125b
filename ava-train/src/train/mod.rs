//! The training loop: micro-batches with gradient accumulation, mixed precision with f32
//! master weights (in memory or in a tier) or with bf16/f16 weights only, the optimizer
//! step after backward or inside it, warmup + cosine learning rate, gradient clipping, evaluation, memory
//! accounting against the budget with the memory policy in the loop, checkpoints and exact
//! resume. Progress goes to a [`Reporter`]; metrics to `metrics.jsonl`.

mod fault;
mod in_backward;
pub mod metrics;
mod optim;
mod preflight;
mod reporter;
pub mod rounding;
mod schedule;
pub mod tensorboard;
mod trainer;

use std::path::PathBuf;

pub use optim::{
    COMPENSATION, HostState, MASTER, MODEL_OPTIONS, OptimizerState, PinnedHome, Placement, StateBuffer, StepSession,
    StreamStats, optimizer_options, step_param, streamed_params,
};
pub use preflight::{Preflight, fit_budget};
pub(crate) use reporter::is_zero;
pub use reporter::{
    Backoff, EvalRecord, Reporter, RunHeader, RunSummary, Silent, SourceTokens, StepRecord, ValidationReads,
};
pub use schedule::{LossScaler, learning_rate};
pub use trainer::{
    IO_PROGRESS_BYTES, IoProgress, IoProgressFn, MEMORY_DIR, TrainOptions, Trainer, Work, WorkProgress, WorkProgressFn,
    check_training_modes, data_options, memory_trace_files, model_spec, resolve_threads,
};

/// What can stop a training run.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The data could not be opened or read.
    #[error(transparent)]
    Data(Box<crate::data::DataError>),
    /// The model could not be built or loaded.
    #[error(transparent)]
    Model(Box<crate::model::ModelError>),
    /// A checkpoint could not be written or read.
    #[error(transparent)]
    Save(Box<crate::save::SaveError>),
    /// A plugin could not be created.
    #[error(transparent)]
    Host(Box<ava_plugins::HostError>),
    /// A plugin returned an error.
    #[error("plugin '{plugin}' failed in {what}: {message}")]
    Plugin {
        /// The plugin's name.
        plugin: String,
        /// The call.
        what: &'static str,
        /// Its error.
        message: String,
    },
    /// The settings cannot work together.
    #[error("{0}")]
    Invalid(String),
    /// `train.device` cannot be used.
    #[error(transparent)]
    Device(#[from] crate::device::DeviceError),
    /// Before step 1: the estimator predicts more than `memory.budget` even at the smallest
    /// micro-batch the run can use (see [`fit_budget`]).
    #[error(
        "memory.budget is {}, but this step needs {} even at micro-batch {micro_batch} (estimated; `ava estimate` \
         shows where it goes){}: raise memory.budget, or change what the step holds (`ava plan --budget {}` with \
         this config searches the settings that fit)",
        ava_core::format_size(*budget),
        ava_core::format_size(*needed),
        if *in_backward { " — with train.step_in_backward the micro-batch cannot be split" } else { "" },
        crate::budget_arg(*budget)
    )]
    BudgetTooSmall {
        /// `memory.budget`.
        budget: u64,
        /// The smallest estimated peak.
        needed: u64,
        /// The micro-batch it was estimated at.
        micro_batch: usize,
        /// The micro-batch could not be split (`train.step_in_backward`).
        in_backward: bool,
    },
    /// Out of memory at the smallest micro-batch: nothing left to back off to.
    #[error(
        "out of memory at step {step}: an allocation took the count to {} over memory.hard_limit ({}) with the \
         micro-batch at {micro_batch}, the smallest it can be halved to; lower data.seq_len, recompute \
         activations (plugins.checkpoint: full), pick an optimizer with less state (e.g. adam-8bit), or raise \
         memory.hard_limit",
        ava_core::format_size(*at),
        ava_core::format_size(*limit)
    )]
    OutOfMemory {
        /// The step that could not run.
        step: u64,
        /// Its micro-batch.
        micro_batch: usize,
        /// The limit.
        limit: u64,
        /// Bytes in use after the crossing allocation.
        at: u64,
    },
    /// Out of memory inside a step whose parameters are stepped in backward: some had been
    /// stepped already, so the step can neither be retried nor saved.
    #[error(
        "out of memory at step {step}: an allocation took the count to {} over memory.hard_limit ({}) inside \
         backward, and with train.step_in_backward some parameters had already been stepped, so the step can be \
         neither retried at a smaller micro-batch nor saved. Nothing of it was written: the last checkpoint (step \
         {saved}, if one was saved) is intact, resume from it with --resume latest after lowering \
         train.micro_batch_size or data.seq_len, recomputing activations (plugins.checkpoint: full), or raising \
         memory.hard_limit",
        ava_core::format_size(*at),
        ava_core::format_size(*limit)
    )]
    OutOfMemoryInBackward {
        /// The step that could not run.
        step: u64,
        /// The limit.
        limit: u64,
        /// Bytes in use after the crossing allocation.
        at: u64,
        /// The last completed step.
        saved: u64,
    },
    /// An error inside a step whose parameters are stepped in backward (a disk tier that
    /// failed, a plugin): some may have been stepped, so it can neither be retried nor saved.
    #[error(
        "step {step} failed inside backward: {source}\nWith train.step_in_backward some parameters may already have \
         been stepped, so nothing of the step was saved: the last checkpoint (step {saved}, if one was saved) is intact. \
         Fix the cause above, then resume from it with --resume latest"
    )]
    FailedInBackward {
        /// The step that failed.
        step: u64,
        /// The last completed step.
        saved: u64,
        /// What failed.
        source: Box<TrainError>,
    },
    /// A non-finite loss or gradient under `train.nan_policy: stop`, or after too many
    /// skipped steps in a row under `skip`: nothing of the step was applied or saved.
    #[error("{}", non_finite_message(*step, what, *skipped, checkpoint.as_deref()))]
    NonFinite {
        /// The step whose loss or gradient was not finite.
        step: u64,
        /// What was not finite, e.g. "the loss is NaN".
        what: String,
        /// Steps skipped in a row before this one (under `skip`).
        skipped: u64,
        /// The last checkpoint saved, to resume from.
        checkpoint: Option<PathBuf>,
    },
    /// A non-finite gradient inside a step whose parameters are stepped in backward; always
    /// the source of a [`TrainError::FailedInBackward`], which says what was saved.
    #[error(
        "{what} at step {step}: lower train.lr (or set train.grad_clip with \
         train.step_in_backward: false), and check the data and the initial weights"
    )]
    NonFiniteInBackward {
        /// The step.
        step: u64,
        /// What was not finite.
        what: String,
    },
    /// A checkpoint's optimizer state does not fit the optimizer.
    #[error(
        "{}the checkpoint's optimizer state does not match the optimizer{}:\n  - {}\nresume with the optimizer and \
         options it was trained with, or keep its weights and start the optimizer state afresh with \
         --fresh-optimizer",
        file.as_ref().map_or(String::new(), |f| format!("{}: ", f.display())),
        trained_with.as_ref().map_or(String::new(), |o| format!(" (it was trained with {o})")),
        problems.join("\n  - ")
    )]
    OptimizerState {
        /// The mismatches, summarized: one line per kind of buffer.
        problems: Vec<String>,
        /// The optimizer the checkpoint names, when known.
        trained_with: Option<String>,
        /// The checkpoint's optimizer-state file, when known.
        file: Option<PathBuf>,
    },
    /// Resuming a run that already reached `train.max_steps`.
    #[error(
        "{} is at step {step}, and train.max_steps is {max_steps}: the run is finished, nothing is left to train. \
         To train it longer, resume with a larger train.max_steps (--set train.max_steps=N: the learning-rate \
         schedule then runs to the new end)",
        checkpoint.display()
    )]
    Finished {
        /// The checkpoint.
        checkpoint: PathBuf,
        /// Its step.
        step: u64,
        /// The configured last step.
        max_steps: u64,
    },
    /// Resuming with a config that changes the model or the plugins.
    #[error(
        "refusing to resume from {}: the config differs from the one it was trained with:\n  - {}\n\
         resume with the checkpoint's settings (its ava-config.json), or {}",
        checkpoint.display(),
        differences.join("\n  - "),
        resume_anyway(differences)
    )]
    ConfigChanged {
        /// The checkpoint.
        checkpoint: PathBuf,
        /// `key: saved -> current` lines.
        differences: Vec<String>,
    },
    /// Writing the run directory.
    #[error("{}: {message}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        message: String,
    },
    /// A tensor operation failed.
    #[error("tensor operation failed: {0}")]
    Candle(String),
    /// The GPU could not allocate: the step (or the building of the run) failed where it
    /// was, before anything was saved.
    #[error("{}", device_out_of_memory_message(*step, *limit, detail))]
    DeviceOutOfMemory {
        /// The step that could not run; `None` while the run was built (the model and its
        /// optimizer state moved to the device).
        step: Option<u64>,
        /// `memory.hard_limit`, when one caps the device's pool.
        limit: Option<u64>,
        /// The failing operation's own words.
        detail: String,
    },
    /// Another rank failed or the ranks disagree.
    #[error(transparent)]
    Dist(#[from] crate::dist::DistError),
}

/// The message of [`TrainError::NonFinite`].
fn non_finite_message(step: u64, what: &str, skipped: u64, checkpoint: Option<&std::path::Path>) -> String {
    let streak = if skipped > 0 {
        format!(
            ", after {skipped} steps in a row skipped for the same reason (train.nan_policy: skip stops after {})",
            crate::config::NanPolicy::MAX_CONSECUTIVE_SKIPS
        )
    } else {
        String::new()
    };
    let resume = match checkpoint {
        Some(dir) => format!(
            "the last checkpoint, {}, is intact: resume from it with --resume latest after the change (or from \
             an earlier one, --resume DIR, if the loss was already climbing before it)",
            dir.display()
        ),
        None => "no checkpoint was saved yet: start again after the change".to_string(),
    };
    format!(
        "step {step}: {what}{streak}. Nothing of the step was applied or saved; {resume}. Lower train.lr (or set \
         train.grad_clip), and check the data and the initial weights (model.from, or the checkpoint resumed from)"
    )
}

/// The message of [`TrainError::DeviceOutOfMemory`]: when, under which limit, what was
/// saved, and what to change.
fn device_out_of_memory_message(step: Option<u64>, limit: Option<u64>, detail: &str) -> String {
    let when = match step {
        Some(step) => format!("at step {step}"),
        None => "while the run was built (the model and its optimizer state moved to the device)".to_string(),
    };
    let under = match limit {
        Some(bytes) => format!(
            " under memory.hard_limit ({}), the most this run's device allocations may hold",
            crate::config::ByteSize(bytes)
        ),
        None => String::new(),
    };
    let raise = if limit.is_some() { ", or raise memory.hard_limit (up to the card's memory)" } else { "" };
    match step {
        Some(_) => format!(
            "the GPU ran out of memory {when}{under} ({detail}). Nothing of this step was saved or applied: the run \
             stops with its last completed step saved, if it completed one. Make the step smaller: lower \
             train.micro_batch_size or data.seq_len, \
             recompute activations (plugins.checkpoint: full), or hold less state on the card (train.master_weights: \
             none){raise}; then run again, or resume with --resume latest"
        ),
        None => format!(
            "the GPU ran out of memory {when}{under} ({detail}). Nothing was trained or saved. Hold less on the card: \
             train.master_weights: none (bf16 or f16 weights only), or a smaller model{raise}"
        ),
    }
}

/// The wrapped errors are boxed: they are large, and `TrainError` travels through every
/// `Result` of the training loop.
macro_rules! boxed_from {
    ($($variant:ident: $ty:ty),*) => {$(
        impl From<$ty> for TrainError {
            fn from(e: $ty) -> Self {
                Self::$variant(Box::new(e))
            }
        }
    )*};
}
boxed_from!(Data: crate::data::DataError, Model: crate::model::ModelError, Save: crate::save::SaveError, Host: ava_plugins::HostError);

/// Whether an error's text is a CUDA allocation that failed for want of device memory
/// (cudarc's `CUDA_ERROR_OUT_OF_MEMORY`, wherever candle or a plugin passed it on).
pub(crate) fn says_out_of_device_memory(text: &str) -> bool {
    text.contains("CUDA_ERROR_OUT_OF_MEMORY")
}

impl TrainError {
    /// `e` as [`TrainError::DeviceOutOfMemory`] when a CUDA allocation failed inside it
    /// (cudarc's `CUDA_ERROR_OUT_OF_MEMORY`, however deep in the step, or in building the run
    /// when `step` is `None`), under `limit` (`memory.hard_limit` on the device) if one is
    /// set; otherwise `e`.
    pub(crate) fn device_out_of_memory(step: Option<u64>, limit: Option<u64>, e: TrainError) -> TrainError {
        let text = e.to_string();
        if says_out_of_device_memory(&text) { TrainError::DeviceOutOfMemory { step, limit, detail: text } } else { e }
    }

    pub(crate) fn candle(e: candle_core::Error) -> Self {
        Self::Candle(e.to_string())
    }
    pub(crate) fn io(path: impl Into<PathBuf>, e: impl std::fmt::Display) -> Self {
        Self::Io { path: path.into(), message: e.to_string() }
    }
}

/// How to resume past [`TrainError::ConfigChanged`]'s differences: `--force`, and
/// `--fresh-optimizer` when the optimizer changed (its state cannot carry over), alone when
/// that is all that changed.
fn resume_anyway(differences: &[String]) -> String {
    let optimizer = differences.iter().any(|d| d.starts_with("plugins.optimizer"));
    let others = differences.iter().any(|d| !d.starts_with("plugins.optimizer"));
    match (optimizer, others) {
        (true, false) => "pass --fresh-optimizer to train on with the new optimizer (the weights are kept, its \
                          state starts afresh)"
            .into(),
        (true, true) => "pass --force --fresh-optimizer to resume anyway (the optimizer changed too: the weights are \
                         kept, its state starts afresh)"
            .into(),
        _ => "pass --force to resume anyway".into(),
    }
}

#[cfg(test)]
mod oom_tests {
    use super::TrainError;

    /// A CUDA allocation failure, however deep, is said as the GPU running out of memory at
    /// the step, with what to change; any other error passes through unchanged.
    #[test]
    fn a_device_allocation_failure_is_said_plainly() {
        let cuda = || TrainError::Candle("DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")".into());
        let text = TrainError::device_out_of_memory(Some(7), None, cuda()).to_string();
        assert!(
            text.starts_with("the GPU ran out of memory at step 7 (tensor operation failed: DriverError("),
            "{text}"
        );
        for hint in
            ["Nothing of this step was saved", "train.micro_batch_size", "plugins.checkpoint: full", "--resume latest"]
        {
            assert!(text.contains(hint), "{text}");
        }
        assert!(!text.contains("hard_limit"), "no limit, none named: {text}");
        let other = TrainError::device_out_of_memory(Some(7), None, TrainError::Invalid("bad".into()));
        assert!(matches!(other, TrainError::Invalid(ref m) if m == "bad"));
    }

    /// Under `memory.hard_limit` the message names the limit and its value, says nothing was
    /// saved and what to lower, and that the limit may be raised; when the run's build ran
    /// out, it says nothing was trained.
    #[test]
    fn running_out_under_a_hard_limit_names_it() {
        let cuda = || TrainError::Candle("DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")".into());
        let text = TrainError::device_out_of_memory(Some(3), Some(24 << 30), cuda()).to_string();
        assert!(
            text.starts_with(
                "the GPU ran out of memory at step 3 under memory.hard_limit (24GiB), the most this run's device \
                 allocations may hold (tensor operation failed: DriverError("
            ),
            "{text}"
        );
        for hint in [
            "Nothing of this step was saved",
            "train.micro_batch_size",
            "plugins.checkpoint: full",
            "or raise memory.hard_limit (up to the card's memory)",
            "--resume latest",
        ] {
            assert!(text.contains(hint), "{text}");
        }
        let text = TrainError::device_out_of_memory(None, Some(64 << 20), cuda()).to_string();
        assert!(
            text.starts_with(
                "the GPU ran out of memory while the run was built (the model and its optimizer state moved to the \
                 device) under memory.hard_limit (64MiB)"
            ),
            "{text}"
        );
        assert!(text.contains("Nothing was trained or saved") && text.contains("raise memory.hard_limit"), "{text}");
    }
}
