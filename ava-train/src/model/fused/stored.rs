//! The element types the fused ops store (f32, f64, bf16, f16) and the type each computes in:
//! f32 and f64 compute in themselves, bf16 and f16 in f32, each element widened as it is read
//! and rounded once as it is written.
//!
//! The conversions are written here rather than taken from `half`: its `bf16::from_f32` and
//! `f16::from_f32`/`to_f32` branch per element (on NaN, and on a run-time CPU feature check
//! for f16), so loops of them do not vectorize, and on the benchmark model they took longer
//! than the ops' arithmetic. These are branch-free selects that compile to SIMD on any
//! x86-64; they round to nearest with ties to even, as `half` does, and tests compare them
//! with `half` over every half value and across the f32 range.

use half::{bf16, f16};

use super::Real;

/// An element type the fused ops store, and the type they compute in.
pub(crate) trait Stored: candle_core::WithDType + Copy + Send + Sync {
    /// The compute type.
    type C: Real;
    /// The value in the compute type (exact).
    fn load(self) -> Self::C;
    /// The compute-type value rounded to this type (to nearest, ties to even).
    fn store(c: Self::C) -> Self;
}

impl Stored for f32 {
    type C = f32;
    #[inline(always)]
    fn load(self) -> f32 {
        self
    }
    #[inline(always)]
    fn store(c: f32) -> f32 {
        c
    }
}

impl Stored for f64 {
    type C = f64;
    #[inline(always)]
    fn load(self) -> f64 {
        self
    }
    #[inline(always)]
    fn store(c: f64) -> f64 {
        c
    }
}

impl Stored for bf16 {
    type C = f32;
    #[inline(always)]
    fn load(self) -> f32 {
        bf16_to_f32(self.to_bits())
    }
    #[inline(always)]
    fn store(c: f32) -> bf16 {
        bf16::from_bits(f32_to_bf16(c))
    }
}

impl Stored for f16 {
    type C = f32;
    #[inline(always)]
    fn load(self) -> f32 {
        f16_to_f32(self.to_bits())
    }
    #[inline(always)]
    fn store(c: f32) -> f16 {
        f16::from_bits(f32_to_f16(c))
    }
}

/// bf16 bits → f32: bf16 is the top half of an f32 (a NaN stays a NaN).
#[inline(always)]
pub(crate) fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// f32 → bf16 bits, to nearest with ties to even; a NaN becomes a quiet NaN. Adding 0x7fff
/// plus the kept part's lowest bit carries into the kept part exactly when the dropped half
/// is above the midpoint, or at it with an odd kept part; a carry out of the largest finite
/// values gives infinity, as rounding should.
#[inline(always)]
pub(crate) fn f32_to_bf16(c: f32) -> u16 {
    let x = c.to_bits();
    let rounded = x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16;
    let quiet_nan = (x >> 16) | 0x40;
    (if x & 0x7fff_ffff > 0x7f80_0000 { quiet_nan } else { rounded }) as u16
}

/// f16 bits → f32 (exact). The exponent is rebiased from 15 to 127; infinities and NaNs keep
/// an all-ones exponent; subnormals (m · 2⁻²⁴) are made by subtracting 2⁻¹⁴ from the normal
/// f32 2⁻¹⁴ · (1 + m/2¹⁰), which is exact.
#[inline(always)]
pub(crate) fn f16_to_f32(h: u16) -> f32 {
    let h = u32::from(h);
    let sign = (h & 0x8000) << 16;
    let body = (h & 0x7fff) << 13; // exponent and mantissa at their f32 places, bias 15
    let exp = h & 0x7c00;
    let normal = body + (112 << 23); // bias 15 → 127
    let special = body + (224 << 23); // exponent 31 → 255
    let two_m14 = f32::from_bits(113 << 23); // 2⁻¹⁴
    let subnormal = (f32::from_bits(body + (113 << 23)) - two_m14).to_bits();
    let bits = if exp == 0x7c00 {
        special
    } else if exp == 0 {
        subnormal
    } else {
        normal
    };
    f32::from_bits(bits | sign)
}

/// f32 → f16 bits, to nearest with ties to even; overflow gives infinity and a NaN a quiet
/// NaN. Normal results: rebias the exponent from 127 to 15 and drop 13 mantissa bits with the
/// same carry trick as [`f32_to_bf16`]. Results below 2⁻¹⁴ (subnormal or zero): adding 0.5
/// makes the hardware round |c| to a multiple of 2⁻²⁴, the f16 subnormal step, and the sum's
/// low bits are that multiple (1024 when it rounds up to the smallest normal, which is also
/// its f16 encoding).
#[inline(always)]
pub(crate) fn f32_to_f16(c: f32) -> u16 {
    let x = c.to_bits();
    let sign = (x >> 16) & 0x8000;
    let a = x & 0x7fff_ffff;
    let r = a.wrapping_sub(112 << 23); // bias 127 → 15 (meaningful for a ≥ 2⁻¹⁴)
    let normal = (r.wrapping_add(0x0fff + ((r >> 13) & 1)) >> 13).min(0x7c00);
    let subnormal = (f32::from_bits(a) + 0.5).to_bits().wrapping_sub(126 << 23);
    let special = if a > 0x7f80_0000 { 0x7e00 } else { 0x7c00 };
    let bits = if a >= 0x7f80_0000 {
        special
    } else if a < (113 << 23) {
        subnormal
    } else {
        normal
    };
    (bits | sign) as u16
}

/// Runs `$body` with the type alias `$s` bound to the [`Stored`] type of `$dtype` (a
/// `DType`); other types are an error naming `$op`.
macro_rules! with_stored {
    ($dtype:expr, $op:expr, |$s:ident| $body:expr) => {
        match $dtype {
            candle_core::DType::F32 => {
                type $s = f32;
                $body
            }
            candle_core::DType::F64 => {
                type $s = f64;
                $body
            }
            candle_core::DType::BF16 => {
                type $s = half::bf16;
                $body
            }
            candle_core::DType::F16 => {
                type $s = half::f16;
                $body
            }
            dt => candle_core::bail!("{}: {dt:?} is not supported (f32, f64, bf16 or f16)", $op),
        }
    };
}
pub(crate) use with_stored;

#[cfg(test)]
mod tests {
    use super::*;

    /// Same value, or both NaN (`half` keeps a NaN's payload, these quiet it).
    fn same(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }

    #[test]
    fn widening_matches_half_for_every_value() {
        for h in 0..=u16::MAX {
            let (b, f) = (bf16::from_bits(h), f16::from_bits(h));
            assert!(same(bf16_to_f32(h), b.to_f32()), "bf16 {h:#06x}");
            assert!(same(f16_to_f32(h), f.to_f32()), "f16 {h:#06x}");
        }
    }

    /// Every f32 whose low 16 bits are near the bf16 rounding point or the f16 one (13 bits),
    /// for every upper part, plus a stride through all bit patterns.
    fn f32_cases() -> impl Iterator<Item = u32> {
        let near_ties = (0..=u16::MAX).flat_map(|hi| {
            let hi = u32::from(hi) << 16;
            [0, 1, 0x7fff, 0x8000, 0x8001, 0xffff, 0x0fff, 0x1000, 0x1001, 0x3000, 0x5000, 0xf000]
                .into_iter()
                .map(move |lo| hi | lo)
        });
        near_ties.chain((0..u32::MAX / 4099).map(|i| i * 4099))
    }

    #[test]
    fn rounding_matches_half_across_the_f32_range() {
        for bits in f32_cases() {
            let c = f32::from_bits(bits);
            let (b, want_b) = (bf16::from_bits(f32_to_bf16(c)), bf16::from_f32(c));
            assert!(same(b.to_f32(), want_b.to_f32()), "bf16 of {c:e} ({bits:#010x}): {b} vs {want_b}");
            let (f, want_f) = (f16::from_bits(f32_to_f16(c)), f16::from_f32(c));
            assert!(same(f.to_f32(), want_f.to_f32()), "f16 of {c:e} ({bits:#010x}): {f} vs {want_f}");
        }
    }
}
