//! A shadow of candle 0.9's CPU tensors that allocates nothing but counts bytes: each shadow
//! tensor has a shape, strides, a type, a reference-counted buffer and, like a candle tensor,
//! the op that made it (holding its inputs alive). The ops the model uses allocate exactly where
//! candle allocates (views share their buffer, `contiguous` and `to_dtype` are no-ops when
//! nothing changes), and [`backward`] transcribes candle's `Tensor::backward` as Ava carries
//! it (vendor/candle-core: a node's first gradient is moved in, not added to zeros): the same
//! topological order, the same accumulation and the same gradient expressions, so a gradient
//! computed from a tracked tensor keeps its whole expression alive, as it does in candle. Dropping a shadow tensor frees its bytes when the last reference goes.
//!
//! The estimator runs the model's forward and `forward_backward` on these shadows (see
//! `replay`) and reads the peak off the [`Meter`]. Buffers carry a [`Cat`] so the peak can be
//! broken down by what holds the bytes.
//!
//! A meter [`on_gpu`](Meter::on_gpu) counts device memory as a GPU run allocates it instead:
//! candle's CUDA backend follows the same allocation rules (the same `Tensor` code above the
//! storage), but the engine's ops differ in a few places, each marked where the op is: the
//! attention op hands the kernel its inputs in their own type (no f32 copies) and keeps the
//! saved buffer in f32; the cross-entropy reads the logits in their type and returns their
//! gradient in it; RMSNorm's backward sums dw over blocks of 64 rows in one f32 buffer; the
//! linear layer holds no f32 scratch (`replay`'s `linear`); the chunked LM head's loss sums
//! dW of several blocks in one f32 buffer through cuBLAS ([`T::head_loss`]).

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

/// Element type of a shadow tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dt {
    /// f32.
    F32,
    /// bf16 or f16 (2 bytes).
    Half,
    /// u32 token ids and indices.
    U32,
}

impl Dt {
    /// Bytes per element.
    pub(crate) fn size(self) -> u64 {
        match self {
            Dt::F32 | Dt::U32 => 4,
            Dt::Half => 2,
        }
    }
}

/// What a buffer is, for the breakdown of the peak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Cat {
    /// Parameters, their compute-type casts, rotary tables (outside the micro-batch).
    Params,
    /// Gradient accumulators from earlier micro-batches.
    Accumulators,
    /// The embedding stretch: the looked-up rows and their `Var` copy.
    Embedding,
    /// Forward activations of kept blocks (without the attention kernel's saved buffers).
    Blocks,
    /// The attention kernel's saved buffers.
    AttnSaved,
    /// Inputs of recomputed blocks (the `Var` copies that start each stretch).
    Inputs,
    /// Activations of a block run detached or recomputed in backward.
    Recompute,
    /// Final norm, logits and loss.
    Head,
    /// Gradients of intermediate tensors, the expressions they keep alive, and backward
    /// temporaries.
    Backward,
    /// This micro-batch's parameter gradients.
    ParamGrads,
    /// The attention kernel's workspace, while a forward or backward call runs.
    AttnWorkspace,
    /// The optimizer step's transients: a parameter's f32 scratch, its state from a tier.
    Step,
}

/// Number of [`Cat`] values.
pub(crate) const CATS: usize = 12;

/// Where the peak happened and what held the bytes then.
#[derive(Debug, Clone, Default)]
pub(crate) struct PeakInfo {
    /// Bytes at the peak.
    pub bytes: u64,
    /// Bytes per [`Cat`] at the peak.
    pub by_cat: [u64; CATS],
    /// The phase of the replay (set by the driver).
    pub phase: String,
    /// The backward op being processed, if any.
    pub op: &'static str,
}

/// Counts the bytes the shadow buffers hold.
#[derive(Debug, Default)]
pub(crate) struct Meter {
    cur: Cell<u64>,
    by_cat: RefCell<[u64; CATS]>,
    peak: RefCell<PeakInfo>,
    cat: Cell<Option<Cat>>,
    phase: RefCell<String>,
    op: Cell<&'static str>,
    next_id: Cell<usize>,
    /// Counts a GPU run's device memory (see the module docs).
    gpu: Cell<bool>,
}

impl Meter {
    /// A meter at zero.
    pub(crate) fn new() -> Rc<Self> {
        Rc::new(Self::default())
    }

    /// From now on the ops allocate as a GPU run's do (before anything is counted).
    pub(crate) fn set_gpu(&self) {
        self.gpu.set(true);
    }

    /// Whether the ops allocate as a GPU run's do.
    pub(crate) fn on_gpu(&self) -> bool {
        self.gpu.get()
    }

    /// Bytes held now.
    pub(crate) fn current(&self) -> u64 {
        self.cur.get()
    }

    /// Bytes held now, per category.
    pub(crate) fn current_by_cat(&self) -> [u64; CATS] {
        *self.by_cat.borrow()
    }

    /// The peak since the last [`reset_peak`](Self::reset_peak).
    pub(crate) fn peak(&self) -> PeakInfo {
        self.peak.borrow().clone()
    }

    /// Starts a new peak measurement from the current level.
    pub(crate) fn reset_peak(&self) {
        *self.peak.borrow_mut() = PeakInfo {
            bytes: self.cur.get(),
            by_cat: *self.by_cat.borrow(),
            phase: self.phase.borrow().clone(),
            op: "",
        };
    }

    /// The category new buffers are counted under.
    pub(crate) fn cat(&self) -> Option<Cat> {
        self.cat.get()
    }

    /// New buffers are counted under `cat`.
    pub(crate) fn set_cat(&self, cat: Cat) {
        self.cat.set(Some(cat));
    }

    /// Names what the driver is doing, for the peak report.
    pub(crate) fn set_phase(&self, phase: String) {
        *self.phase.borrow_mut() = phase;
        self.op.set("");
    }

    fn id(&self) -> usize {
        let id = self.next_id.get();
        self.next_id.set(id + 1);
        id
    }

    fn alloc(self: &Rc<Self>, bytes: u64, cat: Option<Cat>) -> Rc<Buf> {
        let cat = cat.or(self.cat.get()).unwrap_or(Cat::Backward);
        let now = self.cur.get() + bytes;
        self.cur.set(now);
        self.by_cat.borrow_mut()[cat as usize] += bytes;
        if now > self.peak.borrow().bytes {
            *self.peak.borrow_mut() = PeakInfo {
                bytes: now,
                by_cat: *self.by_cat.borrow(),
                phase: self.phase.borrow().clone(),
                op: self.op.get(),
            };
        }
        Rc::new(Buf { bytes, cat: Cell::new(cat), meter: self.clone() })
    }
}

/// A host buffer: its bytes are counted while it lives.
#[derive(Debug)]
pub(crate) struct Buf {
    bytes: u64,
    cat: Cell<Cat>,
    meter: Rc<Meter>,
}

impl Buf {
    /// Counts the buffer under another category from now on.
    fn retag(&self, cat: Cat) {
        let old = self.cat.replace(cat);
        let mut by = self.meter.by_cat.borrow_mut();
        by[old as usize] -= self.bytes;
        by[cat as usize] += self.bytes;
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        self.meter.cur.set(self.meter.cur.get() - self.bytes);
        self.meter.by_cat.borrow_mut()[self.cat.get() as usize] -= self.bytes;
    }
}

/// A plain allocation (a `Vec` a kernel or op fills), counted while it lives.
pub(crate) fn raw(meter: &Rc<Meter>, bytes: u64) -> Rc<Buf> {
    meter.alloc(bytes, None)
}

/// The op that made a tensor, holding its inputs (candle's `Op`, for the ops the model uses).
#[derive(Debug)]
enum Op {
    Add(T, T),
    Sub(T, T),
    Mul(T, T),
    Div(T, T),
    Matmul(T, T),
    Transpose(T, usize, usize),
    Reshape(T),
    Copy(T),
    ToDType(T),
    Broadcast(T),
    Narrow(T, usize, usize, usize),
    Cat(Vec<T>, usize),
    Exp(T),
    Sqr(T),
    Affine(T, f64),
    /// Sum over dims; the keepdim shape of the result.
    Sum(T, Vec<usize>),
    /// The fused cross-entropy; it holds a copy of the targets.
    CrossEntropy(T, #[allow(dead_code)] Rc<Buf>), // the buffer is held only to be counted
    /// The attention kernel; it holds the kernel's saved buffer until backward takes it, the
    /// bytes of its backward workspace, and the bytes of the f32 copy backward widens a
    /// half-held saved buffer into (0 when it is held in f32).
    Attention(T, T, T, RefCell<Option<Rc<Buf>>>, u64, u64),
    IndexSelect(T, T, usize),
    IndexAdd(T, T, T, usize),
    Gather(T, T, usize),
    /// One of the engine's fused ops (`model::fused`) on its compute-type inputs.
    Fused(Fused, Vec<T>),
    /// The LM head and the cross-entropy in blocks of rows (`model::head_loss`) on h (N, d)
    /// and W (V, d): it holds a copy of the targets (host memory), the forward's value (a
    /// scalar), and the rows per block.
    HeadLoss(T, T, #[allow(dead_code)] Rc<Buf>, #[allow(dead_code)] T, usize), // held only to be counted
    /// `fused::seed` on a stretch's end: it holds the gradient handed back, in the end's type.
    Seed(T, T),
}

/// The engine's fused ops (`model::fused`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fused {
    /// x Wᵀ (x, w) in f32, multiplied as they are.
    Linear,
    /// x Wᵀ (x, w) in a half type through f32 inside the op: each call (forward, backward)
    /// holds the weight's f32 copy and `scratch` f32s for a step of rows; backward also dW's f32
    /// accumulator.
    LinearHalf {
        /// `fused::linear`'s step scratch, in f32s.
        scratch: u64,
    },
    /// RMSNorm (x, w).
    RmsNorm,
    /// (B·T, C·D) → (B, C, T, D), with or without rotation.
    SplitHeads,
    /// (B, C, T, D) → (B·T, C·D).
    MergeHeads,
    /// silu(g) · u.
    SwiGlu,
    /// The token embedding's rows (table): `fused::embedding`.
    Embedding,
}

impl Op {
    fn name(&self) -> &'static str {
        match self {
            Op::Add(..) => "add",
            Op::Sub(..) => "sub",
            Op::Mul(..) => "mul",
            Op::Div(..) => "div",
            Op::Matmul(..) => "matmul",
            Op::Transpose(..) => "transpose",
            Op::Reshape(..) => "reshape",
            Op::Copy(..) => "copy",
            Op::ToDType(..) => "to_dtype",
            Op::Broadcast(..) => "broadcast",
            Op::Narrow(..) => "narrow",
            Op::Cat(..) => "cat",
            Op::Exp(..) => "exp",
            Op::Sqr(..) => "sqr",
            Op::Affine(..) => "affine",
            Op::Sum(..) => "sum",
            Op::CrossEntropy(..) => "cross-entropy",
            Op::Attention(..) => "attention",
            Op::IndexSelect(..) => "index_select",
            Op::IndexAdd(..) => "index_add",
            Op::Gather(..) => "gather",
            Op::Fused(Fused::Linear | Fused::LinearHalf { .. }, _) => "linear",
            Op::Fused(Fused::RmsNorm, _) => "rms-norm",
            Op::Fused(Fused::SplitHeads, _) => "split-heads",
            Op::Fused(Fused::MergeHeads, _) => "merge-heads",
            Op::Fused(Fused::SwiGlu, _) => "swiglu",
            Op::Fused(Fused::Embedding, _) => "embedding",
            Op::HeadLoss(..) => "lm head + cross-entropy (logits recomputed)",
            Op::Seed(..) => "seed",
        }
    }

    /// The inputs in the order candle's `sorted_nodes` walks them.
    fn args(&self) -> Vec<&T> {
        match self {
            Op::Add(a, b) | Op::Sub(a, b) | Op::Mul(a, b) | Op::Div(a, b) | Op::Matmul(a, b) => vec![a, b],
            Op::IndexSelect(a, b, _) | Op::Gather(a, b, _) | Op::HeadLoss(a, b, ..) => vec![a, b],
            Op::Attention(a, b, c, _, _, _) | Op::IndexAdd(a, b, c, _) => vec![a, b, c],
            Op::Cat(args, _) | Op::Fused(_, args) => args.iter().collect(),
            // Affine with a zero factor would stop the walk; the model never uses one.
            Op::Transpose(a, ..)
            | Op::Reshape(a)
            | Op::Copy(a)
            | Op::ToDType(a)
            | Op::Broadcast(a)
            | Op::Narrow(a, ..)
            | Op::Exp(a)
            | Op::Sqr(a)
            | Op::Affine(a, _)
            | Op::Sum(a, _)
            | Op::CrossEntropy(a, _)
            | Op::Seed(a, _) => vec![a],
        }
    }
}

/// A shadow tensor (cheap to clone, like a candle `Tensor`).
#[derive(Debug, Clone)]
pub(crate) struct T(Rc<Inner>);

#[derive(Debug)]
struct Inner {
    id: usize,
    dims: Vec<usize>,
    strides: Vec<usize>,
    dtype: Dt,
    buf: Rc<Buf>,
    op: Option<Op>,
    var: bool,
    param: bool,
    /// Whether it starts at its buffer's start (no narrowing past its first element).
    at_start: bool,
}

fn contiguous_strides(dims: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * dims[i + 1];
    }
    strides
}

fn numel(dims: &[usize]) -> u64 {
    dims.iter().map(|&d| d as u64).product()
}

impl T {
    /// A fresh contiguous tensor with its own buffer.
    fn fresh(meter: &Rc<Meter>, dims: Vec<usize>, dtype: Dt, op: Option<Op>, var: bool, cat: Option<Cat>) -> T {
        let buf = meter.alloc(numel(&dims) * dtype.size(), cat);
        let strides = contiguous_strides(&dims);
        T(Rc::new(Inner { id: meter.id(), dims, strides, dtype, buf, op, var, param: false, at_start: true }))
    }

    /// A view on this tensor's buffer, from the same start.
    fn view(&self, dims: Vec<usize>, strides: Vec<usize>, op: Option<Op>) -> T {
        self.view_from(dims, strides, op, self.0.at_start)
    }

    /// A view on this tensor's buffer, `at_start` or further in.
    fn view_from(&self, dims: Vec<usize>, strides: Vec<usize>, op: Option<Op>, at_start: bool) -> T {
        let m = &self.0.buf.meter;
        T(Rc::new(Inner {
            id: m.id(),
            dims,
            strides,
            dtype: self.0.dtype,
            buf: self.0.buf.clone(),
            op,
            var: false,
            param: false,
            at_start,
        }))
    }

    /// An untracked contiguous tensor on a buffer already counted.
    fn wrap(dims: Vec<usize>, dtype: Dt, buf: Rc<Buf>) -> T {
        let id = buf.meter.id();
        T(Rc::new(Inner {
            id,
            strides: contiguous_strides(&dims),
            dims,
            dtype,
            buf,
            op: None,
            var: false,
            param: false,
            at_start: true,
        }))
    }

    /// An untracked tensor (`Tensor::zeros`, `Tensor::from_vec`, ...).
    pub(crate) fn new(meter: &Rc<Meter>, dims: &[usize], dtype: Dt) -> T {
        T::fresh(meter, dims.to_vec(), dtype, None, false, None)
    }

    /// A model parameter: an f32 `Var`, counted under [`Cat::Params`].
    pub(crate) fn param(meter: &Rc<Meter>, dims: &[usize]) -> T {
        T::param_as(meter, dims, Dt::F32)
    }

    /// A model parameter stored as `dtype`.
    pub(crate) fn param_as(meter: &Rc<Meter>, dims: &[usize], dtype: Dt) -> T {
        let t = T::fresh(meter, dims.to_vec(), dtype, None, true, Some(Cat::Params));
        let mut inner = Rc::try_unwrap(t.0).expect("fresh tensor");
        inner.param = true;
        T(Rc::new(inner))
    }

    /// `Var::from_tensor` of a tensor that is not a `Var`: a copy that is a `Var`.
    pub(crate) fn make_var(&self) -> T {
        if self.0.var {
            return self.clone();
        }
        T::fresh(&self.0.buf.meter, self.0.dims.clone(), self.0.dtype, None, true, None)
    }

    fn meter(&self) -> &Rc<Meter> {
        &self.0.buf.meter
    }

    /// The dimensions.
    pub(crate) fn dims(&self) -> &[usize] {
        &self.0.dims
    }

    /// The element type.
    pub(crate) fn dtype(&self) -> Dt {
        self.0.dtype
    }

    fn elem_count(&self) -> u64 {
        numel(&self.0.dims)
    }

    /// candle's rule: strides match row-major order on every dimension larger than 1.
    fn is_contiguous(&self) -> bool {
        let mut acc = 1;
        for (&stride, &dim) in self.0.strides.iter().zip(&self.0.dims).rev() {
            if dim > 1 && stride != acc {
                return false;
            }
            acc *= dim;
        }
        true
    }

    fn tracks(&self) -> bool {
        self.0.var || self.0.op.is_some()
    }

    /// `Some(op)` when any input tracks gradients (candle's `BackpropOp::new`).
    fn op_if(args: &[&T], op: impl FnOnce() -> Op) -> Option<Op> {
        args.iter().any(|a| a.tracks()).then(op)
    }

    fn out(&self, dims: Vec<usize>, dtype: Dt, op: Option<Op>) -> T {
        T::fresh(self.meter(), dims, dtype, op, false, None)
    }

    /// `detach`: the same buffer, no op.
    pub(crate) fn detach(&self) -> T {
        if self.0.op.is_none() && !self.0.var {
            return self.clone();
        }
        self.view(self.0.dims.clone(), self.0.strides.clone(), None)
    }

    pub(crate) fn reshape(&self, dims: &[usize]) -> T {
        let op = T::op_if(&[self], || Op::Reshape(self.clone()));
        if self.is_contiguous() {
            self.view(dims.to_vec(), contiguous_strides(dims), op)
        } else {
            self.out(dims.to_vec(), self.0.dtype, op)
        }
    }

    pub(crate) fn transpose(&self, a: usize, b: usize) -> T {
        if a == b {
            return self.clone();
        }
        let (mut dims, mut strides) = (self.0.dims.clone(), self.0.strides.clone());
        dims.swap(a, b);
        strides.swap(a, b);
        let op = T::op_if(&[self], || Op::Transpose(self.clone(), a, b));
        self.view(dims, strides, op)
    }

    /// Transpose of the last two dimensions.
    pub(crate) fn t(&self) -> T {
        let r = self.0.dims.len();
        self.transpose(r - 2, r - 1)
    }

    pub(crate) fn narrow(&self, dim: usize, start: usize, len: usize) -> T {
        if start == 0 && len == self.0.dims[dim] {
            return self.clone();
        }
        let mut dims = self.0.dims.clone();
        dims[dim] = len;
        let op = T::op_if(&[self], || Op::Narrow(self.clone(), dim, start, len));
        self.view_from(dims, self.0.strides.clone(), op, self.0.at_start && start == 0)
    }

    pub(crate) fn broadcast_as(&self, dims: &[usize]) -> T {
        let left = dims.len() - self.0.dims.len();
        let mut strides = vec![0; dims.len()];
        for (i, (&d, &s)) in self.0.dims.iter().zip(&self.0.strides).enumerate() {
            strides[left + i] = if d == 1 && dims[left + i] != 1 { 0 } else { s };
        }
        let op = T::op_if(&[self], || Op::Broadcast(self.clone()));
        self.view(dims.to_vec(), strides, op)
    }

    /// `unsqueeze`: a reshape view.
    pub(crate) fn unsqueeze(&self, dim: usize) -> T {
        let mut dims = self.0.dims.clone();
        dims.insert(dim, 1);
        let mut strides = self.0.strides.clone();
        let stride = if dim < strides.len() { strides[dim] } else { 1 };
        strides.insert(dim, stride);
        let op = T::op_if(&[self], || Op::Reshape(self.clone()));
        self.view(dims, strides, op)
    }

    pub(crate) fn contiguous(&self) -> T {
        if self.is_contiguous() {
            return self.clone();
        }
        self.force_contiguous()
    }

    /// `force_contiguous`: always a copy.
    fn force_contiguous(&self) -> T {
        let op = T::op_if(&[self], || Op::Copy(self.clone()));
        self.out(self.0.dims.clone(), self.0.dtype, op)
    }

    pub(crate) fn to_dtype(&self, dtype: Dt) -> T {
        if dtype == self.0.dtype {
            return self.clone();
        }
        let op = T::op_if(&[self], || Op::ToDType(self.clone()));
        self.out(self.0.dims.clone(), dtype, op)
    }

    fn unary(&self, op: impl FnOnce(T) -> Op) -> T {
        let op = T::op_if(&[self], || op(self.clone()));
        self.out(self.0.dims.clone(), self.0.dtype, op)
    }

    pub(crate) fn exp(&self) -> T {
        self.unary(Op::Exp)
    }
    pub(crate) fn sqr(&self) -> T {
        self.unary(Op::Sqr)
    }
    /// `x · mul + add` (also `x + f64`, `x · f64`, `f64 − x`).
    pub(crate) fn affine(&self, mul: f64) -> T {
        self.unary(|a| Op::Affine(a, mul))
    }

    fn binary(&self, rhs: &T, op: impl FnOnce(T, T) -> Op) -> T {
        debug_assert_eq!(self.0.dims, rhs.0.dims, "binary op shapes");
        let op = T::op_if(&[self, rhs], || op(self.clone(), rhs.clone()));
        self.out(self.0.dims.clone(), self.0.dtype, op)
    }

    pub(crate) fn add(&self, rhs: &T) -> T {
        self.binary(rhs, Op::Add)
    }
    pub(crate) fn sub(&self, rhs: &T) -> T {
        self.binary(rhs, Op::Sub)
    }
    pub(crate) fn mul(&self, rhs: &T) -> T {
        self.binary(rhs, Op::Mul)
    }
    pub(crate) fn div(&self, rhs: &T) -> T {
        self.binary(rhs, Op::Div)
    }

    fn broadcast_binary(&self, rhs: &T, f: fn(&T, &T) -> T) -> T {
        let (l, r) = (&self.0.dims, &rhs.0.dims);
        let rank = l.len().max(r.len());
        let at = |d: &[usize], i: usize| if i + d.len() >= rank { d[i + d.len() - rank] } else { 1 };
        let shape: Vec<usize> = (0..rank).map(|i| at(l, i).max(at(r, i))).collect();
        match (&shape != l, &shape != r) {
            (true, true) => f(&self.broadcast_as(&shape), &rhs.broadcast_as(&shape)),
            (false, true) => f(self, &rhs.broadcast_as(&shape)),
            (true, false) => f(&self.broadcast_as(&shape), rhs),
            (false, false) => f(self, rhs),
        }
    }

    pub(crate) fn broadcast_mul(&self, rhs: &T) -> T {
        self.broadcast_binary(rhs, T::mul)
    }
    pub(crate) fn broadcast_div(&self, rhs: &T) -> T {
        self.broadcast_binary(rhs, T::div)
    }
    pub(crate) fn broadcast_sub(&self, rhs: &T) -> T {
        self.broadcast_binary(rhs, T::sub)
    }
    pub(crate) fn broadcast_add(&self, rhs: &T) -> T {
        self.broadcast_binary(rhs, T::add)
    }

    /// 2-D matmul: (m, k) × (k, n) → (m, n).
    pub(crate) fn matmul(&self, rhs: &T) -> T {
        let (m, n) = (self.0.dims[0], rhs.0.dims[1]);
        let op = T::op_if(&[self, rhs], || Op::Matmul(self.clone(), rhs.clone()));
        self.out(vec![m, n], self.0.dtype, op)
    }

    pub(crate) fn sum_keepdim(&self, dims: &[usize]) -> T {
        let mut out = self.0.dims.clone();
        for &d in dims {
            out[d] = 1;
        }
        let op = T::op_if(&[self], || Op::Sum(self.clone(), out.clone()));
        self.out(out, self.0.dtype, op)
    }

    /// `sum_all`: a keepdim sum squeezed to a scalar.
    pub(crate) fn sum_all(&self) -> T {
        let all: Vec<usize> = (0..self.0.dims.len()).collect();
        self.sum_keepdim(&all).reshape(&[])
    }

    /// `max_keepdim(D::Minus1).detach()`: the row maxima, untracked.
    pub(crate) fn max_keepdim_last_detached(&self) -> T {
        let mut dims = self.0.dims.clone();
        *dims.last_mut().expect("rank ≥ 1") = 1;
        T::new(self.meter(), &dims, self.0.dtype)
    }

    pub(crate) fn zeros_like(&self) -> T {
        T::new(self.meter(), &self.0.dims, self.0.dtype)
    }

    pub(crate) fn index_select(&self, ids: &T, dim: usize) -> T {
        let mut dims = self.0.dims.clone();
        dims[dim] = ids.0.dims[0];
        let op = T::op_if(&[self, ids], || Op::IndexSelect(self.clone(), ids.clone(), dim));
        self.out(dims, self.0.dtype, op)
    }

    pub(crate) fn index_add(&self, ids: &T, src: &T, dim: usize) -> T {
        let op = T::op_if(&[self, ids, src], || Op::IndexAdd(self.clone(), ids.clone(), src.clone(), dim));
        self.out(self.0.dims.clone(), self.0.dtype, op)
    }

    pub(crate) fn gather(&self, ids: &T, dim: usize) -> T {
        let op = T::op_if(&[self, ids], || Op::Gather(self.clone(), ids.clone(), dim));
        self.out(ids.0.dims.clone(), self.0.dtype, op)
    }

    /// `scatter_add` onto a copy of `self` (only in backward, untracked there).
    fn scatter_add(&self, _ids: &T, _src: &T, _dim: usize) -> T {
        self.out(self.0.dims.clone(), self.0.dtype, None)
    }

    /// The fused cross-entropy op on (N, V) logits (f32 on the host, their own type on a
    /// GPU): (N,) per-row f32 losses; the op keeps a copy of the targets (N u32), in host
    /// memory on a GPU run, whose forward copies them to the device for its call.
    pub(crate) fn cross_entropy_rows(&self) -> T {
        let n = self.0.dims[0];
        let m = self.meter();
        let targets = if m.on_gpu() {
            drop(raw(m, n as u64 * 4)); // (N,) u32 on the device during the call
            raw(m, 0)
        } else {
            raw(m, n as u64 * 4)
        };
        let op = T::op_if(&[self], || Op::CrossEntropy(self.clone(), targets));
        self.out(vec![n], Dt::F32, op)
    }

    /// A fused op on contiguous inputs of the stored type: a fresh output of `dims` in the
    /// first input's type. The half linear op also holds the weight's f32 copy and its step
    /// scratch while it runs.
    pub(crate) fn fused(kind: Fused, args: &[&T], dims: &[usize]) -> T {
        let m = args[0].meter();
        let scratch = match kind {
            Fused::LinearHalf { scratch } => Some((raw(m, args[1].elem_count() * 4), raw(m, scratch * 4))),
            _ => None,
        };
        let op = T::op_if(args, || Op::Fused(kind, args.iter().map(|a| (*a).clone()).collect()));
        let out = args[0].out(dims.to_vec(), args[0].0.dtype, op);
        drop(scratch);
        out
    }

    /// `model::head_loss`'s op on h (N, d) and W (V, d), after its forward computed `value`
    /// (the f32 scalar) block by block on detached inputs: the op holds a copy of the N
    /// targets (host memory: not counted on a GPU) and the value, and returns a copy of the
    /// value. Backward runs the blocks again (see [`backward`]).
    pub(crate) fn head_loss(h: &T, w: &T, value: T, chunk_rows: usize) -> T {
        let m = h.meter();
        let n = h.0.dims[0] as u64;
        let targets = if m.on_gpu() { raw(m, 0) } else { raw(m, n * 4) };
        let op = T::op_if(&[h, w], || Op::HeadLoss(h.clone(), w.clone(), targets, value, chunk_rows));
        h.out(vec![], Dt::F32, op)
    }

    /// `fused::seed(out, grad)`: an f32 scalar whose op holds `grad` (detached, in `out`'s
    /// type).
    pub(crate) fn seed(out: &T, grad: &T) -> T {
        let grad = grad.detach().to_dtype(out.0.dtype);
        let op = T::op_if(&[out], || Op::Seed(out.clone(), grad.clone()));
        out.out(vec![], Dt::F32, op)
    }

    /// The attention op on contiguous q, k, v of one type: the output (q's shape and type)
    /// and the kernel's saved buffer of `saved_len` f32s (counted under [`Cat::AttnSaved`]),
    /// held by the op, in the half type when the inputs are half and `saved_half` (the
    /// kernel tolerates it); `workspace` is the f32s the kernel declared for its forward and
    /// backward call (counted under [`Cat::AttnWorkspace`] while the call runs). Half inputs
    /// are widened to f32 buffers that live through the kernel call.
    pub(crate) fn attention(q: &T, k: &T, v: &T, saved_len: u64, saved_half: bool, workspace: [u64; 2]) -> T {
        let m = q.meter();
        let dtype = q.0.dtype;
        if m.on_gpu() {
            return T::attention_gpu(q, k, v, saved_len, workspace);
        }
        // cpu_fwd widens q, k, v (half), allocates the f32 `out`, then `saved`, then the
        // workspace, freed when the kernel returns; then rounds `out` into the stored type and
        // frees the f32 buffers.
        let widened = (dtype != Dt::F32).then(|| [q, k, v].map(|x| raw(m, x.elem_count() * 4)));
        let out32 = m.alloc(q.elem_count() * 4, None);
        let saved = m.alloc(saved_len * 4, Some(Cat::AttnSaved));
        drop(m.alloc(workspace[0] * 4, Some(Cat::AttnWorkspace)));
        // A saved buffer held in the half type: rounded into its own buffer, the f32 freed.
        let saved_half = saved_half && dtype == Dt::Half;
        let saved = if saved_half {
            let held = m.alloc(saved_len * dtype.size(), Some(Cat::AttnSaved));
            drop(saved);
            held
        } else {
            saved
        };
        let out_buf = if dtype == Dt::F32 {
            out32
        } else {
            let out = m.alloc(q.elem_count() * dtype.size(), None);
            drop((out32, widened));
            out
        };
        let (bwd, widen) = (workspace[1] * 4, if saved_half { saved_len * 4 } else { 0 });
        let op = T::op_if(&[q, k, v], || {
            Op::Attention(q.clone(), k.clone(), v.clone(), RefCell::new(Some(saved)), bwd, widen)
        });
        let dims = q.0.dims.clone();
        T(Rc::new(Inner {
            id: m.id(),
            strides: contiguous_strides(&dims),
            dims,
            dtype,
            buf: out_buf,
            op,
            var: false,
            param: false,
            at_start: true,
        }))
    }
}

impl T {
    /// The attention op on a GPU (`cuda_fwd`): the output in q's type, the saved buffer in
    /// f32 (held by the op until backward takes it), the forward workspace while the kernel
    /// runs; no f32 copies of the inputs.
    fn attention_gpu(q: &T, k: &T, v: &T, saved_len: u64, workspace: [u64; 2]) -> T {
        let m = q.meter();
        let out = m.alloc(q.elem_count() * q.0.dtype.size(), None); // (B, H, T, D) in q's type
        let saved = m.alloc(saved_len * 4, Some(Cat::AttnSaved)); // e.g. (B, H, T) f32
        drop(m.alloc(workspace[0] * 4, Some(Cat::AttnWorkspace)));
        let op = T::op_if(&[q, k, v], || {
            Op::Attention(q.clone(), k.clone(), v.clone(), RefCell::new(Some(saved)), workspace[1] * 4, 0)
        });
        let dims = q.0.dims.clone();
        T(Rc::new(Inner {
            id: m.id(),
            strides: contiguous_strides(&dims),
            dims,
            dtype: q.0.dtype,
            buf: out,
            op,
            var: false,
            param: false,
            at_start: true,
        }))
    }
}

/// `Tensor::cat` (candle's three paths: all contiguous, along dim 0, or by transposing to 0).
pub(crate) fn cat(args: &[&T], dim: usize) -> T {
    let arg0 = args[0];
    if args.len() == 1 {
        return arg0.clone();
    }
    let total: usize = args.iter().map(|a| a.0.dims[dim]).sum();
    if args.iter().all(|a| a.is_contiguous()) || dim == 0 {
        let mut dims = arg0.0.dims.clone();
        dims[dim] = total;
        let op = T::op_if(args, || Op::Cat(args.iter().map(|a| (*a).clone()).collect(), dim));
        return arg0.out(dims, arg0.0.dtype, op);
    }
    let moved: Vec<T> = args.iter().map(|a| a.transpose(0, dim)).collect();
    let refs: Vec<&T> = moved.iter().collect();
    cat(&refs, 0).transpose(0, dim)
}

/// Gradients by tensor id (candle's `GradStore`).
#[derive(Debug, Default)]
pub(crate) struct GradStore(HashMap<usize, T>);

impl GradStore {
    /// Removes and returns the gradient of `t`.
    pub(crate) fn remove(&mut self, t: &T) -> Option<T> {
        self.0.remove(&t.0.id)
    }

    /// The patched candle's `accumulate`: the first gradient of `arg` is `g` itself (a copy
    /// when it is not contiguous from its buffer's start), a later one the sum of the two. A
    /// parameter's gradient is counted under [`Cat::ParamGrads`].
    fn accumulate(&mut self, arg: &T, g: T) {
        self.combine(arg, g, T::add);
    }

    /// `accumulate_neg`: the first is `-g` (a fresh tensor), a later one the difference.
    fn accumulate_neg(&mut self, arg: &T, g: T) {
        match self.0.contains_key(&arg.0.id) {
            true => self.combine(arg, g, T::sub),
            false => self.combine(arg, g.affine(-1.0), T::sub),
        }
    }

    /// `accumulate_copy` (a piece of a concatenation's gradient): the first always copied.
    fn accumulate_copy(&mut self, arg: &T, g: T) {
        match self.0.contains_key(&arg.0.id) {
            true => self.combine(arg, g, T::add),
            false => self.combine(arg, g.force_contiguous(), T::add),
        }
    }

    fn combine(&mut self, arg: &T, g: T, sum: fn(&T, &T) -> T) {
        let new = match self.0.remove(&arg.0.id) {
            Some(old) => sum(&old, &g),
            None if g.is_contiguous() && g.0.at_start => g,
            None => g.force_contiguous(),
        };
        self.store(arg, new);
    }

    /// `*or_insert(arg) = f(old)`, zeros first when absent: the ops whose gradient scatters
    /// into a base (`index_add`, `scatter_add`), which the patch leaves as they were.
    fn accumulate_into(&mut self, arg: &T, f: impl FnOnce(&T) -> T) {
        let old = match self.0.remove(&arg.0.id) {
            Some(g) => g,
            None => arg.zeros_like(),
        };
        let new = f(&old);
        drop(old);
        self.store(arg, new);
    }

    fn store(&mut self, arg: &T, grad: T) {
        if arg.0.param {
            grad.0.buf.retag(Cat::ParamGrads);
        }
        self.0.insert(arg.0.id, grad);
    }
}

/// candle's `sorted_nodes`: a depth-first walk from `root` over the tensors that lead to a
/// `Var`, in post-order, reversed (iterative, so deep graphs do not exhaust the stack).
fn sorted_nodes(root: &T) -> Vec<T> {
    struct Frame {
        node: T,
        next: usize,
        track: bool,
    }
    let mut seen: HashMap<usize, bool> = HashMap::new();
    let mut nodes = Vec::new();
    let mut stack = vec![Frame { node: root.clone(), next: 0, track: root.0.var }];
    while let Some(frame) = stack.last_mut() {
        let node = frame.node.clone();
        // Vars are leaves; integer tensors do not take part.
        let args: Vec<&T> = match (&node.0.op, node.0.var, node.0.dtype) {
            (Some(op), false, Dt::F32 | Dt::Half) => op.args(),
            _ => Vec::new(),
        };
        if frame.next < args.len() {
            let child = args[frame.next].clone();
            frame.next += 1;
            match seen.get(&child.0.id) {
                Some(&tg) => frame.track |= tg,
                None => stack.push(Frame { track: child.0.var, node: child, next: 0 }),
            }
            continue;
        }
        let done = stack.pop().expect("non-empty");
        seen.insert(done.node.0.id, done.track);
        if done.track {
            nodes.push(done.node.clone());
        }
        if let Some(parent) = stack.last_mut() {
            parent.track |= done.track;
        }
    }
    nodes.reverse();
    nodes
}

/// candle's `Tensor::backward` for the ops the model uses, with the same allocations and the
/// same lifetimes (see the module docs). Each node's step is [`backward_op`].
pub(crate) fn backward(root: &T) -> GradStore {
    let meter = root.meter().clone();
    let sorted = sorted_nodes(root);
    let mut grads = GradStore::default();
    grads.0.insert(root.0.id, root.zeros_like()); // ones_like().contiguous()
    for node in &sorted {
        if node.0.var {
            continue;
        }
        let grad0 = grads.remove(node).expect("gradient populated in topological order");
        let grad = grad0.detach();
        let Some(op) = &node.0.op else { continue };
        meter.op.set(op.name());
        backward_op(&meter, &mut grads, node, op, &grad);
    }
    meter.op.set("");
    grads
}

/// One node's step of [`backward`]: the gradients of `op`'s inputs from the node's gradient
/// `grad` (detached), added into `grads` in candle's order. The longer cases are the
/// functions below.
fn backward_op(meter: &Rc<Meter>, grads: &mut GradStore, node: &T, op: &Op, grad: &T) {
    match op {
        Op::Add(lhs, rhs) => {
            grads.accumulate(lhs, grad.clone());
            grads.accumulate(rhs, grad.clone());
        }
        Op::Sub(lhs, rhs) => {
            grads.accumulate(lhs, grad.clone());
            grads.accumulate_neg(rhs, grad.clone());
        }
        Op::Mul(lhs, rhs) => {
            let lhs_grad = grad.mul(rhs);
            grads.accumulate(lhs, lhs_grad);
            let rhs_grad = grad.mul(lhs);
            grads.accumulate(rhs, rhs_grad);
        }
        Op::Div(lhs, rhs) => {
            let lhs_grad = grad.div(rhs);
            grads.accumulate(lhs, lhs_grad);
            let rhs_grad = grad.mul(lhs).div(&rhs.sqr());
            grads.accumulate_neg(rhs, rhs_grad);
        }
        Op::Matmul(lhs, rhs) => {
            let lhs_grad = grad.matmul(&rhs.t());
            grads.accumulate(lhs, lhs_grad);
            let rhs_grad = lhs.t().matmul(grad);
            grads.accumulate(rhs, rhs_grad);
        }
        Op::Cat(args, dim) => cat_backward(grads, grad, args, *dim),
        Op::Broadcast(arg) => broadcast_backward(grads, node, grad, arg),
        Op::Sum(arg, reduced) => sum_backward(grads, node, grad, arg, reduced),
        Op::ToDType(arg) => grads.accumulate(arg, grad.to_dtype(arg.0.dtype)),
        Op::Copy(arg) => grads.accumulate(arg, grad.clone()),
        Op::Affine(arg, mul) => {
            let arg_grad = grad.affine(*mul);
            grads.accumulate(arg, arg_grad);
        }
        Op::Exp(arg) => grads.accumulate(arg, grad.mul(node)),
        Op::Narrow(arg, dim, start, len) => {
            let arg_grad = narrow_grad(meter, grad, arg, *dim, *start, *len);
            grads.accumulate(arg, arg_grad);
        }
        Op::Reshape(arg) => {
            let arg_grad = grad.reshape(&arg.0.dims);
            grads.accumulate(arg, arg_grad);
        }
        Op::Transpose(arg, a, b) => {
            let arg_grad = grad.transpose(*a, *b);
            grads.accumulate(arg, arg_grad);
        }
        Op::Sqr(arg) => {
            let arg_grad = arg.mul(grad).affine(2.0);
            grads.accumulate(arg, arg_grad);
        }
        Op::CrossEntropy(arg, _) => {
            let arg_grad = cross_entropy_grad(meter, arg);
            grads.accumulate(arg, arg_grad);
        }
        Op::Seed(out, held) => {
            // `bwd`: the held gradient times the upstream scalar (in its type), a fresh
            // (B, T, d).
            let arg_grad = held.broadcast_mul(&grad.to_dtype(held.0.dtype));
            grads.accumulate(out, arg_grad);
        }
        Op::HeadLoss(h, w, _, _, chunk_rows) => {
            let (dh, dw) = head_loss_backward(meter, h, w, *chunk_rows);
            grads.accumulate(h, dh);
            grads.accumulate(w, dw);
        }
        Op::Attention(q, k, v, saved, workspace, _) if meter.on_gpu() => {
            let (dq, dk, dv) = attention_grads_gpu(meter, [q, k, v], saved, *workspace);
            grads.accumulate(q, dq);
            grads.accumulate(k, dk);
            grads.accumulate(v, dv);
        }
        Op::Attention(q, k, v, saved, workspace, widen) => {
            let (dq, dk, dv) = attention_grads_host(meter, node, grad, [q, k, v], saved, *workspace, *widen);
            grads.accumulate(q, dq);
            grads.accumulate(k, dk);
            grads.accumulate(v, dv);
        }
        Op::IndexSelect(arg, ids, dim) => grads.accumulate_into(arg, |s| s.index_add(ids, grad, *dim)),
        Op::IndexAdd(init, ids, src, dim) => {
            grads.accumulate(init, grad.clone());
            let src_grad = grad.index_select(ids, *dim);
            grads.accumulate(src, src_grad);
        }
        Op::Gather(arg, ids, dim) => grads.accumulate_into(arg, |s| s.scatter_add(ids, grad, *dim)),
        Op::Fused(kind, args) => fused_backward(meter, grads, node, grad, *kind, args),
    }
}

/// A concatenation's backward: each input's piece of `grad` (a narrowed view), copied in.
fn cat_backward(grads: &mut GradStore, grad: &T, args: &[T], dim: usize) {
    let mut start = 0;
    for arg in args {
        let len = arg.0.dims[dim];
        let arg_grad = grad.narrow(dim, start, len);
        grads.accumulate_copy(arg, arg_grad);
        start += len;
    }
}

/// A broadcast's backward: `grad` summed over the broadcast dims (the leading ones dropped),
/// as a view of `arg`'s shape.
fn broadcast_backward(grads: &mut GradStore, node: &T, grad: &T, arg: &T) {
    let (a, n) = (&arg.0.dims, &node.0.dims);
    let left = n.len() - a.len();
    let mut sum_dims: Vec<usize> = (0..left).collect();
    sum_dims.extend((0..a.len()).filter(|&i| n[left + i] != a[i]).map(|i| i + left));
    let mut arg_grad = grad.sum_keepdim(&sum_dims);
    for _ in 0..left {
        arg_grad = arg_grad.reshape(&arg_grad.0.dims[1..]);
    }
    grads.accumulate(arg, arg_grad.broadcast_as(&arg.0.dims));
}

/// A sum's backward: `grad` (reshaped to the keepdim shape `reduced` when the sum dropped
/// dims) broadcast back to `arg`'s shape.
fn sum_backward(grads: &mut GradStore, node: &T, grad: &T, arg: &T, reduced: &[usize]) {
    let g = if arg.0.dims.len() == node.0.dims.len() {
        grad.broadcast_as(&arg.0.dims)
    } else {
        grad.reshape(reduced).broadcast_as(&arg.0.dims)
    };
    grads.accumulate(arg, g);
}

/// A narrowing's gradient: `grad` between fresh zero pads to `arg`'s length along `dim`,
/// concatenated (the pads freed when it returns).
fn narrow_grad(meter: &Rc<Meter>, grad: &T, arg: &T, dim: usize, start: usize, len: usize) -> T {
    let mut parts: Vec<T> = Vec::new();
    let pad = |n: usize| {
        let mut dims = arg.0.dims.clone();
        dims[dim] = n;
        T::new(meter, &dims, grad.0.dtype)
    };
    let right = arg.0.dims[dim] - start - len;
    let left_pad = (start > 0).then(|| pad(start));
    let right_pad = (right > 0).then(|| pad(right));
    parts.extend(left_pad);
    parts.push(grad.clone());
    parts.extend(right_pad);
    let refs: Vec<&T> = parts.iter().collect();
    cat(&refs, dim)
}

/// The fused cross-entropy's gradient of the logits `arg`.
fn cross_entropy_grad(meter: &Rc<Meter>, arg: &T) -> T {
    // `ops::cross_entropy_grad`: the (N, V) gradient in the logits' type, while
    // the upstream gradients are read into a Vec on the host (N f32), or the
    // targets are copied to the device on a GPU; both freed when it returns.
    let _rows_or_targets = raw(meter, arg.0.dims[0] as u64 * 4);
    T::new(meter, &arg.0.dims, arg.0.dtype)
}

/// The attention op's backward on a GPU: the gradients of q, k, v.
fn attention_grads_gpu(
    meter: &Rc<Meter>,
    [q, k, v]: [&T; 3],
    saved: &RefCell<Option<Rc<Buf>>>,
    workspace: u64,
) -> (T, T, T) {
    // `cuda_bwd`: zeroed gradients in the inputs' types, then the workspace for
    // the kernel's call; the saved buffer is freed when it returns.
    let saved = saved.borrow_mut().take();
    let [dq, dk, dv] = [q, k, v].map(|x| T::new(meter, &x.0.dims, x.0.dtype));
    drop((meter.alloc(workspace, Some(Cat::AttnWorkspace)), saved));
    (dq, dk, dv)
}

/// The attention op's backward on the host: the gradients of q, k, v, computed in f32 (with
/// the saved buffer widened first when it is held in half, `widen` bytes) and rounded into
/// the inputs' types.
fn attention_grads_host(
    meter: &Rc<Meter>,
    node: &T,
    grad: &T,
    [q, k, v]: [&T; 3],
    saved: &RefCell<Option<Rc<Buf>>>,
    workspace: u64,
    widen: u64,
) -> (T, T, T) {
    let saved = saved.borrow_mut().take();
    // A half-held saved buffer is widened first, the half copy freed.
    let saved = if widen > 0 {
        let wide = raw(meter, widen);
        drop(saved);
        Some(wide)
    } else {
        saved
    };
    let dq = raw(meter, q.elem_count() * 4);
    let dk = raw(meter, k.elem_count() * 4);
    let dv = raw(meter, v.elem_count() * 4);
    // The backward's workspace lives through the kernel call, and so do, for
    // half inputs, f32 copies of q, k, v, the output and its gradient.
    let ws = meter.alloc(workspace, Some(Cat::AttnWorkspace));
    let widened = (q.0.dtype != Dt::F32).then(|| [q, k, v, node, grad].map(|x| raw(meter, x.elem_count() * 4)));
    drop((widened, ws, saved));
    // Each gradient rounded into its input's type, the f32 one freed then.
    let grad_of = |arg: &T, buf: Rc<Buf>| {
        if arg.0.dtype == Dt::F32 {
            return T::wrap(arg.0.dims.clone(), Dt::F32, buf);
        }
        let g = T::new(meter, &arg.0.dims, arg.0.dtype);
        drop(buf);
        g
    };
    (grad_of(q, dq), grad_of(k, dk), grad_of(v, dv))
}

/// A fused op's backward: a fresh gradient per input (by kind, below), each added in turn.
fn fused_backward(meter: &Rc<Meter>, grads: &mut GradStore, node: &T, grad: &T, kind: Fused, args: &[T]) {
    // bwd returns a fresh gradient per input, in the input's type; RMSNorm also
    // fills one f32 partial dw per task of 64 rows (with its Vec header) while dx
    // is held; the half linear op holds its step scratch while it computes dx and
    // dW, the weight's f32 copy while it computes dx, and dW's f32 accumulator
    // while it computes and rounds dW.
    let arg_grads: Vec<T> = match kind {
        Fused::LinearHalf { scratch } => linear_half_grads(meter, args, scratch),
        Fused::Linear if !meter.on_gpu() => linear_grads_host(meter, grad, args),
        Fused::Embedding => embedding_grads(meter, node, args),
        Fused::RmsNorm => rms_norm_grads(meter, args),
        _ => args.iter().map(|arg| T::new(meter, &arg.0.dims, arg.0.dtype)).collect(),
    };
    // candle adds each returned gradient and drops it before the next
    // (`if let Some(g) = ..` moves it), the later ones still held.
    let mut rest = arg_grads.into_iter();
    for arg in args {
        let g = rest.next().expect("a gradient per input");
        grads.accumulate(arg, g);
    }
}

/// The half linear op's [dx, dW]: `linear_backward` (scratch and dW's f32 sum), then the sum
/// rounded.
fn linear_half_grads(meter: &Rc<Meter>, args: &[T], scratch: u64) -> Vec<T> {
    let (x, w) = (&args[0], &args[1]);
    let scratch = raw(meter, scratch * 4);
    let wf = raw(meter, w.elem_count() * 4);
    // gemm's packed copy of each thread's share of a step of g (below),
    // when x is wide enough for it to copy one.
    let step_of_g = crate::model::fused::half_scratch_len(x.0.dims[0], 0, w.0.dims[0]) as u64;
    let packs = crate::model::fused::gemm_packs_output_grad(x.0.dims[1]);
    let packed = packs.then(|| raw(meter, step_of_g * 4));
    let dx = T::new(meter, &x.0.dims, x.0.dtype);
    drop((packed, wf));
    let dw32 = raw(meter, w.elem_count() * 4);
    drop(scratch);
    let dw = T::new(meter, &w.0.dims, w.0.dtype);
    drop(dw32);
    vec![dx, dw]
}

/// The f32 linear op's [dx, dW] on the host.
fn linear_grads_host(meter: &Rc<Meter>, grad: &T, args: &[T]) -> Vec<T> {
    // gemm copies each thread's share of g into a buffer of its own for
    // dW = gᵀ·x when x is wide enough for its kernels
    // (`fused::gemm_packs_output_grad`): all of it when it has few rows,
    // a block of columns of it when more. Counted whole, around dx: an
    // upper bound (seen: exact at 512 rows of 4096 columns, twice what
    // gemm took at 2048).
    let (x, w) = (&args[0], &args[1]);
    let packs = crate::model::fused::gemm_packs_output_grad(x.0.dims[1]);
    let packed = packs.then(|| raw(meter, grad.elem_count() * grad.0.dtype.size()));
    let dx = T::new(meter, &x.0.dims, x.0.dtype);
    drop(packed);
    vec![dx, T::new(meter, &w.0.dims, w.0.dtype)]
}

/// The token embedding's [dW].
fn embedding_grads(meter: &Rc<Meter>, node: &T, args: &[T]) -> Vec<T> {
    // The positions sorted by token: offsets (V + 1) and order (N), u32 (on
    // the host, with the sort's cursor (V + 1) while it sorts; on a GPU
    // both copied to the device), held while dW (V, d), fresh in the
    // table's type, is summed. (The N ids the op keeps on the host from
    // forward are not counted: 4 bytes a token.)
    let table = &args[0];
    let (v, n) = (table.0.dims[0] as u64, node.0.dims[0] as u64);
    let sorted = raw(meter, (v + 1 + n) * 4);
    if !meter.on_gpu() {
        drop(raw(meter, (v + 1) * 4));
    }
    let dw = T::new(meter, &table.0.dims, table.0.dtype);
    drop(sorted);
    vec![dw]
}

/// RMSNorm's [dx, dw], with dw summed from per-task partials.
fn rms_norm_grads(meter: &Rc<Meter>, args: &[T]) -> Vec<T> {
    let (x, w) = (&args[0], &args[1]);
    let dx = T::new(meter, &x.0.dims, x.0.dtype);
    let d = *x.0.dims.last().expect("rows");
    let tasks = (x.elem_count() / d as u64).div_ceil(64);
    // One Vec per task on the host; one (blocks, d) f32 buffer on a GPU.
    let header = if meter.on_gpu() { 0 } else { 24 };
    let partial = raw(meter, tasks * (d as u64 * 4 + header));
    let dw = T::new(meter, &w.0.dims, w.0.dtype);
    drop(partial);
    vec![dx, dw]
}

/// `model::head_loss`'s backward on the host or a GPU (the meter's): per block of rows, the
/// logits again (`fused::linear` on detached inputs), their gradient in the compute type
/// (`ops::cross_entropy_grad`, which reads the per-row upstream gradients into a Vec on the
/// host, or copies them and the targets to the device), the logits freed, then dh by the
/// linear layer's backward (`fused::linear_backward`: the half op's scratch and the weight's
/// f32 copy on the host) while dW is added into one f32 sum; dh written into an (N, d) buffer
/// when there are several blocks. Returns (dh, dW), dW the sum rounded into W's type (a GPU
/// with one block computes dW in W's type directly).
fn head_loss_backward(meter: &Rc<Meter>, h: &T, w: &T, chunk_rows: usize) -> (T, T) {
    let (n, d, v) = (h.0.dims[0], h.0.dims[1], w.0.dims[0]);
    let (dtype, gpu) = (h.0.dtype, meter.on_gpu());
    let (hd, wd) = (h.detach(), w.detach());
    let _per_row = T::new(meter, &[], Dt::F32); // g · (1/N)
    let blocks = crate::model::loss_blocks(n, chunk_rows);
    let several = blocks.len() > 1;
    let dh_all = several.then(|| T::new(meter, &[n, d], dtype));
    let mut dh_one = None;
    let (mut sum, mut single) = (None, None);
    for (start, len) in blocks {
        let h_block = hd.narrow(0, start, len);
        let kind = if dtype == Dt::Half && !gpu {
            Fused::LinearHalf { scratch: crate::model::fused::half_scratch_len(len, d, v) as u64 }
        } else {
            Fused::Linear
        };
        let logits = T::fused(kind, &[&h_block, &wd], &[len, v]);
        let dlogits = {
            // The upstream gradients' Vec (host), or their contiguous copy and the targets'
            // (device).
            let staged = if gpu {
                vec![raw(meter, len as u64 * 4), raw(meter, len as u64 * 4)]
            } else {
                vec![raw(meter, len as u64 * 4)]
            };
            let g = T::new(meter, &[len, v], dtype);
            drop(staged);
            g
        };
        drop(logits);
        let dx = if gpu {
            let dx = T::new(meter, &[len, d], dtype);
            if several {
                sum.get_or_insert_with(|| raw(meter, (v * d) as u64 * 4));
            } else {
                single = Some(T::new(meter, &[v, d], dtype));
            }
            dx
        } else if let Fused::LinearHalf { scratch } = kind {
            let scratch = raw(meter, scratch * 4);
            let wf = raw(meter, (v * d) as u64 * 4);
            let dx = T::new(meter, &[len, d], dtype);
            drop(wf);
            sum.get_or_insert_with(|| raw(meter, (v * d) as u64 * 4));
            drop(scratch);
            dx
        } else {
            let dx = T::new(meter, &[len, d], dtype);
            sum.get_or_insert_with(|| raw(meter, (v * d) as u64 * 4));
            dx
        };
        drop(dlogits);
        if several {
            drop(dx); // written into dh_all
        } else {
            dh_one = Some(dx);
        }
    }
    let dw = match (single, sum) {
        (Some(dw), _) => dw,
        (None, Some(sum)) if dtype == Dt::F32 => T::wrap(vec![v, d], Dt::F32, sum),
        (None, Some(sum)) => {
            let dw = T::new(meter, &[v, d], dtype);
            drop(sum);
            dw
        }
        (None, None) => unreachable!("every block adds to dW"),
    };
    let dh = dh_all.or(dh_one).expect("one block at least");
    (dh, dw)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_share_and_copies_count() {
        let m = Meter::new();
        let x = T::param(&m, &[4, 8]);
        assert_eq!(m.current(), 128);
        let y = x.reshape(&[2, 16]).transpose(0, 1);
        assert_eq!(m.current(), 128, "views allocate nothing");
        let z = y.contiguous();
        assert_eq!(m.current(), 256, "a strided tensor made contiguous is a copy");
        assert_eq!(z.contiguous().0.id, z.0.id, "contiguous of a contiguous tensor is itself");
        drop((y, z));
        assert_eq!(m.current(), 128);
        // A transpose that swaps a size-1 dimension stays contiguous (candle's rule).
        let w = T::param(&m, &[3, 1, 5]);
        assert!(w.transpose(0, 1).is_contiguous());
    }

    #[test]
    fn backward_keeps_a_tracked_gradient_expression_alive_until_its_node_is_processed() {
        let m = Meter::new();
        let w = T::param(&m, &[2, 2]);
        let x = T::param(&m, &[3, 2]);
        let h = x.matmul(&w.t()).exp(); // (3, 2)
        let loss = h.sum_all();
        let base = m.current();
        m.reset_peak();
        let grads = backward(&loss);
        // Left: the two parameter gradients, and what x's gradient holds: grad·w is tracked
        // through w, so the matmul's output gradient it was computed from stays alive with it
        // (one more (3, 2) buffer; with candle's zeros, that and the zeros and the product).
        assert_eq!(m.current() - base, 2 * 2 * 4 + 3 * 2 * 4 + 24);
        // At the matmul node: its incoming gradient, which holds the exp node's (its product
        // is tracked through exp's output), and the two gradients it makes, moved in.
        assert_eq!(m.peak().bytes - base, 3 * 24 + 2 * 2 * 4);
        drop(grads);
        assert_eq!(m.current(), base);
    }
}
