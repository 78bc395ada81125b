//! Helpers shared by the host's integration tests (`vetting.rs`, `loading.rs`,
//! `canary_vetting.rs`). Each test binary uses a part of them.

#![allow(dead_code)]

use std::{
    fs,
    path::{Path, PathBuf},
};

use ava_core::{DType, Optimizer, ParamInfo, StateBuf, StepContext};
use ava_plugins::{HostConfig, Registry, Row, Source, VettingPolicy};
use sha2::{Digest, Sha256};

/// A host config that searches `dirs` only (no `$AVA_PLUGIN_PATH`, no executable
/// directory), with the lock file `dirs[0]/ava-plugins.lock`.
pub fn host(dirs: &[&Path], policy: VettingPolicy) -> HostConfig {
    host_with_lock(dirs, policy, &dirs[0].join("ava-plugins.lock"))
}

/// Like [`host`], with another lock file.
pub fn host_with_lock(dirs: &[&Path], policy: VettingPolicy, lock: &Path) -> HostConfig {
    HostConfig {
        search_paths: dirs.iter().map(|d| d.to_path_buf()).collect(),
        lock_file: lock.to_path_buf(),
        policy,
        threads: 1,
        ..HostConfig::default()
    }
}

/// Loads a registry, panicking with the error if the load as a whole fails.
pub fn load(config: &HostConfig) -> Registry {
    Registry::load(config).unwrap_or_else(|e| panic!("Registry::load failed: {e}"))
}

/// Copies `lib` into `dir` (see `ava_tests::copy_to_temp`) with mode 0755, so that the
/// test does not depend on the umask the library was built under (policy `vetted` refuses
/// group- or world-writable files).
pub fn private_copy(lib: &Path, dir: &Path) -> PathBuf {
    let copy = ava_tests::copy_to_temp(lib, dir);
    set_mode(&copy, 0o755);
    copy
}

/// `chmod mode path`.
pub fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
        .unwrap_or_else(|e| panic!("chmod {mode:o} {}: {e}", path.display()));
}

/// `dir/name`, created.
pub fn subdir(dir: &Path, name: &str) -> PathBuf {
    let d = dir.join(name);
    fs::create_dir_all(&d).unwrap();
    set_mode(&d, 0o700);
    d
}

/// The row of the library file `path` (panics, listing the rows, if there is none or more
/// than one).
pub fn file_row<'r>(reg: &'r Registry, path: &Path) -> &'r Row {
    let rows: Vec<&Row> = reg.rows().iter().filter(|r| r.source == Source::File(path.to_path_buf())).collect();
    assert_eq!(rows.len(), 1, "expected one row for {}, rows: {:#?}", path.display(), reg.rows());
    rows[0]
}

/// Rows of library files (not built-ins).
pub fn file_rows(reg: &Registry) -> Vec<&Row> {
    reg.rows().iter().filter(|r| matches!(r.source, Source::File(_))).collect()
}

/// The reason of a row, which must have one.
pub fn reason(row: &Row) -> &str {
    row.reason.as_deref().unwrap_or_else(|| panic!("row without a reason: {row:#?}"))
}

/// sha256 of a file, lowercase hex, computed here (independently of the host).
pub fn sha256_file(path: &Path) -> String {
    let bytes = fs::read(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// Changes one byte of `path` inside the (unique) occurrence of `needle` — a string in the
/// library's read-only data, so the file still loads — by flipping the case of its
/// `index`-th byte (an ASCII letter). Returns the text that replaces `needle`.
pub fn flip_byte_in(path: &Path, needle: &str, index: usize) -> String {
    let mut bytes = fs::read(path).unwrap();
    let hits: Vec<usize> =
        bytes.windows(needle.len()).enumerate().filter(|(_, w)| *w == needle.as_bytes()).map(|(i, _)| i).collect();
    assert_eq!(hits.len(), 1, "{needle:?} occurs {} times in {}", hits.len(), path.display());
    let at = hits[0] + index;
    assert!(bytes[at].is_ascii_alphabetic(), "byte {index} of {needle:?} is not a letter");
    bytes[at] ^= 0x20;
    fs::write(path, &bytes).unwrap();
    String::from_utf8(bytes[hits[0]..hits[0] + needle.len()].to_vec()).unwrap()
}

/// One parameter's state, allocated the way the host does: zero-filled f32 buffers of the
/// declared lengths (every optimizer used in these tests declares f32 state).
pub struct ParamState {
    /// Buffer names, in layout order.
    pub names: Vec<String>,
    /// The buffers.
    pub bufs: Vec<Vec<f32>>,
}

impl ParamState {
    /// Asks `opt` for the layout of a 1-d parameter of `n` elements and allocates it.
    pub fn new(opt: &dyn Optimizer, n: usize) -> Self {
        let shape = [n as u64];
        let layout = opt.state_layout(&ParamInfo::new("w", &shape)).unwrap_or_else(|e| panic!("state_layout: {e}"));
        for spec in &layout {
            assert_eq!(spec.dtype, DType::F32, "state buffer {} is not f32", spec.name);
        }
        Self {
            names: layout.iter().map(|s| s.name.to_string()).collect(),
            bufs: layout.iter().map(|s| vec![0.0f32; s.len as usize]).collect(),
        }
    }
}

/// Calls `opt.step` once on `w` with gradient `g`.
pub fn step(
    opt: &mut dyn Optimizer,
    w: &mut [f32],
    g: &[f32],
    state: &mut ParamState,
    lr: f64,
    wd: f64,
) -> Result<(), ava_core::PluginError> {
    let shape = [w.len() as u64];
    let info = ParamInfo::new("w", &shape);
    let ctx = StepContext { step: 1, lr, weight_decay: wd, threads: 1, grad_scale: 1.0 };
    let mut bufs: Vec<StateBuf<'_>> =
        state.bufs.iter_mut().map(|b| StateBuf::new(DType::F32, bytemuck::cast_slice_mut(b))).collect();
    opt.step(&info, w, g, &mut bufs, &ctx)
}

/// Asserts two float slices agree to 1e-6.
pub fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: {got:?} vs {want:?}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() < 1e-6, "{what}[{i}] = {g}, want {w} (all: {got:?})");
    }
}
