//! # Adam-mini as an Ava optimizer plugin
//!
//! Adam-mini (Zhang et al. 2024, *Adam-mini: Use Fewer Learning Rates To Gain More*) keeps
//! Adam's first moment `m` for every element but only ONE second-moment scalar per block of
//! parameters: the running average of the block's mean squared gradient. Every element of a
//! block therefore shares one effective learning rate, and `v` shrinks from one float per
//! element to a handful per tensor.
//!
//! With `t` the parameter's own step count, `bc1 = 1 − β1ᵗ`, `bc2 = 1 − β2ᵗ`, `lr` and the
//! weight decay `λ` from the trainer, each step computes (AdamW's arrangement, as torch does):
//!
//! ```text
//! m   ← β1·m + (1 − β1)·g                                 per element
//! v_b ← β2·v_b + (1 − β2)·mean_{i∈b}(g_i²)                per block b
//! θ   ← θ·(1 − lr·λ) − (lr/bc1)·m / (√v_b/√bc2 + ε)       per element, v_b of its block
//! ```
//!
//! With every block of size 1 this is exactly AdamW.
//!
//! ## Partition (the paper's, for Transformers)
//!
//! | parameter                                                         | one block is                    | blocks per tensor |
//! |-------------------------------------------------------------------|---------------------------------|-------------------|
//! | name contains an entry of `adam_names`                            | one element (plain Adam)        | numel             |
//! | `q_proj` / `k_proj` weight (also `wq` / `wk`), `[heads·head_dim, d]` | one attention head: `head_dim` rows | heads         |
//! | any other matrix: `v_proj`, `o_proj`, MLP `gate/up/down_proj`, MoE router and experts, `embed_tokens`, `lm_head` | one output neuron (for the embedding and head: one token) = one row | rows |
//! | vectors (norm gains, biases) and tensors of any other rank         | the whole tensor                | 1                 |
//!
//! The query/key rule matches a dot-separated segment of the name exactly (`q_proj`, `k_proj`,
//! `wq`, `wk`), so that e.g. `block_proj` is not taken for a key projection. `head_dim` is
//! filled in by the engine from the model; a q/k weight without it is refused.
//!
//! The official implementation keeps Adam's per-element `v` for the embedding and output
//! layers; `adam_names: [embed_tokens, lm_head]` reproduces that, at the cost of 4 more bytes
//! per parameter of those tensors.
//!
//! ## Memory
//!
//! Per parameter: 4 bytes of `m` plus `4·blocks/numel` bytes of `v` (plus one `u32` step
//! count per tensor): ≈ 4 + 4/d bytes for an `[out, d]` matrix, 4 + 4/(head_dim·d) for a
//! query/key weight, against AdamW's 8.
//!
//! ## Why it works
//!
//! The paper observes that the Hessian of a Transformer's loss is close to block-diagonal,
//! with one dense block per attention head (queries, keys) or per output neuron (everything
//! else). Within such a dense block no per-coordinate rescaling helps much, so one well-chosen
//! learning rate per block (from its average g²) does as well as Adam's per-element ones.
//!
//! ## State
//!
//! `exp_avg` (f32, numel), `exp_avg_sq` (f32, one per block), `step` (u32, 1: the
//! parameter's own step count, so resumed runs and parameters that start later stay exact).
//!
//! ## On the GPU
//!
//! Built with the `cuda` feature it also steps on NVIDIA GPUs (`step_cuda`: the `gpu` module,
//! kernels/adam_mini.cu, launched through `ava_kernels::cuda` on the host's stream) and its
//! manifest lists the cuda device, so `train.device: cuda` can use it. A block's Σ g² is
//! added in one fixed order on both devices (`sum_sq`), the other operations are the same
//! f32/f64 operations in the same order, and the state is the same bytes: a step on the GPU
//! gives the CPU's bits and a checkpoint moves between devices without changing the run
//! (tests/gpu_adam_mini.rs checks it on a GPU).

#[cfg(feature = "cuda")]
mod gpu;

use ava_core::{error::expect_len, prelude::*};

/// Adam-mini's hyper-parameters (the state lives in the host's buffers).
#[derive(Debug, Clone, PartialEq)]
pub struct AdamMini {
    /// Decay of the first moment.
    pub beta1: f64,
    /// Decay of the per-block second moment.
    pub beta2: f64,
    /// Added to the denominator for numerical stability.
    pub eps: f64,
    /// Rows per attention head of the query and key weights; needed when the model has them.
    pub head_dim: Option<usize>,
    /// Parameters whose name contains one of these get Adam's per-element second moment.
    pub adam_names: Vec<String>,
}

impl Default for AdamMini {
    fn default() -> Self {
        Self { beta1: 0.9, beta2: 0.999, eps: 1e-8, head_dim: None, adam_names: Vec::new() }
    }
}

impl Plugin for AdamMini {
    fn manifest() -> Manifest {
        Manifest::new(
            "adam-mini",
            PluginKind::Optimizer,
            env!("CARGO_PKG_VERSION"),
            "Adam-mini: Adam with one second-moment scalar per head/neuron block; ~4 bytes of state per parameter (Zhang et al. 2024)",
        )
        .devices(if cfg!(feature = "cuda") { &[Device::Cpu, Device::Cuda] } else { &[Device::Cpu] })
        .option(OptionSpec::float_list(
            "betas",
            &[0.9, 0.999],
            "[β1, β2]: decay rates of the first moment and of the per-block second moment",
        ))
        .option(OptionSpec::float("eps", 1e-8, "added to the denominator √v̂ for numerical stability"))
        .option(OptionSpec::optional(
            "head_dim",
            OptionType::Int,
            "rows per attention head of q_proj/k_proj (one block each); filled in from the model",
        ))
        .option(OptionSpec::new(
            "adam_names",
            OptionType::StringList,
            "[]",
            "parameters whose name contains one of these get Adam's per-element v, e.g. [embed_tokens, lm_head]",
        ))
    }

    fn from_options(mut options: Options) -> Result<Self, PluginError> {
        let [beta1, beta2] = options.betas("betas");
        let eps = options.float("eps");
        options.check(eps > 0.0, || format!("option 'eps': {eps} must be > 0"));
        let head_dim = options.opt_int("head_dim");
        if let Some(h) = head_dim {
            options.check(h >= 1, || format!("option 'head_dim': {h} must be ≥ 1"));
        }
        let adam_names = options.string_list("adam_names");
        for (i, s) in adam_names.iter().enumerate() {
            options.check(!s.is_empty(), || {
                format!("option 'adam_names': item {i} is empty (it would match every parameter)")
            });
        }
        options.finish()?;
        Ok(AdamMini { beta1, beta2, eps, head_dim: head_dim.map(|h| h as usize), adam_names })
    }
}

/// How a parameter is cut into blocks of equal size: `count` blocks of `size` consecutive
/// elements (`size·count = numel`; `size ≥ 1` also for empty tensors).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Partition {
    size: usize,
    count: usize,
}

impl Partition {
    fn of(size: usize, numel: usize) -> Self {
        if numel == 0 || size == 0 { Partition { size: 1, count: 0 } } else { Partition { size, count: numel / size } }
    }
}

/// Whether `name` is a query or key projection: one of its dot-separated segments is
/// `q_proj`, `k_proj`, `wq` or `wk`.
fn is_query_or_key(name: &str) -> bool {
    name.split('.').any(|s| matches!(s, "q_proj" | "k_proj" | "wq" | "wk"))
}

impl AdamMini {
    /// The block partition of `param` (the one place it is decided; `state_layout` and
    /// `step` both call it).
    fn partition(&self, param: &ParamInfo<'_>) -> Result<Partition, PluginError> {
        let name = param.name.as_str();
        let shape = param.shape.as_slice();
        let numel = param.numel();
        if self.adam_names.iter().any(|a| name.contains(a.as_str())) {
            return Ok(Partition::of(1, numel));
        }
        let &[rows, cols] = shape else {
            // Vectors, scalars and other ranks: one block.
            return Ok(Partition::of(numel, numel));
        };
        let (rows, cols) = (rows as usize, cols as usize);
        if !is_query_or_key(name) {
            return Ok(Partition::of(cols, numel));
        }
        let Some(head_dim) = self.head_dim else {
            return Err(PluginError::invalid_input(format!(
                "adam-mini splits {name} into one block per attention head, but head_dim is not set; \
                 set plugins.optimizer.head_dim to the model's hidden_size / num_heads"
            )));
        };
        if rows % head_dim != 0 {
            return Err(PluginError::invalid_input(format!(
                "adam-mini: {name} has shape {shape:?}, whose {rows} rows do not split into heads of \
                 head_dim = {head_dim} rows"
            )));
        }
        Ok(Partition::of(head_dim * cols, numel))
    }
}

/// Prefixes a state buffer's type error with the buffer's name.
fn in_buffer(what: &'static str) -> impl FnOnce(PluginError) -> PluginError {
    move |e| PluginError::invalid_input(format!("adam-mini: state buffer '{what}': {}", e.message))
}

/// Lanes of a chunk's sum: a warp's threads on a GPU.
const LANES: usize = 32;

/// Elements per chunk of [`sum_sq`]: 32 in each of the 32 lanes.
const CHUNK: usize = LANES * 32;

/// Σ g² in f64, in one fixed order that a GPU follows in parallel (kernels/adam_mini.cu adds
/// in exactly this order, so both give the same bits). The blocks can be whole tensors
/// (millions of elements), where an f32 running sum loses digits in proportion to the
/// length; f64 keeps the mean exact to ~1e-16·n whatever the block size.
///
/// The block in chunks of [`CHUNK`] = 1024 elements; a chunk in 32 strided f64 lanes (lane k
/// adds the squares of elements k, k + 32, … in order, from 0; a warp's lanes on a GPU, and
/// independent accumulators here, which the compiler vectorizes), the lanes added in lane
/// order; the chunks' sums in a 32-ary tree (each 32 consecutive values added in order, and
/// so on up to one value; a short last group adds what it has), kept as one running sum per
/// level, so nothing is allocated. The pass only reads `g`, so it is bound by memory.
fn sum_sq(g: &[f32]) -> f64 {
    let mut tree = ava_core::math::TreeSum::default(); // over the chunks' sums
    for chunk in g.chunks(CHUNK) {
        let mut lanes = [0f64; LANES];
        let head = chunk.len() / LANES * LANES;
        for c in chunk[..head].chunks_exact(LANES) {
            for k in 0..LANES {
                let x = f64::from(c[k]);
                lanes[k] += x * x;
            }
        }
        for (k, &x) in chunk[head..].iter().enumerate() {
            lanes[k] += f64::from(x) * f64::from(x);
        }
        let mut value = 0.0;
        for l in lanes {
            value += l;
        }
        tree.push(value);
    }
    tree.sum()
}

impl Optimizer for AdamMini {
    fn state_layout(&self, param: &ParamInfo<'_>) -> Result<Vec<StateSpec>, PluginError> {
        let p = self.partition(param)?;
        Ok(vec![
            StateSpec::new("exp_avg", DType::F32, param.numel()),
            StateSpec::new("exp_avg_sq", DType::F32, p.count),
            StateSpec::new("step", DType::U32, 1),
        ])
    }

    fn step(
        &mut self,
        param: &ParamInfo<'_>,
        values: &mut [f32],
        grad: &[f32],
        state: &mut [StateBuf<'_>],
        ctx: &StepContext,
    ) -> Result<(), PluginError> {
        let Partition { size, count } = self.partition(param)?;
        let n = param.numel();
        expect_len("values", values.len(), n)?;
        expect_len("grad", grad.len(), n)?;
        let [m, v, t] = state else {
            return Err(wrong_state(state.len()));
        };
        let m = m.f32().map_err(in_buffer("exp_avg"))?;
        let v = v.f32().map_err(in_buffer("exp_avg_sq"))?;
        let t = t.u32().map_err(in_buffer("step"))?;
        expect_len("exp_avg", m.len(), n)?;
        expect_len("exp_avg_sq", v.len(), count)?;
        expect_len("step", t.len(), 1)?;

        // Everything checked: from here on the step runs to the end.
        t[0] = t[0].saturating_add(1);
        let t = i32::try_from(t[0]).unwrap_or(i32::MAX);
        // Per-step scalars in f64 (torch computes them as Python floats).
        let step_size = ctx.lr / (1.0 - self.beta1.powi(t));
        let bc2_sqrt = (1.0 - self.beta2.powi(t)).sqrt();
        let decay = (1.0 - ctx.lr * ctx.weight_decay) as f32;
        let b1 = self.beta1 as f32;

        if size == 1 {
            // Blocks of one element: AdamW, element by element, in AdamW's arithmetic.
            let (step_size, bc2_sqrt) = (step_size as f32, bc2_sqrt as f32);
            let (b2, eps) = (self.beta2 as f32, self.eps as f32);
            for (((w, &g), m), v) in values.iter_mut().zip(grad).zip(m.iter_mut()).zip(v.iter_mut()) {
                *m = b1 * *m + (1.0 - b1) * g;
                *v = b2 * *v + (1.0 - b2) * g * g;
                *w = *w * decay - step_size * *m / (v.sqrt() / bc2_sqrt + eps);
            }
            return Ok(());
        }

        let blocks = values.chunks_exact_mut(size).zip(grad.chunks_exact(size)).zip(m.chunks_exact_mut(size));
        for (((w, g), m), v) in blocks.zip(v.iter_mut()) {
            // Pass 1: the block's mean g², then its v and one scale for all its elements.
            let mean = sum_sq(g) / size as f64;
            let vb = self.beta2 * f64::from(*v) + (1.0 - self.beta2) * mean;
            *v = vb as f32;
            let scale = (step_size / (f64::from(*v).sqrt() / bc2_sqrt + self.eps)) as f32;
            // Pass 2: m and θ.
            for ((w, &g), m) in w.iter_mut().zip(g).zip(m.iter_mut()) {
                *m = b1 * *m + (1.0 - b1) * g;
                *w = *w * decay - scale * *m;
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

/// The error for `got` state buffers instead of the layout's three.
fn wrong_state(got: usize) -> PluginError {
    PluginError::invalid_input(format!("adam-mini expects 3 state buffers (exp_avg, exp_avg_sq, step), got {got}"))
}

ava_core::export_plugin!(optimizer: AdamMini);

#[cfg(test)]
mod tests;
