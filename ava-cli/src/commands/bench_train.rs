//! `ava bench train`: training throughput on a config. Measures tokens/s over a number of
//! steps after a warmup, converts to model FLOP/s (6·N_matmul + 6·L·d·T per token: the causal
//! half of attention), and compares with the best f32 matmul rate this machine shows between
//! the steps, candle's or the engine's linear op (MFU). Also
//! prints the memory breakdown of the last step and where step time went. With `--modes`,
//! the same model in each memory mode side by side: peak, parts, step time, and the tier's
//! traffic and the time the step waited on it.

use std::time::Instant;

use ava_train::memory::size;
use ava_train::model::fused::linear;
use ava_train::profile;
use ava_train::train::{TrainOptions, Trainer};
use candle_core::{Device, Tensor};
use serde_json::json;

use crate::{CmdResult, Failure, cli::ConfigArgs, context, output::Printer};

use super::offload_arg::OffloadArg;
use super::train::{failure, set_threads};

/// The two matmul rates the bench compares against, sampled between the measured steps so
/// they see the same machine as the steps do (on a shared 2-core VM the rate swings by
/// 2× from one minute to the next; a rate measured once says little about the steps). The
/// operands live only during a sample, so the step's memory breakdown does not see them.
struct MatmulProbe {
    threads: usize,
    candle: Vec<f64>,
    engine: Vec<f64>,
}

impl MatmulProbe {
    const N: usize = 1024;

    fn new(threads: usize) -> Result<Self, candle_core::Error> {
        let mut probe = Self { threads, candle: Vec::new(), engine: Vec::new() };
        probe.sample()?; // warm up both paths
        probe.candle.clear();
        probe.engine.clear();
        Ok(probe)
    }

    /// One GFLOP/s sample of candle's matmul and of the engine's linear op (rows split
    /// over the threads), n×n×n each.
    fn sample(&mut self) -> Result<(), candle_core::Error> {
        let n = Self::N;
        let a = Tensor::randn(0f32, 1.0, (n, n), &Device::Cpu)?; // (n, n)
        let b = Tensor::randn(0f32, 1.0, (n, n), &Device::Cpu)?; // (n, n)
        let flops = 2.0 * (n as f64).powi(3);
        let start = Instant::now();
        drop(a.matmul(&b)?);
        self.candle.push(flops / start.elapsed().as_secs_f64() / 1e9);
        let start = Instant::now();
        drop(linear(&a, &b, self.threads)?);
        self.engine.push(flops / start.elapsed().as_secs_f64() / 1e9);
        Ok(())
    }
}

/// What the binary's element-wise code was compiled for, beside what the CPU has: half
/// precision is slower than it need be when the two differ.
fn isa_line(isa: profile::VectorIsa) -> String {
    let gap = if isa.built == isa.cpu {
        String::new()
    } else {
        format!(" — this CPU has {}: build with the repository's .cargo/config.toml (target-cpu=native)", isa.cpu)
    };
    format!("vector code        built for {}{gap}", isa.built)
}

/// The median of some samples.
fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() { f64::NAN } else { v[v.len() / 2] }
}

pub fn run(p: &Printer, args: &ConfigArgs, steps: u64, warmup: u64) -> CmdResult {
    if steps == 0 {
        return Err(Failure::Usage(anyhow::anyhow!("--steps must be at least 1")));
    }
    let ctx = context::load_checked(args, p)?;
    let mut config = context::load_config(args, p)?.into_config();
    // The benchmark writes nothing: its run directory is a temporary one.
    let tmp = tempfile::tempdir()?;
    config.train.out_dir = tmp.path().to_path_buf();
    config.train.max_steps = config.train.max_steps.max(warmup + steps);
    set_threads(config.train.threads);
    let mut trainer = Trainer::new(&config, &ctx.registry, &TrainOptions::default()).map_err(failure)?;
    let header = trainer.header();
    p.note(&format!(
        "bench: {:.2}M parameters, {} tokens/step, {} threads, {} warmup + {} measured steps",
        header.params as f64 / 1e6,
        header.tokens_per_step,
        header.threads,
        warmup,
        steps
    ));
    for _ in 0..warmup {
        trainer.train_step().map_err(failure)?;
    }
    let mut probe = MatmulProbe::new(header.threads)?;
    profile::reset();
    let mut seconds = 0.0;
    let mut step_times = Vec::new();
    let mut last = None;
    for _ in 0..steps {
        profile::enable(true);
        let start = Instant::now();
        last = Some(trainer.train_step().map_err(failure)?);
        let t = start.elapsed().as_secs_f64();
        profile::enable(false);
        seconds += t;
        step_times.push(t);
        probe.sample()?;
    }
    let last = last.expect("at least one step");

    let tokens_per_sec = (header.tokens_per_step as u64 * steps) as f64 / seconds;
    let flops_per_token = trainer.model().spec().train_flops_per_token(config.data.seq_len);
    let model_gflops = tokens_per_sec * flops_per_token / 1e9;
    let matmul = median(&probe.candle);
    let engine_matmul = median(&probe.engine);
    // The engine's linear op splits rows over the threads and outruns candle's matmul on
    // this machine (README): the MFU is against the faster, so it cannot pass 100% by the
    // engine beating its own yardstick.
    let peak = matmul.max(engine_matmul);
    let fastest = step_times.iter().copied().fold(f64::INFINITY, f64::min);
    let slowest = step_times.iter().copied().fold(0.0, f64::max);
    let step_seconds = seconds / steps as f64;
    let ops: Vec<(String, f64, f64)> = profile::totals()
        .into_iter()
        .map(|(name, d, _)| (name.to_string(), d.as_secs_f64() / steps as f64, d.as_secs_f64() / seconds))
        .collect();
    let m = &last.memory;
    let isa = profile::vector_isa();
    let text = || {
        let mut lines = vec![
            format!("tokens/s           {tokens_per_sec:.0}"),
            format!(
                "step time          {:.1} ms (fastest {:.1}, slowest {:.1})",
                1e3 * step_seconds,
                1e3 * fastest,
                1e3 * slowest
            ),
            format!(
                "model FLOPs/token  {:.1} M (6·N_matmul + 6·L·d·T, attention's causal half)",
                flops_per_token / 1e6
            ),
            format!("model GFLOP/s      {model_gflops:.1}"),
            format!("candle f32 matmul  {matmul:.1} GFLOP/s (1024³, median of samples between the steps)"),
            format!(
                "engine linear op   {engine_matmul:.1} GFLOP/s (1024³, rows split over {} threads)",
                header.threads
            ),
            format!(
                "MFU                {:.1}% of the faster matmul rate above ({peak:.1} GFLOP/s)",
                100.0 * model_gflops / peak
            ),
            isa_line(isa),
            format!(
                "peak memory        {} — params {}, grads {}, optimizer {}, data {}, activations {}",
                size(m.peak),
                size(m.params),
                size(m.grads),
                size(m.optimizer),
                size(m.data),
                size(m.activations)
            ),
        ];
        if last.offload_bytes > 0 {
            lines.push(format!(
                "offload tier       {:.2} MiB at its most (parked block inputs, optimizer state in flight; in the peak)",
                last.offload_bytes as f64 / (1 << 20) as f64
            ));
        }
        let waited = ops.iter().find(|(name, ..)| name == "data: waiting for a batch").map_or(0.0, |o| o.1);
        lines.push(format!(
            "data wait          {:.3} ms/step, {:.3}% of the step",
            1e3 * waited,
            100.0 * waited / step_seconds
        ));
        lines.push(
            "where step time goes (scopes; backward: autograd (all) includes the backward scopes below it):".into(),
        );
        for (name, per_step, share) in ops.iter().take(12) {
            lines.push(format!("  {name:<34} {:>8.1} ms/step  {:>5.1}%", 1e3 * per_step, 100.0 * share));
        }
        lines.join("\n")
    };
    p.result(text, || {
        json!({
            "tokens_per_sec": tokens_per_sec,
            "step_seconds": step_seconds,
            "flops_per_token": flops_per_token,
            "model_gflops": model_gflops,
            "matmul_gflops": matmul,
            "engine_linear_gflops": engine_matmul,
            "step_seconds_fastest": fastest,
            "step_seconds_slowest": slowest,
            "mfu": model_gflops / peak,
            "vector_isa": isa,
            "memory": m,
            "offload_bytes": last.offload_bytes,
            "profile": ops.iter().map(|(n, s, f)| json!({"scope": n, "seconds_per_step": s, "share": f})).collect::<Vec<_>>(),
        })
    });
    Ok(())
}

/// One memory mode of `--modes`: its label and the settings that make it.
struct Mode {
    label: String,
    sets: Vec<String>,
    /// For a mode whose state streams through the `--offload` tier: the mode that is the
    /// same with everything in memory.
    in_memory: Option<&'static str>,
}

/// The modes `--modes` compares, lightest last.
fn modes(offload: Option<&OffloadArg>) -> Vec<Mode> {
    let mode = |label: &str, sets: &[&str]| Mode {
        label: label.to_string(),
        sets: sets.iter().map(|s| s.to_string()).chain(["offload.tiers=[ram: 100%]".to_string()]).collect(),
        in_memory: None,
    };
    let bf16 = "train.precision=bf16";
    let mut out = vec![
        mode("fp32", &["train.precision=fp32", "train.master_weights=f32", "train.step_in_backward=false"]),
        mode("bf16, f32 masters", &[bf16, "train.master_weights=f32", "train.step_in_backward=false"]),
        mode("bf16 only (stochastic rounding)", &[bf16, "train.master_weights=none", "train.step_in_backward=false"]),
        mode("bf16 only, step in backward", &[bf16, "train.master_weights=none", "train.step_in_backward=true"]),
    ];
    if let Some(o) = offload {
        out.push(mode(
            "bf16, f32 masters, step in backward",
            &[bf16, "train.master_weights=f32", "train.step_in_backward=true"],
        ));
        let streamed = |label: String, masters: &str, in_memory| Mode {
            label,
            sets: [bf16.to_string(), format!("train.master_weights={masters}"), "train.step_in_backward=true".into()]
                .into_iter()
                .chain(o.sets())
                .collect(),
            in_memory: Some(in_memory),
        };
        out.push(streamed(
            format!("bf16 only, step in backward, state on {}", o.tier),
            "none",
            "bf16 only, step in backward",
        ));
        out.push(streamed(
            format!("bf16, step in backward, masters and state on {}", o.tier),
            "tier",
            "bf16, f32 masters, step in backward",
        ));
    }
    out
}

/// What one mode measured.
struct Measured {
    label: String,
    step_seconds: f64,
    memory: ava_train::memory::Breakdown,
    /// Per step: bytes read from and written to the tier, seconds waited on it.
    stream: Option<(f64, f64, f64)>,
    /// The step time of the same mode with everything in memory.
    in_memory: Option<&'static str>,
}

/// `ava bench train --modes`: the config's model in each memory mode (see [`modes`]).
pub fn run_modes(p: &Printer, args: &ConfigArgs, steps: u64, warmup: u64, offload: Option<&str>) -> CmdResult {
    if steps == 0 {
        return Err(Failure::Usage(anyhow::anyhow!("--steps must be at least 1")));
    }
    let ctx = context::load_checked(args, p)?;
    let offload = offload.map(|o| OffloadArg::parse(o, &ctx.registry)).transpose()?;
    let all = modes(offload.as_ref());
    p.note(&format!(
        "bench: {} memory modes, {warmup} warmup + {steps} measured steps each, one micro-batch a step and no \
         clipping in every mode (train.gradient_accumulation_steps: 1, train.grad_clip: 0)",
        all.len()
    ));
    let mut results = Vec::new();
    for mode in &all {
        let mut mode_args = args.clone();
        mode_args.set.extend(
            ["train.gradient_accumulation_steps=1".to_string(), "train.grad_clip=0".to_string()]
                .into_iter()
                .chain(mode.sets.iter().cloned()),
        );
        let mut config = context::load_config(&mode_args, p)?.into_config();
        let tmp = tempfile::tempdir()?;
        config.train.out_dir = tmp.path().to_path_buf();
        config.train.max_steps = config.train.max_steps.max(warmup + steps);
        set_threads(config.train.threads);
        p.note(&format!("bench: {}", mode.label));
        let mut trainer = Trainer::new(&config, &ctx.registry, &TrainOptions::default()).map_err(failure)?;
        for _ in 0..warmup {
            trainer.train_step().map_err(failure)?;
        }
        let (mut times, mut last, mut io) = (Vec::new(), None, (0.0, 0.0, 0.0));
        for _ in 0..steps {
            let start = Instant::now();
            let record = trainer.train_step().map_err(failure)?;
            times.push(start.elapsed().as_secs_f64());
            if let Some(s) = &record.stream {
                io.0 += s.read_bytes as f64 / steps as f64;
                io.1 += s.written_bytes as f64 / steps as f64;
                io.2 += s.wait_seconds / steps as f64;
            }
            last = Some(record);
        }
        let last = last.expect("at least one step");
        results.push(Measured {
            label: mode.label.clone(),
            step_seconds: median(&times),
            memory: last.memory,
            stream: last.stream.map(|_| io),
            in_memory: mode.in_memory,
        });
    }
    let first = results[0].step_seconds;
    // A streamed mode against the same one with the state in memory.
    let against = |r: &Measured| {
        let twin = results.iter().find(|m| Some(m.label.as_str()) == r.in_memory)?;
        Some((twin.label.clone(), r.step_seconds / twin.step_seconds))
    };
    let text = || {
        let headers = [
            "mode",
            "peak",
            "params / grads / optimizer / activations",
            "step",
            "× fp32",
            "tier: read + written, waited",
        ];
        let rows: Vec<Vec<String>> = results
            .iter()
            .map(|r| {
                let m = &r.memory;
                vec![
                    r.label.clone(),
                    size(m.peak),
                    format!("{} / {} / {} / {}", size(m.params), size(m.grads), size(m.optimizer), size(m.activations)),
                    format!("{:.1} ms", 1e3 * r.step_seconds),
                    format!("×{:.2}", r.step_seconds / first),
                    match r.stream {
                        Some((read, written, wait)) => format!(
                            "{:.1} + {:.1} MiB, {:.1} ms ({:.2} GB/s over the step)",
                            read / (1u64 << 20) as f64,
                            written / (1u64 << 20) as f64,
                            1e3 * wait,
                            (read + written) / r.step_seconds / 1e9
                        ),
                        None => "-".into(),
                    },
                ]
            })
            .collect();
        let mut out = crate::output::table(&headers, &rows);
        out.push_str("\nstep: median of the measured steps; peak and its parts: the last step's (the optimizer column holds the streamed state in memory at its most)");
        for r in &results {
            if let Some((twin, ratio)) = against(r) {
                let (_, _, wait) = r.stream.unwrap_or_default();
                out.push_str(&format!(
                    "\n{}: ×{ratio:.2} the step of \"{twin}\" (all in memory); it waited {:.1} ms a step on the tier, \
                     the rest of its traffic was hidden behind compute",
                    r.label,
                    1e3 * wait
                ));
            }
        }
        out
    };
    p.result(text, || {
        json!({
            "modes": results.iter().map(|r| json!({
                "mode": r.label,
                "step_seconds": r.step_seconds,
                "relative_to_fp32": r.step_seconds / first,
                "memory": r.memory,
                "tier_read_bytes_per_step": r.stream.map(|s| s.0),
                "tier_written_bytes_per_step": r.stream.map(|s| s.1),
                "tier_wait_seconds_per_step": r.stream.map(|s| s.2),
                "relative_to_state_in_memory": against(r).map(|(_, ratio)| ratio),
            })).collect::<Vec<_>>(),
        })
    });
    Ok(())
}
