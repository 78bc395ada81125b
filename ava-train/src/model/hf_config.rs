//! Hugging Face `config.json` ↔ [`ModelSpec`]. Every field that changes the computation of a
//! supported architecture is honored or refused by name; a missing field takes the value
//! transformers' config class gives it (Mistral's 4096-token window, Mixtral's ε 1e-5, …),
//! never a guess of Ava's.
//!
//! Supported exactly: `llama`, `mistral`, `mixtral` and `qwen2` (see [`Arch`]). RoPE settings
//! are read in both forms: transformers 4's top-level `rope_theta` + `rope_scaling`, and
//! transformers 5's `rope_parameters` (with the same precedence transformers 5 applies), and
//! written back in both, so a folder Ava writes loads the same in either.

use std::path::Path;

use serde_json::{Map, Value, json};

use super::ModelError;
use super::rope::{RopeScaling, RopeSpec};
use super::spec::{Arch, Biases, ModelSpec, MoeSpec};

/// A config.json read into a spec, with what was noticed but changes nothing.
#[derive(Debug, Clone)]
pub struct HfConfig {
    /// The architecture.
    pub spec: ModelSpec,
    /// Fields read and ignored because they do not change the computation in transformers
    /// either (e.g. a `sliding_window` in a Llama config, or fields Ava does not know).
    pub notes: Vec<String>,
}

/// The weight of Ava's per-block load-balancing loss in a Mixtral folder Ava wrote.
const AVA_AUX_KEY: &str = "ava_moe_aux_loss_weight";

/// Fields that never change a model's computation (token ids, generation and serialization
/// settings): accepted silently.
const INERT: &[&str] = &[
    "_name_or_path",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "use_cache",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sep_token_id",
    "decoder_start_token_id",
    "initializer_range",
    "pretraining_tp", // 4.x splits the matmuls into slices; the product is the same
    "id2label",
    "label2id",
    "problem_type",
    "return_dict",
    "output_attentions",
    "output_hidden_states",
    "torchscript",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "is_decoder",
    "add_cross_attention",
    "tie_encoder_decoder",
    "tokenizer_class",
    "prefix",
    "task_specific_params",
    "finetuning_task",
    "cross_attention_hidden_size",
    "max_length",
    "min_length",
    "do_sample",
    "early_stopping",
    "num_beams",
    "num_beam_groups",
    "diversity_penalty",
    "temperature",
    "top_k",
    "top_p",
    "typical_p",
    "repetition_penalty",
    "length_penalty",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "bad_words_ids",
    "num_return_sequences",
    "output_scores",
    "return_dict_in_generate",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "remove_invalid_values",
    "exponential_decay_length_penalty",
    "suppress_tokens",
    "begin_suppress_tokens",
    "tf_legacy_loss",
    "use_bfloat16",
    "pruned_heads",
    "model_name",
];

/// Why an architecture Ava does not implement differs from a Llama, for the refusal.
fn unsupported_reason(model_type: &str) -> &'static str {
    match model_type {
        "qwen3" | "olmo2" | "olmo3" => {
            "it normalizes q and k per head (q_norm, k_norm), which Ava's attention does not"
        }
        "qwen2_moe" | "qwen3_moe" | "deepseek_v2" | "deepseek_v3" => {
            "its mixture of experts (shared experts, other routing) is not Mixtral's"
        }
        "gemma" | "gemma2" | "gemma3" | "gemma3_text" => {
            "it uses GeGLU, a scaled embedding and (1 + w) norm gains; gemma2/3 add logit soft-capping"
        }
        "phi3" | "phi" => "it fuses q/k/v and gate/up into single matrices and uses other RoPE variants",
        "granite" | "granitemoe" => "it multiplies embeddings, residuals, attention and logits by extra factors",
        "cohere" | "cohere2" => "it uses LayerNorm and a parallel attention/MLP block",
        "gpt2" | "gpt_neox" | "gptj" | "opt" | "bloom" | "falcon" | "starcoder2" => {
            "it is not a Llama-style decoder (LayerNorm, other MLP or position encoding)"
        }
        _ => "its computation is not known to be a Llama's",
    }
}

/// Reads config.json fields, remembering which were used and every problem.
struct Reader<'a> {
    obj: &'a Map<String, Value>,
    used: Vec<&'static str>,
    problems: Vec<String>,
    notes: Vec<String>,
}

impl<'a> Reader<'a> {
    fn get(&mut self, key: &'static str) -> Option<&'a Value> {
        self.used.push(key);
        self.obj.get(key).filter(|v| !v.is_null())
    }

    /// A positive integer, or the default when absent/null.
    fn int(&mut self, key: &'static str, default: Option<usize>, max: usize) -> usize {
        self.int_from(key, default, 1, max)
    }

    /// An integer from `min` to `max`, or the default when absent/null.
    fn int_from(&mut self, key: &'static str, default: Option<usize>, min: u64, max: usize) -> usize {
        match self.get(key) {
            None => default.unwrap_or_else(|| {
                self.problems.push(format!("{key} is missing (it has no default): add it as an integer"));
                0
            }),
            Some(v) => match v.as_u64() {
                Some(n) if n >= min && n <= max as u64 => n as usize,
                _ => {
                    self.problems.push(format!("{key} must be an integer from {min} to {max}, got {v}"));
                    0
                }
            },
        }
    }

    fn float(&mut self, key: &'static str, default: f64) -> f64 {
        match self.get(key) {
            None => default,
            Some(v) => v.as_f64().unwrap_or_else(|| {
                self.problems.push(format!("{key} must be a number, got {v}"));
                default
            }),
        }
    }

    fn bool(&mut self, key: &'static str, default: bool) -> bool {
        match self.get(key) {
            None => default,
            Some(v) => v.as_bool().unwrap_or_else(|| {
                self.problems.push(format!("{key} must be true or false, got {v}"));
                default
            }),
        }
    }

    /// A field this architecture's transformers class does not read: noted when it would
    /// matter elsewhere, so a user sees that it has no effect.
    fn not_read(&mut self, key: &'static str, arch: Arch) {
        if let Some(v) = self.get(key) {
            self.notes
                .push(format!("{key} ({v}) is not read by transformers' {} and has no effect", arch.model_type()));
        }
    }
}

/// The architecture named by `model_type` (or, without it, `architectures`).
fn arch_of(r: &mut Reader<'_>) -> Option<Arch> {
    let supported = "Ava implements llama, mistral, mixtral and qwen2 exactly";
    let classes: Vec<String> = match r.get("architectures") {
        None => Vec::new(),
        Some(Value::Array(a)) => a.iter().map(|c| c.as_str().unwrap_or("?").to_string()).collect(),
        Some(v) => {
            r.problems.push(format!("architectures must be a list of class names, got {v}"));
            Vec::new()
        }
    };
    let arch = match r.get("model_type").map(|v| v.as_str()) {
        Some(Some(mt)) => match Arch::ALL.into_iter().find(|a| a.model_type() == mt) {
            Some(a) => a,
            None => {
                r.problems
                    .push(format!("model_type \"{mt}\" is not supported: {}; {supported}", unsupported_reason(mt)));
                return None;
            }
        },
        Some(None) => {
            r.problems.push("model_type must be a string".into());
            return None;
        }
        None => match classes.first().and_then(|c| Arch::ALL.into_iter().find(|a| a.class_name() == c)) {
            Some(a) => a,
            None => {
                r.problems.push(format!(
                    "no model_type, and architectures ({}) names no class Ava implements: add \"model_type\" \
                     (llama, mistral, mixtral or qwen2) if the model is one of those",
                    if classes.is_empty() { "absent".to_string() } else { classes.join(", ") }
                ));
                return None;
            }
        },
    };
    for class in &classes {
        if class != arch.class_name() {
            r.problems.push(format!(
                "architectures names {class}, but Ava trains {} ({}) as a causal language model only",
                arch.class_name(),
                arch.model_type()
            ));
        }
    }
    Some(arch)
}

/// transformers' default of a field by architecture (its config class's `__init__`).
struct Defaults {
    kv_heads: Option<usize>,
    eps: f64,
    theta: f64,
    max_position: usize,
}

fn defaults(arch: Arch) -> Defaults {
    match arch {
        Arch::Llama => Defaults { kv_heads: None, eps: 1e-6, theta: 10000.0, max_position: 2048 },
        Arch::Mistral => Defaults { kv_heads: Some(8), eps: 1e-6, theta: 10000.0, max_position: 131072 },
        Arch::Mixtral => Defaults { kv_heads: Some(8), eps: 1e-5, theta: 1e6, max_position: 131072 },
        Arch::Qwen2 => Defaults { kv_heads: Some(32), eps: 1e-6, theta: 10000.0, max_position: 32768 },
    }
}

/// transformers' `max_position_embeddings` for `arch` when config.json leaves it out.
pub(crate) fn default_max_position(arch: Arch) -> usize {
    defaults(arch).max_position
}

/// The RoPE settings from `rope_scaling` / `rope_parameters` / `rope_theta`, with transformers
/// 5's precedence: a non-null `rope_scaling` replaces `rope_parameters`, and a `rope_theta`
/// inside them wins over the top-level one. Stages: the object the settings come from
/// ([`rope_source`]), θ, the scaling and what it reads ([`RopeParams`]), then the keys it did
/// not read (notes) and the limits on the whole.
fn rope_of(r: &mut Reader<'_>, default_theta: f64, max_position: usize, head_dim: usize) -> RopeSpec {
    let top_theta = r.get("rope_theta").cloned();
    let Some((name, params)) = rope_source(r) else { return RopeSpec::plain(default_theta) };
    let p = RopeParams { name, params: &params, max_position };
    let mut problems = Vec::new();
    let theta = p.theta(top_theta, default_theta, &mut problems);
    let kind = p.kind(&mut problems);
    let (scaling, known) = p.scaling(&kind, &mut problems);
    for key in params.keys() {
        let key = key.as_str();
        if !matches!(key, "rope_type" | "type" | "rope_theta" | "partial_rotary_factor") && !known.contains(&key) {
            r.notes.push(format!("{name}.{key} is not used by rope_type \"{kind}\" (transformers ignores it too)"));
        }
    }
    if let Some(f) = params.get("partial_rotary_factor")
        && f.as_f64() != Some(1.0)
    {
        problems.push(format!("{name}.partial_rotary_factor is {f}: Ava rotates whole heads (1.0) only"));
    }
    if head_dim < 4 && !matches!(scaling, RopeScaling::Default | RopeScaling::Linear { .. }) {
        problems.push(format!("rope_type \"{kind}\" needs a head size of at least 4, got {head_dim}"));
    }
    r.problems.extend(problems);
    RopeSpec { theta, scaling }
}

/// The object the RoPE settings come from and its name: `rope_scaling` when it is set, else
/// `rope_parameters` (an empty one when neither is). Problems with the objects themselves go
/// to `r`: a top-level `partial_rotary_factor` other than 1, an object that is not one, the
/// two disagreeing, settings per layer type (then `None`: plain RoPE).
fn rope_source(r: &mut Reader<'_>) -> Option<(&'static str, Map<String, Value>)> {
    let scaling = r.get("rope_scaling").cloned();
    let parameters = r.get("rope_parameters").cloned();
    if let Some(p) = r.get("partial_rotary_factor")
        && p.as_f64() != Some(1.0)
    {
        r.problems.push(format!("partial_rotary_factor is {p}: Ava rotates whole heads (1.0) only"));
    }
    let as_obj = |name: &str, v: Option<Value>, problems: &mut Vec<String>| match v {
        None => None,
        Some(Value::Object(m)) if m.is_empty() => None,
        Some(Value::Object(m)) => Some(m),
        Some(other) => {
            problems.push(format!("{name} must be an object or null, got {other}"));
            None
        }
    };
    let scaling = as_obj("rope_scaling", scaling, &mut r.problems);
    let parameters = as_obj("rope_parameters", parameters, &mut r.problems);
    // Both present: transformers 4 reads rope_scaling, 5 too (it replaces rope_parameters), so
    // they must agree on everything but θ.
    if let (Some(s), Some(p)) = (&scaling, &parameters) {
        let kind = |m: &Map<String, Value>| m.get("rope_type").or(m.get("type")).cloned();
        let differs = kind(s) != kind(p)
            || s.iter().any(|(k, v)| k != "type" && k != "rope_type" && k != "rope_theta" && p.get(k) != Some(v));
        if differs {
            r.problems.push(format!(
                "rope_scaling ({}) and rope_parameters ({}) disagree: keep one (transformers 4 reads only rope_scaling)",
                Value::Object(s.clone()),
                Value::Object(p.clone())
            ));
        }
    }
    let (name, params) = match (scaling, parameters) {
        (Some(s), _) => ("rope_scaling", s),
        (None, Some(p)) => ("rope_parameters", p),
        (None, None) => ("rope_parameters", Map::new()),
    };
    if params.keys().any(|k| matches!(k.as_str(), "full_attention" | "sliding_attention")) {
        r.problems.push(format!("{name} holds settings per layer type: Ava uses one RoPE for every layer"));
        return None;
    }
    Some((name, params))
}

/// The RoPE settings object `params` (named `name` in messages) and what its values are
/// checked against; each reading pushes what is wrong with it to `problems`.
struct RopeParams<'a> {
    name: &'static str,
    params: &'a Map<String, Value>,
    /// The model's `max_position_embeddings`.
    max_position: usize,
}

impl RopeParams<'_> {
    /// `params[key]` as a number (absent or null: `None`).
    fn num(&self, key: &str, problems: &mut Vec<String>) -> Option<f64> {
        let v = self.params.get(key).filter(|v| !v.is_null())?;
        let n = v.as_f64();
        if n.is_none() {
            problems.push(format!("{}.{key} must be a number, got {v}", self.name));
        }
        n
    }

    /// θ: the object's own `rope_theta`, else the top-level one, else the class default.
    fn theta(&self, top: Option<Value>, default: f64, problems: &mut Vec<String>) -> f64 {
        let name = self.name;
        let theta = match (self.num("rope_theta", problems), top) {
            (Some(inner), Some(top)) if top.as_f64() != Some(inner) => {
                problems.push(format!(
                    "rope_theta ({top}) and {name}.rope_theta ({inner}) disagree: transformers 4 reads the first and 5 \
                     the second; keep one"
                ));
                inner
            }
            (Some(inner), _) => inner,
            (None, Some(top)) => top.as_f64().unwrap_or_else(|| {
                problems.push(format!("rope_theta must be a number, got {top}"));
                default
            }),
            (None, None) => default,
        };
        if !(theta > 1.0 && theta.is_finite()) {
            problems.push(format!("rope_theta must be a finite number above 1, got {theta}"));
        }
        theta
    }

    /// `rope_type` (or the older `type`), "default" when absent.
    fn kind(&self, problems: &mut Vec<String>) -> String {
        match self.params.get("rope_type").or(self.params.get("type")) {
            None => "default".to_string(),
            Some(Value::String(s)) => s.clone(),
            Some(v) => {
                problems.push(format!("{}.rope_type must be a string, got {v}", self.name));
                "default".to_string()
            }
        }
    }

    /// `factor` (at least 1), or `default` when absent; `kind` names the type that needs it.
    fn factor(&self, kind: &str, default: Option<f64>, problems: &mut Vec<String>) -> f64 {
        match self.num("factor", problems).or(default) {
            Some(f) if f >= 1.0 && f.is_finite() => f,
            Some(f) => {
                problems.push(format!("{}.factor must be at least 1, got {f}", self.name));
                1.0
            }
            None => {
                problems.push(format!("{}.factor is missing: rope_type \"{kind}\" needs it", self.name));
                1.0
            }
        }
    }

    /// `original_max_position_embeddings`, or `max_position` when absent (transformers'
    /// standardization fills it so).
    fn original(&self, problems: &mut Vec<String>) -> usize {
        match self.num("original_max_position_embeddings", problems) {
            Some(n) if n >= 1.0 && n.fract() == 0.0 => n as usize,
            Some(n) => {
                problems.push(format!(
                    "{}.original_max_position_embeddings must be a positive integer, got {n}",
                    self.name
                ));
                self.max_position
            }
            None => self.max_position,
        }
    }

    /// The scaling of `kind` and the keys it reads.
    fn scaling(&self, kind: &str, problems: &mut Vec<String>) -> (RopeScaling, &'static [&'static str]) {
        let max_position = self.max_position;
        match kind {
            "default" => (RopeScaling::Default, &[]),
            "linear" => (RopeScaling::Linear { factor: self.factor(kind, None, problems) }, &["factor"]),
            "dynamic" => {
                (RopeScaling::Dynamic { factor: self.factor(kind, None, problems), max_position }, &["factor"])
            }
            "llama3" => (
                self.llama3(problems),
                &["factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"],
            ),
            "yarn" => (
                self.yarn(problems),
                &[
                    "factor",
                    "original_max_position_embeddings",
                    "attention_factor",
                    "beta_fast",
                    "beta_slow",
                    "mscale",
                    "mscale_all_dim",
                    "truncate",
                ],
            ),
            other => {
                problems.push(format!(
                    "{}.rope_type \"{other}\" is not supported: Ava implements default, linear, dynamic, llama3 and yarn",
                    self.name
                ));
                (RopeScaling::Default, &[])
            }
        }
    }

    /// Llama 3's frequency bands.
    fn llama3(&self, problems: &mut Vec<String>) -> RopeScaling {
        let name = self.name;
        let factor = self.factor("llama3", None, problems);
        let original_max_position = self.original(problems);
        let mut band = |key: &str| {
            self.num(key, problems).unwrap_or_else(|| {
                problems.push(format!("{name}.{key} is missing: rope_type \"llama3\" needs it"));
                1.0
            })
        };
        let (low_freq_factor, high_freq_factor) = (band("low_freq_factor"), band("high_freq_factor"));
        if high_freq_factor <= low_freq_factor {
            problems.push(format!(
                "{name}.high_freq_factor ({high_freq_factor}) must be above low_freq_factor ({low_freq_factor})"
            ));
        }
        RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position }
    }

    /// YaRN's interpolation, with transformers' defaults.
    fn yarn(&self, problems: &mut Vec<String>) -> RopeScaling {
        let original_max_position = self.original(problems);
        let factor = self.factor("yarn", Some(self.max_position as f64 / original_max_position as f64), problems);
        // transformers reads these with `or`: 0 and null both mean the default.
        let or = |v: Option<f64>, d: f64| v.filter(|x| *x != 0.0).unwrap_or(d);
        // `rope_parameters.get("truncate", True)`: absent is true, an explicit null false.
        let truncate = match self.params.get("truncate") {
            None => true,
            Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(v) => {
                problems.push(format!("{}.truncate must be true or false, got {v}", self.name));
                true
            }
        };
        RopeScaling::Yarn {
            factor,
            original_max_position,
            attention_factor: self.num("attention_factor", problems),
            beta_fast: or(self.num("beta_fast", problems), 32.0),
            beta_slow: or(self.num("beta_slow", problems), 1.0),
            mscale: or(self.num("mscale", problems), 0.0),
            mscale_all_dim: or(self.num("mscale_all_dim", problems), 0.0),
            truncate,
        }
    }
}

/// The attention window every layer uses (`None`: full causal attention), from Mistral's /
/// Mixtral's `sliding_window` or Qwen2's `use_sliding_window`, `max_window_layers` and
/// `layer_types`.
fn window_of(r: &mut Reader<'_>, arch: Arch, layers: usize) -> Option<usize> {
    let window = |r: &mut Reader<'_>, default: Option<usize>| match r.get("sliding_window") {
        // Absent: the class default; an explicit null: no window.
        None => {
            if r.obj.contains_key("sliding_window") {
                None
            } else {
                default
            }
        }
        Some(v) => match v.as_u64() {
            Some(n) if n >= 1 => Some(n as usize),
            _ => {
                r.problems.push(format!("sliding_window must be a positive integer or null, got {v}"));
                None
            }
        },
    };
    match arch {
        Arch::Llama => {
            r.not_read("sliding_window", arch);
            r.not_read("layer_types", arch);
            None
        }
        Arch::Mistral => window(r, Some(4096)),
        Arch::Mixtral => window(r, None),
        Arch::Qwen2 => {
            let use_window = r.bool("use_sliding_window", false);
            let w = window(r, Some(4096));
            let max_window_layers = r.int_from("max_window_layers", Some(28), 0, 1 << 20);
            let types: Vec<bool> = match r.get("layer_types") {
                Some(Value::Array(a)) if a.len() == layers => a
                    .iter()
                    .map(|t| match t.as_str() {
                        Some("sliding_attention") => true,
                        Some("full_attention") => false,
                        _ => {
                            r.problems.push(format!(
                                "layer_types entries must be \"full_attention\" or \"sliding_attention\", got {t}"
                            ));
                            false
                        }
                    })
                    .collect(),
                Some(v) => {
                    r.problems.push(format!("layer_types must be a list of {layers} layer types, got {v}"));
                    vec![false; layers]
                }
                // transformers 5's Qwen2Config: sliding from layer max_window_layers on.
                None => (0..layers).map(|i| w.is_some() && use_window && i >= max_window_layers).collect(),
            };
            if !use_window || w.is_none() || !types.iter().any(|&s| s) {
                return None;
            }
            if types.iter().all(|&s| s) {
                return w;
            }
            let sliding: Vec<String> =
                types.iter().enumerate().filter(|(_, s)| **s).map(|(i, _)| i.to_string()).collect();
            r.problems.push(format!(
                "use_sliding_window is true with a window in layers {} only (layer_types / max_window_layers): Ava \
                 applies one attention to every layer",
                sliding.join(", ")
            ));
            None
        }
    }
}

use super::spec::{MAX_LAYER_EXPERTS, MAX_PARAMS, param_count};

/// Reads a config.json value; `path` names the file in errors. Stages, in the order the
/// fields are read and their problems listed: the architecture (`arch_of`), the sizes, the
/// activation and norm, the positions and RoPE, attention, Mixtral's experts, what Ava does
/// not train from, the sizes together, then a note of the fields nothing reads.
pub fn parse_hf_config(v: &Value, path: &Path) -> Result<HfConfig, ModelError> {
    let err = |problems: Vec<String>| ModelError::HfConfig {
        path: path.to_path_buf(),
        message: if problems.len() == 1 {
            problems[0].clone()
        } else {
            format!("{} problems:\n  - {}", problems.len(), problems.join("\n  - "))
        },
    };
    let Some(obj) = v.as_object() else { return Err(err(vec!["not a JSON object".into()])) };
    let mut r = Reader { obj, used: Vec::new(), problems: Vec::new(), notes: Vec::new() };
    let Some(arch) = arch_of(&mut r) else { return Err(err(r.problems)) };
    let d = defaults(arch);
    let sizes = sizes_of(&mut r, &d);
    let eps = eps_of(&mut r, &d);
    let tie_embeddings = r.bool("tie_word_embeddings", false);
    let init_std = r.float("initializer_range", 0.02);
    let (max_position, rope) = positions_of(&mut r, &d, sizes.head_dim);
    let (bias, sliding_window) = attention_of(&mut r, arch, sizes.layers);
    let moe = (arch == Arch::Mixtral).then(|| moe_of(&mut r));
    refuse_foreign(&mut r);
    check_totals(&mut r, &sizes, moe, tie_embeddings);
    note_unknown(&mut r, obj, arch);
    if !r.problems.is_empty() {
        return Err(err(r.problems));
    }
    let Sizes { vocab, hidden, layers, heads, kv_heads, head_dim, ffn } = sizes;
    let spec = ModelSpec {
        arch,
        vocab,
        hidden,
        layers,
        heads,
        kv_heads,
        head_dim,
        ffn,
        rope,
        eps,
        tie_embeddings,
        init_std,
        bias,
        sliding_window,
        max_position,
        moe,
    };
    spec.validate(&path.display().to_string())?;
    Ok(HfConfig { spec, notes: r.notes })
}

/// The model's sizes, as config.json gives them.
struct Sizes {
    vocab: usize,
    hidden: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    ffn: usize,
}

/// Reads the sizes (transformers' defaults for `num_key_value_heads` and `head_dim`), and
/// refuses head counts that do not divide as attention needs.
fn sizes_of(r: &mut Reader<'_>, d: &Defaults) -> Sizes {
    let vocab = r.int("vocab_size", None, 1 << 31);
    let hidden = r.int("hidden_size", None, 1 << 20);
    let layers = r.int("num_hidden_layers", None, 4096);
    let heads = r.int("num_attention_heads", None, 1 << 16);
    let ffn = r.int("intermediate_size", None, 1 << 22);
    let kv_heads = r.int("num_key_value_heads", Some(d.kv_heads.unwrap_or(heads)), 1 << 16);
    // transformers: `head_dim` if set, else hidden_size // num_attention_heads.
    let head_dim_given = r.obj.get("head_dim").is_some_and(|v| !v.is_null());
    let head_dim = r.int("head_dim", Some(hidden / heads.max(1)), 1 << 16);
    if !head_dim_given && heads > 0 && !hidden.is_multiple_of(heads) {
        r.problems.push(format!(
            "hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads}), and there is no head_dim: \
             fix one of them, or set head_dim"
        ));
    }
    if heads > 0 && kv_heads > 0 && !heads.is_multiple_of(kv_heads) {
        r.problems.push(format!(
            "num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads}); grouped-query \
             attention shares each key/value head among a whole number of query heads"
        ));
    }
    Sizes { vocab, hidden, layers, heads, kv_heads, head_dim, ffn }
}

/// Refuses an activation other than SwiGLU's, and reads the norm's ε (between 0 and 1).
fn eps_of(r: &mut Reader<'_>, d: &Defaults) -> f64 {
    if let Some(act) = r.get("hidden_act")
        && !matches!(act.as_str(), Some("silu" | "swish"))
    {
        r.problems.push(format!("hidden_act is {act}: Ava's MLP is SwiGLU (\"silu\")"));
    }
    let eps = r.float("rms_norm_eps", d.eps);
    if !(eps > 0.0 && eps < 1.0) {
        r.problems.push(format!("rms_norm_eps must be between 0 and 1, got {eps}"));
    }
    eps
}

/// `max_position_embeddings` (`None` when absent) and the RoPE settings ([`rope_of`]).
fn positions_of(r: &mut Reader<'_>, d: &Defaults, head_dim: usize) -> (Option<usize>, RopeSpec) {
    // Kept as given (absent stays absent when written back); RoPE scalings use the class
    // default in its place, as transformers does.
    let given_max_position = r.obj.get("max_position_embeddings").is_some_and(|v| !v.is_null());
    let max_position = r.int("max_position_embeddings", Some(d.max_position), 1 << 30);
    let rope = rope_of(r, d.theta, max_position, head_dim);
    (given_max_position.then_some(max_position), rope)
}

/// The attention settings: dropout refused, the biases of `arch` (the keys it does not read
/// noted), and the window ([`window_of`]).
fn attention_of(r: &mut Reader<'_>, arch: Arch, layers: usize) -> (Biases, Option<usize>) {
    let dropout = r.float("attention_dropout", 0.0);
    if dropout != 0.0 {
        r.problems.push(format!(
            "attention_dropout is {dropout}: Ava trains without dropout, so the run would differ from transformers'; \
             set it to 0.0"
        ));
    }
    let bias = match arch {
        Arch::Llama => {
            let attn = r.bool("attention_bias", false);
            Biases { qkv: attn, o: attn, mlp: r.bool("mlp_bias", false) }
        }
        // Qwen2's q/k/v projections always have a bias, its o_proj never (modeling_qwen2.py).
        Arch::Qwen2 => Biases { qkv: true, o: false, mlp: false },
        Arch::Mistral | Arch::Mixtral => Biases::default(),
    };
    if arch != Arch::Llama {
        r.not_read("attention_bias", arch);
        r.not_read("mlp_bias", arch);
    }
    let sliding_window = window_of(r, arch, layers);
    (bias, sliding_window)
}

/// Mixtral's experts: their number and top-k, the router settings that would change training
/// refused, and the weight of Ava's own load-balancing loss.
fn moe_of(r: &mut Reader<'_>) -> MoeSpec {
    let experts = r.int("num_local_experts", Some(8), 4096);
    let top_k = r.int("num_experts_per_tok", Some(2), 4096);
    let coef = r.float("router_aux_loss_coef", 0.001);
    let jitter = r.float("router_jitter_noise", 0.0);
    if jitter != 0.0 {
        r.problems
            .push(format!("router_jitter_noise is {jitter}: Ava's router adds no noise in training; set it to 0.0"));
    }
    if r.bool("output_router_logits", false) {
        r.problems.push(format!(
            "output_router_logits is true, which adds transformers' load-balancing loss (weight {coef}, pooled over \
             all layers): Ava's mixture adds a per-block Switch loss instead, a different gradient. Set it to false \
             to train without one, as transformers does by default"
        ));
    }
    // Without output_router_logits transformers trains on the cross-entropy alone; a
    // folder Ava wrote names the weight of Ava's own per-block loss under its own key,
    // which transformers does not read.
    let aux_weight = r.float(AVA_AUX_KEY, 0.0);
    MoeSpec { experts, top_k, aux_weight }
}

/// Refuses what Ava does not train from: quantized checkpoints and custom modeling code.
fn refuse_foreign(r: &mut Reader<'_>) {
    if r.get("quantization_config").is_some() {
        r.problems
            .push("quantization_config is set: Ava trains full-precision weights, not quantized checkpoints".into());
    }
    if let Some(map) = r.get("auto_map")
        && map.get("AutoModelForCausalLM").is_some()
    {
        r.problems.push(format!(
            "auto_map names custom modeling code ({}), which Ava does not run and whose math it cannot check",
            map["AutoModelForCausalLM"]
        ));
    }
}

/// Refuses sizes that are each in range but together describe more expert blocks or more
/// parameters than Ava accepts.
fn check_totals(r: &mut Reader<'_>, sizes: &Sizes, moe: Option<MoeSpec>, tie_embeddings: bool) {
    let Sizes { vocab, hidden, layers, heads, kv_heads, head_dim, ffn } = *sizes;
    // Each number is in range alone, but together they may describe more parameters than any
    // machine holds: refused here, before the model (or its estimate) is sized by them.
    let experts = moe.map_or(1, |m| m.experts);
    // Every expert of every layer is its own tensors (and its own bookkeeping).
    if (layers as u128) * (experts as u128) > MAX_LAYER_EXPERTS {
        r.problems.push(format!(
            "num_hidden_layers {layers} × num_local_experts {experts} is more than the {MAX_LAYER_EXPERTS} expert \
             blocks Ava accepts; is it the right config.json?"
        ));
    }
    if let Some(total) = param_count(vocab, hidden, layers, heads, kv_heads, head_dim, ffn, experts, tie_embeddings)
        && total > MAX_PARAMS
    {
        r.problems.push(format!(
            "vocab_size {vocab}, hidden_size {hidden}, num_hidden_layers {layers}, num_attention_heads {heads}, \
             intermediate_size {ffn}{} make {total} parameters, more than the {MAX_PARAMS} Ava accepts; is it the \
             right config.json?",
            if moe.is_some() { format!(", num_local_experts {experts}") } else { String::new() }
        ));
    }
}

/// Notes the fields of `obj` that were not read and are not known to be inert: transformers'
/// class for `arch` does not read them either.
fn note_unknown(r: &mut Reader<'_>, obj: &Map<String, Value>, arch: Arch) {
    let mut unknown: Vec<&str> =
        obj.keys().map(String::as_str).filter(|k| !r.used.contains(k) && !INERT.contains(k)).collect();
    unknown.sort_unstable();
    if !unknown.is_empty() {
        r.notes.push(format!(
            "fields Ava does not know, ignored (transformers' {} does not read them either): {}",
            arch.class_name(),
            unknown.join(", ")
        ));
    }
}

/// Reads `path` (a config.json).
pub fn read_hf_config(path: &Path) -> Result<HfConfig, ModelError> {
    let text = super::hf::read_bounded(path, ava_fs::bounded::limits::JSON)?;
    let v: Value = serde_json::from_slice(&text)
        .map_err(|e| ModelError::HfConfig { path: path.to_path_buf(), message: format!("not JSON: {e}") })?;
    parse_hf_config(&v, path)
}

impl ModelSpec {
    /// Reads a Hugging Face `config.json` (see [`read_hf_config`] for its notes).
    pub fn from_hf_config(path: &Path) -> Result<Self, ModelError> {
        Ok(read_hf_config(path)?.spec)
    }

    /// The Hugging Face `config.json` describing this model, with RoPE in both transformers
    /// 4's form (`rope_theta`, `rope_scaling`) and 5's (`rope_parameters`).
    pub fn to_hf_config(&self) -> Value {
        let (rope_scaling, rope_parameters) = rope_json(&self.rope);
        let mut v = json!({
            "architectures": [self.arch.class_name()],
            "model_type": self.arch.model_type(),
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.ffn,
            "hidden_act": "silu",
            "rms_norm_eps": self.eps,
            "tie_word_embeddings": self.tie_embeddings,
            "initializer_range": self.init_std,
            "attention_dropout": 0.0,
            "rope_theta": self.rope.theta,
            "rope_scaling": rope_scaling,
            "rope_parameters": rope_parameters,
            "torch_dtype": "float32",
            "dtype": "float32",
        });
        let max_position = match self.rope.scaling {
            RopeScaling::Dynamic { max_position, .. } => Some(max_position),
            _ => self.max_position,
        };
        if let Some(m) = max_position {
            v["max_position_embeddings"] = json!(m);
        }
        match self.arch {
            Arch::Llama => {
                v["attention_bias"] = json!(self.bias.qkv);
                v["mlp_bias"] = json!(self.bias.mlp);
            }
            Arch::Mistral | Arch::Mixtral => v["sliding_window"] = json!(self.sliding_window),
            Arch::Qwen2 => {
                v["use_sliding_window"] = json!(self.sliding_window.is_some());
                v["sliding_window"] = json!(self.sliding_window);
                v["max_window_layers"] = json!(if self.sliding_window.is_some() { 0 } else { self.layers });
                let kind = if self.sliding_window.is_some() { "sliding_attention" } else { "full_attention" };
                v["layer_types"] = json!(vec![kind; self.layers]);
            }
        }
        if let Some(moe) = self.moe {
            v["num_local_experts"] = json!(moe.experts);
            v["num_experts_per_tok"] = json!(moe.top_k);
            // Ava's per-block balancing loss is not transformers' pooled one: transformers is
            // asked for none, and Ava's weight goes under a key only Ava reads.
            v["output_router_logits"] = json!(false);
            v[AVA_AUX_KEY] = json!(moe.aux_weight);
            v["router_jitter_noise"] = json!(0.0);
        }
        v
    }
}

/// RoPE as `rope_scaling` (transformers 4: null for plain RoPE, no θ inside) and
/// `rope_parameters` (transformers 5: always, with θ).
fn rope_json(rope: &RopeSpec) -> (Value, Value) {
    let mut fields = Map::new();
    fields.insert("rope_type".into(), json!(rope.type_name()));
    match rope.scaling {
        RopeScaling::Default => {}
        RopeScaling::Linear { factor } | RopeScaling::Dynamic { factor, .. } => {
            fields.insert("factor".into(), json!(factor));
        }
        RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position } => {
            fields.insert("factor".into(), json!(factor));
            fields.insert("low_freq_factor".into(), json!(low_freq_factor));
            fields.insert("high_freq_factor".into(), json!(high_freq_factor));
            fields.insert("original_max_position_embeddings".into(), json!(original_max_position));
        }
        RopeScaling::Yarn {
            factor,
            original_max_position,
            attention_factor,
            beta_fast,
            beta_slow,
            mscale,
            mscale_all_dim,
            truncate,
        } => {
            fields.insert("factor".into(), json!(factor));
            fields.insert("original_max_position_embeddings".into(), json!(original_max_position));
            if let Some(a) = attention_factor {
                fields.insert("attention_factor".into(), json!(a));
            }
            fields.insert("beta_fast".into(), json!(beta_fast));
            fields.insert("beta_slow".into(), json!(beta_slow));
            if mscale != 0.0 {
                fields.insert("mscale".into(), json!(mscale));
            }
            if mscale_all_dim != 0.0 {
                fields.insert("mscale_all_dim".into(), json!(mscale_all_dim));
            }
            if !truncate {
                fields.insert("truncate".into(), json!(false));
            }
        }
    }
    let scaling = if rope.scaling == RopeScaling::Default { Value::Null } else { Value::Object(fields.clone()) };
    fields.insert("rope_theta".into(), json!(rope.theta));
    (scaling, Value::Object(fields))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn parse(v: Value) -> Result<HfConfig, String> {
        parse_hf_config(&v, Path::new("m/config.json")).map_err(|e| e.to_string())
    }

    fn llama(extra: Value) -> Value {
        let mut v = json!({
            "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 48,
        });
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        v
    }

    /// Issue 20: sizes are checked alone and together, by key, before anything is sized by
    /// them.
    #[test]
    fn zero_heads_and_sizes_that_do_not_fit_together_are_refused_by_key() {
        let e = parse(llama(json!({"num_attention_heads": 0}))).unwrap_err();
        assert!(e.starts_with("m/config.json: num_attention_heads must be an integer from 1 to 65536, got 0"), "{e}");
        let e = parse(llama(json!({"num_attention_heads": 5}))).unwrap_err();
        assert!(e.contains("hidden_size (32) is not a multiple of num_attention_heads (5)"), "{e}");
        let e = parse(llama(json!({"num_key_value_heads": 3}))).unwrap_err();
        assert!(e.contains("num_attention_heads (4) is not a multiple of num_key_value_heads (3)"), "{e}");
        // Each in range, together 4.5 × 10^15 parameters.
        let huge = json!({"vocab_size": 1u64 << 31, "hidden_size": 1 << 20, "num_hidden_layers": 4096,
            "intermediate_size": 1 << 22, "num_attention_heads": 1 << 12});
        let e = parse(llama(huge)).unwrap_err();
        assert!(e.contains("parameters, more than the 2000000000000 Ava accepts; is it the right config.json?"), "{e}");
        let mut moe = llama(json!({"num_hidden_layers": 4096, "num_local_experts": 4096}));
        moe["model_type"] = "mixtral".into();
        moe["architectures"] = json!(["MixtralForCausalLM"]);
        let e = parse(moe).unwrap_err();
        assert!(e.contains("num_hidden_layers 4096 × num_local_experts 4096 is more than the 65536"), "{e}");
    }

    /// A missing field takes the value of transformers' config class of that architecture.
    #[test]
    fn missing_fields_take_transformers_defaults_per_architecture() {
        let base = json!({"vocab_size": 64, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 32,
                          "intermediate_size": 48});
        let with = |mt: &str| {
            let mut v = base.clone();
            v["model_type"] = json!(mt);
            parse(v).unwrap().spec
        };
        let l = with("llama");
        assert_eq!((l.kv_heads, l.eps, l.rope, l.sliding_window), (32, 1e-6, RopeSpec::plain(1e4), None));
        let m = with("mistral");
        assert_eq!((m.kv_heads, m.sliding_window), (8, Some(4096)));
        let x = with("mixtral");
        assert_eq!((x.kv_heads, x.eps, x.rope.theta, x.sliding_window), (8, 1e-5, 1e6, None));
        assert_eq!(x.moe, Some(MoeSpec { experts: 8, top_k: 2, aux_weight: 0.0 }));
        let q = with("qwen2");
        assert_eq!((q.kv_heads, q.bias, q.sliding_window), (32, Biases { qkv: true, o: false, mlp: false }, None));
        // An explicit null window is no window, in Mistral as in transformers.
        let mut v = base.clone();
        v["model_type"] = json!("mistral");
        v["sliding_window"] = Value::Null;
        assert_eq!(parse(v).unwrap().spec.sliding_window, None);
    }

    #[test]
    fn rope_theta_is_read_from_either_form_and_a_disagreement_is_refused() {
        let top = parse(llama(json!({"rope_theta": 5e5}))).unwrap().spec.rope;
        let nested = parse(llama(json!({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}))).unwrap();
        assert_eq!((top, nested.spec.rope), (RopeSpec::plain(5e5), RopeSpec::plain(5e5)));
        let err =
            parse(llama(json!({"rope_theta": 1e4, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})))
                .unwrap_err();
        assert!(err.contains("rope_theta (10000.0) and rope_parameters.rope_theta (500000) disagree"), "{err}");
        // rope_scaling wins over rope_parameters (transformers 5), and must agree with it.
        let err = parse(llama(json!({"rope_scaling": {"rope_type": "linear", "factor": 2.0},
                                     "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})))
        .unwrap_err();
        assert!(err.contains("rope_scaling ({") && err.contains("}) and rope_parameters ({"), "{err}");
        assert!(err.contains("disagree: keep one"), "{err}");
    }

    #[test]
    fn every_problem_is_refused_by_name_at_once() {
        let err = parse(llama(json!({
            "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]},
            "hidden_act": "gelu",
            "attention_dropout": 0.1,
            "partial_rotary_factor": 0.5,
            "quantization_config": {"quant_method": "gptq"},
            "num_hidden_layers": 0,
        })))
        .unwrap_err();
        for want in [
            "6 problems",
            "num_hidden_layers must be an integer from 1 to 4096, got 0",
            "hidden_act is \"gelu\": Ava's MLP is SwiGLU",
            "attention_dropout is 0.1: Ava trains without dropout",
            "partial_rotary_factor is 0.5",
            "rope_scaling.rope_type \"longrope\" is not supported: Ava implements default, linear, dynamic, llama3 and yarn",
            "quantization_config is set",
            "m/config.json",
        ] {
            assert!(err.contains(want), "missing {want:?} in:\n{err}");
        }
        let err = parse(llama(json!({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}))).unwrap_err();
        assert!(err.contains("rope_scaling.low_freq_factor is missing: rope_type \"llama3\" needs it"), "{err}");
    }

    #[test]
    fn architectures_ava_does_not_implement_are_refused_with_the_reason() {
        let mut v = llama(json!({}));
        v["model_type"] = json!("qwen3");
        let err = parse(v).unwrap_err();
        assert!(err.contains("model_type \"qwen3\" is not supported: it normalizes q and k per head"), "{err}");
        assert!(err.contains("Ava implements llama, mistral, mixtral and qwen2 exactly"), "{err}");
        let mut v = llama(json!({"architectures": ["LlamaForSequenceClassification"]}));
        let err = parse(v.clone()).unwrap_err();
        assert!(err.contains("architectures names LlamaForSequenceClassification"), "{err}");
        v.as_object_mut().unwrap().remove("model_type");
        v["architectures"] = json!(["GPT2LMHeadModel"]);
        let err = parse(v).unwrap_err();
        assert!(
            err.contains("no model_type, and architectures (GPT2LMHeadModel) names no class Ava implements"),
            "{err}"
        );
        let v = llama(json!({"auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}}));
        assert!(parse(v).unwrap_err().contains("auto_map names custom modeling code"));
    }

    #[test]
    fn qwen2_windows_in_some_layers_only_are_refused() {
        let qwen = |extra: Value| {
            let mut v = llama(extra);
            v["model_type"] = json!("qwen2");
            v["architectures"] = json!(["Qwen2ForCausalLM"]);
            v["num_key_value_heads"] = json!(2);
            parse(v)
        };
        let err = qwen(json!({"use_sliding_window": true, "sliding_window": 8, "max_window_layers": 1})).unwrap_err();
        assert!(err.contains("a window in layers 1 only"), "{err}");
        let all = qwen(json!({"use_sliding_window": true, "sliding_window": 8, "max_window_layers": 0})).unwrap();
        assert_eq!(all.spec.sliding_window, Some(8));
        let off = qwen(json!({"use_sliding_window": false, "sliding_window": 8})).unwrap();
        assert_eq!(off.spec.sliding_window, None);
    }

    #[test]
    fn mixtral_router_settings_that_change_training_are_refused() {
        let mut v = llama(json!({"output_router_logits": true, "router_jitter_noise": 0.1}));
        v["model_type"] = json!("mixtral");
        v["architectures"] = json!(["MixtralForCausalLM"]);
        let err = parse(v).unwrap_err();
        assert!(err.contains("output_router_logits is true"), "{err}");
        assert!(err.contains("router_jitter_noise is 0.1"), "{err}");
    }

    #[test]
    fn fields_that_change_nothing_are_noted() {
        let c = parse(llama(json!({"sliding_window": 4096, "my_field": 1, "bos_token_id": 1}))).unwrap();
        assert_eq!(c.notes.len(), 2, "{:?}", c.notes);
        assert!(c.notes[0].contains("sliding_window (4096) is not read by transformers' llama"), "{:?}", c.notes);
        assert!(c.notes[1].contains("fields Ava does not know, ignored"), "{:?}", c.notes);
        assert!(c.notes[1].ends_with(": my_field"), "{:?}", c.notes);
    }
}
