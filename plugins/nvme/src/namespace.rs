//! The run's own directory under the tier's path: `<path>/ava-<uid>/ava-run-<id>/`, with a
//! `lock` file held (`flock`) for the run's lifetime, so two runs never share files even when
//! they are given the same path. Directories whose lock nobody holds are left over from runs
//! that ended without cleaning up (killed, crashed); they are removed when the next run of
//! the same user starts, since offloaded records are scratch (a checkpoint copies what it
//! needs).
//!
//! The path may be shared by several users (`/mnt/nvme`, `/tmp`), so nothing in it is taken
//! on trust: each user's runs live in a per-user directory `ava-<uid>` of mode 0700, created
//! by this user and refused if it is this user's but a link, not a directory, or open to group
//! or others. One that another user made first under this user's name is passed over for
//! `ava-<uid>-1` (up to `-15`), said in the tier's note. Other users' directories are never
//! read or touched. Inside it,
//! entries are created and opened relative to the opened directory (`mkdirat`, `openat`)
//! without following links, and a lock file is opened without blocking and must be a regular
//! file: a FIFO or a link there is refused at once, naming it.

use std::{
    ffi::CString,
    fs::File,
    io::{self, Read},
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd},
        unix::ffi::OsStrExt,
    },
    path::{Path, PathBuf},
};

use crate::record::{RunId, run_hex};

const PREFIX: &str = "ava-run-";

/// The run's directory, locked; removed with its records on drop.
#[derive(Debug)]
pub struct RunDir {
    /// `<path>/ava-<uid>/ava-run-<id>`.
    pub dir: PathBuf,
    /// The run's id, written into every record.
    pub id: RunId,
    /// Leftover directories of this user's dead runs removed when this one was made.
    pub removed_leftovers: usize,
    /// `path` did not exist and was made (with its missing parents).
    pub created_path: bool,
    /// Directories under this user's names that other users made first (path, owner),
    /// passed over for the next name.
    pub squatted: Vec<Squatted>,
    _lock: File,
}

/// A fresh run directory, made and locked in this user's directory.
struct Made {
    dir: PathBuf,
    id: RunId,
    lock: File,
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

/// `name` as a C string (a name with a NUL byte cannot exist).
fn c_name(name: &[u8]) -> io::Result<CString> {
    CString::new(name).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a name with a NUL byte"))
}

/// The effective user id of this process.
pub fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

/// `fstatat(dir, name)` without following a link.
fn lstat_at(dir: &OwnedFd, name: &[u8]) -> io::Result<libc::stat> {
    let c = c_name(name)?;
    // SAFETY: zeroed memory is a valid `stat`; fstatat writes into it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a valid descriptor, C string and out pointer.
    if unsafe { libc::fstatat(dir.as_raw_fd(), c.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st)
}

/// What a `stat` describes, in words ("a symbolic link", "a FIFO (named pipe)", ...).
fn kind_of(mode: libc::mode_t) -> &'static str {
    match mode & libc::S_IFMT {
        libc::S_IFLNK => "a symbolic link",
        libc::S_IFIFO => "a FIFO (named pipe)",
        libc::S_IFSOCK => "a socket",
        libc::S_IFCHR => "a character device",
        libc::S_IFBLK => "a block device",
        libc::S_IFDIR => "a directory",
        _ => "a regular file",
    }
}

/// Opens `name` in `dir` with `flags` plus `O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK`: a link is
/// never followed and a FIFO never waited on. `path` is `name`'s full path, for messages.
fn open_at(dir: &OwnedFd, name: &[u8], flags: libc::c_int, mode: libc::mode_t, path: &Path) -> io::Result<OwnedFd> {
    let c = c_name(name)?;
    let flags = flags | libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK | libc::O_NOCTTY;
    // SAFETY: a valid descriptor and C string; the mode is read only with O_CREAT.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), c.as_ptr(), flags, libc::c_uint::from(mode)) };
    if fd < 0 {
        let e = io::Error::last_os_error();
        return Err(match (e.raw_os_error(), lstat_at(dir, name)) {
            (Some(libc::ELOOP | libc::ENOTDIR | libc::ENXIO), Ok(st)) => refused(path, kind_of(st.st_mode)),
            _ => io::Error::new(e.kind(), format!("{}: {e}", path.display())),
        });
    }
    // SAFETY: `fd` was just opened and is owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The error for an entry of the wrong kind where the tier keeps its files.
fn refused(path: &Path, what: &str) -> io::Error {
    io::Error::other(format!(
        "{} is {what}, which the nvme tier does not follow or wait on; someone put it there: remove it",
        path.display()
    ))
}

/// `fstat` of an open descriptor.
fn fstat(fd: &OwnedFd) -> io::Result<libc::stat> {
    // SAFETY: zeroed memory is a valid `stat`; fstat writes into it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a valid descriptor and out pointer.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st)
}

/// Opens the directory `name` in `dir` without following a link.
fn open_dir_at(dir: &OwnedFd, name: &[u8], path: &Path) -> io::Result<OwnedFd> {
    open_at(dir, name, libc::O_RDONLY | libc::O_DIRECTORY, 0, path)
}

/// Opens (or with `create`, creates anew, mode 0600) the lock file `lock` of the run
/// directory `dir`, refusing anything but a regular file.
fn open_lock(dir: &OwnedFd, dir_path: &Path, create: bool) -> io::Result<File> {
    let path = dir_path.join("lock");
    let flags = if create { libc::O_RDWR | libc::O_CREAT | libc::O_EXCL } else { libc::O_RDONLY };
    let fd = open_at(dir, b"lock", flags, 0o600, &path)?;
    let st = fstat(&fd)?;
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(refused(&path, kind_of(st.st_mode)));
    }
    Ok(File::from(fd))
}

/// Opens the directory the user named (following links in it: it is theirs to name).
fn open_named_dir(path: &Path) -> io::Result<OwnedFd> {
    let c = c_name(path.as_os_str().as_bytes())?;
    let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC;
    // SAFETY: a valid C string.
    let fd = unsafe { libc::open(c.as_ptr(), flags) };
    if fd < 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(e.kind(), format!("{}: {e}", path.display())));
    }
    // SAFETY: `fd` was just opened and is owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A directory another user made under one of this user's names: its path and owner.
pub type Squatted = (PathBuf, u32);

/// Names a user's directory may take: `ava-<uid>`, then `ava-<uid>-1` to `ava-<uid>-15`
/// when another user holds the name before it.
const USER_DIR_NAMES: usize = 16;

/// This user's directory in `base`: the first of `ava-<uid>`, `ava-<uid>-1`, ... that is not
/// another user's (one made in advance under this user's name, a squat, is passed over and
/// returned in the list, never touched), created (mode 0700) or opened, and refused if it is
/// this user's link, not a directory, or open to group or others.
fn user_dir(base: &OwnedFd, base_path: &Path) -> io::Result<(OwnedFd, PathBuf, Vec<Squatted>)> {
    let uid = euid();
    let mut squatted = Vec::new();
    for n in 0..USER_DIR_NAMES {
        let name = if n == 0 { format!("ava-{uid}") } else { format!("ava-{uid}-{n}") };
        let path = base_path.join(&name);
        let c = c_name(name.as_bytes())?;
        // SAFETY: a valid descriptor and C string.
        if unsafe { libc::mkdirat(base.as_raw_fd(), c.as_ptr(), 0o700) } != 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::AlreadyExists {
                return Err(io::Error::new(e.kind(), format!("cannot create {}: {e}", path.display())));
            }
        }
        let owner = lstat_at(base, name.as_bytes())
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?
            .st_uid;
        if owner != uid {
            squatted.push((path, owner));
            continue;
        }
        let fd = open_dir_at(base, name.as_bytes(), &path)?;
        check_private(&fstat(&fd)?, &path, uid)?;
        return Ok((fd, path, squatted));
    }
    Err(io::Error::other(format!(
        "{}: ava-{uid} and the {} names after it are other users' (uid {}): this user's offload records cannot go \
         there; set plugins.offload.path to a directory of your own",
        base_path.display(),
        USER_DIR_NAMES - 1,
        squatted.first().map_or(0, |s| s.1)
    )))
}

/// Refuses a per-user directory that is not `uid`'s alone.
fn check_private(st: &libc::stat, path: &Path, uid: u32) -> io::Result<()> {
    if st.st_uid != uid {
        return Err(io::Error::other(format!(
            "{} belongs to uid {}, not to this user (uid {uid}); another user made it where this user's offload \
             records go: remove it, or set plugins.offload.path to a directory of your own",
            path.display(),
            st.st_uid
        )));
    }
    if st.st_mode & 0o077 != 0 {
        return Err(io::Error::other(format!(
            "{} has mode {:o}: group or others can reach this user's offload records; run chmod 700 on it",
            path.display(),
            st.st_mode & 0o7777
        )));
    }
    Ok(())
}

/// Removes this user's run directories in `users` whose lock nobody holds; a lock that is
/// not a regular file is an error naming it. Returns how many were removed.
fn remove_dead_runs(users: &OwnedFd, users_path: &Path) -> io::Result<usize> {
    let mut removed = 0;
    for entry in std::fs::read_dir(users_path)? {
        let entry = entry?;
        let name = entry.file_name();
        if !name.to_string_lossy().starts_with(PREFIX) || !entry.file_type()?.is_dir() {
            continue;
        }
        let path = users_path.join(&name);
        let dir = open_dir_at(users, name.as_bytes(), &path)?;
        let lock = match open_lock(&dir, &path, false) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            other => other?,
        };
        if try_lock(&lock)? {
            std::fs::remove_dir_all(&path)?;
            removed += 1;
        }
    }
    Ok(removed)
}

impl RunDir {
    /// Makes `path` if needed, this user's 0700 directory in it, removes this user's dead
    /// runs' directories there, and creates (0700) and locks a fresh run directory.
    pub fn create(path: &Path) -> io::Result<Self> {
        let created_path = !path.exists();
        std::fs::create_dir_all(path)?;
        let base = open_named_dir(path)?;
        let mut tries = 0;
        loop {
            let (users, users_path, squatted) = user_dir(&base, path)?;
            let made = remove_dead_runs(&users, &users_path)
                .and_then(|removed| make_run_dir(&users, &users_path).map(|made| (removed, made)));
            match made {
                Ok((removed_leftovers, Made { dir, id, lock })) => {
                    return Ok(Self { dir, id, removed_leftovers, created_path, squatted, _lock: lock });
                }
                // The user directory was removed by a run of this user that just ended
                // (its last), while this one listed or used it: make it again.
                Err(e) if e.kind() == io::ErrorKind::NotFound && tries < 3 => tries += 1,
                Err(e) => return Err(e),
            }
        }
    }
}

/// Creates (0700) and locks a fresh run directory `ava-run-<id>` in `users`.
fn make_run_dir(users: &OwnedFd, users_path: &Path) -> io::Result<Made> {
    loop {
        let id = random_id()?;
        let name = format!("{PREFIX}{}", run_hex(&id));
        let dir = users_path.join(&name);
        let c = c_name(name.as_bytes())?;
        // SAFETY: a valid descriptor and C string.
        if unsafe { libc::mkdirat(users.as_raw_fd(), c.as_ptr(), 0o700) } != 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::AlreadyExists {
                continue;
            }
            return Err(io::Error::new(e.kind(), format!("cannot create {}: {e}", dir.display())));
        }
        let fd = open_dir_at(users, name.as_bytes(), &dir)?;
        let lock = open_lock(&fd, &dir, true)?;
        if !try_lock(&lock)? {
            return Err(io::Error::other(format!("{} is locked by another process", dir.display())));
        }
        return Ok(Made { dir, id, lock });
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        // Scratch: nothing here outlives the run (the lock goes with the file).
        let _ = std::fs::remove_dir_all(&self.dir);
        // This user's directory too, when no other run of theirs is in it (then it is not
        // empty and stays), so that the shared path is left as it was found.
        if let Some(users) = self.dir.parent() {
            let _ = std::fs::remove_dir(users);
        }
    }
}

#[cfg(test)]
mod tests;
