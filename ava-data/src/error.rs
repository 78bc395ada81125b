//! [`DataError`]: everything that can go wrong opening a data source or loading batches, with
//! messages meant to be printed as they are (what, where, and how to fix it).

use std::io;
use std::path::PathBuf;

use super::dataset::Split;

/// An error of the data pipeline. Its `Display` is the full message for the user.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DataError {
    /// An option is out of range; `key` is its config key (e.g. `data.synthetic.order`).
    #[error("{key} = {value}: {reason}")]
    InvalidOption {
        /// The config key.
        key: &'static str,
        /// The value as given.
        value: String,
        /// What is wrong and what would be accepted.
        reason: String,
    },
    /// The data file does not exist.
    #[error("data file {} does not exist; set data.path to an existing file", path.display())]
    NotFound {
        /// The path as given.
        path: PathBuf,
    },
    /// The data file exists but could not be read.
    #[error("cannot read data file {}: {source}; check that data.path names a readable file", path.display())]
    Read {
        /// The path as given.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// A tokenizer was configured but the data file is not UTF-8 text.
    #[error(
        "data file {} is not UTF-8 text (invalid byte at offset {offset}); a tokenizer needs text: convert the \
         file, or unset data.tokenizer to train on its raw bytes",
        path.display()
    )]
    NotUtf8 {
        /// The data file.
        path: PathBuf,
        /// Byte offset of the first invalid byte.
        offset: usize,
    },
    /// The tokenizer file does not exist.
    #[error(
        "tokenizer file {} does not exist; set data.tokenizer to a Hugging Face tokenizer.json, or unset it to \
         train on raw bytes",
        path.display()
    )]
    TokenizerNotFound {
        /// The path as given.
        path: PathBuf,
    },
    /// The tokenizer file could not be loaded.
    #[error(
        "cannot load tokenizer {}: {message}; data.tokenizer must be a Hugging Face tokenizer.json (as written by \
         `Tokenizer::save` / `save_pretrained`)",
        path.display()
    )]
    Tokenizer {
        /// The tokenizer file.
        path: PathBuf,
        /// The `tokenizers` error text.
        message: String,
    },
    /// The tokenizer file describes a tokenizer over Ava's limits (`tokenizer_check`).
    #[error("tokenizer {}: {field}: {message}", path.display())]
    TokenizerRefused {
        /// The tokenizer file.
        path: PathBuf,
        /// The key path in the file (`normalizer.normalizers[2].content`).
        field: String,
        /// What is wrong, the limit, and how to fix it.
        message: String,
    },
    /// The tokenizer failed on the data file's text.
    #[error("tokenizer {} failed on data file {}: {message}", tokenizer.display(), path.display())]
    Encode {
        /// The data file.
        path: PathBuf,
        /// The tokenizer file.
        tokenizer: PathBuf,
        /// The `tokenizers` error text.
        message: String,
    },
    /// One split of a text file is too short for one sequence.
    #[error(
        "data file {} has {tokens} tokens; its {split} split ({part}) has {split_tokens}, but a sequence needs \
         data.seq_len + 1 = {needed}: use a longer file, a smaller data.seq_len, or another data.val_fraction",
        path.display(),
        part = split_part(*split, *val_fraction)
    )]
    TooShort {
        /// The data file.
        path: PathBuf,
        /// Tokens in the whole file.
        tokens: usize,
        /// The split that is too short.
        split: Split,
        /// Tokens in that split.
        split_tokens: usize,
        /// Tokens one sequence needs (`seq_len + 1`).
        needed: usize,
        /// The validation fraction in force.
        val_fraction: f64,
    },
    /// A corpus directory without a manifest.
    #[error(
        "{} is not a prepared corpus (no manifest.json); prepare one with `ava data prepare INPUT... --out {}`",
        dir.display(),
        dir.display()
    )]
    NoManifest {
        /// The directory.
        dir: PathBuf,
    },
    /// A manifest that cannot be used.
    #[error("corpus manifest {}: {reason}", path.display())]
    Manifest {
        /// The manifest file.
        path: PathBuf,
        /// What is wrong and what to do.
        reason: String,
    },
    /// A corpus whose preparation did not finish.
    #[error(
        "the corpus in {} is not finished ({shards} shards so far): run the same `ava data prepare` again to complete it",
        dir.display()
    )]
    Unfinished {
        /// The corpus directory.
        dir: PathBuf,
        /// Shards complete.
        shards: usize,
    },
    /// A shard that does not match its manifest entry.
    #[error("shard {}: {reason}", path.display())]
    Shard {
        /// The shard file.
        path: PathBuf,
        /// What is wrong and what to do.
        reason: String,
    },
    /// `data.tokenizer` names another tokenizer than the corpus was prepared with.
    #[error(
        "the corpus in {} was prepared with {corpus}, but data.tokenizer is {configured}: unset data.tokenizer, \
         or prepare the corpus again with that tokenizer",
        dir.display()
    )]
    TokenizerMismatch {
        /// The corpus directory.
        dir: PathBuf,
        /// The corpus's tokenizer.
        corpus: String,
        /// The configured one.
        configured: String,
    },
    /// A corpus split shorter than one sequence.
    #[error(
        "the {split} split of the corpus in {} has {tokens} tokens, but a sequence needs data.seq_len + 1 = \
         {needed}: prepare more text, or use a smaller data.seq_len",
        dir.display()
    )]
    CorpusTooShort {
        /// The corpus directory.
        dir: PathBuf,
        /// The split.
        split: Split,
        /// Its tokens.
        tokens: u64,
        /// Tokens one sequence needs.
        needed: usize,
    },
    /// A loader worker (or, without workers, the loader itself) panicked building a batch.
    #[error("the data loader {} panicked while building batch {batch}: {message}", who(*worker))]
    WorkerPanicked {
        /// The worker, or `None` when batches are built synchronously.
        worker: Option<usize>,
        /// The batch being built.
        batch: u64,
        /// The panic message.
        message: String,
    },
    /// A loader worker thread could not be started.
    #[error("cannot start a data loader worker thread: {source}; try a smaller data.num_workers")]
    Spawn {
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// The stop flag (a signal) was set while [`Loader::next`](crate::Loader::next) waited
    /// for a batch that was not ready: the wait gave up instead of blocking the stop.
    #[error(
        "stopped while waiting for the data loader: batch {batch} of the {split} split was not ready after {:.1} s",
        *waited_ms as f64 / 1000.0
    )]
    Stopped {
        /// The split read.
        split: Split,
        /// The batch waited for.
        batch: u64,
        /// How long the wait lasted, in milliseconds.
        waited_ms: u64,
    },
}

fn split_part(split: Split, val_fraction: f64) -> String {
    let (side, fraction) = match split {
        Split::Train => ("first", 1.0 - val_fraction),
        Split::Validation => ("last", val_fraction),
    };
    // Rounded to 4 decimals then trimmed, so 0.9 prints as 90% and not 90.00000000000001%.
    let percent = format!("{:.4}", 100.0 * fraction);
    format!("the {side} {}%", percent.trim_end_matches('0').trim_end_matches('.'))
}

fn who(worker: Option<usize>) -> String {
    match worker {
        Some(w) => format!("worker {w}"),
        None => "(running without workers)".to_string(),
    }
}
