//! [`Documents`]: the packed documents of a micro-batch (`data.packing: document`), as the
//! blocks use them: each token's document id, which the attention kernel turns into "see
//! only your own document", and its position inside the document, which the rotary
//! embedding uses instead of its index in the sequence.

use std::sync::Arc;

use candle_core::{Result, bail};

/// Per token of a (B, T) micro-batch, its document and its position in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Documents {
    batch: usize,
    seq: usize,
    /// (B, T) document ids, non-decreasing along each row.
    segments: Arc<[u32]>,
    /// (B, T) positions: 0 at each document's first token (and at a row's first token).
    positions: Arc<[u32]>,
}

impl Documents {
    /// The documents of a (`batch`, `seq`) micro-batch from its segment ids and positions,
    /// each (B, T) row-major (as [`crate::data::Batch`] gives them).
    pub fn new(batch: usize, seq: usize, segments: Vec<u32>, positions: Vec<u32>) -> Result<Self> {
        if segments.len() != batch * seq || positions.len() != batch * seq {
            bail!(
                "packed documents: {} segment ids and {} positions for a ({batch}, {seq}) batch",
                segments.len(),
                positions.len()
            );
        }
        Ok(Self { batch, seq, segments: segments.into(), positions: positions.into() })
    }

    /// (B, T) document ids, for the attention kernel.
    pub fn segments(&self) -> &Arc<[u32]> {
        &self.segments
    }

    /// (B, T) positions inside the documents, for the rotary embedding.
    pub fn positions(&self) -> &Arc<[u32]> {
        &self.positions
    }

    /// The (B, T) it describes.
    pub fn dims(&self) -> (usize, usize) {
        (self.batch, self.seq)
    }
}
