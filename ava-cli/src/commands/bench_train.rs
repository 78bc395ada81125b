//! `ava bench train`: training throughput on a config. Measures tokens/s over a number of
//! steps after a warmup, converts to model FLOP/s (6·N_matmul + 6·L·d·T per token: the causal
//! half of attention), and compares with a matmul rate (MFU). Also prints the memory
//! breakdown of the last step and where step time went. With `--modes`, the same model in
//! each memory mode side by side: peak, parts, step time, and the tier's traffic and the time
//! the step waited on it.
//!
//! On the CPU the yardstick is the best f32 matmul rate this machine shows between the steps,
//! candle's or the engine's linear op, and the measured steps are the profiled ones.
//!
//! On a GPU (`train.device: cuda`) candle's launches are asynchronous, so the two are apart:
//! the measured steps run unprofiled, each ended by a device synchronization, and tokens/s is
//! from their median (as PyTorch's reference, `torch_ref.py`, reports); then
//! [`PROFILED_STEPS`] more steps run with every profiler scope synchronizing the device
//! ([`profile::sync_with`]), for where the time goes. The MFU is against the card's dense
//! bf16 peak ([`GPU_PEAK_TFLOPS`]), with candle's bf16 matmul measured on the device beside
//! it; the memory is the device's (the pool's high-water mark, and the card's own figure);
//! and the step `ava plan`'s GPU model predicts for the card (`estimate::step_time`) is
//! printed beside the measured one, so every GPU run says how far off the model is.

use std::time::Instant;

use ava_train::config::Config;
use ava_train::estimate::step_time::{self, Card, StepTime};
use ava_train::memory::size;
use ava_train::memory::timeline::{self, Timeline};
use ava_train::model::fused::linear;
use ava_train::profile;
use ava_train::train::{RunHeader, StepRecord, TrainOptions, Trainer};
use candle_core::{DType, Device, Tensor};
use serde_json::json;

use crate::{CmdResult, Failure, cli::ConfigArgs, context, output::Printer};

use super::memory_timeline;
use super::offload_arg::OffloadArg;
use super::train::{failure, run_config, set_threads};

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

pub fn run(
    p: &Printer,
    args: &ConfigArgs,
    steps: u64,
    warmup: u64,
    trace: Option<&std::path::Path>,
    memory_step: Option<u64>,
) -> CmdResult {
    if steps == 0 {
        return Err(Failure::Usage(anyhow::anyhow!("--steps must be at least 1")));
    }
    if let Some(step) = memory_step.filter(|s| !(1..=steps).contains(s)) {
        return Err(Failure::Usage(anyhow::anyhow!(
            "--memory-trace {step}: the benchmark measures steps 1 to {steps} (after the warmup); pick one of them \
             or raise --steps"
        )));
    }
    let ctx = context::load_checked(args, p)?;
    let mut config = run_config(context::load_config(args, p)?, p)?;
    // The benchmark writes nothing: its run directory is a temporary one.
    let tmp = tempfile::tempdir()?;
    config.train.out_dir = tmp.path().to_path_buf();
    // A GPU run profiles its own steps after the measured ones.
    let profiled = if config.train.device.is_cuda() { PROFILED_STEPS } else { 0 };
    config.train.max_steps = config.train.max_steps.max(warmup + steps + profiled);
    set_threads(config.train.threads);
    if memory_step.is_some() && config.train.device.is_cuda() {
        return Err(Failure::Usage(anyhow::anyhow!(
            "--memory-trace records the host allocator, and a GPU run's buffers are on the device: it is not \
             supported on a GPU run yet; trace a CPU config (train.device: cpu), or use --trace alone"
        )));
    }
    let mut trainer = Trainer::new(&config, &ctx.registry, &TrainOptions::default()).map_err(failure)?;
    // The trace's file is made before any step runs, so a path that cannot be written is said
    // at once; it goes again if no trace gets written into it.
    let mut trace_out = trace.map(TraceOut::create).transpose()?;
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
    let device = trainer.model().device();
    if trace.is_some() {
        profile::trace::start();
    }
    let mut timeline = None;
    let result = if device.is_cuda() {
        gpu_bench(p, &mut trainer, &header, (&config, &ctx.registry), steps, &device)
    } else {
        cpu_bench(p, &mut trainer, &header, &config, steps, memory_step, &mut timeline)
    };
    let recorded = memory_step.zip(timeline.as_ref()); // (step, its timeline)
    let spans = profile::trace::take();
    if let (Some(out), Some(spans), Ok(())) = (trace_out.as_mut(), spans, &result) {
        out.write(p, &spans, recorded, args)?;
    }
    if let (Some(out), Some((step, timeline)), Ok(())) = (&trace_out, recorded, &result) {
        let estimate = memory_timeline::estimated_peak(p, &ctx.registry, &config);
        memory_timeline::chart_beside(p, out.path, step, timeline, estimate)?;
    }
    result
}

/// The file `--trace` names, made before the steps; removed unless a trace was written.
struct TraceOut<'a> {
    path: &'a std::path::Path,
    file: std::fs::File,
    written: bool,
}

impl Drop for TraceOut<'_> {
    fn drop(&mut self) {
        if !self.written {
            let _ = std::fs::remove_file(self.path);
        }
    }
}

impl<'a> TraceOut<'a> {
    fn create(path: &'a std::path::Path) -> Result<Self, Failure> {
        let file = std::fs::File::create(path).map_err(|e| {
            Failure::Usage(anyhow::anyhow!(
                "--trace {}: cannot write the trace there ({e}); name a file in a directory you can write",
                path.display()
            ))
        })?;
        Ok(Self { path, file, written: false })
    }

    /// Writes the profiled steps' timeline (see `--trace`), with a step's memory timeline
    /// (`--memory-trace`) if there is one, and says where and what the memory peak held.
    fn write(
        &mut self,
        p: &Printer,
        trace: &profile::trace::Trace,
        memory: Option<(u64, &Timeline)>,
        args: &ConfigArgs,
    ) -> CmdResult {
        use std::io::Write;
        let what = match &args.config {
            Some(config) => format!("ava bench train {}", config.display()),
            None => "ava bench train".to_string(),
        };
        let chrome = match memory {
            Some((step, timeline)) => timeline.chrome_trace(Some(trace), &what, &format!("step {step}")),
            None => trace.to_chrome_json(&what),
        };
        let json = serde_json::to_vec(&chrome).expect("a JSON value serializes");
        let path = self.path;
        self.file.write_all(&json).and_then(|()| self.file.flush()).map_err(|e| {
            Failure::Runtime(anyhow::anyhow!("--trace {}: writing the trace failed ({e})", path.display()))
        })?;
        self.written = true;
        note_trace(p, path, trace);
        if let Some((step, timeline)) = memory {
            p.note(&memory_timeline::summary(step, timeline));
        }
        Ok(())
    }
}

/// Says where the trace went, how many spans it holds, and the host memory they took.
fn note_trace(p: &Printer, path: &std::path::Path, trace: &profile::trace::Trace) {
    let dropped = if trace.dropped > 0 { format!(", {} more not kept", trace.dropped) } else { String::new() };
    p.note(&format!(
        "trace: {} ({} spans{dropped}, taking {} of host memory while the steps ran: in the host figures); open \
         it in ui.perfetto.dev or chrome://tracing",
        path.display(),
        trace.spans.len(),
        size(trace.bytes())
    ));
}

/// The measured steps on the CPU, profiled, with the matmul rates sampled between them.
/// With `memory_step`, that step (1-based) is recorded as a memory timeline into `recording`.
fn cpu_bench(
    p: &Printer,
    trainer: &mut Trainer,
    header: &RunHeader,
    config: &Config,
    steps: u64,
    memory_step: Option<u64>,
    recording: &mut Option<Timeline>,
) -> CmdResult {
    let mut probe = MatmulProbe::new(header.threads)?;
    profile::reset();
    let mut seconds = 0.0;
    let mut step_times = Vec::new();
    let mut last = None;
    for n in 0..steps {
        let recorded = memory_step == Some(n + 1);
        if recorded {
            timeline::arm(timeline::DEFAULT_CAPACITY);
        }
        profile::enable(true);
        let held = ava_train::memory::current();
        let start = Instant::now();
        let stepped = trainer.train_step();
        let t = start.elapsed().as_secs_f64();
        profile::enable(false);
        if recorded {
            *recording = timeline::disarm();
        }
        last = Some(stepped.map_err(failure)?);
        profile::trace::record(format!("step {}", n + 1).into(), start, held);
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
    let matmul_path = profile::matmul_path();
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
            format!("matmul kernels     {matmul_path}"),
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
            "matmul_path": matmul_path,
            "memory": m,
            "offload_bytes": last.offload_bytes,
            "profile": ops.iter().map(|(n, s, f)| json!({"scope": n, "seconds_per_step": s, "share": f})).collect::<Vec<_>>(),
        })
    });
    Ok(())
}

/// NVIDIA's dense (no sparsity) bf16 tensor-core peak of an H100 SXM, which the H200 shares
/// (989.4 TFLOP/s on the datasheets): the yardstick of the GPU MFU, as of PyTorch's reference
/// (`torch_ref.py`), whatever card runs (its name labels the line, nothing more).
const GPU_PEAK_TFLOPS: f64 = 989.0;

/// Steps run after the measured ones on a GPU, with the device synchronized at every
/// profiler scope, for where the step time goes.
const PROFILED_STEPS: u64 = 2;

/// The side of the square bf16 matmul measured on a GPU (1.1 TFLOP a product).
const GPU_MATMUL_N: usize = 8192;

/// Timed bf16 matmuls on a GPU, after one untimed.
const GPU_MATMUL_REPEATS: usize = 10;

/// The steps measured on a GPU: each one's seconds, and the last one's record.
struct GpuSteps {
    seconds: Vec<f64>,
    last: StepRecord,
}

/// `steps` steps without profiling, each timed from a synchronized device to a synchronized
/// device (a step ends with the loss read on the host, but its optimizer update may still be
/// queued: the synchronization puts it in its own step's time).
fn timed_gpu_steps(trainer: &mut Trainer, device: &Device, steps: u64) -> Result<GpuSteps, Failure> {
    device.synchronize()?;
    let (mut seconds, mut last) = (Vec::new(), None);
    for _ in 0..steps {
        let start = Instant::now();
        let record = trainer.train_step().map_err(failure)?;
        device.synchronize()?;
        seconds.push(start.elapsed().as_secs_f64());
        last = Some(record);
    }
    Ok(GpuSteps { seconds, last: last.expect("at least one step") })
}

/// Profiler scopes: (name, seconds per step, share of the steps' time).
type Scopes = Vec<(String, f64, f64)>;

/// [`PROFILED_STEPS`] steps with every scope synchronizing the device: their scopes, and
/// those steps' mean seconds.
fn profiled_gpu_steps(trainer: &mut Trainer, device: &Device) -> Result<(Scopes, f64), Failure> {
    profile::reset();
    device.synchronize()?;
    profile::sync_with(Some(device.clone()));
    profile::enable(true);
    let start = Instant::now();
    let stepped = (0..PROFILED_STEPS).try_for_each(|n| {
        let (held, at) = (ava_train::memory::current(), Instant::now());
        let stepped = trainer.train_step().map(drop);
        profile::trace::record(format!("profiled step {}", n + 1).into(), at, held);
        stepped
    });
    let synced = device.synchronize();
    let seconds = start.elapsed().as_secs_f64();
    profile::enable(false);
    profile::sync_with(None);
    stepped.map_err(failure)?;
    synced?;
    let n = PROFILED_STEPS as f64;
    let ops = profile::totals()
        .into_iter()
        .map(|(name, d, _)| (name.to_string(), d.as_secs_f64() / n, d.as_secs_f64() / seconds))
        .collect();
    Ok((ops, seconds / n))
}

/// candle's bf16 matmul on `device`, [`GPU_MATMUL_N`]³: TFLOP/s of each timed product, the
/// device synchronized before and after each. The operands are freed on return.
fn gpu_matmul_tflops(device: &Device) -> Result<Vec<f64>, candle_core::Error> {
    let n = GPU_MATMUL_N;
    let a = Tensor::randn(0f32, 1.0, (n, n), device)?.to_dtype(DType::BF16)?; // (n, n)
    let b = Tensor::randn(0f32, 1.0, (n, n), device)?.to_dtype(DType::BF16)?; // (n, n)
    drop(a.matmul(&b)?); // warm-up: cuBLAS's handle and heuristics
    let flops = 2.0 * (n as f64).powi(3);
    let mut tflops = Vec::with_capacity(GPU_MATMUL_REPEATS);
    for _ in 0..GPU_MATMUL_REPEATS {
        device.synchronize()?;
        let start = Instant::now();
        let c = a.matmul(&b)?; // (n, n)
        device.synchronize()?;
        tflops.push(flops / start.elapsed().as_secs_f64() / 1e12);
        drop(c);
    }
    Ok(tflops)
}

/// The GPU step-time model's prediction for `config` on the card this is (recognized from
/// its name and memory), as `ava plan` ranks plans by; why not, when it cannot be made.
fn predicted_step(
    registry: &ava_plugins::Registry,
    config: &Config,
    name: Option<&str>,
    card_total: Option<u64>,
) -> Result<StepTime, String> {
    let name = name.ok_or("the device's name could not be read")?;
    let card = Card::recognize(name, card_total.unwrap_or(0))
        .ok_or_else(|| format!("{name} is none of the cards the model knows (`ava plan --help`, --card)"))?;
    let spec = ava_train::train::model_spec(config).map_err(|e| e.to_string())?;
    let selected = super::estimate::Selected::new(registry, config, &spec).map_err(|e| e.to_string())?;
    let est = ava_train::estimate::estimate(&spec, config, &selected.plugins()).map_err(|e| e.to_string())?;
    Ok(step_time::predict(&spec, config, &est, card))
}

/// The prediction beside the measured median step, with its terms.
fn predicted_line(t: &StepTime, measured: f64) -> String {
    let terms: Vec<String> =
        t.terms.iter().filter(|x| x.seconds > 0.0).map(|x| format!("{} {:.1}", x.name, 1e3 * x.seconds)).collect();
    format!(
        "predicted step     {:.1} ms on {} by `ava plan`'s GPU model ({} ms); measured/predicted ×{:.2}",
        1e3 * t.seconds,
        t.card,
        terms.join(", "),
        measured / t.seconds
    )
}

/// What streaming the optimizer state through the GPU cost in the last measured step: the
/// bytes each way, the copies' own time and rate, and how much of it compute hid.
fn stream_line(st: &ava_train::train::StreamStats) -> String {
    let moved = (st.read_bytes + st.written_bytes) as f64;
    let rate = if st.copy_seconds > 0.0 { moved / st.copy_seconds / 1e9 } else { 0.0 };
    let hidden = if st.copy_seconds > 0.0 { 1.0 - (st.wait_seconds / st.copy_seconds).min(1.0) } else { 1.0 };
    format!(
        "state streamed     {} up, {} back in the last step; copies {:.1} ms on their streams ({rate:.1} GB/s), \
         compute waited {:.1} ms for them ({:.0}% of the copy time hidden)",
        size(st.read_bytes),
        size(st.written_bytes),
        1e3 * st.copy_seconds,
        1e3 * st.wait_seconds,
        100.0 * hidden
    )
}

/// The measured steps on a GPU (see the module's documentation).
fn gpu_bench(
    p: &Printer,
    trainer: &mut Trainer,
    header: &RunHeader,
    (config, registry): (&Config, &ava_plugins::Registry),
    steps: u64,
    device: &Device,
) -> CmdResult {
    let tokens_per_step = header.tokens_per_step as f64;
    p.note(&format!("bench: {steps} measured steps, each ended by a device synchronization, not profiled"));
    let measured = timed_gpu_steps(trainer, device, steps)?;
    p.note(&format!("bench: {PROFILED_STEPS} more steps, profiled with the device synchronized at every scope"));
    let (ops, profiled_seconds) = profiled_gpu_steps(trainer, device)?;
    p.note(&format!("bench: candle's bf16 matmul, {GPU_MATMUL_N}³, on the device"));
    let matmul = median(&gpu_matmul_tflops(device)?);

    let times = &measured.seconds;
    let step_median = median(times);
    let step_mean = times.iter().sum::<f64>() / times.len() as f64;
    let fastest = times.iter().copied().fold(f64::INFINITY, f64::min);
    let slowest = times.iter().copied().fold(0.0, f64::max);
    let tokens_per_sec = tokens_per_step / step_median;
    let flops_per_token = trainer.model().spec().train_flops_per_token(config.data.seq_len);
    let model_tflops = tokens_per_sec * flops_per_token / 1e12;
    let (mfu, mfu_matmul) = (model_tflops / GPU_PEAK_TFLOPS, model_tflops / matmul);
    let spec = config.train.device;
    let name = super::bench_args::device_name(device);
    let last = &measured.last;
    let m = &last.memory;
    let card_total = last.device_memory.as_ref().map(|d| d.card_total);
    let predicted = predicted_step(registry, config, name.as_deref(), card_total);
    let text = || {
        let mut lines = vec![
            format!("device             {spec}{}", name.as_ref().map(|n| format!(", {n}")).unwrap_or_default()),
            format!("tokens/s           {tokens_per_sec:.0} (from the median step)"),
            format!(
                "step time          {:.1} ms median (mean {:.1}, fastest {:.1}, slowest {:.1}; each step ended by a \
                 device synchronization, not profiled)",
                1e3 * step_median,
                1e3 * step_mean,
                1e3 * fastest,
                1e3 * slowest
            ),
            format!(
                "model FLOPs/token  {:.1} M (6·N_matmul + 6·L·d·T, attention's causal half)",
                flops_per_token / 1e6
            ),
            format!("model TFLOP/s      {model_tflops:.1}"),
            format!(
                "MFU                {:.1}% of {GPU_PEAK_TFLOPS:.0} TFLOP/s (the dense bf16 peak of an H100/H200 SXM, \
                 PyTorch's reference's yardstick)",
                100.0 * mfu
            ),
            format!(
                "candle bf16 matmul {matmul:.1} TFLOP/s on this device ({GPU_MATMUL_N}³, median of \
                 {GPU_MATMUL_REPEATS}); MFU against it {:.1}%",
                100.0 * mfu_matmul
            ),
            format!(
                "device peak        {} (the memory pool's high-water mark over the last step) — params {}, grads {}, \
                 optimizer {}, data {}, activations {}",
                size(m.peak),
                size(m.params),
                size(m.grads),
                size(m.optimizer),
                size(m.data),
                size(m.activations)
            ),
        ];
        lines.push(match &predicted {
            Ok(t) => predicted_line(t, step_median),
            Err(why) => format!("predicted step     none: {why}"),
        });
        if let Some(st) = &last.stream {
            lines.push(stream_line(st));
        }
        if let Some(d) = &last.device_memory {
            lines.push(format!(
                "card in use        {} of {} (cuMemGetInfo after the last step: the pool's reserve, the CUDA \
                 context, cuBLAS's workspace, other processes)",
                size(d.card_used),
                size(d.card_total)
            ));
        }
        lines.push(format!(
            "where step time goes ({PROFILED_STEPS} more steps, {:.1} ms each: the device synchronized at every \
             scope's start and end, so slower than the steps above; a scope includes the scopes inside it, \
             backward: autograd (all) every backward scope):",
            1e3 * profiled_seconds
        ));
        for (name, per_step, share) in ops.iter().take(16) {
            lines.push(format!("  {name:<34} {:>8.1} ms/step  {:>5.1}%", 1e3 * per_step, 100.0 * share));
        }
        lines.join("\n")
    };
    p.result(text, || {
        json!({
            "device": {"spec": spec, "name": name},
            "tokens_per_sec": tokens_per_sec,
            "step_seconds_median": step_median,
            "step_seconds_mean": step_mean,
            "step_seconds_fastest": fastest,
            "step_seconds_slowest": slowest,
            "step_seconds": times,
            "flops_per_token": flops_per_token,
            "model_gflops": model_tflops * 1e3,
            "model_tflops": model_tflops,
            "mfu": mfu,
            "mfu_peak_tflops": GPU_PEAK_TFLOPS,
            "matmul_tflops": matmul,
            "matmul_n": GPU_MATMUL_N,
            "mfu_vs_matmul": mfu_matmul,
            "memory": m,
            "device_memory": last.device_memory,
            "stream": last.stream,
            "predicted_step": predicted.as_ref().ok(),
            "measured_over_predicted": predicted.as_ref().ok().map(|t| step_median / t.seconds),
            "profiled_steps": PROFILED_STEPS,
            "profiled_step_seconds": profiled_seconds,
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
        sets: sets.iter().map(|s| s.to_string()).chain(["offload.tiers=[device: 100%]".to_string()]).collect(),
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
        let mut config = run_config(context::load_config(&mode_args, p)?, p)?;
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
