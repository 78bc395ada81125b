//! `ava plugins sign --key FILE`: sign the lock file for machines whose policy requires it.

use std::path::{Path, PathBuf};

use ava_fs::bounded::{self, limits};
use ava_plugins::{
    LockFile,
    sign::{self, SecretKey},
};
use serde_json::json;

use crate::{CmdResult, UsageExt, cli::ConfigArgs, context, output::Printer};

pub fn run(p: &Printer, key: &Path, lock: Option<PathBuf>, args: &ConfigArgs) -> CmdResult {
    let lock = match lock {
        Some(l) => l,
        None => context::host_settings(args, p)?.lock_file,
    };
    let key = SecretKey::read(key).usage()?;
    let bytes = bounded::read(&lock, limits::LOCK).usage()?;
    // Only a lock this ava can read is worth a signature.
    let text = String::from_utf8(bytes.clone())
        .map_err(|_| anyhow::anyhow!("{}: not UTF-8 text; is it a lock file?", lock.display()))
        .usage()?;
    let parsed = LockFile::parse(&lock, &text).usage()?;
    let sig_path = sign::signature_path(&lock);
    ava_train::save::write_atomic(&sig_path, sign::sign(&bytes, &key).as_bytes())?;
    let public = key.public().to_string();
    p.result(
        || {
            format!(
                "signed {} ({} pin(s)) with {public}\n  signature: {}\nMachines whose policy trusts this key now accept this lock file as it is; re-sign after every change.",
                lock.display(),
                parsed.plugins.len(),
                sig_path.display()
            )
        },
        || json!({"lock_file": lock.display().to_string(), "signature_file": sig_path.display().to_string(), "key": public, "pins": parsed.plugins.len()}),
    );
    Ok(())
}
