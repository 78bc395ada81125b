//! `ava bench train`: training throughput on a config. Measures tokens/s over a number of
//! steps after a warmup, converts to model FLOP/s (6·N_matmul + 12·L·d·T per token), and
//! compares with this machine's candle f32 matmul rate measured on the spot (MFU). Also
//! prints the memory breakdown of the last step and where step time went.

use std::time::Instant;

use ava_train::memory::gib;
use ava_train::profile;
use ava_train::train::{TrainOptions, Trainer};
use candle_core::{Device, Tensor};
use serde_json::json;

use crate::{CmdResult, Failure, cli::ConfigArgs, context, output::Printer};

use super::train::{failure, set_threads};

/// GFLOP/s of candle's f32 matmul at n×n×n (best of several runs).
fn matmul_gflops(n: usize) -> Result<f64, candle_core::Error> {
    let a = Tensor::randn(0f32, 1.0, (n, n), &Device::Cpu)?;
    let b = Tensor::randn(0f32, 1.0, (n, n), &Device::Cpu)?;
    let _ = a.matmul(&b)?;
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let start = Instant::now();
        let c = a.matmul(&b)?;
        best = best.min(start.elapsed().as_secs_f64());
        drop(c);
    }
    Ok(2.0 * (n * n * n) as f64 / best / 1e9)
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
    profile::reset();
    profile::enable(true);
    let start = Instant::now();
    let mut last = None;
    for _ in 0..steps {
        last = Some(trainer.train_step().map_err(failure)?);
    }
    let seconds = start.elapsed().as_secs_f64();
    profile::enable(false);
    let last = last.expect("at least one step");

    let tokens_per_sec = (header.tokens_per_step as u64 * steps) as f64 / seconds;
    let flops_per_token = trainer.model().spec().train_flops_per_token(config.data.seq_len);
    let model_gflops = tokens_per_sec * flops_per_token / 1e9;
    let matmul = matmul_gflops(1024)?;
    let step_seconds = seconds / steps as f64;
    let ops: Vec<(String, f64, f64)> = profile::totals()
        .into_iter()
        .map(|(name, d, _)| (name.to_string(), d.as_secs_f64() / steps as f64, d.as_secs_f64() / seconds))
        .collect();
    let m = &last.memory;
    let text = || {
        let mut lines = vec![
            format!("tokens/s           {tokens_per_sec:.0}"),
            format!("step time          {:.1} ms", 1e3 * step_seconds),
            format!("model FLOPs/token  {:.1} M (6·N_matmul + 12·L·d·T)", flops_per_token / 1e6),
            format!("model GFLOP/s      {model_gflops:.1}"),
            format!("candle f32 matmul  {matmul:.1} GFLOP/s (1024³, this machine, now)"),
            format!("MFU                {:.1}%", 100.0 * model_gflops / matmul),
            format!(
                "peak memory        {:.3} GiB — params {:.3}, grads {:.3}, optimizer {:.3}, data {:.3}, activations {:.3}",
                gib(m.peak),
                gib(m.params),
                gib(m.grads),
                gib(m.optimizer),
                gib(m.data),
                gib(m.activations)
            ),
            "where step time goes (scopes; backward: autograd (all) includes the backward scopes below it):".into(),
        ];
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
            "mfu": model_gflops / matmul,
            "memory": m,
            "profile": ops.iter().map(|(n, s, f)| json!({"scope": n, "seconds_per_step": s, "share": f})).collect::<Vec<_>>(),
        })
    });
    Ok(())
}
