//! The built-in optimizers' GPU steps against their CPU steps, bit for bit: the same
//! parameter, gradients and hyper-parameters through several steps (weight decay, AdamW's
//! bias corrections and amsgrad, SGD's first-update buffer and Nesterov), on buffers the test
//! allocates with cudarc and hands over as the host would (device pointers, a CUstream).
//!
//! Run on a machine with an NVIDIA GPU (CI only compiles this target):
//!   source tools/cuda-build-env.sh   # where no CUDA toolkit is installed
//!   cargo test -p ava-plugins --features cuda --test gpu_optim

use std::sync::Arc;

use ava_core::device::{CudaBuf, CudaStream};
use ava_core::prelude::*;
use ava_plugins::builtin::adamw::AdamW;
use ava_plugins::builtin::sgd::Sgd;
use cudarc::driver::{CudaContext, CudaSlice, DevicePtr};

/// The GPU's context (current on this thread) and its stream, or a panic saying the test
/// needs one.
fn gpu() -> (Arc<CudaContext>, Arc<cudarc::driver::CudaStream>) {
    let ctx = CudaContext::new(0).unwrap_or_else(|e| {
        panic!("this test runs on an NVIDIA GPU, and none could be opened ({e}); CI only compiles it")
    });
    ctx.bind_to_thread().unwrap();
    let stream = ctx.default_stream();
    (ctx, stream)
}

/// `n` values in [-scale, scale), a pure function of `seed` (the kernels' test generator).
fn data(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    ava_kernels::testing::Rng(seed).vec(n).into_iter().map(|x| x * scale).collect()
}

/// One parameter's buffers on both sides: values, and the state the layout declares (f32
/// buffers as f32s, the u32 count as one u32).
struct Sides {
    cpu_w: Vec<f32>,
    cpu_state: Vec<Vec<u8>>,
    gpu_w: CudaSlice<f32>,
    gpu_state: Vec<CudaSlice<u8>>,
    layout: Vec<StateSpec>,
}

impl Sides {
    fn new(opt: &dyn Optimizer, info: &ParamInfo<'_>, w: &[f32], stream: &Arc<cudarc::driver::CudaStream>) -> Self {
        let layout = opt.state_layout(info).unwrap();
        let cpu_state: Vec<Vec<u8>> = layout.iter().map(|s| vec![0u8; s.bytes() as usize]).collect();
        let gpu_state = cpu_state.iter().map(|b| stream.clone_htod(b).unwrap()).collect();
        Self { cpu_w: w.to_vec(), cpu_state, gpu_w: stream.clone_htod(w).unwrap(), gpu_state, layout }
    }

    /// One step on each side with gradient `g`.
    fn step(
        &mut self,
        opt: &mut dyn Optimizer,
        info: &ParamInfo<'_>,
        g: &[f32],
        ctx: &StepContext,
        stream: &Arc<cudarc::driver::CudaStream>,
    ) {
        // The CPU: state as 8-byte-aligned host buffers, as the host allocates them.
        let mut aligned: Vec<Vec<u64>> = self.cpu_state.iter().map(|b| vec![0u64; b.len().div_ceil(8)]).collect();
        for (a, b) in aligned.iter_mut().zip(&self.cpu_state) {
            bytemuck::cast_slice_mut::<u64, u8>(a)[..b.len()].copy_from_slice(b);
        }
        {
            let mut bufs: Vec<StateBuf<'_>> = aligned
                .iter_mut()
                .zip(&self.layout)
                .map(|(a, s)| StateBuf::new(s.dtype, &mut bytemuck::cast_slice_mut::<u64, u8>(a)[..s.bytes() as usize]))
                .collect();
            opt.step(info, &mut self.cpu_w, g, &mut bufs, ctx).unwrap();
        }
        for (a, b) in aligned.iter().zip(self.cpu_state.iter_mut()) {
            let n = b.len();
            b.copy_from_slice(&bytemuck::cast_slice::<u64, u8>(a)[..n]);
        }
        // The GPU: the same through device pointers on the stream.
        let gg = stream.clone_htod(g).unwrap();
        let dev = |ptr: u64, len: usize, dtype: DType| CudaBuf { ptr, len: len as u64, dtype, ordinal: 0 };
        let (wp, _w_sync) = self.gpu_w.device_ptr(stream);
        let (gp, _g_sync) = gg.device_ptr(stream);
        let ptrs: Vec<_> = self.gpu_state.iter().map(|s| s.device_ptr(stream)).collect();
        let state: Vec<CudaBuf> =
            ptrs.iter().zip(&self.layout).map(|((p, _), s)| dev(*p, s.len as usize, s.dtype)).collect();
        let cuda_stream = CudaStream { handle: stream.cu_stream() as u64, ordinal: 0 };
        opt.step_cuda(info, &dev(wp, g.len(), DType::F32), &dev(gp, g.len(), DType::F32), &state, ctx, &cuda_stream)
            .unwrap();
    }

    /// Fails unless both sides hold the same bits.
    fn same(&self, what: &str, stream: &Arc<cudarc::driver::CudaStream>) {
        let w = stream.clone_dtoh(&self.gpu_w).unwrap();
        let differ = w.iter().zip(&self.cpu_w).position(|(a, b)| a.to_bits() != b.to_bits());
        assert_eq!(differ, None, "{what}: values differ first at {differ:?}");
        for ((g, c), s) in self.gpu_state.iter().zip(&self.cpu_state).zip(&self.layout) {
            let g = stream.clone_dtoh(g).unwrap();
            assert!(g == *c, "{what}: state '{}' differs", s.name);
        }
    }
}

/// Five steps of `opt` on a parameter of 70 001 elements (a partial last block), with weight
/// decay from the second step, compared after every step.
fn five_steps(mut opt: Box<dyn Optimizer>, what: &str) {
    let (_ctx, stream) = gpu();
    let shape = [70_001u64];
    let info = ParamInfo::new("model.layers.0.mlp.up_proj.weight", &shape);
    let mut sides = Sides::new(opt.as_ref(), &info, &data(70_001, 1, 1.0), &stream);
    for step in 1..=5u64 {
        let g = data(70_001, 10 + step, 0.5);
        let ctx =
            StepContext { step, lr: 1e-3 * step as f64, weight_decay: if step > 1 { 0.1 } else { 0.0 }, threads: 1 };
        sides.step(opt.as_mut(), &info, &g, &ctx, &stream);
        sides.same(&format!("{what}, step {step}"), &stream);
    }
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
    let (_ctx, stream) = gpu();
    let shape = [8u64];
    let info = ParamInfo::new("w", &shape);
    let mut opt = AdamW::default();
    let w = stream.clone_htod(&[0f32; 8]).unwrap();
    let (wp, _sync) = w.device_ptr(&stream);
    let short = CudaBuf { ptr: wp, len: 7, dtype: DType::F32, ordinal: 0 };
    let whole = CudaBuf { len: 8, ..short };
    let ctx = StepContext { step: 1, lr: 1e-3, weight_decay: 0.0, threads: 1 };
    let s = CudaStream { handle: stream.cu_stream() as u64, ordinal: 0 };
    let err = opt.step_cuda(&info, &whole, &short, &[], &ctx, &s).unwrap_err().to_string();
    assert!(err.contains("grad"), "{err}");
}
