//! Property tests ("fuzzing on stable") of every parser of outside input in the engine:
//! config files (YAML, TOML), `--set` and `AVA__*` values, a model's config.json, safetensors
//! files, checkpoint manifests and whole checkpoints. Each gets arbitrary bytes and mutations
//! of real inputs (the repository's configs and model folders) and must answer Ok or Err —
//! never panic — within bounded memory: the counting allocator is installed, and the whole
//! binary's peak must stay under [`PEAK_LIMIT`].
//!
//! The case counts are small so that `cargo test` stays quick; `PROPTEST_CASES=100000`
//! searches harder. Every crash found became a named unit test next to the code it hit
//! (see the issue 20 notes in `docs/architecture/0003-outside-input.md`).

use std::path::{Path, PathBuf};

use ava_kernels::testing::{Edit, mutate, proptest_cases};
use ava_train::config::ConfigLoader;
use ava_train::model::parse_hf_config;
use ava_train::save::{CheckpointStore, Manifest, from_safetensors};
use proptest::prelude::*;
use proptest::test_runner::Config as PropConfig;

#[global_allocator]
static ALLOC: ava_train::memory::CountingAlloc = ava_train::memory::CountingAlloc;

/// The most the whole test binary may ever hold: every input here is a few kilobytes, so
/// anything near this is an allocation sized by a parsed number.
const PEAK_LIMIT: u64 = 1 << 30;

fn cases(default: u32) -> PropConfig {
    PropConfig { cases: proptest_cases(default), failure_persistence: None, ..PropConfig::default() }
}

fn bounded_memory() {
    let peak = ava_train::memory::peak();
    assert!(peak < PEAK_LIMIT, "the test binary's allocations peaked at {peak} bytes");
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Text that YAML, TOML and JSON parsers treat specially, spliced in by [`mutate`].
const TOKENS: &[&str] = &[
    "&a ",
    "*a",
    "<<: *a",
    ".nan",
    "-.inf",
    ".inf",
    "1e999",
    "[",
    "]",
    "{",
    "}",
    ": ",
    "\n",
    "\n  ",
    "- ",
    "0",
    "-1",
    "18446744073709551615",
    "99999999999999999999",
    "4294967296",
    "null",
    "!!float ",
    "\"",
    "'",
    "#",
    ",",
    "=",
    "\t",
    "\u{feff}",
    "\\u0000",
    "---\n",
];

/// A few edits for [`mutate`].
fn edits() -> impl Strategy<Value = Vec<Edit>> {
    prop::collection::vec((any::<u8>(), any::<usize>(), any::<u8>()), 1..12)
}

fn seeds(dir: &str, ext: &str) -> Vec<Vec<u8>> {
    let mut out: Vec<Vec<u8>> = std::fs::read_dir(root().join(dir))
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == ext))
        .map(|p| std::fs::read(p).unwrap())
        .collect();
    out.sort();
    out
}

fn hf_configs() -> Vec<Vec<u8>> {
    let mut out: Vec<Vec<u8>> = std::fs::read_dir(root().join("ava-train/tests/hf"))
        .unwrap()
        .filter_map(|e| std::fs::read(e.ok()?.path().join("config.json")).ok())
        .collect();
    out.sort();
    out
}

fn load_config_file(name: &str, bytes: &[u8]) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(name);
    std::fs::write(&path, bytes).unwrap();
    // Ok or Err; the error must render.
    if let Err(e) = ConfigLoader::new().file(&path).load() {
        let _ = e.to_string();
    }
    bounded_memory();
}

proptest! {
    #![proptest_config(cases(64))]

    #[test]
    fn yaml_config_files_never_panic(seed in 0usize..64, edits in edits()) {
        let seeds = seeds("configs", "yaml");
        load_config_file("c.yaml", &mutate(&seeds[seed % seeds.len()], &edits, TOKENS));
    }

    #[test]
    fn toml_config_files_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256), edits in edits()) {
        let seed = b"[train]\nlr = 0.001\nsteps = 10\n[plugins]\noptimizer = { name = \"lion\", betas = [0.9, 0.98] }\n";
        load_config_file("c.toml", &mutate(seed, &edits, TOKENS));
        load_config_file("c.toml", &bytes);
    }

    #[test]
    fn arbitrary_bytes_as_a_config_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        load_config_file("c.yaml", &bytes);
    }

    #[test]
    fn set_and_env_values_never_panic(key in "[a-z_.]{0,24}", value in any::<String>(), edits in edits()) {
        let mutated = String::from_utf8_lossy(&mutate(value.as_bytes(), &edits, TOKENS)).into_owned();
        for v in [&value, &mutated] {
            let r = ConfigLoader::new().set(format!("{key}={v}")).load();
            if let Err(e) = r { let _ = e.to_string(); }
            let var = format!("AVA__{}", key.replace('.', "__").to_uppercase());
            let r = ConfigLoader::new().env([(var, v.clone())]).load();
            if let Err(e) = r { let _ = e.to_string(); }
            let _ = ava_train::config::parse_value(v);
        }
        bounded_memory();
    }

    #[test]
    fn hf_config_json_never_panics(seed in 0usize..16, edits in edits()) {
        let seeds = hf_configs();
        let bytes = mutate(&seeds[seed % seeds.len()], &edits, TOKENS);
        if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&bytes) {
            match parse_hf_config(&v, Path::new("config.json")) {
                Ok(c) => { let _ = c.spec.params(); }
                Err(e) => { let _ = e.to_string(); }
            }
        }
        bounded_memory();
    }

    /// The numbers a config.json sizes a model by, each set to any integer.
    #[test]
    fn hf_config_sizes_are_checked_before_use(seed in 0usize..16, picks in prop::collection::vec((0usize..11, any::<u64>(), 0u8..4), 1..6)) {
        const KEYS: [&str; 11] = [
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "head_dim", "num_local_experts", "num_experts_per_tok", "max_position_embeddings",
            "sliding_window",
        ];
        let seeds = hf_configs();
        let mut v: serde_json::Value = serde_json::from_slice(&seeds[seed % seeds.len()]).unwrap();
        for (k, n, how) in picks {
            let n = match how { 0 => n, 1 => n % 4, 2 => n % 70_000, _ => 1 << (n % 64) };
            v[KEYS[k]] = serde_json::json!(n);
        }
        match parse_hf_config(&v, Path::new("config.json")) {
            // Accepted: the parameter list can be built without a huge allocation.
            Ok(c) => { let _ = c.spec.params(); }
            Err(e) => { let _ = e.to_string(); }
        }
        bounded_memory();
    }

    #[test]
    fn safetensors_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256), edits in edits()) {
        let seed = std::fs::read(root().join("ava-train/tests/hf/llama3-v4/model.safetensors")).unwrap();
        // Mostly the header: the first 512 bytes and a tail.
        let head = &seed[..seed.len().min(600)];
        for input in [mutate(head, &edits, TOKENS), mutate(&seed, &edits, TOKENS), bytes] {
            if let Err(e) = from_safetensors(&input) { let _ = e.to_string(); }
        }
        bounded_memory();
    }

    #[test]
    fn manifests_and_checkpoints_never_panic(edits in edits(), bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let root_dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(root_dir.path(), 2);
        let dir = store.save(3, &[("a.bin".into(), vec![1, 2, 3]), ("trainer.json".into(), b"{\"step\":3}".to_vec())]).unwrap();
        let manifest = std::fs::read(dir.join("manifest.json")).unwrap();
        for input in [mutate(&manifest, &edits, TOKENS), bytes.clone()] {
            std::fs::write(dir.join("manifest.json"), &input).unwrap();
            if let Err(e) = Manifest::read(&dir) { let _ = e.to_string(); }
            if let Err(e) = CheckpointStore::load(&dir) { let _ = e.to_string(); }
            if let Err(e) = ava_train::save::verify(&dir) { let _ = e.to_string(); }
            if let Err(e) = store.resolve("latest") { let _ = e.to_string(); }
        }
        std::fs::write(root_dir.path().join("latest"), &bytes).unwrap();
        if let Err(e) = store.resolve("latest") { let _ = e.to_string(); }
        bounded_memory();
    }
}
