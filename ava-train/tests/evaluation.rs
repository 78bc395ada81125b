//! `train.eval_batch_size`: an evaluation covers `eval_batches × eval_batch_size` validation
//! sequences, so the same sequences in other batch sizes give the same validation loss.

mod common;

use ava_plugins::Registry;
use ava_train::config::ConfigLoader;
use ava_train::train::{TrainOptions, Trainer};

/// The validation loss of an untrained tiny model with `sets` on top.
fn val_loss(sets: &[&str]) -> f64 {
    let dir = tempfile::tempdir().unwrap();
    let config = common::tiny_config(dir.path(), &[&["train.micro_batch_size=8"][..], sets].concat());
    let mut trainer = Trainer::new(&config, &Registry::builtins(), &TrainOptions::default()).unwrap();
    trainer.evaluate().unwrap().val_loss
}

#[test]
fn the_same_sequences_in_other_batch_sizes_give_the_same_val_loss() {
    // 8 sequences: one batch of the micro-batch size (the default), or 4 batches of 2.
    let default = val_loss(&["train.eval_batches=1"]);
    let eight = val_loss(&["train.eval_batches=1", "train.eval_batch_size=8"]);
    let by_two = val_loss(&["train.eval_batches=4", "train.eval_batch_size=2"]);
    assert_eq!(default, eight, "null means the micro-batch size");
    // The same tokens, summed in another order: equal up to rounding.
    assert!((by_two - eight).abs() < 1e-6 * eight, "{by_two} vs {eight}");
    // Other sequences give another loss: the batch size is really used.
    let first_two = val_loss(&["train.eval_batches=1", "train.eval_batch_size=2"]);
    assert!((first_two - eight).abs() > 1e-4, "{first_two} vs {eight}");
}

/// A sample (`train.sample_every`) longer than the model's context is refused when the run
/// is built, not at its first sample; one that fits is taken.
#[test]
fn a_sample_past_the_models_context_is_refused_before_training() {
    let dir = tempfile::tempdir().unwrap();
    let config = |tokens: &str| {
        let sets = [
            "model.hidden_size=32".to_string(),
            "model.intermediate_size=64".into(),
            "model.num_heads=2".into(),
            "model.num_kv_heads=1".into(),
            "model.num_layers=2".into(),
            "data.seq_len=32".into(),
            "train.sample_every=1".into(),
            format!("train.sample_tokens={tokens}"),
            format!("train.out_dir={}", dir.path().join(tokens).display()),
        ];
        ConfigLoader::new().sets(sets.iter().map(String::as_str)).load().unwrap().into_config()
    };
    let err = match Trainer::new(&config("5000"), &Registry::builtins(), &TrainOptions::default()) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a 5000-token sample of a 2048-position model was accepted"),
    };
    assert!(err.contains("train.sample_tokens is 5000 but the model's context is 2048 positions"), "{err}");
    assert!(err.contains("set train.sample_tokens to at most 2047"), "{err}");
    let trainer = Trainer::new(&config("2047"), &Registry::builtins(), &TrainOptions::default()).unwrap();
    let (text, _) = trainer.sample().unwrap();
    assert!(!text.is_empty());
}
