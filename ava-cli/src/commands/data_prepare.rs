//! `ava data prepare`: tokenizes a corpus into shards (see `ava_data::prepare`), with a
//! progress bar (MB/s of text, tokens/s) and a summary.

use std::path::PathBuf;
use std::time::Duration;

use ava_data::manifest::ShardEntry;
use ava_data::prepare::{self, PrepareError, PrepareOptions, PrepareReporter, Progress};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;

use crate::cli::PrepareArgs;
use crate::output::{Format, Printer};
use crate::{CmdResult, Failure};

/// Draws the bar on a terminal; otherwise a line per shard.
struct Bar<'a> {
    printer: &'a Printer,
    bar: Option<ProgressBar>,
}

impl PrepareReporter for Bar<'_> {
    fn start(&mut self, total: u64, resumed: Option<(usize, u64)>) {
        if let Some((shards, docs)) = resumed {
            self.printer.note(&format!("continuing: {shards} shards ({docs} documents) were complete"));
        }
        if self.printer.verbosity >= 1 && self.printer.format == Format::Text {
            let bar = ProgressBar::new(total);
            bar.set_style(
                ProgressStyle::with_template("{bar:30} {bytes}/{total_bytes} read  {msg}  eta {eta}")
                    .expect("a valid template"),
            );
            bar.enable_steady_tick(Duration::from_millis(250));
            self.bar = Some(bar);
        }
    }

    fn progress(&mut self, p: &Progress) {
        if let Some(bar) = &self.bar {
            let s = p.elapsed.as_secs_f64().max(1e-9);
            bar.set_position(p.input_bytes);
            bar.set_message(format!(
                "{:.1} MB/s of text, {:.2} M tokens/s, {} documents, {} shards",
                p.text_bytes as f64 / s / 1e6,
                p.tokens as f64 / s / 1e6,
                p.documents,
                p.shards
            ));
        }
    }

    fn shard(&mut self, entry: &ShardEntry) {
        let line = format!(
            "wrote {} ({:.1} MiB, {} + {} tokens)",
            entry.file,
            entry.bytes as f64 / (1 << 20) as f64,
            entry.train.tokens,
            entry.validation.tokens
        );
        match &self.bar {
            Some(bar) if !bar.is_hidden() => bar.println(line),
            _ => self.printer.verbose(&line),
        }
    }
}

pub fn run(p: &Printer, args: &PrepareArgs) -> CmdResult {
    // Nothing here reports memory, and the tokenizers allocate per word on every core.
    ava_train::memory::stop_counting();
    let options = PrepareOptions {
        inputs: args.inputs.clone(),
        out: args.out.clone(),
        tokenizer: args.tokenizer.clone().filter(|t| t.as_os_str() != "byte"),
        eos: args.eos.clone(),
        bos: args.bos.clone(),
        reading: args.reading.reading(),
        val_fraction: args.val_fraction,
        shard_tokens: args.shard_tokens,
        force: args.force,
    };
    let mut bar = Bar { printer: p, bar: None };
    let result = prepare::prepare(&options, &mut bar);
    if let Some(b) = bar.bar.take() {
        b.finish_and_clear();
    }
    let summary = result.map_err(|e| match e {
        // The disk or the system failed, not the input.
        PrepareError::DiskFull { .. } | PrepareError::Write { .. } => Failure::Runtime(anyhow::anyhow!(e)),
        _ => Failure::Usage(anyhow::anyhow!(e)),
    })?;
    for warning in &summary.warnings {
        p.warn(warning);
    }
    let m = &summary.manifest;
    let pr = &summary.progress;
    let secs = pr.elapsed.as_secs_f64().max(1e-9);
    let out: PathBuf = args.out.clone();
    p.result(
        || {
            if summary.already_complete {
                return format!(
                    "{} already holds this corpus ({} documents, {} shards); nothing to do (--force prepares it again)",
                    out.display(),
                    m.documents,
                    m.shards.len()
                );
            }
            let mut lines = vec![format!(
                "prepared {} documents ({} train / {} validation), {} tokens ({} train / {} validation) in {} shards \
                 into {}",
                m.documents,
                m.train.documents,
                m.validation.documents,
                m.train.tokens + m.validation.tokens,
                m.train.tokens,
                m.validation.tokens,
                m.shards.len(),
                out.display()
            )];
            lines.push(format!(
                "this run: {:.1} MB of text in {:.2} s ({:.1} MB/s, {:.2} M tokens/s); {}, vocab {}, {}-byte ids",
                pr.text_bytes as f64 / 1e6,
                secs,
                pr.text_bytes as f64 / secs / 1e6,
                pr.tokens as f64 / secs / 1e6,
                m.tokenizer.describe(),
                m.vocab_size,
                m.id_bytes
            ));
            if summary.skipped_documents > 0 {
                lines.push(format!("left out {} empty or invalid documents", summary.skipped_documents));
            }
            // The model's vocabulary must hold the corpus's ids (the byte tokenizer's 257 is one
            // more than the default model's 256), and the run gets a directory of its own.
            let name = out.file_name().map_or("corpus".into(), |n| n.to_string_lossy().into_owned());
            let words = [
                "ava".to_string(),
                "train".into(),
                "--set".into(),
                "data.source=shards".into(),
                "--set".into(),
                format!("data.path={}", out.display()),
                "--set".into(),
                format!("model.vocab_size={}", m.vocab_size),
                "--set".into(),
                format!("train.out_dir=runs/{name}"),
            ];
            let command: Vec<String> = words.iter().map(|w| super::train::shell_quote(w)).collect();
            lines.push(format!("train on it with: {}", command.join(" ")));
            lines.join("\n")
        },
        || {
            json!({
                "out": out,
                "already_complete": summary.already_complete,
                "resumed": summary.resumed.map(|(s, d)| json!({"shards": s, "documents": d})),
                "documents": m.documents,
                "train": m.train,
                "validation": m.validation,
                "shards": m.shards.len(),
                "text_bytes": pr.text_bytes,
                "seconds": secs,
                "text_mb_per_s": pr.text_bytes as f64 / secs / 1e6,
                "tokens_per_s": pr.tokens as f64 / secs,
                "skipped_documents": summary.skipped_documents,
            })
        },
    );
    Ok(())
}
