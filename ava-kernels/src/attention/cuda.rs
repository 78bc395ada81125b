//! `flash` on NVIDIA GPUs (`cuda` feature): the launches of kernels/flash.cu, FlashAttention-2
//! on device buffers in the run's compute type (f32, bf16 or f16), causal or full, GQA, packed
//! documents, head dimensions up to [`MAX_D`].
//!
//! ```text
//! forward    flash_fwd      grid (⌈Tq/BR⌉, B·H)    saves lse (B, H, Tq) f32
//! backward   flash_bwd_delta grid (⌈B·H·Tq/4⌉)     workspace Δ (B, H, Tq) f32 (+ the shares)
//!            flash_bwd_q    grid (⌈Tq/BR⌉, B·H)    dQ
//!            flash_bwd_kv   grid (⌈Tk/BC⌉, B·H)    each query head's share of dK, dV
//!            flash_bwd_kv_sum grid (⌈B·Hkv·Tk·D/256⌉) the shares added over the group in order
//!            (without grouped-query attention: flash_bwd_kv grid (⌈Tk/BC⌉, B·Hkv) writes dK, dV)
//! ```
//! All with 128 threads a block and the dynamic shared memory [`Smem`] computes (the same
//! carving as the kernels'). Every sum runs in a fixed order: the same inputs give the same
//! bits on every run.

use ava_core::device::{CudaBuf, CudaStream};
use ava_core::{AttnShape, DType, PluginError};

use crate::cuda::{Launch, Ptx, arg, attention_dims, check_attention, grid, grid_yz, launch_with, typed};

/// kernels/flash.cu.
const FLASH: Ptx = Ptx::new("flash", concat!(include_str!(concat!(env!("OUT_DIR"), "/flash.ptx")), "\0"));

/// The largest head dimension the kernels' shared memory holds.
pub const MAX_D: u32 = 128;

/// Threads a block (4 warps), as flash.cu's `THREADS`.
const THREADS: u32 = 128;

/// Query and key tile sizes (BR, BC) for an element type: flash.cu's `FLASH_F32` (32 × 32 on
/// the CUDA cores) and its tensor-core kernels (TQ × TK, 64 × 64).
fn tiles(t: DType) -> (usize, usize) {
    if t == DType::F32 { (32, 32) } else { (64, 64) }
}

/// The kernel `base` for an element type and head dimension: `{base}_f32`, or for bf16/f16
/// the tensor-core kernel of the head dimension's 32-column bucket, `{base}_bf16_d64`.
fn kernel_name(base: &str, t: DType, d: u32) -> Result<std::ffi::CString, PluginError> {
    if t == DType::F32 {
        return typed(base, t);
    }
    std::ffi::CString::new(format!("{base}_{}_d{}", t.as_str(), Smem::new(t, d).dp))
        .map_err(|e| PluginError::internal(e.to_string()))
}

/// The dynamic shared memory of each kernel: flash.cu's `Carver` regions in order, each
/// aligned to 128 bytes. Leading dimensions as the kernels' LT (D padded, +8 elements), LP
/// (+8 elements), LS (+4 floats) and LF (+4 floats). D is padded to 16 for f32 and to the
/// 32-column bucket of the tensor-core kernels.
struct Smem {
    elem: usize,
    /// The tensor-core kernels (bf16, f16).
    tc: bool,
    br: usize,
    bc: usize,
    dp: usize,
}

impl Smem {
    fn new(t: DType, d: u32) -> Self {
        let (br, bc) = tiles(t);
        let tc = t != DType::F32;
        let dp = if tc { (d as usize).div_ceil(32) * 32 } else { (d as usize).div_ceil(16) * 16 };
        Self { elem: t.size(), tc, br, bc, dp }
    }

    /// Bytes of regions of (count, element bytes), each 128-byte aligned.
    fn carve(regions: &[(usize, usize)]) -> u32 {
        let end = regions.iter().fold(0usize, |at, &(n, size)| at.next_multiple_of(128) + n * size);
        u32::try_from(end).expect("flash's shared memory is below 4 GiB")
    }

    /// An input-type tile of `rows` rows (ld D + 8).
    fn tile(&self, rows: usize) -> (usize, usize) {
        (rows * (self.dp + 8), self.elem)
    }
    /// The probability tile (ld BC + 8), input type.
    fn probs(&self) -> (usize, usize) {
        (self.br * (self.bc + 8), self.elem)
    }
    /// The f32 score tile (ld BC + 4).
    fn scores(&self) -> (usize, usize) {
        (self.br * (self.bc + 4), 4)
    }
    /// The f32 accumulator of `rows` rows (ld D + 4; the f32 kernels only).
    fn acc(&self, rows: usize) -> (usize, usize) {
        (rows * (self.dp + 4), 4)
    }

    /// fwd: sQ, sK, sV, sP, sS, sO, sM, sL; fwd_tc: sQ, sK, sV (S, P and O in registers).
    fn forward(&self) -> u32 {
        let (br, bc) = (self.br, self.bc);
        if self.tc {
            Self::carve(&[self.tile(br), self.tile(bc), self.tile(bc)])
        } else {
            Self::carve(&[
                self.tile(br),
                self.tile(bc),
                self.tile(bc),
                self.probs(),
                self.scores(),
                self.acc(br),
                (br, 4),
                (br, 4),
            ])
        }
    }

    /// bwd_q: sQ, sdO, sK, sV, sdS, sS, sdP, sdQ, sLse, sDelta; bwd_q_tc: sQ, sdO, sK, sV (S,
    /// dP, dS and dQ in registers).
    fn backward_q(&self) -> u32 {
        let (br, bc) = (self.br, self.bc);
        if self.tc {
            Self::carve(&[self.tile(br), self.tile(br), self.tile(bc), self.tile(bc)])
        } else {
            Self::carve(&[
                self.tile(br),
                self.tile(br),
                self.tile(bc),
                self.tile(bc),
                self.probs(),
                self.scores(),
                self.scores(),
                self.acc(br),
                (br, 4),
                (br, 4),
            ])
        }
    }

    /// bwd_kv: sK, sV, sQ, sdO, sP, sdS, sS, sdP, sdK, sdV, sLse, sDelta; bwd_kv_tc: sK, sV,
    /// sQ, sdO, sLse, sDelta (Sᵀ, dPᵀ, Pᵀ, dSᵀ, dK and dV in registers).
    fn backward_kv(&self) -> u32 {
        let (br, bc) = (self.br, self.bc);
        if self.tc {
            Self::carve(&[self.tile(br), self.tile(br), self.tile(bc), self.tile(bc), (bc, 4), (bc, 4)])
        } else {
            Self::carve(&[
                self.tile(bc),
                self.tile(bc),
                self.tile(br),
                self.tile(br),
                self.probs(),
                self.probs(),
                self.scores(),
                self.scores(),
                self.acc(bc),
                self.acc(bc),
                (br, 4),
                (br, 4),
            ])
        }
    }
}

/// The logsumexps flash saves: one f32 per query row.
fn rows(shape: &AttnShape) -> usize {
    shape.q_numel() / shape.head_dim as usize
}

/// The segments' device pointer, or 0 (no documents).
fn segments_ptr(segments: &CudaBuf) -> u64 {
    if segments.is_empty() { 0 } else { segments.ptr }
}

/// Forward: `out` and the logsumexps `saved`.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    shape: &AttnShape,
    q: &CudaBuf,
    k: &CudaBuf,
    v: &CudaBuf,
    segments: &CudaBuf,
    out: &CudaBuf,
    saved: &CudaBuf,
    stream: &CudaStream,
) -> Result<(), PluginError> {
    let t = check_attention("flash", shape, q, k, v, segments, &[("out", out)], saved, rows(shape), MAX_D)?;
    let (br, _) = tiles(t);
    let d = attention_dims(shape);
    let (causal, segs) = (i32::from(shape.causal), segments_ptr(segments));
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
    let heads = grid_yz(shape.batch as usize * shape.q_heads as usize, "batch × heads")?;
    let shape_of = Launch {
        grid: (grid((shape.q_len as usize).div_ceil(br), "query tiles")?, heads, 1),
        threads: THREADS,
        shared: Smem::new(t, shape.head_dim).forward(),
    };
    // SAFETY: flash_fwd's parameters one for one; every buffer was checked against the shape.
    unsafe { launch_with(&FLASH, &kernel_name("flash_fwd", t, shape.head_dim)?, shape_of, stream, &mut params) }
}

/// Backward: dq, dk, dv from the saved logsumexps; `workspace` holds Δ.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    shape: &AttnShape,
    (q, k, v, segments): (&CudaBuf, &CudaBuf, &CudaBuf, &CudaBuf),
    (out, dout, saved): (&CudaBuf, &CudaBuf, &CudaBuf),
    (dq, dk, dv): (&CudaBuf, &CudaBuf, &CudaBuf),
    workspace: &CudaBuf,
    stream: &CudaStream,
) -> Result<(), PluginError> {
    let like_q = [("out", out), ("dout", dout), ("dq", dq)];
    let t = check_attention("flash", shape, q, k, v, segments, &like_q, saved, rows(shape), MAX_D)?;
    dk.expect("dk", t, shape.kv_numel())?;
    dv.expect("dv", t, shape.kv_numel())?;
    workspace.expect("workspace", DType::F32, super::flash::device_backward_workspace_len(shape) as usize)?;
    delta(shape, t, out, dout, workspace, stream)?;
    // The workspace: Δ (B, H, Tq), then with grouped-query attention the heads' shares of dK
    // and dV, (B, H, Tk, D) f32 each.
    let group = shape.q_heads / shape.kv_heads;
    let shares = shape.batch as u64 * shape.q_heads as u64 * shape.kv_len as u64 * shape.head_dim as u64;
    let (dk_part, dv_part) = if group > 1 {
        let at = workspace.ptr + 4 * rows(shape) as u64;
        (at, at + 4 * shares)
    } else {
        (0, 0)
    };
    let (br, bc) = tiles(t);
    let smem = Smem::new(t, shape.head_dim);
    let d = attention_dims(shape);
    let (causal, segs) = (i32::from(shape.causal), segments_ptr(segments));
    let mut q_params = [
        arg(&q.ptr),
        arg(&k.ptr),
        arg(&v.ptr),
        arg(&segs),
        arg(&dout.ptr),
        arg(&saved.ptr),
        arg(&workspace.ptr),
        arg(&dq.ptr),
        arg(&d[0]),
        arg(&d[1]),
        arg(&d[2]),
        arg(&d[3]),
        arg(&d[4]),
        arg(&causal),
        arg(&shape.scale),
    ];
    let heads = grid_yz(shape.batch as usize * shape.q_heads as usize, "batch × heads")?;
    let q_launch = Launch {
        grid: (grid((shape.q_len as usize).div_ceil(br), "query tiles")?, heads, 1),
        threads: THREADS,
        shared: smem.backward_q(),
    };
    // SAFETY: flash_bwd_q's parameters one for one; buffers checked against the shape.
    unsafe { launch_with(&FLASH, &kernel_name("flash_bwd_q", t, shape.head_dim)?, q_launch, stream, &mut q_params)? };
    let mut kv_params = [
        arg(&q.ptr),
        arg(&k.ptr),
        arg(&v.ptr),
        arg(&segs),
        arg(&dout.ptr),
        arg(&saved.ptr),
        arg(&workspace.ptr),
        arg(&dk.ptr),
        arg(&dv.ptr),
        arg(&dk_part),
        arg(&dv_part),
        arg(&d[0]),
        arg(&d[1]),
        arg(&d[2]),
        arg(&d[3]),
        arg(&d[4]),
        arg(&causal),
        arg(&shape.scale),
    ];
    // A block per key tile and query head when the group's shares are added after; else per
    // key/value head.
    let per = if group > 1 { shape.q_heads } else { shape.kv_heads };
    let kv_launch = Launch {
        grid: (
            grid((shape.kv_len as usize).div_ceil(bc), "key tiles")?,
            grid_yz(shape.batch as usize * per as usize, "batch × heads")?,
            1,
        ),
        threads: THREADS,
        shared: smem.backward_kv(),
    };
    // SAFETY: flash_bwd_kv's parameters one for one; buffers checked against the shape, the
    // shares inside the checked workspace.
    unsafe {
        launch_with(&FLASH, &kernel_name("flash_bwd_kv", t, shape.head_dim)?, kv_launch, stream, &mut kv_params)?
    };
    if group > 1 {
        let n = shape.kv_numel() as u64;
        let per_head = shape.kv_len as u64 * shape.head_dim as u64;
        let group = group as i32;
        let mut params = [
            arg(&dk_part),
            arg(&dv_part),
            arg(&dk.ptr),
            arg(&dv.ptr),
            arg(&n),
            arg(&group),
            arg(&per_head),
            arg(&shape.scale),
        ];
        let launch =
            Launch { grid: (grid(shape.kv_numel().div_ceil(256), "key elements")?, 1, 1), threads: 256, shared: 0 };
        // SAFETY: flash_bwd_kv_sum's parameters one for one; the shares were just written.
        unsafe { launch_with(&FLASH, &typed("flash_bwd_kv_sum", t)?, launch, stream, &mut params)? };
    }
    Ok(())
}

/// Δ = rowsum(dO ∘ O) into `workspace`, a warp a row.
fn delta(
    shape: &AttnShape,
    t: DType,
    out: &CudaBuf,
    dout: &CudaBuf,
    workspace: &CudaBuf,
    stream: &CudaStream,
) -> Result<(), PluginError> {
    let n = rows(shape) as u64;
    let d = shape.head_dim as i32;
    let mut params = [arg(&out.ptr), arg(&dout.ptr), arg(&workspace.ptr), arg(&n), arg(&d)];
    let warps = (THREADS / 32) as usize;
    let launch = Launch { grid: (grid(rows(shape).div_ceil(warps), "query rows")?, 1, 1), threads: THREADS, shared: 0 };
    // SAFETY: flash_bwd_delta's parameters one for one; out and dout checked by the caller.
    unsafe { launch_with(&FLASH, &typed("flash_bwd_delta", t)?, launch, stream, &mut params) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sizes the kernels carve, worked by hand. f32, D = 128: tiles of 32 × 136 f32
    /// (17,408 B), P 32 × 40 f32 (5,120 B), S 32 × 36 f32 (4,608 B), the accumulator 32 × 132
    /// f32 (16,896 B). bf16, D = 128 (tensor cores): tiles 64 × 136 bf16 (17,408 B). Every
    /// region is a multiple of 128 B.
    #[test]
    fn shared_memory_fits_a_hopper_block() {
        let f = Smem::new(DType::F32, 128);
        assert_eq!(f.forward(), 3 * 17_408 + 5_120 + 4_608 + 16_896 + 128 + 128);
        let h = Smem::new(DType::BF16, 128);
        // The forward keeps S, P and O in registers: Q, K and V tiles only.
        assert_eq!(h.forward(), 3 * 17_408);
        // So does the backward its score tiles: the four input tiles, and dK/dV's lse and Δ rows.
        assert_eq!(h.backward_q(), 4 * 17_408);
        assert_eq!(h.backward_kv(), 4 * 17_408 + 256 + 256);
        // D = 80 runs in the 96-column bucket; its name says so.
        assert_eq!(Smem::new(DType::F16, 80).dp, 96);
        assert_eq!(kernel_name("flash_fwd", DType::F16, 80).unwrap().to_str().unwrap(), "flash_fwd_f16_d96");
        assert_eq!(kernel_name("flash_fwd", DType::F32, 80).unwrap().to_str().unwrap(), "flash_fwd_f32");
        // An H100's largest block: 227 KiB.
        for t in [DType::F32, DType::BF16, DType::F16] {
            for d in [16, 64, 80, 128] {
                let s = Smem::new(t, d);
                assert!(s.forward().max(s.backward_q()).max(s.backward_kv()) <= 227 << 10, "{t:?} D={d}");
            }
        }
    }
}
