//! Token shards: the file layout ([`format`]), writing one ([`ShardBuilder`]), and reading
//! one through a memory map ([`ShardFile`]).

pub mod format;

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use memmap2::{Mmap, UncheckedAdvice};
use sha2::{Digest, Sha256};

use crate::dataset::Split;
use crate::error::DataError;
use crate::manifest::{Counts, Manifest, ShardEntry, check_shard_name, sync_dir};
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
        let layout = header.layout().map_err(io::Error::other)?;
        let tmp = dir.join(format!("{file}.tmp"));
        let mut out = HashingWriter {
            inner: io::BufWriter::with_capacity(1 << 20, Room { inner: File::create(&tmp)?, left: room }),
            hash: Sha256::new(),
            bytes: 0,
        };
        out.write_all(&header.encode())?;
        out.write_all(&self.train.ids)?;
        out.write_all(&self.val.ids)?;
        let pad = layout.table_offset - (HEADER_BYTES as u64 + (self.train.ids.len() + self.val.ids.len()) as u64);
        out.write_all(&[0u8; 8][..pad as usize])?;
        for start in self.train.starts.iter().chain(&self.val.starts) {
            out.write_all(&start.to_le_bytes())?;
        }
        debug_assert_eq!(out.bytes, layout.file_bytes);
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
/// leaves no pages mapped into the process). The file is opened without blocking and must
/// be regular (a FIFO would wait for a writer for ever).
pub fn sha256_file(path: &Path) -> io::Result<String> {
    use ava_fs::bounded::{ReadError, limits, open_regular};
    let (file, _) = open_regular(path, limits::LARGE).map_err(|e| match e {
        ReadError::Io { source, .. } => source,
        ReadError::Missing(_) => io::Error::from(io::ErrorKind::NotFound),
        other => io::Error::new(io::ErrorKind::InvalidInput, other.to_string()),
    })?;
    sha256_of(file)
}

/// Opens a shard (see [`ShardFile::open`]) and checks, in one pass of plain reads over the
/// opened file, its checksum against its manifest entry and every token id against the
/// vocabulary (an id at or past it would index past the model's embedding).
pub fn verify(dir: &Path, entry: &ShardEntry, manifest: &Manifest) -> Result<ShardFile, DataError> {
    let shard = ShardFile::open(dir, entry, manifest.id_bytes)?;
    let path = &shard.path;
    let (actual, bad_id) = shard
        .hash_and_check_ids(manifest.vocab_size)
        .map_err(|source| DataError::Read { path: path.clone(), source })?;
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
    if let Some((index, id)) = bad_id {
        return Err(DataError::Shard {
            path: path.clone(),
            reason: format!(
                "its token id at index {index} is {id}, not below the manifest's vocab_size {}: the corpus is \
                 damaged or its manifest is not its own; prepare the corpus again",
                manifest.vocab_size
            ),
        });
    }
    Ok(shard)
}

/// Opens `path` for reading without blocking (a FIFO), and checks it is a regular file. A
/// symbolic link at its last component is followed only when this user or root owns it (a
/// corpus whose shards live in a cache, linked in by its owner); another user's link is
/// refused before anything about its target is looked at, so the error tells nothing of the
/// file it names.
fn open_shard(path: &Path) -> Result<(File, u64), DataError> {
    let refused = |reason: &str| DataError::Shard { path: path.to_path_buf(), reason: reason.to_string() };
    let open = |follow: bool| {
        let flags = libc::O_NONBLOCK | libc::O_NOCTTY | if follow { 0 } else { libc::O_NOFOLLOW };
        fs::OpenOptions::new().read(true).custom_flags(flags).open(path)
    };
    let own_link = || {
        use std::os::unix::fs::MetadataExt;
        fs::symlink_metadata(path).is_ok_and(|m| ava_fs::dirfd::own_link(m.mode() as libc::mode_t, m.uid()))
    };
    let file = match open(false) {
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) && own_link() => open(true),
        other => other,
    }
    .map_err(|source| match source.raw_os_error() {
        Some(libc::ELOOP) => refused(
            "is a symbolic link of another user; a shard must be a regular file inside the corpus directory, or a \
             link that you or root own (another user's link is not followed: they could have put it there): copy \
             the file in, or prepare the corpus again",
        ),
        _ => DataError::Read { path: path.to_path_buf(), source },
    })?;
    let meta = file.metadata().map_err(|source| DataError::Read { path: path.to_path_buf(), source })?;
    if !meta.file_type().is_file() {
        return Err(refused("is not a regular file; a shard is a regular file written by `ava data prepare`"));
    }
    Ok((file, meta.len()))
}

/// A finished shard, memory-mapped. Reading copies ids out and hands the pages back to the
/// page cache, so reading a corpus of any size leaves the process's resident set as it was.
#[derive(Debug)]
pub struct ShardFile {
    path: PathBuf,
    header: Header,
    /// Offset of the document table.
    table: u64,
    file: File,
    map: Mmap,
}

impl ShardFile {
    /// Maps `dir/<entry.file>` and checks its size and header against the manifest entry
    /// and its document table against the header (not its checksum: see [`verify`]). The
    /// file name must be a plain name inside `dir`, and the file a regular file, not a link.
    pub fn open(dir: &Path, entry: &ShardEntry, id_bytes: u32) -> Result<Self, DataError> {
        let path = dir.join(&entry.file);
        let bad = |reason: String| DataError::Shard { path: path.clone(), reason };
        check_shard_name(&entry.file).map_err(|reason| DataError::Manifest {
            path: dir.join(crate::manifest::FILE),
            reason: format!("shard file {reason}"),
        })?;
        let (file, size) = open_shard(&path)?;
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
        let layout = header.layout().map_err(&bad)?;
        let expected = Header {
            id_bytes,
            train_tokens: entry.train.tokens,
            val_tokens: entry.validation.tokens,
            train_docs: entry.train.documents,
            val_docs: entry.validation.documents,
        };
        if header != expected {
            return Err(bad(format!("its header ({header:?}) does not match the manifest ({expected:?})")));
        }
        if layout.file_bytes != size {
            return Err(bad(format!(
                "its header describes a file of {} bytes, but it is {size} bytes: the file is damaged; prepare the \
                 corpus again",
                layout.file_bytes
            )));
        }
        #[cfg(unix)]
        let _ = map.advise(memmap2::Advice::Random);
        let shard = Self { path: path.clone(), header, table: layout.table_offset, file, map };
        shard.release(0, HEADER_BYTES);
        shard.check_table().map_err(bad)?;
        Ok(shard)
    }

    /// Checks each region's document starts: the first 0, each after the one before (a
    /// document holds at least its end-of-text id) and inside the region. What reads them
    /// (a binary search, offsets inside a sequence) relies on it.
    fn check_table(&self) -> Result<(), String> {
        const CHUNK: u64 = (FAULT_WINDOW_BYTES / 8) as u64;
        for (split, first, count, tokens) in [
            ("train", 0, self.header.train_docs, self.header.train_tokens),
            ("validation", self.header.train_docs, self.header.val_docs, self.header.val_tokens),
        ] {
            let mut prev = None;
            let mut doc = 0;
            while doc < count {
                let end = count.min(doc + CHUNK);
                for d in doc..end {
                    let start = self.start_at(first + d);
                    let fine = match prev {
                        None => start == 0,
                        Some(p) => start > p && start < tokens,
                    };
                    if !fine {
                        return Err(format!(
                            "document table: {split} document {d} starts at {start}, but starts must begin at 0, \
                             ascend and stay below the region's {tokens} tokens; the file is damaged: prepare the \
                             corpus again"
                        ));
                    }
                    prev = Some(start);
                }
                self.release((self.table + 8 * (first + doc)) as usize, 8 * (end - doc) as usize);
                doc = end;
            }
        }
        Ok(())
    }

    /// Document start `doc` of the whole table (train documents, then validation ones).
    fn start_at(&self, doc: u64) -> u64 {
        let at = (self.table + 8 * doc) as usize;
        u64::from_le_bytes(self.map[at..at + 8].try_into().expect("8 bytes"))
    }

    /// The SHA-256 of the file (lowercase hex), read in 1 MiB pieces from the opened file, and
    /// the first token id at or past `vocab` with its index among the shard's ids, if any.
    fn hash_and_check_ids(&self, vocab: u64) -> io::Result<(String, Option<(u64, u32)>)> {
        let width = u64::from(self.header.id_bytes);
        let ids_end = HEADER_BYTES as u64 + (self.header.train_tokens + self.header.val_tokens) * width;
        let mut hash = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        let (mut at, mut bad) = (0u64, None);
        loop {
            let n = read_full(&self.file, &mut buf, at)?;
            if n == 0 {
                break;
            }
            hash.update(&buf[..n]);
            // Pieces start at multiples of 1 MiB, so ids never straddle two.
            let (lo, hi) = (at.max(HEADER_BYTES as u64), (at + n as u64).min(ids_end));
            if bad.is_none() && lo < hi {
                let piece = &buf[(lo - at) as usize..(hi - at) as usize];
                let id = |b: &[u8]| {
                    if width == 2 {
                        u32::from(u16::from_le_bytes([b[0], b[1]]))
                    } else {
                        u32::from_le_bytes([b[0], b[1], b[2], b[3]])
                    }
                };
                bad = piece.chunks_exact(width as usize).position(|b| u64::from(id(b)) >= vocab).map(|i| {
                    let off = lo - HEADER_BYTES as u64 + i as u64 * width;
                    (off / width, id(&piece[i * width as usize..]))
                });
            }
            at += n as u64;
        }
        Ok((hex::encode(hash.finalize()), bad))
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
        let table = (self.table + 8 * first) as usize;
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

/// Fills `buf` from `file` at `offset` (less only at the end of the file); returns the bytes
/// read.
fn read_full(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match file.read_at(&mut buf[n..], offset + n as u64) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}
