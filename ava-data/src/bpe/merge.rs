//! A BPE's merges applied to one pre-token: start from its bytes' ids and merge the adjacent
//! pair of lowest rank (the leftmost among equals) until no pair has a merge.
//!
//! Short pre-tokens (nearly all) rescan an array of pair ranks; long ones use the `tokenizers`
//! crate's own procedure (a heap of candidate merges, stale entries skipped by the id they
//! would make), so that a long run of digits or symbols costs O(n log n). Both give the same
//! ids: a stale heap entry always covers fewer bytes than the pair now at its place, so it
//! would make another token (a tokenizer.json maps distinct strings to distinct ids, which
//! [`load`](super::load) checks), and every live pair is in the heap; so the heap too merges
//! the live pair of lowest (rank, position) each time.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use super::cache::FastBuild;

/// No merge (and no neighbour).
const NONE: u32 = u32::MAX;
/// Pre-tokens up to this many bytes are merged by rescanning.
const SHORT: usize = 64;

/// The merges of a byte-level BPE.
pub(crate) struct Merges {
    /// `left << 32 | right` to the rank of their merge.
    ranks: HashMap<u64, u32, FastBuild>,
    /// The id each rank's merge makes.
    made: Vec<u32>,
    /// Each byte's id.
    bytes: [u32; 256],
}

#[derive(Clone, Copy)]
struct Symbol {
    id: u32,
    prev: u32,
    next: u32,
    /// 0 once merged into its left neighbour.
    len: u32,
}

/// Buffers reused from one pre-token to the next.
#[derive(Default)]
pub(crate) struct MergeScratch {
    ids: Vec<u32>,
    ranks: Vec<u32>,
    symbols: Vec<Symbol>,
    heap: BinaryHeap<Reverse<(u32, u32)>>,
}

impl MergeScratch {
    /// Frees buffers a very long pre-token grew beyond `max_bytes` (they would otherwise stay
    /// for the life of the thread); ordinary words reuse them.
    pub(crate) fn trim(&mut self, max_bytes: usize) {
        let held = self.ids.capacity() * size_of::<u32>()
            + self.ranks.capacity() * size_of::<u32>()
            + self.symbols.capacity() * size_of::<Symbol>()
            + self.heap.capacity() * size_of::<Reverse<(u32, u32)>>();
        if held > max_bytes {
            *self = Self::default();
        }
    }
}

impl Merges {
    /// From each byte's id and the merges `(left, right, made)` by rank, lowest first; a pair
    /// listed again takes its later rank, as in the `tokenizers` crate's map.
    pub(crate) fn new(bytes: [u32; 256], merges: impl ExactSizeIterator<Item = (u32, u32, u32)>) -> Self {
        let mut ranks = HashMap::with_capacity_and_hasher(merges.len(), FastBuild::default());
        let mut made = Vec::with_capacity(merges.len());
        for (rank, (left, right, new)) in merges.enumerate() {
            ranks.insert(pair(left, right), rank as u32);
            made.push(new);
        }
        Self { ranks, made, bytes }
    }

    /// The id of byte `b`.
    #[inline]
    pub(crate) fn byte(&self, b: u8) -> u32 {
        self.bytes[b as usize]
    }

    #[inline]
    fn rank(&self, left: u32, right: u32) -> u32 {
        self.ranks.get(&pair(left, right)).copied().unwrap_or(NONE)
    }

    /// Appends the ids of `word` (not empty) to `out`.
    pub(crate) fn apply(&self, word: &[u8], scratch: &mut MergeScratch, out: &mut Vec<u32>) {
        if word.len() <= SHORT { self.apply_short(word, scratch, out) } else { self.apply_long(word, scratch, out) }
    }

    fn apply_short(&self, word: &[u8], scratch: &mut MergeScratch, out: &mut Vec<u32>) {
        let MergeScratch { ids, ranks, .. } = scratch;
        ids.clear();
        ids.extend(word.iter().map(|&b| self.byte(b)));
        ranks.clear();
        ranks.extend(ids.windows(2).map(|w| self.rank(w[0], w[1])));
        loop {
            let (mut best, mut at) = (NONE, 0);
            for (i, &r) in ranks.iter().enumerate() {
                if r < best {
                    (best, at) = (r, i);
                }
            }
            if best == NONE {
                break;
            }
            ids[at] = self.made[best as usize];
            ids.remove(at + 1);
            ranks.remove(at);
            if at > 0 {
                ranks[at - 1] = self.rank(ids[at - 1], ids[at]);
            }
            if at < ranks.len() {
                ranks[at] = self.rank(ids[at], ids[at + 1]);
            }
        }
        out.extend_from_slice(ids);
    }

    fn apply_long(&self, word: &[u8], scratch: &mut MergeScratch, out: &mut Vec<u32>) {
        let MergeScratch { symbols, heap, .. } = scratch;
        let n = word.len() as u32;
        symbols.clear();
        symbols.extend(word.iter().zip(0..n).map(|(&b, i)| Symbol {
            id: self.byte(b),
            prev: if i == 0 { NONE } else { i - 1 },
            next: if i + 1 < n { i + 1 } else { NONE },
            len: 1,
        }));
        heap.clear();
        for (i, w) in symbols.windows(2).enumerate() {
            let r = self.rank(w[0].id, w[1].id);
            if r != NONE {
                heap.push(Reverse((r, i as u32)));
            }
        }
        while let Some(Reverse((rank, at))) = heap.pop() {
            let at = at as usize;
            let left = symbols[at];
            if left.len == 0 || left.next == NONE {
                continue;
            }
            let right = symbols[left.next as usize];
            let made = self.made[rank as usize];
            let now = self.rank(left.id, right.id);
            if now == NONE || self.made[now as usize] != made {
                continue;
            }
            symbols[at] = Symbol { id: made, prev: left.prev, next: right.next, len: left.len + right.len };
            symbols[left.next as usize].len = 0;
            if right.next != NONE {
                symbols[right.next as usize].prev = at as u32;
            }
            if left.prev != NONE {
                let r = self.rank(symbols[left.prev as usize].id, made);
                if r != NONE {
                    heap.push(Reverse((r, left.prev)));
                }
            }
            if right.next != NONE {
                let r = self.rank(made, symbols[right.next as usize].id);
                if r != NONE {
                    heap.push(Reverse((r, at as u32)));
                }
            }
        }
        out.extend(symbols.iter().filter(|s| s.len != 0).map(|s| s.id));
    }
}

#[inline]
fn pair(left: u32, right: u32) -> u64 {
    (u64::from(left) << 32) | u64::from(right)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Rng;

    /// Random merges over the bytes `a`..=`e`, ids by string as in a real vocabulary (two
    /// pairs spelling the same string make the same id).
    fn random_merges(rng: &mut Rng, count: usize) -> Merges {
        let mut tokens: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        let mut ids: HashMap<Vec<u8>, u32> = tokens.iter().cloned().zip(0..).collect();
        let mut merges = Vec::new();
        let small: Vec<u32> = (u32::from(b'a')..=u32::from(b'e')).collect();
        let mut usable = small.clone();
        while merges.len() < count {
            let l = usable[rng.below(usable.len() as u64) as usize];
            let r = usable[rng.below(usable.len() as u64) as usize];
            let s = [tokens[l as usize].clone(), tokens[r as usize].clone()].concat();
            if s.len() > 12 {
                continue;
            }
            let next = tokens.len() as u32;
            let made = *ids.entry(s.clone()).or_insert_with(|| {
                tokens.push(s);
                usable.push(next);
                next
            });
            merges.push((l, r, made));
        }
        Merges::new(std::array::from_fn(|b| b as u32), merges.into_iter())
    }

    #[test]
    fn rescanning_and_the_heap_agree() {
        let mut rng = Rng::new(5);
        let mut scratch = MergeScratch::default();
        for table in 0..20 {
            let merges = random_merges(&mut rng, 50 + 30 * table);
            for _ in 0..200 {
                let len = 1 + rng.below(150) as usize;
                let word: Vec<u8> = (0..len).map(|_| b'a' + rng.below(5) as u8).collect();
                let (mut short, mut long) = (Vec::new(), Vec::new());
                merges.apply_short(&word, &mut scratch, &mut short);
                merges.apply_long(&word, &mut scratch, &mut long);
                assert_eq!(short, long, "{}", String::from_utf8_lossy(&word));
                assert!(short.len() <= word.len());
            }
        }
    }

    #[test]
    fn lowest_rank_first_then_leftmost() {
        // a b -> x (rank 0), b c -> y (rank 1), x c -> z (rank 2), a a -> w (rank 3)
        let (a, b, c) = (u32::from(b'a'), u32::from(b'b'), u32::from(b'c'));
        let merges = Merges::new(
            std::array::from_fn(|b| b as u32),
            [(a, b, 300), (b, c, 301), (300, c, 302), (a, a, 303)].into_iter(),
        );
        let mut scratch = MergeScratch::default();
        let run = |word: &[u8], scratch: &mut MergeScratch| {
            let mut out = Vec::new();
            merges.apply(word, scratch, &mut out);
            out
        };
        assert_eq!(run(b"abc", &mut scratch), [302]);
        assert_eq!(run(b"bc", &mut scratch), [301]);
        assert_eq!(run(b"aaa", &mut scratch), [303, a]);
        assert_eq!(run(b"aab", &mut scratch), [a, 300]);
        assert_eq!(run(b"q", &mut scratch), [u32::from(b'q')]);
    }
}
