//! Checking the merged tree against the schema, and plugin selections against the installed
//! plugins. Every problem is collected (nothing stops at the first), each with the full key
//! path and the layer the value came from.

use std::fmt;

use ava_core::PluginKind;
use ava_core::options::{did_you_mean, edit_distance};
use serde_json::Value;

use super::format::type_phrase;
use super::schema::{self, Config, Field, Kind, MISSING_NAME, PluginSelection, SELECTION_EXPECTED};
use super::sections::{Mix, Tiers};
use super::tree::{Node, Origin};

/// What validation needs to know about the installed plugins; the plugin registry
/// implements it.
pub trait PluginCatalog {
    /// The names of the plugins of `kind` that can be selected.
    fn names(&self, kind: PluginKind) -> Vec<String>;

    /// Checks the options of plugin `name` (a JSON object as text, `{}` for none). Each
    /// problem is a line such as `option 'critical': 1.5 must be in (0, 1]` or
    /// `unknown option 'foo' (did you mean 'bar'?)`; those two shapes are reported at the key
    /// path of the option (`plugins.memory.critical`), anything else at the selection.
    fn check_options(&self, kind: PluginKind, name: &str, options_json: &str) -> Result<(), Vec<String>>;

    /// Why plugin `name` of `kind`, though not among [`names`](Self::names), exists and
    /// cannot be used (refused by the vetting policy, modified, incompatible), if it does.
    fn unusable(&self, _kind: PluginKind, _name: &str) -> Option<String> {
        None
    }
}

/// One problem found in the configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigProblem {
    /// The full key path, e.g. `plugins.optimizer` (empty when the problem is about no key).
    pub path: String,
    /// What is wrong, e.g. `unknown key (did you mean 'plugins.optimizer'?)`.
    pub message: String,
    /// Where the offending value came from, when known.
    pub origin: Option<Origin>,
}

impl ConfigProblem {
    pub(crate) fn new(path: impl Into<String>, message: impl Into<String>, origin: Option<&Origin>) -> Self {
        Self { path: path.into(), message: message.into(), origin: origin.cloned() }
    }
}

impl fmt::Display for ConfigProblem {
    /// `plugins.policy: 'vetd' is not one of open, warn, vetted (did you mean 'vetted'?) [env AVA__PLUGINS__POLICY]`
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.path.is_empty() {
            write!(f, "{}: ", self.path)?;
        }
        f.write_str(&self.message)?;
        if let Some(origin) = &self.origin {
            write!(f, " [{origin}]")?;
        }
        Ok(())
    }
}

/// The closest candidate to a misspelled `word`: [`did_you_mean`], or failing that, the
/// nearest candidate within half the word's length (`vetd` → `vetted`).
pub(crate) fn suggest<'a>(word: &str, candidates: &[&'a str]) -> Option<&'a str> {
    if word.chars().count() > MAX_SUGGEST_CHARS {
        return None;
    }
    did_you_mean(word, candidates.iter().copied()).or_else(|| {
        let limit = (word.chars().count() / 2).max(1);
        candidates
            .iter()
            .map(|c| (edit_distance(word, c), *c))
            .filter(|(d, _)| *d <= limit)
            .min_by_key(|(d, _)| *d)
            .map(|(_, c)| c)
    })
}

fn join(path: &[String]) -> String {
    path.join(".")
}

/// Checks the whole merged tree; with a catalog, also every plugin selection.
pub(crate) fn check_tree(root: &Node, catalog: Option<&dyn PluginCatalog>, out: &mut Vec<ConfigProblem>) {
    check_section(schema::ROOT, root, &mut Vec::new(), catalog, out);
}

fn check_section(
    fields: &[Field],
    node: &Node,
    path: &mut Vec<String>,
    catalog: Option<&dyn PluginCatalog>,
    out: &mut Vec<ConfigProblem>,
) {
    match node {
        // A section with every line commented out.
        Node::Leaf { value: Value::Null, .. } => {}
        Node::Leaf { value, origin } => {
            let keys: Vec<&str> = fields.iter().map(|f| f.key).collect();
            out.push(ConfigProblem::new(
                join(path),
                format!("expected a table of settings ({}), got {}", keys.join(", "), type_phrase(value)),
                Some(origin),
            ));
        }
        Node::Map { entries, .. } => {
            let (mut unknown, mut unlisted_origin) = (0usize, None);
            for (key, child) in entries {
                path.push(key.clone());
                match fields.iter().find(|f| f.key == key) {
                    Some(field) => check_value(&field.kind, child, path, catalog, out),
                    None => {
                        unknown += 1;
                        if unknown <= MAX_UNKNOWN_KEYS {
                            out.push(unknown_key(fields, path, child.origin()));
                        } else {
                            unlisted_origin.get_or_insert(child.origin());
                        }
                    }
                }
                path.pop();
            }
            if let Some(first_unlisted) = unlisted_origin {
                out.push(more_unknown_keys(fields, path, unknown - MAX_UNKNOWN_KEYS, first_unlisted));
            }
        }
    }
}

/// The unknown keys of one section reported one by one (each with its suggestion); the rest
/// are counted in one line. Tens of thousands of them are a generated or wrong file, and
/// neither the report nor the suggestion work should grow with it.
pub(crate) const MAX_UNKNOWN_KEYS: usize = 20;

/// Longer words get no suggestion: no key is that long, and the edit distance costs the
/// product of the lengths.
const MAX_SUGGEST_CHARS: usize = 64;

/// `39980 more unknown keys here are not listed (...)`, at the section's path, from where the
/// first of them came.
fn more_unknown_keys(fields: &[Field], path: &[String], more: usize, origin: &Origin) -> ConfigProblem {
    let keys: Vec<&str> = fields.iter().map(|f| f.key).collect();
    let known = if keys.is_empty() { String::new() } else { format!("; the known keys here are {}", keys.join(", ")) };
    let (s, place) = (if more == 1 { "" } else { "s" }, if path.is_empty() { "at the top level" } else { "here" });
    let message = format!(
        "{more} more unknown key{s} {place} not listed one by one (only the first {MAX_UNKNOWN_KEYS} are){known}"
    );
    ConfigProblem::new(join(path), message, Some(origin))
}

/// What other trainers (Hugging Face's Trainer, torchtune, nanoGPT and llm.c) call some of
/// Ava's settings: a key spelled their way is pointed at Ava's, whatever its spelling
/// distance to Ava's other keys (`batch_size` is the micro-batch, not `eval_batch_size`).
pub(crate) const OTHER_NAMES: &[(&[&str], &str)] = &[
    (
        &["batch_size", "train_batch_size", "per_device_train_batch_size", "micro_batch", "mbs"],
        "train.micro_batch_size",
    ),
    (&["learning_rate", "max_lr"], "train.lr"),
    (&["steps", "num_steps", "total_steps", "max_iters", "num_train_steps", "train_steps"], "train.max_steps"),
    (&["warmup", "warmup_iters", "num_warmup_steps"], "train.warmup_steps"),
    (&["gradient_accumulation", "grad_accum", "accumulate_grad_batches"], "train.gradient_accumulation_steps"),
    (&["max_grad_norm", "clip_grad_norm", "gradient_clipping"], "train.grad_clip"),
    (&["output_dir", "out", "run_dir"], "train.out_dir"),
    (&["dtype", "mixed_precision", "amp"], "train.precision"),
    (&["seq_length", "max_seq_len", "block_size", "context_length", "max_length"], "data.seq_len"),
    (&["n_layer", "n_layers", "num_hidden_layers"], "model.num_layers"),
    (&["n_head", "num_attention_heads"], "model.num_heads"),
    (&["n_embd", "d_model", "dim", "hidden_dim"], "model.hidden_size"),
    (&["num_key_value_heads", "n_kv_head", "n_kv_heads"], "model.num_kv_heads"),
    (&["ffn_dim", "ffn_hidden_size", "mlp_dim"], "model.intermediate_size"),
];

/// Ava's key for a name another trainer uses (see [`OTHER_NAMES`]).
fn other_name(key: &str) -> Option<&'static str> {
    OTHER_NAMES.iter().find(|(names, _)| names.contains(&key)).map(|(_, ours)| *ours)
}

fn unknown_key(siblings: &[Field], path: &[String], origin: &Origin) -> ConfigProblem {
    let (key, parent) = path.split_last().expect("a key path has a key");
    let prefix = if parent.is_empty() { String::new() } else { format!("{}.", join(parent)) };
    let keys: Vec<&str> = siblings.iter().map(|f| f.key).collect();
    let message = if let Some(ours) = other_name(key) {
        format!("unknown key (did you mean '{ours}'?)")
    } else if let Some(near) = suggest(key, &keys) {
        format!("unknown key (did you mean '{prefix}{near}'?)")
    } else if let Some(elsewhere) = suggest_elsewhere(key, &prefix) {
        format!("unknown key (did you mean '{elsewhere}'?)")
    } else if keys.is_empty() {
        "unknown key".to_string()
    } else {
        format!("unknown key (known keys here: {})", keys.join(", "))
    };
    ConfigProblem::new(join(path), message, Some(origin))
}

/// A known key of the same (or a close) name in another section: `optimizer` at the top
/// level → `plugins.optimizer`.
fn suggest_elsewhere(key: &str, prefix: &str) -> Option<String> {
    let paths = schema::all_paths();
    let others: Vec<&String> = paths
        .iter()
        .filter(|p| {
            let parent_prefix = p.rsplit_once('.').map_or(String::new(), |(parent, _)| format!("{parent}."));
            parent_prefix != prefix
        })
        .collect();
    let last = |p: &str| p.rsplit('.').next().unwrap_or(p).to_string();
    let lasts: Vec<String> = others.iter().map(|p| last(p)).collect();
    let lasts_ref: Vec<&str> = lasts.iter().map(String::as_str).collect();
    let near = suggest(key, &lasts_ref)?;
    others.iter().find(|p| last(p) == near).map(|p| p.to_string())
}

fn check_value(
    kind: &Kind,
    node: &Node,
    path: &mut Vec<String>,
    catalog: Option<&dyn PluginCatalog>,
    out: &mut Vec<ConfigProblem>,
) {
    let value = node.to_value();
    let origin = node.origin();
    let mut problem = |message: String| out.push(ConfigProblem::new(join(path), message, Some(origin)));
    match kind {
        Kind::Section(fields) => check_section(fields, node, path, catalog, out),
        Kind::Selection(plugin_kind) => check_selection(*plugin_kind, node, path, catalog, out),
        Kind::Path => match &value {
            Value::String(s) if s.is_empty() => problem("the path is empty".into()),
            Value::String(_) => {}
            other => problem(format!("expected a path, got {}", type_phrase(other))),
        },
        Kind::PathList => match &value {
            Value::Array(items) => {
                for (i, item) in items.iter().enumerate() {
                    let at = format!("{}[{i}]", join(path));
                    match item {
                        Value::String(s) if !s.is_empty() => {}
                        Value::String(_) => out.push(ConfigProblem::new(at, "the path is empty", Some(origin))),
                        other => out.push(ConfigProblem::new(
                            at,
                            format!("expected a path, got {}", type_phrase(other)),
                            Some(origin),
                        )),
                    }
                }
            }
            Value::String(s) => problem(format!(
                "expected a list of paths, got a string (write [{}] for a single path)",
                super::format::yaml_string(s)
            )),
            other => problem(format!("expected a list of paths, got {}", type_phrase(other))),
        },
        Kind::OneOf(words) => match &value {
            Value::String(s) if words.contains(&s.as_str()) => {}
            Value::String(s) => {
                let mut message = format!("'{s}' is not one of {}", words.join(", "));
                if let Some(near) = suggest(s, words) {
                    message.push_str(&format!(" (did you mean '{near}'?)"));
                }
                problem(message)
            }
            other => problem(format!("expected one of {}, got {}", words.join(", "), type_phrase(other))),
        },
        Kind::OptPath => match &value {
            Value::Null => {}
            Value::String(s) if s.is_empty() => problem("the path is empty (write null for none)".into()),
            Value::String(_) => {}
            other => problem(format!("expected a path or null, got {}", type_phrase(other))),
        },
        Kind::OptInt(..) if value.is_null() => {}
        Kind::Int(min, max) | Kind::OptInt(min, max) => match value.as_i64() {
            Some(n) if (*min..=*max).contains(&n) => {}
            Some(n) => problem(range_message(&n.to_string(), *min as f64, *max as f64)),
            None => match &value {
                Value::Number(n) if n.as_u64().is_some() => {
                    problem(range_message(&n.to_string(), *min as f64, *max as f64))
                }
                other => {
                    let or_null = if matches!(kind, Kind::OptInt(..)) { " or null" } else { "" };
                    problem(format!("expected an integer{or_null}, got {}", type_phrase(other)))
                }
            },
        },
        Kind::Float(min, max) => match value.as_f64() {
            Some(x) if x >= *min && x <= *max => {}
            Some(x) => problem(range_message(&x.to_string(), *min, *max)),
            None => problem(format!("expected a number, got {}", type_phrase(&value))),
        },
        Kind::Bool => {
            if !value.is_boolean() {
                problem(format!("expected true or false, got {}", type_phrase(&value)))
            }
        }
        Kind::Device => match &value {
            Value::String(s) => {
                if let Err(e) = crate::device::DeviceSpec::parse(s) {
                    problem(e)
                }
            }
            other => problem(format!("expected {}, got {}", crate::device::DEVICE_FORMS, type_phrase(other))),
        },
        Kind::Size => match &value {
            Value::Number(n) if n.as_u64().is_some() => {}
            Value::String(s) => {
                if let Err(e) = ava_core::options::parse_size(s) {
                    problem(format!("{e}: write a byte count such as 2GiB, 512MiB or 1073741824"))
                }
            }
            other => problem(format!("expected a byte size such as 2GiB, got {}", type_phrase(other))),
        },
        Kind::Tiers => {
            if let Err(e) = Tiers::from_value(&value) {
                problem(e)
            }
        }
        Kind::Mix => {
            if let Err(e) = Mix::from_value(&value) {
                problem(e)
            }
        }
    }
}

fn check_selection(
    kind: PluginKind,
    node: &Node,
    path: &[String],
    catalog: Option<&dyn PluginCatalog>,
    out: &mut Vec<ConfigProblem>,
) {
    let at = join(path);
    let name_node = match node {
        Node::Leaf { value: Value::String(s), origin } => {
            if s.trim().is_empty() {
                out.push(ConfigProblem::new(at, "the plugin name is empty", Some(origin)));
                return;
            }
            node
        }
        Node::Leaf { value, origin } => {
            out.push(ConfigProblem::new(at, format!("{SELECTION_EXPECTED}, got {}", type_phrase(value)), Some(origin)));
            return;
        }
        Node::Map { origin, .. } => match node.child("name") {
            None => {
                out.push(ConfigProblem::new(at, MISSING_NAME, Some(origin)));
                return;
            }
            Some(Node::Leaf { value: Value::String(s), origin }) if s.trim().is_empty() => {
                out.push(ConfigProblem::new(format!("{at}.name"), "the plugin name is empty", Some(origin)));
                return;
            }
            Some(name @ Node::Leaf { value: Value::String(_), .. }) => name,
            Some(other) => {
                let message = format!("expected a plugin name, got {}", type_phrase(&other.to_value()));
                out.push(ConfigProblem::new(format!("{at}.name"), message, Some(other.origin())));
                return;
            }
        },
    };
    let Some(catalog) = catalog else { return };
    let selection = match PluginSelection::from_value(&node.to_value()) {
        Ok(selection) => selection,
        Err(message) => {
            out.push(ConfigProblem::new(at, message, Some(node.origin())));
            return;
        }
    };
    let origin_of = |option: Option<&str>| {
        let option_node = option.and_then(|key| node.child(key));
        Some(option_node.unwrap_or(name_node).origin().clone())
    };
    check_plugin(kind, &selection, &at, &origin_of, catalog, out);
}

/// Checks one selection against the catalog: is the plugin installed, are its options valid.
/// `origin_of(None)` is where the name came from, `origin_of(Some(option))` an option.
fn check_plugin(
    kind: PluginKind,
    selection: &PluginSelection,
    at: &str,
    origin_of: &dyn Fn(Option<&str>) -> Option<Origin>,
    catalog: &dyn PluginCatalog,
    out: &mut Vec<ConfigProblem>,
) {
    let mut names = catalog.names(kind);
    names.sort();
    names.dedup();
    if !names.contains(&selection.name) {
        if let Some(message) = catalog.unusable(kind, &selection.name) {
            out.push(ConfigProblem { path: at.to_string(), message, origin: origin_of(None) });
            return;
        }
        let noun = kind.article_noun().split_once(' ').map_or(kind.as_str(), |(_, noun)| noun);
        let mut message = format!("unknown {noun} '{}'", selection.name);
        let candidates: Vec<&str> = names.iter().map(String::as_str).collect();
        if let Some(near) = suggest(&selection.name, &candidates) {
            message.push_str(&format!(" (did you mean '{near}'?)"));
        }
        if names.is_empty() {
            message.push_str("; none installed");
        } else {
            message.push_str(&format!("; installed: {}", names.join(", ")));
        }
        out.push(ConfigProblem { path: at.to_string(), message, origin: origin_of(None) });
        return;
    }
    let Err(messages) = catalog.check_options(kind, &selection.name, &selection.options_json()) else { return };
    if messages.is_empty() {
        let message = format!("the options of '{}' were refused", selection.name);
        out.push(ConfigProblem { path: at.to_string(), message, origin: origin_of(None) });
    }
    for text in messages {
        let (path, message, origin) = match split_option_message(&text) {
            Some((key, message)) => (format!("{at}.{key}"), message, origin_of(Some(key))),
            None => (at.to_string(), text.clone(), origin_of(None)),
        };
        out.push(ConfigProblem { path, message, origin });
    }
}

/// `option 'X': msg` → (X, msg); `unknown option 'X' (...)` → (X, `unknown option (...)`).
fn split_option_message(text: &str) -> Option<(&str, String)> {
    if let Some(rest) = text.strip_prefix("option '") {
        let (key, message) = rest.split_once("': ")?;
        return Some((key, message.to_string()));
    }
    let rest = text.strip_prefix("unknown option '")?;
    let (key, after) = rest.split_once('\'')?;
    Some((key, format!("unknown option{after}")))
}

impl Config {
    /// Checks every plugin selection against `catalog` (is the plugin installed, are its
    /// options valid). The problems carry no origin;
    /// [`LoadedConfig::validate_plugins`](super::LoadedConfig::validate_plugins) does the
    /// same with origins.
    pub fn validate_plugins(&self, catalog: &dyn PluginCatalog) -> Vec<ConfigProblem> {
        let mut out = Vec::new();
        for kind in PluginKind::ALL {
            check_plugin(kind, self.selection(kind), &format!("plugins.{kind}"), &|_| None, catalog, &mut out);
        }
        out
    }
}

/// Checks the plugin selections of a merged tree against `catalog`, with origins.
pub(crate) fn check_tree_plugins(root: &Node, catalog: &dyn PluginCatalog) -> Vec<ConfigProblem> {
    let mut out = Vec::new();
    for kind in PluginKind::ALL {
        let path = vec!["plugins".to_string(), kind.as_str().to_string()];
        if let Some(node) = root.get(&path) {
            check_selection(kind, node, &path, Some(catalog), &mut out);
        }
    }
    out
}

/// The plugin registry is the catalog: its usable plugins, and options checked by
/// constructing the plugin (so the plugin itself validates them).
impl PluginCatalog for ava_plugins::Registry {
    fn names(&self, kind: PluginKind) -> Vec<String> {
        ava_plugins::Registry::names(self, kind)
    }

    fn check_options(&self, kind: PluginKind, name: &str, options_json: &str) -> Result<(), Vec<String>> {
        ava_plugins::Registry::check_options(self, kind, name, options_json)
    }

    fn unusable(&self, kind: PluginKind, name: &str) -> Option<String> {
        ava_plugins::Registry::unusable(self, kind, name)
    }
}

/// `5000 is out of range: must be between 1 and 4096`.
fn range_message(value: &str, min: f64, max: f64) -> String {
    let show = |x: f64| if x.fract() == 0.0 && x.abs() < 1e15 { format!("{}", x as i64) } else { format!("{x}") };
    if max >= i64::MAX as f64 || max >= 1e12 {
        format!("{value} is out of range: must be at least {}", show(min))
    } else {
        format!("{value} is out of range: must be between {} and {}", show(min), show(max))
    }
}

#[cfg(test)]
mod tests {
    use super::super::{ConfigError, ConfigLoader};

    fn problems(text: &str) -> Vec<String> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("many.yaml");
        std::fs::write(&path, text).unwrap();
        match ConfigLoader::new().file(&path).load() {
            Err(ConfigError::Invalid { problems, .. }) => {
                let shown = path.display().to_string();
                problems.iter().map(|p| p.to_string().replace(&shown, "many.yaml")).collect()
            }
            other => panic!("expected problems, got {other:?}"),
        }
    }

    /// 40 000 unknown keys took 12 s and made a 40 000-line report: each got a suggestion
    /// searched among every key of the schema. Now each section lists the first 20 and
    /// counts the rest.
    #[test]
    fn forty_thousand_unknown_keys_give_a_bounded_report() {
        let mut text = String::from("train:\n  lr: 0.001\n");
        for i in 0..25 {
            text.push_str(&format!("  extra_{i}: 1\n"));
        }
        for i in 0..40_000 {
            text.push_str(&format!("unknown_key_{i}: {i}\n"));
        }
        let got = problems(&text);
        assert_eq!(got.len(), 2 * (super::MAX_UNKNOWN_KEYS + 1), "{got:#?}");
        assert!(got.contains(&"unknown_key_19: unknown key (known keys here: model, data, train, checkpoints, memory, offload, distributed, plugins) [many.yaml]".to_string()), "{got:#?}");
        assert!(!got.iter().any(|p| p.starts_with("unknown_key_20:")), "{got:#?}");
        assert!(
            got.contains(&"39980 more unknown keys at the top level not listed one by one (only the first 20 are); the known keys here are model, data, train, checkpoints, memory, offload, distributed, plugins [many.yaml]".to_string()),
            "{got:#?}"
        );
        let train_more = got.iter().find(|p| p.starts_with("train: 5 more unknown keys here not listed one by one (only the first 20 are); the known keys here are seed, max_steps,")).expect("train's count");
        assert!(train_more.ends_with("[many.yaml]"), "{train_more}");
        // At most 20 is unchanged: every key with its own line.
        let got = problems("a: 1\nb: 2\n");
        assert_eq!(got.len(), 2, "{got:#?}");
    }

    /// A long key gets no suggestion (the edit distance costs the product of the lengths),
    /// but is still reported. (YAML's implicit keys stop at 1024 characters.)
    #[test]
    fn a_huge_key_is_reported_without_a_suggestion() {
        let key = "x".repeat(1000);
        let got = problems(&format!("{key}: 1\n"));
        assert_eq!(got.len(), 1);
        assert!(got[0].starts_with(&format!("{key}: unknown key (known keys here: model,")), "{}", &got[0][1000..]);
        assert_eq!(super::suggest(&"optimiser".repeat(8), &["optimizer"]), None);
        assert_eq!(super::suggest("optimiser", &["optimizer"]), Some("optimizer"));
    }
}
