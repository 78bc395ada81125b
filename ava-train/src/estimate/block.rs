//! What one kept transformer block holds for backward, op by op, as formulas: the terms
//! `ava estimate` prints under "per kept block" and whose sum is the `activation_bytes` the
//! checkpoint policy sees. A unit test checks the sum against the shadow replay of
//! `Model::block`, so the formulas cannot drift from the code they describe.

use super::{Component, Term};
use crate::model::{Biases, ModelSpec};

/// The sizes the formulas are written in.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dims {
    /// Micro-batch B.
    pub b: u64,
    /// Sequence length T.
    pub t: u64,
    /// Width d.
    pub d: u64,
    /// Query heads H.
    pub h: u64,
    /// Key/value heads.
    pub hkv: u64,
    /// Head size D.
    pub hd: u64,
    /// SwiGLU width F.
    pub f: u64,
    /// Vocabulary V.
    pub v: u64,
    /// Bytes per element of the compute type (4, or 2 for bf16/f16).
    pub p: u64,
    /// Projections that add a bias (each addition is one more output-sized tensor).
    pub bias: Biases,
}

impl Dims {
    /// The sizes of `spec` at micro-batch `b`, sequence `t`, `p` bytes per element.
    pub(crate) fn new(spec: &ModelSpec, b: usize, t: usize, p: usize) -> Self {
        Self {
            b: b as u64,
            t: t as u64,
            d: spec.hidden as u64,
            h: spec.heads as u64,
            hkv: spec.kv_heads as u64,
            hd: spec.head_dim() as u64,
            f: spec.ffn as u64,
            v: spec.vocab as u64,
            p: p as u64,
            bias: spec.bias,
        }
    }

    /// Tokens per micro-batch, B·T.
    pub(crate) fn n(&self) -> u64 {
        self.b * self.t
    }

    /// Whether the compute type differs from f32 (so casts exist).
    pub(crate) fn cast(&self) -> bool {
        self.p != 4
    }
}

fn term(name: &str, formula: String, bytes: u64) -> Term {
    Term { component: Component::Activations, name: name.to_string(), formula, bytes }
}

/// The activation terms of one kept block; `saved_len` is the attention kernel's declared
/// saved f32s for one call, held in `saved_size` bytes each (4, or 2 when a half run holds
/// them in its type), `moe` the (experts, top_k) of a mixture-of-experts block.
pub(crate) fn block_terms(x: &Dims, saved_len: u64, saved_size: u64, moe: Option<(u64, u64)>) -> Vec<Term> {
    let (n, d, p) = (x.n(), x.d, x.p);
    let qkv = x.h + 2 * x.hkv;
    let mut out = Vec::new();
    // Each fused op keeps its inputs and output, all in the compute type (a half type's f32
    // scratch lives only inside the op's call); the attention kernel's saved buffer is f32,
    // or the half type when the kernel says it tolerates rounding.
    out.push(term("norms (2): fused RMSNorm output", format!("2 · B·T·d·p = 2 · {n}·{d}·{p}"), 2 * n * d * p));
    out.push(term("q, k, v projections", format!("B·T·(H + 2·Hkv)·D·p = {n}·{qkv}·{}·{p}", x.hd), n * qkv * x.hd * p));
    if x.bias.qkv {
        out.push(term(
            "q, k, v plus their biases",
            format!("B·T·(H + 2·Hkv)·D·p = {n}·{qkv}·{}·{p}", x.hd),
            n * qkv * x.hd * p,
        ));
    }
    out.push(term(
        "q, k, v split into heads (B, heads, T, D), RoPE on q and k",
        format!("B·T·(H + 2·Hkv)·D·p = {n}·{qkv}·{}·{p}", x.hd),
        n * qkv * x.hd * p,
    ));
    out.push(term("attention output", format!("B·H·T·D·p = {n}·{}·{}·{p}", x.h, x.hd), n * x.h * x.hd * p));
    out.push(term(
        "attention kernel's saved buffer",
        if saved_size == 4 {
            format!("saved_len · 4 = {saved_len} · 4 (the kernel's declaration)")
        } else {
            format!("saved_len · p = {saved_len} · {saved_size} (the kernel's declaration, held in the half type)")
        },
        saved_len * saved_size,
    ));
    out.push(term("heads merged to (B·T, H·D)", format!("B·T·H·D·p = {n}·{}·{}·{p}", x.h, x.hd), n * x.h * x.hd * p));
    out.push(term("o_proj output and residual sum", format!("2 · B·T·d·p = 2 · {n}·{d}·{p}"), 2 * n * d * p));
    if x.bias.o {
        out.push(term("o_proj plus its bias", format!("B·T·d·p = {n}·{d}·{p}"), n * d * p));
    }
    match moe {
        None => {
            out.extend(swiglu_terms(x, n));
            if x.bias.mlp {
                out.push(term(
                    "gate, up and down plus their biases",
                    format!("B·T·(2·F + d)·p = {n}·(2·{} + {d})·{p}", x.f),
                    n * (2 * x.f + d) * p,
                ));
            }
            out.push(term(
                "down_proj output and residual sum",
                format!("2 · B·T·d·p = 2 · {n}·{d}·{p}"),
                2 * n * d * p,
            ));
        }
        Some((e, k)) => out.extend(moe_terms(x, e, k)),
    }
    out
}

/// A SwiGLU MLP's gate, up and fused gate product on `rows` rows.
fn swiglu_terms(x: &Dims, rows: u64) -> Vec<Term> {
    let (f, p) = (x.f, x.p);
    vec![
        term("SwiGLU: gate and up", format!("2 · rows·F·p = 2 · {rows}·{f}·{p}"), 2 * rows * f * p),
        term("SwiGLU: fused silu(gate)·up", format!("rows·F·p = {rows}·{f}·{p}"), rows * f * p),
    ]
}

/// The mixture-of-experts part of a block, with the B·T·k routed rows spread evenly over
/// the experts.
fn moe_terms(x: &Dims, e: u64, k: u64) -> Vec<Term> {
    let (n, d, p, f) = (x.n(), x.d, x.p, x.f);
    let used = e.min(n * k);
    let c = u64::from(x.cast());
    let router = n * e * p + c * n * e * 4 + 3 * n * e * 4 + 2 * n * 4;
    let routing = 3 * n * k * 4 + n * 4 + 4 * e * 4 + 8;
    vec![
        term(
            "MoE router: logits, f32 softmax (max, sub, exp, sum, div)",
            format!(
                "B·T·E·p{} + 3 · B·T·E·4 + 2 · B·T·4 = {n}·{e}·{p}{} + 3 · {n}·{e}·4 + 2 · {n}·4",
                cast_f(c),
                cast_v(c, n, e)
            ),
            router,
        ),
        term(
            "MoE routing: chosen ids, top-k weights, load-balancing loss",
            format!("3 · B·T·k·4 + B·T·4 + 4 · E·4 + 8 = 3 · {n}·{k}·4 + {n}·4 + 4 · {e}·4 + 8"),
            routing,
        ),
        term(
            "MoE experts on B·T·k rows: ids, gate, rows, SwiGLU (fused), scaled output",
            if c == 1 {
                format!("B·T·k·(3·4 + (3·d + 1 + 3·F)·p) = {n}·{k}·(12 + (3·{d} + 1 + 3·{f})·{p})")
            } else {
                format!("B·T·k·(3·4 + (3·d + 3·F)·p) = {n}·{k}·(12 + (3·{d} + 3·{f})·{p})")
            },
            n * k * (12 + (3 * d + c + 3 * f) * p),
        ),
        term(
            "MoE output: zeros and one index_add sum per expert",
            format!("(E_used + 1) · B·T·d·p = {} · {n}·{d}·{p}", used + 1),
            (used + 1) * n * d * p,
        ),
        term("residual sum", format!("B·T·d·p = {n}·{d}·{p}"), n * d * p),
    ]
}

fn cast_f(c: u64) -> &'static str {
    if c == 1 { " + B·T·E·4" } else { "" }
}

fn cast_v(c: u64, n: u64, e: u64) -> String {
    if c == 1 { format!(" + {n}·{e}·4") } else { String::new() }
}
