//! RMSNorm's device half (`cuda` feature): `rms_norm_fwd_*` and `rms_norm_bwd_*` of
//! `kernels/fused.cu`, launched with `launch`'s grids on candle's stream. The math is the
//! parent op's (its CPU half).

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::PushKernelArg;
use candle_core::cuda::{CudaStorage, WrapErr};
use candle_core::{DType, Layout, Result, Tensor, bail};

use super::super::cuda::{MODULE, PTX, by_type, config, int, tensor, uninit, view, with_cuda};
use super::super::launch::{self, NORM_BWD_ROWS};

/// `y = x · r · w` row by row: x (N, d), w (d,).
pub(super) fn rms_norm_fwd(
    x: &CudaStorage,
    lx: &Layout,
    w: &CudaStorage,
    lw: &Layout,
    eps: f64,
) -> Result<CudaStorage> {
    let dev = x.device();
    let d = lw.shape().elem_count();
    let n = lx.shape().elem_count();
    let rows = n / d.max(1);
    by_type!(x.dtype(), "rms-norm", |T, s| {
        let (xv, wv) = (view::<T>(x, lx, "rms-norm")?, view::<T>(w, lw, "rms-norm")?);
        let mut y = uninit::<T>(dev, n)?; // (N, d)
        if rows > 0 {
            let f = dev.get_or_load_custom_func(&format!("rms_norm_fwd_{s}"), MODULE, PTX)?;
            let (di, eps) = (int(d, "a row")?, eps as f32);
            let mut b = f.builder();
            b.arg(&xv).arg(&wv).arg(&mut y).arg(&di).arg(&eps);
            // SAFETY: the arguments match rms_norm_fwd's signature; x and y hold rows·d.
            unsafe { b.launch(config(launch::rms_norm_fwd(rows)?)) }.w()?;
        }
        Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
    })
}

/// (dx, dw) of RMSNorm for x (N, d), w (d,) and the incoming gradient g (N, d).
pub(super) fn rms_norm_bwd(x: &Tensor, w: &Tensor, g: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let d = w.elem_count();
    let rows = x.elem_count() / d.max(1);
    let blocks = launch::norm_bwd_blocks(rows);
    with_cuda(x, "rms-norm", |xs, lx| {
        with_cuda(w, "rms-norm", |ws, lw| {
            with_cuda(g, "rms-norm", |gs, lg| {
                let dev = xs.device();
                by_type!(xs.dtype(), "rms-norm", |T, s| {
                    let (xv, wv, gv) = (
                        view::<T>(xs, lx, "rms-norm")?,
                        view::<T>(ws, lw, "rms-norm")?,
                        view::<T>(gs, lg, "rms-norm")?,
                    );
                    let mut dx = uninit::<T>(dev, rows * d)?; // (N, d)
                    let mut partial = uninit::<f32>(dev, blocks * d)?; // (blocks, d) f32, none without rows
                    let mut dw = uninit::<T>(dev, d)?; // (d,)
                    let (ri, di, eps, per) = (int(rows, "rows")?, int(d, "a row")?, eps as f32, NORM_BWD_ROWS as i32);
                    if rows > 0 {
                        let f = dev.get_or_load_custom_func(&format!("rms_norm_bwd_{s}"), MODULE, PTX)?;
                        let mut b = f.builder();
                        b.arg(&xv)
                            .arg(&wv)
                            .arg(&gv)
                            .arg(&mut dx)
                            .arg(&mut partial)
                            .arg(&ri)
                            .arg(&di)
                            .arg(&eps)
                            .arg(&per);
                        // SAFETY: rms_norm_bwd's signature; partial holds blocks·d f32; the block
                        // is wide enough that each thread holds at most NORM_BWD_COLS columns.
                        unsafe { b.launch(config(launch::rms_norm_bwd(rows, d)?)) }.w()?;
                    }
                    let bi = int(blocks, "blocks")?; // 0 without rows: dw is zeros
                    let f = dev.get_or_load_custom_func(&format!("column_sums_{s}"), MODULE, PTX)?;
                    let mut b = f.builder();
                    b.arg(&partial).arg(&mut dw).arg(&bi).arg(&di);
                    // SAFETY: column_sums' signature; one thread per column of d.
                    unsafe { b.launch(config(launch::column_sums(d)?)) }.w()?;
                    Ok((tensor(dx, dev, x.shape().clone()), tensor(dw, dev, w.shape().clone())))
                })
            })
        })
    })
}
