//! Helpers the `ava` end-to-end tests share: running the binary in a clean environment and
//! reading what it printed.

#![allow(dead_code)] // each test file uses its own subset

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

/// `ava ARGS` run in `dir` (no stray ./ava.yaml is read from elsewhere) without any `AVA*`
/// variable of the test's environment.
pub fn ava(dir: &Path, args: &[&str]) -> Output {
    ava_command(dir, args).output().expect("ava runs")
}

/// The `ava` binary the tests run: this build's, or `$AVA_TEST_BIN` when set (a binary
/// copied with the test binaries to a machine without cargo, e.g. the GPU machine, with the
/// plugin libraries it loads beside it). A relative `$AVA_TEST_BIN` is taken from the test's
/// working directory (the binary runs in each test's own directory).
pub fn ava_bin() -> std::path::PathBuf {
    match std::env::var_os("AVA_TEST_BIN") {
        None => env!("CARGO_BIN_EXE_ava").into(),
        Some(bin) => std::path::absolute(&bin).expect("AVA_TEST_BIN names a path"),
    }
}

/// The command [`ava`] runs, to spawn it instead.
pub fn ava_command(dir: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(ava_bin());
    cmd.current_dir(dir).env("NO_COLOR", "1");
    for (key, _) in std::env::vars() {
        if key.starts_with("AVA") {
            cmd.env_remove(key);
        }
    }
    cmd.args(args);
    cmd
}

/// The output of a successful run; the full output in the panic message otherwise.
#[track_caller]
pub fn ok(o: Output) -> Output {
    assert!(
        o.status.success(),
        "ava failed ({}):\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

/// stdout parsed as JSON.
#[track_caller]
pub fn json_of(o: &Output) -> Value {
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&o.stdout)))
}

/// Exit code 2 and the stderr text.
#[track_caller]
pub fn usage_error(o: Output) -> String {
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(2), "expected a usage error, got {}:\n{stderr}", o.status);
    assert!(o.stdout.is_empty(), "stdout: {}", String::from_utf8_lossy(&o.stdout));
    stderr
}

/// A very small training run: 2 blocks of width 32 on the synthetic corpus, a step's
/// metrics logged every step and a checkpoint every 2 steps.
pub const SMALL: &[&str] = &[
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "data.seq_len=32",
    "train.micro_batch_size=4",
    "train.gradient_accumulation_steps=2",
    "train.warmup_steps=2",
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_batches=1",
    "checkpoints.every=2",
    "checkpoints.keep_last=10",
];

/// `ava train` with the [`SMALL`] settings, writing to `dir/out`, plus `extra` arguments.
pub fn train_small(dir: &Path, out: &str, extra: &[&str]) -> Output {
    train_small_command(dir, out, extra).output().expect("ava runs")
}

/// The command [`train_small`] runs, to spawn it instead.
pub fn train_small_command(dir: &Path, out: &str, extra: &[&str]) -> Command {
    let mut args = vec!["train".to_string()];
    for s in SMALL {
        args.extend(["--set".to_string(), s.to_string()]);
    }
    args.extend(["--set".to_string(), format!("train.out_dir={out}")]);
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    ava_command(dir, &args)
}

/// The step losses in a run's metrics.jsonl, by step.
pub fn losses(run: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|v| v["type"] == "step")
        .map(|v| (v["data"]["step"].as_u64().unwrap(), v["data"]["loss"].as_f64().unwrap()))
        .collect()
}

/// The directory of a run's checkpoint at `step`.
pub fn checkpoint(run: &Path, step: u64) -> std::path::PathBuf {
    run.join("checkpoints").join(format!("step-{step:08}"))
}

/// A safetensors file's JSON header.
pub fn safetensors_header(file: &Path) -> Value {
    let bytes = std::fs::read(file).unwrap_or_else(|e| panic!("cannot read {}: {e}", file.display()));
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    serde_json::from_slice(&bytes[8..8 + header_len]).unwrap()
}

/// The tensor names in a safetensors file's header.
pub fn safetensors_names(file: &Path) -> Vec<String> {
    let header = safetensors_header(file);
    header.as_object().unwrap().keys().filter(|k| *k != "__metadata__").cloned().collect()
}
