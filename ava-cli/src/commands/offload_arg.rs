//! `--offload TIER:PATH`, shared by `ava plan` and `ava bench train --modes`: an offload tier
//! plugin that takes a `path` option (the built-in `nvme`), and the directory it stores its
//! records under.

use std::path::PathBuf;

use ava_plugins::Registry;

use crate::Failure;

/// A tier and where it keeps its records.
#[derive(Debug, Clone)]
pub struct OffloadArg {
    /// The offload plugin, e.g. `nvme`.
    pub tier: String,
    /// Its `path` option.
    pub path: PathBuf,
}

impl OffloadArg {
    /// Reads `TIER:PATH` and checks the tier can be made there and returns exactly what it
    /// stores (optimizer state and masters may not be approximated).
    pub fn parse(text: &str, registry: &Registry) -> Result<Self, Failure> {
        let usage = |why: String| {
            Failure::Usage(anyhow::anyhow!(
                "--offload {text:?}: {why}; expected TIER:PATH, e.g. --offload nvme:/mnt/nvme"
            ))
        };
        let (tier, path) = text.split_once(':').ok_or_else(|| usage("no ':' between the tier and its path".into()))?;
        let (tier, path) = (tier.trim(), path.trim());
        if tier.is_empty() || path.is_empty() {
            return Err(usage("the tier or the path is empty".into()));
        }
        let arg = Self { tier: tier.to_string(), path: PathBuf::from(path) };
        let made = registry.offload(&arg.tier, &arg.options_json()).map_err(|e| {
            usage(format!(
                "the tier cannot be made there: {e} (see `ava plugins list --kind offload`; the path must be a \
                 writable directory)"
            ))
        })?;
        if !made.exact() {
            return Err(usage(format!(
                "{} is lossy (it approximates what it stores); optimizer state and master weights need an exact tier",
                arg.tier
            )));
        }
        Ok(arg)
    }

    /// The tier's options as JSON.
    pub fn options_json(&self) -> String {
        serde_json::json!({ "path": self.path }).to_string()
    }

    /// The `--set` values that stream all of the optimizer state through the tier.
    pub fn sets(&self) -> Vec<String> {
        vec![
            format!("plugins.offload={}", serde_json::json!({ "name": self.tier, "path": self.path })),
            format!("offload.tiers=[{}: 100%]", self.tier),
        ]
    }
}
