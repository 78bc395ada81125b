//! Loading dynamic plugins: several libraries in one process, duplicates, libraries built
//! against another contract (or for another application), panics and option errors that
//! cross the boundary.
//!
//! Every test works in its own private temporary directory and searches only that.

#![cfg(target_os = "linux")]

mod common;

use std::fs;

use ava_core::{ErrorKind, OptionType, PluginKind};
use ava_plugins::{HostError, Status, VettingPolicy, open_file};
use ava_tests::{fixture, workspace_plugin};
use common::{ParamState, assert_close, file_row, file_rows, host, load, private_copy, reason, step};

/// Two different plugin libraries in one process each answer with their own manifest and
/// their own code: the host does not go through abi_stable's one-library-per-root-type cache
/// (which would hand out the first library for every file).
#[test]
fn two_plugins_in_one_process_keep_their_own_manifest_and_code() {
    let tmp = tempfile::tempdir().unwrap();
    let lion_path = private_copy(&workspace_plugin("lion"), tmp.path());
    let sign_path = private_copy(&fixture("sign-sgd"), tmp.path());
    let reg = load(&host(&[tmp.path()], VettingPolicy::Open));

    assert_eq!(file_rows(&reg).len(), 2, "{:#?}", reg.rows());
    assert!(reg.warnings().is_empty(), "{:?}", reg.warnings());
    let names = reg.names(PluginKind::Optimizer);
    assert!(names.iter().any(|n| n == "lion") && names.iter().any(|n| n == "sign-sgd"), "{names:?}");

    let lion_row = file_row(&reg, &lion_path);
    assert_eq!(lion_row.status, Status::Loaded);
    assert_eq!(lion_row.reason, None);
    let m = lion_row.manifest.as_ref().expect("lion was opened");
    assert_eq!((m.name.as_str(), m.kind, m.version.as_str()), ("lion", PluginKind::Optimizer, "0.1.0"));
    assert!(m.summary.starts_with("Lion: sign of interpolated momentum"), "{}", m.summary);
    let opts: Vec<(&str, OptionType, &str)> =
        m.options.iter().map(|o| (o.name.as_str(), o.ty, o.default.as_str())).collect();
    assert_eq!(opts, [("betas", OptionType::FloatList, "[0.9, 0.99]")]);
    assert_eq!(lion_row.sha256.as_deref(), Some(common::sha256_file(&lion_path).as_str()));

    let sign_row = file_row(&reg, &sign_path);
    assert_eq!(sign_row.status, Status::Loaded);
    let m = sign_row.manifest.as_ref().expect("sign-sgd was opened");
    assert_eq!((m.name.as_str(), m.kind, m.version.as_str()), ("sign-sgd", PluginKind::Optimizer, "0.1.0"));
    assert!(m.summary.starts_with("signSGD with momentum"), "{}", m.summary);
    let opts: Vec<(&str, OptionType, &str)> =
        m.options.iter().map(|o| (o.name.as_str(), o.ty, o.default.as_str())).collect();
    assert_eq!(opts, [("momentum", OptionType::Float, "0.9")]);
    assert_eq!(sign_row.sha256.as_deref(), Some(common::sha256_file(&sign_path).as_str()));

    // Lion, one step by hand (β = 0.9, 0.99; lr = 0.1; λ = 0; m = 0):
    // c = 0.1·g → sign(g); θ = θ − 0.1·sign(g); m = 0.01·g.
    let mut lion = reg.optimizer("lion", "").unwrap();
    let mut lion_state = ParamState::new(lion.as_ref(), 3);
    assert_eq!(lion_state.names, ["exp_avg"]);
    let mut w = [1.0f32, 1.0, 1.0];
    step(lion.as_mut(), &mut w, &[0.3, -0.2, 0.0], &mut lion_state, 0.1, 0.0).unwrap();
    assert_close(&w, &[0.9, 1.1, 1.0], "lion θ");
    assert_close(&lion_state.bufs[0], &[0.003, -0.002, 0.0], "lion m");

    // sign-sgd (Signum, β = 0.9 by default), the same step: m = 0.1·g; θ = θ − 0.1·sign(m).
    // Same θ, but a momentum ten times Lion's: each library ran its own code.
    let mut sign = reg.optimizer("sign-sgd", "").unwrap();
    let mut sign_state = ParamState::new(sign.as_ref(), 3);
    assert_eq!(sign_state.names, ["momentum"]);
    let mut w = [1.0f32, 1.0, 1.0];
    step(sign.as_mut(), &mut w, &[0.3, -0.2, 0.0], &mut sign_state, 0.1, 0.0).unwrap();
    assert_close(&w, &[0.9, 1.1, 1.0], "sign-sgd θ");
    assert_close(&sign_state.bufs[0], &[0.03, -0.02, 0.0], "sign-sgd m");

    // With its option, through the boundary: momentum 0 is plain signSGD without state,
    // and weight decay is decoupled: θ·(1 − 0.1·0.5) − 0.1·sign(g).
    let mut plain = reg.optimizer("sign-sgd", r#"{"momentum": 0}"#).unwrap();
    let mut plain_state = ParamState::new(plain.as_ref(), 2);
    assert!(plain_state.names.is_empty());
    let mut w = [2.0f32, -2.0];
    step(plain.as_mut(), &mut w, &[-5.0, 0.5], &mut plain_state, 0.1, 0.5).unwrap();
    assert_close(&w, &[2.0 * 0.95 + 0.1, -2.0 * 0.95 - 0.1], "plain signSGD θ");

    // The first instance is still Lion after the others were made.
    let mut w = [1.0f32, 1.0, 1.0];
    step(lion.as_mut(), &mut w, &[0.3, -0.2, 0.0], &mut lion_state, 0.1, 0.0).unwrap();
    assert_close(&lion_state.bufs[0], &[0.99 * 0.003 + 0.003, 0.99 * -0.002 - 0.002, 0.0], "lion m, step 2");
}

/// The same library in two search directories: the first wins the name, the second is
/// refused, and any use of the name is an error naming both files — a stale copy is never
/// picked silently.
#[test]
fn same_library_in_two_directories_is_a_duplicate() {
    let tmp = tempfile::tempdir().unwrap();
    let a = common::subdir(tmp.path(), "a");
    let b = common::subdir(tmp.path(), "b");
    let first = private_copy(&workspace_plugin("lion"), &a);
    let second = private_copy(&workspace_plugin("lion"), &b);
    let reg = load(&host(&[&a, &b], VettingPolicy::Open));

    assert_eq!(file_rows(&reg).len(), 2, "{:#?}", reg.rows());
    assert_eq!(file_row(&reg, &first).status, Status::Loaded);
    let dup = file_row(&reg, &second);
    assert_eq!(dup.status, Status::Refused);
    assert_eq!(dup.name(), Some("lion"));
    assert_eq!(reason(dup), format!("optimizer 'lion' is already defined by {}", first.display()));

    let err = reg.optimizer("lion", "").err().expect("a duplicate name cannot be used");
    let HostError::Duplicate { kind, name, first: f, second: s } = &err else { panic!("not Duplicate: {err:?}") };
    assert_eq!((*kind, name.as_str()), (PluginKind::Optimizer, "lion"));
    assert_eq!((f.as_str(), s.as_str()), (first.to_str().unwrap(), second.to_str().unwrap()));
    assert_eq!(
        err.to_string(),
        format!(
            "optimizer 'lion' is defined twice: by {} and by {}; remove one of them from the search paths",
            first.display(),
            second.display()
        )
    );
    // Other plugins are unaffected.
    reg.optimizer("adamw", "").unwrap();
}

/// A library built against ava-core 0.0.9: a row with status incompatible and a reason
/// naming the file and both versions; `open_file` gives the typed error.
#[test]
fn old_contract_is_incompatible() {
    let tmp = tempfile::tempdir().unwrap();
    let lib = private_copy(&fixture("old-contract"), tmp.path());
    let reg = load(&host(&[tmp.path()], VettingPolicy::Open));
    let row = file_row(&reg, &lib);
    assert_eq!(row.status, Status::Incompatible);
    assert!(row.manifest.is_none());
    let expected = format!(
        "{}: built against Ava plugin contract 0 (ava-core 0.0.9), but this ava speaks contract 3 (ava-core 0.3.0); \
         the plugin is older than this ava: rebuild it against the current ava-core",
        lib.display()
    );
    assert_eq!(reason(row), expected);

    let err = open_file(&lib).unwrap_err();
    match &err {
        HostError::ContractVersion { path, found, found_crate, expected, expected_crate, .. } => {
            assert_eq!(path, &lib);
            assert_eq!((*found, found_crate.as_str()), (0, "0.0.9"));
            assert_eq!((*expected, expected_crate.as_str()), (ava_core::CONTRACT_VERSION, "0.3.0"));
        }
        other => panic!("not ContractVersion: {other:?}"),
    }
    assert_eq!(err.to_string(), expected);
}

/// Same contract version, another root-module layout: incompatible, with a short reason
/// (abi_stable's report is pages long).
#[test]
fn changed_layout_is_incompatible_with_a_short_reason() {
    let tmp = tempfile::tempdir().unwrap();
    let lib = private_copy(&fixture("changed-layout"), tmp.path());
    let reg = load(&host(&[tmp.path()], VettingPolicy::Open));
    let row = file_row(&reg, &lib);
    assert_eq!(row.status, Status::Incompatible);
    let why = reason(row);
    // abi_stable's first complaint: the root module type comes from another crate than
    // ava-core (the fixture defines its own `PluginRoot`).
    let summary = "mismatched package: expected ava-core, found ava-fixture-changed-layout";
    assert_eq!(
        why,
        format!(
            "{}: its plugin interface does not match this ava's ({summary}); \
             rebuild the plugin against the ava-core this ava was built with",
            lib.display()
        )
    );
    assert_eq!(why.lines().count(), 1, "{why}");
    assert!(why.chars().count() <= lib.as_os_str().len() + 300, "{} chars: {why}", why.chars().count());

    let err = open_file(&lib).unwrap_err();
    let HostError::LayoutMismatch { path, summary: s } = &err else { panic!("not LayoutMismatch: {err:?}") };
    assert_eq!((path, s.as_str()), (&lib, summary));
    assert_eq!(err.to_string(), why);
}

/// Another application's abi_stable library (same header symbol, same version string):
/// "not an Ava plugin", not a version or layout complaint.
#[test]
fn foreign_abi_is_not_an_ava_plugin() {
    let tmp = tempfile::tempdir().unwrap();
    let lib = private_copy(&fixture("foreign-abi"), tmp.path());
    let reg = load(&host(&[tmp.path()], VettingPolicy::Open));
    let row = file_row(&reg, &lib);
    assert_eq!(row.status, Status::Incompatible);
    let expected = format!(
        "{}: not an Ava plugin: it is an abi_stable library of another application (root module 'some_other_app')",
        lib.display()
    );
    assert_eq!(reason(row), expected);

    let err = open_file(&lib).unwrap_err();
    assert!(matches!(&err, HostError::NotAPlugin { path, .. } if path == &lib), "{err:?}");
    assert_eq!(err.to_string(), expected);
}

/// A file with the library suffix that is not a library is not a plugin candidate: no row,
/// no warning. Asked for explicitly, it is "not an Ava plugin".
#[test]
fn non_library_file_is_ignored_by_discovery() {
    let tmp = tempfile::tempdir().unwrap();
    let junk = tmp.path().join(format!("{}junk{}", std::env::consts::DLL_PREFIX, std::env::consts::DLL_SUFFIX));
    fs::write(&junk, b"#!/bin/sh\necho this is not a library\n").unwrap();
    let lion = private_copy(&workspace_plugin("lion"), tmp.path());
    let reg = load(&host(&[tmp.path()], VettingPolicy::Vetted));

    let rows = file_rows(&reg);
    assert_eq!(rows.len(), 1, "{rows:#?}");
    assert_eq!(rows[0].source, ava_plugins::Source::File(lion));
    assert!(reg.warnings().is_empty(), "{:?}", reg.warnings());

    let err = open_file(&junk).unwrap_err();
    let HostError::NotAPlugin { path, reason } = &err else { panic!("not NotAPlugin: {err:?}") };
    assert_eq!(path, &junk);
    assert!(reason.starts_with("not a shared library this platform can read"), "{reason}");
    assert!(err.to_string().starts_with(&format!("{}: not an Ava plugin: ", junk.display())), "{err}");
}

/// All the incompatible fixtures together with working plugins in one directory: each
/// gets its row, nothing panics or aborts, and the working plugins still load.
#[test]
fn incompatible_libraries_do_not_stop_the_others() {
    let tmp = tempfile::tempdir().unwrap();
    for name in ["old-contract", "changed-layout", "foreign-abi", "sign-sgd"] {
        private_copy(&fixture(name), tmp.path());
    }
    let lion = private_copy(&workspace_plugin("lion"), tmp.path());
    let reg = load(&host(&[tmp.path()], VettingPolicy::Open));
    // Files are considered in name order.
    let statuses: Vec<(String, Status)> = file_rows(&reg)
        .iter()
        .map(|r| {
            let ava_plugins::Source::File(p) = &r.source else { unreachable!() };
            (p.file_name().unwrap().to_string_lossy().into_owned(), r.status)
        })
        .collect();
    assert_eq!(
        statuses,
        [
            ("libava_fixture_changed_layout.so".to_string(), Status::Incompatible),
            ("libava_fixture_foreign_abi.so".to_string(), Status::Incompatible),
            ("libava_fixture_old_contract.so".to_string(), Status::Incompatible),
            ("libava_plugin_lion.so".to_string(), Status::Loaded),
            ("libava_plugin_sign_sgd.so".to_string(), Status::Loaded),
        ]
    );
    assert_eq!(file_row(&reg, &lion).name(), Some("lion"));
    reg.optimizer("lion", "").unwrap();
    reg.optimizer("sign-sgd", "").unwrap();
}

/// A panic inside a plugin's `step` is caught at the boundary and reaches the host as an
/// error; the process goes on and other plugins still work.
#[test]
fn panic_in_step_becomes_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    private_copy(&fixture("panicky"), tmp.path());
    private_copy(&workspace_plugin("lion"), tmp.path());
    let reg = load(&host(&[tmp.path()], VettingPolicy::Open));

    let mut panicky = reg.optimizer("panicky", "").unwrap();
    let mut state = ParamState::new(panicky.as_ref(), 4);
    assert_eq!(state.names, ["scratch"]);
    let mut w = [1.0f32; 4];
    let err = step(panicky.as_mut(), &mut w, &[0.5; 4], &mut state, 0.1, 0.0).unwrap_err();
    assert_eq!(err.kind, ErrorKind::Panicked);
    let text = err.to_string();
    assert!(text.contains("panicked"), "{text}");
    assert!(text.contains("panicky fixture: deliberate panic in step"), "{text}");
    assert_eq!(w, [1.0; 4], "values changed by a step that panicked");

    // Again: the plugin object is still usable after a caught panic.
    let err2 = step(panicky.as_mut(), &mut w, &[0.5; 4], &mut state, 0.1, 0.0).unwrap_err();
    assert_eq!(err2.to_string(), text);

    let mut lion = reg.optimizer("lion", "").unwrap();
    let mut lion_state = ParamState::new(lion.as_ref(), 1);
    let mut w = [1.0f32];
    step(lion.as_mut(), &mut w, &[0.3], &mut lion_state, 0.1, 0.0).unwrap();
    assert_close(&w, &[0.9], "lion θ after the panic");
}

/// Option problems reported by a dynamic plugin reach the host all at once, as
/// `HostError::Plugin` naming the plugin and its file.
#[test]
fn option_errors_cross_the_boundary_all_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let lion = private_copy(&workspace_plugin("lion"), tmp.path());
    let reg = load(&host(&[tmp.path()], VettingPolicy::Open));

    let err = reg.optimizer("lion", r#"{"betas": [1.5], "bogus": 1}"#).err().expect("bad options are refused");
    let HostError::Plugin { plugin, kind, source_desc, error } = &err else { panic!("not Plugin: {err:?}") };
    assert_eq!((plugin.as_str(), *kind, source_desc.as_str()), ("lion", PluginKind::Optimizer, lion.to_str().unwrap()));
    assert_eq!(error.kind, ErrorKind::InvalidOptions);
    assert_eq!(
        error.details().collect::<Vec<_>>(),
        [
            "unknown option 'bogus' (known: betas)",
            "option 'betas': expected 2 values [β1, β2], got 1",
            "option 'betas': β1 = 1.5 must be in [0, 1)",
        ]
    );
    assert_eq!(
        err.to_string(),
        format!(
            "optimizer 'lion' ({}): {}\n  - unknown option 'bogus' (known: betas)\n  - option 'betas': expected 2 values [β1, β2], got 1\n  - option 'betas': β1 = 1.5 must be in [0, 1)",
            lion.display(),
            error.message
        )
    );
    assert_eq!(
        reg.check_options(PluginKind::Optimizer, "lion", r#"{"betas": [1.5], "bogus": 1}"#).unwrap_err(),
        [
            "unknown option 'bogus' (known: betas)",
            "option 'betas': expected 2 values [β1, β2], got 1",
            "option 'betas': β1 = 1.5 must be in [0, 1)",
        ]
    );
    // A wrong type is refused by the host-side parser even before the plugin's checks.
    let err = reg.optimizer("lion", r#"{"betas": "fast"}"#).err().expect("wrong type is refused");
    assert!(matches!(err, HostError::Plugin { .. }), "{err:?}");
    // And good options work.
    reg.optimizer("lion", r#"{"betas": [0.95, 0.98]}"#).unwrap();
}
