//! What the `ava bench` subcommands share: the list of plugin names to compare,
//! `--set PLUGIN.OPTION=VALUE` options, the statistics of repeated timings, and the name of
//! the GPU a bench runs on.

use std::collections::BTreeMap;

use serde_json::{Map, Value};

use crate::Failure;

/// How one bench names the plugins it compares, for its error messages.
pub struct Flag {
    /// The option, e.g. `--kernels`.
    pub name: &'static str,
    /// What the plugins are, e.g. `attention kernel`.
    pub noun: &'static str,
    /// A valid list, e.g. `standard,flash`.
    pub example_list: &'static str,
    /// A valid `--set`, e.g. `sliding-window.window=512`.
    pub example_set: &'static str,
}

/// The names of a comma-separated list flag, trimmed, without repeats, none empty.
pub fn names(flag: &Flag, list: &[String]) -> Result<Vec<String>, Failure> {
    let mut names: Vec<String> = Vec::new();
    for name in list.iter().map(|n| n.trim()) {
        if name.is_empty() {
            return Err(Failure::Usage(anyhow::anyhow!(
                "{} has an empty name; give {} names separated by commas, e.g. {} {}",
                flag.name,
                flag.noun,
                flag.name,
                flag.example_list
            )));
        }
        if !names.iter().any(|n| n == name) {
            names.push(name.to_string());
        }
    }
    if names.is_empty() {
        let first = flag.example_list.split(',').next().unwrap_or_default();
        return Err(Failure::Usage(anyhow::anyhow!(
            "{} needs at least one {}, e.g. {} {first}",
            flag.name,
            flag.noun,
            flag.name
        )));
    }
    Ok(names)
}

/// `--set PLUGIN.OPTION=VALUE` → per plugin, its options as a JSON object. VALUE is read as
/// JSON when it is (512, true, [1,2]), else as text; the plugin checks the types.
pub fn parse_sets(
    flag: &Flag,
    sets: &[String],
    plugins: &[String],
) -> Result<BTreeMap<String, Map<String, Value>>, Failure> {
    let mut out: BTreeMap<String, Map<String, Value>> = BTreeMap::new();
    let word = flag.noun.rsplit(' ').next().unwrap_or(flag.noun);
    let upper = word.to_uppercase();
    for set in sets {
        let malformed = |why: &str| {
            Failure::Usage(anyhow::anyhow!(
                "--set '{set}': {why}; expected {upper}.OPTION=VALUE, e.g. --set {}",
                flag.example_set
            ))
        };
        let (key, value) = set.split_once('=').ok_or_else(|| malformed("no '='"))?;
        let (plugin, option) =
            key.trim().split_once('.').ok_or_else(|| malformed(&format!("no '.' between {word} and option")))?;
        let (plugin, option, value) = (plugin.trim(), option.trim(), value.trim());
        if plugin.is_empty() {
            return Err(malformed(&format!("the {word} name is empty")));
        }
        if option.is_empty() {
            return Err(malformed("the option name is empty"));
        }
        if value.is_empty() {
            return Err(malformed("the value is empty"));
        }
        if !plugins.iter().any(|k| k == plugin) {
            return Err(Failure::Usage(anyhow::anyhow!(
                "--set '{set}': '{plugin}' is not one of the {word}s benchmarked ({}); --set here sets an option of {} {word} in {}",
                plugins.join(", "),
                if word.starts_with(['a', 'e', 'i', 'o', 'u']) { "an" } else { "a" },
                flag.name
            )));
        }
        let value = serde_json::from_str(value).unwrap_or_else(|_| Value::String(value.to_string()));
        out.entry(plugin.to_string()).or_default().insert(option.to_string(), value);
    }
    Ok(out)
}

/// The median of some samples (the upper one of an even count).
pub fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() { f64::NAN } else { v[v.len() / 2] }
}

/// The smallest sample.
pub fn min(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::INFINITY, f64::min)
}

/// The GPU's name as the driver gives it (`NVIDIA H100 80GB HBM3`), for a report's label;
/// none for the CPU or when the driver does not say.
#[cfg(feature = "cuda")]
pub fn device_name(device: &candle_core::Device) -> Option<String> {
    match device {
        candle_core::Device::Cuda(gpu) => gpu.cuda_stream().context().name().ok(),
        _ => None,
    }
}

/// A build without the `cuda` feature opens no GPU.
#[cfg(not(feature = "cuda"))]
pub fn device_name(_: &candle_core::Device) -> Option<String> {
    None
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    const OPTIMIZERS: Flag =
        Flag { name: "--names", noun: "optimizer", example_list: "adamw,lion", example_set: "lion.betas=[0.9,0.98]" };

    fn message(f: Failure) -> String {
        match f {
            Failure::Usage(e) => e.to_string(),
            other => panic!("not a usage error: {other:?}"),
        }
    }

    #[test]
    fn sets_are_parsed_per_plugin() {
        let plugins = vec!["flash".to_string(), "sliding-window".to_string()];
        let sets = vec!["sliding-window.window=512".to_string(), "sliding-window.name = x".to_string()];
        let kernels = Flag {
            name: "--kernels",
            noun: "attention kernel",
            example_list: "standard,flash",
            example_set: "sliding-window.window=512",
        };
        let parsed = parse_sets(&kernels, &sets, &plugins).unwrap_or_else(|_| panic!("parses"));
        assert_eq!(Value::Object(parsed["sliding-window"].clone()), json!({"window": 512, "name": "x"}));
        for bad in ["window=3", "sliding-window.window", ".window=3", "sliding-window.=3", "sliding-window.window="] {
            assert!(parse_sets(&kernels, &[bad.to_string()], &plugins).is_err(), "{bad}");
        }
    }

    #[test]
    fn messages_name_the_flag_and_the_plugin_kind() {
        let err = |sets: &[&str]| {
            let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            message(parse_sets(&OPTIMIZERS, &sets, &["adamw".into()]).unwrap_err())
        };
        assert_eq!(
            err(&["adamw"]),
            "--set 'adamw': no '='; expected OPTIMIZER.OPTION=VALUE, e.g. --set lion.betas=[0.9,0.98]"
        );
        assert_eq!(
            err(&["lion.betas=1"]),
            "--set 'lion.betas=1': 'lion' is not one of the optimizers benchmarked (adamw); --set here sets an option of an optimizer in --names"
        );
        let list = |l: &[&str]| names(&OPTIMIZERS, &l.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert_eq!(
            message(list(&["adamw", " "]).unwrap_err()),
            "--names has an empty name; give optimizer names separated by commas, e.g. --names adamw,lion"
        );
        assert_eq!(message(list(&[]).unwrap_err()), "--names needs at least one optimizer, e.g. --names adamw");
        assert_eq!(list(&["lion", " adamw", "lion"]).ok(), Some(vec!["lion".to_string(), "adamw".to_string()]));
    }
}
