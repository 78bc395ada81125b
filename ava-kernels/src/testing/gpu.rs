//! The harness every optimizer's GPU test shares (feature `cuda`): one parameter's weights
//! and state on both sides, the CPU's [`Optimizer::step`] and the GPU's
//! [`Optimizer::step_cuda`] on the same inputs, and a bit-for-bit comparison of the weights
//! and of every state byte after each step.
//!
//! The GPU side's buffers are allocated by the test and handed over as the host would:
//! device pointers, the stream as a `CUstream`, state zero-filled before the first step. The
//! CPU side's state is handed over in 8-byte-aligned host buffers, as the host allocates it.
//!
//! Used by ava-plugins' `gpu_optim` and the optimizer plugins' GPU tests (lion, adam-8bit,
//! adafactor, adam-mini). They run on a machine with an NVIDIA GPU, or, with
//! `AVA_CUDA_EMULATE=lockstep` (or `serial`, `serial-reversed`), on the CPU: the test package's `kernels/*.cu`
//! compiled by the kernel emulator (ava-cuda-emu), every launch through [`crate::cuda`] sent
//! there ([`crate::cuda::set_launch_hook`]) and the buffers in host memory, so the plugin's
//! own `step_cuda` runs unchanged (see ava-cuda-emu for what the emulator checks and what it
//! does not model). Where neither a GPU nor the variable is there, they fail saying so.

use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use ava_core::prelude::*;
use ava_cuda_emu::{Build, Emulator, Order, Shape};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream as Stream, DevicePtr, DeviceRepr, ValidAsZeroBits};

/// The variable that runs the GPU tests on the kernel emulator: `lockstep` (or `1`),
/// `serial` or `serial-reversed`, the order a block's threads run in (ava-cuda-emu's
/// [`Order`]).
pub const EMULATE: &str = "AVA_CUDA_EMULATE";

/// Where a GPU test's buffers live and its kernels run: the GPU (its context current on this
/// thread, and its stream), or the CPU emulator.
pub enum Gpu {
    /// An NVIDIA GPU.
    Device {
        /// Held so the context lives as long as the test's buffers.
        _ctx: Arc<CudaContext>,
        /// The stream the steps launch on.
        stream: Arc<Stream>,
    },
    /// The kernel emulator, buffers in host memory.
    Emulated,
}

/// A GPU test's buffer: device memory, or host memory when emulated.
pub enum Buffer<T> {
    /// On the GPU.
    Device(CudaSlice<T>),
    /// In host memory, for the emulator: the values between two guards of [`GUARD`] bytes
    /// of [`CANARY`], which [`Gpu::download`] checks (a kernel that writes past either end
    /// of its buffer fails the test there).
    Host(Guarded),
}

/// Bytes of canary on each side of an emulated buffer.
pub const GUARD: usize = 256;

/// The byte a guard is filled with.
pub const CANARY: u8 = 0xa5;

/// Host memory with a guard on each side; 16-byte aligned, as device allocations are (at
/// least). The guards are checked when the values are read back and when it is dropped.
pub struct Guarded {
    words: Vec<u128>,
    /// The first value's address, taken once from the vector's mutable pointer: kernels
    /// write through it.
    data: *mut u8,
    len: usize,
    bytes: usize,
}

impl Guarded {
    fn new<T: Copy>(v: &[T]) -> Self {
        let bytes = std::mem::size_of_val(v);
        let mut words = vec![0u128; (2 * GUARD + bytes).div_ceil(16)];
        let all = as_bytes_mut(&mut words);
        all.fill(CANARY);
        // SAFETY: T is a plain device type (Copy, no padding that matters for a byte copy).
        let src = unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), bytes) };
        all[GUARD..GUARD + bytes].copy_from_slice(src);
        // SAFETY: GUARD bytes in is inside the allocation, which never moves (the vector is
        // not resized).
        let data = unsafe { words.as_mut_ptr().cast::<u8>().add(GUARD) };
        Self { words, data, len: v.len(), bytes }
    }

    /// Panics naming the side a kernel wrote past, if it did.
    fn check(&self) {
        // SAFETY: the words hold 2·GUARD + bytes initialized bytes; no kernel runs now.
        let all = unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast::<u8>(), 2 * GUARD + self.bytes) };
        let (before, after) = (&all[..GUARD], &all[GUARD + self.bytes..]);
        if let Some(i) = before.iter().rposition(|&b| b != CANARY) {
            panic!("a kernel wrote {} bytes before the start of a {}-byte buffer", GUARD - i, self.bytes);
        }
        if let Some(i) = after.iter().position(|&b| b != CANARY) {
            panic!("a kernel wrote past the end of a {}-byte buffer (at byte {} after it)", self.bytes, i);
        }
    }

    /// The values, after checking both guards.
    fn values<T: Copy>(&self) -> Vec<T> {
        self.check();
        let mut out = Vec::<T>::with_capacity(self.len);
        // SAFETY: the data bytes were written from T values (and by kernels writing T).
        unsafe {
            std::ptr::copy_nonoverlapping(self.data, out.as_mut_ptr().cast::<u8>(), self.bytes);
            out.set_len(self.len);
        }
        out
    }
}

impl Drop for Guarded {
    /// A buffer never read back (a workspace, a gradient) is checked here.
    fn drop(&mut self) {
        if !std::thread::panicking() {
            self.check();
        }
    }
}

impl<T> Buffer<T> {
    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            Buffer::Device(s) => s.len(),
            Buffer::Host(g) => g.len,
        }
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The GPU (its context current on this thread), or the emulator when [`EMULATE`] is set; a
/// panic saying the test needs one when neither is there.
pub fn gpu() -> Gpu {
    if let Some(order) = emulated_order() {
        install_emulator(order);
        return Gpu::Emulated;
    }
    // cudarc panics where the driver library cannot be loaded at all; both ways say the same.
    let opened = std::panic::catch_unwind(|| CudaContext::new(0).map_err(|e| e.to_string()));
    let opened = opened.unwrap_or_else(|p| {
        let why = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
        Err(why.unwrap_or_else(|| "the CUDA driver library could not be loaded".into()))
    });
    let ctx = opened.unwrap_or_else(|e| {
        panic!(
            "this test runs on an NVIDIA GPU, and none could be opened ({e}); set {EMULATE}=lockstep to run it on \
             the CPU's kernel emulator"
        )
    });
    ctx.bind_to_thread().unwrap();
    let stream = ctx.default_stream();
    Gpu::Device { _ctx: ctx, stream }
}

/// The order [`EMULATE`] asks for, if set.
fn emulated_order() -> Option<Order> {
    let v = std::env::var(EMULATE).ok().filter(|v| !v.is_empty())?;
    match v.as_str() {
        "1" | "lockstep" => Some(Order::Lockstep),
        "serial" => Some(Order::Serial),
        "serial-reversed" => Some(Order::SerialReversed),
        other => panic!("{EMULATE}={other}: expected lockstep (or 1), serial or serial-reversed"),
    }
}

/// Compiles the test package's `kernels/*.cu` for the emulator (once) and sends every
/// launch there.
fn install_emulator(order: Order) {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        let package = std::env::var_os("CARGO_MANIFEST_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| panic!("{EMULATE} needs CARGO_MANIFEST_DIR (run the test with cargo test)"));
        let dir = package.join("kernels");
        let mut sources: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{EMULATE}: the package's kernels in {}: {e}", dir.display()))
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "cu"))
            .collect();
        sources.sort();
        let build = Build {
            sources,
            includes: vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("../ava-cuda-build/include")],
            out_dir: ava_cuda_emu::cache_dir().unwrap_or_else(|e| panic!("{e}")),
        };
        let emu = Arc::new(Emulator::build(&build).unwrap_or_else(|e| panic!("{e}")));
        crate::cuda::set_launch_hook(Some(Arc::new(move |_module, name, launch, params| {
            let shape = Shape { grid: launch.grid, block: (launch.threads, 1, 1), shared: launch.shared as usize };
            // SAFETY: the plugin's launcher passes its kernel's parameters one for one (the
            // emulator checks their number); its buffers are this harness's host memory.
            unsafe { emu.call(&name.to_string_lossy(), shape, order, params) }
                .map_err(|e| PluginError::internal(e.to_string()))
        })));
    });
}

/// `x` rounded to `dtype` (f32, bf16 or f16; to nearest, ties to even) as the little-endian
/// bytes a kernel reads.
pub fn stored(dtype: DType, x: &[f32]) -> Vec<u8> {
    match dtype {
        DType::F32 => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::BF16 => x.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect(),
        DType::F16 => x.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect(),
        other => panic!("stored: {} is not a float type of the kernels", other.as_str()),
    }
}

/// The values of little-endian `dtype` bytes (f32, bf16 or f16), widened to f32.
pub fn widened(dtype: DType, b: &[u8]) -> Vec<f32> {
    match dtype {
        DType::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        DType::BF16 => b.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        DType::F16 => b.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        other => panic!("widened: {} is not a float type of the kernels", other.as_str()),
    }
}

impl Gpu {
    /// `v` copied into a new buffer (one element at least: allocations of nothing are not a
    /// buffer to point at).
    pub fn upload<T: DeviceRepr + Copy + Default>(&self, v: &[T]) -> Buffer<T> {
        let v = padded(v);
        match self {
            Gpu::Device { stream, .. } => Buffer::Device(stream.clone_htod(&v).unwrap()),
            Gpu::Emulated => Buffer::Host(Guarded::new(&v)),
        }
    }

    /// The buffer's contents.
    pub fn download<T: DeviceRepr + Copy + ValidAsZeroBits>(&self, b: &Buffer<T>) -> Vec<T> {
        match (self, b) {
            (Gpu::Device { stream, .. }, Buffer::Device(s)) => stream.clone_dtoh(s).unwrap(),
            (_, Buffer::Host(g)) => g.values(),
            (Gpu::Emulated, Buffer::Device(_)) => unreachable!("the emulator holds no device buffers"),
        }
    }

    /// The buffer's address as a kernel takes it.
    pub fn ptr<T>(&self, b: &Buffer<T>) -> u64 {
        match (self, b) {
            (Gpu::Device { stream, .. }, Buffer::Device(s)) => s.device_ptr(stream).0,
            (_, Buffer::Host(g)) => g.data as u64,
            (Gpu::Emulated, Buffer::Device(_)) => unreachable!("the emulator holds no device buffers"),
        }
    }

    /// The stream as the host hands it to a plugin (0, the default stream, when emulated).
    pub fn stream(&self) -> CudaStream {
        match self {
            Gpu::Device { stream, .. } => CudaStream { handle: stream.cu_stream() as u64, ordinal: 0 },
            Gpu::Emulated => CudaStream { handle: 0, ordinal: 0 },
        }
    }

    /// The first `len` elements of `b` as the host hands a buffer over.
    pub fn buf<T>(&self, b: &Buffer<T>, len: usize, dtype: DType) -> CudaBuf {
        CudaBuf { ptr: self.ptr(b), len: len as u64, dtype, ordinal: 0 }
    }
}

/// `n` values in [-scale, scale), a pure function of `seed` ([`Rng`](super::Rng)), with
/// every 9th an exact zero and stretches of very different sizes (every 5th run of 77
/// elements 100× smaller: in a 77-wide matrix, every 5th row).
pub fn uneven(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut rng = super::Rng(seed);
    (0..n)
        .map(|i| {
            let x = rng.uniform() * scale;
            match i {
                _ if i % 9 == 4 => 0.0,
                _ if (i / 77) % 5 == 2 => x * 0.01,
                _ => x,
            }
        })
        .collect()
}

/// Step `step`'s gradient and context on a parameter of `n` elements, for the tests that take
/// their data from [`uneven`]: the gradient's scale changes each step (1, 0.3, 5, 0.02), the
/// learning rate too (1e-3 to 3e-3), and weight decay (0.1) starts at step 2.
pub fn uneven_step(n: usize, step: u64) -> (Vec<f32>, StepContext) {
    let g = uneven(n, 100 + step, [1.0, 0.3, 5.0, 0.02][step as usize % 4]);
    let ctx = StepContext {
        step,
        lr: 1e-3 * (1.0 + (step % 3) as f64),
        weight_decay: if step > 1 { 0.1 } else { 0.0 },
        threads: 1,
        grad_scale: 1.0,
    };
    (g, ctx)
}

/// Fails unless nvcc's output `ptx` has every kernel of `kernels` and no instruction that
/// rounds differently from the CPU: a fused multiply-add (which `--fmad=false` forbids), an
/// approximate division, reciprocal or square root, a flush of subnormals to zero. For the
/// unit tests of every optimizer whose GPU step gives the CPU's bits.
pub fn assert_ptx_rounds_as_the_cpu<'a>(ptx: &str, kernels: impl IntoIterator<Item = &'a str>) {
    for kernel in kernels {
        assert!(ptx.contains(&format!(".entry {kernel}(")), "no {kernel} kernel in the PTX");
    }
    for line in ptx.lines().map(str::trim).filter(|l| !l.starts_with("//")) {
        let op = line.split_whitespace().next().unwrap_or("");
        let fused = (op.starts_with("fma.") || op.starts_with("mad.")) && (op.ends_with("f32") || op.ends_with("f64"));
        let inexact = op.contains(".approx") || op.contains(".ftz");
        assert!(!fused && !inexact, "the PTX has '{line}': the GPU would not give the CPU's bits");
    }
}

/// One parameter on both sides: weights, and the state the optimizer's layout declares as
/// bytes.
pub struct Sides {
    /// The optimizer's state layout for the parameter.
    pub layout: Vec<StateSpec>,
    /// The CPU's weights.
    pub cpu_w: Vec<f32>,
    /// The CPU's state buffers, in the layout's order.
    pub cpu_state: Vec<Vec<u8>>,
    /// The GPU's weights.
    pub gpu_w: Buffer<f32>,
    /// The GPU's state buffers, in the layout's order (a zero-length one holds one byte).
    pub gpu_state: Vec<Buffer<u8>>,
}

impl Sides {
    /// Weights `w` and zero-filled state (as the host allocates it) on both sides.
    pub fn new(opt: &dyn Optimizer, info: &ParamInfo<'_>, w: &[f32], gpu: &Gpu) -> Self {
        let layout = opt.state_layout(info).unwrap();
        let cpu_state: Vec<Vec<u8>> = layout.iter().map(|s| vec![0u8; s.bytes() as usize]).collect();
        let mut sides = Self { layout, cpu_w: w.to_vec(), cpu_state, gpu_w: gpu.upload(w), gpu_state: Vec::new() };
        sides.upload(gpu);
        sides
    }

    /// The CPU's weights and state copied to the GPU (a checkpoint loaded there).
    pub fn upload(&mut self, gpu: &Gpu) {
        self.gpu_w = gpu.upload(&self.cpu_w);
        // A zero-length buffer still gets one byte (what the host allocates); the call sees len 0.
        self.gpu_state = self.cpu_state.iter().map(|b| gpu.upload(b)).collect();
    }

    /// One step on the CPU only.
    pub fn cpu_step(&mut self, opt: &mut dyn Optimizer, info: &ParamInfo<'_>, g: &[f32], ctx: &StepContext) {
        // State as 8-byte-aligned host buffers, as the host allocates them.
        let mut aligned: Vec<Vec<u64>> = self.cpu_state.iter().map(|b| vec![0u64; b.len().div_ceil(8)]).collect();
        for (a, b) in aligned.iter_mut().zip(&self.cpu_state) {
            as_bytes_mut(a)[..b.len()].copy_from_slice(b);
        }
        {
            let mut bufs: Vec<StateBuf<'_>> = aligned
                .iter_mut()
                .zip(&self.layout)
                .map(|(a, s)| StateBuf::new(s.dtype, &mut as_bytes_mut(a)[..s.bytes() as usize]))
                .collect();
            opt.step(info, &mut self.cpu_w, g, &mut bufs, ctx).unwrap();
        }
        for (a, b) in aligned.iter_mut().zip(self.cpu_state.iter_mut()) {
            let n = b.len();
            b.copy_from_slice(&as_bytes_mut(a)[..n]);
        }
    }

    /// One step on the GPU only, through device pointers on `stream`.
    pub fn gpu_step(&mut self, opt: &mut dyn Optimizer, info: &ParamInfo<'_>, g: &[f32], ctx: &StepContext, gpu: &Gpu) {
        let gg = gpu.upload(g);
        let state: Vec<CudaBuf> =
            self.gpu_state.iter().zip(&self.layout).map(|(b, s)| gpu.buf(b, s.len as usize, s.dtype)).collect();
        let n = g.len();
        let (w, g) = (gpu.buf(&self.gpu_w, n, DType::F32), gpu.buf(&gg, n, DType::F32));
        opt.step_cuda(info, &w, &g, &state, ctx, &gpu.stream()).unwrap();
    }

    /// One step on each side (the CPU's first) with gradient `g`.
    pub fn step(&mut self, opt: &mut dyn Optimizer, info: &ParamInfo<'_>, g: &[f32], ctx: &StepContext, gpu: &Gpu) {
        self.cpu_step(opt, info, g, ctx);
        self.gpu_step(opt, info, g, ctx, gpu);
    }

    /// The steps `steps` on each side, [`same`](Self::same) after every one: `input(step)`
    /// gives the step's gradient and context; a difference is reported as `"{what}, step
    /// {step}: …"`.
    pub fn steps(
        &mut self,
        opt: &mut dyn Optimizer,
        info: &ParamInfo<'_>,
        steps: RangeInclusive<u64>,
        mut input: impl FnMut(u64) -> (Vec<f32>, StepContext),
        what: &str,
        gpu: &Gpu,
    ) {
        for step in steps {
            let (g, ctx) = input(step);
            self.step(opt, info, &g, &ctx, gpu);
            self.same(&format!("{what}, step {step}"), gpu);
        }
    }

    /// A checkpoint moving between devices: the steps `cpu` on the CPU only, the CPU's weights
    /// and state then loaded on the GPU ([`upload`](Self::upload)), and the steps `then` on
    /// each side as in [`steps`](Self::steps) (`input` gives every step's gradient and context).
    #[allow(clippy::too_many_arguments)]
    pub fn continued(
        &mut self,
        opt: &mut dyn Optimizer,
        info: &ParamInfo<'_>,
        cpu: RangeInclusive<u64>,
        then: RangeInclusive<u64>,
        mut input: impl FnMut(u64) -> (Vec<f32>, StepContext),
        what: &str,
        gpu: &Gpu,
    ) {
        for step in cpu {
            let (g, ctx) = input(step);
            self.cpu_step(opt, info, &g, &ctx);
        }
        self.upload(gpu);
        self.steps(opt, info, then, input, what, gpu);
    }

    /// Fails unless both sides hold the same bits, naming the first difference: the weight's
    /// index and both values, or the state buffer, the element (and its byte) and both
    /// elements' bits.
    pub fn same(&self, what: &str, gpu: &Gpu) {
        let w = gpu.download(&self.gpu_w);
        let differ = w.iter().zip(&self.cpu_w).position(|(a, b)| a.to_bits() != b.to_bits());
        if let Some(i) = differ {
            panic!("{what}: values differ first at {i}: GPU {:e}, CPU {:e}", w[i], self.cpu_w[i]);
        }
        for ((g, c), s) in self.gpu_state.iter().zip(&self.cpu_state).zip(&self.layout) {
            let g = gpu.download(g);
            let differ = c.iter().zip(&g).position(|(a, b)| a != b);
            if let Some(i) = differ {
                let size = s.dtype.size();
                let at = i / size;
                // The element's bytes as one little-endian word.
                let word =
                    |b: &[u8]| b[size * at..size * (at + 1)].iter().rev().fold(0u64, |w, &x| w << 8 | u64::from(x));
                panic!(
                    "{what}: state '{}' differs first at element {at} (byte {i}): GPU {:#0digits$x}, CPU {:#0digits$x}",
                    s.name,
                    word(&g),
                    word(c),
                    digits = 2 + 2 * size
                );
            }
        }
    }

    /// `opt`'s GPU step on these buffers, with the state as `edit` leaves it, the weights
    /// passed as the gradient too and a first step's context, which must be refused: returns
    /// the error's text. (Then [`same`](Self::same) checks that nothing was launched.)
    pub fn refused(
        &self,
        opt: &mut dyn Optimizer,
        info: &ParamInfo<'_>,
        gpu: &Gpu,
        edit: impl FnOnce(&mut [CudaBuf]),
    ) -> String {
        let mut state: Vec<CudaBuf> =
            self.gpu_state.iter().zip(&self.layout).map(|(b, s)| gpu.buf(b, s.len as usize, s.dtype)).collect();
        edit(&mut state);
        let w = gpu.buf(&self.gpu_w, self.cpu_w.len(), DType::F32);
        let ctx = StepContext { step: 1, lr: 1e-3, weight_decay: 0.0, threads: 1, grad_scale: 1.0 };
        opt.step_cuda(info, &w, &w, &state, &ctx, &gpu.stream()).unwrap_err().to_string()
    }
}

/// At least one element: cudarc's allocations of nothing are not a buffer to point at.
fn padded<T: Copy + Default>(v: &[T]) -> Vec<T> {
    if v.is_empty() { vec![T::default()] } else { v.to_vec() }
}

/// Unsigned integers: no padding, every byte pattern a value.
trait Word: Copy {}
impl Word for u64 {}
impl Word for u128 {}

fn as_bytes_mut<W: Word>(words: &mut [W]) -> &mut [u8] {
    // SAFETY: W is u64 or u128 (no padding, every byte pattern valid); the length is exact.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(words)) }
}
