//! What `--memory-trace` shows of a recorded step (`ava bench train`, `ava train`): its
//! summary on the terminal (the peak, what was live then by owner) and its chart (the bytes
//! by owner stacked over the step, the peak marked, `ava estimate`'s peak as a line).

use std::path::{Path, PathBuf};

use ava_train::config::Config;
use ava_train::memory::size;
use ava_train::memory::timeline::{self, Timeline};

use super::report_plot;
use crate::{CmdResult, Failure, output::Printer};

/// `ava estimate`'s peak for `config`, or None (said) where it cannot estimate.
pub fn estimated_peak(p: &Printer, registry: &ava_plugins::Registry, config: &Config) -> Option<u64> {
    let estimate = || -> Result<u64, String> {
        let spec = ava_train::train::model_spec(config).map_err(|e| e.to_string())?;
        let selected = super::estimate::Selected::new(registry, config, &spec).map_err(|e| e.to_string())?;
        let est = ava_train::estimate::estimate(&spec, config, &selected.plugins()).map_err(|e| e.to_string())?;
        Ok(est.breakdown.peak)
    };
    estimate().map_err(|e| p.warn(&format!("the memory chart has no estimate line: ava estimate failed ({e})"))).ok()
}

/// Draws step `step`'s timeline as `dir/stem.{svg,png}`: the bytes held by owner stacked
/// over the step (what was held before, the four owners holding most at the peak, the rest),
/// the peak marked, `estimate` (bytes) as a dashed line. Nothing without events.
pub fn chart(
    step: u64,
    timeline: &Timeline,
    estimate: Option<u64>,
    dir: &Path,
    stem: &str,
) -> Result<Vec<PathBuf>, String> {
    let Some(peak) = timeline.peak() else { return Ok(Vec::new()) };
    // The owners drawn apart: the most at the peak, as many as the palette has colours left.
    let apart: Vec<&str> = peak.by_owner().into_iter().take(4).map(|(owner, _, _)| owner).collect();
    let column = |owner: &str| timeline.owners.iter().position(|o| *o == owner).map(|i| i + 1);
    let apart_columns: Vec<usize> = apart.iter().filter_map(|o| column(o)).collect();
    let rows = timeline.by_owner(timeline::COUNTER_ROWS);
    let series_of = |label: String, pick: &dyn Fn(&[u64]) -> u64| report_plot::Series {
        label,
        points: rows.iter().map(|(t_ns, held)| (*t_ns as f64 / 1e6, pick(held) as f64)).collect(),
    };
    let mut series = vec![series_of("held before the step".into(), &|h| h[0])];
    for (owner, &c) in apart.iter().zip(&apart_columns) {
        series.push(series_of(owner.to_string(), &|h| h[c]));
    }
    series.push(series_of("everything else".into(), &|h| {
        h.iter().enumerate().skip(1).filter(|(i, _)| !apart_columns.contains(i)).map(|(_, b)| b).sum()
    }));
    report_plot::timeline_chart(
        format!("memory of step {step} by owner"),
        series,
        (peak.t_ns as f64 / 1e6, format!("peak {}", size(peak.bytes))),
        estimate.map(|b| (format!("ava estimate's peak, {}", size(b)), b)),
        dir,
        stem,
    )
    .map_err(|e| format!("drawing the memory chart failed: {e}"))
}

/// [`chart`] as `<trace's stem>.memory.{svg,png}` beside the trace file `trace`, and says
/// where it went.
pub fn chart_beside(p: &Printer, trace: &Path, step: u64, timeline: &Timeline, estimate: Option<u64>) -> CmdResult {
    let stem = format!("{}.memory", trace.file_stem().map_or("trace".into(), |s| s.to_string_lossy()));
    let dir = trace.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let files = chart(step, timeline, estimate, dir, &stem)
        .map_err(|e| Failure::Runtime(anyhow::anyhow!("--memory-trace: {e}")))?;
    if !files.is_empty() {
        let names: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
        p.note(&format!("memory chart: {}", names.join(", ")));
    }
    Ok(())
}

/// What a step's timeline saw: its events, its peak and what was live then, by owner.
pub fn summary(step: u64, timeline: &Timeline) -> String {
    let dropped = match timeline.dropped {
        0 => String::new(),
        n => format!(", {n} more not kept (past its capacity of {})", timeline.capacity),
    };
    let Some(peak) = timeline.peak() else {
        return format!("memory timeline of step {step}: no allocations recorded{dropped}");
    };
    let mut lines = vec![format!(
        "memory timeline of step {step}: {} allocations and releases{dropped} (recorded in {} outside the \
         counted memory); peak {} at {:.1} ms into the step, made in `{}`; held before the step and still \
         held: {}",
        timeline.events.len(),
        size(timeline.buffer_bytes()),
        size(peak.bytes),
        peak.t_ns as f64 / 1e6,
        peak.owner,
        size(peak.held_before),
    )];
    lines.push("  made in the step and live at the peak, by owner:".to_string());
    for (owner, count, bytes) in peak.by_owner().into_iter().take(12) {
        lines.push(format!("  {:>12}  {count:>5} buffers  {owner}", size(bytes)));
    }
    lines.join("\n")
}
