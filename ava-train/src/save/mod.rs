//! The on-disk checkpoint store: crash-safe saving of named files as step directories,
//! finding and verifying them for resume, and pruning old ones. It deals in bytes only; the
//! trainer turns tensors into [`NamedBuffer`](crate::save::NamedBuffer)s and encodes them with
//! [`to_safetensors`](crate::save::to_safetensors).
//!
//! ```
//! use ava_train::save::{BufDType, CheckpointStore, NamedBuffer, from_safetensors, to_safetensors};
//!
//! let root = tempfile::tempdir().unwrap();
//! let store = CheckpointStore::new(root.path(), 2);
//! let weight = NamedBuffer {
//!     name: "model.embed_tokens.weight".into(),
//!     dtype: BufDType::F32,
//!     shape: vec![2],
//!     data: [1.0f32, 2.0].iter().flat_map(|x| x.to_le_bytes()).collect(),
//! };
//! let model = to_safetensors(std::slice::from_ref(&weight), None).unwrap();
//! let dir = store.save(100, &[("model.safetensors".into(), model)]).unwrap();
//! assert!(dir.ends_with("step-00000100"));
//!
//! let loaded = CheckpointStore::load(&store.resolve("latest").unwrap()).unwrap();
//! assert_eq!(loaded.step, 100);
//! let (buffers, _) = from_safetensors(loaded.file("model.safetensors").unwrap()).unwrap();
//! assert_eq!(buffers, vec![weight]);
//! ```
//!
//! Files: `atomic` (durable writes), `tensors` (safetensors encoding), `manifest`
//! (`manifest.json` and verification), `store` (the save protocol, `latest`, pruning),
//! `faults` (the test hook that simulates a kill), `diff` (config comparison on resume),
//! `error`.

mod atomic;
mod diff;
mod error;
mod faults;
mod manifest;
mod room;
mod store;
mod tensors;

#[cfg(test)]
mod tests;

pub use atomic::{fsync_dir, write_atomic, write_atomic_streamed};
pub use diff::differing_keys;
pub use error::SaveError;
pub use faults::FaultInjector;
pub use manifest::{FileEntry, MANIFEST_FILE, MANIFEST_FORMAT, Manifest, sha256_hex, verify};
pub use room::{check_room, free_space};
pub use store::{CheckpointStore, FileBody, FileData, LATEST_FILE, LoadedCheckpoint, parse_step, step_dir_name};
pub use tensors::{
    BufDType, BufferView, NamedBuffer, TensorMetadata, TensorSpec, from_safetensors, safetensors_views, to_safetensors,
    write_safetensors,
};
