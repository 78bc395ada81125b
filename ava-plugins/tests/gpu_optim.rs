//! The built-in optimizers' GPU steps against their CPU steps, bit for bit: the same
//! parameter, gradients and hyper-parameters through several steps (weight decay, AdamW's
//! bias corrections and amsgrad, SGD's first-update buffer and Nesterov), on buffers the test
//! allocates (device memory, or host memory when emulated) and hands over as the host would
//! (device pointers, a CUstream).
//!
//! Run on a machine with an NVIDIA GPU, or on the CPU's kernel emulator with
//! `AVA_CUDA_EMULATE=serial` (or `serial-reversed`, `lockstep`; CI runs the two serial ones,
//! ava-cuda-emu); with neither it fails, saying so:
//!   source tools/cuda-build-env.sh   # where no CUDA toolkit is installed
//!   cargo test -p ava-plugins --features cuda --test gpu_optim

use ava_core::device::CudaBuf;
use ava_core::prelude::*;
use ava_kernels::testing::gpu::{Sides, gpu};
use ava_plugins::builtin::adamw::AdamW;
use ava_plugins::builtin::sgd::Sgd;

/// `n` values in [-scale, scale), a pure function of `seed` (the kernels' test generator).
fn data(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    ava_kernels::testing::Rng(seed).vec(n).into_iter().map(|x| x * scale).collect()
}

/// Five steps of `opt` on a parameter of 70 001 elements (a partial last block), with weight
/// decay from the second step and a gradient scale (the clipping factor, which both steps
/// apply themselves) from the third, compared after every step.
fn five_steps(mut opt: Box<dyn Optimizer>, what: &str) {
    let gpu = gpu();
    let shape = [70_001u64];
    let info = ParamInfo::new("model.layers.0.mlp.up_proj.weight", &shape);
    let mut sides = Sides::new(opt.as_ref(), &info, &data(70_001, 1, 1.0), &gpu);
    let input = |step: u64| {
        let g = data(70_001, 10 + step, 0.5);
        let grad_scale = [1.0, 1.0, 0.5, 0.013_7, 3.25][(step as usize - 1) % 5];
        let ctx = StepContext {
            grad_scale,
            ..StepContext::new(step, 1e-3 * step as f64, if step > 1 { 0.1 } else { 0.0 }, 1)
        };
        (g, ctx)
    };
    sides.steps(opt.as_mut(), &info, 1..=5, input, what, &gpu);
}

#[test]
fn adamw_on_the_gpu_is_the_cpus_bit_for_bit() {
    five_steps(Box::new(AdamW::default()), "adamw");
    five_steps(Box::new(AdamW { amsgrad: true, beta1: 0.8, ..AdamW::default() }), "adamw amsgrad");
}

#[test]
fn sgd_on_the_gpu_is_the_cpus_bit_for_bit() {
    five_steps(Box::new(Sgd::default()), "sgd");
    five_steps(Box::new(Sgd { momentum: 0.9, dampening: 0.1, nesterov: false }), "sgd momentum");
    five_steps(Box::new(Sgd { momentum: 0.9, dampening: 0.0, nesterov: true }), "sgd nesterov");
}

#[test]
fn a_buffer_of_the_wrong_size_is_refused_before_any_launch() {
    let gpu = gpu();
    let shape = [8u64];
    let info = ParamInfo::new("w", &shape);
    let mut opt = AdamW::default();
    let w = gpu.upload(&[0f32; 8]);
    let wp = gpu.ptr(&w);
    let short = CudaBuf { ptr: wp, len: 7, dtype: DType::F32, ordinal: 0 };
    let whole = CudaBuf { len: 8, ..short };
    let ctx = StepContext { step: 1, lr: 1e-3, weight_decay: 0.0, threads: 1, grad_scale: 1.0 };
    let s = gpu.stream();
    let err = opt.step_cuda(&info, &whole, &short, &[], &ctx, &s).unwrap_err().to_string();
    assert!(err.contains("grad"), "{err}");
}
