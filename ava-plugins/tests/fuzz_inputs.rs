//! Property tests ("fuzzing on stable") of the host's parsers of outside input: lock files
//! (TOML and YAML), policy files, the YAML bound that guards them and the engine's configs, and the
//! library files found in a search directory. Arbitrary bytes and mutations of real inputs
//! must give Ok or Err, never a panic or a hang. `PROPTEST_CASES` raises the case count.

use ava_kernels::testing::{mutate, proptest_cases};
use ava_plugins::discover::{Candidate, exports_root_symbol};
use ava_plugins::lock::{LockFile, Pin};
use ava_plugins::policy::MachinePolicy;
use ava_plugins::yaml_guard::{self, YamlLimits};
use proptest::prelude::*;
use proptest::test_runner::Config as PropConfig;

fn cases(default: u32) -> PropConfig {
    PropConfig { cases: proptest_cases(default), failure_persistence: None, ..PropConfig::default() }
}

/// Text that YAML and TOML parsers treat specially, spliced in by [`mutate`].
const TOKENS: &[&str] = &[
    "&a ",
    "*a",
    "<<: *a",
    ".nan",
    "-.inf",
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
    "null",
    "!!str ",
    "\"",
    "'",
    "#",
    ",",
    "=",
    "[[plugins]]\n",
    "---\n",
];

fn edits() -> impl Strategy<Value = Vec<(u8, usize, u8)>> {
    prop::collection::vec((any::<u8>(), any::<usize>(), any::<u8>()), 1..12)
}

/// A real lock file in both formats, as the seeds.
fn lock_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let dir = tempfile::tempdir().unwrap();
    let mut lock = LockFile::default();
    for (name, c) in [("lion", 'a'), ("adam-8bit", 'b')] {
        lock.upsert(Pin {
            name: name.into(),
            kind: "optimizer".into(),
            version: "0.1.0".into(),
            sha256: c.to_string().repeat(64),
            file: format!("libava_plugin_{name}.so"),
        });
    }
    ["ava-plugins.lock", "ava-plugins.yaml"]
        .into_iter()
        .map(|name| {
            let path = dir.path().join(name);
            lock.write(&path).unwrap();
            (name, std::fs::read(&path).unwrap())
        })
        .collect()
}

fn read_lock(name: &str, bytes: &[u8]) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(name);
    std::fs::write(&path, bytes).unwrap();
    if let Err(e) = LockFile::read(&path) {
        let _ = e.to_string();
    }
}

/// Loads `bytes` as the extra policy file (no machine file); the error as its text.
fn load_policy(bytes: &[u8]) -> Result<Option<MachinePolicy>, String> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("policy.yaml");
    std::fs::write(&path, bytes).unwrap();
    MachinePolicy::load_from(&dir.path().join("no-machine-policy.yaml"), Some(&path)).map_err(|e| e.to_string())
}

proptest! {
    #![proptest_config(cases(128))]

    #[test]
    fn policy_files_never_panic(edits in edits(), bytes in prop::collection::vec(any::<u8>(), 0..300)) {
        let seed = b"# the floor\npolicy: vetted\nlock_file: /etc/ava/ava-plugins.lock\nsearch_paths: [/opt/ava/plugins]\n\
                     trusted_keys: [\"ed25519:00\"]\n";
        for input in [mutate(seed, &edits, TOKENS), bytes] {
            let _ = load_policy(&input);
        }
    }

    /// A policy file of blank lines and comments sets no floor: it is refused, never read as
    /// "no policy".
    #[test]
    fn a_policy_file_without_keys_is_refused(lines in prop::collection::vec("[ \t]{0,3}(#[^\r\n]{0,40})?", 0..8)) {
        let text = lines.join("\n");
        let e = load_policy(text.as_bytes()).expect_err("a policy without keys was accepted");
        prop_assert!(e.contains("the plugin policy file is not usable: it sets nothing"), "{e}");
    }

    #[test]
    fn lock_files_never_panic(which in 0usize..2, edits in edits(), bytes in prop::collection::vec(any::<u8>(), 0..300)) {
        let seeds = lock_seeds();
        let (name, seed) = &seeds[which];
        read_lock(name, &mutate(seed, &edits, TOKENS));
        read_lock(name, &bytes);
    }

    #[test]
    fn the_yaml_bound_never_panics(text in any::<String>(), edits in edits()) {
        let seed = b"plugins:\n  optimizer: &o {name: lion, betas: [0.9, 0.98]}\n  other: *o\ntrain: {lr: 0.001}\n";
        let mutated = String::from_utf8_lossy(&mutate(seed, &edits, TOKENS)).into_owned();
        for t in [text, mutated] {
            if let Err(e) = yaml_guard::check(&t, &YamlLimits::DEFAULT) {
                let _ = e.to_string();
            }
        }
    }

    /// Whatever the guard lets through stays within its limit when yaml-rust2 expands it
    /// (checked with small limits, so the expansion itself is cheap).
    #[test]
    fn what_the_yaml_bound_admits_expands_within_it(edits in edits()) {
        let seed = b"a: &a [x, y, {k: &b z}]\nb: &c [*a, *a, *b]\nc: [*c, *c, *a]\n";
        let text = String::from_utf8_lossy(&mutate(seed, &edits, TOKENS)).into_owned();
        let limits = YamlLimits { nodes: 200, text_bytes: 4096, depth: 16 };
        if yaml_guard::check(&text, &limits).is_ok()
            && let Ok(docs) = yaml_rust2::YamlLoader::load_from_str(&text)
        {
            fn count(y: &yaml_rust2::Yaml) -> u64 {
                1 + match y {
                    yaml_rust2::Yaml::Array(a) => a.iter().map(count).sum(),
                    yaml_rust2::Yaml::Hash(h) => h.iter().map(|(k, v)| count(k) + count(v)).sum(),
                    _ => 0,
                }
            }
            let total: u64 = docs.iter().map(count).sum();
            prop_assert!(total <= 200 + docs.len() as u64, "{total} nodes from {text:?}");
        }
    }

    #[test]
    fn library_files_never_panic(edits in edits(), bytes in prop::collection::vec(any::<u8>(), 0..2048)) {
        // The head of a real ELF file (this test binary) as the seed.
        static HEAD: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
        let head = HEAD.get_or_init(|| {
            use std::io::Read;
            let mut head = Vec::new();
            let file = std::fs::File::open(std::env::current_exe().unwrap()).unwrap();
            file.take(8192).read_to_end(&mut head).unwrap();
            head
        });
        let dir = tempfile::tempdir().unwrap();
        for (i, input) in [mutate(head, &edits, TOKENS), bytes].into_iter().enumerate() {
            let _ = exports_root_symbol(&input);
            let path = dir.path().join(format!("lib{i}.so"));
            std::fs::write(&path, &input).unwrap();
            let c = Candidate::read(&path).unwrap();
            let _ = c.exports_plugin_header();
        }
    }
}
