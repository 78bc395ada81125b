//! The README's main job, as a test: the embedded default config (identical to
//! configs/tiny.yaml) drives the validation loss to within 15% of the synthetic corpus's
//! entropy floor.

use ava_plugins::Registry;
use ava_train::config::{Config, ConfigLoader};
use ava_train::train::{Silent, TrainOptions, Trainer};

#[test]
fn tiny_config_gets_within_15_percent_of_the_entropy_floor() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = Config::default();
    config.train.out_dir = dir.path().join("run");
    config.checkpoints.every = 0;
    let mut trainer = Trainer::new(&config, &Registry::builtins(), &TrainOptions::default()).unwrap();
    let summary = trainer.run(&TrainOptions::default(), &mut Silent).unwrap();
    let floor = summary.entropy_floor.expect("the synthetic corpus knows its floor");
    let val = summary.val_loss.expect("the run ends with an evaluation");
    assert!(
        val <= 1.15 * floor,
        "validation loss {val:.4} is {:.1}% above the floor {floor:.4}",
        100.0 * (val / floor - 1.0)
    );
    assert!(val >= floor * 0.98, "validation loss {val:.4} below the entropy floor {floor:.4}: the floor is wrong");
}

#[test]
fn the_tiny_recipe_is_the_embedded_default() {
    let recipe = concat!(env!("CARGO_MANIFEST_DIR"), "/../configs/tiny.yaml");
    let tiny = ConfigLoader::new().file(recipe).load().unwrap().into_config();
    assert_eq!(tiny, Config::default());
}
