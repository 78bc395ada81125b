//! [`TextTokenizer`]: a local Hugging Face `tokenizer.json`, used to encode a text file once.
//! A byte-level BPE is encoded by our own [`ByteLevelBpe`] when it reproduces the file exactly
//! (an order of magnitude faster), anything else by the `tokenizers` crate.

use std::path::{Path, PathBuf};

use super::bpe::{ByteLevelBpe, Unsupported};
use super::error::DataError;

/// Text is encoded in chunks of about this many bytes, cut at line ends, to bound the
/// tokenizer's intermediate memory on large files.
const CHUNK_BYTES: usize = 1 << 20;

/// A loaded `tokenizer.json`.
pub struct TextTokenizer {
    path: PathBuf,
    inner: tokenizers::Tokenizer,
    /// Our encoder, or why the crate encodes instead.
    fast: Result<ByteLevelBpe, Unsupported>,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("path", &self.path)
            .field("vocab_size", &self.vocab_size())
            .field("encoder", &self.encoder())
            .finish()
    }
}

impl TextTokenizer {
    /// Loads `path` (a Hugging Face `tokenizer.json`); errors name the file.
    pub fn from_file(path: &Path) -> Result<Self, DataError> {
        if !path.is_file() {
            return Err(DataError::TokenizerNotFound { path: path.to_path_buf() });
        }
        let bad = |message: String| DataError::Tokenizer { path: path.to_path_buf(), message };
        // Bounded: a tokenizer.json is at most tens of megabytes.
        let bytes = ava_plugins::bounded::read(path, ava_plugins::bounded::limits::JSON).map_err(|e| {
            let full = e.to_string();
            bad(full.strip_prefix(&format!("{}: ", path.display())).map(str::to_string).unwrap_or(full))
        })?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| bad(e.to_string()))?;
        let fast = ByteLevelBpe::new(&bytes, &inner);
        Ok(Self { path: path.to_path_buf(), inner, fast })
    }

    /// Which encoder runs: ours, or the `tokenizers` crate and why.
    pub fn encoder(&self) -> String {
        match &self.fast {
            Ok(_) => "byte-level BPE (ava's encoder)".into(),
            Err(why) => format!("tokenizers crate (ava's encoder would differ: {why})"),
        }
    }

    /// The tokenizer file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Vocabulary size including added tokens: one more than the largest id, so that every id the
    /// tokenizer can produce indexes the embedding table (ids need not be dense).
    pub fn vocab_size(&self) -> usize {
        let vocab = self.inner.get_vocab(true);
        let max_id = vocab.values().max().map_or(0, |&id| id as usize + 1);
        max_id.max(vocab.len())
    }

    /// The id of a token given by its text (a special token such as `</s>`), if the
    /// vocabulary has it.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Encodes one piece of a document without adding special tokens (the caller cuts
    /// pieces at line ends, as [`encode`](Self::encode) does).
    pub fn encode_piece(&self, text: &str) -> Result<Vec<u32>, String> {
        match &self.fast {
            // The ids the crate's `encode_fast(text, false)` gives.
            Ok(fast) => Ok(fast.encode(text)),
            Err(_) => self.inner.encode_fast(text, false).map(|e| e.get_ids().to_vec()).map_err(|e| e.to_string()),
        }
    }

    /// Encodes `text` (the contents of `data_path`, named in errors) without adding special
    /// tokens, in line-aligned chunks.
    pub fn encode(&self, text: &str, data_path: &Path) -> Result<Vec<u32>, DataError> {
        let mut ids = Vec::with_capacity(text.len() / 4);
        let mut start = 0;
        while start < text.len() {
            let end = chunk_end(text, start);
            let piece = self.encode_piece(&text[start..end]).map_err(|message| DataError::Encode {
                path: data_path.to_path_buf(),
                tokenizer: self.path.clone(),
                message,
            })?;
            ids.extend_from_slice(&piece);
            start = end;
        }
        Ok(ids)
    }
}

/// End of the chunk starting at `start`: just after the first newline at or past
/// `start + CHUNK_BYTES`, or the end of the text.
fn chunk_end(text: &str, start: usize) -> usize {
    let min_end = start + CHUNK_BYTES;
    if min_end >= text.len() {
        return text.len();
    }
    // '\n' is ASCII, so the byte after it is always a char boundary.
    text.as_bytes()[min_end..].iter().position(|&b| b == b'\n').map_or(text.len(), |i| min_end + i + 1)
}
