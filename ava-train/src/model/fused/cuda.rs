//! The fused ops' shared device plumbing (`cuda` feature): the kernels of `kernels/fused.cu`,
//! built to PTX by the build script, loaded once per device through candle's module cache and
//! launched on candle's stream, so they order with candle's own work without a sync.
//!
//! Each op's device half (the `cuda_fwd` of its custom op, the device branch of its backward)
//! lives beside the op, in its `cuda` child (`norm/cuda.rs`, `swiglu/cuda.rs`, `rope/cuda.rs`,
//! `embedding/cuda.rs`, `linear/cuda.rs`), on the helpers here: the module's PTX and name,
//! `by_type!`, launch configurations, typed views and fresh buffers. Here too is the device
//! work that is no single fused op's: the cross-entropy of `model::ops`, rounding and
//! widening between f32 and the half types, Σ x², and the buffers handed to plugins.
//!
//! The math is the CPU's (the kernel file says which); inputs arrive contiguous (the public
//! functions make them so) and outputs are fresh buffers of the output's shape. A type other
//! than f32, bf16 and f16 (the gradient checks' f64) is refused by name: those checks run on
//! the CPU. Each launch's grid comes from `launch`, which the kernels' emulated tests
//! (`emulated`) launch them with too.

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{
    CudaSlice, CudaView, CudaViewMut, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg, SyncOnDrop,
};
use candle_core::cuda::{CudaDType, CudaDevice, CudaStorage, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{DType, Layout, Result, Shape, Storage, Tensor, bail};

use super::launch::{self, Grid};

/// kernels/fused.cu as PTX.
pub(super) const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/fused.ptx"));

/// The name candle caches the loaded module under.
pub(super) const MODULE: &str = "ava-fused";

/// Runs `$body` with `$t` the Rust element type of `$dtype` and `$s` its kernel suffix.
macro_rules! by_type {
    ($dtype:expr, $op:expr, |$t:ident, $s:ident| $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $t = f32;
                let $s = "f32";
                $body
            }
            DType::BF16 => {
                type $t = half::bf16;
                let $s = "bf16";
                $body
            }
            DType::F16 => {
                type $t = half::f16;
                let $s = "f16";
                $body
            }
            other => bail!("{}: {other:?} has no CUDA kernel (f32, bf16 and f16 do; f64 is for the CPU's checks)", $op),
        }
    };
}
pub(super) use by_type;

/// cudarc's launch configuration for a grid of fused.cu's (see `launch`).
pub(super) fn config(g: Grid) -> LaunchConfig {
    LaunchConfig { grid_dim: (g.blocks, 1, 1), block_dim: (g.threads, 1, 1), shared_mem_bytes: 0 }
}

/// An `i32` kernel argument.
pub(super) fn int(n: usize, what: &str) -> Result<i32> {
    i32::try_from(n).map_err(|_| candle_core::Error::Msg(format!("{what} of {n} is beyond the kernels' 32-bit sizes")))
}

/// The contiguous elements of `s` that `l` describes.
pub(super) fn view<'a, T: CudaDType>(s: &'a CudaStorage, l: &Layout, op: &str) -> Result<CudaView<'a, T>> {
    let Some((start, end)) = l.contiguous_offsets() else { bail!("{op}: input is not contiguous") };
    Ok(s.as_cuda_slice::<T>()?.slice(start..end))
}

/// A fresh device buffer of `len` elements; the kernel that follows writes all of them.
pub(super) fn uninit<T: DeviceRepr>(dev: &CudaDevice, len: usize) -> Result<CudaSlice<T>> {
    // SAFETY: every caller launches a kernel that writes each element before anything reads it.
    unsafe { dev.alloc::<T>(len.max(1)) }
}

/// A tensor (no graph) over a device buffer.
pub(super) fn tensor<T: CudaDType>(slice: CudaSlice<T>, dev: &CudaDevice, shape: impl Into<Shape>) -> Tensor {
    storage_tensor(CudaStorage::wrap_cuda_slice(slice, dev.clone()), shape)
}

/// Runs `f` on a tensor's device storage and layout (made contiguous first).
pub(super) fn with_cuda<R>(t: &Tensor, op: &str, f: impl FnOnce(&CudaStorage, &Layout) -> Result<R>) -> Result<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(s) = &*storage else { bail!("{op}: a tensor is not on the GPU") };
    f(s, layout)
}

// ---- cross-entropy ----

/// Fails unless every target is a row of the vocabulary (the kernel indexes by it).
fn check_targets(targets: &[u32], v: usize) -> Result<()> {
    if let Some(&t) = targets.iter().find(|&&t| t as usize >= v) {
        bail!("cross-entropy: target token {t} is outside the vocabulary of {v}");
    }
    Ok(())
}

/// Each row's `logsumexp − logit[target]` (N,) f32, from logits (N, V) of their stored type.
pub(crate) fn cross_entropy_fwd(logits: &CudaStorage, l: &Layout, targets: &[u32]) -> Result<CudaStorage> {
    let dev = logits.device();
    let (n, v) = l.shape().dims2()?;
    if targets.len() != n {
        bail!("cross-entropy: {} targets for {n} rows", targets.len());
    }
    check_targets(targets, v)?;
    by_type!(logits.dtype(), "cross-entropy", |T, s| {
        let lv = view::<T>(logits, l, "cross-entropy")?;
        let tv = dev.clone_htod(targets)?; // (N,) u32
        let mut loss = uninit::<f32>(dev, n)?; // (N,)
        if n > 0 {
            let f = dev.get_or_load_custom_func(&format!("cross_entropy_fwd_{s}"), MODULE, PTX)?;
            let vi = int(v, "the vocabulary")?;
            let mut b = f.builder();
            b.arg(&lv).arg(&tv).arg(&mut loss).arg(&vi);
            // SAFETY: cross_entropy_fwd's signature; targets are below V (checked).
            unsafe { b.launch(config(launch::cross_entropy(n)?)) }.w()?;
        }
        Ok(CudaStorage::wrap_cuda_slice(loss, dev.clone()))
    })
}

/// The logits' gradient `(softmax − onehot) · grad_rows`, in the logits' type.
pub(crate) fn cross_entropy_bwd(logits: &Tensor, targets: &[u32], grad_rows: &Tensor) -> Result<Tensor> {
    let (n, v) = logits.dims2()?;
    check_targets(targets, v)?;
    let grad_rows = grad_rows.to_dtype(DType::F32)?;
    with_cuda(logits, "cross-entropy", |ls, ll| {
        with_cuda(&grad_rows, "cross-entropy", |gs, lg| {
            let dev = ls.device();
            by_type!(ls.dtype(), "cross-entropy", |T, s| {
                let (lv, gv) = (view::<T>(ls, ll, "cross-entropy")?, view::<f32>(gs, lg, "cross-entropy")?);
                let tv = dev.clone_htod(targets)?; // (N,) u32
                let mut grad = uninit::<T>(dev, n * v)?; // (N, V)
                if n > 0 {
                    let f = dev.get_or_load_custom_func(&format!("cross_entropy_bwd_{s}"), MODULE, PTX)?;
                    let vi = int(v, "the vocabulary")?;
                    let mut b = f.builder();
                    b.arg(&lv).arg(&tv).arg(&gv).arg(&mut grad).arg(&vi);
                    // SAFETY: cross_entropy_bwd's signature; targets are below V (checked).
                    unsafe { b.launch(config(launch::cross_entropy(n)?)) }.w()?;
                }
                Ok(tensor(grad, dev, (n, v)))
            })
        })
    })
}

// ---- stochastic rounding ----

/// `values` (f32, on the GPU) rounded stochastically to `dtype` (bf16 or f16) with the
/// random bits of (seed, index): the same bits, so the same result, as
/// `train::rounding::round_stochastic` on the CPU.
pub fn round_stochastic(values: &Tensor, dtype: DType, seed: u64) -> Result<Tensor> {
    if values.dtype() != DType::F32 {
        bail!("stochastic rounding: values are {:?}, f32 expected", values.dtype());
    }
    with_cuda(values, "stochastic rounding", |vs, l| {
        let dev = vs.device();
        let xv = view::<f32>(vs, l, "stochastic rounding")?;
        let shape = values.shape().clone();
        match dtype {
            DType::BF16 => Ok(tensor(round_into::<half::bf16>(dev, &xv, "round_stochastic_bf16", seed)?, dev, shape)),
            DType::F16 => Ok(tensor(round_into::<half::f16>(dev, &xv, "round_stochastic_f16", seed)?, dev, shape)),
            other => bail!("stochastic rounding: to {other:?}; bf16 or f16 expected"),
        }
    })
}

/// The launch of [`round_stochastic`] into a fresh buffer of `H`.
fn round_into<H: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    x: &CudaView<'_, f32>,
    name: &str,
    seed: u64,
) -> Result<CudaSlice<H>> {
    let n = x.len();
    let mut out = uninit::<H>(dev, n)?; // (n,)
    if n > 0 {
        let f = dev.get_or_load_custom_func(name, MODULE, PTX)?;
        let mut b = f.builder();
        b.arg(x).arg(&mut out).arg(&n).arg(&seed);
        // SAFETY: round_stochastic_*'s signature; in and out hold n elements.
        unsafe { b.launch(config(launch::elementwise(n)?)) }.w()?;
    }
    Ok(out)
}

/// `values` (f32, on the GPU) stored as Kahan-compensated `dtype` (bf16 or f16): `(h, c)`,
/// h their rounding to nearest and c what that lost, rounded to nearest; the same bits as
/// `train::rounding::round_compensated` on the CPU.
pub fn round_compensated(values: &Tensor, dtype: DType) -> Result<(Tensor, Tensor)> {
    if values.dtype() != DType::F32 {
        bail!("compensated rounding: values are {:?}, f32 expected", values.dtype());
    }
    let n = values.elem_count();
    with_cuda(values, "compensated rounding", |vs, l| {
        let dev = vs.device();
        let x = view::<f32>(vs, l, "compensated rounding")?;
        let (mut h, mut c) = (zeros(dev, dtype, n)?, zeros(dev, dtype, n)?); // (n,) each
        let whole = Layout::contiguous(n);
        match dtype {
            DType::BF16 => {
                let c = c.as_cuda_slice_mut::<half::bf16>()?.slice_mut(..n);
                round_compensated_storage(&x, &mut h, &whole, c)?
            }
            DType::F16 => {
                let c = c.as_cuda_slice_mut::<half::f16>()?.slice_mut(..n);
                round_compensated_storage(&x, &mut h, &whole, c)?
            }
            other => bail!("compensated rounding: to {other:?}; bf16 or f16 expected"),
        }
        let shape = values.shape().clone();
        Ok((storage_tensor(h, shape.clone()), storage_tensor(c, shape)))
    })
}

/// `h + c` in f32 for half values `h` and their compensation `c` (one type, bf16 or f16, on
/// the GPU): the same bits as `train::rounding::widen` with a compensation on the CPU.
pub fn widen_compensated(h: &Tensor, c: &Tensor) -> Result<Tensor> {
    if h.dtype() != c.dtype() || h.dims() != c.dims() {
        bail!(
            "widening with a compensation: values {:?} {:?}, compensation {:?} {:?}",
            h.dims(),
            h.dtype(),
            c.dims(),
            c.dtype()
        );
    }
    with_cuda(h, "widening with a compensation", |hs, hl| {
        with_cuda(c, "widening with a compensation", |cs, cl| {
            let wide = by_type!(c.dtype(), "widening with a compensation", |T, _s| widen_compensated_storage(
                hs,
                hl,
                &view::<T>(cs, cl, "widening with a compensation")?
            ))?;
            Ok(tensor(wide, hs.device(), h.shape().clone()))
        })
    })
}

/// A half storage's values (bf16/f16, contiguous as `l` places them) widened into a fresh
/// f32 buffer: the optimizer steps f32 values.
pub(crate) fn widen_storage(s: &CudaStorage, l: &Layout) -> Result<CudaSlice<f32>> {
    widen_with::<u8>(s, l, None)
}

/// A kahan parameter's half values `h` (bf16/f16, contiguous as `l` places them) plus `c`,
/// their compensation in the same type (the `ava.kahan` state buffer's bytes, 2 a value or
/// one byte for an empty one, which the device cannot allocate; or a tensor's values),
/// widened into a fresh f32 buffer, `h + c`: the value the optimizer steps, as the CPU's
/// `rounding::widen` with a compensation.
pub(crate) fn widen_compensated_storage<C: DeviceRepr>(
    s: &CudaStorage,
    l: &Layout,
    c: &CudaView<'_, C>,
) -> Result<CudaSlice<f32>> {
    widen_with(s, l, Some(c))
}

/// [`widen_storage`], adding the compensation `comp` when given.
fn widen_with<C: DeviceRepr>(s: &CudaStorage, l: &Layout, comp: Option<&CudaView<'_, C>>) -> Result<CudaSlice<f32>> {
    fn widen<H: CudaDType + DeviceRepr, C: DeviceRepr>(
        s: &CudaStorage,
        l: &Layout,
        comp: Option<&CudaView<'_, C>>,
        names: [&str; 2],
    ) -> Result<CudaSlice<f32>> {
        let dev = s.device();
        let x = view::<H>(s, l, "widen")?;
        let n = x.len();
        if let Some(c) = comp {
            let n_c = values_of::<C, H>(c.len());
            if n_c != n {
                bail!("widen: {n_c} compensation values for {n} weights");
            }
        }
        let mut out = uninit::<f32>(dev, n)?; // (n,) f32
        if n > 0 {
            let f = dev.get_or_load_custom_func(names[usize::from(comp.is_some())], MODULE, PTX)?;
            let mut b = f.builder();
            b.arg(&x);
            if let Some(c) = comp {
                b.arg(c);
            }
            b.arg(&mut out).arg(&n);
            // SAFETY: widen_*'s signature, and widen_compensated_*'s with the compensation;
            // in, the compensation and out hold n elements.
            unsafe { b.launch(config(launch::elementwise(n)?)) }.w()?;
        }
        Ok(out)
    }
    match s.dtype() {
        DType::BF16 => widen::<half::bf16, C>(s, l, comp, ["widen_bf16", "widen_compensated_bf16"]),
        DType::F16 => widen::<half::f16, C>(s, l, comp, ["widen_f16", "widen_compensated_f16"]),
        other => bail!("widen: {other:?} is not a half type"),
    }
}

/// Values of `H` in `len` elements of `C` (a state buffer's bytes hold half values; an
/// empty one's single byte holds none).
fn values_of<C, H>(len: usize) -> usize {
    len * std::mem::size_of::<C>() / std::mem::size_of::<H>()
}

/// `x` (f32) rounded stochastically into the half storage `s` in place (the elements `l`
/// places), with the bits of (seed, index) the CPU draws.
pub(crate) fn round_stochastic_storage(x: &CudaSlice<f32>, s: &mut CudaStorage, l: &Layout, seed: u64) -> Result<()> {
    round_in_place::<f32, u8>(&x.as_view(), x.len(), s, l, Rounding::Stochastic(seed))
}

/// `x`, the bytes of f32 values (an f32 master in a state buffer: 4 bytes a value, or one
/// byte for an empty one, which the device cannot allocate), rounded to nearest (ties to
/// even, the CPU's `rounding::round_nearest`) into the half storage `s` in place.
pub(crate) fn round_nearest_storage(x: &CudaSlice<u8>, s: &mut CudaStorage, l: &Layout) -> Result<()> {
    round_in_place::<u8, u8>(&x.as_view(), x.len() / 4, s, l, Rounding::Nearest)
}

/// `x` (f32, a kahan parameter just stepped) stored back: its rounding to nearest into the
/// half storage `s` in place (the elements `l` places), and what that lost, rounded to
/// nearest, into `c`, the compensation (in the storage's type, as
/// [`widen_compensated_storage`] takes it): the CPU's `rounding::round_compensated`.
pub(crate) fn round_compensated_storage<C: DeviceRepr>(
    x: &CudaView<'_, f32>,
    s: &mut CudaStorage,
    l: &Layout,
    c: CudaViewMut<'_, C>,
) -> Result<()> {
    round_in_place(x, x.len(), s, l, Rounding::Compensated(c))
}

/// How [`round_in_place`] rounds f32 values into a half storage.
enum Rounding<'a, C> {
    /// Up or down, with the bits of (seed, index) the CPU draws.
    Stochastic(u64),
    /// To nearest, ties to even.
    Nearest,
    /// To nearest, and what that lost, rounded to nearest, into this compensation buffer
    /// (values of the storage's type).
    Compensated(CudaViewMut<'a, C>),
}

impl<C> Rounding<'_, C> {
    /// Its kernels for bf16 and f16, and its words for errors.
    fn kernels(&self) -> ([&'static str; 2], &'static str) {
        match self {
            Self::Stochastic(_) => (["round_stochastic_bf16", "round_stochastic_f16"], "stochastic rounding"),
            Self::Nearest => (["round_nearest_bf16", "round_nearest_f16"], "rounding to nearest"),
            Self::Compensated(_) => (["round_compensated_bf16", "round_compensated_f16"], "compensated rounding"),
        }
    }
}

/// Launches `how`'s kernel for the storage's type (bf16, f16) on `x` (`n_x` f32 values) into
/// the elements of `s` that `l` places.
fn round_in_place<X: DeviceRepr, C: DeviceRepr>(
    x: &CudaView<'_, X>,
    n_x: usize,
    s: &mut CudaStorage,
    l: &Layout,
    how: Rounding<'_, C>,
) -> Result<()> {
    fn round<H: CudaDType + DeviceRepr, X: DeviceRepr, C: DeviceRepr>(
        x: &CudaView<'_, X>,
        n_x: usize,
        s: &mut CudaStorage,
        l: &Layout,
        name: &str,
        what: &str,
        how: Rounding<'_, C>,
    ) -> Result<()> {
        let Some((start, end)) = l.contiguous_offsets() else { bail!("{what}: parameter not contiguous") };
        let n = end - start;
        if n_x != n {
            bail!("{what}: {n_x} values for {n} elements");
        }
        let (mut comp, seed) = match how {
            Rounding::Stochastic(seed) => (None, Some(seed)),
            Rounding::Nearest => (None, None),
            Rounding::Compensated(c) => (Some(c), None),
        };
        if let Some(c) = &comp {
            let n_c = values_of::<C, H>(c.len());
            if n_c != n {
                bail!("{what}: a compensation of {n_c} values for {n} elements");
            }
        }
        if n == 0 {
            return Ok(());
        }
        let dev = s.device().clone();
        let mut out = s.as_cuda_slice_mut::<H>()?.slice_mut(start..end); // (n,) the parameter
        let f = dev.get_or_load_custom_func(name, MODULE, PTX)?;
        let mut b = f.builder();
        b.arg(x).arg(&mut out);
        if let Some(c) = comp.as_mut() {
            b.arg(c);
        }
        b.arg(&n);
        if let Some(seed) = &seed {
            b.arg(seed);
        }
        // SAFETY: round_stochastic_*, round_nearest_* and round_compensated_*'s signatures
        // (the seed only for the first, the compensation only for the last); x holds n f32
        // values, and the parameter and the compensation n elements.
        unsafe { b.launch(config(launch::elementwise(n)?)) }.w()?;
        Ok(())
    }
    let (names, what) = how.kernels();
    match s.dtype() {
        DType::BF16 => round::<half::bf16, X, C>(x, n_x, s, l, names[0], what, how),
        DType::F16 => round::<half::f16, X, C>(x, n_x, s, l, names[1], what, how),
        other => bail!("{what}: into {other:?}; bf16 or f16 expected"),
    }
}

// ---- Σ x² ----

/// Σ x² of each tensor, read back in one transfer (two launches over all of them).
pub(crate) fn sums_of_squares(tensors: &[&Tensor]) -> Result<Vec<f32>> {
    let Some(t0) = tensors.first() else { return Ok(Vec::new()) };
    let candle_core::Device::Cuda(dev) = t0.device() else { bail!("sum of squares: a tensor is not on the GPU") };
    let mut out = uninit::<f32>(dev, tensors.len())?; // (tensors,) f32
    sums_into(dev, tensors, &mut out.slice_mut(..))?;
    tensor(out, dev, tensors.len()).to_vec1::<f32>()
}

/// Queues Σ x² of each tensor (all on one GPU, of one type) into `out[i]` (`out` has one
/// element per tensor): every tensor's blocks in one grid (`sumsq_many_partial_*`, partial
/// sums over a strided grid), then a block per tensor adding its partial sums in block order
/// (`sumsq_many_final`), so a tensor's sum is the same bits every time, whatever is summed
/// beside it. Nothing waits for them.
fn sums_into(dev: &CudaDevice, tensors: &[&Tensor], out: &mut CudaViewMut<'_, f32>) -> Result<()> {
    let Some(t0) = tensors.first() else { return Ok(()) };
    if let Some(t) = tensors.iter().find(|t| t.dtype() != t0.dtype() || !t.device().same_device(t0.device())) {
        bail!("sum of squares: tensors of {:?} and {:?} (one type, one GPU)", t0.dtype(), t.dtype());
    }
    if out.len() != tensors.len() {
        bail!("sum of squares: {} tensors into {} sums", tensors.len(), out.len());
    }
    let contiguous = tensors.iter().map(|t| t.contiguous()).collect::<Result<Vec<_>>>()?;
    let held: Vec<_> = contiguous.iter().map(|t| t.storage_and_layout()).collect();
    let stream = dev.cuda_stream();
    let mut bufs = Vec::with_capacity(held.len()); // each tensor's device address, its guard
    for (storage, layout) in &held {
        let Storage::Cuda(s) = &**storage else { bail!("sum of squares: a tensor is not on the GPU") };
        bufs.push(storage_buf(s, layout, &stream)?);
    }
    let lens: Vec<usize> = bufs.iter().map(|(b, _)| b.len as usize).collect();
    let first = launch::sumsq_many_first(&lens)?; // (tensors + 1,)
    let blocks = *first.last().expect("one more than the tensors") as usize;
    let ptrs: Vec<u64> = bufs.iter().map(|(b, _)| b.ptr).collect(); // (tensors,)
    let lens: Vec<u64> = lens.iter().map(|&n| n as u64).collect(); // (tensors,)
    let (pv, lv, fv) = (dev.clone_htod(&ptrs)?, dev.clone_htod(&lens)?, dev.clone_htod(&first)?);
    let mut partial = uninit::<f32>(dev, blocks)?; // (blocks,) f32
    let count = int(tensors.len(), "the tensors")?;
    let sfx = match t0.dtype() {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        other => bail!("sum of squares: {other:?} has no CUDA kernel (f32, bf16 and f16 do)"),
    };
    let f = dev.get_or_load_custom_func(&format!("sumsq_many_partial_{sfx}"), MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&pv).arg(&lv).arg(&fv).arg(&count).arg(&mut partial);
    // SAFETY: sumsq_many_partial_*'s signature; ptrs and lens describe `count` live buffers of
    // the type (guarded until the launches are queued), first their blocks.
    unsafe { b.launch(config(launch::sumsq_many_partial(blocks)?)) }.w()?;
    let f = dev.get_or_load_custom_func("sumsq_many_final", MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&partial).arg(&fv).arg(out);
    // SAFETY: sumsq_many_final's signature; partial holds first[count] floats, out count.
    unsafe { b.launch(config(launch::sumsq_many_final(tensors.len())?)) }.w()?;
    drop(bufs);
    Ok(())
}

/// Σ x² of tensors handed over one at a time, each queued on the device into its own slot
/// of one buffer as it comes, and read back together: no synchronization until [`read`].
///
/// [`read`]: DeviceSums::read
pub(crate) struct DeviceSums {
    dev: CudaDevice,
    out: CudaSlice<f32>, // (capacity,) f32, the first `queued` written
    capacity: usize,
    queued: usize,
}

impl DeviceSums {
    /// Room for `capacity` sums on `dev`.
    pub(crate) fn new(dev: &CudaDevice, capacity: usize) -> Result<Self> {
        Ok(Self { dev: dev.clone(), out: uninit::<f32>(dev, capacity)?, capacity, queued: 0 })
    }

    /// Queues Σ t² into the next slot.
    pub(crate) fn push(&mut self, t: &Tensor) -> Result<()> {
        if self.queued >= self.capacity {
            bail!("sum of squares: more than the {} sums room was made for", self.capacity);
        }
        let mut slot = self.out.slice_mut(self.queued..self.queued + 1);
        sums_into(&self.dev, &[t], &mut slot)?;
        self.queued += 1;
        Ok(())
    }

    /// The sums queued, in order, in one read of just those slots (which waits for them).
    pub(crate) fn read(self) -> Result<Vec<f32>> {
        if self.queued == 0 {
            return Ok(Vec::new());
        }
        self.dev.clone_dtoh(&self.out.slice(..self.queued))
    }
}

// ---- buffers handed to plugins (the contract's device calls) ----

/// The stream a plugin's device call launches on: candle's own, so the plugin's work is
/// ordered with the engine's without a synchronization. The device's context is made
/// current on the calling thread first, as the contract promises the plugin.
pub(crate) fn plugin_stream(dev: &CudaDevice) -> Result<ava_core::device::CudaStream> {
    let s = dev.cuda_stream();
    s.context().bind_to_thread().w()?;
    Ok(ava_core::device::CudaStream { handle: s.cu_stream() as u64, ordinal: s.context().ordinal() as u32 })
}

/// The contract's element type for a candle type.
fn plugin_dtype(dtype: DType) -> Result<ava_core::DType> {
    Ok(match dtype {
        DType::F32 => ava_core::DType::F32,
        DType::BF16 => ava_core::DType::BF16,
        DType::F16 => ava_core::DType::F16,
        DType::U32 => ava_core::DType::U32,
        DType::U8 => ava_core::DType::U8,
        DType::F64 => ava_core::DType::F64,
        other => bail!("{other:?} buffers cannot be handed to a plugin"),
    })
}

/// `len` elements of `slice` from element `start` as the contract's buffer, with the guard
/// that records the plugin's use on candle's stream when dropped: keep it until the plugin
/// call has returned.
pub(crate) fn plugin_buf<'a, T: DeviceRepr>(
    slice: &'a CudaSlice<T>,
    start: usize,
    len: usize,
    dtype: DType,
    stream: &'a Arc<candle_core::cuda::cudarc::driver::CudaStream>,
) -> Result<(ava_core::device::CudaBuf, SyncOnDrop<'a>)> {
    if start + len > slice.len() {
        bail!("a plugin buffer of {len} elements from {start} is outside its allocation of {}", slice.len());
    }
    let (ptr, guard) = slice.device_ptr(stream);
    let buf = ava_core::device::CudaBuf {
        ptr: ptr + (start * std::mem::size_of::<T>()) as u64,
        len: len as u64,
        dtype: plugin_dtype(dtype)?,
        ordinal: stream.context().ordinal() as u32,
    };
    Ok((buf, guard))
}

/// A storage's contiguous elements (as `l` places them) as the contract's buffer; see
/// [`plugin_buf`].
pub(crate) fn storage_buf<'a>(
    s: &'a CudaStorage,
    l: &Layout,
    stream: &'a Arc<candle_core::cuda::cudarc::driver::CudaStream>,
) -> Result<(ava_core::device::CudaBuf, SyncOnDrop<'a>)> {
    let Some((start, end)) = l.contiguous_offsets() else { bail!("a buffer handed to a plugin is not contiguous") };
    by_type!(s.dtype(), "plugin buffer", |T, _s| plugin_buf(
        s.as_cuda_slice::<T>()?,
        start,
        end - start,
        s.dtype(),
        stream
    ))
}

/// A zero-filled storage of `n` elements of `dtype` (f32, bf16 or f16).
pub(crate) fn zeros(dev: &CudaDevice, dtype: DType, n: usize) -> Result<CudaStorage> {
    by_type!(dtype, "zeros", |T, _s| Ok(CudaStorage::wrap_cuda_slice(dev.alloc_zeros::<T>(n.max(1))?, dev.clone())))
}

/// A tensor (no graph) over a storage of this module's making.
pub(crate) fn storage_tensor(s: CudaStorage, shape: impl Into<Shape>) -> Tensor {
    Tensor::from_storage(Storage::Cuda(s), shape, BackpropOp::none(), false)
}
