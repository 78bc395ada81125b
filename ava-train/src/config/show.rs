//! `ava config show`: the effective configuration as a list of leaves with their origins, as
//! YAML with `# from:` comments, or as JSON.

use serde_json::{Map, Value, json};

use super::format::{yaml_flow, yaml_string};
use super::load::LoadedConfig;
use super::tree::{Node, Origin};

/// One value of the effective configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigEntry {
    /// Dotted key path, e.g. `plugins.optimizer` or `plugins.memory.critical`.
    pub path: String,
    /// The value (a scalar, a list, or `{}` for an empty table).
    pub value: Value,
    /// Where it came from.
    pub origin: Origin,
}

/// Comments are aligned to this column at most.
const COMMENT_COLUMN_MAX: usize = 44;

impl LoadedConfig {
    /// Every value of the effective configuration with where it came from, in file order
    /// (the order of the built-in defaults, then keys added by higher layers).
    pub fn entries(&self) -> Vec<ConfigEntry> {
        self.tree.leaves().into_iter().map(|(path, value, origin)| ConfigEntry { path, value, origin }).collect()
    }

    /// The effective configuration as YAML, each value followed by `# from: <origin>`. It
    /// reads back (as a config file) to the same configuration.
    pub fn to_yaml(&self) -> String {
        let mut lines: Vec<(String, Option<String>)> = Vec::new();
        render(&self.tree, 0, &mut lines);
        let width = lines
            .iter()
            .filter(|(_, comment)| comment.is_some())
            .map(|(text, _)| text.chars().count())
            .filter(|w| *w <= COMMENT_COLUMN_MAX)
            .max()
            .unwrap_or(0);
        let mut out = String::from(
            "# The effective Ava configuration: built-in defaults < config file < AVA__* environment < --set.\n",
        );
        for (text, comment) in lines {
            match comment {
                Some(origin) => {
                    let pad = width.saturating_sub(text.chars().count()) + 2;
                    out.push_str(&format!("{text}{:pad$}# from: {origin}\n", ""));
                }
                None => {
                    out.push_str(&text);
                    out.push('\n');
                }
            }
        }
        out
    }

    /// The effective configuration as JSON:
    /// `{"plugins.optimizer": {"value": "lion", "origin": "configs/x.yaml", "layer": "file"}, ...}`
    /// in the order of [`entries`](Self::entries). `layer` is `default`, `file`, `env` or `set`.
    pub fn to_json(&self) -> Value {
        let mut out = Map::new();
        for entry in self.entries() {
            out.insert(
                entry.path,
                json!({ "value": entry.value, "origin": entry.origin.to_string(), "layer": entry.origin.layer() }),
            );
        }
        Value::Object(out)
    }
}

fn render(node: &Node, indent: usize, lines: &mut Vec<(String, Option<String>)>) {
    let Node::Map { entries, .. } = node else { return };
    for (key, child) in entries {
        let head = format!("{:indent$}{}:", "", yaml_string(key));
        match child {
            Node::Map { entries, .. } if !entries.is_empty() => {
                lines.push((head, None));
                render(child, indent + 2, lines);
            }
            _ => {
                let origin = child.origin().to_string().replace('\r', "").replace('\n', "\\n");
                lines.push((format!("{head} {}", yaml_flow(&child.to_value())), Some(origin)));
            }
        }
    }
}
