//! `ava train`: runs the training loop of `ava-train` with a progress bar and the memory
//! dashboard, then prints a summary (text or JSON).

use std::sync::Arc;

use ava_train::config::Config;
use ava_train::dist::{self, Collectives};
use ava_train::save::SaveError;
use ava_train::train::{
    IoProgress, IoProgressFn, TrainError, TrainOptions, Trainer, Work, WorkProgress, WorkProgressFn,
};
use serde_json::json;

use std::path::Path;

use ava_train::run_dir::{RunDirError, RunLock, previous_run};

use crate::{CmdResult, Failure, cli::TrainArgs, context, output::Printer, signals};

use super::progress::CliReporter;

/// The run's config from `loaded`, with `memory.budget` taken from the card on a GPU run when
/// no layer set it: the card's memory less a margin for what lives outside the run's
/// allocations (`ava_train::device::card_budget`), and not more than `memory.hard_limit`
/// when one caps the device (`ava_train::device::default_budget`), said once.
pub fn run_config(loaded: ava_train::config::LoadedConfig, p: &Printer) -> Result<Config, Failure> {
    use ava_train::config::Origin;
    let budget_set = !matches!(loaded.origin("memory.budget"), None | Some(Origin::Default));
    let mut config = loaded.into_config();
    if budget_set {
        return Ok(config);
    }
    let card = ava_train::device::card_budget(config.train.device).map_err(|e| failure(e.into()))?;
    if let Some((card_budget, total)) = card {
        let limit = config.memory.hard_limit;
        let budget = ava_train::device::default_budget(card_budget, limit.0);
        config.memory.budget = ava_train::config::ByteSize(budget);
        let why = if budget < card_budget {
            format!(
                "memory.hard_limit, {limit}, which caps the run's device memory; the card's {} less {} for the CUDA \
                 context, cuBLAS's workspace and the pool's slack would be {}",
                ava_core::format_size(total),
                ava_core::format_size(total - card_budget),
                ava_core::format_size(card_budget)
            )
        } else {
            format!(
                "the card's {} less {} for the CUDA context, cuBLAS's workspace and the pool's slack",
                ava_core::format_size(total),
                ava_core::format_size(total - card_budget)
            )
        };
        p.note(&format!(
            "memory.budget: {} of device memory ({why}); set memory.budget to choose another",
            ava_core::format_size(budget)
        ));
    }
    Ok(config)
}

/// Maps the engine's errors to exit codes: configuration problems are usage errors (2).
pub fn failure(e: TrainError) -> Failure {
    match e {
        TrainError::Invalid(_)
        | TrainError::Device(_)
        | TrainError::ConfigChanged { .. }
        | TrainError::Model(_)
        | TrainError::Data(_)
        | TrainError::BudgetTooSmall { .. }
        | TrainError::Finished { .. }
        | TrainError::OptimizerState { .. } => Failure::Usage(e.into()),
        other => Failure::Runtime(other.into()),
    }
}

/// An error building a run, with the command that goes on where there is one. A resume that
/// cannot start is a usage error (2): the checkpoint named, or the settings, are to change.
fn start_failure(e: TrainError, args: &TrainArgs, config: &Config, registry: &ava_plugins::Registry) -> Failure {
    match e {
        TrainError::Finished { max_steps, .. } => {
            let more = format!("train.max_steps={}", max_steps.saturating_mul(2).max(max_steps + 1));
            Failure::Usage(anyhow::anyhow!("{e}; e.g.:\n  {}", follow_up(&["--max-steps"], &["--set", &more], true)))
        }
        TrainError::BudgetTooSmall { budget, .. } => {
            let hint = match super::plan::suggestion(registry, config, budget) {
                Some((text, sets)) => {
                    let words: Vec<&str> = sets.iter().flat_map(|s| ["--set", s.as_str()]).collect();
                    format!(
                        "\n{text}; train with them:\n  {}\nor see every plan that fits:\n  {}",
                        follow_up(&[], &words, args.resume.is_some()),
                        plan_command(&args.config, budget)
                    )
                }
                None => format!(
                    "\nnothing `ava plan` searches fits {}: raise memory.budget, shorten data.seq_len or use a smaller \
                     model",
                    ava_core::format_size(budget)
                ),
            };
            Failure::Usage(anyhow::anyhow!("{e}{hint}"))
        }
        // A --resume that names no checkpoint is the user's to fix (a damaged one is not).
        TrainError::Save(ref s)
            if args.resume.is_some()
                && matches!(**s, SaveError::NoCheckpoint { .. } | SaveError::NotACheckpoint { .. }) =>
        {
            Failure::Usage(e.into())
        }
        e => failure(e),
    }
}

/// Sets the compute thread count for candle's matmuls (read from RAYON_NUM_THREADS)
/// before any work starts.
pub fn set_threads(threads: usize) {
    if threads > 0 {
        // SAFETY: called on the main thread before any other thread is started.
        unsafe { std::env::set_var("RAYON_NUM_THREADS", threads.to_string()) };
    }
}

pub fn run(p: &Printer, args: &TrainArgs) -> CmdResult {
    launch_if_asked(args.nproc)?;
    let group = dist::join().map_err(|e| Failure::Usage(anyhow::anyhow!(e)))?;
    let collectives = group.collectives();
    let (rank, world) = (collectives.rank(), collectives.size());
    if world == 1 {
        return train(p, start(p, args, None)?);
    }
    // Rank 0 prints; the others only their errors, each with its rank.
    let quiet = Printer { format: p.format, verbosity: 0 };
    let printer = if rank == 0 { p } else { &quiet };
    // Every rank builds its run, then they agree before the first collective: a rank that
    // cannot start (a config error, a busy run directory) stops them all, each printing its
    // own error, with the highest exit code of any rank.
    let started = start(printer, args, Some(collectives.clone()));
    let mut code = [started.as_ref().err().map_or(0, Failure::code) as u64];
    if let Err(e) = collectives.all_reduce_max(&mut code) {
        crate::print_failure(p, in_rank(Failure::Runtime(e.into()), rank, world));
        group.abort(1)
    }
    let started = match started {
        Ok(started) if code[0] == 0 => started,
        refused => {
            let f = refused.err().unwrap_or_else(|| {
                let e = anyhow::anyhow!("another rank could not start the run (its error is printed with its rank)");
                if code[0] == 2 { Failure::Usage(e) } else { Failure::Runtime(e) }
            });
            // Each rank prints its own refusal, then they wait for each other before any exits:
            // mpirun stops the job when a rank exits non-zero, which could cut off a slower
            // rank's message. (Best effort: a failed barrier still exits with the code.)
            let code = crate::print_failure(p, in_rank(f, rank, world));
            let _ = collectives.barrier();
            return Err(Failure::Reported(code));
        }
    };
    // Once training runs, the others may be waiting for this rank in a collective: an
    // error ends every rank (MPI aborts the job, and mpirun says which rank), after it is
    // printed with its rank.
    match train(printer, started) {
        Ok(()) => Ok(()),
        Err(f) => {
            let code = crate::print_failure(p, in_rank(f, rank, world));
            group.abort(code.into())
        }
    }
}

/// A run built and ready to train.
struct Started {
    trainer: Trainer,
    options: TrainOptions,
    log_every: u64,
    root: bool,
    /// `ava estimate`'s peak, for the charts of `--memory-trace` (None: not asked, or no estimate).
    memory_estimate: Option<u64>,
    /// The run directory's lock (rank 0's), held until the run ends.
    _lock: Option<RunLock>,
}

/// The failure with its rank in front.
fn in_rank(f: Failure, rank: usize, world: usize) -> Failure {
    let tag = |e: anyhow::Error| anyhow::anyhow!("rank {rank} of {world}: {e:#}");
    match f {
        Failure::Usage(e) => Failure::Usage(tag(e)),
        Failure::Runtime(e) => Failure::Runtime(tag(e)),
        Failure::Signal(s, e) => Failure::Signal(s, tag(e)),
        Failure::Reported(code) => Failure::Reported(code),
    }
}

/// `--nproc N` (N > 1) outside an MPI job: runs this command under mpirun instead
/// ([`launch`]), returning only on failure; otherwise nothing to do.
pub(crate) fn launch_if_asked(nproc: Option<u32>) -> Result<(), Failure> {
    match nproc.filter(|&n| n > 1) {
        Some(n) if dist::launched_size().is_none() => Err(launch(n)),
        _ => Ok(()),
    }
}

/// `ava train --nproc N`: this command again under `mpirun -np N` (exec, so signals and
/// the exit code are mpirun's). Returns only on failure.
fn launch(n: u32) -> Failure {
    if !cfg!(feature = "mpi") {
        return Failure::Usage(anyhow::anyhow!(
            "--nproc {n} runs {n} ranks over MPI, but this ava was built without MPI support: build it with \
             `cargo build --release -p ava-cli --features mpi` (after apt-get install libopenmpi-dev openmpi-bin \
             libclang1-14 libclang-common-14-dev), or leave out --nproc"
        ));
    }
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => return Failure::Runtime(anyhow::anyhow!("--nproc: cannot find this program's own path: {e}")),
    };
    let mut cmd = std::process::Command::new("mpirun");
    cmd.args(["-np", &n.to_string()]);
    // More ranks than cores is legal (slow); Open MPI refuses it unless told.
    cmd.arg("--oversubscribe");
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        cmd.arg("--allow-run-as-root");
    }
    cmd.arg(exe);
    let mut skip = false;
    for a in std::env::args().skip(1) {
        if skip {
            skip = false;
        } else if a == "--nproc" {
            skip = true;
        } else if !a.starts_with("--nproc=") {
            cmd.arg(a);
        }
    }
    use std::os::unix::process::CommandExt;
    let e = cmd.exec();
    let how = if e.kind() == std::io::ErrorKind::NotFound {
        "mpirun is not installed (Open MPI: apt-get install openmpi-bin)".to_string()
    } else {
        e.to_string()
    };
    Failure::Runtime(anyhow::anyhow!("--nproc {n}: cannot start mpirun: {how}"))
}

/// Loads the config, claims the run directory (rank 0) and builds the run; nothing in it
/// talks to the other ranks.
fn start(p: &Printer, args: &TrainArgs, group: Option<Arc<dyn Collectives>>) -> Result<Started, Failure> {
    let root = group.as_ref().is_none_or(|g| g.rank() == 0);
    let mut config_args = args.config.clone();
    if let Some(n) = args.max_steps {
        config_args.set.push(format!("train.max_steps={n}"));
    }
    let ctx = context::load_checked(&config_args, p)?;
    let config = run_config(context::load_config(&config_args, p)?, p)?;
    // Alone with threads 0, the pool keeps rayon's own default; ranks on one machine share
    // its cores.
    set_threads(match config.train.threads {
        0 if dist::local_size() == 1 => 0,
        n => ava_train::train::resolve_threads(n),
    });
    let fresh_steps = args.resume.is_none().then(|| args.steps.unwrap_or(config.train.max_steps));
    check_memory_trace(&args.memory_trace, &config, fresh_steps)?;
    // Held until this function returns (the process's end releases it however it ends).
    // Rank 0 writes the run's files, so it alone claims the directory.
    let lock = if root { Some(claim_run_dir(&config.train.out_dir, args)?) } else { None };
    let options = TrainOptions {
        resume: args.resume.clone(),
        force: args.force,
        fresh_optimizer: args.fresh_optimizer,
        steps: args.steps,
        group,
        io_progress: root.then(|| io_progress(p)),
        work_progress: if root { Some(work_progress(p)?) } else { None },
        stall_loader_at_batch: stall_hook()?,
        memory_trace: args.memory_trace.clone(),
        ..Default::default()
    };
    // Refused before it wrote anything of its own: nothing left behind for it.
    let leave_nothing = |lock: Option<RunLock>| {
        if let Some(lock) = lock
            && previous_run(&config.train.out_dir).is_empty()
        {
            lock.release_unused();
        }
    };
    let trainer = match Trainer::new(&config, &ctx.registry, &options) {
        Ok(trainer) => trainer,
        Err(e) => {
            leave_nothing(lock);
            return Err(start_failure(e, args, &config, &ctx.registry));
        }
    };
    // The steps this invocation trains: after the resumed one, up to --steps more.
    let first = trainer.header().first_step;
    let last = args.steps.map_or(config.train.max_steps, |n| (first - 1 + n).min(config.train.max_steps));
    if let Err(refused) = check_traced_steps(&args.memory_trace, first, last) {
        leave_nothing(lock);
        return Err(refused);
    }
    let memory_estimate = match root && !args.memory_trace.is_empty() {
        true => super::memory_timeline::estimated_peak(p, &ctx.registry, &config),
        false => None,
    };
    Ok(Started { trainer, options, log_every: config.train.log_every, root, memory_estimate, _lock: lock })
}

/// Refuses `--memory-trace` steps the run cannot record: on a GPU (the timeline is the host
/// allocator's), or outside 1..=train.max_steps, or (`fresh_steps`: a fresh run's `--steps`,
/// or max_steps without it) outside the steps it trains.
fn check_memory_trace(steps: &[u64], config: &Config, fresh_steps: Option<u64>) -> Result<(), Failure> {
    if steps.is_empty() {
        return Ok(());
    }
    if config.train.device.is_cuda() {
        return Err(Failure::Usage(anyhow::anyhow!(
            "--memory-trace records the host allocator, and a GPU run's buffers are on the device: it is not \
             supported on a GPU run yet; record a CPU run (train.device: cpu)"
        )));
    }
    let max = config.train.max_steps;
    if let Some(s) = steps.iter().find(|&&s| s == 0 || s > max) {
        return Err(Failure::Usage(anyhow::anyhow!(
            "--memory-trace {s}: the run's steps are 1 to {max} (train.max_steps); pick steps among them"
        )));
    }
    // A fresh run starts at step 1, so its range is known before the run directory is
    // claimed (and, with --overwrite, the earlier run deleted); a resume's, once it is read.
    match fresh_steps {
        Some(n) => check_traced_steps(steps, 1, n.min(max)),
        None => Ok(()),
    }
}

/// Refuses `--memory-trace` steps outside `first..=last`, the steps this invocation trains.
fn check_traced_steps(steps: &[u64], first: u64, last: u64) -> Result<(), Failure> {
    match steps.iter().find(|&&s| s < first || s > last) {
        Some(step) => Err(Failure::Usage(anyhow::anyhow!(
            "--memory-trace {step}: this invocation trains steps {first} to {last}; pick steps among them"
        ))),
        None => Ok(()),
    }
}

/// The variable of the test hook that makes the data loader hang on a batch.
const STALL_VAR: &str = "AVA_TEST_STALL_LOADER_AT_BATCH";

/// Test hook: with `AVA_TEST_STALL_LOADER_AT_BATCH=N` the data loader never delivers batch
/// N (as if its read hung), so the tests can stop a run stuck in a wait.
fn stall_hook() -> Result<Option<u64>, Failure> {
    let Some(value) = std::env::var_os(STALL_VAR) else { return Ok(None) };
    let text = value.to_string_lossy();
    text.trim().parse().map(Some).map_err(|_| {
        Failure::Usage(anyhow::anyhow!("{STALL_VAR}={text:?}: not a batch index (a test hook); unset it to train"))
    })
}

/// What an interrupted run says: where it stopped, what it saved, and how to go on.
fn interrupted_message(summary: &ava_train::train::RunSummary, signal: i32) -> String {
    let name = signals::name(signal);
    match (&summary.interrupted_while, &summary.checkpoint) {
        (None, Some(dir)) => format!(
            "interrupted by {name} at step {}: checkpoint {dir} saved; continue the run with:\n  {}",
            summary.step,
            resume_command()
        ),
        (None, None) => {
            format!("interrupted by {name} before the first step completed: nothing to resume, start again")
        }
        (Some(wait), Some(dir)) => format!(
            "interrupted by {name} while waiting, after step {}: {wait}; nothing of the next step was kept and the \
             latest checkpoint is {dir}; once the cause of the wait is fixed, continue the run with:\n  {}",
            summary.step,
            resume_command()
        ),
        (Some(wait), None) => format!(
            "interrupted by {name} while waiting, before the first step completed: {wait}; nothing to resume, start \
             again once the cause of the wait is fixed"
        ),
    }
}

/// Trains a started run and prints its summary (rank 0).
fn train(p: &Printer, started: Started) -> CmdResult {
    let Started { mut trainer, mut options, log_every, root, memory_estimate, _lock } = started;
    // From here on a signal stops the run at the end of a step, with a checkpoint; before
    // it, there is nothing to save and a signal ends the process as usual.
    options.stop = Some(signals::install());
    let summary = if root {
        trainer.run(&options, &mut CliReporter::new(p, log_every).with_memory_estimate(memory_estimate))
    } else {
        trainer.run(&options, &mut ava_train::train::Silent)
    }
    .map_err(|e| {
        // The errors that name a checkpoint to resume from get the command that does.
        let resumable = matches!(
            &e,
            TrainError::NonFinite { checkpoint: Some(_), .. }
                | TrainError::FailedInBackward { saved: 1.., .. }
                | TrainError::OutOfMemoryInBackward { saved: 1.., .. }
        );
        match failure(e) {
            Failure::Runtime(e) if resumable => {
                Failure::Runtime(anyhow::anyhow!("{e:#}\nonce fixed, resume with: {}", resume_command()))
            }
            f => f,
        }
    })?;
    if !root {
        return Ok(());
    }
    let text = || {
        let mut lines = vec![format!("trained to step {} — loss {:.4}", summary.step, summary.loss)];
        if let Some(v) = summary.val_loss {
            match summary.entropy_floor {
                Some(f) => lines.push(format!(
                    "validation loss {v:.4}; entropy floor {f:.4} nats/token: {:.1}% above the best possible",
                    100.0 * (v / f - 1.0)
                )),
                None => lines.push(format!("validation loss {v:.4}")),
            }
        }
        let ranks = if summary.rank_peak_bytes.is_empty() {
            String::new()
        } else {
            let each: Vec<String> = summary.rank_peak_bytes.iter().map(|&b| ava_train::memory::size(b)).collect();
            format!(" (by rank: {})", each.join(", "))
        };
        lines.push(format!(
            "{} tokens/s; peak memory {}{ranks}",
            super::progress::rate(summary.tokens_per_sec),
            ava_train::memory::size(summary.peak_bytes)
        ));
        let total: u64 = summary.tokens_by_source.iter().map(|s| s.tokens).sum();
        if total > 0 {
            let each: Vec<String> = summary
                .tokens_by_source
                .iter()
                .map(|s| format!("{} {} ({:.1}%)", s.source, s.tokens, 100.0 * s.tokens as f64 / total as f64))
                .collect();
            lines.push(format!("tokens by source: {}", each.join(", ")));
        }
        match (&summary.checkpoint, summary.model_dir.is_some()) {
            (Some(c), false) => lines.push(format!("checkpoint: {c} (continue with: {})", resume_command())),
            (Some(c), true) => lines.push(format!(
                "checkpoint: {c} (the run is finished; to train it longer: {})",
                follow_up(&["--max-steps"], &["--set", &format!("train.max_steps={}", summary.step * 2)], true)
            )),
            (None, _) => {}
        }
        if let Some(m) = &summary.model_dir {
            lines.push(format!(
                "model: {m} (a Hugging Face folder with its tokenizer; sample from it: ava generate {})",
                shell_quote(&Path::new(m).parent().unwrap_or(Path::new(m)).display().to_string())
            ));
        }
        lines.join("\n")
    };
    p.result(text, || json!(summary));
    if summary.interrupted {
        let signal = signals::received().unwrap_or(libc::SIGINT);
        return Err(Failure::Signal(signal, anyhow::anyhow!(interrupted_message(&summary, signal))));
    }
    if let Some(reason) = summary.stopped {
        // The reason says what to change; the changes it names are to settings a checkpoint
        // records, so resuming after them takes --force.
        let then = if summary.checkpoint.is_some() {
            format!(
                "after the change, continue from the checkpoint with: {} (--force: the checkpoint was trained with \
                 the old settings)",
                follow_up(&[], &["--force"], true)
            )
        } else {
            "no step completed, so there is nothing to resume: start again after the change".to_string()
        };
        return Err(Failure::Runtime(anyhow::anyhow!("training stopped early: {reason}; {then}")));
    }
    Ok(())
}

/// The variable of the test hook that sets how often a long step or evaluation says how
/// far it is, in seconds (0: at every micro-batch).
const WORK_PROGRESS_VAR: &str = "AVA_TEST_WORK_PROGRESS_SECS";

/// A line on stderr while a step or an evaluation takes long (a 7B step is minutes): after
/// 10 s of it, then every 10 s, with how many of its micro-batches (batches) are done.
fn work_progress(p: &Printer) -> Result<WorkProgressFn, Failure> {
    let every = match std::env::var_os(WORK_PROGRESS_VAR) {
        None => 10.0,
        Some(v) => v.to_string_lossy().trim().parse::<f64>().map_err(|_| {
            Failure::Usage(anyhow::anyhow!(
                "{WORK_PROGRESS_VAR}={v:?}: not a number of seconds (a test hook); unset it"
            ))
        })?,
    };
    let verbosity = p.verbosity;
    // The work under way: what, when it started, when it was last said.
    let state = std::sync::Mutex::new(None::<(Work, std::time::Instant, std::time::Instant)>);
    Ok(WorkProgressFn(Arc::new(move |w: &WorkProgress| {
        let now = std::time::Instant::now();
        let mut state = state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let (started, last) = match *state {
            Some((what, started, last)) if what == w.what => (started, last),
            _ => (now, now),
        };
        let due = verbosity >= 1 && w.done > 0 && now.duration_since(last).as_secs_f64() >= every;
        *state = Some((w.what, started, if due { now } else { last }));
        if due {
            let seconds = now.duration_since(started).as_secs_f64();
            let line = match w.what {
                Work::Step(n) => format!("[step {n}] {}/{} micro-batches done, {seconds:.0} s so far", w.done, w.total),
                Work::Evaluation(n) => {
                    format!("[step {n}] evaluating: {}/{} batches done, {seconds:.0} s so far", w.done, w.total)
                }
            };
            eprintln!("{line}");
        }
    })))
}

/// A line on stderr for every GiB of a checkpoint saved or loaded (a 7B run's checkpoint is
/// tens of GiB: minutes without it).
fn io_progress(p: &Printer) -> IoProgressFn {
    let verbosity = p.verbosity;
    IoProgressFn(Arc::new(move |io: &IoProgress| {
        if verbosity >= 1 {
            let line = format!(
                "{} checkpoint {}: {} of {} ({:.0}%)",
                io.what,
                io.dir.display(),
                ava_train::memory::size(io.done),
                ava_train::memory::size(io.total),
                100.0 * io.done as f64 / io.total.max(1) as f64
            );
            eprintln!("{}", crate::output::printable(&line));
        }
    }))
}

/// Locks the run directory for this run, and refuses a fresh run into a directory that
/// holds an earlier one unless `--overwrite` (whose files are removed once the lock is ours).
fn claim_run_dir(dir: &Path, args: &TrainArgs) -> Result<RunLock, Failure> {
    let lock = RunLock::acquire(dir).map_err(|e| match e {
        RunDirError::Busy { .. } => Failure::Usage(e.into()),
        RunDirError::Io { .. } => Failure::Runtime(e.into()),
    })?;
    let previous = previous_run(dir);
    if args.resume.is_none() && !previous.is_empty() {
        if !args.overwrite {
            return Err(Failure::Usage(anyhow::anyhow!(
                "{} holds an earlier run ({}): a fresh run would mix its checkpoints and metrics with it. Continue \
                 that run with --resume latest, start again with --overwrite (deletes {}), or set train.out_dir to \
                 another directory",
                dir.display(),
                previous.join(", "),
                previous.join(", ")
            )));
        }
        lock.remove_previous_run().map_err(|e| Failure::Runtime(e.into()))?;
    }
    Ok(lock)
}

/// The command line of this process with `--resume latest` in place of any `--resume` (and
/// without `--overwrite`), quoted for a POSIX shell.
fn resume_command() -> String {
    follow_up(&[], &[], true)
}

/// A follow-up command: this process's command line (so the options naming the run, `-c`
/// and every `--set`, are kept), without `--overwrite`, the options in `drop` (each with its
/// value) and any `--resume` (put back as `--resume latest` when `resume`), with `extra`
/// appended; quoted for a POSIX shell.
/// `ava plan --budget SIZE` on this run's config (its `-c` file and `--set` values), so the
/// plans it lists are for the run that was refused.
fn plan_command(config: &crate::cli::ConfigArgs, budget: u64) -> String {
    let ava = std::env::args().next().unwrap_or_else(|| "ava".to_string());
    let mut words = vec![ava, "plan".into(), "--budget".into(), ava_train::budget_arg(budget)];
    if let Some(file) = &config.config {
        words.extend(["-c".to_string(), file.display().to_string()]);
    }
    for set in &config.set {
        words.extend(["--set".to_string(), set.clone()]);
    }
    words.iter().map(|w| shell_quote(w)).collect::<Vec<_>>().join(" ")
}

pub(crate) fn follow_up(drop: &[&str], extra: &[&str], resume: bool) -> String {
    let env: Vec<(String, String)> = std::env::vars().filter(|(k, _)| config_env(k)).collect();
    command_line(&env, std::env::args().collect(), drop, extra, resume)
}

/// Whether an environment variable sets the config (`AVA__SECTION__KEY`, `AVA_CONFIG`): a
/// follow-up command carries it, or it would run another config (another `train.out_dir`).
fn config_env(key: &str) -> bool {
    key.starts_with("AVA__") || key == "AVA_CONFIG"
}

fn command_line(env: &[(String, String)], argv: Vec<String>, drop: &[&str], extra: &[&str], resume: bool) -> String {
    // Assignments before the command, the value quoted alone (a quoted `K=V` is no assignment).
    let mut env: Vec<String> = env.iter().map(|(k, v)| format!("{k}={} ", shell_quote(v))).collect();
    env.sort();
    let mut args = argv.into_iter();
    let mut out = vec![args.next().unwrap_or_else(|| "ava".to_string())];
    let flag = |a: &str, name: &str| a == name || a.starts_with(&format!("{name}="));
    while let Some(a) = args.next() {
        // The steps --memory-trace named are behind a follow-up command: it would be refused.
        let dropped = drop.iter().chain(&["--resume", "--memory-trace"]).find(|name| flag(&a, name));
        match dropped {
            Some(name) => {
                if a == **name {
                    args.next(); // its value
                }
            }
            None if a == "--overwrite" || (resume && a == "--fresh-optimizer") => {}
            None => out.push(a),
        }
    }
    out.extend(extra.iter().map(|s| s.to_string()));
    if resume {
        out.extend(["--resume".to_string(), "latest".to_string()]);
    }
    env.concat() + &out.iter().map(|a| shell_quote(a)).collect::<Vec<_>>().join(" ")
}

/// `arg` as one word of a POSIX shell command.
pub(crate) fn shell_quote(arg: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "_-./=:,@%+".contains(c);
    if !arg.is_empty() && arg.chars().all(plain) {
        arg.to_string()
    } else {
        format!("'{}'", arg.replace('\'', "'\\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::{command_line, shell_quote};

    fn argv(s: &str) -> Vec<String> {
        s.split(' ').map(str::to_string).collect()
    }

    #[test]
    fn follow_up_commands_keep_what_names_the_run() {
        let run = argv("ava train --steps 20 --set train.out_dir=runs/hint -c my.yaml --overwrite");
        assert_eq!(
            command_line(&[], run.clone(), &[], &[], true),
            "ava train --steps 20 --set train.out_dir=runs/hint -c my.yaml --resume latest"
        );
        let traced = argv("ava train --memory-trace 2,3 --steps 5 --memory-trace=4");
        assert_eq!(command_line(&[], traced, &[], &[], true), "ava train --steps 5 --resume latest");
        let resumed = argv("ava train --resume runs/x/checkpoints/step-1 --max-steps 10 --set a=b");
        assert_eq!(
            command_line(&[], resumed, &["--max-steps"], &["--set", "train.max_steps=20"], true),
            "ava train --set a=b --set train.max_steps=20 --resume latest"
        );
        assert_eq!(
            command_line(&[], argv("ava train --resume=latest --fresh-optimizer"), &[], &["--force"], true),
            "ava train --force --resume latest"
        );
        // The environment that set the config goes along, quoted as a word.
        let env = [("AVA__TRAIN__OUT_DIR".to_string(), "runs/env run".to_string())];
        assert_eq!(
            command_line(&env, argv("ava train --steps 2"), &[], &[], true),
            "AVA__TRAIN__OUT_DIR='runs/env run' ava train --steps 2 --resume latest"
        );
    }

    #[test]
    fn resume_command_words_are_quoted_for_a_shell() {
        assert_eq!(shell_quote("train.out_dir=runs/a-1"), "train.out_dir=runs/a-1");
        assert_eq!(shell_quote("plugins.optimizer={name: lion}"), "'plugins.optimizer={name: lion}'");
        assert_eq!(shell_quote("it's"), "'it'\\''s'");
        assert_eq!(shell_quote(""), "''");
    }
}
