//! `ava`: train transformer language models that would not otherwise fit in memory.
//!
//! This binary only parses arguments, prints and reports progress; the logic lives in the
//! library crates (`ava-train`, `ava-plugins`). One file per subcommand under `commands/`.

mod cli;
mod commands;
mod context;
mod output;
#[cfg(test)]
mod readme_commands;
mod signals;

use std::process::ExitCode;

use clap::Parser;

use crate::{cli::Cli, output::Printer};

/// Every allocation is counted, so the memory breakdown is measured, not guessed from RSS.
#[global_allocator]
static ALLOCATOR: ava_train::memory::CountingAlloc = ava_train::memory::CountingAlloc;

/// A command's failure and the exit code it maps to.
#[derive(Debug)]
pub enum Failure {
    /// Bad usage or configuration: exit code 2.
    Usage(anyhow::Error),
    /// Anything else: exit code 1.
    Runtime(anyhow::Error),
    /// Stopped by a signal after saving what it could: exit code 128 + the signal's number.
    Signal(i32, anyhow::Error),
    /// Printed already, where it happened (each MPI rank prints its own refusal before the
    /// ranks stop together): exit with this code, print nothing more.
    Reported(u8),
}

impl<E: Into<anyhow::Error>> From<E> for Failure {
    fn from(e: E) -> Self {
        Failure::Runtime(e.into())
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Usage(e) | Failure::Runtime(e) | Failure::Signal(_, e) => write!(f, "{e:#}"),
            Failure::Reported(code) => write!(f, "reported where it happened (exit code {code})"),
        }
    }
}

impl Failure {
    /// The exit code it maps to.
    pub fn code(&self) -> u8 {
        match self {
            Failure::Usage(_) => 2,
            Failure::Runtime(_) => 1,
            Failure::Signal(signal, _) => (128 + signal) as u8,
            Failure::Reported(code) => *code,
        }
    }
}

/// Marks an error as a usage/config error (exit code 2).
pub trait UsageExt<T> {
    /// Maps the error to [`Failure::Usage`].
    fn usage(self) -> Result<T, Failure>;
}

impl<T, E: Into<anyhow::Error>> UsageExt<T> for Result<T, E> {
    fn usage(self) -> Result<T, Failure> {
        self.map_err(|e| Failure::Usage(e.into()))
    }
}

/// What every command returns.
pub type CmdResult = Result<(), Failure>;

/// Keeps freed memory in the process for reuse instead of returning it to the OS at once:
/// a training step frees and reallocates the same large buffers every step, and glibc's
/// defaults (mmap above a few MiB, trim the heap top) turn each of them into fresh
/// zero-filled pages, i.e. page faults on every step. This is what PyTorch's caching
/// allocator achieves; RSS then stays near the peak, which the dashboard shows as reserved.
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator parameters; called before any thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}

fn main() -> ExitCode {
    keep_freed_memory();
    let cli = Cli::parse();
    let printer = Printer { format: cli.global.format, verbosity: cli.global.verbosity() };
    match commands::run(cli.command, &printer) {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => ExitCode::from(print_failure(&printer, f)),
    }
}

/// Prints a command's failure (JSON or text) and returns its exit code.
pub fn print_failure(printer: &Printer, f: Failure) -> u8 {
    let code = f.code();
    let err = match f {
        Failure::Usage(err) | Failure::Runtime(err) | Failure::Signal(_, err) => err,
        Failure::Reported(_) => return code,
    };
    match printer.format {
        output::Format::Json => {
            let chain: Vec<String> = err.chain().skip(1).map(|c| c.to_string()).collect();
            println!("{}", serde_json::json!({"error": err.to_string(), "caused_by": chain, "exit_code": code}));
        }
        output::Format::Text => {
            let mut text = format!("error: {err}\n");
            let mut said = err.to_string();
            for cause in err.chain().skip(1) {
                // A cause the message already quotes (`cannot read input X: <the OS error>`)
                // is not said again.
                let cause = cause.to_string();
                if !said.contains(&cause) {
                    text.push_str(&format!("  caused by: {cause}\n"));
                    said.push_str(&cause);
                }
            }
            // One write: eprintln! writes a message in pieces, and the ranks of an MPI job
            // share one stderr, where their pieces interleaved mid-line.
            let text = output::printable(&text);
            let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), text.as_bytes());
        }
    }
    code
}
