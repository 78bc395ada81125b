//! The attention kernel plugin inside candle's autograd: a `CustomOp3` over (q, k, v).
//!
//! A fresh op is made per call. Its forward allocates the output and the buffer the kernel
//! asked to save (`saved_len`) on the host, so both are counted by the allocator; the op
//! holds the saved buffer until backward, which takes it (freeing it as soon as it has been
//! used) and calls the kernel's backward on detached, contiguous copies of the inputs. Each
//! call also gets the workspace the kernel declared for it (`workspace_len`), allocated here
//! so the allocator counts it, and freed as soon as the call returns.
//!
//! q, k, v and the output stay in the compute type (bf16 heads for a bf16 model). The
//! kernel contract is f32, so for any other type the op widens q, k and v into f32 buffers
//! inside its forward (and q, k, v, out and the output gradient inside its backward), runs
//! the kernel, rounds the result into the stored type and frees the f32 buffers on return:
//! the graph keeps the half inputs and output only. A kernel whose saved buffer tolerates
//! rounding ([`AttentionKernel::saved_tolerates_half`]: standard's probabilities) has it held
//! in the half type between the passes, widened back for its backward call.
//!
//! On a GPU (`cuda` feature, the model on a CUDA device) the op calls the kernel's
//! `forward_cuda` and `backward_cuda` instead: q, k, v, the output and the gradients stay in
//! the compute type in device memory, the saved buffer and each call's workspace are f32
//! device buffers of the sizes the kernel declared, and the kernel launches on candle's
//! stream. Nothing is copied to the host.

use std::borrow::Cow;
use std::sync::{Arc, Mutex};

use ava_core::{AttentionKernel, AttnShape, KernelContext, Pass};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Storage, Tensor, bail};

use super::fused::{rounded, widened};
#[cfg(feature = "cuda")]
use candle_core::CudaStorage;

/// Causal self-attention through `kernel`: q (B, H, T, D), k and v (B, Hkv, T, D), of one
/// float type (the kernel computes in f32). Returns (B, H, T, D) in that type, and the
/// gradients in it too. With `segments` (B·T document ids, packed documents) each query
/// sees only its own document's keys; a kernel that does not support that is refused by
/// name.
pub fn attention(
    kernel: &Arc<dyn AttentionKernel>,
    name: &str,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    segments: Option<&Arc<[u32]>>,
    threads: usize,
) -> Result<Tensor> {
    let (b, h, t, d) = q.dims4()?;
    let (_, hkv, tk, _) = k.dims4()?;
    let shape = AttnShape {
        batch: b as u32,
        q_heads: h as u32,
        kv_heads: hkv as u32,
        q_len: t as u32,
        kv_len: tk as u32,
        head_dim: d as u32,
        causal: true,
        scale: 1.0 / (d as f32).sqrt(),
    };
    if k.dtype() != q.dtype() || v.dtype() != q.dtype() {
        bail!("attention: q, k and v are {:?}, {:?} and {:?} (one type)", q.dtype(), k.dtype(), v.dtype());
    }
    if segments.is_some() && !kernel.supports_segments() {
        bail!("{}", unsupported_packing(name));
    }
    let op = AttentionOp {
        kernel: kernel.clone(),
        name: name.to_string(),
        shape,
        segments: segments.cloned(),
        ctx: KernelContext { threads: threads.max(1) as u32, ..KernelContext::default() },
        saved: Mutex::new(None),
    };
    q.contiguous()?.apply_op3(&k.contiguous()?, &v.contiguous()?, op)
}

/// Why attention kernel `name` cannot train on packed documents, and what to do.
pub fn unsupported_packing(name: &str) -> String {
    format!(
        "attention kernel '{name}' does not support data.packing: document (attention kept inside each document); \
         pick a kernel that does (built in: standard; plugins: flash, sliding-window) or set data.packing: concat"
    )
}

/// One attention call: the kernel, the shape, and what forward saved for backward.
struct AttentionOp {
    kernel: Arc<dyn AttentionKernel>,
    name: String,
    shape: AttnShape,
    /// (B·T,) document ids of packed documents, or none.
    segments: Option<Arc<[u32]>>,
    ctx: KernelContext,
    saved: Mutex<Option<Saved>>, // (saved_len,) as the kernel declared
}

/// The kernel's saved buffer between forward and backward: as written, or rounded to the
/// run's half type when the kernel says it tolerates that.
enum Saved {
    F32(Vec<f32>),
    Bf16(Vec<half::bf16>),
    F16(Vec<half::f16>),
    /// On the GPU, as the kernel wrote it.
    #[cfg(feature = "cuda")]
    Cuda(candle_core::cuda::cudarc::driver::CudaSlice<f32>),
}

impl Saved {
    /// Keeps what forward wrote, rounded to `dtype` (the inputs' type) if `half_ok` and it is
    /// a half type; the f32 buffer is freed once rounded.
    fn keep(values: Vec<f32>, dtype: DType, half_ok: bool) -> Saved {
        match dtype {
            DType::BF16 if half_ok => Saved::Bf16(rounded(&values)),
            DType::F16 if half_ok => Saved::F16(rounded(&values)),
            _ => Saved::F32(values),
        }
    }

    /// The f32 values for the backward call: moved, or widened into a buffer of their own.
    fn into_f32(self) -> Result<Vec<f32>> {
        Ok(match self {
            Saved::F32(v) => v,
            Saved::Bf16(v) => widened(&v),
            Saved::F16(v) => widened(&v),
            #[cfg(feature = "cuda")]
            Saved::Cuda(_) => bail!("attention: a GPU forward's saved buffer reached the CPU backward"),
        })
    }
}

/// A contiguous CPU storage's values as f32: borrowed when they are f32, widened into a
/// buffer of their own otherwise (freed by the caller when the kernel call returns).
fn f32_values<'a>(storage: &'a CpuStorage, layout: &Layout, what: &str) -> Result<Cow<'a, [f32]>> {
    let Some((start, end)) = layout.contiguous_offsets() else { bail!("attention: {what} is not contiguous") };
    Ok(match storage {
        CpuStorage::F32(data) => Cow::Borrowed(&data[start..end]),
        CpuStorage::BF16(data) => Cow::Owned(widened(&data[start..end])),
        CpuStorage::F16(data) => Cow::Owned(widened(&data[start..end])),
        CpuStorage::F64(data) => Cow::Owned(data[start..end].iter().map(|&v| v as f32).collect()),
        other => bail!("attention: {what} is {:?}; f32, bf16, f16 or f64 expected", other.dtype()),
    })
}

/// f32 values in the storage type `dtype` (moved when it is f32).
fn to_storage(values: Vec<f32>, dtype: DType) -> Result<CpuStorage> {
    Ok(match dtype {
        DType::F32 => CpuStorage::F32(values),
        DType::BF16 => CpuStorage::BF16(rounded(&values)),
        DType::F16 => CpuStorage::F16(rounded(&values)),
        DType::F64 => CpuStorage::F64(values.iter().map(|&v| f64::from(v)).collect()),
        dt => bail!("attention: {dt:?} is not supported"),
    })
}

/// Runs `f` on a tensor's values as f32: borrowed when it is a contiguous f32 CPU tensor (the
/// op's own inputs and output are in an f32 model), widened into a buffer freed on return
/// otherwise.
fn with_values<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> Result<R>) -> Result<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else { bail!("attention: only the CPU is supported") };
    f(&f32_values(cpu, layout, "a backward operand")?)
}

/// A gradient the kernel wrote in f32, as a tensor of `dtype` (the f32 buffer is moved, or
/// freed once rounded).
fn grad_tensor(values: Vec<f32>, like: &Tensor) -> Result<Tensor> {
    let (shape, dev) = (like.shape(), like.device());
    match like.dtype() {
        DType::F32 => Tensor::from_vec(values, shape, dev),
        DType::BF16 => Tensor::from_vec(rounded::<half::bf16>(&values), shape, dev),
        DType::F16 => Tensor::from_vec(rounded::<half::f16>(&values), shape, dev),
        DType::F64 => Tensor::from_vec(values.iter().map(|&v| f64::from(v)).collect::<Vec<_>>(), shape, dev),
        dt => bail!("attention: {dt:?} is not supported"),
    }
}

impl AttentionOp {
    fn plugin_error(&self, what: &str, e: ava_core::PluginError) -> candle_core::Error {
        candle_core::Error::Msg(format!("attention kernel '{}' failed in {what}: {e}", self.name))
    }

    /// The document ids for the kernel (empty without packed documents).
    fn segments(&self) -> &[u32] {
        self.segments.as_deref().unwrap_or(&[])
    }

    /// The scratch the kernel declared for one `pass` call, zero-filled.
    fn workspace(&self, pass: Pass) -> Result<Vec<f32>> {
        let len = self.kernel.workspace_len(&self.shape, pass, &self.ctx);
        Ok(vec![0f32; len.map_err(|e| self.plugin_error("workspace_len", e))? as usize])
    }

    /// The context of a device call.
    #[cfg(feature = "cuda")]
    fn cuda_ctx(&self) -> KernelContext {
        KernelContext { device: ava_core::Device::Cuda, ..self.ctx }
    }

    /// The f32 scratch the kernel declared for one `pass` device call, zero-filled, and its
    /// declared length (the allocation holds at least one element).
    #[cfg(feature = "cuda")]
    fn cuda_workspace(
        &self,
        dev: &candle_core::CudaDevice,
        pass: Pass,
    ) -> Result<(candle_core::cuda::cudarc::driver::CudaSlice<f32>, usize)> {
        let len = self.kernel.workspace_len(&self.shape, pass, &self.cuda_ctx());
        let len = len.map_err(|e| self.plugin_error("workspace_len", e))? as usize;
        Ok((dev.alloc_zeros::<f32>(len.max(1))?, len))
    }

    /// The document ids on the device (B·T u32), or none.
    #[cfg(feature = "cuda")]
    fn cuda_segments(
        &self,
        dev: &candle_core::CudaDevice,
    ) -> Result<Option<candle_core::cuda::cudarc::driver::CudaSlice<u32>>> {
        self.segments.as_deref().map(|s| dev.clone_htod(s)).transpose()
    }

    /// Backward on the GPU: `backward_cuda` into fresh gradients of the inputs' type.
    #[cfg(feature = "cuda")]
    fn cuda_bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
        saved: &candle_core::cuda::cudarc::driver::CudaSlice<f32>,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        use super::fused::{plugin_buf, plugin_stream, storage_buf, storage_tensor, zeros};
        let (q, k, v, res) = (q.contiguous()?, k.contiguous()?, v.contiguous()?, res.contiguous()?);
        let grad_res = grad_res.to_dtype(q.dtype())?.contiguous()?;
        let candle_core::Device::Cuda(dev) = q.device() else { bail!("attention: a GPU backward off the GPU") };
        let stream = dev.cuda_stream();
        let dtype = q.dtype();
        let dq = zeros(dev, dtype, q.elem_count())?; // (B, H, T, D)
        let dk = zeros(dev, dtype, k.elem_count())?; // (B, Hkv, T, D)
        let dv = zeros(dev, dtype, v.elem_count())?; // (B, Hkv, T, D)
        let (workspace, ws_len) = self.cuda_workspace(dev, Pass::Backward)?; // freed on return
        let segments = self.cuda_segments(dev)?; // (B·T,) u32
        {
            let (sq, lq) = q.storage_and_layout();
            let (sk, lk) = k.storage_and_layout();
            let (sv, lv) = v.storage_and_layout();
            let (so, lo) = res.storage_and_layout();
            let (sg, lg) = grad_res.storage_and_layout();
            let (Storage::Cuda(sq), Storage::Cuda(sk), Storage::Cuda(sv), Storage::Cuda(so), Storage::Cuda(sg)) =
                (&*sq, &*sk, &*sv, &*so, &*sg)
            else {
                bail!("attention: a GPU backward with an operand off the GPU")
            };
            let whole = |n: usize| Layout::contiguous(Shape::from(n));
            let (bq, _g1) = storage_buf(sq, lq, &stream)?;
            let (bk, _g2) = storage_buf(sk, lk, &stream)?;
            let (bv, _g3) = storage_buf(sv, lv, &stream)?;
            let (bo, _g4) = storage_buf(so, lo, &stream)?;
            let (bg, _g5) = storage_buf(sg, lg, &stream)?;
            let (bdq, _g6) = storage_buf(&dq, &whole(q.elem_count()), &stream)?;
            let (bdk, _g7) = storage_buf(&dk, &whole(k.elem_count()), &stream)?;
            let (bdv, _g8) = storage_buf(&dv, &whole(v.elem_count()), &stream)?;
            let (bs, _g9) = plugin_buf(saved, 0, saved.len(), DType::F32, &stream)?;
            let (bw, _g10) = plugin_buf(&workspace, 0, ws_len, DType::F32, &stream)?;
            let (bseg, _g11) = segments_buf(&segments, bq.ordinal, &stream)?;
            self.kernel
                .backward_cuda(
                    &self.shape,
                    &bq,
                    &bk,
                    &bv,
                    &bseg,
                    &bo,
                    &bg,
                    &bs,
                    &bdq,
                    &bdk,
                    &bdv,
                    &bw,
                    &self.cuda_ctx(),
                    &plugin_stream(dev)?,
                )
                .map_err(|e| self.plugin_error("backward_cuda", e))?;
        }
        Ok((
            Some(storage_tensor(dq, q.shape().clone())),
            Some(storage_tensor(dk, k.shape().clone())),
            Some(storage_tensor(dv, v.shape().clone())),
        ))
    }
}

/// The segment ids as the contract's buffer (empty for none on device `ordinal`), with the
/// guard to keep until the plugin call returns.
#[cfg(feature = "cuda")]
fn segments_buf<'a>(
    segments: &'a Option<candle_core::cuda::cudarc::driver::CudaSlice<u32>>,
    ordinal: u32,
    stream: &'a Arc<candle_core::cuda::cudarc::driver::CudaStream>,
) -> Result<(ava_core::device::CudaBuf, Option<candle_core::cuda::cudarc::driver::SyncOnDrop<'a>>)> {
    Ok(match segments {
        Some(s) => {
            let (buf, guard) = super::fused::plugin_buf(s, 0, s.len(), DType::U32, stream)?;
            (buf, Some(guard))
        }
        None => (ava_core::device::CudaBuf::empty(ava_core::DType::U32, ordinal), None),
    })
}

impl CustomOp3 for AttentionOp {
    fn name(&self) -> &'static str {
        "ava-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        // q, k, v (B, H|Hkv, T, D) as f32: borrowed, or widened and freed on return.
        let (q, k, v) = (f32_values(s1, l1, "q")?, f32_values(s2, l2, "k")?, f32_values(s3, l3, "v")?);
        let saved_len = self.kernel.saved_len(&self.shape).map_err(|e| self.plugin_error("saved_len", e))? as usize;
        let mut out = vec![0f32; self.shape.q_numel()]; // (B, H, T, D)
        let mut saved = vec![0f32; saved_len]; // e.g. (B, H, T, T) probabilities, or (B, H, T) logsumexp
        let mut workspace = self.workspace(Pass::Forward)?; // (workspace_len,) freed on return
        self.kernel
            .forward(&self.shape, &q, &k, &v, self.segments(), &mut out, &mut saved, &mut workspace, &self.ctx)
            .map_err(|e| self.plugin_error("forward", e))?;
        drop(workspace);
        let saved = Saved::keep(saved, s1.dtype(), self.kernel.saved_tolerates_half()); // (saved_len,)
        *self.saved.lock().expect("attention op lock") = Some(saved);
        let out = to_storage(out, s1.dtype())?; // (B, H, T, D) in q's type
        drop((q, k, v));
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        use super::fused::{plugin_buf, plugin_stream, storage_buf, zeros};
        let dev = s1.device().clone();
        let stream = dev.cuda_stream();
        let saved_len = self.kernel.saved_len(&self.shape).map_err(|e| self.plugin_error("saved_len", e))? as usize;
        let n = self.shape.q_numel();
        let out = zeros(&dev, s1.dtype(), n)?; // (B, H, T, D) in q's type
        let saved = dev.alloc_zeros::<f32>(saved_len.max(1))?; // e.g. (B, H, T) logsumexp
        let (workspace, ws_len) = self.cuda_workspace(&dev, Pass::Forward)?; // freed on return
        let segments = self.cuda_segments(&dev)?; // (B·T,) u32
        {
            let (bq, _g1) = storage_buf(s1, l1, &stream)?;
            let (bk, _g2) = storage_buf(s2, l2, &stream)?;
            let (bv, _g3) = storage_buf(s3, l3, &stream)?;
            let (bo, _g4) = storage_buf(&out, &Layout::contiguous(Shape::from(n)), &stream)?;
            let (bs, _g5) = plugin_buf(&saved, 0, saved_len, DType::F32, &stream)?;
            let (bw, _g6) = plugin_buf(&workspace, 0, ws_len, DType::F32, &stream)?;
            let (bseg, _g7) = segments_buf(&segments, bq.ordinal, &stream)?;
            self.kernel
                .forward_cuda(&self.shape, &bq, &bk, &bv, &bseg, &bo, &bs, &bw, &self.cuda_ctx(), &plugin_stream(&dev)?)
                .map_err(|e| self.plugin_error("forward_cuda", e))?;
        }
        drop(workspace);
        *self.saved.lock().expect("attention op lock") = Some(Saved::Cuda(saved));
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        if !self.kernel.supports_backward() {
            bail!("attention kernel '{}' has no backward pass; it can run inference but not training", self.name);
        }
        let Some(saved) = self.saved.lock().expect("attention op lock").take() else {
            bail!("attention kernel '{}': backward ran twice over one forward (its saved buffer is gone)", self.name);
        };
        let _span = crate::profile::scope("backward: attention kernel");
        #[cfg(feature = "cuda")]
        if let Saved::Cuda(saved) = saved {
            return self.cuda_bwd(q, k, v, res, grad_res, &saved);
        }
        let saved = saved.into_f32()?; // (saved_len,) f32, the half copy freed once widened
        let mut dq = vec![0f32; q.elem_count()]; // (B, H, T, D)
        let mut dk = vec![0f32; k.elem_count()]; // (B, Hkv, T, D)
        let mut dv = vec![0f32; v.elem_count()]; // (B, Hkv, T, D)
        let mut workspace = self.workspace(Pass::Backward)?; // (workspace_len,) freed on return
        with_values(q, |qv| {
            with_values(k, |kv| {
                with_values(v, |vv| {
                    with_values(res, |out| {
                        with_values(grad_res, |dout| {
                            self.kernel
                                .backward(
                                    &self.shape,
                                    qv,
                                    kv,
                                    vv,
                                    self.segments(),
                                    out,
                                    dout,
                                    &saved,
                                    &mut dq,
                                    &mut dk,
                                    &mut dv,
                                    &mut workspace,
                                    &self.ctx,
                                )
                                .map_err(|e| self.plugin_error("backward", e))
                        })
                    })
                })
            })
        })?;
        drop(workspace);
        drop(saved);
        // Each gradient in its input's type, the f32 one freed as soon as it is rounded.
        Ok((Some(grad_tensor(dq, q)?), Some(grad_tensor(dk, k)?), Some(grad_tensor(dv, v)?)))
    }
}
