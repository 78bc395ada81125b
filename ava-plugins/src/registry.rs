//! The registry: built-ins and dynamic plugins in one table keyed by (kind, name), plus a
//! row per library file found, with its status and the reason for any refusal.

use std::{
    collections::BTreeMap,
    ffi::OsString,
    path::{Path, PathBuf},
    sync::Arc,
};

use abi_stable::std_types::RStr;
use ava_core::{
    AttentionKernel, CheckpointPolicy, Device, HostContext, Manifest, MemoryPolicy, OffloadTier, Optimizer,
    PluginError, PluginKind,
    ffi::{ForeignAttention, ForeignCheckpoint, ForeignMemory, ForeignOffload, ForeignOptimizer, PluginRootRef},
    options::did_you_mean,
};

use crate::{
    HostError, Instance,
    builtin::{self, Builtin},
    discover::{Candidate, DirSource, SearchDir, library_files, search_dirs},
    load::{self, Library},
    lock::{LockFile, Pin, VettingPolicy},
    policy::MachinePolicy,
};

/// What the host needs to know to build a registry.
#[derive(Debug, Clone)]
pub struct HostConfig {
    /// `plugins.search_paths` from the config.
    pub search_paths: Vec<PathBuf>,
    /// `plugins.policy`.
    pub policy: VettingPolicy,
    /// `plugins.lock_file`.
    pub lock_file: PathBuf,
    /// The value of `$AVA_PLUGIN_PATH` (injected so tests need not touch the environment).
    pub plugin_path_env: Option<OsString>,
    /// The directory of the `ava` executable, searched last.
    pub exe_dir: Option<PathBuf>,
    /// Threads plugins may use.
    pub threads: u32,
    /// The machine policy's floor, when there is one ([`HostConfig::with_machine_policy`]).
    pub floor: Option<MachinePolicy>,
}

impl Default for HostConfig {
    fn default() -> Self {
        Self {
            search_paths: Vec::new(),
            policy: VettingPolicy::Open,
            lock_file: PathBuf::from("ava-plugins.lock"),
            plugin_path_env: None,
            exe_dir: None,
            threads: std::thread::available_parallelism().map(|n| n.get() as u32).unwrap_or(1),
            floor: None,
        }
    }
}

impl HostConfig {
    /// A config that also searches `$AVA_PLUGIN_PATH` and the running executable's directory.
    pub fn with_process_defaults(mut self) -> Self {
        self.plugin_path_env = std::env::var_os("AVA_PLUGIN_PATH");
        self.exe_dir = std::env::current_exe().ok().and_then(|p| p.parent().map(Path::to_path_buf));
        self
    }

    /// Puts this machine's policy floor under the config ([`MachinePolicy::load`]). A policy
    /// file that exists but cannot be used is an error, never "no floor".
    pub fn with_machine_policy(mut self) -> Result<Self, HostError> {
        self.floor = MachinePolicy::load()?;
        Ok(self)
    }

    /// The policy in force: the config's, raised to the floor's.
    pub fn effective_policy(&self) -> VettingPolicy {
        self.floor.as_ref().map_or(self.policy, |f| self.policy.max(f.policy.0))
    }

    /// The lock file in force: the floor's, else the config's.
    pub fn effective_lock_file(&self) -> &Path {
        self.floor.as_ref().and_then(|f| f.lock_file.as_ref()).map_or(&self.lock_file, |(p, _)| p)
    }

    /// Where the policy in force comes from, for `plugins list` and `config show`.
    pub fn policy_origin(&self) -> String {
        match &self.floor {
            Some(f) if f.policy.0 > self.policy => format!(
                "the machine policy {} (it raises plugins.policy '{}' to '{}')",
                f.policy.1.display(),
                self.policy,
                f.policy.0
            ),
            Some(f) if f.policy.0 == self.policy => {
                format!("plugins.policy and the machine policy {}", f.policy.1.display())
            }
            Some(f) => {
                format!("plugins.policy, above the machine policy {}'s floor '{}'", f.policy.1.display(), f.policy.0)
            }
            None => "plugins.policy; no machine policy".into(),
        }
    }

    /// Where the lock file in force comes from.
    pub fn lock_origin(&self) -> String {
        match self.floor.as_ref().and_then(|f| f.lock_file.as_ref()) {
            Some((_, from)) => format!("the machine policy {}", from.display()),
            None => "plugins.lock_file".into(),
        }
    }
}

/// The status of one plugin or library file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Status {
    /// Compiled into ava.
    Builtin,
    /// Loaded under policy `open`, not pinned.
    Loaded,
    /// Pinned in the lock file and the bytes match.
    Vetted,
    /// Loaded under policy `warn` although not pinned.
    Unvetted,
    /// Pinned, but the bytes differ from the pin: never loaded.
    Modified,
    /// Built against another contract, or not an Ava plugin at all.
    Incompatible,
    /// Refused by the vetting policy (or a duplicate name), not opened.
    Refused,
}

impl Status {
    /// Lowercase name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Builtin => "builtin",
            Self::Loaded => "loaded",
            Self::Vetted => "vetted",
            Self::Unvetted => "unvetted",
            Self::Modified => "modified",
            Self::Incompatible => "incompatible",
            Self::Refused => "refused",
        }
    }
    /// Whether a plugin with this status can be constructed.
    pub fn is_usable(self) -> bool {
        matches!(self, Self::Builtin | Self::Loaded | Self::Vetted | Self::Unvetted)
    }
}

/// Where a plugin comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// Compiled into ava.
    Builtin,
    /// A library file.
    File(PathBuf),
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Builtin => f.write_str("builtin"),
            Self::File(p) => write!(f, "{}", p.display()),
        }
    }
}

/// One row of `ava plugins list`: a plugin, or a library file that could not be loaded.
#[derive(Debug, Clone)]
pub struct Row {
    /// The manifest, when the library was opened.
    pub manifest: Option<Manifest>,
    /// Builtin or file.
    pub source: Source,
    /// Status.
    pub status: Status,
    /// Why, for every status other than builtin/loaded/vetted (and for warnings).
    pub reason: Option<String>,
    /// sha256 of the file, for dynamic plugins.
    pub sha256: Option<String>,
    /// Time spent reading, hashing, opening and checking the file.
    pub load_time: Option<std::time::Duration>,
}

impl Row {
    /// Plugin name, if known.
    pub fn name(&self) -> Option<&str> {
        self.manifest.as_ref().map(|m| m.name.as_str())
    }
    /// Plugin kind, if known.
    pub fn kind(&self) -> Option<PluginKind> {
        self.manifest.as_ref().map(|m| m.kind)
    }
}

#[derive(Clone)]
enum Factory {
    Builtin(&'static Builtin),
    Dynamic(PluginRootRef),
}

#[derive(Clone)]
struct Entry {
    row: usize,
    factory: Factory,
}

/// All plugins known to this process.
pub struct Registry {
    rows: Vec<Row>,
    table: BTreeMap<(PluginKind, String), Entry>,
    duplicates: BTreeMap<(PluginKind, String), (String, String)>,
    warnings: Vec<String>,
    dirs: Vec<SearchDir>,
    lock: LockFile,
    /// The settings in force (the floor applied).
    config: HostConfig,
    /// The settings as asked for, for saying where those in force come from.
    requested: HostConfig,
}

impl Registry {
    /// A registry holding only the built-in plugins.
    pub fn builtins() -> Registry {
        let mut reg = Registry::empty();
        let mut builtins: Vec<&'static Builtin> = builtin::all().collect();
        builtins.sort_by_key(|b| {
            let m = (b.manifest)();
            // Config order (attention, optimizer, ...), then name.
            (PluginKind::ALL.iter().position(|k| *k == m.kind), m.name.to_string())
        });
        for b in builtins {
            let manifest = (b.manifest)();
            reg.add(
                Row {
                    manifest: Some(manifest),
                    source: Source::Builtin,
                    status: Status::Builtin,
                    reason: None,
                    sha256: None,
                    load_time: None,
                },
                Factory::Builtin(b),
            );
        }
        reg
    }

    /// A registry with no plugin at all.
    fn empty() -> Registry {
        Registry {
            rows: Vec::new(),
            table: BTreeMap::new(),
            duplicates: BTreeMap::new(),
            warnings: Vec::new(),
            dirs: Vec::new(),
            lock: LockFile::default(),
            config: HostConfig::default(),
            requested: HostConfig::default(),
        }
    }

    /// Built-ins plus every plugin library found in the configured search paths, vetted
    /// under `config.policy`. Problems with single files become rows with a status and a
    /// reason; only an unreadable lock file fails the whole load.
    pub fn load(config: &HostConfig) -> Result<Registry, HostError> {
        let mut reg = Registry::builtins();
        reg.config = config.clone();
        reg.requested = config.clone();
        // What the rest of the load sees is the floor applied: policy raised, its lock file.
        reg.config.policy = config.effective_policy();
        reg.config.lock_file = config.effective_lock_file().to_path_buf();
        reg.lock = read_lock(&reg.config)?;
        reg.dirs = match config.floor.as_ref().and_then(|f| f.search_paths.as_ref()) {
            Some((paths, _)) => {
                paths.iter().map(|p| SearchDir { path: p.clone(), source: DirSource::Policy }).collect()
            }
            None => search_dirs(&config.search_paths, config.plugin_path_env.clone(), config.exe_dir.clone()),
        };
        for dir in reg.dirs.clone() {
            if dir.source == DirSource::Config && !dir.path.is_dir() {
                reg.warnings.push(format!(
                    "plugins.search_paths: {} is not a directory (build the plugins first with `cargo build --release --workspace`, or fix the path)",
                    dir.path.display()
                ));
                continue;
            }
            for file in library_files(&dir.path)? {
                reg.consider(&file);
            }
        }
        Ok(reg)
    }

    fn add(&mut self, row: Row, factory: Factory) {
        let idx = self.rows.len();
        let key = row.manifest.as_ref().map(|m| (m.kind, m.name.to_string()));
        self.rows.push(row);
        let Some(key) = key else { return };
        if let Some(first) = self.table.get(&key) {
            let first_src = self.rows[first.row].source.to_string();
            let second_src = self.rows[idx].source.to_string();
            self.rows[idx].status = Status::Refused;
            self.rows[idx].reason = Some(format!("{} '{}' is already defined by {first_src}", key.0, key.1));
            self.duplicates.entry(key).or_insert((first_src, second_src));
        } else {
            self.table.insert(key, Entry { row: idx, factory });
        }
    }

    /// Vets one file and, if allowed, opens it.
    fn consider(&mut self, file: &Path) {
        match self.examine(file) {
            // Not an abi_stable library at all (some other shared object): not ours to list.
            Examined::NotALibrary(_) => {}
            Examined::Row(row, Some(root)) if row.status.is_usable() => self.add(*row, Factory::Dynamic(root)),
            Examined::Row(row, _) => self.rows.push(*row),
        }
    }

    /// The row `ava plugins info PATH` shows for a library outside the search paths: vetted
    /// exactly as if it were in one, so it is opened (and its code run) only when the policy
    /// in force would open it; otherwise the row has the file's sha256 and the refusal, and
    /// no manifest.
    pub fn inspect_file(&self, file: &Path) -> Row {
        match self.examine(file) {
            Examined::Row(row, _) => *row,
            Examined::NotALibrary(reason) => Row {
                manifest: None,
                source: Source::File(file.to_path_buf()),
                status: Status::Incompatible,
                reason: Some(format!("not an Ava plugin: {reason}")),
                sha256: None,
                load_time: None,
            },
        }
    }

    /// Reads, vets and (when the verdict allows) opens one file.
    fn examine(&self, file: &Path) -> Examined {
        let started = std::time::Instant::now();
        let candidate = match Candidate::read(file) {
            Ok(c) => c,
            Err(e) => return Examined::Row(Box::new(file_row(file, None, Status::Refused, e.to_string(), None)), None),
        };
        if let Err(reason) = candidate.exports_plugin_header() {
            return Examined::NotALibrary(reason);
        }
        let sha = Some(candidate.sha256.clone());
        let (status, warning) = match vet(&candidate, self.config.policy, &self.lock) {
            Verdict::Refuse(status, reason) => {
                return Examined::Row(Box::new(file_row(file, sha, status, reason, Some(started.elapsed()))), None);
            }
            Verdict::Open { status, warning } => (status, warning),
        };
        let lib = match load::open(&candidate) {
            Ok(lib) => lib,
            Err(e) => {
                let status = match e {
                    HostError::ContractVersion { .. }
                    | HostError::ManifestContract { .. }
                    | HostError::LayoutMismatch { .. }
                    | HostError::NotAPlugin { .. } => Status::Incompatible,
                    _ => Status::Refused,
                };
                return Examined::Row(
                    Box::new(file_row(file, sha, status, e.to_string(), Some(started.elapsed()))),
                    None,
                );
            }
        };
        let pin_problem = self.lock.by_sha(&lib.sha256).and_then(|pin| pin_mismatch(pin, &lib.manifest));
        let (status, reason) = match pin_problem {
            Some(p) => (Status::Refused, Some(p)),
            None => (status, warning),
        };
        let row = Row {
            manifest: Some(lib.manifest.clone()),
            source: Source::File(lib.path.clone()),
            status,
            reason,
            sha256: Some(lib.sha256.clone()),
            load_time: Some(started.elapsed()),
        };
        Examined::Row(Box::new(row), Some(lib.root))
    }

    /// The host settings this registry was built with, the floor applied: `config().policy`
    /// and `config().lock_file` are the ones in force.
    pub fn config(&self) -> &HostConfig {
        &self.config
    }

    /// The host settings as asked for (before the floor): their
    /// [`policy_origin`](HostConfig::policy_origin) says where those in force come from.
    pub fn requested(&self) -> &HostConfig {
        &self.requested
    }

    /// Every row: built-ins first (by kind, name), then files in search order.
    pub fn rows(&self) -> &[Row] {
        &self.rows
    }

    /// Warnings about the load itself that belong to no row (a configured search path that
    /// is not a directory). Per-plugin warnings are the rows' reasons.
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// Everything a command that does not list the rows should warn about: [`warnings`]
    /// plus each plugin loaded without a pin under policy `warn`.
    ///
    /// [`warnings`]: Self::warnings
    pub fn notices(&self) -> Vec<String> {
        let unvetted =
            self.rows.iter().filter(|r| r.status == Status::Unvetted).map(|r| {
                format!("plugin '{}': {}", r.name().unwrap_or("?"), r.reason.as_deref().unwrap_or("not pinned"))
            });
        self.warnings.iter().cloned().chain(unvetted).chain(self.replaced_copies()).collect()
    }

    /// A library that was not opened (modified since it was pinned, not pinned, writable by
    /// others) while a copy of the same plugin from elsewhere in the search is used: whoever
    /// changed that library would otherwise run the other copy without a word.
    fn replaced_copies(&self) -> Vec<String> {
        self.rows
            .iter()
            .filter(|r| r.manifest.is_none() && !r.status.is_usable())
            .filter_map(|r| {
                let Source::File(path) = &r.source else { return None };
                // The pin for its file name says which plugin it was; else its file name.
                let name = path
                    .file_name()
                    .and_then(|f| self.lock.by_file(&f.to_string_lossy()))
                    .map(|pin| pin.name.clone())
                    .or_else(|| plugin_name_of_file(path))?;
                let used = self.table.iter().find(|((_, n), _)| *n == name).map(|(_, e)| &self.rows[e.row])?;
                Some(format!(
                    "plugin '{name}': {} was not opened ({}); '{name}' is loaded from {} instead",
                    path.display(),
                    r.reason.as_deref().unwrap_or(r.status.as_str()),
                    used.source
                ))
            })
            .collect()
    }

    /// The directories that were searched.
    pub fn search_dirs(&self) -> &[SearchDir] {
        &self.dirs
    }

    /// The lock file that was read.
    pub fn lock(&self) -> &LockFile {
        &self.lock
    }

    /// Names of the usable plugins of `kind`, sorted.
    pub fn names(&self, kind: PluginKind) -> Vec<String> {
        self.table.keys().filter(|(k, _)| *k == kind).map(|(_, n)| n.clone()).collect()
    }

    /// The row of plugin (kind, name).
    pub fn row(&self, kind: PluginKind, name: &str) -> Option<&Row> {
        self.table.get(&(kind, name.to_string())).map(|e| &self.rows[e.row])
    }

    /// Rows whose plugin is called `name`, of any kind and status.
    pub fn rows_named(&self, name: &str) -> Vec<&Row> {
        self.rows.iter().filter(|r| r.name() == Some(name)).collect()
    }

    /// Names of the usable plugins of `kind` whose manifests list `device` (they take its
    /// buffers directly), sorted. A name defined twice is left out: it cannot be used.
    pub fn names_on(&self, kind: PluginKind, device: Device) -> Vec<String> {
        self.table
            .iter()
            .filter(|((k, n), _)| *k == kind && !self.duplicates.contains_key(&(kind, n.clone())))
            .filter(|(_, e)| self.rows[e.row].manifest.as_ref().is_some_and(|m| m.runs_on(device)))
            .map(|((_, n), _)| n.clone())
            .collect()
    }

    /// Checks, before training, that the selected plugins take buffers on the run's
    /// `device` (`train.device`) directly: one problem per selected optimizer or attention
    /// kernel whose manifest does not list it, naming the plugin, the devices it lists, the
    /// installed plugins of its kind that do, and the other `train.device` it could use. The
    /// host never copies device buffers to the host for a plugin, so such a run cannot start.
    ///
    /// `selected` is the run's `plugins.<kind>` names, e.g.
    /// `[(PluginKind::Optimizer, "lion"), (PluginKind::Attention, "flash")]`. Checkpoint
    /// policies, offload tiers and memory policies are never handed device buffers, so their
    /// manifests' devices restrict nothing and they are accepted as they are; so is a name
    /// that is unknown or unusable, which [`create`](Self::create) explains when it is built.
    pub fn check_devices(&self, selected: &[(PluginKind, &str)], device: Device) -> Result<(), Vec<String>> {
        let mut problems = Vec::new();
        for &(kind, name) in selected {
            if !matches!(kind, PluginKind::Optimizer | PluginKind::Attention) {
                continue;
            }
            let Some(manifest) = self.row(kind, name).and_then(|r| r.manifest.as_ref()) else { continue };
            if manifest.runs_on(device) {
                continue;
            }
            let listed: Vec<&str> = manifest.devices.iter().map(|d| d.as_str()).collect();
            let runs_on = match manifest.devices.as_slice() {
                [] => "runs on no device".to_string(),
                devices => {
                    let phrases: Vec<&str> = devices.iter().map(|d| device_phrase(*d)).collect();
                    format!("runs on {} only", phrases.join(" and "))
                }
            };
            let listed = if listed.is_empty() { "none".to_string() } else { listed.join(", ") };
            let fallback = [Device::Cpu, Device::Cuda]
                .into_iter()
                .find(|d| *d != device && manifest.runs_on(*d))
                .map(|d| format!("train.device: {}", d.as_str()));
            let others = self.names_on(kind, device);
            let what = format!(
                "{kind} '{name}' {runs_on} (its manifest lists devices: {listed}); train.device: {} needs one that \
                 takes {} buffers",
                device.as_str(),
                buffer_phrase(device)
            );
            problems.push(match (others.is_empty(), fallback) {
                (false, Some(fallback)) => format!("{what}: {}, or {fallback}", others.join(", ")),
                (false, None) => format!("{what}: {}", others.join(", ")),
                (true, Some(fallback)) => {
                    format!("{what}, and none of the installed {} does yet: use {fallback}", plural(kind))
                }
                (true, None) => format!("{what}, and none of the installed {} does yet", plural(kind)),
            });
        }
        if problems.is_empty() { Ok(()) } else { Err(problems) }
    }

    fn entry(&self, kind: PluginKind, name: &str) -> Result<&Entry, HostError> {
        let key = (kind, name.to_string());
        if let Some((first, second)) = self.duplicates.get(&key) {
            return Err(HostError::Duplicate {
                kind,
                name: name.to_string(),
                first: first.clone(),
                second: second.clone(),
            });
        }
        if let Some(e) = self.table.get(&key) {
            return Ok(e);
        }
        if let Some((other, _)) = self.table.keys().find(|(_, n)| n == name) {
            return Err(HostError::WrongKind { name: name.to_string(), wanted: kind, actual: *other });
        }
        if let Some(row) = self.rows.iter().find(|r| r.name() == Some(name) && r.kind() == Some(kind)) {
            return Err(HostError::Unusable {
                kind,
                name: name.to_string(),
                reason: row.reason.clone().unwrap_or_else(|| row.status.as_str().to_string()),
            });
        }
        // A modified library is never opened, so its row has no manifest; the lock file's pin
        // for its file name says which plugin it was.
        if let Some(row) = self.rows.iter().find(|r| {
            r.status == Status::Modified
                && matches!(&r.source, Source::File(p) if p
                    .file_name()
                    .and_then(|f| self.lock.by_file(&f.to_string_lossy()))
                    .is_some_and(|pin| pin.kind == kind.as_str() && pin.name == name))
        }) {
            return Err(HostError::Unusable {
                kind,
                name: name.to_string(),
                reason: row.reason.clone().unwrap_or_else(|| row.status.as_str().to_string()),
            });
        }
        // A library refused before it was opened (not pinned, writable by others, unreadable):
        // its manifest is unknown, but a file named after the plugin is most likely it.
        if let Some(row) = self.rows.iter().find(|r| {
            r.manifest.is_none()
                && !r.status.is_usable()
                && matches!(&r.source, Source::File(p) if plugin_name_of_file(p).as_deref() == Some(name))
        }) {
            return Err(HostError::Unusable {
                kind,
                name: name.to_string(),
                reason: format!(
                    "its library {} was found but {}: {}",
                    row.source,
                    if row.status == Status::Incompatible { "cannot be loaded" } else { "was refused" },
                    row.reason.clone().unwrap_or_else(|| row.status.as_str().to_string())
                ),
            });
        }
        let available = self.names(kind);
        let suggestion = did_you_mean(name, available.iter().map(String::as_str)).map(str::to_string);
        let unopened = self.rows.iter().filter(|r| r.manifest.is_none()).count();
        let note = if unopened > 0 {
            format!("; {unopened} plugin file(s) were not loaded (see `ava plugins list`)")
        } else {
            String::new()
        };
        Err(HostError::Unknown { kind, name: name.to_string(), suggestion, available, note })
    }

    /// Why plugin (kind, name) exists but cannot be used — refused, modified, incompatible —
    /// or `None` when it is usable or unknown.
    pub fn unusable(&self, kind: PluginKind, name: &str) -> Option<String> {
        match self.entry(kind, name) {
            Err(e @ HostError::Unusable { .. }) => Some(e.to_string()),
            _ => None,
        }
    }

    /// Builds plugin (kind, name) with options given as JSON text (`""` for none).
    pub fn create(&self, kind: PluginKind, name: &str, options_json: &str) -> Result<Instance, HostError> {
        let entry = self.entry(kind, name)?;
        let ctx = HostContext { threads: self.config.threads.max(1), contract_version: ava_core::CONTRACT_VERSION };
        let wrap = |error: PluginError| HostError::Plugin {
            plugin: name.to_string(),
            kind,
            source_desc: self.rows[entry.row].source.to_string(),
            error,
        };
        match &entry.factory {
            Factory::Builtin(b) => (b.create)(options_json, &ctx).map_err(wrap),
            Factory::Dynamic(root) => {
                let o = RStr::from(options_json);
                let inst = match kind {
                    PluginKind::Optimizer => (root.new_optimizer())(o, ctx)
                        .into_result()
                        .map(|b| Instance::Optimizer(Box::new(ForeignOptimizer(b)))),
                    PluginKind::Attention => (root.new_attention())(o, ctx)
                        .into_result()
                        .map(|b| Instance::Attention(Arc::new(ForeignAttention(b)))),
                    PluginKind::Checkpoint => (root.new_checkpoint())(o, ctx)
                        .into_result()
                        .map(|b| Instance::Checkpoint(Arc::new(ForeignCheckpoint(b)))),
                    PluginKind::Offload => (root.new_offload())(o, ctx)
                        .into_result()
                        .map(|b| Instance::Offload(Arc::new(ForeignOffload(b)))),
                    PluginKind::Memory => {
                        (root.new_memory())(o, ctx).into_result().map(|b| Instance::Memory(Box::new(ForeignMemory(b))))
                    }
                };
                inst.map_err(wrap)
            }
        }
    }

    /// Checks options for plugin (kind, name) by constructing it; the problems, one per line.
    pub fn check_options(&self, kind: PluginKind, name: &str, options_json: &str) -> Result<(), Vec<String>> {
        match self.create(kind, name, options_json) {
            Ok(_) => Ok(()),
            Err(HostError::Plugin { error, .. }) if error.details.is_empty() => Err(vec![error.message.to_string()]),
            Err(HostError::Plugin { error, .. }) => Err(error.details().map(str::to_string).collect()),
            Err(other) => Err(vec![other.to_string()]),
        }
    }

    /// An optimizer.
    pub fn optimizer(&self, name: &str, options_json: &str) -> Result<Box<dyn Optimizer>, HostError> {
        match self.create(PluginKind::Optimizer, name, options_json)? {
            Instance::Optimizer(o) => Ok(o),
            other => unreachable!("created {:?} for an optimizer", other.kind()),
        }
    }
    /// An attention kernel.
    pub fn attention(&self, name: &str, options_json: &str) -> Result<Arc<dyn AttentionKernel>, HostError> {
        match self.create(PluginKind::Attention, name, options_json)? {
            Instance::Attention(a) => Ok(a),
            other => unreachable!("created {:?} for an attention kernel", other.kind()),
        }
    }
    /// A checkpoint policy.
    pub fn checkpoint(&self, name: &str, options_json: &str) -> Result<Arc<dyn CheckpointPolicy>, HostError> {
        match self.create(PluginKind::Checkpoint, name, options_json)? {
            Instance::Checkpoint(c) => Ok(c),
            other => unreachable!("created {:?} for a checkpoint policy", other.kind()),
        }
    }
    /// An offload tier.
    pub fn offload(&self, name: &str, options_json: &str) -> Result<Arc<dyn OffloadTier>, HostError> {
        match self.create(PluginKind::Offload, name, options_json)? {
            Instance::Offload(o) => Ok(o),
            other => unreachable!("created {:?} for an offload tier", other.kind()),
        }
    }
    /// A memory policy.
    pub fn memory(&self, name: &str, options_json: &str) -> Result<Box<dyn MemoryPolicy>, HostError> {
        match self.create(PluginKind::Memory, name, options_json)? {
            Instance::Memory(m) => Ok(m),
            other => unreachable!("created {:?} for a memory policy", other.kind()),
        }
    }

    /// Finds a library file for `name_or_path`: an existing path, or a plugin name matched
    /// against loaded plugins and then against file names (`lion` → `libava_plugin_lion.so`)
    /// in the search directories — the latter works for files the policy did not open.
    pub fn locate(&self, name_or_path: &str) -> Result<PathBuf, HostError> {
        let as_path = Path::new(name_or_path);
        if as_path.exists()
            || name_or_path.contains(std::path::MAIN_SEPARATOR)
            || name_or_path.ends_with(std::env::consts::DLL_SUFFIX)
        {
            if !as_path.exists() {
                return Err(HostError::Missing { path: as_path.to_path_buf() });
            }
            return Ok(as_path.to_path_buf());
        }
        for row in &self.rows {
            if let (Some(n), Source::File(p)) = (row.name(), &row.source)
                && n == name_or_path
            {
                return Ok(p.clone());
            }
        }
        let stem = name_or_path.replace('-', "_");
        let wanted = [
            format!("{}ava_plugin_{stem}{}", std::env::consts::DLL_PREFIX, std::env::consts::DLL_SUFFIX),
            format!("{}{stem}{}", std::env::consts::DLL_PREFIX, std::env::consts::DLL_SUFFIX),
        ];
        for row in &self.rows {
            if let Source::File(p) = &row.source
                && let Some(f) = p.file_name().and_then(|f| f.to_str())
                && wanted.iter().any(|w| w == f)
            {
                return Ok(p.clone());
            }
        }
        // Near misses among the libraries that are there: plugin names, and names read off
        // file names (`libava_plugin_lion.so` → `lion`) for files that were not opened.
        let library_names: Vec<String> = self
            .rows
            .iter()
            .filter_map(|row| match &row.source {
                Source::File(p) => row.name().map(str::to_string).or_else(|| plugin_name_of_file(p)),
                Source::Builtin => None,
            })
            .collect();
        let suggestion = did_you_mean(name_or_path, library_names.iter().map(String::as_str)).map(str::to_string);
        let builtin = self.rows.iter().find(|r| r.source == Source::Builtin && r.name() == Some(name_or_path));
        Err(HostError::NotFound {
            name: name_or_path.to_string(),
            suggestion,
            builtin: builtin.and_then(Row::kind),
            searched: self.dirs.clone(),
        })
    }
}

/// "runs on ... only": where a device's buffers are.
fn device_phrase(device: Device) -> &'static str {
    match device {
        Device::Cpu => "the CPU",
        Device::Cuda => "CUDA devices",
        Device::Metal => "Metal devices",
    }
}

/// "takes ... buffers".
fn buffer_phrase(device: Device) -> &'static str {
    match device {
        Device::Cpu => "host",
        Device::Cuda => "CUDA",
        Device::Metal => "Metal",
    }
}

/// "none of the installed ... does yet".
fn plural(kind: PluginKind) -> &'static str {
    match kind {
        PluginKind::Optimizer => "optimizers",
        PluginKind::Attention => "attention kernels",
        PluginKind::Checkpoint => "checkpoint policies",
        PluginKind::Offload => "offload tiers",
        PluginKind::Memory => "memory policies",
    }
}

/// The plugin name a library file's name implies: `libava_plugin_sign_sgd.so` → `sign-sgd`.
fn plugin_name_of_file(path: &Path) -> Option<String> {
    let file = path.file_name()?.to_str()?;
    let stem = file.strip_prefix(std::env::consts::DLL_PREFIX)?.strip_suffix(std::env::consts::DLL_SUFFIX)?;
    Some(stem.strip_prefix("ava_plugin_").unwrap_or(stem).replace('_', "-"))
}

/// The lock file in force. Under policy `vetted` it must be out of other users' reach (owner,
/// mode, every directory up to `/`, no symlink); under a floor with trusted keys, signed by
/// one of them — and the bytes verified are the bytes parsed.
fn read_lock(config: &HostConfig) -> Result<LockFile, HostError> {
    let path = &config.lock_file;
    let exists = std::fs::symlink_metadata(path).is_ok();
    if !exists {
        return Ok(LockFile::default());
    }
    let refuse = |why: String| HostError::Lock {
        path: path.clone(),
        reason: format!("{why}; refused under policy 'vetted' (a lock file others can change vets nothing)"),
    };
    if config.policy == VettingPolicy::Vetted
        && let Some(why) = crate::trust::untrusted_reason(path, "the lock file")
    {
        return Err(refuse(why));
    }
    match config.floor.as_ref().filter(|f| f.requires_signature()) {
        None => LockFile::read(path),
        Some(floor) => {
            let bytes = ava_fs::bounded::read(path, ava_fs::bounded::limits::LOCK).map_err(|e| match e {
                ava_fs::bounded::ReadError::Io { source, .. } => crate::lock::unreadable(path, &source),
                e => {
                    // The error's text starts with the path, which the lock error also shows.
                    let full = e.to_string();
                    let reason = full.strip_prefix(&format!("{}: ", path.display())).unwrap_or(&full).to_string();
                    HostError::Lock { path: path.clone(), reason }
                }
            })?;
            crate::sign::check_signed(path, &bytes, &floor.trusted_keys)?;
            let text = String::from_utf8(bytes)
                .map_err(|_| HostError::Lock { path: path.clone(), reason: "not UTF-8 text".into() })?;
            LockFile::parse(path, &text)
        }
    }
}

/// What [`Registry::examine`] made of one file.
enum Examined {
    /// Not an abi_stable library (why): not listed.
    NotALibrary(String),
    /// Its row, and its root module when it was opened.
    Row(Box<Row>, Option<PluginRootRef>),
}

/// The row of a library file that was not opened or could not be used.
fn file_row(file: &Path, sha: Option<String>, status: Status, reason: String, t: Option<std::time::Duration>) -> Row {
    Row {
        manifest: None,
        source: Source::File(file.to_path_buf()),
        status,
        reason: Some(reason),
        sha256: sha,
        load_time: t,
    }
}

/// The outcome of vetting one file, decided from its bytes alone.
enum Verdict {
    Refuse(Status, String),
    Open { status: Status, warning: Option<String> },
}

fn vet(c: &Candidate, policy: VettingPolicy, lock: &LockFile) -> Verdict {
    let pinned = lock.by_sha(&c.sha256);
    if pinned.is_none()
        && let Some(pin) = lock.by_file(&c.file_name())
    {
        return Verdict::Refuse(
            Status::Modified,
            format!(
                "pinned as {} '{}' {} with sha256 {}, but the file's sha256 is {}; if the change is intended, re-vet it with `ava plugins vet {}`",
                pin.kind,
                pin.name,
                pin.version,
                pin.sha256,
                c.sha256,
                c.path.display()
            ),
        );
    }
    match policy {
        VettingPolicy::Open => {
            Verdict::Open { status: if pinned.is_some() { Status::Vetted } else { Status::Loaded }, warning: None }
        }
        VettingPolicy::Warn => match pinned {
            Some(_) => Verdict::Open { status: Status::Vetted, warning: None },
            None => Verdict::Open {
                status: Status::Unvetted,
                warning: Some(format!(
                    "{} is not pinned in the lock file; policy 'vetted' would refuse it (pin it with `ava plugins vet {}`)",
                    c.path.display(),
                    c.path.display()
                )),
            },
        },
        VettingPolicy::Vetted => {
            if c.symlink {
                return Verdict::Refuse(
                    Status::Refused,
                    "symbolic links are refused under policy 'vetted' (the link's target can change after vetting); put the file itself in the search path".into(),
                );
            }
            if let Some(why) = &c.untrusted {
                return Verdict::Refuse(Status::Refused, format!("{why}; refused under policy 'vetted'"));
            }
            match pinned {
                Some(_) => Verdict::Open { status: Status::Vetted, warning: None },
                None => Verdict::Refuse(
                    Status::Refused,
                    format!(
                        "not pinned in the lock file (sha256 {}); policy 'vetted' opens only pinned plugins: review it, then pin it with `ava plugins vet {}`",
                        c.sha256,
                        c.path.display()
                    ),
                ),
            }
        }
    }
}

fn pin_mismatch(pin: &Pin, m: &Manifest) -> Option<String> {
    (pin.name != m.name.as_str() || pin.version != m.version.as_str() || pin.kind != m.kind.as_str()).then(|| {
        format!(
            "the lock file pins these bytes as {} '{}' {}, but the library says {} '{}' {}; re-vet it",
            pin.kind, pin.name, pin.version, m.kind, m.name, m.version
        )
    })
}

/// Opens one library for `ava plugins vet` / `info PATH`, with the checks that do not depend
/// on a policy (modified pins are reported, not refused: vetting them is the fix).
pub fn open_file(path: &Path) -> Result<Library, HostError> {
    let candidate = Candidate::read(path)?;
    load::open(&candidate)
}

/// Pins the library at `path` into the lock file at `lock_path`. Returns the new pin and the
/// pins it replaced.
pub fn vet_file(path: &Path, lock_path: &Path) -> Result<(Pin, Vec<Pin>), HostError> {
    let lib = open_file(path)?;
    let mut lock = LockFile::read(lock_path)?;
    let pin = Pin {
        name: lib.manifest.name.to_string(),
        kind: lib.manifest.kind.as_str().to_string(),
        version: lib.manifest.version.to_string(),
        sha256: lib.sha256.clone(),
        file: path.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default(),
    };
    let replaced = lock.upsert(pin.clone());
    lock.write(lock_path)?;
    Ok((pin, replaced))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtins_are_registered_once_each() {
        let reg = Registry::builtins();
        for (kind, name) in [
            (PluginKind::Attention, "standard"),
            (PluginKind::Optimizer, "adamw"),
            (PluginKind::Optimizer, "sgd"),
            (PluginKind::Checkpoint, "none"),
            (PluginKind::Checkpoint, "full"),
            (PluginKind::Offload, "ram"),
            (PluginKind::Memory, "thresholds"),
        ] {
            let row = reg.row(kind, name).unwrap_or_else(|| panic!("missing builtin {kind} {name}"));
            assert_eq!(row.status, Status::Builtin);
        }
    }

    #[test]
    fn unknown_and_wrong_kind_errors() {
        let reg = Registry::builtins();
        let e = reg.create(PluginKind::Optimizer, "adamww", "").unwrap_err().to_string();
        assert_eq!(e, "unknown optimizer 'adamww' (did you mean 'adamw'?); installed: adamw, sgd");
        let e = reg.create(PluginKind::Optimizer, "standard", "").unwrap_err().to_string();
        assert_eq!(e, "'standard' is an attention kernel, not an optimizer; set it under plugins.attention instead");
    }

    /// `locate`'s not-found error says what was looked for, where (each directory and why it
    /// is searched, or that there are none), and how to fix it.
    #[test]
    fn locate_says_what_where_and_how_to_fix() {
        let file = format!("{}ava_plugin_sign_sgd{}", std::env::consts::DLL_PREFIX, std::env::consts::DLL_SUFFIX);
        let e = Registry::builtins().locate("sign-sgd").unwrap_err();
        assert!(matches!(&e, HostError::NotFound { name, searched, .. } if name == "sign-sgd" && searched.is_empty()));
        assert_eq!(
            e.to_string(),
            format!(
                "no plugin library named 'sign-sgd' (no search paths: plugins.search_paths and $AVA_PLUGIN_PATH are \
                 empty and the ava executable's directory is unknown); `ava plugins list` shows the plugins found. \
                 To use a library elsewhere, give its path (e.g. ./{file}) or add its directory to \
                 plugins.search_paths or $AVA_PLUGIN_PATH"
            )
        );

        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let config = HostConfig {
            search_paths: vec![a.path().to_path_buf()],
            plugin_path_env: Some(b.path().as_os_str().to_owned()),
            ..HostConfig::default()
        };
        let e = Registry::load(&config).unwrap().locate("sign-sgd").unwrap_err().to_string();
        let want = format!(
            "no plugin library named 'sign-sgd' in the search paths: {} (plugins.search_paths), {} ($AVA_PLUGIN_PATH); ",
            a.path().display(),
            b.path().display()
        );
        assert!(e.starts_with(&want), "{e}");

        // A built-in's name is not a library's, and the error says so.
        let e = Registry::builtins().locate("adamw").unwrap_err().to_string();
        assert_eq!(e, "'adamw' is a built-in optimizer, compiled into ava: it has no library file");
        assert_eq!(plugin_name_of_file(Path::new(&file)).as_deref(), Some("sign-sgd"));
    }

    /// A CUDA run refuses a CPU-only built-in optimizer or attention kernel by name, says
    /// that no installed one of its kind takes CUDA buffers, and offers train.device: cpu (in
    /// a default build every built-in is CPU-only; built-ins whose manifests list cuda pass).
    /// Checkpoint policies, offload tiers, memory policies, and names the registry does not
    /// know, pass.
    #[test]
    fn a_cuda_run_refuses_cpu_only_builtins_by_name() {
        let reg = Registry::builtins();
        let selected = [
            (PluginKind::Attention, "standard"),
            (PluginKind::Optimizer, "adamw"),
            (PluginKind::Checkpoint, "full"),
            (PluginKind::Offload, "ram"),
            (PluginKind::Memory, "thresholds"),
        ];
        assert_eq!(reg.check_devices(&selected, Device::Cpu), Ok(()));
        let standard = "attention 'standard' runs on the CPU only (its manifest lists devices: cpu); train.device: \
                        cuda needs one that takes CUDA buffers, and none of the installed attention kernels does yet: \
                        use train.device: cpu";
        let adamw = "optimizer 'adamw' runs on the CPU only (its manifest lists devices: cpu); train.device: cuda \
                     needs one that takes CUDA buffers, and none of the installed optimizers does yet: use \
                     train.device: cpu";
        let on_cuda = |kind, name| reg.row(kind, name).unwrap().manifest.as_ref().unwrap().runs_on(Device::Cuda);
        let want: Vec<&str> = [(PluginKind::Attention, "standard", standard), (PluginKind::Optimizer, "adamw", adamw)]
            .into_iter()
            .filter(|(kind, name, _)| !on_cuda(*kind, name))
            .map(|(_, _, text)| text)
            .collect();
        let got = reg.check_devices(&selected, Device::Cuda);
        if want.is_empty() {
            assert_eq!(got, Ok(()));
        } else {
            assert_eq!(got.unwrap_err(), want);
        }
        if !on_cuda(PluginKind::Optimizer, "adamw") && !on_cuda(PluginKind::Optimizer, "sgd") {
            assert!(reg.names_on(PluginKind::Optimizer, Device::Cuda).is_empty());
        }
        assert_eq!(reg.names_on(PluginKind::Optimizer, Device::Cpu), ["adamw", "sgd"]);
        // Unknown names are left to `create`, which explains them.
        assert_eq!(reg.check_devices(&[(PluginKind::Optimizer, "nope")], Device::Cuda), Ok(()));
    }

    /// A row as a loaded library would have it, for plugins no build has yet.
    fn add_library(reg: &mut Registry, manifest: Manifest) {
        static NEVER_BUILT: Builtin = Builtin {
            manifest: || Manifest::new("never-built", PluginKind::Optimizer, "0.0.0", "test row"),
            create: |_, _| Err(PluginError::unsupported("test row")),
        };
        let file = format!("/plugins/{}.so", manifest.name);
        let row = Row {
            manifest: Some(manifest),
            source: Source::File(PathBuf::from(file)),
            status: Status::Loaded,
            reason: None,
            sha256: None,
            load_time: None,
        };
        reg.add(row, Factory::Builtin(&NEVER_BUILT));
    }

    /// With plugins whose manifests list cuda installed, the refusal names them; a plugin
    /// that lists cuda passes; a name defined twice is never offered.
    #[test]
    fn a_device_refusal_names_the_plugins_that_take_its_buffers() {
        // No built-ins: their devices depend on ava-plugins' features.
        let mut reg = Registry::empty();
        let m = |name: &str, kind: PluginKind, devices: &[Device]| {
            Manifest::new(name, kind, "0.2.0", "test").devices(devices)
        };
        add_library(&mut reg, m("sdpa", PluginKind::Attention, &[Device::Cpu]));
        add_library(&mut reg, m("lion", PluginKind::Optimizer, &[Device::Cpu]));
        add_library(&mut reg, m("sign-sgd-gpu", PluginKind::Optimizer, &[Device::Cpu, Device::Cuda]));
        add_library(&mut reg, m("adam-cuda", PluginKind::Optimizer, &[Device::Cuda]));
        add_library(&mut reg, m("flash-cuda", PluginKind::Attention, &[Device::Cuda]));
        add_library(&mut reg, m("twice", PluginKind::Optimizer, &[Device::Cuda]));
        add_library(&mut reg, m("twice", PluginKind::Optimizer, &[Device::Cuda]));
        assert_eq!(reg.names_on(PluginKind::Optimizer, Device::Cuda), ["adam-cuda", "sign-sgd-gpu"]);

        let cuda_ok = [(PluginKind::Attention, "flash-cuda"), (PluginKind::Optimizer, "sign-sgd-gpu")];
        assert_eq!(reg.check_devices(&cuda_ok, Device::Cuda), Ok(()));
        assert_eq!(
            reg.check_devices(&[(PluginKind::Attention, "sdpa"), (PluginKind::Optimizer, "lion")], Device::Cuda)
                .unwrap_err(),
            [
                "attention 'sdpa' runs on the CPU only (its manifest lists devices: cpu); train.device: cuda needs one \
                 that takes CUDA buffers: flash-cuda, or train.device: cpu",
                "optimizer 'lion' runs on the CPU only (its manifest lists devices: cpu); train.device: cuda needs one \
                 that takes CUDA buffers: adam-cuda, sign-sgd-gpu, or train.device: cpu",
            ]
        );
        // The other way round: a CUDA-only plugin on a CPU run.
        assert_eq!(
            reg.check_devices(
                &[(PluginKind::Optimizer, "adam-cuda"), (PluginKind::Optimizer, "sign-sgd-gpu")],
                Device::Cpu
            )
            .unwrap_err(),
            ["optimizer 'adam-cuda' runs on CUDA devices only (its manifest lists devices: cuda); train.device: cpu \
                 needs one that takes host buffers: lion, sign-sgd-gpu, or train.device: cuda"]
        );
    }
}
