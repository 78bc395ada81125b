//! `ava train`: runs the training loop of `ava-train` with a progress bar and the memory
//! dashboard, then prints a summary (text or JSON).

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
    let mut config_args = args.config.clone();
    if let Some(n) = args.max_steps {
        config_args.set.push(format!("train.max_steps={n}"));
    }
    let ctx = context::load_checked(&config_args, p)?;
    let config = context::load_config(&config_args, p)?.into_config();
    set_threads(config.train.threads);
    // Held until this function returns (the process's end releases it however it ends).
    let _lock = claim_run_dir(&config.train.out_dir, args)?;
    let mut options =
        TrainOptions { resume: args.resume.clone(), force: args.force, steps: args.steps, ..Default::default() };
    let mut trainer = Trainer::new(&config, &ctx.registry, &options).map_err(failure)?;
    // From here on a signal stops the run at the end of a step, with a checkpoint; before
    // it, there is nothing to save and a signal ends the process as usual.
    options.stop = Some(signals::install());
    let mut reporter = CliReporter::new(p, config.train.log_every);
    let summary = trainer.run(&options, &mut reporter).map_err(failure)?;
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
        lines.push(format!(
            "{} tokens/s; peak memory {:.2} GiB",
            super::progress::rate(summary.tokens_per_sec),
            ava_train::memory::gib(summary.peak_bytes)
        ));
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
