//! [`SaveError`]: everything that can go wrong writing, finding, verifying or reading a
//! checkpoint, with messages meant to be printed as they are (what, where, how to fix).

use std::io;
use std::path::{Path, PathBuf};

/// An error of the checkpoint store. Its `Display` is the full report for the user.
#[derive(Debug, thiserror::Error)]
pub enum SaveError {
    /// A file-system operation failed (or a [`FaultInjector`](super::FaultInjector) made it fail).
    #[error(
        "cannot {action} {}: {source}; check that the directory exists and is writable and that the disk is not full",
        path.display()
    )]
    Io {
        /// What was being done, e.g. `fsync` or `rename /a/.tmp-step-00000001-7 to`.
        action: String,
        /// The file or directory it was done to.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// Something other than a directory (a link, a FIFO) where the store keeps its
    /// checkpoints: refused, never followed.
    #[error(transparent)]
    Planted(#[from] ava_fs::dirfd::DirError),
    /// The disk of the checkpoints has no room for the next one (checked before training).
    #[error(
        "a checkpoint of this run takes {} (weights {}, optimizer state {}, with headers) in {}, but its disk has \
         {} free: free up space there, or point train.out_dir at a disk with room; an older checkpoint is removed \
         only once a newer one is complete, so the disk needs room for one more. Checked before any step ran, so \
         nothing was lost",
        ava_core::format_size(*need),
        ava_core::format_size(*weights),
        ava_core::format_size(*state),
        root.display(),
        ava_core::format_size(*free)
    )]
    NoRoom {
        /// The checkpoint directory.
        root: PathBuf,
        /// Bytes of the weights.
        weights: u64,
        /// Bytes of the optimizer state (and of masters kept with it).
        state: u64,
        /// Bytes the checkpoint takes, headers included.
        need: u64,
        /// Bytes free on its disk.
        free: u64,
    },
    /// A file name given to [`CheckpointStore::save`](super::CheckpointStore::save) cannot be used.
    #[error("cannot save checkpoint file '{name}': {reason}")]
    BadFileName {
        /// The name as given.
        name: String,
        /// Why it is refused.
        reason: String,
    },
    /// A buffer given to [`to_safetensors`](super::to_safetensors) is inconsistent.
    #[error("tensor '{name}': {reason}")]
    BadBuffer {
        /// The tensor's name.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Bytes given to [`from_safetensors`](super::from_safetensors) are not a usable safetensors file.
    #[error("not a valid safetensors file: {reason}; the file is damaged or was not written by a safetensors writer")]
    Safetensors {
        /// What the parser said.
        reason: String,
    },
    /// The checkpoint directory has no `manifest.json`: the save never finished, or it is not a checkpoint.
    #[error(
        "{} is not a complete checkpoint (it has no manifest.json, so its save never finished); {}",
        dir.display(),
        earlier_hint(dir)
    )]
    ManifestMissing {
        /// The checkpoint directory.
        dir: PathBuf,
    },
    /// `manifest.json` exists but cannot be read or understood.
    #[error("checkpoint manifest {} is invalid: {reason}; the checkpoint cannot be used — {}", path.display(), earlier_hint(path.parent().unwrap_or(path)))]
    ManifestInvalid {
        /// The manifest file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A file the manifest lists is absent.
    #[error("checkpoint file {} is missing; the checkpoint cannot be used — {}", path.display(), earlier_hint(path.parent().unwrap_or(path)))]
    FileMissing {
        /// The file.
        path: PathBuf,
    },
    /// A file has another size than the manifest records (truncated, or written to since).
    #[error(
        "checkpoint file {} is truncated or was changed ({found} bytes, the manifest says {expected}); the checkpoint cannot be used — {}",
        path.display(),
        earlier_hint(path.parent().unwrap_or(path))
    )]
    SizeMismatch {
        /// The file.
        path: PathBuf,
        /// Size recorded in the manifest.
        expected: u64,
        /// Size on disk.
        found: u64,
    },
    /// A file's content does not match its recorded sha256. The digest found is kept out of
    /// the message: it is a digest of a file that is not the one expected.
    #[error(
        "checkpoint file {} is corrupted (sha256 mismatch: expected {expected}, its bytes differ); the checkpoint \
         cannot be used — {}",
        path.display(),
        earlier_hint(path.parent().unwrap_or(path))
    )]
    Corrupted {
        /// The file.
        path: PathBuf,
        /// The sha256 the manifest records (hex).
        expected: String,
        /// The sha256 of the bytes on disk (hex).
        found: String,
    },
    /// A file of the checkpoint is a symbolic link another user made: not followed, as it
    /// could lead to any file this process may read (resumed as root, to another user's
    /// secrets).
    #[error(
        "checkpoint file {} is a symbolic link owned by uid {owner}, another user: a checkpoint's files are followed \
         only through links this user or root made; ask its owner to put the file itself there, or copy the \
         checkpoint (cp -rL) after checking where its links lead",
        path.display()
    )]
    ForeignLink {
        /// The link.
        path: PathBuf,
        /// Its owner.
        owner: u32,
    },
    /// `resolve("latest")` found nothing to resume from.
    #[error("no checkpoint found in {}{detail}; train first, or pass --resume PATH", root.display())]
    NoCheckpoint {
        /// The store's root directory.
        root: PathBuf,
        /// Extra detail, e.g. ` (latest names step-00000005, which does not exist)`; may be empty.
        detail: String,
    },
    /// A path given to `resolve` is not a checkpoint directory.
    #[error(
        "{} is not a checkpoint: {reason}; pass a checkpoint directory (one holding manifest.json), the directory holding the checkpoints, or `latest`",
        path.display()
    )]
    NotACheckpoint {
        /// The path as given.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// A [`LoadedCheckpoint`](super::LoadedCheckpoint) has no file of the requested name.
    #[error("checkpoint {} has no file '{name}' (it has: {available}); it was written by another trainer or version", dir.display())]
    NoSuchFile {
        /// The checkpoint directory.
        dir: PathBuf,
        /// The requested name.
        name: String,
        /// The names it does have, comma-separated.
        available: String,
    },
    /// The checkpoint was saved and `latest` names it, but removing an old checkpoint or a
    /// leftover of a crashed save failed. Training can go on; the space is not reclaimed.
    #[error("checkpoint {} was saved, but cleaning up {} failed: {source}; remove it by hand", saved.display(), path.display())]
    Prune {
        /// The checkpoint just saved (complete, and named by `latest`).
        saved: PathBuf,
        /// What could not be removed.
        path: PathBuf,
        /// The error (a [`SaveError::Io`] or an injected fault).
        #[source]
        source: Box<SaveError>,
    },
}

/// `resume from an earlier one: ls PARENT` for a checkpoint directory.
fn earlier_hint(dir: &Path) -> String {
    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.display().to_string(),
        _ => ".".to_string(),
    };
    format!("resume from an earlier one: ls {parent}")
}
