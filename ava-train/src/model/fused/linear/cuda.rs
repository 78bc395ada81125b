//! The linear layer's weight gradient summed over calls on the device (`cuda` feature):
//! the sum kept in f32 across the calls of one backward (the chunked LM head's), each call's
//! product added into it. The math is the parent op's (its CPU half).

use candle_core::backend::BackendStorage;
use candle_core::cuda::WrapErr;
use candle_core::cuda::cudarc::driver::{CudaSlice, DevicePtr};
use candle_core::{DType, Result, Tensor, bail};

use super::super::cuda::{by_type, int, view, with_cuda};

/// A zero-filled f32 buffer of `n` elements on `like`'s GPU.
pub(super) fn zeros_f32(like: &Tensor, n: usize) -> Result<CudaSlice<f32>> {
    let candle_core::Device::Cuda(dev) = like.device() else { bail!("linear: a tensor is not on the GPU") };
    dev.alloc_zeros::<f32>(n.max(1))
}

/// `sum += gᵀ x` for g (N, out) and x (N, in) of one type (f32, bf16 or f16), `sum` an f32
/// (out, in) buffer, returned: one cuBLAS GemmEx with an f32 output, f32 accumulation and
/// beta = 1, so the product is added in f32 without a rounded copy of its own.
///
/// cuBLAS is column-major: the row-major (out, in) sum is the column-major (in, out) matrix
/// `C = A · op(B)` with A the row-major x read as column-major (in, N) (no transpose, lda =
/// in) and B the row-major g read as column-major (out, N), transposed (ldb = out); ldc = in.
pub(super) fn add_weight_grad(mut sum: CudaSlice<f32>, x: &Tensor, g: &Tensor) -> Result<CudaSlice<f32>> {
    use candle_core::cuda::cudarc::cublas::{result::gemm_ex, sys};
    use candle_core::cuda::cudarc::driver::DevicePtrMut;
    let (n, k) = x.dims2()?; // (N, in)
    let (n_g, out) = g.dims2()?; // (N, out)
    if n != n_g || x.dtype() != g.dtype() {
        bail!("linear: dW of x {:?} {:?} and g {:?} {:?}", x.dims(), x.dtype(), g.dims(), g.dtype());
    }
    if sum.len() < out * k {
        bail!("linear: a weight-gradient sum of {} elements for ({out}, {k})", sum.len());
    }
    if n == 0 || out == 0 || k == 0 {
        return Ok(sum);
    }
    let data_type = match x.dtype() {
        DType::F32 => sys::cudaDataType_t::CUDA_R_32F,
        DType::BF16 => sys::cudaDataType_t::CUDA_R_16BF,
        DType::F16 => sys::cudaDataType_t::CUDA_R_16F,
        other => bail!("linear: {other:?} has no cuBLAS weight gradient (f32, bf16 and f16 do)"),
    };
    let (m_c, n_c, k_c) = (int(k, "the input width")?, int(out, "the output width")?, int(n, "the rows")?);
    with_cuda(x, "linear", |xs, xl| {
        with_cuda(g, "linear", |gs, gl| {
            let dev = xs.device();
            let blas = dev.cublas_handle();
            let stream = dev.cuda_stream();
            by_type!(x.dtype(), "linear", |T, _s| {
                let (xv, gv) = (view::<T>(xs, xl, "linear")?, view::<T>(gs, gl, "linear")?);
                let (one, beta) = (1f32, 1f32);
                let (xp, _gx) = xv.device_ptr(&stream);
                let (gp, _gg) = gv.device_ptr(&stream);
                let (sp, _gs) = sum.device_ptr_mut(&stream);
                // SAFETY: A (in, N) with lda = in covers x's N·in elements, B (out, N) with
                // ldb = out covers g's N·out, C (in, out) with ldc = in covers the sum's
                // out·in (checked above); alpha and beta are f32 for the f32 compute type;
                // the handle runs on candle's stream, where x, g and the sum were made.
                unsafe {
                    gemm_ex(
                        *blas.handle(),
                        sys::cublasOperation_t::CUBLAS_OP_N,
                        sys::cublasOperation_t::CUBLAS_OP_T,
                        m_c,
                        n_c,
                        k_c,
                        (&one) as *const f32 as *const _,
                        xp as *const _,
                        data_type,
                        m_c,
                        gp as *const _,
                        data_type,
                        n_c,
                        (&beta) as *const f32 as *const _,
                        sp as *mut _,
                        sys::cudaDataType_t::CUDA_R_32F,
                        m_c,
                        sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP,
                    )
                }
                .w()?;
                Ok(())
            })
        })
    })?;
    Ok(sum)
}
