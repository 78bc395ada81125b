//! Lion's GPU step against its CPU step, bit for bit: the same parameter, gradients and
//! hyper-parameters through several steps (weight decay, a learning-rate schedule, exact-zero
//! gradients and momenta, where `sign` is 0), on buffers the test allocates with cudarc and
//! hands over as the host would (device pointers, a CUstream). Weights and the momentum are
//! compared after every step.
//!
//! Run on a machine with an NVIDIA GPU (CI only compiles this target; like ava-plugins'
//! gpu_optim it fails, saying so, where no GPU can be opened):
//!   source tools/cuda-build-env.sh   # where no CUDA toolkit is installed
//!   cargo test -p ava-plugin-lion --features cuda --test gpu_lion

use std::sync::Arc;

use ava_core::prelude::*;
use ava_plugin_lion::Lion;
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

/// `n` values in [-scale, scale), a pure function of `seed`; every 7th is an exact zero (a
/// zero gradient, and at step 1 a zero interpolation, whose sign is 0).
fn data(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut rng = ava_kernels::testing::Rng(seed);
    (0..n).map(|i| if i % 7 == 3 { 0.0 } else { rng.uniform() * scale }).collect()
}

/// One parameter on both sides: weights and momentum on the host and on the device.
struct Sides {
    cpu_w: Vec<f32>,
    cpu_m: Vec<f32>,
    gpu_w: CudaSlice<f32>,
    gpu_m: CudaSlice<f32>,
}

impl Sides {
    fn new(w: &[f32], stream: &Arc<Stream>) -> Self {
        let zeros = vec![0f32; w.len()]; // the host zero-fills state before the first step
        Self {
            cpu_w: w.to_vec(),
            cpu_m: zeros.clone(),
            gpu_w: stream.clone_htod(w).unwrap(),
            gpu_m: stream.clone_htod(&zeros).unwrap(),
        }
    }

    /// One step on each side with gradient `g`.
    fn step(&mut self, opt: &mut Lion, info: &ParamInfo<'_>, g: &[f32], ctx: &StepContext, stream: &Arc<Stream>) {
        {
            let bytes: &mut [u8] = bytemuck_bytes(&mut self.cpu_m);
            let mut state = [StateBuf::new(DType::F32, bytes)];
            opt.step(info, &mut self.cpu_w, g, &mut state, ctx).unwrap();
        }
        let gg = stream.clone_htod(g).unwrap();
        let n = g.len() as u64;
        let dev = |ptr: u64| CudaBuf { ptr, len: n, dtype: DType::F32, ordinal: 0 };
        let (wp, _w_sync) = self.gpu_w.device_ptr(stream);
        let (gp, _g_sync) = gg.device_ptr(stream);
        let (mp, _m_sync) = self.gpu_m.device_ptr(stream);
        let cuda_stream = CudaStream { handle: stream.cu_stream() as u64, ordinal: 0 };
        opt.step_cuda(info, &dev(wp), &dev(gp), &[dev(mp)], ctx, &cuda_stream).unwrap();
    }

    /// Fails unless both sides hold the same bits.
    fn same(&self, what: &str, stream: &Arc<Stream>) {
        for (name, gpu, cpu) in [("values", &self.gpu_w, &self.cpu_w), ("exp_avg", &self.gpu_m, &self.cpu_m)] {
            let got = stream.clone_dtoh(gpu).unwrap();
            let differ = got.iter().zip(cpu).position(|(a, b)| a.to_bits() != b.to_bits());
            assert_eq!(differ, None, "{what}: {name} differs first at {differ:?}");
        }
    }
}

/// The momentum as the host's byte buffer.
fn bytemuck_bytes(m: &mut [f32]) -> &mut [u8] {
    // SAFETY: f32 has no padding and every byte pattern is a valid u8; the length is exact.
    unsafe { std::slice::from_raw_parts_mut(m.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(m)) }
}

/// Six steps of `opt` on parameters of 70 001 elements (a partial last thread block), 5 and
/// 1, with weight decay from the second step and a changing learning rate, compared after
/// every step.
fn six_steps(mut opt: Lion, what: &str) {
    let (_ctx, stream) = gpu();
    for n in [70_001usize, 5, 1] {
        let shape = [n as u64];
        let info = ParamInfo::new("model.layers.0.mlp.up_proj.weight", &shape);
        let mut sides = Sides::new(&data(n, 1, 1.0), &stream);
        for step in 1..=6u64 {
            let g = data(n, 10 + step, 0.5 * step as f32);
            let ctx = StepContext {
                step,
                lr: 3e-4 * step as f64,
                weight_decay: if step > 1 { 0.1 } else { 0.0 },
                threads: 1,
            };
            sides.step(&mut opt, &info, &g, &ctx, &stream);
            sides.same(&format!("{what}, n {n}, step {step}"), &stream);
        }
    }
}

#[test]
fn lion_on_the_gpu_is_the_cpus_bit_for_bit() {
    six_steps(Lion::default(), "lion");
    six_steps(Lion { beta1: 0.95, beta2: 0.98 }, "lion betas [0.95, 0.98]");
}

#[test]
fn a_buffer_of_the_wrong_size_is_refused_before_any_launch() {
    let (_ctx, stream) = gpu();
    let shape = [8u64];
    let info = ParamInfo::new("w", &shape);
    let w = stream.clone_htod(&[1f32; 8]).unwrap();
    let (wp, _sync) = w.device_ptr(&stream);
    let whole = CudaBuf { ptr: wp, len: 8, dtype: DType::F32, ordinal: 0 };
    let short = CudaBuf { len: 7, ..whole };
    let ctx = StepContext { step: 1, lr: 1e-3, weight_decay: 0.0, threads: 1 };
    let s = CudaStream { handle: stream.cu_stream() as u64, ordinal: 0 };
    let err = Lion::default().step_cuda(&info, &whole, &whole, &[short], &ctx, &s).unwrap_err().to_string();
    assert!(err.contains("exp_avg"), "{err}");
    assert_eq!(stream.clone_dtoh(&w).unwrap(), [1f32; 8], "a refused step leaves the weights alone");
}
