//! # Adafactor as an Ava optimizer plugin
//!
//! Adafactor (Shazeer & Stern 2018, *Adafactor: Adaptive Learning Rates with Sublinear
//! Memory Cost*) is Adam without most of Adam's memory: for a matrix it keeps only running
//! averages of the squared gradient's row means `R` and column means `C`, and rebuilds the
//! second moment of every element from their outer product. Updates are clipped by their
//! RMS, and by default the step size is derived from the step count and the parameter's own
//! scale instead of a learning rate.
//!
//! The arithmetic is that of `transformers.optimization.Adafactor` (the options and their
//! defaults are its too). With `t` the parameter's own step count (1 on its first step):
//!
//! ```text
//! rms(x) = ‖x‖₂ / √numel
//! ρ_t    = relative_step ? min(warmup_init ? 1e-6·t : 1e-2, 1/√t) : lr
//! lr_t   = ρ_t · (scale_parameter ? max(eps2, rms(θ)) : 1)        θ before this step
//! β2_t   = 1 − t^decay_rate                                       (0 at t = 1)
//! u      = g² + eps1
//!
//! rank ≥ 2, per [rows, cols] matrix of the last two dimensions:
//!   R ← β2_t·R + (1 − β2_t)·mean_j u        one per row
//!   C ← β2_t·C + (1 − β2_t)·mean_i u        one per column
//!   U_ij = g_ij / √(R_i·C_j / mean(R))
//! rank ≤ 1:
//!   V ← β2_t·V + (1 − β2_t)·u
//!   U = g / √V
//!
//! U ← lr_t · U / max(1, rms(U)/clip_threshold)
//! M ← β1·M + (1 − β1)·U;  U ← M               only with beta1
//! θ ← θ − λ·lr_t·θ − U                        λ: the trainer's weight decay for θ
//! ```
//!
//! **With `relative_step` (the default) the trainer's learning rate — `train.lr` and its
//! schedule — is ignored**: the step size is `ρ_t` above, scaled by the parameter's RMS.
//! Set `relative_step: false` to use the trainer's `lr` (then `scale_parameter` still
//! multiplies it by the parameter's RMS unless turned off too). The weight decay λ always
//! comes from the trainer (0 for norms, biases and embeddings by default) and, as in
//! transformers, is scaled by `lr_t`.
//!
//! ## Memory
//!
//! An `[r, c]` matrix keeps `r + c` floats: `4(r + c)/(r·c)` bytes per parameter (about
//! 0.002 for a 4096 × 4096 weight, against AdamW's 8). Tensors of higher rank are a batch of
//! such matrices; vectors keep one float per element. `beta1` adds 4 bytes per parameter.
//! Every tensor also keeps a `u32` step count.
//!
//! ## State
//!
//! In order: `exp_avg` (f32, numel; only with `beta1`), then `exp_avg_sq_row` (f32, one per
//! row of every matrix) and `exp_avg_sq_col` (f32, one per column of every matrix) for rank
//! ≥ 2, or `exp_avg_sq` (f32, numel) otherwise, then `step` (u32, 1).
//!
//! ## Implementation
//!
//! The step allocates nothing (the host accounts for all memory): it makes three passes over
//! the tensor — second-moment update and Σθ², then Σ U² for the clip, then the update —
//! in column tiles whose per-column values live on the stack, with one reciprocal square
//! root per row and per column instead of one per element. g² is formed in f32 (as
//! transformers does). It runs on the calling thread (`ctx.threads` is not used).
//!
//! Every sum is added in one fixed order that a GPU follows too (the `reduce` module): a
//! row tile's (or a vector's chunk of 1024 elements') terms in 32 strided f32 lanes, the
//! lanes in f64 in order; the column sums in f32 over blocks of 64 rows, the blocks in f64 in
//! order; and the tensor-wide sums (Σθ², Σ U², Σ R for mean(R)) as a 32-ary tree over those
//! per-tile-row (per-chunk, per-row) values. `1 − t^decay_rate` takes `reduce::pow`
//! instead of libm's. So a step on the GPU gives the CPU's bits.
//!
//! Built with the `cuda` feature it also steps on NVIDIA GPUs (`step_cuda`: the `gpu`
//! module, kernels/adafactor.cu, launched through `ava_kernels::cuda` on the host's stream)
//! and its manifest lists the cuda device, so `train.device: cuda` can use it. The state is
//! the same bytes on both devices, so a checkpoint moves between them without changing the
//! run (tests/gpu_adafactor.rs checks every step's bits on a GPU).

#[cfg(feature = "cuda")]
mod gpu;
mod reduce;

use ava_core::{error::expect_len, prelude::*};
use reduce::{CHUNK, LANES, Tree, lanes_in_order, tree_mean};

/// Columns per tile: the per-column values of a tile live on the stack (48 KiB in pass 1).
/// Wide enough that the rows of most weights are one tile, read front to back: a tile's row
/// is a contiguous run of 16 KiB, and the hardware prefetcher does not cross page borders,
/// so narrower tiles cost much of the memory bandwidth.
const TILE: usize = 4096;

/// Adafactor's hyper-parameters (the state lives in the host's buffers).
#[derive(Debug, Clone, PartialEq)]
pub struct Adafactor {
    /// Added to g² before averaging (regularizes the second moment).
    pub eps1: f64,
    /// Lower bound of the parameter scale used by `scale_parameter`.
    pub eps2: f64,
    /// Largest RMS of the update before the step size is applied.
    pub clip_threshold: f64,
    /// β2 at step t is `1 − t^decay_rate`.
    pub decay_rate: f64,
    /// First-moment decay; `None` keeps no first moment.
    pub beta1: Option<f64>,
    /// Multiply the step size by `max(eps2, rms(θ))`.
    pub scale_parameter: bool,
    /// Step size `min(1e-2, 1/√t)` instead of the trainer's learning rate.
    pub relative_step: bool,
    /// With `relative_step`: `min(1e-6·t, 1/√t)`.
    pub warmup_init: bool,
}

impl Default for Adafactor {
    fn default() -> Self {
        Self {
            eps1: 1e-30,
            eps2: 1e-3,
            clip_threshold: 1.0,
            decay_rate: -0.8,
            beta1: None,
            scale_parameter: true,
            relative_step: true,
            warmup_init: false,
        }
    }
}

impl Plugin for Adafactor {
    fn manifest() -> Manifest {
        Manifest::new(
            "adafactor",
            PluginKind::Optimizer,
            env!("CARGO_PKG_VERSION"),
            "Adafactor: factored second moment (row and column averages), update clipping and relative step size, \
             as transformers' Adafactor (Shazeer & Stern 2018)",
        )
        .devices(if cfg!(feature = "cuda") { &[Device::Cpu, Device::Cuda] } else { &[Device::Cpu] })
        .option(OptionSpec::float_list(
            "eps",
            &[1e-30, 1e-3],
            "[eps1, eps2]: eps1 is added to g² before averaging; eps2 is the smallest parameter scale \
             scale_parameter uses",
        ))
        .option(OptionSpec::float(
            "clip_threshold",
            1.0,
            "the update (before the step size) is scaled down so that its RMS over the tensor is at most this",
        ))
        .option(OptionSpec::float(
            "decay_rate",
            -0.8,
            "negative; β2 at the parameter's step t is 1 − t^decay_rate (0 at the first step, then towards 1)",
        ))
        .option(OptionSpec::optional(
            "beta1",
            OptionType::Float,
            "decay of a first moment of the update, in [0, 1); unset (the default) keeps none and saves 4 bytes \
             per parameter",
        ))
        .option(OptionSpec::bool(
            "scale_parameter",
            true,
            "multiply the step size by the parameter's RMS (at least eps2), so the step is relative to the weights",
        ))
        .option(OptionSpec::bool(
            "relative_step",
            true,
            "step size min(1e-2, 1/√t) from the parameter's own step t: the trainer's lr and its schedule are then \
             IGNORED; set false to use them",
        ))
        .option(OptionSpec::bool(
            "warmup_init",
            false,
            "with relative_step: step size min(1e-6·t, 1/√t), a linear warm-up; needs relative_step = true",
        ))
    }

    fn from_options(mut options: Options) -> Result<Self, PluginError> {
        let eps = options.float_list("eps");
        options.check(eps.len() == 2, || format!("option 'eps': expected 2 values [eps1, eps2], got {}", eps.len()));
        for (i, e) in eps.iter().enumerate() {
            options.check(*e > 0.0, || format!("option 'eps': eps{} = {e} must be > 0", i + 1));
        }
        let clip_threshold = options.float("clip_threshold");
        options.check(clip_threshold > 0.0, || format!("option 'clip_threshold': {clip_threshold} must be > 0"));
        let decay_rate = options.float("decay_rate");
        options.check(decay_rate < 0.0, || {
            format!("option 'decay_rate': {decay_rate} must be < 0 (β2 at step t is 1 − t^decay_rate)")
        });
        let beta1 = options.opt_float("beta1");
        if let Some(b) = beta1 {
            options.check((0.0..1.0).contains(&b), || format!("option 'beta1': {b} must be in [0, 1)"));
        }
        let (relative_step, warmup_init) = (options.bool("relative_step"), options.bool("warmup_init"));
        // transformers raises on this combination too: the warm-up is a relative step size.
        options.check(relative_step || !warmup_init, || {
            "option 'warmup_init': needs relative_step = true (the warm-up is of the relative step size)".to_string()
        });
        options.finish()?;
        Ok(Adafactor {
            eps1: eps[0],
            eps2: eps[1],
            clip_threshold,
            decay_rate,
            beta1,
            scale_parameter: options.bool("scale_parameter"),
            relative_step,
            warmup_init,
        })
    }
}

/// How a parameter's second moment is kept.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Factoring {
    /// A batch of `[rows, cols]` matrices (the last two dimensions): row and column averages.
    Matrices { batch: usize, rows: usize, cols: usize },
    /// One average per element (rank 0 and 1).
    Elements,
}

impl Factoring {
    fn of(shape: &[u64]) -> Factoring {
        match shape {
            [lead @ .., rows, cols] => Factoring::Matrices {
                batch: lead.iter().product::<u64>() as usize,
                rows: *rows as usize,
                cols: *cols as usize,
            },
            _ => Factoring::Elements,
        }
    }
}

impl Adafactor {
    /// Names of the state buffers, in order.
    fn state_names(&self, f: Factoring) -> &'static [&'static str] {
        match (self.beta1.is_some(), f) {
            (false, Factoring::Elements) => &["exp_avg_sq", "step"],
            (false, Factoring::Matrices { .. }) => &["exp_avg_sq_row", "exp_avg_sq_col", "step"],
            (true, Factoring::Elements) => &["exp_avg", "exp_avg_sq", "step"],
            (true, Factoring::Matrices { .. }) => &["exp_avg", "exp_avg_sq_row", "exp_avg_sq_col", "step"],
        }
    }

    /// The error for `got` state buffers where `param`'s layout has another number.
    fn wrong_state(&self, param: &ParamInfo<'_>, got: usize) -> PluginError {
        let names = self.state_names(Factoring::of(&param.shape));
        PluginError::invalid_input(format!(
            "adafactor expects {} state buffers ({}) for {} of shape {:?}, got {got}",
            names.len(),
            names.join(", "),
            param.name,
            param.shape.as_slice(),
        ))
    }
}

impl Optimizer for Adafactor {
    fn state_layout(&self, param: &ParamInfo<'_>) -> Result<Vec<StateSpec>, PluginError> {
        let n = param.numel();
        let mut layout = Vec::with_capacity(4);
        if self.beta1.is_some() {
            layout.push(StateSpec::new("exp_avg", DType::F32, n));
        }
        match Factoring::of(&param.shape) {
            Factoring::Matrices { batch, rows, cols } => {
                layout.push(StateSpec::new("exp_avg_sq_row", DType::F32, batch * rows));
                layout.push(StateSpec::new("exp_avg_sq_col", DType::F32, batch * cols));
            }
            Factoring::Elements => layout.push(StateSpec::new("exp_avg_sq", DType::F32, n)),
        }
        layout.push(StateSpec::new("step", DType::U32, 1));
        Ok(layout)
    }

    fn step(
        &mut self,
        param: &ParamInfo<'_>,
        values: &mut [f32],
        grad: &[f32],
        state: &mut [StateBuf<'_>],
        ctx: &StepContext,
    ) -> Result<(), PluginError> {
        let n = param.numel();
        expect_len("values", values.len(), n)?;
        expect_len("grad", grad.len(), n)?;
        let factoring = Factoring::of(&param.shape);
        if state.len() != self.state_names(factoring).len() {
            return Err(self.wrong_state(param, state.len()));
        }
        // Check every buffer before touching anything, so a refused step changes nothing.
        let (m, rest) = if self.beta1.is_some() {
            let (m, rest) = state.split_at_mut(1);
            let m = typed_f32(&mut m[0], "exp_avg")?;
            expect_len("exp_avg", m.len(), n)?;
            (Some(m), rest)
        } else {
            (None, state)
        };
        let (mut moments, t) = match (factoring, rest) {
            (Factoring::Matrices { batch, rows, cols }, [r, c, t]) => {
                let (r, c) = (typed_f32(r, "exp_avg_sq_row")?, typed_f32(c, "exp_avg_sq_col")?);
                expect_len("exp_avg_sq_row", r.len(), batch * rows)?;
                expect_len("exp_avg_sq_col", c.len(), batch * cols)?;
                (Moments::Factored { r, c, rows, cols }, t)
            }
            (Factoring::Elements, [v, t]) => {
                let v = typed_f32(v, "exp_avg_sq")?;
                expect_len("exp_avg_sq", v.len(), n)?;
                (Moments::Full { v }, t)
            }
            _ => unreachable!("the buffer count was checked against the names"),
        };
        let t = t.u32().map_err(in_buffer("step"))?;
        expect_len("step", t.len(), 1)?;

        // Everything checked: from here on the step runs to the end.
        t[0] = t[0].saturating_add(1);
        if n == 0 {
            return Ok(());
        }
        let t = f64::from(t[0]);
        let s = SecondMoment { beta2: 1.0 - reduce::pow(t, self.decay_rate), eps1: self.eps1 };

        // Pass 1 updates the second moment and sums θ² (for the parameter scale) and, where it
        // can, the squared raw update (for the clip); a factored tensor needs a second pass for
        // that, once every column average is final. Only then is the step known and applied.
        let scale = self.scale_parameter;
        let (sum_w2, sum_u2) = match &mut moments {
            Moments::Factored { r, c, rows, cols } => {
                let (rows, cols) = (*rows, *cols);
                let sum_w2 = if scale {
                    s.factored::<true>(values, grad, r, c, rows, cols)
                } else {
                    s.factored::<false>(values, grad, r, c, rows, cols)
                };
                (sum_w2, factored_sum_sq(grad, r, c, rows, cols))
            }
            Moments::Full { v } => {
                if scale {
                    s.full::<true>(values, grad, v)
                } else {
                    s.full::<false>(values, grad, v)
                }
            }
        };
        let lr = self.step_size(t, sum_w2 / n as f64, ctx.lr);
        let rms_u = (sum_u2 / n as f64).sqrt();
        let apply = Apply {
            scale: lr / (rms_u / self.clip_threshold).max(1.0),
            decay: (1.0 - ctx.weight_decay * lr) as f32,
            beta1: self.beta1.map(|b| b as f32),
        };
        match moments {
            Moments::Factored { r, c, rows, cols } => apply.factored(values, grad, m, r, c, rows, cols),
            Moments::Full { v } => apply.full(values, grad, m, v),
        }
        Ok(())
    }

    /// The same step on the GPU, with the same state bytes and the same bits: see the `gpu`
    /// module.
    #[cfg(feature = "cuda")]
    fn step_cuda(
        &mut self,
        param: &ParamInfo<'_>,
        values: &CudaBuf,
        grad: &CudaBuf,
        state: &[CudaBuf],
        ctx: &StepContext,
        stream: &CudaStream,
    ) -> Result<(), PluginError> {
        gpu::step(self, param, values, grad, state, ctx, stream)
    }
}

impl Adafactor {
    /// `lr_t`: the relative (or the trainer's) step size times the parameter scale.
    fn step_size(&self, t: f64, mean_w2: f64, lr: f64) -> f64 {
        let base = if self.relative_step {
            let cap = if self.warmup_init { 1e-6 * t } else { 1e-2 };
            cap.min(1.0 / t.sqrt())
        } else {
            lr
        };
        if self.scale_parameter { base * self.eps2.max(mean_w2.sqrt()) } else { base }
    }
}

/// A parameter's second-moment buffers, checked and typed.
enum Moments<'a> {
    /// Row and column averages of a batch of `[rows, cols]` matrices.
    Factored { r: &'a mut [f32], c: &'a mut [f32], rows: usize, cols: usize },
    /// One average per element.
    Full { v: &'a mut [f32] },
}

fn typed_f32<'a>(buf: &'a mut StateBuf<'_>, what: &'static str) -> Result<&'a mut [f32], PluginError> {
    buf.f32().map_err(in_buffer(what))
}

fn in_buffer(what: &'static str) -> impl FnOnce(PluginError) -> PluginError {
    move |e| PluginError::invalid_input(format!("adafactor: state buffer '{what}': {}", e.message))
}

// Sums are cascaded: within a row tile of at most [`TILE`] elements (a vector's chunk of
// [`CHUNK`]) they run in f32 over `LANES` independent accumulators (so the compiler vectorizes
// them; a single running sum is a serial dependency chain), and the rest in f64 (see
// [`reduce`]). No f32 sum sees more than `TILE / LANES` terms, and a tensor's totals keep f64
// precision whatever its size.

/// Rows whose column sums are gathered in f32 before they are added to the f64 totals.
const ROW_BLOCK: usize = 64;

/// The second-moment update of one step: `x ← β2_t·x + (1 − β2_t)·mean(g² + eps1)`.
struct SecondMoment {
    beta2: f64,
    eps1: f64,
}

impl SecondMoment {
    /// Updates the row and column averages of every matrix; returns Σθ² when `W`.
    ///
    /// Column sums live on the stack, one tile of columns at a time, so the gradient is read
    /// once with no buffer of the tensor's size; each row's mean is gathered from its tiles
    /// (one f32 rounding per tile; exactly one when the row fits a tile).
    fn factored<const W: bool>(
        &self,
        w: &[f32],
        g: &[f32],
        r: &mut [f32],
        c: &mut [f32],
        rows: usize,
        cols: usize,
    ) -> f64 {
        let (keep, add) = (self.beta2, 1.0 - self.beta2);
        let size = rows * cols;
        let mut acc = [0f64; TILE];
        let mut block = [0f32; TILE];
        // Σθ²: a tree over the tile rows' sums, in the order they are visited here (matrix,
        // column tile, row).
        let mut sum_w2 = Tree::default();
        let mats =
            w.chunks_exact(size).zip(g.chunks_exact(size)).zip(r.chunks_exact_mut(rows)).zip(c.chunks_exact_mut(cols));
        for (((w, g), r), c) in mats {
            for j0 in (0..cols).step_by(TILE) {
                let width = TILE.min(cols - j0);
                let (acc, block) = (&mut acc[..width], &mut block[..width]);
                acc.fill(0.0);
                for (b, r) in r.chunks_mut(ROW_BLOCK).enumerate() {
                    block.fill(0.0);
                    for (i, ri) in r.iter_mut().enumerate() {
                        let at = (b * ROW_BLOCK + i) * cols + j0;
                        let (sum_g2, w2) = accumulate_row::<W>(&g[at..at + width], &w[at..at + width], block);
                        if W {
                            sum_w2.push(w2);
                        }
                        let part = sum_g2 / cols as f64;
                        let old = f64::from(*ri);
                        *ri = if j0 == 0 { keep * old + add * (part + self.eps1) } else { old + add * part } as f32;
                    }
                    for (a, &x) in acc.iter_mut().zip(block.iter()) {
                        *a += f64::from(x);
                    }
                }
                for (cj, &a) in c[j0..j0 + width].iter_mut().zip(acc.iter()) {
                    *cj = (keep * f64::from(*cj) + add * (a / rows as f64 + self.eps1)) as f32;
                }
            }
        }
        sum_w2.sum()
    }

    /// Updates the per-element averages; returns Σθ² (when `W`, else 0) and Σ(g²/V), the
    /// squared norm of the raw update: each a tree over chunks of [`CHUNK`] elements.
    fn full<const W: bool>(&self, w: &[f32], g: &[f32], v: &mut [f32]) -> (f64, f64) {
        let (keep, add, eps1) = (self.beta2 as f32, (1.0 - self.beta2) as f32, self.eps1 as f32);
        let (mut sum_w2, mut sum_u2) = (Tree::default(), Tree::default());
        for ((w, g), v) in w.chunks(CHUNK).zip(g.chunks(CHUNK)).zip(v.chunks_mut(CHUNK)) {
            let (mut wl, mut ul) = ([0f32; LANES], [0f32; LANES]);
            let head = g.len() / LANES * LANES;
            let chunks =
                w[..head].chunks_exact(LANES).zip(g[..head].chunks_exact(LANES)).zip(v[..head].chunks_exact_mut(LANES));
            for ((w, g), v) in chunks {
                for k in 0..LANES {
                    v[k] = keep * v[k] + add * (g[k] * g[k] + eps1);
                    ul[k] += g[k] * g[k] / v[k];
                    if W {
                        wl[k] += w[k] * w[k];
                    }
                }
            }
            for (k, ((&w, &g), v)) in w[head..].iter().zip(&g[head..]).zip(&mut v[head..]).enumerate() {
                *v = keep * *v + add * (g * g + eps1);
                ul[k] += g * g / *v;
                if W {
                    wl[k] += w * w;
                }
            }
            sum_u2.push(lanes_in_order(&ul));
            if W {
                sum_w2.push(lanes_in_order(&wl));
            }
        }
        (sum_w2.sum(), sum_u2.sum())
    }
}

/// One row tile of pass 1: adds g² to the column sums `cols`; returns the tile's Σg² and
/// (when `W`) Σθ².
fn accumulate_row<const W: bool>(g: &[f32], w: &[f32], cols: &mut [f32]) -> (f64, f64) {
    let (mut gl, mut wl) = ([0f32; LANES], [0f32; LANES]);
    let head = g.len() / LANES * LANES;
    let chunks =
        g[..head].chunks_exact(LANES).zip(w[..head].chunks_exact(LANES)).zip(cols[..head].chunks_exact_mut(LANES));
    for ((g, w), a) in chunks {
        for k in 0..LANES {
            let x2 = g[k] * g[k];
            a[k] += x2;
            gl[k] += x2;
            if W {
                wl[k] += w[k] * w[k];
            }
        }
    }
    for (k, ((&g, &w), a)) in g[head..].iter().zip(&w[head..]).zip(&mut cols[head..]).enumerate() {
        *a += g * g;
        gl[k] += g * g;
        if W {
            wl[k] += w * w;
        }
    }
    (lanes_in_order(&gl), lanes_in_order(&wl))
}

/// Pass 2 for factored tensors: Σ U² with `U_ij = g_ij / √(R_i·C_j / mean(R))`, i.e.
/// `Σ_i mean(R)/R_i · Σ_j g_ij²/C_j`: one reciprocal per column (per tile, on the stack)
/// and one division per row. A tree over the tile rows' values (matrix, column tile, row).
fn factored_sum_sq(g: &[f32], r: &[f32], c: &[f32], rows: usize, cols: usize) -> f64 {
    let mut inv_c = [0f32; TILE];
    let mut total = Tree::default();
    for ((g, r), c) in g.chunks_exact(rows * cols).zip(r.chunks_exact(rows)).zip(c.chunks_exact(cols)) {
        let mean_r = tree_mean(r);
        for j0 in (0..cols).step_by(TILE) {
            let width = TILE.min(cols - j0);
            let inv_c = &mut inv_c[..width];
            for (inv, &cj) in inv_c.iter_mut().zip(&c[j0..j0 + width]) {
                *inv = (1.0 / f64::from(cj)) as f32;
            }
            for (i, &ri) in r.iter().enumerate() {
                let at = i * cols + j0;
                total.push(weighted_sum_sq(&g[at..at + width], inv_c) * (mean_r / f64::from(ri)));
            }
        }
    }
    total.sum()
}

/// Σ g²·s over one row tile.
fn weighted_sum_sq(g: &[f32], s: &[f32]) -> f64 {
    let mut lanes = [0f32; LANES];
    let head = g.len() / LANES * LANES;
    for (g, s) in g[..head].chunks_exact(LANES).zip(s[..head].chunks_exact(LANES)) {
        for k in 0..LANES {
            lanes[k] += g[k] * g[k] * s[k];
        }
    }
    for (k, (&g, &s)) in g[head..].iter().zip(&s[head..]).enumerate() {
        lanes[k] += g * g * s;
    }
    lanes_in_order(&lanes)
}

/// Pass 3: `θ ← θ·(1 − λ·lr_t) − U`, with `U = scale·g/√v̂` (or its first moment).
struct Apply {
    /// `lr_t / max(1, rms(U)/clip_threshold)`.
    scale: f64,
    /// `1 − λ·lr_t`.
    decay: f32,
    beta1: Option<f32>,
}

impl Apply {
    #[allow(clippy::too_many_arguments)]
    fn factored(
        &self,
        w: &mut [f32],
        g: &[f32],
        mut m: Option<&mut [f32]>,
        r: &[f32],
        c: &[f32],
        rows: usize,
        cols: usize,
    ) {
        let size = rows * cols;
        let mut inv_sqrt_c = [0f32; TILE];
        for (b, ((w, g), (r, c))) in w
            .chunks_exact_mut(size)
            .zip(g.chunks_exact(size))
            .zip(r.chunks_exact(rows).zip(c.chunks_exact(cols)))
            .enumerate()
        {
            let mean_r = tree_mean(r);
            for j0 in (0..cols).step_by(TILE) {
                let width = TILE.min(cols - j0);
                let inv_sqrt_c = &mut inv_sqrt_c[..width];
                for (s, &cj) in inv_sqrt_c.iter_mut().zip(&c[j0..j0 + width]) {
                    *s = (1.0 / f64::from(cj).sqrt()) as f32;
                }
                for (i, &ri) in r.iter().enumerate() {
                    let at = i * cols + j0;
                    let row = (self.scale * (mean_r / f64::from(ri)).sqrt()) as f32;
                    let (w, g) = (&mut w[at..at + width], &g[at..at + width]);
                    match (&mut m, self.beta1) {
                        (Some(m), Some(b1)) => {
                            let m = &mut m[b * size + at..b * size + at + width];
                            for (((w, &g), m), &s) in w.iter_mut().zip(g).zip(m.iter_mut()).zip(inv_sqrt_c.iter()) {
                                *m = b1 * *m + (1.0 - b1) * (row * g * s);
                                *w = *w * self.decay - *m;
                            }
                        }
                        _ => {
                            for ((w, &g), &s) in w.iter_mut().zip(g).zip(inv_sqrt_c.iter()) {
                                *w = *w * self.decay - row * g * s;
                            }
                        }
                    }
                }
            }
        }
    }

    fn full(&self, w: &mut [f32], g: &[f32], m: Option<&mut [f32]>, v: &[f32]) {
        let scale = self.scale as f32;
        match (m, self.beta1) {
            (Some(m), Some(b1)) => {
                for (((w, &g), m), &v) in w.iter_mut().zip(g).zip(m.iter_mut()).zip(v) {
                    *m = b1 * *m + (1.0 - b1) * (scale * g / v.sqrt());
                    *w = *w * self.decay - *m;
                }
            }
            _ => {
                for ((w, &g), &v) in w.iter_mut().zip(g).zip(v) {
                    *w = *w * self.decay - scale * g / v.sqrt();
                }
            }
        }
    }
}

ava_core::export_plugin!(optimizer: Adafactor);

#[cfg(test)]
mod tests;
