//! Which tokenizer.json files [`ByteLevelBpe`](super::ByteLevelBpe) reproduces exactly, and
//! reading their parts: a BPE model over GPT-2's byte alphabet (no dropout, no subword
//! prefix or suffix; `ignore_merges` either way), no normalizer, the `ByteLevel`
//! pre-tokenizer with GPT-2's pattern (`add_prefix_space` either way), added tokens without
//! `single_word`/`lstrip`/`rstrip`, no truncation or padding, and a post-processor that adds
//! nothing when special tokens are not asked for. Anything else is [`Unsupported`], with the
//! reason, and the caller uses the `tokenizers` crate.
//!
//! Read from the loaded tokenizer where it can be (its serialized form is canonical: defaults
//! filled in, merges in rank order with duplicates resolved), and from the file only for the
//! added tokens' flags as listed (loading folds duplicates, which the crate's matching keeps).

use std::collections::{HashMap, HashSet};

use serde::Deserialize;
use serde_json::Value;
use tokenizers::models::ModelWrapper;

use super::cache::FastBuild;

/// Why a tokenizer.json is left to the `tokenizers` crate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unsupported(pub(crate) String);

impl std::fmt::Display for Unsupported {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Unsupported {}

fn unsupported<T>(reason: impl Into<String>) -> Result<T, Unsupported> {
    Err(Unsupported(reason.into()))
}

/// What the encoder needs of a supported tokenizer.json.
pub(crate) struct Parts {
    pub(crate) add_prefix_space: bool,
    /// Each byte's id.
    pub(crate) bytes: [u32; 256],
    /// `(left, right, made)` by rank, lowest first.
    pub(crate) merges: Vec<(u32, u32, u32)>,
    /// With `ignore_merges`, every token by its bytes: a pre-token in the vocabulary is that
    /// one token.
    pub(crate) whole: Option<HashMap<Box<[u8]>, u32, FastBuild>>,
    /// Added tokens: content, id, and whether matched only after the non-normalized ones.
    pub(crate) added: Vec<(String, u32, bool)>,
}

/// GPT-2's printable stand-in for each byte: printable Latin-1 bytes stand for themselves,
/// the others are U+0100 onwards in byte order.
pub(crate) fn byte_chars() -> [char; 256] {
    let mut next = 0x100;
    std::array::from_fn(|b| {
        let b = b as u8;
        if matches!(b, b'!'..=b'~' | 0xa1..=0xac | 0xae..=0xff) {
            char::from(b)
        } else {
            next += 1;
            char::from_u32(next - 1).expect("below U+0200")
        }
    })
}

/// The bytes a vocabulary string stands for, if all its chars are byte stand-ins.
fn string_bytes(s: &str, char_byte: &HashMap<char, u8>) -> Option<Box<[u8]>> {
    s.chars().map(|c| char_byte.get(&c).copied()).collect()
}

/// The byte-level pre-tokenizer's `add_prefix_space`, if `v` is one with GPT-2's pattern
/// (alone or as the only member of a sequence).
fn byte_level(v: &Value) -> Option<bool> {
    match v["type"].as_str()? {
        "ByteLevel" if v["use_regex"].as_bool() == Some(true) => v["add_prefix_space"].as_bool(),
        "Sequence" => match v["pretokenizers"].as_array()?.as_slice() {
            [only] => byte_level(only),
            _ => None,
        },
        _ => None,
    }
}

/// Whether post-processor `v` leaves the ids alone when special tokens are not added (every
/// kind adds them only when asked, except a template that repeats or drops the sequence).
fn post_processor_adds_nothing(v: &Value) -> bool {
    match v["type"].as_str() {
        None => v.is_null(),
        Some("ByteLevel" | "RobertaProcessing" | "BertProcessing") => true,
        Some("TemplateProcessing") => v["single"].as_array().is_some_and(|pieces| {
            let sequences: Vec<&Value> = pieces.iter().filter_map(|p| p.get("Sequence")).collect();
            matches!(sequences.as_slice(), [s] if s["id"] == "A")
        }),
        Some("Sequence") => v["processors"].as_array().is_some_and(|all| all.iter().all(post_processor_adds_nothing)),
        Some(_) => false,
    }
}

fn kind(v: &Value) -> String {
    v["type"].as_str().map_or_else(|| v.to_string(), str::to_string)
}

/// The added tokens as a tokenizer.json lists them.
#[derive(Deserialize)]
struct Listed {
    #[serde(default)]
    added_tokens: Vec<tokenizers::AddedToken>,
}

/// Reads the parts of `tokenizer` (loaded from `json`), or says why ours would differ.
pub(crate) fn parts(json: &[u8], tokenizer: &tokenizers::Tokenizer) -> Result<Parts, Unsupported> {
    let mut canon = serde_json::to_value(tokenizer).or_else(|e| unsupported(format!("it does not serialize ({e})")))?;
    for field in ["truncation", "padding"] {
        if !canon[field].is_null() {
            return unsupported(format!("it has {field}"));
        }
    }
    let normalizer = &canon["normalizer"];
    let no_normalizer = normalizer.is_null()
        || (normalizer["type"] == "Sequence" && normalizer["normalizers"].as_array().is_some_and(Vec::is_empty));
    if !no_normalizer {
        return unsupported(format!("its normalizer is {}", kind(normalizer)));
    }
    let Some(add_prefix_space) = byte_level(&canon["pre_tokenizer"]) else {
        return unsupported(format!(
            "its pre-tokenizer is {}, not ByteLevel with GPT-2's pattern",
            kind(&canon["pre_tokenizer"])
        ));
    };
    if !post_processor_adds_nothing(&canon["post_processor"]) {
        return unsupported(format!("its post-processor is {}", kind(&canon["post_processor"])));
    }

    let ModelWrapper::BPE(bpe) = tokenizer.get_model() else {
        return unsupported(format!("its model is {}, not BPE", kind(&canon["model"])));
    };
    if bpe.dropout.is_some_and(|p| p != 0.0) {
        return unsupported("its BPE has dropout");
    }
    if bpe.continuing_subword_prefix.as_deref().is_some_and(|s| !s.is_empty())
        || bpe.end_of_word_suffix.as_deref().is_some_and(|s| !s.is_empty())
    {
        return unsupported("its BPE marks subwords (continuing_subword_prefix or end_of_word_suffix)");
    }
    let vocab = bpe.get_vocab();
    if vocab.values().collect::<HashSet<_>>().len() != vocab.len() {
        return unsupported("its vocabulary gives one id to several tokens");
    }
    let chars = byte_chars();
    let char_byte: HashMap<char, u8> = chars.iter().zip(0..=255u8).map(|(&c, b)| (c, b)).collect();
    let mut bytes = [0u32; 256];
    for (b, c) in chars.iter().enumerate() {
        let Some(&id) = vocab.get(c.to_string().as_str()) else {
            return unsupported(format!("its vocabulary lacks byte {b:#04x} (as {c:?}), so it is not byte-level"));
        };
        bytes[b] = id;
    }
    // Tokens made of other chars can never be reached from bytes, so their merges never apply;
    // they are kept by id all the same.
    let listed: Vec<(String, String)> = serde_json::from_value(canon["model"]["merges"].take())
        .or_else(|e| unsupported(format!("its merges do not read as pairs ({e})")))?;
    let id = |s: &str| {
        vocab.get(s).copied().ok_or_else(|| Unsupported(format!("merge part {s:?} is not in its vocabulary")))
    };
    let mut merges = Vec::with_capacity(listed.len());
    for (left, right) in &listed {
        merges.push((id(left)?, id(right)?, id(&format!("{left}{right}"))?));
    }
    let whole = bpe.ignore_merges.then(|| {
        vocab.iter().filter_map(|(s, &id)| Some((string_bytes(s, &char_byte)?, id))).collect::<HashMap<_, _, _>>()
    });

    let Listed { added_tokens } =
        serde_json::from_slice(json).or_else(|e| unsupported(format!("its added tokens do not read ({e})")))?;
    let decoder = tokenizer.get_added_tokens_decoder();
    let mut added: Vec<(String, u32, bool)> = Vec::new();
    // Each content's `normalized` flag as first listed: a lookup per token, so that loading
    // stays linear in their number.
    let mut seen: HashMap<&str, bool> = HashMap::with_capacity(added_tokens.len());
    for token in added_tokens.iter().filter(|t| !t.content.is_empty()) {
        if token.single_word || token.lstrip || token.rstrip {
            return unsupported(format!("added token {:?} has single_word, lstrip or rstrip", token.content));
        }
        let Some(id) = tokenizer.token_to_id(&token.content) else {
            return unsupported(format!("added token {:?} has no id", token.content));
        };
        // The crate matches a token, then reads its flags by id: both must be this token's.
        if decoder.get(&id).is_none_or(|t| t.content != token.content) {
            return unsupported(format!("added token {:?} shares id {id} with another token", token.content));
        }
        match seen.get(token.content.as_str()) {
            Some(&normalized) if normalized != token.normalized => {
                return unsupported(format!("added token {:?} is listed twice, normalized and not", token.content));
            }
            Some(_) => {}
            None => {
                seen.insert(&token.content, token.normalized);
                added.push((token.content.clone(), id, token.normalized));
            }
        }
    }
    Ok(Parts { add_prefix_space, bytes, merges, whole, added })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_byte_chars_are_gpt2s() {
        let chars = byte_chars();
        assert_eq!((chars[b'a' as usize], chars[b' ' as usize], chars[b'\n' as usize]), ('a', 'Ġ', 'Ċ'));
        assert_eq!((chars[0], chars[0xad], chars[0xa1]), ('Ā', 'Ń', '¡'));
        assert_eq!(chars.iter().collect::<HashSet<_>>().len(), 256);
    }
}
