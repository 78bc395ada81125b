//! The step's reductions and its one transcendental function, in orders and operations a GPU
//! follows exactly (the `cuda` feature's kernels/adafactor.cu does the same f32/f64 operations
//! in the same order, so both devices give the same bits):
//!
//! - [`lanes_in_order`]: a run of f32 terms in [`LANES`] = 32 strided f32 lanes (lane k adds terms
//!   k, k + 32, k + 64, … in order; one warp's lanes on a GPU, four AVX2 registers here), then
//!   the 32 lane values in f64 in lane order;
//! - [`Tree`]: a sequence of f64 values added in one fixed 32-ary tree (sequential sums of 32
//!   consecutive values, in index order, at every level), which a GPU adds level by level in
//!   parallel; the same tree as adam-8bit's Σ g²;
//! - [`pow`]: `t^e` for the second moment's decay `1 − t^decay_rate` from f64 additions,
//!   multiplications, divisions and exact scalings only (libm's `pow` and CUDA's differ in
//!   the last bits).

/// Lanes of a [`lane_sum`]: a warp's threads on a GPU.
pub(crate) const LANES: usize = 32;

/// Elements of one leaf of a vector's sums (Σθ², Σ U²): 32 terms in each of the 32 lanes.
pub(crate) const CHUNK: usize = LANES * 32;

/// A run of terms (one row tile or one chunk) summed as [`LANES`] strided f32 sums (lane k:
/// terms k, k + 32, … in index order, from +0), given here; returns those 32 sums added in
/// f64 in lane order.
pub(crate) fn lanes_in_order(lanes: &[f32; LANES]) -> f64 {
    let mut sum = 0.0f64;
    for &l in lanes {
        sum += f64::from(l);
    }
    sum
}

/// The fixed 32-ary tree every sum of the step goes through (ava-core's, shared with
/// adam-8bit and adam-mini; `tree_sum` in ava/common.cuh on the GPU).
pub(crate) use ava_core::math::TreeSum as Tree;

/// The mean of `x` in f64: Σ in a [`Tree`] over the values in order, over the length.
pub(crate) fn tree_mean(x: &[f32]) -> f64 {
    let mut tree = Tree::default();
    for &v in x {
        tree.push(f64::from(v));
    }
    tree.sum() / x.len() as f64
}

/// ln 2 split for an exact k·ln 2 (fdlibm's `ln2_hi`, `ln2_lo`).
const LN2_HI: u64 = 0x3FE6_2E42_FEE0_0000;
const LN2_LO: u64 = 0x3DEA_39EF_3579_3C76;
/// 1 / ln 2 rounded to f64.
const LOG2_E: u64 = 0x3FF7_1547_652B_82FE;
/// √2 rounded to f64.
const SQRT2: u64 = 0x3FF6_A09E_667F_3BCD;

/// `t^e` for the step count `t ≥ 1` and a negative exponent `e`, as exp(e·ln t), each to
/// within a few units in the last place of f64, from operations a GPU rounds identically
/// (kernels/adafactor.cu's `pow_t` is this function, line for line):
/// - ln t: t = 2^k·m with m in [√½, √2); ln m = 2·atanh(s), s = (m − 1)/(m + 1), by its
///   series to s^23 (|s| ≤ 0.172); ln t = k·ln2_hi + (k·ln2_lo + ln m);
/// - exp x (x ≤ 0): x = j·ln 2 + r with j = ⌊x/ln 2 + ½⌋, |r| ≤ 0.35, e^r by its Taylor series
///   to r^17, times 2^j exactly. Below x = −708 (t^e < 2^−1021) it is 0: 1 − t^e is 1 either way.
///
/// `pow(1, e)` is exactly 1, so the first step's β2 is exactly 0.
pub(crate) fn pow(t: f64, e: f64) -> f64 {
    let bits = t.to_bits();
    let mut k = ((bits >> 52) & 0x7ff) as i32 - 1023;
    let mut m = f64::from_bits((bits & ((1u64 << 52) - 1)) | (1023u64 << 52));
    if m > f64::from_bits(SQRT2) {
        m *= 0.5;
        k += 1;
    }
    let s = (m - 1.0) / (m + 1.0);
    let z = s * s;
    let mut p = 1.0 / 23.0;
    for i in (0..11).rev() {
        p = p * z + 1.0 / f64::from(2 * i + 1);
    }
    let k = f64::from(k);
    let ln = k * f64::from_bits(LN2_HI) + (k * f64::from_bits(LN2_LO) + 2.0 * s * p);
    let x = e * ln;
    if x < -708.0 {
        return 0.0;
    }
    let j = (x * f64::from_bits(LOG2_E) + 0.5).floor();
    let r = (x - j * f64::from_bits(LN2_HI)) - j * f64::from_bits(LN2_LO);
    let mut q = 1.0;
    for i in (1..=17).rev() {
        q = 1.0 + r / f64::from(i) * q;
    }
    // 2^j is a normal f64: j is in [−1021, 0].
    q * f64::from_bits(((j as i64 + 1023) as u64) << 52)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Σ x² over `x` as the step's lane sums add it.
    fn lane_sum_sq(x: &[f32]) -> f64 {
        let mut lanes = [0f32; LANES];
        let head = x.len() / LANES * LANES;
        for c in x[..head].chunks_exact(LANES) {
            for k in 0..LANES {
                lanes[k] += c[k] * c[k];
            }
        }
        for (k, &v) in x[head..].iter().enumerate() {
            lanes[k] += v * v;
        }
        lanes_in_order(&lanes)
    }

    /// The tree, added level by level as a GPU does (each level's groups of 32 in order).
    fn by_levels(values: &[f64]) -> f64 {
        let mut level = values.to_vec();
        if level.len() == 1 {
            return level[0];
        }
        while level.len() > 1 {
            level = level
                .chunks(ava_core::math::TREE_FAN)
                .map(|g| {
                    let mut s = 0.0;
                    for &v in g {
                        s += v;
                    }
                    s
                })
                .collect();
        }
        level.first().copied().unwrap_or(0.0)
    }

    /// The streaming tree gives the level-by-level sum's bits, for lengths around every
    /// level's edges (values of very different sizes, so another order rounds differently).
    #[test]
    fn the_streaming_tree_is_the_level_by_level_tree() {
        let mut s = 7u64;
        let mut next = || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let x = (s >> 11) as f64 / (1u64 << 53) as f64;
            x * 10f64.powi(((s >> 3) % 12) as i32 - 6)
        };
        let values: Vec<f64> = (0..33_000).map(|_| next()).collect();
        let mut differs_from_sequential = false;
        for len in [0, 1, 2, 31, 32, 33, 63, 64, 65, 1023, 1024, 1025, 1056, 2047, 32_768, 32_769, 33_000] {
            let mut tree = Tree::default();
            for &v in &values[..len] {
                tree.push(v);
            }
            let got = tree.sum();
            assert_eq!(got.to_bits(), by_levels(&values[..len]).to_bits(), "length {len}");
            differs_from_sequential |= got != values[..len].iter().sum::<f64>();
        }
        assert!(differs_from_sequential, "the test's values do not tell the orders apart");
    }

    /// Lane sums: lane k adds elements k, k + 32, … in order, in f32; the lanes in f64.
    #[test]
    fn lane_sums_follow_the_lanes() {
        let x: Vec<f32> = (0..77).map(|i| 1.0 + i as f32 * 1e-3).collect();
        let mut want = 0.0f64;
        for k in 0..LANES {
            let mut lane = 0f32;
            for v in x.iter().skip(k).step_by(LANES) {
                lane += v * v;
            }
            want += f64::from(lane);
        }
        assert_eq!(lane_sum_sq(&x).to_bits(), want.to_bits());
        assert_eq!(lane_sum_sq(&[]), 0.0);
    }

    /// `pow` against libm over the counts and exponents a run sees: within what rounding
    /// x = e·ln t to f64 allows (a relative 2^−53·|x| in e^x, plus a few ulps), exactly 1 at
    /// t = 1, and 0 far below f64's range.
    #[test]
    fn pow_is_libms_to_rounding() {
        for e in [-0.8, -0.5, -1.0, -0.3, -2.0, -0.0123, -7.5] {
            assert_eq!(pow(1.0, e), 1.0);
            let ts = (1..3000u32).chain([65_535, 1 << 20, 123_456_789, u32::MAX - 1, u32::MAX]);
            for t in ts {
                let (got, want) = (pow(f64::from(t), e), f64::from(t).powf(e));
                let x = (e * f64::from(t).ln()).abs();
                let off = (got / want - 1.0).abs();
                assert!(off <= 2.3e-16 * (4.0 + x), "{t}^{e}: {got:e} against libm's {want:e} ({off:e} off)");
            }
        }
        assert_eq!(pow(4e9, -100.0), 0.0);
        assert!(pow(2.0, -1000.0) > 0.0 && (pow(2.0, -1000.0) / 2f64.powi(-1000) - 1.0).abs() < 1e-13);
    }
}
