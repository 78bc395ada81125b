//! One `ava data prepare` per corpus directory: [`OutLock`] holds the exclusive lock
//! ([`ava_fs::dir_lock`], the one `ava train` takes on its `train.out_dir`) on
//! `<--out>/.ava-prepare.lock` for the whole preparation, so a second prepare into the same
//! directory is refused at once, naming the holder, instead of the two overwriting each
//! other's manifest and shards. The lock file is not part of the corpus: the manifest lists
//! the corpus's files, and a fresh prepare leaves the lock file alone.

use std::path::Path;

use ava_fs::dir_lock::{Acquired, DirLock};
use ava_fs::dirfd::DirError;

use super::PrepareError;

/// The lock file inside the corpus directory.
pub const LOCK_FILE: &str = ".ava-prepare.lock";

/// The exclusive lock on a corpus directory, held until dropped (or the process ends).
#[derive(Debug)]
pub struct OutLock {
    _lock: DirLock,
}

impl OutLock {
    /// Creates `dir` if needed and takes its lock without waiting; [`PrepareError::Busy`]
    /// names the holder when another process has it.
    pub fn acquire(dir: &Path) -> Result<Self, PrepareError> {
        if dir.exists() && !dir.is_dir() {
            return Err(PrepareError::OutInUse {
                dir: dir.to_path_buf(),
                what: "is a file, not a directory".into(),
                action: "(no: --force does not replace files) choose a directory",
            });
        }
        let io_err = |e: DirError| match e {
            DirError::Io { source, .. } => PrepareError::Write { dir: dir.to_path_buf(), shards: 0, source },
            refused => PrepareError::Planted(refused.to_string()),
        };
        match DirLock::acquire(dir, LOCK_FILE).map_err(io_err)? {
            Acquired::Held(lock) => Ok(Self { _lock: lock }),
            Acquired::Busy { pid, holder } => {
                Err(PrepareError::Busy { dir: dir.to_path_buf(), lock: dir.join(LOCK_FILE), pid, holder })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_prepare_is_refused_naming_the_holder_and_what_to_do() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("corpus");
        let lock = OutLock::acquire(&out).unwrap();
        let err = OutLock::acquire(&out).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, PrepareError::Busy { pid: Some(p), .. } if p == std::process::id()), "{text}");
        assert!(text.contains(&format!("in use by another ava data prepare (pid {}", std::process::id())), "{text}");
        assert!(text.contains(".ava-prepare.lock") && text.contains("choose another --out"), "{text}");
        drop(lock);
        OutLock::acquire(&out).unwrap();
    }

    #[test]
    fn a_link_in_place_of_the_lock_file_is_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("corpus");
        std::fs::create_dir(&out).unwrap();
        std::os::unix::fs::symlink(dir.path().join("elsewhere"), out.join(LOCK_FILE)).unwrap();
        let err = OutLock::acquire(&out).unwrap_err().to_string();
        assert!(err.starts_with(&format!("--out {}: is a symbolic link", out.join(LOCK_FILE).display())), "{err}");
        assert!(!dir.path().join("elsewhere").exists(), "nothing is created through the link");
    }
}
