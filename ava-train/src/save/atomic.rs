//! Durable file writes: [`write_atomic`] replaces a file so that after a crash it holds
//! either the old or the new content, never a mix; [`fsync_dir`] makes a directory's entries
//! (creations, renames) survive a power loss.
//!
//! Files are always created anew (`O_CREAT|O_EXCL|O_NOFOLLOW`): a link planted under a temp
//! name in a directory others can write is never written through, and the rename that puts
//! the file in place replaces a link at its name instead of following it.

use std::fs::{self, File};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::SaveError;
use super::faults::{FaultInjector, durable, has_fired};

/// Tells temp files of one process apart.
static COUNTER: AtomicU64 = AtomicU64::new(0);

/// Replaces `path` with `bytes` atomically and durably: writes a temp file in the same
/// directory (`.{name}.tmp-{pid}-{n}`), fsyncs it, renames it over `path`, fsyncs the directory.
pub fn write_atomic(path: impl AsRef<Path>, bytes: &[u8]) -> Result<(), SaveError> {
    write_atomic_with(path.as_ref(), bytes, None)
}

/// [`write_atomic`] of content that `write` produces piece by piece (a file larger than
/// memory): into the temp file through a buffer, then fsync, rename and directory fsync.
pub fn write_atomic_streamed(
    path: impl AsRef<Path>,
    write: impl FnOnce(&mut dyn std::io::Write) -> Result<(), SaveError>,
) -> Result<(), SaveError> {
    replace_atomically(path.as_ref(), None, |tmp| write_streamed_synced(tmp, write, None))
}

/// Fsyncs the directory `dir`, so that entries created, renamed or removed in it are durable.
pub fn fsync_dir(dir: impl AsRef<Path>) -> Result<(), SaveError> {
    fsync_dir_with(dir.as_ref(), None)
}

/// The parent directory of `path` (`.` for a bare file name).
pub(crate) fn parent_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// [`fsync_dir`], counted by `faults`.
pub(crate) fn fsync_dir_with(dir: &Path, faults: Option<&FaultInjector>) -> Result<(), SaveError> {
    durable(faults, "fsync directory", dir, || File::open(dir)?.sync_all())
}

/// Creates the new file `path`, never through a link: whatever is already there (a link
/// included) makes it fail.
fn create_new(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    fs::OpenOptions::new().write(true).create_new(true).custom_flags(libc::O_NOFOLLOW).open(path)
}

/// Creates the new file `path`, writes `bytes` and fsyncs it: two durable operations.
pub(crate) fn write_synced(path: &Path, bytes: &[u8], faults: Option<&FaultInjector>) -> Result<(), SaveError> {
    let file = durable(faults, "write", path, || {
        let mut file = create_new(path)?;
        file.write_all(bytes)?;
        Ok(file)
    })?;
    durable(faults, "fsync", path, || file.sync_all())
}

/// [`write_synced`] of content that `write` produces piece by piece, through a 1 MiB buffer:
/// the same two durable operations.
pub(crate) fn write_streamed_synced(
    path: &Path,
    write: impl FnOnce(&mut dyn std::io::Write) -> Result<(), SaveError>,
    faults: Option<&FaultInjector>,
) -> Result<(), SaveError> {
    let file = durable(faults, "write", path, || create_new(path))?;
    let mut out = std::io::BufWriter::with_capacity(1 << 20, file);
    write(&mut out)?;
    let file = out.into_inner().map_err(|e| SaveError::Io {
        action: "write".into(),
        path: path.to_path_buf(),
        source: e.into_error(),
    })?;
    durable(faults, "fsync", path, || file.sync_all())
}

/// [`write_atomic`], counted by `faults`.
pub(crate) fn write_atomic_with(path: &Path, bytes: &[u8], faults: Option<&FaultInjector>) -> Result<(), SaveError> {
    replace_atomically(path, faults, |tmp| write_synced(tmp, bytes, faults))
}

/// Replaces `path` with the file `fill` writes (durably) under a temp name beside it: the
/// rename and the directory fsync that follow make the swap atomic and durable.
fn replace_atomically(
    path: &Path,
    faults: Option<&FaultInjector>,
    fill: impl FnOnce(&Path) -> Result<(), SaveError>,
) -> Result<(), SaveError> {
    let dir = parent_dir(path);
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    // A free temp name (one taken, e.g. planted, is skipped; the file is created exclusively).
    let tmp = loop {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let tmp = dir.join(format!(".{name}.tmp-{}-{n}", std::process::id()));
        if fs::symlink_metadata(&tmp).is_err() {
            break tmp;
        }
    };
    let result = fill(&tmp)
        .and_then(|()| durable(faults, &format!("rename {} to", tmp.display()), path, || fs::rename(&tmp, path)))
        .and_then(|()| fsync_dir_with(&dir, faults));
    if result.is_err() && !has_fired(faults) {
        // A real error (not a simulated kill): do not leave the temp file behind.
        let _ = fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A link planted under the name a write creates is never written through.
    #[test]
    fn a_link_planted_at_a_new_file_is_not_written_through() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        fs::write(&victim, b"keep").unwrap();
        let planted = dir.path().join("manifest.json");
        std::os::unix::fs::symlink(&victim, &planted).unwrap();
        let e = write_synced(&planted, b"{}", None).unwrap_err();
        assert!(e.to_string().contains("cannot write"), "{e}");
        // Replaced atomically, the link itself is replaced.
        write_atomic(&planted, b"{}").unwrap();
        assert_eq!(fs::read(&victim).unwrap(), b"keep");
        assert_eq!(fs::read(&planted).unwrap(), b"{}");
        assert!(fs::symlink_metadata(&planted).unwrap().is_file());
    }
}
