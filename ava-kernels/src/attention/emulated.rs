//! `flash` on the GPU, run on the CPU: kernels/flash.cu compiled by the kernel emulator
//! (ava-cuda-emu) and launched by this crate's own GPU launcher (`attention::cuda`, its grids,
//! shared memory, argument order and workspace carving unchanged, through
//! `cuda::set_launch_hook`), with host memory for the device's. Every result is compared
//! with the CPU's flash kernel on the same (rounded) inputs; runs in the emulator's two serial
//! orders (warp after warp, each up to its next `__syncthreads`, the first or the last warp
//! first) must give the lockstep run's bits (no thread or warp reads another's write without
//! a barrier). This runs wherever `cargo test --features cuda` does, GPU or not; `gpu_ops` on
//! a GPU (ava-train) stays the test of the device itself.
//!
//! Tolerances, as a share of each tensor's largest magnitude: bf16 1e-2, f16 1.5e-3 (the
//! kernels round P and dS to the input type before the tensor-core products, as
//! FlashAttention-2 does; the CPU keeps them in f32), f32 (CUDA-core kernels) 1e-6; the
//! logsumexps 1e-5 in every type (f32 on both sides). A wrong fragment layout, tile offset or
//! mask gives errors of the values' own size.

use std::cell::Cell;
use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use ava_core::device::CudaBuf;
use ava_core::{AttnShape, DType, PluginError};
use ava_cuda_emu::{Build, Emulator, Order, Shape};

use super::{Kernel, Masking, cuda};
use crate::testing::gpu::{Buffer, Gpu, stored, widened};
use crate::testing::{Rng, run_segmented, shape};

thread_local! {
    /// The order the emulated launches on this thread run their threads in.
    static ORDER: Cell<Order> = const { Cell::new(Order::Lockstep) };
}

/// The emulator with flash.cu loaded and every launch of this process sent to it.
fn emulator() -> &'static Arc<Emulator> {
    static EMU: OnceLock<Arc<Emulator>> = OnceLock::new();
    EMU.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let build = Build {
            sources: vec![root.join("kernels/flash.cu")],
            includes: vec![ava_cuda_build_include()],
            out_dir: ava_cuda_emu::cache_dir().unwrap_or_else(|e| panic!("{e}")),
        };
        let emu = Arc::new(Emulator::build(&build).unwrap_or_else(|e| panic!("{e}")));
        let hooked = emu.clone();
        crate::cuda::set_launch_hook(Some(Arc::new(move |_module, name, launch, params| {
            let shape = Shape { grid: launch.grid, block: (launch.threads, 1, 1), shared: launch.shared as usize };
            let name = name.to_string_lossy();
            // SAFETY: the launcher passes the kernel's parameters one for one (the emulator
            // checks their number); its buffers are the host vectors below.
            unsafe { hooked.call(&name, shape, ORDER.get(), params) }.map_err(|e| PluginError::internal(e.to_string()))
        })));
        emu
    })
}

/// `<ava/common.cuh>`'s directory (ava-cuda-build's, as the build script gives nvcc).
fn ava_cuda_build_include() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../ava-cuda-build/include")
}

/// The element type of a run, and its values' storage.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Ty {
    F32,
    Bf16,
    F16,
}

impl Ty {
    fn dtype(self) -> DType {
        match self {
            Ty::F32 => DType::F32,
            Ty::Bf16 => DType::BF16,
            Ty::F16 => DType::F16,
        }
    }
    /// `x` rounded to the type (nearest, ties to even), as stored bits in 4 bytes or 2.
    fn store(self, x: &[f32]) -> Vec<u8> {
        stored(self.dtype(), x)
    }
    fn load(self, b: &[u8]) -> Vec<f32> {
        widened(self.dtype(), b)
    }
    /// The largest difference allowed, as a share of the tensor's largest magnitude: the
    /// outputs' rounding to the type and, for bf16/f16, P and dS rounded before the
    /// tensor-core products (2–3× the largest seen on these cases: 5.0e-3, 5.3e-4, 3.3e-7).
    fn tolerance(self) -> f32 {
        match self {
            Ty::F32 => 1e-6,
            Ty::Bf16 => 1e-2,
            Ty::F16 => 1.5e-3,
        }
    }
}

/// out, lse, dq, dk, dv of the emulated GPU kernels, widened to f32.
type Outputs = [Vec<f32>; 5];

/// The GPU launcher's forward and backward on `inputs` (already rounded to `ty`). Buffers are
/// the GPU tests' emulated ones: 16-byte aligned, between canary guards checked when read
/// back (a write past either end fails).
fn gpu(s: &AttnShape, ty: Ty, segments: &[u32], inputs: &[Vec<f32>; 4], order: Order) -> Result<Outputs, String> {
    emulator();
    ORDER.set(order);
    let mem = Gpu::Emulated;
    let dt = ty.dtype();
    let size = dt.size();
    let [q, k, v, dout] = inputs.each_ref().map(|x| mem.upload(&ty.store(x)));
    let (nq, nk) = (s.q_numel(), s.kv_numel());
    // Outputs start as 0xff bytes (NaN in every type): an element left unwritten fails.
    let nan = |n: usize| mem.upload(&vec![0xffu8; n * size]);
    let (out, dq, dk, dv) = (nan(nq), nan(nq), nan(nk), nan(nk)); // (B, H, Tq, D) ×2, (B, Hkv, Tk, D) ×2
    let rows = (s.batch * s.q_heads * s.q_len) as usize;
    let lse = mem.upload(&vec![f32::NAN; rows]); // (B, H, Tq)
    let ws = mem.upload(&vec![f32::NAN; super::flash::device_backward_workspace_len(s) as usize]);
    let segs = if segments.is_empty() { None } else { Some(mem.upload(segments)) }; // (B, Tk)
    let segs = segs.as_ref().map_or(CudaBuf::empty(DType::U32, 0), |b| mem.buf(b, segments.len(), DType::U32));
    let stream = mem.stream();
    let x = |b: &Buffer<u8>, n: usize| mem.buf(b, n, dt);
    let (bq, bk, bv) = (x(&q, nq), x(&k, nk), x(&v, nk));
    let (lse_buf, ws_buf) = (mem.buf(&lse, lse.len(), DType::F32), mem.buf(&ws, ws.len(), DType::F32));
    cuda::forward(s, &bq, &bk, &bv, &segs, &x(&out, nq), &lse_buf, &stream).map_err(|e| format!("forward: {e}"))?;
    cuda::backward(
        s,
        (&bq, &bk, &bv, &segs),
        (&x(&out, nq), &x(&dout, nq), &lse_buf),
        (&x(&dq, nq), &x(&dk, nk), &x(&dv, nk)),
        &ws_buf,
        &stream,
    )
    .map_err(|e| format!("backward: {e}"))?;
    let load = |b: &Buffer<u8>| ty.load(&mem.download(b));
    Ok([load(&out), mem.download(&lse), load(&dq), load(&dk), load(&dv)])
}

/// The CPU's flash kernel on the same values (widened to f32): out, lse, dq, dk, dv.
fn cpu(s: &AttnShape, segments: &[u32], [q, k, v, dout]: &[Vec<f32>; 4]) -> Outputs {
    let kernel = Kernel::flash(Masking::Plain);
    let (out, lse, [dq, dk, dv]) = run_segmented(&kernel, s, segments, (q, k, v, dout), 2).expect("the CPU's flash");
    [out, lse, dq, dk, dv]
}

/// Inputs in [-1, 1) rounded to `ty` and widened back (both sides see the same values).
fn inputs(s: &AttnShape, ty: Ty, seed: u64) -> [Vec<f32>; 4] {
    let mut rng = Rng(seed);
    let (nq, nk) = (s.q_numel(), s.kv_numel());
    [rng.vec(nq), rng.vec(nk), rng.vec(nk), rng.vec(nq)].map(|x| ty.load(&ty.store(&x)))
}

/// Every element of each tensor within tolerance, or a line per tensor that is not: how many
/// differ, the worst (index and values).
fn compare(what: &str, ty: Ty, got: &Outputs, want: &Outputs) -> Result<(), String> {
    let mut problems = Vec::new();
    for (name, g, w) in ["out", "lse", "dq", "dk", "dv"].iter().zip(got).zip(want).map(|((n, g), w)| (n, g, w)) {
        let scale = w.iter().filter(|x| x.is_finite()).fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
        let bound = if *name == "lse" { 1e-5 } else { ty.tolerance() } * scale;
        let (mut bad, mut worst) = (0usize, None::<(usize, f32)>);
        for (i, (&a, &b)) in g.iter().zip(w).enumerate() {
            let same_inf = a.is_infinite() && a == b;
            // NaN (an element left unwritten) counts as the worst difference.
            let err = if a.is_nan() || b.is_nan() { f32::INFINITY } else { (a - b).abs() };
            if !same_inf && err > bound {
                bad += 1;
                if worst.is_none_or(|(_, e)| err > e) {
                    worst = Some((i, err));
                }
            }
        }
        if let Some((i, _)) = worst {
            problems.push(format!("{name}: {bad} of {} differ, worst [{i}] = {} against {}", g.len(), g[i], w[i]));
        }
    }
    if problems.is_empty() { Ok(()) } else { Err(format!("{what}:\n  {}", problems.join("\n  "))) }
}

/// Runs each case through the emulated GPU kernels and the CPU's, and reports every case
/// that differs (not only the first).
fn check(cases: &[(AttnShape, Vec<u32>)], types: &[Ty], serial_too: bool) {
    let mut failures = Vec::new();
    for (i, (s, segments)) in cases.iter().enumerate() {
        for &ty in types {
            let what = format!(
                "{ty:?} B {} H {}/{} Tq {} Tk {} D {} causal {} documents {}",
                s.batch,
                s.q_heads,
                s.kv_heads,
                s.q_len,
                s.kv_len,
                s.head_dim,
                s.causal,
                !segments.is_empty()
            );
            let x = inputs(s, ty, 17 + i as u64);
            let want = cpu(s, segments, &x);
            let got = match gpu(s, ty, segments, &x, Order::Lockstep) {
                Ok(got) => got,
                Err(e) => {
                    failures.push(format!("{what}: {e}"));
                    continue;
                }
            };
            if let Err(e) = compare(&what, ty, &got, &want) {
                failures.push(e);
            }
            for order in if serial_too { &[Order::Serial, Order::SerialReversed][..] } else { &[] } {
                match gpu(s, ty, segments, &x, *order) {
                    Ok(again)
                        if again
                            .iter()
                            .flatten()
                            .map(|v| v.to_bits())
                            .eq(got.iter().flatten().map(|v| v.to_bits())) => {}
                    Ok(_) => failures
                        .push(format!("{what}: the {order:?} order gave other bits than the lockstep order: a race")),
                    Err(e) => failures.push(format!("{what} ({order:?} order): {e}")),
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} case(s) differ from the CPU:\n{}", failures.len(), failures.join("\n"));
}

/// Document ids for (B, T): documents of `len` tokens, numbered from 0 in each sequence.
fn documents(b: usize, t: usize, len: usize) -> Vec<u32> {
    (0..b).flat_map(|_| (0..t).map(move |i| (i / len) as u32)).collect()
}

#[test]
fn the_tensor_core_kernels_match_the_cpu() {
    let mut cases = Vec::new();
    for (d, causal) in [(64, true), (64, false), (128, true), (32, true), (96, false)] {
        cases.push((shape(1, 2, 2, 80, 80, d, causal), vec![]));
    }
    // Grouped-query attention (the shares added by flash_bwd_kv_sum), two sequences.
    cases.push((shape(2, 4, 2, 70, 70, 64, true), vec![]));
    // Fewer queries than keys (the causal offset), more than one query tile.
    cases.push((shape(1, 2, 1, 65, 130, 64, true), vec![]));
    // Packed documents.
    cases.push((shape(2, 2, 2, 96, 96, 64, true), documents(2, 96, 40)));
    check(&cases, &[Ty::Bf16, Ty::F16], false);
}

#[test]
fn the_tensor_core_kernels_have_no_race_between_threads() {
    let cases = [(shape(1, 4, 2, 72, 72, 64, true), vec![]), (shape(1, 2, 2, 64, 64, 128, false), vec![])];
    check(&cases, &[Ty::Bf16], true);
}

#[test]
fn the_f32_kernels_match_the_cpu() {
    let cases = [
        (shape(1, 2, 2, 40, 40, 64, true), vec![]),
        (shape(1, 4, 2, 33, 33, 48, false), vec![]),
        (shape(1, 2, 2, 48, 48, 64, true), documents(1, 48, 20)),
    ];
    check(&cases, &[Ty::F32], true);
}

/// The emulator catches what it should here too: a launch with the wrong argument count.
#[test]
fn a_launch_with_a_missing_argument_is_refused() {
    let emu = emulator();
    let mut params: Vec<*mut c_void> = vec![std::ptr::null_mut(); 3];
    // SAFETY: refused before anything runs (flash_bwd_delta takes five parameters).
    let e = unsafe { emu.call("flash_bwd_delta_bf16", Shape::linear(1, 128), Order::Lockstep, &mut params) };
    assert!(e.unwrap_err().to_string().contains("takes 5 parameters, the launch gives 3"));
}
