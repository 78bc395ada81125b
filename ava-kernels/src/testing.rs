//! Checks every attention kernel's tests share: a from-the-definition f64 reference, the
//! comparison against the dense kernel under the same mask, and finite differences.
//!
//! Used by this crate's tests and by each attention plugin's own tests (through the
//! plugin's [`AttentionKernel`] implementation, options and all), so every kernel is held
//! to the same tolerances: f32 against f32 `atol 1e-4, rtol 1e-3`; analytic against f64
//! finite differences `1e-4 · (1 + |fd|)`.
//!
//! With `cuda`, [`gpu`]: the harness of the optimizers' GPU tests (their GPU step against
//! their CPU step, bit for bit).

use ava_core::{AttentionKernel, AttnShape, KernelContext, attention::Pass};

use crate::attention::{Mask, dense};

#[cfg(feature = "cuda")]
pub mod gpu;

/// splitmix64 (Steele, Lea & Flood 2014): reproducible inputs without a rand crate.
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// `n` uniforms in [-1, 1).
    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.uniform()).collect()
    }
}

/// Self- or cross-attention shape with scale 1/√D.
pub fn shape(b: u32, h: u32, hkv: u32, tq: u32, tk: u32, d: u32, causal: bool) -> AttnShape {
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

/// Attention straight from the definition in f64 with its own indexing, masked by
/// [`Mask::visible`] and, when the mask holds segment ids, by their equality (checked here
/// from the ids themselves): returns (out (B, H, Tq, D), logsumexp (B, H, Tq)).
pub fn reference(s: &AttnShape, mask: &Mask<'_>, q: &[f64], k: &[f64], v: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let (bn, hn, hkv, tq, tk, d) = (
        s.batch as usize,
        s.q_heads as usize,
        s.kv_heads as usize,
        s.q_len as usize,
        s.kv_len as usize,
        s.head_dim as usize,
    );
    let qi = |b: usize, h: usize, i: usize, x: usize| ((b * hn + h) * tq + i) * d + x;
    let ki = |b: usize, h: usize, j: usize, x: usize| ((b * hkv + h) * tk + j) * d + x;
    let mut out = vec![0.0; bn * hn * tq * d];
    let mut lse = vec![0.0; bn * hn * tq];
    let segments = mask.segments();
    let same_segment =
        |b: usize, i: usize, j: usize| segments.is_empty() || segments[b * tk + j] == segments[b * tk + i + (tk - tq)];
    for b in 0..bn {
        let pattern = Mask::new(mask.pattern(), tq, tk).expect("the mask's own pattern");
        for h in 0..hn {
            let kh = h / (hn / hkv);
            for i in 0..tq {
                let scores: Vec<f64> = (0..tk)
                    .map(|j| {
                        if pattern.visible(i, j) && same_segment(b, i, j) {
                            s.scale as f64 * (0..d).map(|x| q[qi(b, h, i, x)] * k[ki(b, kh, j, x)]).sum::<f64>()
                        } else {
                            f64::NEG_INFINITY
                        }
                    })
                    .collect();
                let z: f64 = scores.iter().map(|s| s.exp()).sum();
                lse[(b * hn + h) * tq + i] = z.ln();
                for (j, sc) in scores.iter().enumerate() {
                    let p = sc.exp() / z;
                    for x in 0..d {
                        out[qi(b, h, i, x)] += p * v[ki(b, kh, j, x)];
                    }
                }
            }
        }
    }
    (out, lse)
}

/// One forward and backward through a kernel, in one output layout: (out, saved, [dq, dk, dv]).
pub type Run = (Vec<f32>, Vec<f32>, [Vec<f32>; 3]);

/// One forward and backward through a kernel: (out, saved, dq, dk, dv). Output buffers
/// start as NaN, so a kernel that leaves any element unwritten fails the comparison.
pub fn run(
    kernel: &dyn AttentionKernel,
    s: &AttnShape,
    inputs: (&[f32], &[f32], &[f32], &[f32]),
    threads: u32,
) -> Result<Run, String> {
    run_segmented(kernel, s, &[], inputs, threads)
}

/// [`run`] with segment ids (B·Tk, or empty).
pub fn run_segmented(
    kernel: &dyn AttentionKernel,
    s: &AttnShape,
    segments: &[u32],
    (q, k, v, dout): (&[f32], &[f32], &[f32], &[f32]),
    threads: u32,
) -> Result<Run, String> {
    let ctx = KernelContext { threads, ..KernelContext::default() };
    let saved_len = kernel.saved_len(s).map_err(|e| format!("saved_len: {e}"))? as usize;
    let mut out = vec![f32::NAN; s.q_numel()];
    let mut saved = vec![f32::NAN; saved_len];
    // The declared workspaces, NaN-filled: a kernel must not depend on what it holds.
    let workspace = |pass: Pass| -> Result<Vec<f32>, String> {
        let n = kernel.workspace_len(s, pass, &ctx).map_err(|e| format!("workspace_len({}): {e}", pass.as_str()))?;
        Ok(vec![f32::NAN; n as usize])
    };
    let mut ws = workspace(Pass::Forward)?;
    kernel.forward(s, q, k, v, segments, &mut out, &mut saved, &mut ws, &ctx).map_err(|e| format!("forward: {e}"))?;
    let mut dq = vec![f32::NAN; s.q_numel()];
    let mut dk = vec![f32::NAN; s.kv_numel()];
    let mut dv = vec![f32::NAN; s.kv_numel()];
    let mut ws = workspace(Pass::Backward)?;
    kernel
        .backward(s, q, k, v, segments, &out, dout, &saved, &mut dq, &mut dk, &mut dv, &mut ws, &ctx)
        .map_err(|e| format!("backward: {e}"))?;
    Ok((out, saved, [dq, dk, dv]))
}

/// The dense kernel under `mask`: (out, dq, dk, dv).
fn dense_run(s: &AttnShape, mask: &Mask<'_>, (q, k, v, dout): (&[f32], &[f32], &[f32], &[f32])) -> [Vec<f32>; 4] {
    let mut out = vec![0.0; s.q_numel()];
    let mut probs = vec![0.0; dense::saved_len(s).expect("dense saved_len") as usize];
    dense::forward(s, mask, q, k, v, &mut out, &mut probs, 2).expect("dense forward");
    let (mut dq, mut dk, mut dv) = (vec![0.0; s.q_numel()], vec![0.0; s.kv_numel()], vec![0.0; s.kv_numel()]);
    let mut ws = vec![0.0; dense::backward_workspace_len(s, 2).expect("dense workspace") as usize];
    dense::backward(s, mask, q, k, v, &out, dout, &probs, &mut dq, &mut dk, &mut dv, &mut ws, 2)
        .expect("dense backward");
    [out, dq, dk, dv]
}

/// Largest `|got − want| − rtol·|want|` over the elements, and where; Ok when every element
/// satisfies `|got − want| <= atol + rtol·|want|` (NaN never does).
fn allclose(what: &str, got: &[f32], want: &[f32], atol: f32, rtol: f32) -> Result<f32, String> {
    let mut worst = 0f32;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs();
        if err.is_nan() || err > atol + rtol * w.abs() {
            return Err(format!("{what}[{i}] = {g}, dense reference {w} (|diff| {err})"));
        }
        worst = worst.max(err);
    }
    if got.len() != want.len() {
        return Err(format!("{what} has {} elements, reference {}", got.len(), want.len()));
    }
    Ok(worst)
}

/// Runs `kernel` and the dense kernel under `mask` (and its segment ids, which the kernel is
/// given too) on the same random inputs and checks the output and dq, dk, dv agree within
/// `atol 1e-4, rtol 1e-3`; returns the largest absolute difference.
pub fn against_dense(
    kernel: &dyn AttentionKernel,
    s: &AttnShape,
    mask: &Mask<'_>,
    threads: u32,
    seed: u64,
) -> Result<f32, String> {
    let mut rng = Rng(seed);
    let (q, k, v, dout) = (rng.vec(s.q_numel()), rng.vec(s.kv_numel()), rng.vec(s.kv_numel()), rng.vec(s.q_numel()));
    let inputs = (&q[..], &k[..], &v[..], &dout[..]);
    let (out, _, [dq, dk, dv]) = run_segmented(kernel, s, mask.segments(), inputs, threads)?;
    let [r_out, r_dq, r_dk, r_dv] = dense_run(s, mask, inputs);
    let mut worst = 0f32;
    for (what, got, want) in [("out", &out, &r_out), ("dq", &dq, &r_dq), ("dk", &dk, &r_dk), ("dv", &dv, &r_dv)] {
        worst = worst.max(allclose(what, got, want, 1e-4, 1e-3).map_err(|e| format!("{s:?} threads {threads}: {e}"))?);
    }
    Ok(worst)
}

/// Checks `kernel`'s output against the f64 [`reference`] under `mask` (`1e-5` absolute,
/// inputs in [-1, 1)) and its analytic gradients (f32) against central finite differences
/// of `loss = Σ out ∘ R` computed in f64. The kernel is given the mask's segment ids.
pub fn finite_differences(
    kernel: &dyn AttentionKernel,
    s: &AttnShape,
    mask: &Mask<'_>,
    seed: u64,
) -> Result<(), String> {
    let mut rng = Rng(seed);
    let (q, k, v, r) = (rng.vec(s.q_numel()), rng.vec(s.kv_numel()), rng.vec(s.kv_numel()), rng.vec(s.q_numel()));
    let (out, _, grads) = run_segmented(kernel, s, mask.segments(), (&q, &k, &v, &r), 1)?;
    let f64s = |x: &[f32]| x.iter().map(|&x| x as f64).collect::<Vec<f64>>();
    let (want, _) = reference(s, mask, &f64s(&q), &f64s(&k), &f64s(&v));
    for (i, (&got, &want)) in out.iter().zip(&want).enumerate() {
        let err = (got as f64 - want).abs();
        if err.is_nan() || err >= 1e-5 {
            return Err(format!("{s:?} out[{i}] = {got}, f64 reference {want}"));
        }
    }
    let r64 = f64s(&r);
    let loss = |q: &[f64], k: &[f64], v: &[f64]| -> f64 {
        reference(s, mask, q, k, v).0.iter().zip(&r64).map(|(o, r)| o * r).sum()
    };
    // h = 1e-5 in f64: truncation O(h²) ≈ 1e-10, cancellation ≈ 1e-16/h ≈ 1e-11, so the FD
    // value is good to ~1e-9; the f32 analytic side is off by ~1e-6, and any wrong term (a
    // missing scale, a transposed index, a dropped group member) by ~1e-1.
    let h = 1e-5;
    let inputs = [f64s(&q), f64s(&k), f64s(&v)];
    for (which, analytic) in grads.iter().enumerate() {
        for (idx, &got) in analytic.iter().enumerate() {
            let (mut plus, mut minus) = (inputs.clone(), inputs.clone());
            plus[which][idx] += h;
            minus[which][idx] -= h;
            let fd = (loss(&plus[0], &plus[1], &plus[2]) - loss(&minus[0], &minus[1], &minus[2])) / (2.0 * h);
            let err = (got as f64 - fd).abs();
            if err.is_nan() || err > 1e-4 * (1.0 + fd.abs()) {
                return Err(format!(
                    "{s:?} d{}[{idx}]: analytic {got}, finite difference {fd}",
                    ["q", "k", "v"][which]
                ));
            }
        }
    }
    Ok(())
}

/// The shapes every attention kernel is checked over, (B, H, Hkv, Tq, Tk, D): T = 1, T not
/// a multiple of the tuned 64-wide tiles (7, 37, 65, 130, 200), head_dim 16/64/128, GQA
/// ratios 1/2/4, and decoding against a cache (Tq < Tk).
pub const SHAPES: &[(u32, u32, u32, u32, u32, u32)] = &[
    (1, 1, 1, 1, 1, 16),
    (2, 4, 4, 7, 7, 64),
    (1, 4, 2, 37, 37, 128),
    (1, 8, 2, 65, 65, 16),
    (1, 4, 1, 130, 130, 64),
    (2, 2, 2, 200, 200, 16),
    (1, 4, 4, 65, 65, 128),
    (1, 4, 1, 3, 70, 16),
    (2, 2, 1, 1, 9, 64),
];

/// Segment ids for `s` (B·Tk): each sequence cut into documents of random lengths (from 1
/// up to about a third of the keys, so a tile holds several and a document crosses tiles),
/// numbered upwards from a random first id.
pub fn segments(s: &AttnShape, seed: u64) -> Vec<u32> {
    let mut rng = Rng(seed);
    let tk = s.kv_len as usize;
    let longest = (tk / 3).max(1) as u64;
    let mut ids = Vec::with_capacity(s.batch as usize * tk);
    for _ in 0..s.batch {
        let mut id = (rng.next_u64() % 5) as u32;
        let mut left = tk;
        while left > 0 {
            let len = ((1 + rng.next_u64() % longest) as usize).min(left);
            ids.extend(std::iter::repeat_n(id, len));
            left -= len;
            id += 1 + (rng.next_u64() % 2) as u32; // ids need only increase
        }
    }
    ids
}

/// [`against_dense`] over every shape in [`SHAPES`], causal on and off, with 1 and 3
/// threads, without segment ids and, when the kernel [supports
/// them](AttentionKernel::supports_segments), with [`segments`]; `mask_for` gives the
/// kernel's mask for a shape (`None`: the kernel refuses the shape, which must then be
/// refused by the kernel too). A kernel that does not support segments must refuse them.
/// Returns the cases compared.
pub fn against_dense_everywhere(
    kernel: &dyn AttentionKernel,
    mask_for: impl Fn(&AttnShape) -> Option<Mask<'static>>,
) -> Result<usize, String> {
    let mut cases = 0;
    for (n, &(b, h, hkv, tq, tk, d)) in SHAPES.iter().enumerate() {
        for causal in [true, false] {
            let s = shape(b, h, hkv, tq, tk, d, causal);
            let Some(mask) = mask_for(&s) else {
                if kernel.saved_len(&s).is_ok() {
                    return Err(format!("{s:?}: the kernel accepts a shape the test expected it to refuse"));
                }
                continue;
            };
            let ids = segments(&s, n as u64);
            if !kernel.supports_segments() {
                let inputs = (&vec![0.0; s.q_numel()][..], &vec![0.0; s.kv_numel()][..], &vec![0.0; s.kv_numel()][..]);
                if run_segmented(kernel, &s, &ids, (inputs.0, inputs.1, inputs.2, inputs.0), 1).is_ok() {
                    return Err(format!("{s:?}: the kernel says it takes no segment ids but ran with them"));
                }
            }
            for segmented in [false, kernel.supports_segments()] {
                let mask = if segmented { mask.with_segments(&ids).map_err(|e| e.to_string())? } else { mask };
                for threads in [1, 3] {
                    against_dense(kernel, &s, &mask, threads, n as u64)?;
                    cases += 1;
                }
                if !kernel.supports_segments() {
                    break;
                }
            }
        }
    }
    Ok(cases)
}

/// One edit of [`mutate`]: (operation, position, byte), each taken modulo what applies.
pub type Edit = (u8, usize, u8);

/// `seed` with `edits` applied, for the property tests of the parsers that read outside
/// input: bytes replaced, inserted, removed, chunks repeated, and `tokens` (text the parser
/// treats specially) spliced in.
pub fn mutate(seed: &[u8], edits: &[Edit], tokens: &[&str]) -> Vec<u8> {
    let mut v = seed.to_vec();
    for &(op, at, b) in edits {
        let i = at % (v.len() + 1);
        match op % 5 {
            0 if i < v.len() => v[i] = b,
            1 => v.insert(i, b),
            2 if i < v.len() => {
                v.remove(i);
            }
            3 => {
                let end = (i + b as usize).min(v.len());
                let chunk = v[i..end].to_vec();
                v.splice(i..i, chunk);
            }
            _ if !tokens.is_empty() => {
                let token = tokens[b as usize % tokens.len()];
                v.splice(i..i, token.bytes());
            }
            _ => {}
        }
    }
    v
}

/// A property test's case count: `$PROPTEST_CASES` when set (to fuzz longer), else `default`
/// (small, so the ordinary `cargo test` stays quick).
pub fn proptest_cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}
