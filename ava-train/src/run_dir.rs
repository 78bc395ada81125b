//! One run per output directory: [`RunLock`] holds an exclusive `flock` on
//! `<train.out_dir>/.ava-run.lock` for the whole run, so a second `ava train` on the same
//! directory is refused (rather than the two saves deleting each other's temporary files);
//! and [`previous_run`] finds the files a finished or stopped run left there, so a fresh run
//! does not silently mix its checkpoints and metrics with them.
//!
//! The kernel releases a `flock` when the process ends however it ends, so a lock file left
//! by a killed run blocks nothing; the pid, host and start time written into it are only for
//! the message a refused run prints. The file itself is never removed: removing it while
//! another process waits to lock it would let two processes hold "the" lock on two files.

use std::fs;
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// The lock file inside the run directory.
pub const LOCK_FILE: &str = ".ava-run.lock";

/// What a run writes into its directory, and what `--overwrite` removes (nothing else there
/// is touched): the metrics, the checkpoints, the final model and `ava report`'s charts.
pub const RUN_FILES: &[&str] = &["metrics.jsonl", "checkpoints", "model", "report"];

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

/// The exclusive lock on a run directory, held until dropped (or the process ends).
#[derive(Debug)]
pub struct RunLock {
    dir: PathBuf,
    file: fs::File,
}

impl RunLock {
    /// Creates `dir` if needed and takes its lock without waiting; [`RunDirError::Busy`]
    /// names the holder when another process has it.
    pub fn acquire(dir: &Path) -> Result<Self, RunDirError> {
        let io = |path: &Path, e: std::io::Error| RunDirError::Io { path: path.to_path_buf(), message: e.to_string() };
        fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
        let path = dir.join(LOCK_FILE);
        let mut file = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| io(&path, e))?;
        // SAFETY: flock on a descriptor this function owns; no memory is passed.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
                return Err(io(&path, e));
            }
            let mut text = String::new();
            let _ = file.read_to_string(&mut text);
            let (pid, holder) = describe_holder(&text);
            return Err(RunDirError::Busy { dir: dir.to_path_buf(), pid, holder });
        }
        // Ours now: say who holds it (for a refused run's message only).
        let started = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let text = format!("pid {}\nhost {}\nstarted {started}\n", std::process::id(), hostname());
        file.set_len(0)
            .and_then(|_| file.rewind())
            .and_then(|_| file.write_all(text.as_bytes()))
            .map_err(|e| io(&path, e))?;
        Ok(Self { dir: dir.to_path_buf(), file })
    }

    /// The locked directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Removes the previous run's [`RUN_FILES`] (`--overwrite`); only with the lock held, so
    /// never from under a run that is still going.
    pub fn remove_previous_run(&self) -> Result<(), RunDirError> {
        let _held = &self.file;
        for name in RUN_FILES {
            let path = self.dir.join(name);
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

/// The holder's pid and a description of it, from its lock file's text.
fn describe_holder(text: &str) -> (Option<u32>, String) {
    let field = |key: &str| text.lines().find_map(|l| l.strip_prefix(key).map(|v| v.trim().to_string()));
    let pid = field("pid ").and_then(|p| p.parse().ok());
    let mut parts = vec![match pid {
        Some(p) => format!("pid {p}"),
        None => "pid unknown".to_string(),
    }];
    if let Some(host) = field("host ") {
        parts.push(format!("on host {host}"));
    }
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    if let Some(started) = field("started ").and_then(|s| s.parse::<u64>().ok()) {
        parts.push(format!("started {} s ago", now.saturating_sub(started)));
    }
    (pid, parts.join(", "))
}

/// This machine's name, or "unknown".
fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer and its length are valid; gethostname writes at most that many bytes.
    if unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } != 0 {
        return "unknown".to_string();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
