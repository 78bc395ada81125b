//! `ava plugins enable KIND NAME [--set opt=value]`: write a plugin selection into the
//! config file, after the plugin has accepted the options.

use anyhow::anyhow;
use ava_train::config::{EditOutcome, PluginSelection, set_plugin_selection};
use serde_json::json;

use crate::{
    CmdResult, UsageExt,
    cli::ConfigArgs,
    commands::parse_kind,
    context::{self, DEFAULT_CONFIG_FILE},
    output::Printer,
};

pub fn run(p: &Printer, kind: &str, name: &str, config: Option<std::path::PathBuf>, set: &[String]) -> CmdResult {
    let kind = parse_kind(kind)?;
    let file = config.unwrap_or_else(|| DEFAULT_CONFIG_FILE.into());
    // The registry is built from the file being edited, so its search paths and policy apply.
    let args = ConfigArgs { config: file.is_file().then(|| file.clone()), set: Vec::new() };
    let ctx = context::load(&args, p)?;

    let mut selection = PluginSelection::new(name);
    for s in set {
        let (key, value) = s
            .split_once('=')
            .ok_or_else(|| anyhow!("--set {s:?}: expected OPTION=VALUE, e.g. --set betas=[0.9,0.98]"))
            .usage()?;
        let value = ava_train::config::parse_value(value.trim()).map_err(|e| anyhow!("--set {s:?}: {e}")).usage()?;
        selection = selection.with_option(key.trim(), value);
    }
    // Unknown plugin, wrong kind, refused options: all before anything is written.
    ctx.registry.create(kind, name, &selection.options_json()).usage()?;

    let outcome = set_plugin_selection(&file, kind, Some(&selection)).usage()?;
    let shown = ava_train::config::selection_yaml(&selection);
    p.result(
        || match outcome {
            EditOutcome::Unchanged => format!("{} already has plugins.{kind}: {shown}", file.display()),
            EditOutcome::Created => format!("created {} with plugins.{kind}: {shown}", file.display()),
            EditOutcome::Changed => format!("set plugins.{kind}: {shown} in {}", file.display()),
        },
        || {
            json!({
                "file": file.display().to_string(),
                "key": format!("plugins.{kind}"),
                "value": selection.to_value(),
                "outcome": format!("{outcome:?}").to_lowercase(),
            })
        },
    );
    Ok(())
}
