//! Tests. The expected numbers of the `*_match_reference` tests were printed by the script
//! below (Python 3, standard library only, f64): an independent transcription of
//! `transformers.optimization.Adafactor.step` from the formulas in the module doc, written
//! element by element with plain lists. Running it prints, per case and step, `lr_t`, the
//! RMS of the raw update before the clip, θ and the state; the values are pasted below as
//! printed (Python's shortest round-trip repr).
//!
// # Independent f64 reference of transformers' Adafactor.step, pure standard library.
// import math
//
// def rms(x):
//     return math.sqrt(sum(v * v for v in x) / len(x))
//
// class Ref:
//     def __init__(self, shape, eps=(1e-30, 1e-3), clip=1.0, decay=-0.8, beta1=None,
//                  scale=True, rel=True, warm=False):
//         self.shape, self.eps, self.clip, self.decay = shape, eps, clip, decay
//         self.beta1, self.scale, self.rel, self.warm = beta1, scale, rel, warm
//         n = math.prod(shape)
//         self.t = 0
//         self.m = [0.0] * n
//         self.factored = len(shape) >= 2
//         if self.factored:
//             self.batch, self.rows, self.cols = math.prod(shape[:-2]), shape[-2], shape[-1]
//             self.r = [0.0] * (self.batch * self.rows)
//             self.c = [0.0] * (self.batch * self.cols)
//         else:
//             self.v = [0.0] * n
//
//     def step(self, p, g, lr, wd):
//         self.t += 1
//         t = self.t
//         size = (min(1e-6 * t if self.warm else 1e-2, 1 / math.sqrt(t))) if self.rel else lr
//         lr_t = size * (max(self.eps[1], rms(p)) if self.scale else 1.0)
//         b2 = 1 - t ** self.decay
//         u2 = [x * x + self.eps[0] for x in g]
//         if self.factored:
//             R, C = self.rows, self.cols
//             upd = [0.0] * len(g)
//             for b in range(self.batch):
//                 at = lambda i, j: b * R * C + i * C + j
//                 for i in range(R):
//                     k = b * R + i
//                     self.r[k] = b2 * self.r[k] + (1 - b2) * sum(u2[at(i, j)] for j in range(C)) / C
//                 for j in range(C):
//                     k = b * C + j
//                     self.c[k] = b2 * self.c[k] + (1 - b2) * sum(u2[at(i, j)] for i in range(R)) / R
//                 mean_r = sum(self.r[b * R:(b + 1) * R]) / R
//                 for i in range(R):
//                     for j in range(C):
//                         vhat = self.r[b * R + i] / mean_r * self.c[b * C + j]
//                         upd[at(i, j)] = g[at(i, j)] / math.sqrt(vhat)
//         else:
//             self.v = [b2 * v + (1 - b2) * x for v, x in zip(self.v, u2)]
//             upd = [x / math.sqrt(v) for x, v in zip(g, self.v)]
//         self.rms_before_clip = rms(upd)
//         d = max(1.0, rms(upd) / self.clip)
//         upd = [x / d * lr_t for x in upd]
//         if self.beta1 is not None:
//             self.m = [self.beta1 * m + (1 - self.beta1) * x for m, x in zip(self.m, upd)]
//             upd = self.m
//         p = [x - wd * lr_t * x for x in p]
//         p = [x - y for x, y in zip(p, upd)]
//         self.lr_t = lr_t
//         return p
//
// def show(name, xs):
//     print(f"{name} = [{', '.join(repr(x) for x in xs)}]")
//
// def case(title, ref, p, grads, lr, wd):
//     print(f"== {title}")
//     for s, g in enumerate(grads, 1):
//         p = ref.step(p, g, lr, wd)
//         print(f"-- step {s}: lr_t = {ref.lr_t!r}, rms(update) before clip = {ref.rms_before_clip!r}")
//         show("theta", p)
//         if ref.factored:
//             show("row", ref.r)
//             show("col", ref.c)
//         else:
//             show("v", ref.v)
//         if ref.beta1 is not None:
//             show("m", ref.m)
//
// W = [0.5, -1.0, 0.25, 2.0, -0.75, 1.5, 0.1, -0.3, 1.2, -0.6, 0.8, 0.05]
// G1 = [0.1, -0.2, 0.3, 0.05, -0.4, 0.25, 0.0, 0.15, 0.2, -0.1, 0.35, -0.3]
// G2 = [-0.3, 0.1, 0.2, -0.25, 0.05, 0.4, -0.15, 0.1, -0.2, 0.3, 0.1, 0.45]
// V = [0.5, -1.5, 2.0, 0.25]
// VG1 = [0.2, -0.05, 0.5, -1.0]
// VG2 = [-0.4, 0.3, 0.01, 0.6]
//
// case("matrix 3x4, defaults (ctx.lr 0.5 ignored)", Ref([3, 4]), W, [G1, G2], 0.5, 0.0)
// case("matrix 3x4, beta1 0.9, relative_step false, lr 0.05, wd 0.1",
//      Ref([3, 4], beta1=0.9, rel=False), W, [G1, G2], 0.05, 0.1)
// case("vector 4, defaults (ctx.lr 0.5 ignored)", Ref([4]), V, [VG1, VG2], 0.5, 0.0)
// case("vector 4, warmup_init", Ref([4], warm=True), V, [VG1, VG2], 0.5, 0.0)
// case("vector 4, beta1 0.5, relative_step false, scale_parameter false, lr 0.1, wd 0.2",
//      Ref([4], beta1=0.5, rel=False, scale=False), V, [VG1, VG2], 0.1, 0.2)
// case("clip: matrix 2x2, relative_step false, scale_parameter false, lr 0.1",
//      Ref([2, 2], rel=False, scale=False), [1.0, -1.0, 0.5, 2.0], [[10.0, 0.0, 0.0, 0.1]], 0.1, 0.0)

use super::*;

fn build(json: &str) -> Result<Adafactor, PluginError> {
    ava_core::ffi::build::<Adafactor>(json, &HostContext::default())
}

/// One parameter's state as the host keeps it: the buffers of the optimizer's layout,
/// 8-byte aligned and zero-filled.
struct Param {
    shape: Vec<u64>,
    specs: Vec<StateSpec>,
    bufs: Vec<Vec<u64>>,
}

impl Param {
    fn new(opt: &Adafactor, shape: &[u64]) -> Param {
        let specs = opt.state_layout(&ParamInfo::new("p", shape)).unwrap();
        let bufs = specs.iter().map(|s| vec![0u64; (s.bytes() as usize).div_ceil(8)]).collect();
        Param { shape: shape.to_vec(), specs, bufs }
    }

    /// One step with the trainer's `lr` and weight decay `wd`; the global step is 1 (the
    /// optimizer must count its own).
    fn step(&mut self, opt: &mut Adafactor, w: &mut [f32], g: &[f32], lr: f64, wd: f64) -> Result<(), PluginError> {
        let info = ParamInfo::new("model.layers.0.mlp.up_proj.weight", &self.shape);
        let mut state: Vec<StateBuf<'_>> = self
            .specs
            .iter()
            .zip(self.bufs.iter_mut())
            .map(|(s, b)| StateBuf::new(s.dtype, &mut bytemuck::cast_slice_mut::<u64, u8>(b)[..s.bytes() as usize]))
            .collect();
        let ctx = StepContext { step: 1, lr, weight_decay: wd, threads: 1, grad_scale: 1.0 };
        opt.step(&info, w, g, &mut state, &ctx)
    }

    fn bytes(&self, name: &str) -> &[u8] {
        let i = self.specs.iter().position(|s| s.name.as_str() == name).unwrap_or_else(|| panic!("no '{name}'"));
        &bytemuck::cast_slice::<u64, u8>(&self.bufs[i])[..self.specs[i].bytes() as usize]
    }

    fn f32(&self, name: &str) -> &[f32] {
        bytemuck::cast_slice(self.bytes(name))
    }

    fn count(&self) -> u32 {
        bytemuck::cast_slice::<u8, u32>(self.bytes("step"))[0]
    }
}

/// `got` (f32) against `want` (f64) within `tol` relative to `max(|want|, floor)`.
fn close_to(got: &[f32], want: &[f64], tol: f64, floor: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (f64::from(g) - w).abs();
        assert!(err <= tol * w.abs().max(floor), "{what}[{i}] = {g}, want {w} (off by {err:e})");
    }
}

/// θ: f32 keeps ~6e-8 absolute for |θ| ≤ 2, and a step moves θ by ~1e-2, so an absolute
/// 4e-7 checks the step itself to a few parts in 1e5.
fn theta(got: &[f32], want: &[f64], what: &str) {
    close_to(got, want, 4e-7, 1.0, what);
}

/// State buffers: 1e-6 relative (f32 arithmetic against the f64 reference).
fn state(got: &[f32], want: &[f64], what: &str) {
    close_to(got, want, 1e-6, 1e-12, what);
}

const W: [f32; 12] = [0.5, -1.0, 0.25, 2.0, -0.75, 1.5, 0.1, -0.3, 1.2, -0.6, 0.8, 0.05];
const G1: [f32; 12] = [0.1, -0.2, 0.3, 0.05, -0.4, 0.25, 0.0, 0.15, 0.2, -0.1, 0.35, -0.3];
const G2: [f32; 12] = [-0.3, 0.1, 0.2, -0.25, 0.05, 0.4, -0.15, 0.1, -0.2, 0.3, 0.1, 0.45];
const V: [f32; 4] = [0.5, -1.5, 2.0, 0.25];
const VG1: [f32; 4] = [0.2, -0.05, 0.5, -1.0];
const VG2: [f32; 4] = [-0.4, 0.3, 0.01, 0.6];

/// Defaults on a 3×4 matrix: relative step min(1e-2, 1/√t)·rms(θ); the trainer's lr (0.5)
/// must not matter. Step 1 has β2_t = 0 (R, C are the plain means of g² + eps1), step 2
/// β2_t = 1 − 2^−0.8 and a raw-update RMS of 1.0055, so the clip also acts (slightly).
#[test]
fn matrix_default_options_match_reference() {
    let mut opt = build("").unwrap();
    let mut p = Param::new(&opt, &[3, 4]);
    let mut w = W;
    p.step(&mut opt, &mut w, &G1, 0.5, 0.0).unwrap();
    // lr_t = 0.00942845869340972, rms(update) before clip = 0.9975625271760586
    theta(
        &w,
        &[
            0.4956057951253851,
            -0.9879927463984751,
            0.23689515959252982,
            1.9970309942885163,
            -0.7365950659137942,
            1.4885533583664763,
            0.1,
            -0.3067929227811943,
            1.1935248016632984,
            -0.5955765974295997,
            0.7887352565744069,
            0.06312517376400799,
        ],
        "step 1 θ",
    );
    state(p.f32("exp_avg_sq_row"), &[0.035625000000000004, 0.061250000000000006, 0.06562499999999999], "step 1 R");
    state(
        p.f32("exp_avg_sq_col"),
        &[0.07000000000000002, 0.037500000000000006, 0.07083333333333332, 0.03833333333333333],
        "step 1 C",
    );
    assert_eq!(p.count(), 1);

    p.step(&mut opt, &mut w, &G2, 0.5, 0.0).unwrap();
    // lr_t = 0.009369184061460908, rms(update) before clip = 1.005547021054677
    theta(
        &w,
        &[
            0.509288495984275,
            -0.9921706856716211,
            0.22668513135681034,
            2.0072285914141275,
            -0.7386578252973888,
            1.4734368981962533,
            0.10692653760046252,
            -0.31048257839136806,
            1.200434011163791,
            -0.6050702026083506,
            0.7848685186685991,
            0.049221865761694204,
        ],
        "step 2 θ",
    );
    state(p.f32("exp_avg_sq_row"), &[0.04424023766247776, 0.05407063528126854, 0.07711198354997034], "step 2 R");
    state(
        p.f32("exp_avg_sq_col"),
        &[0.05516264624795497, 0.06573883456034378, 0.04403037171673585, 0.0689652894665876],
        "step 2 C",
    );
    assert_eq!(p.count(), 2);
}

/// First moment, the trainer's lr (relative_step off, scale_parameter on) and a decoupled
/// weight decay λ = 0.1 scaled by lr_t.
#[test]
fn matrix_with_beta1_weight_decay_and_trainer_lr_match_reference() {
    let mut opt = build(r#"{"beta1": 0.9, "relative_step": false}"#).unwrap();
    let mut p = Param::new(&opt, &[3, 4]);
    let mut w = W;
    p.step(&mut opt, &mut w, &G1, 0.05, 0.1).unwrap();
    // lr_t = 0.047142293467048596, rms(update) before clip = 0.9975625271760586
    theta(
        &w,
        &[
            0.49544578288934016,
            -0.9892821438525328,
            0.2422690224595887,
            1.9890870384508483,
            -0.7397618609468684,
            1.4872053351631807,
            0.09952857706532953,
            -0.3019821925865857,
            1.1911053256156034,
            -0.594959761106777,
            0.7905962448098396,
            0.056326875414668756,
        ],
        "step 1 θ",
    );
    state(
        p.f32("exp_avg"),
        &[
            0.0021971024373074357,
            -0.006003626800762434,
            0.006552420203735088,
            0.0014845028557418881,
            -0.006702467043102918,
            0.005723320816761866,
            0.0,
            0.0033964613905971613,
            0.003237599168350757,
            -0.00221170128520013,
            0.005632371712796582,
            -0.006562586882003995,
        ],
        "step 1 M",
    );
    state(p.f32("exp_avg_sq_row"), &[0.035625000000000004, 0.061250000000000006, 0.06562499999999999], "step 1 R");

    p.step(&mut opt, &mut w, &G2, 0.05, 0.1).unwrap();
    // lr_t = 0.04677151435679522, rms(update) before clip = 1.005547021054677
    theta(
        &w,
        &[
            0.4979815999695647,
            -0.9813375090328804,
            0.2301418096087647,
            1.983538424661532,
            -0.7312994038968542,
            1.467552236604137,
            0.1025208348860829,
            -0.305468489034946,
            1.186069624139437,
            -0.5949257762337951,
            0.779899073747614,
            0.05502914167852132,
        ],
        "step 2 θ",
    );
    state(
        p.f32("exp_avg"),
        &[
            -0.00485309203496683,
            -0.00331761242024028,
            0.010994083944606457,
            -0.003754647508265511,
            -0.005002478800025549,
            0.012697213990535128,
            -0.003457768047865627,
            0.004898712893966331,
            -0.0005352785075819965,
            0.0027487320278501842,
            0.00699943270077044,
            0.0010342844099343754,
        ],
        "step 2 M",
    );
    state(
        p.f32("exp_avg_sq_col"),
        &[0.05516264624795497, 0.06573883456034378, 0.04403037171673585, 0.0689652894665876],
        "step 2 C",
    );
    assert_eq!(p.count(), 2);
}

/// Defaults on a vector. Step 1 by hand too: V = g² + eps1, so U = sign(g) (to 1e-30),
/// rms(U) = 1 (no clip) and lr_t = 1e-2·rms(θ) = 1e-2·√(6.5625/4) = 0.0128086884…
#[test]
fn vector_default_options_match_reference() {
    let mut opt = build("").unwrap();
    let mut p = Param::new(&opt, &[4]);
    let mut w = V;
    p.step(&mut opt, &mut w, &VG1, 0.5, 0.0).unwrap();
    let lr_t = 1e-2 * (6.5625f64 / 4.0).sqrt();
    let by_hand: Vec<f64> = V.iter().zip(&VG1).map(|(&w, &g)| f64::from(w) - lr_t * f64::from(g.signum())).collect();
    theta(&w, &by_hand, "step 1 θ by hand");
    // lr_t = 0.012808688457449497, rms(update) before clip = 1.0
    theta(&w, &[0.4871913115425505, -1.4871913115425506, 1.9871913115425506, 0.2628086884574495], "step 1 θ");
    state(p.f32("exp_avg_sq"), &[0.04000000000000001, 0.0025000000000000005, 0.25, 1.0], "step 1 V");

    p.step(&mut opt, &mut w, &VG2, 0.5, 0.0).unwrap();
    // lr_t = 0.01271523799086074, rms(update) before clip = 0.9676141111308122
    theta(&w, &[0.5026021716375365, -1.5037990944016355, 1.9868016293325361, 0.253215253433742], "step 2 θ");
    state(
        p.f32("exp_avg_sq"),
        &[0.10892190129982211, 0.05275555303112028, 0.1064701405431205, 0.6324165264009488],
        "step 2 V",
    );
    assert_eq!(p.count(), 2);
}

/// warmup_init: the relative step is min(1e-6·t, 1/√t), so step 2 is twice step 1's size.
#[test]
fn vector_warmup_init_matches_reference() {
    let mut opt = build(r#"{"warmup_init": true}"#).unwrap();
    let mut p = Param::new(&opt, &[4]);
    let mut w = V;
    p.step(&mut opt, &mut w, &VG1, 0.5, 0.0).unwrap();
    // lr_t = 1.2808688457449496e-06
    theta(&w, &[0.49999871913115423, -1.4999987191311543, 1.9999987191311543, 0.25000128086884577], "step 1 θ");
    p.step(&mut opt, &mut w, &VG2, 0.5, 0.0).unwrap();
    // lr_t = 2.561735816490494e-06
    theta(&w, &[0.5000018239532815, -1.5000020650970114, 1.999998640621977, 0.24999934808189195], "step 2 θ");
}

/// First moment and weight decay on a vector with a plain learning rate (no relative step,
/// no parameter scale). Step 1 by hand: U = 0.1·sign(g), M = 0.5·U = ±0.05,
/// θ = θ·(1 − 0.2·0.1) − M = (0.44, −1.42, 1.91, 0.295).
#[test]
fn vector_with_beta1_and_plain_lr_matches_reference() {
    let mut opt = build(r#"{"beta1": 0.5, "relative_step": false, "scale_parameter": false}"#).unwrap();
    let mut p = Param::new(&opt, &[4]);
    let mut w = V;
    p.step(&mut opt, &mut w, &VG1, 0.1, 0.2).unwrap();
    theta(&w, &[0.44, -1.42, 1.91, 0.295], "step 1 θ");
    state(p.f32("exp_avg"), &[0.05, -0.05, 0.05, -0.05], "step 1 M");

    p.step(&mut opt, &mut w, &VG2, 0.1, 0.2).unwrap();
    // lr_t = 0.1, rms(update) before clip = 0.9676141111308122
    theta(&w, &[0.46679996716562755, -1.4319066142805275, 1.8452676566404242, 0.27637583380427927], "step 2 θ");
    state(
        p.f32("exp_avg"),
        &[-0.03559996716562752, 0.04030661428052746, 0.02653234335957567, 0.012724166195720692],
        "step 2 M",
    );
    state(
        p.f32("exp_avg_sq"),
        &[0.10892190129982211, 0.05275555303112028, 0.1064701405431205, 0.6324165264009488],
        "step 2 V",
    );
}

/// g = [[10, 0], [0, 0.1]] is far from rank one: R = C = (50, 0.005), so v̂₁₁ = 0.005²/25.0025
/// ≈ 1e-6 and U₁₁ = 0.1/0.001 ≈ 100; rms(U) = 50.005 > 1 and U is divided by it. Unclipped
/// θ₁₁ would be 2 − 0.1·100 = −8; clipped it is 2 − 0.1·100/50.005 = 1.80001.
#[test]
fn clip_engages() {
    let mut opt = build(r#"{"relative_step": false, "scale_parameter": false}"#).unwrap();
    let mut p = Param::new(&opt, &[2, 2]);
    let mut w = [1.0f32, -1.0, 0.5, 2.0];
    p.step(&mut opt, &mut w, &[10.0, 0.0, 0.0, 0.1], 0.1, 0.0).unwrap();
    // reference: lr_t = 0.1, rms(update) before clip = 50.00499999999999
    theta(&w, &[0.9980000999925006, -1.0, 0.5, 1.8000099992500624], "clipped θ");

    // A vector's first step is U = sign(g) with RMS 1; clip_threshold 0.5 halves it:
    // θ − lr·0.5·sign(g), exactly (up to eps1).
    let mut opt = build(r#"{"relative_step": false, "scale_parameter": false, "clip_threshold": 0.5}"#).unwrap();
    let mut p = Param::new(&opt, &[4]);
    let mut w = V;
    p.step(&mut opt, &mut w, &VG1, 0.1, 0.0).unwrap();
    theta(&w, &[0.45, -1.45, 1.95, 0.3], "θ with clip_threshold 0.5");
}

/// A [2, 3, 4] tensor is two 3×4 matrices, each with its own row and column averages (and
/// its own mean(R)). Without the parameter scale and with the clip out of reach the tensor-wide
/// RMSs do not couple them, so the batched step equals two separate ones, bit for bit.
#[test]
fn batched_matrices_keep_their_own_averages() {
    let json = r#"{"scale_parameter": false, "clip_threshold": 1e6, "beta1": 0.8}"#;
    let mut opt = build(json).unwrap();
    let mut both = Param::new(&opt, &[2, 3, 4]);
    let mut wb: Vec<f32> = W.iter().chain(W.iter().rev()).copied().collect();
    let (mut w0, mut w1): ([f32; 12], [f32; 12]) = (W, W);
    w1.reverse();
    let (mut p0, mut p1) = (Param::new(&opt, &[3, 4]), Param::new(&opt, &[3, 4]));
    for (ga, gb) in [(G1, G2), (G2, G1), (G1, G1)] {
        let g: Vec<f32> = ga.iter().chain(&gb).copied().collect();
        both.step(&mut opt, &mut wb, &g, 0.1, 0.01).unwrap();
        p0.step(&mut opt, &mut w0, &ga, 0.1, 0.01).unwrap();
        p1.step(&mut opt, &mut w1, &gb, 0.1, 0.01).unwrap();
    }
    assert_eq!(wb[..12], w0);
    assert_eq!(wb[12..], w1);
    for name in ["exp_avg", "exp_avg_sq_row", "exp_avg_sq_col"] {
        let (b, a0, a1) = (both.f32(name), p0.f32(name), p1.f32(name));
        assert_eq!(b, [a0, a1].concat(), "{name}");
    }
    assert_eq!(both.f32("exp_avg_sq_row").len(), 6);
    assert_eq!(both.f32("exp_avg_sq_col").len(), 8);
}

/// A plain f64 transcription of the formulas (the Python reference's loops, in Rust), for
/// tensors too big to paste: [batch, rows, cols] with `cols` spanning several column tiles.
struct Naive {
    opt: Adafactor,
    t: u32,
    r: Vec<f64>,
    c: Vec<f64>,
    m: Vec<f64>,
}

impl Naive {
    fn step(&mut self, [batch, rows, cols]: [usize; 3], p: &mut [f64], g: &[f32], lr: f64, wd: f64) {
        let o = &self.opt;
        self.t += 1;
        let t = f64::from(self.t);
        let n = p.len() as f64;
        let rms = |x: &[f64]| (x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64).sqrt();
        let size = if o.relative_step { 1e-2f64.min(1.0 / t.sqrt()) } else { lr };
        let lr_t = size * if o.scale_parameter { o.eps2.max(rms(p)) } else { 1.0 };
        let b2 = 1.0 - t.powf(o.decay_rate);
        let u2 = |k: usize| f64::from(g[k]) * f64::from(g[k]) + o.eps1;
        let mut u = vec![0.0; p.len()];
        for b in 0..batch {
            let at = |i: usize, j: usize| (b * rows + i) * cols + j;
            for i in 0..rows {
                let mean = (0..cols).map(|j| u2(at(i, j))).sum::<f64>() / cols as f64;
                self.r[b * rows + i] = b2 * self.r[b * rows + i] + (1.0 - b2) * mean;
            }
            for j in 0..cols {
                let mean = (0..rows).map(|i| u2(at(i, j))).sum::<f64>() / rows as f64;
                self.c[b * cols + j] = b2 * self.c[b * cols + j] + (1.0 - b2) * mean;
            }
            let mean_r = self.r[b * rows..(b + 1) * rows].iter().sum::<f64>() / rows as f64;
            for i in 0..rows {
                for j in 0..cols {
                    let vhat = self.r[b * rows + i] / mean_r * self.c[b * cols + j];
                    u[at(i, j)] = f64::from(g[at(i, j)]) / vhat.sqrt();
                }
            }
        }
        let d = (rms(&u) / o.clip_threshold).max(1.0);
        let b1 = o.beta1.unwrap_or(0.0);
        for k in 0..u.len() {
            self.m[k] = b1 * self.m[k] + (1.0 - b1) * u[k] / d * lr_t;
            p[k] -= wd * lr_t * p[k] + self.m[k];
        }
        assert!(n > 0.0);
    }
}

/// Deterministic values in (−1, 1) (a 64-bit LCG).
fn noise(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f64 / (1u64 << 24) as f64 * 2.0 - 1.0) as f32
        })
        .collect()
}

/// Column tiles: a [2, 5, 2·TILE + 37] tensor (several tiles and a ragged last one, rows not
/// a multiple of the lanes) against the naive transcription, three steps with a first moment,
/// the parameter scale and weight decay.
#[test]
fn wide_matrices_match_the_naive_formulas() {
    let dims = [2, 5, 2 * TILE + 37];
    let n = dims.iter().product::<usize>();
    let mut opt = build(r#"{"beta1": 0.9}"#).unwrap();
    let mut naive = Naive { opt: opt.clone(), t: 0, r: vec![0.0; 10], c: vec![0.0; 2 * dims[2]], m: vec![0.0; n] };
    let shape: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
    let mut p = Param::new(&opt, &shape);
    let mut w = noise(n, 1);
    let mut want: Vec<f64> = w.iter().map(|&x| f64::from(x)).collect();
    for step in 0..3 {
        // Rows of very different scale, so mean(R) and the per-row factors matter.
        let mut g = noise(n, 10 + step);
        for (k, x) in g.iter_mut().enumerate() {
            *x *= [1.0, 0.01, 3.0, 0.2, 0.5][(k / dims[2]) % 5];
        }
        let before: Vec<f32> = w.clone();
        p.step(&mut opt, &mut w, &g, 0.5, 0.1).unwrap();
        naive.step(dims, &mut want, &g, 0.5, 0.1);
        // Compare the steps taken: θ is stored in f32 (|θ| < 1: rounding ≤ 6e-8), the step
        // is f32 arithmetic (a few ulps, relative) against f64.
        for (k, ((&got, &was), &want)) in w.iter().zip(&before).zip(&want).enumerate() {
            let (moved, want_moved) = (f64::from(got) - f64::from(was), want - f64::from(was));
            let err = (moved - want_moved).abs();
            assert!(err <= 1.2e-7 + 1e-5 * want_moved.abs(), "step {} Δθ[{k}] = {moved}, want {want_moved}", step + 1);
        }
        state(p.f32("exp_avg_sq_row"), &naive.r, "R");
        state(p.f32("exp_avg_sq_col"), &naive.c, "C");
        want = w.iter().map(|&x| f64::from(x)).collect();
    }
}

/// The step size follows the parameter's own count, not the trainer's global step: a
/// parameter that starts late takes a first step (β2_t = 0, relative step 1e-2) whatever the
/// global step is.
#[test]
fn counts_its_own_steps() {
    let mut opt = Adafactor::default();
    let info = ParamInfo::new("w", &[4]);
    let mut run = |global: u64| {
        let (mut v, mut t) = ([0.0f32; 4], [0u32; 1]);
        let mut state = [
            StateBuf::new(DType::F32, bytemuck::cast_slice_mut(&mut v)),
            StateBuf::new(DType::U32, bytemuck::cast_slice_mut(&mut t)),
        ];
        let mut w = V;
        let ctx = StepContext { step: global, lr: 1.0, weight_decay: 0.0, threads: 1, grad_scale: 1.0 };
        opt.step(&info, &mut w, &VG1, &mut state, &ctx).unwrap();
        (w, t[0])
    };
    let (first, t1) = run(1);
    let (late, t2) = run(5000);
    assert_eq!(first, late);
    assert_eq!((t1, t2), (1, 1));
}

/// A zero gradient (eps1 keeps the averages positive) moves θ only by the weight decay; a
/// rank-0 parameter is kept like a vector of one.
#[test]
fn zero_gradient_and_scalars() {
    let mut opt = build(r#"{"relative_step": false, "scale_parameter": false}"#).unwrap();
    let mut p = Param::new(&opt, &[3, 4]);
    let mut w = W;
    p.step(&mut opt, &mut w, &[0.0; 12], 0.1, 0.5).unwrap();
    let want: Vec<f64> = W.iter().map(|&x| f64::from(x) * 0.95).collect();
    theta(&w, &want, "θ after a zero gradient");
    state(p.f32("exp_avg_sq_row"), &[1e-30; 3], "R");

    let mut p = Param::new(&opt, &[]);
    let mut w = [2.0f32];
    p.step(&mut opt, &mut w, &[-3.0], 0.1, 0.0).unwrap();
    theta(&w, &[2.1], "scalar θ");
    state(p.f32("exp_avg_sq"), &[9.0], "scalar V");
}

/// A parameter at zero (e.g. a freshly zeroed bias) still moves: scale_parameter floors the
/// parameter scale at eps2, so a first default step is θ − 1e-2·1e-3·sign(g).
#[test]
fn parameter_scale_is_floored_at_eps2() {
    let mut opt = build("").unwrap();
    let mut p = Param::new(&opt, &[4]);
    let mut w = [0.0f32; 4];
    p.step(&mut opt, &mut w, &VG1, 0.5, 0.0).unwrap();
    theta(&w, &[-1e-5, 1e-5, -1e-5, 1e-5], "θ");
    close_to(&w, &[-1e-5, 1e-5, -1e-5, 1e-5], 1e-6, 0.0, "θ, relative");
}

#[test]
fn state_layout_names_dtypes_and_lengths() {
    let layout = |opt: &Adafactor, shape: &[u64]| -> Vec<(String, DType, u64)> {
        let specs = opt.state_layout(&ParamInfo::new("p", shape)).unwrap();
        specs.into_iter().map(|s| (s.name.to_string(), s.dtype, s.len)).collect()
    };
    let s = |name: &str, dtype, len| (name.to_string(), dtype, len);
    let plain = Adafactor::default();
    let beta1 = Adafactor { beta1: Some(0.9), ..Adafactor::default() };
    assert_eq!(
        layout(&plain, &[3, 4]),
        [s("exp_avg_sq_row", DType::F32, 3), s("exp_avg_sq_col", DType::F32, 4), s("step", DType::U32, 1)]
    );
    assert_eq!(
        layout(&plain, &[2, 3, 4]),
        [s("exp_avg_sq_row", DType::F32, 6), s("exp_avg_sq_col", DType::F32, 8), s("step", DType::U32, 1)]
    );
    assert_eq!(layout(&plain, &[5]), [s("exp_avg_sq", DType::F32, 5), s("step", DType::U32, 1)]);
    assert_eq!(layout(&plain, &[]), [s("exp_avg_sq", DType::F32, 1), s("step", DType::U32, 1)]);
    assert_eq!(
        layout(&beta1, &[3, 4]),
        [
            s("exp_avg", DType::F32, 12),
            s("exp_avg_sq_row", DType::F32, 3),
            s("exp_avg_sq_col", DType::F32, 4),
            s("step", DType::U32, 1)
        ]
    );
    assert_eq!(
        layout(&beta1, &[2, 3, 4]),
        [
            s("exp_avg", DType::F32, 24),
            s("exp_avg_sq_row", DType::F32, 6),
            s("exp_avg_sq_col", DType::F32, 8),
            s("step", DType::U32, 1)
        ]
    );
    assert_eq!(
        layout(&beta1, &[5]),
        [s("exp_avg", DType::F32, 5), s("exp_avg_sq", DType::F32, 5), s("step", DType::U32, 1)]
    );
}

#[test]
fn wrong_state_is_refused_and_the_parameter_left_alone() {
    let mut opt = Adafactor::default();
    let info = ParamInfo::new("model.norm.weight", &[2]);
    let ctx = StepContext { step: 1, lr: 0.1, weight_decay: 0.0, threads: 1, grad_scale: 1.0 };
    let (mut w, g) = ([1.0f32, 2.0], [0.1f32, 0.2]);

    let mut v = [0.0f32; 2];
    let mut state = [StateBuf::new(DType::F32, bytemuck::cast_slice_mut(&mut v))];
    let err = opt.step(&info, &mut w, &g, &mut state, &ctx).unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidInput);
    assert_eq!(
        err.message.as_str(),
        "adafactor expects 2 state buffers (exp_avg_sq, step) for model.norm.weight of shape [2], got 1"
    );

    // The step count given as f32.
    let (mut v, mut t) = ([0.0f32; 2], [0.0f32; 1]);
    let mut state = [
        StateBuf::new(DType::F32, bytemuck::cast_slice_mut(&mut v)),
        StateBuf::new(DType::F32, bytemuck::cast_slice_mut(&mut t)),
    ];
    let err = opt.step(&info, &mut w, &g, &mut state, &ctx).unwrap_err();
    assert_eq!(err.message.as_str(), "adafactor: state buffer 'step': state buffer is f32, read as u32");

    // A second moment of the wrong length: nothing may change, the count included.
    let (mut v, mut t) = ([0.0f32; 3], [0u32; 1]);
    let mut state = [
        StateBuf::new(DType::F32, bytemuck::cast_slice_mut(&mut v)),
        StateBuf::new(DType::U32, bytemuck::cast_slice_mut(&mut t)),
    ];
    let err = opt.step(&info, &mut w, &g, &mut state, &ctx).unwrap_err();
    assert_eq!(err.message.as_str(), "exp_avg_sq has 3 elements, expected 2");
    assert_eq!(t, [0]);

    // A matrix with beta1 handed a vector's buffers.
    let mut opt = Adafactor { beta1: Some(0.9), ..Adafactor::default() };
    let info = ParamInfo::new("lm_head.weight", &[1, 2]);
    let (mut m, mut v, mut t) = ([0.0f32; 2], [0.0f32; 2], [0u32; 1]);
    let mut state = [
        StateBuf::new(DType::F32, bytemuck::cast_slice_mut(&mut m)),
        StateBuf::new(DType::F32, bytemuck::cast_slice_mut(&mut v)),
        StateBuf::new(DType::U32, bytemuck::cast_slice_mut(&mut t)),
    ];
    let err = opt.step(&info, &mut w, &g, &mut state, &ctx).unwrap_err();
    assert_eq!(
        err.message.as_str(),
        "adafactor expects 4 state buffers (exp_avg, exp_avg_sq_row, exp_avg_sq_col, step) \
         for lm_head.weight of shape [1, 2], got 3"
    );
    assert_eq!(w, [1.0, 2.0], "a refused step leaves the parameter alone");
    assert_eq!((m, v, t), ([0.0; 2], [0.0; 2], [0]), "and its state");
}

#[test]
fn defaults_are_transformers_defaults() {
    let m = Adafactor::manifest();
    m.validate().unwrap();
    assert_eq!(m.name.as_str(), "adafactor");
    assert_eq!(m.kind, PluginKind::Optimizer);
    let names: Vec<&str> = m.options.iter().map(|o| o.name.as_str()).collect();
    assert_eq!(
        names,
        ["eps", "clip_threshold", "decay_rate", "beta1", "scale_parameter", "relative_step", "warmup_init"]
    );
    let opt = build("").unwrap();
    // serde_json (without its float_roundtrip feature) reads "1e-30" one ulp low.
    assert!((opt.eps1 / 1e-30 - 1.0).abs() < 1e-15, "eps1 = {:e}", opt.eps1);
    let opt = Adafactor { eps1: 1e-30, ..opt };
    assert_eq!(opt, Adafactor::default());
    assert_eq!(
        opt,
        Adafactor {
            eps1: 1e-30,
            eps2: 1e-3,
            clip_threshold: 1.0,
            decay_rate: -0.8,
            beta1: None,
            scale_parameter: true,
            relative_step: true,
            warmup_init: false,
        }
    );
}

#[test]
fn options_are_checked_all_at_once() {
    let err = build(
        r#"{"eps": [0], "clip_threshold": 0, "decay_rate": 0.5, "beta1": 1, "relative_step": false,
            "warmup_init": true, "betas": [0.9, 0.99]}"#,
    )
    .unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidOptions);
    let details: Vec<&str> = err.details().collect();
    assert_eq!(
        details,
        [
            "unknown option 'betas' (did you mean 'beta1'?)",
            "option 'eps': expected 2 values [eps1, eps2], got 1",
            "option 'eps': eps1 = 0 must be > 0",
            "option 'clip_threshold': 0 must be > 0",
            "option 'decay_rate': 0.5 must be < 0 (β2 at step t is 1 − t^decay_rate)",
            "option 'beta1': 1 must be in [0, 1)",
            "option 'warmup_init': needs relative_step = true (the warm-up is of the relative step size)",
        ]
    );
    let err = build(r#"{"eps": [1e-30, -1], "decay_rate": 0, "beta1": -0.1}"#).unwrap_err();
    let details: Vec<&str> = err.details().collect();
    assert_eq!(
        details,
        [
            "option 'eps': eps2 = -1 must be > 0",
            "option 'decay_rate': 0 must be < 0 (β2 at step t is 1 − t^decay_rate)",
            "option 'beta1': -0.1 must be in [0, 1)",
        ]
    );
}

/// Built from JSON as the host does (through the FFI constructor's option parsing).
#[test]
fn built_from_json_options() {
    let opt = build(
        r#"{"eps": [1e-20, 1e-4], "clip_threshold": 2, "decay_rate": -0.5, "beta1": 0.9,
            "scale_parameter": false, "relative_step": true, "warmup_init": true}"#,
    )
    .unwrap();
    assert_eq!(
        opt,
        Adafactor {
            eps1: 1e-20,
            eps2: 1e-4,
            clip_threshold: 2.0,
            decay_rate: -0.5,
            beta1: Some(0.9),
            scale_parameter: false,
            relative_step: true,
            warmup_init: true,
        }
    );
    let opt = build(r#"{"relative_step": "false", "beta1": 0}"#).unwrap();
    assert!(!opt.relative_step);
    assert_eq!(opt.beta1, Some(0.0));
}

#[test]
fn takes_cuda_buffers_only_when_built_with_cuda() {
    let manifest = Adafactor::manifest();
    assert!(manifest.runs_on(Device::Cpu));
    assert_eq!(manifest.runs_on(Device::Cuda), cfg!(feature = "cuda"));
}
