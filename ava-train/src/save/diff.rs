//! [`differing_keys`]: which settings of the structural config sections (model shape,
//! plugins, ...) differ between the config a checkpoint was saved with and the current one,
//! so that resuming can refuse, or warn, naming each of them.

use std::collections::BTreeSet;

use serde_json::Value;

/// The leaf settings under `sections` whose values differ between `saved` and `current`,
/// each as `"model.hidden_size: 128 -> 256"`. Paths are dotted, list items are `[i]`; a
/// setting present on one side only shows `(absent)` on the other; values are compact JSON
/// (strings quoted). A section may itself be a dotted path (`plugins.optimizer`). Sections
/// are reported in the order given, keys within them sorted.
pub fn differing_keys(saved: &Value, current: &Value, sections: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    for section in sections {
        let a = section.split('.').try_fold(saved, |v, key| v.get(key));
        let b = section.split('.').try_fold(current, |v, key| v.get(key));
        compare(section, a, b, &mut out);
    }
    out
}

fn compare(path: &str, a: Option<&Value>, b: Option<&Value>, out: &mut Vec<String>) {
    match (a, b) {
        (Some(Value::Object(a)), Some(Value::Object(b))) => {
            let keys: BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            for key in keys {
                compare(&format!("{path}.{key}"), a.get(key), b.get(key), out);
            }
        }
        (Some(Value::Array(a)), Some(Value::Array(b))) => {
            for i in 0..a.len().max(b.len()) {
                compare(&format!("{path}[{i}]"), a.get(i), b.get(i), out);
            }
        }
        (Some(a), Some(b)) if a == b => {}
        (None, None) => {}
        // One side only, and non-empty: list its leaves, each added or removed.
        (Some(side), None) | (None, Some(side)) if has_children(side) => {
            let removed = a.is_some();
            for (child_path, child) in children(path, side) {
                let (x, y) = if removed { (Some(child), None) } else { (None, Some(child)) };
                compare(&child_path, x, y, out);
            }
        }
        // Differing leaves, or a type change (e.g. a list became a number): one line.
        (a, b) => out.push(format!("{path}: {} -> {}", show(a), show(b))),
    }
}

fn has_children(value: &Value) -> bool {
    match value {
        Value::Object(map) => !map.is_empty(),
        Value::Array(items) => !items.is_empty(),
        _ => false,
    }
}

/// The paths and values of the members of an object or list.
fn children<'a>(path: &str, value: &'a Value) -> Vec<(String, &'a Value)> {
    match value {
        Value::Object(map) => {
            let sorted: std::collections::BTreeMap<_, _> = map.iter().collect();
            sorted.into_iter().map(|(key, v)| (format!("{path}.{key}"), v)).collect()
        }
        Value::Array(items) => items.iter().enumerate().map(|(i, v)| (format!("{path}[{i}]"), v)).collect(),
        _ => Vec::new(),
    }
}

fn show(value: Option<&Value>) -> String {
    value.map_or_else(|| "(absent)".to_string(), Value::to_string)
}
