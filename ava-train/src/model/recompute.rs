//! Forward and backward of one micro-batch under a checkpoint plan: the mechanism behind
//! the `CheckpointPolicy` plugins' decisions.
//!
//! Blocks the policy keeps run inside the autograd graph as usual. A block it recomputes
//! runs detached: only its input is kept, and its output becomes a fresh `Var` that starts
//! the next stretch of graph. Backward walks the stretches in reverse: the last one by
//! `loss.backward()`; each recomputed block by running it again with its input as a `Var`
//! and back-propagating `(out · grad_out).sum()`; each kept stretch the same way from its
//! end. Every kept gradient is detached and each grad store dropped at once, since a kept
//! gradient would otherwise hold its whole graph alive. An `Offload` block is recomputed
//! too, with its input parked off the device between forward and backward (`park`: in the
//! offload tier, or on a GPU with `ram` in page-locked host memory, the next one down brought
//! back while a stage is recomputed). `Segment`
//! blocks join the recomputed block below them: the segment keeps only its first block's
//! input and is run again, all of it, in backward (Chen et al. 2016).

use ava_core::BlockDecision;
use candle_core::{DType, Result, Tensor, Var, backprop::GradStore};

use super::Documents;
use super::llama::{Model, add_opt};
use super::park::{self, Parked, Parking, Session};

/// A stretch of the forward graph between two recomputed blocks.
struct Kept {
    /// The `Var` the stretch starts from (None: it starts at the token embedding).
    start: Option<Var>,
    /// Its output, still attached to the graph.
    end: Tensor,
    /// Load-balancing losses of its MoE blocks.
    aux: Option<Tensor>,
    /// Blocks (indices) inside it (none for the embedding's own stretch).
    blocks: Vec<usize>,
}

/// Where a recomputed block's input waits for backward.
enum Input {
    /// In memory (detached).
    Held(Tensor),
    /// Parked off the device (`park`).
    Parked(Parked),
}

enum Stage {
    Kept(Kept),
    /// Blocks run again in backward from `input`: one, or a segment of consecutive blocks.
    Recompute {
        blocks: Vec<usize>,
        input: Input,
    },
}

/// The loss of one micro-batch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MicroLoss {
    /// Mean cross-entropy (nats per token).
    pub ce: f64,
    /// Summed load-balancing loss of the MoE blocks (unweighted; 0 for a dense model).
    pub aux: f64,
    /// The most host memory parked block inputs held at once: the offload tier's resident
    /// bytes, sampled after each put, or on a GPU run with `ram` the page-locked buffers of
    /// the inputs parked at once (0 without offloaded blocks).
    pub tier_peak: u64,
}

/// Gradients of one micro-batch, by parameter index; `None` for a parameter the batch did
/// not reach (an expert no token was routed to).
pub type Grads = Vec<Option<Tensor>>;

/// Where the parameter gradients of a micro-batch go as backward produces them, stretch by
/// stretch: accumulators ([`Grads`], stepped after backward), or the optimizer itself
/// (`train.step_in_backward`), which steps each parameter as soon as its gradient is final.
pub trait GradSink {
    /// Called once, before backward starts, with the parameters in the order their final
    /// gradients will arrive (a parameter the batch does not reach, such as an expert no
    /// token was routed to, is listed but never arrives). Lets a sink read ahead.
    fn expect(&mut self, _order: &[usize]) -> Result<()> {
        Ok(())
    }

    /// Parameter `i`'s gradient (f32, detached) from one stretch. `last`: no more of it
    /// will come in this micro-batch (false only for a tied embedding's head use).
    fn receive(&mut self, i: usize, grad: Tensor, last: bool) -> Result<()>;

    /// Called after each stretch's backward: the first `final_count` parameters of the
    /// order given to [`GradSink::expect`] have all the gradient they will get in this
    /// micro-batch (one that did not arrive gets none: an expert no token reached). Lets a
    /// sink hand on whole stretches, such as stage 2's reduce-scatter.
    fn stretch_done(&mut self, _final_count: usize) -> Result<()> {
        Ok(())
    }

    /// Whether backward should end a stretch after every block, kept blocks included, so
    /// that each block's gradients are handed on as soon as they are final rather than at
    /// the end of a stretch of kept blocks. The gradients are the same; each extra stretch
    /// costs one product of its output with its output gradient.
    fn block_stretches(&self) -> bool {
        false
    }
}

/// Where the forward pass finds its weights. One process (and ZeRO stages 0–2) holds them
/// all: a `Vec<Tensor>` indexed by parameter. ZeRO stage 3 holds only its own parameters
/// and gathers each block's weights from the ranks that own them before the block's
/// forward, and again before its backward ([`crate::dist::Gathered`]).
///
/// [`forward_backward`] fetches a block's parameters before running it and releases them
/// as soon as nothing needs them: after a recomputed block's forward (it is run again in
/// backward) and after a stretch's backward. A kept block's weights stay in its graph
/// until its backward anyway, so they are released then.
pub trait Weights {
    /// Makes parameters `params` available in [`tensors`](Self::tensors). Every rank calls
    /// this with the same parameters in the same order (stage 3 gathers here).
    fn fetch(&mut self, _model: &Model, _params: &[usize]) -> Result<()> {
        Ok(())
    }

    /// Says parameters `params` are not needed until fetched again.
    fn release(&mut self, _params: &[usize]) {}

    /// The weights by parameter index, as the forward pass uses them (in the compute type,
    /// inside the graph); only fetched entries are meaningful.
    fn tensors(&self) -> &[Tensor];

    /// The leaf backward's gradient of parameter `i` is keyed by: the parameter's `Var`,
    /// or the one its gathered copy was made into.
    fn leaf(&self, model: &Model, i: usize) -> Tensor {
        model.params()[i].var.as_tensor().clone()
    }
    /// Seconds spent waiting for other ranks' weights so far (stage 3's all-gathers).
    fn gather_seconds(&self) -> f64 {
        0.0
    }
}

/// All the weights at hand (see [`Model::weights`]).
impl Weights for Vec<Tensor> {
    fn tensors(&self) -> &[Tensor] {
        self
    }
}

/// Accumulation: each gradient is added to what is there.
impl GradSink for Grads {
    fn receive(&mut self, i: usize, g: Tensor, _last: bool) -> Result<()> {
        self[i] = Some(match self[i].take() {
            Some(acc) => (acc + g)?,
            None => g,
        });
        Ok(())
    }
}

/// Runs forward and backward of one micro-batch with `plan[i]` deciding block `i`.
///
/// `tokens` and `targets` are (B, T), `documents` their packed documents if any. The loss back-propagated is
/// `(ce + aux_weight · aux) · scale / divisor`: `scale` is the f16 loss scale (1 otherwise),
/// `divisor` the number of micro-batches accumulated. `grads` receives the f32 gradients,
/// added to what is there (gradient accumulation), in the same order of additions whatever
/// the plan, so checkpointed and plain runs give identical gradients. With another
/// [`GradSink`] each gradient goes there instead, as soon as its stretch's backward ends.
///
/// Three stages: the forward through the plan (`forward_stretches`), the loss and the
/// backward of the last stretch (here), then the other stretches from the top down
/// (`Below::backward_stretches`).
#[allow(clippy::too_many_arguments)]
pub fn forward_backward(
    model: &Model,
    weights: &mut dyn Weights,
    tokens: &Tensor,
    documents: Option<&Documents>,
    targets: &[u32],
    plan: &[BlockDecision],
    scale: f64,
    divisor: f64,
    offload: Option<&Parking>,
    grads: &mut dyn GradSink,
) -> Result<MicroLoss> {
    let mut parking = offload.map(Parking::session).transpose()?;
    let aux_weight = model.spec().moe.map_or(0.0, |m| m.aux_weight);
    let Forward { mut stages, current, mut aux_total } =
        forward_stretches(model, weights, tokens, documents, plan, &*grads, parking.as_mut())?;

    // The last stretch ends in the loss.
    let outside = model.outside_params();
    weights.fetch(model, outside)?;
    // The final norm, the LM head and the mean cross-entropy: with `train.loss_chunk_rows`
    // the logits exist a block of rows at a time, here and in backward, and the graph holds
    // only the normed hidden state; otherwise the graph keeps the (B·T, V) logits.
    let ce = model.head_loss(weights.tensors(), &current.end, targets)?;
    let mut loss = ce.clone();
    if let Some(aux) = &current.aux {
        aux_total += aux.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        loss = (loss + aux.to_dtype(ce.dtype())?.affine(aux_weight, 0.0)?)?;
    }
    let ce_value = ce.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    // Stretch by stretch, the parameters whose gradients are final after it.
    let order = gradient_order(model, &current, &stages);
    let mut final_counts = order.iter().scan(0, |n, s| {
        *n += s.len();
        Some(*n)
    });
    grads.expect(&order.concat())?;
    // The first input backward needs comes back while the last stretch back-propagates.
    if let Some(parking) = parking.as_mut() {
        parking.forward_done()?;
    }
    prefetch(parking.as_mut(), &mut stages)?;
    let span = crate::profile::scope("backward: autograd (all)");
    let store = loss.affine(scale / divisor, 0.0)?.backward()?;
    drop(span);
    drop((loss, ce));
    // Gradients go straight into the accumulators, stretch by stretch, so no second copy of
    // them is held. The additions happen in the same order whatever the plan: every
    // parameter belongs to one stretch, except a tied embedding, whose head use is always
    // collected (last stretch) before its embedding use (first stretch).
    let grad_out = collect(model, weights, &current.blocks, current.start.as_ref(), store, grads)?;
    // The head's weights go (but a tied one, which is the embedding, stays for its stretch).
    weights.release(&outside.iter().copied().filter(|&i| i != EMBEDDING).collect::<Vec<_>>());
    release_blocks(model, weights, &current.blocks);
    drop(current);
    grads.stretch_done(final_counts.next().expect("one count per stretch"))?;

    let below = Below { model, documents, aux_scale: aux_weight * scale / divisor };
    below.backward_stretches(weights, stages, grad_out, parking.as_mut(), grads, &mut final_counts)?;
    let tier_peak = parking.as_ref().map_or(0, Session::peak);
    Ok(MicroLoss { ce: ce_value, aux: aux_total, tier_peak })
}

/// What [`forward_stretches`] leaves for backward: the stretches below the last, bottom
/// first; the last stretch (`current`, which ends in the loss); the MoE losses of the
/// stretches that ended, summed.
struct Forward {
    stages: Vec<Stage>,
    current: Kept,
    aux_total: f64,
}

/// The forward pass through the plan, a stretch of graph at a time: kept blocks extend the
/// stretch under way (a stretch per block when `grads` asks for them: a sink that steps or
/// reduces inside backward), a recomputed or offloaded block ends it and keeps only its
/// input (held, or parked in `parking`), and a segment block joins the recomputed block
/// below it.
fn forward_stretches(
    model: &Model,
    weights: &mut dyn Weights,
    tokens: &Tensor,
    documents: Option<&Documents>,
    plan: &[BlockDecision],
    grads: &dyn GradSink,
    mut parking: Option<&mut Session<'_>>,
) -> Result<Forward> {
    // The embedding is always a stretch of its own. With tied embeddings the same weight is
    // used by the embedding and the head, and keeping the two uses in separate graphs makes
    // candle sum the gradients in the same order whatever the plan (in one graph the order
    // depends on its shape, and the sums differed in the last bit).
    weights.fetch(model, &[EMBEDDING])?;
    let embedded = Kept { start: None, end: model.embed(weights.tensors(), tokens)?, aux: None, blocks: vec![] };
    let first = Var::from_tensor(&embedded.end.detach())?;
    let mut stages: Vec<Stage> = vec![Stage::Kept(embedded)];
    let mut current = Kept { end: first.as_tensor().clone(), start: Some(first), aux: None, blocks: vec![] };
    let mut aux_total = 0.0;
    for (i, decision) in plan.iter().enumerate() {
        match decision {
            BlockDecision::Keep => {
                if grads.block_stretches() && !current.blocks.is_empty() {
                    // The stretch ends here; the block starts the next from its input's Var.
                    if let Some(a) = &current.aux {
                        aux_total += a.to_dtype(DType::F64)?.to_scalar::<f64>()?;
                    }
                    let start = Var::from_tensor(&current.end.detach())?;
                    let next = Kept { end: start.as_tensor().clone(), start: Some(start), aux: None, blocks: vec![] };
                    stages.push(Stage::Kept(std::mem::replace(&mut current, next)));
                }
                weights.fetch(model, model.block_params(i))?;
                let out = model.block(weights.tensors(), i, &current.end, documents)?;
                current.end = out.hidden;
                current.aux = add_opt(current.aux.take(), out.aux)?;
                current.blocks.push(i);
            }
            BlockDecision::Segment => {
                // The block below was recomputed, so `current` is only the Var of its output.
                let Some(Stage::Recompute { blocks, .. }) = stages.last_mut() else {
                    candle_core::bail!("block {i} is 'segment' with no recomputed block below it");
                };
                blocks.push(i);
                let own = model.block_params(i);
                weights.fetch(model, own)?;
                let out = model.block(weights.tensors(), i, &current.end.detach(), documents)?;
                weights.release(own);
                let hidden = out.hidden.detach();
                if let Some(a) = &out.aux {
                    aux_total += a.to_dtype(DType::F64)?.to_scalar::<f64>()?;
                }
                drop(out);
                let start = Var::from_tensor(&hidden)?;
                current = Kept { end: start.as_tensor().clone(), start: Some(start), aux: None, blocks: vec![] };
            }
            BlockDecision::Recompute | BlockDecision::Offload => {
                let input = current.end.detach(); // (B, T, d)
                let own = model.block_params(i);
                weights.fetch(model, own)?;
                let out = model.block(weights.tensors(), i, &input, documents)?;
                weights.release(own);
                let hidden = out.hidden.detach();
                if let Some(a) = &out.aux {
                    aux_total += a.to_dtype(DType::F64)?.to_scalar::<f64>()?;
                }
                drop(out); // frees the block's activations now
                // A stretch that is only the Var of the previous recomputed block has nothing
                // to back-propagate through; the gradient passes straight on.
                if !current.blocks.is_empty() {
                    if let Some(a) = &current.aux {
                        aux_total += a.to_dtype(DType::F64)?.to_scalar::<f64>()?;
                    }
                    stages.push(Stage::Kept(current));
                }
                let input = match (decision, parking.as_deref_mut()) {
                    (BlockDecision::Offload, Some(parking)) => Input::Parked(parking.park(i, input)?),
                    _ => Input::Held(input),
                };
                stages.push(Stage::Recompute { blocks: vec![i], input });
                let start = Var::from_tensor(&hidden)?;
                current = Kept { end: start.as_tensor().clone(), start: Some(start), aux: None, blocks: vec![] };
            }
        }
    }
    Ok(Forward { stages, current, aux_total })
}

/// What the stretches below the last need from the micro-batch: the model, the packed
/// documents, and the weight of the MoE loss in a surrogate's seed
/// (`aux_weight · scale / divisor`).
struct Below<'a> {
    model: &'a Model,
    documents: Option<&'a Documents>,
    aux_scale: f64,
}

impl Below<'_> {
    /// Backward through the stretches below the last, from the top down, starting from the
    /// gradient `grad_out` of the last stretch's input: a recomputed stretch runs its blocks
    /// again from its input (a parked one fetched back, the next one down asked for
    /// meanwhile), a kept one back-propagates its graph; each hands its gradients to `grads`
    /// and its input's gradient to the stretch below. `final_counts` says how many
    /// parameters' gradients are final after each stretch.
    fn backward_stretches(
        &self,
        weights: &mut dyn Weights,
        mut stages: Vec<Stage>,
        mut grad_out: Option<Tensor>,
        mut parking: Option<&mut Session<'_>>,
        grads: &mut dyn GradSink,
        final_counts: &mut dyn Iterator<Item = usize>,
    ) -> Result<()> {
        let Self { model, documents, aux_scale } = *self;
        while let Some(stage) = stages.pop() {
            let g = grad_out.take().expect("a stage after the first always receives a gradient");
            match stage {
                Stage::Recompute { blocks, input } => {
                    let input = match input {
                        Input::Held(t) => t,
                        Input::Parked(parked) => {
                            let parking = parking.as_deref_mut().expect("parked with a parking");
                            let input = parking.take(parked, &model.device())?;
                            // The next one down comes back while these blocks are recomputed.
                            prefetch(Some(parking), &mut stages)?;
                            input
                        }
                    };
                    let start = Var::from_tensor(&input)?;
                    drop(input);
                    let (mut hidden, mut aux) = (start.as_tensor().clone(), None);
                    for &block in &blocks {
                        weights.fetch(model, model.block_params(block))?;
                        let out = model.block(weights.tensors(), block, &hidden, documents)?;
                        hidden = out.hidden;
                        aux = add_opt(aux, out.aux)?;
                    }
                    let surrogate = surrogate(&hidden, &g, aux.as_ref(), aux_scale)?;
                    let span = crate::profile::scope("backward: autograd (all)");
                    let store = surrogate.backward()?;
                    drop(span);
                    drop((surrogate, hidden, aux));
                    grad_out = collect(model, weights, &blocks, Some(&start), store, grads)?;
                    release_blocks(model, weights, &blocks);
                    grads.stretch_done(final_counts.next().expect("one count per stretch"))?;
                }
                Stage::Kept(kept) => {
                    let surrogate = surrogate(&kept.end, &g, kept.aux.as_ref(), aux_scale)?;
                    let span = crate::profile::scope("backward: autograd (all)");
                    let store = surrogate.backward()?;
                    drop(span);
                    drop(surrogate);
                    grad_out = collect(model, weights, &kept.blocks, kept.start.as_ref(), store, grads)?;
                    release_blocks(model, weights, &kept.blocks);
                    if kept.start.is_none() {
                        weights.release(&[EMBEDDING]); // the embedding's own stretch: the last
                    }
                    grads.stretch_done(final_counts.next().expect("one count per stretch"))?;
                }
            }
        }
        Ok(())
    }
}

/// Forward pass only (evaluation): logits (B·T, V) for `tokens` (B, T) and their packed
/// `documents` if any, each block's weights fetched before it and released after it;
/// without a graph when `weights` are detached.
pub fn forward_logits(
    model: &Model,
    weights: &mut dyn Weights,
    tokens: &Tensor,
    documents: Option<&Documents>,
) -> Result<Tensor> {
    weights.fetch(model, &[EMBEDDING])?;
    let mut x = model.embed(weights.tensors(), tokens)?; // (B, T, d)
    for i in 0..model.spec().layers {
        let own = model.block_params(i);
        weights.fetch(model, own)?;
        x = model.block(weights.tensors(), i, &x, documents)?.hidden;
        weights.release(own);
    }
    let outside = model.outside_params();
    weights.fetch(model, outside)?;
    let logits = model.head(weights.tensors(), &x)?;
    weights.release(outside);
    Ok(logits)
}

/// `seed(out, grad_out) + aux_scale · aux`: its gradient with respect to `out` is exactly
/// `grad_out` (`fused::seed`), which continues back-propagation from a stretch's end.
fn surrogate(out: &Tensor, grad_out: &Tensor, aux: Option<&Tensor>, aux_scale: f64) -> Result<Tensor> {
    let mut s = crate::model::fused::seed(out, grad_out)?;
    if let Some(aux) = aux {
        s = (s + aux.to_dtype(DType::F32)?.affine(aux_scale, 0.0)?)?;
    }
    Ok(s)
}

/// Moves the parameter gradients of a stretch (its `blocks`, plus the embedding, final norm
/// and head when the store has them) into `grads`, detached and in f32, and returns the
/// gradient of the stretch's `start`. The store is dropped before returning.
fn collect(
    model: &Model,
    weights: &dyn Weights,
    blocks: &[usize],
    start: Option<&Var>,
    mut store: GradStore,
    grads: &mut dyn GradSink,
) -> Result<Option<Tensor>> {
    let _span = crate::profile::scope("backward: gradients handed over in f32");
    for &i in blocks.iter().flat_map(|&b| model.block_params(b)).chain(model.outside_params()) {
        if let Some(g) = store.remove(&weights.leaf(model, i)) {
            let g = g.detach().to_dtype(DType::F32)?;
            // Only the embedding's own stretch (it has no start) holds its last use.
            grads.receive(i, g, start.is_none() || i != EMBEDDING)?;
        }
    }
    let start = start.and_then(|v| store.remove(v.as_tensor())).map(|g| g.detach());
    drop(store);
    Ok(start)
}

/// Releases the weights of `blocks`.
fn release_blocks(model: &Model, weights: &mut dyn Weights, blocks: &[usize]) {
    for &b in blocks {
        weights.release(model.block_params(b));
    }
}

/// Index of the token embedding among the parameters (also the head, when tied).
const EMBEDDING: usize = 0;

/// The order in which backward will hand over final gradients, one list per stretch in the
/// order backward walks them: the last stretch's blocks, the final norm and head, then each
/// earlier stage's blocks, the embedding last, in its own stretch (a tied embedding's head
/// use is not final, so it is listed once, at the end).
fn gradient_order(model: &Model, last: &Kept, stages: &[Stage]) -> Vec<Vec<usize>> {
    let mut first: Vec<usize> = last.blocks.iter().flat_map(|&b| model.block_params(b)).copied().collect();
    first.extend(model.outside_params().iter().copied().filter(|&i| i != EMBEDDING));
    let mut order = vec![first];
    for stage in stages.iter().rev() {
        order.push(match stage {
            Stage::Kept(k) if k.start.is_none() => vec![EMBEDDING], // the embedding's stretch
            Stage::Kept(Kept { blocks, .. }) | Stage::Recompute { blocks, .. } => {
                blocks.iter().flat_map(|&b| model.block_params(b)).copied().collect()
            }
        });
    }
    order
}

/// Starts bringing back the next parked input backward will take (`park::next_down`), while
/// the stages above it back-propagate.
fn prefetch(parking: Option<&mut Session<'_>>, stages: &mut [Stage]) -> Result<()> {
    let Some(parking) = parking else { return Ok(()) };
    let parked: Vec<bool> =
        stages.iter().map(|s| matches!(s, Stage::Recompute { input: Input::Parked(_), .. })).collect();
    match park::next_down(&parked).map(|k| &mut stages[k]) {
        Some(Stage::Recompute { input: Input::Parked(next), .. }) => parking.prefetch(next),
        _ => Ok(()),
    }
}
