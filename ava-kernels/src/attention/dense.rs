//! Dense attention that saves the probabilities: the `standard` kernel and the reference.
//!
//! ```text
//! S = scale · Q Kᵀ, −∞ where masked     P = softmax(S) row by row (saved: B·H·Tq·Tk f32)
//! O = P V
//! dV = Pᵀ dO    dP = dO Vᵀ    dS = P ∘ (dP − rowsum(dP ∘ P))    dQ = scale · dS K    dK = scale · dSᵀ Q
//! ```
//!
//! Products run on blocks of [`ROWS`] query rows against only the keys the block can see
//! ([`Mask::key_span`]: a causal block stops at its last row's position, which halves the
//! work). Forward runs one task per (batch, query head); backward one per (batch, kv head),
//! which owns its dK, dV and its group's dQ, so results do not depend on the thread count.
//! Forward needs no scratch; backward's dP rows come from the host's workspace
//! ([`backward_workspace_len`]).

use ava_core::{AttnShape, PluginError, error::expect_len};

use super::{
    Dims, Mask, Tile, check_forward, check_grads, count,
    matmul::{Mat, matmul},
};
use crate::{parallel, rows};

/// Query rows per block: enough for gemm to reach full speed, small enough to keep the
/// backward's dP scratch at ROWS × Tk.
pub const ROWS: usize = 64;

/// Saved f32s: the probabilities, B·H·Tq·Tk.
pub fn saved_len(shape: &AttnShape) -> Result<u64, PluginError> {
    Dims::new(shape)?;
    count(shape, &[shape.batch, shape.q_heads, shape.q_len, shape.kv_len], "probabilities")
}

/// Backward's workspace in f32s: one (ROWS, Tk) dP block per thread it uses.
pub fn backward_workspace_len(shape: &AttnShape, threads: u32) -> Result<u64, PluginError> {
    let x = Dims::new(shape)?;
    let groups = shape.batch as usize * shape.kv_heads as usize;
    Ok((parallel::workers(threads, groups) * backward_per_thread(&x)) as u64)
}

/// One thread's dP block in backward: (ROWS, Tk), 0 without queries.
fn backward_per_thread(x: &Dims) -> usize {
    ROWS.min(x.tq) * x.tk
}

/// Computes `out` (B, H, Tq, D) and the probabilities `probs` (B, H, Tq, Tk).
#[allow(clippy::too_many_arguments)] // q, k, v, out, saved, mask, shape, threads
pub fn forward(
    shape: &AttnShape,
    mask: &Mask<'_>,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &mut [f32],
    probs: &mut [f32],
    threads: u32,
) -> Result<(), PluginError> {
    let x = check_forward(shape, mask, (q, k, v, out), probs.len(), saved_len(shape)?)?;
    if x.tq == 0 {
        return Ok(()); // nothing to compute (and chunks of length 0 are not allowed)
    }
    // One task per (batch, query head): its output (Tq, D) and probabilities (Tq, Tk).
    let tasks: Vec<_> = out.chunks_mut(x.tq * x.d).zip(probs.chunks_mut(x.tq * x.tk)).enumerate().collect();
    parallel::run(tasks, threads, || (), |_, (bh, (out, probs))| forward_head(&x, mask, bh, q, k, v, out, probs));
    Ok(())
}

/// Writes `dq`, `dk`, `dv` from `dout` and the saved probabilities; `workspace` holds
/// [`backward_workspace_len`] f32s.
#[allow(clippy::too_many_arguments)] // the kernel signature
pub fn backward(
    shape: &AttnShape,
    mask: &Mask<'_>,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &[f32],
    dout: &[f32],
    probs: &[f32],
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    workspace: &mut [f32],
    threads: u32,
) -> Result<(), PluginError> {
    let x = check_forward(shape, mask, (q, k, v, out), probs.len(), saved_len(shape)?)?;
    check_grads(shape, dout.len(), dq.len(), dk.len(), dv.len())?;
    expect_len("workspace", workspace.len(), backward_workspace_len(shape, threads)? as usize)?;
    if x.tq == 0 {
        // No queries: no gradient flows to keys or values.
        dk.fill(0.0);
        dv.fill(0.0);
        return Ok(());
    }
    let inputs = Inputs { q, k, v, dout, probs };
    let (tq, tk, d) = (x.tq, x.tk, x.d);
    // One task per (batch, kv head): its group's dQ (group, Tq, D), its dK and dV (Tk, D).
    let tasks: Vec<_> =
        dq.chunks_mut(x.group * tq * d).zip(dk.chunks_mut(tk * d)).zip(dv.chunks_mut(tk * d)).enumerate().collect();
    // Each thread's (ROWS, Tk) block: dP, then dS in place.
    parallel::run_in(
        tasks,
        threads,
        workspace,
        backward_per_thread(&x),
        |ds| ds,
        |ds, (g, ((dq, dk), dv))| backward_group(&x, mask, g, &inputs, dq, dk, dv, ds),
    );
    Ok(())
}

/// One (batch, query head) `bh`: its output rows and probabilities, [`ROWS`] rows at a time.
#[allow(clippy::too_many_arguments)]
fn forward_head(
    x: &Dims,
    mask: &Mask<'_>,
    bh: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &mut [f32],
    probs: &mut [f32],
) {
    let (tq, tk, d) = (x.tq, x.tk, x.d);
    let mask = &mask.sequence(x.batch_of_head(bh));
    let kv = x.kv_of(bh);
    let q = &q[bh * tq * d..][..tq * d]; // (Tq, D)
    let k = &k[kv * tk * d..][..tk * d]; // (Tk, D)
    let v = &v[kv * tk * d..][..tk * d]; // (Tk, D)
    for i0 in (0..tq).step_by(ROWS) {
        let rows = ROWS.min(tq - i0);
        let (lo, hi) = mask.key_span(i0, i0 + rows);
        let n = hi - lo;
        let p = &mut probs[i0 * tk..][..rows * tk]; // (rows, Tk)
        // S = scale · Q Kᵀ over the keys the block can see, into columns lo..hi.
        let q_blk = Mat::rows(&q[i0 * d..][..rows * d], d); // (rows, D)
        let k_t = Mat::transposed(&k[lo * d..hi * d], d); // (D, n)
        matmul(rows, n, d, &mut p[lo..], tk, q_blk, k_t, x.scale, false);
        let partial = mask.tile(i0, i0 + rows, lo, hi) == Tile::Partial;
        for (r, row) in p.chunks_exact_mut(tk).enumerate() {
            row[..lo].fill(0.0);
            row[hi..].fill(0.0); // masked keys have probability 0
            if partial {
                mask.mask_row(i0 + r, lo, &mut row[lo..hi]);
            }
            rows::softmax_rows(&mut row[lo..hi], n);
        }
        // O = P V.
        let p_blk = Mat::rows(&p[lo..(rows - 1) * tk + hi], tk); // (rows, n)
        let v_blk = Mat::rows(&v[lo * d..hi * d], d); // (n, D)
        matmul(rows, d, n, &mut out[i0 * d..][..rows * d], d, p_blk, v_blk, 1.0, false);
    }
}

/// The read-only buffers of a backward call.
struct Inputs<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    dout: &'a [f32],
    probs: &'a [f32],
}

/// One (batch, kv head) `g = b·Hkv + kh`: the dQ rows of its query heads (`bh = g·group + r`,
/// contiguous in (B, H, Tq, D)) and its dK, dV, [`ROWS`] query rows at a time.
#[allow(clippy::too_many_arguments)]
fn backward_group(
    x: &Dims,
    mask: &Mask<'_>,
    g: usize,
    inp: &Inputs<'_>,
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    ds: &mut [f32],
) {
    let (tq, tk, d) = (x.tq, x.tk, x.d);
    let mask = &mask.sequence(x.batch_of_group(g));
    dq.fill(0.0); // (group, Tq, D)
    dk.fill(0.0); // (Tk, D)
    dv.fill(0.0); // (Tk, D)
    let k = &inp.k[g * tk * d..][..tk * d]; // (Tk, D)
    let v = &inp.v[g * tk * d..][..tk * d]; // (Tk, D)
    for r in 0..x.group {
        let bh = g * x.group + r;
        let q = &inp.q[bh * tq * d..][..tq * d]; // (Tq, D)
        let dout = &inp.dout[bh * tq * d..][..tq * d]; // (Tq, D)
        let probs = &inp.probs[bh * tq * tk..][..tq * tk]; // (Tq, Tk)
        let dq = &mut dq[r * tq * d..][..tq * d]; // (Tq, D)
        for i0 in (0..tq).step_by(ROWS) {
            let rows = ROWS.min(tq - i0);
            let (lo, hi) = mask.key_span(i0, i0 + rows);
            let n = hi - lo;
            let do_blk = Mat::rows(&dout[i0 * d..][..rows * d], d); // (rows, D)
            let p = &probs[i0 * tk..][..rows * tk]; // (rows, Tk)
            // dP = dO Vᵀ over the visible keys, into columns 0..n of the scratch.
            let v_t = Mat::transposed(&v[lo * d..hi * d], d); // (D, n)
            matmul(rows, n, d, ds, tk, do_blk, v_t, 1.0, false);
            // dS = P ∘ (dP − rowsum(dP ∘ P)); masked entries have P = 0, so dS = 0 there.
            for (p_row, ds_row) in p.chunks_exact(tk).zip(ds.chunks_exact_mut(tk)) {
                rows::softmax_backward_rows(&p_row[lo..hi], &mut ds_row[..n], n);
            }
            let span = (rows - 1) * tk + n;
            let ds_blk = Mat::rows(&ds[..span], tk); // (rows, n)
            let ds_t = Mat::transposed(&ds[..span], tk); // (n, rows)
            let p_t = Mat::transposed(&p[lo..lo + span], tk); // (n, rows)
            let k_blk = Mat::rows(&k[lo * d..hi * d], d); // (n, D)
            let q_blk = Mat::rows(&q[i0 * d..][..rows * d], d); // (rows, D)
            // dQ = scale · dS K;  dK += scale · dSᵀ Q;  dV += Pᵀ dO.
            matmul(rows, d, n, &mut dq[i0 * d..][..rows * d], d, ds_blk, k_blk, x.scale, false);
            matmul(n, d, rows, &mut dk[lo * d..hi * d], d, ds_t, q_blk, x.scale, true);
            matmul(n, d, rows, &mut dv[lo * d..hi * d], d, p_t, do_blk, 1.0, true);
        }
    }
}
