//! What most commands start from: the effective configuration and the plugin registry
//! built from it.

use std::path::{Path, PathBuf};

use ava_plugins::{HostConfig, Registry, VettingPolicy};
use ava_train::config::{ConfigLoader, LoadedConfig, PluginsConfig};

use crate::{Failure, UsageExt, cli::ConfigArgs, output::Printer};

/// The config file used when none is named: `./ava.yaml` (written by `ava plugins enable`).
pub const DEFAULT_CONFIG_FILE: &str = "ava.yaml";

/// The plugin registry built from the effective configuration.
pub struct Ctx {
    /// Built-ins plus the plugins found in the search paths.
    pub registry: Registry,
    /// The vetting policy in force.
    pub policy: VettingPolicy,
    /// The lock file in force.
    pub lock_file: PathBuf,
}

/// The config file to read: the one named, else `./ava.yaml` if it exists.
pub fn config_file(named: Option<&Path>) -> Option<PathBuf> {
    named
        .map(Path::to_path_buf)
        .or_else(|| Path::new(DEFAULT_CONFIG_FILE).is_file().then(|| DEFAULT_CONFIG_FILE.into()))
}

/// Loads the configuration (defaults < file < environment < --set). Errors are usage errors.
pub fn load_config(args: &ConfigArgs, p: &Printer) -> Result<LoadedConfig, Failure> {
    loader(args, p).load().usage()
}

/// The host settings from the `plugins` section.
fn host_from(plugins: &PluginsConfig) -> HostConfig {
    HostConfig {
        search_paths: plugins.search_paths.clone(),
        policy: plugins.policy,
        lock_file: plugins.lock_file.clone(),
        ..HostConfig::default()
    }
    .with_process_defaults()
}

fn loader(args: &ConfigArgs, p: &Printer) -> ConfigLoader<'static> {
    let mut loader = ConfigLoader::new().process_env().sets(args.set.iter().cloned());
    if let Some(file) = config_file(args.config.as_deref()) {
        p.verbose(&format!("config: {}", file.display()));
        loader = loader.file(file);
    }
    loader
}

/// Configuration and registry, with every plugin selection checked by its plugin: unknown
/// keys, wrong types and refused plugin options come in one report (exit code 2).
pub fn load_checked(args: &ConfigArgs, p: &Printer) -> Result<Ctx, Failure> {
    let (loaded, registry) =
        loader(args, p).load_checked(|plugins| Registry::load(&host_from(plugins)).map_err(Box::new))?.usage()?;
    report(&registry, p, false);
    // A valid configuration's host settings are the ones the registry was built from.
    let plugins = &loaded.config().plugins;
    Ok(Ctx { registry, policy: plugins.policy, lock_file: plugins.lock_file.clone() })
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
    let host = host_from(&loaded.config().plugins);
    let registry = Registry::load(&host)?;
    report(&registry, p, listing);
    Ok(Ctx { registry, policy: host.policy, lock_file: host.lock_file })
}
