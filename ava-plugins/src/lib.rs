//! # ava-plugins: the plugin host
//!
//! Finds plugin libraries ([`discover`]), vets them against `ava-plugins.lock` ([`lock`])
//! before opening anything, opens each file on its own ([`load`]), and keeps every plugin —
//! built-in ([`builtin`]) or dynamic — in one [`Registry`] keyed by (kind, name). A machine
//! policy ([`policy`]) sets a floor no user layer can loosen; under it the lock file must be
//! signed ([`sign`]) and every file trusted must be out of other users' reach ([`trust`]).

pub mod builtin;
pub mod discover;
mod error;
mod instance;
pub mod load;
pub mod lock;
pub mod policy;
pub mod private_copy;
pub mod registry;
pub mod sign;
pub mod trust;
pub mod yaml_guard;

pub use error::HostError;
pub use instance::Instance;
pub use lock::{LockFile, Pin, VettingPolicy};
pub use policy::MachinePolicy;
pub use registry::{HostConfig, Registry, Row, Source, Status, open_file, vet_file};
