//! A simulated kill at every durable operation of a save: the previous checkpoint stays
//! loadable, `latest` never names a partial checkpoint, and the next save cleans up.

use std::path::{Path, PathBuf};

use super::{files, leftovers};
use crate::save::{CheckpointStore, FaultInjector, SaveError, verify};

/// Every checkpoint `list` reports is intact, and `latest` (if any) is one of them.
fn assert_consistent(store: &CheckpointStore, context: &str) -> Option<PathBuf> {
    for (step, dir) in store.list().unwrap() {
        let loaded = CheckpointStore::load(&dir).unwrap_or_else(|e| panic!("{context}: {e}"));
        assert_eq!(loaded.step, step, "{context}");
        verify(&dir).unwrap();
    }
    let latest = store.latest().unwrap();
    if let Some(dir) = &latest {
        assert_eq!(store.resolve("latest").unwrap(), *dir, "{context}");
        assert!(store.list().unwrap().iter().any(|(_, d)| d == dir), "{context}: latest {dir:?} is not complete");
    }
    latest
}

/// The files of `dir`, as loaded.
fn content(dir: &Path) -> Vec<(String, Vec<u8>)> {
    CheckpointStore::load(dir).unwrap().files.into_iter().map(|(k, v)| (k, v.to_vec())).collect()
}

/// Runs `prepare` then a save of `step` with `new` files failing at operation 1, 2, ... until
/// a save goes through; `check` judges the state after each failure. Returns the number of
/// fault positions, after checking it against `FaultInjector::count_ops`.
fn every_fault(
    keep_last: usize,
    prepare: impl Fn(&CheckpointStore),
    step: u64,
    new: &[(String, Vec<u8>)],
    check: impl Fn(&CheckpointStore, &str),
) -> u64 {
    let counted = {
        let root = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(root.path().join("ckpt"), keep_last);
        prepare(&store);
        let counter = FaultInjector::count_ops();
        store.clone().with_faults(counter.clone()).save(step, new).unwrap();
        counter.ops()
    };
    for n in 1.. {
        let root = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(root.path().join("ckpt"), keep_last);
        prepare(&store);
        let fault = FaultInjector::fail_at(n);
        let result = store.clone().with_faults(fault.clone()).save(step, new);
        let Some(what) = fault.fired() else {
            result.unwrap();
            assert_eq!(n - 1, counted, "count_ops saw another number of operations");
            return counted;
        };
        let err = result.expect_err(&what);
        let source = match &err {
            SaveError::Prune { source, .. } => source.as_ref(),
            other => other,
        };
        assert!(matches!(source, SaveError::Io { .. }), "{what}: {err}");
        assert!(err.to_string().contains("injected fault"), "{what}: {err}");
        let context = format!("killed at {what}");
        check(&store, &context);

        // The next save works and leaves nothing behind.
        let dir = store.save(step + 1, &files(step + 1)).unwrap_or_else(|e| panic!("{context}, then: {e}"));
        assert_eq!(store.latest().unwrap(), Some(dir.clone()), "{context}");
        assert_eq!(content(&dir), files(step + 1));
        assert!(leftovers(store.root()).is_empty(), "{context}: left {:?}", leftovers(store.root()));
        assert_consistent(&store, &context);
        if keep_last > 0 {
            assert!(store.list().unwrap().len() <= keep_last, "{context}");
        }
    }
    unreachable!()
}

#[test]
fn a_kill_during_the_first_save_leaves_no_checkpoint_or_a_complete_one() {
    let positions = every_fault(
        2,
        |_| {},
        1,
        &files(1),
        |store, context| match assert_consistent(store, context) {
            None => assert!(store.resolve("latest").unwrap_err().to_string().contains("no checkpoint found")),
            Some(dir) => assert_eq!(content(&dir), files(1), "{context}"),
        },
    );
    // Root creation + fsync, tmp dir, 4 files and the manifest (write + fsync each), fsync
    // tmp, rename, fsync root, latest (write, fsync, rename, fsync).
    assert_eq!(positions, 2 + 1 + 5 * 2 + 3 + 4);
}

#[test]
fn a_kill_at_any_point_leaves_the_previous_checkpoint_loadable() {
    let prepare = |store: &CheckpointStore| {
        store.save(1, &files(1)).unwrap();
        store.save(2, &files(2)).unwrap();
    };
    let positions = every_fault(2, prepare, 3, &files(3), |store, context| {
        let latest = assert_consistent(store, context).expect("a checkpoint was saved before");
        let (two, three) = (store.root().join("step-00000002"), store.root().join("step-00000003"));
        assert_eq!(content(&two), files(2), "{context}: the previous checkpoint");
        if latest == two {
            // Killed before `latest` moved: nothing older was touched either.
            assert_eq!(content(&store.root().join("step-00000001")), files(1), "{context}");
        } else {
            assert_eq!(latest, three, "{context}");
            assert_eq!(content(&three), files(3), "{context}");
        }
    });
    // As the first save without creating the root, plus renaming step 1 away in the prune.
    assert_eq!(positions, 1 + 5 * 2 + 3 + 4 + 1);
}

#[test]
fn a_kill_while_resaving_the_latest_step_keeps_it_loadable() {
    let prepare = |store: &CheckpointStore| {
        store.save(1, &files(1)).unwrap();
        store.save(2, &files(2)).unwrap();
    };
    let again = vec![("model.safetensors".to_string(), b"retrained".to_vec())];
    let positions = every_fault(3, prepare, 2, &again, |store, context| {
        let latest = assert_consistent(store, context).expect("a checkpoint was saved before");
        assert_eq!(latest, store.root().join("step-00000002"), "{context}");
        let found = content(&latest);
        assert!(found == files(2) || found == again, "{context}: step 2 holds neither version");
        assert_eq!(content(&store.root().join("step-00000001")), files(1), "{context}");
    });
    // tmp dir, 1 file + manifest, fsync tmp, exchange, fsync root, latest (4).
    assert_eq!(positions, 1 + 2 * 2 + 1 + 1 + 1 + 4);
}

#[test]
fn without_atomic_exchange_a_kill_while_resaving_leaves_a_complete_copy() {
    crate::save::store::NO_EXCHANGE.with(|c| c.set(true));
    let prepare = |store: &CheckpointStore| store.save(2, &files(2)).map(drop).unwrap();
    let again = vec![("model.safetensors".to_string(), b"retrained".to_vec())];
    let positions = every_fault(3, prepare, 2, &again, |store, context| {
        let step2 = store.root().join("step-00000002");
        if step2.exists() {
            let found = content(&step2);
            assert!(found == files(2) || found == again, "{context}");
        } else {
            // The documented window between the two renames: the old one is aside, intact.
            let aside = store.root().join(format!(".tmp-old-step-00000002-{}", std::process::id()));
            assert_eq!(content(&aside), files(2), "{context}");
        }
    });
    crate::save::store::NO_EXCHANGE.with(|c| c.set(false));
    // As with the exchange (whose attempt counts), plus two renames.
    assert_eq!(positions, 1 + 2 * 2 + 1 + 1 + 2 + 1 + 4);
}

#[test]
fn fail_at_zero_never_fires_and_faults_count_across_clones() {
    let root = tempfile::tempdir().unwrap();
    let fault = FaultInjector::fail_at(0);
    CheckpointStore::new(root.path(), 0).with_faults(fault.clone()).save(1, &files(1)).unwrap();
    assert_eq!(fault.fired(), None);
    assert!(fault.ops() > 10);
}
