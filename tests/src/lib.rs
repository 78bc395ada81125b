//! Shared helpers for the integration tests.
//!
//! Two sets of plugin libraries are built on demand, once per test process:
//!
//! - the **fixtures** ([`fixtures_dir`], [`fixture`]): the separate cargo workspace in
//!   `tests/fixtures/` (a canary that marks its loading, a panicking optimizer, libraries
//!   built against an old or a changed contract, a foreign abi_stable library, and the
//!   out-of-tree example `sign-sgd`), built into `target/fixtures/`;
//! - the **workspace plugins** ([`workspace_plugins_dir`], [`workspace_plugin`]): every
//!   crate under `plugins/`, built into the main target directory.
//!
//! `cargo test` releases its build lock before it runs the tests, so building from inside a
//! test does not deadlock. Tests that modify a library (flip bytes, ...) work on a copy
//! made with [`copy_to_temp`].

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
    sync::OnceLock,
};

/// The fixture crates, by directory name under `tests/fixtures/`.
pub const FIXTURES: [&str; 6] = ["canary", "panicky", "old-contract", "changed-layout", "foreign-abi", "sign-sgd"];

/// The environment variable the `canary` fixture reads at load time: when set, opening the
/// library appends `"<pid> loaded"` to the file it names.
pub const CANARY_MARKER_ENV: &str = "AVA_CANARY_MARKER";

/// The repository root (the main workspace).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ has a parent").to_path_buf()
}

/// The cargo that runs the tests (`$CARGO`), or `cargo` from `PATH`.
fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

/// Runs a cargo build, panicking with its full output if it fails.
fn run_build(mut cmd: Command, what: &str) {
    let out = cmd.output().unwrap_or_else(|e| panic!("cannot run cargo to build {what}: {e} ({cmd:?})"));
    if !out.status.success() {
        panic!(
            "building {what} failed ({}): {cmd:?}\n--- stderr ---\n{}\n--- stdout ---\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout)
        );
    }
}

/// Builds the fixture workspace (`tests/fixtures/`) once per process into
/// `<repo>/target/fixtures` and returns the directory holding the libraries
/// (`<repo>/target/fixtures/debug`). Panics with cargo's output if the build fails.
///
/// The fixtures never share the main target directory (whatever `CARGO_TARGET_DIR` says),
/// so they never end up next to the `ava` binary, where the host would discover them.
pub fn fixtures_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let root = repo_root();
        let target = root.join("target").join("fixtures");
        let mut cmd = cargo();
        cmd.arg("build")
            .arg("--manifest-path")
            .arg(root.join("tests").join("fixtures").join("Cargo.toml"))
            .arg("--target-dir")
            .arg(&target);
        run_build(cmd, "the test fixtures (tests/fixtures)");
        target.join("debug")
    })
    .clone()
}

/// The library of fixture `name` (a directory under `tests/fixtures/`, see [`FIXTURES`]),
/// e.g. `fixture("canary")` → `.../target/fixtures/debug/libava_fixture_canary.so`.
/// Builds the fixtures first if needed.
pub fn fixture(name: &str) -> PathBuf {
    let manifest = repo_root().join("tests").join("fixtures").join(name).join("Cargo.toml");
    assert!(manifest.is_file(), "no fixture '{name}' (known: {})", FIXTURES.join(", "));
    fixtures_dir().join(library_file_name(&manifest))
}

/// Builds fixture `name` alone with its cargo `features` (e.g. `["cuda"]`) into
/// `<repo>/target/<target>` and returns its library there (`.../debug/lib….so`). Panics with
/// cargo's output if the build fails.
///
/// A target directory of its own (not [`fixtures_dir`]'s), so the fixtures the other tests
/// load keep their default features and are not rebuilt.
pub fn fixture_with_features(name: &str, features: &[&str], target: &str) -> PathBuf {
    let root = repo_root();
    let manifest = root.join("tests").join("fixtures").join(name).join("Cargo.toml");
    assert!(manifest.is_file(), "no fixture '{name}' (known: {})", FIXTURES.join(", "));
    let target = root.join("target").join(target);
    let mut cmd = cargo();
    cmd.arg("build")
        .arg("--manifest-path")
        .arg(root.join("tests").join("fixtures").join("Cargo.toml"))
        .arg("--target-dir")
        .arg(&target)
        .arg("-p")
        .arg(package_name(&manifest))
        .arg("--features")
        .arg(features.join(","));
    run_build(cmd, &format!("fixture '{name}' with features {features:?}"));
    target.join("debug").join(library_file_name(&manifest))
}

/// The main target directory: `$CARGO_TARGET_DIR` when set, else `<repo>/target`.
pub fn main_target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) if !dir.is_empty() => {
            let dir = PathBuf::from(dir);
            if dir.is_absolute() { dir } else { repo_root().join(dir) }
        }
        _ => repo_root().join("target"),
    }
}

/// Package names of the crates under `plugins/`, sorted, read from their `Cargo.toml`.
pub fn workspace_plugin_packages() -> Vec<String> {
    let dir = repo_root().join("plugins");
    let mut names: Vec<String> = fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
        .filter_map(|entry| {
            let manifest = entry.ok()?.path().join("Cargo.toml");
            manifest.is_file().then(|| package_name(&manifest))
        })
        .collect();
    names.sort();
    names
}

/// Builds every crate under `plugins/` (`cargo build -p ava-plugin-lion -p ... -p ava-cli`)
/// once per process into the main target directory ([`main_target_dir`]) and returns the directory
/// holding the libraries (`<target>/debug`). Panics with cargo's output if the build fails.
pub fn workspace_plugins_dir() -> PathBuf {
    workspace_plugins_dir_with(&[])
}

/// [`workspace_plugins_dir`] for a test built with cargo `features` (e.g. `ava-cli/mpi`):
/// the `ava` binary the same build makes is the one the test runs, so it must have them.
/// One feature set per test process.
pub fn workspace_plugins_dir_with(features: &[&str]) -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let root = repo_root();
        let target = main_target_dir();
        let packages = workspace_plugin_packages();
        assert!(!packages.is_empty(), "no plugin crates under {}", root.join("plugins").display());
        let mut cmd = cargo();
        cmd.arg("build").arg("--manifest-path").arg(root.join("Cargo.toml")).arg("--target-dir").arg(&target);
        for p in &packages {
            cmd.arg("-p").arg(p);
        }
        // With the ava binary in the same build, the plugins' dependencies (serde, half,
        // gemm, ...) get the features `cargo test --workspace` resolved for them (candle's
        // among them), so this build reuses the test build's artifacts. Alone, the plugins
        // resolved other features and recompiled ~40 crates, a minute or two of CI.
        cmd.arg("-p").arg("ava-cli");
        if !features.is_empty() {
            cmd.arg("--features").arg(features.join(","));
        }
        run_build(cmd, &format!("the workspace plugins ({})", packages.join(", ")));
        target.join("debug")
    })
    .clone()
}

/// The library of workspace plugin `name` (a directory under `plugins/`), e.g.
/// `workspace_plugin("lion")` → `<target>/debug/libava_plugin_lion.so`. Builds the
/// workspace plugins first if needed.
pub fn workspace_plugin(name: &str) -> PathBuf {
    let manifest = repo_root().join("plugins").join(name).join("Cargo.toml");
    assert!(manifest.is_file(), "no plugin crate plugins/{name}");
    workspace_plugins_dir().join(library_file_name(&manifest))
}

/// Copies `lib` into `dir` under its own file name and returns the copy's path; tests that
/// corrupt or re-pin a library work on such copies.
pub fn copy_to_temp(lib: &Path, dir: &Path) -> PathBuf {
    let name = lib.file_name().unwrap_or_else(|| panic!("{} has no file name", lib.display()));
    let dest = dir.join(name);
    fs::copy(lib, &dest).unwrap_or_else(|e| panic!("cannot copy {} to {}: {e}", lib.display(), dest.display()));
    dest
}

/// `[package] name` of a crate manifest.
fn package_name(manifest: &Path) -> String {
    let doc = read_manifest(manifest);
    doc.get("package")
        .and_then(|p| p.get("name"))
        .and_then(|n| n.as_str())
        .unwrap_or_else(|| panic!("{} has no [package] name", manifest.display()))
        .to_string()
}

/// File name of the dynamic library a crate builds: `[lib] name`, or the package name with
/// `-` → `_`, between the platform's prefix and suffix (`lib….so` on Linux).
fn library_file_name(manifest: &Path) -> String {
    let doc = read_manifest(manifest);
    let lib_name = match doc.get("lib").and_then(|l| l.get("name")).and_then(|n| n.as_str()) {
        Some(n) => n.to_string(),
        None => package_name(manifest).replace('-', "_"),
    };
    format!("{}{lib_name}{}", std::env::consts::DLL_PREFIX, std::env::consts::DLL_SUFFIX)
}

fn read_manifest(manifest: &Path) -> toml::Table {
    let text = fs::read_to_string(manifest).unwrap_or_else(|e| panic!("cannot read {}: {e}", manifest.display()));
    text.parse().unwrap_or_else(|e| panic!("{} is not valid TOML: {e}", manifest.display()))
}

/// A tmpfs of a given size mounted on a fresh temporary directory, for tests of a full
/// disk; unmounted on drop. Mounting needs root: where the machine forbids it, [`mount`]
/// prints why the test is skipped and returns `None`.
///
/// [`mount`]: SmallDisk::mount
pub struct SmallDisk(tempfile::TempDir);

impl SmallDisk {
    /// Mounts a tmpfs of `size` (as `mount -o size=` takes it: `256k`, `1m`).
    pub fn mount(size: &str) -> Option<Self> {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .output();
        match out {
            Ok(o) if o.status.success() => Some(Self(dir)),
            Ok(o) => {
                eprintln!(
                    "SKIPPED: cannot mount a {size} tmpfs for a full-disk test (needs root): {}",
                    String::from_utf8_lossy(&o.stderr).trim()
                );
                None
            }
            Err(e) => {
                eprintln!("SKIPPED: cannot run mount for a full-disk test: {e}");
                None
            }
        }
    }

    /// Where it is mounted.
    pub fn path(&self) -> &Path {
        self.0.path()
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.0.path()).status();
    }
}
