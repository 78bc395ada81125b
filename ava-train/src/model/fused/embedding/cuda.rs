//! The token embedding's backward on the device (`cuda` feature): `embedding_bwd_*` of
//! `kernels/fused.cu`, launched with `launch`'s grid on candle's stream. The math is the
//! parent op's (its CPU half).

use candle_core::backend::BackendStorage;
use candle_core::cuda::WrapErr;
use candle_core::cuda::cudarc::driver::PushKernelArg;
use candle_core::{DType, Result, Tensor, bail};

use super::super::cuda::{MODULE, PTX, by_type, config, int, tensor, uninit, view, with_cuda};
use super::super::launch;

/// The table's gradient (V, d) in the type of `grad` (N, d): row t the f32 sum of the rows
/// of token t's positions, `order[offsets[t]..offsets[t + 1]]` (the host's counting sort,
/// copied to the device), rounded once.
pub(super) fn embedding_bwd(grad: &Tensor, offsets: &[u32], order: &[u32], (v, d): (usize, usize)) -> Result<Tensor> {
    with_cuda(grad, "embedding", |gs, lg| {
        let dev = gs.device();
        by_type!(gs.dtype(), "embedding", |T, s| {
            let gv = view::<T>(gs, lg, "embedding")?;
            let (ov, pv) = (dev.clone_htod(offsets)?, dev.clone_htod(order)?); // (V + 1,), (N,) u32
            let mut dw = uninit::<T>(dev, v * d)?; // (V, d)
            if v > 0 && d > 0 {
                let f = dev.get_or_load_custom_func(&format!("embedding_bwd_{s}"), MODULE, PTX)?;
                let di = int(d, "the embedding's width")?;
                let mut b = f.builder();
                b.arg(&gv).arg(&ov).arg(&pv).arg(&mut dw).arg(&di);
                // SAFETY: embedding_bwd's signature; order holds positions below N, offsets
                // V + 1 ascending bounds into it (the host's sort).
                unsafe { b.launch(config(launch::embedding_bwd(v, d)?)) }.w()?;
            }
            Ok(tensor(dw, dev, (v, d)))
        })
    })
}
