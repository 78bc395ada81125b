//! `ava plan` on a GPU config searches where the optimizer state lives: on the device, or in
//! page-locked host memory streamed through the GPU each step (all of it, or the largest
//! device share that fits). Each plan's host memory is counted apart and checked against the
//! host's RAM (`--host-ram`). Planning needs no GPU.

use std::path::Path;

mod common;

use common::{ava, json_of, ok, usage_error};

/// A copy of configs/gpu-llama2-7b.yaml (Llama-2-7B's shape: bf16 weights only, AdamW's f32
/// state, 50 GiB of it, the step inside backward, flash, every block recomputed) in `dir`.
fn seven_b(dir: &Path) -> String {
    let from = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/gpu-llama2-7b.yaml");
    std::fs::copy(from, dir.join("7b.yaml")).unwrap();
    "7b.yaml".into()
}

/// On a 24 GB card the 7B config fits only with its optimizer state streamed from host
/// memory: every plan proposed streams it, lists it as host memory apart from the device
/// peak, is one a GPU run accepts, and estimates as planned; the same settings with the
/// state on the device are over the budget. The split that keeps the most state on the
/// device ranks before all of it in host memory (as fast, fewer bytes over the link). Each plan's
/// step is predicted on the budget's card, its copies over that card's link.
#[test]
fn a_gpu_plan_streams_the_state_from_host_memory_where_the_device_cannot_hold_it() {
    let dir = tempfile::tempdir().unwrap();
    let config = seven_b(dir.path());
    let head = ["--budget", "rtx-4090-24gb", "--host-ram", "128GiB", "-c", &config];
    let args: Vec<&str> = ["--format", "json", "plan", "--top", "50"].iter().chain(&head).copied().collect();
    let plan = json_of(&ok(ava(dir.path(), &args)));
    assert_eq!(plan["device"], "cuda:0", "{plan}");
    assert_eq!(plan["host_ram"]["bytes"], 128u64 << 30, "{plan}");
    assert_eq!(plan["host_ram"]["from"], "--host-ram", "{plan}");
    let host_usable = plan["host_ram"]["usable"].as_u64().unwrap();
    assert_eq!(plan["card"]["name"], "rtx-4090-24gb", "{plan}");
    let link = plan["card"]["link_both_ways"].as_f64().unwrap();
    let aim = (plan["budget"].as_f64().unwrap() * 0.9) as u64;
    let configs = plan["configs"].as_array().unwrap();
    assert!(!configs.is_empty(), "{plan}");
    for c in configs {
        // Nothing a GPU run refuses: no Kahan compensation, no tier plugin; masters in a tier
        // stream with the state from host memory.
        assert!(["f32", "none", "tier"].contains(&c["master_weights"].as_str().unwrap()), "{c}");
        assert!(c["offload"].is_null() && c["offloaded_bytes"] == 0, "{c}");
        let tiers = c["offload_tiers"].as_str().unwrap();
        assert!(tiers.contains("ram: "), "{c}");
        assert!(
            tiers.trim_matches(['[', ']']).split(", ").all(|s| s.starts_with("device: ") || s.starts_with("ram: "))
        );
        // The state in host memory is host memory, apart from the device peak.
        let (host, pinned) = (c["host_memory"].as_u64().unwrap(), c["state_in_host_memory"].as_u64().unwrap());
        assert!(pinned > 40 << 30 && host >= pinned && host <= host_usable, "{c}");
        assert!(c["peak"].as_u64().unwrap() <= aim, "{c}");
        assert!(c["state"].as_str().unwrap().contains("ram (host, "), "{c}");
        let copies = &c["state_copies"];
        assert_eq!(copies["bytes_each_way"], pinned, "{c}");
        let seconds = copies["seconds"].as_f64().unwrap();
        assert!((seconds - 2.0 * pinned as f64 / link).abs() < 1e-9, "{c}");
        let exposed = copies["seconds_not_hidden"].as_f64().unwrap();
        assert!((0.0..=seconds).contains(&exposed), "{c}");
        // The predicted step: its terms add up, the exposed copies among them.
        let step = &c["predicted_step"];
        let terms = step["terms"].as_array().unwrap();
        let sum: f64 = terms.iter().map(|t| t["seconds"].as_f64().unwrap()).sum();
        assert!((sum - step["seconds"].as_f64().unwrap()).abs() < 1e-9, "{c}");
        assert!(terms.iter().any(|t| t["name"] == "state copies not hidden" && t["seconds"] == exposed), "{c}");
    }
    // Among the plans that recompute every block (equally fast but for the copies).
    let full = |c: &&serde_json::Value| c["checkpoint"] == "full" && c["master_weights"] == "none";
    let all_host = configs.iter().position(|c| full(&c) && c["offload_tiers"] == "[ram: 100%]").expect("all in host");
    let split = configs.iter().position(|c| full(&c) && c["offload_tiers"].as_str().unwrap().starts_with("[device: "));
    let split = split.expect("a plan keeping some of the state on the device");
    assert!(split < all_host, "{plan}");
    assert!(configs[split]["state_in_host_memory"].as_u64() < configs[all_host]["state_in_host_memory"].as_u64());

    // The best plan's settings estimate as planned (`ava estimate` refuses what a GPU run
    // refuses); with the state on the device instead they are over the budget.
    let best = &configs[0];
    let estimate = |tiers: Option<&str>| {
        let mut args = vec!["--format".to_string(), "json".into(), "estimate".into(), "-c".into(), config.clone()];
        for s in best["sets"].as_array().unwrap() {
            let s = s.as_str().unwrap();
            let s = match tiers {
                Some(t) if s.starts_with("offload.tiers=") => format!("offload.tiers={t}"),
                _ => s.to_string(),
            };
            args.extend(["--set".into(), s]);
        }
        json_of(&ok(ava(dir.path(), &args.iter().map(String::as_str).collect::<Vec<_>>())))
    };
    let as_planned = estimate(None);
    assert_eq!(as_planned["breakdown"]["peak"], best["peak"], "{as_planned}");
    let host: u64 = as_planned["host"].as_array().unwrap().iter().map(|t| t["bytes"].as_u64().unwrap()).sum();
    assert_eq!(host, best["host_memory"].as_u64().unwrap());
    let on_device = estimate(Some("[device: 100%]"));
    assert!(on_device["breakdown"]["peak"].as_u64().unwrap() > aim, "{on_device}");
    assert!(
        on_device["host"].as_array().unwrap().iter().all(|t| t["name"] != "optimizer state in page-locked host memory")
    );

    // The table: host memory in a column of its own, the state's place, the copies' model.
    let args: Vec<&str> = ["plan", "--top", "3"].iter().chain(&head).copied().collect();
    let text = String::from_utf8(ok(ava(dir.path(), &args)).stdout).unwrap();
    for needle in [
        "host RAM 115.20 GiB of 128.00 GiB (--host-ram",
        "state copies",
        "ram (host, ",
        "step time: predicted on rtx-4090-24gb",
        " tok/s (×",
    ] {
        assert!(text.contains(needle), "{needle:?} in\n{text}");
    }
    assert!(!text.contains("keeps its optimizer state in device memory in this version"), "{text}");
}

/// A host whose RAM cannot hold the streamed state: every plan that fits the device is
/// refused for it, and the error says so with the host memory the least of them needs.
#[test]
fn a_gpu_plan_over_the_hosts_ram_does_not_fit() {
    let dir = tempfile::tempdir().unwrap();
    let config = seven_b(dir.path());
    let args = ["plan", "--budget", "rtx-4090-24gb", "--host-ram", "32GiB", "-c", &config];
    let err = usage_error(ava(dir.path(), &args));
    assert!(err.contains("no configuration fits rtx-4090-24gb"), "{err}");
    // The smallest peak, and what dominates it: the 7B bf16 weights.
    assert!(err.contains("the smallest peak is 16.95 GiB ("), "{err}");
    assert!(err.contains("most of it parameters, 12.55 GiB (74%; the largest term: bf16 weights"), "{err}");
    assert!(err.contains("fit the device but not the host's RAM, 28.80 GiB of 32.00 GiB (--host-ram"), "{err}");
    assert!(err.contains("the least host memory is "), "{err}");
    assert!(err.contains("stream the optimizer state to disk (--offload nvme:/path)"), "a GPU run takes a tier: {err}");
    let err = usage_error(ava(dir.path(), &["plan", "--budget", "24GiB", "--host-ram", "lots", "-c", &config]));
    assert!(err.contains("--host-ram \"lots\" is not a size"), "{err}");
}

/// `--card` predicts the steps on another card (the same plans, the same peaks); a name that
/// is not a GPU preset is refused with the presets listed.
#[test]
fn a_gpu_plans_steps_are_predicted_on_the_card_named() {
    let dir = tempfile::tempdir().unwrap();
    let config = seven_b(dir.path());
    let plan = |card: &str| {
        let args =
            ["--format", "json", "plan", "--budget", "24GiB", "--host-ram", "128GiB", "--card", card, "-c", &config];
        json_of(&ok(ava(dir.path(), &args)))
    };
    let (h100, a100) = (plan("h100-80gb"), plan("a100-80gb"));
    assert_eq!(h100["card"]["name"], "h100-80gb");
    assert_eq!(a100["card"]["name"], "a100-80gb");
    let best = |p: &serde_json::Value| p["configs"][0].clone();
    assert_eq!(best(&h100)["peak"], best(&a100)["peak"]);
    let seconds = |p: &serde_json::Value| best(p)["predicted_step"]["seconds"].as_f64().unwrap();
    assert!(seconds(&a100) > 2.0 * seconds(&h100), "{} against {}", seconds(&a100), seconds(&h100));

    let args = ["plan", "--budget", "24GiB", "--card", "v100", "-c", &config];
    let err = usage_error(ava(dir.path(), &args));
    assert!(err.contains("--card \"v100\" is not a GPU preset: rtx-3060-12gb, "), "{err}");
    assert!(err.contains("h200-141gb"), "{err}");
}

/// `--offload nvme:PATH` on a GPU config adds plans that stream all of the optimizer state
/// (and with `master_weights: tier` the f32 masters) through the disk tier instead of host
/// memory: with too little host RAM for the state, only those fit; each keeps none of it in
/// host memory, predicts the disk's time, and its settings estimate as planned.
#[test]
fn a_gpu_plan_streams_the_state_through_a_disk_tier_with_offload() {
    let dir = tempfile::tempdir().unwrap();
    let tier = dir.path().join("tier");
    std::fs::create_dir(&tier).unwrap();
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/gpu-tinyllama-1b.yaml");
    let config = config.to_str().unwrap();
    // TinyLlama's vocabulary, a narrow two-block body: 38M parameters, 307 MB of AdamW state.
    let small = [
        "model.hidden_size=512",
        "model.intermediate_size=1408",
        "model.num_layers=2",
        "model.num_heads=8",
        "model.num_kv_heads=2",
        "data.seq_len=256",
    ];
    let offload = format!("nvme:{}", tier.display());
    let mut args =
        vec!["--format", "json", "plan", "--budget", "600MiB", "--host-ram", "256MiB", "--keep", "optimizer"];
    args.extend(["--offload", &offload, "--top", "50", "-c", config]);
    args.extend(small.iter().flat_map(|s| ["--set", s]));
    let plan = json_of(&ok(ava(dir.path(), &args)));
    let configs = plan["configs"].as_array().unwrap();
    assert!(!configs.is_empty(), "{plan}");
    for c in configs {
        assert_eq!(c["offload"]["tier"], "nvme", "{c}");
        assert!(c["offload_tiers"].is_null() && c["state_in_host_memory"] == 0, "{c}");
        let streamed = c["offloaded_bytes"].as_u64().unwrap();
        let state = if c["master_weights"] == "tier" { 400_000_000 } else { 300_000_000 };
        assert!(streamed > state, "{c}");
        let terms = c["predicted_step"]["terms"].as_array().unwrap();
        assert!(terms.iter().any(|t| t["name"] == "disk tier" && t["seconds"].as_f64().unwrap() > 0.0), "{c}");
    }
    // The best plan's settings: a GPU run's modes, estimated as planned.
    let mut args = vec!["--format".to_string(), "json".into(), "estimate".into(), "-c".into(), config.into()];
    for s in small
        .iter()
        .map(|s| s.to_string())
        .chain(configs[0]["sets"].as_array().unwrap().iter().map(|s| s.as_str().unwrap().to_string()))
    {
        args.extend(["--set".into(), s]);
    }
    let estimate = json_of(&ok(ava(dir.path(), &args.iter().map(String::as_str).collect::<Vec<_>>())));
    assert_eq!(estimate["breakdown"]["peak"], configs[0]["peak"], "{estimate}");
    assert_eq!(estimate["offloaded"], configs[0]["offloaded_bytes"], "{estimate}");
}
