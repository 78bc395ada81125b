//! The memory breakdown of one step, measured or estimated, and its one-line rendering.

use serde::{Deserialize, Serialize};

/// Bytes as GiB.
pub fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// Where the bytes of a training step go.
/// Read back from `metrics.jsonl` by `ava report` (the measured-only fields may be absent).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Breakdown {
    /// f32 master weights (plus compute-precision copies while a step runs).
    pub params: u64,
    /// Gradient accumulators.
    pub grads: u64,
    /// Optimizer state buffers.
    pub optimizer: u64,
    /// Batches queued by the loader.
    pub data: u64,
    /// Everything else at the peak: activations, saved attention buffers, workspace
    /// (measured: peak minus the components above).
    pub activations: u64,
    /// The peak (the sum of the above).
    pub peak: u64,
    /// The budget from `memory.budget`.
    pub budget: u64,
    /// Resident set size reported by the OS, when known (measured only).
    #[serde(default)]
    pub resident: Option<u64>,
    /// Bytes allocated when `resident` was read (measured only).
    #[serde(default)]
    pub allocated: u64,
}

impl Breakdown {
    /// A measured breakdown: `activations` is what the peak holds beyond the known parts.
    pub fn measured(peak: u64, params: u64, grads: u64, optimizer: u64, data: u64, budget: u64) -> Self {
        let known = params + grads + optimizer + data;
        Self {
            params,
            grads,
            optimizer,
            data,
            activations: peak.saturating_sub(known),
            peak: peak.max(known),
            budget,
            resident: super::resident_bytes(),
            allocated: super::current(),
        }
    }

    /// Fraction of the budget the peak uses.
    pub fn fraction(&self) -> f64 {
        if self.budget == 0 { 0.0 } else { self.peak as f64 / self.budget as f64 }
    }

    /// Resident bytes over the bytes allocated at the same moment (> 1: memory the
    /// allocator holds that we do not use: fragmentation and freed pages kept).
    pub fn fragmentation(&self) -> Option<f64> {
        self.resident.filter(|_| self.allocated > 0).map(|r| r as f64 / self.allocated as f64)
    }

    /// `memory 1.85/2.00 GiB (92%) warning — params 0.21, grads 0.21, optimizer 0.42,
    /// data 0.00, activations 1.01`; `status` is the memory policy's pressure word. Numbers
    /// are in GiB, or in MiB when the budget is under 1 GiB.
    pub fn line(&self, status: &str) -> String {
        let (unit, div) = if self.budget >= 1 << 30 { ("GiB", 1u64 << 30) } else { ("MiB", 1 << 20) };
        let u = |b: u64| b as f64 / div as f64;
        let mut s = format!(
            "memory {:.2}/{:.2} {unit} ({:.0}%) {status} — params {:.2}, grads {:.2}, optimizer {:.2}, data {:.2}, activations {:.2}",
            u(self.peak),
            u(self.budget),
            100.0 * self.fraction(),
            u(self.params),
            u(self.grads),
            u(self.optimizer),
            u(self.data),
            u(self.activations),
        );
        if let (Some(f), Some(r)) = (self.fragmentation(), self.resident) {
            s.push_str(&format!("; reserved {:.2} {unit} ({f:.2}x allocated)", u(r)));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measured_breakdown_attributes_the_rest_to_activations() {
        let g = 1u64 << 30;
        let mut b = Breakdown::measured(g * 2, g / 4, g / 4, g / 2, 0, g * 4);
        b.resident = None;
        assert_eq!(b.activations, g);
        assert_eq!(b.fraction(), 0.5);
        assert_eq!(
            b.line("ok"),
            "memory 2.00/4.00 GiB (50%) ok — params 0.25, grads 0.25, optimizer 0.50, data 0.00, activations 1.00"
        );
        // A peak below the known parts (measured before they were all allocated) is not negative.
        assert_eq!(Breakdown::measured(10, 20, 0, 0, 0, 100).activations, 0);
    }
}
