//! `ava bench data`: the data pipeline's two rates that matter.
//!
//! 1. Preparing: generated English-like text (or `--input`) tokenized into shards with the
//!    byte tokenizer, and with `--tokenizer` also with that tokenizer.json, in MB/s of text
//!    and naming the encoder that ran (ava's byte-level BPE, or the `tokenizers` crate and
//!    why); beside it the Python `tokenizers` package's batch encoding of the same documents
//!    with the same tokenizer, when python3 has it (for `--input`, the documents prepare
//!    read, `--separator` and `--field` included, handed to Python as JSONL).
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

/// Resident bytes of this process, and of them those mapped from files (Linux /proc; 0
/// elsewhere).
fn rss_bytes() -> (u64, u64) {
    let status = fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    };
    (field("VmRSS:"), field("RssFile:"))
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

/// Writes `mb` MB of English-like text as JSONL files of about 4 MB, documents of 1–8 KB
/// under "text" (the shape of a dataset hub's dump).
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
    while written < mb * 1_000_000 {
        let mut jsonl = String::with_capacity(4_200_000);
        while jsonl.len() < 4_000_000 {
            let target = 1000 + rng.below(7000) as usize;
            let (mut doc, mut line) = (String::with_capacity(target + 100), 0);
            while doc.len() < target {
                let w = WORDS[rng.below(WORDS.len() as u64) as usize];
                doc.push_str(w);
                line += w.len() + 1;
                let r = rng.below(100);
                doc.push_str(if line > 80 {
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
            written += doc.len() as u64;
            jsonl.push_str(&json!({ "text": doc }).to_string());
            jsonl.push('\n');
        }
        let path = dir.join(format!("text-{:04}.jsonl", files.len()));
        fs::write(&path, &jsonl)?;
        files.push(path);
    }
    Ok(files)
}

/// The documents `prepare` reads from `inputs`, written as JSONL (`{"text": ...}` a line)
/// into `out`, so that the Python comparison encodes exactly the same texts whatever the
/// inputs' formats.
fn documents_jsonl(inputs: &[PathBuf], reading: &Reading, out: &Path) -> anyhow::Result<PathBuf> {
    use std::io::Write;
    let mut jsonl = std::io::BufWriter::new(fs::File::create(out)?);
    let mut failed: Option<std::io::Error> = None;
    let read = Arc::new(std::sync::atomic::AtomicU64::new(0));
    for file in prepare::input::list(inputs)? {
        prepare::input::documents(&file.path, reading, read.clone(), &mut |doc| {
            // As prepare decodes it (--invalid replace or skip included).
            let text = prepare::input::utf8(&doc.bytes, reading.invalid, &doc.path, doc.offset, doc.line)?;
            if let Some(text) = text.filter(|t| !t.is_empty() && failed.is_none()) {
                let written = serde_json::to_writer(&mut jsonl, &json!({ "text": text }))
                    .map_err(std::io::Error::from)
                    .and_then(|()| jsonl.write_all(b"\n"));
                failed = written.err();
            }
            Ok(())
        })?;
    }
    if let Some(e) = failed {
        return Err(anyhow::anyhow!("cannot write {}: {e}", out.display()));
    }
    jsonl.flush()?;
    Ok(out.to_path_buf())
}

/// MB/s of preparing `inputs` with `tokenizer` (None: bytes).
fn prepare_rate(
    inputs: &[PathBuf],
    reading: &Reading,
    tokenizer: Option<&Path>,
    out: &Path,
) -> anyhow::Result<(f64, u64)> {
    let options = PrepareOptions {
        inputs: inputs.to_vec(),
        out: out.to_path_buf(),
        tokenizer: tokenizer.map(Path::to_path_buf),
        eos: None,
        bos: None,
        reading: reading.clone(),
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
import json
docs = [json.loads(line)["text"] for p in sys.argv[2:] for line in open(p, encoding="utf-8") if line.strip()]
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

/// What streaming measured.
struct Streamed {
    /// Resident bytes after the first batch, and the file-mapped part of them.
    first: (u64, u64),
    /// The largest resident bytes seen after, and the file-mapped part then.
    most: (u64, u64),
    seconds_per_batch: f64,
    describe: String,
}

impl Streamed {
    fn line(&self, label: &str) -> String {
        format!(
            "{label:<28} RSS {:.1} MiB after batch 1 ({:.1} of it mapped files), {:.1} MiB at most ({:.1}): +{:.1} \
             MiB; {:.3} ms/batch",
            mib(self.first.0),
            mib(self.first.1),
            mib(self.most.0),
            mib(self.most.1),
            mib(self.most.0.saturating_sub(self.first.0)),
            self.seconds_per_batch * 1e3
        )
    }

    fn json(&self) -> Value {
        json!({"rss_first": self.first.0, "rss_file_first": self.first.1, "rss_most": self.most.0,
               "rss_file_most": self.most.1, "seconds_per_batch": self.seconds_per_batch})
    }
}

/// Streams `batches` batches of the training split through the loader (one worker).
fn stream(dir: &Path, verify: Verify, args: &BenchDataArgs) -> anyhow::Result<Streamed> {
    let dataset = Arc::new(ShardedDataset::open_with(dir, None, args.seq_len, 1, verify)?);
    let describe = ava_data::Dataset::describe(&*dataset);
    let mut loader = Loader::new(dataset, Split::Train, args.batch_size, args.seq_len, 0, 1, 2)?;
    loader.next()?;
    let first = rss_bytes();
    let mut most = first;
    let start = Instant::now();
    for i in 1..args.batches {
        loader.next()?;
        if i % 64 == 0 || i + 1 == args.batches {
            let now = rss_bytes();
            if now.0 > most.0 {
                most = now;
            }
        }
    }
    let seconds_per_batch = start.elapsed().as_secs_f64() / args.batches.saturating_sub(1).max(1) as f64;
    Ok(Streamed { first, most, seconds_per_batch, describe })
}

pub fn run(p: &Printer, args: &BenchDataArgs) -> CmdResult {
    // As `ava data prepare` does; memory here is measured as the resident set.
    ava_train::memory::stop_counting();
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
        // Generated text is JSONL, one document a line; --input is read as asked.
        let default = Reading { separator: None, field: "text".into(), invalid: Invalid::Error };
        let reading = match &args.input {
            Some(_) => args.reading.reading(),
            None if args.reading.reading() != default => {
                return Err(Failure::Usage(anyhow::anyhow!(
                    "--separator, --field and --invalid say how to read --input: pass --input FILE_OR_DIR, or leave \
                     them out for the generated text"
                )));
            }
            None => default,
        };
        let listed = ava_data::prepare::input::list(&inputs).map_err(|e| Failure::Usage(anyhow::anyhow!(e)))?;
        let files: Vec<PathBuf> = listed.iter().map(|f| f.path.clone()).collect();
        p.note("preparing with the byte tokenizer ...");
        let (byte_rate, _) = prepare_rate(&inputs, &reading, None, &work.path().join("bytes"))?;
        lines.push(format!("prepare, byte tokenizer      {byte_rate:8.1} MB/s of text"));
        report.insert("prepare_byte_mb_per_s".into(), json!(byte_rate));
        if let Some(tok) = &args.tokenizer {
            p.note(&format!("preparing with {} ...", tok.display()));
            let (rate, _) = prepare_rate(&inputs, &reading, Some(tok), &work.path().join("bpe"))?;
            // Preparing loaded it already, so this does not fail.
            let encoder = ava_data::TextTokenizer::from_file(tok).map_or_else(|e| e.to_string(), |t| t.encoder());
            lines.push(format!(
                "prepare, {:<20} {rate:8.1} MB/s of text, by {encoder}",
                tok.file_name().unwrap_or_default().to_string_lossy()
            ));
            report.insert("prepare_tokenizer_mb_per_s".into(), json!(rate));
            report.insert("prepare_tokenizer_encoder".into(), json!(encoder));
            p.note("encoding the same documents with Python tokenizers (encode_batch) ...");
            let python = if args.input.is_some() {
                let jsonl = documents_jsonl(&inputs, &reading, &work.path().join("documents.jsonl"))?;
                python_rate(&[jsonl], tok)
            } else {
                python_rate(&files, tok)
            };
            match python {
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
        // Writing left the heap grown; hand it back so the streaming numbers are the reader's.
        // SAFETY: malloc_trim only returns free memory to the system.
        #[cfg(target_os = "linux")]
        unsafe {
            libc::malloc_trim(0);
        }
        p.note(&format!("streaming {} batches of {} x {} ...", args.batches, args.batch_size, args.seq_len + 1));
        let streamed = stream(&base, Verify::Checksums, args)?;
        let bytes: u64 = manifest.shards.iter().map(|s| s.bytes).sum();
        lines.push(format!("corpus                       {}", streamed.describe));
        lines.push(streamed.line(&format!("stream {:.2} GiB", bytes as f64 / (1u64 << 30) as f64)));
        let mut entry = streamed.json();
        entry["corpus_bytes"] = json!(bytes);
        report.insert("stream".into(), entry);
        if args.scale > 1 {
            let scaled = work.path().join("scaled");
            scaled_corpus(&base, &manifest, &scaled, args.scale)?;
            p.note(&format!("streaming the corpus listed {}x over (not re-verified) ...", args.scale));
            let streamed = stream(&scaled, Verify::Sizes, args)?;
            let gib = (bytes * args.scale as u64) as f64 / (1u64 << 30) as f64;
            lines.push(streamed.line(&format!("stream {gib:.2} GiB ({}x)", args.scale)));
            let mut entry = streamed.json();
            entry["times"] = json!(args.scale);
            report.insert("stream_scaled".into(), entry);
        }
    }
    p.result(|| lines.join("\n"), || Value::Object(report.clone()));
    Ok(())
}
