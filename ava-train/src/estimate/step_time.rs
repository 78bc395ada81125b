//! A GPU step's time, predicted from the config and its memory estimate, for `ava plan` to
//! rank plans by and `ava bench train` to hold against what it measures.
//!
//! A roofline per kind of work, each at a share of the card's datasheet peak that was
//! measured on a GPU (the constants below say where):
//! - **matmuls**: 2 FLOPs per matmul parameter and token forward, 4 backward, 2 more for each
//!   recomputed block, at the card's dense bf16 (or fp32) tensor rate times
//!   [`MATMUL_EFFICIENCY`];
//! - **attention**: the causal half of the scores and weighted sum, `2·T·H·D` FLOPs a token
//!   and block forward (the window's length for a sliding window), 2.5× that backward, at the
//!   kernel's own measured rate ([`attention_efficiency`]);
//! - **the memory-bound ops** around them (norms, rotary, SwiGLU, casts, residual adds, the
//!   loss): effective bytes per token, block and channel of width `d + F`, forward and
//!   backward, at the card's memory bandwidth ([`ELEMENTWISE_BYTES`]);
//! - **recomputation's own cost** beyond the forward it repeats ([`RECOMPUTE_BYTES`]);
//! - **the optimizer step and gradient bookkeeping**: the bytes each parameter's step reads
//!   and writes (state, weights, masters, gradient, its norm), at [`STEP_EFFICIENCY`] of the
//!   bandwidth;
//! - **copies**: the optimizer state streamed from page-locked host memory, up and back once a
//!   step over the link, hidden behind backward when the step runs inside it and behind the
//!   other parameters' steps when it runs after; a disk tier's reads and writes; the parked
//!   inputs of `offload` blocks, each hidden behind a block's compute.
//!
//! The efficiencies are one card's (an H200, the engine as it stood in session 41; see each
//! constant) and are assumed to carry to other cards as shares of their peaks, which is the
//! model's main approximation. `ava bench train` on a GPU prints this prediction beside the
//! measured step, so each run on a device says how far off it is.

use ava_core::BlockDecision;
use serde::Serialize;

use super::Estimate;
use crate::config::{Config, MasterWeights, Precision};
use crate::model::ModelSpec;

/// A GPU's datasheet figures the model scales its measured efficiencies by.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Card {
    /// The `--budget` preset's name, e.g. `h100-80gb`.
    pub name: &'static str,
    /// Device memory in bytes.
    pub memory: u64,
    /// Dense bf16/f16 tensor-core FLOP/s with f32 accumulation (what cuBLAS runs for candle).
    pub half_flops: f64,
    /// fp32 FLOP/s (no TF32: candle's f32 matmuls keep full precision).
    pub f32_flops: f64,
    /// Device memory bandwidth in bytes per second.
    pub bandwidth: f64,
    /// Page-locked host→device copies alone, bytes per second.
    pub link_one_way: f64,
    /// Copies both ways at once on two streams, bytes per second together.
    pub link_both_ways: f64,
    /// Where the link figures come from.
    pub link_from: &'static str,
}

/// The measured link of the H100 machine (PCIe 5.0 x16): pinned 2 GiB buffers, 55.1 GB/s
/// host→device, 90.7 GB/s both ways at once on two streams; PyTorch, ../shared/gpu/README.md,
/// 2026-11-25.
const PCIE5: (f64, f64, &str) = (55.1e9, 90.7e9, "measured on an H100 machine's PCIe 5.0 link");

/// PCIe 4.0 x16: half of [`PCIE5`]'s figures, not measured.
const PCIE4: (f64, f64, &str) = (27.5e9, 45.3e9, "PCIe 4.0 x16, half the measured PCIe 5.0 figures");

/// The GPUs `ava plan --budget` names, with their datasheets' dense peaks (NVIDIA's SXM
/// figures for the data-center cards; the GeForce cards' bf16 rate with f32 accumulation,
/// half their f16-accumulation rate).
pub const CARDS: &[Card] = &[
    card("rtx-3060-12gb", 12, 25.6e12, 12.7e12, 360e9, PCIE4),
    card("rtx-4090-24gb", 24, 165.2e12, 82.6e12, 1008e9, PCIE4),
    card("a100-40gb", 40, 312e12, 19.5e12, 1555e9, PCIE4),
    card("a100-80gb", 80, 312e12, 19.5e12, 2039e9, PCIE4),
    card("h100-80gb", 80, 989e12, 67e12, 3350e9, PCIE5),
    card("h200-141gb", 140, 989e12, 67e12, 4800e9, PCIE5),
];

const fn card(
    name: &'static str,
    gib: u64,
    half_flops: f64,
    f32_flops: f64,
    bandwidth: f64,
    link: (f64, f64, &'static str),
) -> Card {
    Card {
        name,
        memory: gib << 30,
        half_flops,
        f32_flops,
        bandwidth,
        link_one_way: link.0,
        link_both_ways: link.1,
        link_from: link.2,
    }
}

impl Card {
    /// The preset named `name`.
    pub fn named(name: &str) -> Option<&'static Card> {
        CARDS.iter().find(|c| c.name == name)
    }

    /// The preset a CUDA device's name (`cuDeviceGetName`, e.g. `NVIDIA H200`) and memory
    /// are, when one is.
    pub fn recognize(device_name: &str, memory: u64) -> Option<&'static Card> {
        let name = device_name.to_ascii_uppercase();
        let preset = if name.contains("H200") {
            "h200-141gb"
        } else if name.contains("H100") {
            "h100-80gb"
        } else if name.contains("A100") {
            if memory > 48 << 30 { "a100-80gb" } else { "a100-40gb" }
        } else if name.contains("4090") {
            "rtx-4090-24gb"
        } else if name.contains("3060") {
            "rtx-3060-12gb"
        } else {
            return None;
        };
        Card::named(preset)
    }
}

/// The share of the card's dense peak the model's matmuls run at: candle's 8192³ bf16
/// matmul measured 722 TFLOP/s on the H200 (989 peak), `ava bench train`, session 41.
pub const MATMUL_EFFICIENCY: f64 = 0.73;

/// The share of the card's peak an attention kernel runs at, (forward, backward). `flash`:
/// its forward took 26 ms and its backward 104 ms a step of TinyLlama-1.1B's shape (T 2048 ×
/// 4, 1.51 TFLOP forward), 58 and 36 TFLOP/s, in the H200 profile of session 41 (`ava bench
/// train -c configs/gpu-tinyllama-1b.yaml`); at T = 32K, `ava bench attention` gave 73 and 33.
/// `standard` materializes the T×T scores: the same run took 7.6 s a step with it, about
/// 0.75 TFLOP/s for its attention. Another kernel is predicted as `standard`.
pub fn attention_efficiency(kernel: &str) -> (f64, f64) {
    match kernel {
        "flash" => (0.059, 0.037),
        _ => (0.00076, 0.00076),
    }
}

/// Effective bytes the memory-bound ops move per token, block and channel of `d + F`, in
/// bf16, (forward, backward): the rest of the H200's measured 420.7 ms step once the
/// matmuls (70.4 ms at [`MATMUL_EFFICIENCY`]), attention (130 ms) and the optimizer (28 ms)
/// are taken out, 192 ms, split as the profile split it (forward 11.75%), over 8192 tokens ×
/// 22 blocks × 7680 channels at 4.8 TB/s. They count the ops' inefficiency (launches, casts
/// through f32) with their bytes; fp32 doubles them.
pub const ELEMENTWISE_BYTES: (f64, f64) = (78.4, 588.5);

/// Effective bytes per token, recomputed block and channel that recomputation cost beyond
/// the forward it repeats: with full checkpointing the H200 step took 823.8 ms, 332.5 ms more
/// than the kept step plus one forward of every block (session 41). Where that time went was
/// not profiled; the model carries it as measured. Part of it was each stretch's surrogate
/// root, a whole-tensor sum candle runs in one block (3–6 ms a stretch, 22 stretches), which
/// `fused::seed` has replaced since: refit from the next measurement.
pub const RECOMPUTE_BYTES: f64 = 1153.0;

/// The share of the bandwidth the optimizer step and the gradients' norm reach: AdamW with
/// f32 masters stepped TinyLlama-1.1B's 1.1 B parameters in 24 ms plus 4 ms for the norm on
/// the H200, 34 bytes a parameter (37.4 GB, 7.8 ms at 4.8 TB/s) (session 41).
pub const STEP_EFFICIENCY: f64 = 0.278;

/// Seconds a GPU step waits on a disk tier per byte it streams, [inside backward, after it]:
/// the CPU engine's measured waits on the nvme tier (README, `ava bench train --modes
/// --offload`), since the disk bounds both engines; not measured on a GPU.
const TIER_WAIT_PER_BYTE: [f64; 2] = [1.0e-9, 2.0e-9];

/// A disk tier's records reach the device through pageable memory: 17.6 GB/s host→device,
/// 13.3 back (PyTorch on the H100 machine, ../shared/gpu/README.md).
const PAGEABLE_BYTES_PER_S: f64 = 15.4e9;

/// The term of the streamed state's copies that compute does not hide.
pub const STATE_COPIES_EXPOSED: &str = "state copies not hidden";

/// One term of the prediction.
#[derive(Debug, Clone, Serialize)]
pub struct TimeTerm {
    /// e.g. `matmuls`.
    pub name: &'static str,
    /// Seconds a step.
    pub seconds: f64,
}

/// A predicted GPU step.
#[derive(Debug, Clone, Serialize)]
pub struct StepTime {
    /// The card predicted for.
    pub card: &'static str,
    /// What the step's seconds are made of (compute first, then the copies' exposed part).
    pub terms: Vec<TimeTerm>,
    /// The step's seconds, the terms summed.
    pub seconds: f64,
    /// Tokens a second: the step's tokens over its seconds.
    pub tokens_per_sec: f64,
    /// The state streamed from page-locked host memory: its copies' own seconds a step (the
    /// exposed part is a term); `None` when none streams.
    pub state_copies: Option<f64>,
}

/// The step time of `config` on `card`, from `est` (the config's estimate on a GPU).
pub fn predict(spec: &ModelSpec, config: &Config, est: &Estimate, card: &Card) -> StepTime {
    let w = Work::new(spec, est);
    let half = est.precision != Precision::Fp32;
    let flops = if half { card.half_flops } else { card.f32_flops };
    let bytes_scale = if half { 1.0 } else { 2.0 };
    let micro = est.accumulation as f64;

    let matmuls = micro * w.matmul_flops() / (flops * MATMUL_EFFICIENCY);
    let (fwd_eff, bwd_eff) = attention_efficiency(&config.plugins.attention.name);
    let (fwd, bwd) = w.attention_flops();
    let attention = micro * (fwd * (1.0 + w.recomputed_share()) / fwd_eff + bwd / bwd_eff) / flops;
    let channels = w.channel_tokens() * bytes_scale / card.bandwidth;
    let elementwise = micro * channels * (ELEMENTWISE_BYTES.0 * (1.0 + w.recomputed_share()) + ELEMENTWISE_BYTES.1);
    let recompute = micro * channels * RECOMPUTE_BYTES * w.recomputed_share();
    let step = step_bytes(config, est) / (card.bandwidth * STEP_EFFICIENCY);
    let compute = matmuls + attention + elementwise + recompute;

    let mut terms = vec![
        TimeTerm { name: "matmuls", seconds: matmuls },
        TimeTerm { name: "attention", seconds: attention },
        TimeTerm { name: "memory-bound ops", seconds: elementwise },
        TimeTerm { name: "recomputation's own cost", seconds: recompute },
        TimeTerm { name: "optimizer step and gradients", seconds: step },
    ];
    let pinned = est.pinned_state_bytes();
    let state_copies = (pinned > 0).then(|| 2.0 * pinned as f64 / card.link_both_ways);
    if let Some(copies) = state_copies {
        // Inside backward the uploads run ahead of the gradients (from the backward's start),
        // so backward and the steps hide them; after it, only the other parameters' steps do.
        let behind = if config.train.step_in_backward { compute * BACKWARD_SHARE + step } else { step };
        terms.push(TimeTerm { name: STATE_COPIES_EXPOSED, seconds: (copies - behind).max(0.0) });
    }
    if est.offloaded > 0 {
        let moved = 2.0 * est.offloaded as f64;
        let wait = moved * TIER_WAIT_PER_BYTE[usize::from(!config.train.step_in_backward)];
        terms.push(TimeTerm { name: "disk tier", seconds: wait + moved / PAGEABLE_BYTES_PER_S });
    }
    if let Some(parked) = w.parked_exposed(card, compute / micro).filter(|s| *s > 0.0) {
        terms.push(TimeTerm { name: "parked inputs not hidden", seconds: micro * parked });
    }
    let seconds: f64 = terms.iter().map(|t| t.seconds).sum();
    let tokens = (est.batch * est.seq_len * est.accumulation) as f64;
    StepTime { card: card.name, terms, seconds, tokens_per_sec: tokens / seconds, state_copies }
}

/// The share of a micro-step's compute that is backward (and recomputation): 2 of every 3
/// matmul FLOPs, more for the rest; the copies of state streamed inside backward hide behind it.
const BACKWARD_SHARE: f64 = 0.7;

/// The bytes a step's optimizer update and gradient handling read and write: each
/// parameter's gradient (read, and read again for the norm), its weights as stored, its
/// masters and the engine's buffers with the state (read and written), and with gradient
/// accumulation the f32 accumulators (read, added, written) every micro-step.
fn step_bytes(config: &Config, est: &Estimate) -> f64 {
    let n = est.num_params as f64;
    let stored = if est.precision == Precision::Fp32 { 4.0 } else { 2.0 };
    // Weights: f32 masters read and written beside the stored copy written; without masters
    // the stored weights widened into f32, stepped there and rounded back; in a tier, the
    // masters are state (counted there) and the stored copy is written from them.
    let weights = match config.train.master_weights {
        _ if est.precision == Precision::Fp32 => 8.0,
        MasterWeights::F32 => 8.0 + stored,
        MasterWeights::Tier => stored + 4.0,
        MasterWeights::None | MasterWeights::Kahan => 2.0 * stored + 16.0,
    };
    let gradient = 4.0 + 4.0;
    let accumulators = if est.accumulation > 1 { 12.0 * est.accumulation as f64 } else { 0.0 };
    n * (weights + gradient + accumulators) + 2.0 * est.state_bytes as f64
}

/// The work one micro-step does, from the model's sizes and the estimate's plan.
struct Work {
    /// Tokens a micro-step, B·T.
    tokens: f64,
    /// Matmul parameters a token visits: the blocks', and the head's.
    block_matmul: f64,
    head_matmul: f64,
    /// Blocks L, and those the plan recomputes.
    blocks: f64,
    recomputed: f64,
    /// Attention's forward FLOPs per token and block: `2·Tₐ·H·D`, with Tₐ the positions a
    /// query sees at most (T, or the sliding window).
    attention_per_token: f64,
    /// `d + F`, the channels the memory-bound ops scale with.
    channels: f64,
    /// The inputs of blocks parked off the device, bytes each, and how many.
    parked: (f64, f64),
}

impl Work {
    fn new(spec: &ModelSpec, est: &Estimate) -> Self {
        let head = (spec.vocab * spec.hidden) as f64;
        let seen = spec.sliding_window.map_or(est.seq_len, |w| w.min(est.seq_len)) as f64;
        let recomputed = est.plan.iter().filter(|d| d.is_recomputed()).count() as f64;
        let parked: Vec<u64> = est
            .plan
            .iter()
            .zip(&est.block_facts)
            .filter(|(d, _)| **d == BlockDecision::Offload)
            .map(|(_, f)| f.input_bytes)
            .collect();
        Self {
            tokens: (est.batch * est.seq_len) as f64,
            block_matmul: spec.matmul_params_per_token() as f64 - head,
            head_matmul: head,
            blocks: spec.layers as f64,
            recomputed,
            attention_per_token: 2.0 * seen * (spec.heads * spec.head_dim) as f64,
            channels: (spec.hidden + spec.ffn) as f64,
            parked: (parked.first().copied().unwrap_or(0) as f64, parked.len() as f64),
        }
    }

    /// The share of blocks recomputed.
    fn recomputed_share(&self) -> f64 {
        if self.blocks > 0.0 { self.recomputed / self.blocks } else { 0.0 }
    }

    /// Forward, backward (twice the forward) and the recomputed blocks' forward again.
    fn matmul_flops(&self) -> f64 {
        let forward = 2.0 * self.tokens * (self.block_matmul + self.head_matmul);
        3.0 * forward + 2.0 * self.tokens * self.block_matmul * self.recomputed_share()
    }

    /// Attention's (forward, backward) FLOPs over every block, backward at 2.5× the forward
    /// (five products of the tile against the forward's two, as FlashAttention-2 counts).
    fn attention_flops(&self) -> (f64, f64) {
        let forward = self.tokens * self.blocks * self.attention_per_token;
        (forward, 2.5 * forward)
    }

    /// Tokens × blocks × channels, what the memory-bound ops' bytes scale with.
    fn channel_tokens(&self) -> f64 {
        self.tokens * self.blocks * self.channels
    }

    /// Seconds a micro-step waits for parked inputs: each written to host memory in forward
    /// and uploaded ahead of its recompute, hidden behind one block's share of the compute.
    fn parked_exposed(&self, card: &Card, compute: f64) -> Option<f64> {
        let (bytes, count) = self.parked;
        (count > 0.0).then(|| {
            let per_block = compute / self.blocks.max(1.0);
            2.0 * count * (bytes / card.link_one_way - per_block).max(0.0)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ConfigLoader;

    /// configs/tiny.yaml's model on a GPU with `sets`, its estimate under the built-in adamw,
    /// standard attention and `checkpoint`, predicted on `card`.
    fn predicted(sets: &[&str], checkpoint: &str, card: &str) -> StepTime {
        let registry = ava_plugins::Registry::builtins();
        let optimizer = registry.optimizer("adamw", "{}").unwrap();
        let attention = registry.attention("standard", "{}").unwrap();
        let checkpoint = registry.checkpoint(checkpoint, "{}").unwrap();
        let plugins = super::super::Plugins {
            optimizer: optimizer.as_ref(),
            attention: attention.as_ref(),
            checkpoint: checkpoint.as_ref(),
        };
        let base = ["train.device=cuda", "train.precision=bf16", "train.micro_batch_size=4", "data.seq_len=256"];
        let config = ConfigLoader::new().sets(base.iter().chain(sets).copied()).load().unwrap().into_config();
        let spec = ModelSpec::from_config(&config.model).unwrap();
        let est = super::super::estimate(&spec, &config, &plugins).unwrap();
        predict(&spec, &config, &est, Card::named(card).unwrap())
    }

    fn term(t: &StepTime, name: &str) -> f64 {
        t.terms.iter().find(|x| x.name == name).map_or(0.0, |x| x.seconds)
    }

    #[test]
    fn a_device_name_is_recognized_as_its_preset() {
        let named = |n: &str, gib: u64| Card::recognize(n, gib << 30).map(|c| c.name);
        assert_eq!(named("NVIDIA H200", 140), Some("h200-141gb"));
        assert_eq!(named("NVIDIA H100 80GB HBM3", 80), Some("h100-80gb"));
        assert_eq!(named("NVIDIA A100-SXM4-40GB", 40), Some("a100-40gb"));
        assert_eq!(named("NVIDIA A100-SXM4-80GB", 80), Some("a100-80gb"));
        assert_eq!(named("NVIDIA GeForce RTX 4090", 24), Some("rtx-4090-24gb"));
        assert_eq!(named("Tesla T4", 16), None);
    }

    #[test]
    fn the_terms_add_up_to_the_step_and_its_tokens() {
        let t = predicted(&[], "none", "h100-80gb");
        let sum: f64 = t.terms.iter().map(|x| x.seconds).sum();
        assert!((sum - t.seconds).abs() < 1e-12);
        assert!((t.tokens_per_sec - 4.0 * 256.0 / t.seconds).abs() < 1e-6);
        assert_eq!(term(&t, "recomputation's own cost"), 0.0);
        assert!(t.state_copies.is_none());
    }

    #[test]
    fn recomputing_fp32_accumulating_and_slower_cards_cost_time() {
        let kept = predicted(&[], "none", "h100-80gb");
        let full = predicted(&[], "full", "h100-80gb");
        assert!(full.seconds > kept.seconds && term(&full, "matmuls") > term(&kept, "matmuls"));
        assert!(term(&full, "recomputation's own cost") > 0.0);
        let fp32 = predicted(&["train.precision=fp32"], "none", "h100-80gb");
        assert!(term(&fp32, "matmuls") > 10.0 * term(&kept, "matmuls"), "fp32 runs off the tensor cores");
        // Twice the micro-steps of half the sequences: the same tokens, the accumulators' traffic more.
        let split =
            predicted(&["train.micro_batch_size=2", "train.gradient_accumulation_steps=2"], "none", "h100-80gb");
        assert!((term(&split, "matmuls") - term(&kept, "matmuls")).abs() < 1e-12);
        assert!(term(&split, "optimizer step and gradients") > term(&kept, "optimizer step and gradients"));
        let slower = predicted(&[], "none", "rtx-4090-24gb");
        assert!(slower.seconds > kept.seconds);
    }

    #[test]
    fn streamed_state_is_hidden_inside_backward_and_waited_for_after_it() {
        let host = ["offload.tiers=[ram: 100%]", "train.grad_clip=0"];
        let after = predicted(&host, "none", "rtx-3060-12gb");
        let inside = predicted(&[host[0], host[1], "train.step_in_backward=true"], "none", "rtx-3060-12gb");
        let copies = after.state_copies.expect("the state streams");
        assert_eq!(inside.state_copies, Some(copies));
        let step = term(&after, "optimizer step and gradients");
        assert!((term(&after, STATE_COPIES_EXPOSED) - (copies - step).max(0.0)).abs() < 1e-12);
        assert!(term(&inside, STATE_COPIES_EXPOSED) < term(&after, STATE_COPIES_EXPOSED));
    }
}
