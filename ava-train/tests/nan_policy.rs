//! `train.nan_policy`, through the trainer, with the `nan_grad_at_steps` hook making one
//! gradient NaN at chosen steps: `skip` leaves the weights and the optimizer state as they
//! were, logs the step and stops after a bounded number of skips in a row; `stop` ends the
//! run naming the step, the parameter and the last checkpoint, saving nothing of the step;
//! with `step_in_backward` a NaN gradient is caught as it is stepped (the step fails by the
//! parameter's name and nothing of it is saved), and `skip` is refused there by name.

mod common;

use ava_plugins::Registry;
use ava_train::config::{Config, NanPolicy};
use ava_train::train::{Silent, TrainError, TrainOptions, Trainer};

fn config(out: &std::path::Path, sets: &[&str]) -> Config {
    let base = [
        "train.micro_batch_size=4",
        "train.max_steps=6",
        "train.eval_every=0",
        "train.log_every=1",
        "checkpoints.every=2",
    ];
    common::tiny_config(out, &[&base[..], sets].concat())
}

fn trainer(config: &Config, nan_at: std::ops::Range<u64>) -> Trainer {
    let options = TrainOptions { nan_grad_at_steps: Some(nan_at), ..Default::default() };
    Trainer::new(config, &Registry::builtins(), &options).unwrap()
}

/// Every weight's values, in order.
fn weights(t: &Trainer) -> Vec<Vec<f32>> {
    t.model()
        .named_tensors()
        .iter()
        .map(|(_, w)| w.flatten_all().unwrap().to_dtype(candle_core::DType::F32).unwrap().to_vec1().unwrap())
        .collect()
}

/// The optimizer state's bytes, as a checkpoint would hold them.
fn state(t: &Trainer) -> Vec<u8> {
    let mut out = Vec::new();
    t.optimizer_state().write_safetensors(t.model().params(), &mut out).unwrap();
    out
}

#[test]
fn skip_leaves_the_state_as_it_was_and_logs_the_step() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = trainer(&config(dir.path(), &["train.nan_policy=skip"]), 3..4);
    t.train_step().unwrap();
    t.train_step().unwrap();
    let (w, s) = (weights(&t), state(&t));
    let record = t.train_step().unwrap();
    assert!(record.skipped, "step 3 is skipped");
    let warning = record.nonfinite.clone().expect("the skip is said");
    assert!(warning.contains("step 3: the gradient norm is NaN (the first non-finite gradient: "), "{warning}");
    assert!(warning.contains("train.nan_policy: skip; 1 in a row"), "{warning}");
    assert!(weights(&t) == w && state(&t) == s, "a skipped step changes neither the weights nor the state");
    assert_eq!(t.step(), 3, "the step counts: its batch is consumed");
    let record = t.train_step().unwrap();
    assert!(!record.skipped && record.nonfinite.is_none());
    assert!(weights(&t) != w, "the next step trains");

    // Through run(): the skipped step is in metrics.jsonl whatever log_every says.
    let dir = tempfile::tempdir().unwrap();
    let mut t = trainer(&config(dir.path(), &["train.nan_policy=skip", "train.log_every=100"]), 3..4);
    let summary = t.run(&TrainOptions::default(), &mut Silent).unwrap();
    assert_eq!(summary.step, 6);
    let metrics = std::fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
    let skipped: Vec<serde_json::Value> = metrics
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["data"]["skipped"] == true)
        .collect();
    assert_eq!(skipped.len(), 1, "{metrics}");
    assert_eq!(skipped[0]["data"]["step"], 3);
    assert!(skipped[0]["data"]["nonfinite"].as_str().unwrap().contains("the gradient norm is NaN"));
}

#[test]
fn skip_stops_after_a_bounded_number_of_skips_in_a_row() {
    let dir = tempfile::tempdir().unwrap();
    let limit = NanPolicy::MAX_CONSECUTIVE_SKIPS;
    let mut t = trainer(&config(dir.path(), &["train.nan_policy=skip", "train.max_steps=100"]), 2..1000);
    t.train_step().unwrap();
    for _ in 1..limit {
        assert!(t.train_step().unwrap().skipped);
    }
    let err = t.train_step().unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(err, TrainError::NonFinite { step, skipped, .. } if step == limit + 1 && skipped == limit - 1),
        "{text}"
    );
    assert!(text.contains(&format!("after {} steps in a row skipped", limit - 1)), "{text}");
    assert!(text.contains("no checkpoint was saved yet"), "{text}");
}

#[test]
fn stop_names_the_step_the_parameter_and_the_last_checkpoint_and_saves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = trainer(&config(dir.path(), &[]), 3..4);
    let err = t.run(&TrainOptions::default(), &mut Silent).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, TrainError::NonFinite { step: 3, skipped: 0, .. }), "{text}");
    let last = dir.path().join("checkpoints/step-00000002");
    for want in [
        "step 3: the gradient norm is NaN (the first non-finite gradient: lm_head.weight)",
        "Nothing of the step was applied or saved",
        &format!("the last checkpoint, {}, is intact: resume from it with --resume latest", last.display()),
        "Lower train.lr",
    ] {
        assert!(text.contains(want), "{want:?} not in: {text}");
    }
    assert!(!dir.path().join("checkpoints/step-00000003").exists());
    assert!(!dir.path().join("model").exists(), "no final model either");
    // The checkpoint left resumes (to the end, the hook gone).
    let options = TrainOptions { resume: Some("latest".into()), ..Default::default() };
    let mut resumed = Trainer::new(&config(dir.path(), &[]), &Registry::builtins(), &options).unwrap();
    assert_eq!(resumed.step(), 2);
    assert_eq!(resumed.run(&options, &mut Silent).unwrap().step, 6);
}

#[test]
fn step_in_backward_checks_each_gradient_it_steps_and_saves_nothing_of_a_bad_step() {
    let dir = tempfile::tempdir().unwrap();
    let sets = ["train.step_in_backward=true", "train.grad_clip=0"];
    let mut t = trainer(&config(dir.path(), &sets), 3..4);
    let err = t.run(&TrainOptions::default(), &mut Silent).unwrap_err();
    let text = err.to_string();
    let TrainError::FailedInBackward { step: 3, saved: 2, source } = &err else { panic!("{text}") };
    assert!(matches!(**source, TrainError::NonFiniteInBackward { step: 3, .. }), "{text}");
    assert!(
        text.contains(
            "step 3 failed inside backward: the gradient of model.layers.0.self_attn.q_proj.weight is NaN at step 3"
        ),
        "{text}"
    );
    assert!(text.contains("is NaN at step 3: lower train.lr"), "{text}");
    assert!(text.contains("the last checkpoint (step 2, if one was saved) is intact"), "{text}");
    assert!(!dir.path().join("checkpoints/step-00000003").exists());

    // `skip` cannot work there: refused before anything runs, naming both keys and the fix.
    let config = config(dir.path(), &["train.step_in_backward=true", "train.grad_clip=0", "train.nan_policy=skip"]);
    let err = Trainer::new(&config, &Registry::builtins(), &TrainOptions::default()).unwrap_err().to_string();
    assert!(err.contains("train.step_in_backward steps each parameter"), "{err}");
    assert!(err.contains("but train.nan_policy is skip: set train.nan_policy: stop"), "{err}");
    assert!(err.contains("or train.step_in_backward: false"), "{err}");
}
