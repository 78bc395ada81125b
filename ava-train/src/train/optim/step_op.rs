//! The in-place candle op that hands a parameter, its gradient and its state to the plugin's
//! `step` ([`step_param`]): f32 weights stepped where they are, half weights through an f32
//! scratch or their master and rounded back, on the host or on the device.

use super::*;

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
