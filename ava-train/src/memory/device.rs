//! Device memory on a GPU run (`cuda` feature): what the engine's allocations hold, read from
//! the device's stream-ordered memory pool, and what the whole card has in use.
//!
//! candle allocates every device buffer with `cuMemAllocAsync` from the device's default
//! pool, so the pool's used-memory attributes count every tensor, gradient and optimizer
//! buffer the run holds, and its high-water mark (reset at the start of a step) is the step's
//! peak. `cuMemGetInfo` is the card's own view: the pool's reserve, the CUDA context, cuBLAS's
//! workspace and other processes, shown beside it rather than mixed in.

use candle_core::cuda::cudarc::driver::{result, sys};
use candle_core::{CudaDevice, Result};

pub use super::DeviceMemory;

fn driver(e: result::DriverError) -> candle_core::Error {
    candle_core::Error::Msg(format!("reading device memory: {e}"))
}

/// The device's default memory pool (the one candle's allocations come from).
fn pool(dev: &CudaDevice) -> Result<sys::CUmemoryPool> {
    let ctx = dev.cuda_stream().context().clone();
    ctx.bind_to_thread().map_err(driver)?;
    let mut pool = std::mem::MaybeUninit::uninit();
    // SAFETY: cu_device is the context's device; the out-pointer is valid.
    unsafe { sys::cuDeviceGetDefaultMemPool(pool.as_mut_ptr(), ctx.cu_device()).result() }.map_err(driver)?;
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
