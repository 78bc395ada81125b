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
//! The cases' shapes are drawn, not picked: a fixed handful of shapes once left the causal
//! diagonal's offset Tk − Tq at a few residues mod 16 (a warp's rows) and mod 64 (a tile's),
//! and a one-key over-reach in the tensor-core kernels' whole-tile test passed every case.
//! Each run draws Tq, Tk, the head dimension, GQA, the batch, the mask and packed documents'
//! lengths from one seed, fixed so CI runs the same cases every time; `AVA_TEST_SEED=N`
//! draws others, and a failure's message gives the seed that replays it.
//!
//! Tolerances, as a share of each tensor's largest magnitude: bf16 1e-2, f16 1.5e-3 (the
//! kernels round P and dS to the input type before the tensor-core products, as
//! FlashAttention-2 does; the CPU keeps them in f32), f32 (CUDA-core kernels) 1e-6; the
//! logsumexps 1e-5 in every type (f32 on both sides); and in every tensor, differences
//! below [`ROUNDING`]. A wrong fragment layout, tile offset or mask gives errors of the
//! values' own size.

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
    /// tensor-core products (the largest seen in twelve seeds' drawn cases: 5.5e-3, 7.9e-4,
    /// 7.8e-7).
    fn tolerance(self) -> f32 {
        match self {
            Ty::F32 => 1e-6,
            Ty::Bf16 => 1e-2,
            Ty::F16 => 1.5e-3,
        }
    }
}

/// A difference every tensor may have, whatever its largest magnitude: a few roundings of f32
/// sums of values in [-1, 1) (an ulp of 1 is 1.2e-7). A query that sees one key has P = 1
/// and dS = P ∘ (dP − Δ) = 0 up to the rounding of dP and Δ (8.4e-8 seen in dK),
/// so where most queries see one key (packed documents of a token or two) dQ's and dK's
/// largest values can be that small too, and a share of them means nothing (f32's share,
/// 1e-6, is a few ulps). Where every query sees one key, dQ and dK are that rounding only:
/// such shapes are drawn again ([`some_query_sees_two_keys`]).
const ROUNDING: f32 = 3e-7;

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
        let scale = w.iter().filter(|x| x.is_finite()).fold(0f32, |m, x| m.max(x.abs()));
        let bound = (if *name == "lse" { 1e-5 } else { ty.tolerance() } * scale).max(ROUNDING);
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

/// A case: the element type, the shape, the documents' ids (B·Tk, or none).
type Case = (Ty, AttnShape, Vec<u32>);

/// Runs each case through the emulated GPU kernels and the CPU's, and reports every case
/// that differs (not only the first), with the seed the cases and their inputs were drawn
/// from.
fn check(cases: &[Case], serial_too: bool, seed: u64) {
    let mut failures = Vec::new();
    for (i, (ty, s, segments)) in cases.iter().enumerate() {
        let what = format!(
            "case {i}: {ty:?} B {} H {}/{} Tq {} Tk {} D {} causal {} documents {}",
            s.batch,
            s.q_heads,
            s.kv_heads,
            s.q_len,
            s.kv_len,
            s.head_dim,
            s.causal,
            document_lengths(s, segments)
        );
        let ty = *ty;
        let x = inputs(s, ty, seed ^ (17 + i as u64));
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
                    if again.iter().flatten().map(|v| v.to_bits()).eq(got.iter().flatten().map(|v| v.to_bits())) => {}
                Ok(_) => failures
                    .push(format!("{what}: the {order:?} order gave other bits than the lockstep order: a race")),
                Err(e) => failures.push(format!("{what} ({order:?} order): {e}")),
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} case(s) differ from the CPU (drawn from seed {seed}: {SEED}={seed} draws them again):\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

/// The variable that picks the seed the cases are drawn from (a u64).
const SEED: &str = "AVA_TEST_SEED";

/// The seed of every drawn case and input here: `$AVA_TEST_SEED` when set (to draw other
/// cases, or to replay a failure's, whose message gives its seed), else a fixed one, so CI
/// runs the same cases every time.
fn seed() -> u64 {
    match std::env::var(SEED) {
        Ok(v) if !v.trim().is_empty() => {
            v.trim().parse().unwrap_or_else(|_| panic!("{SEED}={v:?} is not a seed (an integer below 2^64)"))
        }
        _ => 0x0a7a_f1a5,
    }
}

/// A number in `lo..=hi`, drawn.
fn between(rng: &mut Rng, lo: u32, hi: u32) -> u32 {
    lo + (rng.next_u64() % u64::from(hi - lo + 1)) as u32
}

/// A head dimension: mostly a bucket's full width (32, 64, 96, 128: no padding), else any up
/// to 128 (padded to its 32-column bucket; below 8 or not a multiple of 8 the kernels load
/// tiles element by element).
fn head_dim(rng: &mut Rng) -> u32 {
    if rng.next_u64().is_multiple_of(4) { between(rng, 1, 128) } else { 32 * between(rng, 1, 4) }
}

/// (H, Hkv): one or two key/value heads, each shared by 1 to `most_group` query heads
/// (grouped-query attention, whose dK and dV are the shares flash_bwd_kv_sum adds).
fn heads(rng: &mut Rng, most_group: u32) -> (u32, u32) {
    let hkv = between(rng, 1, 2);
    (hkv * between(rng, 1, most_group), hkv)
}

/// Document ids for (B, Tk): each sequence's documents of random lengths (up to a cap drawn
/// per sequence, 1 to Tk: many short documents or a few long ones), numbered from 0.
fn documents(rng: &mut Rng, b: u32, tk: u32) -> Vec<u32> {
    let mut ids = Vec::with_capacity((b * tk) as usize);
    for _ in 0..b {
        let cap = between(rng, 1, tk);
        let (mut id, mut left) = (0, between(rng, 1, cap));
        for _ in 0..tk {
            if left == 0 {
                id += 1;
                left = between(rng, 1, cap);
            }
            ids.push(id);
            left -= 1;
        }
    }
    ids
}

/// The documents' lengths in each sequence, for a failure's message: `none`, or `[3 40 …]`.
fn document_lengths(s: &AttnShape, segments: &[u32]) -> String {
    if segments.is_empty() {
        return "none".into();
    }
    let seqs = segments.chunks(s.kv_len as usize).map(|row| {
        let lengths = row.chunk_by(|a, b| a == b).map(|d| d.len().to_string());
        format!("[{}]", lengths.collect::<Vec<_>>().join(" "))
    });
    seqs.collect::<Vec<_>>().join(" ")
}

/// A case of any shape the launcher takes with this mask, in `ty`, up to `most` queries and
/// keys: Tq > Tk too where neither `causal` nor `packed` (packed documents, of drawn lengths)
/// rules it out, GQA (groups of 1 to 3), one or two sequences, any head dimension. Drawn
/// again while every query would see one key only ([`some_query_sees_two_keys`]).
fn any_case(rng: &mut Rng, ty: Ty, most: u32, causal: bool, packed: bool) -> Case {
    loop {
        let tq = between(rng, 1, most);
        // Causal attention and packed documents need Tq <= Tk (the queries are the last keys).
        let tk = if causal || packed { between(rng, tq, most) } else { between(rng, 1, most) };
        let b = between(rng, 1, 2);
        let (h, hkv) = heads(rng, 3);
        let s = shape(b, h, hkv, tq, tk, head_dim(rng), causal);
        let segments = if packed { documents(rng, b, tk) } else { vec![] };
        if some_query_sees_two_keys(&s, &segments) {
            return (ty, s, segments);
        }
    }
}

/// Whether some query sees two keys or more. Where every query sees one key only (Tk = 1, or
/// documents of one token), dQ and dK are 0 in exact arithmetic (P = 1, so dS = dP − Δ = 0):
/// both sides give what rounding leaves of dP − Δ, which a tolerance relative to the
/// tensor's largest value cannot judge.
fn some_query_sees_two_keys(s: &AttnShape, segments: &[u32]) -> bool {
    let (tq, tk) = (s.q_len as usize, s.kv_len as usize);
    if segments.is_empty() {
        return tk >= 2; // the last query sees every key
    }
    segments
        .chunks(tk)
        .any(|ids| (tk - tq..tk).any(|p| (0..tk).filter(|&j| ids[j] == ids[p] && (!s.causal || j <= p)).count() >= 2))
}

/// Bf16 or f16, drawn.
fn half(rng: &mut Rng) -> Ty {
    if rng.next_u64().is_multiple_of(2) { Ty::Bf16 } else { Ty::F16 }
}

/// Shapes of every kind, drawn ([`any_case`]): up to 150 queries and keys (single, several
/// and partial 64-row tiles), six cases of each mask (causal or not, packed documents or
/// not), in bf16 or f16.
#[test]
fn the_tensor_core_kernels_match_the_cpu() {
    let seed = seed();
    let mut rng = Rng(seed ^ 1);
    let cases: Vec<_> = (0..24)
        .map(|i| {
            let ty = half(&mut rng);
            any_case(&mut rng, ty, 150, i % 2 == 0, i % 4 >= 2)
        })
        .collect();
    check(&cases, false, seed);
}

/// The causal diagonal against the kernels' tiles. A warp's tile wholly below the diagonal
/// skips the mask (the forward's and dQ's 16-query warps against 64-key tiles, dK/dV's 16-key
/// warps against 64-query tiles), so an off-by-one in that test shows only where the
/// diagonal (query i's last key, i + Tk − Tq) meets a warp's first or last row at a tile's
/// edge: at one offset Tk − Tq mod 16. Two cases for each of the 16, one in bf16 and one in
/// f16 (bf16's tolerance can miss one key's share of a dQ row, f16's is 7× tighter):
/// Tk − Tq = r + 16·u, u drawn 0 to 3, so the diagonal also meets the 64-wide tiles at as
/// many places mod 64; 80 queries or more, so for every offset the warp whose shortcut sits
/// at a tile's edge exists (two query tiles, two key tiles or more); no documents (they
/// always take the mask); the rest drawn.
#[test]
fn the_causal_diagonal_meets_the_tiles_at_every_offset() {
    let seed = seed();
    let mut rng = Rng(seed ^ 2);
    let mut cases = Vec::new();
    for r in 0..16 {
        for ty in [Ty::Bf16, Ty::F16] {
            let tq = between(&mut rng, 80, 136);
            let tk = tq + r + 16 * between(&mut rng, 0, 3);
            let (h, hkv) = heads(&mut rng, 2);
            cases.push((ty, shape(1, h, hkv, tq, tk, head_dim(&mut rng), true), vec![]));
        }
    }
    check(&cases, false, seed);
}

#[test]
fn the_tensor_core_kernels_have_no_race_between_threads() {
    let cases =
        [(Ty::Bf16, shape(1, 4, 2, 72, 72, 64, true), vec![]), (Ty::Bf16, shape(1, 2, 2, 64, 64, 128, false), vec![])];
    check(&cases, true, seed());
}

/// The f32 kernels (32 × 32 tiles on the CUDA cores) on drawn shapes ([`any_case`]), up to 80
/// queries and keys, three cases of each mask, in the three orders.
#[test]
fn the_f32_kernels_match_the_cpu() {
    let seed = seed();
    let mut rng = Rng(seed ^ 3);
    let cases: Vec<_> = (0..12).map(|i| any_case(&mut rng, Ty::F32, 80, i % 2 == 0, i % 4 >= 2)).collect();
    check(&cases, true, seed);
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
