//! Tests of the checkpoint store: safetensors encoding, save/load/list/resolve, a simulated
//! kill at every durable operation of a save, corruption detection, pruning, config diffs.

mod diff;
mod faults;
mod store;
mod tensors;

use std::path::Path;

/// A checkpoint's files for `step`: distinct content per step, one file empty; sorted by
/// name, as a loaded checkpoint lists them.
fn files(step: u64) -> Vec<(String, Vec<u8>)> {
    vec![
        ("empty.bin".into(), Vec::new()),
        ("model.safetensors".into(), format!("model weights of step {step}").repeat(50).into_bytes()),
        ("optimizer.safetensors".into(), (0..=255u8).cycle().take(3000 + step as usize).collect()),
        ("trainer.json".into(), format!("{{\"step\":{step}}}").into_bytes()),
    ]
}

/// The entries of `root` whose names start with `.tmp-` or `.latest.tmp-`.
fn leftovers(root: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".tmp-") || n.starts_with(".latest.tmp-"))
        .collect();
    names.sort();
    names
}
