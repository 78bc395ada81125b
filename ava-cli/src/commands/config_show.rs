//! `ava config show`: the effective configuration, each value with where it came from, and
//! the plugin policy in force when a machine policy sets a floor under it.

use serde_json::{Value, json};

use crate::{CmdResult, cli::ConfigArgs, context, output::Printer};

pub fn run(p: &Printer, args: &ConfigArgs) -> CmdResult {
    // With model.from, the folder's architecture is the run's: shown in place of the model
    // keys it makes ignored.
    let loaded = context::load_config(args, p)?.with_model_from().map_err(|e| crate::Failure::Usage(e.into()))?;
    let host = context::host_from(&loaded.config().plugins);
    let floor = match &host {
        Ok(h) => h.floor.as_ref().map(|_| h),
        Err(e) => {
            p.warn(&e.to_string());
            None
        }
    };
    p.result(
        || {
            let mut out = loaded.to_yaml();
            if let Some(h) = floor {
                out.push_str(&format!(
                    "\n# in force: plugins.policy {} (from {}); plugins.lock_file {} (from {})",
                    h.effective_policy(),
                    h.policy_origin(),
                    h.effective_lock_file().display(),
                    h.lock_origin()
                ));
            }
            out
        },
        || {
            let mut v = loaded.to_json();
            if let (Some(h), Value::Object(map)) = (floor, &mut v) {
                map.insert(
                    "machine_policy".into(),
                    json!({
                        "files": h.floor.iter().flat_map(|f| f.files.iter().map(|p| p.display().to_string())).collect::<Vec<_>>(),
                        "policy": h.effective_policy().as_str(),
                        "policy_from": h.policy_origin(),
                        "lock_file": h.effective_lock_file().display().to_string(),
                        "lock_file_from": h.lock_origin(),
                    }),
                );
            }
            v
        },
    );
    Ok(())
}
