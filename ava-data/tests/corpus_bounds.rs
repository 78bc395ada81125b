//! A prepared corpus as outside input: shard headers whose counts overflow a file size,
//! damaged document tables and ids, shard names that leave the corpus directory (absolute,
//! `..`, a symbolic link out), and manifest counts that do not add up. Each is refused with
//! the file and the field, before training reads a sequence, and without telling anything
//! about a file outside the corpus.

use std::fs;
use std::path::Path;

use ava_data::manifest::{self, Counts, Manifest, TokenizerId};
use ava_data::shard::{self, ShardBuilder};
use ava_data::{Dataset, ShardedDataset, Split, Verify};
use serde_json::Value;

/// Writes a one-shard corpus of byte ids (vocabulary 257, end of text 256) into `dir`:
/// train documents `train`, validation documents `val`.
fn corpus(dir: &Path, train: &[&[u32]], val: &[&[u32]]) -> Manifest {
    fs::create_dir_all(dir).unwrap();
    let mut b = ShardBuilder::new(2, 256);
    for d in train {
        b.push(Split::Train, d);
    }
    for d in val {
        b.push(Split::Validation, d);
    }
    let entry = b.finish(dir, &shard::file_name(0), 0).unwrap();
    let mut m = Manifest {
        format: manifest::FORMAT.into(),
        version: manifest::VERSION,
        complete: true,
        tokenizer: TokenizerId::Byte,
        vocab_size: 257,
        id_bytes: 2,
        eos_id: 256,
        bos_id: None,
        val_fraction: 0.2,
        shard_tokens: 4000,
        reading: "test".into(),
        inputs: vec![],
        documents: 0,
        text_bytes: 0,
        train: Counts::default(),
        validation: Counts::default(),
        shards: vec![],
    };
    m.push(entry, 0);
    m.save(dir).unwrap();
    m
}

fn small(dir: &Path) -> Manifest {
    corpus(dir, &[&[1, 2, 3, 4], &[5, 6, 7, 8]], &[&[9, 10]])
}

/// Edits `dir/manifest.json` as JSON.
fn edit_manifest(dir: &Path, edit: impl FnOnce(&mut Value)) {
    let path = dir.join(manifest::FILE);
    let mut v: Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
    edit(&mut v);
    fs::write(&path, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
}

/// Rewrites shard 0 with `edit` applied and its manifest checksum updated, as someone who
/// crafts a corpus would.
fn craft_shard(dir: &Path, edit: impl FnOnce(&mut Vec<u8>)) {
    let path = dir.join(shard::file_name(0));
    let mut bytes = fs::read(&path).unwrap();
    edit(&mut bytes);
    fs::write(&path, &bytes).unwrap();
    let sha = shard::sha256_file(&path).unwrap();
    edit_manifest(dir, |v| v["shards"][0]["sha256"] = Value::from(sha));
}

fn open_error(dir: &Path) -> String {
    ShardedDataset::open_with(dir, None, 4, 1, Verify::Checksums).unwrap_err().to_string()
}

#[test]
fn a_header_whose_token_count_overflows_the_size_check_is_refused_with_the_field() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("corpus");
    small(&dir);
    // 2^63 + 10 two-byte train ids: (2^63 + 13) × 2 wraps to 26 bytes, the real ids' size,
    // so unchecked arithmetic finds the file the size the header describes. Header and
    // manifest agree, and the checksum is the file's.
    let crafted = (1u64 << 63) + 10;
    craft_shard(&dir, |b| b[16..24].copy_from_slice(&crafted.to_le_bytes()));
    edit_manifest(&dir, |v| {
        v["shards"][0]["train"]["tokens"] = Value::from(crafted);
        v["train"]["tokens"] = Value::from(crafted);
    });
    let e = open_error(&dir);
    let shard = dir.join(shard::file_name(0));
    assert!(e.starts_with(&format!("shard {}: header field tokens × id bytes does not fit", shard.display())), "{e}");
    // `ava data verify` reads the same way.
    let m = Manifest::load(&dir).unwrap();
    let checks = ava_data::corpus::verify_all(&dir, &m, &|_| {});
    let problem = checks[0].problem.as_ref().expect("refused").to_string();
    assert!(problem.contains("header field tokens × id bytes"), "{problem}");
}

#[test]
fn a_damaged_document_table_or_an_id_past_the_vocabulary_is_refused_before_training() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("corpus");
    small(&dir);
    let ok = ShardedDataset::open(&dir, None, 4, 1).unwrap().with_document_packing(true);
    assert_eq!(ok.sequence(Split::Train, 0, 4).len(), 5);
    drop(ok);
    // Ids: 13 of 2 bytes → table at 96; train starts [0, 5], validation start [0].
    craft_shard(&dir, |b| b[104..112].copy_from_slice(&u64::MAX.to_le_bytes()));
    let e = open_error(&dir);
    assert!(e.contains("document table: train document 1 starts at 18446744073709551615"), "{e}");
    craft_shard(&dir, |b| b[104..112].copy_from_slice(&5u64.to_le_bytes()));
    ShardedDataset::open(&dir, None, 4, 1).unwrap();

    craft_shard(&dir, |b| b[66..68].copy_from_slice(&300u16.to_le_bytes()));
    let e = open_error(&dir);
    assert!(e.contains("its token id at index 1 is 300, not below the manifest's vocab_size 257"), "{e}");
}

#[test]
fn shard_names_that_leave_the_corpus_directory_are_refused_without_a_word_about_the_target() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("corpus");
    small(&dir);
    let secret = tmp.path().join("secret");
    fs::write(&secret, vec![7u8; 12345]).unwrap();
    let manifest = dir.join(manifest::FILE);
    let mut seen = Vec::new();
    for name in
        ["../secret", "/etc/passwd", secret.to_str().unwrap(), "sub/../../secret", "./shard-00000.bin", "a\0b", ""]
    {
        edit_manifest(&dir, |v| v["shards"][0]["file"] = Value::from(name));
        let e = open_error(&dir);
        assert!(e.starts_with(&format!("corpus manifest {}: shards[0].file is ", manifest.display())), "{e}");
        assert!(e.contains("a shard must be named by a plain file name inside the corpus directory"), "{e}");
        assert!(!e.contains("12345") && !e.contains("bytes"), "{e}");
        seen.push(e);
    }
    // The same text whether the file outside exists or not.
    edit_manifest(&dir, |v| v["shards"][0]["file"] = Value::from("../secret"));
    let with = open_error(&dir);
    fs::remove_file(&secret).unwrap();
    assert_eq!(open_error(&dir), with);
    assert_eq!(seen[0], with);

    // A symbolic link of this user's, to the shard moved out of the corpus (a cache): followed.
    edit_manifest(&dir, |v| v["shards"][0]["file"] = Value::from(shard::file_name(0)));
    let shard_path = dir.join(shard::file_name(0));
    let cached = tmp.path().join("cache-shard");
    fs::rename(&shard_path, &cached).unwrap();
    std::os::unix::fs::symlink(&cached, &shard_path).unwrap();
    ShardedDataset::open_with(&dir, None, 4, 1, Verify::Checksums).expect("the owner's own link is followed");

    // Another user's link in the corpus pointing out of it: refused, saying nothing of its target.
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: making a link of another user needs root");
        return;
    }
    fs::write(&secret, vec![7u8; 12345]).unwrap();
    fs::remove_file(&shard_path).unwrap();
    std::os::unix::fs::symlink(&secret, &shard_path).unwrap();
    std::os::unix::fs::lchown(&shard_path, Some(65534), Some(65534)).unwrap();
    let e = open_error(&dir);
    assert!(e.starts_with(&format!("shard {}: is a symbolic link of another user", shard_path.display())), "{e}");
    assert!(!e.contains("12345"), "{e}");
    fs::remove_file(&secret).unwrap();
    assert_eq!(open_error(&dir), e, "nothing said depends on the target");
}

#[test]
fn manifest_numbers_are_checked_against_what_they_describe() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("corpus");
    let m = small(&dir);
    let path = dir.join(manifest::FILE);
    let original = fs::read(&path).unwrap();
    type Edit = Box<dyn Fn(&mut Value)>;
    let cases: [(&str, Edit); 7] = [
        ("id_bytes is 3; it must be 2 or 4", Box::new(|v| v["id_bytes"] = 3.into())),
        (
            "vocab_size is 70000; with 2-byte ids it must be between 1 and 65536",
            Box::new(|v| v["vocab_size"] = 70000.into()),
        ),
        ("eos_id is 257; it must be below vocab_size (257)", Box::new(|v| v["eos_id"] = 257.into())),
        (
            "train says 11 tokens in 2 documents, but its shards hold 10 tokens",
            Box::new(|v| v["train"]["tokens"] = 11.into()),
        ),
        ("shards[0].train: 11 documents in 10 tokens", Box::new(|v| v["shards"][0]["train"]["documents"] = 11.into())),
        ("shards[0].sha256 is \"é\"", Box::new(|v| v["shards"][0]["sha256"] = "é".into())),
        (
            "train: the shards' counts add up to more than 2^64",
            Box::new(|v| {
                let mut second = v["shards"][0].clone();
                second["train"]["tokens"] = Value::from(u64::MAX);
                v["shards"].as_array_mut().unwrap().push(second);
            }),
        ),
    ];
    for (expected, edit) in cases {
        fs::write(&path, &original).unwrap();
        edit_manifest(&dir, edit);
        let e = Manifest::load(&dir).unwrap_err().to_string();
        assert!(e.starts_with(&format!("corpus manifest {}: {expected}", path.display())), "{e}");
        assert!(e.ends_with("the manifest is damaged: prepare the corpus again"), "{e}");
    }
    fs::write(&path, &original).unwrap();
    assert_eq!(Manifest::load(&dir).unwrap(), m);
}

#[test]
fn a_start_batch_past_the_last_sequence_index_is_refused_not_a_hung_loader() {
    use std::sync::{Arc, mpsc};
    // Run in a thread with a guard: before the check, workers died on the overflowing window
    // and `next` waited for ever.
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let dataset: Arc<dyn Dataset> =
            Arc::new(ava_data::SyntheticDataset::new(&ava_data::MarkovSpec::default(), 1).unwrap());
        let result = ava_data::Loader::new(dataset, Split::Train, 1, 8, u64::MAX - 2, 2, 2)
            .and_then(|mut loader| loader.next().map(|_| ()));
        let _ = tx.send(result.map_err(|e| e.to_string()));
    });
    let got = rx.recv_timeout(std::time::Duration::from_secs(120)).expect("the loader answers instead of hanging");
    let e = got.unwrap_err();
    assert!(e.starts_with("the loader's start batch = 18446744073709551613:"), "{e}");
    assert!(e.contains("past the last batch"), "{e}");
    // The last start whose window fits is accepted.
    let dataset: Arc<dyn Dataset> =
        Arc::new(ava_data::SyntheticDataset::new(&ava_data::MarkovSpec::default(), 1).unwrap());
    let last = u64::MAX / 4 - 7;
    let mut loader = ava_data::Loader::new(dataset, Split::Train, 4, 8, last, 2, 2).unwrap();
    assert_eq!(loader.next().unwrap().index, last);
}

#[test]
fn a_fifo_given_as_the_tokenizer_is_refused_not_waited_on() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("corpus");
    small(&dir);
    let fifo = tmp.path().join("tokenizer.json");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let e = ShardedDataset::open(&dir, Some(&fifo), 4, 1).unwrap_err().to_string();
    assert!(e.contains("is a FIFO (named pipe), not a regular file"), "{e}");
}
