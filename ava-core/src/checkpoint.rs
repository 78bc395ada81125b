//! The [`CheckpointPolicy`] trait: decides, per transformer block, what happens to its
//! activations. It returns decisions as data; the engine implements them (detached forward,
//! recompute in backward, offload of block inputs).

use abi_stable::{
    StableAbi, sabi_trait,
    std_types::{RBox, RResult, RSlice, RVec},
};

use crate::{PluginError, ffi::guard};

/// Facts about one block, computed by the engine for the current shapes.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockFacts {
    /// Position of the block, 0-based.
    pub index: u32,
    /// Bytes of activations the block keeps for backward if it is not recomputed.
    pub activation_bytes: u64,
    /// Bytes of the block's input (what a recomputed block keeps).
    pub input_bytes: u64,
    /// Bytes of the block's parameters.
    pub parameter_bytes: u64,
    /// FLOPs of one forward pass of the block (the price of recomputing it).
    pub forward_flops: u64,
}

/// What the policy is deciding for.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckpointContext {
    /// Activation memory budget in bytes; 0 means no budget was given.
    pub budget_bytes: u64,
    /// Whether an offload tier is configured (otherwise `Offload` is not allowed).
    pub offload_available: bool,
}

/// The fate of one block's activations.
#[repr(u8)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockDecision {
    /// Keep every activation for backward (fastest, most memory).
    Keep = 0,
    /// Keep only the block input; recompute the block in backward.
    Recompute = 1,
    /// Like `Recompute`, with the block input moved to the offload tier.
    Offload = 2,
    /// Part of the segment that the block below starts (Chen et al. 2016): keeps nothing,
    /// not even its input. In backward the whole segment is run again from its first
    /// block's input, so its blocks' activations are all held at once while it is
    /// back-propagated. Allowed only above a `Recompute`, `Offload` or `Segment` block.
    Segment = 3,
}

impl BlockDecision {
    /// Lowercase name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Keep => "keep",
            Self::Recompute => "recompute",
            Self::Offload => "offload",
            Self::Segment => "segment",
        }
    }

    /// Whether the block is run detached in forward and again in backward.
    pub fn is_recomputed(self) -> bool {
        self != Self::Keep
    }
}

/// Checks a policy's plan for `blocks` blocks: one decision per block, and every `Segment`
/// above a recomputed block. The message says what is wrong, for the policy's author.
pub fn check_plan(plan: &[BlockDecision], blocks: usize) -> Result<(), String> {
    if plan.len() != blocks {
        return Err(format!("returned {} decisions for {blocks} blocks; a policy decides once per block", plan.len()));
    }
    for (i, pair) in plan.windows(2).enumerate() {
        if pair[1] == BlockDecision::Segment && pair[0] == BlockDecision::Keep {
            return Err(format!(
                "block {} is 'segment' but block {i} below it is 'keep': a segment starts at a 'recompute' \
                 or 'offload' block",
                i + 1
            ));
        }
    }
    if plan.first() == Some(&BlockDecision::Segment) {
        return Err("block 0 is 'segment', which needs a recomputed block below it: start it with 'recompute'".into());
    }
    Ok(())
}

/// A checkpointing policy.
pub trait CheckpointPolicy: Send + Sync {
    /// One decision per entry of `blocks`, in the same order.
    fn decide(&self, blocks: &[BlockFacts], ctx: &CheckpointContext) -> Result<Vec<BlockDecision>, PluginError>;
}

/// The FFI-safe form of [`CheckpointPolicy`].
#[sabi_trait]
pub trait FfiCheckpoint: Send + Sync {
    /// See [`CheckpointPolicy::decide`].
    fn decide(
        &self,
        blocks: RSlice<'_, BlockFacts>,
        ctx: CheckpointContext,
    ) -> RResult<RVec<BlockDecision>, PluginError>;
}

/// A boxed checkpoint policy from a plugin library.
pub type CheckpointBox = FfiCheckpoint_TO<'static, RBox<()>>;

pub(crate) struct Guarded<T>(pub T);

impl<T: CheckpointPolicy> FfiCheckpoint for Guarded<T> {
    fn decide(
        &self,
        blocks: RSlice<'_, BlockFacts>,
        ctx: CheckpointContext,
    ) -> RResult<RVec<BlockDecision>, PluginError> {
        guard("CheckpointPolicy::decide", || self.0.decide(&blocks, &ctx).map(RVec::from))
    }
}

/// Host side: a plugin's policy behind the Rust trait. Checks the answer's length.
pub struct ForeignCheckpoint(pub CheckpointBox);

impl CheckpointPolicy for ForeignCheckpoint {
    fn decide(&self, blocks: &[BlockFacts], ctx: &CheckpointContext) -> Result<Vec<BlockDecision>, PluginError> {
        let out = self.0.decide(blocks.into(), *ctx).into_result()?.into_vec();
        check_plan(&out, blocks.len()).map_err(PluginError::internal)?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::{BlockDecision::*, check_plan};

    #[test]
    fn a_plan_has_a_decision_per_block_and_segments_above_recomputed_blocks() {
        assert_eq!(check_plan(&[Keep, Recompute, Segment, Offload, Segment, Segment], 6), Ok(()));
        assert_eq!(check_plan(&[], 0), Ok(()));
        assert_eq!(
            check_plan(&[Keep; 3], 4).unwrap_err(),
            "returned 3 decisions for 4 blocks; a policy decides once per block"
        );
        assert_eq!(
            check_plan(&[Recompute, Keep, Segment], 3).unwrap_err(),
            "block 2 is 'segment' but block 1 below it is 'keep': a segment starts at a 'recompute' or 'offload' block"
        );
        assert!(check_plan(&[Segment, Recompute], 2).unwrap_err().starts_with("block 0 is 'segment'"));
    }
}
