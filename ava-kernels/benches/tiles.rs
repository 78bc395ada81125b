//! Which flash tile sizes are fastest here? Forward and backward of causal attention
//! (B=1, H=4) timed apart, since they keep different working sets: D=64 at T=4096 and
//! D=128 at T=2048, over a grid of (query rows, keys) per tile. The winners are what
//! `Tiles::tuned_forward` and `Tiles::tuned_backward` return; rerun this on a new CPU
//! before changing them. On a shared machine read the fastest sample, not the median.
//!
//! `cargo bench -p ava-kernels --bench tiles`

use ava_core::{AttentionKernel, AttnShape, KernelContext, attention::Pass};
use ava_kernels::{
    attention::{Algorithm, Kernel, Masking, Tiles},
    testing::{Rng, shape},
};

fn main() {
    divan::main();
}

/// (query rows, keys) per tile.
const TILES: [(usize, usize); 7] = [(32, 32), (32, 64), (64, 32), (64, 64), (128, 32), (128, 64), (256, 64)];

/// Inputs and the forward's results for one head size, made outside the timed region.
struct Case {
    shape: AttnShape,
    kernel: Kernel,
    ctx: KernelContext,
    q: Vec<f32>,    // (B, H, T, D)
    k: Vec<f32>,    // (B, H, T, D)
    v: Vec<f32>,    // (B, H, T, D)
    dout: Vec<f32>, // (B, H, T, D)
    out: Vec<f32>,  // (B, H, T, D)
    lse: Vec<f32>,  // (B, H, T)
}

fn case(head_dim: u32, (tq, tk): (usize, usize)) -> Case {
    let seq = if head_dim <= 64 { 4096 } else { 2048 };
    let shape = shape(1, 4, 4, seq, seq, head_dim, true);
    let mut rng = Rng(7);
    let kernel = Kernel { masking: Masking::Plain, algorithm: Algorithm::Flash(Some(Tiles { q: tq, k: tk })) };
    let ctx = KernelContext {
        threads: std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
        ..Default::default()
    };
    let mut c = Case {
        q: rng.vec(shape.q_numel()),
        k: rng.vec(shape.kv_numel()),
        v: rng.vec(shape.kv_numel()),
        dout: rng.vec(shape.q_numel()),
        out: vec![0f32; shape.q_numel()],
        lse: vec![0f32; kernel.saved_len(&shape).expect("saved_len") as usize],
        shape,
        kernel,
        ctx,
    };
    let mut ws = workspace(&c, Pass::Forward);
    c.kernel.forward(&c.shape, &c.q, &c.k, &c.v, &[], &mut c.out, &mut c.lse, &mut ws, &c.ctx).expect("forward");
    c
}

/// The workspace the kernel declares for `pass` (the host allocates it per call; here once).
fn workspace(c: &Case, pass: Pass) -> Vec<f32> {
    vec![0f32; c.kernel.workspace_len(&c.shape, pass, &c.ctx).expect("workspace_len") as usize]
}

fn forward(bencher: divan::Bencher, head_dim: u32, tiles: (usize, usize)) {
    let mut c = case(head_dim, tiles);
    let mut ws = workspace(&c, Pass::Forward);
    bencher.bench_local(|| {
        c.kernel.forward(&c.shape, &c.q, &c.k, &c.v, &[], &mut c.out, &mut c.lse, &mut ws, &c.ctx).expect("forward");
    });
}

fn backward(bencher: divan::Bencher, head_dim: u32, tiles: (usize, usize)) {
    let c = case(head_dim, tiles);
    let mut dq = vec![0f32; c.shape.q_numel()]; // (B, H, T, D)
    let mut dk = vec![0f32; c.shape.kv_numel()]; // (B, H, T, D)
    let mut dv = vec![0f32; c.shape.kv_numel()]; // (B, H, T, D)
    let mut ws = workspace(&c, Pass::Backward);
    bencher.bench_local(|| {
        let (s, x) = (&c.shape, &c.kernel);
        x.backward(s, &c.q, &c.k, &c.v, &[], &c.out, &c.dout, &c.lse, &mut dq, &mut dk, &mut dv, &mut ws, &c.ctx)
            .expect("backward");
    });
}

#[divan::bench(args = TILES, sample_count = 10, sample_size = 1)]
fn forward_d64(bencher: divan::Bencher, tiles: (usize, usize)) {
    forward(bencher, 64, tiles);
}

#[divan::bench(args = TILES, sample_count = 10, sample_size = 1)]
fn backward_d64(bencher: divan::Bencher, tiles: (usize, usize)) {
    backward(bencher, 64, tiles);
}

#[divan::bench(args = TILES, sample_count = 10, sample_size = 1)]
fn forward_d128(bencher: divan::Bencher, tiles: (usize, usize)) {
    forward(bencher, 128, tiles);
}

#[divan::bench(args = TILES, sample_count = 10, sample_size = 1)]
fn backward_d128(bencher: divan::Bencher, tiles: (usize, usize)) {
    backward(bencher, 128, tiles);
}
