//! `ava plugins keygen FILE`: a new ed25519 key pair for signing lock files.

use ava_plugins::sign::SecretKey;
use serde_json::json;

use crate::{CmdResult, UsageExt, output::Printer};

pub fn run(p: &Printer, out: &std::path::Path) -> CmdResult {
    let key = SecretKey::generate()?;
    key.write_new(out).usage()?;
    let public = key.public().to_string();
    p.result(
        || {
            format!(
                "secret key written to {} (mode 600; keep it off the machines that run ava)\n\
                 public key: {public}\n\n\
                 Trust it on a machine by adding to /etc/ava/policy.yaml:\n  trusted_keys: [\"{public}\"]\n\
                 then sign the lock file with: ava plugins sign --key {}",
                out.display(),
                out.display()
            )
        },
        || json!({"secret_key_file": out.display().to_string(), "public_key": public}),
    );
    Ok(())
}
