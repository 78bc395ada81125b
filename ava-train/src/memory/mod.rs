//! Memory accounting: the counting global allocator ([`CountingAlloc`]) and the per-step
//! breakdown (parameters, gradients, optimizer state, data, activations) printed in the
//! dashboard line `[step 100] memory 1.85/2.00 GiB (92%) warning — params 0.21, ...`. On a
//! GPU run the same breakdown is of device memory ([`device`], `cuda` feature). Where a run's
//! waiting buffers live (optimizer state, parked block inputs) is a value of [`home::Home`].
//! What the allocator saw inside a step, allocation by allocation, is a [`timeline`].

mod alloc;
mod breakdown;
#[cfg(feature = "cuda")]
pub mod device;
pub mod home;
#[cfg(feature = "cuda")]
pub mod pinned;
pub mod timeline;

pub use alloc::{
    CountingAlloc, available_bytes, current, installed, limit, peak, reset_peak, resident_bytes, set_limit,
    stop_counting, take_crossed,
};
pub use breakdown::{Breakdown, DeviceMemory, RSS_NOTE, gib, mib, size};
