//! The memory breakdown of one step, measured or estimated, and its one-line rendering.

use serde::{Deserialize, Serialize};

/// Bytes as GiB.
pub fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// Bytes as MiB.
pub fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
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

/// One reading of a GPU's memory, in bytes (`memory::device` reads it on a `cuda` build).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceMemory {
    /// Held by the run's allocations now (the stream-ordered pool's used memory).
    pub used: u64,
    /// The most held at once since the start of the step.
    pub peak: u64,
    /// The card's memory in use by anyone (total less free, `cuMemGetInfo`): the pool's
    /// reserve, the CUDA context, cuBLAS's workspace, other processes.
    pub card_used: u64,
    /// The card's memory.
    pub card_total: u64,
}

impl DeviceMemory {
    /// `; card 12.3 GiB of 79.2 GiB in use (context, cuBLAS, the pool's reserve)`.
    pub fn line(&self) -> String {
        format!(
            "; card {} of {} in use (context, cuBLAS workspace, the pool's reserve)",
            size(self.card_used),
            size(self.card_total)
        )
    }
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

    /// `memory 1.85 GiB of 2.00 GiB (92%) warning — params 210.5 MiB, grads 210.5 MiB,
    /// optimizer 421.0 MiB, data 64.00 KiB, activations 1.01 GiB; RSS 2.31 GiB (pages the OS counts
    /// resident: code, heap, freed pages kept)`;
    /// `status` is the memory policy's pressure word. Each number in the unit that suits it.
    /// The RSS is the operating system's count of the process's resident pages, read after
    /// the step: not a reserve, and it may be below the step's peak (pages handed back).
    pub fn line(&self, status: &str) -> String {
        let budget = if self.budget == 0 {
            " (no budget)".to_string()
        } else {
            format!(" of {} ({:.0}%) {status}", size(self.budget), 100.0 * self.fraction())
        };
        let mut s = format!(
            "memory {}{budget} — params {}, grads {}, optimizer {}, data {}, activations {}",
            size(self.peak),
            size(self.params),
            size(self.grads),
            size(self.optimizer),
            size(self.data),
            size(self.activations),
        );
        if let Some(r) = self.resident {
            s.push_str(&format!("; RSS {}{RSS_NOTE}", size(r)));
        }
        s
    }
}

/// What the RSS in [`Breakdown::line`] is, said after it (a log says it once: `replace` it
/// with nothing in the lines after the first).
pub const RSS_NOTE: &str = " (pages the OS counts resident: code, heap, freed pages kept)";

/// Bytes in the unit that suits them, three significant digits: `512 B`, `64.0 KiB`,
/// `210.5 MiB`, `1.85 GiB`.
pub fn size(bytes: u64) -> String {
    const UNITS: [(&str, u64); 3] = [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    for (unit, size) in UNITS {
        if bytes >= size {
            let x = bytes as f64 / size as f64;
            return if x >= 100.0 { format!("{x:.1} {unit}") } else { format!("{x:.2} {unit}") };
        }
    }
    format!("{bytes} B")
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
            "memory 2.00 GiB of 4.00 GiB (50%) ok — params 256.0 MiB, grads 256.0 MiB, optimizer 512.0 MiB, data \
             0 B, activations 1.00 GiB"
        );
        // Small runs read in the unit that suits each number, and the RSS says what it is.
        let small = Breakdown {
            resident: Some(102 << 20),
            allocated: 7 << 20,
            ..Breakdown::measured(70 << 20, 1 << 20, 1 << 20, 2 << 20, 12 << 10, 2 << 30)
        };
        assert_eq!(
            small.line("normal"),
            "memory 70.00 MiB of 2.00 GiB (3%) normal — params 1.00 MiB, grads 1.00 MiB, optimizer 2.00 MiB, data \
             12.00 KiB, activations 65.99 MiB; RSS 102.0 MiB (pages the OS counts resident: code, heap, freed pages \
             kept)"
        );
        // A peak below the known parts (measured before they were all allocated) is not negative.
        assert_eq!(Breakdown::measured(10, 20, 0, 0, 0, 100).activations, 0);
    }
}
