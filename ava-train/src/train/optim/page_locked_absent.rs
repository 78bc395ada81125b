//! The page-locked home of the optimizer state ([`PinnedState`]) in a build without the
//! `cuda` feature: the same type as `optim/page_locked.rs`, uninhabited. No value of it can
//! exist, so `OptimizerState` holds `None` where a GPU build may hold the `ram` share, every
//! branch that handles it is unreachable, and the state and its step session handle it
//! without a `cfg`.

use super::{CopyStats, StateBuffer};

/// No value: what makes [`PinnedState`] uninhabited.
enum Never {}

/// The state of parameters homed in page-locked host memory: none without the `cuda`
/// feature. Its public fields are `page_locked.rs`'s, read by the same code in both builds.
pub struct PinnedState {
    /// Per parameter: whether its state lives in page-locked host memory.
    pub homed: Vec<bool>,
    /// Parameters uploaded ahead of the one being stepped.
    pub prefetch: usize,
    never: Never,
}

impl std::fmt::Debug for PinnedState {
    fn fmt(&self, _f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.never {}
    }
}

// The methods the state and its session call, as `page_locked.rs` has them; none can run.
impl PinnedState {
    pub fn bytes(&self, _buffers: &[Vec<StateBuffer>]) -> u64 {
        match self.never {}
    }

    pub fn begin(&mut self, _buffers: &mut [Vec<StateBuffer>]) -> candle_core::Result<()> {
        match self.never {}
    }

    pub fn upload(&mut self, _i: usize, _bufs: &mut [StateBuffer]) -> candle_core::Result<()> {
        match self.never {}
    }

    pub fn before_step(&mut self, _i: usize, _bufs: &mut [StateBuffer]) -> candle_core::Result<()> {
        match self.never {}
    }

    pub fn after_step(&mut self, _i: usize, _buffers: &mut [Vec<StateBuffer>]) -> candle_core::Result<()> {
        match self.never {}
    }

    pub fn finish(&mut self, _buffers: &mut [Vec<StateBuffer>]) -> candle_core::Result<CopyStats> {
        match self.never {}
    }
}
