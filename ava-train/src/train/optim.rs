//! The optimizer plugin applied to the model: the options the engine fills in from the
//! model, state buffers allocated by the engine from the plugin's declared layout, and an
//! in-place candle op that hands each parameter, its gradient and its state to the plugin's
//! `step`.

use std::cell::RefCell;

use ava_core::{DType as StateDType, Optimizer, ParamInfo, StateBuf, StateSpec, StepContext};
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
/// zero-filled, as the contract promises.
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
}

/// Every parameter's optimizer state.
#[derive(Debug, Clone, PartialEq)]
pub struct OptimizerState {
    /// Per parameter (in model order), its buffers in layout order.
    pub buffers: Vec<Vec<StateBuffer>>,
}

fn shape_u64(p: &Param) -> Vec<u64> {
    p.def.shape.iter().map(|&d| d as u64).collect()
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
        Ok(Self { buffers })
    }

    /// Total bytes of state.
    pub fn bytes(&self) -> u64 {
        self.buffers.iter().flatten().map(|b| b.spec.bytes()).sum()
    }

    /// The state as named buffers `{param}.{buffer}` for a checkpoint.
    pub fn to_buffers(&self, params: &[Param]) -> Vec<NamedBuffer> {
        let mut out = Vec::new();
        for (p, bufs) in params.iter().zip(&self.buffers) {
            for b in bufs {
                out.push(NamedBuffer {
                    name: format!("{}.{}", p.def.name, b.spec.name),
                    dtype: buf_dtype(b.spec.dtype),
                    shape: vec![b.spec.len as usize],
                    data: b.bytes().to_vec(),
                });
            }
        }
        out
    }

    /// Fills the state from a checkpoint's buffers; every buffer of the layout must be there
    /// with the declared type and length.
    pub fn load_buffers(&mut self, params: &[Param], saved: Vec<NamedBuffer>) -> Result<(), TrainError> {
        let mut by_name: std::collections::HashMap<String, NamedBuffer> =
            saved.into_iter().map(|b| (b.name.clone(), b)).collect();
        let mut problems = Vec::new();
        for (p, bufs) in params.iter().zip(&mut self.buffers) {
            for b in bufs {
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
                    Some(s) => b.bytes_mut().copy_from_slice(&s.data),
                }
            }
        }
        problems.extend(by_name.into_keys().map(|k| format!("unexpected {k}")));
        if problems.is_empty() { Ok(()) } else { Err(TrainError::OptimizerState { problems }) }
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
