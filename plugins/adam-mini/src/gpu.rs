//! The step on NVIDIA GPUs (`cuda` feature): kernels/adam_mini.cu, built to PTX by build.rs
//! with `--fmad=false` and launched through `ava_kernels::cuda` on the host's stream.
//!
//! The state is the CPU's, byte for byte ([`AdamMini::state_layout`]'s buffers: `exp_avg`,
//! `exp_avg_sq`, `step`), the partition into blocks is the CPU's (`AdamMini::partition`, one
//! function for both), and so is every operation, in the same order: a step on the GPU gives
//! the bits of [`Optimizer::step`] on the CPU, so a checkpoint moves between devices without
//! changing the run (tests/gpu_adam_mini.rs checks it on a GPU). A block's Σ g² is added in the
//! fixed order of [`sum_sq`](crate::sum_sq) on both devices. (Not a NaN's bits: from a NaN or
//! infinite gradient x86 passes an operand's NaN on or makes 0xFFC00000, an NVIDIA GPU makes
//! 0x7FFFFFFF; such a step has ruined the weights on either device.)
//!
//! The launches, per parameter: `adam_mini_count` (t += 1), then for blocks of one element
//! `adam_mini_adam` (AdamW), else `adam_mini_chunks` (each 1024 elements' Σ g²),
//! `adam_mini_blocks` (a thread block per Adam-mini block: the tree, v, the block's scale) and
//! `adam_mini_update` (m and θ). Between them the chunks' sums, the trees' levels and the
//! blocks' scales live in a scratch buffer of about 8 bytes per 1024 elements plus 4 per
//! block (32 KiB for a 4096 × 4096 weight), allocated and freed in stream order
//! (`cuMemAllocAsync` on the host's stream, from the device's current pool, where the host's
//! own tensors live: [`Scratch`]). Nothing here waits for the GPU.

use ava_core::prelude::*;
use ava_kernels::cuda::{Ptx, Scratch, THREADS, arg, blocks, grid, launch};

use crate::{AdamMini, CHUNK, Partition, wrong_state};

/// kernels/adam_mini.cu as PTX (made by build.rs), NUL-terminated for the driver.
const PTX: Ptx = Ptx::new("adam-mini", concat!(include_str!(concat!(env!("OUT_DIR"), "/adam_mini.ptx")), "\0"));

/// Warps (chunks) per block of `adam_mini_chunks` (WARPS in the kernel file).
const WARPS: usize = 8;

/// Where the step's values live in its scratch buffer: byte offsets, each 8-aligned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Layout {
    /// Chunks per block: ⌈size / 1024⌉.
    pub chunks: usize,
    /// Each chunk's Σ g² (f64, blocks·chunks).
    pub sums: usize,
    /// The trees' levels (f64, blocks·⌈chunks/32⌉ and blocks·⌈chunks/1024⌉).
    pub ta: usize,
    pub tb: usize,
    /// Each block's step scale (f32, blocks).
    pub scales: usize,
    /// Bytes in all.
    pub bytes: usize,
}

impl Layout {
    /// The scratch of a step on `count` blocks of `size` elements.
    pub(crate) fn of(Partition { size, count }: Partition) -> Self {
        let chunks = size.div_ceil(CHUNK);
        let mut at = 0;
        let mut take = |bytes: usize| {
            let here = at;
            at += bytes.div_ceil(8) * 8;
            here
        };
        let sums = take(8 * count * chunks);
        let ta = take(8 * count * chunks.div_ceil(32));
        let tb = take(8 * count * chunks.div_ceil(1024));
        let scales = take(4 * count);
        Self { chunks, sums, ta, tb, scales, bytes: at }
    }
}

/// [`Optimizer::step_cuda`] of [`AdamMini`]: checks every buffer first (a refused step
/// launches nothing), then enqueues the step's kernels on `stream`.
pub(crate) fn step(
    opt: &AdamMini,
    param: &ParamInfo<'_>,
    values: &CudaBuf,
    grad: &CudaBuf,
    state: &[CudaBuf],
    ctx: &StepContext,
    stream: &CudaStream,
) -> Result<(), PluginError> {
    let partition = opt.partition(param)?;
    let Partition { size, count: blocks_n } = partition;
    let n = param.numel();
    values.expect("values", DType::F32, n)?;
    grad.expect("grad", DType::F32, n)?;
    let [m, v, count] = state else {
        return Err(wrong_state(state.len()));
    };
    m.expect("exp_avg", DType::F32, n)?;
    v.expect("exp_avg_sq", DType::F32, blocks_n)?;
    count.expect("step", DType::U32, 1)?;

    // SAFETY: adam_mini_count(unsigned*): the count holds one u32 on the stream's device.
    unsafe { launch(&PTX, c"adam_mini_count", 1, 1, stream, &mut [arg(&count.ptr)])? };
    if n == 0 {
        return Ok(());
    }
    let (lr, beta1, beta2, eps) = (ctx.lr, opt.beta1, opt.beta2, opt.eps);
    let decay = (1.0 - ctx.lr * ctx.weight_decay) as f32;
    if size == 1 {
        let mut params = [
            arg(&values.ptr),
            arg(&grad.ptr),
            arg(&m.ptr),
            arg(&v.ptr),
            arg(&count.ptr),
            arg(&n),
            arg(&lr),
            arg(&beta1),
            arg(&beta2),
            arg(&eps),
            arg(&decay),
        ];
        // SAFETY: adam_mini_adam's parameters one for one (size_t a usize, double f64, float
        // f32); values, grad, m and v hold n f32s (checked above: one block per element).
        return unsafe { launch(&PTX, c"adam_mini_adam", blocks(n)?, THREADS, stream, &mut params) };
    }

    let at = Layout::of(partition);
    let scratch = Scratch::new(at.bytes, stream, "adam-mini", "its scratch")?;
    let (sums, ta, tb, scales) = (scratch.at(at.sums), scratch.at(at.ta), scratch.at(at.tb), scratch.at(at.scales));
    let total = blocks_n * at.chunks;
    let mut params = [arg(&grad.ptr), arg(&sums), arg(&size), arg(&at.chunks), arg(&total)];
    // SAFETY: adam_mini_chunks's parameters one for one; grad holds blocks·size = n f32s, the
    // scratch one f64 per chunk at sums.
    unsafe {
        launch(&PTX, c"adam_mini_chunks", grid(total.div_ceil(WARPS), "chunk blocks")?, THREADS, stream, &mut params)?
    };

    let mut params = [
        arg(&sums),
        arg(&ta),
        arg(&tb),
        arg(&v.ptr),
        arg(&scales),
        arg(&count.ptr),
        arg(&size),
        arg(&at.chunks),
        arg(&lr),
        arg(&beta1),
        arg(&beta2),
        arg(&eps),
    ];
    let threads = if at.chunks > 1024 { 256 } else { 32 };
    // SAFETY: adam_mini_blocks's parameters one for one; v holds one f32 per block (checked
    // above), the scratch the chunks' sums, the trees' levels (⌈chunks/32⌉ and
    // ⌈chunks/1024⌉ f64s a block) and one f32 scale a block.
    unsafe { launch(&PTX, c"adam_mini_blocks", grid(blocks_n, "Adam-mini blocks")?, threads, stream, &mut params)? };

    let b1 = opt.beta1 as f32;
    let mut params =
        [arg(&values.ptr), arg(&grad.ptr), arg(&m.ptr), arg(&scales), arg(&n), arg(&size), arg(&b1), arg(&decay)];
    // SAFETY: adam_mini_update's parameters one for one; values, grad and m hold n f32s, the
    // scratch n / size scales.
    unsafe { launch(&PTX, c"adam_mini_update", blocks(n)?, THREADS, stream, &mut params)? };
    scratch.free()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// nvcc's output: every kernel is there, and no instruction rounds differently from the
    /// CPU (a fused multiply-add, which `--fmad=false` forbids; an approximate division,
    /// reciprocal or square root; a flush of subnormals to zero).
    #[test]
    fn the_ptx_has_every_kernel_and_only_the_cpus_rounding() {
        let ptx = include_str!(concat!(env!("OUT_DIR"), "/adam_mini.ptx"));
        let kernels = ["adam_mini_count", "adam_mini_adam", "adam_mini_chunks", "adam_mini_blocks", "adam_mini_update"];
        ava_kernels::testing::gpu::assert_ptx_rounds_as_the_cpu(ptx, kernels);
    }

    /// The launch constants agree with the kernel file's.
    #[test]
    fn launch_constants_match_the_kernels() {
        let cu = include_str!("../kernels/adam_mini.cu");
        assert!(cu.contains(&format!("#define CHUNK {CHUNK}\n")));
        assert!(cu.contains(&format!("#define WARPS {WARPS}\n")));
        assert_eq!(WARPS * 32, THREADS as usize);
        assert_eq!(crate::LANES, 32, "a chunk's lanes are a warp's");
    }

    /// The scratch's regions do not overlap and each is 8-aligned.
    #[test]
    fn the_scratch_layout_holds_every_region() {
        for (size, count) in [(4096, 3), (5000, 7), (33 * 1024 + 1, 1), (1100 * 1024, 2)] {
            let at = Layout::of(Partition { size, count });
            let chunks = size.div_ceil(CHUNK);
            assert_eq!(at.chunks, chunks);
            let regions = [
                (at.sums, 8 * count * chunks),
                (at.ta, 8 * count * chunks.div_ceil(32)),
                (at.tb, 8 * count * chunks.div_ceil(1024)),
                (at.scales, 4 * count),
            ];
            for (i, &(start, len)) in regions.iter().enumerate() {
                assert_eq!(start % 8, 0, "region {i}");
                let end = regions.get(i + 1).map_or(at.bytes, |r| r.0);
                assert!(start + len <= end, "size {size}: region {i} overlaps the next");
            }
        }
    }

    /// Wrong buffers are refused, naming the buffer, before anything touches a GPU (none here).
    #[test]
    fn step_cuda_checks_the_buffers_first() {
        let shape = [3u64, 5];
        let info = ParamInfo::new("model.layers.0.mlp.up_proj.weight", &shape);
        let ctx = StepContext { step: 1, lr: 1e-3, weight_decay: 0.0, threads: 1, grad_scale: 1.0 };
        let stream = CudaStream { handle: 0, ordinal: 0 };
        let buf = |len: usize, dtype| CudaBuf { ptr: 0x1000, len: len as u64, dtype, ordinal: 0 };
        let w = buf(15, DType::F32);
        let good = [buf(15, DType::F32), buf(3, DType::F32), buf(1, DType::U32)];
        let mut opt = AdamMini::default();
        let mut step = |info: &ParamInfo<'_>, g: &CudaBuf, state: &[CudaBuf]| {
            opt.step_cuda(info, &w, g, state, &ctx, &stream).unwrap_err().message.to_string()
        };
        assert_eq!(step(&info, &buf(14, DType::F32), &good), "grad has 14 f32 elements, expected 15 f32");
        assert_eq!(step(&info, &w, &good[..2]), "adam-mini expects 3 state buffers (exp_avg, exp_avg_sq, step), got 2");
        let mut bad = good;
        bad[1] = buf(15, DType::F32);
        assert_eq!(step(&info, &w, &bad), "exp_avg_sq has 15 f32 elements, expected 3 f32");
        let mut bad = good;
        bad[0] = buf(15, DType::BF16);
        assert_eq!(step(&info, &w, &bad), "exp_avg has 15 bf16 elements, expected 15 f32");
        let mut bad = good;
        bad[2] = buf(1, DType::F32);
        assert_eq!(step(&info, &w, &bad), "step has 1 f32 elements, expected 1 u32");
        // A query weight without head_dim: the CPU's refusal.
        let query = ParamInfo::new("model.layers.0.self_attn.q_proj.weight", &shape);
        assert!(step(&query, &w, &good).contains("head_dim is not set"));
    }
}
