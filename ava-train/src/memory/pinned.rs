//! Page-locked host memory and the copy streams that move bytes between it and the device
//! (`cuda` feature): what a GPU run's offloaded state and parked activations are built on.
//!
//! A copy between pageable host memory and the device is staged by the driver through its
//! own pinned buffer and blocks the host; a copy from page-locked memory (`cuMemHostAlloc`)
//! is a DMA the copy engines run while the SMs compute, at the link's speed (55 GB/s each
//! way on an H100's PCIe 5 link, 90.7 GB/s both at once). So everything a GPU run keeps on
//! the host to be copied each step lives in [`PinnedBytes`], and its copies run on a
//! [`CopyStream`] of their own, ordered against candle's compute stream by [`Event`]s: never
//! a host-side wait unless the host itself reads the bytes.
//!
//! Two streams, one per direction: a copy engine serves one stream at a time, so uploads
//! and write-backs on one stream would take turns, not overlap.
//!
//! The streams are the driver's own (`cuStreamCreate`), not cudarc's: a second cudarc stream
//! turns on its per-buffer event tracking for every tensor candle makes afterwards. The
//! engine orders its copies by hand instead, and keeps every rule of that ordering in the
//! module that issues the copies.

use candle_core::cuda::cudarc::driver::{result, sys};

/// What went wrong in the driver, with what the engine was doing.
fn failed(what: &str, e: result::DriverError) -> String {
    format!("{what}: {e}")
}

/// Bytes of page-locked host memory (`cuMemHostAlloc`, cached, not write-combined: the host
/// reads them too, to save a checkpoint). The device writes into them asynchronously; the
/// event of the last such write is kept ([`set_pending`](Self::set_pending)) and the host's
/// reads and writes wait for it first.
pub struct PinnedBytes {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
    ctx: std::sync::Arc<candle_core::cuda::cudarc::driver::CudaContext>,
    /// The last copy that writes (or reads) these bytes on a stream: the host waits for it
    /// before touching them.
    pending: Option<std::sync::Arc<Event>>,
}

// SAFETY: the memory is a plain host allocation owned by this value; the driver reads or
// writes it only through copies ordered by `pending`, which every host access waits for.
unsafe impl Send for PinnedBytes {}
// SAFETY: as above; `&self` gives only reads, after `pending` completes.
unsafe impl Sync for PinnedBytes {}

impl std::fmt::Debug for PinnedBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedBytes").field("len", &self.len).finish()
    }
}

impl PinnedBytes {
    /// `len` zeroed bytes of page-locked memory (at least one: the driver has no empty
    /// allocation). The error says how much was asked: the host may be out of memory, or
    /// the limit on locked memory (`ulimit -l`) may be lower.
    pub fn zeroed(
        ctx: &std::sync::Arc<candle_core::cuda::cudarc::driver::CudaContext>,
        len: usize,
    ) -> Result<Self, String> {
        ctx.bind_to_thread().map_err(|e| failed("binding the CUDA context", e))?;
        // SAFETY: flags 0 asks for plain page-locked memory; the pointer is checked below.
        let raw = unsafe { result::malloc_host(len.max(1), 0) }.map_err(|e| {
            failed(
                &format!(
                    "page-locking {} of host memory (cuMemHostAlloc): the host may not have it free, or the locked \
                     memory limit (`ulimit -l`) is lower",
                    ava_core::format_size(len as u64)
                ),
                e,
            )
        })?;
        let ptr = std::ptr::NonNull::new(raw.cast::<u8>()).ok_or("cuMemHostAlloc returned no memory")?;
        // SAFETY: `len.max(1)` bytes were just allocated at `ptr`.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len.max(1)) };
        Ok(Self { ptr, len, ctx: ctx.clone(), pending: None })
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Waits for the last copy that touches the bytes.
    pub fn wait(&self) -> Result<(), String> {
        match &self.pending {
            Some(e) => e.synchronize(),
            None => Ok(()),
        }
    }

    /// The bytes, once the last copy that touches them is done.
    pub fn as_slice(&self) -> Result<&[u8], String> {
        self.wait()?;
        // SAFETY: `len` initialized bytes at `ptr`, owned by `self`; no copy is in flight.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) })
    }

    /// The bytes to write, once the last copy that touches them is done.
    pub fn as_mut_slice(&mut self) -> Result<&mut [u8], String> {
        self.wait()?;
        self.pending = None;
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only access.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) })
    }

    /// The bytes for a copy the caller is about to issue on a stream, without waiting: the
    /// caller orders it after [`pending`](Self::pending) on that stream and then records
    /// its own event with [`set_pending`](Self::set_pending).
    ///
    /// # Safety
    /// The slice must only be handed to a stream-ordered copy ordered after `pending`.
    pub unsafe fn for_copy(&mut self) -> &mut [u8] {
        // SAFETY: `len` bytes at `ptr`; the caller orders the copy after the last one.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// The event of the last copy that touches the bytes, if any.
    pub fn pending(&self) -> Option<&std::sync::Arc<Event>> {
        self.pending.as_ref()
    }

    /// Records that a copy touching the bytes completes at `event`.
    pub fn set_pending(&mut self, event: std::sync::Arc<Event>) {
        self.pending = Some(event);
    }
}

/// A copy in new page-locked memory (tests compare states by cloning them). Panics if the
/// host cannot lock the memory or a copy into the original failed: a clone has no error to
/// return.
impl Clone for PinnedBytes {
    fn clone(&self) -> Self {
        let mut copy = Self::zeroed(&self.ctx, self.len).unwrap_or_else(|e| panic!("cloning pinned bytes: {e}"));
        let bytes = self.as_slice().unwrap_or_else(|e| panic!("cloning pinned bytes: {e}"));
        copy.as_mut_slice().expect("no copy in flight").copy_from_slice(bytes);
        copy
    }
}

impl Drop for PinnedBytes {
    fn drop(&mut self) {
        // A copy still in flight must not land in freed memory; errors here have no one to
        // go to (the run is ending or has failed already).
        let _ = self.wait();
        // SAFETY: `ptr` came from `malloc_host` and is freed once.
        let _ = unsafe { result::free_host(self.ptr.as_ptr().cast()) };
    }
}

/// A live stream of the device's context: candle's compute stream or a [`CopyStream`].
pub trait Stream {
    /// The driver's handle, live as long as `self`.
    fn raw(&self) -> sys::CUstream;
}

impl Stream for candle_core::cuda::cudarc::driver::CudaStream {
    fn raw(&self) -> sys::CUstream {
        self.cu_stream()
    }
}

/// A CUDA event: a point in a stream's work another stream (or the host) can wait for.
/// Made with timing, so two of them on one stream measure the work between.
pub struct Event(sys::CUevent);

// SAFETY: a CUevent is a driver handle usable from any thread of the context.
unsafe impl Send for Event {}
// SAFETY: as above; the driver synchronizes its own use of the handle.
unsafe impl Sync for Event {}

impl Event {
    /// Records a new event at the current end of `stream`'s work.
    pub fn record(stream: &impl Stream) -> Result<Self, String> {
        let event = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
            .map_err(|e| failed("creating a CUDA event", e))?;
        // SAFETY: a live event and stream.
        unsafe { result::event::record(event, stream.raw()) }.map_err(|e| failed("recording a CUDA event", e))?;
        Ok(Self(event))
    }

    /// Makes `stream`'s later work wait for this event (the host does not wait).
    pub fn wait_on(&self, stream: &impl Stream) -> Result<(), String> {
        // SAFETY: a live event and stream.
        unsafe { result::stream::wait_event(stream.raw(), self.0, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
            .map_err(|e| failed("ordering a stream after an event", e))
    }

    /// Waits on the host until the work before the event is done.
    pub fn synchronize(&self) -> Result<(), String> {
        // SAFETY: a live event.
        unsafe { result::event::synchronize(self.0) }.map_err(|e| failed("waiting for a CUDA event", e))
    }

    /// Seconds of the stream's work between `self` and a later `end` on the same stream,
    /// once both are done.
    pub fn seconds_to(&self, end: &Event) -> Result<f64, String> {
        end.synchronize()?;
        // SAFETY: two live, completed events.
        let ms = unsafe { result::event::elapsed(self.0, end.0) }.map_err(|e| failed("timing CUDA events", e))?;
        Ok(f64::from(ms) / 1e3)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // The driver releases an event whose work is still pending once it completes.
        // SAFETY: destroyed once.
        let _ = unsafe { result::event::destroy(self.0) };
    }
}

/// A stream of the driver's own for copies, beside candle's compute stream.
pub struct CopyStream {
    raw: sys::CUstream,
    ctx: std::sync::Arc<candle_core::cuda::cudarc::driver::CudaContext>,
}

// SAFETY: a CUstream is a driver handle usable from any thread bound to its context.
unsafe impl Send for CopyStream {}
// SAFETY: as above.
unsafe impl Sync for CopyStream {}

impl std::fmt::Debug for CopyStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CopyStream")
    }
}

impl CopyStream {
    /// A new stream in `dev`'s context that does not wait for the legacy default stream.
    pub fn new(dev: &candle_core::CudaDevice) -> Result<Self, String> {
        let ctx = dev.cuda_stream().context().clone();
        ctx.bind_to_thread().map_err(|e| failed("binding the CUDA context", e))?;
        let raw = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(|e| failed("creating a copy stream", e))?;
        Ok(Self { raw, ctx })
    }

    /// Copies `src` into the device memory at `dst` (at least `src.len()` bytes), after the
    /// work this stream already holds.
    ///
    /// # Safety
    /// `dst` must be live device memory of at least `src.len()` bytes until the copy is
    /// done, with its allocation ordered before this stream's work; `src` must stay
    /// allocated and unwritten until then ([`PinnedBytes::set_pending`]).
    pub unsafe fn upload(&self, dst: sys::CUdeviceptr, src: &[u8]) -> Result<(), String> {
        if src.is_empty() {
            return Ok(());
        }
        self.ctx.bind_to_thread().map_err(|e| failed("binding the CUDA context", e))?;
        // SAFETY: the caller's contract.
        unsafe { result::memcpy_htod_async(dst, src, self.raw) }.map_err(|e| failed("copying to the device", e))
    }

    /// Copies `dst.len()` bytes from the device memory at `src` into `dst`, after the work
    /// this stream already holds.
    ///
    /// # Safety
    /// As [`upload`](Self::upload), the other way.
    pub unsafe fn download(&self, dst: &mut [u8], src: sys::CUdeviceptr) -> Result<(), String> {
        if dst.is_empty() {
            return Ok(());
        }
        self.ctx.bind_to_thread().map_err(|e| failed("binding the CUDA context", e))?;
        // SAFETY: the caller's contract.
        unsafe { result::memcpy_dtoh_async(dst, src, self.raw) }.map_err(|e| failed("copying to the host", e))
    }

    /// Records an event at the current end of this stream's work.
    pub fn record(&self) -> Result<Event, String> {
        Event::record(self)
    }
}

impl Stream for CopyStream {
    fn raw(&self) -> sys::CUstream {
        self.raw
    }
}

impl Drop for CopyStream {
    fn drop(&mut self) {
        // Copies still queued finish first: the memory they touch is freed after this.
        // SAFETY: a live stream, destroyed once.
        unsafe {
            let _ = result::stream::synchronize(self.raw);
            let _ = result::stream::destroy(self.raw);
        }
    }
}
