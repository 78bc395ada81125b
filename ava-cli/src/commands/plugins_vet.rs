//! `ava plugins vet PATH|NAME`: pin a library's sha256 in the lock file.

use serde_json::json;

use crate::{CmdResult, cli::ConfigArgs, context, output::Printer};

pub fn run(p: &Printer, path_or_name: &str, lock: Option<std::path::PathBuf>, args: &ConfigArgs) -> CmdResult {
    let ctx = context::load(args, p)?;
    let lock_path = lock.unwrap_or_else(|| ctx.lock_file.clone());
    let path = ctx.registry.locate(path_or_name)?;
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
