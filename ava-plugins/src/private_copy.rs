//! The private copy of a plugin library that the dynamic loader opens: the bytes that were
//! read, hashed and vetted, where no one else can change them between their write and the
//! load, whatever the process's umask.
//!
//! Why: `dlopen` takes a path, and a path is looked up again when it is opened. A copy in a
//! directory that takes its mode from the umask (000, or 002 with a shared group) can be
//! renamed over by another user between the write and the load, and her library then runs in
//! this process under a vetted, signed policy. So the copy is made one of two ways, each
//! checked after it is written (its size, owner and mode, and its bytes hashed again through
//! the descriptor against the vetted sha256):
//!
//! - [`CopyWay::Sealed`] (Linux): an anonymous memory file (`memfd_create`), written, then
//!   sealed against any further write, shrink or growth (`F_ADD_SEALS`), and opened by the
//!   loader as `/proc/self/fd/N`, a name that exists only in this process's descriptor table
//!   and that no other user may follow. Nothing touches the file system, so a process killed
//!   at start-up leaves nothing behind. The descriptor is kept open as long as the process
//!   (libraries are never unloaded, and the mapping holds the file's memory anyway): glibc
//!   reuses a loaded library whose name matches, so `/proc/self/fd/N` must never name a second
//!   library.
//! - [`CopyWay::Directory`]: a new directory `ava-plugin-<pid>-<n>` in the temporary directory,
//!   mode 0700 set explicitly and checked (owner, not a link), holding the file created
//!   exclusively with mode 0600, in a temporary directory of this user or root that no one else
//!   may rename entries of; both are removed once the library is loaded. Directories that
//!   a killed process left behind are removed by the next copy made this way (those of
//!   processes no longer running, owned by this user). Used where memory files are not
//!   available (not Linux, a sandbox that refuses `memfd_create`, no `/proc`).
//!
//! [`CopyWay::Best`] is the first that works of the two.

use std::ffi::CString;
use std::fs::{self, File};
use std::io::{self, Write as _};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use sha2::{Digest, Sha256};

use crate::{HostError, discover::Candidate};
use ava_fs::dirfd::euid;

/// How the private copy is made (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyWay {
    /// A sealed memory file where the system has them, else a private directory.
    Best,
    /// A sealed memory file (Linux); an error elsewhere.
    Sealed,
    /// A private directory in the temporary directory.
    Directory,
}

/// A private copy, checked against the vetted bytes, ready for the loader.
#[derive(Debug)]
pub struct PrivateCopy {
    /// The path the loader opens.
    path: PathBuf,
    /// What to do once the library is loaded (or failed to load).
    held: Held,
}

#[derive(Debug)]
enum Held {
    /// The memory file's descriptor.
    Sealed(OwnedFd),
    /// The private directory, removed on drop.
    Directory(PathBuf),
    /// Handed on by [`PrivateCopy::loaded`].
    Done,
}

/// Memory files whose library the loader holds: open for the process's life (module docs).
static LOADED: Mutex<Vec<OwnedFd>> = Mutex::new(Vec::new());

/// Tells a process's private directories apart.
static COUNTER: AtomicU64 = AtomicU64::new(0);

impl PrivateCopy {
    /// Writes `candidate`'s bytes `way` and checks the copy against its sha256.
    pub fn new(candidate: &Candidate, way: CopyWay) -> Result<Self, HostError> {
        match way {
            CopyWay::Sealed => Self::sealed(candidate),
            CopyWay::Directory => Self::directory(candidate),
            CopyWay::Best => match Self::sealed(candidate) {
                // Not available here: the other way. A copy that failed its check is not
                // retried another way; the check's error is the answer.
                Err(HostError::Io { .. }) => Self::directory(candidate),
                other => other,
            },
        }
    }

    /// The path to give the loader.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether this copy is a sealed memory file (else a private directory).
    pub fn is_sealed(&self) -> bool {
        matches!(self.held, Held::Sealed(_))
    }

    /// Called once the loader tried the copy, whether it loaded or not (a library the loader
    /// mapped and then gave up on may stay resident under the name): a memory file's
    /// descriptor is kept for the process's life (module docs); a directory is removed, as on
    /// drop.
    pub fn loaded(mut self) {
        match std::mem::replace(&mut self.held, Held::Done) {
            Held::Sealed(fd) => LOADED.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(fd),
            Held::Directory(dir) => remove(&dir),
            Held::Done => {}
        }
    }

    #[cfg(target_os = "linux")]
    fn sealed(candidate: &Candidate) -> Result<Self, HostError> {
        let place = || PathBuf::from("memfd:").join(candidate.file_name());
        let fd = memfd(&candidate.file_name()).map_err(|e| HostError::io(place(), e))?;
        let mut file = File::from(fd);
        file.write_all(&candidate.bytes).map_err(|e| HostError::io(place(), e))?;
        let seals = libc::F_SEAL_SEAL | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE;
        // SAFETY: fcntl on a descriptor this function owns; no pointers.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(HostError::io(place(), io::Error::last_os_error()));
        }
        let path = PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
        // The name must lead to this file: without /proc it leads nowhere (or elsewhere).
        let (by_fd, by_name) = (file.metadata(), fs::metadata(&path));
        match (by_fd, by_name) {
            (Ok(a), Ok(b)) if (a.dev(), a.ino()) == (b.dev(), b.ino()) => {}
            (_, Err(e)) => return Err(HostError::io(&path, e)),
            _ => return Err(HostError::io(&path, io::Error::other("does not name the memory file written"))),
        }
        let copy = Self { path, held: Held::Sealed(file.into()) };
        copy.check(candidate)?;
        Ok(copy)
    }

    #[cfg(not(target_os = "linux"))]
    fn sealed(candidate: &Candidate) -> Result<Self, HostError> {
        let _ = candidate;
        Err(HostError::io("memfd:", io::Error::new(io::ErrorKind::Unsupported, "memory files are Linux only")))
    }

    fn directory(candidate: &Candidate) -> Result<Self, HostError> {
        let tmp = std::env::temp_dir();
        remove_stale(&tmp);
        let dir = make_private_dir(&tmp)?;
        // From here the directory is removed on drop, whatever fails next.
        let mut copy = Self { path: dir.clone(), held: Held::Directory(dir.clone()) };
        let path = dir.join(candidate.file_name());
        let mut file = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)
            .map_err(|e| HostError::io(&path, e))?;
        // The mode asked for is masked by the umask; set it whole.
        file.set_permissions(fs::Permissions::from_mode(0o600)).map_err(|e| HostError::io(&path, e))?;
        file.write_all(&candidate.bytes).map_err(|e| HostError::io(&path, e))?;
        drop(file);
        copy.path = path;
        copy.check(candidate)?;
        Ok(copy)
    }

    /// Checks that the copy is the vetted bytes, held where only this user could have
    /// changed them: a memory file sealed against writes, or a file in the private directory,
    /// opened again by the loader's path.
    pub fn check(&self, candidate: &Candidate) -> Result<(), HostError> {
        let tampered =
            |reason: String| HostError::CopyChanged { path: candidate.path.clone(), copy: self.path.clone(), reason };
        let file = match &self.held {
            Held::Sealed(fd) => {
                let file = File::from(fd.try_clone().map_err(|e| HostError::io(&self.path, e))?);
                // SAFETY: fcntl on a descriptor this copy owns; no pointers.
                let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
                let wanted = libc::F_SEAL_SEAL | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE;
                if seals < 0 || seals & wanted != wanted {
                    return Err(tampered(format!("the memory file is not sealed against writes (seals {seals:#x})")));
                }
                file
            }
            Held::Done => return Err(HostError::io(&self.path, io::Error::other("already handed to the loader"))),
            Held::Directory(dir) => {
                let d = fs::symlink_metadata(dir).map_err(|e| HostError::io(dir, e))?;
                if !d.file_type().is_dir() || d.uid() != euid() || d.mode() & 0o077 != 0 {
                    return Err(tampered(format!("its directory {} is no longer private", dir.display())));
                }
                let file = fs::OpenOptions::new()
                    .read(true)
                    .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
                    .open(&self.path)
                    .map_err(|e| tampered(format!("it cannot be opened again: {e}")))?;
                let meta = file.metadata().map_err(|e| HostError::io(&self.path, e))?;
                if !meta.file_type().is_file() || meta.uid() != euid() {
                    return Err(tampered(format!("it is no longer a regular file of uid {}", euid())));
                }
                if meta.mode() & 0o077 != 0 || meta.nlink() != 1 {
                    let (mode, links) = (meta.mode() & 0o7777, meta.nlink());
                    return Err(tampered(format!("mode {mode:o} with {links} link(s), where 600 with 1 was written")));
                }
                file
            }
        };
        let found = sha256_from_start(&file).map_err(|e| HostError::io(&self.path, e))?;
        if found != candidate.sha256 {
            return Err(tampered(format!("its sha256 is {found}, the bytes vetted are {}", candidate.sha256)));
        }
        Ok(())
    }
}

/// The sha256 (lowercase hex) of a file's bytes from its start, whatever its offset.
fn sha256_from_start(file: &File) -> io::Result<String> {
    use std::os::unix::fs::FileExt as _;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut at = 0u64;
    loop {
        let n = file.read_at(&mut buf, at)?;
        if n == 0 {
            return Ok(hex::encode(hasher.finalize()));
        }
        hasher.update(&buf[..n]);
        at += n as u64;
    }
}

impl Drop for PrivateCopy {
    fn drop(&mut self) {
        if let Held::Directory(dir) = &self.held {
            remove(dir);
        }
    }
}

/// Removes a private directory and what is in it (nothing to report if it fails: the next
/// copy made that way removes it, see [`remove_stale`]).
fn remove(dir: &Path) {
    let _ = fs::remove_dir_all(dir);
}

/// A new memory file that allows sealing and, where the kernel asks, executable mappings.
#[cfg(target_os = "linux")]
fn memfd(name: &str) -> io::Result<OwnedFd> {
    let name = CString::new(format!("ava-plugin:{}", name.replace('\0', "_"))).expect("no NUL left");
    let flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
    // Kernels from 6.3 on may refuse to map a memory file executable unless it was created
    // with MFD_EXEC; older ones refuse the flag itself (EINVAL), and then need none.
    for flags in [flags | libc::MFD_EXEC, flags] {
        // SAFETY: a NUL-terminated name and plain flags.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), flags) };
        if fd >= 0 {
            // SAFETY: a descriptor memfd_create just returned, owned by nothing else.
            return Ok(unsafe { OwnedFd::from_raw_fd(fd) });
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINVAL) {
            return Err(e);
        }
    }
    Err(io::Error::last_os_error())
}

/// Creates `tmp/ava-plugin-<pid>-<n>` with mode 0700 (set whole, not through the umask),
/// and checks that what is there is that directory, owned by this user. A temporary
/// directory another user (not root) owns, or that others may write without the sticky bit,
/// is refused: there they could rename the private directory away and put theirs in its place.
fn make_private_dir(tmp: &Path) -> Result<PathBuf, HostError> {
    let t = fs::metadata(tmp).map_err(|e| HostError::io(tmp, e))?;
    // Who could rename the private directory away and put theirs in its place: the temporary
    // directory's owner (even with the sticky bit), and whoever may write it without one.
    let why = if t.uid() != euid() && t.uid() != 0 {
        Some(format!("it belongs to uid {}, who could replace the copy", t.uid()))
    } else if t.mode() & 0o022 != 0 && t.mode() & 0o1000 == 0 {
        Some("others may write it and it lacks the sticky bit".to_string())
    } else {
        None
    };
    if let Some(why) = why {
        let why =
            format!("{why}: a plugin cannot be loaded from a copy there; set TMPDIR to a directory only you can write");
        return Err(HostError::io(tmp, io::Error::new(io::ErrorKind::PermissionDenied, why)));
    }
    let pid = std::process::id();
    loop {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let dir = tmp.join(format!("ava-plugin-{pid}-{n}"));
        match fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => {}
            // A name taken (planted, or left by an earlier process of this pid): the next.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(HostError::io(&dir, e)),
        }
        let opened = fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&dir)
            .map_err(|e| HostError::io(&dir, e))?;
        let meta = opened.metadata().map_err(|e| HostError::io(&dir, e))?;
        if meta.uid() != euid() {
            return Err(HostError::io(&dir, io::Error::other("was replaced right after it was created")));
        }
        opened.set_permissions(fs::Permissions::from_mode(0o700)).map_err(|e| HostError::io(&dir, e))?;
        return Ok(dir);
    }
}

/// Removes `ava-plugin-<pid>-<n>` directories in `tmp` that this user owns and whose
/// process is no longer running (left by a process killed between copy and load).
fn remove_stale(tmp: &Path) {
    let Ok(entries) = fs::read_dir(tmp) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(stale_pid) else { continue };
        if pid == std::process::id() || running(pid) {
            continue;
        }
        let path = entry.path();
        match fs::symlink_metadata(&path) {
            Ok(m) if m.file_type().is_dir() && m.uid() == euid() => {
                let _ = fs::remove_dir_all(&path);
            }
            _ => {}
        }
    }
}

/// The pid in a private directory's name `ava-plugin-<pid>-<n>`.
fn stale_pid(name: &str) -> Option<u32> {
    let (pid, n) = name.strip_prefix("ava-plugin-")?.split_once('-')?;
    n.parse::<u64>().ok()?;
    pid.parse().ok()
}

/// Whether process `pid` exists (a process of another user counts).
fn running(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else { return false };
    // SAFETY: signal 0 only checks that the process exists.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt as _;

    use super::*;

    /// A candidate of arbitrary bytes (a copy is made of any file; the loader checks the rest).
    fn candidate(dir: &Path, bytes: &[u8]) -> Candidate {
        let path = dir.join("libava_plugin_test.so");
        fs::write(&path, bytes).unwrap();
        Candidate::read(&path).unwrap()
    }

    fn mode(path: &Path) -> u32 {
        fs::symlink_metadata(path).unwrap().mode() & 0o7777
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_sealed_copy_is_the_bytes_and_takes_no_write() {
        let dir = tempfile::tempdir().unwrap();
        let c = candidate(dir.path(), b"\x7fELF and then some bytes");
        let copy = PrivateCopy::new(&c, CopyWay::Sealed).unwrap();
        assert!(copy.is_sealed());
        assert!(copy.path().starts_with("/proc/self/fd"), "{}", copy.path().display());
        assert_eq!(fs::read(copy.path()).unwrap(), c.bytes);
        // The seals refuse a write through any descriptor, this user's included.
        let mut w = fs::OpenOptions::new().write(true).open(copy.path()).unwrap();
        let e = w.write_all(b"swapped").unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
        assert_eq!(fs::read(copy.path()).unwrap(), c.bytes);
        copy.check(&c).unwrap();
    }

    #[test]
    fn a_directory_copy_is_private_and_gone_after_its_load() {
        let dir = tempfile::tempdir().unwrap();
        let c = candidate(dir.path(), b"library bytes");
        let copy = PrivateCopy::new(&c, CopyWay::Directory).unwrap();
        assert!(!copy.is_sealed());
        let parent = copy.path().parent().unwrap().to_path_buf();
        assert_eq!((mode(&parent), mode(copy.path())), (0o700, 0o600));
        assert_eq!(fs::read(copy.path()).unwrap(), c.bytes);
        copy.loaded();
        assert!(!parent.exists(), "{} left behind", parent.display());
    }

    #[test]
    fn a_directory_copy_changed_after_its_write_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let c = candidate(dir.path(), b"the vetted bytes");
        let copy = PrivateCopy::new(&c, CopyWay::Directory).unwrap();
        // Another file renamed over the copy (as its owner could; another user cannot here).
        let other = copy.path().with_extension("other");
        fs::write(&other, b"someone else's library").unwrap();
        fs::set_permissions(&other, fs::Permissions::from_mode(0o600)).unwrap();
        fs::rename(&other, copy.path()).unwrap();
        let e = copy.check(&c).unwrap_err().to_string();
        assert!(e.contains("not loaded: its private copy") && e.contains("its sha256 is"), "{e}");
        assert!(e.contains(&c.sha256) && e.contains("set TMPDIR"), "{e}");
        // The bytes back, but opened up to others: refused too.
        fs::write(copy.path(), &c.bytes).unwrap();
        copy.check(&c).unwrap();
        fs::set_permissions(copy.path(), fs::Permissions::from_mode(0o666)).unwrap();
        let e = copy.check(&c).unwrap_err().to_string();
        assert!(e.contains("mode 666 with 1 link(s), where 600 with 1 was written"), "{e}");
    }

    #[test]
    fn a_temporary_directory_anyone_may_write_without_the_sticky_bit_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o777)).unwrap();
        let e = make_private_dir(tmp.path()).unwrap_err().to_string();
        assert!(e.contains("lacks the sticky bit") && e.contains("set TMPDIR"), "{e}");
        fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o1777)).unwrap();
        let made = make_private_dir(tmp.path()).unwrap();
        assert_eq!(mode(&made), 0o700);
        // Another user's directory, even closed and sticky: its owner may rename what is in it.
        if euid() == 0 {
            std::os::unix::fs::chown(tmp.path(), Some(65534), Some(65534)).unwrap();
            let e = make_private_dir(tmp.path()).unwrap_err().to_string();
            assert!(e.contains("it belongs to uid 65534, who could replace the copy"), "{e}");
        }
    }

    #[test]
    fn directories_left_by_processes_gone_are_removed_and_no_others() {
        let tmp = tempfile::tempdir().unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let gone = child.id();
        child.wait().unwrap();
        let make = |name: String| {
            let d = tmp.path().join(name);
            fs::create_dir(&d).unwrap();
            fs::write(d.join("lib.so"), b"x").unwrap();
            d
        };
        let stale = make(format!("ava-plugin-{gone}-3"));
        let ours = make(format!("ava-plugin-{}-9", std::process::id()));
        let older_style = make("ava-plugin-Xy12ab".to_string());
        let unrelated = make(format!("other-{gone}-3"));
        remove_stale(tmp.path());
        assert!(!stale.exists());
        assert!(ours.exists() && older_style.exists() && unrelated.exists());
    }

    #[test]
    fn private_directory_names_give_their_pid() {
        assert_eq!(stale_pid("ava-plugin-1234-0"), Some(1234));
        assert_eq!(stale_pid("ava-plugin-1234-17"), Some(1234));
        assert_eq!(stale_pid("ava-plugin-aBc123"), None, "tempfile's names of older versions are left alone");
        assert_eq!(stale_pid("ava-plugin-12-x"), None);
        assert_eq!(stale_pid("other-12-3"), None);
    }
}
