//! Do the row loops vectorize? The same softmax over a 64 × 64 score tile three ways:
//! scalar libm `exp` (what a naive loop compiles to), the portable copy (SSE2, 4 lanes),
//! and the dispatched copy (AVX2 + FMA, 8 lanes, on CPUs that have them).
//!
//! `cargo bench -p ava-kernels --bench rows`

use ava_kernels::rows;

fn main() {
    divan::main();
}

fn tile() -> Vec<f32> {
    (0..64 * 64).map(|i| ((i * 37) % 101) as f32 * 0.05 - 2.5).collect()
}

#[divan::bench]
fn softmax_scalar_libm(bencher: divan::Bencher) {
    let mut s = tile();
    bencher.bench_local(|| {
        for row in s.chunks_exact_mut(64) {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0;
            for x in row.iter_mut() {
                *x = (*x - max).exp();
                sum += *x;
            }
            for x in row.iter_mut() {
                *x /= sum;
            }
        }
        divan::black_box(&mut s);
    });
}

#[divan::bench]
fn softmax_portable(bencher: divan::Bencher) {
    let mut s = tile();
    bencher.bench_local(|| {
        rows::softmax_rows_portable(divan::black_box(&mut s), 64);
    });
}

#[divan::bench]
fn softmax_dispatched(bencher: divan::Bencher) {
    let mut s = tile();
    bencher.bench_local(|| {
        rows::softmax_rows(divan::black_box(&mut s), 64);
    });
}

#[divan::bench]
fn online_softmax_portable(bencher: divan::Bencher) {
    let mut s = tile();
    let (mut m, mut l, mut acc) = (vec![0.0f32; 64], vec![1.0f32; 64], vec![1.0f32; 64 * 64]);
    bencher.bench_local(|| {
        rows::online_softmax_portable(divan::black_box(&mut s), 64, &mut m, &mut l, &mut acc, 64);
    });
}

#[divan::bench]
fn online_softmax_dispatched(bencher: divan::Bencher) {
    let mut s = tile();
    let (mut m, mut l, mut acc) = (vec![0.0f32; 64], vec![1.0f32; 64], vec![1.0f32; 64 * 64]);
    bencher.bench_local(|| {
        rows::online_softmax(divan::black_box(&mut s), 64, &mut m, &mut l, &mut acc, 64);
    });
}
