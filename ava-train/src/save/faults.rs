//! [`FaultInjector`]: a test hook that makes one durable operation of a save fail, to
//! simulate the process being killed at that point; and [`durable`], the one helper every
//! durable operation (file write, fsync, rename, directory creation) goes through, so that
//! the operations are counted in one place.

use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::SaveError;

/// Makes the n-th durable operation of the store fail with an injected I/O error.
///
/// Durable operations are: creating a directory, writing a file, each fsync (file or
/// directory), each rename (including the `latest` pointer's). A failure at operation `n`
/// stands for a kill right before it: the store then does no clean-up at all, exactly as a
/// dead process would not, and leaves the leftovers to the next save.
///
/// Clones share their counter, so a test keeps one clone and hands the other to
/// [`CheckpointStore::with_faults`](super::CheckpointStore::with_faults):
///
/// ```
/// use ava_train::save::{CheckpointStore, FaultInjector};
///
/// let root = tempfile::tempdir().unwrap();
/// let counter = FaultInjector::count_ops();
/// CheckpointStore::new(root.path(), 2).with_faults(counter.clone()).save(1, &[("a.bin".into(), vec![1])]).unwrap();
/// let ops = counter.ops();
/// for n in 1..=ops {
///     let dir = tempfile::tempdir().unwrap();
///     let fault = FaultInjector::fail_at(n);
///     let store = CheckpointStore::new(dir.path(), 2).with_faults(fault.clone());
///     assert!(store.save(1, &[("a.bin".into(), vec![1])]).is_err());
///     assert!(fault.fired().is_some());
/// }
/// ```
#[derive(Clone, Debug)]
pub struct FaultInjector {
    inner: Arc<State>,
}

#[derive(Debug)]
struct State {
    /// 1-based operation to fail; `None` only counts.
    fail_at: Option<u64>,
    ops: AtomicU64,
    fired: Mutex<Option<String>>,
}

impl FaultInjector {
    /// Fails the `n`-th durable operation (1 = the first) and lets every other one through.
    /// `fail_at(0)` never fires.
    pub fn fail_at(n: u64) -> Self {
        Self::with(Some(n))
    }

    /// Fails nothing; only counts the operations ([`ops`](Self::ops)), so a test can learn
    /// how many fault positions a save has.
    pub fn count_ops() -> Self {
        Self::with(None)
    }

    fn with(fail_at: Option<u64>) -> Self {
        Self { inner: Arc::new(State { fail_at, ops: AtomicU64::new(0), fired: Mutex::new(None) }) }
    }

    /// How many durable operations have been attempted so far (the failed one included).
    pub fn ops(&self) -> u64 {
        self.inner.ops.load(Ordering::SeqCst)
    }

    /// When the fault has fired: a description of the operation it failed, e.g.
    /// `op 7: fsync /tmp/x/.tmp-step-00000002-41/model.safetensors`.
    pub fn fired(&self) -> Option<String> {
        self.inner.fired.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Counts one operation; the injected error when it is the chosen one.
    fn check(&self, action: &str, path: &Path) -> io::Result<()> {
        let n = self.inner.ops.fetch_add(1, Ordering::SeqCst) + 1;
        if self.inner.fail_at == Some(n) {
            let what = format!("op {n}: {action} {}", path.display());
            *self.inner.fired.lock().unwrap_or_else(|e| e.into_inner()) = Some(what.clone());
            return Err(io::Error::other(format!("injected fault ({what})")));
        }
        Ok(())
    }
}

/// True when `faults` has fired: the save must then stop dead, without cleaning up, because
/// the fault stands for a kill.
pub(crate) fn has_fired(faults: Option<&FaultInjector>) -> bool {
    faults.is_some_and(|f| f.fired().is_some())
}

/// Runs one durable operation `f` on `path`, counted by (and possibly failed by) `faults`;
/// an error becomes [`SaveError::Io`] naming `action` and `path`.
pub(crate) fn durable<T>(
    faults: Option<&FaultInjector>,
    action: &str,
    path: &Path,
    f: impl FnOnce() -> io::Result<T>,
) -> Result<T, SaveError> {
    let io_error = |source| SaveError::Io { action: action.to_string(), path: path.to_path_buf(), source };
    if let Some(faults) = faults {
        faults.check(action, path).map_err(io_error)?;
    }
    f().map_err(io_error)
}
