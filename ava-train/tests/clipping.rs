//! Global-norm clipping through the trainer, with an optimizer that applies the clipping
//! factor inside its step (`sgd`, `Optimizer::scales_gradients`): the host must hand the
//! factor over once, neither dropping it nor also scaling the gradient. Plain SGD without
//! weight decay moves the weights by `lr · g · c` with `c = clip / (‖g‖ + 1e-6)`, so the
//! update's norm is `lr · clip` (to 1e-6 of it) whatever the gradient: dropped, it would be
//! `lr · ‖g‖`; applied twice, `lr · clip · c`.

mod common;

use ava_plugins::Registry;
use ava_train::train::{Silent, TrainOptions, Trainer};

/// Every weight's values, in order.
fn weights(t: &Trainer) -> Vec<f64> {
    t.model()
        .named_tensors()
        .iter()
        .flat_map(|(_, w)| {
            w.flatten_all().unwrap().to_dtype(candle_core::DType::F64).unwrap().to_vec1::<f64>().unwrap()
        })
        .collect()
}

#[test]
fn one_clipped_sgd_step_moves_the_weights_by_lr_times_the_clip() {
    let dir = tempfile::tempdir().unwrap();
    let (lr, clip) = (0.1, 1e-3);
    let sets = [
        "train.micro_batch_size=4",
        "train.max_steps=1",
        "train.eval_every=0",
        "plugins.optimizer=sgd",
        "train.lr=0.1",
        "train.min_lr=0.1",
        "train.warmup_steps=0",
        "train.weight_decay=0",
        "train.grad_clip=0.001",
    ];
    let config = common::tiny_config(dir.path(), &sets);
    let options = TrainOptions::default();
    let mut t = Trainer::new(&config, &Registry::builtins(), &options).unwrap();
    let before = weights(&t);
    let summary = t.run(&options, &mut Silent).unwrap();
    assert_eq!(summary.step, 1);
    let after = weights(&t);
    let moved = before.iter().zip(&after).map(|(a, b)| (b - a) * (b - a)).sum::<f64>().sqrt();
    let want = lr * clip;
    assert!((moved - want).abs() <= 0.01 * want, "the weights moved by {moved:e}, want lr · clip = {want:e}");
}
