//! `ava data prepare`: tokenizes a corpus once into shards of token ids and a manifest.
//!
//! One thread reads the inputs in order (decompressing, splitting into documents, checking
//! UTF-8) and hands batches of about 4 MiB of text to the caller's thread, which tokenizes
//! a batch's documents on the rayon pool (order kept; only very long documents are cut into
//! pieces, see [`TOKENIZER_PIECE_BYTES`]), appends each document to the shard being
//! filled (train or validation region, by a hash of the document's index) and writes the
//! shard when it holds `shard_tokens` ids. After every written shard the manifest is saved
//! atomically, so a killed run leaves a manifest listing only complete shards, and the next
//! run into the same directory skips the documents they hold and continues.
//!
//! Memory: two shards' ids (`shard_tokens` × id bytes each, plus 8 bytes per document for
//! where it starts, plus one document's: one filling, one being written on its own thread),
//! plus up to four batches of text (two queued, one being sent, one being tokenized). A
//! stream that never ends is read in that memory for as long as it goes on.

mod fault;
pub mod input;
pub mod lock;

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::sync_channel;
use std::time::{Duration, Instant};

use rayon::prelude::*;

use crate::dataset::Split;
use crate::manifest::{self, Manifest, ShardEntry, TokenizerId};
use crate::rng::hash64;
use crate::shard::{self, ShardBuilder};
use crate::tokenizer::TextTokenizer;
#[doc(hidden)]
pub use fault::DiskFault;
pub use input::{Invalid, Reading};
pub use lock::{LOCK_FILE, OutLock};

/// Everything `prepare` needs.
#[derive(Debug, Clone)]
pub struct PrepareOptions {
    /// Files and directories, in order.
    pub inputs: Vec<PathBuf>,
    /// The corpus directory.
    pub out: PathBuf,
    /// A Hugging Face `tokenizer.json`; `None` is the byte tokenizer.
    pub tokenizer: Option<PathBuf>,
    /// The end-of-text token's text (a tokenizer.json's); `None` looks for a usual one.
    pub eos: Option<String>,
    /// A beginning-of-text token's text, put before every document.
    pub bos: Option<String>,
    /// How inputs become documents.
    pub reading: Reading,
    /// Share of documents held out for validation.
    pub val_fraction: f64,
    /// Ids per shard (a shard is written once it holds at least this many).
    pub shard_tokens: u64,
    /// Start over in a directory holding something else or another corpus.
    pub force: bool,
}

/// The default ids per shard: 2²⁷ (256 MiB of u16 ids).
pub const DEFAULT_SHARD_TOKENS: u64 = 1 << 27;

/// Text per batch handed from the reader to the tokenizers.
const BATCH_BYTES: usize = 4 << 20;
/// Pieces the byte tokenizer's documents are cut into (at line ends), so one long document
/// can use every core; bytes are ids, so cutting changes nothing.
const BYTE_PIECE_BYTES: usize = 1 << 20;
/// A tokenizer.json sees each document whole, so its ids are exactly those of encoding the
/// document (a cut would make the tokenizer see a new start: another pre-token split, or
/// SentencePiece's word-start mark). Only documents beyond this size are cut, at line ends,
/// to bound the tokenizer's working memory; a whole book is ~1 MB.
const TOKENIZER_PIECE_BYTES: usize = 8 << 20;
/// Salt of the hash that picks validation documents.
const VALIDATION_SALT: u64 = 0x7661_6c69_6461_7465;

/// Whether document `index` is held out for validation.
pub fn is_validation(index: u64, val_fraction: f64) -> bool {
    (hash64(VALIDATION_SALT, index) as f64) < val_fraction * 2f64.powi(64)
}

/// Something went wrong preparing a corpus. Its `Display` is the whole message for the user.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PrepareError {
    /// No input was named.
    #[error("no inputs: name text, JSONL (.gz/.zst) or Parquet files, or directories, to prepare")]
    NoInputs,
    /// The inputs hold no file, or no document.
    #[error("the inputs hold no {what}: {}", list(inputs))]
    EmptyInput {
        /// What was given.
        inputs: Vec<PathBuf>,
        /// "file" or "document".
        what: &'static str,
    },
    /// An input could not be read.
    #[error("cannot read input {}: {source}", path.display())]
    Input {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// A compressed input could not be decompressed.
    #[error("cannot decompress {}: {message}", path.display())]
    Decompress {
        /// The file.
        path: PathBuf,
        /// The decoder's error.
        message: String,
    },
    /// An input of a kind this build refuses.
    #[error("{}: {what}", path.display())]
    Unsupported {
        /// The file.
        path: PathBuf,
        /// What and what to do.
        what: String,
    },
    /// Invalid UTF-8 under `--invalid error`.
    #[error(
        "{}{}: invalid UTF-8 at byte offset {offset}; pass --invalid replace (U+FFFD) or --invalid skip (leave such \
         documents out) to go on",
        path.display(),
        line.map(|l| format!(" record {l}")).unwrap_or_default()
    )]
    InvalidUtf8 {
        /// The file.
        path: PathBuf,
        /// Byte offset of the first invalid byte: in the decompressed file, or in the
        /// record when there is one.
        offset: u64,
        /// The record (JSONL line, Parquet row), if any.
        line: Option<u64>,
    },
    /// A Parquet file that cannot be read, or has no string column by that name.
    #[error("{}: {message}", path.display())]
    Parquet {
        /// The file.
        path: PathBuf,
        /// What is wrong and what to do.
        message: String,
    },
    /// A JSONL line that is not an object with the text field.
    #[error("{}:{line}: {reason}", path.display())]
    Jsonl {
        /// The file.
        path: PathBuf,
        /// The line (from 1).
        line: u64,
        /// What is wrong.
        reason: String,
    },
    /// A document larger than a read can hold.
    #[error(
        "{}: a document over {} GiB; split the text with --separator (e.g. --separator $'\\n\\n')",
        path.display(),
        input::MAX_DOCUMENT_BYTES >> 30
    )]
    DocumentTooLarge {
        /// The file.
        path: PathBuf,
    },
    /// The tokenizer could not be loaded, or has no usable end-of-text token.
    #[error("{0}")]
    Tokenizer(String),
    /// A tokenizer failed on some text.
    #[error("tokenizer {} failed on a document of {}: {message}", tokenizer.display(), path.display())]
    Encode {
        /// The input it came from.
        path: PathBuf,
        /// The tokenizer file.
        tokenizer: PathBuf,
        /// The tokenizer's error.
        message: String,
    },
    /// An option is out of range.
    #[error("{option} {value}: {reason}")]
    Option {
        /// The flag.
        option: &'static str,
        /// The value given.
        value: String,
        /// What is accepted.
        reason: String,
    },
    /// `--out` holds something that is not this corpus.
    #[error("{} {what}; choose another --out, or pass --force to {action}", dir.display())]
    OutInUse {
        /// The directory.
        dir: PathBuf,
        /// What it holds.
        what: String,
        /// What `--force` would do.
        action: &'static str,
    },
    /// Something other than a directory and a lock file Ava writes is where they go (a link
    /// or FIFO another user planted, a `--out` that is a link of another user's): the text
    /// says what and how to fix it.
    #[error("--out {0}")]
    Planted(String),
    /// Another process prepares into `--out` (it holds [`LOCK_FILE`]).
    #[error(
        "{} is in use by another ava data prepare ({holder}; it holds {}): wait for it to finish or stop it \
         (kill {pid}), or choose another --out",
        dir.display(),
        lock.display(),
        pid = pid.map_or("its pid".to_string(), |p| p.to_string())
    )]
    Busy {
        /// The corpus directory.
        dir: PathBuf,
        /// Its lock file.
        lock: PathBuf,
        /// The holder's pid, as its lock file says.
        pid: Option<u32>,
        /// The holder as its lock file describes it: pid, host, age, command.
        holder: String,
    },
    /// The disk filled up.
    #[error(
        "the disk holding {} is full ({source}) after {shards} complete shards; they stay usable: free some space \
         and run the same command again to continue from shard {shards}",
        dir.display()
    )]
    DiskFull {
        /// The corpus directory.
        dir: PathBuf,
        /// Shards complete and listed in the manifest.
        shards: usize,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// The reader was told to stop: the writer failed first (the writer's error is the one
    /// reported), or a tokenizer's training text is full. Never reaches a caller.
    #[error("stopped: writing the corpus failed")]
    Stopped,
    /// Writing the corpus failed.
    #[error("cannot write to {}: {source} ({shards} complete shards stay listed in its manifest)", dir.display())]
    Write {
        /// The corpus directory.
        dir: PathBuf,
        /// Shards complete.
        shards: usize,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
}

fn list(paths: &[PathBuf]) -> String {
    paths.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
}

/// Where a run stands, for progress reports.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Progress {
    /// Bytes of input files read (on disk, before decompression).
    pub input_bytes: u64,
    /// Bytes of all input files.
    pub input_total: u64,
    /// Text bytes of the documents tokenized this run.
    pub text_bytes: u64,
    /// Documents in the corpus so far (earlier runs' included).
    pub documents: u64,
    /// Ids written or waiting for the current shard, this run.
    pub tokens: u64,
    /// Shards complete.
    pub shards: usize,
    /// Time this run.
    pub elapsed: Duration,
}

/// Receives progress (the CLI draws a bar; tests record).
pub trait PrepareReporter {
    /// Called once before reading, with what an earlier run left (shards, documents).
    fn start(&mut self, total_input_bytes: u64, resumed: Option<(usize, u64)>) {
        let _ = (total_input_bytes, resumed);
    }
    /// Called after every batch of documents.
    fn progress(&mut self, progress: &Progress) {
        let _ = progress;
    }
    /// Called after every written shard.
    fn shard(&mut self, entry: &ShardEntry) {
        let _ = entry;
    }
}

/// A reporter that reports nothing.
pub struct Silent;
impl PrepareReporter for Silent {}

/// What a run did.
#[derive(Debug, Clone)]
pub struct Summary {
    /// The manifest as written.
    pub manifest: Manifest,
    /// The progress at the end of this run.
    pub progress: Progress,
    /// Shards and documents an earlier run had finished, if this run continued one.
    pub resumed: Option<(usize, u64)>,
    /// True when the corpus was complete already and nothing was done.
    pub already_complete: bool,
    /// Documents left out (`--invalid skip`, or empty).
    pub skipped_documents: u64,
    /// What the corpus will not do as the user may expect (no validation documents).
    pub warnings: Vec<String>,
}

/// How text becomes ids.
enum Encoder {
    Byte,
    Hf(Box<TextTokenizer>),
}

impl Encoder {
    fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        match self {
            Encoder::Byte => Ok(text.bytes().map(u32::from).collect()),
            Encoder::Hf(t) => t.encode_piece(text),
        }
    }
}

/// The usual end-of-text tokens, tried in order when `--eos` is not given.
const EOS_NAMES: [&str; 6] = ["<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]"];

/// The encoder, the corpus's tokenizer identity, vocabulary, EOS and BOS ids.
fn encoder(options: &PrepareOptions) -> Result<(Encoder, TokenizerId, u64, u32, Option<u32>), PrepareError> {
    let Some(path) = &options.tokenizer else {
        if options.eos.is_some() || options.bos.is_some() {
            return Err(PrepareError::Option {
                option: "--eos/--bos",
                value: options.eos.clone().or(options.bos.clone()).unwrap_or_default(),
                reason: "the byte tokenizer's end of text is id 256 and it has no other special tokens; --eos and \
                         --bos name tokens of a --tokenizer"
                    .into(),
            });
        }
        return Ok((Encoder::Byte, TokenizerId::Byte, 257, 256, None));
    };
    let tok = TextTokenizer::from_file(path).map_err(|e| PrepareError::Tokenizer(e.to_string()))?;
    let sha256 = shard::sha256_file(path).map_err(|source| PrepareError::Input { path: path.clone(), source })?;
    let named = |name: &str, flag: &str| {
        tok.token_id(name).ok_or_else(|| {
            PrepareError::Tokenizer(format!(
                "{flag} {name:?}: tokenizer {} has no such token; name one of its special tokens",
                path.display()
            ))
        })
    };
    let eos = match &options.eos {
        Some(name) => named(name, "--eos")?,
        None => EOS_NAMES.iter().find_map(|n| tok.token_id(n)).ok_or_else(|| {
            PrepareError::Tokenizer(format!(
                "tokenizer {} has none of the usual end-of-text tokens ({}); name the one it uses with --eos",
                path.display(),
                EOS_NAMES.join(", ")
            ))
        })?,
    };
    let bos = options.bos.as_deref().map(|name| named(name, "--bos")).transpose()?;
    let vocab = tok.vocab_size() as u64;
    Ok((Encoder::Hf(Box::new(tok)), TokenizerId::Huggingface { file: path.clone(), sha256 }, vocab, eos, bos))
}

/// One batch from the reader: pieces of text, and how many pieces each document has.
#[derive(Default)]
struct Batch {
    pieces: Vec<String>,
    /// Per document: its piece count, its text bytes, and its input file.
    documents: Vec<(usize, u64, Arc<Path>)>,
    bytes: usize,
}

/// Prepares a corpus (see the module docs).
pub fn prepare(options: &PrepareOptions, reporter: &mut dyn PrepareReporter) -> Result<Summary, PrepareError> {
    run(options, reporter, None)
}

/// Test hook: [`prepare`] on a disk that fills up where `fault` says (see [`DiskFault`]).
#[doc(hidden)]
pub fn prepare_with_fault(
    options: &PrepareOptions,
    reporter: &mut dyn PrepareReporter,
    fault: DiskFault,
) -> Result<Summary, PrepareError> {
    run(options, reporter, Some(fault))
}

/// A run, stage by stage: check the options, list the inputs and load the tokenizer, claim
/// `--out` (returning at once when the corpus is complete), then tokenize and finish.
fn run(
    options: &PrepareOptions,
    reporter: &mut dyn PrepareReporter,
    fault: Option<DiskFault>,
) -> Result<Summary, PrepareError> {
    check_options(options)?;
    // Not the corpus itself, when it is written inside an input directory.
    let files = input::list_except(&options.inputs, Some(&options.out))?;
    let (encoder, tokenizer, vocab_size, eos_id, bos_id) = encoder(options)?;
    let id_bytes = if vocab_size <= 1 << 16 { 2 } else { 4 };
    let encoding = Encoding { encoder, id_bytes, eos_id, bos_id };
    let fresh = fresh_manifest(options, &files, tokenizer, vocab_size, &encoding);
    // Held until this function returns: nothing is written into `--out` before it is ours.
    let _lock = OutLock::acquire(&options.out)?;
    let manifest = match claim_out(&options.out, &fresh, options.force)? {
        Claim::Complete(done) => return Ok(already_complete(done)),
        Claim::Continue(partial) => partial,
        Claim::Fresh => fresh,
    };
    let mut job = Job::start(options, fault, files, encoding, manifest, reporter);
    job.tokenize(reporter)?;
    job.finish(reporter)
}

/// Refuses options out of range: the validation share, an empty separator, no ids per shard.
fn check_options(options: &PrepareOptions) -> Result<(), PrepareError> {
    if !(0.0..1.0).contains(&options.val_fraction) {
        return Err(PrepareError::Option {
            option: "--val-fraction",
            value: options.val_fraction.to_string(),
            reason: "must be at least 0 and below 1 (the share of documents held out for validation)".into(),
        });
    }
    if options.reading.separator.as_deref() == Some("") {
        return Err(PrepareError::Option {
            option: "--separator",
            value: "\"\"".into(),
            reason: "is empty; give the string that separates documents (e.g. $'\\n\\n'), or leave it out for one \
                     document per file"
                .into(),
        });
    }
    if options.shard_tokens == 0 {
        return Err(PrepareError::Option {
            option: "--shard-tokens",
            value: "0".into(),
            reason: "must be at least 1".into(),
        });
    }
    Ok(())
}

/// How documents become a shard's ids.
struct Encoding {
    encoder: Encoder,
    /// Bytes per id in a shard: 2 up to a vocabulary of 2¹⁶, else 4.
    id_bytes: u32,
    eos_id: u32,
    bos_id: Option<u32>,
}

/// The manifest of this run's corpus before anything is in it: what `--out` must hold to be
/// continued, and what a fresh corpus starts from.
fn fresh_manifest(
    options: &PrepareOptions,
    files: &[manifest::InputFile],
    tokenizer: TokenizerId,
    vocab_size: u64,
    encoding: &Encoding,
) -> Manifest {
    Manifest {
        format: manifest::FORMAT.into(),
        version: manifest::VERSION,
        complete: false,
        tokenizer,
        vocab_size,
        id_bytes: encoding.id_bytes,
        eos_id: encoding.eos_id,
        bos_id: encoding.bos_id,
        val_fraction: options.val_fraction,
        shard_tokens: options.shard_tokens,
        reading: options.reading.describe(),
        inputs: files.to_vec(),
        documents: 0,
        text_bytes: 0,
        train: Default::default(),
        validation: Default::default(),
        shards: Vec::new(),
    }
}

/// The summary of a run that found the corpus complete already and did nothing.
fn already_complete(done: Manifest) -> Summary {
    Summary {
        progress: Progress { documents: done.documents, shards: done.shards.len(), ..Progress::default() },
        manifest: done,
        resumed: None,
        already_complete: true,
        skipped_documents: 0,
        warnings: Vec::new(),
    }
}

/// A run once `--out` is ours: what it reads, how it encodes, the manifest it keeps and
/// where it stands.
struct Job<'a> {
    options: &'a PrepareOptions,
    /// The test hook's full disk, if any.
    fault: Option<DiskFault>,
    files: Vec<manifest::InputFile>,
    encoding: Encoding,
    manifest: Manifest,
    /// Shards and documents an earlier run had finished, if this run continues one.
    resumed: Option<(usize, u64)>,
    /// Shards an earlier run had listed.
    first_shard: usize,
    /// Documents an earlier run had placed: the reader counts them but does not send them.
    skip: u64,
    progress: Progress,
    started: Instant,
    /// Input bytes read (the reader adds to it).
    read: Arc<AtomicU64>,
    /// Documents left out (the reader counts them).
    skipped: Arc<AtomicU64>,
}

impl<'a> Job<'a> {
    /// Sets a run up on the manifest `--out` holds (an earlier run's, or a fresh one) and
    /// tells the reporter where it starts.
    fn start(
        options: &'a PrepareOptions,
        fault: Option<DiskFault>,
        files: Vec<manifest::InputFile>,
        encoding: Encoding,
        manifest: Manifest,
        reporter: &mut dyn PrepareReporter,
    ) -> Self {
        let resumed = (!manifest.shards.is_empty()).then_some((manifest.shards.len(), manifest.documents));
        let first_shard = manifest.shards.len();
        let skip = manifest.documents;
        let input_total = files.iter().map(|f| f.bytes).sum();
        reporter.start(input_total, resumed);

        let started = Instant::now();
        let read = Arc::new(AtomicU64::new(0));
        let skipped = Arc::new(AtomicU64::new(0));
        let progress = Progress {
            input_total,
            documents: manifest.documents,
            shards: manifest.shards.len(),
            ..Progress::default()
        };
        Job { options, fault, files, encoding, manifest, resumed, first_shard, skip, progress, started, read, skipped }
    }

    /// Reads, tokenizes and writes every document not in the corpus yet: the reader and the
    /// shard writer on threads of their own, the tokenizing here (and on the rayon pool).
    /// Either way both threads are done when it returns; on success every written shard is
    /// in the manifest.
    fn tokenize(&mut self, reporter: &mut dyn PrepareReporter) -> Result<(), PrepareError> {
        let (options, fault, first_shard) = (self.options, self.fault, self.first_shard);
        let mut filling = Filling {
            builder: ShardBuilder::new(self.encoding.id_bytes, self.encoding.eos_id),
            text_bytes: 0,
            pending: None,
            val_documents: self.manifest.validation.documents,
            options,
            id_bytes: self.encoding.id_bytes,
            eos_id: self.encoding.eos_id,
        };
        std::thread::scope(|scope| -> Result<(), PrepareError> {
            let (tx, rx) = sync_channel::<Batch>(2);
            let reading = options.reading.clone();
            let (read2, skipped2) = (self.read.clone(), self.skipped.clone());
            let files2 = self.files.clone();
            let skip = self.skip;
            let piece =
                if matches!(self.encoding.encoder, Encoder::Byte) { BYTE_PIECE_BYTES } else { TOKENIZER_PIECE_BYTES };
            let reader = scope.spawn(move || read_documents(&files2, &reading, skip, piece, &read2, &skipped2, &tx));
            // Shards are written (hashed, fsynced, renamed) on their own thread while the next
            // one fills; this thread keeps the manifest and saves it, in shard order, as each
            // lands. A rendezvous channel: a full shard waits for the writer, so at most two exist.
            let (shard_tx, shard_rx) = sync_channel::<(ShardBuilder, String, u64, u64)>(0);
            let (done_tx, done_rx) = std::sync::mpsc::channel::<io::Result<(ShardEntry, u64)>>();
            let out_dir = options.out.clone();
            let writer = scope.spawn(move || write_shards(shard_rx, done_tx, &out_dir, first_shard, fault));
            let mut sink = ShardSink {
                dir: &options.out,
                shard_tx: Some(shard_tx),
                done_rx,
                handed: self.manifest.shards.len(),
                handed_docs: self.manifest.documents,
                first_shard,
                fault,
            };
            for batch in rx {
                self.encode_batch(batch, &mut filling, &mut sink, reporter)?;
            }
            // The channel closed: the reader finished, or failed.
            reader.join().expect("the input reader does not panic")?;
            filling.finish(&mut sink, &mut self.manifest, reporter)?;
            sink.shard_tx = None; // the writer finishes what it has, then stops
            writer.join().expect("the shard writer does not panic");
            while let Ok(done) = sink.done_rx.recv() {
                sink.absorb(done, &mut self.manifest, reporter)?;
            }
            Ok(())
        })
    }

    /// Tokenizes a batch's pieces on the rayon pool (order kept), joins each document's ids
    /// (after the BOS id, if any), places the document read before it (see [`Filling`]), and
    /// reports progress.
    fn encode_batch(
        &mut self,
        batch: Batch,
        filling: &mut Filling<'_>,
        sink: &mut ShardSink<'_>,
        reporter: &mut dyn PrepareReporter,
    ) -> Result<(), PrepareError> {
        let encoder = &self.encoding.encoder;
        let encoded: Vec<Result<Vec<u32>, String>> = batch.pieces.par_iter().map(|p| encoder.encode(p)).collect();
        let mut pieces = encoded.into_iter();
        for (count, text_bytes, path) in batch.documents {
            let mut ids = Vec::new();
            ids.extend(self.encoding.bos_id);
            for piece in pieces.by_ref().take(count) {
                ids.extend(piece.map_err(|message| PrepareError::Encode {
                    path: path.to_path_buf(),
                    tokenizer: self.options.tokenizer.clone().unwrap_or_default(),
                    message,
                })?);
            }
            self.progress.tokens += ids.len() as u64 + 1;
            self.progress.text_bytes += text_bytes;
            if let Some(previous) = filling.pending.replace((ids, text_bytes)) {
                filling.place(previous, false, sink, &mut self.manifest, reporter)?;
            }
        }
        self.progress.documents = sink.handed_docs + filling.builder.documents() + u64::from(filling.pending.is_some());
        self.progress.shards = self.manifest.shards.len();
        self.progress.input_bytes = self.read.load(Ordering::Relaxed);
        self.progress.elapsed = self.started.elapsed();
        reporter.progress(&self.progress);
        Ok(())
    }

    /// Marks the manifest complete and saves it, reports the final progress, and sums the
    /// run up; a run that found no document at all fails instead.
    fn finish(self, reporter: &mut dyn PrepareReporter) -> Result<Summary, PrepareError> {
        let Job { options, fault, mut manifest, resumed, first_shard, mut progress, started, read, skipped, .. } = self;
        let dir = &options.out;
        if manifest.documents == 0 {
            return Err(PrepareError::EmptyInput { inputs: options.inputs.clone(), what: "document" });
        }
        manifest.complete = true;
        let room = DiskFault::manifest_room(fault, manifest.shards.len() - first_shard);
        manifest.save_within(dir, room).map_err(|e| write_error(dir, manifest.shards.len(), e))?;
        progress.documents = manifest.documents;
        progress.shards = manifest.shards.len();
        progress.input_bytes = read.load(Ordering::Relaxed);
        progress.elapsed = started.elapsed();
        reporter.progress(&progress);
        let warnings = validation_warnings(&manifest, options.val_fraction);
        Ok(Summary {
            manifest,
            progress,
            resumed,
            already_complete: false,
            skipped_documents: skipped.load(Ordering::Relaxed),
            warnings,
        })
    }
}

/// The warning a corpus with no validation document gets (none when it has some).
fn validation_warnings(manifest: &Manifest, val_fraction: f64) -> Vec<String> {
    let mut warnings = Vec::new();
    if manifest.validation.documents == 0 {
        let why = if manifest.documents < 2 {
            "the corpus is one document; cut the text into documents with --separator to evaluate".to_string()
        } else {
            format!("--val-fraction is {val_fraction}")
        };
        warnings
            .push(format!("no document was held out for validation ({why}): training on it runs without validation"));
    }
    warnings
}

/// The shard writer's thread: writes each shard it is handed and sends back its entry (and
/// text bytes), in order; at the first failure it removes that shard's temporary file, sends
/// the error and stops.
fn write_shards(
    shard_rx: std::sync::mpsc::Receiver<(ShardBuilder, String, u64, u64)>,
    done_tx: std::sync::mpsc::Sender<io::Result<(ShardEntry, u64)>>,
    out_dir: &Path,
    first_shard: usize,
    fault: Option<DiskFault>,
) {
    for (i, (builder, file, first, text_bytes)) in shard_rx.into_iter().enumerate() {
        let room = DiskFault::shard_room(fault, first_shard + i);
        let done = builder.finish_within(out_dir, &file, first, room).map(|e| (e, text_bytes));
        let failed = done.is_err();
        if failed {
            let _ = fs::remove_file(out_dir.join(format!("{file}.tmp")));
        }
        let _ = done_tx.send(done);
        if failed {
            return;
        }
    }
}

/// The shard being filled, and the document held back until the next one arrives.
///
/// Each document waits for the next before it is placed, so the last one is known as the
/// last: when no document was held out by then (a small corpus, where a share of 0.5%
/// rounds to none), it goes to validation instead, so there is some.
struct Filling<'a> {
    builder: ShardBuilder,
    /// Text bytes of the documents in `builder`.
    text_bytes: u64,
    /// The last document read (its ids and text bytes), not placed yet.
    pending: Option<(Vec<u32>, u64)>,
    /// Validation documents in the corpus so far (earlier runs' included).
    val_documents: u64,
    options: &'a PrepareOptions,
    id_bytes: u32,
    eos_id: u32,
}

impl Filling<'_> {
    /// Appends a document to the shard being filled, to validation when `hold_out` or its
    /// index's hash says so, and hands the shard to the writer once it holds `shard_tokens`.
    fn place(
        &mut self,
        (ids, text_bytes): (Vec<u32>, u64),
        hold_out: bool,
        sink: &mut ShardSink<'_>,
        manifest: &mut Manifest,
        reporter: &mut dyn PrepareReporter,
    ) -> Result<(), PrepareError> {
        let index = sink.handed_docs + self.builder.documents();
        let split =
            if hold_out || is_validation(index, self.options.val_fraction) { Split::Validation } else { Split::Train };
        self.val_documents += u64::from(split == Split::Validation);
        self.builder.push(split, &ids);
        self.text_bytes += text_bytes;
        if self.builder.tokens() >= self.options.shard_tokens {
            let full = std::mem::replace(&mut self.builder, ShardBuilder::new(self.id_bytes, self.eos_id));
            sink.hand(full, std::mem::take(&mut self.text_bytes), manifest, reporter)?;
        }
        Ok(())
    }

    /// Once the input has ended: places the last document (held out when none was yet) and
    /// hands the last shard, if it holds any document, to the writer.
    fn finish(
        mut self,
        sink: &mut ShardSink<'_>,
        manifest: &mut Manifest,
        reporter: &mut dyn PrepareReporter,
    ) -> Result<(), PrepareError> {
        if let Some(last) = self.pending.take() {
            let documents = sink.handed_docs + self.builder.documents() + 1;
            let none_held_out = self.val_documents == 0 && documents >= 2 && self.options.val_fraction > 0.0;
            self.place(last, none_held_out, sink, manifest, reporter)?;
        }
        if self.builder.documents() > 0 {
            sink.hand(self.builder, self.text_bytes, manifest, reporter)?;
        }
        Ok(())
    }
}

/// A failed write into the corpus directory, with the shards its manifest lists: a full disk
/// is said as such.
fn write_error(dir: &Path, shards: usize, source: io::Error) -> PrepareError {
    let dir = dir.to_path_buf();
    if source.kind() == io::ErrorKind::StorageFull {
        PrepareError::DiskFull { dir, shards, source }
    } else {
        PrepareError::Write { dir, shards, source }
    }
}

/// The preparing thread's end of the shard writer.
struct ShardSink<'a> {
    dir: &'a Path,
    shard_tx: Option<std::sync::mpsc::SyncSender<(ShardBuilder, String, u64, u64)>>,
    done_rx: std::sync::mpsc::Receiver<io::Result<(ShardEntry, u64)>>,
    /// Shards handed to the writer.
    handed: usize,
    /// Their documents: the index of the next document.
    handed_docs: u64,
    /// Shards an earlier run had listed.
    first_shard: usize,
    /// The test hook's full disk, if any.
    fault: Option<DiskFault>,
}

impl ShardSink<'_> {
    /// Hands a full shard to the writer (waiting while it writes the previous one), then
    /// records the shards it has finished.
    fn hand(
        &mut self,
        builder: ShardBuilder,
        text_bytes: u64,
        manifest: &mut Manifest,
        reporter: &mut dyn PrepareReporter,
    ) -> Result<(), PrepareError> {
        let docs = builder.documents();
        let tx = self.shard_tx.as_ref().expect("open until the end");
        if tx.send((builder, shard::file_name(self.handed), self.handed_docs, text_bytes)).is_err() {
            // The writer stopped on an error: that error is the one to report.
            while let Ok(done) = self.done_rx.recv() {
                self.absorb(done, manifest, reporter)?;
            }
            return Err(PrepareError::Write {
                dir: self.dir.to_path_buf(),
                shards: manifest.shards.len(),
                source: io::Error::other("the shard writer stopped without saying why"),
            });
        }
        self.handed += 1;
        self.handed_docs += docs;
        while let Ok(done) = self.done_rx.try_recv() {
            self.absorb(done, manifest, reporter)?;
        }
        Ok(())
    }

    /// Lists a written shard in the manifest and saves it.
    fn absorb(
        &self,
        done: io::Result<(ShardEntry, u64)>,
        manifest: &mut Manifest,
        reporter: &mut dyn PrepareReporter,
    ) -> Result<(), PrepareError> {
        // Either way the manifest on disk lists the shards before this one.
        let listed = manifest.shards.len();
        let (entry, text_bytes) = done.map_err(|e| write_error(self.dir, listed, e))?;
        manifest.push(entry.clone(), text_bytes);
        let room = DiskFault::manifest_room(self.fault, listed - self.first_shard);
        manifest.save_within(self.dir, room).map_err(|e| write_error(self.dir, listed, e))?;
        reporter.shard(&entry);
        Ok(())
    }
}

/// What `--out` holds.
enum Claim {
    /// Nothing of ours (created or emptied): start fresh.
    Fresh,
    /// A partial corpus from the same inputs and options: continue it.
    Continue(Manifest),
    /// The same corpus, complete.
    Complete(Manifest),
}

/// Decides what to do with `--out` (a directory, created and locked by [`OutLock`]): start
/// afresh, continue the corpus in it, or refuse.
fn claim_out(dir: &Path, fresh: &Manifest, force: bool) -> Result<Claim, PrepareError> {
    let io_err = |source| PrepareError::Write { dir: dir.to_path_buf(), shards: 0, source };
    let ours = |name: &str| name == manifest::FILE || name.ends_with(".tmp") || name.starts_with("shard-");
    // The lock is neither the corpus nor someone else's file: it stays.
    let ours_or_lock = |name: &str| ours(name) || name == LOCK_FILE;
    let entries: Vec<String> = fs::read_dir(dir)
        .map_err(io_err)?
        .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect();
    let refusal = match Manifest::load(dir) {
        Ok(existing) if same_corpus(&existing, fresh) && !force => {
            return Ok(if existing.complete { Claim::Complete(existing) } else { Claim::Continue(existing) });
        }
        Ok(existing) => Some(format!(
            "holds a {} corpus prepared from other inputs or options ({} inputs, {}; this run: {} inputs, {})",
            if existing.complete { "complete" } else { "partial" },
            existing.inputs.len(),
            existing.reading,
            fresh.inputs.len(),
            fresh.reading
        )),
        Err(crate::error::DataError::NoManifest { .. }) => {
            let others: Vec<&String> = entries.iter().filter(|n| !ours_or_lock(n)).collect();
            (!others.is_empty()).then(|| {
                format!(
                    "is not empty and not a corpus (it holds {})",
                    others.iter().take(3).map(|s| s.as_str()).collect::<Vec<_>>().join(", ")
                )
            })
        }
        Err(e) => Some(format!("holds a manifest that cannot be read ({e})")),
    };
    if let Some(what) = refusal.filter(|_| !force) {
        return Err(PrepareError::OutInUse {
            dir: dir.to_path_buf(),
            what,
            action: "start a new corpus there (its shards and manifest are replaced; other files are left)",
        });
    }
    for name in entries.iter().filter(|n| ours(n)) {
        fs::remove_file(dir.join(name)).map_err(io_err)?;
    }
    Ok(Claim::Fresh)
}

/// Whether a manifest on disk describes the corpus this run would make.
fn same_corpus(a: &Manifest, b: &Manifest) -> bool {
    a.tokenizer == b.tokenizer
        && a.eos_id == b.eos_id
        && a.bos_id == b.bos_id
        // Through JSON and back a fraction may move by an ulp.
        && (a.val_fraction - b.val_fraction).abs() <= 1e-12
        && a.shard_tokens == b.shard_tokens
        && a.reading == b.reading
        && a.inputs == b.inputs
}

/// The reader thread: every document of every file, in order, cut into pieces and sent in
/// batches; the first `skip` documents (an earlier run's) are counted, not sent.
fn read_documents(
    files: &[manifest::InputFile],
    reading: &Reading,
    skip: u64,
    piece_bytes: usize,
    read: &Arc<AtomicU64>,
    skipped: &AtomicU64,
    tx: &std::sync::mpsc::SyncSender<Batch>,
) -> Result<(), PrepareError> {
    let mut batch = Batch::default();
    let mut index = 0u64;
    for file in files {
        let mut emit = |doc: input::RawDocument| -> Result<(), PrepareError> {
            let Some(text) = input::utf8(&doc.bytes, reading.invalid, &doc.path, doc.offset, doc.line)? else {
                skipped.fetch_add(1, Ordering::Relaxed);
                return Ok(());
            };
            if text.is_empty() {
                skipped.fetch_add(1, Ordering::Relaxed);
                return Ok(());
            }
            index += 1;
            if index <= skip {
                return Ok(());
            }
            let text_bytes = text.len() as u64;
            let mut count = 0;
            let mut rest: &str = &text;
            while !rest.is_empty() {
                let end = piece_end(rest, piece_bytes);
                batch.pieces.push(rest[..end].to_string());
                rest = &rest[end..];
                count += 1;
            }
            batch.documents.push((count, text_bytes, doc.path.clone()));
            batch.bytes += text_bytes as usize;
            if batch.bytes >= BATCH_BYTES {
                // A closed channel means the consumer stopped on an error of its own.
                if tx.send(std::mem::take(&mut batch)).is_err() {
                    return Err(PrepareError::Stopped);
                }
            }
            Ok(())
        };
        match input::documents(&file.path, reading, read.clone(), &mut emit) {
            Ok(()) => {}
            // The writer's own error is what the user sees.
            Err(PrepareError::Stopped) => return Ok(()),
            Err(e) => return Err(e),
        }
    }
    if !batch.documents.is_empty() {
        let _ = tx.send(batch);
    }
    Ok(())
}

/// Where the first piece of `text` ends: just after the first line end at or past
/// `piece_bytes`, or the end of the text.
fn piece_end(text: &str, piece_bytes: usize) -> usize {
    if text.len() <= piece_bytes {
        return text.len();
    }
    // '\n' is ASCII, so the byte after it is a char boundary.
    text.as_bytes()[piece_bytes..].iter().position(|&b| b == b'\n').map_or(text.len(), |i| piece_bytes + i + 1)
}
