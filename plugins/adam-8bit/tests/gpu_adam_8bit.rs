//! 8-bit AdamW's GPU step against its CPU step, bit for bit: the same parameter, gradients and
//! hyper-parameters through several steps, on buffers the test allocates with cudarc and
//! hands over as the host would (device pointers, a CUstream). After every step the weights
//! and every state buffer (the u8 codes, the absmaxes, the count, the norm history) must be
//! the same bytes on both sides.
//!
//! Covered: block sizes 64, 256, 2048 and 4096; lengths that are not a multiple of the block
//! (and n = 1, 5, 63); an all-zero block and one whose moments are subnormal (both stored as
//! zeros); weight decay and a changing learning rate; percentile clipping that engages, on a
//! tensor long enough for two levels of the Σ g² tree above the per-block sums, and past 100
//! steps (the history wraps); the fp32 path (small tensors, `fp32_state`); the CPU split over
//! threads; and state written by the CPU continued on the GPU (a checkpoint moving devices).
//!
//! Run on a machine with an NVIDIA GPU (CI only compiles this target; like ava-plugins'
//! gpu_optim it fails, saying so, where no GPU can be opened):
//!   source tools/cuda-build-env.sh   # where no CUDA toolkit is installed
//!   cargo test -p ava-plugin-adam-8bit --features cuda --test gpu_adam_8bit

use std::sync::Arc;

use ava_core::prelude::*;
use ava_plugin_adam_8bit::Adam8bit;
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
    fn new(opt: &Adam8bit, info: &ParamInfo<'_>, w: &[f32], stream: &Arc<Stream>) -> Self {
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
        // A zero-length buffer still gets one byte (what the host allocates); the call sees len 0.
        self.gpu_state = self.cpu_state.iter().map(|b| stream.clone_htod(&padded(b)).unwrap()).collect();
    }

    /// One step on the CPU only.
    fn cpu_step(&mut self, opt: &mut Adam8bit, info: &ParamInfo<'_>, g: &[f32], ctx: &StepContext) {
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
    fn step(&mut self, opt: &mut Adam8bit, info: &ParamInfo<'_>, g: &[f32], ctx: &StepContext, stream: &Arc<Stream>) {
        self.cpu_step(opt, info, g, ctx);
        let gg = stream.clone_htod(&padded(g)).unwrap();
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
                panic!(
                    "{what}: state '{}' differs first at element {at} (byte {i}): GPU {}, CPU {}",
                    s.name, g[i], c[i]
                );
            }
        }
    }
}

/// At least one element: cudarc's allocations of nothing are not a buffer to point at.
fn padded<T: Copy + Default>(v: &[T]) -> Vec<T> {
    if v.is_empty() { vec![T::default()] } else { v.to_vec() }
}

fn as_bytes_mut(words: &mut [u64]) -> &mut [u8] {
    // SAFETY: u64 has no padding and every byte pattern is a valid u8; the length is exact.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(words)) }
}

/// `steps` steps of `opt` on a parameter of `n` elements named `name`, compared after every
/// step. The gradient's scale follows `scales` (cycled; jumps make percentile clipping engage),
/// the learning rate changes each step and weight decay starts at step 2; the CPU step runs
/// on `threads` threads.
fn run(opt: &mut Adam8bit, name: &str, n: usize, steps: u64, scales: &[f32], threads: u32, what: &str) {
    let (_ctx, stream) = gpu();
    let shape = [n as u64];
    let info = ParamInfo::new(name, &shape);
    let w0: Vec<f32> = ava_kernels::testing::Rng(1).vec(n);
    let mut sides = Sides::new(opt, &info, &w0, &stream);
    for step in 1..=steps {
        let scale = scales[(step as usize - 1) % scales.len()];
        let g = grad(n, 100 + step, scale);
        let ctx = StepContext {
            step,
            lr: 1e-3 * (1.0 + (step % 7) as f64),
            weight_decay: if step > 1 { 0.1 } else { 0.0 },
            threads,
        };
        sides.step(opt, &info, &g, &ctx, &stream);
        sides.same(&format!("{what}: n {n}, step {step}"), &stream);
    }
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
    let (_ctx, stream) = gpu();
    let n = 20_000;
    let shape = [n as u64];
    let info = ParamInfo::new(LAYER, &shape);
    let mut opt = build(r#"{"percentile_clipping": 80}"#);
    let mut sides = Sides::new(&opt, &info, &ava_kernels::testing::Rng(2).vec(n), &stream);
    let ctx = |step| StepContext { step, lr: 1e-3, weight_decay: 0.01, threads: 1 };
    for step in 1..=3 {
        sides.cpu_step(&mut opt, &info, &grad(n, step, 1.0), &ctx(step));
    }
    sides.upload(&stream);
    for step in 4..=6 {
        sides.step(&mut opt, &info, &grad(n, step, 1.0), &ctx(step), &stream);
        sides.same(&format!("continued, step {step}"), &stream);
    }
}

#[test]
fn a_buffer_of_the_wrong_size_is_refused_before_any_launch() {
    let (_ctx, stream) = gpu();
    let n = 4096;
    let shape = [n as u64];
    let info = ParamInfo::new(LAYER, &shape);
    let mut opt = Adam8bit::default();
    let mut sides = Sides::new(&opt, &info, &vec![1f32; n], &stream);
    let (wp, _w) = sides.gpu_w.device_ptr(&stream);
    let ptrs: Vec<_> = sides.gpu_state.iter().map(|s| s.device_ptr(&stream)).collect();
    let dev = |ptr: u64, len: u64, dtype: DType| CudaBuf { ptr, len, dtype, ordinal: 0 };
    let mut state: Vec<CudaBuf> = ptrs.iter().zip(&sides.layout).map(|((p, _), s)| dev(*p, s.len, s.dtype)).collect();
    state[2].len -= 1; // absmax_exp_avg one short
    let w = dev(wp, n as u64, DType::F32);
    let ctx = StepContext { step: 1, lr: 1e-3, weight_decay: 0.0, threads: 1 };
    let s = CudaStream { handle: stream.cu_stream() as u64, ordinal: 0 };
    let err = opt.step_cuda(&info, &w, &w, &state, &ctx, &s).unwrap_err().to_string();
    assert!(err.contains("absmax_exp_avg"), "{err}");
    drop(ptrs);
    drop(_w);
    sides.cpu_w = vec![1f32; n]; // what the GPU side must still hold, state all zeros
    sides.same("refused step", &stream);
}
