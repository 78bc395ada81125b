//! A bounded map from a pre-token's bytes to its ids, one per thread: most pre-tokens of a
//! corpus are words seen before, and a lookup costs far less than merging.
//!
//! Open addressing over arenas (no allocation per entry); when it holds [`MAX_ENTRIES`] words
//! or [`MAX_BYTES`] of them it is emptied and refills, which keeps its memory bounded on any
//! corpus (about 7 MiB per thread at most).

use std::hash::{BuildHasherDefault, Hasher};

/// Pre-tokens longer than this are not cached (as the `tokenizers` crate's cache).
pub(crate) const MAX_KEY: usize = 255;
/// Slots of the table; at most half are used, so probes stay short.
const SLOTS: usize = 1 << 17;
const MAX_ENTRIES: usize = SLOTS / 2;
/// Bytes of cached words at most (their ids are at most as many).
const MAX_BYTES: usize = 1 << 20;

/// A multiplier with well-mixed bits (2^64 / φ, odd).
const K: u64 = 0x9e37_79b9_7f4a_7c15;

/// A hash of `bytes` whose high bits are well mixed.
#[inline]
pub(crate) fn hash(bytes: &[u8]) -> u64 {
    let mut h = bytes.len() as u64;
    let mut chunks = bytes.chunks_exact(8);
    for chunk in &mut chunks {
        h = (h.rotate_left(23) ^ u64::from_le_bytes(chunk.try_into().expect("8 bytes"))).wrapping_mul(K);
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        let mut last = [0u8; 8];
        last[..rest.len()].copy_from_slice(rest);
        h = (h.rotate_left(23) ^ u64::from_le_bytes(last)).wrapping_mul(K);
    }
    h
}

/// A fast hasher for the encoder's own maps (keys are ids and byte strings from a
/// tokenizer.json, not from an adversary who could aim at collisions).
#[derive(Default, Clone, Copy)]
pub(crate) struct FastHasher(u64);

impl Hasher for FastHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        self.0 = (self.0.rotate_left(23) ^ hash(bytes)).wrapping_mul(K);
    }

    #[inline]
    fn write_u64(&mut self, x: u64) {
        self.0 = (self.0.rotate_left(23) ^ x).wrapping_mul(K);
    }

    #[inline]
    fn write_usize(&mut self, x: usize) {
        self.write_u64(x as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        // The product's high bits are its best; hash tables index with the low ones.
        self.0.rotate_left(32)
    }
}

/// Builds [`FastHasher`]s.
pub(crate) type FastBuild = BuildHasherDefault<FastHasher>;

#[derive(Clone, Copy, Default)]
struct Slot {
    /// High bits of the hash, to skip most mismatches without comparing bytes.
    tag: u32,
    key_at: u32,
    ids_at: u32,
    /// 0: empty (pre-tokens are never empty).
    key_len: u16,
    ids_len: u16,
}

/// The cache (see the module docs).
pub(crate) struct WordCache {
    slots: Box<[Slot]>,
    entries: usize,
    keys: Vec<u8>,
    ids: Vec<u32>,
}

impl WordCache {
    pub(crate) fn new() -> Self {
        Self { slots: vec![Slot::default(); SLOTS].into_boxed_slice(), entries: 0, keys: Vec::new(), ids: Vec::new() }
    }

    /// Empties it.
    pub(crate) fn clear(&mut self) {
        if self.entries > 0 {
            self.slots.fill(Slot::default());
            self.entries = 0;
            self.keys.clear();
            self.ids.clear();
        }
    }

    #[inline]
    fn first_slot(h: u64) -> usize {
        (h >> (64 - SLOTS.trailing_zeros())) as usize
    }

    /// The ids of `word` (whose [`hash`] is `h`), if cached.
    #[inline]
    pub(crate) fn get(&self, h: u64, word: &[u8]) -> Option<&[u32]> {
        let tag = h as u32;
        let mut i = Self::first_slot(h);
        loop {
            let slot = &self.slots[i];
            if slot.key_len == 0 {
                return None;
            }
            if slot.tag == tag && slot.key_len as usize == word.len() {
                let at = slot.key_at as usize;
                if &self.keys[at..at + word.len()] == word {
                    let at = slot.ids_at as usize;
                    return Some(&self.ids[at..at + slot.ids_len as usize]);
                }
            }
            i = (i + 1) & (SLOTS - 1);
        }
    }

    /// Caches `ids` for `word` (not cached yet; at most [`MAX_KEY`] bytes, as many ids).
    pub(crate) fn insert(&mut self, h: u64, word: &[u8], ids: &[u32]) {
        debug_assert!(!word.is_empty() && word.len() <= MAX_KEY && ids.len() <= word.len());
        if self.entries >= MAX_ENTRIES || self.keys.len() + word.len() > MAX_BYTES {
            self.clear();
        }
        let mut i = Self::first_slot(h);
        while self.slots[i].key_len != 0 {
            i = (i + 1) & (SLOTS - 1);
        }
        self.slots[i] = Slot {
            tag: h as u32,
            key_at: self.keys.len() as u32,
            ids_at: self.ids.len() as u32,
            key_len: word.len() as u16,
            ids_len: ids.len() as u16,
        };
        self.keys.extend_from_slice(word);
        self.ids.extend_from_slice(ids);
        self.entries += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn it_finds_what_it_holds_and_empties_itself_when_full() {
        let mut cache = WordCache::new();
        let word = |i: usize| format!("w{i}").into_bytes();
        for i in 0..1000 {
            let w = word(i);
            assert!(cache.get(hash(&w), &w).is_none());
            cache.insert(hash(&w), &w, &[i as u32, 7]);
        }
        for i in 0..1000 {
            let w = word(i);
            assert_eq!(cache.get(hash(&w), &w), Some(&[i as u32, 7][..]));
        }
        assert!(cache.get(hash(b"w1000"), b"w1000").is_none());
        for i in 1000..MAX_ENTRIES + 1 {
            let w = word(i);
            cache.insert(hash(&w), &w, &[1]);
        }
        // The insert past MAX_ENTRIES emptied it first.
        assert_eq!(cache.entries, 1);
        assert!(cache.get(hash(&word(0)), &word(0)).is_none());
        let last = word(MAX_ENTRIES);
        assert_eq!(cache.get(hash(&last), &last), Some(&[1][..]));
        // So does one past MAX_BYTES of words.
        cache.clear();
        let long = vec![b'x'; MAX_KEY];
        for i in 0..MAX_BYTES / MAX_KEY + 1 {
            let mut w = long.clone();
            w[..8].copy_from_slice(&(i as u64).to_le_bytes());
            cache.insert(hash(&w), &w, &[2]);
        }
        assert_eq!(cache.entries, 1);
        assert!(cache.keys.len() <= MAX_BYTES && cache.ids.len() <= MAX_BYTES);
    }
}
