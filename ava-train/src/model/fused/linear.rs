//! The linear layer `y = x Wᵀ` as one op whose products split their output rows over the
//! threads, each part a single-threaded `gemm` call.
//!
//! Why: candle's matmul hands the whole product to `gemm` with rayon parallelism, which on
//! this project's 2-core benchmark machine reached 1.35× its single-thread rate on the
//! model's shapes; splitting the rows into one part per thread reached 1.9× (`ava bench
//! train` reports the effect). Splitting by rows does not change any element's summation
//! order, so the result is the same for every thread count (tested).
//!
//! Backward: `dx = g W` (rows of x split) and `dW = gᵀ x` (rows of W split), both written
//! directly in the layout of their input, so no transposed views or strided additions
//! follow, as they do after candle's `x.matmul(&w.t())`.

use std::mem::MaybeUninit;

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor, WithDType, bail};
use half::f16;
use rayon::prelude::*;

use super::{values, with_values};

/// `x Wᵀ` for x (N, in) and w (out, in), computed with `threads` parts.
///
/// f32, f64 and f16 are multiplied natively; bf16 (which `gemm` lacks) in f32, the product
/// rounded back to bf16, as bf16 autocast does on hardware.
pub fn linear(x: &Tensor, w: &Tensor, threads: usize) -> Result<Tensor> {
    let (_, k) = x.dims2()?;
    let (_, k2) = w.dims2()?;
    if k != k2 {
        bail!("linear: input rows of {k} for a weight of shape {:?}", w.dims());
    }
    if x.dtype() != w.dtype() {
        bail!("linear: input is {:?} but the weight is {:?}", x.dtype(), w.dtype());
    }
    let op = Linear { threads: threads.max(1) };
    if x.dtype() == DType::BF16 {
        let xf = x.to_dtype(DType::F32)?.contiguous()?;
        let wf = w.to_dtype(DType::F32)?.contiguous()?;
        return xf.apply_op2(&wf, op)?.to_dtype(DType::BF16);
    }
    x.contiguous()?.apply_op2(&w.contiguous()?, op)
}

struct Linear {
    threads: usize,
}

/// Element types `gemm` multiplies.
trait Gemm: WithDType {}
impl Gemm for f32 {}
impl Gemm for f64 {}
impl Gemm for f16 {}

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
        let part_rows = out.len() / n;
        let a_part = &a.data[i * rows * a.row_stride..];
        debug_assert!(a_part.len() > (part_rows - 1) * a.row_stride + (k - 1) * a.col_stride);
        debug_assert!(b.data.len() > (k - 1) * b.row_stride + (n - 1) * b.col_stride);
        // SAFETY: `out` holds part_rows × n elements, all written (read_dst is false) with
        // row stride n; `a_part` and `b.data` cover every element the strides address
        // (checked above in debug builds, guaranteed by the shapes the callers pass).
        unsafe {
            gemm::gemm(
                part_rows,
                n,
                k,
                out.as_mut_ptr().cast::<T>(),
                1,
                n as isize,
                false,
                a_part.as_ptr(),
                a.col_stride as isize,
                a.row_stride as isize,
                b.data.as_ptr(),
                b.col_stride as isize,
                b.row_stride as isize,
                T::from_f64(0.0),
                T::from_f64(1.0),
                false,
                false,
                false,
                gemm::Parallelism::None,
            )
        }
    });
}

impl Linear {
    fn fwd<T: Gemm>(&self, x: &[T], w: &[T], n_rows: usize, k: usize) -> Vec<T> {
        let out_dim = w.len() / k;
        let a = Operand { data: x, row_stride: k, col_stride: 1 };
        let b = Operand { data: w, row_stride: 1, col_stride: k }; // Wᵀ: (in, out)
        matmul(n_rows, out_dim, k, a, b, self.threads) // (N, out)
    }

    /// (dx, dw) for x (N, in), w (out, in) and g (N, out).
    fn bwd_values<T: Gemm>(&self, x: &[T], w: &[T], g: &[T], n_rows: usize, k: usize) -> (Vec<T>, Vec<T>) {
        let out_dim = w.len() / k;
        let a = Operand { data: g, row_stride: out_dim, col_stride: 1 };
        let b = Operand { data: w, row_stride: k, col_stride: 1 };
        let dx = matmul(n_rows, k, out_dim, a, b, self.threads); // (N, in)
        let a = Operand { data: g, row_stride: 1, col_stride: out_dim }; // gᵀ: (out, N)
        let b = Operand { data: x, row_stride: k, col_stride: 1 };
        let dw = matmul(out_dim, k, n_rows, a, b, self.threads); // (out, in)
        (dx, dw)
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
            (CpuStorage::F16(_), CpuStorage::F16(_)) => {
                CpuStorage::F16(self.fwd(values(s1, l1, "linear")?, values(s2, l2, "linear")?, n_rows, k))
            }
            _ => bail!("linear: input and weight must both be f32, f64 or f16"),
        };
        Ok((y, Shape::from((n_rows, out_dim))))
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _y: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let _span = crate::profile::scope("backward: linear");
        fn run<T: Gemm>(op: &Linear, x: &Tensor, w: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
            let (n_rows, k) = x.dims2()?;
            let g = g.to_dtype(T::DTYPE)?;
            let (dx, dw) = with_values::<T, _>(x, "linear", |xv| {
                with_values::<T, _>(w, "linear", |wv| {
                    with_values::<T, _>(&g, "linear", |gv| Ok(op.bwd_values(xv, wv, gv, n_rows, k)))
                })
            })?;
            Ok((Some(Tensor::from_vec(dx, x.dims(), x.device())?), Some(Tensor::from_vec(dw, w.dims(), w.device())?)))
        }
        match x.dtype() {
            DType::F32 => run::<f32>(self, x, w, g),
            DType::F64 => run::<f64>(self, x, w, g),
            DType::F16 => run::<f16>(self, x, w, g),
            dt => bail!("linear: backward for {dt:?} is not supported"),
        }
    }
}
