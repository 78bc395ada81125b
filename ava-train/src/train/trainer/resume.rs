//! What a resumed run reads back and checks: the trainer's own state (`trainer.json`) against
//! its checkpoint and data, the config's structural keys against the checkpoint's, and the
//! optimizer state (with the f32 masters it may hold).

use super::*;

/// The trainer's own state in a checkpoint (`trainer.json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct TrainerState {
    /// Steps completed.
    pub(super) step: u64,
    /// Next training batch index of the loader.
    pub(super) data_position: u64,
    /// The seed of the data order and initial weights. The data order has no other random
    /// state: batch i of a split is a pure function of (seed, split, i).
    pub(super) seed: u64,
    /// Loss scaling.
    pub(super) loss_scale: LossScaler,
    /// How many pieces the memory policy split each micro-batch into.
    pub(super) micro_batch_split: usize,
    /// Ranks that trained it: the loader's position counts batches of
    /// `micro_batch_size × world_size` sequences.
    #[serde(default = "one")]
    pub(super) world_size: usize,
}

fn one() -> usize {
    1
}

/// Checks `trainer.json` against its checkpoint and the run: every field in range and the
/// step the manifest's. Its numbers size and index what follows (micro-batch split, data
/// position), so a damaged one must stop here. All problems are reported at once.
fn check_trainer_state(
    state: &TrainerState,
    ckpt: &LoadedCheckpoint,
    config: &Config,
    dataset: &dyn Dataset,
    world: usize,
) -> Result<(), TrainError> {
    let mut problems = Vec::new();
    if state.step != ckpt.step {
        problems.push(format!("step is {}, but the manifest says the checkpoint is of step {}", state.step, ckpt.step));
    }
    // The store names each checkpoint by its step when it writes it: a step edited in both
    // files afterwards still disagrees with the name.
    let named = ckpt.dir.file_name().and_then(|n| n.to_str()).and_then(crate::save::parse_step);
    if let Some(named) = named.filter(|&n| n != ckpt.step) {
        problems.push(format!(
            "its directory is named for step {named}, but its manifest and step say {}: edited after it was written",
            ckpt.step
        ));
    }
    let micro = config.train.micro_batch_size;
    let split = state.micro_batch_split;
    if split == 0 || !split.is_power_of_two() || !micro.is_multiple_of(split) {
        problems.push(format!(
            "micro_batch_split is {split}; it must be a power of two dividing train.micro_batch_size ({micro})"
        ));
    }
    problems.extend(data_position_problem(state, config, dataset, world));
    let ls = &state.loss_scale;
    if !(ls.scale.is_finite() && ls.scale >= 1.0) && ls.enabled {
        problems.push(format!("loss_scale.scale is {}; it must be a finite number of at least 1", ls.scale));
    }
    if ls.enabled && ls.growth_interval == 0 {
        problems.push("loss_scale.growth_interval is 0; it must be at least 1".into());
    }
    if problems.is_empty() {
        return Ok(());
    }
    let path = ckpt.dir.join(TRAINER_FILE);
    Err(TrainError::Invalid(format!(
        "{}: {}; this checkpoint is damaged or from another run; resume from an older one",
        path.display(),
        problems.join("; ")
    )))
}

/// What is wrong with `trainer.json`'s data position, if anything. Batch k is a pure function
/// of (seed, k), so any position reads (a resume with `--force` may even change how many
/// batches a step reads), but every sequence index the loader reaches from it, its read-ahead
/// included, must fit in 64 bits: a position past that used to overflow in the loader's
/// threads and hang the run. Checked before any loader thread starts.
fn data_position_problem(state: &TrainerState, config: &Config, dataset: &dyn Dataset, world: usize) -> Option<String> {
    let pos = state.data_position;
    let per_batch = (config.train.micro_batch_size as u64).saturating_mul(world as u64);
    let ahead = (config.data.num_workers as u64).saturating_mul(config.data.prefetch_factor as u64 + 1) + 1;
    if pos.checked_add(ahead).and_then(|b| b.checked_mul(per_batch)).is_some() {
        return None;
    }
    let corpus = match dataset.sequences_per_pass(Split::Train, config.data.seq_len) {
        Some(n) => format!("the corpus holds {n} training sequences of {} tokens per pass", config.data.seq_len + 1),
        None => "the data source has no end".to_string(),
    };
    Some(format!(
        "data_position is {pos}: {pos} batches of {per_batch} sequences are past the last 64-bit sequence index \
         ({corpus}, and step {} of a run reads far fewer)",
        state.step
    ))
}

/// Resuming: loads `ckpt`'s optimizer state into `state` through views of the mapped file (a
/// state larger than memory goes straight to its tier), with progress every
/// [`IO_PROGRESS_BYTES`]; returns the f32 masters it held, if any.
pub(super) fn load_optimizer_state(
    ckpt: &LoadedCheckpoint,
    model: &Model,
    state: &mut OptimizerState,
    options: &TrainOptions,
) -> Result<Vec<NamedBuffer>, TrainError> {
    let optimizer_file = ckpt.dir.join(OPTIMIZER_FILE);
    let (buffers, _) = safetensors_views(ckpt.file(OPTIMIZER_FILE)?).map_err(|e| {
        TrainError::Invalid(format!(
            "{}: {e}; resume from an older checkpoint, or keep this one's weights with --fresh-optimizer",
            optimizer_file.display()
        ))
    })?;
    // Progress over the weights (loaded before) and the state.
    let weights: u64 = model.params().iter().map(|p| p.stored_bytes() as u64).sum();
    let total = weights + state.bytes();
    let mut reported = 0;
    let mut progress = |done: u64| {
        let done = weights + done;
        if let Some(f) = &options.io_progress
            && done / IO_PROGRESS_BYTES > reported
        {
            reported = done / IO_PROGRESS_BYTES;
            (f.0)(&IoProgress { what: "loading", dir: ckpt.dir.clone(), done, total });
        }
    };
    state.load_buffers(model.params(), buffers, &mut progress).map_err(|e| match e {
        TrainError::OptimizerState { problems, .. } => {
            TrainError::OptimizerState { problems, trained_with: saved_optimizer(ckpt), file: Some(optimizer_file) }
        }
        e => e,
    })
}

/// From a run with f32 masters in a tier to one with f32 weights (`--force`): the masters,
/// not their rounding, become the weights. Nothing to do when the model's weights are not f32.
pub(super) fn masters_into_weights(
    ckpt: &LoadedCheckpoint,
    model: &Model,
    masters: Vec<NamedBuffer>,
) -> Result<(), TrainError> {
    if model.storage() != DType::F32 {
        return Ok(());
    }
    for b in masters {
        let name = b.name.trim_end_matches(&format!(".{}", crate::train::MASTER));
        let Some(p) = model.params().iter().find(|p| p.def.name == name) else { continue };
        let numel: usize = p.def.shape.iter().product();
        if b.data.len() != numel.saturating_mul(4) {
            return Err(TrainError::Invalid(format!(
                "{}: {} holds {} bytes, but the f32 master of {name} (shape {:?}) takes {}; this checkpoint is \
                 damaged or from another run; resume from an older one",
                ckpt.dir.join(OPTIMIZER_FILE).display(),
                b.name,
                b.data.len(),
                p.def.shape,
                numel.saturating_mul(4)
            )));
        }
        let values: Vec<f32> = b.data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        let t = Tensor::from_vec(values, p.def.shape.as_slice(), p.var.device());
        t.and_then(|t| p.var.set(&t)).map_err(TrainError::candle)?;
    }
    Ok(())
}

/// Resuming: `ckpt`'s `trainer.json`, read and checked against the checkpoint, the run and
/// its data ([`check_trainer_state`]), for a run of `world` ranks.
pub(super) fn read_trainer_state(
    ckpt: &LoadedCheckpoint,
    config: &Config,
    dataset: &dyn Dataset,
    world: usize,
) -> Result<TrainerState, TrainError> {
    let mut state: TrainerState = serde_json::from_slice(ckpt.file(TRAINER_FILE)?).map_err(|e| {
        TrainError::Invalid(format!(
            "{}: unreadable trainer state: {e}; this checkpoint is damaged or from another version; resume from an \
             older one",
            ckpt.dir.join(TRAINER_FILE).display()
        ))
    })?;
    check_trainer_state(&state, ckpt, config, dataset, world)?;
    state.world_size = world;
    Ok(state)
}

/// The optimizer a checkpoint was trained with, as its `ava-config.json` names it.
fn saved_optimizer(ckpt: &LoadedCheckpoint) -> Option<String> {
    let saved: Value = serde_json::from_slice(ckpt.file(AVA_CONFIG_FILE).ok()?).ok()?;
    let sel = saved.pointer("/plugins/optimizer")?;
    let name = sel.as_str().or_else(|| sel.get("name").and_then(Value::as_str));
    Some(name.map_or_else(|| sel.to_string(), str::to_string))
}

/// Refuses a resume whose config changes what the checkpoint's state means.
///
/// A checkpoint written by `saved_world` ranks resumes on `world` ranks when the global
/// micro-batch (`train.micro_batch_size` × ranks) is the same: the loader's position counts
/// global batches, and the state is whole in the checkpoint.
pub(super) fn check_config(
    ckpt: &LoadedCheckpoint,
    config: &Config,
    options: &TrainOptions,
    saved_world: usize,
    world: usize,
) -> Result<(), TrainError> {
    let mut saved: Value = serde_json::from_slice(ckpt.file(AVA_CONFIG_FILE)?).map_err(|e| {
        TrainError::Invalid(format!("{}: unreadable config: {e}", ckpt.dir.join(AVA_CONFIG_FILE).display()))
    })?;
    let current = serde_json::to_value(config).expect("the config serializes");
    let micro = config.train.micro_batch_size;
    let saved_micro = saved.pointer("/train/micro_batch_size").and_then(Value::as_u64);
    let mut global_change = None;
    if let Some(saved_micro) = saved_micro
        && saved_world != world
    {
        let (before, after) = (saved_micro as usize * saved_world, micro * world);
        if before == after {
            // The same global batch: not a change.
            saved["train"]["micro_batch_size"] = Value::from(micro);
        } else {
            global_change = Some(format!(
                "global micro-batch (train.micro_batch_size × ranks): {saved_micro} × {saved_world} = {before} -> \
                 {micro} × {world} = {after} (on {world} ranks, resume with train.micro_batch_size: {})",
                if before % world == 0 {
                    (before / world).to_string()
                } else {
                    format!("{before}/{world}, which is not whole: use a world size dividing {before}")
                }
            ));
        }
    }
    let mut differences = differing_keys(&saved, &current, STRUCTURAL_KEYS);
    if let Some(change) = global_change {
        differences.retain(|d| !d.starts_with("train.micro_batch_size"));
        differences.push(change);
    }
    if options.fresh_optimizer {
        // The state it would have to match is not loaded.
        differences.retain(|d| !d.starts_with("plugins.optimizer"));
    }
    if differences.is_empty() || options.force {
        return Ok(());
    }
    Err(TrainError::ConfigChanged { checkpoint: ckpt.dir.clone(), differences })
}

#[cfg(test)]
mod trainer_state_tests {
    //! `trainer.json` as outside input: every field checked against the checkpoint and the
    //! run, and any bytes at all an error or a valid state, never a panic.

    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;

    fn ckpt(step: u64) -> LoadedCheckpoint {
        LoadedCheckpoint { dir: PathBuf::from("/ckpt/step-00000004"), step, files: BTreeMap::new() }
    }

    /// A corpus of 123 sequences per pass (only its size is asked).
    struct Corpus;

    impl Dataset for Corpus {
        fn vocab_size(&self) -> usize {
            2
        }
        fn sequence(&self, _: Split, _: u64, seq_len: usize) -> Vec<u32> {
            vec![0; seq_len + 1]
        }
        fn entropy_floor_nats(&self) -> Option<f64> {
            None
        }
        fn describe(&self) -> String {
            "a corpus".into()
        }
        fn sequences_per_pass(&self, _: Split, _: usize) -> Option<u64> {
            Some(123)
        }
    }

    fn check(json: &str, step: u64) -> Result<(), String> {
        let state: TrainerState = serde_json::from_str(json).map_err(|e| e.to_string())?;
        check_trainer_state(&state, &ckpt(step), &Config::default(), &Corpus, 1).map_err(|e| e.to_string())
    }

    const GOOD: &str = r#"{"step":4,"data_position":4,"seed":1,"micro_batch_split":1,
        "loss_scale":{"scale":65536.0,"clean_steps":0,"growth_interval":2000,"enabled":true}}"#;

    #[test]
    fn a_consistent_state_passes() {
        check(GOOD, 4).unwrap();
    }

    #[test]
    fn a_step_other_than_the_manifests_is_refused() {
        let e = check(GOOD, 6).unwrap_err();
        assert!(e.starts_with("/ckpt/step-00000004/trainer.json: step is 4, but the manifest says"), "{e}");
        assert!(e.ends_with("this checkpoint is damaged or from another run; resume from an older one"), "{e}");
    }

    #[test]
    fn a_split_that_does_not_divide_the_micro_batch_is_refused() {
        for split in [0usize, 3, 1 << 40] {
            let e = check(&GOOD.replace(r#""micro_batch_split":1"#, &format!(r#""micro_batch_split":{split}"#)), 4)
                .unwrap_err();
            assert!(e.contains(&format!("micro_batch_split is {split}; it must be a power of two")), "{e}");
        }
    }

    #[test]
    fn a_bad_loss_scale_is_refused_with_every_other_problem() {
        let json = GOOD.replace("65536.0", "0.0").replace(r#""growth_interval":2000"#, r#""growth_interval":0"#);
        let e = check(&json, 5).unwrap_err();
        assert!(
            e.contains("step is 4") && e.contains("loss_scale.scale is 0") && e.contains("growth_interval is 0"),
            "{e}"
        );
    }

    #[test]
    fn a_data_position_past_the_last_sequence_index_is_refused_with_the_corpus_size() {
        let micro = Config::default().train.micro_batch_size;
        // Far past the steps, but every index reachable: batch k is a function of (seed, k).
        check(&GOOD.replace(r#""data_position":4"#, r#""data_position":4000000"#), 4).unwrap();
        // Its sequence indices past u64 (they used to overflow in the loader's threads and hang).
        let pos = u64::MAX / micro as u64;
        let e = check(&GOOD.replace(r#""data_position":4"#, &format!(r#""data_position":{pos}"#)), 4).unwrap_err();
        assert!(
            e.starts_with(&format!(
                "/ckpt/step-00000004/trainer.json: data_position is {pos}: {pos} batches of {micro} sequences are past \
                 the last 64-bit sequence index (the corpus holds 123 training sequences of "
            )),
            "{e}"
        );
        assert!(e.ends_with("this checkpoint is damaged or from another run; resume from an older one"), "{e}");
    }

    fn cases() -> proptest::test_runner::Config {
        // proptest reads $PROPTEST_CASES into its default (256).
        proptest::test_runner::Config { failure_persistence: None, ..Default::default() }
    }

    proptest! {
        #![proptest_config(cases())]

        /// Any numbers in every field: Ok or an error naming trainer.json, never a panic.
        #[test]
        fn any_trainer_json_is_checked_without_panic(
            step in any::<u64>(), pos in any::<u64>(), split in any::<u64>(), scale in any::<f64>(),
            interval in any::<u64>(), enabled in any::<bool>(), manifest_step in any::<u64>(),
            edits in prop::collection::vec((any::<usize>(), any::<u8>()), 0..4),
        ) {
            let json = format!(
                r#"{{"step":{step},"data_position":{pos},"seed":1,"micro_batch_split":{split},
                "loss_scale":{{"scale":{scale:?},"clean_steps":0,"growth_interval":{interval},"enabled":{enabled}}}}}"#
            );
            let mut bytes = json.into_bytes();
            for (at, b) in edits {
                let i = at % bytes.len();
                bytes[i] = b;
            }
            let text = String::from_utf8_lossy(&bytes);
            if let Err(e) = check(&text, manifest_step)
                && e.contains("trainer.json")
            {
                prop_assert!(e.contains("resume from an older one"), "{}", e);
            }
        }
    }
}
