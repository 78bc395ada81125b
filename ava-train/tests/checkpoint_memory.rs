//! Activation checkpointing saves memory: the same micro-batch with every block recomputed
//! (`full`) peaks lower than with every block kept (`none`), measured with the counting
//! allocator, while the gradients stay identical. Segments of two blocks (`sqrt` for four
//! blocks) fall in between: half the inputs kept, but two blocks rebuilt at once.

use std::sync::Arc;

use ava_core::BlockDecision;
use ava_plugins::Registry;
use ava_train::memory;
use ava_train::model::{Grads, Model, ModelSpec, forward_backward};
use candle_core::{DType, Device, Tensor};

#[global_allocator]
static ALLOCATOR: memory::CountingAlloc = memory::CountingAlloc;

/// Peak bytes above the starting level during one forward/backward, and the gradients.
fn measure(model: &Model, plan: &[BlockDecision]) -> (u64, Grads) {
    let (b, t, v) = (4, 128, model.spec().vocab);
    let tokens: Vec<u32> = (0..b * t).map(|i| ((i * 7 + i / 5) % v) as u32).collect();
    let targets: Vec<u32> = (0..b * t).map(|i| ((i * 3 + 1) % v) as u32).collect();
    let tokens = Tensor::from_vec(tokens, (b, t), &Device::Cpu).unwrap();
    let mut weights = model.weights(DType::F32).unwrap();
    let mut grads = vec![None; model.params().len()];
    let start = memory::current();
    memory::reset_peak();
    forward_backward(model, &mut weights, &tokens, None, &targets, plan, 1.0, 1.0, None, &mut grads).unwrap();
    (memory::peak() - start, grads)
}

#[test]
fn full_recompute_and_segments_peak_lower_with_identical_gradients() {
    assert!(memory::installed() || memory::current() > 0, "the counting allocator is installed");
    let spec = ModelSpec { eps: 1e-5, ..ModelSpec::llama(256, 128, 4, 4, 2, 352) };
    let kernel = Registry::builtins().attention("standard", "{}").unwrap();
    let model = Model::new(spec, 3, 128, Arc::clone(&kernel), "standard", 1).unwrap();
    let (kept, g_kept) = measure(&model, &[BlockDecision::Keep; 4]);
    let (recomputed, g_rec) = measure(&model, &[BlockDecision::Recompute; 4]);
    println!(
        "peak above baseline: none {kept} bytes, full {recomputed} bytes ({:.2}x)",
        kept as f64 / recomputed as f64
    );
    assert!(recomputed * 3 < kept * 2, "full recompute should save at least a third: {recomputed} vs {kept} bytes");
    use BlockDecision::{Recompute as R, Segment as S};
    let (segments, g_seg) = measure(&model, &[R, S, R, S]);
    println!("segments of two blocks: {segments} bytes");
    assert!(recomputed < segments && segments < kept, "{recomputed} < {segments} < {kept} bytes");
    for (a, b) in [&g_rec, &g_seg].into_iter().flat_map(|g| g_kept.iter().zip(g)) {
        let (a, b) = (a.as_ref().unwrap(), b.as_ref().unwrap());
        let diff = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert_eq!(diff, 0.0);
    }
}
