//! `ava-plugins.lock`: the plugins a platform team has vetted, pinned by the sha256 of the
//! library file. TOML by default; YAML when the file name ends in `.yaml`/`.yml`.
//!
//! ```toml
//! version = 1
//!
//! [[plugins]]
//! name = "lion"
//! kind = "optimizer"
//! version = "0.1.0"
//! sha256 = "9f2c…"
//! file = "libava_plugin_lion.so"
//! ```

use std::{
    fmt,
    io::Write,
    path::{Path, PathBuf},
    str::FromStr,
};

use serde::{Deserialize, Serialize};

use crate::HostError;

/// How strictly plugin libraries are checked before they are opened.
/// Ordered from loosest to strictest, so a floor is a maximum.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VettingPolicy {
    /// Load whatever is found (a pinned plugin whose bytes changed is still refused).
    #[default]
    Open,
    /// Load, but warn about every plugin that is not pinned.
    Warn,
    /// Open only pinned plugins whose bytes match the pin; refuse symlinks and plugin
    /// directories or files writable by group or others.
    Vetted,
}

impl VettingPolicy {
    /// All values, for messages.
    pub const ALL: [VettingPolicy; 3] = [Self::Open, Self::Warn, Self::Vetted];

    /// The accepted config words, in order.
    pub const NAMES: &'static [&'static str] = &["open", "warn", "vetted"];

    /// Parses the config word.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.as_str() == s)
    }

    /// The config spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Open => "open",
            Self::Warn => "warn",
            Self::Vetted => "vetted",
        }
    }
}

impl FromStr for VettingPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::parse(s).ok_or_else(|| format!("'{s}' is not one of open, warn, vetted"))
    }
}

impl fmt::Display for VettingPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One vetted library.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pin {
    /// Plugin name from its manifest.
    pub name: String,
    /// Plugin kind (`optimizer`, ...).
    pub kind: String,
    /// Plugin version from its manifest.
    pub version: String,
    /// sha256 of the library file, lowercase hex.
    pub sha256: String,
    /// File name of the library (no directory), used to recognise a modified library.
    pub file: String,
}

/// The lock file's contents.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LockFile {
    /// Format version (1).
    #[serde(default = "one")]
    pub version: u32,
    /// The pins.
    #[serde(default)]
    pub plugins: Vec<Pin>,
}

fn one() -> u32 {
    1
}

impl Default for LockFile {
    fn default() -> Self {
        Self { version: 1, plugins: Vec::new() }
    }
}

/// The mode a written lock file gets: it holds hashes and pins, not secrets, and every user
/// who runs ava must read it; only its owner may change it.
pub const LOCK_FILE_MODE: u32 = 0o644;

/// A lock file that exists but cannot be read (permission denied, an I/O error): a problem
/// with the setup, said with the path and how to fix it.
pub(crate) fn unreadable(path: &Path, source: &std::io::Error) -> HostError {
    let fix = if source.kind() == std::io::ErrorKind::PermissionDenied {
        format!(
            "make it readable by the users who run ava (`chmod 644 {}`, and let them into its directory; \
             a lock file holds hashes, not secrets), or name another with plugins.lock_file",
            path.display()
        )
    } else {
        "fix it by hand or delete it and re-pin with `ava plugins vet`, or name another with plugins.lock_file"
            .to_string()
    };
    HostError::Lock { path: path.to_path_buf(), reason: format!("the lock file cannot be read ({source}); {fix}") }
}

fn is_yaml(path: &Path) -> bool {
    matches!(path.extension().and_then(|e| e.to_str()), Some("yaml" | "yml"))
}

impl LockFile {
    /// Reads `path`; a missing file is an empty lock.
    pub fn read(path: &Path) -> Result<LockFile, HostError> {
        let bad = |reason: String| HostError::Lock {
            path: path.to_path_buf(),
            reason: format!("{reason}; fix it by hand or delete it and re-pin with `ava plugins vet`"),
        };
        // Bounded: a FIFO or a device at the lock path would hang or exhaust memory.
        let text = match ava_fs::bounded::read_to_string(path, ava_fs::bounded::limits::LOCK) {
            Ok(t) => t,
            Err(e) if e.is_missing() => return Ok(LockFile::default()),
            Err(ava_fs::bounded::ReadError::Io { source, .. }) => return Err(unreadable(path, &source)),
            Err(e) => {
                let full = e.to_string();
                let prefix = format!("{}: ", path.display());
                return Err(bad(full.strip_prefix(&prefix).unwrap_or(&full).to_string()));
            }
        };
        Self::parse(path, &text)
    }

    /// Parses the text of the lock file at `path` (named in errors; its extension picks the
    /// format). The signature check reads the bytes once and parses them here.
    pub fn parse(path: &Path, text: &str) -> Result<LockFile, HostError> {
        let bad = |reason: String| HostError::Lock {
            path: path.to_path_buf(),
            reason: format!("{reason}; fix it by hand or delete it and re-pin with `ava plugins vet`"),
        };
        let lock: LockFile = if is_yaml(path) {
            // Bounded before the loader expands aliases.
            crate::yaml_guard::check(text, &crate::yaml_guard::YamlLimits::DEFAULT)
                .map_err(|e| bad(format!("not a usable YAML lock file: {e}")))?;
            let value: serde_json::Value = config::Config::builder()
                .add_source(config::File::from_str(text, config::FileFormat::Yaml))
                .build()
                .and_then(|c| c.try_deserialize())
                .map_err(|e| bad(format!("not a valid YAML lock file: {e}")))?;
            serde_json::from_value(value).map_err(|e| bad(format!("not a valid lock file: {e}")))?
        } else {
            toml::from_str(text).map_err(|e| bad(format!("not a valid TOML lock file: {e}")))?
        };
        if lock.version != 1 {
            return Err(bad(format!(
                "lock file version {} is not supported (this ava writes version 1)",
                lock.version
            )));
        }
        for p in &lock.plugins {
            if p.sha256.len() != 64 || !p.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(bad(format!("pin '{}' has sha256 {:?}, which is not 64 hex digits", p.name, p.sha256)));
            }
        }
        Ok(lock)
    }

    /// The pin whose hash is `sha256`.
    pub fn by_sha(&self, sha256: &str) -> Option<&Pin> {
        self.plugins.iter().find(|p| p.sha256.eq_ignore_ascii_case(sha256))
    }

    /// The pin for a library file name.
    pub fn by_file(&self, file: &str) -> Option<&Pin> {
        self.plugins.iter().find(|p| p.file == file)
    }

    /// Adds `pin`, replacing pins with the same (kind, name) or the same file name. Returns
    /// the pins it replaced.
    pub fn upsert(&mut self, pin: Pin) -> Vec<Pin> {
        let (replaced, kept): (Vec<Pin>, Vec<Pin>) = std::mem::take(&mut self.plugins)
            .into_iter()
            .partition(|p| (p.kind == pin.kind && p.name == pin.name) || p.file == pin.file);
        self.plugins = kept;
        self.plugins.push(pin);
        self.plugins.sort_by(|a, b| (&a.kind, &a.name).cmp(&(&b.kind, &b.name)));
        replaced
    }

    /// The file's text in the format its name asks for.
    pub fn render(&self, path: &Path) -> String {
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let mut out = format!(
            "# {name}: plugin libraries vetted for this project, pinned by sha256.\n\
             # Written by `ava plugins vet`. Under `plugins.policy: vetted` nothing else is opened.\n",
        );
        let q = |s: &str| serde_json::Value::from(s).to_string();
        if is_yaml(path) {
            out.push_str(&format!("version: {}\nplugins:\n", self.version));
            if self.plugins.is_empty() {
                out.truncate(out.len() - 1);
                out.push_str(" []\n");
            }
            for p in &self.plugins {
                out.push_str(&format!(
                    "  - name: {}\n    kind: {}\n    version: {}\n    sha256: {}\n    file: {}\n",
                    q(&p.name),
                    q(&p.kind),
                    q(&p.version),
                    q(&p.sha256),
                    q(&p.file)
                ));
            }
        } else {
            out.push_str(&format!("version = {}\n", self.version));
            for p in &self.plugins {
                out.push_str(&format!(
                    "\n[[plugins]]\nname = {}\nkind = {}\nversion = {}\nsha256 = {}\nfile = {}\n",
                    q(&p.name),
                    q(&p.kind),
                    q(&p.version),
                    q(&p.sha256),
                    q(&p.file)
                ));
            }
        }
        out
    }

    /// Writes the lock atomically (temp file in the same directory, then rename), readable
    /// by everyone ([`LOCK_FILE_MODE`]): every user who runs ava reads it.
    pub fn write(&self, path: &Path) -> Result<(), HostError> {
        use std::os::unix::fs::PermissionsExt;
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let mut tmp = tempfile::NamedTempFile::new_in(&dir).map_err(|e| HostError::io(&dir, e))?;
        // The temporary file is created 0600; renamed as is, the lock would be root's alone
        // and every other user's command would fail on it.
        tmp.as_file()
            .set_permissions(std::fs::Permissions::from_mode(LOCK_FILE_MODE))
            .map_err(|e| HostError::io(path, e))?;
        tmp.write_all(self.render(path).as_bytes()).map_err(|e| HostError::io(path, e))?;
        tmp.as_file().sync_all().map_err(|e| HostError::io(path, e))?;
        tmp.persist(path).map_err(|e| HostError::io(path, e.error))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;

    fn pin(name: &str, sha: char) -> Pin {
        Pin {
            name: name.into(),
            kind: "optimizer".into(),
            version: "0.1.0".into(),
            sha256: sha.to_string().repeat(64),
            file: format!("libava_plugin_{name}.so"),
        }
    }

    #[test]
    fn round_trips_toml_and_yaml() {
        let dir = tempfile::tempdir().unwrap();
        let mut lock = LockFile::default();
        lock.upsert(pin("lion", 'a'));
        lock.upsert(pin("adam-8bit", 'b'));
        for name in ["ava-plugins.lock", "ava-plugins.yaml"] {
            let path = dir.path().join(name);
            lock.write(&path).unwrap();
            assert_eq!(LockFile::read(&path).unwrap(), lock, "{name}:\n{}", fs::read_to_string(&path).unwrap());
        }
    }

    /// Issue "hardening, second pass": the lock was written 0600 (the temporary file's mode),
    /// so after `sudo ava plugins vet --lock /etc/ava/...` no other user could run ava.
    #[test]
    fn a_written_lock_is_readable_by_everyone_and_replaced_atomically() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ava-plugins.lock");
        fs::write(&path, "version = 1\n").unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).unwrap();
        let mut lock = LockFile::default();
        lock.upsert(pin("lion", 'a'));
        lock.write(&path).unwrap();
        assert_eq!(fs::metadata(&path).unwrap().permissions().mode() & 0o7777, 0o644);
        assert_eq!(LockFile::read(&path).unwrap(), lock);
        // Only the lock is left in the directory: the temporary file was renamed over it.
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn upsert_replaces_same_name_or_file() {
        let mut lock = LockFile::default();
        lock.upsert(pin("lion", 'a'));
        let replaced = lock.upsert(pin("lion", 'c'));
        assert_eq!(replaced.len(), 1);
        assert_eq!(lock.plugins.len(), 1);
        assert_eq!(lock.by_sha(&"c".repeat(64)).unwrap().name, "lion");
        assert!(lock.by_sha(&"a".repeat(64)).is_none());
    }

    #[test]
    fn missing_file_is_empty_and_bad_hash_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(LockFile::read(&dir.path().join("nope.lock")).unwrap(), LockFile::default());
        let path = dir.path().join("bad.lock");
        fs::write(&path, "[[plugins]]\nname='x'\nkind='optimizer'\nversion='1'\nsha256='zz'\nfile='x.so'\n").unwrap();
        let err = LockFile::read(&path).unwrap_err().to_string();
        assert!(err.contains("pin 'x' has sha256 \"zz\", which is not 64 hex digits"), "{err}");
    }

    /// Issue 20: a YAML lock file is bounded before it is loaded, and a FIFO or a device at
    /// the lock path is refused without blocking.
    #[test]
    fn an_alias_bomb_or_a_fifo_as_the_lock_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ava-plugins.yaml");
        let mut bomb = String::from("a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n");
        for i in 1..7 {
            let p = i - 1;
            bomb.push_str(&format!("a{i}: &a{i} [{}]\n", vec![format!("*a{p}"); 10].join(", ")));
        }
        fs::write(&path, bomb).unwrap();
        let e = LockFile::read(&path).unwrap_err().to_string();
        assert!(e.contains("not a usable YAML lock file: line 5: the YAML expands to more than 100000 values"), "{e}");
        let fifo = dir.path().join("fifo.lock");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = LockFile::read(&fifo).unwrap_err().to_string();
        assert!(e.contains("fifo.lock: is a FIFO (named pipe), not a regular file"), "{e}");
    }
}
