//! One optimizer step ([`Trainer::train_step`]), a stage per concern: what the step starts
//! from ([`StepStart`]), its batches, the micro-batches' forward and backward with each
//! parameter stepped inside backward, or with the gradients accumulated (backing off to a
//! smaller micro-batch after running out of memory), checked, clipped and stepped after it,
//! and the step's record with its memory breakdown ([`StepDone`] carries what the stages did
//! to it).

use super::*;
use crate::dist::CommTimes;

/// How a step's micro-steps ended.
enum MicroSteps {
    /// All ran: the mean losses, and the most host memory the offload tier held for parked
    /// block inputs.
    Done { ce: f64, aux: f64, tier_peak: u64 },
    /// One crossed the hard limit, with this many bytes in use; on a GPU one ran out of
    /// device memory (`device`: the driver's error), with this many bytes in the pool.
    OutOfMemory { at: u64, device: Option<String> },
}

/// What the micro-steps of a step run with.
struct MicroBatches<'a> {
    model: &'a Model,
    /// The run's memory meter (the micro-batches' device is its).
    meter: &'a Meter,
    plan: &'a [BlockDecision],
    /// The f16 loss scale (1 otherwise).
    scale: f64,
    offload: Option<&'a Parking>,
    /// The step, and who is told how far it is.
    progress: (u64, Option<&'a WorkProgressFn>),
}

impl MicroBatches<'_> {
    /// Forward and backward of every micro-batch of the step's `batches` (each split into
    /// `split` pieces), the gradients going to `sink`; stops at the first micro-step during
    /// which an allocation crossed the hard limit, or on a GPU failed for want of device
    /// memory (the caller drops what it received; what the failed micro-step allocated is
    /// freed as its tensors drop).
    fn run(
        &self,
        weights: &mut dyn Weights,
        batches: &[Batch],
        split: usize,
        sink: &mut dyn GradSink,
    ) -> Result<MicroSteps, TrainError> {
        let pieces = batches.len() * split;
        let (mut ce, mut aux, mut tier_peak) = (0.0, 0.0, 0);
        memory::take_crossed(); // a crossing before the micro-steps is not theirs
        let mut done = 0;
        for batch in batches {
            for micro in split_batch(batch, split, self.meter.device())? {
                WorkProgressFn::tell(self.progress.1, Work::Step(self.progress.0), done, pieces as u64);
                done += 1;
                let loss = match forward_backward(
                    self.model,
                    weights,
                    &micro.tokens,
                    micro.documents.as_ref(),
                    &micro.targets,
                    self.plan,
                    self.scale,
                    pieces as f64,
                    self.offload,
                    sink,
                ) {
                    Ok(loss) => loss,
                    Err(e) if self.meter.is_out_of_memory(&e) => {
                        return Ok(MicroSteps::OutOfMemory { at: self.meter.held_now(), device: Some(e.to_string()) });
                    }
                    Err(e) => return Err(TrainError::candle(e)),
                };
                if let Some(at) = memory::take_crossed() {
                    return Ok(MicroSteps::OutOfMemory { at, device: None });
                }
                ce += loss.ce / pieces as f64;
                aux += loss.aux / pieces as f64;
                tier_peak = tier_peak.max(loss.tier_peak);
            }
        }
        Ok(MicroSteps::Done { ce, aux, tier_peak })
    }
}

/// What a step starts from: its number and learning rate, and what memory it found held.
struct StepStart {
    step: u64,
    lr: f64,
    started: Instant,
    /// Bytes of weights this rank holds between steps.
    params_bytes: u64,
    /// State held between steps: the engine's, and a built-in tier's records (the counting
    /// allocator sees both).
    held_optimizer: u64,
    /// The counting allocator's bytes before the step.
    baseline: u64,
}

/// What a step's micro-steps and its optimizer step did.
struct StepDone {
    ce: f64,
    aux: f64,
    /// The most host memory the offload tier held for parked block inputs.
    parked_peak: u64,
    /// The global norm of the unscaled gradients.
    norm: f64,
    /// Whether the parameters were stepped (not skipped for a non-finite loss or gradient).
    applied: bool,
    /// Bytes of the accumulated gradients (0 when each was stepped inside backward).
    grads_bytes: u64,
    /// The micro-batch back-offs after running out of memory.
    backoffs: Vec<Backoff>,
    /// The optimizer state streamed through the device or a tier.
    stream: StreamStats,
    /// Set when the step's loss or gradient is not finite and `nan_policy: skip` skipped it.
    nonfinite: Option<String>,
    /// Stage 2's reduction during backward: how long it ran and how much was exposed.
    comm: Option<CommTimes>,
}

impl StepDone {
    /// A step whose micro-steps ran and whose parameters were stepped or skipped.
    fn new(ce: f64, aux: f64, parked_peak: u64, norm: f64, applied: bool) -> Self {
        Self {
            ce,
            aux,
            parked_peak,
            norm,
            applied,
            grads_bytes: 0,
            backoffs: Vec::new(),
            stream: StreamStats::default(),
            nonfinite: None,
            comm: None,
        }
    }
}

impl Trainer {
    /// [`train_step`](Self::train_step)'s work, stage by stage: what the step starts from,
    /// its batches, forward and backward with the parameters stepped inside backward or after
    /// it, and its record.
    pub(super) fn run_step(&mut self) -> Result<StepRecord, TrainError> {
        if std::mem::take(&mut self.gather_pending) {
            self.zero.gather_parameters(self.model.params())?;
        }
        let start = self.begin_step()?;
        // Stage 3 gathers each block's weights as forward and backward reach it.
        let mut weights = self.step_weights(false)?;
        let batches = self.read_batches()?;
        let mut done = if self.config.train.step_in_backward {
            self.step_inside_backward(&start, weights.as_mut(), &batches)?
        } else {
            self.step_after_backward(&start, weights.as_mut(), &batches)?
        };
        if let Some(times) = done.comm.as_mut() {
            times.gather_seconds = weights.gather_seconds();
        }
        drop(weights);
        self.step = start.step;
        self.data_position = self.loader.position();
        self.record(&start, done)
    }

    /// The step's number, learning rate and the memory held before it; arms the tier-fault
    /// test hook and starts the step's memory high-water mark.
    fn begin_step(&mut self) -> Result<StepStart, TrainError> {
        let started = Instant::now();
        let t = &self.config.train;
        let step = self.step + 1;
        let lr = learning_rate(step, t.lr, t.min_lr, t.warmup_steps, t.max_steps);
        let params_bytes = self.held_weight_bytes();
        let tier_held = match self.state.tier() {
            Some(tier) if !self.offload_foreign => tier.resident_bytes(),
            _ => 0,
        };
        let held_optimizer = self.state.resident_bytes() + tier_held;
        if let Some((tier, at)) = &self.tier_fault
            && *at == step
        {
            tier.arm((self.model.params().len() / 2) as u64);
        }
        let baseline = memory::current();
        self.meter.reset_step_peak()?;
        Ok(StepStart { step, lr, started, params_bytes, held_optimizer, baseline })
    }

    /// The step's batches, read once: a retry after running out of memory trains on the same
    /// samples, and the loader moves on exactly as without one.
    fn read_batches(&mut self) -> Result<Vec<Batch>, TrainError> {
        let n = self.config.train.gradient_accumulation_steps;
        let mut batches = Vec::with_capacity(n);
        for _ in 0..n {
            let _span = crate::profile::scope("data: waiting for a batch");
            batches.push(self.loader.next()?);
        }
        Ok(batches)
    }

    /// Each parameter stepped inside backward (`train.step_in_backward`): nothing can be
    /// retried or skipped, since some parameters may be stepped already when something fails.
    fn step_inside_backward(
        &mut self,
        start: &StepStart,
        weights: &mut dyn Weights,
        batches: &[Batch],
    ) -> Result<StepDone, TrainError> {
        let step = start.step;
        let t = self.config.train.clone();
        let opt_name = self.config.plugins.optimizer.name.clone();
        let inject = self.oom_at_step == Some(step);
        let held_before = memory::current();
        if inject {
            self.oom_at_step = None;
            memory::set_limit(Some(held_before + 1));
        }
        let poison = self.poisoned(step);
        let settings = step_settings(self.optimizer.as_mut(), &opt_name, &self.model, &t, step, start.lr, self.threads);
        let mut sink = StepInBackward::new(settings, &mut self.state, poison);
        let run = MicroBatches {
            model: &self.model,
            meter: &self.meter,
            plan: &self.plan,
            scale: 1.0,
            offload: Some(&self.parking),
            progress: (step, self.work_progress.as_ref()),
        };
        let outcome = run.run(weights, batches, self.split, &mut sink);
        if inject {
            self.meter.set_host_limit();
        }
        // Some parameters may be stepped already: the step can be neither retried nor
        // saved, and the error says the last checkpoint is what to resume from.
        let failed =
            |source: TrainError| TrainError::FailedInBackward { step, saved: self.step, source: Box::new(source) };
        let done = match outcome {
            // The step's own error (a disk that failed, a plugin) over candle's wrapper of it.
            Err(e) => return Err(failed(sink.failure.take().unwrap_or(e))),
            Ok(done) => done,
        };
        let (stream, sumsq) = sink.finish().map_err(failed)?;
        match done {
            // Every gradient was finite (each is checked as it is stepped), but the loss
            // may not be: the step is applied, and the run stops before it is saved.
            MicroSteps::Done { ce, .. } if !ce.is_finite() => {
                let what = format!("the loss is {}", non_finite_word(ce));
                Err(failed(TrainError::NonFiniteInBackward { step, what }))
            }
            MicroSteps::Done { ce, aux, tier_peak } => {
                Ok(StepDone { stream, ..StepDone::new(ce, aux, tier_peak, sumsq.sqrt(), true) })
            }
            MicroSteps::OutOfMemory { device: Some(detail), .. } => {
                let limit = self.meter.device_limit();
                Err(failed(TrainError::DeviceOutOfMemory { step: Some(step), limit, detail }))
            }
            MicroSteps::OutOfMemory { at, device: None } => {
                let limit = if inject { held_before + 1 } else { self.meter.host_limit().unwrap_or(0) };
                Err(TrainError::OutOfMemoryInBackward { step, limit, at, saved: self.step })
            }
        }
    }

    /// The gradients accumulated over the step's micro-batches, then checked, clipped and
    /// stepped (`train.step_in_backward: false`).
    fn step_after_backward(
        &mut self,
        start: &StepStart,
        weights: &mut dyn Weights,
        batches: &[Batch],
    ) -> Result<StepDone, TrainError> {
        let step = start.step;
        let mut backoffs = Vec::new();
        let mut comm = None;
        let (mut grads, ce, aux, parked_peak) =
            self.backward_with_backoff(step, weights, batches, &mut backoffs, &mut comm)?;
        let grads_bytes = grads.iter().flatten().map(|g| (g.elem_count() * 4) as u64).sum::<u64>();
        if self.poisoned(step)
            && let Some(g) = grads.iter_mut().rev().flatten().next()
        {
            *g = g.affine(f64::NAN, 0.0).map_err(TrainError::candle)?;
        }
        let (sumsq, first_bad) = self.gradient_sumsq(&grads)?;
        let norm = sumsq.sqrt() / self.scaler.scale;
        let finite = norm.is_finite();
        let scale = self.scaler.scale; // the gradients carry this one; update may change it
        // f16's scaler absorbs an overflow of the gradients while it can lower the scale;
        // a non-finite loss, or one at the lowest scale, is the run's to handle.
        let scalable = self.scaler.enabled && scale > 1.0 && ce.is_finite();
        let applied = self.scaler.update(finite && ce.is_finite());
        let mut nonfinite = None;
        if !applied && !scalable {
            let what = if !ce.is_finite() {
                format!("the loss is {}", non_finite_word(ce))
            } else {
                let name = first_bad.map(|i| self.model.params()[i].def.name.as_str());
                format!(
                    "the gradient norm is {}{}",
                    non_finite_word(norm),
                    name.map(|n| format!(" (the first non-finite gradient: {n})")).unwrap_or_default()
                )
            };
            nonfinite = Some(self.non_finite(step, what)?);
        }
        let mut stream = StreamStats::default();
        if applied {
            self.skipped_in_a_row = 0;
            let t = &self.config.train;
            let clip = if t.grad_clip > 0.0 && norm > t.grad_clip { t.grad_clip / (norm + 1e-6) } else { 1.0 };
            stream = self.apply_gradients(start, &mut grads, clip / scale)?;
        }
        Ok(StepDone {
            grads_bytes,
            backoffs,
            stream,
            nonfinite,
            comm,
            ..StepDone::new(ce, aux, parked_peak, norm, applied)
        })
    }

    /// Forward and backward of the step's micro-batches into accumulated gradients, reduced
    /// over the ranks (stage 2 during backward, into `comm`); after running out of memory
    /// (the hard limit on the host, the device's memory on a GPU) the micro-batch is halved
    /// and the same samples run again, each back-off recorded in `backoffs`, until a
    /// micro-batch of one fails too. Returns the gradients, the mean losses and the parked
    /// inputs' peak.
    fn backward_with_backoff(
        &mut self,
        step: u64,
        weights: &mut dyn Weights,
        batches: &[Batch],
        backoffs: &mut Vec<Backoff>,
        comm: &mut Option<CommTimes>,
    ) -> Result<(Grads, f64, f64, u64), TrainError> {
        let micro_batch_size = self.config.train.micro_batch_size;
        loop {
            let held_before = self.meter.held_now();
            let inject = self.oom_at_step == Some(step);
            if inject {
                self.oom_at_step = None;
                memory::set_limit(Some(held_before + 1)); // the next allocation crosses it
            }
            let mut grads: Grads = vec![None; self.model.params().len()];
            let run = MicroBatches {
                model: &self.model,
                meter: &self.meter,
                plan: &self.plan,
                scale: self.scaler.scale,
                offload: Some(&self.parking),
                progress: (step, self.work_progress.as_ref()),
            };
            // Stage 2 reduces during backward, stretch by stretch; stages 0 and 1 after it.
            let outcome = if self.zero.stage() >= 2 && self.zero.size() > 1 {
                let mut sink = ReduceInBackward::new(&self.zero, self.model.params());
                match run.run(weights, batches, self.split, &mut sink) {
                    Err(e) => Err(sink.take_failure().unwrap_or(e)),
                    Ok(done @ MicroSteps::Done { .. }) => {
                        let (reduced, times) = sink.finish()?;
                        grads = reduced;
                        *comm = Some(times);
                        Ok(done)
                    }
                    Ok(oom) => Ok(oom),
                }
            } else {
                run.run(weights, batches, self.split, &mut grads)
            };
            if inject {
                self.meter.set_host_limit();
            }
            match outcome? {
                MicroSteps::Done { ce, aux, tier_peak } => {
                    // Every rank's gradients summed and averaged (stages 0 and 1; stage 2
                    // did it in backward), and the loss the mean over the ranks.
                    if comm.is_none() {
                        let _span = crate::profile::scope("gradients: reduce over ranks");
                        self.zero.reduce_gradients(self.model.params(), &mut grads)?;
                    }
                    let mut losses = [ce, aux];
                    self.zero.mean(&mut losses)?;
                    return Ok((grads, losses[0], losses[1], tier_peak));
                }
                MicroSteps::OutOfMemory { at, device: oom } => {
                    drop(grads);
                    if oom.is_some() {
                        self.meter.release_unused()?;
                    }
                    let micro_batch = micro_batch_size / self.split;
                    let limit = if inject { held_before + 1 } else { self.meter.host_limit().unwrap_or(0) };
                    if !self.shrink_micro_batch() {
                        return Err(match oom {
                            // Out of device memory at a micro-batch of one: what to change.
                            Some(detail) => TrainError::DeviceOutOfMemory {
                                step: Some(step),
                                limit: self.meter.device_limit(),
                                detail,
                            },
                            None => TrainError::OutOfMemory { step, micro_batch, limit, at },
                        });
                    }
                    backoffs.push(Backoff {
                        micro_batch,
                        retry_micro_batch: micro_batch_size / self.split,
                        crossed_at: at,
                        held_before,
                        held_after: self.meter.held_now(),
                    });
                    // The step's peak is the attempt that ran (the crossing is in `backoffs`),
                    // so the memory policy does not shrink again for the abandoned one.
                    self.meter.reset_step_peak()?;
                }
            }
        }
    }

    /// Σ g² over the gradients this rank holds (over every rank's from stage 2 on), and the first
    /// parameter whose gradient is not finite, to name in the error: the global norm's square
    /// of the scaled gradients (a non-finite one is an f16 overflow, or garbage:
    /// `train.nan_policy`).
    fn gradient_sumsq(&self, grads: &Grads) -> Result<(f64, Option<usize>), TrainError> {
        let held: Vec<(usize, &Tensor)> =
            grads.iter().enumerate().filter_map(|(i, g)| Some((i, g.as_ref()?))).collect();
        let sums = {
            let _span = crate::profile::scope("gradients: norm");
            let tensors: Vec<&Tensor> = held.iter().map(|(_, g)| *g).collect();
            crate::model::fused::sums_of_squares(&tensors).map_err(TrainError::candle)?
        };
        let mut sumsq = 0f64;
        let mut first_bad = None;
        for (&(i, _), s) in held.iter().zip(sums) {
            let s = s as f64;
            if !s.is_finite() && first_bad.is_none() {
                first_bad = Some(i);
            }
            sumsq += s;
        }
        if self.zero.stage() >= 2 {
            // Each rank holds its own parameters' gradients only.
            let mut total = [sumsq];
            self.zero.sum(&mut total)?;
            sumsq = total[0];
        }
        Ok((sumsq, first_bad))
    }

    /// The optimizer step: each parameter whose state this rank holds stepped with its
    /// gradient times `factor` (the clipping over the loss scale), then every rank gets the
    /// parameters the others stepped.
    fn apply_gradients(
        &mut self,
        start: &StepStart,
        grads: &mut Grads,
        factor: f64,
    ) -> Result<StreamStats, TrainError> {
        let _span = crate::profile::scope("optimizer step");
        // From stage 1 a rank steps only the parameters whose state it holds; the others'
        // gradients (stage 1 reduces them whole) go before the step.
        for (i, g) in grads.iter_mut().enumerate() {
            if !self.state.holds(i) {
                *g = None;
            }
        }
        let active: Vec<usize> = (0..grads.len()).filter(|&i| grads[i].is_some()).collect();
        let t = self.config.train.clone();
        let opt_name = self.config.plugins.optimizer.name.clone();
        // An optimizer that says so multiplies by the factor as it reads each gradient;
        // for any other the gradient is scaled first (a pass and an allocation apiece).
        let scales = self.optimizer.scales_gradients();
        let mut settings =
            step_settings(self.optimizer.as_mut(), &opt_name, &self.model, &t, start.step, start.lr, self.threads);
        if scales {
            settings.grad_scale = factor;
        }
        let stream = self.state.for_each(&active, |i, buffers| {
            let g = grads[i].take().expect("active parameters have a gradient");
            let g = if factor != 1.0 && !scales { g.affine(factor, 0.0).map_err(TrainError::candle)? } else { g };
            settings.apply(i, &g, buffers).map(drop)
        })?;
        // Every rank gets the parameters the others stepped.
        self.zero.gather_parameters(self.model.params())?;
        Ok(stream)
    }

    /// The step's record: its losses, norm and speed, and its memory breakdown (the device's
    /// on a GPU, the counting allocator's on the host).
    fn record(&self, start: &StepStart, done: StepDone) -> Result<StepRecord, TrainError> {
        let t = &self.config.train;
        let StepDone { ce, aux, parked_peak, norm, applied, grads_bytes, backoffs, stream, nonfinite, comm } = done;
        // A loaded tier's own memory is outside the allocator's count: added at its most (an
        // upper bound, as the two peaks need not coincide).
        let peak = memory::peak() + if self.offload_foreign { stream.peak_tier.max(parked_peak) } else { 0 };
        let data_bytes = start.baseline.saturating_sub(start.params_bytes + start.held_optimizer);
        let optimizer_bytes = start.held_optimizer.max(stream.peak_resident);
        let device_memory = self.meter.device_memory()?;
        // On a GPU, the state kept on the device; of the state in page-locked host memory,
        // what visited the device at once (`peak_resident` counts both then).
        let (pinned, streamed) = (self.state.pinned_bytes(), self.state.streamed_bytes());
        let kept = self.state.held_bytes().saturating_sub(pinned + streamed);
        let state_on_device = if pinned > 0 { kept.max(stream.peak_resident) } else { kept };
        let breakdown = match device_memory {
            // On a GPU: the device's high-water mark, the state there, the step's tokens.
            Some(d) => Breakdown::measured(
                d.peak,
                start.params_bytes,
                grads_bytes,
                state_on_device,
                (t.micro_batch_size * self.config.data.seq_len * 4) as u64,
                self.config.memory.budget.0,
            ),
            None => Breakdown::measured(
                peak,
                start.params_bytes,
                grads_bytes,
                optimizer_bytes,
                data_bytes,
                self.config.memory.budget.0,
            ),
        };
        let seconds = start.started.elapsed().as_secs_f64();
        let tokens = self.global_batch() * self.config.data.seq_len;
        let rank_peaks = if self.zero.size() > 1 { self.zero.gather_each(peak)? } else { Vec::new() };
        Ok(StepRecord {
            step: start.step,
            loss: ce,
            aux_loss: self.model.spec().moe.map(|_| aux),
            lr: start.lr,
            grad_norm: norm,
            skipped: !applied,
            loss_scale: self.scaler.scale,
            tokens_per_sec: tokens as f64 / seconds.max(1e-9),
            step_seconds: seconds,
            memory: breakdown,
            device_memory,
            memory_status: String::new(),
            micro_batch: t.micro_batch_size / self.split,
            backoffs,
            memory_events: Vec::new(),
            nonfinite,
            offload_bytes: stream.peak_tier.max(parked_peak),
            stream: (streamed + pinned).gt(&0).then_some(stream),
            communication: comm,
            rank_peaks,
            tokens_by_source: self.tokens_by_source(),
        })
    }
}

/// How this step's parameters are stepped, inside backward or after it.
fn step_settings<'a>(
    optimizer: &'a mut dyn ava_core::Optimizer,
    plugin: &'a str,
    model: &'a Model,
    t: &crate::config::TrainConfig,
    step: u64,
    lr: f64,
    threads: usize,
) -> StepSettings<'a> {
    StepSettings {
        optimizer,
        plugin,
        params: model.params(),
        step,
        lr,
        weight_decay: t.weight_decay,
        threads: threads as u32,
        seed: t.seed,
        grad_scale: 1.0,
    }
}

/// How a non-finite number is said in errors.
fn non_finite_word(x: f64) -> &'static str {
    if x.is_nan() { "NaN" } else { "infinite" }
}
