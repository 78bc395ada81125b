//! What most commands start from: the effective configuration and the plugin registry
//! built from it.

use std::path::{Path, PathBuf};

use ava_plugins::{HostConfig, HostError, Registry, VettingPolicy};
use ava_train::config::{ConfigLoader, LoadedConfig, PluginsConfig};

use crate::{Failure, UsageExt, cli::ConfigArgs, output::Printer};

/// The config file used when none is named: `./ava.yaml` (written by `ava plugins enable`).
pub const DEFAULT_CONFIG_FILE: &str = "ava.yaml";

/// The plugin registry built from the effective configuration.
pub struct Ctx {
    /// Built-ins plus the plugins found in the search paths.
    pub registry: Registry,
    /// The vetting policy in force (the config's, raised to the machine policy's floor).
    pub policy: VettingPolicy,
    /// The lock file in force (the machine policy's, else the config's).
    pub lock_file: PathBuf,
}

impl Ctx {
    fn new(registry: Registry) -> Ctx {
        let (policy, lock_file) = (registry.config().policy, registry.config().lock_file.clone());
        Ctx { registry, policy, lock_file }
    }
}

/// The config file to read: the one named, else `./ava.yaml` if it exists.
pub fn config_file(named: Option<&Path>) -> Option<PathBuf> {
    named
        .map(Path::to_path_buf)
        .or_else(|| Path::new(DEFAULT_CONFIG_FILE).is_file().then(|| DEFAULT_CONFIG_FILE.into()))
}

/// Loads the configuration (defaults < file < environment < --set). Errors are usage errors.
pub fn load_config(args: &ConfigArgs, p: &Printer) -> Result<LoadedConfig, Failure> {
    loader(args, p)?.load().usage()
}

/// The host settings from the `plugins` section, over the machine policy's floor.
pub fn host_from(plugins: &PluginsConfig) -> Result<HostConfig, Box<HostError>> {
    HostConfig {
        search_paths: plugins.search_paths.clone(),
        policy: plugins.policy,
        lock_file: plugins.lock_file.clone(),
        ..HostConfig::default()
    }
    .with_process_defaults()
    .with_machine_policy()
    .map_err(Box::new)
}

/// The host settings in force (config plus the machine policy's floor), without building a
/// registry: for commands that must work while the lock file is not yet acceptable (`plugins
/// sign`, `plugins vet PATH`).
pub fn host_settings(args: &ConfigArgs, p: &Printer) -> Result<HostConfig, Failure> {
    let loaded = load_config(args, p)?;
    let mut host = host_from(&loaded.config().plugins).map_err(registry_failure)?;
    host.policy = host.effective_policy();
    host.lock_file = host.effective_lock_file().to_path_buf();
    Ok(host)
}

/// Building the registry: a lock file or policy file that cannot be used is a configuration
/// error (exit code 2), like a bad config file; anything else (I/O) is a failure.
fn registry_failure(e: Box<HostError>) -> Failure {
    match *e {
        HostError::Lock { .. } | HostError::Policy { .. } => Failure::Usage(e.into()),
        other => Failure::Runtime(other.into()),
    }
}

/// Whether two paths name the same file.
fn same_file(a: &Path, b: &Path) -> bool {
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

fn loader(args: &ConfigArgs, p: &Printer) -> Result<ConfigLoader<'static>, Failure> {
    let mut loader = ConfigLoader::new().process_env().sets(args.set.iter().cloned());
    if let Some(file) = config_file(args.config.as_deref()) {
        p.verbose(&format!("config: {}", file.display()));
        if args.config.is_none() {
            check_default_config_owner(&file, p)?;
        }
        loader = loader.file(file);
    }
    Ok(loader)
}

/// The owner of `./ava.yaml` (the link, the file it names) or of the working directory, when
/// that is another user than this one and root: whoever it is chooses this run's settings
/// (plugins, paths), so a file in the working directory that they could have put or changed
/// there is warned about, and refused under a machine policy with `refuse_foreign_config`.
/// A file named with `-c` is the user's choice and is not checked.
fn check_default_config_owner(file: &Path, p: &Printer) -> Result<(), Failure> {
    let Some((what, uid)) = foreign_owner(file) else { return Ok(()) };
    let me = ava_fs::dirfd::euid();
    let problem = format!(
        "./{DEFAULT_CONFIG_FILE} is read as this command's config only because it is in the working directory, but \
         {what} belongs to uid {uid}, not to this user (uid {me}) or root, so that user chooses this run's settings \
         (plugins, paths)"
    );
    let policy = ava_plugins::MachinePolicy::load().map_err(|e| registry_failure(Box::new(e)))?;
    if let Some(set_by) = policy.and_then(|floor| floor.refuse_foreign_config) {
        return Err(Failure::Usage(anyhow::anyhow!(
            "{problem}; the machine policy {} refuses it (refuse_foreign_config: true). Name the file you mean with \
             -c FILE after checking it, or run ava in a directory of your own",
            set_by.display()
        )));
    }
    p.warn(&format!(
        "{problem}. If you checked it and mean to use it, name it (-c ./{DEFAULT_CONFIG_FILE}) or chown it; \
         otherwise run ava in a directory of your own"
    ));
    Ok(())
}

/// What of `file` and its directory belongs to another user (neither this one nor root), and
/// that user's uid.
fn foreign_owner(file: &Path) -> Option<(String, u32)> {
    use std::os::unix::fs::MetadataExt;
    let me = ava_fs::dirfd::euid();
    let foreign = |uid: u32| uid != me && uid != 0;
    let dir = match file.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let checks = [
        (format!("./{DEFAULT_CONFIG_FILE}"), std::fs::symlink_metadata(file)),
        (format!("the file ./{DEFAULT_CONFIG_FILE} links to"), std::fs::metadata(file)),
        ("the working directory".to_string(), std::fs::metadata(dir)),
    ];
    checks
        .into_iter()
        .find_map(|(what, meta)| meta.ok().map(|m| m.uid()).filter(|&uid| foreign(uid)).map(|uid| (what, uid)))
}

/// Configuration and registry, with every plugin selection checked by its plugin: unknown
/// keys, wrong types and refused plugin options come in one report (exit code 2).
pub fn load_checked(args: &ConfigArgs, p: &Printer) -> Result<Ctx, Failure> {
    // One config file is read: a named one replaces ./ava.yaml (what `plugins enable`
    // writes), which would otherwise be missed without a word.
    if let Some(named) = &args.config
        && Path::new(DEFAULT_CONFIG_FILE).is_file()
        && !same_file(named, Path::new(DEFAULT_CONFIG_FILE))
    {
        p.note(&format!(
            "note: ./{DEFAULT_CONFIG_FILE} is not read: {} is the config file (one file is read; put the settings in \
             it, or pass them with --set)",
            named.display()
        ));
    }
    let (_loaded, registry) = loader(args, p)?
        .load_checked(|plugins| host_from(plugins).and_then(|host| Registry::load(&host).map_err(Box::new)))
        .map_err(registry_failure)?
        .usage()?;
    report(&registry, p, false);
    Ok(Ctx::new(registry))
}

/// Prints the searched directories (`-v`) and the registry's warnings. `listing` commands
/// print every row with its reason themselves, so they get only the warnings no row carries.
fn report(registry: &Registry, p: &Printer, listing: bool) {
    for dir in registry.search_dirs() {
        p.verbose(&format!("searching {} ({})", dir.path.display(), dir.source.as_str()));
    }
    let warnings = if listing { registry.warnings().to_vec() } else { registry.notices() };
    for w in warnings {
        p.warn(&w);
    }
}

/// Configuration plus registry; registry warnings go to stderr.
pub fn load(args: &ConfigArgs, p: &Printer) -> Result<Ctx, Failure> {
    load_inner(args, p, false)
}

/// Like [`load`], for commands that print every row with its reason (`plugins list`): only
/// the warnings that no row explains go to stderr.
pub fn load_for_listing(args: &ConfigArgs, p: &Printer) -> Result<Ctx, Failure> {
    load_inner(args, p, true)
}

fn load_inner(args: &ConfigArgs, p: &Printer, listing: bool) -> Result<Ctx, Failure> {
    let loaded = load_config(args, p)?;
    let host = host_from(&loaded.config().plugins).map_err(registry_failure)?;
    let registry = Registry::load(&host).map_err(|e| registry_failure(Box::new(e)))?;
    report(&registry, p, listing);
    Ok(Ctx::new(registry))
}
