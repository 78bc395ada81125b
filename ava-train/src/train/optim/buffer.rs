//! One state buffer ([`StateBuffer`]): its spec and its bytes, in host memory, in device
//! memory, or (streamed through the GPU) in page-locked host memory.

use super::page_locked::{self, DeviceBytes, PinnedBytes};
use super::*;

/// One state buffer: its spec and its bytes, 8-byte aligned (stored as u64 words) and
/// zero-filled, as the contract promises. A streamed parameter's buffers hold no words
/// between steps. On a GPU run the bytes live in device memory instead
/// ([`OptimizerState::place_on`]), and the plugin's `step_cuda` reads and writes them there.
#[derive(Debug, Clone)]
pub struct StateBuffer {
    /// Name, type and length, as the plugin declared (or the engine, for its own buffers).
    pub spec: StateSpec,
    /// The engine's own buffer (f32 masters, a compensation), not the plugin's.
    pub host: bool,
    words: Vec<u64>,
    /// The bytes on the GPU (then `words` is empty): where they live, or while a step
    /// visits them from `pinned`. Never set in a build without the `cuda` feature, whose
    /// [`DeviceBytes`] has no value.
    device: Option<DeviceBytes>,
    /// The bytes in page-locked host memory: a GPU run's `ram` share ([`super::page_locked`]).
    /// Never set in a build without the `cuda` feature either.
    pinned: Option<PinnedBytes>,
}

/// Equal when spec, owner and bytes are, wherever the bytes live.
impl PartialEq for StateBuffer {
    fn eq(&self, other: &Self) -> bool {
        self.spec == other.spec
            && self.host == other.host
            && matches!((self.bytes(), other.bytes()), (Ok(a), Ok(b)) if a == b)
    }
}

impl StateBuffer {
    /// A buffer that holds no memory yet.
    pub(super) fn empty(spec: StateSpec, host: bool) -> Self {
        Self { spec, host, words: Vec::new(), device: None, pinned: None }
    }

    /// The buffer's bytes (copied from the GPU when they live there; a checkpoint is the
    /// same bytes whichever device wrote it).
    pub fn bytes(&self) -> candle_core::Result<std::borrow::Cow<'_, [u8]>> {
        if let Some(d) = &self.device {
            let mut bytes = page_locked::download(d)?;
            bytes.truncate(self.spec.bytes() as usize); // a 0-byte buffer holds 1 on the device
            return Ok(std::borrow::Cow::Owned(bytes));
        }
        if let Some(p) = &self.pinned {
            return Ok(std::borrow::Cow::Borrowed(p.as_slice().map_err(candle_core::Error::Msg)?));
        }
        Ok(std::borrow::Cow::Borrowed(&bytemuck::cast_slice(&self.words)[..self.spec.bytes() as usize]))
    }

    /// Moves the bytes to `dev`, freeing the host copy (refused in a build without the
    /// `cuda` feature).
    pub(super) fn place_on(&mut self, dev: &candle_core::CudaDevice) -> candle_core::Result<()> {
        if self.device.is_some() || self.words.is_empty() && self.spec.bytes() > 0 {
            return Ok(()); // already there, or held elsewhere (another rank, the tier)
        }
        let bytes = self.bytes()?.into_owned();
        let on = page_locked::upload(dev, &bytes)?;
        self.device = Some(on);
        self.words = Vec::new();
        Ok(())
    }

    pub(super) fn bytes_mut(&mut self) -> &mut [u8] {
        let n = self.spec.bytes() as usize;
        &mut bytemuck::cast_slice_mut(&mut self.words)[..n]
    }

    /// Gives the memory back (the bytes are in the tier or page-locked memory), on the host
    /// and on the GPU.
    pub(super) fn release(&mut self) {
        self.words = Vec::new();
        self.device = None;
    }

    /// Memory for the bytes again, zero-filled.
    pub(super) fn reserve(&mut self) {
        self.words = vec![0u64; (self.spec.bytes() as usize).div_ceil(8)];
    }

    pub(super) fn held(&self) -> u64 {
        (self.words.len() * 8) as u64
    }
}

/// The GPU half's accessors: the page-locked home (`page_locked/cuda.rs`) and the step op's
/// device launch call them; a build without the `cuda` feature has neither.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl StateBuffer {
    /// Makes page-locked memory the bytes' home.
    pub(super) fn set_pinned(&mut self, pinned: PinnedBytes) {
        self.pinned = Some(pinned);
    }

    /// The page-locked bytes, if this is their home.
    pub(super) fn pinned_ref(&self) -> Option<&PinnedBytes> {
        self.pinned.as_ref()
    }

    /// The page-locked bytes to record a copy's event on.
    pub(super) fn pinned_mut(&mut self) -> Option<&mut PinnedBytes> {
        self.pinned.as_mut()
    }

    /// The device memory a step visits the page-locked bytes in.
    pub(super) fn set_slot(&mut self, slot: DeviceBytes) {
        self.device = Some(slot);
    }

    /// The visiting device copy and the page-locked home, for a copy between them.
    pub(super) fn slot_and_pinned(&mut self) -> Option<(&DeviceBytes, &mut PinnedBytes)> {
        match (&self.device, &mut self.pinned) {
            (Some(d), Some(p)) => Some((d, p)),
            _ => None,
        }
    }

    /// Drops the visiting device copy of page-locked bytes (freed in the compute stream's
    /// order); whether there was one.
    pub(super) fn drop_slot(&mut self) -> bool {
        self.pinned.is_some() && self.device.take().is_some()
    }

    /// Whether the bytes are on the device now.
    pub(super) fn on_device_now(&self) -> bool {
        self.device.is_some()
    }

    /// The bytes on the GPU, if they live there.
    pub(super) fn on_device(&self) -> Option<&DeviceBytes> {
        self.device.as_ref()
    }

    /// The bytes on the GPU to write, if they live there.
    pub(super) fn on_device_mut(&mut self) -> Option<&mut DeviceBytes> {
        self.device.as_mut()
    }
}
