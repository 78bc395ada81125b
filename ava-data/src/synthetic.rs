//! A synthetic corpus whose entropy rate is known exactly: a seeded random sparse Markov source.
//!
//! For every context (the previous `order` symbols) the next symbol is one of `branching`
//! distinct symbols picked at random per context, with probabilities that are a per-context
//! permutation of one fixed vector `p` (geometric weights `1, 1/2, 1/4, ...`, normalized). Every
//! context's distribution therefore has entropy exactly `H(p)`, and so does every target of every
//! sequence: the mean cross-entropy of a perfect model is `H(p)`, whatever the stationary
//! distribution. A trained model's loss can be compared against that floor.
//!
//! Symbol `i` is the byte `b'a' + i` (wrapping past 255 and skipping `b'\n'`), so the vocabulary
//! stays the 256 bytes and samples are readable. Each sequence starts with the visible
//! [`START`] byte `b'\n'`; the hidden context before the first symbol is `order` copies of
//! symbol 0. As `START` is always at position 0, the context of every target is a function of
//! what the model sees, and the first target is drawn like any other.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::dataset::{Dataset, Split};
use super::error::DataError;
use super::rng::{Rng, hash64};

/// The byte that opens every synthetic sequence (never one of the alphabet's symbols).
pub const START: u8 = b'\n';

/// At most this many contexts (`alphabet^order`).
pub const MAX_CONTEXTS: usize = 1 << 20;

/// At most this many entries (`contexts × branching`, one byte each) in the transition table.
pub const MAX_TABLE_ENTRIES: usize = 1 << 26;

/// Stream id of the transition table's RNG (sequences use the split ids 1 and 2).
const TABLE_STREAM: u64 = 0x7AB1E;

/// Parameters of the Markov source (config section `data.synthetic`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MarkovSpec {
    /// Number of symbols, 1..=255.
    pub alphabet: usize,
    /// How many previous symbols form the context (0 = independent symbols).
    pub order: usize,
    /// Number of possible next symbols per context, 1..=alphabet.
    pub branching: usize,
    /// Seed of the transition table (which source); the sampling seed is separate.
    pub seed: u64,
}

impl Default for MarkovSpec {
    fn default() -> Self {
        Self { alphabet: 16, order: 2, branching: 4, seed: 0 }
    }
}

impl MarkovSpec {
    /// Checks the parameters; errors name the `data.synthetic.*` key. Returns the context count.
    pub fn validate(&self) -> Result<usize, DataError> {
        let invalid =
            |key, value: usize, reason: String| DataError::InvalidOption { key, value: value.to_string(), reason };
        if !(1..=255).contains(&self.alphabet) {
            return Err(invalid(
                "data.synthetic.alphabet",
                self.alphabet,
                "must be between 1 and 255 (the symbols and the start byte share the 256 byte tokens)".into(),
            ));
        }
        if !(1..=self.alphabet).contains(&self.branching) {
            return Err(invalid(
                "data.synthetic.branching",
                self.branching,
                format!("must be between 1 and data.synthetic.alphabet ({})", self.alphabet),
            ));
        }
        let contexts = u32::try_from(self.order)
            .ok()
            .and_then(|order| self.alphabet.checked_pow(order))
            .filter(|&c| c <= MAX_CONTEXTS)
            .ok_or_else(|| {
                invalid(
                    "data.synthetic.order",
                    self.order,
                    format!(
                        "alphabet^order contexts must be at most {MAX_CONTEXTS}; lower data.synthetic.order or \
                         data.synthetic.alphabet ({})",
                        self.alphabet
                    ),
                )
            })?;
        if contexts * self.branching > MAX_TABLE_ENTRIES {
            return Err(invalid(
                "data.synthetic.branching",
                self.branching,
                format!(
                    "the transition table would hold {contexts} contexts × {} = {} entries, more than \
                     {MAX_TABLE_ENTRIES}; lower data.synthetic.branching, order or alphabet",
                    self.branching,
                    contexts * self.branching
                ),
            ));
        }
        Ok(contexts)
    }
}

/// The fixed next-symbol probabilities: geometric weights `2^-k`, normalized, largest first.
pub fn branch_probabilities(branching: usize) -> Vec<f64> {
    let weights: Vec<f64> = (0..branching).map(|k| 0.5f64.powi(k as i32)).collect();
    let total: f64 = weights.iter().sum();
    weights.iter().map(|w| w / total).collect()
}

/// Entropy in nats of a probability vector.
pub fn entropy_nats(p: &[f64]) -> f64 {
    p.iter().filter(|&&q| q > 0.0).map(|&q| -q * q.ln()).sum()
}

/// The byte of symbol `i`: `b'a' + i`, wrapping past 255 and skipping [`START`].
fn symbol_bytes(alphabet: usize) -> Vec<u8> {
    (0..256usize).map(|k| ((usize::from(b'a') + k) % 256) as u8).filter(|&b| b != START).take(alphabet).collect()
}

/// The precomputed source, shared by every clone of a [`SyntheticDataset`].
#[derive(Debug)]
struct Table {
    spec: MarkovSpec,
    contexts: usize,
    /// `next[c * branching + k]`: the symbol drawn with probability `p[k]` in context `c`.
    next: Vec<u8>,
    p: Vec<f64>,
    /// Cumulative `p`, last entry forced to 1 so rounding never falls off the end.
    cdf: Vec<f64>,
    /// Symbol index → byte.
    bytes: Vec<u8>,
    /// Byte → symbol index.
    symbol_of: [Option<u8>; 256],
    entropy: f64,
}

impl Table {
    fn build(spec: &MarkovSpec) -> Result<Self, DataError> {
        let contexts = spec.validate()?;
        let (alphabet, branching) = (spec.alphabet, spec.branching);
        let mut rng = Rng::stream(spec.seed, TABLE_STREAM, 0);
        // A partial Fisher–Yates shuffle per context; the array need not be reset between
        // contexts, since shuffling any permutation gives uniformly random distinct picks.
        let mut perm: Vec<u8> = (0..alphabet).map(|s| s as u8).collect();
        let mut next = Vec::with_capacity(contexts * branching);
        for _ in 0..contexts {
            for k in 0..branching {
                let j = k + rng.below((alphabet - k) as u64) as usize;
                perm.swap(k, j);
                next.push(perm[k]);
            }
        }
        let p = branch_probabilities(branching);
        let mut acc = 0.0;
        let mut cdf: Vec<f64> = p
            .iter()
            .map(|q| {
                acc += q;
                acc
            })
            .collect();
        *cdf.last_mut().expect("branching >= 1") = 1.0;
        let bytes = symbol_bytes(alphabet);
        let mut symbol_of = [None; 256];
        for (i, &b) in bytes.iter().enumerate() {
            symbol_of[usize::from(b)] = Some(i as u8);
        }
        let entropy = entropy_nats(&p);
        Ok(Self { spec: spec.clone(), contexts, next, p, cdf, bytes, symbol_of, entropy })
    }
}

/// The synthetic [`Dataset`]: a [`MarkovSpec`] source sampled with a separate sampling seed.
#[derive(Debug, Clone)]
pub struct SyntheticDataset {
    table: Arc<Table>,
    seed: u64,
}

impl SyntheticDataset {
    /// Builds the transition table of `spec` (once; clones share it). Sequence `i` of a split is
    /// drawn from an RNG derived from `(sample_seed, split, i)`.
    pub fn new(spec: &MarkovSpec, sample_seed: u64) -> Result<Self, DataError> {
        Ok(Self { table: Arc::new(Table::build(spec)?), seed: sample_seed })
    }

    /// The source's parameters.
    pub fn spec(&self) -> &MarkovSpec {
        &self.table.spec
    }

    /// The fixed next-symbol probability vector `p` (every context uses a permutation of it).
    pub fn probabilities(&self) -> &[f64] {
        &self.table.p
    }

    /// `H(p)` in nats: the entropy of every target, hence the floor of the mean cross-entropy.
    pub fn entropy_floor_nats(&self) -> f64 {
        self.table.entropy
    }

    /// The byte of each symbol, in symbol order.
    pub fn symbols(&self) -> &[u8] {
        &self.table.bytes
    }

    /// The true distribution `(token, probability)` of the token after `prefix`, where `prefix`
    /// is the start of a sequence (`prefix[0] == START`, then symbols). `None` if `prefix` is not
    /// such a prefix.
    pub fn next_token_probabilities(&self, prefix: &[u32]) -> Option<Vec<(u32, f64)>> {
        let t = &*self.table;
        let (&first, symbols) = prefix.split_first()?;
        if first != u32::from(START) {
            return None;
        }
        let indices: Vec<usize> = symbols
            .iter()
            .map(|&tok| u8::try_from(tok).ok().and_then(|b| t.symbol_of[usize::from(b)]).map(usize::from))
            .collect::<Option<_>>()?;
        // Context digits, oldest first; positions before the sequence are symbol 0.
        let mut context = 0;
        for back in (1..=t.spec.order).rev() {
            let symbol = indices.len().checked_sub(back).map_or(0, |i| indices[i]);
            context = context * t.spec.alphabet + symbol;
        }
        let row = &t.next[context * t.spec.branching..][..t.spec.branching];
        Some(row.iter().zip(&t.p).map(|(&s, &q)| (u32::from(t.bytes[usize::from(s)]), q)).collect())
    }
}

impl Dataset for SyntheticDataset {
    fn vocab_size(&self) -> usize {
        256
    }

    fn sequence(&self, split: Split, index: u64, seq_len: usize) -> Vec<u32> {
        let t = &*self.table;
        let (alphabet, branching) = (t.spec.alphabet, t.spec.branching);
        let mut rng = Rng::new(hash64(hash64(self.seed, split.stream_id()), index));
        let mut out = Vec::with_capacity(seq_len + 1);
        out.push(u32::from(START));
        let mut context = 0;
        for _ in 0..seq_len {
            let u = rng.next_f64();
            let k = t.cdf.iter().position(|&c| u < c).unwrap_or(branching - 1);
            let symbol = usize::from(t.next[context * branching + k]);
            out.push(u32::from(t.bytes[symbol]));
            // Shift the newest symbol in as the least significant digit; the oldest falls off.
            context = (context * alphabet + symbol) % t.contexts;
        }
        out
    }

    fn entropy_floor_nats(&self) -> Option<f64> {
        Some(self.table.entropy)
    }

    fn describe(&self) -> String {
        let s = &self.table.spec;
        format!(
            "synthetic Markov source: {} symbols, order {}, branching {}, table seed {}, sampling seed {} ({} \
             contexts); entropy floor {:.4} nats/token",
            s.alphabet, s.order, s.branching, s.seed, self.seed, self.table.contexts, self.table.entropy
        )
    }
}
