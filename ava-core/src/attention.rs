//! The [`AttentionKernel`] trait: scaled dot-product attention over host buffers.
//!
//! All tensors are contiguous f32 in `(batch, heads, seq, head_dim)` order. Query heads may
//! outnumber key/value heads (grouped-query attention): query head `h` reads key/value head
//! `h / (q_heads / kv_heads)`. The kernel declares how many f32s it saves for backward
//! ([`AttentionKernel::saved_len`]); the host allocates that buffer and keeps it alive
//! between forward and backward, so it is counted in the memory breakdown. Scratch a call
//! needs while it runs (flash's per-thread score tiles) is declared the same way
//! ([`AttentionKernel::workspace_len`]): the host allocates it for the call and frees it
//! when the call returns, so it is counted too and the kernel allocates nothing big itself.
//!
//! Packed documents (`data.packing: document`) reach a kernel as segment ids: one `u32` per
//! key position of each sequence, the same id for the positions of one document, so a query
//! sees only the keys of its own document (as Llama 3 was trained). Only a kernel that says
//! it [supports them](AttentionKernel::supports_segments) is handed any; the host refuses the
//! others by name before a run starts.
//!
//! On a CUDA run the host calls [`AttentionKernel::forward_cuda`] and
//! [`AttentionKernel::backward_cuda`] instead, with the same buffers in device memory
//! ([`CudaBuf`]) and a stream to launch on ([`CudaStream`]); see [`crate::device`] for the
//! rules of a device call. Only a kernel whose manifest lists [`Device::Cuda`] is called
//! there.

#![allow(clippy::too_many_arguments, clippy::type_complexity)] // a kernel takes q, k, v, out, dout, saved, dq, dk, dv

use abi_stable::{
    StableAbi, sabi_trait,
    std_types::{RBox, RResult, RSlice, RSliceMut},
};

use crate::{
    Device, PluginError,
    device::{CudaBuf, CudaStream},
    error::expect_len,
    ffi::guard,
};

/// The shape and mask of one attention call.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq)]
pub struct AttnShape {
    /// Batch size B.
    pub batch: u32,
    /// Query heads H.
    pub q_heads: u32,
    /// Key/value heads (divides `q_heads`).
    pub kv_heads: u32,
    /// Query length Tq.
    pub q_len: u32,
    /// Key/value length Tk.
    pub kv_len: u32,
    /// Head dimension D.
    pub head_dim: u32,
    /// Causal mask: query `i` sees keys `j <= i + (kv_len - q_len)`.
    pub causal: bool,
    /// Score scale, usually `1 / sqrt(head_dim)`.
    pub scale: f32,
}

impl AttnShape {
    /// Self-attention with `q_len == kv_len`, scale `1/sqrt(D)`.
    pub fn self_attention(
        batch: usize,
        q_heads: usize,
        kv_heads: usize,
        seq: usize,
        head_dim: usize,
        causal: bool,
    ) -> Self {
        Self {
            batch: batch as u32,
            q_heads: q_heads as u32,
            kv_heads: kv_heads as u32,
            q_len: seq as u32,
            kv_len: seq as u32,
            head_dim: head_dim as u32,
            causal,
            scale: 1.0 / (head_dim as f32).sqrt(),
        }
    }
    /// Elements of Q and of the output: B·H·Tq·D.
    pub fn q_numel(&self) -> usize {
        self.batch as usize * self.q_heads as usize * self.q_len as usize * self.head_dim as usize
    }
    /// Elements of K (and of V): B·Hkv·Tk·D.
    pub fn kv_numel(&self) -> usize {
        self.batch as usize * self.kv_heads as usize * self.kv_len as usize * self.head_dim as usize
    }
    /// Query heads per key/value head.
    pub fn group(&self) -> usize {
        (self.q_heads / self.kv_heads.max(1)) as usize
    }
    /// Checks the shape's own consistency.
    pub fn validate(&self) -> Result<(), PluginError> {
        if self.batch == 0 || self.q_heads == 0 || self.kv_heads == 0 || self.head_dim == 0 {
            return Err(PluginError::invalid_input(format!("attention shape has a zero dimension: {self:?}")));
        }
        if !self.q_heads.is_multiple_of(self.kv_heads) {
            return Err(PluginError::invalid_input(format!(
                "q_heads ({}) must be a multiple of kv_heads ({})",
                self.q_heads, self.kv_heads
            )));
        }
        if self.kv_len == 0 && self.q_len > 0 {
            return Err(PluginError::invalid_input("attention over zero keys (kv_len = 0) is undefined"));
        }
        if self.causal && self.q_len > self.kv_len {
            return Err(PluginError::invalid_input(format!(
                "causal attention needs q_len ({}) <= kv_len ({})",
                self.q_len, self.kv_len
            )));
        }
        Ok(())
    }
    /// Checks the shape and the lengths of q, k, v and out.
    pub fn check_buffers(&self, q: usize, k: usize, v: usize, out: usize) -> Result<(), PluginError> {
        self.validate()?;
        expect_len("q", q, self.q_numel())?;
        expect_len("k", k, self.kv_numel())?;
        expect_len("v", v, self.kv_numel())?;
        expect_len("out", out, self.q_numel())
    }

    /// Checks the shape can take packed-document segments: they give one id per key position,
    /// and query i's document is the id at its own position, the last Tq of the Tk (i + Tk −
    /// Tq), so there cannot be more queries than keys.
    pub fn check_segmented(&self) -> Result<(), PluginError> {
        if self.q_len > self.kv_len {
            return Err(PluginError::invalid_input(format!(
                "packed-document segments give one id per key position and the queries are the last of them, but \
                 q_len ({}) is more than kv_len ({}); attend without segments, or over as many keys as queries",
                self.q_len, self.kv_len
            )));
        }
        Ok(())
    }

    /// Checks segment ids: none, or B·Tk of them, non-decreasing along each sequence (a
    /// document is one run of positions, which is what lets kernels treat it as an interval).
    pub fn check_segments(&self, segments: &[u32]) -> Result<(), PluginError> {
        if segments.is_empty() {
            return Ok(());
        }
        self.check_segmented()?;
        let tk = self.kv_len as usize;
        expect_len("segments", segments.len(), self.batch as usize * tk)?;
        for (b, row) in segments.chunks_exact(tk.max(1)).enumerate() {
            if let Some(j) = row.windows(2).position(|w| w[1] < w[0]) {
                return Err(PluginError::invalid_input(format!(
                    "segment ids of sequence {b} decrease at position {} ({} after {}): a document must be one run \
                     of positions",
                    j + 1,
                    row[j + 1],
                    row[j]
                )));
            }
        }
        Ok(())
    }
}

/// Which call of a kernel a workspace is for.
#[repr(u8)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Pass {
    /// [`AttentionKernel::forward`] (and [`AttentionKernel::forward_cuda`]).
    Forward = 0,
    /// [`AttentionKernel::backward`] (and [`AttentionKernel::backward_cuda`]).
    Backward = 1,
}

impl Pass {
    /// Lowercase name.
    pub fn as_str(self) -> &'static str {
        match self {
            Pass::Forward => "forward",
            Pass::Backward => "backward",
        }
    }
}

/// Per-call context from the host.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelContext {
    /// Threads the kernel may use.
    pub threads: u32,
    /// Where the buffers live: `Cpu` for [`forward`](AttentionKernel::forward) and
    /// [`backward`](AttentionKernel::backward), `Cuda` for
    /// [`forward_cuda`](AttentionKernel::forward_cuda) and
    /// [`backward_cuda`](AttentionKernel::backward_cuda). In
    /// [`workspace_len`](AttentionKernel::workspace_len) it says which of the two the
    /// workspace is for, so a kernel may declare different scratch on each.
    pub device: Device,
}

impl Default for KernelContext {
    fn default() -> Self {
        Self { threads: 1, device: Device::Cpu }
    }
}

/// An attention kernel. Forward is required; backward is optional, and the engine refuses
/// to train with a kernel whose [`supports_backward`](Self::supports_backward) is false.
pub trait AttentionKernel: Send + Sync {
    /// f32 elements the kernel saves in forward for backward (standard: the B·H·Tq·Tk
    /// probabilities; flash: one logsumexp per query row). Also refuses unsupported shapes.
    fn saved_len(&self, shape: &AttnShape) -> Result<u64, PluginError>;

    /// f32 elements of scratch one `pass` call of `shape` needs with `ctx.threads` threads
    /// (flash: score and transposed-key tiles per thread). The host allocates exactly this
    /// many (counted in the memory breakdown and by `ava estimate`), hands them to the call as
    /// `workspace` with unspecified contents, and frees them when it returns: nothing in it
    /// survives to the next call (what backward needs from forward goes in `saved`).
    /// Default: none.
    fn workspace_len(&self, shape: &AttnShape, pass: Pass, ctx: &KernelContext) -> Result<u64, PluginError> {
        let _ = (shape, pass, ctx);
        Ok(0)
    }

    /// Computes `out` (B, H, Tq, D) and fills `saved` (`saved_len` elements); `workspace`
    /// is the forward's declared scratch. `segments` is empty, or (for a kernel that
    /// [`supports_segments`](Self::supports_segments)) B·Tk segment ids, non-decreasing along
    /// each sequence: the query at position `p = i + Tk − Tq` of sequence `b` then sees key
    /// `j` only if `segments[b·Tk + j] == segments[b·Tk + p]`, on top of its own mask.
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        shape: &AttnShape,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        segments: &[u32],
        out: &mut [f32],
        saved: &mut [f32],
        workspace: &mut [f32],
        ctx: &KernelContext,
    ) -> Result<(), PluginError>;

    /// Whether [`backward`](Self::backward) is implemented.
    fn supports_backward(&self) -> bool {
        false
    }

    /// Whether the kernel honours segment ids (packed documents; see
    /// [`forward`](Self::forward)). The default, no, makes the host refuse
    /// `data.packing: document` with this kernel by name rather than hand it ids it would
    /// ignore.
    fn supports_segments(&self) -> bool {
        false
    }

    /// Whether the saved buffer tolerates being held rounded to the run's half type: when
    /// training in bf16 or f16, the host then keeps it between forward and backward in that
    /// type (half the bytes) and widens it back to f32 for the backward call. Say yes for
    /// values that tolerate rounding as activations do (standard's probabilities, in [0, 1]);
    /// keep the default, no, for values whose error backward amplifies (flash's logsumexp
    /// feeds exp(s - lse)). In f32 runs the buffer is always kept as written.
    fn saved_tolerates_half(&self) -> bool {
        false
    }

    /// Writes (overwrites) `dq`, `dk`, `dv` from `dout`, using what forward saved;
    /// `workspace` is the backward's declared scratch, `segments` the forward's.
    #[allow(clippy::too_many_arguments)]
    fn backward(
        &self,
        shape: &AttnShape,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        segments: &[u32],
        out: &[f32],
        dout: &[f32],
        saved: &[f32],
        dq: &mut [f32],
        dk: &mut [f32],
        dv: &mut [f32],
        workspace: &mut [f32],
        ctx: &KernelContext,
    ) -> Result<(), PluginError> {
        let _ = (shape, q, k, v, segments, out, dout, saved, dq, dk, dv, workspace, ctx);
        Err(PluginError::unsupported("this attention kernel has no backward pass; it can run inference only"))
    }

    /// [`forward`](Self::forward) on a CUDA device, launched on `stream` (see
    /// [`crate::device`] for the rules of a device call: host-owned memory, launch only on
    /// `stream`, never synchronize).
    ///
    /// `q`, `k`, `v` and `out` are of one dtype, bf16, f16 or f32 (the run's compute type;
    /// the same for every buffer of one call), with the lengths of [`forward`](Self::forward);
    /// `saved` is f32 of [`saved_len`](Self::saved_len) elements, `workspace` f32 of
    /// [`workspace_len`](Self::workspace_len) elements (asked with `ctx.device == Cuda`).
    /// `segments` is u32: empty (`len == 0`) for none, else the B·Tk ids described at
    /// [`forward`](Self::forward), only for a kernel that
    /// [`supports_segments`](Self::supports_segments). Every buffer is on device
    /// `stream.ordinal`; `ctx.device` is `Cuda`. [`CudaBuf::expect`] checks one.
    ///
    /// Called only for a kernel whose manifest lists [`Device::Cuda`], which promises this
    /// method. The default refuses.
    fn forward_cuda(
        &self,
        shape: &AttnShape,
        q: &CudaBuf,
        k: &CudaBuf,
        v: &CudaBuf,
        segments: &CudaBuf,
        out: &CudaBuf,
        saved: &CudaBuf,
        workspace: &CudaBuf,
        ctx: &KernelContext,
        stream: &CudaStream,
    ) -> Result<(), PluginError> {
        let _ = (shape, q, k, v, segments, out, saved, workspace, ctx, stream);
        Err(PluginError::unsupported(
            "this attention kernel has no CUDA forward pass (AttentionKernel::forward_cuda): its manifest must not \
             list the cuda device",
        ))
    }

    /// [`backward`](Self::backward) on a CUDA device, launched on `stream`: writes
    /// (overwrites) `dq`, `dk`, `dv` from `dout`, using what
    /// [`forward_cuda`](Self::forward_cuda) saved. `q`, `k`, `v`, `out`, `dout`, `dq`, `dk`
    /// and `dv` are of the forward's dtype (bf16, f16 or f32); `saved` is f32 as written by
    /// the forward; `workspace` is the backward's declared f32 scratch; `segments` the
    /// forward's. Every buffer is on device `stream.ordinal`; `ctx.device` is `Cuda`.
    ///
    /// A kernel whose manifest lists [`Device::Cuda`] and which
    /// [`supports_backward`](Self::supports_backward) promises this method. The default
    /// refuses.
    fn backward_cuda(
        &self,
        shape: &AttnShape,
        q: &CudaBuf,
        k: &CudaBuf,
        v: &CudaBuf,
        segments: &CudaBuf,
        out: &CudaBuf,
        dout: &CudaBuf,
        saved: &CudaBuf,
        dq: &CudaBuf,
        dk: &CudaBuf,
        dv: &CudaBuf,
        workspace: &CudaBuf,
        ctx: &KernelContext,
        stream: &CudaStream,
    ) -> Result<(), PluginError> {
        let _ = (shape, q, k, v, segments, out, dout, saved, dq, dk, dv, workspace, ctx, stream);
        Err(PluginError::unsupported(
            "this attention kernel has no CUDA backward pass (AttentionKernel::backward_cuda): it cannot train on the \
             GPU",
        ))
    }
}

/// The FFI-safe form of [`AttentionKernel`].
#[sabi_trait]
pub trait FfiAttention: Send + Sync {
    /// See [`AttentionKernel::saved_len`].
    fn saved_len(&self, shape: AttnShape) -> RResult<u64, PluginError>;
    /// See [`AttentionKernel::workspace_len`].
    fn workspace_len(&self, shape: AttnShape, pass: Pass, ctx: KernelContext) -> RResult<u64, PluginError>;
    /// See [`AttentionKernel::forward`].
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        shape: AttnShape,
        q: RSlice<'_, f32>,
        k: RSlice<'_, f32>,
        v: RSlice<'_, f32>,
        segments: RSlice<'_, u32>,
        out: RSliceMut<'_, f32>,
        saved: RSliceMut<'_, f32>,
        workspace: RSliceMut<'_, f32>,
        ctx: KernelContext,
    ) -> RResult<(), PluginError>;
    /// See [`AttentionKernel::supports_backward`].
    fn supports_backward(&self) -> bool;
    /// See [`AttentionKernel::supports_segments`].
    fn supports_segments(&self) -> bool;
    /// See [`AttentionKernel::saved_tolerates_half`].
    fn saved_tolerates_half(&self) -> bool;
    /// See [`AttentionKernel::backward`].
    #[allow(clippy::too_many_arguments)]
    fn backward(
        &self,
        shape: AttnShape,
        q: RSlice<'_, f32>,
        k: RSlice<'_, f32>,
        v: RSlice<'_, f32>,
        segments: RSlice<'_, u32>,
        out: RSlice<'_, f32>,
        dout: RSlice<'_, f32>,
        saved: RSlice<'_, f32>,
        dq: RSliceMut<'_, f32>,
        dk: RSliceMut<'_, f32>,
        dv: RSliceMut<'_, f32>,
        workspace: RSliceMut<'_, f32>,
        ctx: KernelContext,
    ) -> RResult<(), PluginError>;
    /// See [`AttentionKernel::forward_cuda`].
    #[allow(clippy::too_many_arguments)]
    fn forward_cuda(
        &self,
        shape: AttnShape,
        q: CudaBuf,
        k: CudaBuf,
        v: CudaBuf,
        segments: CudaBuf,
        out: CudaBuf,
        saved: CudaBuf,
        workspace: CudaBuf,
        ctx: KernelContext,
        stream: CudaStream,
    ) -> RResult<(), PluginError>;
    /// See [`AttentionKernel::backward_cuda`].
    #[allow(clippy::too_many_arguments)]
    fn backward_cuda(
        &self,
        shape: AttnShape,
        q: CudaBuf,
        k: CudaBuf,
        v: CudaBuf,
        segments: CudaBuf,
        out: CudaBuf,
        dout: CudaBuf,
        saved: CudaBuf,
        dq: CudaBuf,
        dk: CudaBuf,
        dv: CudaBuf,
        workspace: CudaBuf,
        ctx: KernelContext,
        stream: CudaStream,
    ) -> RResult<(), PluginError>;
}

/// A boxed attention kernel from a plugin library.
pub type AttentionBox = FfiAttention_TO<'static, RBox<()>>;

pub(crate) struct Guarded<T>(pub T);

impl<T: AttentionKernel> FfiAttention for Guarded<T> {
    fn saved_len(&self, shape: AttnShape) -> RResult<u64, PluginError> {
        guard("AttentionKernel::saved_len", || self.0.saved_len(&shape))
    }
    fn workspace_len(&self, shape: AttnShape, pass: Pass, ctx: KernelContext) -> RResult<u64, PluginError> {
        guard("AttentionKernel::workspace_len", || self.0.workspace_len(&shape, pass, &ctx))
    }
    fn forward(
        &self,
        shape: AttnShape,
        q: RSlice<'_, f32>,
        k: RSlice<'_, f32>,
        v: RSlice<'_, f32>,
        segments: RSlice<'_, u32>,
        mut out: RSliceMut<'_, f32>,
        mut saved: RSliceMut<'_, f32>,
        mut workspace: RSliceMut<'_, f32>,
        ctx: KernelContext,
    ) -> RResult<(), PluginError> {
        guard("AttentionKernel::forward", || {
            let (out, saved, workspace) = (out.as_mut_slice(), saved.as_mut_slice(), workspace.as_mut_slice());
            self.0.forward(&shape, &q, &k, &v, &segments, out, saved, workspace, &ctx)
        })
    }
    fn supports_backward(&self) -> bool {
        // A panic here would abort; a kernel that panics in a bool getter gets "no backward".
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.0.supports_backward())).unwrap_or(false)
    }
    fn saved_tolerates_half(&self) -> bool {
        // As above: a panic means no (the buffer is kept as written).
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.0.saved_tolerates_half())).unwrap_or(false)
    }
    fn supports_segments(&self) -> bool {
        // As above: a panic means no (the host refuses packed documents with this kernel).
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.0.supports_segments())).unwrap_or(false)
    }
    fn backward(
        &self,
        shape: AttnShape,
        q: RSlice<'_, f32>,
        k: RSlice<'_, f32>,
        v: RSlice<'_, f32>,
        segments: RSlice<'_, u32>,
        out: RSlice<'_, f32>,
        dout: RSlice<'_, f32>,
        saved: RSlice<'_, f32>,
        mut dq: RSliceMut<'_, f32>,
        mut dk: RSliceMut<'_, f32>,
        mut dv: RSliceMut<'_, f32>,
        mut workspace: RSliceMut<'_, f32>,
        ctx: KernelContext,
    ) -> RResult<(), PluginError> {
        guard("AttentionKernel::backward", || {
            self.0.backward(
                &shape,
                &q,
                &k,
                &v,
                &segments,
                &out,
                &dout,
                &saved,
                dq.as_mut_slice(),
                dk.as_mut_slice(),
                dv.as_mut_slice(),
                workspace.as_mut_slice(),
                &ctx,
            )
        })
    }
    fn forward_cuda(
        &self,
        shape: AttnShape,
        q: CudaBuf,
        k: CudaBuf,
        v: CudaBuf,
        segments: CudaBuf,
        out: CudaBuf,
        saved: CudaBuf,
        workspace: CudaBuf,
        ctx: KernelContext,
        stream: CudaStream,
    ) -> RResult<(), PluginError> {
        guard("AttentionKernel::forward_cuda", || {
            self.0.forward_cuda(&shape, &q, &k, &v, &segments, &out, &saved, &workspace, &ctx, &stream)
        })
    }
    fn backward_cuda(
        &self,
        shape: AttnShape,
        q: CudaBuf,
        k: CudaBuf,
        v: CudaBuf,
        segments: CudaBuf,
        out: CudaBuf,
        dout: CudaBuf,
        saved: CudaBuf,
        dq: CudaBuf,
        dk: CudaBuf,
        dv: CudaBuf,
        workspace: CudaBuf,
        ctx: KernelContext,
        stream: CudaStream,
    ) -> RResult<(), PluginError> {
        guard("AttentionKernel::backward_cuda", || {
            self.0.backward_cuda(
                &shape, &q, &k, &v, &segments, &out, &dout, &saved, &dq, &dk, &dv, &workspace, &ctx, &stream,
            )
        })
    }
}

/// Host side: a plugin's kernel behind the Rust trait.
pub struct ForeignAttention(pub AttentionBox);

impl AttentionKernel for ForeignAttention {
    fn saved_len(&self, shape: &AttnShape) -> Result<u64, PluginError> {
        self.0.saved_len(*shape).into_result()
    }
    fn workspace_len(&self, shape: &AttnShape, pass: Pass, ctx: &KernelContext) -> Result<u64, PluginError> {
        self.0.workspace_len(*shape, pass, *ctx).into_result()
    }
    fn forward(
        &self,
        shape: &AttnShape,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        segments: &[u32],
        out: &mut [f32],
        saved: &mut [f32],
        workspace: &mut [f32],
        ctx: &KernelContext,
    ) -> Result<(), PluginError> {
        self.0
            .forward(
                *shape,
                q.into(),
                k.into(),
                v.into(),
                segments.into(),
                out.into(),
                saved.into(),
                workspace.into(),
                *ctx,
            )
            .into_result()
    }
    fn supports_backward(&self) -> bool {
        self.0.supports_backward()
    }
    fn supports_segments(&self) -> bool {
        self.0.supports_segments()
    }
    fn saved_tolerates_half(&self) -> bool {
        self.0.saved_tolerates_half()
    }
    fn backward(
        &self,
        shape: &AttnShape,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        segments: &[u32],
        out: &[f32],
        dout: &[f32],
        saved: &[f32],
        dq: &mut [f32],
        dk: &mut [f32],
        dv: &mut [f32],
        workspace: &mut [f32],
        ctx: &KernelContext,
    ) -> Result<(), PluginError> {
        self.0
            .backward(
                *shape,
                q.into(),
                k.into(),
                v.into(),
                segments.into(),
                out.into(),
                dout.into(),
                saved.into(),
                dq.into(),
                dk.into(),
                dv.into(),
                workspace.into(),
                *ctx,
            )
            .into_result()
    }
    fn forward_cuda(
        &self,
        shape: &AttnShape,
        q: &CudaBuf,
        k: &CudaBuf,
        v: &CudaBuf,
        segments: &CudaBuf,
        out: &CudaBuf,
        saved: &CudaBuf,
        workspace: &CudaBuf,
        ctx: &KernelContext,
        stream: &CudaStream,
    ) -> Result<(), PluginError> {
        self.0.forward_cuda(*shape, *q, *k, *v, *segments, *out, *saved, *workspace, *ctx, *stream).into_result()
    }
    fn backward_cuda(
        &self,
        shape: &AttnShape,
        q: &CudaBuf,
        k: &CudaBuf,
        v: &CudaBuf,
        segments: &CudaBuf,
        out: &CudaBuf,
        dout: &CudaBuf,
        saved: &CudaBuf,
        dq: &CudaBuf,
        dk: &CudaBuf,
        dv: &CudaBuf,
        workspace: &CudaBuf,
        ctx: &KernelContext,
        stream: &CudaStream,
    ) -> Result<(), PluginError> {
        self.0
            .backward_cuda(*shape, *q, *k, *v, *segments, *out, *dout, *saved, *dq, *dk, *dv, *workspace, *ctx, *stream)
            .into_result()
    }
}

#[cfg(test)]
mod tests {
    use abi_stable::sabi_trait::TD_Opaque;

    use super::*;

    /// A kernel that keeps the default answer to `saved_tolerates_half`.
    struct Quiet;

    /// A kernel that answers it (`Some`), or panics in it (`None`).
    struct Says(Option<bool>);

    macro_rules! no_op_kernel {
        ($t:ty $(, $extra:item)?) => {
            impl AttentionKernel for $t {
                fn saved_len(&self, _: &AttnShape) -> Result<u64, PluginError> {
                    Ok(0)
                }
                fn forward(
                    &self,
                    _: &AttnShape,
                    _: &[f32],
                    _: &[f32],
                    _: &[f32],
                    _: &[u32],
                    _: &mut [f32],
                    _: &mut [f32],
                    _: &mut [f32],
                    _: &KernelContext,
                ) -> Result<(), PluginError> {
                    Ok(())
                }
                $($extra)?
            }
        };
    }
    no_op_kernel!(Quiet);
    no_op_kernel!(
        Says,
        fn saved_tolerates_half(&self) -> bool {
            self.0.expect("a kernel that panics in its getter")
        }
    );

    /// A kernel that takes segment ids and writes them to its output, to see what crossed.
    struct Echo;

    impl AttentionKernel for Echo {
        fn saved_len(&self, _: &AttnShape) -> Result<u64, PluginError> {
            Ok(0)
        }
        fn forward(
            &self,
            shape: &AttnShape,
            _: &[f32],
            _: &[f32],
            _: &[f32],
            segments: &[u32],
            out: &mut [f32],
            _: &mut [f32],
            _: &mut [f32],
            _: &KernelContext,
        ) -> Result<(), PluginError> {
            shape.check_segments(segments)?;
            for (o, &s) in out.iter_mut().zip(segments) {
                *o = s as f32;
            }
            Ok(())
        }
        fn supports_segments(&self) -> bool {
            true
        }
    }

    fn foreign<K: AttentionKernel + 'static>(k: K) -> ForeignAttention {
        ForeignAttention(FfiAttention_TO::from_value(Guarded(k), TD_Opaque))
    }

    /// Through the FFI object, as the host sees a loaded plugin: the kernel's answer, the
    /// default's (no), and no when the getter panics.
    #[test]
    fn saved_tolerates_half_crosses_the_boundary() {
        assert!(foreign(Says(Some(true))).saved_tolerates_half());
        assert!(!foreign(Says(Some(false))).saved_tolerates_half());
        assert!(!foreign(Quiet).saved_tolerates_half());
        assert!(!foreign(Says(None)).saved_tolerates_half());
    }

    /// The capability and the ids cross the boundary; a kernel that does not say keeps the
    /// default, no.
    #[test]
    fn segments_cross_the_boundary() {
        assert!(!foreign(Quiet).supports_segments());
        let echo = foreign(Echo);
        assert!(echo.supports_segments());
        let s = AttnShape::self_attention(2, 1, 1, 3, 1, true);
        let mut out = vec![0.0; 6];
        echo.forward(
            &s,
            &[0.0; 6],
            &[0.0; 6],
            &[0.0; 6],
            &[0, 0, 1, 4, 4, 4],
            &mut out,
            &mut [],
            &mut [],
            &KernelContext::default(),
        )
        .unwrap();
        assert_eq!(out, [0.0, 0.0, 1.0, 4.0, 4.0, 4.0]);
    }

    /// What a CUDA call received: the pass, the buffers in argument order, the stream.
    type SeenCuda = (Pass, Vec<CudaBuf>, KernelContext, CudaStream);

    /// A kernel with CUDA passes that record what crossed (and panic on a zero stream).
    #[derive(Default)]
    struct OnCuda(std::sync::Arc<std::sync::Mutex<Vec<SeenCuda>>>);

    impl AttentionKernel for OnCuda {
        fn saved_len(&self, _: &AttnShape) -> Result<u64, PluginError> {
            Ok(0)
        }
        fn forward(
            &self,
            _: &AttnShape,
            _: &[f32],
            _: &[f32],
            _: &[f32],
            _: &[u32],
            _: &mut [f32],
            _: &mut [f32],
            _: &mut [f32],
            _: &KernelContext,
        ) -> Result<(), PluginError> {
            Ok(())
        }
        fn forward_cuda(
            &self,
            shape: &AttnShape,
            q: &CudaBuf,
            k: &CudaBuf,
            v: &CudaBuf,
            segments: &CudaBuf,
            out: &CudaBuf,
            saved: &CudaBuf,
            workspace: &CudaBuf,
            ctx: &KernelContext,
            stream: &CudaStream,
        ) -> Result<(), PluginError> {
            assert!(stream.handle != 0, "no stream");
            q.expect("q", q.dtype, shape.q_numel())?;
            let bufs = vec![*q, *k, *v, *segments, *out, *saved, *workspace];
            self.0.lock().unwrap().push((Pass::Forward, bufs, *ctx, *stream));
            Ok(())
        }
        fn backward_cuda(
            &self,
            _: &AttnShape,
            q: &CudaBuf,
            k: &CudaBuf,
            v: &CudaBuf,
            segments: &CudaBuf,
            out: &CudaBuf,
            dout: &CudaBuf,
            saved: &CudaBuf,
            dq: &CudaBuf,
            dk: &CudaBuf,
            dv: &CudaBuf,
            workspace: &CudaBuf,
            ctx: &KernelContext,
            stream: &CudaStream,
        ) -> Result<(), PluginError> {
            let bufs = vec![*q, *k, *v, *segments, *out, *dout, *saved, *dq, *dk, *dv, *workspace];
            self.0.lock().unwrap().push((Pass::Backward, bufs, *ctx, *stream));
            Ok(())
        }
    }

    /// Both CUDA passes cross the boundary with every buffer in place; the defaults refuse
    /// naming the pass; a panic is caught naming the method.
    #[test]
    fn cuda_passes_cross_the_boundary() {
        use crate::DType;

        let s = AttnShape::self_attention(1, 2, 1, 4, 8, true);
        let buf = |i: u64, len: usize, dtype: DType| CudaBuf { ptr: 0x1000 * i, len: len as u64, dtype, ordinal: 3 };
        let (q, k, v) =
            (buf(1, s.q_numel(), DType::BF16), buf(2, s.kv_numel(), DType::BF16), buf(3, s.kv_numel(), DType::BF16));
        let segments = CudaBuf::empty(DType::U32, 3);
        let (out, saved, ws) = (buf(4, s.q_numel(), DType::BF16), buf(5, 8, DType::F32), buf(6, 0, DType::F32));
        let (dout, dq, dk, dv) = (
            buf(7, s.q_numel(), DType::BF16),
            buf(8, s.q_numel(), DType::BF16),
            buf(9, s.kv_numel(), DType::BF16),
            buf(10, s.kv_numel(), DType::BF16),
        );
        let ctx = KernelContext { threads: 1, device: Device::Cuda };
        let stream = CudaStream { handle: 0xabc, ordinal: 3 };

        let quiet = foreign(Quiet);
        let e = quiet.forward_cuda(&s, &q, &k, &v, &segments, &out, &saved, &ws, &ctx, &stream).unwrap_err();
        assert_eq!(e.kind, crate::ErrorKind::Unsupported);
        assert_eq!(
            e.message.as_str(),
            "this attention kernel has no CUDA forward pass (AttentionKernel::forward_cuda): its manifest must not \
             list the cuda device"
        );
        let e = quiet
            .backward_cuda(&s, &q, &k, &v, &segments, &out, &dout, &saved, &dq, &dk, &dv, &ws, &ctx, &stream)
            .unwrap_err();
        assert_eq!(e.kind, crate::ErrorKind::Unsupported);
        assert_eq!(
            e.message.as_str(),
            "this attention kernel has no CUDA backward pass (AttentionKernel::backward_cuda): it cannot train on the \
             GPU"
        );

        let kernel = OnCuda::default();
        let seen = kernel.0.clone();
        let f = foreign(kernel);
        f.forward_cuda(&s, &q, &k, &v, &segments, &out, &saved, &ws, &ctx, &stream).unwrap();
        f.backward_cuda(&s, &q, &k, &v, &segments, &out, &dout, &saved, &dq, &dk, &dv, &ws, &ctx, &stream).unwrap();
        assert_eq!(
            *seen.lock().unwrap(),
            [
                (Pass::Forward, vec![q, k, v, segments, out, saved, ws], ctx, stream),
                (Pass::Backward, vec![q, k, v, segments, out, dout, saved, dq, dk, dv, ws], ctx, stream),
            ]
        );
        // The kernel's own error, and a caught panic.
        let short = CudaBuf { len: 3, ..q };
        let e = f.forward_cuda(&s, &short, &k, &v, &segments, &out, &saved, &ws, &ctx, &stream).unwrap_err();
        assert_eq!(e.message.as_str(), "q has 3 bf16 elements, expected 64 bf16");
        let no_stream = CudaStream { handle: 0, ordinal: 3 };
        let e = f.forward_cuda(&s, &q, &k, &v, &segments, &out, &saved, &ws, &ctx, &no_stream).unwrap_err();
        assert_eq!(e.kind, crate::ErrorKind::Panicked);
        assert_eq!(e.message.as_str(), "panicked in AttentionKernel::forward_cuda: no stream");
    }

    #[test]
    fn segment_ids_are_checked() {
        let s = AttnShape::self_attention(2, 1, 1, 3, 1, true);
        assert!(s.check_segments(&[]).is_ok());
        assert!(s.check_segments(&[0, 0, 1, 0, 1, 1]).is_ok(), "each sequence starts afresh");
        let err = s.check_segments(&[0, 1]).unwrap_err();
        assert_eq!(err.message.as_str(), "segments has 2 elements, expected 6");
        let err = s.check_segments(&[0, 1, 1, 2, 3, 2]).unwrap_err();
        assert_eq!(
            err.message.as_str(),
            "segment ids of sequence 1 decrease at position 2 (2 after 3): a document must be one run of positions"
        );
        // Fewer queries than keys: they are the last positions, each in its own document.
        let last = AttnShape { q_len: 2, ..s };
        assert!(last.check_segments(&[0, 0, 1, 0, 1, 1]).is_ok());
        // More (non-causal): the first queries have no position among the keys, so no document.
        let more = AttnShape { q_len: 4, causal: false, ..s };
        let err = more.check_segments(&[0, 0, 1, 0, 1, 1]).unwrap_err();
        assert!(err.message.as_str().contains("q_len (4) is more than kv_len (3)"), "{err:?}");
        assert!(more.check_segments(&[]).is_ok());
    }
}
