//! The engine's config sections (`model`, `data`, `train`, `checkpoints`, `memory`,
//! `offload`), typed.
//! Their keys, ranges and defaults are in the schema table and `default.yaml`; these structs
//! are what the engine reads after validation.

use std::fmt;
use std::path::PathBuf;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The `model` section: a Llama-style decoder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// A local Hugging Face folder (`config.json` + `*.safetensors`) to start from; its
    /// `config.json` then gives the architecture and the keys below are ignored.
    pub from: Option<PathBuf>,
    /// Vocabulary size V (256 for byte-level data).
    pub vocab_size: usize,
    /// Model width d.
    pub hidden_size: usize,
    /// Transformer blocks L.
    pub num_layers: usize,
    /// Query heads H (d must be a multiple of H).
    pub num_heads: usize,
    /// Key/value heads (H must be a multiple of it; fewer than H is grouped-query attention).
    pub num_kv_heads: usize,
    /// Hidden width of the SwiGLU MLP.
    pub intermediate_size: usize,
    /// RoPE base frequency θ.
    pub rope_theta: f64,
    /// RMSNorm ε.
    pub rms_norm_eps: f64,
    /// Share the token embedding with the LM head.
    pub tie_embeddings: bool,
    /// Standard deviation of the initial weights.
    pub init_std: f64,
    /// Mixture of experts in place of the dense MLP.
    pub moe: MoeConfig,
}

/// The `model.moe` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoeConfig {
    /// Experts per block; 0 keeps the dense MLP.
    pub num_experts: usize,
    /// Experts each token is routed to.
    pub top_k: usize,
    /// Weight of the load-balancing loss (Switch Transformer's α).
    pub aux_loss_weight: f64,
}

/// `data.source`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataSource {
    /// The seeded Markov corpus with a known entropy floor.
    Synthetic,
    /// A local text file (`data.path`), byte-level or through `data.tokenizer`.
    Text,
    /// A corpus prepared by `ava data prepare` (`data.path` is its directory), read through
    /// memory maps.
    Shards,
}

/// The `data` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    /// Where the tokens come from.
    pub source: DataSource,
    /// The text file (`source: text`), or the corpus directory (`source: shards`).
    pub path: Option<PathBuf>,
    /// A Hugging Face `tokenizer.json`; without one, text is read as bytes.
    pub tokenizer: Option<PathBuf>,
    /// Tokens per training sequence T.
    pub seq_len: usize,
    /// Fraction of the data held out for validation.
    pub val_fraction: f64,
    /// Background threads preparing batches (0: prepared on the training thread).
    pub num_workers: usize,
    /// Finished batches each worker may queue ahead.
    pub prefetch_factor: usize,
    /// Several prepared corpora and their shares (`source: shards`, instead of `path`).
    #[serde(default)]
    pub mix: Mix,
    /// How sequences treat document boundaries.
    #[serde(default)]
    pub packing: crate::data::Packing,
    /// The synthetic corpus.
    pub synthetic: SyntheticConfig,
}

/// The `data.synthetic` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SyntheticConfig {
    /// Symbols of the source (mapped into the byte vocabulary).
    pub alphabet: usize,
    /// Markov order: how many previous symbols decide the next one.
    pub order: usize,
    /// Possible next symbols per context.
    pub branching: usize,
}

/// `train.precision`: the compute type (and, with `train.master_weights` other than f32, the
/// weights' type).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// f32 everywhere.
    Fp32,
    /// bfloat16 compute.
    Bf16,
    /// float16 compute with dynamic loss scaling.
    F16,
}

impl Precision {
    /// The names accepted in a config.
    pub const NAMES: &'static [&'static str] = &["fp32", "bf16", "f16"];

    /// The name as written in a config.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Fp32 => "fp32",
            Self::Bf16 => "bf16",
            Self::F16 => "f16",
        }
    }

    /// Bytes per element of the compute type.
    pub fn bytes(self) -> usize {
        match self {
            Self::Fp32 => 4,
            Self::Bf16 | Self::F16 => 2,
        }
    }
}

/// `train.master_weights`: where the weights the optimizer steps live, and in what type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MasterWeights {
    /// f32 master weights in memory; the forward pass uses a cast to `train.precision`.
    F32,
    /// No master copy: the weights live only in `train.precision` (bf16 or f16). Each step
    /// widens one parameter to f32, steps it, and rounds it back stochastically.
    None,
    /// As `none`, plus a compensation buffer in `train.precision` holding what rounding lost.
    Kahan,
    /// f32 masters in the offload tier, streamed with the optimizer state; the resident
    /// weights are their rounding to `train.precision`.
    Tier,
}

impl MasterWeights {
    /// The names accepted in a config.
    pub const NAMES: &'static [&'static str] = &["f32", "none", "kahan", "tier"];

    /// The name as written in a config.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::None => "none",
            Self::Kahan => "kahan",
            Self::Tier => "tier",
        }
    }
}

/// `train.nan_policy`: what a step whose loss or gradient is not finite (NaN or infinite)
/// does, when f16's loss scaler cannot absorb it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NanPolicy {
    /// End the run with an error naming the step, what was not finite and the last
    /// checkpoint; nothing of the step is applied or saved.
    Stop,
    /// Skip the step's optimizer update (the state stays as it was), warn, and stop as
    /// `stop` does after [`NanPolicy::MAX_CONSECUTIVE_SKIPS`] skipped steps in a row.
    Skip,
}

impl NanPolicy {
    /// The names accepted in a config.
    pub const NAMES: &'static [&'static str] = &["stop", "skip"];

    /// Under `skip`, this many non-finite steps in a row end the run: a run that produces
    /// nothing but NaN does not recover by skipping.
    pub const MAX_CONSECUTIVE_SKIPS: u64 = 10;

    /// The name as written in a config.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Skip => "skip",
        }
    }
}

/// The `train` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    /// Seeds the initial weights and the data order.
    pub seed: u64,
    /// Optimizer steps to run (`--max-steps`).
    pub max_steps: u64,
    /// Sequences per forward/backward pass.
    pub micro_batch_size: usize,
    /// Micro-batches whose gradients are summed before each optimizer step.
    pub gradient_accumulation_steps: usize,
    /// Where the run computes: `cpu`, `cuda` or `cuda:N`.
    #[serde(default)]
    pub device: crate::device::DeviceSpec,
    /// Compute precision.
    pub precision: Precision,
    /// Where the weights the optimizer steps live.
    pub master_weights: MasterWeights,
    /// Step each parameter as soon as its gradient is final, inside backward, so the
    /// whole-model gradient buffer never exists.
    pub step_in_backward: bool,
    /// Rows of the LM head and the cross-entropy computed at once (`model::head_loss`): the
    /// (B·T, V) logits exist a block of this many rows at a time, in forward and again in
    /// backward, instead of whole and kept for backward. 0: the logits whole, kept.
    #[serde(default = "default_loss_chunk_rows")]
    pub loss_chunk_rows: usize,
    /// What a step with a non-finite loss or gradient does.
    pub nan_policy: NanPolicy,
    /// Peak learning rate.
    pub lr: f64,
    /// Learning rate at the end of the cosine decay.
    pub min_lr: f64,
    /// Steps of linear warmup from 0 to `lr`.
    pub warmup_steps: u64,
    /// Decoupled weight decay for matrices (norm weights are not decayed).
    pub weight_decay: f64,
    /// Clip the global gradient norm to this (0: no clipping).
    pub grad_clip: f64,
    /// Compute threads (0: one per core).
    pub threads: usize,
    /// Evaluate every this many steps (0: only at the end).
    pub eval_every: u64,
    /// Validation batches per evaluation.
    pub eval_batches: usize,
    /// Sequences per validation batch (`None`: `micro_batch_size`). An evaluation covers
    /// `eval_batches × eval_batch_size` sequences.
    pub eval_batch_size: Option<usize>,
    /// Print a sample of `sample_tokens` generated tokens every this many steps (0: never),
    /// as llm.c does: what the model writes from the start of a document.
    #[serde(default)]
    pub sample_every: u64,
    /// Tokens in each such sample.
    #[serde(default = "default_sample_tokens")]
    pub sample_tokens: usize,
    /// Write a metrics line every this many steps.
    pub log_every: u64,
    /// What the run directory gets besides `metrics.jsonl`.
    #[serde(default)]
    pub log: LogConfig,
    /// The run directory: metrics, checkpoints, the effective config.
    pub out_dir: PathBuf,
    /// Dynamic loss scaling (used with `precision: f16`).
    pub loss_scale: LossScaleConfig,
}

impl TrainConfig {
    /// Sequences per optimizer step.
    pub fn effective_batch(&self) -> usize {
        self.micro_batch_size * self.gradient_accumulation_steps
    }

    /// Sequences per validation batch: `eval_batch_size`, or the micro-batch size.
    pub fn eval_batch(&self) -> usize {
        self.eval_batch_size.unwrap_or(self.micro_batch_size)
    }
}

fn default_sample_tokens() -> usize {
    64
}

fn default_loss_chunk_rows() -> usize {
    crate::model::DEFAULT_LOSS_CHUNK_ROWS
}

/// The `train.log` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogConfig {
    /// TensorBoard event files of the metrics' scalars and texts (`train/tensorboard.rs`).
    pub tensorboard: bool,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self { tensorboard: true }
    }
}

/// The `train.loss_scale` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LossScaleConfig {
    /// The starting scale.
    pub init: f64,
    /// Steps without overflow before the scale doubles.
    pub growth_interval: u64,
}

/// The `checkpoints` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointsConfig {
    /// Save every this many steps (0: only at the end).
    pub every: u64,
    /// Checkpoints kept; older ones are deleted.
    pub keep_last: usize,
}

/// The `memory` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryConfig {
    /// What the run may use; the memory policy acts on fractions of it.
    pub budget: ByteSize,
    /// Where memory runs out (0: nowhere); not below `budget`. On CPU nothing fails: the
    /// micro-step whose allocations cross it is abandoned and retried at half the micro-batch,
    /// as a device out-of-memory error would be. On a GPU it caps the device memory the run's
    /// allocations may hold (at most the card's): one past it stops the run with the device's
    /// out-of-memory error, as on a card of that size.
    pub hard_limit: ByteSize,
}

/// The `offload` section: where the optimizer state lives between steps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OffloadConfig {
    /// The optimizer state's placement by fraction of its bytes: `device` (the memory the run
    /// computes in), `ram` (host memory: on a GPU run page-locked, streamed through the device)
    /// and the tier `plugins.offload` names ([`Tiers`]).
    pub tiers: Tiers,
    /// Parameters whose offloaded state is read ahead while the optimizer steps another.
    pub prefetch: usize,
}

/// The `distributed` section: how the ranks of `mpirun -np N ava train` share the work.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DistributedConfig {
    /// ZeRO stage: 0 all-reduces gradients (plain data parallel); 1 also partitions the
    /// optimizer state; 2 also the gradients.
    pub zero_stage: u8,
    /// Gradients and parameters travel in buckets of about this many bytes.
    pub bucket_size: ByteSize,
}

/// One corpus of a mixture and its share of the sequences.
#[derive(Debug, Clone, PartialEq)]
pub struct MixShare {
    /// The corpus directory (written by `ava data prepare`).
    pub path: PathBuf,
    /// In (0, 1].
    pub fraction: f64,
}

/// `[corpora/books: 70%, corpora/code: 30%]`: prepared corpora whose shares add up to 100%;
/// empty for none.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Mix(pub Vec<MixShare>);

impl Mix {
    /// What a config's `data.mix` must look like, for messages.
    pub const EXPECTED: &str = "expected a list of corpus shares such as [corpora/books: 70%, corpora/code: 30%]";

    /// Reads the list from its config value; the error says what is wrong with it.
    pub fn from_value(value: &serde_json::Value) -> Result<Self, String> {
        use serde_json::Value;
        let items = match value {
            Value::Null => return Ok(Self::default()),
            Value::Array(items) => items,
            other => return Err(format!("{}, got {}", Self::EXPECTED, super::format::type_phrase(other))),
        };
        if items.is_empty() {
            return Ok(Self::default());
        }
        let empty_name = |name: &str| {
            if name.trim().is_empty() { Err("the corpus directory is empty".to_string()) } else { Ok(()) }
        };
        let shares = named_shares(items, Self::EXPECTED, "corpus: share", ("30%", "(0, 1]"), empty_name)?;
        let shares: Vec<MixShare> =
            shares.into_iter().map(|(path, fraction)| MixShare { path: PathBuf::from(path), fraction }).collect();
        // As paths, `corpora/a/` and `corpora/a` are one corpus.
        for (i, s) in shares.iter().enumerate() {
            if shares[..i].iter().any(|t| t.path == s.path) {
                return Err(format!("entry {i}: '{}' is listed twice", s.path.display()));
            }
        }
        Ok(Self(shares))
    }

    fn to_value(&self) -> serde_json::Value {
        serde_json::Value::Array(
            self.0.iter().map(|s| serde_json::json!({ s.path.display().to_string(): percent(s.fraction) })).collect(),
        )
    }
}

impl Serialize for Mix {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.to_value().serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Mix {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = serde_json::Value::deserialize(deserializer)?;
        Self::from_value(&value).map_err(serde::de::Error::custom)
    }
}

/// The entries of a list of shares such as `[ram: 60%, nvme: 40%]`: each one `name: share`
/// (`form` says which, for messages), the share in `range` (its example and interval, as
/// `("40%", "[0, 1]")`; "(0" excludes zero), the name accepted by `name_ok`, no name twice,
/// and the shares adding up to 100%.
fn named_shares(
    items: &[serde_json::Value],
    expected: &str,
    form: &str,
    range: (&str, &str),
    name_ok: impl Fn(&str) -> Result<(), String>,
) -> Result<Vec<(String, f64)>, String> {
    let (example, interval) = range;
    let positive = interval.starts_with('(');
    let mut shares: Vec<(String, f64)> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let (name, value) = match item {
            serde_json::Value::Object(map) if map.len() == 1 => map.iter().next().expect("one entry"),
            _ => return Err(format!("entry {i}: {expected}: each entry is one `{form}`")),
        };
        let in_range = |f: &f64| (0.0..=1.0).contains(f) && !(positive && *f == 0.0);
        let Some(fraction) = share(value).filter(in_range) else {
            return Err(format!(
                "entry {i} ({name}): the share must be a percentage such as {example} or a fraction in {interval}, got {}",
                super::format::yaml_flow(value)
            ));
        };
        name_ok(name).map_err(|e| format!("entry {i}: {e}"))?;
        if shares.iter().any(|(n, _)| n == name) {
            return Err(format!("entry {i}: '{name}' is listed twice"));
        }
        shares.push((name.clone(), fraction));
    }
    let total: f64 = shares.iter().map(|s| s.1).sum();
    if (total - 1.0).abs() > 1e-6 {
        return Err(format!("the shares add up to {}%, not 100%", (total * 1e6).round() / 1e4));
    }
    Ok(shares)
}

/// A share written as `40%` or `0.4`.
fn share(value: &serde_json::Value) -> Option<f64> {
    match value {
        serde_json::Value::String(s) if s.trim_end().ends_with('%') => {
            s.trim_end().trim_end_matches('%').trim().parse::<f64>().ok().map(|p| p / 100.0)
        }
        serde_json::Value::Number(n) => n.as_f64(),
        _ => None,
    }
}

/// A fraction as a percentage, `40%` (or `12.5%`).
fn percent(f: f64) -> String {
    let pct = f * 100.0;
    if (pct - pct.round()).abs() < 1e-9 { format!("{}%", pct.round()) } else { format!("{pct}%") }
}

/// One share of the optimizer state: a place's or a tier's name and the fraction of the
/// bytes it holds.
#[derive(Debug, Clone, PartialEq)]
pub struct TierShare {
    /// [`Tiers::DEVICE`], [`Tiers::RAM`], or the name of the offload tier in
    /// `plugins.offload`.
    pub name: String,
    /// In [0, 1].
    pub fraction: f64,
}

/// `[device: 60%, nvme: 40%]`: shares that add up to 100%. Two names are places rather than
/// tiers: `device`, the memory the run computes in, and `ram`, host memory. On a CPU run they
/// are the same memory; on a GPU run the `ram` share lives in page-locked host memory and
/// streams through the device each step. Any other name is the tier `plugins.offload`
/// selects.
#[derive(Debug, Clone, PartialEq)]
pub struct Tiers(pub Vec<TierShare>);

impl Tiers {
    /// What a config's `offload.tiers` must look like, for messages.
    pub const EXPECTED: &str = "expected a list of tier shares such as [device: 60%, nvme: 40%]";
    /// The memory the run computes in: host RAM on a CPU run, the GPU's on a GPU run.
    pub const DEVICE: &str = "device";
    /// Host memory: on a GPU run, page-locked and streamed through the device each step.
    pub const RAM: &str = "ram";

    /// All of the state where the run computes (the default).
    pub fn on_device() -> Self {
        Self(vec![TierShare { name: Self::DEVICE.into(), fraction: 1.0 }])
    }

    /// Whether `name` is a place (`device`, `ram`) rather than a tier.
    pub fn is_place(name: &str) -> bool {
        name == Self::DEVICE || name == Self::RAM
    }

    fn share(&self, name: &str) -> f64 {
        // A fold from +0: an empty f64 sum is -0, which prints as "-0%".
        self.0.iter().filter(|t| t.name == name).fold(0.0, |sum, t| sum + t.fraction)
    }

    /// The fraction of the state kept in the memory the run computes in: the `device`
    /// share, and on a CPU run (`gpu` false) the `ram` share too, which is the same memory.
    pub fn resident(&self, gpu: bool) -> f64 {
        if gpu { self.share(Self::DEVICE) } else { self.share(Self::DEVICE) + self.share(Self::RAM) }
    }

    /// The fraction a GPU run keeps in page-locked host memory and streams through the
    /// device each step (its `ram` share); 0 on a CPU run.
    pub fn pinned(&self, gpu: bool) -> f64 {
        if gpu { self.share(Self::RAM) } else { 0.0 }
    }

    /// The tier the rest streams through, with its share, if any share is not a place.
    pub fn offloaded(&self) -> Option<&TierShare> {
        self.0.iter().find(|t| !Self::is_place(&t.name) && t.fraction > 0.0)
    }

    /// Reads the list from its config value; the error says what is wrong with it.
    pub fn from_value(value: &serde_json::Value) -> Result<Self, String> {
        use serde_json::Value;
        let Value::Array(items) = value else {
            return Err(format!("{}, got {}", Self::EXPECTED, super::format::type_phrase(value)));
        };
        let shares: Vec<TierShare> = named_shares(items, Self::EXPECTED, "name: share", ("40%", "[0, 1]"), |_| Ok(()))?
            .into_iter()
            .map(|(name, fraction)| TierShare { name, fraction })
            .collect();
        let others: Vec<&str> = shares.iter().filter(|s| !Self::is_place(&s.name)).map(|s| s.name.as_str()).collect();
        if others.len() > 1 {
            return Err(format!(
                "{} offload tiers named ({}): the state splits between device, ram and the one tier \
                 plugins.offload selects",
                others.len(),
                others.join(", ")
            ));
        }
        Ok(Self(shares))
    }

    fn to_value(&self) -> serde_json::Value {
        serde_json::Value::Array(
            self.0.iter().map(|t| serde_json::json!({ t.name.clone(): percent(t.fraction) })).collect(),
        )
    }
}

impl Serialize for Tiers {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.to_value().serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Tiers {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = serde_json::Value::deserialize(deserializer)?;
        Self::from_value(&value).map_err(serde::de::Error::custom)
    }
}

/// A number of bytes, written in a config as an integer or as `2GiB`, `512MB`, ...
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct ByteSize(pub u64);

impl fmt::Display for ByteSize {
    /// `2GiB`, `1.5GiB`, `512MiB`, `4096B`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [(&str, u64); 4] = [("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
        for (unit, size) in UNITS {
            if self.0 >= size {
                let value = self.0 as f64 / size as f64;
                return if self.0.is_multiple_of(size) {
                    write!(f, "{}{unit}", self.0 / size)
                } else {
                    write!(f, "{value:.2}{unit}")
                };
            }
        }
        write!(f, "{}B", self.0)
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        match serde_json::Value::deserialize(deserializer)? {
            serde_json::Value::Number(n) => {
                n.as_u64().map(ByteSize).ok_or_else(|| serde::de::Error::custom(format!("{n} is not a byte count")))
            }
            serde_json::Value::String(s) => {
                ava_core::options::parse_size(&s).map(ByteSize).map_err(serde::de::Error::custom)
            }
            other => Err(serde::de::Error::custom(format!("expected a byte size, got {other}"))),
        }
    }
}
