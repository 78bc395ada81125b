//! Unit tests: the per-block formulas against the replay, the replay's own invariants.

use ava_core::BlockDecision;

use super::block::{Dims, block_terms};
use super::replay::{Replay, StepModel};
use super::sim::Dt;
use crate::model::{Arch, Biases, ModelSpec, MoeSpec};

fn spec(kv_heads: usize, moe: Option<MoeSpec>) -> ModelSpec {
    ModelSpec {
        arch: if moe.is_some() { Arch::Mixtral } else { Arch::Llama },
        eps: 1e-5,
        moe,
        ..ModelSpec::llama(97, 48, 3, 4, kv_heads, 80)
    }
}

/// The printed formulas add up to exactly what the replay of `Model::block` keeps, in f32
/// and in a half type (bf16 and f16 run the same ops), with the weights cast in the graph
/// from f32 masters or stored in the half type, and the kernel's saved buffer held in f32 or
/// (a kernel that tolerates it, in a half run) in the half type.
#[test]
fn block_formulas_sum_to_the_replayed_block() {
    let moe = MoeSpec { experts: 4, top_k: 2, aux_weight: 0.01 };
    // Every bias, and a head size apart from d / H (Mistral-Nemo-like).
    let biased = ModelSpec { bias: Biases { qkv: true, o: true, mlp: true }, head_dim: 20, ..spec(2, None) };
    let qkv_bias = ModelSpec { bias: Biases { qkv: true, o: false, mlp: false }, ..spec(1, None) };
    let stored = StepModel { stored_half: true, ..StepModel::default() };
    for s in [spec(4, None), spec(2, None), spec(1, None), spec(2, Some(moe)), biased, qkv_bias] {
        for (dt, p, step) in
            [(Dt::F32, 4, StepModel::default()), (Dt::Half, 2, StepModel::default()), (Dt::Half, 2, stored.clone())]
        {
            // On a GPU (the saved buffer is kept in f32 there, whatever the kernel tolerates).
            for (tolerates, gpu) in [(false, false), (true, false), (false, true)] {
                let (b, t) = (3, 10);
                let saved = (b * s.heads * t * t) as u64;
                let replay = Replay::new(&s, b, t, dt, saved);
                let replay = if gpu { replay.on_gpu() } else { replay };
                let replay = replay.with_saved_half(tolerates).with_step(step.clone());
                let replayed = replay.block_activation_bytes();
                let saved_size = if tolerates && dt == Dt::Half { 2 } else { 4 };
                let moe = s.moe.map(|m| (m.experts as u64, m.top_k as u64));
                let terms = block_terms(&Dims::new(&s, b, t, p), saved, saved_size, moe);
                let sum: u64 = terms.iter().map(|t| t.bytes).sum();
                let what =
                    format!("kv_heads {} moe {:?} {dt:?} {step:?} saved half {tolerates} gpu {gpu}", s.kv_heads, s.moe);
                assert_eq!(sum, replayed, "{what}: {terms:#?}");
            }
        }
    }
}

/// In a half type every kept activation is half the size it is in f32 (the ops keep no f32
/// copies), the kernel's saved buffer too when the kernel tolerates it; one it keeps in f32
/// stays f32.
#[test]
fn half_precision_halves_a_blocks_activations() {
    let s = spec(2, None);
    let (b, t) = (3, 10);
    let saved = (b * s.heads * t * t) as u64;
    let f32_bytes = Replay::new(&s, b, t, Dt::F32, saved).with_saved_half(true).block_activation_bytes();
    let half = Replay::new(&s, b, t, Dt::Half, saved).with_saved_half(true).block_activation_bytes();
    assert_eq!(2 * half, f32_bytes);
    let kept_f32 = Replay::new(&s, b, t, Dt::Half, saved).block_activation_bytes();
    assert_eq!(kept_f32, half + 2 * saved);
}

/// The half linear op's scratch (the weight's f32 copy, a step of rows, dW's accumulator) is
/// held only while a call runs: everything but the gradients is freed after a micro-batch,
/// and its peak stays below f32's.
#[test]
fn half_scratch_is_transient() {
    let s = spec(2, None);
    let saved = (2 * 4 * 16 * 16) as u64;
    let plan = [BlockDecision::Keep; 3];
    let half = Replay::new(&s, 2, 16, Dt::Half, saved);
    let before = half.meter().current();
    let peak_half = half.forward_backward(&plan, false).bytes;
    assert_eq!(half.meter().current(), before, "everything but the gradients is freed");
    let peak_f32 = Replay::new(&s, 2, 16, Dt::F32, saved).forward_backward(&plan, false).bytes;
    assert!(peak_half < peak_f32, "half {peak_half}, f32 {peak_f32}");
}

/// Everything the replayed micro-batch allocates is freed again except its gradients, and
/// recomputing every block keeps less than keeping them.
#[test]
fn replay_frees_all_but_the_gradients_and_recompute_saves_memory() {
    let s = spec(2, None);
    let n: u64 = s.params().iter().map(|d| d.numel() as u64).sum();
    let replay = Replay::new(&s, 2, 16, Dt::F32, (2 * 4 * 16 * 16) as u64);
    let before = replay.meter().current();
    let keep = replay.forward_backward(&[BlockDecision::Keep; 3], false);
    assert_eq!(replay.meter().current(), before, "the replay drops its gradients at the end");
    let full = replay.forward_backward(&[BlockDecision::Recompute; 3], false);
    assert!(full.bytes < keep.bytes, "{} vs {}", full.bytes, keep.bytes);
    assert!(keep.bytes >= 4 * n, "the gradients alone are 4·N");
}

/// A policy that refuses any budget under `threshold` and keeps every block otherwise: its
/// model over-predicts, as a budget-driven plugin's may.
struct Stubborn {
    threshold: u64,
}

impl ava_core::CheckpointPolicy for Stubborn {
    fn decide(
        &self,
        blocks: &[ava_core::BlockFacts],
        ctx: &ava_core::CheckpointContext,
    ) -> Result<Vec<BlockDecision>, ava_core::PluginError> {
        if ctx.budget_bytes < self.threshold {
            return Err(ava_core::PluginError::invalid_input(format!("{} is not enough", ctx.budget_bytes)));
        }
        Ok(vec![BlockDecision::Keep; blocks.len()])
    }
}

/// The budget handed to a policy is calibrated against the replay in both directions: a
/// policy that refuses what memory.budget leaves for activations, although its plan fits,
/// is given more; one whose plan does not fit at any budget is refused with the reason.
#[test]
fn the_policy_budget_is_raised_when_the_replay_shows_room() {
    let registry = ava_plugins::Registry::builtins();
    let (optimizer, attention) =
        (registry.optimizer("adamw", "{}").unwrap(), registry.attention("standard", "{}").unwrap());
    let config = |budget: u64| {
        crate::config::ConfigLoader::new()
            .sets([format!("memory.budget={budget}").as_str()])
            .load()
            .unwrap()
            .into_config()
    };
    let spec = ModelSpec::from_config(&config(0).model).unwrap();
    let keep_all = super::Plugins {
        optimizer: optimizer.as_ref(),
        attention: attention.as_ref(),
        checkpoint: &Stubborn { threshold: 0 },
    };
    let peak = super::estimate(&spec, &config(0), &keep_all).unwrap().breakdown.peak;
    // Room for the keep-all plan, with a 1 MiB margin; what it leaves for activations.
    let budget = peak + (1 << 20);
    let target = super::estimate(&spec, &config(budget), &keep_all).unwrap().activation_budget;
    let stubborn = Stubborn { threshold: target + (512 << 10) };
    let plugins = super::Plugins { checkpoint: &stubborn, ..keep_all };
    let est = super::estimate(&spec, &config(budget), &plugins).unwrap();
    assert_eq!(est.plan, vec![BlockDecision::Keep; spec.layers]);
    assert!(est.activation_budget >= stubborn.threshold, "{} < {}", est.activation_budget, stubborn.threshold);
    assert!(est.breakdown.peak <= budget);
    // Below the keep-all peak nothing fits: the policy's refusal, and why.
    let e = super::estimate(&spec, &config(peak - 1), &plugins).unwrap_err().to_string();
    assert!(e.contains("is not enough"), "{e}");
}

/// The estimate of the default config with `sets`, under the built-in adamw, standard
/// attention and no checkpointing.
fn estimate_with(sets: &[String]) -> super::Estimate {
    let checkpoint = ava_plugins::Registry::builtins().checkpoint("none", "{}").unwrap();
    estimate_planned(sets, checkpoint.as_ref())
}

/// [`estimate_with`] under the checkpoint policy `checkpoint`.
fn estimate_planned(sets: &[String], checkpoint: &dyn ava_core::CheckpointPolicy) -> super::Estimate {
    let registry = ava_plugins::Registry::builtins();
    let (optimizer, attention) =
        (registry.optimizer("adamw", "{}").unwrap(), registry.attention("standard", "{}").unwrap());
    let plugins = super::Plugins { optimizer: optimizer.as_ref(), attention: attention.as_ref(), checkpoint };
    let config = crate::config::ConfigLoader::new().sets(sets.iter().map(String::as_str)).load().unwrap().into_config();
    super::estimate(&ModelSpec::from_config(&config.model).unwrap(), &config, &plugins).unwrap()
}

/// Packed documents add their ids to the data component: B·T·4 per queued batch and
/// 3·B·T·4 for the batch in use (its ids, the step's ids and positions), nothing else.
#[test]
fn packed_documents_count_their_ids_as_data() {
    let estimate = |packing: &str| {
        let sets = [
            format!("data.packing={packing}"),
            "data.num_workers=2".into(),
            "data.prefetch_factor=3".into(),
            "train.micro_batch_size=4".into(),
            "data.seq_len=64".into(),
        ];
        estimate_with(&sets)
    };
    let data = |e: &super::Estimate| -> u64 {
        e.terms.iter().filter(|t| t.component == super::Component::Data).map(|t| t.bytes).sum()
    };
    let (concat, document) = (estimate("concat"), estimate("document"));
    let ids = 4 * 64 * 4; // B·T·4
    assert_eq!(data(&document) - data(&concat), 2 * 3 * ids + 3 * ids);
    assert_eq!(document.breakdown.peak - concat.breakdown.peak, 2 * 3 * ids + 3 * ids);
}

/// On a GPU the replay frees everything but the gradients too.
#[test]
fn a_gpu_replay_frees_all_but_the_gradients() {
    let s = spec(2, None);
    let gpu = Replay::new(&s, 2, 16, Dt::Half, (2 * 4 * 16) as u64).on_gpu();
    let before = gpu.meter().current();
    let keep = gpu.forward_backward(&[BlockDecision::Keep; 3], false);
    assert_eq!(gpu.meter().current(), before, "the replay drops its gradients at the end");
    let full = gpu.forward_backward(&[BlockDecision::Recompute; 3], false);
    assert!(full.bytes < keep.bytes, "{} vs {}", full.bytes, keep.bytes);
}

/// A GPU estimate counts device memory: the token ids on the device as its data, the rotary
/// tables' f32 device copy, no gemm slabs, logits read in their type; the host's loader
/// queue, batch and tables are listed apart and left out of the peak.
#[test]
fn a_gpu_estimate_lists_host_memory_apart() {
    let estimate = |device: &str| {
        // The logits whole (kept for backward), where the host's copy differs from the GPU's.
        let sets = [
            format!("train.device={device}"),
            "train.precision=bf16".into(),
            "train.micro_batch_size=2".into(),
            "train.loss_chunk_rows=0".into(),
        ];
        estimate_with(&sets)
    };
    let (cpu, gpu) = (estimate("cpu"), estimate("cuda:1"));
    let names = |e: &super::Estimate| e.terms.iter().map(|t| t.name.clone()).collect::<Vec<_>>();
    assert!(cpu.host.is_empty());
    assert!(names(&cpu).iter().any(|n| n.starts_with("matmul workspace")));
    assert!(!names(&gpu).iter().any(|n| n.starts_with("matmul workspace") || n.starts_with("loader queue")));
    let data: Vec<_> = gpu.terms.iter().filter(|t| t.component == super::Component::Data).collect();
    assert_eq!(data.len(), 1, "{data:#?}");
    assert_eq!(data[0].bytes, (gpu.batch * gpu.seq_len * 4) as u64);
    let host: Vec<&str> = gpu.host.iter().map(|t| t.name.as_str()).collect();
    assert!(host.iter().any(|n| n.starts_with("loader queue")), "{host:?}");
    assert!(host.iter().any(|n| n.starts_with("rotary tables (cos, sin in f32 and f64)")), "{host:?}");
    let head = |e: &super::Estimate| e.terms.iter().find(|t| t.name.starts_with("head:")).map(|t| t.formula.clone());
    assert!(head(&cpu).is_some_and(|f| f.contains("f32 logits")));
    assert!(head(&gpu).is_none_or(|f| !f.contains("f32 logits")));
    assert!(gpu.breakdown.peak < cpu.breakdown.peak, "{} vs {}", gpu.breakdown.peak, cpu.breakdown.peak);
    let b = &gpu.breakdown;
    assert_eq!(b.peak, b.params + b.grads + b.optimizer + b.data + b.activations, "host memory is not in the peak");
    let json = serde_json::to_value(&gpu).unwrap();
    assert_eq!(json["device"], "cuda:1");
    assert!(json["host"].as_array().is_some_and(|h| !h.is_empty()));
    assert!(gpu.render().contains("on cuda:1 (device memory)"));
    assert!(gpu.render().contains("host memory (not in the device peak)"));
}

/// `offload.tiers`' `ram` share on a GPU: that state is host memory (listed apart, out of the
/// device peak), and the device holds the rest plus what visits it (the next
/// `offload.prefetch` parameters' state and the one stepped before). On the CPU the same
/// shares are one memory: nothing streams.
#[test]
fn a_gpu_estimate_puts_the_ram_share_of_the_state_in_host_memory() {
    let estimate = |device: &str, tiers: &str| {
        estimate_with(&[format!("train.device={device}"), format!("offload.tiers={tiers}")])
    };
    let state = |e: &super::Estimate| e.breakdown.optimizer;
    let on_device = estimate("cuda", "[device: 100%]");
    let total = state(&on_device);
    let pinned = |e: &super::Estimate| {
        e.host.iter().find(|t| t.name == "optimizer state in page-locked host memory").map(|t| t.bytes)
    };
    assert_eq!(pinned(&on_device), None);
    for tiers in ["[device: 30%, ram: 70%]", "[ram: 100%]"] {
        let split = estimate("cuda", tiers);
        let host = pinned(&split).unwrap_or_else(|| panic!("{tiers}: no host term in {:#?}", split.host));
        let kept =
            split.terms.iter().find(|t| t.name.starts_with("state kept in device memory")).map_or(0, |t| t.bytes);
        assert_eq!(kept + host, total, "{tiers}: the state is kept on the device or homed on the host");
        let visiting = split.terms.iter().find(|t| t.name.starts_with("streamed state on the device")).expect(tiers);
        assert!(visiting.bytes > 0 && visiting.bytes < host, "{tiers}: {visiting:?}");
        assert!(state(&split) < total, "{tiers}: {} of device state, {total} kept whole", state(&split));
        assert!(split.breakdown.peak < on_device.breakdown.peak, "{tiers}");
        assert_eq!(split.offloaded, 0, "{tiers}: no tier records");
    }
    // On the CPU, `device` and `ram` are the same memory.
    let (cpu, cpu_split) = (estimate("cpu", "[device: 100%]"), estimate("cpu", "[device: 30%, ram: 70%]"));
    assert_eq!(cpu.breakdown, cpu_split.breakdown);
    // Through a tier on a GPU: the tier's read-ahead is host memory, not the device's.
    let disk = estimate("cuda", "[device: 30%, nvme: 70%]");
    let tier = "streamed state held by the tier (read ahead, written behind)";
    assert!(disk.host.iter().any(|t| t.name == tier), "{:#?}", disk.host);
    assert!(!disk.terms.iter().any(|t| t.name == tier));
    assert!(state(&disk) < total && disk.offloaded > 0);
    let on_cpu = estimate("cpu", "[device: 30%, nvme: 70%]");
    assert!(on_cpu.terms.iter().any(|t| t.name == tier) && on_cpu.host.is_empty());
}

/// The loss in blocks of rows (`train.loss_chunk_rows`): on the host and on a GPU, in f32 and
/// bf16, a micro-batch whose logits dominate peaks lower with the logits in blocks than
/// whole, lower again with smaller blocks (until the peak is elsewhere), and frees
/// everything but its gradients.
#[test]
fn the_loss_in_blocks_of_rows_lowers_the_peak() {
    // A vocabulary of 4096 on d 48: the logits (B·T·V) are 64 times a block's activations.
    let s = ModelSpec { vocab: 4096, ..spec(2, None) };
    let (b, t) = (4, 64); // 256 rows
    let saved = (b * s.heads * t * t) as u64;
    for (dt, gpu) in [(Dt::F32, false), (Dt::Half, false), (Dt::Half, true)] {
        let peak = |rows: usize| {
            let replay = Replay::new(&s, b, t, dt, saved);
            let replay = if gpu { replay.on_gpu() } else { replay };
            let replay = replay.with_loss_chunk_rows(rows);
            let before = replay.meter().current();
            let peak = replay.forward_backward(&[BlockDecision::Keep; 3], false);
            assert_eq!(replay.meter().current(), before, "{dt:?} gpu {gpu} rows {rows}: all but the gradients freed");
            peak.bytes
        };
        let (whole, one, four, sixteen) = (peak(0), peak(256), peak(64), peak(16));
        let what = format!("{dt:?} gpu {gpu}: whole {whole}, one block {one}, 64 rows {four}, 16 rows {sixteen}");
        println!("{what}");
        assert!(one < whole && four < one && sixteen <= four, "{what}");
        // The logits of 256 rows are 256·4096·p; in blocks of 16 the peak is lower by most
        // of two of them (the kept logits and their gradient), less the f32 dW sum.
        let p = if dt == Dt::F32 { 4 } else { 2 };
        let logits = 256 * 4096 * p;
        assert!(whole - sixteen > logits, "{what}");
    }
}

/// Every block's input parked (as `selective` with `offload: true` decides).
struct OffloadAll;

impl ava_core::CheckpointPolicy for OffloadAll {
    fn decide(
        &self,
        blocks: &[ava_core::BlockFacts],
        _: &ava_core::CheckpointContext,
    ) -> Result<Vec<BlockDecision>, ava_core::PluginError> {
        Ok(vec![BlockDecision::Offload; blocks.len()])
    }
}

/// On a GPU with `ram`, offloaded blocks' inputs are host memory (page-locked, one buffer
/// per block, listed apart) and the device holds of them only the one written back behind
/// the block computing in forward, and in backward the one uploaded ahead beside the one
/// being recomputed: its peak is below every block's input held (`full`). Through another
/// tier (int8) they are off the device too, not listed as host memory (they are the tier's).
/// On the CPU parking changes nothing: the tier is host memory counted with the rest.
#[test]
fn a_gpu_estimate_puts_parked_block_inputs_in_host_memory() {
    let full = ava_plugins::Registry::builtins().checkpoint("full", "{}").unwrap();
    let sets = |device: &str, tier: &str| {
        [
            format!("train.device={device}"),
            format!("plugins.offload={tier}"),
            "train.micro_batch_size=8".into(),
            "data.seq_len=256".into(),
            "train.precision=bf16".into(),
            "model.num_layers=6".into(),
            // The logits whole, large: the peak is the head's, after every block has parked.
            "model.vocab_size=8192".into(),
            "train.loss_chunk_rows=0".into(),
        ]
    };
    let inputs =
        |e: &super::Estimate| e.terms.iter().find(|t| t.name == "inputs of recomputed blocks").map_or(0, |t| t.bytes);
    let host = |e: &super::Estimate| {
        e.host.iter().find(|t| t.name == "inputs of offloaded blocks in page-locked host memory").map(|t| t.bytes)
    };
    let held = estimate_planned(&sets("cuda", "ram"), full.as_ref());
    let parked = estimate_planned(&sets("cuda", "ram"), &OffloadAll);
    assert!(parked.plan.iter().all(|d| *d == BlockDecision::Offload), "{:?}", parked.plan);
    let one = held.block_facts[0].input_bytes; // (B, T, d) bf16
    assert_eq!(host(&parked), Some(6 * one), "one buffer per block: {:#?}", parked.host);
    assert_eq!(host(&held), None, "nothing parked, nothing listed");
    // The peak is the head's backward. `full` holds every block's input there; parked, only
    // the last block's is on the device, uploaded ahead (block 0's input is the embedding's
    // Var, counted with the embedding; the other five are the Vars blocks 0..=4's outputs
    // became, in the inputs term with the Var the head's stretch starts from).
    assert!(held.peak_at.starts_with("backward: loss, head") && parked.peak_at == held.peak_at, "{}", parked.peak_at);
    assert_eq!(inputs(&held), inputs(&parked) + 4 * one);
    assert_eq!(held.micro_batch_peak, parked.micro_batch_peak + 5 * one);
    assert_eq!(held.breakdown.peak, parked.breakdown.peak + 5 * one);

    // Through int8 nothing is uploaded ahead: all six are off the device at the head.
    let int8 = estimate_planned(&sets("cuda", "int8"), &OffloadAll);
    assert_eq!(host(&int8), None, "the tier's memory is its own");
    assert_eq!(held.micro_batch_peak, int8.micro_batch_peak + 6 * one);

    let cpu = estimate_planned(&sets("cpu", "ram"), &OffloadAll);
    assert!(cpu.host.is_empty());
    assert_eq!(cpu.breakdown, estimate_planned(&sets("cpu", "ram"), full.as_ref()).breakdown);
}
