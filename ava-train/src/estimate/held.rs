//! The terms held through the whole step, outside any micro-batch: the parameters, this
//! rank's optimizer state, the data. Each is a closed formula of the config; each function
//! returns one term (or none where it does not apply), in bytes.
//!
//! On a GPU run ([`Inputs::gpu`]) these are device memory: the rotary tables' device copy
//! and the batch's token ids replace their host forms, which [`host_terms`] lists apart with
//! the loader's queue.

use ava_core::BlockDecision;

use super::inputs::{Inputs, Offload, Shares, State};
use super::replay::ParkedInputs;
use super::{Component, Term, grouped};
use crate::config::{DataSource, Precision};
use crate::data::Packing;
use crate::model::fused::RopeTables;

/// Every held term, in report order within each component.
pub(super) fn terms(s: &Inputs<'_>, shares: &Shares, offload: &Offload) -> Vec<Term> {
    let note = share_note(s, shares);
    let tables = if s.gpu() { device_rotary_tables(s) } else { rotary_tables(s) };
    let mut terms = vec![tables, weights(s, shares)];
    terms.extend(weight_cast(s));
    terms.extend(state_kept_in_memory(s, offload, &note));
    if !offload.is_on() {
        terms.extend(shares.states.iter().map(|state| state_buffers(s, state, &note)));
    }
    terms.extend(no_state(shares));
    terms.extend(mapped_shards(s));
    if s.gpu() {
        terms.push(device_tokens(s));
    } else {
        terms.extend(loader_queue(s));
        terms.extend(packed_documents(s));
        terms.push(batch_in_use(s));
    }
    terms
}

/// On a GPU run, what the step holds in host memory, outside the device's peak: the rotary
/// tables the device copy is made from, the loader's queue and the batch in use (its
/// targets and packed documents stay on the host, where the ops that take them read them).
/// Empty on the CPU, where every term is host memory.
pub(super) fn host_terms(s: &Inputs<'_>, offload: &Offload, plan: &[BlockDecision]) -> Vec<Term> {
    if !s.gpu() {
        return Vec::new();
    }
    let mut terms = vec![rotary_tables(s)];
    terms.extend(pinned_state(s, offload));
    terms.extend(parked_inputs(s, plan));
    terms.extend(loader_queue(s));
    terms.extend(packed_documents(s));
    terms.push(batch_in_use(s));
    terms
}

/// A GPU run's `ram` share of the optimizer state, in page-locked host memory.
fn pinned_state(s: &Inputs<'_>, offload: &Offload) -> Option<Term> {
    let (_, bytes) = offload.through.as_ref().filter(|_| offload.pinned)?;
    Some(Term::new(
        Component::Optimizer,
        "optimizer state in page-locked host memory",
        format!(
            "the state of the parameters past the device share of offload.tiers ({:.0}%), streamed through the GPU \
             each step",
            s.config.offload.tiers.resident(true) * 100.0
        ),
        *bytes,
    ))
}

/// A GPU run's `Offload` blocks' inputs in page-locked host memory (`plugins.offload: ram`,
/// `model::park`): a buffer per parked block, (B, T, d) in the compute type, kept for the run.
/// Through another tier they are that tier's (compressed, or on disk), not listed here.
fn parked_inputs(s: &Inputs<'_>, plan: &[BlockDecision]) -> Option<Term> {
    let parked = plan.iter().filter(|d| **d == BlockDecision::Offload).count() as u64;
    (parked > 0 && s.parked_inputs() == ParkedInputs::Pinned).then(|| {
        let x = &s.x;
        Term::new(
            Component::Activations,
            "inputs of offloaded blocks in page-locked host memory",
            format!(
                "{parked} × B·T·d·p = {parked} × {}·{}·{} (each written back in forward, uploaded again ahead of its \
                 recompute)",
                x.n(),
                x.d,
                x.p
            ),
            parked * x.n() * x.d * x.p,
        )
    })
}

/// The rotary tables' device copy: cos and sin of every position in f32, (T, D) each.
fn device_rotary_tables(s: &Inputs<'_>) -> Term {
    Term::new(
        Component::Parameters,
        "rotary tables' device copy (cos, sin in f32)",
        format!("T·D·2·4 = {}·{}·8", s.x.t, s.x.hd),
        RopeTables::device_bytes(s.x.t as usize, s.x.hd as usize),
    )
}

/// A GPU run's batch on the device: the micro-batch's (B, T) u32 token ids.
fn device_tokens(s: &Inputs<'_>) -> Term {
    Term::new(
        Component::Data,
        "token ids of the batch in use, on the device",
        format!("B·T·4 = {}·4", s.x.n()),
        s.x.n() * 4,
    )
}

/// The rotary tables: cos and sin of every position in f32 and in f64, (T, D) each, in bytes.
fn rotary_tables(s: &Inputs<'_>) -> Term {
    Term::new(
        Component::Parameters,
        "rotary tables (cos, sin in f32 and f64)",
        format!("T·D·(2·4 + 2·8) = {}·{}·24", s.x.t, s.x.hd),
        RopeTables::bytes(s.x.t as usize, s.x.hd as usize),
    )
}

/// The resident weights in bytes: f32 masters, or the compute type's only copy without them
/// (`train.master_weights`: none, kahan, tier); at ZeRO stage 3 this rank's own parameters
/// only (the others are gathered block by block, counted at the peak).
fn weights(s: &Inputs<'_>, shares: &Shares) -> Term {
    let (resident, resident_n) = if s.stage >= 3 {
        let mine = s.numel_of(&shares.held);
        (mine, format!("N/{} ≈ {} (this rank's whole parameters, ZeRO stage 3)", s.world, grouped(mine)))
    } else {
        (s.n_params, format!("N = {}", s.n()))
    };
    if s.stored_half {
        let name = format!(
            "{} weights (the only resident copy; master_weights: {})",
            s.precision.as_str(),
            s.masters.as_str()
        );
        Term::new(Component::Parameters, name, format!("2 · {resident_n}"), 2 * resident)
    } else {
        Term::new(Component::Parameters, "f32 master weights", format!("4 · {resident_n}"), 4 * resident)
    }
}

/// The compute type's copy of f32 master weights, cast in the graph for the forward pass:
/// 2 bytes per parameter (none in f32, without masters, or at ZeRO stage 3, where the
/// gathered weights' casts are counted at the peak).
fn weight_cast(s: &Inputs<'_>) -> Option<Term> {
    (s.precision != Precision::Fp32 && !s.stored_half && s.stage < 3).then(|| {
        Term::new(
            Component::Parameters,
            format!("{} copy of the weights (cast in the graph)", s.precision.as_str()),
            format!("2 · N = 2 · {}", s.n()),
            2 * s.n_params,
        )
    })
}

/// From ZeRO stage 1, the words saying the optimizer state is one rank's share (appended to
/// the state's names); empty below it.
fn share_note(s: &Inputs<'_>, shares: &Shares) -> String {
    if s.stage < 1 {
        return String::new();
    }
    let total: u64 = shares.all_bytes.iter().sum();
    let whose = s.rank.map_or("the largest rank's".to_string(), |r| format!("rank {r}'s"));
    format!(
        " ({whose} share of {}: ZeRO stage {} over {} ranks, whole parameters)",
        ava_core::format_size(total),
        s.stage,
        s.world
    )
}

/// With an offload tier: the optimizer state (and masters) kept in memory, the first
/// parameters' up to the ram share of `offload.tiers`, in bytes.
fn state_kept_in_memory(s: &Inputs<'_>, offload: &Offload, note: &str) -> Option<Term> {
    offload.is_on().then(|| {
        Term::new(
            Component::Optimizer,
            format!("state kept in {}memory{note}", if s.gpu() { "device " } else { "" }),
            format!(
                "the first parameters' state, up to the device share of offload.tiers ({:.0}%)",
                (s.config.offload.tiers.resident(s.gpu()) * 100.0).abs()
            ),
            offload.kept,
        )
    })
}

/// This rank's optimizer state buffers of one name (`exp_avg`, the engine's masters or
/// compensation), summed over its parameters, in bytes.
fn state_buffers(s: &Inputs<'_>, state: &State, note: &str) -> Term {
    let (size, dtype) = (state.dtype.size(), state.dtype.as_str());
    // One element per parameter element, for every parameter: size · N.
    let formula = if state.per_element && state.bytes == size as u64 * s.n_params {
        format!("{size} · N = {size} · {} ({dtype})", s.n())
    } else {
        format!("Σ over parameters of the state_layout bytes ({dtype})")
    };
    let name = match state.name.as_str() {
        crate::train::MASTER => "f32 master weights (ava.master, with the state)".to_string(),
        crate::train::COMPENSATION => format!("{} compensation of the weights (ava.kahan)", s.precision.as_str()),
        _ => state.name.clone(),
    };
    Term::new(Component::Optimizer, format!("{name}{note}"), formula, state.bytes)
}

/// A 0-byte line saying the optimizer keeps no state, when no parameter's layout has any.
fn no_state(shares: &Shares) -> Option<Term> {
    shares
        .states
        .is_empty()
        .then(|| Term::new(Component::Optimizer, "no state", "state_layout is empty for every parameter".into(), 0))
}

/// The corpus's mapped shards (`data.source: shards`): 0 bytes, listed to say why.
fn mapped_shards(s: &Inputs<'_>) -> Option<Term> {
    (s.config.data.source == DataSource::Shards).then(|| {
        Term::new(
            Component::Data,
            "the corpus's mapped shards",
            "0: not resident (each read's 2 MiB window is handed back to the page cache once copied)".into(),
            0,
        )
    })
}

/// Packed documents (`data.packing: document`): a batch also carries its document ids.
fn packed(s: &Inputs<'_>) -> bool {
    s.config.data.packing == Packing::Document
}

/// The loader's queue: `num_workers · prefetch_factor` batches of B rows of T+1 u32 ids
/// (2T+1 with packed documents' ids), in bytes.
fn loader_queue(s: &Inputs<'_>) -> Option<Term> {
    let (workers, prefetch) = (s.config.data.num_workers as u64, s.config.data.prefetch_factor as u64);
    if workers == 0 {
        return None;
    }
    let (what, row) = if packed(s) { ("loader queue (ids and document ids)", "2T+1") } else { ("loader queue", "T+1") };
    let row_len = if packed(s) { 2 * s.x.t + 1 } else { s.x.t + 1 };
    Some(Term::new(
        Component::Data,
        what,
        format!("W · prefetch · B·({row})·4 = {workers} · {prefetch} · {}·{row_len}·4", s.x.b),
        workers * prefetch * s.x.b * row_len * 4,
    ))
}

/// With packed documents, three (B, T) u32 buffers of the batch in use: its document ids,
/// the step's ids and positions, in bytes.
fn packed_documents(s: &Inputs<'_>) -> Option<Term> {
    packed(s).then(|| {
        Term::new(
            Component::Data,
            "packed documents of the batch in use: its document ids, the step's ids and positions",
            format!("3 · B·T·4 = 3 · {}·4", s.x.n()),
            3 * s.x.n() * 4,
        )
    })
}

/// The batch in use, (B, T+1) u32 ids, and its inputs and targets, (B, T) each, in bytes.
fn batch_in_use(s: &Inputs<'_>) -> Term {
    let x = &s.x;
    Term::new(
        Component::Data,
        "batch in use, its inputs and targets",
        format!("B·(T+1)·4 + 2 · B·T·4 = {}·{}·4 + 2 · {}·4", x.b, x.t + 1, x.n()),
        x.b * (x.t + 1) * 4 + 2 * x.n() * 4,
    )
}
