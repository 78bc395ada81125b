//! One run per output directory: [`RunLock`] holds the exclusive lock
//! ([`ava_fs::dir_lock`]) on `<train.out_dir>/.ava-run.lock` for the whole run, so a
//! second `ava train` on the same directory is refused (rather than the two saves deleting
//! each other's temporary files); and [`previous_run`] finds the files a finished or stopped
//! run left there, so a fresh run does not silently mix its checkpoints and metrics with them.

use std::fs;
use std::path::{Path, PathBuf};

use ava_fs::dir_lock::{Acquired, DirLock};
use ava_fs::dirfd::DirError;

/// The lock file inside the run directory.
pub const LOCK_FILE: &str = ".ava-run.lock";

/// What a run writes into its directory, and what `--overwrite` removes (nothing else there
/// is touched): the metrics, the checkpoints, the final model, `ava report`'s charts and the
/// steps `--memory-trace` recorded.
pub const RUN_FILES: &[&str] = &["metrics.jsonl", "checkpoints", "model", "report", "memory"];

/// Why the run directory cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum RunDirError {
    /// Another process holds the lock.
    #[error(
        "the run directory {} is in use by another ava train ({holder}; it holds {}): wait for that run to \
         finish or stop it (kill -INT {pid} saves a checkpoint first), or give this run another train.out_dir",
        dir.display(),
        dir.join(LOCK_FILE).display(),
        pid = pid.map_or("its pid".to_string(), |p| p.to_string())
    )]
    Busy {
        /// The run directory.
        dir: PathBuf,
        /// The holder's pid, as its lock file says.
        pid: Option<u32>,
        /// The holder as its lock file describes it: pid, host, how long ago it started.
        holder: String,
    },
    /// Creating, opening or locking the directory's lock file failed.
    #[error("{}: {message}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        message: String,
    },
}

impl RunDirError {
    /// A [`DirError`] naming its path once.
    fn from_dir(e: DirError) -> Self {
        let full = e.to_string();
        let path = e.path().map(Path::to_path_buf).unwrap_or_default();
        let message = full.strip_prefix(&format!("{}: ", path.display())).map(str::to_string).unwrap_or(full);
        Self::Io { path, message }
    }
}

/// The exclusive lock on a run directory, held until dropped (or the process ends).
#[derive(Debug)]
pub struct RunLock {
    lock: DirLock,
    /// The directory did not exist before this lock made it.
    created: bool,
}

impl RunLock {
    /// Creates `dir` if needed and takes its lock without waiting; [`RunDirError::Busy`]
    /// names the holder when another process has it. The lock file is opened relative to
    /// the directory: a link, FIFO or device planted there is refused at once.
    pub fn acquire(dir: &Path) -> Result<Self, RunDirError> {
        let created = fs::symlink_metadata(dir).is_err();
        match DirLock::acquire(dir, LOCK_FILE).map_err(RunDirError::from_dir)? {
            Acquired::Held(lock) => Ok(Self { lock, created }),
            Acquired::Busy { pid, holder } => Err(RunDirError::Busy { dir: dir.to_path_buf(), pid, holder }),
        }
    }

    /// The locked directory.
    pub fn dir(&self) -> &Path {
        self.lock.dir()
    }

    /// Gives the directory up after a run that was refused before it wrote anything: the
    /// lock file is removed, and the directory too when this lock made it and nothing else is
    /// in it, so a refused run leaves nothing behind. (A process that opened the old file
    /// meanwhile finds it unlinked once it locks it, and locks the name's new file instead:
    /// `DirLock::acquire`.)
    pub fn release_unused(self) {
        let dir = self.dir().to_path_buf();
        let _ = fs::remove_file(dir.join(LOCK_FILE));
        if self.created {
            // Fails, and keeps it, if anything else is in it.
            let _ = fs::remove_dir(&dir);
        }
        drop(self);
    }

    /// Removes the previous run's [`RUN_FILES`] (`--overwrite`); only with the lock held, so
    /// never from under a run that is still going.
    pub fn remove_previous_run(&self) -> Result<(), RunDirError> {
        for name in RUN_FILES {
            let path = self.dir().join(name);
            let removed = match fs::symlink_metadata(&path) {
                Err(_) => Ok(()),
                Ok(m) if m.is_dir() => fs::remove_dir_all(&path),
                Ok(_) => fs::remove_file(&path),
            };
            removed.map_err(|e| RunDirError::Io { path, message: format!("cannot remove it: {e}") })?;
        }
        Ok(())
    }
}

/// The files of an earlier run in `dir` (names of [`RUN_FILES`] that hold something); empty
/// for a new, empty or unrelated directory. An empty `metrics.jsonl` (a run that failed
/// before its first step) does not count.
pub fn previous_run(dir: &Path) -> Vec<String> {
    RUN_FILES
        .iter()
        .filter(|name| {
            let path = dir.join(name);
            match fs::metadata(&path) {
                Err(_) => false,
                Ok(m) if m.is_dir() => fs::read_dir(&path).is_ok_and(|mut d| d.next().is_some()),
                Ok(m) => m.len() > 0,
            }
        })
        .map(|name| name.to_string())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_run_leaves_no_lock_and_no_directory_it_made() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("new");
        RunLock::acquire(&run).unwrap().release_unused();
        assert!(!run.exists());
        // A directory that was there stays, without the lock file; one holding more stays whole.
        let there = dir.path().join("there");
        fs::create_dir(&there).unwrap();
        RunLock::acquire(&there).unwrap().release_unused();
        assert!(there.is_dir() && !there.join(LOCK_FILE).exists());
        let lock = RunLock::acquire(&run).unwrap();
        fs::write(run.join("metrics.jsonl"), b"").unwrap();
        lock.release_unused();
        assert!(run.join("metrics.jsonl").is_file() && !run.join(LOCK_FILE).exists());
    }

    #[test]
    fn a_second_lock_is_refused_naming_the_holder_and_freed_on_drop() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        let lock = RunLock::acquire(&run).unwrap();
        let err = RunLock::acquire(&run).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, RunDirError::Busy { pid: Some(p), .. } if p == std::process::id()), "{text}");
        assert!(text.contains(&format!("pid {}", std::process::id())) && text.contains("another train.out_dir"));
        drop(lock);
        // The file stays; its lock went with the descriptor.
        assert!(run.join(LOCK_FILE).is_file());
        RunLock::acquire(&run).unwrap();
    }

    #[test]
    fn previous_run_files_are_found_and_removed_with_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        assert!(previous_run(dir.path()).is_empty());
        fs::write(dir.path().join("metrics.jsonl"), "").unwrap();
        fs::create_dir(dir.path().join("checkpoints")).unwrap();
        assert!(previous_run(dir.path()).is_empty(), "empty files and directories are no run");
        fs::write(dir.path().join("metrics.jsonl"), "{}\n").unwrap();
        fs::create_dir_all(dir.path().join("checkpoints/step-00000002")).unwrap();
        fs::write(dir.path().join("notes.txt"), "mine").unwrap();
        assert_eq!(previous_run(dir.path()), ["metrics.jsonl", "checkpoints"]);
        let lock = RunLock::acquire(dir.path()).unwrap();
        lock.remove_previous_run().unwrap();
        assert!(previous_run(dir.path()).is_empty());
        assert!(dir.path().join("notes.txt").is_file() && dir.path().join(LOCK_FILE).is_file());
    }

    /// The uid of `nobody`, the other user of these tests.
    const NOBODY: u32 = 65534;

    /// A run directory owned by another user (`nobody`), as root; `None` (the test skipped,
    /// saying why) when this process cannot make files another user's.
    fn foreign_run_dir(test: &str) -> Option<tempfile::TempDir> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipping {test}: it needs root, to make a run directory owned by uid {NOBODY}");
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        std::os::unix::fs::chown(dir.path(), Some(NOBODY), Some(NOBODY)).unwrap();
        Some(dir)
    }

    /// `f` on another thread; the test fails instead of hanging if it waits.
    fn within<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(std::time::Duration::from_secs(20)).expect("it waited instead of answering")
    }

    #[test]
    fn a_fifo_or_a_link_planted_as_the_lock_file_is_refused_at_once() {
        let Some(dir) = foreign_run_dir("a_fifo_or_a_link_planted_as_the_lock_file_is_refused_at_once") else {
            return;
        };
        let lock = dir.path().join(LOCK_FILE);
        let c = std::ffi::CString::new(lock.to_str().unwrap()).unwrap();
        // SAFETY: a valid C string.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o666) }, 0);
        let run = dir.path().to_path_buf();
        let e = within(move || RunLock::acquire(&run)).unwrap_err().to_string();
        assert!(e.starts_with(&format!("{}: is a FIFO (named pipe)", lock.display())), "{e}");
        assert!(e.contains("remove it"), "{e}");

        fs::remove_file(&lock).unwrap();
        let victim = tempfile::NamedTempFile::new().unwrap();
        fs::write(victim.path(), "keep").unwrap();
        std::os::unix::fs::symlink(victim.path(), &lock).unwrap();
        std::os::unix::fs::lchown(&lock, Some(NOBODY), Some(NOBODY)).unwrap();
        let e = RunLock::acquire(dir.path()).unwrap_err().to_string();
        assert!(e.contains("is a symbolic link (owned by uid 65534)"), "{e}");
        assert_eq!(fs::read_to_string(victim.path()).unwrap(), "keep", "nothing was written through the link");
    }

    /// The attack of the issue: in a run directory another user owns, they put a `model`
    /// link where the run exports its model. The export refuses it and writes nothing where
    /// it points; a link planted in place of one of the model's files is replaced, not
    /// written through.
    #[test]
    fn a_model_link_planted_in_a_run_directory_of_another_user_is_not_followed() {
        use crate::inference::{TokenizerSource, write_tokenizer_files};
        use crate::model::{ModelSpec, save_hf_folder};
        let Some(dir) = foreign_run_dir("a_model_link_planted_in_a_run_directory_of_another_user_is_not_followed")
        else {
            return;
        };
        let elsewhere = tempfile::tempdir().unwrap();
        let victim = elsewhere.path().join("config.json");
        fs::write(&victim, "theirs").unwrap();
        let model = dir.path().join("model");
        std::os::unix::fs::symlink(elsewhere.path(), &model).unwrap();
        std::os::unix::fs::lchown(&model, Some(NOBODY), Some(NOBODY)).unwrap();
        let spec = ModelSpec::llama(11, 8, 2, 2, 1, 12);
        let e = save_hf_folder(&model, &spec, &[]).unwrap_err().to_string();
        assert!(e.starts_with(&format!("{}: is a symbolic link (owned by uid 65534)", model.display())), "{e}");
        assert!(e.contains("where Ava expected a directory"), "{e}");
        let source = TokenizerSource { file: None, bos: None, eos: Some(0) };
        let e = write_tokenizer_files(&model, &source).unwrap_err().to_string();
        assert!(e.contains("is a symbolic link"), "{e}");
        assert_eq!(fs::read_to_string(&victim).unwrap(), "theirs");
        assert_eq!(fs::read_dir(elsewhere.path()).unwrap().count(), 1, "nothing was made where the link points");

        // A real folder, with links planted at its files' names: replaced, not followed.
        fs::remove_file(&model).unwrap();
        fs::create_dir(&model).unwrap();
        for name in ["config.json", "model.safetensors", "tokenizer.json"] {
            std::os::unix::fs::symlink(&victim, model.join(name)).unwrap();
        }
        save_hf_folder(&model, &spec, &[]).unwrap();
        write_tokenizer_files(&model, &source).unwrap();
        assert_eq!(fs::read_to_string(&victim).unwrap(), "theirs");
        assert!(fs::symlink_metadata(model.join("config.json")).unwrap().is_file());
        assert!(fs::read_to_string(model.join("config.json")).unwrap().contains("\"eos_token_id\": 0"));
    }

    /// A `checkpoints` link planted in the run directory: the save is refused and nothing is
    /// written (or pruned) where it points.
    #[test]
    fn a_checkpoints_link_planted_in_a_run_directory_is_refused() {
        let Some(dir) = foreign_run_dir("a_checkpoints_link_planted_in_a_run_directory_is_refused") else {
            return;
        };
        let elsewhere = tempfile::tempdir().unwrap();
        fs::create_dir(elsewhere.path().join("step-00000001")).unwrap();
        let root = dir.path().join("checkpoints");
        std::os::unix::fs::symlink(elsewhere.path(), &root).unwrap();
        std::os::unix::fs::lchown(&root, Some(NOBODY), Some(NOBODY)).unwrap();
        let store = crate::save::CheckpointStore::new(&root, 1);
        let e = store.save(2, &[("a.bin".into(), vec![1, 2, 3])]).unwrap_err().to_string();
        assert!(e.starts_with(&format!("{}: is a symbolic link", root.display())), "{e}");
        let left: Vec<_> = fs::read_dir(elsewhere.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left, ["step-00000001"]);
    }
}
