//! # `flash`: FlashAttention-2 on the CPU, with a real backward pass
//!
//! The algorithm of Dao 2023 (*FlashAttention-2: Faster Attention with Better Parallelism
//! and Work Partitioning*) on f32 host buffers: tiles of queries against tiles of keys with
//! an online softmax, so the T × T probabilities never exist. Forward saves only the output
//! (which the host keeps anyway) and one logsumexp per query row — B·H·T floats instead of
//! `standard`'s B·H·T²; backward recomputes each probability tile from the logsumexp.
//! Causal masking skips the tiles above the diagonal; grouped-query attention is supported.
//! With packed documents (`data.packing: document`) a query sees only its own document's
//! keys, and the tiles between documents are skipped like those above the diagonal.
//!
//! The math, tiling and threading live in [`ava_kernels::attention::flash`], shared with
//! the `sliding-window` and `block-sparse` plugins; this crate is the plugin around it.
//!
//! Built with the `cuda` feature (or in a workspace build where ava-kernels has it), it also
//! runs on NVIDIA GPUs: ava-kernels' kernels/flash.cu, bf16/f16 tiles on the tensor cores with
//! f32 accumulation, f32 on the CUDA cores; its manifest then lists the cuda device.
//!
//! ```yaml
//! plugins:
//!   attention: flash
//! ```

use ava_core::prelude::*;
use ava_kernels::attention::{Kernel, Masking};

/// Tiled causal (or full) attention saving the logsumexp. No options: the tile sizes are
/// tuned per head size and direction ([`ava_kernels::attention::Tiles::tuned_forward`],
/// [`ava_kernels::attention::Tiles::tuned_backward`]).
#[derive(Debug, Clone, Copy)]
pub struct Flash(Kernel);

/// The kernel: tiled under the plain (causal or full) mask.
const FLASH: Kernel = Kernel::flash(Masking::Plain);

impl Plugin for Flash {
    fn manifest() -> Manifest {
        Manifest::new(
            "flash",
            PluginKind::Attention,
            env!("CARGO_PKG_VERSION"),
            "FlashAttention-2 (tiled, online softmax; causal, GQA); saves one logsumexp per query row instead of Tq×Tk probabilities",
        )
        .devices(FLASH.devices())
    }

    fn from_options(options: Options) -> Result<Self, PluginError> {
        options.finish()?;
        Ok(Flash(FLASH))
    }
}

ava_kernels::delegate_attention!(Flash, 0);

ava_core::export_plugin!(attention: Flash);

#[cfg(test)]
mod tests {
    use ava_kernels::{
        attention::{Mask, Pattern},
        testing::{self, shape},
    };

    use super::*;

    fn flash() -> Flash {
        ava_core::ffi::build::<Flash>("", &HostContext::default()).unwrap()
    }

    fn plain(s: &AttnShape) -> Mask<'static> {
        let p = if s.causal { Pattern::Causal } else { Pattern::Full };
        Mask::new(p, s.q_len as usize, s.kv_len as usize).unwrap()
    }

    /// Output, dq, dk and dv against the dense kernel with the same mask (f32, atol 1e-4,
    /// rtol 1e-3) over odd lengths, T = 1, head_dim 16/64/128, GQA 1/2/4, causal on and off,
    /// with and without packed documents (segment ids), 1 and 3 threads.
    #[test]
    fn matches_dense_attention() {
        assert!(flash().supports_segments());
        let cases = testing::against_dense_everywhere(&flash(), |s| Some(plain(s))).unwrap();
        assert_eq!(cases, testing::SHAPES.len() * 2 * 2 * 2);
    }

    #[test]
    fn gradients_match_finite_differences() {
        for (s, seed) in [(shape(1, 4, 2, 5, 5, 3, true), 1), (shape(1, 2, 1, 3, 4, 4, false), 2)] {
            testing::finite_differences(&flash(), &s, &plain(&s), seed).unwrap();
        }
    }

    /// The saved buffer is one f32 per query row: at T = 4096 that is 1/4096 of `standard`'s.
    #[test]
    fn saves_one_float_per_query_row() {
        let s = AttnShape::self_attention(1, 4, 4, 4096, 64, true);
        assert_eq!(flash().saved_len(&s).unwrap(), 4 * 4096);
        assert!(flash().supports_backward());
    }

    #[test]
    fn takes_no_options() {
        let err = ava_core::ffi::build::<Flash>(r#"{"window": 4}"#, &HostContext::default()).unwrap_err();
        assert_eq!(err.details().collect::<Vec<_>>(), ["unknown option 'window' ('flash' takes no options)"]);
        let err = flash().saved_len(&shape(1, 3, 2, 4, 4, 8, true)).unwrap_err();
        assert_eq!(err.message.as_str(), "q_heads (3) must be a multiple of kv_heads (2)");
    }
}
