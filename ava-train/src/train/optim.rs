//! The optimizer plugin applied to the model: the options the engine fills in from the
//! model, state buffers allocated by the engine from the plugin's declared layout, and an
//! in-place candle op that hands each parameter, its gradient and its state to the plugin's
//! `step`.
//!
//! The state of some parameters may be streamed through an offload tier (`offload.tiers`):
//! between steps it lives only in the tier; during the optimizer step each such parameter's
//! state is read back, updated and written out again, while the tier reads the next ones
//! ahead ([`OptimizerState::for_each`]), so memory holds a few parameters' state instead of
//! all of it (ZeRO-Infinity's optimizer-state offload, one parameter per group).

use std::cell::RefCell;
use std::sync::Arc;
use std::time::Instant;

use ava_core::{DType as StateDType, OffloadTier, Optimizer, ParamInfo, StateBuf, StateSpec, StepContext};
use candle_core::{CpuStorage, InplaceOp2, Layout, Tensor};

use super::TrainError;
use super::rounding::{self, Half};
use crate::config::PluginSelection;
use crate::model::{ModelSpec, Param};
use crate::save::{BufDType, BufferView, NamedBuffer, SaveError, TensorSpec};

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

/// One state buffer: its spec and its bytes, 8-byte aligned (stored as u64 words) and
/// zero-filled, as the contract promises. A streamed parameter's buffers hold no words
/// between steps. On a GPU run the bytes live in device memory instead
/// ([`OptimizerState::place_on`]), and the plugin's `step_cuda` reads and writes them there.
#[derive(Debug, Clone)]
pub struct StateBuffer {
    /// Name, type and length, as the plugin declared (or the engine, for its own buffers).
    pub spec: StateSpec,
    /// The engine's own buffer (f32 masters, a compensation), not the plugin's.
    pub host: bool,
    words: Vec<u64>,
    /// The bytes on the GPU (then `words` is empty): where they live, or while a step
    /// visits them from `pinned`.
    #[cfg(feature = "cuda")]
    device: Option<candle_core::cuda::cudarc::driver::CudaSlice<u8>>,
    /// The bytes in page-locked host memory: a GPU run's `ram` share ([`super::pinned_state`]).
    #[cfg(feature = "cuda")]
    pinned: Option<crate::memory::pinned::PinnedBytes>,
}

/// Equal when spec, owner and bytes are, wherever the bytes live.
impl PartialEq for StateBuffer {
    fn eq(&self, other: &Self) -> bool {
        self.spec == other.spec
            && self.host == other.host
            && matches!((self.bytes(), other.bytes()), (Ok(a), Ok(b)) if a == b)
    }
}

impl StateBuffer {
    /// A buffer that holds no memory yet.
    fn empty(spec: StateSpec, host: bool) -> Self {
        Self {
            spec,
            host,
            words: Vec::new(),
            #[cfg(feature = "cuda")]
            device: None,
            #[cfg(feature = "cuda")]
            pinned: None,
        }
    }

    /// The buffer's bytes (copied from the GPU when they live there; a checkpoint is the
    /// same bytes whichever device wrote it).
    pub fn bytes(&self) -> candle_core::Result<std::borrow::Cow<'_, [u8]>> {
        #[cfg(feature = "cuda")]
        if let Some(d) = &self.device {
            use candle_core::cuda::WrapErr;
            let mut bytes = d.stream().clone_dtoh(d).w()?;
            bytes.truncate(self.spec.bytes() as usize); // a 0-byte buffer holds 1 on the device
            return Ok(std::borrow::Cow::Owned(bytes));
        }
        #[cfg(feature = "cuda")]
        if let Some(p) = &self.pinned {
            return Ok(std::borrow::Cow::Borrowed(p.as_slice().map_err(candle_core::Error::Msg)?));
        }
        Ok(std::borrow::Cow::Borrowed(&bytemuck::cast_slice(&self.words)[..self.spec.bytes() as usize]))
    }

    /// Moves the bytes to `dev`, freeing the host copy.
    #[cfg(feature = "cuda")]
    fn place_on(&mut self, dev: &candle_core::CudaDevice) -> candle_core::Result<()> {
        if self.device.is_some() || self.words.is_empty() && self.spec.bytes() > 0 {
            return Ok(()); // already there, or held elsewhere (another rank, the tier)
        }
        let bytes = self.bytes()?.into_owned();
        // One byte at least: a zero-length allocation has no address to hand a plugin.
        let on = if bytes.is_empty() { dev.alloc_zeros::<u8>(1)? } else { dev.clone_htod(&bytes)? };
        self.device = Some(on);
        self.words = Vec::new();
        Ok(())
    }

    /// Makes page-locked memory the bytes' home.
    #[cfg(feature = "cuda")]
    pub(super) fn set_pinned(&mut self, pinned: crate::memory::pinned::PinnedBytes) {
        self.pinned = Some(pinned);
    }

    /// The page-locked bytes, if this is their home.
    #[cfg(feature = "cuda")]
    pub(super) fn pinned_ref(&self) -> Option<&crate::memory::pinned::PinnedBytes> {
        self.pinned.as_ref()
    }

    /// The page-locked bytes to record a copy's event on.
    #[cfg(feature = "cuda")]
    pub(super) fn pinned_mut(&mut self) -> Option<&mut crate::memory::pinned::PinnedBytes> {
        self.pinned.as_mut()
    }

    /// The device memory a step visits the page-locked bytes in.
    #[cfg(feature = "cuda")]
    pub(super) fn set_slot(&mut self, slot: candle_core::cuda::cudarc::driver::CudaSlice<u8>) {
        self.device = Some(slot);
    }

    /// The visiting device copy and the page-locked home, for a copy between them.
    #[cfg(feature = "cuda")]
    pub(super) fn slot_and_pinned(
        &mut self,
    ) -> Option<(&candle_core::cuda::cudarc::driver::CudaSlice<u8>, &mut crate::memory::pinned::PinnedBytes)> {
        match (&self.device, &mut self.pinned) {
            (Some(d), Some(p)) => Some((d, p)),
            _ => None,
        }
    }

    /// Drops the visiting device copy of page-locked bytes (freed in the compute stream's
    /// order); whether there was one.
    #[cfg(feature = "cuda")]
    pub(super) fn drop_slot(&mut self) -> bool {
        self.pinned.is_some() && self.device.take().is_some()
    }

    /// Whether the bytes are on the device now.
    #[cfg(feature = "cuda")]
    pub(super) fn on_device_now(&self) -> bool {
        self.device.is_some()
    }

    /// The bytes on the GPU, if they live there.
    #[cfg(feature = "cuda")]
    fn on_device(&self) -> Option<&candle_core::cuda::cudarc::driver::CudaSlice<u8>> {
        self.device.as_ref()
    }

    /// The bytes on the GPU to write, if they live there.
    #[cfg(feature = "cuda")]
    fn on_device_mut(&mut self) -> Option<&mut candle_core::cuda::cudarc::driver::CudaSlice<u8>> {
        self.device.as_mut()
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        let n = self.spec.bytes() as usize;
        &mut bytemuck::cast_slice_mut(&mut self.words)[..n]
    }

    /// Gives the memory back (the bytes are in the tier or page-locked memory), on the host
    /// and on the GPU.
    pub(super) fn release(&mut self) {
        self.words = Vec::new();
        #[cfg(feature = "cuda")]
        {
            self.device = None;
        }
    }

    /// Memory for the bytes again, zero-filled.
    fn reserve(&mut self) {
        self.words = vec![0u64; (self.spec.bytes() as usize).div_ceil(8)];
    }

    fn held(&self) -> u64 {
        (self.words.len() * 8) as u64
    }
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
    streamed: Option<Streamed>,
    /// Per parameter, whether this process holds its state (under ZeRO, another rank may).
    held: Vec<bool>,
    /// A GPU run's state in page-locked host memory, and the streams that move it.
    #[cfg(feature = "cuda")]
    pinned: Option<super::pinned_state::PinnedState>,
    /// The GPU a GPU run's state lives on: a parameter streamed through a tier visits it for
    /// its step.
    #[cfg(feature = "cuda")]
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
        let mut state = Self {
            buffers: layouts,
            streamed: None,
            held: held.clone(),
            #[cfg(feature = "cuda")]
            pinned: None,
            #[cfg(feature = "cuda")]
            gpu: None,
        };
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
            state.streamed = Some(Streamed { tier, name, offloaded: offloaded.clone(), keys, prefetch });
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
        match &self.streamed {
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
    /// device during each step ([`super::pinned_state`]); `names(i)` names parameter `i`
    /// in errors.
    #[cfg(feature = "cuda")]
    pub fn place_on(
        &mut self,
        dev: &candle_core::CudaDevice,
        home: Option<PinnedHome>,
        names: &dyn Fn(usize) -> String,
    ) -> Result<(), TrainError> {
        if let Some(home) = home {
            let per_param: Vec<u64> = (self.buffers.iter().zip(&self.held))
                .map(|(b, &h)| if h { b.iter().map(|b| b.spec.bytes()).sum() } else { 0 })
                .collect();
            let homed = streamed_params(&per_param, home.on_device);
            let pinned = super::pinned_state::PinnedState::new(dev, &mut self.buffers, homed, home.prefetch, names)
                .map_err(TrainError::Invalid)?;
            self.pinned = Some(pinned);
        }
        self.gpu = Some(dev.clone());
        for (i, (bufs, _)) in self.buffers.iter_mut().zip(&self.held).enumerate().filter(|(_, (_, h))| **h) {
            if self.pinned.as_ref().is_some_and(|p| p.homed[i]) {
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
        #[cfg(feature = "cuda")]
        if let Some(p) = &self.pinned {
            return p.bytes(&self.buffers);
        }
        0
    }

    /// Bytes of buffer `j` of parameter `i`, which this process holds (read from the tier
    /// if streamed).
    pub fn buffer_bytes(&self, i: usize, j: usize) -> Result<Vec<u8>, TrainError> {
        match &self.streamed {
            Some(s) if s.offloaded[i] => {
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
        self.streamed.as_ref().map(|s| &s.tier)
    }

    /// Parameter `i`'s buffers' bytes, read from the tier (checksums checked) if streamed.
    fn read(&self, i: usize) -> Result<Vec<Vec<u8>>, TrainError> {
        if !self.held[i] {
            return Ok(Vec::new());
        }
        match &self.streamed {
            Some(s) if s.offloaded[i] => self.buffers[i]
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
    /// Writes the state as a safetensors file of buffers named `{param}.{buffer}` (what
    /// [`load_buffers`](Self::load_buffers) reads), one buffer at a time: a streamed buffer is read from the tier when its turn
    /// comes and freed once written, so a state larger than memory can be saved.
    pub fn write_safetensors(&self, params: &[Param], out: &mut dyn std::io::Write) -> Result<(), SaveError> {
        self.write_safetensors_gathered(params, out, &mut |i, j, _| {
            Err(SaveError::BadBuffer {
                name: format!("{}.{}", params[i].def.name, self.buffers[i][j].spec.name),
                reason: "another rank holds this buffer".into(),
            })
        })
    }

    /// [`write_safetensors`](Self::write_safetensors) of the whole state when this process
    /// holds only its ZeRO share: a buffer another rank holds comes from
    /// `remote(param, buffer, bytes)`, called in file order.
    pub fn write_safetensors_gathered(
        &self,
        params: &[Param],
        out: &mut dyn std::io::Write,
        remote: &mut dyn FnMut(usize, usize, usize) -> Result<Vec<u8>, SaveError>,
    ) -> Result<(), SaveError> {
        let mut at = Vec::new(); // (parameter, buffer) of each spec
        let mut specs = Vec::new();
        for (i, (p, bufs)) in params.iter().zip(&self.buffers).enumerate() {
            for (j, b) in bufs.iter().enumerate() {
                at.push((i, j));
                specs.push(TensorSpec {
                    name: format!("{}.{}", p.def.name, b.spec.name),
                    dtype: buf_dtype(b.spec.dtype),
                    shape: vec![b.spec.len as usize],
                });
            }
        }
        crate::save::write_safetensors(out, &specs, None, &mut |k| {
            let (i, j) = at[k];
            let b = &self.buffers[i][j];
            if !self.held[i] {
                return remote(i, j, b.spec.bytes() as usize).map(std::borrow::Cow::Owned);
            }
            match &self.streamed {
                Some(s) if s.offloaded[i] => {
                    let mut bytes = vec![0u8; b.spec.bytes() as usize]; // (len · size,) one buffer
                    s.tier.get(&s.keys[i][j], &mut bytes).map_err(|e| SaveError::BadBuffer {
                        name: specs[k].name.clone(),
                        reason: tier_error(&s.name, &format!("reading {}", s.keys[i][j]), e).to_string(),
                    })?;
                    Ok(std::borrow::Cow::Owned(bytes))
                }
                _ => b.bytes().map_err(|e| SaveError::BadBuffer { name: specs[k].name.clone(), reason: e.to_string() }),
            }
        })?;
        Ok(())
    }

    /// Fills the state from a checkpoint's buffers; every buffer of the plugin's layout must
    /// be there with the declared type and length. Streamed state goes to the tier. The
    /// engine's own buffers may be missing (a checkpoint of another `train.master_weights`,
    /// resumed with --force: they keep their initial values, f32 masters the weights
    /// widened); a saved master this run has no buffer for is returned, for the caller to
    /// take the weights from.
    pub fn load_buffers(
        &mut self,
        params: &[Param],
        saved: Vec<BufferView<'_>>,
        progress: &mut dyn FnMut(u64),
    ) -> Result<Vec<NamedBuffer>, TrainError> {
        let mut loaded = 0u64;
        let mut by_name: std::collections::HashMap<String, BufferView<'_>> =
            saved.into_iter().map(|b| (b.name.clone(), b)).collect();
        let mut problems = StateProblems::default();
        for (i, (p, bufs)) in params.iter().zip(&mut self.buffers).enumerate() {
            for (j, b) in bufs.iter_mut().enumerate() {
                let name = format!("{}.{}", p.def.name, b.spec.name);
                if !self.held[i] {
                    // Another rank's: it loads these itself.
                    by_name.remove(&name);
                    continue;
                }
                match by_name.remove(&name) {
                    None if b.host => {}
                    None => problems.add("missing", &b.spec.name, &name),
                    Some(s) if s.dtype != buf_dtype(b.spec.dtype) || s.data.len() != b.spec.bytes() as usize => {
                        problems.add(
                            &format!(
                                "of another type or size ({} × {} bytes saved, {} × {} declared)",
                                s.dtype.name(),
                                s.data.len(),
                                b.spec.dtype.as_str(),
                                b.spec.bytes()
                            ),
                            &b.spec.name,
                            &name,
                        )
                    }
                    Some(saved) => {
                        match &self.streamed {
                            Some(st) if st.offloaded[i] => {
                                let k = &st.keys[i][j];
                                st.tier
                                    .put(k, saved.data, b.spec.dtype)
                                    .map_err(|e| tier_error(&st.name, &format!("storing {k}"), e))?;
                            }
                            _ => b.bytes_mut().copy_from_slice(saved.data),
                        }
                        loaded += saved.data.len() as u64;
                        progress(loaded);
                    }
                }
            }
        }
        let host = |k: &str| k.ends_with(&format!(".{MASTER}")) || k.ends_with(&format!(".{COMPENSATION}"));
        let (left, unexpected): (Vec<BufferView<'_>>, Vec<BufferView<'_>>) =
            by_name.into_values().partition(|b| host(&b.name));
        for b in unexpected {
            // The buffer's own name: what follows the parameter it belongs to.
            let owner = params
                .iter()
                .map(|p| &p.def.name)
                .filter(|n| b.name.starts_with(&format!("{n}.")))
                .max_by_key(|n| n.len());
            let buffer = owner.map_or(b.name.as_str(), |n| &b.name[n.len() + 1..]);
            problems.add("unexpected (the optimizer has no such buffer)", buffer, &b.name);
        }
        if !problems.is_empty() {
            return Err(TrainError::OptimizerState { problems: problems.lines(), trained_with: None, file: None });
        }
        if let Some(st) = &self.streamed {
            st.tier.flush().map_err(|e| tier_error(&st.name, "writing the optimizer state", e))?;
        }
        Ok(left
            .into_iter()
            .filter(|b| b.name.ends_with(&format!(".{MASTER}")))
            .map(|b| NamedBuffer { name: b.name, dtype: b.dtype, shape: b.shape, data: b.data.to_vec() })
            .collect())
    }

    /// Runs `step(i, buffers)` for each parameter `i` in `active`, with its state in
    /// `buffers`. Parameters kept in memory go first, while the tier reads the first
    /// streamed ones ahead; then each streamed parameter's state is read (the next
    /// `prefetch` ones are being read meanwhile), updated and written back, and its memory
    /// freed. Waits for every write before returning, so an I/O error is this step's.
    pub fn for_each(
        &mut self,
        active: &[usize],
        mut step: impl FnMut(usize, &mut Vec<StateBuffer>) -> Result<(), TrainError>,
    ) -> Result<StreamStats, TrainError> {
        let (ram, disk): (Vec<usize>, Vec<usize>) = active.iter().partition(|&&i| !self.is_streamed(i));
        let mut session = self.session(&disk)?;
        for i in ram.into_iter().chain(disk) {
            session.step(i, &mut step)?;
        }
        session.finish()
    }

    /// Whether parameter `i`'s state lives in the tier, or in page-locked host memory on a
    /// GPU run: away from where the step runs, so it streams.
    pub fn is_streamed(&self, i: usize) -> bool {
        #[cfg(feature = "cuda")]
        if self.pinned.as_ref().is_some_and(|p| p.homed[i]) {
            return true;
        }
        self.streamed.as_ref().is_some_and(|s| s.offloaded[i])
    }

    /// Parameters read ahead of the one being stepped.
    fn prefetch(&self) -> usize {
        #[cfg(feature = "cuda")]
        if let Some(p) = &self.pinned {
            return p.prefetch;
        }
        self.streamed.as_ref().map_or(0, |s| s.prefetch)
    }

    /// Starts a step whose parameters are updated one at a time, in about the `order`
    /// given (the streamed parameters in it are read ahead in that order, `prefetch` at a
    /// time): the optimizer step after backward, or inside it (`train.step_in_backward`),
    /// where the state of the next parameters down is read while backward runs. End it
    /// with [`StepSession::finish`].
    pub fn session(&mut self, order: &[usize]) -> Result<StepSession<'_>, TrainError> {
        let order: Vec<usize> = order.iter().copied().filter(|&i| self.is_streamed(i)).collect();
        let mut position = vec![usize::MAX; self.buffers.len()];
        for (n, &i) in order.iter().enumerate() {
            position[i] = position[i].min(n);
        }
        let resident = self.resident_bytes();
        #[cfg(feature = "cuda")]
        if let Some(p) = self.pinned.as_mut() {
            p.begin(&mut self.buffers).map_err(TrainError::candle)?;
        }
        let ahead = self.prefetch();
        let mut session =
            StepSession { state: self, order, position, queued: 0, stats: StreamStats::default(), resident };
        session.read_ahead(ahead)?;
        Ok(session)
    }
}

/// One optimizer step over the parameters, one at a time, with the tier reading ahead
/// ([`OptimizerState::session`]).
pub struct StepSession<'a> {
    state: &'a mut OptimizerState,
    /// The streamed parameters in the order they are expected.
    order: Vec<usize>,
    /// Per parameter, its place in `order` (MAX: not in it).
    position: Vec<usize>,
    /// Reads were asked for `order[..queued]`.
    queued: usize,
    stats: StreamStats,
    /// State held between steps.
    resident: u64,
}

impl StepSession<'_> {
    fn sample(&mut self, working: u64) {
        if let Some(s) = &self.state.streamed {
            let in_tier = s.tier.resident_bytes();
            self.stats.peak_tier = self.stats.peak_tier.max(in_tier);
            self.stats.peak_resident = self.stats.peak_resident.max(self.resident + working + in_tier);
        }
    }

    /// Asks the tier for the streamed parameters of `order[..upto]` not yet asked for (on a
    /// GPU run from page-locked memory, issues their uploads).
    fn read_ahead(&mut self, upto: usize) -> Result<(), TrainError> {
        #[cfg(feature = "cuda")]
        if let Some(p) = self.state.pinned.as_mut() {
            while self.queued < self.order.len().min(upto) {
                let i = self.order[self.queued];
                p.upload(i, &mut self.state.buffers[i]).map_err(TrainError::candle)?;
                self.queued += 1;
            }
            return Ok(());
        }
        let Some(s) = &self.state.streamed else { return Ok(()) };
        while self.queued < self.order.len().min(upto) {
            for k in &s.keys[self.order[self.queued]] {
                s.tier.prefetch(k).map_err(|e| tier_error(&s.name, &format!("prefetching {k}"), e))?;
            }
            self.queued += 1;
        }
        Ok(())
    }

    /// Runs `step(i, buffers)` with parameter `i`'s state; a streamed parameter's state is
    /// read from the tier first (the next ones in the order are asked for meanwhile), and
    /// written back and freed after.
    pub fn step(
        &mut self,
        i: usize,
        step: &mut impl FnMut(usize, &mut Vec<StateBuffer>) -> Result<(), TrainError>,
    ) -> Result<(), TrainError> {
        if !self.state.is_streamed(i) {
            return step(i, &mut self.state.buffers[i]);
        }
        #[cfg(feature = "cuda")]
        if self.state.pinned.is_some() {
            return self.step_pinned(i, step);
        }
        let s = self.state.streamed.as_ref().expect("streamed");
        let (tier, name, prefetch) = (Arc::clone(&s.tier), s.name.clone(), s.prefetch);
        let keys = s.keys[i].clone();
        let waiting = Instant::now();
        for (b, k) in self.state.buffers[i].iter_mut().zip(&keys) {
            b.reserve();
            tier.get(k, b.bytes_mut()).map_err(|e| tier_error(&name, &format!("reading {k}"), e))?;
            self.stats.read_bytes += b.held();
        }
        self.stats.wait_seconds += waiting.elapsed().as_secs_f64();
        let held: Vec<u64> = self.state.buffers[i].iter().map(StateBuffer::held).collect();
        // On a GPU run the state visits the device for its step (copied from and back to the
        // host's pageable bytes on the compute stream: next to a disk's 0.5–1 GB/s the link's
        // 13–17 GB/s for pageable copies costs little, so no page-locked staging).
        #[cfg(feature = "cuda")]
        if let Some(dev) = &self.state.gpu {
            for b in self.state.buffers[i].iter_mut() {
                b.place_on(dev).map_err(TrainError::candle)?;
            }
        }
        // The next `prefetch` parameters load while this one is updated (this one was just
        // read: never asked for again).
        let at = self.position[i];
        if at != usize::MAX {
            self.queued = self.queued.max(at + 1);
            self.read_ahead(at + 1 + prefetch)?;
        }
        let working: u64 = held.iter().sum();
        self.sample(working);
        step(i, &mut self.state.buffers[i])?;
        // Each buffer is freed as soon as the tier has its copy.
        let mut left = working;
        for (j, k) in keys.iter().enumerate() {
            let b = &self.state.buffers[i][j];
            let waiting = Instant::now();
            let bytes = b.bytes().map_err(TrainError::candle)?;
            tier.put(k, &bytes, b.spec.dtype).map_err(|e| tier_error(&name, &format!("storing {k}"), e))?;
            self.stats.wait_seconds += waiting.elapsed().as_secs_f64();
            self.stats.written_bytes += held[j];
            self.sample(left);
            left -= held[j];
            self.state.buffers[i][j].release();
        }
        Ok(())
    }

    /// [`step`](Self::step) of a parameter whose state lives in page-locked host memory on a
    /// GPU run: uploaded (if it was not read ahead), the compute stream waiting for it, the
    /// next ones' uploads issued, stepped, and written back.
    #[cfg(feature = "cuda")]
    fn step_pinned(
        &mut self,
        i: usize,
        step: &mut impl FnMut(usize, &mut Vec<StateBuffer>) -> Result<(), TrainError>,
    ) -> Result<(), TrainError> {
        let pinned = self.state.pinned.as_mut().expect("pinned");
        pinned.before_step(i, &mut self.state.buffers[i]).map_err(TrainError::candle)?;
        let at = self.position[i];
        if at != usize::MAX {
            self.queued = self.queued.max(at + 1);
            let prefetch = self.state.prefetch();
            self.read_ahead(at + 1 + prefetch)?;
        }
        step(i, &mut self.state.buffers[i])?;
        let pinned = self.state.pinned.as_mut().expect("pinned");
        pinned.after_step(i, &mut self.state.buffers).map_err(TrainError::candle)
    }

    /// Waits for every write, so an I/O error is this step's, and returns what streaming
    /// held at its most.
    pub fn finish(mut self) -> Result<StreamStats, TrainError> {
        #[cfg(feature = "cuda")]
        if let Some(p) = self.state.pinned.as_mut() {
            let copies = p.finish(&mut self.state.buffers).map_err(TrainError::candle)?;
            let kept: u64 = (0..self.state.buffers.len())
                .filter(|&i| self.state.held[i] && !p.homed[i])
                .flat_map(|i| self.state.buffers[i].iter().map(|b| b.spec.bytes()))
                .sum();
            return Ok(StreamStats {
                peak_resident: kept + copies.peak_on_device,
                peak_tier: 0,
                read_bytes: copies.uploaded,
                written_bytes: copies.written_back,
                wait_seconds: copies.wait_seconds,
                copy_seconds: copies.copy_seconds,
            });
        }
        if let Some(s) = &self.state.streamed {
            let waiting = Instant::now();
            s.tier.flush().map_err(|e| tier_error(&s.name, "writing the optimizer state", e))?;
            self.stats.wait_seconds += waiting.elapsed().as_secs_f64();
        }
        self.sample(0);
        Ok(self.stats)
    }
}

fn buf_dtype(d: StateDType) -> BufDType {
    match d {
        StateDType::F32 => BufDType::F32,
        StateDType::F64 => BufDType::F64,
        StateDType::U32 => BufDType::U32,
        StateDType::F16 => BufDType::F16,
        StateDType::BF16 => BufDType::BF16,
        // Saved as raw bytes; read back the same way.
        StateDType::U8 | StateDType::I8 => BufDType::U8,
    }
}

/// Calls the plugin's `step` on a parameter's storage in place. f32 weights are stepped
/// where they are; bf16/f16 weights are widened into an f32 scratch (or the f32 master
/// buffer, when there is one), stepped there, and rounded back: to nearest from a master,
/// with compensation from a compensation buffer, stochastically otherwise.
struct StepOp<'a> {
    optimizer: RefCell<&'a mut dyn Optimizer>,
    state: RefCell<&'a mut Vec<StateBuffer>>,
    name: &'a str,
    shape: &'a [u64],
    ctx: StepContext,
    /// Seed of the stochastic rounding ([`rounding::seed_for`]).
    round_seed: u64,
    result: RefCell<Result<(), ava_core::PluginError>>,
    /// Σ g² of the gradient, read where it lies (no tensor allocated for it).
    sumsq: std::cell::Cell<f64>,
}

impl StepOp<'_> {
    /// Steps half-precision `values`: widen, step in f32, round back.
    fn step_half<H: Half>(&self, values: &mut [H], grad: &[f32]) {
        let mut state = self.state.borrow_mut();
        let (mut host, mut plugin): (Vec<&mut StateBuffer>, Vec<&mut StateBuffer>) =
            state.iter_mut().partition(|b| b.host);
        let mut views: Vec<StateBuf<'_>> =
            plugin.iter_mut().map(|b| StateBuf::new(b.spec.dtype, b.bytes_mut())).collect();
        let info = ParamInfo::new(self.name, self.shape);
        let mut optimizer = self.optimizer.borrow_mut();
        let result = match host.first_mut() {
            // The master is the f32 copy: stepped in place, the weights its rounding.
            Some(b) if b.spec.name.as_str() == MASTER => {
                let master: &mut [f32] = bytemuck::cast_slice_mut(b.bytes_mut());
                let r = optimizer.step(&info, master, grad, &mut views, &self.ctx);
                rounding::round_nearest(master, values);
                r
            }
            Some(b) => {
                let comp: &mut [H] = bytemuck::cast_slice_mut(b.bytes_mut());
                let mut scratch = vec![0f32; values.len()]; // (numel,) the widened weights
                rounding::widen(values, Some(comp), &mut scratch);
                let r = optimizer.step(&info, &mut scratch, grad, &mut views, &self.ctx);
                rounding::round_compensated(&scratch, values, comp);
                r
            }
            None => {
                let mut scratch = vec![0f32; values.len()]; // (numel,) the widened weights
                rounding::widen(values, None, &mut scratch);
                let r = optimizer.step(&info, &mut scratch, grad, &mut views, &self.ctx);
                rounding::round_stochastic(&scratch, values, self.round_seed, self.ctx.threads);
                r
            }
        };
        *self.result.borrow_mut() = result;
    }
}

/// The bytes of a state buffer on the GPU, or an error naming it.
#[cfg(feature = "cuda")]
fn device_bytes(b: &StateBuffer) -> candle_core::Result<&candle_core::cuda::cudarc::driver::CudaSlice<u8>> {
    b.on_device().ok_or_else(|| candle_core::Error::Msg(format!("optimizer state {} is not on the GPU", b.spec.name)))
}

/// The engine's own buffer of a parameter for its GPU step, told apart by name, its bytes
/// on the device.
#[cfg(feature = "cuda")]
enum EngineBuf<'a> {
    /// None: f32 weights, or half weights rounded stochastically.
    Nothing,
    /// [`MASTER`]: the f32 master the plugin steps (`master_weights: tier`).
    Master(&'a candle_core::cuda::cudarc::driver::CudaSlice<u8>),
    /// [`COMPENSATION`]: what rounding lost, in the weights' half type (`master_weights: kahan`).
    Compensation(&'a mut candle_core::cuda::cudarc::driver::CudaSlice<u8>),
}

#[cfg(feature = "cuda")]
impl<'a> EngineBuf<'a> {
    /// The one engine buffer among a parameter's `host` buffers, if any.
    fn of(host: Vec<&'a mut StateBuffer>) -> candle_core::Result<Self> {
        let count = host.len();
        let Some(b) = host.into_iter().next() else { return Ok(Self::Nothing) };
        if count > 1 {
            candle_core::bail!(
                "optimizer step: {count} engine buffers for one parameter; one at most (an f32 master or a compensation)"
            );
        }
        match b.spec.name.as_str() {
            MASTER => Ok(Self::Master(device_bytes(b)?)),
            COMPENSATION => {
                let name = b.spec.name.clone();
                b.on_device_mut()
                    .map(Self::Compensation)
                    .ok_or_else(|| candle_core::Error::Msg(format!("optimizer state {name} is not on the GPU")))
            }
            other => candle_core::bail!(
                "optimizer step: the engine keeps no buffer named {other} (only {MASTER} and {COMPENSATION})"
            ),
        }
    }

    /// What it is, for an error.
    fn describe(&self) -> &'static str {
        match self {
            Self::Nothing => "no engine buffer",
            Self::Master(_) => "an f32 master (ava.master)",
            Self::Compensation(_) => "a compensation (ava.kahan)",
        }
    }
}

impl InplaceOp2 for StepOp<'_> {
    fn name(&self) -> &'static str {
        "ava-optimizer-step"
    }

    /// On the GPU: the plugin's `step_cuda` on the parameter, its f32 gradient and its state
    /// in device memory, launched on candle's stream. bf16/f16 weights with an f32 master
    /// (`master_weights: tier`, its buffer on the device for the step) step the master and
    /// take its rounding to nearest, as on the CPU. With a compensation (`master_weights:
    /// kahan`, on the device with the rest of the state) they are widened with it into an f32
    /// scratch on the device, stepped there, and stored back as the scratch's rounding to
    /// nearest and what that lost, rounded to nearest. Without either they are widened into an
    /// f32 scratch, stepped there and rounded back stochastically. Every rounding gives the
    /// CPU's bits.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<()> {
        use crate::model::fused::{self, plugin_buf, plugin_stream, storage_buf};
        use candle_core::DType;
        use candle_core::backend::BackendStorage;
        let dev = s1.device().clone();
        let stream = dev.cuda_stream();
        if s2.dtype() != DType::F32 {
            candle_core::bail!("optimizer step: the gradient must be f32");
        }
        let info = ParamInfo::new(self.name, self.shape);
        let mut state = self.state.borrow_mut();
        let (host, plugin): (Vec<&mut StateBuffer>, Vec<&mut StateBuffer>) = state.iter_mut().partition(|b| b.host);
        let engine = EngineBuf::of(host)?;
        let slices = plugin.iter().map(|b| device_bytes(b)).collect::<candle_core::Result<Vec<_>>>()?;
        let bufs = slices
            .iter()
            .zip(&plugin)
            .map(|(d, b)| {
                plugin_buf(d, 0, b.spec.bytes() as usize, DType::U8, &stream).map(|(mut buf, g)| {
                    // The plugin's own element type and count, over the same bytes.
                    buf.dtype = b.spec.dtype;
                    buf.len = b.spec.len;
                    (buf, g)
                })
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let views: Vec<ava_core::device::CudaBuf> = bufs.iter().map(|(b, _)| *b).collect();
        let (grad, _g) = storage_buf(s2, l2, &stream)?;
        let on = plugin_stream(&dev)?;
        let mut optimizer = self.optimizer.borrow_mut();
        let mut step =
            |values: &ava_core::device::CudaBuf| optimizer.step_cuda(&info, values, &grad, &views, &self.ctx, &on);
        // The plugin steps an f32 scratch of the widened weights.
        let step_scratch =
            |scratch: &candle_core::cuda::cudarc::driver::CudaSlice<f32>,
             step: &mut dyn FnMut(&ava_core::device::CudaBuf) -> Result<(), ava_core::PluginError>| {
                plugin_buf(scratch, 0, scratch.len(), DType::F32, &stream).map(|(values, _v)| step(&values))
            };
        let result = match (s1.dtype(), engine) {
            (DType::F32, EngineBuf::Nothing) => {
                let (values, _v) = storage_buf(s1, l1, &stream)?;
                step(&values)
            }
            (DType::BF16 | DType::F16, EngineBuf::Master(master)) => {
                let r = {
                    let (mut values, _v) = plugin_buf(master, 0, master.len(), DType::U8, &stream)?;
                    values.dtype = ava_core::DType::F32;
                    values.len = (master.len() / 4) as u64;
                    step(&values)
                };
                fused::round_nearest_storage(master, s1, l1)?;
                r
            }
            (DType::BF16 | DType::F16, EngineBuf::Compensation(comp)) => {
                let scratch = fused::widen_compensated_storage(s1, l1, &comp.as_view())?; // (numel,) f32: w + c
                let r = step_scratch(&scratch, &mut step)?;
                fused::round_compensated_storage(&scratch.as_view(), s1, l1, comp.as_view_mut())?;
                r
            }
            (DType::BF16 | DType::F16, EngineBuf::Nothing) => {
                let scratch = fused::widen_storage(s1, l1)?; // (numel,) f32
                let r = step_scratch(&scratch, &mut step)?;
                fused::round_stochastic_storage(&scratch, s1, l1, self.round_seed)?;
                r
            }
            (other, engine) => candle_core::bail!(
                "optimizer step: parameters stored as {other:?} with {}; f32 weights take no engine buffer, bf16 or \
                 f16 ones an f32 master, a compensation or none",
                engine.describe()
            ),
        };
        *self.result.borrow_mut() = result;
        Ok(())
    }

    fn cpu_fwd(&self, s1: &mut CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> candle_core::Result<()> {
        let (Some((a0, a1)), Some((b0, b1))) = (l1.contiguous_offsets(), l2.contiguous_offsets()) else {
            candle_core::bail!("optimizer step: parameter and gradient must be contiguous")
        };
        let CpuStorage::F32(grad) = s2 else { candle_core::bail!("optimizer step: the gradient must be f32") };
        let grad = &grad[b0..b1];
        self.sumsq.set(grad.iter().map(|&g| g as f64 * g as f64).sum());
        match s1 {
            CpuStorage::F32(values) => {
                let mut state = self.state.borrow_mut();
                let mut views: Vec<StateBuf<'_>> =
                    state.iter_mut().filter(|b| !b.host).map(|b| StateBuf::new(b.spec.dtype, b.bytes_mut())).collect();
                let info = ParamInfo::new(self.name, self.shape);
                *self.result.borrow_mut() =
                    self.optimizer.borrow_mut().step(&info, &mut values[a0..a1], grad, &mut views, &self.ctx);
            }
            CpuStorage::BF16(values) => self.step_half(&mut values[a0..a1], grad),
            CpuStorage::F16(values) => self.step_half(&mut values[a0..a1], grad),
            _ => candle_core::bail!("optimizer step: parameters must be stored as f32, bf16 or f16"),
        }
        Ok(())
    }
}

/// Updates `param` in place from `grad` (f32, same shape) with the plugin; `round_seed`
/// seeds the stochastic rounding of half-precision weights without masters. Returns the
/// gradient's Σ g² on the CPU (computed as the step reads it), `None` on the GPU.
pub fn step_param(
    optimizer: &mut dyn Optimizer,
    plugin: &str,
    param: &Param,
    grad: &Tensor,
    state: &mut Vec<StateBuffer>,
    ctx: StepContext,
    round_seed: u64,
) -> Result<Option<f64>, TrainError> {
    let shape = shape_u64(param);
    let op = StepOp {
        optimizer: RefCell::new(optimizer),
        state: RefCell::new(state),
        name: &param.def.name,
        shape: &shape,
        ctx,
        round_seed,
        result: RefCell::new(Ok(())),
        sumsq: std::cell::Cell::new(0.0),
    };
    let grad = grad.contiguous().map_err(TrainError::candle)?;
    param.var.as_tensor().inplace_op2(&grad, &op).map_err(TrainError::candle)?;
    // The CPU step adds Σ g² as it reads the gradient; the GPU's would cost a read back per
    // parameter, and its callers have the sum already (the norm, the check before a step
    // inside backward).
    let sumsq = if grad.device().is_cuda() { None } else { Some(op.sumsq.get()) };
    op.result.into_inner().map_err(|e| TrainError::Plugin {
        plugin: plugin.to_string(),
        what: "step",
        message: format!("{} ({e})", param.def.name),
    })?;
    Ok(sumsq)
}

/// Mismatches between a checkpoint's optimizer state and the optimizer's layout, grouped by
/// what is wrong and the buffer's own name (`exp_avg`, `step`), so a change of optimizer reads
/// as a few lines rather than one per tensor.
#[derive(Default)]
struct StateProblems {
    /// (what, buffer) → (how many, the first full name).
    groups: std::collections::BTreeMap<(String, String), (usize, String)>,
}

impl StateProblems {
    fn add(&mut self, what: &str, buffer: &str, name: &str) {
        let e = self.groups.entry((what.to_string(), buffer.to_string())).or_insert((0, name.to_string()));
        e.0 += 1;
    }

    fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// `missing exp_avg: 22 tensors (e.g. lm_head.weight.exp_avg)`, one line per group.
    fn lines(&self) -> Vec<String> {
        self.groups
            .iter()
            .map(|((what, buffer), (n, first))| match n {
                1 => format!("{what} {buffer}: {first}"),
                _ => format!("{what} {buffer}: {n} tensors (e.g. {first})"),
            })
            .collect()
    }
}
