//! `ava data info`: a prepared corpus's manifest, summarized.

use std::path::Path;

use ava_data::manifest::Manifest;
use serde_json::json;

use crate::output::Printer;
use crate::{CmdResult, Failure};

pub fn run(p: &Printer, dir: &Path) -> CmdResult {
    let m = Manifest::load(dir).map_err(|e| Failure::Usage(anyhow::anyhow!(e)))?;
    let bytes: u64 = m.shards.iter().map(|s| s.bytes).sum();
    p.result(
        || {
            let mut lines = vec![
                format!(
                    "corpus      {}{}",
                    dir.display(),
                    if m.complete { "" } else { " (unfinished: run its prepare again)" }
                ),
                format!(
                    "tokenizer   {}, vocab {}, {}-byte ids, end of text {}",
                    m.tokenizer.describe(),
                    m.vocab_size,
                    m.id_bytes,
                    m.eos_id
                ),
                format!(
                    "documents   {} ({} train / {} validation, held out by a hash of their index at {})",
                    m.documents, m.train.documents, m.validation.documents, m.val_fraction
                ),
                format!("tokens      {} train / {} validation", m.train.tokens, m.validation.tokens),
                format!(
                    "shards      {} ({} on disk; {} of text read)",
                    m.shards.len(),
                    ava_core::format_size(bytes),
                    ava_core::format_size(m.text_bytes)
                ),
                format!("inputs      {} files; {}", m.inputs.len(), m.reading),
            ];
            if let Some(bos) = m.bos_id {
                lines.push(format!("begin       id {bos} before every document"));
            }
            lines.join("\n")
        },
        || json!({ "dir": dir, "manifest": m, "bytes": bytes }),
    );
    Ok(())
}
