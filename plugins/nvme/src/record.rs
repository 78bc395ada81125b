//! The on-disk record: a fixed header, the key, the payload, padded to [`ALIGN`] so that a
//! whole record is one aligned write and one aligned read under `O_DIRECT`.
//!
//! ```text
//! 0   magic "AVAREC01"              8 bytes
//! 8   run id                        16 bytes   (stale files of another run are refused)
//! 24  sequence number               u64 LE     (a record older than the last put is refused)
//! 32  payload length                u64 LE
//! 40  payload CRC-32                u32 LE
//! 44  key length                    u16 LE
//! 46  element type                  u8
//! 47  zero
//! 48  header CRC-32 (bytes 0..48 and the key)  u32 LE
//! 52  zero padding to 64
//! 64  key bytes, zero padding to a multiple of 64
//!     payload, zero padding to a multiple of ALIGN
//! ```

use std::fmt;

/// Alignment of buffers, offsets and lengths for direct I/O: the largest logical block size
/// in common use (4 KiB drives; 512-byte ones accept it too).
pub const ALIGN: usize = 4096;

const MAGIC: [u8; 8] = *b"AVAREC01";
const HEADER: usize = 64;

/// A run's identity, written into each of its records.
pub type RunId = [u8; 16];

/// Where a record's payload starts, for a key of `key_len` bytes.
pub fn payload_offset(key_len: usize) -> usize {
    (HEADER + key_len).next_multiple_of(64)
}

/// Bytes a record takes on disk.
pub fn stored_len(key_len: usize, payload_len: usize) -> usize {
    (payload_offset(key_len) + payload_len).next_multiple_of(ALIGN)
}

/// What the reader expects of a record.
#[derive(Debug, Clone, Copy)]
pub struct Expect<'a> {
    /// This run's id.
    pub run: &'a RunId,
    /// The key.
    pub key: &'a str,
    /// The sequence number of the last put of the key.
    pub seq: u64,
    /// The payload's length.
    pub len: u64,
}

/// Why a record was refused. Shown after the file's name.
#[allow(missing_docs)] // the fields are the numbers and names its messages show
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordError {
    /// Shorter than its header or its payload says.
    Truncated { have: usize, need: usize },
    /// No magic: not a record.
    NotARecord,
    /// The header or key does not match its checksum.
    HeaderCorrupt,
    /// Written by another run.
    OtherRun { found: String, this: String },
    /// A record of the key, but an older one (a write that never reached the disk).
    Stale { found: u64, expected: u64 },
    /// A record of another key.
    OtherKey { found: String },
    /// The payload's length is not the one stored.
    Length { found: u64, expected: u64 },
    /// The payload does not match its checksum.
    PayloadCorrupt { stored: u32, computed: u32 },
}

impl fmt::Display for RecordError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Truncated { have, need } => {
                write!(f, "truncated: the file has {have} bytes, the record needs {need}")
            }
            Self::NotARecord => write!(f, "not an Ava offload record (no AVAREC01 header)"),
            Self::HeaderCorrupt => write!(f, "the record's header is corrupt (checksum mismatch)"),
            Self::OtherRun { found, this } => {
                write!(f, "a stale file written by another run ({found}; this run is {this}); it is never used")
            }
            Self::Stale { found, expected } => write!(
                f,
                "a stale record: write #{found} of the key, but #{expected} was the last (a write that never reached the disk)"
            ),
            Self::OtherKey { found } => write!(f, "the record of another key ('{found}')"),
            Self::Length { found, expected } => {
                write!(f, "the record has {found} bytes of data, {expected} were stored")
            }
            Self::PayloadCorrupt { stored, computed } => {
                write!(f, "the data is corrupt: CRC-32 {computed:08x}, the record says {stored:08x}")
            }
        }
    }
}

/// The run id as text (hex), as in the run directory's name.
pub fn run_hex(run: &RunId) -> String {
    run.iter().map(|b| format!("{b:02x}")).collect()
}

/// Writes the record into `out`, which must be [`stored_len`] bytes (and zeroed past the
/// payload, as a fresh aligned buffer is).
pub fn encode(out: &mut [u8], run: &RunId, seq: u64, key: &str, dtype: u8, payload: &[u8]) {
    let off = payload_offset(key.len());
    debug_assert_eq!(out.len(), stored_len(key.len(), payload.len()));
    let key_len = u16::try_from(key.len()).expect("keys are checked to be shorter than 64 KiB");
    out[0..8].copy_from_slice(&MAGIC);
    out[8..24].copy_from_slice(run);
    out[24..32].copy_from_slice(&seq.to_le_bytes());
    out[32..40].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    out[40..44].copy_from_slice(&crc32fast::hash(payload).to_le_bytes());
    out[44..46].copy_from_slice(&key_len.to_le_bytes());
    out[46] = dtype;
    out[47] = 0;
    out[HEADER..HEADER + key.len()].copy_from_slice(key.as_bytes());
    let crc = header_crc(&out[..48], key.as_bytes());
    out[48..52].copy_from_slice(&crc.to_le_bytes());
    out[off..off + payload.len()].copy_from_slice(payload);
}

fn header_crc(fixed: &[u8], key: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(fixed);
    h.update(key);
    h.finalize()
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

/// Checks a record read back and returns the range of its payload in `bytes`.
pub fn decode(bytes: &[u8], expect: Expect<'_>) -> Result<std::ops::Range<usize>, RecordError> {
    if bytes.len() < HEADER {
        if bytes.len() >= 8 && bytes[..8] != MAGIC {
            return Err(RecordError::NotARecord);
        }
        return Err(RecordError::Truncated { have: bytes.len(), need: HEADER });
    }
    if bytes[..8] != MAGIC {
        return Err(RecordError::NotARecord);
    }
    let key_len = u16::from_le_bytes([bytes[44], bytes[45]]) as usize;
    let off = payload_offset(key_len);
    if bytes.len() < HEADER + key_len {
        return Err(RecordError::Truncated { have: bytes.len(), need: HEADER + key_len });
    }
    if header_crc(&bytes[..48], &bytes[HEADER..HEADER + key_len]) != u32_at(bytes, 48) {
        return Err(RecordError::HeaderCorrupt);
    }
    if bytes[8..24] != expect.run[..] {
        return Err(RecordError::OtherRun {
            found: format!("run {}", run_hex(bytes[8..24].try_into().expect("16 bytes"))),
            this: run_hex(expect.run),
        });
    }
    let key = &bytes[HEADER..HEADER + key_len];
    if key != expect.key.as_bytes() {
        return Err(RecordError::OtherKey { found: String::from_utf8_lossy(key).into_owned() });
    }
    let seq = u64_at(bytes, 24);
    if seq != expect.seq {
        return Err(RecordError::Stale { found: seq, expected: expect.seq });
    }
    let len = u64_at(bytes, 32);
    if len != expect.len {
        return Err(RecordError::Length { found: len, expected: expect.len });
    }
    // Checked: the length was compared with the caller's, but a length past the address
    // space must not wrap into a small range.
    let end = match usize::try_from(len).ok().and_then(|l| off.checked_add(l)) {
        Some(end) if end <= bytes.len() => end,
        _ => {
            let need = usize::try_from(len).ok().and_then(|l| off.checked_add(l)).unwrap_or(usize::MAX);
            return Err(RecordError::Truncated {
                have: bytes.len(),
                need: need.checked_next_multiple_of(ALIGN).unwrap_or(need),
            });
        }
    };
    if bytes.len() < end {
        return Err(RecordError::Truncated { have: bytes.len(), need: end.next_multiple_of(ALIGN) });
    }
    let (stored, computed) = (u32_at(bytes, 40), crc32fast::hash(&bytes[off..end]));
    if stored != computed {
        return Err(RecordError::PayloadCorrupt { stored, computed });
    }
    Ok(off..end)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(run: &RunId, seq: u64, key: &str, payload: &[u8]) -> Vec<u8> {
        let mut out = vec![0; stored_len(key.len(), payload.len())];
        encode(&mut out, run, seq, key, 0, payload);
        out
    }

    #[test]
    fn lengths_are_aligned() {
        assert_eq!(payload_offset(0), 64);
        assert_eq!(payload_offset(1), 128);
        assert_eq!(stored_len(10, 0), ALIGN);
        assert_eq!(stored_len(10, ALIGN - 128), ALIGN);
        assert_eq!(stored_len(10, ALIGN - 127), 2 * ALIGN);
    }

    #[test]
    fn every_kind_of_damage_is_named() {
        let run = [7u8; 16];
        let payload: Vec<u8> = (0..5000u32).map(|i| (i * 31) as u8).collect();
        let good = record(&run, 3, "opt/w/exp_avg", &payload);
        let expect = Expect { run: &run, key: "opt/w/exp_avg", seq: 3, len: payload.len() as u64 };
        let range = decode(&good, expect).unwrap();
        assert_eq!(&good[range], &payload[..]);

        let mut bad = good.clone();
        bad[200] ^= 1;
        assert!(matches!(decode(&bad, expect), Err(RecordError::PayloadCorrupt { .. })));
        let mut bad = good.clone();
        bad[30] ^= 1; // inside the sequence number: the header checksum sees it
        assert_eq!(decode(&bad, expect), Err(RecordError::HeaderCorrupt));
        assert_eq!(decode(&good[..100], expect), Err(RecordError::Truncated { have: 100, need: 2 * ALIGN }));
        assert_eq!(decode(&good[..10], expect), Err(RecordError::Truncated { have: 10, need: 64 }));
        assert_eq!(decode(&[0u8; 4096], expect), Err(RecordError::NotARecord));
        let other = record(&[8u8; 16], 3, "opt/w/exp_avg", &payload);
        assert!(matches!(decode(&other, expect), Err(RecordError::OtherRun { .. })));
        let older = record(&run, 2, "opt/w/exp_avg", &payload);
        assert_eq!(decode(&older, expect), Err(RecordError::Stale { found: 2, expected: 3 }));
        let moved = record(&run, 3, "opt/v/exp_avg", &payload);
        assert_eq!(decode(&moved, expect), Err(RecordError::OtherKey { found: "opt/v/exp_avg".into() }));
        assert_eq!(decode(&good, Expect { len: 4, ..expect }), Err(RecordError::Length { found: 5000, expected: 4 }));
    }

    /// Property test: a record read back from disk, damaged anywhere (or replaced by any
    /// bytes), is an error or the exact range of the stored payload; never a panic, never a
    /// range past the buffer. `PROPTEST_CASES` raises the count.
    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        fn cases() -> proptest::test_runner::Config {
            // proptest reads $PROPTEST_CASES into its default (256).
            proptest::test_runner::Config { failure_persistence: None, ..Default::default() }
        }

        proptest! {
            #![proptest_config(cases())]

            #[test]
            fn damaged_records_never_panic(
                payload in prop::collection::vec(any::<u8>(), 0..300),
                flips in prop::collection::vec((any::<usize>(), any::<u8>()), 0..8),
                cut in any::<usize>(),
                expect_len in prop_oneof![Just(None), any::<u64>().prop_map(Some)],
            ) {
                let run = [3u8; 16];
                let mut bytes = record(&run, 9, "k/exp_avg", &payload);
                for (at, b) in flips {
                    let i = at % bytes.len();
                    bytes[i] ^= b;
                }
                bytes.truncate(cut % (bytes.len() + 1));
                let len = expect_len.unwrap_or(payload.len() as u64);
                if let Ok(range) = decode(&bytes, Expect { run: &run, key: "k/exp_avg", seq: 9, len }) {
                    prop_assert!(range.end <= bytes.len());
                    prop_assert_eq!(range.len() as u64, len);
                }
            }

            #[test]
            fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..5000), len in any::<u64>()) {
                let run = [0u8; 16];
                let _ = decode(&bytes, Expect { run: &run, key: "", seq: 0, len });
            }
        }
    }
}
