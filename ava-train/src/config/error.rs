//! [`ConfigError`]: everything that can go wrong loading, validating or editing a config,
//! with messages meant to be printed as they are.

use std::fmt::Write as _;
use std::io;
use std::path::{Path, PathBuf};

use super::validate::ConfigProblem;

/// An error of the configuration system. Its `Display` is the full report for the user.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The config file does not exist.
    #[error("{}", not_found(path, suggestion.as_deref()))]
    NotFound {
        /// The path as given.
        path: PathBuf,
        /// A file of a similar name in the same directory.
        suggestion: Option<PathBuf>,
    },
    /// The config file exists but could not be read.
    #[error("cannot read config file {}: {source}", path.display())]
    Read {
        /// The path as given.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// The file's extension is not one of the known formats.
    #[error("config file {}: unknown format (the name must end in .yaml, .yml or .toml)", path.display())]
    UnknownFormat {
        /// The path as given.
        path: PathBuf,
    },
    /// The file is not valid YAML / TOML.
    #[error("{}", syntax(path, format, *line, *column, message))]
    Syntax {
        /// The path as given.
        path: PathBuf,
        /// `YAML` or `TOML`.
        format: &'static str,
        /// 1-based line, when the parser says.
        line: Option<usize>,
        /// 1-based column, when the parser says.
        column: Option<usize>,
        /// The parser's message.
        message: String,
    },
    /// Well-formed, but refused before it is loaded: an alias bomb, too deep, a non-finite
    /// number (the message names the key and the limit).
    #[error("{}{}: {message}", path.display(), line.map(|l| format!(":{l}")).unwrap_or_default())]
    Refused {
        /// The path as given.
        path: PathBuf,
        /// 1-based line.
        line: Option<usize>,
        /// What is wrong and how to fix it.
        message: String,
    },
    /// A malformed `--set` argument.
    #[error("--set '{arg}': {reason}")]
    BadSet {
        /// The argument as given.
        arg: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The configuration was read but has problems; all of them are listed.
    #[error("{}", report(file.as_deref(), problems))]
    Invalid {
        /// The config file, if one was given.
        file: Option<PathBuf>,
        /// Every problem found (at least one).
        problems: Vec<ConfigProblem>,
    },
    /// Writing an edited config file failed.
    #[error("cannot write {}: {source}", path.display())]
    Write {
        /// The file being written.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// An edit could not be made safely; the file was left as it was.
    #[error("cannot edit {}: {reason}; the file was left unchanged", path.display())]
    Edit {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
}

impl ConfigError {
    /// The problems of an [`Invalid`](Self::Invalid) configuration (empty for other errors).
    pub fn problems(&self) -> &[ConfigProblem] {
        match self {
            Self::Invalid { problems, .. } => problems,
            _ => &[],
        }
    }
}

fn not_found(path: &Path, suggestion: Option<&Path>) -> String {
    let mut out = format!("config file {} not found", path.display());
    if let Some(near) = suggestion {
        let _ = write!(out, " (did you mean {}?)", near.display());
    }
    out.push_str("; the recipes in configs/ are ready to use, and `ava config show` prints the built-in defaults");
    out
}

fn syntax(path: &Path, format: &str, line: Option<usize>, column: Option<usize>, message: &str) -> String {
    let mut out = path.display().to_string();
    if let Some(line) = line {
        let _ = write!(out, ":{line}");
        if let Some(column) = column {
            let _ = write!(out, ":{column}");
        }
    }
    let _ = write!(out, ": {format} syntax error: {message}");
    out
}

fn report(file: Option<&Path>, problems: &[ConfigProblem]) -> String {
    let mut out = String::new();
    if let Some(file) = file {
        let _ = write!(out, "{}: ", file.display());
    }
    let n = problems.len();
    let _ = write!(out, "{n} problem{} in the configuration:", if n == 1 { "" } else { "s" });
    for problem in problems {
        let _ = write!(out, "\n  - {problem}");
    }
    out
}
