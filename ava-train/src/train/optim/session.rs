//! One optimizer step over the parameters, one at a time ([`StepSession`]): the state kept in
//! memory stepped first, while the tier (or page-locked host memory on a GPU) reads the
//! streamed parameters' state ahead, each written back and freed once stepped.

use super::*;

impl OptimizerState {
    /// Runs `step(i, buffers)` for each parameter `i` in `active`, with its state in
    /// `buffers`. Parameters kept in memory go first, while the tier reads the first
    /// streamed ones ahead; then each streamed parameter's state is read (the next
    /// `prefetch` ones are being read meanwhile), updated and written back, and its memory
    /// freed. Waits for every write before returning, so an I/O error is this step's.
    pub fn for_each(
        &mut self,
        active: &[usize],
        mut step: impl FnMut(usize, &mut Vec<StateBuffer>) -> Result<(), TrainError>,
    ) -> Result<StreamStats, TrainError> {
        let (ram, disk): (Vec<usize>, Vec<usize>) = active.iter().partition(|&&i| !self.is_streamed(i));
        let mut session = self.session(&disk)?;
        for i in ram.into_iter().chain(disk) {
            session.step(i, &mut step)?;
        }
        session.finish()
    }

    /// Whether parameter `i`'s state lives in the tier, or in page-locked host memory on a
    /// GPU run: away from where the step runs, so it streams.
    pub fn is_streamed(&self, i: usize) -> bool {
        match &self.home {
            Home::Here => false,
            Home::Tier(s) => s.offloaded[i],
            Home::PageLocked(p) => p.homed[i],
        }
    }

    /// Parameters read ahead of the one being stepped.
    fn prefetch(&self) -> usize {
        match &self.home {
            Home::Here => 0,
            Home::Tier(s) => s.prefetch,
            Home::PageLocked(p) => p.prefetch,
        }
    }

    /// Starts a step whose parameters are updated one at a time, in about the `order`
    /// given (the streamed parameters in it are read ahead in that order, `prefetch` at a
    /// time): the optimizer step after backward, or inside it (`train.step_in_backward`),
    /// where the state of the next parameters down is read while backward runs. End it
    /// with [`StepSession::finish`].
    pub fn session(&mut self, order: &[usize]) -> Result<StepSession<'_>, TrainError> {
        let order: Vec<usize> = order.iter().copied().filter(|&i| self.is_streamed(i)).collect();
        let mut position = vec![usize::MAX; self.buffers.len()];
        for (n, &i) in order.iter().enumerate() {
            position[i] = position[i].min(n);
        }
        let resident = self.resident_bytes();
        if let Home::PageLocked(p) = &mut self.home {
            p.begin(&mut self.buffers).map_err(TrainError::candle)?;
        }
        let ahead = self.prefetch();
        let mut session =
            StepSession { state: self, order, position, queued: 0, stats: StreamStats::default(), resident };
        session.read_ahead(ahead)?;
        Ok(session)
    }
}

/// One optimizer step over the parameters, one at a time, with the tier reading ahead
/// ([`OptimizerState::session`]).
pub struct StepSession<'a> {
    state: &'a mut OptimizerState,
    /// The streamed parameters in the order they are expected.
    order: Vec<usize>,
    /// Per parameter, its place in `order` (MAX: not in it).
    position: Vec<usize>,
    /// Reads were asked for `order[..queued]`.
    queued: usize,
    stats: StreamStats,
    /// State held between steps.
    resident: u64,
}

impl StepSession<'_> {
    fn sample(&mut self, working: u64) {
        if let Home::Tier(s) = &self.state.home {
            let in_tier = s.tier.resident_bytes();
            self.stats.peak_tier = self.stats.peak_tier.max(in_tier);
            self.stats.peak_resident = self.stats.peak_resident.max(self.resident + working + in_tier);
        }
    }

    /// Asks the tier for the streamed parameters of `order[..upto]` not yet asked for (on a
    /// GPU run from page-locked memory, issues their uploads).
    fn read_ahead(&mut self, upto: usize) -> Result<(), TrainError> {
        match &mut self.state.home {
            Home::PageLocked(p) => {
                while self.queued < self.order.len().min(upto) {
                    let i = self.order[self.queued];
                    p.upload(i, &mut self.state.buffers[i]).map_err(TrainError::candle)?;
                    self.queued += 1;
                }
            }
            Home::Tier(s) => {
                while self.queued < self.order.len().min(upto) {
                    for k in &s.keys[self.order[self.queued]] {
                        s.tier.prefetch(k).map_err(|e| tier_error(&s.name, &format!("prefetching {k}"), e))?;
                    }
                    self.queued += 1;
                }
            }
            Home::Here => {}
        }
        Ok(())
    }

    /// Runs `step(i, buffers)` with parameter `i`'s state; a streamed parameter's state is
    /// read from the tier first (the next ones in the order are asked for meanwhile), and
    /// written back and freed after.
    pub fn step(
        &mut self,
        i: usize,
        step: &mut impl FnMut(usize, &mut Vec<StateBuffer>) -> Result<(), TrainError>,
    ) -> Result<(), TrainError> {
        match &self.state.home {
            Home::Tier(s) if s.offloaded[i] => {
                let (tier, name, prefetch) = (Arc::clone(&s.tier), s.name.clone(), s.prefetch);
                let keys = s.keys[i].clone();
                self.step_tiered(i, step, tier, name, prefetch, keys)
            }
            Home::PageLocked(p) if p.homed[i] => self.step_pinned(i, step),
            _ => step(i, &mut self.state.buffers[i]),
        }
    }

    /// [`step`](Self::step) of a parameter whose state lives in the tier `tier` (named `name`,
    /// `prefetch` parameters read ahead) under `keys`.
    fn step_tiered(
        &mut self,
        i: usize,
        step: &mut impl FnMut(usize, &mut Vec<StateBuffer>) -> Result<(), TrainError>,
        tier: Arc<dyn OffloadTier>,
        name: String,
        prefetch: usize,
        keys: Vec<String>,
    ) -> Result<(), TrainError> {
        let waiting = Instant::now();
        for (b, k) in self.state.buffers[i].iter_mut().zip(&keys) {
            b.reserve();
            tier.get(k, b.bytes_mut()).map_err(|e| tier_error(&name, &format!("reading {k}"), e))?;
            self.stats.read_bytes += b.held();
        }
        self.stats.wait_seconds += waiting.elapsed().as_secs_f64();
        let held: Vec<u64> = self.state.buffers[i].iter().map(StateBuffer::held).collect();
        // On a GPU run the state visits the device for its step (copied from and back to the
        // host's pageable bytes on the compute stream: next to a disk's 0.5–1 GB/s the link's
        // 13–17 GB/s for pageable copies costs little, so no page-locked staging).
        if let Some(dev) = &self.state.gpu {
            for b in self.state.buffers[i].iter_mut() {
                b.place_on(dev).map_err(TrainError::candle)?;
            }
        }
        // The next `prefetch` parameters load while this one is updated (this one was just
        // read: never asked for again).
        let at = self.position[i];
        if at != usize::MAX {
            self.queued = self.queued.max(at + 1);
            self.read_ahead(at + 1 + prefetch)?;
        }
        let working: u64 = held.iter().sum();
        self.sample(working);
        step(i, &mut self.state.buffers[i])?;
        // Each buffer is freed as soon as the tier has its copy.
        let mut left = working;
        for (j, k) in keys.iter().enumerate() {
            let b = &self.state.buffers[i][j];
            let waiting = Instant::now();
            let bytes = b.bytes().map_err(TrainError::candle)?;
            tier.put(k, &bytes, b.spec.dtype).map_err(|e| tier_error(&name, &format!("storing {k}"), e))?;
            self.stats.wait_seconds += waiting.elapsed().as_secs_f64();
            self.stats.written_bytes += held[j];
            self.sample(left);
            left -= held[j];
            self.state.buffers[i][j].release();
        }
        Ok(())
    }

    /// [`step`](Self::step) of a parameter whose state lives in page-locked host memory on a
    /// GPU run: uploaded (if it was not read ahead), the compute stream waiting for it, the
    /// next ones' uploads issued, stepped, and written back.
    fn step_pinned(
        &mut self,
        i: usize,
        step: &mut impl FnMut(usize, &mut Vec<StateBuffer>) -> Result<(), TrainError>,
    ) -> Result<(), TrainError> {
        let Home::PageLocked(pinned) = &mut self.state.home else { unreachable!("called for a page-locked home") };
        pinned.before_step(i, &mut self.state.buffers[i]).map_err(TrainError::candle)?;
        let at = self.position[i];
        if at != usize::MAX {
            self.queued = self.queued.max(at + 1);
            let prefetch = self.state.prefetch();
            self.read_ahead(at + 1 + prefetch)?;
        }
        step(i, &mut self.state.buffers[i])?;
        let Home::PageLocked(pinned) = &mut self.state.home else { unreachable!("called for a page-locked home") };
        pinned.after_step(i, &mut self.state.buffers).map_err(TrainError::candle)
    }

    /// Waits for every write, so an I/O error is this step's, and returns what streaming
    /// held at its most.
    pub fn finish(mut self) -> Result<StreamStats, TrainError> {
        if let Home::PageLocked(p) = &mut self.state.home {
            let copies = p.finish(&mut self.state.buffers).map_err(TrainError::candle)?;
            let kept: u64 = (0..self.state.buffers.len())
                .filter(|&i| self.state.held[i] && !p.homed[i])
                .flat_map(|i| self.state.buffers[i].iter().map(|b| b.spec.bytes()))
                .sum();
            return Ok(StreamStats {
                peak_resident: kept + copies.peak_on_device,
                peak_tier: 0,
                read_bytes: copies.uploaded,
                written_bytes: copies.written_back,
                wait_seconds: copies.wait_seconds,
                copy_seconds: copies.copy_seconds,
            });
        }
        if let Home::Tier(s) = &self.state.home {
            let waiting = Instant::now();
            s.tier.flush().map_err(|e| tier_error(&s.name, "writing the optimizer state", e))?;
            self.stats.wait_seconds += waiting.elapsed().as_secs_f64();
        }
        self.sample(0);
        Ok(self.stats)
    }
}
