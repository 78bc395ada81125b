//! `ava generate`: text from a trained model, token by token with a KV cache
//! (`ava_train::model::generate`), read and written with the tokenizer the model was trained
//! with (`ava_train::inference`).

use std::time::Instant;

use ava_train::inference::{self, InferenceError, LoadOptions, Trained};
use ava_train::model::{ModelError, Sampling, Stop};
use serde_json::json;

use crate::{CmdResult, Failure, cli::GenerateArgs, output::Printer};

use super::train::set_threads;

pub fn run(p: &Printer, args: &GenerateArgs) -> CmdResult {
    let sampling = sampling(args)?;
    if args.max_tokens == 0 {
        return Err(usage("--max-tokens must be at least 1"));
    }
    set_threads(args.threads);
    let trained = load(&args.model, args.tokenizer.as_deref(), args.threads)?;
    let Trained { model, tokenizer, bos, eos, source, .. } = &trained;
    p.note(&format!(
        "model: {source}, {:.2}M parameters; {}",
        model.spec().num_params() as f64 / 1e6,
        tokenizer.describe()
    ));
    let mut prompt = tokenizer.encode(&args.prompt).map_err(|e| usage(&format!("cannot tokenize --prompt: {e}")))?;
    if prompt.is_empty() {
        // Where a document starts: after its begin (or the previous one's end) token.
        let start = bos.or(*eos).ok_or_else(|| {
            usage("the model was trained without a begin- or end-of-text token to start from: give some text, --prompt TEXT")
        })?;
        prompt.push(start);
    }
    let stop_at = if args.ignore_eos { None } else { *eos };
    // Before the prompt is echoed: a size the model or the machine cannot take prints nothing.
    let context = trained.context();
    ava_train::model::check_positions(model.spec(), context, prompt.len(), args.max_tokens)
        .map_err(|e| Failure::Usage(e.into()))?;

    // The text so far, printed as it grows; a token that ends inside a UTF-8 character is
    // held back until the character is whole.
    p.stream(&args.prompt);
    let mut ids: Vec<u32> = Vec::new();
    let mut shown = 0;
    let started = Instant::now();
    let (out, stop) =
        ava_train::model::generate(model, &prompt, args.max_tokens, context, sampling, stop_at, &mut |id| {
            ids.push(id);
            if let Ok(text) = tokenizer.decode(&ids)
                && !text.ends_with('\u{fffd}')
                && text.len() > shown
                && text.is_char_boundary(shown)
            {
                p.stream(&text[shown..]);
                shown = text.len();
            }
        })
        .map_err(|e| Failure::Usage(e.into()))?;
    let seconds = started.elapsed().as_secs_f64();
    let text = tokenizer.decode(&out).map_err(|e| Failure::Runtime(anyhow::anyhow!("cannot decode: {e}")))?;
    if text.len() > shown && text.is_char_boundary(shown) {
        p.stream(&text[shown..]);
    }
    p.stream("\n");
    let why = match stop {
        Stop::EndOfText => "stopped at the end-of-text token",
        Stop::Length => "stopped at --max-tokens",
    };
    p.note(&format!(
        "{} tokens in {seconds:.2} s ({:.1} tokens/s, prompt of {} tokens); {why}",
        out.len(),
        out.len() as f64 / seconds.max(1e-9),
        prompt.len()
    ));
    p.result(String::new, || {
        json!({
            "model": source,
            "tokenizer": tokenizer.describe(),
            "prompt": args.prompt,
            "prompt_ids": prompt,
            "ids": out,
            "text": text,
            "stop": match stop { Stop::EndOfText => "eos", Stop::Length => "length" },
            "sampling": {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p, "seed": sampling.seed},
            "tokens_per_sec": out.len() as f64 / seconds.max(1e-9),
        })
    });
    Ok(())
}

/// The sampling the options ask for, checked.
fn sampling(args: &GenerateArgs) -> Result<Sampling, Failure> {
    if args.greedy {
        return Ok(Sampling { seed: args.seed, ..Sampling::default() });
    }
    let mut problems = Vec::new();
    if !(args.temperature.is_finite() && args.temperature >= 0.0) {
        problems.push(format!("--temperature {}: must be 0 (greedy) or more", args.temperature));
    }
    if !(args.top_p > 0.0 && args.top_p <= 1.0) {
        problems.push(format!("--top-p {}: must be above 0 and at most 1 (1: no cut)", args.top_p));
    }
    if !problems.is_empty() {
        return Err(usage(&problems.join("; ")));
    }
    Ok(Sampling { temperature: args.temperature, top_k: args.top_k, top_p: args.top_p, seed: args.seed })
}

/// Loads the model for inference; a path or tokenizer that is not one is a usage error.
pub(crate) fn load(
    path: &std::path::Path,
    tokenizer: Option<&std::path::Path>,
    threads: usize,
) -> Result<Trained, Failure> {
    let kernel = ava_plugins::Registry::builtins()
        .attention("standard", "{}")
        .map_err(|e| Failure::Runtime(anyhow::anyhow!("the built-in attention kernel: {e}")))?;
    let options = LoadOptions {
        kernel: (kernel, "standard"),
        max_seq: 1,
        threads: ava_train::train::resolve_threads(threads),
        tokenizer,
    };
    // What the folder holds is the user's input (exit 2, as `ava train` says of it); failing
    // to read it or to compute is not.
    inference::load(path, &options).map_err(|e| match e {
        InferenceError::Save(_) | InferenceError::Model(ModelError::Io { .. } | ModelError::Candle(_)) => {
            Failure::Runtime(e.into())
        }
        e => Failure::Usage(e.into()),
    })
}

fn usage(message: &str) -> Failure {
    Failure::Usage(anyhow::anyhow!("{message}"))
}
