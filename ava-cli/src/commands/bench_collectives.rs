//! `ava bench collectives`: time and bandwidth of the collectives the trainer's ZeRO stages
//! call, between the ranks of an MPI job, through `ava_train::dist::Collectives`.

use std::time::Instant;

use ava_train::dist;
use serde_json::json;

use crate::{CmdResult, Failure, cli::BenchCollectivesArgs, output::Printer};

pub fn run(p: &Printer, args: &BenchCollectivesArgs) -> CmdResult {
    super::train::launch_if_asked(args.nproc)?;
    let group = dist::join().map_err(|e| Failure::Usage(anyhow::anyhow!(e)))?;
    let c = group.collectives();
    let n = c.size();
    if n == 1 {
        return Err(Failure::Usage(anyhow::anyhow!(
            "ava bench collectives measures collectives between ranks, and this is one process: run it under \
             mpirun -np 2 (or with --nproc 2)"
        )));
    }
    let elems = (args.size / 4).max(1) as usize;
    let bytes = elems * 4;
    let counts: Vec<usize> = (0..n).map(|r| elems / n + usize::from(r < elems % n)).collect();
    let byte_counts: Vec<usize> = counts.iter().map(|c| c * 4).collect();
    let mut f = vec![1f32; elems]; // (S/4,) f32
    let mut b = vec![0u8; bytes]; // (S,) bytes
    let factor = (n - 1) as f64 / n as f64;
    let mut rows = Vec::new();
    for (name, bus) in [("all-reduce", 2.0 * factor), ("reduce-scatter", factor), ("all-gather", factor)] {
        let mut call = || match name {
            "all-reduce" => c.all_reduce_sum(&mut f),
            "reduce-scatter" => c.reduce_scatter_sum(&mut f, &counts),
            _ => c.all_gather(&mut b, &byte_counts),
        };
        let mut times = Vec::with_capacity(args.iters);
        for i in 0..args.warmup + args.iters.max(1) {
            c.barrier()?;
            let t = Instant::now();
            call()?;
            if i >= args.warmup {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        // Each call's time is its slowest rank's.
        let mut max: Vec<u64> = times.iter().map(|t| (t * 1e9) as u64).collect();
        c.all_reduce_max(&mut max)?;
        let mut slowest: Vec<f64> = max.iter().map(|&ns| ns as f64 / 1e9).collect();
        slowest.sort_by(f64::total_cmp);
        let median = slowest[slowest.len() / 2];
        let algbw = bytes as f64 / median / 1e9;
        rows.push((name, median, algbw, algbw * bus));
    }
    if c.rank() != 0 {
        return Ok(());
    }
    let text = || {
        let mut lines = vec![
            format!(
                "{n} ranks over {}, {} per call ({} f32)",
                c.describe(),
                ava_core::format_size(bytes as u64),
                elems
            ),
            format!("{:<16}{:>10}{:>14}{:>14}", "collective", "ms", "algbw GB/s", "busbw GB/s"),
        ];
        for (name, t, alg, bus) in &rows {
            lines.push(format!("{name:<16}{:>10.3}{alg:>14.2}{bus:>14.2}", t * 1e3));
        }
        lines.join("\n")
    };
    let json = || {
        json!({
            "ranks": n,
            "transport": c.describe(),
            "bytes": bytes,
            "collectives": rows.iter().map(|(name, t, alg, bus)| json!({
                "name": name, "seconds": t, "algbw_gb_s": alg, "busbw_gb_s": bus,
            })).collect::<Vec<_>>(),
        })
    };
    p.result(text, json);
    Ok(())
}
