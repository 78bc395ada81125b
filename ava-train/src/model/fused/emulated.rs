//! The GPU kernels of the fused ops (`kernels/fused.cu`), run on the CPU, against the CPU ops.
//!
//! The kernel emulator (ava-cuda-emu) compiles fused.cu with the system's C++ compiler and runs
//! each kernel with the grid the `cuda` module launches it with (module `launch`, shared with
//! it) and its arguments in the launcher's order, host memory standing in for the device's.
//! So every kernel is tested wherever `cargo test` runs, GPU or `cuda` feature or not; several
//! were written without a GPU at hand (RMSNorm's backward, the Kahan pair, the rounding to
//! nearest), and `tests/gpu_ops.rs` on a GPU stays the test of the device itself.
//!
//! Each case runs the op's launches in the emulator's three orders (lockstep; serial, warp
//! after warp, each up to its next `__syncthreads`; and serial reversed, the last warp and
//! block first), and the outputs must be the same bits: a thread reading what another writes
//! without a barrier between gives other values in one of them. Outputs start as 0xff bytes,
//! NaN in every float type, so an element no thread writes fails the comparison. Inputs come
//! from a fixed-seed generator, rounded to the stored type (f32, bf16, f16) so both sides
//! read the same values, at sizes that end inside a block and take each kernel's wide paths.
//!
//! The comparisons are `gpu_ops`': the roundings (stochastic with the same seed, to nearest,
//! Kahan's pair) and the widenings are the CPU's bits; the other kernels agree within
//! atol + rtol·|cpu|, f32 1e-4 + 1e-3, bf16 1e-2 + 1e-2, f16 2e-3 + 2e-3 (the order of the
//! f32 sums and `expf` against the CPU's fast exp, then one rounding to the type); the copies
//! of the head split and merge are bits; the sum of squares is within 1e-5 relative (+ 1e-6)
//! of an f64 sum. Every case runs and every failure is reported: the kernel, type and shape,
//! how many elements differ and the worst.

use std::error::Error;
use std::ffi::c_void;
use std::path::Path;
use std::sync::{Arc, OnceLock};

use ava_cuda_emu::{Build, Emulator, Order, Shape};
use candle_core::{DType, Device, Tensor, Var};
use half::{bf16, f16};

use super::launch::{self, Grid, NORM_BWD_ROWS};
use super::{RopeTables, merge_heads, rms_norm, split_heads, swiglu_gate};
use crate::model::{RopeScaling, RopeSpec, ops};
use crate::train::rounding::{self, Half};

/// RMSNorm's ε in these cases (the `cuda` module hands the kernel `eps as f32`).
const EPS: f64 = 1e-5;

/// A launch's or a reference's error.
type Outcome<T> = Result<T, Box<dyn Error>>;

/// The emulator with fused.cu loaded (compiled once per change of the file, then reused from
/// the temporary directory).
fn emulator() -> &'static Emulator {
    static EMU: OnceLock<Emulator> = OnceLock::new();
    EMU.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let build = Build {
            sources: vec![root.join("kernels/fused.cu")],
            includes: vec![root.join("../ava-cuda-build/include")],
            out_dir: ava_cuda_emu::cache_dir().unwrap_or_else(|e| panic!("{e}")),
        };
        Emulator::build(&build).unwrap_or_else(|e| panic!("{e}"))
    })
}

/// `n` values in [-scale, scale), a pure function of `seed` (gpu_ops' generator).
fn data(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    ava_kernels::testing::Rng(seed).vec(n).into_iter().map(|x| x * scale).collect()
}

/// A stored element type of the kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ty {
    F32,
    Bf16,
    F16,
}

/// The types every fused op has kernels for.
const TYPES: [Ty; 3] = [Ty::F32, Ty::Bf16, Ty::F16];

impl Ty {
    fn dtype(self) -> DType {
        match self {
            Ty::F32 => DType::F32,
            Ty::Bf16 => DType::BF16,
            Ty::F16 => DType::F16,
        }
    }

    /// The kernels' name suffix.
    fn suffix(self) -> &'static str {
        match self {
            Ty::F32 => "f32",
            Ty::Bf16 => "bf16",
            Ty::F16 => "f16",
        }
    }

    /// Bytes an element.
    fn size(self) -> usize {
        self.dtype().size_in_bytes()
    }

    /// `x` rounded to the type (nearest, ties to even), as its stored bytes.
    fn store(self, x: &[f32]) -> Vec<u8> {
        match self {
            Ty::F32 => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Ty::Bf16 => x.iter().flat_map(|v| bf16::from_f32(*v).to_le_bytes()).collect(),
            Ty::F16 => x.iter().flat_map(|v| f16::from_f32(*v).to_le_bytes()).collect(),
        }
    }

    /// Stored bytes widened to f32 (exact).
    fn load(self, b: &[u8]) -> Vec<f32> {
        match self {
            Ty::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            Ty::Bf16 => b.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            Ty::F16 => b.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        }
    }

    /// Each element's bits.
    fn bits(self, b: &[u8]) -> Vec<u32> {
        match self {
            Ty::F32 => b.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            Ty::Bf16 | Ty::F16 => b.chunks_exact(2).map(|c| u32::from(u16::from_le_bytes([c[0], c[1]]))).collect(),
        }
    }

    /// `x` rounded to the type and widened back: values both sides read alike.
    fn round(self, x: &[f32]) -> Vec<f32> {
        self.load(&self.store(x))
    }

    /// A CPU tensor of the type holding `x` (values of the type already: the cast is exact).
    fn tensor(self, x: &[f32], shape: &[usize]) -> Tensor {
        Tensor::from_slice(x, shape, &Device::Cpu).and_then(|t| t.to_dtype(self.dtype())).expect("a CPU tensor")
    }

    /// gpu_ops' tolerance (atol, rtol) for the type.
    fn tolerance(self) -> (f32, f32) {
        match self {
            Ty::F32 => (1e-4, 1e-3),
            Ty::Bf16 => (1e-2, 1e-2),
            Ty::F16 => (2e-3, 2e-3),
        }
    }
}

/// Device memory on the host: bytes, 16-byte aligned as the device's allocations are.
struct Buf {
    words: Vec<u128>,
    len: usize,
}

impl Buf {
    /// A buffer holding `bytes`.
    fn new(bytes: &[u8]) -> Self {
        let mut b = Self::output(bytes.len());
        bytemuck::cast_slice_mut::<u128, u8>(&mut b.words)[..bytes.len()].copy_from_slice(bytes);
        b
    }

    /// An output of `len` bytes, all 0xff (NaN in every float type): an element the kernel
    /// leaves unwritten fails the comparison.
    fn output(len: usize) -> Self {
        Self { words: vec![u128::MAX; len.div_ceil(16).max(1)], len }
    }

    fn bytes(&self) -> Vec<u8> {
        bytemuck::cast_slice::<u128, u8>(&self.words)[..self.len].to_vec()
    }
}

/// A kernel argument, as the `cuda` module pushes it onto its launch.
enum Arg<'a> {
    /// A buffer the kernel reads.
    In(&'a Buf),
    /// A buffer the kernel writes.
    Out(&'a mut Buf),
    /// A null device pointer (no rotary tables, no positions).
    Null,
    I32(i32),
    F32(f32),
    /// A `size_t`.
    Size(usize),
    U64(u64),
}

impl Arg<'_> {
    /// The argument's bits in a 64-bit slot: the kernel's caller reads its parameter's type
    /// from the slot's start (little-endian), as `cuLaunchKernel` reads each address.
    fn slot(self) -> u64 {
        match self {
            Arg::In(b) => b.words.as_ptr() as u64,
            Arg::Out(b) => b.words.as_mut_ptr() as u64,
            Arg::Null => 0,
            Arg::I32(v) => u64::from(v as u32),
            Arg::F32(v) => u64::from(v.to_bits()),
            Arg::Size(v) => v as u64,
            Arg::U64(v) => v,
        }
    }
}

/// Runs `kernel` on the emulator as a `grid` launch with `args` in their order, its block's
/// threads in `order`.
fn launch(kernel: &str, grid: Grid, order: Order, args: Vec<Arg<'_>>) -> Outcome<()> {
    let mut slots: Vec<u64> = args.into_iter().map(Arg::slot).collect();
    let mut params: Vec<*mut c_void> = slots.iter_mut().map(|s| (s as *mut u64).cast()).collect();
    // SAFETY: each slot holds its parameter's value (the emulator checks their number, the
    // cases follow fused.cu's signatures); the buffers outlive the launch and hold what the
    // grid reads and writes.
    unsafe { emulator().call(kernel, Shape::linear(grid.blocks, grid.threads), order, &mut params) }?;
    Ok(())
}

/// Runs `launches` (an op's launches as the `cuda` module makes them, into fresh outputs) in
/// the emulator's lockstep order and again in its two serial orders, and returns the lockstep
/// run's outputs (`names` name them); `None` once `failures` says why there are none (a launch
/// refused or failed). Outputs whose bits differ between the orders are a race: a failure,
/// and still returned for the comparison with the CPU.
fn run_both<const N: usize>(
    what: &str,
    names: [&str; N],
    failures: &mut Vec<String>,
    launches: impl Fn(Order) -> Outcome<[Vec<u8>; N]>,
) -> Option<[Vec<u8>; N]> {
    let lockstep = match launches(Order::Lockstep) {
        Ok(out) => out,
        Err(e) => {
            failures.push(format!("{what}: {e}"));
            return None;
        }
    };
    for order in [Order::Serial, Order::SerialReversed] {
        match launches(order) {
            Ok(other) => {
                for ((name, a), b) in names.iter().zip(&lockstep).zip(&other) {
                    let bytes = a.iter().zip(b).filter(|(x, y)| x != y).count();
                    if bytes > 0 {
                        failures.push(format!(
                            "{what}: {name}: the {order:?} order gave other bits than the lockstep order ({bytes} of \
                             {} bytes): a race",
                            a.len()
                        ));
                    }
                }
            }
            Err(e) => failures.push(format!("{what} ({order:?} order): {e}")),
        }
    }
    Some(lockstep)
}

/// The kernel's output `got` against the CPU's `want`, both f32 values: the elements beyond
/// atol + rtol·|want| (NaN, an element left unwritten, counts as the worst), how many and the
/// worst; `None` when none is.
fn within(what: &str, got: &[f32], want: &[f32], (atol, rtol): (f32, f32)) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!("{what}: {} elements, the CPU's {}", got.len(), want.len()));
    }
    let (mut bad, mut worst) = (0usize, None::<(usize, f32)>);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if g == w || (g.is_nan() && w.is_nan()) {
            continue;
        }
        let excess = (g - w).abs() - (atol + rtol * w.abs());
        let excess = if excess.is_nan() { f32::INFINITY } else { excess };
        if excess > 0.0 {
            bad += 1;
            if worst.is_none_or(|(_, e)| excess > e) {
                worst = Some((i, excess));
            }
        }
    }
    let (i, _) = worst?;
    Some(format!(
        "{what}: {bad} of {} elements differ, worst [{i}] = {} against the CPU's {} (atol {atol}, rtol {rtol})",
        got.len(),
        got[i],
        want[i]
    ))
}

/// The kernel's output `got` against the CPU's `want`, both stored bytes of `ty`: the
/// elements whose bits differ (a NaN matches a NaN, the device's conversions writing the
/// canonical one, unless it is the 0xff fill: an element left unwritten), how many and the
/// worst; `None` when none does.
fn same_bits(what: &str, ty: Ty, got: &[u8], want: &[u8]) -> Option<String> {
    let (gb, wb, gv, wv) = (ty.bits(got), ty.bits(want), ty.load(got), ty.load(want));
    if gb.len() != wb.len() {
        return Some(format!("{what}: {} elements, the CPU's {}", gb.len(), wb.len()));
    }
    let fill = if ty == Ty::F32 { u32::MAX } else { 0xffff };
    let (mut bad, mut worst) = (0usize, None::<(usize, f32)>);
    for i in 0..gb.len() {
        if gb[i] == wb[i] || (gv[i].is_nan() && wv[i].is_nan() && gb[i] != fill) {
            continue;
        }
        bad += 1;
        let err = (gv[i] - wv[i]).abs();
        let err = if err.is_nan() { f32::INFINITY } else { err };
        if worst.is_none_or(|(_, e)| err > e) {
            worst = Some((i, err));
        }
    }
    let (i, _) = worst?;
    Some(format!(
        "{what}: {bad} of {} elements differ in their bits, worst [{i}] = {} ({:#x}) against the CPU's {} ({:#x})",
        gb.len(),
        gv[i],
        gb[i],
        wv[i],
        wb[i]
    ))
}

/// The CPU op `f` on `inputs` (values of `ty` with their shapes, as `Var`s), widened to f32,
/// and each input's gradient for the upstream gradient `up` (the output's shape, values of
/// `ty`): backward of Σ f(..) ∘ up, which hands `up` itself to the op's backward.
fn cpu_value_and_grads(
    ty: Ty,
    inputs: &[(&[f32], &[usize])],
    up: &[f32],
    f: impl Fn(&[Tensor]) -> candle_core::Result<Tensor>,
) -> Outcome<(Vec<f32>, Vec<Vec<f32>>)> {
    let vars =
        inputs.iter().map(|(x, s)| Var::from_tensor(&ty.tensor(x, s))).collect::<candle_core::Result<Vec<_>>>()?;
    let tensors: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let out = f(&tensors)?;
    let up = ty.tensor(up, out.dims());
    let grads = out.mul(&up)?.to_dtype(DType::F32)?.sum_all()?.backward()?;
    let flat = |t: &Tensor| t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>();
    let mut g = Vec::new();
    for v in &vars {
        g.push(flat(grads.get(v.as_tensor()).ok_or("an input without a gradient")?)?);
    }
    Ok((flat(&out)?, g))
}

/// Asserts that no case failed, listing every failure.
fn assert_none(failures: &[String], cases: usize) {
    assert!(failures.is_empty(), "{} failure(s) in {cases} cases:\n{}", failures.len(), failures.join("\n"));
}

// ---- RMSNorm ----

/// RMSNorm on `rows` rows of `d`: `rms_norm_fwd_*`, then `rms_norm_bwd_*` and `column_sums_*`
/// as `norm::cuda::rms_norm_fwd` and `norm::cuda::rms_norm_bwd` launch them, against the CPU op's value
/// and autograd gradients (dx, dw).
fn rms_norm_case(ty: Ty, rows: usize, d: usize, failures: &mut Vec<String>) {
    let (s, size) = (ty.suffix(), ty.size());
    let what = format!("rms_norm_fwd_{s} / rms_norm_bwd_{s} + column_sums_{s} (rows {rows}, d {d})");
    let x = ty.round(&data(rows * d, 1, 2.0)); // (rows, d)
    let w = ty.round(&data(d, 2, 1.0)); // (d,)
    let g = ty.round(&data(rows * d, 3, 1.0)); // (rows, d) the upstream gradient
    let (bx, bw, bg) = (Buf::new(&ty.store(&x)), Buf::new(&ty.store(&w)), Buf::new(&ty.store(&g)));
    let (ri, di, eps) = (rows as i32, d as i32, EPS as f32);
    let names = ["y (rms_norm_fwd)", "dx (rms_norm_bwd)", "dw (rms_norm_bwd + column_sums)", "partial"];
    let Some([y, dx, dw, _]) = run_both(&what, names, failures, |order| {
        use Arg::*;
        let mut y = Buf::output(rows * d * size); // (rows, d)
        if rows > 0 {
            let args = vec![In(&bx), In(&bw), Out(&mut y), I32(di), F32(eps)];
            launch(&format!("rms_norm_fwd_{s}"), launch::rms_norm_fwd(rows)?, order, args)?;
        }
        let blocks = launch::norm_bwd_blocks(rows);
        let mut dx = Buf::output(rows * d * size); // (rows, d)
        let mut partial = Buf::output(blocks * d * 4); // (blocks, d) f32
        let mut dw = Buf::output(d * size); // (d,)
        if rows > 0 {
            let per = NORM_BWD_ROWS as i32;
            let args =
                vec![In(&bx), In(&bw), In(&bg), Out(&mut dx), Out(&mut partial), I32(ri), I32(di), F32(eps), I32(per)];
            launch(&format!("rms_norm_bwd_{s}"), launch::rms_norm_bwd(rows, d)?, order, args)?;
        }
        let args = vec![In(&partial), Out(&mut dw), I32(blocks as i32), I32(di)];
        launch(&format!("column_sums_{s}"), launch::column_sums(d)?, order, args)?;
        Ok([y.bytes(), dx.bytes(), dw.bytes(), partial.bytes()])
    }) else {
        return;
    };
    let cpu = cpu_value_and_grads(ty, &[(&x, &[rows, d]), (&w, &[d])], &g, |t| rms_norm(&t[0], &t[1], EPS));
    let (want_y, want_g) = match cpu {
        Ok(c) => c,
        Err(e) => return failures.push(format!("{what}: the CPU op: {e}")),
    };
    let tol = ty.tolerance();
    failures.extend(within(&format!("{what}: y"), &ty.load(&y), &want_y, tol));
    failures.extend(within(&format!("{what}: dx"), &ty.load(&dx), &want_g[0], tol));
    failures.extend(within(&format!("{what}: dw"), &ty.load(&dw), &want_g[1], tol));
}

/// RMSNorm's kernels against the CPU in every type: rows of 64 (a 256-thread block, most
/// threads idle), 4100 (a backward block of 544 threads, the last column ragged) and 8192 (the
/// widest the backward takes: 1024 threads of 8 columns); row counts that leave the last block
/// of the backward's NORM_BWD_ROWS short; and no rows (dw is then zeros, `column_sums` over no
/// blocks).
#[test]
fn rms_norm_kernels_match_the_cpu() {
    let mut failures = Vec::new();
    let shapes = [(37, 64), (19, 4100), (18, 8192), (0, 64)];
    for (rows, d) in shapes {
        for ty in TYPES {
            rms_norm_case(ty, rows, d, &mut failures);
        }
    }
    assert_none(&failures, shapes.len() * TYPES.len());
}

// ---- SwiGLU ----

/// The SwiGLU gate on `n` elements: `swiglu_fwd_*` and `swiglu_bwd_*` as `swiglu::cuda::swiglu_fwd`
/// and `swiglu::cuda::swiglu_bwd` launch them, against the CPU op's value and gradients (dg, du).
fn swiglu_case(ty: Ty, n: usize, failures: &mut Vec<String>) {
    let (s, size) = (ty.suffix(), ty.size());
    let what = format!("swiglu_fwd_{s} / swiglu_bwd_{s} (n {n})");
    let g = ty.round(&data(n, 4, 4.0)); // (n,)
    let u = ty.round(&data(n, 5, 2.0)); // (n,)
    let dh = ty.round(&data(n, 6, 1.0)); // (n,) the upstream gradient
    let (bg, bu, bd) = (Buf::new(&ty.store(&g)), Buf::new(&ty.store(&u)), Buf::new(&ty.store(&dh)));
    let Some([h, dg, du]) =
        run_both(&what, ["h (swiglu_fwd)", "dg (swiglu_bwd)", "du (swiglu_bwd)"], failures, |order| {
            use Arg::*;
            let (mut h, mut dg, mut du) = (Buf::output(n * size), Buf::output(n * size), Buf::output(n * size));
            let grid = launch::elementwise(n)?;
            launch(&format!("swiglu_fwd_{s}"), grid, order, vec![In(&bg), In(&bu), Out(&mut h), Size(n)])?;
            let args = vec![In(&bg), In(&bu), In(&bd), Out(&mut dg), Out(&mut du), Size(n)];
            launch(&format!("swiglu_bwd_{s}"), grid, order, args)?;
            Ok([h.bytes(), dg.bytes(), du.bytes()])
        })
    else {
        return;
    };
    let (want_h, want_g) = match cpu_value_and_grads(ty, &[(&g, &[n]), (&u, &[n])], &dh, |t| swiglu_gate(&t[0], &t[1]))
    {
        Ok(c) => c,
        Err(e) => return failures.push(format!("{what}: the CPU op: {e}")),
    };
    let tol = ty.tolerance();
    failures.extend(within(&format!("{what}: h"), &ty.load(&h), &want_h, tol));
    failures.extend(within(&format!("{what}: dg"), &ty.load(&dg), &want_g[0], tol));
    failures.extend(within(&format!("{what}: du"), &ty.load(&du), &want_g[1], tol));
}

/// The SwiGLU kernels against the CPU in every type: one element (a block of 255 idle
/// threads), and sizes ending inside a block.
#[test]
fn swiglu_kernels_match_the_cpu() {
    let mut failures = Vec::new();
    let sizes = [1, 1000, 4097];
    for n in sizes {
        for ty in TYPES {
            swiglu_case(ty, n, &mut failures);
        }
    }
    assert_none(&failures, sizes.len() * TYPES.len());
}

// ---- heads split/merge with the rotary embedding ----

/// The f32 tables (cos, sin), (T, D) each, that the CPU's split applies for `rope`: read back
/// from the op itself in f32, rotating head rows (1…1 | 0…0), which gives (cos₁ | sin₂), and
/// (0…0 | 1…1), which gives (−sin₁ | cos₂), so the kernel gets exactly the CPU's tables.
fn tables_of(rope: &Arc<RopeTables>, t: usize, d: usize) -> (Vec<f32>, Vec<f32>) {
    let h = d / 2;
    let rotated = |ones_first: bool| -> Vec<f32> {
        let row: Vec<f32> = (0..d).map(|j| if (j < h) == ones_first { 1.0 } else { 0.0 }).collect(); // (D,)
        let p = Tensor::from_slice(&row.repeat(t), (t, d), &Device::Cpu).expect("a CPU tensor"); // (T, D)
        let out = split_heads(&p, 1, t, 1, Some(rope), None).expect("the CPU's split");
        out.flatten_all().and_then(|o| o.to_vec1::<f32>()).expect("f32 values") // (1, 1, T, D)
    };
    let (ones_first, ones_second) = (rotated(true), rotated(false));
    let (mut cos, mut sin) = (vec![0f32; t * d], vec![0f32; t * d]);
    for i in 0..t * d {
        if i % d < h {
            cos[i] = ones_first[i];
            sin[i] = 0.0 - ones_second[i];
        } else {
            cos[i] = ones_second[i];
            sin[i] = ones_first[i];
        }
    }
    (cos, sin)
}

/// One move of `heads_*` (`rope::cuda::HeadsMove`'s kernel arguments).
struct Move<'a> {
    /// (B, C, T, D) → (B·T, C·D); else the split.
    merge: bool,
    /// The transposed rotation (backward).
    transposed: bool,
    /// The rotary tables (cos, sin), (T, D) f32 each; `None`: a copy.
    tables: Option<&'a (Buf, Buf)>,
    /// (B·T,) u32 each token's position; `None`: its index t.
    positions: Option<&'a Buf>,
}

/// One `heads_*` launch as `rope::cuda::heads` makes it: `src` (values of `ty`, B·C·T·D of them)
/// moved as `m` says. The moved bytes, or `None` (in `failures`).
fn heads_kernel(
    what: &str,
    ty: Ty,
    src: &[f32],
    [b, c, t, d]: [usize; 4],
    m: &Move<'_>,
    failures: &mut Vec<String>,
) -> Option<Vec<u8>> {
    let n = b * c * t * d;
    let bs = Buf::new(&ty.store(src));
    let [moved] = run_both(what, ["dst"], failures, |order| {
        use Arg::*;
        let mut dst = Buf::output(n * ty.size());
        let (cos, sin) = m.tables.map_or((Null, Null), |(c, s)| (In(c), In(s)));
        let pos = m.positions.map_or(Null, In);
        let [db, dc, dt, dd] = [b, c, t, d].map(|x| I32(x as i32));
        let (merge, transposed) = (I32(i32::from(m.merge)), I32(i32::from(m.transposed)));
        let args = vec![In(&bs), Out(&mut dst), cos, sin, pos, db, dc, dt, dd, merge, transposed];
        launch(&format!("heads_{}", ty.suffix()), launch::heads(n, m.tables.is_some())?, order, args)?;
        Ok([dst.bytes()])
    })?;
    Some(moved)
}

/// The head split (B·T, C·D) → (B, C, T, D) with the rotary embedding of `spec`, and its
/// backward (the transposed rotation, merging back), for each way of placing tokens (their
/// index, or `positions`), against the CPU's split and its autograd gradient.
fn rotary_cases(
    ty: Ty,
    [b, t, c, d]: [usize; 4],
    (name, spec): (&str, &RopeSpec),
    failures: &mut Vec<String>,
) -> usize {
    let rope = RopeTables::new(t, d, spec).expect("rotary tables");
    let (cos, sin) = tables_of(&rope, t, d);
    let tables = (Buf::new(&Ty::F32.store(&cos)), Buf::new(&Ty::F32.store(&sin))); // (T, D) f32 each
    // Packed documents: positions restart inside a sequence, every 3 tokens in the first, 4 in
    // the second (a position read from the wrong sequence shows).
    let positions: Arc<[u32]> = (0..b * t).map(|i| ((i % t) % (3 + i / t)) as u32).collect();
    let pos_buf = Buf::new(bytemuck::cast_slice(&positions));
    let p = ty.round(&data(b * t * c * d, 7, 1.0)); // (B·T, C·D)
    let up = ty.round(&data(b * c * t * d, 8, 1.0)); // (B, C, T, D) the upstream gradient
    let mut cases = 0;
    for pos in [None, Some(&positions)] {
        cases += 1;
        let s = ty.suffix();
        let what = format!("heads_{s} (B {b}, T {t}, C {c}, D {d}) rotary {name}, positions {}", pos.is_some());
        let cpu =
            cpu_value_and_grads(ty, &[(&p, &[b * t, c * d])], &up, |x| split_heads(&x[0], b, t, c, Some(&rope), pos));
        let (want, want_g) = match cpu {
            Ok(r) => r,
            Err(e) => {
                failures.push(format!("{what}: the CPU op: {e}"));
                continue;
            }
        };
        let shape = [b, c, t, d];
        let on_device = pos.map(|_| &pos_buf); // the kernel's positions argument
        let split = format!("{what}: the split (merge 0, transposed 0)");
        let m = Move { merge: false, transposed: false, tables: Some(&tables), positions: on_device };
        if let Some(got) = heads_kernel(&split, ty, &p, shape, &m, failures) {
            failures.extend(within(&split, &ty.load(&got), &want, ty.tolerance()));
        }
        let back = format!("{what}: its backward (merge 1, transposed 1)");
        let m = Move { merge: true, transposed: true, tables: Some(&tables), positions: on_device };
        if let Some(got) = heads_kernel(&back, ty, &up, shape, &m, failures) {
            failures.extend(within(&back, &ty.load(&got), &want_g[0], ty.tolerance()));
        }
    }
    cases
}

/// A CPU op on input tensors, for a table of cases.
type CpuOp<'a> = &'a dyn Fn(&[Tensor]) -> candle_core::Result<Tensor>;

/// The copies: the split without rotation (v) and the merge (B, C, T, D) → (B·T, C·D), each
/// with its backward, against the CPU's bit for bit (a copy is a copy).
fn copy_cases(ty: Ty, [b, t, c, d]: [usize; 4], failures: &mut Vec<String>) -> usize {
    let s = ty.suffix();
    let shape = [b, c, t, d];
    let x = ty.round(&data(b * t * c * d, 9, 1.0)); // (B·T, C·D) or (B, C, T, D)
    let up = ty.round(&data(b * t * c * d, 10, 1.0)); // the upstream gradient, the other layout
    let what = format!("heads_{s} (B {b}, T {t}, C {c}, D {d}) without rotation");
    let split = |x: &[Tensor]| split_heads(&x[0], b, t, c, None, None);
    let merge = |x: &[Tensor]| merge_heads(&x[0]);
    let ops: [(&str, &[usize], bool, CpuOp<'_>); 2] =
        [("split", &[b * t, c * d], false, &split), ("merge", &[b, c, t, d], true, &merge)];
    for (name, in_shape, merged, op) in ops {
        let (want, want_g) = match cpu_value_and_grads(ty, &[(&x, in_shape)], &up, op) {
            Ok(r) => r,
            Err(e) => {
                failures.push(format!("{what}: the CPU's {name}: {e}"));
                continue;
            }
        };
        let fwd = format!("{what}: the {name} (merge {})", i32::from(merged));
        let m = Move { merge: merged, transposed: false, tables: None, positions: None };
        if let Some(got) = heads_kernel(&fwd, ty, &x, shape, &m, failures) {
            failures.extend(same_bits(&fwd, ty, &got, &ty.store(&want)));
        }
        let bwd = format!("{what}: the {name}'s backward (merge {}, transposed 1)", i32::from(!merged));
        let m = Move { merge: !merged, transposed: true, tables: None, positions: None };
        if let Some(got) = heads_kernel(&bwd, ty, &up, shape, &m, failures) {
            failures.extend(same_bits(&bwd, ty, &got, &ty.store(&want_g[0])));
        }
    }
    2
}

/// `heads_*` against the CPU in every type: the rotary split and its backward with plain RoPE
/// and YaRN (cos and sin scaled by its attention factor), tokens at their index and at packed
/// documents' positions; the copies both ways. Head sizes 16 and 36 (half a row 18: pairs
/// whose count is no power of two), element counts ending inside a block.
#[test]
fn heads_kernels_match_the_cpu() {
    let yarn = RopeScaling::Yarn {
        factor: 4.0,
        original_max_position: 4,
        attention_factor: None,
        beta_fast: 32.0,
        beta_slow: 1.0,
        mscale: 0.0,
        mscale_all_dim: 0.0,
        truncate: true,
    };
    let specs = [("plain", RopeSpec::plain(10_000.0)), ("YaRN", RopeSpec { theta: 500.0, scaling: yarn })];
    let (mut failures, mut cases) = (Vec::new(), 0);
    for shape in [[2, 7, 3, 16], [1, 9, 4, 36]] {
        for ty in TYPES {
            for (name, spec) in &specs {
                cases += rotary_cases(ty, shape, (name, spec), &mut failures);
            }
            cases += copy_cases(ty, shape, &mut failures);
        }
    }
    assert_none(&failures, cases);
}

// ---- cross-entropy ----

/// Cross-entropy on logits (rows, v): `cross_entropy_fwd_*` (each row's loss, f32) and
/// `cross_entropy_bwd_*` (the logits' gradient for per-row upstream gradients) as
/// `cuda::cross_entropy_fwd` and `cuda::cross_entropy_bwd` launch them, against the CPU's
/// `ops::cross_entropy_rows` and `ops::cross_entropy_grad` on the same logits.
fn cross_entropy_case(ty: Ty, rows: usize, v: usize, failures: &mut Vec<String>) {
    let s = ty.suffix();
    let what = format!("cross_entropy_fwd_{s} / cross_entropy_bwd_{s} (rows {rows}, V {v})");
    let logits = ty.round(&data(rows * v, 11, 8.0)); // (rows, V)
    // The vocabulary's first and last tokens among the targets.
    let targets: Vec<u32> = (0..rows)
        .map(|i| {
            if i == 0 {
                0
            } else if i == 1 {
                v as u32 - 1
            } else {
                (i * 7919 % v) as u32
            }
        })
        .collect();
    let grad_rows = data(rows, 12, 1.0); // (rows,) f32
    let (bl, bt, bg) =
        (Buf::new(&ty.store(&logits)), Buf::new(bytemuck::cast_slice(&targets)), Buf::new(&Ty::F32.store(&grad_rows)));
    let names = ["loss (cross_entropy_fwd)", "grad (cross_entropy_bwd)"];
    let Some([loss, grad]) = run_both(&what, names, failures, |order| {
        use Arg::*;
        let (mut loss, mut grad) = (Buf::output(rows * 4), Buf::output(rows * v * ty.size()));
        let grid = launch::cross_entropy(rows)?;
        let vi = I32(v as i32);
        launch(&format!("cross_entropy_fwd_{s}"), grid, order, vec![In(&bl), In(&bt), Out(&mut loss), vi])?;
        let args = vec![In(&bl), In(&bt), In(&bg), Out(&mut grad), I32(v as i32)];
        launch(&format!("cross_entropy_bwd_{s}"), grid, order, args)?;
        Ok([loss.bytes(), grad.bytes()])
    }) else {
        return;
    };
    let cpu = || -> Outcome<(Vec<f32>, Vec<f32>)> {
        let l = ty.tensor(&logits, &[rows, v]);
        let loss = ops::cross_entropy_rows(&l, &targets)?.to_vec1::<f32>()?;
        let up = Tensor::from_slice(&grad_rows, rows, &Device::Cpu)?;
        let grad = ops::cross_entropy_grad(&l, &targets, &up)?.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?;
        Ok((loss, grad))
    };
    let (want_loss, want_grad) = match cpu() {
        Ok(r) => r,
        Err(e) => return failures.push(format!("{what}: the CPU op: {e}")),
    };
    // The loss is f32 whichever the logits' type: gpu_ops compares it at the logits' tolerance.
    failures.extend(within(&format!("{what}: loss"), &Ty::F32.load(&loss), &want_loss, ty.tolerance()));
    failures.extend(within(&format!("{what}: grad"), &ty.load(&grad), &want_grad, ty.tolerance()));
}

/// The cross-entropy kernels against the CPU in every type: a vocabulary smaller than the
/// block, and ones that end inside a block's stride.
#[test]
fn cross_entropy_kernels_match_the_cpu() {
    let mut failures = Vec::new();
    let shapes = [(3, 100), (5, 300), (4, 2051)];
    for (rows, v) in shapes {
        for ty in TYPES {
            cross_entropy_case(ty, rows, v, &mut failures);
        }
    }
    assert_none(&failures, shapes.len() * TYPES.len());
}

// ---- the token embedding's backward: the CPU's bits ----

/// `embedding_bwd_*` as `embedding::cuda::embedding_bwd` launches it (the host's sort of the positions
/// by token, then a block per table row), against the CPU op's gradient of the table for the
/// same ids and upstream rows: the same bits, as both add a row's tokens in position order in
/// f32 and round once.
fn embedding_case(ty: Ty, v: usize, d: usize, ids: &[u32], failures: &mut Vec<String>) {
    let (s, n) = (ty.suffix(), ids.len());
    let what = format!("embedding_bwd_{s} (V {v}, d {d}, {n} tokens)");
    let up = ty.round(&data(n * d, 21, 1.0)); // (N, d)
    let (offsets, order) = super::positions_by_token(ids, v);
    let (bg, bo, bp) =
        (Buf::new(&ty.store(&up)), Buf::new(bytemuck::cast_slice(&offsets)), Buf::new(bytemuck::cast_slice(&order)));
    let Some([dw]) = run_both(&what, ["dw"], failures, |threads| {
        use Arg::*;
        let mut dw = Buf::output(v * d * ty.size()); // (V, d)
        let args = vec![In(&bg), In(&bo), In(&bp), Out(&mut dw), I32(d as i32)];
        launch(&format!("embedding_bwd_{s}"), launch::embedding_bwd(v, d)?, threads, args)?;
        Ok([dw.bytes()])
    }) else {
        return;
    };
    let tokens = match Tensor::from_slice(ids, n, &Device::Cpu) {
        Ok(t) => t,
        Err(e) => return failures.push(format!("{what}: {e}")),
    };
    let table = vec![0.0; v * d];
    match cpu_value_and_grads(ty, &[(&table, &[v, d])], &up, |t| super::embedding(&t[0], &tokens)) {
        Ok((_, grads)) => failures.extend(same_bits(&format!("{what}: dw"), ty, &dw, &ty.store(&grads[0]))),
        Err(e) => failures.push(format!("{what}: the CPU op: {e}")),
    }
}

/// The embedding's backward against the CPU in every type: a token many times over, tokens
/// once, the vocabulary's first and last, rows no token has (zero), rows narrower than a
/// warp and wider than the block.
#[test]
fn embedding_backward_kernels_match_the_cpu() {
    let mut failures = Vec::new();
    let many: Vec<u32> = (0..300).map(|i| ([7, 7, 3, 49, 0, 7, 12][i % 7] + (i / 97) as u32) % 50).collect();
    let wide: Vec<u32> = (0..120).map(|i| (i * i % 19) as u32).collect();
    let cases: [(usize, usize, &[u32]); 2] = [(50, 24, &many), (20, 300, &wide)];
    for (v, d, ids) in cases {
        for ty in TYPES {
            embedding_case(ty, v, d, ids, &mut failures);
        }
    }
    assert_none(&failures, cases.len() * TYPES.len());
}

// ---- rounding and widening: the CPU's bits ----

/// Values for the roundings: between neighbours, ties to even of both parities at bf16's and
/// f16's unit in the last place, exact ones, zeros, f32's, bf16's and f16's subnormals, f16's
/// overflow, f32's extremes, infinities and NaN; 4 122 in all (not a multiple of the block).
fn rounding_values() -> Vec<f32> {
    let mut values = data(4099, 14, 5.0);
    let ties = |ulp: f32| [1.0 + ulp / 2.0, 1.0 + 1.5 * ulp, -(1.0 + ulp / 2.0), -(1.0 + 1.5 * ulp)];
    values.extend(ties(2f32.powi(-7)));
    values.extend(ties(2f32.powi(-10)));
    values.extend([0.0, -0.0, 1.0, 3.0e-6, -7.0e-8, 1.0e-40, -3.0e-39, 65_519.0, 70_000.0, -1.0e6]);
    values.extend([f32::MAX, f32::MIN_POSITIVE, f32::INFINITY, f32::NEG_INFINITY, f32::NAN]);
    values
}

/// A half slice's bytes.
fn half_bytes<H: Half>(h: &[H]) -> Vec<u8> {
    bytemuck::cast_slice::<H, u8>(h).to_vec()
}

/// The rounding and widening kernels of one half type (`H`, `ty`) as `cuda::round_stochastic`,
/// `round_nearest_storage`, `widen_storage`, `round_compensated_storage` and
/// `widen_compensated_storage` launch them, against `train::rounding` bit for bit. Returns
/// the number of cases.
fn rounding_cases<H: Half>(ty: Ty, failures: &mut Vec<String>) -> usize {
    let s = ty.suffix();
    let values = rounding_values();
    let n = values.len();
    let bx = Buf::new(&Ty::F32.store(&values));
    let seed = 0x5eed_1234_abcd_u64;
    let one = |name: &str, with_seed: bool, failures: &mut Vec<String>| {
        let kernel = format!("{name}_{s}");
        let what = format!("{kernel} (n {n})");
        run_both(&what, ["out"], failures, |order| {
            use Arg::*;
            let mut out = Buf::output(n * ty.size());
            let mut args = vec![In(&bx), Out(&mut out), Size(n)];
            if with_seed {
                args.push(U64(seed));
            }
            launch(&kernel, launch::elementwise(n)?, order, args)?;
            Ok([out.bytes()])
        })
        .map(|[out]| (what, out))
    };
    // Stochastic rounding, the same seed: the same bits drawn from (seed, index).
    let mut cpu = vec![H::nearest(0.0); n];
    rounding::round_stochastic(&values, &mut cpu, seed, 2);
    if let Some((what, got)) = one("round_stochastic", true, failures) {
        failures.extend(same_bits(&what, ty, &got, &half_bytes(&cpu)));
    }
    // To nearest, ties to even (the resident copy of `master_weights: tier`).
    let mut nearest = vec![H::nearest(0.0); n];
    rounding::round_nearest(&values, &mut nearest);
    if let Some((what, got)) = one("round_nearest", false, failures) {
        failures.extend(same_bits(&what, ty, &got, &half_bytes(&nearest)));
    }
    // Widening every half value there is, NaNs and infinities included.
    let all: Vec<H> = (0..=u16::MAX).map(|b| bytemuck::cast::<u16, H>(b)).collect();
    let mut wide = vec![0f32; all.len()]; // (65 536,) f32
    rounding::widen(&all, None, &mut wide);
    let bh = Buf::new(&half_bytes(&all));
    let what = format!("widen_{s} (every {s} value)");
    let got = run_both(&what, ["out"], failures, |order| {
        use Arg::*;
        let mut out = Buf::output(all.len() * 4);
        let args = vec![In(&bh), Out(&mut out), Size(all.len())];
        launch(&format!("widen_{s}"), launch::elementwise(all.len())?, order, args)?;
        Ok([out.bytes()])
    });
    if let Some([got]) = got {
        failures.extend(same_bits(&what, Ty::F32, &got, &Ty::F32.store(&wide)));
    }
    // Kahan: h and c, then h + c widened.
    let (mut h, mut c) = (vec![H::nearest(0.0); n], vec![H::nearest(0.0); n]); // (n,) each
    rounding::round_compensated(&values, &mut h, &mut c);
    let what = format!("round_compensated_{s} (n {n})");
    let got = run_both(&what, ["h", "c"], failures, |order| {
        use Arg::*;
        let (mut gh, mut gc) = (Buf::output(n * ty.size()), Buf::output(n * ty.size()));
        let args = vec![In(&bx), Out(&mut gh), Out(&mut gc), Size(n)];
        launch(&format!("round_compensated_{s}"), launch::elementwise(n)?, order, args)?;
        Ok([gh.bytes(), gc.bytes()])
    });
    if let Some([gh, gc]) = got {
        failures.extend(same_bits(&format!("{what}: h"), ty, &gh, &half_bytes(&h)));
        failures.extend(same_bits(&format!("{what}: c"), ty, &gc, &half_bytes(&c)));
    }
    let mut wide = vec![0f32; n]; // (n,) f32
    rounding::widen(&h, Some(&c), &mut wide);
    let (bh, bc) = (Buf::new(&half_bytes(&h)), Buf::new(&half_bytes(&c)));
    let what = format!("widen_compensated_{s} (n {n})");
    let got = run_both(&what, ["out"], failures, |order| {
        use Arg::*;
        let mut out = Buf::output(n * 4);
        let args = vec![In(&bh), In(&bc), Out(&mut out), Size(n)];
        launch(&format!("widen_compensated_{s}"), launch::elementwise(n)?, order, args)?;
        Ok([out.bytes()])
    });
    if let Some([got]) = got {
        failures.extend(same_bits(&what, Ty::F32, &got, &Ty::F32.store(&wide)));
    }
    5
}

/// The roundings (stochastic with the CPU's seed, to nearest, Kahan's compensated pair) and
/// the widenings (plain, every half value; compensated) give the CPU's bits, in bf16 and f16.
#[test]
fn rounding_and_widening_kernels_give_the_cpus_bits() {
    let mut failures = Vec::new();
    let cases = rounding_cases::<bf16>(Ty::Bf16, &mut failures) + rounding_cases::<f16>(Ty::F16, &mut failures);
    assert_none(&failures, cases);
}

// ---- Σ x² ----

/// `sumsq_many_partial_*` then `sumsq_many_final` over tensors of `sizes`, as
/// `cuda::sums_of_squares` launches them (device addresses in a table, each tensor's blocks
/// from `launch::sumsq_many_first`): the sums in the lockstep order, or why there are none.
fn sumsq_many(ty: Ty, xs: &[Buf], sizes: &[usize], order: Order) -> Outcome<Vec<u8>> {
    use Arg::*;
    let s = ty.suffix();
    let first = launch::sumsq_many_first(sizes)?;
    let blocks = *first.last().expect("tensors + 1") as usize;
    let ptrs: Vec<u64> = xs.iter().map(|b| b.words.as_ptr() as u64).collect();
    let lens: Vec<u64> = sizes.iter().map(|&n| n as u64).collect();
    let (bp, bl, bf) = (
        Buf::new(bytemuck::cast_slice(&ptrs)),
        Buf::new(bytemuck::cast_slice(&lens)),
        Buf::new(bytemuck::cast_slice(&first)),
    );
    let (mut partial, mut out) = (Buf::output(blocks * 4), Buf::output(sizes.len() * 4)); // (blocks,), (tensors,) f32
    let args = vec![In(&bp), In(&bl), In(&bf), I32(sizes.len() as i32), Out(&mut partial)];
    launch(&format!("sumsq_many_partial_{s}"), launch::sumsq_many_partial(blocks)?, order, args)?;
    launch(
        "sumsq_many_final",
        launch::sumsq_many_final(sizes.len())?,
        order,
        vec![In(&partial), In(&bf), Out(&mut out)],
    )?;
    Ok(out.bytes())
}

/// The sums of squares of tensors of `sizes` in one pair of launches: each against an f64
/// sum, and each the bits it has summed alone.
fn sumsq_case(ty: Ty, sizes: &[usize], failures: &mut Vec<String>) {
    let what = format!("sumsq_many_partial_{} + sumsq_many_final (sizes {sizes:?})", ty.suffix());
    let xs: Vec<Vec<f32>> = sizes.iter().map(|&n| ty.round(&data(n, 50 + n as u64, 1.0))).collect();
    let bufs: Vec<Buf> = xs.iter().map(|x| Buf::new(&ty.store(x))).collect();
    let Some([all]) = run_both(&what, ["the sums"], failures, |order| Ok([sumsq_many(ty, &bufs, sizes, order)?]))
    else {
        return;
    };
    let got = Ty::F32.load(&all);
    for (i, x) in xs.iter().enumerate() {
        let want: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        let err = (f64::from(got[i]) - want).abs();
        if err.is_nan() || err > 1e-5 * want + 1e-6 {
            failures.push(format!("{what}: tensor {i}: {} against the f64 sum {want}", got[i]));
        }
        match sumsq_many(ty, &bufs[i..=i], &sizes[i..=i], Order::Lockstep) {
            Ok(alone) => failures.extend(same_bits(
                &format!("{what}: tensor {i} against alone"),
                Ty::F32,
                &all[i * 4..i * 4 + 4],
                &alone,
            )),
            Err(e) => failures.push(format!("{what}: tensor {i} alone: {e}")),
        }
    }
}

/// The sum of squares against an f64 sum in every type, several tensors in one launch: no
/// elements, one, a block's worth and a bit, and more than the first pass's SUMSQ_BLOCKS
/// blocks of 256 threads cover (its threads stride over the rest); each tensor's sum the
/// bits it has alone.
#[test]
fn sum_of_squares_kernels_match_the_cpu() {
    let mut failures = Vec::new();
    for ty in TYPES {
        sumsq_case(ty, &[1000, 0, 1, 300_001, 257], &mut failures);
    }
    assert_none(&failures, TYPES.len());
}

// ---- the checks themselves ----

/// An output element no thread writes keeps its 0xff fill and fails the comparison: here
/// `widen_bf16` launched a block short of its 257 elements.
#[test]
fn an_element_left_unwritten_fails_the_comparison() {
    let values = data(257, 60, 3.0);
    let h: Vec<bf16> = values.iter().map(|&v| bf16::from_f32(v)).collect();
    let bh = Buf::new(&half_bytes(&h));
    let mut out = Buf::output(257 * 4);
    let grid = launch::elementwise(257).unwrap();
    assert_eq!(grid.blocks, 2);
    let short = Grid { blocks: 1, ..grid };
    launch("widen_bf16", short, Order::Lockstep, vec![Arg::In(&bh), Arg::Out(&mut out), Arg::Size(257)]).unwrap();
    let want: Vec<f32> = h.iter().map(|v| v.to_f32()).collect();
    let e = same_bits("widen_bf16", Ty::F32, &out.bytes(), &Ty::F32.store(&want)).expect("a failure");
    assert!(e.starts_with("widen_bf16: 1 of 257 elements differ in their bits, worst [256] = NaN (0xffffffff)"), "{e}");
    let e = within("widen_bf16", &Ty::F32.load(&out.bytes()), &want, (1.0, 1.0)).expect("a failure");
    assert!(e.starts_with("widen_bf16: 1 of 257 elements differ, worst [256] = NaN"), "{e}");
}

/// A launch whose arguments do not match the kernel's parameters is refused before it runs.
#[test]
fn a_launch_with_a_missing_argument_is_refused() {
    let x = Buf::new(&[0; 16]);
    let e = launch("widen_f16", Grid { blocks: 1, threads: 256 }, Order::Lockstep, vec![Arg::In(&x), Arg::Size(4)]);
    assert!(e.unwrap_err().to_string().contains("takes 3 parameters, the launch gives 2"));
}
