//! The command line, declared with clap. Kept in this crate only.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::output::Format;

/// Train transformer language models that would not otherwise fit in memory.
///
/// Every memory technique is a plugin picked by name in a YAML config: attention kernels,
/// optimizers, checkpoint policies, offload tiers and memory policies. Start with
/// `ava plugins list` to see what is installed, and `ava config show` to see the effective
/// configuration and where each value comes from.
#[derive(Debug, Parser)]
#[command(name = "ava", version, propagate_version = true, max_term_width = 100)]
pub struct Cli {
    /// Options every command takes.
    #[command(flatten)]
    pub global: GlobalArgs,
    /// The command.
    #[command(subcommand)]
    pub command: Command,
}

/// Options every command takes.
#[derive(Debug, Args)]
pub struct GlobalArgs {
    /// Print only results and errors (no warnings or progress).
    #[arg(short, long, global = true, conflicts_with = "verbose")]
    pub quiet: bool,
    /// Print more detail (repeat for even more).
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,
    /// Output format of results: text for people, json for scripts.
    #[arg(long, global = true, value_enum, default_value_t = Format::Text)]
    pub format: Format,
}

impl GlobalArgs {
    /// 0 quiet, 1 normal, 2+ verbose.
    pub fn verbosity(&self) -> u8 {
        if self.quiet { 0 } else { 1 + self.verbose }
    }
}

/// Where the configuration comes from (for commands that read it).
#[derive(Debug, Args, Clone, Default)]
pub struct ConfigArgs {
    /// Config file (YAML or TOML). Default: ./ava.yaml if it exists, else the built-in
    /// defaults. Environment variables AVA__SECTION__KEY override the file.
    #[arg(short, long, value_name = "FILE", env = "AVA_CONFIG")]
    pub config: Option<PathBuf>,
    /// Override one value, highest precedence: --set plugins.policy=vetted,
    /// --set 'plugins.optimizer={name: lion, betas: [0.9, 0.98]}'. Repeatable.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
}

/// The commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Train a model: the embedded default trains a small Llama on a synthetic corpus whose
    /// entropy floor is known, so the report says how close to optimal it got.
    ///
    /// Writes <train.out_dir>/metrics.jsonl, checkpoints/ (resumable) and, at the end,
    /// model/ (Hugging Face config.json + model.safetensors).
    ///
    /// One run per train.out_dir: a second run on it is refused while the first holds its
    /// lock, and a fresh run into a directory holding an earlier run needs --resume or
    /// --overwrite. Ctrl-C (SIGINT), SIGTERM or SIGHUP finishes the step under way, saves a
    /// checkpoint, prints the command that resumes and exits with 130, 143 or 129; a second
    /// signal stops at once.
    ///
    /// Examples:
    ///   ava train
    ///   ava train -c configs/small.yaml --set plugins.optimizer=lion --max-steps 200
    ///   ava train --resume latest
    ///   ava train --nproc 2 --set distributed.zero_stage=2     (or: mpirun -np 2 ava train ...)
    ///
    /// Under mpirun, rank 0 prints and writes the run's files; an error on any rank is printed
    /// with its rank and stops every rank.
    #[command(verbatim_doc_comment)]
    Train(TrainArgs),
    /// Predict peak memory (parameters, gradients, optimizer state, data, activations)
    /// from the config alone, before anything is allocated; prints every formula term.
    ///
    /// Works for models far bigger than this machine: ava estimate -c configs/llama-7b-24gb.yaml
    Estimate {
        /// Where the configuration comes from.
        #[command(flatten)]
        config: ConfigArgs,
        /// Estimate one rank of N data-parallel ranks (`mpirun -np N`): the micro-batch is
        /// per rank; with distributed.zero_stage ≥ 1 the optimizer state is the rank's share
        /// (split by whole parameters, as training splits it), and at stage 2 so are the
        /// gradients. Prints each rank's peak; the breakdown is the rank holding the most
        /// state's (or --rank's).
        #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=65536))]
        world_size: u32,
        /// With --world-size: the breakdown of this rank (0-based) instead.
        #[arg(long, value_name = "R", requires = "world_size")]
        rank: Option<u32>,
        /// The device to estimate for (train.device: cpu, cuda or cuda:N; default: the
        /// config's). On a GPU every term is device memory as the GPU engine allocates it (what
        /// `ava bench train` reports as the device peak), host memory is listed apart, and
        /// what a GPU run refuses (CPU-only plugins, several ranks) is refused here too.
        /// Needs no GPU: ava estimate -c configs/gpu-tinyllama-1b.yaml --device cuda
        #[arg(long, value_name = "DEVICE", value_parser = ava_train::device::DeviceSpec::parse)]
        device: Option<ava_train::device::DeviceSpec>,
    },
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Find configurations that fit a memory budget: searches the micro-batch (gradient
    /// accumulation keeps the effective batch), precision, where the weights live
    /// (train.master_weights: f32 masters, bf16 only, or masters in the offload tier), the
    /// optimizer step inside backward (with one micro-batch a step), checkpoint policy,
    /// attention kernel and optimizer among the installed plugins, and with --offload the
    /// optimizer state on disk; estimates each (as `ava estimate`) and ranks those that fit
    /// by predicted step time.
    ///
    /// Step time is predicted from FLOPs: three passes of the blocks and head, one more
    /// forward of each recomputed block, and this CPU engine's measured costs (ava bench):
    /// the attention kernel against standard (flash 1.06x), bf16 (2.2x fp32), a micro-step's
    /// fixed cost, each optimizer's step, rounding bf16-only weights, and the disk traffic
    /// a streaming plan waits for (less when the step runs inside backward). It is relative
    /// to the config as given.
    ///
    /// A GPU config (train.device: cuda) is planned for the GPU engine: peaks are device
    /// memory; only the plugins whose manifests take device buffers and the modes a GPU run
    /// accepts are searched, and where the optimizer state lives is searched too: on the
    /// device (offload.tiers: [device: 100%]), all in page-locked host memory streamed through
    /// the GPU each step ([ram: 100%]), where only streaming fits the largest device share
    /// that still fits (e.g. [device: 4%, ram: 96%]), and with --offload all of it through
    /// that disk tier. Each plan's host memory (that state, the loader's queue, the batch) is
    /// counted apart and must fit the host's RAM (--host-ram, default this machine's
    /// MemTotal, 10% kept back). Step times are predicted in milliseconds on a card (--card,
    /// default --budget's device, else h100-80gb): a roofline per kind of work (matmuls,
    /// attention, the memory-bound ops, recomputation, the optimizer step) at efficiencies
    /// measured on an H200, scaled to the card's datasheet peaks, plus the copies of state
    /// streamed over the card's link that compute does not hide (inside backward, backward
    /// hides them; after it, only the other parameters' steps) and a disk tier's time.
    /// `ava bench train` on a GPU prints the prediction beside the measured step.
    ///
    /// Examples:
    ///   ava plan --budget 24GiB -c configs/small.yaml
    ///   ava plan --budget rtx-4090-24gb --model llama-7b
    ///   ava plan --budget 200MiB -c configs/small.yaml --write small-200m.yaml && ava train -c small-200m.yaml
    ///   ava plan --budget 24GiB -c configs/llama-7b-24gb.yaml --offload nvme:/mnt/nvme
    ///   ava plan --budget 16GiB --card h200-141gb -c configs/gpu-llama2-7b-16gib.yaml
    #[command(verbatim_doc_comment)]
    Plan(PlanArgs),
    /// Generate text with a trained model: from a run directory (its model/, else its latest
    /// checkpoint), a checkpoint, or a Hugging Face folder, with the tokenizer it was trained
    /// with (the folder's tokenizer.json, or the run's corpus's). A KV cache keeps each
    /// block's keys and values, so each new token costs one position's work.
    ///
    /// Sampling: --greedy (the most likely token), or --temperature with --top-k and --top-p
    /// from --seed (the same seed gives the same text). Stops at the end-of-text token the
    /// model was trained with (unless --ignore-eos) or after --max-tokens.
    ///
    /// Examples:
    ///   ava generate runs/default
    ///   ava generate runs/fortunes --prompt "A friend" --max-tokens 200 --temperature 0.7
    ///   ava generate runs/fortunes/model --prompt "The" --greedy --format json
    #[command(verbatim_doc_comment)]
    Generate(GenerateArgs),
    /// Evaluate a trained model on a prepared corpus: the mean cross-entropy (nats/token)
    /// and perplexity over a split, in sequences of --seq-len tokens. Without --data, the
    /// run's own data (its validation split).
    ///
    /// Examples:
    ///   ava eval runs/fortunes                              # the run's validation split
    ///   ava eval runs/fortunes/model --data corpora/other --split train --batches 20
    #[command(verbatim_doc_comment)]
    Eval(EvalArgs),
    /// Report on runs from their metrics.jsonl. One run: a summary (loss, validation loss
    /// against the entropy floor, peak memory by component, micro-batch changes and memory
    /// events) and charts of its loss and memory, as SVG and PNG in RUN/report. Several
    /// runs: one metric by step side by side, as a table, JSON (--format json), a CSV file
    /// or a chart.
    ///
    /// Metrics are the fields of the step and eval records: val_loss (default), gap, loss,
    /// lr, grad_norm, tokens_per_sec, step_seconds, micro_batch, and memory.peak,
    /// memory.optimizer, memory.activations, ... (bytes).
    ///
    /// Examples:
    ///   ava report runs/small                              # summary, runs/small/report/*.svg|png
    ///   ava report runs/adamw runs/adam-8bit runs/adafactor
    ///   ava report runs/* --metric loss --csv loss.csv --plots charts
    #[command(verbatim_doc_comment)]
    Report(ReportArgs),
    /// Prepare corpora for training: tokenize text once into checksummed shards that
    /// training memory-maps (data.source: shards), inspect them, verify them.
    #[command(subcommand)]
    Data(DataCommand),
    /// List, inspect, vet, enable and disable plugins.
    #[command(subcommand)]
    Plugins(PluginsCommand),
    /// Show or validate the configuration.
    #[command(subcommand)]
    Config(ConfigCommand),
}

/// `ava plan` options.
#[derive(Debug, Args)]
pub struct PlanArgs {
    /// Where the configuration comes from (the model, data and effective batch to plan for).
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Memory to fit: a size (24GiB, 512MB; 3% is kept back for the estimate's error) or a
    /// device: rtx-3060-12gb, rtx-4090-24gb, a100-40gb, a100-80gb, h100-80gb, h200-141gb
    /// (10% kept back for the runtime), m2-16gb (65% usable: memory shared with the OS).
    #[arg(long, value_name = "SIZE|DEVICE")]
    pub budget: String,
    /// On a GPU config, the card whose speeds predict the plans' step times (one of the GPU
    /// devices --budget names). Default: --budget's own device, else h100-80gb. The model is a
    /// roofline per kind of work at efficiencies measured on an H200, scaled to the card's
    /// datasheet peaks; `ava bench train` prints it beside the measured step.
    #[arg(long, value_name = "DEVICE")]
    pub card: Option<String>,
    /// A model preset instead of the config's model section: tiny, small, llama-7b.
    #[arg(long, value_name = "PRESET")]
    pub model: Option<String>,
    /// How many of the configurations that fit to list, fastest first.
    #[arg(long, default_value_t = 8, value_name = "N")]
    pub top: usize,
    /// Write the fastest configuration that fits to FILE (YAML), ready for `ava train -c FILE`.
    #[arg(long, value_name = "FILE")]
    pub write: Option<PathBuf>,
    /// Also search streaming the optimizer state, and the f32 master weights, through this
    /// offload tier, TIER:PATH (e.g. nvme:/mnt/nvme): what it holds leaves memory, at the
    /// cost of the disk traffic each step (hidden behind backward when the step runs inside
    /// it). The plan checks the disk has room for the records.
    #[arg(long, value_name = "TIER:PATH")]
    pub offload: Option<String>,
    /// Plan one rank of N data-parallel ranks (`mpirun -np N`), the budget being each
    /// rank's: the micro-batch is per rank, and the ZeRO stage (distributed.zero_stage 0 to
    /// 3) is searched too.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub world_size: u32,
    /// On a GPU config, the RAM of the host the GPU is in (e.g. 128GiB; 10% is kept back for
    /// the OS): a plan whose host memory (its optimizer state streamed from page-locked host
    /// memory, the loader's queue, the batch) is over it does not fit. Default: this
    /// machine's MemTotal (/proc/meminfo).
    #[arg(long, value_name = "SIZE")]
    pub host_ram: Option<String>,
    /// Keep this setting as the config has it instead of searching it (repeatable, or
    /// comma-separated): train.micro_batch_size, train.precision, train.master_weights,
    /// train.step_in_backward, plugins.attention, plugins.optimizer, plugins.checkpoint,
    /// distributed.zero_stage, offload; the last part alone also works (--keep optimizer).
    #[arg(long, value_name = "KEY")]
    pub keep: Vec<String>,
}

/// `ava train` options.
#[derive(Debug, Args)]
pub struct TrainArgs {
    /// Where the configuration comes from.
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Train until this step (sets train.max_steps, which also ends the LR schedule).
    #[arg(long, value_name = "N")]
    pub max_steps: Option<u64>,
    /// Run at most N more steps now and stop with a checkpoint; the schedule still ends at
    /// max_steps, so a later `--resume latest` continues the same run exactly.
    #[arg(long, value_name = "N")]
    pub steps: Option<u64>,
    /// Continue from a checkpoint: `latest` (of <train.out_dir>/checkpoints) or a
    /// checkpoint directory.
    #[arg(long, value_name = "DIR|latest")]
    pub resume: Option<String>,
    /// Resume even if the config changes the model, the data or the plugins.
    #[arg(long, requires = "resume")]
    pub force: bool,
    /// Resume the weights, the step and the data position, but start the optimizer state
    /// afresh (e.g. to switch plugins.optimizer, which this allows without --force): its
    /// moments and step counts begin at zero, as at step 1.
    #[arg(long, requires = "resume")]
    pub fresh_optimizer: bool,
    /// Start a fresh run in a train.out_dir that holds an earlier run: deletes that run's
    /// metrics.jsonl, checkpoints/, model/, report/ and memory/ (nothing else in the
    /// directory), once this run holds the directory's lock. Without it such a run is refused.
    #[arg(long, conflicts_with = "resume")]
    pub overwrite: bool,
    /// Record these steps allocation by allocation (e.g. --memory-trace 2 or 2,500): each
    /// into <train.out_dir>/memory/ as step-N.trace.json (the profiled scopes as spans and
    /// the bytes held by owner as a counter track, for ui.perfetto.dev or chrome://tracing),
    /// step-N.json (the peak and what was live then; `ava report` shows it) and
    /// step-N.memory.{svg,png} (the bytes by owner stacked over the step, the peak marked,
    /// `ava estimate`'s peak as a line). The owner of an allocation is the engine's scope
    /// it was made in (e.g. `forward: attention kernel`). A recorded step runs with the
    /// profiler on: its time in metrics.jsonl includes the recording's. CPU runs only.
    #[arg(long, value_name = "STEP[,STEP...]", value_delimiter = ',')]
    pub memory_trace: Vec<u64>,
    /// Train with N data-parallel ranks on this machine: runs this same command under
    /// `mpirun -np N` (needs Open MPI's mpirun and an ava built with `--features mpi`).
    /// Each rank takes train.micro_batch_size sequences per micro-step; distributed.zero_stage
    /// picks what the ranks split. Same as `mpirun -np N ava train ...`.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub nproc: Option<u32>,
}

/// `ava generate` options.
#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// A run directory (train.out_dir), a checkpoint directory, or a Hugging Face folder.
    #[arg(value_name = "RUN_OR_MODEL")]
    pub model: PathBuf,
    /// Text to continue. Empty: start where a document starts (after the begin- or
    /// end-of-text token the model was trained with).
    #[arg(long, default_value = "")]
    pub prompt: String,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 128, value_name = "N")]
    pub max_tokens: usize,
    /// Always the most likely token (same as --temperature 0).
    #[arg(long, conflicts_with_all = ["temperature", "top_k", "top_p"])]
    pub greedy: bool,
    /// Divide the logits by this before sampling: lower is more conservative (0: greedy).
    #[arg(long, default_value_t = 0.8, value_name = "T")]
    pub temperature: f64,
    /// Sample only among the K most likely tokens (0: all).
    #[arg(long, default_value_t = 0, value_name = "K")]
    pub top_k: usize,
    /// Sample only among the most likely tokens whose probabilities add up to P (1: all).
    #[arg(long, default_value_t = 0.95, value_name = "P")]
    pub top_p: f64,
    /// Seed of the draws.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Keep going past the end-of-text token (it is then part of the output).
    #[arg(long)]
    pub ignore_eos: bool,
    /// A tokenizer.json to read and write text with, instead of the model's own.
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
    /// Compute threads (0: all cores).
    #[arg(long, default_value_t = 0, value_name = "N", value_parser = threads_arg)]
    pub threads: usize,
}

/// `ava eval` options.
#[derive(Debug, Args)]
pub struct EvalArgs {
    /// A run directory (train.out_dir), a checkpoint directory, or a Hugging Face folder.
    #[arg(value_name = "RUN_OR_MODEL")]
    pub model: PathBuf,
    /// A corpus prepared by `ava data prepare`. Default: the run's own data.
    #[arg(long, value_name = "DIR")]
    pub data: Option<PathBuf>,
    /// Which split: validation or train.
    #[arg(long, default_value = "validation", value_parser = ["validation", "train"])]
    pub split: String,
    /// Tokens per sequence, at most the model's context. Default: the run's data.seq_len (for
    /// a folder alone 256, or its context when shorter).
    #[arg(long, value_name = "T")]
    pub seq_len: Option<usize>,
    /// Sequences per batch (with --batches: how many sequences are read). Default: the
    /// run's train.eval_batch_size (its micro-batch), else 8.
    #[arg(long, value_name = "B")]
    pub batch_size: Option<usize>,
    /// Batches to evaluate. Default: one pass over a corpus split; for a source without an
    /// end (synthetic), the run's train.eval_batches, so the loss is the one training
    /// reported.
    #[arg(long, value_name = "N")]
    pub batches: Option<u64>,
    /// A tokenizer.json the model reads with, instead of its own.
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
    /// Compute threads (0: all cores).
    #[arg(long, default_value_t = 0, value_name = "N", value_parser = threads_arg)]
    pub threads: usize,
}

/// `ava report` options.
#[derive(Debug, Args)]
pub struct ReportArgs {
    /// Run directories (train.out_dir) or metrics.jsonl files; each becomes a column named
    /// after its directory.
    #[arg(required = true, value_name = "RUN")]
    pub runs: Vec<PathBuf>,
    /// The metric to compare: a field of the records, dotted for nested ones (memory.peak).
    /// Default val_loss. With one run and no --metric, the run's summary and charts instead.
    #[arg(long, value_name = "NAME")]
    pub metric: Option<String>,
    /// Also write the table as CSV to FILE: a `step` column, then one column per run
    /// (empty where a run has no value at that step).
    #[arg(long, value_name = "FILE")]
    pub csv: Option<PathBuf>,
    /// Where the charts go (SVG and PNG). One run: loss.* and memory.*, by default in
    /// RUN/report. Several runs: METRIC.*, only when this is given.
    #[arg(long, value_name = "DIR")]
    pub plots: Option<PathBuf>,
}

/// `ava bench ...`
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Training throughput on a config: tokens/s, model GFLOP/s, MFU against this
    /// machine's measured f32 matmul rate, peak memory by component, and where step time
    /// goes. On a GPU (train.device: cuda): tokens/s from the median step (each ended by a
    /// device synchronization), MFU against the H100/H200's dense bf16 peak beside candle's
    /// bf16 matmul measured on the device, device memory, and where step time goes over 2
    /// more steps synchronized at every profiled scope. Examples:
    /// ava bench train -c configs/small.yaml;
    /// ava bench train -c configs/gpu-tinyllama-1b.yaml --steps 10 --warmup 3
    Train {
        /// Where the configuration comes from.
        #[command(flatten)]
        config: ConfigArgs,
        /// Steps measured (after the warmup steps).
        #[arg(long, default_value_t = 10, value_name = "N")]
        steps: u64,
        /// Steps run first and not measured.
        #[arg(long, default_value_t = 2, value_name = "N")]
        warmup: u64,
        /// Compare the memory modes on the config's model, one after another: fp32; bf16
        /// with f32 masters; bf16 weights only (stochastic rounding); the same with the
        /// optimizer step inside backward; and, with --offload, the state (and the f32
        /// masters) streamed through the tier. Every mode runs one micro-batch per step
        /// with no clipping (what stepping inside backward needs), so they do the same work.
        #[arg(long)]
        modes: bool,
        /// With --modes: also stream the optimizer state through this tier, TIER:PATH
        /// (e.g. nvme:/mnt/nvme), and report the disk traffic and the time the step waited
        /// on it.
        #[arg(long, value_name = "TIER:PATH")]
        offload: Option<String>,
        /// Write the profiled steps as a timeline to FILE: Chrome's trace-event JSON, each
        /// profiler scope a span on its thread, each step a span, and the host memory the
        /// counting allocator held as a counter track, sampled at every span's start and end.
        /// Open it in ui.perfetto.dev or chrome://tracing. On the CPU every measured step is
        /// profiled; on a GPU the profiled steps after them.
        #[arg(long, value_name = "FILE")]
        trace: Option<std::path::PathBuf>,
        /// With --trace: also record every allocation and release of measured step STEP (1 is
        /// the first after the warmup) into the trace: the bytes held by owner (the
        /// profiler scope open when each was made, e.g. `backward: linear`; what was held
        /// before the step is one lump) as a counter track, the step's peak and the 50
        /// largest allocations as instant events, and the buffers live at the peak listed
        /// here, by owner. Also draws FILE's stem + .memory.{svg,png} beside it: the bytes by
        /// owner stacked over the step, the peak marked, `ava estimate`'s peak as a line. The
        /// recorded step is one of the measured ones: its time includes the recording's. CPU
        /// runs only. Example: ava bench train -c configs/small.yaml --trace step.json
        /// --memory-trace 2
        #[arg(long, value_name = "STEP", requires = "trace")]
        memory_trace: Option<u64>,
    },
    /// Attention kernels head to head: time, saved-for-backward memory, peak memory and
    /// accuracy against the dense kernel with the same mask, per sequence length.
    ///
    /// For each T and kernel it makes random q, k, v and dout (the same for every kernel),
    /// then runs forward and backward --repeats times, each time allocating out, saved and
    /// dq, dk, dv afresh as the training engine does every step. Repeats take turns across
    /// the kernels, so a slow spell of a shared machine slows them all alike. Columns:
    ///   fwd ms       forward, allocation of out and saved included (median of the repeats)
    ///   fwd+bwd ms   forward plus backward, allocation of dq, dk, dv included (median)
    ///   ×standard    fwd+bwd time divided by standard's at the same T
    ///   saved        bytes the kernel keeps from forward for backward (saved_len · 4)
    ///   ×standard    saved bytes divided by standard's (its B·H·T² probabilities)
    ///   host peak    the most bytes the host allocator held during forward + backward above
    ///                what it held before: out, saved, dq, dk, dv, plus what a built-in
    ///                kernel allocates itself. A plugin library allocates its scratch with
    ///                its own allocator, which this count does not see.
    ///   max err      largest |difference| of out, dq, dk, dv from the dense kernel under the
    ///                same mask: causal (or full) for standard and flash, the band of
    ///                sliding-window, the blocks of block-sparse, each with the options given;
    ///                another kernel is assumed plain causal (marked *). '-' when that dense
    ///                reference's T² probabilities would need over 4 GiB
    ///
    /// With --device cuda (a build with the `cuda` feature) each kernel runs on the GPU through
    /// the training engine's attention op (its device calls, on device buffers in --dtype, bf16
    /// by default), causal, after one untimed warm-up call; only kernels whose manifests list
    /// cuda can run there (by default, all the installed ones that do). Columns there:
    ///   fwd ms, fwd+bwd ms  median of the repeats (10 by default), each from a synchronized
    ///                device to a synchronized device; fwd+bwd is candle's autograd of Σ out·dout
    ///   TFLOP/s      4·B·H·T²·D/2 per forward (the causal half), 3.5× that per forward +
    ///                backward (backward as 2.5 forwards), as PyTorch's attn_ref.py counts
    ///   device peak  the most the device's memory pool held during forward + backward above
    ///                what it held before
    ///   max err      largest |difference| of out, dq, dk, dv from the same kernel on the CPU in
    ///                f32 on the same (rounded) inputs; '-' beyond T=4096
    ///
    /// Examples:
    ///   ava bench attention
    ///   ava bench attention --kernels flash,sliding-window --seq 8192 --set sliding-window.window=512
    ///   ava bench attention --seq 1024 --heads 8 --kv-heads 2 --set block-sparse.stride=8 --format json
    ///   ava bench attention --device cuda --kernels standard,flash --seq 2048,4096,8192 \
    ///       --heads 32 --kv-heads 4 --head-dim 64
    #[command(verbatim_doc_comment)]
    Attention(BenchAttentionArgs),
    /// Optimizers head to head on the tensors of a Llama-shaped model: bytes of state per
    /// parameter and step time.
    ///
    /// It builds a model of about --params parameters (byte vocabulary, 4 blocks, width d
    /// chosen to fit, heads of 64, SwiGLU 8d/3), one random gradient per tensor, and each
    /// optimizer's state as training does (the buffers its plugin declares, allocated by
    /// the engine). Then every optimizer steps every tensor --steps times through the
    /// engine's step op, after one untimed step; steps take turns across the optimizers,
    /// so a slow spell of a shared machine slows them all alike. Columns:
    ///   declared B/param  bytes of state the plugin's layout declares, per parameter
    ///   measured B/param  bytes the host allocator handed out while allocating that state
    ///   matrices B/param  declared bytes of the 2-D tensors only, per parameter of theirs
    ///   ms/step           one step over every tensor (median of --steps)
    ///   ms per M params   that divided by the millions of parameters
    ///   ×adamw            step time divided by adamw's (when adamw is in --names)
    ///   host peak         the most bytes allocated above the state during a step; a plugin
    ///                     library's own allocations are not seen by this count
    ///
    /// Examples:
    ///   ava bench optimizer
    ///   ava bench optimizer --names adamw,adam-8bit --params 100M --threads 1
    ///   ava bench optimizer --names adam-8bit --set adam-8bit.block_size=2048 --format json
    #[command(verbatim_doc_comment)]
    Optimizer(BenchOptimizerArgs),
    /// An offload tier's throughput on a disk, and what streaming the optimizer state
    /// through it costs a training step.
    ///
    /// First it writes --total bytes as records of --record bytes through the tier (the
    /// disk's own directory is made inside --path and removed after), waiting for every
    /// write; then reads them back one by one, each read waiting for the disk; then again
    /// with the next records prefetched, as training reads the optimizer state. With
    /// direct_io off the reads may come from the page cache: the write rate is the disk's.
    /// Compare with the disk's ceiling on the same directory, e.g.
    ///   dd if=/dev/zero of=DIR/x bs=4M count=128 oflag=direct conv=fsync
    ///
    /// Then, unless --steps 0, it trains the config (-c, default ./ava.yaml or the built-in
    /// one) twice, steps taking turns: the optimizer state in memory, and all of it streamed
    /// through the tier (offload.tiers: [TIER: 100%]); it reports each one's median step
    /// time and the optimizer state held in memory at its most.
    ///
    /// Examples:
    ///   ava bench offload --path /mnt/nvme
    ///   ava bench offload --path /mnt/nvme -c configs/small.yaml --tier-set direct_io=off
    ///   ava bench offload --path /tmp --record 64MiB --total 1GiB --steps 0 --format json
    #[command(verbatim_doc_comment)]
    Offload(BenchOffloadArgs),
    /// The data pipeline: `ava data prepare`'s MB/s of text (byte tokenizer, and with
    /// --tokenizer that tokenizer.json beside the Python tokenizers package's batch encoding
    /// of the same documents), then the training loader streaming a corpus of --corpus bytes
    /// written for the benchmark: resident memory after the first batch and at its largest,
    /// and again with the corpus listed --scale times over. Everything written is deleted.
    ///
    /// Examples:
    ///   ava bench data                                    # 256 MB of text, an 8 GiB corpus
    ///   ava bench data --tokenizer tokenizer.json --corpus 0
    ///   ava bench data --text-mb 0 --corpus 1GiB --batches 2000 --dir /mnt/nvme
    #[command(verbatim_doc_comment)]
    Data(BenchDataArgs),
    /// The collectives data-parallel training uses, between the ranks of an MPI job: time
    /// per call and bandwidth for all-reduce (gradients, stages 0-1), reduce-scatter (stage
    /// 2) and all-gather (the updated weights, stages 1-2) of one buffer, through the same
    /// trait the trainer calls. Run it under mpirun; rank 0 prints.
    ///
    /// Columns (NCCL-tests' conventions, n ranks, S bytes):
    ///   ms        median time of one call over --iters calls (after --warmup)
    ///   algbw     S / time
    ///   busbw     what each rank's links carried: algbw · 2(n-1)/n for all-reduce,
    ///             algbw · (n-1)/n for reduce-scatter and all-gather
    ///
    /// Examples:
    ///   mpirun -np 2 ava bench collectives --size 64MiB
    ///   ava bench collectives --nproc 2 --size 25MiB --format json
    #[command(verbatim_doc_comment)]
    Collectives(BenchCollectivesArgs),
}

/// `ava bench collectives` options.
#[derive(Debug, Args)]
pub struct BenchCollectivesArgs {
    /// Bytes per call (f32 elements: SIZE / 4), e.g. 25MiB, the default gradient bucket.
    #[arg(long, default_value = "64MiB", value_name = "SIZE", value_parser = parse_size_arg)]
    pub size: u64,
    /// Calls measured per collective.
    #[arg(long, default_value_t = 20, value_name = "N")]
    pub iters: usize,
    /// Calls run first and not measured.
    #[arg(long, default_value_t = 3, value_name = "N")]
    pub warmup: usize,
    /// Start N ranks under mpirun (as `ava train --nproc`).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub nproc: Option<u32>,
}

/// `ava bench offload` options.
#[derive(Debug, Args)]
pub struct BenchOffloadArgs {
    /// Directory on the disk to measure.
    #[arg(long, value_name = "DIR")]
    pub path: PathBuf,
    /// The offload tier plugin measured.
    #[arg(long, default_value = "nvme", value_name = "NAME")]
    pub tier: String,
    /// A tier option, OPTION=VALUE (repeatable), e.g. --tier-set direct_io=off
    /// --tier-set io_threads=4. VALUE is read as JSON when it is one, else as text.
    #[arg(long = "tier-set", value_name = "OPTION=VALUE")]
    pub tier_set: Vec<String>,
    /// Bytes per record (about one parameter's optimizer state), e.g. 4MiB.
    #[arg(long, default_value = "4MiB", value_name = "SIZE", value_parser = parse_size_arg)]
    pub record: u64,
    /// Bytes written and read back in all, e.g. 512MiB.
    #[arg(long, default_value = "256MiB", value_name = "SIZE", value_parser = parse_size_arg)]
    pub total: u64,
    /// Training steps measured per placement (0: only the throughput).
    #[arg(long, default_value_t = 5, value_name = "N")]
    pub steps: u64,
    /// Training steps run first per placement and not measured.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub warmup: u64,
    /// Where the training configuration comes from.
    #[command(flatten)]
    pub config: ConfigArgs,
}

/// `ava bench data` options.
#[derive(Debug, Args)]
pub struct BenchDataArgs {
    /// MB of generated English-like text to prepare (0: skip preparing).
    #[arg(long, default_value_t = 256, value_name = "MB")]
    pub text_mb: u64,
    /// Prepare these files or directory instead of generated text.
    #[arg(long, value_name = "PATH")]
    pub input: Option<PathBuf>,
    /// How --input is read into documents (as `ava data prepare` reads it).
    #[command(flatten)]
    pub reading: ReadingArgs,
    /// Also prepare with this tokenizer.json, and compare with Python's tokenizers.
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
    /// Bytes of shards to write and stream (0: skip streaming), e.g. 8GiB.
    #[arg(long, default_value = "8GiB", value_name = "SIZE", value_parser = parse_size_or_zero)]
    pub corpus: u64,
    /// Batches to stream.
    #[arg(long, default_value_t = 10_000, value_name = "N")]
    pub batches: u64,
    /// Also stream the corpus listed this many times over (hard links), to show memory does
    /// not grow with the corpus (1: skip).
    #[arg(long, default_value_t = 10, value_name = "N")]
    pub scale: usize,
    /// Sequences per batch.
    #[arg(long, default_value_t = 8, value_name = "B")]
    pub batch_size: usize,
    /// Tokens per sequence (each holds T + 1).
    #[arg(long, default_value_t = 256, value_name = "T")]
    pub seq_len: usize,
    /// Where to write (a directory on the disk to measure).
    #[arg(long, default_value = "/tmp", value_name = "DIR")]
    pub dir: PathBuf,
}

/// Parses a byte size, 0 included (for options where 0 skips something).
fn parse_size_or_zero(s: &str) -> Result<u64, String> {
    if s.trim() == "0" { Ok(0) } else { parse_size_arg(s) }
}

/// Parses a byte size such as 4MiB or 1048576.
fn parse_size_arg(s: &str) -> Result<u64, String> {
    match ava_core::parse_size(s) {
        Ok(0) => Err("must be more than 0 bytes".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("{e}: write a size such as 4MiB or 1048576")),
    }
}

/// `ava bench optimizer` options.
#[derive(Debug, Args)]
pub struct BenchOptimizerArgs {
    /// Optimizers to compare, by plugin name (see `ava plugins list --kind optimizer`).
    #[arg(
        long,
        value_name = "NAME,...",
        value_delimiter = ',',
        default_value = "adamw,adam-8bit,adafactor,adam-mini,lion"
    )]
    pub names: Vec<String>,
    /// Parameters of the model whose tensors are stepped: a count with an optional K, M or B
    /// suffix (powers of 1000), e.g. 8M or 1.5B.
    #[arg(long, default_value = "8M", value_name = "N", value_parser = parse_count)]
    pub params: u64,
    /// Timed steps per optimizer, taking turns across optimizers; times are their median.
    #[arg(long, default_value_t = 5, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub steps: u32,
    /// Threads each optimizer may use. Default (or 0): one per core, as training uses.
    #[arg(long, value_name = "N", value_parser = threads_arg)]
    pub threads: Option<usize>,
    /// An optimizer option, OPTIMIZER.OPTION=VALUE (repeatable), checked by the optimizer;
    /// e.g. --set adam-8bit.block_size=2048 --set adafactor.beta1=0.9.
    #[arg(long = "set", value_name = "OPTIMIZER.OPTION=VALUE")]
    pub set: Vec<String>,
    /// Config file whose `plugins` section (search paths, vetting policy) says where
    /// optimizers come from. Default: ./ava.yaml if it exists.
    #[arg(short, long, value_name = "FILE", env = "AVA_CONFIG")]
    pub config: Option<PathBuf>,
}

/// Parses a parameter count: digits with an optional K, M or B suffix (powers of 1000).
fn parse_count(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (number, scale) = match t.char_indices().last() {
        Some((i, c)) if c.eq_ignore_ascii_case(&'k') => (&t[..i], 1e3),
        Some((i, c)) if c.eq_ignore_ascii_case(&'m') => (&t[..i], 1e6),
        Some((i, c)) if c.eq_ignore_ascii_case(&'b') => (&t[..i], 1e9),
        _ => (t, 1.0),
    };
    match number.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v * scale <= 1e12 => Ok((v * scale).round() as u64),
        _ => Err(format!("expected a parameter count such as 8M, 250K or 1.5B, got '{s}'")),
    }
}

/// `ava bench attention` options.
#[derive(Debug, Args)]
pub struct BenchAttentionArgs {
    /// Attention kernels to compare, by plugin name (see `ava plugins list --kind attention`).
    /// Default: standard,flash,sliding-window,block-sparse on the CPU; on a GPU, the
    /// installed kernels that run there.
    #[arg(long, value_name = "NAME,...", value_delimiter = ',')]
    pub kernels: Option<Vec<String>>,
    /// Sequence lengths T to measure.
    #[arg(long, value_name = "T,...", value_delimiter = ',', default_value = "256,1024,2048,4096", value_parser = parse_seq)]
    pub seq: Vec<u32>,
    /// Query heads H.
    #[arg(long, default_value_t = 4, value_name = "H", value_parser = clap::value_parser!(u32).range(1..))]
    pub heads: u32,
    /// Key/value heads (grouped-query attention; must divide --heads). Default: --heads.
    #[arg(long, value_name = "H", value_parser = clap::value_parser!(u32).range(1..))]
    pub kv_heads: Option<u32>,
    /// Head dimension D.
    #[arg(long, default_value_t = 64, value_name = "D", value_parser = clap::value_parser!(u32).range(1..))]
    pub head_dim: u32,
    /// Batch size B.
    #[arg(long, default_value_t = 1, value_name = "B", value_parser = clap::value_parser!(u32).range(1..))]
    pub batch: u32,
    /// Causal (true) or full (false) attention.
    #[arg(long, default_value_t = true, value_name = "BOOL", action = clap::ArgAction::Set)]
    pub causal: bool,
    /// Threads each kernel may use (on a GPU: the CPU reference). Default (or 0): one per
    /// core, as training uses.
    #[arg(long, value_name = "N", value_parser = threads_arg)]
    pub threads: Option<usize>,
    /// Forward + backward runs per kernel and T, taking turns across kernels; times are
    /// their median. Default: 3 on the CPU, 10 on a GPU.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub repeats: Option<u32>,
    /// Where the kernels run: cpu (their host calls), or cuda / cuda:N (the GPU of that
    /// ordinal, through the training engine's attention op; needs a build with the `cuda`
    /// feature).
    #[arg(long, default_value = "cpu", value_name = "DEVICE", value_parser = parse_device)]
    pub device: ava_train::device::DeviceSpec,
    /// The type of q, k, v, the output and the gradients on a GPU: f32, bf16 or f16 (the
    /// kernels compute in f32). Default: bf16 on a GPU; the CPU takes f32 only.
    #[arg(long, value_enum, value_name = "TYPE")]
    pub dtype: Option<AttnDtype>,
    /// A kernel option, KERNEL.OPTION=VALUE (repeatable), checked by the kernel; e.g.
    /// --set sliding-window.window=512 --set block-sparse.stride=8. Options not given take
    /// the kernel's defaults (see `ava plugins info NAME`).
    #[arg(long = "set", value_name = "KERNEL.OPTION=VALUE")]
    pub set: Vec<String>,
    /// Config file whose `plugins` section (search paths, vetting policy) says where kernels
    /// come from. Default: ./ava.yaml if it exists.
    #[arg(short, long, value_name = "FILE", env = "AVA_CONFIG")]
    pub config: Option<PathBuf>,
}

/// The element types `ava bench attention --dtype` takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum AttnDtype {
    /// 32-bit floats.
    F32,
    /// bfloat16, as mixed-precision training computes.
    Bf16,
    /// IEEE half precision.
    F16,
}

/// Parses `--device`: cpu, cuda or cuda:N.
fn parse_device(s: &str) -> Result<ava_train::device::DeviceSpec, String> {
    ava_train::device::DeviceSpec::parse(s.trim())
}

/// Parses one sequence length of `--seq`.
fn parse_seq(s: &str) -> Result<u32, String> {
    match s.trim().parse::<u64>() {
        Ok(0) => Err("a sequence length must be at least 1".into()),
        Ok(t) => u32::try_from(t).map_err(|_| format!("a sequence length must be at most {}", u32::MAX)),
        Err(_) if s.trim().is_empty() => {
            Err("expected sequence lengths separated by commas, e.g. --seq 256,1024; got an empty one".into())
        }
        Err(_) => Err("expected a sequence length (a whole number >= 1)".into()),
    }
}

/// `ava data ...`
#[derive(Debug, Subcommand)]
pub enum DataCommand {
    /// Tokenize text into shards of token ids and a manifest, once, for any number of runs.
    ///
    /// Inputs are files or directories (walked in sorted order, hidden entries and links
    /// skipped): text (one document per file, or cut at --separator), JSONL (*.jsonl,
    /// *.ndjson; the text is --field), each optionally gzip (.gz) or Zstandard (.zst)
    /// compressed, and Parquet (*.parquet; one document per row of the string column --field).
    /// Every document gets the tokenizer's end-of-text id after it; a hash of its index
    /// holds --val-fraction of them out for validation.
    ///
    /// A shard is written whole and fsynced before the manifest (replaced atomically) lists
    /// it: a killed run, run again with the same arguments, continues from its first
    /// unfinished shard; a finished corpus is left alone.
    ///
    /// Examples:
    ///   ava data prepare books/ --out corpora/books
    ///   ava data prepare dump.jsonl.zst --field text --tokenizer tokenizer.json --out corpora/dump
    ///   ava data prepare train-00000-of-00004.parquet --field content --out corpora/hub
    ///   ava data prepare notes.txt --separator $'\n\n' --invalid replace --out corpora/notes
    ///   ava train --set data.source=shards --set data.path=corpora/books --set model.vocab_size=257
    #[command(verbatim_doc_comment)]
    Prepare(PrepareArgs),
    /// Learn a byte-level BPE tokenizer (GPT-2's scheme, with the tokenizers crate) from
    /// text read as `prepare` reads it, and write it as a Hugging Face tokenizer.json with
    /// <|endoftext|> as its end-of-text token. Holds the documents in memory: train it on a
    /// sample of a large corpus.
    ///
    /// Example:
    ///   ava data train-tokenizer books/ --vocab-size 8192 --out books-bpe.json
    ///   ava data prepare books/ --tokenizer books-bpe.json --out corpora/books-bpe
    #[command(verbatim_doc_comment)]
    TrainTokenizer(TrainTokenizerArgs),
    /// Summarize a prepared corpus: tokenizer, documents and tokens per split, shards, inputs.
    Info {
        /// The corpus directory.
        dir: PathBuf,
    },
    /// Check every shard of a prepared corpus against the manifest (size, header, SHA-256);
    /// names every damaged shard, exit code 1 if any. Training checks the same when it
    /// opens a corpus.
    Verify {
        /// The corpus directory.
        dir: PathBuf,
    },
}

/// What `--invalid` accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum InvalidArg {
    /// Stop, naming the file and byte offset.
    Error,
    /// Replace each invalid sequence with U+FFFD.
    Replace,
    /// Leave the document out.
    Skip,
}

impl From<InvalidArg> for ava_data::prepare::Invalid {
    fn from(a: InvalidArg) -> Self {
        match a {
            InvalidArg::Error => Self::Error,
            InvalidArg::Replace => Self::Replace,
            InvalidArg::Skip => Self::Skip,
        }
    }
}

/// How `ava data prepare` and `train-tokenizer` cut their inputs into documents.
#[derive(Debug, Args)]
pub struct ReadingArgs {
    /// Cut text files into documents at this string (default: one document per file).
    #[arg(long, value_name = "STRING")]
    pub separator: Option<String>,
    /// The JSONL field, or Parquet column, holding the text.
    #[arg(long, value_name = "NAME", default_value = "text")]
    pub field: String,
    /// What to do with invalid UTF-8.
    #[arg(long, value_enum, default_value_t = InvalidArg::Error)]
    pub invalid: InvalidArg,
}

impl ReadingArgs {
    /// The options as the data crate takes them.
    pub fn reading(&self) -> ava_data::prepare::Reading {
        ava_data::prepare::Reading {
            separator: self.separator.clone(),
            field: self.field.clone(),
            invalid: self.invalid.into(),
        }
    }
}

/// `ava data train-tokenizer` options.
#[derive(Debug, Args)]
pub struct TrainTokenizerArgs {
    /// Text, JSONL (.gz/.zst too) and Parquet files, and directories, in order.
    #[arg(required = true, value_name = "INPUT")]
    pub inputs: Vec<PathBuf>,
    /// The tokenizer.json to write.
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
    /// Ids in the vocabulary: the end-of-text token, 256 bytes, and learned merges (at most
    /// 2097152, the most ids a tokenizer may have).
    #[arg(long, value_name = "N", default_value_t = 8192)]
    pub vocab_size: usize,
    /// Text to learn from at most: the inputs' documents are read in order until this many
    /// bytes are held (in memory while the merges are learned; a document is read whole before
    /// it is cut, and a text file without --separator is one document of at most 1 GiB), so a
    /// large corpus, or an endless stream cut at --separator, trains on its beginning; the
    /// summary says when the inputs went further.
    #[arg(long, value_name = "SIZE", default_value = "1GiB", value_parser = parse_size_arg)]
    pub max_bytes: u64,
    /// How the inputs become documents.
    #[command(flatten)]
    pub reading: ReadingArgs,
    /// Replace --out if it exists.
    #[arg(long)]
    pub force: bool,
}

/// `ava data prepare` options.
#[derive(Debug, Args)]
pub struct PrepareArgs {
    /// Text, JSONL (.gz/.zst too) and Parquet files, and directories, in order.
    #[arg(required = true, value_name = "INPUT")]
    pub inputs: Vec<PathBuf>,
    /// The corpus directory (created; must be empty, or hold this same corpus).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// A Hugging Face tokenizer.json, or `byte` (ids 0-255 and 256 for end of text).
    #[arg(long, value_name = "FILE|byte")]
    pub tokenizer: Option<PathBuf>,
    /// The tokenizer's end-of-text token (default: the first of <|endoftext|>,
    /// <|end_of_text|>, </s>, <eos>, <|eos|>, [SEP] it has).
    #[arg(long, value_name = "TOKEN")]
    pub eos: Option<String>,
    /// A token to put before every document (e.g. <s>); none by default.
    #[arg(long, value_name = "TOKEN")]
    pub bos: Option<String>,
    /// How the inputs become documents.
    #[command(flatten)]
    pub reading: ReadingArgs,
    /// Share of documents held out for validation.
    #[arg(long, value_name = "FRACTION", default_value_t = 0.005)]
    pub val_fraction: f64,
    /// Token ids per shard (memory while preparing: one shard's ids).
    #[arg(long, value_name = "N", default_value_t = ava_data::prepare::DEFAULT_SHARD_TOKENS)]
    pub shard_tokens: u64,
    /// Replace a different corpus, or write into a directory holding other files (they are
    /// left alone).
    #[arg(long)]
    pub force: bool,
}

/// `ava plugins ...`
#[derive(Debug, Subcommand)]
pub enum PluginsCommand {
    /// Every plugin, built-in and found on disk, with its status and why.
    ///
    /// Statuses: builtin, loaded (policy open), vetted (pinned, bytes match), unvetted
    /// (policy warn, not pinned), modified (pinned but the bytes changed: never loaded),
    /// incompatible (another contract version, or not an Ava plugin), refused (by policy).
    List {
        /// Only plugins of this kind: attention, optimizer, checkpoint, offload, memory.
        #[arg(long, value_name = "KIND")]
        kind: Option<String>,
        /// Where the configuration comes from.
        #[command(flatten)]
        config: ConfigArgs,
    },
    /// A plugin's manifest: summary, options with defaults and docs, file, sha256, status.
    Info {
        /// Plugin name (e.g. lion) or path of a plugin library.
        name: String,
        /// Disambiguates a name used by several kinds.
        #[arg(long, value_name = "KIND")]
        kind: Option<String>,
        /// Where the configuration comes from.
        #[command(flatten)]
        config: ConfigArgs,
    },
    /// Pin a plugin library in the lock file (name, version, sha256), vetting it for
    /// `plugins.policy: vetted`. Opens the library to read its manifest.
    Vet {
        /// Path of the library, or the name of a plugin in the search paths.
        path_or_name: String,
        /// Lock file to write (default: plugins.lock_file from the config, ava-plugins.lock).
        #[arg(long, value_name = "FILE")]
        lock: Option<PathBuf>,
        /// Where the configuration comes from.
        #[command(flatten)]
        config: ConfigArgs,
    },
    /// Sign the lock file (ed25519) for machines whose policy names trusted keys: there an
    /// unsigned lock, or one changed since it was signed, is refused whole. Writes
    /// `<lock>.sig` beside it; re-sign after every `ava plugins vet`.
    ///
    /// Example: ava plugins sign --key ~/.config/ava/team.key
    Sign {
        /// The secret key file, from `ava plugins keygen`.
        #[arg(long, value_name = "FILE")]
        key: PathBuf,
        /// Lock file to sign (default: the lock file in force: the machine policy's, else
        /// plugins.lock_file).
        #[arg(long, value_name = "FILE")]
        lock: Option<PathBuf>,
        /// Where the configuration comes from.
        #[command(flatten)]
        config: ConfigArgs,
    },
    /// Make an ed25519 key pair for `ava plugins sign`. The secret key goes to FILE (mode 600,
    /// never overwritten: keep it off the machines that run ava); the public key is printed,
    /// for the machine policy's `trusted_keys` (/etc/ava/policy.yaml).
    ///
    /// Example: ava plugins keygen ~/.config/ava/team.key
    Keygen {
        /// Where to write the secret key.
        out: PathBuf,
    },
    /// Select a plugin for its kind by writing it into the config file.
    ///
    /// Example: ava plugins enable optimizer lion --set betas=[0.9,0.98]
    Enable {
        /// attention, optimizer, checkpoint, offload or memory.
        kind: String,
        /// The plugin's name (see `ava plugins list`).
        name: String,
        /// Config file to edit (created if missing). Default: ./ava.yaml.
        #[arg(short, long, value_name = "FILE", env = "AVA_CONFIG")]
        config: Option<PathBuf>,
        /// A plugin option, OPTION=VALUE (repeatable); checked by the plugin before writing.
        #[arg(long = "set", value_name = "OPTION=VALUE")]
        set: Vec<String>,
    },
    /// Return a kind to its built-in default by removing its selection from the config file.
    Disable {
        /// attention, optimizer, checkpoint, offload or memory.
        kind: String,
        /// Config file to edit. Default: ./ava.yaml.
        #[arg(short, long, value_name = "FILE", env = "AVA_CONFIG")]
        config: Option<PathBuf>,
    },
}

/// `ava config ...`
#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// The effective configuration, each value with where it came from
    /// (default, file, environment variable, --set).
    Show {
        /// Where the configuration comes from.
        #[command(flatten)]
        config: ConfigArgs,
    },
    /// Check a config file: unknown keys, wrong types, out-of-range values, unknown plugins
    /// and their options. Every problem is reported at once; exit code 2 if any.
    Validate {
        /// The file to check.
        file: PathBuf,
        /// Overrides applied on top, as in `ava config show`.
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
    },
}

/// Most threads a `--threads` takes: training's own bound (`train.threads`).
pub const MAX_THREADS: usize = 1024;

/// A `--threads` value: 0 (one per core) up to [`MAX_THREADS`].
fn threads_arg(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(n) if n <= MAX_THREADS => Ok(n),
        _ => Err(format!("must be a number from 0 (one per core) to {MAX_THREADS}")),
    }
}
