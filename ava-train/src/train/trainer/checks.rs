//! What a config must satisfy before a run is built, and what it resolves to: threads, the
//! data options, the architecture, the attention window, samples, the training modes, the
//! weights' types, the vocabulary and the hard limit. Every problem names its key and the fix.

use super::*;

/// The compute threads a config asks for (0: one per core, shared out among the ranks that
/// run on this machine).
pub fn resolve_threads(threads: usize) -> usize {
    if threads > 0 {
        threads
    } else {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        (cores / crate::dist::local_size()).max(1)
    }
}

/// The data options of a config.
pub fn data_options(config: &Config) -> Result<DataOptions, TrainError> {
    let d = &config.data;
    if !d.mix.0.is_empty() && d.source != DataSource::Shards {
        return Err(TrainError::Invalid(format!(
            "data.mix names prepared corpora but data.source is {}: set data.source to shards",
            serde_json::to_value(d.source).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default()
        )));
    }
    let source = match d.source {
        DataSource::Synthetic => Source::Synthetic(MarkovSpec {
            alphabet: d.synthetic.alphabet,
            order: d.synthetic.order,
            branching: d.synthetic.branching,
            seed: config.train.seed,
        }),
        DataSource::Text => Source::Text {
            path: d.path.clone().ok_or_else(|| {
                TrainError::Invalid("data.source is text but data.path is not set: set data.path to a text file".into())
            })?,
            tokenizer: d.tokenizer.clone(),
        },
        DataSource::Shards if !d.mix.0.is_empty() => {
            if let Some(path) = &d.path {
                return Err(TrainError::Invalid(format!(
                    "data.path ({}) and data.mix are both set: train on one corpus (data.path) or a mixture \
                     (data.mix), and set the other to null / []",
                    path.display()
                )));
            }
            Source::Mix {
                corpora: d.mix.0.iter().map(|s| (s.path.clone(), s.fraction)).collect(),
                tokenizer: d.tokenizer.clone(),
            }
        }
        DataSource::Shards => Source::Shards {
            dir: d.path.clone().ok_or_else(|| {
                TrainError::Invalid(
                    "data.source is shards but data.path is not set: set data.path to a directory written by `ava \
                     data prepare` (or data.mix to several)"
                        .into(),
                )
            })?,
            tokenizer: d.tokenizer.clone(),
        },
    };
    Ok(DataOptions {
        source,
        seq_len: d.seq_len,
        val_fraction: d.val_fraction,
        seed: config.train.seed,
        packing: d.packing,
    })
}

/// The model architecture a config describes (from `model.from`'s config.json if set).
pub fn model_spec(config: &Config) -> Result<ModelSpec, TrainError> {
    Ok(match &config.model.from {
        Some(dir) => ModelSpec::from_hf_config(&dir.join(HF_CONFIG_FILE))?,
        None => ModelSpec::from_config(&config.model)?,
    })
}

/// The attention window of a kernel selection: `Some(None)` for full causal attention,
/// `Some(Some(w))` for a window of `w`, `None` when the host cannot tell (another plugin).
fn kernel_window(sel: &PluginSelection) -> Option<Option<usize>> {
    match sel.name.as_str() {
        "standard" | "flash" => Some(None),
        // The sliding-window plugin's default window.
        "sliding-window" => Some(Some(sel.options.get("window").and_then(|v| v.as_u64()).unwrap_or(256) as usize)),
        _ => None,
    }
}

/// Checks the selected attention computes what the model asks for: a model with a sliding
/// window (Mistral's `sliding_window`) needs a kernel with that window, unless the window
/// covers every sequence of `seq` tokens, where full causal attention is the same.
pub fn check_attention(spec: &ModelSpec, sel: &PluginSelection, seq: usize) -> Result<(), TrainError> {
    let Some(w) = spec.sliding_window else { return Ok(()) };
    let seen = |window: Option<usize>| window.map_or(seq, |w| w.min(seq));
    match kernel_window(sel) {
        Some(k) if seen(k) == seen(Some(w)) => Ok(()),
        found => {
            let what = match found {
                Some(None) => "full causal attention".to_string(),
                Some(Some(k)) => format!("a window of {k}"),
                None => "a kernel whose window Ava cannot check".to_string(),
            };
            Err(TrainError::Invalid(format!(
                "the model is a {} with sliding_window: {w} (each token sees the last {w} positions, its own \
                 included), but plugins.attention is '{}' ({what}), which would compute another model for sequences \
                 of {seq} tokens: set plugins.attention={{name: sliding-window, window: {w}}}, or data.seq_len to at \
                 most {w} (the window then covers every sequence)",
                spec.arch.model_type(),
                sel.name
            )))
        }
    }
}

/// Checks that a sample (`train.sample_every`: the token it starts from and
/// `train.sample_tokens` after it) fits in the model's context, so a run does not stop at its
/// first sample.
pub fn check_samples(spec: &ModelSpec, config: &Config) -> Result<(), TrainError> {
    let t = &config.train;
    let context = spec.context().max(config.data.seq_len);
    if t.sample_every == 0 || t.sample_tokens < context {
        return Ok(());
    }
    Err(TrainError::Invalid(format!(
        "train.sample_tokens is {} but {}: set train.sample_tokens to at most {} (a sample starts from one token)",
        t.sample_tokens,
        model::context_note(spec, context),
        context - 1
    )))
}

/// Checks that `train.master_weights` and `train.step_in_backward` work with the rest of
/// the config; every problem is reported at once, each naming the keys and what to change.
///
/// `world`: the ranks the run has, for the `distributed` section's own conditions.
pub fn check_training_modes(config: &Config, world: usize) -> Result<(), TrainError> {
    let t = &config.train;
    let mut problems = Vec::new();
    if world > 1 && t.step_in_backward {
        problems.push(format!(
            "train.step_in_backward is not supported with {world} ranks yet (each gradient would have to be \
             reduced before its step inside backward): set train.step_in_backward: false"
        ));
    }
    let mw = t.master_weights;
    if mw != MasterWeights::F32 && t.precision == Precision::Fp32 {
        problems.push(format!(
            "train.master_weights: {} keeps the weights in train.precision, which is fp32 (4 bytes a weight, as with \
             f32 masters): set train.precision: bf16 (or f16), or train.master_weights: f32",
            mw.as_str()
        ));
    }
    let tiers = &config.offload.tiers;
    if mw == MasterWeights::Tier && tiers.offloaded().is_none() && tiers.pinned(t.device.is_cuda()) == 0.0 {
        let gpu = if t.device.is_cuda() {
            "; on a GPU run, page-locked host memory takes them too (offload.tiers: [device: 0%, ram: 100%])"
        } else {
            ""
        };
        problems.push(format!(
            "train.master_weights: tier streams the f32 master weights through the offload tier with the optimizer \
             state, but offload.tiers keeps all of it where the run computes: select a tier and give it a share, \
             e.g. plugins.offload: {{name: nvme, path: /mnt/scratch}} and offload.tiers: [device: 0%, nvme: 100%]{gpu} \
             (or train.master_weights: none or kahan, which keep no masters)"
        ));
    }
    if t.sample_every > 0 && world > 1 && config.distributed.zero_stage >= 3 {
        problems.push(
            "train.sample_every samples on rank 0 with every weight, which ZeRO stage 3 splits over the ranks: set \
             train.sample_every: 0 (and sample after training with `ava generate RUN`), or distributed.zero_stage \
             below 3"
                .to_string(),
        );
    }
    if t.step_in_backward {
        let why = "train.step_in_backward steps each parameter as soon as its gradient is final";
        if t.gradient_accumulation_steps > 1 {
            problems.push(format!(
                "{why}, so gradients are never summed over micro-batches, but train.gradient_accumulation_steps is \
                 {}: set it to 1 (raise train.micro_batch_size for a larger batch), or train.step_in_backward: false",
                t.gradient_accumulation_steps
            ));
        }
        if t.grad_clip > 0.0 {
            problems.push(format!(
                "{why}, before the global gradient norm is known, so train.grad_clip ({}) cannot apply: set \
                 train.grad_clip: 0 (the norm is still computed and logged), or train.step_in_backward: false",
                t.grad_clip
            ));
        }
        if t.nan_policy == NanPolicy::Skip {
            problems.push(format!(
                "{why}, so a parameter may be stepped before a later gradient of the step turns out not finite, and \
                 the step can no longer be skipped, but train.nan_policy is skip: set train.nan_policy: stop (a \
                 non-finite gradient then stops the run before it is applied, naming the checkpoint to resume from), \
                 or train.step_in_backward: false"
            ));
        }
        if t.precision == Precision::F16 {
            problems.push(format!(
                "{why}, but with train.precision: f16 an overflow is found only after the whole backward, when \
                 steps were already applied and the loss scaler could no longer skip the step: use train.precision: \
                 bf16 (no loss scaling needed) or train.step_in_backward: false"
            ));
        }
    }
    match problems.len() {
        0 => Ok(()),
        1 => Err(TrainError::Invalid(problems.remove(0))),
        _ => Err(TrainError::Invalid(format!(
            "the config's training modes do not fit:\n  - {}",
            problems.join("\n  - ")
        ))),
    }
}

/// The type the weights are stored in: f32 masters, or the compute type when there are none
/// in memory.
pub fn storage_dtype(config: &Config) -> DType {
    match config.train.master_weights {
        MasterWeights::F32 => DType::F32,
        _ => compute_dtype(config.train.precision),
    }
}

/// The engine's own state buffer per parameter for `train.master_weights`.
pub(super) fn host_state(config: &Config) -> HostState {
    match config.train.master_weights {
        MasterWeights::F32 | MasterWeights::None => HostState::Nothing,
        MasterWeights::Tier => HostState::Master,
        MasterWeights::Kahan => HostState::Compensation(match config.train.precision {
            Precision::F16 => ava_core::DType::F16,
            _ => ava_core::DType::BF16,
        }),
    }
}

pub(super) fn compute_dtype(p: Precision) -> DType {
    match p {
        Precision::Fp32 => DType::F32,
        Precision::Bf16 => DType::BF16,
        Precision::F16 => DType::F16,
    }
}

/// The architecture, and what model.from's `config.json` holds that changes nothing (said
/// once in the header).
pub(super) fn model_spec_with_notes(config: &Config) -> Result<(ModelSpec, Vec<String>), TrainError> {
    Ok(match &config.model.from {
        Some(dir) => {
            let path = dir.join(HF_CONFIG_FILE);
            let read = model::read_hf_config(&path)?;
            let notes = read.notes.iter().map(|n| format!("model.from {}: {n}", path.display())).collect();
            (read.spec, notes)
        }
        None => (ModelSpec::from_config(&config.model)?, Vec::new()),
    })
}

/// Every token id of the data must have a row in the model's embedding; the error says which
/// side to change, for the data source in use.
pub(super) fn check_vocabulary(config: &Config, dataset: &dyn Dataset, spec: &ModelSpec) -> Result<(), TrainError> {
    let (data, model) = (dataset.vocab_size(), spec.vocab);
    if data <= model {
        return Ok(());
    }
    Err(TrainError::Invalid(match (&config.model.from, config.data.source, &config.data.path) {
        (Some(dir), _, _) => format!(
            "the data has {data} distinct token ids but the model in model.from ({}) has a vocabulary of {model}: \
             train it on data tokenized with its own tokenizer (data.tokenizer: its tokenizer.json)",
            dir.display()
        ),
        (None, DataSource::Shards, Some(dir)) => format!(
            "the corpus in {} was prepared with a vocabulary of {data} but model.vocab_size is {model}: set \
             model.vocab_size to at least {data}, or prepare the corpus with a smaller tokenizer",
            dir.display()
        ),
        _ => format!(
            "the data has {data} distinct token ids but model.vocab_size is {model}: set model.vocab_size to at least \
             {data}"
        ),
    }))
}

/// `memory.hard_limit` against the rest of the config, before anything is allocated: not
/// below `memory.budget` (on a GPU both are device memory), and on the CPU only with the
/// counting allocator installed, which enforces it there.
pub(super) fn check_hard_limit(config: &Config) -> Result<(), TrainError> {
    let limit = config.memory.hard_limit.0;
    if limit == 0 {
        return Ok(());
    }
    if config.memory.budget.0 > limit {
        return Err(TrainError::Invalid(format!(
            "memory.hard_limit ({}) is below memory.budget ({}): the memory policy acts at fractions of the budget, \
             so memory would run out before it could; lower memory.budget or raise memory.hard_limit",
            config.memory.hard_limit, config.memory.budget
        )));
    }
    if !config.train.device.is_cuda() && !memory::installed() {
        return Err(TrainError::Invalid(
            "memory.hard_limit needs the counting allocator, which this program does not install (the ava binary \
             does): remove memory.hard_limit, or install ava_train::memory::CountingAlloc as the #[global_allocator]"
                .into(),
        ));
    }
    Ok(())
}
