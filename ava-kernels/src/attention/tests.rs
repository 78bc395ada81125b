//! The algorithms against each other and against the f64 definition, over every pattern.

use ava_core::{AttentionKernel, AttnShape, KernelContext, attention::Pass};

use super::*;
use crate::testing::{self, Rng, shape};

/// (B, H, Hkv, Tq, Tk, D): T = 1, odd lengths, head_dim 16/64/128, GQA 1/2/4, decoding
/// (Tq < Tk).
const SHAPES: &[(u32, u32, u32, u32, u32, u32)] = &[
    (1, 1, 1, 1, 1, 16),
    (2, 4, 4, 7, 7, 16),
    (1, 4, 2, 13, 13, 64),
    (2, 8, 2, 5, 5, 16),
    (1, 4, 1, 37, 37, 16),
    (1, 2, 2, 70, 70, 128),
    (1, 4, 1, 3, 10, 16),
    (2, 2, 1, 1, 9, 64),
    (1, 4, 4, 129, 129, 16),
];

fn maskings() -> Vec<Masking> {
    vec![
        Masking::Plain,
        Masking::Window(1),
        Masking::Window(3),
        Masking::Window(16),
        Masking::Window(1000),
        Masking::Blocks { block: 4, local: 2, global: 1, stride: 0 },
        Masking::Blocks { block: 3, local: 1, global: 0, stride: 2 },
        Masking::Blocks { block: 16, local: 1, global: 1, stride: 3 },
    ]
}

/// Tiles that cut every shape above mid-tile, the tuned ones (D=64 forward and backward),
/// and a lopsided pair.
const TILES: [Tiles; 4] =
    [Tiles { q: 4, k: 3 }, Tiles { q: 128, k: 64 }, Tiles { q: 64, k: 64 }, Tiles { q: 16, k: 32 }];

/// Dense attention under every mask matches the f64 definition (this is the reference the
/// plugins are compared with), and its gradients match finite differences.
#[test]
fn dense_matches_the_definition() {
    for masking in maskings() {
        let kernel = Kernel::dense(masking);
        for (n, &(b, h, hkv, tq, tk, d)) in SHAPES.iter().enumerate().filter(|(_, s)| s.3 <= 40) {
            for causal in [true, false] {
                let s = shape(b, h, hkv, tq, tk, d, causal);
                let Ok(mask) = masking.mask(&s) else { continue };
                check_forward_against_f64(&kernel, &s, &mask, n as u64, false);
            }
        }
        let s = shape(1, 4, 2, 5, 5, 3, true);
        testing::finite_differences(&kernel, &s, &masking.mask(&s).unwrap(), 11).unwrap();
    }
}

/// Out (and, when the kernel saves it, the logsumexp) against the f64 reference.
fn check_forward_against_f64(kernel: &dyn AttentionKernel, s: &AttnShape, mask: &Mask<'_>, seed: u64, saves_lse: bool) {
    let mut rng = Rng(seed);
    let (q, k, v) = (rng.vec(s.q_numel()), rng.vec(s.kv_numel()), rng.vec(s.kv_numel()));
    let mut out = vec![f32::NAN; s.q_numel()];
    let mut saved = vec![f32::NAN; kernel.saved_len(s).unwrap() as usize];
    let ctx = KernelContext { threads: 2, ..Default::default() };
    let mut ws = vec![f32::NAN; kernel.workspace_len(s, Pass::Forward, &ctx).unwrap() as usize];
    kernel.forward(s, &q, &k, &v, mask.segments(), &mut out, &mut saved, &mut ws, &ctx).unwrap();
    let f64s = |x: &[f32]| x.iter().map(|&x| x as f64).collect::<Vec<f64>>();
    let (want, lse) = testing::reference(s, mask, &f64s(&q), &f64s(&k), &f64s(&v));
    for (i, (&got, &want)) in out.iter().zip(&want).enumerate() {
        // D <= 128 products of numbers in [-1, 1): f32 rounding stays below ~1e-5.
        assert!((got as f64 - want).abs() < 2e-5, "{:?} {s:?} out[{i}] = {got}, reference {want}", mask.pattern());
    }
    if saves_lse {
        for (i, (&got, &want)) in saved.iter().zip(&lse).enumerate() {
            assert!((got as f64 - want).abs() < 1e-5, "{:?} {s:?} lse[{i}] = {got}, reference {want}", mask.pattern());
        }
    }
}

/// The tiled kernel equals the dense one under the same mask (out, dq, dk, dv within
/// atol 1e-4, rtol 1e-3) for every shape, mask, causal flag, tile size and thread count.
#[test]
fn flash_matches_dense_everywhere() {
    for masking in maskings() {
        for tiles in TILES {
            let kernel = Kernel { masking, algorithm: Algorithm::Flash(Some(tiles)) };
            for (n, &(b, h, hkv, tq, tk, d)) in SHAPES.iter().enumerate() {
                for causal in [true, false] {
                    let s = shape(b, h, hkv, tq, tk, d, causal);
                    let Ok(mask) = masking.mask(&s) else { continue };
                    for threads in [1, 3] {
                        testing::against_dense(&kernel, &s, &mask, threads, n as u64)
                            .unwrap_or_else(|e| panic!("{masking:?} {tiles:?}: {e}"));
                    }
                }
            }
        }
    }
}

/// More queries than keys, which only the full pattern takes (the last queries' positions
/// lie past the last key): the tiled kernel matches dense, query tiles past Tk included (its
/// backward once skipped them: `Mask::row_span` bounded the rows by the keys' end).
#[test]
fn flash_matches_dense_with_more_queries_than_keys() {
    let tiles = TILES.into_iter().map(Some).chain([None]);
    for tiles in tiles {
        let kernel = Kernel { masking: Masking::Plain, algorithm: Algorithm::Flash(tiles) };
        for (n, s) in [shape(1, 4, 2, 45, 20, 16, false), shape(2, 2, 1, 200, 10, 64, false)].iter().enumerate() {
            let mask = Masking::Plain.mask(s).unwrap();
            for threads in [1, 3] {
                testing::against_dense(&kernel, s, &mask, threads, n as u64)
                    .unwrap_or_else(|e| panic!("{tiles:?}: {e}"));
            }
        }
    }
}

/// Flash forward against the f64 definition directly, logsumexp included.
#[test]
fn flash_forward_and_logsumexp_match_the_definition() {
    for masking in maskings() {
        let kernel = Kernel { masking, algorithm: Algorithm::Flash(Some(Tiles { q: 4, k: 3 })) };
        for (n, &(b, h, hkv, tq, tk, d)) in SHAPES.iter().enumerate() {
            let s = shape(b, h, hkv, tq, tk, d, true);
            check_forward_against_f64(&kernel, &s, &masking.mask(&s).unwrap(), n as u64, true);
        }
    }
}

/// Finite differences in f64 through the tiled kernel, tiles smaller than the shape.
#[test]
fn flash_gradients_match_finite_differences() {
    for masking in [Masking::Plain, Masking::Window(2), Masking::Blocks { block: 2, local: 1, global: 1, stride: 2 }] {
        let kernel = Kernel { masking, algorithm: Algorithm::Flash(Some(Tiles { q: 2, k: 3 })) };
        for (s, seed) in [
            (shape(1, 4, 2, 7, 7, 3, true), 1),
            (shape(2, 2, 1, 3, 6, 4, true), 2),
            (shape(1, 2, 2, 5, 5, 2, false), 3),
        ] {
            testing::finite_differences(&kernel, &s, &masking.mask(&s).unwrap(), seed)
                .unwrap_or_else(|e| panic!("{masking:?}: {e}"));
        }
    }
}

/// The maskings that take segment ids (packed documents).
fn segmented_maskings() -> Vec<Masking> {
    maskings().into_iter().filter(|m| m.takes_segments()).collect()
}

/// With segment ids, dense attention matches the f64 definition (which checks the ids'
/// equality itself) and the tiled kernel matches dense, logsumexp included, for every
/// interval masking, tile size and thread count; gradients match finite differences.
#[test]
fn segments_match_the_definition_in_both_algorithms() {
    for masking in segmented_maskings() {
        for (n, &(b, h, hkv, tq, tk, d)) in SHAPES.iter().enumerate() {
            for causal in [true, false] {
                let s = shape(b, h, hkv, tq, tk, d, causal);
                let ids = testing::segments(&s, 100 + n as u64);
                let Ok(mask) = masking.mask(&s) else { continue };
                let mask = mask.with_segments(&ids).unwrap();
                if tq <= 40 {
                    check_forward_against_f64(&Kernel::dense(masking), &s, &mask, n as u64, false);
                }
                for tiles in TILES {
                    let flash = Kernel { masking, algorithm: Algorithm::Flash(Some(tiles)) };
                    check_forward_against_f64(&flash, &s, &mask, n as u64, true);
                    for threads in [1, 3] {
                        testing::against_dense(&flash, &s, &mask, threads, n as u64)
                            .unwrap_or_else(|e| panic!("{masking:?} {tiles:?} segments {ids:?}: {e}"));
                    }
                }
            }
        }
        for (s, seed) in [(shape(1, 4, 2, 7, 7, 3, true), 1), (shape(2, 2, 1, 6, 6, 2, false), 2)] {
            let ids = testing::segments(&s, seed);
            let mask = masking.mask(&s).unwrap().with_segments(&ids).unwrap();
            for kernel in
                [Kernel::dense(masking), Kernel { masking, algorithm: Algorithm::Flash(Some(Tiles { q: 2, k: 3 })) }]
            {
                testing::finite_differences(&kernel, &s, &mask, seed)
                    .unwrap_or_else(|e| panic!("{kernel:?} segments {ids:?}: {e}"));
            }
        }
    }
}

/// Three documents packed into one causal sequence give what each gives alone: the
/// outputs and all three gradients of each document's rows equal those of a run over the
/// document by itself (so nothing leaks across a boundary, in either direction).
#[test]
fn packed_documents_equal_separate_runs() {
    let lens = [5usize, 9, 1, 3];
    let (h, hkv, d) = (4u32, 2u32, 8u32);
    let total = lens.iter().sum::<usize>() as u32;
    let packed = shape(1, h, hkv, total, total, d, true);
    let ids: Vec<u32> = lens.iter().enumerate().flat_map(|(i, &n)| std::iter::repeat_n(i as u32 * 3, n)).collect();
    let mut rng = Rng(9);
    let (q, k, v, r) =
        (rng.vec(packed.q_numel()), rng.vec(packed.kv_numel()), rng.vec(packed.kv_numel()), rng.vec(packed.q_numel()));
    // Rows t0..t0 + n of every head of a (1, heads, T, D) buffer.
    let rows = |x: &[f32], heads: u32, t0: usize, n: usize| -> Vec<f32> {
        let d = d as usize;
        x.chunks_exact(total as usize * d)
            .take(heads as usize)
            .flat_map(|head| head[t0 * d..(t0 + n) * d].to_vec())
            .collect()
    };
    for kernel in [
        Kernel::dense(Masking::Plain),
        Kernel { masking: Masking::Plain, algorithm: Algorithm::Flash(Some(Tiles { q: 4, k: 3 })) },
    ] {
        let (out, _, grads) = testing::run_segmented(&kernel, &packed, &ids, (&q, &k, &v, &r), 2).unwrap();
        let mut t0 = 0;
        for &n in &lens {
            let alone = shape(1, h, hkv, n as u32, n as u32, d, true);
            let (qa, ka, va, ra) = (rows(&q, h, t0, n), rows(&k, hkv, t0, n), rows(&v, hkv, t0, n), rows(&r, h, t0, n));
            let (out_a, _, grads_a) = testing::run(&kernel, &alone, (&qa, &ka, &va, &ra), 2).unwrap();
            let close = |what: &str, got: &[f32], want: &[f32]| {
                for (i, (g, w)) in got.iter().zip(want).enumerate() {
                    assert!(
                        (g - w).abs() <= 1e-6 + 1e-5 * w.abs(),
                        "{kernel:?} document at {t0}: {what}[{i}] = {g}, alone {w}"
                    );
                }
            };
            close("out", &rows(&out, h, t0, n), &out_a);
            for (which, heads) in [(0, h), (1, hkv), (2, hkv)] {
                close(["dq", "dk", "dv"][which], &rows(&grads[which], heads, t0, n), &grads_a[which]);
            }
            t0 += n;
        }
    }
}

/// Block patterns are fixed positions, not documents: they refuse segment ids.
#[test]
fn block_patterns_refuse_segments() {
    let kernel = Kernel::flash(Masking::Blocks { block: 4, local: 1, global: 0, stride: 0 });
    assert!(!kernel.supports_segments());
    assert!(Kernel::flash(Masking::Window(8)).supports_segments() && Kernel::dense(Masking::Plain).supports_segments());
    let s = shape(1, 1, 1, 8, 8, 4, true);
    let zeros = vec![0.0; 32];
    let err = testing::run_segmented(&kernel, &s, &[0, 0, 0, 1, 1, 1, 1, 1], (&zeros, &zeros, &zeros, &zeros), 1)
        .unwrap_err();
    assert_eq!(
        err,
        "forward: block-sparse attention does not take segment ids (packed documents): its blocks are fixed \
         positions, not documents"
    );
    let err = testing::run_segmented(
        &Kernel::dense(Masking::Plain),
        &s,
        &[0, 0, 1, 0, 1, 1, 1, 1],
        (&zeros, &zeros, &zeros, &zeros),
        1,
    )
    .unwrap_err();
    assert!(err.contains("segment ids of sequence 0 decrease at position 3"), "{err}");
}

/// A window at least as long as the sequence is causal attention, bit for bit.
#[test]
fn a_window_covering_the_sequence_is_causal_attention() {
    let s = shape(1, 4, 2, 100, 100, 16, true);
    let mut rng = Rng(5);
    let inputs = (rng.vec(s.q_numel()), rng.vec(s.kv_numel()), rng.vec(s.kv_numel()), rng.vec(s.q_numel()));
    let inputs = (&inputs.0[..], &inputs.1[..], &inputs.2[..], &inputs.3[..]);
    let causal = testing::run(&Kernel::flash(Masking::Plain), &s, inputs, 2).unwrap();
    for window in [100, 101, 4096] {
        let windowed = testing::run(&Kernel::flash(Masking::Window(window)), &s, inputs, 2).unwrap();
        assert_eq!(windowed, causal, "window {window}");
    }
}

/// With at least as many (batch, kv head) groups as threads, results do not depend on the
/// thread count.
#[test]
fn thread_count_does_not_change_bits() {
    let s = shape(2, 4, 2, 45, 45, 16, true);
    let mut rng = Rng(9);
    let inputs = (rng.vec(s.q_numel()), rng.vec(s.kv_numel()), rng.vec(s.kv_numel()), rng.vec(s.q_numel()));
    let inputs = (&inputs.0[..], &inputs.1[..], &inputs.2[..], &inputs.3[..]);
    for kernel in [Kernel::flash(Masking::Plain), Kernel::dense(Masking::Plain)] {
        let one = testing::run(&kernel, &s, inputs, 1).unwrap();
        for threads in [2, 4] {
            assert_eq!(testing::run(&kernel, &s, inputs, threads).unwrap(), one, "{kernel:?} threads {threads}");
        }
    }
}

#[test]
fn saved_lengths() {
    let s = shape(2, 8, 2, 5, 7, 16, true);
    assert_eq!(Kernel::dense(Masking::Plain).saved_len(&s).unwrap(), 2 * 8 * 5 * 7);
    assert_eq!(Kernel::flash(Masking::Plain).saved_len(&s).unwrap(), 2 * 8 * 5);
    assert_eq!(Kernel::flash(Masking::Window(3)).saved_len(&s).unwrap(), 2 * 8 * 5);
    // Refused: q_len > kv_len under a mask, a zero window.
    let err = Kernel::flash(Masking::Window(3)).saved_len(&shape(1, 1, 1, 4, 2, 8, false)).unwrap_err();
    assert!(err.message.contains("q_len (4) <= kv_len (2)"), "{err}");
    let err = Kernel::flash(Masking::Window(0)).saved_len(&s).unwrap_err();
    assert_eq!(err.message.as_str(), "window must be at least 1");
}

#[test]
fn wrong_buffers_are_named() {
    let s = shape(1, 2, 1, 3, 3, 4, true);
    let k = Kernel::flash(Masking::Plain);
    let ctx = KernelContext::default();
    let (q, kv) = (vec![0.0; s.q_numel()], vec![0.0; s.kv_numel()]);
    let (mut out, mut saved) = (vec![0.0; s.q_numel()], vec![0.0; 6]);
    let mut ws = vec![0.0; k.workspace_len(&s, Pass::Backward, &ctx).unwrap() as usize];
    let err = k.forward(&s, &q, &kv, &kv, &[], &mut out, &mut saved[1..], &mut ws, &ctx).unwrap_err();
    assert_eq!(err.message.as_str(), "saved has 5 elements, expected 6");
    let (mut dq, mut dk, mut dv) = (vec![0.0; s.q_numel()], vec![0.0; s.kv_numel()], vec![0.0; s.kv_numel() + 1]);
    let err =
        k.backward(&s, &q, &kv, &kv, &[], &out, &q, &saved, &mut dq, &mut dk, &mut dv, &mut ws, &ctx).unwrap_err();
    assert_eq!(err.message.as_str(), "dv has 13 elements, expected 12");
}

/// Each kernel declares the scratch it takes, per thread it uses (at most one per task), and
/// refuses a call handed another length before computing anything.
#[test]
fn workspaces_are_declared_per_thread_and_checked() {
    let ctx = |threads| KernelContext { threads, ..Default::default() };
    let s = shape(2, 4, 2, 45, 45, 16, true); // B·Hkv = 4 groups
    let dense = Kernel::dense(Masking::Plain);
    assert_eq!(dense.workspace_len(&s, Pass::Forward, &ctx(2)).unwrap(), 0);
    // Backward: a (min(64, Tq), Tk) dP block per thread, one thread per group at most.
    assert_eq!(dense.workspace_len(&s, Pass::Backward, &ctx(2)).unwrap(), 2 * 45 * 45);
    assert_eq!(dense.workspace_len(&s, Pass::Backward, &ctx(16)).unwrap(), 4 * 45 * 45);

    let flash = Kernel { masking: Masking::Plain, algorithm: Algorithm::Flash(Some(Tiles { q: 16, k: 32 })) };
    // Forward: per thread a 16 × 32 score tile, a (D = 16) × 32 key tile, 16 maxima and sums.
    assert_eq!(flash.workspace_len(&s, Pass::Forward, &ctx(2)).unwrap(), 2 * (16 * 32 + 16 * 32 + 2 * 16));
    // Backward, 4 groups for 2 threads: one run per group, no dQ copy; per thread P and dS
    // tiles, Kᵀ and Vᵀ tiles, Δ for the group's 2 heads × 45 rows.
    let per = 2 * 16 * 32 + 2 * 16 * 32 + 2 * 45;
    assert_eq!(flash.workspace_len(&s, Pass::Backward, &ctx(2)).unwrap(), 2 * per);
    // One group for 4 threads: its 2 key tiles in 2 runs, the second writing a dQ copy (2, 45, 16).
    let one = shape(1, 2, 1, 45, 45, 16, true);
    assert_eq!(flash.workspace_len(&one, Pass::Backward, &ctx(4)).unwrap(), 2 * 45 * 16 + 2 * per);

    let mut rng = Rng(4);
    let (q, k, v) = (rng.vec(s.q_numel()), rng.vec(s.kv_numel()), rng.vec(s.kv_numel()));
    let (mut out, mut saved) = (vec![0.0; s.q_numel()], vec![0.0; flash.saved_len(&s).unwrap() as usize]);
    let want = flash.workspace_len(&s, Pass::Forward, &ctx(2)).unwrap();
    let err = flash.forward(&s, &q, &k, &v, &[], &mut out, &mut saved, &mut [0.0; 5], &ctx(2)).unwrap_err();
    assert_eq!(err.message.to_string(), format!("workspace has 5 elements, expected {want}"));
    let err = dense.forward(&s, &q, &k, &v, &[], &mut out, &mut saved, &mut [0.0; 5], &ctx(2)).unwrap_err();
    assert_eq!(err.message.as_str(), "workspace has 5 elements, expected 0");
    // The multi-run backward (dQ copies summed) through the declared workspace, NaN-filled.
    let inputs = (rng.vec(one.q_numel()), rng.vec(one.kv_numel()), rng.vec(one.kv_numel()), rng.vec(one.q_numel()));
    let inputs = (&inputs.0[..], &inputs.1[..], &inputs.2[..], &inputs.3[..]);
    let (a, _, ga) = testing::run(&flash, &one, inputs, 4).unwrap();
    let (b, _, gb) = testing::run(&Kernel::dense(Masking::Plain), &one, inputs, 1).unwrap();
    for (x, y) in a.iter().chain(ga.iter().flatten()).zip(b.iter().chain(gb.iter().flatten())) {
        assert!((x - y).abs() < 1e-5, "{x} vs {y}");
    }
}
