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
}

impl BlockDecision {
    /// Lowercase name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Keep => "keep",
            Self::Recompute => "recompute",
            Self::Offload => "offload",
        }
    }
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
        if out.len() != blocks.len() {
            return Err(PluginError::internal(format!("returned {} decisions for {} blocks", out.len(), blocks.len())));
        }
        Ok(out)
    }
}
