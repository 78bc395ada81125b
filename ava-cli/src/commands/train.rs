//! `ava train`: runs the training loop of `ava-train` with a progress bar and the memory
//! dashboard, then prints a summary (text or JSON).

use ava_train::train::{TrainError, TrainOptions, Trainer};
use serde_json::json;

use crate::{CmdResult, Failure, cli::TrainArgs, context, output::Printer};

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
    let options =
        TrainOptions { resume: args.resume.clone(), force: args.force, steps: args.steps, ..Default::default() };
    let mut trainer = Trainer::new(&config, &ctx.registry, &options).map_err(failure)?;
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
