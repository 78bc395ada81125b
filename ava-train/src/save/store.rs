//! [`CheckpointStore`]: checkpoints as directories `root/step-{step:08}` of named files plus a
//! `manifest.json`, a `root/latest` pointer, crash-safe saving, and pruning of old ones.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use super::SaveError;
use super::atomic::{fsync_dir_with, parent_dir, write_atomic_with, write_streamed_synced, write_synced};
use super::faults::{FaultInjector, durable, has_fired};
use super::manifest::{FileEntry, MANIFEST_FILE, MANIFEST_FORMAT, Manifest, check_bytes, check_file_name, sha256_hex};

/// The pointer file in the root: one line, the directory name of the newest checkpoint.
pub const LATEST_FILE: &str = "latest";

/// Prefix of everything a save leaves behind only when it crashes.
const TMP_PREFIX: &str = ".tmp-";

/// The directory name of the checkpoint of `step`: `step-00001000`.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

/// The step of a checkpoint directory name (`step-00001000` → 1000).
pub fn parse_step(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// A directory of checkpoints: `step-{step:08}` directories of named files plus a
/// `manifest.json`, and a `latest` pointer file naming the newest.
///
/// The property the save protocol keeps: a crash at any point leaves the previous checkpoint
/// loadable, and `latest` never names a partial checkpoint. Files are written into a hidden
/// `.tmp-` directory, the manifest last, everything fsynced; the directory is renamed into
/// place (atomically exchanged with an existing one of the same step, on Linux); only then
/// does `latest` move, itself replaced atomically. Leftovers of crashed saves start with
/// `.tmp-` and are removed by the next successful save. One process saves into a root at a
/// time.
#[derive(Clone, Debug)]
pub struct CheckpointStore {
    root: PathBuf,
    keep_last: usize,
    faults: Option<FaultInjector>,
}

/// A checkpoint read back and verified by [`CheckpointStore::load`].
#[derive(Debug, PartialEq, Eq)]
pub struct LoadedCheckpoint {
    /// The checkpoint directory.
    pub dir: PathBuf,
    /// The step it was saved at.
    pub step: u64,
    /// Every file but the manifest, by name.
    pub files: BTreeMap<String, FileData>,
}

/// A checkpoint file's bytes, verified against the manifest: read into memory, or (a file of
/// [`FileData::MAP_FROM`] bytes or more) mapped, so that a checkpoint larger than memory can
/// be loaded: its pages come through the page cache as they are used and can be dropped.
#[derive(Debug)]
pub enum FileData {
    /// Read whole.
    Read(Vec<u8>),
    /// Mapped read-only.
    Mapped(memmap2::Mmap),
}

impl FileData {
    /// Files this large or larger are mapped.
    pub const MAP_FROM: u64 = 16 << 20;
}

impl std::ops::Deref for FileData {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            FileData::Read(bytes) => bytes,
            FileData::Mapped(map) => map,
        }
    }
}

impl PartialEq for FileData {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl Eq for FileData {}

impl LoadedCheckpoint {
    /// The bytes of file `name`, or an error naming the checkpoint and the files it has.
    pub fn file(&self, name: &str) -> Result<&[u8], SaveError> {
        self.files.get(name).map(|f| &**f).ok_or_else(|| self.no_such_file(name))
    }

    /// Takes file `name` out of the checkpoint (no copy), or an error as [`file`](Self::file).
    pub fn take(&mut self, name: &str) -> Result<FileData, SaveError> {
        self.files.remove(name).ok_or_else(|| self.no_such_file(name))
    }

    fn no_such_file(&self, name: &str) -> SaveError {
        let available = self.files.keys().map(String::as_str).collect::<Vec<_>>().join(", ");
        SaveError::NoSuchFile { dir: self.dir.clone(), name: name.to_string(), available }
    }
}

impl CheckpointStore {
    /// A store in `root` (created by the first save) that keeps the `keep_last` newest
    /// checkpoints, by step; `0` keeps all of them.
    pub fn new(root: impl Into<PathBuf>, keep_last: usize) -> Self {
        Self { root: root.into(), keep_last, faults: None }
    }

    /// For tests: counts the durable operations of this store and fails the chosen one; see
    /// [`FaultInjector`].
    pub fn with_faults(mut self, faults: FaultInjector) -> Self {
        self.faults = Some(faults);
        self
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Writes `files` (name, bytes) as the checkpoint of `step`, directory
    /// `root/step-{step:08}`, replacing one of the same step; points `latest` at it; then
    /// removes checkpoints beyond `keep_last` and leftovers of crashed saves. Returns the
    /// directory. Names must be plain, distinct file names, not starting with `.`, and not
    /// `manifest.json`.
    ///
    /// On [`SaveError::Prune`] the checkpoint was saved and `latest` names it; only the clean-up
    /// failed. On any other error, `latest` and every earlier checkpoint are as they were.
    pub fn save(&self, step: u64, files: &[(String, Vec<u8>)]) -> Result<PathBuf, SaveError> {
        let mut bodies: Vec<(String, FileBody<'_>)> =
            files.iter().map(|(name, bytes)| (name.clone(), FileBody::Bytes(bytes))).collect();
        self.save_files(step, &mut bodies)
    }

    /// [`save`](Self::save) of files that may be written as they are produced
    /// ([`FileBody::Stream`]): a checkpoint larger than memory needs one piece of it in memory
    /// at a time. Each file's sha256 is computed as it is written.
    pub fn save_files(&self, step: u64, files: &mut [(String, FileBody<'_>)]) -> Result<PathBuf, SaveError> {
        let mut seen = BTreeSet::new();
        for (name, _) in files.iter() {
            check_file_name(name).map_err(|reason| SaveError::BadFileName { name: name.clone(), reason })?;
            if !seen.insert(name.as_str()) {
                let reason = "the name is given twice; every file needs its own name".to_string();
                return Err(SaveError::BadFileName { name: name.clone(), reason });
            }
        }
        let tmp = self.root.join(format!("{TMP_PREFIX}step-{step:08}-{}", std::process::id()));
        let dir = self.root.join(step_dir_name(step));
        let result = self.write_and_publish(step, files, &tmp, &dir);
        if result.is_err() && !has_fired(self.faults.as_ref()) && tmp.exists() {
            // A real error, not a simulated kill: do not leave a half-written directory behind.
            let _ = fs::remove_dir_all(&tmp);
        }
        result?;
        self.prune(&dir)?;
        Ok(dir)
    }

    /// Steps 1–5 of a save: write into `tmp`, move it to `dir`, point `latest` at it.
    fn write_and_publish(
        &self,
        step: u64,
        files: &mut [(String, FileBody<'_>)],
        tmp: &Path,
        dir: &Path,
    ) -> Result<(), SaveError> {
        let faults = self.faults.as_ref();
        if fs::symlink_metadata(&self.root).is_err() {
            durable(faults, "create directory", &self.root, || fs::create_dir_all(&self.root))?;
            fsync_dir_with(&parent_dir(&self.root), faults)?;
        }
        // A link planted as the root (e.g. `checkpoints` in a directory another user can
        // write) is refused: saving through it would write, and prune, where it points.
        ava_fs::dirfd::Dir::open(&self.root)?;
        if fs::symlink_metadata(tmp).is_ok() {
            // Left by a crashed save of this step by a process that had our pid.
            fs::remove_dir_all(tmp).map_err(|source| io_error("remove stale directory", tmp, source))?;
        }
        durable(faults, "create directory", tmp, || fs::create_dir(tmp))?;
        let mut entries = BTreeMap::new();
        for (name, body) in files.iter_mut() {
            let path = tmp.join(&*name);
            let entry = match body {
                FileBody::Bytes(bytes) => {
                    write_synced(&path, bytes, faults)?;
                    FileEntry { sha256: sha256_hex(bytes), bytes: bytes.len() as u64 }
                }
                FileBody::Stream(write) => write_streamed(&path, write.as_mut(), faults)?,
            };
            entries.insert(name.clone(), entry);
        }
        // The manifest goes last: its presence is what makes a directory a complete checkpoint.
        let manifest = Manifest { format: MANIFEST_FORMAT, step, files: entries };
        write_synced(&tmp.join(MANIFEST_FILE), &manifest.to_json(), faults)?;
        fsync_dir_with(tmp, faults)?;

        if fs::symlink_metadata(dir).is_ok() {
            self.replace_dir(tmp, dir)?;
        } else {
            durable(faults, &format!("rename {} to", tmp.display()), dir, || fs::rename(tmp, dir))?;
        }
        fsync_dir_with(&self.root, faults)?;

        let name = step_dir_name(step);
        write_atomic_with(&self.root.join(LATEST_FILE), format!("{name}\n").as_bytes(), faults)
    }

    /// Puts the complete checkpoint `tmp` in place of the existing `dir` (re-saving a step,
    /// e.g. after resuming from it). The old content ends up in a `.tmp-` directory that the
    /// prune removes, after `latest` has moved.
    fn replace_dir(&self, tmp: &Path, dir: &Path) -> Result<(), SaveError> {
        let faults = self.faults.as_ref();
        // An atomic exchange: `dir` is never absent, even if `latest` names it and we crash.
        let action = format!("exchange {} with", tmp.display());
        let exchanged = durable(faults, &action, dir, || match exchange(tmp, dir) {
            Ok(()) => Ok(true),
            Err(e) if exchange_unsupported(&e) => Ok(false),
            Err(e) => Err(e),
        })?;
        if !exchanged {
            // No atomic exchange on this system or file system: move the old one aside first.
            // A crash between the two renames leaves no `dir`; resume from the `.tmp-old-` one.
            let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            let aside = self.root.join(format!("{TMP_PREFIX}old-{name}-{}", std::process::id()));
            if fs::symlink_metadata(&aside).is_ok() {
                fs::remove_dir_all(&aside).map_err(|source| io_error("remove stale directory", &aside, source))?;
            }
            durable(faults, &format!("rename {} to", dir.display()), &aside, || fs::rename(dir, &aside))?;
            durable(faults, &format!("rename {} to", tmp.display()), dir, || fs::rename(tmp, dir))?;
        }
        Ok(())
    }

    /// Step 6 of a save: remove complete checkpoints beyond `keep_last` (oldest first, never
    /// `saved`, which `latest` now names) and every `.tmp-` leftover.
    fn prune(&self, saved: &Path) -> Result<(), SaveError> {
        let failed = |path: &Path, source: SaveError| SaveError::Prune {
            saved: saved.to_path_buf(),
            path: path.to_path_buf(),
            source: Box::new(source),
        };
        let faults = self.faults.as_ref();
        let complete = self.list().map_err(|e| failed(&self.root, e))?;
        if self.keep_last > 0 && complete.len() > self.keep_last {
            let excess = complete.len() - self.keep_last;
            for (_, dir) in complete.iter().take(excess).filter(|(_, dir)| dir != saved) {
                // Renamed out of sight first, so a crash mid-delete never leaves a checkpoint
                // that looks complete but has lost files.
                let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                let trash = self.root.join(format!("{TMP_PREFIX}prune-{name}-{}", std::process::id()));
                durable(faults, &format!("rename {} to", dir.display()), &trash, || fs::rename(dir, &trash))
                    .map_err(|e| failed(dir, e))?;
            }
        }
        let entries = fs::read_dir(&self.root).map_err(|e| failed(&self.root, io_error("list", &self.root, e)))?;
        for entry in entries {
            let entry = entry.map_err(|e| failed(&self.root, io_error("list", &self.root, e)))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let leftover_latest = name.starts_with(&format!(".{LATEST_FILE}.tmp-"));
            if !name.starts_with(TMP_PREFIX) && !leftover_latest {
                continue;
            }
            let path = entry.path();
            let removed = match entry.file_type() {
                Ok(kind) if kind.is_dir() => fs::remove_dir_all(&path),
                _ => fs::remove_file(&path),
            };
            removed.map_err(|e| failed(&path, io_error("remove", &path, e)))?;
        }
        Ok(())
    }

    /// The directory the `latest` pointer names (which need not exist), or `None` when there
    /// is no pointer (nothing saved yet).
    pub fn latest(&self) -> Result<Option<PathBuf>, SaveError> {
        let path = self.root.join(LATEST_FILE);
        // Bounded: the pointer is one directory name.
        let text = match ava_fs::bounded::read_to_string(&path, 4096) {
            Ok(text) => text,
            Err(e) if e.is_missing() => return Ok(None),
            Err(ava_fs::bounded::ReadError::Io { source, .. }) => return Err(io_error("read", &path, source)),
            Err(e) => {
                let detail = format!(" ({}: {})", path.display(), super::manifest::unprefixed(&e));
                return Err(SaveError::NoCheckpoint { root: self.root.clone(), detail });
            }
        };
        let name = text.trim();
        if parse_step(name).is_none() {
            let detail = format!(" ({} holds '{name}', not a checkpoint directory name)", path.display());
            return Err(SaveError::NoCheckpoint { root: self.root.clone(), detail });
        }
        Ok(Some(self.root.join(name)))
    }

    /// The checkpoint directory `spec` stands for: `latest` (the pointer of this store), a
    /// checkpoint directory, or another store's root (its `latest`). The manifest is read and
    /// checked, the files are not (that is [`load`](Self::load)'s job).
    pub fn resolve(&self, spec: &str) -> Result<PathBuf, SaveError> {
        if spec == LATEST_FILE {
            return self.resolve_latest();
        }
        let path = PathBuf::from(spec);
        if !path.is_dir() {
            let reason = if path.exists() { "it is a file, not a directory" } else { "it does not exist" };
            return Err(SaveError::NotACheckpoint { path, reason: reason.into() });
        }
        if path.join(MANIFEST_FILE).exists() {
            Manifest::read(&path)?;
            return Ok(path);
        }
        if path.join(LATEST_FILE).is_file() {
            return Self::new(path, 0).resolve_latest();
        }
        let is_step_dir = path.file_name().and_then(|n| n.to_str()).and_then(parse_step).is_some();
        if is_step_dir {
            return Err(SaveError::ManifestMissing { dir: path });
        }
        Err(SaveError::NotACheckpoint { path, reason: "it has neither a manifest.json nor a latest file".into() })
    }

    fn resolve_latest(&self) -> Result<PathBuf, SaveError> {
        let no_checkpoint = |detail: String| SaveError::NoCheckpoint { root: self.root.clone(), detail };
        let Some(dir) = self.latest()? else {
            let detail = if self.root.is_dir() { "" } else { " (the directory does not exist)" };
            return Err(no_checkpoint(detail.into()));
        };
        if !dir.is_dir() {
            let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            return Err(no_checkpoint(format!(" ({LATEST_FILE} names {name}, which does not exist)")));
        }
        Manifest::read(&dir)?;
        Ok(dir)
    }

    /// Reads the checkpoint in `dir`, checking every file against the manifest first; a
    /// missing, truncated or corrupted file is an error naming it.
    pub fn load(dir: &Path) -> Result<LoadedCheckpoint, SaveError> {
        let manifest = Manifest::read(dir)?;
        let mut files = BTreeMap::new();
        for (name, entry) in &manifest.files {
            let path = dir.join(name);
            let mut file = super::manifest::open(&path)?;
            // The size on disk is checked against the manifest before the manifest's number
            // sizes anything: a damaged `bytes` is a clear error, not a huge allocation.
            let meta = file.metadata().map_err(|e| io_error("read", &path, e))?;
            super::manifest::check_size(&path, entry, meta.len())?;
            let data = if entry.bytes >= FileData::MAP_FROM {
                // SAFETY: checkpoint files are written once, under a temporary name, and never
                // modified after the rename that publishes them; the map is read-only. A file
                // truncated behind our back would fault, as reading it would fail.
                let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| io_error("map", &path, e))?;
                FileData::Mapped(map)
            } else {
                let mut bytes = Vec::with_capacity(usize::try_from(entry.bytes).unwrap_or(0));
                // At most one byte more than the manifest says, should the file grow meanwhile.
                (&mut file).take(entry.bytes + 1).read_to_end(&mut bytes).map_err(|e| io_error("read", &path, e))?;
                FileData::Read(bytes)
            };
            check_bytes(&path, entry, &data)?;
            files.insert(name.clone(), data);
        }
        Ok(LoadedCheckpoint { dir: dir.to_path_buf(), step: manifest.step, files })
    }

    /// The complete checkpoints (directories `step-N` with a valid manifest), by step, oldest
    /// first. Files are not verified.
    pub fn list(&self) -> Result<Vec<(u64, PathBuf)>, SaveError> {
        let entries = match fs::read_dir(&self.root) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(source) => return Err(io_error("list", &self.root, source)),
        };
        let mut found = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|e| io_error("list", &self.root, e))?;
            let Some(step) = entry.file_name().to_str().and_then(parse_step) else { continue };
            let path = entry.path();
            if path.is_dir() && Manifest::read(&path).is_ok() {
                found.push((step, path));
            }
        }
        found.sort();
        Ok(found)
    }
}

/// Writes a file's content into the writer it is given.
pub type WriteFile<'a> = Box<dyn FnMut(&mut dyn io::Write) -> Result<(), SaveError> + 'a>;

/// A file of a checkpoint: its bytes, or a function that writes them to the file as it
/// produces them (returning an error of its own, e.g. a tier that could not be read).
pub enum FileBody<'a> {
    /// The whole content.
    Bytes(&'a [u8]),
    /// Writes the content.
    Stream(WriteFile<'a>),
}

/// [`write_streamed_synced`] of `path`, hashing what passes on its way to the file. Returns
/// the file's manifest entry.
fn write_streamed(
    path: &Path,
    write: &mut (dyn FnMut(&mut dyn io::Write) -> Result<(), SaveError> + '_),
    faults: Option<&FaultInjector>,
) -> Result<FileEntry, SaveError> {
    /// Hashes and counts the bytes on their way to the file.
    struct Hashing<W> {
        inner: W,
        hash: sha2::Sha256,
        len: u64,
    }
    impl<W: io::Write> io::Write for Hashing<W> {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            let n = self.inner.write(buf)?;
            sha2::Digest::update(&mut self.hash, &buf[..n]);
            self.len += n as u64;
            Ok(n)
        }
        fn flush(&mut self) -> io::Result<()> {
            self.inner.flush()
        }
    }
    let (mut hash, mut len) = (sha2::Sha256::default(), 0);
    write_streamed_synced(
        path,
        |out| {
            let mut hashing = Hashing { inner: out, hash: sha2::Sha256::default(), len: 0 };
            write(&mut hashing)?;
            (hash, len) = (hashing.hash, hashing.len);
            Ok(())
        },
        faults,
    )?;
    Ok(FileEntry { sha256: hex::encode(sha2::Digest::finalize(hash)), bytes: len })
}

fn io_error(action: &str, path: &Path, source: io::Error) -> SaveError {
    SaveError::Io { action: action.to_string(), path: path.to_path_buf(), source }
}

#[cfg(test)]
thread_local! {
    /// Tests set this to take the no-exchange fallback of [`CheckpointStore::replace_dir`].
    pub(crate) static NO_EXCHANGE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Atomically swaps the directory entries `a` and `b` (Linux `renameat2(RENAME_EXCHANGE)`).
#[cfg(target_os = "linux")]
fn exchange(a: &Path, b: &Path) -> io::Result<()> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;

    #[cfg(test)]
    if NO_EXCHANGE.with(|c| c.get()) {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    let a = CString::new(a.as_os_str().as_bytes())?;
    let b = CString::new(b.as_os_str().as_bytes())?;
    // SAFETY: both arguments are NUL-terminated paths that live until the call returns; the
    // syscall reads nothing else.
    let result = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if result == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

/// No atomic exchange outside Linux.
#[cfg(not(target_os = "linux"))]
fn exchange(_a: &Path, _b: &Path) -> io::Result<()> {
    Err(io::Error::from(io::ErrorKind::Unsupported))
}

/// True when `exchange` failed because the kernel or file system lacks it.
fn exchange_unsupported(e: &io::Error) -> bool {
    #[cfg(target_os = "linux")]
    if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP)) {
        return true;
    }
    e.kind() == io::ErrorKind::Unsupported
}
