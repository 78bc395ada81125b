//! The SwiGLU gate as one op: `h = silu(g) ∘ u` for the gate and up projections' outputs.
//!
//! Backward, with `s = σ(g)`: `dg = dh ∘ u ∘ s ∘ (1 + g(1 − s))`, `du = dh ∘ g ∘ s`. candle's
//! form computes SiLU's derivative from half a dozen tracked intermediates and keeps about
//! ten (N, F) buffers alive at once; this one keeps g and u (the op's inputs) only.

use std::mem::MaybeUninit;

use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor, bail};
use rayon::prelude::*;

use super::{Real, compute_dtype, filled, values, with_values};

/// Elements per task.
const CHUNK: usize = 16 * 1024;

/// `silu(g) ∘ u` for g and u of the same shape, in f32 (f64 for f64 input), returned in g's
/// type.
pub fn swiglu_gate(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    if g.dims() != u.dims() {
        bail!("swiglu: gate {:?} and up {:?} differ in shape", g.dims(), u.dims());
    }
    let dtype = g.dtype();
    let cd = compute_dtype(dtype);
    let gc = g.to_dtype(cd)?.contiguous()?;
    let uc = u.to_dtype(cd)?.contiguous()?;
    gc.apply_op2(&uc, SwiGlu)?.to_dtype(dtype)
}

struct SwiGlu;

#[inline(always)]
fn sigmoid<F: Real>(x: F) -> F {
    F::one() / (F::one() + (-x).fast_exp())
}

fn fwd<F: Real>(g: &[F], u: &[F]) -> Vec<F> {
    let fill = |h: &mut [MaybeUninit<F>]| {
        h.par_chunks_mut(CHUNK).zip(g.par_chunks(CHUNK).zip(u.par_chunks(CHUNK))).for_each(|(hs, (gs, us))| {
            for ((o, &gv), &uv) in hs.iter_mut().zip(gs).zip(us) {
                o.write(gv * sigmoid(gv) * uv);
            }
        })
    };
    // SAFETY: the chunks cover the output and every element of each is written.
    unsafe { filled(g.len(), fill) } // (N, F)
}

fn bwd_values<F: Real>(g: &[F], u: &[F], dh: &[F]) -> (Vec<F>, Vec<F>) {
    let mut du = Vec::new();
    let fill_dg = |dg: &mut [MaybeUninit<F>]| {
        let fill_both = |du: &mut [MaybeUninit<F>]| {
            dg.par_chunks_mut(CHUNK)
                .zip(du.par_chunks_mut(CHUNK))
                .zip(g.par_chunks(CHUNK).zip(u.par_chunks(CHUNK)).zip(dh.par_chunks(CHUNK)))
                .for_each(|((dgs, dus), ((gs, us), dhs))| {
                    for ((((dgv, duv), &gv), &uv), &d) in dgs.iter_mut().zip(dus.iter_mut()).zip(gs).zip(us).zip(dhs) {
                        let s = sigmoid(gv);
                        dgv.write(d * uv * s * (F::one() + gv * (F::one() - s)));
                        duv.write(d * gv * s);
                    }
                })
        };
        // SAFETY: the chunks cover both outputs and every element of each is written.
        du = unsafe { filled(g.len(), fill_both) }; // (N, F)
    };
    // SAFETY: as above.
    let dg = unsafe { filled(g.len(), fill_dg) }; // (N, F)
    (dg, du)
}

impl CustomOp2 for SwiGlu {
    fn name(&self) -> &'static str {
        "swiglu"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = match (s1, s2) {
            (CpuStorage::F32(_), CpuStorage::F32(_)) => {
                CpuStorage::F32(fwd(values::<f32>(s1, l1, "swiglu")?, values::<f32>(s2, l2, "swiglu")?))
            }
            (CpuStorage::F64(_), CpuStorage::F64(_)) => {
                CpuStorage::F64(fwd(values::<f64>(s1, l1, "swiglu")?, values::<f64>(s2, l2, "swiglu")?))
            }
            _ => bail!("swiglu: gate and up must both be f32 or both f64"),
        };
        Ok((out, l1.shape().clone()))
    }

    fn bwd(&self, g: &Tensor, u: &Tensor, _h: &Tensor, dh: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let _span = crate::profile::scope("backward: swiglu");
        fn run<F: Real>(g: &Tensor, u: &Tensor, dh: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
            let dh = dh.to_dtype(F::DTYPE)?;
            let (dg, du) = with_values::<F, _>(g, "swiglu", |gv| {
                with_values::<F, _>(u, "swiglu", |uv| {
                    with_values::<F, _>(&dh, "swiglu", |dv| Ok(bwd_values(gv, uv, dv)))
                })
            })?;
            Ok((Some(Tensor::from_vec(dg, g.dims(), g.device())?), Some(Tensor::from_vec(du, u.dims(), u.device())?)))
        }
        match g.dtype() {
            candle_core::DType::F64 => run::<f64>(g, u, dh),
            _ => run::<f32>(g, u, dh),
        }
    }
}
