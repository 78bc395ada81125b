//! `ava estimate`: the memory breakdown predicted from the config alone, with its formula
//! terms; nothing model-sized is allocated, so it works for models bigger than the machine.

use std::sync::Arc;

use ava_core::{AttentionKernel, CheckpointPolicy, Optimizer, PluginKind, format_size};
use ava_train::config::Config;
use ava_train::device::DeviceSpec;
use ava_train::estimate::{Plugins, estimate_rank};
use ava_train::model::ModelSpec;
use serde_json::json;

use crate::{CmdResult, Failure, UsageExt, cli::ConfigArgs, context, output::Printer};

/// The config's optimizer, attention kernel and checkpoint policy, built from the registry
/// as a run builds them, for the estimator to ask their declared sizes.
pub struct Selected {
    optimizer: Box<dyn Optimizer>,
    attention: Arc<dyn AttentionKernel>,
    checkpoint: Arc<dyn CheckpointPolicy>,
}

impl Selected {
    pub fn new(registry: &ava_plugins::Registry, config: &Config, spec: &ModelSpec) -> Result<Self, Failure> {
        let sel = |k: PluginKind| config.selection(k).clone();
        let (o, a, c) = (sel(PluginKind::Optimizer), sel(PluginKind::Attention), sel(PluginKind::Checkpoint));
        let optimizer_options = ava_train::train::optimizer_options(registry, &o, spec).usage()?;
        Ok(Self {
            optimizer: registry.optimizer(&o.name, &optimizer_options)?,
            attention: registry.attention(&a.name, &a.options_json())?,
            checkpoint: registry.checkpoint(&c.name, &c.options_json())?,
        })
    }

    pub fn plugins(&self) -> Plugins<'_> {
        Plugins {
            optimizer: self.optimizer.as_ref(),
            attention: self.attention.as_ref(),
            checkpoint: self.checkpoint.as_ref(),
        }
    }
}

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
    let spec = ava_train::train::model_spec(&config).usage()?;
    if world > 1 {
        // What training on that many ranks would refuse (the step inside
        // backward) is not estimated either.
        ava_train::train::check_training_modes(&config, world).usage()?;
    }
    let selected = Selected::new(&ctx.registry, &config, &spec)?;
    let plugins = selected.plugins();
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
