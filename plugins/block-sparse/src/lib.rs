//! # `block-sparse`: attention over a pattern of blocks
//!
//! Positions are grouped in blocks of `block_size`; a query block sees a key block when
//! the pair is
//!
//! - **local**: fewer than `num_local_blocks` blocks apart (the block itself included);
//! - **global**: either block is among the first `num_global_blocks` (they see and are seen
//!   by everything, BigBird's global tokens);
//! - **strided**: `stride > 0` and their distance is a multiple of `stride` (the strided
//!   pattern of Child et al. 2019, *Generating Long Sequences with Sparse Transformers*,
//!   at block granularity).
//!
//! Inside a visible pair a causal shape still hides later positions. BigBird's random
//! blocks are left out: a pattern that changes between calls would make recomputation in
//! backward (and activation checkpointing) see different attention than forward.
//!
//! It does not take packed documents (`data.packing: document`): its blocks are fixed
//! positions and its global blocks would see across documents, so a run asking for both is
//! refused with this kernel's name before it starts.
//!
//! It runs the tiled FlashAttention-2 forward and backward of
//! [`ava_kernels::attention::flash`], visiting only the pattern's tiles (with
//! `block_size` a multiple of 64 they are exactly the tiles), and saves one logsumexp per
//! query row.
//!
//! ```yaml
//! plugins:
//!   attention: {name: block-sparse, block_size: 64, num_local_blocks: 4, num_global_blocks: 1, stride: 8}
//! ```

use ava_core::prelude::*;
use ava_kernels::attention::{Kernel, Masking};

/// Tiled attention over a local + global + strided block pattern.
#[derive(Debug, Clone, Copy)]
pub struct BlockSparse(Kernel);

impl Plugin for BlockSparse {
    fn manifest() -> Manifest {
        Manifest::new(
            "block-sparse",
            PluginKind::Attention,
            env!("CARGO_PKG_VERSION"),
            "block-sparse attention (local, global and strided blocks; BigBird / Sparse Transformer), tiled",
        )
        .option(OptionSpec::int(
            "block_size",
            64,
            "positions per block; multiples of 64 line up with the kernel's tiles",
        ))
        .option(OptionSpec::int(
            "num_local_blocks",
            4,
            "a query block sees key blocks fewer than this many blocks away (1: only its own block)",
        ))
        .option(OptionSpec::int(
            "num_global_blocks",
            1,
            "the first blocks, which see and are seen by every block (0: none)",
        ))
        .option(OptionSpec::int("stride", 0, "also see blocks whose distance is a multiple of this (0: off)"))
    }

    fn from_options(mut options: Options) -> Result<Self, PluginError> {
        let block = options.int("block_size");
        let local = options.int("num_local_blocks");
        let global = options.int("num_global_blocks");
        let stride = options.int("stride");
        options.check(block >= 1, || format!("option 'block_size': must be at least 1, got {block}"));
        options.check(local >= 1, || {
            format!("option 'num_local_blocks': must be at least 1 (a block must see itself), got {local}")
        });
        options.check(global >= 0, || format!("option 'num_global_blocks': must be 0 or more, got {global}"));
        options.check(stride >= 0, || format!("option 'stride': must be 0 (off) or more, got {stride}"));
        options.finish()?;
        let masking = Masking::Blocks {
            block: block as usize,
            local: local as usize,
            global: global as usize,
            stride: stride as usize,
        };
        Ok(BlockSparse(Kernel::flash(masking)))
    }
}

ava_kernels::delegate_attention!(BlockSparse, 0);

ava_core::export_plugin!(attention: BlockSparse);

#[cfg(test)]
mod tests {
    use ava_kernels::{
        attention::{BlockPattern, Mask, Pattern},
        testing::{self, shape},
    };

    use super::*;

    fn build(json: &str) -> Result<BlockSparse, PluginError> {
        ava_core::ffi::build::<BlockSparse>(json, &HostContext::default())
    }

    /// Output and gradients against the dense kernel under the same block pattern, with
    /// blocks smaller than, equal to and not dividing the tiles.
    #[test]
    fn matches_dense_attention_with_the_same_pattern() {
        for (block, local, global, stride) in [(64, 1, 1, 0), (16, 2, 1, 3), (7, 1, 0, 2), (32, 3, 2, 0), (5, 2, 0, 0)]
        {
            let json = format!(
                r#"{{"block_size": {block}, "num_local_blocks": {local}, "num_global_blocks": {global}, "stride": {stride}}}"#
            );
            let kernel = build(&json).unwrap();
            let mask_for = |s: &AttnShape| {
                let p = Pattern::Blocks(BlockPattern { block, local, global, stride, causal: s.causal });
                Some(Mask::new(p, s.q_len as usize, s.kv_len as usize).unwrap())
            };
            testing::against_dense_everywhere(&kernel, mask_for).unwrap_or_else(|e| panic!("{json}: {e}"));
        }
    }

    #[test]
    fn gradients_match_finite_differences() {
        let kernel = build(r#"{"block_size": 2, "num_local_blocks": 1, "num_global_blocks": 1, "stride": 2}"#).unwrap();
        for (s, seed) in [(shape(1, 4, 2, 9, 9, 3, true), 1), (shape(1, 2, 1, 7, 7, 2, false), 2)] {
            let p = Pattern::Blocks(BlockPattern { block: 2, local: 1, global: 1, stride: 2, causal: s.causal });
            let mask = Mask::new(p, s.q_len as usize, s.kv_len as usize).unwrap();
            testing::finite_differences(&kernel, &s, &mask, seed).unwrap();
        }
    }

    #[test]
    fn bad_options_are_all_reported() {
        let err =
            build(r#"{"block_size": 0, "num_local_blocks": 0, "num_global_blocks": -1, "stride": -2}"#).unwrap_err();
        assert_eq!(
            err.details().collect::<Vec<_>>(),
            [
                "option 'block_size': must be at least 1, got 0",
                "option 'num_local_blocks': must be at least 1 (a block must see itself), got 0",
                "option 'num_global_blocks': must be 0 or more, got -1",
                "option 'stride': must be 0 (off) or more, got -2",
            ]
        );
        let defaults = build("").unwrap();
        assert_eq!(defaults.0, Kernel::flash(Masking::Blocks { block: 64, local: 4, global: 1, stride: 0 }));
    }
}
