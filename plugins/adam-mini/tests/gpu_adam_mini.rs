//! Adam-mini's GPU step against its CPU step, bit for bit: the same parameter, gradients and
//! hyper-parameters through several steps, on buffers the test allocates (device memory, or
//! host memory when emulated) and hands over as the host would (device pointers, a
//! CUstream). After every step the weights and every state buffer (the first moment, the
//! blocks' second moments, the count) must be the same bytes on both sides.
//!
//! Covered: rows of 4173 (five chunks of 1024, the last partial) and of 1000 (less than one),
//! query heads of 7500 elements, whole vectors of 1, 5 and 70 001 elements and one of
//! 1 100 003 (1075 chunks: a tree of three levels, the wider thread block), a rank-3 tensor
//! (one block), blocks of one element (`adam_names`, and a one-column matrix: AdamW); other
//! betas and eps; weight decay and a changing learning rate; and state written by the CPU
//! continued on the GPU (a checkpoint moving devices).
//!
//! Run on a machine with an NVIDIA GPU, or on the CPU's kernel emulator with
//! `AVA_CUDA_EMULATE=serial` (or `serial-reversed`, `lockstep`; CI runs the two serial ones,
//! ava-cuda-emu); with neither it fails, saying so:
//!   source tools/cuda-build-env.sh   # where no CUDA toolkit is installed
//!   cargo test -p ava-plugin-adam-mini --features cuda --test gpu_adam_mini

use ava_core::prelude::*;
use ava_kernels::testing::gpu::{Sides, gpu, uneven as data, uneven_step};
use ava_plugin_adam_mini::AdamMini;

fn build(json: &str) -> AdamMini {
    ava_core::ffi::build::<AdamMini>(json, &HostContext::default()).unwrap()
}

/// `steps` steps of `opt` on the parameter `name` of `shape`, compared after every step. The
/// gradient's scale changes each step, the learning rate too, and weight decay starts at step 2.
fn run(opt: &mut AdamMini, name: &str, shape: &[u64], steps: u64, what: &str) {
    let gpu = gpu();
    let info = ParamInfo::new(name, shape);
    let n = info.numel();
    let mut sides = Sides::new(opt, &info, &data(n, 1, 1.0), &gpu);
    sides.steps(opt, &info, 1..=steps, |step| uneven_step(n, step), &format!("{what}: {name} {shape:?}"), &gpu);
}

/// Every kind of block: (name, shape).
const PARAMS: [(&str, &[u64]); 9] = [
    ("model.layers.0.mlp.up_proj.weight", &[70, 4096 + 77]),
    ("model.layers.0.mlp.down_proj.weight", &[5, 1000]),
    ("model.layers.0.self_attn.q_proj.weight", &[30, 1500]),
    ("model.norm.weight", &[1]),
    ("model.norm.weight", &[5]),
    ("model.layers.0.input_layernorm.weight", &[70_001]),
    ("model.layers.0.experts", &[3, 4, 5]),
    ("lm_head.weight", &[33, 17]),
    ("model.layers.0.mlp.gate_proj.weight", &[40, 1]),
];

#[test]
fn steps_are_the_cpus_bit_for_bit() {
    let mut opt = build(r#"{"head_dim": 5, "adam_names": ["lm_head"]}"#);
    for (name, shape) in PARAMS {
        run(&mut opt, name, shape, 5, "defaults");
    }
    let mut opt = build(r#"{"head_dim": 10, "betas": [0.8, 0.95], "eps": 1e-6, "adam_names": ["lm_head"]}"#);
    for (name, shape) in PARAMS {
        run(&mut opt, name, shape, 4, "betas [0.8, 0.95], eps 1e-6");
    }
}

#[test]
fn a_block_of_many_chunks_is_the_cpus_bit_for_bit() {
    // 1 100 003 elements in one block: 1075 chunks, three levels of the tree.
    run(&mut AdamMini::default(), "model.layers.0.post_attention_layernorm.weight", &[1_100_003], 3, "one long block");
}

/// State written by CPU steps, continued on the GPU: the same bits as continuing on the CPU
/// (a checkpoint moving between devices).
#[test]
fn cpu_state_continues_on_the_gpu() {
    let gpu = gpu();
    for (name, shape) in [PARAMS[0], PARAMS[7]] {
        let info = ParamInfo::new(name, shape);
        let n = info.numel();
        let mut opt = build(r#"{"adam_names": ["lm_head"]}"#);
        let mut sides = Sides::new(&opt, &info, &data(n, 2, 1.0), &gpu);
        let input = |step| {
            (data(n, step, 1.0), StepContext { step, lr: 1e-3, weight_decay: 0.01, threads: 1, grad_scale: 1.0 })
        };
        sides.continued(&mut opt, &info, 1..=3, 4..=6, input, &format!("{name} continued"), &gpu);
    }
}

#[test]
fn a_buffer_of_the_wrong_size_is_refused_before_any_launch() {
    let gpu = gpu();
    let shape = [4u64, 6];
    let info = ParamInfo::new("model.layers.0.mlp.up_proj.weight", &shape);
    let mut opt = AdamMini::default();
    let sides = Sides::new(&opt, &info, &[1f32; 24], &gpu);
    let err = sides.refused(&mut opt, &info, &gpu, |state| state[1].len -= 1); // exp_avg_sq one short
    assert!(err.contains("exp_avg_sq"), "{err}");
    // The GPU side must still hold the weights it started with, the state all zeros.
    sides.same("refused step", &gpu);
}
