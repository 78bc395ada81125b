//! `ava estimate`: the peak memory of one training step, predicted from the config alone
//! before anything is allocated, as parameters / gradients / optimizer state / data /
//! activations, with the formula behind every term.
//!
//! The plugins are asked only for their declared sizes: the optimizer's
//! [`state_layout`](ava_core::Optimizer::state_layout) per parameter (names and shapes, no
//! buffers), the attention kernel's [`saved_len`](ava_core::AttentionKernel::saved_len) and
//! [`workspace_len`](ava_core::AttentionKernel::workspace_len) for the step's shape, and the checkpoint policy's [`decide`](ava_core::CheckpointPolicy::decide) on
//! per-block facts ([`block_facts`]). Nothing model-sized is allocated, so a 7B model can be
//! estimated on a laptop.
//!
//! Parameters, gradients, optimizer state and data are closed formulas. Activations are not:
//! what candle keeps alive depends on which op outputs the graph references and on how its
//! backward pass holds gradients, so the estimator replays the model's forward pass and
//! `forward_backward` on shadow tensors that count bytes instead of holding them (`sim`: candle's
//! allocation rules and its `backward`, transcribed; `replay`: `Model::block`, `Model::head` and
//! `forward_backward`, statement by statement). The peak of that replay is the activation
//! term, broken down by what holds the bytes at that moment; the per-op terms of one kept block
//! are printed as formulas (`block`). `tests/estimate_vs_measured.rs` checks the replay against
//! the counting allocator on real steps.
//!
//! [`estimate_rank`] runs in stages, each term computed by a function of its own from the
//! shared inputs (`inputs::Inputs`: the spec, the config and the sizes derived from them): the
//! terms held through the step (`held`), the plan and its replay (`calibrate`), the terms at
//! the replay's peak (`peak`), the ZeRO comparison (`zero`).
//!
//! On a GPU run (`train.device: cuda`, or `ava estimate --device cuda`) the terms are device
//! memory, what the stream-ordered pool hands out: the replay allocates as the engine's
//! device ops do (`sim`'s module docs: no f32 scratch in the linear layers, the attention
//! kernel's device workspace and f32 saved buffer, the logits read in their own type), the
//! held terms are the device's (the rotary tables' f32 copy, the batch's token ids), there
//! are no gemm slabs, and the host's share of the step is listed apart
//! ([`Estimate::host`]). `tests/estimate_vs_measured.rs` holds it against peaks measured
//! on an H200.
//!
//! Files: `inputs` (what every term is computed from), `held`, `calibrate`, `peak`, `zero`,
//! `sim` (shadow tensors and candle's backward), `replay` (the model on them), `block`
//! (per-block formulas), `render` (the text report); `step_time`, a GPU step's time
//! predicted from the estimate (`ava plan`, `ava bench train`).

mod block;
mod calibrate;
mod held;
mod inputs;
mod peak;
mod render;
mod replay;
mod sim;
pub mod step_time;
mod zero;

#[cfg(test)]
mod tests;

use ava_core::{
    AttentionKernel, AttnShape, BlockDecision, BlockFacts, CheckpointPolicy, KernelContext, Optimizer, Pass,
};
use serde::{Serialize, Serializer};

use self::calibrate::Planned;
use self::inputs::{Inputs, Kernels, Offload, Shares, step_model};
use self::replay::{MicroBatchPeak, Replay};
use self::sim::{Cat, Dt};
use crate::config::{Config, Precision};
use crate::device::DeviceSpec;
use crate::memory::Breakdown;
use crate::model::ModelSpec;

/// What a term counts towards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Component {
    /// f32 master weights, compute-type copies, rotary tables.
    Parameters,
    /// Gradient accumulators.
    Gradients,
    /// Optimizer state buffers.
    Optimizer,
    /// Batches queued by the loader and the batch in use.
    Data,
    /// What the forward and backward pass of a micro-batch hold at the peak.
    Activations,
}

impl Component {
    /// In report order.
    pub const ALL: [Component; 5] =
        [Component::Parameters, Component::Gradients, Component::Optimizer, Component::Data, Component::Activations];

    /// Lowercase name.
    pub fn as_str(self) -> &'static str {
        match self {
            Component::Parameters => "parameters",
            Component::Gradients => "gradients",
            Component::Optimizer => "optimizer",
            Component::Data => "data",
            Component::Activations => "activations",
        }
    }
}

/// One line of the estimate: what, how it is computed, how many bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Term {
    /// The component it counts towards.
    pub component: Component,
    /// e.g. `f32 master weights`.
    pub name: String,
    /// e.g. `4 · N = 4 · 3,277,056`.
    pub formula: String,
    /// Bytes.
    pub bytes: u64,
}

impl Term {
    /// A term of `component`.
    fn new(component: Component, name: impl Into<String>, formula: String, bytes: u64) -> Self {
        Self { component, name: name.into(), formula, bytes }
    }
}

/// The plugins whose declared sizes the estimate uses.
#[derive(Clone, Copy)]
pub struct Plugins<'a> {
    /// Asked for `state_layout` of every parameter.
    pub optimizer: &'a dyn Optimizer,
    /// Asked for `saved_len` of the step's attention shape.
    pub attention: &'a dyn AttentionKernel,
    /// Asked to `decide` on the block facts.
    pub checkpoint: &'a dyn CheckpointPolicy,
}

impl std::fmt::Debug for Plugins<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugins").finish_non_exhaustive()
    }
}

/// The predicted peak of one training step.
#[derive(Debug, Clone, Serialize)]
pub struct Estimate {
    /// Sequences per micro-batch B.
    pub batch: usize,
    /// Tokens per sequence T.
    pub seq_len: usize,
    /// The compute precision.
    pub precision: Precision,
    /// Micro-batches per optimizer step.
    pub accumulation: usize,
    /// Parameters N.
    pub num_params: u64,
    /// Every term, grouped by component in [`Component::ALL`] order; each component's terms
    /// sum to its field of [`breakdown`](Self::breakdown).
    pub terms: Vec<Term>,
    /// What one kept block holds for backward, op by op (sums to
    /// `block_facts[i].activation_bytes`).
    pub block_terms: Vec<Term>,
    /// The components at the peak, against `memory.budget`.
    pub breakdown: Breakdown,
    /// The checkpoint policy's decision per block.
    #[serde(serialize_with = "plan_names")]
    pub plan: Vec<BlockDecision>,
    /// The facts the policy decided on.
    #[serde(serialize_with = "facts_table")]
    pub block_facts: Vec<BlockFacts>,
    /// The activation budget the policy was given: `memory.budget` less everything that is
    /// not activations (parameters, gradients, optimizer state, data, workspace), calibrated
    /// against the replay: the largest budget whose plan the replay fits in `memory.budget`
    /// (more or less than that remainder, as the policy's block model is under or over the
    /// replay); 0 when no budget is set. The trainer gives a policy the same, so both plan
    /// alike.
    pub activation_budget: u64,
    /// Peak growth of memory across one micro-batch's `forward_backward` (gradients and
    /// activations; with accumulation, above the accumulators already held).
    pub micro_batch_peak: u64,
    /// Where in the step the peak happens, e.g. `backward: block 0 (recomputed), in silu`.
    pub peak_at: String,
    /// `ok`, `warning`, `critical` or `over budget` (`no budget` when none is set).
    pub status: String,
    /// Bytes of optimizer state (and masters) streamed through the offload tier, outside
    /// memory between steps (0 without `offload.tiers`).
    pub offloaded: u64,
    /// This rank's optimizer state with the engine's buffers beside it (masters in a tier, the
    /// Kahan compensation), wherever it lives: on the device, in host memory or in a tier.
    pub state_bytes: u64,
    /// The records the tier will store, one per streamed buffer, in bytes: what its
    /// `preflight` is asked about.
    #[serde(skip)]
    pub offload_records: Vec<u64>,
    /// With several ranks: one rank's model states (weights, gradients, optimizer state)
    /// under each ZeRO stage, by the ZeRO paper's accounting in Ava's layout.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub zero_stages: Vec<ZeroStage>,
    /// `train.device`: on a GPU every term is device memory (the stream-ordered pool's
    /// allocations, what `ava bench train` reports as the device peak) and `host` lists the
    /// host memory apart.
    pub device: DeviceSpec,
    /// On a GPU run, the step's host memory, outside the device peak (the loader's queue, the
    /// batch, the rotary tables the device copy is made from); empty on the CPU.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub host: Vec<Term>,
}

/// The name of the host term of a GPU run's optimizer state in page-locked host memory.
pub const PINNED_STATE: &str = "optimizer state in page-locked host memory";

impl Estimate {
    /// On a GPU run, the optimizer state (and masters) kept in page-locked host memory and
    /// streamed through the device each step; 0 when none is.
    pub fn pinned_state_bytes(&self) -> u64 {
        self.host.iter().filter(|t| t.name == PINNED_STATE).map(|t| t.bytes).sum()
    }
}

/// One rank's model states under one ZeRO stage (Rajbhandari et al. 2020, §5: stage 1 =
/// 2Ψ + 2Ψ + KΨ/N, stage 2 = 2Ψ + (2 + K)Ψ/N, stage 3 = (4 + K)Ψ/N in mixed precision).
#[derive(Debug, Clone, Serialize)]
pub struct ZeroStage {
    /// 0..=3.
    pub stage: u8,
    /// e.g. `P + 4Ψ/N + KΨ/N = 12.81 MiB + 6.38 MiB + 12.76 MiB`.
    pub formula: String,
    /// Bytes for the rank estimated (its own share of whole parameters, not exactly 1/N).
    pub bytes: u64,
}

fn plan_names<S: Serializer>(plan: &[BlockDecision], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(plan.iter().map(|d| d.as_str()))
}

fn facts_table<S: Serializer>(facts: &[BlockFacts], s: S) -> Result<S::Ok, S::Error> {
    #[derive(Serialize)]
    struct Row {
        index: u32,
        activation_bytes: u64,
        input_bytes: u64,
        parameter_bytes: u64,
        forward_flops: u64,
    }
    s.collect_seq(facts.iter().map(|f| Row {
        index: f.index,
        activation_bytes: f.activation_bytes,
        input_bytes: f.input_bytes,
        parameter_bytes: f.parameter_bytes,
        forward_flops: f.forward_flops,
    }))
}

/// Why an estimate could not be made.
#[derive(Debug, thiserror::Error)]
pub enum EstimateError {
    /// A size in the config is zero.
    #[error("{key} is 0; the estimate needs at least 1 (set it in the config or with --set {key}=N)")]
    Zero {
        /// The config key.
        key: &'static str,
    },
    /// The attention kernel refused the step's shape.
    #[error(
        "the attention kernel (plugins.attention) refused the shape {shape}: {message}\n  \
         pick a kernel that supports it (`ava plugins list`), or change data.seq_len or the model's heads"
    )]
    Attention {
        /// The shape, as B, heads, T, D.
        shape: String,
        /// The kernel's error.
        message: String,
    },
    /// The optimizer could not describe its state for a parameter.
    #[error(
        "the optimizer (plugins.optimizer) failed in state_layout for {param} {shape:?}: {message}\n  \
         its state cannot be sized; check the optimizer's options (`ava plugins info NAME`)"
    )]
    Optimizer {
        /// The parameter's Hugging Face name.
        param: String,
        /// Its shape.
        shape: Vec<usize>,
        /// The plugin's error.
        message: String,
    },
    /// The checkpoint policy failed.
    #[error("the checkpoint policy (plugins.checkpoint) failed in decide: {message}")]
    Checkpoint {
        /// The plugin's error.
        message: String,
    },
    /// The checkpoint policy returned a plan the engine cannot carry out.
    #[error("the checkpoint policy (plugins.checkpoint) {message}")]
    Plan {
        /// What is wrong with it ([`ava_core::check_plan`]).
        message: String,
    },
}

/// The shadow replay's element type for a precision.
fn dt(precision: Precision) -> Dt {
    match precision {
        Precision::Fp32 => Dt::F32,
        Precision::Bf16 | Precision::F16 => Dt::Half,
    }
}

/// The attention kernel's saved f32s for one call of the step's shape.
fn saved_len(
    spec: &ModelSpec,
    batch: usize,
    seq: usize,
    attention: &dyn AttentionKernel,
) -> Result<u64, EstimateError> {
    let shape = AttnShape::self_attention(batch, spec.heads, spec.kv_heads, seq, spec.head_dim(), true);
    attention.saved_len(&shape).map_err(|e| EstimateError::Attention {
        shape: format!("B={batch}, H={}, Hkv={}, T={seq}, D={}", spec.heads, spec.kv_heads, spec.head_dim()),
        message: e.to_string(),
    })
}

/// The attention kernel's declared workspace for one forward and one backward call of the
/// step's shape with `threads` threads on `device` (f32s).
fn workspace_lens(
    spec: &ModelSpec,
    batch: usize,
    seq: usize,
    attention: &dyn AttentionKernel,
    threads: usize,
    device: ava_core::Device,
) -> Result<[u64; 2], EstimateError> {
    let shape = AttnShape::self_attention(batch, spec.heads, spec.kv_heads, seq, spec.head_dim(), true);
    let ctx = KernelContext { threads: threads.max(1) as u32, device };
    let len = |pass: Pass| {
        attention.workspace_len(&shape, pass, &ctx).map_err(|e| EstimateError::Attention {
            shape: format!("B={batch}, H={}, Hkv={}, T={seq}, D={}", spec.heads, spec.kv_heads, spec.head_dim()),
            message: format!("workspace_len({}): {e}", pass.as_str()),
        })
    };
    Ok([len(Pass::Forward)?, len(Pass::Backward)?])
}

/// Forward FLOPs of one block for `batch · seq` tokens: 2 per matmul parameter a token visits,
/// plus the attention scores and weighted sum (4·d·T per token: the whole square, as the
/// standard kernel computes it; [`ModelSpec::train_flops_per_token`]'s model FLOPs count the
/// causal half). A cost for ranking plans, not a model-FLOP count.
fn block_forward_flops(spec: &ModelSpec, batch: usize, seq: usize) -> u64 {
    let per_token_matmul = (spec.matmul_params_per_token() - spec.vocab * spec.hidden) / spec.layers;
    let tokens = (batch * seq) as u64;
    tokens * (2 * per_token_matmul as u64 + 4 * (spec.hidden * seq) as u64)
}

/// Per-block facts for the checkpoint policy: the bytes a kept block holds for backward (its
/// activations, the attention kernel's saved buffer and its output), the bytes a recomputed
/// block keeps instead (its (B, T, d) input), its f32 parameter bytes and its forward FLOPs.
/// On a GPU (`device`) the activations are device memory, as the device's ops hold them.
pub fn block_facts(
    spec: &ModelSpec,
    batch: usize,
    seq: usize,
    precision: Precision,
    attention: &dyn AttentionKernel,
    device: DeviceSpec,
) -> Result<Vec<BlockFacts>, EstimateError> {
    if batch == 0 {
        return Err(EstimateError::Zero { key: "train.micro_batch_size" });
    }
    if seq == 0 {
        return Err(EstimateError::Zero { key: "data.seq_len" });
    }
    let saved = saved_len(spec, batch, seq, attention)?;
    let replay = replay_on(device, Replay::new(spec, batch, seq, dt(precision), saved))
        .with_saved_half(attention.saved_tolerates_half());
    let activation_bytes = replay.block_activation_bytes();
    let input_bytes = (batch * seq * spec.hidden * precision.bytes()) as u64;
    let defs = spec.params();
    let flops = block_forward_flops(spec, batch, seq);
    Ok((0..spec.layers)
        .map(|i| BlockFacts {
            index: i as u32,
            activation_bytes,
            input_bytes,
            parameter_bytes: 4 * defs.iter().filter(|d| d.block == Some(i)).map(|d| d.numel() as u64).sum::<u64>(),
            forward_flops: flops,
        })
        .collect())
}

/// `replay` counting `device`'s memory: a GPU's device memory, or the host's.
fn replay_on(device: DeviceSpec, replay: Replay<'_>) -> Replay<'_> {
    if device.is_cuda() { replay.on_gpu() } else { replay }
}

/// The modeled peak of one micro-batch's forward and backward pass.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MicroBatch {
    /// Peak growth of memory across the call, above what was held before it (parameters,
    /// casts, accumulators and the batch are held before).
    pub peak_bytes: u64,
    /// Of those, the bytes of this micro-batch's parameter gradients alive at the peak.
    pub gradient_bytes: u64,
    /// Where the peak happens, e.g. `backward: block 0 (recomputed), in silu`.
    pub peak_at: String,
}

/// Replays one micro-batch's `model::forward_backward` of `spec` on `batch` sequences of `seq`
/// tokens in `precision`, under `plan` (one decision per block), on byte-counting shadow
/// tensors. With `accumulating`, gradient accumulators from an earlier micro-batch are held
/// and this micro-batch's gradients are added to them at the end (the additions count). The
/// attention kernel runs with `threads` threads (its workspace depends on them); the loss
/// computes the LM head `loss_chunk_rows` rows at a time (`train.loss_chunk_rows`, as
/// `Model::with_loss_chunk_rows`; 0: the logits whole).
#[allow(clippy::too_many_arguments)] // the step's shape, its plan and how it runs
pub fn micro_batch(
    spec: &ModelSpec,
    batch: usize,
    seq: usize,
    precision: Precision,
    attention: &dyn AttentionKernel,
    plan: &[BlockDecision],
    accumulating: bool,
    threads: usize,
    loss_chunk_rows: usize,
) -> Result<MicroBatch, EstimateError> {
    if batch == 0 {
        return Err(EstimateError::Zero { key: "train.micro_batch_size" });
    }
    if seq == 0 {
        return Err(EstimateError::Zero { key: "data.seq_len" });
    }
    ava_core::check_plan(plan, spec.layers).map_err(|message| EstimateError::Plan { message })?;
    let saved = saved_len(spec, batch, seq, attention)?;
    let [fwd, bwd] = workspace_lens(spec, batch, seq, attention, threads, ava_core::Device::Cpu)?;
    let peak = Replay::new(spec, batch, seq, dt(precision), saved)
        .with_saved_half(attention.saved_tolerates_half())
        .with_workspace(fwd, bwd)
        .with_loss_chunk_rows(loss_chunk_rows)
        .forward_backward(plan, accumulating);
    Ok(MicroBatch {
        peak_bytes: peak.bytes,
        gradient_bytes: peak.by_cat[Cat::ParamGrads as usize],
        peak_at: peak_at(&peak),
    })
}

/// `1234567` → `1,234,567`.
pub fn grouped(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Bytes of one cached gemm packing slab per compute thread: gemm keeps an L2-sized buffer per
/// thread after its first matmul. Read from sysfs; 1 MiB where it cannot be read.
fn l2_bytes() -> u64 {
    let text = std::fs::read_to_string("/sys/devices/system/cpu/cpu0/cache/index2/size").unwrap_or_default();
    let text = text.trim();
    let parsed = if let Some(k) = text.strip_suffix('K') {
        k.parse::<u64>().ok().map(|k| k << 10)
    } else if let Some(m) = text.strip_suffix('M') {
        m.parse::<u64>().ok().map(|m| m << 20)
    } else {
        text.parse().ok()
    };
    parsed.unwrap_or(1 << 20)
}

/// The compute threads of one rank of `world`, as the trainer resolves them
/// (`train::resolve_threads`): `train.threads`, or this machine's cores shared by its ranks.
/// Under a launcher the ranks on this machine are known; otherwise the `world` ranks are
/// taken to share it, as `ava train --nproc` starts them.
fn rank_threads(threads: usize, world: usize) -> usize {
    if threads > 0 || crate::dist::launched_size().is_some() {
        return crate::train::resolve_threads(threads);
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / world.clamp(1, cores)).max(1)
}

/// The memory policy's words for a fraction of the budget (the `thresholds` defaults: target
/// 0.90, critical 0.95).
fn status(fraction: f64, budget: u64) -> &'static str {
    match fraction {
        _ if budget == 0 => "no budget",
        f if f < 0.90 => "ok",
        f if f < 0.95 => "warning",
        f if f <= 1.0 => "critical",
        _ => "over budget",
    }
}

/// Predicts the peak memory of one training step of `spec` under `config` with `plugins`.
pub fn estimate(spec: &ModelSpec, config: &Config, plugins: &Plugins<'_>) -> Result<Estimate, EstimateError> {
    estimate_on(spec, config, plugins, 1)
}

/// [`estimate`] for the rank of `world` data-parallel ranks (`mpirun -np N`) that holds the
/// most optimizer state: see [`estimate_rank`].
pub fn estimate_on(
    spec: &ModelSpec,
    config: &Config,
    plugins: &Plugins<'_>,
    world: usize,
) -> Result<Estimate, EstimateError> {
    estimate_rank(spec, config, plugins, world, None)
}

/// [`estimate`] for rank `rank` (None: the one holding the most optimizer state) of `world`
/// data-parallel ranks. The micro-batch is per rank. From `distributed.zero_stage` 1 the
/// optimizer state is the rank's share, split by whole parameters as the trainer splits it
/// (`dist::owners`), and the updated weights are all-gathered a bucket at a time; stages 0
/// and 1 all-reduce whole gradients after backward (a bucket's copy beside them); stage 2
/// reduce-scatters them during backward, a bucket at a time, and keeps only the rank's own.
pub fn estimate_rank(
    spec: &ModelSpec,
    config: &Config,
    plugins: &Plugins<'_>,
    world: usize,
    rank: Option<usize>,
) -> Result<Estimate, EstimateError> {
    let s = Inputs::new(spec, config, *plugins, world, rank);
    // Held through the whole step: the weights, this rank's optimizer state, the data.
    let shares = Shares::new(&s)?;
    let offload = Offload::new(&s, &shares);
    let mut terms = held::terms(&s, &shares, &offload);
    // One micro-batch: the checkpoint policy's plan, decided with the budget left for
    // activations (calibrated against the replay), and what the replay holds at its peak.
    let kernels = Kernels::new(&s)?;
    let (outside, fixed) = outside_micro_batch(&s, &shares, &kernels, &terms);
    let planned = calibrate::plan(&s, &kernels, step_model(&s, &shares, &offload), outside, fixed)?;
    terms.extend(peak::terms(&s, &shares, &offload, &kernels, &planned.peak));
    // Grouped by component, in the order they were added within each.
    terms.sort_by_key(|t| Component::ALL.iter().position(|c| *c == t.component));
    Ok(report(&s, &shares, offload, kernels, planned, terms))
}

/// Bytes held through the micro-batch (every held term, the gradient accumulators, the gemm
/// workspace), and those with this micro-batch's gradients: all that is not activations
/// (inside backward the gradients are only a few at a time, counted at the peak).
fn outside_micro_batch(s: &Inputs<'_>, shares: &Shares, kernels: &Kernels, held: &[Term]) -> (u64, u64) {
    let accumulators = if s.accumulation > 1 { 4 * s.accumulated(&shares.held) } else { 0 };
    let outside = held.iter().map(|t| t.bytes).sum::<u64>() + accumulators + kernels.gemm_workspace;
    (outside, outside + if s.inside { 0 } else { 4 * s.n_params })
}

/// The estimate from its terms (grouped by component), the plan and its peak.
fn report(
    s: &Inputs<'_>,
    shares: &Shares,
    offload: Offload,
    kernels: Kernels,
    planned: Planned,
    terms: Vec<Term>,
) -> Estimate {
    let budget = s.config.memory.budget.0;
    let breakdown = breakdown(&terms, budget);
    let moe = s.spec.moe.map(|m| (m.experts as u64, m.top_k as u64));
    Estimate {
        zero_stages: zero::stages(s, shares),
        device: s.device,
        host: [held::host_terms(s, &offload, &planned.plan), peak::host_terms(s, &offload, &planned.peak)].concat(),
        batch: s.batch,
        seq_len: s.seq,
        precision: s.precision,
        accumulation: s.accumulation,
        num_params: s.n_params,
        terms,
        block_terms: block::block_terms(&s.x, kernels.saved, kernels.saved_size, moe),
        status: status(breakdown.fraction(), budget).to_string(),
        breakdown,
        plan: planned.plan,
        block_facts: kernels.facts,
        activation_budget: planned.activation_budget,
        micro_batch_peak: planned.peak.bytes,
        peak_at: peak_at(&planned.peak),
        offloaded: offload.records.iter().sum(),
        state_bytes: shares.per_param().iter().sum(),
        offload_records: offload.records,
    }
}

/// Each component's terms summed, and their total as the peak, against `budget`.
fn breakdown(terms: &[Term], budget: u64) -> Breakdown {
    let sum = |c: Component| terms.iter().filter(|t| t.component == c).map(|t| t.bytes).sum::<u64>();
    let mut breakdown = Breakdown {
        params: sum(Component::Parameters),
        grads: sum(Component::Gradients),
        optimizer: sum(Component::Optimizer),
        data: sum(Component::Data),
        activations: sum(Component::Activations),
        peak: 0,
        budget,
        resident: None,
        allocated: 0,
    };
    breakdown.peak = breakdown.params + breakdown.grads + breakdown.optimizer + breakdown.data + breakdown.activations;
    breakdown
}

/// Where in the step the peak happens, e.g. `backward: block 0 (recomputed), in silu`.
fn peak_at(peak: &MicroBatchPeak) -> String {
    if peak.op.is_empty() { peak.phase.clone() } else { format!("{}, in {}", peak.phase, peak.op) }
}
