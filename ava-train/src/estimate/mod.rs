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
//! Files: `sim` (shadow tensors and candle's backward), `replay` (the model on them), `block`
//! (per-block formulas), `render` (the text report).

mod block;
mod render;
mod replay;
mod sim;

#[cfg(test)]
mod tests;

use ava_core::{
    AttentionKernel, AttnShape, BlockDecision, BlockFacts, CheckpointContext, CheckpointPolicy, KernelContext,
    Optimizer, Pass,
};
use ava_core::{ParamInfo, StateSpec};
use serde::{Serialize, Serializer};

use self::block::Dims;
use self::replay::{Replay, StepModel};
use self::sim::{Cat, Dt};
use crate::config::{Config, MasterWeights, Precision};
use crate::memory::Breakdown;
use crate::model::ModelSpec;
use crate::train::HostState;

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
    /// The records the tier will store, one per streamed buffer, in bytes: what its
    /// `preflight` is asked about.
    #[serde(skip)]
    pub offload_records: Vec<u64>,
    /// With several ranks: one rank's model states (weights, gradients, optimizer state)
    /// under each ZeRO stage, by the ZeRO paper's accounting in Ava's layout.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub zero_stages: Vec<ZeroStage>,
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
/// step's shape with `threads` threads (f32s).
fn workspace_lens(
    spec: &ModelSpec,
    batch: usize,
    seq: usize,
    attention: &dyn AttentionKernel,
    threads: usize,
) -> Result<[u64; 2], EstimateError> {
    let shape = AttnShape::self_attention(batch, spec.heads, spec.kv_heads, seq, spec.head_dim(), true);
    let ctx = KernelContext { threads: threads.max(1) as u32, ..KernelContext::default() };
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
pub fn block_facts(
    spec: &ModelSpec,
    batch: usize,
    seq: usize,
    precision: Precision,
    attention: &dyn AttentionKernel,
) -> Result<Vec<BlockFacts>, EstimateError> {
    if batch == 0 {
        return Err(EstimateError::Zero { key: "train.micro_batch_size" });
    }
    if seq == 0 {
        return Err(EstimateError::Zero { key: "data.seq_len" });
    }
    let saved = saved_len(spec, batch, seq, attention)?;
    let replay = Replay::new(spec, batch, seq, dt(precision), saved).with_saved_half(attention.saved_tolerates_half());
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
/// attention kernel runs with `threads` threads (its workspace depends on them).
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
) -> Result<MicroBatch, EstimateError> {
    if batch == 0 {
        return Err(EstimateError::Zero { key: "train.micro_batch_size" });
    }
    if seq == 0 {
        return Err(EstimateError::Zero { key: "data.seq_len" });
    }
    ava_core::check_plan(plan, spec.layers).map_err(|message| EstimateError::Plan { message })?;
    let saved = saved_len(spec, batch, seq, attention)?;
    let [fwd, bwd] = workspace_lens(spec, batch, seq, attention, threads)?;
    let peak = Replay::new(spec, batch, seq, dt(precision), saved)
        .with_saved_half(attention.saved_tolerates_half())
        .with_workspace(fwd, bwd)
        .forward_backward(plan, accumulating);
    Ok(MicroBatch {
        peak_bytes: peak.bytes,
        gradient_bytes: peak.by_cat[Cat::ParamGrads as usize],
        peak_at: if peak.op.is_empty() { peak.phase } else { format!("{}, in {}", peak.phase, peak.op) },
    })
}

/// `1234567` → `1,234,567`.
pub(crate) fn grouped(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
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
    let (batch, seq) = (config.train.micro_batch_size, config.data.seq_len);
    let precision = config.train.precision;
    let accumulation = config.train.gradient_accumulation_steps.max(1);
    let x = Dims::new(spec, batch, seq, precision.bytes());
    let defs = spec.params();
    let n_params: u64 = defs.iter().map(|d| d.numel() as u64).sum();
    let mut terms = Vec::new();
    fn add(terms: &mut Vec<Term>, component: Component, name: &str, formula: String, bytes: u64) {
        terms.push(Term { component, name: name.to_string(), formula, bytes });
    }

    // Parameters: f32 masters (and a cast copy for the forward pass), or the weights in the
    // compute type only (`train.master_weights`: none, kahan, tier).
    let n = grouped(n_params);
    let masters = config.train.master_weights;
    let stored_half = masters != MasterWeights::F32 && precision != Precision::Fp32;
    // Bytes per weight as stored: the compute type's 2 without f32 masters, else 4.
    let stored_size: u64 = if stored_half { 2 } else { 4 };
    let inside = config.train.step_in_backward;
    add(
        &mut terms,
        Component::Parameters,
        "rotary tables (cos, sin in f32 and f64)",
        format!("T·D·(2·4 + 2·8) = {}·{}·24", x.t, x.hd),
        crate::model::fused::RopeTables::bytes(x.t as usize, x.hd as usize),
    );

    // Optimizer state, from the plugin's layout, summed per state name.
    struct State {
        name: String,
        bytes: u64,
        /// Every buffer of this name has one element per parameter element, of one type.
        per_element: bool,
        dtype: ava_core::DType,
    }
    let mut states: Vec<State> = Vec::new();
    let host = match (stored_half, masters) {
        (true, MasterWeights::Tier) => HostState::Master,
        (true, MasterWeights::Kahan) => HostState::Compensation(match precision {
            Precision::F16 => ava_core::DType::F16,
            _ => ava_core::DType::BF16,
        }),
        _ => HostState::Nothing,
    };
    let mut layouts = Vec::with_capacity(defs.len());
    for def in &defs {
        let shape: Vec<u64> = def.shape.iter().map(|&s| s as u64).collect();
        let mut layout: Vec<StateSpec> =
            plugins.optimizer.state_layout(&ParamInfo::new(&def.name, &shape)).map_err(|e| {
                EstimateError::Optimizer { param: def.name.clone(), shape: def.shape.clone(), message: e.to_string() }
            })?;
        // The engine's own buffers, placed with the plugin's: f32 masters, a compensation.
        layout.extend(host.spec(def.numel()));
        layouts.push(layout);
    }
    // ZeRO stage ≥ 1 on several ranks: the rank holding the most state holds only its own
    // parameters' (whole parameters, contiguous in model order).
    let stage = if world > 1 { config.distributed.zero_stage } else { 0 };
    let all_bytes: Vec<u64> = layouts.iter().map(|l| l.iter().map(StateSpec::bytes).sum()).collect();
    let held: Vec<bool> = if stage >= 1 {
        let owner = crate::dist::owners(&all_bytes, world);
        let share = |r: usize| all_bytes.iter().zip(&owner).filter(|(_, o)| **o == r).map(|(b, _)| b).sum::<u64>();
        let largest = (0..world).max_by_key(|&r| (share(r), std::cmp::Reverse(r))).unwrap_or(0);
        let who = rank.unwrap_or(largest);
        owner.iter().map(|&o| o == who).collect()
    } else {
        vec![true; layouts.len()]
    };
    // The weights: all of them, or at stage 3 this rank's own (the others are gathered block
    // by block, counted with the activations' peak below).
    let (resident, resident_n) = if stage >= 3 {
        let mine: u64 = defs.iter().zip(&held).filter(|(_, h)| **h).map(|(d, _)| d.numel() as u64).sum();
        (mine, format!("N/{world} ≈ {} (this rank's whole parameters, ZeRO stage 3)", grouped(mine)))
    } else {
        (n_params, format!("N = {n}"))
    };
    if stored_half {
        add(
            &mut terms,
            Component::Parameters,
            &format!("{} weights (the only resident copy; master_weights: {})", precision.as_str(), masters.as_str()),
            format!("2 · {resident_n}"),
            2 * resident,
        );
    } else {
        add(&mut terms, Component::Parameters, "f32 master weights", format!("4 · {resident_n}"), 4 * resident);
    }
    if precision != Precision::Fp32 && !stored_half && stage < 3 {
        add(
            &mut terms,
            Component::Parameters,
            &format!("{} copy of the weights (cast in the graph)", precision.as_str()),
            format!("2 · N = 2 · {n}"),
            2 * n_params,
        );
    }
    let share_note = (stage >= 1).then(|| {
        let total: u64 = all_bytes.iter().sum();
        let whose = rank.map_or("the largest rank's".to_string(), |r| format!("rank {r}'s"));
        format!(
            " ({whose} share of {}: ZeRO stage {stage} over {world} ranks, whole parameters)",
            ava_core::format_size(total)
        )
    });
    let mut per_param = Vec::with_capacity(defs.len());
    let mut buffers_of = Vec::with_capacity(defs.len()); // per parameter, its buffers' bytes
    for ((layout, &mine), def) in layouts.into_iter().zip(&held).zip(&defs) {
        let layout = if mine { layout } else { Vec::new() };
        per_param.push(layout.iter().map(StateSpec::bytes).sum::<u64>());
        buffers_of.push(layout.iter().map(StateSpec::bytes).collect::<Vec<_>>());
        for spec in layout {
            let per_element = spec.len == def.numel() as u64;
            match states.iter_mut().find(|s| *s.name == *spec.name) {
                Some(s) => {
                    s.bytes += spec.bytes();
                    s.per_element &= per_element && s.dtype == spec.dtype;
                }
                None => states.push(State {
                    name: spec.name.to_string(),
                    bytes: spec.bytes(),
                    per_element,
                    dtype: spec.dtype,
                }),
            }
        }
    }
    // Per parameter, the state bytes its step reads from the tier (0: kept in memory).
    let mut streamed_bytes = vec![0u64; per_param.len()];
    let mut streamed_through = None;
    let mut offload_records = Vec::new();
    let streamed = match config.offload.tiers.offloaded() {
        Some(share) => {
            let streamed = crate::train::streamed_params(&per_param, config.offload.tiers.in_ram());
            for ((out, &b), &s) in streamed_bytes.iter_mut().zip(&per_param).zip(&streamed) {
                *out = if s { b } else { 0 };
            }
            offload_records =
                buffers_of.iter().zip(&streamed).filter(|(_, s)| **s).flat_map(|(b, _)| b.iter().copied()).collect();
            let total_streamed = streamed_bytes.iter().sum::<u64>();
            let kept = per_param.iter().sum::<u64>() - total_streamed;
            streamed_through = Some((share.name.clone(), total_streamed));
            add(
                &mut terms,
                Component::Optimizer,
                &format!("state kept in memory{}", share_note.as_deref().unwrap_or("")),
                format!(
                    "the first parameters' state, up to the ram share of offload.tiers ({:.0}%)",
                    (config.offload.tiers.in_ram() * 100.0).abs()
                ),
                kept,
            );
            true
        }
        None => false,
    };
    for s in states.iter().filter(|_| !streamed) {
        let (size, dtype) = (s.dtype.size(), s.dtype.as_str());
        // One element per parameter element, for every parameter: size · N.
        let formula = if s.per_element && s.bytes == size as u64 * n_params {
            format!("{size} · N = {size} · {n} ({dtype})")
        } else {
            format!("Σ over parameters of the state_layout bytes ({dtype})")
        };
        let name = match s.name.as_str() {
            crate::train::MASTER => "f32 master weights (ava.master, with the state)".to_string(),
            crate::train::COMPENSATION => format!("{} compensation of the weights (ava.kahan)", precision.as_str()),
            _ => s.name.clone(),
        };
        let name = format!("{name}{}", share_note.as_deref().unwrap_or(""));
        add(&mut terms, Component::Optimizer, &name, formula, s.bytes);
    }
    if states.is_empty() {
        add(&mut terms, Component::Optimizer, "no state", "state_layout is empty for every parameter".into(), 0);
    }

    // Data: the loader's queue and the batch in use.
    let (workers, prefetch) = (config.data.num_workers as u64, config.data.prefetch_factor as u64);
    if config.data.source == crate::config::DataSource::Shards {
        add(
            &mut terms,
            Component::Data,
            "the corpus's mapped shards",
            "0: not resident (each read's 2 MiB window is handed back to the page cache once copied)".into(),
            0,
        );
    }
    let batch_bytes = x.b * (x.t + 1) * 4;
    // Packed documents: a queued batch also holds its (B, T) document ids.
    let packed = config.data.packing == crate::data::Packing::Document;
    if workers > 0 {
        let (what, row) =
            if packed { ("loader queue (ids and document ids)", "2T+1") } else { ("loader queue", "T+1") };
        let row_len = if packed { 2 * x.t + 1 } else { x.t + 1 };
        add(
            &mut terms,
            Component::Data,
            what,
            format!("W · prefetch · B·({row})·4 = {workers} · {prefetch} · {}·{row_len}·4", x.b),
            workers * prefetch * x.b * row_len * 4,
        );
    }
    if packed {
        add(
            &mut terms,
            Component::Data,
            "packed documents of the batch in use: its document ids, the step's ids and positions",
            format!("3 · B·T·4 = 3 · {}·4", x.n()),
            3 * x.n() * 4,
        );
    }
    add(
        &mut terms,
        Component::Data,
        "batch in use, its inputs and targets",
        format!("B·(T+1)·4 + 2 · B·T·4 = {}·{}·4 + 2 · {}·4", x.b, x.t + 1, x.n()),
        batch_bytes + 2 * x.n() * 4,
    );

    // The checkpoint policy decides on the block facts, with the budget left for activations.
    let facts = block_facts(spec, batch, seq, precision, plugins.attention)?;
    let saved = saved_len(spec, batch, seq, plugins.attention)?;
    let rank_threads = rank_threads(config.train.threads, world);
    let kernel_workspace = workspace_lens(spec, batch, seq, plugins.attention, rank_threads)?;
    let threads = rank_threads as u64;
    let workspace = threads * l2_bytes();
    // Gradient elements accumulated between micro-batches: every parameter's, or from ZeRO
    // stage 2 only this rank's (the others' are reduce-scattered away during backward).
    let accumulated = if stage >= 2 {
        defs.iter().zip(&held).filter(|(_, own)| **own).map(|(d, _)| d.numel() as u64).sum()
    } else {
        n_params
    };
    // Held through the micro-batch: every term so far, the accumulators, the workspace.
    let outside_micro_batch =
        terms.iter().map(|t| t.bytes).sum::<u64>() + if accumulation > 1 { 4 * accumulated } else { 0 } + workspace;
    // What is not activations: the above and this micro-batch's gradients (inside backward,
    // only a few at a time).
    let fixed = outside_micro_batch + if inside { 0 } else { 4 * n_params };
    let zero = (world > 1).then(|| crate::estimate::replay::ZeroModel {
        stage,
        owned: held.clone(),
        bucket: config.distributed.bucket_size.0.clamp(4096, 1 << 30),
        stored: defs.iter().map(|d| d.numel() as u64 * stored_size).collect(),
    });
    let step = StepModel {
        zero,
        inside,
        stored_half,
        scratch: stored_half && masters != MasterWeights::Tier,
        after: true,
        streamed: streamed_bytes,
        prefetch: config.offload.prefetch,
    };
    let budget = config.memory.budget.0;
    // 0 would mean "no budget"; a budget already spent leaves the smallest one.
    let target = if budget == 0 { 0 } else { budget.saturating_sub(fixed).max(1) };
    // Both the trainer and the estimate offer the offload tier (there always is one, `ram`
    // by default); the replay counts an offloaded input as held, which is what `ram` does.
    let mut ctx = CheckpointContext { budget_bytes: target, offload_available: true };
    let replay = Replay::new(spec, batch, seq, dt(precision), saved)
        .with_saved_half(plugins.attention.saved_tolerates_half())
        .with_workspace(kernel_workspace[0], kernel_workspace[1])
        .with_step(step.clone());
    // The policy predicts the blocks' memory from their facts; the logits, the loss and the
    // gradients in flight are not in them, and its model is coarser than the replay. So the
    // budget it is given is calibrated against the replay: the largest budget whose plan
    // the replay fits in memory.budget, found by bisection (a larger budget gives a plan
    // that holds more). If no plan fits, the policy refuses the largest budget that does not
    // give one too large, and says why. A policy that ignores the budget (its plan for
    // 1 byte is the same) is asked once, and the estimate says "over budget" if it is.
    let decide = |budget_bytes: u64| {
        let plan = plugins.checkpoint.decide(&facts, &CheckpointContext { budget_bytes, ..ctx });
        let plan = plan.map_err(|e| EstimateError::Checkpoint { message: e.to_string() })?;
        ava_core::check_plan(&plan, facts.len()).map_err(|message| EstimateError::Plan { message })?;
        let peak = replay.forward_backward(&plan, accumulation > 1);
        // The estimate's peak, as the breakdown below adds it up.
        let fits = outside_micro_batch + peak.bytes + peak.tier_peak <= budget;
        Ok((plan, peak, fits))
    };
    // `lo` does not give a plan too large (it fits, or is refused), `hi` does: the largest
    // such budget and its outcome.
    let bisect = |mut lo: u64, mut at_lo: Result<_, EstimateError>, mut hi: u64| {
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            match decide(mid) {
                Ok((_, _, false)) => hi = mid,
                other => (lo, at_lo) = (mid, other),
            }
        }
        (lo, at_lo)
    };
    let mut outcome = decide(target);
    let same_plan = |a: &Result<_, EstimateError>, b: &Result<(Vec<BlockDecision>, _, _), EstimateError>| matches!((a, b), (Ok((p, _, _)), Ok((q, _, _))) if p == q);
    if target > 0 && !same_plan(&outcome, &decide(1)) {
        // The most worth giving: room for every block's activations (a budget past that keeps
        // them all), or all of memory.budget (for a policy whose model over-predicts).
        let all_kept = (facts.iter().map(|f| f.activation_bytes + f.input_bytes).sum::<u64>() + 1).max(budget);
        match &outcome {
            Ok((_, _, false)) => {
                let at_one = decide(1);
                if !matches!(at_one, Ok((_, _, false))) {
                    (ctx.budget_bytes, outcome) = bisect(1, at_one, target);
                }
            }
            // Refused, or fits: a larger budget may still fit (the policy's block model can
            // over-predict the replay).
            Ok((_, _, true)) | Err(EstimateError::Checkpoint { .. }) if all_kept > target => {
                let at_top = decide(all_kept);
                let (raised, at_raised) = match at_top {
                    Ok((_, _, true)) => (all_kept, at_top),
                    Ok((_, _, false)) => bisect(target, decide(target), all_kept),
                    err => (all_kept, err),
                };
                // Only a plan that fits replaces the first answer: a refusal keeps the
                // policy's own words about the budget memory.budget leaves.
                if matches!(at_raised, Ok((_, _, true))) {
                    (ctx.budget_bytes, outcome) = (raised, at_raised);
                }
            }
            _ => {}
        }
    }
    let (plan, peak) = match outcome {
        Ok((plan, peak, _)) => (plan, peak),
        Err(EstimateError::Checkpoint { mut message }) => {
            if budget > 0 && budget <= fixed {
                // The 1 byte passed above: say where the budget went.
                message.push_str(&format!(
                    ". memory.budget ({}) does not even cover the rest of the step (parameters, gradients, \
                     optimizer state, data and workspace: {}); raise it",
                    render::bytes(budget),
                    render::bytes(fixed)
                ));
            } else if ctx.budget_bytes < target {
                message.push_str(&format!(
                    ". That is what memory.budget ({}) leaves for activations ({}) less {} for the logits, loss \
                     and gradients in flight, which the block facts do not include: with more, the policy's plan \
                     would not fit. Raise memory.budget, or lower train.micro_batch_size or data.seq_len",
                    render::bytes(budget),
                    render::bytes(target),
                    render::bytes(target - ctx.budget_bytes)
                ));
            }
            return Err(EstimateError::Checkpoint { message });
        }
        Err(e) => return Err(e),
    };
    drop(replay);
    let at = |c: Cat| peak.by_cat[c as usize];
    if accumulation > 1 && stage >= 2 {
        add(
            &mut terms,
            Component::Gradients,
            &format!("f32 gradient accumulators of this rank's parameters (ZeRO stage 2 over {world} ranks)"),
            format!("4 · N/{world} ≈ 4 · {} (whole parameters)", grouped(accumulated)),
            4 * accumulated,
        );
    } else if accumulation > 1 {
        add(
            &mut terms,
            Component::Gradients,
            "f32 gradient accumulators (earlier micro-batches)",
            format!("4 · N = 4 · {n}"),
            4 * n_params,
        );
    }
    if at(Cat::Step) > 0 {
        add(
            &mut terms,
            Component::Optimizer,
            "optimizer step's transients at the peak",
            format!(
                "the global norm's g² of one gradient (4 · its elements){}{}",
                if step.scratch { ", one parameter widened to f32 to be stepped (4 · its elements)" } else { "" },
                if streamed { ", the state of the parameter being stepped, read from the tier" } else { "" }
            ),
            at(Cat::Step),
        );
    }
    if let Some((tier, total)) = &streamed_through {
        add(
            &mut terms,
            Component::Optimizer,
            "streamed state held by the tier (read ahead, written behind)",
            format!(
                "at most, as the step goes: the next offload.prefetch = {} parameters' state read ahead and the \
                 last one's written behind (of the {} streamed through {tier}; a tier that lets more writes wait \
                 for the disk, as nvme's max_in_flight does, holds up to that much more)",
                config.offload.prefetch,
                render::bytes(*total)
            ),
            peak.tier_peak,
        );
    }
    if stage >= 3 {
        add(
            &mut terms,
            Component::Parameters,
            &format!("weights gathered from the other ranks, and their casts (ZeRO stage 3 over {world} ranks)"),
            "at the peak: the blocks whose graph holds them (kept blocks until their backward; one recomputed \
             block), the embedding and the head, each in the stored type plus its cast to the compute type"
                .to_string(),
            at(Cat::Params),
        );
    }
    let grads_now = at(Cat::ParamGrads);
    let label = if inside {
        "f32 gradients in flight (each stepped inside backward and freed)"
    } else if stage >= 2 {
        "f32 gradients: this micro-batch's not yet reduced, buckets in flight, this rank's reduced ones"
    } else if accumulation > 1 {
        "this micro-batch's f32 gradients"
    } else {
        "f32 gradients (the accumulators)"
    };
    let formula = if inside {
        format!(
            "4 · {} elements at the peak (a stretch's gradients{}), of N = {n}",
            grouped(grads_now / 4),
            if step.scratch { " and a parameter's f32 scratch" } else { "" }
        )
    } else if grads_now >= 4 * n_params {
        format!("4 · N = 4 · {n} (all: the peak comes after the backward)")
    } else {
        format!("4 · {} of N = {n} elements (produced by the backward before the peak)", grouped(grads_now / 4))
    };
    add(&mut terms, Component::Gradients, label, formula, grads_now + at(Cat::Accumulators));

    // The saved buffer's bytes per element as held between the passes.
    let saved_size = if precision != Precision::Fp32 && plugins.attention.saved_tolerates_half() { 2 } else { 4 };
    let block = block::block_terms(&x, saved, saved_size, spec.moe.map(|m| (m.experts as u64, m.top_k as u64)));
    let block_bytes = facts.first().map_or(0, |f| f.activation_bytes);
    let per_block = block_bytes.saturating_sub(saved * saved_size).max(1);
    let nd_p = x.n() * x.d * x.p;
    let count = |bytes: u64, unit: u64| bytes as f64 / unit.max(1) as f64;
    let activation_terms = [
        (
            Cat::Embedding,
            "embedding rows and their Var copy".to_string(),
            format!("2 · B·T·d·p = 2 · {}·{}·{}", x.n(), x.d, x.p),
        ),
        (
            Cat::Blocks,
            "activations of kept blocks".to_string(),
            format!(
                "{:.2} × {} per kept block (per-block terms below, without the saved buffer)",
                count(at(Cat::Blocks), per_block),
                render::bytes(per_block)
            ),
        ),
        (
            Cat::AttnSaved,
            "attention kernel's saved buffers".to_string(),
            format!(
                "{:.0} × saved_len · {saved_size} = {:.0} × {} · {saved_size}",
                count(at(Cat::AttnSaved), saved * saved_size),
                count(at(Cat::AttnSaved), saved * saved_size),
                grouped(saved)
            ),
        ),
        (
            Cat::Inputs,
            "inputs of recomputed blocks".to_string(),
            format!(
                "{:.0} × B·T·d·p = {:.0} × {}·{}·{}",
                count(at(Cat::Inputs), nd_p),
                count(at(Cat::Inputs), nd_p),
                x.n(),
                x.d,
                x.p
            ),
        ),
        (
            Cat::Recompute,
            "activations of the block being recomputed".to_string(),
            "one block's activations while it runs detached or is recomputed (per-block terms)".to_string(),
        ),
        (
            Cat::Head,
            "head: final norm, logits, loss".to_string(),
            format!(
                "norm B·T·d·p + logits B·T·V·p{} = {}·{}·{} + {}·{}·{}{}, plus the loss's per-row values",
                if x.cast() { " + B·T·V·4 (f32 logits)" } else { "" },
                x.n(),
                x.d,
                x.p,
                x.n(),
                x.v,
                x.p,
                if x.cast() { format!(" + {}·{}·4", x.n(), x.v) } else { String::new() }
            ),
        ),
        (
            Cat::Backward,
            "backward: intermediate gradients and what they hold".to_string(),
            "candle's backward replayed: gradients not yet consumed, the expressions tracked gradients keep alive, \
             zeros from or_insert, op temporaries"
                .to_string(),
        ),
    ];
    for (cat, name, formula) in activation_terms {
        if at(cat) > 0 {
            add(&mut terms, Component::Activations, &name, formula, at(cat));
        }
    }
    if kernel_workspace != [0, 0] {
        // Listed even when it is not live at the peak, so the declaration is visible.
        let [fwd, bwd] = kernel_workspace;
        add(
            &mut terms,
            Component::Activations,
            "attention kernel's workspace (during a call)",
            format!(
                "workspace_len · 4: forward {} · 4, backward {} · 4 (the kernel's declaration); {} at the peak",
                grouped(fwd),
                grouped(bwd),
                if at(Cat::AttnWorkspace) > 0 { "live" } else { "not live" }
            ),
            at(Cat::AttnWorkspace),
        );
    }
    add(
        &mut terms,
        Component::Activations,
        "matmul workspace (gemm packing slab per thread)",
        format!("threads · L2 = {threads} · {}", render::bytes(l2_bytes())),
        workspace,
    );

    // Grouped by component, in the order they were added within each.
    terms.sort_by_key(|t| Component::ALL.iter().position(|c| *c == t.component));
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
    let peak_at = if peak.op.is_empty() { peak.phase.clone() } else { format!("{}, in {}", peak.phase, peak.op) };
    // One rank's model states under each stage, for comparison with the configured one.
    let zero_stages = if world > 1 {
        // Every weight as held at stages 0–2 (whatever the configured stage): the stored
        // copy, the compute type's cast of f32 masters, the rotary tables.
        let cast_copy = if precision != Precision::Fp32 && !stored_half { 2 * n_params } else { 0 };
        let params =
            n_params * stored_size + cast_copy + crate::model::fused::RopeTables::bytes(x.t as usize, x.hd as usize);
        let state_all: u64 = all_bytes.iter().sum();
        // The rank estimated: its own parameters (at stage 0, the largest share's).
        let mine: Vec<bool> = if stage >= 1 {
            held.clone()
        } else {
            let owner = crate::dist::owners(&all_bytes, world);
            let share = |r: usize| all_bytes.iter().zip(&owner).filter(|(_, o)| **o == r).map(|(b, _)| b).sum::<u64>();
            let who = rank.unwrap_or_else(|| (0..world).max_by_key(|&r| (share(r), std::cmp::Reverse(r))).unwrap_or(0));
            owner.iter().map(|&o| o == who).collect()
        };
        let state_mine: u64 = all_bytes.iter().zip(&mine).filter(|(_, m)| **m).map(|(b, _)| b).sum();
        let params_n: u64 = defs.iter().zip(&mine).filter(|(_, m)| **m).map(|(d, _)| d.numel() as u64).sum();
        let params_mine = params_n * stored_size;
        let grads_mine: u64 = defs.iter().zip(&mine).filter(|(_, m)| **m).map(|(d, _)| 4 * d.numel() as u64).sum();
        let (g, b) = (4 * n_params, render::bytes);
        let k = state_all as f64 / n_params.max(1) as f64;
        let line = |stage: u8, formula: &str, parts: &[u64]| ZeroStage {
            stage,
            formula: format!(
                "{} = {}",
                formula.replace('K', &format!("K({k:.2})")),
                parts.iter().map(|&p| b(p)).collect::<Vec<_>>().join(" + ")
            ),
            bytes: parts.iter().sum(),
        };
        vec![
            line(0, "P + 4Ψ + KΨ", &[params, g, state_all]),
            line(1, "P + 4Ψ + KΨ/N", &[params, g, state_mine]),
            line(2, "P + 4Ψ/N + KΨ/N", &[params, grads_mine, state_mine]),
            line(3, "P/N + 4Ψ/N + KΨ/N", &[params_mine, grads_mine, state_mine]),
        ]
    } else {
        Vec::new()
    };
    Ok(Estimate {
        zero_stages,
        batch,
        seq_len: seq,
        precision,
        accumulation,
        num_params: n_params,
        terms,
        block_terms: block,
        status: status(breakdown.fraction(), budget).to_string(),
        breakdown,
        plan,
        block_facts: facts,
        activation_budget: ctx.budget_bytes,
        micro_batch_peak: peak.bytes,
        peak_at,
        offloaded: offload_records.iter().sum(),
        offload_records,
    })
}
