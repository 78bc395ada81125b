//! Editing a config file for `ava plugins enable/disable`: one key (a plugin selection,
//! `offload.tiers`) is set or removed and everything else in the file — comments, order,
//! formatting — stays as it was.
//! YAML goes through a line-based editor ([`super::yaml_edit`]), TOML through `toml_edit`.
//! The result is parsed again and compared with what was intended before it replaces the
//! file (atomically: a temporary file in the same directory, then a rename).

use std::fs;
use std::io::{self, Write as _};
use std::path::{Path, PathBuf};

use ava_core::PluginKind;
use serde_json::{Map, Value};
use toml_edit::{DocumentMut, Item, Table};

use super::error::ConfigError;
use super::format::{Format, yaml_flow};
use super::load::parse_file_text;
use super::schema::PluginSelection;
use super::yaml_edit;

/// What [`set_plugin_selection`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EditOutcome {
    /// The file did not exist and was created.
    Created,
    /// The file was rewritten.
    Changed,
    /// The file already said that (or there was nothing to remove); it was not touched.
    Unchanged,
}

/// The first lines of a config file created by an edit.
const NEW_FILE_HEADER: &str = "\
# Ava configuration, created by `ava plugins enable`.
# Settings not written here keep their built-in defaults; `ava config show` prints the
# effective configuration and where each value comes from.
";

/// Sets `plugins.<kind>` in the config file at `path` to `selection` (written as a bare name,
/// or as a table when it has options), or removes the key when `selection` is `None` so the
/// built-in default applies again: [`set_config_value`] on that key.
pub fn set_plugin_selection(
    path: &Path,
    kind: PluginKind,
    selection: Option<&PluginSelection>,
) -> Result<EditOutcome, ConfigError> {
    set_config_value(path, "plugins", kind.as_str(), selection.map(PluginSelection::to_value).as_ref())
}

/// Sets `<section>.<key>` in the config file at `path` to `value`, or removes the key when
/// `value` is `None` so the built-in default applies again. Only that key changes; comments
/// and formatting elsewhere are kept. A missing file is created (with a header comment) when
/// there is something to set. The edited text is parsed and checked before it is written;
/// on any error the file is left as it was.
pub fn set_config_value(
    path: &Path,
    section: &str,
    key: &str,
    value: Option<&Value>,
) -> Result<EditOutcome, ConfigError> {
    let format = Format::of(path).ok_or_else(|| ConfigError::UnknownFormat { path: path.to_path_buf() })?;
    // Edit the file a symbolic link points to, not the link.
    let target = match fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_symlink() => fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf()),
        _ => path.to_path_buf(),
    };
    let old = super::load::read_config_text(&target)?;
    let edit_error = |reason: String| ConfigError::Edit { path: path.to_path_buf(), reason };

    let (new_text, outcome) = match &old {
        None => {
            let Some(value) = value else { return Ok(EditOutcome::Unchanged) };
            let body = edit_text(format, "", section, key, Some(value)).map_err(edit_error)?;
            (format!("{NEW_FILE_HEADER}{body}"), EditOutcome::Created)
        }
        Some(text) => {
            // A file that does not parse is reported as such, not edited.
            parse_file_text(path, text)?;
            let edited = edit_text(format, text, section, key, value).map_err(edit_error)?;
            if edited == *text {
                return Ok(EditOutcome::Unchanged);
            }
            (edited, EditOutcome::Changed)
        }
    };
    verify(path, old.as_deref(), &new_text, section, key, value).map_err(edit_error)?;
    write_atomically(&target, &new_text, old.is_some())
        .map_err(|source| ConfigError::Write { path: target.clone(), source })?;
    Ok(outcome)
}

fn edit_text(format: Format, text: &str, section: &str, key: &str, value: Option<&Value>) -> Result<String, String> {
    match format {
        Format::Yaml => yaml_edit::set_key(text, section, key, value.map(yaml_flow).as_deref()),
        Format::Toml => edit_toml(text, section, key, value),
    }
}

/// Checks that `new_text` reads back as `old_text` with only `<section>.<key>` changed.
fn verify(
    path: &Path,
    old_text: Option<&str>,
    new_text: &str,
    section: &str,
    key: &str,
    value: Option<&Value>,
) -> Result<(), String> {
    let got = parse_file_text(path, new_text).map_err(|e| format!("the edited text would not parse ({e})"))?;
    let mut expected = match old_text {
        Some(text) => parse_file_text(path, text).map_err(|e| e.to_string())?,
        None => Value::Object(Map::new()),
    };
    let root = expected.as_object_mut().expect("a document is a table");
    let table = root.entry(section).or_insert_with(|| Value::Object(Map::new()));
    if table.is_null() {
        *table = Value::Object(Map::new());
    }
    let Some(table) = table.as_object_mut() else {
        return Err(format!("`{section}` is not a table"));
    };
    match value {
        Some(value) => {
            table.insert(key.to_string(), value.clone());
        }
        None => {
            table.shift_remove(key);
        }
    }
    let (got, expected) = (without_empty(got, section), without_empty(expected, section));
    if got == expected {
        return Ok(());
    }
    let read_back = got.get(section).and_then(|p| p.get(key)).map_or("nothing".to_string(), yaml_flow);
    let wanted = value.map_or("nothing".to_string(), yaml_flow);
    Err(if read_back != wanted {
        format!("{section}.{key} would read back as {read_back} instead of {wanted}; edit the file by hand")
    } else {
        format!("the edit would also change other settings; edit {section}.{key} by hand")
    })
}

/// A section that is empty or `null` counts as absent.
fn without_empty(mut doc: Value, section: &str) -> Value {
    if let Some(root) = doc.as_object_mut() {
        let empty = match root.get(section) {
            Some(Value::Null) => true,
            Some(Value::Object(m)) => m.is_empty(),
            _ => false,
        };
        if empty {
            root.shift_remove(section);
        }
    }
    doc
}

fn write_atomically(target: &Path, text: &str, existed: bool) -> io::Result<()> {
    let dir = match target.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let mut tmp = tempfile::NamedTempFile::new_in(&dir)?;
    tmp.write_all(text.as_bytes())?;
    tmp.as_file().sync_all()?;
    let permissions = match fs::metadata(target) {
        Ok(meta) if existed => Some(meta.permissions()),
        _ => new_file_permissions(),
    };
    if let Some(permissions) = permissions {
        fs::set_permissions(tmp.path(), permissions)?;
    }
    tmp.persist(target).map_err(|e| e.error)?;
    Ok(())
}

#[cfg(unix)]
fn new_file_permissions() -> Option<fs::Permissions> {
    use std::os::unix::fs::PermissionsExt as _;
    Some(fs::Permissions::from_mode(0o644))
}

#[cfg(not(unix))]
fn new_file_permissions() -> Option<fs::Permissions> {
    None
}

/// Sets or removes `<section>.<key>` in TOML text with `toml_edit`, which keeps comments and
/// formatting. A `[<section>.<key>]` table stays a table (for a table value); otherwise the
/// value is written inline, keeping the old value's trailing comment.
fn edit_toml(text: &str, section: &str, key: &str, value: Option<&Value>) -> Result<String, String> {
    let mut doc: DocumentMut = text.parse().map_err(|e: toml_edit::TomlError| e.to_string())?;
    let not_table = || format!("`{section}` is not a table");
    match value {
        Some(value) => {
            if !doc.contains_key(section) {
                doc.insert(section, Item::Table(Table::new()));
            }
            let table = doc[section].as_table_like_mut().ok_or_else(not_table)?;
            match (table.get_mut(key), value) {
                (Some(Item::Table(t)), Value::Object(members)) => {
                    t.clear();
                    for (k, v) in members {
                        t.insert(k, Item::Value(toml_value(v)?));
                    }
                }
                (Some(item @ Item::Value(_)), _) => {
                    let mut new = toml_value(value)?;
                    if let Some(old) = item.as_value() {
                        *new.decor_mut() = old.decor().clone();
                    }
                    *item = Item::Value(new);
                }
                _ => {
                    table.insert(key, Item::Value(toml_value(value)?));
                }
            }
        }
        None => {
            let Some(item) = doc.get_mut(section) else { return Ok(text.to_string()) };
            let table = item.as_table_like_mut().ok_or_else(not_table)?;
            let Some(orphans) = remove_keeping_comments(table, key) else {
                return Ok(text.to_string());
            };
            let keep_table = !table.is_empty()
                || match &*item {
                    Item::Table(t) => has_comment(t.decor()),
                    Item::Value(v) => has_comment(v.decor()),
                    _ => true,
                };
            let position = item.as_table().and_then(Table::position);
            if !keep_table {
                doc.remove(section);
            }
            if !orphans.is_empty() {
                place_before_next_table(&mut doc, position, &orphans);
            }
        }
    }
    Ok(doc.to_string())
}

fn has_comment(decor: &toml_edit::Decor) -> bool {
    let has = |raw: Option<&toml_edit::RawString>| raw.and_then(|r| r.as_str()).is_some_and(|s| s.contains('#'));
    has(decor.prefix()) || has(decor.suffix())
}

/// Removes `key` from a table. Comment lines above it (stored with the key) move to the key
/// that follows; when there is none, they are returned so the caller can keep them.
/// `None` when the key was not there.
fn remove_keeping_comments(table: &mut dyn toml_edit::TableLike, key: &str) -> Option<String> {
    let keys: Vec<String> = table.iter().map(|(k, _)| k.to_string()).collect();
    let index = keys.iter().position(|k| k == key)?;
    let comments = table
        .key(key)
        .and_then(|k| k.leaf_decor().prefix())
        .and_then(|p| p.as_str())
        .filter(|p| p.contains('#'))
        .map(str::to_string);
    table.remove(key);
    let Some(comments) = comments else { return Some(String::new()) };
    if let Some(next) = keys.get(index + 1)
        && let Some(mut next_key) = table.key_mut(next)
    {
        let old = next_key.leaf_decor().prefix().and_then(|p| p.as_str()).unwrap_or("").to_string();
        next_key.leaf_decor_mut().set_prefix(format!("{comments}{old}"));
        return Some(String::new());
    }
    Some(comments)
}

/// A JSON value as a TOML value (tables become inline tables).
fn toml_value(value: &Value) -> Result<toml_edit::Value, String> {
    Ok(match value {
        Value::Null => return Err("TOML has no null value".into()),
        Value::Bool(b) => (*b).into(),
        Value::Number(n) => match (n.as_i64(), n.as_f64()) {
            (Some(i), _) => i.into(),
            (None, Some(f)) if n.is_f64() => f.into(),
            _ => return Err(format!("the number {n} does not fit in TOML")),
        },
        Value::String(s) => s.as_str().into(),
        Value::Array(items) => {
            let mut array = toml_edit::Array::new();
            for item in items {
                array.push(toml_value(item)?);
            }
            toml_edit::Value::Array(array)
        }
        Value::Object(map) => {
            let mut table = toml_edit::InlineTable::new();
            for (k, v) in map {
                table.insert(k, toml_value(v)?);
            }
            toml_edit::Value::InlineTable(table)
        }
    })
}

/// One step of the way to a table in a document.
enum Step {
    Key(String),
    Index(usize),
}

/// Puts comment lines where the text after the table at `position` continues: above the
/// next table header, or at the end of the document. That is where they stood in the text.
fn place_before_next_table(doc: &mut DocumentMut, position: Option<isize>, comments: &str) {
    fn visit(table: &Table, after: isize, path: &mut Vec<Step>, best: &mut Option<(isize, Vec<Step>)>) {
        let consider = |t: &Table, path: &mut Vec<Step>, best: &mut Option<(isize, Vec<Step>)>| {
            if let Some(p) = t.position()
                && p > after
                && best.as_ref().is_none_or(|(b, _)| p < *b)
            {
                let copy = path
                    .iter()
                    .map(|s| match s {
                        Step::Key(k) => Step::Key(k.clone()),
                        Step::Index(i) => Step::Index(*i),
                    })
                    .collect();
                *best = Some((p, copy));
            }
            visit(t, after, path, best);
        };
        for (key, item) in table.iter() {
            path.push(Step::Key(key.to_string()));
            match item {
                Item::Table(t) => consider(t, path, best),
                Item::ArrayOfTables(array) => {
                    for (i, t) in array.iter().enumerate() {
                        path.push(Step::Index(i));
                        consider(t, path, best);
                        path.pop();
                    }
                }
                _ => {}
            }
            path.pop();
        }
    }
    let mut best = None;
    if let Some(after) = position {
        visit(doc.as_table(), after, &mut Vec::new(), &mut best);
    }
    let next = best.and_then(|(_, path)| table_at(doc, &path));
    match next {
        Some(table) => {
            let old = table.decor().prefix().and_then(|p| p.as_str()).unwrap_or("").to_string();
            table.decor_mut().set_prefix(format!("{comments}{old}"));
        }
        None => {
            let trailing = format!("{comments}{}", doc.trailing().as_str().unwrap_or(""));
            doc.set_trailing(trailing);
        }
    }
}

fn table_at<'a>(doc: &'a mut DocumentMut, path: &[Step]) -> Option<&'a mut Table> {
    let mut table = doc.as_table_mut();
    let mut steps = path.iter();
    while let Some(step) = steps.next() {
        let Step::Key(key) = step else { return None };
        table = match table.get_mut(key)? {
            Item::Table(t) => t,
            Item::ArrayOfTables(array) => match steps.next() {
                Some(Step::Index(i)) => array.get_mut(*i)?,
                _ => return None,
            },
            _ => return None,
        };
    }
    Some(table)
}
