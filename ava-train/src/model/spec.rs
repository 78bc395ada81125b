//! The architecture as numbers: [`ModelSpec`] (from the `model` config section or a Hugging
//! Face `config.json`), and the list of parameters it implies, with Hugging Face Llama names.
//! Everything here is arithmetic, so `ava estimate` can use it for models it never allocates.

use std::path::Path;

use serde_json::{Value, json};

use super::ModelError;
use crate::config::ModelConfig;

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
    /// SwiGLU hidden width F.
    pub ffn: usize,
    /// RoPE θ.
    pub rope_theta: f64,
    /// RMSNorm ε.
    pub eps: f64,
    /// LM head shares the embedding.
    pub tie_embeddings: bool,
    /// Initial weight standard deviation.
    pub init_std: f64,
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
    /// SwiGLU projections.
    Dense { gate: usize, up: usize, down: usize },
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
        let spec = Self {
            vocab: config.vocab_size,
            hidden: config.hidden_size,
            layers: config.num_layers,
            heads: config.num_heads,
            kv_heads: config.num_kv_heads,
            ffn: config.intermediate_size,
            rope_theta: config.rope_theta,
            eps: config.rms_norm_eps,
            tie_embeddings: config.tie_embeddings,
            init_std: config.init_std,
            moe: (config.moe.num_experts > 0).then_some(MoeSpec {
                experts: config.moe.num_experts,
                top_k: config.moe.top_k,
                aux_weight: config.moe.aux_loss_weight,
            }),
        };
        spec.validate("model")?;
        Ok(spec)
    }

    /// Checks the numbers fit together; `origin` names where they came from in errors.
    pub fn validate(&self, origin: &str) -> Result<(), ModelError> {
        let mut problems = Vec::new();
        if self.hidden % self.heads != 0 {
            problems.push(format!(
                "hidden_size ({}) must be a multiple of num_heads ({}): each head gets hidden_size / num_heads dimensions",
                self.hidden, self.heads
            ));
        } else if self.head_dim() % 2 != 0 {
            problems.push(format!(
                "the head size hidden_size / num_heads = {} must be even for rotary embeddings",
                self.head_dim()
            ));
        }
        if self.heads % self.kv_heads != 0 {
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

    /// Head dimension D = d / H.
    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads
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
            let p = |name: String, shape: Vec<usize>, role| ParamDef { name, shape, role, block: Some(i) };
            let pre = format!("model.layers.{i}");
            out.push(p(format!("{pre}.input_layernorm.weight"), vec![d], ParamRole::Norm));
            out.push(p(format!("{pre}.self_attn.q_proj.weight"), vec![self.heads * hd, d], ParamRole::Matrix));
            out.push(p(format!("{pre}.self_attn.k_proj.weight"), vec![self.kv_heads * hd, d], ParamRole::Matrix));
            out.push(p(format!("{pre}.self_attn.v_proj.weight"), vec![self.kv_heads * hd, d], ParamRole::Matrix));
            out.push(p(format!("{pre}.self_attn.o_proj.weight"), vec![d, self.heads * hd], ParamRole::ResidualOut));
            out.push(p(format!("{pre}.post_attention_layernorm.weight"), vec![d], ParamRole::Norm));
            match self.moe {
                None => {
                    out.push(p(format!("{pre}.mlp.gate_proj.weight"), vec![f, d], ParamRole::Matrix));
                    out.push(p(format!("{pre}.mlp.up_proj.weight"), vec![f, d], ParamRole::Matrix));
                    out.push(p(format!("{pre}.mlp.down_proj.weight"), vec![d, f], ParamRole::ResidualOut));
                }
                Some(moe) => {
                    // Mixtral's names: w1 = gate, w3 = up, w2 = down.
                    out.push(p(format!("{pre}.block_sparse_moe.gate.weight"), vec![moe.experts, d], ParamRole::Matrix));
                    for e in 0..moe.experts {
                        let ex = format!("{pre}.block_sparse_moe.experts.{e}");
                        out.push(p(format!("{ex}.w1.weight"), vec![f, d], ParamRole::Matrix));
                        out.push(p(format!("{ex}.w3.weight"), vec![f, d], ParamRole::Matrix));
                        out.push(p(format!("{ex}.w2.weight"), vec![d, f], ParamRole::ResidualOut));
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

    /// Training FLOPs per token at sequence length `seq`: 6·N_matmul + 12·L·d·T (the
    /// attention scores and weighted sum, forward and backward; PaLM's appendix B formula
    /// without the causal halving, as the PyTorch reference counts it).
    pub fn train_flops_per_token(&self, seq: usize) -> f64 {
        6.0 * self.matmul_params_per_token() as f64 + 12.0 * (self.layers * self.hidden * seq) as f64
    }

    /// Reads a Hugging Face `config.json` (Llama or Mixtral).
    pub fn from_hf_config(path: &Path) -> Result<Self, ModelError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ModelError::Io { path: path.to_path_buf(), message: e.to_string() })?;
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| ModelError::HfConfig { path: path.to_path_buf(), message: format!("not JSON: {e}") })?;
        let mut missing = Vec::new();
        let mut int = |key: &str| match v.get(key).and_then(Value::as_u64) {
            Some(n) => n as usize,
            None => {
                missing.push(key.to_string());
                0
            }
        };
        let vocab = int("vocab_size");
        let hidden = int("hidden_size");
        let layers = int("num_hidden_layers");
        let heads = int("num_attention_heads");
        let ffn = int("intermediate_size");
        if !missing.is_empty() {
            return Err(ModelError::HfConfig {
                path: path.to_path_buf(),
                message: format!("missing or not an integer: {}", missing.join(", ")),
            });
        }
        if let Some(act) = v.get("hidden_act").and_then(Value::as_str)
            && act != "silu"
        {
            return Err(ModelError::HfConfig {
                path: path.to_path_buf(),
                message: format!("hidden_act is {act:?}; Ava's Llama blocks use SwiGLU (\"silu\")"),
            });
        }
        let kv_heads = v.get("num_key_value_heads").and_then(Value::as_u64).map_or(heads, |n| n as usize);
        let experts = v.get("num_local_experts").and_then(Value::as_u64).unwrap_or(0) as usize;
        let spec = Self {
            vocab,
            hidden,
            layers,
            heads,
            kv_heads,
            ffn,
            rope_theta: v.get("rope_theta").and_then(Value::as_f64).unwrap_or(10000.0),
            eps: v.get("rms_norm_eps").and_then(Value::as_f64).unwrap_or(1e-6),
            tie_embeddings: v.get("tie_word_embeddings").and_then(Value::as_bool).unwrap_or(false),
            init_std: v.get("initializer_range").and_then(Value::as_f64).unwrap_or(0.02),
            moe: (experts > 0).then(|| MoeSpec {
                experts,
                top_k: v.get("num_experts_per_tok").and_then(Value::as_u64).unwrap_or(2) as usize,
                aux_weight: v.get("router_aux_loss_coef").and_then(Value::as_f64).unwrap_or(0.01),
            }),
        };
        spec.validate(&path.display().to_string())?;
        Ok(spec)
    }

    /// The Hugging Face `config.json` describing this model.
    pub fn to_hf_config(&self) -> Value {
        let mut v = json!({
            "architectures": [if self.moe.is_some() { "MixtralForCausalLM" } else { "LlamaForCausalLM" }],
            "model_type": if self.moe.is_some() { "mixtral" } else { "llama" },
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "intermediate_size": self.ffn,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.eps,
            "tie_word_embeddings": self.tie_embeddings,
            "initializer_range": self.init_std,
            "attention_bias": false,
            "mlp_bias": false,
            "torch_dtype": "float32",
        });
        if let Some(moe) = self.moe {
            v["num_local_experts"] = json!(moe.experts);
            v["num_experts_per_tok"] = json!(moe.top_k);
            v["router_aux_loss_coef"] = json!(moe.aux_weight);
        }
        v
    }
}
