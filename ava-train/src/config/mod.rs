//! Configuration: layered loading, validation, `ava config show`, and editing.
//!
//! Layers, lowest to highest: the built-in defaults ([`DEFAULT_CONFIG_YAML`]) < a config file
//! (YAML or TOML, by extension) < `AVA__SECTION__KEY` environment variables < `--set
//! section.key=value` overrides. Every value remembers its [`Origin`], so problems name the
//! file, variable or argument they came from, and `ava config show` says where each value
//! came from. Validation reports every problem at once ([`ConfigError::Invalid`]).
//!
//! ```
//! use ava_core::PluginKind;
//! use ava_train::config::ConfigLoader;
//!
//! let loaded = ConfigLoader::new()
//!     .env([("AVA__PLUGINS__POLICY", "vetted")])
//!     .set("plugins.memory.critical=0.9")
//!     .load()
//!     .unwrap();
//! let memory = loaded.config().selection(PluginKind::Memory);
//! assert_eq!((memory.name.as_str(), memory.options_json()), ("thresholds", r#"{"critical":0.9}"#.to_string()));
//! assert_eq!(loaded.origin("plugins.policy").unwrap().to_string(), "env AVA__PLUGINS__POLICY");
//! ```
//!
//! Files: `schema` (the typed config, defaults and schema table), `tree` (values with
//! origins, merging), `format` (YAML/TOML reading and YAML writing), `load` (the layers),
//! `validate` (problems), `show`, `edit` and `yaml_edit` (`ava plugins enable/disable`),
//! `error`.

mod edit;
mod error;
mod format;
mod load;
mod schema;
mod sections;
mod show;
mod tree;
mod validate;
mod yaml_edit;

#[cfg(test)]
mod tests;

pub use edit::{EditOutcome, set_config_value, set_plugin_selection};
pub use error::ConfigError;
pub use format::{parse_value, selection_yaml, yaml_flow};
pub use load::{ConfigLoader, ENV_PREFIX, LoadedConfig};
pub use schema::{Config, DEFAULT_CONFIG_YAML, PluginSelection, PluginsConfig, VettingPolicy};
pub use sections::{
    ByteSize, CheckpointsConfig, DataConfig, DataSource, DistributedConfig, LogConfig, LossScaleConfig, MasterWeights,
    MemoryConfig, Mix, MixShare, ModelConfig, MoeConfig, NanPolicy, OffloadConfig, Precision, SyntheticConfig,
    TierShare, Tiers, TrainConfig,
};
pub use show::ConfigEntry;
pub use tree::Origin;
pub use validate::{ConfigProblem, PluginCatalog};
