//! The linear layer `y = x Wᵀ` as one op whose products split their output rows over the
//! threads, each part a single-threaded `gemm` call.
//!
//! Why: candle's matmul hands the whole product to `gemm` with rayon parallelism, which on
//! this project's 2-core benchmark machine reached 1.35× its single-thread rate on the
//! model's shapes; splitting the rows into one part per thread reached 1.9× (`ava bench
//! train` reports the effect). Splitting by rows does not change any element's summation
//! order, so the result is the same for every thread count (tested), but for one case: a
//! part of a single row (the last part can be one) goes to `gemm`'s matrix-vector kernel,
//! which sums in another order.
//!
//! Backward: `dx = g W` (rows of x split) and `dW = gᵀ x` (rows of W split), both written
//! directly in the layout of their input, so no transposed views or strided additions
//! follow, as they do after candle's `x.matmul(&w.t())`.
//!
//! bf16 and f16 go through f32 scratch inside the op: `gemm` lacks bf16, and its f16 path
//! rounds its running sums to f16 between blocks of the inner dimension. The weight is widened
//! once per call, and the rows of x (of g in backward) a fixed step of rows at a time: the
//! threads split a step's rows, each widening its share, multiplying it by one f32 gemm call
//! and rounding the product once into the stored type (f32 accumulation, as half-precision
//! autocast does on hardware). `dW` sums the steps' products in f32 in step order and is
//! rounded once. The scratch lives for one call, so the graph holds only the half inputs and
//! output; its size is fixed by the shapes, and a row split leaves every element's sum as it
//! is, so neither the result nor the memory depends on the thread count.
//!
//! On a GPU the op is the same node with cuBLAS doing the products through candle's CUDA
//! storage (f32 accumulation for bf16/f16): forward `x Wᵀ` reads W through a transposed
//! layout (no copy), backward computes `dx = g W` and `dW = gᵀ x` directly in their inputs'
//! layouts on detached operands. Against `x.matmul(&w.t())` differentiated by candle, that
//! saves each weight's gradient a zero-filled transposed buffer, a strided addition into it
//! and its transposed view's own accumulation, and the backward's time shows under
//! "backward: linear" in a profile.
//!
//! The backward's math is also a function of its own, [`linear_backward`], for callers that
//! run the product over blocks of rows and want one weight gradient: each call returns its
//! rows' dx and adds its dW into a [`WeightGrad`], rounded once at the end. The op's own
//! backward is one such call (the LM head's chunked loss, `model::head_loss`, makes several).

use std::mem::MaybeUninit;

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor, WithDType, bail};
use half::{bf16, f16};
use rayon::prelude::*;

use super::{Stored, values, with_values};

// The device half of the weight gradient's sum over calls.
#[cfg(feature = "cuda")]
mod cuda;

/// `x Wᵀ` for x (N, in) and w (out, in), computed with `threads` parts, in their type.
///
/// f32 and f64 are multiplied natively; bf16 and f16 through f32 scratch inside the op, each
/// product rounded once into the stored type.
pub fn linear(x: &Tensor, w: &Tensor, threads: usize) -> Result<Tensor> {
    let (_, k) = x.dims2()?;
    let (_, k2) = w.dims2()?;
    if k != k2 {
        bail!("linear: input rows of {k} for a weight of shape {:?}", w.dims());
    }
    if x.dtype() != w.dtype() {
        bail!("linear: input is {:?} but the weight is {:?}", x.dtype(), w.dtype());
    }
    x.contiguous()?.apply_op2(&w.contiguous()?, Linear { threads: threads.max(1) })
}

/// Rows of x (of g in backward) the half-precision path widens and multiplies per step.
/// Fixed, so the scratch does not depend on the thread count (nor does the estimator's replay
/// of it); large enough that each thread's share packs the weight for many rows at once.
const STEP_ROWS: usize = 1024;

/// The `gemm` crate's kernels on this CPU (it picks them at run time).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmIsa {
    /// x86-64-v4: its AVX-512 kernels (16 f32 lanes, register tiles of 64 rows).
    Avx512,
    /// x86-64-v3: its AVX2 + FMA kernels (8 f32 lanes, register tiles of 24 rows).
    Avx2,
    /// Anything else: its portable kernels, or another architecture's.
    Other,
}

/// See [`GemmIsa`]: the CPU features gemm's dispatch asks for (pulp's x86-64-v3 and -v4).
pub fn gemm_isa() -> GemmIsa {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        let v3 = has!("avx2") && has!("fma") && has!("bmi1") && has!("bmi2") && has!("lzcnt");
        let v4 = v3 && has!("avx512f") && has!("avx512bw") && has!("avx512cd") && has!("avx512dq") && has!("avx512vl");
        if v4 {
            return GemmIsa::Avx512;
        }
        if v3 {
            return GemmIsa::Avx2;
        }
    }
    GemmIsa::Other
}

/// Whether `gemm` copies a thread's share of the output gradient g into a buffer of its own
/// while the op's backward computes dW = gᵀ x, for x of `in_dim` columns. gemm computes a
/// row-major product transposed, so g becomes its right operand with rows `out` apart, which
/// it packs when that product's own rows (`in_dim`) exceed twice its register tile's rows:
/// 64 with its AVX-512 f32 kernels, 24 with AVX2 (gemm-common 0.19's `do_pack_rhs`; seen
/// with a counting allocator: on AVX-512 a copy at 256 columns and none at 128 or 64, on
/// AVX2 one at 64). Elsewhere taken to pack (the estimator's replay then counts an upper
/// bound).
pub(crate) fn gemm_packs_output_grad(in_dim: usize) -> bool {
    match gemm_isa() {
        GemmIsa::Avx512 => in_dim > 2 * 64,
        GemmIsa::Avx2 => in_dim > 2 * 24,
        GemmIsa::Other => true,
    }
}

/// The f32s of scratch the half-precision path holds through one forward or backward call of
/// x (N, in) and w (out, in), besides the weight's f32 copy (out·in) and, in backward, dW's
/// f32 accumulator (out·in): one step of rows of input and of product. The estimator's
/// replay allocates the same.
pub(crate) fn half_scratch_len(n_rows: usize, k: usize, out_dim: usize) -> usize {
    STEP_ROWS.min(n_rows) * (k + out_dim)
}

struct Linear {
    threads: usize,
}

/// Element types the op hands to `gemm` as they are.
trait Gemm: WithDType {
    /// The host sum of dW of this type in a [`WeightGrad`].
    fn sum(dw: &mut WeightGrad) -> &mut Option<Vec<Self>>;
}
impl Gemm for f32 {
    fn sum(dw: &mut WeightGrad) -> &mut Option<Vec<f32>> {
        &mut dw.f32
    }
}
impl Gemm for f64 {
    fn sum(dw: &mut WeightGrad) -> &mut Option<Vec<f64>> {
        &mut dw.f64
    }
}

/// A row-major matrix operand: where it starts and its strides (elements) along rows and
/// columns.
#[derive(Clone, Copy)]
struct Operand<'a, T> {
    data: &'a [T],
    row_stride: usize,
    col_stride: usize,
}

/// `a (m, k) · b (k, n)`, row-major and contiguous, with the rows split into `parts`
/// single-threaded `gemm` calls run on the rayon pool.
fn matmul<T: Gemm>(m: usize, n: usize, k: usize, a: Operand<'_, T>, b: Operand<'_, T>, parts: usize) -> Vec<T> {
    if m == 0 || n == 0 || k == 0 {
        return vec![T::from_f64(0.0); m * n];
    }
    let rows = m.div_ceil(parts.min(m));
    // SAFETY: every row chunk is written whole by its gemm call (read_dst is false).
    unsafe { super::filled(m * n, |dst| matmul_into(dst, n, k, a, b, rows)) }
}

/// The gemm calls of [`matmul`], one per chunk of `rows` rows of `dst`.
fn matmul_into<T: Gemm>(
    dst: &mut [MaybeUninit<T>],
    n: usize,
    k: usize,
    a: Operand<'_, T>,
    b: Operand<'_, T>,
    rows: usize,
) {
    dst.par_chunks_mut(rows * n).enumerate().for_each(|(i, out)| {
        let a_part = Operand { data: &a.data[i * rows * a.row_stride..], ..a };
        // SAFETY: `out` holds whole rows of n; gemm writes all of them (no accumulation).
        unsafe { gemm_call(out.as_mut_ptr().cast::<T>(), out.len() / n, n, k, a_part, b, false) }
    });
}

/// `dst (m, n) += a (m, k) · b (k, n)`, the rows of dst split into `parts` single-threaded
/// `gemm` calls as [`matmul`] splits them (so each element's sum is the same for any split).
fn matmul_add<T: Gemm>(
    dst: &mut [T],
    m: usize,
    n: usize,
    k: usize,
    a: Operand<'_, T>,
    b: Operand<'_, T>,
    parts: usize,
) {
    if m == 0 || n == 0 || k == 0 {
        return;
    }
    let rows = m.div_ceil(parts.min(m));
    dst.par_chunks_mut(rows * n).enumerate().for_each(|(i, out)| {
        let a_part = Operand { data: &a.data[i * rows * a.row_stride..], ..a };
        // SAFETY: `out` is whole rows of n, initialized (the sum so far).
        unsafe { gemm_call(out.as_mut_ptr(), out.len() / n, n, k, a_part, b, true) }
    });
}

/// One single-threaded gemm call: `dst (m, n) = a (m, k) · b (k, n)`, or `dst += a · b` with
/// `accumulate`; dst is row-major with row stride n.
///
/// # Safety
/// `dst` must be valid for writes of m·n elements (and initialized if `accumulate`).
unsafe fn gemm_call<T: Gemm>(
    dst: *mut T,
    m: usize,
    n: usize,
    k: usize,
    a: Operand<'_, T>,
    b: Operand<'_, T>,
    accumulate: bool,
) {
    assert!(a.data.len() > (m - 1) * a.row_stride + (k - 1) * a.col_stride, "gemm: lhs too short");
    assert!(b.data.len() > (k - 1) * b.row_stride + (n - 1) * b.col_stride, "gemm: rhs too short");
    // SAFETY: the caller vouches for dst; `a.data` and `b.data` cover every element the
    // strides address (checked above).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            n as isize,
            accumulate,
            a.data.as_ptr(),
            a.col_stride as isize,
            a.row_stride as isize,
            b.data.as_ptr(),
            b.col_stride as isize,
            b.row_stride as isize,
            T::from_f64(if accumulate { 1.0 } else { 0.0 }),
            T::from_f64(1.0),
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// Widens half values into f32 (`dst` as long as `src`), in parallel chunks.
fn widen_into<S: Stored<C = f32>>(dst: &mut [f32], src: &[S]) {
    const CHUNK: usize = 1 << 14;
    dst.par_chunks_mut(CHUNK).zip(src.par_chunks(CHUNK)).for_each(|(d, s)| {
        for (o, &v) in d.iter_mut().zip(s) {
            *o = v.load();
        }
    });
}

/// `dst (N, m) = a (N, ka) · b (ka, m)` for half `a` and an f32 `b`, a step of rows at a
/// time, the step's rows split into `parts`: each part widened into its own scratch,
/// multiplied by one gemm call into scratch, and rounded into dst.
fn stepped<S: Stored<C = f32>>(
    dst: &mut [MaybeUninit<S>],
    a: &[S],
    ka: usize,
    m: usize,
    b: Operand<'_, f32>,
    parts: usize,
    scratch: &mut [f32],
) {
    let step_rows = STEP_ROWS.min(a.len() / ka);
    for (d_step, a_step) in dst.chunks_mut(step_rows * m).zip(a.chunks(step_rows * ka)) {
        let part_rows = (a_step.len() / ka).div_ceil(parts);
        let shares = d_step.par_chunks_mut(part_rows * m).zip(a_step.par_chunks(part_rows * ka));
        shares.zip(scratch.par_chunks_mut(part_rows * (ka + m))).for_each(|((d_part, a_part), s)| {
            let rows = d_part.len() / m;
            let (sa, sd) = s.split_at_mut(rows * ka); // (rows, ka) and (rows, m)
            for (o, &v) in sa.iter_mut().zip(a_part) {
                *o = v.load();
            }
            let a_op = Operand { data: sa, row_stride: ka, col_stride: 1 };
            // SAFETY: sd holds at least rows rows of m (part_rows · (ka + m) ≥ rows · ka + rows · m).
            unsafe { gemm_call(sd.as_mut_ptr(), rows, m, ka, a_op, b, false) };
            for (o, &v) in d_part.iter_mut().zip(&sd[..rows * m]) {
                o.write(S::store(v));
            }
        });
    }
}

impl Linear {
    fn fwd<T: Gemm>(&self, x: &[T], w: &[T], n_rows: usize, k: usize) -> Vec<T> {
        let out_dim = w.len() / k;
        let a = Operand { data: x, row_stride: k, col_stride: 1 };
        let b = Operand { data: w, row_stride: 1, col_stride: k }; // Wᵀ: (in, out)
        matmul(n_rows, out_dim, k, a, b, self.threads) // (N, out)
    }

    /// dx for x (N, in), w (out, in) and g (N, out); dW = gᵀ x is the sum's first value, or
    /// is added into it.
    fn bwd_values<T: Gemm>(
        &self,
        x: &[T],
        w: &[T],
        g: &[T],
        n_rows: usize,
        k: usize,
        dw: &mut Option<Vec<T>>,
    ) -> Vec<T> {
        let out_dim = w.len() / k.max(1);
        let a = Operand { data: g, row_stride: out_dim, col_stride: 1 };
        let b = Operand { data: w, row_stride: k, col_stride: 1 };
        let dx = matmul(n_rows, k, out_dim, a, b, self.threads); // (N, in)
        let a = Operand { data: g, row_stride: 1, col_stride: out_dim }; // gᵀ: (out, N)
        let b = Operand { data: x, row_stride: k, col_stride: 1 };
        match dw {
            None => *dw = Some(matmul(out_dim, k, n_rows, a, b, self.threads)), // (out, in)
            Some(sum) => matmul_add(sum, out_dim, k, n_rows, a, b, self.threads),
        }
        dx
    }

    /// `x Wᵀ` for half x and w through f32 scratch (see the module docs).
    fn fwd_half<S: Stored<C = f32>>(&self, x: &[S], w: &[S], n_rows: usize, k: usize) -> Vec<S> {
        let out_dim = w.len() / k.max(1);
        if n_rows == 0 || out_dim == 0 || k == 0 {
            return vec![S::store(0.0); n_rows * out_dim];
        }
        let mut wf = vec![0f32; w.len()]; // (out, in), freed on return
        widen_into(&mut wf, w);
        let mut scratch = vec![0f32; half_scratch_len(n_rows, k, out_dim)]; // (step rows, in + out)
        let b = Operand { data: &wf, row_stride: 1, col_stride: k }; // Wᵀ: (in, out)
        let parts = self.threads;
        // SAFETY: the steps' parts cover y in whole rows and every row is written.
        unsafe { super::filled(n_rows * out_dim, |y| stepped(y, x, k, out_dim, b, parts, &mut scratch)) } // (N, out)
    }

    /// dx for half x (N, in), w (out, in) and g (N, out) through f32 scratch; dW = gᵀ x is
    /// added into its f32 sum (zeros when there is none yet).
    fn bwd_half<S: Stored<C = f32>>(
        &self,
        x: &[S],
        w: &[S],
        g: &[S],
        n_rows: usize,
        k: usize,
        dw: &mut Option<Vec<f32>>,
    ) -> Vec<S> {
        let out_dim = w.len() / k.max(1);
        if n_rows == 0 || out_dim == 0 || k == 0 {
            dw.get_or_insert_with(|| vec![0f32; w.len()]);
            return vec![S::store(0.0); n_rows * k];
        }
        let mut scratch = vec![0f32; half_scratch_len(n_rows, k, out_dim)]; // (step rows, in + out)
        let mut wf = vec![0f32; w.len()]; // (out, in)
        widen_into(&mut wf, w);
        let b = Operand { data: &wf, row_stride: k, col_stride: 1 }; // W: (out, in)
        let parts = self.threads;
        // SAFETY: as in fwd_half.
        let dx = unsafe { super::filled(n_rows * k, |dx| stepped(dx, g, out_dim, k, b, parts, &mut scratch)) }; // (N, in)
        drop(wf);
        // dW = Σ over steps of g_stepᵀ x_step, accumulated in f32 in step order, the rows of
        // dW split over the threads (which leaves each element's sum unchanged). Into the sum
        // of earlier calls, if any: then from the first step on, as if this call's rows had
        // been more steps of theirs.
        let fresh = dw.is_none();
        let dw32 = dw.get_or_insert_with(|| vec![0f32; w.len()]); // (out, in)
        let step_rows = STEP_ROWS.min(n_rows);
        let (gs, xs) = scratch.split_at_mut(step_rows * out_dim); // (step rows, out) and (step rows, in)
        let dw_rows = out_dim.div_ceil(self.threads.min(out_dim));
        for (i, (g_step, x_step)) in g.chunks(step_rows * out_dim).zip(x.chunks(step_rows * k)).enumerate() {
            let rows = g_step.len() / out_dim;
            widen_into(&mut gs[..g_step.len()], g_step);
            widen_into(&mut xs[..x_step.len()], x_step);
            let (gs, xs) = (&gs[..g_step.len()], &xs[..x_step.len()]);
            dw32.par_chunks_mut(dw_rows * k).enumerate().for_each(|(p, part)| {
                let a = Operand { data: &gs[p * dw_rows..], row_stride: 1, col_stride: out_dim }; // gᵀ rows
                let b = Operand { data: xs, row_stride: k, col_stride: 1 };
                // SAFETY: `part` is whole rows of dW, initialized (zeros, then earlier steps).
                unsafe { gemm_call(part.as_mut_ptr(), part.len() / k, k, rows, a, b, i > 0 || !fresh) };
            });
        }
        dx
    }
}

impl CustomOp2 for Linear {
    fn name(&self) -> &'static str {
        "linear"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n_rows, k) = l1.shape().dims2()?;
        let (out_dim, _) = l2.shape().dims2()?;
        let y = match (s1, s2) {
            (CpuStorage::F32(_), CpuStorage::F32(_)) => {
                CpuStorage::F32(self.fwd(values(s1, l1, "linear")?, values(s2, l2, "linear")?, n_rows, k))
            }
            (CpuStorage::F64(_), CpuStorage::F64(_)) => {
                CpuStorage::F64(self.fwd(values(s1, l1, "linear")?, values(s2, l2, "linear")?, n_rows, k))
            }
            (CpuStorage::BF16(_), CpuStorage::BF16(_)) => {
                CpuStorage::BF16(self.fwd_half(values(s1, l1, "linear")?, values(s2, l2, "linear")?, n_rows, k))
            }
            (CpuStorage::F16(_), CpuStorage::F16(_)) => {
                CpuStorage::F16(self.fwd_half(values(s1, l1, "linear")?, values(s2, l2, "linear")?, n_rows, k))
            }
            _ => bail!("linear: input and weight must both be f32, f64, f16 or bf16"),
        };
        Ok((y, Shape::from((n_rows, out_dim))))
    }

    /// `x Wᵀ` by cuBLAS: x (N, in) times W (out, in) read through its transposed layout.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let (n_rows, k) = l1.shape().dims2()?;
        let (out_dim, _) = l2.shape().dims2()?;
        let y = s1.matmul(s2, (1, n_rows, out_dim, k), l1, &l2.transpose(0, 1)?)?; // (N, out)
        Ok((y, Shape::from((n_rows, out_dim))))
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _y: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let mut dw = WeightGrad::new(1);
        let dx = linear_backward(x, w, g, self.threads, &mut dw)?;
        Ok((Some(dx), Some(dw.finish(w)?)))
    }
}

/// The weight gradient of [`linear`] summed over the calls of [`linear_backward`] that add
/// to it, in call order, and rounded once into the weight's type by [`finish`](Self::finish).
///
/// On the CPU the sum is f32 (f64 for f64 weights), and each call adds its product into it
/// as the op's backward adds its steps of rows: for a half weight, calls on consecutive
/// blocks of rows whose sizes are multiples of the op's step (1024 rows) give the bits of one
/// call on all the rows; for an f32 weight the additions are grouped differently (each call
/// is its own gemm sum, added to the sum), so the result differs by rounding. On a GPU a
/// single call is the op's own backward (dW in the weight's type from cuBLAS); more calls add
/// each product into an f32 buffer through cuBLAS (f32 output, beta = 1), so nothing is
/// rounded per call and no per-call dW exists.
pub(crate) struct WeightGrad {
    /// The calls that will add to it.
    calls: usize,
    /// The host sum (f32, bf16 and f16 weights).
    f32: Option<Vec<f32>>,
    /// The host sum of f64 weights.
    f64: Option<Vec<f64>>,
    /// A single GPU call's dW, in the weight's type.
    single: Option<Tensor>,
    /// The GPU sum of several calls, f32.
    #[cfg(feature = "cuda")]
    device: Option<candle_core::cuda::cudarc::driver::CudaSlice<f32>>,
}

impl WeightGrad {
    /// An empty sum for `calls` calls of [`linear_backward`].
    pub(crate) fn new(calls: usize) -> Self {
        Self {
            calls,
            f32: None,
            f64: None,
            single: None,
            #[cfg(feature = "cuda")]
            device: None,
        }
    }

    /// The sum as a tensor of `w`'s shape, type and device: the f32 sum rounded once into a
    /// half type (to nearest, ties to even, as the op's backward rounds).
    pub(crate) fn finish(self, w: &Tensor) -> Result<Tensor> {
        let dims = w.dims();
        if let Some(dw) = self.single {
            return Ok(dw);
        }
        #[cfg(feature = "cuda")]
        if let Some(sum) = self.device {
            let dev = match w.device() {
                candle_core::Device::Cuda(d) => d.clone(),
                _ => bail!("linear: a GPU weight gradient for a weight that is not on the GPU"),
            };
            let sum = super::storage_tensor(candle_core::CudaStorage::wrap_cuda_slice(sum, dev), dims);
            return sum.to_dtype(w.dtype());
        }
        match (w.dtype(), self.f32, self.f64) {
            (DType::F32, Some(sum), _) => Tensor::from_vec(sum, dims, w.device()),
            (DType::F64, _, Some(sum)) => Tensor::from_vec(sum, dims, w.device()),
            (DType::BF16, Some(sum), _) => Tensor::from_vec(round::<bf16>(&sum), dims, w.device()),
            (DType::F16, Some(sum), _) => Tensor::from_vec(round::<f16>(&sum), dims, w.device()),
            (dt, ..) => bail!("linear: no weight gradient of {dt:?} was summed"),
        }
    }
}

/// f32 values rounded into a half type.
fn round<S: Stored<C = f32>>(sum: &[f32]) -> Vec<S> {
    sum.iter().map(|&v| S::store(v)).collect()
}

/// The backward of [`linear`] for the output gradient `g` (N, out) of x (N, in) and
/// w (out, in): returns dx = g W in x's type and adds dW = gᵀ x into `dw`, with the op's math
/// on either device (its module docs). The op's own backward is one call; the chunked LM head
/// makes one per block of rows.
pub(crate) fn linear_backward(
    x: &Tensor,
    w: &Tensor,
    g: &Tensor,
    threads: usize,
    dw: &mut WeightGrad,
) -> Result<Tensor> {
    let _span = crate::profile::scope("backward: linear");
    if x.device().is_cuda() {
        // Detached, so the products hold no graph of their own; both in the layout of
        // their input.
        let (x, w, g) = (x.detach(), w.detach(), g.to_dtype(x.dtype())?.detach());
        let dx = g.matmul(&w)?; // (N, out) · (out, in) → (N, in)
        if dw.calls <= 1 {
            if dw.single.is_some() {
                bail!("linear: a second call adds to a weight gradient made for one");
            }
            dw.single = Some(g.t()?.matmul(&x)?); // (out, N) · (N, in) → (out, in)
            return Ok(dx);
        }
        #[cfg(feature = "cuda")]
        {
            let sum = match dw.device.take() {
                Some(sum) => sum,
                None => cuda::zeros_f32(&x, w.elem_count())?,
            };
            dw.device = Some(cuda::add_weight_grad(sum, &x, &g)?);
            return Ok(dx);
        }
        #[cfg(not(feature = "cuda"))]
        bail!("linear: a GPU tensor in a build without the cuda feature");
    }
    fn run<T: WithDType>(
        x: &Tensor,
        w: &Tensor,
        g: &Tensor,
        bwd: impl FnOnce(&[T], &[T], &[T], usize, usize) -> Vec<T>,
    ) -> Result<Tensor> {
        let (n_rows, k) = x.dims2()?;
        let g = g.to_dtype(T::DTYPE)?;
        let dx = with_values::<T, _>(x, "linear", |xv| {
            with_values::<T, _>(w, "linear", |wv| {
                with_values::<T, _>(&g, "linear", |gv| Ok(bwd(xv, wv, gv, n_rows, k)))
            })
        })?;
        Tensor::from_vec(dx, x.dims(), x.device())
    }
    let op = Linear { threads: threads.max(1) };
    match x.dtype() {
        DType::F32 => run::<f32>(x, w, g, |x, w, g, n, k| op.bwd_values(x, w, g, n, k, f32::sum(dw))),
        DType::F64 => run::<f64>(x, w, g, |x, w, g, n, k| op.bwd_values(x, w, g, n, k, f64::sum(dw))),
        DType::BF16 => run::<bf16>(x, w, g, |x, w, g, n, k| op.bwd_half(x, w, g, n, k, &mut dw.f32)),
        DType::F16 => run::<f16>(x, w, g, |x, w, g, n, k| op.bwd_half(x, w, g, n, k, &mut dw.f32)),
        dt => bail!("linear: backward for {dt:?} is not supported"),
    }
}
