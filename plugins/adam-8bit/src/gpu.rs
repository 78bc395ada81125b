//! The step on NVIDIA GPUs (`cuda` feature): kernels/adam_8bit.cu, built to PTX by build.rs
//! with `--fmad=false` and launched through `ava_kernels::cuda` on the host's stream.
//!
//! The state is the CPU's, byte for byte ([`Adam8bit::state_layout`]'s buffers in its order:
//! the u8 codes, the f32 absmaxes, the u32 count, the f32 norm history), and so is every
//! operation on it, in the same order: a step on the GPU gives the bits of
//! [`Optimizer::step`] on the CPU, weights and state alike, so a checkpoint moves between
//! devices without changing the run (tests/gpu_adam_8bit.rs checks it on a GPU). How each
//! part is matched is in the kernel file's header; in short, the maps' values come from
//! [`QuantMap::values`](crate::quant::QuantMap::values), the encoder's binary search over the
//! midpoints finds the code the CPU's lookup table finds (checked here on the CPU for every
//! bucket edge and midpoint by `quant::tests::the_gpus_search_is_the_lookup_table`), and the
//! gradient's Σ g² for percentile clipping is added in the fixed tree order the CPU uses too
//! (`sum_of_squares`).
//!
//! The exception: a gradient holding a NaN or an infinity. The CPU's absmax is `f32::max`
//! over the block in its scalar loop, which passes NaNs over, but AVX2's `max_ps` in its
//! vector loop keeps the second operand, so there a NaN drops the lane's earlier maximum: the
//! CPU's own result depends on the NaN's position and on the CPU. The GPU takes `fmaxf`, the
//! scalar loop's rule. And a NaN's bits differ between the devices: x86 passes an operand's
//! NaN on and makes 0xFFC00000 from ∞/∞, an NVIDIA GPU makes 0x7FFFFFFF. Such a step has
//! ruined the weights on either device.
//!
//! The launches, per parameter: `adam8_count` (t += 1), then with percentile clipping
//! `adam8_sumsq` (one block per 32768 elements) and `adam8_clip` (one block) into a scratch
//! buffer of 8·(⌈n/32768⌉ + ⌈n/32768/32⌉ + 1) bytes, about 8 bytes per 32 Ki elements (11 KiB
//! for a 4096 × 11008 matrix, 32 KiB for a 32000 × 4096 embedding), allocated and freed in
//! stream order (`cuMemAllocAsync` on the host's stream, from the device's current pool,
//! where the host's own tensors live: [`Scratch`]), then `adam8_block_step_<PER>` (one block per
//! quantization block) or `adam8_full_step` (fp32 moments).
//! Nothing here waits for the GPU.

use ava_core::prelude::*;
use ava_kernels::cuda::{Ptx, Scratch, THREADS, arg, blocks, grid, launch};

use crate::{Adam8bit, HISTORY, MAX_BLOCK, SUM_FAN, quant::CODES};

/// kernels/adam_8bit.cu as PTX (made by build.rs), NUL-terminated for the driver.
const PTX: Ptx = Ptx::new("adam-8bit", concat!(include_str!(concat!(env!("OUT_DIR"), "/adam_8bit.ptx")), "\0"));

/// Elements one `adam8_sumsq` block adds: three levels of the Σ g² tree (SUMSQ_SPAN there).
const SUMSQ_SPAN: usize = SUM_FAN * SUM_FAN * SUM_FAN;

/// Threads of the one `adam8_clip` block.
const CLIP_THREADS: u32 = 1024;

/// Threads of an `adam8_block_step_<PER>` block: one per element up to this, then PER
/// elements each (2 to `MAX_BLOCK / 256` = 16).
const BLOCK_THREADS: usize = 256;

/// The 8-bit step's kernel for blocks of `block` elements: `adam8_block_step_<PER>` with PER
/// = block / min(block, 256), and its threads a block.
fn block_kernel(block: usize) -> (&'static std::ffi::CStr, u32) {
    let threads = block.min(BLOCK_THREADS);
    let name = match block / threads {
        1 => c"adam8_block_step_1",
        2 => c"adam8_block_step_2",
        4 => c"adam8_block_step_4",
        8 => c"adam8_block_step_8",
        _ => c"adam8_block_step_16", // block 4096: `step` takes no larger one
    };
    (name, threads as u32)
}

/// The two maps' sorted values, passed to `adam8_block_step_<PER>` by value (its `Maps`).
#[repr(C)]
struct Maps {
    signed: [f32; CODES],
    unsigned: [f32; CODES],
}

/// [`Optimizer::step_cuda`] of [`Adam8bit`]: checks every buffer first (a refused step
/// launches nothing), then enqueues the step's kernels on `stream`.
pub(crate) fn step(
    opt: &Adam8bit,
    param: &ParamInfo<'_>,
    values: &CudaBuf,
    grad: &CudaBuf,
    state: &[CudaBuf],
    ctx: &StepContext,
    stream: &CudaStream,
) -> Result<(), PluginError> {
    let n = param.numel();
    values.expect("values", DType::F32, n)?;
    grad.expect("grad", DType::F32, n)?;
    let kind = opt.kind(param);
    if state.len() != Adam8bit::buffers(kind) {
        return Err(Adam8bit::wrong_state(param, kind, state.len()));
    }
    let (moments, rest) = state.split_at(if kind.eight_bit { 4 } else { 2 });
    let count = &rest[0];
    count.expect("step", DType::U32, 1)?;
    let history = rest.get(1);
    if let Some(h) = history {
        h.expect("grad_norm_history", DType::F32, HISTORY)?;
    }
    let block = opt.block_size;
    if kind.eight_bit {
        let [m, v, am, av] = moments else { unreachable!("split at 4") };
        m.expect("exp_avg", DType::U8, n)?;
        v.expect("exp_avg_sq", DType::U8, n)?;
        am.expect("absmax_exp_avg", DType::F32, n.div_ceil(block))?;
        av.expect("absmax_exp_avg_sq", DType::F32, n.div_ceil(block))?;
        if !(64..=MAX_BLOCK).contains(&block) || !block.is_power_of_two() {
            return Err(PluginError::unsupported(format!(
                "adam-8bit on the GPU takes a block_size that is a power of two from 64 to {MAX_BLOCK}, got {block}"
            )));
        }
    } else {
        let [m, v] = moments else { unreachable!("split at 2") };
        m.expect("exp_avg", DType::F32, n)?;
        v.expect("exp_avg_sq", DType::F32, n)?;
    }

    // SAFETY: adam8_count(unsigned*): the count holds one u32 on the stream's device.
    unsafe { launch(&PTX, c"adam8_count", 1, 1, stream, &mut [arg(&count.ptr)])? };
    let scratch = match history {
        Some(h) => Some(clip_factor(grad, h, count, opt.percentile_clipping, stream)?),
        None => None,
    };
    let clip = scratch.as_ref().map_or(0u64, |(_, clip)| *clip); // NULL: no clipping
    if n > 0 {
        let (lr, wd) = (ctx.lr, ctx.weight_decay);
        let (b1, b2, eps) = (opt.beta1, opt.beta2, opt.eps);
        if kind.eight_bit {
            let [m, v, am, av] = moments else { unreachable!("split at 4") };
            let maps = Maps { signed: *opt.signed.values(), unsigned: *opt.unsigned.values() };
            let block_u32 = block as u32;
            let (kernel, threads) = block_kernel(block);
            let mut params = [
                arg(&values.ptr),
                arg(&grad.ptr),
                arg(&m.ptr),
                arg(&v.ptr),
                arg(&am.ptr),
                arg(&av.ptr),
                arg(&count.ptr),
                arg(&clip),
                arg(&n),
                arg(&block_u32),
                arg(&lr),
                arg(&wd),
                arg(&b1),
                arg(&b2),
                arg(&eps),
                arg(&maps),
            ];
            let grid = grid(n.div_ceil(block), "quantization blocks")?;
            // SAFETY: adam8_block_step_<PER>'s parameters one for one (size_t n a usize, the
            // doubles f64s, Maps the same #[repr(C)] layout); values and grad hold n f32s,
            // the codes n u8s, the absmaxes one f32 per block (checked above), the clip
            // factor is NULL or one f32 of the scratch; block is a power of two from 64 to
            // 4096, threads min(block, 256) and PER their ratio, as the kernel requires.
            unsafe { launch(&PTX, kernel, grid, threads, stream, &mut params)? };
        } else {
            let [m, v] = moments else { unreachable!("split at 2") };
            let mut params = [
                arg(&values.ptr),
                arg(&grad.ptr),
                arg(&m.ptr),
                arg(&v.ptr),
                arg(&count.ptr),
                arg(&clip),
                arg(&n),
                arg(&lr),
                arg(&wd),
                arg(&b1),
                arg(&b2),
                arg(&eps),
            ];
            // SAFETY: adam8_full_step's parameters one for one; values, grad, m and v hold
            // n f32s (checked above), the clip factor is NULL or one f32 of the scratch.
            unsafe { launch(&PTX, c"adam8_full_step", blocks(n)?, THREADS, stream, &mut params)? };
        }
    }
    match scratch {
        Some((buffer, _)) => buffer.free(),
        None => Ok(()),
    }
}

/// Enqueues percentile clipping's kernels (after the count's): Σ g² into the history and the
/// clipping factor into a scratch buffer. Returns the buffer (to free after the step) and the
/// factor's device address.
fn clip_factor(
    grad: &CudaBuf,
    history: &CudaBuf,
    count: &CudaBuf,
    p: u32,
    stream: &CudaStream,
) -> Result<(Scratch, u64), PluginError> {
    let n = grad.len as usize;
    let parts = n.div_ceil(SUMSQ_SPAN);
    // The partial sums, the tree's next level, and one slot for the factor.
    let slots = parts + parts.div_ceil(SUM_FAN) + 1;
    let scratch = Scratch::new(slots * 8, stream, "adam-8bit", "percentile clipping's scratch")?;
    let sums = scratch.at(0);
    if parts > 0 {
        let mut params = [arg(&grad.ptr), arg(&n), arg(&sums)];
        // SAFETY: adam8_sumsq(const float*, size_t, double*): grad holds n f32s, the scratch
        // at least `parts` f64s, one per block.
        unsafe { launch(&PTX, c"adam8_sumsq", grid(parts, "Σ g² blocks")?, 256, stream, &mut params)? };
    }
    let clip = scratch.at((slots - 1) * 8);
    let mut params = [arg(&sums), arg(&parts), arg(&history.ptr), arg(&count.ptr), arg(&p), arg(&clip)];
    // SAFETY: adam8_clip(double*, size_t, float*, const unsigned*, unsigned, float*): the
    // scratch holds the `parts` partials and ⌈parts/32⌉ more f64s before the factor's slot,
    // the history 100 f32s, the count one u32 (checked by the caller).
    unsafe { launch(&PTX, c"adam8_clip", 1, CLIP_THREADS, stream, &mut params)? };
    Ok((scratch, clip))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// nvcc's output: every kernel is there, and no instruction rounds differently from the
    /// CPU (a fused multiply-add, which `--fmad=false` forbids; an approximate division,
    /// reciprocal or square root; a flush of subnormals to zero).
    #[test]
    fn the_ptx_has_every_kernel_and_only_the_cpus_rounding() {
        let ptx = include_str!(concat!(env!("OUT_DIR"), "/adam_8bit.ptx"));
        let blocks = (6..=12).map(|b| block_kernel(1 << b).0.to_str().unwrap());
        let kernels = ["adam8_count", "adam8_sumsq", "adam8_clip", "adam8_full_step"].into_iter().chain(blocks);
        ava_kernels::testing::gpu::assert_ptx_rounds_as_the_cpu(ptx, kernels);
    }

    /// The launch constants agree with the kernel file's.
    #[test]
    fn launch_constants_match_the_kernels() {
        let cu = include_str!("../kernels/adam_8bit.cu");
        assert!(cu.contains(&format!("#define FAN {SUM_FAN}\n")));
        assert!(cu.contains(&format!("#define SUMSQ_SPAN {SUMSQ_SPAN}\n")));
        assert!(cu.contains(&format!("#define HISTORY {HISTORY}\n")));
        assert!(cu.contains(&format!("#define CODES {CODES}\n")));
        assert_eq!(std::mem::size_of::<Maps>(), 2 * CODES * 4);
        // Every block size the options take: PER = block / threads, threads ≤ 256.
        let shapes: Vec<_> = (6..=12).map(|b| block_kernel(1 << b)).collect();
        let names: Vec<&str> = shapes.iter().map(|(k, _)| k.to_str().unwrap()).collect();
        let threads: Vec<u32> = shapes.iter().map(|s| s.1).collect();
        assert_eq!(names[..3], ["adam8_block_step_1"; 3]);
        assert_eq!(
            names[3..],
            ["adam8_block_step_2", "adam8_block_step_4", "adam8_block_step_8", "adam8_block_step_16"]
        );
        assert_eq!(threads, [64, 128, 256, 256, 256, 256, 256]);
        assert_eq!(1 << 12, MAX_BLOCK);
    }

    /// Wrong buffers are refused, naming the buffer, before anything touches a GPU (none here).
    #[test]
    fn step_cuda_checks_the_buffers_first() {
        let shape = [4096u64 + 7];
        let info = ParamInfo::new("model.layers.0.mlp.up_proj.weight", &shape);
        let ctx = StepContext { step: 1, lr: 1e-3, weight_decay: 0.0, threads: 1, grad_scale: 1.0 };
        let stream = CudaStream { handle: 0, ordinal: 0 };
        let buf = |len: usize, dtype| CudaBuf { ptr: 0x1000, len: len as u64, dtype, ordinal: 0 };
        let n = 4103;
        let w = buf(n, DType::F32);
        let good = [buf(n, DType::U8), buf(n, DType::U8), buf(17, DType::F32), buf(17, DType::F32), buf(1, DType::U32)];
        let step = |opt: &mut Adam8bit, g: &CudaBuf, state: &[CudaBuf]| {
            opt.step_cuda(&info, &w, g, state, &ctx, &stream).unwrap_err().message.to_string()
        };
        let mut opt = Adam8bit::default();
        assert_eq!(step(&mut opt, &buf(n - 1, DType::F32), &good), "grad has 4102 f32 elements, expected 4103 f32");
        assert_eq!(
            step(&mut opt, &w, &good[..4]),
            "adam-8bit expects 5 state buffers for model.layers.0.mlp.up_proj.weight (8-bit), got 4"
        );
        let mut bad = good;
        bad[2] = buf(16, DType::F32);
        assert_eq!(step(&mut opt, &w, &bad), "absmax_exp_avg has 16 f32 elements, expected 17 f32");
        let mut bad = good;
        bad[1] = buf(n, DType::F32);
        assert_eq!(step(&mut opt, &w, &bad), "exp_avg_sq has 4103 f32 elements, expected 4103 u8");
        let mut bad = good;
        bad[4] = buf(1, DType::F32);
        assert_eq!(step(&mut opt, &w, &bad), "step has 1 f32 elements, expected 1 u32");
        // With clipping, the history; and a block size the kernel does not take.
        let mut clipped = Adam8bit { percentile_clipping: 90, ..Adam8bit::default() };
        let with_history = [good.as_slice(), &[buf(99, DType::F32)]].concat();
        assert_eq!(step(&mut clipped, &w, &with_history), "grad_norm_history has 99 f32 elements, expected 100 f32");
        let mut odd = Adam8bit { block_size: 8192, ..Adam8bit::default() };
        let state = [buf(n, DType::U8), buf(n, DType::U8), buf(1, DType::F32), buf(1, DType::F32), buf(1, DType::U32)];
        assert_eq!(
            step(&mut odd, &w, &state),
            "adam-8bit on the GPU takes a block_size that is a power of two from 64 to 4096, got 8192"
        );
        // The fp32 path (a small tensor) checks f32 moments.
        let small = [10u64];
        let info = ParamInfo::new("model.norm.weight", &small);
        let (w, g) = (buf(10, DType::F32), buf(10, DType::F32));
        let state = [buf(10, DType::F32), buf(10, DType::U8), buf(1, DType::U32)];
        let err = opt.step_cuda(&info, &w, &g, &state, &ctx, &stream).unwrap_err();
        assert_eq!(err.message.as_str(), "exp_avg_sq has 10 u8 elements, expected 10 f32");
    }
}
