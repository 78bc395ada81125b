//! The README's commands still run as written: every `ava` command in its `sh` blocks is
//! parsed as `ava` parses its arguments (the subcommand, every flag and its value), and the
//! config it names (`-c FILE` from the repository root, every `--set`) loads. Not their
//! timings or outputs: those need the machines they were measured on.
//!
//! Shell words are split as `sh` would for the forms the README uses ('…', "…", `$'…'`,
//! backslash line continuations, `&&` and `;` between commands, `for … do … done`); a
//! variable (`$F`, `$o`) stands for one word.

use std::path::{Path, PathBuf};

use clap::Parser;

use crate::cli::{Cli, Command};

/// The repository root.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("ava-cli is in the workspace").to_path_buf()
}

/// The lines of the README's `sh` blocks, continuations joined, with their line numbers.
fn sh_lines(readme: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let (mut inside, mut pending): (bool, Option<(usize, String)>) = (false, None);
    for (i, line) in readme.lines().enumerate() {
        if line.starts_with("```") {
            inside = line.trim() == "```sh";
            continue;
        }
        if !inside {
            continue;
        }
        let (number, mut text) = pending.take().unwrap_or((i + 1, String::new()));
        text.push_str(line.trim_end());
        match text.strip_suffix('\\') {
            Some(head) => pending = Some((number, format!("{head} "))),
            None => out.push((number, text)),
        }
    }
    out
}

/// `line` as shell words, each command (split at `&&`, `;`, `do`, `done`) apart; a comment
/// ends it. A variable or command substitution becomes the word `x`.
fn commands(line: &str) -> Vec<Vec<String>> {
    let (mut all, mut words, mut word, mut in_word) = (Vec::new(), Vec::new(), String::new(), false);
    let mut chars = line.chars().peekable();
    let end_word = |words: &mut Vec<String>, word: &mut String, in_word: &mut bool| {
        if std::mem::take(in_word) {
            words.push(std::mem::take(word));
        }
    };
    while let Some(c) = chars.next() {
        match c {
            '#' if !in_word => break,
            ' ' | '\t' => end_word(&mut words, &mut word, &mut in_word),
            ';' | '&' => {
                end_word(&mut words, &mut word, &mut in_word);
                if c == '&' {
                    chars.next_if_eq(&'&');
                }
                all.push(std::mem::take(&mut words));
            }
            '\'' => {
                in_word = true;
                word.extend(chars.by_ref().take_while(|&c| c != '\''));
            }
            '"' => {
                in_word = true;
                word.extend(chars.by_ref().take_while(|&c| c != '"'));
            }
            '$' if chars.peek() == Some(&'\'') => {
                chars.next();
                in_word = true;
                let body: String = chars.by_ref().take_while(|&c| c != '\'').collect();
                word.push_str(&body.replace("\\n", "\n").replace("\\t", "\t"));
            }
            '$' => {
                in_word = true;
                word.push('x');
                if chars.next_if_eq(&'(').is_some() {
                    let mut depth = 1;
                    for c in chars.by_ref() {
                        depth += i32::from(c == '(') - i32::from(c == ')');
                        if depth == 0 {
                            break;
                        }
                    }
                } else {
                    while chars.next_if(|c| c.is_ascii_alphanumeric() || *c == '_').is_some() {}
                }
            }
            c => {
                in_word = true;
                word.push(c);
            }
        }
    }
    end_word(&mut words, &mut word, &mut in_word);
    all.push(words);
    all.into_iter()
        .map(|mut w| {
            // `for o in …; do` and `done` only frame the commands.
            while w.first().is_some_and(|f| f == "do" || f == "done") {
                w.remove(0);
            }
            w
        })
        .filter(|w| !w.is_empty())
        .collect()
}

/// The arguments after `ava` of a command that runs it (directly, as `./target/release/ava`,
/// or under `mpirun`), environment assignments before it skipped.
fn ava_args(words: &[String]) -> Option<Vec<String>> {
    let at = words.iter().position(|w| w == "ava" || w.ends_with("/ava"))?;
    let before_ok =
        words[..at].iter().all(|w| w.contains('=') || w == "mpirun" || w == "-np" || w.parse::<u32>().is_ok());
    before_ok.then(|| words[at + 1..].to_vec())
}

/// Why the config a parsed command names would not load, if it would not. `given` says
/// whether the command's own words name a file: clap also reads `AVA_CONFIG` from the
/// environment of whoever runs the test, which a reader of the README does not have.
fn config_problem(cli: &Cli, given: bool) -> Option<String> {
    let config = match &cli.command {
        Command::Train(a) => &a.config,
        Command::Estimate { config, .. } => config,
        Command::Plan(a) => &a.config,
        _ => return None,
    };
    let mut loader = ava_train::config::ConfigLoader::new().sets(config.set.iter().cloned());
    if let Some(file) = config.config.as_ref().filter(|_| given) {
        loader = loader.file(root().join(file));
    }
    loader.load().err().map(|e| e.to_string())
}

#[test]
fn every_ava_command_in_the_readme_parses_and_its_config_loads() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let mut problems = Vec::new();
    let mut checked = 0;
    for (number, line) in sh_lines(&readme) {
        for words in commands(&line) {
            let Some(args) = ava_args(&words) else { continue };
            checked += 1;
            let parsed = Cli::try_parse_from(std::iter::once("ava".to_string()).chain(args.iter().cloned()));
            match parsed {
                Err(e) => problems.push(format!("README.md:{number}: ava {}: {}", args.join(" "), e.kind())),
                Ok(cli) => {
                    let given = args.iter().any(|a| a.starts_with("-c") || a.starts_with("--config"));
                    if let Some(p) = config_problem(&cli, given) {
                        problems.push(format!("README.md:{number}: ava {}: {p}", args.join(" ")));
                    }
                }
            }
        }
    }
    assert!(checked >= 40, "only {checked} ava commands found in the README's sh blocks");
    assert!(problems.is_empty(), "{} README commands do not run as written:\n{}", problems.len(), problems.join("\n"));
}

#[test]
fn shell_words_are_split_as_sh_splits_them() {
    let words = |s: &str| commands(s);
    assert_eq!(
        words("ava train --set 'a={b: 1}' --max-steps 2   # a comment"),
        vec![vec!["ava", "train", "--set", "a={b: 1}", "--max-steps", "2"]]
    );
    assert_eq!(
        words("cargo build && ./target/release/ava train"),
        vec![vec!["cargo", "build"], vec!["./target/release/ava", "train"]]
    );
    assert_eq!(
        words("ava data prepare $F --separator $'\\n%\\n'"),
        vec![vec!["ava", "data", "prepare", "x", "--separator", "\n%\n"]]
    );
    assert_eq!(
        words("  ava train --set o=$o --prompt \"The best\""),
        vec![vec!["ava", "train", "--set", "o=x", "--prompt", "The best"]]
    );
    assert_eq!(words("F=$(find a -name '*.dat' | sort)"), vec![vec!["F=x"]]);
    assert_eq!(words("for o in a b; do"), vec![vec!["for", "o", "in", "a", "b"]]);
    assert_eq!(
        ava_args(&["mpirun", "-np", "2", "target/release/ava", "train"].map(String::from)),
        Some(vec!["train".to_string()])
    );
    assert_eq!(ava_args(&["cargo", "build"].map(String::from)), None);
}
