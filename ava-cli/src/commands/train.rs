//! `ava train`: runs the training loop of `ava-train` with a progress bar and the memory
//! dashboard, then prints a summary (text or JSON).

use std::sync::Arc;

use ava_train::dist::{self, Collectives};
use ava_train::train::{TrainError, TrainOptions, Trainer};
use serde_json::json;

use std::path::Path;

use ava_train::run_dir::{RunDirError, RunLock, previous_run};

use crate::{CmdResult, Failure, cli::TrainArgs, context, output::Printer, signals};

use super::progress::CliReporter;

/// Maps the engine's errors to exit codes: configuration problems are usage errors (2).
pub fn failure(e: TrainError) -> Failure {
    match e {
        TrainError::Invalid(_) | TrainError::ConfigChanged { .. } | TrainError::Model(_) | TrainError::Data(_) => {
            Failure::Usage(e.into())
        }
        other => Failure::Runtime(other.into()),
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
        Err(f) => return Err(in_rank(f, rank, world)),
        Ok(_) if code[0] > 0 => {
            let e = anyhow::anyhow!("another rank could not start the run (its error is printed with its rank)");
            return Err(in_rank(if code[0] == 2 { Failure::Usage(e) } else { Failure::Runtime(e) }, rank, world));
        }
        Ok(started) => started,
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
    let config = context::load_config(&config_args, p)?.into_config();
    // Alone with threads 0, the pool keeps rayon's own default; ranks on one machine share
    // its cores.
    set_threads(match config.train.threads {
        0 if dist::local_size() == 1 => 0,
        n => ava_train::train::resolve_threads(n),
    });
    // Held until this function returns (the process's end releases it however it ends).
    // Rank 0 writes the run's files, so it alone claims the directory.
    let lock = if root { Some(claim_run_dir(&config.train.out_dir, args)?) } else { None };
    let options =
        TrainOptions { resume: args.resume.clone(), force: args.force, steps: args.steps, group, ..Default::default() };
    let trainer = Trainer::new(&config, &ctx.registry, &options).map_err(failure)?;
    Ok(Started { trainer, options, log_every: config.train.log_every, root, _lock: lock })
}

/// Trains a started run and prints its summary (rank 0).
fn train(p: &Printer, started: Started) -> CmdResult {
    let Started { mut trainer, mut options, log_every, root, _lock } = started;
    // From here on a signal stops the run at the end of a step, with a checkpoint; before
    // it, there is nothing to save and a signal ends the process as usual.
    options.stop = Some(signals::install());
    let summary = if root {
        trainer.run(&options, &mut CliReporter::new(p, log_every))
    } else {
        trainer.run(&options, &mut ava_train::train::Silent)
    }
    .map_err(failure)?;
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
            let each: Vec<String> =
                summary.rank_peak_bytes.iter().map(|&b| format!("{:.3}", ava_train::memory::gib(b))).collect();
            format!(" (by rank: {} GiB)", each.join(", "))
        };
        lines.push(format!(
            "{} tokens/s; peak memory {:.2} GiB{ranks}",
            super::progress::rate(summary.tokens_per_sec),
            ava_train::memory::gib(summary.peak_bytes)
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
        if let Some(c) = &summary.checkpoint {
            lines.push(format!("checkpoint: {c} (continue with: ava train --resume latest)"));
        }
        if let Some(m) = &summary.model_dir {
            lines.push(format!("model: {m} (Hugging Face config.json + model.safetensors)"));
        }
        lines.join("\n")
    };
    p.result(text, || json!(summary));
    if summary.interrupted {
        let signal = signals::received().unwrap_or(libc::SIGINT);
        let message = match &summary.checkpoint {
            Some(dir) => format!(
                "interrupted by {} at step {}: checkpoint {dir} saved; continue the run with:\n  {}",
                signals::name(signal),
                summary.step,
                resume_command()
            ),
            None => format!(
                "interrupted by {} before the first step completed: nothing to resume, start again",
                signals::name(signal)
            ),
        };
        return Err(Failure::Signal(signal, anyhow::anyhow!(message)));
    }
    if let Some(reason) = summary.stopped {
        // The reason says what to change; the changes it names are to settings a checkpoint
        // records, so resuming after them takes --force.
        let then = if summary.checkpoint.is_some() {
            "after the change, continue from the checkpoint with: ava train --resume latest --force \
             (--force: the checkpoint was trained with the old settings)"
        } else {
            "no step completed, so there is nothing to resume: start again after the change"
        };
        return Err(Failure::Runtime(anyhow::anyhow!("training stopped early: {reason}; {then}")));
    }
    Ok(())
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
    let mut args = std::env::args();
    let mut out = vec![args.next().unwrap_or_else(|| "ava".to_string())];
    while let Some(a) = args.next() {
        match a.as_str() {
            "--overwrite" => {}
            "--resume" => {
                args.next();
            }
            _ if a.starts_with("--resume=") => {}
            _ => out.push(a),
        }
    }
    out.extend(["--resume".to_string(), "latest".to_string()]);
    out.iter().map(|a| shell_quote(a)).collect::<Vec<_>>().join(" ")
}

/// `arg` as one word of a POSIX shell command.
fn shell_quote(arg: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "_-./=:,@%+".contains(c);
    if !arg.is_empty() && arg.chars().all(plain) {
        arg.to_string()
    } else {
        format!("'{}'", arg.replace('\'', "'\\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::shell_quote;

    #[test]
    fn resume_command_words_are_quoted_for_a_shell() {
        assert_eq!(shell_quote("train.out_dir=runs/a-1"), "train.out_dir=runs/a-1");
        assert_eq!(shell_quote("plugins.optimizer={name: lion}"), "'plugins.optimizer={name: lion}'");
        assert_eq!(shell_quote("it's"), "'it'\\''s'");
        assert_eq!(shell_quote(""), "''");
    }
}
