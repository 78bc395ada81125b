//! `ava config validate FILE`: every problem in a config file at once — keys, types, ranges,
//! and the plugins it selects with their options (checked by the plugins themselves).

use std::path::Path;

use anyhow::anyhow;
use serde_json::json;

use crate::{CmdResult, Failure, cli::ConfigArgs, context, output::Printer};

pub fn run(p: &Printer, file: &Path, set: &[String]) -> CmdResult {
    if !file.exists() {
        return Err(Failure::Usage(anyhow!("{}: no such config file", file.display())));
    }
    let args = ConfigArgs { config: Some(file.to_path_buf()), set: set.to_vec() };
    context::load_checked(&args, p)?;
    p.result(|| format!("{} is valid", file.display()), || json!({"file": file.display().to_string(), "valid": true}));
    Ok(())
}
