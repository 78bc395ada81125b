//! The built-in `standard` attention kernel on the GPU (kernels/attention.cu, through the
//! plugin's own `forward_cuda` and `backward_cuda`) against the same kernel on the CPU
//! (`forward` and `backward`) on the same inputs: the output, the saved probabilities and
//! dQ, dK, dV, in f32, bf16 and f16, for causal and full masks, grouped-query attention,
//! fewer queries than keys, packed documents, head dimensions 64 and 128 and lengths that are
//! no multiple of a block (the GPU's 128 threads, the CPU's 64 rows, a warp). The buffers are
//! the test's (device memory, or host memory when emulated) and are handed over as the host
//! does: device pointers, a CUstream, the saved buffer and the workspaces of the lengths the
//! kernel declares for the device (`workspace_len` asked with `Device::Cuda`), every output
//! and the workspace first filled with NaN so an element left unwritten, or a value read
//! from the workspace before it is written, fails. Also: a buffer of the wrong size or type
//! is refused before anything is launched, and two runs give the same bits (no atomics).
//!
//! Tolerances, `|gpu − cpu| <= atol + rtol·|cpu|` for every element (the sums run in other
//! orders on the two sides, so the bits may differ; the kernel does not promise the CPU's):
//!   f32: atol 1e-4, rtol 1e-3 (every tensor; the largest difference seen is about 1e-6).
//!   bf16, f16: the saved probabilities as f32 (f32 on both sides, from the same inputs);
//!   out, dq, dk, dv rtol 1e-3 + half a unit in the last place of the type (2⁻⁸ bf16, 2⁻¹¹
//!   f16: the GPU rounds its results to the type) and atol a share of the tensor's largest
//!   magnitude, 5e-3 bf16, 1e-3 f16. The share is for the backward's Δ = rowsum(dO ∘ O),
//!   which the GPU takes from its output rounded to the type (as FlashAttention does) and
//!   the CPU as rowsum(dP ∘ P) in f32: dq and dk then differ by up to 1.9e-3 (bf16) and
//!   2.8e-4 (f16) of their largest magnitude beyond the rounding, all of it that (the CPU's
//!   dq corrected for the Δ of the rounded output is within 2⁻⁸ of the GPU's). A wrong
//!   index, mask or barrier gives differences of the values' own size.
//!
//! Run on a machine with an NVIDIA GPU, or on the CPU's kernel emulator with
//! `AVA_CUDA_EMULATE=serial` (or `serial-reversed`, `lockstep`; ava-cuda-emu); with neither it
//! fails, saying so:
//!   source tools/cuda-build-env.sh   # where no CUDA toolkit is installed
//!   cargo test -p ava-plugins --features cuda --test gpu_attention
//!   AVA_CUDA_EMULATE=serial cargo test -p ava-plugins --features cuda --test gpu_attention

use ava_core::prelude::*;
use ava_kernels::testing::gpu::{Buffer, Gpu, gpu, stored, widened};
use ava_kernels::testing::{Rng, run_segmented, segments, shape};
use ava_plugins::builtin::standard::Standard;

/// The element type of q, k, v, out, dout, dq, dk, dv in a run (the saved probabilities and
/// the workspace are f32 in every one).
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

    /// `x` as stored bits in 4 bytes or 2 (rounded to nearest; the test's inputs are exact in
    /// every type, see [`inputs`]).
    fn store(self, x: &[f32]) -> Vec<u8> {
        stored(self.dtype(), x)
    }

    fn load(self, b: &[u8]) -> Vec<f32> {
        widened(self.dtype(), b)
    }

    /// The tolerance of `tensor` (see the header): (whether atol is a share of the tensor's
    /// largest magnitude rather than absolute, atol, rtol).
    fn tolerance(self, tensor: &str) -> (bool, f32, f32) {
        match (self, tensor) {
            (Ty::F32, _) | (_, "saved") => (false, 1e-4, 1e-3),
            (Ty::Bf16, _) => (true, 5e-3, 1e-3 + 1.0 / 256.0),
            (Ty::F16, _) => (true, 1e-3, 1e-3 + 1.0 / 2048.0),
        }
    }
}

/// q, k, v, dout in [-1, 1]: for f32 the generator's values, for bf16 and f16 multiples of
/// 2⁻⁸ (exact in both), so the two sides see the same values.
fn inputs(s: &AttnShape, ty: Ty, seed: u64) -> [Vec<f32>; 4] {
    let mut rng = Rng(seed);
    let (nq, nk) = (s.q_numel(), s.kv_numel());
    let x = [rng.vec(nq), rng.vec(nk), rng.vec(nk), rng.vec(nq)];
    if ty == Ty::F32 { x } else { x.map(|x| x.into_iter().map(|v| (v * 256.0).round() / 256.0).collect()) }
}

/// out, saved, dq, dk, dv, widened to f32.
type Outputs = [Vec<f32>; 5];

/// The tensors of [`Outputs`], by name.
const TENSORS: [&str; 5] = ["out", "saved", "dq", "dk", "dv"];

/// `len` elements of `size` bytes filled with 0xff bytes: NaN in every type.
fn nan(gpu: &Gpu, len: usize, size: usize) -> Buffer<u8> {
    gpu.upload(&vec![0xffu8; len * size])
}

/// The kernel's device forward and backward on `x`, with the saved buffer and workspaces of
/// the lengths it declares for the device, outputs and workspaces NaN-filled.
fn on_gpu(gpu: &Gpu, s: &AttnShape, ty: Ty, segments: &[u32], x: &[Vec<f32>; 4]) -> Result<Outputs, String> {
    let ctx = KernelContext { threads: 1, device: Device::Cuda };
    let (dt, size) = (ty.dtype(), ty.dtype().size());
    let (nq, nk) = (s.q_numel(), s.kv_numel());
    let saved_len = Standard.saved_len(s).map_err(|e| format!("saved_len: {e}"))? as usize;
    let ws_len = |pass: Pass| -> Result<usize, String> {
        Standard.workspace_len(s, pass, &ctx).map(|n| n as usize).map_err(|e| format!("workspace_len: {e}"))
    };
    let (fwd_ws, bwd_ws) = (ws_len(Pass::Forward)?, ws_len(Pass::Backward)?);
    // q, dout (B, H, Tq, D); k, v (B, Hkv, Tk, D)
    let [q, k, v, dout] = x.each_ref().map(|x| gpu.upload(&ty.store(x)));
    let (out, dq) = (nan(gpu, nq, size), nan(gpu, nq, size)); // (B, H, Tq, D)
    let (dk, dv) = (nan(gpu, nk, size), nan(gpu, nk, size)); // (B, Hkv, Tk, D)
    let saved = nan(gpu, saved_len, 4); // (B, H, Tq, Tk) f32
    let (ws_f, ws_b) = (nan(gpu, fwd_ws, 4), nan(gpu, bwd_ws, 4)); // (declared,) f32
    let segs = gpu.upload(segments); // (B, Tk) u32, or one unused element
    let stream = gpu.stream();
    let t = |b: &Buffer<u8>, n: usize| gpu.buf(b, n, dt);
    let f = |b: &Buffer<u8>, n: usize| gpu.buf(b, n, DType::F32);
    let seg = gpu.buf(&segs, segments.len(), DType::U32);
    let (bq, bk, bv, bo) = (t(&q, nq), t(&k, nk), t(&v, nk), t(&out, nq));
    let bs = f(&saved, saved_len);
    Standard
        .forward_cuda(s, &bq, &bk, &bv, &seg, &bo, &bs, &f(&ws_f, fwd_ws), &ctx, &stream)
        .map_err(|e| format!("forward_cuda: {e}"))?;
    Standard
        .backward_cuda(
            s,
            &bq,
            &bk,
            &bv,
            &seg,
            &bo,
            &t(&dout, nq),
            &bs,
            &t(&dq, nq),
            &t(&dk, nk),
            &t(&dv, nk),
            &f(&ws_b, bwd_ws),
            &ctx,
            &stream,
        )
        .map_err(|e| format!("backward_cuda: {e}"))?;
    let load = |b: &Buffer<u8>, ty: Ty| ty.load(&gpu.download(b));
    Ok([load(&out, ty), load(&saved, Ty::F32), load(&dq, ty), load(&dk, ty), load(&dv, ty)])
}

/// The kernel's CPU forward and backward on the same values (outputs NaN-filled too).
fn on_cpu(s: &AttnShape, segments: &[u32], [q, k, v, dout]: &[Vec<f32>; 4]) -> Result<Outputs, String> {
    let (out, saved, [dq, dk, dv]) = run_segmented(&Standard, s, segments, (q, k, v, dout), 2)?;
    Ok([out, saved, dq, dk, dv])
}

/// Every element of each tensor within its tolerance, or a line per tensor that is not: how
/// many differ, the worst (index and both values).
fn compare(ty: Ty, got: &Outputs, want: &Outputs) -> Result<(), String> {
    let mut problems = Vec::new();
    for ((name, g), w) in TENSORS.iter().zip(got).zip(want) {
        let (relative, atol, rtol) = ty.tolerance(name);
        let atol = if relative { atol * w.iter().fold(0f32, |m, x| m.max(x.abs())) } else { atol };
        let (mut bad, mut worst) = (0usize, None::<(usize, f32)>);
        for (i, (&a, &b)) in g.iter().zip(w).enumerate() {
            // NaN (an element left unwritten) is the worst difference there is.
            let excess = if a.is_nan() || b.is_nan() { f32::INFINITY } else { (a - b).abs() - rtol * b.abs() };
            if excess > atol {
                bad += 1;
                if worst.is_none_or(|(_, e)| excess > e) {
                    worst = Some((i, excess));
                }
            }
        }
        if g.len() != w.len() {
            problems.push(format!("{name}: {} elements against {}", g.len(), w.len()));
        } else if let Some((i, _)) = worst {
            problems.push(format!("{name}: {bad} of {} differ, worst [{i}]: GPU {:e}, CPU {:e}", g.len(), g[i], w[i]));
        }
    }
    if problems.is_empty() { Ok(()) } else { Err(problems.join("\n  ")) }
}

/// (B, H, Hkv, Tq, Tk, D, causal, packed documents).
type Case = (u32, u32, u32, u32, u32, u32, bool, bool);

/// Causal and full; GQA 2 and 4; Tq < Tk (with and without a mask, documents, more keys than
/// a block's threads); packed documents; D 64 and 128; no length a multiple of 32, and Tq
/// past the CPU's 64-row blocks once.
const CASES: &[Case] = &[
    (1, 2, 2, 37, 37, 64, true, false),
    (2, 2, 2, 45, 45, 128, false, false),
    (1, 4, 2, 67, 67, 64, true, false),
    (2, 4, 1, 19, 19, 128, true, false),
    (1, 4, 1, 23, 23, 64, false, false),
    (1, 2, 1, 13, 70, 64, true, false),
    (1, 2, 2, 5, 29, 128, false, false),
    (1, 2, 1, 6, 150, 64, true, false),
    (2, 2, 1, 41, 41, 64, true, true),
    (1, 2, 2, 30, 30, 128, false, true),
    (1, 4, 2, 9, 23, 64, true, true),
];

fn describe(ty: Ty, s: &AttnShape, documents: bool) -> String {
    format!(
        "{ty:?} B {} H {}/{} Tq {} Tk {} D {} causal {} documents {documents}",
        s.batch, s.q_heads, s.kv_heads, s.q_len, s.kv_len, s.head_dim, s.causal
    )
}

/// Every case in every type on both sides; all the cases that differ are reported.
#[test]
fn the_gpu_matches_the_cpu() {
    let gpu = gpu();
    let mut failures = Vec::new();
    let mut compared = 0;
    for (n, &(b, h, hkv, tq, tk, d, causal, documents)) in CASES.iter().enumerate() {
        let s = shape(b, h, hkv, tq, tk, d, causal);
        let ids = if documents { segments(&s, 40 + n as u64) } else { Vec::new() };
        for ty in [Ty::F32, Ty::Bf16, Ty::F16] {
            let what = describe(ty, &s, documents);
            let x = inputs(&s, ty, 7 + n as u64);
            let result = on_cpu(&s, &ids, &x)
                .map_err(|e| format!("the CPU: {e}"))
                .and_then(|want| Ok((on_gpu(&gpu, &s, ty, &ids, &x)?, want)))
                .and_then(|(got, want)| compare(ty, &got, &want));
            if let Err(e) = result {
                failures.push(format!("{what}:\n  {e}"));
            }
            compared += 1;
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {compared} case(s) differ from the CPU:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// attention.cu sums dK and dV over the rows in a fixed order (no atomics): two runs on the
/// same inputs give the same bits. Meaningful on a GPU, where blocks race; the emulator is
/// deterministic in any one order.
#[test]
fn two_runs_give_the_same_bits() {
    let gpu = gpu();
    let s = shape(2, 4, 2, 21, 21, 64, true);
    let x = inputs(&s, Ty::Bf16, 3);
    let first = on_gpu(&gpu, &s, Ty::Bf16, &[], &x).unwrap();
    let second = on_gpu(&gpu, &s, Ty::Bf16, &[], &x).unwrap();
    for ((name, a), b) in TENSORS.iter().zip(&first).zip(&second) {
        let differ = a.iter().zip(b).position(|(a, b)| a.to_bits() != b.to_bits());
        assert!(differ.is_none(), "{name} differs between two runs at {}", differ.unwrap());
    }
}

/// Buffers of the wrong length or type, and a head dimension past the kernels' shared
/// memory, are refused by name before anything is launched: the NaN-filled outputs are
/// untouched afterwards.
#[test]
fn a_buffer_of_the_wrong_size_is_refused_before_any_launch() {
    let gpu = gpu();
    let s = shape(1, 2, 1, 5, 7, 64, true);
    let ctx = KernelContext { threads: 1, device: Device::Cuda };
    let (nq, nk, np) = (s.q_numel(), s.kv_numel(), Standard.saved_len(&s).unwrap() as usize);
    let device_ws = Standard.workspace_len(&s, Pass::Backward, &ctx).unwrap() as usize;
    let cpu_ws = Standard.workspace_len(&s, Pass::Backward, &KernelContext::default()).unwrap() as usize;
    assert_ne!(device_ws, cpu_ws, "the shape should tell the device's workspace from the CPU's");
    let x = inputs(&s, Ty::F32, 1);
    // q, dout (B, H, Tq, D); k, v (B, Hkv, Tk, D)
    let [q, k, v, dout] = x.each_ref().map(|x| gpu.upload(x));
    let (out, dq) = (gpu.upload(&vec![f32::NAN; nq]), gpu.upload(&vec![f32::NAN; nq])); // (B, H, Tq, D)
    let (dk, dv) = (gpu.upload(&vec![f32::NAN; nk]), gpu.upload(&vec![f32::NAN; nk])); // (B, Hkv, Tk, D)
    let saved = gpu.upload(&vec![f32::NAN; np]); // (B, H, Tq, Tk)
    let ws = gpu.upload(&vec![f32::NAN; device_ws.max(cpu_ws)]); // (the larger declaration,)
    let f = |b: &Buffer<f32>, n: usize| gpu.buf(b, n, DType::F32);
    let (bq, bk, bv, bo, bdout) = (f(&q, nq), f(&k, nk), f(&v, nk), f(&out, nq), f(&dout, nq));
    let (bs, bdq, bdk, bdv) = (f(&saved, np), f(&dq, nq), f(&dk, nk), f(&dv, nk));
    let none = CudaBuf::empty(DType::U32, 0);
    let stream = gpu.stream();
    let forward = |k: &CudaBuf, seg: &CudaBuf, saved: &CudaBuf| {
        Standard.forward_cuda(&s, &bq, k, &bv, seg, &bo, saved, &f(&ws, 0), &ctx, &stream).unwrap_err().to_string()
    };
    let backward = |dk: &CudaBuf, ws_len: usize| {
        Standard
            .backward_cuda(&s, &bq, &bk, &bv, &none, &bo, &bdout, &bs, &bdq, dk, &bdv, &f(&ws, ws_len), &ctx, &stream)
            .unwrap_err()
            .to_string()
    };

    let err = forward(&bk, &none, &f(&saved, np - 1));
    assert!(err.contains("saved has 69 f32 elements, expected 70 f32"), "{err}");
    let err = forward(&CudaBuf { dtype: DType::BF16, ..bk }, &none, &bs);
    assert!(err.contains("k has 448 bf16 elements, expected 448 f32"), "{err}");
    let seg = gpu.upload(&[0u32; 6]);
    let err = forward(&bk, &gpu.buf(&seg, 6, DType::U32), &bs);
    assert!(err.contains("segments has 6 u32 elements, expected 7 u32"), "{err}");
    // The CPU's declaration of the backward's workspace, not the device's.
    let err = backward(&bdk, cpu_ws);
    assert!(err.contains(&format!("workspace has {cpu_ws} f32 elements, expected {device_ws} f32")), "{err}");
    let err = backward(&f(&dk, nk - 1), device_ws);
    assert!(err.contains("dk has 447 f32 elements, expected 448 f32"), "{err}");
    // A head dimension past the row kernels' shared memory (MAX_D = 256).
    let wide = shape(1, 1, 1, 1, 1, 257, false);
    let (q1, o1, p1) = (gpu.upload(&[0f32; 257]), gpu.upload(&[f32::NAN; 257]), gpu.upload(&[f32::NAN]));
    let (b1, bo1) = (f(&q1, 257), f(&o1, 257));
    let err =
        Standard.forward_cuda(&wide, &b1, &b1, &b1, &none, &bo1, &f(&p1, 1), &f(&ws, 0), &ctx, &stream).unwrap_err();
    assert_eq!(err.kind, ErrorKind::Unsupported, "{err}");
    assert!(err.to_string().contains("head dimensions up to 256, got 257"), "{err}");

    for (name, b) in [("out", &out), ("saved", &saved), ("dq", &dq), ("dk", &dk), ("dv", &dv), ("out (D 257)", &o1)] {
        let v = gpu.download(b);
        assert!(v.iter().all(|x| x.is_nan()), "{name} was written by a call that was refused");
    }
}
