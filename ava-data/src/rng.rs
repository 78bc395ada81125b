//! A small deterministic random number generator: SplitMix64 seeding and xoshiro256**.
//!
//! Everything random in the data pipeline is a pure function of a seed and a few integers
//! (split, sequence index), derived with [`hash64`], so batches can be rebuilt in any order, on
//! any thread, and after a restart. The state is four `u64`s ([`Rng::state`]) so the trainer can
//! store it in a checkpoint.

/// The golden-ratio increment of SplitMix64.
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// One step of SplitMix64: advances `state` and returns the next output.
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(GOLDEN);
    finalize(*state)
}

/// A bijective scrambling of `x` (the SplitMix64 output function applied to `x + GOLDEN`).
pub fn mix(x: u64) -> u64 {
    finalize(x.wrapping_add(GOLDEN))
}

/// A well-mixed 64-bit hash of the pair `(a, b)`; chain it to derive independent streams,
/// e.g. `hash64(hash64(seed, stream), index)`. For a fixed `a` it is a bijection of `b`.
pub fn hash64(a: u64, b: u64) -> u64 {
    mix(mix(a) ^ b)
}

fn finalize(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// xoshiro256** (Blackman & Vigna): fast, 256 bits of state, good statistical quality.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    /// A generator seeded from one `u64` (the state is four SplitMix64 outputs, never all zero).
    pub fn new(seed: u64) -> Self {
        let mut sm = seed;
        Self { s: [splitmix64(&mut sm), splitmix64(&mut sm), splitmix64(&mut sm), splitmix64(&mut sm)] }
    }

    /// The generator for item `index` of stream `stream` under `seed`: independent of every other
    /// `(stream, index)` pair, and cheap to create.
    pub fn stream(seed: u64, stream: u64, index: u64) -> Self {
        Self::new(hash64(hash64(seed, stream), index))
    }

    /// A generator restored from [`state`](Self::state). The all-zero state (which xoshiro cannot
    /// leave and `state` never returns) is replaced by `Rng::new(0)`.
    pub fn from_state(state: [u64; 4]) -> Self {
        if state == [0; 4] { Self::new(0) } else { Self { s: state } }
    }

    /// The full state, for checkpoints.
    pub fn state(&self) -> [u64; 4] {
        self.s
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// A uniform `f64` in `[0, 1)` with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// A uniform integer in `[0, n)`, without modulo bias (Lemire's method).
    ///
    /// # Panics
    /// If `n == 0`.
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0, "Rng::below(0): the range is empty");
        let mut m = u128::from(self.next_u64()) * u128::from(n);
        if (m as u64) < n {
            // Reject the few low products that would make some results more likely.
            let threshold = n.wrapping_neg() % n;
            while (m as u64) < threshold {
                m = u128::from(self.next_u64()) * u128::from(n);
            }
        }
        (m >> 64) as u64
    }
}
