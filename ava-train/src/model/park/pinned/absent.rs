//! The page-locked half of [`Parking`](super::super::Parking) in a build without the `cuda`
//! feature: the same types as `park/pinned/cuda.rs`, uninhabited. No value of them can exist, so
//! `Parking` and its `Session` never have a `Home::PageLocked`, where a GPU build may hold page-locked buffers,
//! every arm that handles them is unreachable, and `park.rs` handles them without a `cfg`.
//!
//! [`Park::new`] refuses: in this build `ava_train::device::open` never yields a CUDA device,
//! so a run never asks; a caller that builds one by hand gets this error where the build
//! with the feature would park in page-locked memory.

use std::marker::PhantomData;
use std::sync::Mutex;

use candle_core::{CudaDevice, Result, Tensor};

/// No value: what makes the types below uninhabited.
enum Never {}

/// Page-locked buffers and copy streams: none without the `cuda` feature.
pub(crate) struct Park(Never);

impl Park {
    /// Refused: this build has no page-locked memory (see the module doc).
    pub(crate) fn new(_dev: &CudaDevice) -> std::result::Result<Self, String> {
        Err("page-locked parking needs a build with the cuda feature".into())
    }
}

/// A block input in a page-locked buffer: none without the `cuda` feature.
pub(crate) struct Parked(Never);

/// One micro-batch's page-locked parking: none without the `cuda` feature.
pub(crate) struct Session<'a>(Never, PhantomData<&'a ()>);

// The methods `park.rs` calls, as `park/pinned/cuda.rs` has them; none can run.
impl<'a> Session<'a> {
    pub(crate) fn new(park: &'a Mutex<Park>) -> Result<Self> {
        let park = park.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        match park.0 {}
    }

    pub(crate) fn held(&self) -> u64 {
        match self.0 {}
    }

    pub(crate) fn park(&mut self, _block: usize, _input: Tensor, _tier: &dyn ava_core::OffloadTier) -> Result<Parked> {
        match self.0 {}
    }

    pub(crate) fn retire(&mut self) -> Result<()> {
        match self.0 {}
    }

    pub(crate) fn upload(&mut self, _parked: &mut Parked) -> Result<()> {
        match self.0 {}
    }

    pub(crate) fn take(&mut self, parked: Parked) -> Result<Tensor> {
        match parked.0 {}
    }
}
