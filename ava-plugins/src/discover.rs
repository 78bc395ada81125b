//! Discovery: which directories are searched, which files in them are plugin libraries, and
//! the facts vetting needs — all found without opening (and so running) any library.
//!
//! A file is a candidate when its name ends in the platform's library suffix and its symbol
//! table exports abi_stable's library header. That is read from the bytes with the `object`
//! crate; `dlopen` would run the library's initialisers.

use std::{
    collections::HashSet,
    ffi::OsString,
    fs,
    path::{Path, PathBuf},
};

use ava_core::ffi::ROOT_SYMBOL;
use sha2::{Digest, Sha256};

use crate::HostError;

/// Where a search directory came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DirSource {
    /// `plugins.search_paths` in the config.
    Config,
    /// `$AVA_PLUGIN_PATH`.
    Env,
    /// The directory of the running `ava` executable.
    ExeDir,
    /// The machine policy's `search_paths` (the only directories searched then).
    Policy,
}

impl DirSource {
    /// For messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Config => "plugins.search_paths",
            Self::Env => "$AVA_PLUGIN_PATH",
            Self::ExeDir => "the ava executable's directory",
            Self::Policy => "the machine policy",
        }
    }
}

/// One directory to search.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SearchDir {
    /// The directory.
    pub path: PathBuf,
    /// Why it is searched.
    pub source: DirSource,
}

/// The search directories in order: config, then `$AVA_PLUGIN_PATH`, then the executable's
/// directory; a directory reached twice is searched once.
pub fn search_dirs(config: &[PathBuf], env: Option<OsString>, exe_dir: Option<PathBuf>) -> Vec<SearchDir> {
    let mut out = Vec::new();
    let mut seen = HashSet::new();
    let mut add = |path: PathBuf, source| {
        let key = fs::canonicalize(&path).unwrap_or_else(|_| path.clone());
        if seen.insert(key) {
            out.push(SearchDir { path, source });
        }
    };
    for p in config {
        add(p.clone(), DirSource::Config);
    }
    if let Some(env) = env {
        for p in std::env::split_paths(&env).filter(|p| !p.as_os_str().is_empty()) {
            add(p, DirSource::Env);
        }
    }
    if let Some(d) = exe_dir {
        add(d, DirSource::ExeDir);
    }
    out
}

/// Library files (by suffix) directly inside `dir`, sorted. A missing directory yields none.
pub fn library_files(dir: &Path) -> Result<Vec<PathBuf>, HostError> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(HostError::io(dir, e)),
    };
    let suffix = std::env::consts::DLL_SUFFIX;
    let mut files = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| HostError::io(dir, e))?;
        let path = entry.path();
        let name = entry.file_name();
        if name.to_string_lossy().ends_with(suffix) && !path.is_dir() {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// A library file read into memory: the bytes that are hashed are the bytes that get loaded.
#[derive(Clone)]
pub struct Candidate {
    /// Where it was found.
    pub path: PathBuf,
    /// The file's bytes.
    pub bytes: Vec<u8>,
    /// sha256 of `bytes`, lowercase hex.
    pub sha256: String,
    /// The path is a symbolic link.
    pub symlink: bool,
    /// Why the file, or a directory above it, could be changed by someone other than root
    /// and the invoking user, if it could ([`crate::trust`]).
    pub untrusted: Option<String>,
    /// Whether the symbol table exports abi_stable's header, read once with the bytes.
    header: Result<(), String>,
}

impl std::fmt::Debug for Candidate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Candidate")
            .field("path", &self.path)
            .field("len", &self.bytes.len())
            .field("sha256", &self.sha256)
            .field("symlink", &self.symlink)
            .field("untrusted", &self.untrusted)
            .finish()
    }
}

impl Candidate {
    /// Reads `path` (one read of the opened file) and records what vetting checks.
    pub fn read(path: &Path) -> Result<Candidate, HostError> {
        let meta = match fs::symlink_metadata(path) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(HostError::Missing { path: path.to_path_buf() });
            }
            Err(e) => return Err(HostError::io(path, e)),
        };
        let symlink = meta.file_type().is_symlink();
        // Bounded: a FIFO, a device (a symlink to /dev/zero) or a huge file in a search
        // directory is refused here instead of hanging or exhausting memory.
        let (file, size) =
            ava_fs::bounded::open_regular(path, ava_fs::bounded::limits::LIBRARY).map_err(read_refused)?;
        let bytes =
            ava_fs::bounded::read_opened(file, path, size, ava_fs::bounded::limits::LIBRARY).map_err(read_refused)?;
        // The bytes loaded are the bytes hashed, so this is only about a later replacement.
        let untrusted = crate::trust::untrusted_reason(path, "the library");
        let sha256 = hex::encode(Sha256::digest(&bytes));
        let header = exports_root_symbol(&bytes);
        Ok(Candidate { path: path.to_path_buf(), bytes, sha256, symlink, untrusted, header })
    }

    /// The file name without directory.
    pub fn file_name(&self) -> String {
        self.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
    }

    /// Whether the bytes are a shared library exporting abi_stable's root-module header.
    pub fn exports_plugin_header(&self) -> Result<(), String> {
        self.header.clone()
    }
}

/// A bounded read's refusal as a host error: a file that is not a regular file or is too
/// large is refused (a row in `plugins list`), not an I/O failure.
fn read_refused(e: ava_fs::bounded::ReadError) -> HostError {
    use ava_fs::bounded::ReadError;
    match e {
        ReadError::Missing(path) => HostError::Missing { path },
        ReadError::Io { path, source } => HostError::io(path, source),
        e @ (ReadError::NotRegular { .. } | ReadError::TooLarge { .. }) => {
            let path = e.path().to_path_buf();
            let full = e.to_string();
            let prefix = format!("{}: ", path.display());
            let reason = full.strip_prefix(&prefix).unwrap_or(&full).to_string();
            HostError::Refused { path, reason }
        }
    }
}

/// Checks the symbol table of a library image for the abi_stable header symbol.
pub fn exports_root_symbol(bytes: &[u8]) -> Result<(), String> {
    use object::Object;
    let file = object::File::parse(bytes).map_err(|e| format!("not a shared library this platform can read ({e})"))?;
    let exports = file.exports().map_err(|e| format!("its symbol table cannot be read ({e})"))?;
    let found = exports.flatten().any(|sym| match sym.name() {
        object::NameOrOrdinal::Name(name) => {
            name == ROOT_SYMBOL.as_bytes() || name.strip_prefix(b"_") == Some(ROOT_SYMBOL.as_bytes())
        }
        object::NameOrOrdinal::Ordinal(_) => false,
    });
    if found {
        Ok(())
    } else {
        Err(format!(
            "it exports no abi_stable library header (symbol {ROOT_SYMBOL}); build it with ava_core::export_plugin!"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn search_dirs_keep_order_and_drop_repeats() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a");
        let b = dir.path().join("b");
        fs::create_dir_all(&a).unwrap();
        fs::create_dir_all(&b).unwrap();
        let env = std::env::join_paths([&b, &a]).unwrap();
        let dirs = search_dirs(std::slice::from_ref(&a), Some(env), Some(b.clone()));
        assert_eq!(
            dirs,
            vec![SearchDir { path: a, source: DirSource::Config }, SearchDir { path: b, source: DirSource::Env }]
        );
    }

    #[test]
    fn non_libraries_are_not_candidates() {
        let err = exports_root_symbol(b"#!/bin/sh\necho hi\n").unwrap_err();
        assert!(err.starts_with("not a shared library"), "{err}");
    }

    #[cfg(unix)]
    #[test]
    fn a_fifo_or_a_link_to_a_device_is_refused_without_blocking_or_reading() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("libfifo.so");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = Candidate::read(&fifo).unwrap_err();
        assert!(matches!(e, HostError::Refused { .. }), "{e:?}");
        assert!(
            e.to_string().ends_with(
                "libfifo.so: refused: is a FIFO (named pipe), not a regular file; name a regular file instead"
            ),
            "{e}"
        );
        let zero = dir.path().join("libzero.so");
        std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
        let e = Candidate::read(&zero).unwrap_err();
        assert!(e.to_string().contains("refused: is a character device, not a regular file"), "{e}");
    }

    #[cfg(unix)]
    #[test]
    fn world_writable_directory_is_reported() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("libx.so");
        fs::write(&file, b"x").unwrap();
        fs::set_permissions(&file, fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(Candidate::read(&file).unwrap().untrusted, None);
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o777)).unwrap();
        let why = Candidate::read(&file).unwrap().untrusted.unwrap();
        assert!(why.contains("writable by group and others (mode 777)"), "{why}");
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o700)).unwrap();
    }
}
