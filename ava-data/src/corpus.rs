//! Checking a prepared corpus whole: `ava data verify`.

use std::path::Path;

use rayon::prelude::*;

use crate::error::DataError;
use crate::manifest::{Manifest, ShardEntry};
use crate::shard;

/// One shard's verdict.
#[derive(Debug)]
pub struct ShardCheck<'a> {
    /// The manifest's entry.
    pub entry: &'a ShardEntry,
    /// `None` when the shard is as the manifest says.
    pub problem: Option<DataError>,
}

/// Checks every shard of `manifest` (size, header, checksum), in parallel, and returns
/// every verdict in shard order, so all damaged shards are named at once. `done` is called
/// as each shard finishes (in any order), for progress.
pub fn verify_all<'a>(dir: &Path, manifest: &'a Manifest, done: &(dyn Fn(&ShardEntry) + Sync)) -> Vec<ShardCheck<'a>> {
    manifest
        .shards
        .par_iter()
        .map(|entry| {
            let problem = shard::verify(dir, entry, manifest).err();
            done(entry);
            ShardCheck { entry, problem }
        })
        .collect()
}
