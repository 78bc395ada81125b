//! `manifest.json`, the last file a save writes: the step and the sha256 and size of every
//! other file. A checkpoint directory is complete exactly when it has a valid manifest, and
//! intact exactly when every file matches it ([`verify`]).

use std::collections::BTreeMap;
use std::fs::File;
use std::io;
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
        let invalid = |reason: String| SaveError::ManifestInvalid { path: path.clone(), reason };
        // Bounded: a manifest is a few kilobytes; a FIFO or a device in its place is refused.
        let text = match ava_fs::bounded::read(&path, ava_fs::bounded::limits::JSON) {
            Ok(text) => text,
            Err(e) if e.is_missing() => return Err(SaveError::ManifestMissing { dir: dir.to_path_buf() }),
            Err(ava_fs::bounded::ReadError::Io { source, .. }) => {
                return Err(SaveError::Io { action: "read".into(), path, source });
            }
            Err(e) => return Err(invalid(unprefixed(&e))),
        };
        let manifest: Self = serde_json::from_slice(&text).map_err(|e| invalid(format!("not a manifest: {e}")))?;
        if manifest.format != MANIFEST_FORMAT {
            return Err(invalid(format!(
                "format {} (this Ava reads format {MANIFEST_FORMAT}; use the Ava version that wrote it)",
                manifest.format
            )));
        }
        for (name, entry) in &manifest.files {
            check_file_name(name).map_err(|reason| invalid(format!("file name '{name}': {reason}")))?;
            if entry.sha256.len() != 64 || !entry.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(invalid(format!("files.{name}.sha256 is {:?}, not 64 hex digits", entry.sha256)));
            }
            // A size past what any disk holds is damage, refused before anything is sized by it.
            if entry.bytes > MAX_FILE_BYTES {
                return Err(invalid(format!(
                    "files.{name}.bytes is {}, more than the {MAX_FILE_BYTES} bytes a checkpoint file can have",
                    entry.bytes
                )));
            }
        }
        Ok(manifest)
    }
}

/// The largest checkpoint file a manifest may list (1 PiB): a bound on sizes read from it.
pub const MAX_FILE_BYTES: u64 = 1 << 50;

/// A bounded read's error without its leading "path: " (the caller's message names the path).
pub(crate) fn unprefixed(e: &ava_fs::bounded::ReadError) -> String {
    let full = e.to_string();
    let prefix = format!("{}: ", e.path().display());
    full.strip_prefix(&prefix).map(str::to_string).unwrap_or(full)
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
        let hash = ava_data::shard::sha256_of(&mut file).map_err(|source| read_error(&path, source))?;
        check_hash(&path, entry, hash)?;
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
/// Opened without blocking and checked to be a regular file: a FIFO in a checkpoint would
/// otherwise hang `File::open` itself.
/// Links are followed only through this user's or root's, link after link, and the file
/// opened must be the one that walk ended at: another user's link anywhere on the way, or a
/// file swapped in between, is refused.
pub(crate) fn open(path: &Path) -> Result<File, SaveError> {
    use ava_fs::bounded::{ReadError, open_regular};
    use std::os::unix::fs::MetadataExt as _;
    let walked = walk_links(path)?;
    match open_regular(path, u64::MAX) {
        Ok((file, _)) => {
            let meta = file.metadata().map_err(|source| read_error(path, source))?;
            if walked.is_some_and(|id| id != (meta.dev(), meta.ino())) {
                let why = "it was replaced while it was opened: another process is changing the checkpoint's files";
                return Err(read_error(path, io::Error::other(why)));
            }
            Ok(file)
        }
        Err(ReadError::Missing(_)) => Err(SaveError::FileMissing { path: path.to_path_buf() }),
        Err(ReadError::Io { source, .. }) => Err(read_error(path, source)),
        Err(e) => {
            let dir = path.parent().unwrap_or(Path::new("."));
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            Err(SaveError::ManifestInvalid {
                path: dir.join(MANIFEST_FILE),
                reason: format!("it lists '{name}', which {}", unprefixed(&e).split(';').next().unwrap_or_default()),
            })
        }
    }
}

/// Follows `path`'s links (at most 40) while this user or root owns each, and returns the
/// (device, inode) they end at; None when something on the way is missing (the open says
/// what). Another user's link is [`SaveError::ForeignLink`].
fn walk_links(path: &Path) -> Result<Option<(u64, u64)>, SaveError> {
    use std::os::unix::fs::MetadataExt as _;
    let mut at = path.to_path_buf();
    for _ in 0..40 {
        let Ok(meta) = std::fs::symlink_metadata(&at) else { return Ok(None) };
        if !meta.file_type().is_symlink() {
            return Ok(Some((meta.dev(), meta.ino())));
        }
        if !ava_fs::dirfd::own_link(meta.mode(), meta.uid()) {
            return Err(SaveError::ForeignLink { path: at, owner: meta.uid() });
        }
        let next = std::fs::read_link(&at).map_err(|source| read_error(&at, source))?;
        at = at.parent().unwrap_or(Path::new("/")).join(next);
    }
    Ok(None)
}

fn read_error(path: &Path, source: io::Error) -> SaveError {
    SaveError::Io { action: "read".into(), path: PathBuf::from(path), source }
}

pub(crate) fn check_size(path: &Path, entry: &FileEntry, found: u64) -> Result<(), SaveError> {
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
