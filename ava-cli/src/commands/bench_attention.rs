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
//!
//! With `--device cuda[:N]` the kernels run on the GPU instead, through the training
//! engine's own attention op, in `--dtype` (see [`gpu`]): the same columns, with TFLOP/s, the
//! device memory pool's peak in place of the host's, and the error against the same kernel
//! on the CPU in f32.

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
    cli::{AttnDtype, BenchAttentionArgs, ConfigArgs},
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

/// The kernels compared on the CPU when `--kernels` is not given.
const CPU_KERNELS: [&str; 4] = ["standard", "flash", "sliding-window", "block-sparse"];

/// Repeats on the CPU when `--repeats` is not given.
const CPU_REPEATS: u32 = 3;

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
    if !heads.is_multiple_of(kv_heads) {
        return Err(Failure::Usage(anyhow::anyhow!(
            "--kv-heads {kv_heads} must divide --heads {heads} (each key/value head serves the same number of query heads); try --kv-heads {}",
            divisors(heads).map(|d| d.to_string()).collect::<Vec<_>>().join(", --kv-heads ")
        )));
    }
    if args.seq.is_empty() {
        return Err(Failure::Usage(anyhow::anyhow!("--seq needs at least one sequence length, e.g. --seq 256,1024")));
    }
    if args.device.is_cuda() {
        return gpu::run(p, args, kv_heads);
    }
    if let Some(dtype) = args.dtype.filter(|d| *d != AttnDtype::F32) {
        let word = dtype_word(dtype);
        return Err(Failure::Usage(anyhow::anyhow!(
            "--dtype {word}: on --device cpu the kernels are called on f32 buffers (the kernel contract's host calls \
             take f32); drop --dtype, or add --device cuda to bench {word} on a GPU"
        )));
    }
    let kernels = args.kernels.clone().unwrap_or_else(|| CPU_KERNELS.iter().map(|k| k.to_string()).collect());
    let names = bench_args::names(&KERNELS, &kernels)?;
    let options = bench_args::parse_sets(&KERNELS, &args.set, &names)?;
    let threads = ava_train::train::resolve_threads(args.threads.unwrap_or(0));
    let repeats = args.repeats.unwrap_or(CPU_REPEATS);

    let ctx = context::load(&ConfigArgs { config: args.config.clone(), set: Vec::new() }, p)?;
    let mut benches = Vec::new();
    for name in &names {
        let given = options.get(name).cloned().unwrap_or_default();
        benches.push(build(&ctx.registry, name, given)?);
    }

    let header =
        Header { batch: args.batch, heads, kv_heads, head_dim: args.head_dim, causal: args.causal, threads, repeats };
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
            benches.iter().map(|bench| prepare(bench, &shape, repeats)).collect::<Result<_, _>>()?;
        for r in 0..repeats {
            p.note(&format!("[T={seq}] repeat {}/{}: every kernel once", r + 1, repeats));
            for (bench, run) in benches.iter().zip(&mut runs) {
                if let Ok(run) = run {
                    run.once(bench, &shape, inputs, &kctx, r + 1 == repeats)?;
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
    (1..=n).filter(move |d| n.is_multiple_of(*d))
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
    if let Some(available) = ava_train::memory::available_bytes()
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
    let mut notes = Notes::default();
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
                cells.push(skipped_cells(&mut notes, bench, row.seq, name, why, 9));
                continue;
            }
        };
        let (time_ratio, saved_ratio) = ratios(benches, rows, row);
        let err = err_cell(&mut notes, m);
        cells.push(vec![
            row.seq.to_string(),
            name,
            fmt_ms(m.fwd()),
            total_cell(&mut notes, bench, m),
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
    lines.extend(notes.lines());
    lines.join("\n")
}

/// A table's footnotes: each distinct text once, marked `[n]` where it applies.
#[derive(Default)]
struct Notes(Vec<String>);

impl Notes {
    /// The mark of `text`, added if new.
    fn mark(&mut self, text: String) -> String {
        let i = self.0.iter().position(|x| *x == text).unwrap_or_else(|| {
            self.0.push(text);
            self.0.len() - 1
        });
        format!("[{}]", i + 1)
    }

    /// `[n] text`, in order.
    fn lines(&self) -> impl Iterator<Item = String> + '_ {
        self.0.iter().enumerate().map(|(i, n)| format!("[{}] {n}", i + 1))
    }
}

/// The cells of a skipped row, `width` in all: T, kernel, `skipped [n]`, then empty ones.
fn skipped_cells(notes: &mut Notes, bench: &Bench, seq: u32, name: String, why: &str, width: usize) -> Vec<String> {
    let mark = notes.mark(format!("{} at T={seq}: skipped, {why}", bench.name));
    let mut r = vec![seq.to_string(), name, format!("skipped {mark}")];
    r.resize(width, String::new());
    r
}

/// The fwd+bwd time, or `- [n]` for a kernel without a backward.
fn total_cell(notes: &mut Notes, bench: &Bench, m: &Measured) -> String {
    m.total().map(fmt_ms).unwrap_or_else(|| format!("- {}", notes.mark(format!("{}: no backward", bench.name))))
}

/// The largest error, or `- [n]` with why there is none.
fn err_cell(notes: &mut Notes, m: &Measured) -> String {
    match (&m.errors, m.max_err()) {
        (Err(why), _) => format!("- {}", notes.mark(why.clone())),
        (Ok(_), Some(e)) => fmt_err(e),
        (Ok(_), None) => "-".into(),
    }
}

/// One row of `--format json`: the skipped reason, or the measurements, the peak under
/// `peak_key`, and the (forward, forward + backward) TFLOP/s `tflops` gives (a GPU's).
fn row_json(
    benches: &[Bench],
    rows: &[Row],
    row: &Row,
    peak_key: &str,
    tflops: impl Fn(&Measured) -> Option<(f64, Option<f64>)>,
) -> Value {
    let name = &benches[row.kernel].name;
    let m = match &row.outcome {
        Err(why) => return json!({"seq": row.seq, "kernel": name, "skipped": why}),
        Ok(m) => m,
    };
    let (time_ratio, saved_ratio) = ratios(benches, rows, row);
    let (errors, reference_skipped) = match &m.errors {
        Ok([out, dq, dk, dv]) => (json!({"out": out, "dq": dq, "dk": dk, "dv": dv}), None),
        Err(why) => (Value::Null, Some(why)),
    };
    let mut v = json!({
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
        "max_abs_err": m.max_err(),
        "max_abs_err_by_buffer": errors,
        "reference_skipped": reference_skipped,
    });
    v[peak_key] = json!(m.peak_bytes);
    if let Some((fwd, total)) = tflops(m) {
        v["forward_tflops"] = json!(fwd);
        v["forward_backward_tflops"] = json!(total);
    }
    v
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
    let rows: Vec<Value> = rows.iter().map(|row| row_json(benches, rows, row, "host_peak_bytes", |_| None)).collect();
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

/// `--dtype`'s word for a type.
fn dtype_word(dtype: AttnDtype) -> &'static str {
    match dtype {
        AttnDtype::F32 => "f32",
        AttnDtype::Bf16 => "bf16",
        AttnDtype::F16 => "f16",
    }
}

/// `ava bench attention --device cuda[:N]`: each kernel through the training engine's
/// attention op on the GPU (`ava_train::model::attention`: the kernel's `forward_cuda` and
/// `backward_cuda` on device buffers, launched on candle's stream), in `--dtype`.
///
/// For each T: q, k, v and dout are the CPU path's draws, rounded to the type and copied to
/// the device. Each kernel runs [`WARMUP`] untimed forward + backward calls (module loads,
/// the memory pool's growth), then the repeats, interleaved across the kernels as on the CPU:
/// a forward, then a forward + backward through candle's autograd (the gradients of
/// Σ out·dout, so backward receives dout), each timed from a synchronized device to a
/// synchronized device. The device peak is the memory pool's high-water mark over the
/// forward + backward above what the pool held before it. The error is against the same
/// kernel on the CPU in f32 on the same (rounded) inputs, up to [`REFERENCE_MAX_SEQ`].
/// A call that fails (out of device memory, say) makes its row a skipped one with the error,
/// and the other kernels go on.
mod gpu {
    use ava_core::Device as KernelDevice;
    use ava_train::device::{DeviceError, DeviceSpec};
    use candle_core::{DType, Device, Tensor, Var};

    use super::*;

    /// Beyond this T the CPU reference is not run: its time grows as T².
    pub(super) const REFERENCE_MAX_SEQ: u32 = 4096;

    /// Repeats when `--repeats` is not given (PyTorch's `attn_ref.py` takes 10).
    const REPEATS: u32 = 10;

    /// Untimed forward + backward calls per kernel and T before the repeats.
    pub(super) const WARMUP: u32 = 1;

    /// Backward counted as this many forwards (FlashAttention's and `attn_ref.py`'s count).
    const BACKWARD_FORWARDS: f64 = 2.5;

    /// The run's settings, for the header line and JSON.
    struct GpuHeader {
        batch: u32,
        heads: u32,
        kv_heads: u32,
        head_dim: u32,
        spec: DeviceSpec,
        name: Option<String>,
        dtype: AttnDtype,
        repeats: u32,
        /// Threads of the CPU reference.
        threads: usize,
    }

    pub(super) fn run(p: &Printer, args: &BenchAttentionArgs, kv_heads: u32) -> CmdResult {
        if !args.causal {
            return Err(Failure::Usage(anyhow::anyhow!(
                "--causal false: on a GPU each kernel runs through the training engine's attention op, which is \
                 causal (as training is); drop --causal false, or bench full attention with --device cpu"
            )));
        }
        let device = open(args.device)?;
        let ctx = context::load(&ConfigArgs { config: args.config.clone(), set: Vec::new() }, p)?;
        let kernels = match &args.kernels {
            Some(kernels) => kernels.clone(),
            None => ctx.registry.names_on(PluginKind::Attention, KernelDevice::Cuda),
        };
        if kernels.is_empty() {
            return Err(Failure::Usage(anyhow::anyhow!(
                "--device {}: none of the installed attention kernels runs on a GPU (no manifest lists cuda); \
                 bench them on the host with --device cpu",
                args.device
            )));
        }
        let names = bench_args::names(&KERNELS, &kernels)?;
        let options = bench_args::parse_sets(&KERNELS, &args.set, &names)?;
        let mut benches = Vec::new();
        for name in &names {
            benches.push(build(&ctx.registry, name, options.get(name).cloned().unwrap_or_default())?);
        }
        refuse_host_only(&ctx.registry, &names, args.device)?;
        let h = GpuHeader {
            batch: args.batch,
            heads: args.heads,
            kv_heads,
            head_dim: args.head_dim,
            spec: args.device,
            name: bench_args::device_name(&device),
            dtype: args.dtype.unwrap_or(AttnDtype::Bf16),
            repeats: args.repeats.unwrap_or(REPEATS),
            threads: ava_train::train::resolve_threads(args.threads.unwrap_or(0)),
        };
        let mut rows = Vec::new();
        for &seq in &args.seq {
            let shape = AttnShape::self_attention(
                h.batch as usize,
                h.heads as usize,
                kv_heads as usize,
                seq as usize,
                h.head_dim as usize,
                true,
            );
            rows.extend(bench_seq(p, &benches, &shape, &device, &h)?);
        }
        p.result(|| render_text(&h, &benches, &rows), || render_json(&h, &benches, &rows));
        Ok(())
    }

    /// Opens `--device` with the engine's own function; the errors name the flag.
    fn open(spec: DeviceSpec) -> Result<Device, Failure> {
        ava_train::device::open(spec).map_err(|e| {
            Failure::Usage(match e {
                DeviceError::NotBuilt { .. } => anyhow::anyhow!(
                    "--device {spec}: this ava was built without CUDA. Build one with `cargo build --release \
                     --features cuda` (a CUDA 12.4+ toolkit, and CUDA_COMPUTE_CAP for the card: 80 A100, 89 RTX \
                     4090, 90 H100; on a machine without a toolkit, `source tools/cuda-build-env.sh` first), or \
                     bench the kernels on the host with --device cpu"
                ),
                DeviceError::Open { reason, .. } => anyhow::anyhow!(
                    "--device {spec}: the GPU could not be opened ({reason}). Check that `nvidia-smi` lists it \
                     (ordinals start at 0) and that the CUDA libraries are found (LD_LIBRARY_PATH, e.g. \
                     /usr/local/cuda/lib64), or use --device cpu"
                ),
                other => anyhow::anyhow!("--device {spec}: {other}"),
            })
        })
    }

    /// Refuses, all at once and by name, the kernels whose manifests do not list the GPU
    /// ([`ava_plugins::Registry::check_devices`]): the engine hands them no device buffers.
    pub(super) fn refuse_host_only(
        registry: &ava_plugins::Registry,
        names: &[String],
        spec: DeviceSpec,
    ) -> Result<(), Failure> {
        let host_only: Vec<String> = names
            .iter()
            .filter(|n| registry.check_devices(&[(PluginKind::Attention, n.as_str())], KernelDevice::Cuda).is_err())
            .map(|n| {
                let manifest = registry.row(PluginKind::Attention, n).and_then(|r| r.manifest.as_ref());
                let listed: Vec<&str> =
                    manifest.map(|m| m.devices.iter().map(|d| d.as_str()).collect()).unwrap_or_default();
                format!(
                    "'{n}' (its manifest lists devices: {})",
                    if listed.is_empty() { "none".into() } else { listed.join(", ") }
                )
            })
            .collect();
        if host_only.is_empty() {
            return Ok(());
        }
        let on_gpu = registry.names_on(PluginKind::Attention, KernelDevice::Cuda);
        let others = if on_gpu.is_empty() {
            "none of the installed attention kernels does yet".to_string()
        } else {
            format!("the installed ones that do: {}", on_gpu.join(", "))
        };
        let (kernels, has, they, them) = match host_only.as_slice() {
            [one] => (format!("attention kernel {one}"), "has", "it", "it"),
            many => (format!("attention kernels {}", many.join(", ")), "have", "they", "them"),
        };
        Err(Failure::Usage(anyhow::anyhow!(
            "--device {spec}: {kernels} {has} no GPU side (no calls that take device buffers), so {they} cannot \
             run there; {others}. Drop {them} from --kernels, or bench {them} on the host with --device cpu"
        )))
    }

    /// q, k, v (variables, for their gradients) and dout (B, H|Hkv, T, D), on one device in
    /// one type.
    struct Inputs {
        q: Var,
        k: Var,
        v: Var,
        dout: Tensor,
    }

    impl Inputs {
        /// The CPU path's draws for `shape` (same seed, same order), in `dtype` on `device`.
        fn new(shape: &AttnShape, dtype: DType, device: &Device) -> candle_core::Result<Self> {
            let mut rng = Rng(0xA77E_0000 ^ u64::from(shape.q_len));
            let (b, t, d) = (shape.batch as usize, shape.q_len as usize, shape.head_dim as usize);
            let (h, hkv) = (shape.q_heads as usize, shape.kv_heads as usize);
            let mut draw = |heads: usize| -> candle_core::Result<Tensor> {
                let host = Tensor::from_vec(rng.vec(b * heads * t * d), (b, heads, t, d), &Device::Cpu)?;
                host.to_dtype(dtype)?.to_device(device)
            };
            let q = draw(h)?; // (B, H, T, D)
            let k = draw(hkv)?; // (B, Hkv, T, D)
            let v = draw(hkv)?; // (B, Hkv, T, D)
            let dout = draw(h)?; // (B, H, T, D)
            Ok(Self { q: Var::from_tensor(&q)?, k: Var::from_tensor(&k)?, v: Var::from_tensor(&v)?, dout })
        }

        /// The same values widened to f32 on the host, for the CPU reference.
        fn on_host_f32(&self) -> candle_core::Result<Self> {
            let host = |t: &Tensor| t.to_dtype(DType::F32)?.to_device(&Device::Cpu);
            Ok(Self {
                q: Var::from_tensor(&host(self.q.as_tensor())?)?,
                k: Var::from_tensor(&host(self.k.as_tensor())?)?,
                v: Var::from_tensor(&host(self.v.as_tensor())?)?,
                dout: host(&self.dout)?,
            })
        }
    }

    /// The kernel's forward through the engine's attention op, on the inputs' device.
    fn forward(bench: &Bench, x: &Inputs, threads: usize) -> candle_core::Result<Tensor> {
        let (q, k, v) = (x.q.as_tensor(), x.k.as_tensor(), x.v.as_tensor());
        ava_train::model::attention(&bench.kernel, &bench.name, q, k, v, None, threads)
    }

    /// Forward, then backward through candle's autograd: out and the gradients of q, k, v
    /// of Σ out·dout, so the kernel's backward receives dout. The product is the root itself
    /// (autograd seeds a root with ones, and 1·dout is dout exactly): no whole-tensor sum, whose
    /// one-block reduction and casts would be timed with the kernel's backward (PyTorch's
    /// reference calls `out.backward(dout)`).
    fn forward_backward(bench: &Bench, x: &Inputs, threads: usize) -> candle_core::Result<(Tensor, [Tensor; 3])> {
        let out = forward(bench, x, threads)?; // (B, H, T, D)
        let grads = out.mul(&x.dout)?.backward()?; // (B, H, T, D) root, seeded with ones
        let grad = |v: &Var| {
            grads
                .get(v.as_tensor())
                .cloned()
                .ok_or_else(|| candle_core::Error::Msg("no gradient reached an input".into()))
        };
        Ok((out, [grad(&x.q)?, grad(&x.k)?, grad(&x.v)?]))
    }

    /// `f`'s milliseconds from a synchronized device to a synchronized device, and its value.
    fn timed<T>(device: &Device, f: impl FnOnce() -> candle_core::Result<T>) -> candle_core::Result<(f64, T)> {
        device.synchronize()?;
        let start = Instant::now();
        let value = f()?;
        device.synchronize()?;
        Ok((start.elapsed().as_secs_f64() * 1e3, value))
    }

    /// A tensor's values as f32 on the host.
    fn host_values(t: &Tensor) -> candle_core::Result<Vec<f32>> {
        t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()
    }

    /// Synchronizes `device`, then starts a new high-water mark of its memory pool: the bytes
    /// the pool holds now.
    #[cfg(feature = "cuda")]
    fn pool_mark(device: &Device) -> candle_core::Result<u64> {
        device.synchronize()?;
        match device {
            Device::Cuda(gpu) => {
                memory::device::reset_peak(gpu)?;
                Ok(memory::device::read(gpu)?.used)
            }
            _ => Ok(0),
        }
    }

    /// The pool's high-water mark above `mark`.
    #[cfg(feature = "cuda")]
    fn pool_peak_above(device: &Device, mark: u64) -> candle_core::Result<u64> {
        match device {
            Device::Cuda(gpu) => Ok(memory::device::read(gpu)?.peak.saturating_sub(mark)),
            _ => Ok(0),
        }
    }

    /// The card's memory, if it can be read.
    #[cfg(feature = "cuda")]
    fn card_total(device: &Device) -> Option<u64> {
        match device {
            Device::Cuda(gpu) => memory::device::read(gpu).ok().map(|m| m.card_total),
            _ => None,
        }
    }

    /// Without the `cuda` feature no GPU opens, so these are never reached with one.
    #[cfg(not(feature = "cuda"))]
    fn pool_mark(device: &Device) -> candle_core::Result<u64> {
        device.synchronize().map(|()| 0)
    }

    #[cfg(not(feature = "cuda"))]
    fn pool_peak_above(_: &Device, _: u64) -> candle_core::Result<u64> {
        Ok(0)
    }

    #[cfg(not(feature = "cuda"))]
    fn card_total(_: &Device) -> Option<u64> {
        None
    }

    /// One kernel's repeats at one T on the device, gathered one at a time.
    struct DeviceSamples {
        saved_len: u64,
        /// f32s of workspace the kernel declared for a forward and a backward device call.
        workspace: [u64; 2],
        fwd_ms: Vec<f64>,
        total_ms: Vec<f64>,
        peak_bytes: u64,
        /// The last repeat's out and dq, dk, dv as f32 on the host, when there is a reference.
        last: Option<Outputs>,
    }

    /// Checks that a kernel takes the shape and that its buffers could fit on the card:
    /// `Err(why)` when it is skipped. Only what cannot fit on the card at all is skipped
    /// here: what fits on the card but not in its free memory fails its allocation, and the
    /// row says so.
    fn prepare(
        bench: &Bench,
        shape: &AttnShape,
        dtype: DType,
        device: &Device,
        threads: usize,
    ) -> Result<DeviceSamples, String> {
        let saved_len = bench.kernel.saved_len(shape).map_err(|e| format!("refuses the shape: {}", e.message))?;
        let ctx = KernelContext { threads: threads.min(u32::MAX as usize) as u32, device: KernelDevice::Cuda };
        let declared = |pass: Pass| {
            bench.kernel.workspace_len(shape, pass, &ctx).map_err(|e| format!("declares no workspace: {}", e.message))
        };
        let workspace = [declared(Pass::Forward)?, if bench.backward { declared(Pass::Backward)? } else { 0 }];
        let (qn, kvn, elt) = (shape.q_numel() as u64, shape.kv_numel() as u64, dtype.size_in_bytes() as u64);
        // out, saved, the larger workspace; dq, dk, dv and the product out·dout and its seed.
        let grads = if bench.backward { (qn + 2 * kvn) * elt + 2 * qn * elt } else { 0 };
        let needed = (saved_len + workspace[0].max(workspace[1])).saturating_mul(4) + qn * elt + grads;
        if let Some(total) = card_total(device)
            && needed > total
        {
            return Err(format!(
                "needs {} of device memory for out, saved, workspace and gradients; the card has {}",
                fmt_bytes(needed),
                fmt_bytes(total)
            ));
        }
        Ok(DeviceSamples { saved_len, workspace, fwd_ms: Vec::new(), total_ms: Vec::new(), peak_bytes: 0, last: None })
    }

    impl DeviceSamples {
        /// One untimed forward + backward (forward alone without a backward).
        fn warm_up(&mut self, bench: &Bench, x: &Inputs, threads: usize) -> candle_core::Result<()> {
            if bench.backward {
                forward_backward(bench, x, threads).map(drop)
            } else {
                forward(bench, x, threads).map(drop)
            }
        }

        /// A timed forward, then a timed forward + backward (for a kernel without a backward,
        /// the peak is the forward's); keeps the results on the host when `keep`.
        fn once(
            &mut self,
            bench: &Bench,
            x: &Inputs,
            device: &Device,
            threads: usize,
            keep: bool,
        ) -> candle_core::Result<()> {
            let mark = pool_mark(device)?;
            let (ms, out) = timed(device, || forward(bench, x, threads))?;
            self.fwd_ms.push(ms);
            if !bench.backward {
                self.peak_bytes = self.peak_bytes.max(pool_peak_above(device, mark)?);
                self.last = if keep { Some((host_values(&out)?, None)) } else { None };
                return Ok(());
            }
            drop(out);
            let mark = pool_mark(device)?;
            let (ms, (out, [dq, dk, dv])) = timed(device, || forward_backward(bench, x, threads))?;
            self.total_ms.push(ms);
            self.peak_bytes = self.peak_bytes.max(pool_peak_above(device, mark)?);
            if keep {
                let grads = [host_values(&dq)?, host_values(&dk)?, host_values(&dv)?];
                self.last = Some((host_values(&out)?, Some(grads)));
            }
            Ok(())
        }

        /// The measurement, with the last repeat's errors against `reference`.
        fn finish(self, bench: &Bench, reference: Reference) -> Measured {
            let errors = reference.and_then(|[r_out, r_dq, r_dk, r_dv]| {
                let (out, grads) = self.last.as_ref().ok_or("no results were kept to compare")?;
                let g = |i: usize, r: &[f32]| grads.as_ref().map(|g| max_abs_diff(&g[i], r));
                Ok([Some(max_abs_diff(out, &r_out)), g(0, &r_dq), g(1, &r_dk), g(2, &r_dv)])
            });
            Measured {
                fwd_ms: self.fwd_ms,
                total_ms: bench.backward.then_some(self.total_ms),
                saved_bytes: self.saved_len * 4,
                workspace_bytes: self.workspace.map(|n| n * 4),
                peak_bytes: self.peak_bytes,
                errors,
            }
        }
    }

    /// Runs `f` on a kernel's samples unless it was skipped; a failure skips it from then on.
    fn attempt(run: &mut Result<DeviceSamples, String>, f: impl FnOnce(&mut DeviceSamples) -> candle_core::Result<()>) {
        if let Ok(samples) = run
            && let Err(e) = f(samples)
        {
            *run = Err(format!("failed on the device: {e}"));
        }
    }

    /// Every kernel at one T: warm-up, interleaved repeats, then each one's CPU reference.
    fn bench_seq(
        p: &Printer,
        benches: &[Bench],
        shape: &AttnShape,
        device: &Device,
        h: &GpuHeader,
    ) -> Result<Vec<Row>, Failure> {
        let seq = shape.q_len;
        let dtype = candle_dtype(h.dtype);
        let x = Inputs::new(shape, dtype, device)
            .map_err(|e| Failure::Runtime(anyhow::anyhow!("making q, k, v and dout at T={seq} on {}: {e}", h.spec)))?;
        let mut runs: Vec<_> = benches.iter().map(|b| prepare(b, shape, dtype, device, h.threads)).collect();
        for w in 0..WARMUP {
            p.note(&format!("[T={seq}] warm-up {}/{WARMUP}: every kernel once, untimed", w + 1));
            for (bench, run) in benches.iter().zip(&mut runs) {
                attempt(run, |s| s.warm_up(bench, &x, h.threads));
            }
        }
        let keep = seq <= REFERENCE_MAX_SEQ;
        for r in 0..h.repeats {
            p.note(&format!("[T={seq}] repeat {}/{}: every kernel once", r + 1, h.repeats));
            for (bench, run) in benches.iter().zip(&mut runs) {
                attempt(run, |s| s.once(bench, &x, device, h.threads, keep && r + 1 == h.repeats));
            }
        }
        let rows = benches
            .iter()
            .zip(runs)
            .enumerate()
            .map(|(i, (bench, run))| {
                let outcome = run.map(|s| {
                    let reference = cpu_reference(p, bench, shape, &x, h.threads);
                    s.finish(bench, reference)
                });
                Row { seq, kernel: i, outcome }
            })
            .collect();
        Ok(rows)
    }

    /// The same kernel on the CPU in f32, on the device's inputs widened: the rounding of the
    /// inputs is common to both sides, so the difference is the device call's (its arithmetic
    /// and the rounding of its results). Not beyond [`REFERENCE_MAX_SEQ`], nor when the
    /// kernel's saved buffer would pass [`REFERENCE_CAP_BYTES`].
    fn cpu_reference(p: &Printer, bench: &Bench, shape: &AttnShape, x: &Inputs, threads: usize) -> Reference {
        let seq = shape.q_len;
        if seq > REFERENCE_MAX_SEQ {
            return Err(format!(
                "no max err at T={seq}: the CPU reference runs up to T={REFERENCE_MAX_SEQ} (its time grows as T²)"
            ));
        }
        let saved = bench.kernel.saved_len(shape).unwrap_or(0).saturating_mul(4);
        if saved > REFERENCE_CAP_BYTES {
            return Err(format!(
                "no max err for {} at T={seq}: on the CPU it would save {} (over the {} cap)",
                bench.name,
                fmt_bytes(saved),
                fmt_bytes(REFERENCE_CAP_BYTES)
            ));
        }
        p.note(&format!("[T={seq}] {}: the CPU reference (f32, {threads} threads)", bench.name));
        let failed = |e: candle_core::Error| format!("the CPU reference of {} failed: {e}", bench.name);
        let host = x.on_host_f32().map_err(failed)?;
        if !bench.backward {
            let out = forward(bench, &host, threads).and_then(|o| host_values(&o)).map_err(failed)?;
            return Ok([out, Vec::new(), Vec::new(), Vec::new()]);
        }
        let (out, [dq, dk, dv]) = forward_backward(bench, &host, threads).map_err(failed)?;
        let values = [&out, &dq, &dk, &dv].map(host_values);
        let [out, dq, dk, dv] = values;
        Ok([out.map_err(failed)?, dq.map_err(failed)?, dk.map_err(failed)?, dv.map_err(failed)?])
    }

    /// The backward seeded with dout gives the gradients of Σ out·dout, as the summed loss
    /// it replaced did, on the CPU engine's f32 (where both are exact to rounding).
    #[cfg(test)]
    #[test]
    fn a_backward_seeded_with_dout_equals_the_summed_loss() {
        let registry = ava_plugins::Registry::builtins();
        let bench = build(&registry, "standard", Map::new()).unwrap();
        let shape = AttnShape::self_attention(2, 4, 2, 9, 8, true);
        let x = Inputs::new(&shape, DType::F32, &Device::Cpu).unwrap();
        let (out, grads) = forward_backward(&bench, &x, 1).unwrap();
        let summed = forward(&bench, &x, 1).unwrap().mul(&x.dout).unwrap().sum_all().unwrap().backward().unwrap();
        assert_eq!(host_values(&out).unwrap(), host_values(&forward(&bench, &x, 1).unwrap()).unwrap());
        for (got, v) in grads.iter().zip([&x.q, &x.k, &x.v]) {
            let want = summed.get(v.as_tensor()).unwrap();
            assert_eq!(host_values(got).unwrap(), host_values(want).unwrap());
        }
    }

    /// candle's type for `--dtype`.
    fn candle_dtype(dtype: AttnDtype) -> DType {
        match dtype {
            AttnDtype::F32 => DType::F32,
            AttnDtype::Bf16 => DType::BF16,
            AttnDtype::F16 => DType::F16,
        }
    }

    /// Attention FLOPs of one forward at T, the causal half: QKᵀ and PV, 2·T²·D each per
    /// head, halved (`attn_ref.py`'s count).
    fn forward_flops(h: &GpuHeader, seq: u32) -> f64 {
        4.0 * f64::from(h.batch) * f64::from(h.heads) * f64::from(seq).powi(2) * f64::from(h.head_dim) / 2.0
    }

    /// (forward, forward + backward) TFLOP/s of a row.
    fn tflops(h: &GpuHeader, seq: u32, m: &Measured) -> (f64, Option<f64>) {
        let flops = forward_flops(h, seq);
        (flops / m.fwd() / 1e9, m.total().map(|t| (1.0 + BACKWARD_FORWARDS) * flops / t / 1e9))
    }

    fn render_text(h: &GpuHeader, benches: &[Bench], rows: &[Row]) -> String {
        let mut lines = vec![format!(
            "attention B={} H={} Hkv={} D={} causal, {} on {}{}, median of {} repeat{} after {WARMUP} warm-up call",
            h.batch,
            h.heads,
            h.kv_heads,
            h.head_dim,
            dtype_word(h.dtype),
            h.spec,
            h.name.as_ref().map(|n| format!(" ({n})")).unwrap_or_default(),
            h.repeats,
            if h.repeats == 1 { "" } else { "s" }
        )];
        let mut notes = Notes::default();
        let mut cells = Vec::new();
        for row in rows {
            let bench = &benches[row.kernel];
            let m = match &row.outcome {
                Ok(m) => m,
                Err(why) => {
                    cells.push(skipped_cells(&mut notes, bench, row.seq, bench.name.clone(), why, 11));
                    continue;
                }
            };
            let (time_ratio, saved_ratio) = ratios(benches, rows, row);
            let (fwd_tflops, total_tflops) = tflops(h, row.seq, m);
            let err = err_cell(&mut notes, m);
            cells.push(vec![
                row.seq.to_string(),
                bench.name.clone(),
                fmt_ms(m.fwd()),
                format!("{fwd_tflops:.1}"),
                total_cell(&mut notes, bench, m),
                total_tflops.map(|t| format!("{t:.1}")).unwrap_or_else(|| "-".into()),
                time_ratio.map(fmt_ratio).unwrap_or_else(|| "-".into()),
                fmt_bytes(m.saved_bytes),
                saved_ratio.map(fmt_ratio).unwrap_or_else(|| "-".into()),
                fmt_bytes(m.peak_bytes),
                err,
            ]);
        }
        lines.push(table(
            &[
                "T",
                "kernel",
                "fwd ms",
                "TFLOP/s",
                "fwd+bwd ms",
                "TFLOP/s",
                "×standard",
                "saved",
                "×standard",
                "device peak",
                "max err",
            ],
            &cells,
        ));
        lines.push(String::new());
        lines.push(
            "fwd ms, fwd+bwd ms: median over the repeats, each from a synchronized device to a synchronized\n\
             \x20 device; the op allocates out, saved, its workspace (and dq, dk, dv) inside the timed call, as\n\
             \x20 in a training step. fwd+bwd also runs the loss's element-wise work (Σ out·dout in f32 and\n\
             \x20 its gradient), small beside attention's."
                .into(),
        );
        lines.push(format!(
            "TFLOP/s: 4·B·H·T²·D/2 a forward (QKᵀ and PV over the causal half), {}× that a forward +\n\
             \x20 backward (backward as {BACKWARD_FORWARDS} forwards), as PyTorch's attn_ref.py counts.",
            1.0 + BACKWARD_FORWARDS
        ));
        if benches.iter().any(|b| b.name == BASELINE) {
            lines.push(format!("×standard: fwd+bwd time and saved bytes divided by {BASELINE}'s at the same T."));
        } else {
            lines.push(format!("×standard: '-' since {BASELINE} is not in --kernels."));
        }
        lines
            .push("saved: bytes the kernel keeps from forward for backward (saved_len · 4: f32 on the device).".into());
        lines.push(
            "device peak: the most bytes the device's memory pool held during forward + backward (forward\n\
             \x20 alone for a kernel without one) above what it held before (q, k, v, dout not counted)."
                .into(),
        );
        lines.push(format!(
            "max err: largest |difference| of out, dq, dk, dv from the same kernel on the CPU in f32, on the\n\
             \x20 same inputs (rounded to {}: the difference is the GPU call's arithmetic and the rounding\n\
             \x20 of its results); '-' beyond T={REFERENCE_MAX_SEQ}.",
            dtype_word(h.dtype)
        ));
        lines.extend(notes.lines());
        lines.join("\n")
    }

    fn render_json(h: &GpuHeader, benches: &[Bench], rows: &[Row]) -> Value {
        let kernels: Vec<Value> =
            benches.iter().map(|b| json!({"name": b.name, "options": b.options, "backward": b.backward})).collect();
        let rows: Vec<Value> = rows
            .iter()
            .map(|row| row_json(benches, rows, row, "device_peak_bytes", |m| Some(tflops(h, row.seq, m))))
            .collect();
        json!({
            "device": {"spec": h.spec, "name": h.name},
            "dtype": dtype_word(h.dtype),
            "shape": {"batch": h.batch, "heads": h.heads, "kv_heads": h.kv_heads, "head_dim": h.head_dim, "causal": true},
            "repeats": h.repeats,
            "warmup": WARMUP,
            "reference_threads": h.threads,
            "flops": format!("forward 4·B·H·T²·D/2 (the causal half), forward + backward {}× that", 1.0 + BACKWARD_FORWARDS),
            "device_peak_counts": "the device memory pool's high-water mark during forward + backward above what it held before: out, saved, workspace, dq, dk, dv and the loss's element-wise buffers",
            "reference": format!("the same kernel on the CPU in f32 on the same inputs (rounded to {}), up to T={REFERENCE_MAX_SEQ}", dtype_word(h.dtype)),
            "kernels": kernels,
            "rows": rows,
        })
    }
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

    /// A kernel whose manifest does not list the GPU is refused by name, with what to do; the
    /// built-in `standard` runs there in a `cuda` build only.
    #[test]
    fn a_kernel_without_a_gpu_side_is_refused_by_name() {
        let registry = ava_plugins::Registry::builtins();
        let spec = ava_train::device::DeviceSpec::Cuda(0);
        let refused = gpu::refuse_host_only(&registry, &["standard".to_string()], spec);
        assert_eq!(refused.is_ok(), cfg!(feature = "cuda"));
        if let Err(Failure::Usage(e)) = refused {
            assert_eq!(
                e.to_string(),
                "--device cuda:0: attention kernel 'standard' (its manifest lists devices: cpu) has no GPU side (no \
                 calls that take device buffers), so it cannot run there; none of the installed attention kernels \
                 does yet. Drop it from --kernels, or bench it on the host with --device cpu"
            );
        }
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
