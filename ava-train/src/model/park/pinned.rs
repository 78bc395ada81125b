//! The page-locked half of [`Parking`](super::Parking): a GPU run's parked block inputs in
//! page-locked host memory, on copy streams of their own ([`Park`], [`Session`], [`Parked`]).
//!
//! The build chooses the half here, and only here: `pinned/cuda.rs` with the `cuda` feature
//! (its module doc has the ordering rules), and without it `pinned/absent.rs`, whose types
//! have the same names and no values ([`Park::new`] refuses). So `park.rs` reads the same in
//! both builds, without a `cfg`.

#[cfg(not(feature = "cuda"))]
mod absent;
#[cfg(feature = "cuda")]
mod cuda;

#[cfg(not(feature = "cuda"))]
pub(crate) use absent::*;
#[cfg(feature = "cuda")]
pub(crate) use cuda::*;
