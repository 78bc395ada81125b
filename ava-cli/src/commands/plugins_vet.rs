//! `ava plugins vet PATH|NAME`: pin a library's sha256 in the lock file.

use anyhow::anyhow;
use ava_plugins::HostError;
use serde_json::json;

use crate::{CmdResult, Failure, cli::ConfigArgs, context, output::Printer};

pub fn run(p: &Printer, path_or_name: &str, lock: Option<std::path::PathBuf>, args: &ConfigArgs) -> CmdResult {
    // A path needs no registry, so a platform team can vet into a lock the machine policy
    // does not accept yet (unsigned), then sign it.
    let as_path = std::path::Path::new(path_or_name);
    let (path, lock_in_force) = if as_path.is_file() {
        (as_path.to_path_buf(), context::host_settings(args, p)?.lock_file)
    } else {
        let ctx = context::load(args, p)?;
        (ctx.registry.locate(path_or_name).map_err(|e| not_found(path_or_name, e))?, ctx.lock_file)
    };
    let lock_path = lock.unwrap_or(lock_in_force);
    let (pin, replaced) = ava_plugins::vet_file(&path, &lock_path).map_err(lock_problem)?;
    let sig = ava_plugins::sign::signature_path(&lock_path);
    if sig.exists() {
        p.warn(&format!(
            "{} no longer matches the lock file: re-sign it with `ava plugins sign --key KEYFILE --lock {}`",
            sig.display(),
            lock_path.display()
        ));
    }
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

/// A lock file that cannot be read or parsed is a setup problem the user fixes (exit code 2),
/// like a bad config file; other failures (a library that cannot be opened) stay failures.
fn lock_problem(e: HostError) -> Failure {
    match e {
        e @ HostError::Lock { .. } => Failure::Usage(e.into()),
        e => e.into(),
    }
}

/// A name or path that names no library is a usage error (exit code 2). The registry's error
/// says where it looked and how to fix it; a built-in's name gets vet's own words.
fn not_found(path_or_name: &str, e: HostError) -> Failure {
    match e {
        HostError::NotFound { builtin: Some(kind), .. } => Failure::Usage(anyhow!(
            "'{path_or_name}' is a built-in {kind}, compiled into ava: there is no library to vet"
        )),
        e @ (HostError::Missing { .. } | HostError::NotFound { .. }) => Failure::Usage(e.into()),
        e => e.into(),
    }
}
