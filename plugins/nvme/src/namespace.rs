//! The run's own directory under the tier's path: `ava-run-<id>/`, with a `lock` file held
//! (`flock`) for the run's lifetime, so two runs never share files even when they are given
//! the same path. Directories whose lock nobody holds are left over from runs that ended
//! without cleaning up (killed, crashed); they are removed when the next run starts, since
//! offloaded records are scratch (a checkpoint copies what it needs).

use std::{
    fs::File,
    io::{self, Read},
    os::fd::AsRawFd,
    path::{Path, PathBuf},
};

use crate::record::{RunId, run_hex};

const PREFIX: &str = "ava-run-";

/// The run's directory, locked; removed with its records on drop.
#[derive(Debug)]
pub struct RunDir {
    /// `<path>/ava-run-<id>`.
    pub dir: PathBuf,
    /// The run's id, written into every record.
    pub id: RunId,
    /// Leftover directories of dead runs removed when this one was made.
    pub removed_leftovers: usize,
    /// `path` did not exist and was made (with its missing parents).
    pub created_path: bool,
    _lock: File,
}

/// Takes the `flock` on `file` without waiting: `Ok(false)` if another process holds it.
fn try_lock(file: &File) -> io::Result<bool> {
    // SAFETY: a valid open descriptor.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) { Ok(false) } else { Err(e) }
}

fn random_id() -> io::Result<RunId> {
    let mut id = [0u8; 16];
    File::open("/dev/urandom")?.read_exact(&mut id)?;
    Ok(id)
}

impl RunDir {
    /// Makes `path` if needed, removes dead runs' directories in it, and creates and locks a
    /// fresh run directory.
    pub fn create(path: &Path) -> io::Result<Self> {
        let created_path = !path.exists();
        std::fs::create_dir_all(path)?;
        let mut removed_leftovers = 0;
        for entry in std::fs::read_dir(path)? {
            let entry = entry?;
            let name = entry.file_name();
            if !name.to_string_lossy().starts_with(PREFIX) || !entry.file_type()?.is_dir() {
                continue;
            }
            let Ok(lock) = File::open(entry.path().join("lock")) else { continue };
            if try_lock(&lock)? {
                std::fs::remove_dir_all(entry.path())?;
                removed_leftovers += 1;
            }
        }
        loop {
            let id = random_id()?;
            let dir = path.join(format!("{PREFIX}{}", run_hex(&id)));
            match std::fs::create_dir(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
            let lock = File::create(dir.join("lock"))?;
            if !try_lock(&lock)? {
                return Err(io::Error::other(format!("{} is locked by another process", dir.display())));
            }
            return Ok(Self { dir, id, removed_leftovers, created_path, _lock: lock });
        }
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        // Scratch: nothing here outlives the run (the lock goes with the file).
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_get_their_own_locked_directories_and_dead_ones_are_cleared() {
        let root = tempfile::tempdir().unwrap();
        let a = RunDir::create(root.path()).unwrap();
        let b = RunDir::create(root.path()).unwrap();
        assert_ne!(a.dir, b.dir);
        assert_eq!((a.removed_leftovers, b.removed_leftovers), (0, 0), "a live run's directory is kept");
        // A dead run: its directory is there, its lock is not held.
        let dead = root.path().join("ava-run-0123");
        std::fs::create_dir(&dead).unwrap();
        File::create(dead.join("lock")).unwrap();
        std::fs::write(dead.join("x"), b"old").unwrap();
        let c = RunDir::create(root.path()).unwrap();
        assert_eq!(c.removed_leftovers, 1);
        assert!(!dead.exists() && a.dir.exists() && b.dir.exists());
        let dir = a.dir.clone();
        drop(a);
        assert!(!dir.exists(), "a run's records go with it");
    }
}
