//! The attention kernel plugin inside candle's autograd: a `CustomOp3` over (q, k, v).
//!
//! A fresh op is made per call. Its forward allocates the output and the buffer the kernel
//! asked to save (`saved_len`) on the host, so both are counted by the allocator; the op
//! holds the saved buffer until backward, which takes it (freeing it as soon as it has been
//! used) and calls the kernel's backward on detached, contiguous copies of the inputs. Each
//! call also gets the workspace the kernel declared for it (`workspace_len`), allocated here
//! so the allocator counts it, and freed as soon as the call returns.

use std::sync::{Arc, Mutex};

use ava_core::{AttentionKernel, AttnShape, KernelContext, Pass};
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Storage, Tensor, bail};

/// Causal self-attention through `kernel`: q (B, H, T, D), k and v (B, Hkv, T, D), any
/// float type (the kernel computes in f32). Returns (B, H, T, D) in q's type.
pub fn attention(
    kernel: &Arc<dyn AttentionKernel>,
    name: &str,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
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
    let dtype = q.dtype();
    let f32c = |x: &Tensor| -> Result<Tensor> { x.to_dtype(DType::F32)?.contiguous() };
    let op = AttentionOp {
        kernel: kernel.clone(),
        name: name.to_string(),
        shape,
        ctx: KernelContext { threads: threads.max(1) as u32, ..KernelContext::default() },
        saved: Mutex::new(None),
    };
    f32c(q)?.apply_op3(&f32c(k)?, &f32c(v)?, op)?.to_dtype(dtype)
}

/// One attention call: the kernel, the shape, and what forward saved for backward.
struct AttentionOp {
    kernel: Arc<dyn AttentionKernel>,
    name: String,
    shape: AttnShape,
    ctx: KernelContext,
    saved: Mutex<Option<Vec<f32>>>, // (saved_len,) as the kernel declared
}

/// The f32 elements of a contiguous CPU storage.
fn slice<'a>(storage: &'a CpuStorage, layout: &Layout, what: &str) -> Result<&'a [f32]> {
    let Some((start, end)) = layout.contiguous_offsets() else { bail!("attention: {what} is not contiguous") };
    match storage {
        CpuStorage::F32(data) => Ok(&data[start..end]),
        _ => bail!("attention: {what} must be f32"),
    }
}

/// Runs `f` on a tensor's f32 values: borrowed when it is a contiguous f32 CPU tensor (the
/// op's own inputs and output are), copied out otherwise.
fn with_values<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> Result<R>) -> Result<R> {
    {
        let (storage, layout) = t.storage_and_layout();
        if let (Storage::Cpu(CpuStorage::F32(data)), Some((start, end))) = (&*storage, layout.contiguous_offsets()) {
            return f(&data[start..end]);
        }
    }
    f(&t.detach().to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}

impl AttentionOp {
    fn plugin_error(&self, what: &str, e: ava_core::PluginError) -> candle_core::Error {
        candle_core::Error::Msg(format!("attention kernel '{}' failed in {what}: {e}", self.name))
    }

    /// The scratch the kernel declared for one `pass` call, zero-filled.
    fn workspace(&self, pass: Pass) -> Result<Vec<f32>> {
        let len = self.kernel.workspace_len(&self.shape, pass, &self.ctx);
        Ok(vec![0f32; len.map_err(|e| self.plugin_error("workspace_len", e))? as usize])
    }
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
        let (q, k, v) = (slice(s1, l1, "q")?, slice(s2, l2, "k")?, slice(s3, l3, "v")?);
        let saved_len = self.kernel.saved_len(&self.shape).map_err(|e| self.plugin_error("saved_len", e))? as usize;
        let mut out = vec![0f32; self.shape.q_numel()]; // (B, H, T, D)
        let mut saved = vec![0f32; saved_len]; // e.g. (B, H, T, T) probabilities, or (B, H, T) logsumexp
        let mut workspace = self.workspace(Pass::Forward)?; // (workspace_len,) freed on return
        self.kernel
            .forward(&self.shape, q, k, v, &mut out, &mut saved, &mut workspace, &self.ctx)
            .map_err(|e| self.plugin_error("forward", e))?;
        drop(workspace);
        *self.saved.lock().expect("attention op lock") = Some(saved);
        Ok((CpuStorage::F32(out), l1.shape().clone()))
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
        let dev = q.device();
        Ok((
            Some(Tensor::from_vec(dq, q.shape(), dev)?),
            Some(Tensor::from_vec(dk, k.shape(), dev)?),
            Some(Tensor::from_vec(dv, v.shape(), dev)?),
        ))
    }
}
