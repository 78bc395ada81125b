//! Which flash tile sizes are fastest here? Forward + backward of causal attention, B=1,
//! H=4, T=2048, for head sizes 64 and 128, over a grid of (query rows, keys) per tile. The
//! winner is what `Tiles::tuned` returns; rerun this on a new CPU before changing it.
//!
//! `cargo bench -p ava-kernels --bench tiles`

use ava_core::{AttentionKernel, AttnShape, KernelContext};
use ava_kernels::{
    attention::{Algorithm, Kernel, Masking, Tiles},
    testing::{Rng, shape},
};

fn main() {
    divan::main();
}

/// (query rows, keys) per tile.
const TILES: [(usize, usize); 6] = [(32, 64), (64, 32), (64, 64), (64, 128), (128, 64), (128, 128)];

/// Inputs for one head size; allocated once, outside the timed region.
struct Case {
    shape: AttnShape,
    q: Vec<f32>,    // (B, H, T, D)
    k: Vec<f32>,    // (B, H, T, D)
    v: Vec<f32>,    // (B, H, T, D)
    dout: Vec<f32>, // (B, H, T, D)
}

fn case(head_dim: u32) -> Case {
    let shape = shape(1, 4, 4, 2048, 2048, head_dim, true);
    let mut rng = Rng(7);
    Case {
        q: rng.vec(shape.q_numel()),
        k: rng.vec(shape.kv_numel()),
        v: rng.vec(shape.kv_numel()),
        dout: rng.vec(shape.q_numel()),
        shape,
    }
}

fn run(bencher: divan::Bencher, head_dim: u32, (tq, tk): (usize, usize)) {
    let c = case(head_dim);
    let s = &c.shape;
    let kernel = Kernel { masking: Masking::Plain, algorithm: Algorithm::Flash(Some(Tiles { q: tq, k: tk })) };
    let ctx = KernelContext {
        threads: std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
        ..Default::default()
    };
    let mut out = vec![0f32; s.q_numel()]; // (B, H, T, D)
    let mut lse = vec![0f32; kernel.saved_len(s).expect("saved_len") as usize]; // (B, H, T)
    let mut dq = vec![0f32; s.q_numel()]; // (B, H, T, D)
    let mut dk = vec![0f32; s.kv_numel()]; // (B, H, T, D)
    let mut dv = vec![0f32; s.kv_numel()]; // (B, H, T, D)
    bencher.bench_local(|| {
        kernel.forward(s, &c.q, &c.k, &c.v, &mut out, &mut lse, &ctx).expect("forward");
        kernel.backward(s, &c.q, &c.k, &c.v, &out, &c.dout, &lse, &mut dq, &mut dk, &mut dv, &ctx).expect("backward");
    });
}

#[divan::bench(args = TILES, sample_count = 10, sample_size = 1)]
fn d64(bencher: divan::Bencher, tiles: (usize, usize)) {
    run(bencher, 64, tiles);
}

#[divan::bench(args = TILES, sample_count = 10, sample_size = 1)]
fn d128(bencher: divan::Bencher, tiles: (usize, usize)) {
    run(bencher, 128, tiles);
}
