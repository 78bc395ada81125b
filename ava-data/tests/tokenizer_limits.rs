//! A tokenizer.json is outside input: each limit of `ava_data::tokenizer_check` refuses the
//! small file that used to make big work, with the file, the field and the limit in the
//! error; a real tokenizer still loads and encodes as the `tokenizers` crate does; truncation
//! and padding (which the crate panics on or pads with) are dropped.

use std::path::{Path, PathBuf};

use ava_data::TextTokenizer;
use ava_data::tokenizer_check::{MAX_ADDED_TOKENS, MAX_GROWTH};
use serde_json::{Value, json};

fn tiny_llama() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../ava-cli/tests/generate/tiny-llama/tokenizer.json");
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// `json` written as `tokenizer.json` in `dir`.
fn write(dir: &tempfile::TempDir, json: &Value) -> PathBuf {
    let path = dir.path().join("tokenizer.json");
    std::fs::write(&path, serde_json::to_vec(json).unwrap()).unwrap();
    path
}

/// The error text of loading `json`.
fn refusal(json: &Value) -> (PathBuf, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = write(&dir, json);
    let err = TextTokenizer::from_file(&path).expect_err("the tokenizer is refused").to_string();
    assert!(err.contains(&path.display().to_string()), "the error names the file: {err}");
    (path, err)
}

fn crate_ids(json: &Value, text: &str) -> Vec<u32> {
    let tokenizer = tokenizers::Tokenizer::from_bytes(serde_json::to_vec(json).unwrap()).unwrap();
    tokenizer.encode_fast(text, false).unwrap().get_ids().to_vec()
}

const TEXT: &str = "the model is trained on the text; <|endoftext|> then it is done.\nHe said: it's fine";

#[test]
fn a_real_tokenizer_still_loads_and_encodes_as_the_crate_does() {
    let json = tiny_llama();
    let dir = tempfile::tempdir().unwrap();
    let tok = TextTokenizer::from_file(&write(&dir, &json)).unwrap();
    assert_eq!(tok.encoder(), "byte-level BPE (ava's encoder)");
    assert_eq!(tok.encode_piece(TEXT).unwrap(), crate_ids(&json, TEXT));
    assert_eq!(tok.vocab_size(), 320);
}

#[test]
fn a_normalizer_that_grows_text_without_bound_is_refused_naming_the_member() {
    // Ten doublings: 1 MB of text would become 1 GB (and each byte costs the crate tens more).
    let mut json = tiny_llama();
    let double = json!({"type": "Replace", "pattern": {"String": "e"}, "content": "ee"});
    json["normalizer"] = json!({"type": "Sequence", "normalizers": vec![double; 10]});
    let (_, err) = refusal(&json);
    assert!(err.contains("normalizer.normalizers[8].content"), "{err}");
    assert!(
        err.contains("up to 512 bytes of each byte of text") && err.contains(&format!("at most {MAX_GROWTH}")),
        "{err}"
    );
    // One long replacement alone.
    json["normalizer"] = json!({"type": "Replace", "pattern": {"String": "e"}, "content": "e".repeat(4096)});
    let (_, err) = refusal(&json);
    assert!(err.contains("normalizer.content: a replacement of 4096 bytes for a match of at least 1 byte(s)"), "{err}");
    // A prefix put before every text.
    json["normalizer"] = json!({"type": "Prepend", "prepend": "x".repeat(100_000)});
    let (_, err) = refusal(&json);
    assert!(err.contains("normalizer.prepend: a prefix of 100000 bytes") && err.contains("at most 65536"), "{err}");
}

#[test]
fn pre_tokenizers_templates_and_decoders_that_multiply_are_refused() {
    let mut json = tiny_llama();
    json["pre_tokenizer"] = json!({"type": "Sequence", "pretokenizers": vec![json!({"type": "ByteLevel"}); 12]});
    assert!(refusal(&json).1.contains("pre_tokenizer.pretokenizers[8]: a ByteLevel pre-tokenizer"));

    let mut json = tiny_llama();
    json["post_processor"] = json!({"type": "TemplateProcessing",
        "single": vec![json!({"Sequence": {"id": "A", "type_id": 0}}); 1000], "pair": [], "special_tokens": {}});
    assert!(refusal(&json).1.contains("post_processor.single: a template that repeats the text 1000 times"));

    let mut json = tiny_llama();
    let grow = json!({"type": "Replace", "pattern": {"String": "a"}, "content": "a".repeat(64)});
    json["decoder"] = json!({"type": "Sequence", "decoders": [grow.clone(), grow]});
    assert!(refusal(&json).1.contains("decoder.decoders[1].content"));
}

#[test]
fn ids_and_counts_that_would_size_a_huge_table_are_refused() {
    let mut json = tiny_llama();
    json["model"]["vocab"]["Ġthe"] = json!(4_294_967_295u64);
    let (_, err) = refusal(&json);
    assert!(err.contains("model.vocab[\"Ġthe\"]: id 4294967295 is not below 2097152"), "{err}");
    assert!(err.contains("renumber"), "{err}");

    let mut json = tiny_llama();
    json["model"]["type"] = json!("WordPiece");
    json["model"]["max_input_chars_per_word"] = json!(u64::MAX);
    assert!(refusal(&json).1.contains("model.max_input_chars_per_word: 18446744073709551615 is over 1024"));
}

#[test]
fn three_hundred_thousand_added_tokens_are_refused_before_any_is_built() {
    let mut json = tiny_llama();
    let tokens: Vec<Value> = (0..300_000)
        .map(|i| {
            json!({"id": 320 + i, "content": format!("<|r{i}|>"), "single_word": false, "lstrip": false,
                        "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    json["added_tokens"] = Value::Array(tokens);
    let (_, err) = refusal(&json);
    assert!(
        err.contains(&format!(
            "added_tokens: 300000 added tokens; a tokenizer with more than {MAX_ADDED_TOKENS} added tokens is refused"
        )),
        "{err}"
    );
}

#[test]
fn the_most_added_tokens_load_and_are_matched_as_the_crate_does() {
    // All share their first bytes: matching them one by one was quadratic.
    let mut json = tiny_llama();
    let tokens: Vec<Value> = (0..MAX_ADDED_TOKENS - 1)
        .map(|i| {
            json!({"id": 320 + i, "content": format!("<|r{i}|>"), "single_word": false, "lstrip": false,
                        "rstrip": false, "normalized": i % 2 == 0, "special": i % 3 == 0})
        })
        .chain(std::iter::once(json["added_tokens"][0].clone()))
        .collect();
    json["added_tokens"] = Value::Array(tokens);
    let dir = tempfile::tempdir().unwrap();
    let tok = TextTokenizer::from_file(&write(&dir, &json)).unwrap();
    assert_eq!(tok.encoder(), "byte-level BPE (ava's encoder)");
    let text = format!("{TEXT} <|r65000|><|r7|x <|r12345|>{}", "<|r".repeat(1000));
    assert_eq!(tok.encode_piece(&text).unwrap(), crate_ids(&json, &text));
    assert_eq!(tok.vocab_size(), 320 + MAX_ADDED_TOKENS as usize - 1);
}

#[test]
fn truncation_and_padding_are_dropped_and_the_text_is_encoded_whole() {
    let plain = tiny_llama();
    let mut json = plain.clone();
    // The crate panicked on a stride not below max_length, and padded every piece to 100 000.
    json["truncation"] = json!({"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 4});
    json["padding"] = json!({"strategy": {"Fixed": 100_000}, "direction": "Right", "pad_to_multiple_of": null,
                             "pad_id": 0, "pad_type_id": 0, "pad_token": "!"});
    let dir = tempfile::tempdir().unwrap();
    let tok = TextTokenizer::from_file(&write(&dir, &json)).unwrap();
    assert_eq!(tok.encode_piece(TEXT).unwrap(), crate_ids(&plain, TEXT));
}

#[test]
fn a_long_line_through_a_growing_tokenizer_is_handed_over_in_parts() {
    // A normalizer and byte-level pre-tokenizer that can grow text 200 times: the crate gets at most 16 MiB / 200 bytes of
    // text at once, cut before a space, and the ids are those of the whole text.
    let mut plain = tiny_llama();
    plain["normalizer"] = json!({"type": "Replace", "pattern": {"String": "\u{1}"}, "content": "q".repeat(100)});
    let dir = tempfile::tempdir().unwrap();
    let tok = TextTokenizer::from_file(&write(&dir, &plain)).unwrap();
    assert!(tok.encoder().starts_with("tokenizers crate"), "{}", tok.encoder());
    let line = "the model is here ".repeat(20_000);
    assert!(line.len() > (16 << 20) / 200);
    assert_eq!(tok.encode_piece(&line).unwrap(), crate_ids(&plain, &line));
}

#[test]
fn what_the_crate_panics_on_is_an_error_naming_the_file() {
    // Found by tests/fuzz_tokenizer.rs: a bad escape in the decoder stopped the program in the
    // crate's loader ("Helper").
    let text =
        serde_json::to_string(&tiny_llama()).unwrap().replace("\"decoder\":{", "\"decoder\":{\"x\":\"\\ud800\",");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer.json");
    std::fs::write(&path, &text).unwrap();
    let err = TextTokenizer::from_file(&path).unwrap_err().to_string();
    assert!(err.contains(&path.display().to_string()) && err.contains("it is not JSON"), "{err}");

    // A character map whose trie points outside itself: the crate indexes past its end.
    let mut json = tiny_llama();
    json["normalizer"] = json!({"type": "Precompiled", "precompiled_charsmap": "BAAAAP////9hAA=="});
    let tok = TextTokenizer::from_file(&write(&dir, &json)).unwrap();
    let err = tok.encode_piece("abc").unwrap_err();
    assert!(err.contains("the tokenizers crate panicked running this tokenizer"), "{err}");
    assert!(err.contains("the tokenizer file is damaged") && err.contains("the text is not at fault"), "{err}");
}

#[test]
fn long_added_tokens_are_refused_and_the_longest_accepted_load() {
    // Found by tests/fuzz_tokenizer.rs: one added token of 200 000 bytes took minutes to build
    // a matcher for.
    let mut json = tiny_llama();
    json["added_tokens"][0]["content"] = json!("e".repeat(200_000));
    let (_, err) = refusal(&json);
    assert!(err.contains("added_tokens[0].content: token \"eeeeeeeeeeeeeeee\"... has 200000 bytes"), "{err}");
    assert!(err.contains("longer than 1024 bytes are refused"), "{err}");

    // A hundred of the longest accepted (the crate builds its fastest matcher for few tokens).
    let mut json = tiny_llama();
    let tokens: Vec<Value> = (0..100)
        .map(|i| {
            json!({"id": 320 + i, "content": format!("{i:03}{}", "e".repeat(1021)), "single_word": false,
                   "lstrip": false, "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    json["added_tokens"] = Value::Array(tokens);
    let dir = tempfile::tempdir().unwrap();
    let tok = TextTokenizer::from_file(&write(&dir, &json)).unwrap();
    let text = format!("the {}{} model", "007", "e".repeat(2000));
    assert_eq!(tok.encode_piece(&text).unwrap(), crate_ids(&json, &text));
}
