//! Device memory on a GPU run (`cuda` feature): what the engine's allocations hold, read from
//! the device's stream-ordered memory pool, what the whole card has in use, and the pool
//! that caps them at `memory.hard_limit` ([`CappedPool`]).
//!
//! candle allocates every device buffer with `cuMemAllocAsync`, which takes memory from the
//! device's *current* pool (the default pool, or the [`CappedPool`] while a run holds one),
//! so that pool's used-memory attributes count every tensor, gradient and optimizer buffer
//! the run holds, and its high-water mark (reset at the start of a step) is the step's peak.
//! `cuMemGetInfo` is the card's own view: the pool's reserve, the CUDA context, cuBLAS's
//! workspace and other processes, shown beside it rather than mixed in.
//!
//! The pool keeps what it reserved ([`keep_reserve`]): by default the driver gives a pool's
//! unused memory back to the OS at every synchronization (the loss read back, the gradients'
//! norm), so each step would map its activations' memory afresh; the CUDA programming guide's
//! advice for a pool an application reuses is a release threshold of `u64::MAX`, and the
//! caching allocators of PyTorch and RAPIDS keep their reserve the same way. What is freed
//! stays in the pool for the next step's buffers; [`release_unused`] gives it back before an
//! out-of-memory back-off retries, so the retry does not fail on a fragmented reserve.
//!
//! A [`CappedPool`] is a pool created with `maxSize` (CUDA 12.2 and later) and made the
//! device's current pool: an allocation that would take its reserve past the cap fails with
//! `CUDA_ERROR_OUT_OF_MEMORY`, as on a card of that size. What lives outside the pool (the
//! context, cuBLAS's workspace) is not counted against it, as it is not counted in
//! `memory.budget`.

use candle_core::cuda::cudarc::driver::{result, sys};
use candle_core::{CudaDevice, Result};

pub use super::DeviceMemory;

fn driver(e: result::DriverError) -> candle_core::Error {
    candle_core::Error::Msg(format!("reading device memory: {e}"))
}

/// The device's current memory pool (the one candle's allocations come from: the default
/// pool, or a [`CappedPool`] while one is held).
fn pool(dev: &CudaDevice) -> Result<sys::CUmemoryPool> {
    let ctx = dev.cuda_stream().context().clone();
    ctx.bind_to_thread().map_err(driver)?;
    let mut pool = std::mem::MaybeUninit::uninit();
    // SAFETY: cu_device is the context's device; the out-pointer is valid.
    unsafe { sys::cuDeviceGetMemPool(pool.as_mut_ptr(), ctx.cu_device()).result() }.map_err(driver)?;
    // SAFETY: written by the successful call above.
    Ok(unsafe { pool.assume_init() })
}

/// One u64 attribute of the pool.
fn attribute(pool: sys::CUmemoryPool, attr: sys::CUmemPool_attribute) -> Result<u64> {
    let mut value = 0u64;
    // SAFETY: the used/reserved attributes are cuuint64_t, written into `value`.
    unsafe { result::mem_pool::get_attribute(pool, attr, (&mut value as *mut u64).cast()) }.map_err(driver)?;
    Ok(value)
}

/// The variable that, set to `1`, keeps the driver's default release threshold (0: the
/// pool's unused memory goes back at every synchronization), to measure what keeping it is
/// worth; any other value is the same as unset.
pub const TRIM_VAR: &str = "AVA_CUDA_POOL_TRIM";

/// Makes the device's current pool keep the memory it has reserved (its release threshold
/// `u64::MAX`), unless [`TRIM_VAR`] is `1`.
pub fn keep_reserve(dev: &CudaDevice) -> Result<()> {
    if !keeps_reserve() {
        return Ok(());
    }
    set_release_threshold(pool(dev)?, u64::MAX).map_err(|e| {
        candle_core::Error::Msg(format!(
            "setting the device memory pool's release threshold (so it keeps its reserve between steps): {e}; \
             {TRIM_VAR}=1 leaves the driver's default"
        ))
    })
}

/// Whether pools keep their reserve: unless [`TRIM_VAR`] is `1`.
fn keeps_reserve() -> bool {
    std::env::var_os(TRIM_VAR).is_none_or(|v| v != "1")
}

fn set_release_threshold(pool: sys::CUmemoryPool, mut bytes: u64) -> std::result::Result<(), result::DriverError> {
    // SAFETY: RELEASE_THRESHOLD takes a cuuint64_t; `bytes` lives through the call.
    unsafe {
        result::mem_pool::set_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut bytes as *mut u64).cast(),
        )
    }
}

/// Gives the current pool's unused memory back to the driver once the work queued so far has
/// run (it waits for candle's stream, which every free the engine makes is queued on): what
/// an out-of-memory back-off does before its retry. The wait's error is returned (the device
/// is in no state to retry); the trim is best effort: a pool it cannot trim is used as it is,
/// and a retry that runs out on it backs off again.
pub fn release_unused(dev: &CudaDevice) -> Result<()> {
    use candle_core::backend::BackendDevice;
    dev.synchronize()?;
    let pool = pool(dev)?;
    // SAFETY: the device's current pool, valid while the device is.
    let _ = unsafe { result::mem_pool::trim_to(pool, 0) };
    Ok(())
}

/// Reads the device's memory now.
pub fn read(dev: &CudaDevice) -> Result<DeviceMemory> {
    let pool = pool(dev)?;
    let used = attribute(pool, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?;
    let peak = attribute(pool, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?;
    let (free, total) = result::mem_get_info().map_err(driver)?;
    Ok(DeviceMemory { used, peak, card_used: (total - free) as u64, card_total: total as u64 })
}

/// Starts a new high-water mark at the memory held now (the start of a step).
pub fn reset_peak(dev: &CudaDevice) -> Result<()> {
    let pool = pool(dev)?;
    let mut zero = 0u64; // the driver sets the mark to the current use
    // SAFETY: USED_MEM_HIGH takes a cuuint64_t, and resetting it takes 0.
    unsafe {
        result::mem_pool::set_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            (&mut zero as *mut u64).cast(),
        )
    }
    .map_err(driver)
}

/// A stream-ordered memory pool whose reserve cannot pass `max` bytes, the device's current
/// pool from [`CappedPool::new`] on: every allocation candle makes afterwards comes from it,
/// and one that would take it past `max` fails with `CUDA_ERROR_OUT_OF_MEMORY`.
///
/// Dropping it destroys the pool (`cuMemPoolDestroy`), which makes the device's default pool
/// current again; buffers still allocated from it stay valid, and the driver releases its
/// memory once the last of them is freed. The trainer holds it for the run, so a process
/// that builds several runs gives each its own cap.
#[derive(Debug)]
pub struct CappedPool {
    pool: sys::CUmemoryPool,
    max: u64,
}

impl CappedPool {
    /// Creates a pool of at most `max` bytes on `dev`'s device (pinned device memory, like
    /// the default pool) and makes it the device's current pool. Needs a CUDA 12.2+ driver:
    /// older ones know no `maxSize` and refuse the pool.
    pub fn new(dev: &CudaDevice, max: u64) -> std::result::Result<Self, String> {
        let ctx = dev.cuda_stream().context().clone();
        ctx.bind_to_thread().map_err(|e| e.to_string())?;
        let max_size = usize::try_from(max).map_err(|_| format!("{max} bytes do not fit this machine's usize"))?;
        // Zeroed, then set: the struct's other fields (win32SecurityAttributes, usage, the
        // reserved bytes) differ across CUDA 12.2..13.0, and zero is "none" for all of them.
        // SAFETY: CUmemPoolProps is plain C data (enums with a 0 variant, a pointer, bytes).
        let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
        props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.handleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
        props.location =
            sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: ctx.cu_device() };
        props.maxSize = max_size;
        let mut pool = std::mem::MaybeUninit::uninit();
        // SAFETY: props is fully initialized and outlives the call; the out-pointer is valid.
        unsafe { sys::cuMemPoolCreate(pool.as_mut_ptr(), &props).result() }
            .map_err(|e| format!("cuMemPoolCreate: {e:?}"))?;
        // SAFETY: written by the successful call above.
        let capped = Self { pool: unsafe { pool.assume_init() }, max };
        // It keeps what it reserves up to the cap, as the default pool does ([`keep_reserve`]).
        if keeps_reserve() {
            set_release_threshold(capped.pool, u64::MAX).map_err(|e| format!("cuMemPoolSetAttribute: {e:?}"))?;
        }
        // SAFETY: the pool was made for this device, and lives until `capped` is dropped
        // (which, on this error, destroys it).
        unsafe { sys::cuDeviceSetMemPool(ctx.cu_device(), capped.pool).result() }
            .map_err(|e| format!("cuDeviceSetMemPool: {e:?}"))?;
        Ok(capped)
    }

    /// The cap, in bytes.
    pub fn max(&self) -> u64 {
        self.max
    }
}

impl Drop for CappedPool {
    fn drop(&mut self) {
        // SAFETY: the pool is this struct's own; destroying the current pool makes the default
        // one current, and the memory of buffers still allocated from it is released when
        // they are freed. Nothing to do about an error at the end of a run.
        let _ = unsafe { sys::cuMemPoolDestroy(self.pool) };
    }
}
