//! The built-ins' GPU side (`cuda` feature): kernels/optim.cu (adamw, sgd) and
//! kernels/attention.cu (standard) as PTX, each loaded into
//! the CUDA context current on the calling thread (the host's, as the contract promises) and
//! launched on the stream the host hands over. This is the path any GPU plugin takes: device
//! pointers and a `CUstream` as integers, its own PTX, no CUDA library linked (cudarc loads
//! the driver at run time outside a CUDA build of the workspace).

use std::ffi::{CStr, CString, c_void};
use std::sync::Mutex;

use ava_core::PluginError;
use ava_core::device::CudaStream;
use cudarc::driver::{result, sys};

/// One PTX module of the built-ins: a name for messages and its NUL-terminated image.
pub(crate) struct Ptx {
    name: &'static str,
    image: &'static str,
}

/// kernels/optim.cu: adamw's and sgd's steps.
pub(crate) const OPTIM: Ptx =
    Ptx { name: "optim", image: concat!(include_str!(concat!(env!("OUT_DIR"), "/optim.ptx")), "\0") };

/// kernels/attention.cu: standard's dense attention.
pub(crate) const ATTENTION: Ptx =
    Ptx { name: "attention", image: concat!(include_str!(concat!(env!("OUT_DIR"), "/attention.ptx")), "\0") };

/// Threads per block of the element kernels.
pub(crate) const THREADS: u32 = 256;

/// The modules loaded so far: (CUcontext, module name, CUmodule), the handles as addresses.
static MODULES: Mutex<Vec<(usize, &'static str, usize)>> = Mutex::new(Vec::new());

fn driver(what: &str, e: result::DriverError) -> PluginError {
    PluginError::internal(format!("CUDA {what}: {e}"))
}

/// `ptx` in the calling thread's current context, loaded on first use there.
fn module(ptx: &Ptx) -> Result<sys::CUmodule, PluginError> {
    result::init().map_err(|e| driver("driver init", e))?;
    let ctx = result::ctx::get_current().map_err(|e| driver("context query", e))?.ok_or_else(|| {
        PluginError::internal(
            "no CUDA context is current on the calling thread: the host must make its context current before a \
             CUDA call",
        )
    })?;
    let mut modules = MODULES.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(&(_, _, m)) = modules.iter().find(|(c, n, _)| *c == ctx as usize && *n == ptx.name) {
        return Ok(m as sys::CUmodule);
    }
    // SAFETY: the image is NUL-terminated PTX built by nvcc for this crate.
    let m = unsafe { result::module::load_data(ptx.image.as_ptr().cast()) }
        .map_err(|e| driver(&format!("loading the {} kernels", ptx.name), e))?;
    modules.push((ctx as usize, ptx.name, m as usize));
    Ok(m)
}

/// Launches kernel `name` of `ptx` with `grid` blocks of `threads` on `stream`.
///
/// # Safety
/// `params` must point at values matching the kernel's parameters one for one, and every
/// device pointer among them must be valid for what the kernel reads and writes.
pub(crate) unsafe fn launch(
    ptx: &Ptx,
    name: &CStr,
    grid: u32,
    threads: u32,
    stream: &CudaStream,
    params: &mut [*mut c_void],
) -> Result<(), PluginError> {
    let m = module(ptx)?;
    // SAFETY: m is a loaded module; the name is one of its kernels.
    let f = unsafe { result::module::get_function(m, CString::from(name)) }.map_err(|e| driver("kernel lookup", e))?;
    // SAFETY: the caller's promise about params; the stream is the host's (0: the default).
    unsafe { result::launch_kernel(f, (grid, 1, 1), (threads, 1, 1), 0, stream.handle as sys::CUstream, params) }
        .map_err(|e| driver(&format!("launch of {}", name.to_string_lossy()), e))
}

/// Blocks of [`THREADS`] covering `n` elements.
pub(crate) fn blocks(n: usize) -> Result<u32, PluginError> {
    u32::try_from(n.div_ceil(THREADS as usize))
        .ok()
        .filter(|&b| b <= i32::MAX as u32)
        .ok_or_else(|| PluginError::invalid_input(format!("{n} elements are more than one kernel launch covers")))
}

/// A kernel argument's address, as `cuLaunchKernel` takes it.
pub(crate) fn arg<T>(v: &T) -> *mut c_void {
    (v as *const T).cast_mut().cast()
}
