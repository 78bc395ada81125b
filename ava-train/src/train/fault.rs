//! A test hook for the failure a disk tier meets in the middle of a step: an offload tier
//! that passes everything to the real one until it is armed, then lets a given number of
//! writes through and refuses every later one as a full disk would. The trainer arms it at
//! the start of the step named by [`TrainOptions::tier_fault_at_step`](super::TrainOptions),
//! so the failure lands after some parameters were already stepped.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use ava_core::{DType, OffloadTier, PluginError};

/// Not armed: every write goes through.
const DISARMED: i64 = i64::MAX;

/// The real tier, and how many more writes succeed once armed.
pub(crate) struct FailingTier {
    inner: Arc<dyn OffloadTier>,
    writes_left: AtomicI64,
}

impl FailingTier {
    pub(crate) fn new(inner: Arc<dyn OffloadTier>) -> Self {
        Self { inner, writes_left: AtomicI64::new(DISARMED) }
    }

    /// From now on, `writes` more puts succeed and every later one fails.
    pub(crate) fn arm(&self, writes: u64) {
        self.writes_left.store(writes.min(i64::MAX as u64 - 1) as i64, Ordering::SeqCst);
    }
}

impl OffloadTier for FailingTier {
    fn capacity(&self) -> u64 {
        self.inner.capacity()
    }
    fn used_bytes(&self) -> u64 {
        self.inner.used_bytes()
    }
    fn resident_bytes(&self) -> u64 {
        self.inner.resident_bytes()
    }
    fn put(&self, key: &str, bytes: &[u8], dtype: DType) -> Result<(), PluginError> {
        let left = self.writes_left.load(Ordering::SeqCst);
        if left != DISARMED && self.writes_left.fetch_sub(1, Ordering::SeqCst) <= 0 {
            return Err(PluginError::io(format!(
                "writing record '{key}' ({} bytes): No space left on device (os error 28; injected by the \
                 tier_fault_at_step test hook)",
                bytes.len()
            )));
        }
        self.inner.put(key, bytes, dtype)
    }
    fn get(&self, key: &str, into: &mut [u8]) -> Result<(), PluginError> {
        self.inner.get(key, into)
    }
    fn len(&self, key: &str) -> Result<Option<u64>, PluginError> {
        self.inner.len(key)
    }
    fn prefetch(&self, key: &str) -> Result<(), PluginError> {
        self.inner.prefetch(key)
    }
    fn evict(&self, key: &str) -> Result<(), PluginError> {
        self.inner.evict(key)
    }
    fn flush(&self) -> Result<(), PluginError> {
        self.inner.flush()
    }
    fn exact(&self) -> bool {
        self.inner.exact()
    }
    fn preflight(&self, records: &[u64]) -> Result<(), PluginError> {
        self.inner.preflight(records)
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
}
