//! `ava plugins disable KIND`: remove a kind's selection from the config file so its built-in
//! default applies again.

use ava_train::config::{EditOutcome, set_config_value, set_plugin_selection};
use serde_json::json;

use crate::{CmdResult, UsageExt, commands::parse_kind, context::DEFAULT_CONFIG_FILE, output::Printer};

pub fn run(p: &Printer, kind: &str, config: Option<std::path::PathBuf>) -> CmdResult {
    let kind = parse_kind(kind)?;
    let file = config.unwrap_or_else(|| DEFAULT_CONFIG_FILE.into());
    let outcome = set_plugin_selection(&file, kind, None).usage()?;
    // offload.tiers naming the tier would now be refused: it goes with it.
    let tiers_removed = kind == ava_core::PluginKind::Offload
        && set_config_value(&file, "offload", "tiers", None).usage()? != EditOutcome::Unchanged;
    let default = ava_train::config::Config::default().plugins.selection(kind).name.clone();
    let also = if tiers_removed { " (and offload.tiers: the optimizer state stays in memory)" } else { "" };
    p.result(
        || match outcome {
            EditOutcome::Unchanged => {
                format!("{} has no plugins.{kind}; the built-in default '{default}' applies", file.display())
            }
            _ => format!(
                "removed plugins.{kind}{also} from {}; the built-in default '{default}' applies",
                file.display()
            ),
        },
        || {
            json!({
                "file": file.display().to_string(),
                "key": format!("plugins.{kind}"),
                "default": default,
                "outcome": format!("{outcome:?}").to_lowercase(),
            })
        },
    );
    Ok(())
}
