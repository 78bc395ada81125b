//! A trained model for generation and evaluation (`ava generate`, `ava eval`): found from a
//! run directory, a checkpoint or a Hugging Face folder, with the tokenizer it was trained with
//! and its begin- and end-of-text ids; and what an exported model folder carries so that
//! other tools (transformers' `generate`) read it alike: `tokenizer.json`, the ids in
//! `config.json` and `generation_config.json`.
//!
//! Where a run's tokenizer comes from: `data.tokenizer` when set; a prepared corpus's
//! manifest (the byte tokenizer, or the `tokenizer.json` it was prepared with, and the ids it
//! puts around documents); raw bytes for a text file without a tokenizer and for the
//! synthetic source (whose sequences open with a newline).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ava_core::AttentionKernel;
use ava_data::{TextTokenizer, Tokenizer};
use serde_json::Value;

use crate::config::{Config, DataSource};
use crate::model::{self, Model, ModelError, ModelSpec};
use crate::save::{CheckpointStore, SaveError};

/// The checkpoint's weights and config, as the trainer writes them.
const MODEL_FILE: &str = "model.safetensors";
const AVA_CONFIG_FILE: &str = "ava-config.json";

/// Why a model could not be loaded for inference.
#[derive(Debug, thiserror::Error)]
pub enum InferenceError {
    /// The path is none of the things a model is read from.
    #[error(
        "{} is not a model: {reason}; give a run directory (train.out_dir), a checkpoint directory, or a Hugging \
         Face folder (config.json and *.safetensors)",
        path.display()
    )]
    NotAModel {
        /// The path given.
        path: PathBuf,
        /// What was looked for.
        reason: String,
    },
    /// The model's tokenizer could not be found or read.
    #[error("{0}")]
    Tokenizer(String),
    /// The weights or config could not be read.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The checkpoint could not be read.
    #[error(transparent)]
    Save(#[from] SaveError),
}

/// Where a model's tokenizer is, and the ids it puts around documents.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenizerSource {
    /// `None`: the byte tokenizer.
    pub file: Option<PathBuf>,
    /// The id that opens every document, if any.
    pub bos: Option<u32>,
    /// The id that ends every document (the end of text), if any.
    pub eos: Option<u32>,
}

impl TokenizerSource {
    /// Loads it.
    pub fn load(&self) -> Result<Tokenizer, InferenceError> {
        match &self.file {
            None => Ok(Tokenizer::Bytes),
            Some(path) => TextTokenizer::from_file(path)
                .map(|t| Tokenizer::File(Box::new(t)))
                .map_err(|e| InferenceError::Tokenizer(e.to_string())),
        }
    }
}

/// The tokenizer a run trained with, from its config (see the module docs).
pub fn run_tokenizer(config: &Config) -> Result<TokenizerSource, InferenceError> {
    let d = &config.data;
    let corpus = match d.source {
        DataSource::Shards => d.path.clone().or_else(|| d.mix.0.first().map(|s| s.path.clone())),
        _ => None,
    };
    let manifest =
        match &corpus {
            Some(dir) => Some(ava_data::manifest::Manifest::load(dir).map_err(|e| {
                InferenceError::Tokenizer(format!("cannot tell the run's tokenizer from its corpus: {e}"))
            })?),
            None => None,
        };
    let (bos, eos) = manifest.as_ref().map_or((None, None), |m| (m.bos_id, Some(m.eos_id)));
    let file = match (&d.tokenizer, &manifest) {
        (Some(path), _) => Some(path.clone()),
        (None, Some(m)) => match &m.tokenizer {
            ava_data::manifest::TokenizerId::Byte => None,
            ava_data::manifest::TokenizerId::Huggingface { file, .. } => Some(file.clone()),
        },
        (None, None) => None,
    };
    let bos = match d.source {
        // Every synthetic sequence opens with this byte.
        DataSource::Synthetic => Some(u32::from(ava_data::START)),
        _ => bos,
    };
    Ok(TokenizerSource { file, bos, eos })
}

/// A model loaded for inference, with its tokenizer.
pub struct Trained {
    /// The model (f32 weights).
    pub model: Model,
    /// Its tokenizer.
    pub tokenizer: Tokenizer,
    /// The id that opens a document, if the model was trained with one.
    pub bos: Option<u32>,
    /// The end-of-text id, if the model was trained with one.
    pub eos: Option<u32>,
    /// What was loaded: `runs/x/model (the model exported at the end of training)`.
    pub source: String,
    /// The run's config, when loaded from a run or a checkpoint.
    pub config: Option<Config>,
}

impl Trained {
    /// The positions the model is run on at most: its own context
    /// ([`ModelSpec::context`](crate::model::ModelSpec::context)), or the sequence length its
    /// run trained at when that is longer (Ava's exports leave `max_position_embeddings` to
    /// transformers' default).
    pub fn context(&self) -> usize {
        self.model.spec().context().max(self.config.as_ref().map_or(0, |c| c.data.seq_len))
    }
}

/// How a model is loaded: the attention kernel its forward pass uses (for `ava eval`), the
/// longest sequence it is run on, its threads, and a tokenizer file that overrides the one
/// found.
pub struct LoadOptions<'a> {
    /// The kernel and its name.
    pub kernel: (Arc<dyn AttentionKernel>, &'a str),
    /// Rotary tables of the training forward are built for this many positions.
    pub max_seq: usize,
    /// Compute threads.
    pub threads: usize,
    /// `--tokenizer FILE`.
    pub tokenizer: Option<&'a Path>,
}

/// Loads the model at `path`: a Hugging Face folder (config.json); a checkpoint
/// (manifest.json); a run directory, whose `model/` (written when the run finished) is
/// preferred to its latest checkpoint.
pub fn load(path: &Path, options: &LoadOptions<'_>) -> Result<Trained, InferenceError> {
    if path.join("config.json").is_file() {
        return load_folder(path, options, None);
    }
    if path.join(crate::save::MANIFEST_FILE).is_file() {
        return load_checkpoint(path, options);
    }
    if path.join("model").join("config.json").is_file() {
        let config = latest_config(path);
        return load_folder(&path.join("model"), options, config);
    }
    if path.join("checkpoints").is_dir() {
        let dir = CheckpointStore::new(path.join("checkpoints"), 0).resolve("latest")?;
        return load_checkpoint(&dir, options);
    }
    let reason = if path.is_dir() {
        "it holds no config.json, manifest.json, model/ or checkpoints/".to_string()
    } else if path.exists() {
        "it is a file".to_string()
    } else {
        "it does not exist".to_string()
    };
    Err(InferenceError::NotAModel { path: path.to_path_buf(), reason })
}

/// The config of a run's latest checkpoint, if it has one that reads.
fn latest_config(run: &Path) -> Option<Config> {
    let dir = CheckpointStore::new(run.join("checkpoints"), 0).resolve("latest").ok()?;
    let bytes = crate::model::read_bounded(&dir.join(AVA_CONFIG_FILE), ava_fs::bounded::limits::JSON).ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// A Hugging Face folder: its tokenizer.json (or `--tokenizer`), the ids in its config.json
/// or generation_config.json; without a tokenizer file, bytes when the vocabulary is theirs.
fn load_folder(dir: &Path, options: &LoadOptions<'_>, config: Option<Config>) -> Result<Trained, InferenceError> {
    let (spec, tensors) = model::load_hf_folder(dir)?;
    let ids = |file: &str, key: &str| -> Option<u32> {
        let bytes = crate::model::read_bounded(&dir.join(file), ava_fs::bounded::limits::JSON).ok()?;
        let v: Value = serde_json::from_slice(&bytes).ok()?;
        match &v[key] {
            Value::Number(n) => n.as_u64().and_then(|n| u32::try_from(n).ok()),
            // transformers allows a list of end ids; the first is the one it writes.
            Value::Array(a) => a.first().and_then(Value::as_u64).and_then(|n| u32::try_from(n).ok()),
            _ => None,
        }
    };
    let found = |key: &str| ids("generation_config.json", key).or_else(|| ids("config.json", key));
    let (bos, eos) = (found("bos_token_id"), found("eos_token_id"));
    // Whatever is at tokenizer.json is the tokenizer: a FIFO, a device or a dangling link
    // there is refused when it is read, never silently replaced by the byte tokenizer.
    let file = options.tokenizer.map(Path::to_path_buf).or_else(|| {
        let beside = dir.join("tokenizer.json");
        std::fs::symlink_metadata(&beside).is_ok().then_some(beside)
    });
    let source = match (file, &config) {
        (Some(file), _) => TokenizerSource { file: Some(file), bos, eos },
        // A run's folder without tokenizer.json (exported before they carried one).
        (None, Some(config)) => run_tokenizer(config)?,
        (None, None) if spec.vocab <= 257 => TokenizerSource { file: None, bos, eos },
        (None, None) => {
            return Err(InferenceError::Tokenizer(format!(
                "{} has no tokenizer.json and a vocabulary of {} (not bytes): pass the tokenizer it was trained \
                 with, --tokenizer FILE",
                dir.display(),
                spec.vocab
            )));
        }
    };
    assemble(spec, tensors, dir, "Hugging Face folder", source, config, options)
}

/// A checkpoint: its weights, and the tokenizer of the run it came from.
fn load_checkpoint(dir: &Path, options: &LoadOptions<'_>) -> Result<Trained, InferenceError> {
    let ckpt = CheckpointStore::load(dir)?;
    let config: Config =
        serde_json::from_slice(ckpt.file(AVA_CONFIG_FILE)?).map_err(|e| InferenceError::NotAModel {
            path: dir.to_path_buf(),
            reason: format!("its {AVA_CONFIG_FILE} does not read as a config ({e})"),
        })?;
    let spec = match &config.model.from {
        Some(from) => model::read_hf_config(&from.join("config.json"))?.spec,
        None => ModelSpec::from_config(&config.model)?,
    };
    let tensors = model::tensors_from_safetensors(ckpt.file(MODEL_FILE)?, &dir.join(MODEL_FILE))?;
    let mut source = run_tokenizer(&config)?;
    if let Some(file) = options.tokenizer {
        source.file = Some(file.to_path_buf());
    }
    assemble(spec, tensors, dir, "checkpoint", source, Some(config), options)
}

/// The model of `spec` with the weights read from `dir` (a `what`), and its tokenizer.
fn assemble(
    spec: ModelSpec,
    tensors: std::collections::HashMap<String, candle_core::Tensor>,
    dir: &Path,
    what: &str,
    source: TokenizerSource,
    config: Option<Config>,
    options: &LoadOptions<'_>,
) -> Result<Trained, InferenceError> {
    let tokenizer = source.load()?;
    let (kernel, name) = (options.kernel.0.clone(), options.kernel.1);
    let model = Model::from_tensors(spec, tensors, dir, options.max_seq.max(1), kernel, name, options.threads)?;
    Ok(Trained {
        model,
        tokenizer,
        bos: source.bos,
        eos: source.eos,
        source: format!("{} ({what})", dir.display()),
        config,
    })
}

/// Writes what an exported model folder needs beside its weights for other tools to use it:
/// `tokenizer.json` (a copy of the run's, or the byte tokenizer's), and the begin- and
/// end-of-text ids in `config.json` and `generation_config.json`.
pub fn write_tokenizer_files(dir: &Path, source: &TokenizerSource) -> Result<(), ModelError> {
    // Relative to the opened folder, never through a link planted in it.
    let folder = ava_fs::dirfd::Dir::open(dir).map_err(model::dir_error)?;
    let write = |name: &str, bytes: &[u8]| {
        folder.replace(name, 0o666, |f| std::io::Write::write_all(f, bytes)).map_err(model::dir_error)
    };
    let bytes = match &source.file {
        Some(file) => crate::model::read_bounded(file, ava_fs::bounded::limits::JSON)?,
        None => ava_data::byte_tokenizer_json(source.eos).into_bytes(),
    };
    write("tokenizer.json", &bytes)?;
    let config_path = dir.join("config.json");
    let text = folder.read("config.json", ava_fs::bounded::limits::JSON).map_err(model::dir_error)?;
    let mut config: Value = serde_json::from_slice(&text)
        .map_err(|e| ModelError::Io { path: config_path.clone(), message: e.to_string() })?;
    config["bos_token_id"] = source.bos.map_or(Value::Null, Value::from);
    config["eos_token_id"] = source.eos.map_or(Value::Null, Value::from);
    write("config.json", &serde_json::to_vec_pretty(&config).expect("a JSON value serializes"))?;
    let generation = serde_json::json!({
        "bos_token_id": source.bos,
        "eos_token_id": source.eos,
        "_from_model_config": true,
    });
    write("generation_config.json", &serde_json::to_vec_pretty(&generation).expect("a JSON value serializes"))
}
