//! The built-in memory policy `thresholds`: four fractions of the memory budget, each with an
//! action, and hysteresis before undoing one. "Memory" is the step's peak, which the
//! micro-batch moves (activations scale with it).
//!
//! | memory / budget | pressure | action |
//! |---|---|---|
//! | < target (0.90) | normal | continue; after `restore_after` such observations in a row with a shrunk micro-batch, restore it |
//! | ≥ target | target | continue (and restart the count above) |
//! | ≥ warning (0.92) | warning | warn |
//! | ≥ critical (0.95) | critical | halve the micro-batch, or stop with a checkpoint when it is at its minimum |
//! | ≥ emergency (0.97) | emergency | save a checkpoint first, then halve the micro-batch (stop at its minimum) |
//!
//! Without the hysteresis a run whose memory sits just above `critical` at micro-batch `m`
//! and below `target` at `m/2` would shrink and restore on alternate observations; with it a
//! restore needs `restore_after` consecutive observations below target, so the number of
//! shrink/restore actions is at most about `2·observations / restore_after`.
//!
//! It also watches the memory held between steps (what the next step starts from, with no
//! gradients or activations alive): when it has grown at every one of `leak_window`
//! observations in a row, by at least `LEAK_MIN_BYTES` in all, something is probably kept
//! from each step, and the policy warns once per such window.

use ava_core::{format_size, prelude::*};

/// Growth over a leak window below this is noise (a lazily grown cache), not a leak.
pub const LEAK_MIN_BYTES: u64 = 64 << 10;

/// The `thresholds` policy: its options and its below-target counter.
#[derive(Debug, Clone, PartialEq)]
pub struct Thresholds {
    /// Fraction of the budget at and above which pressure is `Target`.
    pub target: f64,
    /// ... `Warning`.
    pub warning: f64,
    /// ... `Critical`.
    pub critical: f64,
    /// ... `Emergency`.
    pub emergency: f64,
    /// Consecutive below-target observations needed before restoring the micro-batch.
    pub restore_after: u64,
    /// The micro-batch is never halved below this.
    pub min_micro_batch: u32,
    /// Observations of steadily growing held memory that make a probable leak (0: never).
    pub leak_window: u64,
    /// Consecutive below-target observations so far with a shrunk micro-batch.
    below_target: u64,
    /// Held memory at the last observation, the observations in a row it grew at, and
    /// where that run of growth started.
    held: Option<u64>,
    growing: u64,
    growth_from: u64,
    /// A leak message waiting for an observation without another action.
    leak: Option<String>,
}

impl Default for Thresholds {
    fn default() -> Self {
        Self {
            target: 0.90,
            warning: 0.92,
            critical: 0.95,
            emergency: 0.97,
            restore_after: 50,
            min_micro_batch: 1,
            leak_window: 20,
            below_target: 0,
            held: None,
            growing: 0,
            growth_from: 0,
            leak: None,
        }
    }
}

/// A fraction as a percentage without trailing zeros: 0.95 → "95", 0.925 → "92.5".
fn pct(fraction: f64) -> String {
    let s = format!("{:.2}", fraction * 100.0);
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

impl Plugin for Thresholds {
    fn manifest() -> Manifest {
        let d = Thresholds::default();
        Manifest::new(
            "thresholds",
            PluginKind::Memory,
            env!("CARGO_PKG_VERSION"),
            "four budget thresholds: warn, halve the micro-batch, save and halve; stop with a checkpoint at the smallest micro-batch; restore with hysteresis",
        )
        .option(OptionSpec::float("target", d.target, "fraction of the budget to stay under"))
        .option(OptionSpec::float("warning", d.warning, "fraction of the budget at which to log a warning"))
        .option(OptionSpec::float(
            "critical",
            d.critical,
            "fraction of the budget at which to halve the micro-batch (at its minimum: save a checkpoint and stop)",
        ))
        .option(OptionSpec::float(
            "emergency",
            d.emergency,
            "fraction of the budget at which to save a checkpoint, then halve the micro-batch (at its minimum: save and stop)",
        ))
        .option(OptionSpec::int(
            "restore_after",
            d.restore_after as i64,
            "consecutive observations below target before a shrunk micro-batch is restored",
        ))
        .option(OptionSpec::int(
            "min_micro_batch",
            i64::from(d.min_micro_batch),
            "never halve the micro-batch below this",
        ))
        .option(OptionSpec::int(
            "leak_window",
            d.leak_window as i64,
            "warn of a probable leak when the memory held between steps grows at this many observations in a row (0: never)",
        ))
    }

    fn from_options(mut options: Options) -> Result<Self, PluginError> {
        let names = ["target", "warning", "critical", "emergency"];
        let levels = names.map(|n| options.float(n));
        for (name, &x) in names.iter().zip(&levels) {
            options.check(x > 0.0 && x <= 1.0, || {
                format!("option '{name}': {x} must be in (0, 1] (a fraction of the budget)")
            });
        }
        // Order is only checked between levels that are themselves in range, so one bad value
        // is reported once, not again as a knock-on ordering problem.
        let in_range = |x: f64| x > 0.0 && x <= 1.0;
        for i in 1..levels.len() {
            let (lo, hi) = ((names[i - 1], levels[i - 1]), (names[i], levels[i]));
            if in_range(lo.1) && in_range(hi.1) {
                options
                    .check(hi.1 > lo.1, || format!("option '{}' ({}) must be above '{}' ({})", hi.0, hi.1, lo.0, lo.1));
            }
        }
        let restore_after = options.int("restore_after");
        options.check(restore_after >= 1, || format!("option 'restore_after': {restore_after} must be >= 1"));
        let min_micro_batch = options.int("min_micro_batch");
        options.check(min_micro_batch >= 1, || format!("option 'min_micro_batch': {min_micro_batch} must be >= 1"));
        options.check(min_micro_batch <= i64::from(u32::MAX), || {
            format!("option 'min_micro_batch': {min_micro_batch} is larger than any micro-batch")
        });
        let leak_window = options.int("leak_window");
        options.check(leak_window >= 0, || format!("option 'leak_window': {leak_window} must be >= 0 (0: never warn)"));
        options.finish()?;
        let [target, warning, critical, emergency] = levels;
        Ok(Thresholds {
            target,
            warning,
            critical,
            emergency,
            restore_after: restore_after as u64,
            min_micro_batch: min_micro_batch as u32,
            leak_window: leak_window as u64,
            ..Thresholds::default()
        })
    }
}

impl Thresholds {
    fn classify(&self, ratio: f64) -> Pressure {
        if ratio >= self.emergency {
            Pressure::Emergency
        } else if ratio >= self.critical {
            Pressure::Critical
        } else if ratio >= self.warning {
            Pressure::Warning
        } else if ratio >= self.target {
            Pressure::Target
        } else {
            Pressure::Normal
        }
    }
}

impl Thresholds {
    /// Follows the held memory; sets `leak` when a window of steady growth completes.
    fn watch_for_leak(&mut self, held: u64) {
        if self.leak_window == 0 {
            return;
        }
        match self.held {
            Some(last) if held > last => self.growing += 1,
            _ => (self.growing, self.growth_from) = (0, held),
        }
        self.held = Some(held);
        if self.growing >= self.leak_window && held - self.growth_from >= LEAK_MIN_BYTES {
            self.leak = Some(format!(
                "probable memory leak: the memory held between steps grew at each of the last {} observations, \
                 from {} to {} (+{}); something is kept from every step (a tensor stored in a list, a growing \
                 cache); plugins' allocations are counted too",
                self.growing,
                format_size(self.growth_from),
                format_size(held),
                format_size(held - self.growth_from)
            ));
            (self.growing, self.growth_from) = (0, held);
        }
    }

    fn pressure(&mut self, stats: &MemoryStats) -> MemoryDecision {
        if stats.budget == 0 {
            return MemoryDecision::proceed(Pressure::Normal); // no budget, nothing to compare
        }
        // The step's peak: what the micro-batch changes, and what runs out first.
        let ratio = stats.peak.max(stats.current) as f64 / stats.budget as f64;
        let pressure = self.classify(ratio);
        let at = |level: &str, fraction: f64| {
            format!("memory at {:.1}% of budget ({level} {}%)", ratio * 100.0, pct(fraction))
        };
        if pressure != Pressure::Normal {
            self.below_target = 0; // the restore needs consecutive observations below target
        }
        let (micro, min) = (stats.micro_batch, self.min_micro_batch);
        match pressure {
            Pressure::Emergency if micro / 2 >= min => MemoryDecision::new(
                MemoryAction::CheckpointAndShrink,
                pressure,
                format!(
                    "{}: saving a checkpoint, then halving the micro-batch from {micro} to {}",
                    at("emergency", self.emergency),
                    micro / 2
                ),
            ),
            Pressure::Emergency => MemoryDecision::new(
                MemoryAction::StopWithCheckpoint,
                pressure,
                format!(
                    "{} and the micro-batch is at its minimum ({micro}, min_micro_batch {min}): saving a checkpoint \
                     and stopping; to go on, raise the memory budget, enable activation checkpointing \
                     (checkpoint: full), or pick an optimizer with less state (e.g. sgd)",
                    at("emergency", self.emergency)
                ),
            ),
            Pressure::Critical if micro / 2 >= min => MemoryDecision::new(
                MemoryAction::ShrinkMicroBatch,
                pressure,
                format!(
                    "{}: halving the micro-batch from {micro} to {} (gradient accumulation doubles, global batch unchanged)",
                    at("critical", self.critical),
                    micro / 2
                ),
            ),
            Pressure::Critical => MemoryDecision::new(
                MemoryAction::StopWithCheckpoint,
                pressure,
                format!(
                    "{} and the micro-batch is at its minimum ({micro}, min_micro_batch {min}): saving a checkpoint and \
                     stopping; to go on, raise the memory budget, enable activation checkpointing (checkpoint: full), \
                     or pick an optimizer with less state (e.g. sgd)",
                    at("critical", self.critical)
                ),
            ),
            Pressure::Warning => MemoryDecision::new(MemoryAction::Warn, pressure, at("warning", self.warning)),
            Pressure::Target => MemoryDecision::proceed(pressure),
            Pressure::Normal if micro < stats.configured_micro_batch => {
                self.below_target += 1;
                if self.below_target >= self.restore_after {
                    self.below_target = 0;
                    MemoryDecision::new(
                        MemoryAction::RestoreMicroBatch,
                        pressure,
                        format!(
                            "memory at {:.1}% of budget, below target ({}%) for {} observations: restoring the \
                             micro-batch from {micro} towards {}",
                            ratio * 100.0,
                            pct(self.target),
                            self.restore_after,
                            stats.configured_micro_batch
                        ),
                    )
                } else {
                    MemoryDecision::proceed(pressure)
                }
            }
            Pressure::Normal => {
                self.below_target = 0; // nothing to restore
                MemoryDecision::proceed(pressure)
            }
        }
    }
}

impl MemoryPolicy for Thresholds {
    fn observe(&mut self, stats: &MemoryStats) -> Result<MemoryDecision, PluginError> {
        self.watch_for_leak(stats.current);
        let decision = self.pressure(stats);
        // A leak warning waits for an observation with nothing else to do.
        if decision.action == MemoryAction::Continue
            && let Some(message) = self.leak.take()
        {
            return Ok(MemoryDecision::new(MemoryAction::Warn, decision.pressure, message));
        }
        Ok(decision)
    }
}

inventory::submit! { crate::builtin::Builtin::memory::<Thresholds>() }

#[cfg(test)]
mod tests {
    use super::*;

    fn build(json: &str) -> Result<Thresholds, PluginError> {
        ava_core::ffi::build::<Thresholds>(json, &HostContext::default())
    }

    /// `permille` thousandths of a 1 000 000-byte budget.
    fn stats(permille: u64, micro_batch: u32, configured: u32) -> MemoryStats {
        MemoryStats {
            current: permille * 1000,
            peak: permille * 1000,
            budget: 1_000_000,
            phase: Phase::Forward,
            step: 1,
            micro_batch,
            configured_micro_batch: configured,
        }
    }

    #[test]
    fn each_level_with_its_action_and_message() {
        let mut p = build("").unwrap();
        let d = p.observe(&stats(500, 8, 8)).unwrap();
        assert_eq!((d.action, d.pressure, d.message.as_str()), (MemoryAction::Continue, Pressure::Normal, ""));
        let d = p.observe(&stats(900, 8, 8)).unwrap(); // "at or above" the target
        assert_eq!((d.action, d.pressure), (MemoryAction::Continue, Pressure::Target));
        let d = p.observe(&stats(930, 8, 8)).unwrap();
        assert_eq!((d.action, d.pressure), (MemoryAction::Warn, Pressure::Warning));
        assert_eq!(d.message.as_str(), "memory at 93.0% of budget (warning 92%)");
        let d = p.observe(&stats(953, 8, 8)).unwrap();
        assert_eq!((d.action, d.pressure), (MemoryAction::ShrinkMicroBatch, Pressure::Critical));
        assert_eq!(
            d.message.as_str(),
            "memory at 95.3% of budget (critical 95%): halving the micro-batch from 8 to 4 \
             (gradient accumulation doubles, global batch unchanged)"
        );
        let d = p.observe(&stats(973, 4, 8)).unwrap();
        assert_eq!((d.action, d.pressure), (MemoryAction::CheckpointAndShrink, Pressure::Emergency));
        assert_eq!(
            d.message.as_str(),
            "memory at 97.3% of budget (emergency 97%): saving a checkpoint, then halving the micro-batch from 4 to 2"
        );
        // At the minimum there is nothing left to halve.
        let d = p.observe(&stats(973, 1, 8)).unwrap();
        assert_eq!((d.action, d.pressure), (MemoryAction::StopWithCheckpoint, Pressure::Emergency));
        assert!(d.message.as_str().starts_with("memory at 97.3% of budget (emergency 97%) and the micro-batch is at its minimum (1, min_micro_batch 1): saving a checkpoint and stopping"), "{d}");
        // Over the budget is still an emergency.
        assert_eq!(p.observe(&stats(1500, 4, 8)).unwrap().pressure, Pressure::Emergency);
    }

    #[test]
    fn critical_at_minimum_micro_batch_stops_with_advice() {
        let mut p = build("").unwrap();
        let d = p.observe(&stats(960, 1, 8)).unwrap();
        assert_eq!((d.action, d.pressure), (MemoryAction::StopWithCheckpoint, Pressure::Critical));
        assert_eq!(
            d.message.as_str(),
            "memory at 96.0% of budget (critical 95%) and the micro-batch is at its minimum (1, min_micro_batch 1): \
             saving a checkpoint and stopping; to go on, raise the memory budget, enable activation checkpointing \
             (checkpoint: full), or pick an optimizer with less state (e.g. sgd)"
        );
        // min_micro_batch 4: 8 may halve to 4, 6 may not (3 < 4), 4 may not.
        let mut p = build(r#"{"min_micro_batch": 4}"#).unwrap();
        assert_eq!(p.observe(&stats(960, 8, 8)).unwrap().action, MemoryAction::ShrinkMicroBatch);
        assert_eq!(p.observe(&stats(960, 6, 8)).unwrap().action, MemoryAction::StopWithCheckpoint);
        assert_eq!(p.observe(&stats(960, 4, 8)).unwrap().action, MemoryAction::StopWithCheckpoint);
    }

    #[test]
    fn no_budget_means_no_pressure() {
        let mut p = build("").unwrap();
        let mut s = stats(999, 8, 8);
        s.budget = 0;
        assert_eq!(p.observe(&s).unwrap(), MemoryDecision::proceed(Pressure::Normal));
    }

    /// Restores need `restore_after` consecutive below-target observations; anything at or
    /// above the target starts the count again, and nothing is restored at full size.
    #[test]
    fn restore_needs_consecutive_calm() {
        let mut p = build(r#"{"restore_after": 5}"#).unwrap();
        // Oscillating between normal and target (or warning) with a shrunk micro-batch: never.
        for i in 0..100 {
            let permille = if i % 2 == 0 {
                500
            } else if i % 4 == 1 {
                910
            } else {
                930
            };
            assert_ne!(p.observe(&stats(permille, 4, 8)).unwrap().action, MemoryAction::RestoreMicroBatch, "obs {i}");
        }
        // Four calm observations are not enough, the fifth restores, and the count restarts.
        for _ in 0..4 {
            assert_eq!(p.observe(&stats(500, 4, 8)).unwrap().action, MemoryAction::Continue);
        }
        let d = p.observe(&stats(500, 4, 8)).unwrap();
        assert_eq!((d.action, d.pressure), (MemoryAction::RestoreMicroBatch, Pressure::Normal));
        assert_eq!(
            d.message.as_str(),
            "memory at 50.0% of budget, below target (90%) for 5 observations: restoring the micro-batch from 4 towards 8"
        );
        assert_eq!(p.observe(&stats(500, 4, 8)).unwrap().action, MemoryAction::Continue);
        // At the configured size there is nothing to restore, however long it stays calm.
        for _ in 0..20 {
            assert_eq!(p.observe(&stats(100, 8, 8)).unwrap().action, MemoryAction::Continue);
        }
    }

    /// An engine whose memory is 96% of the budget at micro-batch 8 (critical) and 76% at 4
    /// (normal): 560‰ + 50‰ per sample. Each cycle is one shrink at micro-batch 8, then
    /// `restore_after` calm observations at 4 ending in a restore: 1 + restore_after
    /// observations. Over 1000 observations with restore_after = 50 (cycle 51): shrinks at
    /// observations 1, 52, ..., 1 + 51·19 = 970 → 20; restores at 51, 102, ..., 51·19 = 969 → 19.
    /// With restore_after = 1 (cycle 2) it flaps: 500 of each.
    #[test]
    fn oscillating_pressure_gives_bounded_actions() {
        for (restore_after, want) in [(50, (20, 19)), (1, (500, 500))] {
            let mut p = build(&format!(r#"{{"restore_after": {restore_after}}}"#)).unwrap();
            let (mut micro, configured) = (8u32, 8u32);
            let (mut shrinks, mut restores) = (0, 0);
            for _ in 0..1000 {
                let d = p.observe(&stats(560 + 50 * u64::from(micro), micro, configured)).unwrap();
                match d.action {
                    MemoryAction::ShrinkMicroBatch => {
                        shrinks += 1;
                        micro /= 2;
                    }
                    MemoryAction::RestoreMicroBatch => {
                        restores += 1;
                        micro = (micro * 2).min(configured);
                    }
                    MemoryAction::Continue => {}
                    other => panic!("unexpected {other:?}: {d}"),
                }
            }
            assert_eq!((shrinks, restores), want, "restore_after = {restore_after}");
        }
    }

    #[test]
    fn options_are_checked_all_at_once() {
        let err = build(
            r#"{"target": 0.95, "warning": 0.9, "critical": 1.5, "emergency": 0,
                "restore_after": 0, "min_micro_batch": -2}"#,
        )
        .unwrap_err();
        let details: Vec<&str> = err.details().collect();
        assert_eq!(
            details,
            [
                "option 'critical': 1.5 must be in (0, 1] (a fraction of the budget)",
                "option 'emergency': 0 must be in (0, 1] (a fraction of the budget)",
                "option 'warning' (0.9) must be above 'target' (0.95)",
                "option 'restore_after': 0 must be >= 1",
                "option 'min_micro_batch': -2 must be >= 1",
            ]
        );
        let ok = build(r#"{"target": 0.5, "warning": 0.6, "critical": 0.7, "emergency": 1}"#).unwrap();
        assert_eq!((ok.target, ok.emergency, ok.restore_after, ok.min_micro_batch), (0.5, 1.0, 50, 1));
        assert_eq!(build("").unwrap(), Thresholds::default());
    }

    #[test]
    fn percentages_print_without_trailing_zeros() {
        assert_eq!(pct(0.95), "95");
        assert_eq!(pct(0.925), "92.5");
        assert_eq!(pct(1.0), "100");
    }

    #[test]
    fn registered() {
        let b = crate::builtin::all().find(|b| (b.manifest)().name.as_str() == "thresholds").expect("registered");
        let m = (b.manifest)();
        m.validate().unwrap();
        let names: Vec<&str> = m.options.iter().map(|o| o.name.as_str()).collect();
        assert_eq!(
            names,
            ["target", "warning", "critical", "emergency", "restore_after", "min_micro_batch", "leak_window"]
        );
        assert_eq!((b.create)("", &HostContext::default()).unwrap().kind(), PluginKind::Memory);
    }

    /// Held memory growing at every one of `leak_window` observations, by 64 KiB or more,
    /// warns once per window, with or without a budget; a plateau, noise, or a pressure
    /// action in the way do not lose or fake it.
    #[test]
    fn steadily_growing_held_memory_warns_of_a_leak() {
        let observe = |p: &mut Thresholds, current: u64, budget: u64| {
            let s = MemoryStats { current, peak: current, budget, ..stats(0, 8, 8) };
            p.observe(&s).unwrap()
        };
        let mut p = build(r#"{"leak_window": 5}"#).unwrap();
        let base = 100 << 20;
        // 20 KiB a step: the fifth growth completes the window, 100 KiB in all.
        let mut warned = Vec::new();
        for i in 0..=12u64 {
            let d = observe(&mut p, base + i * (20 << 10), 0);
            if d.action == MemoryAction::Warn {
                warned.push((i, d.message.to_string()));
            }
        }
        assert_eq!(warned.iter().map(|w| w.0).collect::<Vec<_>>(), [5, 10], "{warned:?}");
        assert_eq!(
            warned[0].1,
            "probable memory leak: the memory held between steps grew at each of the last 5 observations, from \
             100.00 MiB to 100.10 MiB (+100.00 KiB); something is kept from every step (a tensor stored in a list, \
             a growing cache); plugins' allocations are counted too"
        );
        // Growth of 1 KiB a step is below the noise floor; a dip restarts the count.
        let mut p = build(r#"{"leak_window": 5}"#).unwrap();
        for i in 0..50u64 {
            let jitter = if i % 7 == 6 { 0 } else { i * (1 << 10) };
            assert_eq!(observe(&mut p, base + jitter, 0).action, MemoryAction::Continue, "observation {i}");
        }
        let mut p = build(r#"{"leak_window": 3}"#).unwrap();
        for i in 0..6u64 {
            let held = if i % 2 == 0 { base } else { base + (1 << 20) };
            assert_eq!(observe(&mut p, held, 0).action, MemoryAction::Continue, "oscillation {i}");
        }
        // The window ends at a critical observation: the shrink comes first, the warning next.
        let mut p = build(r#"{"leak_window": 2}"#).unwrap();
        let budget = 200 << 20;
        assert_eq!(observe(&mut p, 100 << 20, budget).action, MemoryAction::Continue);
        assert_eq!(observe(&mut p, 101 << 20, budget).action, MemoryAction::Continue);
        assert_eq!(observe(&mut p, 192 << 20, budget).action, MemoryAction::ShrinkMicroBatch);
        let d = observe(&mut p, 150 << 20, budget);
        assert_eq!(d.action, MemoryAction::Warn);
        assert!(d.message.starts_with("probable memory leak"), "{d}");
        // leak_window 0 never warns.
        let mut p = build(r#"{"leak_window": 0}"#).unwrap();
        for i in 0..100u64 {
            assert_eq!(observe(&mut p, base + i * (1 << 20), 0).action, MemoryAction::Continue);
        }
        assert!(build(r#"{"leak_window": -1}"#).unwrap_err().to_string().contains("option 'leak_window'"));
    }
}
