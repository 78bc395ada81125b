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
            return Err(PluginError::invalid_input(format!("lion expects 1 state buffer, got {}", state.len())));
        };
        let m = m.f32()?;
        let n = param.numel();
        ava_core::error::expect_len("values", values.len(), n)?;
        ava_core::error::expect_len("grad", grad.len(), n)?;
        ava_core::error::expect_len("exp_avg", m.len(), n)?;
        let lr = ctx.lr as f32;
        let decay = 1.0 - lr * ctx.weight_decay as f32;
        let (b1, b2) = (self.beta1, self.beta2);
        for ((w, &g), m) in values.iter_mut().zip(grad).zip(m.iter_mut()) {
            let c = b1 * *m + (1.0 - b1) * g;
            *w = *w * decay - lr * sign(c);
            *m = b2 * *m + (1.0 - b2) * g;
        }
        Ok(())
    }
}

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
        let ctx = StepContext { step: 1, lr: 0.1, weight_decay: 0.5, threads: 1 };
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
