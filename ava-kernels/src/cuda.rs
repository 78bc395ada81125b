//! The GPU side's plumbing (`cuda` feature), shared by the built-ins (ava-plugins) and the
//! plugin libraries: PTX modules loaded into the CUDA context current on the calling thread
//! (the host's, as the plugin contract promises) and kernels launched on the stream the host
//! hands over, with device pointers and a `CUstream` as integers. No CUDA library is linked
//! outside a CUDA build of the workspace: cudarc loads the driver at run time.
//!
//! Also a step's stream-ordered scratch memory ([`Scratch`]), and the checks every attention
//! kernel's device call makes on its buffers ([`check_attention`]). With
//! `AVA_CUDA_KERNEL_TIMES` naming a file, each launch's own time is appended to it (`times`).

use std::collections::HashMap;
use std::ffi::{CStr, CString, c_void};
use std::sync::{Arc, Mutex, RwLock};

use ava_core::DType;
use ava_core::PluginError;
use ava_core::attention::AttnShape;
use ava_core::device::{CudaBuf, CudaStream};
use cudarc::driver::{result, sys};

mod times;

/// One PTX module: a name for messages and its NUL-terminated image (`include_str!` of
/// nvcc's output with a `"\0"` appended).
pub struct Ptx {
    name: &'static str,
    image: &'static str,
}

impl Ptx {
    /// A module named `name`; `image` must end with a NUL byte.
    pub const fn new(name: &'static str, image: &'static str) -> Self {
        assert!(!image.is_empty() && image.as_bytes()[image.len() - 1] == 0, "a PTX image ends with NUL");
        Self { name, image }
    }
}

/// Threads per block of the element kernels.
pub const THREADS: u32 = 256;

/// The kernels looked up so far: (context id, module name, kernel name) → CUfunction as an
/// address. The context is named by `cuCtxGetId`, unique for the process's life: a primary
/// context released and retained again comes back at the same address without the modules
/// loaded into it before.
type Kernels = HashMap<(u64, &'static str, CString), usize>;
static KERNELS: Mutex<Option<Kernels>> = Mutex::new(None);

/// The modules loaded so far: (context id, module name) → CUmodule as an address.
static MODULES: Mutex<Vec<(u64, &'static str, usize)>> = Mutex::new(Vec::new());

fn driver(what: &str, e: result::DriverError) -> PluginError {
    PluginError::internal(format!("CUDA {what}: {e}"))
}

/// The unique id of the CUDA context current on the calling thread.
fn current_context() -> Result<u64, PluginError> {
    result::init().map_err(|e| driver("driver init", e))?;
    let ctx = result::ctx::get_current().map_err(|e| driver("context query", e))?.ok_or_else(|| {
        PluginError::internal(
            "no CUDA context is current on the calling thread: the host must make its context current before a \
             CUDA call",
        )
    })?;
    let mut id = 0u64;
    // SAFETY: ctx is a live context (current on this thread); id is a valid out-pointer.
    unsafe { sys::cuCtxGetId(ctx, &mut id) }.result().map_err(|e| driver("context id", e))?;
    Ok(id)
}

/// `ptx` in the context `ctx`, loaded on first use there.
fn module(ctx: u64, ptx: &Ptx) -> Result<sys::CUmodule, PluginError> {
    let mut modules = MODULES.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(&(_, _, m)) = modules.iter().find(|(c, n, _)| *c == ctx && *n == ptx.name) {
        return Ok(m as sys::CUmodule);
    }
    // SAFETY: the image is NUL-terminated PTX built by nvcc for this crate.
    let m = unsafe { result::module::load_data(ptx.image.as_ptr().cast()) }
        .map_err(|e| driver(&format!("loading the {} kernels", ptx.name), e))?;
    modules.push((ctx, ptx.name, m as usize));
    Ok(m)
}

/// Kernel `name` of `ptx` in the current context, looked up once per context.
fn kernel(ptx: &Ptx, name: &CStr) -> Result<sys::CUfunction, PluginError> {
    let ctx = current_context()?;
    let key = (ctx, ptx.name, CString::from(name));
    if let Some(&f) = KERNELS.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert_default().get(&key) {
        return Ok(f as sys::CUfunction);
    }
    let m = module(ctx, ptx)?;
    // SAFETY: m is a loaded module; the name is one of its kernels.
    let f = unsafe { result::module::get_function(m, key.2.clone()) }.map_err(|e| driver("kernel lookup", e))?;
    KERNELS.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert_default().insert(key, f as usize);
    Ok(f)
}

/// Launches kernel `name` of `ptx` with `grid` blocks of `threads` on `stream`.
///
/// # Safety
/// `params` must point at values matching the kernel's parameters one for one, and every
/// device pointer among them must be valid for what the kernel reads and writes.
pub unsafe fn launch(
    ptx: &Ptx,
    name: &CStr,
    grid: u32,
    threads: u32,
    stream: &CudaStream,
    params: &mut [*mut c_void],
) -> Result<(), PluginError> {
    // SAFETY: the caller's promise, passed on.
    unsafe { launch_with(ptx, name, Launch { grid: (grid, 1, 1), threads, shared: 0 }, stream, params) }
}

/// A launch's shape: blocks in x and y (z is 1), threads a block, dynamic shared memory bytes.
#[derive(Debug, Clone, Copy)]
pub struct Launch {
    /// Blocks (x, y, z).
    pub grid: (u32, u32, u32),
    /// Threads per block.
    pub threads: u32,
    /// Dynamic shared memory a block, in bytes. Above 48 KiB the kernel is allowed that much
    /// first (`CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`).
    pub shared: u32,
}

/// Where launches go instead of the driver: (module name, kernel name, shape, the arguments
/// as `cuLaunchKernel` takes them).
pub type LaunchHook = dyn Fn(&str, &CStr, Launch, &mut [*mut c_void]) -> Result<(), PluginError> + Send + Sync;

static HOOK: RwLock<Option<Arc<LaunchHook>>> = RwLock::new(None);

/// From now on every launch through this module goes to `hook` (`None`: to the GPU again),
/// process-wide. For tests that run the kernels on the CPU emulator (ava-cuda-emu), with host
/// addresses as the "device" pointers: the launchers above (grids, shared memory, argument
/// order, workspace carving) then run unchanged.
#[doc(hidden)]
pub fn set_launch_hook(hook: Option<Arc<LaunchHook>>) {
    *HOOK.write().unwrap_or_else(|p| p.into_inner()) = hook;
}

/// [`launch`] with a full launch shape.
///
/// # Safety
/// As [`launch`].
pub unsafe fn launch_with(
    ptx: &Ptx,
    name: &CStr,
    shape: Launch,
    stream: &CudaStream,
    params: &mut [*mut c_void],
) -> Result<(), PluginError> {
    let hook = HOOK.read().unwrap_or_else(|p| p.into_inner()).clone();
    if let Some(hook) = hook {
        return hook(ptx.name, name, shape, params);
    }
    let f = kernel(ptx, name)?;
    if shape.shared > 48 << 10 {
        // SAFETY: f is a live function of the current context.
        unsafe {
            result::function::set_function_attribute(
                f,
                sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                shape.shared as i32,
            )
        }
        .map_err(|e| {
            driver(&format!("{} asking for {} KiB of shared memory", name.to_string_lossy(), shape.shared >> 10), e)
        })?;
    }
    let (grid, block, stream) = (shape.grid, (shape.threads, 1, 1), stream.handle as sys::CUstream);
    times::timed(ptx.name, name, grid, shape.threads, stream, || {
        // SAFETY: the caller's promise about params; the stream is the host's (0: the default).
        unsafe { result::launch_kernel(f, grid, block, shape.shared, stream, params) }
            .map_err(|e| driver(&format!("launch of {}", name.to_string_lossy()), e))
    })
}

/// Blocks of [`THREADS`] covering `n` elements.
pub fn blocks(n: usize) -> Result<u32, PluginError> {
    u32::try_from(n.div_ceil(THREADS as usize))
        .ok()
        .filter(|&b| b <= i32::MAX as u32)
        .ok_or_else(|| PluginError::invalid_input(format!("{n} elements are more than one kernel launch covers")))
}

/// A kernel argument's address, as `cuLaunchKernel` takes it.
pub fn arg<T>(v: &T) -> *mut c_void {
    (v as *const T).cast_mut().cast()
}

/// A step's own device memory for the values its kernels pass on to each other (partial
/// sums, a tree's levels, a factor), allocated and freed in stream order: `cuMemAllocAsync`
/// on the host's stream, from the device's current pool (where the host's own tensors live),
/// and `cuMemFreeAsync` on the same stream. Nothing waits for the GPU.
///
/// The ordering rule: the buffer may be used only by work enqueued on that one stream after
/// [`new`](Self::new), and [`free`](Self::free) must come after the last launch that uses it:
/// the free is itself enqueued, so the memory goes back to the pool once the work before it
/// on the stream has run. Dropped without `free` (an early return when a launch failed), it
/// is freed the same way, the failure of that free unreported.
///
/// Errors name the owner: `"{plugin}: CUDA allocation for {what}: …"`, `"{plugin}: CUDA free
/// of {what}: …"`.
///
/// With a launch hook installed ([`set_launch_hook`]: the kernel emulator's tests) the buffer
/// is host memory, filled with 0xff bytes (NaN floats) so a kernel that reads it before
/// writing it shows.
pub struct Scratch {
    ptr: sys::CUdeviceptr,
    stream: sys::CUstream,
    plugin: &'static str,
    what: &'static str,
    /// The host memory behind `ptr` under a launch hook.
    host: Option<Box<[HostChunk]>>,
}

/// 256 bytes aligned as the driver aligns an allocation, for [`Scratch`]'s host memory.
#[derive(Clone, Copy)]
#[repr(C, align(256))]
struct HostChunk([u8; 256]);

impl Scratch {
    /// `bytes` bytes on `stream` (the host's, on the device whose context is current) for
    /// `plugin`'s `what` (e.g. `"its scratch"`), named so in errors.
    pub fn new(
        bytes: usize,
        stream: &CudaStream,
        plugin: &'static str,
        what: &'static str,
    ) -> Result<Self, PluginError> {
        let stream = stream.handle as sys::CUstream;
        if HOOK.read().unwrap_or_else(|p| p.into_inner()).is_some() {
            let mut host = vec![HostChunk([0xff; 256]); bytes.div_ceil(256).max(1)].into_boxed_slice();
            let ptr = host.as_mut_ptr() as u64;
            return Ok(Self { ptr, stream, plugin, what, host: Some(host) });
        }
        let driver = |step: &str, e: result::DriverError| {
            PluginError::internal(format!("{plugin}: CUDA {step} for {what}: {e}"))
        };
        result::init().map_err(|e| driver("driver init", e))?;
        // SAFETY: the host's stream on the device whose context is current (the contract).
        let ptr = unsafe { result::malloc_async(stream, bytes) }.map_err(|e| driver("allocation", e))?;
        Ok(Self { ptr, stream, plugin, what, host: None })
    }

    /// The device address `offset` bytes in.
    pub fn at(&self, offset: usize) -> u64 {
        self.ptr + offset as u64
    }

    /// Frees the buffer after the work enqueued on its stream so far (a free that fails is
    /// reported).
    pub fn free(mut self) -> Result<(), PluginError> {
        let ptr = std::mem::take(&mut self.ptr);
        if self.host.take().is_some() {
            return Ok(());
        }
        // SAFETY: ptr came from malloc_async on this stream and is freed once.
        unsafe { result::free_async(ptr, self.stream) }
            .map_err(|e| PluginError::internal(format!("{}: CUDA free of {}: {e}", self.plugin, self.what)))
    }
}

impl Drop for Scratch {
    /// On an early return (a launch failed): free anyway, in stream order.
    fn drop(&mut self) {
        if self.ptr != 0 && self.host.is_none() {
            // SAFETY: as in `free`; the pointer is freed once (free() zeroes it).
            let _ = unsafe { result::free_async(self.ptr, self.stream) };
        }
    }
}

/// Checks an attention call's buffers against `shape` for kernel `kernel`: q, k, v and the
/// buffers shaped like q (`like_q`) share one element type (f32, bf16 or f16) and have the
/// shape's lengths, the segments (when given) are (B, Tk) u32, `saved` holds `saved_len` f32,
/// and the head dimension is at most `max_d`. Returns the element type.
#[allow(clippy::too_many_arguments)]
pub fn check_attention(
    kernel: &str,
    shape: &AttnShape,
    q: &CudaBuf,
    k: &CudaBuf,
    v: &CudaBuf,
    segments: &CudaBuf,
    like_q: &[(&str, &CudaBuf)],
    saved: &CudaBuf,
    saved_len: usize,
    max_d: u32,
) -> Result<DType, PluginError> {
    shape.validate()?;
    if shape.head_dim > max_d {
        return Err(PluginError::unsupported(format!(
            "{kernel} on the GPU takes head dimensions up to {max_d}, got {}",
            shape.head_dim
        )));
    }
    let t = q.dtype;
    if !matches!(t, DType::F32 | DType::BF16 | DType::F16) {
        return Err(PluginError::invalid_input(format!("q is {}; f32, bf16 or f16 expected", t.as_str())));
    }
    q.expect("q", t, shape.q_numel())?;
    k.expect("k", t, shape.kv_numel())?;
    v.expect("v", t, shape.kv_numel())?;
    for (what, b) in like_q {
        b.expect(what, t, shape.q_numel())?;
    }
    if !segments.is_empty() {
        shape.check_segmented()?;
        segments.expect("segments", DType::U32, shape.batch as usize * shape.kv_len as usize)?;
    }
    if shape.q_len == 0 {
        return Err(PluginError::invalid_input(format!(
            "{kernel} on the GPU needs at least one query (q_len is 0): a launch of no blocks is refused by the driver"
        )));
    }
    saved.expect("saved", DType::F32, saved_len)?;
    Ok(t)
}

/// (H, Hkv, Tq, Tk, D) as the attention kernels take them.
pub fn attention_dims(shape: &AttnShape) -> [i32; 5] {
    [shape.q_heads, shape.kv_heads, shape.q_len, shape.kv_len, shape.head_dim].map(|d| d as i32)
}

/// The kernel `base` for element type `t`: `{base}_{f32|bf16|f16}`.
pub fn typed(base: &str, t: DType) -> Result<CString, PluginError> {
    CString::new(format!("{base}_{}", t.as_str())).map_err(|e| PluginError::internal(e.to_string()))
}

/// A grid's x dimension of `n` blocks, if one launch covers it (2³¹ − 1).
pub fn grid(n: usize, what: &str) -> Result<u32, PluginError> {
    grid_within(n, i32::MAX as u32, what)
}

/// A grid's y or z dimension of `n` blocks, if one launch covers it (65,535).
pub fn grid_yz(n: usize, what: &str) -> Result<u32, PluginError> {
    grid_within(n, u16::MAX as u32, what)
}

fn grid_within(n: usize, most: u32, what: &str) -> Result<u32, PluginError> {
    u32::try_from(n).ok().filter(|&r| r <= most).ok_or_else(|| {
        PluginError::invalid_input(format!("{n} {what} are more than one launch covers (at most {most})"))
    })
}
