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

use ava_core::{DType as StateDType, OffloadTier, Optimizer, ParamInfo, StateBuf, StateSpec, StepContext};
use candle_core::{CpuStorage, InplaceOp2, Layout, Tensor};

use super::TrainError;
use crate::config::PluginSelection;
use crate::model::{ModelSpec, Param};
use crate::save::{BufDType, NamedBuffer};

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
/// between steps.
#[derive(Debug, Clone, PartialEq)]
pub struct StateBuffer {
    /// Name, type and length, as the plugin declared.
    pub spec: StateSpec,
    words: Vec<u64>,
}

impl StateBuffer {
    fn new(spec: StateSpec) -> Self {
        let bytes = spec.bytes() as usize;
        Self { spec, words: vec![0u64; bytes.div_ceil(8)] }
    }

    /// The buffer's bytes.
    pub fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.spec.bytes() as usize]
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        let n = self.spec.bytes() as usize;
        &mut bytemuck::cast_slice_mut(&mut self.words)[..n]
    }

    /// Gives the memory back (the bytes are in the tier).
    fn release(&mut self) {
        self.words = Vec::new();
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
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StreamStats {
    /// Most bytes of state held at once: the engine's buffers and the tier's own memory.
    pub peak_resident: u64,
    /// Of that, the most the tier held (its writes in flight and prefetched reads).
    pub peak_tier: u64,
}

/// Every parameter's optimizer state.
#[derive(Debug)]
pub struct OptimizerState {
    /// Per parameter (in model order), its buffers in layout order (no bytes held for a
    /// streamed parameter between steps).
    pub buffers: Vec<Vec<StateBuffer>>,
    streamed: Option<Streamed>,
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

impl OptimizerState {
    /// Allocates the state `optimizer` declares for each parameter.
    pub fn allocate(optimizer: &dyn Optimizer, params: &[Param], plugin: &str) -> Result<Self, TrainError> {
        let buffers = params
            .iter()
            .map(|p| {
                let shape = shape_u64(p);
                let layout = optimizer.state_layout(&ParamInfo::new(&p.def.name, &shape)).map_err(|e| {
                    TrainError::Plugin { plugin: plugin.to_string(), what: "state_layout", message: e.to_string() }
                })?;
                Ok(layout.into_iter().map(StateBuffer::new).collect())
            })
            .collect::<Result<_, TrainError>>()?;
        Ok(Self { buffers, streamed: None })
    }

    /// Streams the state of the parameters past the first `in_ram` fraction of the bytes
    /// (in model order) through `tier`: checks the tier has room (its preflight), writes
    /// their current state there and frees it here. `prefetch` parameters are read ahead
    /// during the step. Returns the bytes moved to the tier.
    pub fn stream(
        &mut self,
        params: &[Param],
        tier: Arc<dyn OffloadTier>,
        name: &str,
        in_ram: f64,
        prefetch: usize,
    ) -> Result<u64, TrainError> {
        if !tier.exact() {
            return Err(TrainError::Invalid(format!(
                "offload.tiers: the tier '{name}' is lossy (it compresses what it stores), and optimizer state \
                 must come back exactly: stream it through an exact tier such as nvme, or set offload.tiers: [ram: 100%]"
            )));
        }
        let per_param: Vec<u64> = self.buffers.iter().map(|b| b.iter().map(|b| b.spec.bytes()).sum()).collect();
        let offloaded = streamed_params(&per_param, in_ram);
        let records: Vec<u64> = (0..self.buffers.len())
            .filter(|&i| offloaded[i])
            .flat_map(|i| self.buffers[i].iter().map(|b| b.spec.bytes()))
            .collect();
        tier.preflight(&records).map_err(|e| tier_error(name, "preflight", e))?;
        let keys: Vec<Vec<String>> = params
            .iter()
            .zip(&self.buffers)
            .zip(&offloaded)
            .map(
                |((p, bufs), &off)| {
                    if off { bufs.iter().map(|b| key(&p.def.name, &b.spec.name)).collect() } else { Vec::new() }
                },
            )
            .collect();
        let mut moved = 0;
        for (i, ks) in keys.iter().enumerate() {
            for (b, k) in self.buffers[i].iter().zip(ks) {
                tier.put(k, b.bytes(), b.spec.dtype).map_err(|e| tier_error(name, &format!("storing {k}"), e))?;
                moved += b.spec.bytes();
            }
        }
        tier.flush().map_err(|e| tier_error(name, "writing the optimizer state", e))?;
        // Only once every record is stored: a failure above leaves the state whole here.
        for (i, ks) in keys.iter().enumerate() {
            self.buffers[i].iter_mut().take(ks.len()).for_each(StateBuffer::release);
        }
        self.streamed = Some(Streamed { tier, name: name.to_string(), offloaded, keys, prefetch });
        Ok(moved)
    }

    /// Total bytes of state, wherever it lives.
    pub fn bytes(&self) -> u64 {
        self.buffers.iter().flatten().map(|b| b.spec.bytes()).sum()
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
            _ => Ok(self.buffers[i].iter().map(|b| b.bytes().to_vec()).collect()),
        }
    }
    /// The state as named buffers `{param}.{buffer}` for a checkpoint; streamed state is
    /// read back from the tier, its checksums checked.
    pub fn to_buffers(&self, params: &[Param]) -> Result<Vec<NamedBuffer>, TrainError> {
        let mut out = Vec::new();
        for (i, (p, bufs)) in params.iter().zip(&self.buffers).enumerate() {
            for (b, data) in bufs.iter().zip(self.read(i)?) {
                out.push(NamedBuffer {
                    name: format!("{}.{}", p.def.name, b.spec.name),
                    dtype: buf_dtype(b.spec.dtype),
                    shape: vec![b.spec.len as usize],
                    data,
                });
            }
        }
        Ok(out)
    }

    /// Fills the state from a checkpoint's buffers; every buffer of the layout must be there
    /// with the declared type and length. Streamed state goes to the tier.
    pub fn load_buffers(&mut self, params: &[Param], saved: Vec<NamedBuffer>) -> Result<(), TrainError> {
        let mut by_name: std::collections::HashMap<String, NamedBuffer> =
            saved.into_iter().map(|b| (b.name.clone(), b)).collect();
        let mut problems = Vec::new();
        for (i, (p, bufs)) in params.iter().zip(&mut self.buffers).enumerate() {
            for (j, b) in bufs.iter_mut().enumerate() {
                let name = format!("{}.{}", p.def.name, b.spec.name);
                match by_name.remove(&name) {
                    None => problems.push(format!("missing {name}")),
                    Some(s) if s.dtype != buf_dtype(b.spec.dtype) || s.data.len() != b.spec.bytes() as usize => {
                        problems.push(format!(
                            "{name} is {} x {} bytes, the optimizer declares {} x {}",
                            s.dtype.name(),
                            s.data.len(),
                            b.spec.dtype.as_str(),
                            b.spec.bytes()
                        ))
                    }
                    Some(saved) => match &self.streamed {
                        Some(st) if st.offloaded[i] => {
                            let k = &st.keys[i][j];
                            st.tier
                                .put(k, &saved.data, b.spec.dtype)
                                .map_err(|e| tier_error(&st.name, &format!("storing {k}"), e))?;
                        }
                        _ => b.bytes_mut().copy_from_slice(&saved.data),
                    },
                }
            }
        }
        problems.extend(by_name.into_keys().map(|k| format!("unexpected {k}")));
        if !problems.is_empty() {
            return Err(TrainError::OptimizerState { problems });
        }
        if let Some(st) = &self.streamed {
            st.tier.flush().map_err(|e| tier_error(&st.name, "writing the optimizer state", e))?;
        }
        Ok(())
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
        let resident = self.resident_bytes();
        // The buffers change while the placement is only read: borrowed apart.
        let Self { buffers, streamed } = self;
        let Some(Streamed { tier, name, offloaded, keys, prefetch }) = streamed.as_ref() else {
            for &i in active {
                step(i, &mut buffers[i])?;
            }
            return Ok(StreamStats::default());
        };
        let prefetch = *prefetch;
        let (ram, disk): (Vec<usize>, Vec<usize>) = active.iter().partition(|&&i| !offloaded[i]);
        let mut stats = StreamStats::default();
        let sample = |stats: &mut StreamStats, working: u64| {
            let in_tier = tier.resident_bytes();
            stats.peak_tier = stats.peak_tier.max(in_tier);
            stats.peak_resident = stats.peak_resident.max(resident + working + in_tier);
        };
        // Reads are issued for the streamed parameters before `upto` not yet asked for.
        let mut queued = 0;
        let read_ahead = |queued: &mut usize, upto: usize| -> Result<(), TrainError> {
            while *queued < disk.len().min(upto) {
                for k in &keys[disk[*queued]] {
                    tier.prefetch(k).map_err(|e| tier_error(name, &format!("prefetching {k}"), e))?;
                }
                *queued += 1;
            }
            Ok(())
        };
        read_ahead(&mut queued, prefetch)?;
        for &i in &ram {
            step(i, &mut buffers[i])?;
        }
        for (n, &i) in disk.iter().enumerate() {
            let bufs = &mut buffers[i];
            for (b, k) in bufs.iter_mut().zip(&keys[i]) {
                b.reserve();
                tier.get(k, b.bytes_mut()).map_err(|e| tier_error(name, &format!("reading {k}"), e))?;
            }
            // The next `prefetch` parameters load while this one is updated (this one was
            // just read: never asked for again).
            queued = queued.max(n + 1);
            read_ahead(&mut queued, n + 1 + prefetch)?;
            let working: u64 = bufs.iter().map(StateBuffer::held).sum();
            sample(&mut stats, working);
            step(i, bufs)?;
            // Each buffer is freed as soon as the tier has its copy.
            let mut left = working;
            for (b, k) in bufs.iter_mut().zip(&keys[i]) {
                tier.put(k, b.bytes(), b.spec.dtype).map_err(|e| tier_error(name, &format!("storing {k}"), e))?;
                sample(&mut stats, left);
                left -= b.held();
                b.release();
            }
        }
        tier.flush().map_err(|e| tier_error(name, "writing the optimizer state", e))?;
        sample(&mut stats, 0);
        Ok(stats)
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

/// Calls the plugin's `step` on a parameter's storage in place.
struct StepOp<'a> {
    optimizer: RefCell<&'a mut dyn Optimizer>,
    state: RefCell<&'a mut Vec<StateBuffer>>,
    name: &'a str,
    shape: &'a [u64],
    ctx: StepContext,
    result: RefCell<Result<(), ava_core::PluginError>>,
}

impl InplaceOp2 for StepOp<'_> {
    fn name(&self) -> &'static str {
        "ava-optimizer-step"
    }

    fn cpu_fwd(&self, s1: &mut CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> candle_core::Result<()> {
        let (Some((a0, a1)), Some((b0, b1))) = (l1.contiguous_offsets(), l2.contiguous_offsets()) else {
            candle_core::bail!("optimizer step: parameter and gradient must be contiguous")
        };
        let (CpuStorage::F32(values), CpuStorage::F32(grad)) = (s1, s2) else {
            candle_core::bail!("optimizer step: parameter and gradient must be f32")
        };
        let mut state = self.state.borrow_mut();
        let mut views: Vec<StateBuf<'_>> =
            state.iter_mut().map(|b| StateBuf::new(b.spec.dtype, b.bytes_mut())).collect();
        let info = ParamInfo::new(self.name, self.shape);
        *self.result.borrow_mut() =
            self.optimizer.borrow_mut().step(&info, &mut values[a0..a1], &grad[b0..b1], &mut views, &self.ctx);
        Ok(())
    }
}

/// Updates `param` in place from `grad` (f32, same shape) with the plugin.
pub fn step_param(
    optimizer: &mut dyn Optimizer,
    plugin: &str,
    param: &Param,
    grad: &Tensor,
    state: &mut Vec<StateBuffer>,
    ctx: StepContext,
) -> Result<(), TrainError> {
    let shape = shape_u64(param);
    let op = StepOp {
        optimizer: RefCell::new(optimizer),
        state: RefCell::new(state),
        name: &param.def.name,
        shape: &shape,
        ctx,
        result: RefCell::new(Ok(())),
    };
    let grad = grad.contiguous().map_err(TrainError::candle)?;
    param.var.as_tensor().inplace_op2(&grad, &op).map_err(TrainError::candle)?;
    op.result.into_inner().map_err(|e| TrainError::Plugin {
        plugin: plugin.to_string(),
        what: "step",
        message: format!("{} ({e})", param.def.name),
    })
}
