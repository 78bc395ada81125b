//! [`Kernel`]: an algorithm and a masking rule as a complete [`AttentionKernel`], so a
//! plugin crate is its options plus [`delegate_attention!`](crate::delegate_attention).

#[cfg(feature = "cuda")]
use ava_core::device::{CudaBuf, CudaStream};
use ava_core::{AttentionKernel, AttnShape, Device, KernelContext, PluginError, attention::Pass, error::expect_len};

use super::{BlockPattern, Mask, Pattern, dense, flash, flash::Tiles};

/// Which keys a query sees; the shape's `causal` flag completes it into a [`Pattern`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Masking {
    /// Causal or full attention.
    Plain,
    /// A band of this many positions (causal: looking back only).
    Window(usize),
    /// Block-sparse: see [`BlockPattern`].
    Blocks {
        /// Positions per block.
        block: usize,
        /// Local block distance.
        local: usize,
        /// Global blocks at the start.
        global: usize,
        /// Strided block distance (0: off).
        stride: usize,
    },
}

impl Masking {
    /// The pattern for a call with this `causal` flag.
    pub fn pattern(self, causal: bool) -> Pattern {
        match (self, causal) {
            (Masking::Plain, true) => Pattern::Causal,
            (Masking::Plain, false) => Pattern::Full,
            (Masking::Window(window), causal) => Pattern::Window { window, causal },
            (Masking::Blocks { block, local, global, stride }, causal) => {
                Pattern::Blocks(BlockPattern { block, local, global, stride, causal })
            }
        }
    }

    /// The mask for `shape`.
    pub fn mask(self, shape: &AttnShape) -> Result<Mask<'static>, PluginError> {
        Mask::new(self.pattern(shape.causal), shape.q_len as usize, shape.kv_len as usize)
    }

    /// Whether segment ids (packed documents) can cut this masking: the interval patterns
    /// yes, fixed block patterns no.
    pub fn takes_segments(self) -> bool {
        !matches!(self, Masking::Blocks { .. })
    }
}

/// How the scores are computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    /// [`dense`]: saves the probabilities.
    Dense,
    /// [`flash`]: saves the logsumexp; `None` picks [`Tiles::tuned_forward`] and
    /// [`Tiles::tuned_backward`], `Some` uses the same tiles both ways.
    Flash(Option<Tiles>),
}

/// A masking rule computed by an algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kernel {
    /// Which keys each query sees.
    pub masking: Masking,
    /// Dense or tiled.
    pub algorithm: Algorithm,
}

impl Kernel {
    /// Tiled (flash) attention under `masking` with the tuned tile sizes.
    pub const fn flash(masking: Masking) -> Self {
        Self { masking, algorithm: Algorithm::Flash(None) }
    }

    /// Dense attention under `masking`.
    pub const fn dense(masking: Masking) -> Self {
        Self { masking, algorithm: Algorithm::Dense }
    }
}

impl Kernel {
    /// The tiles of a flash `pass`.
    fn tiles(tiles: Option<Tiles>, pass: Pass, shape: &AttnShape) -> Tiles {
        let d = shape.head_dim as usize;
        tiles.unwrap_or_else(|| match pass {
            Pass::Forward => Tiles::tuned_forward(d),
            Pass::Backward => Tiles::tuned_backward(d),
        })
    }
}

impl AttentionKernel for Kernel {
    fn saved_len(&self, shape: &AttnShape) -> Result<u64, PluginError> {
        self.masking.mask(shape)?;
        match self.algorithm {
            Algorithm::Dense => dense::saved_len(shape),
            Algorithm::Flash(_) => flash::saved_len(shape),
        }
    }

    fn workspace_len(&self, shape: &AttnShape, pass: Pass, ctx: &KernelContext) -> Result<u64, PluginError> {
        self.masking.mask(shape)?;
        if ctx.device == Device::Cuda {
            // The device kernels (flash only): nothing in forward; Δ and the grouped heads'
            // shares of dK, dV in backward.
            return Ok(match pass {
                Pass::Forward => 0,
                Pass::Backward => flash::device_backward_workspace_len(shape),
            });
        }
        match (self.algorithm, pass) {
            (Algorithm::Dense, Pass::Forward) => dense::saved_len(shape).map(|_| 0),
            (Algorithm::Dense, Pass::Backward) => dense::backward_workspace_len(shape, ctx.threads),
            (Algorithm::Flash(tiles), Pass::Forward) => {
                flash::forward_workspace_len(shape, Self::tiles(tiles, pass, shape), ctx.threads)
            }
            (Algorithm::Flash(tiles), Pass::Backward) => {
                flash::backward_workspace_len(shape, Self::tiles(tiles, pass, shape), ctx.threads)
            }
        }
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
        let mask = self.masking.mask(shape)?.with_segments(segments)?;
        match self.algorithm {
            Algorithm::Dense => {
                expect_len("workspace", workspace.len(), 0)?;
                dense::forward(shape, &mask, q, k, v, out, saved, ctx.threads)
            }
            Algorithm::Flash(tiles) => {
                let tiles = Self::tiles(tiles, Pass::Forward, shape);
                flash::forward(shape, &mask, tiles, q, k, v, out, saved, workspace, ctx.threads)
            }
        }
    }

    fn supports_backward(&self) -> bool {
        true
    }

    fn supports_segments(&self) -> bool {
        self.masking.takes_segments()
    }

    /// Dense saves the probabilities (they round as activations do); flash saves the
    /// logsumexp, whose error exp(s - lse) would amplify.
    fn saved_tolerates_half(&self) -> bool {
        matches!(self.algorithm, Algorithm::Dense)
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
        let mask = self.masking.mask(shape)?.with_segments(segments)?;
        let threads = ctx.threads;
        match self.algorithm {
            Algorithm::Dense => {
                dense::backward(shape, &mask, q, k, v, out, dout, saved, dq, dk, dv, workspace, threads)
            }
            Algorithm::Flash(tiles) => {
                let tiles = Self::tiles(tiles, Pass::Backward, shape);
                flash::backward(shape, &mask, tiles, q, k, v, out, dout, saved, dq, dk, dv, workspace, threads)
            }
        }
    }

    /// Flash under a plain (causal or full) mask runs on the GPU (kernels/flash.cu); dense
    /// and the window and block masks do not.
    #[cfg(feature = "cuda")]
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
        _ctx: &KernelContext,
        stream: &CudaStream,
    ) -> Result<(), PluginError> {
        self.on_device()?;
        self.masking.mask(shape)?;
        workspace.expect("workspace", ava_core::DType::F32, 0)?;
        super::cuda::forward(shape, q, k, v, segments, out, saved, stream)
    }

    /// See [`forward_cuda`](Self::forward_cuda).
    #[cfg(feature = "cuda")]
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
        _ctx: &KernelContext,
        stream: &CudaStream,
    ) -> Result<(), PluginError> {
        self.on_device()?;
        self.masking.mask(shape)?;
        super::cuda::backward(shape, (q, k, v, segments), (out, dout, saved), (dq, dk, dv), workspace, stream)
    }
}

impl Kernel {
    /// Whether this kernel has a GPU side: flash under a plain mask.
    pub fn runs_on_cuda(&self) -> bool {
        cfg!(feature = "cuda") && matches!((self.algorithm, self.masking), (Algorithm::Flash(_), Masking::Plain))
    }

    /// The devices whose buffers this kernel takes, for its plugin's manifest.
    pub fn devices(&self) -> &'static [Device] {
        if self.runs_on_cuda() { &[Device::Cpu, Device::Cuda] } else { &[Device::Cpu] }
    }

    #[cfg(feature = "cuda")]
    fn on_device(&self) -> Result<(), PluginError> {
        if self.runs_on_cuda() {
            Ok(())
        } else {
            Err(PluginError::unsupported(
                "only flash under a causal or full mask runs on the GPU; dense, windowed and block-sparse attention \
                 are CPU kernels",
            ))
        }
    }
}

/// Implements [`AttentionKernel`] for a plugin type by forwarding to a [`Kernel`] it holds
/// (plugin types must be local to their crate to implement `Plugin`).
///
/// ```ignore
/// pub struct Flash(ava_kernels::attention::Kernel);
/// ava_kernels::delegate_attention!(Flash, 0);
/// ```
#[macro_export]
macro_rules! delegate_attention {
    ($ty:ty, $field:tt) => {
        impl ::ava_core::AttentionKernel for $ty {
            fn saved_len(&self, shape: &::ava_core::AttnShape) -> Result<u64, ::ava_core::PluginError> {
                self.$field.saved_len(shape)
            }
            fn workspace_len(
                &self,
                shape: &::ava_core::AttnShape,
                pass: ::ava_core::attention::Pass,
                ctx: &::ava_core::KernelContext,
            ) -> Result<u64, ::ava_core::PluginError> {
                self.$field.workspace_len(shape, pass, ctx)
            }
            fn forward(
                &self,
                shape: &::ava_core::AttnShape,
                q: &[f32],
                k: &[f32],
                v: &[f32],
                segments: &[u32],
                out: &mut [f32],
                saved: &mut [f32],
                workspace: &mut [f32],
                ctx: &::ava_core::KernelContext,
            ) -> Result<(), ::ava_core::PluginError> {
                self.$field.forward(shape, q, k, v, segments, out, saved, workspace, ctx)
            }
            fn supports_backward(&self) -> bool {
                self.$field.supports_backward()
            }
            fn supports_segments(&self) -> bool {
                self.$field.supports_segments()
            }
            fn saved_tolerates_half(&self) -> bool {
                self.$field.saved_tolerates_half()
            }
            fn backward(
                &self,
                shape: &::ava_core::AttnShape,
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
                ctx: &::ava_core::KernelContext,
            ) -> Result<(), ::ava_core::PluginError> {
                self.$field.backward(shape, q, k, v, segments, out, dout, saved, dq, dk, dv, workspace, ctx)
            }
            fn forward_cuda(
                &self,
                shape: &::ava_core::AttnShape,
                q: &::ava_core::device::CudaBuf,
                k: &::ava_core::device::CudaBuf,
                v: &::ava_core::device::CudaBuf,
                segments: &::ava_core::device::CudaBuf,
                out: &::ava_core::device::CudaBuf,
                saved: &::ava_core::device::CudaBuf,
                workspace: &::ava_core::device::CudaBuf,
                ctx: &::ava_core::KernelContext,
                stream: &::ava_core::device::CudaStream,
            ) -> Result<(), ::ava_core::PluginError> {
                self.$field.forward_cuda(shape, q, k, v, segments, out, saved, workspace, ctx, stream)
            }
            fn backward_cuda(
                &self,
                shape: &::ava_core::AttnShape,
                q: &::ava_core::device::CudaBuf,
                k: &::ava_core::device::CudaBuf,
                v: &::ava_core::device::CudaBuf,
                segments: &::ava_core::device::CudaBuf,
                out: &::ava_core::device::CudaBuf,
                dout: &::ava_core::device::CudaBuf,
                saved: &::ava_core::device::CudaBuf,
                dq: &::ava_core::device::CudaBuf,
                dk: &::ava_core::device::CudaBuf,
                dv: &::ava_core::device::CudaBuf,
                workspace: &::ava_core::device::CudaBuf,
                ctx: &::ava_core::KernelContext,
                stream: &::ava_core::device::CudaStream,
            ) -> Result<(), ::ava_core::PluginError> {
                self.$field
                    .backward_cuda(shape, q, k, v, segments, out, dout, saved, dq, dk, dv, workspace, ctx, stream)
            }
        }
    };
}
