//! Named byte buffers and their safetensors encoding: [`to_safetensors`] and
//! [`from_safetensors`]. The store deals only in bytes; the trainer turns tensors into
//! [`NamedBuffer`]s and back, so this module needs no tensor library.
//!
//! The writer is our own, not `safetensors::serialize`, because that one keeps the metadata
//! in a `HashMap` and so writes its keys in a random order: the same checkpoint would get a
//! different sha256 each time. The layout is the safetensors crate's own (tensors ordered by
//! descending dtype alignment, then name; header padded with spaces to 8 bytes), so every
//! tensor's data is aligned for memory-mapped reads, and without metadata the bytes are the
//! same as that crate's. Reading uses the safetensors crate, which validates the file.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use safetensors::{Dtype, SafeTensors};

use super::SaveError;

/// Element type of a [`NamedBuffer`]; the names are safetensors'.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BufDType {
    /// 32-bit float.
    F32,
    /// IEEE half float.
    F16,
    /// bfloat16.
    BF16,
    /// 64-bit float.
    F64,
    /// Unsigned byte.
    U8,
    /// Unsigned 32-bit integer.
    U32,
    /// Signed 64-bit integer.
    I64,
}

impl BufDType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Self::U8 => 1,
            Self::F16 | Self::BF16 => 2,
            Self::F32 | Self::U32 => 4,
            Self::F64 | Self::I64 => 8,
        }
    }

    /// The safetensors spelling, e.g. `BF16`.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::BF16 => "BF16",
            Self::F64 => "F64",
            Self::U8 => "U8",
            Self::U32 => "U32",
            Self::I64 => "I64",
        }
    }

    fn to_safetensors(self) -> Dtype {
        match self {
            Self::F32 => Dtype::F32,
            Self::F16 => Dtype::F16,
            Self::BF16 => Dtype::BF16,
            Self::F64 => Dtype::F64,
            Self::U8 => Dtype::U8,
            Self::U32 => Dtype::U32,
            Self::I64 => Dtype::I64,
        }
    }

    fn from_safetensors(dtype: Dtype) -> Option<Self> {
        Some(match dtype {
            Dtype::F32 => Self::F32,
            Dtype::F16 => Self::F16,
            Dtype::BF16 => Self::BF16,
            Dtype::F64 => Self::F64,
            Dtype::U8 => Self::U8,
            Dtype::U32 => Self::U32,
            Dtype::I64 => Self::I64,
            _ => return None,
        })
    }
}

impl std::fmt::Display for BufDType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One tensor as bytes: its name (e.g. `model.layers.0.self_attn.q_proj.weight`), element
/// type, shape, and raw little-endian data (`shape.iter().product() * dtype.size()` bytes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NamedBuffer {
    /// The tensor's name, kept exactly.
    pub name: String,
    /// Element type.
    pub dtype: BufDType,
    /// Dimensions, outermost first; empty for a scalar.
    pub shape: Vec<usize>,
    /// Raw little-endian element bytes, row-major.
    pub data: Vec<u8>,
}

/// Free-form string metadata stored in the safetensors header (`__metadata__`).
pub type TensorMetadata = BTreeMap<String, String>;

/// A tensor of a safetensors file whose data is produced while the file is written
/// ([`write_safetensors`]): its name, type and shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    /// Name, unique within a file.
    pub name: String,
    /// Element type.
    pub dtype: BufDType,
    /// Dimensions, outermost first; empty for a scalar.
    pub shape: Vec<usize>,
}

impl TensorSpec {
    /// Bytes of its data, `None` past `usize`.
    fn bytes(&self) -> Option<usize> {
        self.shape.iter().try_fold(self.dtype.size(), |acc, &d| acc.checked_mul(d))
    }
}

/// Encodes `buffers` (and optional `metadata`) as a safetensors file. The output depends only
/// on the content, not on the order of `buffers`. Fails on a repeated name or on data whose
/// length does not match dtype and shape.
pub fn to_safetensors(buffers: &[NamedBuffer], metadata: Option<TensorMetadata>) -> Result<Vec<u8>, SaveError> {
    let specs: Vec<TensorSpec> =
        buffers.iter().map(|b| TensorSpec { name: b.name.clone(), dtype: b.dtype, shape: b.shape.clone() }).collect();
    let total = 64 + buffers.iter().map(|b| b.data.len()).sum::<usize>();
    let mut out = Vec::with_capacity(total);
    write_safetensors(&mut out, &specs, metadata, &mut |i| Ok(std::borrow::Cow::Borrowed(&buffers[i].data)))?;
    Ok(out)
}

/// Writes the safetensors file of `specs` (and `metadata`) to `out`, asking `data` for each
/// tensor's bytes in the order they are laid out and writing them before asking for the
/// next: a file of any size needs one tensor's bytes in memory at a time. The bytes are
/// [`to_safetensors`]'s for the same tensors. Returns the bytes written.
pub fn write_safetensors<'d>(
    out: &mut dyn std::io::Write,
    specs: &[TensorSpec],
    metadata: Option<TensorMetadata>,
    data: &mut dyn FnMut(usize) -> Result<std::borrow::Cow<'d, [u8]>, SaveError>,
) -> Result<u64, SaveError> {
    let bad = |name: &str, reason: String| SaveError::BadBuffer { name: name.to_string(), reason };
    let mut names = BTreeSet::new();
    for spec in specs {
        if spec.name == "__metadata__" {
            return Err(bad(
                &spec.name,
                "the name is reserved for the safetensors header's metadata; rename the tensor".into(),
            ));
        }
        if !names.insert(spec.name.as_str()) {
            return Err(bad(&spec.name, "the name appears more than once; every tensor needs its own name".into()));
        }
        if spec.bytes().is_none() {
            return Err(bad(&spec.name, format!("shape {:?} holds more than fits in memory", spec.shape)));
        }
    }

    // Descending alignment keeps every tensor's data aligned once the header is 8-aligned.
    let mut order: Vec<usize> = (0..specs.len()).collect();
    order.sort_by(|&a, &b| {
        let (a, b) = (&specs[a], &specs[b]);
        b.dtype.to_safetensors().cmp(&a.dtype.to_safetensors()).then_with(|| a.name.cmp(&b.name))
    });

    let mut header = String::from("{");
    if let Some(metadata) = &metadata {
        header.push_str("\"__metadata__\":");
        header.push_str(&json(metadata));
        header.push(',');
    }
    let mut offset = 0usize;
    for &i in &order {
        let spec = &specs[i];
        let end = offset + spec.bytes().expect("checked above");
        let _ = write!(
            header,
            "{}:{{\"dtype\":\"{}\",\"shape\":{},\"data_offsets\":[{offset},{end}]}},",
            json(&spec.name),
            spec.dtype,
            json(&spec.shape)
        );
        offset = end;
    }
    if header.ends_with(',') {
        header.pop();
    }
    header.push('}');
    while header.len() % 8 != 0 {
        header.push(' ');
    }

    let io = |e: std::io::Error| SaveError::Io { action: "write".into(), path: "safetensors data".into(), source: e };
    out.write_all(&(header.len() as u64).to_le_bytes()).map_err(io)?;
    out.write_all(header.as_bytes()).map_err(io)?;
    for &i in &order {
        let spec = &specs[i];
        let bytes = data(i)?;
        let expected = spec.bytes().expect("checked above");
        if bytes.len() != expected {
            return Err(bad(
                &spec.name,
                format!(
                    "{} bytes of data, but dtype {} and shape {:?} need {expected} bytes; convert the tensor to \
                     contiguous little-endian bytes of its dtype",
                    bytes.len(),
                    spec.dtype,
                    spec.shape
                ),
            ));
        }
        out.write_all(&bytes).map_err(io)?;
    }
    Ok((8 + header.len() + offset) as u64)
}

/// A tensor of a safetensors file, its data borrowed from the file's bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BufferView<'a> {
    /// Name.
    pub name: String,
    /// Element type.
    pub dtype: BufDType,
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
    /// Raw little-endian element bytes, row-major.
    pub data: &'a [u8],
}

/// Decodes a safetensors file: the buffers, sorted by name, and the header metadata.
pub fn from_safetensors(bytes: &[u8]) -> Result<(Vec<NamedBuffer>, Option<TensorMetadata>), SaveError> {
    let (views, metadata) = safetensors_views(bytes)?;
    let buffers = views
        .into_iter()
        .map(|v| NamedBuffer { name: v.name, dtype: v.dtype, shape: v.shape, data: v.data.to_vec() })
        .collect();
    Ok((buffers, metadata))
}

/// [`from_safetensors`] without copying the data: views into `bytes` (a mapped file's, for
/// a checkpoint larger than memory), sorted by name.
pub fn safetensors_views(bytes: &[u8]) -> Result<(Vec<BufferView<'_>>, Option<TensorMetadata>), SaveError> {
    let invalid = |e: safetensors::SafeTensorError| SaveError::Safetensors { reason: e.to_string() };
    let (_, header) = SafeTensors::read_metadata(bytes).map_err(invalid)?;
    let tensors = SafeTensors::deserialize(bytes).map_err(invalid)?;
    let mut views = Vec::with_capacity(tensors.len());
    for (name, view) in tensors.iter() {
        let dtype = BufDType::from_safetensors(view.dtype()).ok_or_else(|| SaveError::Safetensors {
            reason: format!(
                "tensor '{name}' has dtype {:?}, which Ava checkpoints do not use (F32, F16, BF16, F64, U8, U32, I64)",
                view.dtype()
            ),
        })?;
        views.push(BufferView { name: name.to_string(), dtype, shape: view.shape().to_vec(), data: view.data() });
    }
    views.sort_by(|a, b| a.name.cmp(&b.name));
    let metadata = header.metadata().as_ref().map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect());
    Ok((views, metadata))
}

/// Compact JSON of a value that always serializes (strings, maps of strings, lists of sizes).
fn json<T: serde::Serialize + ?Sized>(value: &T) -> String {
    serde_json::to_string(value).unwrap_or_default()
}
