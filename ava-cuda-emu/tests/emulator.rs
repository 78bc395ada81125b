//! The emulator itself, on `tests/kernels/selftest.cu`: block reductions, shuffles and ballots
//! give what CUDA's documentation says; the tensor-core fragments multiply as a plain matrix
//! product; a race shows as a difference between the two thread orders; a divergent barrier,
//! a shuffle with lanes gone and an ldmatrix outside shared memory fail the launch, saying
//! where.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use ava_cuda_emu::{Build, EmuError, Emulator, Order, Shape};
use half::bf16;

fn emulator() -> &'static Emulator {
    static EMU: OnceLock<Emulator> = OnceLock::new();
    EMU.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let build = Build {
            sources: vec![root.join("tests/kernels/selftest.cu")],
            includes: vec![root.join("../ava-cuda-build/include")],
            out_dir: PathBuf::from(env!("CARGO_TARGET_TMPDIR")),
        };
        Emulator::build(&build).unwrap_or_else(|e| panic!("{e}"))
    })
}

/// A raw pointer the launch's body copies (the emulator runs it on the launching thread).
#[derive(Clone, Copy)]
struct P<T>(*mut T);

#[test]
fn block_sums_add_each_blocks_slice() {
    let emu = emulator();
    type F = unsafe extern "C" fn(*const f32, *mut f32, i32);
    // SAFETY: block_sums's signature.
    let k: F = unsafe { emu.kernel("block_sums") }.unwrap();
    let n = 1000;
    let x: Vec<f32> = (0..n).map(|i| (i % 17) as f32 - 8.0).collect();
    let mut out = vec![0f32; 4];
    let (px, po) = (P(x.as_ptr().cast_mut()), P(out.as_mut_ptr()));
    // SAFETY: the buffers outlive the launch and hold what the grid touches.
    emu.launch("block_sums", Shape::linear(4, 256), Order::Lockstep, || unsafe { k(px.0, po.0, n as i32) }).unwrap();
    for (b, got) in out.iter().enumerate() {
        let want: f32 = x[b * 256..((b + 1) * 256).min(n)].iter().sum();
        assert_eq!(*got, want, "block {b}");
    }
}

#[test]
fn shuffles_and_ballots_read_the_lanes_cuda_says() {
    let emu = emulator();
    type F = unsafe extern "C" fn(*const i32, *mut i32);
    // SAFETY: shuffles's signature.
    let k: F = unsafe { emu.kernel("shuffles") }.unwrap();
    let x: Vec<i32> = (0..64).map(|i| i * 3 + 1).collect();
    let mut out = vec![0i32; 64 * 5];
    let (px, po) = (P(x.as_ptr().cast_mut()), P(out.as_mut_ptr()));
    // SAFETY: as above.
    emu.launch("shuffles", Shape::linear(1, 64), Order::Lockstep, || unsafe { k(px.0, po.0) }).unwrap();
    for t in 0..64usize {
        let (w, l) = (t / 32 * 32, t % 32);
        let o = &out[t * 5..t * 5 + 5];
        assert_eq!(o[0], x[w + (l ^ 5)], "xor, thread {t}");
        assert_eq!(o[1], if l + 3 < 32 { x[t + 3] } else { x[t] }, "down, thread {t}");
        assert_eq!(o[2], if l >= 2 { x[t - 2] } else { x[t] }, "up, thread {t}");
        assert_eq!(o[3], x[w + 7], "from lane 7, thread {t}");
        let ballot = (0..32).filter(|j| x[w + j] & 1 == 1).fold(0u32, |b, j| b | 1 << j);
        assert_eq!(o[4] as u32, ballot, "ballot, thread {t}");
    }
}

fn run_order(name: &str, order: Order) -> Result<Vec<i32>, EmuError> {
    run_threads(name, 64, order)
}

/// One block of `threads` of an `(int *out)` kernel.
fn run_threads(name: &str, threads: u32, order: Order) -> Result<Vec<i32>, EmuError> {
    let emu = emulator();
    type F = unsafe extern "C" fn(*mut i32);
    // SAFETY: the (int *out) kernels' signature.
    let k: F = unsafe { emu.kernel(name) }.unwrap();
    let mut out = vec![-1i32; threads as usize];
    let po = out.as_mut_ptr();
    // SAFETY: out holds one int per thread.
    emu.launch(name, Shape::linear(1, threads), order, || unsafe { k(po) })?;
    Ok(out)
}

#[test]
fn lanes_at_different_warp_operations_fail_the_launch() {
    for order in Order::ALL {
        let e = run_threads("mixed_warp_ops", 32, order).unwrap_err().to_string();
        assert!(e.contains("lane 0 waits at __syncwarp, lane 16 at __shfl_xor_sync"), "{order:?}: {e}");
    }
}

#[test]
fn a_shuffle_from_a_lane_the_block_lacks_fails_the_launch() {
    let e = run_threads("partial_warp_shuffle", 48, Order::Lockstep).unwrap_err().to_string();
    assert!(e.contains("a shuffle reads a lane the block does not have"), "{e}");
}

#[test]
fn a_race_shows_as_a_difference_between_the_orders_and_a_barrier_removes_it() {
    let racy = (run_order("racy", Order::Lockstep).unwrap(), run_order("racy", Order::SerialReversed).unwrap());
    assert_ne!(racy.0, racy.1, "a read of another thread's write without a barrier depends on the order");
    let want: Vec<i32> = (0..64).map(|t| (t + 1) % 64).collect();
    for order in Order::ALL {
        assert_eq!(run_order("fenced", order).unwrap(), want, "{order:?}");
    }
}

#[test]
fn a_warp_split_between_a_barrier_and_a_shuffle_fails_the_launch() {
    let e = run_order("divergent", Order::Lockstep).unwrap_err().to_string();
    assert!(e.contains("emulated launch of divergent") && e.contains("block (0, 0, 0) cannot go on"), "{e}");
    assert!(e.contains("warp 0: 16 at a warp op, 16 at __syncthreads, 0 done"), "{e}");
}

#[test]
fn a_shuffle_after_lanes_returned_fails_the_launch() {
    let e = run_order("early_return", Order::Lockstep).unwrap_err().to_string();
    assert!(e.contains("warp 0") && e.contains("16 of its lanes returned"), "{e}");
}

fn bf16s(n: usize, seed: u32) -> Vec<bf16> {
    // Small integers and halves: every product and sum is exact in f32.
    (0..n).map(|i| bf16::from_f32(((i as u32 * 7 + seed * 13) % 9) as f32 * 0.5 - 2.0)).collect()
}

#[test]
fn ldmatrix_and_mma_multiply_as_a_matrix_product() {
    let emu = emulator();
    type F = unsafe extern "C" fn(*const bf16, *const bf16, *const bf16, *mut f32, *mut f32);
    // SAFETY: mma_tile's signature.
    let k: F = unsafe { emu.kernel("mma_tile") }.unwrap();
    let (a, bt, v) = (bf16s(256, 1), bf16s(128, 2), bf16s(128, 3));
    let (mut d, mut dv) = (vec![0f32; 128], vec![0f32; 128]);
    let ptrs = (P(a.as_ptr().cast_mut()), P(bt.as_ptr().cast_mut()), P(v.as_ptr().cast_mut()));
    let (pd, pdv) = (P(d.as_mut_ptr()), P(dv.as_mut_ptr()));
    let shape = Shape { grid: (1, 1, 1), block: (32, 1, 1), shared: 2 * (256 + 128 + 128) };
    // SAFETY: the buffers have the sizes the kernel's comment gives.
    emu.launch("mma_tile", shape, Order::Lockstep, || unsafe { k(ptrs.0.0, ptrs.1.0, ptrs.2.0, pd.0, pdv.0) }).unwrap();
    for r in 0..16 {
        for c in 0..8 {
            let want: f32 = (0..16).map(|k| a[r * 16 + k].to_f32() * bt[c * 16 + k].to_f32()).sum();
            assert_eq!(d[r * 8 + c], want, "A·B at ({r}, {c})");
            let want_v: f32 = (0..16).map(|k| a[r * 16 + k].to_f32() * v[k * 8 + c].to_f32()).sum();
            assert_eq!(dv[r * 8 + c], want_v, "A·V at ({r}, {c})");
        }
    }
}

#[test]
fn ldmatrix_outside_shared_memory_fails_the_launch() {
    let emu = emulator();
    type F = unsafe extern "C" fn(*const bf16);
    // SAFETY: ldmatrix_global's signature.
    let k: F = unsafe { emu.kernel("ldmatrix_global") }.unwrap();
    let a = bf16s(64, 0);
    let pa = P(a.as_ptr().cast_mut());
    // SAFETY: the kernel only reads a's 64 elements (and the emulator refuses before it does).
    let e = emu.launch("ldmatrix_global", Shape::linear(1, 32), Order::Lockstep, || unsafe { k(pa.0) }).unwrap_err();
    assert!(e.to_string().contains("outside the block's shared memory"), "{e}");
}

#[test]
fn a_launch_beyond_the_hardware_is_refused() {
    let e = run_shape(Shape::linear(1, 2048)).to_string();
    assert!(e.contains("1 to 1024 threads"), "{e}");
    let e = run_shape(Shape { grid: (1, 1, 1), block: (32, 1, 1), shared: 300 << 10 }).to_string();
    assert!(e.contains("dynamic shared memory"), "{e}");
}

fn run_shape(shape: Shape) -> EmuError {
    emulator().launch("nothing", shape, Order::Lockstep, || {}).unwrap_err()
}

#[test]
fn a_kernel_runs_from_cu_launch_kernels_argument_array_and_a_wrong_count_is_refused() {
    let emu = emulator();
    let x: Vec<f32> = (0..300).map(|i| i as f32).collect();
    let mut out = vec![0f32; 2];
    let (px, po, n) = (x.as_ptr(), out.as_mut_ptr(), 300i32);
    let arg = |v: &dyn std::any::Any| v as *const dyn std::any::Any as *const () as *mut std::ffi::c_void;
    let mut params = [arg(&px), arg(&po), arg(&n)];
    // SAFETY: block_sums's parameters one for one; the buffers hold what the grid touches.
    unsafe { emu.call("block_sums", Shape::linear(2, 256), Order::Lockstep, &mut params) }.unwrap();
    assert_eq!(out, [(0..256).sum::<i32>() as f32, (256..300).sum::<i32>() as f32]);
    // SAFETY: refused before anything runs.
    let e = unsafe { emu.call("block_sums", Shape::linear(2, 256), Order::Lockstep, &mut params[..2]) }.unwrap_err();
    assert!(e.to_string().contains("takes 3 parameters, the launch gives 2"), "{e}");
}

fn cross_warp(name: &str, order: Order) -> Vec<i32> {
    let emu = emulator();
    type F = unsafe extern "C" fn(*mut i32);
    // SAFETY: cross_warp's and cross_warp_fenced's signature.
    let k: F = unsafe { emu.kernel(name) }.unwrap();
    let mut out = vec![0i32; 128];
    let po = P(out.as_mut_ptr());
    let shape = Shape { grid: (2, 1, 1), block: (64, 1, 1), shared: 256 };
    // SAFETY: out holds one int per thread of the two blocks.
    emu.launch(name, shape, order, || unsafe { k(po.0) }).unwrap();
    out
}

#[test]
fn a_warp_reading_another_warps_writes_without_a_barrier_shows_in_the_serial_orders() {
    let want: Vec<i32> = (0..128).map(|t| (t % 64 + 32) % 64 + 1000 * (t / 64)).collect();
    assert_eq!(cross_warp("cross_warp", Order::Lockstep), want, "lockstep: both warps wrote before either reads");
    let serial = cross_warp("cross_warp", Order::Serial);
    assert!(serial[..32].iter().all(|&v| v == -1), "warp 0 first reads cells not yet written (0xff bytes): {serial:?}");
    let reversed = cross_warp("cross_warp", Order::SerialReversed);
    assert!(reversed[32..64].iter().all(|&v| v == -1), "warp 1 first reads cells not yet written: {reversed:?}");
    for order in Order::ALL {
        assert_eq!(cross_warp("cross_warp_fenced", order), want, "{order:?}");
    }
}

/// Two block sums through one scratch, `unfenced` without the barrier that keeps the first
/// call's readers ahead of the second call's writers.
fn two_sums(name: &str, order: Order) -> Vec<f32> {
    let emu = emulator();
    type F = unsafe extern "C" fn(*const f32, *mut f32);
    // SAFETY: two_sums' and two_sums_unfenced's signature.
    let k: F = unsafe { emu.kernel(name) }.unwrap();
    let x: Vec<f32> = (0..256).map(|i| (i % 13) as f32).collect(); // two rows of 128
    let mut out = vec![0f32; 256];
    let (px, po) = (P(x.as_ptr().cast_mut()), P(out.as_mut_ptr()));
    // SAFETY: x holds the two rows, out two sums per thread of the block of 128.
    emu.launch(name, Shape::linear(1, 128), order, || unsafe { k(px.0, po.0) }).unwrap();
    out
}

#[test]
fn a_warp_overwriting_what_a_later_warp_still_reads_shows_in_the_serial_order() {
    let sums = [(0..128).map(|i| (i % 13) as f32).sum::<f32>(), (128..256).map(|i| (i % 13) as f32).sum()];
    let want: Vec<f32> = (0..256).map(|i| sums[i % 2]).collect();
    for order in Order::ALL {
        assert_eq!(two_sums("two_sums", order), want, "{order:?}");
    }
    // Without the first barrier, warp 0 starts the second sum (its lane 0 writes scratch[0])
    // while the later warps have still to read the first sum from scratch[0]: only the
    // serial order (warp 0 first) runs it so.
    assert_eq!(two_sums("two_sums_unfenced", Order::Lockstep), want);
    assert_eq!(two_sums("two_sums_unfenced", Order::SerialReversed), want);
    assert_ne!(two_sums("two_sums_unfenced", Order::Serial), want);
}

#[test]
fn a_shared_static_read_before_it_is_written_differs_between_the_orders() {
    let emu = emulator();
    type F = unsafe extern "C" fn(*mut i32);
    // SAFETY: stale_static's signature.
    let k: F = unsafe { emu.kernel("stale_static") }.unwrap();
    let run = |order| {
        let mut out = vec![0i32; 3 * 64];
        let po = P(out.as_mut_ptr());
        // SAFETY: out holds one int per thread of the three blocks.
        emu.launch("stale_static", Shape::linear(3, 64), order, || unsafe { k(po.0) }).unwrap();
        out
    };
    let (lockstep, reversed) = (run(Order::Lockstep), run(Order::SerialReversed));
    assert_eq!(&lockstep[64..], [[1; 64], [2; 64]].concat(), "block b reads block b − 1's leftovers");
    assert_eq!(&reversed[..128], [[2; 64], [3; 64]].concat(), "reversed: block b reads block b + 1's");
    assert_ne!(lockstep, reversed);
}
