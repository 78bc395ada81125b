//! [`NvmeTier`]: records in files of the run's directory, written behind and read ahead by
//! a small pool of I/O threads.
//!
//! A `put` encodes the record (checksums included) on the caller's thread into an aligned
//! buffer, which waits in `pending` until a worker has written it; until then `get` and
//! `prefetch` of the key are served from it. A `prefetch` queues a read whose verified
//! result waits in `cache` for the `get`. Each put of a key gets a new sequence number,
//! written into the record and checked on read, so a write that never reached the disk is
//! caught instead of an older record being taken for it. An error of a background write is
//! returned by the next call on its key and by `flush`; nothing fails silently.

use std::{
    collections::{HashMap, HashSet, VecDeque},
    io,
    path::{Path, PathBuf},
    sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock},
    thread::JoinHandle,
};

use ava_core::{DType, ErrorKind, PluginError};

use crate::{
    disk::{self, AlignedBuf},
    namespace::RunDir,
    record::{self, Expect, RunId},
};

/// How records are read and written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DirectIo {
    /// `O_DIRECT` where the filesystem takes it, buffered (and logged) where it does not.
    Auto,
    /// `O_DIRECT` or an error.
    On,
    /// Through the page cache.
    Off,
}

/// The tier's settings.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The directory the run's directory is made in.
    pub path: PathBuf,
    /// Direct I/O mode.
    pub direct_io: DirectIo,
    /// I/O threads.
    pub io_threads: usize,
    /// Most bytes of writes waiting for the disk; a `put` past it waits.
    pub max_in_flight: u64,
    /// Most bytes the tier may store (`None`: the disk's free space).
    pub capacity: Option<u64>,
}

/// What the tier knows of a key's last put.
#[derive(Debug, Clone)]
struct Entry {
    seq: u64,
    len: u64,
    stored: u64,
    file: PathBuf,
}

enum Slot {
    /// A read queued or under way, with the bytes reserved for it in `resident`.
    Loading {
        seq: u64,
        reserved: u64,
    },
    Ready {
        seq: u64,
        buf: AlignedBuf,
        payload: std::ops::Range<usize>,
    },
    Failed {
        seq: u64,
        error: PluginError,
    },
}

enum Job {
    Write { key: String, seq: u64 },
    Read { key: String, seq: u64 },
}

#[derive(Default)]
struct State {
    index: HashMap<String, Entry>,
    pending: HashMap<String, (u64, Arc<AlignedBuf>)>,
    writing: HashSet<String>,
    cache: HashMap<String, Slot>,
    jobs: VecDeque<Job>,
    /// Errors of background writes, by key, until a call on the key returns them.
    errors: HashMap<String, PluginError>,
    /// The first background error since the last `flush`.
    first_error: Option<PluginError>,
    next_seq: u64,
    used: u64,
    in_flight: u64,
    resident: u64,
    shutdown: bool,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    run: RunId,
    direct: bool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Workers never panic while holding the lock with the state half-changed.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wait<'a>(&self, guard: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.changed.wait(guard).unwrap_or_else(|p| p.into_inner())
    }
}

/// The tier once started: its directory made and locked, its I/O mode settled, its threads
/// running.
struct Started {
    settings: Settings,
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    note: String,
    // Dropped after the workers are joined (field order): the records go with it.
    run: RunDir,
}

/// The `nvme` tier. Building it only checks its settings; the run's directory, the direct
/// I/O probe and the I/O threads start at its first use, so validating a config (which
/// builds every plugin it names) leaves nothing on the disk.
pub struct NvmeTier {
    settings: Settings,
    started: OnceLock<Result<Started, PluginError>>,
}

impl std::fmt::Debug for NvmeTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let dir = self.started.get().and_then(|s| s.as_ref().ok()).map(|s| s.run.dir.clone());
        f.debug_struct("NvmeTier").field("path", &self.settings.path).field("dir", &dir).finish()
    }
}

/// Why `path` cannot hold the tier's directory, found without touching the disk: it is a
/// file, or the nearest directory that exists is not writable.
pub fn check_path(path: &Path) -> Result<(), String> {
    use std::os::unix::ffi::OsStrExt;
    let existing = path.ancestors().find(|a| a.as_os_str().is_empty() || a.exists()).unwrap_or(path);
    let existing = if existing.as_os_str().is_empty() { Path::new(".") } else { existing };
    if !existing.is_dir() {
        return Err(format!("option 'path': {} is not a directory", existing.display()));
    }
    let c = std::ffi::CString::new(existing.as_os_str().as_bytes()).map_err(|e| format!("option 'path': {e}"))?;
    // SAFETY: a valid C string.
    if unsafe { libc::access(c.as_ptr(), libc::W_OK | libc::X_OK) } != 0 {
        return Err(format!(
            "option 'path': cannot write in {} ({}); choose a directory this user can write",
            existing.display(),
            io::Error::last_os_error()
        ));
    }
    Ok(())
}

impl NvmeTier {
    /// The tier with these settings, not started yet.
    pub fn new(settings: Settings) -> Self {
        Self { settings, started: OnceLock::new() }
    }

    /// The started tier (starting it on the first call).
    fn started(&self) -> Result<&Started, PluginError> {
        self.started.get_or_init(|| Started::start(self.settings.clone())).as_ref().map_err(Clone::clone)
    }

    /// The started tier, if it has started; nothing is stored before.
    fn if_started(&self) -> Option<&Started> {
        self.started.get().and_then(|s| s.as_ref().ok())
    }

    /// The run's directory (starting the tier).
    pub fn dir(&self) -> Result<&Path, PluginError> {
        Ok(&self.started()?.run.dir)
    }

    /// Whether records go through `O_DIRECT` (starting the tier).
    pub fn direct(&self) -> Result<bool, PluginError> {
        Ok(self.started()?.shared.direct)
    }

    /// The file that holds `key`'s record (starting the tier).
    pub fn file_of(&self, key: &str) -> Result<PathBuf, PluginError> {
        Ok(self.started()?.file_of(key))
    }
}

impl ava_core::OffloadTier for NvmeTier {
    fn capacity(&self) -> u64 {
        self.started().map_or(0, |s| s.capacity())
    }
    fn used_bytes(&self) -> u64 {
        self.if_started().map_or(0, |s| s.used_bytes())
    }
    fn resident_bytes(&self) -> u64 {
        self.if_started().map_or(0, |s| s.resident_bytes())
    }
    fn put(&self, key: &str, bytes: &[u8], dtype: DType) -> Result<(), PluginError> {
        self.started()?.put(key, bytes, dtype)
    }
    fn get(&self, key: &str, into: &mut [u8]) -> Result<(), PluginError> {
        match self.if_started() {
            Some(s) => s.get(key, into),
            None => Err(PluginError::invalid_input(format!("nvme tier: no record under key '{key}'"))),
        }
    }
    fn len(&self, key: &str) -> Result<Option<u64>, PluginError> {
        self.if_started().map_or(Ok(None), |s| s.len(key))
    }
    fn prefetch(&self, key: &str) -> Result<(), PluginError> {
        match self.if_started() {
            Some(s) => s.prefetch(key),
            None => Err(PluginError::invalid_input(format!("nvme tier: no record under key '{key}' to prefetch"))),
        }
    }
    fn evict(&self, key: &str) -> Result<(), PluginError> {
        self.if_started().map_or(Ok(()), |s| s.evict(key))
    }
    fn flush(&self) -> Result<(), PluginError> {
        self.if_started().map_or(Ok(()), |s| s.flush())
    }
    fn preflight(&self, records: &[u64]) -> Result<(), PluginError> {
        self.started()?.preflight(records)
    }
    fn describe(&self) -> String {
        match self.started() {
            Ok(s) => s.note.clone(),
            Err(e) => e.message.to_string(),
        }
    }
}

fn io_error(file: &Path, what: &str, e: &io::Error) -> PluginError {
    let text = match e.raw_os_error() {
        Some(libc::ENOSPC) => format!(
            "no space left on the device ({e}); free space there, point plugins.offload.path at a larger disk, \
             or keep more of the optimizer state in RAM (offload.tiers)"
        ),
        Some(libc::EDQUOT) => format!("disk quota exceeded ({e})"),
        _ => e.to_string(),
    };
    let kind = if matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) {
        ErrorKind::OutOfMemory
    } else {
        ErrorKind::Io
    };
    PluginError::new(kind, format!("nvme tier: {what} {}: {text}", file.display()))
}

fn record_error(file: &Path, e: record::RecordError) -> PluginError {
    PluginError::new(ErrorKind::Io, format!("nvme tier: {}: {e}", file.display()))
}

/// A key as a file name: the characters that are safe kept, the rest as `_`, and a hash of
/// the whole key so that two keys never share a file.
fn file_name(key: &str) -> String {
    let safe: String = key
        .chars()
        .take(80)
        .map(|c| if c.is_ascii_alphanumeric() || matches!(c, '.' | '-') { c } else { '_' })
        .collect();
    format!("{safe}.{:08x}.rec", crc32fast::hash(key.as_bytes()))
}

impl Started {
    /// Creates the run's directory under `settings.path`, settles the I/O mode and starts
    /// the I/O threads.
    fn start(settings: Settings) -> Result<Self, PluginError> {
        let run = RunDir::create(&settings.path).map_err(|e| {
            PluginError::new(
                ErrorKind::Io,
                format!(
                    "nvme tier: cannot make a run directory in {}: {e}; set plugins.offload.path to a writable directory",
                    settings.path.display()
                ),
            )
        })?;
        let (direct, mode) = match settings.direct_io {
            DirectIo::Off => (false, "buffered I/O (direct_io: off)".to_string()),
            DirectIo::On => match disk::probe_direct(&run.dir) {
                Ok(()) => (true, "direct I/O (O_DIRECT, 4096-byte aligned)".to_string()),
                Err(e) => {
                    return Err(PluginError::new(
                        ErrorKind::Unsupported,
                        format!(
                            "nvme tier: direct_io is on but {} refuses O_DIRECT ({e}); use direct_io: auto to fall back \
                             to buffered I/O, or a path on a filesystem that supports it",
                            settings.path.display()
                        ),
                    ));
                }
            },
            DirectIo::Auto => match disk::probe_direct(&run.dir) {
                Ok(()) => (true, "direct I/O (O_DIRECT, 4096-byte aligned)".to_string()),
                Err(e) => (
                    false,
                    format!("buffered I/O: the filesystem refuses O_DIRECT ({e}), so direct_io: auto fell back"),
                ),
            },
        };
        let mut note = format!(
            "nvme tier in {}: {mode}, {} I/O thread{}, at most {} MiB of writes in flight",
            run.dir.display(),
            settings.io_threads,
            if settings.io_threads == 1 { "" } else { "s" },
            settings.max_in_flight >> 20
        );
        if run.created_path {
            note.push_str(&format!("; created {} (it did not exist)", settings.path.display()));
        }
        for (path, owner) in &run.squatted {
            note.push_str(&format!(
                "; {} belongs to uid {owner}, another user, so this user's records went to the next name (it is \
                 left alone; whoever manages the disk may remove it)",
                path.display()
            ));
        }
        if run.removed_leftovers > 0 {
            note.push_str(&format!(
                "; removed {} directories left by runs that ended without cleaning up",
                run.removed_leftovers
            ));
        }
        let shared = Arc::new(Shared { state: Mutex::default(), changed: Condvar::new(), run: run.id, direct });
        let workers = (0..settings.io_threads)
            .map(|i| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new().name(format!("ava-nvme-io-{i}")).spawn(move || worker(&shared)).map_err(
                    |e| PluginError::new(ErrorKind::Internal, format!("nvme tier: cannot start an I/O thread: {e}")),
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { settings, shared, workers, note, run })
    }

    /// The file that holds `key`'s record.
    fn file_of(&self, key: &str) -> PathBuf {
        self.run.dir.join(file_name(key))
    }

    /// Stored bytes of a record of `len` bytes under `key`.
    fn stored(key: &str, len: usize) -> u64 {
        record::stored_len(key.len(), len) as u64
    }

    /// Reads and checks `key`'s record on this thread.
    fn read_now(&self, key: &str, entry: &Entry, into: &mut [u8]) -> Result<(), PluginError> {
        let (buf, range) = read_record(&self.shared, key, entry)?;
        into.copy_from_slice(&buf[range]);
        Ok(())
    }
}

fn read_record(shared: &Shared, key: &str, entry: &Entry) -> Result<(AlignedBuf, std::ops::Range<usize>), PluginError> {
    let buf =
        disk::read_file(&entry.file, shared.direct, entry.stored).map_err(|e| io_error(&entry.file, "reading", &e))?;
    let range = record::decode(&buf, Expect { run: &shared.run, key, seq: entry.seq, len: entry.len })
        .map_err(|e| record_error(&entry.file, e))?;
    Ok((buf, range))
}

fn worker(shared: &Shared) {
    let mut state = shared.lock();
    loop {
        let Some(job) = state.jobs.pop_front() else {
            if state.shutdown {
                return;
            }
            state = shared.wait(state);
            continue;
        };
        match job {
            Job::Write { key, seq } => {
                // Superseded by a later put, or evicted: nothing to write.
                let Some((s, buf)) = state.pending.get(&key).cloned() else { continue };
                if s != seq {
                    continue;
                }
                let Some(file) = state.index.get(&key).map(|e| e.file.clone()) else { continue };
                // An older record of the key still being written by another worker: wait, so
                // that two writes of one file never interleave.
                if state.writing.contains(&key) {
                    while state.writing.contains(&key) {
                        state = shared.wait(state);
                    }
                    if state.pending.get(&key).is_none_or(|(s, _)| *s != seq) {
                        continue;
                    }
                }
                state.writing.insert(key.clone());
                drop(state);
                let result = disk::write_file(&file, &buf, shared.direct);
                state = shared.lock();
                state.writing.remove(&key);
                if state.pending.get(&key).is_some_and(|(s, _)| *s == seq) {
                    state.pending.remove(&key);
                    state.in_flight -= buf.len() as u64;
                    state.resident -= buf.capacity() as u64;
                }
                match result {
                    Err(e) => {
                        let error = io_error(&file, "writing", &e);
                        state.first_error.get_or_insert_with(|| error.clone());
                        state.errors.insert(key.clone(), error);
                    }
                    Ok(()) if !state.index.contains_key(&key) => {
                        // Evicted while it was written: the file is garbage now.
                        let _ = std::fs::remove_file(&file);
                    }
                    Ok(()) => {}
                }
                shared.changed.notify_all();
            }
            Job::Read { key, seq } => {
                // A put or evict of the key drops its slot: then there is nothing to read.
                if !matches!(state.cache.get(&key), Some(Slot::Loading { seq: s, .. }) if *s == seq) {
                    continue;
                }
                let Some(entry) = state.index.get(&key).cloned() else {
                    drop_cached(&mut state, &key);
                    continue;
                };
                drop(state);
                let result = read_record(shared, &key, &entry);
                state = shared.lock();
                // Still wanted (not evicted or replaced while it was read): its result.
                let still = match state.cache.get(&key) {
                    Some(&Slot::Loading { seq: s, reserved }) if s == seq => Some(reserved),
                    _ => None,
                };
                if let Some(reserved) = still {
                    let slot = match result {
                        Ok((buf, payload)) => {
                            state.resident = state.resident - reserved + buf.capacity() as u64;
                            Slot::Ready { seq, buf, payload }
                        }
                        Err(error) => {
                            state.resident -= reserved;
                            Slot::Failed { seq, error }
                        }
                    };
                    state.cache.insert(key, slot);
                }
                // Otherwise its reservation went with the slot it had.
                shared.changed.notify_all();
            }
        }
    }
}

fn slot_bytes(slot: &Slot) -> u64 {
    match slot {
        Slot::Loading { reserved, .. } => *reserved,
        Slot::Ready { buf, .. } => buf.capacity() as u64,
        Slot::Failed { .. } => 0,
    }
}

/// Drops `key`'s cached read, returning its bytes to the count.
fn drop_cached(state: &mut State, key: &str) {
    if let Some(slot) = state.cache.remove(key) {
        state.resident -= slot_bytes(&slot);
    }
}

impl ava_core::OffloadTier for Started {
    fn capacity(&self) -> u64 {
        let used = self.shared.lock().used;
        let disk = disk::free_space(&self.run.dir).unwrap_or(0).saturating_add(used);
        self.settings.capacity.map_or(disk, |cap| cap.min(disk))
    }

    fn used_bytes(&self) -> u64 {
        self.shared.lock().used
    }

    fn resident_bytes(&self) -> u64 {
        self.shared.lock().resident
    }

    fn put(&self, key: &str, bytes: &[u8], dtype: DType) -> Result<(), PluginError> {
        if key.is_empty() || key.len() > 4096 {
            return Err(PluginError::invalid_input(format!("nvme tier: keys are 1 to 4096 bytes, got {}", key.len())));
        }
        let stored = Self::stored(key, bytes.len());
        let file = self.file_of(key);
        let mut state = self.shared.lock();
        if let Some(cap) = self.settings.capacity {
            let replaced = state.index.get(key).map_or(0, |e| e.stored);
            if state.used - replaced + stored > cap {
                return Err(PluginError::new(
                    ErrorKind::OutOfMemory,
                    format!(
                        "nvme tier: cannot store {} bytes under '{key}': {} of its capacity of {cap} bytes in use",
                        bytes.len(),
                        state.used
                    ),
                ));
            }
        }
        // Back-pressure: at most max_in_flight bytes wait for the disk (one record always may).
        while state.in_flight > 0 && state.in_flight + stored > self.settings.max_in_flight {
            state = self.shared.wait(state);
        }
        // One write of a file at a time.
        while state.writing.contains(key) {
            state = self.shared.wait(state);
        }
        state.next_seq += 1;
        let seq = state.next_seq;
        drop(state);
        // Encoding and checksums on the caller's thread, outside the lock.
        let mut buf = AlignedBuf::zeroed(stored as usize);
        record::encode(&mut buf, &self.shared.run, seq, key, dtype as u8, bytes);
        let buf = Arc::new(buf);
        let mut state = self.shared.lock();
        drop_cached(&mut state, key);
        if let Some((_, old)) = state.pending.remove(key) {
            state.in_flight -= old.len() as u64;
            state.resident -= old.capacity() as u64;
        }
        // A new record replaces the old one, and with it an error about the old one.
        state.errors.remove(key);
        let replaced = state
            .index
            .insert(key.to_string(), Entry { seq, len: bytes.len() as u64, stored, file })
            .map_or(0, |e| e.stored);
        state.used = state.used - replaced + stored;
        state.in_flight += buf.len() as u64;
        state.resident += buf.capacity() as u64;
        state.pending.insert(key.to_string(), (seq, buf));
        state.jobs.push_back(Job::Write { key: key.to_string(), seq });
        self.shared.changed.notify_all();
        Ok(())
    }

    fn get(&self, key: &str, into: &mut [u8]) -> Result<(), PluginError> {
        let mut state = self.shared.lock();
        if let Some(error) = state.errors.remove(key) {
            return Err(error);
        }
        let Some(entry) = state.index.get(key).cloned() else {
            return Err(PluginError::invalid_input(format!("nvme tier: no record under key '{key}'")));
        };
        if entry.len != into.len() as u64 {
            return Err(PluginError::invalid_input(format!(
                "nvme tier: record '{key}' has {} bytes, the buffer to read it into has {}",
                entry.len,
                into.len()
            )));
        }
        if let Some((_, buf)) = state.pending.get(key) {
            let off = record::payload_offset(key.len());
            into.copy_from_slice(&buf[off..off + into.len()]);
            return Ok(());
        }
        loop {
            match state.cache.get(key) {
                Some(Slot::Loading { seq, .. }) if *seq == entry.seq => state = self.shared.wait(state),
                Some(Slot::Ready { seq, .. } | Slot::Failed { seq, .. }) if *seq == entry.seq => {
                    let slot = state.cache.remove(key).expect("just matched");
                    state.resident -= slot_bytes(&slot);
                    drop(state);
                    return match slot {
                        Slot::Ready { buf, payload, .. } => {
                            into.copy_from_slice(&buf[payload]);
                            Ok(())
                        }
                        Slot::Failed { error, .. } => Err(error),
                        Slot::Loading { .. } => unreachable!("matched Ready or Failed"),
                    };
                }
                _ => break,
            }
        }
        drop(state);
        self.read_now(key, &entry, into)
    }

    fn len(&self, key: &str) -> Result<Option<u64>, PluginError> {
        Ok(self.shared.lock().index.get(key).map(|e| e.len))
    }

    fn prefetch(&self, key: &str) -> Result<(), PluginError> {
        let mut state = self.shared.lock();
        let Some(entry) = state.index.get(key) else {
            return Err(PluginError::invalid_input(format!("nvme tier: no record under key '{key}' to prefetch")));
        };
        let (seq, stored) = (entry.seq, entry.stored);
        // Still in memory, or already on its way: nothing to do. (An error waits for `get`.)
        if state.pending.contains_key(key) || state.errors.contains_key(key) || state.cache.contains_key(key) {
            return Ok(());
        }
        state.cache.insert(key.to_string(), Slot::Loading { seq, reserved: stored });
        state.resident += stored;
        state.jobs.push_back(Job::Read { key: key.to_string(), seq });
        self.shared.changed.notify_all();
        Ok(())
    }

    fn evict(&self, key: &str) -> Result<(), PluginError> {
        let mut state = self.shared.lock();
        drop_cached(&mut state, key);
        let Some(entry) = state.index.remove(key) else { return Ok(()) };
        state.used -= entry.stored;
        state.errors.remove(key);
        if let Some((_, old)) = state.pending.remove(key) {
            state.in_flight -= old.len() as u64;
            state.resident -= old.capacity() as u64;
        }
        let being_written = state.writing.contains(key);
        self.shared.changed.notify_all();
        drop(state);
        // A file being written is removed by its writer when it finishes.
        if !being_written {
            match std::fs::remove_file(&entry.file) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_error(&entry.file, "removing", &e)),
            }
        }
        Ok(())
    }

    fn flush(&self) -> Result<(), PluginError> {
        let mut state = self.shared.lock();
        while !state.pending.is_empty() || !state.writing.is_empty() {
            state = self.shared.wait(state);
        }
        match state.first_error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn preflight(&self, records: &[u64]) -> Result<(), PluginError> {
        // Keys are short; a page covers the header and key of any the engine makes.
        let need: u64 = records.iter().map(|&len| record::stored_len(64, len as usize) as u64).sum();
        let free =
            disk::free_space(&self.run.dir).map_err(|e| io_error(&self.run.dir, "checking the free space of", &e))?;
        let limit = self.settings.capacity.map(|cap| cap.saturating_sub(self.used_bytes()));
        if need > free || limit.is_some_and(|l| need > l) {
            let (room, what) = match limit {
                Some(l) if l < free => (l, "its capacity option leaves".to_string()),
                _ => (free, format!("{} has", self.settings.path.display())),
            };
            return Err(PluginError::new(
                ErrorKind::OutOfMemory,
                format!(
                    "nvme tier: the plan offloads {} records taking {} on disk, but {what} only {} free: free space there, \
                     point plugins.offload.path at a larger disk, or keep more of the optimizer state in RAM (offload.tiers)",
                    records.len(),
                    ava_core::options::format_size(need),
                    ava_core::options::format_size(room)
                ),
            ));
        }
        Ok(())
    }

    fn describe(&self) -> String {
        self.note.clone()
    }
}

impl Drop for Started {
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        self.shared.changed.notify_all();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}
