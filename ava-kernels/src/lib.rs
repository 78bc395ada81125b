//! # ava-kernels: CPU kernels shared by Ava's built-ins and plugins
//!
//! A plain library (not a plugin): the built-in `standard` attention and the `flash`,
//! `sliding-window` and `block-sparse` plugin libraries link it, so each plugin crate is
//! its options plus a few lines of glue, and all of them compute with the same tested code.
//!
//! - [`attention`]: masks ([`attention::Mask`]), the dense kernel that saves the
//!   probabilities, and the tiled FlashAttention-2 kernel that saves one logsumexp per row.
//! - [`parallel`]: splitting work over the threads the host grants.
//! - [`rows`]: the elementwise row loops (softmax pieces), compiled for AVX2 when the CPU
//!   has it.
//! - `cuda` (feature `cuda`): loading PTX and launching kernels on the host's stream, the
//!   plumbing of every GPU plugin; `flash` runs on the GPU through it.
//! - [`testing`]: the checks every attention kernel's tests share (f64 reference, dense
//!   comparison, finite differences), the byte mutator the parsers' property tests share,
//!   and (feature `cuda`) the optimizers' GPU-against-CPU test harness.

pub mod attention;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod parallel;
pub mod rows;
pub mod testing;
