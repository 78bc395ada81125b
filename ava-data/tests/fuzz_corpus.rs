//! Fuzzing the prepared-corpus readers on stable (`cargo fuzz` is not installable here):
//! property tests that mutate a real corpus made by `ava data prepare`'s own code — byte
//! edits of a shard (its header above all), header fields set to extreme values with the
//! manifest made to agree and the checksum recomputed (so the reader's deeper checks are
//! reached, not only the checksum), manifest values replaced by huge, negative or
//! fractional numbers, and shard names replaced by `../x`, `/etc/passwd` and the like —
//! then load the manifest, verify the corpus, open it and read batches. Each case must end
//! in Ok or an error, never a panic. `PROPTEST_CASES` raises the count (256 by default).

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use ava_data::manifest::{self, Manifest};
use ava_data::prepare::{self, Invalid, PrepareOptions, Reading, Silent};
use ava_data::{Dataset, Loader, ShardedDataset, Split, Verify};
use proptest::prelude::*;
use serde_json::Value;

/// A corpus of a few shards, prepared once per test process.
fn original() -> &'static Path {
    static CORPUS: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    let (_, out) = CORPUS.get_or_init(|| {
        let tmp = tempfile::tempdir().unwrap();
        let input = tmp.path().join("in");
        fs::create_dir_all(&input).unwrap();
        for i in 0..24 {
            let words = 10 + (i * 37) % 120;
            let text: Vec<String> = (0..words).map(|w| format!("w{}", (i * 131 + w * 17) % 97)).collect();
            fs::write(input.join(format!("doc-{i:03}.txt")), text.join(" ")).unwrap();
        }
        let out = tmp.path().join("corpus");
        let options = PrepareOptions {
            inputs: vec![input],
            out: out.clone(),
            tokenizer: None,
            eos: None,
            bos: None,
            reading: Reading { separator: None, field: "text".into(), invalid: Invalid::Error },
            val_fraction: 0.25,
            shard_tokens: 2000,
            force: false,
        };
        prepare::prepare(&options, &mut Silent).unwrap();
        (tmp, out)
    });
    out
}

/// A fresh copy of the corpus.
fn copy() -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for entry in fs::read_dir(original()).unwrap() {
        let entry = entry.unwrap();
        fs::copy(entry.path(), tmp.path().join(entry.file_name())).unwrap();
    }
    tmp
}

fn read_manifest(dir: &Path) -> Value {
    serde_json::from_slice(&fs::read(dir.join(manifest::FILE)).unwrap()).unwrap()
}

fn write_manifest(dir: &Path, v: &Value) {
    fs::write(dir.join(manifest::FILE), serde_json::to_vec_pretty(v).unwrap()).unwrap();
}

/// Recomputes the manifest's checksum of shard `i` from the file.
fn rehash(dir: &Path, v: &mut Value, i: usize) {
    let file = v["shards"][i]["file"].as_str().unwrap().to_string();
    if file.starts_with("shard-")
        && !file.contains('/')
        && let Ok(sha) = ava_data::shard::sha256_file(&dir.join(file))
    {
        v["shards"][i]["sha256"] = Value::from(sha);
    }
}

/// The manifest's totals recomputed from its shards (where they add up).
fn retotal(v: &mut Value) {
    let shards = v["shards"].as_array().unwrap().clone();
    for key in ["train", "validation"] {
        for field in ["tokens", "documents"] {
            let sum = shards.iter().try_fold(0u64, |acc, s| s[key][field].as_u64().and_then(|x| acc.checked_add(x)));
            if let Some(sum) = sum {
                v[key][field] = Value::from(sum);
            }
        }
    }
    if let (Some(t), Some(d)) = (v["train"]["documents"].as_u64(), v["validation"]["documents"].as_u64())
        && let Some(sum) = t.checked_add(d)
    {
        v["documents"] = Value::from(sum);
    }
}

/// Values that break arithmetic.
fn extreme() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(1),
        Just(u64::MAX),
        Just(u64::MAX - 1),
        Just(1 << 63),
        Just((1 << 63) + 10),
        Just(u64::MAX / 2),
        Just(u64::MAX / 4 + 1),
        Just(1 << 32),
        any::<u64>(),
        0u64..5000,
    ]
}

/// A JSON value replacing a manifest number.
fn json_number() -> impl Strategy<Value = Value> {
    prop_oneof![
        extreme().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        Just(Value::from(-1)),
        Just(serde_json::json!(1e300)),
        Just(serde_json::json!(0.5)),
        Just(Value::from("7")),
        Just(Value::Null),
    ]
}

#[derive(Debug, Clone)]
enum Mutation {
    /// Byte `(at % len)` of shard `s` set to `b` (`header`: within the 64-byte header).
    Byte { s: usize, at: usize, b: u8, header: bool, rehash: bool },
    /// Header field `f` (id bytes, then the four counts) of shard `s` set to `value`, with
    /// the manifest made to agree and the checksum recomputed.
    Field { s: usize, f: usize, value: u64 },
    /// A manifest number replaced.
    Number { key: usize, s: usize, value: Value },
    /// A shard's name replaced.
    Name { s: usize, name: usize },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), any::<usize>(), any::<u8>(), any::<bool>(), any::<bool>())
            .prop_map(|(s, at, b, header, rehash)| Mutation::Byte { s, at, b, header, rehash }),
        (any::<usize>(), 0usize..5, extreme()).prop_map(|(s, f, value)| Mutation::Field { s, f, value }),
        (0usize..13, any::<usize>(), json_number()).prop_map(|(key, s, value)| Mutation::Number { key, s, value }),
        (any::<usize>(), 0usize..8).prop_map(|(s, name)| Mutation::Name { s, name }),
    ]
}

const NAMES: [&str; 8] =
    ["../x", "/etc/passwd", "", "..", "a/../shard-00000.bin", "./shard-00000.bin", "x\0y", "sub/x"];

/// The bytes of shard `i`, while its manifest entry still names one of the corpus's own
/// files (an earlier mutation may have renamed it to `/etc/passwd`: never written to).
fn shard_bytes(dir: &Path, v: &Value, i: usize) -> Option<Vec<u8>> {
    let name = v["shards"][i]["file"].as_str()?;
    let own = name.starts_with("shard-") && name.ends_with(".bin") && !name.contains(['/', '\0']);
    let bytes = if own { fs::read(dir.join(name)).ok()? } else { return None };
    (!bytes.is_empty()).then_some(bytes)
}

fn apply(dir: &Path, v: &mut Value, m: &Mutation) {
    let shards = v["shards"].as_array().unwrap().len();
    match m {
        Mutation::Byte { s, at, b, header, rehash: again } => {
            let i = s % shards;
            let Some(mut bytes) = shard_bytes(dir, v, i) else { return };
            let path = dir.join(v["shards"][i]["file"].as_str().unwrap());
            let at = if *header { at % 64 } else { at % bytes.len() };
            bytes[at] = *b;
            fs::write(&path, bytes).unwrap();
            if *again {
                rehash(dir, v, i);
            }
        }
        Mutation::Field { s, f, value } => {
            let i = s % shards;
            let Some(mut bytes) = shard_bytes(dir, v, i) else { return };
            let path = dir.join(v["shards"][i]["file"].as_str().unwrap());
            if *f == 0 {
                bytes[12..16].copy_from_slice(&(*value as u32).to_le_bytes());
                v["id_bytes"] = Value::from(*value as u32);
            } else {
                let at = 16 + 8 * (f - 1);
                bytes[at..at + 8].copy_from_slice(&value.to_le_bytes());
                let (split, field) = [
                    ("train", "tokens"),
                    ("validation", "tokens"),
                    ("train", "documents"),
                    ("validation", "documents"),
                ][f - 1];
                v["shards"][i][split][field] = Value::from(*value);
                retotal(v);
            }
            fs::write(&path, bytes).unwrap();
            rehash(dir, v, i);
        }
        Mutation::Number { key, s, value } => {
            let i = s % shards;
            let slot = match key {
                0 => &mut v["vocab_size"],
                1 => &mut v["id_bytes"],
                2 => &mut v["eos_id"],
                3 => &mut v["train"]["tokens"],
                4 => &mut v["documents"],
                5 => &mut v["validation"]["documents"],
                6 => &mut v["shards"][i]["bytes"],
                7 => &mut v["shards"][i]["train"]["tokens"],
                8 => &mut v["shards"][i]["train"]["documents"],
                9 => &mut v["shards"][i]["validation"]["tokens"],
                10 => &mut v["shards"][i]["first_document"],
                11 => &mut v["version"],
                _ => &mut v["bos_id"],
            };
            *slot = value.clone();
        }
        Mutation::Name { s, name } => {
            let i = s % shards;
            v["shards"][i]["file"] = Value::from(NAMES[*name]);
        }
    }
}

/// Everything a run does with a corpus: load, verify, open, read sequences and batches.
fn exercise(dir: &Path, seq_len: usize, indices: &[u64]) {
    let Ok(m) = Manifest::load(dir) else { return };
    let _ = ava_data::corpus::verify_all(dir, &m, &|_| {});
    let _ = ShardedDataset::open_with(dir, None, seq_len, 3, Verify::Sizes);
    let Ok(ds) = ShardedDataset::open(dir, None, seq_len, 3) else { return };
    let ds = Arc::new(ds.with_document_packing(true));
    let _ = ds.describe();
    for &i in indices {
        assert_eq!(ds.sequence(Split::Train, i, seq_len).len(), seq_len + 1);
        let _ = ds.document_starts(Split::Train, i, seq_len);
        if ds.missing_validation().is_none() {
            let _ = ds.sequence(Split::Validation, i, seq_len);
            let _ = ds.document_starts(Split::Validation, i, seq_len);
        }
    }
    if let Ok(mut loader) = Loader::new(ds.clone(), Split::Train, 2, seq_len, indices[0], 0, 1) {
        loader.next().expect("a batch of an opened corpus");
    }
}

fn cases() -> ProptestConfig {
    // proptest reads $PROPTEST_CASES into its default (256).
    ProptestConfig { failure_persistence: None, ..ProptestConfig::default() }
}

proptest! {
    #![proptest_config(cases())]

    /// Any mutations of a real corpus: Ok or an error, never a panic.
    #[test]
    fn a_mutated_corpus_is_read_or_refused_without_panic(
        mutations in prop::collection::vec(mutation(), 1..4),
        seq_len in 1usize..80,
        indices in prop::collection::vec(prop_oneof![0u64..10_000, any::<u64>()], 1..4),
    ) {
        let tmp = copy();
        let mut v = read_manifest(tmp.path());
        for m in &mutations {
            apply(tmp.path(), &mut v, m);
        }
        write_manifest(tmp.path(), &v);
        exercise(tmp.path(), seq_len, &indices);
    }
}

#[test]
fn the_unmutated_corpus_reads() {
    let tmp = copy();
    Manifest::load(tmp.path()).unwrap();
    let ds = ShardedDataset::open(tmp.path(), None, 16, 3).unwrap();
    assert!(ds.sequences_per_epoch(Split::Train, 16) > 10);
    exercise(tmp.path(), 16, &[0, 5, u64::MAX / 1000]);
}
