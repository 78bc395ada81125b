//! Two ops candle already has, done with the fast conversions of [`Stored`] for half types:
//! the cast between f32 and bf16/f16 (f32 master weights into the compute type, every step)
//! and the residual addition of two half tensors (and of two large f32 ones, in parallel);
//! and the parallel widening and rounding of whole buffers that the attention op uses around
//! its f32 kernel.
//!
//! Why: candle converts and adds half values one element at a time through `half`, whose
//! rounding branches on the data; on the benchmark model those two took longer per step than
//! the fused ops' own conversions. Values and gradients are what candle's `to_dtype` and
//! `+` give (round to nearest, ties to even; backward hands the output gradient to both
//! addends unchanged), and so is the memory: one fresh output, no gradient buffers of their
//! own, so the estimator's replay models them as candle's ops.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor, WithDType, bail};
use half::{bf16, f16};
use rayon::prelude::*;

use super::{Stored, same_dtype, values, with_stored};

/// Elements per task.
const CHUNK: usize = 16 * 1024;

/// `x` in `dtype`: between f32 and bf16/f16 through this op, any other pair (f64, for the
/// gradient checks) through candle's `to_dtype`. Differentiable: backward casts the gradient
/// back to `x`'s type.
pub fn cast(x: &Tensor, dtype: DType) -> Result<Tensor> {
    use DType::{BF16, F16, F32};
    match (x.dtype(), dtype) {
        (from, to) if from == to => Ok(x.clone()),
        // candle's own cast kernel, round to nearest even as here.
        _ if x.device().is_cuda() => x.to_dtype(dtype),
        (F32, BF16 | F16) | (BF16 | F16, F32) => x.contiguous()?.apply_op1(Cast { to: dtype }),
        _ => x.to_dtype(dtype),
    }
}

/// `a + b` for tensors of one shape and type (the residual stream). On the CPU, half types
/// always and f32 from four chunks of elements go through this op, in parallel chunks
/// (candle adds on one thread); f64 and smaller f32 tensors through candle's addition.
pub fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if a.dims() != b.dims() {
        bail!("add: shapes {:?} and {:?} differ", a.dims(), b.dims());
    }
    let parallel = !a.device().is_cuda()
        && match a.dtype() {
            DType::BF16 | DType::F16 => true,
            DType::F32 => a.elem_count() >= 4 * CHUNK,
            _ => false,
        };
    if parallel { a.contiguous()?.apply_op2(&b.contiguous()?, Add) } else { a + b }
}

struct Cast {
    to: DType,
}

/// Half values widened to f32, in parallel chunks.
pub(crate) fn widened<S: Stored<C = f32>>(src: &[S]) -> Vec<f32> {
    // SAFETY: the chunks cover the output and every element is written.
    unsafe {
        super::filled(src.len(), |dst| {
            dst.par_chunks_mut(CHUNK).zip(src.par_chunks(CHUNK)).for_each(|(d, s)| {
                for (o, &v) in d.iter_mut().zip(s) {
                    o.write(v.load());
                }
            })
        })
    }
}

/// f32 values rounded to a half type, in parallel chunks.
pub(crate) fn rounded<S: Stored<C = f32>>(src: &[f32]) -> Vec<S> {
    // SAFETY: the chunks cover the output and every element is written.
    unsafe {
        super::filled(src.len(), |dst| {
            dst.par_chunks_mut(CHUNK).zip(src.par_chunks(CHUNK)).for_each(|(d, s)| {
                for (o, &v) in d.iter_mut().zip(s) {
                    o.write(S::store(v));
                }
            })
        })
    }
}

impl CustomOp1 for Cast {
    fn name(&self) -> &'static str {
        "cast"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = match (s, self.to) {
            (CpuStorage::F32(_), DType::BF16) => CpuStorage::BF16(rounded::<bf16>(values(s, l, "cast")?)),
            (CpuStorage::F32(_), DType::F16) => CpuStorage::F16(rounded::<f16>(values(s, l, "cast")?)),
            (CpuStorage::BF16(_), DType::F32) => CpuStorage::F32(widened::<bf16>(values(s, l, "cast")?)),
            (CpuStorage::F16(_), DType::F32) => CpuStorage::F32(widened::<f16>(values(s, l, "cast")?)),
            (s, to) => bail!("cast: {:?} to {to:?} is not one of this op's casts", s.dtype()),
        };
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(cast(grad, arg.dtype())?))
    }
}

struct Add;

/// `a + b` element by element, added in the compute type and rounded once.
fn add_values<S: Stored>(a: &[S], b: &[S]) -> Vec<S> {
    // SAFETY: the chunks cover the output and every element is written.
    unsafe {
        super::filled(a.len(), |dst| {
            dst.par_chunks_mut(CHUNK).zip(a.par_chunks(CHUNK).zip(b.par_chunks(CHUNK))).for_each(|(d, (x, y))| {
                for ((o, &u), &v) in d.iter_mut().zip(x).zip(y) {
                    o.write(S::store(u.load() + v.load()));
                }
            })
        })
    }
}

impl CustomOp2 for Add {
    fn name(&self) -> &'static str {
        "add"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        same_dtype(s1, s2, "add")?;
        let out = with_stored!(s1.dtype(), "add", |S| {
            S::to_cpu_storage_owned(add_values::<S>(values(s1, l1, "add")?, values(s2, l2, "add")?))
        });
        Ok((out, l1.shape().clone()))
    }

    /// Both addends get the output's gradient itself (no copy), as from candle's addition.
    fn bwd(&self, _a: &Tensor, _b: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(grad.clone()), Some(grad.clone())))
    }
}
