//! Adafactor's GPU step against its CPU step, bit for bit: the same parameter, gradients and
//! hyper-parameters through several steps, on buffers the test allocates (device memory, or
//! host memory when emulated) and hands over as the host would (device pointers, a
//! CUstream). After every step the weights and every state buffer (the first moment, the row
//! and column averages or the per-element one, the count) must be the same bytes on both
//! sides.
//!
//! Covered: vectors of 1, 5, 1023, 3001 and 70 001 elements (partial chunks of 1024, a tree of
//! three levels) and a scalar; matrices [1, 5], [130, 77] (a partial block of 64 rows, a
//! partial warp of columns), [37, 8292] (three column tiles, the last partial), [1100, 40]
//! (mean(R) and Σ U² over trees of three levels) and a batch [3, 70, 33]; the default
//! options (relative step, parameter scale), a first moment with the trainer's learning rate
//! and weight decay, warmup_init, the clip engaging, another decay rate and eps; and state
//! written by the CPU continued on the GPU (a checkpoint moving devices).
//!
//! Run on a machine with an NVIDIA GPU, or on the CPU's kernel emulator with
//! `AVA_CUDA_EMULATE=serial` (or `serial-reversed`, `lockstep`; CI runs the two serial ones,
//! ava-cuda-emu); with neither it fails, saying so:
//!   source tools/cuda-build-env.sh   # where no CUDA toolkit is installed
//!   cargo test -p ava-plugin-adafactor --features cuda --test gpu_adafactor

use ava_core::prelude::*;
use ava_kernels::testing::gpu::{Sides, gpu, uneven as data, uneven_step};
use ava_plugin_adafactor::Adafactor;

fn build(json: &str) -> Adafactor {
    ava_core::ffi::build::<Adafactor>(json, &HostContext::default()).unwrap()
}

/// `steps` steps of `opt` on a parameter of `shape`, compared after every step. The
/// gradient's scale changes each step, the learning rate too, and weight decay starts at step 2.
fn run(opt: &mut Adafactor, shape: &[u64], steps: u64, what: &str) {
    let gpu = gpu();
    let info = ParamInfo::new("model.layers.0.mlp.up_proj.weight", shape);
    let n = info.numel();
    let mut sides = Sides::new(opt, &info, &data(n, 1, 1.0), &gpu);
    sides.steps(opt, &info, 1..=steps, |step| uneven_step(n, step), &format!("{what}: shape {shape:?}"), &gpu);
}

const VECTORS: [&[u64]; 6] = [&[1], &[5], &[1023], &[3001], &[70_001], &[]];
const MATRICES: [&[u64]; 5] = [&[1, 5], &[130, 77], &[37, 2 * 4096 + 100], &[1100, 40], &[3, 70, 33]];

#[test]
fn default_steps_are_the_cpus_bit_for_bit() {
    for shape in VECTORS.iter().chain(&MATRICES) {
        run(&mut Adafactor::default(), shape, 5, "defaults");
    }
}

#[test]
fn first_moment_and_trainer_lr_are_the_cpus_bit_for_bit() {
    let mut opt = build(r#"{"beta1": 0.9, "relative_step": false}"#);
    for shape in VECTORS.iter().chain(&MATRICES) {
        run(&mut opt, shape, 4, "beta1 0.9, relative_step false");
    }
}

#[test]
fn other_options_are_the_cpus_bit_for_bit() {
    // warmup_init; the clip engaging (a low threshold, no parameter scale); another decay
    // rate and eps.
    let cases = [
        (r#"{"warmup_init": true, "beta1": 0.5}"#, "warmup_init"),
        (r#"{"scale_parameter": false, "relative_step": false, "clip_threshold": 0.3}"#, "clip 0.3"),
        (r#"{"decay_rate": -0.5, "eps": [1e-20, 1e-4]}"#, "decay_rate -0.5"),
    ];
    for (json, what) in cases {
        let mut opt = build(json);
        for shape in [&[5u64][..], &[3001], &[130, 77], &[37, 2 * 4096 + 100], &[3, 70, 33]] {
            run(&mut opt, shape, 4, what);
        }
    }
}

/// State written by CPU steps, continued on the GPU: the same bits as continuing on the CPU
/// (a checkpoint moving between devices).
#[test]
fn cpu_state_continues_on_the_gpu() {
    let gpu = gpu();
    for shape in [&[3001u64][..], &[130, 77]] {
        let info = ParamInfo::new("model.layers.0.mlp.up_proj.weight", shape);
        let n = info.numel();
        let mut opt = build(r#"{"beta1": 0.9}"#);
        let mut sides = Sides::new(&opt, &info, &data(n, 2, 1.0), &gpu);
        let input = |step| {
            (data(n, step, 1.0), StepContext { step, lr: 1e-3, weight_decay: 0.01, threads: 1, grad_scale: 1.0 })
        };
        sides.continued(&mut opt, &info, 1..=3, 4..=6, input, &format!("{shape:?} continued"), &gpu);
    }
}

#[test]
fn a_buffer_of_the_wrong_size_is_refused_before_any_launch() {
    let gpu = gpu();
    let shape = [4u64, 6];
    let info = ParamInfo::new("model.layers.0.mlp.up_proj.weight", &shape);
    let mut opt = Adafactor::default();
    let sides = Sides::new(&opt, &info, &[1f32; 24], &gpu);
    let err = sides.refused(&mut opt, &info, &gpu, |state| state[1].len -= 1); // exp_avg_sq_col one short
    assert!(err.contains("exp_avg_sq_col"), "{err}");
    // The GPU side must still hold the weights it started with, the state all zeros.
    sides.same("refused step", &gpu);
}
