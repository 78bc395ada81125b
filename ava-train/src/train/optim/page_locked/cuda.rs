//! A GPU run's optimizer state in page-locked host memory: `offload.tiers`' `ram` share
//! (`cuda` feature); and, at the end, a state buffer's bytes in device memory and the copies
//! in and out of it.
//!
//! The parameters past the `device` share (model order, as [`streamed_params`] splits a
//! tier's share) keep their state in [`PinnedBytes`] between steps. During a step each one's
//! state visits the device: uploaded into freshly allocated device memory on the upload
//! stream, `offload.prefetch` parameters ahead of the one being stepped; stepped there by
//! the plugin's `step_cuda` on candle's compute stream; written back on the write-back
//! stream; its device copy freed once the next parameter has been stepped. So the device
//! holds at most (prefetch + 2) parameters' state of this share, and the host none of it
//! twice.
//!
//! The ordering, all of it here (the streams are the driver's own, not cudarc's, so nothing
//! is tracked for us; [`crate::memory::pinned`]):
//! - an upload waits for its device memory's allocation (an event on the compute stream)
//!   and for the last write-back into the same host bytes (their pending event);
//! - the step waits for its upload (the compute stream waits for the upload's event);
//! - the write-back waits for the step (an event on the compute stream);
//! - the device memory is freed on the compute stream after it waits for the write-back;
//! - the host touches the bytes (a checkpoint) only after their pending event.
//!
//! The compute stream's waits are timed with events around them: the seconds the copies did
//! not hide behind compute ([`StreamStats::wait_seconds`]); the copies' own seconds come from
//! events on their streams ([`StreamStats::copy_seconds`]).
//!
//! [`streamed_params`]: super::super::streamed_params
//! [`StreamStats::wait_seconds`]: super::super::StreamStats::wait_seconds
//! [`StreamStats::copy_seconds`]: super::super::StreamStats::copy_seconds

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::CudaDevice;
use candle_core::cuda::cudarc::driver::{CudaStream, DevicePtr};

use super::super::{CopyStats, StateBuffer};
pub use crate::memory::pinned::PinnedBytes;
use crate::memory::pinned::{CopyStream, Event};

/// The state of the parameters homed in page-locked host memory, and the streams that move
/// it through the device.
pub struct PinnedState {
    /// Per parameter: whether its state lives in page-locked host memory.
    pub homed: Vec<bool>,
    /// Parameters uploaded ahead of the one being stepped.
    pub prefetch: usize,
    dev: CudaDevice,
    up: CopyStream,
    down: CopyStream,
    /// Parameters whose upload was issued this step, with the event it completes at.
    arriving: HashMap<usize, Arc<Event>>,
    /// The last parameter stepped: its write-back may be in flight, its device copy alive.
    retiring: Option<usize>,
    /// (start, end) event pairs: the compute stream's waits, then the copies.
    waits: Vec<(Event, Event)>,
    copies: Vec<(Event, Event)>,
    stats: CopyStats,
    /// Bytes of this share's state on the device now.
    on_device: u64,
}

impl std::fmt::Debug for PinnedState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedState").field("homed", &self.homed).field("prefetch", &self.prefetch).finish()
    }
}

/// Bytes of the state of the parameters `homed` selects.
fn homed_bytes(buffers: &[Vec<StateBuffer>], homed: &[bool]) -> u64 {
    buffers.iter().zip(homed).filter(|(_, h)| **h).flat_map(|(b, _)| b).map(|b| b.spec.bytes()).sum()
}

fn msg(e: String) -> candle_core::Error {
    candle_core::Error::Msg(e)
}

impl PinnedState {
    /// Moves the state of the parameters `homed` selects from `buffers`' host words into
    /// page-locked memory (freeing the words), and makes the two copy streams. The error
    /// names the parameter whose memory the host could not lock, and the whole share's size.
    pub fn new(
        dev: &CudaDevice,
        buffers: &mut [Vec<StateBuffer>],
        homed: Vec<bool>,
        prefetch: usize,
        names: &dyn Fn(usize) -> String,
    ) -> Result<Self, String> {
        let total = homed_bytes(buffers, &homed);
        let ctx = dev.cuda_stream().context().clone();
        for (i, bufs) in buffers.iter_mut().enumerate().filter(|(i, _)| homed[*i]) {
            for b in bufs.iter_mut() {
                let mut pinned = PinnedBytes::zeroed(&ctx, b.spec.bytes() as usize).map_err(|e| {
                    format!(
                        "offload.tiers: the ram share's optimizer state ({} in all) goes to page-locked host memory, \
                         and {}'s buffer {} could not be placed there ({e}); lower the ram share or free host memory",
                        ava_core::format_size(total),
                        names(i),
                        b.spec.name
                    )
                })?;
                pinned.as_mut_slice()?.copy_from_slice(&b.bytes().map_err(|e| e.to_string())?);
                b.release();
                b.set_pinned(pinned);
            }
        }
        Ok(Self {
            homed,
            prefetch,
            dev: dev.clone(),
            up: CopyStream::new(dev)?,
            down: CopyStream::new(dev)?,
            arriving: HashMap::new(),
            retiring: None,
            waits: Vec::new(),
            copies: Vec::new(),
            stats: CopyStats::default(),
            on_device: 0,
        })
    }

    /// Bytes of state in page-locked host memory.
    pub fn bytes(&self, buffers: &[Vec<StateBuffer>]) -> u64 {
        homed_bytes(buffers, &self.homed)
    }

    /// candle's compute stream.
    fn compute(&self) -> Arc<CudaStream> {
        self.dev.cuda_stream()
    }

    /// Starts a step: what an earlier step left on the device (one that failed part-way) is
    /// freed once its copies are done, and the counts start again.
    pub fn begin(&mut self, buffers: &mut [Vec<StateBuffer>]) -> candle_core::Result<()> {
        self.dev.cuda_stream().context().bind_to_thread().map_err(|e| msg(e.to_string()))?;
        let left: Vec<usize> = (0..buffers.len())
            .filter(|&i| self.homed[i] && buffers[i].iter().any(StateBuffer::on_device_now))
            .collect();
        for i in left {
            self.free(i, &mut buffers[i])?;
        }
        self.arriving.clear();
        self.retiring = None;
        self.waits.clear();
        self.copies.clear();
        self.stats = CopyStats::default();
        self.on_device = 0;
        Ok(())
    }

    /// Issues parameter `i`'s upload, unless it was issued already this step.
    pub fn upload(&mut self, i: usize, bufs: &mut [StateBuffer]) -> candle_core::Result<()> {
        if self.arriving.contains_key(&i) {
            return Ok(());
        }
        let compute = self.compute();
        // (state bytes,) u8 on the device, one per buffer; at least one byte, so a plugin
        // gets an address.
        for b in bufs.iter_mut() {
            // SAFETY: every byte is written by the upload below before the step reads it.
            let slot = unsafe { self.dev.alloc::<u8>((b.spec.bytes() as usize).max(1)) }?;
            b.set_slot(slot);
            self.on_device += b.spec.bytes();
        }
        self.stats.peak_on_device = self.stats.peak_on_device.max(self.on_device);
        let allocated = Event::record(&*compute).map_err(msg)?;
        allocated.wait_on(&self.up).map_err(msg)?;
        for b in bufs.iter() {
            if let Some(last) = b.pinned_ref().and_then(PinnedBytes::pending) {
                last.wait_on(&self.up).map_err(msg)?;
            }
        }
        let start = self.up.record().map_err(msg)?;
        let stream = self.dev.cuda_stream();
        for b in bufs.iter_mut() {
            let (slot, pinned) =
                b.slot_and_pinned().ok_or_else(|| msg("pinned optimizer state without a slot".into()))?;
            let (dst, _g) = slot.device_ptr(&stream);
            // SAFETY: the slot is live until freed after this copy's event (free); the host
            // bytes are not touched until the event set below completes.
            unsafe { self.up.upload(dst, pinned.for_copy()) }.map_err(msg)?;
            self.stats.uploaded += pinned.len() as u64;
        }
        let end = self.up.record().map_err(msg)?;
        let done = Arc::new(self.up.record().map_err(msg)?);
        for b in bufs.iter_mut() {
            if let Some(p) = b.pinned_mut() {
                p.set_pending(Arc::clone(&done));
            }
        }
        self.arriving.insert(i, done);
        self.copies.push((start, end));
        Ok(())
    }

    /// Before parameter `i`'s step: its upload issued (now, if it was not read ahead), and
    /// the compute stream made to wait for it.
    pub fn before_step(&mut self, i: usize, bufs: &mut [StateBuffer]) -> candle_core::Result<()> {
        self.upload(i, bufs)?;
        let arrived = Arc::clone(&self.arriving[&i]);
        let compute = self.compute();
        let start = Event::record(&*compute).map_err(msg)?;
        arrived.wait_on(&*compute).map_err(msg)?;
        let end = Event::record(&*compute).map_err(msg)?;
        self.waits.push((start, end));
        Ok(())
    }

    /// After parameter `i`'s step: its state written back on the write-back stream, and the
    /// parameter stepped before it freed from the device.
    pub fn after_step(&mut self, i: usize, buffers: &mut [Vec<StateBuffer>]) -> candle_core::Result<()> {
        let stepped = Event::record(&*self.compute()).map_err(msg)?;
        stepped.wait_on(&self.down).map_err(msg)?;
        let start = self.down.record().map_err(msg)?;
        let stream = self.dev.cuda_stream();
        for b in buffers[i].iter_mut() {
            let (slot, pinned) =
                b.slot_and_pinned().ok_or_else(|| msg("pinned optimizer state without a slot".into()))?;
            let (src, _g) = slot.device_ptr(&stream);
            // SAFETY: the slot lives until the compute stream has waited for this copy
            // (free); the host bytes are read again only after the pending event below.
            unsafe { self.down.download(pinned.for_copy(), src) }.map_err(msg)?;
            self.stats.written_back += pinned.len() as u64;
        }
        let end = self.down.record().map_err(msg)?;
        let done = Arc::new(self.down.record().map_err(msg)?);
        for b in buffers[i].iter_mut() {
            if let Some(p) = b.pinned_mut() {
                p.set_pending(Arc::clone(&done));
            }
        }
        self.copies.push((start, end));
        self.arriving.remove(&i);
        if let Some(before) = self.retiring.replace(i) {
            self.free(before, &mut buffers[before])?;
        }
        Ok(())
    }

    /// Frees parameter `i`'s device copy once the copies that read or write it are done
    /// (the compute stream waits for them; the host does not).
    fn free(&mut self, i: usize, bufs: &mut [StateBuffer]) -> candle_core::Result<()> {
        let compute = self.compute();
        for b in bufs.iter_mut() {
            if let Some(last) = b.pinned_ref().and_then(PinnedBytes::pending) {
                last.wait_on(&*compute).map_err(msg)?;
            }
            if b.drop_slot() {
                self.on_device -= b.spec.bytes();
            }
        }
        self.arriving.remove(&i);
        Ok(())
    }

    /// Ends a step: the last write-back's device copy freed, uploads never stepped (a
    /// parameter the batch did not reach) freed, and the host waits for the write-backs, so
    /// a copy's error is this step's and the timings can be read.
    pub fn finish(&mut self, buffers: &mut [Vec<StateBuffer>]) -> candle_core::Result<CopyStats> {
        let mut left: Vec<usize> = self.arriving.keys().copied().collect();
        left.extend(self.retiring.take());
        for i in left {
            self.free(i, &mut buffers[i])?;
        }
        let mut stats = self.stats;
        for (start, end) in &self.waits {
            stats.wait_seconds += start.seconds_to(end).map_err(msg)?;
        }
        for (start, end) in &self.copies {
            stats.copy_seconds += start.seconds_to(end).map_err(msg)?;
        }
        self.waits.clear();
        self.copies.clear();
        Ok(stats)
    }
}

/// Whether state can move to `dev`: always with the `cuda` feature (the stand-in without it
/// refuses every device).
pub fn usable(_dev: &CudaDevice) -> candle_core::Result<()> {
    Ok(())
}

/// A state buffer's bytes in device memory: where they live on a GPU run
/// ([`OptimizerState::place_on`](super::super::OptimizerState::place_on)), or where page-locked
/// bytes visit during a step.
pub type DeviceBytes = candle_core::cuda::cudarc::driver::CudaSlice<u8>;

/// The bytes of `d`, copied to the host.
pub fn download(d: &DeviceBytes) -> candle_core::Result<Vec<u8>> {
    use candle_core::cuda::WrapErr;
    d.stream().clone_dtoh(d).w()
}

/// `bytes` in device memory on `dev`: one byte at least, as a zero-length allocation has no
/// address to hand a plugin.
pub fn upload(dev: &CudaDevice, bytes: &[u8]) -> candle_core::Result<DeviceBytes> {
    if bytes.is_empty() { dev.alloc_zeros::<u8>(1) } else { dev.clone_htod(bytes) }
}
