//! The two passes of an 8-bit step over one block, in plain Rust and with AVX2.
//!
//! 1. [`update_block`]: dequantize m and v, the fp32 Adam update of m, v and θ, and the new
//!    moments' absolute maxima (the moments stay in an fp32 scratch block);
//! 2. [`encode_moments`]: requantize both moments against their new absmax, in one loop
//!    (two independent lookups per element to overlap).
//!
//! Per element the work is two decodes and, per moment, a bucket lookup and a midpoint
//! comparison. The scalar loop reads the decoded values from the 256-entry tables; the AVX2
//! versions decode eight codes at once with the maps' arithmetic form ([`quant::Tree`]:
//! two 8-entry permutes instead of a gather from the table) and encode with one gather.
//! Both evaluate the same operations in the same order without fused multiply-adds, so
//! they produce the same bits, and a run does not depend on the CPU.

use crate::quant::{self, QuantMap};

/// The per-step constants, computed once in f64 (as torch's Python floats) and applied in f32.
pub(crate) struct Scalars {
    pub b1: f32,
    pub b2: f32,
    pub eps: f32,
    pub step_size: f32,
    pub bc2_sqrt: f32,
    /// `step_size·bc2_sqrt` and `eps·bc2_sqrt`: the 8-bit path's update with one division
    /// per element instead of two (see [`Scalars::adam_8bit`]).
    pub step_bc2: f32,
    pub eps_bc2: f32,
    pub decay: f32,
    /// Percentile clipping's factor on the gradient (1 when off or not needed).
    pub clip: f32,
}

impl Scalars {
    /// Moments, then parameter; returns the new moments. AdamW's exact arithmetic.
    #[inline(always)]
    pub fn adam(&self, w: &mut f32, g: f32, m: f32, v: f32) -> (f32, f32) {
        let g = g * self.clip;
        let m = self.b1 * m + (1.0 - self.b1) * g;
        let v = self.b2 * v + (1.0 - self.b2) * g * g;
        *w = *w * self.decay - self.step_size * m / (v.sqrt() / self.bc2_sqrt + self.eps);
        (m, v)
    }

    /// The same update as [`Scalars::adam`], rearranged for the 8-bit path:
    /// `step·m / (√v/√bc2 + ε) = (step·√bc2)·m / (√v + ε·√bc2)`. One division instead of
    /// two (the divider is what bounds this loop), at the cost of torch's exact rounding,
    /// which the quantized moments do not keep anyway.
    #[inline(always)]
    pub fn adam_8bit(&self, w: &mut f32, g: f32, m: f32, v: f32) -> (f32, f32) {
        let g = g * self.clip;
        let m = self.b1 * m + (1.0 - self.b1) * g;
        let v = self.b2 * v + (1.0 - self.b2) * g * g;
        *w = *w * self.decay - self.step_bc2 * m / (v.sqrt() + self.eps_bc2);
        (m, v)
    }
}

/// Whether the AVX2 passes can run here (checked once per process by std).
#[inline]
fn avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Pass 1 over one block of `w.len()` elements: m = signed[mc]·am, v = unsigned[vc]·av,
/// the Adam update of m, v and w, the new moments written to `ms` and `vs`. Returns
/// (max |m|, max v).
#[allow(clippy::too_many_arguments)]
pub(crate) fn update_block(
    s: &Scalars,
    signed: &QuantMap,
    unsigned: &QuantMap,
    w: &mut [f32],
    g: &[f32],
    mc: &[u8],
    vc: &[u8],
    am: f32,
    av: f32,
    ms: &mut [f32],
    vs: &mut [f32],
) -> (f32, f32) {
    let n = w.len();
    assert!(g.len() == n && mc.len() == n && vc.len() == n && ms.len() == n && vs.len() == n);
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: AVX2 is present, and every slice has n elements (checked above).
        return unsafe { x86::update_block(s, signed, unsigned, w, g, mc, vc, am, av, ms, vs) };
    }
    update_scalar(s, signed, unsigned, w, g, mc, vc, am, av, ms, vs, (0.0, 0.0))
}

/// The scalar pass 1 (also the tail of the AVX2 one), starting from maxima `max`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn update_scalar(
    s: &Scalars,
    signed: &QuantMap,
    unsigned: &QuantMap,
    w: &mut [f32],
    g: &[f32],
    mc: &[u8],
    vc: &[u8],
    am: f32,
    av: f32,
    ms: &mut [f32],
    vs: &mut [f32],
    max: (f32, f32),
) -> (f32, f32) {
    let (mut max_m, mut max_v) = max;
    let items = w.iter_mut().zip(g).zip(mc).zip(vc).zip(ms.iter_mut()).zip(vs.iter_mut());
    for (((((w, &g), &mc), &vc), m), v) in items {
        (*m, *v) = s.adam_8bit(w, g, signed.decode(mc) * am, unsigned.decode(vc) * av);
        max_m = max_m.max(m.abs());
        max_v = max_v.max(*v);
    }
    (max_m, max_v)
}

/// Pass 2 for one moment: `codes[i] = map.encode(x[i]·inv)`. A step encodes both moments
/// with [`encode_moments`]; the tests check the vectorized single-map encoder with this.
#[cfg(test)]
fn encode_block(map: &QuantMap, x: &[f32], inv: f32, codes: &mut [u8]) {
    assert_eq!(x.len(), codes.len());
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: AVX2 is present, and both slices have the same length (checked above).
        return unsafe { x86::encode_block(map, x, inv, codes) };
    }
    for (c, &v) in codes.iter_mut().zip(x) {
        *c = map.encode(v * inv);
    }
}

/// Pass 2 for both moments at once (what a step does): `m_codes = signed.encode(m·inv_m)`,
/// `v_codes = unsigned.encode(v·inv_v)`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn encode_moments(
    signed: &QuantMap,
    m: &[f32],
    inv_m: f32,
    m_codes: &mut [u8],
    unsigned: &QuantMap,
    v: &[f32],
    inv_v: f32,
    v_codes: &mut [u8],
) {
    let n = m.len();
    assert!(m_codes.len() == n && v.len() == n && v_codes.len() == n);
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: AVX2 is present, and the four slices have n elements (checked above).
        return unsafe { x86::encode_moments(signed, m, inv_m, m_codes, unsigned, v, inv_v, v_codes) };
    }
    for i in 0..n {
        m_codes[i] = signed.encode(m[i] * inv_m);
        v_codes[i] = unsigned.encode(v[i] * inv_v);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{QuantMap, Scalars, quant, update_scalar};

    /// Eight codes (u8) widened to i32 lanes.
    #[inline(always)]
    unsafe fn load_codes(p: *const u8) -> __m256i {
        // SAFETY: the caller guarantees 8 readable bytes at p.
        unsafe { _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast())) }
    }

    /// Eight values of a dynamic tree map from their codes (i32 lanes, each < 256): the
    /// same f32 arithmetic that made the map's table ([`quant::Tree`]).
    #[inline(always)]
    unsafe fn decode(codes: __m256i, first: __m256, step: __m256, signed: bool) -> __m256 {
        // SAFETY (all below): register-only AVX2 operations; the caller has AVX2.
        unsafe {
            // The signed map's codes run −1 … −0, +0 … +1: magnitude index and sign.
            let (k, sign) = if signed {
                let negative = _mm256_cmpgt_epi32(_mm256_set1_epi32(128), codes);
                let low = _mm256_set1_epi32(127);
                let k = _mm256_xor_si256(_mm256_and_si256(codes, low), _mm256_and_si256(negative, low));
                (k, _mm256_and_si256(negative, _mm256_set1_epi32(i32::MIN)))
            } else {
                (codes, _mm256_setzero_si256())
            };
            let kf = _mm256_cvtepi32_ps(k); // exact: k < 256
            // k's biased exponent 127 + L picks the slot (permutes read it mod 8); 2^L is
            // kf with its mantissa cleared.
            let slot = _mm256_srli_epi32::<23>(_mm256_castps_si256(kf));
            let pow2 = _mm256_and_ps(kf, _mm256_castsi256_ps(_mm256_set1_epi32(0x7F80_0000)));
            let level = _mm256_add_ps(_mm256_sub_ps(kf, pow2), _mm256_set1_ps(1.0)); // j + 1, exact
            let value = _mm256_add_ps(
                _mm256_permutevar8x32_ps(first, slot),
                _mm256_mul_ps(_mm256_permutevar8x32_ps(step, slot), level),
            );
            let zero = _mm256_castsi256_ps(_mm256_cmpeq_epi32(k, _mm256_setzero_si256()));
            _mm256_or_ps(_mm256_andnot_ps(zero, value), _mm256_castsi256_ps(sign))
        }
    }

    /// See [`super::update_block`].
    ///
    /// # Safety
    /// AVX2 must be available and every slice must have `w.len()` elements.
    #[target_feature(enable = "avx2")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn update_block(
        s: &Scalars,
        signed: &QuantMap,
        unsigned: &QuantMap,
        w: &mut [f32],
        g: &[f32],
        mc: &[u8],
        vc: &[u8],
        am: f32,
        av: f32,
        ms: &mut [f32],
        vs: &mut [f32],
    ) -> (f32, f32) {
        let n = w.len();
        let full = n / 8 * 8;
        let (st, ut) = (signed.tree(), unsigned.tree());
        // SAFETY: four 8-float arrays.
        let (s_first, s_step, u_first, u_step) = unsafe {
            (
                _mm256_loadu_ps(st.first.as_ptr()),
                _mm256_loadu_ps(st.step.as_ptr()),
                _mm256_loadu_ps(ut.first.as_ptr()),
                _mm256_loadu_ps(ut.step.as_ptr()),
            )
        };
        let b1 = _mm256_set1_ps(s.b1);
        let one_b1 = _mm256_set1_ps(1.0 - s.b1);
        let b2 = _mm256_set1_ps(s.b2);
        let one_b2 = _mm256_set1_ps(1.0 - s.b2);
        let (eps, step, decay, clip) =
            (_mm256_set1_ps(s.eps_bc2), _mm256_set1_ps(s.step_bc2), _mm256_set1_ps(s.decay), _mm256_set1_ps(s.clip));
        let (amv, avv) = (_mm256_set1_ps(am), _mm256_set1_ps(av));
        let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
        let (mut max_m, mut max_v) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        while i < full {
            // SAFETY: i + 8 <= n for every slice.
            unsafe {
                let m_old = _mm256_mul_ps(decode(load_codes(mc.as_ptr().add(i)), s_first, s_step, true), amv);
                let v_old = _mm256_mul_ps(decode(load_codes(vc.as_ptr().add(i)), u_first, u_step, false), avv);
                let gv = _mm256_mul_ps(_mm256_loadu_ps(g.as_ptr().add(i)), clip);
                // The scalar order: b1·m + (1 − b1)·g ; b2·v + ((1 − b2)·g)·g
                let m = _mm256_add_ps(_mm256_mul_ps(b1, m_old), _mm256_mul_ps(one_b1, gv));
                let v = _mm256_add_ps(_mm256_mul_ps(b2, v_old), _mm256_mul_ps(_mm256_mul_ps(one_b2, gv), gv));
                // w·decay − (step·√bc2·m) / (√v + ε·√bc2), as Scalars::adam_8bit
                let den = _mm256_add_ps(_mm256_sqrt_ps(v), eps);
                let wp = w.as_mut_ptr().add(i);
                let wv = _mm256_sub_ps(
                    _mm256_mul_ps(_mm256_loadu_ps(wp), decay),
                    _mm256_div_ps(_mm256_mul_ps(step, m), den),
                );
                _mm256_storeu_ps(wp, wv);
                _mm256_storeu_ps(ms.as_mut_ptr().add(i), m);
                _mm256_storeu_ps(vs.as_mut_ptr().add(i), v);
                max_m = _mm256_max_ps(max_m, _mm256_and_ps(m, abs));
                max_v = _mm256_max_ps(max_v, v);
            }
            i += 8;
        }
        let mut lanes = [[0f32; 8]; 2];
        // SAFETY: two 8-float arrays.
        unsafe {
            _mm256_storeu_ps(lanes[0].as_mut_ptr(), max_m);
            _mm256_storeu_ps(lanes[1].as_mut_ptr(), max_v);
        }
        let max = (lanes[0].iter().fold(0f32, |a, &b| a.max(b)), lanes[1].iter().fold(0f32, |a, &b| a.max(b)));
        let (w, g, mc, vc) = (&mut w[full..], &g[full..], &mc[full..], &vc[full..]);
        update_scalar(s, signed, unsigned, w, g, mc, vc, am, av, &mut ms[full..], &mut vs[full..], max)
    }

    /// [`decode`] of 8 codes into `out`, for the tests.
    ///
    /// # Safety
    /// AVX2 must be available; `codes` and `out` hold 8 elements.
    #[cfg(test)]
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn decode_for_test(codes: &[u8], tree: &quant::Tree, signed: bool, out: &mut [f32]) {
        assert!(codes.len() == 8 && out.len() == 8);
        // SAFETY: 8 codes, 8 outputs, two 8-float tables.
        unsafe {
            let (first, step) = (_mm256_loadu_ps(tree.first.as_ptr()), _mm256_loadu_ps(tree.step.as_ptr()));
            _mm256_storeu_ps(out.as_mut_ptr(), decode(load_codes(codes.as_ptr()), first, step, signed));
        }
    }

    /// The constants of one map's vectorized encoder.
    struct Encoder<'a> {
        lut: &'a [u32; quant::BUCKETS],
        shift: __m128i,
        low: __m256i,
        last: __m256i,
        low16: __m256i,
        code_max: __m256i,
        abs: __m256,
        signed: bool,
    }

    impl<'a> Encoder<'a> {
        /// # Safety
        /// AVX2 must be available (the constants are AVX2 registers).
        #[inline(always)]
        unsafe fn new(map: &'a QuantMap) -> Self {
            let (shift, low, last) = quant::BUCKET_BITS;
            // SAFETY: register-only AVX2 operations; the caller guarantees AVX2.
            unsafe {
                Self {
                    lut: map.tables().1,
                    shift: _mm_cvtsi32_si128(shift as i32),
                    low: _mm256_set1_epi32(low as i32),
                    last: _mm256_set1_epi32(last as i32),
                    low16: _mm256_set1_epi32(0xFFFF),
                    code_max: _mm256_set1_epi32(255),
                    abs: _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF)),
                    signed: map.is_signed(),
                }
            }
        }

        /// Writes the codes of `x[..8]·inv` to `codes[..8]`.
        ///
        /// # Safety
        /// AVX2 must be available; 8 floats readable at `x`, 8 bytes writable at `codes`.
        #[inline(always)]
        unsafe fn encode8(&self, x: *const f32, inv: __m256, codes: *mut u8) {
            // SAFETY: the caller's guarantees; bucket indices are clamped into the table.
            unsafe {
                let xv = _mm256_mul_ps(_mm256_loadu_ps(x), inv);
                let a = _mm256_and_ps(xv, self.abs);
                let top = _mm256_srl_epi32(_mm256_castps_si256(a), self.shift);
                let b = _mm256_min_epu32(_mm256_sub_epi32(_mm256_max_epu32(top, self.low), self.low), self.last);
                let entry = _mm256_i32gather_epi32::<4>(self.lut.as_ptr().cast(), b);
                // code + 1 where a's low 16 bits are above the midpoint's (mask −1 there).
                let past = _mm256_cmpgt_epi32(
                    _mm256_and_si256(_mm256_castps_si256(a), self.low16),
                    _mm256_and_si256(entry, self.low16),
                );
                let c = _mm256_sub_epi32(_mm256_srli_epi32::<16>(entry), past);
                let negative = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LT_OQ>(xv, _mm256_setzero_ps()));
                let c = if self.signed {
                    _mm256_blendv_epi8(c, _mm256_sub_epi32(self.code_max, c), negative)
                } else {
                    // Negative input to the unsigned map: code 0 (the value 0).
                    _mm256_andnot_si256(negative, c)
                };
                // 8 × i32 (each < 256) → 8 bytes.
                let packed16 = _mm256_packus_epi32(c, c); // lanes: c0..3 c0..3 | c4..7 c4..7
                let packed8 = _mm256_packus_epi16(packed16, packed16);
                let lo = _mm256_castsi256_si128(packed8);
                let hi = _mm256_extracti128_si256::<1>(packed8);
                _mm_storel_epi64(codes.cast(), _mm_unpacklo_epi32(lo, hi));
            }
        }
    }

    /// See [`super::encode_block`].
    ///
    /// # Safety
    /// AVX2 must be available and `codes` must have `x.len()` elements.
    #[cfg(test)]
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn encode_block(map: &QuantMap, x: &[f32], inv: f32, codes: &mut [u8]) {
        let full = x.len() / 8 * 8;
        // SAFETY: this function runs with AVX2.
        let encoder = unsafe { Encoder::new(map) };
        let invv = _mm256_set1_ps(inv);
        for i in (0..full).step_by(8) {
            // SAFETY: i + 8 <= len of both.
            unsafe { encoder.encode8(x.as_ptr().add(i), invv, codes.as_mut_ptr().add(i)) };
        }
        for (c, &v) in codes[full..].iter_mut().zip(&x[full..]) {
            *c = map.encode(v * inv);
        }
    }

    /// See [`super::encode_moments`].
    ///
    /// # Safety
    /// AVX2 must be available and all four slices must have the same length.
    #[target_feature(enable = "avx2")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn encode_moments(
        signed: &QuantMap,
        m: &[f32],
        inv_m: f32,
        m_codes: &mut [u8],
        unsigned: &QuantMap,
        v: &[f32],
        inv_v: f32,
        v_codes: &mut [u8],
    ) {
        let full = m.len() / 8 * 8;
        // SAFETY: this function runs with AVX2.
        let (em, ev) = unsafe { (Encoder::new(signed), Encoder::new(unsigned)) };
        let (im, iv) = (_mm256_set1_ps(inv_m), _mm256_set1_ps(inv_v));
        for i in (0..full).step_by(8) {
            // SAFETY: i + 8 <= len of all four; the two gathers are independent, so they
            // overlap.
            unsafe {
                em.encode8(m.as_ptr().add(i), im, m_codes.as_mut_ptr().add(i));
                ev.encode8(v.as_ptr().add(i), iv, v_codes.as_mut_ptr().add(i));
            }
        }
        for i in full..m.len() {
            m_codes[i] = signed.encode(m[i] * inv_m);
            v_codes[i] = unsigned.encode(v[i] * inv_v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vectorized decoder gives every code the table's value, bit for bit.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_decode_is_the_table() {
        if !avx2() {
            return;
        }
        for map in [QuantMap::signed(), QuantMap::unsigned()] {
            let codes: Vec<u8> = (0..=255).collect();
            let mut got = [0f32; 256];
            for (chunk, out) in codes.chunks(8).zip(got.chunks_mut(8)) {
                // SAFETY: AVX2 checked above; 8 codes and 8 outputs.
                unsafe { x86::decode_for_test(chunk, map.tree(), map.is_signed(), out) };
            }
            for (c, (g, want)) in got.iter().zip(map.values()).enumerate() {
                assert_eq!(g.to_bits(), want.to_bits(), "code {c}, signed {}", map.is_signed());
            }
        }
    }

    /// The AVX2 passes give the scalar passes' bits (on a machine without AVX2 both calls
    /// take the scalar path and the test checks nothing new).
    #[test]
    fn vector_and_scalar_passes_agree_bit_for_bit() {
        let (signed, unsigned) = (QuantMap::signed(), QuantMap::unsigned());
        let s = Scalars {
            b1: 0.9,
            b2: 0.999,
            eps: 1e-8,
            step_size: 1e-3,
            bc2_sqrt: 0.05,
            step_bc2: 5e-5,
            eps_bc2: 5e-10,
            decay: 0.9999,
            clip: 0.75,
        };
        let mut state = 99u64;
        let mut u = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32
        };
        let n = 256 + 5; // a tail after the vector part
        let w0: Vec<f32> = (0..n).map(|_| u() - 0.5).collect();
        let g: Vec<f32> = (0..n).map(|i| if i % 9 == 0 { 0.0 } else { (u() - 0.5) * 1e-2 }).collect();
        let mc: Vec<u8> = (0..n).map(|_| (u() * 256.0) as u8).collect();
        let vc: Vec<u8> = (0..n).map(|_| (u() * 256.0) as u8).collect();
        let (mut w1, mut w2) = (w0.clone(), w0.clone());
        let (mut ms1, mut vs1, mut ms2, mut vs2) = (vec![0f32; n], vec![0f32; n], vec![0f32; n], vec![0f32; n]);
        let max1 = update_block(&s, &signed, &unsigned, &mut w1, &g, &mc, &vc, 0.02, 3e-5, &mut ms1, &mut vs1);
        let max2 =
            update_scalar(&s, &signed, &unsigned, &mut w2, &g, &mc, &vc, 0.02, 3e-5, &mut ms2, &mut vs2, (0.0, 0.0));
        assert_eq!(max1, max2);
        assert_eq!((&w1, &ms1, &vs1), (&w2, &ms2, &vs2));
        // Encoding: values of both signs, zeros, the maxima, midpoints and NaN.
        let mut x = ms1.clone();
        x.extend(signed.values().windows(2).map(|p| 0.02 * 0.5 * (p[0] + p[1])));
        x.extend([0.0, -0.0, f32::NAN, 0.02, -0.02, 1e-30]);
        for (map, xs, inv) in [(&signed, &x, 1.0 / 0.02), (&unsigned, &vs1, 1.0 / max1.1), (&unsigned, &x, 50.0)] {
            let mut c1 = vec![0u8; xs.len()];
            encode_block(map, xs, inv, &mut c1);
            let c2: Vec<u8> = xs.iter().map(|&v| map.encode(v * inv)).collect();
            assert_eq!(c1, c2, "signed {}", map.is_signed());
        }
        let (mut mc1, mut vc1) = (vec![0u8; n], vec![0u8; n]);
        encode_moments(&signed, &ms1, 1.0 / max1.0, &mut mc1, &unsigned, &vs1, 1.0 / max1.1, &mut vc1);
        assert_eq!(mc1, ms1.iter().map(|&v| signed.encode(v * (1.0 / max1.0))).collect::<Vec<_>>());
        assert_eq!(vc1, vs1.iter().map(|&v| unsigned.encode(v * (1.0 / max1.1))).collect::<Vec<_>>());
    }
}
