//! Which keys each query row sees.
//!
//! A [`Mask`] is a [`Pattern`] placed on a (Tq, Tk) score matrix. Query row `i` sits at
//! position `p = i + (Tk − Tq)` (queries are the last Tq positions, as when decoding against
//! a cache), and every pattern lets a row see at least its own position, so no softmax is
//! ever over zero keys. Kernels ask three questions:
//!
//! - [`Mask::key_span`]: the keys a run of rows can see lie in `lo..hi` (the dense kernel
//!   multiplies only those columns);
//! - [`Mask::tile`]: is a (rows × keys) tile [`Tile::Skip`], [`Tile::Full`] or
//!   [`Tile::Partial`] (the tiled kernel skips the first and masks only the last);
//! - [`Mask::mask_row`]: write −∞ over the masked keys of one row of a tile.
//!
//! Segment ids (packed documents, [`Mask::with_segments`]) narrow every interval pattern to
//! the query's own document: with ids non-decreasing along a sequence a document is a run
//! of positions `start..end`, so row `i`'s keys become the intersection of its interval with
//! its document's run. The intervals still move right with the row and still touch (a row
//! always sees its own position), which is all the tile answers rely on. A mask with
//! segments holds the whole batch's; the kernels pick one sequence's with
//! [`Mask::sequence`] before asking anything.
//!
//! Patterns:
//!
//! ```text
//! Full              every key
//! Causal            j <= p
//! Window (causal)   p − w < j <= p          (Mistral, Longformer's causal form)
//! Window (both)     |p − j| < w             (Longformer)
//! Blocks            block pairs (P, K) = (p / s, j / s) that are local (|P − K| < local),
//!                   global (K < global or P < global) or strided ((P − K) % stride = 0),
//!                   and, when causal, j <= p inside them   (BigBird / Sparse Transformer)
//! ```

use ava_core::PluginError;

/// The mask a kernel applies, independent of the lengths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pattern {
    /// Every query sees every key.
    Full,
    /// Query at position `p` sees keys `j <= p`.
    Causal,
    /// A band of `window` positions: `p − window < j <= p` when causal, `|p − j| < window`
    /// otherwise.
    Window {
        /// Positions in the band, the query's own included (>= 1).
        window: usize,
        /// Causal band (looks back only) or symmetric band.
        causal: bool,
    },
    /// A block pattern; see [`BlockPattern`].
    Blocks(BlockPattern),
}

/// Block-sparse attention: positions grouped in blocks of `block` and a block pair visible
/// when it is local, global or strided (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockPattern {
    /// Positions per block (>= 1).
    pub block: usize,
    /// Block distance below which a pair is visible (>= 1: a block sees itself).
    pub local: usize,
    /// The first `global` blocks see and are seen by every block.
    pub global: usize,
    /// Block pairs whose distance is a multiple of `stride` are visible; 0 turns it off.
    pub stride: usize,
    /// Whether keys after the query's position are hidden.
    pub causal: bool,
}

impl BlockPattern {
    /// Whether query block `qb` sees key block `kb` (before the causal cut inside the pair).
    pub fn visible(&self, qb: usize, kb: usize) -> bool {
        if self.causal && kb > qb {
            return false;
        }
        let dist = qb.abs_diff(kb);
        dist < self.local
            || kb < self.global
            || qb < self.global
            || (self.stride > 0 && dist.is_multiple_of(self.stride))
    }
}

/// How much of a tile a mask lets through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tile {
    /// No element is visible: the tile is not computed.
    Skip,
    /// Every element is visible: no masking needed.
    Full,
    /// Some elements are visible: masked row by row with [`Mask::mask_row`].
    Partial,
}

/// A [`Pattern`] on a Tq × Tk score matrix, optionally cut by segment ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mask<'a> {
    pattern: Pattern,
    tq: usize,
    tk: usize,
    /// Position of query row 0: Tk − Tq (0 for self-attention).
    offset: usize,
    /// Segment ids: empty (none), the whole batch's (B·Tk), or once [`Mask::sequence`] has
    /// picked one, that sequence's (Tk).
    segments: &'a [u32],
    /// Whether `segments` is one sequence's.
    picked: bool,
}

impl Mask<'static> {
    /// Places `pattern` on a `tq × tk` score matrix. Every pattern but `Full` needs
    /// `tq <= tk` (queries are the last positions) and its sizes at least 1.
    pub fn new(pattern: Pattern, tq: usize, tk: usize) -> Result<Self, PluginError> {
        let bad = |m: String| Err(PluginError::invalid_input(m));
        if tk == 0 && tq > 0 {
            return bad("attention over zero keys (kv_len = 0) is undefined".into());
        }
        if pattern != Pattern::Full && tq > tk {
            return bad(format!(
                "a masked attention needs q_len ({tq}) <= kv_len ({tk}): queries are the last positions of the keys"
            ));
        }
        match pattern {
            Pattern::Window { window: 0, .. } => return bad("window must be at least 1".into()),
            Pattern::Blocks(b) if b.block == 0 => return bad("block_size must be at least 1".into()),
            Pattern::Blocks(b) if b.local == 0 => {
                return bad("num_local_blocks must be at least 1 (a block must see itself)".into());
            }
            _ => {}
        }
        Ok(Self { pattern, tq, tk, offset: tk.saturating_sub(tq), segments: &[], picked: false })
    }
}

impl<'a> Mask<'a> {
    /// The same mask, with each query also limited to the keys of its own segment:
    /// `segments` holds B·Tk ids, non-decreasing along each sequence (checked by
    /// [`ava_core::AttnShape::check_segments`]); empty means none. Block patterns refuse them.
    pub fn with_segments<'b>(self, segments: &'b [u32]) -> Result<Mask<'b>, PluginError> {
        if !segments.is_empty() {
            if let Pattern::Blocks(_) = self.pattern {
                return Err(PluginError::unsupported(
                    "block-sparse attention does not take segment ids (packed documents): its blocks are fixed \
                     positions, not documents",
                ));
            }
            if self.tk == 0 || !segments.len().is_multiple_of(self.tk) {
                return Err(PluginError::invalid_input(format!(
                    "{} segment ids are not a whole number of sequences of {} keys",
                    segments.len(),
                    self.tk
                )));
            }
        }
        let Mask { pattern, tq, tk, offset, .. } = self;
        Ok(Mask { pattern, tq, tk, offset, segments, picked: false })
    }

    /// The mask of sequence `b` of the batch (itself when there are no segments).
    pub fn sequence(&self, b: usize) -> Mask<'a> {
        if self.segments.is_empty() {
            return *self;
        }
        debug_assert!(!self.picked, "a sequence's mask picked again");
        Mask { segments: &self.segments[b * self.tk..][..self.tk], picked: true, ..*self }
    }

    /// The segment ids it holds (see [`Mask::with_segments`]).
    pub fn segments(&self) -> &'a [u32] {
        self.segments
    }

    /// The positions `start..end` of the segment holding position `p` (all keys without
    /// segments).
    fn segment_of(&self, p: usize) -> (usize, usize) {
        if self.segments.is_empty() {
            return (0, self.tk);
        }
        debug_assert!(self.picked, "a batch's mask asked about one sequence: call Mask::sequence first");
        let id = self.segments[p];
        // Ids are non-decreasing, so the segment is the run of positions holding `id`.
        (self.segments.partition_point(|&s| s < id), self.segments.partition_point(|&s| s <= id))
    }

    /// The pattern.
    pub fn pattern(&self) -> Pattern {
        self.pattern
    }

    /// Query length Tq.
    pub fn q_len(&self) -> usize {
        self.tq
    }

    /// Key length Tk.
    pub fn kv_len(&self) -> usize {
        self.tk
    }

    /// Position of query row `i` among the keys.
    fn pos(&self, i: usize) -> usize {
        i + self.offset
    }

    /// For the interval patterns: row `i` sees exactly `lo..hi`; both ends are
    /// non-decreasing in `i` and consecutive rows' intervals touch. `None` for blocks.
    /// With segments, the interval cut to the row's segment.
    fn interval(&self, i: usize) -> Option<(usize, usize)> {
        let p = self.pos(i);
        let (lo, hi) = match self.pattern {
            Pattern::Full => (0, self.tk),
            Pattern::Causal => (0, p + 1),
            Pattern::Window { window, causal: true } => ((p + 1).saturating_sub(window), p + 1),
            Pattern::Window { window, causal: false } => ((p + 1).saturating_sub(window), (p + window).min(self.tk)),
            Pattern::Blocks(_) => return None,
        };
        let (start, end) = self.segment_of(p);
        Some((lo.max(start), hi.min(end)))
    }

    /// Whether row `i` sees key `j` (the definition the other methods must agree with).
    pub fn visible(&self, i: usize, j: usize) -> bool {
        if j >= self.tk {
            return false;
        }
        match (self.interval(i), self.pattern) {
            (Some((lo, hi)), _) => lo <= j && j < hi,
            (None, Pattern::Blocks(b)) => {
                let p = self.pos(i);
                b.visible(p / b.block, j / b.block) && !(b.causal && j > p)
            }
            (None, _) => unreachable!("only block patterns have no interval"),
        }
    }

    /// Keys rows `i0..i1` can see lie in `lo..hi` (exact for the interval patterns, the
    /// causal bound for blocks).
    pub fn key_span(&self, i0: usize, i1: usize) -> (usize, usize) {
        debug_assert!(i0 < i1 && i1 <= self.tq);
        match (self.interval(i0), self.interval(i1 - 1), self.pattern) {
            (Some((lo, _)), Some((_, hi)), _) => (lo, hi),
            (_, _, Pattern::Blocks(b)) if b.causal => (0, self.pos(i1 - 1) + 1),
            _ => (0, self.tk),
        }
    }

    /// Query rows that may see a key in `j0..j1` lie in `lo..hi` (a bound; tiles inside it
    /// can still be [`Tile::Skip`]).
    pub fn row_span(&self, j0: usize, j1: usize) -> (usize, usize) {
        let off = self.offset;
        // Rows whose position p lies in p_lo..p_hi (and in the segments of keys j0..j1, when
        // there are segments), clipped to 0..Tq. Without segments the keys bound no position:
        // the full pattern takes Tq > Tk, and its last rows' positions lie past the last key.
        let (first, last) =
            if self.segments.is_empty() { (0, usize::MAX) } else { (self.segment_of(j0).0, self.segment_of(j1 - 1).1) };
        let rows = |p_lo: usize, p_hi: usize| {
            let clip = |p: usize| p.saturating_sub(off).min(self.tq);
            let (lo, hi) = (clip(p_lo.max(first)), clip(p_hi.min(last)));
            (lo, hi.max(lo))
        };
        match self.pattern {
            Pattern::Full => rows(0, usize::MAX),
            Pattern::Causal => rows(j0, usize::MAX),
            // p − w < j  ⇔  p < j + w: keys up to j1 − 1 are seen by positions below j1 − 1 + w.
            Pattern::Window { window, causal: true } => rows(j0, j1 - 1 + window),
            Pattern::Window { window, causal: false } => rows((j0 + 1).saturating_sub(window), j1 - 1 + window),
            Pattern::Blocks(b) if b.causal => rows(j0, usize::MAX),
            Pattern::Blocks(_) => (0, self.tq),
        }
    }

    /// How much of the tile rows `i0..i1` × keys `j0..j1` is visible.
    pub fn tile(&self, i0: usize, i1: usize, j0: usize, j1: usize) -> Tile {
        debug_assert!(i0 < i1 && i1 <= self.tq && j0 < j1 && j1 <= self.tk);
        if let (Some((first_lo, first_hi)), Some((last_lo, last_hi))) = (self.interval(i0), self.interval(i1 - 1)) {
            // Intervals move right with the row and touch, so their union is first_lo..last_hi.
            return if j1 <= first_lo || j0 >= last_hi {
                Tile::Skip
            } else if last_lo <= j0 && first_hi >= j1 {
                Tile::Full
            } else {
                Tile::Partial
            };
        }
        let Pattern::Blocks(b) = self.pattern else { unreachable!("only block patterns have no interval") };
        let (p0, p1) = (self.pos(i0), self.pos(i1 - 1));
        if b.causal && j0 > p1 {
            return Tile::Skip;
        }
        let (mut any, mut all) = (false, true);
        for qb in p0 / b.block..=p1 / b.block {
            for kb in j0 / b.block..=(j1 - 1) / b.block {
                let v = b.visible(qb, kb);
                any |= v;
                all &= v;
            }
        }
        if !any {
            Tile::Skip
        } else if all && !(b.causal && j1 - 1 > p0) {
            Tile::Full
        } else {
            Tile::Partial
        }
    }

    /// Writes −∞ over the keys of row `i` in `j0..j0 + row.len()` that the mask hides.
    pub fn mask_row(&self, i: usize, j0: usize, row: &mut [f32]) {
        let j1 = j0 + row.len();
        if let Some((lo, hi)) = self.interval(i) {
            let (a, b) = (lo.clamp(j0, j1) - j0, hi.clamp(j0, j1) - j0);
            row[..a].fill(f32::NEG_INFINITY);
            row[b.max(a)..].fill(f32::NEG_INFINITY);
            return;
        }
        let Pattern::Blocks(bp) = self.pattern else { unreachable!("only block patterns have no interval") };
        let p = self.pos(i);
        let qb = p / bp.block;
        let mut j = j0;
        while j < j1 {
            let kb = j / bp.block;
            let end = ((kb + 1) * bp.block).min(j1);
            if !bp.visible(qb, kb) {
                row[j - j0..end - j0].fill(f32::NEG_INFINITY);
            }
            j = end;
        }
        if bp.causal && p + 1 < j1 {
            row[(p + 1).max(j0) - j0..].fill(f32::NEG_INFINITY);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn patterns() -> Vec<Pattern> {
        let mut v = vec![Pattern::Full, Pattern::Causal];
        for window in [1, 2, 3, 5, 40] {
            for causal in [true, false] {
                v.push(Pattern::Window { window, causal });
            }
        }
        for (block, local, global, stride) in [(1, 1, 0, 0), (2, 1, 1, 0), (3, 2, 1, 3), (4, 1, 0, 2), (5, 3, 2, 0)] {
            for causal in [true, false] {
                v.push(Pattern::Blocks(BlockPattern { block, local, global, stride, causal }));
            }
        }
        v
    }

    /// Segment ids over `tk` keys: documents of lengths cycling through 1, 3, 2, 5.
    fn documents(tk: usize) -> Vec<u32> {
        let mut ids = Vec::with_capacity(tk);
        for (id, len) in [1usize, 3, 2, 5].iter().cycle().enumerate() {
            if ids.len() >= tk {
                break;
            }
            ids.extend(std::iter::repeat_n(id as u32 * 2, (*len).min(tk - ids.len())));
        }
        ids
    }

    /// Every answer the kernels use agrees with `visible`, over all tiles of a few grids, and
    /// with segment ids `visible` is the pattern's and the ids' equality.
    #[test]
    fn tiles_rows_and_spans_agree_with_visible() {
        for pattern in patterns() {
            for (tq, tk) in [(1, 1), (7, 7), (13, 13), (3, 11), (1, 9)] {
                let plain = Mask::new(pattern, tq, tk).unwrap();
                let ids = documents(tk);
                let segmented = plain.with_segments(&ids).map(|m| m.sequence(0));
                if let Pattern::Blocks(_) = pattern {
                    assert!(segmented.is_err(), "{pattern:?} takes segments");
                }
                for m in [Some(plain), segmented.ok()].into_iter().flatten() {
                    for i in 0..tq {
                        let p = i + tk - tq;
                        for j in 0..tk {
                            let same = m.segments().is_empty() || ids[j] == ids[p];
                            assert_eq!(m.visible(i, j), plain.visible(i, j) && same, "{pattern:?} ({i}, {j}) {ids:?}");
                        }
                    }
                    check_tiles(&m, pattern, tq, tk);
                }
            }
        }
    }

    fn check_tiles(m: &Mask<'_>, pattern: Pattern, tq: usize, tk: usize) {
        for i in 0..tq {
            assert!(m.visible(i, i + tk - tq), "{pattern:?} row {i} must see its own position");
        }
        for (br, bc) in [(1, 1), (2, 3), (4, 4), (5, 2)] {
            for i0 in (0..tq).step_by(br) {
                let i1 = (i0 + br).min(tq);
                let (klo, khi) = m.key_span(i0, i1);
                for j0 in (0..tk).step_by(bc) {
                    let j1 = (j0 + bc).min(tk);
                    let cells: Vec<bool> =
                        (i0..i1).flat_map(|i| (j0..j1).map(move |j| (i, j))).map(|(i, j)| m.visible(i, j)).collect();
                    let kind = m.tile(i0, i1, j0, j1);
                    let segmented = !m.segments().is_empty();
                    let ctx =
                        format!("{pattern:?} {tq}x{tk} segments {segmented} tile rows {i0}..{i1} keys {j0}..{j1}");
                    match kind {
                        Tile::Skip => assert!(cells.iter().all(|c| !c), "{ctx}: Skip hides a visible key"),
                        Tile::Full => assert!(cells.iter().all(|&c| c), "{ctx}: Full shows a masked key"),
                        Tile::Partial => {}
                    }
                    let (rlo, rhi) = m.row_span(j0, j1);
                    for i in i0..i1 {
                        let mut row = vec![0.0f32; j1 - j0];
                        m.mask_row(i, j0, &mut row);
                        for j in j0..j1 {
                            let shown = row[j - j0] == 0.0;
                            assert_eq!(shown, m.visible(i, j), "{ctx}: mask_row({i}) at key {j}");
                            if m.visible(i, j) {
                                assert!(klo <= j && j < khi, "{ctx}: key {j} outside key_span");
                                assert!(rlo <= i && i < rhi, "{ctx}: row {i} outside row_span");
                            }
                        }
                    }
                }
            }
        }
    }

    /// Interval and block tiles are exact where the kernels rely on it: a block pattern with
    /// block = tile size has no Partial tiles off the diagonal.
    #[test]
    fn aligned_block_tiles_are_full_or_skipped() {
        let b = BlockPattern { block: 4, local: 2, global: 1, stride: 3, causal: true };
        let m = Mask::new(Pattern::Blocks(b), 32, 32).unwrap();
        for qb in 0..8 {
            for kb in 0..8 {
                let t = m.tile(qb * 4, qb * 4 + 4, kb * 4, kb * 4 + 4);
                let want = if kb > qb {
                    Tile::Skip
                } else if kb == qb {
                    Tile::Partial
                } else if b.visible(qb, kb) {
                    Tile::Full
                } else {
                    Tile::Skip
                };
                assert_eq!(t, want, "block ({qb}, {kb})");
            }
        }
        // Strided: distance 3 and 6 visible, 4 and 5 not (local covers 0 and 1, global block 0).
        assert!(b.visible(6, 3) && b.visible(6, 0) && !b.visible(6, 2) && !b.visible(5, 1) && b.visible(7, 6));
    }

    /// A window at least as long as the keys is plain causal (or full) attention.
    #[test]
    fn long_windows_are_causal_or_full() {
        let w = Mask::new(Pattern::Window { window: 9, causal: true }, 9, 9).unwrap();
        let c = Mask::new(Pattern::Causal, 9, 9).unwrap();
        let wb = Mask::new(Pattern::Window { window: 9, causal: false }, 9, 9).unwrap();
        for i in 0..9 {
            for j in 0..9 {
                assert_eq!(w.visible(i, j), c.visible(i, j));
                assert!(wb.visible(i, j));
            }
        }
    }

    #[test]
    fn bad_masks_are_refused() {
        let err = |p, tq, tk| Mask::new(p, tq, tk).unwrap_err().message.to_string();
        assert_eq!(err(Pattern::Window { window: 0, causal: true }, 4, 4), "window must be at least 1");
        assert_eq!(
            err(Pattern::Causal, 5, 4),
            "a masked attention needs q_len (5) <= kv_len (4): queries are the last positions of the keys"
        );
        let b = BlockPattern { block: 4, local: 0, global: 0, stride: 0, causal: true };
        assert_eq!(err(Pattern::Blocks(b), 4, 4), "num_local_blocks must be at least 1 (a block must see itself)");
        assert!(Mask::new(Pattern::Full, 5, 4).is_ok());
    }
}
