//! Reading YAML and TOML text into JSON values, and writing values back as YAML.

use std::path::Path;

use config::{FileFormat, Format as _, ValueKind};
use serde_json::{Map, Number, Value};

/// A config file format, chosen by the file's extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Format {
    /// `.yaml` / `.yml`.
    Yaml,
    /// `.toml`.
    Toml,
}

impl Format {
    /// The format of `path`, from its extension.
    pub(crate) fn of(path: &Path) -> Option<Format> {
        match path.extension()?.to_str()?.to_ascii_lowercase().as_str() {
            "yaml" | "yml" => Some(Format::Yaml),
            "toml" => Some(Format::Toml),
            _ => None,
        }
    }

    /// `YAML` or `TOML`.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Format::Yaml => "YAML",
            Format::Toml => "TOML",
        }
    }
}

/// A syntax error with its position when the parser gives one (1-based).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SyntaxError {
    pub(crate) line: Option<usize>,
    pub(crate) column: Option<usize>,
    pub(crate) message: String,
    /// Well-formed YAML refused by the bounds or for a non-finite number, not a syntax error.
    pub(crate) refused: bool,
}

impl SyntaxError {
    fn plain(message: impl Into<String>) -> Self {
        Self { line: None, column: None, message: message.into(), refused: false }
    }
}

/// Parses a whole document, whose top level must be a table.
pub(crate) fn parse_document(format: Format, text: &str) -> Result<Map<String, Value>, SyntaxError> {
    match format {
        Format::Yaml => parse_yaml_document(text),
        Format::Toml => parse_toml_document(text),
    }
}

fn parse_yaml_document(text: &str) -> Result<Map<String, Value>, SyntaxError> {
    guard(text)?;
    let table = FileFormat::Yaml.parse(None, text).map_err(|e| yaml_error(&e.to_string()))?;
    let mut out = Map::new();
    for (key, value) in table {
        out.insert(key, from_config_value(value).map_err(SyntaxError::plain)?);
    }
    Ok(out)
}

/// Bounds `text` before the loader expands its aliases, and names the key of a non-finite
/// number (the loader's own error for `.nan` names no key).
fn guard(text: &str) -> Result<(), SyntaxError> {
    use ava_plugins::yaml_guard::{self, YamlGuardError, YamlLimits};
    yaml_guard::check(text, &YamlLimits::DEFAULT).map_err(|e| match e {
        YamlGuardError::NonFinite { line, .. } => {
            SyntaxError { line: Some(line), column: None, message: e.to_string(), refused: true }
        }
        YamlGuardError::TooManyNodes { line, .. }
        | YamlGuardError::TooMuchText { line, .. }
        | YamlGuardError::TooDeep { line, .. } => {
            // The guard's message starts with "line N: "; the position is kept apart.
            let full = e.to_string();
            let message = full.split_once(": ").map(|(_, m)| m.to_string()).unwrap_or(full);
            SyntaxError { line: Some(line), column: None, message, refused: true }
        }
    })
}

/// Splits yaml-rust2's "<what> at byte N line L column C" into its parts.
fn yaml_error(text: &str) -> SyntaxError {
    if let Some((message, position)) = text.rsplit_once(" at byte ") {
        let mut numbers = position.split(' ').filter_map(|w| w.parse::<usize>().ok());
        let (_byte, line, column) = (numbers.next(), numbers.next(), numbers.next());
        if line.is_some() {
            return SyntaxError { line, column, message: message.to_string(), refused: false };
        }
    }
    match text {
        "invalid type: sequence, expected a map" => {
            SyntaxError::plain("the top level must be a table of sections, not a list")
        }
        "invalid type: unit value, expected a map" => {
            SyntaxError::plain("the top level must be a table of sections, not empty")
        }
        _ if text.starts_with("invalid type:") => SyntaxError::plain("the top level must be a table of sections"),
        _ => SyntaxError::plain(text),
    }
}

fn from_config_value(value: config::Value) -> Result<Value, String> {
    Ok(match value.kind {
        ValueKind::Nil => Value::Null,
        ValueKind::Boolean(b) => Value::Bool(b),
        ValueKind::I64(i) => Value::from(i),
        ValueKind::U64(u) => Value::from(u),
        ValueKind::I128(i) => {
            Number::from_i128(i).map(Value::Number).ok_or_else(|| format!("the number {i} is too large"))?
        }
        ValueKind::U128(u) => {
            Number::from_u128(u).map(Value::Number).ok_or_else(|| format!("the number {u} is too large"))?
        }
        ValueKind::Float(f) => number(f)?,
        ValueKind::String(s) => Value::String(s),
        ValueKind::Array(items) => Value::Array(items.into_iter().map(from_config_value).collect::<Result<_, _>>()?),
        ValueKind::Table(table) => Value::Object(
            table.into_iter().map(|(k, v)| Ok((k, from_config_value(v)?))).collect::<Result<Map<_, _>, String>>()?,
        ),
    })
}

fn number(f: f64) -> Result<Value, String> {
    Number::from_f64(f).map(Value::Number).ok_or_else(|| format!("{f} is not a finite number"))
}

fn parse_toml_document(text: &str) -> Result<Map<String, Value>, SyntaxError> {
    let doc: toml_edit::DocumentMut = text.parse().map_err(|e: toml_edit::TomlError| {
        let (line, column) = match e.span() {
            Some(span) => {
                let before = &text[..span.start.min(text.len())];
                let line = before.matches('\n').count() + 1;
                let column = before.rsplit('\n').next().unwrap_or("").chars().count() + 1;
                (Some(line), Some(column))
            }
            None => (None, None),
        };
        SyntaxError { line, column, message: e.message().trim().to_string(), refused: false }
    })?;
    // Its only errors are non-finite numbers at a key: refused, not a syntax error.
    toml_table(doc.as_table(), "").map_err(|message| SyntaxError { line: None, column: None, message, refused: true })
}

/// `path.key` (or `key` at the top).
fn join(path: &str, key: &str) -> String {
    if path.is_empty() { key.to_string() } else { format!("{path}.{key}") }
}

/// The errors name the key path (`train.lr: NaN is not a finite number`).
fn toml_table(table: &dyn toml_edit::TableLike, path: &str) -> Result<Map<String, Value>, String> {
    let mut out = Map::new();
    for (key, item) in table.iter() {
        if let Some(value) = toml_item(item, &join(path, key))? {
            out.insert(key.to_string(), value);
        }
    }
    Ok(out)
}

fn toml_item(item: &toml_edit::Item, path: &str) -> Result<Option<Value>, String> {
    Ok(Some(match item {
        toml_edit::Item::None => return Ok(None),
        toml_edit::Item::Value(v) => toml_value(v, path)?,
        toml_edit::Item::Table(t) => Value::Object(toml_table(t, path)?),
        toml_edit::Item::ArrayOfTables(a) => Value::Array(
            a.iter()
                .enumerate()
                .map(|(i, t)| toml_table(t, &format!("{path}[{i}]")).map(Value::Object))
                .collect::<Result<_, _>>()?,
        ),
    }))
}

fn toml_value(value: &toml_edit::Value, path: &str) -> Result<Value, String> {
    use toml_edit::Value as T;
    Ok(match value {
        T::String(s) => Value::String(s.value().clone()),
        T::Integer(i) => Value::from(*i.value()),
        T::Float(f) => number(*f.value()).map_err(|e| format!("{path}: {e}; write a finite number"))?,
        T::Boolean(b) => Value::Bool(*b.value()),
        T::Datetime(d) => Value::String(d.value().to_string()),
        T::Array(a) => Value::Array(
            a.iter().enumerate().map(|(i, v)| toml_value(v, &format!("{path}[{i}]"))).collect::<Result<_, _>>()?,
        ),
        T::InlineTable(t) => Value::Object(toml_table(t, path)?),
    })
}

/// Parses the text of one value as YAML (`0.9`, `true`, `lion`, `[a, b]`,
/// `{name: lion, betas: [0.9, 0.98]}`); an empty text is `null`.
pub(crate) fn parse_yaml_value(text: &str) -> Result<Value, String> {
    parse_yaml_value_at(text, "")
}

/// [`parse_yaml_value`] for the value of `key` (a dotted path, empty when the caller names
/// the key itself): a non-finite number's message starts with its full key path.
pub(crate) fn parse_yaml_value_at(text: &str, key: &str) -> Result<Value, String> {
    // Indented under a key, any YAML value (also a multi-line block) reads as that key's value.
    let mut doc = String::from("v:\n");
    for line in text.lines() {
        doc.push_str("  ");
        doc.push_str(line);
        doc.push('\n');
    }
    // The wrapper adds the key `v` (one node, one level); the guard's path drops it.
    if let Err(e) = guard(&doc) {
        let message = match e.message.strip_prefix("v: ") {
            Some(rest) if key.is_empty() => rest.to_string(),
            Some(rest) => format!("{key}: {rest}"),
            None => match e.message.strip_prefix("v.").or_else(|| e.message.strip_prefix('v')) {
                Some(rest) if rest.contains(" is not a finite number") => {
                    let sep = if key.is_empty() || rest.starts_with('[') { "" } else { "." };
                    format!("{key}{sep}{rest}")
                }
                _ => e.message,
            },
        };
        return Err(message);
    }
    let table = FileFormat::Yaml.parse(None, &doc).map_err(|e| {
        let e = yaml_error(&e.to_string());
        format!("not a valid YAML value: {}", e.message)
    })?;
    match table.into_iter().find(|(k, _)| k == "v") {
        Some((_, value)) => from_config_value(value),
        None => Ok(Value::Null),
    }
}

/// Parses one value written as YAML, as in `--set key=VALUE` and `AVA__...` variables:
/// `0.9` is a number, `true` a boolean, `lion` a string, `[0.9, 0.98]` a list,
/// `{name: lion, lr: 0.001}` a table, and an empty text `null`. The error says what is wrong.
pub fn parse_value(text: &str) -> Result<Value, String> {
    parse_yaml_value(text)
}

/// A plugin selection as written in a YAML config: `lion`, or
/// `{name: lion, betas: [0.9, 0.98]}` when it has options (the same as its `Display`).
pub fn selection_yaml(selection: &super::PluginSelection) -> String {
    yaml_flow(&selection.to_value())
}

/// "an integer", "a string", ... for "expected X, got <phrase>".
pub(crate) fn type_phrase(value: &Value) -> &'static str {
    match value {
        Value::Null => "nothing (null)",
        Value::Bool(_) => "a boolean",
        Value::Number(n) if n.is_f64() => "a number",
        Value::Number(_) => "an integer",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "a table",
    }
}

/// A value in YAML flow style on one line: `lion`, `0.9`, `'1.0'`, `[0.9, 0.98]`,
/// `{name: lion, betas: [0.9, 0.98]}`. Reads back as the same value.
pub fn yaml_flow(value: &Value) -> String {
    match value {
        Value::Null => "null".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => yaml_string(s),
        Value::Array(items) => format!("[{}]", items.iter().map(yaml_flow).collect::<Vec<_>>().join(", ")),
        Value::Object(map) => format!(
            "{{{}}}",
            map.iter().map(|(k, v)| format!("{}: {}", yaml_string(k), yaml_flow(v))).collect::<Vec<_>>().join(", ")
        ),
    }
}

/// A string as a YAML scalar: plain when that reads back as the same string (also inside a
/// flow collection), otherwise quoted.
pub(crate) fn yaml_string(s: &str) -> String {
    let plain_chars = s.chars().all(|c| c.is_alphanumeric() || "_-./ +@~=()<>^".contains(c));
    let plain_start = s.chars().next().is_some_and(|c| c.is_alphanumeric() || "_./".contains(c));
    if plain_chars && plain_start && !s.ends_with(' ') && parse_yaml_value(s).ok() == Some(Value::String(s.to_string()))
    {
        return s.to_string();
    }
    if s.chars().any(char::is_control) {
        // JSON string syntax is valid YAML double-quoted syntax.
        return Value::String(s.to_string()).to_string();
    }
    format!("'{}'", s.replace('\'', "''"))
}
