//! # `sliding-window`: banded attention that is linear in the sequence length
//!
//! Each query sees only the last `window` positions, its own included (Mistral's sliding
//! window; the causal form of Longformer's): `p − window < j <= p`. With
//! `causal: false` in the attention shape the band is symmetric, `|p − j| < window`
//! (Longformer's local attention). A window at least as long as the sequence is plain
//! causal attention.
//!
//! It runs the same tiled FlashAttention-2 forward and backward as `flash`
//! ([`ava_kernels::attention::flash`]) and visits only the tiles that touch the band, so
//! for a fixed window both time and memory grow linearly in T; it saves one logsumexp per
//! query row. With packed documents (`data.packing: document`) the band also stops at the
//! query's document boundary.
//!
//! ```yaml
//! plugins:
//!   attention: {name: sliding-window, window: 256}
//! ```

use ava_core::prelude::*;
use ava_kernels::attention::{Kernel, Masking};

/// Tiled attention over a band of `window` positions.
#[derive(Debug, Clone, Copy)]
pub struct SlidingWindow(Kernel);

impl Plugin for SlidingWindow {
    fn manifest() -> Manifest {
        Manifest::new(
            "sliding-window",
            PluginKind::Attention,
            env!("CARGO_PKG_VERSION"),
            "sliding-window attention (each query sees the last `window` positions), tiled; time and memory linear in T",
        )
        .option(OptionSpec::int(
            "window",
            256,
            "positions each query sees, its own included; a window >= the sequence length is full causal attention",
        ))
    }

    fn from_options(mut options: Options) -> Result<Self, PluginError> {
        let window = options.int("window");
        options.check(window >= 1, || format!("option 'window': must be at least 1, got {window}"));
        options.finish()?;
        Ok(SlidingWindow(Kernel::flash(Masking::Window(window as usize))))
    }
}

ava_kernels::delegate_attention!(SlidingWindow, 0);

ava_core::export_plugin!(attention: SlidingWindow);

#[cfg(test)]
mod tests {
    use ava_kernels::{
        attention::{Mask, Pattern},
        testing::{self, Rng, shape},
    };

    use super::*;

    fn window(w: usize) -> SlidingWindow {
        ava_core::ffi::build::<SlidingWindow>(&format!(r#"{{"window": {w}}}"#), &HostContext::default()).unwrap()
    }

    /// Output and gradients against the dense kernel under the same band, for windows
    /// shorter than, cutting through, and longer than the sequences.
    #[test]
    fn matches_dense_attention_with_the_same_band() {
        for w in [1, 5, 64, 100, 1000] {
            let mask_for = |s: &AttnShape| {
                let p = Pattern::Window { window: w, causal: s.causal };
                Some(Mask::new(p, s.q_len as usize, s.kv_len as usize).unwrap())
            };
            testing::against_dense_everywhere(&window(w), mask_for).unwrap_or_else(|e| panic!("window {w}: {e}"));
        }
    }

    #[test]
    fn gradients_match_finite_differences() {
        for (s, w, seed) in [(shape(1, 4, 2, 7, 7, 3, true), 3, 1), (shape(1, 2, 1, 6, 6, 2, false), 2, 2)] {
            let mask = Mask::new(Pattern::Window { window: w, causal: s.causal }, s.q_len as usize, s.kv_len as usize);
            testing::finite_differences(&window(w), &s, &mask.unwrap(), seed).unwrap();
        }
    }

    /// A window covering the whole sequence is causal full attention: the same numbers as
    /// the dense causal kernel (within f32 rounding) and as `flash` (bit for bit).
    #[test]
    fn a_window_covering_the_sequence_is_causal_attention() {
        for (s, seed) in [(shape(1, 4, 2, 130, 130, 64, true), 4u64), (shape(2, 2, 2, 1, 1, 16, true), 5)] {
            let mut rng = Rng(seed);
            let (q, k, v, r) =
                (rng.vec(s.q_numel()), rng.vec(s.kv_numel()), rng.vec(s.kv_numel()), rng.vec(s.q_numel()));
            let causal = Mask::new(Pattern::Causal, s.q_len as usize, s.kv_len as usize).unwrap();
            let flash = testing::run(&Kernel::flash(Masking::Plain), &s, (&q, &k, &v, &r), 2).unwrap();
            for w in [s.kv_len as usize, s.kv_len as usize + 1, 100_000] {
                testing::against_dense(&window(w), &s, &causal, 2, seed).unwrap();
                assert_eq!(testing::run(&window(w), &s, (&q, &k, &v, &r), 2).unwrap(), flash, "window {w}");
            }
        }
    }

    #[test]
    fn bad_windows_are_refused_with_the_option_named() {
        let err = ava_core::ffi::build::<SlidingWindow>(r#"{"window": 0}"#, &HostContext::default()).unwrap_err();
        assert_eq!(err.details().collect::<Vec<_>>(), ["option 'window': must be at least 1, got 0"]);
        let err = window(4).saved_len(&shape(1, 1, 1, 5, 3, 8, false)).unwrap_err();
        assert!(err.message.contains("q_len (5) <= kv_len (3)"), "{err}");
    }
}
