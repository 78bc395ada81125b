//! Our byte-level BPE encoder against the `tokenizers` crate: the same ids on every text, for
//! tokenizers trained here and written by hand, and a refusal (so the crate encodes) for
//! every tokenizer.json it would not reproduce.

use std::fs;
use std::path::{Path, PathBuf};

use ava_data::Rng;
use ava_data::TextTokenizer;
use ava_data::bpe::{self, ByteLevelBpe};
use ava_data::prepare::{Invalid, Reading};
use rayon::prelude::*;
use serde_json::{Value, json};

const WORDS: &[&str] = &[
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "memory",
    "model",
    "training",
    "language",
    "The",
    "Hello",
    "world",
    "it's",
    "don't",
    "we're",
    "I've",
    "I'm",
    "we'll",
    "he'd",
    "IT'S",
    "naïve",
    "café",
    "東京",
    "日本語",
    "١٢٣",
    "Ⅻ",
    "2024",
    "3.14",
    "1,000",
    "e\u{301}t\u{e9}",
    "👍🏽",
    "👨\u{200d}👩\u{200d}👧",
    "--",
    "...",
    "!?",
    "(x)",
    "\"quoted\"",
    "<|endoftext|>",
    "snake_case",
    "x\u{a0}y",
    "Привет",
    "مرحبا",
    "नमस्ते",
    "½",
    "²",
];

/// Generated text with words, numbers, symbols and every kind of whitespace run.
fn corpus(seed: u64, words: usize) -> String {
    let mut rng = Rng::new(seed);
    let mut text = String::new();
    for _ in 0..words {
        text.push_str(WORDS[rng.below(WORDS.len() as u64) as usize]);
        let r = rng.below(100);
        text.push_str(match r {
            0..=69 => " ",
            70..=79 => "\n",
            80..=84 => "  ",
            85..=87 => "\n\n",
            88..=89 => "\t",
            90..=91 => " \n ",
            92..=93 => ", ",
            94..=95 => ". ",
            96 => "\u{3000}",
            _ => "",
        });
    }
    text
}

/// A byte-level BPE of `vocab_size` ids trained by `ava_data::bpe::train` on generated text.
fn trained(dir: &Path, vocab_size: usize) -> PathBuf {
    let input = dir.join("in");
    fs::create_dir_all(&input).unwrap();
    for i in 0..8 {
        fs::write(input.join(format!("doc-{i}.txt")), corpus(i, 3000)).unwrap();
    }
    let out = dir.join(format!("bpe-{vocab_size}.json"));
    let reading = Reading { separator: None, field: "text".into(), invalid: Invalid::Error };
    bpe::train(&[input], &reading, vocab_size, u64::MAX, &out).unwrap();
    out
}

/// The crate's tokenizer and ours, from one file.
fn both(json: &[u8]) -> (tokenizers::Tokenizer, ByteLevelBpe) {
    let reference = tokenizers::Tokenizer::from_bytes(json).unwrap();
    let ours = ByteLevelBpe::new(json, &reference).unwrap();
    (reference, ours)
}

fn crate_ids(reference: &tokenizers::Tokenizer, text: &str) -> Vec<u32> {
    reference.encode_fast(text, false).unwrap().get_ids().to_vec()
}

fn assert_same(reference: &tokenizers::Tokenizer, ours: &ByteLevelBpe, text: &str) {
    assert_eq!(ours.encode(text), crate_ids(reference, text), "text {text:?}");
}

/// Texts chosen for the pattern's corners.
const TEXTS: &[&str] = &[
    "",
    "a",
    " ",
    "Hello world",
    "Hello, world! The model's training isn't done; we're sure they've said I'm fine, you'll see, he'd go.",
    "IT'S THEY'RE WE'VE I'M YOU'LL HE'D 'S 'T",
    "'s 't 're 've 'm 'll 'd ''s '''",
    " 's x's x'S x'sa 'lla 'rex",
    "rock 'n' roll",
    "1 22 333 4444 3.14159 1,000,000 2024-01-01",
    "a  b   c    d",
    "a\n\nb\n\n\nc",
    "trailing spaces   ",
    "   leading spaces",
    "tabs\t\tand\t spaces \t mixed",
    "line\r\nwindows\r\n",
    "\n\n\n",
    "  \n  \n  x",
    "x \u{a0}y \u{3000}z\u{2028}w\u{85}v",
    "naïve café 東京 ١٢٣ Ⅻ ½ ²",
    "e\u{301}t\u{e9} cafe\u{301} a\u{308}",
    "👍🏽 👨\u{200d}👩\u{200d}👧 emoji😀text",
    "Привет мир مرحبا بالعالم नमस्ते दुनिया",
    "before<|endoftext|>after",
    "<|endoftext|>",
    "<|endoftext|><|endoftext|> x <|endoftext|>",
    "text <|endoftext|> text<|endoftext|>\n<|endoftext|> ",
    "<|endoftext|",
    "<|endoftext|>'s",
    "snake_case CamelCase kebab-case UPPER_CASE",
    "!!! ??? ... --- *** ###",
    "\"quoted\" (paren) [bracket] {brace}",
    "https://example.com/path?query=1&x=2",
];

#[test]
fn trained_tokenizers_give_the_crates_ids_on_hand_picked_texts() {
    let tmp = tempfile::tempdir().unwrap();
    for vocab in [300, 600] {
        let path = trained(tmp.path(), vocab);
        let (reference, ours) = both(&fs::read(&path).unwrap());
        for text in TEXTS {
            assert_same(&reference, &ours, text);
        }
        // Merges really applied: fewer ids than bytes on the training text.
        let text = corpus(99, 500);
        assert_same(&reference, &ours, &text);
        assert!(ours.encode(&text).len() * 10 < text.len() * 9);
    }
}

/// Strings drawn from pieces that meet every branch of the pattern, the added token and its
/// fragments.
fn random_text(rng: &mut Rng) -> String {
    const PIECES: &[&str] = &[
        "a",
        "b",
        "t",
        "h",
        "e",
        "s",
        "S",
        "l",
        "r",
        "v",
        "m",
        "d",
        "T",
        "x",
        " ",
        " ",
        " ",
        "\n",
        "\t",
        "\r",
        "'",
        "'",
        "0",
        "7",
        "42",
        "é",
        "ï",
        "東",
        "京",
        "١",
        "Ⅻ",
        "\u{301}",
        "😀",
        "\u{200d}",
        "\u{a0}",
        "\u{3000}",
        "\u{85}",
        "\u{2028}",
        "!",
        ".",
        ",",
        "-",
        "_",
        "<",
        "|",
        ">",
        "<|endoftext|>",
        "endoftext",
        "'ll",
        "'re",
        "  ",
        "\r\n",
        "the",
        " the",
        "ing",
        "\u{b}",
        "\u{c}",
        "$",
        "€",
    ];
    let len = rng.below(40) as usize;
    (0..len).map(|_| PIECES[rng.below(PIECES.len() as u64) as usize]).collect()
}

#[test]
fn trained_tokenizers_give_the_crates_ids_on_random_strings() {
    let tmp = tempfile::tempdir().unwrap();
    let (reference, ours) = both(&fs::read(trained(tmp.path(), 500)).unwrap());
    let mut rng = Rng::new(2024);
    for _ in 0..4000 {
        let text = random_text(&mut rng);
        assert_same(&reference, &ours, &text);
    }
    // Random chars from the whole Unicode range (and their runs), also with whitespace.
    for _ in 0..1000 {
        let len = rng.below(30) as usize;
        let text: String = (0..len)
            .map(|_| match rng.below(4) {
                0 => ' ',
                1 => char::from_u32(rng.below(0x3000) as u32).unwrap_or('?'),
                _ => char::from_u32(rng.below(0x11_0000) as u32).unwrap_or('x'),
            })
            .collect();
        assert_same(&reference, &ours, &text);
    }
}

#[test]
fn long_pretokens_many_words_threads_and_two_encoders_agree_with_the_crate() {
    let tmp = tempfile::tempdir().unwrap();
    let json = fs::read(trained(tmp.path(), 400)).unwrap();
    let (reference, ours) = both(&json);
    // Pre-tokens too long to cache, merged by the heap.
    let mut rng = Rng::new(3);
    let long_letters: String = (0..3000).map(|_| ['t', 'h', 'e', 'a'][rng.below(4) as usize]).collect();
    for text in [
        "1".repeat(5000),
        "the".repeat(700),
        long_letters.clone(),
        format!(" {long_letters} {long_letters}"),
        "!".repeat(1000),
        " ".repeat(3000) + "x",
    ] {
        assert_same(&reference, &ours, &text);
    }
    // More distinct words than the per-thread cache holds, so it empties and refills.
    let words: String =
        (0..150_000u64).map(|i| format!("w{}x{} ", i.wrapping_mul(2_654_435_761) % 1_000_000, i % 7)).collect();
    assert_same(&reference, &ours, &words);
    // From rayon's threads, as `prepare` calls it, and interleaved with another encoder.
    let other_json = fs::read(trained(&tmp.path().join("other"), 300)).unwrap();
    let (other_reference, other) = both(&other_json);
    let docs: Vec<String> = (0..64).map(|i| corpus(1000 + i, 400)).collect();
    docs.par_iter().for_each(|d| {
        assert_eq!(ours.encode(d), crate_ids(&reference, d));
        assert_eq!(other.encode(d), crate_ids(&other_reference, d));
    });
}

/// A tokenizer.json written by hand: GPT-2's byte alphabet, a few merges, `add_prefix_space`,
/// and added tokens of each kind.
fn hand_written(add_prefix_space: bool, ignore_merges: bool) -> Value {
    // Ids in order of addition.
    fn add(token: &str, vocab: &mut serde_json::Map<String, Value>) {
        vocab.insert(token.to_string(), json!(vocab.len()));
    }
    let mut vocab = serde_json::Map::new();
    // GPT-2's stand-ins: printable bytes as themselves, the others from U+0100 in byte order.
    let mut next = 0x100;
    for b in 0..=255u8 {
        let c = if matches!(b, b'!'..=b'~' | 0xa1..=0xac | 0xae..=0xff) {
            char::from(b)
        } else {
            next += 1;
            char::from_u32(next - 1).unwrap()
        };
        add(&c.to_string(), &mut vocab);
    }
    let merges = [
        ("Ġ", "t"),
        ("h", "e"),
        ("Ġt", "he"),
        ("i", "n"),
        ("in", "g"),
        ("Ġ", "w"),
        ("o", "r"),
        ("Ġw", "or"),
        ("l", "d"),
        ("Ġwor", "ld"),
        ("'", "s"),
        ("Ċ", "Ċ"),
        ("Ġ", "Ġ"),
        ("t", "he"),
        ("th", "e"),
        ("t", "h"),
        ("1", "2"),
        ("Ã", "©"),
    ];
    for (l, r) in merges {
        let made = format!("{l}{r}");
        if !vocab.contains_key(&made) {
            add(&made, &mut vocab);
        }
    }
    // With ignore_merges, a word in the vocabulary is one token even without a merge path.
    add("Ġmodel", &mut vocab);
    let added =
        [("<|endoftext|>", true, false), ("<pad>", true, true), ("[NEW]", false, true), ("[NEW][NEWER]", false, false)];
    let mut added_tokens = Vec::new();
    for (content, special, normalized) in added {
        added_tokens.push(json!({"id": vocab.len(), "content": content, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": normalized, "special": special}));
        add(content, &mut vocab);
    }
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": true,
                          "use_regex": true},
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [256], "tokens": ["<|endoftext|>"]}}},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": ignore_merges, "vocab": vocab,
                  "merges": merges.iter().map(|(l, r)| format!("{l} {r}")).collect::<Vec<_>>()}
    })
}

#[test]
fn a_hand_written_tokenizer_with_add_prefix_space_gives_the_crates_ids() {
    let mut rng = Rng::new(11);
    for (add_prefix_space, ignore_merges) in [(true, false), (false, false), (true, true), (false, true)] {
        let json = serde_json::to_vec(&hand_written(add_prefix_space, ignore_merges)).unwrap();
        let (reference, ours) = both(&json);
        let extra = [
            "the world the thing",
            "model models the model",
            " the world",
            "x<|endoftext|>the<pad>world",
            "[NEW][NEWER][NEW]<pad>[NEW]x",
            "<|endoftext|> the",
            "<pad><pad>",
            "é 12 1212 'sing",
        ];
        // Pre-tokens over 64 bytes take the heap path, where "t"+"he" and "th"+"e" compete.
        let long = ["the".repeat(40), format!(" {}", "thet".repeat(30)), "modelthe".repeat(12)];
        for text in TEXTS.iter().chain(&extra).copied().chain(long.iter().map(String::as_str)) {
            assert_same(&reference, &ours, text);
        }
        for _ in 0..1000 {
            let text = random_text(&mut rng) + ["", "[NEW]", "<pad>", "[NEW][NEWER]", " model"][rng.below(5) as usize];
            assert_same(&reference, &ours, &text);
        }
    }
    // The prefix space really changes ids: the first word is merged as " the".
    let (_, with) = both(&serde_json::to_vec(&hand_written(true, false)).unwrap());
    let (_, without) = both(&serde_json::to_vec(&hand_written(false, false)).unwrap());
    assert_ne!(with.encode("the"), without.encode("the"));
}

#[test]
fn unsupported_tokenizers_are_left_to_the_crate() {
    let tmp = tempfile::tempdir().unwrap();
    let base = hand_written(false, false);
    // (field, its new value, a word of the reason given)
    let variants: Vec<(&str, Value, &str)> = vec![
        ("normalizer", json!({"type": "NFC"}), "NFC"),
        ("normalizer", json!({"type": "Lowercase"}), "Lowercase"),
        (
            "pre_tokenizer",
            json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}),
            "pre-tokenizer",
        ),
        (
            "pre_tokenizer",
            json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true}),
            "Metaspace",
        ),
        (
            "pre_tokenizer",
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}]}),
            "Sequence",
        ),
        ("pre_tokenizer", Value::Null, "pre-tokenizer is null"),
        (
            "truncation",
            json!({"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}),
            "truncation",
        ),
        (
            "post_processor",
            json!({"type": "TemplateProcessing",
                "single": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [], "special_tokens": {}}),
            "TemplateProcessing",
        ),
    ];
    let mut cases: Vec<(String, Value, &str)> = variants
        .into_iter()
        .map(|(field, value, reason)| {
            let mut v = base.clone();
            v[field] = value;
            (format!("{field} changed"), v, reason)
        })
        .collect();
    let mut dropout = base.clone();
    dropout["model"]["dropout"] = json!(0.1);
    cases.push(("dropout".into(), dropout, "dropout"));
    let mut suffix = base.clone();
    suffix["model"]["end_of_word_suffix"] = json!("</w>");
    cases.push(("end_of_word_suffix".into(), suffix, "end_of_word_suffix"));
    let mut lstrip = base.clone();
    lstrip["added_tokens"][1]["lstrip"] = json!(true);
    cases.push(("an lstrip added token".into(), lstrip, "lstrip"));
    let mut no_byte = base.clone();
    no_byte["model"]["vocab"].as_object_mut().unwrap().remove("Ā");
    cases.push(("a byte missing from the vocabulary".into(), no_byte, "lacks byte 0x00"));
    cases.push((
        "WordPiece".into(),
        json!({"version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
               "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                                 "use_regex": true},
               "post_processor": null, "decoder": null,
               "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
                         "max_input_chars_per_word": 100, "vocab": {"[UNK]": 0, "a": 1, "##b": 2}}}),
        "WordPiece",
    ));
    for (what, v, reason) in cases {
        let json = serde_json::to_vec(&v).unwrap();
        let reference = tokenizers::Tokenizer::from_bytes(&json).unwrap_or_else(|e| panic!("{what}: {e}"));
        let why = ByteLevelBpe::new(&json, &reference).expect_err(&what).to_string();
        assert!(why.contains(reason), "{what}: {why}");
        // TextTokenizer then encodes with the crate: the crate's ids, and says so.
        let path = tmp.path().join("t.json");
        fs::write(&path, &json).unwrap();
        let tok = TextTokenizer::from_file(&path).unwrap();
        if what == "truncation changed" {
            // Except truncation, which TextTokenizer drops: ours encodes the whole text.
            assert_eq!(tok.encoder(), "byte-level BPE (ava's encoder)");
            let (plain, _) = both(&serde_json::to_vec(&base).unwrap());
            assert_eq!(
                tok.encode_piece("the world, the thing ab").unwrap(),
                crate_ids(&plain, "the world, the thing ab")
            );
            continue;
        }
        assert!(tok.encoder().starts_with("tokenizers crate"), "{what}: {}", tok.encoder());
        let text = "the world, the thing ab";
        if what != "dropout" {
            // (Dropout merges at random: two encodings differ.)
            assert_eq!(tok.encode_piece(text).unwrap(), crate_ids(&reference, text), "{what}");
        }
    }
    // A supported one says it runs ours, and encodes a file as the crate does.
    let path = trained(tmp.path(), 350);
    let tok = TextTokenizer::from_file(&path).unwrap();
    assert_eq!(tok.encoder(), "byte-level BPE (ava's encoder)");
    let text = corpus(5, 2000);
    let reference = tokenizers::Tokenizer::from_file(&path).unwrap();
    assert_eq!(tok.encode(&text, Path::new("doc.txt")).unwrap(), crate_ids(&reference, &text));
}
