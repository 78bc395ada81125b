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

    /// The sum, or `None` when a count does not fit in 64 bits.
    fn checked_add(self, other: Counts) -> Option<Counts> {
        Some(Counts {
            tokens: self.tokens.checked_add(other.tokens)?,
            documents: self.documents.checked_add(other.documents)?,
        })
    }
}

fn is_sha256(text: &str) -> bool {
    text.len() == 64 && text.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Checks a shard's file name as a manifest gives it: one plain name (no directory, no `..`
/// or `.`, not absolute, no NUL, not empty), so that it names a file inside the corpus
/// directory and nothing else. The error says what is wrong, quoting the name.
pub fn check_shard_name(name: &str) -> Result<(), String> {
    use std::path::Component;
    let quoted = serde_json::to_string(name).unwrap_or_default();
    let plain = !name.is_empty()
        && !name.contains('\0')
        && !name.contains('/')
        && matches!(Path::new(name).components().collect::<Vec<_>>()[..], [Component::Normal(_)]);
    if plain {
        return Ok(());
    }
    Err(format!(
        "is {quoted}: a shard must be named by a plain file name inside the corpus directory (no directory, `..`, \
         absolute path or NUL)"
    ))
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
        let bytes = ava_fs::bounded::read(&path, ava_fs::bounded::limits::JSON).map_err(|e| match e {
            ava_fs::bounded::ReadError::Missing(_) => DataError::NoManifest { dir: dir.to_path_buf() },
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
        let manifest: Self = serde_json::from_value(probe).map_err(|e| bad(e.to_string()))?;
        manifest
            .check()
            .map_err(|reason| bad(format!("{reason}; the manifest is damaged: prepare the corpus again")))?;
        Ok(manifest)
    }

    /// Checks what the numbers and names size and reach: the id width and the ids against
    /// the vocabulary, each shard's file name (a plain name inside the corpus directory) and
    /// counts, and the totals against the shards' (with checked sums: a total that does not
    /// fit in 64 bits is refused, not wrapped). The error names the key.
    pub fn check(&self) -> Result<(), String> {
        if !matches!(self.id_bytes, 2 | 4) {
            return Err(format!("id_bytes is {}; it must be 2 or 4", self.id_bytes));
        }
        let most = if self.id_bytes == 2 { 1u64 << 16 } else { 1u64 << 32 };
        if self.vocab_size == 0 || self.vocab_size > most {
            return Err(format!(
                "vocab_size is {}; with {}-byte ids it must be between 1 and {most}",
                self.vocab_size, self.id_bytes
            ));
        }
        for (key, id) in [("eos_id", Some(self.eos_id)), ("bos_id", self.bos_id)] {
            if let Some(id) = id.filter(|&id| u64::from(id) >= self.vocab_size) {
                return Err(format!("{key} is {id}; it must be below vocab_size ({})", self.vocab_size));
            }
        }
        if !(0.0..1.0).contains(&self.val_fraction) {
            return Err(format!("val_fraction is {}; it must be at least 0 and below 1", self.val_fraction));
        }
        if let TokenizerId::Huggingface { sha256, .. } = &self.tokenizer
            && !is_sha256(sha256)
        {
            return Err(format!("tokenizer.sha256 is {sha256:?}; it must be 64 hex digits"));
        }
        let (mut train, mut validation, mut documents) = (Counts::default(), Counts::default(), 0u64);
        let overflow = |key: &str| format!("{key}: the shards' counts add up to more than 2^64");
        for (i, shard) in self.shards.iter().enumerate() {
            check_shard_name(&shard.file).map_err(|e| format!("shards[{i}].file {e}"))?;
            if !is_sha256(&shard.sha256) {
                return Err(format!("shards[{i}].sha256 is {:?}; it must be 64 hex digits", shard.sha256));
            }
            for (key, counts) in [("train", shard.train), ("validation", shard.validation)] {
                if counts.documents > counts.tokens {
                    return Err(format!(
                        "shards[{i}].{key}: {} documents in {} tokens; every document holds at least its \
                         end-of-text id",
                        counts.documents, counts.tokens
                    ));
                }
            }
            train = train.checked_add(shard.train).ok_or_else(|| overflow("train"))?;
            validation = validation.checked_add(shard.validation).ok_or_else(|| overflow("validation"))?;
            documents = documents
                .checked_add(shard.train.documents)
                .and_then(|d| d.checked_add(shard.validation.documents))
                .ok_or_else(|| overflow("documents"))?;
        }
        for (key, total, sum) in [("train", self.train, train), ("validation", self.validation, validation)] {
            if total != sum {
                return Err(format!(
                    "{key} says {} tokens in {} documents, but its shards hold {} tokens in {} documents",
                    total.tokens, total.documents, sum.tokens, sum.documents
                ));
            }
        }
        if self.documents != documents {
            return Err(format!("documents is {}, but its shards hold {documents}", self.documents));
        }
        Ok(())
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
