//! Property tests ("fuzzing on stable") of loading a tokenizer.json: mutations of real ones
//! (byte edits, repeated chunks, JSON tokens spliced in, values replaced by big numbers, long
//! strings, deep arrays and long sequences) and arbitrary bytes are loaded and, when they
//! load, encode and decode a short text. Each must answer Ok or Err — never panic — within
//! bounded memory: this binary counts its allocations and the peak must stay under
//! [`PEAK_LIMIT`].
//!
//! The case counts are small so that `cargo test` stays quick; `PROPTEST_CASES=3000`
//! searches harder.

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use ava_data::TextTokenizer;
use ava_kernels::testing::{Edit, mutate, proptest_cases};
use proptest::prelude::*;
use proptest::test_runner::Config as PropConfig;
use serde_json::{Value, json};

/// The system allocator, counting the bytes in use and their peak.
struct Counting;

static CURRENT: AtomicU64 = AtomicU64::new(0);
static PEAK: AtomicU64 = AtomicU64::new(0);

// SAFETY: every method forwards to `System` with the same arguments and only adds counting.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        CURRENT.fetch_sub(layout.size() as u64, Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            CURRENT.fetch_sub(layout.size() as u64, Relaxed);
            grew(new_size);
        }
        p
    }
}

fn grew(bytes: usize) {
    let now = CURRENT.fetch_add(bytes as u64, Relaxed) + bytes as u64;
    PEAK.fetch_max(now, Relaxed);
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// The most the whole test binary may ever hold: every input is a few kilobytes (a few
/// hundred with the repeated chunks), so anything near this is work a file asked for.
const PEAK_LIMIT: u64 = 1 << 30;

fn cases(default: u32) -> PropConfig {
    PropConfig { cases: proptest_cases(default), failure_persistence: None, ..PropConfig::default() }
}

fn bounded_memory() {
    let peak = PEAK.load(Relaxed);
    assert!(peak < PEAK_LIMIT, "the test binary's allocations peaked at {peak} bytes");
}

/// The real tokenizers: the repository's, and the byte tokenizer Ava writes.
fn seeds() -> Vec<Vec<u8>> {
    let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("../ava-cli/tests/generate/tiny-llama/tokenizer.json");
    vec![std::fs::read(tiny).unwrap(), ava_data::byte_tokenizer_json(Some(256)).into_bytes()]
}

/// Text that JSON and tokenizer.json treat specially, spliced in by [`mutate`].
const TOKENS: &[&str] = &[
    "[",
    "]",
    "{",
    "}",
    ",",
    ":",
    "\"",
    "null",
    "0",
    "-1",
    "4294967295",
    "18446744073709551615",
    "1e999",
    "\"Sequence\"",
    "\"Replace\"",
    "\"Prepend\"",
    "\"TemplateProcessing\"",
    "\"ByteLevel\"",
    "\"Metaspace\"",
    "\"WordPiece\"",
    "\"Unigram\"",
    "\"type\": ",
    "\"content\": ",
    "\"normalizers\": ",
    "\"stride\": ",
    "\\u0000",
    "\u{feff}",
];

/// Loads `bytes` as a tokenizer.json and, when it loads, encodes and decodes a short text.
fn load_and_use(bytes: &[u8]) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer.json");
    std::fs::write(&path, bytes).unwrap();
    if let Ok(tok) = TextTokenizer::from_file(&path) {
        let _ = tok.vocab_size();
        if let Ok(ids) = tok.encode_piece("The model <|endoftext|> is trained.\n  It's 42 °C — 東京.") {
            let _ = tok.decode(&ids);
        }
        let _ = tok.decode(&[0, 1, 2, 300, 319, 4_000_000]);
    }
    bounded_memory();
}

/// A JSON value that makes big work if a count, size or growth is taken on trust.
fn big_value() -> impl Strategy<Value = Value> {
    let step = prop_oneof![
        Just(json!({"type": "Replace", "pattern": {"String": "e"}, "content": "eeee"})),
        Just(json!({"type": "Replace", "pattern": {"Regex": "x*"}, "content": "yy"})),
        Just(json!({"type": "Prepend", "prepend": "▁▁▁▁"})),
        Just(json!({"type": "ByteLevel"})),
        Just(json!({"type": "NFKC"})),
        Just(json!({"Sequence": {"id": "A", "type_id": 0}})),
    ];
    prop_oneof![
        any::<u64>().prop_map(Value::from),
        (0u32..40).prop_map(|e| Value::from(1u64 << e)),
        (1usize..200_000).prop_map(|n| Value::from("e".repeat(n))),
        (1usize..100).prop_map(|depth| (0..depth).fold(json!(1), |v, _| json!([v]))),
        (step, 1usize..300).prop_map(|(s, n)| Value::Array(vec![s; n])),
        (1usize..300).prop_map(|n| json!({"type": "Sequence", "normalizers":
            vec![json!({"type": "Replace", "pattern": {"String": "e"}, "content": "ee"}); n]})),
        (any::<u32>(), any::<u32>()).prop_map(|(max_length, stride)| json!({"direction": "Right",
            "max_length": max_length % 8, "strategy": "LongestFirst", "stride": stride % 8})),
        (any::<u64>(), any::<u64>()).prop_map(|(n, multiple)| json!({"strategy": {"Fixed": n},
            "direction": "Right", "pad_to_multiple_of": multiple, "pad_id": 0, "pad_type_id": 0, "pad_token": "!"})),
    ]
}

/// Every value's place in `v` (objects' values and arrays' items), depth first.
fn places(v: &Value, at: &mut Vec<String>, out: &mut Vec<String>) {
    let children: Vec<(String, &Value)> = match v {
        Value::Object(m) => m.iter().map(|(k, c)| (k.replace('~', "~0").replace('/', "~1"), c)).collect(),
        Value::Array(a) => a.iter().take(8).enumerate().map(|(i, c)| (i.to_string(), c)).collect(),
        _ => return,
    };
    for (key, child) in children {
        at.push(key);
        out.push(format!("/{}", at.join("/")));
        places(child, at, out);
        at.pop();
    }
}

/// `seed` (JSON) with the values at places picked by `picks` replaced.
fn replaced(seed: &[u8], picks: Vec<(usize, Value)>) -> Vec<u8> {
    let mut json: Value = serde_json::from_slice(seed).unwrap();
    for (pick, value) in picks {
        let mut all = Vec::new();
        places(&json, &mut Vec::new(), &mut all);
        if let Some(slot) = json.pointer_mut(&all[pick % all.len()]) {
            *slot = value;
        }
    }
    serde_json::to_vec(&json).unwrap()
}

proptest! {
    #![proptest_config(cases(64))]

    #[test]
    fn mutated_tokenizers_load_or_are_refused(
        seed in 0usize..2,
        edits in prop::collection::vec((any::<u8>(), any::<usize>(), any::<u8>()), 1..12),
    ) {
        let edits: Vec<Edit> = edits;
        load_and_use(&mutate(&seeds()[seed], &edits, TOKENS));
    }

    #[test]
    fn values_replaced_by_big_ones_load_or_are_refused(
        seed in 0usize..2,
        picks in prop::collection::vec((any::<usize>(), big_value()), 1..4),
    ) {
        load_and_use(&replaced(&seeds()[seed], picks));
    }

    #[test]
    fn arbitrary_bytes_load_or_are_refused(bytes in prop::collection::vec(any::<u8>(), 0..2048)) {
        load_and_use(&bytes);
    }
}
