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

mod build;
mod run_loop;
mod step;

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
}

/// How far a step or an evaluation is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkProgress {
    /// A step's micro-batches, or an evaluation's batches.
    pub what: Work,
    /// Done so far.
    pub done: u64,
    /// In all.
    pub total: u64,
}

/// What [`WorkProgress`] counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Work {
    /// The micro-batches of this step (its forward and backward passes).
    Step(u64),
    /// The validation batches of the evaluation after this step.
    Evaluation(u64),
}

/// Receives [`WorkProgress`].
#[derive(Clone)]
pub struct WorkProgressFn(pub Arc<dyn Fn(&WorkProgress) + Send + Sync>);

impl std::fmt::Debug for WorkProgressFn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WorkProgressFn")
    }
}

impl WorkProgressFn {
    /// Tells it, if there is one.
    pub(crate) fn tell(this: Option<&Self>, what: Work, done: u64, total: u64) {
        if let Some(f) = this {
            (f.0)(&WorkProgress { what, done, total });
        }
    }
}

/// How far writing or reading a checkpoint is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IoProgress {
    /// `saving` or `loading`.
    pub what: &'static str,
    /// The checkpoint directory (for a save, where it will be).
    pub dir: PathBuf,
    /// Bytes done so far.
    pub done: u64,
    /// Bytes in all (weights and optimizer state; the small files are left out).
    pub total: u64,
}

/// Receives [`IoProgress`].
#[derive(Clone)]
pub struct IoProgressFn(pub Arc<dyn Fn(&IoProgress) + Send + Sync>);

impl std::fmt::Debug for IoProgressFn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("IoProgressFn")
    }
}

/// A checkpoint's save or load reports its progress every this many bytes.
pub const IO_PROGRESS_BYTES: u64 = 1 << 30;

/// Counts the bytes written through it (`done`, shared by the writers of one checkpoint) and
/// reports the count each time it passes a multiple of `every`.
struct Counting<'a> {
    out: &'a mut dyn Write,
    done: &'a std::cell::Cell<u64>,
    report: &'a dyn Fn(u64),
    every: u64,
}

impl Write for Counting<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.out.write(buf)?;
        let before = self.done.get();
        self.done.set(before + n as u64);
        if (before + n as u64) / self.every > before / self.every {
            (self.report)(before + n as u64);
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

/// The trainer's own state in a checkpoint (`trainer.json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct TrainerState {
    /// Steps completed.
    step: u64,
    /// Next training batch index of the loader.
    data_position: u64,
    /// The seed of the data order and initial weights. The data order has no other random
    /// state: batch i of a split is a pure function of (seed, split, i).
    seed: u64,
    /// Loss scaling.
    loss_scale: LossScaler,
    /// How many pieces the memory policy split each micro-batch into.
    micro_batch_split: usize,
    /// Ranks that trained it: the loader's position counts batches of
    /// `micro_batch_size × world_size` sequences.
    #[serde(default = "one")]
    world_size: usize,
}

fn one() -> usize {
    1
}

/// Checks `trainer.json` against its checkpoint and the run: every field in range and the
/// step the manifest's. Its numbers size and index what follows (micro-batch split, data
/// position), so a damaged one must stop here. All problems are reported at once.
fn check_trainer_state(
    state: &TrainerState,
    ckpt: &LoadedCheckpoint,
    config: &Config,
    dataset: &dyn Dataset,
    world: usize,
) -> Result<(), TrainError> {
    let mut problems = Vec::new();
    if state.step != ckpt.step {
        problems.push(format!("step is {}, but the manifest says the checkpoint is of step {}", state.step, ckpt.step));
    }
    // The store names each checkpoint by its step when it writes it: a step edited in both
    // files afterwards still disagrees with the name.
    let named = ckpt.dir.file_name().and_then(|n| n.to_str()).and_then(crate::save::parse_step);
    if let Some(named) = named.filter(|&n| n != ckpt.step) {
        problems.push(format!(
            "its directory is named for step {named}, but its manifest and step say {}: edited after it was written",
            ckpt.step
        ));
    }
    let micro = config.train.micro_batch_size;
    let split = state.micro_batch_split;
    if split == 0 || !split.is_power_of_two() || !micro.is_multiple_of(split) {
        problems.push(format!(
            "micro_batch_split is {split}; it must be a power of two dividing train.micro_batch_size ({micro})"
        ));
    }
    problems.extend(data_position_problem(state, config, dataset, world));
    let ls = &state.loss_scale;
    if !(ls.scale.is_finite() && ls.scale >= 1.0) && ls.enabled {
        problems.push(format!("loss_scale.scale is {}; it must be a finite number of at least 1", ls.scale));
    }
    if ls.enabled && ls.growth_interval == 0 {
        problems.push("loss_scale.growth_interval is 0; it must be at least 1".into());
    }
    if problems.is_empty() {
        return Ok(());
    }
    let path = ckpt.dir.join(TRAINER_FILE);
    Err(TrainError::Invalid(format!(
        "{}: {}; this checkpoint is damaged or from another run; resume from an older one",
        path.display(),
        problems.join("; ")
    )))
}

/// What is wrong with `trainer.json`'s data position, if anything. Batch k is a pure function
/// of (seed, k), so any position reads (a resume with `--force` may even change how many
/// batches a step reads), but every sequence index the loader reaches from it, its read-ahead
/// included, must fit in 64 bits: a position past that used to overflow in the loader's
/// threads and hang the run. Checked before any loader thread starts.
fn data_position_problem(state: &TrainerState, config: &Config, dataset: &dyn Dataset, world: usize) -> Option<String> {
    let pos = state.data_position;
    let per_batch = (config.train.micro_batch_size as u64).saturating_mul(world as u64);
    let ahead = (config.data.num_workers as u64).saturating_mul(config.data.prefetch_factor as u64 + 1) + 1;
    if pos.checked_add(ahead).and_then(|b| b.checked_mul(per_batch)).is_some() {
        return None;
    }
    let corpus = match dataset.sequences_per_pass(Split::Train, config.data.seq_len) {
        Some(n) => format!("the corpus holds {n} training sequences of {} tokens per pass", config.data.seq_len + 1),
        None => "the data source has no end".to_string(),
    };
    Some(format!(
        "data_position is {pos}: {pos} batches of {per_batch} sequences are past the last 64-bit sequence index \
         ({corpus}, and step {} of a run reads far fewer)",
        state.step
    ))
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
    /// `memory.hard_limit` on the CPU, if set: the counting allocator's limit (`None` on a
    /// GPU, whose limit is [`device_limit`](Self::device_limit)).
    hard_limit: Option<u64>,
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
    /// `memory.hard_limit` on a GPU: the capped pool the device's allocations come from,
    /// held for the run. Last, so it is dropped after the model and the state (dropping it
    /// destroys the pool and gives the device its default pool back).
    device_limit: Option<crate::device::DeviceLimit>,
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

/// The compute threads a config asks for (0: one per core, shared out among the ranks that
/// run on this machine).
pub fn resolve_threads(threads: usize) -> usize {
    if threads > 0 {
        threads
    } else {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        (cores / crate::dist::local_size()).max(1)
    }
}

/// The data options of a config.
pub fn data_options(config: &Config) -> Result<DataOptions, TrainError> {
    let d = &config.data;
    if !d.mix.0.is_empty() && d.source != DataSource::Shards {
        return Err(TrainError::Invalid(format!(
            "data.mix names prepared corpora but data.source is {}: set data.source to shards",
            serde_json::to_value(d.source).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default()
        )));
    }
    let source = match d.source {
        DataSource::Synthetic => Source::Synthetic(MarkovSpec {
            alphabet: d.synthetic.alphabet,
            order: d.synthetic.order,
            branching: d.synthetic.branching,
            seed: config.train.seed,
        }),
        DataSource::Text => Source::Text {
            path: d.path.clone().ok_or_else(|| {
                TrainError::Invalid("data.source is text but data.path is not set: set data.path to a text file".into())
            })?,
            tokenizer: d.tokenizer.clone(),
        },
        DataSource::Shards if !d.mix.0.is_empty() => {
            if let Some(path) = &d.path {
                return Err(TrainError::Invalid(format!(
                    "data.path ({}) and data.mix are both set: train on one corpus (data.path) or a mixture \
                     (data.mix), and set the other to null / []",
                    path.display()
                )));
            }
            Source::Mix {
                corpora: d.mix.0.iter().map(|s| (s.path.clone(), s.fraction)).collect(),
                tokenizer: d.tokenizer.clone(),
            }
        }
        DataSource::Shards => Source::Shards {
            dir: d.path.clone().ok_or_else(|| {
                TrainError::Invalid(
                    "data.source is shards but data.path is not set: set data.path to a directory written by `ava \
                     data prepare` (or data.mix to several)"
                        .into(),
                )
            })?,
            tokenizer: d.tokenizer.clone(),
        },
    };
    Ok(DataOptions {
        source,
        seq_len: d.seq_len,
        val_fraction: d.val_fraction,
        seed: config.train.seed,
        packing: d.packing,
    })
}

/// The model architecture a config describes (from `model.from`'s config.json if set).
pub fn model_spec(config: &Config) -> Result<ModelSpec, TrainError> {
    Ok(match &config.model.from {
        Some(dir) => ModelSpec::from_hf_config(&dir.join(HF_CONFIG_FILE))?,
        None => ModelSpec::from_config(&config.model)?,
    })
}

/// The attention window of a kernel selection: `Some(None)` for full causal attention,
/// `Some(Some(w))` for a window of `w`, `None` when the host cannot tell (another plugin).
fn kernel_window(sel: &PluginSelection) -> Option<Option<usize>> {
    match sel.name.as_str() {
        "standard" | "flash" => Some(None),
        // The sliding-window plugin's default window.
        "sliding-window" => Some(Some(sel.options.get("window").and_then(|v| v.as_u64()).unwrap_or(256) as usize)),
        _ => None,
    }
}

/// Checks the selected attention computes what the model asks for: a model with a sliding
/// window (Mistral's `sliding_window`) needs a kernel with that window, unless the window
/// covers every sequence of `seq` tokens, where full causal attention is the same.
pub fn check_attention(spec: &ModelSpec, sel: &PluginSelection, seq: usize) -> Result<(), TrainError> {
    let Some(w) = spec.sliding_window else { return Ok(()) };
    let seen = |window: Option<usize>| window.map_or(seq, |w| w.min(seq));
    match kernel_window(sel) {
        Some(k) if seen(k) == seen(Some(w)) => Ok(()),
        found => {
            let what = match found {
                Some(None) => "full causal attention".to_string(),
                Some(Some(k)) => format!("a window of {k}"),
                None => "a kernel whose window Ava cannot check".to_string(),
            };
            Err(TrainError::Invalid(format!(
                "the model is a {} with sliding_window: {w} (each token sees the last {w} positions, its own \
                 included), but plugins.attention is '{}' ({what}), which would compute another model for sequences \
                 of {seq} tokens: set plugins.attention={{name: sliding-window, window: {w}}}, or data.seq_len to at \
                 most {w} (the window then covers every sequence)",
                spec.arch.model_type(),
                sel.name
            )))
        }
    }
}

/// Checks that a sample (`train.sample_every`: the token it starts from and
/// `train.sample_tokens` after it) fits in the model's context, so a run does not stop at its
/// first sample.
pub fn check_samples(spec: &ModelSpec, config: &Config) -> Result<(), TrainError> {
    let t = &config.train;
    let context = spec.context().max(config.data.seq_len);
    if t.sample_every == 0 || t.sample_tokens < context {
        return Ok(());
    }
    Err(TrainError::Invalid(format!(
        "train.sample_tokens is {} but {}: set train.sample_tokens to at most {} (a sample starts from one token)",
        t.sample_tokens,
        model::context_note(spec, context),
        context - 1
    )))
}

/// Checks that `train.master_weights` and `train.step_in_backward` work with the rest of
/// the config; every problem is reported at once, each naming the keys and what to change.
///
/// `world`: the ranks the run has, for the `distributed` section's own conditions.
pub fn check_training_modes(config: &Config, world: usize) -> Result<(), TrainError> {
    let t = &config.train;
    let mut problems = Vec::new();
    if world > 1 && t.step_in_backward {
        problems.push(format!(
            "train.step_in_backward is not supported with {world} ranks yet (each gradient would have to be \
             reduced before its step inside backward): set train.step_in_backward: false"
        ));
    }
    let mw = t.master_weights;
    if mw != MasterWeights::F32 && t.precision == Precision::Fp32 {
        problems.push(format!(
            "train.master_weights: {} keeps the weights in train.precision, which is fp32 (4 bytes a weight, as with \
             f32 masters): set train.precision: bf16 (or f16), or train.master_weights: f32",
            mw.as_str()
        ));
    }
    let tiers = &config.offload.tiers;
    if mw == MasterWeights::Tier && tiers.offloaded().is_none() && tiers.pinned(t.device.is_cuda()) == 0.0 {
        let gpu = if t.device.is_cuda() {
            "; on a GPU run, page-locked host memory takes them too (offload.tiers: [device: 0%, ram: 100%])"
        } else {
            ""
        };
        problems.push(format!(
            "train.master_weights: tier streams the f32 master weights through the offload tier with the optimizer \
             state, but offload.tiers keeps all of it where the run computes: select a tier and give it a share, \
             e.g. plugins.offload: {{name: nvme, path: /mnt/scratch}} and offload.tiers: [device: 0%, nvme: 100%]{gpu} \
             (or train.master_weights: none or kahan, which keep no masters)"
        ));
    }
    if t.sample_every > 0 && world > 1 && config.distributed.zero_stage >= 3 {
        problems.push(
            "train.sample_every samples on rank 0 with every weight, which ZeRO stage 3 splits over the ranks: set \
             train.sample_every: 0 (and sample after training with `ava generate RUN`), or distributed.zero_stage \
             below 3"
                .to_string(),
        );
    }
    if t.step_in_backward {
        let why = "train.step_in_backward steps each parameter as soon as its gradient is final";
        if t.gradient_accumulation_steps > 1 {
            problems.push(format!(
                "{why}, so gradients are never summed over micro-batches, but train.gradient_accumulation_steps is \
                 {}: set it to 1 (raise train.micro_batch_size for a larger batch), or train.step_in_backward: false",
                t.gradient_accumulation_steps
            ));
        }
        if t.grad_clip > 0.0 {
            problems.push(format!(
                "{why}, before the global gradient norm is known, so train.grad_clip ({}) cannot apply: set \
                 train.grad_clip: 0 (the norm is still computed and logged), or train.step_in_backward: false",
                t.grad_clip
            ));
        }
        if t.nan_policy == NanPolicy::Skip {
            problems.push(format!(
                "{why}, so a parameter may be stepped before a later gradient of the step turns out not finite, and \
                 the step can no longer be skipped, but train.nan_policy is skip: set train.nan_policy: stop (a \
                 non-finite gradient then stops the run before it is applied, naming the checkpoint to resume from), \
                 or train.step_in_backward: false"
            ));
        }
        if t.precision == Precision::F16 {
            problems.push(format!(
                "{why}, but with train.precision: f16 an overflow is found only after the whole backward, when \
                 steps were already applied and the loss scaler could no longer skip the step: use train.precision: \
                 bf16 (no loss scaling needed) or train.step_in_backward: false"
            ));
        }
    }
    match problems.len() {
        0 => Ok(()),
        1 => Err(TrainError::Invalid(problems.remove(0))),
        _ => Err(TrainError::Invalid(format!(
            "the config's training modes do not fit:\n  - {}",
            problems.join("\n  - ")
        ))),
    }
}

/// The type the weights are stored in: f32 masters, or the compute type when there are none
/// in memory.
pub fn storage_dtype(config: &Config) -> DType {
    match config.train.master_weights {
        MasterWeights::F32 => DType::F32,
        _ => compute_dtype(config.train.precision),
    }
}

/// The engine's own state buffer per parameter for `train.master_weights`.
fn host_state(config: &Config) -> HostState {
    match config.train.master_weights {
        MasterWeights::F32 | MasterWeights::None => HostState::Nothing,
        MasterWeights::Tier => HostState::Master,
        MasterWeights::Kahan => HostState::Compensation(match config.train.precision {
            Precision::F16 => ava_core::DType::F16,
            _ => ava_core::DType::BF16,
        }),
    }
}

fn compute_dtype(p: Precision) -> DType {
    match p {
        Precision::Fp32 => DType::F32,
        Precision::Bf16 => DType::BF16,
        Precision::F16 => DType::F16,
    }
}

/// The architecture, and what model.from's `config.json` holds that changes nothing (said
/// once in the header).
fn model_spec_with_notes(config: &Config) -> Result<(ModelSpec, Vec<String>), TrainError> {
    Ok(match &config.model.from {
        Some(dir) => {
            let path = dir.join(HF_CONFIG_FILE);
            let read = model::read_hf_config(&path)?;
            let notes = read.notes.iter().map(|n| format!("model.from {}: {n}", path.display())).collect();
            (read.spec, notes)
        }
        None => (ModelSpec::from_config(&config.model)?, Vec::new()),
    })
}

/// Every token id of the data must have a row in the model's embedding; the error says which
/// side to change, for the data source in use.
fn check_vocabulary(config: &Config, dataset: &dyn Dataset, spec: &ModelSpec) -> Result<(), TrainError> {
    let (data, model) = (dataset.vocab_size(), spec.vocab);
    if data <= model {
        return Ok(());
    }
    Err(TrainError::Invalid(match (&config.model.from, config.data.source, &config.data.path) {
        (Some(dir), _, _) => format!(
            "the data has {data} distinct token ids but the model in model.from ({}) has a vocabulary of {model}: \
             train it on data tokenized with its own tokenizer (data.tokenizer: its tokenizer.json)",
            dir.display()
        ),
        (None, DataSource::Shards, Some(dir)) => format!(
            "the corpus in {} was prepared with a vocabulary of {data} but model.vocab_size is {model}: set \
             model.vocab_size to at least {data}, or prepare the corpus with a smaller tokenizer",
            dir.display()
        ),
        _ => format!(
            "the data has {data} distinct token ids but model.vocab_size is {model}: set model.vocab_size to at least \
             {data}"
        ),
    }))
}

/// Resuming: loads `ckpt`'s optimizer state into `state` through views of the mapped file (a
/// state larger than memory goes straight to its tier), with progress every
/// [`IO_PROGRESS_BYTES`]; returns the f32 masters it held, if any.
fn load_optimizer_state(
    ckpt: &LoadedCheckpoint,
    model: &Model,
    state: &mut OptimizerState,
    options: &TrainOptions,
) -> Result<Vec<NamedBuffer>, TrainError> {
    let optimizer_file = ckpt.dir.join(OPTIMIZER_FILE);
    let (buffers, _) = safetensors_views(ckpt.file(OPTIMIZER_FILE)?).map_err(|e| {
        TrainError::Invalid(format!(
            "{}: {e}; resume from an older checkpoint, or keep this one's weights with --fresh-optimizer",
            optimizer_file.display()
        ))
    })?;
    // Progress over the weights (loaded before) and the state.
    let weights: u64 = model.params().iter().map(|p| p.stored_bytes() as u64).sum();
    let total = weights + state.bytes();
    let mut reported = 0;
    let mut progress = |done: u64| {
        let done = weights + done;
        if let Some(f) = &options.io_progress
            && done / IO_PROGRESS_BYTES > reported
        {
            reported = done / IO_PROGRESS_BYTES;
            (f.0)(&IoProgress { what: "loading", dir: ckpt.dir.clone(), done, total });
        }
    };
    state.load_buffers(model.params(), buffers, &mut progress).map_err(|e| match e {
        TrainError::OptimizerState { problems, .. } => {
            TrainError::OptimizerState { problems, trained_with: saved_optimizer(ckpt), file: Some(optimizer_file) }
        }
        e => e,
    })
}

/// From a run with f32 masters in a tier to one with f32 weights (`--force`): the masters,
/// not their rounding, become the weights. Nothing to do when the model's weights are not f32.
fn masters_into_weights(ckpt: &LoadedCheckpoint, model: &Model, masters: Vec<NamedBuffer>) -> Result<(), TrainError> {
    if model.storage() != DType::F32 {
        return Ok(());
    }
    for b in masters {
        let name = b.name.trim_end_matches(&format!(".{}", super::MASTER));
        let Some(p) = model.params().iter().find(|p| p.def.name == name) else { continue };
        let numel: usize = p.def.shape.iter().product();
        if b.data.len() != numel.saturating_mul(4) {
            return Err(TrainError::Invalid(format!(
                "{}: {} holds {} bytes, but the f32 master of {name} (shape {:?}) takes {}; this checkpoint is \
                 damaged or from another run; resume from an older one",
                ckpt.dir.join(OPTIMIZER_FILE).display(),
                b.name,
                b.data.len(),
                p.def.shape,
                numel.saturating_mul(4)
            )));
        }
        let values: Vec<f32> = b.data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        let t = Tensor::from_vec(values, p.def.shape.as_slice(), p.var.device());
        t.and_then(|t| p.var.set(&t)).map_err(TrainError::candle)?;
    }
    Ok(())
}

/// Resuming: `ckpt`'s `trainer.json`, read and checked against the checkpoint, the run and
/// its data ([`check_trainer_state`]), for a run of `world` ranks.
fn read_trainer_state(
    ckpt: &LoadedCheckpoint,
    config: &Config,
    dataset: &dyn Dataset,
    world: usize,
) -> Result<TrainerState, TrainError> {
    let mut state: TrainerState = serde_json::from_slice(ckpt.file(TRAINER_FILE)?).map_err(|e| {
        TrainError::Invalid(format!(
            "{}: unreadable trainer state: {e}; this checkpoint is damaged or from another version; resume from an \
             older one",
            ckpt.dir.join(TRAINER_FILE).display()
        ))
    })?;
    check_trainer_state(&state, ckpt, config, dataset, world)?;
    state.world_size = world;
    Ok(state)
}

/// `memory.hard_limit` against the rest of the config, before anything is allocated: not
/// below `memory.budget` (on a GPU both are device memory), and on the CPU only with the
/// counting allocator installed, which enforces it there.
fn check_hard_limit(config: &Config) -> Result<(), TrainError> {
    let limit = config.memory.hard_limit.0;
    if limit == 0 {
        return Ok(());
    }
    if config.memory.budget.0 > limit {
        return Err(TrainError::Invalid(format!(
            "memory.hard_limit ({}) is below memory.budget ({}): the memory policy acts at fractions of the budget, \
             so memory would run out before it could; lower memory.budget or raise memory.hard_limit",
            config.memory.hard_limit, config.memory.budget
        )));
    }
    if !config.train.device.is_cuda() && !memory::installed() {
        return Err(TrainError::Invalid(
            "memory.hard_limit needs the counting allocator, which this program does not install (the ava binary \
             does): remove memory.hard_limit, or install ava_train::memory::CountingAlloc as the #[global_allocator]"
                .into(),
        ));
    }
    Ok(())
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

    /// The GPU's memory after a step (none on the CPU).
    fn device_memory(&self) -> Result<Option<memory::DeviceMemory>, TrainError> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(gpu) = self.model.device() {
            return memory::device::read(&gpu).map(Some).map_err(TrainError::candle);
        }
        Ok(None)
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
        let limit = self.device_limit.as_ref().map(crate::device::DeviceLimit::bytes);
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
            let micro = tensors(&b, &self.model.device())?;
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

    /// Writes a checkpoint of the current step; returns its directory.
    ///
    /// With several ranks every rank calls it: rank 0 writes the whole checkpoint, the
    /// optimizer state of parameters other ranks hold sent by them buffer by buffer (so the
    /// checkpoint is the same whatever the world size and ZeRO stage, and resumes on any).
    pub fn save_checkpoint(&mut self) -> Result<PathBuf, TrainError> {
        let dir = self.store.root().join(crate::save::step_dir_name(self.step));
        if !self.zero.is_root() {
            self.send_state_to_root()?;
            return Ok(dir);
        }
        let trainer = TrainerState {
            step: self.step,
            data_position: self.data_position,
            seed: self.config.train.seed,
            loss_scale: self.scaler,
            micro_batch_split: self.split,
            world_size: self.zero.size(),
        };
        let (hf_config, trainer, config) = (
            json_bytes(&self.model.spec().to_hf_config()),
            json_bytes(&serde_json::to_value(&trainer).expect("serializable")),
            json_bytes(&serde_json::to_value(&self.config).expect("serializable")),
        );
        // The weights and the optimizer state stream into their files a tensor at a time (a
        // streamed state is read back from the tier buffer by buffer): saving holds one
        // tensor's copy, not the model's and the state's.
        let (state, params, zero) = (&self.state, self.model.params(), &self.zero);
        // A buffer another rank holds: rank 0 names it (the file's order is its own), then
        // its owner sends it.
        let mut remote = move |i: usize, j: usize, len: usize| {
            let failed = |e: TrainError| crate::save::SaveError::BadBuffer {
                name: params[i].def.name.clone(),
                reason: format!("receiving it from rank {}: {e}", zero.owner(i)),
            };
            zero.broadcast(&mut state_request(i as u64, j as u64), 0).map_err(failed)?;
            let mut bytes = vec![0u8; len]; // (len,) one buffer
            zero.broadcast(&mut bytes, zero.owner(i)).map_err(failed)?;
            Ok(bytes)
        };
        let mut weights = self.weights_writer();
        // Progress of the two large files, together.
        let total = self.model.params().iter().map(|p| p.stored_bytes() as u64).sum::<u64>() + state.bytes();
        let done = std::cell::Cell::new(0u64);
        let progress = self.io_progress.clone();
        let report = move |bytes: u64| {
            if let Some(f) = &progress {
                (f.0)(&IoProgress { what: "saving", dir: dir.clone(), done: bytes, total });
            }
        };
        let (done, report) = (&done, &report);
        let mut files = vec![
            (HF_CONFIG_FILE.to_string(), FileBody::Bytes(&hf_config)),
            (
                MODEL_FILE.to_string(),
                FileBody::Stream(Box::new(move |out| {
                    weights(&mut Counting { out, done, report, every: IO_PROGRESS_BYTES })
                })),
            ),
            (
                OPTIMIZER_FILE.to_string(),
                FileBody::Stream(Box::new(move |out| {
                    let mut out = Counting { out, done, report, every: IO_PROGRESS_BYTES };
                    state.write_safetensors_gathered(params, &mut out, &mut remote)
                })),
            ),
            (TRAINER_FILE.to_string(), FileBody::Bytes(&trainer)),
            (AVA_CONFIG_FILE.to_string(), FileBody::Bytes(&config)),
        ];
        let dir = self.store.save_files(self.step, &mut files)?;
        if self.zero.stage() >= 1 {
            // The other ranks wait for requests until this one.
            self.zero.broadcast(&mut state_request(u64::MAX, 0), 0)?;
        }
        Ok(dir)
    }

    /// Rank 0's writer of the model's weights (safetensors, a tensor at a time). At ZeRO
    /// stage 3 it asks each other rank's parameters of their owner as it goes (the other
    /// ranks answer in [`send_state_to_root`](Self::send_state_to_root)); rank 0 never
    /// holds more than one of them.
    fn weights_writer(&self) -> impl FnMut(&mut dyn std::io::Write) -> Result<(), crate::save::SaveError> + '_ {
        move |out| {
            if self.zero.stage() < 3 || self.zero.size() == 1 {
                return model::write_tensors(out, &self.model.named_tensors());
            }
            let (params, zero) = (self.model.params(), &self.zero);
            let bad = |i: usize, reason: String| crate::save::SaveError::BadBuffer {
                name: params[i].def.name.clone(),
                reason,
            };
            let specs = params
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    model::tensor_spec(&p.def.name, p.var.dtype(), &p.def.shape).map_err(|e| bad(i, e.to_string()))
                })
                .collect::<Result<Vec<_>, _>>()?;
            model::write_tensors_from(out, &specs, &mut |i| {
                let p = &params[i];
                if zero.owner(i) == zero.rank() {
                    return model::tensor_to_buffer(&p.def.name, p.var.as_tensor())
                        .map(|b| b.data)
                        .map_err(|e| bad(i, e.to_string()));
                }
                let failed = |e: TrainError| bad(i, format!("receiving it from rank {}: {e}", zero.owner(i)));
                zero.broadcast(&mut state_request(i as u64, WEIGHTS_REQUEST), 0).map_err(failed)?;
                let mut bytes = vec![0u8; p.stored_bytes()]; // (numel,) stored type
                zero.broadcast(&mut bytes, zero.owner(i)).map_err(failed)?;
                Ok(bytes)
            })
        }
    }

    /// Writes the trained model's `model/` folder: rank 0 writes it whole; at ZeRO stage 3
    /// the other ranks send it their parameters as it goes.
    /// Writes the final weights as a Hugging Face folder with the run's tokenizer and its
    /// begin- and end-of-text ids (a tokenizer that cannot be written is warned about: the
    /// weights are what the run made).
    fn save_final_model(&self, reporter: &mut dyn Reporter) -> Result<Option<PathBuf>, TrainError> {
        let dir = self.out_dir.join("model");
        if !self.zero.is_root() {
            if self.zero.stage() >= 3 {
                self.send_state_to_root()?;
            }
            return Ok(None);
        }
        let mut weights = self.weights_writer();
        let written = model::save_hf_folder_with(&dir, self.model.spec(), &mut weights);
        drop(weights);
        if self.zero.stage() >= 3 && self.zero.size() > 1 {
            // The other ranks wait for requests until this one.
            self.zero.broadcast(&mut state_request(u64::MAX, 0), 0)?;
        }
        written?;
        let tokenizer = crate::inference::run_tokenizer(&self.config)
            .map_err(|e| e.to_string())
            .and_then(|source| crate::inference::write_tokenizer_files(&dir, &source).map_err(|e| e.to_string()));
        if let Err(e) = tokenizer {
            reporter.warn(&format!(
                "{}: the weights are saved, but not the tokenizer ({e}); `ava generate` and transformers need one \
                 beside them: copy it there as tokenizer.json",
                dir.display()
            ));
        }
        Ok(Some(dir))
    }

    /// The other ranks' side of [`save_checkpoint`](Self::save_checkpoint): rank 0 names
    /// each buffer it lacks as it writes the file, and the rank holding it sends it (every
    /// rank takes part in each broadcast) until rank 0 says the file is done. At stage 3
    /// the buffers include the weights ([`WEIGHTS_REQUEST`]).
    fn send_state_to_root(&self) -> Result<(), TrainError> {
        if self.zero.stage() == 0 {
            return Ok(()); // rank 0 holds all of it
        }
        loop {
            let mut request = state_request(0, 0);
            self.zero.broadcast(&mut request, 0)?;
            let (i, j) = (
                u64::from_le_bytes(request[..8].try_into().expect("8 bytes")),
                u64::from_le_bytes(request[8..].try_into().expect("8 bytes")),
            );
            if i == u64::MAX {
                return Ok(());
            }
            if j == WEIGHTS_REQUEST {
                let Some(p) = self.model.params().get(i as usize) else {
                    return Err(TrainError::Invalid(format!(
                        "rank 0 asked for parameter {i}, which does not exist: the ranks disagree on the model"
                    )));
                };
                let owner = self.zero.owner(i as usize);
                let mut bytes = if owner == self.zero.rank() {
                    model::tensor_to_buffer(&p.def.name, p.var.as_tensor())?.data
                } else {
                    vec![0u8; p.stored_bytes()] // (numel,) received and dropped
                };
                self.zero.broadcast(&mut bytes, owner)?;
                continue;
            }
            let (i, j) = (i as usize, j as usize);
            let Some(buffer) = self.state.buffers.get(i).and_then(|b| b.get(j)) else {
                return Err(TrainError::Invalid(format!(
                    "rank 0 asked for optimizer buffer {j} of parameter {i}, which does not exist: the ranks \
                     disagree on the model"
                )));
            };
            let owner = self.zero.owner(i);
            let mut bytes = if owner == self.zero.rank() {
                self.state.buffer_bytes(i, j)?
            } else {
                vec![0u8; buffer.spec.bytes() as usize] // (len,) received and dropped
            };
            self.zero.broadcast(&mut bytes, owner)?;
        }
    }

    /// A run saves at least at its end: a disk without room for that checkpoint is found
    /// before the first step (the tier already holds its records), not after the last. A
    /// disk whose free space cannot be read is left to the save to report.
    fn check_checkpoint_room(&self) -> Result<(), TrainError> {
        let weights = (self.model.spec().num_params() * self.model.storage().size_in_bytes()) as u64;
        if let Ok(free) = crate::save::free_space(self.store.root()) {
            crate::save::check_room(self.store.root(), weights, self.state.bytes(), free)?;
        }
        Ok(())
    }

    /// The checkpoint store of this run.
    pub fn store(&self) -> &CheckpointStore {
        &self.store
    }
}

/// How this step's parameters are stepped, inside backward or after it.
fn step_settings<'a>(
    optimizer: &'a mut dyn ava_core::Optimizer,
    plugin: &'a str,
    model: &'a Model,
    t: &crate::config::TrainConfig,
    step: u64,
    lr: f64,
    threads: usize,
) -> StepSettings<'a> {
    StepSettings {
        optimizer,
        plugin,
        params: model.params(),
        step,
        lr,
        weight_decay: t.weight_decay,
        threads: threads as u32,
        seed: t.seed,
        grad_scale: 1.0,
    }
}

/// The buffer index of a request for a parameter's weights (ZeRO stage 3).
const WEIGHTS_REQUEST: u64 = u64::MAX;

/// Rank 0's request for buffer `j` of parameter `i` while it writes a checkpoint
/// (`u64::MAX`: done; `j` = [`WEIGHTS_REQUEST`]: the weights).
fn state_request(i: u64, j: u64) -> [u8; 16] {
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&i.to_le_bytes());
    out[8..].copy_from_slice(&j.to_le_bytes());
    out
}

/// How a non-finite number is said in errors.
fn non_finite_word(x: f64) -> &'static str {
    if x.is_nan() { "NaN" } else { "infinite" }
}

/// Pretty JSON bytes of a value, with a final newline.
fn json_bytes(value: &Value) -> Vec<u8> {
    let mut v = serde_json::to_vec_pretty(value).expect("a JSON value serializes");
    v.push(b'\n');
    v
}

/// The optimizer a checkpoint was trained with, as its `ava-config.json` names it.
fn saved_optimizer(ckpt: &LoadedCheckpoint) -> Option<String> {
    let saved: Value = serde_json::from_slice(ckpt.file(AVA_CONFIG_FILE).ok()?).ok()?;
    let sel = saved.pointer("/plugins/optimizer")?;
    let name = sel.as_str().or_else(|| sel.get("name").and_then(Value::as_str));
    Some(name.map_or_else(|| sel.to_string(), str::to_string))
}

/// With `train.sample_every`: the run's tokenizer, the token a sample starts from (the
/// begin- or end-of-text id, else the first token of the data) and the end-of-text id.
fn samples_from(
    config: &Config,
    dataset: &dyn Dataset,
) -> Result<Option<(ava_data::Tokenizer, u32, Option<u32>)>, TrainError> {
    if config.train.sample_every == 0 {
        return Ok(None);
    }
    let invalid = |e: crate::inference::InferenceError| {
        TrainError::Invalid(format!("train.sample_every: {e} (or set train.sample_every: 0)"))
    };
    let source = crate::inference::run_tokenizer(config).map_err(invalid)?;
    let tokenizer = source.load().map_err(invalid)?;
    let start = match source.bos.or(source.eos) {
        Some(id) => id,
        None => dataset.sequence(Split::Train, 0, 1)[0],
    };
    Ok(Some((tokenizer, start, source.eos)))
}

/// Why the checkpoint plan could not be made.
enum PlanError {
    /// The estimator could not size the step.
    Estimate(String),
    /// The policy failed, or returned a plan the engine cannot carry out.
    Policy(String),
}

/// The checkpoint policy's decision per block, for micro-batches of `train.micro_batch_size /
/// split` sequences. With a memory budget the policy gets what is left of it for activations,
/// computed by the estimator for this rank (`ava estimate` shows the same plan); without
/// one, no budget.
fn checkpoint_plan(
    spec: &ModelSpec,
    config: &Config,
    plugins: &crate::estimate::Plugins<'_>,
    split: usize,
    world: usize,
    rank: usize,
) -> Result<Vec<BlockDecision>, PlanError> {
    let mut config = config.clone();
    config.train.micro_batch_size /= split;
    config.train.gradient_accumulation_steps *= split;
    let t = &config.train;
    let (batch, seq) = (t.micro_batch_size, config.data.seq_len);
    let facts = crate::estimate::block_facts(spec, batch, seq, t.precision, plugins.attention, t.device)
        .map_err(|e| PlanError::Estimate(e.to_string()))?;
    let budget_bytes = if config.memory.budget.0 == 0 {
        0
    } else {
        crate::estimate::estimate_rank(spec, &config, plugins, world, Some(rank))
            .map_err(|e| PlanError::Estimate(e.to_string()))?
            .activation_budget
    };
    let ctx = CheckpointContext { budget_bytes, offload_available: true };
    let plan = plugins.checkpoint.decide(&facts, &ctx).map_err(|e| PlanError::Policy(e.to_string()))?;
    ava_core::check_plan(&plan, spec.layers).map_err(PlanError::Policy)?;
    Ok(plan)
}

/// Refuses a resume whose config changes what the checkpoint's state means.
///
/// A checkpoint written by `saved_world` ranks resumes on `world` ranks when the global
/// micro-batch (`train.micro_batch_size` × ranks) is the same: the loader's position counts
/// global batches, and the state is whole in the checkpoint.
fn check_config(
    ckpt: &LoadedCheckpoint,
    config: &Config,
    options: &TrainOptions,
    saved_world: usize,
    world: usize,
) -> Result<(), TrainError> {
    let mut saved: Value = serde_json::from_slice(ckpt.file(AVA_CONFIG_FILE)?).map_err(|e| {
        TrainError::Invalid(format!("{}: unreadable config: {e}", ckpt.dir.join(AVA_CONFIG_FILE).display()))
    })?;
    let current = serde_json::to_value(config).expect("the config serializes");
    let micro = config.train.micro_batch_size;
    let saved_micro = saved.pointer("/train/micro_batch_size").and_then(Value::as_u64);
    let mut global_change = None;
    if let Some(saved_micro) = saved_micro
        && saved_world != world
    {
        let (before, after) = (saved_micro as usize * saved_world, micro * world);
        if before == after {
            // The same global batch: not a change.
            saved["train"]["micro_batch_size"] = Value::from(micro);
        } else {
            global_change = Some(format!(
                "global micro-batch (train.micro_batch_size × ranks): {saved_micro} × {saved_world} = {before} -> \
                 {micro} × {world} = {after} (on {world} ranks, resume with train.micro_batch_size: {})",
                if before % world == 0 {
                    (before / world).to_string()
                } else {
                    format!("{before}/{world}, which is not whole: use a world size dividing {before}")
                }
            ));
        }
    }
    let mut differences = differing_keys(&saved, &current, STRUCTURAL_KEYS);
    if let Some(change) = global_change {
        differences.retain(|d| !d.starts_with("train.micro_batch_size"));
        differences.push(change);
    }
    if options.fresh_optimizer {
        // The state it would have to match is not loaded.
        differences.retain(|d| !d.starts_with("plugins.optimizer"));
    }
    if differences.is_empty() || options.force {
        return Ok(());
    }
    Err(TrainError::ConfigChanged { checkpoint: ckpt.dir.clone(), differences })
}

/// What one forward/backward pass reads: (B, T) input ids, the flat targets, and the
/// packed documents (`data.packing: document`).
struct MicroBatch {
    tokens: Tensor,
    targets: Vec<u32>,
    documents: Option<Documents>,
}

/// A batch as one micro-batch, its tokens on `device`.
fn tensors(batch: &Batch, device: &Device) -> Result<MicroBatch, TrainError> {
    Ok(split_batch(batch, 1, device)?.pop().expect("one piece"))
}

/// A batch split into `pieces` equal micro-batches (the memory policy's shrink). Each
/// piece's packed documents are copied from the batch's rows directly, so they are held
/// once: B·T ids and positions over all the pieces. The tokens go to `device` (the model's);
/// the targets and documents stay on the host, where the ops that take them read them.
fn split_batch(batch: &Batch, pieces: usize, device: &Device) -> Result<Vec<MicroBatch>, TrainError> {
    let (inputs, targets, positions) = (batch.inputs(), batch.targets(), batch.positions());
    let rows = batch.batch_size / pieces;
    let per = rows * batch.seq_len;
    (0..pieces)
        .map(|i| {
            let span = i * per..(i + 1) * per;
            let tokens = Tensor::from_vec(inputs[span.clone()].to_vec(), (rows, batch.seq_len), device); // (B, T)
            let documents = match (&batch.segments, &positions) {
                (Some(segments), Some(positions)) => Some(
                    Documents::new(
                        rows,
                        batch.seq_len,
                        segments[span.clone()].to_vec(),
                        positions[span.clone()].to_vec(),
                    )
                    .map_err(TrainError::candle)?,
                ),
                _ => None,
            };
            Ok(MicroBatch { tokens: tokens.map_err(TrainError::candle)?, targets: targets[span].to_vec(), documents })
        })
        .collect()
}

/// Appends one JSON line and flushes it (so a killed run keeps its metrics); nothing on a
/// rank that does not write the run's files.
fn write_line(file: Option<&mut std::fs::File>, path: &Path, value: &Value) -> Result<(), TrainError> {
    let Some(file) = file else { return Ok(()) };
    let mut line = serde_json::to_string(value).expect("a JSON value serializes");
    line.push('\n');
    file.write_all(line.as_bytes()).and_then(|_| file.flush()).map_err(|e| TrainError::io(path, e))
}

#[cfg(test)]
mod progress_tests {
    use std::io::Write;

    /// Two files written through one count: a report each time the total passes a multiple
    /// of the step, with the total then, and the bytes reach their file unchanged.
    #[test]
    fn counting_writers_report_each_step_of_the_total() {
        let reports = std::cell::RefCell::new(Vec::new());
        let report = |n: u64| reports.borrow_mut().push(n);
        let done = std::cell::Cell::new(0);
        let (mut a, mut b) = (Vec::new(), Vec::new());
        let mut first = super::Counting { out: &mut a, done: &done, report: &report, every: 10 };
        first.write_all(&[1; 7]).unwrap();
        first.write_all(&[2; 7]).unwrap();
        let mut second = super::Counting { out: &mut b, done: &done, report: &report, every: 10 };
        second.write_all(&[3; 25]).unwrap();
        assert_eq!(*reports.borrow(), vec![14, 39]);
        assert_eq!((a.len(), b.len(), done.get()), (14, 25, 39));
    }
}

#[cfg(test)]
mod split_tests {
    use super::*;

    /// Split by the memory policy, each micro-batch of a packed batch holds its rows' tokens,
    /// targets, document ids and positions: together, the whole batch's.
    #[test]
    fn split_pieces_hold_their_rows_documents() {
        let (b, t) = (4, 3);
        let tokens: Vec<u32> = (0..(b * (t + 1)) as u32).collect();
        let segments = vec![0, 0, 1, 0, 1, 1, 0, 0, 0, 0, 1, 2];
        let batch = Batch { index: 0, batch_size: b, seq_len: t, tokens, segments: Some(segments.clone()) };
        let whole = tensors(&batch, &Device::Cpu).unwrap();
        let docs = whole.documents.as_ref().unwrap();
        assert_eq!(&**docs.segments(), &segments[..]);
        assert_eq!(&**docs.positions(), &[0, 1, 0, 0, 0, 1, 0, 1, 2, 0, 0, 0][..]);
        let pieces = split_batch(&batch, 2, &Device::Cpu).unwrap();
        for (i, piece) in pieces.iter().enumerate() {
            let rows = i * 2 * t..(i + 1) * 2 * t;
            assert_eq!(piece.tokens.to_vec2::<u32>().unwrap().concat(), batch.inputs()[rows.clone()]);
            assert_eq!(piece.targets, batch.targets()[rows.clone()]);
            let d = piece.documents.as_ref().unwrap();
            assert_eq!(d.dims(), (2, t));
            assert_eq!(&**d.segments(), &docs.segments()[rows.clone()]);
            assert_eq!(&**d.positions(), &docs.positions()[rows]);
        }
        let plain = Batch { segments: None, ..batch };
        assert!(split_batch(&plain, 2, &Device::Cpu).unwrap().iter().all(|p| p.documents.is_none()));
    }
}

#[cfg(test)]
mod trainer_state_tests {
    //! `trainer.json` as outside input: every field checked against the checkpoint and the
    //! run, and any bytes at all an error or a valid state, never a panic.

    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;

    fn ckpt(step: u64) -> LoadedCheckpoint {
        LoadedCheckpoint { dir: PathBuf::from("/ckpt/step-00000004"), step, files: BTreeMap::new() }
    }

    /// A corpus of 123 sequences per pass (only its size is asked).
    struct Corpus;

    impl Dataset for Corpus {
        fn vocab_size(&self) -> usize {
            2
        }
        fn sequence(&self, _: Split, _: u64, seq_len: usize) -> Vec<u32> {
            vec![0; seq_len + 1]
        }
        fn entropy_floor_nats(&self) -> Option<f64> {
            None
        }
        fn describe(&self) -> String {
            "a corpus".into()
        }
        fn sequences_per_pass(&self, _: Split, _: usize) -> Option<u64> {
            Some(123)
        }
    }

    fn check(json: &str, step: u64) -> Result<(), String> {
        let state: TrainerState = serde_json::from_str(json).map_err(|e| e.to_string())?;
        check_trainer_state(&state, &ckpt(step), &Config::default(), &Corpus, 1).map_err(|e| e.to_string())
    }

    const GOOD: &str = r#"{"step":4,"data_position":4,"seed":1,"micro_batch_split":1,
        "loss_scale":{"scale":65536.0,"clean_steps":0,"growth_interval":2000,"enabled":true}}"#;

    #[test]
    fn a_consistent_state_passes() {
        check(GOOD, 4).unwrap();
    }

    #[test]
    fn a_step_other_than_the_manifests_is_refused() {
        let e = check(GOOD, 6).unwrap_err();
        assert!(e.starts_with("/ckpt/step-00000004/trainer.json: step is 4, but the manifest says"), "{e}");
        assert!(e.ends_with("this checkpoint is damaged or from another run; resume from an older one"), "{e}");
    }

    #[test]
    fn a_split_that_does_not_divide_the_micro_batch_is_refused() {
        for split in [0usize, 3, 1 << 40] {
            let e = check(&GOOD.replace(r#""micro_batch_split":1"#, &format!(r#""micro_batch_split":{split}"#)), 4)
                .unwrap_err();
            assert!(e.contains(&format!("micro_batch_split is {split}; it must be a power of two")), "{e}");
        }
    }

    #[test]
    fn a_bad_loss_scale_is_refused_with_every_other_problem() {
        let json = GOOD.replace("65536.0", "0.0").replace(r#""growth_interval":2000"#, r#""growth_interval":0"#);
        let e = check(&json, 5).unwrap_err();
        assert!(
            e.contains("step is 4") && e.contains("loss_scale.scale is 0") && e.contains("growth_interval is 0"),
            "{e}"
        );
    }

    #[test]
    fn a_data_position_past_the_last_sequence_index_is_refused_with_the_corpus_size() {
        let micro = Config::default().train.micro_batch_size;
        // Far past the steps, but every index reachable: batch k is a function of (seed, k).
        check(&GOOD.replace(r#""data_position":4"#, r#""data_position":4000000"#), 4).unwrap();
        // Its sequence indices past u64 (they used to overflow in the loader's threads and hang).
        let pos = u64::MAX / micro as u64;
        let e = check(&GOOD.replace(r#""data_position":4"#, &format!(r#""data_position":{pos}"#)), 4).unwrap_err();
        assert!(
            e.starts_with(&format!(
                "/ckpt/step-00000004/trainer.json: data_position is {pos}: {pos} batches of {micro} sequences are past \
                 the last 64-bit sequence index (the corpus holds 123 training sequences of "
            )),
            "{e}"
        );
        assert!(e.ends_with("this checkpoint is damaged or from another run; resume from an older one"), "{e}");
    }

    fn cases() -> proptest::test_runner::Config {
        // proptest reads $PROPTEST_CASES into its default (256).
        proptest::test_runner::Config { failure_persistence: None, ..Default::default() }
    }

    proptest! {
        #![proptest_config(cases())]

        /// Any numbers in every field: Ok or an error naming trainer.json, never a panic.
        #[test]
        fn any_trainer_json_is_checked_without_panic(
            step in any::<u64>(), pos in any::<u64>(), split in any::<u64>(), scale in any::<f64>(),
            interval in any::<u64>(), enabled in any::<bool>(), manifest_step in any::<u64>(),
            edits in prop::collection::vec((any::<usize>(), any::<u8>()), 0..4),
        ) {
            let json = format!(
                r#"{{"step":{step},"data_position":{pos},"seed":1,"micro_batch_split":{split},
                "loss_scale":{{"scale":{scale:?},"clean_steps":0,"growth_interval":{interval},"enabled":{enabled}}}}}"#
            );
            let mut bytes = json.into_bytes();
            for (at, b) in edits {
                let i = at % bytes.len();
                bytes[i] = b;
            }
            let text = String::from_utf8_lossy(&bytes);
            if let Err(e) = check(&text, manifest_step)
                && e.contains("trainer.json")
            {
                prop_assert!(e.contains("resume from an older one"), "{}", e);
            }
        }
    }
}
