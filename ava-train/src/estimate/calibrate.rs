//! The checkpoint plan of the estimate, and the activation budget it was decided on.
//!
//! The policy predicts the blocks' memory from their facts; the logits, the loss and the
//! gradients in flight are not in them, and its model is coarser than the replay. So the
//! budget it is given is calibrated against the replay: the largest budget whose plan the
//! replay fits in `memory.budget`, found by bisection (a larger budget gives a plan that
//! holds more). If no plan fits, the policy refuses the largest budget that does not give
//! one too large, and says why. A policy that ignores the budget (its plan for 1 byte is
//! the same) is asked once, and the estimate says "over budget" if it is.

use ava_core::{BlockDecision, CheckpointContext};

use super::inputs::{Inputs, Kernels};
use super::render;
use super::replay::{MicroBatchPeak, Replay, StepModel};
use super::{EstimateError, dt, replay_on};

/// A plan, its replayed peak, and whether the step fits `memory.budget` with it.
type Outcome = Result<(Vec<BlockDecision>, MicroBatchPeak, bool), EstimateError>;

/// The plan the estimate reports.
pub(super) struct Planned {
    /// The policy's decision per block.
    pub(super) plan: Vec<BlockDecision>,
    /// One micro-batch's replay under it.
    pub(super) peak: MicroBatchPeak,
    /// The activation budget the policy was given (0 without `memory.budget`).
    pub(super) activation_budget: u64,
}

/// The checkpoint policy asked for plans on the block facts, each plan replayed and held
/// against `memory.budget`.
struct Calibration<'a> {
    /// The step's inputs (the policy, the accumulation).
    s: &'a Inputs<'a>,
    /// The facts and the kernel's declarations.
    kernels: &'a Kernels,
    /// One micro-batch on shadow tensors.
    replay: Replay<'a>,
    /// Bytes held outside the micro-batch: the held terms, the accumulators, the workspace.
    outside: u64,
    /// `memory.budget` in bytes (0: none).
    budget: u64,
}

impl Calibration<'_> {
    /// The policy's plan for an activation budget of `budget_bytes`, replayed. Both the
    /// trainer and the estimate offer the offload tier (there always is one, `ram` by
    /// default); the replay counts an offloaded input as held on the CPU, which is what `ram`
    /// does, and off the device on a GPU (`ParkedInputs`).
    fn decide(&self, budget_bytes: u64) -> Outcome {
        let ctx = CheckpointContext { budget_bytes, offload_available: true };
        let plan = self.s.plugins.checkpoint.decide(&self.kernels.facts, &ctx);
        let plan = plan.map_err(|e| EstimateError::Checkpoint { message: e.to_string() })?;
        ava_core::check_plan(&plan, self.kernels.facts.len()).map_err(|message| EstimateError::Plan { message })?;
        let peak = self.replay.forward_backward(&plan, self.s.accumulation > 1);
        // The estimate's peak, as the breakdown adds it up.
        let fits = self.outside + peak.bytes + peak.tier_peak <= self.budget;
        Ok((plan, peak, fits))
    }

    /// `lo` does not give a plan too large (it fits, or is refused), `hi` does: the largest
    /// such budget and its outcome.
    fn bisect(&self, mut lo: u64, mut at_lo: Outcome, mut hi: u64) -> (u64, Outcome) {
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            match self.decide(mid) {
                Ok((_, _, false)) => hi = mid,
                other => (lo, at_lo) = (mid, other),
            }
        }
        (lo, at_lo)
    }

    /// The most worth giving: room for every block's activations (a budget past that keeps
    /// them all), or all of `memory.budget` (for a policy whose model over-predicts).
    fn all_kept(&self) -> u64 {
        (self.kernels.facts.iter().map(|f| f.activation_bytes + f.input_bytes).sum::<u64>() + 1).max(self.budget)
    }

    /// From `target` (what `memory.budget` leaves for activations), the calibrated budget
    /// and its outcome.
    fn calibrate(&self, target: u64) -> (u64, Outcome) {
        let outcome = self.decide(target);
        if target == 0 || same_plan(&outcome, &self.decide(1)) {
            return (target, outcome);
        }
        let all_kept = self.all_kept();
        match &outcome {
            Ok((_, _, false)) => {
                let at_one = self.decide(1);
                if !matches!(at_one, Ok((_, _, false))) {
                    return self.bisect(1, at_one, target);
                }
            }
            // Refused, or fits: a larger budget may still fit (the policy's block model can
            // over-predict the replay).
            Ok((_, _, true)) | Err(EstimateError::Checkpoint { .. }) if all_kept > target => {
                let at_top = self.decide(all_kept);
                let (raised, at_raised) = match at_top {
                    Ok((_, _, true)) => (all_kept, at_top),
                    Ok((_, _, false)) => self.bisect(target, self.decide(target), all_kept),
                    err => (all_kept, err),
                };
                // Only a plan that fits replaces the first answer: a refusal keeps the
                // policy's own words about the budget memory.budget leaves.
                if matches!(at_raised, Ok((_, _, true))) {
                    return (raised, at_raised);
                }
            }
            _ => {}
        }
        (target, outcome)
    }
}

/// Whether two outcomes are the same plan.
fn same_plan(a: &Outcome, b: &Outcome) -> bool {
    matches!((a, b), (Ok((p, _, _)), Ok((q, _, _))) if p == q)
}

/// The policy's plan on the block facts, with the activation budget calibrated against the
/// replay under `step`. `outside`: bytes held outside the micro-batch (the held terms, the
/// accumulators, the workspace); `fixed`: those and this micro-batch's gradients, all that is
/// not activations.
pub(super) fn plan(
    s: &Inputs<'_>,
    kernels: &Kernels,
    step: StepModel,
    outside: u64,
    fixed: u64,
) -> Result<Planned, EstimateError> {
    let budget = s.config.memory.budget.0;
    // 0 would mean "no budget"; a budget already spent leaves the smallest one.
    let target = if budget == 0 { 0 } else { budget.saturating_sub(fixed).max(1) };
    let replay = replay_on(s.device, Replay::new(s.spec, s.batch, s.seq, dt(s.precision), kernels.saved))
        .with_saved_half(kernels.saved_size == 2)
        .with_workspace(kernels.workspace_lens[0], kernels.workspace_lens[1])
        .with_loss_chunk_rows(s.config.train.loss_chunk_rows)
        .with_parked_inputs(s.parked_inputs())
        .with_step(step);
    let calibration = Calibration { s, kernels, replay, outside, budget };
    match calibration.calibrate(target) {
        (activation_budget, Ok((plan, peak, _))) => Ok(Planned { plan, peak, activation_budget }),
        (given, Err(EstimateError::Checkpoint { message })) => {
            Err(EstimateError::Checkpoint { message: explain_refusal(message, budget, fixed, target, given) })
        }
        (_, Err(e)) => Err(e),
    }
}

/// The policy's refusal, with where `memory.budget` went: not even the rest of the step
/// fits (the 1 byte passed), or less than `target` was given for the logits, loss and
/// gradients in flight.
fn explain_refusal(mut message: String, budget: u64, fixed: u64, target: u64, given: u64) -> String {
    if budget > 0 && budget <= fixed {
        message.push_str(&format!(
            ". memory.budget ({}) does not even cover the rest of the step (parameters, gradients, \
             optimizer state, data and workspace: {}); raise it",
            render::bytes(budget),
            render::bytes(fixed)
        ));
    } else if given < target {
        message.push_str(&format!(
            ". That is what memory.budget ({}) leaves for activations ({}) less {} for the logits, loss \
             and gradients in flight, which the block facts do not include: with more, the policy's plan \
             would not fit. Raise memory.budget, or lower train.micro_batch_size or data.seq_len",
            render::bytes(budget),
            render::bytes(target),
            render::bytes(target - given)
        ));
    }
    message
}
