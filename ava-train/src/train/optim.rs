//! The optimizer plugin applied to the model: the options the engine fills in from the
//! model, state buffers allocated by the engine from the plugin's declared layout, and an
//! in-place candle op that hands each parameter, its gradient and its state to the plugin's
//! `step`.
//!
//! The state of some parameters may be streamed through an offload tier (`offload.tiers`):
//! between steps it lives only in the tier; during the optimizer step each such parameter's
//! state is read back, updated and written out again, while the tier reads the next ones
//! ahead ([`OptimizerState::for_each`]), so memory holds a few parameters' state instead of
//! all of it (ZeRO-Infinity's optimizer-state offload, one parameter per group). On a GPU
//! run the state lives in device memory, or its `ram` share in page-locked host memory
//! streamed through the device (`optim/page_locked.rs`). Where the state lives away from the
//! step is one value, a [`Home`], chosen when the state is allocated and placed.

use std::cell::RefCell;
use std::sync::Arc;
use std::time::Instant;

use ava_core::{DType as StateDType, OffloadTier, Optimizer, ParamInfo, StateBuf, StateSpec, StepContext};
use candle_core::{CpuStorage, InplaceOp2, Layout, Tensor};

use super::TrainError;
use super::rounding::{self, Half};
use crate::config::PluginSelection;
use crate::memory::home::Home;
use crate::model::{ModelSpec, Param};
use crate::save::{BufDType, BufferView, NamedBuffer, SaveError, TensorSpec};

mod buffer;
mod io;
// The GPU half of the state's homes (device bytes, the page-locked `ram` share); the build
// chooses its real half or the uninhabited stand-ins inside it.
mod page_locked;
mod session;
mod step_op;
#[cfg(test)]
mod tests;

pub use buffer::StateBuffer;
pub use session::StepSession;
pub use step_op::step_param;

/// Options an optimizer may declare and the engine fills in from the model, so the two
/// cannot disagree: `head_dim`, the width of one attention head (`hidden_size / num_heads`),
/// which an optimizer that treats each head of `q_proj`/`k_proj` as a block needs (Adam-mini).
pub const MODEL_OPTIONS: [&str; 1] = ["head_dim"];

/// The optimizer selection's options as JSON, with the [`MODEL_OPTIONS`] the plugin's
/// manifest declares filled in from `spec`. A value the config sets must agree with the model.
pub fn optimizer_options(
    registry: &ava_plugins::Registry,
    selection: &PluginSelection,
    spec: &ModelSpec,
) -> Result<String, TrainError> {
    let declared = |option: &str| {
        registry
            .row(ava_core::PluginKind::Optimizer, &selection.name)
            .and_then(|row| row.manifest.as_ref())
            .is_some_and(|m| m.option_spec(option).is_some())
    };
    let mut options = selection.options.clone();
    if declared("head_dim") {
        let head_dim = spec.head_dim();
        match options.get("head_dim") {
            Some(given) if given.as_u64() != Some(head_dim as u64) => {
                return Err(TrainError::Invalid(format!(
                    "plugins.optimizer.head_dim is {given} but the model's heads are {head_dim} wide \
                     (model.hidden_size {} / model.num_heads {}): remove the option, the engine fills it in",
                    spec.hidden, spec.heads
                )));
            }
            _ => {
                options.insert("head_dim".into(), serde_json::Value::from(head_dim));
            }
        }
    }
    Ok(serde_json::Value::Object(options).to_string())
}

/// The tier streamed parameters' state lives in.
struct Streamed {
    tier: Arc<dyn OffloadTier>,
    /// The tier's name, for errors.
    name: String,
    /// Per parameter: whether its state lives in the tier.
    offloaded: Vec<bool>,
    /// Per parameter, its buffers' keys in the tier (none for a parameter kept here).
    keys: Vec<Vec<String>>,
    /// Parameters read ahead.
    prefetch: usize,
}

impl std::fmt::Debug for Streamed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Streamed").field("tier", &self.name).field("offloaded", &self.offloaded).finish()
    }
}

/// Which parameters' state streams through the tier when the fraction `in_ram` of the
/// bytes stays in memory: the first parameters (model order) up to that share stay, a
/// parameter straddling the line going to whichever side is nearer; the rest stream.
pub fn streamed_params(per_param: &[u64], in_ram: f64) -> Vec<bool> {
    let total: u64 = per_param.iter().sum();
    let keep = (in_ram.clamp(0.0, 1.0) * total as f64).round() as u64;
    let mut kept = 0;
    per_param
        .iter()
        .map(|&bytes| {
            if kept + bytes / 2 < keep {
                kept += bytes;
                false
            } else {
                bytes > 0
            }
        })
        .collect()
}

/// The key of a state buffer in the tier.
fn key(param: &str, buffer: &str) -> String {
    format!("optimizer/{param}/{buffer}")
}

/// What the copies of one step moved and cost (a GPU run's page-locked share,
/// `optim/page_locked/cuda.rs`).
#[derive(Debug, Default, Clone, Copy)]
pub struct CopyStats {
    /// Bytes uploaded to the device.
    pub uploaded: u64,
    /// Bytes written back to the host.
    pub written_back: u64,
    /// Seconds the compute stream waited for uploads (what the copies did not hide).
    pub wait_seconds: f64,
    /// Seconds the copies ran on their streams.
    pub copy_seconds: f64,
    /// The most bytes of this share's state on the device at once.
    pub peak_on_device: u64,
}

/// What streaming cost during one optimizer step.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StreamStats {
    /// Most bytes of state held at once: the engine's buffers and the tier's own memory.
    pub peak_resident: u64,
    /// Of that, the most the tier held (its writes in flight and prefetched reads).
    pub peak_tier: u64,
    /// Bytes read from the tier.
    pub read_bytes: u64,
    /// Bytes written back to it.
    pub written_bytes: u64,
    /// Seconds the step spent waiting on the tier: reads not yet done when a parameter's
    /// turn came, writes held back for room, and the final flush. What streaming did not
    /// hide behind compute. On a GPU run streaming from page-locked host memory: the seconds
    /// the compute stream waited for uploads, timed on the device.
    pub wait_seconds: f64,
    /// On a GPU run streaming from page-locked host memory, the seconds the copies ran on
    /// their own streams, both ways: with `wait_seconds`, how much of them compute hid.
    #[serde(default)]
    pub copy_seconds: f64,
}

/// Every parameter's optimizer state.
#[derive(Debug)]
pub struct OptimizerState {
    /// Per parameter (in model order), its buffers in layout order (no bytes held for a
    /// streamed parameter between steps).
    pub buffers: Vec<Vec<StateBuffer>>,
    /// Where the state of the parameters not kept where the step runs lives: a tier (set by
    /// [`allocate_shard`](Self::allocate_shard)), or a GPU run's page-locked host memory with
    /// the streams that move it (set by [`place_on`](Self::place_on)); never both.
    home: Home<Streamed, page_locked::PinnedState>,
    /// Per parameter, whether this process holds its state (under ZeRO, another rank may).
    held: Vec<bool>,
    /// The GPU a GPU run's state lives on: a parameter streamed through a tier visits it for
    /// its step. Never set in a build without the `cuda` feature (whose state cannot be
    /// placed on a device: [`place_on`](Self::place_on) refuses).
    gpu: Option<candle_core::CudaDevice>,
}

/// Equal when every buffer has the same bytes, wherever they live (tests compare runs).
impl PartialEq for OptimizerState {
    fn eq(&self, other: &Self) -> bool {
        let all = |s: &Self| {
            (0..s.buffers.len())
                .map(|i| s.read(i).unwrap_or_else(|e| panic!("reading the optimizer state to compare it: {e}")))
                .collect::<Vec<_>>()
        };
        self.buffers.len() == other.buffers.len() && all(self) == all(other)
    }
}

fn shape_u64(p: &Param) -> Vec<u64> {
    p.def.shape.iter().map(|&d| d as u64).collect()
}

fn tier_error(tier: &str, what: &str, e: ava_core::PluginError) -> TrainError {
    TrainError::Plugin { plugin: tier.to_string(), what: "offload", message: format!("{what}: {e}") }
}

/// The engine's own per-parameter buffers for `train.master_weights`, saved and placed
/// with the optimizer's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostState {
    /// None: f32 weights in memory, or bf16/f16 weights rounded stochastically.
    Nothing,
    /// `ava.master`: the f32 master weights (`master_weights: tier`).
    Master,
    /// `ava.kahan`: what rounding to the stored type lost, in that type (`master_weights: kahan`).
    Compensation(StateDType),
}

/// Name of the f32 master buffer.
pub const MASTER: &str = "ava.master";
/// Name of the compensation buffer.
pub const COMPENSATION: &str = "ava.kahan";

impl HostState {
    /// The buffer it adds to a parameter of `numel` elements.
    pub fn spec(self, numel: usize) -> Option<StateSpec> {
        match self {
            Self::Nothing => None,
            Self::Master => Some(StateSpec::new(MASTER, StateDType::F32, numel)),
            Self::Compensation(dtype) => Some(StateSpec::new(COMPENSATION, dtype, numel)),
        }
    }
}

/// Where a GPU run keeps the state of the parameters past its `device` share: in page-locked
/// host memory, visiting the device during each step.
#[derive(Debug, Clone, Copy)]
pub struct PinnedHome {
    /// Share of the state's bytes kept in device memory (the first parameters, model order).
    pub on_device: f64,
    /// Parameters uploaded ahead of the one being stepped.
    pub prefetch: usize,
}

/// Where the state of the parameters past the first `in_ram` share streams to.
pub struct Placement {
    /// The tier.
    pub tier: Arc<dyn OffloadTier>,
    /// Its name, for errors.
    pub name: String,
    /// Share of the state's bytes kept in memory (the first parameters, model order).
    pub in_ram: f64,
    /// Parameters read ahead.
    pub prefetch: usize,
}

/// A parameter's weights widened to f32: the initial value of its master buffer when the
/// caller has none better (weights loaded in bf16).
pub fn widened(p: &Param) -> Vec<f32> {
    let values = p.var.as_tensor().flatten_all().and_then(|t| t.to_dtype(candle_core::DType::F32));
    values.and_then(|t| t.to_vec1::<f32>()).expect("a parameter widens to f32")
}

impl OptimizerState {
    /// Allocates the state `optimizer` declares for each parameter, all of it in memory.
    pub fn allocate(optimizer: &dyn Optimizer, params: &[Param], plugin: &str) -> Result<Self, TrainError> {
        Self::allocate_with(optimizer, params, plugin, HostState::Nothing, None, &widened)
    }

    /// Allocates each parameter's state: the plugin's buffers plus the engine's `host`
    /// buffer (f32 masters start as `master(param)`, a compensation at 0). With a `placement`,
    /// the state of the parameters past its `in_ram` share of the bytes (model order) never
    /// takes memory here: after the tier's preflight (so a disk without room is refused
    /// before anything is written) its initial bytes go straight to the tier, one buffer at
    /// a time, and come back during each step ([`for_each`](Self::for_each)). A lossy tier
    /// is refused: state must come back exactly.
    pub fn allocate_with(
        optimizer: &dyn Optimizer,
        params: &[Param],
        plugin: &str,
        host: HostState,
        placement: Option<Placement>,
        master: &dyn Fn(&Param) -> Vec<f32>,
    ) -> Result<Self, TrainError> {
        Self::allocate_shard(optimizer, params, plugin, host, placement, master, &|_| true)
    }

    /// Each parameter's state layout (the plugin's buffers and the engine's), nothing
    /// allocated: what sizes a ZeRO partition before the state is placed.
    pub fn layout_bytes(
        optimizer: &dyn Optimizer,
        params: &[Param],
        plugin: &str,
        host: HostState,
    ) -> Result<Vec<u64>, TrainError> {
        Ok(Self::layouts(optimizer, params, plugin, host)?
            .iter()
            .map(|b| b.iter().map(|b| b.spec.bytes()).sum())
            .collect())
    }

    fn layouts(
        optimizer: &dyn Optimizer,
        params: &[Param],
        plugin: &str,
        host: HostState,
    ) -> Result<Vec<Vec<StateBuffer>>, TrainError> {
        params
            .iter()
            .map(|p| {
                let shape = shape_u64(p);
                let layout = optimizer.state_layout(&ParamInfo::new(&p.def.name, &shape)).map_err(|e| {
                    TrainError::Plugin { plugin: plugin.to_string(), what: "state_layout", message: e.to_string() }
                })?;
                let mut bufs: Vec<StateBuffer> = layout.into_iter().map(|s| StateBuffer::empty(s, false)).collect();
                bufs.extend(host.spec(p.def.numel()).map(|s| StateBuffer::empty(s, true)));
                Ok(bufs)
            })
            .collect()
    }

    /// [`allocate_with`](Self::allocate_with) for the parameters `held` selects (a ZeRO
    /// rank's share): the others' buffers are declared (so a checkpoint can name them) but
    /// hold no memory here, and never go to the tier; their bytes live on another rank.
    #[allow(clippy::too_many_arguments)]
    pub fn allocate_shard(
        optimizer: &dyn Optimizer,
        params: &[Param],
        plugin: &str,
        host: HostState,
        placement: Option<Placement>,
        master: &dyn Fn(&Param) -> Vec<f32>,
        held: &dyn Fn(usize) -> bool,
    ) -> Result<Self, TrainError> {
        let held: Vec<bool> = (0..params.len()).map(held).collect();
        let layouts = Self::layouts(optimizer, params, plugin, host)?;
        let mut state = Self { buffers: layouts, home: Home::Here, held: held.clone(), gpu: None };
        let offloaded = match &placement {
            Some(p) => {
                if !p.tier.exact() {
                    return Err(TrainError::Invalid(format!(
                        "offload.tiers: the tier '{}' is lossy (it compresses what it stores), and optimizer state \
                         and master weights must come back exactly: stream them through an exact tier such as nvme, \
                         or set offload.tiers: [device: 100%]",
                        p.name
                    )));
                }
                // The split is of this rank's own state.
                let per_param: Vec<u64> = (state.buffers.iter().zip(&held))
                    .map(|(b, &h)| if h { b.iter().map(|b| b.spec.bytes()).sum() } else { 0 })
                    .collect();
                streamed_params(&per_param, p.in_ram)
            }
            None => vec![false; params.len()],
        };
        let initial = |p: &Param, b: &StateBuffer| -> Vec<u8> {
            if b.host && b.spec.name.as_str() == MASTER {
                bytemuck::cast_slice(&master(p)).to_vec()
            } else {
                vec![0u8; b.spec.bytes() as usize]
            }
        };
        if let Some(Placement { tier, name, prefetch, .. }) = placement {
            let records: Vec<u64> = (0..params.len())
                .filter(|&i| offloaded[i])
                .flat_map(|i| state.buffers[i].iter().map(|b| b.spec.bytes()))
                .collect();
            tier.preflight(&records).map_err(|e| tier_error(&name, "preflight", e))?;
            let keys: Vec<Vec<String>> = params
                .iter()
                .zip(&state.buffers)
                .zip(&offloaded)
                .map(
                    |((p, bufs), &off)| {
                        if off { bufs.iter().map(|b| key(&p.def.name, &b.spec.name)).collect() } else { Vec::new() }
                    },
                )
                .collect();
            for (i, ks) in keys.iter().enumerate() {
                for (b, k) in state.buffers[i].iter().zip(ks) {
                    let bytes = initial(&params[i], b);
                    tier.put(k, &bytes, b.spec.dtype).map_err(|e| tier_error(&name, &format!("storing {k}"), e))?;
                }
            }
            tier.flush().map_err(|e| tier_error(&name, "writing the initial optimizer state", e))?;
            state.home = Home::Tier(Streamed { tier, name, offloaded: offloaded.clone(), keys, prefetch });
        }
        for (i, p) in params.iter().enumerate().filter(|&(i, _)| held[i] && !offloaded[i]) {
            for b in state.buffers[i].iter_mut() {
                b.reserve();
                if b.host && b.spec.name.as_str() == MASTER {
                    b.bytes_mut().copy_from_slice(bytemuck::cast_slice(&master(p)));
                }
            }
        }
        Ok(state)
    }

    /// Bytes the tier holds for the streamed parameters.
    pub fn streamed_bytes(&self) -> u64 {
        match self.home.tier() {
            Some(s) => (0..self.buffers.len())
                .filter(|&i| s.offloaded[i])
                .flat_map(|i| self.buffers[i].iter().map(|b| b.spec.bytes()))
                .sum(),
            None => 0,
        }
    }

    /// Total bytes of state, wherever it lives (on every rank).
    pub fn bytes(&self) -> u64 {
        self.buffers.iter().flatten().map(|b| b.spec.bytes()).sum()
    }

    /// Bytes of the state this process holds (its ZeRO share; all of it alone).
    pub fn held_bytes(&self) -> u64 {
        (self.buffers.iter().zip(&self.held)).filter(|(_, h)| **h).flat_map(|(b, _)| b).map(|b| b.spec.bytes()).sum()
    }

    /// Whether this process holds parameter `i`'s state.
    pub fn holds(&self, i: usize) -> bool {
        self.held[i]
    }

    /// Moves the state this process holds in memory to `dev`: a GPU run's stage after the
    /// state is allocated (or loaded from a checkpoint of any device). The plugin's
    /// `step_cuda` then updates it where it lies, and a checkpoint copies it back. With
    /// `home`, the parameters past its `on_device` share of the bytes (model order, as
    /// [`streamed_params`] splits) go to page-locked host memory instead and visit the
    /// device during each step (`optim/page_locked`); `names(i)` names parameter `i`
    /// in errors. A state streamed through a tier has no page-locked share (a GPU run's
    /// config names one or the other, [`crate::device::check_run`]): asking for both is refused.
    /// A build without the `cuda` feature refuses the move.
    pub fn place_on(
        &mut self,
        dev: &candle_core::CudaDevice,
        home: Option<PinnedHome>,
        names: &dyn Fn(usize) -> String,
    ) -> Result<(), TrainError> {
        if let Some(home) = home {
            if let Some(s) = self.home.tier() {
                return Err(TrainError::Invalid(format!(
                    "the optimizer state streams through the tier '{}', so none of it can also be homed in \
                     page-locked host memory: name one of them in offload.tiers",
                    s.name
                )));
            }
            let per_param: Vec<u64> = (self.buffers.iter().zip(&self.held))
                .map(|(b, &h)| if h { b.iter().map(|b| b.spec.bytes()).sum() } else { 0 })
                .collect();
            let homed = streamed_params(&per_param, home.on_device);
            let pinned = page_locked::PinnedState::new(dev, &mut self.buffers, homed, home.prefetch, names)
                .map_err(TrainError::Invalid)?;
            self.home = Home::PageLocked(pinned);
        }
        page_locked::usable(dev).map_err(TrainError::candle)?;
        self.gpu = Some(dev.clone());
        for (i, (bufs, _)) in self.buffers.iter_mut().zip(&self.held).enumerate().filter(|(_, (_, h))| **h) {
            if self.home.page_locked().is_some_and(|p| p.homed[i]) {
                continue;
            }
            for b in bufs {
                b.place_on(dev).map_err(TrainError::candle)?;
            }
        }
        Ok(())
    }

    /// Bytes of state in page-locked host memory (a GPU run's `ram` share).
    pub fn pinned_bytes(&self) -> u64 {
        self.home.page_locked().map_or(0, |p| p.bytes(&self.buffers))
    }

    /// Bytes of buffer `j` of parameter `i`, which this process holds (read from the tier
    /// if streamed).
    pub fn buffer_bytes(&self, i: usize, j: usize) -> Result<Vec<u8>, TrainError> {
        match &self.home {
            Home::Tier(s) if s.offloaded[i] => {
                let mut bytes = vec![0u8; self.buffers[i][j].spec.bytes() as usize];
                s.tier
                    .get(&s.keys[i][j], &mut bytes)
                    .map_err(|e| tier_error(&s.name, &format!("reading {}", s.keys[i][j]), e))?;
                Ok(bytes)
            }
            _ => Ok(self.buffers[i][j].bytes().map_err(TrainError::candle)?.into_owned()),
        }
    }

    /// Bytes of state held in memory between steps (all of it unless streamed).
    pub fn resident_bytes(&self) -> u64 {
        self.buffers.iter().flatten().map(StateBuffer::held).sum()
    }

    /// The tier the state streams through, if any.
    pub fn tier(&self) -> Option<&Arc<dyn OffloadTier>> {
        self.home.tier().map(|s| &s.tier)
    }

    /// Parameter `i`'s buffers' bytes, read from the tier (checksums checked) if streamed.
    fn read(&self, i: usize) -> Result<Vec<Vec<u8>>, TrainError> {
        if !self.held[i] {
            return Ok(Vec::new());
        }
        match &self.home {
            Home::Tier(s) if s.offloaded[i] => self.buffers[i]
                .iter()
                .enumerate()
                .map(|(j, b)| {
                    let mut bytes = vec![0u8; b.spec.bytes() as usize];
                    s.tier
                        .get(&s.keys[i][j], &mut bytes)
                        .map_err(|e| tier_error(&s.name, &format!("reading {}", s.keys[i][j]), e))?;
                    Ok(bytes)
                })
                .collect(),
            _ => self.buffers[i].iter().map(|b| Ok(b.bytes().map_err(TrainError::candle)?.into_owned())).collect(),
        }
    }
}
