//! Dynamic tree quantization (Dettmers et al. 2021, *8-bit Optimizers via Block-wise
//! Quantization*, section 2.3): 256 values spread over seven (signed) or eight (unsigned)
//! decades, so small and large moments both keep about two significant digits.
//!
//! A code's bits read as: the sign (signed map only), then a run of `e` zeros giving the
//! decade `10^-e`, then an indicator `1`, then the remaining bits as a linear fraction in
//! `[0.1, 1]`. The more zeros, the fewer fraction bits: the map is fine near 1 and coarse
//! near 0, which is how Adam's moments are distributed within a block after dividing by the
//! block's absolute maximum.
//!
//! | map | decades `e` | fraction levels per decade | zeros | values |
//! |---|---|---|---|---|
//! | signed (first moment) | 0..=6 | 2^(6−e): 64, 32, …, 1 | +0 and −0 | ±127, 0, 0 |
//! | unsigned (second moment) | 0..=7 | 2^(7−e): 128, 64, …, 1 | one | 255 positive, 0 |
//!
//! Level `j` of `k` in decade `e` is `10^-e · (0.1 + 0.9·(j + 1)/k)`: the upper end of the
//! `j`-th of `k` equal bins of `[0.1, 1]`. Taking upper ends (bitsandbytes takes the bin
//! middles and appends 1.0 in place of −0) puts ±1 in the map, so each block's absmax element
//! is stored exactly, and keeps the signed map symmetric: `values[i] = −values[255 − i]`.
//! The values are evaluated in f32 as `10^-e·0.1 + (10^-e·0.9/k)·(j + 1)`, an expression a
//! vectorized decoder can repeat bit for bit ([`Tree`]).
//!
//! A code is an index into the sorted values. Encoding finds the nearest value with one
//! table lookup on the float's top 16 bits (exponent and 7 mantissa bits, a bucket 0.8%
//! wide, narrower than the map's spacing): the entry holds the code nearest to the bucket's
//! start and the low 16 bits of the one midpoint that may lie inside the bucket, and
//! comparing the float's own low 16 bits with those says whether to take the next code.
//! Exact, and one lookup per element instead of a binary search over 256 values.

/// How many values a map has.
pub const CODES: usize = 256;

/// Bits of an f32 dropped to form the bucket index (23 mantissa bits − 7 kept).
const BUCKET_SHIFT: u32 = 16;

/// The first bucket: floats from 2^-27 (7.5e-9) up share buckets; everything smaller falls
/// in this one, whose nearest value is 0 in both maps (their smallest non-zero values are
/// 1e-6 and 1e-7). Starting here keeps the table at 3.4 KiB, inside the L1 cache.
const LOW: u32 = (1.0f32 / (1u32 << 27) as f32).to_bits() >> BUCKET_SHIFT;

/// Number of buckets covering `[0, 1]`: from 2^-27 up to 1.0 inclusive.
pub(crate) const BUCKETS: usize = (1.0f32.to_bits() >> BUCKET_SHIFT) as usize + 1 - LOW as usize;

/// A lookup entry's low half when no midpoint lies in its bucket: no float's low 16 bits
/// are above it.
const NO_MID: u32 = 0xFFFF;

/// A sorted 256-value quantization map with a fast nearest-value encoder.
#[derive(Clone)]
pub struct QuantMap {
    values: [f32; CODES],
    signed: bool,
    /// Code of the smallest non-negative value: 128 (the +0) for the signed map, 0 otherwise.
    zero: u8,
    /// Per bucket of non-negative floats: `code << 16 | low`, the code of the value nearest
    /// to the bucket's start and the low 16 bits of the midpoint between it and the next
    /// value if that midpoint lies in the bucket (its top 16 bits are then the bucket's),
    /// else [`NO_MID`].
    lut: Box<[u32; BUCKETS]>,
    /// The arithmetic form of the values, for a vectorized decoder.
    tree: Tree,
}

impl std::fmt::Debug for QuantMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuantMap").field("signed", &self.signed).finish_non_exhaustive()
    }
}

impl QuantMap {
    /// The signed dynamic tree map (for Adam's first moment).
    pub fn signed() -> Self {
        let tree = Tree::new(6);
        let mut values = Vec::with_capacity(CODES);
        for k in 1..128 {
            values.push(tree.magnitude(k));
            values.push(-tree.magnitude(k));
        }
        values.extend([0.0, -0.0]);
        Self::from_values(values, true, tree)
    }

    /// The unsigned dynamic tree map (for Adam's second moment, which is never negative).
    pub fn unsigned() -> Self {
        let tree = Tree::new(7);
        let mut values: Vec<f32> = (1..256).map(|k| tree.magnitude(k)).collect();
        values.push(0.0);
        Self::from_values(values, false, tree)
    }

    fn from_values(mut list: Vec<f32>, signed: bool, tree: Tree) -> Self {
        assert_eq!(list.len(), CODES, "a dynamic map has 256 values");
        list.sort_by(f32::total_cmp); // −0 before +0
        let mut values = [0f32; CODES];
        values.copy_from_slice(&list);
        let zero = if signed { 128 } else { 0 };
        // mids[c]: between values[c] and values[c + 1]; none above the last value.
        let mut mids = [f32::INFINITY; CODES];
        for c in zero..CODES - 1 {
            mids[c] = 0.5 * (values[c] + values[c + 1]);
        }
        let mut lut = Box::new([0u32; BUCKETS]);
        let mut c = zero;
        // Everything below the first bucket's start rounds to 0.
        assert!(mids[zero] > f32::from_bits(LOW << BUCKET_SHIFT));
        for b in 0..BUCKETS {
            let start = f32::from_bits((b as u32 + LOW) << BUCKET_SHIFT);
            while c + 1 < CODES && values[c + 1] <= start {
                c += 1;
            }
            let nearest = if start > mids[c] { c + 1 } else { c };
            // Every float in the bucket is below the next bucket's start: at most one
            // midpoint may lie in between, or one comparison would not do.
            let end = f32::from_bits((b as u32 + LOW + 1) << BUCKET_SHIFT);
            let inside = (nearest..CODES - 1).take_while(|&i| mids[i] < end).count();
            assert!(inside <= 1, "bucket {b} holds {inside} midpoints");
            let low = if inside == 1 { mids[nearest].to_bits() & 0xFFFF } else { NO_MID };
            lut[b] = (nearest as u32) << 16 | low;
        }
        Self { values, signed, zero: zero as u8, lut, tree }
    }

    /// The 256 values, sorted; a code is an index into them.
    pub fn values(&self) -> &[f32; CODES] {
        &self.values
    }

    /// Whether the map holds negative values.
    pub fn is_signed(&self) -> bool {
        self.signed
    }

    /// The value of `code`.
    #[inline(always)]
    pub fn decode(&self, code: u8) -> f32 {
        self.values[code as usize]
    }

    /// The code of the value nearest to `x`, which should lie in `[−1, 1]` (`[0, 1]` for the
    /// unsigned map; negatives encode as 0 there). Values outside the range take the nearest
    /// end; ties go to the smaller magnitude.
    #[inline(always)]
    pub fn encode(&self, x: f32) -> u8 {
        let c = self.nearest_magnitude(x.abs());
        // Branch-free: the hot loop encodes random signs.
        let negative = x < 0.0;
        match (negative, self.signed) {
            (true, true) => (CODES - 1 - c) as u8,
            (true, false) => self.zero,
            (false, _) => c as u8,
        }
    }

    /// The code (≥ `zero`) of the non-negative value nearest to `a` (`a ≥ 0` or NaN).
    #[inline(always)]
    fn nearest_magnitude(&self, a: f32) -> usize {
        let entry = self.lut[bucket(a)];
        (entry >> 16) as usize + usize::from(a.to_bits() & 0xFFFF > entry & 0xFFFF)
    }

    /// The tables a vectorized encoder reads: the 256 values and the lookup table.
    pub(crate) fn tables(&self) -> (&[f32; CODES], &[u32; BUCKETS]) {
        (&self.values, &self.lut)
    }

    /// The values' arithmetic form, for a vectorized decoder.
    pub(crate) fn tree(&self) -> &Tree {
        &self.tree
    }

    /// The largest distance between neighbouring values: twice the worst rounding error of
    /// a normalized value in `[−1, 1]` (or `[0, 1]`).
    pub fn max_gap(&self) -> f32 {
        self.values.windows(2).map(|w| w[1] - w[0]).fold(0.0, f32::max)
    }
}

/// The lookup-table bucket of a non-negative float: its top 16 bits, clamped to the first
/// bucket below and to 1.0's above.
#[inline(always)]
pub(crate) fn bucket(a: f32) -> usize {
    ((a.to_bits() >> BUCKET_SHIFT).max(LOW) - LOW).min(BUCKETS as u32 - 1) as usize
}

/// For a vectorized encoder: bits of an f32 dropped to form the bucket index, the first
/// bucket's top bits, and the last bucket (1.0's).
pub(crate) const BUCKET_BITS: (u32, u32, u32) = (BUCKET_SHIFT, LOW, (BUCKETS - 1) as u32);

/// The dynamic tree's values as arithmetic, so that decoding needs no 256-entry table.
///
/// Sorted by size, the non-zero magnitudes `k = 1, 2, …` of a tree with `top + 1` decades
/// fill the decades from the smallest up, decade `e = top − L` holding the `2^L` magnitudes
/// with `L = ⌊log2 k⌋`. So magnitude `k` is level `j + 1 = k − 2^L + 1` of `2^L`:
///
/// ```text
/// magnitude(k) = first[L] + step[L]·(j + 1)    first[L] = 10^-e·0.1, step[L] = 10^-e·0.9 / 2^L
/// ```
///
/// evaluated in f32 (a product, then a sum). The map's values are made by this very
/// expression, so a decoder that evaluates it (eight at a time, with `L` read from the
/// exponent of `k` as a float) gives the table's bits exactly.
#[derive(Debug, Clone)]
pub(crate) struct Tree {
    /// `first[L]` at slot `(127 + L) mod 8`: the biased exponent of `k` as an f32, mod 8.
    pub first: [f32; 8],
    /// `step[L]`, in the same slots.
    pub step: [f32; 8],
}

impl Tree {
    /// A tree with decades `0..=top` (at most 7: eight slots).
    fn new(top: i32) -> Self {
        assert!((0..8).contains(&top));
        let (mut first, mut step) = ([0f32; 8], [0f32; 8]);
        for l in 0..=top {
            let scale = 10f64.powi(l - top);
            let slot = (127 + l as usize) % 8;
            first[slot] = (scale * 0.1) as f32;
            step[slot] = (scale * 0.9 / f64::from(1u32 << l)) as f32;
        }
        Self { first, step }
    }

    /// Non-zero magnitude `k` (1-based, in increasing order).
    fn magnitude(&self, k: u32) -> f32 {
        let l = 31 - k.leading_zeros();
        let slot = (127 + l as usize) % 8;
        self.first[slot] + self.step[slot] * (k - (1 << l) + 1) as f32
    }
}

/// Block-wise quantization of `x` with `map`: one absmax per `block` elements, written to
/// `absmax`, and one code per element written to `codes`. Used by the tests and the
/// benchmark's round trip; the optimizer fuses the same arithmetic into its step.
pub fn quantize_blockwise(map: &QuantMap, x: &[f32], block: usize, codes: &mut [u8], absmax: &mut [f32]) {
    for ((xs, cs), am) in x.chunks(block).zip(codes.chunks_mut(block)).zip(absmax.iter_mut()) {
        let max = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
        *am = max;
        let inv = if max > 0.0 { 1.0 / max } else { 0.0 };
        for (c, &v) in cs.iter_mut().zip(xs) {
            *c = map.encode(v * inv);
        }
    }
}

/// The inverse of [`quantize_blockwise`]: `x[i] = map[codes[i]] · absmax[i / block]`.
pub fn dequantize_blockwise(map: &QuantMap, codes: &[u8], absmax: &[f32], block: usize, x: &mut [f32]) {
    for ((xs, cs), &am) in x.chunks_mut(block).zip(codes.chunks(block)).zip(absmax) {
        for (v, &c) in xs.iter_mut().zip(cs) {
            *v = map.decode(c) * am;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The nearest value's code by exhaustive search (ties to the smaller magnitude).
    fn nearest(map: &QuantMap, x: f32) -> f32 {
        let mut best = map.values[0];
        for &v in map.values.iter() {
            let (d, db) = ((v - x).abs(), (best - x).abs());
            if d < db || (d == db && v.abs() < best.abs()) {
                best = v;
            }
        }
        best
    }

    #[test]
    fn maps_are_sorted_with_zero_and_one() {
        for map in [QuantMap::signed(), QuantMap::unsigned()] {
            let v = map.values();
            assert_eq!(v.len(), 256);
            assert!(v.windows(2).all(|w| w[0] <= w[1]), "sorted");
            assert!(v.contains(&0.0) && v.contains(&1.0), "0 and 1 present");
            assert_eq!(v[255], 1.0);
            assert_eq!(map.decode(map.zero), 0.0);
        }
        let s = QuantMap::signed();
        assert_eq!(s.values()[0], -1.0);
        for i in 0..256 {
            assert_eq!(s.values()[i], -s.values()[255 - i], "signed map symmetric at {i}");
        }
        // Distinct apart from the two zeros: 254 non-zero magnitudes pair up as ±127.
        assert_eq!(s.values().windows(2).filter(|w| w[0] == w[1]).count(), 1);
        let u = QuantMap::unsigned();
        assert!(u.values().windows(2).all(|w| w[0] < w[1]), "unsigned map strictly increasing");
        assert_eq!(u.values()[0], 0.0);
        // The smallest non-zero magnitudes: 10^-6 (signed), 10^-7 (unsigned).
        assert!((s.values()[129] - 1e-6).abs() < 1e-12, "{}", s.values()[129]);
        assert!((u.values()[1] - 1e-7).abs() < 1e-13, "{}", u.values()[1]);
        // Resolution near 1: 64 (signed) and 128 (unsigned) levels over [0.1, 1].
        assert!((s.max_gap() - 0.9 / 64.0).abs() < 1e-6, "{}", s.max_gap());
        assert!((u.max_gap() - 0.9 / 128.0).abs() < 1e-6, "{}", u.max_gap());
    }

    #[test]
    fn every_code_round_trips() {
        for map in [QuantMap::signed(), QuantMap::unsigned()] {
            for c in 0..=255u8 {
                let v = map.decode(c);
                assert_eq!(map.decode(map.encode(v)), v, "code {c} ({v}) signed {}", map.signed);
            }
        }
    }

    /// The table-driven encoder agrees with an exhaustive nearest search on random inputs
    /// and just either side of every midpoint (where a wrong bucket would show).
    #[test]
    fn encode_is_the_nearest_value() {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for map in [QuantMap::signed(), QuantMap::unsigned()] {
            let lo = if map.signed { -1.0 } else { 0.0 };
            let mut xs: Vec<f32> = Vec::new();
            for _ in 0..200_000 {
                let u = (next() >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
                // Half uniform, half log-uniform over 8 decades (where the small codes are).
                let x = if next() & 1 == 0 { lo + (1.0 - lo) * u } else { 10f32.powf(-8.0 * u) };
                xs.push(if map.signed && next() & 1 == 0 { -x } else { x });
            }
            for w in map.values.windows(2) {
                let mid = 0.5 * (w[0] + w[1]);
                xs.extend([mid, f32::from_bits(mid.to_bits() + 1), f32::from_bits(mid.to_bits().saturating_sub(1))]);
            }
            xs.extend([0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30, 1.5, -1.5]);
            for x in xs {
                let x = if map.signed { x } else { x.abs() };
                let got = map.decode(map.encode(x));
                let want = nearest(&map, x.clamp(-1.0, 1.0));
                // Exact ties (x on a midpoint) may differ by the rounding of the distances.
                assert!(
                    (got - x).abs() <= (want - x).abs() + f32::EPSILON * x.abs(),
                    "x = {x:e}: encoded to {got:e}, nearest is {want:e} (signed {})",
                    map.signed
                );
            }
        }
    }

    /// The encoder of the `cuda` step (kernels/adam_8bit.cu's `encode_signed` and
    /// `encode_unsigned`), in Rust: the code of |x| is the map's first non-negative code plus
    /// how many midpoints between the non-negative values lie below |x|, found by an 8-probe
    /// binary search over the midpoints padded with +inf to 256; NaN takes the top code; a
    /// negative x the mirrored code (signed) or 0 (unsigned).
    fn encode_by_search(map: &QuantMap, x: f32) -> u8 {
        let zero = map.zero as usize;
        let mut mids = [f32::INFINITY; CODES];
        for (i, mid) in mids.iter_mut().enumerate().take(CODES - 1 - zero) {
            *mid = 0.5 * (map.values[zero + i] + map.values[zero + i + 1]);
        }
        let a = x.abs();
        let c = if a.is_nan() {
            CODES - 1
        } else {
            let mut lo = 0;
            let mut step = 128;
            while step > 0 {
                if mids[lo + step - 1] < a {
                    lo += step;
                }
                step >>= 1;
            }
            zero + lo
        };
        match (x < 0.0, map.signed) {
            (true, true) => (CODES - 1 - c) as u8,
            (true, false) => 0,
            (false, _) => c as u8,
        }
    }

    /// The GPU's search gives every input the lookup table's code: at and either side of
    /// every bucket edge and every midpoint (where the two could part), at zeros, subnormals,
    /// NaNs, infinities and values above 1, over a sweep of the whole f32 range, and on random
    /// bit patterns.
    #[test]
    fn the_gpus_search_is_the_lookup_table() {
        let mut xs: Vec<f32> = Vec::new();
        let near = |x: f32, xs: &mut Vec<f32>| {
            for d in 0..=3u32 {
                xs.extend([f32::from_bits(x.to_bits() + d), f32::from_bits(x.to_bits().saturating_sub(d))]);
            }
        };
        for b in 0..BUCKETS as u32 + 2 {
            near(f32::from_bits((b + LOW) << BUCKET_SHIFT), &mut xs);
        }
        for map in [QuantMap::signed(), QuantMap::unsigned()] {
            for w in map.values.windows(2) {
                near(0.5 * (w[0] + w[1]), &mut xs);
                near(w[0].abs(), &mut xs);
            }
        }
        xs.extend([0.0, 1.0, 1.5, 1e-30, 1e-45, f32::MIN_POSITIVE, f32::MAX, f32::INFINITY, f32::NAN]);
        xs.extend([f32::from_bits(0x7F80_0001), f32::from_bits(0x7FFF_FFFF)]); // NaN payloads
        xs.extend((0..1u64 << 20).map(|i| f32::from_bits((i * 4099) as u32 & 0x7FFF_FFFF)));
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        for _ in 0..1 << 20 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            xs.push(f32::from_bits((state >> 32) as u32 & 0x7FFF_FFFF));
        }
        for map in [QuantMap::signed(), QuantMap::unsigned()] {
            for &a in &xs {
                for x in [a, -a] {
                    let (want, got) = (map.encode(x), encode_by_search(&map, x));
                    assert_eq!(got, want, "x = {x:e} ({:#010x}), signed {}", x.to_bits(), map.signed);
                }
            }
        }
    }

    /// Round trip through block-wise quantization: every element within half the local gap
    /// of the map (scaled by its block's absmax), so a block's largest relative error is at
    /// most half the map's largest gap; zeros and each block's absmax element exact.
    #[test]
    fn blockwise_round_trip_is_within_the_maps_resolution() {
        let mut state = 12345u64;
        let mut normal = || {
            // Box–Muller from two xorshift uniforms.
            let mut u = || {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                ((state >> 11) as f64 + 0.5) / (1u64 << 53) as f64
            };
            let (a, b) = (u(), u());
            ((-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos()) as f32
        };
        let block = 256;
        let n = 64 * block + 77; // a short last block too
        for (signed, spread) in [(true, 1.0f32), (true, 1e-4), (false, 1.0), (false, 1e-6)] {
            let map = if signed { QuantMap::signed() } else { QuantMap::unsigned() };
            let mut x: Vec<f32> = (0..n)
                .map(|i| {
                    let g = normal() * spread;
                    // Every 7th a zero; the second moment is a square (heavy-tailed, ≥ 0).
                    if i % 7 == 0 {
                        0.0
                    } else if signed {
                        g
                    } else {
                        g * g
                    }
                })
                .collect();
            x[block..2 * block].fill(0.0); // an all-zero block
            let blocks = n.div_ceil(block);
            let (mut codes, mut absmax, mut back) = (vec![0u8; n], vec![0f32; blocks], vec![0f32; n]);
            quantize_blockwise(&map, &x, block, &mut codes, &mut absmax);
            dequantize_blockwise(&map, &codes, &absmax, block, &mut back);
            let half_gap = 0.5 * map.max_gap();
            for (b, (xs, ys)) in x.chunks(block).zip(back.chunks(block)).enumerate() {
                let am = absmax[b];
                let mut worst = 0f32;
                for (&v, &y) in xs.iter().zip(ys) {
                    if v == 0.0 {
                        assert_eq!(y, 0.0, "zero stays zero (block {b})");
                        continue;
                    }
                    if v.abs() == am {
                        assert_eq!(y, v, "the absmax element is exact (block {b})");
                    }
                    // The local bound: half the distance between the values bracketing v/am.
                    let a = v / am;
                    let i = map.values.partition_point(|&m| m < a).clamp(1, 255);
                    let local = 0.5 * (map.values[i] - map.values[i - 1]) * am;
                    assert!((y - v).abs() <= local * 1.0001 + 1e-30, "block {b}: {v:e} → {y:e}, bound {local:e}");
                    worst = worst.max((y - v).abs() / am);
                }
                assert!(worst <= half_gap * 1.0001, "block {b}: relative error {worst} > {half_gap}");
            }
            assert!(absmax[1] == 0.0 && back[block..2 * block].iter().all(|&v| v == 0.0));
        }
    }
}
