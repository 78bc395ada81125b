//! Adam-mini's GPU step against its CPU step, bit for bit: the same parameter, gradients and
//! hyper-parameters through several steps, on buffers the test allocates with cudarc and
//! hands over as the host would (device pointers, a CUstream). After every step the weights
//! and every state buffer (the first moment, the blocks' second moments, the count) must be
//! the same bytes on both sides.
//!
//! Covered: rows of 4173 (five chunks of 1024, the last partial) and of 1000 (less than one),
//! query heads of 7500 elements, whole vectors of 1, 5 and 70 001 elements and one of
//! 1 100 003 (1075 chunks: a tree of three levels, the wider thread block), a rank-3 tensor
//! (one block), blocks of one element (`adam_names`, and a one-column matrix: AdamW); other
//! betas and eps; weight decay and a changing learning rate; and state written by the CPU
//! continued on the GPU (a checkpoint moving devices).
//!
//! Run on a machine with an NVIDIA GPU (CI only compiles this target; like ava-plugins'
//! gpu_optim it fails, saying so, where no GPU can be opened):
//!   source tools/cuda-build-env.sh   # where no CUDA toolkit is installed
//!   cargo test -p ava-plugin-adam-mini --features cuda --test gpu_adam_mini

use std::sync::Arc;

use ava_core::prelude::*;
use ava_plugin_adam_mini::AdamMini;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream as Stream, DevicePtr};

/// The GPU's context (current on this thread) and its stream, or a panic saying the test
/// needs one.
fn gpu() -> (Arc<CudaContext>, Arc<Stream>) {
    let ctx = CudaContext::new(0).unwrap_or_else(|e| {
        panic!("this test runs on an NVIDIA GPU, and none could be opened ({e}); CI only compiles it")
    });
    ctx.bind_to_thread().unwrap();
    let stream = ctx.default_stream();
    (ctx, stream)
}

fn build(json: &str) -> AdamMini {
    ava_core::ffi::build::<AdamMini>(json, &HostContext::default()).unwrap()
}

/// `n` values in [-scale, scale), a pure function of `seed`, with every 9th an exact zero and
/// stretches of very different sizes (every 5th run of 77 elements 100× smaller).
fn data(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut rng = ava_kernels::testing::Rng(seed);
    (0..n)
        .map(|i| {
            let x = rng.uniform() * scale;
            match i {
                _ if i % 9 == 4 => 0.0,
                _ if (i / 77) % 5 == 2 => x * 0.01,
                _ => x,
            }
        })
        .collect()
}

/// One parameter on both sides: weights, and the state the layout declares as bytes.
struct Sides {
    layout: Vec<StateSpec>,
    cpu_w: Vec<f32>,
    cpu_state: Vec<Vec<u8>>,
    gpu_w: CudaSlice<f32>,
    gpu_state: Vec<CudaSlice<u8>>,
}

impl Sides {
    /// Weights `w` and zero-filled state (as the host allocates it) on both sides.
    fn new(opt: &AdamMini, info: &ParamInfo<'_>, w: &[f32], stream: &Arc<Stream>) -> Self {
        let layout = opt.state_layout(info).unwrap();
        let cpu_state: Vec<Vec<u8>> = layout.iter().map(|s| vec![0u8; s.bytes() as usize]).collect();
        let mut sides =
            Self { layout, cpu_w: w.to_vec(), cpu_state, gpu_w: stream.clone_htod(w).unwrap(), gpu_state: Vec::new() };
        sides.upload(stream);
        sides
    }

    /// The CPU's weights and state copied to the GPU (a checkpoint loaded there).
    fn upload(&mut self, stream: &Arc<Stream>) {
        self.gpu_w = stream.clone_htod(&self.cpu_w).unwrap();
        self.gpu_state = self.cpu_state.iter().map(|b| stream.clone_htod(b).unwrap()).collect();
    }

    /// One step on the CPU only.
    fn cpu_step(&mut self, opt: &mut AdamMini, info: &ParamInfo<'_>, g: &[f32], ctx: &StepContext) {
        // State as 8-byte-aligned host buffers, as the host allocates them.
        let mut aligned: Vec<Vec<u64>> = self.cpu_state.iter().map(|b| vec![0u64; b.len().div_ceil(8)]).collect();
        for (a, b) in aligned.iter_mut().zip(&self.cpu_state) {
            as_bytes_mut(a)[..b.len()].copy_from_slice(b);
        }
        {
            let mut bufs: Vec<StateBuf<'_>> = aligned
                .iter_mut()
                .zip(&self.layout)
                .map(|(a, s)| StateBuf::new(s.dtype, &mut as_bytes_mut(a)[..s.bytes() as usize]))
                .collect();
            opt.step(info, &mut self.cpu_w, g, &mut bufs, ctx).unwrap();
        }
        for (a, b) in aligned.iter_mut().zip(self.cpu_state.iter_mut()) {
            let n = b.len();
            b.copy_from_slice(&as_bytes_mut(a)[..n]);
        }
    }

    /// One step on each side with gradient `g`.
    fn step(&mut self, opt: &mut AdamMini, info: &ParamInfo<'_>, g: &[f32], ctx: &StepContext, stream: &Arc<Stream>) {
        self.cpu_step(opt, info, g, ctx);
        let gg = stream.clone_htod(g).unwrap();
        let dev = |ptr: u64, len: usize, dtype: DType| CudaBuf { ptr, len: len as u64, dtype, ordinal: 0 };
        let (wp, _w_sync) = self.gpu_w.device_ptr(stream);
        let (gp, _g_sync) = gg.device_ptr(stream);
        let ptrs: Vec<_> = self.gpu_state.iter().map(|s| s.device_ptr(stream)).collect();
        let state: Vec<CudaBuf> =
            ptrs.iter().zip(&self.layout).map(|((p, _), s)| dev(*p, s.len as usize, s.dtype)).collect();
        let cuda_stream = CudaStream { handle: stream.cu_stream() as u64, ordinal: 0 };
        let n = g.len();
        opt.step_cuda(info, &dev(wp, n, DType::F32), &dev(gp, n, DType::F32), &state, ctx, &cuda_stream).unwrap();
    }

    /// Fails unless both sides hold the same bits, naming the first difference.
    fn same(&self, what: &str, stream: &Arc<Stream>) {
        let w = stream.clone_dtoh(&self.gpu_w).unwrap();
        let differ = w.iter().zip(&self.cpu_w).position(|(a, b)| a.to_bits() != b.to_bits());
        if let Some(i) = differ {
            panic!("{what}: values differ first at {i}: GPU {:e}, CPU {:e}", w[i], self.cpu_w[i]);
        }
        for ((g, c), s) in self.gpu_state.iter().zip(&self.cpu_state).zip(&self.layout) {
            let g = stream.clone_dtoh(g).unwrap();
            let differ = c.iter().zip(&g).position(|(a, b)| a != b);
            if let Some(i) = differ {
                let at = i / s.dtype.size();
                let word = |b: &[u8]| u32::from_le_bytes(b[4 * at..4 * at + 4].try_into().unwrap());
                panic!(
                    "{what}: state '{}' differs first at element {at}: GPU {:#010x}, CPU {:#010x}",
                    s.name,
                    word(&g),
                    word(c)
                );
            }
        }
    }
}

fn as_bytes_mut(words: &mut [u64]) -> &mut [u8] {
    // SAFETY: u64 has no padding and every byte pattern is a valid u8; the length is exact.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(words)) }
}

/// `steps` steps of `opt` on the parameter `name` of `shape`, compared after every step. The
/// gradient's scale changes each step, the learning rate too, and weight decay starts at step 2.
fn run(opt: &mut AdamMini, name: &str, shape: &[u64], steps: u64, what: &str) {
    let (_ctx, stream) = gpu();
    let info = ParamInfo::new(name, shape);
    let n = info.numel();
    let mut sides = Sides::new(opt, &info, &data(n, 1, 1.0), &stream);
    for step in 1..=steps {
        let g = data(n, 100 + step, [1.0, 0.3, 5.0, 0.02][step as usize % 4]);
        let ctx = StepContext {
            step,
            lr: 1e-3 * (1.0 + (step % 3) as f64),
            weight_decay: if step > 1 { 0.1 } else { 0.0 },
            threads: 1,
        };
        sides.step(opt, &info, &g, &ctx, &stream);
        sides.same(&format!("{what}: {name} {shape:?}, step {step}"), &stream);
    }
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
    let (_ctx, stream) = gpu();
    for (name, shape) in [PARAMS[0], PARAMS[7]] {
        let info = ParamInfo::new(name, shape);
        let n = info.numel();
        let mut opt = build(r#"{"adam_names": ["lm_head"]}"#);
        let mut sides = Sides::new(&opt, &info, &data(n, 2, 1.0), &stream);
        let ctx = |step| StepContext { step, lr: 1e-3, weight_decay: 0.01, threads: 1 };
        for step in 1..=3 {
            sides.cpu_step(&mut opt, &info, &data(n, step, 1.0), &ctx(step));
        }
        sides.upload(&stream);
        for step in 4..=6 {
            sides.step(&mut opt, &info, &data(n, step, 1.0), &ctx(step), &stream);
            sides.same(&format!("{name} continued, step {step}"), &stream);
        }
    }
}

#[test]
fn a_buffer_of_the_wrong_size_is_refused_before_any_launch() {
    let (_ctx, stream) = gpu();
    let shape = [4u64, 6];
    let info = ParamInfo::new("model.layers.0.mlp.up_proj.weight", &shape);
    let mut opt = AdamMini::default();
    let mut sides = Sides::new(&opt, &info, &[1f32; 24], &stream);
    let (wp, _w) = sides.gpu_w.device_ptr(&stream);
    let ptrs: Vec<_> = sides.gpu_state.iter().map(|s| s.device_ptr(&stream)).collect();
    let dev = |ptr: u64, len: u64, dtype: DType| CudaBuf { ptr, len, dtype, ordinal: 0 };
    let mut state: Vec<CudaBuf> = ptrs.iter().zip(&sides.layout).map(|((p, _), s)| dev(*p, s.len, s.dtype)).collect();
    state[1].len -= 1; // exp_avg_sq one short
    let w = dev(wp, 24, DType::F32);
    let ctx = StepContext { step: 1, lr: 1e-3, weight_decay: 0.0, threads: 1 };
    let s = CudaStream { handle: stream.cu_stream() as u64, ordinal: 0 };
    let err = opt.step_cuda(&info, &w, &w, &state, &ctx, &s).unwrap_err().to_string();
    assert!(err.contains("exp_avg_sq"), "{err}");
    drop(ptrs);
    drop(_w);
    sides.cpu_w = vec![1f32; 24]; // what the GPU side must still hold, state all zeros
    sides.same("refused step", &stream);
}
