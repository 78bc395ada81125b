//! `ava plugins vet PATH|NAME`: pin a library's sha256 in the lock file.

use anyhow::anyhow;
use ava_plugins::{HostError, Registry, Source};
use serde_json::json;

use crate::{CmdResult, Failure, cli::ConfigArgs, context, output::Printer};

pub fn run(p: &Printer, path_or_name: &str, lock: Option<std::path::PathBuf>, args: &ConfigArgs) -> CmdResult {
    let ctx = context::load(args, p)?;
    let lock_path = lock.unwrap_or_else(|| ctx.lock_file.clone());
    let path = ctx.registry.locate(path_or_name).map_err(|e| not_found(&ctx.registry, path_or_name, e))?;
    let (pin, replaced) = ava_plugins::vet_file(&path, &lock_path)?;
    p.result(
        || {
            let mut s = format!(
                "pinned {} '{}' {} in {}\n  file:   {}\n  sha256: {}",
                pin.kind,
                pin.name,
                pin.version,
                lock_path.display(),
                path.display(),
                pin.sha256
            );
            for old in &replaced {
                if old.sha256 != pin.sha256 {
                    s.push_str(&format!("\n  replaced the earlier pin {} {} (sha256 {})", old.name, old.version, old.sha256));
                }
            }
            s
        },
        || {
            json!({
                "lock_file": lock_path.display().to_string(),
                "file": path.display().to_string(),
                "pinned": {"name": pin.name, "kind": pin.kind, "version": pin.version, "sha256": pin.sha256, "file": pin.file},
                "replaced": replaced.iter().map(|r| json!({"name": r.name, "version": r.version, "sha256": r.sha256})).collect::<Vec<_>>(),
            })
        },
    );
    Ok(())
}

/// A name or path that names no library is a usage error (exit code 2), with a hint: a close
/// name, or that built-in plugins are part of ava and need no vetting.
fn not_found(registry: &Registry, path_or_name: &str, e: HostError) -> Failure {
    let HostError::Missing { .. } = e else { return e.into() };
    let looks_like_path =
        path_or_name.contains(std::path::MAIN_SEPARATOR) || path_or_name.ends_with(std::env::consts::DLL_SUFFIX);
    if looks_like_path {
        return Failure::Usage(e.into());
    }
    if let Some(row) = registry.rows_named(path_or_name).into_iter().find(|r| r.source == Source::Builtin) {
        let kind = row.kind().map(|k| k.as_str()).unwrap_or("plugin");
        return Failure::Usage(anyhow!(
            "'{path_or_name}' is a built-in {kind}, compiled into ava: there is no library to vet"
        ));
    }
    let libraries: Vec<&str> =
        registry.rows().iter().filter(|r| matches!(r.source, Source::File(_))).filter_map(|r| r.name()).collect();
    let hint = ava_core::options::did_you_mean(path_or_name, libraries.iter().copied())
        .map(|s| format!(" (did you mean '{s}'?)"))
        .unwrap_or_default();
    let searched: Vec<String> = registry.search_dirs().iter().map(|d| d.path.display().to_string()).collect();
    Failure::Usage(anyhow!(
        "no plugin library named '{path_or_name}'{hint} in the search paths ({}); give the library's path, \
         or see `ava plugins list`",
        if searched.is_empty() { "none".to_string() } else { searched.join(", ") }
    ))
}
