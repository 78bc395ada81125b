//! The SwiGLU gate as one op: `h = silu(g) ∘ u` for the gate and up projections' outputs.
//!
//! Backward, with `s = σ(g)`: `dg = dh ∘ u ∘ s ∘ (1 + g(1 − s))`, `du = dh ∘ g ∘ s`. candle's
//! form computes SiLU's derivative from half a dozen tracked intermediates and keeps about
//! ten (N, F) buffers alive at once; this one keeps g and u (the op's inputs) only, in their
//! own type.

use std::mem::MaybeUninit;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor, WithDType, bail};
use rayon::prelude::*;

use super::{Real, Stored, filled, same_dtype, values, with_stored, with_values};

// The device half: the GPU kernels' launches.
#[cfg(feature = "cuda")]
mod cuda;

/// Elements per task.
const CHUNK: usize = 16 * 1024;

/// `silu(g) ∘ u` for g and u of the same shape and type: read and written in that type,
/// computed in f32 (f64 for f64 input).
pub fn swiglu_gate(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    if g.dims() != u.dims() {
        bail!("swiglu: gate {:?} and up {:?} differ in shape", g.dims(), u.dims());
    }
    g.contiguous()?.apply_op2(&u.contiguous()?, SwiGlu)
}

struct SwiGlu;

#[inline(always)]
fn sigmoid<F: Real>(x: F) -> F {
    F::one() / (F::one() + (-x).fast_exp())
}

fn fwd<S: Stored<C = F>, F: Real>(g: &[S], u: &[S]) -> Vec<S> {
    let fill = |h: &mut [MaybeUninit<S>]| {
        h.par_chunks_mut(CHUNK).zip(g.par_chunks(CHUNK).zip(u.par_chunks(CHUNK))).for_each(|(hs, (gs, us))| {
            for ((o, &gv), &uv) in hs.iter_mut().zip(gs).zip(us) {
                let gv = gv.load();
                o.write(S::store(gv * sigmoid(gv) * uv.load()));
            }
        })
    };
    // SAFETY: the chunks cover the output and every element of each is written.
    unsafe { filled(g.len(), fill) } // (N, F)
}

fn bwd_values<S: Stored<C = F>, F: Real>(g: &[S], u: &[S], dh: &[S]) -> (Vec<S>, Vec<S>) {
    let one = F::one();
    let mut du = Vec::new();
    let fill_dg = |dg: &mut [MaybeUninit<S>]| {
        let fill_both = |du: &mut [MaybeUninit<S>]| {
            dg.par_chunks_mut(CHUNK)
                .zip(du.par_chunks_mut(CHUNK))
                .zip(g.par_chunks(CHUNK).zip(u.par_chunks(CHUNK)).zip(dh.par_chunks(CHUNK)))
                .for_each(|((dgs, dus), ((gs, us), dhs))| {
                    for ((((dgv, duv), &gv), &uv), &d) in dgs.iter_mut().zip(dus.iter_mut()).zip(gs).zip(us).zip(dhs) {
                        let (gv, uv, d) = (gv.load(), uv.load(), d.load());
                        let s = sigmoid(gv);
                        dgv.write(S::store(d * uv * s * (one + gv * (one - s))));
                        duv.write(S::store(d * gv * s));
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
        same_dtype(s1, s2, "swiglu")?;
        let out = with_stored!(s1.dtype(), "swiglu", |S| {
            S::to_cpu_storage_owned(fwd::<S, _>(values(s1, l1, "swiglu")?, values(s2, l2, "swiglu")?))
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
        same_dtype(s1, s2, "swiglu")?;
        Ok((cuda::swiglu_fwd(s1, l1, s2, l2)?, l1.shape().clone()))
    }

    fn bwd(&self, g: &Tensor, u: &Tensor, _h: &Tensor, dh: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let _span = crate::profile::scope("backward: swiglu");
        #[cfg(feature = "cuda")]
        if g.device().is_cuda() {
            let (dg, du) = cuda::swiglu_bwd(g, u, &dh.to_dtype(g.dtype())?)?;
            return Ok((Some(dg), Some(du)));
        }
        fn run<S: Stored>(g: &Tensor, u: &Tensor, dh: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
            let dh = dh.to_dtype(S::DTYPE)?;
            let (dg, du) = with_values::<S, _>(g, "swiglu", |gv| {
                with_values::<S, _>(u, "swiglu", |uv| {
                    with_values::<S, _>(&dh, "swiglu", |dv| Ok(bwd_values(gv, uv, dv)))
                })
            })?;
            Ok((Some(Tensor::from_vec(dg, g.dims(), g.device())?), Some(Tensor::from_vec(du, u.dims(), u.device())?)))
        }
        with_stored!(g.dtype(), "swiglu", |S| run::<S>(g, u, dh))
    }
}
