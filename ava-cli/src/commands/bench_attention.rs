//! `ava bench attention`: attention kernels head to head on the same inputs. For each
//! sequence length T and kernel: forward and forward + backward time (median of the
//! repeats), the bytes the kernel saves for backward, the host's peak allocation during the
//! call, and the largest difference of out, dq, dk, dv from the dense kernel under the same
//! mask.
//!
//! The repeats are interleaved: repeat r of every kernel runs before repeat r + 1 of any,
//! so a slow spell of a shared machine slows every kernel alike and the ratios hold.
//!
//! Every repeat allocates out, saved, dq, dk, dv and the kernel's declared workspace afresh
//! and inside the timed region, as
//! the training engine does every step (`ava-train/src/model/attention.rs`), so allocation and
//! first-touch costs are part of the times. q, k, v and dout exist before the call and are
//! not counted in the peak.

use std::{sync::Arc, time::Instant};

use ava_core::{
    AttentionKernel, AttnShape, KernelContext, Manifest, OptionType, Options, Pass, PluginError, PluginKind,
};
use ava_kernels::{
    attention::{Kernel, Masking},
    testing::Rng,
};
use ava_train::memory;
use serde_json::{Map, Value, json};

use super::bench_args::{self, Flag, median, min};

use crate::{
    CmdResult, Failure,
    cli::{BenchAttentionArgs, ConfigArgs},
    context,
    output::{Printer, table},
};

/// The dense reference is skipped when its probabilities (B·H·T² f32) would exceed this.
const REFERENCE_CAP_BYTES: u64 = 4 << 30;

/// How this bench names the kernels it compares.
const KERNELS: Flag = Flag {
    name: "--kernels",
    noun: "attention kernel",
    example_list: "standard,flash",
    example_set: "sliding-window.window=512",
};

/// The kernel every ratio is relative to.
const BASELINE: &str = "standard";

/// One kernel under test, built with the user's options.
struct Bench {
    name: String,
    kernel: Arc<dyn AttentionKernel>,
    /// The effective options (defaults filled in), for the report.
    options: Value,
    /// The mask of the dense reference it is compared with.
    masking: Masking,
    /// Why the mask is an assumption (a kernel this command does not know), if it is.
    assumed: Option<String>,
    backward: bool,
}

/// What one (T, kernel) run measured.
struct Measured {
    /// Forward times in ms, one per repeat.
    fwd_ms: Vec<f64>,
    /// Forward + backward times in ms, one per repeat (`None` without a backward).
    total_ms: Option<Vec<f64>>,
    saved_bytes: u64,
    /// The declared workspace of a forward and a backward call, in bytes.
    workspace_bytes: [u64; 2],
    /// Peak host bytes above the level before the call, the largest over the repeats.
    peak_bytes: u64,
    /// Max |difference| of out, dq, dk, dv from the reference, or why there is none.
    errors: Result<[Option<f64>; 4], String>,
}

/// One row of the table: a run, or why it was skipped.
struct Row {
    seq: u32,
    kernel: usize,
    outcome: Result<Measured, String>,
}

/// The dense reference's out, dq, dk, dv for one (T, mask), or why it was not computed.
type Reference = Result<[Vec<f32>; 4], String>;

pub fn run(p: &Printer, args: &BenchAttentionArgs) -> CmdResult {
    let heads = args.heads;
    let kv_heads = args.kv_heads.unwrap_or(heads);
    if heads % kv_heads != 0 {
        return Err(Failure::Usage(anyhow::anyhow!(
            "--kv-heads {kv_heads} must divide --heads {heads} (each key/value head serves the same number of query heads); try --kv-heads {}",
            divisors(heads).map(|d| d.to_string()).collect::<Vec<_>>().join(", --kv-heads ")
        )));
    }
    if args.seq.is_empty() {
        return Err(Failure::Usage(anyhow::anyhow!("--seq needs at least one sequence length, e.g. --seq 256,1024")));
    }
    let names = bench_args::names(&KERNELS, &args.kernels)?;
    let options = bench_args::parse_sets(&KERNELS, &args.set, &names)?;
    let threads = ava_train::train::resolve_threads(args.threads.unwrap_or(0));

    let ctx = context::load(&ConfigArgs { config: args.config.clone(), set: Vec::new() }, p)?;
    let mut benches = Vec::new();
    for name in &names {
        let given = options.get(name).cloned().unwrap_or_default();
        benches.push(build(&ctx.registry, name, given)?);
    }

    let header = Header {
        batch: args.batch,
        heads,
        kv_heads,
        head_dim: args.head_dim,
        causal: args.causal,
        threads,
        repeats: args.repeats,
    };
    let kctx = KernelContext { threads: threads.min(u32::MAX as usize) as u32, ..KernelContext::default() };
    let mut rows = Vec::new();
    for &seq in &args.seq {
        let shape = AttnShape::self_attention(
            args.batch as usize,
            heads as usize,
            kv_heads as usize,
            seq as usize,
            args.head_dim as usize,
            args.causal,
        );
        // The same inputs for every kernel at this T.
        let mut rng = Rng(0xA77E_0000 ^ u64::from(seq));
        let q = rng.vec(shape.q_numel());
        let k = rng.vec(shape.kv_numel());
        let v = rng.vec(shape.kv_numel());
        let dout = rng.vec(shape.q_numel());
        let inputs = Inputs { q: &q, k: &k, v: &v, dout: &dout };
        let mut references: Vec<(Masking, Reference)> = Vec::new();
        for bench in &benches {
            if !references.iter().any(|(m, _)| *m == bench.masking) {
                let reference = reference(p, &shape, bench.masking, inputs, &kctx, REFERENCE_CAP_BYTES);
                references.push((bench.masking, reference));
            }
        }
        let mut runs: Vec<Result<Samples, String>> =
            benches.iter().map(|bench| prepare(bench, &shape, args.repeats)).collect::<Result<_, _>>()?;
        for r in 0..args.repeats {
            p.note(&format!("[T={seq}] repeat {}/{}: every kernel once", r + 1, args.repeats));
            for (bench, run) in benches.iter().zip(&mut runs) {
                if let Ok(run) = run {
                    run.once(bench, &shape, inputs, &kctx, r + 1 == args.repeats)?;
                }
            }
        }
        for (i, (bench, run)) in benches.iter().zip(runs).enumerate() {
            let reference = &references.iter().find(|(m, _)| *m == bench.masking).expect("computed above").1;
            rows.push(Row { seq, kernel: i, outcome: run.map(|run| run.finish(bench, reference)) });
        }
    }

    p.result(|| render_text(&header, &benches, &rows), || render_json(&header, &benches, &rows));
    Ok(())
}

/// The divisors of `n`, for the --kv-heads hint.
fn divisors(n: u32) -> impl Iterator<Item = u32> {
    (1..=n).filter(move |d| n % d == 0)
}

/// Builds one kernel through the registry and works out the mask of its reference.
fn build(registry: &ava_plugins::Registry, name: &str, given: Map<String, Value>) -> Result<Bench, Failure> {
    let json = if given.is_empty() { String::new() } else { Value::Object(given).to_string() };
    let kernel = registry.attention(name, &json).map_err(|e| {
        Failure::Usage(match (&e, json.is_empty()) {
            (ava_plugins::HostError::Plugin { .. }, false) => anyhow::Error::new(e).context(format!(
                "attention kernel '{name}' refused the options given with --set ({json}); \
                 `ava plugins info {name}` lists the options it takes"
            )),
            _ => anyhow::anyhow!("--kernels {name}: {e}"),
        })
    })?;
    let manifest = registry.row(PluginKind::Attention, name).and_then(|r| r.manifest.clone());
    let options = manifest.as_ref().map(|m| Options::parse(m, &json));
    let (masking, assumed) = match (&manifest, &options) {
        (Some(m), Some(o)) => reference_masking(name, m, o),
        _ => (Masking::Plain, Some(format!("'{name}' has no manifest to read its options from"))),
    };
    Ok(Bench {
        name: name.to_string(),
        backward: kernel.supports_backward(),
        kernel,
        options: options.map(|o| o.to_json()).unwrap_or(Value::Null),
        masking,
        assumed,
    })
}

/// The mask the dense reference applies for kernel `name`: plain for `standard` and
/// `flash`, the band of `sliding-window`, the pattern of `block-sparse` (options merged
/// with the manifest's defaults). Any other kernel is compared with plain attention, and
/// the second value says that this is an assumption.
fn reference_masking(name: &str, manifest: &Manifest, options: &Options) -> (Masking, Option<String>) {
    // An option the manifest declares as an int; a kernel called like ours but declaring
    // its options differently is treated as unknown.
    let int = |option: &str| {
        manifest
            .option_spec(option)
            .filter(|s| s.ty == OptionType::Int)
            .and_then(|_| options.opt_int(option))
            .and_then(|v| usize::try_from(v).ok())
    };
    let unknown = |why: String| (Masking::Plain, Some(why));
    match name {
        "standard" | "flash" => (Masking::Plain, None),
        "sliding-window" => match int("window") {
            Some(w) => (Masking::Window(w), None),
            None => unknown(format!("'{name}' declares no int option 'window'")),
        },
        "block-sparse" => match (int("block_size"), int("num_local_blocks"), int("num_global_blocks"), int("stride")) {
            (Some(block), Some(local), Some(global), Some(stride)) => {
                (Masking::Blocks { block, local, global, stride }, None)
            }
            _ => unknown(format!(
                "'{name}' does not declare the int options block_size, num_local_blocks, num_global_blocks, stride"
            )),
        },
        _ => unknown(format!("'{name}' is not a kernel this command knows the mask of")),
    }
}

/// Words for a mask under the shape's causal flag.
fn describe(masking: Masking, causal: bool) -> String {
    let c = if causal { "causal" } else { "full" };
    match masking {
        Masking::Plain => c.to_string(),
        Masking::Window(w) => format!("{} window {w}", if causal { "causal" } else { "symmetric" }),
        Masking::Blocks { block, local, global, stride } => {
            format!("{c} blocks of {block}: {local} local, {global} global, stride {stride}")
        }
    }
}

/// The inputs every kernel at one T gets.
#[derive(Clone, Copy)]
struct Inputs<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    dout: &'a [f32],
}

/// The dense kernel under `masking`: out, dq, dk, dv — unless its probabilities would exceed
/// `cap` bytes ([`REFERENCE_CAP_BYTES`]).
fn reference(p: &Printer, shape: &AttnShape, masking: Masking, x: Inputs, ctx: &KernelContext, cap: u64) -> Reference {
    let dense = Kernel::dense(masking);
    let probs = dense.saved_len(shape).map_err(|e| format!("the dense reference refuses the shape: {}", e.message))?;
    let bytes = probs.saturating_mul(4);
    if bytes > cap {
        return Err(format!(
            "no max err at T={}: the dense reference would hold {} of probabilities (over the {} cap)",
            shape.q_len,
            fmt_bytes(bytes),
            fmt_bytes(cap)
        ));
    }
    p.note(&format!("[T={}] dense reference, {}", shape.q_len, describe(masking, shape.causal)));
    let (out, _probs, [dq, dk, dv]) = ava_kernels::testing::run(&dense, shape, (x.q, x.k, x.v, x.dout), ctx.threads)
        .map_err(|e| format!("the dense reference failed: {e}"))?;
    Ok([out, dq, dk, dv])
}

/// Bytes the system can still give us (Linux `MemAvailable`), if known.
fn available_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The error a kernel's failure becomes.
fn failed(bench: &Bench, shape: &AttnShape, what: &str, e: PluginError) -> Failure {
    Failure::Runtime(anyhow::anyhow!(
        "attention kernel '{}' failed in {what} at T={} (B={}, H={}, Hkv={}, D={}): {e}",
        bench.name,
        shape.q_len,
        shape.batch,
        shape.q_heads,
        shape.kv_heads,
        shape.head_dim
    ))
}

/// Checks that a kernel takes the shape and that its buffers fit in memory: `Ok(Err(why))`
/// when it is skipped.
fn prepare(bench: &Bench, shape: &AttnShape, repeats: u32) -> Result<Result<Samples, String>, Failure> {
    let saved_len = match bench.kernel.saved_len(shape) {
        Ok(n) => n,
        Err(e) => return Ok(Err(format!("refuses the shape: {}", e.message))),
    };
    let (qn, kvn) = (shape.q_numel() as u64, shape.kv_numel() as u64);
    let needed = (saved_len + qn + if bench.backward { qn + 2 * kvn } else { 0 }).saturating_mul(4);
    if let Some(available) = available_bytes()
        && needed > available
    {
        return Ok(Err(format!(
            "needs {} for out, saved and gradients; {} is available",
            fmt_bytes(needed),
            fmt_bytes(available)
        )));
    }
    let saved_len = usize::try_from(saved_len)
        .map_err(|_| failed(bench, shape, "saved_len", PluginError::internal("too large")))?;
    // Reserved up front, so that the only host allocations inside the measured region are
    // the call's own buffers and whatever a built-in kernel allocates.
    let (fwd_ms, total_ms) = (Vec::with_capacity(repeats as usize), Vec::with_capacity(repeats as usize));
    Ok(Ok(Samples { saved_len, workspace: [0, 0], fwd_ms, total_ms, peak_bytes: 0, last: None }))
}

/// One kernel's repeats at one T, gathered one at a time.
struct Samples {
    saved_len: usize,
    /// f32s of workspace the kernel declared for forward and backward.
    workspace: [u64; 2],
    fwd_ms: Vec<f64>,
    total_ms: Vec<f64>,
    peak_bytes: u64,
    /// The last repeat's outputs, for the error.
    last: Option<Outputs>,
}

/// A call's out and, with a backward, its dq, dk, dv.
type Outputs = (Vec<f32>, Option<[Vec<f32>; 3]>);

impl Samples {
    /// Runs forward (and backward) once; keeps the results when `keep`.
    fn once(&mut self, bench: &Bench, shape: &AttnShape, x: Inputs, ctx: &KernelContext, keep: bool) -> CmdResult {
        // Exact to within a few hundred bytes: threads a kernel started in an earlier call
        // may still be freeing their last bytes (thread-local storage) during this one.
        let before = memory::current();
        memory::reset_peak();
        let start = Instant::now();
        let mut out = vec![0f32; shape.q_numel()]; // (B, H, T, D)
        let mut saved = vec![0f32; self.saved_len]; // as the kernel declared
        let mut workspace = |pass: Pass| -> Result<Vec<f32>, Failure> {
            let n =
                bench.kernel.workspace_len(shape, pass, ctx).map_err(|e| failed(bench, shape, "workspace_len", e))?;
            self.workspace[pass as usize] = n;
            Ok(vec![0f32; n as usize]) // as the kernel declared, freed when the call returns
        };
        let mut ws = workspace(Pass::Forward)?;
        bench
            .kernel
            .forward(shape, x.q, x.k, x.v, &[], &mut out, &mut saved, &mut ws, ctx)
            .map_err(|e| failed(bench, shape, "forward", e))?;
        drop(ws);
        self.fwd_ms.push(start.elapsed().as_secs_f64() * 1e3);
        let grads = if bench.backward {
            let mut dq = vec![0f32; shape.q_numel()]; // (B, H, T, D)
            let mut dk = vec![0f32; shape.kv_numel()]; // (B, Hkv, T, D)
            let mut dv = vec![0f32; shape.kv_numel()]; // (B, Hkv, T, D)
            let mut ws = workspace(Pass::Backward)?;
            bench
                .kernel
                .backward(shape, x.q, x.k, x.v, &[], &out, x.dout, &saved, &mut dq, &mut dk, &mut dv, &mut ws, ctx)
                .map_err(|e| failed(bench, shape, "backward", e))?;
            drop(ws);
            self.total_ms.push(start.elapsed().as_secs_f64() * 1e3);
            Some([dq, dk, dv])
        } else {
            None
        };
        self.peak_bytes = self.peak_bytes.max(memory::peak().saturating_sub(before));
        drop(saved);
        self.last = keep.then_some((out, grads));
        Ok(())
    }

    /// The measurement, with the last repeat's errors against `reference`.
    fn finish(self, bench: &Bench, reference: &Reference) -> Measured {
        let (out, grads) = self.last.expect("at least one repeat");
        let errors = reference.as_ref().map_err(Clone::clone).map(|[r_out, r_dq, r_dk, r_dv]| {
            let g = |i: usize, r: &[f32]| grads.as_ref().map(|g| max_abs_diff(&g[i], r));
            [Some(max_abs_diff(&out, r_out)), g(0, r_dq), g(1, r_dk), g(2, r_dv)]
        });
        Measured {
            fwd_ms: self.fwd_ms,
            total_ms: bench.backward.then_some(self.total_ms),
            saved_bytes: self.saved_len as u64 * 4,
            workspace_bytes: self.workspace.map(|n| n * 4),
            peak_bytes: self.peak_bytes,
            errors,
        }
    }
}

/// The largest |a − b|; NaN if any difference is NaN (a NaN must not hide behind `max`).
fn max_abs_diff(a: &[f32], b: &[f32]) -> f64 {
    if a.len() != b.len() {
        return f64::NAN;
    }
    let mut max = 0f64;
    for (x, y) in a.iter().zip(b) {
        let d = f64::from((x - y).abs());
        if d.is_nan() {
            return f64::NAN;
        }
        max = max.max(d);
    }
    max
}

impl Measured {
    fn fwd(&self) -> f64 {
        median(&self.fwd_ms)
    }
    fn total(&self) -> Option<f64> {
        self.total_ms.as_deref().map(median)
    }
    /// The largest of the errors measured, NaN if any is NaN.
    fn max_err(&self) -> Option<f64> {
        let errs = self.errors.as_ref().ok()?;
        let mut max = 0f64;
        for e in errs.iter().flatten() {
            if e.is_nan() {
                return Some(f64::NAN);
            }
            max = max.max(*e);
        }
        Some(max)
    }
}

/// The shape and settings, for the header line and JSON.
struct Header {
    batch: u32,
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    causal: bool,
    threads: usize,
    repeats: u32,
}

/// The baseline's measurement at `seq`, if it ran.
fn baseline<'a>(benches: &[Bench], rows: &'a [Row], seq: u32) -> Option<&'a Measured> {
    rows.iter().find(|r| r.seq == seq && benches[r.kernel].name == BASELINE).and_then(|r| r.outcome.as_ref().ok())
}

/// (time, saved) relative to the baseline at the same T.
fn ratios(benches: &[Bench], rows: &[Row], row: &Row) -> (Option<f64>, Option<f64>) {
    let (Some(base), Ok(m)) = (baseline(benches, rows, row.seq), &row.outcome) else { return (None, None) };
    let time = match (m.total(), base.total()) {
        (Some(t), Some(b)) => Some(t / b),
        _ => None, // forward-only kernels are compared on nothing rather than on unlike times
    };
    let saved = (base.saved_bytes > 0).then(|| m.saved_bytes as f64 / base.saved_bytes as f64);
    (time, saved)
}

fn render_text(h: &Header, benches: &[Bench], rows: &[Row]) -> String {
    let mut lines = vec![format!(
        "attention B={} H={} Hkv={} D={} {}, {} threads, median of {} repeat{}",
        h.batch,
        h.heads,
        h.kv_heads,
        h.head_dim,
        if h.causal { "causal" } else { "full (not causal)" },
        h.threads,
        h.repeats,
        if h.repeats == 1 { "" } else { "s" }
    )];
    let mut notes: Vec<String> = Vec::new();
    let mut note = |n: String| {
        let i = match notes.iter().position(|x| *x == n) {
            Some(i) => i,
            None => {
                notes.push(n);
                notes.len() - 1
            }
        };
        format!("[{}]", i + 1)
    };
    let mut cells = Vec::new();
    for row in rows {
        let bench = &benches[row.kernel];
        let name = match &bench.assumed {
            Some(_) => format!("{}*", bench.name),
            None => bench.name.clone(),
        };
        let m = match &row.outcome {
            Ok(m) => m,
            Err(why) => {
                let mark = note(format!("{} at T={}: skipped, {why}", bench.name, row.seq));
                let mut r = vec![row.seq.to_string(), name, format!("skipped {mark}")];
                r.extend(std::iter::repeat_n(String::new(), 6));
                cells.push(r);
                continue;
            }
        };
        let (time_ratio, saved_ratio) = ratios(benches, rows, row);
        let err = match (&m.errors, m.max_err()) {
            (Err(why), _) => format!("- {}", note(why.clone())),
            (Ok(_), Some(e)) => fmt_err(e),
            (Ok(_), None) => "-".into(),
        };
        cells.push(vec![
            row.seq.to_string(),
            name,
            fmt_ms(m.fwd()),
            m.total().map(fmt_ms).unwrap_or_else(|| format!("- {}", note(format!("{}: no backward", bench.name)))),
            time_ratio.map(fmt_ratio).unwrap_or_else(|| "-".into()),
            fmt_bytes(m.saved_bytes),
            saved_ratio.map(fmt_ratio).unwrap_or_else(|| "-".into()),
            fmt_bytes(m.peak_bytes),
            err,
        ]);
    }
    lines.push(table(
        &["T", "kernel", "fwd ms", "fwd+bwd ms", "×standard", "saved", "×standard", "host peak", "max err"],
        &cells,
    ));
    lines.push(String::new());
    lines.push(
        "fwd ms, fwd+bwd ms: median over the repeats; allocating out and saved (and dq, dk, dv)\n\
         \x20 is inside the timed call, as in a training step."
            .into(),
    );
    if benches.iter().any(|b| b.name == BASELINE) {
        lines.push(format!("×standard: fwd+bwd time and saved bytes divided by {BASELINE}'s at the same T."));
    } else {
        lines.push(format!("×standard: '-' since {BASELINE} is not in --kernels."));
    }
    lines.push("saved: bytes the kernel keeps from forward for backward (its saved_len · 4).".into());
    lines.push(
        "host peak: the most bytes this process's counting allocator held during forward + backward,\n\
         \x20 above what it held before (q, k, v, dout not counted): out, saved, dq, dk, dv, the\n\
         \x20 workspace the kernel declares for a call (its scratch, allocated by the host), and what a\n\
         \x20 built-in kernel allocates itself. A plugin library's other allocations use its own\n\
         \x20 allocator, which this count does not see."
            .into(),
    );
    lines.push("max err: largest |difference| of out, dq, dk, dv from the dense kernel with the same mask:".into());
    for b in benches {
        lines.push(format!("  {}: {}", b.name, describe(b.masking, h.causal)));
    }
    for b in benches {
        if let Some(why) = &b.assumed {
            lines.push(format!(
                "* {why}: it is assumed to mask as plain {} attention,\n\
                 \x20 so a large max err may only mean it masks differently.",
                if h.causal { "causal" } else { "full" }
            ));
        }
    }
    for (i, n) in notes.iter().enumerate() {
        lines.push(format!("[{}] {n}", i + 1));
    }
    lines.join("\n")
}

fn render_json(h: &Header, benches: &[Bench], rows: &[Row]) -> Value {
    let kernels: Vec<Value> = benches
        .iter()
        .map(|b| {
            json!({
                "name": b.name,
                "options": b.options,
                "reference_mask": describe(b.masking, h.causal),
                "mask_assumed": b.assumed,
                "backward": b.backward,
            })
        })
        .collect();
    let rows: Vec<Value> = rows
        .iter()
        .map(|row| {
            let name = &benches[row.kernel].name;
            match &row.outcome {
                Err(why) => json!({"seq": row.seq, "kernel": name, "skipped": why}),
                Ok(m) => {
                    let (time_ratio, saved_ratio) = ratios(benches, rows, row);
                    let (errors, reference_skipped) = match &m.errors {
                        Ok([out, dq, dk, dv]) => (json!({"out": out, "dq": dq, "dk": dk, "dv": dv}), None),
                        Err(why) => (Value::Null, Some(why)),
                    };
                    json!({
                        "seq": row.seq,
                        "kernel": name,
                        "forward_ms": m.fwd(),
                        "forward_ms_min": min(&m.fwd_ms),
                        "forward_backward_ms": m.total(),
                        "forward_backward_ms_min": m.total_ms.as_deref().map(min),
                        "time_vs_standard": time_ratio,
                        "saved_bytes": m.saved_bytes,
                        "saved_vs_standard": saved_ratio,
                        "workspace_bytes": {"forward": m.workspace_bytes[0], "backward": m.workspace_bytes[1]},
                        "host_peak_bytes": m.peak_bytes,
                        "max_abs_err": m.max_err(),
                        "max_abs_err_by_buffer": errors,
                        "reference_skipped": reference_skipped,
                    })
                }
            }
        })
        .collect();
    json!({
        "shape": {
            "batch": h.batch,
            "heads": h.heads,
            "kv_heads": h.kv_heads,
            "head_dim": h.head_dim,
            "causal": h.causal,
        },
        "threads": h.threads,
        "repeats": h.repeats,
        "host_peak_counts": "bytes held by the ava process's counting allocator during forward + backward above the level before the call: out, saved, dq, dk, dv, the kernel's declared workspace and a built-in kernel's own allocations; not a plugin library's internal allocations",
        "kernels": kernels,
        "rows": rows,
    })
}

fn fmt_ms(ms: f64) -> String {
    if ms < 1.0 {
        format!("{ms:.3}")
    } else if ms < 100.0 {
        format!("{ms:.2}")
    } else {
        format!("{ms:.1}")
    }
}

fn fmt_bytes(b: u64) -> String {
    const KIB: f64 = 1024.0;
    let f = b as f64;
    if b < 1024 {
        format!("{b} B")
    } else if f < KIB * KIB {
        format!("{:.1} KiB", f / KIB)
    } else if f < KIB * KIB * KIB {
        format!("{:.1} MiB", f / (KIB * KIB))
    } else {
        format!("{:.2} GiB", f / (KIB * KIB * KIB))
    }
}

fn fmt_ratio(r: f64) -> String {
    if r >= 100.0 {
        format!("{r:.0}×")
    } else if r >= 0.01 {
        format!("{r:.2}×")
    } else {
        format!("{r:.1e}×")
    }
}

fn fmt_err(e: f64) -> String {
    if e.is_nan() {
        "NaN".into()
    } else if e == 0.0 {
        "0".into()
    } else {
        format!("{e:.1e}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_abs_diff_does_not_hide_nan() {
        assert_eq!(max_abs_diff(&[1.0, 2.0], &[1.5, 2.0]), 0.5);
        assert!(max_abs_diff(&[f32::NAN, 2.0], &[1.0, 5.0]).is_nan());
    }

    #[test]
    fn numbers_are_formatted_for_people() {
        assert_eq!(fmt_bytes(4096), "4.0 KiB");
        assert_eq!(fmt_bytes(1 << 20), "1.0 MiB");
        assert_eq!(fmt_ratio(1.0 / 4096.0), "2.4e-4×");
        assert_eq!(fmt_ratio(0.5), "0.50×");
        assert_eq!(fmt_err(0.0), "0");
    }

    fn manifest(name: &str) -> Manifest {
        Manifest::new(name, PluginKind::Attention, "0.1.0", "test")
            .option(ava_core::OptionSpec::int("window", 256, "w"))
            .option(ava_core::OptionSpec::int("block_size", 64, "b"))
            .option(ava_core::OptionSpec::int("num_local_blocks", 4, "l"))
            .option(ava_core::OptionSpec::int("num_global_blocks", 1, "g"))
            .option(ava_core::OptionSpec::int("stride", 0, "s"))
    }

    #[test]
    fn the_reference_mask_follows_the_kernel_and_its_options() {
        let masking = |name: &str, json: &str| {
            let m = manifest(name);
            reference_masking(name, &m, &Options::parse(&m, json))
        };
        assert_eq!(masking("flash", ""), (Masking::Plain, None));
        assert_eq!(masking("sliding-window", ""), (Masking::Window(256), None));
        assert_eq!(masking("sliding-window", r#"{"window": 512}"#), (Masking::Window(512), None));
        assert_eq!(
            masking("block-sparse", r#"{"stride": 8}"#),
            (Masking::Blocks { block: 64, local: 4, global: 1, stride: 8 }, None)
        );
        let (m, assumed) = masking("my-attention", "");
        assert_eq!(m, Masking::Plain);
        assert_eq!(assumed.as_deref(), Some("'my-attention' is not a kernel this command knows the mask of"));
        // Called like ours but without the option: not guessed.
        let bare = Manifest::new("sliding-window", PluginKind::Attention, "0.1.0", "test");
        let (m, assumed) = reference_masking("sliding-window", &bare, &Options::parse(&bare, ""));
        assert_eq!(m, Masking::Plain);
        assert!(assumed.is_some());
    }

    #[test]
    fn a_reference_over_the_cap_is_skipped_with_the_reason() {
        let p = Printer { format: crate::output::Format::Text, verbosity: 0 };
        let shape = AttnShape::self_attention(1, 2, 2, 8, 4, true);
        let mut rng = Rng(1);
        let (q, k, v, d) = (rng.vec(64), rng.vec(64), rng.vec(64), rng.vec(64));
        let x = Inputs { q: &q, k: &k, v: &v, dout: &d };
        let ctx = KernelContext::default();
        let err = reference(&p, &shape, Masking::Plain, x, &ctx, 100).unwrap_err();
        assert_eq!(
            err,
            "no max err at T=8: the dense reference would hold 512 B of probabilities (over the 100 B cap)"
        );
        assert_eq!(reference(&p, &shape, Masking::Plain, x, &ctx, 512).map(|r| r[0].len()), Ok(64));
    }
}
