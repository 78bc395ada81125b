//! The terms read off the replay's peak: the gradients (accumulators and this micro-batch's),
//! the optimizer step's transients, the streamed state the tier holds, the weights gathered
//! at ZeRO stage 3, the activations by what holds them, and the workspaces. Each function
//! returns one term (or none where it does not apply), in bytes.

use super::block::Dims;
use super::inputs::{Inputs, Kernels, Offload, Shares};
use super::replay::MicroBatchPeak;
use super::sim::Cat;
use super::{Component, Term, grouped, l2_bytes, render};

/// Every term at the peak, in report order within each component.
pub(super) fn terms(
    s: &Inputs<'_>,
    shares: &Shares,
    offload: &Offload,
    kernels: &Kernels,
    peak: &MicroBatchPeak,
) -> Vec<Term> {
    let mut terms: Vec<Term> = gradient_accumulators(s, shares).into_iter().collect();
    terms.extend(step_transients(s, offload, peak));
    // A tier's read-ahead and write-behind are host memory: on a GPU run they are listed
    // apart ([`host_terms`]); state streamed from page-locked memory visits the device.
    if !s.gpu() || offload.pinned {
        terms.extend(tier_held(s, offload, peak));
    }
    terms.extend(gathered_weights(s, peak));
    terms.push(gradients(s, peak));
    terms.extend(activations(s, kernels, peak).into_iter().filter(|t| t.bytes > 0));
    terms.extend(kernel_workspace(kernels, peak));
    if !s.gpu() {
        terms.push(gemm_workspace(kernels));
    }
    terms
}

/// Bytes of the peak held by `cat`.
fn at(peak: &MicroBatchPeak, cat: Cat) -> u64 {
    peak.by_cat[cat as usize]
}

/// With accumulation, the f32 gradient accumulators of the earlier micro-batches: every
/// parameter's, or from ZeRO stage 2 this rank's, 4 bytes per element.
fn gradient_accumulators(s: &Inputs<'_>, shares: &Shares) -> Option<Term> {
    if s.accumulation <= 1 {
        return None;
    }
    Some(if s.stage >= 2 {
        let (world, accumulated) = (s.world, s.accumulated(&shares.held));
        Term::new(
            Component::Gradients,
            format!("f32 gradient accumulators of this rank's parameters (ZeRO stage 2 over {world} ranks)"),
            format!("4 · N/{world} ≈ 4 · {} (whole parameters)", grouped(accumulated)),
            4 * accumulated,
        )
    } else {
        Term::new(
            Component::Gradients,
            "f32 gradient accumulators (earlier micro-batches)",
            format!("4 · N = 4 · {}", s.n()),
            4 * s.n_params,
        )
    })
}

/// The optimizer step's transients live at the peak, in bytes: the global norm's partial
/// sums, a parameter widened to f32, the streamed state of the parameter being stepped.
fn step_transients(s: &Inputs<'_>, offload: &Offload, peak: &MicroBatchPeak) -> Option<Term> {
    (at(peak, Cat::Step) > 0).then(|| {
        Term::new(
            Component::Optimizer,
            "optimizer step's transients at the peak",
            format!(
                "the global norm's partial sums (a few per gradient){}{}",
                if s.scratch() { ", one parameter widened to f32 to be stepped (4 · its elements)" } else { "" },
                match (offload.is_on(), offload.pinned) {
                    (true, true) => ", the state of the parameter being stepped, uploaded from host memory",
                    (true, false) => ", the state of the parameter being stepped, read from the tier",
                    _ => "",
                }
            ),
            at(peak, Cat::Step),
        )
    })
}

/// With an offload tier, the most streamed state it holds at once, in bytes: the records it
/// reads ahead (`offload.prefetch` parameters') and the one it writes behind.
fn tier_held(s: &Inputs<'_>, offload: &Offload, peak: &MicroBatchPeak) -> Option<Term> {
    let (tier, total) = offload.through.as_ref()?;
    if offload.pinned {
        return Some(Term::new(
            Component::Optimizer,
            "streamed state on the device (uploaded ahead, written back behind)",
            format!(
                "at most, as the step goes: the next offload.prefetch = {} parameters' state uploaded ahead and the \
                 one stepped before, freed once the next is stepped (of the {} in page-locked host memory)",
                s.config.offload.prefetch,
                render::bytes(*total)
            ),
            peak.tier_peak,
        ));
    }
    Some(Term::new(
        Component::Optimizer,
        "streamed state held by the tier (read ahead, written behind)",
        format!(
            "at most, as the step goes: the next offload.prefetch = {} parameters' state read ahead and the \
             last one's written behind (of the {} streamed through {tier}; a tier that lets more writes wait \
             for the disk, as nvme's max_in_flight does, holds up to that much more)",
            s.config.offload.prefetch,
            render::bytes(*total)
        ),
        peak.tier_peak,
    ))
}

/// On a GPU run streaming its state through a tier, what the tier holds in host memory at
/// most (its read-ahead and write-behind), listed apart from the device's peak.
pub(super) fn host_terms(s: &Inputs<'_>, offload: &Offload, peak: &MicroBatchPeak) -> Vec<Term> {
    if !s.gpu() || offload.pinned {
        return Vec::new();
    }
    tier_held(s, offload, peak).into_iter().collect()
}

/// At ZeRO stage 3, the weights gathered from the other ranks and their compute-type casts
/// alive at the peak, in bytes.
fn gathered_weights(s: &Inputs<'_>, peak: &MicroBatchPeak) -> Option<Term> {
    (s.stage >= 3).then(|| {
        Term::new(
            Component::Parameters,
            format!("weights gathered from the other ranks, and their casts (ZeRO stage 3 over {} ranks)", s.world),
            "at the peak: the blocks whose graph holds them (kept blocks until their backward; one recomputed \
             block), the embedding and the head, each in the stored type plus its cast to the compute type"
                .to_string(),
            at(peak, Cat::Params),
        )
    })
}

/// This micro-batch's f32 gradients alive at the peak, with the accumulators the replay
/// holds, in bytes (4 per element).
fn gradients(s: &Inputs<'_>, peak: &MicroBatchPeak) -> Term {
    let grads_now = at(peak, Cat::ParamGrads);
    let label = if s.inside {
        "f32 gradients in flight (each stepped inside backward and freed)"
    } else if s.stage >= 2 {
        "f32 gradients: this micro-batch's not yet reduced, buckets in flight, this rank's reduced ones"
    } else if s.accumulation > 1 {
        "this micro-batch's f32 gradients"
    } else {
        "f32 gradients (the accumulators)"
    };
    let n = s.n();
    let formula = if s.inside {
        format!(
            "4 · {} elements at the peak (a stretch's gradients{}), of N = {n}",
            grouped(grads_now / 4),
            if s.scratch() { " and a parameter's f32 scratch" } else { "" }
        )
    } else if grads_now >= 4 * s.n_params {
        format!("4 · N = 4 · {n} (all: the peak comes after the backward)")
    } else {
        format!("4 · {} of N = {n} elements (produced by the backward before the peak)", grouped(grads_now / 4))
    };
    Term::new(Component::Gradients, label, formula, grads_now + at(peak, Cat::Accumulators))
}

/// The activation terms by what holds them at the peak, each in bytes (0 where nothing
/// does).
fn activations(s: &Inputs<'_>, kernels: &Kernels, peak: &MicroBatchPeak) -> [Term; 7] {
    let x = &s.x;
    [
        embedding(x, peak),
        kept_blocks(kernels, peak),
        saved_buffers(kernels, peak),
        recomputed_inputs(x, peak),
        recomputed_block(peak),
        head(x, !s.gpu(), s.config.train.loss_chunk_rows as u64, peak),
        backward(peak),
    ]
}

/// `bytes` in units of `unit`, for the formulas.
fn count(bytes: u64, unit: u64) -> f64 {
    bytes as f64 / unit.max(1) as f64
}

/// One activation term of `cat`.
fn activation(peak: &MicroBatchPeak, cat: Cat, name: &str, formula: String) -> Term {
    Term::new(Component::Activations, name, formula, at(peak, cat))
}

/// The embedding's looked-up rows and their `Var` copy, (B, T, d) each.
fn embedding(x: &Dims, peak: &MicroBatchPeak) -> Term {
    let formula = format!("2 · B·T·d·p = 2 · {}·{}·{}", x.n(), x.d, x.p);
    activation(peak, Cat::Embedding, "embedding rows and their Var copy", formula)
}

/// What kept blocks hold for backward, without the kernel's saved buffers: a number of
/// blocks' worth of the per-block terms.
fn kept_blocks(kernels: &Kernels, peak: &MicroBatchPeak) -> Term {
    let block_bytes = kernels.facts.first().map_or(0, |f| f.activation_bytes);
    let per_block = block_bytes.saturating_sub(kernels.saved * kernels.saved_size).max(1);
    let formula = format!(
        "{:.2} × {} per kept block (per-block terms below, without the saved buffer)",
        count(at(peak, Cat::Blocks), per_block),
        render::bytes(per_block)
    );
    activation(peak, Cat::Blocks, "activations of kept blocks", formula)
}

/// The attention kernel's saved buffers, `saved_len` elements per kept block.
fn saved_buffers(kernels: &Kernels, peak: &MicroBatchPeak) -> Term {
    let (saved, saved_size) = (kernels.saved, kernels.saved_size);
    let calls = count(at(peak, Cat::AttnSaved), saved * saved_size);
    let formula = format!("{calls:.0} × saved_len · {saved_size} = {calls:.0} × {} · {saved_size}", grouped(saved));
    activation(peak, Cat::AttnSaved, "attention kernel's saved buffers", formula)
}

/// The inputs recomputed blocks keep instead of their activations, (B, T, d) each.
fn recomputed_inputs(x: &Dims, peak: &MicroBatchPeak) -> Term {
    let blocks = count(at(peak, Cat::Inputs), x.n() * x.d * x.p);
    let formula = format!("{blocks:.0} × B·T·d·p = {blocks:.0} × {}·{}·{}", x.n(), x.d, x.p);
    activation(peak, Cat::Inputs, "inputs of recomputed blocks", formula)
}

/// One block's activations while it runs detached or is recomputed in backward.
fn recomputed_block(peak: &MicroBatchPeak) -> Term {
    let formula = "one block's activations while it runs detached or is recomputed (per-block terms)".to_string();
    activation(peak, Cat::Recompute, "activations of the block being recomputed", formula)
}

/// The head. With `chunk_rows` 0: the final norm (B, T, d), the logits (B, T, V) (and,
/// `widened` on the host, their f32 copy in a half run: a GPU's cross-entropy reads them in
/// their type), the loss's per-row values, all kept for backward. In blocks of `chunk_rows`
/// rows (`model::head_loss`): the final norm, and the logits and per-row values of one block
/// while the head's forward computes them (the head's backward computes each block's logits
/// and their gradient again: those count under backward).
fn head(x: &Dims, widened: bool, chunk_rows: u64, peak: &MicroBatchPeak) -> Term {
    if chunk_rows > 0 {
        let rows = chunk_rows.min(x.n());
        let formula = format!(
            "norm B·T·d·p = {}·{}·{}, plus the loss's per-row values; the logits exist {rows}·V·p = {rows}·{}·{} at a \
             time (train.loss_chunk_rows = {chunk_rows}), in the head's forward and, with their gradient, in its backward",
            x.n(),
            x.d,
            x.p,
            x.v,
            x.p,
        );
        return activation(peak, Cat::Head, "head: final norm, loss (logits in blocks of rows)", formula);
    }
    let widened = widened && x.cast();
    let formula = format!(
        "norm B·T·d·p + logits B·T·V·p{} = {}·{}·{} + {}·{}·{}{}, plus the loss's per-row values",
        if widened { " + B·T·V·4 (f32 logits)" } else { "" },
        x.n(),
        x.d,
        x.p,
        x.n(),
        x.v,
        x.p,
        if widened { format!(" + {}·{}·4", x.n(), x.v) } else { String::new() }
    );
    activation(peak, Cat::Head, "head: final norm, logits, loss", formula)
}

/// candle's backward: gradients not yet consumed and what they keep alive, op temporaries.
fn backward(peak: &MicroBatchPeak) -> Term {
    let formula = "candle's backward replayed: gradients not yet consumed, the expressions tracked gradients keep \
                   alive, op temporaries (each first gradient moved in, not added to zeros)"
        .to_string();
    activation(peak, Cat::Backward, "backward: intermediate gradients and what they hold", formula)
}

/// The attention kernel's declared workspace (f32s, forward and backward), in bytes where it
/// is live at the peak; listed whenever one is declared, so the declaration is visible.
fn kernel_workspace(kernels: &Kernels, peak: &MicroBatchPeak) -> Option<Term> {
    let [fwd, bwd] = kernels.workspace_lens;
    (kernels.workspace_lens != [0, 0]).then(|| {
        Term::new(
            Component::Activations,
            "attention kernel's workspace (during a call)",
            format!(
                "workspace_len · 4: forward {} · 4, backward {} · 4 (the kernel's declaration); {} at the peak",
                grouped(fwd),
                grouped(bwd),
                if at(peak, Cat::AttnWorkspace) > 0 { "live" } else { "not live" }
            ),
            at(peak, Cat::AttnWorkspace),
        )
    })
}

/// gemm's packing slabs: one L2-sized buffer per compute thread, kept after its first
/// matmul, in bytes.
fn gemm_workspace(kernels: &Kernels) -> Term {
    Term::new(
        Component::Activations,
        "matmul workspace (gemm packing slab per thread)",
        format!("threads · L2 = {} · {}", kernels.threads, render::bytes(l2_bytes())),
        kernels.gemm_workspace,
    )
}
