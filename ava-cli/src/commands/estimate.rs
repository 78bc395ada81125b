//! `ava estimate`: the memory breakdown predicted from the config alone, with its formula
//! terms; nothing model-sized is allocated, so it works for models bigger than the machine.

use ava_core::PluginKind;
use ava_core::format_size;
use ava_train::device::DeviceSpec;
use ava_train::estimate::{Plugins, estimate_rank};
use serde_json::json;

use crate::{CmdResult, UsageExt, cli::ConfigArgs, context, output::Printer};

/// Ranks listed one by one up to this world size (each is a replay of the step).
const MAX_LISTED: usize = 16;

pub fn run(p: &Printer, args: &ConfigArgs, world: usize, rank: Option<usize>, device: Option<DeviceSpec>) -> CmdResult {
    if let Some(r) = rank.filter(|&r| r >= world) {
        return Err(crate::Failure::Usage(anyhow::anyhow!(
            "--rank {r} is not a rank of --world-size {world}: ranks are 0..={}",
            world - 1
        )));
    }
    let ctx = context::load_checked(args, p)?;
    let mut config = context::load_config(args, p)?.into_config();
    if let Some(device) = device {
        config.train.device = device;
    }
    check_device(p, &config, world, &ctx.registry)?;
    let sel = |k: PluginKind| config.selection(k).clone();
    let (o, a, c) = (sel(PluginKind::Optimizer), sel(PluginKind::Attention), sel(PluginKind::Checkpoint));
    let spec = ava_train::train::model_spec(&config).usage()?;
    if world > 1 {
        // What training on that many ranks would refuse (the step inside
        // backward) is not estimated either.
        ava_train::train::check_training_modes(&config, world).usage()?;
    }
    let optimizer_options = ava_train::train::optimizer_options(&ctx.registry, &o, &spec).usage()?;
    let optimizer = ctx.registry.optimizer(&o.name, &optimizer_options)?;
    let attention = ctx.registry.attention(&a.name, &a.options_json())?;
    let checkpoint = ctx.registry.checkpoint(&c.name, &c.options_json())?;
    let plugins =
        Plugins { optimizer: optimizer.as_ref(), attention: attention.as_ref(), checkpoint: checkpoint.as_ref() };
    let est = estimate_rank(&spec, &config, &plugins, world, rank).usage()?;
    // Each rank's peak, when the ranks differ (from stage 1 they own different parameters).
    let ranks: Vec<u64> = if world > 1 && config.distributed.zero_stage >= 1 && world <= MAX_LISTED {
        (0..world)
            .map(|r| estimate_rank(&spec, &config, &plugins, world, Some(r)).map(|e| e.breakdown.peak))
            .collect::<Result<_, _>>()
            .usage()?
    } else {
        Vec::new()
    };
    p.result(
        || {
            let mut out = est.render();
            if !ranks.is_empty() {
                let each: Vec<String> =
                    ranks.iter().enumerate().map(|(r, &b)| format!("rank {r} {}", format_size(b))).collect();
                out.push_str(&format!("\npeak by rank: {}", each.join(", ")));
            }
            out
        },
        || {
            let mut v = json!(est);
            if !ranks.is_empty() {
                v["rank_peaks"] = json!(ranks);
            }
            v
        },
    );
    Ok(())
}

/// A GPU estimate is of a run the GPU engine would start, so what it refuses is refused here
/// too. A build without CUDA cannot tell which plugins run on a GPU (their manifests list
/// the devices of this build), so it estimates the GPU engine all the same and says so.
fn check_device(
    p: &Printer,
    config: &ava_train::config::Config,
    world: usize,
    registry: &ava_plugins::Registry,
) -> CmdResult {
    if !config.train.device.is_cuda() {
        return Ok(());
    }
    if cfg!(feature = "cuda") {
        ava_train::device::check_run(config, world, registry).usage()?;
    } else {
        ava_train::device::check_modes(config, world).usage()?;
        p.warn(&format!(
            "this ava was built without CUDA: the estimate is of the GPU engine on {}, but whether the selected \
             plugins run on a GPU is not checked here (a `cuda` build checks it: README, NVIDIA GPUs)",
            config.train.device
        ));
    }
    Ok(())
}
