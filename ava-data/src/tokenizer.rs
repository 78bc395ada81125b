//! [`TextTokenizer`]: a local Hugging Face `tokenizer.json`, used to encode a text file once.
//! A byte-level BPE is encoded by our own [`ByteLevelBpe`] when it reproduces the file exactly
//! (an order of magnitude faster), anything else by the `tokenizers` crate. [`Tokenizer`]: what
//! a trained model reads and writes text with (that, or raw bytes), and
//! [`byte_tokenizer_json`], the byte tokenizer as a `tokenizer.json` other tools load.

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

    /// The text of `ids`, special tokens written out (`<|endoftext|>`); bytes that do not make
    /// whole UTF-8 characters (a character cut between tokens) become U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String, String> {
        self.inner.decode(ids, false).map_err(|e| e.to_string())
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

/// The tokenizer a model was trained with: raw bytes (ids 0–255, and the end-of-text id
/// after them in a prepared corpus), or a `tokenizer.json`.
#[derive(Debug)]
pub enum Tokenizer {
    /// Ids 0–255 are the bytes of the text.
    Bytes,
    /// A Hugging Face tokenizer.
    File(Box<TextTokenizer>),
}

impl Tokenizer {
    /// The ids of `text`, no special tokens added.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        match self {
            Tokenizer::Bytes => Ok(text.bytes().map(u32::from).collect()),
            Tokenizer::File(t) => t.encode_piece(text),
        }
    }

    /// The text of `ids`: for bytes, as UTF-8 (U+FFFD for what is not), ids past the bytes
    /// written as `<|endoftext|>`.
    pub fn decode(&self, ids: &[u32]) -> Result<String, String> {
        match self {
            Tokenizer::Bytes => {
                let mut out = String::new();
                let mut bytes = Vec::new();
                for &id in ids {
                    match u8::try_from(id) {
                        Ok(b) => bytes.push(b),
                        Err(_) => {
                            out.push_str(&String::from_utf8_lossy(&std::mem::take(&mut bytes)));
                            out.push_str(crate::bpe::END_OF_TEXT);
                        }
                    }
                }
                out.push_str(&String::from_utf8_lossy(&bytes));
                Ok(out)
            }
            Tokenizer::File(t) => t.decode(ids),
        }
    }

    /// `the byte tokenizer` or `tokenizer PATH`.
    pub fn describe(&self) -> String {
        match self {
            Tokenizer::Bytes => "the byte tokenizer".into(),
            Tokenizer::File(t) => format!("tokenizer {}", t.path().display()),
        }
    }
}

/// The byte tokenizer as a Hugging Face `tokenizer.json`: a byte-level BPE without merges whose
/// vocabulary is the 256 bytes at their own ids (GPT-2's printable stand-ins), and
/// `<|endoftext|>` at `end_of_text` when given. The `tokenizers` crate and transformers encode
/// text with it to exactly its UTF-8 bytes, so a model trained on bytes ships the tokenizer
/// other tools need.
pub fn byte_tokenizer_json(end_of_text: Option<u32>) -> String {
    let chars = crate::bpe::byte_chars();
    let vocab: serde_json::Map<String, serde_json::Value> =
        (0..256).map(|b| (chars[b].to_string(), serde_json::Value::from(b))).collect();
    let added: Vec<serde_json::Value> = end_of_text
        .map(|id| {
            serde_json::json!({
                "id": id, "content": crate::bpe::END_OF_TEXT, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true,
            })
        })
        .into_iter()
        .collect();
    let level =
        serde_json::json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    let json = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": level,
        "post_processor": null,
        "decoder": level,
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": [],
        },
    });
    serde_json::to_string_pretty(&json).expect("a JSON value serializes")
}
