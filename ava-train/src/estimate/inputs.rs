//! What every term of the estimate is computed from: the model and the config with the sizes
//! derived from them once ([`Inputs`]), the optimizer state per parameter and which rank
//! holds it ([`Shares`]), how that state splits between memory and the offload tier
//! ([`Offload`]), and what the attention kernel and the compute threads declare for the
//! step's shape ([`Kernels`]). The term functions (`held`, `peak`, `zero`) take these and
//! nothing else; terms for another device take the same.

use ava_core::{BlockFacts, ParamInfo, StateSpec};

use super::block::Dims;
use super::replay::{ParkedInputs, StepModel, ZeroModel};
use super::{EstimateError, Plugins, block_facts, grouped, l2_bytes, rank_threads, saved_len, workspace_lens};
use crate::config::{Config, MasterWeights, Precision};
use crate::device::DeviceSpec;
use crate::model::{ModelSpec, ParamDef};
use crate::train::HostState;

/// The model, the config and the sizes every term shares, derived once.
pub(super) struct Inputs<'a> {
    /// The model estimated.
    pub(super) spec: &'a ModelSpec,
    /// The run's config.
    pub(super) config: &'a Config,
    /// The plugins whose declared sizes are used.
    pub(super) plugins: Plugins<'a>,
    /// Data-parallel ranks.
    pub(super) world: usize,
    /// The rank estimated (None: the one holding the most optimizer state).
    pub(super) rank: Option<usize>,
    /// Sequences per micro-batch B.
    pub(super) batch: usize,
    /// Tokens per sequence T.
    pub(super) seq: usize,
    /// The compute precision.
    pub(super) precision: Precision,
    /// Micro-batches per optimizer step (at least 1).
    pub(super) accumulation: usize,
    /// The step's sizes (B, T, d, heads, F, V, bytes per element) for the formulas.
    pub(super) x: Dims,
    /// Every parameter, in model order.
    pub(super) defs: Vec<ParamDef>,
    /// Parameters N (elements).
    pub(super) n_params: u64,
    /// `train.master_weights`.
    pub(super) masters: MasterWeights,
    /// The weights are stored in the compute type, with no f32 master in memory.
    pub(super) stored_half: bool,
    /// Bytes per weight as stored: the compute type's 2 without f32 masters, else 4.
    pub(super) stored_size: u64,
    /// Each parameter is stepped inside backward (`train.step_in_backward`).
    pub(super) inside: bool,
    /// The ZeRO stage in effect: `distributed.zero_stage` on several ranks, else 0.
    pub(super) stage: u8,
    /// `train.device`: on a GPU the terms count device memory, and host memory apart.
    pub(super) device: DeviceSpec,
}

impl<'a> Inputs<'a> {
    /// The inputs of rank `rank` of `world` for `spec` under `config`.
    pub(super) fn new(
        spec: &'a ModelSpec,
        config: &'a Config,
        plugins: Plugins<'a>,
        world: usize,
        rank: Option<usize>,
    ) -> Self {
        let (batch, seq) = (config.train.micro_batch_size, config.data.seq_len);
        let precision = config.train.precision;
        let defs = spec.params();
        let masters = config.train.master_weights;
        let stored_half = masters != MasterWeights::F32 && precision != Precision::Fp32;
        Self {
            spec,
            config,
            plugins,
            world,
            rank,
            batch,
            seq,
            precision,
            accumulation: config.train.gradient_accumulation_steps.max(1),
            x: Dims::new(spec, batch, seq, precision.bytes()),
            n_params: defs.iter().map(|d| d.numel() as u64).sum(),
            defs,
            masters,
            stored_half,
            stored_size: if stored_half { 2 } else { 4 },
            inside: config.train.step_in_backward,
            stage: if world > 1 { config.distributed.zero_stage } else { 0 },
            device: config.train.device,
        }
    }

    /// Whether the run computes on a GPU (the terms are device memory).
    pub(super) fn gpu(&self) -> bool {
        self.device.is_cuda()
    }

    /// Where `Offload` blocks' inputs wait for backward, as `model::Parking::for_run`
    /// decides: on a GPU in page-locked host memory with `ram`, through any other tier's
    /// byte API; on the CPU in the tier, which is host memory counted with the rest.
    pub(super) fn parked_inputs(&self) -> ParkedInputs {
        match self.gpu() {
            false => ParkedInputs::Held,
            true if self.config.plugins.offload.name == crate::config::Tiers::RAM => ParkedInputs::Pinned,
            true => ParkedInputs::Tier,
        }
    }

    /// N with its digits grouped, for the formulas.
    pub(super) fn n(&self) -> String {
        grouped(self.n_params)
    }

    /// Elements of the parameters marked in `own` (one flag per parameter).
    pub(super) fn numel_of(&self, own: &[bool]) -> u64 {
        self.defs.iter().zip(own).filter(|(_, o)| **o).map(|(d, _)| d.numel() as u64).sum()
    }

    /// Each step widens its parameter into an f32 scratch (`none`, `kahan`; a `tier` master
    /// is itself the f32 copy).
    pub(super) fn scratch(&self) -> bool {
        self.stored_half && self.masters != MasterWeights::Tier
    }

    /// Gradient elements accumulated between micro-batches: every parameter's, or from ZeRO
    /// stage 2 only this rank's (the others' are reduce-scattered away during backward).
    pub(super) fn accumulated(&self, held: &[bool]) -> u64 {
        if self.stage >= 2 { self.numel_of(held) } else { self.n_params }
    }

    /// The engine's own buffers placed with the optimizer's: an f32 master or a compensation
    /// in the compute type, or nothing.
    fn host_state(&self) -> HostState {
        match (self.stored_half, self.masters) {
            (true, MasterWeights::Tier) => HostState::Master,
            (true, MasterWeights::Kahan) => HostState::Compensation(match self.precision {
                Precision::F16 => ava_core::DType::F16,
                _ => ava_core::DType::BF16,
            }),
            _ => HostState::Nothing,
        }
    }
}

/// The optimizer state buffers of one name (`exp_avg`, `ava.master`) that this rank holds,
/// summed over its parameters.
pub(super) struct State {
    /// The buffer's name in the layout.
    pub(super) name: String,
    /// Bytes, over this rank's parameters.
    pub(super) bytes: u64,
    /// Every buffer of this name has one element per parameter element, of one type.
    pub(super) per_element: bool,
    /// Its element type.
    pub(super) dtype: ava_core::DType,
}

/// The optimizer state of every parameter (the plugin's layout with the engine's own
/// buffers) and which of it this rank holds.
pub(super) struct Shares {
    /// Per parameter, the bytes of its state, whichever rank holds it.
    pub(super) all_bytes: Vec<u64>,
    /// Per parameter, whether this rank holds its state (every one below ZeRO stage 1).
    pub(super) held: Vec<bool>,
    /// Per parameter, the bytes of each of its buffers this rank holds (none for another
    /// rank's parameter).
    pub(super) buffers: Vec<Vec<u64>>,
    /// This rank's buffers by name, in the order the names first appear.
    pub(super) states: Vec<State>,
}

impl Shares {
    /// Asks the optimizer for every parameter's `state_layout` and splits it by rank: from
    /// ZeRO stage 1 the rank holds only its own parameters' (whole parameters, contiguous in
    /// model order).
    pub(super) fn new(s: &Inputs<'_>) -> Result<Self, EstimateError> {
        let layouts = layouts(s)?;
        let all_bytes: Vec<u64> = layouts.iter().map(|l| l.iter().map(StateSpec::bytes).sum()).collect();
        let held = if s.stage >= 1 { owned_by(&all_bytes, s.world, s.rank) } else { vec![true; layouts.len()] };
        let mut states: Vec<State> = Vec::new();
        let mut buffers = Vec::with_capacity(layouts.len());
        for ((layout, &mine), def) in layouts.into_iter().zip(&held).zip(&s.defs) {
            let layout = if mine { layout } else { Vec::new() };
            buffers.push(layout.iter().map(StateSpec::bytes).collect::<Vec<_>>());
            for spec in layout {
                add_state(&mut states, &spec, spec.len == def.numel() as u64);
            }
        }
        Ok(Self { all_bytes, held, buffers, states })
    }

    /// Per parameter, the state bytes this rank holds.
    pub(super) fn per_param(&self) -> Vec<u64> {
        self.buffers.iter().map(|b| b.iter().sum::<u64>()).collect()
    }
}

/// Every parameter's state layout: the optimizer's, then the engine's own buffer.
fn layouts(s: &Inputs<'_>) -> Result<Vec<Vec<StateSpec>>, EstimateError> {
    let host = s.host_state();
    let mut layouts = Vec::with_capacity(s.defs.len());
    for def in &s.defs {
        let shape: Vec<u64> = def.shape.iter().map(|&s| s as u64).collect();
        let mut layout: Vec<StateSpec> =
            s.plugins.optimizer.state_layout(&ParamInfo::new(&def.name, &shape)).map_err(|e| {
                EstimateError::Optimizer { param: def.name.clone(), shape: def.shape.clone(), message: e.to_string() }
            })?;
        layout.extend(host.spec(def.numel()));
        layouts.push(layout);
    }
    Ok(layouts)
}

/// Adds one buffer to the sums by name; `per_element`: it has one element per parameter
/// element.
fn add_state(states: &mut Vec<State>, spec: &StateSpec, per_element: bool) {
    match states.iter_mut().find(|s| *s.name == *spec.name) {
        Some(s) => {
            s.bytes += spec.bytes();
            s.per_element &= per_element && s.dtype == spec.dtype;
        }
        None => states.push(State { name: spec.name.to_string(), bytes: spec.bytes(), per_element, dtype: spec.dtype }),
    }
}

/// The parameters whose state rank `rank` of `world` steps, split by whole parameters as the
/// trainer splits it (`dist::owners`); None: the rank with the largest share (the lowest
/// such rank).
pub(super) fn owned_by(all_bytes: &[u64], world: usize, rank: Option<usize>) -> Vec<bool> {
    let owner = crate::dist::owners(all_bytes, world);
    let share = |r: usize| all_bytes.iter().zip(&owner).filter(|(_, o)| **o == r).map(|(b, _)| b).sum::<u64>();
    let who = rank.unwrap_or_else(|| (0..world).max_by_key(|&r| (share(r), std::cmp::Reverse(r))).unwrap_or(0));
    owner.iter().map(|&o| o == who).collect()
}

/// How this rank's optimizer state splits between memory and the offload tier
/// (`offload.tiers`).
pub(super) struct Offload {
    /// Per parameter, the state bytes its step reads from the tier (0: kept in memory).
    pub(super) streamed: Vec<u64>,
    /// The tier the rest streams through and the bytes streamed; None without one.
    pub(super) through: Option<(String, u64)>,
    /// Bytes of state kept in memory (all of it without a tier).
    pub(super) kept: u64,
    /// The tier's records, one per streamed buffer, in bytes.
    pub(super) records: Vec<u64>,
    /// A GPU run's streamed state lives in page-locked host memory (`offload.tiers`' `ram`
    /// share) rather than in a tier: `through` names `ram`, and there are no records.
    pub(super) pinned: bool,
}

impl Offload {
    /// The first parameters' state up to the ram share stays in memory; the rest streams
    /// (`train::streamed_params`).
    pub(super) fn new(s: &Inputs<'_>, shares: &Shares) -> Self {
        let per_param = shares.per_param();
        let held: u64 = per_param.iter().sum();
        let tiers = &s.config.offload.tiers;
        let pinned = tiers.offloaded().is_none() && tiers.pinned(s.gpu()) > 0.0;
        let through = match tiers.offloaded() {
            Some(share) => share.name.clone(),
            None if pinned => crate::config::Tiers::RAM.to_string(),
            None => {
                let streamed = vec![0; per_param.len()];
                return Self { streamed, through: None, kept: held, records: Vec::new(), pinned };
            }
        };
        let is_streamed = crate::train::streamed_params(&per_param, tiers.resident(s.gpu()));
        let streamed: Vec<u64> = per_param.iter().zip(&is_streamed).map(|(&b, &on)| if on { b } else { 0 }).collect();
        let records = if pinned {
            Vec::new()
        } else {
            shares
                .buffers
                .iter()
                .zip(&is_streamed)
                .filter(|(_, on)| **on)
                .flat_map(|(b, _)| b.iter().copied())
                .collect()
        };
        let total = streamed.iter().sum::<u64>();
        Self { streamed, through: Some((through, total)), kept: held - total, records, pinned }
    }

    /// Whether any state streams through a tier.
    pub(super) fn is_on(&self) -> bool {
        self.through.is_some()
    }
}

/// The optimizer step as the replay runs it after backward: inside backward or after it,
/// the weights' storage, the streamed state, and on several ranks this rank's ZeRO share.
pub(super) fn step_model(s: &Inputs<'_>, shares: &Shares, offload: &Offload) -> StepModel {
    let zero = (s.world > 1).then(|| ZeroModel {
        stage: s.stage,
        owned: shares.held.clone(),
        bucket: s.config.distributed.bucket_size.0.clamp(4096, 1 << 30),
        stored: s.defs.iter().map(|d| d.numel() as u64 * s.stored_size).collect(),
    });
    StepModel {
        zero,
        inside: s.inside,
        stored_half: s.stored_half,
        scratch: s.scratch(),
        after: true,
        streamed: offload.streamed.clone(),
        prefetch: s.config.offload.prefetch,
        pinned: offload.pinned,
    }
}

/// What the attention kernel declares for the step's shape, and the compute threads'
/// workspace.
pub(super) struct Kernels {
    /// Per-block facts for the checkpoint policy.
    pub(super) facts: Vec<BlockFacts>,
    /// The kernel's saved f32s for one call, per its `saved_len` (the standard kernel's
    /// probabilities, (B, H, T, T)).
    pub(super) saved: u64,
    /// Bytes per element of the saved buffer as held between the passes: 2 in a half run
    /// for a kernel that tolerates it, else 4.
    pub(super) saved_size: u64,
    /// Its declared workspace for one forward and one backward call (f32s).
    pub(super) workspace_lens: [u64; 2],
    /// This rank's compute threads.
    pub(super) threads: u64,
    /// gemm's packing slabs, one L2-sized per thread (bytes); none on a GPU (cuBLAS's
    /// workspace is outside the pool the estimate counts).
    pub(super) gemm_workspace: u64,
}

impl Kernels {
    /// Asks the attention kernel about the step's shape (its errors name the shape), for the
    /// device the run computes on: a GPU call's workspace is its device declaration, and the
    /// saved buffer stays in f32 there.
    pub(super) fn new(s: &Inputs<'_>) -> Result<Self, EstimateError> {
        let attention = s.plugins.attention;
        let facts = block_facts(s.spec, s.batch, s.seq, s.precision, attention, s.device)?;
        let saved = saved_len(s.spec, s.batch, s.seq, attention)?;
        let threads = rank_threads(s.config.train.threads, s.world);
        let device = if s.gpu() { ava_core::Device::Cuda } else { ava_core::Device::Cpu };
        let workspace_lens = workspace_lens(s.spec, s.batch, s.seq, attention, threads, device)?;
        let threads = threads as u64;
        let half = s.precision != Precision::Fp32 && attention.saved_tolerates_half() && !s.gpu();
        let saved_size = if half { 2 } else { 4 };
        let gemm_workspace = if s.gpu() { 0 } else { threads * l2_bytes() };
        Ok(Self { facts, saved, saved_size, workspace_lens, threads, gemm_workspace })
    }
}
