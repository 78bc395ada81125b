//! Numerics helpers for kernel authors: an f32 `exp` that the compiler can vectorize, and
//! [`TreeSum`], the fixed summation order an optimizer's CPU and GPU steps share.
//!
//! `f32::exp` calls libm once per element, which keeps a loop around it scalar; softmax and
//! SiLU spend most of their time there. [`exp`] is branch-free arithmetic (range reduction
//! by ln 2, a degree-6 polynomial, the exponent built from bits), so loops over slices that
//! call it vectorize. Its relative error is below 4 ulp (3e-7) on the whole f32 range
//! (tested against f64), results are exactly 1 at 0, 0 below the smallest normal result,
//! and infinite above f32::MAX's logarithm.

/// The input below which the result would be subnormal: returned as 0.
const LO: f32 = -87.336_55; // ln(f32::MIN_POSITIVE)
/// The input above which the result overflows: returned as infinity.
const HI: f32 = 88.722_83; // ln(f32::MAX)

/// `e^x` in f32, vectorizable (see the module docs).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    // 1.5 · 2^23: adding it rounds to an integer (ties to even) in the low mantissa bits, with
    // plain additions that vectorize on every x86-64 (no SSE4.1 `round` needed).
    const ROUND: f32 = 12_582_912.0;
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split so that n · LN2_HI is exact for |n| ≤ 2^9.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let xc = x.clamp(LO, HI);
    let t = xc * LOG2E + ROUND;
    let n = t - ROUND; // round(x / ln 2), in [-126, 128]
    let r = xc - n * LN2_HI - n * LN2_LO; // |r| ≤ ln2 / 2
    // e^r by its Taylor series to r⁶ (the remainder is below 1.2e-7 relative on |r| ≤ 0.347).
    let p = 1.0 + r * (1.0 + r * (0.5 + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    // 2^n: n is in the low bits of t; 2^n splits in two factors so n = 128 does not overflow
    // before the (reduced) polynomial has scaled it down.
    let k = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32); // n as an integer
    let half = k >> 1;
    let two_a = f32::from_bits(((half + 127) << 23) as u32);
    let two_b = f32::from_bits((((k - half) + 127) << 23) as u32);
    let y = p * two_a * two_b;
    if x < LO {
        0.0
    } else if x > HI {
        f32::INFINITY
    } else {
        y // NaN stays NaN: the comparisons above are false for it
    }
}

/// Fan-in of a [`TreeSum`].
pub const TREE_FAN: usize = 32;

/// A running sum of f64 values in one fixed 32-ary tree: the values in groups of
/// [`TREE_FAN`] consecutive ones, each group added in index order from 0; those sums grouped
/// and added the same way, and so on up to one value. A short last group adds what it has.
/// Kept as one running sum per level, so nothing is allocated (14 levels cover
/// 32^14 > 2^64 values).
///
/// A GPU adds the same tree level by level (`tree_sum` in ava-cuda-build's `ava/common.cuh`:
/// a level's groups in parallel, each group sequentially), so an optimizer whose CPU and GPU
/// steps both reduce through it gives the same bits on both devices (adam-8bit's, adafactor's
/// and adam-mini's sums).
#[derive(Debug, Default, Clone)]
pub struct TreeSum {
    /// level[k]: the sum in progress of the current group of level-k values (level 0: the
    /// pushed values).
    level: [f64; 14],
    count: usize,
}

impl TreeSum {
    /// Adds the next value of the sequence.
    pub fn push(&mut self, value: f64) {
        let (mut value, mut index) = (value, self.count);
        self.count += 1;
        for group in &mut self.level {
            *group += value;
            if index % TREE_FAN != TREE_FAN - 1 {
                break;
            }
            // A full group becomes a value of the level above.
            value = std::mem::take(group);
            index /= TREE_FAN;
        }
    }

    /// The sum of every value pushed (0 for none). The unfinished groups, lowest first, are
    /// each the last value of the group above it.
    pub fn sum(mut self) -> f64 {
        for k in 0..self.level.len() - 1 {
            self.level[k + 1] += self.level[k];
        }
        self.level[self.level.len() - 1]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_error_is_a_few_ulp_over_the_whole_range() {
        let mut worst = 0f64;
        let steps = 2_000_000;
        for i in 0..=steps {
            let x = (LO + (HI - LO) * i as f32 / steps as f32).min(HI);
            let want = (x as f64).exp();
            let got = exp(x) as f64;
            let e = ((got - want) / want).abs();
            assert!(e < 3e-7, "exp({x}) = {got}, want {want}");
            worst = worst.max(e);
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        for x in [-1e-3f32, -0.5, 0.25, 1.0, 10.0, -10.0, 80.0, -80.0, 88.7] {
            let want = (x as f64).exp();
            assert!(((exp(x) as f64 - want) / want).abs() < 3e-7, "exp({x})");
        }
    }

    #[test]
    fn edges() {
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(89.0), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
        assert!(exp(HI).is_finite() && exp(LO) > 0.0);
    }
}
