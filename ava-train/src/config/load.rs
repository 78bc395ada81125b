//! Loading: the layers (built-in defaults < file < `AVA__*` environment < `--set`), each
//! turned into an origin-tracked tree and merged, then validated as a whole.

use std::fs;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::error::ConfigError;
use super::format::{self, Format};
use super::schema::{Config, DEFAULT_CONFIG_YAML, PluginsConfig, ROOT_KIND};
use super::tree::{Node, Origin};
use super::validate::{self, ConfigProblem, PluginCatalog};

/// The prefix of configuration environment variables: `AVA__PLUGINS__POLICY=vetted` sets
/// `plugins.policy` (levels are separated by a double underscore; names are lowercased).
pub const ENV_PREFIX: &str = "AVA__";

/// Builds the effective configuration from its layers.
///
/// ```
/// use ava_train::config::{ConfigLoader, VettingPolicy};
///
/// let loaded = ConfigLoader::new()
///     .env([("AVA__PLUGINS__POLICY", "warn")])
///     .set("plugins.optimizer={name: lion, betas: [0.9, 0.98]}")
///     .load()
///     .unwrap();
/// assert_eq!(loaded.config().plugins.policy, VettingPolicy::Warn);
/// assert_eq!(loaded.config().plugins.optimizer.name, "lion");
/// ```
#[derive(Default)]
pub struct ConfigLoader<'a> {
    file: Option<PathBuf>,
    env: Vec<(String, String)>,
    sets: Vec<String>,
    catalog: Option<&'a dyn PluginCatalog>,
}

impl<'a> ConfigLoader<'a> {
    /// A loader of the built-in defaults only: no file, no environment, no `--set`.
    pub fn new() -> Self {
        Self::default()
    }

    /// Reads this config file (YAML `.yaml`/`.yml` or TOML `.toml`) over the defaults.
    pub fn file(mut self, path: impl Into<PathBuf>) -> Self {
        self.file = Some(path.into());
        self
    }

    /// Takes environment variables from `vars` (those starting with [`ENV_PREFIX`]; the rest
    /// are ignored). Tests pass a list; the `ava` binary passes the process environment
    /// ([`process_env`](Self::process_env)).
    pub fn env<I, K, V>(mut self, vars: I) -> Self
    where
        I: IntoIterator<Item = (K, V)>,
        K: Into<String>,
        V: Into<String>,
    {
        for (key, value) in vars {
            let key = key.into();
            if key.starts_with(ENV_PREFIX) {
                self.env.push((key, value.into()));
            }
        }
        self
    }

    /// Takes the `AVA__*` variables of this process's environment.
    pub fn process_env(self) -> Self {
        let vars = std::env::vars_os()
            .map(|(k, v)| (k.to_string_lossy().into_owned(), v.to_string_lossy().into_owned()))
            .collect::<Vec<_>>();
        self.env(vars)
    }

    /// Adds one `--set section.key=value` override (the value is read as YAML). Later ones
    /// win over earlier ones.
    pub fn set(mut self, arg: impl Into<String>) -> Self {
        self.sets.push(arg.into());
        self
    }

    /// Adds several `--set` overrides, in order.
    pub fn sets<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.sets.extend(args.into_iter().map(Into::into));
        self
    }

    /// Also checks the plugin selections against `catalog` while loading (installed names,
    /// options). Without one, [`LoadedConfig::check_plugins`] does it later — the usual
    /// order, since finding the plugins needs `plugins.search_paths` from the config.
    pub fn catalog(mut self, catalog: &'a dyn PluginCatalog) -> Self {
        self.catalog = Some(catalog);
        self
    }

    /// Reads and merges every layer and validates the result. A missing or unreadable file,
    /// a syntax error and a malformed `--set` fail at once; everything else is collected into
    /// one [`ConfigError::Invalid`] listing every problem.
    pub fn load(&self) -> Result<LoadedConfig, ConfigError> {
        let mut layers = self.layers()?;
        validate::check_tree(&layers.tree, self.catalog, &mut layers.problems);
        self.finish(layers)
    }

    /// Like [`load`](Self::load), and also checks every plugin selection against the catalog
    /// that `catalog_for` builds from the host settings (`search_paths`, `policy`,
    /// `lock_file`). Those settings are taken from the configuration where they are valid and
    /// from the defaults where they are not, so structural and plugin problems come in one
    /// report even when the configuration is broken. The outer error is `catalog_for`'s.
    pub fn load_checked<C: PluginCatalog, E>(
        &self,
        catalog_for: impl FnOnce(&PluginsConfig) -> Result<C, E>,
    ) -> Result<Result<(LoadedConfig, C), ConfigError>, E> {
        let mut layers = match self.layers() {
            Ok(l) => l,
            Err(e) => return Ok(Err(e)),
        };
        let mut structural = Vec::new();
        validate::check_tree(&layers.tree, None, &mut structural);
        let host = host_settings(&layers.tree, &structural);
        let catalog = catalog_for(&host)?;
        validate::check_tree(&layers.tree, Some(&catalog), &mut layers.problems);
        model_problems(&layers.tree, &mut layers.problems);
        Ok(self.finish(layers).map(|loaded| (loaded, catalog)))
    }

    /// Merges the layers; problems found on the way (bad environment values) are kept.
    fn layers(&self) -> Result<Layers, ConfigError> {
        let sets = self.sets.iter().map(|arg| parse_set(arg)).collect::<Result<Vec<_>, _>>()?;
        let mut problems = Vec::new();
        let mut tree = defaults_tree();

        let mut file_paths = Vec::new();
        if let Some(path) = &self.file {
            let layer = read_file(path)?;
            file_paths = layer.paths();
            tree.merge(layer, Some(&ROOT_KIND), 0);
        }

        let mut env = self.env.clone();
        // Sorted, so that AVA__PLUGINS__MEMORY comes before AVA__PLUGINS__MEMORY__CRITICAL.
        env.sort();
        for (var, text) in &env {
            let origin = Origin::Env(var.clone());
            let path: Vec<String> = var[ENV_PREFIX.len()..].split("__").map(str::to_ascii_lowercase).collect();
            if path.iter().any(String::is_empty) {
                problems.push(ConfigProblem::new(
                    "",
                    format!("malformed variable name: levels are separated by exactly two underscores, as in {ENV_PREFIX}PLUGINS__POLICY"),
                    Some(&origin),
                ));
                continue;
            }
            match format::parse_yaml_value(text) {
                Ok(value) => apply(&mut tree, &path, value, &origin),
                Err(message) => problems.push(ConfigProblem::new(path.join("."), message, Some(&origin))),
            }
        }

        for (arg, path, value) in sets {
            apply(&mut tree, &path, value, &Origin::Set(arg));
        }
        Ok(Layers { tree, problems, file_paths, env })
    }

    /// Orders the problems and, if there are none, builds the typed configuration.
    fn finish(&self, layers: Layers) -> Result<LoadedConfig, ConfigError> {
        let Layers { tree, mut problems, file_paths, env } = layers;
        // Report in the order of the layers, and within a layer in the order written.
        problems.sort_by_key(|p| match &p.origin {
            None | Some(Origin::Default) => (0, 0),
            Some(Origin::File(_)) => (1, position_in(&file_paths, &p.path)),
            Some(Origin::Env(var)) => (2, env.iter().position(|(v, _)| v == var).unwrap_or(usize::MAX)),
            Some(Origin::Set(arg)) => (3, self.sets.iter().position(|a| a == arg).unwrap_or(usize::MAX)),
            Some(Origin::ModelFrom(_)) => (4, 0),
        });
        if !problems.is_empty() {
            return Err(ConfigError::Invalid { file: self.file.clone(), problems });
        }
        let config = serde_json::from_value::<Config>(tree.to_value()).map_err(|e| ConfigError::Invalid {
            file: self.file.clone(),
            problems: vec![ConfigProblem::new("", format!("the configuration does not fit its schema: {e}"), None)],
        })?;
        Ok(LoadedConfig { config, tree, file: self.file.clone() })
    }
}

/// The model's shape, checked as training checks it (heads against the hidden size and the
/// key/value heads, sizes that are zero, the parameter count), or `model.from`'s config.json
/// read: every problem, each as a problem of `model` from where its values came. Skipped when
/// the section has problems of its own already (a value of the wrong type).
fn model_problems(tree: &Node, problems: &mut Vec<ConfigProblem>) {
    // The shape is checked on the keys the section knows: an unknown key (a typo) is left out
    // of it, not a reason to say nothing of the shape; a known key's bad value is.
    let in_model: Vec<&ConfigProblem> =
        problems.iter().filter(|p| p.path == "model" || p.path.starts_with("model.")).collect();
    let unknown = |p: &&ConfigProblem| p.message.starts_with("unknown key") && p.path.starts_with("model.");
    if !in_model.iter().all(unknown) {
        return;
    }
    let Some(model) = tree.get(&["model"]) else { return };
    let mut value = model.to_value();
    for p in in_model {
        let keys: Vec<&str> = p.path.split('.').skip(1).collect();
        if let Some((last, parents)) = keys.split_last() {
            let parent = parents.iter().try_fold(&mut value, |v, k| v.get_mut(*k));
            if let Some(serde_json::Value::Object(map)) = parent {
                map.remove(*last);
            }
        }
    }
    let Ok(config) = serde_json::from_value::<super::sections::ModelConfig>(value) else { return };
    // The origin of the section's values: the latest layer that set one of them.
    let origin = tree
        .leaves()
        .into_iter()
        .filter(|(path, ..)| path.starts_with("model."))
        .map(|(.., origin)| origin)
        .max_by_key(|o| match o {
            Origin::Default => 0,
            Origin::File(_) => 1,
            Origin::Env(_) => 2,
            Origin::Set(_) => 3,
            Origin::ModelFrom(_) => 4,
        });
    let found = match &config.from {
        Some(dir) => crate::model::read_hf_config(&dir.join("config.json")).map(|_| ()),
        None => crate::model::ModelSpec::from_config(&config).map(|_| ()),
    };
    match found {
        Ok(()) => {}
        Err(crate::model::ModelError::Spec { problems: found, .. }) => {
            problems.extend(found.into_iter().map(|m| ConfigProblem::new("model", m, origin.as_ref())));
        }
        Err(e) => problems.push(ConfigProblem::new("model.from", e.to_string(), origin.as_ref())),
    }
}

/// The merged layers before validation.
struct Layers {
    tree: Node,
    problems: Vec<ConfigProblem>,
    file_paths: Vec<String>,
    env: Vec<(String, String)>,
}

/// The host settings of a possibly broken configuration: each of `search_paths`, `policy`
/// and `lock_file` from the tree when no problem touches it, from the defaults otherwise.
fn host_settings(tree: &Node, problems: &[ConfigProblem]) -> PluginsConfig {
    let mut host = Config::default().plugins;
    let clean = |key: &str| {
        let path = format!("plugins.{key}");
        !problems.iter().any(|p| {
            p.path == path || p.path.starts_with(&format!("{path}.")) || p.path.starts_with(&format!("{path}["))
        })
    };
    let value = |key: &str| tree.get(&["plugins", key]).map(Node::to_value);
    if clean("search_paths")
        && let Some(Ok(v)) = value("search_paths").map(serde_json::from_value)
    {
        host.search_paths = v;
    }
    if clean("policy")
        && let Some(Ok(v)) = value("policy").map(serde_json::from_value)
    {
        host.policy = v;
    }
    if clean("lock_file")
        && let Some(Ok(v)) = value("lock_file").map(serde_json::from_value)
    {
        host.lock_file = v;
    }
    host
}

fn apply(tree: &mut Node, path: &[String], value: Value, origin: &Origin) {
    let layer = Node::nested(path, Node::from_value(value, origin), origin);
    tree.merge(layer, Some(&ROOT_KIND), path.len());
}

/// Where the key `path` (or the closest table holding it) is in a file's key order.
fn position_in(file_paths: &[String], path: &str) -> usize {
    let mut path = path.split('[').next().unwrap_or(path);
    loop {
        if let Some(i) = file_paths.iter().position(|p| p == path) {
            return i;
        }
        match path.rsplit_once('.') {
            Some((parent, _)) => path = parent,
            None => return usize::MAX,
        }
    }
}

/// The built-in defaults as a tree.
pub(crate) fn defaults_tree() -> Node {
    let table =
        format::parse_document(Format::Yaml, DEFAULT_CONFIG_YAML).expect("the embedded default config is valid YAML");
    Node::from_value(Value::Object(table), &Origin::Default)
}

/// Splits `section.key=value` into the key path and the value read as YAML.
fn parse_set(arg: &str) -> Result<(String, Vec<String>, Value), ConfigError> {
    let bad = |reason: String| ConfigError::BadSet { arg: arg.to_string(), reason };
    let Some((key, text)) = arg.split_once('=') else {
        return Err(bad("expected section.key=value, e.g. --set plugins.optimizer=lion".into()));
    };
    let key = key.trim();
    if key.is_empty() {
        return Err(bad(
            "the key before '=' is empty; expected section.key=value, e.g. --set plugins.optimizer=lion".into()
        ));
    }
    let path: Vec<String> = key.split('.').map(|part| part.trim().to_string()).collect();
    if path.iter().any(String::is_empty) {
        return Err(bad(format!(
            "the key '{key}' has an empty part; levels are separated by single dots, e.g. plugins.memory.critical"
        )));
    }
    let value = format::parse_yaml_value_at(text.trim(), key).map_err(bad)?;
    Ok((arg.to_string(), path, value))
}

/// Reads a config file into a tree (all of it from [`Origin::File`]).
pub(crate) fn read_file(path: &Path) -> Result<Node, ConfigError> {
    let text = read_config_text(path)?
        .ok_or_else(|| ConfigError::NotFound { path: path.to_path_buf(), suggestion: similar_file(path) })?;
    let value = parse_file_text(path, &text)?;
    Ok(Node::from_value(value, &Origin::File(path.to_path_buf())))
}

/// The text of the config file `path`, `None` when there is none. Bounded: a FIFO, a device
/// or a file over [`limits::CONFIG`](ava_fs::bounded::limits::CONFIG) is refused
/// instead of hanging or filling memory.
pub(crate) fn read_config_text(path: &Path) -> Result<Option<String>, ConfigError> {
    use ava_fs::bounded::{self, ReadError};
    match bounded::read_to_string(path, bounded::limits::CONFIG) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.is_missing() => Ok(None),
        Err(ReadError::Io { source, .. }) => Err(ConfigError::Read { path: path.to_path_buf(), source }),
        Err(e) => {
            let full = e.to_string();
            let message = full.strip_prefix(&format!("{}: ", path.display())).map(str::to_string).unwrap_or(full);
            Err(ConfigError::Refused { path: path.to_path_buf(), line: None, message })
        }
    }
}

/// Parses the text of the config file `path` (format from its extension).
pub(crate) fn parse_file_text(path: &Path, text: &str) -> Result<Value, ConfigError> {
    let format = Format::of(path).ok_or_else(|| ConfigError::UnknownFormat { path: path.to_path_buf() })?;
    format::parse_document(format, text).map(Value::Object).map_err(|e| {
        if e.refused {
            ConfigError::Refused { path: path.to_path_buf(), line: e.line, message: e.message }
        } else {
            ConfigError::Syntax {
                path: path.to_path_buf(),
                format: format.name(),
                line: e.line,
                column: e.column,
                message: e.message,
            }
        }
    })
}

/// A config file of a similar name next to the missing `path`.
fn similar_file(path: &Path) -> Option<PathBuf> {
    let name = path.file_name()?.to_str()?;
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    let names: Vec<String> = fs::read_dir(dir)
        .ok()?
        .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
        .filter(|n| Format::of(Path::new(n)).is_some())
        .collect();
    let mut names_ref: Vec<&str> = names.iter().map(String::as_str).collect();
    names_ref.sort();
    let near = ava_core::options::did_you_mean(name, names_ref)?;
    Some(path.with_file_name(near))
}

/// The effective configuration with the origin of every value.
#[derive(Debug, Clone)]
pub struct LoadedConfig {
    config: Config,
    pub(crate) tree: Node,
    file: Option<PathBuf>,
}

impl LoadedConfig {
    /// The typed configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// With `model.from` set: the `model` keys its folder's `config.json` decides (the sizes,
    /// θ, ε, tied embeddings, experts) set to the folder's values, each from that file, since
    /// the run takes them from there and ignores the config's. Unchanged without `model.from`.
    pub fn with_model_from(mut self) -> Result<Self, crate::model::ModelError> {
        let Some(dir) = self.config.model.from.clone() else { return Ok(self) };
        let path = dir.join("config.json");
        let spec = crate::model::read_hf_config(&path)?.spec;
        let origin = Origin::ModelFrom(path);
        let moe = spec.moe.map_or((0, self.config.model.moe.top_k), |m| (m.experts, m.top_k));
        let values: [(&[&str], Value); 11] = [
            (&["model", "vocab_size"], spec.vocab.into()),
            (&["model", "hidden_size"], spec.hidden.into()),
            (&["model", "num_layers"], spec.layers.into()),
            (&["model", "num_heads"], spec.heads.into()),
            (&["model", "num_kv_heads"], spec.kv_heads.into()),
            (&["model", "intermediate_size"], spec.ffn.into()),
            (&["model", "rope_theta"], spec.rope.theta.into()),
            (&["model", "rms_norm_eps"], spec.eps.into()),
            (&["model", "tie_embeddings"], spec.tie_embeddings.into()),
            (&["model", "moe", "num_experts"], moe.0.into()),
            (&["model", "moe", "top_k"], moe.1.into()),
        ];
        for (path, value) in values {
            let path: Vec<String> = path.iter().map(|s| s.to_string()).collect();
            apply(&mut self.tree, &path, value, &origin);
        }
        if let Ok(config) = serde_json::from_value::<Config>(self.tree.to_value()) {
            self.config = config;
        }
        Ok(self)
    }

    /// The typed configuration, origins dropped.
    pub fn into_config(self) -> Config {
        self.config
    }

    /// The config file that was read, if any.
    pub fn file(&self) -> Option<&Path> {
        self.file.as_deref()
    }

    /// Where the value at a dotted key path came from (`plugins.optimizer`,
    /// `plugins.memory.critical`); for a table, the layer that made it a table.
    pub fn origin(&self, path: &str) -> Option<&Origin> {
        let keys: Vec<&str> = path.split('.').collect();
        self.tree.get(&keys).map(Node::origin)
    }

    /// Checks every plugin selection against `catalog`: the plugin must be installed and its
    /// options valid. Each problem names the key path and where the value came from.
    pub fn validate_plugins(&self, catalog: &dyn PluginCatalog) -> Vec<ConfigProblem> {
        validate::check_tree_plugins(&self.tree, catalog)
    }

    /// [`validate_plugins`](Self::validate_plugins) as a `Result`: every problem in one
    /// [`ConfigError::Invalid`].
    pub fn check_plugins(&self, catalog: &dyn PluginCatalog) -> Result<(), ConfigError> {
        let problems = self.validate_plugins(catalog);
        if problems.is_empty() { Ok(()) } else { Err(ConfigError::Invalid { file: self.file.clone(), problems }) }
    }
}
