//! `ava bench data`: the data pipeline's two rates that matter.
//!
//! 1. Preparing: generated English-like text (or `--input`) tokenized into shards with the
//!    byte tokenizer, and with `--tokenizer` also with that tokenizer.json, in MB/s of text;
//!    beside it the Python `tokenizers` package's batch encoding of the same documents with
//!    the same tokenizer, when python3 has it.
//! 2. Streaming: a corpus of `--corpus` bytes of shards written for the benchmark (random
//!    ids, documents of 100–4000 tokens), read by the training loader for `--batches`
//!    batches; the process's resident set after the first batch and at its largest after,
//!    then the same with the corpus listed `--scale` times over (hard links: the same
//!    bytes on disk, `--scale`× the sequences). Everything written is deleted at the end.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use ava_data::manifest::{self, Counts, Manifest, TokenizerId};
use ava_data::prepare::{self, Invalid, PrepareOptions, Reading, Silent};
use ava_data::shard::{self, ShardBuilder};
use ava_data::{Loader, Rng, ShardedDataset, Split, Verify};
use serde_json::{Value, json};

use crate::cli::BenchDataArgs;
use crate::output::Printer;
use crate::{CmdResult, Failure};

/// Resident bytes of this process (Linux /proc; 0 elsewhere).
fn rss_bytes() -> u64 {
    let statm = fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm.split_whitespace().nth(1).and_then(|v| v.parse().ok()).unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
    pages * page
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

/// Writes `mb` MB of English-like text as files of about 4 MB (one document each).
fn write_text(dir: &Path, mb: u64) -> std::io::Result<Vec<PathBuf>> {
    const WORDS: &[&str] = &[
        "the",
        "of",
        "and",
        "to",
        "in",
        "a",
        "is",
        "that",
        "for",
        "it",
        "as",
        "was",
        "with",
        "be",
        "by",
        "on",
        "not",
        "he",
        "this",
        "are",
        "or",
        "his",
        "from",
        "at",
        "which",
        "but",
        "have",
        "an",
        "had",
        "they",
        "you",
        "were",
        "their",
        "one",
        "all",
        "we",
        "can",
        "her",
        "has",
        "there",
        "been",
        "if",
        "more",
        "when",
        "will",
        "would",
        "who",
        "so",
        "no",
        "memory",
        "model",
        "training",
        "language",
        "system",
        "between",
        "through",
        "because",
        "however",
        "different",
        "important",
        "without",
        "government",
        "following",
        "development",
        "information",
    ];
    fs::create_dir_all(dir)?;
    let mut rng = Rng::new(7);
    let mut files = Vec::new();
    let mut written = 0u64;
    let mut i = 0;
    while written < mb * 1_000_000 {
        let mut text = String::with_capacity(4_100_000);
        let mut line = 0;
        while text.len() < 4_000_000 {
            let w = WORDS[rng.below(WORDS.len() as u64) as usize];
            text.push_str(w);
            line += w.len() + 1;
            let r = rng.below(100);
            text.push_str(if line > 80 {
                "\n"
            } else if r < 6 {
                ", "
            } else if r < 10 {
                ". "
            } else {
                " "
            });
            if line > 80 {
                line = 0;
            }
        }
        let path = dir.join(format!("text-{i:04}.txt"));
        fs::write(&path, &text)?;
        written += text.len() as u64;
        files.push(path);
        i += 1;
    }
    Ok(files)
}

/// MB/s of preparing `inputs` with `tokenizer` (None: bytes).
fn prepare_rate(inputs: &[PathBuf], tokenizer: Option<&Path>, out: &Path) -> anyhow::Result<(f64, u64)> {
    let options = PrepareOptions {
        inputs: inputs.to_vec(),
        out: out.to_path_buf(),
        tokenizer: tokenizer.map(Path::to_path_buf),
        eos: None,
        bos: None,
        reading: Reading { separator: None, field: "text".into(), invalid: Invalid::Error },
        val_fraction: 0.005,
        shard_tokens: prepare::DEFAULT_SHARD_TOKENS,
        force: true,
    };
    let start = Instant::now();
    let summary = prepare::prepare(&options, &mut Silent)?;
    let seconds = start.elapsed().as_secs_f64();
    let _ = fs::remove_dir_all(out);
    Ok((
        summary.progress.text_bytes as f64 / seconds / 1e6,
        summary.manifest.train.tokens + summary.manifest.validation.tokens,
    ))
}

/// The Python `tokenizers` package's batch encoding of the same documents: MB/s, or why not.
fn python_rate(inputs: &[PathBuf], tokenizer: &Path) -> Result<f64, String> {
    const SCRIPT: &str = r#"
import sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
docs = [open(p, encoding="utf-8").read() for p in sys.argv[2:]]
encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
start = time.perf_counter()
encode(docs, add_special_tokens=False)
print(sum(len(d.encode("utf-8")) for d in docs) / (time.perf_counter() - start) / 1e6)
"#;
    let out = Command::new("python3")
        .arg("-c")
        .arg(SCRIPT)
        .arg(tokenizer)
        .args(inputs)
        .output()
        .map_err(|e| format!("python3 did not run ({e})"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(format!(
            "python3 failed ({}); pip install tokenizers to compare",
            err.lines().last().unwrap_or("no message")
        ));
    }
    String::from_utf8_lossy(&out.stdout).trim().parse().map_err(|e| format!("unexpected output ({e})"))
}

/// Writes a corpus of about `bytes` bytes of random u16 ids in shards of 2²⁷ ids.
fn write_corpus(dir: &Path, bytes: u64, p: &Printer) -> anyhow::Result<Manifest> {
    fs::create_dir_all(dir)?;
    let mut manifest = Manifest {
        format: manifest::FORMAT.into(),
        version: manifest::VERSION,
        complete: false,
        tokenizer: TokenizerId::Byte,
        vocab_size: 257,
        id_bytes: 2,
        eos_id: 256,
        bos_id: None,
        val_fraction: 0.005,
        shard_tokens: prepare::DEFAULT_SHARD_TOKENS,
        reading: "generated by ava bench data".into(),
        inputs: Vec::new(),
        documents: 0,
        text_bytes: 0,
        train: Counts::default(),
        validation: Counts::default(),
        shards: Vec::new(),
    };
    let mut rng = Rng::new(11);
    let mut builder = ShardBuilder::new(2, 256);
    let mut doc = Vec::new();
    let mut total = 0u64;
    while total < bytes {
        doc.clear();
        let len = 100 + rng.below(3900) as usize;
        doc.extend((0..len).map(|_| rng.below(256) as u32));
        let index = manifest.documents + builder.documents();
        let split = if prepare::is_validation(index, manifest.val_fraction) { Split::Validation } else { Split::Train };
        builder.push(split, &doc);
        total += 2 * (len as u64 + 1);
        if builder.tokens() >= manifest.shard_tokens || total >= bytes {
            let first = manifest.documents;
            let full = std::mem::replace(&mut builder, ShardBuilder::new(2, 256));
            let entry = full.finish(dir, &shard::file_name(manifest.shards.len()), first)?;
            manifest.push(entry, 0);
            p.note(&format!("  wrote {} of {:.1} GiB", manifest.shards.len(), bytes as f64 / (1u64 << 30) as f64));
        }
    }
    manifest.complete = true;
    manifest.save(dir)?;
    Ok(manifest)
}

/// A corpus listing every shard of `base` `times` times, as hard links.
fn scaled_corpus(base: &Path, manifest: &Manifest, dir: &Path, times: usize) -> anyhow::Result<()> {
    fs::create_dir_all(dir)?;
    let mut scaled = Manifest {
        shards: Vec::new(),
        documents: 0,
        train: Counts::default(),
        validation: Counts::default(),
        ..manifest.clone()
    };
    for _ in 0..times {
        for entry in &manifest.shards {
            let file = shard::file_name(scaled.shards.len());
            fs::hard_link(base.join(&entry.file), dir.join(&file))?;
            let first = scaled.documents;
            scaled.push(manifest::ShardEntry { file, first_document: first, ..entry.clone() }, 0);
        }
    }
    scaled.save(dir)?;
    Ok(())
}

/// Streams `batches` batches: (resident bytes after the first, largest after, seconds per batch).
fn stream(dir: &Path, verify: Verify, args: &BenchDataArgs) -> anyhow::Result<(u64, u64, f64, String)> {
    let dataset = Arc::new(ShardedDataset::open_with(dir, None, args.seq_len, 1, verify)?);
    let describe = ava_data::Dataset::describe(&*dataset);
    let mut loader = Loader::new(dataset, Split::Train, args.batch_size, args.seq_len, 0, 1, 2)?;
    loader.next()?;
    let first = rss_bytes();
    let mut most = first;
    let start = Instant::now();
    for i in 1..args.batches {
        loader.next()?;
        if i % 64 == 0 {
            most = most.max(rss_bytes());
        }
    }
    most = most.max(rss_bytes());
    Ok((first, most, start.elapsed().as_secs_f64() / args.batches.saturating_sub(1).max(1) as f64, describe))
}

pub fn run(p: &Printer, args: &BenchDataArgs) -> CmdResult {
    let work = tempfile::Builder::new().prefix("ava-bench-data-").tempdir_in(&args.dir)?;
    let mut report = serde_json::Map::new();
    let mut lines = Vec::new();

    if args.text_mb > 0 {
        let inputs = match &args.input {
            Some(dir) => vec![dir.clone()],
            None => {
                p.note(&format!("writing {} MB of text ...", args.text_mb));
                write_text(&work.path().join("text"), args.text_mb)?
            }
        };
        let listed = ava_data::prepare::input::list(&inputs).map_err(|e| Failure::Usage(anyhow::anyhow!(e)))?;
        let files: Vec<PathBuf> = listed.iter().map(|f| f.path.clone()).collect();
        p.note("preparing with the byte tokenizer ...");
        let (byte_rate, _) = prepare_rate(&inputs, None, &work.path().join("bytes"))?;
        lines.push(format!("prepare, byte tokenizer      {byte_rate:8.1} MB/s of text"));
        report.insert("prepare_byte_mb_per_s".into(), json!(byte_rate));
        if let Some(tok) = &args.tokenizer {
            p.note(&format!("preparing with {} ...", tok.display()));
            let (rate, _) = prepare_rate(&inputs, Some(tok), &work.path().join("bpe"))?;
            lines.push(format!(
                "prepare, {:<20} {rate:8.1} MB/s of text",
                tok.file_name().unwrap_or_default().to_string_lossy()
            ));
            report.insert("prepare_tokenizer_mb_per_s".into(), json!(rate));
            p.note("encoding the same documents with Python tokenizers (encode_batch) ...");
            match python_rate(&files, tok) {
                Ok(py) => {
                    lines.push(format!("python tokenizers batch      {py:8.1} MB/s of text (ava: {:.2}x)", rate / py));
                    report.insert("python_tokenizers_mb_per_s".into(), json!(py));
                }
                Err(why) => {
                    lines.push(format!("python tokenizers batch      not measured: {why}"));
                    report.insert("python_tokenizers".into(), Value::String(why));
                }
            }
        }
    }

    if args.corpus > 0 && args.batches > 0 {
        let base = work.path().join("corpus");
        p.note(&format!("writing a {:.1} GiB corpus of shards ...", args.corpus as f64 / (1u64 << 30) as f64));
        let manifest = write_corpus(&base, args.corpus, p)?;
        p.note(&format!("streaming {} batches of {} x {} ...", args.batches, args.batch_size, args.seq_len + 1));
        let (first, most, per_batch, describe) = stream(&base, Verify::Checksums, args)?;
        let bytes: u64 = manifest.shards.iter().map(|s| s.bytes).sum();
        lines.push(format!("corpus                       {describe}"));
        lines.push(format!(
            "stream {:>6.2} GiB            RSS {:.1} MiB after batch 1, {:.1} MiB at most (+{:.1} MiB); {:.3} ms/batch",
            bytes as f64 / (1u64 << 30) as f64,
            mib(first),
            mib(most),
            mib(most.saturating_sub(first)),
            per_batch * 1e3
        ));
        report.insert(
            "stream".into(),
            json!({"corpus_bytes": bytes, "rss_first": first, "rss_most": most, "seconds_per_batch": per_batch}),
        );
        if args.scale > 1 {
            let scaled = work.path().join("scaled");
            scaled_corpus(&base, &manifest, &scaled, args.scale)?;
            p.note(&format!("streaming the corpus listed {}x over (not re-verified) ...", args.scale));
            let (first, most, per_batch, _) = stream(&scaled, Verify::Sizes, args)?;
            lines.push(format!(
                "stream {:>6.2} GiB ({}x)       RSS {:.1} MiB after batch 1, {:.1} MiB at most (+{:.1} MiB); {:.3} ms/batch",
                (bytes * args.scale as u64) as f64 / (1u64 << 30) as f64,
                args.scale,
                mib(first),
                mib(most),
                mib(most.saturating_sub(first)),
                per_batch * 1e3
            ));
            report.insert(
                "stream_scaled".into(),
                json!({"times": args.scale, "rss_first": first, "rss_most": most, "seconds_per_batch": per_batch}),
            );
        }
    }
    p.result(|| lines.join("\n"), || Value::Object(report.clone()));
    Ok(())
}
