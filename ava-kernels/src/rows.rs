//! The elementwise loops of the attention kernels, over rows of a score tile.
//!
//! Written so the compiler vectorizes them: no early exits, [`ava_core::math::exp`]
//! instead of libm, and reductions in 8 interleaved lanes (a plain `fold` over f32 stays
//! scalar because float addition is not associative). A portable x86-64 build only assumes
//! SSE2 (4 lanes); on a CPU with AVX2 and FMA each public function runs a copy of the same
//! code compiled for 8 lanes. `benches/rows.rs` measures both against scalar libm code.

/// Σ x, in 8 interleaved lanes (vectorizes; a fixed order, so deterministic).
#[inline(always)]
pub fn lane_sum(x: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l += v;
        }
    }
    lanes.iter().sum::<f32>() + chunks.remainder().iter().sum::<f32>()
}

/// max x (−∞ for an empty slice), in 8 lanes. NaNs are not propagated: scores are finite.
#[inline(always)]
fn lane_max(x: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l = if v > *l { v } else { *l };
        }
    }
    let tail = chunks.remainder().iter().fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a });
    lanes.iter().fold(tail, |a, &b| if b > a { b } else { a })
}

/// Σ a ∘ b, in 8 lanes.
#[inline(always)]
fn lane_dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (mut ca, mut cb) = (a.chunks_exact(8), b.chunks_exact(8));
    for (x, y) in (&mut ca).zip(&mut cb) {
        for ((l, &x), &y) in lanes.iter_mut().zip(x).zip(y) {
            *l += x * y;
        }
    }
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    lanes.iter().sum::<f32>() + tail
}

/// Runs `$body` through a copy compiled for AVX2 + FMA when the CPU has them.
macro_rules! dispatch {
    ($(#[$doc:meta])* pub fn $name:ident / $avx:ident / $portable:ident ($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        /// The portable (SSE2 on x86-64) copy, public for `benches/rows.rs`.
        #[doc(hidden)]
        #[inline(always)]
        pub fn $portable($($arg: $ty),*) $(-> $ret)? $body

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn $avx($($arg: $ty),*) $(-> $ret)? {
            $portable($($arg),*)
        }

        $(#[$doc])*
        pub fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            if has_avx2() {
                // SAFETY: the CPU supports the features the copy was compiled for.
                return unsafe { $avx($($arg),*) };
            }
            $portable($($arg),*)
        }
    };
}

/// Whether this CPU runs the AVX2 copies (cached by std after the first call). The
/// environment variable `AVA_KERNELS_PORTABLE=1` forces the portable code, for benchmarks.
#[cfg(target_arch = "x86_64")]
pub fn has_avx2() -> bool {
    use std::sync::OnceLock;
    static AVX2: OnceLock<bool> = OnceLock::new();
    *AVX2.get_or_init(|| {
        std::env::var_os("AVA_KERNELS_PORTABLE").is_none_or(|v| v != "1")
            && std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
    })
}

/// Whether this CPU runs AVX-512F code (the attention products' wider tiles), under the same
/// `AVA_KERNELS_PORTABLE=1` switch as [`has_avx2`] (which it implies).
#[cfg(target_arch = "x86_64")]
pub fn has_avx512() -> bool {
    use std::sync::OnceLock;
    static AVX512: OnceLock<bool> = OnceLock::new();
    *AVX512.get_or_init(|| has_avx2() && std::is_x86_feature_detected!("avx512f"))
}

/// Whether this CPU runs AVX-512F code (never, off x86-64).
#[cfg(not(target_arch = "x86_64"))]
pub fn has_avx512() -> bool {
    false
}

/// Whether this CPU runs the AVX2 copies (never, off x86-64).
#[cfg(not(target_arch = "x86_64"))]
pub fn has_avx2() -> bool {
    false
}

dispatch! {
    /// One step of the online softmax over a tile of scores `s` (rows × cols, row stride
    /// `cols`, masked entries −∞): per row, the running max `m` and sum `l` absorb the tile,
    /// `s` becomes `exp(s − m_new)`, and the row of the output accumulator `acc` (row stride
    /// `d`) is rescaled by `exp(m_old − m_new)` so it stays relative to the new max.
    pub fn online_softmax / online_softmax_avx2 / online_softmax_portable(
        s: &mut [f32],
        cols: usize,
        m: &mut [f32],
        l: &mut [f32],
        acc: &mut [f32],
        d: usize,
    ) {
        for (r, row) in s.chunks_exact_mut(cols).enumerate() {
            let m_new = lane_max(row).max(m[r]);
            if m_new == f32::NEG_INFINITY {
                row.fill(0.0); // every key so far masked: nothing to absorb yet
                continue;
            }
            for x in row.iter_mut() {
                *x = ava_core::math::exp(*x - m_new);
            }
            let alpha = ava_core::math::exp(m[r] - m_new); // 0 when m[r] = −∞
            l[r] = l[r] * alpha + lane_sum(row);
            if alpha != 1.0 {
                for o in &mut acc[r * d..][..d] {
                    *o *= alpha;
                }
            }
            m[r] = m_new;
        }
    }
}

dispatch! {
    /// Probabilities from scores and the saved logsumexp: `s = exp(s − lse[r])` per row
    /// (masked −∞ entries become 0).
    pub fn exp_minus_lse / exp_minus_lse_avx2 / exp_minus_lse_portable(s: &mut [f32], cols: usize, lse: &[f32]) {
        for (row, &lse) in s.chunks_exact_mut(cols).zip(lse) {
            for x in row.iter_mut() {
                *x = ava_core::math::exp(*x - lse);
            }
        }
    }
}

dispatch! {
    /// Softmax backward on a tile: `dp = p ∘ (dp − delta[r])` per row, where `delta` is
    /// rowsum(dO ∘ O) (equal to rowsum(P ∘ dP) over the whole row).
    pub fn softmax_grad / softmax_grad_avx2 / softmax_grad_portable(p: &[f32], dp: &mut [f32], cols: usize, delta: &[f32]) {
        for ((p, dp), &delta) in p.chunks_exact(cols).zip(dp.chunks_exact_mut(cols)).zip(delta) {
            for (g, &p) in dp.iter_mut().zip(p) {
                *g = p * (*g - delta);
            }
        }
    }
}

dispatch! {
    /// Row dot products: `out[r] = Σ a[r, :] ∘ b[r, :]` for rows of length `d`.
    pub fn row_dots / row_dots_avx2 / row_dots_portable(a: &[f32], b: &[f32], d: usize, out: &mut [f32]) {
        for ((a, b), o) in a.chunks_exact(d).zip(b.chunks_exact(d)).zip(out.iter_mut()) {
            *o = lane_dot(a, b);
        }
    }
}

dispatch! {
    /// Dense softmax of each row in place (masked −∞ entries become 0; every row must have
    /// a finite entry).
    pub fn softmax_rows / softmax_rows_avx2 / softmax_rows_portable(s: &mut [f32], cols: usize) {
        for row in s.chunks_exact_mut(cols) {
            let max = lane_max(row);
            for x in row.iter_mut() {
                *x = ava_core::math::exp(*x - max);
            }
            let inv = 1.0 / lane_sum(row);
            for x in row.iter_mut() {
                *x *= inv;
            }
        }
    }
}

dispatch! {
    /// Dense softmax backward in place: `ds = p ∘ (ds − rowsum(p ∘ ds))` per row.
    pub fn softmax_backward_rows / softmax_backward_rows_avx2 / softmax_backward_rows_portable(
        p: &[f32],
        ds: &mut [f32],
        cols: usize,
    ) {
        for (p, ds) in p.chunks_exact(cols).zip(ds.chunks_exact_mut(cols)) {
            let dot = lane_dot(p, ds);
            for (g, &p) in ds.iter_mut().zip(p) {
                *g = p * (*g - dot);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lanes_match_plain_loops() {
        let x: Vec<f32> = (0..37).map(|i| ((i * 13) % 11) as f32 - 5.0).collect();
        let y: Vec<f32> = (0..37).map(|i| ((i * 7) % 5) as f32 * 0.5).collect();
        assert_eq!(lane_sum(&x), x.iter().sum::<f32>()); // small integers: exact in any order
        assert_eq!(lane_max(&x), 5.0);
        assert_eq!(lane_max(&[]), f32::NEG_INFINITY);
        assert_eq!(lane_dot(&x, &y), x.iter().zip(&y).map(|(a, b)| a * b).sum::<f32>());
    }

    /// Two tiles through the online softmax equal one softmax over the whole row.
    #[test]
    fn online_softmax_equals_softmax_of_the_row() {
        let row: Vec<f32> = vec![0.5, -1.0, 3.0, f32::NEG_INFINITY, 2.0, 0.0, -4.0, 1.5, 2.5, 0.25];
        let v: Vec<f32> = (0..10).map(|j| j as f32).collect(); // one output column: Σ p_j · j
        let (mut m, mut l, mut acc) = ([f32::NEG_INFINITY], [0.0f32], [0.0f32]);
        for (lo, hi) in [(0, 4), (4, 10)] {
            let mut s = row[lo..hi].to_vec();
            online_softmax(&mut s, hi - lo, &mut m, &mut l, &mut acc, 1);
            acc[0] += s.iter().zip(&v[lo..hi]).map(|(p, v)| p * v).sum::<f32>();
        }
        let mut p = row.clone();
        softmax_rows(&mut p, 10);
        let want: f32 = p.iter().zip(&v).map(|(p, v)| p * v).sum();
        assert!((acc[0] / l[0] - want).abs() < 1e-5, "{} vs {want}", acc[0] / l[0]);
        assert_eq!(m[0], 3.0);
        // The saved logsumexp turns scores back into the same probabilities.
        let mut s = row.clone();
        exp_minus_lse(&mut s, 10, &[m[0] + l[0].ln()]);
        for (a, b) in s.iter().zip(&p) {
            assert!((a - b).abs() < 1e-6);
        }
        assert_eq!(p[3], 0.0);
    }

    /// A tile whose row is fully masked leaves the running state alone.
    #[test]
    fn masked_rows_absorb_nothing() {
        let mut s = vec![f32::NEG_INFINITY; 3];
        let (mut m, mut l, mut acc) = ([f32::NEG_INFINITY], [0.0f32], [7.0f32]);
        online_softmax(&mut s, 3, &mut m, &mut l, &mut acc, 1);
        assert_eq!((m[0], l[0], acc[0], s.as_slice()), (f32::NEG_INFINITY, 0.0, 7.0, [0.0; 3].as_slice()));
    }

    #[test]
    fn both_copies_agree() {
        let s: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin() * 4.0).collect();
        let (mut a, mut b) = (s.clone(), s.clone());
        softmax_rows_portable(&mut a, 16);
        softmax_rows(&mut b, 16);
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= 1e-7, "{x} vs {y}");
        }
    }
}
