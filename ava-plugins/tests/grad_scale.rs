//! The built-in optimizers (and the `lion` plugin) apply `StepContext::grad_scale` inside their step (contract 3), so
//! the host no longer writes a scaled copy of every gradient when clipping applies. What
//! they compute must be what they computed on the copy: for every configuration, a step on
//! `g` with `grad_scale` s gives the same bits (parameter and every state buffer) as a step on
//! the host's copy with `grad_scale` 1. The copy is candle's affine, `g · (s as f32) + 0`
//! (which makes −0 into +0), written only when s ≠ 1; the gradients hold −0s, zeros and
//! values whose product underflows, where a plain `g · s` would differ in the sign of zero.

use ava_core::prelude::*;
use ava_plugin_lion::Lion;
use ava_plugins::builtin::adamw::AdamW;
use ava_plugins::builtin::sgd::Sgd;

/// A parameter's state as the host allocates it: each buffer of the layout zero-filled,
/// 8-byte aligned.
fn allocate(opt: &dyn Optimizer, info: &ParamInfo<'_>) -> Vec<(DType, Vec<u64>)> {
    let layout = opt.state_layout(info).unwrap();
    layout.iter().map(|s| (s.dtype, vec![0u64; (s.bytes() as usize).div_ceil(8)])).collect()
}

/// One step of `opt` on `w` with the state `st`.
fn step(
    opt: &mut dyn Optimizer,
    info: &ParamInfo<'_>,
    w: &mut [f32],
    g: &[f32],
    st: &mut [(DType, Vec<u64>)],
    ctx: &StepContext,
) {
    let n = info.numel();
    let mut bufs: Vec<StateBuf<'_>> = st
        .iter_mut()
        .zip(opt.state_layout(info).unwrap())
        .map(|((d, b), spec)| StateBuf::new(*d, &mut bytemuck::cast_slice_mut(b)[..spec.bytes() as usize]))
        .collect();
    assert_eq!(w.len(), n);
    opt.step(info, w, g, &mut bufs, ctx).unwrap();
}

/// Gradients of mixed signs and sizes (a few exactly zero, some tiny), a pure function of
/// `seed` (the kernels' test generator).
fn gradient(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = ava_kernels::testing::Rng(seed);
    (0..n)
        .map(|i| {
            let u = rng.uniform() * 0.5;
            match i % 17 {
                0 => 0.0,
                3 => -0.0,
                5 => u * 1e-30,
                9 => -1e-45, // the smallest subnormal: times a scale < 1 it rounds to −0
                _ => u * 3.0,
            }
        })
        .collect()
}

/// Five steps of two copies of `make()`: one handed the scale, one the scaled gradient.
fn scaled_inside_equals_scaled_first(make: &dyn Fn() -> Box<dyn Optimizer>, what: &str) {
    let (mut inside, mut first) = (make(), make());
    assert!(inside.scales_gradients(), "{what} applies grad_scale itself");
    let shape = [3u64, 37];
    let info = ParamInfo::new("model.layers.0.mlp.up_proj.weight", &shape);
    let n = info.numel();
    // Weights of both signs, some zero (so a decay term is ±0 too).
    let w0: Vec<f32> = gradient(n, 99).iter().map(|x| x * 0.3).collect();
    let (mut wa, mut wb) = (w0.clone(), w0);
    let (mut sa, mut sb) = (allocate(inside.as_ref(), &info), allocate(first.as_ref(), &info));
    for (k, scale) in [0.5f64, 1.0, 0.013_7, 3.25, 1e-6].into_iter().enumerate() {
        let t = k as u64 + 1;
        let g = gradient(n, t);
        let ctx = StepContext::new(t, 1e-2, if t > 1 { 0.1 } else { 0.0 }, 1);
        step(inside.as_mut(), &info, &mut wa, &g, &mut sa, &StepContext { grad_scale: scale, ..ctx });
        // What the host handed over: candle's affine when there is a factor, else g.
        let scaled: Vec<f32> =
            if scale == 1.0 { g.clone() } else { g.iter().map(|x| x * scale as f32 + 0.0).collect() };
        step(first.as_mut(), &info, &mut wb, &scaled, &mut sb, &ctx);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&wa), bits(&wb), "{what}, step {t} (scale {scale}): the parameter");
        assert_eq!(sa, sb, "{what}, step {t} (scale {scale}): the state");
    }
}

#[test]
fn adamw_applies_the_scale_as_the_host_did() {
    scaled_inside_equals_scaled_first(&|| Box::new(AdamW::default()), "adamw");
    scaled_inside_equals_scaled_first(
        &|| Box::new(AdamW { amsgrad: true, beta1: 0.8, ..AdamW::default() }),
        "adamw amsgrad",
    );
}

#[test]
fn sgd_applies_the_scale_as_the_host_did() {
    scaled_inside_equals_scaled_first(&|| Box::new(Sgd::default()), "sgd");
    scaled_inside_equals_scaled_first(
        &|| Box::new(Sgd { momentum: 0.9, dampening: 0.1, nesterov: false }),
        "sgd momentum",
    );
    scaled_inside_equals_scaled_first(
        &|| Box::new(Sgd { momentum: 0.9, dampening: 0.0, nesterov: true }),
        "sgd nesterov",
    );
}

#[test]
fn lion_applies_the_scale_as_the_host_did() {
    scaled_inside_equals_scaled_first(&|| Box::new(Lion { beta1: 0.9, beta2: 0.99 }), "lion");
}
