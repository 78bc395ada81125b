//! The built-in attention kernel `standard`: dense scaled-dot-product attention on CPU f32
//! buffers, the reference every other kernel is tested against.
//!
//! ```text
//! S = scale · Q Kᵀ            masked when causal: query i sees keys j <= i + (Tk − Tq)
//! P = softmax(S) row by row   saved for backward: B·H·Tq·Tk f32 (the O(T²) memory flash avoids)
//! O = P V
//! ```
//!
//! Backward, from the saved `P`:
//!
//! ```text
//! dV = Pᵀ dO    dP = dO Vᵀ    dS = P ∘ (dP − rowsum(dP ∘ P))    dQ = scale · dS K    dK = scale · dSᵀ Q
//! ```
//!
//! The products run through `gemm` (single-threaded per task) on blocks of 64 query rows; a
//! causal block multiplies only the keys its last row can see, which halves the work.
//!
//! Grouped-query attention: query head `h` reads key/value head `h / (H / Hkv)`, so dK and dV
//! sum over the query heads of a group. Work is split over (batch, head) for forward and over
//! (batch, kv head) for backward, one task per thread-owned slice of the outputs, so results do
//! not depend on the thread count.

use ava_core::{error::expect_len, prelude::*};

/// Dense attention that saves the probabilities. No options.
#[derive(Debug, Clone, Copy, Default)]
pub struct Standard;

impl Plugin for Standard {
    fn manifest() -> Manifest {
        Manifest::new(
            "standard",
            PluginKind::Attention,
            env!("CARGO_PKG_VERSION"),
            "dense scaled-dot-product attention (causal, GQA); saves the Tq×Tk probabilities for backward",
        )
    }

    fn from_options(options: Options) -> Result<Self, PluginError> {
        options.finish()?;
        Ok(Standard)
    }
}

/// The shape as `usize`s, checked once per call.
#[derive(Debug, Clone, Copy)]
struct Dims {
    heads: usize,
    group: usize,
    tq: usize,
    tk: usize,
    d: usize,
    causal: bool,
    scale: f32,
}

impl Dims {
    fn new(shape: &AttnShape) -> Result<Self, PluginError> {
        shape.validate()?;
        if shape.kv_len == 0 && shape.q_len > 0 {
            // A softmax over no keys is undefined; refuse rather than return zeros.
            return Err(PluginError::invalid_input("attention over zero keys (kv_len = 0) is undefined"));
        }
        Ok(Self {
            heads: shape.q_heads as usize,
            group: shape.group(),
            tq: shape.q_len as usize,
            tk: shape.kv_len as usize,
            d: shape.head_dim as usize,
            causal: shape.causal,
            scale: shape.scale,
        })
    }

    /// Query row `i` sees keys `0..visible(i)` (never 0 keys: `validate` ensures Tq <= Tk when causal).
    fn visible(&self, i: usize) -> usize {
        if self.causal { i + (self.tk - self.tq) + 1 } else { self.tk }
    }

    /// One (batch, query head): fills its output rows and probabilities, `ROWS` query rows
    /// at a time; a causal block only multiplies the keys its last row can see.
    /// `bh = b·H + h`; its key/value block is `b·Hkv + h / group`.
    fn forward_head(&self, bh: usize, q: &[f32], k: &[f32], v: &[f32], out: &mut [f32], probs: &mut [f32]) {
        let (tq, tk, d) = (self.tq, self.tk, self.d);
        let (b, h) = (bh / self.heads, bh % self.heads);
        let kvh = b * (self.heads / self.group) + h / self.group;
        let q = &q[bh * tq * d..][..tq * d]; // (Tq, D)
        let k = &k[kvh * tk * d..][..tk * d]; // (Tk, D)
        let v = &v[kvh * tk * d..][..tk * d]; // (Tk, D)
        for i0 in (0..tq).step_by(ROWS) {
            let rows = ROWS.min(tq - i0);
            let n_max = self.visible(i0 + rows - 1);
            let p = &mut probs[i0 * tk..][..rows * tk]; // (rows, Tk)
            // S = scale · Q Kᵀ over the visible keys.
            let q_blk = Mat { data: &q[i0 * d..][..rows * d], rs: d as isize, cs: 1 }; // (rows, D)
            let k_t = Mat { data: &k[..n_max * d], rs: 1, cs: d as isize }; // (D, n_max)
            matmul(rows, n_max, d, p, tk, q_blk, k_t, self.scale, false);
            for r in 0..rows {
                let n = self.visible(i0 + r);
                let row = &mut p[r * tk..][..tk]; // (Tk,)
                let max = row[..n].iter().copied().fold(f32::NEG_INFINITY, f32::max);
                // Subtracting the row max keeps exp() from overflowing; it cancels in the ratio.
                // The exps and the sum are separate loops so the first vectorizes; the sum
                // runs in 8 lanes for the same reason.
                for s in &mut row[..n] {
                    *s = ava_core::math::exp(*s - max);
                }
                let sum = lane_sum(&row[..n]);
                let inv = 1.0 / sum;
                for x in &mut row[..n] {
                    *x *= inv;
                }
                row[n..].fill(0.0); // masked keys have probability 0
            }
            // O = P V.
            let p_blk = Mat { data: &p[..(rows - 1) * tk + n_max], rs: tk as isize, cs: 1 }; // (rows, n_max)
            let v_blk = Mat { data: &v[..n_max * d], rs: d as isize, cs: 1 }; // (n_max, D)
            matmul(rows, d, n_max, &mut out[i0 * d..][..rows * d], d, p_blk, v_blk, 1.0, false);
        }
    }

    /// One (batch, kv head) `g = b·Hkv + kh`: the dQ rows of its `group` query heads
    /// (`bh = g·group + r`, contiguous in (B, H, Tq, D)) and its dK, dV blocks, `ROWS` query
    /// rows at a time (the dP scratch is ROWS × Tk, not Tq × Tk).
    fn backward_group(&self, g: usize, x: &BackwardInputs<'_>, dq: &mut [f32], dk: &mut [f32], dv: &mut [f32]) {
        let (tq, tk, d) = (self.tq, self.tk, self.d);
        dq.fill(0.0); // (group, Tq, D)
        dk.fill(0.0); // (Tk, D)
        dv.fill(0.0); // (Tk, D)
        let k = &x.k[g * tk * d..][..tk * d]; // (Tk, D)
        let v = &x.v[g * tk * d..][..tk * d]; // (Tk, D)
        let mut ds = vec![0.0f32; ROWS.min(tq) * tk]; // (ROWS, Tk): dP, then dS in place
        for r in 0..self.group {
            let bh = g * self.group + r;
            let q = &x.q[bh * tq * d..][..tq * d]; // (Tq, D)
            let dout = &x.dout[bh * tq * d..][..tq * d]; // (Tq, D)
            let probs = &x.saved[bh * tq * tk..][..tq * tk]; // (Tq, Tk)
            let dq = &mut dq[r * tq * d..][..tq * d]; // (Tq, D)
            for i0 in (0..tq).step_by(ROWS) {
                let rows = ROWS.min(tq - i0);
                let n_max = self.visible(i0 + rows - 1);
                let do_blk = Mat { data: &dout[i0 * d..][..rows * d], rs: d as isize, cs: 1 }; // (rows, D)
                let p = &probs[i0 * tk..][..rows * tk]; // (rows, Tk)
                // dP = dO Vᵀ over the visible keys.
                let v_t = Mat { data: &v[..n_max * d], rs: 1, cs: d as isize }; // (D, n_max)
                matmul(rows, n_max, d, &mut ds, tk, do_blk, v_t, 1.0, false);
                // dS = P ∘ (dP − rowsum(dP ∘ P)) (softmax backward); masked entries are 0.
                for row in 0..rows {
                    let n = self.visible(i0 + row);
                    let (p_row, ds_row) = (&p[row * tk..][..n_max], &mut ds[row * tk..][..n_max]);
                    let row_dot: f32 = p_row[..n].iter().zip(&ds_row[..n]).map(|(p, dp)| p * dp).sum();
                    for (dsj, &pj) in ds_row[..n].iter_mut().zip(&p_row[..n]) {
                        *dsj = pj * (*dsj - row_dot);
                    }
                    ds_row[n..].fill(0.0);
                }
                let span = (rows - 1) * tk + n_max;
                let ds_blk = Mat { data: &ds[..span], rs: tk as isize, cs: 1 }; // (rows, n_max)
                let ds_t = Mat { data: &ds[..span], rs: 1, cs: tk as isize }; // (n_max, rows)
                let p_t = Mat { data: &p[..span], rs: 1, cs: tk as isize }; // (n_max, rows)
                let k_blk = Mat { data: &k[..n_max * d], rs: d as isize, cs: 1 }; // (n_max, D)
                let q_blk = Mat { data: &q[i0 * d..][..rows * d], rs: d as isize, cs: 1 }; // (rows, D)
                // dQ = scale · dS K;  dK += scale · dSᵀ Q;  dV += Pᵀ dO.
                matmul(rows, d, n_max, &mut dq[i0 * d..][..rows * d], d, ds_blk, k_blk, self.scale, false);
                matmul(n_max, d, rows, &mut dk[..n_max * d], d, ds_t, q_blk, self.scale, true);
                matmul(n_max, d, rows, &mut dv[..n_max * d], d, p_t, do_blk, 1.0, true);
            }
        }
    }
}

/// Query rows per block: enough for gemm to reach full speed, small enough to keep the
/// backward's dP scratch at ROWS × Tk.
const ROWS: usize = 64;

/// A read-only strided matrix view: element (i, j) is `data[i·rs + j·cs]`.
#[derive(Clone, Copy)]
struct Mat<'a> {
    data: &'a [f32],
    rs: isize,
    cs: isize,
}

impl Mat<'_> {
    /// Whether every element of an `rows × cols` matrix lies inside `data`.
    fn fits(&self, rows: usize, cols: usize) -> bool {
        rows == 0
            || cols == 0
            || ((rows - 1) as isize * self.rs + (cols - 1) as isize * self.cs) < self.data.len() as isize
    }
}

/// `dst (m × n, row stride dst_rs) = beta · lhs (m × k) · rhs (k × n)`, added to `dst` when
/// `accumulate`. Single-threaded gemm: the kernel's tasks are already spread over threads,
/// and a fixed order keeps results independent of the thread count.
#[allow(clippy::too_many_arguments)]
fn matmul(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    dst_rs: usize,
    lhs: Mat<'_>,
    rhs: Mat<'_>,
    beta: f32,
    accumulate: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(lhs.fits(m, k) && rhs.fits(k, n), "attention matmul operand out of bounds");
    assert!((m - 1) * dst_rs + n <= dst.len(), "attention matmul destination out of bounds");
    if k == 0 {
        if !accumulate {
            for row in dst.chunks_mut(dst_rs).take(m) {
                row[..n].fill(0.0);
            }
        }
        return;
    }
    // SAFETY: the asserts above keep every element gemm reads or writes inside the slices;
    // `dst` is exclusively borrowed and does not overlap the shared `lhs`/`rhs`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            accumulate,
            lhs.data.as_ptr(),
            lhs.cs,
            lhs.rs,
            rhs.data.as_ptr(),
            rhs.cs,
            rhs.rs,
            1.0,
            beta,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    };
}

/// The read-only buffers of a backward call, bundled to keep signatures short.
struct BackwardInputs<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    dout: &'a [f32],
    saved: &'a [f32],
}

/// B·H·Tq·Tk, refusing shapes whose probability matrix does not fit in an address space.
fn probs_len(shape: &AttnShape) -> Result<u64, PluginError> {
    [shape.q_heads, shape.q_len, shape.kv_len]
        .iter()
        .try_fold(u64::from(shape.batch), |acc, &x| acc.checked_mul(u64::from(x)))
        .filter(|&n| usize::try_from(n).is_ok())
        .ok_or_else(|| {
            PluginError::invalid_input(format!("attention probabilities for {shape:?} do not fit in memory"))
        })
}

/// Σ x, summed in 8 interleaved lanes (vectorizes; a fixed order, so deterministic).
fn lane_sum(x: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l += v;
        }
    }
    lanes.iter().sum::<f32>() + chunks.remainder().iter().sum::<f32>()
}

/// Runs `work` on every item, splitting the items into at most `threads` contiguous runs, one
/// per scoped thread (the calling thread takes the first). Each item owns its output slices,
/// so the result is the same for any thread count.
fn parallel<T: Send>(items: Vec<T>, threads: u32, work: impl Fn(T) + Sync) {
    let threads = (threads.max(1) as usize).min(items.len());
    if threads <= 1 {
        items.into_iter().for_each(work);
        return;
    }
    let per = items.len().div_ceil(threads);
    let mut runs = Vec::with_capacity(threads);
    let mut rest = items;
    while rest.len() > per {
        let tail = rest.split_off(per);
        runs.push(rest);
        rest = tail;
    }
    runs.push(rest);
    let work = &work;
    std::thread::scope(|s| {
        let mut runs = runs.into_iter();
        let first = runs.next();
        for run in runs {
            s.spawn(move || run.into_iter().for_each(work));
        }
        if let Some(run) = first {
            run.into_iter().for_each(work);
        }
    });
}

impl AttentionKernel for Standard {
    fn saved_len(&self, shape: &AttnShape) -> Result<u64, PluginError> {
        Dims::new(shape)?;
        probs_len(shape)
    }

    fn forward(
        &self,
        shape: &AttnShape,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: &mut [f32],
        saved: &mut [f32],
        ctx: &KernelContext,
    ) -> Result<(), PluginError> {
        shape.check_buffers(q.len(), k.len(), v.len(), out.len())?;
        let dims = Dims::new(shape)?;
        expect_len("saved", saved.len(), probs_len(shape)? as usize)?;
        if dims.tq == 0 {
            return Ok(()); // nothing to compute (and chunks of length 0 are not allowed)
        }
        // One task per (batch, query head): its output (Tq, D) and probabilities (Tq, Tk).
        let tasks: Vec<_> =
            out.chunks_mut(dims.tq * dims.d).zip(saved.chunks_mut(dims.tq * dims.tk)).enumerate().collect();
        parallel(tasks, ctx.threads, |(bh, (out, probs))| dims.forward_head(bh, q, k, v, out, probs));
        Ok(())
    }

    fn supports_backward(&self) -> bool {
        true
    }

    fn backward(
        &self,
        shape: &AttnShape,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: &[f32],
        dout: &[f32],
        saved: &[f32],
        dq: &mut [f32],
        dk: &mut [f32],
        dv: &mut [f32],
        ctx: &KernelContext,
    ) -> Result<(), PluginError> {
        shape.check_buffers(q.len(), k.len(), v.len(), out.len())?;
        let dims = Dims::new(shape)?;
        expect_len("saved", saved.len(), probs_len(shape)? as usize)?;
        expect_len("dout", dout.len(), shape.q_numel())?;
        expect_len("dq", dq.len(), shape.q_numel())?;
        expect_len("dk", dk.len(), shape.kv_numel())?;
        expect_len("dv", dv.len(), shape.kv_numel())?;
        if dims.tq == 0 {
            // No queries: no gradient flows to keys or values.
            dk.fill(0.0);
            dv.fill(0.0);
            return Ok(());
        }
        let (tq, tk, d) = (dims.tq, dims.tk, dims.d);
        let inputs = BackwardInputs { q, k, v, dout, saved };
        // One task per (batch, kv head): its group's dQ (group, Tq, D), its dK and dV (Tk, D).
        let tasks: Vec<_> = dq
            .chunks_mut(dims.group * tq * d)
            .zip(dk.chunks_mut(tk * d))
            .zip(dv.chunks_mut(tk * d))
            .enumerate()
            .collect();
        parallel(tasks, ctx.threads, |(g, ((dq, dk), dv))| dims.backward_group(g, &inputs, dq, dk, dv));
        Ok(())
    }
}

inventory::submit! { crate::builtin::Builtin::attention::<Standard>() }

#[cfg(test)]
mod tests {
    use super::*;

    /// splitmix64 (Steele, Lea & Flood 2014), for reproducible inputs without a rand crate.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
        /// Uniform in [-1, 1).
        fn uniform(&mut self) -> f32 {
            ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
        fn vec(&mut self, n: usize) -> Vec<f32> {
            (0..n).map(|_| self.uniform()).collect()
        }
    }

    fn shape(b: u32, h: u32, hkv: u32, tq: u32, tk: u32, d: u32, causal: bool) -> AttnShape {
        AttnShape {
            batch: b,
            q_heads: h,
            kv_heads: hkv,
            q_len: tq,
            kv_len: tk,
            head_dim: d,
            causal,
            scale: 1.0 / (d as f32).sqrt(),
        }
    }

    /// Straight from the definition in f64, with its own indexing: returns (out, probs).
    fn reference(s: &AttnShape, q: &[f64], k: &[f64], v: &[f64]) -> (Vec<f64>, Vec<f64>) {
        let (b_, h_, hkv, tq, tk, d) = (
            s.batch as usize,
            s.q_heads as usize,
            s.kv_heads as usize,
            s.q_len as usize,
            s.kv_len as usize,
            s.head_dim as usize,
        );
        let qi = |b: usize, h: usize, i: usize, x: usize| ((b * h_ + h) * tq + i) * d + x;
        let ki = |b: usize, h: usize, j: usize, x: usize| ((b * hkv + h) * tk + j) * d + x;
        let mut out = vec![0.0; b_ * h_ * tq * d];
        let mut probs = vec![0.0; b_ * h_ * tq * tk];
        for b in 0..b_ {
            for h in 0..h_ {
                let kh = h / (h_ / hkv);
                for i in 0..tq {
                    let scores: Vec<f64> = (0..tk)
                        .map(|j| {
                            if s.causal && j > i + tk - tq {
                                f64::NEG_INFINITY
                            } else {
                                s.scale as f64 * (0..d).map(|x| q[qi(b, h, i, x)] * k[ki(b, kh, j, x)]).sum::<f64>()
                            }
                        })
                        .collect();
                    let z: f64 = scores.iter().map(|s| s.exp()).sum();
                    for j in 0..tk {
                        let p = scores[j].exp() / z;
                        probs[((b * h_ + h) * tq + i) * tk + j] = p;
                        for x in 0..d {
                            out[qi(b, h, i, x)] += p * v[ki(b, kh, j, x)];
                        }
                    }
                }
            }
        }
        (out, probs)
    }

    fn f64s(x: &[f32]) -> Vec<f64> {
        x.iter().map(|&x| x as f64).collect()
    }

    fn run_forward(s: &AttnShape, q: &[f32], k: &[f32], v: &[f32], threads: u32) -> (Vec<f32>, Vec<f32>) {
        let mut out = vec![f32::NAN; s.q_numel()];
        let mut saved = vec![f32::NAN; Standard.saved_len(s).unwrap() as usize];
        let ctx = KernelContext { threads, ..KernelContext::default() };
        Standard.forward(s, q, k, v, &mut out, &mut saved, &ctx).unwrap();
        (out, saved)
    }

    /// Returns (dq, dk, dv); the buffers start as NaN to prove backward overwrites them.
    fn run_backward(s: &AttnShape, q: &[f32], k: &[f32], v: &[f32], dout: &[f32], threads: u32) -> [Vec<f32>; 3] {
        let (out, saved) = run_forward(s, q, k, v, threads);
        let mut dq = vec![f32::NAN; s.q_numel()];
        let mut dk = vec![f32::NAN; s.kv_numel()];
        let mut dv = vec![f32::NAN; s.kv_numel()];
        let ctx = KernelContext { threads, ..KernelContext::default() };
        Standard.backward(s, q, k, v, &out, dout, &saved, &mut dq, &mut dk, &mut dv, &ctx).unwrap();
        [dq, dk, dv]
    }

    /// (B, H, Hkv, Tq, Tk, D, causal): T = 1, odd lengths, head_dim 16, GQA ratios 1/2/4,
    /// causal on and off, and q_len < kv_len (decoding against a cache) with and without mask.
    const SHAPES: &[(u32, u32, u32, u32, u32, u32, bool)] = &[
        (1, 1, 1, 1, 1, 16, true),
        (1, 2, 2, 1, 1, 16, false),
        (2, 4, 4, 7, 7, 16, false),
        (2, 4, 4, 7, 7, 16, true),
        (1, 4, 2, 13, 13, 16, true),
        (2, 8, 2, 5, 5, 16, false),
        (1, 8, 2, 11, 11, 8, true),
        (1, 4, 1, 3, 10, 16, true),
        (2, 2, 1, 1, 9, 16, true),
        (1, 4, 2, 4, 6, 5, false),
    ];

    #[test]
    fn forward_matches_f64_reference() {
        let mut rng = Rng(7);
        for &(b, h, hkv, tq, tk, d, causal) in SHAPES {
            let s = shape(b, h, hkv, tq, tk, d, causal);
            let (q, k, v) = (rng.vec(s.q_numel()), rng.vec(s.kv_numel()), rng.vec(s.kv_numel()));
            let (out, saved) = run_forward(&s, &q, &k, &v, 2);
            let (want_out, want_p) = reference(&s, &f64s(&q), &f64s(&k), &f64s(&v));
            // Inputs are in [-1, 1) with Tk <= 13 terms per sum: f32 rounding stays below ~1e-6.
            for (i, (&got, &want)) in out.iter().zip(&want_out).enumerate() {
                assert!((got as f64 - want).abs() < 1e-5, "{s:?} out[{i}] = {got}, reference {want}");
            }
            for (i, (&got, &want)) in saved.iter().zip(&want_p).enumerate() {
                assert!((got as f64 - want).abs() < 1e-6, "{s:?} P[{i}] = {got}, reference {want}");
            }
        }
    }

    /// Worked by hand, scale 1, D = 1, causal, Tq = Tk = 2: q = (1, 1), k = (0, ln 3), v = (4, 8).
    /// Row 0 sees key 0 only: out = 4. Row 1: scores (0, ln 3) → P = (1/4, 3/4), out = 1 + 6 = 7.
    /// With Tq = 1 < Tk = 2 the single query sits at position 1 and sees both keys: out = 7.
    #[test]
    fn causal_mask_by_hand() {
        let mut s = shape(1, 1, 1, 2, 2, 1, true);
        s.scale = 1.0;
        let (out, p) = run_forward(&s, &[1.0, 1.0], &[0.0, 3f32.ln()], &[4.0, 8.0], 1);
        assert_eq!(p[..2], [1.0, 0.0]);
        assert!((p[2] - 0.25).abs() < 1e-7 && (p[3] - 0.75).abs() < 1e-7, "{p:?}");
        assert_eq!(out[0], 4.0);
        assert!((out[1] - 7.0).abs() < 1e-6, "{out:?}");

        s.q_len = 1;
        let (out, p) = run_forward(&s, &[1.0], &[0.0, 3f32.ln()], &[4.0, 8.0], 1);
        assert!((p[0] - 0.25).abs() < 1e-7 && (p[1] - 0.75).abs() < 1e-7, "{p:?}");
        assert!((out[0] - 7.0).abs() < 1e-6, "{out:?}");
    }

    /// Analytic gradients (f32) against central finite differences of
    /// loss = Σ out ∘ R computed in f64 by `reference`.
    #[test]
    fn backward_matches_finite_differences() {
        let mut rng = Rng(11);
        let cases = [
            shape(1, 2, 2, 4, 4, 3, false),
            shape(2, 4, 2, 3, 5, 4, true),
            shape(1, 4, 1, 5, 5, 2, true),
            shape(1, 2, 1, 1, 3, 4, false),
        ];
        for s in cases {
            let (q, k, v) = (rng.vec(s.q_numel()), rng.vec(s.kv_numel()), rng.vec(s.kv_numel()));
            let r = rng.vec(s.q_numel()); // dL/dout
            let [dq, dk, dv] = run_backward(&s, &q, &k, &v, &r, 2);

            let r64 = f64s(&r);
            let loss = |q: &[f64], k: &[f64], v: &[f64]| -> f64 {
                reference(&s, q, k, v).0.iter().zip(&r64).map(|(o, r)| o * r).sum()
            };
            // h = 1e-5 in f64: truncation error O(h²·f''') ≈ 1e-10 and cancellation
            // ≈ 1e-16/h ≈ 1e-11, so the FD value is exact to ~1e-9 for these O(1) inputs.
            let h = 1e-5;
            let inputs = [f64s(&q), f64s(&k), f64s(&v)];
            for (which, analytic) in [&dq, &dk, &dv].into_iter().enumerate() {
                for idx in 0..analytic.len() {
                    let mut plus = inputs.clone();
                    let mut minus = inputs.clone();
                    plus[which][idx] += h;
                    minus[which][idx] -= h;
                    let fd = (loss(&plus[0], &plus[1], &plus[2]) - loss(&minus[0], &minus[1], &minus[2])) / (2.0 * h);
                    let got = analytic[idx] as f64;
                    // The analytic side is f32 (relative rounding ~6e-8 per op over a few
                    // dozen ops), so 1e-4 absolute + relative leaves margin while any wrong term
                    // (a missing scale, a transposed index, a dropped group member) is O(1e-1).
                    assert!(
                        (got - fd).abs() <= 1e-4 * (1.0 + fd.abs()),
                        "{s:?} d{}[{idx}]: analytic {got}, finite difference {fd}",
                        ["q", "k", "v"][which]
                    );
                }
            }
        }
    }

    #[test]
    fn thread_count_does_not_change_bits() {
        let mut rng = Rng(3);
        for s in [shape(2, 4, 2, 9, 9, 16, true), shape(3, 3, 1, 5, 7, 4, false)] {
            let (q, k, v, r) =
                (rng.vec(s.q_numel()), rng.vec(s.kv_numel()), rng.vec(s.kv_numel()), rng.vec(s.q_numel()));
            let one = run_forward(&s, &q, &k, &v, 1);
            let three = run_forward(&s, &q, &k, &v, 3);
            let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&one.0), bits(&three.0), "{s:?} out");
            assert_eq!(bits(&one.1), bits(&three.1), "{s:?} saved");
            let g1 = run_backward(&s, &q, &k, &v, &r, 1);
            let g3 = run_backward(&s, &q, &k, &v, &r, 3);
            for i in 0..3 {
                assert_eq!(bits(&g1[i]), bits(&g3[i]), "{s:?} gradient {i}");
            }
        }
    }

    #[test]
    fn saved_len_is_the_probability_matrix() {
        assert_eq!(Standard.saved_len(&shape(2, 8, 2, 5, 7, 16, true)).unwrap(), 2 * 8 * 5 * 7);
        assert!(Standard.supports_backward());
    }

    #[test]
    fn wrong_buffers_are_invalid_input() {
        let s = shape(1, 2, 1, 3, 3, 4, true);
        let (nq, nkv, np) = (s.q_numel(), s.kv_numel(), 2 * 3 * 3);
        let ctx = KernelContext::default();
        let (q, k, v) = (vec![0.0; nq], vec![0.0; nkv], vec![0.0; nkv]);
        let (mut out, mut saved) = (vec![0.0; nq], vec![0.0; np]);

        let err = Standard.forward(&s, &q[1..], &k, &v, &mut out, &mut saved, &ctx).unwrap_err();
        assert_eq!((err.kind, err.message.as_str()), (ErrorKind::InvalidInput, "q has 23 elements, expected 24"));
        let err = Standard.forward(&s, &q, &k, &v, &mut out, &mut saved[1..], &ctx).unwrap_err();
        assert_eq!((err.kind, err.message.as_str()), (ErrorKind::InvalidInput, "saved has 17 elements, expected 18"));

        let (mut dq, mut dk, mut dv) = (vec![0.0; nq], vec![0.0; nkv + 1], vec![0.0; nkv]);
        let err = Standard.backward(&s, &q, &k, &v, &out, &q, &saved, &mut dq, &mut dk, &mut dv, &ctx).unwrap_err();
        assert_eq!((err.kind, err.message.as_str()), (ErrorKind::InvalidInput, "dk has 13 elements, expected 12"));
        let err = Standard
            .backward(&s, &q, &k, &v, &out, &q[..4], &saved, &mut dq, &mut dk[..nkv], &mut dv, &ctx)
            .unwrap_err();
        assert_eq!((err.kind, err.message.as_str()), (ErrorKind::InvalidInput, "dout has 4 elements, expected 24"));

        // q_heads not a multiple of kv_heads, and a softmax over zero keys.
        let err = Standard.saved_len(&shape(1, 3, 2, 3, 3, 4, false)).unwrap_err();
        assert_eq!(err.kind, ErrorKind::InvalidInput);
        let err = Standard.saved_len(&shape(1, 1, 1, 2, 0, 4, false)).unwrap_err();
        assert_eq!(err.message.as_str(), "attention over zero keys (kv_len = 0) is undefined");
    }

    #[test]
    fn registered_without_options() {
        let b = crate::builtin::all().find(|b| (b.manifest)().name.as_str() == "standard").expect("registered");
        let m = (b.manifest)();
        assert_eq!((m.kind, m.options.len()), (PluginKind::Attention, 0));
        m.validate().unwrap();
        let inst = (b.create)("", &HostContext::default()).unwrap();
        assert_eq!(inst.kind(), PluginKind::Attention);
        let err = (b.create)(r#"{"window": 4}"#, &HostContext::default()).unwrap_err();
        assert_eq!(err.details().collect::<Vec<_>>(), ["unknown option 'window' ('standard' takes no options)"]);
    }
}
