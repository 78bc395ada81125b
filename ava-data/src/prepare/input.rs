//! Inputs to `ava data prepare`: which files (directories walked in sorted order), how each
//! is decompressed (`.gz`, `.zst`), and how it splits into documents (a whole text file, text
//! cut at a separator, one JSONL line's string field, or one Parquet row's string column).

use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::manifest::InputFile;

use super::PrepareError;

/// How text inputs become documents.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reading {
    /// Split text files at this string (dropped); `None` makes each file one document.
    pub separator: Option<String>,
    /// The JSONL field holding a document's text.
    pub field: String,
    /// What to do with invalid UTF-8.
    pub invalid: Invalid,
}

impl Reading {
    /// The options in words, for the manifest (a rerun with other ones starts over).
    pub fn describe(&self) -> String {
        let separator = match &self.separator {
            None => "one document per text file".to_string(),
            Some(s) => format!("text split at {s:?}"),
        };
        format!("{separator}; JSONL field {:?}; invalid UTF-8: {}", self.field, self.invalid.name())
    }
}

/// What to do with invalid UTF-8 in a document.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Invalid {
    /// Stop with the file and byte offset.
    Error,
    /// Replace each invalid sequence with U+FFFD.
    Replace,
    /// Leave the document out.
    Skip,
}

impl Invalid {
    /// The option's value.
    pub fn name(self) -> &'static str {
        match self {
            Invalid::Error => "error",
            Invalid::Replace => "replace",
            Invalid::Skip => "skip",
        }
    }
}

/// How one file is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Plain text.
    Text,
    /// One JSON object per line.
    Jsonl,
    /// Parquet: one document per row, from a string column.
    Parquet,
}

/// How one file is compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// Not compressed.
    None,
    /// gzip.
    Gzip,
    /// Zstandard.
    Zstd,
}

/// The layout and compression a file name says.
pub fn classify(path: &Path) -> (Kind, Compression) {
    let name = path.file_name().map(|n| n.to_string_lossy().to_lowercase()).unwrap_or_default();
    let (stem, compression) = if let Some(s) = name.strip_suffix(".gz") {
        (s, Compression::Gzip)
    } else if let Some(s) = name.strip_suffix(".zst") {
        (s, Compression::Zstd)
    } else {
        (name.as_str(), Compression::None)
    };
    let kind = if stem.ends_with(".jsonl") || stem.ends_with(".ndjson") {
        Kind::Jsonl
    } else if stem.ends_with(".parquet") {
        Kind::Parquet
    } else {
        Kind::Text
    };
    (kind, compression)
}

/// The input files named by `inputs`: files as given, directories walked recursively in
/// sorted order (hidden entries and symbolic links skipped). Each with its size and modification time.
pub fn list(inputs: &[PathBuf]) -> Result<Vec<InputFile>, PrepareError> {
    list_except(inputs, None)
}

/// [`list`], leaving out the directory `except` (the corpus being written, when it lies
/// inside an input directory).
pub fn list_except(inputs: &[PathBuf], except: Option<&Path>) -> Result<Vec<InputFile>, PrepareError> {
    if inputs.is_empty() {
        return Err(PrepareError::NoInputs);
    }
    let except = except.and_then(|p| p.canonicalize().ok());
    let mut files = Vec::new();
    for input in inputs {
        let meta = std::fs::metadata(input).map_err(|source| PrepareError::Input { path: input.clone(), source })?;
        if meta.is_dir() {
            walk(input, except.as_deref(), &mut files)?;
        } else {
            files.push(input_file(input, &meta));
        }
    }
    if files.is_empty() {
        return Err(PrepareError::EmptyInput { inputs: inputs.to_vec(), what: "file" });
    }
    Ok(files)
}

fn input_file(path: &Path, meta: &std::fs::Metadata) -> InputFile {
    let modified =
        meta.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()).map_or(0, |d| d.as_secs());
    InputFile { path: path.to_path_buf(), bytes: meta.len(), modified }
}

fn walk(dir: &Path, except: Option<&Path>, files: &mut Vec<InputFile>) -> Result<(), PrepareError> {
    let err = |source| PrepareError::Input { path: dir.to_path_buf(), source };
    let mut entries: Vec<_> = std::fs::read_dir(dir).map_err(err)?.collect::<Result<_, _>>().map_err(err)?;
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        if entry.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        let path = entry.path();
        // Links inside a directory are not followed (no cycles, no second copy of a file
        // linked beside itself); name a link as an input to include what it points to.
        let meta =
            std::fs::symlink_metadata(&path).map_err(|source| PrepareError::Input { path: path.clone(), source })?;
        if meta.is_dir() {
            if except.is_some_and(|e| path.canonicalize().is_ok_and(|p| p == e)) {
                continue;
            }
            walk(&path, except, files)?;
        } else if meta.is_file() {
            files.push(input_file(&path, &meta));
        }
    }
    Ok(())
}

/// A reader that counts the bytes it hands out (the on-disk bytes, before decompression).
struct Counting<R> {
    inner: R,
    count: Arc<AtomicU64>,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.count.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// Opens `path` decompressed; `read` counts its on-disk bytes.
pub fn open(path: &Path, read: Arc<AtomicU64>) -> Result<Box<dyn BufRead + Send>, PrepareError> {
    let file = File::open(path).map_err(|source| PrepareError::Input { path: path.to_path_buf(), source })?;
    let raw = BufReader::with_capacity(1 << 20, Counting { inner: file, count: read });
    Ok(match classify(path).1 {
        Compression::None => Box::new(raw),
        Compression::Gzip => Box::new(BufReader::with_capacity(1 << 20, flate2::bufread::MultiGzDecoder::new(raw))),
        Compression::Zstd => Box::new(BufReader::with_capacity(1 << 20, ZstdFrames::new(raw))),
    })
}

/// A Zstandard stream of any number of frames (`cat a.zst b.zst`, pzstd's output), skippable
/// frames skipped: ruzstd's streaming decoder stops after the first frame.
struct ZstdFrames<R> {
    source: R,
    decoder: ruzstd::decoding::FrameDecoder,
    in_frame: bool,
}

impl<R: BufRead> ZstdFrames<R> {
    fn new(source: R) -> Self {
        Self { source, decoder: ruzstd::decoding::FrameDecoder::new(), in_frame: false }
    }
}

impl<R: BufRead> Read for ZstdFrames<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        use ruzstd::decoding::BlockDecodingStrategy;
        use ruzstd::decoding::errors::{FrameDecoderError, ReadFrameHeaderError};
        let corrupt = |e: FrameDecoderError| io::Error::new(io::ErrorKind::InvalidData, e.to_string());
        if buf.is_empty() {
            return Ok(0);
        }
        loop {
            if !self.in_frame {
                if self.source.fill_buf()?.is_empty() {
                    return Ok(0); // the end, between frames
                }
                match self.decoder.init(&mut self.source) {
                    Ok(()) => self.in_frame = true,
                    Err(FrameDecoderError::ReadFrameHeaderError(ReadFrameHeaderError::SkipFrame {
                        length, ..
                    })) => {
                        io::copy(&mut (&mut self.source).take(u64::from(length)), &mut io::sink())?;
                        continue;
                    }
                    Err(e) => return Err(corrupt(e)),
                }
            }
            while self.decoder.can_collect() < buf.len() && !self.decoder.is_finished() {
                let wanted = buf.len() - self.decoder.can_collect();
                self.decoder
                    .decode_blocks(&mut self.source, BlockDecodingStrategy::UptoBytes(wanted))
                    .map_err(corrupt)?;
            }
            let n = self.decoder.read(buf)?;
            if n > 0 {
                return Ok(n);
            }
            // The frame is drained: the next one, if any.
            self.in_frame = false;
        }
    }
}

/// One document as read: its bytes and where it came from (for errors).
#[derive(Debug)]
pub struct RawDocument {
    /// The text, not yet checked as UTF-8.
    pub bytes: Vec<u8>,
    /// The file.
    pub path: Arc<Path>,
    /// Byte offset of the document in the (decompressed) file.
    pub offset: u64,
    /// The record it came from, if any: a JSONL line or a Parquet row (from 1).
    pub line: Option<u64>,
}

/// Largest single document read whole (a text file without a separator).
pub const MAX_DOCUMENT_BYTES: u64 = 1 << 30;

/// Calls `emit` with every document of `path`, in order.
pub fn documents(
    path: &Path,
    reading: &Reading,
    read: Arc<AtomicU64>,
    emit: &mut dyn FnMut(RawDocument) -> Result<(), PrepareError>,
) -> Result<(), PrepareError> {
    let (kind, _) = classify(path);
    let shared: Arc<Path> = Arc::from(path);
    let io_err = |source| PrepareError::Input { path: path.to_path_buf(), source };
    match kind {
        Kind::Parquet => parquet_documents(path, &reading.field, read, &shared, emit),
        Kind::Jsonl => {
            let mut reader = open(path, read)?;
            let (mut line, mut offset, mut number) = (Vec::new(), 0u64, 0u64);
            loop {
                line.clear();
                let n = reader.read_until(b'\n', &mut line).map_err(io_err)?;
                if n == 0 {
                    return Ok(());
                }
                number += 1;
                let start = offset;
                offset += n as u64;
                let body = line.trim_ascii();
                if body.is_empty() {
                    continue;
                }
                let body = match utf8(body, reading.invalid, path, start, Some(number))? {
                    Some(body) => body,
                    // Handed on as it is: the reader leaves it out and counts it.
                    None => {
                        emit(RawDocument {
                            bytes: body.to_vec(),
                            path: shared.clone(),
                            offset: start,
                            line: Some(number),
                        })?;
                        continue;
                    }
                };
                let bytes = json_field(&body, &reading.field).map_err(|reason| PrepareError::Jsonl {
                    path: path.to_path_buf(),
                    line: number,
                    reason,
                })?;
                emit(RawDocument { bytes, path: shared.clone(), offset: start, line: Some(number) })?;
            }
        }
        Kind::Text => {
            let mut reader = open(path, read)?;
            match &reading.separator {
                None => {
                    let mut bytes = Vec::new();
                    let n = reader.by_ref().take(MAX_DOCUMENT_BYTES + 1).read_to_end(&mut bytes).map_err(io_err)?;
                    if n as u64 > MAX_DOCUMENT_BYTES {
                        return Err(PrepareError::DocumentTooLarge { path: path.to_path_buf() });
                    }
                    emit(RawDocument { bytes, path: shared, offset: 0, line: None })
                }
                Some(separator) => split_stream(&mut reader, separator.as_bytes(), &shared, emit),
            }
        }
    }
}

/// The documents of a stream cut at `separator`, read in 1 MiB blocks (a document is held
/// whole, the stream is not).
fn split_stream(
    reader: &mut dyn BufRead,
    separator: &[u8],
    path: &Arc<Path>,
    emit: &mut dyn FnMut(RawDocument) -> Result<(), PrepareError>,
) -> Result<(), PrepareError> {
    let finder = memchr::memmem::Finder::new(separator);
    let (mut pending, mut pending_offset) = (Vec::<u8>::new(), 0u64);
    let mut block = vec![0u8; 1 << 20];
    loop {
        let n = reader.read(&mut block).map_err(|source| PrepareError::Input { path: path.to_path_buf(), source })?;
        // Search only where a separator could end in the new bytes.
        let search_from = pending.len().saturating_sub(separator.len() - 1);
        pending.extend_from_slice(&block[..n]);
        let mut cut = 0;
        let mut from = search_from;
        while let Some(at) = finder.find(&pending[from..]).map(|i| from + i) {
            emit(RawDocument {
                bytes: pending[cut..at].to_vec(),
                path: path.clone(),
                offset: pending_offset + cut as u64,
                line: None,
            })?;
            cut = at + separator.len();
            from = cut;
        }
        if n == 0 {
            emit(RawDocument {
                bytes: pending[cut..].to_vec(),
                path: path.clone(),
                offset: pending_offset + cut as u64,
                line: None,
            })?;
            return Ok(());
        }
        pending.drain(..cut);
        pending_offset += cut as u64;
        if pending.len() as u64 > MAX_DOCUMENT_BYTES {
            return Err(PrepareError::DocumentTooLarge { path: path.to_path_buf() });
        }
    }
}

/// The documents of a Parquet file: the string column `field` (top level, not repeated), one
/// document per row; a null row is an empty document (left out). Read row group by row
/// group, a thousand values at a time.
fn parquet_documents(
    path: &Path,
    field: &str,
    read: Arc<AtomicU64>,
    shared: &Arc<Path>,
    emit: &mut dyn FnMut(RawDocument) -> Result<(), PrepareError>,
) -> Result<(), PrepareError> {
    use parquet::basic::{ConvertedType, LogicalType, Type as Physical};
    use parquet::column::reader::ColumnReader;
    use parquet::file::reader::{FileReader, SerializedFileReader};

    let bad = |message: String| PrepareError::Parquet { path: path.to_path_buf(), message };
    let file = File::open(path).map_err(|source| PrepareError::Input { path: path.to_path_buf(), source })?;
    let size = file.metadata().map(|m| m.len()).unwrap_or(0);
    let reader = SerializedFileReader::new(file).map_err(|e| bad(format!("not a readable Parquet file: {e}")))?;
    let schema = reader.metadata().file_metadata().schema_descr_ptr();
    let names: Vec<String> = (0..schema.num_columns()).map(|i| schema.column(i).path().string()).collect();
    let Some(index) = names.iter().position(|n| n == field) else {
        return Err(bad(format!(
            "no column {field:?} (it has: {}); name the text column with --field",
            names.join(", ")
        )));
    };
    let column = schema.column(index);
    let is_string = column.physical_type() == Physical::BYTE_ARRAY
        && (matches!(column.logical_type(), Some(LogicalType::String))
            || column.converted_type() == ConvertedType::UTF8);
    if !is_string {
        let kind = match column.logical_type() {
            Some(logical) => format!("{logical:?}"),
            None => format!("{}", column.physical_type()),
        };
        return Err(bad(format!(
            "column {field:?} holds {kind}, not strings; name a string column with --field (columns: {})",
            names.join(", ")
        )));
    }
    if column.max_rep_level() > 0 {
        return Err(bad(format!("column {field:?} is a list of strings; name a column of one string per row")));
    }
    let max_def = column.max_def_level();
    let mut row = 0u64;
    let (mut values, mut defs) = (Vec::new(), Vec::new());
    for group in 0..reader.num_row_groups() {
        let group_reader = reader.get_row_group(group).map_err(|e| bad(e.to_string()))?;
        let ColumnReader::ByteArrayColumnReader(mut column_reader) =
            group_reader.get_column_reader(index).map_err(|e| bad(e.to_string()))?
        else {
            unreachable!("a BYTE_ARRAY column has a byte-array reader");
        };
        loop {
            values.clear();
            defs.clear();
            let levels = (max_def > 0).then_some(&mut defs);
            let (records, _, _) =
                column_reader.read_records(1024, levels, None, &mut values).map_err(|e| bad(e.to_string()))?;
            if records == 0 {
                break;
            }
            let mut values_iter = values.drain(..);
            // One definition level per row (the column is not repeated); none when required.
            let present: Box<dyn Iterator<Item = bool>> = if max_def == 0 {
                Box::new(std::iter::repeat_n(true, records))
            } else {
                Box::new(defs[..records].iter().map(|&d| d == max_def))
            };
            for present in present {
                row += 1;
                let bytes = if present {
                    values_iter.next().map(|v| v.data().to_vec()).unwrap_or_default()
                } else {
                    Vec::new()
                };
                emit(RawDocument { bytes, path: shared.clone(), offset: 0, line: Some(row) })?;
            }
        }
        // Progress in whole row groups: the file's share of this one.
        read.fetch_add(size / reader.num_row_groups().max(1) as u64, Ordering::Relaxed);
    }
    Ok(())
}

/// `bytes` as text under the `--invalid` policy: `None` when the document is to be skipped.
/// `offset` (and `line`) place it in its file for the error.
pub fn utf8<'a>(
    bytes: &'a [u8],
    invalid: Invalid,
    path: &Path,
    offset: u64,
    line: Option<u64>,
) -> Result<Option<std::borrow::Cow<'a, str>>, PrepareError> {
    match std::str::from_utf8(bytes) {
        Ok(text) => Ok(Some(text.into())),
        Err(e) => match invalid {
            Invalid::Error => Err(PrepareError::InvalidUtf8 {
                path: path.to_path_buf(),
                offset: offset + e.valid_up_to() as u64,
                line,
            }),
            Invalid::Replace => Ok(Some(String::from_utf8_lossy(bytes))),
            Invalid::Skip => Ok(None),
        },
    }
}

/// The string field `field` of a JSON object line, as UTF-8 bytes.
fn json_field(line: &str, field: &str) -> Result<Vec<u8>, String> {
    let value: serde_json::Value = serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
    let serde_json::Value::Object(mut object) = value else {
        return Err("not a JSON object".into());
    };
    match object.remove(field) {
        Some(serde_json::Value::String(text)) => Ok(text.into_bytes()),
        Some(other) => {
            let mut shown = other.to_string();
            if shown.chars().count() > 60 {
                shown = shown.chars().take(57).chain("...".chars()).collect();
            }
            Err(format!("field {field:?} is not a string but {shown}"))
        }
        None => {
            let keys: Vec<_> = object.keys().map(String::as_str).collect();
            Err(format!("no field {field:?} (it has: {}); name the text field with --field", keys.join(", ")))
        }
    }
}
