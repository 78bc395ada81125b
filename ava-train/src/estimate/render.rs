//! The text report of an [`Estimate`]: terms grouped by component with subtotals, the
//! per-block terms the checkpoint policy saw, and the breakdown line.

use std::fmt::Write as _;

use ava_core::BlockDecision;

use super::{Component, Estimate, Term};

/// Bytes in the largest binary unit that keeps the number at least 1 (`13.25 MiB`).
pub(crate) use ava_core::format_size as bytes;

/// `keep ×2, recompute ×30` (runs of equal decisions).
fn plan_summary(plan: &[BlockDecision]) -> String {
    let mut runs: Vec<(BlockDecision, usize)> = Vec::new();
    for &d in plan {
        match runs.last_mut() {
            Some((last, n)) if *last == d => *n += 1,
            _ => runs.push((d, 1)),
        }
    }
    runs.iter().map(|(d, n)| format!("{} ×{n}", d.as_str())).collect::<Vec<_>>().join(", ")
}

fn line(out: &mut String, t: &Term) {
    let _ = writeln!(out, "    {:<52} {:>12}  {}", t.name, bytes(t.bytes), t.formula);
}

impl Estimate {
    /// The report: each term with its bytes and formula, grouped by component with subtotals,
    /// the per-block terms, and the breakdown line with its status.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "Memory estimate for one training step{}: N = {} parameters, micro-batch B = {} × T = {} tokens, {}{}",
            if self.device.is_cuda() { format!(" on {} (device memory)", self.device) } else { String::new() },
            super::grouped(self.num_params),
            self.batch,
            self.seq_len,
            self.precision.as_str(),
            if self.accumulation > 1 {
                format!(", {} micro-batches per step", self.accumulation)
            } else {
                String::new()
            },
        );
        let budget = if self.activation_budget > 0 {
            format!(" (the policy was given {} for activations)", bytes(self.activation_budget))
        } else {
            String::new()
        };
        let _ = writeln!(out, "checkpoint plan: {}{budget}", plan_summary(&self.plan));
        let _ = writeln!(out, "peak: {}", self.peak_at);
        for component in Component::ALL {
            let terms: Vec<&Term> = self.terms.iter().filter(|t| t.component == component).collect();
            let total: u64 = terms.iter().map(|t| t.bytes).sum();
            let _ = writeln!(out, "  {:<54} {:>12}", component.as_str(), bytes(total));
            for t in terms {
                line(&mut out, t);
            }
        }
        let per_block: u64 = self.block_terms.iter().map(|t| t.bytes).sum();
        let input = self.block_facts.first().map_or(0, |f| f.input_bytes);
        let _ = writeln!(
            out,
            "  per kept block (activation_bytes for the checkpoint policy; a recomputed block keeps its input, {})",
            bytes(input)
        );
        for t in &self.block_terms {
            line(&mut out, t);
        }
        let _ = writeln!(out, "    {:<52} {:>12}", "total per kept block", bytes(per_block));
        if !self.zero_stages.is_empty() {
            let _ = writeln!(
                out,
                "model states per rank by ZeRO stage (P: the weights as held; Ψ = {} parameters; K: bytes of \
                 optimizer state per parameter, f32 masters included; /N is this rank's own share, whole \
                 parameters; at stage 3 the weights too, less the rotary tables); activations, the weights \
                 stage 3 gathers and buffers in flight come on top:",
                super::grouped(self.num_params),
            );
            for z in &self.zero_stages {
                let _ = writeln!(out, "    stage {}: {:<70} {:>12}", z.stage, z.formula, bytes(z.bytes));
            }
        }
        if self.device.is_cuda() {
            self.render_host(&mut out);
        }
        let _ = writeln!(out, "{}", self.breakdown.line(&self.status));
        out
    }

    /// A GPU run's host memory, and what the device holds outside the allocations counted.
    fn render_host(&self, out: &mut String) {
        let total: u64 = self.host.iter().map(|t| t.bytes).sum();
        let _ = writeln!(out, "  {:<54} {:>12}", "host memory (not in the device peak)", bytes(total));
        for t in &self.host {
            line(out, t);
        }
        let _ = writeln!(
            out,
            "  outside the counted allocations: the CUDA context, cuBLAS's workspace and the memory pool's slack \
             (1.2 to 1.9 GiB on an H200); memory.budget's default leaves 5% of the card for them, at least 2 GiB"
        );
    }
}
