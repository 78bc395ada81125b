//! Generation with a KV cache: a [`Generator`] feeds tokens to a trained [`Model`] one
//! stretch at a time (the prompt, then each sampled token) and returns the next token's
//! logits; every block keeps the keys and values of the positions it has seen, so a new token
//! costs one position's projections and one row of attention instead of the whole sequence
//! again. [`Sampler`] picks the next token: greedy, or with temperature, top-k and top-p from
//! a seeded generator (the same seed gives the same text).
//!
//! A stretch of many tokens (a long prompt, a sequence `ava eval` scores) goes through the
//! blocks in chunks of rows ([`prompt_chunk`]), so its attention scores stay near 64 MiB
//! where the whole stretch's would grow with the square of its length; every size is checked
//! before anything is allocated: the positions asked for against the model's context
//! ([`ModelSpec::context`](super::ModelSpec::context)), and what they hold
//! ([`generator_bytes`]) against the memory the machine has.
//!
//! The blocks reuse the training forward's fused ops (RMSNorm, the projections, the head split
//! with RoPE at each token's position, SwiGLU, the MoE routing) in f32, and attend with
//! candle's own ops: one query row against the cached keys, causal, inside the model's
//! sliding window when it has one, grouped-query heads sharing their key/value head. The test
//! holds its logits to the full forward pass's at every position, and its greedy tokens to
//! transformers' `generate` (ava-cli/tests/generate/).

use std::sync::Arc;

use candle_core::{DType, Result as CResult, Tensor};

use super::fused::{RopeTables, add, linear, merge_heads, rms_norm, split_heads, swiglu_gate};
use super::llama::{moe, projection};
use super::ops::softmax_last;
use super::spec::{MlpIndex, ParamIndex};
use super::{Model, ModelError, ModelSpec, cerr};

/// What the attention scores of a chunk of prompt rows may take, with their mask and the
/// softmax's copy beside them.
const CHUNK_SCORES_BYTES: usize = 64 << 20;

/// Rows of a stretch fed through the blocks at once when the sequence will be `len`
/// positions long: a chunk's scores, mask and probabilities ((2H + 1)·c·L f32) stay within
/// [`CHUNK_SCORES_BYTES`], at most 512 rows and at least one.
pub fn prompt_chunk(heads: usize, len: usize) -> usize {
    let per_row = (2 * heads + 1).saturating_mul(len.max(1)).saturating_mul(4);
    (CHUNK_SCORES_BYTES / per_row).clamp(1, 512)
}

/// Bytes a generator made for `positions` holds at its most, besides the model's weights:
/// its rotary tables, every block's cached keys and values (one block's twice while a stretch
/// is appended), the keys and values widened to every query head for one block, a chunk's
/// scores and its logits.
pub fn generator_bytes(spec: &ModelSpec, positions: usize) -> u64 {
    let (l, d) = (positions as u64, spec.head_dim() as u64);
    let (h, hkv, layers) = (spec.heads as u64, spec.kv_heads as u64, spec.layers as u64);
    let chunk = prompt_chunk(spec.heads, positions) as u64;
    // Saturating: a size past u64 is more than any machine has, and says so.
    let times = |parts: &[u64]| parts.iter().fold(1u64, |a, &b| a.saturating_mul(b));
    let rope = times(&[2, l, d, 4]); // cos and sin, (L, D/2) each, f32 — rounded up
    let block_cache = times(&[2, hkv, l, d, 4]); // (1, Hkv, L, D) keys and values
    let widened = times(&[2, h, l, d, 4]); // (1, H, L, D) keys and values
    let scores = times(&[2 * h + 1, chunk, l, 4]);
    let logits = times(&[chunk, spec.vocab as u64, 4]);
    [rope, times(&[layers + 1, block_cache]), widened, scores, logits].iter().fold(0u64, |a, &b| a.saturating_add(b))
}

/// Keys and values a block has cached: (1, Hkv, P, D) each.
struct Cached {
    k: Tensor,
    v: Tensor,
}

/// Runs a model token by token with a cache of every block's keys and values.
pub struct Generator<'m> {
    model: &'m Model,
    /// The weights in f32, in [`ModelSpec::params`](super::ModelSpec::params) order.
    weights: Vec<Tensor>,
    index: ParamIndex,
    rope: Arc<RopeTables>,
    /// The most positions this generator takes (its rotary tables' length).
    max_len: usize,
    cache: Vec<Option<Cached>>,
    /// Positions fed so far.
    len: usize,
    /// Rows fed through the blocks at once at most ([`prompt_chunk`] may take fewer).
    max_chunk: usize,
}

impl<'m> Generator<'m> {
    /// A generator for sequences of up to `max_len` tokens (prompt and generated).
    pub fn new(model: &'m Model, max_len: usize) -> Result<Self, ModelError> {
        let spec = model.spec();
        let weights = model.weights(DType::F32).map_err(cerr)?.into_iter().map(|w| w.detach()).collect();
        let rope = RopeTables::new(max_len.max(1), spec.head_dim(), &spec.rope).map_err(cerr)?;
        Ok(Self {
            model,
            weights,
            index: spec.param_index(),
            rope,
            max_len,
            cache: (0..spec.layers).map(|_| None).collect(),
            len: 0,
            max_chunk: usize::MAX,
        })
    }

    /// Feeds at most `rows` tokens through the blocks at once (at least 1): fewer rows hold
    /// less attention at a time; the logits are the same up to the products' rounding.
    pub fn with_max_chunk(mut self, rows: usize) -> Self {
        self.max_chunk = rows.max(1);
        self
    }

    /// Forgets every position fed, to start another sequence (the weights and tables stay).
    pub fn reset(&mut self) {
        self.cache.iter_mut().for_each(|c| *c = None);
        self.len = 0;
    }

    /// Positions fed so far.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing was fed yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Feeds `tokens` at the next positions and returns the logits (V values, f32) that
    /// predict the token after the last of them.
    pub fn feed(&mut self, tokens: &[u32]) -> CResult<Vec<f32>> {
        let mut hidden = None;
        for chunk in tokens.chunks(self.chunk(tokens.len())) {
            hidden = Some(self.blocks(chunk)?); // (1, c, d)
        }
        let Some(hidden) = hidden else { candle_core::bail!("generate: nothing to feed") };
        let last = hidden.narrow(1, hidden.dim(1)? - 1, 1)?; // (1, 1, d): only its logits are asked for
        self.logits(&last)?.get(0)?.to_vec1::<f32>()
    }

    /// [`feed`](Self::feed), returning the logits after every token fed: (t, V).
    pub fn feed_all(&mut self, tokens: &[u32]) -> CResult<Tensor> {
        let mut logits = Vec::new();
        for chunk in tokens.chunks(self.chunk(tokens.len())) {
            let hidden = self.blocks(chunk)?; // (1, c, d)
            logits.push(self.logits(&hidden)?); // (c, V)
        }
        if logits.is_empty() {
            candle_core::bail!("generate: nothing to feed");
        }
        Tensor::cat(&logits, 0) // (t, V)
    }

    /// Rows fed at once when `t` more tokens come ([`prompt_chunk`]).
    fn chunk(&self, t: usize) -> usize {
        prompt_chunk(self.model.spec().heads, self.len + t).min(self.max_chunk)
    }

    /// Embeds `tokens` at the next positions and runs every block on them: (1, t, d).
    fn blocks(&mut self, tokens: &[u32]) -> CResult<Tensor> {
        let t = tokens.len();
        if t == 0 {
            candle_core::bail!("generate: nothing to feed");
        }
        if self.len + t > self.max_len {
            candle_core::bail!("generate: {} positions asked of a generator made for {}", self.len + t, self.max_len);
        }
        let ids = Tensor::from_vec(tokens.to_vec(), (1, t), &self.model.device())?; // (1, t)
        let mut x = self.model.embed(&self.weights, &ids)?; // (1, t, d)
        let positions: Arc<[u32]> = (self.len..self.len + t).map(|p| p as u32).collect();
        for i in 0..self.model.spec().layers {
            x = self.block(i, &x, &positions)?;
        }
        self.len += t;
        Ok(x)
    }

    /// The final norm and the LM head on `x` (1, t, d): (t, V).
    fn logits(&self, x: &Tensor) -> CResult<Tensor> {
        let (spec, w) = (self.model.spec(), &self.weights);
        let t = x.dims3()?.1;
        let normed = rms_norm(x, &w[self.index.final_norm], spec.eps)?.reshape((t, spec.hidden))?; // (t, d)
        linear(&normed, &w[self.index.head], self.model.threads()) // (t, V)
    }

    /// Block `i` on `x` (1, t, d) at `positions`, its keys and values added to the cache.
    fn block(&mut self, i: usize, x: &Tensor, positions: &Arc<[u32]>) -> CResult<Tensor> {
        let spec = self.model.spec();
        let (w, th) = (&self.weights, self.model.threads());
        let bi = &self.index.blocks[i];
        let (_, t, d) = x.dims3()?;
        let (h, hkv) = (spec.heads, spec.kv_heads);

        let normed = rms_norm(x, &w[bi.attn_norm], spec.eps)?.reshape((t, d))?; // (t, d)
        let q = projection(&normed, w, bi.q, bi.qkv_bias[0], th)?; // (t, H·D)
        let k = projection(&normed, w, bi.k, bi.qkv_bias[1], th)?; // (t, Hkv·D)
        let v = projection(&normed, w, bi.v, bi.qkv_bias[2], th)?; // (t, Hkv·D)
        let q = split_heads(&q, 1, t, h, Some(&self.rope), Some(positions))?; // (1, H, t, D)
        let k = split_heads(&k, 1, t, hkv, Some(&self.rope), Some(positions))?; // (1, Hkv, t, D)
        let v = split_heads(&v, 1, t, hkv, None, None)?; // (1, Hkv, t, D)
        let (k, v) = match self.cache[i].take() {
            Some(c) => (Tensor::cat(&[&c.k, &k], 2)?, Tensor::cat(&[&c.v, &v], 2)?), // (1, Hkv, P + t, D)
            None => (k, v),
        };
        let attn = self.attend(&q, &k, &v)?; // (1, H, t, D)
        self.cache[i] = Some(Cached { k, v });
        let attn = merge_heads(&attn)?; // (t, H·D)
        let x = add(x, &projection(&attn, w, bi.o, bi.o_bias, th)?.reshape((1, t, d))?)?; // (1, t, d)

        let normed = rms_norm(&x, &w[bi.mlp_norm], spec.eps)?.reshape((t, d))?; // (t, d)
        let mlp = match &bi.mlp {
            MlpIndex::Dense { gate, up, down, bias } => {
                let hidden = swiglu_gate(
                    &projection(&normed, w, *gate, bias[0], th)?,
                    &projection(&normed, w, *up, bias[1], th)?,
                )?; // (t, F)
                projection(&hidden, w, *down, bias[2], th)?
            }
            MlpIndex::Moe { router, experts, top_k } => moe(&normed, &w[*router], experts, *top_k, w, th)?.0,
        }; // (t, d)
        add(&x, &mlp.reshape((1, t, d))?)
    }

    /// Causal attention of the `t` new queries (1, H, t, D) over every cached key and value
    /// (1, Hkv, L, D), the new ones last: query j (position L − t + j) sees keys up to its own
    /// position, and within the model's sliding window (`p − window < key`) when it has one.
    fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> CResult<Tensor> {
        let spec = self.model.spec();
        let (_, h, t, hd) = q.dims4()?;
        let (_, hkv, l, _) = k.dims4()?;
        // Grouped-query attention: each key/value head serves h / hkv query heads, as
        // transformers' repeat_kv lays them out (query head i reads key head i / group).
        let group = h / hkv;
        let repeat = |x: &Tensor| -> CResult<Tensor> {
            if group == 1 {
                return Ok(x.clone());
            }
            x.unsqueeze(2)?.broadcast_as((1, hkv, group, l, hd))?.reshape((1, h, l, hd)) // (1, H, L, D)
        };
        let (k, v) = (repeat(k)?, repeat(v)?);
        let scale = 1.0 / (hd as f64).sqrt();
        let scores = (q.contiguous()?.matmul(&k.t()?.contiguous()?)? * scale)?; // (1, H, t, L)
        let first = l - t;
        let window = spec.sliding_window.unwrap_or(usize::MAX);
        let mask: Vec<f32> = (0..t)
            .flat_map(|j| {
                let p = first + j;
                (0..l).map(move |key| if key <= p && p - key < window { 0.0 } else { f32::NEG_INFINITY })
            })
            .collect();
        let mask = Tensor::from_vec(mask, (t, l), scores.device())?; // (t, L)
        let probs = softmax_last(&scores.broadcast_add(&mask)?)?; // (1, H, t, L)
        probs.matmul(&v.contiguous()?) // (1, H, t, D)
    }
}

/// How the next token is picked from the logits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// 0: greedy (the most likely token; ties to the lowest id). Otherwise the logits are
    /// divided by it before the softmax.
    pub temperature: f64,
    /// Keep only the `top_k` most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probabilities reach `top_p` (1: all).
    pub top_p: f64,
    /// The seed of the draws.
    pub seed: u64,
}

impl Default for Sampling {
    fn default() -> Self {
        Self { temperature: 0.0, top_k: 0, top_p: 1.0, seed: 0 }
    }
}

/// Picks tokens from logits as [`Sampling`] says, with its own SplitMix64 stream.
#[derive(Debug, Clone)]
pub struct Sampler {
    sampling: Sampling,
    state: u64,
}

impl Sampler {
    /// A sampler whose draws start from `sampling.seed`.
    pub fn new(sampling: Sampling) -> Self {
        Self { sampling, state: sampling.seed }
    }

    /// A uniform draw in [0, 1).
    fn uniform(&mut self) -> f64 {
        (ava_data::splitmix64(&mut self.state) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// The next token for `logits` (one per vocabulary entry).
    pub fn pick(&mut self, logits: &[f32]) -> u32 {
        let s = self.sampling;
        if s.temperature <= 0.0 {
            return argmax(logits);
        }
        // Candidates, most likely first (ties to the lower id), cut to top-k.
        let mut order: Vec<usize> = (0..logits.len()).filter(|&i| logits[i].is_finite()).collect();
        if order.is_empty() {
            return argmax(logits);
        }
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        if s.top_k > 0 {
            order.truncate(s.top_k);
        }
        let top = f64::from(logits[order[0]]);
        let mut probs: Vec<f64> = order.iter().map(|&i| ((f64::from(logits[i]) - top) / s.temperature).exp()).collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
        // Top-p: the shortest head of the ranking whose mass reaches top_p.
        if s.top_p < 1.0 {
            let mut mass = 0.0;
            let keep = probs.iter().position(|p| {
                mass += p;
                mass >= s.top_p
            });
            let keep = keep.map_or(probs.len(), |i| i + 1);
            probs.truncate(keep);
            order.truncate(keep);
            let total: f64 = probs.iter().sum();
            probs.iter_mut().for_each(|p| *p /= total);
        }
        let mut u = self.uniform();
        for (&i, &p) in order.iter().zip(&probs) {
            if u < p {
                return i as u32;
            }
            u -= p;
        }
        order[order.len() - 1] as u32
    }
}

/// The index of the largest value (the lowest index among equals; NaN never wins).
pub fn argmax(values: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] || values[best].is_nan() {
            best = i;
        }
    }
    best as u32
}

/// Why generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// `max_tokens` were generated.
    Length,
    /// The end-of-text token was generated (it is not part of the text).
    EndOfText,
}

/// Generates up to `max_tokens` tokens after `prompt` (at least one token), stopping early
/// at `eos` when given; `on_token` sees each one as it is picked (to print it). Returns the
/// new tokens (without the end-of-text) and why it stopped. The prompt and the tokens asked
/// for must fit in `context` positions and the machine's memory ([`check_positions`]).
pub fn generate(
    model: &Model,
    prompt: &[u32],
    max_tokens: usize,
    context: usize,
    sampling: Sampling,
    eos: Option<u32>,
    on_token: &mut dyn FnMut(u32),
) -> Result<(Vec<u32>, Stop), ModelError> {
    if prompt.is_empty() {
        return Err(ModelError::Generate("the prompt has no tokens: give some text (or a token to start from)".into()));
    }
    if let Some(&bad) = prompt.iter().find(|&&id| id as usize >= model.spec().vocab) {
        return Err(ModelError::Generate(format!(
            "the prompt holds token id {bad}, outside the model's vocabulary of {}: the tokenizer is not the model's",
            model.spec().vocab
        )));
    }
    let positions = check_positions(model.spec(), context, prompt.len(), max_tokens)?;
    let mut generator = Generator::new(model, positions)?;
    let mut sampler = Sampler::new(sampling);
    let mut out = Vec::new();
    let mut logits = generator.feed(prompt).map_err(cerr)?;
    while out.len() < max_tokens {
        let next = sampler.pick(&logits);
        if Some(next) == eos {
            return Ok((out, Stop::EndOfText));
        }
        out.push(next);
        on_token(next);
        if out.len() == max_tokens {
            break;
        }
        logits = generator.feed(&[next]).map_err(cerr)?;
    }
    Ok((out, Stop::Length))
}

/// How an error says what the model's context is.
pub fn context_note(spec: &ModelSpec, context: usize) -> String {
    format!(
        "the model's context is {context} positions (its max_position_embeddings, transformers' default for {} where \
         config.json has none, or the sequence length it was trained at when longer)",
        spec.arch.model_type()
    )
}

/// The positions a prompt of `prompt` tokens and `more` tokens after it take, checked against
/// `context` and, where the system says, the memory the machine has left
/// ([`generator_bytes`]); an error says which check failed and what to ask for instead.
pub fn check_positions(spec: &ModelSpec, context: usize, prompt: usize, more: usize) -> Result<usize, ModelError> {
    if prompt >= context {
        return Err(ModelError::Generate(format!(
            "the prompt is {prompt} tokens and {}: shorten the prompt to fewer than {context} tokens",
            context_note(spec, context)
        )));
    }
    let positions = match prompt.checked_add(more) {
        Some(n) if n <= context => n,
        _ => {
            return Err(ModelError::Generate(format!(
                "{more} tokens after a prompt of {prompt} need {} positions, but {}: generate at most {} tokens \
                 (--max-tokens)",
                prompt as u128 + more as u128,
                context_note(spec, context),
                context - prompt
            )));
        }
    };
    let need = generator_bytes(spec, positions);
    if let Some(available) = crate::memory::available_bytes()
        && need > available
    {
        // The most positions that fit, by halving what comes after the prompt.
        let mut fits = positions;
        while fits > prompt + 1 && generator_bytes(spec, fits) > available {
            fits = prompt + (fits - prompt) / 2;
        }
        return Err(ModelError::Generate(format!(
            "{positions} positions need {:.2} GiB beside the weights (the key/value cache of {} blocks, the rotary \
             tables, a chunk's attention), but the machine has {:.2} GiB available: generate fewer tokens (about {} \
             fit), or free memory",
            crate::memory::gib(need),
            spec.layers,
            crate::memory::gib(available),
            fits.saturating_sub(prompt)
        )));
    }
    Ok(positions)
}
