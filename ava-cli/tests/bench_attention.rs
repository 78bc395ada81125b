//! `ava bench attention` end to end: every kernel's row, its saved bytes and its error
//! against the dense reference with the same mask (kernel options from `--set` included),
//! the text table, and the messages for bad arguments. Timings are printed, never asserted.
//!
//! The plugin kernels (`flash`, `sliding-window`, `block-sparse`) are dynamically loaded
//! libraries built next to the `ava` binary, where it finds them.

mod common;

use std::path::Path;
use std::process::Output;

use common::{json_of, ok, usage_error};
use serde_json::Value;

/// Runs `ava bench attention ARGS` in a fresh directory (no stray ./ava.yaml) without any
/// `AVA*` variable.
fn bench(dir: &Path, args: &[&str]) -> Output {
    ava_tests::workspace_plugins_dir();
    let mut all = vec!["bench", "attention"];
    all.extend(args);
    common::ava(dir, &all)
}

/// The row of `kernel` at `seq`.
fn row<'a>(doc: &'a Value, seq: u64, kernel: &str) -> &'a Value {
    doc["rows"]
        .as_array()
        .expect("rows")
        .iter()
        .find(|r| r["seq"] == seq && r["kernel"] == kernel)
        .unwrap_or_else(|| panic!("no row for {kernel} at T={seq}: {doc:#}"))
}

#[test]
fn every_kernel_matches_the_dense_reference_and_declares_its_saved_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let o = ok(bench(
        dir.path(),
        &["--seq", "1,37", "--heads", "2", "--head-dim", "16", "--repeats", "1", "--threads", "2", "--format", "json"],
    ));
    let doc = json_of(&o);
    assert_eq!(
        doc["shape"],
        serde_json::json!({"batch": 1, "heads": 2, "kv_heads": 2, "head_dim": 16, "causal": true})
    );
    assert_eq!(doc["rows"].as_array().unwrap().len(), 8, "{doc:#}");
    let (b, h) = (1u64, 2u64);
    for t in [1u64, 37] {
        for kernel in ["standard", "flash", "sliding-window", "block-sparse"] {
            let r = row(&doc, t, kernel);
            for key in ["forward_ms", "forward_backward_ms", "host_peak_bytes", "time_vs_standard"] {
                assert!(r[key].as_f64().is_some_and(f64::is_finite), "{kernel} T={t}: {key} in {r:#}");
            }
            let err = r["max_abs_err"].as_f64().unwrap_or_else(|| panic!("{kernel} T={t}: no max_abs_err in {r:#}"));
            assert!(err < 1e-4, "{kernel} T={t}: max error {err} against the dense reference");
            for buf in ["out", "dq", "dk", "dv"] {
                assert!(r["max_abs_err_by_buffer"][buf].as_f64().is_some_and(|e| e < 1e-4), "{kernel} {buf}: {r:#}");
            }
            // out, saved, dq, dk, dv and the backward's declared workspace are allocated by the
            // host for every call, a plugin's scratch included. (The count is exact to within a
            // few hundred bytes: threads an earlier call started may free their thread-local
            // storage during this one.)
            let workspace = r["workspace_bytes"]["backward"].as_u64().unwrap();
            let host = 4 * (4 * b * h * t * 16) + r["saved_bytes"].as_u64().unwrap() + workspace;
            let peak = r["host_peak_bytes"].as_u64().unwrap();
            assert!(peak + 1024 >= host, "{kernel} T={t}: peak {peak} below its buffers {host}: {r:#}");
            assert!(workspace > 0, "{kernel} T={t}: every kernel here has backward scratch: {r:#}");
        }
        // flash (a plugin library): its tiles, 2 threads × (2·64·64 + 2·16·64 + Δ of T rows)
        // f32s in backward (tuned_backward(16) = 64 × 64 tiles).
        let flash_ws = row(&doc, t, "flash")["workspace_bytes"]["backward"].as_u64().unwrap();
        assert_eq!(flash_ws, 4 * 2 * (2 * 64 * 64 + 2 * 16 * 64 + t), "T={t}");
        // flash saves one logsumexp per query row, standard the T×T probabilities.
        assert_eq!(row(&doc, t, "flash")["saved_bytes"], b * h * t * 4);
        assert_eq!(row(&doc, t, "standard")["saved_bytes"], b * h * t * t * 4);
        assert_eq!(row(&doc, t, "standard")["time_vs_standard"], 1.0);
        let ratio = row(&doc, t, "flash")["saved_vs_standard"].as_f64().unwrap();
        assert!((ratio - 1.0 / t as f64).abs() < 1e-12, "flash saved ratio {ratio} at T={t}");
    }
    let masks: Vec<(&str, &str)> = doc["kernels"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| (k["name"].as_str().unwrap(), k["reference_mask"].as_str().unwrap()))
        .collect();
    assert_eq!(
        masks,
        [
            ("standard", "causal"),
            ("flash", "causal"),
            ("sliding-window", "causal window 256"),
            ("block-sparse", "causal blocks of 64: 4 local, 1 global, stride 0"),
        ]
    );
    // One progress line per (T, repeat) on stderr: every kernel runs in each repeat.
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(stderr.contains("[T=37] repeat 1/1: every kernel once"), "{stderr}");
}

/// Options from --set reach the kernel and its reference mask, which therefore cuts
/// through the sequence; grouped-query, non-causal, batched.
#[test]
fn kernel_options_set_the_reference_mask_too() {
    let dir = tempfile::tempdir().unwrap();
    let o = ok(bench(
        dir.path(),
        &[
            "--kernels",
            "sliding-window,block-sparse,flash",
            "--seq",
            "45",
            "--batch",
            "2",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--head-dim",
            "8",
            "--causal",
            "false",
            "--repeats",
            "2",
            "--set",
            "sliding-window.window=5",
            "--set",
            "block-sparse.block_size=8",
            "--set",
            "block-sparse.stride=2",
            "--format",
            "json",
        ],
    ));
    let doc = json_of(&o);
    let kernels = doc["kernels"].as_array().unwrap();
    assert_eq!(kernels[0]["options"], serde_json::json!({"window": 5}));
    assert_eq!(kernels[0]["reference_mask"], "symmetric window 5");
    assert_eq!(kernels[1]["reference_mask"], "full blocks of 8: 4 local, 1 global, stride 2");
    assert_eq!(kernels[2]["reference_mask"], "full");
    for kernel in ["sliding-window", "block-sparse", "flash"] {
        let r = row(&doc, 45, kernel);
        assert!(r["max_abs_err"].as_f64().is_some_and(|e| e < 1e-4), "{kernel}: {r:#}");
        assert_eq!(r["saved_bytes"], 2 * 4 * 45 * 4, "{kernel}: one logsumexp per query row");
        // No standard in the list: nothing to compare with.
        assert!(r["time_vs_standard"].is_null() && r["saved_vs_standard"].is_null(), "{r:#}");
    }
}

#[test]
fn the_text_table_has_a_row_per_kernel_and_explains_its_columns() {
    let dir = tempfile::tempdir().unwrap();
    let o =
        ok(bench(dir.path(), &["--seq", "16", "--heads", "2", "--head-dim", "8", "--repeats", "1", "--threads", "1"]));
    let text = String::from_utf8_lossy(&o.stdout);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], "attention B=1 H=2 Hkv=2 D=8 causal, 1 threads, median of 1 repeat", "{text}");
    let header: Vec<&str> = lines[1].split("  ").map(str::trim).filter(|c| !c.is_empty()).collect();
    assert_eq!(
        header,
        ["T", "kernel", "fwd ms", "fwd+bwd ms", "×standard", "saved", "×standard", "host peak", "max err"],
        "{text}"
    );
    for (line, kernel) in lines[2..6].iter().zip(["standard", "flash", "sliding-window", "block-sparse"]) {
        let cells: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(&cells[..2], ["16", kernel], "{text}");
    }
    assert!(lines[2].contains("2.0 KiB"), "standard saves 2·16·16 f32: {text}");
    assert!(text.contains("workspace the kernel declares for a call (its scratch, allocated by the host)"), "{text}");
    assert!(text.contains("  block-sparse: causal blocks of 64: 4 local, 1 global, stride 0"), "{text}");
}

#[test]
fn help_explains_the_columns_with_an_example() {
    let dir = tempfile::tempdir().unwrap();
    let o = ok(bench(dir.path(), &["--help"]));
    let help = String::from_utf8_lossy(&o.stdout);
    for needle in [
        "host peak",
        "max err",
        "--set sliding-window.window=512",
        "KERNEL.OPTION=VALUE",
        "own allocator",
        "ava bench attention --device cuda --kernels standard,flash --seq 2048,4096,8192 \\\n      --heads 32 --kv-heads 4 --head-dim 64",
        "device peak",
    ] {
        assert!(help.contains(needle), "help lacks '{needle}':\n{help}");
    }
}

#[test]
fn an_unknown_kernel_is_named_with_a_suggestion() {
    let dir = tempfile::tempdir().unwrap();
    let e = usage_error(bench(dir.path(), &["--kernels", "standard,flsh", "--seq", "4"]));
    assert!(
        e.contains("--kernels flsh: unknown attention 'flsh' (did you mean 'flash'?); installed: block-sparse, flash,"),
        "{e}"
    );
    let e = usage_error(bench(dir.path(), &["--kernels", "lion", "--seq", "4"]));
    assert!(e.contains("'lion' is an optimizer, not an attention kernel"), "{e}");
    let e = usage_error(bench(dir.path(), &["--kernels", "flash,", "--seq", "4"]));
    assert!(e.contains("--kernels has an empty name"), "{e}");
}

#[test]
fn a_bad_option_names_the_kernel_and_the_option() {
    let dir = tempfile::tempdir().unwrap();
    let e = usage_error(bench(dir.path(), &["--set", "sliding-window.window=0", "--seq", "4"]));
    assert!(
        e.contains("attention kernel 'sliding-window' refused the options given with --set ({\"window\":0})"),
        "{e}"
    );
    assert!(e.contains("option 'window': must be at least 1, got 0"), "{e}");
    let e = usage_error(bench(dir.path(), &["--set", "block-sparse.strid=2", "--seq", "4"]));
    assert!(e.contains("unknown option 'strid' (did you mean 'stride'?)"), "{e}");
    // An option for a kernel that is not benchmarked (or a config key) is refused, not ignored.
    let e = usage_error(bench(dir.path(), &["--kernels", "flash", "--set", "sliding-window.window=8", "--seq", "4"]));
    assert!(
        e.contains("--set 'sliding-window.window=8': 'sliding-window' is not one of the kernels benchmarked (flash)"),
        "{e}"
    );
}

#[test]
fn a_malformed_set_says_what_form_it_takes() {
    let dir = tempfile::tempdir().unwrap();
    for (set, why) in [
        ("window=512", "no '.' between kernel and option"),
        ("sliding-window.window", "no '='"),
        ("sliding-window.=3", "the option name is empty"),
        ("sliding-window.window=", "the value is empty"),
    ] {
        let e = usage_error(bench(dir.path(), &["--set", set, "--seq", "4"]));
        assert!(
            e.contains(&format!(
                "--set '{set}': {why}; expected KERNEL.OPTION=VALUE, e.g. --set sliding-window.window=512"
            )),
            "{set}: {e}"
        );
    }
}

#[test]
fn bad_sequence_lengths_and_heads_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let e = usage_error(bench(dir.path(), &["--seq", "0"]));
    assert!(e.contains("invalid value '0' for '--seq <T,...>': a sequence length must be at least 1"), "{e}");
    for empty in [&["--seq", ""][..], &["--seq=256,,1024"][..]] {
        let e = usage_error(bench(dir.path(), empty));
        assert!(
            e.contains("expected sequence lengths separated by commas, e.g. --seq 256,1024; got an empty one"),
            "{e}"
        );
    }
    let e = usage_error(bench(dir.path(), &["--seq", "abc"]));
    assert!(e.contains("expected a sequence length (a whole number >= 1)"), "{e}");
    let e = usage_error(bench(dir.path(), &["--seq", "4", "--heads", "4", "--kv-heads", "3"]));
    assert!(e.contains("--kv-heads 3 must divide --heads 4"), "{e}");
}

/// A GPU asked of a build without CUDA says how to build one, naming the flag (the engine's
/// `train.device` refusal, worded for the bench); checked before any kernel is loaded.
#[cfg(not(feature = "cuda"))]
#[test]
fn a_gpu_on_a_build_without_cuda_says_how_to_build_one() {
    let dir = tempfile::tempdir().unwrap();
    for (device, spec) in [("cuda", "cuda:0"), ("cuda:1", "cuda:1")] {
        let e = usage_error(bench(dir.path(), &["--device", device, "--kernels", "standard", "--seq", "4"]));
        assert!(e.contains(&format!("--device {spec}: this ava was built without CUDA.")), "{e}");
        assert!(e.contains("cargo build --release --features cuda") && e.contains("tools/cuda-build-env.sh"), "{e}");
        assert!(e.contains("or bench the kernels on the host with --device cpu"), "{e}");
    }
}

/// What the GPU options refuse, each naming the flag and what to do instead.
#[test]
fn the_device_options_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    let e = usage_error(bench(dir.path(), &["--device", "gpu", "--seq", "4"]));
    assert!(e.contains("'gpu' is not a device: write cpu, cuda or cuda:N (N the GPU's ordinal, from 0)"), "{e}");
    let e = usage_error(bench(dir.path(), &["--dtype", "bf16", "--seq", "4"]));
    assert!(
        e.contains("--dtype bf16: on --device cpu the kernels are called on f32 buffers")
            && e.contains("add --device cuda to bench bf16 on a GPU"),
        "{e}"
    );
    let e = usage_error(bench(dir.path(), &["--dtype", "f8", "--seq", "4"]));
    assert!(e.contains("invalid value 'f8' for '--dtype <TYPE>'") && e.contains("f32, bf16, f16"), "{e}");
    let e = usage_error(bench(dir.path(), &["--device", "cuda", "--causal", "false", "--seq", "4"]));
    assert!(e.contains("--causal false: on a GPU each kernel runs through the training engine's attention op"), "{e}");
    // --dtype f32 is the CPU's own type: accepted.
    let o = ok(bench(dir.path(), &["--dtype", "f32", "--kernels", "standard", "--seq", "4", "--repeats", "1"]));
    assert!(String::from_utf8_lossy(&o.stdout).contains("median of 1 repeat"));
}
