//! Tiled attention that saves one logsumexp per query row: FlashAttention-2 on the CPU.
//!
//! Forward, for each tile of `Tiles::q` query rows (Dao 2023, Algorithm 1):
//!
//! ```text
//! m = −∞, l = 0, O = 0                             running max, running sum, unnormalized output
//! for each key tile j the mask does not hide:
//!     S = scale · Q_i K_jᵀ, −∞ where masked        (q_tile, k_tile), in cache
//!     m' = max(m, rowmax S);  P = exp(S − m')
//!     l = l · exp(m − m') + rowsum P;  O = O · exp(m − m') + P V_j;  m = m'
//! O = O / l;  L = m + ln l                          saved: L, B·H·Tq f32
//! ```
//!
//! Backward, for each key tile j (owning dK_j, dV_j) and each query tile i that sees it:
//!
//! ```text
//! Δ = rowsum(dO ∘ O)                                once per query row
//! S = scale · Q_i K_jᵀ;  P = exp(S − L)             recomputed, never stored whole
//! dV_j += Pᵀ dO_i;  dP = dO_i V_jᵀ;  dS = P ∘ (dP − Δ)
//! dQ_i += scale · dS K_j;  dK_j += scale · dSᵀ Q_i
//! ```
//!
//! Tiles the mask hides are skipped, and only tiles it cuts through are masked element by
//! element. Forward runs one task per (batch, head, query tile), the longest first.
//! Backward runs one task per (batch, kv head) with all the query heads of its group; when
//! there are fewer such groups than threads, each group's key tiles are split into runs of
//! equal work, and the runs after the first write dQ into scratch copies summed at the end
//! (so results then depend on the thread count; with B·Hkv ≥ threads they do not).
//!
//! Every scratch buffer — the per-thread tiles, the running max and sum, and backward's dQ
//! copies — is carved from the host's workspace ([`forward_workspace_len`],
//! [`backward_workspace_len`]), so the host counts it.

use ava_core::{AttnShape, PluginError, error::expect_len};

use super::{
    Dims, Mask, Tile, check_forward, check_grads, count,
    matmul::{Mat, matmul},
};
use crate::{parallel, rows};

/// Tile sizes: query rows and keys per tile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tiles {
    /// Query rows per tile.
    pub q: usize,
    /// Keys per tile.
    pub k: usize,
}

impl Tiles {
    /// Forward tiles for head size `head_dim`: a Q (and O) tile of 32 KiB and K, V tiles
    /// of 16 KiB each, so a task's working set stays in a 512 KiB L2 next to its score
    /// tile. Both stay multiples of the 4 × 16 tile kernel's block and at most 256 keys,
    /// which it needs.
    ///
    /// Measured with `cargo bench -p ava-kernels --bench tiles` (causal, B=1, H=4, fastest
    /// of 10 samples, 2-core Zen 3): D=64 T=4096 forward 128 × 64 in 82 ms against 87
    /// for 128 × 32 and 90 for 64 × 64. At D=128 the tiles' differences were smaller than
    /// the machine's run-to-run swings; the rule's 64 × 32 was within 10% of the fastest.
    pub fn tuned_forward(head_dim: usize) -> Self {
        Self { q: fit(head_dim, 8192, 128), k: fit(head_dim, 4096, 64) }
    }

    /// Backward tiles for head size `head_dim`: Q and K tiles of 16 KiB each. Backward
    /// keeps two score-sized tiles (P and dS) per thread where forward keeps one, and
    /// smaller query tiles keep them in L1 next to the rows they multiply. Same bench:
    /// D=64 T=4096 backward 64 × 64 in 141 ms against 155 for 128 × 64 (the forward
    /// tiles); at D=128 T=2048 32-row query tiles were the fastest in both runs.
    pub fn tuned_backward(head_dim: usize) -> Self {
        Self { q: fit(head_dim, 4096, 64), k: fit(head_dim, 4096, 64) }
    }
}

/// `floats / head_dim` rounded down to a multiple of 16 in `32..=max`.
fn fit(head_dim: usize, floats: usize, max: usize) -> usize {
    (floats / head_dim.max(1)).clamp(32, max) / 16 * 16
}

/// Saved f32s: one logsumexp per query row, B·H·Tq.
pub fn saved_len(shape: &AttnShape) -> Result<u64, PluginError> {
    Dims::new(shape)?;
    count(shape, &[shape.batch, shape.q_heads, shape.q_len], "logsumexp rows")
}

/// Forward's workspace in f32s: per thread a (q_tile, k_tile) score tile, a (D, k_tile)
/// transposed key tile and the running max and sum of a query tile.
pub fn forward_workspace_len(shape: &AttnShape, tiles: Tiles, threads: u32) -> Result<u64, PluginError> {
    let x = Dims::new(shape)?;
    check_tiles(tiles)?;
    let tasks = shape.batch as usize * x.heads * x.tq.div_ceil(tiles.q);
    Ok((parallel::workers(threads, tasks) * forward_per_thread(tiles, x.d)) as u64)
}

fn forward_per_thread(tiles: Tiles, d: usize) -> usize {
    tiles.q * tiles.k + d * tiles.k + 2 * tiles.q
}

/// How backward splits its work: (B·Hkv groups, key tiles, runs per group).
fn backward_split(shape: &AttnShape, x: &Dims, tiles: Tiles, threads: u32) -> (usize, usize, usize) {
    let groups = shape.batch as usize * shape.kv_heads as usize;
    let k_tiles = x.tk.div_ceil(tiles.k);
    (groups, k_tiles, runs_per_group(groups, threads as usize, k_tiles))
}

/// Backward's workspace in f32s: the dQ copies of the runs after the first
/// ((runs − 1)·B·H·Tq·D, see the module notes), and per thread the P and dS tiles, the
/// transposed K and V tiles and Δ for its group's rows.
pub fn backward_workspace_len(shape: &AttnShape, tiles: Tiles, threads: u32) -> Result<u64, PluginError> {
    let x = Dims::new(shape)?;
    check_tiles(tiles)?;
    if x.tq == 0 {
        return Ok(0);
    }
    let (groups, _, runs) = backward_split(shape, &x, tiles, threads);
    let extra = (runs - 1) * groups * x.group * x.tq * x.d;
    Ok((extra + parallel::workers(threads, groups * runs) * Scratch::len(tiles, &x)) as u64)
}

/// The GPU backward's workspace in f32s (kernels/flash.cu): Δ, one per query row, then with
/// grouped-query attention each query head's share of dK and dV, 2·B·H·Tk·D, which a last
/// kernel adds over the group in order.
pub fn device_backward_workspace_len(shape: &AttnShape) -> u64 {
    let rows = u64::from(shape.batch) * u64::from(shape.q_heads) * u64::from(shape.q_len);
    let shares = if shape.q_heads > shape.kv_heads {
        2 * u64::from(shape.batch) * u64::from(shape.q_heads) * u64::from(shape.kv_len) * u64::from(shape.head_dim)
    } else {
        0
    };
    rows + shares
}

/// Computes `out` (B, H, Tq, D) and the logsumexp `lse` (B, H, Tq).
#[allow(clippy::too_many_arguments)] // q, k, v, out, saved, mask, tiles, shape, threads
pub fn forward(
    shape: &AttnShape,
    mask: &Mask<'_>,
    tiles: Tiles,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &mut [f32],
    lse: &mut [f32],
    workspace: &mut [f32],
    threads: u32,
) -> Result<(), PluginError> {
    let x = check_forward(shape, mask, (q, k, v, out), lse.len(), saved_len(shape)?)?;
    check_tiles(tiles)?;
    expect_len("workspace", workspace.len(), forward_workspace_len(shape, tiles, threads)? as usize)?;
    if x.tq == 0 {
        return Ok(());
    }
    // One task per (batch, head, query tile): its output rows (rows, D) and lse (rows,).
    let mut tasks = Vec::new();
    for (bh, (out, lse)) in out.chunks_mut(x.tq * x.d).zip(lse.chunks_mut(x.tq)).enumerate() {
        for (t, (out, lse)) in out.chunks_mut(tiles.q * x.d).zip(lse.chunks_mut(tiles.q)).enumerate() {
            let i0 = t * tiles.q;
            let cost = key_tiles(&mask.sequence(x.batch_of_head(bh)), tiles, i0, i0 + lse.len()).count();
            tasks.push((cost, bh, i0, out, lse));
        }
    }
    tasks.sort_by_key(|t| std::cmp::Reverse(t.0)); // longest first: the queue balances the rest
    parallel::run_in(
        tasks,
        threads,
        workspace,
        forward_per_thread(tiles, x.d),
        |part| {
            let (s, rest) = part.split_at_mut(tiles.q * tiles.k); // (q_tile, k_tile) scores
            let (kt, rest) = rest.split_at_mut(x.d * tiles.k); // (D, k_tile) transposed keys
            let (m, l) = rest.split_at_mut(tiles.q); // (q_tile,) running max and sum
            (s, kt, m, l)
        },
        |(s, kt, m, l), (_, bh, i0, out, lse)| forward_tile(&x, mask, tiles, bh, i0, (q, k, v), out, lse, s, kt, m, l),
    );
    Ok(())
}

/// Writes `dq`, `dk`, `dv` from `dout`, the output and the saved logsumexp.
#[allow(clippy::too_many_arguments)] // the kernel signature
pub fn backward(
    shape: &AttnShape,
    mask: &Mask<'_>,
    tiles: Tiles,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &[f32],
    dout: &[f32],
    lse: &[f32],
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    workspace: &mut [f32],
    threads: u32,
) -> Result<(), PluginError> {
    let x = check_forward(shape, mask, (q, k, v, out), lse.len(), saved_len(shape)?)?;
    check_grads(shape, dout.len(), dq.len(), dk.len(), dv.len())?;
    check_tiles(tiles)?;
    expect_len("workspace", workspace.len(), backward_workspace_len(shape, tiles, threads)? as usize)?;
    if x.tq == 0 {
        dk.fill(0.0);
        dv.fill(0.0);
        return Ok(());
    }
    let (tq, tk, d, group) = (x.tq, x.tk, x.d, x.group);
    let (groups, k_tiles, runs) = backward_split(shape, &x, tiles, threads);
    // Key-tile boundaries of the runs, equal in work: per sequence, whose segments change
    // the work (the same for every sequence without them).
    let batch = shape.batch as usize;
    let bounds: Vec<Vec<usize>> = if mask.segments().is_empty() {
        vec![split_by_work(mask, tiles, k_tiles, runs); batch]
    } else {
        (0..batch).map(|b| split_by_work(&mask.sequence(b), tiles, k_tiles, runs)).collect()
    };
    // dQ of runs 1.. : (runs − 1, B·Hkv, group, Tq, D); run 0 writes `dq` itself. Each run
    // zero-fills its part first, so the workspace's contents do not matter.
    let (extra, per_thread) = workspace.split_at_mut((runs - 1) * groups * group * tq * d);
    let mut extra_slices: Vec<Option<&mut [f32]>> = extra.chunks_mut((group * tq * d).max(1)).map(Some).collect();
    let mut tasks = Vec::with_capacity(groups * runs);
    for (g, ((dq, dk), dv)) in
        dq.chunks_mut(group * tq * d).zip(dk.chunks_mut(tk * d)).zip(dv.chunks_mut(tk * d)).enumerate()
    {
        let (mut dk, mut dv) = (dk, dv);
        let mut dq = Some(dq);
        let bounds = &bounds[x.batch_of_group(g)];
        for run in 0..runs {
            let (t0, t1) = (bounds[run], bounds[run + 1]);
            let len = ((t1 * tiles.k).min(tk) - t0 * tiles.k) * d;
            let (dk_run, dk_rest) = dk.split_at_mut(len);
            let (dv_run, dv_rest) = dv.split_at_mut(len);
            (dk, dv) = (dk_rest, dv_rest);
            let dq_run = if run == 0 { dq.take() } else { extra_slices[(run - 1) * groups + g].take() };
            let dq_run = dq_run.expect("each dQ slice is handed out once");
            tasks.push((g, t0, t1, dq_run, dk_run, dv_run));
        }
    }
    let inputs = Inputs { q, k, v, out, dout, lse };
    parallel::run_in(
        tasks,
        threads,
        per_thread,
        Scratch::len(tiles, &x),
        |part| Scratch::new(part, tiles, &x),
        |s, (g, t0, t1, dq, dk, dv)| backward_run(&x, mask, tiles, g, (t0, t1), &inputs, dq, dk, dv, s),
    );
    // Sum the runs' dQ in run order.
    for part in extra.chunks(groups * group * tq * d) {
        for (a, b) in dq.iter_mut().zip(part) {
            *a += b;
        }
    }
    Ok(())
}

fn check_tiles(tiles: Tiles) -> Result<(), PluginError> {
    if tiles.q == 0 || tiles.k == 0 {
        return Err(PluginError::invalid_input(format!("tile sizes must be at least 1, got {tiles:?}")));
    }
    Ok(())
}

/// The key tiles (`j0..j1`, kind) rows `i0..i1` must visit, in order.
fn key_tiles<'m>(
    mask: &'m Mask<'m>,
    tiles: Tiles,
    i0: usize,
    i1: usize,
) -> impl Iterator<Item = (usize, usize, Tile)> + 'm {
    let (lo, hi) = mask.key_span(i0, i1);
    let tk = mask.kv_len();
    (lo / tiles.k * tiles.k..hi).step_by(tiles.k).filter_map(move |j0| {
        let j1 = (j0 + tiles.k).min(tk);
        let kind = mask.tile(i0, i1, j0, j1);
        (kind != Tile::Skip).then_some((j0, j1, kind))
    })
}

/// The query tiles (`i0..i1`, kind) that see keys `j0..j1`, in order.
fn query_tiles<'m>(
    mask: &'m Mask<'m>,
    tiles: Tiles,
    j0: usize,
    j1: usize,
) -> impl Iterator<Item = (usize, usize, Tile)> + 'm {
    let (lo, hi) = mask.row_span(j0, j1);
    let tq = mask.q_len();
    (lo / tiles.q * tiles.q..hi).step_by(tiles.q).filter_map(move |i0| {
        let i1 = (i0 + tiles.q).min(tq);
        let kind = mask.tile(i0, i1, j0, j1);
        (kind != Tile::Skip).then_some((i0, i1, kind))
    })
}

/// Key-tile runs per (batch, kv head) in backward: 1 when the groups already keep every
/// thread busy, otherwise enough for an even share (each extra run costs a dQ copy).
fn runs_per_group(groups: usize, threads: usize, k_tiles: usize) -> usize {
    let threads = threads.max(1);
    let runs =
        if groups.is_multiple_of(threads) || groups >= 4 * threads { 1 } else { threads.div_ceil(groups).max(2) };
    runs.min(k_tiles).max(1)
}

/// Splits key tiles `0..k_tiles` into `runs` contiguous runs of about equal work (query
/// tiles visited); returns the `runs + 1` boundaries.
fn split_by_work(mask: &Mask<'_>, tiles: Tiles, k_tiles: usize, runs: usize) -> Vec<usize> {
    let work: Vec<usize> = (0..k_tiles)
        .map(|t| {
            let j0 = t * tiles.k;
            query_tiles(mask, tiles, j0, (j0 + tiles.k).min(mask.kv_len())).count() + 1
        })
        .collect();
    let total: usize = work.iter().sum();
    let mut bounds = vec![0];
    let mut acc = 0;
    for (t, w) in work.iter().enumerate() {
        acc += w;
        // Close a run once it reaches its share, leaving at least one tile per later run.
        let made = bounds.len();
        if made < runs && acc * runs >= total * made && k_tiles - (t + 1) >= runs - made {
            bounds.push(t + 1);
        }
    }
    while bounds.len() < runs {
        // Only when a share could not be reached before the tiles ran out.
        bounds.push(*bounds.last().expect("starts with 0"));
    }
    bounds.push(k_tiles);
    bounds
}

/// One (batch, head, query tile): online softmax over the visible key tiles.
#[allow(clippy::too_many_arguments)]
fn forward_tile(
    x: &Dims,
    mask: &Mask<'_>,
    tiles: Tiles,
    bh: usize,
    i0: usize,
    (q, k, v): (&[f32], &[f32], &[f32]),
    out: &mut [f32],
    lse: &mut [f32],
    s: &mut [f32],
    kt: &mut [f32],
    m: &mut [f32],
    l: &mut [f32],
) {
    let (tq, tk, d) = (x.tq, x.tk, x.d);
    let rows = lse.len();
    let kv = x.kv_of(bh);
    let mask = &mask.sequence(x.batch_of_head(bh));
    let q = Mat::rows(&q[(bh * tq + i0) * d..][..rows * d], d); // (rows, D)
    let k = &k[kv * tk * d..][..tk * d]; // (Tk, D)
    let v = &v[kv * tk * d..][..tk * d]; // (Tk, D)
    let m = &mut m[..rows]; // (rows,) running max
    let l = &mut l[..rows]; // (rows,) running sum
    m.fill(f32::NEG_INFINITY);
    l.fill(0.0);
    out.fill(0.0); // (rows, D) unnormalized output
    for (j0, j1, kind) in key_tiles(mask, tiles, i0, i0 + rows) {
        let cols = j1 - j0;
        let s = &mut s[..rows * cols]; // (rows, cols)
        let kt = transpose(&k[j0 * d..j1 * d], d, &mut kt[..d * cols]); // (D, cols)
        matmul(rows, cols, d, s, cols, q, Mat::rows(kt, cols), x.scale, false);
        if kind == Tile::Partial {
            for (r, row) in s.chunks_exact_mut(cols).enumerate() {
                mask.mask_row(i0 + r, j0, row);
            }
        }
        rows::online_softmax(s, cols, m, l, out, d);
        matmul(rows, d, cols, out, d, Mat::rows(s, cols), Mat::rows(&v[j0 * d..j1 * d], d), 1.0, true);
    }
    for (r, o) in out.chunks_exact_mut(d).enumerate() {
        // Every row sees at least its own position (checked by `Mask::new`), so l > 0.
        let inv = 1.0 / l[r];
        for o in o.iter_mut() {
            *o *= inv;
        }
        lse[r] = m[r] + l[r].ln();
    }
}

/// The read-only buffers of a backward call.
struct Inputs<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    out: &'a [f32],
    dout: &'a [f32],
    lse: &'a [f32],
}

/// A backward thread's buffers, carved from its part of the workspace.
struct Scratch<'a> {
    p: &'a mut [f32],     // (q_tile, k_tile) probabilities
    ds: &'a mut [f32],    // (q_tile, k_tile) dP, then dS in place
    kt: &'a mut [f32],    // (D, k_tile) K_jᵀ
    vt: &'a mut [f32],    // (D, k_tile) V_jᵀ
    delta: &'a mut [f32], // (group, Tq) rowsum(dO ∘ O)
}

impl<'a> Scratch<'a> {
    /// f32s of one thread's buffers.
    fn len(tiles: Tiles, x: &Dims) -> usize {
        2 * tiles.q * tiles.k + 2 * x.d * tiles.k + x.group * x.tq
    }

    fn new(part: &'a mut [f32], tiles: Tiles, x: &Dims) -> Self {
        let (p, rest) = part.split_at_mut(tiles.q * tiles.k);
        let (ds, rest) = rest.split_at_mut(tiles.q * tiles.k);
        let (kt, rest) = rest.split_at_mut(x.d * tiles.k);
        let (vt, delta) = rest.split_at_mut(x.d * tiles.k);
        Self { p, ds, kt, vt, delta }
    }
}

/// Writes the transpose of `src` (rows × `cols`, row-major) into `dst` (`cols` × rows) and
/// returns it, so products against Kᵀ and Vᵀ read contiguous rows.
fn transpose<'a>(src: &[f32], cols: usize, dst: &'a mut [f32]) -> &'a [f32] {
    let rows = src.len() / cols;
    for (r, row) in src.chunks_exact(cols).enumerate() {
        for (c, &x) in row.iter().enumerate() {
            dst[c * rows + r] = x;
        }
    }
    dst
}

/// One run of key tiles `t0..t1` of group `g = b·Hkv + kh`: its dK, dV rows and its
/// contribution to the group's dQ (group, Tq, D).
#[allow(clippy::too_many_arguments)]
fn backward_run(
    x: &Dims,
    mask: &Mask<'_>,
    tiles: Tiles,
    g: usize,
    (t0, t1): (usize, usize),
    inp: &Inputs<'_>,
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    s: &mut Scratch<'_>,
) {
    let (tq, tk, d, group) = (x.tq, x.tk, x.d, x.group);
    let mask = &mask.sequence(x.batch_of_group(g));
    dq.fill(0.0); // (group, Tq, D)
    dk.fill(0.0); // (run keys, D)
    dv.fill(0.0); // (run keys, D)
    if t0 == t1 {
        return;
    }
    let heads = g * group * tq * d..(g + 1) * group * tq * d;
    let (q, dout, out) = (&inp.q[heads.clone()], &inp.dout[heads.clone()], &inp.out[heads]); // (group, Tq, D)
    let lse = &inp.lse[g * group * tq..][..group * tq]; // (group, Tq)
    rows::row_dots(dout, out, d, s.delta);
    let k = &inp.k[g * tk * d..][..tk * d]; // (Tk, D)
    let v = &inp.v[g * tk * d..][..tk * d]; // (Tk, D)
    let key0 = t0 * tiles.k;
    for t in t0..t1 {
        let (j0, j1) = (t * tiles.k, ((t + 1) * tiles.k).min(tk));
        let cols = j1 - j0;
        let k_j = &k[j0 * d..j1 * d]; // (cols, D)
        let v_j = &v[j0 * d..j1 * d]; // (cols, D)
        let dk_j = &mut dk[(j0 - key0) * d..(j1 - key0) * d]; // (cols, D)
        let dv_j = &mut dv[(j0 - key0) * d..(j1 - key0) * d]; // (cols, D)
        let k_t = transpose(k_j, d, &mut s.kt[..d * cols]); // (D, cols)
        let v_t = transpose(v_j, d, &mut s.vt[..d * cols]); // (D, cols)
        for (i0, i1, kind) in query_tiles(mask, tiles, j0, j1) {
            let rows = i1 - i0;
            let (p, ds) = (&mut s.p[..rows * cols], &mut s.ds[..rows * cols]); // (rows, cols)
            for r in 0..group {
                let at = (r * tq + i0) * d..(r * tq + i1) * d;
                let q_i = Mat::rows(&q[at.clone()], d); // (rows, D)
                let do_i = Mat::rows(&dout[at.clone()], d); // (rows, D)
                // P = exp(scale · Q_i K_jᵀ − L), masked entries 0.
                matmul(rows, cols, d, p, cols, q_i, Mat::rows(k_t, cols), x.scale, false);
                if kind == Tile::Partial {
                    for (row, p_row) in p.chunks_exact_mut(cols).enumerate() {
                        mask.mask_row(i0 + row, j0, p_row);
                    }
                }
                rows::exp_minus_lse(p, cols, &lse[r * tq + i0..r * tq + i1]);
                // dV_j += Pᵀ dO_i.
                matmul(cols, d, rows, dv_j, d, Mat::transposed(p, cols), do_i, 1.0, true);
                // dP = dO_i V_jᵀ;  dS = P ∘ (dP − Δ).
                matmul(rows, cols, d, ds, cols, do_i, Mat::rows(v_t, cols), 1.0, false);
                rows::softmax_grad(p, ds, cols, &s.delta[r * tq + i0..r * tq + i1]);
                // dQ_i += scale · dS K_j;  dK_j += scale · dSᵀ Q_i.
                matmul(rows, d, cols, &mut dq[at], d, Mat::rows(ds, cols), Mat::rows(k_j, d), x.scale, true);
                matmul(cols, d, rows, dk_j, d, Mat::transposed(ds, cols), q_i, x.scale, true);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::Pattern;

    #[test]
    fn tuned_tiles_follow_the_head_size_and_suit_the_tile_kernel() {
        let pairs = |f: fn(usize) -> Tiles| {
            [64, 128, 16, 256, 1000, 0].map(|d| {
                let t = f(d);
                (t.q, t.k)
            })
        };
        assert_eq!(pairs(Tiles::tuned_forward), [(128, 64), (64, 32), (128, 64), (32, 32), (32, 32), (128, 64)]);
        assert_eq!(pairs(Tiles::tuned_backward), [(64, 64), (32, 32), (64, 64), (32, 32), (32, 32), (64, 64)]);
        for d in 1..600 {
            for Tiles { q, k } in [Tiles::tuned_forward(d), Tiles::tuned_backward(d)] {
                assert!(
                    q % 16 == 0 && k % 16 == 0 && (32..=128).contains(&q) && (32..=64).contains(&k),
                    "D={d}: {q}x{k}"
                );
            }
        }
    }

    #[test]
    fn runs_split_the_work_evenly() {
        let mask = Mask::new(Pattern::Causal, 256, 256).unwrap();
        let tiles = Tiles { q: 16, k: 16 };
        // Causal: key tile t is seen by 16 − t query tiles, so the first runs are shorter.
        let b = split_by_work(&mask, tiles, 16, 2);
        assert_eq!(b.len(), 3);
        assert!(b[1] > 2 && b[1] < 8, "{b:?}");
        assert_eq!(split_by_work(&mask, tiles, 16, 1), [0, 16]);
        // More runs than tiles never happens (runs_per_group caps it); equal shares with 16 runs.
        assert_eq!(split_by_work(&mask, tiles, 16, 16), (0..=16).collect::<Vec<_>>());
        assert_eq!(runs_per_group(8, 2, 100), 1);
        assert_eq!(runs_per_group(3, 2, 100), 2);
        assert_eq!(runs_per_group(1, 16, 100), 16);
        assert_eq!(runs_per_group(1, 16, 3), 3);
    }
}
