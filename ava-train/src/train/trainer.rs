//! [`Trainer`]: builds the run from a config (data, model, plugins, state), runs the steps,
//! evaluates, measures memory, saves checkpoints and resumes from them exactly.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use ava_core::{
    BlockDecision, CheckpointContext, MemoryAction, MemoryPolicy, MemoryStats, OffloadTier, Optimizer, Phase,
    PluginKind,
};
use ava_plugins::{Registry, Source as PluginSource};
use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::TrainError;
use super::fault::FailingTier;
use super::in_backward::{StepInBackward, StepSettings};
use super::optim::{HostState, OptimizerState, Placement, StreamStats, optimizer_options};
use super::reporter::{
    Backoff, EvalRecord, Reporter, RunHeader, RunSummary, SourceTokens, StepRecord, ValidationReads,
};
use super::schedule::{LossScaler, learning_rate};
use crate::config::{Config, DataSource, MasterWeights, NanPolicy, PluginSelection, Precision};
use crate::data::{self, Batch, DataOptions, Dataset, Loader, MarkovSpec, Packing, Share, Source, Split};
use crate::dist::{Collectives, Gathered, ReduceInBackward, Single, Zero};
use crate::memory::{self, Breakdown};
use crate::model::{self, Documents, GradSink, Grads, Model, ModelSpec, Parking, Weights, forward_backward};
use crate::save::{CheckpointStore, FileBody, LoadedCheckpoint, NamedBuffer, differing_keys, safetensors_views};

mod batch;
mod build;
mod checks;
mod memory_trace;
mod meter;
mod progress;
mod resume;
mod run_loop;
mod save;
mod step;

use batch::*;
use checks::*;
pub use checks::{
    check_attention, check_samples, check_training_modes, data_options, model_spec, resolve_threads, storage_dtype,
};
pub use memory_trace::{MEMORY_DIR, files as memory_trace_files};
use meter::Meter;
pub use progress::{IO_PROGRESS_BYTES, IoProgress, IoProgressFn, Work, WorkProgress, WorkProgressFn};
use resume::*;

/// How a run starts.
#[derive(Debug, Clone, Default)]
pub struct TrainOptions {
    /// Resume from `latest` or a checkpoint directory.
    pub resume: Option<String>,
    /// Resume even when the config changes the model or plugins.
    pub force: bool,
    /// Resume without the checkpoint's optimizer state: the optimizer starts afresh (and may
    /// be another one than the checkpoint's, without `force`).
    pub fresh_optimizer: bool,
    /// Run at most this many steps in this invocation (the schedule still ends at
    /// `train.max_steps`), e.g. to split a run into sessions.
    pub steps: Option<u64>,
    /// Test hook: the first micro-step of this step runs out of memory, as if an allocation
    /// had crossed `memory.hard_limit` (needs the counting allocator).
    pub oom_at_step: Option<u64>,
    /// Test hook: in this step, after as many writes to the offload tier as half the model's
    /// parameters, every write fails as on a full disk (the failure lands in the middle of
    /// the step, after some parameters were stepped).
    pub tier_fault_at_step: Option<u64>,
    /// Test hook: in these steps one parameter's gradient is NaN (the last one to be stepped
    /// after backward; with `train.step_in_backward`, the second one stepped inside it).
    pub nan_grad_at_steps: Option<std::ops::Range<u64>>,
    /// Set from outside (e.g. a signal handler) to ask the run to stop: it finishes the
    /// step under way, saves a checkpoint and returns with [`RunSummary::interrupted`]. A
    /// wait outside the step's work (the data loader, the other ranks) gives up within a
    /// second of it being set: see [`RunSummary::interrupted_while`].
    pub stop: Option<Arc<AtomicBool>>,
    /// Test hook: the data loader never delivers this batch (as if reading it hung), so the
    /// run blocks waiting for it until [`TrainOptions::stop`] is set.
    pub stall_loader_at_batch: Option<u64>,
    /// The ranks this process trains with (`crate::dist::join` under `mpirun`); alone
    /// when `None`.
    pub group: Option<Arc<dyn Collectives>>,
    /// Told how far a checkpoint's save or load is, about every [`IO_PROGRESS_BYTES`].
    pub io_progress: Option<IoProgressFn>,
    /// Told after each micro-batch of a step and each batch of an evaluation, so a long one
    /// can show it is under way.
    pub work_progress: Option<WorkProgressFn>,
    /// Steps to record allocation by allocation (`ava train --memory-trace`): written into
    /// the run directory's `memory/` and handed to [`Reporter::memory_timeline`]. Rank 0 of a
    /// CPU run records; elsewhere they are ignored (the CLI refuses them on a GPU).
    pub memory_trace: Vec<u64>,
}

/// Files of a checkpoint directory.
const MODEL_FILE: &str = "model.safetensors";
const HF_CONFIG_FILE: &str = "config.json";
const OPTIMIZER_FILE: &str = "optimizer.safetensors";
const TRAINER_FILE: &str = "trainer.json";
const AVA_CONFIG_FILE: &str = "ava-config.json";

/// The config keys whose change makes a checkpoint's state meaningless. Where the state is
/// placed (`plugins.offload`, `offload`) is not one: a checkpoint holds all of it, so a run
/// may resume with another disk, or with more of its state in memory.
const STRUCTURAL_KEYS: &[&str] = &[
    "model",
    "plugins.attention",
    "plugins.optimizer",
    "plugins.checkpoint",
    "plugins.memory",
    "data.source",
    "data.path",
    "data.tokenizer",
    "data.mix",
    "data.packing",
    "data.seq_len",
    "data.synthetic",
    "train.seed",
    "train.micro_batch_size",
    "train.gradient_accumulation_steps",
    "train.precision",
    "train.master_weights",
];

/// Whether `e` is a wait outside the step's work given up because the stop flag was set.
fn stopped_waiting(e: &TrainError) -> bool {
    match e {
        TrainError::Data(d) => matches!(**d, data::DataError::Stopped { .. }),
        TrainError::Dist(d) => matches!(d, crate::dist::DistError::Stopped { .. }),
        _ => false,
    }
}

/// A training run.
pub struct Trainer {
    config: Config,
    model: Model,
    optimizer: Box<dyn Optimizer>,
    state: OptimizerState,
    plan: Vec<BlockDecision>,
    /// Where `Offload` blocks' inputs wait for backward: the offload tier, or on a GPU with
    /// `ram` page-locked host memory (`model::Parking`).
    parking: Parking,
    /// Whether the offload tier is a loaded library, whose memory the counting allocator
    /// does not see (a built-in tier's it does).
    offload_foreign: bool,
    /// How the optimizer state is placed, one line for the run's header.
    offload_note: Option<String>,
    /// Fields of model.from's config.json read and found to change nothing.
    model_notes: Vec<String>,
    memory_policy: Box<dyn MemoryPolicy>,
    dataset: Arc<dyn Dataset>,
    loader: Loader,
    store: CheckpointStore,
    step: u64,
    scaler: LossScaler,
    split: usize,
    /// The split the preflight found the budget needs: the memory policy's restores stop there.
    fitted_split: usize,
    /// Told how far a checkpoint's save is.
    io_progress: Option<IoProgressFn>,
    /// Told how far a step or an evaluation is.
    work_progress: Option<WorkProgressFn>,
    /// With `train.sample_every`: the run's tokenizer, the token samples start from, and the
    /// end-of-text id they stop at.
    sampling: Option<(ava_data::Tokenizer, u32, Option<u32>)>,
    /// What the run does otherwise than its config may suggest (the preflight's smaller
    /// micro-batch, a tier that holds nothing, no validation data): the header's warnings.
    warnings: Vec<String>,
    compute: DType,
    threads: usize,
    resumed_from: Option<PathBuf>,
    out_dir: PathBuf,
    /// The loader's position after the last completed step (what a checkpoint records: a
    /// step that ran out of memory at its smallest micro-batch has read its batches).
    data_position: u64,
    /// [`TrainOptions::oom_at_step`], until it fires.
    oom_at_step: Option<u64>,
    /// [`TrainOptions::tier_fault_at_step`]: the wrapped tier, armed when that step starts.
    tier_fault: Option<(Arc<FailingTier>, u64)>,
    /// [`TrainOptions::nan_grad_at_steps`].
    nan_grad_at_steps: Option<std::ops::Range<u64>>,
    /// Steps skipped in a row for a non-finite loss or gradient (`train.nan_policy: skip`).
    skipped_in_a_row: u64,
    /// The ranks and which parameters each steps (one rank when alone).
    /// Shared with stage 3's [`Gathered`] weights, which live through a step.
    zero: Rc<Zero>,
    /// Weights some ranks may have changed since the last gather (masters of a resumed
    /// checkpoint turned into weights by their owners): gathered before the first step,
    /// not while the run is built, when the ranks have yet to agree that all of them started.
    gather_pending: bool,
    /// Where the run computes (opened once when the run is built), what the run holds there and
    /// its limit, on the host or the device. Last, so that on a GPU
    /// with `memory.hard_limit` its capped pool is dropped after the model and the state
    /// (dropping it destroys the pool and gives the device its default pool back).
    meter: Meter,
}

/// What the memory policy's decision asks of the run loop.
#[derive(Debug, Default)]
struct PolicyOutcome {
    /// Save a checkpoint now.
    checkpoint: bool,
    /// Stop, for this reason (after saving).
    stop: Option<String>,
}

impl std::fmt::Debug for Trainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer").field("step", &self.step).field("out_dir", &self.out_dir).finish_non_exhaustive()
    }
}

impl Trainer {
    /// Builds a run: opens the data, creates the plugins, builds or loads the model,
    /// allocates the optimizer state, asks the checkpoint policy for its plan, and, when
    /// resuming, restores everything from the checkpoint.
    pub fn new(config: &Config, registry: &Registry, options: &TrainOptions) -> Result<Self, TrainError> {
        let config = config.clone();
        // First, where it computes: nothing is read or allocated for a device that cannot be used.
        let device = crate::device::open(config.train.device)?;
        let group: Arc<dyn Collectives> = options.group.clone().unwrap_or_else(|| Arc::new(Single));
        let world = group.size();
        crate::device::check_run(&config, world, registry)?;
        check_training_modes(&config, world)?;
        check_hard_limit(&config)?;
        // On a GPU the hard limit caps the device's pool before anything of the run is there;
        // running out while the run is built (the model, the optimizer state) says so.
        let device_limit = crate::device::limit(&device, &config)?;
        let limit = device_limit.as_ref().map(crate::device::DeviceLimit::bytes);
        Self::build(config, registry, options, device, group, device_limit)
            .map_err(|e| TrainError::device_out_of_memory(None, limit, e))
    }

    /// The model.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// Every parameter's values by Hugging Face name, in their stored type. At ZeRO stage 3
    /// they are gathered from the ranks holding them (every rank must call this); otherwise
    /// they are this rank's own tensors.
    pub fn consolidated_weights(&self) -> Result<Vec<(String, Tensor)>, TrainError> {
        if self.zero.stage() < 3 || self.zero.size() == 1 {
            return Ok(self.model.named_tensors());
        }
        let params = self.model.params();
        let ids: Vec<usize> = (0..params.len()).collect();
        let values = self.zero.gather_some(params, &ids)?;
        Ok(params.iter().zip(values).map(|(p, t)| (p.def.name.clone(), t)).collect())
    }

    /// Steps completed.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The micro-batch in effect.
    pub fn micro_batch(&self) -> usize {
        self.config.train.micro_batch_size / self.split
    }

    /// The loader's position (training batches read) after the last completed step.
    pub fn data_position(&self) -> u64 {
        self.data_position
    }

    /// The optimizer state.
    pub fn optimizer_state(&self) -> &OptimizerState {
        &self.state
    }

    /// The checkpoint plan in effect.
    pub fn plan(&self) -> &[BlockDecision] {
        &self.plan
    }

    /// What the run is about to do.
    pub fn header(&self) -> RunHeader {
        let t = &self.config.train;
        RunHeader {
            params: self.model.spec().num_params(),
            data: self.dataset.describe(),
            effective_batch: self.global_batch(),
            tokens_per_step: self.global_batch() * self.config.data.seq_len,
            first_step: self.step + 1,
            max_steps: t.max_steps,
            last_step: t.max_steps,
            plugins: PluginKind::ALL
                .iter()
                .map(|k| (k.as_str().to_string(), self.config.selection(*k).to_string()))
                .collect(),
            plan: self.plan.iter().map(|d| d.as_str().to_string()).collect(),
            out_dir: self.out_dir.display().to_string(),
            resumed_from: self.resumed_from.as_ref().map(|p| p.display().to_string()),
            offload: self.offload_note.clone(),
            model_notes: self.model_notes.clone(),
            entropy_floor: self.dataset.entropy_floor_nats(),
            validation: self.validation_reads(),
            threads: self.threads,
            warnings: self.warnings.clone(),
            ranks: (self.zero.size() > 1).then(|| {
                let z = &self.zero;
                let weights = (z.stage() >= 3).then(|| {
                    let all = (self.model.spec().num_params() * self.model.storage().size_in_bytes()) as u64;
                    format!(
                        ", and {} of the {} of weights (each block's gathered as it runs)",
                        ava_core::format_size(self.held_weight_bytes()),
                        ava_core::format_size(all)
                    )
                });
                format!(
                    "{} ranks over {}, ZeRO stage {}: rank 0 holds {} of the {} of optimizer state{}",
                    z.size(),
                    z.group().describe(),
                    z.stage(),
                    ava_core::format_size(self.state.held_bytes()),
                    ava_core::format_size(self.state.bytes()),
                    weights.unwrap_or_default()
                )
            }),
        }
    }

    /// The maximum of each flag over the ranks.
    fn agreed_flags<const N: usize>(&self, mut flags: [u64; N]) -> Result<[u64; N], TrainError> {
        self.zero.agree(&mut flags)?;
        Ok(flags)
    }

    /// Sequences per optimizer step over all ranks.
    fn global_batch(&self) -> usize {
        self.config.train.effective_batch() * self.zero.size()
    }

    /// The ranks, and which parameters this one steps.
    pub fn zero(&self) -> &Zero {
        &self.zero
    }

    fn metrics_path(&self) -> PathBuf {
        self.out_dir.join(super::metrics::METRICS_FILE)
    }

    /// Opens `metrics.jsonl` for appending; a resumed run first drops the records of steps
    /// after the checkpoint (they belong to the abandoned continuation), reading the file
    /// backwards from its end, and a fresh run empties it.
    /// Through the run directory's handle: a link, FIFO or device planted as `metrics.jsonl`
    /// is refused, never followed or cut.
    fn open_metrics(&self) -> Result<std::fs::File, TrainError> {
        use ava_fs::dirfd::{Access, Dir};
        use std::io::{Seek, SeekFrom};
        let path = self.metrics_path();
        let mut file = Dir::open(&self.out_dir)
            .and_then(|dir| dir.open_file(super::metrics::METRICS_FILE, Access::ReadWriteCreate, 0o644))
            .map_err(|e| TrainError::Invalid(e.to_string()))?;
        if self.step == 0 || self.resumed_from.is_some() {
            super::metrics::keep_steps_up_to(&file, self.step).map_err(|e| TrainError::io(&path, e))?;
        }
        // Records are appended (this process is the run directory's only writer: its lock).
        file.seek(SeekFrom::End(0)).map_err(|e| TrainError::io(&path, e))?;
        Ok(file)
    }

    /// The run's TensorBoard event file (`train.log.tensorboard`), opened as `metrics.jsonl` is:
    /// a resumed run first drops the events of steps after its checkpoint, a fresh run all of
    /// them, with the key on or off (so no earlier run's events outlive the steps they were
    /// of). A failure is warned about and the run goes on without the events.
    fn open_tensorboard(&self, reporter: &mut dyn Reporter) -> super::tensorboard::Board {
        use super::tensorboard::{Board, EventWriter, keep_steps_up_to};
        let on = self.config.train.log.tensorboard;
        let dir = ava_fs::dirfd::Dir::open(&self.out_dir).map_err(|e| std::io::Error::other(e.to_string()));
        let opened = dir.and_then(|dir| {
            if on {
                EventWriter::open(&dir, self.step).map(|(w, _)| Some(w))
            } else {
                keep_steps_up_to(&dir, self.step).map(|_| None)
            }
        });
        match opened {
            Ok(writer) => Board::new(writer),
            Err(e) if on => {
                reporter.warn(&format!(
                    "TensorBoard events: could not open an event file in {} ({e}); the run goes on without them \
                     (metrics.jsonl has every metric; train.log.tensorboard: false turns them off)",
                    self.out_dir.display()
                ));
                Board::new(None)
            }
            Err(e) => {
                reporter.warn(&format!(
                    "TensorBoard events: could not drop the steps after {} from the event files in {} ({e}); they \
                     may show steps this run trains again (metrics.jsonl is exact)",
                    self.step,
                    self.out_dir.display()
                ));
                Board::new(None)
            }
        }
    }

    /// The weights a step (or, `detached`, an evaluation) computes with: all of them, cast
    /// to the compute type; at ZeRO stage 3, gathered block by block from their ranks.
    fn step_weights(&self, detached: bool) -> Result<Box<dyn Weights>, TrainError> {
        if self.zero.stage() >= 3 && self.zero.size() > 1 {
            let gathered = Gathered::new(Rc::clone(&self.zero), &self.model, self.compute, detached);
            return Ok(Box::new(gathered.map_err(TrainError::candle)?));
        }
        let weights = self.model.weights(self.compute).map_err(TrainError::candle)?;
        Ok(Box::new(if detached { weights.into_iter().map(|w| w.detach()).collect() } else { weights }))
    }

    /// Bytes of weights this rank holds between steps (at stage 3, its own parameters').
    fn held_weight_bytes(&self) -> u64 {
        let size = self.model.storage().size_in_bytes();
        let params = self.model.params();
        (0..params.len()).filter(|&i| self.zero.holds_values(i)).map(|i| (params[i].def.numel() * size) as u64).sum()
    }

    /// One optimizer step over `gradient_accumulation_steps` micro-batches.
    pub fn train_step(&mut self) -> Result<StepRecord, TrainError> {
        let step = self.step + 1;
        let limit = self.meter.device_limit();
        self.run_step().map_err(|e| TrainError::device_out_of_memory(Some(step), limit, e))
    }

    /// With `data.mix`: the training tokens each corpus has given, from the loader's
    /// position (global micro-batches of `micro_batch_size × ranks` sequences).
    fn tokens_by_source(&self) -> Vec<SourceTokens> {
        let sequences = self.loader.position() * (self.config.train.micro_batch_size * self.zero.size()) as u64;
        let per_sequence = self.config.data.seq_len as u64;
        let seen = self.dataset.sources_seen(sequences);
        seen.into_iter().map(|(source, n)| SourceTokens { source, tokens: n * per_sequence }).collect()
    }

    /// Whether the [`TrainOptions::nan_grad_at_steps`] hook poisons `step`'s gradients.
    fn poisoned(&self, step: u64) -> bool {
        self.nan_grad_at_steps.as_ref().is_some_and(|r| r.contains(&step))
    }

    /// `train.nan_policy` on a step whose loss or gradient is not finite: under `skip`, the
    /// warning the step's record carries (the caller leaves the state as it was); under
    /// `stop`, or after too many skipped steps in a row, the error that ends the run, naming
    /// the last checkpoint (nothing of this step is saved).
    fn non_finite(&mut self, step: u64, what: String) -> Result<String, TrainError> {
        let limit = NanPolicy::MAX_CONSECUTIVE_SKIPS;
        if self.config.train.nan_policy == NanPolicy::Skip && self.skipped_in_a_row + 1 < limit {
            self.skipped_in_a_row += 1;
            return Ok(format!(
                "step {step}: {what}; its optimizer update was skipped (train.nan_policy: skip; {} in a row, the \
                 run stops at {limit})",
                self.skipped_in_a_row
            ));
        }
        let skipped = if self.config.train.nan_policy == NanPolicy::Skip { self.skipped_in_a_row } else { 0 };
        Err(TrainError::NonFinite { step, what, skipped, checkpoint: self.store.latest()? })
    }

    /// Halves the micro-batch (each loaded batch is split into twice the pieces, so the
    /// samples and the effective batch stay the same); false when it cannot be halved, or
    /// when parameters step inside backward (halving needs accumulation). The memory policy
    /// and the out-of-memory back-off act through it.
    pub fn shrink_micro_batch(&mut self) -> bool {
        let configured = self.config.train.micro_batch_size;
        if !self.config.train.step_in_backward
            && configured / self.split > 1
            && configured.is_multiple_of(self.split * 2)
        {
            self.split *= 2;
            true
        } else {
            false
        }
    }

    /// Lets the memory policy see the step's numbers and applies its action. Each decision
    /// that does something is logged and kept in the step's record.
    fn apply_memory_policy(&mut self, record: &mut StepRecord, reporter: &mut dyn Reporter) -> PolicyOutcome {
        let configured = self.config.train.micro_batch_size;
        let stats = MemoryStats {
            current: memory::current(),
            peak: record.memory.peak,
            budget: self.config.memory.budget.0,
            phase: Phase::OptimizerStep,
            step: record.step,
            micro_batch: (configured / self.split) as u32,
            // What a restore may return to: the largest micro-batch that fits the budget.
            configured_micro_batch: (configured / self.fitted_split) as u32,
        };
        let decision = match self.memory_policy.observe(&stats) {
            Ok(d) => d,
            Err(e) => {
                reporter.warn(&format!("memory policy '{}' failed: {e}", self.config.plugins.memory.name));
                return PolicyOutcome::default();
            }
        };
        let message = decision.message.to_string();
        record.memory_status = decision.pressure.as_str().to_string();
        let mut outcome = PolicyOutcome::default();
        let shrink = |this: &mut Self| {
            let from = configured / this.split;
            if this.config.train.step_in_backward {
                format!(
                    "{message}; the micro-batch stays {from}: with train.step_in_backward a smaller one would need \
                     gradient accumulation (lower train.micro_batch_size, or recompute activations)"
                )
            } else if this.shrink_micro_batch() {
                format!(
                    "{message}; micro-batch {from} -> {} (the global batch stays {})",
                    configured / this.split,
                    this.config.train.effective_batch()
                )
            } else {
                format!("{message}; the micro-batch cannot shrink further")
            }
        };
        let event = match decision.action {
            MemoryAction::Continue => None,
            MemoryAction::Warn => Some(message.clone()),
            MemoryAction::ShrinkMicroBatch => Some(shrink(self)),
            MemoryAction::CheckpointAndShrink => {
                outcome.checkpoint = true;
                Some(shrink(self))
            }
            // Not past the micro-batch the preflight found fits.
            MemoryAction::RestoreMicroBatch => (self.split > self.fitted_split).then(|| {
                self.split /= 2;
                format!("{message}; micro-batch back to {}", configured / self.split)
            }),
            MemoryAction::ClearCaches => Some(format!("{message} (the CPU engine holds no caches to clear)")),
            MemoryAction::StopWithCheckpoint => {
                outcome.stop = Some(format!("memory policy: {message}"));
                Some(message.clone())
            }
        };
        if let Some(event) = event {
            if decision.action != MemoryAction::StopWithCheckpoint {
                reporter.warn(&event); // a stop is reported by the summary
            }
            record.memory_events.push(event);
        }
        outcome
    }

    /// How many sequences an evaluation reads of how many the validation split holds, where
    /// that is not the whole split of a corpus with an end: `ava eval` reads the whole split,
    /// and the two losses then differ.
    fn validation_reads(&self) -> Option<ValidationReads> {
        if self.dataset.missing_validation().is_some() {
            return None;
        }
        let split = self.dataset.sequences_per_pass(Split::Validation, self.config.data.seq_len)?;
        let reads = (self.config.train.eval_batches * self.config.train.eval_batch()) as u64;
        (reads != split).then_some(ValidationReads { reads, split })
    }

    /// Mean validation loss over `train.eval_batches` batches of `train.eval_batch_size`
    /// sequences (the same batches every time), without building a graph. Batch k of a split
    /// holds sequences k·B..(k+1)·B, so the same sequences in other batch sizes give the same
    /// loss (up to the order of the additions).
    pub fn evaluate(&mut self) -> Result<EvalRecord, TrainError> {
        if let Some(why) = self.dataset.missing_validation() {
            return Err(TrainError::Invalid(format!("cannot evaluate: {why}")));
        }
        let seq = self.config.data.seq_len;
        let batch = self.config.train.eval_batch();
        // Each rank evaluates its rows of the global batches (as in training).
        let share = Share { rank: self.zero.rank(), world: self.zero.size() };
        let mut loader = Loader::new_shared(self.dataset.clone(), Split::Validation, batch, seq, 0, 0, 1, share)?;
        let mut weights = self.step_weights(true)?;
        let n = self.config.train.eval_batches;
        let mut total = 0.0;
        for i in 0..n {
            WorkProgressFn::tell(self.work_progress.as_ref(), Work::Evaluation(self.step), i as u64, n as u64);
            let b = loader.next()?;
            let micro = tensors(&b, self.meter.device())?;
            let logits = model::forward_logits(&self.model, weights.as_mut(), &micro.tokens, micro.documents.as_ref())
                .map_err(TrainError::candle)?;
            let loss = model::ops::cross_entropy(&logits, &micro.targets)
                .and_then(|l| l.to_dtype(DType::F64))
                .and_then(|l| l.to_scalar::<f64>())
                .map_err(TrainError::candle)?;
            total += loss / n as f64;
        }
        let mut mean = [total];
        self.zero.mean(&mut mean)?;
        let total = mean[0];
        let floor = self.dataset.entropy_floor_nats();
        Ok(EvalRecord { step: self.step, val_loss: total, entropy_floor: floor, gap: floor.map(|f| total / f - 1.0) })
    }

    /// `train.sample_tokens` tokens the model writes now from the start of a document
    /// (temperature 1, seeded by `train.seed`, so samples of different steps compare), and
    /// whether it stopped at the end of text.
    pub fn sample(&self) -> Result<(String, bool), TrainError> {
        let Some((tokenizer, start, eos)) = &self.sampling else {
            return Err(TrainError::Invalid("train.sample_every is 0: this run takes no samples".into()));
        };
        let sampling = model::Sampling { temperature: 1.0, top_k: 0, top_p: 1.0, seed: self.config.train.seed };
        let context = self.model.spec().context().max(self.config.data.seq_len);
        let (ids, stop) = model::generate(
            &self.model,
            &[*start],
            self.config.train.sample_tokens,
            context,
            sampling,
            *eos,
            &mut |_| {},
        )?;
        let text = tokenizer.decode(&ids).map_err(|e| TrainError::Invalid(format!("cannot decode a sample: {e}")))?;
        Ok((text, stop == model::Stop::EndOfText))
    }
}
