//! `ava plugins list`: every plugin with its status, and the reason for any refusal.

use ava_plugins::{Row, Source};
use serde_json::{Value, json};

use crate::{
    CmdResult,
    cli::ConfigArgs,
    commands::parse_kind,
    context,
    output::{Printer, table},
};

pub fn run(p: &Printer, kind: Option<&str>, args: &ConfigArgs) -> CmdResult {
    let kind = kind.map(parse_kind).transpose()?;
    let ctx = context::load_for_listing(args, p)?;
    // A file that was not opened has no kind: keep it in a filtered listing, since it may be
    // the plugin the user is looking for.
    let rows: Vec<&Row> =
        ctx.registry.rows().iter().filter(|r| kind.is_none() || r.kind().is_none() || r.kind() == kind).collect();
    p.result(|| render_text(&rows, &ctx), || Value::Array(rows.iter().map(|r| row_json(r)).collect()));
    Ok(())
}

fn render_text(rows: &[&Row], ctx: &context::Ctx) -> String {
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.name().unwrap_or("-").to_string(),
                r.kind().map(|k| k.as_str()).unwrap_or("-").to_string(),
                r.manifest.as_ref().map(|m| m.version.to_string()).unwrap_or_else(|| "-".into()),
                r.status.as_str().to_string(),
                r.source.to_string(),
            ]
        })
        .collect();
    let mut out = table(&["NAME", "KIND", "VERSION", "STATUS", "SOURCE"], &cells);
    let with_reason: Vec<&&Row> = rows.iter().filter(|r| r.reason.is_some()).collect();
    if !with_reason.is_empty() {
        out.push('\n');
        for r in with_reason {
            let what = match (&r.manifest, &r.source) {
                (Some(m), _) => format!("{} '{}'", m.kind, m.name),
                (None, Source::File(f)) => f.display().to_string(),
                (None, Source::Builtin) => "builtin".into(),
            };
            out.push_str(&format!("\n{} ({}): {}", what, r.status.as_str(), r.reason.as_deref().unwrap_or("")));
        }
    }
    let host = ctx.registry.requested();
    out.push_str(&format!(
        "\n\npolicy: {} (from {})\nlock file: {} (from {}{})",
        ctx.policy,
        host.policy_origin(),
        ctx.lock_file.display(),
        host.lock_origin(),
        match host.floor.as_ref() {
            Some(f) if f.requires_signature() => ", must be signed by a key the machine policy trusts",
            _ => "",
        }
    ));
    out
}

/// The JSON form of a row, shared with `plugins info`.
pub fn row_json(r: &Row) -> Value {
    json!({
        "name": r.name(),
        "kind": r.kind().map(|k| k.as_str()),
        "version": r.manifest.as_ref().map(|m| m.version.to_string()),
        "summary": r.manifest.as_ref().map(|m| m.summary.to_string()),
        "source": match &r.source { Source::Builtin => "builtin".to_string(), Source::File(f) => f.display().to_string() },
        "status": r.status.as_str(),
        "reason": r.reason,
        "sha256": r.sha256,
    })
}
