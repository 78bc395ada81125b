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
/// device ranks before all of it in host memory (fewer bytes over the link).
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
    let aim = (plan["budget"].as_f64().unwrap() * 0.9) as u64;
    let configs = plan["configs"].as_array().unwrap();
    assert!(!configs.is_empty(), "{plan}");
    for c in configs {
        // Nothing a GPU run refuses: no host-side masters, no tier plugin.
        assert!(["f32", "none"].contains(&c["master_weights"].as_str().unwrap()), "{c}");
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
        assert!((seconds - 2.0 * pinned as f64 / 90.7e9).abs() < 1e-9, "{c}");
        assert!(copies["model"].as_str().unwrap().contains("not yet calibrated"), "{c}");
    }
    let all_host = configs.iter().position(|c| c["offload_tiers"] == "[ram: 100%]").expect("an all-host plan");
    let split = configs.iter().position(|c| c["offload_tiers"].as_str().unwrap().starts_with("[device: "));
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
    for needle in ["host RAM 115.20 GiB of 128.00 GiB (--host-ram", "state copies", "ram (host, ", "not yet calibrated"]
    {
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
    assert!(err.contains("fit the device but not the host's RAM, 28.80 GiB of 32.00 GiB (--host-ram"), "{err}");
    assert!(err.contains("the least host memory is "), "{err}");
    assert!(!err.contains("--offload nvme"), "a GPU run takes no tier plugin: {err}");
    let err = usage_error(ava(dir.path(), &["plan", "--budget", "24GiB", "--host-ram", "lots", "-c", &config]));
    assert!(err.contains("--host-ram \"lots\" is not a size"), "{err}");
}
