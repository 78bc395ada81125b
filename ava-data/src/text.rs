//! [`TextDataset`]: a local text file, as raw bytes (vocabulary 256) or encoded once with a
//! Hugging Face tokenizer. The last `val_fraction` of the token stream is the validation split,
//! the rest the training split; sequence `i` of a split is a window of `seq_len + 1` tokens at
//! an offset drawn uniformly from `(seed, split, i)`, entirely inside that split.

use std::io;
use std::path::{Path, PathBuf};

use super::dataset::{Dataset, Split};
use super::error::DataError;
use super::rng::Rng;
use super::tokenizer::TextTokenizer;

/// The token stream; raw bytes stay one byte per token in memory.
#[derive(Debug)]
enum Tokens {
    Bytes(Vec<u8>),
    Ids(Vec<u32>),
}

impl Tokens {
    fn len(&self) -> usize {
        match self {
            Tokens::Bytes(b) => b.len(),
            Tokens::Ids(i) => i.len(),
        }
    }

    fn window(&self, start: usize, len: usize) -> Vec<u32> {
        match self {
            Tokens::Bytes(b) => b[start..start + len].iter().map(|&x| u32::from(x)).collect(),
            Tokens::Ids(i) => i[start..start + len].to_vec(),
        }
    }
}

/// A text file split into training and validation token streams.
#[derive(Debug)]
pub struct TextDataset {
    path: PathBuf,
    tokenizer: Option<PathBuf>,
    tokens: Tokens,
    /// Tokens `[0, train_len)` are training data, `[train_len, len)` validation.
    train_len: usize,
    vocab_size: usize,
    seed: u64,
}

impl TextDataset {
    /// Reads `path` (and encodes it with `tokenizer` if given), splits it, and checks that both
    /// splits hold at least `seq_len + 1` tokens. `val_fraction` must lie in (0, 1).
    pub fn open(
        path: &Path,
        tokenizer: Option<&Path>,
        seq_len: usize,
        val_fraction: f64,
        seed: u64,
    ) -> Result<Self, DataError> {
        if !(val_fraction > 0.0 && val_fraction < 1.0) {
            return Err(DataError::InvalidOption {
                key: "data.val_fraction",
                value: val_fraction.to_string(),
                reason: "must be strictly between 0 and 1 (the share of the file held out for validation)".into(),
            });
        }
        // Load the tokenizer first: a bad tokenizer.json fails before reading a large file.
        let tokenizer = tokenizer.map(TextTokenizer::from_file).transpose()?;
        // A corpus is legitimately large, so only the file type is bounded: a FIFO or a
        // device (a link to /dev/zero) is refused instead of hanging or filling memory.
        let bytes = ava_fs::bounded::read(path, ava_fs::bounded::limits::LARGE).map_err(|e| match e {
            ava_fs::bounded::ReadError::Missing(_) => DataError::NotFound { path: path.to_path_buf() },
            ava_fs::bounded::ReadError::Io { source, .. } => DataError::Read { path: path.to_path_buf(), source },
            other => DataError::Read {
                path: path.to_path_buf(),
                source: io::Error::new(io::ErrorKind::InvalidInput, {
                    let full = other.to_string();
                    full.strip_prefix(&format!("{}: ", path.display())).map(str::to_string).unwrap_or(full)
                }),
            },
        })?;
        let (tokens, vocab_size) = match &tokenizer {
            None => (Tokens::Bytes(bytes), 256),
            Some(tok) => {
                let text = String::from_utf8(bytes).map_err(|e| DataError::NotUtf8 {
                    path: path.to_path_buf(),
                    offset: e.utf8_error().valid_up_to(),
                })?;
                (Tokens::Ids(tok.encode(&text, path)?), tok.vocab_size())
            }
        };
        let len = tokens.len();
        let val_len = ((len as f64) * val_fraction).round() as usize;
        let train_len = len - val_len.min(len);
        let needed = seq_len + 1;
        for (split, split_tokens) in [(Split::Train, train_len), (Split::Validation, len - train_len)] {
            if split_tokens < needed {
                return Err(DataError::TooShort {
                    path: path.to_path_buf(),
                    tokens: len,
                    split,
                    split_tokens,
                    needed,
                    val_fraction,
                });
            }
        }
        Ok(Self {
            path: path.to_path_buf(),
            tokenizer: tokenizer.map(|t| t.path().to_path_buf()),
            tokens,
            train_len,
            vocab_size,
            seed,
        })
    }

    /// Number of tokens in the whole file.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether the file has no tokens (never true for an opened dataset).
    pub fn is_empty(&self) -> bool {
        self.tokens.len() == 0
    }

    /// The token range `[start, end)` of `split` within the file's token stream.
    pub fn split_range(&self, split: Split) -> std::ops::Range<usize> {
        match split {
            Split::Train => 0..self.train_len,
            Split::Validation => self.train_len..self.tokens.len(),
        }
    }

    /// The offset (in the whole token stream) of the window of sequence `index` of `split`.
    ///
    /// # Panics
    /// If the split is shorter than `seq_len + 1` tokens.
    pub fn window_start(&self, split: Split, index: u64, seq_len: usize) -> usize {
        let range = self.split_range(split);
        let max_seq = range.len().saturating_sub(1);
        assert!(
            seq_len <= max_seq,
            "seq_len {seq_len} is too long for the {split} split of {} ({} tokens; at most {max_seq})",
            self.path.display(),
            range.len()
        );
        // Offsets are uniform in [0, split_len - seq_len - 1], so the window ends inside the split.
        let positions = (range.len() - seq_len) as u64;
        range.start + Rng::stream(self.seed, split.stream_id(), index).below(positions) as usize
    }
}

impl Dataset for TextDataset {
    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    fn sequence(&self, split: Split, index: u64, seq_len: usize) -> Vec<u32> {
        self.tokens.window(self.window_start(split, index, seq_len), seq_len + 1)
    }

    fn entropy_floor_nats(&self) -> Option<f64> {
        None
    }

    fn describe(&self) -> String {
        let encoding = match &self.tokenizer {
            None => "byte-level".to_string(),
            Some(t) => format!("tokenizer {}", t.display()),
        };
        format!(
            "text file {}: {} tokens, {encoding} (vocab {}); {} train / {} validation tokens",
            self.path.display(),
            self.tokens.len(),
            self.vocab_size,
            self.train_len,
            self.tokens.len() - self.train_len
        )
    }

    fn max_seq_len(&self, split: Split) -> Option<usize> {
        Some(self.split_range(split).len().saturating_sub(1))
    }
}
