//! The shard file layout, written by `ava data prepare` and memory-mapped by training.
//!
//! ```text
//! offset 0   header, 64 bytes, little-endian:
//!              magic "AVASHRD\0" | version u32 | id bytes u32 (2 or 4)
//!              train tokens u64 | validation tokens u64
//!              train documents u64 | validation documents u64 | 16 bytes zero
//! offset 64  train token ids, then validation token ids (id bytes each)
//!            zero padding to a multiple of 8
//!            train document starts (u64 each: token offsets inside the train region),
//!            then validation document starts (offsets inside the validation region)
//! ```
//!
//! Every document in a region is followed by the end-of-text id, so a region is the
//! documents' concatenation as training reads it. Keeping the ids and the document table in
//! one file gives one checksum per shard and one mapping. 64 bytes keep the id arrays
//! aligned for their type, and the padding the u64 table.

/// The first 8 bytes of every shard.
pub const MAGIC: [u8; 8] = *b"AVASHRD\0";
/// The layout version this build writes and reads.
pub const VERSION: u32 = 1;
/// Bytes before the first token id.
pub const HEADER_BYTES: usize = 64;

/// The counts a shard's header records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Header {
    /// Bytes per token id: 2 (u16) or 4 (u32).
    pub id_bytes: u32,
    /// Token ids in the train region, end-of-text ids included.
    pub train_tokens: u64,
    /// Token ids in the validation region.
    pub val_tokens: u64,
    /// Documents in the train region.
    pub train_docs: u64,
    /// Documents in the validation region.
    pub val_docs: u64,
}

impl Header {
    /// The header's 64 bytes.
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut out = [0u8; HEADER_BYTES];
        out[..8].copy_from_slice(&MAGIC);
        out[8..12].copy_from_slice(&VERSION.to_le_bytes());
        out[12..16].copy_from_slice(&self.id_bytes.to_le_bytes());
        for (i, v) in [self.train_tokens, self.val_tokens, self.train_docs, self.val_docs].into_iter().enumerate() {
            out[16 + 8 * i..24 + 8 * i].copy_from_slice(&v.to_le_bytes());
        }
        out
    }

    /// Reads a header, or says what is wrong with it.
    pub fn decode(bytes: &[u8]) -> Result<Self, String> {
        if bytes.len() < HEADER_BYTES {
            return Err(format!("{} bytes, shorter than the {HEADER_BYTES}-byte header", bytes.len()));
        }
        if bytes[..8] != MAGIC {
            return Err("not an Ava shard (bad magic bytes)".into());
        }
        let u32_at = |i: usize| u32::from_le_bytes(bytes[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().expect("8 bytes"));
        let version = u32_at(8);
        if version != VERSION {
            return Err(format!("shard layout version {version}; this build reads version {VERSION}"));
        }
        let header = Header {
            id_bytes: u32_at(12),
            train_tokens: u64_at(16),
            val_tokens: u64_at(24),
            train_docs: u64_at(32),
            val_docs: u64_at(40),
        };
        if !matches!(header.id_bytes, 2 | 4) {
            return Err(format!("token ids of {} bytes (2 or 4 expected)", header.id_bytes));
        }
        Ok(header)
    }

    /// Where the header puts the document table and where the file ends, computed with
    /// checked arithmetic: the counts come from a file, and a sum or product that does not
    /// fit in 64 bits would otherwise wrap to a small size a crafted file could match. Each
    /// region's documents are checked against its tokens too (every document ends with the
    /// end-of-text id, so a region holds at least as many ids as documents, and ids only
    /// within documents). The error names the field.
    pub fn layout(&self) -> Result<Layout, String> {
        for (field, tokens, docs) in
            [("train", self.train_tokens, self.train_docs), ("validation", self.val_tokens, self.val_docs)]
        {
            if docs > tokens {
                return Err(format!(
                    "header field {field} documents ({docs}) is more than its {field} tokens ({tokens}); every \
                     document holds at least its end-of-text id"
                ));
            }
            if tokens > 0 && docs == 0 {
                return Err(format!(
                    "header field {field} documents is 0 but its {field} tokens is {tokens}; every id belongs to a \
                     document"
                ));
            }
        }
        let too_big = |what: &str| format!("header field {what} does not fit in a 64-bit file size");
        let tokens =
            self.train_tokens.checked_add(self.val_tokens).ok_or_else(|| too_big("train + validation tokens"))?;
        let ids = tokens.checked_mul(u64::from(self.id_bytes)).ok_or_else(|| too_big("tokens × id bytes"))?;
        let table_offset = ids
            .checked_add(HEADER_BYTES as u64)
            .and_then(|end| end.checked_next_multiple_of(8))
            .ok_or_else(|| too_big("tokens × id bytes"))?;
        let docs = self.train_docs.checked_add(self.val_docs).ok_or_else(|| too_big("train + validation documents"))?;
        let file_bytes = docs
            .checked_mul(8)
            .and_then(|table| table.checked_add(table_offset))
            .ok_or_else(|| too_big("documents × 8"))?;
        Ok(Layout { table_offset, file_bytes })
    }
}

/// Where a header puts things (see [`Header::layout`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Offset of the document table: after the ids, padded to 8.
    pub table_offset: u64,
    /// The whole file's size.
    pub file_bytes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips_and_sizes_add_up() {
        let h = Header { id_bytes: 2, train_tokens: 5, val_tokens: 2, train_docs: 2, val_docs: 1 };
        assert_eq!(Header::decode(&h.encode()), Ok(h));
        // 64 + 7·2 = 78 → 80, then 3 starts of 8 bytes.
        assert_eq!(h.layout(), Ok(Layout { table_offset: 80, file_bytes: 104 }));
    }

    #[test]
    fn bad_headers_say_what_is_wrong() {
        let mut bytes = Header { id_bytes: 4, ..Header::default() }.encode();
        assert!(Header::decode(&bytes[..10]).unwrap_err().contains("shorter than the 64-byte header"));
        bytes[8] = 9;
        assert!(Header::decode(&bytes).unwrap_err().contains("version 9; this build reads version 1"));
        bytes[0] = b'X';
        assert!(Header::decode(&bytes).unwrap_err().contains("not an Ava shard"));
        let odd = Header { id_bytes: 3, ..Header::default() }.encode();
        assert!(Header::decode(&odd).unwrap_err().contains("3 bytes"));
    }

    #[test]
    fn counts_that_overflow_a_file_size_are_refused_by_field() {
        // 2^63 + 5 two-byte ids wrap to 10 bytes without checked arithmetic: a 144-byte
        // file could "match" a header claiming more ids than any disk holds.
        let h = Header { id_bytes: 2, train_tokens: (1 << 63) + 5, val_tokens: 0, train_docs: 1, val_docs: 0 };
        let e = h.layout().unwrap_err();
        assert!(e.contains("header field tokens × id bytes does not fit"), "{e}");
        let h = Header { id_bytes: 4, train_tokens: u64::MAX, val_tokens: 1, train_docs: 1, val_docs: 1 };
        assert!(h.layout().unwrap_err().contains("train + validation tokens"));
        let h = Header { id_bytes: 2, train_tokens: 4, val_tokens: 0, train_docs: 5, val_docs: 0 };
        assert!(h.layout().unwrap_err().contains("train documents (5) is more than its train tokens (4)"));
        let h = Header { id_bytes: 2, train_tokens: 0, val_tokens: 3, train_docs: 0, val_docs: 0 };
        assert!(h.layout().unwrap_err().contains("validation documents is 0 but its validation tokens is 3"));
        let h = Header { id_bytes: 2, train_tokens: 1 << 40, val_tokens: 0, train_docs: (1 << 62) - 1, val_docs: 0 };
        assert!(h.layout().unwrap_err().contains("more than its train tokens"));
        let h =
            Header { id_bytes: 2, train_tokens: u64::MAX / 2, val_tokens: 0, train_docs: u64::MAX / 2, val_docs: 0 };
        assert!(h.layout().unwrap_err().contains("does not fit"));
    }
}
