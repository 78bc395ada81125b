//! A manifest's `contract_version` is checked against the host's: the canary fixture declares
//! the contract named by `$AVA_CANARY_CONTRACT`, and a library whose manifest declares another
//! contract is refused when it is loaded, listed or vetted, naming the plugin, its contract
//! and the host's.
//!
//! One test in its own binary: it sets an environment variable, which is process-global.

#![cfg(target_os = "linux")]

mod common;

use ava_plugins::{HostError, Status, VettingPolicy, vet_file};
use ava_tests::fixture;
use common::{file_row, host, load, private_copy, reason};

const CONTRACT_ENV: &str = "AVA_CANARY_CONTRACT";

fn set_contract(contract: Option<u32>) {
    // SAFETY: the only test in this binary; no other thread reads the environment.
    unsafe {
        match contract {
            Some(c) => std::env::set_var(CONTRACT_ENV, c.to_string()),
            None => std::env::remove_var(CONTRACT_ENV),
        }
    }
}

#[test]
fn a_manifest_declaring_another_contract_is_incompatible_everywhere() {
    let tmp = tempfile::tempdir().unwrap();
    let lib = private_copy(&fixture("canary"), tmp.path());
    let lock = tmp.path().join("ava-plugins.lock");
    let host_contract = ava_core::CONTRACT_VERSION;
    let version = "0.1.0"; // tests/fixtures/canary/Cargo.toml

    for (declared, hint) in [
        (host_contract - 1, "the plugin is older than this ava: rebuild it against the current ava-core"),
        (
            (host_contract / 1000 + 1) * 1000,
            "the plugin is newer than this ava: upgrade ava, or rebuild the plugin against this ava's ava-core",
        ),
    ] {
        set_contract(Some(declared));
        let want = format!(
            "{}: optimizer 'canary' {version} declares plugin contract {declared} in its manifest, but this ava \
             speaks contract {host_contract}; {hint}",
            lib.display()
        );
        // Discovery and loading: a row, incompatible, with the reason; the plugin is unusable.
        for policy in [VettingPolicy::Open, VettingPolicy::Warn] {
            let reg = load(&host(&[tmp.path()], policy));
            let row = file_row(&reg, &lib);
            assert_eq!(row.status, Status::Incompatible, "policy {policy}");
            assert_eq!(reason(row), want, "policy {policy}");
            assert!(reg.optimizer("canary", "").is_err());
        }
        // Vetting: refused, and nothing is pinned.
        let err = vet_file(&lib, &lock).unwrap_err();
        assert!(matches!(err, HostError::ManifestContract { .. }), "{err:?}");
        assert_eq!(err.to_string(), want);
        assert!(!lock.exists(), "a refused library was pinned");
    }

    // A contract the host would take (a newer minor) that the library was not built against:
    // the manifest is wrong, and refused as such everywhere.
    set_contract(Some(999));
    let want = format!(
        "{}: optimizer 'canary' {version} declares plugin contract 999 in its manifest, but it was built against \
         ava-core {} (contract {host_contract}): its manifest is wrong",
        lib.display(),
        ava_core_version()
    );
    let reg = load(&host(&[tmp.path()], VettingPolicy::Open));
    let row = file_row(&reg, &lib);
    assert_eq!(row.status, Status::Incompatible);
    assert!(reason(row).starts_with(&want), "{}", reason(row));
    let err = vet_file(&lib, &lock).unwrap_err();
    assert!(matches!(err, HostError::ManifestContract { .. }) && err.to_string().starts_with(&want), "{err}");
    assert!(!lock.exists(), "a refused library was pinned");

    // Control: the host's contract loads and vets.
    set_contract(Some(host_contract));
    let reg = load(&host(&[tmp.path()], VettingPolicy::Open));
    assert_eq!(file_row(&reg, &lib).status, Status::Loaded);
    vet_file(&lib, &lock).unwrap();
    set_contract(None);
}

/// The ava-core version the fixtures build against (the workspace's).
fn ava_core_version() -> String {
    let manifest = ava_tests::repo_root().join("ava-core/Cargo.toml");
    let text = std::fs::read_to_string(manifest).unwrap();
    let line = text.lines().find(|l| l.starts_with("version")).unwrap();
    line.split('"').nth(1).unwrap().to_string()
}
