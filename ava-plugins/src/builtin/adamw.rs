//! The built-in optimizer `adamw`: Adam with decoupled weight decay (Loshchilov & Hutter 2019,
//! *Decoupled Weight Decay Regularization*), computed as `torch.optim.AdamW` does:
//!
//! ```text
//! θ ← θ − lr·λ·θ                       decay first, scaled by lr (torch's convention)
//! m ← β1·m + (1 − β1)·g
//! v ← β2·v + (1 − β2)·g²
//! v_max ← max(v_max, v)                 amsgrad only; then v_max replaces v below
//! θ ← θ − lr·m̂ / (√v̂ + ε)              m̂ = m / (1 − β1ᵗ), v̂ = v / (1 − β2ᵗ)
//! ```
//!
//! `lr` and `λ` come from the trainer each step. The step `t` of the bias corrections is the
//! parameter's own, as torch keeps `state['step']` per parameter: a parameter that got no
//! gradient on some steps (an expert no token was routed to) has been updated fewer times
//! than the global step, and its moments have decayed fewer times too.
//!
//! State per parameter: `exp_avg` and `exp_avg_sq` (f32, one per element), plus
//! `max_exp_avg_sq` with amsgrad — 8 bytes per element (12 with amsgrad) — and `step`, one
//! u32 per tensor (exact up to 4·10⁹ updates; torch keeps a float tensor).
//!
//! On the CPU a tensor of at least two [`parallel::MIN_ELEMENTS_PER_THREAD`] runs is stepped
//! by up to [`StepContext::threads`] threads, one run of elements each; every element's
//! arithmetic is the same whichever thread does it, so the bits do not depend on the thread
//! count (tested).

#[cfg(feature = "cuda")]
use ava_core::device::{CudaBuf, CudaStream};
use ava_core::{error::expect_len, prelude::*};
use ava_kernels::parallel;

/// AdamW's hyper-parameters (the state lives in the host's buffers).
#[derive(Debug, Clone, PartialEq)]
pub struct AdamW {
    /// Decay of the first moment.
    pub beta1: f64,
    /// Decay of the second moment.
    pub beta2: f64,
    /// Added to the denominator for numerical stability.
    pub eps: f64,
    /// Use the running maximum of the second moment (Reddi et al. 2018).
    pub amsgrad: bool,
}

impl Default for AdamW {
    fn default() -> Self {
        Self { beta1: 0.9, beta2: 0.999, eps: 1e-8, amsgrad: false }
    }
}

impl Plugin for AdamW {
    fn manifest() -> Manifest {
        Manifest::new(
            "adamw",
            PluginKind::Optimizer,
            env!("CARGO_PKG_VERSION"),
            "AdamW: Adam with decoupled weight decay, as torch.optim.AdamW; two f32 state buffers per parameter",
        )
        .devices(crate::builtin::BUILTIN_DEVICES)
        .option(OptionSpec::float_list(
            "betas",
            &[0.9, 0.999],
            "[β1, β2]: decay rates of the first and second moment estimates",
        ))
        .option(OptionSpec::float("eps", 1e-8, "added to the denominator √v̂ for numerical stability"))
        .option(OptionSpec::bool(
            "amsgrad",
            false,
            "use the running maximum of the second moment (AMSGrad); adds a third state buffer",
        ))
    }

    fn from_options(mut options: Options) -> Result<Self, PluginError> {
        let [beta1, beta2] = options.betas("betas");
        let eps = options.float("eps");
        options.check(eps > 0.0, || format!("option 'eps': {eps} must be > 0"));
        options.finish()?;
        Ok(AdamW { beta1, beta2, eps, amsgrad: options.bool("amsgrad") })
    }
}

/// One step's scalars, applied element by element (in f32, the scalars computed in f64).
#[derive(Clone, Copy)]
struct Update {
    /// lr / (1 − β1ᵗ).
    step_size: f32,
    /// √(1 − β2ᵗ).
    bc2_sqrt: f32,
    /// 1 − lr·λ.
    decay: f32,
    b1: f32,
    b2: f32,
    eps: f32,
    /// The gradient's affine map `g·mul + add` ([`StepContext::grad_affine`]).
    mul: f32,
    add: f32,
}

impl Update {
    /// The moments of raw gradient `g`, updated in place.
    #[inline(always)]
    fn moments(self, g: f32, m: &mut f32, v: &mut f32) {
        let g = g * self.mul + self.add;
        *m = self.b1 * *m + (1.0 - self.b1) * g;
        *v = self.b2 * *v + (1.0 - self.b2) * g * g;
    }

    /// θ ← θ·(1 − lr·λ) − lr/bc1 · m / (√v / √bc2 + ε), torch's arrangement of m̂/(√v̂ + ε).
    #[inline(always)]
    fn apply(self, w: &mut f32, m: f32, v: f32) {
        *w = *w * self.decay - self.step_size * m / (v.sqrt() / self.bc2_sqrt + self.eps);
    }

    /// AdamW over a run of elements.
    fn adam(self, w: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
        for (((w, &g), m), v) in w.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
            self.moments(g, m, v);
            self.apply(w, *m, *v);
        }
    }

    /// AdamW with the running maximum of v (amsgrad) over a run of elements.
    fn amsgrad(self, w: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], v_max: &mut [f32]) {
        for ((((w, &g), m), v), vm) in w.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()).zip(v_max.iter_mut()) {
            self.moments(g, m, v);
            *vm = vm.max(*v);
            self.apply(w, *m, *vm);
        }
    }
}

impl Optimizer for AdamW {
    /// The clipping factor is applied as each gradient element is read
    /// ([`StepContext::grad_affine`]: the product the host would have written), on both devices.
    fn scales_gradients(&self) -> bool {
        true
    }

    fn state_layout(&self, param: &ParamInfo<'_>) -> Result<Vec<StateSpec>, PluginError> {
        let n = param.numel();
        let mut layout = vec![StateSpec::new("exp_avg", DType::F32, n), StateSpec::new("exp_avg_sq", DType::F32, n)];
        if self.amsgrad {
            layout.push(StateSpec::new("max_exp_avg_sq", DType::F32, n));
        }
        layout.push(StateSpec::new("step", DType::U32, 1));
        Ok(layout)
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
        let (m, v, v_max, t) = match state {
            [m, v, t] if !self.amsgrad => (m.f32()?, v.f32()?, None, t),
            [m, v, v_max, t] if self.amsgrad => (m.f32()?, v.f32()?, Some(v_max.f32()?), t),
            _ => {
                return Err(PluginError::invalid_input(format!(
                    "adamw expects {} state buffers, got {}",
                    if self.amsgrad { 4 } else { 3 },
                    state.len()
                )));
            }
        };
        expect_len("exp_avg", m.len(), n)?;
        expect_len("exp_avg_sq", v.len(), n)?;
        if let Some(v_max) = &v_max {
            expect_len("max_exp_avg_sq", v_max.len(), n)?;
        }
        let count = t.u32()?;
        expect_len("step", count.len(), 1)?;
        // Everything checked: this parameter's update number t (1-based; the host zero-fills).
        count[0] = count[0].saturating_add(1);
        let t = count[0];

        // Per-step scalars in f64 (torch computes them as Python floats), applied in f32.
        let t = i32::try_from(t).unwrap_or(i32::MAX);
        let (mul, add) = ctx.grad_affine();
        let k = Update {
            step_size: (ctx.lr / (1.0 - self.beta1.powi(t))) as f32,
            bc2_sqrt: (1.0 - self.beta2.powi(t)).sqrt() as f32,
            decay: (1.0 - ctx.lr * ctx.weight_decay) as f32,
            b1: self.beta1 as f32,
            b2: self.beta2 as f32,
            eps: self.eps as f32,
            mul,
            add,
        };
        // A large tensor's elements in one run per thread: each element's arithmetic is the
        // same whichever thread does it, so the bits do not depend on the thread count.
        let chunk = parallel::elementwise_chunk(n, ctx.threads);
        let runs = values.chunks_mut(chunk).zip(grad.chunks(chunk)).zip(m.chunks_mut(chunk)).zip(v.chunks_mut(chunk));
        match v_max {
            None => {
                let runs: Vec<_> = runs.collect();
                parallel::run(runs, ctx.threads, || (), move |_, (((w, g), m), v)| k.adam(w, g, m, v));
            }
            Some(v_max) => {
                let runs: Vec<_> = runs.zip(v_max.chunks_mut(chunk)).collect();
                parallel::run(runs, ctx.threads, || (), move |_, ((((w, g), m), v), vm)| k.amsgrad(w, g, m, v, vm));
            }
        }
        Ok(())
    }

    /// The same step on the GPU (kernels/optim.cu): the count advanced on the device, then one
    /// thread per element with the CPU's arithmetic, so the bits are the CPU's.
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
        let (m, v, v_max, t) = match state {
            [m, v, t] if !self.amsgrad => (m, v, None, t),
            [m, v, v_max, t] if self.amsgrad => (m, v, Some(v_max), t),
            _ => {
                return Err(PluginError::invalid_input(format!(
                    "adamw expects {} state buffers, got {}",
                    if self.amsgrad { 4 } else { 3 },
                    state.len()
                )));
            }
        };
        m.expect("exp_avg", DType::F32, n)?;
        v.expect("exp_avg_sq", DType::F32, n)?;
        if let Some(v_max) = v_max {
            v_max.expect("max_exp_avg_sq", DType::F32, n)?;
        }
        t.expect("step", DType::U32, 1)?;
        let grid = blocks(n)?;
        // SAFETY: count_update(unsigned*): t holds one u32 on the stream's device.
        unsafe { launch(&OPTIM, c"count_update", 1, 1, stream, &mut [arg(&t.ptr)])? };
        if n == 0 {
            return Ok(());
        }
        let v_max = v_max.map_or(0u64, |b| b.ptr); // NULL without amsgrad
        let (lr, wd) = (ctx.lr, ctx.weight_decay);
        let (mul, add) = ctx.grad_affine();
        let mut params = [
            arg(&values.ptr),
            arg(&grad.ptr),
            arg(&m.ptr),
            arg(&v.ptr),
            arg(&v_max),
            arg(&t.ptr),
            arg(&n),
            arg(&lr),
            arg(&wd),
            arg(&self.beta1),
            arg(&self.beta2),
            arg(&self.eps),
            arg(&mul),
            arg(&add),
        ];
        // SAFETY: adamw_step's parameters one for one; every buffer was checked to hold n
        // f32s (the count one u32) above.
        unsafe { launch(&OPTIM, c"adamw_step", grid, THREADS, stream, &mut params) }
    }
}

inventory::submit! { crate::builtin::Builtin::optimizer::<AdamW>() }

#[cfg(test)]
mod tests {
    use super::*;

    fn build(json: &str) -> Result<AdamW, PluginError> {
        ava_core::ffi::build::<AdamW>(json, &HostContext::default())
    }

    /// A parameter's state as the host allocates it: `k` f32 buffers of `n`, then the count.
    struct State {
        bufs: Vec<Vec<f32>>,
        step: [u32; 1],
    }

    impl State {
        fn new(n: usize, k: usize) -> Self {
            Self { bufs: vec![vec![0.0; n]; k], step: [0] }
        }
    }

    /// One step on `w` with state `st`; `step` is the trainer's global step.
    fn run(opt: &mut AdamW, w: &mut [f32], g: &[f32], st: &mut State, step: u64, lr: f64, wd: f64) {
        run_on(opt, w, g, st, StepContext { step, lr, weight_decay: wd, threads: 1, grad_scale: 1.0 });
    }

    /// One step with the context `ctx`.
    fn run_on(opt: &mut AdamW, w: &mut [f32], g: &[f32], st: &mut State, ctx: StepContext) {
        let shape = [w.len() as u64];
        let info = ParamInfo::new("w", &shape);
        let mut state: Vec<StateBuf<'_>> =
            st.bufs.iter_mut().map(|b| StateBuf::new(DType::F32, bytemuck::cast_slice_mut(b))).collect();
        state.push(StateBuf::new(DType::U32, bytemuck::cast_slice_mut(&mut st.step)));
        opt.step(&info, w, g, &mut state, &ctx).unwrap();
    }

    /// A tensor large enough to be split over threads gets the same bits, weights and state,
    /// from 1, 2 and 3 threads (with a length no thread count divides, and with amsgrad).
    #[test]
    fn threads_do_not_change_the_bits() {
        let n = 5 * ava_kernels::parallel::MIN_ELEMENTS_PER_THREAD + 7;
        let wave = |i: usize, f: f32| ((i as f32) * f).sin();
        for amsgrad in [false, true] {
            let mut runs = Vec::new();
            for threads in [1, 2, 3] {
                let mut opt = AdamW { amsgrad, ..AdamW::default() };
                let mut w: Vec<f32> = (0..n).map(|i| wave(i, 0.37)).collect();
                let mut st = State::new(n, if amsgrad { 3 } else { 2 });
                for step in 1..=3u64 {
                    let g: Vec<f32> = (0..n).map(|i| wave(i, 0.11 * step as f32)).collect();
                    let ctx = StepContext { step, lr: 1e-2, weight_decay: 0.1, threads, grad_scale: 0.5 };
                    run_on(&mut opt, &mut w, &g, &mut st, ctx);
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                runs.push((bits(&w), st.bufs.iter().map(|b| bits(b)).collect::<Vec<_>>(), st.step));
            }
            let start: Vec<u32> = (0..n).map(|i| wave(i, 0.37).to_bits()).collect();
            let moved = runs[0].0.iter().zip(&start).filter(|(a, b)| a != b).count();
            assert!(moved > n / 2 && runs[0].2 == [3], "three steps moved {moved} of {n} weights");
            assert_eq!(runs[0], runs[1], "amsgrad {amsgrad}: 1 vs 2 threads");
            assert_eq!(runs[0], runs[2], "amsgrad {amsgrad}: 1 vs 3 threads");
        }
    }

    fn close(got: &[f32], want: &[f64], tol: f64, what: &str) {
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!((g as f64 - w).abs() < tol, "{what}[{i}] = {g}, want {w}");
        }
    }

    /// Three steps by hand with β = (0.5, 0.75), lr = 0.1, θ = (1, −2); ε = 1e-8 moves θ by
    /// < 1e-8, below the tolerance.
    ///
    /// step 1, λ = 0, g = (2, −1): m = 0.5g = (1, −0.5), v = 0.25g² = (1, 0.25);
    ///   bc1 = 0.5, bc2 = 0.25 → m̂ = (2, −1), √v̂ = (2, 1) → θ = (1 − 0.1, −2 + 0.1) = (0.9, −1.9).
    /// step 2, λ = 0.5, g = (−1, 3): θ·(1 − 0.05) = (0.855, −1.805);
    ///   m = 0.5m + 0.5g = (0, 1.25), v = 0.75v + 0.25g² = (1, 2.4375);
    ///   bc1 = 0.75, bc2 = 0.4375 → m̂ = (0, 5/3), v̂ = (16/7, 39/7)
    ///   → θ = (0.855, −1.805 − 0.1·(5/3)/√(39/7)).
    /// step 3, λ = 0.5, g = (0.5, 0): θ·0.95; m = (0.25, 0.625), v = (0.8125, 1.828125);
    ///   bc1 = 0.875, bc2 = 0.578125 → m̂ = (2/7, 5/7), v̂ = (52/37, 117/37).
    ///   With amsgrad v fell in both entries, so v_max stays (1, 2.4375) → v̂ = (64/37, 156/37).
    #[test]
    fn matches_hand_computed_steps() {
        for amsgrad in [false, true] {
            let mut opt = AdamW { beta1: 0.5, beta2: 0.75, eps: 1e-8, amsgrad };
            let mut w = [1.0f32, -2.0];
            let mut st = State::new(2, if amsgrad { 3 } else { 2 });

            run(&mut opt, &mut w, &[2.0, -1.0], &mut st, 1, 0.1, 0.0);
            close(&w, &[0.9, -1.9], 1e-6, "step 1 θ");
            close(&st.bufs[0], &[1.0, -0.5], 1e-7, "step 1 m");
            close(&st.bufs[1], &[1.0, 0.25], 1e-7, "step 1 v");

            run(&mut opt, &mut w, &[-1.0, 3.0], &mut st, 2, 0.1, 0.5);
            let w2 = [0.855, -1.805 - 0.1 * (5.0 / 3.0) / (39.0f64 / 7.0).sqrt()];
            close(&w, &w2, 1e-6, "step 2 θ");
            close(&st.bufs[0], &[0.0, 1.25], 1e-7, "step 2 m");
            close(&st.bufs[1], &[1.0, 2.4375], 1e-6, "step 2 v");

            run(&mut opt, &mut w, &[0.5, 0.0], &mut st, 3, 0.1, 0.5);
            let v_hat = if amsgrad { [64.0 / 37.0, 156.0 / 37.0] } else { [52.0 / 37.0, 117.0 / 37.0] };
            let w3 = [
                w2[0] * 0.95 - 0.1 * (2.0 / 7.0) / f64::sqrt(v_hat[0]),
                w2[1] * 0.95 - 0.1 * (5.0 / 7.0) / f64::sqrt(v_hat[1]),
            ];
            close(&w, &w3, 1e-6, &format!("step 3 θ (amsgrad {amsgrad})"));
            close(&st.bufs[0], &[0.25, 0.625], 1e-7, "step 3 m");
            close(&st.bufs[1], &[0.8125, 1.828125], 1e-6, "step 3 v");
            if amsgrad {
                close(&st.bufs[2], &[1.0, 2.4375], 1e-6, "step 3 v_max keeps the maximum");
            }
        }
    }

    /// torch keeps `state['step']` per parameter (torch/optim/adamw.py, `_single_tensor_adamw`:
    /// `step_t += 1; bias_correction1 = 1 - beta1 ** step`), so a parameter that got no
    /// gradient on some global steps is bias-corrected by its own count. Same numbers as
    /// `matches_hand_computed_steps`: updated at global steps 1 and 5 (frozen on 2..4), the
    /// second update is that test's step 2 (t = 2: bc1 = 0.75, bc2 = 0.4375), not one with the
    /// global t = 5 (bc1 = 0.96875, bc2 ≈ 0.763), which would move θ₁ by 0.0722 instead of 0.0706.
    /// A parameter first updated at global step 7 gets a first step: θ − lr·sign(g).
    #[test]
    fn bias_correction_counts_the_parameters_own_updates() {
        let mut opt = AdamW { beta1: 0.5, beta2: 0.75, eps: 1e-8, amsgrad: false };
        let mut w = [1.0f32, -2.0];
        let mut st = State::new(2, 2);
        run(&mut opt, &mut w, &[2.0, -1.0], &mut st, 1, 0.1, 0.0);
        assert_eq!(st.step, [1]);
        run(&mut opt, &mut w, &[-1.0, 3.0], &mut st, 5, 0.1, 0.5);
        assert_eq!(st.step, [2], "the count is the parameter's updates, not the global step");
        close(&w, &[0.855, -1.805 - 0.1 * (5.0 / 3.0) / (39.0f64 / 7.0).sqrt()], 1e-6, "second update");
        close(&st.bufs[1], &[1.0, 2.4375], 1e-6, "v after two updates");

        let mut late = [1.0f32, -2.0];
        let mut st = State::new(2, 2);
        run(&mut opt, &mut late, &[0.25, -3.0], &mut st, 7, 0.1, 0.0);
        assert_eq!(st.step, [1]);
        close(&late, &[0.9, -1.9], 1e-6, "a late first update is a first update");
    }

    /// Default betas, step 1: m̂ = g and v̂ = g² exactly, so the update is lr·g/(|g| + ε):
    /// lr·sign(g) up to ε. With λ = 0.1 and lr = 1e-3 the decay factor is 1 − 1e-4.
    #[test]
    fn first_step_is_signed_lr() {
        let mut opt = build("").unwrap();
        assert_eq!(opt, AdamW::default());
        let mut w = [0.5f32, -0.5, 2.0];
        let mut st = State::new(3, 2);
        run(&mut opt, &mut w, &[1e-3, -4.0, 0.0], &mut st, 1, 1e-3, 0.1);
        // g = 0 gives m̂ = 0: only the decay moves the third entry.
        let want = [0.5 * (1.0 - 1e-4) - 1e-3, -0.5 * (1.0 - 1e-4) + 1e-3, 2.0 * (1.0 - 1e-4)];
        close(&w, &want, 1e-7, "θ");
    }

    #[test]
    fn state_layout_names_and_lengths() {
        let shape = [3u64, 5];
        let info = ParamInfo::new("model.layers.0.mlp.up_proj.weight", &shape);
        let names = |o: &AdamW| -> Vec<(String, DType, u64)> {
            o.state_layout(&info).unwrap().into_iter().map(|s| (s.name.to_string(), s.dtype, s.len)).collect()
        };
        assert_eq!(
            names(&build("").unwrap()),
            [
                ("exp_avg".to_string(), DType::F32, 15),
                ("exp_avg_sq".to_string(), DType::F32, 15),
                ("step".to_string(), DType::U32, 1)
            ]
        );
        let ams = build(r#"{"amsgrad": true}"#).unwrap();
        assert_eq!(names(&ams)[2], ("max_exp_avg_sq".to_string(), DType::F32, 15));
        assert_eq!(names(&ams)[3], ("step".to_string(), DType::U32, 1));
        assert_eq!(names(&ams).len(), 4);
    }

    #[test]
    fn wrong_state_is_refused_and_changes_nothing() {
        let mut opt = AdamW::default();
        let shape = [2u64];
        let info = ParamInfo::new("w", &shape);
        let (mut w, g) = ([1.0f32, 2.0], [0.1f32, 0.2]);
        let mut a = [0.0f32; 2];
        let mut state = [StateBuf::new(DType::F32, bytemuck::cast_slice_mut(&mut a))];
        let ctx = StepContext { step: 1, lr: 0.1, weight_decay: 0.0, threads: 1, grad_scale: 1.0 };
        let err = opt.step(&info, &mut w, &g, &mut state, &ctx).unwrap_err();
        assert_eq!(err.message.as_str(), "adamw expects 3 state buffers, got 1");
        // A count of the wrong type (f32 where u32 is declared) is refused before anything moves.
        let (mut a, mut b, mut c) = ([0.0f32; 2], [0.0f32; 2], [0.0f32; 1]);
        let mut state = [
            StateBuf::new(DType::F32, bytemuck::cast_slice_mut(&mut a)),
            StateBuf::new(DType::F32, bytemuck::cast_slice_mut(&mut b)),
            StateBuf::new(DType::F32, bytemuck::cast_slice_mut(&mut c)),
        ];
        let err = opt.step(&info, &mut w, &g, &mut state, &ctx).unwrap_err();
        assert_eq!(err.message.as_str(), "state buffer is f32, read as u32");
        assert_eq!(w, [1.0, 2.0], "a refused step leaves the parameter alone");
        assert_eq!((a, b), ([0.0; 2], [0.0; 2]), "and its moments");
    }

    #[test]
    fn options_are_checked_all_at_once() {
        let err = build(r#"{"betas": [1.0], "eps": 0, "amsgrad": "yes"}"#).unwrap_err();
        assert_eq!(err.kind, ErrorKind::InvalidOptions);
        let details: Vec<&str> = err.details().collect();
        assert_eq!(
            details,
            [
                "option 'amsgrad': expected bool, got a string (\"yes\")",
                "option 'betas': expected 2 values [β1, β2], got 1",
                "option 'betas': β1 = 1 must be in [0, 1)",
                "option 'eps': 0 must be > 0",
            ]
        );
        let ok = build(r#"{"betas": [0.8, 0.95], "eps": 1e-6, "amsgrad": true}"#).unwrap();
        assert_eq!(ok, AdamW { beta1: 0.8, beta2: 0.95, eps: 1e-6, amsgrad: true });
    }

    #[test]
    fn registered() {
        let b = crate::builtin::all().find(|b| (b.manifest)().name.as_str() == "adamw").expect("registered");
        let m = (b.manifest)();
        m.validate().unwrap();
        assert_eq!(m.kind, PluginKind::Optimizer);
        let names: Vec<&str> = m.options.iter().map(|o| o.name.as_str()).collect();
        assert_eq!(names, ["betas", "eps", "amsgrad"]);
        assert_eq!((b.create)("", &HostContext::default()).unwrap().kind(), PluginKind::Optimizer);
    }
}
