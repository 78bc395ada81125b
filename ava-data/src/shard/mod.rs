//! Token shards: the file layout ([`format`]), writing one ([`ShardBuilder`]), and reading
//! one through a memory map ([`ShardFile`]).

pub mod format;

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use memmap2::{Mmap, UncheckedAdvice};
use sha2::{Digest, Sha256};

use crate::dataset::Split;
use crate::error::DataError;
use crate::manifest::{Counts, ShardEntry, sync_dir};
use format::{HEADER_BYTES, Header};

/// The file name of shard `index`.
pub fn file_name(index: usize) -> String {
    format!("shard-{index:05}.bin")
}

/// One region's ids (little-endian bytes) and document starts, while a shard is filled.
#[derive(Debug, Default)]
struct Region {
    ids: Vec<u8>,
    starts: Vec<u64>,
    tokens: u64,
}

/// A shard being filled in memory, written whole by [`finish`](Self::finish). Its size is
/// bounded by the `prepare`'s shard size, whatever the corpus size.
#[derive(Debug)]
pub struct ShardBuilder {
    id_bytes: u32,
    eos: u32,
    train: Region,
    val: Region,
}

impl ShardBuilder {
    /// An empty shard of `id_bytes`-byte ids whose documents end with `eos`.
    pub fn new(id_bytes: u32, eos: u32) -> Self {
        assert!(matches!(id_bytes, 2 | 4), "ids are 2 or 4 bytes");
        Self { id_bytes, eos, train: Region::default(), val: Region::default() }
    }

    /// Appends one document's ids, and the end-of-text id, to `split`'s region. The ids must
    /// fit the id width (the vocabulary decided it).
    pub fn push(&mut self, split: Split, ids: &[u32]) {
        let region = match split {
            Split::Train => &mut self.train,
            Split::Validation => &mut self.val,
        };
        region.starts.push(region.tokens);
        let width = self.id_bytes as usize;
        let at = region.ids.len();
        region.ids.resize(at + (ids.len() + 1) * width, 0);
        for (out, &id) in region.ids[at..].chunks_exact_mut(width).zip(ids.iter().chain([&self.eos])) {
            out.copy_from_slice(&id.to_le_bytes()[..width]);
        }
        region.tokens += ids.len() as u64 + 1;
    }

    /// Token ids held so far (both regions).
    pub fn tokens(&self) -> u64 {
        self.train.tokens + self.val.tokens
    }

    /// Documents held so far.
    pub fn documents(&self) -> u64 {
        (self.train.starts.len() + self.val.starts.len()) as u64
    }

    fn header(&self) -> Header {
        Header {
            id_bytes: self.id_bytes,
            train_tokens: self.train.tokens,
            val_tokens: self.val.tokens,
            train_docs: self.train.starts.len() as u64,
            val_docs: self.val.starts.len() as u64,
        }
    }

    /// Writes the shard as `dir/<file>`: into a temporary file that is fsynced, then renamed
    /// (and the directory fsynced), so the name only ever holds a complete shard. Returns its
    /// manifest entry.
    pub fn finish(self, dir: &Path, file: &str, first_document: u64) -> io::Result<ShardEntry> {
        self.finish_within(dir, file, first_document, u64::MAX)
    }

    /// [`finish`](Self::finish) on a disk with room for `room` more bytes of this file (see
    /// [`Room`]); `u64::MAX` is any disk.
    pub(crate) fn finish_within(
        self,
        dir: &Path,
        file: &str,
        first_document: u64,
        room: u64,
    ) -> io::Result<ShardEntry> {
        let header = self.header();
        let tmp = dir.join(format!("{file}.tmp"));
        let mut out = HashingWriter {
            inner: io::BufWriter::with_capacity(1 << 20, Room { inner: File::create(&tmp)?, left: room }),
            hash: Sha256::new(),
            bytes: 0,
        };
        out.write_all(&header.encode())?;
        out.write_all(&self.train.ids)?;
        out.write_all(&self.val.ids)?;
        let pad = header.table_offset() - (HEADER_BYTES as u64 + (self.train.ids.len() + self.val.ids.len()) as u64);
        out.write_all(&[0u8; 8][..pad as usize])?;
        for start in self.train.starts.iter().chain(&self.val.starts) {
            out.write_all(&start.to_le_bytes())?;
        }
        debug_assert_eq!(out.bytes, header.file_bytes());
        let (bytes, sha256) = (out.bytes, hex::encode(out.hash.finalize()));
        out.inner.into_inner().map_err(|e| e.into_error())?.inner.sync_all()?;
        fs::rename(&tmp, dir.join(file))?;
        sync_dir(dir)?;
        Ok(ShardEntry {
            file: file.to_string(),
            bytes,
            sha256,
            first_document,
            train: Counts { tokens: header.train_tokens, documents: header.train_docs },
            validation: Counts { tokens: header.val_tokens, documents: header.val_docs },
        })
    }
}

/// A writer that hashes and counts what passes through.
struct HashingWriter<W> {
    inner: W,
    hash: Sha256,
    bytes: u64,
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// A file on a disk with room for `left` more bytes: the write that reaches the limit
/// writes what fits, and every later one fails with `StorageFull` (ENOSPC), as on a disk that
/// filled up. It exists for the `prepare` test hook ([`DiskFault`](crate::prepare::DiskFault));
/// in a normal run `left` is `u64::MAX`, a comparison per write of a megabyte.
pub(crate) struct Room<W> {
    pub(crate) inner: W,
    pub(crate) left: u64,
}

impl<W: Write> Write for Room<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.left == 0 && !buf.is_empty() {
            return Err(io::Error::from(io::ErrorKind::StorageFull));
        }
        let fits = buf.len().min(usize::try_from(self.left).unwrap_or(usize::MAX));
        let n = self.inner.write(&buf[..fits])?;
        self.left -= n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// The SHA-256 of what `reader` yields, lowercase hex, read in 1 MiB pieces.
pub fn sha256_of(mut reader: impl Read) -> io::Result<String> {
    let mut hash = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = reader.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hash.update(&buf[..n]);
    }
    Ok(hex::encode(hash.finalize()))
}

/// The SHA-256 of a file, with plain reads (not through a mapping, so checking a corpus
/// leaves no pages mapped into the process).
pub fn sha256_file(path: &Path) -> io::Result<String> {
    sha256_of(File::open(path)?)
}

/// Opens a shard (see [`ShardFile::open`]) and checks its checksum against its manifest
/// entry too.
pub fn verify(dir: &Path, entry: &ShardEntry, id_bytes: u32) -> Result<ShardFile, DataError> {
    let shard = ShardFile::open(dir, entry, id_bytes)?;
    let path = &shard.path;
    let actual = sha256_file(path).map_err(|source| DataError::Read { path: path.clone(), source })?;
    if actual != entry.sha256 {
        return Err(DataError::Shard {
            path: path.clone(),
            reason: format!(
                "its checksum is {} but the manifest says {}: the file was changed or damaged; prepare the corpus \
                 again (or restore the file)",
                &actual[..16],
                &entry.sha256[..16.min(entry.sha256.len())]
            ),
        });
    }
    Ok(shard)
}

/// A finished shard, memory-mapped. Reading copies ids out and hands the pages back to the
/// page cache, so reading a corpus of any size leaves the process's resident set as it was.
#[derive(Debug)]
pub struct ShardFile {
    path: PathBuf,
    header: Header,
    map: Mmap,
}

impl ShardFile {
    /// Maps `dir/<entry.file>` and checks its size and header against the manifest entry
    /// (not its checksum: see [`verify`]).
    pub fn open(dir: &Path, entry: &ShardEntry, id_bytes: u32) -> Result<Self, DataError> {
        let path = dir.join(&entry.file);
        let bad = |reason: String| DataError::Shard { path: path.clone(), reason };
        let file = File::open(&path).map_err(|source| DataError::Read { path: path.clone(), source })?;
        let size = file.metadata().map_err(|source| DataError::Read { path: path.clone(), source })?.len();
        if size != entry.bytes {
            return Err(bad(format!(
                "it is {size} bytes but the manifest says {}: the file was truncated or replaced; prepare the corpus \
                 again (or restore the file)",
                entry.bytes
            )));
        }
        // SAFETY: the mapping is read-only; a shard is never written after its rename, and a
        // file changed under us is what `verify` catches.
        let map = unsafe { Mmap::map(&file) }.map_err(|source| DataError::Read { path: path.clone(), source })?;
        let header = Header::decode(&map).map_err(&bad)?;
        let expected = Header {
            id_bytes,
            train_tokens: entry.train.tokens,
            val_tokens: entry.validation.tokens,
            train_docs: entry.train.documents,
            val_docs: entry.validation.documents,
        };
        if header != expected || header.file_bytes() != size {
            return Err(bad(format!("its header ({header:?}) does not match the manifest ({expected:?})")));
        }
        #[cfg(unix)]
        let _ = map.advise(memmap2::Advice::Random);
        let shard = Self { path, header, map };
        shard.release(0, HEADER_BYTES);
        Ok(shard)
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Token ids in `split`'s region.
    pub fn tokens(&self, split: Split) -> u64 {
        match split {
            Split::Train => self.header.train_tokens,
            Split::Validation => self.header.val_tokens,
        }
    }

    /// Documents in `split`'s region.
    pub fn documents(&self, split: Split) -> u64 {
        match split {
            Split::Train => self.header.train_docs,
            Split::Validation => self.header.val_docs,
        }
    }

    /// Byte offset of `split`'s first id.
    fn region_offset(&self, split: Split) -> u64 {
        let before = match split {
            Split::Train => 0,
            Split::Validation => self.header.train_tokens,
        };
        HEADER_BYTES as u64 + before * u64::from(self.header.id_bytes)
    }

    /// Appends ids `start .. start + len` of `split`'s region to `out` as u32s, then releases
    /// the pages read.
    pub fn copy_ids(&self, split: Split, start: u64, len: usize, out: &mut Vec<u32>) {
        assert!(start + len as u64 <= self.tokens(split), "ids past the end of {}", self.path.display());
        let width = self.header.id_bytes as usize;
        let from = (self.region_offset(split) + start * width as u64) as usize;
        let bytes = &self.map[from..from + len * width];
        match width {
            2 => out.extend(bytes.chunks_exact(2).map(|b| u32::from(u16::from_le_bytes([b[0], b[1]])))),
            _ => out.extend(bytes.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
        }
        self.release(from, len * width);
    }

    /// Appends the region offsets of the documents of `split` that start in `lo..hi`
    /// (ascending) to `out`, then releases the table pages read. A binary search over the
    /// mapped table: nothing about the documents is held in memory.
    pub fn document_starts_between(&self, split: Split, lo: u64, hi: u64, out: &mut Vec<u64>) {
        let (first, count) = match split {
            Split::Train => (0, self.header.train_docs),
            Split::Validation => (self.header.train_docs, self.header.val_docs),
        };
        let table = (self.header.table_offset() + 8 * first) as usize;
        let start_of = |doc: u64| -> u64 {
            let at = table + 8 * doc as usize;
            u64::from_le_bytes(self.map[at..at + 8].try_into().expect("8 bytes"))
        };
        // The first document starting at or after `lo` (starts ascend).
        let (mut a, mut b) = (0, count);
        while a < b {
            let mid = a + (b - a) / 2;
            if start_of(mid) < lo { a = mid + 1 } else { b = mid }
        }
        let mut doc = a;
        while doc < count {
            let start = start_of(doc);
            if start >= hi {
                break;
            }
            out.push(start);
            doc += 1;
        }
        self.release(table, 8 * count as usize);
    }

    /// Drops the pages holding `from .. from + len` from this process's mapping: they stay in
    /// the page cache (a later access, ours or another reader's, finds them there) but stop
    /// counting towards the resident set. One fault on a file mapping maps more than its
    /// page: the cached pages around it (fault-around, 64 KiB by default) and, where the page
    /// cache holds the file in large folios (recent kernels, after the checksum pass read it),
    /// up to a whole 2 MiB folio. So the whole aligned 2 MiB window is dropped; with less,
    /// those pages stayed mapped and added up (measured: +58 MiB over 10,000 batches of an
    /// 8 GiB corpus with 64 KiB windows).
    ///
    /// Another thread reading the same window meanwhile just faults its page back in: the
    /// mapping is read-only and file-backed, so every access sees the file's bytes.
    fn release(&self, from: usize, len: usize) {
        #[cfg(unix)]
        {
            let window = FAULT_WINDOW_BYTES.max(page_size());
            let start = from / window * window;
            let end = (from + len).next_multiple_of(window).min(self.map.len());
            if end > start {
                // SAFETY: see above; dropped pages of a read-only file mapping are read
                // back from the file.
                let _ = unsafe { self.map.unchecked_advise_range(UncheckedAdvice::DontNeed, start, end - start) };
            }
        }
    }
}

/// The most Linux maps on one fault of a file mapping: a 2 MiB folio (x86-64's PMD size).
const FAULT_WINDOW_BYTES: usize = 2 << 20;

#[cfg(unix)]
fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if size > 0 { size as usize } else { 4096 }
}
