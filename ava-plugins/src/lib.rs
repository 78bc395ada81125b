//! # ava-plugins: the plugin host
//!
//! Finds plugin libraries, vets them against `ava-plugins.lock`, loads each file on its own,
//! and keeps every plugin — built-in or dynamic — in one registry keyed by (kind, name).

pub mod builtin;
mod instance;

pub use instance::Instance;
