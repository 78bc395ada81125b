//! Vetting: the lock file and the three policies, decided before a library is opened.
//! (The canary fixture, which proves "not opened", has its own test binary:
//! `canary_vetting.rs`.)
//!
//! Every test works in its own private temporary directory (mode 0700) and searches only it.

#![cfg(target_os = "linux")]

mod common;

use std::{fs, path::Path};

use ava_core::PluginKind;
use ava_plugins::{HostError, LockFile, Pin, Status, VettingPolicy, vet_file};
use ava_tests::{fixture, workspace_plugin};
use common::{
    ParamState, assert_close, file_row, file_rows, flip_byte_in, host, host_with_lock, load, private_copy, reason,
    set_mode, sha256_file, step,
};

const LION_FILE: &str = "libava_plugin_lion.so";
/// A string in Lion's read-only data (its manifest summary): changing one of its letters
/// leaves a library that still loads.
const LION_SUMMARY: &str = "sign of interpolated momentum";

fn lock_path(dir: &Path) -> std::path::PathBuf {
    dir.join("ava-plugins.lock")
}

fn lion_pin(sha256: &str) -> Pin {
    Pin {
        name: "lion".into(),
        kind: "optimizer".into(),
        version: "0.1.0".into(),
        sha256: sha256.into(),
        file: LION_FILE.into(),
    }
}

/// Restores a directory's mode when dropped, even if the test fails.
struct RestoreMode<'a>(&'a Path, u32);

impl Drop for RestoreMode<'_> {
    fn drop(&mut self) {
        set_mode(self.0, self.1);
    }
}

#[test]
fn vet_file_writes_a_pin_and_re_vetting_replaces_it() {
    let tmp = tempfile::tempdir().unwrap();
    let lib = private_copy(&workspace_plugin("lion"), tmp.path());
    let lock = lock_path(tmp.path());
    let sha1 = sha256_file(&lib);

    let (pin, replaced) = vet_file(&lib, &lock).unwrap();
    assert_eq!(pin, lion_pin(&sha1));
    assert!(replaced.is_empty(), "{replaced:?}");
    assert_eq!(LockFile::read(&lock).unwrap().plugins, std::slice::from_ref(&pin));
    let text = fs::read_to_string(&lock).unwrap();
    assert!(
        text.ends_with(&format!(
            "version = 1\n\n[[plugins]]\nname = \"lion\"\nkind = \"optimizer\"\nversion = \"0.1.0\"\nsha256 = \"{sha1}\"\nfile = \"{LION_FILE}\"\n"
        )),
        "{text}"
    );

    // Vetting the same bytes again replaces the pin with an equal one.
    let (again, replaced) = vet_file(&lib, &lock).unwrap();
    assert_eq!(again, pin);
    assert_eq!(replaced, std::slice::from_ref(&pin));
    assert_eq!(LockFile::read(&lock).unwrap().plugins, std::slice::from_ref(&pin));

    // The library changes: re-vetting pins the new bytes and hands back the old pin.
    flip_byte_in(&lib, LION_SUMMARY, 0);
    let sha2 = sha256_file(&lib);
    assert_ne!(sha1, sha2);
    let (new_pin, replaced) = vet_file(&lib, &lock).unwrap();
    assert_eq!(new_pin, lion_pin(&sha2));
    assert_eq!(replaced, [pin]);
    assert_eq!(LockFile::read(&lock).unwrap().plugins, [new_pin]);

    // And the re-vetted library is what policy vetted now opens.
    let reg = load(&host(&[tmp.path()], VettingPolicy::Vetted));
    let row = file_row(&reg, &lib);
    assert_eq!(row.status, Status::Vetted, "{row:#?}");
    assert_eq!(
        row.manifest.as_ref().unwrap().summary.as_str().split(';').next(),
        Some("Lion: Sign of interpolated momentum")
    );
}

#[test]
fn vet_file_refuses_what_it_cannot_open_and_writes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let lock = lock_path(tmp.path());
    let old = private_copy(&fixture("old-contract"), tmp.path());
    assert!(matches!(vet_file(&old, &lock), Err(HostError::ContractVersion { .. })));
    let foreign = private_copy(&fixture("foreign-abi"), tmp.path());
    assert!(matches!(vet_file(&foreign, &lock), Err(HostError::NotAPlugin { .. })));
    let missing = tmp.path().join("libnope.so");
    assert!(matches!(vet_file(&missing, &lock), Err(HostError::Missing { .. })));
    assert!(!lock.exists(), "a lock file was written for a library that could not be vetted");
}

#[test]
fn yaml_lock_file_works() {
    let tmp = tempfile::tempdir().unwrap();
    let lib = private_copy(&workspace_plugin("lion"), tmp.path());
    let lock = tmp.path().join("ava-plugins.yaml");
    let sha = sha256_file(&lib);

    let (pin, replaced) = vet_file(&lib, &lock).unwrap();
    assert_eq!(pin, lion_pin(&sha));
    assert!(replaced.is_empty());
    let text = fs::read_to_string(&lock).unwrap();
    assert!(
        text.ends_with(&format!(
            "version: 1\nplugins:\n  - name: \"lion\"\n    kind: \"optimizer\"\n    version: \"0.1.0\"\n    sha256: \"{sha}\"\n    file: \"{LION_FILE}\"\n"
        )),
        "{text}"
    );
    assert_eq!(LockFile::read(&lock).unwrap().plugins, [pin]);

    let reg = load(&host_with_lock(&[tmp.path()], VettingPolicy::Vetted, &lock));
    assert_eq!(file_row(&reg, &lib).status, Status::Vetted);
    reg.optimizer("lion", "").unwrap();
    assert!(reg.warnings().is_empty(), "{:?}", reg.warnings());
}

#[test]
fn vetted_policy_refuses_unpinned_and_opens_pinned() {
    let tmp = tempfile::tempdir().unwrap();
    let lib = private_copy(&workspace_plugin("lion"), tmp.path());
    let sha = sha256_file(&lib);

    let reg = load(&host(&[tmp.path()], VettingPolicy::Vetted));
    let row = file_row(&reg, &lib);
    assert_eq!(row.status, Status::Refused);
    assert!(row.manifest.is_none(), "an unpinned library was opened under vetted");
    assert_eq!(row.sha256.as_deref(), Some(sha.as_str()));
    assert_eq!(
        reason(row),
        format!(
            "not pinned in the lock file (sha256 {sha}); policy 'vetted' opens only pinned plugins: review it, then pin it with `ava plugins vet {}`",
            lib.display()
        )
    );
    let err = reg.optimizer("lion", "").err().expect("a refused plugin cannot be used");
    // Said to exist and why it was refused, not "unknown".
    assert_eq!(
        err.to_string(),
        format!(
            "optimizer 'lion' cannot be used: its library {} was found but was refused: {}",
            lib.display(),
            reason(row)
        )
    );

    vet_file(&lib, &lock_path(tmp.path())).unwrap();
    let reg = load(&host(&[tmp.path()], VettingPolicy::Vetted));
    let row = file_row(&reg, &lib);
    assert_eq!(row.status, Status::Vetted);
    assert_eq!(row.reason, None);
    assert_eq!(reg.row(PluginKind::Optimizer, "lion").map(|r| r.status), Some(Status::Vetted));
    let mut lion = reg.optimizer("lion", "").unwrap();
    let mut state = ParamState::new(lion.as_ref(), 1);
    let mut w = [1.0f32];
    step(lion.as_mut(), &mut w, &[0.3], &mut state, 0.1, 0.0).unwrap();
    assert_close(&w, &[0.9], "lion θ");
}

/// One changed byte in a pinned library: status modified, both hashes in the reason, not
/// opened — under every policy — and using it is an error that says why.
#[test]
fn modified_pinned_library_is_refused_under_every_policy() {
    let tmp = tempfile::tempdir().unwrap();
    let lib = private_copy(&workspace_plugin("lion"), tmp.path());
    let lock = lock_path(tmp.path());
    let (pin, _) = vet_file(&lib, &lock).unwrap();
    let pinned_sha = pin.sha256.clone();
    flip_byte_in(&lib, LION_SUMMARY, 0);
    let actual_sha = sha256_file(&lib);
    assert_ne!(pinned_sha, actual_sha);

    let expected = format!(
        "pinned as optimizer 'lion' 0.1.0 with sha256 {pinned_sha}, but the file's sha256 is {actual_sha}; \
         if the change is intended, re-vet it with `ava plugins vet {}`",
        lib.display()
    );
    for policy in VettingPolicy::ALL {
        let reg = load(&host(&[tmp.path()], policy));
        let row = file_row(&reg, &lib);
        assert_eq!(row.status, Status::Modified, "policy {policy}: {row:#?}");
        assert!(row.manifest.is_none(), "policy {policy}: a modified library was opened");
        assert_eq!(row.sha256.as_deref(), Some(actual_sha.as_str()));
        let why = reason(row);
        assert!(why.contains(&pinned_sha) && why.contains(&actual_sha), "{why}");
        assert_eq!(why, expected, "policy {policy}");
        assert!(reg.names(PluginKind::Optimizer).iter().all(|n| n != "lion"), "policy {policy}");
        let err = reg.optimizer("lion", "").err().expect("a modified plugin cannot be used");
        assert!(matches!(err, HostError::Unusable { .. }), "policy {policy}: {err:?}");
        assert_eq!(err.to_string(), format!("optimizer 'lion' cannot be used: {expected}"), "policy {policy}");
    }

    // The changed byte is harmless in itself: without the pin the same file loads, and the
    // change is visible in what was loaded. The refusals above are the pin's doing.
    let reg = load(&host_with_lock(&[tmp.path()], VettingPolicy::Open, &tmp.path().join("empty.lock")));
    let row = file_row(&reg, &lib);
    assert_eq!(row.status, Status::Loaded);
    assert!(row.manifest.as_ref().unwrap().summary.starts_with("Lion: Sign of interpolated momentum"));
}

/// A modified copy searched first, and the pinned copy later in the search: the pinned one is
/// used, and the registry says so (a notice every command prints), naming both files.
#[test]
fn a_modified_copy_replaced_by_another_is_said() {
    let tmp = tempfile::tempdir().unwrap();
    let (first, second) = (tmp.path().join("first"), tmp.path().join("second"));
    for d in [&first, &second] {
        fs::create_dir(d).unwrap();
        set_mode(d, 0o700);
    }
    let edited = private_copy(&workspace_plugin("lion"), &first);
    let good = private_copy(&workspace_plugin("lion"), &second);
    let lock = lock_path(tmp.path());
    vet_file(&good, &lock).unwrap();
    flip_byte_in(&edited, LION_SUMMARY, 0);
    let reg = load(&host_with_lock(&[first.as_path(), second.as_path()], VettingPolicy::Vetted, &lock));
    assert_eq!(file_row(&reg, &edited).status, Status::Modified);
    assert!(reg.optimizer("lion", "").is_ok(), "the pinned copy is used");
    let notices = reg.notices();
    let said = notices.iter().find(|n| n.contains(&edited.display().to_string())).expect("a notice");
    assert!(
        said.starts_with(&format!("plugin 'lion': {} was not opened (pinned as optimizer 'lion'", edited.display()))
            && said.ends_with(&format!("'lion' is loaded from {} instead", good.display())),
        "{said}"
    );
}

/// Bytes pinned under another name or version: the lock file and the library disagree.
#[test]
fn pin_with_other_name_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let lib = private_copy(&workspace_plugin("lion"), tmp.path());
    let mut lock = LockFile::default();
    lock.upsert(Pin { name: "lion2".into(), version: "0.2.0".into(), ..lion_pin(&sha256_file(&lib)) });
    lock.write(&lock_path(tmp.path())).unwrap();
    for policy in VettingPolicy::ALL {
        let reg = load(&host(&[tmp.path()], policy));
        let row = file_row(&reg, &lib);
        assert_eq!(row.status, Status::Refused, "policy {policy}");
        assert_eq!(
            reason(row),
            "the lock file pins these bytes as optimizer 'lion2' 0.2.0, but the library says optimizer 'lion' 0.1.0; re-vet it"
        );
        assert!(reg.optimizer("lion", "").is_err());
    }
}

#[test]
fn symlink_to_pinned_library_is_refused_under_vetted() {
    let tmp = tempfile::tempdir().unwrap();
    let real_dir = common::subdir(tmp.path(), "real");
    let real = private_copy(&workspace_plugin("lion"), &real_dir);
    let link = tmp.path().join(LION_FILE);
    std::os::unix::fs::symlink(&real, &link).unwrap();
    vet_file(&real, &lock_path(tmp.path())).unwrap();

    let reg = load(&host(&[tmp.path()], VettingPolicy::Vetted));
    let row = file_row(&reg, &link);
    assert_eq!(row.status, Status::Refused);
    assert!(row.manifest.is_none());
    assert_eq!(
        reason(row),
        "symbolic links are refused under policy 'vetted' (the link's target can change after vetting); put the file itself in the search path"
    );
    assert!(reg.optimizer("lion", "").is_err());

    // The same link is fine under open (and the bytes are the pinned ones).
    let reg = load(&host(&[tmp.path()], VettingPolicy::Open));
    assert_eq!(file_row(&reg, &link).status, Status::Vetted);
}

#[test]
fn writable_directory_or_file_is_refused_under_vetted() {
    let tmp = tempfile::tempdir().unwrap();
    // The lock file lives apart: in the writable directory it would be refused itself
    // (`a_lock_file_others_can_change_fails_the_load`).
    let team = tempfile::tempdir().unwrap();
    let lock = lock_path(team.path());
    let host = |dirs: &[&Path], policy| host_with_lock(dirs, policy, &lock);
    let lib = private_copy(&workspace_plugin("lion"), tmp.path());
    vet_file(&lib, &lock).unwrap();
    assert_eq!(file_row(&load(&host(&[tmp.path()], VettingPolicy::Vetted)), &lib).status, Status::Vetted);

    {
        set_mode(tmp.path(), 0o777);
        let _restore = RestoreMode(tmp.path(), 0o700);
        let reg = load(&host(&[tmp.path()], VettingPolicy::Vetted));
        let row = file_row(&reg, &lib);
        assert_eq!(row.status, Status::Refused);
        assert!(row.manifest.is_none());
        let why = reason(row);
        assert!(why.contains("writable by"), "{why}");
        assert_eq!(
            why,
            format!(
                "the library's directory {} is writable by group and others (mode 777), so it could be changed after vetting; fix with chmod go-w {}; refused under policy 'vetted'",
                tmp.path().display(),
                tmp.path().display()
            )
        );
        // Policy warn does not look at permissions.
        let reg = load(&host(&[tmp.path()], VettingPolicy::Warn));
        assert_eq!(file_row(&reg, &lib).status, Status::Vetted);
    }

    set_mode(&lib, 0o775);
    let reg = load(&host(&[tmp.path()], VettingPolicy::Vetted));
    let row = file_row(&reg, &lib);
    assert_eq!(row.status, Status::Refused);
    assert_eq!(
        reason(row),
        format!(
            "the library {} is writable by group (mode 775), so it could be changed after vetting; fix with chmod go-w {}; refused under policy 'vetted'",
            lib.display(),
            lib.display()
        )
    );
    set_mode(&lib, 0o755);
    assert_eq!(file_row(&load(&host(&[tmp.path()], VettingPolicy::Vetted)), &lib).status, Status::Vetted);
}

/// Under vetted, a lock file in a directory others can write fails the whole load: whoever
/// can write there can pin anything.
#[test]
fn a_lock_file_others_can_change_fails_the_load() {
    let tmp = tempfile::tempdir().unwrap();
    let lib = private_copy(&workspace_plugin("lion"), tmp.path());
    vet_file(&lib, &lock_path(tmp.path())).unwrap();
    set_mode(tmp.path(), 0o777);
    let _restore = RestoreMode(tmp.path(), 0o700);
    let e = ava_plugins::Registry::load(&host(&[tmp.path()], VettingPolicy::Vetted)).err().expect("refused");
    assert!(
        e.to_string().contains(&format!(
            "the lock file's directory {} is writable by group and others (mode 777)",
            tmp.path().display()
        )),
        "{e}"
    );
    // Policy warn reads it as before.
    assert!(ava_plugins::Registry::load(&host(&[tmp.path()], VettingPolicy::Warn)).is_ok());
}

#[test]
fn unpinned_plugin_under_warn_loads_unvetted_with_a_warning() {
    let tmp = tempfile::tempdir().unwrap();
    let lib = private_copy(&workspace_plugin("lion"), tmp.path());
    let reg = load(&host(&[tmp.path()], VettingPolicy::Warn));
    let row = file_row(&reg, &lib);
    assert_eq!(row.status, Status::Unvetted);
    assert_eq!(row.name(), Some("lion"));
    let warning = format!(
        "{} is not pinned in the lock file; policy 'vetted' would refuse it (pin it with `ava plugins vet {}`)",
        lib.display(),
        lib.display()
    );
    assert_eq!(row.reason.as_deref(), Some(warning.as_str()));
    assert_eq!(reg.notices(), [format!("plugin 'lion': {warning}")]);
    assert!(reg.warnings().is_empty(), "the warning belongs to the row: {:?}", reg.warnings());
    reg.optimizer("lion", "").unwrap();

    vet_file(&lib, &lock_path(tmp.path())).unwrap();
    let reg = load(&host(&[tmp.path()], VettingPolicy::Warn));
    assert_eq!(file_row(&reg, &lib).status, Status::Vetted);
    assert!(reg.warnings().is_empty(), "{:?}", reg.warnings());
}

#[test]
fn open_policy_loads_unpinned_and_marks_pinned_vetted() {
    let tmp = tempfile::tempdir().unwrap();
    let lion = private_copy(&workspace_plugin("lion"), tmp.path());
    let sign = private_copy(&fixture("sign-sgd"), tmp.path());
    vet_file(&lion, &lock_path(tmp.path())).unwrap();

    let reg = load(&host(&[tmp.path()], VettingPolicy::Open));
    assert_eq!(file_rows(&reg).len(), 2);
    let row = file_row(&reg, &lion);
    assert_eq!((row.status, row.reason.as_deref()), (Status::Vetted, None));
    let row = file_row(&reg, &sign);
    assert_eq!((row.status, row.reason.as_deref()), (Status::Loaded, None));
    assert!(reg.warnings().is_empty(), "{:?}", reg.warnings());
    reg.optimizer("lion", "").unwrap();
    reg.optimizer("sign-sgd", "").unwrap();
}
