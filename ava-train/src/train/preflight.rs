//! Before step 1: does the configured step fit `memory.budget`?
//!
//! The memory policy acts on a step's measured peak, so without this a step that cannot fit
//! runs once at its full size first (a step of 8 GiB under a 2 GiB budget), and a budget no
//! micro-batch fits is found out one halving, and one checkpoint, at a time. Instead the
//! estimator (`ava estimate`: within 1% of the measured peak) predicts the step's peak. When
//! the configured micro-batch is over the budget, the run starts at the largest one that fits,
//! preferring one the memory policy (asked on a fresh instance) would not shrink again at
//! step 1. The loader still reads whole micro-batches of `train.micro_batch_size` rows; each
//! is split into equal pieces, with gradient accumulation, so the samples and the global
//! batch stay as configured. A budget that not even a micro-batch of one fits is refused
//! before anything is allocated.

use ava_core::{MemoryAction, MemoryPolicy, MemoryStats, Phase, format_size};

use super::TrainError;
use crate::config::Config;
use crate::estimate::{Estimate, EstimateError, Plugins, estimate_rank};
use crate::model::ModelSpec;

/// What the preflight decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Preflight {
    /// Pieces each loaded micro-batch is split into (1: the configured micro-batch fits).
    pub split: usize,
    /// The one line that says what changed and why (None when nothing did).
    pub note: Option<String>,
}

/// One micro-batch the run could use, estimated.
struct Probe {
    split: usize,
    peak: u64,
    /// The estimated peak is within `memory.budget`.
    fits: bool,
    /// ... and the memory policy would not act on it (it halves from its critical level).
    quiet: bool,
}

/// Checks the configured step against `memory.budget` (nothing to do without one). A step
/// whose estimated peak is within the budget runs as configured. Otherwise the run starts at
/// the largest micro-batch `train.micro_batch_size` halves to whose estimate the memory policy
/// accepts without acting (so it does not halve again at step 1), else the largest within the
/// budget; [`TrainError::BudgetTooSmall`] when even the smallest is over it. `policy` makes a
/// fresh instance of the run's memory policy (each is asked once); `world` ranks each hold
/// their share, and the rank holding the most decides for all (every rank computes the same
/// answer).
pub fn fit_budget(
    spec: &ModelSpec,
    config: &Config,
    plugins: &Plugins<'_>,
    world: usize,
    policy: &dyn Fn() -> Result<Box<dyn MemoryPolicy>, TrainError>,
) -> Result<Preflight, TrainError> {
    let budget = config.memory.budget.0;
    if budget == 0 {
        return Ok(Preflight { split: 1, note: None });
    }
    let micro = config.train.micro_batch_size;
    let estimate = |split: usize| -> Result<Estimate, TrainError> {
        let mut c = config.clone();
        c.train.micro_batch_size = micro / split;
        c.train.gradient_accumulation_steps = config.train.gradient_accumulation_steps * split;
        estimate_rank(spec, &c, plugins, world, None).map_err(invalid)
    };
    let whole = estimate(1)?;
    if whole.breakdown.peak <= budget {
        return Ok(Preflight { split: 1, note: None });
    }
    let probe = |split: usize| -> Result<Probe, TrainError> {
        let est = estimate(split)?;
        // The loader's queue and the batch in use stay whole-micro-batch sized.
        let peak = est.breakdown.peak + whole.breakdown.data.saturating_sub(est.breakdown.data);
        let stats = MemoryStats {
            current: peak.saturating_sub(est.breakdown.activations),
            peak,
            budget,
            phase: Phase::StepStart,
            step: 0,
            micro_batch: u32::try_from(micro / split).unwrap_or(u32::MAX),
            configured_micro_batch: u32::try_from(micro).unwrap_or(u32::MAX),
        };
        let decision = policy()?
            .observe(&stats)
            .map_err(|e| TrainError::Invalid(format!("memory policy '{}' failed: {e}", config.plugins.memory.name)))?;
        let acts = matches!(
            decision.action,
            MemoryAction::ShrinkMicroBatch | MemoryAction::CheckpointAndShrink | MemoryAction::StopWithCheckpoint
        );
        Ok(Probe { split, peak, fits: peak <= budget, quiet: peak <= budget && !acts })
    };
    // Halvings, as the memory policy shrinks (a checkpoint records the split, a power of
    // two); splitting needs gradient accumulation, which a step inside backward cannot do.
    let splits: Vec<usize> = if config.train.step_in_backward {
        Vec::new()
    } else {
        (1..usize::BITS).map(|k| 1usize << k).take_while(|&d| d <= micro && micro.is_multiple_of(d)).collect()
    };
    let probes = splits.into_iter().map(probe).collect::<Result<Vec<_>, _>>()?;
    let chosen = probes.iter().find(|p| p.quiet).or_else(|| probes.iter().find(|p| p.fits));
    let Some(p) = chosen else {
        let (needed, split) = probes.last().map_or((whole.breakdown.peak, 1), |p| (p.peak, p.split));
        return Err(TrainError::BudgetTooSmall {
            budget,
            needed,
            micro_batch: micro / split,
            in_backward: config.train.step_in_backward && micro > 1,
        });
    };
    let pieces = config.train.gradient_accumulation_steps * p.split;
    let note = format!(
        "memory.budget {}: micro-batch {micro} would peak at {} (estimated); starting at micro-batch {} × {pieces} \
         accumulated instead (estimated peak {}, {:.0}% of the budget), the same {} sequences a step",
        format_size(budget),
        format_size(whole.breakdown.peak),
        micro / p.split,
        format_size(p.peak),
        100.0 * p.peak as f64 / budget as f64,
        config.train.effective_batch(),
    );
    Ok(Preflight { split: p.split, note: Some(note) })
}

fn invalid(e: EstimateError) -> TrainError {
    TrainError::Invalid(e.to_string())
}
