//! The GPU half of the optimizer state's homes in a build without the `cuda` feature: the
//! same types as `optim/page_locked/cuda.rs` ([`PinnedState`], [`PinnedBytes`], [`DeviceBytes`]),
//! uninhabited. No value of them can exist, so `OptimizerState` never has a page-locked home
//! and no [`StateBuffer`] holds device or page-locked bytes; every branch that handles them
//! is unreachable, and the state, its buffers and its step session handle them without a
//! `cfg`.
//!
//! The ways in refuse: [`usable`], [`PinnedState::new`] and [`upload`]. In this build
//! `ava_train::device::open` never yields a CUDA device, so a run never asks; a caller that
//! hands `OptimizerState::place_on` a CUDA device by hand gets their error.

use candle_core::CudaDevice;

use super::super::{CopyStats, StateBuffer};

/// No value: what makes [`PinnedState`] uninhabited.
enum Never {}

/// The state of parameters homed in page-locked host memory: none without the `cuda`
/// feature. Its public fields are `cuda.rs`'s, read by the same code in both builds.
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

// The methods the state and its session call, as `cuda.rs` has them; none can run.
impl PinnedState {
    /// Refused: this build has no page-locked memory (see the module doc).
    pub fn new(
        _dev: &CudaDevice,
        _buffers: &mut [Vec<StateBuffer>],
        _homed: Vec<bool>,
        _prefetch: usize,
        _names: &dyn Fn(usize) -> String,
    ) -> Result<Self, String> {
        Err("optimizer state in page-locked host memory needs a build with the cuda feature".into())
    }

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

/// A state buffer's bytes in page-locked host memory: none without the `cuda` feature.
#[derive(Debug, Clone)]
pub enum PinnedBytes {}

impl PinnedBytes {
    pub fn as_slice(&self) -> Result<&[u8], String> {
        match *self {}
    }
}

/// A state buffer's bytes in device memory: none without the `cuda` feature.
#[derive(Debug, Clone)]
pub enum DeviceBytes {}

pub fn download(d: &DeviceBytes) -> candle_core::Result<Vec<u8>> {
    match *d {}
}

/// Refused: this build has no device to move state to (see the module doc).
pub fn usable(_dev: &CudaDevice) -> candle_core::Result<()> {
    candle_core::bail!("optimizer state on a GPU needs a build with the cuda feature")
}

/// Refused: this build has no device memory (see the module doc).
pub fn upload(_dev: &CudaDevice, _bytes: &[u8]) -> candle_core::Result<DeviceBytes> {
    candle_core::bail!("optimizer state on a GPU needs a build with the cuda feature")
}
