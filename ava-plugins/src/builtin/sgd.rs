//! The built-in optimizer `sgd`: stochastic gradient descent with optional (Nesterov)
//! momentum, computed as `torch.optim.SGD` does:
//!
//! ```text
//! g ← g + λ·θ                                  L2 weight decay, coupled into the gradient
//! b ← g                  at the parameter's first update   momentum > 0 only
//! b ← μ·b + (1 − dampening)·g   later steps
//! g ← g + μ·b (nesterov)  or  g ← b
//! θ ← θ − lr·g
//! ```
//!
//! Note on weight decay: the trainer's `weight_decay` is applied here as torch's SGD applies
//! its `weight_decay`, i.e. as an L2 term added to the gradient (so it also feeds the momentum
//! buffer). This is *not* the decoupled decay AdamW uses; for plain SGD the two coincide
//! (`θ − lr·(g + λθ)`), with momentum they differ.
//!
//! State when `momentum > 0`: one f32 `momentum_buffer` per element and `step`, one u32 per
//! tensor counting the parameter's own updates. torch sets the buffer to the gradient when
//! the parameter has none yet (`momentum_buffer is None`), i.e. at *its* first update, which
//! for a parameter that got no gradient on the first global steps comes later; the host
//! zero-fills state, so "no buffer yet" is read from the count. Without momentum there is no
//! state at all (torch keeps none either: plain SGD has nothing per-parameter to count).

#[cfg(feature = "cuda")]
use ava_core::device::{CudaBuf, CudaStream};
use ava_core::{error::expect_len, prelude::*};

/// SGD's hyper-parameters (the momentum buffer lives in the host's buffers).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Sgd {
    /// Momentum factor μ (0 disables momentum and its state).
    pub momentum: f64,
    /// Dampening of the gradient's contribution to the momentum buffer.
    pub dampening: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
}

impl Plugin for Sgd {
    fn manifest() -> Manifest {
        Manifest::new(
            "sgd",
            PluginKind::Optimizer,
            env!("CARGO_PKG_VERSION"),
            "SGD with optional (Nesterov) momentum, as torch.optim.SGD; weight decay is coupled L2",
        )
        .devices(crate::builtin::BUILTIN_DEVICES)
        .option(OptionSpec::float("momentum", 0.0, "momentum factor μ; 0 disables momentum and its state buffer"))
        .option(OptionSpec::float("dampening", 0.0, "dampening of the gradient's contribution to the momentum"))
        .option(OptionSpec::bool(
            "nesterov",
            false,
            "Nesterov momentum (needs momentum > 0 and dampening = 0)",
        ))
    }

    fn from_options(mut options: Options) -> Result<Self, PluginError> {
        let momentum = options.float("momentum");
        let dampening = options.float("dampening");
        let nesterov = options.bool("nesterov");
        options.check(momentum >= 0.0, || format!("option 'momentum': {momentum} must be >= 0"));
        // torch does not check this, but outside [0, 1] the gradient's weight in the buffer
        // would be negative or above 1, which is never intended.
        options
            .check((0.0..=1.0).contains(&dampening), || format!("option 'dampening': {dampening} must be in [0, 1]"));
        options.check(!nesterov || (momentum > 0.0 && dampening == 0.0), || {
            format!(
                "option 'nesterov': Nesterov momentum needs momentum > 0 and dampening = 0 \
                 (got momentum = {momentum}, dampening = {dampening})"
            )
        });
        options.finish()?;
        Ok(Sgd { momentum, dampening, nesterov })
    }
}

impl Optimizer for Sgd {
    /// The clipping factor is applied as each gradient element is read
    /// ([`StepContext::grad_affine`]: the product the host would have written), on both devices.
    fn scales_gradients(&self) -> bool {
        true
    }

    fn state_layout(&self, param: &ParamInfo<'_>) -> Result<Vec<StateSpec>, PluginError> {
        if self.momentum > 0.0 {
            Ok(vec![
                StateSpec::new("momentum_buffer", DType::F32, param.numel()),
                StateSpec::new("step", DType::U32, 1),
            ])
        } else {
            Ok(Vec::new())
        }
    }

    fn step(
        &mut self,
        param: &ParamInfo<'_>,
        values: &mut [f32],
        grad: &[f32],
        state: &mut [StateBuf<'_>],
        ctx: &StepContext,
    ) -> Result<(), PluginError> {
        let n = param.numel();
        expect_len("values", values.len(), n)?;
        expect_len("grad", grad.len(), n)?;
        if ctx.step == 0 {
            return Err(PluginError::invalid_input("sgd: step numbers are 1-based, got step 0"));
        }
        let (lr, wd) = (ctx.lr as f32, ctx.weight_decay as f32);
        let (mul, add) = ctx.grad_affine();
        match state {
            [] if self.momentum == 0.0 => {
                for (w, &g) in values.iter_mut().zip(grad) {
                    let g = (g * mul + add) + wd * *w;
                    *w -= lr * g;
                }
            }
            [buf, count] if self.momentum > 0.0 => {
                let buf = buf.f32()?;
                expect_len("momentum_buffer", buf.len(), n)?;
                let count = count.u32()?;
                expect_len("step", count.len(), 1)?;
                let first = count[0] == 0;
                count[0] = count[0].saturating_add(1);
                let (mu, keep) = (self.momentum as f32, (1.0 - self.dampening) as f32);
                for ((w, &g), b) in values.iter_mut().zip(grad).zip(buf.iter_mut()) {
                    let g = (g * mul + add) + wd * *w;
                    *b = if first { g } else { mu * *b + keep * g };
                    let d = if self.nesterov { g + mu * *b } else { *b };
                    *w -= lr * d;
                }
            }
            _ => {
                let want =
                    if self.momentum > 0.0 { "2 state buffers (momentum_buffer, step)" } else { "no state buffers" };
                return Err(PluginError::invalid_input(format!("sgd expects {want}, got {}", state.len())));
            }
        }
        Ok(())
    }

    /// The same step on the GPU (kernels/optim.cu), with the CPU's arithmetic: with momentum,
    /// the element kernel reads "first update" from the count, then the count advances.
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
        use crate::builtin::cuda::{OPTIM, THREADS, arg, blocks, launch};
        let n = param.numel();
        values.expect("values", DType::F32, n)?;
        grad.expect("grad", DType::F32, n)?;
        if ctx.step == 0 {
            return Err(PluginError::invalid_input("sgd: step numbers are 1-based, got step 0"));
        }
        let grid = blocks(n)?;
        let (lr, wd) = (ctx.lr as f32, ctx.weight_decay as f32);
        let (mul, add) = ctx.grad_affine();
        match state {
            [] if self.momentum == 0.0 => {
                if n == 0 {
                    return Ok(());
                }
                let mut params = [arg(&values.ptr), arg(&grad.ptr), arg(&n), arg(&lr), arg(&wd), arg(&mul), arg(&add)];
                // SAFETY: sgd_step's parameters one for one; both buffers hold n f32s (checked).
                unsafe { launch(&OPTIM, c"sgd_step", grid, THREADS, stream, &mut params) }
            }
            [buf, count] if self.momentum > 0.0 => {
                buf.expect("momentum_buffer", DType::F32, n)?;
                count.expect("step", DType::U32, 1)?;
                let (mu, keep) = (self.momentum as f32, (1.0 - self.dampening) as f32);
                let nesterov = i32::from(self.nesterov);
                if n > 0 {
                    let mut params = [
                        arg(&values.ptr),
                        arg(&grad.ptr),
                        arg(&buf.ptr),
                        arg(&count.ptr),
                        arg(&n),
                        arg(&lr),
                        arg(&wd),
                        arg(&mu),
                        arg(&keep),
                        arg(&nesterov),
                        arg(&mul),
                        arg(&add),
                    ];
                    // SAFETY: sgd_momentum_step's parameters one for one; sizes checked above.
                    unsafe { launch(&OPTIM, c"sgd_momentum_step", grid, THREADS, stream, &mut params)? };
                }
                // SAFETY: count_update(unsigned*): count holds one u32 (checked).
                unsafe { launch(&OPTIM, c"count_update", 1, 1, stream, &mut [arg(&count.ptr)]) }
            }
            _ => {
                let want =
                    if self.momentum > 0.0 { "2 state buffers (momentum_buffer, step)" } else { "no state buffers" };
                Err(PluginError::invalid_input(format!("sgd expects {want}, got {}", state.len())))
            }
        }
    }
}

inventory::submit! { crate::builtin::Builtin::optimizer::<Sgd>() }

#[cfg(test)]
mod tests {
    use super::*;

    fn build(json: &str) -> Result<Sgd, PluginError> {
        ava_core::ffi::build::<Sgd>(json, &HostContext::default())
    }

    /// A parameter's state as the host allocates it: the momentum buffer (empty when the
    /// optimizer has no state) and the update count.
    struct State {
        buf: Vec<f32>,
        step: [u32; 1],
    }

    impl State {
        fn new(n: usize) -> Self {
            Self { buf: vec![0.0; n], step: [0] }
        }
    }

    /// One step; `step` is the trainer's global step.
    fn run(opt: &mut Sgd, w: &mut [f32], g: &[f32], st: &mut State, step: u64, wd: f64) {
        let shape = [w.len() as u64];
        let info = ParamInfo::new("w", &shape);
        let mut state: Vec<StateBuf<'_>> = if st.buf.is_empty() {
            Vec::new()
        } else {
            vec![
                StateBuf::new(DType::F32, bytemuck::cast_slice_mut(&mut st.buf)),
                StateBuf::new(DType::U32, bytemuck::cast_slice_mut(&mut st.step)),
            ]
        };
        let ctx = StepContext { step, lr: 0.1, weight_decay: wd, threads: 1, grad_scale: 1.0 };
        opt.step(&info, w, g, &mut state, &ctx).unwrap();
    }

    fn close(got: &[f32], want: &[f64], what: &str) {
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!((g as f64 - w).abs() < 1e-6, "{what}[{i}] = {g}, want {w}");
        }
    }

    /// lr = 0.1, θ = (1, −2), g = (0.5, 1): θ − 0.1g = (0.95, −2.1).
    /// With λ = 0.1 the gradient becomes g + 0.1θ = (0.6, 0.8): θ = (0.94, −2.08).
    #[test]
    fn plain_steps_by_hand() {
        let mut opt = build("").unwrap();
        assert!(opt.state_layout(&ParamInfo::new("w", &[2])).unwrap().is_empty());
        let mut none = State::new(0);
        let mut w = [1.0f32, -2.0];
        run(&mut opt, &mut w, &[0.5, 1.0], &mut none, 1, 0.0);
        close(&w, &[0.95, -2.1], "no decay");
        let mut w = [1.0f32, -2.0];
        run(&mut opt, &mut w, &[0.5, 1.0], &mut none, 7, 0.1);
        close(&w, &[0.94, -2.08], "L2 decay");
    }

    /// μ = 0.9, lr = 0.1, θ = (1, −2).
    /// step 1, g = (1, −2): b = g = (1, −2); θ = (0.9, −1.8).
    /// step 2, g = (0.5, 0.5): b = 0.9·(1, −2) + (0.5, 0.5) = (1.4, −1.3); θ = (0.76, −1.67).
    /// With dampening 0.5, step 1 is the same (no dampening on the first step) and
    /// b = 0.9·(1, −2) + 0.5·(0.5, 0.5) = (1.15, −1.55); θ = (0.785, −1.645).
    #[test]
    fn momentum_steps_by_hand() {
        for (json, b2, w2) in [
            (r#"{"momentum": 0.9}"#, [1.4, -1.3], [0.76, -1.67]),
            (r#"{"momentum": 0.9, "dampening": 0.5}"#, [1.15, -1.55], [0.785, -1.645]),
        ] {
            let mut opt = build(json).unwrap();
            let mut st = State::new(2);
            let mut w = [1.0f32, -2.0];
            run(&mut opt, &mut w, &[1.0, -2.0], &mut st, 1, 0.0);
            close(&st.buf, &[1.0, -2.0], "step 1 buffer");
            close(&w, &[0.9, -1.8], "step 1 θ");
            run(&mut opt, &mut w, &[0.5, 0.5], &mut st, 2, 0.0);
            close(&st.buf, &b2, json);
            close(&w, &w2, json);
        }
    }

    /// torch/optim/sgd.py (`_single_tensor_sgd`): `if buf is None: buf = clone(grad)`, else
    /// `buf.mul_(momentum).add_(grad, alpha=1 - dampening)` — the buffer starts at the
    /// parameter's own first update. μ = 0.9, dampening 0.5, lr = 0.1, θ = (1, −2): a parameter
    /// first updated at global step 3 with g = (1, −2) gets b = g = (1, −2), θ = (0.9, −1.8)
    /// (counting from the global step, b = 0.9·0 + 0.5·g = (0.5, −1) and θ = (0.95, −1.9)).
    /// Its next update, at global step 9, is its second: b = 0.9·(1, −2) + 0.5·(0.5, 0.5).
    #[test]
    fn momentum_starts_at_the_parameters_own_first_update() {
        let mut opt = build(r#"{"momentum": 0.9, "dampening": 0.5}"#).unwrap();
        let mut st = State::new(2);
        let mut w = [1.0f32, -2.0];
        run(&mut opt, &mut w, &[1.0, -2.0], &mut st, 3, 0.0);
        assert_eq!(st.step, [1]);
        close(&st.buf, &[1.0, -2.0], "first update's buffer");
        close(&w, &[0.9, -1.8], "first update's θ");
        run(&mut opt, &mut w, &[0.5, 0.5], &mut st, 9, 0.0);
        assert_eq!(st.step, [2]);
        close(&st.buf, &[1.15, -1.55], "second update's buffer");
        close(&w, &[0.785, -1.645], "second update's θ");
    }

    /// μ = 0.9, λ = 0.1, lr = 0.1, θ = (1, −2), g = (1, −2): the decay enters the gradient and
    /// the buffer: g + 0.1θ = (1.1, −2.2) = b; θ = (0.89, −1.78).
    #[test]
    fn weight_decay_feeds_the_momentum_buffer() {
        let mut opt = build(r#"{"momentum": 0.9}"#).unwrap();
        let mut st = State::new(2);
        let mut w = [1.0f32, -2.0];
        run(&mut opt, &mut w, &[1.0, -2.0], &mut st, 1, 0.1);
        close(&st.buf, &[1.1, -2.2], "buffer");
        close(&w, &[0.89, -1.78], "θ");
    }

    /// Nesterov, μ = 0.9, lr = 0.1, θ = (1, −2).
    /// step 1, g = (1, −2): b = g; update g + 0.9b = (1.9, −3.8); θ = (0.81, −1.62).
    /// step 2, g = (0.5, 0.5): b = (1.4, −1.3); update = (0.5 + 1.26, 0.5 − 1.17) = (1.76, −0.67);
    /// θ = (0.81 − 0.176, −1.62 + 0.067) = (0.634, −1.553).
    #[test]
    fn nesterov_steps_by_hand() {
        let mut opt = build(r#"{"momentum": 0.9, "nesterov": true}"#).unwrap();
        let mut st = State::new(2);
        let mut w = [1.0f32, -2.0];
        run(&mut opt, &mut w, &[1.0, -2.0], &mut st, 1, 0.0);
        close(&w, &[0.81, -1.62], "step 1 θ");
        run(&mut opt, &mut w, &[0.5, 0.5], &mut st, 2, 0.0);
        close(&st.buf, &[1.4, -1.3], "step 2 buffer");
        close(&w, &[0.634, -1.553], "step 2 θ");
    }

    #[test]
    fn state_layout_only_with_momentum() {
        let shape = [4u64, 2];
        let info = ParamInfo::new("w", &shape);
        let layout = build(r#"{"momentum": 0.5}"#).unwrap().state_layout(&info).unwrap();
        assert_eq!(layout, [StateSpec::new("momentum_buffer", DType::F32, 8), StateSpec::new("step", DType::U32, 1)]);
        // A momentum optimizer handed no buffer is refused, not silently run without momentum.
        let mut opt = build(r#"{"momentum": 0.5}"#).unwrap();
        let ctx = StepContext { step: 1, lr: 0.1, weight_decay: 0.0, threads: 1, grad_scale: 1.0 };
        let err = opt.step(&info, &mut [0.0; 8], &[0.0; 8], &mut [], &ctx).unwrap_err();
        assert_eq!(err.message.as_str(), "sgd expects 2 state buffers (momentum_buffer, step), got 0");
    }

    #[test]
    fn options_are_checked_all_at_once() {
        let err = build(r#"{"momentum": -0.1, "dampening": 2, "nesterov": true}"#).unwrap_err();
        let details: Vec<&str> = err.details().collect();
        assert_eq!(
            details,
            [
                "option 'momentum': -0.1 must be >= 0",
                "option 'dampening': 2 must be in [0, 1]",
                "option 'nesterov': Nesterov momentum needs momentum > 0 and dampening = 0 \
                 (got momentum = -0.1, dampening = 2)",
            ]
        );
        // torch's rule: Nesterov with dampening is refused even when momentum is fine.
        let err = build(r#"{"momentum": 0.9, "dampening": 0.1, "nesterov": true}"#).unwrap_err();
        assert_eq!(
            err.details().collect::<Vec<_>>(),
            [
                "option 'nesterov': Nesterov momentum needs momentum > 0 and dampening = 0 (got momentum = 0.9, dampening = 0.1)"
            ]
        );
        let err = build(r#"{"nesterov": true}"#).unwrap_err();
        assert_eq!(err.details().count(), 1);
    }

    #[test]
    fn registered() {
        let b = crate::builtin::all().find(|b| (b.manifest)().name.as_str() == "sgd").expect("registered");
        let m = (b.manifest)();
        m.validate().unwrap();
        let names: Vec<&str> = m.options.iter().map(|o| o.name.as_str()).collect();
        assert_eq!(names, ["momentum", "dampening", "nesterov"]);
        assert_eq!((b.create)("", &HostContext::default()).unwrap().kind(), PluginKind::Optimizer);
    }
}
