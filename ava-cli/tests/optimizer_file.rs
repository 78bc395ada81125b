//! Every error about a checkpoint's optimizer-state file names the file: one that is not a
//! safetensors file at all (its manifest entry matching, so the hash check passes), and one
//! whose state does not fit the optimizer resumed with.

mod common;

use std::path::Path;

use common::{checkpoint, ok, train_small, usage_error};
use sha2::{Digest, Sha256};

/// Replaces `name` in checkpoint `ckpt` with `bytes`, updating its manifest entry so the
/// checkpoint still verifies: what a writer that wrote a broken file would leave.
fn replace_sealed(ckpt: &Path, name: &str, bytes: &[u8]) {
    std::fs::write(ckpt.join(name), bytes).unwrap();
    let path = ckpt.join("manifest.json");
    let mut manifest: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let sha: String = Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect();
    manifest["files"][name] = serde_json::json!({"sha256": sha, "bytes": bytes.len()});
    std::fs::write(&path, serde_json::to_vec_pretty(&manifest).unwrap()).unwrap();
}

#[test]
fn optimizer_file_errors_name_the_file() {
    let dir = tempfile::tempdir().unwrap();
    ok(train_small(dir.path(), "run", &["--max-steps", "4", "--steps", "2"]));
    let file = Path::new("run").join("checkpoints").join("step-00000002").join("optimizer.safetensors");

    // A state that does not fit another optimizer (sgd with momentum keeps other buffers).
    let sgd = ["--max-steps", "4", "--resume", "latest", "--set", "plugins.optimizer={name: sgd, momentum: 0.9}"];
    let err = usage_error(train_small(dir.path(), "run", &[&sgd[..], &["--force"]].concat()));
    assert!(
        err.contains("optimizer.safetensors: the checkpoint's optimizer state does not match the optimizer"),
        "{err}"
    );
    assert!(err.contains("step-00000002"), "{err}");

    // Not a safetensors file at all.
    replace_sealed(&checkpoint(&dir.path().join("run"), 2), "optimizer.safetensors", b"\x08\0\0\0\0\0\0\0{broken}");
    let err = usage_error(train_small(dir.path(), "run", &["--max-steps", "4", "--resume", "latest"]));
    let at = err.find("optimizer.safetensors: not a valid safetensors file:").unwrap_or_else(|| panic!("{err}"));
    assert!(err[..at].ends_with(&file.display().to_string()) || err[..at].contains("step-00000002"), "{err}");
    assert!(
        err.contains("resume from an older checkpoint, or keep this one's weights with --fresh-optimizer"),
        "{err}"
    );
}
