//! The boundary itself: the root module every plugin library exports, the FFI-safe trait
//! objects, and the panic guard.
//!
//! A plugin author never touches this module directly: [`crate::export_plugin!`] builds the
//! root module from a type implementing [`Plugin`] and one of the five traits. The host
//! loads the root module and wraps the returned trait objects in the `Foreign*` adapters,
//! which implement the same Rust traits the built-in plugins implement.
//!
//! ## Evolving the contract
//!
//! The root module is an abi_stable *prefix type*: a host can read a library built against
//! a newer contract as long as fields were only appended after `new_memory` (the last
//! prefix field), and such appended fields read as absent from older libraries. The
//! five constructors exist from contract 1 on, so no kind is ever added to the prefix.

use std::panic::{AssertUnwindSafe, catch_unwind};

use abi_stable::{
    StableAbi,
    library::RootModule,
    package_version_strings,
    prefix_type::PrefixTypeTrait,
    sabi_trait::TD_Opaque,
    sabi_types::VersionStrings,
    std_types::{RErr, ROk, RResult, RStr},
};

pub use crate::attention::{AttentionBox, FfiAttention, FfiAttention_TO, ForeignAttention};
pub use crate::checkpoint::{CheckpointBox, FfiCheckpoint, FfiCheckpoint_TO, ForeignCheckpoint};
pub use crate::memory::{FfiMemory, FfiMemory_TO, ForeignMemory, MemoryBox};
pub use crate::offload::{FfiOffload, FfiOffload_TO, ForeignOffload, OffloadBox};
pub use crate::optimizer::{FfiOptimizer, FfiOptimizer_TO, ForeignOptimizer, OptimizerBox};
use crate::{
    AttentionKernel, CheckpointPolicy, ErrorKind, HostContext, Manifest, MemoryPolicy, OffloadTier, Optimizer, Options,
    Plugin, PluginError, PluginKind,
};

/// Name of the exported symbol holding abi_stable's library header (the same for every
/// abi_stable library). The host looks for it in the symbol table before opening a file.
pub const ROOT_SYMBOL: &str = "_1as_0lib_1header_0root_bmodule_bloader";

/// `BASE_NAME` / `NAME` of the root module, which tells an Ava plugin from other abi_stable
/// libraries.
pub const ROOT_MODULE_NAME: &str = "ava_plugin";

/// The text a panic carried (`panic!("...")` with or without arguments), if it carried text.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> Option<String> {
    payload.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| payload.downcast_ref::<String>().cloned())
}

/// Runs `f`, turning a panic into [`ErrorKind::Panicked`] so it never unwinds across the
/// boundary (which would abort the host).
pub fn guard<T>(what: &str, f: impl FnOnce() -> Result<T, PluginError>) -> RResult<T, PluginError> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => ROk(v),
        Ok(Err(e)) => RErr(e),
        Err(payload) => {
            let msg = panic_message(payload.as_ref()).unwrap_or_else(|| "a non-text panic payload".to_string());
            RErr(PluginError::new(ErrorKind::Panicked, format!("panicked in {what}: {msg}")))
        }
    }
}

/// The constructor signature shared by the five kinds.
pub type Constructor<T> = extern "C" fn(options: RStr<'_>, ctx: HostContext) -> RResult<T, PluginError>;

/// The root module of a plugin library.
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = PluginRootRef)))]
#[sabi(missing_field(panic))]
pub struct PluginRoot {
    /// The plugin's manifest.
    pub manifest: extern "C" fn() -> RResult<Manifest, PluginError>,
    /// Builds the optimizer, or `Unsupported` if the library is of another kind.
    pub new_optimizer: extern "C" fn(options: RStr<'_>, ctx: HostContext) -> RResult<OptimizerBox, PluginError>,
    /// Builds the attention kernel, or `Unsupported`.
    pub new_attention: extern "C" fn(options: RStr<'_>, ctx: HostContext) -> RResult<AttentionBox, PluginError>,
    /// Builds the checkpoint policy, or `Unsupported`.
    pub new_checkpoint: extern "C" fn(options: RStr<'_>, ctx: HostContext) -> RResult<CheckpointBox, PluginError>,
    /// Builds the offload tier, or `Unsupported`.
    pub new_offload: extern "C" fn(options: RStr<'_>, ctx: HostContext) -> RResult<OffloadBox, PluginError>,
    /// Builds the memory policy, or `Unsupported`.
    #[sabi(last_prefix_field)]
    pub new_memory: extern "C" fn(options: RStr<'_>, ctx: HostContext) -> RResult<MemoryBox, PluginError>,
}

impl RootModule for PluginRootRef {
    abi_stable::declare_root_module_statics! {PluginRootRef}
    const BASE_NAME: &'static str = ROOT_MODULE_NAME;
    const NAME: &'static str = ROOT_MODULE_NAME;
    const VERSION_STRINGS: VersionStrings = package_version_strings!();
}

/// The box type a constructor returns, tied to its kind.
pub trait KindBox {
    /// The kind.
    const KIND: PluginKind;
}
impl KindBox for OptimizerBox {
    const KIND: PluginKind = PluginKind::Optimizer;
}
impl KindBox for AttentionBox {
    const KIND: PluginKind = PluginKind::Attention;
}
impl KindBox for CheckpointBox {
    const KIND: PluginKind = PluginKind::Checkpoint;
}
impl KindBox for OffloadBox {
    const KIND: PluginKind = PluginKind::Offload;
}
impl KindBox for MemoryBox {
    const KIND: PluginKind = PluginKind::Memory;
}

/// Parses the options and builds `P`. Structural problems (unknown keys, wrong types) are
/// returned even if the plugin forgot to call [`Options::finish`].
pub fn build<P: Plugin>(options: &str, ctx: &HostContext) -> Result<P, PluginError> {
    let manifest = P::manifest();
    let opts = Options::parse(&manifest, options);
    let structural = opts.problems().to_vec();
    let p = P::create(opts, ctx)?;
    if !structural.is_empty() {
        return Err(PluginError::invalid_options(structural));
    }
    Ok(p)
}

extern "C" fn manifest_of<P: Plugin>() -> RResult<Manifest, PluginError> {
    guard("manifest", || Ok(P::manifest()))
}

extern "C" fn other_kind<P: Plugin, B: KindBox>(_: RStr<'_>, _: HostContext) -> RResult<B, PluginError> {
    guard("constructor", || {
        let m = P::manifest();
        Err(PluginError::unsupported(format!(
            "plugin '{}' is {}, not {}",
            m.name,
            m.kind.article_noun(),
            B::KIND.article_noun()
        )))
    })
}

extern "C" fn new_optimizer<P: Plugin + Optimizer + 'static>(
    o: RStr<'_>,
    ctx: HostContext,
) -> RResult<OptimizerBox, PluginError> {
    guard("constructor", || {
        let p = build::<P>(o.as_str(), &ctx)?;
        Ok(FfiOptimizer_TO::from_value(crate::optimizer::Guarded(p), TD_Opaque))
    })
}
extern "C" fn new_attention<P: Plugin + AttentionKernel + 'static>(
    o: RStr<'_>,
    ctx: HostContext,
) -> RResult<AttentionBox, PluginError> {
    guard("constructor", || {
        let p = build::<P>(o.as_str(), &ctx)?;
        Ok(FfiAttention_TO::from_value(crate::attention::Guarded(p), TD_Opaque))
    })
}
extern "C" fn new_checkpoint<P: Plugin + CheckpointPolicy + 'static>(
    o: RStr<'_>,
    ctx: HostContext,
) -> RResult<CheckpointBox, PluginError> {
    guard("constructor", || {
        let p = build::<P>(o.as_str(), &ctx)?;
        Ok(FfiCheckpoint_TO::from_value(crate::checkpoint::Guarded(p), TD_Opaque))
    })
}
extern "C" fn new_offload<P: Plugin + OffloadTier + 'static>(
    o: RStr<'_>,
    ctx: HostContext,
) -> RResult<OffloadBox, PluginError> {
    guard("constructor", || {
        let p = build::<P>(o.as_str(), &ctx)?;
        Ok(FfiOffload_TO::from_value(crate::offload::Guarded(p), TD_Opaque))
    })
}
extern "C" fn new_memory<P: Plugin + MemoryPolicy + 'static>(
    o: RStr<'_>,
    ctx: HostContext,
) -> RResult<MemoryBox, PluginError> {
    guard("constructor", || {
        let p = build::<P>(o.as_str(), &ctx)?;
        Ok(FfiMemory_TO::from_value(crate::memory::Guarded(p), TD_Opaque))
    })
}

impl PluginRoot {
    fn leak(self) -> PluginRootRef {
        self.leak_into_prefix()
    }

    /// Root module of a library exporting optimizer `P`.
    pub fn optimizer<P: Plugin + Optimizer + 'static>() -> PluginRootRef {
        PluginRoot {
            manifest: manifest_of::<P>,
            new_optimizer: new_optimizer::<P>,
            new_attention: other_kind::<P, AttentionBox>,
            new_checkpoint: other_kind::<P, CheckpointBox>,
            new_offload: other_kind::<P, OffloadBox>,
            new_memory: other_kind::<P, MemoryBox>,
        }
        .leak()
    }
    /// Root module of a library exporting attention kernel `P`.
    pub fn attention<P: Plugin + AttentionKernel + 'static>() -> PluginRootRef {
        PluginRoot {
            manifest: manifest_of::<P>,
            new_optimizer: other_kind::<P, OptimizerBox>,
            new_attention: new_attention::<P>,
            new_checkpoint: other_kind::<P, CheckpointBox>,
            new_offload: other_kind::<P, OffloadBox>,
            new_memory: other_kind::<P, MemoryBox>,
        }
        .leak()
    }
    /// Root module of a library exporting checkpoint policy `P`.
    pub fn checkpoint<P: Plugin + CheckpointPolicy + 'static>() -> PluginRootRef {
        PluginRoot {
            manifest: manifest_of::<P>,
            new_optimizer: other_kind::<P, OptimizerBox>,
            new_attention: other_kind::<P, AttentionBox>,
            new_checkpoint: new_checkpoint::<P>,
            new_offload: other_kind::<P, OffloadBox>,
            new_memory: other_kind::<P, MemoryBox>,
        }
        .leak()
    }
    /// Root module of a library exporting offload tier `P`.
    pub fn offload<P: Plugin + OffloadTier + 'static>() -> PluginRootRef {
        PluginRoot {
            manifest: manifest_of::<P>,
            new_optimizer: other_kind::<P, OptimizerBox>,
            new_attention: other_kind::<P, AttentionBox>,
            new_checkpoint: other_kind::<P, CheckpointBox>,
            new_offload: new_offload::<P>,
            new_memory: other_kind::<P, MemoryBox>,
        }
        .leak()
    }
    /// Root module of a library exporting memory policy `P`.
    pub fn memory<P: Plugin + MemoryPolicy + 'static>() -> PluginRootRef {
        PluginRoot {
            manifest: manifest_of::<P>,
            new_optimizer: other_kind::<P, OptimizerBox>,
            new_attention: other_kind::<P, AttentionBox>,
            new_checkpoint: other_kind::<P, CheckpointBox>,
            new_offload: other_kind::<P, OffloadBox>,
            new_memory: new_memory::<P>,
        }
        .leak()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_symbol_matches_abi_stable() {
        assert_eq!(ROOT_SYMBOL, abi_stable::library::ROOT_MODULE_LOADER_NAME);
    }

    #[test]
    fn guard_turns_panics_into_errors() {
        let r: RResult<(), PluginError> = guard("test", || panic!("boom {}", 7));
        let e = r.into_result().unwrap_err();
        assert_eq!(e.kind, ErrorKind::Panicked);
        assert_eq!(e.message.as_str(), "panicked in test: boom 7");
    }
}
