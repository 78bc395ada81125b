//! The one error type that crosses the plugin boundary.

use std::fmt;

use abi_stable::{
    StableAbi,
    std_types::{RString, RVec},
};

/// What went wrong, coarsely; the message says the rest.
#[repr(u8)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The plugin does not provide this (another kind, a backward pass, a device, a shape).
    Unsupported = 0,
    /// The options were refused; `details` lists every problem.
    InvalidOptions = 1,
    /// A call's arguments were wrong (buffer lengths, shapes, unknown key).
    InvalidInput = 2,
    /// Reading or writing storage failed.
    Io = 3,
    /// The plugin panicked; the panic was caught at the boundary.
    Panicked = 4,
    /// A bug or broken invariant inside the plugin.
    Internal = 5,
    /// The plugin could not get the memory or storage it needed.
    OutOfMemory = 6,
}

impl ErrorKind {
    /// A short lowercase word for messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Unsupported => "unsupported",
            Self::InvalidOptions => "invalid options",
            Self::InvalidInput => "invalid input",
            Self::Io => "i/o error",
            Self::Panicked => "panicked",
            Self::Internal => "internal error",
            Self::OutOfMemory => "out of memory",
        }
    }
}

/// An error returned by a plugin: a kind, a one-line message, and details (one problem per
/// entry, e.g. every refused option).
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq, Eq)]
pub struct PluginError {
    /// Coarse classification.
    pub kind: ErrorKind,
    /// One line saying what went wrong.
    pub message: RString,
    /// Further problems, one per entry (all refused options, not only the first).
    pub details: RVec<RString>,
}

impl PluginError {
    /// An error of `kind` with `message` and no details.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self { kind, message: RString::from(message.into()), details: RVec::new() }
    }

    /// [`ErrorKind::Unsupported`].
    pub fn unsupported(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unsupported, message)
    }

    /// [`ErrorKind::InvalidInput`].
    pub fn invalid_input(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidInput, message)
    }

    /// [`ErrorKind::InvalidOptions`] with every problem listed.
    pub fn invalid_options(problems: Vec<String>) -> Self {
        let n = problems.len();
        let message =
            if n == 1 { "1 problem with the options".to_string() } else { format!("{n} problems with the options") };
        Self {
            kind: ErrorKind::InvalidOptions,
            message: message.into(),
            details: problems.into_iter().map(RString::from).collect(),
        }
    }

    /// [`ErrorKind::Io`].
    pub fn io(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Io, message)
    }

    /// [`ErrorKind::OutOfMemory`].
    pub fn out_of_memory(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::OutOfMemory, message)
    }

    /// [`ErrorKind::Internal`].
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Internal, message)
    }

    /// Adds one detail line.
    pub fn with_detail(mut self, detail: impl Into<String>) -> Self {
        self.details.push(RString::from(detail.into()));
        self
    }

    /// The detail lines as `&str`.
    pub fn details(&self) -> impl Iterator<Item = &str> {
        self.details.iter().map(|d| d.as_str())
    }
}

impl fmt::Display for PluginError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)?;
        for d in self.details.iter() {
            write!(f, "\n  - {d}")?;
        }
        Ok(())
    }
}

impl std::error::Error for PluginError {}

/// Checks that a buffer has the length a call needs, naming it in the error.
pub fn expect_len(what: &str, got: usize, want: usize) -> Result<(), PluginError> {
    if got == want {
        Ok(())
    } else {
        Err(PluginError::invalid_input(format!("{what} has {got} elements, expected {want}")))
    }
}
