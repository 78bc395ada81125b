//! The canary fixture really marks its loading: `dlopen` alone (no Ava code) appends
//! `"<pid> loaded"` to `$AVA_CANARY_MARKER`, and writes nothing when the variable is unset.
//! This is what makes the host's "refused before opening, marker absent" tests meaningful.
//!
//! One test in its own binary: it sets an environment variable, which must not race with
//! other threads.

#![cfg(target_os = "linux")]

use std::{
    ffi::CString,
    os::unix::ffi::OsStrExt,
    path::{Path, PathBuf},
};

use ava_tests::{CANARY_MARKER_ENV, copy_to_temp, fixture};

fn dlopen(lib: &Path) -> *mut libc::c_void {
    let c = CString::new(lib.as_os_str().as_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path; the canary's initializer only writes a file.
    let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    assert!(!handle.is_null(), "dlopen {} failed", lib.display());
    handle
}

#[test]
fn canary_writes_its_marker_when_opened() {
    let canary = fixture("canary");
    let tmp = tempfile::tempdir().unwrap();
    let marker = tmp.path().join("marker");

    // SAFETY: the only test in this binary, run before any thread that reads the environment.
    unsafe { std::env::set_var(CANARY_MARKER_ENV, &marker) };
    let first = copy_to_temp(&canary, &subdir(tmp.path(), "a"));
    assert!(!marker.exists(), "marker written before the library was opened");
    let h1 = dlopen(&first);
    let text = std::fs::read_to_string(&marker).expect("opening the canary writes the marker");
    assert_eq!(text, format!("{} loaded\n", std::process::id()));

    // A second file is a second library: its initializer runs again, without the variable.
    // SAFETY: as above.
    unsafe { std::env::remove_var(CANARY_MARKER_ENV) };
    let second = copy_to_temp(&canary, &subdir(tmp.path(), "b"));
    let h2 = dlopen(&second);
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), text, "marker written with the variable unset");

    // SAFETY: handles from dlopen above; nothing from the libraries is in use.
    unsafe {
        libc::dlclose(h2);
        libc::dlclose(h1);
    }
}

/// `dir/name`, created: each copy of the library gets a directory of its own.
fn subdir(dir: &Path, name: &str) -> PathBuf {
    let d = dir.join(name);
    std::fs::create_dir_all(&d).unwrap();
    d
}
