//! One optimizer step over one tensor, the 8-bit optimizer against the built-in fp32 AdamW
//! (the same call the engine makes, without the engine): the cost per parameter of
//! dequantizing, updating and requantizing, apart from everything else in a training step.
//!
//! Run: `cargo bench -p ava-plugin-adam-8bit --bench step`. Sizes: 256K elements (state in
//! the L2 cache: compute alone) and 4M (30+ MB streamed from memory, as a model's matrices
//! are), on one thread and on two. Divide a time by the size for ns per parameter.

use ava_core::{Optimizer, ParamInfo, StateBuf, StateSpec, StepContext};
use ava_plugin_adam_8bit::Adam8bit;
use ava_plugins::builtin::adamw::AdamW;
use divan::Bencher;

fn main() {
    divan::main();
}

const SIZES: [usize; 2] = [1 << 18, 1 << 22];

/// A parameter with its gradient and its state allocated from the optimizer's layout.
struct Setup {
    specs: Vec<StateSpec>,
    words: Vec<Vec<u64>>,
    w: Vec<f32>,
    g: Vec<f32>,
}

impl Setup {
    fn new(opt: &dyn Optimizer, n: usize) -> Self {
        let shape = [n as u64];
        let info = ParamInfo::new("layers.0.mlp.up_proj.weight", &shape);
        let specs = opt.state_layout(&info).unwrap();
        let words = specs.iter().map(|s| vec![0u64; (s.bytes() as usize).div_ceil(8)]).collect();
        // Gradients spread over a few decades, as real ones are.
        let mut x = 0x9E37_79B9u64;
        let g = (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 10f32.powi(-((x & 3) as i32) - 2)
            })
            .collect();
        Self { specs, words, w: vec![0.01; n], g }
    }

    fn step(&mut self, opt: &mut dyn Optimizer, step: u64, threads: u32) {
        let shape = [self.w.len() as u64];
        let info = ParamInfo::new("layers.0.mlp.up_proj.weight", &shape);
        let mut bufs: Vec<StateBuf<'_>> = self
            .specs
            .iter()
            .zip(&mut self.words)
            .map(|(s, w)| StateBuf::new(s.dtype, &mut bytemuck::cast_slice_mut(w)[..s.bytes() as usize]))
            .collect();
        let ctx = StepContext { step, lr: 1e-3, weight_decay: 0.01, threads, grad_scale: 1.0 };
        opt.step(&info, &mut self.w, &self.g, &mut bufs, &ctx).unwrap();
    }
}

fn run(bencher: Bencher, mut opt: Box<dyn Optimizer>, n: usize, threads: u32) {
    let mut setup = Setup::new(opt.as_ref(), n);
    // A few steps first, so the moments (and the 8-bit codes) are not all zero.
    for t in 1..=3 {
        setup.step(opt.as_mut(), t, threads);
    }
    let mut t = 3;
    bencher.counter(divan::counter::ItemsCount::new(n)).bench_local(|| {
        t += 1;
        setup.step(opt.as_mut(), t, threads);
    });
}

/// The built-in fp32 AdamW: 8 bytes of state per parameter (it runs on one thread).
#[divan::bench(args = SIZES, sample_count = 30)]
fn adamw(bencher: Bencher, n: usize) {
    run(bencher, Box::new(AdamW::default()), n, 1);
}

/// Block-wise 8-bit AdamW (block 256), one thread: ~2 bytes of state per parameter.
#[divan::bench(args = SIZES, sample_count = 30)]
fn adam_8bit(bencher: Bencher, n: usize) {
    run(bencher, Box::new(Adam8bit::default()), n, 1);
}

/// The same on two threads (whole blocks per thread), as training runs it on two cores.
#[divan::bench(args = SIZES, sample_count = 30)]
fn adam_8bit_2_threads(bencher: Bencher, n: usize) {
    run(bencher, Box::new(Adam8bit::default()), n, 2);
}
