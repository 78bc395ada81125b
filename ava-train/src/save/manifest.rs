//! `manifest.json`, the last file a save writes: the step and the sha256 and size of every
//! other file. A checkpoint directory is complete exactly when it has a valid manifest, and
//! intact exactly when every file matches it ([`verify`]).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::SaveError;

/// The manifest's file name inside a checkpoint directory.
pub const MANIFEST_FILE: &str = "manifest.json";

/// The manifest format this version writes and reads.
pub const MANIFEST_FORMAT: u32 = 1;

/// The content of `manifest.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// Format version ([`MANIFEST_FORMAT`]).
    pub format: u32,
    /// The training step the checkpoint was taken at.
    pub step: u64,
    /// Every file of the checkpoint but the manifest, by name.
    pub files: BTreeMap<String, FileEntry>,
}

/// What the manifest records about one file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// sha256 of the content, lowercase hex.
    pub sha256: String,
    /// Size in bytes.
    pub bytes: u64,
}

impl Manifest {
    /// The manifest of `files` saved at `step`.
    pub fn new(step: u64, files: &[(String, Vec<u8>)]) -> Self {
        let files = files
            .iter()
            .map(|(name, bytes)| (name.clone(), FileEntry { sha256: sha256_hex(bytes), bytes: bytes.len() as u64 }))
            .collect();
        Self { format: MANIFEST_FORMAT, step, files }
    }

    /// The JSON text written to `manifest.json` (pretty, newline-terminated).
    pub fn to_json(&self) -> Vec<u8> {
        let mut text = serde_json::to_vec_pretty(self).unwrap_or_default();
        text.push(b'\n');
        text
    }

    /// Reads and checks `dir/manifest.json` (format, file names), without looking at the files.
    pub fn read(dir: &Path) -> Result<Self, SaveError> {
        let path = dir.join(MANIFEST_FILE);
        let text = match std::fs::read(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(SaveError::ManifestMissing { dir: dir.to_path_buf() });
            }
            Err(source) => return Err(SaveError::Io { action: "read".into(), path, source }),
        };
        let invalid = |reason: String| SaveError::ManifestInvalid { path: path.clone(), reason };
        let manifest: Self = serde_json::from_slice(&text).map_err(|e| invalid(format!("not a manifest: {e}")))?;
        if manifest.format != MANIFEST_FORMAT {
            return Err(invalid(format!(
                "format {} (this Ava reads format {MANIFEST_FORMAT}; use the Ava version that wrote it)",
                manifest.format
            )));
        }
        for name in manifest.files.keys() {
            check_file_name(name).map_err(|reason| invalid(format!("file name '{name}': {reason}")))?;
        }
        Ok(manifest)
    }
}

/// Checks `bytes`, read from `path`, against its manifest `entry`.
pub(crate) fn check_bytes(path: &Path, entry: &FileEntry, bytes: &[u8]) -> Result<(), SaveError> {
    check_size(path, entry, bytes.len() as u64)?;
    check_hash(path, entry, sha256_hex(bytes))
}

/// Recomputes the sha256 of every file `dir/manifest.json` lists (in name order, streaming);
/// the first missing, truncated or corrupted file is the error. Files the manifest does not
/// list are ignored. Returns the manifest.
pub fn verify(dir: impl AsRef<Path>) -> Result<Manifest, SaveError> {
    let dir = dir.as_ref();
    let manifest = Manifest::read(dir)?;
    for (name, entry) in &manifest.files {
        let path = dir.join(name);
        let mut file = open(&path)?;
        let size = file.metadata().map_err(|source| read_error(&path, source))?.len();
        check_size(&path, entry, size)?;
        let mut hasher = Sha256::new();
        let mut chunk = vec![0u8; 1 << 20];
        loop {
            let n = file.read(&mut chunk).map_err(|source| read_error(&path, source))?;
            if n == 0 {
                break;
            }
            hasher.update(&chunk[..n]);
        }
        check_hash(&path, entry, hex::encode(hasher.finalize()))?;
    }
    Ok(manifest)
}

/// sha256 of `bytes`, lowercase hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Why `name` cannot be a checkpoint file name, if it cannot: it must be a plain file name
/// (no directories), not hidden, and not the manifest's.
pub(crate) fn check_file_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        Err("the name is empty".into())
    } else if name.contains(['/', '\\', '\0']) {
        Err("a checkpoint holds plain files; the name must not contain '/', '\\' or NUL".into())
    } else if name.starts_with('.') {
        Err("names starting with '.' are reserved for the store's temporary files".into())
    } else if name == MANIFEST_FILE {
        Err("the store writes manifest.json itself; pick another name".into())
    } else {
        Ok(())
    }
}

/// Opens a file the manifest lists; absent is [`SaveError::FileMissing`].
pub(crate) fn open(path: &Path) -> Result<File, SaveError> {
    File::open(path).map_err(|source| match source.kind() {
        io::ErrorKind::NotFound => SaveError::FileMissing { path: path.to_path_buf() },
        _ => read_error(path, source),
    })
}

fn read_error(path: &Path, source: io::Error) -> SaveError {
    SaveError::Io { action: "read".into(), path: PathBuf::from(path), source }
}

fn check_size(path: &Path, entry: &FileEntry, found: u64) -> Result<(), SaveError> {
    if found != entry.bytes {
        return Err(SaveError::SizeMismatch { path: path.to_path_buf(), expected: entry.bytes, found });
    }
    Ok(())
}

fn check_hash(path: &Path, entry: &FileEntry, found: String) -> Result<(), SaveError> {
    if !found.eq_ignore_ascii_case(&entry.sha256) {
        return Err(SaveError::Corrupted { path: path.to_path_buf(), expected: entry.sha256.clone(), found });
    }
    Ok(())
}
