//! [`ShardedDataset`]: a corpus prepared by `ava data prepare`, read through memory maps.
//!
//! Each split is the concatenation of its regions over the shards, in order: documents
//! with an end-of-text id after each (GPT-2 / llm.c style). Sequence `j` of that stream is
//! the `T + 1` ids starting at `j·T`, so consecutive sequences share one id, as llm.c's
//! batches do. The training split is read in epochs: epoch `e` visits every sequence once,
//! in the order of a [`Permutation`] keyed by `(seed, e)`, so sequence `i` of the stream is
//! a pure function of `(seed, i)` and memory does not grow with the corpus. Validation is
//! read in order.
//!
//! Opening checks every shard's size and header against the manifest and its checksum
//! against the bytes on disk (in parallel, with plain reads), so a truncated or damaged
//! shard is named before training reads any of it.

use std::path::{Path, PathBuf};

use rayon::prelude::*;

use crate::dataset::{Dataset, Split};
use crate::error::DataError;
use crate::manifest::{Manifest, TokenizerId};
use crate::permute::Permutation;
use crate::rng::hash64;
use crate::shard::{self, ShardFile};

/// How much of a corpus [`ShardedDataset::open_with`] checks before reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verify {
    /// Every shard's size, header and SHA-256 (reads the whole corpus once).
    Checksums,
    /// Sizes and headers only: for benchmarks of corpora already checked.
    Sizes,
}

/// A prepared corpus opened for training.
#[derive(Debug)]
pub struct ShardedDataset {
    dir: PathBuf,
    manifest: Manifest,
    shards: Vec<ShardFile>,
    /// Per split, where each shard's region starts in the split's stream; one more entry
    /// than shards (the total last).
    starts: [Vec<u64>; 2],
    seq_len: usize,
    seed: u64,
    /// `data.packing: document`: sequences report where their documents start.
    packing: bool,
}

fn slot(split: Split) -> usize {
    match split {
        Split::Train => 0,
        Split::Validation => 1,
    }
}

impl ShardedDataset {
    /// Opens the corpus in `dir` for sequences of `seq_len` (+1) tokens: reads the manifest,
    /// maps and verifies every shard, and checks both splits hold a sequence. `tokenizer`,
    /// when given (`data.tokenizer`), must be the one the corpus was prepared with.
    pub fn open(dir: &Path, tokenizer: Option<&Path>, seq_len: usize, seed: u64) -> Result<Self, DataError> {
        Self::open_with(dir, tokenizer, seq_len, seed, Verify::Checksums)
    }

    /// [`open`](Self::open), checking as much as `verify` says.
    pub fn open_with(
        dir: &Path,
        tokenizer: Option<&Path>,
        seq_len: usize,
        seed: u64,
        verify: Verify,
    ) -> Result<Self, DataError> {
        let manifest = Manifest::load(dir)?;
        if !manifest.complete {
            return Err(DataError::Unfinished { dir: dir.to_path_buf(), shards: manifest.shards.len() });
        }
        if let Some(path) = tokenizer {
            let sha256 = shard::sha256_file(path).map_err(|source| DataError::Read { path: path.into(), source })?;
            let given = TokenizerId::Huggingface { file: path.into(), sha256 };
            if !manifest.tokenizer.same_as(&given) {
                return Err(DataError::TokenizerMismatch {
                    dir: dir.to_path_buf(),
                    corpus: manifest.tokenizer.describe(),
                    configured: given.describe(),
                });
            }
        }
        let shards: Vec<ShardFile> = manifest
            .shards
            .par_iter()
            .map(|entry| match verify {
                Verify::Checksums => shard::verify(dir, entry, &manifest),
                Verify::Sizes => ShardFile::open(dir, entry, manifest.id_bytes),
            })
            .collect::<Result<_, _>>()?;
        let starts = [Split::Train, Split::Validation].map(|split| {
            let mut acc = vec![0u64];
            for s in &shards {
                acc.push(acc.last().expect("non-empty") + s.tokens(split));
            }
            acc
        });
        let dataset = Self { dir: dir.to_path_buf(), manifest, shards, starts, seq_len, seed, packing: false };
        // Too little validation data is not an error: the run trains without evaluating
        // (`missing_validation` says why).
        let tokens = dataset.split_tokens(Split::Train);
        if tokens < seq_len as u64 + 1 {
            return Err(DataError::CorpusTooShort {
                dir: dir.to_path_buf(),
                split: Split::Train,
                tokens,
                needed: seq_len + 1,
            });
        }
        Ok(dataset)
    }

    /// With `on`, sequences report where their documents start
    /// ([`Dataset::document_starts`], `data.packing: document`).
    pub fn with_document_packing(mut self, on: bool) -> Self {
        self.packing = on;
        self
    }

    /// The corpus's manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Ids in `split`'s stream.
    pub fn split_tokens(&self, split: Split) -> u64 {
        *self.starts[slot(split)].last().expect("non-empty")
    }

    /// Sequences of `seq_len + 1` ids per pass over `split`.
    pub fn sequences_per_epoch(&self, split: Split, seq_len: usize) -> u64 {
        (self.split_tokens(split) - 1) / seq_len as u64
    }

    /// The stream offset of sequence `index` of `split`: shuffled per epoch for training,
    /// in order for validation.
    pub fn sequence_start(&self, split: Split, index: u64, seq_len: usize) -> u64 {
        let per_epoch = self.sequences_per_epoch(split, seq_len);
        let (epoch, at) = (index / per_epoch, index % per_epoch);
        let j = match split {
            Split::Train => Permutation::new(per_epoch, hash64(self.seed, epoch)).apply(at),
            Split::Validation => at,
        };
        j * seq_len as u64
    }

    /// Appends ids `start .. start + len` of `split`'s stream to `out`, across shard ends.
    fn copy_stream(&self, split: Split, mut start: u64, mut len: usize, out: &mut Vec<u32>) {
        let starts = &self.starts[slot(split)];
        while len > 0 {
            // The last shard whose region starts at or before `start` (empty regions skipped).
            let s = starts.partition_point(|&b| b <= start) - 1;
            let offset = start - starts[s];
            let take = len.min((starts[s + 1] - start) as usize);
            self.shards[s].copy_ids(split, offset, take, out);
            start += take as u64;
            len -= take;
        }
    }
}

impl Dataset for ShardedDataset {
    fn vocab_size(&self) -> usize {
        self.manifest.vocab_size as usize
    }

    fn sequence(&self, split: Split, index: u64, seq_len: usize) -> Vec<u32> {
        let start = self.sequence_start(split, index, seq_len);
        let mut out = Vec::with_capacity(seq_len + 1);
        self.copy_stream(split, start, seq_len + 1, &mut out);
        out
    }

    fn document_starts(&self, split: Split, index: u64, seq_len: usize) -> Option<Vec<u32>> {
        if !self.packing {
            return None;
        }
        // Input tokens 1..T of the sequence are stream offsets start + 1 .. start + T.
        let start = self.sequence_start(split, index, seq_len);
        let (lo, hi) = (start + 1, start + seq_len as u64);
        let starts = &self.starts[slot(split)];
        let (mut found, mut offsets) = (Vec::new(), Vec::new());
        // Shards whose region overlaps lo..hi; a region begins with a document, so a shard
        // boundary is a document start too.
        let mut s = starts.partition_point(|&b| b <= lo) - 1;
        while s < self.shards.len() && starts[s] < hi {
            let base = starts[s];
            offsets.clear();
            self.shards[s].document_starts_between(split, lo.saturating_sub(base), hi - base, &mut offsets);
            found.extend(offsets.iter().map(|&o| (base + o - start) as u32));
            s += 1;
        }
        found.dedup(); // an empty region shares its start with the next
        Some(found)
    }

    fn packs_documents(&self) -> bool {
        self.packing
    }

    fn sequences_per_pass(&self, split: Split, seq_len: usize) -> Option<u64> {
        (self.split_tokens(split) > seq_len as u64).then(|| self.sequences_per_epoch(split, seq_len))
    }

    fn missing_validation(&self) -> Option<String> {
        let (tokens, needed) = (self.split_tokens(Split::Validation), self.seq_len as u64 + 1);
        (tokens < needed).then(|| {
            let m = &self.manifest;
            // What would give it one: more documents, a larger share held out, or shorter
            // sequences.
            let remedy = if m.documents < 2 {
                "the corpus is one document: cut its text into documents (ava data prepare --separator) so some can \
                 be held out"
            } else if m.validation.documents == 0 {
                "prepare it with a larger --val-fraction"
            } else {
                "prepare it with a larger --val-fraction, or shorten data.seq_len"
            };
            format!(
                "the validation split of the corpus in {} has {tokens} tokens ({} document{}), less than one \
                 sequence (data.seq_len + 1 = {needed}); {remedy}",
                self.dir.display(),
                m.validation.documents,
                if m.validation.documents == 1 { "" } else { "s" }
            )
        })
    }

    fn entropy_floor_nats(&self) -> Option<f64> {
        None
    }

    fn describe(&self) -> String {
        let m = &self.manifest;
        format!(
            "token shards {}: {} shards, {} documents, {} train / {} validation tokens, {} (vocab {}); {} train \
             sequences of {} per epoch",
            self.dir.display(),
            m.shards.len(),
            m.documents,
            m.train.tokens,
            m.validation.tokens,
            m.tokenizer.describe(),
            m.vocab_size,
            self.sequences_per_epoch(Split::Train, self.seq_len),
            self.seq_len + 1
        )
    }

    fn max_seq_len(&self, split: Split) -> Option<usize> {
        Some(self.split_tokens(split).saturating_sub(1) as usize)
    }
}
