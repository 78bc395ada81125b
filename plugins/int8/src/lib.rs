//! # INT8 activation compression as an Ava plugin
//!
//! An [`OffloadTier`] that keeps records in host memory, floating-point ones quantized to
//! int8 block by block: each block of `block_size` values stores one f32 scale
//! (its largest magnitude / 127) and one signed byte per value, `round(x / scale)`.
//! On `get` the values come back as `q · scale` in their own type. An f32 record shrinks to
//! about 27% (block 64: 1 + 4/64 bytes per value instead of 4), a bf16 or f16 one to about
//! 53%; records of other types are stored as they are.
//!
//! It is lossy by design ([`exact`](OffloadTier::exact) is false): each value is off by at
//! most half a step, `scale / 2`, of its block. The engine uses it for what may be
//! approximated, the checkpointed block inputs (`plugins.checkpoint: {name: selective,
//! every: 1, offload: true}`), and refuses to stream optimizer state through it.
//!
//! ```yaml
//! plugins:
//!   checkpoint: {name: selective, every: 1, offload: true}
//!   offload: {name: int8, block_size: 64}
//! ```

use std::{
    collections::HashMap,
    sync::{Mutex, MutexGuard},
};

use ava_core::prelude::*;

/// A stored record.
#[derive(Debug)]
enum Record {
    /// Quantized: the element type to return, the value count, per-block scales and codes.
    Quantized { dtype: DType, len: usize, scales: Vec<f32>, codes: Vec<i8> },
    /// Stored as given (not a floating-point type).
    Raw(Vec<u8>),
}

impl Record {
    fn stored_bytes(&self) -> u64 {
        match self {
            Record::Quantized { scales, codes, .. } => (scales.len() * 4 + codes.len()) as u64,
            Record::Raw(b) => b.len() as u64,
        }
    }
    fn len_bytes(&self) -> u64 {
        match self {
            Record::Quantized { dtype, len, .. } => (*len * dtype.size()) as u64,
            Record::Raw(b) => b.len() as u64,
        }
    }
}

/// The `int8` tier.
#[derive(Debug)]
pub struct Int8Tier {
    block: usize,
    records: Mutex<(HashMap<String, Record>, u64)>,
}

/// Quantizes `values` in blocks of `block`: (scales, codes).
pub fn quantize(values: &[f32], block: usize) -> (Vec<f32>, Vec<i8>) {
    let mut scales = Vec::with_capacity(values.len().div_ceil(block));
    let mut codes = Vec::with_capacity(values.len());
    for chunk in values.chunks(block) {
        let absmax = chunk.iter().fold(0f32, |m, &x| m.max(x.abs()));
        // A block of zeros (or one that is not finite) keeps scale 0 / its NaN: it comes back
        // as zeros / NaN, as the engine's overflow checks expect.
        let scale = absmax / 127.0;
        scales.push(scale);
        let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
        codes.extend(chunk.iter().map(|&x| (x * inv).round().clamp(-127.0, 127.0) as i8));
    }
    (scales, codes)
}

/// The values back from their blocks' scales and codes.
pub fn dequantize(scales: &[f32], codes: &[i8], block: usize, out: &mut [f32]) {
    for ((o, c), &s) in out.chunks_mut(block).zip(codes.chunks(block)).zip(scales) {
        for (o, &c) in o.iter_mut().zip(c) {
            *o = f32::from(c) * s;
        }
    }
}

impl Int8Tier {
    /// A tier quantizing in blocks of `block` values.
    pub fn new(block: usize) -> Self {
        Self { block: block.max(1), records: Mutex::default() }
    }

    fn records(&self) -> MutexGuard<'_, (HashMap<String, Record>, u64)> {
        self.records.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Plugin for Int8Tier {
    fn manifest() -> Manifest {
        Manifest::new(
            "int8",
            PluginKind::Offload,
            env!("CARGO_PKG_VERSION"),
            "lossy offload to RAM: activations quantized to int8 per block (absmax scale), about 27% of f32, 53% of bf16",
        )
        .option(OptionSpec::int(
            "block_size",
            64,
            "values per quantization block; each block stores one f32 scale. Smaller: more accurate, more scale overhead",
        ))
    }

    fn from_options(mut options: Options) -> Result<Self, PluginError> {
        let block = options.int("block_size");
        options.check((1..=1 << 20).contains(&block), || {
            format!("option 'block_size': expected 1 to 1048576 values, got {block}")
        });
        options.finish()?;
        Ok(Self::new(block as usize))
    }
}

fn floats(bytes: &[u8], dtype: DType) -> Option<Vec<f32>> {
    let read = |n: usize, f: &dyn Fn(&[u8]) -> f32| bytes.chunks_exact(n).map(f).collect::<Vec<f32>>();
    match dtype {
        DType::F32 if bytes.len().is_multiple_of(4) => Some(read(4, &|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))),
        DType::BF16 if bytes.len().is_multiple_of(2) => {
            Some(read(2, &|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()))
        }
        DType::F16 if bytes.len().is_multiple_of(2) => {
            Some(read(2, &|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()))
        }
        _ => None,
    }
}

impl OffloadTier for Int8Tier {
    fn capacity(&self) -> u64 {
        u64::MAX
    }

    fn used_bytes(&self) -> u64 {
        self.records().1
    }

    /// The records live in this library's memory.
    fn resident_bytes(&self) -> u64 {
        self.records().1
    }

    fn put(&self, key: &str, bytes: &[u8], dtype: DType) -> Result<(), PluginError> {
        let record = match floats(bytes, dtype) {
            Some(values) => {
                let (scales, codes) = quantize(&values, self.block);
                Record::Quantized { dtype, len: values.len(), scales, codes }
            }
            None => Record::Raw(bytes.to_vec()),
        };
        let mut records = self.records();
        let added = record.stored_bytes();
        let removed = records.0.insert(key.to_string(), record).map_or(0, |r| r.stored_bytes());
        records.1 = records.1 - removed + added;
        Ok(())
    }

    fn get(&self, key: &str, into: &mut [u8]) -> Result<(), PluginError> {
        let records = self.records();
        let record = records
            .0
            .get(key)
            .ok_or_else(|| PluginError::invalid_input(format!("int8 tier: no record under key '{key}'")))?;
        if record.len_bytes() != into.len() as u64 {
            return Err(PluginError::invalid_input(format!(
                "int8 tier: record '{key}' has {} bytes, the buffer to read it into has {}",
                record.len_bytes(),
                into.len()
            )));
        }
        match record {
            Record::Raw(b) => into.copy_from_slice(b),
            Record::Quantized { dtype, len, scales, codes } => {
                let mut values = vec![0f32; *len];
                dequantize(scales, codes, self.block, &mut values);
                match dtype {
                    DType::F32 => into.copy_from_slice(bytemuck::cast_slice(&values)),
                    DType::BF16 | DType::F16 => {
                        for (o, &v) in into.chunks_exact_mut(2).zip(&values) {
                            let bits = if *dtype == DType::BF16 {
                                half::bf16::from_f32(v).to_bits()
                            } else {
                                half::f16::from_f32(v).to_bits()
                            };
                            o.copy_from_slice(&bits.to_le_bytes());
                        }
                    }
                    other => unreachable!("only float records are quantized, not {other:?}"),
                }
            }
        }
        Ok(())
    }

    fn len(&self, key: &str) -> Result<Option<u64>, PluginError> {
        Ok(self.records().0.get(key).map(Record::len_bytes))
    }

    fn evict(&self, key: &str) -> Result<(), PluginError> {
        let mut records = self.records();
        if let Some(r) = records.0.remove(key) {
            records.1 -= r.stored_bytes();
        }
        Ok(())
    }

    fn exact(&self) -> bool {
        false
    }

    fn describe(&self) -> String {
        format!("int8 tier: floating-point records quantized in blocks of {} values (lossy)", self.block)
    }
}

ava_core::export_plugin!(offload: Int8Tier);

#[cfg(test)]
mod tests {
    use super::*;

    fn build(json: &str) -> Result<Int8Tier, PluginError> {
        ava_core::ffi::build::<Int8Tier>(json, &HostContext::default())
    }

    /// Every value comes back within half a quantization step of its block; the sizes are
    /// the promised fractions; other types are exact.
    #[test]
    fn round_trip_error_is_bounded_and_memory_shrinks() {
        let t = build(r#"{"block_size": 64}"#).unwrap();
        let values: Vec<f32> = (0..1000).map(|i| ((i as f32) * 0.37).sin() * (1.0 + (i % 7) as f32)).collect();
        t.put("act/0", bytemuck::cast_slice(&values), DType::F32).unwrap();
        assert_eq!(t.used_bytes(), 1000 + 16 * 4, "one byte per value and one f32 per block of 64");
        let mut back = vec![0f32; 1000];
        t.get("act/0", bytemuck::cast_slice_mut(&mut back)).unwrap();
        for (b, chunk) in back.chunks(64).zip(values.chunks(64)) {
            let step = chunk.iter().fold(0f32, |m, x| m.max(x.abs())) / 127.0;
            for (x, y) in chunk.iter().zip(b) {
                assert!((x - y).abs() <= step * 0.5 + 1e-6, "{x} came back as {y} (step {step})");
            }
        }
        assert_ne!(back, values, "lossy: something was rounded");
        assert!(!t.exact());

        let halves: Vec<half::bf16> = values.iter().map(|&v| half::bf16::from_f32(v)).collect();
        t.put("act/1", bytemuck::cast_slice(&halves), DType::BF16).unwrap();
        let mut back = vec![half::bf16::ZERO; 1000];
        t.get("act/1", bytemuck::cast_slice_mut(&mut back)).unwrap();
        let worst = halves.iter().zip(&back).map(|(a, b)| (a.to_f32() - b.to_f32()).abs()).fold(0f32, f32::max);
        assert!(worst <= 7.0 / 127.0 * 0.5 + 0.04, "bf16 within a step and a bf16 rounding: {worst}");

        t.put("codes", &[1, 2, 3], DType::U8).unwrap();
        let mut raw = [0u8; 3];
        t.get("codes", &mut raw).unwrap();
        assert_eq!(raw, [1, 2, 3]);
        assert_eq!(t.len("act/1").unwrap(), Some(2000));
        t.evict("act/0").unwrap();
        t.evict("act/1").unwrap();
        t.evict("codes").unwrap();
        assert_eq!(t.used_bytes(), 0);
    }

    #[test]
    fn zeros_stay_zeros_and_errors_name_the_key() {
        let t = Int8Tier::new(4);
        t.put("z", bytemuck::cast_slice(&[0f32; 10]), DType::F32).unwrap();
        let mut back = [1f32; 10];
        t.get("z", bytemuck::cast_slice_mut(&mut back)).unwrap();
        assert_eq!(back, [0f32; 10]);
        let e = t.get("z", &mut [0u8; 4]).unwrap_err();
        assert_eq!(e.message.as_str(), "int8 tier: record 'z' has 40 bytes, the buffer to read it into has 4");
        let e = t.get("nope", &mut [0u8; 4]).unwrap_err();
        assert_eq!(e.message.as_str(), "int8 tier: no record under key 'nope'");
        let e = build(r#"{"block_size": 0}"#).unwrap_err();
        assert_eq!(e.details().collect::<Vec<_>>(), ["option 'block_size': expected 1 to 1048576 values, got 0"]);
    }
}
