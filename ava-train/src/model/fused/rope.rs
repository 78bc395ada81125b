//! The head split with the rotary embedding, and the head merge, as single passes.
//!
//! `split_heads` turns a projection's output (B·T, C·D) into heads (B, C, T, D), rotating
//! each head row by its position's angles on the way (Hugging Face Llama's rotate-half
//! layout: element `i` pairs with `i + D/2`). Its backward is the transposed rotation on the
//! way back. `merge_heads` is the plain inverse transposition, (B, C, T, D) → (B·T, C·D).
//! candle's form of the same (transpose, contiguous copy, narrow, negate, concatenate, two
//! broadcast products, a sum, and the reverse in backward, plus gradients for the tables)
//! was ten passes over q and k. Both keep the stored type (bf16 heads for bf16 projections),
//! rotating in f32.

use std::mem::MaybeUninit;
use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor, WithDType, bail};
use rayon::prelude::*;

use super::{Real, Stored, filled, values, with_stored, with_values};
use crate::model::RopeSpec;

// The device half: the GPU kernel's launch and the tables' copy on the device.
#[cfg(feature = "cuda")]
mod cuda;

/// Rotary tables for positions `0..seq` and a head size: `a·cos` and `a·sin` of `t · fᵢ`, with
/// the frequencies `fᵢ` and attention factor `a` of a [`RopeSpec`] (plain RoPE: `fᵢ = θ^(-2i/D)`,
/// `a = 1`), both halves of a head sharing the frequencies. Kept in f32 and f64 (the gradient
/// checks).
#[derive(Debug)]
pub struct RopeTables {
    seq: usize,
    head_dim: usize,
    cos32: Vec<f32>, // (T, D)
    sin32: Vec<f32>, // (T, D)
    cos64: Vec<f64>, // (T, D)
    sin64: Vec<f64>, // (T, D)
    /// The f32 tables' copy on the GPU, made on first use there.
    #[cfg(feature = "cuda")]
    on_device: cuda::TableCache,
}

impl RopeTables {
    /// Tables for `seq` positions, head size `head_dim` (even) and the settings `rope`.
    pub fn new(seq: usize, head_dim: usize, rope: &RopeSpec) -> Result<Arc<Self>> {
        if !head_dim.is_multiple_of(2) {
            bail!("rotary embedding needs an even head size, got {head_dim}");
        }
        let half = head_dim / 2;
        let (freqs, scale) = rope.frequencies(head_dim, seq);
        let (mut cos64, mut sin64) = (Vec::with_capacity(seq * head_dim), Vec::with_capacity(seq * head_dim));
        for t in 0..seq {
            for j in 0..head_dim {
                let angle = t as f64 * freqs[j % half];
                cos64.push(angle.cos() * scale);
                sin64.push(angle.sin() * scale);
            }
        }
        let cos32 = cos64.iter().map(|&v| v as f32).collect();
        let sin32 = sin64.iter().map(|&v| v as f32).collect();
        Ok(Arc::new(Self {
            seq,
            head_dim,
            cos32,
            sin32,
            cos64,
            sin64,
            #[cfg(feature = "cuda")]
            on_device: Default::default(),
        }))
    }

    /// The f32 tables (cos, sin), (T, D) each.
    #[cfg(feature = "cuda")]
    fn f32_tables(&self) -> (&[f32], &[f32]) {
        (&self.cos32, &self.sin32)
    }

    /// Where the GPU copy of the tables is kept.
    #[cfg(feature = "cuda")]
    fn device_cache(&self) -> &cuda::TableCache {
        &self.on_device
    }

    /// Positions covered.
    pub fn seq_len(&self) -> usize {
        self.seq
    }

    /// Bytes the tables hold (for the estimate).
    pub fn bytes(seq: usize, head_dim: usize) -> u64 {
        (seq * head_dim * (2 * 4 + 2 * 8)) as u64
    }

    /// Bytes of the tables' device copy on a GPU run, cos and sin in f32 (for the estimate).
    pub fn device_bytes(seq: usize, head_dim: usize) -> u64 {
        (seq * head_dim * 2 * 4) as u64
    }
}

/// The tables in a compute type.
trait Tabled: Real {
    fn tables(r: &RopeTables) -> (&[Self], &[Self]);
}

impl Tabled for f32 {
    fn tables(r: &RopeTables) -> (&[f32], &[f32]) {
        (&r.cos32, &r.sin32)
    }
}

impl Tabled for f64 {
    fn tables(r: &RopeTables) -> (&[f64], &[f64]) {
        (&r.cos64, &r.sin64)
    }
}

/// Which way the op moves data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dir {
    /// (B·T, C·D) → (B, C, T, D).
    Split,
    /// (B, C, T, D) → (B·T, C·D).
    Merge,
}

struct Heads {
    dir: Dir,
    b: usize,
    t: usize,
    c: usize,
    d: usize,
    rope: Option<Arc<RopeTables>>,
    /// (B, T) each token's position for the rotation (packed documents restart it); `None`:
    /// its index in the sequence.
    positions: Option<Arc<[u32]>>,
}

/// Splits `p` (B·T, C·D) into heads (B, C, T, D), rotated by `rope` when given (q and k)
/// or not (v), token `(b, t)` by the angles of position `positions[b·T + t]` when given
/// (packed documents), else of `t`. Returns `p`'s type; the rotation is computed in f32 (f64
/// for f64 input).
pub fn split_heads(
    p: &Tensor,
    b: usize,
    t: usize,
    c: usize,
    rope: Option<&Arc<RopeTables>>,
    positions: Option<&Arc<[u32]>>,
) -> Result<Tensor> {
    let (n, cd) = p.dims2()?;
    if n != b * t || cd % c != 0 {
        bail!("split_heads: ({n}, {cd}) is not (B·T, C·D) for B {b}, T {t}, C {c}");
    }
    let d = cd / c;
    if let Some(r) = rope
        && (t > r.seq || d != r.head_dim)
    {
        bail!("sequence of {t} tokens is longer than the rotary tables ({}) or head size {d} differs", r.seq);
    }
    if let Some(pos) = positions {
        if pos.len() != b * t {
            bail!("split_heads: {} positions for (B {b}, T {t}); B·T expected", pos.len());
        }
        // Inside the tables: packed documents restart positions inside a sequence (each below
        // T); generation's tokens are at their place after the cached ones (each below the
        // tables' length).
        let limit = rope.map_or(t, |r| r.seq);
        if let Some(i) = pos.iter().position(|&x| x as usize >= limit) {
            bail!(
                "split_heads: position {} of token ({}, {}) is outside the rotary tables ({limit} positions)",
                pos[i],
                i / t,
                i % t
            );
        }
    }
    let positions = positions.cloned();
    p.contiguous()?.apply_op1(Heads { dir: Dir::Split, b, t, c, d, rope: rope.cloned(), positions })
}

/// Merges heads (B, C, T, D) into rows (B·T, C·D), in `x`'s type.
pub fn merge_heads(x: &Tensor) -> Result<Tensor> {
    let (b, c, t, d) = x.dims4()?;
    x.contiguous()?.apply_op1(Heads { dir: Dir::Merge, b, t, c, d, rope: None, positions: None })
}

/// One head row: copy, or rotate in the compute type (`transposed`: by the transposed
/// rotation, for backward).
#[inline]
fn row<S: Stored<C = F>, F: Real>(
    src: &[S],
    dst: &mut [MaybeUninit<S>],
    tables: Option<(&[F], &[F])>,
    transposed: bool,
) {
    let Some((cos, sin)) = tables else {
        for (o, &v) in dst.iter_mut().zip(src) {
            o.write(v);
        }
        return;
    };
    let h = src.len() / 2;
    let (s1, s2) = src.split_at(h);
    let (d1, d2) = dst.split_at_mut(h);
    let (c1, c2) = cos.split_at(h);
    let (n1, n2) = sin.split_at(h);
    for j in 0..h {
        let (a, b) = (s1[j].load(), s2[j].load());
        if transposed {
            d1[j].write(S::store(a * c1[j] + b * n2[j]));
            d2[j].write(S::store(b * c2[j] - a * n1[j]));
        } else {
            d1[j].write(S::store(a * c1[j] - b * n1[j]));
            d2[j].write(S::store(b * c2[j] + a * n2[j]));
        }
    }
}

impl Heads {
    /// Moves `src` to the layout `to`, rotating with the tables (transposed or not).
    fn run<S: Stored<C = F>, F: Tabled>(&self, src: &[S], to: Dir, transposed: bool) -> Vec<S> {
        let (t, c, d) = (self.t, self.c, self.d);
        let tables = self.rope.as_ref().map(|r| F::tables(r));
        let positions = self.positions.as_deref();
        // The tables' rows for token (b, t).
        let at = |bb: usize, tt: usize| {
            let pos = positions.map_or(tt, |p| p[bb * t + tt] as usize);
            tables.map(|(cos, sin)| (&cos[pos * d..(pos + 1) * d], &sin[pos * d..(pos + 1) * d]))
        };
        let fill = |dst: &mut [MaybeUninit<S>]| match to {
            // dst (B, C, T, D): one task per (b, c), reading rows (b, t, c) of src (B, T, C, D).
            Dir::Split => dst.par_chunks_mut(t * d).enumerate().for_each(|(i, out)| {
                let (bb, cc) = (i / c, i % c);
                for (tt, o) in out.chunks_exact_mut(d).enumerate() {
                    let s = ((bb * t + tt) * c + cc) * d;
                    row(&src[s..s + d], o, at(bb, tt), transposed);
                }
            }),
            // dst (B, T, C, D): one task per (b, t), reading rows (b, c, t) of src (B, C, T, D).
            Dir::Merge => dst.par_chunks_mut(c * d).enumerate().for_each(|(i, out)| {
                let (bb, tt) = (i / t, i % t);
                for (cc, o) in out.chunks_exact_mut(d).enumerate() {
                    let s = ((bb * c + cc) * t + tt) * d;
                    row(&src[s..s + d], o, at(bb, tt), transposed);
                }
            }),
        };
        // SAFETY: every chunk of dst is a whole (b, c) or (b, t) block, each of its rows
        // written by `row`.
        unsafe { filled(src.len(), fill) }
    }

    fn out_shape(&self, dir: Dir) -> Shape {
        match dir {
            Dir::Split => Shape::from((self.b, self.c, self.t, self.d)),
            Dir::Merge => Shape::from((self.b * self.t, self.c * self.d)),
        }
    }

    fn other(&self) -> Dir {
        match self.dir {
            Dir::Split => Dir::Merge,
            Dir::Merge => Dir::Split,
        }
    }

    /// This op's move towards `to` for the GPU kernel.
    #[cfg(feature = "cuda")]
    fn device_move(&self, to: Dir, transposed: bool) -> cuda::HeadsMove<'_> {
        cuda::HeadsMove {
            b: self.b,
            c: self.c,
            t: self.t,
            d: self.d,
            merge: to == Dir::Merge,
            transposed,
            rope: self.rope.as_deref(),
            positions: self.positions.as_deref(),
        }
    }
}

impl CustomOp1 for Heads {
    fn name(&self) -> &'static str {
        match self.dir {
            Dir::Split => "split-heads",
            Dir::Merge => "merge-heads",
        }
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let name = self.name();
        let out = with_stored!(storage.dtype(), name, |S| {
            S::to_cpu_storage_owned(self.run::<S, _>(values(storage, layout, name)?, self.dir, false))
        });
        Ok((out, self.out_shape(self.dir)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = cuda::heads(storage, layout, &self.device_move(self.dir, false))?;
        Ok((out, self.out_shape(self.dir)))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let _span = crate::profile::scope("backward: heads split/merge + rope");
        let back = self.other();
        let grad = grad.to_dtype(arg.dtype())?;
        #[cfg(feature = "cuda")]
        if arg.device().is_cuda() {
            return Ok(Some(cuda::heads_tensor(&grad, &self.device_move(back, true), self.out_shape(back))?));
        }
        let dx = with_stored!(arg.dtype(), self.name(), |S| {
            let v = with_values::<S, _>(&grad, self.name(), |g| Ok(self.run::<S, _>(g, back, true)))?;
            Tensor::from_vec(v, self.out_shape(back), arg.device())?
        });
        Ok(Some(dx))
    }
}
