//! # ava-fs: file-system safety
//!
//! What every Ava crate that touches files from outside needs, in one place beneath them
//! all: [`bounded`] reads a file without trusting its path (no FIFO waited on, no device
//! read until memory runs out, at most a limit for its kind); [`dirfd`] creates, opens,
//! replaces and removes entries relative to an opened directory, so a link or FIFO planted
//! by another user under a name is refused rather than followed; [`dir_lock`] gives an
//! output directory one writer at a time. The plugin host (`ava-plugins`: lock files, plugin
//! libraries), the data pipeline (`ava-data`: tokenizers, corpora, manifests, the lock on
//! `--out`) and the engine (`ava-train`: configs, run directories, checkpoints, model folders)
//! all use it.
//!
//! Unix only, as the rest of Ava: the guarantees rest on `openat`, `O_NOFOLLOW` and `flock`.

pub mod bounded;
pub mod dir_lock;
pub mod dirfd;
