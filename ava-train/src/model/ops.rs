//! Differentiable building blocks candle lacks or has only without a backward: RMSNorm,
//! rotary embeddings, softmax, and a fused cross-entropy with its own backward.
//!
//! candle-nn's fused `rms_norm` and `softmax_last_dim` have no backward pass, so these are
//! written either from candle's differentiable primitives or as custom ops that implement
//! `bwd` (tested against the composed forms and finite differences).

use std::mem::MaybeUninit;

use candle_core::{CpuStorage, CustomOp1, D, DType, Layout, Result, Shape, Tensor, bail};
use half::{bf16, f16};
use rayon::prelude::*;

use super::fused::{ROWS_PER_TASK, Stored, filled, values, with_values};

/// RMSNorm over the last dimension: `x / sqrt(mean(x²) + ε) · w`, computed in f32 whatever
/// the input type (as Hugging Face Llama does), returned in the input type.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let xf = x.to_dtype(DType::F32)?;
    let ms = xf.sqr()?.mean_keepdim(D::Minus1)?; // (.., 1)
    let normed = xf.broadcast_div(&(ms + eps)?.sqrt()?)?;
    normed.to_dtype(dtype)?.broadcast_mul(&weight.to_dtype(dtype)?)
}

/// Softmax over the last dimension from differentiable primitives.
pub fn softmax_last(x: &Tensor) -> Result<Tensor> {
    // The max only shifts for stability; the result does not depend on it, so no gradient.
    let max = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&max)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

/// Rotary position embedding tables for one sequence length.
#[derive(Debug, Clone)]
pub struct Rope {
    cos: Tensor, // (T, D)
    sin: Tensor, // (T, D)
}

impl Rope {
    /// Tables for positions `0..seq` and head size `head_dim` (even), frequencies
    /// `θ^(-2i/D)`, laid out as Hugging Face Llama does: both halves of a head share the
    /// frequencies, and the rotation pairs element `i` with `i + D/2`.
    pub fn new(seq: usize, head_dim: usize, theta: f64, device: &candle_core::Device) -> Result<Self> {
        let half = head_dim / 2;
        let mut cos = Vec::with_capacity(seq * head_dim);
        let mut sin = Vec::with_capacity(seq * head_dim);
        for t in 0..seq {
            for j in 0..head_dim {
                let i = j % half;
                let freq = theta.powf(-2.0 * i as f64 / head_dim as f64);
                let angle = t as f64 * freq;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        Ok(Self {
            cos: Tensor::from_vec(cos, (seq, head_dim), device)?,
            sin: Tensor::from_vec(sin, (seq, head_dim), device)?,
        })
    }

    /// Sequence length the tables cover.
    pub fn seq_len(&self) -> usize {
        self.cos.dims()[0]
    }

    /// Rotates `x` (B, H, T, D): `x·cos + rotate_half(x)·sin`, rotate_half(x) = [−x₂, x₁].
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let (_, _, t, d) = x.dims4()?;
        if t > self.seq_len() {
            bail!("sequence of {t} tokens is longer than the rotary tables ({})", self.seq_len());
        }
        let dtype = x.dtype();
        let cos = self.cos.narrow(0, 0, t)?.to_dtype(dtype)?; // (T, D)
        let sin = self.sin.narrow(0, 0, t)?.to_dtype(dtype)?; // (T, D)
        let half = d / 2;
        let x1 = x.narrow(D::Minus1, 0, half)?;
        let x2 = x.narrow(D::Minus1, half, half)?;
        let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?; // (B, H, T, D)
        x.broadcast_mul(&cos)?.add(&rotated.broadcast_mul(&sin)?)
    }
}

/// Mean cross-entropy of `logits` (N, V) against `targets` (N token ids), in f32.
///
/// A custom op: forward computes each row's `logsumexp − logit[target]` without keeping the
/// softmax; backward recomputes the softmax from the logits it already holds and returns
/// `(softmax − onehot) · grad` ([`cross_entropy_grad`]). The composed form would keep four
/// N×V tensors alive.
///
/// f64 logits (gradient checks) take the composed log-softmax path instead, in f64.
pub fn cross_entropy(logits: &Tensor, targets: &[u32]) -> Result<Tensor> {
    if logits.dtype() == DType::F64 {
        return cross_entropy_composed(logits, targets);
    }
    // On the GPU the kernel reads the logits in their own type and computes in f32, so no f32
    // copy of the (N, V) logits is made; on the CPU they are widened first.
    let logits = if logits.device().is_cuda() { logits.clone() } else { logits.to_dtype(DType::F32)? };
    cross_entropy_rows(&logits, targets)?.mean_all()
}

/// Each row's cross-entropy `logsumexp − logit[target]`, (N,) f32, for logits (N, V) of f32,
/// bf16 or f16, read in their own type (each element widened as it is read): the fused op of
/// [`cross_entropy`], which keeps the logits for its backward when they are in a graph.
pub(crate) fn cross_entropy_rows(logits: &Tensor, targets: &[u32]) -> Result<Tensor> {
    let (n, _) = logits.dims2()?;
    if targets.len() != n {
        bail!("cross_entropy: {} targets for {n} rows", targets.len());
    }
    let logits = logits.contiguous()?;
    let _span = crate::profile::scope("forward: cross-entropy");
    logits.apply_op1(CrossEntropy { targets: targets.to_vec() }) // (N,)
}

/// The gradient of the rows' cross-entropy with respect to logits (N, V):
/// `(softmax(row) − onehot(target)) · grad_rows[row]`, in the logits' type (f32, bf16 or
/// f16), each element computed in f32 and rounded once. On the CPU a loop over the rows; on a
/// GPU the kernel of `kernels/fused.cu`, the same math. `grad_rows` (N,) is the upstream
/// gradient of each row's value (any layout).
pub(crate) fn cross_entropy_grad(logits: &Tensor, targets: &[u32], grad_rows: &Tensor) -> Result<Tensor> {
    let _span = crate::profile::scope("backward: cross-entropy");
    let (n, v) = logits.dims2()?;
    if targets.len() != n || grad_rows.dims() != [n] {
        bail!("cross-entropy: {} targets and upstream gradients {:?} for {n} rows", targets.len(), grad_rows.dims());
    }
    #[cfg(feature = "cuda")]
    if logits.device().is_cuda() {
        return crate::model::fused::cross_entropy_bwd(logits, targets, grad_rows);
    }
    check_targets(targets, v)?;
    let grad_rows = grad_rows.detach().to_dtype(DType::F32)?.to_vec1::<f32>()?;
    // Row by row on the threads (each row computed alone, so the bits do not depend on them).
    fn rows<S: Stored<C = f32>>(logits: &[S], v: usize, targets: &[u32], grad_rows: &[f32]) -> Vec<S> {
        let fill = |grad: &mut [MaybeUninit<S>]| {
            // (Chunks of at least one element: no rows, or none of V, is no work.)
            let rows = grad.par_chunks_exact_mut(v.max(1)).zip(logits.par_chunks_exact(v.max(1))).enumerate();
            rows.with_min_len(ROWS_PER_TASK).for_each(|(i, (g, row))| {
                let (max, lse) = log_sum_exp(row);
                let scale = grad_rows[i];
                let p = |x: S| ava_core::math::exp(x.load() - max - lse) * scale;
                for (gj, &x) in g.iter_mut().zip(row) {
                    gj.write(S::store(p(x)));
                }
                // The target's element again, less the scale, rounded once.
                let t = targets[i] as usize;
                g[t].write(S::store(p(row[t]) - scale));
            });
        };
        // SAFETY: every row of V is written whole.
        unsafe { filled(logits.len(), fill) } // (N, V)
    }
    let logits = logits.detach();
    let grad = match logits.dtype() {
        DType::F32 => Tensor::from_vec(
            with_values(&logits, "cross-entropy", |l| Ok(rows::<f32>(l, v, targets, &grad_rows)))?,
            (n, v),
            logits.device(),
        )?,
        DType::BF16 => Tensor::from_vec(
            with_values(&logits, "cross-entropy", |l| Ok(rows::<bf16>(l, v, targets, &grad_rows)))?,
            (n, v),
            logits.device(),
        )?,
        DType::F16 => Tensor::from_vec(
            with_values(&logits, "cross-entropy", |l| Ok(rows::<f16>(l, v, targets, &grad_rows)))?,
            (n, v),
            logits.device(),
        )?,
        other => bail!("cross-entropy: logits of {other:?} (f32, bf16 or f16)"),
    };
    Ok(grad)
}

/// Fails unless every target is inside the vocabulary of `v`.
fn check_targets(targets: &[u32], v: usize) -> Result<()> {
    match targets.iter().find(|&&t| t as usize >= v) {
        Some(t) => bail!("cross-entropy: target token {t} is outside the vocabulary of {v}"),
        None => Ok(()),
    }
}

/// Mean cross-entropy from differentiable primitives (log-softmax, gather): the reference
/// for the fused op, and the f64 path.
pub(crate) fn cross_entropy_composed(logits: &Tensor, targets: &[u32]) -> Result<Tensor> {
    let max = logits.max_keepdim(D::Minus1)?.detach();
    let lse = (logits.broadcast_sub(&max)?.exp()?.sum_keepdim(D::Minus1)?.log()? + &max)?; // (N, 1)
    let logp = logits.broadcast_sub(&lse)?; // (N, V)
    let idx = Tensor::from_vec(targets.to_vec(), (targets.len(), 1), logits.device())?;
    logp.gather(&idx, 1)?.neg()?.mean_all()
}

/// The per-row cross-entropy op (see [`cross_entropy`]).
struct CrossEntropy {
    targets: Vec<u32>,
}

/// `row` is one row of logits; returns (max, log Σ exp(x − max)), in f32 (a half row
/// widened as it is read).
fn log_sum_exp<S: Stored<C = f32>>(row: &[S]) -> (f32, f32) {
    let max = row.iter().map(|x| x.load()).fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = row.iter().map(|x| ava_core::math::exp(x.load() - max)).sum();
    (max, sum.ln())
}

impl CustomOp1 for CrossEntropy {
    fn name(&self) -> &'static str {
        "cross-entropy"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, v) = layout.shape().dims2()?;
        check_targets(&self.targets, v)?;
        // Row by row on the threads (each row computed alone).
        fn rows<S: Stored<C = f32>>(data: &[S], v: usize, targets: &[u32]) -> Vec<f32> {
            let rows = data.par_chunks_exact(v.max(1)).zip(targets.par_iter()).with_min_len(ROWS_PER_TASK);
            rows.map(|(row, &t)| {
                let (max, lse) = log_sum_exp(row);
                max + lse - row[t as usize].load()
            })
            .collect()
        }
        let out = match storage {
            CpuStorage::F32(_) => rows::<f32>(values(storage, layout, "cross-entropy")?, v, &self.targets),
            CpuStorage::BF16(_) => rows::<bf16>(values(storage, layout, "cross-entropy")?, v, &self.targets),
            CpuStorage::F16(_) => rows::<f16>(values(storage, layout, "cross-entropy")?, v, &self.targets),
            _ => bail!("cross-entropy: logits must be f32, bf16 or f16"),
        };
        Ok((CpuStorage::F32(out), Shape::from(n)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let n = layout.shape().dims2()?.0;
        Ok((crate::model::fused::cross_entropy_fwd(storage, layout, &self.targets)?, Shape::from(n)))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(cross_entropy_grad(arg, &self.targets, grad_res)?))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;

    #[test]
    fn fused_cross_entropy_matches_composed_value_and_gradient() -> Result<()> {
        let dev = Device::Cpu;
        let data: Vec<f32> = (0..5 * 7).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.7).collect();
        let targets = [0u32, 6, 3, 3, 1];
        let a = Var::from_vec(data.clone(), (5, 7), &dev)?;
        let b = Var::from_vec(data, (5, 7), &dev)?;
        let la = cross_entropy(a.as_tensor(), &targets)?;
        let lb = cross_entropy_composed(b.as_tensor(), &targets)?;
        let (va, vb) = (la.to_scalar::<f32>()?, lb.to_scalar::<f32>()?);
        assert!((va - vb).abs() < 1e-5, "{va} vs {vb}");
        let ga = la.backward()?.get(&a).unwrap().flatten_all()?.to_vec1::<f32>()?;
        let gb = lb.backward()?.get(&b).unwrap().flatten_all()?.to_vec1::<f32>()?;
        for (x, y) in ga.iter().zip(&gb) {
            assert!((x - y).abs() < 1e-6, "{x} vs {y}");
        }
        Ok(())
    }

    #[test]
    fn rms_norm_and_softmax_values() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::new(&[[3f32, 4.0], [1.0, -1.0]], &dev)?;
        let w = Tensor::new(&[2f32, 1.0], &dev)?;
        let y = rms_norm(&x, &w, 0.0)?.to_vec2::<f32>()?;
        let r = (12.5f32).sqrt();
        assert!((y[0][0] - 6.0 / r).abs() < 1e-6 && (y[0][1] - 4.0 / r).abs() < 1e-6);
        assert!((y[1][0] - 2.0).abs() < 1e-6 && (y[1][1] + 1.0).abs() < 1e-6);
        let s = softmax_last(&Tensor::new(&[[0f32, 2f32.ln()]], &dev)?)?.to_vec2::<f32>()?;
        assert!((s[0][0] - 1.0 / 3.0).abs() < 1e-6 && (s[0][1] - 2.0 / 3.0).abs() < 1e-6);
        Ok(())
    }

    #[test]
    fn rope_rotates_pairs_and_keeps_norms() -> Result<()> {
        let dev = Device::Cpu;
        let rope = Rope::new(3, 4, 10000.0, &dev)?;
        let x = Tensor::new(&[1f32, 2.0, 3.0, 4.0], &dev)?.reshape((1, 1, 1, 4))?.repeat((1, 1, 3, 1))?;
        let y = rope.apply(&x)?.reshape((3, 4))?.to_vec2::<f32>()?;
        // Position 0 is unrotated.
        assert_eq!(y[0], vec![1.0, 2.0, 3.0, 4.0]);
        // Position 1, pair (x0, x2) rotated by 1 radian: frequency θ^0 = 1.
        let (c, s) = (1f32.cos(), 1f32.sin());
        assert!((y[1][0] - (1.0 * c - 3.0 * s)).abs() < 1e-6);
        assert!((y[1][2] - (3.0 * c + 1.0 * s)).abs() < 1e-6);
        for row in &y {
            let n: f32 = row.iter().map(|v| v * v).sum();
            assert!((n - 30.0).abs() < 1e-4);
        }
        Ok(())
    }
}
