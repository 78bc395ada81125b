//! The README's main job runs the embedded default config, which must stay identical to
//! configs/tiny.yaml. That it trains to within 15% of the synthetic corpus's entropy floor
//! is checked end to end, through the `ava` binary, by
//! `ava-cli/tests/optimizers.rs::the_main_job_trains_as_well_with_each_optimizer` (its adamw
//! run), so the suite trains those 300 steps once.

use ava_train::config::{Config, ConfigLoader};

#[test]
fn the_tiny_recipe_is_the_embedded_default() {
    let recipe = concat!(env!("CARGO_MANIFEST_DIR"), "/../configs/tiny.yaml");
    let tiny = ConfigLoader::new().file(recipe).load().unwrap().into_config();
    assert_eq!(tiny, Config::default());
}
