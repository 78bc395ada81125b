//! The [`Optimizer`] trait: a per-parameter update with explicit, host-allocated state.
//!
//! The engine asks [`Optimizer::state_layout`] once per parameter, allocates the named
//! buffers itself (so it can count them, place them in an offload tier and save them in
//! checkpoints), zero-fills them, and calls [`Optimizer::step`] with them every step.

use abi_stable::{
    StableAbi, sabi_trait,
    std_types::{RBox, RResult, RSlice, RSliceMut, RStr, RString, RVec},
};

use crate::{
    PluginError,
    device::{CudaBuf, CudaStream},
    ffi::guard,
};

/// Element type of a state buffer.
#[repr(u8)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit float.
    F32 = 0,
    /// IEEE half.
    F16 = 1,
    /// bfloat16.
    BF16 = 2,
    /// Unsigned byte (quantization codes).
    U8 = 3,
    /// Signed byte.
    I8 = 4,
    /// 64-bit float.
    F64 = 5,
    /// 32-bit unsigned integer.
    U32 = 6,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Self::U8 | Self::I8 => 1,
            Self::F16 | Self::BF16 => 2,
            Self::F32 | Self::U32 => 4,
            Self::F64 => 8,
        }
    }
    /// Lowercase name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::BF16 => "bf16",
            Self::U8 => "u8",
            Self::I8 => "i8",
            Self::F64 => "f64",
            Self::U32 => "u32",
        }
    }
}

/// The parameter being updated: its Hugging Face style name and its shape.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy)]
pub struct ParamInfo<'a> {
    /// e.g. `model.layers.0.self_attn.q_proj.weight`.
    pub name: RStr<'a>,
    /// Dimensions, outermost first (a Linear weight is `[out, in]`).
    pub shape: RSlice<'a, u64>,
}

impl<'a> ParamInfo<'a> {
    /// Builds the info from plain Rust values.
    pub fn new(name: &'a str, shape: &'a [u64]) -> Self {
        Self { name: name.into(), shape: shape.into() }
    }
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product::<u64>() as usize
    }
}

/// One state buffer an optimizer needs for a parameter.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq, Eq)]
pub struct StateSpec {
    /// Name within the parameter (`exp_avg`, `absmax_m`); saved under it in checkpoints.
    pub name: RString,
    /// Element type.
    pub dtype: DType,
    /// Number of elements.
    pub len: u64,
}

impl StateSpec {
    /// A spec.
    pub fn new(name: &str, dtype: DType, len: usize) -> Self {
        Self { name: name.into(), dtype, len: len as u64 }
    }
    /// Bytes the buffer takes.
    pub fn bytes(&self) -> u64 {
        self.len * self.dtype.size() as u64
    }
}

/// A state buffer handed to [`Optimizer::step`], in the order of the layout. The host
/// allocates it 8-byte aligned and zero-filled before the first step.
#[repr(C)]
#[derive(StableAbi, Debug)]
pub struct StateBuf<'a> {
    /// Element type (as declared).
    pub dtype: DType,
    /// The bytes.
    pub bytes: RSliceMut<'a, u8>,
}

impl<'a> StateBuf<'a> {
    /// Wraps raw bytes.
    pub fn new(dtype: DType, bytes: &'a mut [u8]) -> Self {
        Self { dtype, bytes: bytes.into() }
    }

    fn typed<T: bytemuck::Pod>(&mut self, want: DType) -> Result<&mut [T], PluginError> {
        if self.dtype != want {
            return Err(PluginError::invalid_input(format!(
                "state buffer is {}, read as {}",
                self.dtype.as_str(),
                want.as_str()
            )));
        }
        bytemuck::try_cast_slice_mut(self.bytes.as_mut_slice()).map_err(|e| {
            PluginError::invalid_input(format!("state buffer cannot be viewed as {}: {e:?}", want.as_str()))
        })
    }

    /// The buffer as `f32`s.
    pub fn f32(&mut self) -> Result<&mut [f32], PluginError> {
        self.typed(DType::F32)
    }
    /// The buffer as `u8` codes.
    pub fn u8(&mut self) -> Result<&mut [u8], PluginError> {
        self.typed(DType::U8)
    }
    /// The buffer as `u32`s.
    pub fn u32(&mut self) -> Result<&mut [u32], PluginError> {
        self.typed(DType::U32)
    }
    /// The buffer as `f64`s.
    pub fn f64(&mut self) -> Result<&mut [f64], PluginError> {
        self.typed(DType::F64)
    }
}

/// Per-step values from the trainer.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq)]
pub struct StepContext {
    /// 1-based global step number, for schedules. An optimizer that needs a per-parameter
    /// count (bias correction) keeps it in its own state, as torch does, so parameters that
    /// start training later and resumed runs stay exact.
    pub step: u64,
    /// Learning rate for this step (after the schedule).
    pub lr: f64,
    /// Weight decay λ for this parameter (0 for norms, biases and embeddings by default);
    /// each optimizer applies it its own way (AdamW and Lion decoupled, SGD as L2).
    pub weight_decay: f64,
    /// Threads the optimizer may use.
    pub threads: u32,
    /// The factor every element of the gradient is to be multiplied by before it is used
    /// (the global-norm clipping over the loss scale). An optimizer that says so
    /// ([`Optimizer::scales_gradients`]) applies it inside its step, as
    /// [`grad_affine`](Self::grad_affine) says, which spares the host a pass over every
    /// gradient; any other receives gradients the host has scaled already and `grad_scale`
    /// 1. (Contract 3; torch's fused AdamW takes its `grad_scale` the same way.)
    pub grad_scale: f64,
}

impl StepContext {
    /// The per-step values with no gradient scaling (`grad_scale` 1).
    pub fn new(step: u64, lr: f64, weight_decay: f64, threads: u32) -> Self {
        Self { step, lr, weight_decay, threads, grad_scale: 1.0 }
    }

    /// `(mul, add)` such that `g * mul + add` (two f32 operations, not fused) is the
    /// gradient element the host would have handed over scaled: `g · s + 0` for a scale s ≠ 1
    /// (the host's affine, which also makes −0 into +0), and `g` itself for s = 1 (`+ −0` changes
    /// no value). An optimizer that applies it this way gives the same bits as on the host's
    /// scaled copy.
    pub fn grad_affine(&self) -> (f32, f32) {
        if self.grad_scale == 1.0 { (1.0, -0.0) } else { (self.grad_scale as f32, 0.0) }
    }
}

/// A per-parameter optimizer. State lives in host-allocated buffers described by
/// [`state_layout`](Self::state_layout); the optimizer object itself holds only
/// hyper-parameters.
///
/// A step of one parameter may depend only on that parameter's values, gradient and state:
/// the host steps parameters in any order, and with `train.step_in_backward` interleaves
/// them with the backward pass (each as soon as its gradient is final), with `values` in
/// f32 even when the weights are stored in bf16 (the host widens and rounds them).
pub trait Optimizer: Send {
    /// State buffers for `param`, in the order `step` receives them. Called once per
    /// parameter before the first step.
    fn state_layout(&self, param: &ParamInfo<'_>) -> Result<Vec<StateSpec>, PluginError>;

    /// Whether [`step`](Self::step) and [`step_cuda`](Self::step_cuda) multiply the gradient
    /// by [`StepContext::grad_scale`] themselves. The default, `false`, has the host scale
    /// each gradient first (a pass over it, and on a GPU a launch per parameter) and pass 1.
    fn scales_gradients(&self) -> bool {
        false
    }

    /// Updates `values` in place from `grad`, reading and writing `state`.
    fn step(
        &mut self,
        param: &ParamInfo<'_>,
        values: &mut [f32],
        grad: &[f32],
        state: &mut [StateBuf<'_>],
        ctx: &StepContext,
    ) -> Result<(), PluginError>;

    /// [`step`](Self::step) on a CUDA device: updates `values` in place from `grad`, reading
    /// and writing `state`, by launching work on `stream` (see [`crate::device`] for the rules
    /// of a device call: host-owned memory, launch only on `stream`, never synchronize).
    ///
    /// `values` are the parameter's f32 master weights (`numel` elements, [`DType::F32`]),
    /// `grad` its f32 gradient (`numel` elements), `state` the buffers of
    /// [`state_layout`](Self::state_layout) in its order, each of the declared dtype and
    /// length, zero-filled by the host before the first step. All are on device
    /// `stream.ordinal`. [`CudaBuf::expect`] checks one.
    ///
    /// Called only for a plugin whose manifest lists [`Device::Cuda`](crate::Device::Cuda),
    /// which promises this method. The default refuses.
    fn step_cuda(
        &mut self,
        param: &ParamInfo<'_>,
        values: &CudaBuf,
        grad: &CudaBuf,
        state: &[CudaBuf],
        ctx: &StepContext,
        stream: &CudaStream,
    ) -> Result<(), PluginError> {
        let _ = (param, values, grad, state, ctx, stream);
        Err(PluginError::unsupported(
            "this optimizer has no CUDA step (Optimizer::step_cuda): its manifest must not list the cuda device",
        ))
    }
}

impl<T: Optimizer + ?Sized> Optimizer for Box<T> {
    fn state_layout(&self, param: &ParamInfo<'_>) -> Result<Vec<StateSpec>, PluginError> {
        (**self).state_layout(param)
    }
    fn scales_gradients(&self) -> bool {
        (**self).scales_gradients()
    }
    fn step(
        &mut self,
        param: &ParamInfo<'_>,
        values: &mut [f32],
        grad: &[f32],
        state: &mut [StateBuf<'_>],
        ctx: &StepContext,
    ) -> Result<(), PluginError> {
        (**self).step(param, values, grad, state, ctx)
    }
    fn step_cuda(
        &mut self,
        param: &ParamInfo<'_>,
        values: &CudaBuf,
        grad: &CudaBuf,
        state: &[CudaBuf],
        ctx: &StepContext,
        stream: &CudaStream,
    ) -> Result<(), PluginError> {
        (**self).step_cuda(param, values, grad, state, ctx, stream)
    }
}

/// The FFI-safe form of [`Optimizer`] (what crosses the boundary).
#[sabi_trait]
pub trait FfiOptimizer: Send {
    /// See [`Optimizer::state_layout`].
    fn state_layout(&self, param: ParamInfo<'_>) -> RResult<RVec<StateSpec>, PluginError>;
    /// See [`Optimizer::step`].
    fn step<'a>(
        &mut self,
        param: ParamInfo<'_>,
        values: RSliceMut<'_, f32>,
        grad: RSlice<'_, f32>,
        state: RSliceMut<'_, StateBuf<'a>>,
        ctx: StepContext,
    ) -> RResult<(), PluginError>;
    /// See [`Optimizer::step_cuda`].
    fn step_cuda(
        &mut self,
        param: ParamInfo<'_>,
        values: CudaBuf,
        grad: CudaBuf,
        state: RSlice<'_, CudaBuf>,
        ctx: StepContext,
        stream: CudaStream,
    ) -> RResult<(), PluginError>;
    /// See [`Optimizer::scales_gradients`] (contract 3, after the methods of contract 2).
    fn scales_gradients(&self) -> bool;
}

/// A boxed optimizer from a plugin library.
pub type OptimizerBox = FfiOptimizer_TO<'static, RBox<()>>;

/// Plugin side: runs a Rust [`Optimizer`] behind the FFI trait, catching panics.
pub(crate) struct Guarded<T>(pub T);

impl<T: Optimizer> FfiOptimizer for Guarded<T> {
    fn state_layout(&self, param: ParamInfo<'_>) -> RResult<RVec<StateSpec>, PluginError> {
        guard("Optimizer::state_layout", || self.0.state_layout(&param).map(RVec::from))
    }
    fn scales_gradients(&self) -> bool {
        // A panic here would abort; one in a bool getter means no (the host scales the
        // gradient first, which is always right).
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.0.scales_gradients())).unwrap_or(false)
    }
    fn step<'a>(
        &mut self,
        param: ParamInfo<'_>,
        mut values: RSliceMut<'_, f32>,
        grad: RSlice<'_, f32>,
        mut state: RSliceMut<'_, StateBuf<'a>>,
        ctx: StepContext,
    ) -> RResult<(), PluginError> {
        guard("Optimizer::step", || {
            self.0.step(&param, values.as_mut_slice(), grad.as_slice(), state.as_mut_slice(), &ctx)
        })
    }
    fn step_cuda(
        &mut self,
        param: ParamInfo<'_>,
        values: CudaBuf,
        grad: CudaBuf,
        state: RSlice<'_, CudaBuf>,
        ctx: StepContext,
        stream: CudaStream,
    ) -> RResult<(), PluginError> {
        guard("Optimizer::step_cuda", || self.0.step_cuda(&param, &values, &grad, state.as_slice(), &ctx, &stream))
    }
}

/// Host side: a plugin's optimizer behind the Rust trait.
pub struct ForeignOptimizer(pub OptimizerBox);

impl Optimizer for ForeignOptimizer {
    fn state_layout(&self, param: &ParamInfo<'_>) -> Result<Vec<StateSpec>, PluginError> {
        self.0.state_layout(*param).into_result().map(RVec::into_vec)
    }
    fn scales_gradients(&self) -> bool {
        self.0.scales_gradients()
    }
    fn step(
        &mut self,
        param: &ParamInfo<'_>,
        values: &mut [f32],
        grad: &[f32],
        state: &mut [StateBuf<'_>],
        ctx: &StepContext,
    ) -> Result<(), PluginError> {
        self.0.step(*param, values.into(), grad.into(), state.into(), *ctx).into_result()
    }
    fn step_cuda(
        &mut self,
        param: &ParamInfo<'_>,
        values: &CudaBuf,
        grad: &CudaBuf,
        state: &[CudaBuf],
        ctx: &StepContext,
        stream: &CudaStream,
    ) -> Result<(), PluginError> {
        self.0.step_cuda(*param, *values, *grad, state.into(), *ctx, *stream).into_result()
    }
}

#[cfg(test)]
mod tests {
    use abi_stable::sabi_trait::TD_Opaque;

    use super::*;
    use crate::ErrorKind;

    /// A CPU-only optimizer: keeps the default `step_cuda`.
    struct CpuOnly;

    /// What a CUDA step received.
    type Seen = (String, CudaBuf, CudaBuf, Vec<CudaBuf>, StepContext, CudaStream);

    /// An optimizer whose CUDA step records what crossed (or panics when told to).
    #[derive(Default)]
    struct Recording {
        seen: std::sync::Arc<std::sync::Mutex<Option<Seen>>>,
        panic: bool,
    }

    impl Optimizer for CpuOnly {
        fn state_layout(&self, _: &ParamInfo<'_>) -> Result<Vec<StateSpec>, PluginError> {
            Ok(Vec::new())
        }
        fn step(
            &mut self,
            _: &ParamInfo<'_>,
            _: &mut [f32],
            _: &[f32],
            _: &mut [StateBuf<'_>],
            _: &StepContext,
        ) -> Result<(), PluginError> {
            Ok(())
        }
    }

    impl Optimizer for Recording {
        fn state_layout(&self, _: &ParamInfo<'_>) -> Result<Vec<StateSpec>, PluginError> {
            Ok(Vec::new())
        }
        fn step(
            &mut self,
            _: &ParamInfo<'_>,
            _: &mut [f32],
            _: &[f32],
            _: &mut [StateBuf<'_>],
            _: &StepContext,
        ) -> Result<(), PluginError> {
            Ok(())
        }
        fn step_cuda(
            &mut self,
            param: &ParamInfo<'_>,
            values: &CudaBuf,
            grad: &CudaBuf,
            state: &[CudaBuf],
            ctx: &StepContext,
            stream: &CudaStream,
        ) -> Result<(), PluginError> {
            assert!(!self.panic, "kernel launch failed");
            values.expect("values", DType::F32, param.numel())?;
            *self.seen.lock().unwrap() = Some((param.name.to_string(), *values, *grad, state.to_vec(), *ctx, *stream));
            Ok(())
        }
    }

    fn foreign<O: Optimizer + 'static>(o: O) -> ForeignOptimizer {
        ForeignOptimizer(FfiOptimizer_TO::from_value(Guarded(o), TD_Opaque))
    }

    /// The CUDA step crosses the boundary with every argument; the default refuses, and a
    /// panic in it is caught naming the method.
    #[test]
    fn step_cuda_crosses_the_boundary() {
        let shape = [2u64, 3];
        let param = ParamInfo::new("w", &shape);
        let values = CudaBuf { ptr: 0x1000, len: 6, dtype: DType::F32, ordinal: 1 };
        let grad = CudaBuf { ptr: 0x2000, len: 6, dtype: DType::F32, ordinal: 1 };
        let state = [
            CudaBuf { ptr: 0x3000, len: 6, dtype: DType::U8, ordinal: 1 },
            CudaBuf { ptr: 0x4000, len: 1, dtype: DType::F32, ordinal: 1 },
        ];
        let ctx = StepContext { step: 7, lr: 1e-3, weight_decay: 0.1, threads: 2, grad_scale: 0.25 };
        let stream = CudaStream { handle: 0xdead_beef, ordinal: 1 };

        let e = foreign(CpuOnly).step_cuda(&param, &values, &grad, &state, &ctx, &stream).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Unsupported);
        assert_eq!(
            e.message.as_str(),
            "this optimizer has no CUDA step (Optimizer::step_cuda): its manifest must not list the cuda device"
        );
        // Through a Box, as the registry hands optimizers out.
        let mut boxed: Box<dyn Optimizer> = Box::new(CpuOnly);
        assert_eq!(boxed.step_cuda(&param, &values, &grad, &state, &ctx, &stream).unwrap_err(), e);

        let rec = Recording::default();
        let seen = rec.seen.clone();
        let mut f = foreign(rec);
        f.step_cuda(&param, &values, &grad, &state, &ctx, &stream).unwrap();
        let want = ("w".to_string(), values, grad, state.to_vec(), ctx, stream);
        assert_eq!(seen.lock().unwrap().as_ref(), Some(&want));
        // The plugin's own error comes back as it was.
        let half = CudaBuf { dtype: DType::BF16, ..values };
        let e = f.step_cuda(&param, &half, &grad, &state, &ctx, &stream).unwrap_err();
        assert_eq!(e.message.as_str(), "values has 6 bf16 elements, expected 6 f32");

        let e = foreign(Recording { panic: true, ..Recording::default() })
            .step_cuda(&param, &values, &grad, &state, &ctx, &stream)
            .unwrap_err();
        assert_eq!(e.kind, ErrorKind::Panicked);
        assert_eq!(e.message.as_str(), "panicked in Optimizer::step_cuda: kernel launch failed");
    }

    /// An optimizer that applies the gradient scale itself, and one whose flag panics.
    struct Scaling {
        panic: bool,
    }

    impl Optimizer for Scaling {
        fn scales_gradients(&self) -> bool {
            assert!(!self.panic, "no flag");
            true
        }
        fn state_layout(&self, _: &ParamInfo<'_>) -> Result<Vec<StateSpec>, PluginError> {
            Ok(Vec::new())
        }
        fn step(
            &mut self,
            _: &ParamInfo<'_>,
            values: &mut [f32],
            grad: &[f32],
            _: &mut [StateBuf<'_>],
            ctx: &StepContext,
        ) -> Result<(), PluginError> {
            let (mul, add) = ctx.grad_affine();
            values.iter_mut().zip(grad).for_each(|(w, g)| *w -= g * mul + add);
            Ok(())
        }
    }

    /// `scales_gradients` and `grad_scale` cross the boundary (contract 3); the default is
    /// no, and a panic in the flag reads as no, so the host scales the gradient itself.
    #[test]
    fn the_gradient_scale_and_who_applies_it_cross_the_boundary() {
        assert!(!foreign(CpuOnly).scales_gradients());
        assert!(!(Box::new(CpuOnly) as Box<dyn Optimizer>).scales_gradients());
        let mut f = foreign(Scaling { panic: false });
        assert!(f.scales_gradients());
        assert!((Box::new(Scaling { panic: false }) as Box<dyn Optimizer>).scales_gradients());
        assert!(!foreign(Scaling { panic: true }).scales_gradients());
        let shape = [2u64];
        let mut values = [1.0f32, 2.0];
        let ctx = StepContext { grad_scale: 0.5, ..StepContext::new(1, 0.1, 0.0, 1) };
        f.step(&ParamInfo::new("w", &shape), &mut values, &[4.0, -2.0], &mut [], &ctx).unwrap();
        assert_eq!(values, [-1.0, 3.0]);
        assert_eq!(StepContext::new(3, 0.1, 0.2, 4).grad_scale, 1.0);
        // The host's product: −0 stays −0 unscaled, and becomes +0 when scaled (candle's
        // affine adds 0).
        let unscaled = StepContext::new(1, 0.1, 0.0, 1).grad_affine();
        assert_eq!(((-0.0f32) * unscaled.0 + unscaled.1).to_bits(), (-0.0f32).to_bits());
        assert_eq!((3.5f32 * unscaled.0 + unscaled.1).to_bits(), 3.5f32.to_bits());
        let scaled = StepContext { grad_scale: 0.25, ..StepContext::new(1, 0.1, 0.0, 1) }.grad_affine();
        assert_eq!(((-0.0f32) * scaled.0 + scaled.1).to_bits(), 0.0f32.to_bits());
        assert_eq!(3.5f32 * scaled.0 + scaled.1, 0.875);
    }
}
