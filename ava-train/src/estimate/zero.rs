//! One rank's model states (weights, gradients, optimizer state) under each ZeRO stage, for
//! comparison with the configured one (Rajbhandari et al. 2020, §5, in Ava's layout): P the
//! weights as held at stages 0–2, Ψ the parameters, K the optimizer state's bytes per
//! parameter, N the ranks.

use super::inputs::{Inputs, Shares, owned_by};
use super::{ZeroStage, render};
use crate::config::Precision;
use crate::model::fused::RopeTables;

/// On several ranks, the rank estimated under stages 0 to 3, in bytes; none on one rank.
pub(super) fn stages(s: &Inputs<'_>, shares: &Shares) -> Vec<ZeroStage> {
    if s.world <= 1 {
        return Vec::new();
    }
    let params = weights(s);
    let grads = 4 * s.n_params;
    let state_all: u64 = shares.all_bytes.iter().sum();
    // The rank estimated: its own parameters (the same split as the state's from stage 1; at
    // stage 0, the largest share's).
    let mine = owned_by(&shares.all_bytes, s.world, s.rank);
    let state_mine: u64 = shares.all_bytes.iter().zip(&mine).filter(|(_, m)| **m).map(|(b, _)| b).sum();
    let params_mine = s.numel_of(&mine) * s.stored_size;
    let grads_mine: u64 = s.defs.iter().zip(&mine).filter(|(_, m)| **m).map(|(d, _)| 4 * d.numel() as u64).sum();
    let k = state_all as f64 / s.n_params.max(1) as f64;
    vec![
        stage(0, "P + 4Ψ + KΨ", k, &[params, grads, state_all]),
        stage(1, "P + 4Ψ + KΨ/N", k, &[params, grads, state_mine]),
        stage(2, "P + 4Ψ/N + KΨ/N", k, &[params, grads_mine, state_mine]),
        stage(3, "P/N + 4Ψ/N + KΨ/N", k, &[params_mine, grads_mine, state_mine]),
    ]
}

/// P: every weight as held at stages 0–2 (whatever the configured stage), in bytes: the
/// stored copy, the compute type's cast of f32 masters, the rotary tables.
fn weights(s: &Inputs<'_>) -> u64 {
    let cast_copy = if s.precision != Precision::Fp32 && !s.stored_half { 2 * s.n_params } else { 0 };
    s.n_params * s.stored_size + cast_copy + RopeTables::bytes(s.x.t as usize, s.x.hd as usize)
}

/// One stage's line: `formula` with K's value, the sum of `parts` (bytes).
fn stage(stage: u8, formula: &str, k: f64, parts: &[u64]) -> ZeroStage {
    ZeroStage {
        stage,
        formula: format!(
            "{} = {}",
            formula.replace('K', &format!("K({k:.2})")),
            parts.iter().map(|&p| render::bytes(p)).collect::<Vec<_>>().join(" + ")
        ),
        bytes: parts.iter().sum(),
    }
}
