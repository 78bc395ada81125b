//! The LM head and the cross-entropy as one op over blocks of rows, so the (N, V) logits of a
//! micro-batch never exist whole (`train.loss_chunk_rows`).
//!
//! Why: the head's logits are the largest activation of a long sequence. At T = 64K,
//! TinyLlama's 32,000-token vocabulary makes them 4 GiB in bf16, and the plain path keeps
//! them (and, on the CPU, their f32 copy) through the whole backward of the last stretch,
//! next to a gradient of the same size. Here they exist a block of rows at a time, twice:
//!
//! - forward, on detached inputs: each block's logits (`fused::linear`), each row's
//!   cross-entropy (`ops::cross_entropy_rows`, in the logits' own type), the logits freed; the
//!   rows' values are concatenated in row order and averaged as `ops::cross_entropy` averages
//!   them. The value enters the graph through a custom op on (h, W) whose forward returns it,
//!   so the graph holds h and W, not the logits.
//! - backward, block by block: the block's logits again, their gradient
//!   (`ops::cross_entropy_grad`, per-row upstream gradient g/N as `mean_all` hands it on), then
//!   dh and dW by the linear layer's backward (`fused::linear_backward`): dh's rows are
//!   written into dh, dW is added into one sum (`fused::WeightGrad`: f32, in block order)
//!   rounded once into W's type.
//!
//! The cost is the head's forward product run a second time in backward.
//!
//! What changes with the block size, on the CPU. In bf16 or f16 with blocks of a multiple of
//! 1024 rows (the linear layer's step), nothing: the blocks start where the whole product's
//! steps start, so every product is the same gemm calls on the same rows, each row's loss and
//! logits' gradient are computed alone, and dW's f32 sum is added to in the same order. In f32
//! (or other block sizes), the loss and dh stay the same bits as long as each block's share of
//! rows per thread keeps gemm in the kernel it uses for the whole (a share of one row, which a
//! last block of a few rows can leave, goes to its matrix-vector kernel, which sums in
//! another order), and dW's sum is grouped by block: the same bits where the blocks' edges fall
//! on gemm's own blocking of the sum, otherwise within rounding (tested). With one block,
//! everything is the bits of the plain path, `linear` then `ops::cross_entropy` (tested). On a
//! GPU one block is the plain path's products; several add dW through cuBLAS into f32.

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor, bail};

use super::fused::{WeightGrad, linear, linear_backward};
use super::ops::{cross_entropy_grad, cross_entropy_rows};

/// `train.loss_chunk_rows`' default, the rows of the head computed at once: 4096 rows of a
/// 32,000-token vocabulary are 250 MiB of bf16 logits (and as much gradient), against 4 GiB
/// each for all 64K rows of one 64K-token sequence; a multiple of the linear layer's step of
/// 1024 rows, so a half-precision run's gradients are the bits of the whole logits' (module
/// docs); and a micro-batch of up to 4096 tokens is one block.
pub const DEFAULT_LOSS_CHUNK_ROWS: usize = 4096;

/// Mean cross-entropy (f32 scalar, in the graph of `h` and `w`) of the logits `h Wᵀ` against
/// `targets`, computed `chunk_rows` rows at a time: `h` (N, d) is the final-normed hidden
/// state, `w` (V, d) the head weight, both in the compute type (f32, bf16 or f16), `targets`
/// the N next-token ids. The value is the bits of `ops::cross_entropy(&linear(h, w))`; see the
/// module docs for the gradients.
pub fn head_loss(h: &Tensor, w: &Tensor, targets: &[u32], chunk_rows: usize, threads: usize) -> Result<Tensor> {
    let (n, d) = h.dims2()?;
    let (_, d_w) = w.dims2()?;
    if d != d_w {
        bail!("head loss: hidden rows of {d} for a head weight of shape {:?}", w.dims());
    }
    if h.dtype() != w.dtype() || !matches!(h.dtype(), DType::F32 | DType::BF16 | DType::F16) {
        bail!("head loss: hidden {:?} and head weight {:?} (both f32, bf16 or f16)", h.dtype(), w.dtype());
    }
    if targets.len() != n {
        bail!("head loss: {} targets for {n} rows", targets.len());
    }
    if chunk_rows == 0 {
        bail!("head loss: blocks of 0 rows");
    }
    let (hd, wd) = (h.detach(), w.detach());
    let value = {
        let _span = crate::profile::scope("forward: lm_head + cross-entropy (in blocks of rows)");
        let mut rows = Vec::new();
        for (start, len) in blocks(n, chunk_rows) {
            let logits = linear(&hd.narrow(0, start, len)?, &wd, threads)?; // (len, V)
            rows.push(cross_entropy_rows(&logits, &targets[start..start + len])?); // (len,) f32
        }
        Tensor::cat(&rows, 0)?.mean_all()? // as `ops::cross_entropy` averages its (N,) rows
    };
    h.apply_op2(w, HeadLoss { value, targets: targets.to_vec(), chunk_rows, threads: threads.max(1) })
}

/// The blocks of `chunk_rows` rows (the last one shorter) that cover `n` rows, as (start,
/// length); one empty block when there are no rows. (The estimator's replay walks the same.)
pub(crate) fn blocks(n: usize, chunk_rows: usize) -> Vec<(usize, usize)> {
    (0..n.max(1)).step_by(chunk_rows).map(|start| (start, chunk_rows.min(n - start))).collect()
}

/// The op that puts the forward's value into the graph of (h, W) and computes their
/// gradients block by block in backward (see the module docs).
struct HeadLoss {
    /// The mean cross-entropy the forward computed (f32 scalar, no graph).
    value: Tensor,
    targets: Vec<u32>,
    chunk_rows: usize,
    threads: usize,
}

impl CustomOp2 for HeadLoss {
    fn name(&self) -> &'static str {
        "lm-head-cross-entropy"
    }

    /// A copy of the value the forward computed.
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        Ok((CpuStorage::F32(vec![self.value.to_scalar::<f32>()?]), Shape::from(())))
    }

    /// A device copy of the value the forward computed.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let (storage, layout) = self.value.storage_and_layout();
        let candle_core::Storage::Cuda(s) = &*storage else { bail!("head loss: the value is not on the GPU") };
        Ok((s.try_clone(layout)?, Shape::from(())))
    }

    fn bwd(&self, h: &Tensor, w: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let _span = crate::profile::scope("backward: lm_head + cross-entropy (logits recomputed)");
        let (n, d) = h.dims2()?;
        let (hd, wd) = (h.detach(), w.detach());
        // `mean_all`'s backward: each row's value gets the upstream gradient times 1/N.
        let per_row = grad.detach().to_dtype(DType::F32)?.affine(1.0 / n as f64, 0.0)?; // () f32
        let blocks = blocks(n, self.chunk_rows);
        // With several blocks, dh is filled a block of rows at a time.
        let dh_all = if blocks.len() > 1 { Some(Tensor::zeros((n, d), h.dtype(), h.device())?) } else { None };
        let mut dh_one = None;
        let mut dw = WeightGrad::new(blocks.len());
        for (start, len) in blocks {
            let h_block = hd.narrow(0, start, len)?; // (len, d)
            let logits = linear(&h_block, &wd, self.threads)?; // (len, V)
            let up = per_row.broadcast_as(len)?; // (len,)
            let dlogits = cross_entropy_grad(&logits, &self.targets[start..start + len], &up)?; // (len, V)
            drop(logits);
            let dh = linear_backward(&h_block, &wd, &dlogits, self.threads, &mut dw)?; // (len, d)
            drop(dlogits);
            match &dh_all {
                Some(all) => all.slice_set(&dh, 0, start)?,
                None => dh_one = Some(dh),
            }
        }
        let dh = match (dh_all, dh_one) {
            (Some(dh), _) | (None, Some(dh)) => dh,
            (None, None) => bail!("head loss: no block of rows"),
        };
        Ok((Some(dh), Some(dw.finish(w)?)))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;
    use crate::model::ops::cross_entropy;

    /// Deterministic values in about [-scale, scale).
    fn values(n: usize, salt: u64, scale: f32) -> Vec<f32> {
        (0..n as u64)
            .map(|i| {
                let x = (i.wrapping_mul(2654435761).wrapping_add(salt.wrapping_mul(40503)) % 1000) as f32;
                (x / 500.0 - 1.0) * scale
            })
            .collect()
    }

    /// (loss, dh, dW) as f32 vectors, through candle's backward on Vars of `dtype`, with an
    /// upstream factor (as `forward_backward`'s `scale / divisor`).
    fn run(
        n: usize,
        d: usize,
        v: usize,
        dtype: DType,
        loss: impl Fn(&Tensor, &Tensor, &[u32]) -> Result<Tensor>,
    ) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
        let dev = Device::Cpu;
        let make = |len, salt, scale| Tensor::from_vec(values(len, salt, scale), len, &dev).unwrap();
        let h = Var::from_tensor(&make(n * d, 1, 2.0).reshape((n, d)).unwrap().to_dtype(dtype).unwrap()).unwrap();
        let w = Var::from_tensor(&make(v * d, 2, 0.5).reshape((v, d)).unwrap().to_dtype(dtype).unwrap()).unwrap();
        let targets: Vec<u32> = (0..n).map(|i| ((i * 7919 + 3) % v) as u32).collect();
        let value = loss(h.as_tensor(), w.as_tensor(), &targets).unwrap();
        let grads = value.affine(0.75, 0.0).unwrap().backward().unwrap();
        let bits = |t: &Tensor| -> Vec<u32> {
            t.to_dtype(DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect()
        };
        (bits(&value), bits(grads.get(h.as_tensor()).unwrap()), bits(grads.get(w.as_tensor()).unwrap()))
    }

    /// The plain path: logits whole, then the fused cross-entropy.
    fn plain(h: &Tensor, w: &Tensor, targets: &[u32]) -> Result<Tensor> {
        cross_entropy(&linear(h, w, 2)?, targets)
    }

    fn floats(bits: &[u32]) -> Vec<f32> {
        bits.iter().map(|&b| f32::from_bits(b)).collect()
    }

    /// Largest |a − b| over the elements, in units of `largest`.
    fn worst(a: &[u32], b: &[u32], largest: f32) -> f32 {
        floats(a).iter().zip(floats(b)).map(|(x, y)| (x - y).abs() / largest).fold(0.0, f32::max)
    }

    #[test]
    fn one_block_is_the_plain_path_bit_for_bit() {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for (n, d, v) in [(37, 24, 50), (1500, 16, 40)] {
                let want = run(n, d, v, dtype, plain);
                for chunk in [n, n + 1, 1 << 20] {
                    let got = run(n, d, v, dtype, |h, w, t| head_loss(h, w, t, chunk, 2));
                    same_bits(&format!("{dtype:?} N {n} block {chunk}: loss"), &got.0, &want.0);
                    same_bits(&format!("{dtype:?} N {n} block {chunk}: dh"), &got.1, &want.1);
                    same_bits(&format!("{dtype:?} N {n} block {chunk}: dW"), &got.2, &want.2);
                }
            }
        }
    }

    /// Fails naming the first element where `got` and `want` differ in their bits.
    fn same_bits(what: &str, got: &[u32], want: &[u32]) {
        assert_eq!(got.len(), want.len(), "{what}: lengths");
        if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
            let (a, b) = (f32::from_bits(got[i]), f32::from_bits(want[i]));
            panic!("{what}: element {i} of {} is {a:e}, the plain path's {b:e}", got.len());
        }
    }

    /// Several blocks: the loss and dh are the same bits; dW the same bits for a half W in
    /// blocks of a multiple of 1024 rows (the linear layer's step); otherwise an f32 dW within
    /// 1e-5 of its largest element (the order of the f32 additions), a bf16 one within 2⁻⁷ of
    /// it (rounded once from an f32 sum either way: one unit in the last place of an element
    /// at most that large).
    #[test]
    fn several_blocks_give_the_same_loss_and_dh_and_dw_within_rounding() {
        let (n, d, v) = (2500, 16, 40);
        for dtype in [DType::F32, DType::BF16] {
            let want = run(n, d, v, dtype, plain);
            for chunk in [1024, 2048, 700] {
                let got = run(n, d, v, dtype, |h, w, t| head_loss(h, w, t, chunk, 2));
                same_bits(&format!("{dtype:?} block {chunk}: loss"), &got.0, &want.0);
                same_bits(&format!("{dtype:?} block {chunk}: dh"), &got.1, &want.1);
                if dtype == DType::BF16 && chunk % 1024 == 0 {
                    same_bits(&format!("{dtype:?} block {chunk}: dW"), &got.2, &want.2);
                    continue;
                }
                let largest = floats(&want.2).iter().fold(0f32, |m, x| m.max(x.abs()));
                let tolerance = if dtype == DType::F32 { 1e-5 } else { 2f32.powi(-7) };
                let off = worst(&got.2, &want.2, largest);
                println!("{dtype:?} block {chunk}: dW off by {off:e} of its largest element");
                assert!(off <= tolerance, "{dtype:?} block {chunk}: dW off by {off} of its largest element");
            }
        }
    }

    /// Blocks of one row: gemm multiplies a single row with its own kernel (a matrix-vector
    /// product, its sums in another order), so the loss and the gradients are no longer the
    /// plain path's bits, only close to them.
    #[test]
    fn single_row_blocks_are_close() {
        let (n, d, v) = (300, 16, 40);
        for (dtype, tolerance) in [(DType::F32, 1e-5), (DType::BF16, 2f32.powi(-7))] {
            let want = run(n, d, v, dtype, plain);
            let got = run(n, d, v, dtype, |h, w, t| head_loss(h, w, t, 1, 2));
            for (what, g, w) in [("loss", &got.0, &want.0), ("dh", &got.1, &want.1), ("dW", &got.2, &want.2)] {
                let largest = floats(w).iter().fold(0f32, |m, x| m.max(x.abs()));
                let off = worst(g, w, largest);
                assert!(off <= tolerance, "{dtype:?} {what}: off by {off} of its largest element");
            }
        }
    }

    #[test]
    fn bad_inputs_are_refused_by_name() {
        let dev = Device::Cpu;
        let h = Tensor::zeros((4, 8), DType::F32, &dev).unwrap();
        let w = Tensor::zeros((10, 8), DType::F32, &dev).unwrap();
        let err = |r: Result<Tensor>| r.unwrap_err().to_string();
        assert!(err(head_loss(&h, &w, &[1, 2, 3], 2, 1)).contains("3 targets for 4 rows"));
        assert!(
            err(head_loss(&h, &w, &[1, 2, 3, 10], 2, 1)).contains("target token 10 is outside the vocabulary of 10")
        );
        assert!(err(head_loss(&h, &w.t().unwrap(), &[0; 4], 2, 1)).contains("hidden rows of 8"));
        assert!(err(head_loss(&h, &w.to_dtype(DType::BF16).unwrap(), &[0; 4], 2, 1)).contains("both f32, bf16 or f16"));
        assert!(err(head_loss(&h, &w, &[0; 4], 0, 1)).contains("blocks of 0 rows"));
    }
}
