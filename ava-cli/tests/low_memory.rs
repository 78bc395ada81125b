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

/// The run's summary (`ava train --format json`).
fn summary(out: &Output) -> serde_json::Value {
    common::json_of(out)
}

/// Issue 19's proof at CI size: a model whose plain fp32 step (f32 masters, state in memory,
/// step after backward, no checkpointing) needs three times `memory.hard_limit` trains 20
/// steps under it with bf16 weights, the state (and masters) on the disk tier, the step
/// inside backward and full checkpointing: its loss within 1% of the plain run's at every
/// step, a resume across processes bit for bit, and `ava estimate` within 5% of the peak.
#[test]
fn a_model_three_times_over_the_hard_limit_trains_under_it() {
    ava_tests::workspace_plugins_dir();
    let dir = tempfile::tempdir().unwrap();
    // 12 blocks of width 256 with a byte vocabulary: parameters and state dominate.
    let model = set(&[
        "model.vocab_size=256",
        "model.hidden_size=256",
        "model.num_layers=12",
        "model.num_heads=4",
        "model.num_kv_heads=4",
        "model.intermediate_size=704",
        "model.tie_embeddings=false",
        "train.micro_batch_size=1",
        "train.max_steps=20",
        "train.precision=fp32",
        "checkpoints.every=10",
    ]);
    let json = vec!["--format".to_string(), "json".to_string()];
    let plain = summary(&ok(train(dir.path(), "plain", &[model.clone(), json.clone()].concat())));
    let naive = plain["peak_bytes"].as_u64().unwrap();
    let limit = naive / 3;
    for masters in ["tier", "none"] {
        let disk = dir.path().join(format!("nvme-{masters}"));
        let low = [
            model.clone(),
            set(&[
                "train.precision=bf16",
                &format!("train.master_weights={masters}"),
                "train.step_in_backward=true",
                "plugins.checkpoint=full",
                &format!("memory.budget={limit}"),
                &format!("memory.hard_limit={limit}"),
            ]),
            // One record written behind at a time, as the estimate counts (the tier's
            // default lets 64 MiB wait for a slow disk).
            set(&[
                &format!("plugins.offload={{name: nvme, path: {}, max_in_flight: 1MiB}}", disk.display()),
                "offload.tiers=[nvme: 100%]",
            ]),
        ]
        .concat();
        let out = ok(train(dir.path(), masters, &[low.clone(), json.clone()].concat()));
        let peak = summary(&out)["peak_bytes"].as_u64().unwrap();
        let run = dir.path().join(masters);
        let (reference, ours) = (common::losses(&dir.path().join("plain")), common::losses(&run));
        assert_eq!(ours.len(), 20, "{masters}: {ours:?}");
        for ((step, a), (_, b)) in reference.iter().zip(&ours) {
            assert!((a - b).abs() <= 0.01 * a, "{masters}, step {step}: loss {b} vs the plain run's {a}");
        }
        // The estimate of the same configuration, against the measured peak.
        let mut args = vec!["estimate".to_string()];
        args.extend(common::SMALL.iter().flat_map(|s| ["--set".to_string(), s.to_string()]));
        args.extend(set(BASE));
        args.extend(low.iter().cloned());
        args.extend(json.clone());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let estimate = common::json_of(&ok(common::ava(dir.path(), &args)));
        let estimated = estimate["breakdown"]["peak"].as_u64().unwrap();
        let ratio = estimated as f64 / peak as f64;
        println!("{masters}: plain peak {naive}, limit {limit}, measured {peak}, estimated {estimated} ({ratio:.3})");
        assert!((0.95..=1.05).contains(&ratio), "{masters}: estimated {estimated} vs measured {peak}");

        // Ten steps, a new process, ten more: the same bytes as the straight run.
        let resumed = format!("{masters}-resumed");
        let disk = dir.path().join(format!("nvme-{resumed}"));
        let low: Vec<String> =
            low.iter().map(|a| a.replace(&format!("nvme-{masters}"), &format!("nvme-{resumed}"))).collect();
        ok(train(dir.path(), &resumed, &[low.clone(), vec!["--steps".into(), "10".into()]].concat()));
        ok(train(dir.path(), &resumed, &[low, vec!["--resume".into(), "latest".into()]].concat()));
        assert!(disk.exists());
        same_files(
            &checkpoint(&run, 20),
            &checkpoint(&dir.path().join(&resumed), 20),
            &["model.safetensors", "optimizer.safetensors", "trainer.json"],
        );
    }
}

/// `ava plan --offload nvme:PATH` on the proof's model with Lion (whose state the planner
/// cannot swap for a smaller one) and a third of the plain config's peak: only plans that
/// stream the state to disk fit; the one it writes trains under the budget, as planned.
/// A malformed --offload and a tier that is not installed are refused with what to write.
#[test]
fn plan_streams_the_state_to_disk_when_nothing_else_fits() {
    ava_tests::workspace_plugins_dir();
    let dir = tempfile::tempdir().unwrap();
    let disk = dir.path().join("nvme");
    std::fs::create_dir_all(&disk).unwrap();
    let model = [
        "model.vocab_size=256",
        "model.hidden_size=256",
        "model.num_layers=12",
        "model.num_heads=4",
        "model.num_kv_heads=4",
        "model.intermediate_size=704",
        "data.seq_len=32",
        "train.micro_batch_size=1",
        "train.gradient_accumulation_steps=1",
        "plugins.optimizer=lion",
        "plugins.checkpoint=none",
    ];
    let with = |head: &[&str]| {
        let mut args: Vec<String> = head.iter().map(|s| s.to_string()).collect();
        args.extend(set(&model));
        args
    };
    let call = |args: &[String]| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        common::ava(dir.path(), &args)
    };
    let plain = common::json_of(&ok(call(&with(&["--format", "json", "estimate"]))));
    let naive = plain["breakdown"]["peak"].as_u64().unwrap();
    let budget = (naive / 3).to_string();
    let offload = format!("nvme:{}", disk.display());
    let plan = common::json_of(&ok(call(&with(&[
        "--format",
        "json",
        "plan",
        "--budget",
        &budget,
        "--offload",
        &offload,
        "--write",
        "planned.yaml",
    ]))));
    let best = &plan["configs"][0];
    println!("budget {budget} (plain {naive}): {best}");
    assert_eq!(best["offload"]["tier"], "nvme", "{plan}");
    assert_eq!(best["precision"], "bf16", "{plan}");
    assert!(best["offloaded_bytes"].as_u64().unwrap() > 0, "{plan}");
    assert!(best["peak"].as_u64().unwrap() < budget.parse::<u64>().unwrap(), "{plan}");
    let out = ok(common::ava(
        dir.path(),
        &["--format", "json", "train", "-c", "planned.yaml", "--max-steps", "4", "--set", "train.out_dir=planned"],
    ));
    let measured = common::json_of(&out)["peak_bytes"].as_u64().unwrap();
    println!("measured {measured}");
    assert!(measured <= budget.parse::<u64>().unwrap(), "the planned run peaked at {measured}, over {budget}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("streams through nvme"), "{err}");

    let out = call(&with(&["plan", "--budget", &budget, "--offload", "nvme"]));
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--offload \"nvme\": no ':' between the tier and its path; expected TIER:PATH"), "{err}");
    let out = call(&with(&["plan", "--budget", &budget, "--offload", "tape:/tmp"]));
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--offload \"tape:/tmp\": the tier cannot be made there") && err.contains("tape"), "{err}");
}

/// `ava bench train` says which matrix kernels ran, in its text and its JSON, beside where
/// the step's time went (the linear layers' backward among the scopes).
#[test]
fn bench_train_names_the_matmul_kernels() {
    ava_tests::workspace_plugins_dir();
    let dir = tempfile::tempdir().unwrap();
    let mut args: Vec<String> =
        ["bench", "train", "--steps", "1", "--warmup", "0"].iter().map(|s| s.to_string()).collect();
    args.extend(common::SMALL.iter().flat_map(|s| ["--set".to_string(), s.to_string()]));
    let text_args: Vec<&str> = args.iter().map(String::as_str).collect();
    let text = String::from_utf8_lossy(&ok(common::ava(dir.path(), &text_args)).stdout).into_owned();
    let line = text.lines().find(|l| l.starts_with("matmul kernels")).unwrap_or_else(|| panic!("{text}"));
    assert!(line.contains("gemm ") && line.contains("attention tiles"), "{line}");
    let json_args: Vec<&str> = ["--format", "json"].into_iter().chain(text_args.iter().copied()).collect();
    let out = common::json_of(&ok(common::ava(dir.path(), &json_args)));
    assert_eq!(out["matmul_path"].as_str(), Some(line.trim_start_matches("matmul kernels").trim()));
    let scopes: Vec<&str> = out["profile"].as_array().unwrap().iter().map(|p| p["scope"].as_str().unwrap()).collect();
    assert!(scopes.contains(&"backward: linear"), "{scopes:?}");
}

/// `ava bench train` with the [`common::SMALL`] settings, `extra` and `--trace trace`, in
/// `dir`: what it said on stderr and stdout (it must succeed).
fn bench_traced(dir: &std::path::Path, trace: &std::path::Path, extra: &[&str]) -> String {
    let mut args: Vec<String> = ["bench", "train"].iter().chain(extra).map(|s| s.to_string()).collect();
    args.extend(["--trace".to_string(), trace.display().to_string()]);
    args.extend(common::SMALL.iter().flat_map(|s| ["--set".to_string(), s.to_string()]));
    let out = ok(common::ava(dir, &args.iter().map(String::as_str).collect::<Vec<_>>()));
    String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout)
}

/// `ava bench train --trace FILE` writes the profiled steps as Chrome trace-event JSON: each
/// measured step a span, the profiler's scopes as spans inside the steps, and the host memory
/// held as a counter track in time order; a file that cannot be written is refused before
/// any step runs, and so is --trace with --modes.
#[test]
fn bench_train_writes_the_steps_as_a_trace() {
    ava_tests::workspace_plugins_dir();
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace.json");
    let said = bench_traced(dir.path(), &trace, &["--steps", "2", "--warmup", "0"]);
    assert!(said.contains(&format!("trace: {} (", trace.display())), "{said}");
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
    let events = json["traceEvents"].as_array().unwrap();
    let spans: Vec<&serde_json::Value> = events.iter().filter(|e| e["ph"] == "X").collect();
    let steps: Vec<&serde_json::Value> =
        spans.iter().copied().filter(|e| e["name"].as_str().unwrap().starts_with("step ")).collect();
    assert_eq!(steps.iter().map(|e| e["name"].as_str().unwrap()).collect::<Vec<_>>(), ["step 1", "step 2"]);
    let within = |e: &serde_json::Value, s: &serde_json::Value| {
        let (t, d) = (e["ts"].as_f64().unwrap(), e["dur"].as_f64().unwrap());
        let (st, sd) = (s["ts"].as_f64().unwrap(), s["dur"].as_f64().unwrap());
        t >= st && t + d <= st + sd + 1.0
    };
    let linear: Vec<&serde_json::Value> = spans.iter().copied().filter(|e| e["name"] == "backward: linear").collect();
    assert!(!linear.is_empty() && linear.len().is_multiple_of(2), "as many in each step: {}", linear.len());
    assert!(linear.iter().all(|l| steps.iter().any(|s| within(l, s))), "scopes lie inside their step");
    let counter: Vec<f64> = events.iter().filter(|e| e["ph"] == "C").map(|e| e["ts"].as_f64().unwrap()).collect();
    assert_eq!(counter.len(), 2 * spans.len(), "the memory at each span's start and end");
    assert!(counter.windows(2).all(|w| w[0] <= w[1]), "the counter in time order");
    assert!(events.iter().filter(|e| e["ph"] == "C").all(|e| e["args"]["MiB"].as_f64().unwrap() > 0.0));

    let refused = common::ava(dir.path(), &["bench", "train", "--steps", "1", "--trace", "/nonexistent/dir/t.json"]);
    assert_eq!(refused.status.code(), Some(2));
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(err.contains("--trace /nonexistent/dir/t.json: cannot write the trace there"), "{err}");
    assert!(!err.contains("tokens/s"), "refused before any step: {err}");
    let refused = common::ava(dir.path(), &["bench", "train", "--modes", "--trace", "t.json"]);
    assert_eq!(refused.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--trace records one config's profiled steps"));
}

/// `ava bench train --memory-trace STEP` records every allocation and release of that
/// measured step into the trace: the bytes held by owner as a counter inside the step's
/// span, the peak as an instant event whose bytes are the counter's highest total, and the
/// buffers live at the peak listed by owner on the terminal. Steps outside the run, and the
/// flag without --trace, are refused before any step.
#[test]
fn bench_train_records_a_steps_memory_timeline() {
    ava_tests::workspace_plugins_dir();
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace.json");
    let said = bench_traced(dir.path(), &trace, &["--steps", "2", "--warmup", "1", "--memory-trace", "2"]);
    assert!(said.contains("memory timeline of step 2: "), "{said}");
    assert!(said.contains("made in the step and live at the peak, by owner:"), "{said}");
    assert!(said.lines().any(|l| l.contains(" buffers  forward: ")), "forward's activations live at the peak: {said}");

    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
    let events = json["traceEvents"].as_array().unwrap();
    let step = events.iter().find(|e| e["ph"] == "X" && e["name"] == "step 2").expect("step 2's span");
    let (start, end) = (step["ts"].as_f64().unwrap(), step["ts"].as_f64().unwrap() + step["dur"].as_f64().unwrap());
    let inside = |e: &serde_json::Value| (start - 1.0..=end + 1.0).contains(&e["ts"].as_f64().unwrap());
    let rows: Vec<&serde_json::Value> =
        events.iter().filter(|e| e["ph"] == "C" && e["name"] == "memory by owner, step 2 (MiB)").collect();
    assert!(rows.len() > 10, "{} rows", rows.len());
    assert!(rows.iter().all(|r| inside(r)), "the timeline lies inside its step");
    assert!(rows.iter().all(|r| r["args"]["held before the step"].as_f64().unwrap() > 0.0));
    let total = |r: &serde_json::Value| -> f64 {
        r["args"].as_object().unwrap().values().map(|v| v.as_f64().unwrap()).sum::<f64>() * 1048576.0
    };
    let highest = rows.iter().map(|r| total(r)).fold(0.0, f64::max);
    let peak = events.iter().find(|e| e["ph"] == "i" && e["s"] == "g").expect("the peak's instant event");
    assert!(inside(peak));
    let peak_bytes = peak["args"]["peak (bytes)"].as_f64().unwrap();
    assert!((peak_bytes - highest).abs() < 16.0, "peak {peak_bytes} against the counter's highest {highest}");
    let largest: Vec<i64> = events
        .iter()
        .filter(|e| e["ph"] == "i" && e["s"] == "p")
        .map(|e| e["args"]["bytes"].as_i64().unwrap())
        .collect();
    assert!(!largest.is_empty() && largest.windows(2).all(|w| w[0] >= w[1]), "largest first: {largest:?}");
    assert_eq!(json["otherData"]["memory events dropped (past the timeline's capacity)"], 0);
    // The chart beside the trace: the peak marked, the estimate's peak as a line, the owners.
    let svg = std::fs::read_to_string(dir.path().join("trace.memory.svg")).unwrap();
    for text in ["memory of step 2 by owner", "peak ", "ava estimate&apos;s peak", "held before the step"] {
        assert!(svg.contains(text) || svg.contains(&text.replace("&apos;", "'")), "{text} in the chart");
    }
    assert!(said.contains("memory chart: "), "{said}");
    let png = std::fs::read(dir.path().join("trace.memory.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");

    let refused =
        common::ava(dir.path(), &["bench", "train", "--steps", "2", "--trace", "t.json", "--memory-trace", "3"]);
    assert_eq!(refused.status.code(), Some(2));
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(err.contains("--memory-trace 3: the benchmark measures steps 1 to 2"), "{err}");
    assert!(!dir.path().join("t.json").exists(), "nothing written for a refused run");
    let refused = common::ava(dir.path(), &["bench", "train", "--memory-trace", "1"]);
    assert_eq!(refused.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--trace"));
}

/// `ava train --memory-trace 2,3` writes each step's recording into the run directory's
/// memory/ (the trace, the summary, the chart), the timeline's peak is the run's measured
/// peak of that step (within what allocations racing on other threads and the span trace's
/// own bytes move), `ava report` lists the steps with their peaks, and the same run
/// trained without the flag has the same losses. Steps outside the run are refused before
/// anything is written; the follow-up command drops the flag.
#[test]
fn train_records_chosen_steps_and_report_shows_them() {
    ava_tests::workspace_plugins_dir();
    let dir = tempfile::tempdir().unwrap();
    let out = ok(common::train_small(dir.path(), "traced", &["--steps", "3", "--memory-trace", "2,3"]));
    let said = String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    let follow_up = said.lines().find(|l| l.contains("--resume latest")).unwrap_or_else(|| panic!("{said}"));
    assert!(!follow_up.contains("--memory-trace"), "{follow_up}");
    assert!(said.contains("memory timeline of step 2: ") && said.contains("memory timeline of step 3: "), "{said}");
    let run = dir.path().join("traced");
    let memory = run.join("memory");
    for step in [2, 3] {
        for file in [".trace.json", ".json", ".memory.svg", ".memory.png"] {
            assert!(memory.join(format!("step-{step}{file}")).is_file(), "step-{step}{file}");
        }
    }
    assert!(!memory.join("step-1.json").exists(), "only the chosen steps");
    let summary: serde_json::Value =
        serde_json::from_slice(&std::fs::read(memory.join("step-2.json")).unwrap()).unwrap();
    let steps: Vec<serde_json::Value> = std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["type"] == "step")
        .collect();
    let step2 = steps.iter().find(|v| v["data"]["step"] == 2).unwrap();
    let (timeline_peak, step_peak) =
        (summary["peak_bytes"].as_f64().unwrap(), step2["data"]["memory"]["peak"].as_f64().unwrap());
    assert!(
        (timeline_peak - step_peak).abs() < 1048576.0,
        "the timeline's peak {timeline_peak} is the step's {step_peak}"
    );
    let owners = summary["live_by_owner"].as_array().unwrap();
    assert!(owners.iter().any(|o| o["owner"].as_str().unwrap().starts_with("forward: ")), "{owners:?}");
    let trace: serde_json::Value =
        serde_json::from_slice(&std::fs::read(memory.join("step-2.trace.json")).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    assert!(events.iter().any(|e| e["ph"] == "X" && e["name"] == "backward: linear"), "the scopes as spans");
    assert!(events.iter().any(|e| e["ph"] == "C" && e["name"] == "memory by owner, step 2 (MiB)"));

    let report = ok(common::ava(dir.path(), &["report", "traced"]));
    let text = String::from_utf8_lossy(&report.stdout);
    for step in [2, 3] {
        let line = text.lines().find(|l| l.starts_with(&format!("memory timeline of step {step}: "))).unwrap_or("");
        assert!(
            line.contains("peak ")
                && line.contains("step-{step}.memory.svg".replace("{step}", &step.to_string()).as_str()),
            "{text}"
        );
    }
    let json = common::json_of(&ok(common::ava(dir.path(), &["--format", "json", "report", "traced"])));
    let timelines = json["memory_timelines"].as_array().unwrap();
    assert_eq!(timelines.iter().map(|t| t["step"].as_u64().unwrap()).collect::<Vec<_>>(), [2, 3]);
    assert_eq!(timelines[0]["peak_bytes"], summary["peak_bytes"]);

    // The same run without recording trains the same losses (recording changes nothing).
    ok(common::train_small(dir.path(), "plain", &["--steps", "3"]));
    assert_eq!(common::losses(&run), common::losses(&dir.path().join("plain")));

    let refused = common::train_small(dir.path(), "refused", &["--steps", "3", "--memory-trace", "0"]);
    let err = common::usage_error(refused);
    assert!(err.contains("--memory-trace 0: the run's steps are 1 to"), "{err}");
    let refused = common::train_small(dir.path(), "refused", &["--steps", "3", "--memory-trace", "5"]);
    let err = common::usage_error(refused);
    assert!(err.contains("--memory-trace 5: this invocation trains steps 1 to 3"), "{err}");
    assert!(!dir.path().join("refused").exists(), "a refused run leaves nothing behind");
    // Refused before --overwrite deletes the earlier run.
    let refused = common::train_small(dir.path(), "plain", &["--steps", "3", "--overwrite", "--memory-trace", "4"]);
    let err = common::usage_error(refused);
    assert!(err.contains("--memory-trace 4: this invocation trains steps 1 to 3"), "{err}");
    assert_eq!(common::losses(&dir.path().join("plain")).len(), 3, "the earlier run is still there");
}

/// `ava bench train --modes` runs the config's model in each memory mode and reports them
/// side by side; with --offload also streaming the state to disk, with the tier's traffic
/// and the time the step waited on it. bf16-only weights take half the parameter memory of
/// fp32 weights, and the step inside backward holds no whole-model gradients.
#[test]
fn bench_train_shows_the_modes() {
    ava_tests::workspace_plugins_dir();
    let dir = tempfile::tempdir().unwrap();
    let disk = dir.path().join("nvme");
    std::fs::create_dir_all(&disk).unwrap();
    let offload = format!("nvme:{}", disk.display());
    let mut args: Vec<String> = ["--format", "json", "bench", "train", "--modes", "--steps", "1", "--warmup", "1"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.extend(["--offload".to_string(), offload]);
    args.extend(common::SMALL.iter().flat_map(|s| ["--set".to_string(), s.to_string()]));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = common::json_of(&ok(common::ava(dir.path(), &args)));
    let modes = out["modes"].as_array().unwrap();
    let names: Vec<&str> = modes.iter().map(|m| m["mode"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "fp32",
            "bf16, f32 masters",
            "bf16 only (stochastic rounding)",
            "bf16 only, step in backward",
            "bf16, f32 masters, step in backward",
            "bf16 only, step in backward, state on nvme",
            "bf16, step in backward, masters and state on nvme",
        ]
    );
    let memory = |i: usize, part: &str| modes[i]["memory"][part].as_u64().unwrap();
    assert_eq!(memory(2, "params") * 2, memory(0, "params"), "bf16 only is half of fp32's weights");
    assert_eq!(memory(3, "grads"), 0, "no whole-model gradients inside backward");
    for streamed in &modes[5..] {
        assert!(streamed["tier_read_bytes_per_step"].as_f64().unwrap() > 0.0, "{streamed}");
        assert!(streamed["tier_written_bytes_per_step"].as_f64().unwrap() > 0.0, "{streamed}");
        assert!(streamed["relative_to_state_in_memory"].as_f64().unwrap() > 0.0, "{streamed}");
    }
    assert!(modes[0]["tier_read_bytes_per_step"].is_null());

    let out = common::ava(dir.path(), &["bench", "train", "--offload", "nvme:/tmp"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--offload goes with --modes"));
}

/// A disk that fails in the middle of a step-in-backward step (the tier refuses every write
/// after half the parameters' worth, as a full disk would, once some parameters were
/// stepped): the run stops naming the step, the disk's error and the checkpoint to resume
/// from; that checkpoint is byte for byte the one a run without the failure saved, and
/// resumed from it the run ends exactly where that one does.
#[test]
fn a_disk_error_inside_backward_leaves_the_last_checkpoint_resumable() {
    use ava_plugins::{HostConfig, Registry};
    use ava_train::train::{Silent, TrainError, TrainOptions, Trainer};

    let plugins = ava_tests::workspace_plugins_dir();
    let registry = Registry::load(&HostConfig { search_paths: vec![plugins], ..HostConfig::default() }).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = |run: &str| {
        let (out, disk) = (dir.path().join(run), dir.path().join(format!("{run}-nvme")));
        let own = [
            format!("train.out_dir={}", out.display()),
            format!("plugins.offload={{name: nvme, path: {}}}", disk.display()),
            "offload.tiers=[nvme: 100%]".to_string(),
            "train.master_weights=tier".to_string(),
            "train.step_in_backward=true".to_string(),
            "train.max_steps=4".to_string(),
        ];
        let sets = common::SMALL.iter().chain(BASE).map(|s| s.to_string()).chain(own);
        ava_train::config::ConfigLoader::new().sets(sets).load().unwrap().into_config()
    };
    let straight = TrainOptions::default();
    Trainer::new(&config("straight"), &registry, &straight).unwrap().run(&straight, &mut Silent).unwrap();

    let failing = TrainOptions { tier_fault_at_step: Some(3), ..TrainOptions::default() };
    let mut t = Trainer::new(&config("failed"), &registry, &failing).unwrap();
    let err = t.run(&failing, &mut Silent).unwrap_err();
    assert!(matches!(err, TrainError::FailedInBackward { step: 3, saved: 2, .. }), "{err:?}");
    let text = err.to_string();
    for part in
        ["step 3 failed inside backward", "No space left on device", "the last checkpoint (step 2", "--resume latest"]
    {
        assert!(text.contains(part), "{part}: {text}");
    }
    drop(t);
    let (failed, reference) = (dir.path().join("failed"), dir.path().join("straight"));
    let steps: Vec<String> = std::fs::read_dir(failed.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step"))
        .collect();
    assert_eq!(steps, ["step-00000002"], "nothing saved after the failure");
    let files = ["model.safetensors", "optimizer.safetensors", "trainer.json"];
    same_files(&checkpoint(&failed, 2), &checkpoint(&reference, 2), &files);

    let resume = TrainOptions { resume: Some("latest".into()), ..TrainOptions::default() };
    Trainer::new(&config("failed"), &registry, &resume).unwrap().run(&resume, &mut Silent).unwrap();
    same_files(&checkpoint(&failed, 4), &checkpoint(&reference, 4), &files);
}
