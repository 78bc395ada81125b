//! # Lion optimizer as an Ava plugin
//!
//! Lion ("EvoLved Sign Momentum", Chen et al. 2023, *Symbolic Discovery of Optimization
//! Algorithms*, Algorithm 2) keeps a single momentum buffer and applies the sign of an
//! interpolation between momentum and gradient:
//!
//! ```text
//! c = β1·m + (1 − β1)·g
//! θ ← θ·(1 − lr·λ) − lr·sign(c)
//! m ← β2·m + (1 − β2)·g
//! ```
//!
//! One f32 of state per parameter (AdamW has two). `sign(0) = 0`, as in the reference
//! implementation (`torch.sign`). The paper suggests a learning rate 3–10× smaller and a
//! weight decay 3–10× larger than AdamW's, because the sign update has a larger norm.
//!
//! Built with the `cuda` feature it also steps on NVIDIA GPUs (`step_cuda`: kernels/lion.cu,
//! one thread per element, launched through `ava_kernels::cuda` on the host's stream) and its
//! manifest lists the cuda device, so `train.device: cuda` can use it. The kernel is built
//! with `--fmad=false` and does the CPU's f32 operations in the CPU's order, so a step on the
//! GPU gives the CPU's bits (tests/gpu_lion.rs checks it on a GPU) and a checkpoint moves
//! between devices without changing the run. (Not a NaN's bits: from a NaN or infinite
//! gradient x86 passes an operand's NaN on or makes 0xFFC00000, an NVIDIA GPU makes
//! 0x7FFFFFFF.)

use ava_core::prelude::*;

/// The Lion optimizer's hyper-parameters (state lives in the host's buffers).
#[derive(Debug, Clone, PartialEq)]
pub struct Lion {
    /// Interpolation factor for the update direction.
    pub beta1: f32,
    /// Momentum decay.
    pub beta2: f32,
}

impl Default for Lion {
    fn default() -> Self {
        Self { beta1: 0.9, beta2: 0.99 }
    }
}

impl Plugin for Lion {
    fn manifest() -> Manifest {
        Manifest::new(
            "lion",
            PluginKind::Optimizer,
            env!("CARGO_PKG_VERSION"),
            "Lion: sign of interpolated momentum; one state buffer per parameter (Chen et al. 2023)",
        )
        .devices(if cfg!(feature = "cuda") { &[Device::Cpu, Device::Cuda] } else { &[Device::Cpu] })
        .option(OptionSpec::float_list(
            "betas",
            &[0.9, 0.99],
            "[β1, β2]: β1 interpolates momentum and gradient for the update, β2 decays the momentum",
        ))
    }

    fn from_options(mut options: Options) -> Result<Self, PluginError> {
        let [beta1, beta2] = options.betas("betas");
        options.finish()?;
        Ok(Lion { beta1: beta1 as f32, beta2: beta2 as f32 })
    }
}

impl Optimizer for Lion {
    /// The clipping factor is applied as each gradient element is read
    /// ([`StepContext::grad_affine`]: the product the host would have written), on both devices.
    fn scales_gradients(&self) -> bool {
        true
    }

    fn state_layout(&self, param: &ParamInfo<'_>) -> Result<Vec<StateSpec>, PluginError> {
        Ok(vec![StateSpec::new("exp_avg", DType::F32, param.numel())])
    }

    fn step(
        &mut self,
        param: &ParamInfo<'_>,
        values: &mut [f32],
        grad: &[f32],
        state: &mut [StateBuf<'_>],
        ctx: &StepContext,
    ) -> Result<(), PluginError> {
        let [m] = state else {
            return Err(wrong_state(state.len()));
        };
        let m = m.f32()?;
        let n = param.numel();
        ava_core::error::expect_len("values", values.len(), n)?;
        ava_core::error::expect_len("grad", grad.len(), n)?;
        ava_core::error::expect_len("exp_avg", m.len(), n)?;
        let lr = ctx.lr as f32;
        let decay = 1.0 - lr * ctx.weight_decay as f32;
        let (b1, b2) = (self.beta1, self.beta2);
        let (mul, add) = ctx.grad_affine();
        for ((w, &g), m) in values.iter_mut().zip(grad).zip(m.iter_mut()) {
            let g = g * mul + add;
            let c = b1 * *m + (1.0 - b1) * g;
            *w = *w * decay - lr * sign(c);
            *m = b2 * *m + (1.0 - b2) * g;
        }
        Ok(())
    }

    /// The same step on the GPU: kernels/lion.cu, one thread per element, enqueued on the
    /// host's stream (nothing here waits for it). `lr` and `decay` are computed in f32 here
    /// exactly as `step` computes them.
    #[cfg(feature = "cuda")]
    fn step_cuda(
        &mut self,
        param: &ParamInfo<'_>,
        values: &CudaBuf,
        grad: &CudaBuf,
        state: &[CudaBuf],
        ctx: &StepContext,
        stream: &CudaStream,
    ) -> Result<(), PluginError> {
        use ava_kernels::cuda::{THREADS, arg, blocks, launch};
        let [m] = state else {
            return Err(wrong_state(state.len()));
        };
        let n = param.numel();
        values.expect("values", DType::F32, n)?;
        grad.expect("grad", DType::F32, n)?;
        m.expect("exp_avg", DType::F32, n)?;
        if n == 0 {
            return Ok(());
        }
        let lr = ctx.lr as f32;
        let decay = 1.0 - lr * ctx.weight_decay as f32;
        let (mul, add) = ctx.grad_affine();
        let mut params = [
            arg(&values.ptr),
            arg(&grad.ptr),
            arg(&m.ptr),
            arg(&n),
            arg(&lr),
            arg(&decay),
            arg(&self.beta1),
            arg(&self.beta2),
            arg(&mul),
            arg(&add),
        ];
        // SAFETY: lion_step's parameters one for one (size_t n is a usize, the floats f32s);
        // values, grad and exp_avg were checked to hold n f32s each.
        unsafe { launch(&LION_PTX, c"lion_step", blocks(n)?, THREADS, stream, &mut params) }
    }
}

/// The error for state buffers that are not those of `state_layout`.
fn wrong_state(got: usize) -> PluginError {
    PluginError::invalid_input(format!("lion expects 1 state buffer, got {got}"))
}

/// kernels/lion.cu as PTX (made by build.rs), NUL-terminated for the driver.
#[cfg(feature = "cuda")]
const LION_PTX: ava_kernels::cuda::Ptx =
    ava_kernels::cuda::Ptx::new("lion", concat!(include_str!(concat!(env!("OUT_DIR"), "/lion.ptx")), "\0"));

/// `torch.sign`: −1, 0 or +1 (NaN stays NaN so a bad gradient is not hidden).
fn sign(x: f32) -> f32 {
    if x > 0.0 {
        1.0
    } else if x < 0.0 {
        -1.0
    } else {
        x
    }
}

ava_core::export_plugin!(optimizer: Lion);

#[cfg(test)]
mod tests {
    use super::*;

    fn run(opt: &mut Lion, w: &mut [f32], g: &[f32], m: &mut [f32], ctx: StepContext) {
        let shape = [w.len() as u64];
        let info = ParamInfo::new("w", &shape);
        let bytes: &mut [u8] = bytemuck_cast(m);
        let mut state = [StateBuf::new(DType::F32, bytes)];
        opt.step(&info, w, g, &mut state, &ctx).unwrap();
    }

    fn bytemuck_cast(m: &mut [f32]) -> &mut [u8] {
        // SAFETY: f32 has no padding and every byte pattern is a valid u8.
        unsafe { std::slice::from_raw_parts_mut(m.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(m)) }
    }

    /// Two steps worked by hand from Algorithm 2 of Chen et al. 2023 (β = 0.9, 0.99,
    /// lr = 0.1, λ = 0.5):
    /// step 1, m = 0: c = 0.1·g → sign(g); θ = θ·0.95 − 0.1·sign(g); m = 0.01·g.
    /// step 2: c = 0.9·m + 0.1·g.
    #[test]
    fn matches_hand_computed_steps() {
        let mut opt = Lion::default();
        let ctx = StepContext { step: 1, lr: 0.1, weight_decay: 0.5, threads: 1, grad_scale: 1.0 };
        let mut w = [1.0f32, -2.0, 0.5, 3.0];
        let mut m = [0.0f32; 4];
        run(&mut opt, &mut w, &[0.3, -0.2, 0.0, -4.0], &mut m, ctx);
        // θ·0.95 − 0.1·sign(g): 1·0.95−0.1, −2·0.95+0.1, 0.5·0.95−0, 3·0.95+0.1
        let want_w = [0.85f32, -1.8, 0.475, 2.95];
        let want_m = [0.003f32, -0.002, 0.0, -0.04];
        for i in 0..4 {
            assert!((w[i] - want_w[i]).abs() < 1e-6, "w[{i}] = {} want {}", w[i], want_w[i]);
            assert!((m[i] - want_m[i]).abs() < 1e-7, "m[{i}] = {} want {}", m[i], want_m[i]);
        }
        // Step 2 with g = (−1, −1, 1, 1): c = 0.9·m + 0.1·g = (−0.0973, −0.1018, 0.1, 0.064)
        let ctx2 = StepContext { step: 2, ..ctx };
        run(&mut opt, &mut w, &[-1.0, -1.0, 1.0, 1.0], &mut m, ctx2);
        let want_w2 = [0.85 * 0.95 + 0.1, -1.8 * 0.95 + 0.1, 0.475 * 0.95 - 0.1, 2.95 * 0.95 - 0.1];
        // m = 0.99·m + 0.01·g
        let want_m2 = [0.99 * 0.003 - 0.01, 0.99 * -0.002 - 0.01, 0.01, 0.99 * -0.04 + 0.01];
        for i in 0..4 {
            assert!((w[i] - want_w2[i] as f32).abs() < 1e-6, "step 2 w[{i}] = {} want {}", w[i], want_w2[i]);
            assert!((m[i] - want_m2[i] as f32).abs() < 1e-7, "step 2 m[{i}] = {} want {}", m[i], want_m2[i]);
        }
    }

    #[test]
    fn takes_cuda_buffers_only_when_built_with_cuda() {
        let manifest = Lion::manifest();
        assert!(manifest.runs_on(Device::Cpu));
        assert_eq!(manifest.runs_on(Device::Cuda), cfg!(feature = "cuda"));
    }

    /// nvcc's output: the kernel is there, and no instruction rounds differently from the
    /// CPU (a fused multiply-add, which `--fmad=false` forbids; an approximate division or
    /// square root; a flush of subnormals to zero).
    #[cfg(feature = "cuda")]
    #[test]
    fn the_ptx_has_the_kernel_and_only_the_cpus_rounding() {
        let ptx = include_str!(concat!(env!("OUT_DIR"), "/lion.ptx"));
        ava_kernels::testing::gpu::assert_ptx_rounds_as_the_cpu(ptx, ["lion_step"]);
    }

    /// Wrong buffers are refused, naming the buffer, before anything touches a GPU (none here).
    #[cfg(feature = "cuda")]
    #[test]
    fn step_cuda_checks_the_buffers_first() {
        let shape = [4u64];
        let info = ParamInfo::new("w", &shape);
        let ctx = StepContext { step: 1, lr: 0.1, weight_decay: 0.0, threads: 1, grad_scale: 1.0 };
        let stream = CudaStream { handle: 0, ordinal: 0 };
        let buf = |len, dtype| CudaBuf { ptr: 0x1000, len, dtype, ordinal: 0 };
        let f32s = buf(4, DType::F32);
        let step = |w: &CudaBuf, g: &CudaBuf, state: &[CudaBuf]| {
            Lion::default().step_cuda(&info, w, g, state, &ctx, &stream).unwrap_err().message.to_string()
        };
        assert_eq!(step(&f32s, &buf(3, DType::F32), &[f32s]), "grad has 3 f32 elements, expected 4 f32");
        assert_eq!(step(&buf(4, DType::BF16), &f32s, &[f32s]), "values has 4 bf16 elements, expected 4 f32");
        assert_eq!(step(&f32s, &f32s, &[buf(4, DType::U8)]), "exp_avg has 4 u8 elements, expected 4 f32");
        assert_eq!(step(&f32s, &f32s, &[]), "lion expects 1 state buffer, got 0");
        assert_eq!(step(&f32s, &f32s, &[f32s, f32s]), "lion expects 1 state buffer, got 2");
    }

    #[test]
    fn options_are_checked() {
        let m = Lion::manifest();
        let err = ava_core::ffi::build::<Lion>(r#"{"betas": [1.5, 0.99, 0.1], "lr": 1}"#, &HostContext::default())
            .unwrap_err();
        let details: Vec<&str> = err.details().collect();
        assert_eq!(
            details,
            [
                "unknown option 'lr' (known: betas)",
                "option 'betas': expected 2 values [β1, β2], got 3",
                "option 'betas': β1 = 1.5 must be in [0, 1)",
            ]
            .as_slice(),
            "{m:?}"
        );
    }
}
