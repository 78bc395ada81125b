//! `ava bench offload`: an offload tier's write and read rates on a disk (records of one
//! size, written behind and read back with and without prefetch, as the engine streams
//! optimizer state), and the step time and memory of training with the optimizer state in
//! memory against all of it streamed through the tier, steps taking turns.

use std::time::Instant;

use ava_core::{DType, OffloadTier, PluginKind};
use ava_train::config::{PluginSelection, TierShare, Tiers};
use ava_train::train::{TrainOptions, Trainer};
use serde_json::{Map, Value, json};

use super::bench_args::median;
use super::train::{failure, set_threads};
use crate::{CmdResult, Failure, cli::BenchOffloadArgs, context, output::Printer};

/// The tier's options: `path` and the `--tier-set` ones.
fn tier_options(args: &BenchOffloadArgs) -> Result<Map<String, Value>, Failure> {
    let mut options = Map::new();
    options.insert("path".into(), Value::String(args.path.display().to_string()));
    for set in &args.tier_set {
        let Some((key, value)) = set.split_once('=') else {
            return Err(Failure::Usage(anyhow::anyhow!(
                "--tier-set {set}: expected OPTION=VALUE, e.g. --tier-set direct_io=off"
            )));
        };
        let value = serde_json::from_str(value).unwrap_or_else(|_| Value::String(value.to_string()));
        options.insert(key.trim().to_string(), value);
    }
    Ok(options)
}

fn gbps(bytes: u64, seconds: f64) -> f64 {
    bytes as f64 / seconds / 1e9
}

/// Write, read and prefetched-read rates in GB/s.
fn throughput(p: &Printer, tier: &dyn OffloadTier, record: u64, total: u64) -> anyhow::Result<(f64, f64, f64)> {
    let n = total.div_ceil(record).max(1) as usize;
    let bytes = n as u64 * record;
    let data: Vec<u8> = (0..record as usize).map(|i| (i as u32).wrapping_mul(2_654_435_761) as u8).collect();
    let key = |i: usize| format!("bench/record-{i}");
    tier.preflight(&vec![record; n])?;
    p.note(&format!("writing {n} records of {} ...", ava_core::format_size(record)));
    let start = Instant::now();
    for i in 0..n {
        tier.put(&key(i), &data, DType::U8)?;
    }
    tier.flush()?;
    let write = gbps(bytes, start.elapsed().as_secs_f64());
    let mut back = vec![0u8; record as usize];
    p.note("reading them back, one at a time ...");
    let start = Instant::now();
    for i in 0..n {
        tier.get(&key(i), &mut back)?;
    }
    let read = gbps(bytes, start.elapsed().as_secs_f64());
    anyhow::ensure!(back == data, "the last record read back differs from what was written");
    p.note("and with the next records prefetched ...");
    const AHEAD: usize = 2;
    let start = Instant::now();
    for i in 0..n.min(AHEAD) {
        tier.prefetch(&key(i))?;
    }
    for i in 0..n {
        tier.get(&key(i), &mut back)?;
        if i + AHEAD < n {
            tier.prefetch(&key(i + AHEAD))?;
        }
    }
    let prefetched = gbps(bytes, start.elapsed().as_secs_f64());
    for i in 0..n {
        tier.evict(&key(i))?;
    }
    Ok((write, read, prefetched))
}

/// One placement's training: median step seconds and the optimizer state in memory at its
/// most (bytes), per the step records.
struct Placement {
    name: &'static str,
    trainer: Trainer,
    step_seconds: Vec<f64>,
    optimizer_bytes: u64,
    peak_bytes: u64,
}

pub fn run(p: &Printer, args: &BenchOffloadArgs) -> CmdResult {
    let ctx = context::load_checked(&args.config, p)?;
    let options = tier_options(args)?;
    let options_json = Value::Object(options.clone()).to_string();
    let tier = ctx.registry.offload(&args.tier, &options_json).map_err(|e| Failure::Usage(e.into()))?;
    let described = tier.describe();
    if !described.is_empty() {
        p.note(&described);
    }
    let (write, read, prefetched) = throughput(p, tier.as_ref(), args.record, args.total).map_err(|e| {
        Failure::Runtime(e.context(format!("measuring the {} tier in {}", args.tier, args.path.display())))
    })?;
    drop(tier);

    let mut placements = Vec::new();
    if args.steps > 0 {
        let mut config = context::load_config(&args.config, p)?.into_config();
        let tmp = tempfile::tempdir()?;
        config.train.out_dir = tmp.path().join("memory");
        config.train.max_steps = config.train.max_steps.max(args.warmup + args.steps);
        config.checkpoints.every = 0;
        config.train.eval_every = 0;
        set_threads(config.train.threads);
        config.offload.tiers = Tiers(vec![TierShare { name: "ram".into(), fraction: 1.0 }]);
        let in_memory = Trainer::new(&config, &ctx.registry, &TrainOptions::default()).map_err(failure)?;
        let mut streamed = config.clone();
        streamed.train.out_dir = tmp.path().join("streamed");
        *streamed.plugins.selection_mut(PluginKind::Offload) = PluginSelection { name: args.tier.clone(), options };
        streamed.offload.tiers = Tiers(vec![TierShare { name: args.tier.clone(), fraction: 1.0 }]);
        let through_tier = Trainer::new(&streamed, &ctx.registry, &TrainOptions::default()).map_err(failure)?;
        let header = in_memory.header();
        p.note(&format!(
            "training {:.2}M parameters, {} tokens/step: {} warmup + {} measured steps per placement, taking turns",
            header.params as f64 / 1e6,
            header.tokens_per_step,
            args.warmup,
            args.steps
        ));
        placements = vec![
            Placement { name: "memory", trainer: in_memory, step_seconds: vec![], optimizer_bytes: 0, peak_bytes: 0 },
            Placement {
                name: "streamed",
                trainer: through_tier,
                step_seconds: vec![],
                optimizer_bytes: 0,
                peak_bytes: 0,
            },
        ];
        for round in 0..args.warmup + args.steps {
            for pl in &mut placements {
                let start = Instant::now();
                let record = pl.trainer.train_step().map_err(failure)?;
                if round >= args.warmup {
                    pl.step_seconds.push(start.elapsed().as_secs_f64());
                    pl.optimizer_bytes = pl.optimizer_bytes.max(record.memory.optimizer);
                    pl.peak_bytes = pl.peak_bytes.max(record.memory.peak);
                }
            }
        }
    }

    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let text = || {
        let mut lines = vec![
            format!("{} tier in {}", args.tier, args.path.display()),
            format!(
                "  write            {write:.2} GB/s (records of {}, all written)",
                ava_core::format_size(args.record)
            ),
            format!("  read             {read:.2} GB/s (one at a time)"),
            format!("  read, prefetched {prefetched:.2} GB/s (2 records ahead)"),
        ];
        if let [memory, streamed] = &placements[..] {
            let (a, b) = (median(&memory.step_seconds), median(&streamed.step_seconds));
            lines.push("training step (median)        optimizer state in memory   peak".into());
            for (pl, t) in [(memory, a), (streamed, b)] {
                lines.push(format!(
                    "  {:<10} {:>9.1} ms       {:>10.2} MiB              {:>8.2} MiB",
                    pl.name,
                    1e3 * t,
                    mib(pl.optimizer_bytes),
                    mib(pl.peak_bytes)
                ));
            }
            lines.push(format!(
                "  streamed / memory: step time ×{:.2}, optimizer state in memory {:.1}%",
                b / a,
                100.0 * streamed.optimizer_bytes as f64 / memory.optimizer_bytes.max(1) as f64
            ));
        }
        lines.join("\n")
    };
    p.result(text, || {
        let training: Vec<Value> = placements
            .iter()
            .map(|pl| {
                json!({
                    "placement": pl.name,
                    "step_seconds_median": median(&pl.step_seconds),
                    "step_seconds": pl.step_seconds,
                    "optimizer_bytes": pl.optimizer_bytes,
                    "peak_bytes": pl.peak_bytes,
                })
            })
            .collect();
        json!({
            "tier": args.tier,
            "path": args.path,
            "record_bytes": args.record,
            "write_gbps": write,
            "read_gbps": read,
            "prefetched_read_gbps": prefetched,
            "training": training,
        })
    });
    Ok(())
}
