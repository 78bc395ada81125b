//! The optimizer plugins end to end through `ava`: exact resume with each in a fresh
//! process, validation loss and weights against `adamw` on the tiny config, and the state
//! accounting of `ava bench optimizer`.
//!
//! The plugins (`adam-8bit`, `adam-mini`, `adafactor`, `lion`) are dynamically loaded
//! libraries built next to the `ava` binary, where it finds them.

mod common;

use std::path::Path;

use common::{ava, checkpoint, json_of, losses, ok, safetensors_names, train_small, usage_error};
use serde_json::Value;

/// Each optimizer (with options that exercise its whole state: 8-bit blocks on these small
/// tensors and the gradient-norm history; Adafactor's first moment), and a buffer name its
/// checkpoint must hold.
const OPTIMIZERS: [(&str, &str); 6] = [
    ("{name: adamw, amsgrad: true}", "model.layers.0.mlp.up_proj.weight.max_exp_avg_sq"),
    ("{name: sgd, momentum: 0.9, dampening: 0.1}", "model.layers.0.mlp.up_proj.weight.momentum_buffer"),
    (
        "{name: adam-8bit, min_8bit_size: 256, block_size: 64, percentile_clipping: 90}",
        "model.layers.0.mlp.up_proj.weight.absmax_exp_avg_sq",
    ),
    ("adam-mini", "model.layers.0.self_attn.q_proj.weight.exp_avg_sq"),
    ("{name: adafactor, beta1: 0.9}", "model.layers.0.self_attn.o_proj.weight.exp_avg_sq_col"),
    ("lion", "lion"),
];

#[test]
fn resume_is_bit_exact_with_every_optimizer() {
    ava_tests::workspace_plugins_dir();
    let dir = tempfile::tempdir().unwrap();
    for (i, (selection, buffer)) in OPTIMIZERS.iter().enumerate() {
        let set = format!("plugins.optimizer={selection}");
        let (straight, split) = (format!("straight{i}"), format!("split{i}"));
        ok(train_small(dir.path(), &straight, &["--max-steps", "4", "--set", &set]));
        ok(train_small(dir.path(), &split, &["--max-steps", "4", "--steps", "2", "--set", &set]));
        let out = ok(train_small(dir.path(), &split, &["--max-steps", "4", "--resume", "latest", "--set", &set]));
        assert!(String::from_utf8_lossy(&out.stderr).contains("continuing at step 3"), "{selection}");

        let (a, b) = (dir.path().join(&straight), dir.path().join(&split));
        for file in ["model.safetensors", "optimizer.safetensors", "trainer.json"] {
            let x = std::fs::read(checkpoint(&a, 4).join(file)).unwrap();
            let y = std::fs::read(checkpoint(&b, 4).join(file)).unwrap();
            assert!(x == y, "{selection}: {file} differs between the straight and the resumed run");
        }
        assert_eq!(losses(&a), losses(&b), "{selection}: losses differ");
        assert_eq!(losses(&a).len(), 4);
        let names = safetensors_names(&checkpoint(&a, 4).join("optimizer.safetensors"));
        if *buffer == "lion" {
            assert!(names.iter().all(|n| n.ends_with(".exp_avg")), "{names:?}");
        } else {
            assert!(names.iter().any(|n| n == buffer), "{selection}: no {buffer} in {names:?}");
            // Every parameter keeps its own step count.
            assert!(names.iter().any(|n| n == "model.norm.weight.step"), "{selection}: {names:?}");
        }
    }
}

#[test]
fn a_head_dim_that_disagrees_with_the_model_is_refused() {
    ava_tests::workspace_plugins_dir();
    let dir = tempfile::tempdir().unwrap();
    // SMALL: hidden 32 over 2 heads, so heads are 16 wide.
    let err = usage_error(train_small(
        dir.path(),
        "run",
        &["--max-steps", "1", "--set", "plugins.optimizer={name: adam-mini, head_dim: 8}"],
    ));
    assert!(
        err.contains("plugins.optimizer.head_dim is 8 but the model's heads are 16 wide (model.hidden_size 32 / model.num_heads 2): remove the option, the engine fills it in"),
        "{err}"
    );
    ok(train_small(
        dir.path(),
        "run",
        &["--max-steps", "1", "--set", "plugins.optimizer={name: adam-mini, head_dim: 16}"],
    ));
}

/// `ava bench optimizer --format json` on a 0.3M-parameter model, one timed step.
fn bench(dir: &Path, extra: &[&str]) -> Value {
    ava_tests::workspace_plugins_dir();
    let mut args = vec!["--format", "json", "bench", "optimizer", "--params", "300K", "--steps", "1"];
    args.extend(extra);
    json_of(&ok(ava(dir, &args)))
}

#[test]
fn bench_reports_declared_and_measured_state_per_parameter() {
    let dir = tempfile::tempdir().unwrap();
    let doc = bench(dir.path(), &[]);
    // Width 64 (4096-element matrices), byte vocabulary, 4 blocks.
    assert_eq!(doc["model"]["hidden"], 64);
    let n = doc["model"]["params"].as_f64().unwrap();
    let rows = doc["optimizers"].as_array().unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["adamw", "adam-8bit", "adafactor", "adam-mini", "lion"]);
    let get = |name: &str, key: &str| {
        rows.iter().find(|r| r["name"] == name).unwrap()[key].as_f64().unwrap_or_else(|| panic!("{name} {key}"))
    };
    // The layouts' arithmetic: Lion 4 bytes per parameter exactly; AdamW 8 and the others
    // add a u32 step count per tensor (9 per block and 3 outside: 39 tensors).
    let tensors = 4.0 * 9.0 + 3.0;
    assert_eq!(get("adamw", "state_bytes_per_param_declared"), (8.0 * n + 4.0 * tensors) / n);
    assert_eq!(get("lion", "state_bytes_per_param_declared"), 4.0);
    let eight = get("adam-8bit", "state_bytes_per_param_declared");
    // Matrices (all ≥ 4096 elements) at 2 + 8/256; the 9 norm gains of 64 at 8.
    let norms = 9.0 * 64.0;
    let want = ((n - norms) * (2.0 + 8.0 / 256.0) + norms * 8.0 + 4.0 * tensors) / n;
    assert!((eight - want).abs() < 1e-9, "adam-8bit {eight}, want {want}");
    assert!(get("adam-8bit", "matrix_state_bytes_per_param_declared") < 2.04);
    assert!(get("adafactor", "matrix_state_bytes_per_param_declared") < 0.15);
    assert!(get("adam-mini", "state_bytes_per_param_declared") < 4.1);
    for r in rows {
        let (declared, measured) = (
            r["state_bytes_per_param_declared"].as_f64().unwrap(),
            r["state_bytes_per_param_measured"].as_f64().unwrap(),
        );
        // The host's allocator sees the buffers (rounded up to 8 bytes) and their bookkeeping
        // (vectors, names): a few hundred bytes per tensor, at most 512.
        let extra = (measured - declared) * n;
        assert!(measured >= declared && extra < 512.0 * tensors, "{}: {measured} vs {declared}", r["name"]);
        assert!(r["step_ms_median"].as_f64().unwrap() > 0.0);
    }
}

#[test]
fn bench_options_and_names_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    let doc = bench(dir.path(), &["--names", "adam-8bit", "--set", "adam-8bit.block_size=2048"]);
    assert_eq!(doc["optimizers"][0]["options"]["block_size"], 2048);
    ava_tests::workspace_plugins_dir();
    let err = usage_error(ava(dir.path(), &["bench", "optimizer", "--names", "adam8bit"]));
    assert!(err.contains("unknown optimizer 'adam8bit' (did you mean 'adam-8bit'?)"), "{err}");
    let err = usage_error(ava(
        dir.path(),
        &["bench", "optimizer", "--names", "adam-8bit", "--set", "adam-8bit.block_size=100"],
    ));
    assert!(err.contains("optimizer 'adam-8bit' refused the options given with --set"), "{err}");
    assert!(err.contains("option 'block_size': 100 must be a power of two from 64 to 4096"), "{err}");
    let err = usage_error(ava(dir.path(), &["bench", "optimizer", "--params", "1K"]));
    assert!(err.contains("--params 1000 is below the smallest model this bench builds"), "{err}");
    let err = usage_error(ava(dir.path(), &["bench", "optimizer", "--params", "lots"]));
    assert!(err.contains("expected a parameter count such as 8M, 250K or 1.5B, got 'lots'"), "{err}");
}

/// The main job (the tiny config, the embedded default: 300 steps, seed 0) with each
/// optimizer. adamw within 15% of the data's entropy floor; final validation loss within 2%
/// of adamw's for adam-8bit and adam-mini, within 5% for adafactor.
///
/// Measured (2026-11-23): adamw 1.1908, adam-8bit 1.1934 (+0.22%), adam-mini 1.1973
/// (+0.55%). Adafactor at Hugging Face's defaults reaches 1.3046 (+9.6%): its relative step
/// ignores the config's lr and warmup. Following the config's schedule (`relative_step:
/// false, scale_parameter: false`, β1 0.9, as commonly done for fine-tuning) it reaches
/// 1.1805 (−0.9%); that is what the test runs. At 100 steps adam-mini is still 17% behind (one learning
/// rate per head or row moves slower early on), so the comparison needs the full run:
/// ~75 s per optimizer.
#[test]
fn the_main_job_trains_as_well_with_each_optimizer() {
    ava_tests::workspace_plugins_dir();
    let dir = tempfile::tempdir().unwrap();
    let run = |name: &str, out: &str| {
        let out = ok(ava(
            dir.path(),
            &[
                "--format",
                "json",
                "train",
                "--set",
                &format!("plugins.optimizer={name}"),
                "--set",
                &format!("train.out_dir={out}"),
            ],
        ));
        let summary = json_of(&out);
        let val = summary["val_loss"].as_f64().unwrap_or_else(|| panic!("no val_loss for {name}"));
        (val, summary["entropy_floor"].as_f64().expect("the synthetic corpus knows its floor"))
    };
    // The main job's own promise (issue 3), checked on this run rather than on another one
    // of the same 300 steps: adamw gets within 15% of the corpus's entropy floor.
    let (adamw, floor) = run("adamw", "adamw");
    assert!(
        adamw <= 1.15 * floor,
        "adamw: validation loss {adamw:.4} is {:.1}% above the floor {floor:.4}",
        100.0 * (adamw / floor - 1.0)
    );
    assert!(adamw >= 0.98 * floor, "validation loss {adamw:.4} below the entropy floor {floor:.4}: the floor is wrong");
    let adafactor = "{name: adafactor, relative_step: false, scale_parameter: false, beta1: 0.9}";
    for (name, out, tolerance) in [("adam-8bit", "a8", 0.02), ("adam-mini", "am", 0.02), (adafactor, "af", 0.05)] {
        let (loss, _) = run(name, out);
        println!("{name}: validation loss {loss:.4}, adamw {adamw:.4}");
        assert!(
            (loss - adamw) / adamw < tolerance,
            "{name}: validation loss {loss} is more than {}% above adamw's {adamw}",
            100.0 * tolerance
        );
    }
}
