//! RMSNorm as one op: `y = x · r · w` with `r = 1 / sqrt(mean(x²) + ε)` per row.
//!
//! Backward recomputes `r` from `x` (one pass over a row) instead of keeping it:
//! `dx = r · (g∘w) − x · r³ · Σ(g∘w∘x) / d` and `dw = Σ_rows g∘x·r`, the latter summed per
//! fixed chunk of rows (in the compute type) and the chunks added in order. Half inputs are
//! widened element by element as they are read; outputs and gradients are rounded once.

use std::mem::MaybeUninit;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor, WithDType, bail};
use rayon::prelude::*;

use super::{ROWS_PER_TASK, Real, Stored, filled, same_dtype, values, with_stored, with_values};

// The device half: the GPU kernels' launches.
#[cfg(feature = "cuda")]
mod cuda;

/// RMSNorm over the last dimension of `x` with weight `w` (its size): read and written in
/// `x`'s type, computed in f32 (f64 for f64 input, for the gradient checks), as Hugging Face
/// Llama computes it. `w` must have `x`'s type.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let d = *x.dims().last().unwrap_or(&0);
    if w.dims() != [d] {
        bail!("rms_norm: weight of shape {:?} for rows of {d}", w.dims());
    }
    x.contiguous()?.apply_op2(&w.contiguous()?, RmsNorm { eps })
}

struct RmsNorm {
    eps: f64,
}

/// `1 / sqrt(mean(x²) + ε)` of one row, summed in 8 lanes so the loop vectorizes.
fn inv_rms<S: Stored<C = F>, F: Real>(row: &[S], eps: F) -> F {
    let zero = F::zero();
    let mut lanes = [zero; 8];
    let mut chunks = row.chunks_exact(8);
    for c in &mut chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            let v = v.load();
            *l += v * v;
        }
    }
    let mut ss = lanes.iter().fold(zero, |a, &b| a + b);
    for &v in chunks.remainder() {
        let v = v.load();
        ss += v * v;
    }
    let n = F::from_f64(row.len() as f64);
    F::one() / (ss / n + eps).sqrt()
}

impl RmsNorm {
    fn fwd<S: Stored<C = F>, F: Real>(&self, x: &[S], w: &[S]) -> Vec<S> {
        let d = w.len();
        let eps = F::from_f64(self.eps);
        let fill = |y: &mut [MaybeUninit<S>]| {
            y.par_chunks_mut(d * ROWS_PER_TASK).zip(x.par_chunks(d * ROWS_PER_TASK)).for_each(|(ys, xs)| {
                for (yr, xr) in ys.chunks_exact_mut(d).zip(xs.chunks_exact(d)) {
                    let r = inv_rms(xr, eps);
                    for ((o, &v), &wj) in yr.iter_mut().zip(xr).zip(w) {
                        o.write(S::store(v.load() * r * wj.load()));
                    }
                }
            })
        };
        // SAFETY: x has whole rows of d, so the row chunks cover y and write all of it.
        unsafe { filled(x.len(), fill) } // (N, d)
    }

    /// (dx, dw) for input `x`, weight `w` and incoming gradient `g`, all of one type.
    fn bwd_values<S: Stored<C = F>, F: Real>(&self, x: &[S], w: &[S], g: &[S]) -> (Vec<S>, Vec<S>) {
        let d = w.len();
        let eps = F::from_f64(self.eps);
        let zero = F::zero();
        let inv_d = F::one() / F::from_f64(d as f64);
        let mut partial: Vec<Vec<F>> = Vec::new();
        let fill = |dx: &mut [MaybeUninit<S>]| {
            partial = dx
                .par_chunks_mut(d * ROWS_PER_TASK)
                .zip(x.par_chunks(d * ROWS_PER_TASK).zip(g.par_chunks(d * ROWS_PER_TASK)))
                .map(|(dxs, (xs, gs))| {
                    let mut dw = vec![zero; d]; // (d,) this chunk's share, in the compute type
                    for ((dr, xr), gr) in dxs.chunks_exact_mut(d).zip(xs.chunks_exact(d)).zip(gs.chunks_exact(d)) {
                        let r = inv_rms(xr, eps);
                        let mut s = zero;
                        for ((&gj, &wj), &xj) in gr.iter().zip(w).zip(xr) {
                            s += gj.load() * wj.load() * xj.load();
                        }
                        let c = r * r * r * s * inv_d;
                        for ((((o, &gj), &wj), &xj), acc) in dr.iter_mut().zip(gr).zip(w).zip(xr).zip(dw.iter_mut()) {
                            let (gj, xj) = (gj.load(), xj.load());
                            o.write(S::store(r * gj * wj.load() - xj * c));
                            *acc += gj * xj * r;
                        }
                    }
                    dw
                })
                .collect();
        };
        // SAFETY: x has whole rows of d, so the row chunks cover dx and write all of it.
        let dx = unsafe { filled(x.len(), fill) }; // (N, d)
        // The chunks' shares added in chunk order, rounded once.
        let dw = (0..d).map(|j| S::store(partial.iter().fold(zero, |a, p| a + p[j]))).collect(); // (d,)
        (dx, dw)
    }
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "rms-norm"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        same_dtype(s1, s2, "rms-norm")?;
        let out = with_stored!(s1.dtype(), "rms-norm", |S| {
            S::to_cpu_storage_owned(self.fwd::<S, _>(values(s1, l1, "rms-norm")?, values(s2, l2, "rms-norm")?))
        });
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        same_dtype(s1, s2, "rms-norm")?;
        Ok((cuda::rms_norm_fwd(s1, l1, s2, l2, self.eps)?, l1.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _y: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let _span = crate::profile::scope("backward: rms_norm");
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            let (dx, dw) = cuda::rms_norm_bwd(x, w, &g.to_dtype(x.dtype())?, self.eps)?;
            return Ok((Some(dx), Some(dw)));
        }
        fn run<S: Stored>(
            op: &RmsNorm,
            x: &Tensor,
            w: &Tensor,
            g: &Tensor,
        ) -> Result<(Option<Tensor>, Option<Tensor>)> {
            let g = g.to_dtype(S::DTYPE)?;
            let (dx, dw) = with_values::<S, _>(x, "rms-norm", |xv| {
                with_values::<S, _>(w, "rms-norm", |wv| {
                    with_values::<S, _>(&g, "rms-norm", |gv| Ok(op.bwd_values(xv, wv, gv)))
                })
            })?;
            let dx = Tensor::from_vec(dx, x.dims(), x.device())?;
            let dw = Tensor::from_vec(dw, w.dims(), w.device())?;
            Ok((Some(dx), Some(dw)))
        }
        with_stored!(x.dtype(), "rms-norm", |S| run::<S>(self, x, w, g))
    }
}
