//! Save, load, list, latest, resolve, corruption detection and pruning.

use std::fs;

use super::{files, leftovers};
use crate::save::{CheckpointStore, FileBody, FileData, MANIFEST_FILE, Manifest, SaveError, verify};

/// A streamed file is written as it is produced and gets the same manifest entry as its
/// bytes would; a large one is mapped on load (and reads back the same), a corrupted one is
/// still caught; an error of the producer fails the save and leaves no directory behind.
#[test]
fn streamed_files_save_and_large_files_load_mapped() {
    let root = tempfile::tempdir().unwrap();
    let store = CheckpointStore::new(root.path().join("ckpt"), 3);
    let big: Vec<u8> = (0..FileData::MAP_FROM as usize + 4096).map(|i| (i * 31 % 251) as u8).collect();
    let chunks = big.chunks(1 << 20).map(<[u8]>::to_vec).collect::<Vec<_>>();
    let mut files = vec![
        ("small.json".to_string(), FileBody::Bytes(b"{}")),
        (
            "big.bin".to_string(),
            FileBody::Stream(Box::new(|out| {
                for c in &chunks {
                    out.write_all(c).map_err(|e| SaveError::Io {
                        action: "write".into(),
                        path: "big".into(),
                        source: e,
                    })?;
                }
                Ok(())
            })),
        ),
    ];
    let dir = store.save_files(7, &mut files).unwrap();
    let manifest = verify(&dir).unwrap();
    assert_eq!(manifest, Manifest::new(7, &[("big.bin".into(), big.clone()), ("small.json".into(), b"{}".to_vec())]));
    let loaded = CheckpointStore::load(&dir).unwrap();
    assert!(matches!(loaded.files["big.bin"], FileData::Mapped(_)));
    assert!(matches!(loaded.files["small.json"], FileData::Read(_)));
    assert_eq!(loaded.file("big.bin").unwrap(), big.as_slice());
    drop(loaded);

    let mut bytes = fs::read(dir.join("big.bin")).unwrap();
    bytes[FileData::MAP_FROM as usize] ^= 1;
    fs::write(dir.join("big.bin"), bytes).unwrap();
    let err = CheckpointStore::load(&dir).unwrap_err();
    assert!(err.to_string().contains("big.bin"), "{err}");

    let mut failing = vec![(
        "big.bin".to_string(),
        FileBody::Stream(Box::new(|_| {
            Err(SaveError::BadBuffer { name: "x".into(), reason: "the tier failed".into() })
        })),
    )];
    let err = store.save_files(8, &mut failing).unwrap_err();
    assert!(err.to_string().contains("the tier failed"), "{err}");
    assert!(!root.path().join("ckpt/step-00000008").exists());
    assert!(leftovers(store.root()).is_empty());
}

#[test]
fn save_then_load_gives_back_every_file_and_the_step() {
    let root = tempfile::tempdir().unwrap();
    let store = CheckpointStore::new(root.path().join("ckpt"), 3);
    let dir = store.save(42, &files(42)).unwrap();
    assert_eq!(dir, root.path().join("ckpt/step-00000042"));

    let loaded = CheckpointStore::load(&dir).unwrap();
    assert_eq!((loaded.step, loaded.dir.clone()), (42, dir.clone()));
    assert_eq!(contents(&loaded), files(42).into_iter().collect());
    assert_eq!(loaded.file("trainer.json").unwrap(), b"{\"step\":42}");
    let err = loaded.file("rng.bin").unwrap_err();
    assert!(err.to_string().contains("no file 'rng.bin' (it has: empty.bin, model.safetensors"), "{err}");

    let manifest = verify(&dir).unwrap();
    assert_eq!(manifest, Manifest::new(42, &files(42)));
    let text = fs::read_to_string(dir.join(MANIFEST_FILE)).unwrap();
    assert!(text.contains("\"format\": 1") && text.contains("\"step\": 42") && text.contains("\"sha256\""), "{text}");
    assert_eq!(fs::read_to_string(root.path().join("ckpt/latest")).unwrap(), "step-00000042\n");
    assert!(leftovers(store.root()).is_empty());
}

#[test]
fn list_latest_and_resolve() {
    let root = tempfile::tempdir().unwrap();
    let store = CheckpointStore::new(root.path(), 0);
    assert_eq!(store.list().unwrap(), vec![]);
    assert_eq!(store.latest().unwrap(), None);
    let err = store.resolve("latest").unwrap_err();
    assert_eq!(
        err.to_string(),
        format!("no checkpoint found in {}; train first, or pass --resume PATH", root.path().display())
    );
    let missing_root = CheckpointStore::new(root.path().join("nope"), 0);
    assert!(missing_root.resolve("latest").unwrap_err().to_string().contains("(the directory does not exist)"));

    for step in [10, 2, 300] {
        store.save(step, &files(step)).unwrap();
    }
    // An incomplete directory and unrelated entries are not checkpoints.
    fs::create_dir(root.path().join("step-00000999")).unwrap();
    fs::create_dir(root.path().join("notes")).unwrap();
    let steps: Vec<u64> = store.list().unwrap().into_iter().map(|(s, _)| s).collect();
    assert_eq!(steps, [2, 10, 300]);
    // `latest` is the last saved, not the highest step.
    store.save(5, &files(5)).unwrap();
    let five = root.path().join("step-00000005");
    assert_eq!(store.latest().unwrap(), Some(five.clone()));
    assert_eq!(store.resolve("latest").unwrap(), five);

    // A checkpoint directory, or a store root (which means its latest).
    let ten = root.path().join("step-00000010");
    assert_eq!(store.resolve(ten.to_str().unwrap()).unwrap(), ten);
    assert_eq!(store.resolve(root.path().to_str().unwrap()).unwrap(), five);

    let err = store.resolve(root.path().join("step-00000999").to_str().unwrap()).unwrap_err();
    assert!(matches!(err, SaveError::ManifestMissing { .. }), "{err}");
    assert!(err.to_string().contains("save never finished"), "{err}");
    let err = store.resolve(root.path().join("notes").to_str().unwrap()).unwrap_err();
    assert!(err.to_string().contains("neither a manifest.json nor a latest file"), "{err}");
    let err = store.resolve(root.path().join("gone").to_str().unwrap()).unwrap_err();
    assert!(err.to_string().contains("does not exist"), "{err}");

    // `latest` naming a directory that is gone.
    fs::remove_dir_all(&five).unwrap();
    let err = store.resolve("latest").unwrap_err();
    assert!(err.to_string().contains("(latest names step-00000005, which does not exist); train first"), "{err}");
}

#[test]
fn load_and_resolve_refuse_a_directory_without_a_valid_manifest() {
    let root = tempfile::tempdir().unwrap();
    let store = CheckpointStore::new(root.path(), 0);
    let dir = store.save(1, &files(1)).unwrap();
    fs::write(dir.join(MANIFEST_FILE), "{\"format\": 1, \"step\": ").unwrap();
    let err = CheckpointStore::load(&dir).unwrap_err();
    assert!(matches!(err, SaveError::ManifestInvalid { .. }), "{err}");
    assert!(store.resolve("latest").is_err());
    assert_eq!(store.list().unwrap(), vec![]);

    fs::write(
        dir.join(MANIFEST_FILE),
        r#"{"format": 1, "step": 1, "files": {"../escape": {"sha256": "00", "bytes": 0}}}"#,
    )
    .unwrap();
    assert!(CheckpointStore::load(&dir).unwrap_err().to_string().contains("file name '../escape'"));
    fs::write(dir.join(MANIFEST_FILE), r#"{"format": 2, "step": 1, "files": {}}"#).unwrap();
    assert!(CheckpointStore::load(&dir).unwrap_err().to_string().contains("format 2"));

    fs::remove_file(dir.join(MANIFEST_FILE)).unwrap();
    let err = CheckpointStore::load(&dir).unwrap_err();
    assert!(matches!(err, SaveError::ManifestMissing { .. }), "{err}");
    assert!(store.resolve("latest").is_err());
}

#[test]
fn flipping_any_byte_of_any_file_is_detected_naming_the_file() {
    let root = tempfile::tempdir().unwrap();
    let store = CheckpointStore::new(root.path(), 0);
    let dir = store.save(7, &files(7)).unwrap();
    for (name, bytes) in files(7) {
        if bytes.is_empty() {
            continue;
        }
        let path = dir.join(&name);
        // First, middle and last byte.
        for at in [0, bytes.len() / 2, bytes.len() - 1] {
            let mut damaged = bytes.clone();
            damaged[at] ^= 0x01;
            fs::write(&path, &damaged).unwrap();
            for err in [CheckpointStore::load(&dir).unwrap_err(), verify(&dir).unwrap_err()] {
                let text = err.to_string();
                assert!(matches!(err, SaveError::Corrupted { .. }), "{text}");
                let expected = format!("checkpoint file {} is corrupted (sha256 mismatch: expected ", path.display());
                assert!(text.starts_with(&expected), "{text}");
                // The digest of bytes that are not the checkpoint's is not printed.
                let SaveError::Corrupted { found, .. } = &err else { unreachable!() };
                assert!(!text.contains(found.as_str()), "{text}");
                assert!(text.ends_with(&format!("resume from an earlier one: ls {}", root.path().display())), "{text}");
            }
        }
        fs::write(&path, &bytes).unwrap();
        CheckpointStore::load(&dir).unwrap();
    }
}

/// A checkpoint file that is another user's symbolic link is refused by name, whatever it
/// leads to (resumed as root, it could be any file: a secret's size and digest would be
/// printed); this user's own link is followed.
#[test]
fn another_users_link_in_a_checkpoint_is_not_followed() {
    let root = tempfile::tempdir().unwrap();
    let store = CheckpointStore::new(root.path(), 0);
    let dir = store.save(7, &files(7)).unwrap();
    let (name, bytes) = files(7).into_iter().find(|(_, b)| !b.is_empty()).unwrap();
    let elsewhere = root.path().join("elsewhere.bin");
    fs::write(&elsewhere, &bytes).unwrap();
    let path = dir.join(&name);
    fs::remove_file(&path).unwrap();
    std::os::unix::fs::symlink(&elsewhere, &path).unwrap();
    CheckpointStore::load(&dir).unwrap();
    verify(&dir).unwrap();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("not root: another user's link cannot be made here; only this user's link was checked");
        return;
    }
    std::os::unix::fs::lchown(&path, Some(65534), Some(65534)).unwrap();
    for err in [CheckpointStore::load(&dir).unwrap_err(), verify(&dir).unwrap_err()] {
        let text = err.to_string();
        assert!(matches!(err, SaveError::ForeignLink { owner: 65534, .. }), "{text}");
        assert!(text.contains("is a symbolic link owned by uid 65534, another user"), "{text}");
    }
    // Copied with `cp -r`, her link becomes this user's, pointing at hers: refused at hers.
    let hers = root.path().join("hers");
    fs::rename(&path, &hers).unwrap();
    std::os::unix::fs::symlink(&hers, &path).unwrap();
    let err = CheckpointStore::load(&dir).unwrap_err();
    assert!(matches!(&err, SaveError::ForeignLink { path: p, owner: 65534 } if p == &hers), "{err}");
}

#[test]
fn truncated_grown_and_missing_files_are_detected() {
    let root = tempfile::tempdir().unwrap();
    let dir = CheckpointStore::new(root.path(), 0).save(3, &files(3)).unwrap();
    let path = dir.join("optimizer.safetensors");
    let bytes = fs::read(&path).unwrap();

    fs::write(&path, &bytes[..bytes.len() - 1]).unwrap();
    let err = CheckpointStore::load(&dir).unwrap_err();
    assert!(err.to_string().contains("optimizer.safetensors is truncated or was changed"), "{err}");
    fs::write(&path, [bytes.as_slice(), b"x"].concat()).unwrap();
    assert!(matches!(verify(&dir).unwrap_err(), SaveError::SizeMismatch { .. }));

    fs::remove_file(&path).unwrap();
    let err = verify(&dir).unwrap_err();
    assert!(err.to_string().contains("optimizer.safetensors is missing"), "{err}");
    assert!(matches!(CheckpointStore::load(&dir).unwrap_err(), SaveError::FileMissing { .. }));
}

#[test]
fn keep_last_two_keeps_exactly_the_two_newest() {
    let root = tempfile::tempdir().unwrap();
    let store = CheckpointStore::new(root.path(), 2);
    for step in 1..=5 {
        store.save(step * 100, &files(step)).unwrap();
        let kept: Vec<u64> = store.list().unwrap().into_iter().map(|(s, _)| s).collect();
        let expected: Vec<u64> = (step.saturating_sub(1).max(1)..=step).map(|s| s * 100).collect();
        assert_eq!(kept, expected);
    }
    let mut names: Vec<String> =
        fs::read_dir(root.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    assert_eq!(names, ["latest", "step-00000400", "step-00000500"]);
}

#[test]
fn prune_never_removes_the_checkpoint_latest_names() {
    let root = tempfile::tempdir().unwrap();
    let store = CheckpointStore::new(root.path(), 1);
    store.save(20, &files(20)).unwrap();
    // Resumed from an earlier point: the new save has a lower step than an existing one.
    store.save(10, &files(10)).unwrap();
    let steps: Vec<u64> = store.list().unwrap().into_iter().map(|(s, _)| s).collect();
    assert_eq!(steps, [10, 20]);
    assert_eq!(store.resolve("latest").unwrap(), root.path().join("step-00000010"));
}

#[test]
fn resaving_a_step_replaces_it() {
    for fallback in [false, true] {
        crate::save::store::NO_EXCHANGE.with(|c| c.set(fallback));
        let root = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(root.path(), 2);
        store.save(1, &files(1)).unwrap();
        store.save(2, &files(2)).unwrap();
        let again = vec![("model.safetensors".to_string(), b"retrained".to_vec())];
        let dir = store.save(2, &again).unwrap();
        let loaded = CheckpointStore::load(&dir).unwrap();
        assert_eq!(contents(&loaded), again.into_iter().collect(), "fallback {fallback}");
        assert_eq!(store.list().unwrap().len(), 2);
        assert!(leftovers(root.path()).is_empty(), "fallback {fallback}: {:?}", leftovers(root.path()));
    }
    crate::save::store::NO_EXCHANGE.with(|c| c.set(false));
}

#[test]
fn bad_file_names_are_refused_before_anything_is_written() {
    let root = tempfile::tempdir().unwrap();
    let store = CheckpointStore::new(root.path().join("ckpt"), 0);
    for (name, why) in [
        ("", "empty"),
        ("sub/model.safetensors", "plain files"),
        (".hidden", "reserved"),
        ("manifest.json", "writes manifest.json itself"),
    ] {
        let err = store.save(1, &[(name.to_string(), vec![1])]).unwrap_err();
        assert!(matches!(err, SaveError::BadFileName { .. }) && err.to_string().contains(why), "{name}: {err}");
    }
    let twice = vec![("a".to_string(), vec![1]), ("a".to_string(), vec![2])];
    assert!(store.save(1, &twice).unwrap_err().to_string().contains("given twice"));
    assert!(!root.path().join("ckpt").exists());
}

#[test]
fn a_real_io_error_leaves_no_temp_directory() {
    let root = tempfile::tempdir().unwrap();
    let store = CheckpointStore::new(root.path(), 0);
    store.save(1, &files(1)).unwrap();
    // A name longer than the file system allows makes the file write fail.
    let huge_name = "x".repeat(300);
    let err = store.save(2, &[(huge_name, vec![1])]).unwrap_err();
    assert!(matches!(err, SaveError::Io { .. }), "{err}");
    assert!(err.to_string().contains("check that the directory exists"), "{err}");
    assert!(leftovers(root.path()).is_empty(), "{:?}", leftovers(root.path()));
    assert_eq!(store.resolve("latest").unwrap(), root.path().join("step-00000001"));
}

/// A loaded checkpoint's files as plain bytes.
fn contents(loaded: &crate::save::LoadedCheckpoint) -> std::collections::BTreeMap<String, Vec<u8>> {
    loaded.files.iter().map(|(k, v)| (k.clone(), v.to_vec())).collect()
}

/// Issue 20: a manifest's numbers are checked before they size anything.
fn rewrite_manifest(dir: &std::path::Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join(MANIFEST_FILE);
    let mut v: serde_json::Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
    edit(&mut v);
    fs::write(&path, v.to_string()).unwrap();
}

#[test]
fn a_damaged_manifest_size_is_refused_before_any_allocation() {
    let root = tempfile::tempdir().unwrap();
    let store = CheckpointStore::new(root.path(), 3);
    let dir = store.save(2, &[("a.bin".into(), vec![7; 100])]).unwrap();
    // Past any disk: refused when the manifest is read (it used to be a capacity overflow).
    rewrite_manifest(&dir, |v| v["files"]["a.bin"]["bytes"] = u64::MAX.into());
    let e = CheckpointStore::load(&dir).unwrap_err().to_string();
    assert!(e.contains("is invalid: files.a.bin.bytes is 18446744073709551615, more than the"), "{e}");
    assert!(store.resolve(dir.to_str().unwrap()).is_err());
    // Plausible but wrong: the size on disk is compared first (it used to reserve 1 TiB).
    rewrite_manifest(&dir, |v| v["files"]["a.bin"]["bytes"] = (1u64 << 40).into());
    let e = CheckpointStore::load(&dir).unwrap_err().to_string();
    assert!(e.contains("is truncated or was changed (100 bytes, the manifest says 1099511627776)"), "{e}");
    rewrite_manifest(&dir, |v| v["files"]["a.bin"]["sha256"] = "zz".into());
    let e = Manifest::read(&dir).unwrap_err().to_string();
    assert!(e.contains("files.a.bin.sha256 is \"zz\", not 64 hex digits"), "{e}");
}

#[test]
fn a_fifo_in_a_checkpoint_is_refused_without_blocking() {
    let root = tempfile::tempdir().unwrap();
    let store = CheckpointStore::new(root.path(), 3);
    let dir = store.save(2, &[("a.bin".into(), vec![7; 100])]).unwrap();
    fs::remove_file(dir.join("a.bin")).unwrap();
    let c = std::ffi::CString::new(dir.join("a.bin").to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let e = CheckpointStore::load(&dir).unwrap_err().to_string();
    assert!(e.contains("is invalid: it lists 'a.bin', which is a FIFO (named pipe), not a regular file"), "{e}");
    assert!(verify(&dir).is_err());
    // The manifest itself, and the latest pointer.
    fs::remove_file(dir.join(MANIFEST_FILE)).unwrap();
    std::os::unix::fs::symlink("/dev/zero", dir.join(MANIFEST_FILE)).unwrap();
    let e = Manifest::read(&dir).unwrap_err().to_string();
    assert!(e.contains("is invalid: is a character device, not a regular file"), "{e}");
    fs::remove_file(root.path().join("latest")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", root.path().join("latest")).unwrap();
    let e = store.resolve("latest").unwrap_err().to_string();
    assert!(e.contains("is a character device"), "{e}");
}
