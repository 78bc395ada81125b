//! The [`MemoryPolicy`] trait: looks at memory statistics the engine measured and returns
//! the action to take. The engine applies it (shrinking the micro-batch while keeping the
//! global batch constant, checkpointing and stopping, ...).

use std::fmt;

use abi_stable::{
    StableAbi, sabi_trait,
    std_types::{RBox, RResult, RString},
};

use crate::{PluginError, ffi::guard};

/// Where in a training step the statistics were taken.
#[repr(u8)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Start of a step, before any micro-batch.
    StepStart = 0,
    /// During or after a forward pass.
    Forward = 1,
    /// During or after a backward pass.
    Backward = 2,
    /// During or after the optimizer update.
    OptimizerStep = 3,
    /// Evaluation.
    Eval = 4,
    /// Writing a checkpoint.
    Checkpoint = 5,
}

/// Memory statistics for one observation. Bytes are the host's own count (the counting
/// allocator on CPU, the device's memory info on accelerators).
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryStats {
    /// Bytes in use now.
    pub current: u64,
    /// Highest bytes in use since the step began.
    pub peak: u64,
    /// The configured budget; 0 means none.
    pub budget: u64,
    /// When the numbers were taken.
    pub phase: Phase,
    /// Training step.
    pub step: u64,
    /// Current micro-batch size.
    pub micro_batch: u32,
    /// The micro-batch size from the config (what a restore returns to).
    pub configured_micro_batch: u32,
}

/// How close to the budget memory is.
#[repr(u8)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Pressure {
    /// Below the target.
    Normal = 0,
    /// At or above the target.
    Target = 1,
    /// At or above the warning level.
    Warning = 2,
    /// At or above the critical level.
    Critical = 3,
    /// At or above the emergency level.
    Emergency = 4,
}

impl Pressure {
    /// Lowercase name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Normal => "normal",
            Self::Target => "target",
            Self::Warning => "warning",
            Self::Critical => "critical",
            Self::Emergency => "emergency",
        }
    }
}

/// What the engine should do.
#[repr(u8)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryAction {
    /// Nothing.
    Continue = 0,
    /// Log the decision's message.
    Warn = 1,
    /// Halve the micro-batch, doubling gradient accumulation (global batch unchanged).
    ShrinkMicroBatch = 2,
    /// Go back towards the configured micro-batch.
    RestoreMicroBatch = 3,
    /// Drop caches the engine holds (prefetch buffers, allocator caches).
    ClearCaches = 4,
    /// Save a checkpoint and stop with the message.
    StopWithCheckpoint = 5,
    /// Save a checkpoint (so running out of memory loses nothing), then halve the
    /// micro-batch as `ShrinkMicroBatch` does.
    CheckpointAndShrink = 6,
}

impl MemoryAction {
    /// Lowercase name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Continue => "continue",
            Self::Warn => "warn",
            Self::ShrinkMicroBatch => "shrink-micro-batch",
            Self::RestoreMicroBatch => "restore-micro-batch",
            Self::ClearCaches => "clear-caches",
            Self::StopWithCheckpoint => "stop-with-checkpoint",
            Self::CheckpointAndShrink => "checkpoint-and-shrink",
        }
    }
}

/// The policy's answer to one observation.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq, Eq)]
pub struct MemoryDecision {
    /// What to do.
    pub action: MemoryAction,
    /// How the policy classified the pressure.
    pub pressure: Pressure,
    /// Why, for the log (empty for `Continue`).
    pub message: RString,
}

impl MemoryDecision {
    /// A decision with a message.
    pub fn new(action: MemoryAction, pressure: Pressure, message: impl Into<String>) -> Self {
        Self { action, pressure, message: RString::from(message.into()) }
    }
    /// `Continue` at `pressure`.
    pub fn proceed(pressure: Pressure) -> Self {
        Self::new(MemoryAction::Continue, pressure, "")
    }
}

impl fmt::Display for MemoryDecision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.action.as_str(), self.pressure.as_str())?;
        if !self.message.is_empty() {
            write!(f, ": {}", self.message)?;
        }
        Ok(())
    }
}

/// A memory policy. `observe` is called at each phase boundary; `&mut self` because
/// policies keep history (hysteresis, leak detection).
pub trait MemoryPolicy: Send {
    /// Classifies `stats` and returns the action.
    fn observe(&mut self, stats: &MemoryStats) -> Result<MemoryDecision, PluginError>;
}

/// The FFI-safe form of [`MemoryPolicy`].
#[sabi_trait]
pub trait FfiMemory: Send {
    /// See [`MemoryPolicy::observe`].
    fn observe(&mut self, stats: MemoryStats) -> RResult<MemoryDecision, PluginError>;
}

/// A boxed memory policy from a plugin library.
pub type MemoryBox = FfiMemory_TO<'static, RBox<()>>;

pub(crate) struct Guarded<T>(pub T);

impl<T: MemoryPolicy> FfiMemory for Guarded<T> {
    fn observe(&mut self, stats: MemoryStats) -> RResult<MemoryDecision, PluginError> {
        guard("MemoryPolicy::observe", || self.0.observe(&stats))
    }
}

/// Host side: a plugin's policy behind the Rust trait.
pub struct ForeignMemory(pub MemoryBox);

impl MemoryPolicy for ForeignMemory {
    fn observe(&mut self, stats: &MemoryStats) -> Result<MemoryDecision, PluginError> {
        self.0.observe(*stats).into_result()
    }
}
