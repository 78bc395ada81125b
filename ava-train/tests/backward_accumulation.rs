//! The backward pass moves each node's first gradient in instead of adding it to zeros (the
//! patch Ava carries on candle-core, vendor/candle-core/AVA-PATCH.md): the memory a backward
//! pass holds at once is the gradient it has and the one it makes, not a zeroed buffer and
//! a sum besides; gradients reached along several edges are still summed in the same order,
//! the first of a subtraction is its negation, and every stored gradient is contiguous from
//! its storage's start (the optimizer steps read it so), broadcast and transposed ones
//! included.

#[global_allocator]
static A: ava_train::memory::CountingAlloc = ava_train::memory::CountingAlloc;

use std::sync::Mutex;

use ava_train::memory;
use candle_core::{Device, Tensor, Var};

/// The allocator is process-wide: tests here must not overlap.
static SERIAL: Mutex<()> = Mutex::new(());

/// 1M f32s: 4 MiB, so the tensors dwarf every other allocation of a backward pass.
const N: usize = 1 << 20;

fn var(values: Vec<f32>, shape: &[usize]) -> Var {
    Var::from_tensor(&Tensor::from_vec(values, shape, &Device::Cpu).unwrap()).unwrap()
}

fn values(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

/// The gradient is contiguous from its storage's start, as the optimizer reads it.
fn assert_laid_out(what: &str, g: &Tensor) {
    assert!(g.is_contiguous() && g.layout().start_offset() == 0, "{what}: the gradient is a view: {:?}", g.layout());
}

/// A chain of two scalings of a 4 MiB tensor, summed: candle's unpatched pass held, at the
/// second scaling, the incoming gradient, the new one, the zeros it added that to and the
/// sum (4 × 4 MiB); moving the first gradient in holds two.
#[test]
fn a_chain_holds_two_gradients_at_once_not_four() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let x = var(vec![1.0; N], &[N]);
    let loss = x.as_tensor().affine(2.0, 0.0).unwrap().affine(3.0, 0.0).unwrap().sum_all().unwrap();
    let bytes = (N * 4) as u64;
    let before = memory::current();
    memory::reset_peak();
    let grads = loss.backward().unwrap();
    let held = memory::peak() - before;
    let g = grads.get(x.as_tensor()).expect("x's gradient");
    assert_eq!(values(g), vec![6.0; N]);
    assert_laid_out("x", g);
    assert!(
        held < 2 * bytes + bytes / 2,
        "backward held {held} bytes at its peak: more than two {bytes}-byte gradients (zeros added to?)"
    );
}

/// Several contributions are summed as before: x·2 + x·3 is 5, x·2 − x·3 is −1, and the
/// first of a subtraction (c − x) is the negated gradient.
#[test]
fn contributions_along_several_edges_are_summed() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let x = var(vec![0.5, -1.5, 2.0, 0.0], &[4]);
    let c = Tensor::new(&[1f32, 1.0, 1.0, 1.0], &Device::Cpu).unwrap();
    let xt = x.as_tensor();
    let cases: [(&str, Tensor, f32); 3] = [
        ("x·2 + x·3", (xt.affine(2.0, 0.0).unwrap() + xt.affine(3.0, 0.0).unwrap()).unwrap(), 5.0),
        ("x·2 − x·3", (xt.affine(2.0, 0.0).unwrap() - xt.affine(3.0, 0.0).unwrap()).unwrap(), -1.0),
        ("c − x", (&c - xt).unwrap(), -1.0),
    ];
    for (what, y, want) in cases {
        let grads = y.sum_all().unwrap().backward().unwrap();
        let g = grads.get(xt).unwrap_or_else(|| panic!("{what}: no gradient"));
        assert_eq!(values(g), vec![want; 4], "{what}");
        assert_laid_out(what, g);
    }
}

/// A first gradient that reaches a tensor as a view (a transpose's, a broadcast's, a piece
/// of a concatenation's) is stored as a tensor of its own, laid out from its start.
#[test]
fn gradients_that_arrive_as_views_are_stored_laid_out() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = Device::Cpu;
    let (a, b) = (var((0..6).map(|i| i as f32).collect(), &[2, 3]), var(vec![1.0, 2.0, 3.0], &[3]));
    let w = Tensor::from_vec((0..6).map(|i| 1.0 + i as f32).collect::<Vec<f32>>(), (3, 2), &dev).unwrap();
    // a's gradient comes back through a transpose: wᵀ, laid out (2, 3).
    let grads = (a.as_tensor().t().unwrap() * &w).unwrap().sum_all().unwrap().backward().unwrap();
    let g = grads.get(a.as_tensor()).unwrap();
    assert_eq!(values(g), [1.0, 3.0, 5.0, 2.0, 4.0, 6.0]);
    assert_laid_out("transposed", g);
    // b's through a broadcast over 2 rows: each column's sum of w's transpose.
    let grads =
        (b.as_tensor().broadcast_as((2, 3)).unwrap() * w.t().unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
    let g = grads.get(b.as_tensor()).unwrap();
    assert_eq!(values(g), [3.0, 7.0, 11.0]);
    assert_laid_out("broadcast", g);
    // Both through a concatenation: a's piece starts the whole gradient.
    let scale = Tensor::from_vec((0..9).map(|i| i as f32).collect::<Vec<f32>>(), 9, &dev).unwrap();
    let joined = Tensor::cat(&[&a.as_tensor().flatten_all().unwrap(), b.as_tensor()], 0).unwrap();
    let grads = (joined * scale).unwrap().sum_all().unwrap().backward().unwrap();
    let (ga, gb) = (grads.get(a.as_tensor()).unwrap(), grads.get(b.as_tensor()).unwrap());
    assert_eq!(values(ga), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    assert_eq!(values(gb), [6.0, 7.0, 8.0]);
    assert_laid_out("concatenated, first", ga);
    assert_laid_out("concatenated, second", gb);
}
