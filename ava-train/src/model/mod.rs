//! The Llama-style decoder on candle: architecture ([`ModelSpec`]), differentiable ops,
//! the attention-kernel adapter, packed documents ([`Documents`]), the model, the recompute mechanism behind checkpoint
//! policies, Hugging Face folder loading and saving, and generation with a KV cache.

mod attention;
mod documents;
pub mod fused;
mod generate;
mod head_loss;
mod hf;
mod hf_config;
mod llama;
pub mod ops;
mod park;
mod recompute;
mod rope;
mod spec;

#[cfg(test)]
mod tests;

use std::path::PathBuf;

pub use attention::{attention, unsupported_packing};
pub use documents::Documents;
pub use generate::{
    Generator, Sampler, Sampling, Stop, argmax, check_positions, context_note, generate, generator_bytes, prompt_chunk,
};
pub(crate) use head_loss::blocks as loss_blocks;
pub use head_loss::{DEFAULT_LOSS_CHUNK_ROWS, head_loss};
pub(crate) use hf::{dir_error, read_bounded};
pub use hf::{
    load_hf_folder, save_hf_folder, save_hf_folder_with, tensor_spec, tensor_to_buffer, tensors_from_safetensors,
    tensors_to_safetensors, write_tensors, write_tensors_from,
};
pub use hf_config::{HfConfig, parse_hf_config, read_hf_config};
pub use llama::{BlockOut, Model, Param};
pub use park::Parking;
pub use recompute::{GradSink, Grads, MicroLoss, Weights, forward_backward, forward_logits};
pub use rope::{RopeScaling, RopeSpec};
pub use spec::{Arch, Biases, ModelSpec, MoeSpec, ParamDef, ParamRole};
pub(crate) use spec::{BlockIndex, MlpIndex, ParamIndex};

/// What can go wrong building, loading or running the model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// Generation could not start (an empty prompt, ids outside the vocabulary).
    #[error("{0}")]
    Generate(String),
    /// The architecture numbers do not fit together.
    #[error("invalid model architecture in {origin}:\n  - {}", problems.join("\n  - "))]
    Spec {
        /// `model` (the config section) or the config.json path.
        origin: String,
        /// Every problem found.
        problems: Vec<String>,
    },
    /// A Hugging Face config.json that cannot be used.
    #[error("{}: {message}", path.display())]
    HfConfig {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// Weights that do not match the architecture.
    #[error("the weights in {} do not match the model:\n  - {}", path.display(), problems.join("\n  - "))]
    Weights {
        /// The folder or file.
        path: PathBuf,
        /// Every mismatch.
        problems: Vec<String>,
    },
    /// Weights holding NaN or infinite values (checked as they are loaded).
    #[error(
        "the weights in {} hold values that are not finite, so every step's loss would be NaN:\n  - {}\nstart from \
         finite weights: an earlier checkpoint (--resume with its directory) or the original model",
        path.display(),
        problems.join("\n  - ")
    )]
    NonFiniteWeights {
        /// The folder or checkpoint.
        path: PathBuf,
        /// One line per tensor: its name, how many values, the first one.
        problems: Vec<String>,
    },
    /// Reading or writing a file.
    #[error("{}: {message}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        message: String,
    },
    /// A tensor operation failed.
    #[error("tensor operation failed: {0}")]
    Candle(String),
}

/// Wraps a candle error.
pub(crate) fn cerr(e: candle_core::Error) -> ModelError {
    ModelError::Candle(e.to_string())
}
