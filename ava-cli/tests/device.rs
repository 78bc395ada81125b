//! `train.device`: the forms it takes, and what a build without the `cuda` feature says when
//! asked for a GPU (exit code 2, the build command, nothing trained). The GPU engine's own
//! tests run on a GPU machine.

mod common;

use common::{ava, usage_error};

#[test]
fn a_device_that_is_not_one_is_refused_with_the_forms_it_takes() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a.yaml"), "train:\n  device: gpu\n").unwrap();
    let err = usage_error(ava(dir.path(), &["config", "validate", "a.yaml"]));
    assert!(
        err.contains("train.device: 'gpu' is not a device: write cpu, cuda or cuda:N (N the GPU's ordinal, from 0)"),
        "{err}"
    );
    let err = usage_error(ava(dir.path(), &["train", "--set", "train.device=cuda:-1", "--max-steps", "1"]));
    assert!(err.contains("train.device: 'cuda:-1' is not a device"), "{err}");
    assert!(!dir.path().join("runs").exists(), "a config problem is found before the run directory is made");
}

#[cfg(not(feature = "cuda"))]
#[test]
fn a_gpu_asked_of_a_build_without_cuda_says_how_to_build_one() {
    let dir = tempfile::tempdir().unwrap();
    let err = usage_error(ava(dir.path(), &["train", "--set", "train.device=cuda", "--max-steps", "1"]));
    assert!(err.contains("train.device: cuda:0: this ava was built without CUDA"), "{err}");
    assert!(err.contains("cargo build --release --features cuda") && err.contains("or set train.device: cpu"), "{err}");
    let metrics = dir.path().join("runs/default/metrics.jsonl");
    assert!(!metrics.exists(), "nothing of a run is written");
}

/// `ava estimate --device cuda` needs no GPU: it predicts device memory (the GPU replay, host
/// memory apart) in JSON and text; a build without CUDA says it cannot check the plugins'
/// devices, and what a GPU run refuses whatever its plugins (several ranks) is refused.
#[cfg(not(feature = "cuda"))]
#[test]
fn a_gpu_estimate_needs_no_gpu() {
    let dir = tempfile::tempdir().unwrap();
    let out = ava(dir.path(), &["estimate", "--device", "cuda:1", "--format", "json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("this ava was built without CUDA: the estimate is of the GPU engine on cuda:1"),
        "{stderr}"
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["device"], "cuda:1");
    assert!(json["host"].as_array().is_some_and(|h| !h.is_empty()), "{json}");
    let text = ava(dir.path(), &["estimate", "--device", "cuda"]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("on cuda:0 (device memory)") && text.contains("host memory (not in the device peak)"),
        "{text}"
    );
    let err = usage_error(ava(dir.path(), &["estimate", "--device", "cuda", "--world-size", "2"]));
    assert!(err.contains("2 ranks: distributed training runs on the CPU only for now"), "{err}");
    let err = usage_error(ava(dir.path(), &["estimate", "--device", "gpu"]));
    assert!(err.contains("'gpu' is not a device: write cpu, cuda or cuda:N"), "{err}");
}
