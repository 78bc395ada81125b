//! One writer per output directory: [`DirLock`] holds an exclusive, non-blocking `flock` on a
//! lock file inside a directory (`ava train`'s run directory, `ava data prepare`'s `--out`),
//! so a second process that wants the same directory is told who holds it instead of the two
//! overwriting each other's files.
//!
//! The kernel releases a `flock` when the process ends however it ends, so a lock file left
//! by a killed process blocks nothing; the pid, host, start time and command (its
//! subcommand, no options) written into it are only for the message a refused process prints.
//! Only its holder may remove the file (a run refused before it wrote anything leaves nothing
//! behind): a process that opened the file before it was removed and locks it after finds it
//! unlinked (no links left) and takes the lock again on the name's new file, so two processes
//! never each hold "the" lock on a file of their own.
//!
//! The directory may be shared: the lock file is opened through [`Dir`] (no link followed, no
//! FIFO waited on, regular files only), and what a holder wrote is read bounded and shown
//! with control characters escaped.

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::dirfd::{Access, Dir, DirError};

/// Most bytes of a holder's lock file read for the message.
const MAX_HOLDER_BYTES: u64 = 4096;

/// An exclusive lock on a directory, held until dropped (or the process ends).
#[derive(Debug)]
pub struct DirLock {
    dir: PathBuf,
    _file: File,
}

/// The outcome of [`DirLock::acquire`].
#[derive(Debug)]
pub enum Acquired {
    /// This process holds the lock now.
    Held(DirLock),
    /// Another process holds it.
    Busy {
        /// The holder's pid, as its lock file says.
        pid: Option<u32>,
        /// The holder as its lock file describes it: pid, host, how long ago it started, its
        /// command line; printable ASCII only.
        holder: String,
    },
}

impl DirLock {
    /// Creates `dir` if needed and takes the lock on its file `name` without waiting.
    pub fn acquire(dir: &Path, name: &str) -> Result<Acquired, DirError> {
        let path = dir.join(name);
        let io = |action: &str, source| DirError::Io { action: action.into(), path: path.clone(), source };
        let mut tries = 0;
        let mut file = loop {
            let mut file = Dir::create_all(dir)?.open_file(name, Access::ReadWriteCreate, 0o644)?;
            // SAFETY: flock on a descriptor this function owns; no memory is passed.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
                    return Err(io("lock", e));
                }
                let (pid, holder) = describe_holder(&read_whole_holder(&mut file));
                return Ok(Acquired::Busy { pid, holder });
            }
            // Removed by its holder between our open and our lock: not the lock any more.
            let linked = file.metadata().map_err(|e| io("stat", e))?.nlink() > 0;
            if linked || tries >= 10 {
                break file;
            }
            tries += 1;
        };
        // Ours now: say who holds it (for a refused process's message only).
        let started = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let text =
            format!("pid {}\nhost {}\nstarted {started}\ncommand {}\n", std::process::id(), hostname(), command());
        file.set_len(0)
            .and_then(|_| file.rewind())
            .and_then(|_| file.write_all(text.as_bytes()))
            .map_err(|e| io("write", e))?;
        Ok(Acquired::Held(Self { dir: dir.to_path_buf(), _file: file }))
    }

    /// The locked directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// The holder's text once it has written it all: a holder writes it just after it takes the
/// lock, so a process refused at that moment reads it again, for at most 200 ms (then what
/// there is: a holder that died between the two says nothing).
fn read_whole_holder(file: &mut File) -> String {
    let mut text = read_holder(file);
    for _ in 0..20 {
        if text.lines().any(|l| l.starts_with("command ")) {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
        text = read_holder(file);
    }
    text
}

/// The holder's lock file text: at most [`MAX_HOLDER_BYTES`], lossily decoded.
fn read_holder(file: &mut File) -> String {
    let mut bytes = Vec::new();
    let _ = file.rewind().and_then(|_| file.take(MAX_HOLDER_BYTES).read_to_end(&mut bytes));
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The holder's pid and a description of it (pid, host, age, command), from its lock file's
/// text; every field escaped to printable ASCII (the text may come from another user).
pub fn describe_holder(text: &str) -> (Option<u32>, String) {
    let field = |key: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(key).map(|v| v.trim().chars().flat_map(char::escape_default).collect()))
    };
    let pid = field("pid ").and_then(|p: String| p.parse().ok());
    let mut parts = vec![pid.map_or_else(|| "pid unknown".to_string(), |p| format!("pid {p}"))];
    if let Some(host) = field("host ") {
        parts.push(format!("on host {host}"));
    }
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    if let Some(started) = field("started ").and_then(|s: String| s.parse::<u64>().ok()) {
        parts.push(format!("started {} s ago", now.saturating_sub(started)));
    }
    if let Some(command) = field("command ") {
        parts.push(format!("command: {command}"));
    }
    (pid, parts.join(", "))
}

/// The command as the lock file records it: the program's name and its subcommand words,
/// without options or their values (the file is readable by others and outlives the process,
/// and a `--set` may hold a path or a token).
fn command() -> String {
    let mut args = std::env::args();
    let program = args.next().map(|p| p.rsplit('/').next().unwrap_or_default().to_string()).unwrap_or_default();
    let words = args.take_while(|a| !a.starts_with('-')).take(2);
    std::iter::once(program).chain(words).collect::<Vec<_>>().join(" ")
}

/// This machine's name, or "unknown".
pub fn hostname() -> String {
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

    fn held(acquired: Acquired) -> DirLock {
        match acquired {
            Acquired::Held(lock) => lock,
            Acquired::Busy { holder, .. } => panic!("busy: {holder}"),
        }
    }

    #[test]
    fn a_second_lock_is_refused_naming_the_holder_and_freed_on_drop() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        let lock = held(DirLock::acquire(&out, ".lock").unwrap());
        match DirLock::acquire(&out, ".lock").unwrap() {
            Acquired::Busy { pid, holder } => {
                assert_eq!(pid, Some(std::process::id()));
                assert!(holder.starts_with(&format!("pid {}, on host ", std::process::id())), "{holder}");
                assert!(holder.contains(", command: "), "{holder}");
            }
            Acquired::Held(_) => panic!("two holders"),
        }
        drop(lock);
        assert!(out.join(".lock").is_file(), "the file stays; its lock went with the descriptor");
        held(DirLock::acquire(&out, ".lock").unwrap());
    }

    #[test]
    fn a_link_in_place_of_the_lock_file_is_refused_and_its_target_untouched() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("precious");
        std::fs::write(&target, "keep me").unwrap();
        let out = dir.path().join("out");
        std::fs::create_dir(&out).unwrap();
        std::os::unix::fs::symlink(&target, out.join(".lock")).unwrap();
        let err = DirLock::acquire(&out, ".lock").unwrap_err();
        assert!(matches!(err, DirError::Planted { what: "a symbolic link", .. }), "{err}");
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep me");
    }

    #[test]
    fn a_holder_description_is_escaped() {
        let (pid, text) = describe_holder("pid 12\nhost h\x1b[2J\ncommand ava data prepare x\n");
        assert_eq!(pid, Some(12));
        assert!(text.contains("on host h\\u{1b}[2J") && text.contains("command: ava data prepare x"), "{text}");
        assert_eq!(describe_holder("garbage").1, "pid unknown");
    }

    proptest::proptest! {
        /// Whatever another user wrote into the lock file, the message shows it as printable
        /// ASCII only (no terminal escapes, no line breaks), and the pid is one only if it
        /// was written as one.
        #[test]
        fn any_lock_file_text_describes_as_printable_ascii(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..600),
            pid in proptest::prelude::any::<u32>(),
        ) {
            let mut text = format!("pid {pid}\n").into_bytes();
            text.extend(&bytes);
            for input in [&text[..], &bytes[..]] {
                let (found, described) = describe_holder(&String::from_utf8_lossy(input));
                proptest::prop_assert!(described.chars().all(|c| (' '..='~').contains(&c)), "{described:?}");
                if input.len() == text.len() {
                    proptest::prop_assert_eq!(found, Some(pid));
                }
            }
        }
    }
}
