//! Ava's data pipeline: token sequences from a synthetic Markov source, a local text file,
//! or a corpus prepared into memory-mapped token shards, batched by background workers.
//! It knows nothing of tensors or models, so `ava data` builds and tests without the engine.
//!
//! [`open`] turns [`DataOptions`] into an `Arc<dyn` [`Dataset`]`>`; a [`Loader`] streams its
//! [`Batch`]es of `(B, T+1)` token ids (plain `u32`s: this module knows nothing of tensors).
//! Everything is deterministic: sequence `i` of a split depends only on the seed, the split and
//! `i`, and batch `k` holds sequences `k·B .. (k+1)·B`, so a run resumes from a batch index.
//!
//! ```
//! use ava_data::{DataOptions, Loader, MarkovSpec, Packing, Source, Split, open};
//!
//! let options = DataOptions {
//!     source: Source::Synthetic(MarkovSpec::default()),
//!     seq_len: 32,
//!     val_fraction: 0.1,
//!     seed: 7,
//!     packing: Packing::Concat,
//! };
//! let dataset = open(&options).unwrap();
//! let mut loader = Loader::new(dataset.clone(), Split::Train, 4, 32, 0, 2, 2).unwrap();
//! let batch = loader.next().unwrap();
//! assert_eq!((batch.inputs().len(), loader.position()), (4 * 32, 1));
//! assert!(dataset.entropy_floor_nats().unwrap() > 0.0);
//! ```
//!
//! Files: `dataset` (the trait), `synthetic` (the Markov source), `text` and `tokenizer` (real
//! files), `loader` (batches and workers), `rng` (the deterministic RNG), `error`; and for
//! prepared corpora `prepare` (text to shards), `shard` (the file layout, writing and
//! mapping), `manifest`, `sharded` (the dataset training reads), `permute` (the shuffle),
//! `corpus` (verifying a corpus whole).

pub mod bpe;
pub mod corpus;
mod dataset;
mod error;
mod loader;
pub mod manifest;
mod mixture;
pub mod permute;
pub mod prepare;
mod rng;
pub mod shard;
mod sharded;
mod synthetic;
mod text;
mod tokenizer;
pub mod tokenizer_check;

#[cfg(test)]
mod tests;

use std::path::PathBuf;
use std::sync::Arc;

pub use dataset::{Dataset, Split};
pub use error::DataError;
pub use loader::{Batch, Loader, Share};
pub use mixture::Mixture;
pub use rng::{Rng, hash64, mix, splitmix64};
pub use sharded::{ShardedDataset, Verify};
pub use synthetic::{
    MAX_CONTEXTS, MAX_TABLE_ENTRIES, MarkovSpec, START, SyntheticDataset, branch_probabilities, entropy_nats,
};
pub use text::TextDataset;
pub use tokenizer::{TextTokenizer, Tokenizer, byte_tokenizer_json};

/// Where the tokens come from.
#[derive(Debug, Clone, PartialEq)]
pub enum Source {
    /// The synthetic Markov source (`data.synthetic`).
    Synthetic(MarkovSpec),
    /// A local text file (`data.path`), byte-level unless a `tokenizer.json` is given
    /// (`data.tokenizer`).
    Text {
        /// The text file.
        path: PathBuf,
        /// A Hugging Face `tokenizer.json`; `None` means raw bytes (vocabulary 256).
        tokenizer: Option<PathBuf>,
    },
    /// A corpus prepared by `ava data prepare` (`data.path` is its directory).
    Shards {
        /// The corpus directory.
        dir: PathBuf,
        /// The `tokenizer.json` the run expects the corpus to have been prepared with.
        tokenizer: Option<PathBuf>,
    },
    /// Several prepared corpora with weights adding up to 1 (`data.mix`).
    Mix {
        /// Each corpus directory and its weight.
        corpora: Vec<(PathBuf, f64)>,
        /// As for [`Source::Shards`].
        tokenizer: Option<PathBuf>,
    },
}

/// How sequences are cut from documents (`data.packing`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Packing {
    /// Documents concatenated with an end-of-text id between them and cut every T tokens
    /// (llm.c / GPT-2): attention and positions run across document boundaries.
    #[default]
    Concat,
    /// The same sequences, but each batch also says where its documents start, so positions
    /// restart at every document and attention stays inside it (Llama 3's packing). Needs
    /// documents: a prepared corpus (`shards`) or a mixture of them.
    Document,
}

impl Packing {
    /// The names accepted in a config.
    pub const NAMES: &'static [&'static str] = &["concat", "document"];

    /// The config value.
    pub fn as_str(self) -> &'static str {
        match self {
            Packing::Concat => "concat",
            Packing::Document => "document",
        }
    }
}

/// Everything [`open`] needs.
#[derive(Debug, Clone, PartialEq)]
pub struct DataOptions {
    /// The source.
    pub source: Source,
    /// Tokens per input sequence (each sequence has `seq_len + 1` tokens); text splits must be
    /// at least that long.
    pub seq_len: usize,
    /// Share of a text file held out for validation (its end), in (0, 1); unused by the
    /// synthetic source, whose validation split is an independent stream, and by prepared
    /// corpora, whose held-out documents `ava data prepare` chose.
    pub val_fraction: f64,
    /// Sampling seed: which sequences / windows are drawn (the synthetic table has its own seed).
    pub seed: u64,
    /// How sequences are cut from documents.
    pub packing: Packing,
}

/// Opens the data source described by `options`: builds the synthetic table, reads (and
/// tokenizes) the text file, or maps and verifies a prepared corpus; and checks both splits
/// hold a sequence.
pub fn open(options: &DataOptions) -> Result<Arc<dyn Dataset>, DataError> {
    if options.seq_len == 0 {
        return Err(DataError::InvalidOption {
            key: "data.seq_len",
            value: "0".into(),
            reason: "must be at least 1".into(),
        });
    }
    let packed = options.packing == Packing::Document;
    if packed && matches!(options.source, Source::Synthetic(_) | Source::Text { .. }) {
        let source = if matches!(options.source, Source::Synthetic(_)) { "synthetic" } else { "text" };
        return Err(DataError::InvalidOption {
            key: "data.packing",
            value: options.packing.as_str().into(),
            reason: format!(
                "needs document boundaries, and data.source: {source} has none; prepare the corpus with `ava data \
                 prepare` and train on it with data.source: shards (or data.mix), or set data.packing: concat"
            ),
        });
    }
    Ok(match &options.source {
        Source::Synthetic(spec) => Arc::new(SyntheticDataset::new(spec, options.seed)?),
        Source::Text { path, tokenizer } => Arc::new(TextDataset::open(
            path,
            tokenizer.as_deref(),
            options.seq_len,
            options.val_fraction,
            options.seed,
        )?),
        Source::Shards { dir, tokenizer } => {
            let dataset = ShardedDataset::open(dir, tokenizer.as_deref(), options.seq_len, options.seed)?;
            Arc::new(dataset.with_document_packing(packed))
        }
        Source::Mix { corpora, tokenizer } => {
            Arc::new(Mixture::open_packed(corpora, tokenizer.as_deref(), options.seq_len, options.seed, packed)?)
        }
    })
}
