//! `ava plan`: searches the micro-batch (gradient accumulation keeps the effective batch),
//! the precision, where the weights live (`train.master_weights`), whether the optimizer
//! steps inside backward, the checkpoint policy, the attention kernel and the optimizer
//! among the installed plugins, and with `--offload TIER:PATH` streaming the optimizer state
//! (and masters) through that tier; estimates each combination with the estimator, and
//! ranks those that fit the budget by predicted step time. `--write FILE` writes the best
//! as a config.
//!
//! The time model counts FLOPs: `accumulation · (3·F + R + K + M)` with F the forward FLOPs
//! of the blocks and the head, R those of the blocks the plan recomputes (one more forward
//! each), K the attention kernel's measured cost over standard's on its share, M a
//! micro-step's fixed cost; times the precision's cost on this CPU engine; plus each
//! optimizer's per-parameter step cost, the rounding of weights kept only in bf16, and the
//! part of the tier's traffic the step waits for.
//! The constants are this engine's measurements (README: `ava bench train`, `ava bench
//! optimizer` on this project's CI machine); times are relative to the config as given.
//!
//! On a GPU config (`train.device: cuda`) the peaks are device memory, and the plan also
//! searches where the optimizer state lives: all on the device (`offload.tiers: [device:
//! 100%]`), all in page-locked host memory streamed through the GPU each step (`[ram:
//! 100%]`), and, when only streaming fits, the largest device share that still fits (the
//! fewest bytes over the link); with `--offload`, all of it through that disk tier instead.
//! Only the modes a GPU run accepts are proposed
//! ([`ava_train::device::check_modes`]). Each plan's host memory (the estimate's `host`
//! terms, the pinned state among them) is counted apart and checked against the host's RAM
//! (`--host-ram`, or this machine's MemTotal). GPU plans are ranked by the GPU step-time
//! model ([`ava_train::estimate::step_time`]: a roofline per kind of work at efficiencies
//! measured on an H200, scaled to the card `--card` names, `--budget`'s by default), which
//! also predicts a streamed plan's copies over the link and the part backward does not hide.

use std::path::PathBuf;
use std::sync::Arc;

use ava_core::{PluginKind, format_size, parse_size};
use ava_train::config::{Config, MasterWeights, PluginSelection, Precision, TierShare, Tiers};
use ava_train::estimate::step_time::{self, Card, StepTime};
use ava_train::estimate::{Estimate, estimate_on};
use ava_train::model::ModelSpec;
use serde_json::json;

use super::estimate::Selected;
use super::offload_arg::OffloadArg;
use crate::{CmdResult, Failure, UsageExt, cli::PlanArgs, context, output::Printer};

/// The share of a GPU preset's memory ([`step_time::CARDS`]) a plan may use: 10% back for
/// the CUDA context, the allocator's caching and fragmentation.
const GPU_USABLE: f64 = 0.90;

/// Presets of unified memory shared with the OS and other programs: (name, bytes, the share
/// a plan may use).
const UNIFIED: &[(&str, u64, f64)] = &[("m2-16gb", 16 << 30, 0.65)];

/// The card a GPU config's step times are predicted for when neither `--card` nor
/// `--budget` names one: the card the model's link figures were measured on.
const DEFAULT_CARD: &str = "h100-80gb";

/// Every `--budget` preset: (name, bytes on the device, the share a plan may use).
pub fn devices() -> Vec<(&'static str, u64, f64)> {
    let gpus = step_time::CARDS.iter().map(|c| (c.name, c.memory, GPU_USABLE));
    gpus.chain(UNIFIED.iter().copied()).collect()
}

/// The card a GPU plan's step times are predicted for: `--card`, else `--budget`'s preset
/// when it names a GPU, else [`DEFAULT_CARD`].
fn card(arg: Option<&str>, budget: &str) -> Result<&'static Card, Failure> {
    match arg {
        Some(name) => Card::named(name).ok_or_else(|| {
            Failure::Usage(anyhow::anyhow!(
                "--card {name:?} is not a GPU preset: {}",
                step_time::CARDS.iter().map(|c| c.name).collect::<Vec<_>>().join(", ")
            ))
        }),
        None => Ok(Card::named(budget).unwrap_or_else(|| Card::named(DEFAULT_CARD).expect("a preset"))),
    }
}

/// The share of the host's RAM a GPU plan's host memory may take: 10% back for the OS and
/// whatever else the machine runs (page-locked memory cannot be swapped out).
const HOST_USABLE: f64 = 0.90;

/// A byte budget keeps this back: the estimate's measured error is under 1% (README), the
/// allocator's run-to-run jitter a few hundred KB.
const BYTES_KEPT: f64 = 0.97;

/// Model presets for `--model`: `model.*` settings.
const MODELS: &[(&str, &[&str])] = &[
    ("tiny", &[]),
    (
        "small",
        &[
            "model.vocab_size=256",
            "model.hidden_size=256",
            "model.num_layers=4",
            "model.num_heads=4",
            "model.num_kv_heads=4",
            "model.intermediate_size=704",
        ],
    ),
    (
        "llama-7b",
        &[
            "model.vocab_size=32000",
            "model.hidden_size=4096",
            "model.num_layers=32",
            "model.num_heads=32",
            "model.num_kv_heads=32",
            "model.intermediate_size=11008",
        ],
    ),
];

/// Cost of a step in bf16 or f16 against fp32 on this CPU engine (the casts around every
/// op): 4.44 s against 2.04 s, `ava bench train` on small.yaml at 8 layers, 2026-11-23.
const HALF_PRECISION_COST: f64 = 2.2;

/// The fixed cost of a micro-step, in forward-FLOP equivalents per parameter: each one
/// packs every weight for its matmuls and adds its gradients to the accumulators. Measured
/// with `ava bench train` on small.yaml at 8 layers: micro-batch 8 × 1 took 3.4 s a step,
/// 1 × 8 took 6.8 s, i.e. 0.49 s a micro-step beside 0.36 s a sequence, 2026-11-23.
const MICRO_STEP_COST: f64 = 2300.0;

/// Optimizer step cost in forward-FLOP equivalents per parameter: AdamW's step is 0.5% of
/// small.yaml's step (5.9 ms of ~1.1 s), the others scaled by `ava bench optimizer`'s step
/// times (README table). An optimizer not listed costs as AdamW.
fn optimizer_cost(name: &str) -> f64 {
    let adamw = 60.0;
    adamw
        * match name {
            "adam-8bit" => 13.1 / 5.9,
            "adafactor" => 6.4 / 5.9,
            "adam-mini" | "lion" => 4.8 / 5.9,
            "sgd" => 0.3,
            _ => 1.0,
        }
}

/// Rounding a parameter kept only in bf16 back after its step (stochastic rounding: a
/// random draw per element), in forward-FLOP equivalents per parameter: about a third of
/// AdamW's step (60), as the bf16-only step on configs/small.yaml took 2% longer than with
/// f32 masters (`ava bench train --modes`, within its noise).
const ROUNDING_COST: f64 = 20.0;

/// This engine's rate in forward-FLOP equivalents per second, to turn the seconds a step
/// waits on the offload tier into the cost model's units: configs/tiny.yaml's fp32 step,
/// 8·N·tokens = 7.1 GFLOP in 0.19 s (`ava bench train --modes`), rounded down.
const ENGINE_RATE: f64 = 25e9;

/// Seconds a step waits on the tier per byte it streams (read and written), [inside
/// backward, after it]. Inside, most of the traffic hides behind backward: the step waited
/// 1.5e-9 s a byte on configs/small.yaml (82 ms for 53 MB, `ava bench train --modes
/// --offload`) and 0.6e-9 on the 7B config (16 s for 27.4 GB). After backward only the
/// reads ahead overlap other parameters' updates: about the disk's 0.5–0.85 GB/s (README,
/// `ava bench offload`), 2e-9.
const TIER_WAIT_PER_BYTE: [f64; 2] = [1.0e-9, 2.0e-9];

/// Seconds per byte of weights all-gathered over the ranks: 25 MiB over 2 ranks took
/// 11.5–14.8 ms here (`ava bench collectives`, 2026-11-24), about 0.5e-9.
const GATHER_PER_BYTE: f64 = 0.5e-9;

/// An attention kernel's forward + backward time against `standard`'s: flash took
/// 1.01–1.11× standard's (it recomputes the scores in backward, in tiles that stay in
/// cache), `ava bench attention --kernels standard,flash --seq 256,1024 --heads 4
/// --head-dim 64 --batch 8 --threads 2`, 2026-11-23. A kernel not listed costs as standard.
fn attention_cost(name: &str) -> f64 {
    match name {
        "flash" => 1.06,
        _ => 1.0,
    }
}

/// The usable bytes of `--budget`, and how it was read.
fn budget(text: &str) -> Result<(u64, String), Failure> {
    if let Some((name, bytes, usable)) = devices().into_iter().find(|d| d.0 == text) {
        let b = (bytes as f64 * usable) as u64;
        return Ok((
            b,
            format!(
                "{name}: {} of {} ({:.0}% kept back for the runtime)",
                format_size(b),
                format_size(bytes),
                100.0 * (1.0 - usable)
            ),
        ));
    }
    match parse_size(text) {
        Ok(bytes) if bytes > 0 => {
            let b = (bytes as f64 * BYTES_KEPT) as u64;
            Ok((
                b,
                format!(
                    "{} of {} (3% kept back for the estimate's error and allocator jitter)",
                    format_size(b),
                    format_size(bytes)
                ),
            ))
        }
        _ => Err(Failure::Usage(anyhow::anyhow!(
            "--budget {text:?} is neither a size (e.g. 24GiB, 512MB) nor a device: {}",
            devices().iter().map(|d| d.0).collect::<Vec<_>>().join(", ")
        ))),
    }
}

/// One combination.
#[derive(Debug, Clone)]
struct Candidate {
    micro_batch: usize,
    accumulation: usize,
    precision: Precision,
    attention: PluginSelection,
    optimizer: PluginSelection,
    checkpoint: PluginSelection,
    /// `train.master_weights`.
    masters: MasterWeights,
    /// `train.step_in_backward` (with `train.grad_clip: 0`).
    in_backward: bool,
    /// The optimizer state (and `tier` masters) stream through the `--offload` tier.
    offload: Option<OffloadArg>,
    /// `distributed.zero_stage` (with `--world-size` N > 1).
    zero_stage: u8,
    /// On a GPU run, the percent of the optimizer state in page-locked host memory,
    /// streamed through the device each step (`offload.tiers: [device: 100 − p%, ram: p%]`);
    /// `None` leaves `offload.tiers` as the config has it (the CPU engine).
    host_share: Option<u8>,
}

impl Candidate {
    /// The `--set` values that make a config this candidate, with `memory.budget`. A
    /// selective policy is pinned to the activation budget the plan gave it, so training
    /// plans exactly as estimated.
    fn sets(&self, budget: u64, est: &Estimate) -> Vec<String> {
        let sel = |s: &PluginSelection| {
            if s.options.is_empty() { s.name.clone() } else { serde_json::to_string(&s.to_value()).expect("JSON") }
        };
        vec![
            format!("train.micro_batch_size={}", self.micro_batch),
            format!("train.gradient_accumulation_steps={}", self.accumulation),
            format!("train.precision={}", self.precision.as_str()),
            format!("plugins.attention={}", sel(&self.attention)),
            format!("plugins.optimizer={}", sel(&self.optimizer)),
            if self.checkpoint.name == "selective" && est.activation_budget > 0 {
                format!("plugins.checkpoint={{name: selective, budget: {}}}", est.activation_budget)
            } else {
                format!("plugins.checkpoint={}", sel(&self.checkpoint))
            },
            format!("memory.budget={budget}"),
            format!("train.master_weights={}", self.masters.as_str()),
            format!("train.step_in_backward={}", self.in_backward),
            format!("distributed.zero_stage={}", self.zero_stage),
        ]
        .into_iter()
        // Stepping inside backward cannot wait for the global norm.
        .chain(self.in_backward.then(|| "train.grad_clip=0".to_string()))
        .chain(self.offload.iter().flat_map(OffloadArg::sets))
        .chain(self.host_share.map(|p| format!("offload.tiers={}", placement(p))))
        .collect()
    }

    /// Applies the candidate to a config (as [`sets`](Self::sets) does to a file).
    fn apply(&self, config: &mut Config) {
        config.train.micro_batch_size = self.micro_batch;
        config.train.gradient_accumulation_steps = self.accumulation;
        config.train.precision = self.precision;
        config.plugins.attention = self.attention.clone();
        config.plugins.optimizer = self.optimizer.clone();
        config.plugins.checkpoint = self.checkpoint.clone();
        config.train.master_weights = self.masters;
        config.train.step_in_backward = self.in_backward;
        config.distributed.zero_stage = self.zero_stage;
        if self.in_backward {
            config.train.grad_clip = 0.0;
        }
        if let Some(o) = &self.offload {
            let mut tier = PluginSelection::new(o.tier.clone());
            tier.options.insert("path".into(), json!(o.path));
            config.plugins.offload = tier;
            config.offload.tiers = Tiers(vec![TierShare { name: o.tier.clone(), fraction: 1.0 }]);
        }
        if let Some(p) = self.host_share {
            let shares = [(Tiers::DEVICE, 100 - p), (Tiers::RAM, p)];
            config.offload.tiers = Tiers(
                shares
                    .iter()
                    .filter(|(_, pct)| *pct > 0)
                    .map(|(name, pct)| TierShare { name: name.to_string(), fraction: f64::from(*pct) / 100.0 })
                    .collect(),
            );
        }
    }
}

/// `[device: 100%]`, `[device: 4%, ram: 96%]`, `[ram: 100%]`: `offload.tiers` with `p`% of
/// the state in host memory.
fn placement(p: u8) -> String {
    match p {
        0 => "[device: 100%]".into(),
        100 => "[ram: 100%]".into(),
        _ => format!("[device: {}%, ram: {p}%]", 100 - p),
    }
}

/// A candidate estimated.
struct Planned {
    candidate: Candidate,
    estimate: Estimate,
    /// Predicted step cost: FLOP equivalents on the CPU (the CPU engine's model, relative);
    /// on a GPU, the step's seconds on the search's card ([`time`](Self::time)'s).
    cost: f64,
    /// On a GPU run, the step time predicted on the search's card.
    time: Option<StepTime>,
}

impl Planned {
    /// On a GPU run, the host memory outside the device peak: the sum of the estimate's
    /// `host` terms (the pinned optimizer state, the loader's queue, the batch, the rotary
    /// tables); 0 on the CPU, where every term is in the peak.
    fn host(&self) -> u64 {
        self.estimate.host.iter().map(|t| t.bytes).sum()
    }

    /// The optimizer state a GPU run keeps in page-locked host memory.
    fn pinned(&self) -> u64 {
        self.estimate.pinned_state_bytes()
    }

    /// The seconds a step's state copies take on the card's link: the pinned state up and
    /// back once a step; `None` when nothing streams from host memory.
    fn copies(&self) -> Option<f64> {
        self.time.as_ref().and_then(|t| t.state_copies)
    }

    /// The part of the copies' seconds the step waits for (not hidden by compute).
    fn copies_exposed(&self) -> f64 {
        let terms = self.time.as_ref().map(|t| t.terms.as_slice()).unwrap_or_default();
        terms.iter().filter(|t| t.name == step_time::STATE_COPIES_EXPOSED).map(|t| t.seconds).sum()
    }
}

/// The host's RAM a GPU plan's host memory is checked against.
#[derive(Debug, Clone)]
struct HostRam {
    /// The RAM, and where it was read: `--host-ram` or `/proc/meminfo MemTotal`.
    total: u64,
    from: &'static str,
}

impl HostRam {
    /// `--host-ram` if given, else this machine's MemTotal; `None` when neither is known.
    fn new(arg: Option<&str>) -> Result<Option<Self>, Failure> {
        if let Some(text) = arg {
            return match parse_size(text) {
                Ok(total) if total > 0 => Ok(Some(Self { total, from: "--host-ram" })),
                _ => Err(Failure::Usage(anyhow::anyhow!("--host-ram {text:?} is not a size (e.g. 128GiB, 64GB)"))),
            };
        }
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let kib = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok());
        Ok(kib.map(|k| Self { total: k * 1024, from: "this machine's MemTotal, /proc/meminfo" }))
    }

    /// What a plan's host memory may take ([`HOST_USABLE`]).
    fn usable(&self) -> u64 {
        (self.total as f64 * HOST_USABLE) as u64
    }

    fn describe(&self) -> String {
        format!(
            "{} of {} ({}; {:.0}% kept back for the OS)",
            format_size(self.usable()),
            format_size(self.total),
            self.from,
            100.0 * (1.0 - HOST_USABLE)
        )
    }
}

/// What `--keep` can pin: the settings the plan searches.
const KEEPABLE: &[&str] = &[
    "train.micro_batch_size",
    "train.precision",
    "train.master_weights",
    "train.step_in_backward",
    "plugins.attention",
    "plugins.optimizer",
    "plugins.checkpoint",
    "distributed.zero_stage",
    "offload",
];

/// Validation loss at step 300 of the main job (configs/tiny.yaml, seed 0) against AdamW's,
/// from the README's optimizer table (2026-11-23): an optimizer offered in place of AdamW
/// saves memory but trains differently, and the plan says by how much.
fn trains_vs_adamw(name: &str) -> Option<f64> {
    let adamw = 1.1908;
    match name {
        "adam-8bit" => Some(1.1934 / adamw - 1.0),
        "adam-mini" => Some(1.1973 / adamw - 1.0),
        "adafactor" => Some(1.3046 / adamw - 1.0),
        _ => None,
    }
}

/// The search: every candidate estimated, the ones that fit ranked.
struct Search {
    /// Candidates searched.
    total: usize,
    /// Refused by a plugin (or a disk without room).
    refused: usize,
    /// Why streaming plans did not fit on the tier's disk (the first such error).
    no_room: Option<String>,
    /// Every candidate a plugin accepted.
    planned: Vec<Planned>,
    /// The config as given.
    given: Candidate,
    /// Its own estimate, with its own budget.
    reference: Option<Planned>,
    /// The memory policy's target fraction, and the bytes plans aim under.
    target: f64,
    aim: u64,
    /// A GPU run (`train.device: cuda`): only what the GPU engine runs is searched, ranked by
    /// the GPU step-time model on [`card`](Self::card).
    gpu: bool,
    /// On a GPU run, the card step times are predicted for.
    card: Option<&'static Card>,
    /// On a GPU run, the RAM the plans' host memory must fit (when known).
    host_ram: Option<HostRam>,
}

impl Search {
    /// The candidates under the aim: the user's optimizer first (another one trains
    /// differently, so it never outranks one that keeps it), then fastest; within 1% of each
    /// other, the fewest changes to the config, then (on a GPU) the fewest state bytes over
    /// the link, then the smallest peak. On a GPU a plan whose host memory is over the host's
    /// RAM does not fit.
    fn fitting(&self) -> Vec<&Planned> {
        let reference_cost = self.reference_cost();
        let mut fitting: Vec<&Planned> =
            self.planned.iter().filter(|x| x.estimate.breakdown.peak <= self.aim && self.fits_host(x)).collect();
        let key = |x: &Planned| {
            (
                x.candidate.optimizer.name != self.given.optimizer.name,
                (x.cost / reference_cost * 100.0).round() as i64,
                changes(&self.given, &x.candidate),
                x.pinned(),
            )
        };
        fitting.sort_by(|a, b| key(a).cmp(&key(b)).then(a.estimate.breakdown.peak.cmp(&b.estimate.breakdown.peak)));
        fitting
    }

    /// Whether a plan's host memory fits the host's RAM (always on the CPU, where the budget
    /// is that memory, and when the RAM is unknown).
    fn fits_host(&self, x: &Planned) -> bool {
        !self.gpu || self.host_ram.as_ref().is_none_or(|h| x.host() <= h.usable())
    }

    /// The plans that fit the device but whose host memory is over the host's RAM.
    fn over_host(&self) -> Vec<&Planned> {
        self.planned.iter().filter(|x| x.estimate.breakdown.peak <= self.aim && !self.fits_host(x)).collect()
    }

    /// The search checked against the host's RAM (on a GPU run).
    fn with_host_ram(self, host_ram: Option<HostRam>) -> Self {
        Self { host_ram: host_ram.filter(|_| self.gpu), ..self }
    }

    /// The cost step times are given relative to: the config as given, else the cheapest plan.
    fn reference_cost(&self) -> f64 {
        let cheapest = || self.planned.iter().map(|x| x.cost).fold(f64::INFINITY, f64::min);
        self.reference.as_ref().map_or_else(cheapest, |r| r.cost).max(f64::MIN_POSITIVE)
    }
}

/// The settings `--keep` pins, checked against [`KEEPABLE`].
fn kept(keys: &[String]) -> Result<Vec<&'static str>, Failure> {
    let mut out = Vec::new();
    let mut unknown = Vec::new();
    for k in keys.iter().flat_map(|k| k.split(',')).map(str::trim).filter(|k| !k.is_empty()) {
        match KEEPABLE.iter().find(|&&x| x == k || x.rsplit('.').next() == Some(k)) {
            Some(x) => out.push(*x),
            None => unknown.push(k.to_string()),
        }
    }
    if !unknown.is_empty() {
        return Err(Failure::Usage(anyhow::anyhow!(
            "--keep {}: not a setting the plan searches; it searches {}",
            unknown.join(", "),
            KEEPABLE.join(", ")
        )));
    }
    Ok(out)
}

/// Searches the combinations for `base` under `usable` bytes (see the module docs), a GPU
/// config's step times predicted on `card`.
fn search(
    registry: &ava_plugins::Registry,
    base: &Config,
    usable: u64,
    offload: Option<OffloadArg>,
    world: usize,
    keep: &[&str],
    card: &'static Card,
) -> Result<Search, Failure> {
    let pinned = |key: &str| keep.contains(&key);
    let spec = &ava_train::train::model_spec(base).usage()?;
    let gpu = base.train.device.is_cuda();
    let card = gpu.then_some(card);
    if gpu && world > 1 {
        return Err(Failure::Usage(anyhow::anyhow!(
            "--world-size {world}: a GPU run (train.device: {}) is one process in this version; plan it without \
             --world-size, or set train.device: cpu",
            base.train.device
        )));
    }
    let base_offloaded = base.offload.tiers.offloaded().is_some();
    let offload = offload.filter(|_| !base_offloaded && !pinned("offload"));
    let searcher = Searcher { registry, spec, base, world, keep, gpu, card, offload, base_offloaded };
    let tier = searcher.tier()?;
    let choices = searcher.choices();
    // A plan fits under the memory policy's target, so the run it writes stays quiet: the
    // thresholds policy warns and acts above `target` of memory.budget (0.90 by default).
    let target = match base.plugins.memory.name.as_str() {
        "thresholds" => base.plugins.memory.options.get("target").and_then(|v| v.as_f64()).unwrap_or(0.90),
        _ => 1.0,
    };
    let aim = (usable as f64 * target) as u64;
    let candidates = searcher.candidates(&choices);
    let mut total = candidates.len();
    let (mut planned, mut refused, no_room) = searcher.estimate_all(candidates, aim, tier.as_deref());
    // On a GPU, where only streaming the state from host memory fits: the largest device
    // share that still fits, so the fewest bytes cross the link each step.
    if gpu && !pinned("offload") {
        let (tried, found, not) = splits(registry, spec, base, &planned, aim, world, card);
        total += tried;
        refused += not;
        planned.extend(found);
    }
    // The config as given, for reference (its own budget, its own plan).
    let given = searcher.given(choices.given_share);
    let reference = plan_one(registry, spec, base, &given, 0, world, card).ok().flatten();
    // A selective plan that keeps or recomputes every block is `none` or `full` again.
    planned.retain(|x| {
        let n = x.estimate.plan.iter().filter(|d| d.is_recomputed()).count();
        x.candidate.checkpoint.name != "selective" || (n != 0 && n != x.estimate.plan.len())
    });
    Ok(Search { total, refused, no_room, planned, given, reference, target, aim, gpu, card, host_ram: None })
}

/// One search under way: what its stages read.
struct Searcher<'a> {
    registry: &'a ava_plugins::Registry,
    spec: &'a ModelSpec,
    /// The config the candidates change.
    base: &'a Config,
    /// `--world-size`: the ranks one plan is for.
    world: usize,
    /// The settings `--keep` pins.
    keep: &'a [&'a str],
    /// A GPU run (`train.device: cuda`).
    gpu: bool,
    /// On a GPU run, the card step times are predicted for.
    card: Option<&'static Card>,
    /// `--offload`'s tier, unless the config streams through its own or `--keep` pins `offload`.
    offload: Option<OffloadArg>,
    /// The config streams the optimizer state through its own tier (`offload.tiers`).
    base_offloaded: bool,
}

/// The choices a search combines, one list per setting it searches.
struct Choices {
    attentions: Vec<PluginSelection>,
    optimizers: Vec<PluginSelection>,
    checkpoints: Vec<PluginSelection>,
    precisions: Vec<Precision>,
    /// The effective batch, and the micro-batches that divide it (the config's, halved).
    effective: usize,
    micro_batches: Vec<usize>,
    /// `distributed.zero_stage`.
    stages: Vec<u8>,
    /// On a GPU, the config's percent of the optimizer state in host memory, and the ones
    /// searched ([`Candidate::host_share`]).
    given_share: Option<u8>,
    placements: Vec<Option<u8>>,
}

impl Searcher<'_> {
    /// Whether `--keep` pins `key`.
    fn pinned(&self, key: &str) -> bool {
        self.keep.contains(&key)
    }

    /// The tier whose preflight checks each streaming plan's records fit on its disk: the
    /// --offload one, or the config's own.
    fn tier(&self) -> Result<Option<Arc<dyn ava_core::OffloadTier>>, Failure> {
        let (registry, base) = (self.registry, self.base);
        Ok(match &self.offload {
            Some(o) => Some(registry.offload(&o.tier, &o.options_json()).usage()?),
            None if self.base_offloaded => {
                Some(registry.offload(&base.plugins.offload.name, &base.plugins.offload.options_json()).usage()?)
            }
            None => None,
        })
    }

    /// The choices for each setting: the plugins ([`plugin_choices`](Self::plugin_choices)),
    /// the precisions, the micro-batches, the ZeRO stages and on a GPU the state's placements.
    fn choices(&self) -> Choices {
        let (base, gpu, world) = (self.base, self.gpu, self.world);
        let (attentions, optimizers, checkpoints) = self.plugin_choices();
        let mut precisions = vec![base.train.precision];
        for p in [Precision::Fp32, Precision::Bf16] {
            if !precisions.contains(&p) && !self.pinned("train.precision") {
                precisions.push(p);
            }
        }
        let effective = base.train.effective_batch();
        let micro_batches: Vec<usize> = (0..)
            .map(|k| base.train.micro_batch_size >> k)
            .take_while(|&m| m >= 1)
            .filter(|m| effective.is_multiple_of(*m))
            .filter(|&m| !self.pinned("train.micro_batch_size") || m == base.train.micro_batch_size)
            .collect();
        // With several ranks, every ZeRO stage the engine runs; alone, the config's.
        let stages: Vec<u8> = if world > 1 && !self.pinned("distributed.zero_stage") {
            vec![0, 1, 2, 3]
        } else {
            vec![base.distributed.zero_stage]
        };
        // On a GPU, where the optimizer state lives: the config's placement (None: through the
        // config's own tier), all on the device, all in page-locked host memory (the split between
        // them that fits best is searched below, from these). A plan streaming through --offload's
        // tier keeps all of its state there (the tier's share and host memory's are exclusive).
        let given_share = (gpu && base.offload.tiers.offloaded().is_none())
            .then(|| (base.offload.tiers.pinned(true) * 100.0).round().clamp(0.0, 100.0) as u8);
        let placements: Vec<Option<u8>> = if !gpu {
            vec![None]
        } else if self.pinned("offload") {
            vec![given_share]
        } else {
            let mut these = vec![given_share];
            for p in [0, 100] {
                if !these.contains(&Some(p)) {
                    these.push(Some(p));
                }
            }
            these
        };
        Choices {
            attentions,
            optimizers,
            checkpoints,
            precisions,
            effective,
            micro_batches,
            stages,
            given_share,
            placements,
        }
    }

    /// The plugins to combine, (attention kernels, optimizers, checkpoint policies).
    /// Attention: the configured kernel, and flash for standard (the same attention, O(T)
    /// memory); kernels that change what attends to what are not offered. Optimizers: the
    /// configured one, and for AdamW the installed ones that approximate it with less state
    /// (Lion needs its own learning rate, so it is not offered). On a GPU, only the attention
    /// kernels and optimizers whose manifests take device buffers.
    fn plugin_choices(&self) -> (Vec<PluginSelection>, Vec<PluginSelection>, Vec<PluginSelection>) {
        let (registry, base, gpu) = (self.registry, self.base, self.gpu);
        let on_device = |kind: PluginKind, name: &str| {
            !gpu || registry.check_devices(&[(kind, name)], ava_core::Device::Cuda).is_ok()
        };
        let installed = |kind: PluginKind, name: &str| match kind {
            PluginKind::Attention => registry.attention(name, "{}").is_ok() && on_device(kind, name),
            PluginKind::Optimizer => registry.optimizer(name, "{}").is_ok() && on_device(kind, name),
            _ => registry.checkpoint(name, "{}").is_ok(),
        };
        let mut attentions = vec![base.plugins.attention.clone()];
        if base.plugins.attention.name == "standard"
            && installed(PluginKind::Attention, "flash")
            && !self.pinned("plugins.attention")
        {
            attentions.push(PluginSelection::new("flash"));
        }
        let mut optimizers = vec![base.plugins.optimizer.clone()];
        if base.plugins.optimizer.name == "adamw" && !self.pinned("plugins.optimizer") {
            for name in ["adam-8bit", "adam-mini", "adafactor"] {
                if installed(PluginKind::Optimizer, name) {
                    optimizers.push(PluginSelection::new(name));
                }
            }
        }
        let mut checkpoints = vec![PluginSelection::new("none"), PluginSelection::new("full")];
        if installed(PluginKind::Checkpoint, "selective") {
            checkpoints.push(PluginSelection::new("selective"));
        }
        if self.pinned("plugins.checkpoint") {
            checkpoints = vec![base.plugins.checkpoint.clone()];
        }
        (attentions, optimizers, checkpoints)
    }

    /// Where the weights live and when the optimizer steps, as (`train.master_weights`,
    /// `train.step_in_backward`, the tier streamed through): f32 masters always; with half
    /// precision, the bf16 weights alone (stochastic rounding), or their masters in the tier;
    /// the step inside backward with one micro-batch a step (not with f16, whose loss scale
    /// needs the whole gradient first). On a GPU the masters stream with the state from host
    /// memory (a placement with a `ram` share, [`candidates`](Self::candidates)), and Kahan's
    /// compensation (kept with the state) runs there too.
    fn weight_modes(
        &self,
        precision: Precision,
        accumulation: usize,
    ) -> Vec<(MasterWeights, bool, Option<OffloadArg>)> {
        let (base, offload, world) = (self.base, &self.offload, self.world);
        let (base_offloaded, gpu) = (self.base_offloaded, self.gpu);
        let mut masters = vec![MasterWeights::F32];
        if precision != Precision::Fp32 {
            masters.push(MasterWeights::None);
            if base.train.master_weights == MasterWeights::Kahan {
                masters.push(MasterWeights::Kahan);
            }
        }
        let mut out = Vec::new();
        for offloaded in [false, true] {
            if offloaded && offload.is_none() {
                continue;
            }
            let mut these = masters.clone();
            if precision != Precision::Fp32 && (offloaded || base_offloaded || gpu) {
                these.push(MasterWeights::Tier);
            }
            if self.pinned("train.master_weights") {
                these.retain(|&m| m == base.train.master_weights);
            }
            for &m in &these {
                for in_backward in [false, true] {
                    // Not with several ranks, which reduce the gradients after backward.
                    if in_backward && (accumulation != 1 || precision == Precision::F16 || world > 1) {
                        continue;
                    }
                    if self.pinned("train.step_in_backward") && in_backward != base.train.step_in_backward {
                        continue;
                    }
                    out.push((m, in_backward, offloaded.then(|| offload.clone()).flatten()));
                }
            }
        }
        out
    }

    /// Every combination of the choices (their order breaks exact ties in the ranking).
    fn candidates(&self, choices: &Choices) -> Vec<Candidate> {
        let gpu = self.gpu;
        let mut candidates = Vec::new();
        for attention in &choices.attentions {
            for optimizer in &choices.optimizers {
                for &precision in &choices.precisions {
                    for &micro_batch in &choices.micro_batches {
                        let accumulation = choices.effective / micro_batch;
                        for (masters, in_backward, offload) in self.weight_modes(precision, accumulation) {
                            for (checkpoint, &zero_stage) in
                                choices.checkpoints.iter().flat_map(|c| choices.stages.iter().map(move |s| (c, s)))
                            {
                                let through_tier: &[Option<u8>] = &[None];
                                let shares = if gpu && offload.is_some() { through_tier } else { &choices.placements };
                                for &host_share in shares {
                                    // Masters in a tier need one: on a GPU, host memory's share.
                                    if gpu && masters == MasterWeights::Tier && host_share == Some(0) {
                                        continue;
                                    }
                                    candidates.push(Candidate {
                                        zero_stage,
                                        micro_batch,
                                        accumulation,
                                        precision,
                                        attention: attention.clone(),
                                        optimizer: optimizer.clone(),
                                        checkpoint: checkpoint.clone(),
                                        masters,
                                        in_backward,
                                        offload: offload.clone(),
                                        host_share,
                                    });
                                }
                            }
                        }
                    }
                }
            }
        }
        candidates
    }

    /// Estimates each candidate under `aim`, keeping the plans a plugin accepts (on a GPU, the
    /// GPU engine too) and, when they stream, whose records fit on `tier`'s disk. Returns the
    /// plans, how many were refused, and why streaming plans did not fit on the disk (the
    /// first such error).
    fn estimate_all(
        &self,
        candidates: Vec<Candidate>,
        aim: u64,
        tier: Option<&dyn ava_core::OffloadTier>,
    ) -> (Vec<Planned>, usize, Option<String>) {
        let (registry, spec, base, world, card, gpu) =
            (self.registry, self.spec, self.base, self.world, self.card, self.gpu);
        let mut planned = Vec::new();
        let (mut refused, mut no_room) = (0, None);
        for c in candidates {
            // Nothing a GPU run refuses (host memory's and a tier's share at once, several ranks)
            // is proposed.
            if gpu && ava_train::device::check_modes(&applied(base, &c), world).is_err() {
                refused += 1;
                continue;
            }
            match plan_one(registry, spec, base, &c, aim, world, card) {
                Ok(Some(x)) => {
                    // A plan that streams must fit on the tier's disk.
                    if let (Some(tier), true) = (tier, x.estimate.offloaded > 0)
                        && let Err(e) = tier.preflight(&x.estimate.offload_records)
                    {
                        no_room.get_or_insert(e.to_string());
                        refused += 1;
                        continue;
                    }
                    planned.push(x)
                }
                Ok(None) | Err(_) => refused += 1,
            }
        }
        (planned, refused, no_room)
    }

    /// The config as given, as a candidate, its state placed `given_share`.
    fn given(&self, given_share: Option<u8>) -> Candidate {
        let base = self.base;
        Candidate {
            micro_batch: base.train.micro_batch_size,
            accumulation: base.train.gradient_accumulation_steps,
            precision: base.train.precision,
            attention: base.plugins.attention.clone(),
            optimizer: base.plugins.optimizer.clone(),
            checkpoint: base.plugins.checkpoint.clone(),
            masters: base.train.master_weights,
            in_backward: base.train.step_in_backward,
            offload: None,
            zero_stage: base.distributed.zero_stage,
            host_share: given_share,
        }
    }
}

/// For each plan that fits the device only with all of its optimizer state in host memory
/// (`[ram: 100%]` fits `aim`, the same settings with the state on the device do not): the
/// largest device share that still fits. The all-host plan's peak leaves `aim − peak` for
/// state kept on the device, so that share of the state is tried first, then 5 and 10
/// points less (the state is kept whole parameters at a time). Returns the splits tried, the
/// ones that fit, and how many a plugin refused.
fn splits(
    registry: &ava_plugins::Registry,
    spec: &ModelSpec,
    base: &Config,
    planned: &[Planned],
    aim: u64,
    world: usize,
    card: Option<&'static Card>,
) -> (usize, Vec<Planned>, usize) {
    let same_but_placement = |a: &Candidate, b: &Candidate| {
        let (mut a, mut b) = (a.clone(), b.clone());
        (a.host_share, b.host_share) = (None, None);
        format!("{a:?}") == format!("{b:?}")
    };
    let (mut tried, mut found, mut refused) = (0, Vec::new(), 0);
    for all_host in planned.iter().filter(|x| x.candidate.host_share == Some(100) && x.estimate.breakdown.peak <= aim) {
        let state = all_host.pinned();
        let fits_otherwise = planned.iter().any(|x| {
            x.candidate.host_share != Some(100)
                && x.estimate.breakdown.peak <= aim
                && same_but_placement(&x.candidate, &all_host.candidate)
        });
        if state == 0 || fits_otherwise {
            continue;
        }
        let room = aim - all_host.estimate.breakdown.peak;
        let first = (100.0 * room as f64 / state as f64).floor().min(99.0) as u8;
        for device in [first, first.saturating_sub(5), first.saturating_sub(10)] {
            if device == 0 {
                break;
            }
            let c = Candidate { host_share: Some(100 - device), ..all_host.candidate.clone() };
            tried += 1;
            match plan_one(registry, spec, base, &c, aim, world, card) {
                // A share that streams no whole parameter keeps it all on the device.
                Ok(Some(x)) if x.estimate.breakdown.peak <= aim && x.pinned() > 0 => {
                    found.push(x);
                    break;
                }
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => refused += 1,
            }
        }
    }
    (tried, found, refused)
}

/// For `ava train` refused by its budget: what `ava plan --budget` would pick for `base`
/// under `budget` bytes (its memory.budget), as a sentence and the `KEY=VALUE` settings that
/// change; None when nothing it searches fits.
pub fn suggestion(registry: &ava_plugins::Registry, base: &Config, budget: u64) -> Option<(String, Vec<String>)> {
    let host_ram = HostRam::new(None).ok().flatten();
    let card = Card::named(DEFAULT_CARD).expect("a preset");
    let found = search(registry, base, budget, None, 1, &[], card).ok()?.with_host_ram(host_ram);
    let best = *found.fitting().first()?;
    let given = found.reference.as_ref().map_or(&best.estimate, |r| &r.estimate);
    let given_sets = found.given.sets(budget, given);
    let sets: Vec<String> = best
        .candidate
        .sets(budget, &best.estimate)
        .into_iter()
        .filter(|s| !s.starts_with("memory.budget=") && !given_sets.contains(s))
        .collect();
    let optimizer = &best.candidate.optimizer.name;
    let swapped = match trains_vs_adamw(optimizer) {
        Some(worse) if *optimizer != found.given.optimizer.name => format!(
            " (no plan with {} fits; {optimizer} trained to a {:+.1}% validation loss against AdamW's on the main job)",
            found.given.optimizer.name,
            100.0 * worse
        ),
        _ => String::new(),
    };
    let text = format!(
        "the fastest settings that fit, as `ava plan --budget {}` ranks them: {}, estimated peak {}{swapped}",
        ava_train::budget_arg(budget),
        describe(&best.candidate, &best.estimate),
        format_size(best.estimate.breakdown.peak),
    );
    Some((text, sets))
}

/// `ava plan`: reads the inputs, searches, and prints the plans that fit, the fastest first;
/// `--write` writes the best as a config.
pub fn run(p: &Printer, args: &PlanArgs) -> CmdResult {
    let Inputs { usable, budget_text, config_args, keep, ctx, base, base_offloaded, offload, world, host_ram, card } =
        Inputs::read(p, args)?;
    let registry = &ctx.registry;
    let found = search(registry, &base, usable, offload.clone(), world, &keep, card)?.with_host_ram(host_ram);
    let offload = offload.filter(|_| !base_offloaded && !keep.contains(&"offload"));
    let reference_cost = found.reference_cost();
    let fitting = found.fitting();
    let over_host = found.over_host();
    let host_text = found.host_ram.as_ref().map(HostRam::describe);
    let Some(best) = fitting.first() else {
        return Err(nothing_fits(&found, &budget_text, &over_host, host_text.as_deref(), offload.as_ref(), &keep));
    };

    let mut written = None;
    if let Some(file) = &args.write {
        write_config(p, &config_args, best, usable, file, &args.budget, world)?;
        written = Some(file.clone());
    }
    let top: Vec<&&Planned> = fitting.iter().take(args.top.max(1)).collect();
    let report = Report {
        found: &found,
        base: &base,
        usable,
        budget_text: &budget_text,
        host_text,
        fitting: &fitting,
        over_host: &over_host,
        top,
        reference_cost,
        world,
        offload,
        base_offloaded,
        written,
    };
    p.result(|| report.text(), || report.json());
    Ok(())
}

/// What `ava plan` reads before it searches.
struct Inputs {
    /// The usable bytes of `--budget`, and how it was read.
    usable: u64,
    budget_text: String,
    /// The config's arguments, `--model`'s settings before the user's `--set`.
    config_args: crate::cli::ConfigArgs,
    /// The settings `--keep` pins.
    keep: Vec<&'static str>,
    ctx: context::Ctx,
    /// The config as given.
    base: Config,
    /// The config streams the optimizer state through its own tier (`offload.tiers`).
    base_offloaded: bool,
    /// `--offload`, as given.
    offload: Option<OffloadArg>,
    /// `--world-size`.
    world: usize,
    /// On a GPU config, the host's RAM (when known).
    host_ram: Option<HostRam>,
    /// The card a GPU plan's step times are predicted for.
    card: &'static Card,
}

impl Inputs {
    /// Reads `--budget`, the config with `--model`'s preset, `--keep`, the plugins,
    /// `--offload`, `--world-size`, `--host-ram` and `--card`, and warns of what the config
    /// ignores.
    fn read(p: &Printer, args: &PlanArgs) -> Result<Self, Failure> {
        let (usable, budget_text) = budget(&args.budget)?;
        let mut config_args = args.config.clone();
        if let Some(model) = &args.model {
            let Some((_, sets)) = MODELS.iter().find(|m| m.0 == model) else {
                return Err(Failure::Usage(anyhow::anyhow!(
                    "--model {model:?} is not a preset: {}",
                    MODELS.iter().map(|m| m.0).collect::<Vec<_>>().join(", ")
                )));
            };
            // Before the user's --set, which win.
            config_args.set.splice(0..0, sets.iter().map(|s| s.to_string()));
        }
        let keep = kept(&args.keep)?;
        let ctx = context::load_checked(&config_args, p)?;
        let base = context::load_config(&config_args, p)?.into_config();
        let registry = &ctx.registry;
        let base_offloaded = base.offload.tiers.offloaded().is_some();
        let offload = args.offload.as_deref().map(|o| OffloadArg::parse(o, registry)).transpose()?;
        if offload.is_some() && base_offloaded {
            p.warn(&format!(
                "--offload: the config already streams the optimizer state through {} (offload.tiers); its plans use \
                 that tier, not --offload's",
                base.plugins.offload.name
            ));
        }
        let world = args.world_size as usize;
        let host_ram = if base.train.device.is_cuda() {
            HostRam::new(args.host_ram.as_deref())?
        } else {
            if args.host_ram.is_some() {
                p.warn("--host-ram: ignored on a CPU config, whose budget is the host's memory itself");
            }
            None
        };
        let card = card(args.card.as_deref(), &args.budget)?;
        Ok(Self { usable, budget_text, config_args, keep, ctx, base, base_offloaded, offload, world, host_ram, card })
    }
}

/// The error when no plan fits: the smallest peak searched and what dominates it, the plans
/// over the host's RAM, the disk's refusals, and what to change (`offload`: `--offload`'s
/// tier, where the plans searched it).
fn nothing_fits(
    found: &Search,
    budget_text: &str,
    over_host: &[&Planned],
    host_text: Option<&str>,
    offload: Option<&OffloadArg>,
    keep: &[&str],
) -> Failure {
    let Search { total, ref no_room, aim, .. } = *found;
    let smallest = found.planned.iter().min_by_key(|x| x.estimate.breakdown.peak);
    let offload_hint =
        if offload.is_none() { ", stream the optimizer state to disk (--offload nvme:/path)" } else { "" };
    let kept_hint =
        if keep.is_empty() { String::new() } else { format!(", keep fewer settings (--keep {})", keep.join(",")) };
    // Plans that fit the device but not the host's RAM: the one with the least host memory.
    let host_hint = match (over_host.iter().min_by_key(|x| x.host()), host_text) {
        (Some(least), Some(ram)) => format!(
            "; {} plan(s) fit the device but not the host's RAM, {ram}: the least host memory is {} ({}); plan for a \
             host with more RAM (--host-ram SIZE)",
            over_host.len(),
            format_size(least.host()),
            describe(&least.candidate, &least.estimate)
        ),
        _ => String::new(),
    };
    Failure::Usage(anyhow::anyhow!(
        "no configuration fits {budget_text} (plans aim under {}, the memory policy's target): of {total} searched, \
         the smallest peak is {}{}{}{host_hint}; lower data.seq_len{offload_hint}{kept_hint}, use a smaller model, \
         or give a larger budget",
        format_size(aim),
        smallest.map_or("unknown".into(), |s| format_size(s.estimate.breakdown.peak)),
        smallest.map_or(String::new(), |s| format!(
            " ({}), most of it {}",
            describe(&s.candidate, &s.estimate),
            dominant(&s.estimate)
        )),
        no_room.as_ref().map_or(String::new(), |e| format!("; plans that stream were refused: {e}"))
    ))
}

/// What `ava plan` prints of a search whose plans fit: as text, or as JSON.
struct Report<'a> {
    found: &'a Search,
    /// The config as given.
    base: &'a Config,
    /// The usable bytes of `--budget`, and how it was read.
    usable: u64,
    budget_text: &'a str,
    /// The host's RAM ([`HostRam::describe`]), on a GPU run when known.
    host_text: Option<String>,
    /// The plans that fit, the best first ([`Search::fitting`]); those that fit the device
    /// but not the host's RAM.
    fitting: &'a [&'a Planned],
    over_host: &'a [&'a Planned],
    /// The first `--top` of `fitting`.
    top: Vec<&'a &'a Planned>,
    /// What step times are relative to ([`Search::reference_cost`]).
    reference_cost: f64,
    /// `--world-size`.
    world: usize,
    /// `--offload`'s tier, where the plans searched it.
    offload: Option<OffloadArg>,
    /// The config streams the optimizer state through its own tier (`offload.tiers`).
    base_offloaded: bool,
    /// The file `--write` wrote.
    written: Option<PathBuf>,
}

impl Report<'_> {
    /// The text: the summary, the table of the top plans, and the notes under it.
    fn text(&self) -> String {
        let mut out = self.summary();
        out.push_str(&self.table());
        out.push_str(&self.notes());
        out
    }

    /// The budget, the host's RAM, what was searched and fits, the config as given, and the
    /// ranks.
    fn summary(&self) -> String {
        let Search { total, refused, ref given, ref reference, target, aim, gpu, .. } = *self.found;
        let (found, budget_text, fitting, over_host, top) =
            (self.found, self.budget_text, self.fitting, self.over_host, &self.top);
        let world = self.world;
        let mut out = format!(
            "budget {budget_text}; plans fit under {:.0}% of it ({}), the memory policy's target\n",
            100.0 * target,
            format_size(aim),
        );
        if gpu {
            out.push_str(&match &self.host_text {
                Some(ram) => format!("host RAM {ram}: each plan's host memory must fit it\n"),
                None => "host RAM unknown (no /proc/meminfo MemTotal): plans' host memory is not checked; give \
                         --host-ram\n"
                    .into(),
            });
        }
        out.push_str(&format!(
            "searched {total} configurations ({refused} refused by a plugin{}), {} fit{}{}\n",
            if gpu { " or by the GPU engine" } else { "" },
            fitting.len(),
            if over_host.is_empty() {
                String::new()
            } else {
                format!(" ({} more fit the device but not the host's RAM)", over_host.len())
            },
            if top.len() < fitting.len() {
                format!("; the {} fastest below (--top N shows more)", top.len())
            } else {
                String::new()
            }
        ));
        if let Some(r) = &reference {
            let host = if gpu { format!(", host memory {}", format_size(r.host())) } else { String::new() };
            let over_host = gpu && !found.fits_host(r);
            out.push_str(&format!(
                "the config as given: {}, peak {}{host} ({})\n",
                describe(given, &r.estimate),
                format_size(r.estimate.breakdown.peak),
                match (r.estimate.breakdown.peak <= aim, over_host) {
                    (true, false) => "fits",
                    (true, true) => "over the host's RAM",
                    (false, false) => "over the budget",
                    (false, true) => "over the budget and the host's RAM",
                }
            ));
        }
        if world > 1 {
            out.push_str(&format!(
                "each rank of {world} (mpirun -np {world}): the budget, micro-batch and peak are per rank\n"
            ));
        }
        out
    }

    /// The table of the top plans: a row each, with a GPU's columns and the ranks' ZeRO stage.
    fn table(&self) -> String {
        let Search { ref given, gpu, .. } = *self.found;
        let (top, usable, reference_cost, world) = (&self.top, self.usable, self.reference_cost, self.world);
        let mut headers = vec![
            "#",
            "micro × acc",
            "precision",
            "weights",
            "opt. step",
            "attention",
            "optimizer",
            "state",
            "checkpoint",
            "peak",
            "of budget",
            "step time",
            "params / grads / optimizer / activations",
        ];
        if gpu {
            // Device peak, then the host's memory apart; the copies beside the step time.
            headers.insert(11, "host");
            headers.insert(13, "state copies");
        }
        if world > 1 {
            headers.insert(2, "ZeRO");
        }
        let rows: Vec<Vec<String>> = top
            .iter()
            .enumerate()
            .map(|(i, x)| {
                let b = &x.estimate.breakdown;
                let mut row = vec![
                    (i + 1).to_string(),
                    format!("{} × {}", x.candidate.micro_batch, x.candidate.accumulation),
                    x.candidate.precision.as_str().to_string(),
                    weights_text(&x.candidate),
                    if x.candidate.in_backward { "in backward" } else { "after" }.to_string(),
                    x.candidate.attention.name.clone(),
                    optimizer_text(&given.optimizer.name, &x.candidate.optimizer.name),
                    state_text(&x.candidate, &x.estimate),
                    plan_text(&x.candidate.checkpoint.name, &x.estimate),
                    format_size(b.peak),
                    format!("{:.0}%", 100.0 * b.peak as f64 / usable as f64),
                    step_text(x, reference_cost),
                    format!(
                        "{} / {} / {} / {}",
                        format_size(b.params),
                        format_size(b.grads),
                        format_size(b.optimizer),
                        format_size(b.activations)
                    ),
                ];
                if gpu {
                    row.insert(11, format_size(x.host()));
                    row.insert(13, copies_text(x));
                }
                if world > 1 {
                    row.insert(2, format!("stage {}", x.candidate.zero_stage));
                }
                row
            })
            .collect();
        crate::output::table(&headers, &rows)
    }

    /// The notes under the table: how step times are predicted, another optimizer than the
    /// config's, where the state lives, the step in backward, and the file written.
    fn notes(&self) -> String {
        let Search { ref given, .. } = *self.found;
        let (base, top, world) = (self.base, &self.top, self.world);
        let mut out = self.step_time_note();
        if top.iter().any(|x| x.candidate.optimizer.name != given.optimizer.name) {
            out.push_str(&format!(
                "\noptimizer: another optimizer than the config's {} saves state but trains differently (val loss \
                 against adamw's at step 300 of the main job, README), so plans keeping {} rank first; pin it \
                 with --keep plugins.optimizer",
                given.optimizer.name, given.optimizer.name
            ));
        }
        out.push_str(&self.state_note());
        if top.iter().any(|x| x.candidate.in_backward && base.train.grad_clip > 0.0) {
            out.push_str(&format!(
                "\nstep in backward: each parameter is updated as soon as its gradient is final, before the global \
                 norm exists, so those plans set train.grad_clip: 0 (the config has {})",
                base.train.grad_clip
            ));
        }
        if let Some(f) = &self.written {
            let run = if world > 1 { format!("ava train --nproc {world}") } else { "ava train".into() };
            out.push_str(&format!("\nwrote {}: run it with {run} -c {}", f.display(), f.display()));
        }
        out
    }

    /// How step times are predicted: on a GPU the card's roofline and the state's copies, on
    /// the CPU the FLOPs relative to the config as given.
    fn step_time_note(&self) -> String {
        match self.found.card {
            Some(card) => format!(
                "\nstep time: predicted on {} (ms a step, tokens/s, and against the config as given): a roofline per \
                 kind of work (matmuls, attention, memory-bound ops, recomputation, the optimizer step, copies) at \
                 efficiencies measured on an H200, scaled to the card's datasheet peaks; it reproduces the H200 \
                 steps it was fitted to, and `ava bench train` prints it beside each measured step (--card picks \
                 another card). The peaks are device memory, as `ava estimate --device cuda` predicts it; `host` is \
                 the host memory apart (the state in page-locked memory, the loader's queue, the batch, the rotary \
                 tables); only the plugins and modes a GPU run accepts were searched\n\
                 state copies: a plan whose state lives in host memory moves it up and back each step over the \
                 link, 2 x its bytes / {:.1} GB/s ({}), and the part not hidden: inside backward, backward's \
                 compute and the steps hide them; after it, only the other parameters' steps do",
                card.name,
                card.link_both_ways / 1e9,
                card.link_from
            ),
            None => {
                "\nstep time: predicted, relative to the config as given (FLOPs with this engine's measured costs; see \
                     `ava plan --help`)"
                    .to_string()
            }
        }
    }

    /// Where the optimizer state lives: `--offload`'s tier, the config's own, or on a GPU
    /// device or host memory; and whether plans that stream did not fit on the disk.
    fn state_note(&self) -> String {
        let Search { ref no_room, gpu, .. } = *self.found;
        let (base, base_offloaded) = (self.base, self.base_offloaded);
        let ram = if gpu {
            "a GPU run keeps the optimizer state in device memory ([device: 100%]) or, where the state column says \
             ram, in page-locked host memory streamed through the GPU each step ([ram: 100%], or the largest device \
             share that fits when only streaming does: the fewest bytes over the link); the device then holds the \
             next offload.prefetch parameters' state and the one stepped before. Through a disk tier \
             (--offload), the records are read into the device for each step and written back, the disk's time \
             predicted from the CPU engine's measured waits on it (not yet measured on a GPU)"
        } else {
            "on this CPU engine the device is RAM, so only a disk tier takes bytes out of the budget"
        };
        let room = no_room.as_ref().map_or(String::new(), |e| format!(" (some plans did not fit on it: {e})"));
        match &self.offload {
            Some(o) => format!(
                "\noffload: {} at {}: a plan that streams keeps its optimizer state (and with weights \"bf16 + \
                 masters in {}\" its f32 masters) on that disk, checked for room; {ram}{room}",
                o.tier,
                o.path.display(),
                o.tier,
            ),
            None if base_offloaded => format!(
                "\noffload: the config streams the optimizer state through {} (offload.tiers), checked for room \
                 for each plan; {ram}{room}",
                base.plugins.offload.name,
            ),
            None if gpu => format!(
                "\nstate: {ram}; --offload TIER:PATH (e.g. nvme:/mnt/nvme) adds plans that stream the state through \
                 a disk tier instead of host memory"
            ),
            None => format!(
                "\noffload: not searched; --offload TIER:PATH (e.g. nvme:/mnt/nvme) adds plans that stream the \
                 optimizer state to disk ({ram})"
            ),
        }
    }

    /// The JSON: the budget, the device and card, the host's RAM, what was searched and fits,
    /// and the top plans with the settings that make each.
    fn json(&self) -> serde_json::Value {
        let Search { total, gpu, card, ref host_ram, .. } = *self.found;
        let (base, usable, world, reference_cost) = (self.base, self.usable, self.world, self.reference_cost);
        let (fitting, over_host, top, written) = (self.fitting, self.over_host, &self.top, &self.written);
        json!({
            "budget": usable,
            "device": base.train.device.to_string(),
            "card": card,
            "host_ram": host_ram.as_ref().map(|h| json!({"bytes": h.total, "usable": h.usable(), "from": h.from})),
            "fit_device_not_host": over_host.len(),
            "world_size": world,
            "searched": total,
            "fit": fitting.len(),
            "written": written.as_ref().map(|f| f.display().to_string()),
            "configs": top.iter().map(|x| json!({
                "micro_batch": x.candidate.micro_batch,
                "gradient_accumulation_steps": x.candidate.accumulation,
                "precision": x.candidate.precision.as_str(),
                "attention": x.candidate.attention.name,
                "optimizer": x.candidate.optimizer.name,
                "checkpoint": x.candidate.checkpoint.name,
                "master_weights": x.candidate.masters.as_str(),
                "step_in_backward": x.candidate.in_backward,
                "zero_stage": x.candidate.zero_stage,
                "offload": x.candidate.offload.as_ref().map(|o| json!({"tier": o.tier, "path": o.path})),
                "offloaded_bytes": x.estimate.offloaded,
                "state": state_text(&x.candidate, &x.estimate),
                "offload_tiers": x.candidate.host_share.map(placement),
                "host_memory": gpu.then(|| x.host()),
                "state_in_host_memory": gpu.then(|| x.pinned()),
                "state_copies": x.copies().map(|seconds| json!({
                    "bytes_each_way": x.pinned(),
                    "seconds": seconds,
                    "seconds_not_hidden": x.copies_exposed(),
                })),
                "predicted_step": x.time,
                "plan": x.estimate.plan.iter().map(|d| d.as_str()).collect::<Vec<_>>(),
                "peak": x.estimate.breakdown.peak,
                "relative_step_time": x.cost / reference_cost,
                "breakdown": x.estimate.breakdown,
                "sets": x.candidate.sets(usable, &x.estimate),
            })).collect::<Vec<_>>(),
        })
    }
}

/// `base` with the candidate's settings.
fn applied(base: &Config, c: &Candidate) -> Config {
    let mut config = base.clone();
    c.apply(&mut config);
    config
}

/// Estimates `c` with `memory.budget` = `usable` (0: the config's own) and predicts its step
/// (on `card` for a GPU run); `None` when a plugin refuses it (a budget policy that cannot
/// fit, an optimizer that cannot be built).
fn plan_one(
    registry: &ava_plugins::Registry,
    spec: &ModelSpec,
    base: &Config,
    c: &Candidate,
    usable: u64,
    world: usize,
    card: Option<&'static Card>,
) -> Result<Option<Planned>, Failure> {
    let mut config = applied(base, c);
    if usable > 0 {
        config.memory.budget = ava_train::config::ByteSize(usable);
    }
    let Ok(selected) = Selected::new(registry, &config, spec) else { return Ok(None) };
    let plugins = selected.plugins();
    if !plugins.attention.supports_backward() {
        return Ok(None);
    }
    let Ok(est) = estimate_on(spec, &config, &plugins, world) else { return Ok(None) };
    let time = card.map(|card| step_time::predict(spec, &config, &est, card));
    let cost = time.as_ref().map_or_else(|| cost(spec, c, &est, world), |t| t.seconds);
    Ok(Some(Planned { candidate: c.clone(), estimate: est, cost, time }))
}

/// The predicted step cost in forward-FLOP equivalents (see the module docs).
fn cost(spec: &ModelSpec, c: &Candidate, est: &Estimate, world: usize) -> f64 {
    let (b, t) = (c.micro_batch as f64, est.seq_len as f64);
    // Σ of `value` over the blocks, or over the blocks the plan recomputes.
    let over_blocks = |recomputed_only: bool, value: fn(&ava_core::BlockFacts) -> u64| -> f64 {
        let blocks = est.block_facts.iter().zip(&est.plan);
        blocks.filter(|(_, d)| !recomputed_only || d.is_recomputed()).map(|(f, _)| value(f) as f64).sum()
    };
    let blocks = over_blocks(false, |f| f.forward_flops);
    let head = 2.0 * b * t * (spec.hidden * spec.vocab) as f64;
    let recomputed = over_blocks(true, |f| f.forward_flops);
    // The attention kernel's measured cost against standard's, on its share of the FLOPs
    // (scores and weighted sum, forward and backward: 3 · 4·d·T per token and block).
    let attention_flops = 3.0 * 4.0 * spec.hidden as f64 * t * b * t * spec.layers as f64;
    let kernel = attention_flops * (attention_cost(&c.attention.name) - 1.0);
    let precision = if c.precision == Precision::Fp32 { 1.0 } else { HALF_PRECISION_COST };
    let n = est.num_params as f64;
    let compute =
        c.accumulation as f64 * (3.0 * (blocks + head) + recomputed + kernel + MICRO_STEP_COST * n) * precision;
    let rounding =
        if matches!(c.masters, MasterWeights::None | MasterWeights::Kahan) { ROUNDING_COST * n } else { 0.0 };
    // Read and written back every step; what the step waits for of it.
    let wait = 2.0 * est.offloaded as f64 * TIER_WAIT_PER_BYTE[usize::from(!c.in_backward)];
    // From ZeRO stage 1 a rank steps its share of the parameters. (Stages 0–2 move the same
    // bytes between ranks, gradients reduced and weights gathered once a step, so that
    // does not rank them; stage 3 gathers the weights again for every micro-batch's forward,
    // and for each recomputed block's backward, instead of once after the step.)
    let stepped = if c.zero_stage >= 1 { n / world as f64 } else { n };
    let gathers = if c.zero_stage >= 3 && world > 1 {
        let stored = if matches!(c.masters, MasterWeights::F32) { 4.0 } else { 2.0 };
        let (all, again) = (over_blocks(false, |f| f.parameter_bytes), over_blocks(true, |f| f.parameter_bytes));
        // block_facts count f32 bytes; the weights travel in their stored type.
        let per_micro = (stored / 4.0) * (all + again) + stored * (n - all / 4.0);
        (c.accumulation as f64 * per_micro - stored * n).max(0.0) * GATHER_PER_BYTE
    } else {
        0.0
    };
    compute + optimizer_cost(&c.optimizer.name) * stepped + rounding + (wait + gathers) * ENGINE_RATE
}

/// What dominates an estimate's peak: its largest component, and the largest term in it,
/// e.g. `parameters, 12.55 GiB (74%; the largest term: bf16 weights, 12.55 GiB)`.
fn dominant(est: &Estimate) -> String {
    let b = &est.breakdown;
    let parts = [
        (ava_train::estimate::Component::Parameters, b.params),
        (ava_train::estimate::Component::Gradients, b.grads),
        (ava_train::estimate::Component::Optimizer, b.optimizer),
        (ava_train::estimate::Component::Data, b.data),
        (ava_train::estimate::Component::Activations, b.activations),
    ];
    let Some(&(component, bytes)) = parts.iter().max_by_key(|p| p.1) else { return String::new() };
    let term = est.terms.iter().filter(|t| t.component == component).max_by_key(|t| t.bytes);
    format!(
        "{}, {} ({:.0}%{})",
        component.as_str(),
        format_size(bytes),
        100.0 * bytes as f64 / b.peak.max(1) as f64,
        term.map_or(String::new(), |t| format!("; the largest term: {}, {}", t.name, format_size(t.bytes)))
    )
}

/// Where the weights live: `f32`, `bf16 only`, `bf16 + kahan`, `bf16 + masters in nvme`.
fn weights_text(c: &Candidate) -> String {
    let p = c.precision.as_str();
    match c.masters {
        MasterWeights::F32 => "f32".into(),
        MasterWeights::None => format!("{p} only"),
        MasterWeights::Kahan => format!("{p} + kahan"),
        MasterWeights::Tier => {
            format!("{p} + masters in {}", c.offload.as_ref().map_or("the tier", |o| o.tier.as_str()))
        }
    }
}

/// Where the optimizer state lives: `ram` (the CPU engine), `device` (a GPU's memory), the
/// tier and how much it takes there, or on a GPU what lives in page-locked host memory:
/// `ram (host, 50.21 GiB)`, `device 4% + ram (host, 48.2 GiB)`.
fn state_text(c: &Candidate, est: &Estimate) -> String {
    let pinned = est.pinned_state_bytes();
    match &c.offload {
        Some(o) => format!("{} ({})", o.tier, format_size(est.offloaded)),
        None if est.offloaded > 0 => format!("as configured ({})", format_size(est.offloaded)),
        None if pinned > 0 => {
            let on_device = match c.host_share {
                Some(p) => 100 - u32::from(p),
                None => {
                    let kept = est.terms.iter().filter(|t| t.name.starts_with("state kept in device memory"));
                    let kept: u64 = kept.map(|t| t.bytes).sum();
                    (100.0 * kept as f64 / (kept + pinned) as f64).round() as u32
                }
            };
            let host = format!("ram (host, {})", format_size(pinned));
            if on_device == 0 { host } else { format!("device {on_device}% + {host}") }
        }
        None if est.device.is_cuda() => "device".into(),
        None => "ram".into(),
    }
}

/// A GPU plan's state copies a step ([`Planned::copies`]), e.g. `1.11 s`, or `none`.
fn copies_text(x: &Planned) -> String {
    match x.copies() {
        Some(s) => format!("{:.0} ms, {:.0} not hidden", 1e3 * s, 1e3 * x.copies_exposed()),
        None => "none".into(),
    }
}

/// The predicted step against the config as given: on a GPU `412 ms, 19,880 tok/s (×0.98)`,
/// on the CPU `×0.98`.
fn step_text(x: &Planned, reference_cost: f64) -> String {
    let relative = format!("×{:.2}", x.cost / reference_cost);
    match &x.time {
        Some(t) => format!(
            "{:.0} ms, {} tok/s ({relative})",
            1e3 * t.seconds,
            ava_train::estimate::grouped(t.tokens_per_sec.round() as u64)
        ),
        None => relative,
    }
}

/// The optimizer's name, and when it replaces the config's how it trained against AdamW.
fn optimizer_text(given: &str, name: &str) -> String {
    match trains_vs_adamw(name) {
        Some(worse) if name != given => format!("{name} ({:+.1}% val loss)", 100.0 * worse),
        _ => name.to_string(),
    }
}

/// How many of the searched settings differ from the config's.
fn changes(given: &Candidate, c: &Candidate) -> usize {
    [
        c.micro_batch != given.micro_batch,
        c.precision != given.precision,
        c.attention.name != given.attention.name,
        c.optimizer.name != given.optimizer.name,
        c.checkpoint.name != given.checkpoint.name,
        c.masters != given.masters,
        c.in_backward != given.in_backward,
        c.offload.is_some(),
        c.zero_stage != given.zero_stage,
        c.host_share.is_some() && c.host_share != given.host_share,
    ]
    .iter()
    .filter(|&&d| d)
    .count()
}

/// `recompute ×8` or `none`: what the checkpoint policy decided.
fn plan_text(name: &str, est: &Estimate) -> String {
    let n = est.plan.iter().filter(|d| d.is_recomputed()).count();
    match (name, n) {
        (_, 0) => format!("{name} (keeps all)"),
        (_, n) if n == est.plan.len() => format!("{name} (recomputes all {n})"),
        _ => format!("{name} (recomputes {n} of {})", est.plan.len()),
    }
}

fn describe(c: &Candidate, est: &Estimate) -> String {
    format!(
        "micro-batch {} × {}, {}, weights {}, step {}, {}, {}, state in {}, {}",
        c.micro_batch,
        c.accumulation,
        c.precision.as_str(),
        weights_text(c),
        if c.in_backward { "in backward" } else { "after backward" },
        c.attention.name,
        c.optimizer.name,
        state_text(c, est),
        plan_text(&c.checkpoint.name, est)
    )
}

/// Writes the chosen configuration: the base config with the candidate's settings, as the
/// effective YAML (it reads back to the same config), headed by the command that runs it.
fn write_config(
    p: &Printer,
    base: &crate::cli::ConfigArgs,
    best: &Planned,
    usable: u64,
    file: &PathBuf,
    budget_arg: &str,
    world: usize,
) -> CmdResult {
    let mut args = base.clone();
    args.set.extend(best.candidate.sets(usable, &best.estimate));
    // A run of its own: beside the config's out_dir, named after the file, never one that
    // holds a run already (`ava train` would refuse it).
    let given_dir = context::load_config(&args, p)?.into_config().train.out_dir;
    let parent = given_dir.parent().map(PathBuf::from).unwrap_or_default();
    let stem = file.file_stem().map_or("plan".into(), |s| s.to_string_lossy().into_owned());
    let out_dir = (1..)
        .map(|i| parent.join(if i == 1 { stem.clone() } else { format!("{stem}-{i}") }))
        .find(|d| ava_train::run_dir::previous_run(d).is_empty())
        .expect("some name is free");
    args.set.push(format!("train.out_dir={}", out_dir.display()));
    let loaded = context::load_config(&args, p)?;
    let (command, per_rank) = if world > 1 {
        (format!("ava train --nproc {world} -c {}", file.display()), format!(" --world-size {world} (per rank)"))
    } else {
        (format!("ava train -c {}", file.display()), String::new())
    };
    let text = format!(
        "# {command}\n# Written by ava plan --budget {budget_arg}{per_rank}: its choices are the values \"from: \
         --set\"; memory.budget is\n# what the plan fits under (the thresholds memory policy acts at fractions of \
         it).\n{}",
        loaded.to_yaml()
    );
    std::fs::write(file, text)
        .map_err(|e| Failure::Runtime(anyhow::anyhow!("cannot write {}: {e}", file.display())))?;
    Ok(())
}
