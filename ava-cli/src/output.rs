//! The one printer every command writes through: results to stdout as text or JSON,
//! messages (warnings, notes) to stderr, honouring `-q` / `-v`.
//!
//! Text from outside (a tokenizer's tokens, a key or value in a config file, a file name)
//! reaches a terminal through here, so its control characters are shown rather than obeyed
//! ([`printable`]): on stderr always, on stdout when it is a terminal (a pipe or a file gets
//! a result's bytes as they are). JSON escapes them itself.

use std::borrow::Cow;
use std::io::{IsTerminal, Write};

use clap::ValueEnum;
use serde_json::Value;

/// `--format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// Tables and sentences for people.
    Text,
    /// One JSON document on stdout, for scripts.
    Json,
}

/// Writes results and messages.
pub struct Printer {
    /// Output format of results.
    pub format: Format,
    /// 0 = quiet, 1 = normal, 2+ = verbose.
    pub verbosity: u8,
}

impl Printer {
    /// Prints a result: `text` in text mode, `json` in JSON mode.
    pub fn result(&self, text: impl FnOnce() -> String, json: impl FnOnce() -> Value) {
        let mut out = std::io::stdout().lock();
        let _ = match self.format {
            Format::Text => {
                let t = text();
                if t.is_empty() { Ok(()) } else { writeln!(out, "{}", for_stdout(t.trim_end_matches('\n'))) }
            }
            Format::Json => writeln!(out, "{}", serde_json::to_string_pretty(&json()).unwrap_or_default()),
        };
    }

    /// Part of a text result as it is made (generated text, token by token): written to
    /// stdout at once in text mode; nothing in JSON mode, whose result comes whole at the end.
    pub fn stream(&self, text: &str) {
        if self.format == Format::Text {
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(for_stdout(text).as_bytes()).and_then(|_| out.flush());
        }
    }

    /// A warning on stderr (shown unless `-q`).
    pub fn warn(&self, msg: &str) {
        if self.verbosity >= 1 {
            eprintln!("warning: {}", printable(msg));
        }
    }

    /// A note on stderr (shown unless `-q`; in JSON mode too, since stdout stays clean).
    pub fn note(&self, msg: &str) {
        if self.verbosity >= 1 {
            eprintln!("{}", printable(msg));
        }
    }

    /// A detail shown only with `-v`.
    pub fn verbose(&self, msg: &str) {
        if self.verbosity >= 2 {
            eprintln!("{}", printable(msg));
        }
    }
}

/// `text` with the control characters a terminal would obey written out instead: every C0
/// control but line feed and tab (carriage return, backspace and ESC included), DEL, and the
/// C1 controls become `\u{..}` escapes, so text from outside cannot move the cursor, clear
/// the screen, retitle the window or hide what follows it; so do the Unicode bidirectional
/// controls (embeddings, overrides, isolates and marks), which reorder what a terminal shows
/// so that a line reads other than it is.
pub fn printable(text: &str) -> Cow<'_, str> {
    let bidi =
        |c: char| matches!(c, '\u{200e}' | '\u{200f}' | '\u{061c}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
    let obeyed = |c: char| (c.is_control() && c != '\n' && c != '\t') || bidi(c);
    if !text.chars().any(obeyed) {
        return Cow::Borrowed(text);
    }
    Cow::Owned(text.chars().map(|c| if obeyed(c) { c.escape_unicode().to_string() } else { c.to_string() }).collect())
}

/// `text` for stdout: [`printable`] when stdout is a terminal, as it is otherwise.
fn for_stdout(text: &str) -> Cow<'_, str> {
    if std::io::stdout().is_terminal() { printable(text) } else { Cow::Borrowed(text) }
}

/// Renders rows as an aligned table with a header line.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            widths[i] = widths[i].max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut s = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                s.push_str(c);
            } else {
                s.push_str(&format!("{c:<w$}  ", w = widths[i]));
            }
        }
        s.trim_end().to_string()
    };
    let mut out = line(headers.to_vec());
    for row in rows {
        out.push('\n');
        out.push_str(&line(row.iter().map(String::as_str).collect()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::printable;

    #[test]
    fn control_characters_are_shown_not_obeyed() {
        assert_eq!(printable("plain text\n\tindented é 中"), "plain text\n\tindented é 中");
        assert_eq!(printable("key \u{1b}[2Jx"), "key \\u{1b}[2Jx");
        assert_eq!(printable("a\rb\u{8}c\u{7f}d\u{9b}e\u{0}"), "a\\u{d}b\\u{8}c\\u{7f}d\\u{9b}e\\u{0}");
        // Bidirectional overrides and isolates would show `abc` where the text is `cba`.
        assert_eq!(
            printable("x\u{202e}cba\u{202c}\u{2067}y\u{2069}\u{200f}"),
            "x\\u{202e}cba\\u{202c}\\u{2067}y\\u{2069}\\u{200f}"
        );
    }
}
