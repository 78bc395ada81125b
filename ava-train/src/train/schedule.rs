//! The learning-rate schedule (linear warmup, then cosine decay) and dynamic loss scaling.

use serde::{Deserialize, Serialize};

/// Learning rate at 1-based `step`: linear warmup from lr/warmup to `lr` over `warmup`
/// steps, then cosine decay to `min_lr` at `total`.
pub fn learning_rate(step: u64, lr: f64, min_lr: f64, warmup: u64, total: u64) -> f64 {
    if warmup > 0 && step <= warmup {
        return lr * step as f64 / warmup as f64;
    }
    if total <= warmup {
        return lr;
    }
    let progress = ((step - warmup) as f64 / (total - warmup) as f64).clamp(0.0, 1.0);
    min_lr + 0.5 * (lr - min_lr) * (1.0 + (std::f64::consts::PI * progress).cos())
}

/// Dynamic loss scaling for f16: the loss is multiplied by `scale` before backward; a step
/// whose gradients overflow is skipped and the scale halved; after `growth_interval` clean
/// steps it doubles.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LossScaler {
    /// The current scale (1 when scaling is off).
    pub scale: f64,
    /// Clean steps since the last change.
    pub clean_steps: u64,
    /// Steps before growing.
    pub growth_interval: u64,
    /// Whether scaling is on.
    pub enabled: bool,
}

impl LossScaler {
    /// A scaler starting at `init`; disabled means a constant scale of 1.
    pub fn new(enabled: bool, init: f64, growth_interval: u64) -> Self {
        Self { scale: if enabled { init } else { 1.0 }, clean_steps: 0, growth_interval, enabled }
    }

    /// Records a step's outcome; returns whether the step should be applied.
    pub fn update(&mut self, finite: bool) -> bool {
        if !self.enabled {
            return finite;
        }
        if !finite {
            self.scale = (self.scale / 2.0).max(1.0);
            self.clean_steps = 0;
            return false;
        }
        self.clean_steps += 1;
        if self.clean_steps >= self.growth_interval {
            self.scale *= 2.0;
            self.clean_steps = 0;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine() {
        assert_eq!(learning_rate(1, 1.0, 0.1, 10, 110), 0.1);
        assert_eq!(learning_rate(10, 1.0, 0.1, 10, 110), 1.0);
        assert!((learning_rate(60, 1.0, 0.1, 10, 110) - 0.55).abs() < 1e-12);
        assert!((learning_rate(110, 1.0, 0.1, 10, 110) - 0.1).abs() < 1e-12);
        assert_eq!(learning_rate(5, 1.0, 0.1, 0, 0), 1.0);
    }

    #[test]
    fn loss_scale_halves_on_overflow_and_grows_after_clean_steps() {
        let mut s = LossScaler::new(true, 1024.0, 2);
        assert!(!s.update(false));
        assert_eq!(s.scale, 512.0);
        assert!(s.update(true));
        assert!(s.update(true));
        assert_eq!(s.scale, 1024.0);
        let mut off = LossScaler::new(false, 1024.0, 2);
        assert_eq!(off.scale, 1.0);
        assert!(off.update(true));
        assert_eq!(off.scale, 1.0);
    }
}
