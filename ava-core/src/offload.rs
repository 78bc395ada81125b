//! The [`OffloadTier`] trait: a store of byte records under string keys, placed somewhere
//! cheaper than the compute device (RAM, NVMe, a compressed buffer). The engine decides what
//! goes where and when; the tier stores, returns, prefetches and drops. Integrity is the
//! tier's job: a record that cannot be returned as stored is an error, never data. A lossy
//! tier (one that compresses, see [`OffloadTier::exact`]) returns an approximation by design,
//! and the engine only gives it what may be approximated (activations, never optimizer state).
//!
//! A plugin's allocations are invisible to the host's memory accounting, so a tier reports
//! the host memory it holds itself ([`OffloadTier::resident_bytes`]).

use abi_stable::{
    sabi_trait,
    std_types::{RBox, ROption, RResult, RSlice, RSliceMut, RStr, RString},
};

use crate::{ErrorKind, PluginError, ffi::guard, optimizer::DType};

/// A storage tier. Methods take `&self` so the engine can prefetch on an I/O thread while
/// compute reads from another; implementations synchronise internally.
pub trait OffloadTier: Send + Sync {
    /// Bytes the tier can hold; `u64::MAX` for "as much as the machine has". A disk tier
    /// counts the free space of its filesystem plus what it already stores.
    fn capacity(&self) -> u64;
    /// Bytes currently stored.
    fn used_bytes(&self) -> u64;
    /// Host memory the tier holds now, in bytes: records kept in RAM, buffers of writes in
    /// flight and of prefetched reads. The engine adds it to its own accounting.
    fn resident_bytes(&self) -> u64;
    /// Stores `bytes` under `key`, replacing any earlier record. `dtype` is the element type
    /// of the bytes (a compressing tier needs it; others ignore it). A tier may write in the
    /// background: an error it meets there is returned by the next call that touches the
    /// key, and by [`flush`](Self::flush).
    fn put(&self, key: &str, bytes: &[u8], dtype: DType) -> Result<(), PluginError>;
    /// Copies the record under `key` into `into`, whose length must equal the record's.
    fn get(&self, key: &str, into: &mut [u8]) -> Result<(), PluginError>;
    /// Length of the record under `key`, or `None` if there is none.
    fn len(&self, key: &str) -> Result<Option<u64>, PluginError>;
    /// Hints that `key` will be read soon. The default does nothing.
    fn prefetch(&self, key: &str) -> Result<(), PluginError> {
        let _ = key;
        Ok(())
    }
    /// Drops the record under `key` (no error if there is none).
    fn evict(&self, key: &str) -> Result<(), PluginError>;
    /// Waits until every write so far is stored, and returns the first error any of them
    /// met. The default (a tier that writes synchronously) has nothing to wait for.
    fn flush(&self) -> Result<(), PluginError> {
        Ok(())
    }
    /// Whether `get` returns exactly the bytes `put` stored (`false` for a lossy tier).
    fn exact(&self) -> bool {
        true
    }
    /// Checks, before anything is stored, that records of these lengths fit (a disk tier:
    /// in the free space of its filesystem, with its per-record overhead). The default
    /// compares their total with [`capacity`](Self::capacity) less what is stored.
    fn preflight(&self, records: &[u64]) -> Result<(), PluginError> {
        let need: u64 = records.iter().sum();
        let free = self.capacity().saturating_sub(self.used_bytes());
        if need > free {
            return Err(PluginError::new(
                ErrorKind::OutOfMemory,
                format!("{} records need {need} bytes, the tier has room for {free}", records.len()),
            ));
        }
        Ok(())
    }
    /// One line on how the tier is set up (where, which I/O mode and why), for the run's log.
    fn describe(&self) -> String {
        String::new()
    }
}

/// The FFI-safe form of [`OffloadTier`].
#[sabi_trait]
pub trait FfiOffload: Send + Sync {
    /// See [`OffloadTier::capacity`].
    fn capacity(&self) -> u64;
    /// See [`OffloadTier::used_bytes`].
    fn used_bytes(&self) -> u64;
    /// See [`OffloadTier::resident_bytes`].
    fn resident_bytes(&self) -> u64;
    /// See [`OffloadTier::put`].
    fn put(&self, key: RStr<'_>, bytes: RSlice<'_, u8>, dtype: DType) -> RResult<(), PluginError>;
    /// See [`OffloadTier::get`].
    fn get(&self, key: RStr<'_>, into: RSliceMut<'_, u8>) -> RResult<(), PluginError>;
    /// See [`OffloadTier::len`].
    fn len(&self, key: RStr<'_>) -> RResult<ROption<u64>, PluginError>;
    /// See [`OffloadTier::prefetch`].
    fn prefetch(&self, key: RStr<'_>) -> RResult<(), PluginError>;
    /// See [`OffloadTier::evict`].
    fn evict(&self, key: RStr<'_>) -> RResult<(), PluginError>;
    /// See [`OffloadTier::flush`].
    fn flush(&self) -> RResult<(), PluginError>;
    /// See [`OffloadTier::exact`].
    fn exact(&self) -> bool;
    /// See [`OffloadTier::preflight`].
    fn preflight(&self, records: RSlice<'_, u64>) -> RResult<(), PluginError>;
    /// See [`OffloadTier::describe`].
    fn describe(&self) -> RString;
}

/// A boxed offload tier from a plugin library.
pub type OffloadBox = FfiOffload_TO<'static, RBox<()>>;

pub(crate) struct Guarded<T>(pub T);

impl<T: OffloadTier> FfiOffload for Guarded<T> {
    // Infallible getters: a panic reads as "no capacity" / "nothing used" / "lossy" / "".
    fn capacity(&self) -> u64 {
        quiet(|| self.0.capacity(), 0)
    }
    fn used_bytes(&self) -> u64 {
        quiet(|| self.0.used_bytes(), 0)
    }
    fn resident_bytes(&self) -> u64 {
        quiet(|| self.0.resident_bytes(), 0)
    }
    fn put(&self, key: RStr<'_>, bytes: RSlice<'_, u8>, dtype: DType) -> RResult<(), PluginError> {
        guard("OffloadTier::put", || self.0.put(key.as_str(), &bytes, dtype))
    }
    fn get(&self, key: RStr<'_>, mut into: RSliceMut<'_, u8>) -> RResult<(), PluginError> {
        guard("OffloadTier::get", || self.0.get(key.as_str(), into.as_mut_slice()))
    }
    fn len(&self, key: RStr<'_>) -> RResult<ROption<u64>, PluginError> {
        guard("OffloadTier::len", || self.0.len(key.as_str()).map(ROption::from))
    }
    fn prefetch(&self, key: RStr<'_>) -> RResult<(), PluginError> {
        guard("OffloadTier::prefetch", || self.0.prefetch(key.as_str()))
    }
    fn evict(&self, key: RStr<'_>) -> RResult<(), PluginError> {
        guard("OffloadTier::evict", || self.0.evict(key.as_str()))
    }
    fn flush(&self) -> RResult<(), PluginError> {
        guard("OffloadTier::flush", || self.0.flush())
    }
    fn exact(&self) -> bool {
        quiet(|| self.0.exact(), false)
    }
    fn preflight(&self, records: RSlice<'_, u64>) -> RResult<(), PluginError> {
        guard("OffloadTier::preflight", || self.0.preflight(&records))
    }
    fn describe(&self) -> RString {
        quiet(|| self.0.describe(), String::new()).into()
    }
}

fn quiet<R>(f: impl FnOnce() -> R, on_panic: R) -> R {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or(on_panic)
}

/// Host side: a plugin's tier behind the Rust trait.
pub struct ForeignOffload(pub OffloadBox);

impl OffloadTier for ForeignOffload {
    fn capacity(&self) -> u64 {
        self.0.capacity()
    }
    fn used_bytes(&self) -> u64 {
        self.0.used_bytes()
    }
    fn resident_bytes(&self) -> u64 {
        self.0.resident_bytes()
    }
    fn put(&self, key: &str, bytes: &[u8], dtype: DType) -> Result<(), PluginError> {
        self.0.put(key.into(), bytes.into(), dtype).into_result()
    }
    fn get(&self, key: &str, into: &mut [u8]) -> Result<(), PluginError> {
        self.0.get(key.into(), into.into()).into_result()
    }
    fn len(&self, key: &str) -> Result<Option<u64>, PluginError> {
        self.0.len(key.into()).into_result().map(ROption::into_option)
    }
    fn prefetch(&self, key: &str) -> Result<(), PluginError> {
        self.0.prefetch(key.into()).into_result()
    }
    fn evict(&self, key: &str) -> Result<(), PluginError> {
        self.0.evict(key.into()).into_result()
    }
    fn flush(&self) -> Result<(), PluginError> {
        self.0.flush().into_result()
    }
    fn exact(&self) -> bool {
        self.0.exact()
    }
    fn preflight(&self, records: &[u64]) -> Result<(), PluginError> {
        self.0.preflight(records.into()).into_result()
    }
    fn describe(&self) -> String {
        self.0.describe().into()
    }
}
