//! The launch shapes of `kernels/fused.cu`: how many blocks of how many threads each launch
//! of the device halves (module `cuda` and each op's `cuda` child) asks for, as plain numbers
//! (one-dimensional grids, no dynamic shared memory).
//!
//! Why a module of its own: the kernels also run without a GPU, on the kernel emulator
//! (`emulated`, the `cuda` feature off), and those tests must launch them exactly as the
//! production launcher does. Both take their grids from here, so a change to a launch shape
//! is tested where it is made; `cuda` converts a [`Grid`] into cudarc's `LaunchConfig`.

use candle_core::{Result, bail};

/// Threads per block of the row kernels (RMSNorm, cross-entropy): one block per row.
pub(super) const ROW_THREADS: u32 = 256;

/// Threads per block of the element-wise kernels.
pub(super) const ELEMENT_THREADS: u32 = 256;

/// Rows one block of RMSNorm's backward walks, adding their share of dw: the partial sums are
/// (blocks, d) f32, added in block order by `column_sums`. 16 gives B·T = 8192 rows 512
/// blocks, several per SM, so one block's reduction waits while another's loads run.
pub(super) const NORM_BWD_ROWS: usize = 16;

/// Columns one thread of RMSNorm's backward holds in registers (`NORM_BWD_COLS` in fused.cu).
pub(super) const NORM_BWD_COLS: usize = 8;

/// Blocks of the first pass of the sum of squares: enough to fill a large GPU several times
/// over.
pub(super) const SUMSQ_BLOCKS: usize = 1024;

/// A one-dimensional launch: `blocks` blocks of `threads` threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Grid {
    /// Blocks along x.
    pub blocks: u32,
    /// Threads a block, along x.
    pub threads: u32,
}

/// The block width of RMSNorm's backward for rows of `d`: whole warps, at least 256 and
/// enough that each thread holds at most [`NORM_BWD_COLS`] columns; rows past 1024 threads'
/// worth are refused.
pub(super) fn norm_bwd_threads(d: usize) -> Result<u32> {
    let needed = d.div_ceil(NORM_BWD_COLS).next_multiple_of(32).max(ROW_THREADS as usize);
    if needed > 1024 {
        bail!(
            "rms-norm: rows of {d} elements are beyond the GPU backward's {} (1024 threads of {NORM_BWD_COLS} columns)",
            1024 * NORM_BWD_COLS
        );
    }
    Ok(needed as u32)
}

/// A launch of `n` threads, `threads` a block.
fn spread(n: usize, threads: u32) -> Result<Grid> {
    let blocks = n.div_ceil(threads as usize);
    if blocks > i32::MAX as usize {
        bail!("a kernel launch of {n} threads exceeds the grid");
    }
    Ok(Grid { blocks: blocks as u32, threads })
}

/// One block of `threads` per row.
fn per_row(rows: usize, threads: u32) -> Result<Grid> {
    if rows > i32::MAX as usize {
        bail!("a kernel launch of {rows} rows exceeds the grid");
    }
    Ok(Grid { blocks: rows as u32, threads })
}

/// `rms_norm_fwd_*` on `rows` rows: a block of [`ROW_THREADS`] per row.
pub(super) fn rms_norm_fwd(rows: usize) -> Result<Grid> {
    per_row(rows, ROW_THREADS)
}

/// The blocks of RMSNorm's backward for `rows` rows, [`NORM_BWD_ROWS`] a block (the last
/// may have fewer): the rows of the (blocks, d) f32 partial sums of dw.
pub(super) fn norm_bwd_blocks(rows: usize) -> usize {
    rows.div_ceil(NORM_BWD_ROWS)
}

/// `rms_norm_bwd_*` on `rows` rows of `d`: [`norm_bwd_blocks`] blocks of
/// [`norm_bwd_threads`] threads.
pub(super) fn rms_norm_bwd(rows: usize, d: usize) -> Result<Grid> {
    per_row(norm_bwd_blocks(rows), norm_bwd_threads(d)?)
}

/// `column_sums_*` over `d` columns: a thread per column.
pub(super) fn column_sums(d: usize) -> Result<Grid> {
    spread(d, ELEMENT_THREADS)
}

/// An element-wise kernel on `n` elements, a thread each: the SwiGLU gate's, the roundings
/// and widenings.
pub(super) fn elementwise(n: usize) -> Result<Grid> {
    spread(n, ELEMENT_THREADS)
}

/// `heads_*` moving `n` elements: a thread per element when copying, per rotated pair
/// (element j and j + D/2 of a head row) when `rotating`.
pub(super) fn heads(n: usize, rotating: bool) -> Result<Grid> {
    spread(if rotating { n / 2 } else { n }, ELEMENT_THREADS)
}

/// `cross_entropy_fwd_*` and `cross_entropy_bwd_*` on `rows` rows of logits: a block of
/// [`ROW_THREADS`] per row.
pub(super) fn cross_entropy(rows: usize) -> Result<Grid> {
    per_row(rows, ROW_THREADS)
}

/// `embedding_bwd_*` for a table of `v` rows of `d`: a block per row, its threads the row's
/// columns (whole warps, at most [`ROW_THREADS`]: narrow rows leave no warp idle).
pub(super) fn embedding_bwd(v: usize, d: usize) -> Result<Grid> {
    per_row(v, (d.next_multiple_of(32) as u32).clamp(32, ROW_THREADS))
}

/// The blocks of the sum of squares' first pass over a tensor of `n` elements: one per
/// [`ELEMENT_THREADS`] elements, at least one (it writes the partial sum 0 of an empty
/// tensor) and at most [`SUMSQ_BLOCKS`] (the threads then stride over the rest).
pub(super) fn sumsq_blocks(n: usize) -> usize {
    n.div_ceil(ELEMENT_THREADS as usize).clamp(1, SUMSQ_BLOCKS)
}

/// The blocks each tensor owns in `sumsq_many_partial_*`, as a running count (tensors + 1,):
/// tensor i's [`sumsq_blocks`] are `first[i]..first[i + 1]`.
pub(super) fn sumsq_many_first(lens: &[usize]) -> Result<Vec<u32>> {
    let mut first = Vec::with_capacity(lens.len() + 1);
    let mut at = 0usize;
    first.push(0);
    for &n in lens {
        at += sumsq_blocks(n);
        first.push(u32::try_from(at).map_err(|_| candle_core::Error::Msg(format!("{at} blocks exceed the grid")))?);
    }
    Ok(first)
}

/// `sumsq_many_partial_*` over `blocks` blocks in all (the last of [`sumsq_many_first`]).
pub(super) fn sumsq_many_partial(blocks: usize) -> Result<Grid> {
    per_row(blocks, ELEMENT_THREADS)
}

/// `sumsq_many_final`: a block per tensor.
pub(super) fn sumsq_many_final(tensors: usize) -> Result<Grid> {
    per_row(tensors, ELEMENT_THREADS)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RMSNorm's backward block: 256 threads up to rows of 2048, then whole warps of 8
    /// columns a thread, up to 1024 threads (rows of 8192); wider rows are refused by name.
    #[test]
    fn the_norm_backward_block_grows_with_the_row_and_stops_at_1024_threads() {
        for (d, threads) in [(1, 256), (64, 256), (2048, 256), (2049, 288), (4100, 544), (8192, 1024)] {
            assert_eq!(norm_bwd_threads(d).unwrap(), threads, "d {d}");
            assert_eq!(rms_norm_bwd(37, d).unwrap(), Grid { blocks: 3, threads }, "d {d}");
        }
        let e = norm_bwd_threads(8193).unwrap_err().to_string();
        assert!(e.starts_with("rms-norm: rows of 8193 elements are beyond the GPU backward's 8192"), "{e}");
        assert_eq!(norm_bwd_blocks(0), 0);
        assert_eq!(norm_bwd_blocks(16), 1);
        assert_eq!(norm_bwd_blocks(17), 2);
    }

    /// Element-wise grids round up to whole blocks; a rotating heads move has a thread per
    /// pair; the sum of squares' first pass has between 1 and SUMSQ_BLOCKS blocks.
    #[test]
    fn grids_cover_every_element_in_whole_blocks() {
        assert_eq!(elementwise(1).unwrap(), Grid { blocks: 1, threads: 256 });
        assert_eq!(elementwise(256).unwrap(), Grid { blocks: 1, threads: 256 });
        assert_eq!(elementwise(257).unwrap(), Grid { blocks: 2, threads: 256 });
        assert_eq!(heads(1024, true).unwrap(), Grid { blocks: 2, threads: 256 });
        assert_eq!(heads(1024, false).unwrap(), Grid { blocks: 4, threads: 256 });
        assert_eq!(cross_entropy(5).unwrap(), Grid { blocks: 5, threads: 256 });
        assert_eq!((sumsq_blocks(0), sumsq_blocks(256), sumsq_blocks(257), sumsq_blocks(300_001)), (1, 1, 2, 1024));
        assert_eq!(sumsq_many_first(&[0, 300_001, 257]).unwrap(), [0, 1, 1025, 1027]);
        let e = elementwise(usize::MAX).unwrap_err().to_string();
        assert!(e.starts_with(&format!("a kernel launch of {} threads exceeds the grid", usize::MAX)), "{e}");
        let e = rms_norm_fwd(1 << 31).unwrap_err().to_string();
        assert!(e.starts_with("a kernel launch of 2147483648 rows exceeds the grid"), "{e}");
    }
}
