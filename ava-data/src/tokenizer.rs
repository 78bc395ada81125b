//! [`TextTokenizer`]: a local Hugging Face `tokenizer.json`, used to encode a text file once.
//! A byte-level BPE is encoded by our own [`ByteLevelBpe`] when it reproduces the file exactly
//! (an order of magnitude faster), anything else by the `tokenizers` crate. [`Tokenizer`]: what
//! a trained model reads and writes text with (that, or raw bytes), and
//! [`byte_tokenizer_json`], the byte tokenizer as a `tokenizer.json` other tools load.

use std::path::{Path, PathBuf};

use super::bpe::{ByteLevelBpe, Unsupported};
use super::error::DataError;
use super::tokenizer_check;

/// Text is encoded in chunks of about this many bytes, cut at line ends, to bound the
/// tokenizer's intermediate memory on large files.
const CHUNK_BYTES: usize = 1 << 20;

/// Most bytes of text, times the tokenizer's growth factor, the `tokenizers` crate is handed
/// at once: it keeps tens of bytes per byte of normalized text (alignments, offsets, token
/// strings). 16 MiB is what an 8 MiB piece of `ava data prepare` makes through GPT-2's
/// byte-level pre-tokenizer (factor 2), so byte-level tokenizers see the pieces they did. A
/// tokenizer that can grow text more gets smaller parts (Llama-2's, factor 3: 5.3 MiB; BERT's,
/// 12: 1.4 MiB): a document longer than that is cut at a line end, and where a tokenizer marks
/// the start of its input (a `Prepend`, a `Metaspace` prefix) the ids at the cut differ from
/// encoding it whole. Memory bounded is chosen over those few ids.
const CRATE_TEXT_BYTES: u64 = 16 << 20;

/// A loaded `tokenizer.json`.
pub struct TextTokenizer {
    path: PathBuf,
    inner: tokenizers::Tokenizer,
    /// Our encoder, or why the crate encodes instead.
    fast: Result<ByteLevelBpe, Unsupported>,
    /// How many times the tokenizer can grow text (checked: at most
    /// [`MAX_GROWTH`](tokenizer_check::MAX_GROWTH)).
    growth: u64,
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
    /// Loads `path` (a Hugging Face `tokenizer.json`); errors name the file. Its description is
    /// checked first ([`tokenizer_check`]); truncation and padding are dropped (a corpus or a
    /// prompt is encoded whole, and the crate panics on some of their settings).
    pub fn from_file(path: &Path) -> Result<Self, DataError> {
        if !path.is_file() {
            return Err(DataError::TokenizerNotFound { path: path.to_path_buf() });
        }
        let bad = |message: String| DataError::Tokenizer { path: path.to_path_buf(), message };
        // Bounded: a tokenizer.json is at most tens of megabytes.
        let bytes = ava_fs::bounded::read(path, ava_fs::bounded::limits::JSON).map_err(|e| {
            let full = e.to_string();
            bad(full.strip_prefix(&format!("{}: ", path.display())).map(str::to_string).unwrap_or(full))
        })?;
        // The crate panics on some text that is not JSON: it only ever sees JSON.
        let value: serde_json::Value =
            serde_json::from_slice(&bytes).map_err(|e| bad(format!("it is not JSON ({e})")))?;
        let checked = tokenizer_check::check(&value).map_err(|r| DataError::TokenizerRefused {
            path: path.to_path_buf(),
            field: r.field,
            message: r.message,
        })?;
        drop(value);
        let mut inner =
            guarded(|| tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| e.to_string())).map_err(bad)?;
        inner.with_truncation(None).map_err(|e| bad(e.to_string()))?;
        inner.with_padding(None);
        let fast = ByteLevelBpe::new(&bytes, &inner);
        Ok(Self { path: path.to_path_buf(), inner, fast, growth: checked.text.factor() })
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
            Err(_) => self.crate_encode(text),
        }
    }

    /// The crate's ids of `text`, handed over in parts of at most [`CRATE_TEXT_BYTES`] divided
    /// by the growth factor, cut where [`crate_cut`] says.
    fn crate_encode(&self, text: &str) -> Result<Vec<u32>, String> {
        let most = usize::try_from(CRATE_TEXT_BYTES / self.growth.max(1)).unwrap_or(usize::MAX);
        let mut ids = Vec::new();
        let mut rest = text;
        loop {
            let cut = crate_cut(rest, most);
            let part = &rest[..cut];
            let encoding = guarded(|| self.inner.encode_fast(part, false).map_err(|e| e.to_string()))?;
            ids.extend_from_slice(encoding.get_ids());
            rest = &rest[cut..];
            if rest.is_empty() {
                return Ok(ids);
            }
        }
    }

    /// The text of `ids`, special tokens written out (`<|endoftext|>`); bytes that do not make
    /// whole UTF-8 characters (a character cut between tokens) become U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String, String> {
        guarded(|| self.inner.decode(ids, false).map_err(|e| e.to_string()))
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

thread_local! {
    /// Set while this thread runs a [`guarded`] call: its panic is reported as an error, so
    /// the panic hook stays quiet about it.
    static GUARDED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f`, a call into the `tokenizers` crate, which panics on some tokenizers a file can
/// describe (a damaged `precompiled_charsmap`, a decoder it cannot read): a panic becomes an
/// error that blames the tokenizer file, and the process's panic hook (which would print it
/// as a crash) is skipped for it; every other panic is printed as before.
fn guarded<T>(f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    static QUIET_HOOK: std::sync::Once = std::sync::Once::new();
    QUIET_HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !GUARDED.with(std::cell::Cell::get) {
                previous(info);
            }
        }));
    });
    let was = GUARDED.with(|g| g.replace(true));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    GUARDED.with(|g| g.set(was));
    result.unwrap_or_else(|panic| {
        let why = ava_core::ffi::panic_message(panic.as_ref()).unwrap_or_else(|| "no message".into());
        Err(format!(
            "the tokenizers crate panicked running this tokenizer ({why}): the tokenizer file is damaged or describes \
             what the crate cannot run; the text is not at fault"
        ))
    })
}

/// Where the next part of `text` handed to the crate ends: all of it when it has at most
/// `most` bytes; else just after the last line end within `most` bytes (where the caller cuts
/// too), else before the last space (a word keeps its leading space), else at a character
/// boundary; never at 0, so that every part makes progress.
fn crate_cut(text: &str, most: usize) -> usize {
    if text.len() <= most {
        return text.len();
    }
    let window = &text.as_bytes()[..most];
    if let Some(i) = memchr::memrchr(b'\n', window) {
        return i + 1;
    }
    if let Some(i) = memchr::memrchr(b' ', window).filter(|&i| i > 0) {
        return i;
    }
    let mut end = most.max(1);
    while !text.is_char_boundary(end) {
        end += 1;
    }
    let mut back = most;
    while back > 0 && !text.is_char_boundary(back) {
        back -= 1;
    }
    if back > 0 { back } else { end }
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

    /// Whether this reads text as the byte tokenizer does, with `end_of_text` after the bytes:
    /// the byte tokenizer itself, or a tokenizer.json of at most 257 ids that encodes text to
    /// its UTF-8 bytes and has `<|endoftext|>` at `end_of_text` (what a run trained on bytes
    /// exports, [`byte_tokenizer_json`]).
    pub fn reads_as_bytes(&self, end_of_text: u32) -> bool {
        match self {
            Tokenizer::Bytes => true,
            Tokenizer::File(t) => {
                // Every ASCII character, the separators, and characters of 2, 3 and 4 bytes.
                let probe: String = (1u8..128).map(char::from).chain("é ß€ 中文 😀\n\t".chars()).collect();
                t.vocab_size() <= 257
                    && t.token_id(crate::bpe::END_OF_TEXT) == Some(end_of_text)
                    && t.encode_piece(&probe).is_ok_and(|ids| ids.iter().copied().eq(probe.bytes().map(u32::from)))
            }
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

#[cfg(test)]
mod tests {
    use super::crate_cut;

    #[test]
    fn the_crate_gets_parts_cut_at_line_ends_then_spaces_then_characters() {
        assert_eq!(crate_cut("short", 10), 5);
        assert_eq!(crate_cut("ab\ncd ef\ngh", 8), 3);
        assert_eq!(crate_cut("abc def ghi", 9), 7);
        // A space at the very start is no cut: the part would be empty.
        assert_eq!(crate_cut(" abcdef", 4), 4);
        // No line end or space: a character boundary at or before the limit, or the first
        // character when it alone is longer.
        assert_eq!(crate_cut("ééé", 3), 2);
        assert_eq!(crate_cut("東京", 2), 3);
        assert_eq!(crate_cut("東京", 0), 3);
    }
}
