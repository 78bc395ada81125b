//! Hugging Face folders: `config.json` + `*.safetensors` with Llama parameter names, read
//! for fine-tuning and written at the end of training.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};

use crate::save::{BufDType, NamedBuffer, SaveError, TensorSpec};

use super::{ModelError, ModelSpec, cerr};

/// The checkpoint element type of a tensor of `dtype`, or an error naming tensor `name`.
fn buf_dtype(name: &str, dtype: DType) -> Result<BufDType, ModelError> {
    Ok(match dtype {
        DType::F32 => BufDType::F32,
        DType::F64 => BufDType::F64,
        DType::U32 => BufDType::U32,
        DType::U8 => BufDType::U8,
        DType::BF16 => BufDType::BF16,
        DType::F16 => BufDType::F16,
        other => return Err(ModelError::Candle(format!("{name}: saving {other:?} tensors is not supported"))),
    })
}

/// A tensor as a named little-endian buffer for the checkpoint writer.
pub fn tensor_to_buffer(name: &str, t: &Tensor) -> Result<NamedBuffer, ModelError> {
    let dtype = buf_dtype(name, t.dtype())?;
    let t = t.contiguous().map_err(cerr)?.flatten_all().map_err(cerr)?;
    let data: Vec<u8> = match dtype {
        BufDType::F32 => bytemuck::cast_slice(&t.to_vec1::<f32>().map_err(cerr)?).to_vec(),
        BufDType::F64 => bytemuck::cast_slice(&t.to_vec1::<f64>().map_err(cerr)?).to_vec(),
        BufDType::U32 => bytemuck::cast_slice(&t.to_vec1::<u32>().map_err(cerr)?).to_vec(),
        BufDType::U8 => t.to_vec1::<u8>().map_err(cerr)?,
        BufDType::BF16 => bytemuck::cast_slice(&t.to_vec1::<half::bf16>().map_err(cerr)?).to_vec(),
        BufDType::F16 => bytemuck::cast_slice(&t.to_vec1::<half::f16>().map_err(cerr)?).to_vec(),
        BufDType::I64 => unreachable!("buf_dtype gives no I64"),
    };
    Ok(NamedBuffer { name: name.to_string(), dtype, shape: Vec::new(), data })
}

/// safetensors bytes of named tensors (f32, f64, bf16, f16, u32 or u8), deterministic.
pub fn tensors_to_safetensors(tensors: &[(String, Tensor)]) -> Result<Vec<u8>, ModelError> {
    let mut out = Vec::new();
    write_tensors(&mut out, tensors).map_err(|e| ModelError::Candle(e.to_string()))?;
    Ok(out)
}

/// Writes [`tensors_to_safetensors`]'s bytes to `out`, copying one tensor out at a time: a
/// model as large as memory allows can be saved.
pub fn write_tensors(out: &mut dyn std::io::Write, tensors: &[(String, Tensor)]) -> Result<(), SaveError> {
    let bad = |name: &str, e: ModelError| SaveError::BadBuffer { name: name.to_string(), reason: e.to_string() };
    let specs = tensors
        .iter()
        .map(|(name, t)| tensor_spec(name, t.dtype(), t.dims()).map_err(|e| bad(name, e)))
        .collect::<Result<Vec<_>, SaveError>>()?;
    write_tensors_from(out, &specs, &mut |i| {
        let (name, t) = &tensors[i];
        Ok(tensor_to_buffer(name, t).map_err(|e| bad(name, e))?.data)
    })
}

/// [`write_tensors`] of tensors described by `specs` whose bytes `bytes(i)` gives one at
/// a time (ZeRO stage 3: from the rank that holds each).
pub fn write_tensors_from(
    out: &mut dyn std::io::Write,
    specs: &[TensorSpec],
    bytes: &mut dyn FnMut(usize) -> Result<Vec<u8>, SaveError>,
) -> Result<(), SaveError> {
    crate::save::write_safetensors(out, specs, None, &mut |i| Ok(std::borrow::Cow::Owned(bytes(i)?)))?;
    Ok(())
}

/// How a tensor of `dtype` and `shape` named `name` is described in a safetensors header.
pub fn tensor_spec(name: &str, dtype: DType, shape: &[usize]) -> Result<TensorSpec, ModelError> {
    Ok(TensorSpec { name: name.to_string(), dtype: buf_dtype(name, dtype)?, shape: shape.to_vec() })
}

/// Named tensors from safetensors bytes; `path` names the source in errors.
pub fn tensors_from_safetensors(bytes: &[u8], path: &Path) -> Result<HashMap<String, Tensor>, ModelError> {
    candle_core::safetensors::load_buffer(bytes, &Device::Cpu).map_err(|e| ModelError::Io {
        path: path.to_path_buf(),
        message: format!("not a readable safetensors file: {e}"),
    })
}

/// Reads a folder's `config.json` and its weights, found as transformers finds them: the
/// shards named by `model.safetensors.index.json`, else `model.safetensors`, else every
/// `*.safetensors` in the folder.
pub fn load_hf_folder(dir: &Path) -> Result<(ModelSpec, HashMap<String, Tensor>), ModelError> {
    let io = |path: &Path, e: std::io::Error| ModelError::Io { path: path.to_path_buf(), message: e.to_string() };
    let config = dir.join("config.json");
    if !config.is_file() {
        return Err(ModelError::HfConfig {
            path: config,
            message: "not found: model.from must name a folder holding config.json and *.safetensors".into(),
        });
    }
    let spec = ModelSpec::from_hf_config(&config)?;
    let index = dir.join("model.safetensors.index.json");
    let files: Vec<PathBuf> = if index.is_file() {
        let bad = |message: String| ModelError::Weights { path: index.clone(), problems: vec![message] };
        let text = read_bounded(&index, ava_fs::bounded::limits::JSON)?;
        let text = String::from_utf8(text).map_err(|_| bad("not UTF-8 text".into()))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| bad("no \"weight_map\" object naming each tensor's file".into()))?;
        let mut names: Vec<&str> = map.values().filter_map(|f| f.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        if names.iter().any(|n| n.contains('/') || n.contains('\\') || *n == "..") {
            return Err(bad("weight_map names a file outside the folder".into()));
        }
        names.into_iter().map(|n| dir.join(n)).collect()
    } else if dir.join("model.safetensors").is_file() {
        vec![dir.join("model.safetensors")]
    } else {
        let mut all: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| io(dir, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        all.sort();
        all
    };
    if files.is_empty() {
        // PyTorch's pickles are not read: loading one runs code it holds.
        let pickles: Vec<String> = std::fs::read_dir(dir)
            .map_err(|e| io(dir, e))?
            .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
            .filter(|n| n.ends_with(".bin") || n.ends_with(".pt") || n.ends_with(".pth"))
            .collect();
        let problem = if pickles.is_empty() {
            "no *.safetensors file in the folder".to_string()
        } else {
            format!(
                "the weights are PyTorch pickles ({}), which Ava does not read (loading a pickle runs the code in it): \
                 convert them to safetensors with transformers, e.g. python3 -c \"from transformers import \
                 AutoModelForCausalLM as M; M.from_pretrained('{dir}').save_pretrained('{dir}', \
                 safe_serialization=True)\"",
                pickles.join(", "),
                dir = dir.display()
            )
        };
        return Err(ModelError::Weights { path: dir.to_path_buf(), problems: vec![problem] });
    }
    let mut tensors = HashMap::new();
    for file in files {
        let bytes = read_bounded(&file, ava_fs::bounded::limits::LARGE)?;
        tensors.extend(tensors_from_safetensors(&bytes, &file)?);
    }
    Ok((spec, tensors))
}

/// The bytes of `path`, a regular file of at most `limit` bytes (a FIFO or a device named by
/// a model folder is refused instead of hanging or filling memory).
pub(crate) fn read_bounded(path: &Path, limit: u64) -> Result<Vec<u8>, ModelError> {
    ava_fs::bounded::read(path, limit).map_err(|e| {
        let full = e.to_string();
        let message = full.strip_prefix(&format!("{}: ", path.display())).map(str::to_string).unwrap_or(full);
        ModelError::Io { path: path.to_path_buf(), message }
    })
}

/// Writes `config.json` and `model.safetensors` into `dir` (created if needed), each
/// atomically. `dir` is made and written relative to its opened parent, never through a
/// link: a link (or FIFO, device) planted at `dir` or at a file's name is refused or replaced,
/// not followed ([`ava_fs::dirfd`]).
pub fn save_hf_folder(dir: &Path, spec: &ModelSpec, tensors: &[(String, Tensor)]) -> Result<(), ModelError> {
    save_hf_folder_with(dir, spec, &mut |out| write_tensors(out, tensors))
}

/// [`save_hf_folder`] with the weights written by `weights` (e.g. [`write_tensors_from`]).
pub fn save_hf_folder_with(
    dir: &Path,
    spec: &ModelSpec,
    weights: &mut dyn FnMut(&mut dyn std::io::Write) -> Result<(), SaveError>,
) -> Result<(), ModelError> {
    let folder = open_output_dir(dir)?;
    let config = serde_json::to_vec_pretty(&spec.to_hf_config()).expect("a JSON value serializes");
    folder.replace("config.json", 0o666, |f| std::io::Write::write_all(f, &config)).map_err(dir_error)?;
    // The weights stream to the file, one tensor's copy at a time.
    folder
        .replace("model.safetensors", 0o666, |f| {
            let mut out = std::io::BufWriter::with_capacity(1 << 20, f);
            weights(&mut out).map_err(std::io::Error::other)?;
            std::io::Write::flush(&mut out)
        })
        .map_err(dir_error)
}

/// Creates (if needed) and opens the output folder `dir`, relative to its parent (created
/// as the user named it) and without following a link at `dir`.
pub(crate) fn open_output_dir(dir: &Path) -> Result<ava_fs::dirfd::Dir, ModelError> {
    let name = dir.file_name().and_then(|n| n.to_str()).ok_or_else(|| ModelError::Io {
        path: dir.to_path_buf(),
        message: "not a folder name to write into; name a folder, e.g. out/model".into(),
    })?;
    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let parent = ava_fs::dirfd::Dir::create_all(parent).map_err(dir_error)?;
    parent.create_dir(name, 0o777).map_err(dir_error)
}

/// A [`DirError`](ava_fs::dirfd::DirError) as a [`ModelError::Io`] naming its path once.
pub(crate) fn dir_error(e: ava_fs::dirfd::DirError) -> ModelError {
    let full = e.to_string();
    let path = e.path().map(Path::to_path_buf).unwrap_or_default();
    let message = full.strip_prefix(&format!("{}: ", path.display())).map(str::to_string).unwrap_or(full);
    ModelError::Io { path, message }
}
