//! How the trainer tells the outside world what it is doing: the [`Reporter`] trait (the
//! CLI implements it with a progress bar and the printer) and the metrics records it
//! receives, which are also the JSON lines of `metrics.jsonl`.

use serde::Serialize;

use crate::memory::Breakdown;

/// One optimizer step, as reported and logged.
#[derive(Debug, Clone, Serialize)]
pub struct StepRecord {
    /// 1-based step.
    pub step: u64,
    /// Mean training cross-entropy over the step's micro-batches (nats/token).
    pub loss: f64,
    /// Load-balancing loss (MoE), unweighted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub aux_loss: Option<f64>,
    /// Learning rate used.
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Whether the update was skipped (f16 overflow, or `train.nan_policy: skip`).
    pub skipped: bool,
    /// Why a step was skipped under `train.nan_policy: skip` (its loss or gradient was not
    /// finite), as warned.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub nonfinite: Option<String>,
    /// Loss scale (f16), 1 otherwise.
    pub loss_scale: f64,
    /// Tokens processed per second in this step.
    pub tokens_per_sec: f64,
    /// Wall time of the step in seconds.
    pub step_seconds: f64,
    /// The memory breakdown measured over the step.
    pub memory: Breakdown,
    /// On a GPU run, the device's memory: `memory` is then of the device (its peak the
    /// pool's high-water mark), and this says what the whole card had in use.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub device_memory: Option<crate::memory::DeviceMemory>,
    /// The memory policy's pressure word (normal, target, warning, critical, emergency).
    pub memory_status: String,
    /// Micro-batch size in effect (the policy may shrink it).
    pub micro_batch: usize,
    /// Micro-steps abandoned for running out of memory, each followed by a retry of the
    /// step at half the micro-batch.
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub backoffs: Vec<Backoff>,
    /// The memory policy's decisions at this step, as logged (empty when it said nothing).
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub memory_events: Vec<String>,
    /// The most host memory the offload tier held during the step (parked block inputs,
    /// streamed optimizer state in flight); 0 when nothing went through it.
    #[serde(skip_serializing_if = "is_zero", default)]
    pub offload_bytes: u64,
    /// Stage 2's reduce-scatter during backward (several ranks only): how long it ran and
    /// how much of it held training up.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub communication: Option<crate::dist::CommTimes>,
    /// Each rank's peak memory over the step, by rank (several ranks only; `memory` is
    /// rank 0's).
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub rank_peaks: Vec<u64>,
    /// The optimizer state streamed through the tier this step: bytes each way and the
    /// seconds the step waited on it; absent when no state is offloaded.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub stream: Option<super::StreamStats>,
    /// With `data.mix`: the training tokens each corpus has given since step 1.
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub tokens_by_source: Vec<SourceTokens>,
}

/// Training tokens one source of a mixture has given.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct SourceTokens {
    /// The corpus, as `data.mix` names it.
    pub source: String,
    /// Target tokens of its sequences trained on.
    pub tokens: u64,
}

/// A step's attempt abandoned because an allocation crossed `memory.hard_limit` (on a GPU:
/// the device ran out of memory, under the limit's capped pool or on the whole card).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Backoff {
    /// The micro-batch of the abandoned attempt.
    pub micro_batch: usize,
    /// The micro-batch of the retry.
    pub retry_micro_batch: usize,
    /// Bytes in use just after the allocation that crossed the limit (on a GPU, in the
    /// device pool once the failed allocation was refused).
    pub crossed_at: u64,
    /// Bytes in use before the attempt's first micro-step.
    pub held_before: u64,
    /// Bytes in use once the attempt's partial gradients and graph were dropped.
    pub held_after: u64,
}

/// One evaluation.
#[derive(Debug, Clone, Serialize)]
pub struct EvalRecord {
    /// After this step.
    pub step: u64,
    /// Mean validation cross-entropy (nats/token).
    pub val_loss: f64,
    /// The data's entropy floor, when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub entropy_floor: Option<f64>,
    /// `val_loss / entropy_floor − 1`, when the floor is known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gap: Option<f64>,
}

/// What a run is about to do: printed before the first step.
#[derive(Debug, Clone, Serialize)]
pub struct RunHeader {
    /// Model parameters.
    pub params: usize,
    /// The data source, one line.
    pub data: String,
    /// Sequences per step (micro-batch × accumulation).
    pub effective_batch: usize,
    /// Tokens per step.
    pub tokens_per_step: usize,
    /// First step to run (1, or after the resumed one).
    pub first_step: u64,
    /// Last step of the schedule (`train.max_steps`).
    pub max_steps: u64,
    /// The step this invocation stops at (`--steps N` ends it before `max_steps`).
    pub last_step: u64,
    /// Plugins by kind: `attention standard`, ...
    pub plugins: Vec<(String, String)>,
    /// The checkpoint plan, one word per block.
    pub plan: Vec<String>,
    /// The run directory.
    pub out_dir: String,
    /// Resumed from this checkpoint.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resumed_from: Option<String>,
    /// Where the optimizer state lives, when some of it streams through an offload tier.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub offload: Option<String>,
    /// What model.from's config.json holds that Ava reads but that changes nothing.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub model_notes: Vec<String>,
    /// The entropy floor of the data (nats/token), when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub entropy_floor: Option<f64>,
    /// What the run's validation loss reads when that is not the whole validation split
    /// (`train.eval_batches × eval_batch_size` sequences of a corpus with more or fewer).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub validation: Option<ValidationReads>,
    /// Compute threads.
    pub threads: usize,
    /// Data-parallel ranks, ZeRO stage and this rank's share of the state (several ranks).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ranks: Option<String>,
    /// Where the run does not do what its config says, or lacks something (the budget
    /// preflight's smaller micro-batch, no validation data): one line each, shown as warnings.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

/// An evaluation's share of a validation split with an end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ValidationReads {
    /// Sequences each evaluation reads (`train.eval_batches × eval_batch_size`).
    pub reads: u64,
    /// Sequences one pass over the split holds.
    pub split: u64,
}

/// For `skip_serializing_if`: a number that is zero.
pub(crate) fn is_zero<T: Default + PartialEq>(n: &T) -> bool {
    *n == T::default()
}

/// Receives the trainer's progress. Every method has a default that does nothing.
pub trait Reporter {
    /// Before the first step.
    fn start(&mut self, _header: &RunHeader) {}
    /// After each step.
    fn step(&mut self, _record: &StepRecord) {}
    /// After each evaluation.
    fn eval(&mut self, _record: &EvalRecord) {}
    /// A sample of what the model writes (`train.sample_every`), and whether it ended at
    /// the end-of-text token.
    fn sample(&mut self, _step: u64, _text: &str, _ended: bool) {}
    /// After a checkpoint was written.
    fn checkpoint(&mut self, _step: u64, _dir: &std::path::Path) {}
    /// Something the user should know (memory policy messages, skipped steps).
    fn warn(&mut self, _message: &str) {}
    /// A step recorded allocation by allocation (`TrainOptions::memory_trace`), its files
    /// written into `dir`.
    fn memory_timeline(&mut self, _step: u64, _timeline: &crate::memory::timeline::Timeline, _dir: &std::path::Path) {}
    /// At the end.
    fn finish(&mut self, _summary: &RunSummary) {}
}

/// A reporter that ignores everything.
#[derive(Debug, Default)]
pub struct Silent;

impl Reporter for Silent {}

/// What a finished run did.
#[derive(Debug, Clone, Serialize)]
pub struct RunSummary {
    /// The last step completed.
    pub step: u64,
    /// The last training loss.
    pub loss: f64,
    /// The last validation loss.
    pub val_loss: Option<f64>,
    /// The entropy floor, when known.
    pub entropy_floor: Option<f64>,
    /// Mean tokens/s over the run's steps (after the first).
    pub tokens_per_sec: f64,
    /// The highest peak memory of any step.
    pub peak_bytes: u64,
    /// Each rank's highest peak (several ranks only).
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub rank_peak_bytes: Vec<u64>,
    /// The last checkpoint written.
    pub checkpoint: Option<String>,
    /// The Hugging Face folder with the final weights.
    pub model_dir: Option<String>,
    /// Why the run stopped early, if it did (memory policy).
    pub stopped: Option<String>,
    /// Whether the run stopped because [`TrainOptions::stop`](super::TrainOptions) asked it
    /// to (after saving a checkpoint of the last completed step).
    pub interrupted: bool,
    /// With `interrupted`: the wait outside a step's work that the stop ended (the data
    /// loader, the other ranks), as a message; `None` when the stop came between steps.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub interrupted_while: Option<String>,
    /// With `data.mix`: the training tokens each corpus gave over the run (from step 1).
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub tokens_by_source: Vec<SourceTokens>,
}
