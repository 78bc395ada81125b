//! The GPU half of the optimizer state's homes: a GPU run's `ram` share in page-locked host
//! memory streamed through the device ([`PinnedState`]), and a state buffer's bytes in device
//! memory ([`DeviceBytes`], with [`upload`] and [`download`]).
//!
//! The build chooses the half here, and only here: `page_locked/cuda.rs` with the `cuda`
//! feature, and without it `page_locked/absent.rs`, whose types have the same names and no
//! values (its ways in, [`usable`], [`PinnedState::new`] and [`upload`], refuse). So the state, its
//! buffers, its step session and its move to the device read the same in both builds,
//! without a `cfg`.

#[cfg(not(feature = "cuda"))]
mod absent;
#[cfg(feature = "cuda")]
mod cuda;

#[cfg(not(feature = "cuda"))]
pub use absent::*;
#[cfg(feature = "cuda")]
pub use cuda::*;
