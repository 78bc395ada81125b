//! [`ByteLevelBpe`]: our encoder for byte-level BPE tokenizer.json files, giving the ids of
//! the `tokenizers` crate's `encode_fast(text, false)` an order of magnitude faster: no
//! allocation per pre-token, a hand-made pre-tokenizer instead of a backtracking regex, merges
//! on byte ids, and a per-thread cache of pre-tokens seen.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use super::added::{AddedTokens, Piece};
use super::cache::{self, FastBuild, MAX_KEY, WordCache};
use super::load::{self, Unsupported};
use super::merge::{MergeScratch, Merges};
use super::pretokenize::{Classes, PreTokens, classes};

/// A byte-level BPE encoder (see the module docs); build one with [`ByteLevelBpe::new`].
/// `Send + Sync`: each thread that encodes keeps its own cache (about 7 MiB at most, kept
/// until the thread ends and emptied when another encoder uses that thread) and buffers
/// trimmed back to 1 MiB after a call that grew them past it.
pub struct ByteLevelBpe {
    /// Tells this encoder's cache entries from another's in a thread's cache.
    instance: u64,
    add_prefix_space: bool,
    merges: Merges,
    whole: Option<HashMap<Box<[u8]>, u32, FastBuild>>,
    added: AddedTokens,
    classes: &'static Classes,
}

impl std::fmt::Debug for ByteLevelBpe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ByteLevelBpe").field("add_prefix_space", &self.add_prefix_space).finish_non_exhaustive()
    }
}

/// A thread's cache and buffers, and whose entries the cache holds.
struct Scratch {
    owner: u64,
    cache: WordCache,
    merge: MergeScratch,
    prefixed: String,
}

thread_local! {
    static SCRATCH: RefCell<Option<Scratch>> = const { RefCell::new(None) };
}

static INSTANCES: AtomicU64 = AtomicU64::new(1);

/// Most bytes a thread's merge and prefix buffers keep between calls: a document without
/// line ends can be one piece of up to 8 MiB (and one pre-token as long), and what it grew
/// them to is freed rather than kept by every pool thread.
const KEPT_BUFFER_BYTES: usize = 1 << 20;

impl ByteLevelBpe {
    /// The encoder for `tokenizer`, loaded from the tokenizer.json `json`, when it gives the
    /// same ids as the `tokenizers` crate; otherwise why not.
    pub fn new(json: &[u8], tokenizer: &tokenizers::Tokenizer) -> Result<Self, Unsupported> {
        let parts = load::parts(json, tokenizer)?;
        Ok(Self {
            instance: INSTANCES.fetch_add(1, Ordering::Relaxed),
            add_prefix_space: parts.add_prefix_space,
            merges: Merges::new(parts.bytes, parts.merges.into_iter()),
            whole: parts.whole,
            added: AddedTokens::new(&parts.added)?,
            classes: classes(),
        })
    }

    /// The ids of `text`, without special tokens added around it.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut ids = Vec::with_capacity(text.len() / 3);
        self.encode_into(text, &mut ids);
        ids
    }

    /// Appends the ids of `text` to `ids`.
    pub fn encode_into(&self, text: &str, ids: &mut Vec<u32>) {
        SCRATCH.with(|cell| {
            let mut slot = cell.borrow_mut();
            let scratch = slot.get_or_insert_with(|| Scratch {
                owner: self.instance,
                cache: WordCache::new(),
                merge: MergeScratch::default(),
                prefixed: String::new(),
            });
            if scratch.owner != self.instance {
                scratch.cache.clear();
                scratch.owner = self.instance;
            }
            self.added.split(text, &mut |piece| match piece {
                Piece::Token(id) => ids.push(id),
                // Each piece between added tokens is pre-tokenized on its own, and with
                // `add_prefix_space` gets a leading space unless it has one.
                Piece::Text(t) if self.add_prefix_space && !t.starts_with(' ') => {
                    let mut prefixed = std::mem::take(&mut scratch.prefixed);
                    prefixed.clear();
                    prefixed.push(' ');
                    prefixed.push_str(t);
                    self.encode_piece(&prefixed, scratch, ids);
                    scratch.prefixed = prefixed;
                }
                Piece::Text(t) => self.encode_piece(t, scratch, ids),
            });
            scratch.merge.trim(KEPT_BUFFER_BYTES);
            if scratch.prefixed.capacity() > KEPT_BUFFER_BYTES {
                scratch.prefixed = String::new();
            }
        });
    }

    fn encode_piece(&self, text: &str, scratch: &mut Scratch, ids: &mut Vec<u32>) {
        for word in PreTokens::new(text, self.classes) {
            if word.len() > MAX_KEY {
                self.encode_word(word, &mut scratch.merge, ids);
                continue;
            }
            let h = cache::hash(word);
            if let Some(cached) = scratch.cache.get(h, word) {
                ids.extend_from_slice(cached);
                continue;
            }
            let start = ids.len();
            self.encode_word(word, &mut scratch.merge, ids);
            scratch.cache.insert(h, word, &ids[start..]);
        }
    }

    fn encode_word(&self, word: &[u8], merge: &mut MergeScratch, ids: &mut Vec<u32>) {
        if let Some(id) = self.whole.as_ref().and_then(|w| w.get(word)) {
            ids.push(*id);
        } else if let [b] = word {
            ids.push(self.merges.byte(*b));
        } else {
            self.merges.apply(word, merge, ids);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn it_can_be_shared_between_threads() {
        fn shared<T: Send + Sync>() {}
        shared::<ByteLevelBpe>();
    }
}
