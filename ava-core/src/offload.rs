//! The [`OffloadTier`] trait: a store of byte records under string keys, placed somewhere
//! cheaper than the compute device (RAM, NVMe, a compressed buffer). The engine decides what
//! goes where and when; the tier stores, returns, prefetches and drops. Integrity is the
//! tier's job: a record that cannot be returned exactly as stored is an error, never data.

use abi_stable::{
    sabi_trait,
    std_types::{RBox, ROption, RResult, RSlice, RSliceMut, RStr},
};

use crate::{PluginError, ffi::guard};

/// A storage tier. Methods take `&self` so the engine can prefetch on an I/O thread while
/// compute reads from another; implementations synchronise internally.
pub trait OffloadTier: Send + Sync {
    /// Bytes the tier can hold; `u64::MAX` for "as much as the machine has".
    fn capacity(&self) -> u64;
    /// Bytes currently stored.
    fn used_bytes(&self) -> u64;
    /// Stores `bytes` under `key`, replacing any earlier record.
    fn put(&self, key: &str, bytes: &[u8]) -> Result<(), PluginError>;
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
}

/// The FFI-safe form of [`OffloadTier`].
#[sabi_trait]
pub trait FfiOffload: Send + Sync {
    /// See [`OffloadTier::capacity`].
    fn capacity(&self) -> u64;
    /// See [`OffloadTier::used_bytes`].
    fn used_bytes(&self) -> u64;
    /// See [`OffloadTier::put`].
    fn put(&self, key: RStr<'_>, bytes: RSlice<'_, u8>) -> RResult<(), PluginError>;
    /// See [`OffloadTier::get`].
    fn get(&self, key: RStr<'_>, into: RSliceMut<'_, u8>) -> RResult<(), PluginError>;
    /// See [`OffloadTier::len`].
    fn len(&self, key: RStr<'_>) -> RResult<ROption<u64>, PluginError>;
    /// See [`OffloadTier::prefetch`].
    fn prefetch(&self, key: RStr<'_>) -> RResult<(), PluginError>;
    /// See [`OffloadTier::evict`].
    fn evict(&self, key: RStr<'_>) -> RResult<(), PluginError>;
}

/// A boxed offload tier from a plugin library.
pub type OffloadBox = FfiOffload_TO<'static, RBox<()>>;

pub(crate) struct Guarded<T>(pub T);

impl<T: OffloadTier> FfiOffload for Guarded<T> {
    fn capacity(&self) -> u64 {
        // Infallible getters: a panic reads as "no capacity" / "nothing used".
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.0.capacity())).unwrap_or(0)
    }
    fn used_bytes(&self) -> u64 {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.0.used_bytes())).unwrap_or(0)
    }
    fn put(&self, key: RStr<'_>, bytes: RSlice<'_, u8>) -> RResult<(), PluginError> {
        guard("OffloadTier::put", || self.0.put(key.as_str(), &bytes))
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
    fn put(&self, key: &str, bytes: &[u8]) -> Result<(), PluginError> {
        self.0.put(key.into(), bytes.into()).into_result()
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
}
