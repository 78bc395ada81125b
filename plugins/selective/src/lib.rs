//! # Selective activation checkpointing as an Ava plugin
//!
//! Decides, per transformer block, whether the block keeps its activations for backward
//! ([`BlockDecision::Keep`]) or keeps only its input and is recomputed in backward
//! ([`BlockDecision::Recompute`]), alone or as the start of a segment whose other blocks keep
//! nothing ([`BlockDecision::Segment`]). The engine carries the decisions out. Modes, one per
//! config:
//!
//! ```yaml
//! plugins.checkpoint: {name: selective, every: 2}          # blocks 0, 2, 4, ... recomputed
//! plugins.checkpoint: {name: selective, layers: [0, 4, 8]} # exactly these blocks
//! plugins.checkpoint: {name: selective, sqrt: true}       # segments of ⌈√L⌉ blocks (Chen et al.)
//! plugins.checkpoint: {name: selective, budget: 1.5GiB}    # fewest blocks that fit 1.5 GiB
//! plugins.checkpoint: selective                            # budget mode, with memory.budget
//! ```
//!
//! `budget` predicts a plan's activation memory from the facts the engine passes (each
//! block's activation bytes `A` and input bytes `I`) with the model in [`plan`], and
//! recomputes the fewest blocks for which the prediction fits
//! ([`plan::fewest_recomputed`]).
//!
//! `sqrt` is Chen et al. 2016's schedule: L blocks in segments of k = ⌈√L⌉, only each
//! segment's input kept, a segment rebuilt whole in backward, so about `L/k · I + k · A`.
//! Chen et al. apply it to layers whose activations are about their input's size; a
//! transformer block's activations are 20–35 times its input, so at block granularity
//! `every: 1` (`L · I + A`) holds less for the same recompute, and `sqrt` is there to
//! measure that trade, not as the default.

pub mod plan;

use ava_core::prelude::*;

/// How the blocks to recompute are chosen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mode {
    /// Blocks `0, n, 2n, ...`.
    Every(u32),
    /// Exactly these block indices.
    Layers(Vec<u32>),
    /// Segments of ⌈√L⌉ blocks, each kept only as its first block's input.
    Sqrt,
    /// The fewest blocks whose predicted activation memory fits this many bytes; `None`:
    /// the activation budget the engine derives from `memory.budget`.
    Budget(Option<u64>),
}

/// The `selective` checkpoint policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selective {
    /// The mode.
    pub mode: Mode,
    /// Whether each recomputed block's input is parked in the offload tier between forward
    /// and backward (`Offload`) instead of held in memory (`Recompute`).
    pub offload: bool,
}

impl Plugin for Selective {
    fn manifest() -> Manifest {
        Manifest::new(
            "selective",
            PluginKind::Checkpoint,
            env!("CARGO_PKG_VERSION"),
            "selective activation checkpointing: recompute every Nth block, the blocks named, or the fewest blocks that fit a memory budget",
        )
        .option(OptionSpec::optional(
            "every",
            OptionType::Int,
            "recompute blocks 0, N, 2N, ... (1 = every block, as `full`). Memory: the recomputed blocks keep only their (B, T, d) input",
        ))
        .option(OptionSpec::optional(
            "layers",
            OptionType::IntList,
            "recompute exactly these blocks, 0-based, e.g. [0, 4, 8]",
        ))
        .option(OptionSpec::optional(
            "sqrt",
            OptionType::Bool,
            "true: segments of ceil(sqrt(L)) blocks, each keeping only its input and rebuilt whole in backward \
             (Chen et al. 2016). Memory: L/k inputs plus one segment's activations",
        ))
        .option(OptionSpec::optional(
            "budget",
            OptionType::Size,
            "recompute the fewest blocks whose activations, predicted from the block facts, fit this, e.g. 1.5GiB \
             (blocks only: not the logits or gradients in flight). With no mode given, memory.budget is used, \
             and the engine fits the whole step's replayed peak under it",
        ))
        .option(OptionSpec::bool(
            "offload",
            false,
            "true: park each recomputed block's (B, T, d) input in the offload tier (plugins.offload) between \
             forward and backward instead of holding it; the budget mode still counts the inputs as held",
        ))
    }

    fn from_options(mut options: Options) -> Result<Self, PluginError> {
        let given: Vec<&str> =
            ["every", "layers", "sqrt", "budget"].into_iter().filter(|k| options.is_set(k)).collect();
        options.check(given.len() <= 1, || {
            format!(
                "options {} each choose a mode: give one of them (every: N, layers: [..], sqrt: true or budget: SIZE)",
                given.iter().map(|g| format!("'{g}'")).collect::<Vec<_>>().join(" and ")
            )
        });
        let mode = if options.is_set("every") {
            let n = options.int("every");
            options.check((1..=i64::from(u32::MAX)).contains(&n), || format!("option 'every': {n} must be at least 1"));
            Mode::Every(n.clamp(1, i64::from(u32::MAX)) as u32)
        } else if options.is_set("layers") {
            let layers = options.int_list("layers");
            let mut out = Vec::with_capacity(layers.len());
            for l in layers {
                match u32::try_from(l) {
                    Ok(l) if !out.contains(&l) => out.push(l),
                    Ok(l) => options.problem(format!("option 'layers': block {l} is listed twice")),
                    Err(_) => options.problem(format!("option 'layers': {l} is not a block index (0 or more)")),
                }
            }
            out.sort_unstable();
            Mode::Layers(out)
        } else if options.is_set("sqrt") {
            options.check(options.bool("sqrt"), || {
                "option 'sqrt': false chooses no mode; leave it out, or give sqrt: true".into()
            });
            Mode::Sqrt
        } else {
            let budget = options.opt_size("budget");
            options.check(budget != Some(0), || "option 'budget': must be more than 0 bytes, e.g. 1.5GiB".into());
            Mode::Budget(budget)
        };
        let offload = options.bool("offload");
        options.finish()?;
        Ok(Self { mode, offload })
    }
}

impl CheckpointPolicy for Selective {
    fn decide(&self, blocks: &[BlockFacts], ctx: &CheckpointContext) -> Result<Vec<BlockDecision>, PluginError> {
        let plan = self.decide_recompute(blocks, ctx)?;
        if !self.offload {
            return Ok(plan);
        }
        if !ctx.offload_available {
            return Err(PluginError::invalid_input(
                "option 'offload': the engine offers no offload tier here; leave the option out",
            ));
        }
        Ok(plan.into_iter().map(|d| if d == BlockDecision::Recompute { BlockDecision::Offload } else { d }).collect())
    }
}

impl Selective {
    /// The plan with every block that keeps only its input as `Recompute`.
    fn decide_recompute(
        &self,
        blocks: &[BlockFacts],
        ctx: &CheckpointContext,
    ) -> Result<Vec<BlockDecision>, PluginError> {
        let n = blocks.len();
        let recompute = |pick: &dyn Fn(u32) -> bool| {
            blocks.iter().map(|b| if pick(b.index) { BlockDecision::Recompute } else { BlockDecision::Keep }).collect()
        };
        match &self.mode {
            Mode::Every(k) => Ok(recompute(&|i| i % k == 0)),
            Mode::Layers(layers) => {
                let outside: Vec<String> = layers.iter().filter(|&&l| l as usize >= n).map(u32::to_string).collect();
                if !outside.is_empty() {
                    return Err(PluginError::invalid_input(format!(
                        "option 'layers': the model has {n} blocks (0..={}), so block {} does not exist",
                        n.saturating_sub(1),
                        outside.join(", ")
                    )));
                }
                Ok(recompute(&|i| layers.contains(&i)))
            }
            Mode::Sqrt => {
                let k = sqrt_segment(n) as u32;
                Ok(blocks
                    .iter()
                    .map(|b| if b.index % k == 0 { BlockDecision::Recompute } else { BlockDecision::Segment })
                    .collect())
            }
            Mode::Budget(budget) => {
                let budget = match (budget, ctx.budget_bytes) {
                    (Some(b), _) => *b,
                    (None, 0) => {
                        return Err(PluginError::invalid_input(
                            "no budget: give the option (plugins.checkpoint: {name: selective, budget: 1.5GiB}), \
                             set memory.budget, or choose another mode (every: N, layers: [..])",
                        ));
                    }
                    (None, b) => b,
                };
                plan::fewest_recomputed(blocks, budget)
            }
        }
    }
}

/// Blocks per segment in `sqrt` mode: ⌈√L⌉ (at least 1).
pub fn sqrt_segment(layers: usize) -> usize {
    let mut k = (layers as f64).sqrt().ceil() as usize;
    // Exact for any L: the float root can be one off for large squares.
    while k > 1 && (k - 1) * (k - 1) >= layers {
        k -= 1;
    }
    while k * k < layers {
        k += 1;
    }
    k.max(1)
}

ava_core::export_plugin!(checkpoint: Selective);

#[cfg(test)]
mod tests;
