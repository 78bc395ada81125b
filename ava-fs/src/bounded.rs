//! Bounded reading of files that come from outside: config files, lock files, plugin
//! libraries, checkpoint manifests, model configs.
//!
//! Why: `fs::read` of a path trusts it. A FIFO makes it block forever (and `open` of a FIFO
//! blocks before any read), `/dev/zero` makes it allocate until the process dies, and a
//! multi-gigabyte file is read whole before any check. Here the file is opened without
//! blocking, its type and size are checked on the opened descriptor (so swapping the path
//! afterwards changes nothing), and at most `limit` bytes are ever read.

use std::{
    fmt,
    fs::File,
    io::{self, Read},
    path::{Path, PathBuf},
};

/// Size limits for the kinds of files Ava reads, in bytes. Generous for real files, small
/// enough that a hostile one cannot exhaust memory.
pub mod limits {
    /// A config file (YAML/TOML), `--set` values included.
    pub const CONFIG: u64 = 4 << 20;
    /// `ava-plugins.lock` and its signature, the machine policy file.
    pub const LOCK: u64 = 4 << 20;
    /// A plugin library.
    pub const LIBRARY: u64 = 1 << 30;
    /// Small JSON documents: a checkpoint manifest, `trainer.json`, a model's `config.json`,
    /// a safetensors index.
    pub const JSON: u64 = 64 << 20;
    /// Files that are legitimately as large as a model or a corpus (safetensors weights,
    /// text data): only the file type is really checked (a FIFO or device is refused).
    pub const LARGE: u64 = 1 << 42;
}

/// Why a file could not be read within bounds.
#[derive(Debug)]
pub enum ReadError {
    /// No such file.
    Missing(PathBuf),
    /// A directory, FIFO, socket or device where a regular file was expected.
    NotRegular {
        /// The path.
        path: PathBuf,
        /// What it is instead, in words.
        what: &'static str,
    },
    /// Larger than the limit for its kind.
    TooLarge {
        /// The path.
        path: PathBuf,
        /// Its size.
        size: u64,
        /// The limit.
        limit: u64,
    },
    /// Any other I/O error.
    Io {
        /// The path.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
}

impl ReadError {
    /// The file concerned.
    pub fn path(&self) -> &Path {
        match self {
            Self::Missing(p)
            | Self::NotRegular { path: p, .. }
            | Self::TooLarge { path: p, .. }
            | Self::Io { path: p, .. } => p,
        }
    }

    /// Whether the file does not exist (callers for which that is normal check this).
    pub fn is_missing(&self) -> bool {
        matches!(self, Self::Missing(_))
    }
}

impl fmt::Display for ReadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Missing(p) => write!(f, "{}: no such file", p.display()),
            Self::NotRegular { path, what } => {
                write!(f, "{}: is {what}, not a regular file; name a regular file instead", path.display())
            }
            Self::TooLarge { path, size, limit } => write!(
                f,
                "{}: {size} bytes is more than the {limit} bytes allowed for this kind of file; is it the right file?",
                path.display()
            ),
            Self::Io { path, source } => write!(f, "{}: {source}", path.display()),
        }
    }
}

impl std::error::Error for ReadError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// The kind of a non-regular file, in words.
fn kind_of(ft: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if ft.is_dir() {
        "a directory"
    } else if ft.is_fifo() {
        "a FIFO (named pipe)"
    } else if ft.is_socket() {
        "a socket"
    } else if ft.is_char_device() {
        "a character device"
    } else if ft.is_block_device() {
        "a block device"
    } else {
        "not a regular file"
    }
}

/// Opens `path` for reading without blocking (a FIFO would block `open` itself) and checks,
/// on the opened descriptor, that it is a regular file of at most `limit` bytes. Returns the
/// file and its size. Symbolic links are followed; callers that refuse them check first.
pub fn open_regular(path: &Path, limit: u64) -> Result<(File, u64), ReadError> {
    use std::os::unix::fs::OpenOptionsExt;
    let file =
        std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY).open(path).map_err(
            |e| match e.kind() {
                io::ErrorKind::NotFound => ReadError::Missing(path.to_path_buf()),
                _ => ReadError::Io { path: path.to_path_buf(), source: e },
            },
        )?;
    let meta = file.metadata().map_err(|e| ReadError::Io { path: path.to_path_buf(), source: e })?;
    if !meta.file_type().is_file() {
        return Err(ReadError::NotRegular { path: path.to_path_buf(), what: kind_of(meta.file_type()) });
    }
    if meta.len() > limit {
        return Err(ReadError::TooLarge { path: path.to_path_buf(), size: meta.len(), limit });
    }
    Ok((file, meta.len()))
}

/// The bytes of the regular file `path`, of at most `limit` bytes. A file that grows while
/// it is read is cut at `limit + 1` bytes and refused.
pub fn read(path: &Path, limit: u64) -> Result<Vec<u8>, ReadError> {
    let (file, size) = open_regular(path, limit)?;
    read_opened(file, path, size, limit)
}

/// Reads an already-checked file (from [`open_regular`]) to its end, at most `limit` bytes.
pub fn read_opened(file: File, path: &Path, size: u64, limit: u64) -> Result<Vec<u8>, ReadError> {
    let mut bytes = Vec::with_capacity(size as usize);
    file.take(limit + 1).read_to_end(&mut bytes).map_err(|e| ReadError::Io { path: path.to_path_buf(), source: e })?;
    if bytes.len() as u64 > limit {
        return Err(ReadError::TooLarge { path: path.to_path_buf(), size: bytes.len() as u64, limit });
    }
    Ok(bytes)
}

/// The text of the regular file `path`, of at most `limit` bytes; not UTF-8 is an
/// [`ReadError::Io`] of kind `InvalidData`.
pub fn read_to_string(path: &Path, limit: u64) -> Result<String, ReadError> {
    let bytes = read(path, limit)?;
    String::from_utf8(bytes).map_err(|e| ReadError::Io {
        path: path.to_path_buf(),
        source: io::Error::new(io::ErrorKind::InvalidData, format!("not UTF-8 text ({e})")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_regular_file_within_the_limit_is_read_whole() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.yaml");
        std::fs::write(&p, b"x: 1\n").unwrap();
        assert_eq!(read(&p, 5).unwrap(), b"x: 1\n");
        assert_eq!(read_to_string(&p, 100).unwrap(), "x: 1\n");
    }

    #[test]
    fn a_file_over_the_limit_is_refused_with_both_sizes() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("big");
        std::fs::write(&p, vec![0u8; 10]).unwrap();
        let e = read(&p, 9).unwrap_err();
        assert!(matches!(e, ReadError::TooLarge { size: 10, limit: 9, .. }), "{e:?}");
        assert!(e.to_string().contains("10 bytes is more than the 9 bytes"), "{e}");
    }

    #[test]
    fn a_fifo_is_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("lib.so");
        let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = read(&p, 1 << 20).unwrap_err();
        assert!(e.to_string().contains("a FIFO (named pipe), not a regular file"), "{e}");
    }

    #[test]
    fn devices_and_directories_are_refused() {
        let e = read(Path::new("/dev/zero"), 1 << 20).unwrap_err();
        assert!(e.to_string().contains("a character device"), "{e}");
        let dir = tempfile::tempdir().unwrap();
        let e = read(dir.path(), 1 << 20).unwrap_err();
        assert!(e.to_string().contains("a directory"), "{e}");
        assert!(read(&dir.path().join("nope"), 1).unwrap_err().is_missing());
    }
}
