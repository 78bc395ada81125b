//! The data pipeline, from the `ava-data` crate (which knows nothing of tensors): re-exported
//! here so the engine's paths (`ava_train::data::Loader`, ...) stay as they were.

pub use ava_data::*;
