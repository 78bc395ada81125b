//! A small line-based editor for block-style YAML mappings: it sets or removes one key of a
//! top-level section (`plugins:` → `optimizer:`) and leaves every other byte as it was, so
//! comments, blank lines, quoting and key order survive. It understands what config files
//! use — a block mapping of block mappings — and refuses (with the line number) anything
//! it cannot edit safely, such as a section written in flow style (`plugins: {...}`).

/// One line: its text without the line terminator, and the terminator (`\n`, `\r\n` or none).
#[derive(Debug, Clone)]
struct Line {
    content: String,
    eol: String,
}

impl Line {
    fn indent(&self) -> usize {
        self.content.len() - self.content.trim_start_matches(' ').len()
    }
    fn is_blank(&self) -> bool {
        self.content.trim().is_empty()
    }
    fn is_comment(&self) -> bool {
        self.content.trim_start().starts_with('#')
    }
    /// Neither blank nor a comment.
    fn has_content(&self) -> bool {
        !self.is_blank() && !self.is_comment()
    }
}

fn split_lines(text: &str) -> Vec<Line> {
    text.split_inclusive('\n')
        .map(|raw| {
            let content = raw.trim_end_matches('\n').trim_end_matches('\r');
            Line { content: content.to_string(), eol: raw[content.len()..].to_string() }
        })
        .collect()
}

fn join_lines(lines: &[Line]) -> String {
    lines.iter().flat_map(|l| [l.content.as_str(), l.eol.as_str()]).collect()
}

/// A `key: rest` line, split.
#[derive(Debug, PartialEq, Eq)]
struct KeyLine<'a> {
    /// The key, unquoted.
    key: String,
    /// The line up to and including the colon (indentation and key as written).
    head: &'a str,
    /// Everything after the colon.
    rest: &'a str,
}

/// Splits `  key: value  # comment` at its colon; `None` when the line is not a mapping key.
fn parse_key(content: &str) -> Option<KeyLine<'_>> {
    let start = content.len() - content.trim_start_matches(' ').len();
    let body = &content[start..];
    let (key, after_key) = match body.chars().next()? {
        quote @ ('\'' | '"') => {
            let mut escaped = false;
            let mut end = None;
            let mut chars = body.char_indices().skip(1).peekable();
            while let Some((i, c)) = chars.next() {
                if quote == '"' && escaped {
                    escaped = false;
                } else if quote == '"' && c == '\\' {
                    escaped = true;
                } else if c == quote {
                    if quote == '\'' && chars.peek().is_some_and(|(_, n)| *n == '\'') {
                        chars.next();
                        continue;
                    }
                    end = Some(i);
                    break;
                }
            }
            let end = end?;
            let raw = &body[..=end];
            let key = if quote == '"' {
                serde_json::from_str::<String>(raw).unwrap_or_else(|_| raw[1..end].to_string())
            } else {
                raw[1..end].replace("''", "'")
            };
            let after = body[end + 1..].trim_start_matches(' ');
            if !after.starts_with(':') {
                return None;
            }
            (key, start + body.len() - after.len())
        }
        '-' | '?' | ':' if body[1..].starts_with([' ', '\t']) || body.len() == 1 => return None,
        '[' | '{' | '#' | '&' | '*' | '!' | '|' | '>' | '%' | '@' | '`' | ',' | ']' | '}' => return None,
        _ => {
            let bytes = body.as_bytes();
            let colon = (0..bytes.len()).find(|&i| {
                bytes[i] == b':' && (i + 1 == bytes.len() || bytes[i + 1] == b' ' || bytes[i + 1] == b'\t')
            })?;
            if body[..colon].contains(" #") {
                return None;
            }
            (body[..colon].trim_end().to_string(), start + colon)
        }
    };
    let colon = after_key;
    let rest = &content[colon + 1..];
    if !(rest.is_empty() || rest.starts_with([' ', '\t'])) {
        return None;
    }
    Some(KeyLine { key, head: &content[..=colon], rest })
}

/// Splits the text after a colon into the value and the trailing comment (with the spaces
/// before it): ` lion  # fast` → (` lion`, `  # fast`).
fn split_comment(rest: &str) -> (&str, &str) {
    let mut quote: Option<char> = None;
    let mut prev = ' ';
    let mut escaped = false;
    for (i, c) in rest.char_indices() {
        match quote {
            Some('"') if escaped => escaped = false,
            Some('"') if c == '\\' => escaped = true,
            Some(q) if c == q => quote = None,
            Some(_) => {}
            None if (c == '\'' || c == '"') && (prev.is_whitespace() || "[{,:".contains(prev)) => quote = Some(c),
            None if c == '#' && prev.is_whitespace() => {
                let value = rest[..i].trim_end_matches([' ', '\t']);
                return (value, &rest[value.len()..]);
            }
            None => {}
        }
        prev = c;
    }
    (rest, "")
}

/// Sets `section.key` to `value` (YAML text for one line, e.g. `lion` or
/// `{name: lion, betas: [0.9, 0.98]}`), or removes the key when `value` is `None`.
///
/// A missing section is appended at the end of the file, a missing key after the last key of
/// the section. Replacing a key replaces its value, including an indented block under it,
/// and keeps its trailing comment. Removing the last key of a section also removes the
/// section line, unless comments remain in the section or on that line.
pub(crate) fn set_key(text: &str, section: &str, key: &str, value: Option<&str>) -> Result<String, String> {
    let eol = if text.contains("\r\n") { "\r\n" } else { "\n" };
    let mut lines = split_lines(text);

    let section_at = lines
        .iter()
        .position(|l| l.indent() == 0 && l.has_content() && parse_key(&l.content).is_some_and(|k| k.key == section));
    let Some(s) = section_at else {
        let Some(value) = value else { return Ok(text.to_string()) };
        // A file without a final line break keeps having none (so that removing the key
        // again gives back the same bytes).
        let mut out = text.to_string();
        let last_eol = if !out.is_empty() && !out.ends_with('\n') {
            out.push_str(eol);
            ""
        } else {
            eol
        };
        out.push_str(&format!("{section}:{eol}  {key}: {value}{last_eol}"));
        return Ok(out);
    };

    // The section line: `plugins:`, possibly with a comment or an empty value.
    let line_no = |i: usize| i + 1;
    let section_comment = {
        let parsed = parse_key(&lines[s].content).expect("matched above");
        let (inline, comment) = split_comment(parsed.rest);
        let has_comment = !comment.is_empty();
        match inline.trim() {
            "" => {}
            "~" | "null" | "Null" | "NULL" => {
                lines[s].content = format!("{}{comment}", parsed.head);
            }
            other => {
                return Err(format!(
                    "line {}: `{section}:` has its value on the same line ({other}); only block-style sections \
                     (one key per line) can be edited — rewrite it that way, or edit the file by hand",
                    line_no(s)
                ));
            }
        }
        has_comment
    };

    let end = (s + 1..lines.len()).find(|&i| lines[i].has_content() && lines[i].indent() == 0).unwrap_or(lines.len());
    let child_indent = (s + 1..end).find(|&i| lines[i].has_content()).map(|i| lines[i].indent());

    // The keys of the section: (line, key, last line of its value).
    let mut children: Vec<(usize, String, usize)> = Vec::new();
    if let Some(ci) = child_indent {
        for (i, line) in lines.iter().enumerate().take(end).skip(s + 1) {
            if !line.has_content() || line.indent() > ci {
                continue;
            }
            if line.indent() < ci {
                return Err(format!("line {}: indented less than the other keys of `{section}:`", line_no(i)));
            }
            let Some(parsed) = parse_key(&line.content) else {
                return Err(format!("line {}: expected `key: value` under `{section}:`", line_no(i)));
            };
            children.push((i, parsed.key, i));
        }
        let starts: Vec<usize> = children.iter().map(|c| c.0).collect();
        for (n, child) in children.iter_mut().enumerate() {
            let next = starts.get(n + 1).copied().unwrap_or(end);
            child.2 =
                (child.0 + 1..next).rev().find(|&j| !lines[j].is_blank() && lines[j].indent() > ci).unwrap_or(child.0);
        }
    }

    match (children.iter().find(|c| c.1 == key), value) {
        (Some(&(at, _, last)), Some(value)) => {
            let parsed = parse_key(&lines[at].content).expect("parsed above");
            let (_, comment) = split_comment(parsed.rest);
            let new = Line { content: format!("{} {value}{comment}", parsed.head), eol: lines[last].eol.clone() };
            lines.splice(at..=last, [new]);
        }
        (Some(&(at, _, last)), None) => {
            let at_eof_without_eol = last + 1 == lines.len() && lines[last].eol.is_empty();
            lines.drain(at..=last);
            let end = end - (last + 1 - at);
            let section_empty = (s + 1..end).all(|i| lines[i].is_blank());
            if section_empty && !section_comment {
                lines.remove(s);
            }
            if at_eof_without_eol && let Some(prev) = lines.last_mut() {
                prev.eol.clear();
            }
        }
        (None, Some(value)) => {
            let indent = child_indent
                .or_else(|| {
                    (s + 1..end).find(|&i| lines[i].is_comment() && lines[i].indent() > 0).map(|i| lines[i].indent())
                })
                .unwrap_or(2);
            let after = children.last().map_or(s, |c| c.2);
            let mut new = Line { content: format!("{:indent$}{key}: {value}", ""), eol: eol.to_string() };
            if lines[after].eol.is_empty() {
                lines[after].eol = eol.to_string();
                new.eol.clear();
            }
            lines.insert(after + 1, new);
        }
        (None, None) => {}
    }
    Ok(join_lines(&lines))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_key_lines() {
        let k = parse_key("  optimizer: lion  # fast").unwrap();
        assert_eq!((k.key.as_str(), k.head, k.rest), ("optimizer", "  optimizer:", " lion  # fast"));
        assert_eq!(parse_key("plugins:").unwrap().key, "plugins");
        assert_eq!(parse_key("'a''b': 1").unwrap().key, "a'b");
        assert_eq!(parse_key("\"x y\" : 1").unwrap().key, "x y");
        assert_eq!(parse_key("- item"), None);
        assert_eq!(parse_key("url: http://x"), parse_key("url: http://x"));
        assert_eq!(parse_key("a:b"), None);
        assert_eq!(parse_key("# c: d"), None);
    }

    #[test]
    fn splits_comments_outside_quotes() {
        assert_eq!(split_comment(" lion  # fast"), (" lion", "  # fast"));
        assert_eq!(split_comment(" 'a # b' # c"), (" 'a # b'", " # c"));
        assert_eq!(split_comment(" {name: \"x#y\", z: 1}"), (" {name: \"x#y\", z: 1}", ""));
        assert_eq!(split_comment(" it's # c"), (" it's", " # c"));
        assert_eq!(split_comment(" a#b"), (" a#b", ""));
    }

    #[test]
    fn replaces_a_nested_block_and_keeps_the_rest() {
        let text = "# top\nplugins:\n  optimizer:   # mine\n    name: lion\n    # betas: [1, 2]\n    lr: 0.1\n\n  # the memory policy\n  memory: thresholds\nother: 1\n";
        let out = set_key(text, "plugins", "optimizer", Some("sgd")).unwrap();
        assert_eq!(
            out,
            "# top\nplugins:\n  optimizer: sgd   # mine\n\n  # the memory policy\n  memory: thresholds\nother: 1\n"
        );
    }

    #[test]
    fn appends_keys_and_sections() {
        assert_eq!(set_key("", "plugins", "optimizer", Some("lion")).unwrap(), "plugins:\n  optimizer: lion\n");
        assert_eq!(set_key("a: 1", "plugins", "optimizer", Some("lion")).unwrap(), "a: 1\nplugins:\n  optimizer: lion");
        assert_eq!(
            set_key("plugins:\n    attention: flash\nb: 2\n", "plugins", "optimizer", Some("lion")).unwrap(),
            "plugins:\n    attention: flash\n    optimizer: lion\nb: 2\n"
        );
        assert_eq!(
            set_key("plugins:  # none yet\n  # optimizer: adamw\n", "plugins", "optimizer", Some("lion")).unwrap(),
            "plugins:  # none yet\n  optimizer: lion\n  # optimizer: adamw\n"
        );
        assert_eq!(
            set_key("plugins: ~  # c\n", "plugins", "memory", Some("x")).unwrap(),
            "plugins:  # c\n  memory: x\n"
        );
        assert_eq!(
            set_key("plugins:\r\n  attention: flash", "plugins", "memory", Some("x")).unwrap(),
            "plugins:\r\n  attention: flash\r\n  memory: x"
        );
    }

    #[test]
    fn removal_undoes_insertion() {
        for text in [
            "",
            "a: 1\n",
            "a: 1",
            "plugins:\n  attention: flash\n",
            "plugins:\n  attention: flash",
            "plugins:\n  # nothing\n",
            "plugins:   # mine\nb: 2\n",
            "plugins:\r\n  attention: flash\r\n\r\n# end\r\n",
        ] {
            let added = set_key(text, "plugins", "optimizer", Some("{name: lion, lr: 0.1}")).unwrap();
            assert_ne!(added, text);
            assert_eq!(set_key(&added, "plugins", "optimizer", None).unwrap(), text, "{text:?} -> {added:?}");
        }
    }

    #[test]
    fn refuses_flow_sections_and_odd_blocks() {
        let e = set_key("plugins: {optimizer: lion}\n", "plugins", "memory", Some("x")).unwrap_err();
        assert!(e.starts_with("line 1: `plugins:` has its value on the same line ({optimizer: lion})"), "{e}");
        let e = set_key("plugins:\n  - a\n", "plugins", "memory", Some("x")).unwrap_err();
        assert_eq!(e, "line 2: expected `key: value` under `plugins:`");
    }
}
