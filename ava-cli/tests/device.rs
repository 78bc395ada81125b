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
