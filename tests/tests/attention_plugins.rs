//! The attention plugin libraries through the real boundary: loaded from their `.so` files
//! into one registry, called through the FFI trait objects, and compared with the built-in
//! dense kernel under the same mask.

#![cfg(target_os = "linux")]

mod common;

use ava_core::{AttnShape, ErrorKind, PluginKind};
use ava_kernels::{
    attention::{BlockPattern, Mask, Pattern},
    testing::{self, shape},
};
use ava_plugins::{HostError, VettingPolicy};
use ava_tests::workspace_plugin;
use common::{host, load, private_copy};

fn mask(pattern: Pattern, s: &AttnShape) -> Mask<'static> {
    Mask::new(pattern, s.q_len as usize, s.kv_len as usize).unwrap()
}

#[test]
fn three_kernels_from_their_libraries_match_dense_attention() {
    let tmp = tempfile::tempdir().unwrap();
    for name in ["flash", "sliding-window", "block-sparse"] {
        private_copy(&workspace_plugin(name), tmp.path());
    }
    let reg = load(&host(&[tmp.path()], VettingPolicy::Open));
    let mut names = reg.names(PluginKind::Attention);
    names.sort();
    assert_eq!(names, ["block-sparse", "flash", "sliding-window", "standard"]);

    let flash = reg.attention("flash", "").unwrap();
    let window = reg.attention("sliding-window", r#"{"window": 5}"#).unwrap();
    let blocks = reg
        .attention("block-sparse", r#"{"block_size": 4, "num_local_blocks": 2, "num_global_blocks": 1, "stride": 3}"#)
        .unwrap();
    let standard = reg.attention("standard", "").unwrap();
    for (s, seed) in [(shape(2, 4, 2, 70, 70, 16, true), 1), (shape(1, 2, 1, 9, 13, 64, false), 2)] {
        let plain = mask(if s.causal { Pattern::Causal } else { Pattern::Full }, &s);
        testing::against_dense(flash.as_ref(), &s, &plain, 2, seed).unwrap();
        testing::against_dense(standard.as_ref(), &s, &plain, 2, seed).unwrap();
        let band = Pattern::Window { window: 5, causal: s.causal };
        testing::against_dense(window.as_ref(), &s, &mask(band, &s), 2, seed).unwrap();
        let pattern = Pattern::Blocks(BlockPattern { block: 4, local: 2, global: 1, stride: 3, causal: s.causal });
        testing::against_dense(blocks.as_ref(), &s, &mask(pattern, &s), 2, seed).unwrap();
    }
    // Flash's saved buffer is the logsumexp: B·H·T floats where standard saves B·H·T².
    let s = AttnShape::self_attention(1, 4, 4, 4096, 64, true);
    assert_eq!(flash.saved_len(&s).unwrap(), 4 * 4096);
    assert_eq!(standard.saved_len(&s).unwrap(), 4 * 4096 * 4096);
}

#[test]
fn option_and_shape_errors_cross_the_boundary_named() {
    let tmp = tempfile::tempdir().unwrap();
    private_copy(&workspace_plugin("sliding-window"), tmp.path());
    let reg = load(&host(&[tmp.path()], VettingPolicy::Open));
    let err = reg.attention("sliding-window", r#"{"window": 0, "size": 3}"#).err().expect("refused");
    let text = err.to_string();
    assert!(matches!(err, HostError::Plugin { .. }), "{err:?}");
    assert!(text.contains("sliding-window"), "{text}");
    for detail in ["option 'window': must be at least 1, got 0", "unknown option 'size'"] {
        assert!(text.contains(detail), "{text}");
    }
    let window = reg.attention("sliding-window", "").unwrap();
    let err = window.saved_len(&shape(1, 1, 1, 5, 3, 8, false)).unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidInput);
    assert!(err.message.contains("q_len (5) <= kv_len (3)"), "{err}");
}
