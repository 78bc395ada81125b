//! The [`Dataset`] trait every data source implements, and [`Split`].

use std::fmt;

/// Which part of a data source: the training stream or the held-out validation stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Split {
    /// The training split.
    Train,
    /// The validation split.
    Validation,
}

impl Split {
    /// A stream id for [`Rng::stream`](super::Rng::stream), distinct per split.
    pub fn stream_id(self) -> u64 {
        match self {
            Split::Train => 1,
            Split::Validation => 2,
        }
    }
}

impl fmt::Display for Split {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Split::Train => "train",
            Split::Validation => "validation",
        })
    }
}

/// A source of token sequences. Sequences are pure functions of `(split, index, seq_len)`, so
/// loaders can build them on any thread, in any order, and resume from any index.
pub trait Dataset: Send + Sync {
    /// Size of the token vocabulary; every token is below it.
    fn vocab_size(&self) -> usize;

    /// The `seq_len + 1` tokens of sequence `index` of `split` (inputs are `[0..seq_len]`,
    /// targets `[1..seq_len + 1]`); deterministic.
    ///
    /// # Panics
    /// If `seq_len` exceeds [`max_seq_len`](Self::max_seq_len).
    fn sequence(&self, split: Split, index: u64, seq_len: usize) -> Vec<u32>;

    /// The exact lower bound of the mean cross-entropy (nats/token) over all targets, when it is
    /// known (synthetic sources); `None` for real text.
    fn entropy_floor_nats(&self) -> Option<f64>;

    /// One line describing the source, for the run header.
    fn describe(&self) -> String;

    /// The longest `seq_len` that `split` supports, if limited (a text split of `n` tokens
    /// supports `n - 1`). The default is unlimited.
    fn max_seq_len(&self, split: Split) -> Option<usize> {
        let _ = split;
        None
    }

    /// With `data.packing: document`: the offsets `t` in `1..seq_len` at which input token
    /// `t` of sequence `index` begins a new document, ascending (deterministic, like the
    /// sequence). `None` when the source does not pack documents (the default).
    fn document_starts(&self, split: Split, index: u64, seq_len: usize) -> Option<Vec<u32>> {
        let _ = (split, index, seq_len);
        None
    }

    /// Whether [`document_starts`](Self::document_starts) answers (`data.packing: document`).
    fn packs_documents(&self) -> bool {
        false
    }

    /// Sequences of `seq_len` (+1) tokens one pass over `split` holds, when the source has
    /// an end (a prepared corpus); `None` for a source without one (synthetic), or whose passes
    /// are not a fixed list (a mixture).
    fn sequences_per_pass(&self, split: Split, seq_len: usize) -> Option<u64> {
        let _ = (split, seq_len);
        None
    }

    /// Why the source has no validation data, when it has none (a corpus whose held-out
    /// documents make less than one sequence): training then runs without evaluating, and
    /// `sequence` must not be asked for the validation split. `None` (the default): it has.
    fn missing_validation(&self) -> Option<String> {
        None
    }

    /// For a mixture of sources: how many of the first `sequences` training sequences each
    /// source gave, by name. Empty for a single source (the default).
    fn sources_seen(&self, sequences: u64) -> Vec<(String, u64)> {
        let _ = sequences;
        Vec::new()
    }
}
