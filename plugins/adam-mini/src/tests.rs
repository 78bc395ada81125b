use super::*;

fn build(json: &str) -> Result<AdamMini, PluginError> {
    ava_core::ffi::build::<AdamMini>(json, &HostContext::default())
}

/// The three state buffers of one parameter, sized from the optimizer's own layout.
struct State {
    m: Vec<f32>,
    v: Vec<f32>,
    t: Vec<u32>,
}

impl State {
    fn new(opt: &AdamMini, name: &str, shape: &[u64]) -> State {
        let layout = opt.state_layout(&ParamInfo::new(name, shape)).unwrap();
        State { m: vec![0.0; layout[0].len as usize], v: vec![0.0; layout[1].len as usize], t: vec![0; 1] }
    }
}

/// One step of `name` (of `shape`) with learning rate `lr` and weight decay `wd`; the
/// trainer's global step is `global`.
#[allow(clippy::too_many_arguments)]
fn run(
    opt: &mut AdamMini,
    name: &str,
    shape: &[u64],
    w: &mut [f32],
    g: &[f32],
    s: &mut State,
    global: u64,
    lr: f64,
    wd: f64,
) -> Result<(), PluginError> {
    let info = ParamInfo::new(name, shape);
    let mut state = [
        StateBuf::new(DType::F32, bytemuck::cast_slice_mut(&mut s.m)),
        StateBuf::new(DType::F32, bytemuck::cast_slice_mut(&mut s.v)),
        StateBuf::new(DType::U32, bytemuck::cast_slice_mut(&mut s.t)),
    ];
    let ctx = StepContext { step: global, lr, weight_decay: wd, threads: 1, grad_scale: 1.0 };
    opt.step(&info, w, g, &mut state, &ctx)
}

fn close(got: &[f32], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!((g as f64 - w).abs() < tol, "{what}[{i}] = {g}, want {w}");
    }
}

/// With `adam_names` matching, every block is one element and the step is AdamW's. The
/// numbers are those of adamw.rs's `matches_hand_computed_steps` (β = (0.5, 0.75), lr = 0.1,
/// θ = (1, −2)):
///
/// step 1, λ = 0, g = (2, −1): m = (1, −0.5), v = (1, 0.25); bc1 = 0.5, bc2 = 0.25
///   → m̂ = (2, −1), √v̂ = (2, 1) → θ = (0.9, −1.9).
/// step 2, λ = 0.5, g = (−1, 3): θ·0.95 = (0.855, −1.805); m = (0, 1.25), v = (1, 2.4375);
///   bc1 = 0.75, bc2 = 0.4375 → m̂ = (0, 5/3), v̂ = (16/7, 39/7) → θ₁ −= 0.1·(5/3)/√(39/7).
/// step 3, λ = 0.5, g = (0.5, 0): m = (0.25, 0.625), v = (0.8125, 1.828125); bc1 = 0.875,
///   bc2 = 0.578125 → m̂ = (2/7, 5/7), v̂ = (52/37, 117/37).
///
/// The parameter is a `[1, 2]` matrix, which without `adam_names` would be ONE block (a
/// row); the trainer's global step starts at 11, so the bias corrections must come from
/// the parameter's own count.
#[test]
fn adam_names_blocks_of_one_match_adamw() {
    let mut opt = build(r#"{"betas": [0.5, 0.75], "adam_names": ["lm_head"]}"#).unwrap();
    let (name, shape) = ("lm_head.weight", [1u64, 2]);
    let mut s = State::new(&opt, name, &shape);
    assert_eq!(s.v.len(), 2, "one v per element");
    let mut w = [1.0f32, -2.0];

    run(&mut opt, name, &shape, &mut w, &[2.0, -1.0], &mut s, 11, 0.1, 0.0).unwrap();
    close(&w, &[0.9, -1.9], 1e-6, "step 1 θ");
    close(&s.m, &[1.0, -0.5], 1e-7, "step 1 m");
    close(&s.v, &[1.0, 0.25], 1e-7, "step 1 v");
    assert_eq!(s.t, [1]);

    run(&mut opt, name, &shape, &mut w, &[-1.0, 3.0], &mut s, 12, 0.1, 0.5).unwrap();
    let w2 = [0.855, -1.805 - 0.1 * (5.0 / 3.0) / (39.0f64 / 7.0).sqrt()];
    close(&w, &w2, 1e-6, "step 2 θ");
    close(&s.m, &[0.0, 1.25], 1e-7, "step 2 m");
    close(&s.v, &[1.0, 2.4375], 1e-6, "step 2 v");

    run(&mut opt, name, &shape, &mut w, &[0.5, 0.0], &mut s, 13, 0.1, 0.5).unwrap();
    let w3 = [
        w2[0] * 0.95 - 0.1 * (2.0 / 7.0) / f64::sqrt(52.0 / 37.0),
        w2[1] * 0.95 - 0.1 * (5.0 / 7.0) / f64::sqrt(117.0 / 37.0),
    ];
    close(&w, &w3, 1e-6, "step 3 θ");
    close(&s.m, &[0.25, 0.625], 1e-7, "step 3 m");
    close(&s.v, &[0.8125, 1.828125], 1e-6, "step 3 v");
    assert_eq!(s.t, [3], "the parameter's own count");
}

/// A `q_proj` of shape [4, 2] with head_dim 2: head 0 = elements 0..4, head 1 = 4..8.
/// Worked by hand, β = (0.5, 0.75), lr = 0.1, ε = 1e-8 (moves θ by < 1e-8).
///
/// step 1, λ = 0. bc1 = 0.5, bc2 = 0.25, lr/bc1 = 0.2.
///   head 0: g = (1, −1, 1, 1), mean g² = 1 → v = 0.25·1 = 0.25, √v/√bc2 = 0.5/0.5 = 1.
///   head 1: g = (4, −4, 2, 0), mean g² = (16 + 16 + 4 + 0)/4 = 9 → v = 2.25, √v/√bc2 = 3.
///   m = 0.5·g = (0.5, −0.5, 0.5, 0.5 | 2, −2, 1, 0); θ −= 0.2·m/denom:
///   head 0 moves by 0.1·g, head 1 by 0.1·g/3.
/// step 2, λ = 0.5 (θ·0.95 first). bc1 = 0.75, bc2 = 0.4375, lr/bc1 = 2/15.
///   head 0: g = (−1, 1, 1, 3), mean g² = 12/4 = 3 → v = 0.75·0.25 + 0.25·3 = 0.9375,
///     v/bc2 = 15/7.
///   head 1: g = 0 → v = 0.75·2.25 = 1.6875, v/bc2 = 27/7.
///   m = 0.5·m + 0.5·g = (−0.25, 0.25, 0.75, 1.75 | 1, −1, 0.5, 0).
///   θ = 0.95·θ − (2/15)·m/√(v/bc2).
#[test]
fn query_heads_share_one_v() {
    let mut opt = build(r#"{"betas": [0.5, 0.75], "head_dim": 2}"#).unwrap();
    let (name, shape) = ("model.layers.0.self_attn.q_proj.weight", [4u64, 2]);
    let mut s = State::new(&opt, name, &shape);
    assert_eq!((s.m.len(), s.v.len()), (8, 2));
    let mut w = [1.0f32, -2.0, 0.5, 3.0, 0.0, 1.0, -1.0, 2.0];

    run(&mut opt, name, &shape, &mut w, &[1.0, -1.0, 1.0, 1.0, 4.0, -4.0, 2.0, 0.0], &mut s, 1, 0.1, 0.0).unwrap();
    let w1 = [0.9, -1.9, 0.4, 2.9, -0.4 / 3.0, 1.0 + 0.4 / 3.0, -1.0 - 0.2 / 3.0, 2.0];
    close(&w, &w1, 1e-6, "step 1 θ");
    close(&s.m, &[0.5, -0.5, 0.5, 0.5, 2.0, -2.0, 1.0, 0.0], 1e-7, "step 1 m");
    close(&s.v, &[0.25, 2.25], 1e-7, "step 1 v");

    run(&mut opt, name, &shape, &mut w, &[-1.0, 1.0, 1.0, 3.0, 0.0, 0.0, 0.0, 0.0], &mut s, 2, 0.1, 0.5).unwrap();
    let m2 = [-0.25, 0.25, 0.75, 1.75, 1.0, -1.0, 0.5, 0.0];
    let d = [(15.0f64 / 7.0).sqrt(), (27.0f64 / 7.0).sqrt()];
    let w2: Vec<f64> = (0..8).map(|i| w1[i] * 0.95 - (2.0 / 15.0) * m2[i] / d[i / 4]).collect();
    close(&w, &w2, 1e-6, "step 2 θ");
    close(&s.m, &m2, 1e-7, "step 2 m");
    close(&s.v, &[0.9375, 1.6875], 1e-6, "step 2 v");
    assert_eq!(s.t, [2]);
}

/// A norm gain of 3 elements: one block. β = (0.5, 0.75), lr = 0.1, λ = 0, worked by hand.
///
/// step 1: g = (5, −1, 1), mean g² = 27/3 = 9 → v = 0.25·9 = 2.25, √v/√bc2 = 1.5/0.5 = 3;
///   m = (2.5, −0.5, 0.5); θ −= 0.2·m/3 = g/30 → θ = (1 − 1/6, 2 + 1/30, 3 − 1/30).
/// step 2: g = (1, 1, 1), mean g² = 1 → v = 0.75·2.25 + 0.25 = 1.9375, v/bc2 = 31/7;
///   m = 0.5·m + 0.5·g = (1.75, 0.25, 0.75); θ −= (2/15)·m/√(31/7).
#[test]
fn vector_is_one_block() {
    let mut opt = build(r#"{"betas": [0.5, 0.75], "head_dim": 2}"#).unwrap();
    let (name, shape) = ("model.norm.weight", [3u64]);
    let mut s = State::new(&opt, name, &shape);
    assert_eq!(s.v.len(), 1);
    let mut w = [1.0f32, 2.0, 3.0];

    run(&mut opt, name, &shape, &mut w, &[5.0, -1.0, 1.0], &mut s, 1, 0.1, 0.0).unwrap();
    let w1 = [1.0 - 1.0 / 6.0, 2.0 + 1.0 / 30.0, 3.0 - 1.0 / 30.0];
    close(&w, &w1, 1e-6, "step 1 θ");
    close(&s.m, &[2.5, -0.5, 0.5], 1e-7, "step 1 m");
    close(&s.v, &[2.25], 1e-7, "step 1 v");

    run(&mut opt, name, &shape, &mut w, &[1.0, 1.0, 1.0], &mut s, 2, 0.1, 0.0).unwrap();
    let m2 = [1.75, 0.25, 0.75];
    let w2: Vec<f64> = (0..3).map(|i| w1[i] - (2.0 / 15.0) * m2[i] / (31.0f64 / 7.0).sqrt()).collect();
    close(&w, &w2, 1e-6, "step 2 θ");
    close(&s.m, &m2, 1e-7, "step 2 m");
    close(&s.v, &[1.9375], 1e-6, "step 2 v");
}

/// Rows long enough to use the vectorized lanes of the Σg² and a remainder (21 = 2·8 + 5).
/// At step 1, m̂ = g and v̂ = mean g² of the row, so the update is lr·g/(rms(row) + ε).
#[test]
fn first_step_divides_by_row_rms() {
    let mut opt = AdamMini::default();
    let (name, shape) = ("model.layers.0.mlp.down_proj.weight", [3u64, 21]);
    let mut s = State::new(&opt, name, &shape);
    assert_eq!(s.v.len(), 3);
    let g: Vec<f32> = (0..63).map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.01 * (1 + i / 21) as f32).collect();
    let mut w = vec![1.0f32; 63];
    run(&mut opt, name, &shape, &mut w, &g, &mut s, 1, 1e-2, 0.0).unwrap();
    let want: Vec<f64> = (0..63)
        .map(|i| {
            let row = &g[i / 21 * 21..][..21];
            let rms = (row.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>() / 21.0).sqrt();
            1.0 - 1e-2 * f64::from(g[i]) / (rms + 1e-8)
        })
        .collect();
    close(&w, &want, 1e-6, "θ");
}

/// Every parameter kind of a small Llama (d = 8, 2 heads of head_dim 4, 1 KV head, ffn 12,
/// vocab 16) and of a MoE block (4 experts).
#[test]
fn state_layout_per_parameter_kind() {
    let opt = build(r#"{"head_dim": 4, "adam_names": ["embed_tokens"]}"#).unwrap();
    let cases: &[(&str, &[u64], usize, usize)] = &[
        ("model.embed_tokens.weight", &[16, 8], 128, 128), // adam_names: per element
        ("model.layers.0.input_layernorm.weight", &[8], 8, 1),
        ("model.layers.0.self_attn.q_proj.weight", &[8, 8], 64, 2), // 2 heads
        ("model.layers.0.self_attn.k_proj.weight", &[4, 8], 32, 1), // GQA: 1 KV head
        ("model.layers.0.self_attn.v_proj.weight", &[4, 8], 32, 4), // rows
        ("model.layers.0.self_attn.o_proj.weight", &[8, 8], 64, 8),
        ("model.layers.0.post_attention_layernorm.weight", &[8], 8, 1),
        ("model.layers.0.mlp.gate_proj.weight", &[12, 8], 96, 12),
        ("model.layers.0.mlp.up_proj.weight", &[12, 8], 96, 12),
        ("model.layers.0.mlp.down_proj.weight", &[8, 12], 96, 8),
        ("model.layers.0.block_sparse_moe.gate.weight", &[4, 8], 32, 4),
        ("model.layers.0.block_sparse_moe.experts.3.w1.weight", &[12, 8], 96, 12),
        ("model.layers.0.block_sparse_moe.experts.3.w2.weight", &[8, 12], 96, 8),
        ("model.layers.0.attention.wq.weight", &[8, 8], 64, 2),
        ("model.layers.0.self_attn.q_proj.bias", &[8], 8, 1),
        ("model.norm.weight", &[8], 8, 1),
        ("lm_head.weight", &[16, 8], 128, 16), // one block per token
        ("conv.weight", &[2, 3, 4], 24, 1),
    ];
    for &(name, shape, numel, blocks) in cases {
        let layout: Vec<(String, DType, u64)> = opt
            .state_layout(&ParamInfo::new(name, shape))
            .unwrap()
            .into_iter()
            .map(|s| (s.name.to_string(), s.dtype, s.len))
            .collect();
        let want = [
            ("exp_avg".to_string(), DType::F32, numel as u64),
            ("exp_avg_sq".to_string(), DType::F32, blocks as u64),
            ("step".to_string(), DType::U32, 1),
        ];
        assert_eq!(layout, want, "{name} {shape:?}");
    }
    // adam_names wins over the per-head rule, so it needs no head_dim.
    let adam = build(r#"{"adam_names": ["q_proj"]}"#).unwrap();
    let layout = adam.state_layout(&ParamInfo::new("model.layers.0.self_attn.q_proj.weight", &[8, 8])).unwrap();
    assert_eq!(layout[1].len, 64);
    // A name that merely contains "k_proj" inside a segment is an ordinary matrix.
    let rows = AdamMini::default().state_layout(&ParamInfo::new("model.block_proj.weight", &[6, 8])).unwrap();
    assert_eq!(rows[1].len, 6);
}

#[test]
fn query_key_partition_errors() {
    let unset = AdamMini::default();
    let err = unset.state_layout(&ParamInfo::new("model.layers.0.self_attn.q_proj.weight", &[8, 8])).unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidInput);
    assert_eq!(
        err.message.as_str(),
        "adam-mini splits model.layers.0.self_attn.q_proj.weight into one block per attention head, but head_dim \
         is not set; set plugins.optimizer.head_dim to the model's hidden_size / num_heads"
    );
    let opt = AdamMini { head_dim: Some(4), ..AdamMini::default() };
    let err = opt.state_layout(&ParamInfo::new("model.layers.1.self_attn.k_proj.weight", &[6, 8])).unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidInput);
    assert_eq!(
        err.message.as_str(),
        "adam-mini: model.layers.1.self_attn.k_proj.weight has shape [6, 8], whose 6 rows do not split into heads of \
         head_dim = 4 rows"
    );
    // step refuses it the same way, leaving θ alone.
    let mut unset = unset;
    let (name, shape) = ("model.layers.0.self_attn.q_proj.weight", [2u64, 2]);
    let mut s = State { m: vec![0.0; 4], v: vec![0.0; 1], t: vec![0] };
    let mut w = [1.0f32; 4];
    let err = run(&mut unset, name, &shape, &mut w, &[1.0; 4], &mut s, 1, 0.1, 0.0).unwrap_err();
    assert!(err.message.contains("head_dim is not set"), "{err}");
    assert_eq!(w, [1.0; 4]);
}

#[test]
fn wrong_state_is_refused_and_parameter_untouched() {
    let mut opt = AdamMini::default();
    let (name, shape) = ("model.layers.0.mlp.up_proj.weight", [2u64, 2]);
    let info = ParamInfo::new(name, &shape);
    let ctx = StepContext { step: 1, lr: 0.1, weight_decay: 0.1, threads: 1, grad_scale: 1.0 };
    let (mut w, g) = ([1.0f32, 2.0, 3.0, 4.0], [0.1f32; 4]);

    // Two buffers instead of three.
    let (mut m, mut v) = ([0.0f32; 4], [0.0f32; 2]);
    let mut state = [
        StateBuf::new(DType::F32, bytemuck::cast_slice_mut(&mut m)),
        StateBuf::new(DType::F32, bytemuck::cast_slice_mut(&mut v)),
    ];
    let err = opt.step(&info, &mut w, &g, &mut state, &ctx).unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidInput);
    assert_eq!(err.message.as_str(), "adam-mini expects 3 state buffers (exp_avg, exp_avg_sq, step), got 2");

    // exp_avg_sq with one per element instead of one per row.
    let mut s = State { m: vec![0.0; 4], v: vec![0.0; 4], t: vec![0] };
    let err = run(&mut opt, name, &shape, &mut w, &g, &mut s, 1, 0.1, 0.1).unwrap_err();
    assert_eq!(err.message.as_str(), "exp_avg_sq has 4 elements, expected 2");
    assert_eq!(s.t, [0], "the step count is not advanced by a refused step");

    // step stored as f32.
    let (mut m, mut v, mut t) = ([0.0f32; 4], [0.0f32; 2], [0.0f32; 1]);
    let mut state = [
        StateBuf::new(DType::F32, bytemuck::cast_slice_mut(&mut m)),
        StateBuf::new(DType::F32, bytemuck::cast_slice_mut(&mut v)),
        StateBuf::new(DType::F32, bytemuck::cast_slice_mut(&mut t)),
    ];
    let err = opt.step(&info, &mut w, &g, &mut state, &ctx).unwrap_err();
    assert_eq!(err.message.as_str(), "adam-mini: state buffer 'step': state buffer is f32, read as u32");

    // Gradient of the wrong length.
    let mut s = State::new(&opt, name, &shape);
    let err = run(&mut opt, name, &shape, &mut w, &g[..3], &mut s, 1, 0.1, 0.1).unwrap_err();
    assert_eq!(err.message.as_str(), "grad has 3 elements, expected 4");

    assert_eq!(w, [1.0, 2.0, 3.0, 4.0], "refused steps leave the parameter alone");
    assert_eq!(m, [0.0; 4]);
}

#[test]
fn options_defaults() {
    let opt = build("").unwrap();
    assert_eq!(opt, AdamMini::default());
    assert_eq!(opt, AdamMini { beta1: 0.9, beta2: 0.999, eps: 1e-8, head_dim: None, adam_names: Vec::new() });
    let ok = build(r#"{"betas": [0.8, 0.95], "eps": 1e-6, "head_dim": 64, "adam_names": ["embed_tokens", "lm_head"]}"#)
        .unwrap();
    assert_eq!(
        ok,
        AdamMini {
            beta1: 0.8,
            beta2: 0.95,
            eps: 1e-6,
            head_dim: Some(64),
            adam_names: vec!["embed_tokens".into(), "lm_head".into()],
        }
    );
}

#[test]
fn options_are_checked_all_at_once() {
    let err =
        build(r#"{"betas": [1.0], "eps": 0, "head_dim": 0, "adam_names": ["lm_head", ""], "lr": 1}"#).unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidOptions);
    let details: Vec<&str> = err.details().collect();
    assert_eq!(
        details,
        [
            "unknown option 'lr' (known: betas, eps, head_dim, adam_names)",
            "option 'betas': expected 2 values [β1, β2], got 1",
            "option 'betas': β1 = 1 must be in [0, 1)",
            "option 'eps': 0 must be > 0",
            "option 'head_dim': 0 must be ≥ 1",
            "option 'adam_names': item 1 is empty (it would match every parameter)",
        ]
    );
    let err = build(r#"{"head_dim": 2.5}"#).unwrap_err();
    assert_eq!(err.details().collect::<Vec<_>>(), ["option 'head_dim': expected integer, got a number (2.5)"]);
}

#[test]
fn manifest_is_valid() {
    let m = AdamMini::manifest();
    m.validate().unwrap();
    assert_eq!(m.name.as_str(), "adam-mini");
    assert_eq!(m.kind, PluginKind::Optimizer);
    let names: Vec<&str> = m.options.iter().map(|o| o.name.as_str()).collect();
    assert_eq!(names, ["betas", "eps", "head_dim", "adam_names"]);
}

/// `sum_sq` as a GPU adds it: each chunk of 1024 in 32 strided f64 lanes added in lane order,
/// then the chunks' sums level by level, each level's groups of 32 in order.
fn sum_sq_by_levels(g: &[f32]) -> f64 {
    let mut level: Vec<f64> = g
        .chunks(CHUNK)
        .map(|chunk| {
            let mut value = 0.0;
            for k in 0..LANES {
                let mut lane = 0.0f64;
                for &x in chunk.iter().skip(k).step_by(LANES) {
                    lane += f64::from(x) * f64::from(x);
                }
                value += lane;
            }
            value
        })
        .collect();
    if level.len() == 1 {
        return level[0];
    }
    while level.len() > 1 {
        level = level
            .chunks(ava_core::math::TREE_FAN)
            .map(|group| {
                let mut s = 0.0;
                for &v in group {
                    s += v;
                }
                s
            })
            .collect();
    }
    level.first().copied().unwrap_or(0.0)
}

/// The block's Σ g² is the fixed tree the GPU adds (the same bits), for lengths around every
/// level's edges, and the exact sum to f64's rounding.
#[test]
fn sum_sq_is_the_gpus_tree() {
    let mut s = 3u64;
    let g: Vec<f32> = (0..1_100_000)
        .map(|i| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let x = ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0;
            x * [1.0, 1e-3, 30.0, 1e-6][i % 4]
        })
        .collect();
    let mut differs_from_lanes = false;
    for len in [0, 1, 31, 32, 33, 1023, 1024, 1025, 32 * 1024 - 1, 32 * 1024, 32 * 1024 + 5, 1_100_000] {
        let got = sum_sq(&g[..len]);
        assert_eq!(got.to_bits(), sum_sq_by_levels(&g[..len]).to_bits(), "length {len}");
        let sequential = g[..len].iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>();
        assert!((got - sequential).abs() <= 1e-13 * sequential, "length {len}: {got} against {sequential}");
        differs_from_lanes |= got != sequential;
    }
    assert!(differs_from_lanes, "the test's values do not tell the orders apart");
}

#[test]
fn takes_cuda_buffers_only_when_built_with_cuda() {
    let manifest = AdamMini::manifest();
    assert!(manifest.runs_on(Device::Cpu));
    assert_eq!(manifest.runs_on(Device::Cuda), cfg!(feature = "cuda"));
}
