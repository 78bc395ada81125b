//! The root from which backward continues at the end of a stretch of blocks (recomputation,
//! `model::recompute`): an f32 scalar of `out` whose gradient with respect to `out` is a given
//! `grad_out` (B, T, d), the gradient the later stretch handed back.
//!
//! Its value is 0 and is never read: the op exists for its gradient. It replaces the surrogate
//! `(out · grad_out).sum_all()`, whose gradient is the same `grad_out` but which cost an
//! element-wise product of (B, T, d), a sum over it that candle's CUDA backend runs in a
//! single block of threads (about 6 ms for TinyLlama-1.1B's 4 × 2048 × 2048 in bf16, at the
//! rate its whole-tensor sums ran in the H200 profile), and another product in backward, once
//! per stretch: every block under full checkpointing. Here forward writes one f32 and backward
//! one product of `grad_out` with the upstream gradient (a scalar, 1 at the root, so `grad_out`
//! exactly).

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor, bail};

/// A scalar (f32, value 0) whose gradient with respect to `out` is `grad_out` (in `out`'s
/// type): the root `backward` is called on to continue from `out`.
pub fn seed(out: &Tensor, grad_out: &Tensor) -> Result<Tensor> {
    if out.dims() != grad_out.dims() {
        bail!("seed: out {:?} and its gradient {:?} differ in shape", out.dims(), grad_out.dims());
    }
    out.apply_op1(Seed { grad: grad_out.detach().to_dtype(out.dtype())? })
}

struct Seed {
    /// The gradient handed back, detached, in `out`'s type.
    grad: Tensor,
}

impl CustomOp1 for Seed {
    fn name(&self) -> &'static str {
        "seed"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        Ok((CpuStorage::F32(vec![0.0]), Shape::from(())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, _: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        Ok((super::cuda::zeros(s.device(), candle_core::DType::F32, 1)?, Shape::from(())))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(self.grad.broadcast_mul(&grad.to_dtype(self.grad.dtype())?)?))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Var};

    use super::*;

    /// Backward from the seed (plus another term, as the MoE auxiliary loss is added to it)
    /// hands `grad_out` to `out` bit for bit, and on through the ops before it, as the
    /// surrogate `(out · grad_out).sum_all()` did.
    #[test]
    fn backward_from_the_seed_hands_back_the_given_gradient() {
        let dev = Device::Cpu;
        for dtype in [DType::F32, DType::BF16] {
            let x = Var::from_tensor(&Tensor::arange(0f32, 24.0, &dev).unwrap().reshape((2, 3, 4)).unwrap()).unwrap();
            let x_t = x.as_tensor().to_dtype(dtype).unwrap();
            let out = x_t.affine(0.5, 1.0).unwrap(); // (2, 3, 4)
            let g = Tensor::arange(-12f32, 12.0, &dev).unwrap().affine(0.37, 0.0).unwrap().reshape((2, 3, 4)).unwrap();
            let other = || x.as_tensor().sqr().unwrap().sum_all().unwrap().affine(0.25, 0.0).unwrap();
            let root = (seed(&out, &g).unwrap() + other()).unwrap();
            assert_eq!(root.dims(), &[] as &[usize]);
            assert_eq!(root.dtype(), DType::F32);
            let by_seed = root.backward().unwrap().get(x.as_tensor()).unwrap().to_vec3::<f32>().unwrap();
            let surrogate = (&out * g.to_dtype(dtype).unwrap()).unwrap().sum_all().unwrap().to_dtype(DType::F32);
            let surrogate = (surrogate.unwrap() + other()).unwrap();
            let by_sum = surrogate.backward().unwrap().get(x.as_tensor()).unwrap().to_vec3::<f32>().unwrap();
            assert_eq!(by_seed, by_sum, "{dtype:?}");
        }
    }

    #[test]
    fn a_gradient_of_another_shape_is_refused() {
        let dev = Device::Cpu;
        let e = seed(&Tensor::zeros((2, 3), DType::F32, &dev).unwrap(), &Tensor::zeros(6, DType::F32, &dev).unwrap());
        let e = e.unwrap_err().to_string(); // candle's error text, then a backtrace when enabled
        assert!(e.starts_with("seed: out [2, 3] and its gradient [6] differ in shape"), "{e}");
    }
}
