//! The activation memory of a checkpoint plan, predicted from the block facts, and the
//! budget search.
//!
//! Block `i` holds `A_i` bytes for backward if kept, or only its input `I_i` if recomputed.
//! Forward builds the blocks bottom-up and backward frees them top-down, so the most memory
//! is held while some block `i` has all its activations (being built in forward, or kept or
//! rebuilt by its recompute in backward) and every block below it still holds what it keeps:
//!
//! ```text
//! peak = max over i of  Σ_{j<i} held_j + A_i      held_j = A_j if kept, I_j if recomputed
//! ```
//!
//! Recomputing the top block therefore never lowers the peak: its activations are needed
//! at once. A segment (a recomputed block and the `Segment` blocks above it) holds only its
//! first block's input, but is rebuilt whole in backward, so it also peaks at
//! `Σ_{j<first} held_j + Σ_{k in segment} A_k`. This leaves out the gradients in flight and
//! the logits, which do not depend on the plan.

use ava_core::{format_size, prelude::*};

/// What block `j` holds for backward under `decision`.
fn held(b: &BlockFacts, decision: BlockDecision) -> u64 {
    match decision {
        BlockDecision::Keep => b.activation_bytes,
        BlockDecision::Recompute | BlockDecision::Offload => b.input_bytes,
        BlockDecision::Segment => 0,
    }
}

/// The predicted activation peak of `plan` and the block where it happens (a segment's
/// first block when its rebuild in backward is the peak).
pub fn peak(blocks: &[BlockFacts], plan: &[BlockDecision]) -> (u64, usize) {
    let mut below = 0u64;
    let mut best = (0u64, 0usize);
    // The open segment: its first block, what was held below it, its blocks' activations.
    let mut segment: Option<(usize, u64, u64)> = None;
    let close = |segment: &mut Option<(usize, u64, u64)>, best: &mut (u64, usize)| {
        if let Some((first, under, rebuilt)) = segment.take()
            && under.saturating_add(rebuilt) > best.0
        {
            *best = (under.saturating_add(rebuilt), first);
        }
    };
    for (i, (b, &d)) in blocks.iter().zip(plan).enumerate() {
        let here = below.saturating_add(b.activation_bytes);
        if here > best.0 {
            best = (here, i);
        }
        match d {
            BlockDecision::Segment => {
                if let Some((_, _, rebuilt)) = &mut segment {
                    *rebuilt = rebuilt.saturating_add(b.activation_bytes);
                }
            }
            BlockDecision::Recompute | BlockDecision::Offload => {
                close(&mut segment, &mut best);
                segment = Some((i, below, b.activation_bytes));
            }
            BlockDecision::Keep => close(&mut segment, &mut best),
        }
        below = below.saturating_add(held(b, d));
    }
    close(&mut segment, &mut best);
    best
}

/// The plan with the fewest recomputed blocks whose predicted peak is at most `budget`.
///
/// Each block `i` sets a demand on the blocks below it: their savings (`A_j − I_j` for each
/// recomputed `j < i`) must reach `Σ_{j<i} A_j + A_i − budget`. Going up the blocks, it
/// meets each demand by recomputing, among the blocks below not yet recomputed, the one that
/// saves the most (the lower one on ties). That is the fewest: a plan that meets the lowest
/// unmet demand must recompute some block below it, and swapping that block for the largest
/// saver below it keeps every demand met (every demand that counts one counts the other).
pub fn fewest_recomputed(blocks: &[BlockFacts], budget: u64) -> Result<Vec<BlockDecision>, PluginError> {
    let mut plan = vec![BlockDecision::Keep; blocks.len()];
    let mut below = 0u64; // Σ_{j<i} held_j under the plan so far
    for (i, b) in blocks.iter().enumerate() {
        while below.saturating_add(b.activation_bytes) > budget {
            let saver = (0..i)
                .filter(|&j| plan[j] == BlockDecision::Keep)
                .map(|j| (blocks[j].activation_bytes.saturating_sub(blocks[j].input_bytes), j))
                .filter(|&(saving, _)| saving > 0)
                .max_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
            let Some((saving, j)) = saver else {
                return Err(PluginError::invalid_input(format!(
                    "the activation budget {} cannot be met: recomputing every block that helps still needs {} \
                     (block {i} holds its activations while the blocks below hold their inputs). \
                     Raise the budget, or lower train.micro_batch_size or data.seq_len",
                    format_size(budget),
                    format_size(below.saturating_add(b.activation_bytes))
                )));
            };
            plan[j] = BlockDecision::Recompute;
            below -= saving;
        }
        below = below.saturating_add(held(b, plan[i]));
    }
    Ok(plan)
}
