//! Building a run ([`Trainer::new`]), a stage per concern: the data and the architecture,
//! the plugins, the budget's preflight, the model on its device, the optimizer state where
//! `offload.tiers` puts it, the checkpoint plan, what a resumed checkpoint restores, the notes
//! and warnings the run prints, and the loader.

use super::*;

/// The plugins a run steps with besides its optimizer (created once the architecture is
/// known): the attention kernel, the checkpoint policy, the offload tier (wrapped by the
/// tier-fault test hook when it is armed) and the memory policy.
struct RunPlugins {
    kernel: Arc<dyn ava_core::AttentionKernel>,
    policy: Arc<dyn ava_core::CheckpointPolicy>,
    offload: Arc<dyn OffloadTier>,
    tier_fault: Option<(Arc<FailingTier>, u64)>,
    memory_policy: Box<dyn MemoryPolicy>,
}

impl Trainer {
    /// [`new`](Self::new)'s work once the device is open, checked and capped, stage by stage:
    /// the data and the architecture, the plugins, the budget's preflight, the model (built,
    /// or loaded from a checkpoint or a Hugging Face folder) on its device, the optimizer
    /// state where `offload.tiers` puts it, the checkpoint plan, what a resumed checkpoint
    /// restores, the notes and warnings the run prints, and the loader.
    pub(super) fn build(
        config: Config,
        registry: &Registry,
        options: &TrainOptions,
        device: Device,
        group: Arc<dyn Collectives>,
        device_limit: Option<crate::device::DeviceLimit>,
    ) -> Result<Self, TrainError> {
        // First: on any failure below, a capped device pool drops after what was put in it.
        let meter = Meter::new(device.clone(), &config, device_limit);
        let (rank, world) = (group.rank(), group.size());
        let threads = resolve_threads(config.train.threads);
        // Before the corpus is read (its checksums take a while on a large one).
        check_packing(&config, registry)?;
        let dataset = data::open(&data_options(&config)?)?;
        let (spec, model_notes) = model_spec_with_notes(&config)?;
        check_vocabulary(&config, dataset.as_ref(), &spec)?;
        let run_plugins = RunPlugins::create(&config, registry, options, &spec)?;
        // Created from the architecture (some options come from its shape), before the model:
        // the preflight sizes the step with it before anything model-sized is allocated.
        let opt_sel = config.selection(PluginKind::Optimizer);
        let optimizer = registry.optimizer(&opt_sel.name, &optimizer_options(registry, opt_sel, &spec)?)?;
        let mem_sel = config.selection(PluginKind::Memory);
        let new_policy = || registry.memory(&mem_sel.name, &mem_sel.options_json()).map_err(TrainError::from);
        let preflight =
            super::super::fit_budget(&spec, &config, &run_plugins.estimate(optimizer.as_ref()), world, &new_policy)?;

        let store = CheckpointStore::new(config.train.out_dir.join("checkpoints"), config.checkpoints.keep_last);
        // Resuming: the checkpoint's weights replace the initial ones.
        let resume = match &options.resume {
            Some(spec_text) => Some(CheckpointStore::load(&store.resolve(spec_text)?)?),
            None => None,
        };
        let model = load_model(&config, spec, resume.as_ref(), &run_plugins.kernel, threads, &device)?;
        check_offload_selection(&config)?;
        // f32 masters of a fresh model start from its f32 initial values; of loaded weights
        // (a checkpoint, `model.from`), from those widened.
        let fresh = resume.is_none() && config.model.from.is_none();
        let (zero, mut state) =
            allocate_state(&config, &device, optimizer.as_ref(), &model, group, &run_plugins.offload, fresh)?;
        let plan = plan_checkpoints(
            &config,
            &model,
            &run_plugins.estimate(optimizer.as_ref()),
            preflight.split,
            world,
            &zero,
        )?;

        let mut trainer_state = TrainerState::fresh(&config, preflight.split, world);
        let mut resumed_from = None;
        if let Some(ckpt) = resume {
            trainer_state = restore(&ckpt, &config, options, &model, &mut state, dataset.as_ref(), world)?;
            // Split at least as far as the budget needs now (both are powers of two).
            trainer_state.micro_batch_split = trainer_state.micro_batch_split.max(preflight.split);
            resumed_from = Some(ckpt.dir.clone());
        }
        // The state, allocated (or loaded) on the host, moves to the GPU with the model; the
        // `ram` share of offload.tiers to page-locked host memory, streamed through the GPU.
        if let Device::Cuda(gpu) = &device {
            let tiers = &config.offload.tiers;
            let home = (tiers.pinned(true) > 0.0).then(|| super::super::optim::PinnedHome {
                on_device: tiers.resident(true),
                prefetch: config.offload.prefetch,
            });
            let params = model.params();
            state.place_on(gpu, home, &|i| params[i].def.name.clone())?;
        }

        let off_name = config.selection(PluginKind::Offload).name.clone();
        let offload_foreign =
            registry.row(PluginKind::Offload, &off_name).is_some_and(|r| !matches!(r.source, PluginSource::Builtin));
        // Block inputs parked in the tier: where, and how it is set up.
        let parked = plan.iter().filter(|d| **d == BlockDecision::Offload).count();
        let sampling = samples_from(&config, dataset.as_ref())?;
        let warnings = run_warnings(&config, preflight.note, dataset.as_ref(), parked);
        // On a GPU with the built-in `ram`, parked inputs go to page-locked host memory on copy
        // streams of their own; any other tier keeps its byte API (`model::park`).
        let builtin_ram = off_name == crate::config::Tiers::RAM && !offload_foreign;
        let parking = Parking::for_run(Arc::clone(&run_plugins.offload), &device, builtin_ram, parked > 0)
            .map_err(|e| TrainError::candle(candle_core::Error::Msg(format!("offload: parked block inputs: {e}"))))?;
        let offload_note = state_note(&config, &state, run_plugins.offload.as_ref())
            .or_else(|| parked_note(&config, parked, &parking, run_plugins.offload.as_ref(), &device));

        // Each rank reads its own rows of every global micro-batch (micro_batch_size × world
        // sequences): the same samples as one process with the whole batch.
        let mut loader = Loader::new_shared(
            dataset.clone(),
            Split::Train,
            config.train.micro_batch_size,
            config.data.seq_len,
            trainer_state.data_position,
            config.data.num_workers,
            config.data.prefetch_factor,
            Share { rank, world },
        )?;
        if let Some(batch) = options.stall_loader_at_batch {
            loader.stall_at(batch);
        }
        let out_dir = config.train.out_dir.clone();
        if zero.is_root() {
            std::fs::create_dir_all(&out_dir).map_err(|e| TrainError::io(&out_dir, e))?;
        }
        // The counting allocator enforces the limit on the CPU; a GPU's pool is capped already.
        meter.set_host_limit();
        // Stage 3: each rank keeps only its own parameters' values from here on.
        let mut model = model;
        if zero.stage() >= 3 {
            model.keep_only(|i| zero.holds_values(i))?;
        }
        let gather_pending = resumed_from.is_some() && zero.stage() >= 1;
        let RunPlugins { tier_fault, memory_policy, .. } = run_plugins;
        Ok(Self {
            model,
            optimizer,
            state,
            plan,
            parking,
            offload_foreign,
            offload_note,
            model_notes,
            memory_policy,
            dataset,
            loader,
            store,
            step: trainer_state.step,
            scaler: trainer_state.loss_scale,
            split: trainer_state.micro_batch_split.max(1),
            fitted_split: preflight.split,
            warnings,
            sampling,
            io_progress: options.io_progress.clone(),
            work_progress: options.work_progress.clone(),
            compute: compute_dtype(config.train.precision),
            threads,
            resumed_from,
            out_dir,
            data_position: trainer_state.data_position,
            oom_at_step: options.oom_at_step,
            tier_fault,
            nan_grad_at_steps: options.nan_grad_at_steps.clone(),
            skipped_in_a_row: 0,
            gather_pending,
            zero: Rc::new(zero),
            config,
            meter,
        })
    }
}

impl RunPlugins {
    /// The attention kernel (it must train: a backward, and packed documents when the data
    /// packs them), the checkpoint policy, the offload tier and the memory policy.
    fn create(
        config: &Config,
        registry: &Registry,
        options: &TrainOptions,
        spec: &ModelSpec,
    ) -> Result<Self, TrainError> {
        let attention = config.selection(PluginKind::Attention);
        check_attention(spec, attention, config.data.seq_len)?;
        check_samples(spec, config)?;
        let kernel = registry.attention(&attention.name, &attention.options_json())?;
        if !kernel.supports_backward() {
            return Err(TrainError::Invalid(format!(
                "attention kernel '{}' has no backward pass, so it cannot train: pick one that has (e.g. plugins.attention: standard)",
                attention.name
            )));
        }
        let checkpoint = config.selection(PluginKind::Checkpoint);
        let policy = registry.checkpoint(&checkpoint.name, &checkpoint.options_json())?;
        let tier = config.selection(PluginKind::Offload);
        let offload = registry.offload(&tier.name, &tier.options_json())?;
        let tier_fault = options.tier_fault_at_step.map(|step| (Arc::new(FailingTier::new(offload.clone())), step));
        let offload: Arc<dyn OffloadTier> = match &tier_fault {
            Some((failing, _)) => failing.clone(),
            None => offload,
        };
        let mem_sel = config.selection(PluginKind::Memory);
        let memory_policy = registry.memory(&mem_sel.name, &mem_sel.options_json())?;
        Ok(Self { kernel, policy, offload, tier_fault, memory_policy })
    }

    /// The plugins the estimator sizes a step with, `optimizer` among them.
    fn estimate<'a>(&'a self, optimizer: &'a dyn Optimizer) -> crate::estimate::Plugins<'a> {
        crate::estimate::Plugins { optimizer, attention: self.kernel.as_ref(), checkpoint: self.policy.as_ref() }
    }
}

/// With `data.packing: document`, the attention kernel must take packed documents' segments.
fn check_packing(config: &Config, registry: &Registry) -> Result<(), TrainError> {
    if config.data.packing == Packing::Document {
        let sel = config.selection(PluginKind::Attention);
        if !registry.attention(&sel.name, &sel.options_json())?.supports_segments() {
            return Err(TrainError::Invalid(model::unsupported_packing(&sel.name)));
        }
    }
    Ok(())
}

/// The model, from a resumed checkpoint, a Hugging Face folder (`model.from`) or fresh
/// weights, built or loaded on the host (a checkpoint of any device loads the same way), then
/// moved to where it computes.
fn load_model(
    config: &Config,
    spec: ModelSpec,
    resume: Option<&LoadedCheckpoint>,
    kernel: &Arc<dyn ava_core::AttentionKernel>,
    threads: usize,
    device: &Device,
) -> Result<Model, TrainError> {
    let (seq, stored) = (config.data.seq_len, storage_dtype(config));
    let (name, k) = (&config.selection(PluginKind::Attention).name, kernel.clone());
    let model = match (resume, &config.model.from) {
        (Some(ckpt), _) => {
            let tensors = model::tensors_from_safetensors(ckpt.file(MODEL_FILE)?, &ckpt.dir.join(MODEL_FILE))?;
            Model::from_tensors_stored(spec, tensors, &ckpt.dir, seq, k, name, threads, stored)?
        }
        (None, Some(dir)) => {
            let (hf_spec, tensors) = model::load_hf_folder(dir)?;
            Model::from_tensors_stored(hf_spec, tensors, dir, seq, k, name, threads, stored)?
        }
        (None, None) => Model::new_stored(spec, config.train.seed, seq, k, name, threads, stored)?,
    };
    Ok(model.to_device(device)?.with_loss_chunk_rows(config.train.loss_chunk_rows))
}

/// The tier `offload.tiers` streams state through must be the one `plugins.offload` selects.
fn check_offload_selection(config: &Config) -> Result<(), TrainError> {
    let selected = &config.selection(PluginKind::Offload).name;
    let Some(share) = config.offload.tiers.offloaded().filter(|share| share.name != *selected) else { return Ok(()) };
    let pct = |f: f64| (f * 1e6).round() / 1e4;
    let fix = if selected == "ram" {
        format!("select it, with its options (plugins.offload: {{name: {}, ...}})", share.name)
    } else {
        format!(
            "name the selected tier (offload.tiers: [device: {}%, {}: {}%]) or select '{}' in plugins.offload",
            pct(1.0 - share.fraction),
            selected,
            pct(share.fraction),
            share.name
        )
    };
    Err(TrainError::Invalid(format!(
        "offload.tiers streams {}% of the optimizer state through '{}', but plugins.offload selects '{selected}': {fix}",
        pct(share.fraction),
        share.name,
    )))
}

/// The ranks' split of the state (ZeRO: by whole parameters, sized by the layout before
/// anything is allocated; from stage 1 each rank allocates, and places, only its own share)
/// and this rank's share of the optimizer state (and f32 masters), allocated where
/// `offload.tiers` puts it: the share that is not `ram` streams through the tier, placed as it
/// is allocated (a 7B model's state never exists in memory whole). The f32 masters of a
/// `fresh` model (built here, neither resumed nor loaded by `model.from`) start from its f32
/// initial values (the resident bf16 copy is their rounding); of loaded weights, from those
/// widened.
fn allocate_state(
    config: &Config,
    device: &Device,
    optimizer: &dyn Optimizer,
    model: &Model,
    group: Arc<dyn Collectives>,
    offload: &Arc<dyn OffloadTier>,
    fresh: bool,
) -> Result<(Zero, OptimizerState), TrainError> {
    let tiers = &config.offload.tiers;
    let tier_name = &config.selection(PluginKind::Offload).name;
    let placement = tiers.offloaded().map(|_| Placement {
        tier: Arc::clone(offload),
        name: tier_name.clone(),
        in_ram: tiers.resident(device.is_cuda()),
        prefetch: config.offload.prefetch,
    });
    let host = host_state(config);
    let (spec, seed) = (model.spec().clone(), config.train.seed);
    let master = move |p: &model::Param| {
        if fresh { Model::initial_values(&spec, seed, &p.def) } else { super::super::optim::widened(p) }
    };
    let opt_name = &config.selection(PluginKind::Optimizer).name;
    let layout = OptimizerState::layout_bytes(optimizer, model.params(), opt_name, host)?;
    let stage = if group.size() > 1 { config.distributed.zero_stage } else { 0 };
    let zero = Zero::new(group, stage, &layout, config.distributed.bucket_size.0);
    let state = OptimizerState::allocate_shard(optimizer, model.params(), opt_name, host, placement, &master, &|i| {
        zero.steps(i)
    })?;
    Ok((zero, state))
}

/// The checkpoint policy's plan for this rank's blocks, its errors named as the policy's.
fn plan_checkpoints(
    config: &Config,
    model: &Model,
    plugins: &crate::estimate::Plugins<'_>,
    split: usize,
    world: usize,
    zero: &Zero,
) -> Result<Vec<BlockDecision>, TrainError> {
    checkpoint_plan(model.spec(), config, plugins, split, world, zero.rank()).map_err(|e| match e {
        PlanError::Estimate(message) => TrainError::Invalid(message),
        PlanError::Policy(message) => TrainError::Plugin {
            plugin: config.selection(PluginKind::Checkpoint).name.clone(),
            what: "decide",
            message,
        },
    })
}

impl TrainerState {
    /// A run's state before its first step.
    fn fresh(config: &Config, split: usize, world: usize) -> Self {
        Self {
            step: 0,
            data_position: 0,
            seed: config.train.seed,
            loss_scale: LossScaler::new(
                config.train.precision == Precision::F16,
                config.train.loss_scale.init,
                config.train.loss_scale.growth_interval,
            ),
            micro_batch_split: split,
            world_size: world,
        }
    }
}

/// What a resumed checkpoint restores: the config checked against it (the saved world size
/// decides what "the same micro-batch" means), a finished run refused before its state is
/// read, the optimizer state (unless `--fresh-optimizer`) and the f32 masters into the
/// weights, and the trainer's own state.
fn restore(
    ckpt: &LoadedCheckpoint,
    config: &Config,
    options: &TrainOptions,
    model: &Model,
    state: &mut OptimizerState,
    dataset: &dyn Dataset,
    world: usize,
) -> Result<TrainerState, TrainError> {
    let saved = serde_json::from_slice::<TrainerState>(ckpt.file(TRAINER_FILE)?).ok();
    check_config(ckpt, config, options, saved.as_ref().map_or(1, |s| s.world_size), world)?;
    if let Some(step) = saved.map(|s| s.step).filter(|&s| s >= config.train.max_steps) {
        return Err(TrainError::Finished { checkpoint: ckpt.dir.clone(), step, max_steps: config.train.max_steps });
    }
    let masters = if options.fresh_optimizer { Vec::new() } else { load_optimizer_state(ckpt, model, state, options)? };
    masters_into_weights(ckpt, model, masters)?;
    read_trainer_state(ckpt, config, dataset, world)
}

/// Where the optimizer state (and f32 masters, or kahan's compensation) lives when not all
/// of it is in device or host memory: in page-locked host memory streamed through the GPU,
/// or streamed through a tier.
fn state_note(config: &Config, state: &OptimizerState, offload: &dyn OffloadTier) -> Option<String> {
    let tiers = &config.offload.tiers;
    let pinned = state.pinned_bytes();
    let what = match host_state(config) {
        HostState::Master => "optimizer state and f32 masters",
        HostState::Compensation(_) => "optimizer state and the weights' compensation (kahan)",
        HostState::Nothing => "optimizer state",
    };
    match tiers.offloaded() {
        None if pinned > 0 => Some(format!(
            "{what}: {} of {} ({:.0}%) in page-locked host memory (offload.tiers ram share {:.0}%), streamed through \
             the GPU each step, {} parameters uploaded ahead",
            ava_core::format_size(pinned),
            ava_core::format_size(state.bytes()),
            100.0 * pinned as f64 / state.bytes().max(1) as f64,
            tiers.pinned(true) * 100.0,
            config.offload.prefetch
        )),
        None => None,
        Some(share) => {
            let moved = state.streamed_bytes();
            let total = state.bytes();
            let mut note = format!(
                "{what}: {} of {} ({:.0}%) streams through {} (offload.tiers share {:.0}%), {} read ahead",
                ava_core::format_size(moved),
                ava_core::format_size(total),
                100.0 * moved as f64 / total.max(1) as f64,
                share.name,
                share.fraction * 100.0,
                config.offload.prefetch
            );
            let described = offload.describe();
            if !described.is_empty() {
                note.push_str(&format!("; {described}"));
            }
            Some(note)
        }
    }
}

/// Where the inputs of the `parked` blocks the plan offloads wait between forward and
/// backward, when any do.
fn parked_note(
    config: &Config,
    parked: usize,
    parking: &Parking,
    offload: &dyn OffloadTier,
    device: &Device,
) -> Option<String> {
    if parked == 0 {
        return None;
    }
    let tier = &config.selection(PluginKind::Offload).name;
    if parking.is_pinned() {
        return Some(format!(
            "block inputs of {parked} blocks parked in page-locked host memory ({tier}) between forward and backward: \
             written back on a copy stream, the next one down uploaded while a block is recomputed"
        ));
    }
    let described = offload.describe();
    let how = if described.is_empty() { String::new() } else { format!("; {described}") };
    let waits = if device.is_cuda() {
        "; on the GPU each park and fetch waits for its copy through the tier's host bytes (plugins.offload: ram \
         overlaps them with compute)"
    } else {
        ""
    };
    Some(format!("block inputs of {parked} blocks parked in {tier} between forward and backward{how}{waits}"))
}

/// What the run warns of before its first step: the preflight's note, training without
/// validation, and a selected tier nothing goes through.
fn run_warnings(config: &Config, preflight: Option<String>, dataset: &dyn Dataset, parked: usize) -> Vec<String> {
    let mut warnings: Vec<String> = preflight.into_iter().collect();
    if let Some(why) = dataset.missing_validation() {
        warnings.push(format!("{why}. Training runs without validation (no validation loss)"));
    }
    let tier = &config.selection(PluginKind::Offload).name;
    if tier != "ram" && config.offload.tiers.offloaded().is_none() && parked == 0 {
        warnings.push(format!(
            "plugins.offload selects '{0}', but nothing goes through it: offload.tiers keeps the whole optimizer state \
             in memory ({1}) and no recomputed block parks its input there; to stream the state, set offload.tiers \
             (e.g. --set 'offload.tiers=[{0}: 100%]'; `ava plugins enable offload {0}` writes both)",
            tier,
            serde_json::to_string(&config.offload.tiers).unwrap_or_default()
        ));
    }
    warnings
}

/// With `train.sample_every`: the run's tokenizer, the token a sample starts from (the
/// begin- or end-of-text id, else the first token of the data) and the end-of-text id.
fn samples_from(
    config: &Config,
    dataset: &dyn Dataset,
) -> Result<Option<(ava_data::Tokenizer, u32, Option<u32>)>, TrainError> {
    if config.train.sample_every == 0 {
        return Ok(None);
    }
    let invalid = |e: crate::inference::InferenceError| {
        TrainError::Invalid(format!("train.sample_every: {e} (or set train.sample_every: 0)"))
    };
    let source = crate::inference::run_tokenizer(config).map_err(invalid)?;
    let tokenizer = source.load().map_err(invalid)?;
    let start = match source.bos.or(source.eos) {
        Some(id) => id,
        None => dataset.sequence(Split::Train, 0, 1)[0],
    };
    Ok(Some((tokenizer, start, source.eos)))
}

/// Why the checkpoint plan could not be made.
enum PlanError {
    /// The estimator could not size the step.
    Estimate(String),
    /// The policy failed, or returned a plan the engine cannot carry out.
    Policy(String),
}

/// The checkpoint policy's decision per block, for micro-batches of `train.micro_batch_size /
/// split` sequences. With a memory budget the policy gets what is left of it for activations,
/// computed by the estimator for this rank (`ava estimate` shows the same plan); without
/// one, no budget.
fn checkpoint_plan(
    spec: &ModelSpec,
    config: &Config,
    plugins: &crate::estimate::Plugins<'_>,
    split: usize,
    world: usize,
    rank: usize,
) -> Result<Vec<BlockDecision>, PlanError> {
    let mut config = config.clone();
    config.train.micro_batch_size /= split;
    config.train.gradient_accumulation_steps *= split;
    let t = &config.train;
    let (batch, seq) = (t.micro_batch_size, config.data.seq_len);
    let facts = crate::estimate::block_facts(spec, batch, seq, t.precision, plugins.attention, t.device)
        .map_err(|e| PlanError::Estimate(e.to_string()))?;
    let budget_bytes = if config.memory.budget.0 == 0 {
        0
    } else {
        crate::estimate::estimate_rank(spec, &config, plugins, world, Some(rank))
            .map_err(|e| PlanError::Estimate(e.to_string()))?
            .activation_budget
    };
    let ctx = CheckpointContext { budget_bytes, offload_available: true };
    let plan = plugins.checkpoint.decide(&facts, &ctx).map_err(|e| PlanError::Policy(e.to_string()))?;
    ava_core::check_plan(&plan, spec.layers).map_err(PlanError::Policy)?;
    Ok(plan)
}
