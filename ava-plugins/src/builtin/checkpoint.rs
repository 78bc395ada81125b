//! The built-in checkpoint policies, the two ends of the memory/compute trade:
//!
//! - `none`: keep every block's activations for backward (fastest, most memory);
//! - `full`: recompute every block in backward, keeping only its input (about one extra
//!   forward pass of compute, activation memory of one block plus the block inputs).
//!
//! Neither looks at the block facts or the budget; policies that do (selective, budgeted)
//! are plugins.

use ava_core::prelude::*;

/// Checkpoint policy `none`: every block is [`BlockDecision::Keep`].
#[derive(Debug, Clone, Copy, Default)]
pub struct KeepAll;

/// Checkpoint policy `full`: every block is [`BlockDecision::Recompute`].
#[derive(Debug, Clone, Copy, Default)]
pub struct RecomputeAll;

impl Plugin for KeepAll {
    fn manifest() -> Manifest {
        Manifest::new(
            "none",
            PluginKind::Checkpoint,
            env!("CARGO_PKG_VERSION"),
            "no activation checkpointing: every block keeps its activations for backward",
        )
    }

    fn from_options(options: Options) -> Result<Self, PluginError> {
        options.finish()?;
        Ok(KeepAll)
    }
}

impl CheckpointPolicy for KeepAll {
    fn decide(&self, blocks: &[BlockFacts], _ctx: &CheckpointContext) -> Result<Vec<BlockDecision>, PluginError> {
        Ok(vec![BlockDecision::Keep; blocks.len()])
    }
}

impl Plugin for RecomputeAll {
    fn manifest() -> Manifest {
        Manifest::new(
            "full",
            PluginKind::Checkpoint,
            env!("CARGO_PKG_VERSION"),
            "full activation checkpointing: every block keeps only its input and is recomputed in backward",
        )
    }

    fn from_options(options: Options) -> Result<Self, PluginError> {
        options.finish()?;
        Ok(RecomputeAll)
    }
}

impl CheckpointPolicy for RecomputeAll {
    fn decide(&self, blocks: &[BlockFacts], _ctx: &CheckpointContext) -> Result<Vec<BlockDecision>, PluginError> {
        Ok(vec![BlockDecision::Recompute; blocks.len()])
    }
}

inventory::submit! { crate::builtin::Builtin::checkpoint::<KeepAll>() }
inventory::submit! { crate::builtin::Builtin::checkpoint::<RecomputeAll>() }

#[cfg(test)]
mod tests {
    use super::*;

    fn blocks(n: u32) -> Vec<BlockFacts> {
        (0..n)
            .map(|index| BlockFacts {
                index,
                activation_bytes: 1 << 20,
                input_bytes: 1 << 12,
                parameter_bytes: 1 << 16,
                forward_flops: 1 << 24,
            })
            .collect()
    }

    /// Decisions do not depend on the budget or on an offload tier being present.
    #[test]
    fn one_decision_per_block() {
        let contexts = [
            CheckpointContext { budget_bytes: 0, offload_available: false },
            CheckpointContext { budget_bytes: 1, offload_available: true },
        ];
        for ctx in contexts {
            for n in [0, 1, 5] {
                let keep = KeepAll.decide(&blocks(n), &ctx).unwrap();
                assert_eq!(keep, vec![BlockDecision::Keep; n as usize]);
                let full = RecomputeAll.decide(&blocks(n), &ctx).unwrap();
                assert_eq!(full, vec![BlockDecision::Recompute; n as usize]);
            }
        }
    }

    #[test]
    fn registered_under_both_names_without_options() {
        for (name, want) in [("none", BlockDecision::Keep), ("full", BlockDecision::Recompute)] {
            let b = crate::builtin::all()
                .find(|b| {
                    let m = (b.manifest)();
                    m.kind == PluginKind::Checkpoint && m.name.as_str() == name
                })
                .unwrap_or_else(|| panic!("checkpoint policy '{name}' is not registered"));
            let m = (b.manifest)();
            m.validate().unwrap();
            assert!(m.options.is_empty());
            match (b.create)("", &HostContext::default()).unwrap() {
                crate::Instance::Checkpoint(p) => {
                    let ctx = CheckpointContext { budget_bytes: 0, offload_available: false };
                    assert_eq!(p.decide(&blocks(2), &ctx).unwrap(), [want, want]);
                }
                other => panic!("'{name}' built {other:?}"),
            }
            let err = (b.create)(r#"{"every": 2}"#, &HostContext::default()).unwrap_err();
            assert_eq!(
                err.details().collect::<Vec<_>>(),
                [format!("unknown option 'every' ('{name}' takes no options)")]
            );
        }
    }
}
