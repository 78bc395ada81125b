//! The built-in plugins: the same traits and the same registry as the dynamic ones, compiled
//! into the host and registered with `inventory`. One plugin per file.
//!
//! | kind | name | file |
//! |---|---|---|
//! | attention | `standard` | [`standard`] |
//! | optimizer | `adamw` | [`adamw`] |
//! | optimizer | `sgd` | [`sgd`] |
//! | checkpoint | `none`, `full` | [`checkpoint`] |
//! | offload | `ram` | [`ram`] |
//! | memory | `thresholds` | [`thresholds`] |

use std::sync::Arc;

use ava_core::{
    AttentionKernel, CheckpointPolicy, HostContext, Manifest, MemoryPolicy, OffloadTier, Optimizer, Plugin,
    PluginError, ffi::build,
};

use crate::Instance;

pub mod adamw;
pub mod checkpoint;
#[cfg(feature = "cuda")]
mod cuda;
pub mod ram;
pub mod sgd;
pub mod standard;
pub mod thresholds;

/// The devices whose buffers the built-in optimizers and `standard` take: the CPU's, and a
/// GPU's in a build with the `cuda` feature (kernels/optim.cu, kernels/attention.cu).
pub(crate) const BUILTIN_DEVICES: &[ava_core::Device] =
    if cfg!(feature = "cuda") { &[ava_core::Device::Cpu, ava_core::Device::Cuda] } else { &[ava_core::Device::Cpu] };

/// One built-in plugin: its manifest and constructor. Submitted with `inventory::submit!`.
pub struct Builtin {
    /// The manifest.
    pub manifest: fn() -> Manifest,
    /// Builds an instance from options given as JSON text.
    pub create: fn(&str, &HostContext) -> Result<Instance, PluginError>,
}

inventory::collect!(Builtin);

fn create_optimizer<P: Plugin + Optimizer + 'static>(o: &str, c: &HostContext) -> Result<Instance, PluginError> {
    Ok(Instance::Optimizer(Box::new(build::<P>(o, c)?)))
}
fn create_attention<P: Plugin + AttentionKernel + 'static>(o: &str, c: &HostContext) -> Result<Instance, PluginError> {
    Ok(Instance::Attention(Arc::new(build::<P>(o, c)?)))
}
fn create_checkpoint<P: Plugin + CheckpointPolicy + 'static>(
    o: &str,
    c: &HostContext,
) -> Result<Instance, PluginError> {
    Ok(Instance::Checkpoint(Arc::new(build::<P>(o, c)?)))
}
fn create_offload<P: Plugin + OffloadTier + 'static>(o: &str, c: &HostContext) -> Result<Instance, PluginError> {
    Ok(Instance::Offload(Arc::new(build::<P>(o, c)?)))
}
fn create_memory<P: Plugin + MemoryPolicy + 'static>(o: &str, c: &HostContext) -> Result<Instance, PluginError> {
    Ok(Instance::Memory(Box::new(build::<P>(o, c)?)))
}

impl Builtin {
    /// A built-in optimizer.
    pub const fn optimizer<P: Plugin + Optimizer + 'static>() -> Self {
        Self { manifest: P::manifest, create: create_optimizer::<P> }
    }
    /// A built-in attention kernel.
    pub const fn attention<P: Plugin + AttentionKernel + 'static>() -> Self {
        Self { manifest: P::manifest, create: create_attention::<P> }
    }
    /// A built-in checkpoint policy.
    pub const fn checkpoint<P: Plugin + CheckpointPolicy + 'static>() -> Self {
        Self { manifest: P::manifest, create: create_checkpoint::<P> }
    }
    /// A built-in offload tier.
    pub const fn offload<P: Plugin + OffloadTier + 'static>() -> Self {
        Self { manifest: P::manifest, create: create_offload::<P> }
    }
    /// A built-in memory policy.
    pub const fn memory<P: Plugin + MemoryPolicy + 'static>() -> Self {
        Self { manifest: P::manifest, create: create_memory::<P> }
    }
}

/// Every registered built-in.
pub fn all() -> impl Iterator<Item = &'static Builtin> {
    inventory::iter::<Builtin>.into_iter()
}
