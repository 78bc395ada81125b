//! `ava bench optimizer`: optimizers head to head on the tensors of a Llama-shaped model.
//! For each optimizer: the bytes of state per parameter its plugin declares and the bytes
//! the host allocator handed out for them, and the time of one step over every tensor,
//! taken through the engine's step op ([`ava_train::train::step_param`]) as training does.
//!
//! Steps are interleaved: step r of every optimizer runs before step r + 1 of any, so a slow
//! spell of a shared machine slows every optimizer alike and the ratios hold.

use std::time::Instant;

use ava_core::{PluginKind, StepContext};
use ava_train::config::PluginSelection;
use ava_train::memory;
use ava_train::model::{Model, ModelSpec, ParamRole};
use ava_train::train::{OptimizerState, optimizer_options, resolve_threads, step_param};
use candle_core::{Device, Tensor};
use serde_json::{Value, json};

use super::bench_args::{self, Flag, median, min};
use super::train::{failure, set_threads};
use crate::{
    CmdResult, Failure,
    cli::{BenchOptimizerArgs, ConfigArgs},
    context,
    output::{Printer, table},
};

/// How this bench names the optimizers it compares.
const OPTIMIZERS: Flag = Flag {
    name: "--names",
    noun: "optimizer",
    example_list: "adamw,adam-8bit",
    example_set: "adam-8bit.block_size=2048",
};

/// The optimizer step times are relative to.
const BASELINE: &str = "adamw";

/// Blocks of the benchmark model; its width grows with --params.
const LAYERS: usize = 4;

/// The learning rate and weight decay of the timed steps (their values do not change the
/// work an optimizer does).
const LR: f64 = 1e-3;
const WEIGHT_DECAY: f64 = 0.1;

/// One optimizer under test.
struct Bench {
    name: String,
    /// The options it was built with (the model's `head_dim` filled in where declared).
    options: Value,
    optimizer: Box<dyn ava_core::Optimizer>,
    state: OptimizerState,
    /// Bytes of state the layout declares: all tensors, and the 2-D ones alone.
    declared: u64,
    declared_matrices: u64,
    /// Bytes the host allocator handed out while the state was allocated.
    measured: u64,
    step_ms: Vec<f64>,
    /// The most bytes allocated above the level before a step, during it.
    peak: u64,
}

pub fn run(p: &Printer, args: &BenchOptimizerArgs) -> CmdResult {
    let names = bench_args::names(&OPTIMIZERS, &args.names)?;
    let sets = bench_args::parse_sets(&OPTIMIZERS, &args.set, &names)?;
    let threads = resolve_threads(args.threads.unwrap_or(0));
    set_threads(threads);
    let spec = model_for(args.params)?;
    let ctx = context::load(&ConfigArgs { config: args.config.clone(), set: Vec::new() }, p)?;

    let n = spec.num_params();
    p.note(&format!(
        "bench: {:.2}M parameters (d {}, {} blocks, {} heads of {}, SwiGLU {}, vocabulary {}), {} threads, 1 untimed + {} timed steps each",
        n as f64 / 1e6,
        spec.hidden,
        spec.layers,
        spec.heads,
        spec.head_dim(),
        spec.ffn,
        spec.vocab,
        threads,
        args.steps
    ));
    let kernel = ctx.registry.attention("standard", "")?;
    let model = Model::new(spec.clone(), 0, 16, kernel, "standard", threads).map_err(|e| Failure::Runtime(e.into()))?;
    // (numel,) per tensor: gradients of a typical size; the values do not change the work.
    let grads = model
        .params()
        .iter()
        .map(|p| Tensor::randn(0f32, 1e-3, p.def.shape.as_slice(), &Device::Cpu))
        .collect::<Result<Vec<_>, _>>()?;

    let mut benches = Vec::new();
    for name in &names {
        let selection = PluginSelection { name: name.clone(), options: sets.get(name).cloned().unwrap_or_default() };
        benches.push(build(&ctx.registry, &selection, &spec, &model)?);
    }

    // Step 0 is untimed: it faults in the zero-filled state pages.
    for step in 0..=args.steps {
        for b in &mut benches {
            let before = memory::current();
            memory::reset_peak();
            let start = Instant::now();
            for (i, (param, grad)) in model.params().iter().zip(&grads).enumerate() {
                let weight_decay = match param.def.role {
                    ParamRole::Matrix | ParamRole::ResidualOut => WEIGHT_DECAY,
                    ParamRole::Embedding | ParamRole::Norm | ParamRole::Bias => 0.0,
                };
                let ctx = StepContext {
                    step: u64::from(step) + 1,
                    lr: LR,
                    weight_decay,
                    threads: threads as u32,
                    grad_scale: 1.0,
                };
                step_param(b.optimizer.as_mut(), &b.name, param, grad, &mut b.state.buffers[i], ctx, 0)
                    .map_err(failure)?;
            }
            let ms = 1e3 * start.elapsed().as_secs_f64();
            if step > 0 {
                b.step_ms.push(ms);
                b.peak = b.peak.max(memory::peak().saturating_sub(before));
            }
        }
    }

    let baseline = benches.iter().find(|b| b.name == BASELINE).map(|b| median(&b.step_ms));
    let n = n as f64;
    let rows: Vec<Row> = benches
        .iter()
        .map(|b| {
            let ms = median(&b.step_ms);
            Row {
                name: &b.name,
                options: &b.options,
                declared: b.declared as f64 / n,
                measured: b.measured as f64 / n,
                matrices: b.declared_matrices as f64 / matrix_params(&spec) as f64,
                ms,
                fastest: min(&b.step_ms),
                per_million: ms / (n / 1e6),
                ratio: baseline.map(|base| ms / base),
                peak: b.peak,
            }
        })
        .collect();
    let header = json!({
        "params": n as u64,
        "hidden": spec.hidden,
        "layers": spec.layers,
        "heads": spec.heads,
        "head_dim": spec.head_dim(),
        "ffn": spec.ffn,
        "vocab": spec.vocab,
        "threads": threads,
        "steps": args.steps,
    });
    p.result(
        || render_text(&rows, memory::installed()),
        || json!({"model": header, "optimizers": rows.iter().map(Row::json).collect::<Vec<_>>()}),
    );
    Ok(())
}

/// The benchmark model for about `params` parameters: the widest d (a multiple of 64) whose
/// model fits, with heads of 64 and a SwiGLU width of 8d/3 rounded up to 64.
fn model_for(params: u64) -> Result<ModelSpec, Failure> {
    let spec = |d: usize| ModelSpec {
        eps: 1e-5,
        ..ModelSpec::llama(256, d, LAYERS, d / 64, d / 64, (8 * d / 3).div_ceil(64) * 64)
    };
    let smallest = spec(64).num_params() as u64;
    if params < smallest {
        return Err(Failure::Usage(anyhow::anyhow!(
            "--params {params} is below the smallest model this bench builds ({smallest} parameters: width 64, {LAYERS} blocks); try --params 1M"
        )));
    }
    let mut d = 64;
    while (spec(d + 64).num_params() as u64) <= params {
        d += 64;
    }
    Ok(spec(d))
}

/// Parameters in the model's 2-D tensors.
fn matrix_params(spec: &ModelSpec) -> u64 {
    spec.params().iter().filter(|p| p.shape.len() == 2).map(|p| p.numel() as u64).sum()
}

/// Builds one optimizer through the registry and allocates its state, counting the bytes.
fn build(
    registry: &ava_plugins::Registry,
    selection: &PluginSelection,
    spec: &ModelSpec,
    model: &Model,
) -> Result<Bench, Failure> {
    let name = &selection.name;
    let json = optimizer_options(registry, selection, spec).map_err(failure)?;
    let optimizer = registry.optimizer(name, &json).map_err(|e| {
        Failure::Usage(match (&e, selection.options.is_empty()) {
            (ava_plugins::HostError::Plugin { .. }, false) => anyhow::Error::new(e).context(format!(
                "optimizer '{name}' refused the options given with --set ({}); `ava plugins info {name}` lists the options it takes",
                Value::Object(selection.options.clone())
            )),
            _ => anyhow::anyhow!("--names {name}: {e}"),
        })
    })?;
    let manifest = registry.row(PluginKind::Optimizer, name).and_then(|r| r.manifest.clone());
    let options = manifest.map(|m| ava_core::Options::parse(&m, &json).to_json()).unwrap_or(Value::Null);
    let before = memory::current();
    let state = OptimizerState::allocate(optimizer.as_ref(), model.params(), name).map_err(failure)?;
    let measured = memory::current().saturating_sub(before);
    let declared = state.bytes();
    let mut declared_matrices = 0;
    for (param, buffers) in model.params().iter().zip(&state.buffers) {
        if param.def.shape.len() == 2 {
            declared_matrices += buffers.iter().map(|b| b.spec.bytes()).sum::<u64>();
        }
    }
    Ok(Bench {
        name: name.clone(),
        options,
        optimizer,
        state,
        declared,
        declared_matrices,
        measured,
        step_ms: Vec::new(),
        peak: 0,
    })
}

/// One line of the report.
struct Row<'a> {
    name: &'a str,
    options: &'a Value,
    declared: f64,
    measured: f64,
    matrices: f64,
    ms: f64,
    fastest: f64,
    per_million: f64,
    ratio: Option<f64>,
    peak: u64,
}

impl Row<'_> {
    fn json(&self) -> Value {
        json!({
            "name": self.name,
            "options": self.options,
            "state_bytes_per_param_declared": self.declared,
            "state_bytes_per_param_measured": self.measured,
            "matrix_state_bytes_per_param_declared": self.matrices,
            "step_ms_median": self.ms,
            "step_ms_fastest": self.fastest,
            "ms_per_million_params": self.per_million,
            "vs_adamw": self.ratio,
            "host_peak_bytes": self.peak,
        })
    }
}

fn render_text(rows: &[Row], counting: bool) -> String {
    let headers = [
        "optimizer",
        "declared B/param",
        "measured B/param",
        "matrices B/param",
        "ms/step",
        "ms per M params",
        "×adamw",
        "host peak",
    ];
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.name.to_string(),
                format!("{:.4}", r.declared),
                if counting { format!("{:.4}", r.measured) } else { "-".into() },
                format!("{:.4}", r.matrices),
                format!("{:.1} (fastest {:.1})", r.ms, r.fastest),
                format!("{:.2}", r.per_million),
                r.ratio.map_or("-".into(), |x| format!("{x:.2}")),
                if counting { format!("{:.1} KiB", r.peak as f64 / 1024.0) } else { "-".into() },
            ]
        })
        .collect();
    table(&headers, &cells)
}
