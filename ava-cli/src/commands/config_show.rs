//! `ava config show`: the effective configuration, each value with where it came from.

use crate::{CmdResult, cli::ConfigArgs, context, output::Printer};

pub fn run(p: &Printer, args: &ConfigArgs) -> CmdResult {
    let loaded = context::load_config(args, p)?;
    p.result(|| loaded.to_yaml(), || loaded.to_json());
    Ok(())
}
