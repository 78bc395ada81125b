//! # ava-plugins: the plugin host
//!
//! Finds plugin libraries ([`discover`]), vets them against `ava-plugins.lock` ([`lock`])
//! before opening anything, opens each file on its own ([`load`]), and keeps every plugin —
//! built-in ([`builtin`]) or dynamic — in one [`Registry`] keyed by (kind, name).

pub mod bounded;
pub mod builtin;
pub mod discover;
mod error;
mod instance;
pub mod load;
pub mod lock;
pub mod registry;
pub mod yaml_guard;

pub use error::HostError;
pub use instance::Instance;
pub use lock::{LockFile, Pin, VettingPolicy};
pub use registry::{HostConfig, Registry, Row, Source, Status, open_file, vet_file};
