//! The fused ops against candle's composed forms (values and autograd gradients in f32),
//! against central differences in f64, and for independence from the thread count.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};

use super::*;
use crate::model::{RopeSpec, ops};

/// Deterministic values in about [-2, 2].
fn data(n: usize, salt: u64) -> Vec<f64> {
    let mut s = salt.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 11) as f64 / (1u64 << 53) as f64 * 4.0 - 2.0
        })
        .collect()
}

fn tensor(n_shape: &[usize], salt: u64, dtype: DType) -> Tensor {
    let n = n_shape.iter().product();
    Tensor::from_vec(data(n, salt), n_shape, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
}

fn flat(t: &Tensor) -> Vec<f64> {
    t.flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1().unwrap()
}

fn assert_close(what: &str, got: &[f64], want: &[f64], atol: f64, rtol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= atol + rtol * w.abs(), "{what}[{i}]: {g} vs {w}");
    }
}

/// Runs `f` on fresh `Var`s made from `inputs`, back-propagates `(f(..) · probe).sum()`,
/// and returns the output and each input's gradient.
fn value_and_grads(inputs: &[Tensor], probe: &Tensor, f: impl Fn(&[Tensor]) -> Tensor) -> (Vec<f64>, Vec<Vec<f64>>) {
    let vars: Vec<Var> = inputs.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let out = f(&ts);
    let loss = (out.to_dtype(probe.dtype()).unwrap() * probe).unwrap().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    let g = vars.iter().map(|v| flat(grads.get(v.as_tensor()).expect("input has a gradient"))).collect();
    (flat(&out), g)
}

/// Compares the fused `f` with the composed `reference` in f32 (values and gradients).
fn against_reference(
    shapes: &[&[usize]],
    out_shape: &[usize],
    f: impl Fn(&[Tensor]) -> Tensor,
    reference: impl Fn(&[Tensor]) -> Tensor,
) {
    let inputs: Vec<Tensor> = shapes.iter().enumerate().map(|(i, s)| tensor(s, i as u64 + 1, DType::F32)).collect();
    let probe = tensor(out_shape, 99, DType::F32);
    let (v1, g1) = value_and_grads(&inputs, &probe, &f);
    let (v2, g2) = value_and_grads(&inputs, &probe, &reference);
    assert_close("value", &v1, &v2, 1e-5, 1e-5);
    for (i, (a, b)) in g1.iter().zip(&g2).enumerate() {
        assert_close(&format!("gradient of input {i}"), a, b, 1e-4, 1e-3);
    }
}

/// f64 gradients of `(f(..) · probe).sum()` against central differences on every element.
fn against_finite_differences(shapes: &[&[usize]], out_shape: &[usize], f: impl Fn(&[Tensor]) -> Tensor) {
    let inputs: Vec<Tensor> = shapes.iter().enumerate().map(|(i, s)| tensor(s, i as u64 + 7, DType::F64)).collect();
    let probe = tensor(out_shape, 98, DType::F64);
    let (_, grads) = value_and_grads(&inputs, &probe, &f);
    let loss = |xs: &[Tensor]| -> f64 { (f(xs) * &probe).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap() };
    let h = 1e-5;
    for (i, input) in inputs.iter().enumerate() {
        let base = flat(input);
        for j in 0..base.len() {
            let at = |delta: f64| {
                let mut v = base.clone();
                v[j] += delta;
                let mut xs = inputs.clone();
                xs[i] = Tensor::from_vec(v, input.dims(), &Device::Cpu).unwrap();
                loss(&xs)
            };
            let fd = (at(h) - at(-h)) / (2.0 * h);
            let got = grads[i][j];
            assert!((got - fd).abs() <= 1e-7 + 1e-6 * fd.abs(), "input {i}[{j}]: autograd {got}, differences {fd}");
        }
    }
}

#[test]
fn linear_matches_candle_matmul() {
    // Odd sizes; more threads than rows in the last case.
    for (n, k, out, threads) in [(7, 5, 3, 2), (64, 33, 17, 3), (2, 8, 4, 4)] {
        against_reference(
            &[&[n, k], &[out, k]],
            &[n, out],
            |x| linear(&x[0], &x[1], threads).unwrap(),
            |x| x[0].matmul(&x[1].t().unwrap()).unwrap(),
        );
    }
}

#[test]
fn linear_gradients_match_finite_differences() {
    against_finite_differences(&[&[4, 3], &[5, 3]], &[4, 5], |x| linear(&x[0], &x[1], 2).unwrap());
}

#[test]
fn linear_in_half_types_and_bad_shapes() {
    let x = tensor(&[4, 8], 1, DType::F32);
    let w = tensor(&[3, 8], 2, DType::F32);
    let want = flat(&x.matmul(&w.t().unwrap()).unwrap());
    for dt in [DType::F16, DType::BF16] {
        let y = linear(&x.to_dtype(dt).unwrap(), &w.to_dtype(dt).unwrap(), 2).unwrap();
        assert_eq!(y.dtype(), dt);
        assert_close(&format!("{dt:?} linear"), &flat(&y), &want, 0.1, 2e-2);
    }
    let err = linear(&x, &tensor(&[3, 7], 2, DType::F32), 1).unwrap_err().to_string();
    assert!(err.contains("input rows of 8 for a weight of shape [3, 7]"), "{err}");
}

#[test]
fn rms_norm_matches_composed_form() {
    for d in [8, 13, 64] {
        against_reference(
            &[&[3, 5, d], &[d]],
            &[3, 5, d],
            |x| rms_norm(&x[0], &x[1], 1e-5).unwrap(),
            |x| ops::rms_norm(&x[0], &x[1], 1e-5).unwrap(),
        );
    }
}

#[test]
fn rms_norm_gradients_match_finite_differences() {
    against_finite_differences(&[&[2, 3, 6], &[6]], &[2, 3, 6], |x| rms_norm(&x[0], &x[1], 1e-5).unwrap());
}

/// (B·T, C·D) rows → (B, C, T, D) heads, composed: reshape, transpose, copy, rotate.
fn composed_split(p: &Tensor, b: usize, t: usize, c: usize, rope: Option<&ops::Rope>) -> Tensor {
    let d = p.dims()[1] / c;
    let heads = p.reshape((b, t, c, d)).unwrap().transpose(1, 2).unwrap().contiguous().unwrap();
    match rope {
        Some(r) => r.apply(&heads).unwrap(),
        None => heads,
    }
}

#[test]
fn split_heads_with_rope_matches_composed_form() {
    // T below the tables' length, odd head count, and D = 2 (one pair per head).
    for (b, t, c, d) in [(2, 5, 3, 8), (1, 7, 2, 2), (3, 4, 1, 16)] {
        let tables = RopeTables::new(9, d, &RopeSpec::plain(10000.0)).unwrap();
        let rope = ops::Rope::new(9, d, 10000.0, &Device::Cpu).unwrap();
        against_reference(
            &[&[b * t, c * d]],
            &[b, c, t, d],
            |x| split_heads(&x[0], b, t, c, Some(&tables), None).unwrap(),
            |x| composed_split(&x[0], b, t, c, Some(&rope)),
        );
        against_reference(
            &[&[b * t, c * d]],
            &[b, c, t, d],
            |x| split_heads(&x[0], b, t, c, None, None).unwrap(),
            |x| composed_split(&x[0], b, t, c, None),
        );
    }
}

#[test]
fn merge_heads_matches_composed_form() {
    let (b, c, t, d) = (2, 3, 5, 4);
    against_reference(
        &[&[b, c, t, d]],
        &[b * t, c * d],
        |x| merge_heads(&x[0]).unwrap(),
        |x| x[0].transpose(1, 2).unwrap().reshape((b * t, c * d)).unwrap(),
    );
}

#[test]
fn head_ops_gradients_match_finite_differences() {
    let tables = RopeTables::new(6, 4, &RopeSpec::plain(100.0)).unwrap();
    against_finite_differences(&[&[2 * 3, 2 * 4]], &[2, 2, 3, 4], |x| {
        split_heads(&x[0], 2, 3, 2, Some(&tables), None).unwrap()
    });
    against_finite_differences(&[&[2, 2, 3, 4]], &[6, 8], |x| merge_heads(&x[0]).unwrap());
}

/// With positions (packed documents), token (b, t) is rotated by the angles of its own
/// position: the same values as the plain split gives a token sitting at that index.
#[test]
fn split_heads_rotates_each_token_by_its_position() {
    let (b, t, c, d) = (2, 6, 3, 8);
    let tables = RopeTables::new(t, d, &RopeSpec::plain(500.0)).unwrap();
    let positions: Arc<[u32]> = vec![0, 1, 2, 0, 1, 0, 0, 1, 2, 3, 4, 5].into();
    let p = tensor(&[b * t, c * d], 3, DType::F32);
    let got = split_heads(&p, b, t, c, Some(&tables), Some(&positions)).unwrap().to_dtype(DType::F64).unwrap(); // (B, C, T, D)
    let rows = p.to_dtype(DType::F64).unwrap().to_vec2::<f64>().unwrap();
    for bb in 0..b {
        for tt in 0..t {
            let pos = positions[bb * t + tt] as usize;
            // The token alone at index `pos` of a one-row batch, zeros before it.
            let mut alone = vec![0.0f64; (pos + 1) * c * d];
            alone[pos * c * d..].copy_from_slice(&rows[bb * t + tt]);
            let alone = Tensor::from_vec(alone, (pos + 1, c * d), &Device::Cpu).unwrap();
            let want = split_heads(&alone, 1, pos + 1, c, Some(&tables), None).unwrap();
            for cc in 0..c {
                let w = want.get(0).unwrap().get(cc).unwrap().get(pos).unwrap().to_vec1::<f64>().unwrap();
                let g = got.get(bb).unwrap().get(cc).unwrap().get(tt).unwrap().to_vec1::<f64>().unwrap();
                for (x, y) in g.iter().zip(&w) {
                    assert!((x - y).abs() < 1e-6, "({bb}, {cc}, {tt}) at position {pos}: {g:?} vs {w:?}");
                }
            }
        }
    }
    // A position past the tables is refused (it would read past them).
    let bad: Arc<[u32]> = vec![0, 1, 2, 3, 4, 6, 0, 0, 0, 0, 0, 0].into();
    let err = split_heads(&p, b, t, c, Some(&tables), Some(&bad)).unwrap_err().to_string();
    assert!(
        err.contains("split_heads: position 6 of token (0, 5) is outside the rotary tables (6 positions)"),
        "{err}"
    );
    // One token at a later position (generation after cached ones) reads that position's row.
    let longer = RopeTables::new(9, d, &RopeSpec::plain(500.0)).unwrap();
    let one = tensor(&[1, c * d], 5, DType::F32);
    let at_seven = split_heads(&one, 1, 1, c, Some(&longer), Some(&vec![7u32].into())).unwrap();
    let mut eight = tensor(&[8, c * d], 5, DType::F32).to_vec2::<f32>().unwrap();
    eight[7] = one.to_vec2::<f32>().unwrap()[0].clone();
    let eight = Tensor::new(eight, &Device::Cpu).unwrap();
    let plain = split_heads(&eight, 1, 8, c, Some(&longer), None).unwrap();
    let want = plain.narrow(2, 7, 1).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(at_seven.flatten_all().unwrap().to_vec1::<f32>().unwrap(), want);
    against_finite_differences(&[&[b * t, c * d]], &[b, c, t, d], |x| {
        split_heads(&x[0], b, t, c, Some(&tables), Some(&positions)).unwrap()
    });
}

#[test]
fn split_heads_refuses_sequences_longer_than_the_tables() {
    let tables = RopeTables::new(4, 4, &RopeSpec::plain(100.0)).unwrap();
    let p = tensor(&[5, 8], 1, DType::F32);
    let err = split_heads(&p, 1, 5, 2, Some(&tables), None).unwrap_err().to_string();
    assert!(err.contains("longer than the rotary tables (4)"), "{err}");
    assert!(RopeTables::new(4, 5, &RopeSpec::plain(100.0)).unwrap_err().to_string().contains("even head size"));
}

#[test]
fn swiglu_matches_composed_form() {
    against_reference(
        &[&[7, 33], &[7, 33]],
        &[7, 33],
        |x| swiglu_gate(&x[0], &x[1]).unwrap(),
        |x| (x[0].silu().unwrap() * &x[1]).unwrap(),
    );
}

#[test]
fn swiglu_gradients_match_finite_differences() {
    against_finite_differences(&[&[3, 5], &[3, 5]], &[3, 5], |x| swiglu_gate(&x[0], &x[1]).unwrap());
}

/// The op `f` on half inputs against the same op on the f32 values of those (rounded)
/// inputs: the output and each input's gradient (with an f32 probe rounded alike) agree
/// within the half type's rounding, and come back in the half type.
fn half_against_f32(shapes: &[&[usize]], out_shape: &[usize], f: impl Fn(&[Tensor]) -> Tensor) {
    for (dt, tol) in [(DType::BF16, 2e-2), (DType::F16, 4e-3)] {
        let half: Vec<Tensor> = shapes.iter().enumerate().map(|(i, s)| tensor(s, i as u64 + 21, dt)).collect();
        let wide: Vec<Tensor> = half.iter().map(|t| t.to_dtype(DType::F32).unwrap()).collect();
        let probe = tensor(out_shape, 97, dt);
        // Run on the half inputs: output and gradients must stay in the stored type.
        let vars: Vec<Var> = half.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let out = f(&ts);
        assert_eq!(out.dtype(), dt, "output of {dt:?} inputs");
        let grads = (&out * &probe).unwrap().sum_all().unwrap().backward().unwrap();
        let (v_half, g_half): (Vec<f64>, Vec<Vec<f64>>) = (
            flat(&out),
            vars.iter()
                .map(|v| {
                    let g = grads.get(v.as_tensor()).expect("input has a gradient");
                    assert_eq!(g.dtype(), dt, "gradient of a {dt:?} input");
                    flat(g)
                })
                .collect(),
        );
        let (v32, g32) = value_and_grads(&wide, &probe.to_dtype(DType::F32).unwrap(), &f);
        // The f32 op on the same inputs differs only by the half op's roundings: one on store
        // of each value and gradient, plus, in attention's backward, the rounded output it
        // reads. bf16 keeps 8 significant bits (a rounding is off by up to 2⁻⁸ ≈ 0.4%),
        // f16 11 (2⁻¹¹ ≈ 0.05%); the tolerances allow five to eight such roundings, relative
        // to the largest magnitude, since an element that is a sum of cancelling terms can
        // carry its terms' rounding with no bound relative to itself.
        let close = |what: &str, got: &[f64], want: &[f64]| {
            let scale = want.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-3);
            assert_close(&format!("{dt:?} {what}"), got, want, tol * scale, tol);
        };
        close("value", &v_half, &v32);
        for (i, (a, b)) in g_half.iter().zip(&g32).enumerate() {
            close(&format!("gradient of input {i}"), a, b);
        }
    }
}

#[test]
fn half_linear_matches_f32_linear() {
    // More rows than one step of the half path (1024 rows), a last step of 1 row, odd widths.
    for (n, k, out) in [(7, 5, 3), (1025, 33, 17), (300, 96, 40)] {
        half_against_f32(&[&[n, k], &[out, k]], &[n, out], |x| linear(&x[0], &x[1], 3).unwrap());
    }
}

#[test]
fn half_rms_norm_matches_f32_rms_norm() {
    for d in [8, 13, 64] {
        half_against_f32(&[&[3, 70, d], &[d]], &[3, 70, d], |x| rms_norm(&x[0], &x[1], 1e-5).unwrap());
    }
}

#[test]
fn half_head_ops_match_f32_head_ops() {
    let (b, t, c, d) = (2, 5, 3, 8);
    let tables = RopeTables::new(9, d, &RopeSpec::plain(10000.0)).unwrap();
    half_against_f32(&[&[b * t, c * d]], &[b, c, t, d], |x| split_heads(&x[0], b, t, c, Some(&tables), None).unwrap());
    half_against_f32(&[&[b * t, c * d]], &[b, c, t, d], |x| split_heads(&x[0], b, t, c, None, None).unwrap());
    half_against_f32(&[&[b, c, t, d]], &[b * t, c * d], |x| merge_heads(&x[0]).unwrap());
}

#[test]
fn half_swiglu_matches_f32_swiglu() {
    half_against_f32(&[&[7, 33], &[7, 33]], &[7, 33], |x| swiglu_gate(&x[0], &x[1]).unwrap());
}

#[test]
fn half_attention_matches_f32_attention() {
    let kernel = ava_plugins::Registry::builtins().attention("standard", "{}").unwrap();
    // GQA: 4 query heads over 2 key/value heads.
    half_against_f32(&[&[2, 4, 6, 8], &[2, 2, 6, 8], &[2, 2, 6, 8]], &[2, 4, 6, 8], |x| {
        crate::model::attention(&kernel, "standard", &x[0], &x[1], &x[2], None, 2).unwrap()
    });
}

#[test]
fn mixed_types_are_refused() {
    let x = tensor(&[4, 8], 3, DType::BF16);
    let w = tensor(&[8], 4, DType::F32);
    let err = rms_norm(&x, &w, 1e-5).unwrap_err().to_string();
    assert!(err.contains("BF16") && err.contains("F32"), "{err}");
    let err = linear(&x, &tensor(&[3, 8], 4, DType::F32), 1).unwrap_err().to_string();
    assert!(err.contains("input is BF16 but the weight is F32"), "{err}");
}

#[test]
fn thread_count_does_not_change_bits() {
    // Enough rows for several tasks (ROWS_PER_TASK and the element chunks).
    let x = tensor(&[300, 96], 5, DType::F32);
    let w = tensor(&[96], 6, DType::F32);
    let probe = tensor(&[300, 96], 7, DType::F32);
    let tables = RopeTables::new(100, 16, &RopeSpec::plain(10000.0)).unwrap();
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| {
            let mut out = Vec::new();
            let (v, g) = value_and_grads(&[x.clone(), w.clone()], &probe, |t| rms_norm(&t[0], &t[1], 1e-5).unwrap());
            out.push(v);
            out.extend(g);
            let (v, g) = value_and_grads(&[x.clone(), x.clone()], &probe, |t| swiglu_gate(&t[0], &t[1]).unwrap());
            out.push(v);
            out.extend(g);
            let (v, g) = value_and_grads(std::slice::from_ref(&x), &probe.reshape((3, 6, 100, 16)).unwrap(), |t| {
                split_heads(&t[0], 3, 100, 6, Some(&tables), None).unwrap()
            });
            out.push(v);
            out.extend(g);
            out
        })
    };
    let one = run(1);
    assert_eq!(one, run(3));
    // The linear layer splits its rows by its own thread count.
    let wl = tensor(&[40, 96], 8, DType::F32);
    let lin = |threads: usize| {
        let (v, g) = value_and_grads(&[x.clone(), wl.clone()], &tensor(&[300, 40], 9, DType::F32), |t| {
            linear(&t[0], &t[1], threads).unwrap()
        });
        (v, g)
    };
    assert_eq!(lin(1), lin(3));
    // Half types: the linear op's steps are fixed and its threads split their rows (1025
    // rows: more than one step, a last step of one row), and the element-wise ops' chunks
    // are fixed too.
    for dt in [DType::BF16, DType::F16] {
        let xh = tensor(&[1025, 96], 10, dt);
        let wh = tensor(&[40, 96], 11, dt);
        let probe = tensor(&[1025, 40], 12, dt);
        let lin = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let (v, mut g) =
                    value_and_grads(&[xh.clone(), wh.clone()], &probe, |t| linear(&t[0], &t[1], threads).unwrap());
                let normed = value_and_grads(&[xh.clone(), tensor(&[96], 13, dt)], &xh, |t| {
                    rms_norm(&t[0], &t[1], 1e-5).unwrap()
                });
                g.push(normed.0);
                g.extend(normed.1);
                (v, g)
            })
        };
        assert_eq!(lin(1), lin(3), "{dt:?}");
    }
}

/// `cast` and `add` give what candle's `to_dtype` and `+` give, bit for bit (both round to
/// nearest with ties to even), values and gradients, in both directions of the cast.
#[test]
fn cast_and_add_match_candle_bit_for_bit() {
    let bits = |t: &Tensor| flat(t).iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    for dt in [DType::BF16, DType::F16] {
        // f32 → half (the weights' cast), gradients back to f32.
        let x = tensor(&[37, 29], 31, DType::F32);
        let probe = tensor(&[37, 29], 32, dt);
        let (v, g) = value_and_grads(std::slice::from_ref(&x), &probe, |t| cast(&t[0], dt).unwrap());
        let (v_ref, g_ref) = value_and_grads(std::slice::from_ref(&x), &probe, |t| t[0].to_dtype(dt).unwrap());
        assert_eq!((v, g), (v_ref, g_ref), "{dt:?}: f32 → half");
        assert_eq!(cast(&x, dt).unwrap().dtype(), dt);
        // half → f32.
        let h = tensor(&[37, 29], 33, dt);
        let probe = tensor(&[37, 29], 34, DType::F32);
        let (v, g) = value_and_grads(std::slice::from_ref(&h), &probe, |t| cast(&t[0], DType::F32).unwrap());
        let (v_ref, g_ref) = value_and_grads(std::slice::from_ref(&h), &probe, |t| t[0].to_dtype(DType::F32).unwrap());
        assert_eq!((v, g), (v_ref, g_ref), "{dt:?}: half → f32");
        // The residual addition, more elements than one task.
        let (a, b) = (tensor(&[3, 100, 97], 35, dt), tensor(&[3, 100, 97], 36, dt));
        let probe = tensor(&[3, 100, 97], 37, dt);
        let sum = add(&a, &b).unwrap();
        assert_eq!(bits(&sum), bits(&(&a + &b).unwrap()), "{dt:?}: add");
        let (v, g) = value_and_grads(&[a.clone(), b.clone()], &probe, |t| add(&t[0], &t[1]).unwrap());
        let (v_ref, g_ref) = value_and_grads(&[a.clone(), b.clone()], &probe, |t| (&t[0] + &t[1]).unwrap());
        assert_eq!((v, g), (v_ref, g_ref), "{dt:?}: add gradients");
    }
    let err = add(&tensor(&[2, 3], 1, DType::BF16), &tensor(&[3, 2], 2, DType::BF16)).unwrap_err().to_string();
    assert!(err.contains("shapes [2, 3] and [3, 2] differ"), "{err}");
}

/// f32 tensors of at least four chunks are added in parallel, by `add` (the residual stream)
/// and by the patched candle's gradient sums (`GradStore::accumulate`, a tensor used twice):
/// both the bits of one-thread candle, forward and backward.
#[test]
fn large_f32_additions_match_candle_bit_for_bit() {
    let bits =
        |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    let shape = [3, 211, 149]; // 94317 elements: four chunks of 16384 and a remainder
    let (a, b, probe) =
        (tensor(&shape, 41, DType::F32), tensor(&shape, 42, DType::F32), tensor(&shape, 43, DType::F32));
    assert_eq!(bits(&add(&a, &b).unwrap()), bits(&(&a + &b).unwrap()), "add");
    // a reaches the sum twice, so its gradient is probe + probe · b, summed in the store.
    let (va, vb) = (Var::from_tensor(&a).unwrap(), Var::from_tensor(&b).unwrap());
    let out = add(va.as_tensor(), &(va.as_tensor() * vb.as_tensor()).unwrap()).unwrap();
    let grads = (out * &probe).unwrap().sum_all().unwrap().backward().unwrap();
    let want = (&probe + (&probe * &b).unwrap()).unwrap(); // one thread, candle's own addition
    assert_eq!(bits(grads.get(va.as_tensor()).unwrap()), bits(&want), "a's gradient");
    assert_eq!(bits(grads.get(vb.as_tensor()).unwrap()), bits(&(&probe * &a).unwrap()), "b's gradient");
}

/// The CPU's sum of squares (the gradient norm) reads each tensor without a squared copy:
/// within an f32 rounding of the f64 sum of the same values for every float type, past a
/// chunk and with a remainder, the same bits on one thread and on three, and on a transposed
/// (non-contiguous) view.
#[test]
fn sum_of_squares_on_the_cpu_is_the_f64_sum_rounded_whatever_the_threads() {
    for n in [0usize, 1, 7, 8, 1000, 3 * SUMSQ_CHUNK + 5] {
        for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
            let t = tensor(&[n], 7 + n as u64, dtype);
            let want: f64 = flat(&t).iter().map(|x| x * x).sum();
            let bits: Vec<u32> = [1, 3]
                .iter()
                .map(|&threads| {
                    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                    pool.install(|| sum_of_squares_cpu(&t).unwrap()).to_bits()
                })
                .collect();
            assert_eq!(bits[0], bits[1], "n {n} {dtype:?}: one thread and three differ");
            let got = f64::from(f32::from_bits(bits[0]));
            assert!((got - want).abs() <= want * 1e-7 + 1e-30, "n {n} {dtype:?}: {got} vs {want}");
        }
    }
    let m = tensor(&[37, 53], 3, DType::F32);
    let want: f64 = flat(&m).iter().map(|x| x * x).sum();
    let got = f64::from(sum_of_squares_cpu(&m.t().unwrap()).unwrap());
    assert!((got - want).abs() <= want * 1e-7, "transposed: {got} vs {want}");
    assert_eq!(sums_of_squares(&[&m, &m.t().unwrap()]).unwrap().len(), 2);
}
