//! Rounding an f32 parameter, just stepped, back to the half type it is stored in
//! (`train.master_weights: none | kahan | tier`).
//!
//! Round-to-nearest loses every update smaller than half a unit in the last place: bf16
//! has 8 bits of mantissa, so a weight of 1.0 ignores any step under 2⁻⁹, and training
//! with small learning rates stalls. Stochastic rounding rounds up with probability equal
//! to the distance from the value below, so the rounding error is zero in expectation and
//! small updates survive on average (Gupta et al. 2015; Zamirai et al. 2020, "Revisiting
//! BFloat16 Training"). Kahan-style compensation instead keeps the lost part in a second
//! half buffer and adds it back before the next step (Zamirai et al.'s "Kahan summation").
//!
//! The random bits are a pure function of (seed, element index): the caller derives the
//! seed from the run's seed, the step and the parameter, so a resumed run rounds exactly as
//! the straight one did, and results do not depend on the thread count (each thread owns a
//! fixed range of elements).

use half::{bf16, f16};

/// A half type the weights may be stored in.
pub trait Half: Copy + Send + Sync + bytemuck::Pod {
    /// Round to nearest, ties to even.
    fn nearest(x: f32) -> Self;
    /// Widen exactly.
    fn widen(self) -> f32;
    /// Round `x` up or down to one of its two neighbours, up with probability equal to its
    /// distance from the lower one; `r` is 16 uniform random bits.
    fn stochastic(x: f32, r: u16) -> Self;
}

impl Half for bf16 {
    fn nearest(x: f32) -> Self {
        bf16::from_f32(x)
    }

    fn widen(self) -> f32 {
        self.to_f32()
    }

    fn stochastic(x: f32, r: u16) -> Self {
        if !x.is_finite() {
            return bf16::from_f32(x);
        }
        // bf16 is the top half of an f32: adding 16 random bits below the cut carries into
        // the kept half with probability (the dropped bits) / 2¹⁶, then truncation.
        bf16::from_bits((x.to_bits().wrapping_add(r as u32) >> 16) as u16)
    }
}

impl Half for f16 {
    fn nearest(x: f32) -> Self {
        f16::from_f32(x)
    }

    fn widen(self) -> f32 {
        self.to_f32()
    }

    fn stochastic(x: f32, r: u16) -> Self {
        let near = f16::from_f32(x);
        let n = near.to_f32();
        if !n.is_finite() || n == x {
            return near;
        }
        // The other neighbour of x, one unit in the last place away from `near`.
        let other = f16::from_bits(next_bits(near.to_bits(), x > n));
        let (lo, hi) = if x > n { (n, other.to_f32()) } else { (other.to_f32(), n) };
        if !hi.is_finite() {
            return near;
        }
        let p_up = ((x - lo) / (hi - lo)) as f64;
        let up = (r as f64 + 0.5) / 65536.0 < p_up;
        let pick = if up { hi } else { lo };
        if pick == n { near } else { other }
    }
}

/// The f16 bit pattern one step towards +∞ (`up`) or −∞ from `h` (finite).
fn next_bits(h: u16, up: bool) -> u16 {
    let negative = h & 0x8000 != 0;
    if h & 0x7fff == 0 {
        return if up { 0x0001 } else { 0x8001 };
    }
    if up != negative { h + 1 } else { h - 1 }
}

/// SplitMix64's finalizer: a well-mixed 64-bit hash of `z`.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The rounding seed of parameter `param` at step `step` of a run seeded `seed`.
pub fn seed_for(seed: u64, step: u64, param: usize) -> u64 {
    mix(mix(mix(seed) ^ step) ^ param as u64)
}

/// Elements per task when rounding in parallel: a multiple of 4 (one hash gives 4 × 16 bits).
const CHUNK: usize = 1 << 16;

/// `out[j] = stochastic(values[j])` with random bits drawn from (seed, j).
pub fn round_stochastic<H: Half>(values: &[f32], out: &mut [H], seed: u64, threads: u32) {
    assert_eq!(values.len(), out.len(), "rounding {} values into {}", values.len(), out.len());
    let tasks: Vec<(usize, &[f32], &mut [H])> =
        values.chunks(CHUNK).zip(out.chunks_mut(CHUNK)).enumerate().map(|(i, (v, o))| (i * CHUNK, v, o)).collect();
    ava_kernels::parallel::run(
        tasks,
        threads,
        || (),
        |_, (start, v, o)| {
            for (k, (x, h)) in v.iter().zip(o.iter_mut()).enumerate() {
                let j = start + k;
                let bits = mix(seed ^ (j as u64 / 4).wrapping_mul(0xd1b5_4a32_d192_ed03));
                *h = H::stochastic(*x, (bits >> (16 * (j % 4))) as u16);
            }
        },
    );
}

/// `out[j] = nearest(values[j])`.
pub fn round_nearest<H: Half>(values: &[f32], out: &mut [H]) {
    for (x, h) in values.iter().zip(out) {
        *h = H::nearest(*x);
    }
}

/// Compensated rounding: `out[j] = nearest(values[j])` and `comp[j]` = what that lost,
/// itself rounded to nearest; [`widen_compensated`] adds it back.
pub fn round_compensated<H: Half>(values: &[f32], out: &mut [H], comp: &mut [H]) {
    for ((x, h), c) in values.iter().zip(out).zip(comp) {
        *h = H::nearest(*x);
        *c = H::nearest(*x - h.widen());
    }
}

/// `into[j] = values[j]` widened, plus `comp[j]` when given.
pub fn widen<H: Half>(values: &[H], comp: Option<&[H]>, into: &mut [f32]) {
    match comp {
        Some(comp) => {
            for ((h, c), x) in values.iter().zip(comp).zip(into) {
                *x = h.widen() + c.widen();
            }
        }
        None => {
            for (h, x) in values.iter().zip(into) {
                *x = h.widen();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Stochastic rounding is unbiased: the mean of many roundings of one value is the
    /// value, where round-to-nearest would be off by the whole gap.
    fn unbiased<H: Half>(x: f32) {
        let n = 1 << 16;
        let values = vec![x; n];
        let mut out = vec![H::nearest(0.0); n];
        round_stochastic(&values, &mut out, 7, 2);
        let mean = out.iter().map(|h| h.widen() as f64).sum::<f64>() / n as f64;
        let near = H::nearest(x).widen() as f64;
        let gap = (near - x as f64).abs();
        assert!(gap > 0.0, "{x} must not be representable");
        assert!((mean - x as f64).abs() < 0.05 * gap, "mean {mean} of roundings of {x} (nearest {near})");
        // Only the two neighbours occur.
        let lo = out.iter().map(|h| h.widen()).fold(f32::INFINITY, f32::min);
        let hi = out.iter().map(|h| h.widen()).fold(f32::NEG_INFINITY, f32::max);
        assert!(lo <= x && x <= hi && lo < hi, "{lo} {x} {hi}");
    }

    #[test]
    fn stochastic_rounding_is_unbiased_in_bf16_and_f16() {
        for x in [1.0 + 1.0 / 1024.0, -3.3e-3, 1234.567, 1.0e-6] {
            unbiased::<bf16>(x);
        }
        for x in [1.0 + 1.0 / 4096.0, -3.3e-3, 1234.56, 3.0e-6] {
            unbiased::<f16>(x);
        }
    }

    #[test]
    fn stochastic_rounding_keeps_representable_values_and_specials() {
        let values = [0.0, -0.0, 1.0, -2.5, f32::INFINITY, f32::NEG_INFINITY];
        let mut out = [bf16::ZERO; 6];
        round_stochastic(&values, &mut out, 1, 1);
        assert_eq!(out.map(|h| h.to_f32()), values);
        let mut out = [f16::ZERO; 6];
        round_stochastic(&values, &mut out, 1, 1);
        assert_eq!(out.map(|h| h.to_f32()), values);
        let mut nan = [bf16::ZERO];
        round_stochastic(&[f32::NAN], &mut nan, 1, 1);
        assert!(nan[0].is_nan());
    }

    #[test]
    fn the_bits_depend_on_seed_and_index_only() {
        let values: Vec<f32> = (0..300_000).map(|i| (i as f32).sin() * 1e-2).collect();
        let mut one = vec![bf16::ZERO; values.len()];
        let mut four = vec![bf16::ZERO; values.len()];
        round_stochastic(&values, &mut one, 42, 1);
        round_stochastic(&values, &mut four, 42, 4);
        assert_eq!(one, four);
        let mut other = vec![bf16::ZERO; values.len()];
        round_stochastic(&values, &mut other, 43, 1);
        assert_ne!(one, other);
    }

    #[test]
    fn compensation_keeps_what_rounding_lost() {
        let values: Vec<f32> = (0..1000).map(|i| 1.0 + i as f32 * 1e-5).collect();
        let (mut w, mut c) = (vec![bf16::ZERO; 1000], vec![bf16::ZERO; 1000]);
        round_compensated(&values, &mut w, &mut c);
        let mut back = vec![0f32; 1000];
        widen(&w, Some(&c), &mut back);
        for (x, y) in values.iter().zip(&back) {
            // Two bf16s carry 16 mantissa bits: far closer than one bf16's 2^-8.
            assert!((x - y).abs() <= x.abs() * 2f32.powi(-15), "{x} came back as {y}");
        }
        // Small updates accumulate in the compensation instead of vanishing.
        let (mut w, mut c) = (vec![bf16::ONE], vec![bf16::ZERO]);
        let mut x = [0f32];
        for _ in 0..100 {
            widen(&w, Some(&c), &mut x);
            x[0] += 1e-4;
            round_compensated(&x, &mut w, &mut c);
        }
        widen(&w, Some(&c), &mut x);
        // Each step rounds the compensation too (2^-17 relative): 100 steps stay within 1e-3.
        assert!((x[0] - 1.01).abs() < 1e-3, "100 steps of 1e-4 from 1.0 reached {}", x[0]);
        // Round to nearest alone loses every one of them (1e-4 is under half of bf16's 2^-7 at 1.0).
        let mut plain = [bf16::ONE];
        for _ in 0..100 {
            let x = [plain[0].to_f32() + 1e-4];
            round_nearest(&x, &mut plain);
        }
        assert_eq!(plain[0], bf16::ONE);
    }

    #[test]
    fn f16_neighbours_step_through_zero_and_signs() {
        assert_eq!(next_bits(0x0000, true), 0x0001);
        assert_eq!(next_bits(0x8000, false), 0x8001);
        assert_eq!(next_bits(0x3c00, true), 0x3c01);
        assert_eq!(next_bits(0x3c00, false), 0x3bff);
        assert_eq!(next_bits(0xbc00, true), 0xbbff);
        assert_eq!(next_bits(0xbc00, false), 0xbc01);
    }
}
