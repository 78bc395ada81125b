//! The step on NVIDIA GPUs (`cuda` feature): kernels/adafactor.cu, built to PTX by build.rs
//! with `--fmad=false` and launched through `ava_kernels::cuda` on the host's stream.
//!
//! The state is the CPU's, byte for byte ([`Adafactor::state_layout`]'s buffers in its
//! order), and so is every operation on it, in the same order: a step on the GPU gives the
//! bits of [`Optimizer::step`] on the CPU, weights and state alike, so a checkpoint moves
//! between devices without changing the run (tests/gpu_adafactor.rs checks it on a GPU). Every
//! sum is added in the fixed order of the [`reduce`](crate::reduce) module on both devices,
//! and `1 − t^decay_rate` takes `reduce::pow` (no libm) on both. (Not a NaN's bits: from a NaN
//! or infinite gradient x86 passes an operand's NaN on or makes 0xFFC00000, an NVIDIA GPU
//! makes 0x7FFFFFFF; such a step has ruined the weights on either device.)
//!
//! The launches, per parameter: `adafactor_count` (t += 1); for a matrix (rank ≥ 2)
//! `adafactor_rows`, `adafactor_cols` and `adafactor_usq`, for a vector `adafactor_full`; then
//! `adafactor_scalars` (one block: the trees, lr_t, the clip) and `adafactor_apply_factored`
//! or `adafactor_apply_full`. Between them the values they pass on live in a scratch buffer
//! ([`Layout`]): about 16 bytes per row and column tile of a matrix and 8 per column (for a
//! 4096 × 4096 weight 96 KiB), 16 per 1024 elements of a vector, allocated and freed in stream
//! order (`cuMemAllocAsync` on the host's stream, from the device's current pool, where the
//! host's own tensors live: [`Scratch`]). Nothing here waits for the GPU.

use ava_core::prelude::*;
use ava_kernels::cuda::{Launch, Ptx, Scratch, THREADS, arg, blocks, grid, launch, launch_with};

use crate::reduce::CHUNK;
use crate::{Adafactor, Factoring, TILE};

/// kernels/adafactor.cu as PTX (made by build.rs), NUL-terminated for the driver.
const PTX: Ptx = Ptx::new("adafactor", concat!(include_str!(concat!(env!("OUT_DIR"), "/adafactor.ptx")), "\0"));

/// Warps (rows or chunks) per block of `adafactor_rows`, `adafactor_usq`, `adafactor_full`
/// (WARPS in the kernel file), 32 threads each.
const WARPS: usize = 8;

/// Threads of the one `adafactor_scalars` block.
const SCALAR_THREADS: u32 = 1024;

/// Where the step's values live in its scratch buffer: byte offsets, each 8-aligned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Layout {
    /// Values per tree of `adafactor_scalars`: tile rows (batch·rows·tiles) or chunks.
    pub len: usize,
    /// Σθ² and Σ U² per tile row or chunk (f64, `len` each).
    pub w2: usize,
    pub u2: usize,
    /// The trees' levels (f64, ⌈len/32⌉ and ⌈len/1024⌉).
    pub ta: usize,
    pub tb: usize,
    /// A matrix's mean(R) (f64, batch) and its tree's levels (f64, batch·⌈rows/32⌉ and
    /// batch·⌈rows/1024⌉).
    pub mean_r: usize,
    pub ra: usize,
    pub rb: usize,
    /// 1/C and 1/√C (f32, batch·cols each).
    pub inv_c: usize,
    pub inv_sqrt_c: usize,
    /// The kernel file's `Scalars` (16 bytes).
    pub out: usize,
    /// Bytes in all.
    pub bytes: usize,
}

impl Layout {
    /// The scratch of a step on a parameter factored as `f` with `n` elements (n > 0).
    pub(crate) fn of(f: Factoring, n: usize) -> Self {
        let (len, batch, rows, cols) = match f {
            Factoring::Matrices { batch, rows, cols } => (batch * rows * cols.div_ceil(TILE), batch, rows, cols),
            Factoring::Elements => (n.div_ceil(CHUNK), 0, 0, 0),
        };
        let mut at = 0;
        let mut take = |bytes: usize| {
            let here = at;
            at += bytes.div_ceil(8) * 8;
            here
        };
        let w2 = take(8 * len);
        let u2 = take(8 * len);
        let ta = take(8 * len.div_ceil(32));
        let tb = take(8 * len.div_ceil(1024));
        let mean_r = take(8 * batch);
        let ra = take(8 * batch * rows.div_ceil(32));
        let rb = take(8 * batch * rows.div_ceil(1024));
        let inv_c = take(4 * batch * cols);
        let inv_sqrt_c = take(4 * batch * cols);
        let out = take(16);
        Self { len, w2, u2, ta, tb, mean_r, ra, rb, inv_c, inv_sqrt_c, out, bytes: at }
    }
}

/// [`Optimizer::step_cuda`] of [`Adafactor`]: checks every buffer first (a refused step
/// launches nothing), then enqueues the step's kernels on `stream`.
pub(crate) fn step(
    opt: &Adafactor,
    param: &ParamInfo<'_>,
    values: &CudaBuf,
    grad: &CudaBuf,
    state: &[CudaBuf],
    ctx: &StepContext,
    stream: &CudaStream,
) -> Result<(), PluginError> {
    let n = param.numel();
    let factoring = check(opt, param, values, grad, state)?;
    let (m, rest) = if opt.beta1.is_some() { (state[0].ptr, &state[1..]) } else { (0u64, state) };
    let count = &rest[rest.len() - 1];

    // SAFETY: adafactor_count(unsigned*): the count holds one u32 on the stream's device.
    unsafe { launch(&PTX, c"adafactor_count", 1, 1, stream, &mut [arg(&count.ptr)])? };
    if n == 0 {
        return Ok(());
    }
    let at = Layout::of(factoring, n);
    let scratch = Scratch::new(at.bytes, stream, "adafactor", "its scratch")?;
    let (w2, u2) = (scratch.at(at.w2), scratch.at(at.u2));
    let run = Run {
        opt,
        values,
        grad,
        m,
        count,
        at,
        scratch: &scratch,
        w2,
        u2,
        scale_w: i32::from(opt.scale_parameter),
        n,
        ctx,
        stream,
    };
    match factoring {
        Factoring::Matrices { batch, rows, cols } => run.factored(batch, rows, cols, [&rest[0], &rest[1]])?,
        Factoring::Elements => run.unfactored(&rest[0])?,
    }
    scratch.free()
}

/// Checks the values, the gradient and every state buffer against the parameter and the
/// layout, and that a matrix's columns fit the apply kernel's grid; returns how the
/// parameter is factored.
fn check(
    opt: &Adafactor,
    param: &ParamInfo<'_>,
    values: &CudaBuf,
    grad: &CudaBuf,
    state: &[CudaBuf],
) -> Result<Factoring, PluginError> {
    let n = param.numel();
    values.expect("values", DType::F32, n)?;
    grad.expect("grad", DType::F32, n)?;
    let layout = opt.state_layout(param)?;
    if state.len() != layout.len() {
        return Err(opt.wrong_state(param, state.len()));
    }
    for (buf, spec) in state.iter().zip(&layout) {
        buf.expect(spec.name.as_str(), spec.dtype, spec.len as usize)?;
    }
    let factoring = Factoring::of(&param.shape);
    if let Factoring::Matrices { cols, .. } = factoring {
        // The apply kernel's grid has ⌈cols/256⌉ blocks in y, at most 65535.
        if cols.div_ceil(THREADS as usize) > 65_535 {
            return Err(PluginError::unsupported(format!(
                "adafactor on the GPU takes matrices of up to {} columns, {} has {cols}",
                65_535 * THREADS as usize,
                param.name
            )));
        }
    }
    Ok(factoring)
}

/// What every launch of one parameter's step reads: the buffers, the first moment (0
/// without beta1), the step count, the scratch and where its regions are.
struct Run<'a> {
    opt: &'a Adafactor,
    values: &'a CudaBuf,
    grad: &'a CudaBuf,
    m: u64,
    count: &'a CudaBuf,
    at: Layout,
    scratch: &'a Scratch,
    /// The scratch's Σθ² and Σ U² regions.
    w2: u64,
    u2: u64,
    /// `scale_parameter` as the kernels' int.
    scale_w: i32,
    n: usize,
    ctx: &'a StepContext,
    stream: &'a CudaStream,
}

impl Run<'_> {
    /// A matrix (rank ≥ 2, `batch` of `rows` × `cols`) with row and column factors `r` and
    /// `c`: `adafactor_rows`, `adafactor_cols`, `adafactor_usq`, the scalars, then
    /// `adafactor_apply_factored`.
    fn factored(&self, batch: usize, rows: usize, cols: usize, [r, c]: [&CudaBuf; 2]) -> Result<(), PluginError> {
        let rows_total = batch * rows;
        let warps = grid(rows_total.div_ceil(WARPS), "row blocks")?;
        let mut params = [
            arg(&self.values.ptr),
            arg(&self.grad.ptr),
            arg(&r.ptr),
            arg(&self.w2),
            arg(&self.count.ptr),
            arg(&rows_total),
            arg(&rows),
            arg(&cols),
            arg(&self.opt.decay_rate),
            arg(&self.opt.eps1),
            arg(&self.scale_w),
        ];
        // SAFETY: adafactor_rows's parameters one for one (size_t a usize, double f64, int
        // i32); values and grad hold batch·rows·cols f32s, R batch·rows (checked above),
        // the scratch's w2 one f64 per row and column tile.
        unsafe { launch(&PTX, c"adafactor_rows", warps, THREADS, self.stream, &mut params)? };

        let (inv_c, inv_sqrt_c) = (self.scratch.at(self.at.inv_c), self.scratch.at(self.at.inv_sqrt_c));
        let (mean_r, ra, rb) =
            (self.scratch.at(self.at.mean_r), self.scratch.at(self.at.ra), self.scratch.at(self.at.rb));
        let mut params = [
            arg(&self.grad.ptr),
            arg(&c.ptr),
            arg(&r.ptr),
            arg(&inv_c),
            arg(&inv_sqrt_c),
            arg(&mean_r),
            arg(&ra),
            arg(&rb),
            arg(&self.count.ptr),
            arg(&rows),
            arg(&cols),
            arg(&self.opt.decay_rate),
            arg(&self.opt.eps1),
        ];
        let col_grid = grid(batch * (cols.div_ceil(32) + 1), "column blocks")?;
        // SAFETY: adafactor_cols's parameters one for one; C holds batch·cols f32s, R
        // batch·rows, the scratch 1/C and 1/√C (batch·cols f32s each), mean(R) (batch
        // f64s) and its tree's levels (batch·⌈rows/32⌉ and batch·⌈rows/1024⌉ f64s).
        unsafe { launch(&PTX, c"adafactor_cols", col_grid, THREADS, self.stream, &mut params)? };

        let mut params = [
            arg(&self.grad.ptr),
            arg(&r.ptr),
            arg(&inv_c),
            arg(&mean_r),
            arg(&self.u2),
            arg(&rows_total),
            arg(&rows),
            arg(&cols),
        ];
        // SAFETY: adafactor_usq's parameters one for one; the buffers as above, u2 one
        // f64 per row and column tile.
        unsafe { launch(&PTX, c"adafactor_usq", warps, THREADS, self.stream, &mut params)? };

        scalars(self.opt, &self.at, self.scratch, self.count, self.n, self.ctx, self.stream)?;

        let k = self.scratch.at(self.at.out);
        let b1 = self.opt.beta1.unwrap_or(0.0) as f32;
        let mut params = [
            arg(&self.values.ptr),
            arg(&self.grad.ptr),
            arg(&self.m),
            arg(&r.ptr),
            arg(&inv_sqrt_c),
            arg(&mean_r),
            arg(&k),
            arg(&rows),
            arg(&cols),
            arg(&b1),
        ];
        let shape = Launch {
            grid: (grid(rows_total, "rows")?, cols.div_ceil(THREADS as usize) as u32, 1),
            threads: THREADS,
            shared: 0,
        };
        // SAFETY: adafactor_apply_factored's parameters one for one; values, grad and the
        // first moment (NULL without beta1) hold batch·rows·cols f32s, the scratch's
        // Scalars were written by adafactor_scalars; ⌈cols/256⌉ ≤ 65535 (checked above).
        unsafe { launch_with(&PTX, c"adafactor_apply_factored", shape, self.stream, &mut params)? };

        Ok(())
    }

    /// A vector with its second moment `v`: `adafactor_full`, the scalars, then
    /// `adafactor_apply_full`.
    fn unfactored(&self, v: &CudaBuf) -> Result<(), PluginError> {
        let chunks = grid(self.n.div_ceil(CHUNK).div_ceil(WARPS), "chunk blocks")?;
        let mut params = [
            arg(&self.values.ptr),
            arg(&self.grad.ptr),
            arg(&v.ptr),
            arg(&self.w2),
            arg(&self.u2),
            arg(&self.count.ptr),
            arg(&self.n),
            arg(&self.opt.decay_rate),
            arg(&self.opt.eps1),
            arg(&self.scale_w),
        ];
        // SAFETY: adafactor_full's parameters one for one; values, grad and V hold n f32s
        // (checked above), w2 and u2 one f64 per chunk of 1024.
        unsafe { launch(&PTX, c"adafactor_full", chunks, THREADS, self.stream, &mut params)? };

        scalars(self.opt, &self.at, self.scratch, self.count, self.n, self.ctx, self.stream)?;

        let k = self.scratch.at(self.at.out);
        let b1 = self.opt.beta1.unwrap_or(0.0) as f32;
        let mut params =
            [arg(&self.values.ptr), arg(&self.grad.ptr), arg(&self.m), arg(&v.ptr), arg(&k), arg(&self.n), arg(&b1)];
        // SAFETY: adafactor_apply_full's parameters one for one; values, grad, V and the
        // first moment (NULL without beta1) hold n f32s.
        unsafe { launch(&PTX, c"adafactor_apply_full", blocks(self.n)?, THREADS, self.stream, &mut params)? };
        Ok(())
    }
}

/// Enqueues `adafactor_scalars`: the trees over pass 1's and 2's values, lr_t and the clip,
/// into the scratch's `Scalars`.
fn scalars(
    opt: &Adafactor,
    at: &Layout,
    scratch: &Scratch,
    count: &CudaBuf,
    n: usize,
    ctx: &StepContext,
    stream: &CudaStream,
) -> Result<(), PluginError> {
    let (w2, u2, ta, tb, out) =
        (scratch.at(at.w2), scratch.at(at.u2), scratch.at(at.ta), scratch.at(at.tb), scratch.at(at.out));
    let (lr, wd) = (ctx.lr, ctx.weight_decay);
    let flags = [opt.relative_step, opt.warmup_init, opt.scale_parameter].map(i32::from);
    let mut params = [
        arg(&w2),
        arg(&u2),
        arg(&at.len),
        arg(&ta),
        arg(&tb),
        arg(&count.ptr),
        arg(&n),
        arg(&lr),
        arg(&wd),
        arg(&opt.eps2),
        arg(&opt.clip_threshold),
        arg(&flags[0]),
        arg(&flags[1]),
        arg(&flags[2]),
        arg(&out),
    ];
    // SAFETY: adafactor_scalars's parameters one for one; the scratch holds `len` f64s at w2
    // and u2, ⌈len/32⌉ at ta, ⌈len/1024⌉ at tb and 16 bytes at out.
    unsafe { launch(&PTX, c"adafactor_scalars", 1, SCALAR_THREADS, stream, &mut params) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// nvcc's output: every kernel is there, and no instruction rounds differently from the
    /// CPU (a fused multiply-add, which `--fmad=false` forbids; an approximate division,
    /// reciprocal or square root; a flush of subnormals to zero).
    #[test]
    fn the_ptx_has_every_kernel_and_only_the_cpus_rounding() {
        let ptx = include_str!(concat!(env!("OUT_DIR"), "/adafactor.ptx"));
        let kernels = [
            "adafactor_count",
            "adafactor_rows",
            "adafactor_cols",
            "adafactor_usq",
            "adafactor_full",
            "adafactor_scalars",
            "adafactor_apply_factored",
            "adafactor_apply_full",
        ];
        ava_kernels::testing::gpu::assert_ptx_rounds_as_the_cpu(ptx, kernels);
    }

    /// The launch constants agree with the kernel file's and the CPU step's.
    #[test]
    fn launch_constants_match_the_kernels() {
        let cu = include_str!("../kernels/adafactor.cu");
        assert!(cu.contains(&format!("#define TILE {TILE}\n")));
        assert!(cu.contains(&format!("#define ROW_BLOCK {}\n", crate::ROW_BLOCK)));
        assert!(cu.contains(&format!("#define CHUNK {CHUNK}\n")));
        assert!(cu.contains(&format!("#define WARPS {WARPS}\n")));
        assert_eq!(WARPS * 32, THREADS as usize);
        assert_eq!(crate::reduce::LANES, 32, "a lane sum is a warp's");
    }

    /// The scratch's regions do not overlap, each is 8-aligned and as large as its kernel
    /// writes; for a vector only the trees and the scalars.
    #[test]
    fn the_scratch_layout_holds_every_region() {
        let m = Layout::of(Factoring::Matrices { batch: 3, rows: 70, cols: 2 * TILE + 5 }, 3 * 70 * (2 * TILE + 5));
        assert_eq!(m.len, 3 * 70 * 3);
        let regions = [
            (m.w2, 8 * m.len),
            (m.u2, 8 * m.len),
            (m.ta, 8 * m.len.div_ceil(32)),
            (m.tb, 8 * m.len.div_ceil(1024)),
            (m.mean_r, 8 * 3),
            (m.ra, 8 * 3 * 3),
            (m.rb, 8 * 3),
            (m.inv_c, 4 * 3 * (2 * TILE + 5)),
            (m.inv_sqrt_c, 4 * 3 * (2 * TILE + 5)),
            (m.out, 16),
        ];
        for (i, &(start, len)) in regions.iter().enumerate() {
            assert_eq!(start % 8, 0, "region {i}");
            let end = regions.get(i + 1).map_or(m.bytes, |r| r.0);
            assert!(start + len <= end, "region {i} overlaps the next");
        }
        let v = Layout::of(Factoring::Elements, 5000);
        assert_eq!(v.len, 5);
        assert_eq!((v.mean_r, v.inv_c), (v.ra, v.inv_sqrt_c), "no matrix regions for a vector");
        assert_eq!(v.bytes, 8 * (5 + 5 + 1 + 1) + 16);
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
        let good = [buf(3, DType::F32), buf(5, DType::F32), buf(1, DType::U32)];
        let step = |opt: &mut Adafactor, info: &ParamInfo<'_>, g: &CudaBuf, state: &[CudaBuf]| {
            opt.step_cuda(info, &w, g, state, &ctx, &stream).unwrap_err().message.to_string()
        };
        let mut opt = Adafactor::default();
        assert_eq!(step(&mut opt, &info, &buf(14, DType::F32), &good), "grad has 14 f32 elements, expected 15 f32");
        assert_eq!(
            step(&mut opt, &info, &w, &good[..2]),
            "adafactor expects 3 state buffers (exp_avg_sq_row, exp_avg_sq_col, step) for \
             model.layers.0.mlp.up_proj.weight of shape [3, 5], got 2"
        );
        let mut bad = good;
        bad[1] = buf(3, DType::F32);
        assert_eq!(step(&mut opt, &info, &w, &bad), "exp_avg_sq_col has 3 f32 elements, expected 5 f32");
        let mut bad = good;
        bad[2] = buf(1, DType::F32);
        assert_eq!(step(&mut opt, &info, &w, &bad), "step has 1 f32 elements, expected 1 u32");
        let mut with_m = Adafactor { beta1: Some(0.9), ..Adafactor::default() };
        let state = [buf(15, DType::BF16), good[0], good[1], good[2]];
        assert_eq!(step(&mut with_m, &info, &w, &state), "exp_avg has 15 bf16 elements, expected 15 f32");
        // A vector's one second moment.
        let small = [15u64];
        let vector = ParamInfo::new("model.norm.weight", &small);
        let state = [buf(14, DType::F32), buf(1, DType::U32)];
        assert_eq!(step(&mut opt, &vector, &w, &state), "exp_avg_sq has 14 f32 elements, expected 15 f32");
    }
}
