//! The origin-tracked value tree: every layer (defaults, file, environment, `--set`) is turned
//! into a [`Node`] tree whose leaves remember where they came from ([`Origin`]), and the
//! layers are merged into one tree. Validation walks that tree, and `ava config show` prints it.

use std::fmt;
use std::path::PathBuf;

use serde_json::{Map, Value};

use super::schema::Kind;

/// Where a configuration value came from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Origin {
    /// The built-in defaults ([`DEFAULT_CONFIG_YAML`](super::DEFAULT_CONFIG_YAML)).
    Default,
    /// A config file, as the path was given.
    File(PathBuf),
    /// An `AVA__SECTION__KEY` environment variable (its name).
    Env(String),
    /// A `--set key=value` override (the whole argument text).
    Set(String),
    /// The `config.json` of the folder `model.from` names (its path): the architecture a run
    /// from that folder has, shown by `ava config show` in place of the `model` keys it
    /// makes ignored.
    ModelFrom(PathBuf),
}

impl Origin {
    /// The layer's short name: `default`, `file`, `env` or `set`.
    pub fn layer(&self) -> &'static str {
        match self {
            Self::Default => "default",
            Self::File(_) => "file",
            Self::Env(_) => "env",
            Self::Set(_) => "set",
            Self::ModelFrom(_) => "model.from",
        }
    }
}

impl fmt::Display for Origin {
    /// `default`, the file path, `env AVA__PLUGINS__POLICY` or `--set plugins.policy=vetted`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Default => f.write_str("default"),
            Self::File(path) => write!(f, "{}", path.display()),
            Self::Env(var) => write!(f, "env {var}"),
            Self::Set(text) => write!(f, "--set {text}"),
            Self::ModelFrom(path) => write!(f, "{} (model.from)", path.display()),
        }
    }
}

/// One value of the configuration tree. Tables are merged key by key across layers; every
/// other value (scalars and lists) is a leaf that a higher layer replaces whole.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Node {
    /// A table, in key order; `origin` is the layer that made this a table.
    Map { entries: Vec<(String, Node)>, origin: Origin },
    /// A scalar or a list.
    Leaf { value: Value, origin: Origin },
}

impl Node {
    /// Builds the tree of `value`, every part of it from `origin`.
    pub(crate) fn from_value(value: Value, origin: &Origin) -> Node {
        match value {
            Value::Object(map) => Node::Map {
                entries: map.into_iter().map(|(k, v)| (k, Node::from_value(v, origin))).collect(),
                origin: origin.clone(),
            },
            value => Node::Leaf { value, origin: origin.clone() },
        }
    }

    /// `value` placed under the key path `path` (`["plugins", "memory", "critical"]`), the
    /// intermediate tables also from `origin`.
    pub(crate) fn nested(path: &[String], value: Node, origin: &Origin) -> Node {
        path.iter()
            .rev()
            .fold(value, |inner, key| Node::Map { entries: vec![(key.clone(), inner)], origin: origin.clone() })
    }

    /// The plain value, origins dropped.
    pub(crate) fn to_value(&self) -> Value {
        match self {
            Node::Map { entries, .. } => {
                Value::Object(entries.iter().map(|(k, v)| (k.clone(), v.to_value())).collect::<Map<_, _>>())
            }
            Node::Leaf { value, .. } => value.clone(),
        }
    }

    /// Where this value (for a table: the table itself) came from.
    pub(crate) fn origin(&self) -> &Origin {
        match self {
            Node::Map { origin, .. } | Node::Leaf { origin, .. } => origin,
        }
    }

    /// The entry `key` of a table.
    pub(crate) fn child(&self, key: &str) -> Option<&Node> {
        match self {
            Node::Map { entries, .. } => entries.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            Node::Leaf { .. } => None,
        }
    }

    /// The node at a key path.
    pub(crate) fn get<S: AsRef<str>>(&self, path: &[S]) -> Option<&Node> {
        path.iter().try_fold(self, |node, key| node.child(key.as_ref()))
    }

    /// Merges a higher layer into this one. Tables merge key by key; anything else replaces
    /// (a scalar replaces a table and a table a scalar), except that an empty value (`null`)
    /// over a table leaves the table as it is (a section with every line commented out).
    ///
    /// `kind` is the schema of this position, if known. A plugin selection merges specially:
    /// a bare name replaces the whole selection (the options of another plugin make no sense
    /// for it), while a table merges into the selection below — `--set plugins.memory.critical=0.9`
    /// keeps `memory: thresholds` and adds the option — unless it names a different plugin,
    /// in which case it replaces the selection too.
    ///
    /// `implicit` is how many levels of `overlay` were only made to hold a value deeper down
    /// (the key path of `AVA__...` and `--set`: 3 for `plugins.memory.critical`; 0 for a file).
    /// Only such a made-up selection table takes its plugin name from below; a table written
    /// out in full without a `name` replaces the selection, and validation reports it.
    pub(crate) fn merge(&mut self, overlay: Node, kind: Option<&Kind>, implicit: usize) {
        if let (Node::Map { .. }, Node::Leaf { value: Value::Null, .. }) = (&*self, &overlay) {
            return;
        }
        if let (Some(Kind::Selection(_)), Node::Map { entries: over, origin: over_origin }) = (kind, &overlay) {
            let over_name = over.iter().find(|(k, _)| k == "name").map(|(_, v)| v.to_value());
            let base_name = match &*self {
                Node::Leaf { value: v @ Value::String(_), .. } => Some(v.clone()),
                Node::Map { .. } => self.child("name").map(Node::to_value),
                Node::Leaf { .. } => None,
            };
            let same_plugin = match (&over_name, &base_name) {
                (None, Some(_)) => implicit > 0,
                (Some(a), Some(b)) => a == b,
                _ => false,
            };
            if !same_plugin {
                *self = overlay;
                return;
            }
            if matches!(self, Node::Leaf { .. }) {
                let name = std::mem::replace(self, Node::Leaf { value: Value::Null, origin: Origin::Default });
                *self = Node::Map { entries: vec![("name".to_string(), name)], origin: over_origin.clone() };
            }
        }
        match (self, overlay) {
            (Node::Map { entries, .. }, Node::Map { entries: over, .. }) => {
                // Indexed: a search of `entries` per key made 40 000 keys take seconds.
                let mut index: std::collections::HashMap<String, usize> =
                    entries.iter().enumerate().map(|(i, (k, _))| (k.clone(), i)).collect();
                for (key, value) in over {
                    let child_kind = match kind {
                        Some(Kind::Section(fields)) => fields.iter().find(|f| f.key == key).map(|f| &f.kind),
                        _ => None,
                    };
                    match index.get(&key) {
                        Some(&i) => entries[i].1.merge(value, child_kind, implicit.saturating_sub(1)),
                        None => {
                            index.insert(key.clone(), entries.len());
                            entries.push((key, value));
                        }
                    }
                }
            }
            (this, overlay) => *this = overlay,
        }
    }

    /// The dotted key path of every table and value, in tree order (a table before its entries).
    pub(crate) fn paths(&self) -> Vec<String> {
        fn walk(node: &Node, prefix: &str, out: &mut Vec<String>) {
            if let Node::Map { entries, .. } = node {
                for (key, child) in entries {
                    let path = if prefix.is_empty() { key.clone() } else { format!("{prefix}.{key}") };
                    out.push(path.clone());
                    walk(child, &path, out);
                }
            }
        }
        let mut out = Vec::new();
        walk(self, "", &mut out);
        out
    }

    /// Every leaf with its dotted key path, in tree order. An empty table counts as a leaf
    /// (`{}`), so that it shows up.
    pub(crate) fn leaves(&self) -> Vec<(String, Value, Origin)> {
        fn walk(node: &Node, path: &mut Vec<String>, out: &mut Vec<(String, Value, Origin)>) {
            match node {
                Node::Map { entries, .. } if !entries.is_empty() => {
                    for (key, child) in entries {
                        path.push(key.clone());
                        walk(child, path, out);
                        path.pop();
                    }
                }
                Node::Map { origin, .. } => out.push((path.join("."), Value::Object(Map::new()), origin.clone())),
                Node::Leaf { value, origin } => out.push((path.join("."), value.clone(), origin.clone())),
            }
        }
        let mut out = Vec::new();
        walk(self, &mut Vec::new(), &mut out);
        out
    }
}
