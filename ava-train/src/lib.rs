//! # ava-train: the training engine
//!
//! For now: configuration ([`config`]) — the layered, validated settings that pick the
//! plugins and say where they are found. The model, data, trainer and memory accounting
//! come next.

pub mod config;
