//! The 8-bit optimizer against the built-in fp32 AdamW (`ava_plugins::builtin::adamw`).

use ava_plugins::builtin::adamw::AdamW;

use super::*;

fn build(json: &str) -> Result<Adam8bit, PluginError> {
    ava_core::ffi::build::<Adam8bit>(json, &HostContext::default())
}

/// A parameter's state, allocated from the layout as the host does (zero-filled, 8-aligned).
struct State {
    specs: Vec<StateSpec>,
    words: Vec<Vec<u64>>,
}

impl State {
    fn new(opt: &dyn Optimizer, info: &ParamInfo<'_>) -> Self {
        let specs = opt.state_layout(info).unwrap();
        let words = specs.iter().map(|s| vec![0u64; (s.bytes() as usize).div_ceil(8)]).collect();
        Self { specs, words }
    }

    fn step(&mut self, opt: &mut dyn Optimizer, info: &ParamInfo<'_>, w: &mut [f32], g: &[f32], ctx: StepContext) {
        let mut bufs: Vec<StateBuf<'_>> = self
            .specs
            .iter()
            .zip(&mut self.words)
            .map(|(s, w)| StateBuf::new(s.dtype, &mut bytemuck::cast_slice_mut(w)[..s.bytes() as usize]))
            .collect();
        opt.step(info, w, g, &mut bufs, &ctx).unwrap();
    }

    fn bytes(&self, name: &str) -> &[u8] {
        let i = self.specs.iter().position(|s| s.name.as_str() == name).unwrap();
        &bytemuck::cast_slice(&self.words[i])[..self.specs[i].bytes() as usize]
    }
}

fn ctx(step: u64, lr: f64, weight_decay: f64) -> StepContext {
    StepContext { step, lr, weight_decay, threads: 1, grad_scale: 1.0 }
}

/// A deterministic uniform [0, 1) stream (xorshift).
struct Rng(u64);

impl Rng {
    fn uniform(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// f(θ) = ½ Σ aᵢ (θᵢ − cᵢ)², curvatures aᵢ spread over two decades: ∇f = a ⊙ (θ − c).
struct Quadratic {
    a: Vec<f32>,
    c: Vec<f32>,
}

impl Quadratic {
    fn new(n: usize, rng: &mut Rng) -> Self {
        let a = (0..n).map(|_| 10f32.powf(2.0 * rng.uniform() - 1.0)).collect();
        let c = (0..n).map(|_| 2.0 * rng.uniform() - 1.0).collect();
        Self { a, c }
    }
    fn grad(&self, w: &[f32]) -> Vec<f32> {
        w.iter().zip(&self.a).zip(&self.c).map(|((w, a), c)| a * (w - c)).collect()
    }
    fn loss(&self, w: &[f32]) -> f64 {
        w.iter().zip(&self.a).zip(&self.c).map(|((w, a), c)| 0.5 * f64::from(a * (w - c) * (w - c))).sum()
    }
}

fn dist(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum::<f64>().sqrt()
}

/// 100 steps on a 16384-parameter quadratic, 8-bit vs fp32 AdamW from the same start.
///
/// Tolerance: the state is rounded to the nearest of 256 codes each step, within 0.7% (m)
/// and 0.35% (v) of its block's absmax. On a convex problem those errors do not compound
/// (both runs are pulled to the same minimum); what remains is the phase of Adam's
/// lr-sized oscillation around the minimum at a constant lr. Measured: the trajectories end
/// 0.87% (λ = 0) and 1.0% (λ = 0.1) of the distance travelled apart (an RMS of 0.2·lr per
/// coordinate), and both cut the loss by more than 99.9%, ending 4e-6 and 4e-5 of the
/// initial loss apart. We allow 2% and 2e-4.
#[test]
fn tracks_fp32_adamw_on_a_quadratic() {
    let n = 16384;
    let mut rng = Rng(7);
    let q = Quadratic::new(n, &mut rng);
    let start: Vec<f32> = (0..n).map(|_| 4.0 * rng.uniform() - 2.0).collect();
    let shape = [n as u64];
    let info = ParamInfo::new("model.layers.0.mlp.up_proj.weight", &shape);
    for wd in [0.0, 0.1] {
        let mut eight = Adam8bit::default();
        let mut full = AdamW::default();
        assert!(eight.is_8bit(&info));
        let (mut s8, mut s32) = (State::new(&eight, &info), State::new(&full, &info));
        let (mut w8, mut w32) = (start.clone(), start.clone());
        for t in 1..=100 {
            let c = ctx(t, 5e-2, wd);
            let (g8, g32) = (q.grad(&w8), q.grad(&w32));
            s8.step(&mut eight, &info, &mut w8, &g8, c);
            s32.step(&mut full, &info, &mut w32, &g32, c);
        }
        let travelled = dist(&w32, &start);
        let apart = dist(&w8, &w32) / travelled;
        let (l8, l32, l0) = (q.loss(&w8), q.loss(&w32), q.loss(&start));
        println!("wd {wd}: apart {apart:.5} of {travelled:.3}; loss {l0:.1} → fp32 {l32:.4}, 8-bit {l8:.4}");
        assert!(l32 < 1e-3 * l0, "AdamW itself converges ({l0} → {l32})");
        assert!(apart < 0.02, "wd {wd}: 8-bit ends {apart} (relative) away from fp32 AdamW");
        assert!(l8 < 1e-3 * l0, "wd {wd}: 8-bit converges ({l0} → {l8})");
        assert!((l8 - l32).abs() < 2e-4 * l0, "wd {wd}: loss 8-bit {l8} vs fp32 {l32} (start {l0})");
    }
}

/// Small tensors and `fp32_state` names take the fp32 path, which is AdamW bit for bit.
#[test]
fn fp32_path_is_adamw_exactly() {
    let mut rng = Rng(3);
    for (name, len, json) in
        [("model.norm.weight", 100, ""), ("model.embed_tokens.weight", 5000, r#"{"fp32_state": ["embed_tokens"]}"#)]
    {
        let shape = [len as u64];
        let info = ParamInfo::new(name, &shape);
        let mut eight = build(json).unwrap();
        let mut full = AdamW::default();
        assert!(!eight.is_8bit(&info), "{name}");
        let (mut s8, mut s32) = (State::new(&eight, &info), State::new(&full, &info));
        assert_eq!(s8.specs[0].dtype, DType::F32);
        let mut w8: Vec<f32> = (0..len).map(|_| rng.uniform() - 0.5).collect();
        let mut w32 = w8.clone();
        for t in 1..=5 {
            let g: Vec<f32> = (0..len).map(|_| rng.uniform() - 0.5).collect();
            s8.step(&mut eight, &info, &mut w8, &g, ctx(t, 1e-3, 0.1));
            s32.step(&mut full, &info, &mut w32, &g, ctx(t, 1e-3, 0.1));
        }
        assert_eq!(w8, w32, "{name}");
        assert_eq!(s8.bytes("exp_avg"), s32.bytes("exp_avg"));
        assert_eq!(s8.bytes("exp_avg_sq"), s32.bytes("exp_avg_sq"));
    }
}

/// One step from zero state, worked by hand: m = (1 − β1)g and v = (1 − β2)g², so the
/// update is lr·sign(g) (up to ε) and the stored codes are the map's ±1 and 1 for the
/// block's largest element, with absmax = (1 − β1)·max|g| and (1 − β2)·max g².
#[test]
fn first_step_by_hand() {
    let n = 4096;
    let shape = [n as u64];
    let info = ParamInfo::new("w", &shape);
    let mut opt = Adam8bit::default();
    let mut s = State::new(&opt, &info);
    let g: Vec<f32> = (0..n).map(|i| if i % 2 == 0 { (i + 1) as f32 } else { -0.5 }).collect();
    let mut w = vec![1.0f32; n];
    s.step(&mut opt, &info, &mut w, &g, ctx(1, 0.01, 0.0));
    for (i, &x) in w.iter().enumerate() {
        let want = if i % 2 == 0 { 0.99 } else { 1.01 };
        assert!((x - want).abs() < 1e-6, "θ[{i}] = {x}, want {want}");
    }
    let am: &[f32] = bytemuck::cast_slice(s.bytes("absmax_exp_avg"));
    let av: &[f32] = bytemuck::cast_slice(s.bytes("absmax_exp_avg_sq"));
    assert_eq!(am.len(), 16);
    // Block 0 holds g = 1, −0.5, 3, ..., 255, −0.5: max |g| = 255.
    assert!((am[0] - 0.1 * 255.0).abs() < 1e-4, "{}", am[0]);
    assert!((av[0] - 0.001 * 255.0 * 255.0).abs() < 1e-3, "{}", av[0]);
    let (mc, vc) = (s.bytes("exp_avg"), s.bytes("exp_avg_sq"));
    assert_eq!((mc[254], vc[254]), (255, 255), "the block's largest element is stored as 1.0");
    assert_eq!(opt.signed.decode(mc[1]), opt.signed.decode(opt.signed.encode(-0.5 / 255.0)));
    assert_eq!(bytemuck::cast_slice::<u8, u32>(s.bytes("step")), [1]);
}

/// Splitting a large tensor over threads (whole blocks each) gives the same bits.
#[test]
fn threads_do_not_change_the_result() {
    let n = 3 * MIN_PER_THREAD + 1000;
    let shape = [n as u64];
    let info = ParamInfo::new("w", &shape);
    let mut rng = Rng(11);
    let start: Vec<f32> = (0..n).map(|_| rng.uniform() - 0.5).collect();
    let grads: Vec<Vec<f32>> = (0..3).map(|_| (0..n).map(|_| rng.uniform() - 0.5).collect()).collect();
    let mut results = Vec::new();
    for threads in [1, 3] {
        let mut opt = Adam8bit::default();
        let mut s = State::new(&opt, &info);
        let mut w = start.clone();
        for (t, g) in grads.iter().enumerate() {
            s.step(&mut opt, &info, &mut w, g, StepContext { threads, ..ctx(t as u64 + 1, 1e-3, 0.1) });
        }
        results.push((w, s.words));
    }
    assert!(results[0] == results[1], "1 and 3 threads differ");
}

#[test]
fn percentile_clipping_scales_to_the_percentile_of_recent_norms() {
    let mut h = [0f32; HISTORY];
    // Squared norms 1, 4, 9, 16 then a spike of 400: at p = 50 the limit is the middle of
    // the five recorded (9), so the spike's gradient is scaled by √(9/400) = 0.15.
    for (t, g) in [1.0f32, 2.0, 3.0, 4.0].iter().enumerate() {
        let s = percentile_scale(&mut h, t as u32 + 1, &[*g], 50);
        assert!(s <= 1.0);
    }
    assert_eq!(percentile_scale(&mut h, 5, &[12.0, 16.0], 50), 0.15);
    assert_eq!(&h[..5], &[1.0, 4.0, 9.0, 16.0, 400.0]);
    // Step 101 overwrites the oldest entry (step 1's).
    let mut h = [1f32; HISTORY];
    assert_eq!(percentile_scale(&mut h, 101, &[0.5], 95), 1.0);
    assert_eq!(h[0], 0.25);

    // In the optimizer: a clipped step equals an unclipped step on the scaled gradient.
    let n = 8192;
    let shape = [n as u64];
    let info = ParamInfo::new("w", &shape);
    let mut clipped = build(r#"{"percentile_clipping": 50}"#).unwrap();
    let mut plain = Adam8bit::default();
    let (mut sc, mut sp) = (State::new(&clipped, &info), State::new(&plain, &info));
    assert_eq!(sc.specs.last().unwrap().name.as_str(), "grad_norm_history");
    let (mut wc, mut wp) = (vec![0.5f32; n], vec![0.5f32; n]);
    let small: Vec<f32> = (0..n).map(|i| ((i % 13) as f32 - 6.0) * 1e-3).collect();
    let big: Vec<f32> = small.iter().map(|g| g * 10.0).collect();
    sc.step(&mut clipped, &info, &mut wc, &small, ctx(1, 1e-3, 0.0));
    sp.step(&mut plain, &info, &mut wp, &small, ctx(1, 1e-3, 0.0));
    // Norms so far: |small|², then |big|² = 100·|small|²; the 50th percentile of the two
    // is the larger (index 1 of 2), so nothing is clipped yet ...
    sc.step(&mut clipped, &info, &mut wc, &big, ctx(2, 1e-3, 0.0));
    sp.step(&mut plain, &info, &mut wp, &big, ctx(2, 1e-3, 0.0));
    assert_eq!(wc, wp);
    // ... then another big one: index 1 of (small, big, big) sorted is big: still not above.
    // A huge one (1000×): clipped to |big|, i.e. the same step as a big gradient.
    let huge: Vec<f32> = small.iter().map(|g| g * 1000.0).collect();
    sc.step(&mut clipped, &info, &mut wc, &huge, ctx(3, 1e-3, 0.0));
    sp.step(&mut plain, &info, &mut wp, &big, ctx(3, 1e-3, 0.0));
    let worst = wc.iter().zip(&wp).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    assert!(worst < 1e-6, "clipped step differs from the step with the scaled gradient by {worst}");
}

/// Σ g² by its definition: squares summed 32 at a time in order, then each 32 consecutive
/// sums of a level in order, up to one value (what the `cuda` step's kernels add in parallel).
fn tree_sum_of_squares(grad: &[f32]) -> f64 {
    let mut level: Vec<f64> =
        grad.chunks(32).map(|c| c.iter().fold(0.0, |s, &g| s + f64::from(g) * f64::from(g))).collect();
    while level.len() > 1 {
        level = level.chunks(32).map(|c| c.iter().fold(0.0, |s, &x| s + x)).collect();
    }
    level.first().copied().unwrap_or(0.0)
}

/// The running-sum form the step uses is the tree, bit for bit, at every raggedness of every
/// level (lengths around 32, 32², 32³ and beyond, where a short last group is left at each
/// level); and the tree is a sum: exact on integers, and within 1e-14 (relative) of a
/// compensated (Neumaier) sum on 130k random squares, whose own error is ~1e-16 (the tree's
/// bound: 4 levels of 32 additions, ~128 roundings of 1.1e-16 at worst).
#[test]
fn sum_of_squares_is_the_fixed_tree() {
    let mut rng = Rng(5);
    let big: Vec<f32> = (0..3 * 32768 + 32 * 1024 + 77).map(|_| (rng.uniform() - 0.5) * 1e3).collect();
    let mut lengths = vec![0, 1, 2, 31, 32, 33, 1023, 1024, 1025, 32767, 32768, 32769, 65536 + 1024 + 3];
    lengths.push(big.len());
    for n in lengths {
        let g = &big[..n];
        let (got, want) = (sum_of_squares(g), tree_sum_of_squares(g));
        assert_eq!(got.to_bits(), want.to_bits(), "n = {n}: {got} vs {want}");
    }
    let ints: Vec<f32> = (0..5000).map(|i| (i % 17) as f32).collect(); // exact in f64
    let exact: f64 = ints.iter().map(|&g| f64::from(g * g)).sum();
    assert_eq!(sum_of_squares(&ints), exact);
    let (mut sum, mut compensation) = (0f64, 0f64);
    for x in big.iter().map(|&g| f64::from(g) * f64::from(g)) {
        let t = sum + x;
        compensation += if sum.abs() >= x.abs() { (sum - t) + x } else { (x - t) + sum };
        sum = t;
    }
    let (s, accurate) = (sum_of_squares(&big), sum + compensation);
    assert!((s - accurate).abs() <= 1e-14 * accurate, "{s} vs {accurate}");
}

#[test]
fn state_layout_and_bytes_per_parameter() {
    let layout = |o: &Adam8bit, name: &str, shape: &[u64]| -> Vec<(String, DType, u64)> {
        let info = ParamInfo::new(name, shape);
        o.state_layout(&info).unwrap().into_iter().map(|s| (s.name.to_string(), s.dtype, s.len)).collect()
    };
    let s = |n: &str, d, l| (n.to_string(), d, l);
    let opt = Adam8bit::default();
    assert_eq!(
        layout(&opt, "model.layers.0.self_attn.q_proj.weight", &[256, 100]),
        [
            s("exp_avg", DType::U8, 25600),
            s("exp_avg_sq", DType::U8, 25600),
            s("absmax_exp_avg", DType::F32, 100),
            s("absmax_exp_avg_sq", DType::F32, 100),
            s("step", DType::U32, 1),
        ]
    );
    assert_eq!(
        layout(&opt, "model.norm.weight", &[4095]),
        [s("exp_avg", DType::F32, 4095), s("exp_avg_sq", DType::F32, 4095), s("step", DType::U32, 1)]
    );
    let big = build(r#"{"block_size": 2048, "percentile_clipping": 95, "fp32_state": ["embed"]}"#).unwrap();
    let l = layout(&big, "lm_head.weight", &[3, 2049]);
    assert_eq!(l[2], s("absmax_exp_avg", DType::F32, 4)); // ⌈6147 / 2048⌉
    assert_eq!(l[5], s("grad_norm_history", DType::F32, 100));
    assert_eq!(layout(&big, "model.embed_tokens.weight", &[256, 256])[0], s("exp_avg", DType::F32, 65536));
    // 2 + 8/256 bytes per parameter, plus 4 bytes of step count per tensor.
    let info_shape = [4096u64, 4096];
    let info = ParamInfo::new("w", &info_shape);
    let bytes: u64 = opt.state_layout(&info).unwrap().iter().map(StateSpec::bytes).sum();
    let per = bytes as f64 / (4096.0 * 4096.0);
    assert!((per - (2.0 + 8.0 / 256.0)).abs() < 1e-6, "{per}");
}

#[test]
fn wrong_state_is_refused_and_changes_nothing() {
    let n = 4096;
    let shape = [n as u64];
    let info = ParamInfo::new("model.layers.0.mlp.down_proj.weight", &shape);
    let mut opt = Adam8bit::default();
    let (mut w, g) = (vec![1.0f32; n], vec![0.5f32; n]);
    let mut m = vec![0u8; n];
    let mut v = vec![0f32; n]; // should be u8
    let mut am = vec![0f32; 16];
    let mut av = vec![0f32; 16];
    let mut step = [0u32];
    let mut bufs = [
        StateBuf::new(DType::U8, &mut m),
        StateBuf::new(DType::F32, bytemuck::cast_slice_mut(&mut v)),
        StateBuf::new(DType::F32, bytemuck::cast_slice_mut(&mut am)),
        StateBuf::new(DType::F32, bytemuck::cast_slice_mut(&mut av)),
        StateBuf::new(DType::U32, bytemuck::cast_slice_mut(&mut step)),
    ];
    let err = opt.step(&info, &mut w, &g, &mut bufs, &ctx(1, 0.1, 0.0)).unwrap_err();
    assert_eq!(err.message.as_str(), "state buffer is f32, read as u8");
    let err = opt.step(&info, &mut w, &g, &mut bufs[..3], &ctx(1, 0.1, 0.0)).unwrap_err();
    assert_eq!(
        err.message.as_str(),
        "adam-8bit expects 5 state buffers for model.layers.0.mlp.down_proj.weight (8-bit), got 3"
    );
    assert!(w.iter().all(|&x| x == 1.0) && step == [0], "a refused step leaves everything alone");
}

#[test]
fn takes_cuda_buffers_only_when_built_with_cuda() {
    let manifest = Adam8bit::manifest();
    assert!(manifest.runs_on(Device::Cpu));
    assert_eq!(manifest.runs_on(Device::Cuda), cfg!(feature = "cuda"));
}

#[test]
fn options_are_checked_all_at_once() {
    let err = build(
        r#"{"betas": [0.9], "eps": -1, "block_size": 300, "min_8bit_size": -2, "percentile_clipping": 0, "fp32_state": [""], "lr": 1}"#,
    )
    .unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidOptions);
    let details: Vec<&str> = err.details().collect();
    assert_eq!(
        details,
        [
            "unknown option 'lr' (known: betas, eps, block_size, min_8bit_size, percentile_clipping, fp32_state)",
            "option 'betas': expected 2 values [β1, β2], got 1",
            "option 'eps': -1 must be > 0",
            "option 'block_size': 300 must be a power of two from 64 to 4096 (e.g. 256 or 2048)",
            "option 'min_8bit_size': -2 must be >= 0",
            "option 'percentile_clipping': 0 must be in 1..=100 (100 turns clipping off)",
            "option 'fp32_state': an empty name would match every parameter",
        ]
    );
    let ok = build(r#"{"betas": [0.8, 0.95], "block_size": 2048, "fp32_state": ["embed_tokens"]}"#).unwrap();
    assert_eq!(
        ok,
        Adam8bit {
            beta1: 0.8,
            beta2: 0.95,
            block_size: 2048,
            fp32_state: vec!["embed_tokens".into()],
            ..Adam8bit::default()
        }
    );
    assert_eq!(build("").unwrap(), Adam8bit::default());
}
