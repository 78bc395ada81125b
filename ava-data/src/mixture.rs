//! [`Mixture`]: several prepared corpora sampled with fixed weights (`data.mix`).
//!
//! The stream is cut into blocks of [`BLOCK`] sequences. Each source owns a fixed number of a
//! block's slots, its weight times [`BLOCK`] rounded so the slots add up (largest
//! remainders): a run of consecutive slots, which a seeded [`Permutation`] per block
//! scatters over the block. Sequence `i` is slot `i mod BLOCK` of block `i / BLOCK` after
//! the permutation: the source owning it, and within the source its sequence `block × its
//! slots + the slot's place in its run`. So a block of the mixture takes each source's next
//! `slots` sequences once each (from its own stream: its epochs, its shuffle), the
//! proportions are exact in every block, and sequence `i` is a pure function of `(seed, i)`
//! in O(1) memory: resume needs no replay, and the tokens each source has given are a
//! formula of the position ([`Dataset::sources_seen`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::dataset::{Dataset, Split};
use crate::error::DataError;
use crate::permute::Permutation;
use crate::rng::hash64;
use crate::sharded::ShardedDataset;

/// Sequences per block: weights are kept to 1/1024.
pub const BLOCK: u64 = 1024;

/// One source of a mixture.
struct Source {
    name: String,
    dataset: Arc<dyn Dataset>,
    /// Slots of a block it owns.
    slots: u64,
    /// The first slot it owns, in slot order (sources own consecutive slots before the
    /// permutation scatters them).
    first: u64,
}

/// Several prepared corpora with weights.
pub struct Mixture {
    sources: Vec<Source>,
    seed: u64,
}

impl Mixture {
    /// Opens each corpus (as [`ShardedDataset::open`]) and sets its share of a block.
    /// `weights` are fractions adding up to 1; the corpora must share one tokenizer.
    pub fn open(
        corpora: &[(PathBuf, f64)],
        tokenizer: Option<&Path>,
        seq_len: usize,
        seed: u64,
    ) -> Result<Self, DataError> {
        Self::open_packed(corpora, tokenizer, seq_len, seed, false)
    }

    /// [`open`](Self::open), each corpus [packing documents](ShardedDataset::with_document_packing)
    /// when `packing`.
    pub fn open_packed(
        corpora: &[(PathBuf, f64)],
        tokenizer: Option<&Path>,
        seq_len: usize,
        seed: u64,
        packing: bool,
    ) -> Result<Self, DataError> {
        let invalid = |reason: String| DataError::InvalidOption { key: "data.mix", value: describe(corpora), reason };
        if corpora.is_empty() {
            return Err(invalid("names no corpus".into()));
        }
        let total: f64 = corpora.iter().map(|c| c.1).sum();
        if (total - 1.0).abs() > 1e-6 || corpora.iter().any(|c| c.1.is_nan() || c.1 <= 0.0) {
            return Err(invalid(format!(
                "the shares must be positive and add up to 100% (they add up to {}%)",
                total * 100.0
            )));
        }
        let datasets: Vec<ShardedDataset> = corpora
            .iter()
            .map(|(dir, _)| {
                ShardedDataset::open(dir, tokenizer, seq_len, seed).map(|d| d.with_document_packing(packing))
            })
            .collect::<Result<_, _>>()?;
        let first = datasets[0].manifest();
        for (d, (dir, _)) in datasets.iter().zip(corpora).skip(1) {
            let m = d.manifest();
            if !m.tokenizer.same_as(&first.tokenizer) {
                return Err(invalid(format!(
                    "{} was prepared with {} and {} with {}: a mixture's corpora must share one tokenizer",
                    corpora[0].0.display(),
                    first.tokenizer.describe(),
                    dir.display(),
                    m.tokenizer.describe()
                )));
            }
            if (m.eos_id, m.bos_id) != (first.eos_id, first.bos_id) {
                return Err(invalid(format!(
                    "{} ends documents with id {} (begins them with {:?}) and {} with id {} ({:?}): prepare them with \
                     the same --eos and --bos",
                    corpora[0].0.display(),
                    first.eos_id,
                    first.bos_id,
                    dir.display(),
                    m.eos_id,
                    m.bos_id
                )));
            }
        }
        // Largest remainders: floor(w · BLOCK) each, the rest to the largest fractions.
        let exact: Vec<f64> = corpora.iter().map(|(_, w)| w * BLOCK as f64).collect();
        let mut slots: Vec<u64> = exact.iter().map(|x| x.floor() as u64).collect();
        let mut order: Vec<usize> = (0..slots.len()).collect();
        order.sort_by(|&a, &b| (exact[b] - exact[b].floor()).total_cmp(&(exact[a] - exact[a].floor())).then(a.cmp(&b)));
        let missing = BLOCK.saturating_sub(slots.iter().sum());
        for &i in order.iter().take(missing as usize) {
            slots[i] += 1;
        }
        if let Some(i) = slots.iter().position(|&s| s == 0) {
            return Err(invalid(format!(
                "{}'s weight {} is below 1/{BLOCK}, the finest share a mixture keeps: raise it or leave the corpus out",
                corpora[i].0.display(),
                corpora[i].1
            )));
        }
        let mut at = 0;
        let sources = datasets
            .into_iter()
            .zip(corpora)
            .zip(slots)
            .map(|((dataset, (dir, _)), slots)| {
                let dataset: Arc<dyn Dataset> = Arc::new(dataset);
                let source = Source { name: dir.display().to_string(), dataset, slots, first: at };
                at += slots;
                source
            })
            .collect();
        Ok(Self { sources, seed })
    }

    /// The source of sequence `index` and the index within that source.
    pub fn locate(&self, index: u64) -> (usize, u64) {
        let (block, slot) = (index / BLOCK, index % BLOCK);
        let p = Permutation::new(BLOCK, hash64(self.seed ^ 0x6d69_7874_7572_6573, block)).apply(slot);
        let s = self.sources.iter().position(|s| p < s.first + s.slots).expect("the slots cover the block");
        let source = &self.sources[s];
        (s, block * source.slots + (p - source.first))
    }

    /// Sequences each source gave among the first `n` of the stream.
    pub fn counts(&self, n: u64) -> Vec<u64> {
        let (blocks, rest) = (n / BLOCK, n % BLOCK);
        let mut counts: Vec<u64> = self.sources.iter().map(|s| blocks * s.slots).collect();
        for i in 0..rest {
            counts[self.locate(blocks * BLOCK + i).0] += 1;
        }
        counts
    }
}

impl std::fmt::Debug for Mixture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let slots: Vec<(&str, u64)> = self.sources.iter().map(|s| (s.name.as_str(), s.slots)).collect();
        f.debug_struct("Mixture").field("slots", &slots).field("seed", &self.seed).finish()
    }
}

fn describe(corpora: &[(PathBuf, f64)]) -> String {
    let parts: Vec<String> = corpora.iter().map(|(d, w)| format!("{}: {}%", d.display(), w * 100.0)).collect();
    format!("[{}]", parts.join(", "))
}

impl Dataset for Mixture {
    fn vocab_size(&self) -> usize {
        self.sources.iter().map(|s| s.dataset.vocab_size()).max().unwrap_or(0)
    }

    fn sequence(&self, split: Split, index: u64, seq_len: usize) -> Vec<u32> {
        let (s, within) = self.locate(index);
        self.sources[s].dataset.sequence(split, within, seq_len)
    }

    fn document_starts(&self, split: Split, index: u64, seq_len: usize) -> Option<Vec<u32>> {
        let (s, within) = self.locate(index);
        self.sources[s].dataset.document_starts(split, within, seq_len)
    }

    fn packs_documents(&self) -> bool {
        self.sources.iter().all(|s| s.dataset.packs_documents())
    }

    fn entropy_floor_nats(&self) -> Option<f64> {
        None
    }

    fn describe(&self) -> String {
        let parts: Vec<String> =
            self.sources.iter().map(|s| format!("{} {:.1}%", s.name, 100.0 * s.slots as f64 / BLOCK as f64)).collect();
        format!("a mixture of {} token-shard corpora: {}", self.sources.len(), parts.join(", "))
    }

    fn max_seq_len(&self, split: Split) -> Option<usize> {
        self.sources.iter().filter_map(|s| s.dataset.max_seq_len(split)).min()
    }

    fn sources_seen(&self, sequences: u64) -> Vec<(String, u64)> {
        self.sources.iter().map(|s| s.name.clone()).zip(self.counts(sequences)).collect()
    }

    /// Validation sequences come from every source by its share, so each needs some.
    fn missing_validation(&self) -> Option<String> {
        let missing: Vec<String> = self.sources.iter().filter_map(|s| s.dataset.missing_validation()).collect();
        (!missing.is_empty()).then(|| missing.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mixture(slots: &[u64]) -> Mixture {
        let mut at = 0;
        let sources = slots
            .iter()
            .map(|&n| {
                let s = (n, at);
                at += n;
                s
            })
            .collect::<Vec<_>>();
        // Any dataset will do: only `locate` and `counts` are exercised.
        Mixture {
            sources: sources
                .into_iter()
                .enumerate()
                .map(|(i, (slots, first))| Source {
                    name: i.to_string(),
                    dataset: Arc::new(
                        crate::SyntheticDataset::new(&crate::MarkovSpec::default(), 1).expect("the default spec"),
                    ),
                    slots,
                    first,
                })
                .collect(),
            seed: 9,
        }
    }

    #[test]
    fn each_block_takes_every_source_s_next_sequences_once_at_its_exact_share() {
        let m = mixture(&[717, 205, 102]);
        let n = 5 * BLOCK + 300;
        let mut seen: [Vec<u64>; 3] = Default::default();
        for i in 0..5 * BLOCK {
            let (s, within) = m.locate(i);
            seen[s].push(within);
        }
        for (s, slots) in [717u64, 205, 102].into_iter().enumerate() {
            seen[s].sort_unstable();
            assert_eq!(seen[s], (0..5 * slots).collect::<Vec<_>>(), "source {s}: skipped or repeated");
        }
        let mut partial = [0u64; 3];
        for i in 0..n {
            partial[m.locate(i).0] += 1;
        }
        assert_eq!(m.counts(n), partial.to_vec());
        assert_eq!(m.counts(5 * BLOCK), vec![5 * 717, 5 * 205, 5 * 102]);
        // Scattered, not in runs: the first block's first 50 draw from every source.
        let firsts: std::collections::BTreeSet<usize> = (0..50).map(|i| m.locate(i).0).collect();
        assert_eq!(firsts.len(), 3);
    }
}
