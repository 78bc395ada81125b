//! Placeholder replaced by the estimator work in progress.
use ava_core::{AttentionKernel, AttnShape, BlockFacts};

use crate::config::Precision;
use crate::model::ModelSpec;

/// Estimation errors.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct EstimateError(String);

/// Per-block facts for the checkpoint policy.
pub fn block_facts(
    spec: &ModelSpec,
    batch: usize,
    seq: usize,
    precision: Precision,
    attention: &dyn AttentionKernel,
) -> Result<Vec<BlockFacts>, EstimateError> {
    let shape = AttnShape::self_attention(batch, spec.heads, spec.kv_heads, seq, spec.head_dim(), true);
    let saved = attention.saved_len(&shape).map_err(|e| EstimateError(e.to_string()))? * 4;
    let bt = (batch * seq) as u64;
    let input = bt * spec.hidden as u64 * precision.bytes() as u64;
    Ok((0..spec.layers)
        .map(|i| BlockFacts {
            index: i as u32,
            activation_bytes: saved + 20 * input,
            input_bytes: input,
            parameter_bytes: 0,
            forward_flops: 0,
        })
        .collect())
}

/// Plugins the estimate asks for their sizes.
pub struct Plugins<'a> {
    /// Optimizer.
    pub optimizer: &'a dyn ava_core::Optimizer,
    /// Attention.
    pub attention: &'a dyn AttentionKernel,
    /// Checkpoint policy.
    pub checkpoint: &'a dyn ava_core::CheckpointPolicy,
}

/// An estimate.
#[derive(Debug, serde::Serialize)]
pub struct Estimate {}

impl Estimate {
    /// Text.
    pub fn render(&self) -> String {
        String::new()
    }
}

/// Estimates.
pub fn estimate(_: &ModelSpec, _: &crate::config::Config, _: &Plugins) -> Result<Estimate, EstimateError> {
    Err(EstimateError("not yet".into()))
}
