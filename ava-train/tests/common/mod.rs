//! What several of ava-train's integration tests share.

use std::path::Path;

use ava_train::config::{Config, ConfigLoader};

/// The tiny model the trainer tests run (2 blocks of width 32, two heads and one kv head,
/// 32-token sequences, no loader workers), its run directory `out`, with `sets` on top.
pub fn tiny_config(out: &Path, sets: &[&str]) -> Config {
    let out_dir = format!("train.out_dir={}", out.display());
    let base = [
        "model.hidden_size=32",
        "model.intermediate_size=64",
        "model.num_heads=2",
        "model.num_kv_heads=1",
        "model.num_layers=2",
        "data.seq_len=32",
        "data.num_workers=0",
        out_dir.as_str(),
    ];
    ConfigLoader::new().sets(base.iter().chain(sets).copied()).load().unwrap().into_config()
}
