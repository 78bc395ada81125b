//! The architecture as numbers: [`ModelSpec`] (from the `model` config section or a Hugging
//! Face `config.json`, read in `hf_config`), and the list of parameters it implies, with
//! Hugging Face names. Everything here is arithmetic, so `ava estimate` can use it for models
//! it never allocates.

use super::{ModelError, RopeSpec};
use crate::config::ModelConfig;

/// The Hugging Face architecture a model is: what its `config.json` says and how Ava writes
/// it back. All four are the same decoder; they differ in which projections have biases,
/// the attention window and the MLP (see [`ModelSpec`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// `llama` (LlamaForCausalLM): optional biases on every attention / MLP projection.
    Llama,
    /// `mistral` (MistralForCausalLM): no biases, an optional sliding window.
    Mistral,
    /// `mixtral` (MixtralForCausalLM): a top-k mixture of SwiGLU experts.
    Mixtral,
    /// `qwen2` (Qwen2ForCausalLM): biases on q, k and v only.
    Qwen2,
}

impl Arch {
    /// `model_type` in config.json.
    pub fn model_type(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Mistral => "mistral",
            Arch::Mixtral => "mixtral",
            Arch::Qwen2 => "qwen2",
        }
    }

    /// The transformers class in `architectures`.
    pub fn class_name(self) -> &'static str {
        match self {
            Arch::Llama => "LlamaForCausalLM",
            Arch::Mistral => "MistralForCausalLM",
            Arch::Mixtral => "MixtralForCausalLM",
            Arch::Qwen2 => "Qwen2ForCausalLM",
        }
    }

    /// Every architecture, for lookups by name.
    pub const ALL: [Arch; 4] = [Arch::Llama, Arch::Mistral, Arch::Mixtral, Arch::Qwen2];
}

/// Which projections add a bias vector after their matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Biases {
    /// q_proj, k_proj and v_proj (Llama's `attention_bias`, always on in Qwen2).
    pub qkv: bool,
    /// o_proj (Llama's `attention_bias`).
    pub o: bool,
    /// gate_proj, up_proj and down_proj (Llama's `mlp_bias`).
    pub mlp: bool,
}

/// Mixture-of-experts settings of a model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeSpec {
    /// Experts per block.
    pub experts: usize,
    /// Experts each token goes to.
    pub top_k: usize,
    /// Weight of the load-balancing loss.
    pub aux_weight: f64,
}

/// A Llama-style decoder's shape.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSpec {
    /// The Hugging Face architecture it is written as.
    pub arch: Arch,
    /// Vocabulary size V.
    pub vocab: usize,
    /// Width d.
    pub hidden: usize,
    /// Blocks L.
    pub layers: usize,
    /// Query heads H.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Head size D (usually d / H; Mistral-Nemo-like configs set it apart).
    pub head_dim: usize,
    /// SwiGLU hidden width F.
    pub ffn: usize,
    /// Rotary embedding: base θ and scaling.
    pub rope: RopeSpec,
    /// RMSNorm ε.
    pub eps: f64,
    /// LM head shares the embedding.
    pub tie_embeddings: bool,
    /// Initial weight standard deviation.
    pub init_std: f64,
    /// Projections with biases.
    pub bias: Biases,
    /// Each query sees only the last `w` positions, its own included (Mistral's
    /// `sliding_window`); `None`: full causal attention.
    pub sliding_window: Option<usize>,
    /// `max_position_embeddings` as config.json gave it (written back unchanged; Ava's own
    /// models leave it to transformers' default).
    pub max_position: Option<usize>,
    /// Mixture of experts, if any.
    pub moe: Option<MoeSpec>,
}

/// What a parameter is, which decides its initialization and weight decay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamRole {
    /// The token embedding (no weight decay).
    Embedding,
    /// An RMSNorm gain (initialized to 1, no weight decay).
    Norm,
    /// A projection's bias (initialized to 0, no weight decay).
    Bias,
    /// A projection matrix (decayed).
    Matrix,
    /// A projection that writes into the residual stream (o_proj, down_proj): initialized
    /// with std / sqrt(2L), as GPT-2 does, so the residual stream does not grow with depth.
    ResidualOut,
}

/// One parameter: its Hugging Face name, shape and role.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamDef {
    /// e.g. `model.layers.0.self_attn.q_proj.weight`.
    pub name: String,
    /// `[out, in]` for a matrix, `[d]` for a norm.
    pub shape: Vec<usize>,
    /// Its role.
    pub role: ParamRole,
    /// The block it belongs to, if any.
    pub block: Option<usize>,
}

impl ParamDef {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Where a dense or MoE MLP's parameters are in [`ModelSpec::params`].
#[derive(Debug, Clone)]
pub(crate) enum MlpIndex {
    /// SwiGLU projections and, with `mlp_bias`, their biases.
    Dense { gate: usize, up: usize, down: usize, bias: [Option<usize>; 3] },
    /// The router and `[w1, w3, w2]` per expert.
    Moe { router: usize, experts: Vec<[usize; 3]>, top_k: usize },
}

/// Where one block's parameters are in [`ModelSpec::params`] (shared by the model and the
/// estimator's replay, so the two cannot disagree on which weight is which).
#[derive(Debug, Clone)]
pub(crate) struct BlockIndex {
    pub attn_norm: usize,
    pub q: usize,
    pub k: usize,
    pub v: usize,
    pub o: usize,
    /// Biases of q, k and v (all or none).
    pub qkv_bias: [Option<usize>; 3],
    pub o_bias: Option<usize>,
    pub mlp_norm: usize,
    pub mlp: MlpIndex,
}

/// Where the parameters outside the blocks are in [`ModelSpec::params`].
#[derive(Debug, Clone)]
pub(crate) struct ParamIndex {
    pub blocks: Vec<BlockIndex>,
    /// The LM head (the embedding, index 0, when tied).
    pub head: usize,
    pub final_norm: usize,
}

impl ModelSpec {
    /// Indices into [`params`](Self::params) of every block's weights, the head and the
    /// final norm, looked up by their Hugging Face names.
    pub(crate) fn param_index(&self) -> ParamIndex {
        let defs = self.params();
        let find: std::collections::HashMap<&str, usize> =
            defs.iter().enumerate().map(|(i, d)| (d.name.as_str(), i)).collect();
        let at = |name: String| find[name.as_str()];
        let blocks = (0..self.layers)
            .map(|i| {
                let pre = format!("model.layers.{i}");
                let mlp = match self.moe {
                    None => MlpIndex::Dense {
                        gate: at(format!("{pre}.mlp.gate_proj.weight")),
                        up: at(format!("{pre}.mlp.up_proj.weight")),
                        down: at(format!("{pre}.mlp.down_proj.weight")),
                        bias: ["gate", "up", "down"]
                            .map(|p| self.bias.mlp.then(|| at(format!("{pre}.mlp.{p}_proj.bias")))),
                    },
                    Some(moe) => MlpIndex::Moe {
                        router: at(format!("{pre}.block_sparse_moe.gate.weight")),
                        experts: (0..moe.experts)
                            .map(|e| {
                                let ex = format!("{pre}.block_sparse_moe.experts.{e}");
                                [
                                    at(format!("{ex}.w1.weight")),
                                    at(format!("{ex}.w3.weight")),
                                    at(format!("{ex}.w2.weight")),
                                ]
                            })
                            .collect(),
                        top_k: moe.top_k,
                    },
                };
                BlockIndex {
                    attn_norm: at(format!("{pre}.input_layernorm.weight")),
                    q: at(format!("{pre}.self_attn.q_proj.weight")),
                    k: at(format!("{pre}.self_attn.k_proj.weight")),
                    v: at(format!("{pre}.self_attn.v_proj.weight")),
                    o: at(format!("{pre}.self_attn.o_proj.weight")),
                    qkv_bias: ["q", "k", "v"]
                        .map(|p| self.bias.qkv.then(|| at(format!("{pre}.self_attn.{p}_proj.bias")))),
                    o_bias: self.bias.o.then(|| at(format!("{pre}.self_attn.o_proj.bias"))),
                    mlp_norm: at(format!("{pre}.post_attention_layernorm.weight")),
                    mlp,
                }
            })
            .collect();
        let head = if self.tie_embeddings { 0 } else { at("lm_head.weight".into()) };
        ParamIndex { blocks, head, final_norm: at("model.norm.weight".into()) }
    }

    /// The spec of the `model` config section.
    pub fn from_config(config: &ModelConfig) -> Result<Self, ModelError> {
        let moe = (config.moe.num_experts > 0).then_some(MoeSpec {
            experts: config.moe.num_experts,
            top_k: config.moe.top_k,
            aux_weight: config.moe.aux_loss_weight,
        });
        let spec = Self {
            arch: if moe.is_some() { Arch::Mixtral } else { Arch::Llama },
            rope: RopeSpec::plain(config.rope_theta),
            eps: config.rms_norm_eps,
            tie_embeddings: config.tie_embeddings,
            init_std: config.init_std,
            moe,
            ..Self::llama(
                config.vocab_size,
                config.hidden_size,
                config.num_layers,
                config.num_heads,
                config.num_kv_heads,
                config.intermediate_size,
            )
        };
        // Every problem at once: the head split here, the rest from validate.
        let mut problems = Vec::new();
        if config.num_heads > 0 && !config.hidden_size.is_multiple_of(config.num_heads) {
            problems.push(format!(
                "hidden_size ({}) must be a multiple of num_heads ({}): each head gets hidden_size / num_heads dimensions",
                config.hidden_size, config.num_heads
            ));
        }
        match spec.validate("model") {
            Ok(()) => {}
            Err(ModelError::Spec { problems: more, .. }) => problems.extend(more),
            Err(e) => return Err(e),
        }
        if problems.is_empty() { Ok(spec) } else { Err(ModelError::Spec { origin: "model".into(), problems }) }
    }

    /// A plain Llama of these sizes: head size d / H, RoPE θ 10000, ε 1e-6, no biases, no
    /// window, untied head, initial std 0.02 (change fields with `..`).
    pub fn llama(vocab: usize, hidden: usize, layers: usize, heads: usize, kv_heads: usize, ffn: usize) -> Self {
        Self {
            arch: Arch::Llama,
            vocab,
            hidden,
            layers,
            heads,
            kv_heads,
            head_dim: hidden / heads.max(1),
            ffn,
            rope: RopeSpec::plain(10000.0),
            eps: 1e-6,
            tie_embeddings: false,
            init_std: 0.02,
            bias: Biases::default(),
            sliding_window: None,
            max_position: None,
            moe: None,
        }
    }

    /// Checks the numbers fit together; `origin` names where they came from in errors.
    pub fn validate(&self, origin: &str) -> Result<(), ModelError> {
        let mut problems = Vec::new();
        for (name, n) in [
            ("vocab_size", self.vocab),
            ("hidden_size", self.hidden),
            ("num_layers", self.layers),
            ("num_heads", self.heads),
            ("num_kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("intermediate_size", self.ffn),
        ] {
            if n == 0 {
                problems.push(format!("{name} must be at least 1, got 0"));
            }
        }
        if !problems.is_empty() {
            return Err(ModelError::Spec { origin: origin.to_string(), problems });
        }
        let experts = self.moe.map_or(1, |m| m.experts);
        if (self.layers as u128) * (experts as u128) > MAX_LAYER_EXPERTS {
            problems.push(format!(
                "num_layers {} × num_experts {experts} is more than the {MAX_LAYER_EXPERTS} expert blocks Ava accepts",
                self.layers
            ));
        }
        let (v, d, l, h, kv, hd, f) =
            (self.vocab, self.hidden, self.layers, self.heads, self.kv_heads, self.head_dim, self.ffn);
        if let Some(total) = param_count(v, d, l, h, kv, hd, f, experts, self.tie_embeddings)
            && total > MAX_PARAMS
        {
            problems.push(format!("these sizes make {total} parameters, more than the {MAX_PARAMS} Ava accepts"));
        }
        if !problems.is_empty() {
            return Err(ModelError::Spec { origin: origin.to_string(), problems });
        }
        if !self.head_dim.is_multiple_of(2) {
            problems.push(format!("the head size ({}) must be even for rotary embeddings", self.head_dim));
        }
        if self.sliding_window == Some(0) {
            problems.push("sliding_window must be at least 1".into());
        }
        if self.moe.is_some() != (self.arch == Arch::Mixtral) {
            problems.push(format!(
                "a mixture of experts is written as Mixtral and only Mixtral has one (architecture {}, {} experts)",
                self.arch.model_type(),
                self.moe.map_or(0, |m| m.experts)
            ));
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            problems.push(format!(
                "num_heads ({}) must be a multiple of num_kv_heads ({}) for grouped-query attention",
                self.heads, self.kv_heads
            ));
        }
        if let Some(moe) = self.moe
            && moe.top_k > moe.experts
        {
            problems.push(format!("moe.top_k ({}) must be at most moe.num_experts ({})", moe.top_k, moe.experts));
        }
        if problems.is_empty() { Ok(()) } else { Err(ModelError::Spec { origin: origin.to_string(), problems }) }
    }

    /// Head dimension D.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// The longest sequence the model is made for, in positions: `max_position_embeddings`,
    /// or transformers' default for the architecture where config.json leaves it out (as
    /// Ava's own exports do, so transformers reads them alike), times the factor of a dynamic
    /// RoPE scaling, which is there to go past it.
    /// At most 2^30 positions (the most `max_position_embeddings` may say), whatever a
    /// scaling factor multiplies it by.
    pub fn context(&self) -> usize {
        const MOST: usize = 1 << 30;
        let max = self.max_position.unwrap_or_else(|| super::hf_config::default_max_position(self.arch));
        let scaled = match self.rope.scaling {
            super::rope::RopeScaling::Dynamic { factor, .. } => (max as f64 * factor).floor().min(MOST as f64) as usize,
            _ => max,
        };
        scaled.min(MOST)
    }

    /// Every parameter, in a fixed order (embedding, blocks, final norm, head).
    pub fn params(&self) -> Vec<ParamDef> {
        let (d, f, hd) = (self.hidden, self.ffn, self.head_dim());
        let mut out = vec![ParamDef {
            name: "model.embed_tokens.weight".into(),
            shape: vec![self.vocab, d],
            role: ParamRole::Embedding,
            block: None,
        }];
        for i in 0..self.layers {
            let pre = format!("model.layers.{i}");
            let mut p =
                |name: String, shape: Vec<usize>, role| out.push(ParamDef { name, shape, role, block: Some(i) });
            // A projection's weight (out, in), then its bias (out) when it has one.
            let proj =
                |p: &mut dyn FnMut(String, Vec<usize>, ParamRole), name: String, dims: [usize; 2], role, bias| {
                    p(format!("{name}.weight"), dims.to_vec(), role);
                    if bias {
                        p(format!("{name}.bias"), vec![dims[0]], ParamRole::Bias);
                    }
                };
            let (qkv, o, mlp) = (self.bias.qkv, self.bias.o, self.bias.mlp);
            let (q_rows, kv_rows) = (self.heads * hd, self.kv_heads * hd);
            p(format!("{pre}.input_layernorm.weight"), vec![d], ParamRole::Norm);
            proj(&mut p, format!("{pre}.self_attn.q_proj"), [q_rows, d], ParamRole::Matrix, qkv);
            proj(&mut p, format!("{pre}.self_attn.k_proj"), [kv_rows, d], ParamRole::Matrix, qkv);
            proj(&mut p, format!("{pre}.self_attn.v_proj"), [kv_rows, d], ParamRole::Matrix, qkv);
            proj(&mut p, format!("{pre}.self_attn.o_proj"), [d, q_rows], ParamRole::ResidualOut, o);
            p(format!("{pre}.post_attention_layernorm.weight"), vec![d], ParamRole::Norm);
            match self.moe {
                None => {
                    proj(&mut p, format!("{pre}.mlp.gate_proj"), [f, d], ParamRole::Matrix, mlp);
                    proj(&mut p, format!("{pre}.mlp.up_proj"), [f, d], ParamRole::Matrix, mlp);
                    proj(&mut p, format!("{pre}.mlp.down_proj"), [d, f], ParamRole::ResidualOut, mlp);
                }
                Some(moe) => {
                    // Mixtral's names: w1 = gate, w3 = up, w2 = down.
                    p(format!("{pre}.block_sparse_moe.gate.weight"), vec![moe.experts, d], ParamRole::Matrix);
                    for e in 0..moe.experts {
                        let ex = format!("{pre}.block_sparse_moe.experts.{e}");
                        p(format!("{ex}.w1.weight"), vec![f, d], ParamRole::Matrix);
                        p(format!("{ex}.w3.weight"), vec![f, d], ParamRole::Matrix);
                        p(format!("{ex}.w2.weight"), vec![d, f], ParamRole::ResidualOut);
                    }
                }
            }
        }
        out.push(ParamDef { name: "model.norm.weight".into(), shape: vec![d], role: ParamRole::Norm, block: None });
        if !self.tie_embeddings {
            out.push(ParamDef {
                name: "lm_head.weight".into(),
                shape: vec![self.vocab, d],
                role: ParamRole::Matrix,
                block: None,
            });
        }
        out
    }

    /// Total parameter count.
    pub fn num_params(&self) -> usize {
        self.params().iter().map(ParamDef::numel).sum()
    }

    /// Parameters that take part in matrix multiplications per token: all but the embedding
    /// table and the norms (the LM head counts, also when tied). For a MoE, only the `top_k`
    /// experts a token visits count.
    pub fn matmul_params_per_token(&self) -> usize {
        let (d, f, hd) = (self.hidden, self.ffn, self.head_dim());
        let attn = d * self.heads * hd * 2 + d * self.kv_heads * hd * 2;
        let mlp = match self.moe {
            None => 3 * d * f,
            Some(moe) => moe.top_k * 3 * d * f + moe.experts * d,
        };
        self.layers * (attn + mlp) + self.vocab * d
    }

    /// Training FLOPs per token at sequence length `seq`: 6·N_matmul + 6·L·H·D·T. The second
    /// term is the attention scores and weighted sum, forward and backward, over the causal
    /// half of the T×T pairs a token attends to on average (PaLM's appendix B counts all of
    /// them, 12·L·H·D·T; a causal kernel that skips masked tiles does half that work, and
    /// `../shared/gpu/torch_ref.py`'s MFU counts the half, 6·L·T·d). Counting the whole
    /// square put the long-context benchmark's MFU above 100%.
    pub fn train_flops_per_token(&self, seq: usize) -> f64 {
        6.0 * self.matmul_params_per_token() as f64 + 6.0 * (self.layers * self.heads * self.head_dim * seq) as f64
    }
}

/// The most parameters a model may have: 2 × 10^12, past the largest open models. Sizes from
/// a config.json or a config file are refused past it, before anything is sized by them.
pub const MAX_PARAMS: u128 = 2_000_000_000_000;

/// The most expert blocks (layers × experts) a model may have; the largest open mixtures
/// have about 16 thousand (61 layers of 256). Each is its own tensors and bookkeeping.
pub const MAX_LAYER_EXPERTS: u128 = 65_536;

/// The parameter count of a Llama-style model with these sizes (an upper bound: biases and
/// norms are counted generously), `None` when a size is zero (reported elsewhere). In
/// `u128`, so no size within the per-key limits overflows.
#[allow(clippy::too_many_arguments)]
pub(crate) fn param_count(
    vocab: usize,
    hidden: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    ffn: usize,
    experts: usize,
    tied: bool,
) -> Option<u128> {
    let [v, d, l, h, kv, hd, f, e] =
        [vocab, hidden, layers, heads, kv_heads, head_dim, ffn, experts].map(|n| n as u128);
    if [v, d, l, h, kv, hd, f, e].contains(&0) {
        return None;
    }
    let attention = d * h * hd * 2 + d * kv * hd * 2 + (h + kv * 2) * hd;
    let mlp = e * (3 * d * f + 2 * f + d) + d * e;
    let embeddings = v * d * if tied { 1 } else { 2 };
    Some(embeddings + l * (attention + mlp + 2 * d) + d)
}
