//! `ava plugins info NAME|PATH`: manifest, options with defaults and docs, file, sha256, status.

use std::path::Path;

use anyhow::anyhow;
use ava_core::Manifest;
use ava_plugins::{Row, Source};
use serde_json::{Value, json};

use crate::{
    CmdResult, Failure, UsageExt,
    cli::ConfigArgs,
    commands::{parse_kind, plugins_list::row_json},
    context,
    output::Printer,
};

pub fn run(p: &Printer, name: &str, kind: Option<&str>, args: &ConfigArgs) -> CmdResult {
    let kind = kind.map(parse_kind).transpose()?;
    let ctx = context::load(args, p)?;
    let looks_like_path = name.contains(std::path::MAIN_SEPARATOR) || name.ends_with(std::env::consts::DLL_SUFFIX);
    let row: Row = if looks_like_path {
        let path = Path::new(name);
        // Reuse the registry's verdict if the file was found in a search path.
        let canon = std::fs::canonicalize(path).ok();
        let found = ctx.registry.rows().iter().find(|r| match &r.source {
            Source::File(f) => canon.is_some() && std::fs::canonicalize(f).ok() == canon,
            Source::Builtin => false,
        });
        match found {
            Some(r) => r.clone(),
            None => {
                if !path.exists() {
                    return Err(Failure::Usage(anyhow!("{}: no such plugin file", path.display())));
                }
                p.note(&format!(
                    "{} is not in a search path; it is vetted as if it were, under policy '{}'",
                    path.display(),
                    ctx.policy
                ));
                // Opened (its code run) only if the policy in force would open it there.
                let mut row = ctx.registry.inspect_file(path);
                if row.manifest.is_some() && row.reason.is_none() {
                    row.reason = Some("not in any search path, so ava would not find it".into());
                }
                row
            }
        }
    } else {
        let matches: Vec<&Row> =
            ctx.registry.rows_named(name).into_iter().filter(|r| kind.is_none() || r.kind() == kind).collect();
        match matches.as_slice() {
            [one] => (*one).clone(),
            [] => {
                let all: Vec<String> =
                    ctx.registry.rows().iter().filter_map(|r| r.name().map(str::to_string)).collect();
                let hint = ava_core::options::did_you_mean(name, all.iter().map(String::as_str))
                    .map(|s| format!(" (did you mean '{s}'?)"))
                    .unwrap_or_default();
                return Err(anyhow!("no plugin named '{name}'{hint}; `ava plugins list` shows what is installed"))
                    .usage();
            }
            many => {
                let kinds: Vec<&str> = many.iter().filter_map(|r| r.kind().map(|k| k.as_str())).collect();
                return Err(Failure::Usage(anyhow!(
                    "'{name}' names plugins of several kinds ({}); add --kind",
                    kinds.join(", ")
                )));
            }
        }
    };
    match row.manifest.clone() {
        Some(m) => p.result(|| render_text(&row, &m), || info_json(&row, &m)),
        None => p.result(|| render_unopened(&row), || row_json(&row)),
    }
    Ok(())
}

/// A library that was not opened (refused, modified, unreadable) or could not be used: what
/// is known without running its code.
fn render_unopened(row: &Row) -> String {
    let mut out = format!("{} (not opened: its manifest is unknown)\n\n", row.source);
    if let Some(sha) = &row.sha256 {
        out.push_str(&format!("  sha256:    {sha}\n"));
    }
    out.push_str(&format!("  status:    {}\n", row.status.as_str()));
    if let Some(reason) = &row.reason {
        out.push_str(&format!("  note:      {reason}\n"));
    }
    out
}

fn render_text(row: &Row, m: &Manifest) -> String {
    let devices: Vec<&str> = m.devices.iter().map(|d| d.as_str()).collect();
    let mut out = format!("{} ({}) {}\n  {}\n\n", m.name, m.kind, m.version, m.summary);
    out.push_str(&format!("  contract:  {}\n", m.contract_version));
    out.push_str(&format!("  devices:   {}\n", devices.join(", ")));
    out.push_str(&format!("  source:    {}\n", row.source));
    if let Some(sha) = &row.sha256 {
        out.push_str(&format!("  sha256:    {sha}\n"));
    }
    out.push_str(&format!("  status:    {}\n", row.status.as_str()));
    if let Some(reason) = &row.reason {
        out.push_str(&format!("  note:      {reason}\n"));
    }
    if m.options.is_empty() {
        out.push_str("\noptions: none\n");
    } else {
        out.push_str(&format!("\noptions (plugins.{}: {{name: {}, ...}}):\n", m.kind, m.name));
        for o in m.options.iter() {
            let default = if o.default.as_str() == "null" { "unset".to_string() } else { o.default.to_string() };
            out.push_str(&format!("  {:<18} {:<16} default {}\n      {}\n", o.name, o.ty.as_str(), default, o.doc));
        }
    }
    out
}

fn info_json(row: &Row, m: &Manifest) -> Value {
    let mut v = row_json(row);
    v["contract_version"] = json!(m.contract_version);
    v["devices"] = json!(m.devices.iter().map(|d| d.as_str()).collect::<Vec<_>>());
    v["options"] = Value::Array(
        m.options
            .iter()
            .map(|o| {
                json!({
                    "name": o.name.as_str(),
                    "type": o.ty.as_str(),
                    "default": serde_json::from_str::<Value>(&o.default).unwrap_or(Value::Null),
                    "doc": o.doc.as_str(),
                })
            })
            .collect(),
    );
    v
}
