//! Lion's GPU step against its CPU step, bit for bit: the same parameter, gradients and
//! hyper-parameters through several steps (weight decay, a learning-rate schedule, exact-zero
//! gradients and momenta, where `sign` is 0), on buffers the test allocates (device memory,
//! or host memory when emulated) and hands over as the host would (device pointers, a
//! CUstream). Weights and the momentum are compared after every step.
//!
//! Run on a machine with an NVIDIA GPU, or on the CPU's kernel emulator with
//! `AVA_CUDA_EMULATE=serial` (or `serial-reversed`, `lockstep`; CI runs the two serial ones,
//! ava-cuda-emu); with neither it fails, saying so:
//!   source tools/cuda-build-env.sh   # where no CUDA toolkit is installed
//!   cargo test -p ava-plugin-lion --features cuda --test gpu_lion

use ava_core::prelude::*;
use ava_kernels::testing::gpu::{Sides, gpu};
use ava_plugin_lion::Lion;

/// `n` values in [-scale, scale), a pure function of `seed`; every 7th is an exact zero (a
/// zero gradient, and at step 1 a zero interpolation, whose sign is 0).
fn data(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut rng = ava_kernels::testing::Rng(seed);
    (0..n).map(|i| if i % 7 == 3 { 0.0 } else { rng.uniform() * scale }).collect()
}

/// Six steps of `opt` on parameters of 70 001 elements (a partial last thread block), 5 and
/// 1, with weight decay from the second step, a changing learning rate and a gradient scale
/// (the clipping factor, which both steps apply themselves) from the third, compared after
/// every step.
fn six_steps(mut opt: Lion, what: &str) {
    let gpu = gpu();
    for n in [70_001usize, 5, 1] {
        let shape = [n as u64];
        let info = ParamInfo::new("model.layers.0.mlp.up_proj.weight", &shape);
        let mut sides = Sides::new(&opt, &info, &data(n, 1, 1.0), &gpu);
        let input = |step: u64| {
            let g = data(n, 10 + step, 0.5 * step as f32);
            let ctx = StepContext {
                step,
                lr: 3e-4 * step as f64,
                weight_decay: if step > 1 { 0.1 } else { 0.0 },
                threads: 1,
                grad_scale: [1.0, 1.0, 0.5, 0.013_7, 3.25, 1e-6][(step as usize - 1) % 6],
            };
            (g, ctx)
        };
        sides.steps(&mut opt, &info, 1..=6, input, &format!("{what}, n {n}"), &gpu);
    }
}

#[test]
fn lion_on_the_gpu_is_the_cpus_bit_for_bit() {
    six_steps(Lion::default(), "lion");
    six_steps(Lion { beta1: 0.95, beta2: 0.98 }, "lion betas [0.95, 0.98]");
}

#[test]
fn a_buffer_of_the_wrong_size_is_refused_before_any_launch() {
    let gpu = gpu();
    let shape = [8u64];
    let info = ParamInfo::new("w", &shape);
    let w = gpu.upload(&[1f32; 8]);
    let wp = gpu.ptr(&w);
    let whole = CudaBuf { ptr: wp, len: 8, dtype: DType::F32, ordinal: 0 };
    let short = CudaBuf { len: 7, ..whole };
    let ctx = StepContext { step: 1, lr: 1e-3, weight_decay: 0.0, threads: 1, grad_scale: 1.0 };
    let s = gpu.stream();
    let err = Lion::default().step_cuda(&info, &whole, &whole, &[short], &ctx, &s).unwrap_err().to_string();
    assert!(err.contains("exp_avg"), "{err}");
    assert_eq!(gpu.download(&w), [1f32; 8], "a refused step leaves the weights alone");
}
