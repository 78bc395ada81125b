//! `ava estimate`: the memory breakdown predicted from the config alone, with its formula
//! terms; nothing model-sized is allocated, so it works for models bigger than the machine.

use ava_core::PluginKind;
use ava_train::estimate::{Plugins, estimate_on};
use serde_json::json;

use crate::{CmdResult, UsageExt, cli::ConfigArgs, context, output::Printer};

pub fn run(p: &Printer, args: &ConfigArgs, world: usize) -> CmdResult {
    let ctx = context::load_checked(args, p)?;
    let config = context::load_config(args, p)?.into_config();
    let sel = |k: PluginKind| config.selection(k).clone();
    let (o, a, c) = (sel(PluginKind::Optimizer), sel(PluginKind::Attention), sel(PluginKind::Checkpoint));
    let spec = ava_train::train::model_spec(&config).usage()?;
    let optimizer_options = ava_train::train::optimizer_options(&ctx.registry, &o, &spec).usage()?;
    let optimizer = ctx.registry.optimizer(&o.name, &optimizer_options)?;
    let attention = ctx.registry.attention(&a.name, &a.options_json())?;
    let checkpoint = ctx.registry.checkpoint(&c.name, &c.options_json())?;
    let plugins =
        Plugins { optimizer: optimizer.as_ref(), attention: attention.as_ref(), checkpoint: checkpoint.as_ref() };
    let est = estimate_on(&spec, &config, &plugins, world).usage()?;
    p.result(|| est.render(), || json!(est));
    Ok(())
}
