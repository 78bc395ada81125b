//! File operations relative to an opened directory, for directories other users may be able
//! to write to (a shared output directory, a run directory owned by someone else).
//!
//! Why: a path is looked up anew at every use, so whoever can write the directory can put a
//! symbolic link, a FIFO or a device under a name between two uses, and a path-based
//! `create` or `create_dir_all` follows it (writing where they chose) or waits on it. Here
//! the directory is opened once ([`Dir::open`], `O_DIRECTORY|O_NOFOLLOW`) and every entry is
//! created, opened, replaced and removed relative to that descriptor (`mkdirat`, `openat`,
//! `renameat`, `unlinkat`) with `O_NOFOLLOW|O_NONBLOCK`: a FIFO is never waited on, a link to
//! a file never followed, and a link to a directory followed only when this user or root owns
//! it ([`own_link`]: `checkpoints` on a bigger disk is the user's choice; a link another user
//! planted is not). What is found instead is refused with its path, what it is and who owns
//! it ([`DirError::Planted`]). Replacing a file ([`Dir::replace`]) writes a new temp file
//! (`O_CREAT|O_EXCL`, so a name planted in advance is never opened) and renames it over the
//! name, which replaces a link there rather than writing through it.

use std::ffi::CString;
use std::fs::File;
use std::io::{self, Write as _};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::bounded::{self, ReadError};

/// Tells temp files of one process apart.
static COUNTER: AtomicU64 = AtomicU64::new(0);

/// Why an operation in a directory was refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum DirError {
    /// Something other than what Ava writes there (a link, a FIFO, a device, a directory
    /// where a file goes) is at the path: put there by someone, never followed or waited on.
    #[error(
        "{}: is {what} (owned by uid {owner}), where Ava expected {expected}; it does not follow links or open \
         special files in the directories it writes, since anyone who can write there could have put it there: \
         remove it (and check who can write to {})",
        path.display(),
        parent.display()
    )]
    Planted {
        /// The path.
        path: PathBuf,
        /// The directory it is in.
        parent: PathBuf,
        /// What it is, in words ("a symbolic link", "a FIFO (named pipe)", ...).
        what: &'static str,
        /// Its owner's uid.
        owner: u32,
        /// What should be there ("a directory", "a regular file").
        expected: &'static str,
    },
    /// A name that is not one plain path component.
    #[error("{name:?}: not a plain file name (it must not be empty, \".\", \"..\" or contain '/' or NUL)")]
    BadName {
        /// The name.
        name: String,
    },
    /// A file read through the directory was refused by its bounds.
    #[error(transparent)]
    Read(#[from] ReadError),
    /// Any other I/O error.
    #[error("{}: cannot {action}: {source}", path.display())]
    Io {
        /// What was being done ("create the directory", "open", "rename ... to").
        action: String,
        /// The path.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
}

impl DirError {
    /// The path concerned (none for a bad name).
    pub fn path(&self) -> Option<&Path> {
        match self {
            Self::Planted { path, .. } | Self::Io { path, .. } => Some(path),
            Self::Read(e) => Some(e.path()),
            Self::BadName { .. } => None,
        }
    }

    /// Whether the error is "no such file or directory".
    pub fn is_missing(&self) -> bool {
        match self {
            Self::Io { source, .. } => source.kind() == io::ErrorKind::NotFound,
            Self::Read(e) => e.is_missing(),
            _ => false,
        }
    }
}

/// What a `stat` mode describes, in words.
pub fn kind_of(mode: libc::mode_t) -> &'static str {
    match mode & libc::S_IFMT {
        libc::S_IFLNK => "a symbolic link",
        libc::S_IFIFO => "a FIFO (named pipe)",
        libc::S_IFSOCK => "a socket",
        libc::S_IFCHR => "a character device",
        libc::S_IFBLK => "a block device",
        libc::S_IFDIR => "a directory",
        libc::S_IFREG => "a regular file",
        _ => "not a regular file",
    }
}

/// The effective user id of this process.
pub fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

/// Whether `mode`/`owner` (an `lstat`) is a symbolic link this user or root owns: one this
/// user may follow to a directory (their own choice, or the administrator's). A link another
/// user owns could have been planted by them, and is never followed (the rule of Linux's
/// `fs.protected_symlinks`, for every directory rather than sticky ones only).
pub fn own_link(mode: libc::mode_t, owner: u32) -> bool {
    mode & libc::S_IFMT == libc::S_IFLNK && trusted(owner)
}

/// Whether `owner` is this user or root.
fn trusted(owner: u32) -> bool {
    owner == euid() || owner == 0
}

/// `path` as a C string.
fn c_path(path: &Path) -> Result<CString, DirError> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| DirError::BadName { name: path.to_string_lossy().into_owned() })
}

/// `name` as a C string, if it is one plain path component.
fn c_name(name: &str) -> Result<CString, DirError> {
    if name.is_empty() || name == "." || name == ".." || name.contains('/') {
        return Err(DirError::BadName { name: name.to_string() });
    }
    CString::new(name).map_err(|_| DirError::BadName { name: name.to_string() })
}

/// `fstat` of an open descriptor.
fn fstat(fd: &impl AsRawFd) -> io::Result<libc::stat> {
    // SAFETY: zeroed memory is a valid `stat`; fstat writes into it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a valid descriptor and out pointer.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st)
}

/// How to open a file in a [`Dir`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Read only; the file must exist.
    Read,
    /// Read and write, created (with the mode given) if missing, never truncated.
    ReadWriteCreate,
}

/// An opened directory; entries are reached relative to it, never through a link.
#[derive(Debug)]
pub struct Dir {
    fd: OwnedFd,
    path: PathBuf,
}

impl Dir {
    /// Opens the directory `path` (`O_DIRECTORY|O_NOFOLLOW|O_CLOEXEC`). Its last component
    /// must be a directory, or a link to one that this user or root owns ([`own_link`]): a
    /// `checkpoints` linked to a bigger disk is the user's own choice; a link another user
    /// planted is refused.
    pub fn open(path: &Path) -> Result<Self, DirError> {
        let c = c_path(path)?;
        let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC;
        // SAFETY: a valid C string.
        let fd = unsafe { libc::open(c.as_ptr(), flags) };
        if fd >= 0 {
            // SAFETY: `fd` was just opened and is owned by nothing else.
            return Ok(Self { fd: unsafe { OwnedFd::from_raw_fd(fd) }, path: path.to_path_buf() });
        }
        let e = io::Error::last_os_error();
        let found = std::fs::symlink_metadata(path).ok().map(|m| {
            use std::os::unix::fs::MetadataExt;
            (m.mode() as libc::mode_t, m.uid())
        });
        match found {
            // O_NOFOLLOW with O_DIRECTORY on a link: ELOOP, or ENOTDIR on some kernels.
            Some((mode, owner))
                if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR)) && own_link(mode, owner) =>
            {
                // SAFETY: a valid C string.
                let fd = unsafe { libc::open(c.as_ptr(), flags & !libc::O_NOFOLLOW) };
                if fd < 0 {
                    let source = io::Error::last_os_error();
                    return Err(DirError::Io {
                        action: "open the directory its link names".into(),
                        path: path.into(),
                        source,
                    });
                }
                // SAFETY: `fd` was just opened and is owned by nothing else.
                Ok(Self { fd: unsafe { OwnedFd::from_raw_fd(fd) }, path: path.to_path_buf() })
            }
            _ => {
                let parent = path.parent().unwrap_or(Path::new("."));
                Err(Self::refusal(e, path, parent, found, "a directory", "open the directory"))
            }
        }
    }

    /// Creates the directory `path` with its missing parents (the path as its user named it),
    /// then [`open`](Self::open)s it.
    pub fn create_all(path: &Path) -> Result<Self, DirError> {
        if std::fs::symlink_metadata(path).is_err() {
            std::fs::create_dir_all(path).map_err(|source| DirError::Io {
                action: "create the directory".into(),
                path: path.to_path_buf(),
                source,
            })?;
        }
        Self::open(path)
    }

    /// The directory's path, for messages.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The uid of the directory's owner.
    pub fn owner(&self) -> Result<u32, DirError> {
        fstat(&self.fd).map(|st| st.st_uid).map_err(|e| self.io("stat", &self.path, e))
    }

    /// The error for an `openat` or `open` that failed with `e`: a link, a FIFO or a device
    /// found there (`found`: its mode and owner) is [`DirError::Planted`].
    fn refusal(
        e: io::Error,
        path: &Path,
        parent: &Path,
        found: Option<(libc::mode_t, u32)>,
        expected: &'static str,
        action: &str,
    ) -> DirError {
        let wrong_kind = matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR | libc::ENXIO | libc::EISDIR));
        match found {
            Some((mode, owner)) if wrong_kind => DirError::Planted {
                path: path.to_path_buf(),
                parent: parent.to_path_buf(),
                what: kind_of(mode),
                owner,
                expected,
            },
            _ => DirError::Io { action: action.to_string(), path: path.to_path_buf(), source: e },
        }
    }

    fn io(&self, action: &str, path: &Path, source: io::Error) -> DirError {
        DirError::Io { action: action.to_string(), path: path.to_path_buf(), source }
    }

    /// The mode and owner of the entry `name`, not following a link; `None` if absent.
    pub fn lstat(&self, name: &str) -> Result<Option<(libc::mode_t, u32)>, DirError> {
        let c = c_name(name)?;
        // SAFETY: zeroed memory is a valid `stat`; fstatat writes into it.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: a valid descriptor, C string and out pointer.
        if unsafe { libc::fstatat(self.fd.as_raw_fd(), c.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) } != 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::NotFound {
                return Ok(None);
            }
            return Err(self.io("stat", &self.path.join(name), e));
        }
        Ok(Some((st.st_mode, st.st_uid)))
    }

    /// `openat(name)` with `flags | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK | O_NOCTTY`.
    fn open_at(&self, name: &str, flags: libc::c_int, mode: u32, expected: &'static str) -> Result<OwnedFd, DirError> {
        let c = c_name(name)?;
        let flags = flags | libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK | libc::O_NOCTTY;
        // SAFETY: a valid descriptor and C string; the mode is read only with O_CREAT.
        let fd = unsafe { libc::openat(self.fd.as_raw_fd(), c.as_ptr(), flags, mode as libc::c_uint) };
        if fd < 0 {
            let e = io::Error::last_os_error();
            let found = self.lstat(name).ok().flatten();
            return Err(Self::refusal(e, &self.path.join(name), &self.path, found, expected, "open"));
        }
        // SAFETY: `fd` was just opened and is owned by nothing else.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Opens the subdirectory `name`, refusing a link unless this user or root owns it
    /// ([`own_link`]).
    pub fn open_dir(&self, name: &str) -> Result<Dir, DirError> {
        let path = self.path.join(name);
        match self.open_at(name, libc::O_RDONLY | libc::O_DIRECTORY, 0, "a directory") {
            Ok(fd) => Ok(Dir { fd, path }),
            Err(DirError::Planted { what, owner, .. }) if what == kind_of(libc::S_IFLNK) && trusted(owner) => {
                let c = c_name(name)?;
                let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC | libc::O_NONBLOCK;
                // SAFETY: a valid descriptor and C string.
                let fd = unsafe { libc::openat(self.fd.as_raw_fd(), c.as_ptr(), flags) };
                if fd < 0 {
                    let source = io::Error::last_os_error();
                    return Err(DirError::Io { action: "open the directory its link names".into(), path, source });
                }
                // SAFETY: `fd` was just opened and is owned by nothing else.
                Ok(Dir { fd: unsafe { OwnedFd::from_raw_fd(fd) }, path })
            }
            Err(e) => Err(e),
        }
    }

    /// Creates the subdirectory `name` with `mode` (less the umask) if it is missing, and
    /// opens it; a link (or anything but a directory) there is refused.
    pub fn create_dir(&self, name: &str, mode: u32) -> Result<Dir, DirError> {
        let c = c_name(name)?;
        // SAFETY: a valid descriptor and C string.
        if unsafe { libc::mkdirat(self.fd.as_raw_fd(), c.as_ptr(), mode as libc::mode_t) } != 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::AlreadyExists {
                return Err(self.io("create the directory", &self.path.join(name), e));
            }
        }
        self.open_dir(name)
    }

    /// Opens the file `name`, which must be a regular file (a link, FIFO or device is refused
    /// without being followed or waited on); with [`Access::ReadWriteCreate`] it is created
    /// with `mode` if missing.
    pub fn open_file(&self, name: &str, access: Access, mode: u32) -> Result<File, DirError> {
        let flags = match access {
            Access::Read => libc::O_RDONLY,
            Access::ReadWriteCreate => libc::O_RDWR | libc::O_CREAT,
        };
        let fd = self.open_at(name, flags, mode, "a regular file")?;
        self.regular(fd, name)
    }

    /// `fd` as a file, if it is a regular file.
    fn regular(&self, fd: OwnedFd, name: &str) -> Result<File, DirError> {
        let path = self.path.join(name);
        let st = fstat(&fd).map_err(|e| self.io("stat", &path, e))?;
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(DirError::Planted {
                path,
                parent: self.path.clone(),
                what: kind_of(st.st_mode),
                owner: st.st_uid,
                expected: "a regular file",
            });
        }
        Ok(File::from(fd))
    }

    /// The bytes of the regular file `name`, at most `limit` of them ([`bounded`]).
    pub fn read(&self, name: &str, limit: u64) -> Result<Vec<u8>, DirError> {
        let path = self.path.join(name);
        let file = self.open_file(name, Access::Read, 0)?;
        let size = file.metadata().map_err(|e| self.io("stat", &path, e))?.len();
        if size > limit {
            return Err(ReadError::TooLarge { path, size, limit }.into());
        }
        Ok(bounded::read_opened(file, &path, size, limit)?)
    }

    /// Creates the new file `name` with `mode` (`O_CREAT|O_EXCL`: whatever is there already,
    /// a link included, makes it fail).
    pub fn create_new(&self, name: &str, mode: u32) -> Result<File, DirError> {
        let fd = self.open_at(name, libc::O_RDWR | libc::O_CREAT | libc::O_EXCL, mode, "nothing")?;
        self.regular(fd, name)
    }

    /// Replaces `name` atomically and durably with the file `fill` writes: into a new temp
    /// file beside it (`.{name}.tmp-{pid}-{n}`, mode `mode`), fsynced, renamed over `name`
    /// (a link there is replaced, never written through), then the directory fsynced. On an
    /// error the temp file is removed and `name` is as it was.
    pub fn replace(
        &self,
        name: &str,
        mode: u32,
        fill: impl FnOnce(&mut File) -> io::Result<()>,
    ) -> Result<(), DirError> {
        c_name(name)?;
        let (tmp, mut file) = self.temp_file(name, mode)?;
        let path = self.path.join(name);
        let result = fill(&mut file)
            .and_then(|()| file.flush())
            .and_then(|()| file.sync_all())
            .map_err(|e| self.io("write", &path, e))
            .and_then(|()| self.rename(&tmp, name))
            .and_then(|()| self.sync());
        if result.is_err() {
            let _ = self.remove_file(&tmp);
        }
        result
    }

    /// A new temp file for `name`, trying other numbers if one is taken (by a crashed save or
    /// by someone else).
    fn temp_file(&self, name: &str, mode: u32) -> Result<(String, File), DirError> {
        let mut last = None;
        for _ in 0..16 {
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let tmp = format!(".{name}.tmp-{}-{n}", std::process::id());
            match self.create_new(&tmp, mode) {
                Ok(file) => return Ok((tmp, file)),
                Err(DirError::Io { source, .. }) if source.kind() == io::ErrorKind::AlreadyExists => {
                    last = Some(source);
                }
                Err(e) => return Err(e),
            }
        }
        Err(self.io("create a temp file", &self.path.join(name), last.expect("at least one try")))
    }

    /// Renames the entry `from` to `to`, both in this directory (`renameat`): whatever `to`
    /// was, a link included, is replaced, not followed.
    pub fn rename(&self, from: &str, to: &str) -> Result<(), DirError> {
        let (a, b) = (c_name(from)?, c_name(to)?);
        let fd = self.fd.as_raw_fd();
        // SAFETY: valid descriptors and C strings.
        if unsafe { libc::renameat(fd, a.as_ptr(), fd, b.as_ptr()) } != 0 {
            let e = io::Error::last_os_error();
            return Err(self.io(&format!("rename {} to it", self.path.join(from).display()), &self.path.join(to), e));
        }
        Ok(())
    }

    /// Removes the file (or link) `name` (`unlinkat`); a missing one is not an error.
    pub fn remove_file(&self, name: &str) -> Result<(), DirError> {
        self.unlink(name, 0)
    }

    /// Removes the empty directory `name`; a missing one is not an error.
    pub fn remove_dir(&self, name: &str) -> Result<(), DirError> {
        self.unlink(name, libc::AT_REMOVEDIR)
    }

    fn unlink(&self, name: &str, flags: libc::c_int) -> Result<(), DirError> {
        let c = c_name(name)?;
        // SAFETY: a valid descriptor and C string.
        if unsafe { libc::unlinkat(self.fd.as_raw_fd(), c.as_ptr(), flags) } != 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::NotFound {
                return Err(self.io("remove", &self.path.join(name), e));
            }
        }
        Ok(())
    }

    /// Fsyncs the directory, so that entries created, renamed or removed in it are durable.
    pub fn sync(&self) -> Result<(), DirError> {
        // SAFETY: a valid descriptor.
        if unsafe { libc::fsync(self.fd.as_raw_fd()) } != 0 {
            return Err(self.io("fsync", &self.path, io::Error::last_os_error()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
