//! The token embedding as one op: forward looks up the table's rows for the tokens (candle's
//! own gather, on either device); backward gives each row of the table the sum of its
//! tokens' gradient rows, added in f32 (f64 for the gradient checks' f64) in the order the
//! tokens come and rounded once into the table's type, each row on its own: the same bits
//! for any thread count, on the CPU and on a GPU, with no atomics.
//!
//! Why: candle's `index_select` backward scatters the gradient with `index_add` into a
//! zeroed table of the table's type. In bf16 a token's sum is then rounded at every one of
//! its occurrences (a frequent token's gradient, summed over thousands of positions, loses
//! most of its bits), and candle's GPU kernel gives each of a few blocks' threads a column
//! and walks every token in sequence (for TinyLlama's 8,192 tokens, a latency-bound loop on
//! a couple of SMs). Here the positions of each token are sorted out on the host first (a
//! counting sort of the ids the op holds, [`positions_by_token`]), and a GPU block per table
//! row, or a CPU task per 64 rows, walks only its own tokens' positions.
//!
//! An f32 table's gradient is the bits candle's gave (both add a row's tokens in position
//! order, starting from zero); a half table's is more exact than candle's.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor, bail};
use rayon::prelude::*;

use super::{Real, Stored, with_stored, with_values};

// The device half: the backward's GPU kernel launch.
#[cfg(feature = "cuda")]
mod cuda;

/// Table rows per task of the CPU backward.
const ROWS_PER_TASK: usize = 64;

/// The rows of `table` (V, d) for `tokens` (any shape of u32 ids, each below V), as (N, d)
/// in the table's type, N the number of tokens. Differentiable in the table (see the module
/// docs); the ids are read to the host once, here (on a GPU a small copy that waits for the
/// device: the embedding is the step's first op).
pub fn embedding(table: &Tensor, tokens: &Tensor) -> Result<Tensor> {
    let (v, _) = table.dims2()?;
    let ids = tokens.flatten_all()?;
    let host = ids.to_vec1::<u32>()?;
    if let Some((i, &t)) = host.iter().enumerate().find(|&(_, &t)| t as usize >= v) {
        bail!("embedding: token {t} (at position {i}) is outside the vocabulary of {v} (model.vocab_size)");
    }
    table.contiguous()?.apply_op1(Embedding { ids, host })
}

struct Embedding {
    /// The ids as given, (N,) u32 on the table's device: forward's gather reads them there.
    ids: Tensor,
    /// The same ids on the host, for backward's sort.
    host: Vec<u32>,
}

/// The positions of each token, by a counting sort of `ids` over a vocabulary of `v`: token
/// t's positions are `order[offsets[t]..offsets[t + 1]]`, ascending. offsets (V + 1,), order
/// (N,).
pub(crate) fn positions_by_token(ids: &[u32], v: usize) -> (Vec<u32>, Vec<u32>) {
    let mut offsets = vec![0u32; v + 1];
    for &t in ids {
        offsets[t as usize + 1] += 1;
    }
    for t in 0..v {
        offsets[t + 1] += offsets[t];
    }
    let mut next = offsets.clone();
    let mut order = vec![0u32; ids.len()];
    for (p, &t) in ids.iter().enumerate() {
        order[next[t as usize] as usize] = p as u32;
        next[t as usize] += 1;
    }
    (offsets, order)
}

/// dW (V, d) from the gradient rows `grad` (N, d): row t the sum, in the compute type and in
/// `order`'s sequence, of the rows of token t's positions, rounded once; zero for a token
/// that does not occur.
fn table_grad<S: Stored<C = F>, F: Real>(grad: &[S], d: usize, offsets: &[u32], order: &[u32]) -> Vec<S> {
    let v = offsets.len() - 1;
    let mut dw = vec![S::store(F::zero()); v * d]; // (V, d)
    dw.par_chunks_mut(ROWS_PER_TASK * d).enumerate().for_each(|(task, rows)| {
        let mut sum = vec![F::zero(); d]; // (d,) this row's sum
        for (r, row) in rows.chunks_mut(d).enumerate() {
            let t = task * ROWS_PER_TASK + r;
            let mine = &order[offsets[t] as usize..offsets[t + 1] as usize];
            if mine.is_empty() {
                continue;
            }
            sum.fill(F::zero());
            for &p in mine {
                for (s, &g) in sum.iter_mut().zip(&grad[p as usize * d..(p as usize + 1) * d]) {
                    *s += g.load();
                }
            }
            for (o, &s) in row.iter_mut().zip(&sum) {
                *o = S::store(s);
            }
        }
    });
    dw
}

impl CustomOp1 for Embedding {
    fn name(&self) -> &'static str {
        "embedding"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (storage, layout) = self.ids.storage_and_layout();
        let candle_core::Storage::Cpu(ids) = &*storage else { bail!("embedding: the ids are not on the CPU") };
        let rows = s.index_select(ids, l, layout, 0)?;
        Ok((rows, Shape::from((self.host.len(), l.dims()[1]))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let (storage, layout) = self.ids.storage_and_layout();
        let candle_core::Storage::Cuda(ids) = &*storage else { bail!("embedding: the ids are not on the GPU") };
        let rows = s.index_select(ids, l, layout, 0)?;
        Ok((rows, Shape::from((self.host.len(), l.dims()[1]))))
    }

    fn bwd(&self, table: &Tensor, _rows: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let _span = crate::profile::scope("backward: embedding");
        let (v, d) = table.dims2()?;
        let (offsets, order) = positions_by_token(&self.host, v);
        let grad = grad.to_dtype(table.dtype())?;
        #[cfg(feature = "cuda")]
        if table.device().is_cuda() {
            return Ok(Some(cuda::embedding_bwd(&grad, &offsets, &order, (v, d))?));
        }
        let dw = with_stored!(table.dtype(), "embedding", |S| {
            let dw = with_values::<S, _>(&grad, "embedding", |g| Ok(table_grad(g, d, &offsets, &order)))?;
            Tensor::from_vec(dw, (v, d), table.device())?
        });
        Ok(Some(dw))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Var};

    use super::*;

    /// Ids with a token many times over, tokens once, the first and the last of a vocabulary
    /// of 50 and most of it absent.
    fn ids() -> Vec<u32> {
        let mut ids: Vec<u32> = (0..300).map(|i| ([7, 7, 3, 49, 0, 7, 12][i % 7] + (i / 97) as u32) % 50).collect();
        ids.extend([49, 0, 31]);
        ids
    }

    fn table_and_grad(dtype: DType, n: usize) -> (Var, Tensor) {
        let table = Tensor::randn(0f32, 1.0, (50, 24), &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
        let up = Tensor::randn(0f32, 1.0, (n, 24), &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
        (Var::from_tensor(&table).unwrap(), up)
    }

    /// The rows looked up, and their gradient: in f32 the bits of candle's `index_select`.
    #[test]
    fn matches_index_select_in_f32_bit_for_bit() {
        let ids = ids();
        let (table, up) = table_and_grad(DType::F32, ids.len());
        let tokens = Tensor::new(ids.as_slice(), &Device::Cpu).unwrap();
        let ours = embedding(table.as_tensor(), &tokens).unwrap();
        let theirs = table.as_tensor().index_select(&tokens, 0).unwrap();
        let bits = |t: &Tensor| {
            t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        };
        assert_eq!(bits(&ours), bits(&theirs));
        let g_ours = (ours * &up).unwrap().sum_all().unwrap().backward().unwrap();
        let g_theirs = (theirs * &up).unwrap().sum_all().unwrap().backward().unwrap();
        assert_eq!(bits(g_ours.get(table.as_tensor()).unwrap()), bits(g_theirs.get(table.as_tensor()).unwrap()));
    }

    /// In bf16 each row is the f32 sum rounded once (candle rounds at every addition).
    #[test]
    fn half_rows_are_summed_in_f32_and_rounded_once() {
        let ids = ids();
        let (table, up) = table_and_grad(DType::BF16, ids.len());
        let tokens = Tensor::new(ids.as_slice(), &Device::Cpu).unwrap();
        let out = embedding(table.as_tensor(), &tokens).unwrap();
        let grads = (out * &up).unwrap().sum_all().unwrap().backward().unwrap();
        let got = grads.get(table.as_tensor()).unwrap().to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap();
        let up = up.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap();
        for (t, row) in got.iter().enumerate() {
            for (j, &g) in row.iter().enumerate() {
                let sum: f32 = ids.iter().zip(&up).filter(|(id, _)| **id as usize == t).map(|(_, u)| u[j]).sum();
                assert_eq!(g, half::bf16::from_f32(sum).to_f32(), "row {t}, column {j}");
            }
        }
    }

    /// The counting sort: every position once, each token's ascending.
    #[test]
    fn positions_are_sorted_by_token_then_position() {
        let ids = ids();
        let (offsets, order) = positions_by_token(&ids, 50);
        assert_eq!(offsets.len(), 51);
        assert_eq!(order.len(), ids.len());
        for t in 0..50 {
            let mine = &order[offsets[t] as usize..offsets[t + 1] as usize];
            let want: Vec<u32> = (0..ids.len() as u32).filter(|&p| ids[p as usize] as usize == t).collect();
            assert_eq!(mine, want.as_slice(), "token {t}");
        }
    }

    /// The gradient's bits do not depend on the thread count.
    #[test]
    fn the_gradient_does_not_depend_on_the_thread_count() {
        let ids = ids();
        let (table, up) = table_and_grad(DType::BF16, ids.len());
        let tokens = Tensor::new(ids.as_slice(), &Device::Cpu).unwrap();
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let out = embedding(table.as_tensor(), &tokens).unwrap();
                let g = (out * &up).unwrap().sum_all().unwrap().backward().unwrap();
                g.get(table.as_tensor())
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
            })
        };
        assert_eq!(run(1), run(3));
    }

    /// A token outside the vocabulary is refused, naming it and its position.
    #[test]
    fn a_token_outside_the_vocabulary_is_refused() {
        let table = Tensor::zeros((50, 4), DType::F32, &Device::Cpu).unwrap();
        let tokens = Tensor::new(&[1u32, 50, 2], &Device::Cpu).unwrap();
        let e = embedding(&table, &tokens).unwrap_err().to_string();
        assert!(e.contains("token 50 (at position 1) is outside the vocabulary of 50"), "{e}");
    }
}
