//! "Refused before it is opened", proved with the canary fixture: opening the library
//! (`dlopen`, before any Ava code runs) appends `"<pid> loaded"` to `$AVA_CANARY_MARKER`.
//! Refused → marker absent; loaded → marker present.
//!
//! One test in its own binary, running its scenarios in order: it sets an environment
//! variable, which is process-global and must not race with other threads.

#![cfg(target_os = "linux")]

mod common;

use std::{fs, path::Path};

use ava_core::PluginKind;
use ava_plugins::{HostError, Status, VettingPolicy, vet_file};
use ava_tests::{CANARY_MARKER_ENV, fixture};
use common::{
    ParamState, assert_close, file_row, flip_byte_in, host, host_with_lock, load, private_copy, reason, step,
};

/// A string in the canary's read-only data (its manifest summary).
const CANARY_SUMMARY: &str = "plain SGD that marks its loading";

fn set_marker(path: Option<&Path>) {
    // SAFETY: the only test in this binary; no other thread reads the environment.
    unsafe {
        match path {
            Some(p) => std::env::set_var(CANARY_MARKER_ENV, p),
            None => std::env::remove_var(CANARY_MARKER_ENV),
        }
    }
}

/// Lines of the marker file (none if it does not exist).
fn marks(marker: &Path) -> Vec<String> {
    match fs::read_to_string(marker) {
        Ok(t) => t.lines().map(str::to_string).collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => panic!("cannot read {}: {e}", marker.display()),
    }
}

#[test]
fn canary_is_opened_only_when_policy_allows() {
    let canary = fixture("canary");
    let markers = tempfile::tempdir().unwrap();
    let loaded = format!("{} loaded", std::process::id());

    // 1. Unpinned under vetted: refused, never opened.
    let tmp = tempfile::tempdir().unwrap();
    let lib = private_copy(&canary, tmp.path());
    let lock = tmp.path().join("ava-plugins.lock");
    let marker = markers.path().join("unpinned");
    set_marker(Some(&marker));
    let reg = load(&host(&[tmp.path()], VettingPolicy::Vetted));
    let row = file_row(&reg, &lib);
    assert_eq!(row.status, Status::Refused);
    assert!(reason(row).starts_with("not pinned in the lock file (sha256 "), "{}", reason(row));
    assert!(row.manifest.is_none());
    assert_eq!(marks(&marker), Vec::<String>::new(), "an unpinned canary was opened under policy vetted");
    assert!(reg.optimizer("canary", "").is_err());

    // 2. Pinned: vetting opens the library (it reads the manifest) ...
    let marker = markers.path().join("vet");
    set_marker(Some(&marker));
    let (pin, _) = vet_file(&lib, &lock).unwrap();
    assert_eq!((pin.name.as_str(), pin.kind.as_str()), ("canary", "optimizer"));
    assert_eq!(marks(&marker), [loaded.as_str()], "vet_file opens the library once");

    // ... and then policy vetted opens it: status vetted, marker present, and it works.
    let marker = markers.path().join("pinned");
    set_marker(Some(&marker));
    let reg = load(&host(&[tmp.path()], VettingPolicy::Vetted));
    let row = file_row(&reg, &lib);
    assert_eq!(row.status, Status::Vetted, "{row:#?}");
    assert_eq!(marks(&marker), [loaded.as_str()], "the pinned canary was opened once");
    let mut opt = reg.optimizer("canary", "").unwrap();
    let mut state = ParamState::new(opt.as_ref(), 2);
    assert!(state.names.is_empty());
    // θ ← θ − lr·(g + λ·θ): 1 − 0.1·(0.5 + 0.1·1), −2 − 0.1·(−1 + 0.1·(−2)).
    let mut w = [1.0f32, -2.0];
    step(opt.as_mut(), &mut w, &[0.5, -1.0], &mut state, 0.1, 0.1).unwrap();
    assert_close(&w, &[0.94, -1.88], "canary θ");
    drop(opt);

    // 3. One byte changed after pinning: modified, never opened, under every policy.
    flip_byte_in(&lib, CANARY_SUMMARY, 0);
    let marker = markers.path().join("modified");
    set_marker(Some(&marker));
    for policy in VettingPolicy::ALL {
        let reg = load(&host(&[tmp.path()], policy));
        let row = file_row(&reg, &lib);
        assert_eq!(row.status, Status::Modified, "policy {policy}");
        let why = reason(row);
        assert!(why.contains(&pin.sha256), "policy {policy}: {why}");
        assert!(why.contains(&common::sha256_file(&lib)), "policy {policy}: {why}");
        assert_eq!(marks(&marker), Vec::<String>::new(), "policy {policy}: a modified canary was opened");
        let err = reg.create(PluginKind::Optimizer, "canary", "").expect_err("a modified plugin cannot be used");
        assert!(matches!(err, HostError::Unusable { .. }), "policy {policy}: {err:?}");
    }

    // Control: the changed file itself still loads when nothing pins it, and then its
    // initializer does run. So the absent marker above means "refused before opening".
    let reg = load(&host_with_lock(&[tmp.path()], VettingPolicy::Open, &markers.path().join("empty.lock")));
    let row = file_row(&reg, &lib);
    assert_eq!(row.status, Status::Loaded);
    assert!(row.manifest.as_ref().unwrap().summary.ends_with("Plain SGD that marks its loading"));
    assert_eq!(marks(&marker), [loaded.as_str()]);

    // 4. Not even under policy open is an unpinned file opened twice by one load: the
    // marker counts exactly the openings.
    let marker = markers.path().join("open");
    set_marker(Some(&marker));
    let other = tempfile::tempdir().unwrap();
    private_copy(&canary, other.path());
    let reg = load(&host(&[other.path()], VettingPolicy::Open));
    assert_eq!(reg.row(PluginKind::Optimizer, "canary").map(|r| r.status), Some(Status::Loaded));
    assert_eq!(marks(&marker), [loaded.as_str()]);
    set_marker(None);
}
