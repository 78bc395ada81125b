//! The model's forward pass (`model::llama`) and one micro-batch's `forward_backward`
//! (`model::recompute`), replayed statement by statement on the shadow tensors of `sim`, so the
//! meter sees the same allocations, in the same order and with the same lifetimes, as the
//! counting allocator sees in a real step. Keep this file in step with those two: a change
//! there (an extra cast, a copy, a tensor kept longer) is a change in memory that the estimate
//! will only see once it is mirrored here. The calibration tests in
//! `tests/estimate_vs_measured.rs` compare the two.

use std::cell::RefCell;
use std::rc::Rc;

use ava_core::BlockDecision;

use super::sim::{self, Buf, Cat, Dt, Fused, GradStore, Meter, T, backward};
use crate::model::fused::{RopeTables, half_scratch_len};
use crate::model::{BlockIndex, MlpIndex, ModelSpec, ParamDef, ParamIndex};

/// How the optimizer step runs, as far as memory goes (`train::optim`, `train::in_backward`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct StepModel {
    /// Each parameter is stepped as soon as its gradient is final and the gradient freed
    /// (`train.step_in_backward`); otherwise all gradients are held until after backward,
    /// where the step also computes their norm (partial sums only, no g²).
    pub inside: bool,
    /// The weights are stored in the compute type with no f32 master in memory
    /// (`master_weights: none | kahan | tier`): no cast copy for the forward pass.
    pub stored_half: bool,
    /// Each step widens its parameter into an f32 scratch (`none`, `kahan`; a `tier` master
    /// is itself the f32 copy).
    pub scratch: bool,
    /// Replay the step after backward too (a whole training step, not only a micro-batch's
    /// forward and backward).
    pub after: bool,
    /// Per parameter, the bytes of its state the engine reads from the offload tier for its
    /// step and frees once the tier has them back (0: the state stays in memory).
    pub streamed: Vec<u64>,
    /// Streamed parameters whose records the tier reads ahead of the one being stepped
    /// (`offload.prefetch`).
    pub prefetch: usize,
    /// The streamed state visits a GPU from page-locked host memory (`offload.tiers`' `ram`
    /// share on a GPU run): a parameter's device copy stays until the next one is stepped,
    /// while its write-back runs, rather than the tier holding it.
    pub pinned: bool,
    /// Data parallelism over several ranks (`dist`), for the rank estimated.
    pub zero: Option<ZeroModel>,
}

/// ZeRO as the engine runs it, for one rank (`dist::zero`, `dist::reduce`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct ZeroModel {
    /// The stage, 0..=3.
    pub stage: u8,
    /// The parameters this rank steps (every one at stage 0).
    pub owned: Vec<bool>,
    /// Bytes per bucket (`distributed.bucket_size`, as `dist::Zero` clamps it).
    pub bucket: u64,
    /// Bytes of each parameter as stored (for the all-gathers of the weights).
    pub stored: Vec<u64>,
}

impl ZeroModel {
    /// The largest bucket of consecutive parameters of `bytes` each, as `Zero::buckets`
    /// forms them (one larger than a bucket travels alone).
    fn largest_bucket(&self, bytes: impl Iterator<Item = u64>) -> u64 {
        let (mut most, mut fill) = (0u64, 0u64);
        for b in bytes {
            if fill > 0 && fill + b > self.bucket {
                most = most.max(fill);
                fill = 0;
            }
            fill += b;
        }
        most.max(fill)
    }
}

/// Stage 2's buckets during backward (`dist::ReduceInBackward`): final gradients go into a
/// bucket; a full bucket becomes one flat copy in flight (its gradients freed); the oldest
/// of more than `IN_FLIGHT` lands as this rank's reduced gradients.
struct Buckets<'a> {
    zero: &'a ZeroModel,
    /// Whether each parameter is in a bucket already (this micro-batch).
    handed: Vec<bool>,
    filling: Vec<usize>,
    fill: u64,
    flight: std::collections::VecDeque<(T, Vec<usize>)>,
    /// This rank's reduced gradients (accumulated over micro-batches).
    reduced: Vec<Option<T>>,
}

impl Buckets<'_> {
    /// After a stretch: every gradient that is final goes into a bucket (a tied embedding's
    /// is final only in the embedding's own stretch, the one without a start).
    fn stretch_done(&mut self, replay: &Replay, grads: &mut [Option<T>], embedding_stretch: bool) {
        for i in 0..grads.len() {
            if self.handed[i] || grads[i].is_none() || (i == 0 && !embedding_stretch) {
                continue;
            }
            self.handed[i] = true;
            self.filling.push(i);
            self.fill += 4 * (replay.defs[i].numel() as u64 + 1);
            if self.fill >= self.zero.bucket {
                self.start(replay, grads);
            }
        }
        if embedding_stretch && !self.filling.is_empty() {
            self.start(replay, grads);
        }
    }

    fn start(&mut self, replay: &Replay, grads: &mut [Option<T>]) {
        if self.flight.len() >= crate::dist::IN_FLIGHT {
            self.complete_oldest(replay);
        }
        let params = std::mem::take(&mut self.filling);
        let len: usize = params.iter().map(|&i| replay.defs[i].numel() + 1).sum();
        let flat = T::new(&replay.meter, &[len], Dt::F32); // (Σ numel + 1,) the bucket's copy
        for &i in &params {
            grads[i] = None;
        }
        self.fill = 0;
        self.flight.push_back((flat, params));
    }

    fn complete_oldest(&mut self, replay: &Replay) {
        let Some((flat, params)) = self.flight.pop_front() else { return };
        for i in params.into_iter().filter(|&i| self.zero.owned[i]) {
            let g = T::new(&replay.meter, &replay.defs[i].shape, Dt::F32); // averaged share
            self.reduced[i] = Some(match self.reduced[i].take() {
                Some(acc) => acc.add(&g),
                None => g,
            });
        }
        drop(flat);
    }

    /// Ends the micro-batch: the last bucket started, every one landed.
    fn finish(mut self, replay: &Replay, grads: &mut [Option<T>]) -> Vec<Option<T>> {
        if !self.filling.is_empty() {
            self.start(replay, grads);
        }
        while !self.flight.is_empty() {
            self.complete_oldest(replay);
        }
        self.reduced
    }
}

/// A block's output and its load-balancing loss (MoE).
struct BlockOut {
    hidden: T,
    aux: Option<T>,
}

/// A stretch of graph between recomputed blocks (`recompute::Kept`).
struct Kept {
    start: Option<T>,
    end: T,
    aux: Option<T>,
    blocks: Vec<usize>,
}

enum Stage {
    Kept(Kept),
    /// One recomputed block, or a segment of them run again from the first one's input.
    Recompute {
        blocks: Vec<usize>,
        input: Input,
    },
}

/// Where a recomputed block's input waits for backward (`recompute::Input`).
enum Input {
    /// In the memory counted.
    Held(T),
    /// Off the device (a GPU run's `Offload` block, [`ParkedInputs`]): its shape and type,
    /// and its device copy once uploaded ahead.
    Parked { dims: Vec<usize>, dtype: Dt, back: Option<T> },
}

/// Where a GPU run's `Offload` blocks keep their inputs between forward and backward
/// (`model::park`), as far as device memory goes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum ParkedInputs {
    /// In the memory counted (the host's: the CPU parks in a tier of the same memory).
    #[default]
    Held,
    /// In page-locked host memory (`ram`): each device copy stays until the next block is
    /// parked (or forward is done) while it is written back; in backward the next one down
    /// is uploaded while a stage is recomputed, first before the loss's backward.
    Pinned,
    /// Through another tier's byte API: off the device from its synchronous copy until its
    /// stage is recomputed, fetched then.
    Tier,
}

/// What one replayed micro-batch cost.
#[derive(Debug, Clone)]
pub(crate) struct MicroBatchPeak {
    /// Peak bytes above what was held before the call.
    pub bytes: u64,
    /// The same, per category.
    pub by_cat: [u64; sim::CATS],
    /// Where the peak happened.
    pub phase: String,
    /// The backward op being processed at the peak, if any.
    pub op: &'static str,
    /// The most the offload tier holds of the streamed state at once, in the order the
    /// parameters were stepped: the records read ahead and the one written behind.
    pub tier_peak: u64,
}

/// The model on shadow tensors: parameters, their compute-type casts, rotary tables.
pub(crate) struct Replay<'a> {
    spec: &'a ModelSpec,
    meter: Rc<Meter>,
    batch: usize,
    seq: usize,
    dtype: Dt,
    saved_len: u64,
    /// Whether the kernel's saved buffer is held in the half type (a half run, and the
    /// kernel tolerates it).
    saved_half: bool,
    /// The kernel's declared workspace, forward and backward (f32s).
    workspace: [u64; 2],
    /// How the optimizer steps the parameters (`train.master_weights`, `step_in_backward`).
    step: StepModel,
    /// Rows of the LM head computed at once in the loss (`train.loss_chunk_rows`; 0: the
    /// logits whole).
    loss_chunk_rows: usize,
    /// Where `Offload` blocks' inputs wait.
    parked_inputs: ParkedInputs,
    /// The streamed parameters in the order the replay stepped them.
    stepped: std::cell::RefCell<Vec<usize>>,
    defs: Vec<ParamDef>,
    /// By parameter: its `Var`, and the weight the forward pass uses. At ZeRO stage 3 they
    /// change as blocks are gathered and released (see [`Replay::fetch`]).
    vars: RefCell<Vec<T>>,
    weights: RefCell<Vec<T>>,
    /// Stage 3: which parameters are gathered now.
    present: RefCell<Vec<bool>>,
    /// The rotary tables (f32 and f64), held with the parameters.
    _rope: Rc<Buf>,
    blocks: Vec<BlockIndex>,
    block_all: Vec<Vec<usize>>,
    final_norm: usize,
    head: usize,
}

fn add_opt(a: Option<T>, b: Option<T>) -> Option<T> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.add(&b)),
        (a, None) => a,
        (None, b) => b,
    }
}

/// `fused::linear`: x (N, in) · wᵀ, w (out, in), in their type; on the host a half type
/// through f32 scratch inside the op, on a GPU cuBLAS without scratch (in the pool).
fn linear(x: &T, w: &T, gpu: bool) -> T {
    let dims = [x.dims()[0], w.dims()[0]];
    let kind = if x.dtype() == Dt::Half && !gpu {
        Fused::LinearHalf { scratch: half_scratch_len(dims[0], x.dims()[1], dims[1]) as u64 }
    } else {
        Fused::Linear
    };
    T::fused(kind, &[&x.contiguous(), &w.contiguous()], &dims)
}

/// `ops::softmax_last`.
fn softmax_last(x: &T) -> T {
    let max = x.max_keepdim_last_detached();
    let e = x.broadcast_sub(&max).exp();
    e.broadcast_div(&e.sum_keepdim(&[e.dims().len() - 1]))
}

impl<'a> Replay<'a> {
    /// The model for micro-batches of `batch` sequences of `seq` tokens in `dtype`, with an
    /// attention kernel that saves `saved_len` f32s per call. Parameters, casts and rotary
    /// tables are counted under [`Cat::Params`].
    pub(crate) fn new(spec: &'a ModelSpec, batch: usize, seq: usize, dtype: Dt, saved_len: u64) -> Self {
        let meter = Meter::new();
        meter.set_cat(Cat::Params);
        let defs = spec.params();
        let vars: Vec<T> = defs.iter().map(|d| T::param(&meter, &d.shape)).collect();
        // Model::weights: the Vars themselves in f32, casts (inside the graph) otherwise;
        // `fused::cast` allocates and back-propagates as candle's `to_dtype` does.
        let weights = vars.iter().map(|v| v.to_dtype(dtype)).collect();
        let _rope = sim::raw(&meter, RopeTables::bytes(seq, spec.head_dim()));
        let ParamIndex { blocks, head, final_norm } = spec.param_index();
        // Each block's parameters in `params()` order, for `collect`.
        let block_all =
            (0..spec.layers).map(|i| (0..defs.len()).filter(|&j| defs[j].block == Some(i)).collect()).collect();
        let present = RefCell::new(vec![true; defs.len()]);
        Self {
            spec,
            meter,
            present,
            batch,
            seq,
            dtype,
            saved_len,
            saved_half: false,
            workspace: [0, 0],
            step: StepModel::default(),
            loss_chunk_rows: crate::model::DEFAULT_LOSS_CHUNK_ROWS,
            parked_inputs: ParkedInputs::Held,
            stepped: Default::default(),
            defs,
            vars: RefCell::new(vars),
            weights: RefCell::new(weights),
            _rope,
            blocks,
            block_all,
            final_norm,
            head,
        }
    }

    /// Counting a GPU run's device memory (`sim`'s module docs): the ops allocate as the
    /// engine's device ops do, and the rotary tables are their device copy, cos and sin in
    /// f32 (the host's f32 and f64 tables are host memory). Call first, before the other
    /// `with_` settings.
    pub(crate) fn on_gpu(mut self) -> Self {
        self.meter.set_gpu();
        self.meter.set_cat(Cat::Params);
        self._rope = sim::raw(&self.meter, RopeTables::device_bytes(self.seq, self.spec.head_dim()));
        self
    }

    /// With an attention kernel that declares `forward` and `backward` f32s of workspace.
    pub(crate) fn with_workspace(mut self, forward: u64, backward: u64) -> Self {
        self.workspace = [forward, backward];
        self
    }

    /// With the kernel's saved buffer held in the half type in a half run (the kernel's
    /// [`saved_tolerates_half`](ava_core::AttentionKernel::saved_tolerates_half)).
    pub(crate) fn with_saved_half(mut self, tolerates: bool) -> Self {
        self.saved_half = tolerates;
        self
    }

    /// With the loss computing the LM head `rows` rows at a time (`train.loss_chunk_rows`; 0:
    /// the logits whole, kept for backward); [`crate::model::DEFAULT_LOSS_CHUNK_ROWS`] otherwise,
    /// as a built `Model`.
    pub(crate) fn with_loss_chunk_rows(mut self, rows: usize) -> Self {
        self.loss_chunk_rows = rows;
        self
    }

    /// With `Offload` blocks' inputs kept as `parked` says (a GPU run's; held otherwise).
    pub(crate) fn with_parked_inputs(mut self, parked: ParkedInputs) -> Self {
        self.parked_inputs = parked;
        self
    }

    /// With the optimizer step modelled as `step` (the weights stored in the compute type
    /// when it says so: the cast copies then do not exist).
    pub(crate) fn with_step(mut self, step: StepModel) -> Self {
        self.step = step;
        let stored = self.stored_dtype();
        if stored != Dt::F32 {
            self.meter.set_cat(Cat::Params);
            self.weights.get_mut().clear();
            *self.vars.get_mut() = self.defs.iter().map(|d| T::param_as(&self.meter, &d.shape, self.dtype)).collect();
            *self.weights.get_mut() = self.vars.borrow().clone();
        }
        if let Some(z) = self.step.zero.as_ref().filter(|z| z.stage >= 3) {
            // Stage 3: only this rank's own parameters are held; nothing is cast until a
            // block's weights are fetched.
            self.meter.set_cat(Cat::Params);
            let empty = |dtype| T::new(&self.meter, &[0], dtype);
            self.weights.get_mut().clear();
            *self.vars.get_mut() = (self.defs.iter().zip(&z.owned))
                .map(|(d, &own)| if own { T::param_as(&self.meter, &d.shape, stored) } else { empty(stored) })
                .collect();
            *self.weights.get_mut() = self.defs.iter().map(|_| empty(self.dtype)).collect();
            *self.present.get_mut() = vec![false; self.defs.len()];
        }
        self
    }

    /// The meter.
    #[cfg(test)]
    pub(crate) fn meter(&self) -> &Rc<Meter> {
        &self.meter
    }

    /// `fused::rms_norm`: in the input's type.
    fn rms_norm(&self, x: &T, w: &T) -> T {
        T::fused(Fused::RmsNorm, &[&x.contiguous(), &w.contiguous()], x.dims())
    }

    /// `fused::split_heads`: (B·T, C·D) → (B, C, T, D) in the input's type.
    fn split_heads(&self, p: &T, c: usize) -> T {
        T::fused(Fused::SplitHeads, &[&p.contiguous()], &[self.batch, c, self.seq, self.spec.head_dim()])
    }

    /// `fused::merge_heads`: (B, C, T, D) → (B·T, C·D) in the input's type.
    fn merge_heads(x: &T) -> T {
        let d = x.dims();
        let (b, c, t, hd) = (d[0], d[1], d[2], d[3]);
        T::fused(Fused::MergeHeads, &[&x.contiguous()], &[b * t, c * hd])
    }

    /// `model::attention`: the kernel op on q, k, v in their type (widened to f32 inside it).
    fn attention(&self, q: &T, k: &T, v: &T) -> T {
        T::attention(&q.contiguous(), &k.contiguous(), &v.contiguous(), self.saved_len, self.saved_half, self.workspace)
    }

    /// `llama::projection`: the product, plus the bias when the projection has one.
    fn projection(&self, x: &T, weight: usize, bias: Option<usize>) -> T {
        let y = linear(x, &self.weights.borrow()[weight], self.meter.on_gpu());
        match bias {
            Some(b) => y.broadcast_add(&self.weights.borrow()[b]),
            None => y,
        }
    }

    fn swiglu(&self, x: &T, gate: usize, up: usize, down: usize) -> T {
        self.swiglu_biased(x, [gate, up, down], [None; 3])
    }

    /// SwiGLU with the (gate, up, down) weights and their biases, if any.
    fn swiglu_biased(&self, x: &T, [gate, up, down]: [usize; 3], bias: [Option<usize>; 3]) -> T {
        let (g, u) = (self.projection(x, gate, bias[0]), self.projection(x, up, bias[1])); // (N, F)
        let hidden = T::fused(Fused::SwiGlu, &[&g.contiguous(), &u.contiguous()], g.dims()); // (N, F)
        self.projection(&hidden, down, bias[2])
    }

    /// `llama::moe`, with tokens spread evenly over the experts (the routing is data-dependent;
    /// an even spread is what the load-balancing loss aims for).
    fn moe(&self, x: &T, router: usize, experts: &[[usize; 3]], top_k: usize) -> (T, T) {
        let (n, d) = (x.dims()[0], x.dims()[1]);
        let e_count = experts.len();
        let m = &self.meter;
        let probs = softmax_last(&linear(x, &self.weights.borrow()[router], self.meter.on_gpu()).to_dtype(Dt::F32)); // (N, E) f32
        // probs.to_vec2 (rows of E f32 plus a Vec header each), the chosen ids, the counts.
        let _values = sim::raw(m, (n * e_count * 4 + n * 24) as u64);
        let _chosen = sim::raw(m, (n * top_k * 4) as u64);
        let chosen_t = T::new(m, &[n, top_k], Dt::U32);
        let top = probs.gather(&chosen_t, 1); // (N, k)
        let top = top.broadcast_div(&top.sum_keepdim(&[1])).reshape(&[n * top_k]); // (N·k,)
        let mut out = T::new(m, &[n, d], x.dtype()); // (N, d)
        let slots = n * top_k;
        for (e, [w1, w3, w2]) in experts.iter().enumerate() {
            let count = slots / e_count + usize::from(e < slots % e_count);
            if count == 0 {
                continue;
            }
            let _slots = sim::raw(m, count as u64 * 4);
            let rows = T::new(m, &[count], Dt::U32);
            let gate = top.index_select(&T::new(m, &[count], Dt::U32), 0); // (n_e,)
            let y = self.swiglu(&x.index_select(&rows, 0), *w1, *w3, *w2); // (n_e, d)
            let y = y.broadcast_mul(&gate.to_dtype(x.dtype()).unsqueeze(1));
            out = out.index_add(&rows, &y, 0);
        }
        let fractions = T::new(m, &[e_count], Dt::F32);
        let mean = probs.sum_keepdim(&[0]).reshape(&[e_count]).affine(1.0);
        let aux = mean.mul(&fractions).sum_all().affine(e_count as f64);
        (out, aux)
    }

    /// ZeRO stage 3's `Gathered::fetch`: the parameters of `ids` not gathered yet come in one
    /// all-gather of their stored bytes (the flat buffer beside the tensors read out of it),
    /// then each becomes a `Var` (another rank's) and its cast for the forward pass. Other
    /// stages hold every weight: nothing happens.
    fn fetch(&self, ids: &[usize]) {
        let Some(z) = self.step.zero.as_ref().filter(|z| z.stage >= 3) else { return };
        let missing: Vec<usize> = ids.iter().copied().filter(|&i| !self.present.borrow()[i]).collect();
        if missing.is_empty() {
            return;
        }
        let m = &self.meter;
        let cat = m.cat();
        m.set_cat(Cat::Params);
        let stored = self.stored_dtype();
        let bytes: u64 = missing.iter().map(|&i| z.stored[i]).sum();
        let flat = T::new(m, &[bytes.div_ceil(4) as usize], Dt::F32); // (Σ bytes,) u8
        let gathered: Vec<(usize, T)> = missing
            .iter()
            .filter(|&&i| !z.owned[i])
            .map(|&i| (i, T::param_as(m, &self.defs[i].shape, stored)))
            .collect();
        drop(flat);
        for (i, var) in gathered {
            self.vars.borrow_mut()[i] = var;
        }
        for &i in &missing {
            let cast = self.vars.borrow()[i].to_dtype(self.dtype);
            self.weights.borrow_mut()[i] = cast;
            self.present.borrow_mut()[i] = true;
        }
        if let Some(cat) = cat {
            m.set_cat(cat);
        }
    }

    /// ZeRO stage 3's `Gathered::release`: the references go (a graph may still hold them).
    fn release(&self, ids: &[usize]) {
        let Some(z) = self.step.zero.as_ref().filter(|z| z.stage >= 3) else { return };
        let stored = self.stored_dtype();
        for &i in ids {
            if !std::mem::replace(&mut self.present.borrow_mut()[i], false) {
                continue;
            }
            self.weights.borrow_mut()[i] = T::new(&self.meter, &[0], self.dtype);
            if !z.owned[i] {
                self.vars.borrow_mut()[i] = T::new(&self.meter, &[0], stored);
            }
        }
    }

    /// The type the weights are stored in: the compute type when no f32 masters are held.
    fn stored_dtype(&self) -> Dt {
        if self.step.stored_half { self.dtype } else { Dt::F32 }
    }

    /// The parameters outside the blocks: embedding, final norm, head.
    fn outside(&self) -> Vec<usize> {
        (0..self.defs.len()).filter(|&i| self.defs[i].block.is_none()).collect()
    }

    fn release_blocks(&self, blocks: &[usize]) {
        for &b in blocks {
            self.release(&self.block_all[b]);
        }
    }

    /// `Model::embed`: (B, T) ids → (B, T, d).
    fn embed(&self, tokens: &T) -> T {
        let (b, t) = (tokens.dims()[0], tokens.dims()[1]);
        let table = self.weights.borrow()[0].contiguous(); // (V, d)
        T::fused(Fused::Embedding, &[&table], &[b * t, self.spec.hidden]).reshape(&[b, t, self.spec.hidden])
    }

    /// `Model::block`.
    fn block(&self, i: usize, x: &T) -> BlockOut {
        let bi = &self.blocks[i];
        let s = self.spec;
        let w = self.weights.borrow();
        let (b, t, d) = (x.dims()[0], x.dims()[1], x.dims()[2]);
        let (h, hkv) = (s.heads, s.kv_heads);
        let n = b * t;
        let normed = self.rms_norm(x, &w[bi.attn_norm]).reshape(&[n, d]); // (B·T, d)
        let (q, k, v) = (
            self.projection(&normed, bi.q, bi.qkv_bias[0]),
            self.projection(&normed, bi.k, bi.qkv_bias[1]),
            self.projection(&normed, bi.v, bi.qkv_bias[2]),
        );
        let q = self.split_heads(&q, h); // (B, H, T, D)
        let k = self.split_heads(&k, hkv); // (B, Hkv, T, D)
        let v = self.split_heads(&v, hkv); // (B, Hkv, T, D)
        let attn = self.attention(&q, &k, &v); // (B, H, T, D)
        drop((q, k, v));
        let attn = Self::merge_heads(&attn); // (B·T, H·D)
        // `fused::add`: for half types (and large f32) a custom op with candle's addition's memory.
        let x = x.add(&self.projection(&attn, bi.o, bi.o_bias).reshape(&[b, t, d])); // (B, T, d)
        let normed = self.rms_norm(&x, &w[bi.mlp_norm]).reshape(&[n, d]); // (B·T, d)
        let (mlp, aux) = match &bi.mlp {
            MlpIndex::Dense { gate, up, down, bias } => (self.swiglu_biased(&normed, [*gate, *up, *down], *bias), None),
            MlpIndex::Moe { router, experts, top_k } => {
                let (out, aux) = self.moe(&normed, *router, experts, *top_k);
                (out, Some(aux))
            }
        };
        BlockOut { hidden: x.add(&mlp.reshape(&[b, t, d])), aux }
    }

    /// `Model::head`: final norm and LM head, (B, T, d) → (B·T, V).
    fn head(&self, x: &T) -> T {
        let (b, t, d) = (x.dims()[0], x.dims()[1], x.dims()[2]);
        let normed = self.rms_norm(x, &self.weights.borrow()[self.final_norm]).reshape(&[b * t, d]);
        linear(&normed, &self.weights.borrow()[self.head], self.meter.on_gpu())
    }

    /// `Model::head_loss`: the final norm, the LM head and the mean cross-entropy of (B, T, d),
    /// an f32 scalar. Without blocks (`loss_chunk_rows` 0) the logits of [`head`](Self::head)
    /// go whole into `ops::cross_entropy` (on the host widened to f32 first; a GPU's kernel
    /// reads them in their type), and the graph keeps them. In blocks (`model::head_loss`):
    /// each block's logits and per-row values on detached inputs, the logits freed, the values
    /// concatenated and averaged, then the op that holds h and W ([`T::head_loss`]).
    fn head_loss(&self, x: &T) -> T {
        let gpu = self.meter.on_gpu();
        if self.loss_chunk_rows == 0 {
            let logits = self.head(x); // (B·T, V)
            let wide = if gpu { logits } else { logits.to_dtype(Dt::F32) };
            return wide.contiguous().cross_entropy_rows().sum_all().affine(1.0);
        }
        let (b, t, d) = (x.dims()[0], x.dims()[1], x.dims()[2]);
        let normed = self.rms_norm(x, &self.weights.borrow()[self.final_norm]).reshape(&[b * t, d]); // (B·T, d)
        let w = self.weights.borrow()[self.head].clone(); // (V, d)
        let (hd, wd) = (normed.detach(), w.detach());
        let value = {
            let mut rows = Vec::new();
            for (start, len) in crate::model::loss_blocks(b * t, self.loss_chunk_rows) {
                let logits = linear(&hd.narrow(0, start, len), &wd, gpu); // (len, V)
                rows.push(logits.contiguous().cross_entropy_rows()); // (len,) f32
            }
            let refs: Vec<&T> = rows.iter().collect();
            sim::cat(&refs, 0).sum_all().affine(1.0)
        };
        T::head_loss(&normed, &w, value, self.loss_chunk_rows)
    }

    /// Bytes a kept block adds to the graph (its activations, the kernel's saved buffer and its
    /// output), measured on a fresh input.
    pub(crate) fn block_activation_bytes(&self) -> u64 {
        let x = T::new(&self.meter, &[self.batch, self.seq, self.spec.hidden], self.dtype).make_var();
        let before = self.meter.current();
        let out = self.block(0, &x);
        let bytes = self.meter.current() - before;
        drop((out.hidden, out.aux, x));
        bytes
    }

    /// `recompute::surrogate`.
    fn surrogate(out: &T, grad_out: &T, aux: Option<&T>) -> T {
        let mut s = T::seed(out, grad_out);
        if let Some(aux) = aux {
            s = s.add(&aux.to_dtype(Dt::F32).affine(1.0));
        }
        s
    }

    /// `recompute::collect`: the stretch's parameter gradients into the accumulators, the gradient of
    /// its start out; the store is dropped.
    fn collect(&self, blocks: &[usize], start: Option<&T>, mut store: GradStore, grads: &mut [Option<T>]) -> Option<T> {
        self.meter.set_cat(Cat::ParamGrads);
        let indices: Vec<usize> =
            blocks.iter().flat_map(|&b| self.block_all[b].clone()).chain(self.outside()).collect();
        for i in indices {
            let var = self.vars.borrow()[i].clone();
            if let Some(g) = store.remove(&var) {
                let g = g.detach().to_dtype(Dt::F32);
                grads[i] = Some(match grads[i].take() {
                    Some(acc) => acc.add(&g),
                    None => g,
                });
                // Stepped at once, unless it is the embedding's head use (tied), which waits
                // for the embedding's own stretch (the one without a start).
                if self.step.inside && (start.is_none() || i != 0) {
                    self.step_param(i, grads);
                }
            }
        }
        let start = start.and_then(|v| store.remove(v)).map(|g| g.detach());
        drop(store);
        self.meter.set_cat(Cat::Backward);
        start
    }

    /// The optimizer step of parameter `i`: its f32 scratch while it is stepped, then its
    /// gradient freed.
    fn step_param(&self, i: usize, grads: &mut [Option<T>]) {
        self.meter.set_cat(Cat::Step);
        // The state read from the tier (its buffers, as the plugin lays them out).
        let state = self.step.streamed.get(i).filter(|&&b| b > 0).map(|&b| {
            self.stepped.borrow_mut().push(i);
            T::new(&self.meter, &[b.div_ceil(4) as usize], Dt::F32) // (state bytes / 4,)
        });
        if self.step.scratch {
            drop(T::new(&self.meter, &self.defs[i].shape, Dt::F32)); // (numel,) widened weights
        }
        drop(state);
        self.meter.set_cat(Cat::ParamGrads);
        grads[i] = None;
    }

    /// `recompute::forward_backward` for one micro-batch under `plan` (an `Offload` block
    /// keeps its input as [`ParkedInputs`] says: in memory on the CPU, whose tier is counted
    /// memory too). With
    /// `accumulating`, gradient accumulators from an earlier micro-batch are held throughout
    /// and this micro-batch's gradients are added to them at the end. Returns the peak above
    /// what was held before the call (parameters, casts, accumulators, the batch).
    pub(crate) fn forward_backward(&self, plan: &[BlockDecision], accumulating: bool) -> MicroBatchPeak {
        self.stepped.borrow_mut().clear();
        let m = &self.meter;
        let (b, t) = (self.batch, self.seq);
        m.set_cat(Cat::Accumulators);
        // Stage 2 reduces each stretch's gradients during backward, into this rank's own
        // accumulators only; its backward hands over a stretch per block.
        let zero = self.step.zero.as_ref();
        let stage2 = zero.filter(|z| z.stage >= 2);
        let kept_from_before = |i: usize| accumulating && stage2.is_none_or(|z| z.owned[i]);
        let held: Vec<Option<T>> = (0..self.defs.len())
            .map(|i| kept_from_before(i).then(|| T::new(m, &self.defs[i].shape, Dt::F32)))
            .collect();
        let mut buckets = stage2.map(|zero| Buckets {
            zero,
            handed: vec![false; self.defs.len()],
            filling: Vec::new(),
            fill: 0,
            flight: Default::default(),
            reduced: Vec::new(),
        });
        let mut accumulators = match &mut buckets {
            Some(b) => {
                b.reduced = held;
                vec![None; self.defs.len()]
            }
            None => held,
        };
        m.set_cat(Cat::Params);
        let tokens = T::new(m, &[b, t], Dt::U32); // the caller's (B, T) ids
        let before = m.current_by_cat();
        m.reset_peak();

        m.set_phase("forward: embedding".into());
        m.set_cat(Cat::Embedding);
        self.fetch(&[0]);
        let embedded = self.embed(&tokens);
        let first = embedded.detach().make_var();
        let mut stages = vec![Stage::Kept(Kept { start: None, end: embedded, aux: None, blocks: vec![] })];
        let mut current = Kept { end: first.clone(), start: Some(first), aux: None, blocks: vec![] };
        // A parked input's device copy while its write-back runs (`ParkedInputs::Pinned`).
        let mut retiring: Option<T> = None;
        for (i, decision) in plan.iter().enumerate() {
            match decision {
                BlockDecision::Keep => {
                    m.set_phase(format!("forward: block {i} (keep)"));
                    m.set_cat(Cat::Blocks);
                    if buckets.is_some() && !current.blocks.is_empty() {
                        let start = current.end.detach().make_var();
                        let next = Kept { end: start.clone(), start: Some(start), aux: None, blocks: vec![] };
                        stages.push(Stage::Kept(std::mem::replace(&mut current, next)));
                    }
                    self.fetch(&self.block_all[i]);
                    let out = self.block(i, &current.end);
                    current.end = out.hidden;
                    current.aux = add_opt(current.aux.take(), out.aux);
                    current.blocks.push(i);
                }
                BlockDecision::Segment => {
                    m.set_phase(format!("forward: block {i} (run detached, recomputed with its segment)"));
                    m.set_cat(Cat::Recompute);
                    match stages.last_mut() {
                        Some(Stage::Recompute { blocks, .. }) => blocks.push(i),
                        _ => panic!("block {i} is 'segment' with no recomputed block below (check_plan refuses it)"),
                    }
                    self.fetch(&self.block_all[i]);
                    let out = self.block(i, &current.end.detach());
                    self.release(&self.block_all[i]);
                    let hidden = out.hidden.detach();
                    drop(out);
                    m.set_cat(Cat::Inputs);
                    let start = hidden.make_var();
                    current = Kept { end: start.clone(), start: Some(start), aux: None, blocks: vec![] };
                    drop(hidden);
                }
                BlockDecision::Recompute | BlockDecision::Offload => {
                    m.set_phase(format!("forward: block {i} (run detached, recomputed in backward)"));
                    m.set_cat(Cat::Recompute);
                    let input = current.end.detach(); // (B, T, d)
                    self.fetch(&self.block_all[i]);
                    let out = self.block(i, &input);
                    self.release(&self.block_all[i]);
                    let hidden = out.hidden.detach();
                    drop(out);
                    if !current.blocks.is_empty() {
                        stages.push(Stage::Kept(current));
                    }
                    let input = match (decision, self.parked_inputs) {
                        (BlockDecision::Offload, ParkedInputs::Pinned) => {
                            let parked =
                                Input::Parked { dims: input.dims().to_vec(), dtype: input.dtype(), back: None };
                            retiring = Some(input); // the one before goes
                            parked
                        }
                        (BlockDecision::Offload, ParkedInputs::Tier) => {
                            Input::Parked { dims: input.dims().to_vec(), dtype: input.dtype(), back: None }
                        }
                        _ => Input::Held(input),
                    };
                    stages.push(Stage::Recompute { blocks: vec![i], input });
                    m.set_cat(Cat::Inputs);
                    let start = hidden.make_var();
                    current = Kept { end: start.clone(), start: Some(start), aux: None, blocks: vec![] };
                    drop(hidden);
                }
            }
        }

        m.set_phase("forward: head and loss".into());
        m.set_cat(Cat::Head);
        let outside = self.outside();
        self.fetch(&outside);
        let ce = self.head_loss(&current.end);
        let mut loss = ce.clone();
        if let Some(aux) = &current.aux {
            loss = loss.add(&aux.to_dtype(Dt::F32).affine(1.0));
        }
        m.set_phase(format!("backward: loss, head and {}", stretch_name(&current.blocks)));
        drop(retiring); // forward is done: the last write-back's device copy goes
        self.bring_back(&mut stages);
        m.set_cat(Cat::Backward);
        let root = loss.affine(1.0);
        let store = backward(&root);
        drop((root, loss, ce));
        let mut grad_out = self.collect(&current.blocks, current.start.as_ref(), store, &mut accumulators);
        self.release(&outside.iter().copied().filter(|&i| i != 0).collect::<Vec<_>>());
        self.release_blocks(&current.blocks);
        drop(current);
        if let Some(b) = &mut buckets {
            b.stretch_done(self, &mut accumulators, false);
        }

        while let Some(stage) = stages.pop() {
            let g = grad_out.take().expect("a stage after the first receives a gradient");
            match stage {
                Stage::Recompute { blocks, input } => {
                    m.set_phase(match blocks.as_slice() {
                        [one] => format!("backward: block {one} (recomputed)"),
                        [first, .., last] => format!("backward: segment of blocks {first}..={last} (recomputed)"),
                        [] => unreachable!("a recompute stage has its first block"),
                    });
                    m.set_cat(Cat::Inputs);
                    let input = match input {
                        Input::Held(t) => t,
                        Input::Parked { dims, dtype, back } => {
                            let input = back.unwrap_or_else(|| T::new(m, &dims, dtype)); // fetched now
                            self.bring_back(&mut stages);
                            input
                        }
                    };
                    let start = input.make_var();
                    drop(input);
                    m.set_cat(Cat::Recompute);
                    let (mut hidden, mut aux) = (start.clone(), None);
                    for &block in &blocks {
                        self.fetch(&self.block_all[block]);
                        let out = self.block(block, &hidden);
                        hidden = out.hidden;
                        aux = add_opt(aux, out.aux);
                    }
                    m.set_cat(Cat::Backward);
                    let surrogate = Self::surrogate(&hidden, &g, aux.as_ref());
                    let store = backward(&surrogate);
                    drop((surrogate, hidden, aux));
                    grad_out = self.collect(&blocks, Some(&start), store, &mut accumulators);
                    self.release_blocks(&blocks);
                    if let Some(b) = &mut buckets {
                        b.stretch_done(self, &mut accumulators, false);
                    }
                }
                Stage::Kept(kept) => {
                    m.set_phase(format!("backward: {}", stretch_name(&kept.blocks)));
                    m.set_cat(Cat::Backward);
                    let surrogate = Self::surrogate(&kept.end, &g, kept.aux.as_ref());
                    let store = backward(&surrogate);
                    drop(surrogate);
                    let embedding = kept.start.is_none();
                    grad_out = self.collect(&kept.blocks, kept.start.as_ref(), store, &mut accumulators);
                    self.release_blocks(&kept.blocks);
                    if embedding {
                        self.release(&[0]);
                    }
                    if let Some(b) = &mut buckets {
                        b.stretch_done(self, &mut accumulators, embedding);
                    }
                }
            }
        }
        if let Some(b) = buckets {
            m.set_cat(Cat::ParamGrads);
            accumulators = b.finish(self, &mut accumulators);
        }
        if self.step.after && !self.step.inside {
            // The step after backward: the global norm (read from the gradients, no g²),
            // then each parameter stepped and its gradient freed, in model order.
            if let Some(z) = zero.filter(|z| z.stage < 2) {
                // Stages 0 and 1 all-reduce after backward, a bucket at a time: the bucket's
                // flat copy beside the gradients (its own are replaced as it lands).
                m.set_phase("gradients: all-reduce over ranks".into());
                m.set_cat(Cat::ParamGrads);
                let largest = z.largest_bucket(self.defs.iter().map(|d| 4 * d.numel() as u64));
                drop(T::new(m, &[largest.div_ceil(4) as usize], Dt::F32)); // (bucket,) f32
            }
            m.set_phase("optimizer step".into());
            m.set_cat(Cat::Step);
            // `fused::sums_of_squares` reads each gradient into a few partial sums on
            // either device: no g².
            // A rank steps only its own parameters; the others' gradients go first.
            if let Some(z) = zero.filter(|z| z.stage >= 1) {
                m.set_cat(Cat::ParamGrads);
                for (g, _) in accumulators.iter_mut().zip(&z.owned).filter(|(_, own)| !**own) {
                    *g = None;
                }
            }
            for i in 0..accumulators.len() {
                if accumulators[i].is_some() {
                    self.step_param(i, &mut accumulators);
                }
            }
            if let Some(z) = zero.filter(|z| (1..=2).contains(&z.stage)) {
                // The updated weights all-gathered a bucket at a time, each parameter read
                // out of it into a tensor of its own before it is set.
                m.set_phase("parameters: all-gather over ranks".into());
                m.set_cat(Cat::Step);
                let words = |bytes: u64| [bytes.div_ceil(4) as usize];
                let flat = T::new(m, &words(z.largest_bucket(z.stored.iter().copied())), Dt::F32);
                let one = T::new(m, &words(z.stored.iter().copied().max().unwrap_or(0)), Dt::F32);
                drop((flat, one)); // (bucket,) bytes, and one parameter's
            }
        }
        let peak = m.peak();
        let mut by_cat = peak.by_cat;
        for (c, b) in by_cat.iter_mut().zip(before) {
            *c = c.saturating_sub(b);
        }
        drop(accumulators);
        MicroBatchPeak {
            bytes: peak.bytes - before.iter().sum::<u64>(),
            by_cat,
            phase: peak.phase,
            op: peak.op,
            tier_peak: self.tier_peak(),
        }
    }

    /// With inputs in page-locked memory, the next parked input down uploaded ahead
    /// (`park::next_down`), counted under [`Cat::Inputs`] (new buffers stay counted there).
    fn bring_back(&self, stages: &mut [Stage]) {
        if self.parked_inputs != ParkedInputs::Pinned {
            return;
        }
        let next = stages.iter_mut().rev().find_map(|s| match s {
            Stage::Recompute { input: Input::Parked { dims, dtype, back }, .. } => Some((dims, *dtype, back)),
            _ => None,
        });
        if let Some((dims, dtype, back @ None)) = next {
            self.meter.set_cat(Cat::Inputs);
            *back = Some(T::new(&self.meter, dims, dtype)); // (B, T, d)
        }
    }

    /// What the tier holds at most while the stepped parameters stream through it, as
    /// `train::optim`'s session drives it: `prefetch` records read ahead before the first
    /// step; then, stepping the k-th, the next `prefetch` read ahead and the k-th's new
    /// record waiting to be written.
    ///
    /// From page-locked memory on a GPU (`pinned`), what the device holds besides the one
    /// being stepped (a step transient): the next `prefetch` uploaded ahead and the one
    /// stepped before it, freed once this one is stepped (`train::optim::page_locked`).
    fn tier_peak(&self) -> u64 {
        let order = self.stepped.borrow();
        let bytes = |k: usize| order.get(k).map_or(0, |&i| self.step.streamed[i]);
        let ahead = |from: usize| (from..from + self.step.prefetch).map(bytes).sum::<u64>();
        let behind = |k: usize| if self.step.pinned { k.checked_sub(1).map_or(0, bytes) } else { bytes(k) };
        (0..order.len()).map(|k| ahead(k + 1) + behind(k)).fold(ahead(0), u64::max)
    }
}

fn stretch_name(blocks: &[usize]) -> String {
    match blocks {
        [] => "embedding".into(),
        [one] => format!("kept block {one}"),
        [first, .., last] => format!("kept blocks {first}..={last}"),
    }
}
