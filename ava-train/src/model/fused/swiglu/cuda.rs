//! The SwiGLU gate's device half (`cuda` feature): `swiglu_fwd_*` and `swiglu_bwd_*` of
//! `kernels/fused.cu`, launched with `launch`'s grids on candle's stream. The math is the
//! parent op's (its CPU half).

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::PushKernelArg;
use candle_core::cuda::{CudaStorage, WrapErr};
use candle_core::{DType, Layout, Result, Tensor, bail};

use super::super::cuda::{MODULE, PTX, by_type, config, tensor, uninit, view, with_cuda};
use super::super::launch;

/// `silu(g) ∘ u` element by element.
pub(super) fn swiglu_fwd(g: &CudaStorage, lg: &Layout, u: &CudaStorage, lu: &Layout) -> Result<CudaStorage> {
    let dev = g.device();
    let n = lg.shape().elem_count();
    by_type!(g.dtype(), "swiglu", |T, s| {
        let (gv, uv) = (view::<T>(g, lg, "swiglu")?, view::<T>(u, lu, "swiglu")?);
        let mut h = uninit::<T>(dev, n)?; // (N, F)
        if n > 0 {
            let f = dev.get_or_load_custom_func(&format!("swiglu_fwd_{s}"), MODULE, PTX)?;
            let mut b = f.builder();
            b.arg(&gv).arg(&uv).arg(&mut h).arg(&n);
            // SAFETY: swiglu_fwd's signature; all three hold n elements.
            unsafe { b.launch(config(launch::elementwise(n)?)) }.w()?;
        }
        Ok(CudaStorage::wrap_cuda_slice(h, dev.clone()))
    })
}

/// (dg, du) of the SwiGLU gate for the incoming gradient dh.
pub(super) fn swiglu_bwd(g: &Tensor, u: &Tensor, dh: &Tensor) -> Result<(Tensor, Tensor)> {
    let n = g.elem_count();
    with_cuda(g, "swiglu", |gs, lg| {
        with_cuda(u, "swiglu", |us, lu| {
            with_cuda(dh, "swiglu", |hs, lh| {
                let dev = gs.device();
                by_type!(gs.dtype(), "swiglu", |T, s| {
                    let (gv, uv, hv) =
                        (view::<T>(gs, lg, "swiglu")?, view::<T>(us, lu, "swiglu")?, view::<T>(hs, lh, "swiglu")?);
                    let mut dg = uninit::<T>(dev, n)?; // (N, F)
                    let mut du = uninit::<T>(dev, n)?; // (N, F)
                    if n > 0 {
                        let f = dev.get_or_load_custom_func(&format!("swiglu_bwd_{s}"), MODULE, PTX)?;
                        let mut b = f.builder();
                        b.arg(&gv).arg(&uv).arg(&hv).arg(&mut dg).arg(&mut du).arg(&n);
                        // SAFETY: swiglu_bwd's signature; all five hold n elements.
                        unsafe { b.launch(config(launch::elementwise(n)?)) }.w()?;
                    }
                    Ok((tensor(dg, dev, g.shape().clone()), tensor(du, dev, u.shape().clone())))
                })
            })
        })
    })
}
