//! A bound on YAML text before it is loaded: the expanded size and the nesting depth.
//!
//! Why: yaml-rust2's loader (under the `config` crate) expands every alias into a full copy
//! of what its anchor names, so a 300-byte "billion laughs" document of nested aliases
//! becomes gigabytes of values. This module walks the parser's event stream (which never
//! expands anything), counts each alias as the size of what it repeats, and refuses the
//! document before the loader sees it. The same walk knows each value's key path, so a
//! non-finite number (`.nan`, `.inf`, `1e999`), which the loader turns into a bare error,
//! is reported at its key instead.
//!
//! Config files, `--set` values and `AVA__*` variables (ava-train) and YAML lock files
//! (here) all pass through [`check`].

use std::collections::HashMap;

use yaml_rust2::parser::{Event, Parser};
use yaml_rust2::scanner::TScalarStyle;

/// Limits of a YAML document. Real configs and lock files are far below them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct YamlLimits {
    /// Values (scalars, lists, tables) after expanding aliases.
    pub nodes: u64,
    /// Bytes of scalar text after expanding aliases.
    pub text_bytes: u64,
    /// Nesting depth of lists and tables.
    pub depth: usize,
}

impl YamlLimits {
    /// The limits for config files, `--set`/`AVA__*` values and lock files.
    pub const DEFAULT: YamlLimits = YamlLimits { nodes: 100_000, text_bytes: 16 << 20, depth: 64 };
}

/// Why a YAML document was refused. The caller says which file, flag or variable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum YamlGuardError {
    /// Too many values once aliases are expanded.
    #[error(
        "line {line}: the YAML expands to more than {limit} values (each alias counts as all the values it repeats); \
         is it an alias bomb? write the values out, or use fewer aliases"
    )]
    TooManyNodes {
        /// The limit.
        limit: u64,
        /// 1-based line where the limit was passed.
        line: usize,
    },
    /// Too much scalar text once aliases are expanded.
    #[error(
        "line {line}: the YAML expands to more than {limit} bytes of text (each alias counts as all the text it repeats); \
         is it an alias bomb? write the values out, or use fewer aliases"
    )]
    TooMuchText {
        /// The limit.
        limit: u64,
        /// 1-based line where the limit was passed.
        line: usize,
    },
    /// Lists and tables nested too deep.
    #[error("line {line}: lists and tables are nested more than {limit} levels deep; flatten the document")]
    TooDeep {
        /// The limit.
        limit: usize,
        /// 1-based line where the limit was passed.
        line: usize,
    },
    /// `.nan`, `.inf`, `-.inf` or a number too large for a float.
    #[error("{}{text} is not a finite number; write a finite number (e.g. 0.001 or 1e30)", if path.is_empty() { String::new() } else { format!("{path}: ") })]
    NonFinite {
        /// The dotted key path (`train.lr`, `plugins.optimizer.betas[1]`), empty at the top.
        path: String,
        /// The value as written.
        text: String,
        /// 1-based line.
        line: usize,
    },
}

/// One open list or table.
struct Frame {
    /// `Some(expecting_key, last_key)` for a table, `None` for a list.
    map: Option<(bool, String)>,
    /// The next index, for a list.
    index: usize,
    /// Counts when it started, to size it for its anchor.
    start: (u64, u64),
    /// Its anchor id (0: none).
    anchor: usize,
}

/// Checks `text` against `limits`. A syntax error is not reported here (the loader reports it
/// with its position); the walk stops there, and what was seen before it is bounded.
pub fn check(text: &str, limits: &YamlLimits) -> Result<(), YamlGuardError> {
    let mut parser = Parser::new_from_str(text);
    let mut anchors: HashMap<usize, (u64, u64)> = HashMap::new();
    let mut stack: Vec<Frame> = Vec::new();
    let (mut nodes, mut bytes) = (0u64, 0u64);
    loop {
        let Ok((event, mark)) = parser.next_token() else { return Ok(()) };
        let line = mark.line();
        // The value just completed, to advance the enclosing table's key/value state.
        let mut completed = false;
        match event {
            Event::StreamEnd => return Ok(()),
            Event::Scalar(value, style, anchor, tag) => {
                let is_key = matches!(stack.last(), Some(Frame { map: Some((true, _)), .. }));
                if !is_key
                    && style == TScalarStyle::Plain
                    && tag.is_none()
                    && value.parse::<i64>().is_err()
                    && parse_f64(&value).is_some_and(|f| !f.is_finite())
                {
                    return Err(YamlGuardError::NonFinite { path: path_of(&stack), text: value, line });
                }
                nodes += 1;
                bytes = bytes.saturating_add(value.len() as u64);
                if anchor != 0 {
                    anchors.insert(anchor, (1, value.len() as u64));
                }
                if let Some(Frame { map: Some((true, key)), .. }) = stack.last_mut() {
                    *key = value;
                }
                completed = true;
            }
            Event::Alias(id) => {
                let (n, b) = anchors.get(&id).copied().unwrap_or((1, 0));
                nodes = nodes.saturating_add(n);
                bytes = bytes.saturating_add(b);
                if let Some(Frame { map: Some((true, key)), .. }) = stack.last_mut() {
                    *key = "*alias".into();
                }
                completed = true;
            }
            Event::SequenceStart(anchor, _) | Event::MappingStart(anchor, _) => {
                nodes += 1;
                if stack.len() >= limits.depth {
                    return Err(YamlGuardError::TooDeep { limit: limits.depth, line });
                }
                let map = matches!(event, Event::MappingStart(..)).then(|| (true, String::new()));
                stack.push(Frame { map, index: 0, start: (nodes, bytes), anchor });
            }
            Event::SequenceEnd | Event::MappingEnd => {
                if let Some(frame) = stack.pop()
                    && frame.anchor != 0
                {
                    // +1: the collection itself.
                    anchors.insert(frame.anchor, (nodes - frame.start.0 + 1, bytes - frame.start.1));
                }
                completed = true;
            }
            _ => {}
        }
        if nodes > limits.nodes {
            return Err(YamlGuardError::TooManyNodes { limit: limits.nodes, line });
        }
        if bytes > limits.text_bytes {
            return Err(YamlGuardError::TooMuchText { limit: limits.text_bytes, line });
        }
        if completed && let Some(frame) = stack.last_mut() {
            match &mut frame.map {
                Some((expecting_key, _)) => *expecting_key = !*expecting_key,
                None => frame.index += 1,
            }
        }
    }
}

/// The dotted key path of the value about to complete.
fn path_of(stack: &[Frame]) -> String {
    let mut out = String::new();
    for frame in stack {
        match &frame.map {
            Some((_, key)) => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(key);
            }
            None => out.push_str(&format!("[{}]", frame.index)),
        }
    }
    out
}

/// The floats yaml-rust2's loader reads from a plain scalar (its own rules, copied: only
/// these spellings or text with a digit).
fn parse_f64(v: &str) -> Option<f64> {
    match v {
        ".inf" | ".Inf" | ".INF" | "+.inf" | "+.Inf" | "+.INF" => Some(f64::INFINITY),
        "-.inf" | "-.Inf" | "-.INF" => Some(f64::NEG_INFINITY),
        ".nan" | ".NaN" | ".NAN" => Some(f64::NAN),
        _ if v.bytes().any(|b| b.is_ascii_digit()) => v.parse::<f64>().ok(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn laughs(levels: usize) -> String {
        let mut s = String::from("a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n");
        for i in 1..levels {
            let p = i - 1;
            s.push_str(&format!("a{i}: &a{i} [*a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}]\n"));
        }
        s
    }

    #[test]
    fn an_alias_bomb_is_refused_before_expansion() {
        let bomb = laughs(9);
        assert!(bomb.len() < 600, "{}", bomb.len());
        let e = check(&bomb, &YamlLimits::DEFAULT).unwrap_err();
        assert!(matches!(e, YamlGuardError::TooManyNodes { limit: 100_000, .. }), "{e:?}");
        assert!(e.to_string().contains("alias bomb"), "{e}");
    }

    #[test]
    fn a_few_aliases_are_fine() {
        check(&laughs(3), &YamlLimits::DEFAULT).unwrap();
        check("base: &b {lr: 0.1}\nother: *b\n", &YamlLimits::DEFAULT).unwrap();
    }

    #[test]
    fn repeated_long_text_is_counted_in_bytes() {
        let s = format!("a: &a '{}'\nb: [{}]\n", "x".repeat(1 << 20), vec!["*a"; 40].join(", "));
        let e = check(&s, &YamlLimits::DEFAULT).unwrap_err();
        assert!(matches!(e, YamlGuardError::TooMuchText { .. }), "{e:?}");
    }

    #[test]
    fn deep_nesting_is_refused() {
        let s = format!("{}{}", "[".repeat(100), "]".repeat(100));
        let e = check(&s, &YamlLimits::DEFAULT).unwrap_err();
        assert!(matches!(e, YamlGuardError::TooDeep { limit: 64, line: 1 }), "{e:?}");
    }

    #[test]
    fn non_finite_numbers_name_their_key() {
        let e = check("train:\n  lr: .nan\n", &YamlLimits::DEFAULT).unwrap_err();
        assert_eq!(e.to_string(), "train.lr: .nan is not a finite number; write a finite number (e.g. 0.001 or 1e30)");
        let e = check("opt: {betas: [0.9, -.inf]}\n", &YamlLimits::DEFAULT).unwrap_err();
        assert!(e.to_string().starts_with("opt.betas[1]: -.inf is not"), "{e}");
        let e = check("x: 1e999\n", &YamlLimits::DEFAULT).unwrap_err();
        assert!(e.to_string().starts_with("x: 1e999 is not"), "{e}");
        // Quoted, or a word without digits: a string, not a number.
        check("x: '.nan'\ny: inf\nz: nan\n", &YamlLimits::DEFAULT).unwrap();
    }

    #[test]
    fn syntax_errors_are_left_to_the_loader() {
        check("a: [1, 2\n", &YamlLimits::DEFAULT).unwrap();
    }
}
