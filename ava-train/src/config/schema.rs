//! What the configuration contains: the typed [`Config`], the built-in defaults
//! ([`DEFAULT_CONFIG_YAML`]) and the schema table that validation walks.
//!
//! Adding a section: add its struct (deriving `Serialize`/`Deserialize`) as a field of
//! [`Config`], its keys to a new `&[Field]` table listed in [`ROOT`], and its defaults, with
//! comments, to `default.yaml`. A test checks that the three agree. Add a new [`Kind`] when
//! a value needs a check that none of the existing ones does.

use std::fmt;
use std::path::PathBuf;

use ava_core::PluginKind;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value};

use super::format;
use super::sections::*;

/// The embedded default config: the lowest layer, and documentation of every setting.
pub const DEFAULT_CONFIG_YAML: &str = include_str!("default.yaml");

/// The type of one configuration key, as validation checks it.
#[derive(Debug)]
pub(crate) enum Kind {
    /// A table of further keys.
    Section(&'static [Field]),
    /// A plugin selection: a name, or a table `{name: X, <options>...}` (options are checked
    /// by the plugin catalog, not here).
    Selection(PluginKind),
    /// A file or directory path (a non-empty string).
    Path,
    /// A list of paths.
    PathList,
    /// One of a fixed set of words.
    OneOf(&'static [&'static str]),
    /// A path, or `null` for none.
    OptPath,
    /// An integer in `[min, max]`.
    Int(i64, i64),
    /// An integer in `[min, max]`, or `null` for the default another key implies.
    OptInt(i64, i64),
    /// A number in `[min, max]`.
    Float(f64, f64),
    /// `true` or `false`.
    Bool,
    /// A device: `cpu`, `cuda` or `cuda:N` ([`DeviceSpec`](crate::device::DeviceSpec)).
    Device,
    /// A byte size: an integer number of bytes or a string such as `2GiB`, `512MB`.
    Size,
    /// Tier shares such as `[ram: 60%, nvme: 40%]` ([`Tiers`]).
    Tiers,
    /// Corpus shares such as `[corpora/a: 70%, corpora/b: 30%]` ([`Mix`]).
    Mix,
}

/// One key of a section.
#[derive(Debug)]
pub(crate) struct Field {
    /// The key as written in the file.
    pub(crate) key: &'static str,
    /// Its type.
    pub(crate) kind: Kind,
}

/// The `plugins` section.
const PLUGINS: &[Field] = &[
    Field { key: "attention", kind: Kind::Selection(PluginKind::Attention) },
    Field { key: "optimizer", kind: Kind::Selection(PluginKind::Optimizer) },
    Field { key: "checkpoint", kind: Kind::Selection(PluginKind::Checkpoint) },
    Field { key: "offload", kind: Kind::Selection(PluginKind::Offload) },
    Field { key: "memory", kind: Kind::Selection(PluginKind::Memory) },
    Field { key: "search_paths", kind: Kind::PathList },
    Field { key: "policy", kind: Kind::OneOf(VettingPolicy::NAMES) },
    Field { key: "lock_file", kind: Kind::Path },
];

/// The `model.moe` section.
const MOE: &[Field] = &[
    Field { key: "num_experts", kind: Kind::Int(0, 1024) },
    Field { key: "top_k", kind: Kind::Int(1, 64) },
    Field { key: "aux_loss_weight", kind: Kind::Float(0.0, 1e3) },
];

/// The `model` section.
const MODEL: &[Field] = &[
    Field { key: "from", kind: Kind::OptPath },
    Field { key: "vocab_size", kind: Kind::Int(1, 1 << 24) },
    Field { key: "hidden_size", kind: Kind::Int(1, 1 << 20) },
    Field { key: "num_layers", kind: Kind::Int(1, 4096) },
    Field { key: "num_heads", kind: Kind::Int(1, 4096) },
    Field { key: "num_kv_heads", kind: Kind::Int(1, 4096) },
    Field { key: "intermediate_size", kind: Kind::Int(1, 1 << 22) },
    Field { key: "rope_theta", kind: Kind::Float(1.0, 1e12) },
    Field { key: "rms_norm_eps", kind: Kind::Float(0.0, 1.0) },
    Field { key: "tie_embeddings", kind: Kind::Bool },
    Field { key: "init_std", kind: Kind::Float(0.0, 10.0) },
    Field { key: "moe", kind: Kind::Section(MOE) },
];

/// The `data.synthetic` section.
const SYNTHETIC: &[Field] = &[
    Field { key: "alphabet", kind: Kind::Int(2, 255) },
    Field { key: "order", kind: Kind::Int(1, 8) },
    Field { key: "branching", kind: Kind::Int(1, 255) },
];

/// The `data` section.
const DATA: &[Field] = &[
    Field { key: "source", kind: Kind::OneOf(&["synthetic", "text", "shards"]) },
    Field { key: "path", kind: Kind::OptPath },
    Field { key: "tokenizer", kind: Kind::OptPath },
    Field { key: "seq_len", kind: Kind::Int(1, 1 << 20) },
    Field { key: "val_fraction", kind: Kind::Float(0.0, 0.9) },
    Field { key: "num_workers", kind: Kind::Int(0, 64) },
    Field { key: "prefetch_factor", kind: Kind::Int(1, 64) },
    Field { key: "mix", kind: Kind::Mix },
    Field { key: "packing", kind: Kind::OneOf(crate::data::Packing::NAMES) },
    Field { key: "synthetic", kind: Kind::Section(SYNTHETIC) },
];

/// The `train.loss_scale` section.
const LOSS_SCALE: &[Field] = &[
    Field { key: "init", kind: Kind::Float(1.0, 1e30) },
    Field { key: "growth_interval", kind: Kind::Int(1, 1 << 30) },
];

/// The `train.log` section.
const LOG: &[Field] = &[Field { key: "tensorboard", kind: Kind::Bool }];

/// The `train` section.
const TRAIN: &[Field] = &[
    Field { key: "seed", kind: Kind::Int(0, i64::MAX) },
    Field { key: "max_steps", kind: Kind::Int(0, i64::MAX) },
    Field { key: "micro_batch_size", kind: Kind::Int(1, 1 << 20) },
    Field { key: "gradient_accumulation_steps", kind: Kind::Int(1, 1 << 20) },
    Field { key: "device", kind: Kind::Device },
    Field { key: "precision", kind: Kind::OneOf(Precision::NAMES) },
    Field { key: "master_weights", kind: Kind::OneOf(MasterWeights::NAMES) },
    Field { key: "step_in_backward", kind: Kind::Bool },
    Field { key: "loss_chunk_rows", kind: Kind::Int(0, 1 << 30) },
    Field { key: "nan_policy", kind: Kind::OneOf(NanPolicy::NAMES) },
    Field { key: "lr", kind: Kind::Float(0.0, 1e3) },
    Field { key: "min_lr", kind: Kind::Float(0.0, 1e3) },
    Field { key: "warmup_steps", kind: Kind::Int(0, i64::MAX) },
    Field { key: "weight_decay", kind: Kind::Float(0.0, 1e3) },
    Field { key: "grad_clip", kind: Kind::Float(0.0, 1e12) },
    Field { key: "threads", kind: Kind::Int(0, 1024) },
    Field { key: "eval_every", kind: Kind::Int(0, i64::MAX) },
    Field { key: "eval_batches", kind: Kind::Int(1, 1 << 20) },
    Field { key: "eval_batch_size", kind: Kind::OptInt(1, 1 << 20) },
    Field { key: "sample_every", kind: Kind::Int(0, i64::MAX) },
    Field { key: "sample_tokens", kind: Kind::Int(1, 1 << 16) },
    Field { key: "log_every", kind: Kind::Int(1, i64::MAX) },
    Field { key: "log", kind: Kind::Section(LOG) },
    Field { key: "out_dir", kind: Kind::Path },
    Field { key: "loss_scale", kind: Kind::Section(LOSS_SCALE) },
];

/// The `checkpoints` section.
const CHECKPOINTS: &[Field] =
    &[Field { key: "every", kind: Kind::Int(0, i64::MAX) }, Field { key: "keep_last", kind: Kind::Int(1, 1 << 20) }];

/// The `memory` section.
const MEMORY: &[Field] = &[Field { key: "budget", kind: Kind::Size }, Field { key: "hard_limit", kind: Kind::Size }];

/// The `offload` section.
const OFFLOAD: &[Field] =
    &[Field { key: "tiers", kind: Kind::Tiers }, Field { key: "prefetch", kind: Kind::Int(0, 1 << 20) }];

/// The top level: one entry per section.
const DISTRIBUTED: &[Field] =
    &[Field { key: "zero_stage", kind: Kind::Int(0, 3) }, Field { key: "bucket_size", kind: Kind::Size }];

pub(crate) const ROOT: &[Field] = &[
    Field { key: "model", kind: Kind::Section(MODEL) },
    Field { key: "data", kind: Kind::Section(DATA) },
    Field { key: "train", kind: Kind::Section(TRAIN) },
    Field { key: "checkpoints", kind: Kind::Section(CHECKPOINTS) },
    Field { key: "memory", kind: Kind::Section(MEMORY) },
    Field { key: "offload", kind: Kind::Section(OFFLOAD) },
    Field { key: "distributed", kind: Kind::Section(DISTRIBUTED) },
    Field { key: "plugins", kind: Kind::Section(PLUGINS) },
];

/// The schema of the whole tree.
pub(crate) const ROOT_KIND: Kind = Kind::Section(ROOT);

/// Every key path of the schema (`plugins`, `plugins.attention`, ...), for suggestions.
pub(crate) fn all_paths() -> Vec<String> {
    fn walk(fields: &[Field], prefix: &str, out: &mut Vec<String>) {
        for field in fields {
            let path = if prefix.is_empty() { field.key.to_string() } else { format!("{prefix}.{}", field.key) };
            out.push(path.clone());
            if let Kind::Section(children) = field.kind {
                walk(children, &path, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(ROOT, "", &mut out);
    out
}

/// The effective configuration, typed. Built by [`ConfigLoader::load`](super::ConfigLoader::load)
/// after every layer has been merged and validated; `Config::default()` is the built-in defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The model's architecture (or the Hugging Face folder it is loaded from).
    pub model: ModelConfig,
    /// The training data and its loader.
    pub data: DataConfig,
    /// The training loop.
    pub train: TrainConfig,
    /// Saving checkpoints.
    pub checkpoints: CheckpointsConfig,
    /// The memory budget.
    pub memory: MemoryConfig,
    /// Where the optimizer state lives between steps.
    pub offload: OffloadConfig,
    /// How ranks share the work under `mpirun` (ignored by a single process).
    pub distributed: DistributedConfig,
    /// Which plugin provides each technique, and where plugins are found.
    pub plugins: PluginsConfig,
}

impl Config {
    /// The plugin selected for `kind`.
    pub fn selection(&self, kind: PluginKind) -> &PluginSelection {
        self.plugins.selection(kind)
    }
}

impl Default for Config {
    fn default() -> Self {
        super::ConfigLoader::new()
            .load()
            .expect("the embedded default config is valid (checked by a test)")
            .into_config()
    }
}

/// The `plugins` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PluginsConfig {
    /// The attention kernel.
    pub attention: PluginSelection,
    /// The optimizer.
    pub optimizer: PluginSelection,
    /// The activation checkpointing policy.
    pub checkpoint: PluginSelection,
    /// The offload tier.
    pub offload: PluginSelection,
    /// The memory policy.
    pub memory: PluginSelection,
    /// Extra directories searched for plugin libraries (before `$AVA_PLUGIN_PATH` and the
    /// `ava` executable's directory), as written (relative paths are relative to the
    /// working directory).
    pub search_paths: Vec<PathBuf>,
    /// Which plugin libraries may be loaded.
    pub policy: VettingPolicy,
    /// The lock file pinning vetted libraries.
    pub lock_file: PathBuf,
}

impl PluginsConfig {
    /// The plugin selected for `kind`.
    pub fn selection(&self, kind: PluginKind) -> &PluginSelection {
        match kind {
            PluginKind::Attention => &self.attention,
            PluginKind::Optimizer => &self.optimizer,
            PluginKind::Checkpoint => &self.checkpoint,
            PluginKind::Offload => &self.offload,
            PluginKind::Memory => &self.memory,
        }
    }

    /// The plugin selected for `kind`, to change it.
    pub fn selection_mut(&mut self, kind: PluginKind) -> &mut PluginSelection {
        match kind {
            PluginKind::Attention => &mut self.attention,
            PluginKind::Optimizer => &mut self.optimizer,
            PluginKind::Checkpoint => &mut self.checkpoint,
            PluginKind::Offload => &mut self.offload,
            PluginKind::Memory => &mut self.memory,
        }
    }
}

/// One plugin choice: its name and its options (the config table minus `name`), which are
/// handed to the plugin as JSON text ([`options_json`](Self::options_json)).
///
/// In a file it is written as a bare name (`optimizer: lion`) or as a table
/// (`optimizer: {name: lion, betas: [0.9, 0.98]}`); it serializes the same way.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PluginSelection {
    /// The plugin's name, e.g. `adamw`.
    pub name: String,
    /// The plugin's options, without `name`.
    pub options: Map<String, Value>,
}

impl PluginSelection {
    /// A selection of `name` with no options.
    pub fn new(name: impl Into<String>) -> Self {
        Self { name: name.into(), options: Map::new() }
    }

    /// Adds (or replaces) one option.
    pub fn with_option(mut self, key: impl Into<String>, value: impl Into<Value>) -> Self {
        self.options.insert(key.into(), value.into());
        self
    }

    /// The options as JSON text (`{}` when there are none), as plugins take them.
    pub fn options_json(&self) -> String {
        Value::Object(self.options.clone()).to_string()
    }

    /// The value as written in a config: the bare name without options, otherwise a table
    /// with `name` first.
    pub fn to_value(&self) -> Value {
        if self.options.is_empty() {
            return Value::String(self.name.clone());
        }
        let mut map = Map::new();
        map.insert("name".into(), Value::String(self.name.clone()));
        map.extend(self.options.iter().map(|(k, v)| (k.clone(), v.clone())));
        Value::Object(map)
    }

    /// Reads a selection from its config value: a name, or a table with a `name`.
    pub fn from_value(value: &Value) -> Result<Self, String> {
        match value {
            Value::String(name) if !name.trim().is_empty() => Ok(Self::new(name.clone())),
            Value::String(_) => Err("the plugin name is empty".into()),
            Value::Object(map) => {
                let name = match map.get("name") {
                    Some(Value::String(name)) if !name.trim().is_empty() => name.clone(),
                    Some(Value::String(_)) => return Err("the plugin name is empty".into()),
                    Some(other) => {
                        return Err(format!("'name' must be a plugin name, got {}", format::type_phrase(other)));
                    }
                    None => return Err(MISSING_NAME.into()),
                };
                let options = map.iter().filter(|(k, _)| *k != "name").map(|(k, v)| (k.clone(), v.clone())).collect();
                Ok(Self { name, options })
            }
            other => Err(format!("{}, got {}", SELECTION_EXPECTED, format::type_phrase(other))),
        }
    }

    /// Parses a selection written as on the command line or in a YAML file: `lion` or
    /// `{name: lion, betas: [0.9, 0.98]}`.
    pub fn parse(text: &str) -> Result<Self, String> {
        Self::from_value(&format::parse_yaml_value(text)?)
    }
}

/// What a selection must look like, for messages.
pub(crate) const SELECTION_EXPECTED: &str =
    "expected a plugin name or a table {name: <plugin>, <option>: <value>, ...}";

/// The message for a selection table without `name`.
pub(crate) const MISSING_NAME: &str = "a plugin table needs a 'name': write {name: <plugin>, <option>: <value>, ...}";

impl fmt::Display for PluginSelection {
    /// As written in YAML: `lion` or `{name: lion, betas: [0.9, 0.98]}`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&format::yaml_flow(&self.to_value()))
    }
}

impl Serialize for PluginSelection {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.to_value().serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for PluginSelection {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = Value::deserialize(deserializer)?;
        Self::from_value(&value).map_err(serde::de::Error::custom)
    }
}

/// Which plugin libraries the host may load (`plugins.policy`): the host's own type.
pub use ava_plugins::VettingPolicy;
