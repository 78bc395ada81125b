//! `manifest.json`: what a prepared corpus holds and how it was made. Written atomically
//! (a temporary file, fsynced, renamed over the old one, the directory fsynced) after every
//! finished shard, so it never lists a shard that is not complete on disk, and a killed
//! `prepare` continues from it.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::DataError;
use crate::shard::Room;

/// The file name inside a corpus directory.
pub const FILE: &str = "manifest.json";
/// The `format` string every manifest carries.
pub const FORMAT: &str = "ava-token-shards";
/// The manifest version this build writes; it reads this one and older.
pub const VERSION: u32 = 1;

/// How text became token ids.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum TokenizerId {
    /// Raw bytes: ids 0–255, and 256 for end of text.
    Byte,
    /// A Hugging Face `tokenizer.json`, identified by the SHA-256 of its bytes.
    Huggingface {
        /// Where it was read from at prepare time (informative).
        file: PathBuf,
        /// SHA-256 of the file, hex.
        sha256: String,
    },
}

impl TokenizerId {
    /// Whether two corpora were tokenized alike: both bytes, or tokenizer files with the same
    /// bytes wherever they were read from.
    pub fn same_as(&self, other: &TokenizerId) -> bool {
        match (self, other) {
            (TokenizerId::Byte, TokenizerId::Byte) => true,
            (TokenizerId::Huggingface { sha256: a, .. }, TokenizerId::Huggingface { sha256: b, .. }) => a == b,
            _ => false,
        }
    }

    /// How the tokenizer reads in messages.
    pub fn describe(&self) -> String {
        match self {
            TokenizerId::Byte => "the byte tokenizer".into(),
            TokenizerId::Huggingface { file, sha256 } => {
                format!("tokenizer {} (sha256 {})", file.display(), &sha256[..12.min(sha256.len())])
            }
        }
    }
}

/// Token and document counts of one split.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Counts {
    /// Token ids, end-of-text ids included.
    pub tokens: u64,
    /// Documents.
    pub documents: u64,
}

impl Counts {
    fn add(&mut self, other: Counts) {
        self.tokens += other.tokens;
        self.documents += other.documents;
    }
}

/// One finished shard.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardEntry {
    /// File name inside the corpus directory.
    pub file: String,
    /// Size of the file.
    pub bytes: u64,
    /// SHA-256 of the whole file, hex.
    pub sha256: String,
    /// Index (in input order) of the shard's first document.
    pub first_document: u64,
    /// Its train region.
    pub train: Counts,
    /// Its validation region.
    pub validation: Counts,
}

/// One input as it was when preparation started: a rerun with other inputs, or changed
/// ones, must not continue a half-finished corpus.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InputFile {
    /// The file.
    pub path: PathBuf,
    /// Its size.
    pub bytes: u64,
    /// Its modification time, seconds since the epoch (0 when the system has none).
    pub modified: u64,
}

/// `manifest.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`FORMAT`].
    pub format: String,
    /// The manifest version.
    pub version: u32,
    /// True once every input is in a shard.
    pub complete: bool,
    /// The tokenizer.
    pub tokenizer: TokenizerId,
    /// One more than the largest id the tokenizer can produce.
    pub vocab_size: u64,
    /// Bytes per stored id: 2 when the vocabulary fits in u16, else 4.
    pub id_bytes: u32,
    /// The end-of-text id appended to every document.
    pub eos_id: u32,
    /// A beginning-of-text id put before every document, if the tokenizer has one and it
    /// was asked for.
    pub bos_id: Option<u32>,
    /// Share of documents held out for validation, chosen by a hash of their index.
    pub val_fraction: f64,
    /// Ids per shard the run was asked for (a shard holds at least this many, the last fewer).
    pub shard_tokens: u64,
    /// The options that decide which documents the inputs hold, in words (format, field,
    /// separator, invalid-UTF-8 handling): compared on a rerun.
    pub reading: String,
    /// The inputs, in the order their documents are numbered.
    pub inputs: Vec<InputFile>,
    /// Documents in the shards.
    pub documents: u64,
    /// Text bytes read for those documents.
    pub text_bytes: u64,
    /// Train totals.
    pub train: Counts,
    /// Validation totals.
    pub validation: Counts,
    /// The finished shards, in order.
    pub shards: Vec<ShardEntry>,
}

impl Manifest {
    /// Adds a finished shard to the totals.
    pub fn push(&mut self, shard: ShardEntry, text_bytes: u64) {
        self.train.add(shard.train);
        self.validation.add(shard.validation);
        self.documents += shard.train.documents + shard.validation.documents;
        self.text_bytes += text_bytes;
        self.shards.push(shard);
    }

    /// Reads `dir/manifest.json`. A newer version, or a file that is not a manifest, is an
    /// error naming the file.
    pub fn load(dir: &Path) -> Result<Self, DataError> {
        let path = dir.join(FILE);
        let bad = |reason: String| DataError::Manifest { path: path.clone(), reason };
        let bytes = ava_plugins::bounded::read(&path, ava_plugins::bounded::limits::JSON).map_err(|e| match e {
            ava_plugins::bounded::ReadError::Missing(_) => DataError::NoManifest { dir: dir.to_path_buf() },
            other => bad(other.to_string()),
        })?;
        // The version is read first so that a newer manifest is named as such, not as a
        // parse error about whatever field it added.
        let probe: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| bad(format!("not JSON: {e}")))?;
        if probe.get("format").and_then(|f| f.as_str()) != Some(FORMAT) {
            return Err(bad(format!("not an Ava corpus manifest (its \"format\" is not \"{FORMAT}\")")));
        }
        let version = probe.get("version").and_then(|v| v.as_u64()).unwrap_or(0);
        if version > u64::from(VERSION) {
            return Err(bad(format!(
                "written by a newer Ava (manifest version {version}; this build reads up to {VERSION}): update ava, \
                 or prepare the corpus again with this one"
            )));
        }
        serde_json::from_value(probe).map_err(|e| bad(e.to_string()))
    }

    /// Writes `dir/manifest.json` atomically.
    pub fn save(&self, dir: &Path) -> std::io::Result<()> {
        self.save_within(dir, u64::MAX)
    }

    /// [`save`](Self::save) on a disk with room for `room` more bytes of the file (see
    /// [`Room`]). A failed write removes the temporary file, giving its
    /// space back; the manifest before stays.
    pub(crate) fn save_within(&self, dir: &Path, room: u64) -> std::io::Result<()> {
        let tmp = dir.join(format!("{FILE}.tmp"));
        let write = || {
            let mut file = Room { inner: File::create(&tmp)?, left: room };
            file.write_all(&serde_json::to_vec_pretty(self).expect("a manifest serializes"))?;
            file.write_all(b"\n")?;
            file.inner.sync_all()
        };
        if let Err(e) = write() {
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
        fs::rename(&tmp, dir.join(FILE))?;
        sync_dir(dir)
    }
}

/// fsyncs a directory, so a rename in it survives a crash.
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}
