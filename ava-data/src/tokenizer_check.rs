//! A tokenizer.json is outside input: [`check`] reads its description before the `tokenizers`
//! crate builds or runs it, and refuses what would make a small file cost unbounded memory or
//! time. The limits are the constants below, each with why it has its value.
//!
//! Counts: vocabulary entries, merges and added tokens, and every id, are bounded (an id sizes
//! the embedding table through the vocabulary size). Growth: each normalizer, pre-tokenizer,
//! post-processor and decoder is given a bound `out <= a * in + b` on the bytes (or ids) it can
//! make of its input, a `Sequence` composes its members' bounds with checked arithmetic, and a
//! tokenizer whose text or decoded output can grow more than [`MAX_GROWTH`] times is refused,
//! naming the member that took it over. [`Growth::factor`] also tells the caller how much text
//! it may hand the crate at once.

use serde_json::Value;

/// Vocabulary entries, merges, and every id must be below this (2 097 152). The largest
/// published vocabularies have about 262 144 tokens (Gemma 3); an id sizes the model's
/// embedding table (the vocabulary size is the largest id plus one), so a stray
/// `4294967295` would ask for billions of rows.
pub const MAX_VOCAB: u64 = 1 << 21;
/// Merges at most: one per vocabulary entry.
pub const MAX_MERGES: u64 = MAX_VOCAB;
/// Added tokens at most (65 536). Real tokenizers list tens to a few thousand (T5's 100
/// `<extra_id_N>`, Llama 3's 256 reserved tokens); each is matched in every text, and the
/// crate normalizes and indexes each one when the file is loaded.
pub const MAX_ADDED_TOKENS: u64 = 1 << 16;
/// Bytes of the added tokens' contents together (4 MiB, 64 bytes for each of the most
/// tokens): both the crate and Ava's encoder build an automaton with a state per byte.
pub const MAX_ADDED_BYTES: u64 = 4 << 20;
/// Bytes of the `normalized` added tokens once normalized, at most (16 MiB): the crate
/// normalizes each when it loads the file, and holds them all (tens of bytes per byte) until
/// it has built its matcher.
pub const MAX_NORMALIZED_ADDED_BYTES: u64 = 16 << 20;
/// Bytes of one vocabulary entry or added token at most (1024; published vocabularies'
/// longest are runs of spaces or dashes of a hundred or so): a Unigram model walks every entry
/// that begins at each position of the text, so the longest sets the time per byte, and the
/// crate's matcher of added tokens takes time growing faster than their length to build.
pub const MAX_TOKEN_BYTES: u64 = 1024;
/// How many times the bytes of a text (or of decoded tokens) may grow through the normalizer,
/// the pre-tokenizer and the post-processor (or the decoder), by the bounds below. Real
/// tokenizers stay far below: GPT-2's byte-level pre-tokenizer 2, Llama 2's `Prepend` and
/// `Replace(" ", "▁")` 3, BERT's normalizer 12, NFKC with a metaspace 33. A `Sequence` of
/// ten `Replace`s that double the text is 1024, and grows 1 MiB of text to 1 GiB.
pub const MAX_GROWTH: u64 = 256;
/// Bytes a tokenizer may add to a text regardless of its length (`Prepend`, a metaspace or
/// byte-level prefix): 64 KiB, far above any real prefix.
pub const MAX_EXTRA_BYTES: u64 = 1 << 16;
/// Members of one `Sequence` at most: each is one more pass over the whole text.
pub const MAX_SEQUENCE: usize = 64;
/// WordPiece's `max_input_chars_per_word` at most: the crate looks up every prefix of a word
/// (time quadratic in it); BERT uses 100.
pub const MAX_WORD_CHARS: u64 = 1024;

/// Why a tokenizer.json is refused: the field (`normalizer.normalizers[2].content`) and what
/// is wrong with it, the limit and how to fix it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    /// The key path in the file.
    pub field: String,
    /// What is wrong, the limit, and how to fix it.
    pub message: String,
}

fn refuse<T>(field: &str, message: String) -> Result<T, Refused> {
    Err(Refused { field: field.to_string(), message })
}

/// A bound `out <= a * in + b` on what a step makes of `in` bytes (or ids).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Growth {
    a: u64,
    b: u64,
}

impl Growth {
    const SAME: Growth = Growth { a: 1, b: 0 };

    fn times(a: u64) -> Self {
        Self { a: a.max(1), b: 0 }
    }

    /// This step followed by `next` (saturating: a saturated bound is over every limit).
    fn then(self, next: Growth) -> Self {
        Self { a: next.a.saturating_mul(self.a), b: next.a.saturating_mul(self.b).saturating_add(next.b) }
    }

    /// The multiplier: at most [`MAX_GROWTH`] in a checked tokenizer.
    pub fn factor(self) -> u64 {
        self.a
    }

    /// Refuses the bound if it is over the limits; `field` is the step that made it.
    fn within(self, field: &str, what: &str) -> Result<Self, Refused> {
        if self.a > MAX_GROWTH {
            return refuse(
                field,
                format!(
                    "{what}; with it the tokenizer can make up to {} bytes of each byte of text, and at most \
                     {MAX_GROWTH} is accepted (a tokenizer that grows text more makes memory grow with it); shorten \
                     or remove it",
                    show(self.a)
                ),
            );
        }
        if self.b > MAX_EXTRA_BYTES {
            return refuse(
                field,
                format!(
                    "{what}; with it the tokenizer adds up to {} bytes to every text, and at most {MAX_EXTRA_BYTES} \
                     is accepted; shorten or remove it",
                    show(self.b)
                ),
            );
        }
        Ok(self)
    }
}

fn show(n: u64) -> String {
    if n == u64::MAX { "more than 18446744073709551614".into() } else { n.to_string() }
}

/// What [`check`] found: the growth of text on its way to ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Checked {
    /// Normalizer, pre-tokenizer and post-processor together.
    pub text: Growth,
}

/// Checks a tokenizer.json's description (see the module docs).
pub fn check(json: &Value) -> Result<Checked, Refused> {
    if !json.is_object() {
        return refuse("(top level)", "a tokenizer.json is a JSON object; this file is not one".into());
    }
    model(&json["model"])?;
    let normalized = normalizer(&json["normalizer"], "normalizer", Growth::SAME)?;
    added_tokens(&json["added_tokens"], normalized)?;
    let split = pre_tokenizer(&json["pre_tokenizer"], "pre_tokenizer", normalized)?;
    let text = post_processor(&json["post_processor"], "post_processor", split)?;
    decoder(&json["decoder"], "decoder", Growth::SAME)?;
    Ok(Checked { text })
}

/// A count of entries, refused over `limit`; `why` says why and how to fix it.
fn count(field: &str, n: usize, limit: u64, what: &str, why: &str) -> Result<(), Refused> {
    if n as u64 > limit {
        return refuse(field, format!("{n} {what}; a tokenizer with more than {limit} {what} is refused ({why})"));
    }
    Ok(())
}

/// Why a vocabulary or its merges are bounded.
const VOCAB_WHY: &str = "the largest published vocabularies have about 262 144; use the tokenizer.json of a real model";

/// An id, refused at or over [`MAX_VOCAB`] (a non-integer is left to the crate's own error).
fn id(field: &str, v: &Value) -> Result<(), Refused> {
    match v.as_u64() {
        Some(id) if id >= MAX_VOCAB => refuse(
            field,
            format!(
                "id {id} is not below {MAX_VOCAB}, the most ids a tokenizer may have (the vocabulary size, which \
                 sizes the embedding table, is the largest id plus one); renumber the tokens"
            ),
        ),
        _ => Ok(()),
    }
}

fn model(m: &Value) -> Result<(), Refused> {
    match &m["vocab"] {
        Value::Object(vocab) => {
            count("model.vocab", vocab.len(), MAX_VOCAB, "vocabulary entries", VOCAB_WHY)?;
            for (token, v) in vocab {
                token_bytes("model.vocab", token)?;
                id(&format!("model.vocab[{token:?}]"), v)?;
            }
        }
        // Unigram: `[piece, score]` pairs, ids by position.
        Value::Array(vocab) => {
            count("model.vocab", vocab.len(), MAX_VOCAB, "vocabulary entries", VOCAB_WHY)?;
            for (i, entry) in vocab.iter().enumerate() {
                token_bytes(&format!("model.vocab[{i}]"), entry[0].as_str().unwrap_or(""))?;
            }
        }
        _ => {}
    }
    if let Some(merges) = m["merges"].as_array() {
        count("model.merges", merges.len(), MAX_MERGES, "merges", VOCAB_WHY)?;
    }
    if let Some(chars) = m["max_input_chars_per_word"].as_u64()
        && chars > MAX_WORD_CHARS
    {
        return refuse(
            "model.max_input_chars_per_word",
            format!(
                "{chars} is over {MAX_WORD_CHARS} (WordPiece's time grows with the square of it; BERT uses 100); \
                 lower it"
            ),
        );
    }
    Ok(())
}

/// A vocabulary entry, refused over [`MAX_TOKEN_BYTES`].
fn token_bytes(field: &str, token: &str) -> Result<(), Refused> {
    if token.len() as u64 > MAX_TOKEN_BYTES {
        let start: String = token.chars().take(16).collect();
        return refuse(
            field,
            format!(
                "token {start:?}... has {} bytes; tokens longer than {MAX_TOKEN_BYTES} bytes are refused (the \
                 time to load the tokenizer and encode each byte grows with them); remove it",
                token.len()
            ),
        );
    }
    Ok(())
}

/// The added tokens, whose `normalized` ones the crate runs through `normalizer` when it loads.
fn added_tokens(v: &Value, normalizer: Growth) -> Result<(), Refused> {
    let Some(tokens) = v.as_array() else { return Ok(()) };
    count(
        "added_tokens",
        tokens.len(),
        MAX_ADDED_TOKENS,
        "added tokens",
        "each is looked for in every text, and real tokenizers list at most a few thousand; keep the ones the model \
         uses",
    )?;
    let (mut bytes, mut normalized) = (0u64, 0u64);
    for (i, token) in tokens.iter().enumerate() {
        id(&format!("added_tokens[{i}].id"), &token["id"])?;
        let content = token["content"].as_str().unwrap_or("");
        token_bytes(&format!("added_tokens[{i}].content"), content)?;
        bytes = bytes.saturating_add(content.len() as u64);
        // A token is normalized unless it says otherwise or is special.
        let special = token["special"].as_bool().unwrap_or(false);
        if token["normalized"].as_bool().unwrap_or(!special) {
            let grown = normalizer.a.saturating_mul(content.len() as u64).saturating_add(normalizer.b);
            normalized = normalized.saturating_add(grown);
        }
        if normalized > MAX_NORMALIZED_ADDED_BYTES {
            return refuse(
                &format!("added_tokens[{i}].content"),
                format!(
                    "normalized when the tokenizer is loaded (the normalizer can grow text {} times), the added \
                     tokens pass {MAX_NORMALIZED_ADDED_BYTES} bytes here; mark them \"normalized\": false, or \
                     remove some",
                    normalizer.a
                ),
            );
        }
        if bytes > MAX_ADDED_BYTES {
            return refuse(
                &format!("added_tokens[{i}].content"),
                format!(
                    "the added tokens' contents pass {MAX_ADDED_BYTES} bytes here; longer ones together are \
                     refused (each byte is a state of the matcher built when loading); remove some"
                ),
            );
        }
    }
    Ok(())
}

/// The members of a `Sequence` under `key`, at most [`MAX_SEQUENCE`].
fn members<'a>(v: &'a Value, key: &str, field: &str) -> Result<Option<&'a [Value]>, Refused> {
    let Some(all) = v[key].as_array() else { return Ok(None) };
    if all.len() > MAX_SEQUENCE {
        return refuse(
            &format!("{field}.{key}"),
            format!(
                "{} members; a sequence of more than {MAX_SEQUENCE} is refused (each is a pass over the text)",
                all.len()
            ),
        );
    }
    Ok(Some(all))
}

/// `so_far` followed by each member of the sequence, each checked.
fn sequence(
    all: &[Value],
    field: &str,
    key: &str,
    so_far: Growth,
    step: fn(&Value, &str, Growth) -> Result<Growth, Refused>,
) -> Result<Growth, Refused> {
    all.iter().enumerate().try_fold(so_far, |g, (i, member)| step(member, &format!("{field}.{key}[{i}]"), g))
}

/// The type of a step: its `type`, or what its keys say (the crate also reads untagged forms).
fn kind<'a>(v: &'a Value, by_key: &[(&str, &'a str)]) -> &'a str {
    v["type"].as_str().or_else(|| by_key.iter().find(|(key, _)| v.get(*key).is_some()).map(|(_, k)| *k)).unwrap_or("")
}

/// A normalizer `Sequence`. Members in a row that map each character to a normal form
/// (NFC, NFD, NFKC, NFKD, a `Precompiled` map, StripAccents, Lowercase) grow text by the
/// largest of their factors (doubled with a Lowercase among them), not their product: the
/// second form of a character already in normal form is not an expansion of the first's
/// output (ALBERT and XLNet write NFKD, StripAccents, Lowercase, Precompiled). Every other
/// member composes as it does alone.
fn normalizer_sequence(all: &[Value], field: &str, so_far: Growth) -> Result<Growth, Refused> {
    let mut g = so_far;
    // The run of character forms under way: its largest factor, the member that has it, and
    // whether it lowercases.
    let mut run: Option<(u64, String, bool)> = None;
    let close = |g: Growth, run: &mut Option<(u64, String, bool)>| -> Result<Growth, Refused> {
        match run.take() {
            None => Ok(g),
            Some((factor, at, lower)) => {
                let g = g.then(Growth::times(factor.saturating_mul(if lower { 2 } else { 1 })));
                g.within(&at, "a run of Unicode normalizations")
            }
        }
    };
    for (i, member) in all.iter().enumerate() {
        let at = format!("{field}.normalizers[{i}]");
        match character_form(member, &at)? {
            Some((factor, lower)) => {
                let (most, most_at, lowered) = run.get_or_insert((1, at.clone(), false));
                if factor > *most {
                    (*most, *most_at) = (factor, at);
                }
                *lowered |= lower;
            }
            None => {
                g = close(g, &mut run)?;
                g = normalizer(member, &at, g)?;
            }
        }
    }
    close(g, &mut run)
}

/// A normalizer that maps each character to a normal form: its factor, and whether it is a
/// Lowercase; `None` for any other normalizer.
fn character_form(v: &Value, field: &str) -> Result<Option<(u64, bool)>, Refused> {
    Ok(match v["type"].as_str().unwrap_or(if v.get("precompiled_charsmap").is_some() { "Precompiled" } else { "" }) {
        "NFKC" | "NFKD" => Some((11, false)),
        "NFC" | "NFD" => Some((3, false)),
        "StripAccents" => Some((1, false)),
        "Lowercase" => Some((1, true)),
        "Precompiled" => {
            // Checked (and its longest replacement read) as it is alone.
            Some((normalizer(v, field, Growth::SAME)?.factor(), false))
        }
        _ => None,
    })
}

fn normalizer(v: &Value, field: &str, so_far: Growth) -> Result<Growth, Refused> {
    let keys = [
        ("normalizers", "Sequence"),
        ("content", "Replace"),
        ("prepend", "Prepend"),
        ("precompiled_charsmap", "Precompiled"),
    ];
    let step = match kind(v, &keys) {
        "Sequence" => {
            return match members(v, "normalizers", field)? {
                Some(all) => normalizer_sequence(all, field, so_far),
                None => Ok(so_far),
            };
        }
        "Replace" => return replace(v, field, so_far),
        "Prepend" => {
            let bytes = v["prepend"].as_str().map_or(0, str::len) as u64;
            let g = so_far.then(Growth { a: 1, b: bytes });
            return g.within(&format!("{field}.prepend"), &format!("a prefix of {bytes} bytes"));
        }
        "Precompiled" => {
            let map = v["precompiled_charsmap"].as_str().unwrap_or("");
            if decode_base64(map).is_none() {
                return refuse(
                    &format!("{field}.precompiled_charsmap"),
                    "it is not base64; write the tokenizer again with the tools that made it".into(),
                );
            }
            let longest = precompiled_longest(map);
            let g = so_far.then(Growth::times(longest));
            return g.within(
                &format!("{field}.precompiled_charsmap"),
                &format!("a character map replacing a character with up to {longest} bytes"),
            );
        }
        // UAX #15: in UTF-8, NFKC and NFKD grow text at most 11 times, NFC and NFD 3 times.
        "NFKC" | "NFKD" => Growth::times(11),
        "NFC" | "NFD" => Growth::times(3),
        // Removes combining marks: never longer.
        "StripAccents" => Growth::SAME,
        // Lowercase grows a character by at most half its bytes (U+023A: 2 bytes to 3).
        "Lowercase" => Growth::times(2),
        // Each byte becomes a character of at most 2 bytes.
        "ByteLevel" => Growth::times(2),
        // Spaces around CJK characters (2), accents stripped (3), lowercase (2).
        "BertNormalizer" => Growth::times(12),
        _ => Growth::SAME,
    };
    so_far.then(step).within(field, &format!("a {} normalizer", kind(v, &keys)))
}

/// A `Replace` (normalizer or decoder): a match of at least `m` bytes becomes `content`.
fn replace(v: &Value, field: &str, so_far: Growth) -> Result<Growth, Refused> {
    let content = v["content"].as_str().map_or(0, str::len) as u64;
    let pattern = &v["pattern"];
    let shortest = match (pattern["String"].as_str(), pattern["Regex"].as_str()) {
        (Some(s), _) => s.len() as u64,
        (None, Some(r)) => {
            regex_syntax::Parser::new().parse(r).ok().and_then(|hir| hir.properties().minimum_len()).unwrap_or(0) as u64
        }
        (None, None) => 1,
    };
    // A pattern that can match nothing inserts `content` at every character boundary.
    let step = if shortest == 0 {
        Growth { a: content.saturating_add(1), b: content }
    } else {
        Growth::times(content.div_ceil(shortest))
    };
    so_far.then(step).within(
        &format!("{field}.content"),
        &format!("a replacement of {content} bytes for a match of at least {shortest} byte(s)"),
    )
}

/// The longest replacement in a `Precompiled` normalizer's character map (base64 of: the
/// trie's size in bytes as a little-endian u32, the trie, then NUL-terminated replacements);
/// the whole map's size when it does not read so.
fn precompiled_longest(base64: &str) -> u64 {
    let Some(map) = decode_base64(base64) else { return base64.len() as u64 };
    let trie = map.get(..4).map(|n| u32::from_le_bytes(n.try_into().expect("4 bytes")) as usize);
    match trie.and_then(|t| t.checked_add(4)).and_then(|start| map.get(start..)) {
        Some(replacements) => replacements.split(|&b| b == 0).map(<[u8]>::len).max().unwrap_or(0) as u64,
        None => map.len() as u64,
    }
}

/// Standard base64 with padding, or `None`.
fn decode_base64(s: &str) -> Option<Vec<u8>> {
    let digit = |c: u8| match c {
        b'A'..=b'Z' => Some(c - b'A'),
        b'a'..=b'z' => Some(c - b'a' + 26),
        b'0'..=b'9' => Some(c - b'0' + 52),
        b'+' => Some(62),
        b'/' => Some(63),
        _ => None,
    };
    let s = s.trim_end_matches('=').as_bytes();
    if s.len() % 4 == 1 {
        return None;
    }
    let mut out = Vec::with_capacity(s.len() / 4 * 3 + 3);
    for chunk in s.chunks(4) {
        let bits = chunk.iter().try_fold(0u32, |acc, &c| Some(acc << 6 | u32::from(digit(c)?)))?;
        let bits = bits << (6 * (4 - chunk.len()));
        let bytes = bits.to_be_bytes();
        out.extend_from_slice(&bytes[1..chunk.len()]);
    }
    Some(out)
}

fn pre_tokenizer(v: &Value, field: &str, so_far: Growth) -> Result<Growth, Refused> {
    let keys = [("pretokenizers", "Sequence"), ("replacement", "Metaspace")];
    let step = match kind(v, &keys) {
        "Sequence" => {
            return match members(v, "pretokenizers", field)? {
                Some(all) => sequence(all, field, "pretokenizers", so_far, pre_tokenizer),
                None => Ok(so_far),
            };
        }
        // Each byte becomes a character of at most 2 bytes, and a space may be put in front.
        "ByteLevel" => Growth { a: 2, b: 2 },
        // A space (1 byte) becomes the replacement character, which may also be put in front.
        "Metaspace" => {
            let r = v["replacement"].as_str().map_or(1, str::len) as u64;
            Growth { a: r, b: r }
        }
        _ => Growth::SAME,
    };
    so_far.then(step).within(field, &format!("a {} pre-tokenizer", kind(v, &keys)))
}

/// Ids of the text through the post-processor: a template's `single` may copy the text's ids
/// several times, even when special tokens are not asked for.
fn post_processor(v: &Value, field: &str, so_far: Growth) -> Result<Growth, Refused> {
    match kind(v, &[("processors", "Sequence"), ("single", "TemplateProcessing")]) {
        "Sequence" => match members(v, "processors", field)? {
            Some(all) => sequence(all, field, "processors", so_far, post_processor),
            None => Ok(so_far),
        },
        "TemplateProcessing" => {
            let copies = v["single"].as_array().map_or(0, |pieces| {
                pieces
                    .iter()
                    .filter(|p| p.get("Sequence").is_some() || p.as_str().is_some_and(|s| s.starts_with('$')))
                    .count()
            }) as u64;
            so_far
                .then(Growth::times(copies))
                .within(&format!("{field}.single"), &format!("a template that repeats the text {copies} times"))
        }
        _ => Ok(so_far),
    }
}

fn decoder(v: &Value, field: &str, so_far: Growth) -> Result<Growth, Refused> {
    let keys = [("decoders", "Sequence"), ("content", "Replace")];
    let step = match kind(v, &keys) {
        "Sequence" => {
            return match members(v, "decoders", field)? {
                Some(all) => sequence(all, field, "decoders", so_far, decoder),
                None => Ok(so_far),
            };
        }
        "Replace" => return replace(v, field, so_far),
        // A suffix, prefix or delimiter becomes a space; an empty one puts a space between
        // every two characters.
        "BPEDecoder" | "WordPiece" | "CTC" => Growth::times(3),
        _ => Growth::SAME,
    };
    so_far.then(step).within(field, &format!("a {} decoder", kind(v, &keys)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn refused(v: Value) -> Refused {
        check(&v).expect_err("refused")
    }

    #[test]
    fn growth_composes_and_names_the_member_over_the_limit() {
        let double = json!({"type": "Replace", "pattern": {"String": "a"}, "content": "aa"});
        let ok = json!({"normalizer": {"type": "Sequence", "normalizers": vec![double.clone(); 8]}});
        assert_eq!(check(&ok).unwrap().text.factor(), 256);
        let r = refused(json!({"normalizer": {"type": "Sequence", "normalizers": vec![double; 9]}}));
        assert_eq!(r.field, "normalizer.normalizers[8].content");
        assert!(r.message.contains("up to 512 bytes") && r.message.contains("at most 256"), "{}", r.message);
    }

    #[test]
    fn unicode_forms_in_a_row_grow_text_by_the_largest_not_the_product() {
        let form = |t: &str| json!({"type": t});
        // ALBERT's and XLNet's shape (their Precompiled map in place of the last NFKC): the
        // product 11·1·2·11·3 would be refused; the run grows by 11, doubled for Lowercase.
        let albert = json!({"normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Replace", "pattern": {"String": "``"}, "content": "\""},
            form("NFKD"), form("StripAccents"), form("Lowercase"), form("NFKC"), form("NFD")]}});
        assert_eq!(check(&albert).unwrap().text.factor(), 22);
        // A member that grows text between two forms breaks the run: the products count.
        let double = json!({"type": "Replace", "pattern": {"String": "a"}, "content": "aaaa"});
        let broken = json!({"normalizer": {"type": "Sequence", "normalizers": [form("NFKD"), double, form("NFKC")]}});
        let r = refused(broken);
        assert_eq!(r.field, "normalizer.normalizers[2]");
        assert!(r.message.contains("a run of Unicode normalizations") && r.message.contains("484"), "{}", r.message);
    }

    #[test]
    fn a_pattern_that_matches_nothing_inserts_everywhere() {
        let empty = json!({"normalizer": {"type": "Replace", "pattern": {"Regex": "x*"}, "content": "y".repeat(300)}});
        assert!(refused(empty).message.contains("at least 0 byte(s)"));
        let llama = json!({"normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}});
        let g = check(&llama).unwrap().text;
        // The prefix counts as text the replacement may grow: a bound, not the exact growth.
        assert_eq!((g.a, g.b), (3, 9));
    }

    #[test]
    fn the_precompiled_map_is_read_for_its_longest_replacement() {
        // Trie of 4 bytes, then "ab\0" and 40 bytes.
        let mut map = vec![4, 0, 0, 0, 9, 9, 9, 9, b'a', b'b', 0];
        map.extend(std::iter::repeat_n(b'z', 40));
        let encoded = encode_base64(&map);
        assert_eq!(decode_base64(&encoded).unwrap(), map);
        assert_eq!(precompiled_longest(&encoded), 40);
        assert_eq!(precompiled_longest("!!"), 2);
        let r = refused(json!({"normalizer": {"type": "Precompiled", "precompiled_charsmap": "AAAAA"}}));
        assert_eq!(r.field, "normalizer.precompiled_charsmap");
    }

    fn encode_base64(bytes: &[u8]) -> String {
        const A: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let mut s = String::new();
        for c in bytes.chunks(3) {
            let n = c.iter().enumerate().fold(0u32, |acc, (i, &b)| acc | u32::from(b) << (16 - 8 * i));
            for i in 0..=c.len() {
                s.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
            }
        }
        while !s.len().is_multiple_of(4) {
            s.push('=');
        }
        s
    }

    #[test]
    fn ids_counts_templates_and_sequences_are_bounded() {
        let r = refused(json!({"model": {"type": "BPE", "vocab": {"a": 0, "b": 4294967295u64}, "merges": []}}));
        assert_eq!(r.field, "model.vocab[\"b\"]");
        assert!(r.message.contains("id 4294967295 is not below 2097152"));
        let r = refused(json!({"added_tokens": [{"id": 0, "content": "x"}, {"id": 2097152, "content": "y"}]}));
        assert_eq!(r.field, "added_tokens[1].id");
        let r = refused(json!({"post_processor": {"type": "TemplateProcessing",
            "single": vec![json!({"Sequence": {"id": "A", "type_id": 0}}); 300]}}));
        assert_eq!(r.field, "post_processor.single");
        let r = refused(
            json!({"pre_tokenizer": {"type": "Sequence", "pretokenizers": vec![json!({"type": "ByteLevel"}); 9]}}),
        );
        assert_eq!(r.field, "pre_tokenizer.pretokenizers[8]");
        let r = refused(json!({"decoder": {"type": "Sequence", "decoders": vec![json!({"type": "Fuse"}); 65]}}));
        assert_eq!(r.field, "decoder.decoders");
        let r = refused(json!({"model": {"type": "WordPiece", "vocab": {}, "max_input_chars_per_word": 1000000}}));
        assert_eq!(r.field, "model.max_input_chars_per_word");
        assert_eq!(refused(json!([1])).field, "(top level)");
        let r = refused(json!({"model": {"type": "Unigram", "vocab": [["a", 0.0], ["b".repeat(1025), 0.0]]}}));
        assert_eq!(r.field, "model.vocab[1]");
        assert!(r.message.contains("has 1025 bytes"), "{}", r.message);
        let r = refused(json!({"added_tokens": [{"id": 0, "content": "x".repeat(1025)}]}));
        assert_eq!(r.field, "added_tokens[0].content");
        let long = json!({"id": 0, "content": "x".repeat(1024)});
        let r = refused(json!({"added_tokens": vec![long.clone(); 4097]}));
        assert_eq!(r.field, "added_tokens[4096].content");
        assert!(r.message.contains("pass 4194304 bytes"), "{}", r.message);
        // Normalized (the default for tokens not special) through a normalizer growing text
        // 256 times: 65 tokens of 1024 bytes pass 16 MiB.
        let grow = json!({"type": "Sequence", "normalizers":
            vec![json!({"type": "Replace", "pattern": {"String": "a"}, "content": "aa"}); 8]});
        let r = refused(json!({"normalizer": grow.clone(), "added_tokens": vec![long; 65]}));
        assert_eq!(r.field, "added_tokens[64].content");
        assert!(r.message.contains("\"normalized\": false"), "{}", r.message);
        let special = json!({"id": 0, "content": "x".repeat(1024), "special": true});
        check(&json!({"normalizer": grow, "added_tokens": vec![special; 65]})).unwrap();
    }
}
