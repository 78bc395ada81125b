//! Each kernel's own time, for a profile: with the environment variable
//! `AVA_CUDA_KERNEL_TIMES` naming a file, every launch made through [`super::launch_with`]
//! (the built-in plugins' kernels and those of a plugin library built on this crate, each
//! reading the variable itself) is bracketed by two CUDA events on its stream, waited for, and
//! appended to that file as one line:
//!
//! ```text
//! module <TAB> kernel <TAB> grid XxYxZ <TAB> threads <TAB> milliseconds
//! ```
//!
//! The host waits for every kernel so timed, so a run with it set is slower than one without:
//! it says where a step's kernel time goes (flash's `bwd_q` against its `bwd_kv`, say), not how
//! fast the step is. Since the stream is idle when the start event is recorded, a time
//! includes the launch's own latency (microseconds): negligible for flash's kernels, most of
//! it for a one-block kernel. The file is opened once, for appending; several processes or libraries
//! may share it (each line is one write). `tools/gpu-session.sh` sums it per kernel.

use std::ffi::CStr;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;
use std::sync::{Mutex, OnceLock};

use ava_core::PluginError;
use cudarc::driver::{result, sys};

/// The variable naming the file.
pub(super) const VAR: &str = "AVA_CUDA_KERNEL_TIMES";

/// The file, once opened: `None` when the variable is unset or empty, the message when it
/// could not be opened.
static SINK: OnceLock<Option<Result<Mutex<File>, String>>> = OnceLock::new();

fn sink() -> Result<Option<&'static Mutex<File>>, PluginError> {
    let opened = SINK.get_or_init(|| {
        let path = std::env::var_os(VAR).filter(|p| !p.is_empty())?;
        Some(open(Path::new(&path)))
    });
    match opened {
        None => Ok(None),
        Some(Ok(file)) => Ok(Some(file)),
        Some(Err(e)) => Err(PluginError::invalid_input(e.clone())),
    }
}

/// `path` opened for appending, or what to do about it.
fn open(path: &Path) -> Result<Mutex<File>, String> {
    OpenOptions::new().create(true).append(true).open(path).map(Mutex::new).map_err(|e| {
        format!(
            "{VAR} names {}, which cannot be opened for appending ({e}): name a writable file, or unset it",
            path.display()
        )
    })
}

/// A CUDA event, destroyed when dropped.
struct Event(sys::CUevent);

impl Event {
    fn new() -> Result<Self, PluginError> {
        result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
            .map(Self)
            .map_err(|e| PluginError::internal(format!("CUDA event for {VAR}: {e}")))
    }

    fn record(&self, stream: sys::CUstream) -> Result<(), PluginError> {
        // SAFETY: a live event; the stream is the one the launch goes on (the host's).
        unsafe { result::event::record(self.0, stream) }
            .map_err(|e| PluginError::internal(format!("CUDA event record for {VAR}: {e}")))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created by `new`, destroyed once; CUDA defers it until the event completes.
        let _ = unsafe { result::event::destroy(self.0) };
    }
}

/// Runs `launch` (one kernel launch of `kernel` on `stream`); with [`VAR`] set, times it and
/// appends its line. A failed launch is returned as it is, and writes no line.
pub(super) fn timed(
    module: &str,
    kernel: &CStr,
    grid: (u32, u32, u32),
    threads: u32,
    stream: sys::CUstream,
    launch: impl FnOnce() -> Result<(), PluginError>,
) -> Result<(), PluginError> {
    let Some(file) = sink()? else { return launch() };
    let (start, end) = (Event::new()?, Event::new()?);
    start.record(stream)?;
    launch()?;
    end.record(stream)?;
    // SAFETY: both events were created here and recorded on one stream, in this order.
    let ms = unsafe { result::event::synchronize(end.0).and_then(|()| result::event::elapsed(start.0, end.0)) }
        .map_err(|e| PluginError::internal(format!("timing {} for {VAR}: {e}", kernel.to_string_lossy())))?;
    let line = line(module, kernel, grid, threads, ms);
    file.lock()
        .unwrap_or_else(|p| p.into_inner())
        .write_all(line.as_bytes())
        .map_err(|e| PluginError::internal(format!("writing the file {VAR} names: {e}")))
}

/// One launch's line.
fn line(module: &str, kernel: &CStr, (x, y, z): (u32, u32, u32), threads: u32, ms: f32) -> String {
    format!("{module}\t{}\t{x}x{y}x{z}\t{threads}\t{ms:.4}\n", kernel.to_string_lossy())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_is_tab_separated_and_ends_the_line() {
        let l = line("flash", c"flash_bwd_q_bf16_d64", (32, 128, 1), 128, 1.25);
        assert_eq!(l, "flash\tflash_bwd_q_bf16_d64\t32x128x1\t128\t1.2500\n");
    }

    #[test]
    fn a_file_that_cannot_be_opened_is_named_with_the_variable() {
        let e = open(Path::new("/nonexistent-dir/times.tsv")).unwrap_err();
        assert!(e.starts_with("AVA_CUDA_KERNEL_TIMES names /nonexistent-dir/times.tsv, which cannot be opened"), "{e}");
        assert!(e.ends_with("name a writable file, or unset it"), "{e}");
    }
}
