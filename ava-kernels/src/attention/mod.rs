//! Scaled dot-product attention on CPU f32 buffers in (B, H, T, D) order, under a [`Mask`].
//!
//! Two algorithms, each with forward and backward:
//!
//! - [`dense`]: materializes the probabilities (B·H·Tq·Tk floats saved for backward); the
//!   built-in `standard` kernel and the reference every other kernel is tested against.
//! - [`flash`]: FlashAttention-2 (Dao 2023): tiles of queries against tiles of keys with
//!   an online softmax, saving only one logsumexp per query row; backward recomputes the
//!   probabilities tile by tile. Tiles the mask hides are never computed, which is what
//!   makes the sliding-window and block-sparse kernels linear in T.
//!
//! With the `cuda` feature, `cuda`: flash on NVIDIA GPUs (kernels/flash.cu), the same
//! algorithm on device buffers in the run's compute type.
//!
//! Grouped-query attention: query head `h` reads key/value head `h / (H / Hkv)`; dK and dV
//! sum over the query heads of a group.

use ava_core::{AttnShape, PluginError, error::expect_len};

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dense;
pub mod flash;
mod kernel;
mod mask;
pub mod matmul;

pub use flash::Tiles;
pub use kernel::{Algorithm, Kernel, Masking};
pub use mask::{BlockPattern, Mask, Pattern, Tile};

/// The shape as `usize`s, checked once per call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dims {
    pub heads: usize,
    pub group: usize,
    pub tq: usize,
    pub tk: usize,
    pub d: usize,
    pub scale: f32,
}

impl Dims {
    fn new(shape: &AttnShape) -> Result<Self, PluginError> {
        shape.validate()?;
        Ok(Self {
            heads: shape.q_heads as usize,
            group: shape.group(),
            tq: shape.q_len as usize,
            tk: shape.kv_len as usize,
            d: shape.head_dim as usize,
            scale: shape.scale,
        })
    }

    /// Index of the key/value head block that query head block `bh = b·H + h` reads.
    fn kv_of(&self, bh: usize) -> usize {
        let (b, h) = (bh / self.heads, bh % self.heads);
        b * (self.heads / self.group) + h / self.group
    }

    /// The sequence `b` of query head block `bh = b·H + h`.
    fn batch_of_head(&self, bh: usize) -> usize {
        bh / self.heads
    }

    /// The sequence `b` of key/value head block `g = b·Hkv + kh`.
    fn batch_of_group(&self, g: usize) -> usize {
        g / (self.heads / self.group)
    }
}

/// Checks a mask (and its segments) against the shape it is used with.
fn check_mask(shape: &AttnShape, mask: &Mask<'_>) -> Result<(), PluginError> {
    shape.check_segments(mask.segments())?;
    if (mask.q_len(), mask.kv_len()) != (shape.q_len as usize, shape.kv_len as usize) {
        return Err(PluginError::internal(format!(
            "mask built for {}×{} used on q_len {} × kv_len {}",
            mask.q_len(),
            mask.kv_len(),
            shape.q_len,
            shape.kv_len
        )));
    }
    Ok(())
}

/// Checks every buffer of a forward call.
fn check_forward(
    shape: &AttnShape,
    mask: &Mask<'_>,
    (q, k, v, out): (&[f32], &[f32], &[f32], &[f32]),
    saved: usize,
    saved_want: u64,
) -> Result<Dims, PluginError> {
    shape.check_buffers(q.len(), k.len(), v.len(), out.len())?;
    check_mask(shape, mask)?;
    expect_len("saved", saved, saved_want as usize)?;
    Dims::new(shape)
}

/// Checks the gradient buffers of a backward call (after [`check_forward`] on the inputs).
fn check_grads(shape: &AttnShape, dout: usize, dq: usize, dk: usize, dv: usize) -> Result<(), PluginError> {
    expect_len("dout", dout, shape.q_numel())?;
    expect_len("dq", dq, shape.q_numel())?;
    expect_len("dk", dk, shape.kv_numel())?;
    expect_len("dv", dv, shape.kv_numel())
}

/// `a · b · c · …` as u64, refusing products that do not fit in an address space.
fn count(shape: &AttnShape, factors: &[u32], what: &str) -> Result<u64, PluginError> {
    factors
        .iter()
        .try_fold(1u64, |acc, &x| acc.checked_mul(u64::from(x)))
        .filter(|&n| usize::try_from(n).is_ok())
        .ok_or_else(|| PluginError::invalid_input(format!("attention {what} for {shape:?} do not fit in memory")))
}

#[cfg(all(test, feature = "cuda"))]
mod emulated;
#[cfg(test)]
mod tests;
