//! # ava-core: the plugin contract
//!
//! Everything a plugin author depends on, and nothing else: no candle, no clap, no host code.
//! A plugin is a `cdylib` that implements one of five traits and exports it with
//! [`export_plugin!`]:
//!
//! | trait | what it is asked |
//! |---|---|
//! | [`Optimizer`] | the state it needs per parameter, and one in-place update step |
//! | [`AttentionKernel`] | its saved-for-backward size, a forward and (optionally) a backward |
//! | [`CheckpointPolicy`] | per block: keep, recompute or offload the activations |
//! | [`OffloadTier`] | put/get/prefetch/evict of byte records under string keys |
//! | [`MemoryPolicy`] | given memory statistics, the action the engine should take |
//!
//! The host owns every large buffer: parameters, gradients, optimizer state and attention
//! scratch are allocated by the engine at sizes the plugin declares, so they show up in the
//! host's memory accounting and can be placed in any offload tier. A plugin only computes.
//!
//! ## Devices
//!
//! A buffer handed to a plugin says where it lives: a host slice (`step`, `forward`,
//! `backward`) or a [`CudaBuf`] on a CUDA device with the [`CudaStream`] to launch on
//! (`step_cuda`, `forward_cuda`, `backward_cuda`; see [`device`]). A plugin's
//! [`Manifest::devices`] lists the devices whose buffers it takes directly; on a CUDA run the
//! host refuses, by name and before training, an optimizer or attention kernel whose manifest
//! does not list [`Device::Cuda`], rather than copy buffers to the host for it. A CPU plugin
//! needs no CUDA code: the `*_cuda` methods have defaults that refuse.
//!
//! ## The boundary
//!
//! Only `#[repr(C)]` + [`StableAbi`](abi_stable::StableAbi) types cross it (see [`ffi`]).
//! Every exported library has one root module ([`ffi::PluginRootRef`]) with a manifest
//! function and one constructor per kind; the constructors of the kinds a library does not
//! provide return [`ErrorKind::Unsupported`]. Panics never cross: each exported call is run
//! under `catch_unwind` and a panic becomes [`ErrorKind::Panicked`].
//!
//! ## A complete plugin
//!
//! ```
//! use ava_core::prelude::*;
//!
//! /// Plain SGD without momentum.
//! struct Plain;
//!
//! impl Plugin for Plain {
//!     fn manifest() -> Manifest {
//!         Manifest::new("plain-sgd", PluginKind::Optimizer, "0.1.0", "SGD without momentum")
//!     }
//!     fn from_options(options: Options) -> Result<Self, PluginError> {
//!         options.finish()?;
//!         Ok(Plain)
//!     }
//! }
//!
//! impl Optimizer for Plain {
//!     fn state_layout(&self, _param: &ParamInfo<'_>) -> Result<Vec<StateSpec>, PluginError> {
//!         Ok(Vec::new())
//!     }
//!     fn step(
//!         &mut self,
//!         _param: &ParamInfo<'_>,
//!         values: &mut [f32],
//!         grad: &[f32],
//!         _state: &mut [StateBuf<'_>],
//!         ctx: &StepContext,
//!     ) -> Result<(), PluginError> {
//!         for (w, g) in values.iter_mut().zip(grad) {
//!             *w -= ctx.lr as f32 * g;
//!         }
//!         Ok(())
//!     }
//! }
//!
//! // In a cdylib crate: ava_core::export_plugin!(optimizer: Plain);
//! # let _ = Plain::manifest();
//! ```

// abi_stable's #[sabi_trait] expands to impls inside a const block; that is its design.
#![allow(non_local_definitions)]

pub mod attention;
pub mod checkpoint;
pub mod device;
pub mod error;
mod export;
pub mod ffi;
pub mod manifest;
pub mod math;
pub mod memory;
pub mod offload;
pub mod optimizer;
pub mod options;

pub use attention::{AttentionKernel, AttnShape, KernelContext, Pass};
pub use checkpoint::{BlockDecision, BlockFacts, CheckpointContext, CheckpointPolicy, check_plan};
pub use device::{CudaBuf, CudaStream};
pub use error::{ErrorKind, PluginError};
pub use manifest::{Device, Manifest, OptionSpec, OptionType, PluginKind};
pub use memory::{MemoryAction, MemoryDecision, MemoryPolicy, MemoryStats, Phase, Pressure};
pub use offload::OffloadTier;
pub use optimizer::{DType, Optimizer, ParamInfo, StateBuf, StateSpec, StepContext};
pub use options::{Options, format_size, parse_size};

/// Version of the contract this crate defines.
///
/// The host refuses a library built against another contract version with an error naming
/// both. It is tied to the crate version: the contract version is the crate's minor version
/// while the crate is 0.x (abi_stable's own compatibility rule), `major * 1000 + minor` from
/// 1.0 on (the rule of [`Manifest::check_contract`]), so bumping the crate version in a
/// breaking way bumps the contract; a unit test ties the two.
///
/// Contract 2 (ava-core 0.2): device buffers ([`CudaBuf`], [`CudaStream`]), the `*_cuda`
/// methods of [`Optimizer`] and [`AttentionKernel`], and [`Manifest::devices`] meaning the
/// devices whose buffers the plugin takes directly.
///
/// Contract 3 (ava-core 0.3): [`StepContext::grad_scale`] and
/// [`Optimizer::scales_gradients`], so an optimizer may apply the clipping factor inside its
/// step instead of the host scaling every gradient first.
pub const CONTRACT_VERSION: u32 = 3;

/// Context every constructor receives from the host.
#[repr(C)]
#[derive(abi_stable::StableAbi, Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostContext {
    /// Threads the plugin may use for its own work; it must not start more.
    pub threads: u32,
    /// The contract version the host speaks.
    pub contract_version: u32,
}

impl Default for HostContext {
    fn default() -> Self {
        Self { threads: 1, contract_version: CONTRACT_VERSION }
    }
}

/// What every plugin type provides besides its trait: a manifest and a constructor from
/// validated options.
pub trait Plugin: Sized {
    /// The plugin's manifest: name, kind, version, options.
    fn manifest() -> Manifest;

    /// Builds the plugin from its options, already checked against the manifest's option
    /// specs. Range checks of its own go through [`Options::check`]; [`Options::finish`]
    /// returns every problem at once.
    fn from_options(options: Options) -> Result<Self, PluginError>;

    /// Like [`from_options`](Self::from_options) with the host's context (thread count).
    /// The default ignores the context.
    fn create(options: Options, ctx: &HostContext) -> Result<Self, PluginError> {
        let _ = ctx;
        Self::from_options(options)
    }
}

/// Everything a plugin author usually needs, in one import.
pub mod prelude {
    pub use crate::{
        AttentionKernel, AttnShape, BlockDecision, BlockFacts, CheckpointContext, CheckpointPolicy, CudaBuf,
        CudaStream, DType, Device, ErrorKind, HostContext, KernelContext, Manifest, MemoryAction, MemoryDecision,
        MemoryPolicy, MemoryStats, OffloadTier, Optimizer, OptionSpec, OptionType, Options, ParamInfo, Pass, Phase,
        Plugin, PluginError, PluginKind, Pressure, StateBuf, StateSpec, StepContext,
    };
}

#[doc(hidden)]
pub mod __private {
    pub use abi_stable;
}

#[cfg(test)]
mod tests {
    /// The contract number follows ava-core's version: its minor version while it is 0.x,
    /// `major * 1000 + minor` after (the rule `Manifest::check_contract` and the host's
    /// library check apply). Bumping one without the other fails here.
    #[test]
    fn contract_version_follows_the_crate_version() {
        let major: u32 = env!("CARGO_PKG_VERSION_MAJOR").parse().unwrap();
        let minor: u32 = env!("CARGO_PKG_VERSION_MINOR").parse().unwrap();
        let expected = if major == 0 { minor } else { major * 1000 + minor };
        assert_eq!(
            super::CONTRACT_VERSION,
            expected,
            "ava-core is {}: set CONTRACT_VERSION to {expected} (or bump the crate version with the contract)",
            env!("CARGO_PKG_VERSION")
        );
    }
}
