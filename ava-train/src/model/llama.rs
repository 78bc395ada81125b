//! The Llama-style decoder: parameters as candle `Var`s (f32 master weights, or the only
//! copy in bf16/f16 when `train.master_weights` keeps no f32 masters in memory) and the
//! forward pass split into embedding, blocks and head, so the engine can keep, recompute or
//! offload each block (see `recompute`).

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use ava_core::AttentionKernel;
use candle_core::{D, DType, Device, Result as CResult, Tensor, Var};

use super::attention::attention;
use super::fused::{RopeTables, add, cast, embedding, linear, merge_heads, rms_norm, split_heads, swiglu_gate};
use super::head_loss::head_loss;
use super::ops::{cross_entropy, softmax_last};
use super::spec::{BlockIndex, MlpIndex, ModelSpec, ParamDef, ParamIndex, ParamRole};
use super::{Documents, ModelError, cerr};

/// One parameter: its definition and its values.
#[derive(Debug)]
pub struct Param {
    /// Name, shape, role.
    pub def: ParamDef,
    /// The weights the optimizer steps: f32 masters, or the only copy in bf16/f16
    /// (`train.master_weights`).
    pub var: Var,
}

impl Param {
    /// Bytes of its values in the type they are stored in.
    pub fn stored_bytes(&self) -> usize {
        self.def.numel() * self.var.dtype().size_in_bytes()
    }
}

/// A block's output and, for a MoE block, its load-balancing loss (a scalar).
pub struct BlockOut {
    /// (B, T, d)
    pub hidden: Tensor,
    /// The unweighted load-balancing loss.
    pub aux: Option<Tensor>,
}

/// The model: spec, parameters, rotary tables and the attention kernel.
pub struct Model {
    spec: ModelSpec,
    params: Vec<Param>,
    blocks: Vec<BlockIndex>,
    /// Indices of each block's parameters, and of those outside the blocks (embedding,
    /// final norm, head): the forward pass asks for them per block.
    block_params: Vec<Vec<usize>>,
    outside_params: Vec<usize>,
    head: usize,
    final_norm: usize,
    rope: Arc<RopeTables>,
    kernel: Arc<dyn AttentionKernel>,
    kernel_name: String,
    threads: usize,
    /// Rows of the LM head computed at once in training's loss (0: the logits whole).
    loss_chunk_rows: usize,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model").field("spec", &self.spec).field("kernel", &self.kernel_name).finish_non_exhaustive()
    }
}

/// Deterministic N(0, 1) samples for a parameter: a SplitMix64 stream keyed by the seed and
/// the parameter's name, so a parameter's initial values do not depend on the others.
/// SplitMix64's k-th output is a pure function of k, so the samples are made in chunks on
/// the threads, each starting at its own place in the stream, with the same values as one
/// pass (a 7B model's 6.7 billion take minutes on one core).
fn normal_samples(seed: u64, name: &str, n: usize) -> Vec<f32> {
    use rayon::prelude::*;
    /// Samples per task; even, so a chunk holds whole Box–Muller pairs.
    const CHUNK: usize = 1 << 16;
    let start = seed ^ name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
    let mut out = vec![0f32; n];
    out.par_chunks_mut(CHUNK).enumerate().for_each(|(c, chunk)| {
        // Each sample takes one uniform: this chunk's first is the stream's (c·CHUNK)-th.
        let mut state = start.wrapping_add(((c * CHUNK) as u64).wrapping_mul(SPLITMIX_GAMMA));
        let mut next = move || {
            state = state.wrapping_add(SPLITMIX_GAMMA);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
        };
        for pair in chunk.chunks_mut(2) {
            // Box–Muller: two uniforms to two normals (the last of an odd count drops one).
            let (u1, u2) = (next().max(f64::MIN_POSITIVE), next());
            let r = (-2.0 * u1.ln()).sqrt();
            pair[0] = (r * (std::f64::consts::TAU * u2).cos()) as f32;
            if let Some(second) = pair.get_mut(1) {
                *second = (r * (std::f64::consts::TAU * u2).sin()) as f32;
            }
        }
    });
    out
}

/// SplitMix64's increment (the golden ratio in 64 bits).
const SPLITMIX_GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

impl Model {
    /// A freshly initialized model for sequences of up to `max_seq` tokens.
    pub fn new(
        spec: ModelSpec,
        seed: u64,
        max_seq: usize,
        kernel: Arc<dyn AttentionKernel>,
        kernel_name: &str,
        threads: usize,
    ) -> Result<Self, ModelError> {
        Self::new_stored(spec, seed, max_seq, kernel, kernel_name, threads, DType::F32)
    }

    /// [`new`](Self::new) with the parameters stored in `dtype` (f32, or bf16/f16 when the
    /// weights have no f32 master copy in memory). Each parameter is drawn in f32 and
    /// rounded to nearest, one at a time, so no f32 copy of the whole model ever exists.
    pub fn new_stored(
        spec: ModelSpec,
        seed: u64,
        max_seq: usize,
        kernel: Arc<dyn AttentionKernel>,
        kernel_name: &str,
        threads: usize,
        dtype: DType,
    ) -> Result<Self, ModelError> {
        let dev = Device::Cpu;
        let params = spec
            .params()
            .into_iter()
            .map(|def| {
                let values = Self::initial_values(&spec, seed, &def);
                let values = Tensor::from_vec(values, def.shape.as_slice(), &dev).map_err(cerr)?;
                let var = Var::from_tensor(&values.to_dtype(dtype).map_err(cerr)?).map_err(cerr)?;
                Ok(Param { def, var })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        Self::assemble(spec, params, max_seq, kernel, kernel_name, threads)
    }

    /// The f32 initial values of parameter `def` of a fresh model seeded `seed` (a pure
    /// function of both: f32 masters kept apart from bf16 weights start from these).
    pub fn initial_values(spec: &ModelSpec, seed: u64, def: &ParamDef) -> Vec<f32> {
        let n = def.numel();
        let residual_std = spec.init_std / (2.0 * spec.layers as f64).sqrt();
        match def.role {
            ParamRole::Norm => vec![1f32; n],
            ParamRole::Bias => vec![0f32; n],
            role => {
                let std = if role == ParamRole::ResidualOut { residual_std } else { spec.init_std } as f32;
                normal_samples(seed, &def.name, n).into_iter().map(|x| x * std).collect()
            }
        }
    }

    /// A model with the given f32 weights (by Hugging Face name), e.g. read from safetensors.
    /// Every parameter of the spec must be present with its shape; extra tensors are errors.
    pub fn from_tensors(
        spec: ModelSpec,
        tensors: HashMap<String, Tensor>,
        source: &Path,
        max_seq: usize,
        kernel: Arc<dyn AttentionKernel>,
        kernel_name: &str,
        threads: usize,
    ) -> Result<Self, ModelError> {
        Self::from_tensors_stored(spec, tensors, source, max_seq, kernel, kernel_name, threads, DType::F32)
    }

    /// [`from_tensors`](Self::from_tensors) with the parameters stored in `dtype`.
    #[allow(clippy::too_many_arguments)]
    pub fn from_tensors_stored(
        spec: ModelSpec,
        mut tensors: HashMap<String, Tensor>,
        source: &Path,
        max_seq: usize,
        kernel: Arc<dyn AttentionKernel>,
        kernel_name: &str,
        threads: usize,
        dtype: DType,
    ) -> Result<Self, ModelError> {
        let mut problems = Vec::new();
        let mut non_finite = Vec::new();
        let mut params = Vec::new();
        for def in spec.params() {
            match tensors.remove(&def.name) {
                None => problems.push(format!("missing tensor {}", def.name)),
                Some(t) if t.dims() != def.shape.as_slice() => {
                    problems.push(format!("{} has shape {:?}, the config says {:?}", def.name, t.dims(), def.shape))
                }
                Some(t) => {
                    let t = t.to_dtype(dtype).map_err(cerr)?;
                    // In the stored type: an f32 value beyond f16's range is infinite there.
                    if let Some(problem) = non_finite_values(&def.name, &t)? {
                        non_finite.push(problem);
                    }
                    params.push(Param { def, var: Var::from_tensor(&t).map_err(cerr)? });
                }
            }
        }
        if !non_finite.is_empty() && problems.is_empty() {
            return Err(ModelError::NonFiniteWeights { path: source.to_path_buf(), problems: non_finite });
        }
        let mut extra: Vec<String> = tensors.into_keys().filter(|k| !k.ends_with("rotary_emb.inv_freq")).collect();
        extra.sort();
        problems.extend(extra.into_iter().map(|k| format!("unexpected tensor {k} (not part of this architecture)")));
        if !problems.is_empty() {
            return Err(ModelError::Weights { path: source.to_path_buf(), problems });
        }
        Self::assemble(spec, params, max_seq, kernel, kernel_name, threads)
    }

    fn assemble(
        spec: ModelSpec,
        params: Vec<Param>,
        max_seq: usize,
        kernel: Arc<dyn AttentionKernel>,
        kernel_name: &str,
        threads: usize,
    ) -> Result<Self, ModelError> {
        // `params` are in `spec.params()` order (both constructors build them so).
        let ParamIndex { blocks, head, final_norm } = spec.param_index();
        let rope = RopeTables::new(max_seq, spec.head_dim(), &spec.rope).map_err(cerr)?;
        let in_block = |b: Option<usize>| (0..params.len()).filter(|&j| params[j].def.block == b).collect();
        let block_params = (0..spec.layers).map(|i| in_block(Some(i))).collect();
        let outside_params = in_block(None);
        Ok(Self {
            spec,
            params,
            blocks,
            block_params,
            outside_params,
            head,
            final_norm,
            rope,
            kernel,
            kernel_name: kernel_name.to_string(),
            threads,
            loss_chunk_rows: super::DEFAULT_LOSS_CHUNK_ROWS,
        })
    }

    /// The architecture.
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// The compute threads its ops split their work over.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// The model with training's loss ([`head_loss`](Self::head_loss)) computing the LM head
    /// `rows` rows at a time (`train.loss_chunk_rows`; 0: the logits whole, kept for
    /// backward). Built models start at [`DEFAULT_LOSS_CHUNK_ROWS`](super::DEFAULT_LOSS_CHUNK_ROWS).
    pub fn with_loss_chunk_rows(mut self, rows: usize) -> Self {
        self.loss_chunk_rows = rows;
        self
    }

    /// Rows of the LM head training's loss computes at once (0: all of them, kept).
    pub fn loss_chunk_rows(&self) -> usize {
        self.loss_chunk_rows
    }

    /// The parameters, in [`ModelSpec::params`] order.
    pub fn params(&self) -> &[Param] {
        &self.params
    }

    /// Indices (into [`params`](Self::params)) of block `i`'s parameters.
    pub fn block_params(&self, i: usize) -> &[usize] {
        &self.block_params[i]
    }

    /// Indices of the parameters outside the blocks: the embedding, the final norm, the head.
    pub fn outside_params(&self) -> &[usize] {
        &self.outside_params
    }

    /// The weights as the forward pass uses them: the `Var`s themselves when they are
    /// stored in `dtype`, or casts of them (inside the graph, so gradients flow back to
    /// the f32 masters).
    pub fn weights(&self, dtype: DType) -> CResult<Vec<Tensor>> {
        self.params.iter().map(|p| cast(p.var.as_tensor(), dtype)).collect()
    }

    /// Drops the values of every parameter `keep` rejects (ZeRO stage 3: another rank
    /// holds them, and they are gathered when needed). Such a parameter keeps its
    /// definition and stored type; its `Var` holds no values.
    pub fn keep_only(&mut self, keep: impl Fn(usize) -> bool) -> Result<(), ModelError> {
        for (i, p) in self.params.iter_mut().enumerate() {
            if !keep(i) {
                let empty = Tensor::zeros(0, p.var.dtype(), p.var.device()).map_err(cerr)?;
                p.var = Var::from_tensor(&empty).map_err(cerr)?;
            }
        }
        Ok(())
    }

    /// The model on `device`: every parameter's values moved there (the engine's stage after
    /// building or loading a model on the host, so a checkpoint of any device loads on any).
    pub fn to_device(mut self, device: &Device) -> Result<Self, ModelError> {
        if self.device().same_device(device) {
            return Ok(self);
        }
        for p in &mut self.params {
            p.var = Var::from_tensor(&p.var.as_tensor().to_device(device).map_err(cerr)?).map_err(cerr)?;
        }
        Ok(self)
    }

    /// Where the parameters live.
    pub fn device(&self) -> Device {
        self.params.first().map_or(Device::Cpu, |p| p.var.device().clone())
    }

    /// The type the parameters are stored in.
    pub fn storage(&self) -> DType {
        self.params.first().map_or(DType::F32, |p| p.var.dtype())
    }

    /// Token embedding: `tokens` (B, T) u32 → (B, T, d) (`fused::embedding`: its backward
    /// sums each token's rows in f32, in order, without atomics or zeros).
    pub fn embed(&self, w: &[Tensor], tokens: &Tensor) -> CResult<Tensor> {
        let (b, t) = tokens.dims2()?;
        let _span = crate::profile::scope("forward: embedding");
        embedding(&w[0], tokens)?.reshape((b, t, self.spec.hidden))
    }

    /// Block `i`: x + attn(norm(x)), then + mlp(norm(·)). x is (B, T, d). With packed
    /// `documents`, positions restart at each document and attention stays inside it.
    pub fn block(&self, w: &[Tensor], i: usize, x: &Tensor, documents: Option<&Documents>) -> CResult<BlockOut> {
        let bi = &self.blocks[i];
        let s = &self.spec;
        let (b, t, d) = x.dims3()?;
        let (h, hkv) = (s.heads, s.kv_heads);
        let n = b * t;

        let span = crate::profile::scope("forward: rms_norm");
        let normed = rms_norm(x, &w[bi.attn_norm], s.eps)?.reshape((n, d))?; // (B·T, d)
        drop(span);
        // q and k rotated on their way into heads; all three stay in the compute type (the
        // attention op widens them to the kernel's f32 inside its call).
        let span = crate::profile::scope("forward: q/k/v projections");
        let th = self.threads;
        let (q, k, v) = (
            projection(&normed, w, bi.q, bi.qkv_bias[0], th)?, // (B·T, H·D)
            projection(&normed, w, bi.k, bi.qkv_bias[1], th)?, // (B·T, Hkv·D)
            projection(&normed, w, bi.v, bi.qkv_bias[2], th)?, // (B·T, Hkv·D)
        );
        drop(span);
        let span = crate::profile::scope("forward: head split + rope");
        if let Some(docs) = documents.filter(|d| d.dims() != (b, t)) {
            candle_core::bail!("packed documents describe a {:?} batch, the block got ({b}, {t})", docs.dims());
        }
        let positions = documents.map(Documents::positions); // (B, T)
        let q = split_heads(&q, b, t, h, Some(&self.rope), positions)?; // (B, H, T, D)
        let k = split_heads(&k, b, t, hkv, Some(&self.rope), positions)?; // (B, Hkv, T, D)
        let v = split_heads(&v, b, t, hkv, None, None)?; // (B, Hkv, T, D)
        drop(span);
        let span = crate::profile::scope("forward: attention kernel");
        let segments = documents.map(Documents::segments); // (B, T)
        let attn = attention(&self.kernel, &self.kernel_name, &q, &k, &v, segments, self.threads)?; // (B, H, T, D)
        drop((span, q, k, v));
        let span = crate::profile::scope("forward: o_proj + residual");
        let attn = merge_heads(&attn)?; // (B·T, H·D)
        let x = add(x, &projection(&attn, w, bi.o, bi.o_bias, th)?.reshape((b, t, d))?)?; // (B, T, d)
        drop(span);

        let span = crate::profile::scope("forward: rms_norm");
        let normed = rms_norm(&x, &w[bi.mlp_norm], s.eps)?.reshape((n, d))?; // (B·T, d)
        drop(span);
        let _span = crate::profile::scope("forward: mlp + residual");
        let (mlp, aux) = match &bi.mlp {
            MlpIndex::Dense { gate, up, down, bias: b } => {
                let hidden =
                    swiglu_gate(&projection(&normed, w, *gate, b[0], th)?, &projection(&normed, w, *up, b[1], th)?)?; // (N, F)
                (projection(&hidden, w, *down, b[2], th)?, None)
            }
            MlpIndex::Moe { router, experts, top_k } => {
                let (out, aux) = moe(&normed, &w[*router], experts, *top_k, w, th)?;
                (out, Some(aux))
            }
        };
        Ok(BlockOut { hidden: add(&x, &mlp.reshape((b, t, d))?)?, aux })
    }

    /// Final norm and LM head: (B, T, d) → logits (B·T, V).
    pub fn head(&self, w: &[Tensor], x: &Tensor) -> CResult<Tensor> {
        let (b, t, d) = x.dims3()?;
        let _span = crate::profile::scope("forward: final norm + lm_head");
        let normed = rms_norm(x, &w[self.final_norm], self.spec.eps)?.reshape((b * t, d))?; // (B·T, d)
        linear(&normed, &w[self.head], self.threads) // (B·T, V)
    }

    /// Training's loss: the final norm, the LM head and the mean cross-entropy of (B, T, d)
    /// against the B·T `targets` (f32 scalar). With a positive
    /// [`loss_chunk_rows`](Self::loss_chunk_rows) the head and the loss run in blocks of that
    /// many rows (`model::head_loss`), so the logits never exist whole, and backward computes
    /// each block's again; with 0, or f64 weights (the gradient checks), the logits of
    /// [`head`](Self::head) go whole into `ops::cross_entropy`, and the graph keeps them for
    /// backward. The value and the gradients are the same bits either way, but for the
    /// exceptions `model::head_loss` lists.
    pub fn head_loss(&self, w: &[Tensor], x: &Tensor, targets: &[u32]) -> CResult<Tensor> {
        if self.loss_chunk_rows == 0 || x.dtype() == DType::F64 {
            return cross_entropy(&self.head(w, x)?, targets);
        }
        let (b, t, d) = x.dims3()?;
        let normed = {
            let _span = crate::profile::scope("forward: final norm");
            rms_norm(x, &w[self.final_norm], self.spec.eps)?.reshape((b * t, d))? // (B·T, d)
        };
        head_loss(&normed, &w[self.head], targets, self.loss_chunk_rows, self.threads)
    }

    /// Plain forward pass: logits (B·T, V) and the summed load-balancing losses.
    pub fn forward(
        &self,
        w: &[Tensor],
        tokens: &Tensor,
        documents: Option<&Documents>,
    ) -> CResult<(Tensor, Option<Tensor>)> {
        let mut x = self.embed(w, tokens)?;
        let mut aux: Option<Tensor> = None;
        for i in 0..self.spec.layers {
            let out = self.block(w, i, &x, documents)?;
            x = out.hidden;
            aux = add_opt(aux, out.aux)?;
        }
        Ok((self.head(w, &x)?, aux))
    }

    /// The weights as Hugging Face names → f32 tensors (for safetensors).
    pub fn named_tensors(&self) -> Vec<(String, Tensor)> {
        self.params.iter().map(|p| (p.def.name.clone(), p.var.as_tensor().clone())).collect()
    }
}

/// `a + b` where either may be absent.
pub(crate) fn add_opt(a: Option<Tensor>, b: Option<Tensor>) -> CResult<Option<Tensor>> {
    Ok(match (a, b) {
        (Some(a), Some(b)) => Some((a + b)?),
        (a, None) => a,
        (None, b) => b,
    })
}

/// `x W[w]ᵀ (+ W[bias])`: a projection, with its bias when it has one. x (N, in) → (N, out).
pub(crate) fn projection(
    x: &Tensor,
    w: &[Tensor],
    weight: usize,
    bias: Option<usize>,
    threads: usize,
) -> CResult<Tensor> {
    let y = linear(x, &w[weight], threads)?; // (N, out)
    match bias {
        Some(b) => y.broadcast_add(&w[b]),
        None => Ok(y),
    }
}

/// SwiGLU: down(silu(gate(x)) · up(x)). x (N, d) → (N, d).
fn swiglu(x: &Tensor, gate: &Tensor, up: &Tensor, down: &Tensor, threads: usize) -> CResult<Tensor> {
    let hidden = swiglu_gate(&linear(x, gate, threads)?, &linear(x, up, threads)?)?; // (N, F)
    linear(&hidden, down, threads)
}

/// A top-k mixture of SwiGLU experts (Mixtral's routing: softmax over all experts, keep the
/// top k, renormalize), and the Switch Transformer load-balancing loss
/// `E · Σₑ fₑ · Pₑ` (fₑ: fraction of routed slots going to e, Pₑ: mean router probability).
pub(crate) fn moe(
    x: &Tensor,
    router: &Tensor,
    experts: &[[usize; 3]],
    top_k: usize,
    w: &[Tensor],
    threads: usize,
) -> CResult<(Tensor, Tensor)> {
    let (n, d) = x.dims2()?;
    let e_count = experts.len();
    let probs = softmax_last(&linear(x, router, threads)?.to_dtype(DType::F32)?)?; // (N, E) f32
    let values = probs.detach().to_vec2::<f32>()?;
    // Top-k per token (ties to the lower index, so the choice is deterministic).
    let mut chosen = Vec::with_capacity(n * top_k); // (N, k) expert ids
    let mut counts = vec![0usize; e_count];
    for row in &values {
        let mut order: Vec<usize> = (0..e_count).collect();
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        for &e in &order[..top_k] {
            chosen.push(e as u32);
            counts[e] += 1;
        }
    }
    let chosen_t = Tensor::from_vec(chosen.clone(), (n, top_k), x.device())?;
    let top = probs.gather(&chosen_t, 1)?; // (N, k)
    let top = top.broadcast_div(&top.sum_keepdim(D::Minus1)?)?.flatten_all()?; // (N·k,)
    let mut out = Tensor::zeros((n, d), x.dtype(), x.device())?; // (N, d)
    for (e, [w1, w3, w2]) in experts.iter().enumerate() {
        let slots: Vec<u32> =
            chosen.iter().enumerate().filter(|(_, c)| **c as usize == e).map(|(s, _)| s as u32).collect();
        if slots.is_empty() {
            continue;
        }
        let rows: Vec<u32> = slots.iter().map(|s| s / top_k as u32).collect();
        let rows = Tensor::from_vec(rows, slots.len(), x.device())?;
        let gate = top.index_select(&Tensor::from_vec(slots.clone(), slots.len(), x.device())?, 0)?; // (n_e,)
        let y = swiglu(&x.index_select(&rows, 0)?, &w[*w1], &w[*w3], &w[*w2], threads)?; // (n_e, d)
        let y = y.broadcast_mul(&gate.to_dtype(x.dtype())?.unsqueeze(1)?)?;
        out = out.index_add(&rows, &y, 0)?;
    }
    let fractions: Vec<f32> = counts.iter().map(|&c| c as f32 / (n * top_k) as f32).collect();
    let fractions = Tensor::from_vec(fractions, e_count, x.device())?;
    let aux = (probs.mean(0)? * fractions)?.sum_all()?.affine(e_count as f64, 0.0)?;
    Ok((out, aux))
}

/// A loaded tensor's NaN and infinite values, said in one line (`None` when all are finite).
/// One pass over a copy of one tensor: cheap next to reading the file.
fn non_finite_values(name: &str, t: &Tensor) -> Result<Option<String>, ModelError> {
    let values = t.flatten_all().and_then(|t| t.to_dtype(DType::F32)).and_then(|t| t.to_vec1::<f32>()).map_err(cerr)?;
    let mut bad = values.iter().enumerate().filter(|(_, v)| !v.is_finite());
    let Some((first, value)) = bad.next() else { return Ok(None) };
    let count = 1 + bad.count();
    let what = if value.is_nan() { "NaN" } else { "infinite" };
    Ok(Some(format!(
        "{name}: {count} of {} values are NaN or infinite (the first, element {first}, is {what})",
        values.len()
    )))
}

#[cfg(test)]
mod tests {
    /// The samples made in parallel chunks are the single pass over the stream (the
    /// generator before it was split, kept here as the reference), at chunk edges and with
    /// an odd count.
    #[test]
    fn chunked_normal_samples_are_the_single_stream() {
        fn single_pass(seed: u64, name: &str, n: usize) -> Vec<f32> {
            let mut state =
                seed ^ name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
            let mut next = move || {
                state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
                let mut z = state;
                z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
            };
            let mut out = Vec::new();
            while out.len() < n {
                let (u1, u2) = (next().max(f64::MIN_POSITIVE), next());
                let r = (-2.0 * u1.ln()).sqrt();
                out.push((r * (std::f64::consts::TAU * u2).cos()) as f32);
                out.push((r * (std::f64::consts::TAU * u2).sin()) as f32);
            }
            out.truncate(n);
            out
        }
        let chunk = 1 << 16;
        for n in [0, 1, 2, 3, chunk - 1, chunk, chunk + 1, 3 * chunk + 7] {
            let (a, b) = (
                super::normal_samples(7, "model.layers.0.mlp.up_proj.weight", n),
                single_pass(7, "model.layers.0.mlp.up_proj.weight", n),
            );
            assert!(a.iter().map(|x| x.to_bits()).eq(b.iter().map(|x| x.to_bits())), "n = {n}");
        }
    }
}
