//! 8-bit AdamW's GPU step against its CPU step, bit for bit: the same parameter, gradients and
//! hyper-parameters through several steps, on buffers the test allocates (device memory, or
//! host memory when emulated) and hands over as the host would (device pointers, a
//! CUstream). After every step the weights and every state buffer (the u8 codes, the
//! absmaxes, the count, the norm history) must be the same bytes on both sides.
//!
//! Covered: block sizes 64, 256, 2048 and 4096; lengths that are not a multiple of the block
//! (and n = 1, 5, 63); an all-zero block and one whose moments are subnormal (both stored as
//! zeros); weight decay and a changing learning rate; percentile clipping that engages, on a
//! tensor long enough for two levels of the Σ g² tree above the per-block sums, and past 100
//! steps (the history wraps); the fp32 path (small tensors, `fp32_state`); the CPU split over
//! threads; and state written by the CPU continued on the GPU (a checkpoint moving devices).
//!
//! Run on a machine with an NVIDIA GPU, or on the CPU's kernel emulator with
//! `AVA_CUDA_EMULATE=serial` (or `serial-reversed`, `lockstep`; CI runs the two serial ones,
//! ava-cuda-emu); with neither it fails, saying so:
//!   source tools/cuda-build-env.sh   # where no CUDA toolkit is installed
//!   cargo test -p ava-plugin-adam-8bit --features cuda --test gpu_adam_8bit

use ava_core::prelude::*;
use ava_kernels::testing::gpu::{Sides, gpu};
use ava_plugin_adam_8bit::Adam8bit;

fn build(json: &str) -> Adam8bit {
    ava_core::ffi::build::<Adam8bit>(json, &HostContext::default()).unwrap()
}

/// A gradient of `n` values in [-scale, scale), a pure function of `seed`, with every 9th an
/// exact zero, elements [256, 512) all zero (a block whose moments stay 0 at block size ≤ 256)
/// and [512, 576) tiny (moments below f32's normal range: stored as zeros).
fn grad(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut rng = ava_kernels::testing::Rng(seed);
    (0..n)
        .map(|i| {
            let x = rng.uniform();
            match i {
                _ if i % 9 == 4 => 0.0,
                256..512 => 0.0,
                512..576 => x * 4e-38,
                _ => x * scale,
            }
        })
        .collect()
}

/// `steps` steps of `opt` on a parameter of `n` elements named `name`, compared after every
/// step. The gradient's scale follows `scales` (cycled; jumps make percentile clipping engage),
/// the learning rate changes each step and weight decay starts at step 2; the CPU step runs
/// on `threads` threads.
fn run(opt: &mut Adam8bit, name: &str, n: usize, steps: u64, scales: &[f32], threads: u32, what: &str) {
    let gpu = gpu();
    let shape = [n as u64];
    let info = ParamInfo::new(name, &shape);
    let w0: Vec<f32> = ava_kernels::testing::Rng(1).vec(n);
    let mut sides = Sides::new(opt, &info, &w0, &gpu);
    let input = |step: u64| {
        let scale = scales[(step as usize - 1) % scales.len()];
        let g = grad(n, 100 + step, scale);
        let ctx = StepContext {
            step,
            lr: 1e-3 * (1.0 + (step % 7) as f64),
            weight_decay: if step > 1 { 0.1 } else { 0.0 },
            threads,
            grad_scale: 1.0,
        };
        (g, ctx)
    };
    sides.steps(opt, &info, 1..=steps, input, &format!("{what}: n {n}"), &gpu);
}

const LAYER: &str = "model.layers.0.mlp.up_proj.weight";

#[test]
fn eight_bit_steps_are_the_cpus_bit_for_bit() {
    // The default block of 256 on a length with a partial last block, the CPU on 2 threads.
    run(&mut Adam8bit::default(), LAYER, 70_001, 6, &[1.0, 0.5, 2.0], 4, "block 256");
    // Block 4096: 16 elements per thread; a partial last block.
    run(&mut build(r#"{"block_size": 4096}"#), LAYER, 3 * 4096 + 1000, 4, &[1.0], 1, "block 4096");
    // Block 64 on small tensors (min_8bit_size 0): n smaller than a block, and around one.
    let mut small = build(r#"{"block_size": 64, "min_8bit_size": 0, "betas": [0.8, 0.95], "eps": 1e-6}"#);
    for n in [1, 5, 63, 64, 65, 700] {
        run(&mut small, LAYER, n, 5, &[1.0, 3.0], 1, "block 64");
    }
}

#[test]
fn percentile_clipping_is_the_cpus_bit_for_bit() {
    // Scales jump 30× and 100×: at p = 50 those steps are clipped.
    let scales = [1.0, 1.0, 30.0, 0.5, 100.0, 1.0];
    run(&mut build(r#"{"block_size": 2048, "percentile_clipping": 50}"#), LAYER, 70_001, 6, &scales, 1, "p 50");
    // 1 100 003 elements: 34 partial sums, so the tree has two levels above them.
    run(&mut build(r#"{"percentile_clipping": 90}"#), LAYER, 1_100_003, 4, &scales, 4, "p 90, long");
    // Past 100 steps the history wraps; a small tensor keeps it quick.
    let mut wraps = build(r#"{"block_size": 64, "min_8bit_size": 0, "percentile_clipping": 75}"#);
    run(&mut wraps, LAYER, 300, 105, &scales, 1, "p 75, 105 steps");
}

#[test]
fn fp32_path_steps_are_the_cpus_bit_for_bit() {
    // A tensor under min_8bit_size (a norm gain), with and without clipping, and a name in
    // fp32_state.
    run(&mut Adam8bit::default(), "model.norm.weight", 100, 5, &[1.0], 1, "fp32, small");
    let mut clipped = build(r#"{"percentile_clipping": 50}"#);
    run(&mut clipped, "model.norm.weight", 1000, 6, &[1.0, 1.0, 30.0, 0.5, 100.0], 1, "fp32, clipped");
    let mut named = build(r#"{"fp32_state": ["embed_tokens"]}"#);
    run(&mut named, "model.embed_tokens.weight", 5000, 4, &[1.0], 1, "fp32_state");
}

/// State written by CPU steps, continued on the GPU: the same bits as continuing on the CPU
/// (a checkpoint moving between devices).
#[test]
fn cpu_state_continues_on_the_gpu() {
    let gpu = gpu();
    let n = 20_000;
    let shape = [n as u64];
    let info = ParamInfo::new(LAYER, &shape);
    let mut opt = build(r#"{"percentile_clipping": 80}"#);
    let mut sides = Sides::new(&opt, &info, &ava_kernels::testing::Rng(2).vec(n), &gpu);
    let input =
        |step| (grad(n, step, 1.0), StepContext { step, lr: 1e-3, weight_decay: 0.01, threads: 1, grad_scale: 1.0 });
    sides.continued(&mut opt, &info, 1..=3, 4..=6, input, "continued", &gpu);
}

#[test]
fn a_buffer_of_the_wrong_size_is_refused_before_any_launch() {
    let gpu = gpu();
    let n = 4096;
    let shape = [n as u64];
    let info = ParamInfo::new(LAYER, &shape);
    let mut opt = Adam8bit::default();
    let sides = Sides::new(&opt, &info, &vec![1f32; n], &gpu);
    let err = sides.refused(&mut opt, &info, &gpu, |state| state[2].len -= 1); // absmax_exp_avg one short
    assert!(err.contains("absmax_exp_avg"), "{err}");
    // The GPU side must still hold the weights it started with, the state all zeros.
    sides.same("refused step", &gpu);
}
