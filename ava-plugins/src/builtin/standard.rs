//! The built-in attention kernel `standard`: dense scaled-dot-product attention on CPU f32
//! buffers that saves the probabilities, the reference every other kernel is tested against.
//! The algorithm lives in [`ava_kernels::attention::dense`] (shared with the tests of the
//! plugin kernels, which compare against it under their own masks); this file is its name,
//! its (absent) options and its tests through the plugin trait.
//!
//! ```text
//! S = scale · Q Kᵀ (causal: query i sees keys j <= i + (Tk − Tq))    P = softmax(S)    O = P V
//! saved for backward: P, B·H·Tq·Tk f32 (the O(T²) memory flash avoids)
//! workspace: none in forward; in backward a (64, Tk) dP block per thread
//! ```

#[cfg(feature = "cuda")]
use ava_core::device::{CudaBuf, CudaStream};
use ava_core::prelude::*;
use ava_kernels::attention::{Kernel, Masking};

#[cfg(feature = "cuda")]
use crate::builtin::cuda::{ATTENTION, arg, launch};

/// Dense attention that saves the probabilities. No options.
#[derive(Debug, Clone, Copy, Default)]
pub struct Standard;

impl Plugin for Standard {
    fn manifest() -> Manifest {
        Manifest::new(
            "standard",
            PluginKind::Attention,
            env!("CARGO_PKG_VERSION"),
            "dense scaled-dot-product attention (causal, GQA); saves the Tq×Tk probabilities for backward",
        )
        .devices(crate::builtin::BUILTIN_DEVICES)
    }

    fn from_options(options: Options) -> Result<Self, PluginError> {
        options.finish()?;
        Ok(Standard)
    }
}

/// The dense algorithm with the shape's own causal flag.
const DENSE: Kernel = Kernel { masking: Masking::Plain, algorithm: ava_kernels::attention::Algorithm::Dense };

impl AttentionKernel for Standard {
    fn saved_len(&self, shape: &AttnShape) -> Result<u64, PluginError> {
        DENSE.saved_len(shape)
    }

    /// On the CPU, the dense algorithm's blocks; on a GPU, backward keeps dS whole (B·H·Tq·Tk
    /// f32, as large as the saved probabilities) so the key-side sums need no atomics.
    fn workspace_len(&self, shape: &AttnShape, pass: Pass, ctx: &KernelContext) -> Result<u64, PluginError> {
        match (ctx.device, pass) {
            (Device::Cuda, Pass::Forward) => Ok(0),
            (Device::Cuda, Pass::Backward) => DENSE.saved_len(shape),
            _ => DENSE.workspace_len(shape, pass, ctx),
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
        DENSE.forward(shape, q, k, v, segments, out, saved, workspace, ctx)
    }

    fn supports_backward(&self) -> bool {
        true
    }

    /// Packed documents: a query sees only the keys of its own document.
    fn supports_segments(&self) -> bool {
        true
    }

    /// The probabilities, in [0, 1], round as activations do.
    fn saved_tolerates_half(&self) -> bool {
        true
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
        DENSE.backward(shape, q, k, v, segments, out, dout, saved, dq, dk, dv, workspace, ctx)
    }

    /// kernels/attention.cu's forward: one block per query row.
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
        _workspace: &CudaBuf,
        _ctx: &KernelContext,
        stream: &CudaStream,
    ) -> Result<(), PluginError> {
        let t = device::check(shape, q, k, v, segments, &[("out", out)], saved)?;
        let causal = i32::from(shape.causal);
        let segs = if segments.is_empty() { 0u64 } else { segments.ptr };
        let d = device::dims(shape);
        let mut params = [
            arg(&q.ptr),
            arg(&k.ptr),
            arg(&v.ptr),
            arg(&segs),
            arg(&out.ptr),
            arg(&saved.ptr),
            arg(&d[0]),
            arg(&d[1]),
            arg(&d[2]),
            arg(&d[3]),
            arg(&d[4]),
            arg(&causal),
            arg(&shape.scale),
        ];
        let name = device::kernel("dense_fwd", t)?;
        // SAFETY: dense_fwd's parameters one for one; every buffer was checked against the shape.
        unsafe {
            launch(
                &ATTENTION,
                &name,
                device::rows(shape.q_numel() / shape.head_dim as usize)?,
                ROW,
                stream,
                &mut params,
            )
        }
    }

    /// kernels/attention.cu's backward: dS and dQ one query row a block, then dK and dV one
    /// key row a block, summed in a fixed order.
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
        let t = device::check(shape, q, k, v, segments, &[("out", out), ("dout", dout), ("dq", dq)], saved)?;
        dk.expect("dk", t, shape.kv_numel())?;
        dv.expect("dv", t, shape.kv_numel())?;
        workspace.expect("workspace", DType::F32, saved.len as usize)?;
        let d = device::dims(shape);
        let mut rows = [
            arg(&k.ptr),
            arg(&v.ptr),
            arg(&out.ptr),
            arg(&dout.ptr),
            arg(&saved.ptr),
            arg(&workspace.ptr),
            arg(&dq.ptr),
            arg(&d[0]),
            arg(&d[1]),
            arg(&d[2]),
            arg(&d[3]),
            arg(&d[4]),
            arg(&shape.scale),
        ];
        let name = device::kernel("dense_bwd_rows", t)?;
        let grid = device::rows(shape.q_numel() / shape.head_dim as usize)?;
        // SAFETY: dense_bwd_rows' parameters one for one; buffers checked against the shape.
        unsafe { launch(&ATTENTION, &name, grid, ROW, stream, &mut rows)? };
        let mut keys = [
            arg(&q.ptr),
            arg(&dout.ptr),
            arg(&saved.ptr),
            arg(&workspace.ptr),
            arg(&dk.ptr),
            arg(&dv.ptr),
            arg(&d[0]),
            arg(&d[1]),
            arg(&d[2]),
            arg(&d[3]),
            arg(&d[4]),
            arg(&shape.scale),
        ];
        let name = device::kernel("dense_bwd_keys", t)?;
        let grid = device::rows(shape.kv_numel() / shape.head_dim as usize)?;
        // SAFETY: dense_bwd_keys' parameters one for one; buffers checked against the shape.
        unsafe { launch(&ATTENTION, &name, grid, ROW, stream, &mut keys) }
    }
}

/// standard's device calls: its buffers checked ([`ava_kernels::cuda::check_attention`]) with
/// the probabilities as the saved buffer.
#[cfg(feature = "cuda")]
mod device {
    use ava_core::device::CudaBuf;
    use ava_core::prelude::*;

    pub(super) use ava_kernels::cuda::{attention_dims as dims, typed as kernel};

    /// The row kernels' largest head dimension (their shared memory).
    const MAX_D: u32 = 256;

    /// Checks q, k, v, the other query-shaped buffers, the segments and the saved
    /// probabilities against `shape`; returns the element type of the call.
    pub(super) fn check(
        shape: &AttnShape,
        q: &CudaBuf,
        k: &CudaBuf,
        v: &CudaBuf,
        segments: &CudaBuf,
        like_q: &[(&str, &CudaBuf)],
        saved: &CudaBuf,
    ) -> Result<DType, PluginError> {
        shape.validate()?;
        let probabilities = shape.q_numel() / shape.head_dim as usize * shape.kv_len as usize;
        ava_kernels::cuda::check_attention("standard", shape, q, k, v, segments, like_q, saved, probabilities, MAX_D)
    }

    /// A grid of one block per row, if it fits.
    pub(super) fn rows(n: usize) -> Result<u32, PluginError> {
        ava_kernels::cuda::grid(n, "attention rows")
    }
}

/// Threads per block of standard's row kernels.
#[cfg(feature = "cuda")]
const ROW: u32 = 128;

inventory::submit! { crate::builtin::Builtin::attention::<Standard>() }

#[cfg(test)]
mod tests {
    use ava_kernels::{
        attention::{Mask, Pattern},
        testing::{self, Rng, shape},
    };

    use super::*;

    fn run_forward(s: &AttnShape, q: &[f32], k: &[f32], v: &[f32]) -> (Vec<f32>, Vec<f32>) {
        let mut out = vec![f32::NAN; s.q_numel()];
        let mut saved = vec![f32::NAN; Standard.saved_len(s).unwrap() as usize];
        Standard.forward(s, q, k, v, &[], &mut out, &mut saved, &mut [], &KernelContext::default()).unwrap();
        (out, saved)
    }

    /// (B, H, Hkv, Tq, Tk, D, causal): T = 1, odd lengths, GQA ratios 1/2/4, causal on and
    /// off, and q_len < kv_len (decoding against a cache) with and without mask.
    const SHAPES: &[(u32, u32, u32, u32, u32, u32, bool)] = &[
        (1, 1, 1, 1, 1, 16, true),
        (1, 2, 2, 1, 1, 16, false),
        (2, 4, 4, 7, 7, 16, true),
        (1, 4, 2, 13, 13, 16, true),
        (2, 8, 2, 5, 5, 4, false),
        (1, 4, 1, 3, 10, 8, true),
        (1, 4, 2, 4, 6, 5, false),
    ];

    /// Output against the f64 definition and gradients against f64 finite differences,
    /// through the plugin trait.
    #[test]
    fn matches_the_definition_and_finite_differences() {
        for (n, &(b, h, hkv, tq, tk, d, causal)) in SHAPES.iter().enumerate() {
            let s = shape(b, h, hkv, tq, tk, d, causal);
            let mask =
                Mask::new(if causal { Pattern::Causal } else { Pattern::Full }, tq as usize, tk as usize).unwrap();
            testing::finite_differences(&Standard, &s, &mask, n as u64).unwrap();
        }
    }

    /// Packed documents: each query sees only its own document's keys, through the plugin
    /// trait, against the f64 definition and finite differences.
    #[test]
    fn packed_documents_match_the_definition() {
        assert!(Standard.supports_segments());
        for (n, s) in [shape(2, 4, 2, 9, 9, 8, true), shape(1, 2, 1, 4, 7, 4, true), shape(2, 2, 2, 6, 6, 4, false)]
            .iter()
            .enumerate()
        {
            let ids = testing::segments(s, n as u64 + 40);
            let p = if s.causal { Pattern::Causal } else { Pattern::Full };
            let mask = Mask::new(p, s.q_len as usize, s.kv_len as usize).unwrap().with_segments(&ids).unwrap();
            testing::finite_differences(&Standard, s, &mask, n as u64).unwrap();
        }
    }

    /// Worked by hand, scale 1, D = 1, causal, Tq = Tk = 2: q = (1, 1), k = (0, ln 3), v = (4, 8).
    /// Row 0 sees key 0 only: out = 4. Row 1: scores (0, ln 3) → P = (1/4, 3/4), out = 1 + 6 = 7.
    /// With Tq = 1 < Tk = 2 the single query sits at position 1 and sees both keys: out = 7.
    #[test]
    fn causal_mask_by_hand() {
        let mut s = shape(1, 1, 1, 2, 2, 1, true);
        s.scale = 1.0;
        let (out, p) = run_forward(&s, &[1.0, 1.0], &[0.0, 3f32.ln()], &[4.0, 8.0]);
        assert_eq!(p[..2], [1.0, 0.0]);
        assert!((p[2] - 0.25).abs() < 1e-7 && (p[3] - 0.75).abs() < 1e-7, "{p:?}");
        assert_eq!(out[0], 4.0);
        assert!((out[1] - 7.0).abs() < 1e-6, "{out:?}");

        s.q_len = 1;
        let (out, p) = run_forward(&s, &[1.0], &[0.0, 3f32.ln()], &[4.0, 8.0]);
        assert!((p[0] - 0.25).abs() < 1e-7 && (p[1] - 0.75).abs() < 1e-7, "{p:?}");
        assert!((out[0] - 7.0).abs() < 1e-6, "{out:?}");
    }

    #[test]
    fn thread_count_does_not_change_bits() {
        let mut rng = Rng(3);
        for s in [shape(2, 4, 2, 9, 9, 16, true), shape(3, 3, 1, 5, 7, 4, false)] {
            let (q, k, v, r) =
                (rng.vec(s.q_numel()), rng.vec(s.kv_numel()), rng.vec(s.kv_numel()), rng.vec(s.q_numel()));
            let one = testing::run(&Standard, &s, (&q, &k, &v, &r), 1).unwrap();
            let three = testing::run(&Standard, &s, (&q, &k, &v, &r), 3).unwrap();
            let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&one.0), bits(&three.0), "{s:?} out");
            assert_eq!(bits(&one.1), bits(&three.1), "{s:?} saved");
            for i in 0..3 {
                assert_eq!(bits(&one.2[i]), bits(&three.2[i]), "{s:?} gradient {i}");
            }
        }
    }

    #[test]
    fn saved_len_is_the_probability_matrix() {
        assert_eq!(Standard.saved_len(&shape(2, 8, 2, 5, 7, 16, true)).unwrap(), 2 * 8 * 5 * 7);
        assert!(Standard.supports_backward());
    }

    #[test]
    fn wrong_buffers_are_invalid_input() {
        let s = shape(1, 2, 1, 3, 3, 4, true);
        let (nq, nkv, np) = (s.q_numel(), s.kv_numel(), 2 * 3 * 3);
        let ctx = KernelContext::default();
        let (q, k, v) = (vec![0.0; nq], vec![0.0; nkv], vec![0.0; nkv]);
        let (mut out, mut saved) = (vec![0.0; nq], vec![0.0; np]);

        let err = Standard.forward(&s, &q[1..], &k, &v, &[], &mut out, &mut saved, &mut [], &ctx).unwrap_err();
        assert_eq!((err.kind, err.message.as_str()), (ErrorKind::InvalidInput, "q has 23 elements, expected 24"));
        let err = Standard.forward(&s, &q, &k, &v, &[], &mut out, &mut saved[1..], &mut [], &ctx).unwrap_err();
        assert_eq!((err.kind, err.message.as_str()), (ErrorKind::InvalidInput, "saved has 17 elements, expected 18"));

        let (mut dq, mut dk, mut dv) = (vec![0.0; nq], vec![0.0; nkv + 1], vec![0.0; nkv]);
        let mut ws = vec![0.0; Standard.workspace_len(&s, Pass::Backward, &ctx).unwrap() as usize];
        let err = Standard
            .backward(&s, &q, &k, &v, &[], &out, &q, &saved, &mut dq, &mut dk, &mut dv, &mut ws, &ctx)
            .unwrap_err();
        assert_eq!((err.kind, err.message.as_str()), (ErrorKind::InvalidInput, "dk has 13 elements, expected 12"));
        let err = Standard
            .backward(&s, &q, &k, &v, &[], &out, &q[..4], &saved, &mut dq, &mut dk[..nkv], &mut dv, &mut ws, &ctx)
            .unwrap_err();
        assert_eq!((err.kind, err.message.as_str()), (ErrorKind::InvalidInput, "dout has 4 elements, expected 24"));

        // q_heads not a multiple of kv_heads, and a softmax over zero keys.
        let err = Standard.saved_len(&shape(1, 3, 2, 3, 3, 4, false)).unwrap_err();
        assert_eq!(err.kind, ErrorKind::InvalidInput);
        let err = Standard.saved_len(&shape(1, 1, 1, 2, 0, 4, false)).unwrap_err();
        assert_eq!(err.message.as_str(), "attention over zero keys (kv_len = 0) is undefined");
    }

    #[test]
    fn registered_without_options() {
        let b = crate::builtin::all().find(|b| (b.manifest)().name.as_str() == "standard").expect("registered");
        let m = (b.manifest)();
        assert_eq!((m.kind, m.options.len()), (PluginKind::Attention, 0));
        m.validate().unwrap();
        let inst = (b.create)("", &HostContext::default()).unwrap();
        assert_eq!(inst.kind(), PluginKind::Attention);
        let err = (b.create)(r#"{"window": 4}"#, &HostContext::default()).unwrap_err();
        assert_eq!(err.details().collect::<Vec<_>>(), ["unknown option 'window' ('standard' takes no options)"]);
    }
}
