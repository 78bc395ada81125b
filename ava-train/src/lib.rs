//! # ava-train: the training engine
//!
//! - [`config`]: the layered, validated settings (model, data, training, checkpoints,
//!   memory budget, plugins).
//! - [`data`]: token sources (a synthetic corpus with a known entropy floor, text files,
//!   `tokenizer.json`) and the background batch loader.
//! - [`dist`]: data-parallel ranks (`mpirun -np N ava train`): the collectives trait and
//!   ZeRO stages 0–2.
//! - [`estimate`]: `ava estimate`, the peak memory of a training step predicted from the config
//!   alone (closed formulas, and a replay of the model on byte-counting shadow tensors).
//! - [`inference`]: a trained model and its tokenizer, loaded from a run, a checkpoint or a
//!   Hugging Face folder (`ava generate`, `ava eval`).
//! - [`model`]: the Llama-style decoder on candle, the attention-kernel adapter, the
//!   recompute mechanism behind checkpoint policies, and generation with a KV cache.
//! - [`memory`]: the counting allocator and the memory breakdown.
//! - [`profile`]: named wall-clock scopes for `ava bench`.
//! - [`run_dir`]: one run per output directory (the lock, an earlier run's files).
//! - [`train`]: the training loop, checkpoints and exact resume.
//! - [`save`]: checkpoints on disk (atomic writes, manifests with sha256, keep-last-k).

pub mod config;
pub mod data;
pub mod device;
pub mod dist;
pub mod estimate;
pub mod inference;
pub mod memory;
pub mod model;
pub mod profile;
pub mod run_dir;
pub mod save;
pub mod train;

/// A byte count as a `--budget` or `memory.budget` value a person reads and `parse_size`
/// reads back exactly: `60.00MiB` where that is the count, else the bytes.
///
/// ```
/// assert_eq!(ava_train::budget_arg(60 << 20), "60.00MiB");
/// assert_eq!(ava_train::budget_arg((60 << 20) + 1), "62914561");
/// ```
pub fn budget_arg(bytes: u64) -> String {
    let short = ava_core::format_size(bytes).replace(' ', "");
    if ava_core::parse_size(&short) == Ok(bytes) { short } else { bytes.to_string() }
}
