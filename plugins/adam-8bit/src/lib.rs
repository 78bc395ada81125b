//! # Block-wise 8-bit AdamW as an Ava plugin
//!
//! Dettmers et al. 2021, *8-bit Optimizers via Block-wise Quantization*: Adam's two moments
//! are stored as one byte per element each, plus one f32 absolute maximum per block of
//! `block_size` elements and moment — 2 + 8/block_size bytes of state per parameter instead
//! of AdamW's 8 (2.03 at the default block of 256).
//!
//! Each step, per block and element:
//!
//! ```text
//! m = signed[m_code]·absmax_m          v = unsigned[v_code]·absmax_v      dequantize
//! m ← β1·m + (1 − β1)·g                v ← β2·v + (1 − β2)·g²             fp32 Adam
//! θ ← θ·(1 − lr·λ) − (lr/bc1·√bc2)·m / (√v + ε·√bc2)                     AdamW
//! absmax_m = max|m|  absmax_v = max v  m_code = nearest(m/absmax_m)  ...  requantize
//! ```
//!
//! The update uses the fresh fp32 moments; only what is kept between steps is 8-bit. It is
//! torch's `lr/bc1 · m / (√v/√bc2 + ε)` with √bc2 moved out of the denominator: one
//! division per element instead of two. (The fp32 path below keeps torch's exact form.) The
//! maps are the dynamic tree maps of [`quant`]: signed for m, unsigned for v (which is never
//! negative, so the sign bit buys one more bit of fraction).
//!
//! Tensors with fewer than `min_8bit_size` elements (norm gains, biases: a negligible share
//! of the memory, but sensitive) and parameters named in `fp32_state` (the paper's advice
//! for embeddings, which bitsandbytes pairs with its "stable embedding") keep fp32 moments
//! and are updated exactly as `adamw` does.
//!
//! `percentile_clipping: p < 100` keeps each parameter's last 100 squared gradient norms and
//! scales the gradient down to the p-th percentile of them when it is larger — a clipping
//! threshold that adapts to the run (the paper's section on stability; bitsandbytes' option
//! of the same name). During the first 100 steps the percentile is taken over the norms
//! seen so far.
//!
//! Bias correction counts each parameter's own steps (`step` in its state), so resumed runs
//! and skipped steps stay exact.
//!
//! Built with the `cuda` feature it also steps on NVIDIA GPUs (`step_cuda`:
//! kernels/adam_8bit.cu, one thread block per quantization block, launched through
//! `ava_kernels::cuda` on the host's stream) and its manifest lists the cuda device, so
//! `train.device: cuda` can use it. The state is the same bytes on both devices and a GPU
//! step gives the CPU's bits (the `gpu` module says how, and its exception: a gradient
//! holding a NaN or an infinity), so a checkpoint moves between devices without changing the run.

#[cfg(feature = "cuda")]
mod gpu;
mod kernel;
pub mod quant;

use ava_core::{error::expect_len, prelude::*};
use kernel::Scalars;
use quant::QuantMap;

/// Gradient norms remembered per parameter for percentile clipping.
pub const HISTORY: usize = 100;

/// The largest block; the step keeps one block of fp32 moments on the stack.
pub const MAX_BLOCK: usize = 4096;

/// Elements per thread below which a tensor is updated on the calling thread alone:
/// starting a thread costs about what updating a few thousand elements does (~3 ns each),
/// so 32k per thread keeps that overhead small. Measured with `ava bench optimizer
/// --threads 2` (d 384: q/k/v/o tensors of 147k split too): 2.0–2.6× adamw's step time
/// against 2.4–2.9× with 128k per thread.
const MIN_PER_THREAD: usize = 1 << 15;

/// 8-bit AdamW's hyper-parameters and its two quantization maps (the state lives in the
/// host's buffers).
#[derive(Debug, Clone)]
pub struct Adam8bit {
    /// Decay of the first moment.
    pub beta1: f64,
    /// Decay of the second moment.
    pub beta2: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// Elements per absmax.
    pub block_size: usize,
    /// Smaller tensors keep fp32 state.
    pub min_8bit_size: usize,
    /// Percentile of the recent gradient norms to clip at; 100 = off.
    pub percentile_clipping: u32,
    /// Parameters whose name contains one of these keep fp32 state.
    pub fp32_state: Vec<String>,
    signed: QuantMap,
    unsigned: QuantMap,
}

impl Default for Adam8bit {
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            block_size: 256,
            min_8bit_size: 4096,
            percentile_clipping: 100,
            fp32_state: Vec::new(),
            signed: QuantMap::signed(),
            unsigned: QuantMap::unsigned(),
        }
    }
}

impl PartialEq for Adam8bit {
    fn eq(&self, o: &Self) -> bool {
        (self.beta1, self.beta2, self.eps, self.block_size, self.min_8bit_size, self.percentile_clipping)
            == (o.beta1, o.beta2, o.eps, o.block_size, o.min_8bit_size, o.percentile_clipping)
            && self.fp32_state == o.fp32_state
    }
}

impl Plugin for Adam8bit {
    fn manifest() -> Manifest {
        Manifest::new(
            "adam-8bit",
            PluginKind::Optimizer,
            env!("CARGO_PKG_VERSION"),
            "8-bit AdamW: moments as 1-byte dynamic-tree codes with one f32 absmax per block, ~2 bytes of state per parameter (Dettmers et al. 2021)",
        )
        .devices(if cfg!(feature = "cuda") { &[Device::Cpu, Device::Cuda] } else { &[Device::Cpu] })
        .option(OptionSpec::float_list("betas", &[0.9, 0.999], "[β1, β2]: decay rates of the first and second moments"))
        .option(OptionSpec::float("eps", 1e-8, "added to the denominator √v̂ for numerical stability"))
        .option(OptionSpec::int(
            "block_size",
            256,
            "elements sharing one absmax: a power of two from 64 to 4096. Memory: 8/block_size bytes per parameter (256: 0.03; bitsandbytes first used 2048)",
        ))
        .option(OptionSpec::int(
            "min_8bit_size",
            4096,
            "tensors with fewer elements keep fp32 moments (8 bytes per parameter), e.g. norm gains",
        ))
        .option(OptionSpec::int(
            "percentile_clipping",
            100,
            "clip each gradient at this percentile of its last 100 norms (1-100; 100 = off). Memory: 400 bytes per tensor when on",
        ))
        .option(OptionSpec::new(
            "fp32_state",
            OptionType::StringList,
            "[]",
            "parameters whose name contains one of these keep fp32 moments, e.g. [embed_tokens] (the paper's advice for embeddings). Memory: 8 bytes per parameter of those",
        ))
    }

    fn from_options(mut options: Options) -> Result<Self, PluginError> {
        let [beta1, beta2] = options.betas("betas");
        let eps = options.float("eps");
        options.check(eps > 0.0, || format!("option 'eps': {eps} must be > 0"));
        let block = options.int("block_size");
        options.check((64..=MAX_BLOCK as i64).contains(&block) && (block as u64).is_power_of_two(), || {
            format!("option 'block_size': {block} must be a power of two from 64 to {MAX_BLOCK} (e.g. 256 or 2048)")
        });
        let min_size = options.int("min_8bit_size");
        options.check(min_size >= 0, || format!("option 'min_8bit_size': {min_size} must be >= 0"));
        let p = options.int("percentile_clipping");
        options.check((1..=100).contains(&p), || {
            format!("option 'percentile_clipping': {p} must be in 1..=100 (100 turns clipping off)")
        });
        let fp32_state = options.string_list("fp32_state");
        for name in &fp32_state {
            options.check(!name.is_empty(), || "option 'fp32_state': an empty name would match every parameter".into());
        }
        options.finish()?;
        Ok(Adam8bit {
            beta1,
            beta2,
            eps,
            block_size: block as usize,
            min_8bit_size: min_size as usize,
            percentile_clipping: p as u32,
            fp32_state,
            ..Adam8bit::default()
        })
    }
}

/// How a parameter's state is kept (decided from its name and size alone, so the layout
/// and every step agree).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Kind {
    eight_bit: bool,
    clipping: bool,
}

impl Adam8bit {
    fn kind(&self, param: &ParamInfo<'_>) -> Kind {
        let forced = self.fp32_state.iter().any(|s| param.name.as_str().contains(s.as_str()));
        Kind { eight_bit: !forced && param.numel() >= self.min_8bit_size, clipping: self.percentile_clipping < 100 }
    }

    /// Whether `param` gets 8-bit state.
    pub fn is_8bit(&self, param: &ParamInfo<'_>) -> bool {
        self.kind(param).eight_bit
    }

    /// How many state buffers the layout has for a parameter of `kind`.
    fn buffers(kind: Kind) -> usize {
        3 + 2 * usize::from(kind.eight_bit) + usize::from(kind.clipping)
    }

    /// The error for `got` state buffers where the layout of a `kind` parameter has another
    /// number.
    fn wrong_state(param: &ParamInfo<'_>, kind: Kind, got: usize) -> PluginError {
        PluginError::invalid_input(format!(
            "adam-8bit expects {} state buffers for {} ({}), got {got}",
            Self::buffers(kind),
            param.name,
            if kind.eight_bit { "8-bit" } else { "fp32" },
        ))
    }
}

impl Optimizer for Adam8bit {
    fn state_layout(&self, param: &ParamInfo<'_>) -> Result<Vec<StateSpec>, PluginError> {
        let n = param.numel();
        let kind = self.kind(param);
        let mut layout = if kind.eight_bit {
            let blocks = n.div_ceil(self.block_size);
            vec![
                StateSpec::new("exp_avg", DType::U8, n),
                StateSpec::new("exp_avg_sq", DType::U8, n),
                StateSpec::new("absmax_exp_avg", DType::F32, blocks),
                StateSpec::new("absmax_exp_avg_sq", DType::F32, blocks),
            ]
        } else {
            vec![StateSpec::new("exp_avg", DType::F32, n), StateSpec::new("exp_avg_sq", DType::F32, n)]
        };
        layout.push(StateSpec::new("step", DType::U32, 1));
        if kind.clipping {
            layout.push(StateSpec::new("grad_norm_history", DType::F32, HISTORY));
        }
        Ok(layout)
    }

    fn step(
        &mut self,
        param: &ParamInfo<'_>,
        values: &mut [f32],
        grad: &[f32],
        state: &mut [StateBuf<'_>],
        ctx: &StepContext,
    ) -> Result<(), PluginError> {
        let n = param.numel();
        expect_len("values", values.len(), n)?;
        expect_len("grad", grad.len(), n)?;
        let kind = self.kind(param);
        if state.len() != Self::buffers(kind) {
            return Err(Self::wrong_state(param, kind, state.len()));
        }
        let (moments, rest) = state.split_at_mut(if kind.eight_bit { 4 } else { 2 });
        let (step_buf, history) = rest.split_at_mut(1);
        let step = step_buf[0].u32()?;
        expect_len("step", step.len(), 1)?;
        let history = match history.first_mut() {
            Some(h) => {
                let h = h.f32()?;
                expect_len("grad_norm_history", h.len(), HISTORY)?;
                Some(h)
            }
            None => None,
        };
        // Check every buffer before touching anything, so a refused step changes nothing.
        let moments = if kind.eight_bit {
            let [m, v, am, av] = moments else { unreachable!("split at 4") };
            let (m, v, am, av) = (m.u8()?, v.u8()?, am.f32()?, av.f32()?);
            expect_len("exp_avg", m.len(), n)?;
            expect_len("exp_avg_sq", v.len(), n)?;
            let blocks = n.div_ceil(self.block_size);
            expect_len("absmax_exp_avg", am.len(), blocks)?;
            expect_len("absmax_exp_avg_sq", av.len(), blocks)?;
            Moments::Quantized { m, v, am, av }
        } else {
            let [m, v] = moments else { unreachable!("split at 2") };
            let (m, v) = (m.f32()?, v.f32()?);
            expect_len("exp_avg", m.len(), n)?;
            expect_len("exp_avg_sq", v.len(), n)?;
            Moments::Full { m, v }
        };

        let t = step[0].saturating_add(1);
        step[0] = t;
        let clip = match history {
            Some(h) => percentile_scale(h, t, grad, self.percentile_clipping),
            None => 1.0,
        };
        let s = Scalars::new(self, t, ctx, clip);
        let threads = (ctx.threads.max(1) as usize).min(n / MIN_PER_THREAD).max(1);
        match moments {
            Moments::Full { m, v } => s.full(values, grad, m, v),
            Moments::Quantized { m, v, am, av } => {
                let block = self.block_size;
                if threads == 1 {
                    s.quantized(&self.signed, &self.unsigned, block, values, grad, m, v, am, av);
                } else {
                    // Whole blocks per thread, so every absmax has one owner.
                    let per = n.div_ceil(block).div_ceil(threads) * block;
                    std::thread::scope(|scope| {
                        let parts = values
                            .chunks_mut(per)
                            .zip(grad.chunks(per))
                            .zip(m.chunks_mut(per))
                            .zip(v.chunks_mut(per))
                            .zip(am.chunks_mut(per / block))
                            .zip(av.chunks_mut(per / block));
                        for (((((w, g), m), v), am), av) in parts {
                            let (signed, unsigned, s) = (&self.signed, &self.unsigned, &s);
                            scope.spawn(move || s.quantized(signed, unsigned, block, w, g, m, v, am, av));
                        }
                    });
                }
            }
        }
        Ok(())
    }

    /// The same step on the GPU, with the same state bytes and the same bits: see the `gpu`
    /// module.
    #[cfg(feature = "cuda")]
    fn step_cuda(
        &mut self,
        param: &ParamInfo<'_>,
        values: &CudaBuf,
        grad: &CudaBuf,
        state: &[CudaBuf],
        ctx: &StepContext,
        stream: &CudaStream,
    ) -> Result<(), PluginError> {
        gpu::step(self, param, values, grad, state, ctx, stream)
    }
}

/// A parameter's moments, checked and typed.
enum Moments<'a> {
    Full { m: &'a mut [f32], v: &'a mut [f32] },
    Quantized { m: &'a mut [u8], v: &'a mut [u8], am: &'a mut [f32], av: &'a mut [f32] },
}

impl Scalars {
    fn new(o: &Adam8bit, t: u32, ctx: &StepContext, clip: f32) -> Self {
        let t = i32::try_from(t).unwrap_or(i32::MAX);
        let bc2_sqrt = (1.0 - o.beta2.powi(t)).sqrt();
        Self {
            b1: o.beta1 as f32,
            b2: o.beta2 as f32,
            eps: o.eps as f32,
            step_size: (ctx.lr / (1.0 - o.beta1.powi(t))) as f32,
            bc2_sqrt: bc2_sqrt as f32,
            step_bc2: (ctx.lr / (1.0 - o.beta1.powi(t)) * bc2_sqrt) as f32,
            eps_bc2: (o.eps * bc2_sqrt) as f32,
            decay: (1.0 - ctx.lr * ctx.weight_decay) as f32,
            clip,
        }
    }

    fn full(&self, values: &mut [f32], grad: &[f32], m: &mut [f32], v: &mut [f32]) {
        for (((w, &g), m), v) in values.iter_mut().zip(grad).zip(m.iter_mut()).zip(v.iter_mut()) {
            (*m, *v) = self.adam(w, g, *m, *v);
        }
    }

    /// Dequantize, update and requantize whole blocks of `block` elements (the last may be
    /// shorter).
    #[allow(clippy::too_many_arguments)]
    fn quantized(
        &self,
        signed: &QuantMap,
        unsigned: &QuantMap,
        block: usize,
        values: &mut [f32],
        grad: &[f32],
        m_codes: &mut [u8],
        v_codes: &mut [u8],
        absmax_m: &mut [f32],
        absmax_v: &mut [f32],
    ) {
        let mut m_new = [0f32; MAX_BLOCK]; // (block,) this block's fp32 first moments
        let mut v_new = [0f32; MAX_BLOCK]; // (block,) and second moments
        let blocks = values
            .chunks_mut(block)
            .zip(grad.chunks(block))
            .zip(m_codes.chunks_mut(block))
            .zip(v_codes.chunks_mut(block))
            .zip(absmax_m.iter_mut().zip(absmax_v.iter_mut()));
        for ((((w, g), mc), vc), (am, av)) in blocks {
            let len = w.len();
            let (ms, vs) = (&mut m_new[..len], &mut v_new[..len]);
            let (max_m, max_v) = kernel::update_block(self, signed, unsigned, w, g, mc, vc, *am, *av, ms, vs);
            *am = max_m;
            *av = max_v;
            // Below the normal range 1/max overflows; such a block is stored as zeros.
            let inv_m = if max_m >= f32::MIN_POSITIVE { 1.0 / max_m } else { 0.0 };
            let inv_v = if max_v >= f32::MIN_POSITIVE { 1.0 / max_v } else { 0.0 };
            kernel::encode_moments(signed, ms, inv_m, mc, unsigned, vs, inv_v, vc);
        }
    }
}

/// Records this step's squared gradient norm in `history` (a ring of the last 100) and
/// returns the factor that brings the norm down to the `p`-th percentile of the recorded
/// ones, or 1 if it is not above it.
fn percentile_scale(history: &mut [f32], t: u32, grad: &[f32], p: u32) -> f32 {
    let norm2 = sum_of_squares(grad);
    history[(t as usize - 1) % HISTORY] = norm2 as f32;
    let seen = (t as usize).min(HISTORY);
    let mut sorted = [0f32; HISTORY];
    sorted[..seen].copy_from_slice(&history[..seen]);
    sorted[..seen].sort_unstable_by(f32::total_cmp);
    let limit = f64::from(sorted[(p as usize * seen / 100).min(seen - 1)]);
    if norm2 > limit && norm2 > 0.0 { (limit / norm2).sqrt() as f32 } else { 1.0 }
}

/// The fan-in of [`sum_of_squares`]' tree.
const SUM_FAN: usize = ava_core::math::TREE_FAN;

/// Σ g² in f64, added in one fixed order that a GPU can follow in parallel (the `cuda`
/// step's kernels/adam_8bit.cu adds in exactly this order, so both give the same bits): the
/// squares of each 32 consecutive elements in index order, then each 32 consecutive such sums
/// in order, and so on up a 32-ary tree to one value. A short last group adds what it has
/// (the GPU adds zeros in its place, which changes no sum: none is −0). The squares are exact
/// in f64. Kept as one running sum per level, so no memory is allocated.
fn sum_of_squares(grad: &[f32]) -> f64 {
    // The sums of 32 squares, then ava-core's tree over them (the tree's first level here).
    let mut tree = ava_core::math::TreeSum::default();
    for chunk in grad.chunks(SUM_FAN) {
        let mut sum = 0.0;
        for &g in chunk {
            sum += f64::from(g) * f64::from(g);
        }
        tree.push(sum);
    }
    tree.sum()
}

ava_core::export_plugin!(optimizer: Adam8bit);

#[cfg(test)]
mod tests;
