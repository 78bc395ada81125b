//! `ava train` on an NVIDIA GPU, end to end (`cuda` feature; CI only compiles this target):
//! the tiny config against the CPU at every logged step, exact resume on the GPU, checkpoints
//! that move between the devices, `memory.hard_limit` capping the device's memory, the
//! weights' f32 masters and Kahan compensation streamed with the state, and the refusals of
//! what a GPU run does not do.
//!
//!   source tools/cuda-build-env.sh   # where no CUDA toolkit is installed
//!   cargo test -p ava-cli --features cuda --test gpu_train
//! or build it here (tools/gpu-session.sh build) and run it on the GPU machine with
//! `AVA_TEST_BIN` naming the `ava` binary to run, the `lion` plugin beside it.

mod common;

use std::path::Path;

use common::{ava, checkpoint, losses, ok, train_small, usage_error};

const CUDA: &[&str] = &["--set", "train.device=cuda"];

/// Each parameter stepped inside backward (which takes no clipping and one micro-batch).
const INSIDE: &[&str] = &[
    "--set",
    "train.step_in_backward=true",
    "--set",
    "train.grad_clip=0",
    "--set",
    "train.gradient_accumulation_steps=1",
];

/// The run's arguments with the GPU added.
fn on_gpu<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    CUDA.iter().chain(extra).copied().collect()
}

/// Fails unless every logged loss of `gpu` is within `rel` of the CPU's at the same step.
fn follows(gpu: &Path, cpu: &Path, rel: f64) {
    let (g, c) = (losses(gpu), losses(cpu));
    assert_eq!(g.len(), c.len(), "the two runs logged different steps");
    for ((sg, lg), (sc, lc)) in g.iter().zip(&c) {
        assert_eq!(sg, sc);
        assert!(
            (lg - lc).abs() <= rel * lc.abs(),
            "step {sg}: loss {lg} on the GPU, {lc} on the CPU (more than {rel})"
        );
    }
}

/// Fails unless runs `a` and `b` saved the same bits at step 6 (weights and optimizer state)
/// and logged the same losses; `what` says which runs, for the message.
fn same_bits(a: &Path, b: &Path, what: &str) {
    for file in ["model.safetensors", "optimizer.safetensors"] {
        let x = std::fs::read(checkpoint(a, 6).join(file)).unwrap();
        let y = std::fs::read(checkpoint(b, 6).join(file)).unwrap();
        assert!(x == y, "{what}: {file} differs");
    }
    assert_eq!(losses(a), losses(b), "{what}: losses differ");
}

/// The validation losses of a run, by step.
fn validation(run: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["type"] == "eval")
        .map(|v| (v["data"]["step"].as_u64().unwrap(), v["data"]["val_loss"].as_f64().unwrap()))
        .collect()
}

/// configs/tiny.yaml, the README's main job: in f32 the GPU's loss is within 1% of the CPU's
/// at every logged step (the bar). In bf16 (f32 master weights, as PyTorch's
/// autocast) the two devices round different sums (cuBLAS's bf16 products against the CPU's),
/// and in the steep first hundred steps that noise moves the curve sideways: measured on an
/// H200, 1.7% apart at step 90. The bar there is 5% at every logged step and at the early
/// validations, and 1% at the last (both runs reach the same model).
#[test]
fn the_tiny_config_on_the_gpu_follows_the_cpu_within_one_percent() {
    let dir = tempfile::tempdir().unwrap();
    // Embedded, so the test binary carries it to a machine without this checkout's paths.
    std::fs::write(dir.path().join("tiny.yaml"), include_str!("../../configs/tiny.yaml")).unwrap();
    let config = "tiny.yaml";
    for precision in ["fp32", "bf16"] {
        let p = format!("train.precision={precision}");
        let run = |device: &str| {
            let out = format!("train.out_dir={device}-{precision}");
            let dev = format!("train.device={device}");
            let args =
                ["train", "-c", config, "--set", &p, "--set", &out, "--set", &dev, "--set", "train.log_every=10"];
            ok(ava(dir.path(), &args));
            dir.path().join(format!("{device}-{precision}"))
        };
        let (gpu, cpu) = (run("cuda"), run("cpu"));
        follows(&gpu, &cpu, if precision == "fp32" { 0.01 } else { 0.05 });
        let (vg, vc) = (validation(&gpu), validation(&cpu));
        assert_eq!(vg.len(), vc.len(), "the two runs validated at different steps");
        assert!(!vg.is_empty(), "tiny.yaml validates (train.eval_every)");
        for (n, ((step, g), (_, c))) in vg.iter().zip(&vc).enumerate() {
            let rel = if n + 1 == vg.len() || precision == "fp32" { 0.01 } else { 0.05 };
            assert!(
                (g - c).abs() <= rel * c,
                "{precision}, step {step}: validation loss {g} on the GPU, {c} on the CPU (more than {rel})"
            );
        }
    }
}

/// N steps straight and N/2 + N/2 in a fresh process give the same bits on the GPU.
#[test]
fn resume_on_the_gpu_continues_exactly() {
    let dir = tempfile::tempdir().unwrap();
    for (tag, extra) in [("f32", "train.precision=fp32"), ("none", "train.master_weights=none")] {
        resumes_exactly(dir.path(), tag, &["--set", "train.precision=bf16", "--set", extra]);
    }
}

/// On the GPU with `base` settings, 6 steps straight and 3 + 3 in two processes give the same
/// checkpoint bytes (weights and optimizer state) and losses.
fn resumes_exactly(dir: &Path, tag: &str, base: &[&str]) {
    let (straight, split) = (format!("straight-{tag}"), format!("split-{tag}"));
    ok(train_small(dir, &straight, &on_gpu(&[base, &["--max-steps", "6"]].concat())));
    ok(train_small(dir, &split, &on_gpu(&[base, &["--max-steps", "6", "--steps", "3"]].concat())));
    ok(train_small(dir, &split, &on_gpu(&[base, &["--max-steps", "6", "--resume", "latest"]].concat())));
    let (a, b) = (dir.join(&straight), dir.join(&split));
    same_bits(&a, &b, &format!("{tag}: the straight and the resumed run on the GPU"));
}

/// A checkpoint written on the GPU resumes on the CPU, and one of the CPU on the GPU: the
/// files are the same format (the state copied back to the host when saved), and the
/// continued runs follow the straight one.
#[test]
fn checkpoints_move_between_the_gpu_and_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    ok(train_small(dir.path(), "gpu", &on_gpu(&["--max-steps", "6"])));
    ok(train_small(dir.path(), "cpu", &["--max-steps", "6"]));
    for (from, to, device) in
        [("gpu", "gpu-then-cpu", "train.device=cpu"), ("cpu", "cpu-then-gpu", "train.device=cuda")]
    {
        let src = checkpoint(&dir.path().join(from), 4);
        let resume = src.to_str().unwrap();
        ok(train_small(dir.path(), to, &["--set", device, "--max-steps", "6", "--resume", resume]));
        let (cont, straight) = (losses(&dir.path().join(to)), losses(&dir.path().join(from)));
        for ((s, l), (s2, l2)) in cont.iter().zip(straight.iter().skip(4)) {
            assert_eq!(s, s2);
            assert!((l - l2).abs() <= 0.01 * l2.abs(), "{to}: step {s} loss {l}, the straight run's {l2}");
        }
    }
}

/// What a GPU run does not do is refused before anything is trained, every problem at once,
/// each with what to change.
#[test]
fn what_the_gpu_does_not_do_is_refused_by_name() {
    // The lion plugin: built here, or beside $AVA_TEST_BIN where there is no cargo.
    if std::env::var_os("AVA_TEST_BIN").is_none() {
        ava_tests::workspace_plugins_dir();
    }
    let dir = tempfile::tempdir().unwrap();
    let args = on_gpu(&["--max-steps", "1", "--set", "plugins.optimizer=lion"]);
    let err = usage_error(train_small(dir.path(), "refused", &args));
    assert!(err.contains("train.device: cuda:0 cannot run this configuration"), "{err}");
    assert!(err.contains("optimizer 'lion' runs on the CPU only"), "{err}");
    assert!(err.contains("adamw") && err.contains("sgd"), "the optimizers that do run there are named: {err}");
    assert!(!dir.path().join("refused/metrics.jsonl").exists(), "nothing of a run is written");

    let err = usage_error(train_small(dir.path(), "refused", &on_gpu(&["--set", "train.device=cuda:63"])));
    assert!(err.contains("train.device: cuda:63: the GPU could not be opened"), "{err}");
}

/// The step records of a run's metrics.jsonl (none when the file was never written).
fn step_records(run: &Path) -> Vec<serde_json::Value> {
    let Ok(text) = std::fs::read_to_string(run.join("metrics.jsonl")) else { return Vec::new() };
    text.lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["type"] == "step")
        .map(|v| v["data"].clone())
        .collect()
}

/// `memory.hard_limit` caps the device memory the run's allocations may hold (a pool of
/// that size made the device's current one). configs/tiny.yaml at T = 1024 needs about 78 MiB
/// a step even at a micro-batch of 1 (`ava estimate --device cuda`) over about 7 MiB of
/// weights, gradients and AdamW state: under 32 MiB the run is built, then its first step
/// runs out of device memory at every micro-batch it backs off to (16 down to 1), the
/// message names the limit, and nothing of the run is saved (no checkpoint, no half-written
/// one, no step logged).
/// Under 2 GiB the same run trains, and every logged step's device peak (the capped pool's
/// high-water mark) is above zero, so it is read from the pool the allocations come from, and
/// within the limit. A limit past the card is refused by name before anything is trained, and
/// an unset budget defaults to no more than the limit.
#[test]
fn a_hard_limit_caps_the_device_memory() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tiny.yaml"), include_str!("../../configs/tiny.yaml")).unwrap();
    let run = |name: &str, limit: &str, extra: &[&str]| {
        let (out, lim) = (format!("train.out_dir={name}"), format!("memory.hard_limit={limit}"));
        let mut args = vec!["train", "-c", "tiny.yaml", "--set", &out, "--set", &lim];
        args.extend(CUDA);
        args.extend(["--set", "train.log_every=5", "--max-steps", "20"]);
        args.extend(extra);
        (ava(dir.path(), &args), dir.path().join(name))
    };

    // tiny.yaml's budget (2 GiB) is over 32 MiB: 0 turns the budget (and its preflight) off.
    let (out, small) = run("small", "32MiB", &["--set", "memory.budget=0", "--set", "data.seq_len=1024"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "a runtime failure:\n{stderr}");
    let said = "the GPU ran out of memory at step 1 under memory.hard_limit (32MiB), the most this run's device \
                allocations may hold";
    assert!(stderr.contains(said), "{stderr}");
    assert!(stderr.contains("CUDA_ERROR_OUT_OF_MEMORY"), "the driver's words: {stderr}");
    assert!(
        stderr.contains("Nothing of this step was saved") && stderr.contains("raise memory.hard_limit"),
        "{stderr}"
    );
    let saved: Vec<_> = std::fs::read_dir(small.join("checkpoints")).map(|d| d.flatten().collect()).unwrap_or_default();
    assert!(
        saved.is_empty(),
        "no checkpoint, whole or partial: {:?}",
        saved.iter().map(|e| e.path()).collect::<Vec<_>>()
    );
    assert!(step_records(&small).is_empty(), "no step was logged");

    let (out, roomy) = run("roomy", "2GiB", &[]);
    ok(out);
    let steps = step_records(&roomy);
    assert!(steps.iter().any(|s| s["step"] == 20), "the last step is logged");
    for step in &steps {
        let (peak, used) =
            (step["device_memory"]["peak"].as_u64().unwrap(), step["device_memory"]["used"].as_u64().unwrap());
        assert!(peak > 0 && peak <= 2 << 30 && used <= peak, "step {}: device peak {peak}, used {used}", step["step"]);
        let shown = step["memory"]["peak"].as_u64().unwrap();
        assert!(shown >= peak && shown <= 2 << 30, "step {}: the breakdown's peak {shown}", step["step"]);
    }
    assert!(checkpoint(&roomy, 20).is_dir(), "the run saved its last step");

    // Past the card (no GPU has 64 TiB): refused before training, with the card's size.
    let err = usage_error(train_small(
        dir.path(),
        "huge",
        &on_gpu(&["--max-steps", "1", "--set", "memory.hard_limit=64TiB"]),
    ));
    assert!(err.contains("memory.hard_limit: 64TiB is more than the "), "{err}");
    assert!(err.contains("set memory.hard_limit to at most"), "{err}");
    assert!(!dir.path().join("huge/metrics.jsonl").exists(), "nothing of a run is written");

    // No budget set: the card's default, capped by the limit, said once.
    let out = ok(train_small(dir.path(), "budget", &on_gpu(&["--max-steps", "2", "--set", "memory.hard_limit=1GiB"])));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("memory.budget: 1.00 GiB of device memory (memory.hard_limit, 1GiB, which caps"),
        "{stderr}"
    );
}

/// The `flash` plugin library (FlashAttention-2 on the GPU, loaded from its .so as any plugin
/// is) trains tiny.yaml on the GPU within 1% of flash on the CPU at every logged step (f32),
/// and its checkpoint resumes exactly: its backward adds in a fixed order.
#[test]
fn flash_trains_on_the_gpu() {
    if std::env::var_os("AVA_TEST_BIN").is_none() {
        ava_tests::workspace_plugins_dir();
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tiny.yaml"), include_str!("../../configs/tiny.yaml")).unwrap();
    let run = |name: &str, device: &str, extra: &[&str]| {
        let (out, dev) = (format!("train.out_dir={name}"), format!("train.device={device}"));
        let mut args = vec!["train", "-c", "tiny.yaml", "--set", &out, "--set", &dev];
        args.extend(["--set", "plugins.attention=flash", "--set", "train.log_every=10", "--max-steps", "60"]);
        args.extend(extra);
        ok(ava(dir.path(), &args));
        dir.path().join(name)
    };
    let (gpu, cpu) = (run("gpu", "cuda", &[]), run("cpu", "cpu", &[]));
    follows(&gpu, &cpu, 0.01);
    // 30 + 30 steps in two processes against the 60 straight.
    run("split", "cuda", &["--steps", "30"]);
    let split = run("split", "cuda", &["--resume", "latest"]);
    assert_eq!(losses(&split), losses(&gpu), "flash on the GPU did not resume exactly");
}

/// The tensor-core paths resume exactly too: flash in bf16 (its backward adds in a fixed
/// order, no atomics), and the optimizer step inside backward (each gradient stepped as soon
/// as it is final and freed), in bf16 with f32 masters: 6 steps straight and 3 + 3 in two
/// processes give the same checkpoint bytes and losses. In f32 the step inside backward
/// follows the CPU's within 1% at every step.
#[test]
fn flash_in_bf16_and_the_step_inside_backward_resume_exactly_on_the_gpu() {
    if std::env::var_os("AVA_TEST_BIN").is_none() {
        ava_tests::workspace_plugins_dir();
    }
    let dir = tempfile::tempdir().unwrap();
    let flash = ["--set", "plugins.attention=flash"];
    for (tag, extra) in [("flash", &flash[..]), ("inside", INSIDE)] {
        resumes_exactly(dir.path(), tag, &[&["--set", "train.precision=bf16"][..], extra].concat());
    }
    let f32_inside = [&["--set", "train.precision=fp32", "--max-steps", "6"][..], INSIDE].concat();
    ok(train_small(dir.path(), "inside-gpu", &on_gpu(&f32_inside)));
    ok(train_small(dir.path(), "inside-cpu", &f32_inside));
    follows(&dir.path().join("inside-gpu"), &dir.path().join("inside-cpu"), 0.01);
}

/// Out of device memory inside a step, the step backs off as on the host: tiny.yaml at a
/// micro-batch of 32 (138 MiB by `ava estimate --device cuda`) under a 110 MiB hard limit
/// runs out at step 1, retries the same samples as two micro-batches of 16 (72 MiB), and
/// trains on; its losses follow a run of 16 × 2 from the start within 1% (f32).
#[test]
fn running_out_of_device_memory_backs_off_to_a_smaller_micro_batch() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tiny.yaml"), include_str!("../../configs/tiny.yaml")).unwrap();
    let run = |name: &str, extra: &[&str]| {
        let out = format!("train.out_dir={name}");
        let mut args = vec!["train", "-c", "tiny.yaml", "--set", &out, "--set", "train.device=cuda"];
        args.extend(["--set", "train.precision=fp32", "--set", "train.log_every=1", "--max-steps", "6"]);
        args.extend(extra);
        ok(ava(dir.path(), &args));
        dir.path().join(name)
    };
    let limited = run(
        "limited",
        &["--set", "train.micro_batch_size=32", "--set", "memory.hard_limit=110MiB", "--set", "memory.budget=0"],
    );
    let steps: Vec<serde_json::Value> = std::fs::read_to_string(limited.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["type"] == "step")
        .collect();
    assert_eq!(steps.len(), 6, "every step ran");
    let backoffs = steps[0]["data"]["backoffs"].as_array().cloned().unwrap_or_default();
    assert!(
        backoffs.iter().any(|b| b["micro_batch"] == 32 && b["retry_micro_batch"] == 16),
        "step 1 did not back off from 32 to 16: {}",
        steps[0]
    );
    let reference =
        run("reference", &["--set", "train.micro_batch_size=16", "--set", "train.gradient_accumulation_steps=2"]);
    follows(&limited, &reference, 0.01);
}

/// `offload.tiers`' `ram` share on a GPU run: the state of the parameters past the `device`
/// share lives in page-locked host memory and visits the device each step (uploaded ahead
/// on a copy stream, written back on another). It steps exactly as the state kept on the
/// device: after 6 steps the checkpoint's weights and optimizer state and every loss are the
/// same bits, with the step after backward (f32) and inside it (bf16 weights without masters),
/// with uploads read ahead (`offload.prefetch: 2`) and without (0). Every step record says
/// what moved: as many bytes back as up. A run streaming from host memory resumes exactly.
#[test]
fn optimizer_state_in_host_memory_steps_exactly_as_on_the_device() {
    let dir = tempfile::tempdir().unwrap();
    let after = ["--set", "train.precision=fp32"];
    let inside = [&["--set", "train.precision=bf16", "--set", "train.master_weights=none"], INSIDE].concat();
    for (tag, mode) in [("after", &after[..]), ("inside", &inside[..])] {
        let run = |name: &str, tiers: &str, prefetch: &str| {
            let (tiers, prefetch) = (format!("offload.tiers={tiers}"), format!("offload.prefetch={prefetch}"));
            let extra = [mode, &["--max-steps", "6", "--set", &tiers, "--set", &prefetch]].concat();
            let out = format!("{tag}-{name}");
            ok(train_small(dir.path(), &out, &on_gpu(&extra)));
            dir.path().join(out)
        };
        let device = run("device", "[device: 100%]", "2");
        for (name, tiers, prefetch) in [("split", "[device: 30%, ram: 70%]", "2"), ("host", "[ram: 100%]", "0")] {
            let host = run(name, tiers, prefetch);
            same_bits(&device, &host, &format!("{tag}, {tiers} against the state on the device"));
            let records = step_records(&host);
            assert_eq!(records.len(), 6, "{tag}, {tiers}: every step logged");
            for r in &records {
                let (up, back) = (r["stream"]["read_bytes"].as_u64(), r["stream"]["written_bytes"].as_u64());
                assert!(up.is_some_and(|b| b > 0) && up == back, "{tag}, {tiers}: step record {r}");
            }
        }
    }
    resumes_exactly(dir.path(), "host", &["--set", "offload.tiers=[device: 30%, ram: 70%]"]);
}

/// `offload.tiers` through a tier plugin on a GPU run (`nvme`): each streamed parameter's
/// state is read from the disk, visits the device for its step and is written back, so the
/// run gives the same bits as with the state kept on the device. Host memory and a tier at
/// once is refused by name.
#[test]
fn optimizer_state_streamed_through_nvme_steps_exactly_as_on_the_device() {
    // The nvme plugin: built here, or beside $AVA_TEST_BIN where there is no cargo.
    if std::env::var_os("AVA_TEST_BIN").is_none() {
        ava_tests::workspace_plugins_dir();
    }
    let dir = tempfile::tempdir().unwrap();
    let nvme = format!("plugins.offload={{name: nvme, path: {}}}", dir.path().join("disk").display());
    let base = ["--max-steps", "6", "--set", "train.precision=fp32"];
    let device = [&base[..], &["--set", "offload.tiers=[device: 100%]"]].concat();
    ok(train_small(dir.path(), "device", &on_gpu(&device)));
    let streamed = [&base[..], &["--set", &nvme, "--set", "offload.tiers=[device: 30%, nvme: 70%]"]].concat();
    ok(train_small(dir.path(), "nvme", &on_gpu(&streamed)));
    let (a, b) = (dir.path().join("device"), dir.path().join("nvme"));
    same_bits(&a, &b, "the state on the device and streamed through nvme");
    assert!(step_records(&b).iter().all(|r| r["stream"]["read_bytes"].as_u64().is_some_and(|n| n > 0)));

    let both = ["--max-steps", "1", "--set", &nvme, "--set", "offload.tiers=[device: 20%, ram: 40%, nvme: 40%]"];
    let err = usage_error(train_small(dir.path(), "both", &on_gpu(&both)));
    assert!(err.contains("on a GPU run the state streams from one place"), "{err}");
}

/// Block inputs parked off the device on a GPU run (`selective` with `offload: true`, the
/// built-in `ram` tier): each is written back into page-locked host memory on a copy stream
/// while the next blocks compute, and uploaded on another ahead of its recompute. The run is
/// the same bits as the same blocks recomputed with their inputs held on the device: after 6
/// steps the checkpoint's weights and optimizer state and every loss, in f32 and bf16, with
/// every block parked (against `full`) and with a kept block between two parked ones. Every
/// step record gives the host memory the parked inputs held: their (B, T, d) buffers.
#[test]
fn block_inputs_parked_in_host_memory_train_exactly_as_held_on_the_device() {
    // The selective plugin: built here, or beside $AVA_TEST_BIN where there is no cargo.
    if std::env::var_os("AVA_TEST_BIN").is_none() {
        ava_tests::workspace_plugins_dir();
    }
    let dir = tempfile::tempdir().unwrap();
    for (precision, bytes) in [("fp32", 4), ("bf16", 2)] {
        let run = |name: &str, policy: &str| {
            let (precision, policy) = (format!("train.precision={precision}"), format!("plugins.checkpoint={policy}"));
            let out = format!("{name}-{precision}");
            let args = ["--max-steps", "6", "--set", "model.num_layers=3", "--set", &precision, "--set", &policy];
            let output = ok(train_small(dir.path(), &out, &on_gpu(&args)));
            (dir.path().join(out), String::from_utf8_lossy(&output.stderr).into_owned())
        };
        // SMALL: micro-batches of 4 sequences of 32 tokens, width 32.
        let input = 4 * 32 * 32 * bytes;
        for (tag, held, parked, blocks) in [
            ("every block", "full", "{name: selective, every: 1, offload: true}", 3),
            (
                "blocks 0 and 2",
                "{name: selective, layers: [0, 2]}",
                "{name: selective, layers: [0, 2], offload: true}",
                2,
            ),
        ] {
            let (held, _) = run(&format!("held-{blocks}"), held);
            let (parked, header) = run(&format!("parked-{blocks}"), parked);
            assert!(header.contains("parked in page-locked host memory (ram)"), "{precision}, {tag}: {header}");
            same_bits(&held, &parked, &format!("{precision}, {tag} against the inputs held on the device"));
            let records = step_records(&parked);
            assert_eq!(records.len(), 6, "{precision}, {tag}: every step logged");
            for r in &records {
                assert_eq!(r["offload_bytes"].as_u64(), Some(blocks * input), "{precision}, {tag}: step record {r}");
            }
            assert!(step_records(&held).iter().all(|r| r["offload_bytes"].is_null()), "{precision}, {tag}: held");
        }
    }
}

/// `master_weights: tier` on a GPU run: the f32 masters live with the optimizer state in
/// page-locked host memory (`[ram: 100%]`), each visits the device for its parameter's step,
/// and the resident bf16 weights are its rounding to nearest. The losses are those of f32
/// masters on the device (the forward reads the same rounded weights, the step updates the
/// same f32 values), after backward and inside it; and the run resumes exactly.
#[test]
fn f32_masters_in_host_memory_train_as_f32_masters_on_the_device() {
    let dir = tempfile::tempdir().unwrap();
    let base = ["--max-steps", "6", "--set", "train.precision=bf16"];
    let device = [&base[..], &["--set", "train.master_weights=f32"]].concat();
    ok(train_small(dir.path(), "f32", &on_gpu(&device)));
    let tier = [&base[..], &["--set", "train.master_weights=tier", "--set", "offload.tiers=[ram: 100%]"]].concat();
    let out = ok(train_small(dir.path(), "tier", &on_gpu(&tier)));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("optimizer state and f32 masters:") && stderr.contains("page-locked host memory"),
        "{stderr}"
    );
    ok(train_small(dir.path(), "tier-inside", &on_gpu(&[&tier[..], INSIDE].concat())));
    ok(train_small(dir.path(), "f32-inside", &on_gpu(&[&device[..], INSIDE].concat())));
    for (run, reference) in [("tier", "f32"), ("tier-inside", "f32-inside")] {
        let (a, b) = (losses(&dir.path().join(run)), losses(&dir.path().join(reference)));
        assert_eq!(a, b, "{run}: losses differ from f32 masters on the device");
    }
    resumes_exactly(
        dir.path(),
        "masters",
        &[
            "--set",
            "train.precision=bf16",
            "--set",
            "train.master_weights=tier",
            "--set",
            "offload.tiers=[device: 30%, ram: 70%]",
        ],
    );
}

/// `master_weights: kahan` on a GPU run: bf16 weights and their bf16 compensation
/// (`ava.kahan`), a buffer of the optimizer state. The step is the CPU's bit for bit from the
/// same inputs (ava-train's gpu_ops, `kahan_steps_on_the_gpu_are_the_cpus_bit_for_bit`); a
/// whole run's forward and backward round differently on the two devices (cuBLAS's bf16
/// products), so here the GPU run follows the CPU engine's kahan run within the bf16 bar of
/// the tiny config's test (5% at every step). On the GPU the state, the compensation with
/// it, in page-locked host memory (`[ram: 100%]`, uploaded for each step and written back)
/// gives the same bits as kept on the device: after 6 steps the checkpoint's weights and
/// optimizer state (the compensation included) and every loss, with the step after backward
/// and inside it. The run's header says what lives there, and a run streaming part of it
/// resumes exactly.
#[test]
fn kahan_compensation_in_host_memory_trains_as_on_the_device() {
    let dir = tempfile::tempdir().unwrap();
    let kahan = ["--max-steps", "6", "--set", "train.precision=bf16", "--set", "train.master_weights=kahan"];
    ok(train_small(dir.path(), "cpu", &kahan));
    ok(train_small(dir.path(), "gpu", &on_gpu(&kahan)));
    follows(&dir.path().join("gpu"), &dir.path().join("cpu"), 0.05);
    for (tag, mode) in [("after", &[][..]), ("inside", INSIDE)] {
        let run = |name: &str, tiers: &str| {
            let tiers = format!("offload.tiers={tiers}");
            let out = format!("{tag}-{name}");
            let output = ok(train_small(dir.path(), &out, &on_gpu(&[&kahan[..], mode, &["--set", &tiers]].concat())));
            (dir.path().join(out), String::from_utf8_lossy(&output.stderr).into_owned())
        };
        let (device, _) = run("device", "[device: 100%]");
        let (host, stderr) = run("host", "[ram: 100%]");
        assert!(
            stderr.contains("optimizer state and the weights' compensation (kahan):")
                && stderr.contains("page-locked host memory"),
            "{tag}: {stderr}"
        );
        same_bits(&device, &host, &format!("kahan {tag}, the state in host memory against on the device"));
        for r in step_records(&host) {
            let (up, back) = (r["stream"]["read_bytes"].as_u64(), r["stream"]["written_bytes"].as_u64());
            assert!(up.is_some_and(|b| b > 0) && up == back, "kahan {tag}: step record {r}");
        }
    }
    resumes_exactly(
        dir.path(),
        "kahan",
        &[
            "--set",
            "train.precision=bf16",
            "--set",
            "train.master_weights=kahan",
            "--set",
            "offload.tiers=[device: 30%, ram: 70%]",
        ],
    );
}
