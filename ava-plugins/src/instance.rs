//! A constructed plugin of any kind, behind the Rust traits. Built-ins and dynamic plugins
//! look the same from here on.

use std::sync::Arc;

use ava_core::{AttentionKernel, CheckpointPolicy, MemoryPolicy, OffloadTier, Optimizer, PluginKind};

/// A constructed plugin.
pub enum Instance {
    /// An optimizer.
    Optimizer(Box<dyn Optimizer>),
    /// An attention kernel (shared by the autograd ops that call it).
    Attention(Arc<dyn AttentionKernel>),
    /// A checkpoint policy.
    Checkpoint(Arc<dyn CheckpointPolicy>),
    /// An offload tier (shared by the compute and I/O threads).
    Offload(Arc<dyn OffloadTier>),
    /// A memory policy.
    Memory(Box<dyn MemoryPolicy>),
}

impl Instance {
    /// The kind of plugin this is.
    pub fn kind(&self) -> PluginKind {
        match self {
            Self::Optimizer(_) => PluginKind::Optimizer,
            Self::Attention(_) => PluginKind::Attention,
            Self::Checkpoint(_) => PluginKind::Checkpoint,
            Self::Offload(_) => PluginKind::Offload,
            Self::Memory(_) => PluginKind::Memory,
        }
    }
}

impl std::fmt::Debug for Instance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Instance({})", self.kind())
    }
}
