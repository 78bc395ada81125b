//! bf16 weights whose f32 masters stream through the `nvme` tier with the optimizer state,
//! through `ava train`: the masters are exactly the f32 weights of a run that keeps them in
//! memory (the forward pass sees the same bf16 rounding of them either way), with the step
//! after backward or inside it; a run resumes across processes bit for bit; a resume that
//! changes `train.master_weights` is refused unless --force, which converts.

use std::collections::HashMap;
use std::path::Path;
use std::process::Output;

use candle_core::{DType, Device};

mod common;

use common::{checkpoint, ok, train_small};

fn set(pairs: &[&str]) -> Vec<String> {
    pairs.iter().flat_map(|p| ["--set".to_string(), p.to_string()]).collect()
}

/// One micro-batch a step and no clipping (what stepping inside backward needs), bf16.
const BASE: &[&str] = &[
    "train.max_steps=6",
    "train.precision=bf16",
    "train.gradient_accumulation_steps=1",
    "train.grad_clip=0",
    "model.tie_embeddings=true",
];

fn train(dir: &Path, out: &str, extra: &[String]) -> Output {
    let mut args = set(BASE);
    args.extend(extra.iter().cloned());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    train_small(dir, out, &args)
}

fn nvme(path: &Path, tiers: &str) -> Vec<String> {
    set(&[&format!("plugins.offload={{name: nvme, path: {}}}", path.display()), &format!("offload.tiers={tiers}")])
}

/// A safetensors file's tensors as f32 values.
fn tensors(file: &Path) -> HashMap<String, Vec<f32>> {
    candle_core::safetensors::load(file, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}", file.display()))
        .into_iter()
        .map(|(k, t)| (k, t.flatten_all().unwrap().to_dtype(DType::F32).unwrap().to_vec1().unwrap()))
        .collect()
}

/// The training losses, bit for bit, per step.
fn losses(run: &Path) -> Vec<u64> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["type"] == "step")
        .map(|v| v["data"]["loss"].as_f64().unwrap().to_bits())
        .collect()
}

fn same_files(a: &Path, b: &Path, files: &[&str]) {
    for f in files {
        let (x, y) = (std::fs::read(a.join(f)).unwrap(), std::fs::read(b.join(f)).unwrap());
        assert!(x == y, "{f} differs between {} and {}", a.display(), b.display());
    }
}

#[test]
fn masters_in_the_tier_are_the_f32_masters_and_resume_exactly() {
    ava_tests::workspace_plugins_dir();
    let dir = tempfile::tempdir().unwrap();
    let disk = dir.path().join("nvme");
    let inside = set(&["train.step_in_backward=true"]);
    ok(train(dir.path(), "f32", &set(&["train.master_weights=f32"])));
    let out =
        ok(train(dir.path(), "tier", &[set(&["train.master_weights=tier"]), nvme(&disk, "[nvme: 100%]")].concat()));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("optimizer state and f32 masters:") && err.contains("(100%) streams through nvme"), "{err}");
    // Inside backward, part of it in memory: the session reads the rest ahead as backward goes.
    let split = [set(&["train.master_weights=tier"]), nvme(&disk, "[ram: 30%, nvme: 70%]"), inside.clone()].concat();
    ok(train(dir.path(), "tier-inside", &split));

    let f32_run = dir.path().join("f32");
    for run in ["tier", "tier-inside"] {
        let run = dir.path().join(run);
        assert_eq!(losses(&run), losses(&f32_run), "{}", run.display());
        let (reference, weights) = (
            tensors(&checkpoint(&f32_run, 6).join("model.safetensors")),
            checkpoint(&run, 6).join("model.safetensors"),
        );
        let (weights, state) = (tensors(&weights), tensors(&checkpoint(&run, 6).join("optimizer.safetensors")));
        let reference_state = tensors(&checkpoint(&f32_run, 6).join("optimizer.safetensors"));
        for (name, values) in &reference {
            assert_eq!(&state[&format!("{name}.ava.master")], values, "{name}: master");
            // The resident copy is the master rounded to nearest bf16.
            let rounded = candle_core::Tensor::new(values.as_slice(), &Device::Cpu).unwrap();
            let rounded: Vec<f32> =
                rounded.to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap().to_vec1().unwrap();
            assert_eq!(&weights[name], &rounded, "{name}: resident bf16");
        }
        for (name, values) in &reference_state {
            assert_eq!(&state[name], values, "{name}: optimizer state");
        }
    }

    // Three steps, a checkpoint with the state and masters on the disk, a new process, three more.
    let steps = |n: &str| vec!["--steps".to_string(), n.to_string()];
    ok(train(dir.path(), "resumed", &[split.clone(), steps("3")].concat()));
    ok(train(dir.path(), "resumed", &[split, vec!["--resume".into(), "latest".into()]].concat()));
    let files = ["model.safetensors", "optimizer.safetensors", "trainer.json"];
    same_files(&checkpoint(&dir.path().join("tier-inside"), 6), &checkpoint(&dir.path().join("resumed"), 6), &files);
}

#[test]
fn stochastically_rounded_weights_resume_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let none = set(&["train.master_weights=none", "train.step_in_backward=true"]);
    ok(train(dir.path(), "straight", &none));
    ok(train(dir.path(), "resumed", &[none.clone(), vec!["--steps".into(), "3".into()]].concat()));
    ok(train(dir.path(), "resumed", &[none, vec!["--resume".into(), "latest".into()]].concat()));
    let files = ["model.safetensors", "optimizer.safetensors", "trainer.json"];
    same_files(&checkpoint(&dir.path().join("straight"), 6), &checkpoint(&dir.path().join("resumed"), 6), &files);
    // The weights are stored as bf16, 2 bytes each, in checkpoints and in the final model.
    let header = common::safetensors_header(&dir.path().join("straight/model/model.safetensors"));
    assert_eq!(header["model.embed_tokens.weight"]["dtype"], "BF16", "{header}");
}

#[test]
fn a_resume_that_changes_master_weights_needs_force_and_converts() {
    ava_tests::workspace_plugins_dir();
    let dir = tempfile::tempdir().unwrap();
    let disk = dir.path().join("nvme");
    let tier = [set(&["train.master_weights=tier"]), nvme(&disk, "[nvme: 100%]")].concat();
    ok(train(dir.path(), "f32", &set(&["train.master_weights=f32"])));
    ok(train(dir.path(), "run", &[tier, vec!["--steps".into(), "3".into()]].concat()));
    let resume = vec!["--resume".to_string(), "latest".to_string()];
    let out = train(dir.path(), "run", &[set(&["train.master_weights=f32"]), resume.clone()].concat());
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("train.master_weights") && err.contains("--force"), "{err}");
    // Forced: the tier's masters become the f32 weights, so the run goes on exactly as the
    // one that had f32 masters from the start.
    let forced = [set(&["train.master_weights=f32"]), resume, vec!["--force".into()]].concat();
    ok(train(dir.path(), "run", &forced));
    same_files(
        &checkpoint(&dir.path().join("f32"), 6),
        &checkpoint(&dir.path().join("run"), 6),
        &["model.safetensors", "optimizer.safetensors"],
    );
}
