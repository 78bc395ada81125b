//! `ava data verify`: checks every shard of a prepared corpus (size, header, checksum) and
//! names every damaged one; exit code 1 if any.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

use ava_data::corpus;
use ava_data::manifest::Manifest;
use serde_json::json;

use crate::output::Printer;
use crate::{CmdResult, Failure};

pub fn run(p: &Printer, dir: &Path) -> CmdResult {
    let m = Manifest::load(dir).map_err(|e| Failure::Usage(anyhow::anyhow!(e)))?;
    let done = AtomicUsize::new(0);
    let total = m.shards.len();
    let checks = corpus::verify_all(dir, &m, &|entry| {
        let n = done.fetch_add(1, Ordering::Relaxed) + 1;
        p.verbose(&format!("[{n}/{total}] {}", entry.file));
    });
    let bad: Vec<(String, String)> =
        checks.iter().filter_map(|c| c.problem.as_ref().map(|e| (c.entry.file.clone(), e.to_string()))).collect();
    let bytes: u64 = m.shards.iter().map(|s| s.bytes).sum();
    p.result(
        || {
            if bad.is_empty() {
                format!(
                    "{}: all {total} shards match their checksums ({:.1} MiB){}",
                    dir.display(),
                    bytes as f64 / (1 << 20) as f64,
                    if m.complete { "" } else { "; the corpus is unfinished: run its prepare again" }
                )
            } else {
                let mut lines = vec![format!("{}: {} of {total} shards are damaged:", dir.display(), bad.len())];
                lines.extend(bad.iter().map(|(_, e)| format!("  {e}")));
                lines.join("\n")
            }
        },
        || json!({ "dir": dir, "shards": total, "bytes": bytes, "complete": m.complete, "damaged": bad.iter().map(|(f, e)| json!({"file": f, "error": e})).collect::<Vec<_>>() }),
    );
    if bad.is_empty() {
        Ok(())
    } else {
        Err(Failure::Runtime(anyhow::anyhow!(
            "{} of {total} shards in {} are damaged: prepare the corpus again, or restore those files",
            bad.len(),
            dir.display()
        )))
    }
}
