//! The model's ops written as single candle custom ops with their own backward: the token
//! embedding, the linear layer, RMSNorm, the head split with the rotary embedding (and its
//! inverse, the head merge), the SwiGLU gate, and for half types the residual addition and the cast of the
//! weights (`convert`); and the root backward continues from at a stretch's end (`seed`).
//!
//! Why: each is a chain of 5–10 candle primitives, and candle's backward gave every node of
//! a chain a zero-filled gradient plus an addition (the candle Ava carries now moves the
//! first gradient in: vendor/candle-core), computes gradients for untracked inputs
//! (the rotary tables) and keeps tracked gradient expressions alive. On the benchmark model
//! those passes were most of the step. Each op here reads its inputs once and writes its
//! output once, keeps nothing but its inputs, and returns detached gradients.
//!
//! Every op reads and writes the type its inputs are stored in (f32, bf16, f16, or f64 for
//! the finite-difference checks) and returns its gradients in that type; a half input is
//! widened to f32 element by element inside the kernel and the result rounded once, so no
//! f32 copy of a half activation exists outside an op's call ([`Stored`]). The linear op
//! multiplies f32 and f64 natively and bf16 and f16 through bounded f32 scratch. The
//! element-wise ops split their work into fixed chunks on candle's rayon pool and
//! add partial sums in a fixed order; the linear op splits rows, which leaves each element's
//! summation unchanged. Either way the results do not depend on the thread count. The
//! composed forms in `ops` stay as the reference the tests compare against.
//!
//! With the `cuda` feature each op also runs on an NVIDIA GPU: its `cuda_fwd` and the device
//! branch of its backward launch the kernels of `kernels/fused.cu`, the same math in the same
//! types. Each op's launches live beside it, in its own `cuda` child (`norm/cuda.rs`,
//! `swiglu/cuda.rs`, `rope/cuda.rs`, `embedding/cuda.rs`, `linear/cuda.rs`), on the shared
//! helpers of module `cuda` (the PTX module, launch configurations, typed views), which also
//! holds the device work that is no single op's: the cross-entropy of `model::ops`, rounding
//! and widening, Σ x², and the buffers handed to plugins. The linear layer's products go to
//! cuBLAS through candle's matmul (f32 accumulation for bf16/f16), and the cast and the
//! residual addition to candle's own kernels. The kernels also run without a GPU or the
//! feature, in tests: compiled for the CPU by the kernel emulator (ava-cuda-emu), launched
//! with the grids of module `launch` and compared with the CPU ops here (module `emulated`).

mod convert;
#[cfg(feature = "cuda")]
mod cuda;
mod embedding;
// The kernels' launch shapes: the device halves' launches, and the emulated tests' (which
// run without the feature).
#[cfg(any(feature = "cuda", test))]
mod launch;
mod linear;
mod norm;
mod rope;
mod seed;
mod stored;
mod swiglu;

#[cfg(test)]
mod emulated;
#[cfg(test)]
mod tests;

use std::mem::MaybeUninit;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Layout, Result, Storage, Tensor, WithDType, bail};

pub use convert::{add, cast};
pub(crate) use convert::{rounded, widened};
pub use embedding::embedding;
#[cfg(test)]
pub(crate) use embedding::positions_by_token;
pub use linear::{GemmIsa, gemm_isa, linear};
pub(crate) use linear::{WeightGrad, gemm_packs_output_grad, half_scratch_len, linear_backward};
pub use norm::rms_norm;
pub use rope::{RopeTables, merge_heads, split_heads};
pub use seed::seed;
pub(crate) use stored::{Stored, with_stored};
pub use swiglu::swiglu_gate;

#[cfg(feature = "cuda")]
pub use cuda::{round_compensated, round_stochastic, widen_compensated};

/// Σ x² of each tensor, read back in one transfer: on the GPU the engine's two-pass kernel
/// over all of them in two launches (no synchronization until the one read); on the CPU
/// [`sum_of_squares_cpu`], one tensor at a time. The sums are f32.
pub fn sums_of_squares(tensors: &[&Tensor]) -> Result<Vec<f32>> {
    #[cfg(feature = "cuda")]
    if tensors.first().is_some_and(|t| t.device().is_cuda()) {
        return cuda::sums_of_squares(tensors);
    }
    tensors.iter().map(|t| sum_of_squares_cpu(t)).collect()
}

/// Elements a task of [`sum_of_squares_cpu`] sums.
const SUMSQ_CHUNK: usize = 1 << 16;

/// Σ x² of a CPU tensor without a squared copy of it (the gradient norm read a whole
/// gradient-sized g² per tensor, which sat on top of every gradient at the step's end): fixed
/// chunks of [`SUMSQ_CHUNK`] elements on candle's rayon pool, each summed in f64 over eight
/// lanes (x² of an f32 is exact in f64), the lanes and then the chunks added in order, so the
/// sum does not depend on the thread count; rounded to f32 once.
pub(crate) fn sum_of_squares_cpu(t: &Tensor) -> Result<f32> {
    use rayon::prelude::*;
    fn chunk<T: WithDType>(c: &[T]) -> f64 {
        let mut lanes = [0f64; 8];
        let mut groups = c.chunks_exact(8);
        for g in &mut groups {
            for (lane, x) in lanes.iter_mut().zip(g) {
                let x = x.to_f64();
                *lane += x * x;
            }
        }
        let rest = groups.remainder().iter().fold(0f64, |s, x| s + x.to_f64() * x.to_f64());
        lanes.iter().fold(rest, |s, l| s + l)
    }
    fn sum<T: WithDType>(v: &[T]) -> f32 {
        let chunks: Vec<f64> = v.par_chunks(SUMSQ_CHUNK).map(chunk).collect();
        chunks.iter().sum::<f64>() as f32
    }
    let op = "sum of squares";
    match t.dtype() {
        candle_core::DType::F32 => with_values::<f32, _>(t, op, |v| Ok(sum(v))),
        candle_core::DType::F64 => with_values::<f64, _>(t, op, |v| Ok(sum(v))),
        candle_core::DType::BF16 => with_values::<half::bf16, _>(t, op, |v| Ok(sum(v))),
        candle_core::DType::F16 => with_values::<half::f16, _>(t, op, |v| Ok(sum(v))),
        other => bail!("{op}: {other:?} is not a float type"),
    }
}

/// Σ x² of tensors handed over one at a time and read back together. On a GPU each is summed
/// on the device as it comes, into its own slot of one buffer, so nothing waits until
/// [`read`](Self::read) (the step inside backward had a host synchronization per parameter
/// here); a CPU tensor is not taken (the optimizer step sums a CPU gradient as it reads it).
pub(crate) struct DeferredSums {
    /// Room for this many sums.
    capacity: usize,
    #[cfg(feature = "cuda")]
    device: Option<cuda::DeviceSums>,
    /// The caller's id of each sum queued, in order.
    #[cfg(feature = "cuda")]
    ids: Vec<usize>,
}

impl DeferredSums {
    /// Room for `capacity` sums (a step's parameters).
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            capacity,
            #[cfg(feature = "cuda")]
            device: None,
            #[cfg(feature = "cuda")]
            ids: Vec::new(),
        }
    }

    /// Queues Σ t² under `id` when `t` is on a GPU; returns whether it did (a CPU tensor is
    /// left to its caller).
    pub(crate) fn push(&mut self, id: usize, t: &Tensor) -> Result<bool> {
        #[cfg(feature = "cuda")]
        if let candle_core::Device::Cuda(dev) = t.device() {
            let sums = match &mut self.device {
                Some(sums) => sums,
                empty => empty.insert(cuda::DeviceSums::new(dev, self.capacity)?),
            };
            sums.push(t)?;
            self.ids.push(id);
            return Ok(true);
        }
        let _ = (id, t, self.capacity);
        Ok(false)
    }

    /// Each queued sum with its id, in the order they were queued (one read from the device).
    pub(crate) fn read(self) -> Result<Vec<(usize, f32)>> {
        #[cfg(feature = "cuda")]
        if let Some(sums) = self.device {
            return Ok(self.ids.into_iter().zip(sums.read()?).collect());
        }
        Ok(Vec::new())
    }
}

#[cfg(feature = "cuda")]
pub(crate) use cuda::{
    cross_entropy_bwd, cross_entropy_fwd, plugin_buf, plugin_stream, round_compensated_storage, round_nearest_storage,
    round_stochastic_storage, storage_buf, storage_tensor, widen_compensated_storage, widen_storage, zeros,
};

/// The element types the fused ops compute in.
pub(crate) trait Real: WithDType + num_traits::Float + std::ops::AddAssign + Send + Sync {
    /// `e^self`: the vectorizable `ava_core::math::exp` in f32, libm's in f64 (the
    /// gradient checks want every digit).
    fn fast_exp(self) -> Self;
}

impl Real for f32 {
    #[inline(always)]
    fn fast_exp(self) -> f32 {
        ava_core::math::exp(self)
    }
}

impl Real for f64 {
    #[inline(always)]
    fn fast_exp(self) -> f64 {
        self.exp()
    }
}

/// Rows per task: small enough to spread 2k-row batches over a few threads, large enough
/// that a task is worth scheduling. Fixed, so reductions add partial sums in one order.
pub(crate) const ROWS_PER_TASK: usize = 64;

/// The contiguous values of a CPU storage of element type `F`.
pub(crate) fn values<'a, F: WithDType>(storage: &'a CpuStorage, layout: &Layout, op: &str) -> Result<&'a [F]> {
    let Some((start, end)) = layout.contiguous_offsets() else { bail!("{op}: input is not contiguous") };
    Ok(&F::cpu_storage_as_slice(storage)?[start..end])
}

/// Runs `f` on a tensor's contiguous values of type `F` (the tensor is made contiguous
/// first if it is not; backward's incoming gradients usually are).
pub(crate) fn with_values<F: WithDType, R>(t: &Tensor, op: &str, f: impl FnOnce(&[F]) -> Result<R>) -> Result<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else { bail!("{op}: only the CPU is supported") };
    f(values::<F>(cpu, layout, op)?)
}

/// A vector of `len` elements written by `fill`, without zeroing them first (outputs are
/// large, and a memset per op was a measurable share of the step).
///
/// # Safety
/// `fill` must write every element of the slice it is given.
pub(crate) unsafe fn filled<T>(len: usize, fill: impl FnOnce(&mut [MaybeUninit<T>])) -> Vec<T> {
    let mut v = Vec::with_capacity(len);
    fill(&mut v.spare_capacity_mut()[..len]);
    // SAFETY: the caller's `fill` wrote all `len` elements.
    unsafe { v.set_len(len) };
    v
}

/// Fails unless the two inputs of a two-input op have the same type.
pub(crate) fn same_dtype<S: BackendStorage>(a: &S, b: &S, op: &str) -> Result<()> {
    if a.dtype() != b.dtype() {
        bail!("{op}: inputs of {:?} and {:?} (both must have one type)", a.dtype(), b.dtype());
    }
    Ok(())
}
