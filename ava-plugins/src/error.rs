//! Host errors: each says what went wrong, where (file, plugin, kind) and how to fix it.

use std::path::PathBuf;

use ava_core::{PluginError, PluginKind};

use crate::discover::SearchDir;

/// Everything the host can refuse or fail at.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// A path given explicitly does not exist.
    #[error("{}: no such plugin file", path.display())]
    Missing {
        /// The path.
        path: PathBuf,
    },

    /// [`Registry::locate`](crate::Registry::locate) found no library of that name: not among
    /// the plugins loaded from files, nor as a library file name in the search directories.
    #[error("{}", not_found(name, suggestion.as_deref(), *builtin, searched))]
    NotFound {
        /// The name asked for.
        name: String,
        /// A close name of a library that is there, if any.
        suggestion: Option<String>,
        /// Set when the name is a built-in plugin's (compiled into ava, so it has no file).
        builtin: Option<PluginKind>,
        /// The directories searched, in order (none when no search path is set).
        searched: Vec<SearchDir>,
    },

    /// The file is not an Ava plugin library.
    #[error("{}: not an Ava plugin: {reason}", path.display())]
    NotAPlugin {
        /// The file.
        path: PathBuf,
        /// Why (no abi_stable header, another application's root module, ...).
        reason: String,
    },

    /// Built against another contract version.
    #[error(
        "{}: built against Ava plugin contract {found} (ava-core {found_crate}), but this ava speaks contract {expected} (ava-core {expected_crate}); {hint}",
        path.display()
    )]
    ContractVersion {
        /// The file.
        path: PathBuf,
        /// The library's contract version.
        found: u32,
        /// The library's ava-core version.
        found_crate: String,
        /// The host's contract version.
        expected: u32,
        /// The host's ava-core version.
        expected_crate: String,
        /// What to do.
        hint: &'static str,
    },

    /// The library's manifest declares a contract version this ava cannot use
    /// ([`Manifest::check_contract`](ava_core::Manifest::check_contract)).
    #[error("{}: {reason}", path.display())]
    ManifestContract {
        /// The file.
        path: PathBuf,
        /// Which plugin, its contract and the host's, and what to do.
        reason: String,
    },

    /// Same contract version, different type layout.
    #[error(
        "{}: its plugin interface does not match this ava's ({summary}); rebuild the plugin against the ava-core this ava was built with",
        path.display()
    )]
    LayoutMismatch {
        /// The file.
        path: PathBuf,
        /// One or two lines from abi_stable's report.
        summary: String,
    },

    /// The dynamic loader refused the file.
    #[error("{}: could not be loaded: {reason}", path.display())]
    Open {
        /// The file.
        path: PathBuf,
        /// The loader's message.
        reason: String,
    },

    /// The private copy the loader was to open was not the bytes read and vetted (see
    /// [`private_copy`](crate::private_copy)): nothing was loaded.
    #[error(
        "{}: not loaded: its private copy {} changed before it could be loaded ({reason}); another process may \
         be writing where Ava copies plugins: set TMPDIR to a directory only you can write, and tell whoever \
         manages this machine",
        path.display(),
        copy.display()
    )]
    CopyChanged {
        /// The library.
        path: PathBuf,
        /// The copy.
        copy: PathBuf,
        /// What was found.
        reason: String,
    },

    /// The vetting policy refused the file before opening it.
    #[error("{}: refused: {reason}", path.display())]
    Refused {
        /// The file.
        path: PathBuf,
        /// Why, and how to fix it.
        reason: String,
    },

    /// A plugin call failed.
    #[error("{kind} '{plugin}' ({source_desc}): {error}")]
    Plugin {
        /// Plugin name.
        plugin: String,
        /// Its kind.
        kind: PluginKind,
        /// `builtin` or the file.
        source_desc: String,
        /// The plugin's error.
        error: PluginError,
    },

    /// No plugin of that kind has that name.
    #[error("unknown {kind} '{name}'{}; installed: {}{note}", suggestion.as_ref().map(|s| format!(" (did you mean '{s}'?)")).unwrap_or_default(), if available.is_empty() { "none".to_string() } else { available.join(", ") })]
    Unknown {
        /// The kind asked for.
        kind: PluginKind,
        /// The name asked for.
        name: String,
        /// A close name, if any.
        suggestion: Option<String>,
        /// The names of that kind.
        available: Vec<String>,
        /// Extra hint (starts with "; " or is empty), e.g. that files were refused.
        note: String,
    },

    /// The name exists, but under another kind.
    #[error("'{name}' is {}, not {}; set it under plugins.{} instead", actual.article_noun(), wanted.article_noun(), actual.as_str())]
    WrongKind {
        /// The name.
        name: String,
        /// The kind asked for.
        wanted: PluginKind,
        /// The kind it is.
        actual: PluginKind,
    },

    /// Two sources define the same (kind, name).
    #[error("{kind} '{name}' is defined twice: by {first} and by {second}; remove one of them from the search paths")]
    Duplicate {
        /// The kind.
        kind: PluginKind,
        /// The name.
        name: String,
        /// The first source.
        first: String,
        /// The second source.
        second: String,
    },

    /// The plugin exists but could not be used (refused, incompatible, modified).
    #[error("{kind} '{name}' cannot be used: {reason}")]
    Unusable {
        /// The kind.
        kind: PluginKind,
        /// The name.
        name: String,
        /// Why.
        reason: String,
    },

    /// The lock file could not be read or written.
    #[error("{}: {reason}", path.display())]
    Lock {
        /// The lock file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },

    /// A plugin policy file (the machine's, or `$AVA_POLICY_FILE`) is not usable. Nothing is
    /// loaded then: a floor that cannot be read must not silently become no floor.
    #[error(
        "{}: the plugin policy file is not usable: {}; fix it (it is the machine's floor under every run: ask whoever manages this machine)",
        path.display(),
        problems.join("; ")
    )]
    Policy {
        /// The policy file.
        path: PathBuf,
        /// Every problem found.
        problems: Vec<String>,
    },

    /// Other I/O.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

impl HostError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io { path: path.into(), source }
    }
}

/// The text of [`HostError::NotFound`]: what was looked for, where, and how to fix it.
fn not_found(name: &str, suggestion: Option<&str>, builtin: Option<PluginKind>, searched: &[SearchDir]) -> String {
    if let Some(kind) = builtin {
        return format!("'{name}' is a built-in {kind}, compiled into ava: it has no library file");
    }
    let close = suggestion.map(|s| format!(" (did you mean '{s}'?)")).unwrap_or_default();
    let file = format!(
        "{}ava_plugin_{}{}",
        std::env::consts::DLL_PREFIX,
        name.replace('-', "_"),
        std::env::consts::DLL_SUFFIX
    );
    let place = if searched.is_empty() {
        "(no search paths: plugins.search_paths and $AVA_PLUGIN_PATH are empty and the ava executable's \
         directory is unknown)"
            .to_string()
    } else {
        let dirs: Vec<String> =
            searched.iter().map(|d| format!("{} ({})", d.path.display(), d.source.as_str())).collect();
        format!("in the search paths: {}", dirs.join(", "))
    };
    format!(
        "no plugin library named '{name}'{close} {place}; `ava plugins list` shows the plugins found. To use a \
         library elsewhere, give its path (e.g. ./{file}) or add its directory to plugins.search_paths or \
         $AVA_PLUGIN_PATH"
    )
}
