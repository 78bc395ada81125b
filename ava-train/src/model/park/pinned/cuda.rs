//! A GPU run's parked block inputs in page-locked host memory (`cuda` feature, the built-in
//! `ram` tier): written back while the next blocks compute, uploaded ahead while the stage
//! above is recomputed.
//!
//! Two copy streams of the driver's own ([`CopyStream`]), one per direction, beside candle's
//! compute stream; one page-locked buffer per parked block ([`PinnedBytes`]), kept from
//! step to step. Nothing orders these copies but the rules here (cudarc tracks no events on
//! streams it did not make, [`crate::memory::pinned`]):
//!
//! - **Write-back** (forward, [`Session::park`]): the compute stream records an event after
//!   the forward that computed the input; the download stream waits for it, and for the last
//!   copy that touched the buffer (the previous step's upload out of it, its pending event);
//!   the copy's own event becomes the buffer's pending event.
//! - **The device copy after the write-back**: candle frees a tensor's memory when it is
//!   dropped, with `cuMemFreeAsync` on the compute stream, so the pool may hand that memory to
//!   the next allocation on the compute stream while the download still reads it. The parked
//!   tensor is therefore kept (`retiring`) until the next input is parked, or forward is done
//!   (after the head's forward is queued); then the compute stream waits for the download's
//!   event and only after that is the tensor dropped. The wait sits after a whole block's (or
//!   the head's) forward in the compute stream's order, by when the copy is usually done, so
//!   the compute stream does not stall on it; the device holds at most one parked input
//!   beyond the block being computed.
//! - **Upload** (backward, [`Session::upload`], issued for the next parked stage down when a
//!   stage is taken, and for the first before the loss's backward): device memory of the
//!   input's size and type is allocated on the compute stream (`CudaDevice::alloc`), whose
//!   event the upload stream waits for, with the buffer's pending event (its write-back);
//!   the upload's event becomes the buffer's pending event.
//! - **Use** ([`Session::take`]): the compute stream waits for the upload's event before the
//!   recompute reads the tensor built over that memory (`CudaStorage::wrap_cuda_slice`, no
//!   copy). The tensor is candle's from then on: dropped with the recompute's graph, freed on
//!   the compute stream, which already waited for the upload. The buffer goes back to the
//!   block's slot, its pending event the upload's.
//! - **Failures**: a parked input dropped with its upload in flight (a micro-step that ran
//!   out of memory) makes the compute stream wait for the upload before its device memory is
//!   dropped; a session dropped with a write-back in flight does the same for the download;
//!   a buffer dropped waits on the host for its pending copy ([`PinnedBytes`]'s drop).
//!
//! So the device holds, of the parked inputs, at most one whose write-back may be in flight
//! in forward, and in backward the one uploaded ahead beside the one being recomputed.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::cuda::cudarc::driver::CudaStream;
use candle_core::cuda::{CudaDevice, CudaStorage};
use candle_core::{DType, Layout, Result, Storage, Tensor};

use crate::memory::pinned::{CopyStream, Event, PinnedBytes};
use crate::model::fused::{storage_buf, storage_tensor};

fn msg(e: String) -> candle_core::Error {
    candle_core::Error::Msg(e)
}

/// The run's parking: the streams and a page-locked buffer per block parked so far.
pub(crate) struct Park {
    dev: CudaDevice,
    down: CopyStream,
    up: CopyStream,
    /// Per block, its buffer while no input of it is parked (each micro-batch takes it and
    /// gives it back).
    slots: HashMap<usize, PinnedBytes>,
}

impl Park {
    /// The streams of a run on `dev`; buffers come as blocks are parked.
    pub(crate) fn new(dev: &CudaDevice) -> std::result::Result<Self, String> {
        Ok(Self { dev: dev.clone(), down: CopyStream::new(dev)?, up: CopyStream::new(dev)?, slots: HashMap::new() })
    }
}

/// An input in a page-locked buffer.
pub(crate) struct Parked {
    block: usize,
    dims: Vec<usize>,
    dtype: DType,
    /// Its bytes (the buffer may be larger: a block's buffer serves a smaller micro-batch).
    len: usize,
    /// Its buffer (taken back into the block's slot by [`Session::take`]).
    host: Option<PinnedBytes>,
    /// The device copy being uploaded, and the event it is complete at.
    upload: Option<(Tensor, Arc<Event>)>,
    /// The compute stream, to order a drop with an upload in flight.
    compute: Arc<CudaStream>,
}

impl Drop for Parked {
    fn drop(&mut self) {
        // Taken inputs have no upload left; one in flight must land before its memory can be
        // reused. An error here has no one to go to (the micro-step is failing already).
        if let Some((tensor, arrived)) = self.upload.take() {
            let _ = release_after(&self.compute, tensor, &arrived);
        }
    }
}

/// Drops `tensor` once the compute stream has waited for `copy` (a copy reading or writing
/// its memory on another stream): candle frees it on the compute stream, in that stream's
/// order. If the wait cannot be queued the memory is leaked rather than freed under the copy.
fn release_after(compute: &CudaStream, tensor: Tensor, copy: &Event) -> Result<()> {
    match copy.wait_on(compute) {
        Ok(()) => {
            drop(tensor);
            Ok(())
        }
        Err(e) => {
            std::mem::forget(tensor);
            Err(msg(e))
        }
    }
}

/// One micro-batch's parking: holds the run's [`Park`] for its duration.
pub(crate) struct Session<'a> {
    park: MutexGuard<'a, Park>,
    compute: Arc<CudaStream>,
    /// The last parked input's device copy and its write-back's event.
    retiring: Option<(Tensor, Arc<Event>)>,
    /// Bytes of the buffers of the inputs parked now.
    held: u64,
}

impl<'a> Session<'a> {
    /// Holds the run's parking for one micro-batch, the device's context bound.
    pub(crate) fn new(park: &'a Mutex<Park>) -> Result<Self> {
        // Nothing panics while the lock is held with the slots half updated.
        let park = park.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let compute = park.dev.cuda_stream();
        compute.context().bind_to_thread().map_err(|e| msg(format!("binding the CUDA context: {e}")))?;
        Ok(Self { park, compute, retiring: None, held: 0 })
    }

    /// Bytes of page-locked buffers holding parked inputs now.
    pub(crate) fn held(&self) -> u64 {
        self.held
    }

    /// Writes block `block`'s input back into its page-locked buffer (see the module doc);
    /// the device copy is kept until the next park or the end of forward. `tier`: the `ram`
    /// tier whose capacity bounds the parked bytes.
    pub(crate) fn park(&mut self, block: usize, input: Tensor, tier: &dyn ava_core::OffloadTier) -> Result<Parked> {
        let input = input.contiguous()?;
        let (dims, dtype) = (input.dims().to_vec(), input.dtype());
        let len = crate::memory::home::bytes_of(&dims, dtype);
        crate::memory::home::room_for(tier.capacity(), tier.used_bytes(), self.held, len as u64).map_err(|e| {
            msg(format!(
                "offload: cannot park block {block}'s input ({}) in page-locked host memory: {e}; raise \
                 plugins.offload's capacity or offload fewer blocks",
                ava_core::format_size(len as u64)
            ))
        })?;
        let mut host = match self.park.slots.remove(&block) {
            Some(host) if crate::memory::home::reusable(Some(host.len()), len) => host,
            smaller => {
                drop(smaller); // a smaller buffer goes (its drop waits for its last copy)
                PinnedBytes::zeroed(self.compute.context(), len).map_err(|e| {
                    msg(format!("offload: block {block}'s input ({}): {e}", ava_core::format_size(len as u64)))
                })?
            }
        };
        let computed = Event::record(&*self.compute).map_err(msg)?;
        computed.wait_on(&self.park.down).map_err(msg)?;
        if let Some(last) = host.pending() {
            last.wait_on(&self.park.down).map_err(msg)?;
        }
        {
            let (storage, layout) = input.storage_and_layout();
            let Storage::Cuda(s) = &*storage else { candle_core::bail!("offload: a parked input is not on the GPU") };
            let (src, _guard) = storage_buf(s, layout, &self.compute)?;
            // SAFETY: the input's memory lives until the compute stream has waited for this
            // copy's event (`retire`); the buffer is touched again only after its pending
            // event, set below.
            unsafe { self.park.down.download(&mut host.for_copy()[..len], src.ptr) }.map_err(msg)?;
        }
        let written = match self.park.down.record() {
            Ok(e) => Arc::new(e),
            Err(e) => {
                // The copy is queued with nothing to wait for: its memory must not be freed.
                std::mem::forget(input);
                std::mem::forget(host);
                return Err(msg(e));
            }
        };
        host.set_pending(Arc::clone(&written));
        self.held += host.len() as u64;
        let before = self.retiring.replace((input, written));
        if let Some((tensor, written)) = before {
            release_after(&self.compute, tensor, &written)?;
        }
        Ok(Parked { block, dims, dtype, len, host: Some(host), upload: None, compute: Arc::clone(&self.compute) })
    }

    /// The last parked input's device copy dropped, after the compute stream waits for its
    /// write-back.
    pub(crate) fn retire(&mut self) -> Result<()> {
        match self.retiring.take() {
            Some((tensor, written)) => release_after(&self.compute, tensor, &written),
            None => Ok(()),
        }
    }

    /// Issues `parked`'s upload into new device memory, unless it was issued already.
    pub(crate) fn upload(&mut self, parked: &mut Parked) -> Result<()> {
        if parked.upload.is_some() {
            return Ok(());
        }
        let n: usize = parked.dims.iter().product();
        let storage = alloc(&self.park.dev, parked.dtype, n)?;
        let allocated = Event::record(&*self.compute).map_err(msg)?;
        allocated.wait_on(&self.park.up).map_err(msg)?;
        let host = parked.host.as_mut().ok_or_else(|| msg("offload: a parked input was taken twice".into()))?;
        if let Some(written) = host.pending() {
            written.wait_on(&self.park.up).map_err(msg)?;
        }
        {
            let (dst, _guard) = storage_buf(&storage, &Layout::contiguous(parked.dims.as_slice()), &self.compute)?;
            // SAFETY: the memory was allocated before the event this stream waits for, and is
            // read or freed on the compute stream only after it waits for the upload's event
            // (`take`, or the parked input's drop); the buffer is written again only after
            // its pending event, set below.
            unsafe { self.park.up.upload(dst.ptr, &host.for_copy()[..parked.len]) }.map_err(msg)?;
        }
        let arrived = match self.park.up.record() {
            Ok(e) => Arc::new(e),
            Err(e) => {
                // The copy is queued with nothing to wait for: its memory must not be freed.
                std::mem::forget(storage);
                std::mem::forget(parked.host.take());
                return Err(msg(e));
            }
        };
        let host = parked.host.as_mut().expect("checked above");
        host.set_pending(Arc::clone(&arrived));
        parked.upload = Some((storage_tensor(storage, parked.dims.as_slice()), arrived));
        Ok(())
    }

    /// `parked` back on the device (uploaded now if it was not ahead), the compute stream made
    /// to wait for its upload; its buffer goes back to its block's slot.
    pub(crate) fn take(&mut self, mut parked: Parked) -> Result<Tensor> {
        self.upload(&mut parked)?;
        let (tensor, arrived) = parked.upload.take().expect("uploaded just above");
        if let Err(e) = arrived.wait_on(&*self.compute) {
            std::mem::forget(tensor); // never freed under the upload
            return Err(msg(e));
        }
        if let Some(host) = parked.host.take() {
            self.held -= host.len() as u64;
            self.park.slots.insert(parked.block, host);
        }
        Ok(tensor)
    }
}

impl Drop for Session<'_> {
    fn drop(&mut self) {
        // A write-back still reading a device copy: the compute stream waits for it first.
        let _ = self.retire();
    }
}

/// Uninitialized device memory for `n` elements of `dtype`, allocated on the compute stream.
fn alloc(dev: &CudaDevice, dtype: DType, n: usize) -> Result<CudaStorage> {
    // SAFETY (each arm): every element is written by the upload before anything reads it
    // (the compute stream waits for the upload's event first).
    Ok(match dtype {
        DType::F32 => CudaStorage::wrap_cuda_slice(unsafe { dev.alloc::<f32>(n.max(1)) }?, dev.clone()),
        DType::BF16 => CudaStorage::wrap_cuda_slice(unsafe { dev.alloc::<half::bf16>(n.max(1)) }?, dev.clone()),
        DType::F16 => CudaStorage::wrap_cuda_slice(unsafe { dev.alloc::<half::f16>(n.max(1)) }?, dev.clone()),
        other => candle_core::bail!("offload: block inputs of type {other:?} are not supported"),
    })
}
