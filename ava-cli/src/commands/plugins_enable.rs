//! `ava plugins enable KIND NAME [--set opt=value]`: write a plugin selection into the
//! config file, after the plugin has accepted the options.

use anyhow::anyhow;
use ava_core::PluginKind;
use ava_train::config::{EditOutcome, PluginSelection, Tiers, set_config_value, set_plugin_selection};
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
    let current = context::load_config(&args, p)?.into_config();

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
    if let Err(e) = ctx.registry.create(kind, name, &selection.options_json()) {
        let options = matches!(&e, ava_plugins::HostError::Plugin { error, .. }
            if error.kind == ava_core::ErrorKind::InvalidOptions);
        // Said when no option was given here: one given shows the user knows how.
        let hint = if options && set.is_empty() {
            format!(
                "\ngive the options here as --set OPTION=VALUE, one --set each (ava plugins enable {} {name} --set \
                 OPTION=VALUE); `ava plugins info {name}` lists them",
                kind.as_str()
            )
        } else {
            String::new()
        };
        return Err(anyhow!("{e}{hint}")).usage();
    }
    // An offload tier holds nothing until offload.tiers gives it a share of the optimizer
    // state: an exact tier gets all of it, unless the file already names it there.
    let tiers = match kind {
        PluginKind::Offload if name != "ram" => tiers_for(&ctx.registry, name, &selection, &current.offload.tiers)?,
        _ => None,
    };

    let outcome = set_plugin_selection(&file, kind, Some(&selection)).usage()?;
    let tiers_outcome = match &tiers {
        Some(TiersEdit::Set(value)) => Some(set_config_value(&file, "offload", "tiers", Some(value)).usage()?),
        _ => None,
    };
    let shown = ava_train::config::selection_yaml(&selection);
    let also = match &tiers {
        Some(TiersEdit::Set(value)) => format!(
            "\nset offload.tiers: {} too: the optimizer state streams through {name} (keep a share in memory with \
             offload.tiers: [device: 50%, {name}: 50%])",
            ava_train::config::yaml_flow(value)
        ),
        Some(TiersEdit::Lossy) => format!(
            "\n{name} is not exact, so it cannot hold optimizer state (offload.tiers): it holds the inputs of \
             recomputed blocks with plugins.checkpoint: {{name: selective, every: 1, offload: true}}"
        ),
        None => String::new(),
    };
    let outcome = match (outcome, tiers_outcome) {
        (EditOutcome::Unchanged, Some(o)) => o,
        (o, _) => o,
    };
    // Which runs read it: ./ava.yaml only when no other file is named.
    if file == std::path::Path::new(DEFAULT_CONFIG_FILE) {
        p.note(&format!(
            "{DEFAULT_CONFIG_FILE} is read by ava commands run in this directory without -c/--config (and AVA_CONFIG \
             unset); to change a config file, name it: ava plugins enable {kind} {name} --config FILE"
        ));
    } else {
        p.note(&format!("read by runs with -c {}", file.display()));
    }
    p.result(
        || match outcome {
            EditOutcome::Unchanged => format!("{} already has plugins.{kind}: {shown}{also}", file.display()),
            EditOutcome::Created => format!("created {} with plugins.{kind}: {shown}{also}", file.display()),
            EditOutcome::Changed => format!("set plugins.{kind}: {shown} in {}{also}", file.display()),
        },
        || {
            let mut out = json!({
                "file": file.display().to_string(),
                "key": format!("plugins.{kind}"),
                "value": selection.to_value(),
                "outcome": format!("{outcome:?}").to_lowercase(),
            });
            if let Some(TiersEdit::Set(v)) = &tiers {
                out["offload_tiers"] = v.clone();
            }
            out
        },
    );
    Ok(())
}

/// What enabling an offload tier does to `offload.tiers`.
enum TiersEdit {
    /// Writes this value.
    Set(serde_json::Value),
    /// Nothing: a lossy tier may not hold optimizer state.
    Lossy,
}

/// `offload.tiers` for tier `name`: all of the state through it (`[NAME: 100%]`), unless the
/// config already gives it a share; nothing for a lossy tier.
fn tiers_for(
    registry: &ava_plugins::Registry,
    name: &str,
    selection: &PluginSelection,
    current: &Tiers,
) -> Result<Option<TiersEdit>, crate::Failure> {
    let tier = registry.offload(name, &selection.options_json()).usage()?;
    if !tier.exact() {
        return Ok(Some(TiersEdit::Lossy));
    }
    if current.offloaded().is_some_and(|share| share.name == name) {
        return Ok(None);
    }
    Ok(Some(TiersEdit::Set(json!([{ name: "100%" }]))))
}
