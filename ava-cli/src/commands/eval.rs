//! `ava eval`: a trained model's mean cross-entropy and perplexity on a split of a prepared
//! corpus (or of the run's own data), sequence by sequence through the inference forward
//! (`ava_train::model::Generator`, which the golden tests hold to transformers' logits).

use std::path::Path;
use std::time::Instant;

use ava_data::{DataOptions, Dataset, Packing, Source, Split, Tokenizer};
use ava_train::inference::Trained;
use ava_train::model::{Generator, ops};
use candle_core::{DType, Tensor};
use serde_json::json;

use crate::{CmdResult, Failure, cli::EvalArgs, output::Printer};

use super::train::set_threads;

/// Batches when neither --batches, a corpus's length nor a run's config says.
const DEFAULT_BATCHES: u64 = 8;

pub fn run(p: &Printer, args: &EvalArgs) -> CmdResult {
    if args.batch_size == Some(0) || args.batches == Some(0) || args.seq_len == Some(0) {
        return Err(usage("--batch-size, --batches and --seq-len must be at least 1"));
    }
    set_threads(args.threads);
    let trained = super::generate::load(&args.model, args.tokenizer.as_deref(), args.threads)?;
    let seq = args.seq_len.or(trained.config.as_ref().map(|c| c.data.seq_len)).unwrap_or(256.min(trained.context()));
    check_room(&trained, seq)?;
    let split = if args.split == "train" { Split::Train } else { Split::Validation };
    let (dataset, what) = open_data(args, &trained, seq)?;
    if split == Split::Validation
        && let Some(why) = dataset.missing_validation()
    {
        return Err(usage(&format!("{why}. Nothing to evaluate on: use --split train, or another --data")));
    }
    let vocab = trained.model.spec().vocab;
    if dataset.vocab_size() > vocab {
        return Err(usage(&format!(
            "{what} has token ids up to {} but the model's vocabulary is {vocab}: it was tokenized for another model",
            dataset.vocab_size() - 1
        )));
    }
    // As many sequences as training's evaluation reads, unless a corpus's pass or the options
    // say otherwise: batch k of a split is its sequences k·B..(k+1)·B, so these are the same
    // sequences and the loss is the one the run reported.
    let config = trained.config.as_ref();
    let batch = args.batch_size.or(config.map(|c| c.train.eval_batch())).unwrap_or(8) as u64;
    let sequences = match args.batches {
        Some(b) => b * batch,
        None => dataset
            .sequences_per_pass(split, seq)
            .unwrap_or_else(|| config.map_or(DEFAULT_BATCHES, |c| c.train.eval_batches as u64) * batch),
    };
    let split_name = if split == Split::Train { "train" } else { "validation" };
    p.note(&format!(
        "model: {}; {} sequences of {seq} tokens from the {split_name} split of {what}",
        trained.source, sequences
    ));

    let started = Instant::now();
    let mut last_note = Instant::now();
    let mut total = 0.0f64;
    // One generator (its f32 weights and rotary tables) for every sequence, emptied between.
    let mut generator = Generator::new(&trained.model, seq).map_err(|e| Failure::Runtime(e.into()))?;
    for i in 0..sequences {
        let ids = dataset.sequence(split, i, seq); // (T + 1)
        generator.reset();
        let logits = generator.feed_all(&ids[..seq]).map_err(runtime)?; // (T, V)
        let loss = ops::cross_entropy(&logits, &ids[1..])
            .and_then(|l| l.to_dtype(DType::F64))
            .and_then(|l: Tensor| l.to_scalar::<f64>())
            .map_err(runtime)?;
        if !loss.is_finite() {
            return Err(Failure::Runtime(anyhow::anyhow!(
                "the loss of sequence {i} of the {split_name} split is {loss}: the model's numbers overflow (a weight \
                 near f32's limit, or activations that grow past it), so no loss or perplexity can be given; check \
                 the weights of {} (a run that diverged: resume from an earlier checkpoint)",
                trained.source
            )));
        }
        total += loss;
        if last_note.elapsed().as_secs_f64() >= 10.0 {
            p.note(&format!("{}/{sequences} sequences, loss so far {:.4}", i + 1, total / (i + 1) as f64));
            last_note = Instant::now();
        }
    }
    let loss = total / sequences.max(1) as f64;
    let tokens = sequences * seq as u64;
    let seconds = started.elapsed().as_secs_f64();
    // The run's "validation loss" reads its first train.eval_batches × eval_batch_size
    // sequences: where this read others, the two numbers differ, and that is said.
    let run_reads = config.map(|c| c.train.eval_batches as u64 * c.train.eval_batch() as u64);
    let run_seq = config.map(|c| c.data.seq_len);
    let other_than_the_run = match run_reads {
        Some(n) if split == Split::Validation && args.data.is_none() && (n != sequences || run_seq != Some(seq)) => {
            format!(
                "\nthe run's validation loss reads {n} sequences of {} tokens (train.eval_batches × \
                 train.eval_batch_size, data.seq_len), not these {sequences} of {seq}, so it differs from this one",
                run_seq.unwrap_or(seq)
            )
        }
        _ => String::new(),
    };
    p.result(
        || {
            format!(
                "{split_name} loss {loss:.4} nats/token, perplexity {:.3} — {tokens} tokens ({sequences} sequences of \
                 {seq}) of {what}, in {seconds:.1} s{other_than_the_run}",
                loss.exp()
            )
        },
        || {
            json!({
                "model": trained.source,
                "data": what,
                "split": split_name,
                "seq_len": seq,
                "sequences": sequences,
                "tokens": tokens,
                "loss": loss,
                "perplexity": loss.exp(),
                "seconds": seconds,
            })
        },
    );
    Ok(())
}

/// Checks that sequences of `seq` tokens fit the model's context and the machine's memory:
/// the generator's cache and tables ([`generator_bytes`](ava_train::model::generator_bytes))
/// and a sequence's logits with the cross-entropy's copy of them.
fn check_room(trained: &Trained, seq: usize) -> Result<(), Failure> {
    let (spec, context) = (trained.model.spec(), trained.context());
    if seq > context {
        return Err(usage(&format!(
            "--seq-len {seq} is longer than the model runs: {}; use --seq-len {context} or less",
            ava_train::model::context_note(spec, context)
        )));
    }
    let logits = (seq as u64).saturating_mul(spec.vocab as u64).saturating_mul(8); // (T, V) f32, twice
    let need = ava_train::model::generator_bytes(spec, seq).saturating_add(logits);
    if let Some(available) = ava_train::memory::available_bytes()
        && need > available
    {
        return Err(usage(&format!(
            "sequences of {seq} tokens need {:.2} GiB beside the weights (the key/value cache, a chunk's attention, \
             the logits), but the machine has {:.2} GiB available: use a shorter --seq-len",
            ava_train::memory::gib(need),
            ava_train::memory::gib(available)
        )));
    }
    Ok(())
}

/// The data to evaluate on: `--data`'s corpus (checked to be tokenized as the model reads),
/// else the run's own data source.
fn open_data(args: &EvalArgs, trained: &Trained, seq: usize) -> Result<(std::sync::Arc<dyn Dataset>, String), Failure> {
    let options = match (&args.data, &trained.config) {
        (Some(dir), _) => {
            check_tokenizer(dir, &trained.tokenizer)?;
            DataOptions {
                source: Source::Shards { dir: dir.clone(), tokenizer: None },
                seq_len: seq,
                val_fraction: 0.0,
                seed: 0,
                packing: Packing::Concat,
            }
        }
        (None, Some(config)) => {
            let mut options = ava_train::train::data_options(config).map_err(|e| Failure::Usage(e.into()))?;
            options.seq_len = seq;
            options.packing = Packing::Concat;
            options
        }
        (None, None) => {
            return Err(usage(&format!(
                "{} is a model folder without the run it came from: pass the data to evaluate on, --data DIR (a \
                 corpus from `ava data prepare`)",
                args.model.display()
            )));
        }
    };
    let what = match &options.source {
        Source::Synthetic(_) => "the run's synthetic source".to_string(),
        Source::Text { path, .. } => format!("text file {}", path.display()),
        Source::Shards { dir, .. } => format!("corpus {}", dir.display()),
        Source::Mix { corpora, .. } => format!("a mixture of {} corpora", corpora.len()),
    };
    let dataset = ava_data::open(&options).map_err(|e| Failure::Usage(e.into()))?;
    Ok((dataset, what))
}

/// Refuses a corpus prepared with another tokenizer than the model reads with.
fn check_tokenizer(dir: &Path, tokenizer: &Tokenizer) -> Result<(), Failure> {
    use ava_data::manifest::{Manifest, TokenizerId};
    let manifest = Manifest::load(dir).map_err(|e| Failure::Usage(e.into()))?;
    let same = match (&manifest.tokenizer, tokenizer) {
        // A run trained on bytes exports the byte tokenizer as a tokenizer.json.
        (TokenizerId::Byte, t) => t.reads_as_bytes(manifest.eos_id),
        (TokenizerId::Huggingface { sha256, .. }, Tokenizer::File(t)) => {
            ava_data::shard::sha256_file(t.path()).is_ok_and(|ours| &ours == sha256)
        }
        _ => false,
    };
    if same {
        return Ok(());
    }
    Err(usage(&format!(
        "the corpus in {} was prepared with {}, but the model reads text with {}: evaluate on a corpus prepared with \
         the model's tokenizer (ava data prepare ... --tokenizer FILE)",
        dir.display(),
        manifest.tokenizer.describe(),
        tokenizer.describe()
    )))
}

fn usage(message: &str) -> Failure {
    Failure::Usage(anyhow::anyhow!("{message}"))
}

fn runtime(e: candle_core::Error) -> Failure {
    Failure::Runtime(anyhow::anyhow!("evaluation failed: {e}"))
}
