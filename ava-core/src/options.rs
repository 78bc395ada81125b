//! Plugin options: the host passes the plugin's config table as JSON text; [`Options::parse`]
//! checks it against the manifest's option specs, and the plugin adds its own range checks.
//! Every problem is collected and reported at once.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::{Manifest, OptionType, PluginError};

/// Validated option values of one plugin, defaults filled in.
#[derive(Debug, Clone)]
pub struct Options {
    plugin: String,
    values: BTreeMap<String, Value>,
    types: BTreeMap<String, OptionType>,
    problems: Vec<String>,
}

impl Options {
    /// Parses `json` (an object, or empty text for "no options") against `manifest`'s option
    /// specs. Unknown keys (with a "did you mean") and wrong types are recorded, not returned
    /// early: call [`finish`](Self::finish) after your own checks to get them all at once.
    pub fn parse(manifest: &Manifest, json: &str) -> Options {
        let mut problems = Vec::new();
        let given: serde_json::Map<String, Value> = if json.trim().is_empty() {
            serde_json::Map::new()
        } else {
            match serde_json::from_str::<Value>(json) {
                Ok(Value::Object(m)) => m,
                Ok(Value::Null) => serde_json::Map::new(),
                Ok(other) => {
                    problems.push(format!("options must be a table of key: value, got {}", type_name(&other)));
                    serde_json::Map::new()
                }
                Err(e) => {
                    problems.push(format!("options are not valid JSON: {e}"));
                    serde_json::Map::new()
                }
            }
        };

        let mut values = BTreeMap::new();
        let mut types = BTreeMap::new();
        for spec in manifest.options.iter() {
            types.insert(spec.name.to_string(), spec.ty);
            let default: Value = serde_json::from_str(&spec.default).unwrap_or(Value::Null);
            values.insert(spec.name.to_string(), default);
        }
        for (key, value) in given {
            match manifest.option_spec(&key) {
                None => {
                    let known: Vec<&str> = manifest.options.iter().map(|o| o.name.as_str()).collect();
                    let mut msg = format!("unknown option '{key}'");
                    if let Some(s) = did_you_mean(&key, known.iter().copied()) {
                        msg.push_str(&format!(" (did you mean '{s}'?)"));
                    } else if known.is_empty() {
                        msg.push_str(&format!(" ('{}' takes no options)", manifest.name));
                    } else {
                        msg.push_str(&format!(" (known: {})", known.join(", ")));
                    }
                    problems.push(msg);
                }
                Some(spec) => match coerce(spec.ty, value) {
                    Ok(v) => {
                        values.insert(key, v);
                    }
                    Err(e) => problems.push(format!("option '{key}': {e}")),
                },
            }
        }
        Options { plugin: manifest.name.to_string(), values, types, problems }
    }

    /// Options with nothing given: every value at its default.
    pub fn defaults(manifest: &Manifest) -> Options {
        Self::parse(manifest, "")
    }

    /// The plugin these options belong to.
    pub fn plugin(&self) -> &str {
        &self.plugin
    }

    fn get(&self, name: &str, ty: OptionType) -> &Value {
        match self.types.get(name) {
            Some(t) if *t == ty || (ty == OptionType::Float && *t == OptionType::Int) => &self.values[name],
            Some(t) => panic!(
                "option '{name}' of plugin '{}' is declared {} but read as {}",
                self.plugin,
                t.as_str(),
                ty.as_str()
            ),
            None => panic!("option '{name}' is not declared in the manifest of plugin '{}'", self.plugin),
        }
    }

    /// A number option; `None` when it has no default and was not given.
    pub fn opt_float(&self, name: &str) -> Option<f64> {
        self.get(name, OptionType::Float).as_f64()
    }
    /// A number option with a default.
    pub fn float(&self, name: &str) -> f64 {
        self.opt_float(name).unwrap_or(f64::NAN)
    }
    /// A whole-number option; `None` when unset.
    pub fn opt_int(&self, name: &str) -> Option<i64> {
        self.get(name, OptionType::Int).as_i64()
    }
    /// A whole-number option with a default.
    pub fn int(&self, name: &str) -> i64 {
        self.opt_int(name).unwrap_or(0)
    }
    /// A bool option with a default.
    pub fn bool(&self, name: &str) -> bool {
        self.get(name, OptionType::Bool).as_bool().unwrap_or(false)
    }
    /// A text option; `None` when unset.
    pub fn opt_string(&self, name: &str) -> Option<String> {
        self.get(name, OptionType::String).as_str().map(str::to_string)
    }
    /// A list-of-numbers option (empty when unset).
    pub fn float_list(&self, name: &str) -> Vec<f64> {
        match self.get(name, OptionType::FloatList) {
            Value::Array(a) => a.iter().filter_map(Value::as_f64).collect(),
            _ => Vec::new(),
        }
    }
    /// A list-of-integers option (empty when unset).
    pub fn int_list(&self, name: &str) -> Vec<i64> {
        match self.get(name, OptionType::IntList) {
            Value::Array(a) => a.iter().filter_map(Value::as_i64).collect(),
            _ => Vec::new(),
        }
    }
    /// A list-of-strings option (empty when unset).
    pub fn string_list(&self, name: &str) -> Vec<String> {
        match self.get(name, OptionType::StringList) {
            Value::Array(a) => a.iter().filter_map(|v| v.as_str().map(str::to_string)).collect(),
            _ => Vec::new(),
        }
    }
    /// A `[β1, β2]` pair of decay rates (Adam-style optimizers): exactly two values, each in
    /// [0, 1). Problems are recorded; the returned pair is only meaningful when
    /// [`finish`](Self::finish) succeeds.
    pub fn betas(&mut self, name: &str) -> [f64; 2] {
        let betas = self.float_list(name);
        self.check(betas.len() == 2, || format!("option '{name}': expected 2 values [β1, β2], got {}", betas.len()));
        for (i, b) in betas.iter().enumerate() {
            self.check((0.0..1.0).contains(b), || format!("option '{name}': β{} = {b} must be in [0, 1)", i + 1));
        }
        match betas[..] {
            [b1, b2] => [b1, b2],
            _ => [0.0, 0.0],
        }
    }

    /// A byte-size option in bytes; `None` when unset.
    pub fn opt_size(&self, name: &str) -> Option<u64> {
        self.get(name, OptionType::Size).as_u64()
    }

    /// Whether option `name` was given or has a non-null default.
    pub fn is_set(&self, name: &str) -> bool {
        self.values.get(name).is_some_and(|v| !v.is_null())
    }

    /// Records `problem` unless `ok`. Use for range checks: `o.check(b < 1.0, "...")`.
    pub fn check(&mut self, ok: bool, problem: impl FnOnce() -> String) -> &mut Self {
        if !ok {
            self.problems.push(problem());
        }
        self
    }

    /// Records a problem unconditionally.
    pub fn problem(&mut self, problem: impl Into<String>) {
        self.problems.push(problem.into());
    }

    /// Problems so far.
    pub fn problems(&self) -> &[String] {
        &self.problems
    }

    /// `Err` with every recorded problem, or `Ok` if there were none.
    pub fn finish(&self) -> Result<(), PluginError> {
        if self.problems.is_empty() { Ok(()) } else { Err(PluginError::invalid_options(self.problems.clone())) }
    }

    /// The effective values (defaults filled in) as a JSON object, for display.
    pub fn to_json(&self) -> Value {
        Value::Object(self.values.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "nothing",
        Value::Bool(_) => "a bool",
        Value::Number(n) if n.is_f64() => "a number",
        Value::Number(_) => "an integer",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "a table",
    }
}

/// Checks (without converting) that `v` has type `ty`, as used for manifest defaults.
pub(crate) fn check_type(ty: OptionType, v: &Value) -> Result<(), String> {
    coerce(ty, v.clone()).map(|_| ())
}

/// Converts a config value to the option's type. Text that spells a value of the right type
/// is accepted (environment variables arrive as text).
fn coerce(ty: OptionType, v: Value) -> Result<Value, String> {
    let want = ty.as_str();
    let bad = |v: &Value| format!("expected {want}, got {} ({v})", type_name(v));
    match ty {
        OptionType::Bool => match &v {
            Value::Bool(_) => Ok(v),
            Value::String(s) if s == "true" || s == "false" => Ok(Value::Bool(s == "true")),
            _ => Err(bad(&v)),
        },
        OptionType::Int => match &v {
            Value::Number(n) if n.is_i64() || n.is_u64() => Ok(v),
            Value::Number(n) if n.as_f64().is_some_and(|f| f.fract() == 0.0 && f.abs() < 9.0e15) => {
                Ok(Value::from(n.as_f64().unwrap_or(0.0) as i64))
            }
            Value::String(s) => s.trim().parse::<i64>().map(Value::from).map_err(|_| bad(&v)),
            _ => Err(bad(&v)),
        },
        OptionType::Float => match &v {
            Value::Number(n) => Ok(Value::from(n.as_f64().unwrap_or(f64::NAN))),
            Value::String(s) => match s.trim().parse::<f64>() {
                Ok(f) if f.is_finite() => Ok(Value::from(f)),
                _ => Err(bad(&v)),
            },
            _ => Err(bad(&v)),
        },
        OptionType::String => match &v {
            Value::String(_) => Ok(v),
            _ => Err(bad(&v)),
        },
        OptionType::FloatList | OptionType::IntList | OptionType::StringList => {
            let item_ty = match ty {
                OptionType::FloatList => OptionType::Float,
                OptionType::IntList => OptionType::Int,
                _ => OptionType::String,
            };
            match v {
                Value::Array(items) => {
                    let mut out = Vec::with_capacity(items.len());
                    for (i, item) in items.into_iter().enumerate() {
                        out.push(coerce(item_ty, item).map_err(|e| format!("item {i}: {e}"))?);
                    }
                    Ok(Value::Array(out))
                }
                other => Err(bad(&other)),
            }
        }
        OptionType::Size => match &v {
            Value::Number(n) if n.is_u64() => Ok(v),
            Value::String(s) => parse_size(s).map(Value::from).map_err(|e| format!("{e} (e.g. 1.5GiB, 512MiB, 4096)")),
            _ => Err(bad(&v)),
        },
    }
}

/// Parses a byte size: `4096`, `512KiB`, `1.5GiB`, `2GB` (SI and binary suffixes, case-insensitive,
/// optional space and trailing `B`).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let num: f64 = num.parse().map_err(|_| format!("{text:?} is not a byte size"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "t" | "tb" => 1e12,
        "ki" | "kib" => 1024.0,
        "mi" | "mib" => 1024.0 * 1024.0,
        "gi" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "ti" | "tib" => 1024.0f64.powi(4),
        _ => return Err(format!("{text:?} has an unknown size unit {unit:?}")),
    };
    let bytes = num * mult;
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
        return Err(format!("{text:?} is out of range"));
    }
    Ok(bytes.round() as u64)
}

/// A byte count for people, in the largest binary unit up to GiB that keeps the number at
/// least 1: `512 B`, `64.00 KiB`, `1.50 GiB` (what [`parse_size`] reads back).
pub fn format_size(bytes: u64) -> String {
    const UNITS: [(&str, u64); 3] = [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    for (unit, size) in UNITS {
        if bytes >= size {
            return format!("{:.2} {unit}", bytes as f64 / size as f64);
        }
    }
    format!("{bytes} B")
}

/// Edit distance between two strings, counting a swap of two neighbours as one edit
/// (optimal string alignment), by characters.
pub fn edit_distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    // d[i][j]: distance between a[..i] and b[..j]
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut best = (d[i - 1][j] + 1).min(d[i][j - 1] + 1).min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                best = best.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = best;
        }
    }
    d[a.len()][b.len()]
}

/// The closest candidate to `word` if it is close enough to be a likely typo (distance at most
/// a third of the word's length, at least 1), or `word` is a prefix of it.
pub fn did_you_mean<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let limit = (word.chars().count() / 3).max(1);
    candidates
        .into_iter()
        .map(|c| (edit_distance(word, c), c))
        .filter(|(d, c)| *d <= limit || (word.len() >= 3 && c.starts_with(word)))
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{OptionSpec, PluginKind};

    fn manifest() -> Manifest {
        Manifest::new("t", PluginKind::Optimizer, "0.1.0", "test")
            .option(OptionSpec::float_list("betas", &[0.9, 0.99], "betas"))
            .option(OptionSpec::int("block_size", 256, "block"))
            .option(OptionSpec::bool("nesterov", false, "n"))
            .option(OptionSpec::optional("budget", OptionType::Size, "b"))
    }

    #[test]
    fn defaults_fill_in() {
        let o = Options::parse(&manifest(), "");
        assert_eq!(o.float_list("betas"), vec![0.9, 0.99]);
        assert_eq!(o.int("block_size"), 256);
        assert!(!o.bool("nesterov"));
        assert_eq!(o.opt_size("budget"), None);
        o.finish().unwrap();
    }

    #[test]
    fn all_problems_reported_at_once() {
        let o = Options::parse(&manifest(), r#"{"beats": [1], "block_size": "x", "nesterov": 3}"#);
        let err = o.finish().unwrap_err();
        let details: Vec<&str> = err.details().collect();
        assert_eq!(details.len(), 3, "{details:?}");
        assert!(details.contains(&"unknown option 'beats' (did you mean 'betas'?)"), "{details:?}");
        assert!(details.contains(&"option 'block_size': expected integer, got a string (\"x\")"), "{details:?}");
        assert!(details.contains(&"option 'nesterov': expected bool, got an integer (3)"), "{details:?}");
    }

    #[test]
    fn text_values_are_coerced() {
        let o = Options::parse(&manifest(), r#"{"block_size": "2048", "nesterov": "true", "budget": "1.5GiB"}"#);
        o.finish().unwrap();
        assert_eq!(o.int("block_size"), 2048);
        assert!(o.bool("nesterov"));
        assert_eq!(o.opt_size("budget"), Some(1_610_612_736));
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("512 KiB").unwrap(), 512 * 1024);
        assert_eq!(parse_size("2GB").unwrap(), 2_000_000_000);
        assert!(parse_size("3 parsecs").is_err());
        assert!(parse_size("").is_err());
    }

    #[test]
    fn suggestions() {
        assert_eq!(did_you_mean("optimiser", ["optimizer", "attention"]), Some("optimizer"));
        assert_eq!(did_you_mean("xyz", ["optimizer", "attention"]), None);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("beats", "betas"), 1);
    }
}
