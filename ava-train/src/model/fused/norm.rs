//! RMSNorm as one op: `y = x · r · w` with `r = 1 / sqrt(mean(x²) + ε)` per row.
//!
//! Backward recomputes `r` from `x` (one pass over a row) instead of keeping it:
//! `dx = r · (g∘w) − x · r³ · Σ(g∘w∘x) / d` and `dw = Σ_rows g∘x·r`, the latter summed per
//! fixed chunk of rows and the chunks added in order.

use std::mem::MaybeUninit;

use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor, bail};
use rayon::prelude::*;

use super::{ROWS_PER_TASK, Real, compute_dtype, filled, values, with_values};

/// RMSNorm over the last dimension of `x` with weight `w` (its size), computed in f32 (f64
/// for f64 input, for the gradient checks) and returned in `x`'s type, as Hugging Face Llama
/// computes it.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let cd = compute_dtype(dtype);
    let d = *x.dims().last().unwrap_or(&0);
    if w.dims() != [d] {
        bail!("rms_norm: weight of shape {:?} for rows of {d}", w.dims());
    }
    let xc = x.to_dtype(cd)?.contiguous()?;
    let wc = w.to_dtype(cd)?.contiguous()?;
    xc.apply_op2(&wc, RmsNorm { eps })?.to_dtype(dtype)
}

struct RmsNorm {
    eps: f64,
}

/// `1 / sqrt(mean(x²) + ε)` of one row, summed in 8 lanes so the loop vectorizes.
fn inv_rms<F: Real>(row: &[F], eps: F) -> F {
    let mut lanes = [F::zero(); 8];
    let mut chunks = row.chunks_exact(8);
    for c in &mut chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l += v * v;
        }
    }
    let mut ss = lanes.iter().fold(F::zero(), |a, &b| a + b);
    for &v in chunks.remainder() {
        ss += v * v;
    }
    let n = F::from_f64(row.len() as f64);
    F::one() / (ss / n + eps).sqrt()
}

impl RmsNorm {
    fn fwd<F: Real>(&self, x: &[F], w: &[F]) -> Vec<F> {
        let d = w.len();
        let eps = F::from_f64(self.eps);
        let fill = |y: &mut [MaybeUninit<F>]| {
            y.par_chunks_mut(d * ROWS_PER_TASK).zip(x.par_chunks(d * ROWS_PER_TASK)).for_each(|(ys, xs)| {
                for (yr, xr) in ys.chunks_exact_mut(d).zip(xs.chunks_exact(d)) {
                    let r = inv_rms(xr, eps);
                    for ((o, &v), &wj) in yr.iter_mut().zip(xr).zip(w) {
                        o.write(v * r * wj);
                    }
                }
            })
        };
        // SAFETY: x has whole rows of d, so the row chunks cover y and write all of it.
        unsafe { filled(x.len(), fill) } // (N, d)
    }

    /// (dx, dw) for input `x`, weight `w` and incoming gradient `g`.
    fn bwd_values<F: Real>(&self, x: &[F], w: &[F], g: &[F]) -> (Vec<F>, Vec<F>) {
        let d = w.len();
        let eps = F::from_f64(self.eps);
        let inv_d = F::one() / F::from_f64(d as f64);
        let mut partial: Vec<Vec<F>> = Vec::new();
        let fill = |dx: &mut [MaybeUninit<F>]| {
            partial = dx
                .par_chunks_mut(d * ROWS_PER_TASK)
                .zip(x.par_chunks(d * ROWS_PER_TASK).zip(g.par_chunks(d * ROWS_PER_TASK)))
                .map(|(dxs, (xs, gs))| {
                    let mut dw = vec![F::zero(); d]; // (d,) this chunk's share
                    for ((dr, xr), gr) in dxs.chunks_exact_mut(d).zip(xs.chunks_exact(d)).zip(gs.chunks_exact(d)) {
                        let r = inv_rms(xr, eps);
                        let mut s = F::zero();
                        for ((&gj, &wj), &xj) in gr.iter().zip(w).zip(xr) {
                            s += gj * wj * xj;
                        }
                        let c = r * r * r * s * inv_d;
                        for ((((o, &gj), &wj), &xj), acc) in dr.iter_mut().zip(gr).zip(w).zip(xr).zip(dw.iter_mut()) {
                            o.write(r * gj * wj - xj * c);
                            *acc += gj * xj * r;
                        }
                    }
                    dw
                })
                .collect();
        };
        // SAFETY: x has whole rows of d, so the row chunks cover dx and write all of it.
        let dx = unsafe { filled(x.len(), fill) }; // (N, d)
        let mut dw = vec![F::zero(); d];
        for p in &partial {
            for (a, &b) in dw.iter_mut().zip(p) {
                *a += b;
            }
        }
        (dx, dw)
    }
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "rms-norm"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let shape = l1.shape().clone();
        let out = match (s1, s2) {
            (CpuStorage::F32(_), CpuStorage::F32(_)) => {
                CpuStorage::F32(self.fwd(values::<f32>(s1, l1, "rms-norm")?, values::<f32>(s2, l2, "rms-norm")?))
            }
            (CpuStorage::F64(_), CpuStorage::F64(_)) => {
                CpuStorage::F64(self.fwd(values::<f64>(s1, l1, "rms-norm")?, values::<f64>(s2, l2, "rms-norm")?))
            }
            _ => bail!("rms-norm: x and w must both be f32 or both f64"),
        };
        Ok((out, shape))
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _y: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let _span = crate::profile::scope("backward: rms_norm");
        fn run<F: Real>(op: &RmsNorm, x: &Tensor, w: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
            let g = g.to_dtype(F::DTYPE)?;
            let (dx, dw) = with_values::<F, _>(x, "rms-norm", |xv| {
                with_values::<F, _>(w, "rms-norm", |wv| {
                    with_values::<F, _>(&g, "rms-norm", |gv| Ok(op.bwd_values(xv, wv, gv)))
                })
            })?;
            let dx = Tensor::from_vec(dx, x.dims(), x.device())?;
            let dw = Tensor::from_vec(dw, w.dims(), w.device())?;
            Ok((Some(dx), Some(dw)))
        }
        match x.dtype() {
            candle_core::DType::F64 => run::<f64>(self, x, w, g),
            _ => run::<f32>(self, x, w, g),
        }
    }
}
