//! Tests of the configuration system: golden error reports, layering and origins, YAML and
//! TOML files, `config show`, and the editor used by `ava plugins enable/disable`.

use std::fs;
use std::path::{Path, PathBuf};

use ava_core::PluginKind;
use ava_core::options::did_you_mean;
use serde_json::{Map, Value, json};

use super::format::{parse_yaml_value, yaml_flow};
use super::*;

/// Installed: optimizers adamw, lion, sgd; attention standard, flash; checkpoint none, full;
/// offload ram; memory thresholds (options warn, critical in (0, 1]); lion takes lr, betas.
struct FakeCatalog;

impl PluginCatalog for FakeCatalog {
    fn names(&self, kind: PluginKind) -> Vec<String> {
        let names: &[&str] = match kind {
            PluginKind::Optimizer => &["sgd", "adamw", "lion"],
            PluginKind::Attention => &["standard", "flash"],
            PluginKind::Checkpoint => &["none", "full"],
            PluginKind::Offload => &["ram"],
            PluginKind::Memory => &["thresholds"],
        };
        names.iter().map(|s| s.to_string()).collect()
    }

    fn check_options(&self, _kind: PluginKind, name: &str, options_json: &str) -> Result<(), Vec<String>> {
        let options: Map<String, Value> = serde_json::from_str(options_json).expect("options are a JSON object");
        let known: &[&str] = match name {
            "thresholds" => &["warn", "critical"],
            "lion" => &["lr", "betas"],
            _ => &[],
        };
        let mut problems = Vec::new();
        for (key, value) in &options {
            if !known.contains(&key.as_str()) {
                problems.push(match did_you_mean(key, known.iter().copied()) {
                    Some(near) => format!("unknown option '{key}' (did you mean '{near}'?)"),
                    None => format!("unknown option '{key}' ('{name}' takes no options)"),
                });
            } else if name == "thresholds" {
                match value.as_f64() {
                    Some(x) if x > 0.0 && x <= 1.0 => {}
                    Some(x) => problems.push(format!("option '{key}': {x} must be in (0, 1]")),
                    None => problems.push(format!("option '{key}': expected a number")),
                }
            }
        }
        if problems.is_empty() { Ok(()) } else { Err(problems) }
    }
}

fn write(dir: &tempfile::TempDir, name: &str, text: &str) -> PathBuf {
    let path = dir.path().join(name);
    fs::write(&path, text).unwrap();
    path
}

/// The error's text with the temporary directory replaced by `<dir>`.
fn error_text(result: Result<LoadedConfig, ConfigError>, dir: &Path) -> String {
    match result {
        Ok(loaded) => panic!("expected an error, got {:?}", loaded.config()),
        Err(e) => e.to_string().replace(&dir.display().to_string(), "<dir>"),
    }
}

/// Loads `text` as `<dir>/<name>` with the fake catalog, returning the error text.
fn file_error(name: &str, text: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = write(&dir, name, text);
    error_text(ConfigLoader::new().file(&path).catalog(&FakeCatalog).load(), dir.path())
}

// ---------------------------------------------------------------------------------------
// Defaults and schema

#[test]
fn defaults_load_and_are_complete() {
    let loaded = ConfigLoader::new().catalog(&FakeCatalog).load().unwrap();
    let defaults = Config::default();
    assert_eq!(defaults.model.hidden_size, 128);
    assert_eq!(defaults.memory.budget, super::ByteSize(2 << 30));
    assert_eq!(defaults.train.precision, super::Precision::Fp32);
    let expected = Config {
        model: defaults.model.clone(),
        data: defaults.data.clone(),
        train: defaults.train.clone(),
        checkpoints: defaults.checkpoints.clone(),
        memory: defaults.memory.clone(),
        offload: super::OffloadConfig {
            tiers: super::Tiers(vec![super::TierShare { name: "device".into(), fraction: 1.0 }]),
            prefetch: 2,
        },
        distributed: super::DistributedConfig { zero_stage: 0, bucket_size: super::ByteSize(25 << 20) },
        plugins: PluginsConfig {
            attention: PluginSelection::new("standard"),
            optimizer: PluginSelection::new("adamw"),
            checkpoint: PluginSelection::new("none"),
            offload: PluginSelection::new("ram"),
            memory: PluginSelection::new("thresholds"),
            search_paths: vec![],
            policy: VettingPolicy::Open,
            lock_file: PathBuf::from("ava-plugins.lock"),
        },
    };
    assert_eq!(loaded.config(), &expected);
    assert_eq!(Config::default(), expected);
    // Every schema key has a default, and the defaults have no key the schema lacks (the
    // load above validated that).
    for path in schema::all_paths() {
        assert_eq!(loaded.origin(&path), Some(&Origin::Default), "{path} has no default");
    }
    assert!(loaded.entries().iter().all(|e| e.origin == Origin::Default));
    assert!(DEFAULT_CONFIG_YAML.matches('#').count() > 20, "the embedded defaults are documented");
}

#[test]
fn selection_by_kind() {
    let config = Config::default();
    for kind in PluginKind::ALL {
        let via_section = config.plugins.selection(kind);
        assert_eq!(config.selection(kind), via_section);
    }
    assert_eq!(config.selection(PluginKind::Offload).name, "ram");
    let mut plugins = config.plugins.clone();
    plugins.selection_mut(PluginKind::Optimizer).name = "lion".into();
    assert_eq!(plugins.optimizer.name, "lion");
}

#[test]
fn vetting_policy_words() {
    for word in VettingPolicy::NAMES {
        assert_eq!(VettingPolicy::parse(word).unwrap().as_str(), *word);
    }
    assert_eq!(VettingPolicy::parse("vetd"), None);
    assert_eq!(VettingPolicy::Warn.to_string(), "warn");
}

// ---------------------------------------------------------------------------------------
// Golden error reports

#[test]
fn golden_typo_in_nested_key() {
    assert_eq!(
        file_error("bad.yaml", "plugins:\n  optimzer: lion\n"),
        "<dir>/bad.yaml: 1 problem in the configuration:\n  \
         - plugins.optimzer: unknown key (did you mean 'plugins.optimizer'?) [<dir>/bad.yaml]"
    );
}

/// A key spelled as another trainer spells it points at Ava's (`batch_size` is the
/// micro-batch, though `eval_batch_size` is closer in spelling), from any section.
#[test]
fn keys_other_trainers_use_point_at_ours() {
    assert_eq!(
        file_error("bad.yaml", "train:\n  batch_size: 3\n  learning_rate: 0.1\nmodel:\n  n_layer: 4\n"),
        "<dir>/bad.yaml: 3 problems in the configuration:\n  \
         - train.batch_size: unknown key (did you mean 'train.micro_batch_size'?) [<dir>/bad.yaml]\n  \
         - train.learning_rate: unknown key (did you mean 'train.lr'?) [<dir>/bad.yaml]\n  \
         - model.n_layer: unknown key (did you mean 'model.num_layers'?) [<dir>/bad.yaml]"
    );
    let paths = super::schema::all_paths();
    for (names, ours) in super::validate::OTHER_NAMES {
        assert!(paths.iter().any(|p| p == ours), "{names:?} point at {ours}, which is not a key");
        for name in *names {
            assert!(!paths.iter().any(|p| p.rsplit('.').next() == Some(name)), "{name} is a key of Ava's own");
        }
    }
}

/// The model's shape is checked with the rest of the config, every problem at once.
#[test]
fn the_models_shape_is_checked_with_every_problem() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(&dir, "bad.yaml", "model:\n  hidden_size: 130\n  num_heads: 4\n  num_kv_heads: 3\n");
    let catalog = |_: &PluginsConfig| Ok::<_, ()>(FakeCatalog);
    let got = ConfigLoader::new().file(&path).load_checked(catalog).unwrap().map(|(loaded, _)| loaded);
    assert_eq!(
        error_text(got, dir.path()),
        "<dir>/bad.yaml: 2 problems in the configuration:\n  \
         - model: hidden_size (130) must be a multiple of num_heads (4): each head gets hidden_size / num_heads \
         dimensions [<dir>/bad.yaml]\n  \
         - model: num_heads (4) must be a multiple of num_kv_heads (3) for grouped-query attention [<dir>/bad.yaml]"
    );
}

/// An unknown key under `model:` (a typo) does not hide the shape's problems: both are said,
/// the shape checked on the keys the section knows; a known key's bad value still stops the
/// shape check (its number is not known).
#[test]
fn an_unknown_model_key_does_not_hide_the_shapes_problems() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(&dir, "bad.yaml", "model:\n  hiden_size: 100\n  num_heads: 3\n");
    let catalog = |_: &PluginsConfig| Ok::<_, ()>(FakeCatalog);
    let got = ConfigLoader::new().file(&path).load_checked(catalog).unwrap().map(|(loaded, _)| loaded);
    let text = error_text(got, dir.path());
    assert!(text.contains("3 problems in the configuration"), "{text}");
    assert!(text.contains("model.hiden_size: unknown key (did you mean 'model.hidden_size'?)"), "{text}");
    assert!(text.contains("hidden_size (128) must be a multiple of num_heads (3)"), "{text}");
    let path = write(&dir, "typed.yaml", "model:\n  hiden_size: 100\n  num_heads: three\n");
    let got = ConfigLoader::new().file(&path).load_checked(catalog).unwrap().map(|(loaded, _)| loaded);
    let text = error_text(got, dir.path());
    assert!(text.contains("2 problems in the configuration") && text.contains("model.num_heads"), "{text}");
}

#[test]
fn golden_wrong_type() {
    assert_eq!(
        file_error("bad.yaml", "plugins:\n  search_paths: 3\n"),
        "<dir>/bad.yaml: 1 problem in the configuration:\n  \
         - plugins.search_paths: expected a list of paths, got an integer [<dir>/bad.yaml]"
    );
}

/// `train.eval_batch_size` is null (the micro-batch size) by default, and a bad value is
/// named by its key.
#[test]
fn eval_batch_size_defaults_to_the_micro_batch_and_names_its_key() {
    let config = ConfigLoader::new().set("train.micro_batch_size=6").load().unwrap().into_config();
    assert_eq!((config.train.eval_batch_size, config.train.eval_batch()), (None, 6));
    let config = ConfigLoader::new().set("train.eval_batch_size=32").load().unwrap().into_config();
    assert_eq!((config.train.eval_batch_size, config.train.eval_batch()), (Some(32), 32));
    assert_eq!(
        file_error("bad.yaml", "train:\n  eval_batch_size: 0\n"),
        "<dir>/bad.yaml: 1 problem in the configuration:\n  \
         - train.eval_batch_size: 0 is out of range: must be between 1 and 1048576 [<dir>/bad.yaml]"
    );
    assert_eq!(
        file_error("bad.yaml", "train:\n  eval_batch_size: many\n"),
        "<dir>/bad.yaml: 1 problem in the configuration:\n  \
         - train.eval_batch_size: expected an integer or null, got a string [<dir>/bad.yaml]"
    );
}

/// `train.loss_chunk_rows` is 4096 by default (the model's default), 0 turns the blocks off,
/// and a bad value is named by its key.
#[test]
fn loss_chunk_rows_defaults_to_the_models_and_names_its_key() {
    let config = ConfigLoader::new().load().unwrap().into_config();
    assert_eq!(config.train.loss_chunk_rows, crate::model::DEFAULT_LOSS_CHUNK_ROWS);
    assert_eq!(config.train.loss_chunk_rows, 4096);
    let config = ConfigLoader::new().set("train.loss_chunk_rows=0").load().unwrap().into_config();
    assert_eq!(config.train.loss_chunk_rows, 0);
    assert_eq!(
        file_error("bad.yaml", "train:\n  loss_chunk_rows: -1\n"),
        "<dir>/bad.yaml: 1 problem in the configuration:\n  \
         - train.loss_chunk_rows: -1 is out of range: must be between 0 and 1073741824 [<dir>/bad.yaml]"
    );
    assert_eq!(
        file_error("bad.yaml", "train:\n  loss_chunk_rows: all\n"),
        "<dir>/bad.yaml: 1 problem in the configuration:\n  \
         - train.loss_chunk_rows: expected an integer, got a string [<dir>/bad.yaml]"
    );
}

#[test]
fn golden_threshold_out_of_range() {
    assert_eq!(
        file_error("bad.yaml", "plugins:\n  memory: {name: thresholds, critical: 1.5}\n"),
        "<dir>/bad.yaml: 1 problem in the configuration:\n  \
         - plugins.memory.critical: 1.5 must be in (0, 1] [<dir>/bad.yaml]"
    );
    // The same from --set, on top of the default `memory: thresholds`.
    let err = ConfigLoader::new().set("plugins.memory.critical=1.5").catalog(&FakeCatalog).load().unwrap_err();
    assert_eq!(
        err.to_string(),
        "1 problem in the configuration:\n  \
         - plugins.memory.critical: 1.5 must be in (0, 1] [--set plugins.memory.critical=1.5]"
    );
}

#[test]
fn golden_unknown_plugin_with_suggestion() {
    assert_eq!(
        file_error("bad.yaml", "plugins:\n  optimizer: lino\n"),
        "<dir>/bad.yaml: 1 problem in the configuration:\n  \
         - plugins.optimizer: unknown optimizer 'lino' (did you mean 'lion'?); installed: adamw, lion, sgd [<dir>/bad.yaml]"
    );
    assert_eq!(
        file_error("bad.yaml", "plugins:\n  attention: {name: flsh, window: 256}\n"),
        "<dir>/bad.yaml: 1 problem in the configuration:\n  \
         - plugins.attention: unknown attention kernel 'flsh' (did you mean 'flash'?); installed: flash, standard [<dir>/bad.yaml]"
    );
}

#[test]
fn golden_bad_plugin_option() {
    assert_eq!(
        file_error("bad.yaml", "plugins:\n  memory:\n    name: thresholds\n    critcal: 0.9\n"),
        "<dir>/bad.yaml: 1 problem in the configuration:\n  \
         - plugins.memory.critcal: unknown option (did you mean 'critical'?) [<dir>/bad.yaml]"
    );
    assert_eq!(
        file_error("bad.yaml", "plugins:\n  optimizer: {name: sgd, lr: 0.1}\n"),
        "<dir>/bad.yaml: 1 problem in the configuration:\n  \
         - plugins.optimizer.lr: unknown option ('sgd' takes no options) [<dir>/bad.yaml]"
    );
}

#[test]
fn golden_enum_from_environment() {
    let err = ConfigLoader::new().env([("AVA__PLUGINS__POLICY", "vetd")]).load().unwrap_err();
    assert_eq!(
        err.to_string(),
        "1 problem in the configuration:\n  \
         - plugins.policy: 'vetd' is not one of open, warn, vetted (did you mean 'vetted'?) [env AVA__PLUGINS__POLICY]"
    );
}

#[test]
fn golden_table_without_name() {
    assert_eq!(
        file_error("bad.yaml", "plugins:\n  optimizer: {lr: 0.001}\n"),
        "<dir>/bad.yaml: 1 problem in the configuration:\n  \
         - plugins.optimizer: a plugin table needs a 'name': write {name: <plugin>, <option>: <value>, ...} [<dir>/bad.yaml]"
    );
    let err = ConfigLoader::new().set("plugins.optimizer={lr: 0.001}").load().unwrap_err();
    assert_eq!(
        err.to_string(),
        "1 problem in the configuration:\n  \
         - plugins.optimizer: a plugin table needs a 'name': write {name: <plugin>, <option>: <value>, ...} [--set plugins.optimizer={lr: 0.001}]"
    );
}

#[test]
fn all_problems_are_reported_at_once() {
    let text = "\
# three mistakes
plugins:
  optimzer: lion
  policy: vetd
  search_paths: 3
";
    assert_eq!(
        file_error("bad.yaml", text),
        "<dir>/bad.yaml: 3 problems in the configuration:\n  \
         - plugins.optimzer: unknown key (did you mean 'plugins.optimizer'?) [<dir>/bad.yaml]\n  \
         - plugins.policy: 'vetd' is not one of open, warn, vetted (did you mean 'vetted'?) [<dir>/bad.yaml]\n  \
         - plugins.search_paths: expected a list of paths, got an integer [<dir>/bad.yaml]"
    );

    // Across layers too, each with its own origin.
    let dir = tempfile::tempdir().unwrap();
    let path = write(&dir, "bad.yaml", "plugins:\n  optimizer: lino\n");
    let err = ConfigLoader::new()
        .file(&path)
        .env([("AVA__PLUGINS__POLICY", "vetd"), ("HOME", "/root")])
        .set("plugins.memory.critical=1.5")
        .set("plugins.lock_file=[a]")
        .catalog(&FakeCatalog)
        .load()
        .unwrap_err();
    assert_eq!(err.problems().len(), 4);
    assert_eq!(
        err.to_string().replace(&dir.path().display().to_string(), "<dir>"),
        "<dir>/bad.yaml: 4 problems in the configuration:\n  \
         - plugins.optimizer: unknown optimizer 'lino' (did you mean 'lion'?); installed: adamw, lion, sgd [<dir>/bad.yaml]\n  \
         - plugins.policy: 'vetd' is not one of open, warn, vetted (did you mean 'vetted'?) [env AVA__PLUGINS__POLICY]\n  \
         - plugins.memory.critical: 1.5 must be in (0, 1] [--set plugins.memory.critical=1.5]\n  \
         - plugins.lock_file: expected a path, got a list [--set plugins.lock_file=[a]]"
    );
}

#[test]
fn other_structural_problems() {
    // A known key in the wrong place.
    assert_eq!(
        file_error("bad.yaml", "optimizer: lion\n"),
        "<dir>/bad.yaml: 1 problem in the configuration:\n  \
         - optimizer: unknown key (did you mean 'plugins.optimizer'?) [<dir>/bad.yaml]"
    );
    // Nothing close: the known keys are listed.
    assert_eq!(
        file_error("bad.yaml", "plugins:\n  zzzzzz: 1\n"),
        "<dir>/bad.yaml: 1 problem in the configuration:\n  \
         - plugins.zzzzzz: unknown key (known keys here: attention, optimizer, checkpoint, offload, memory, search_paths, policy, lock_file) [<dir>/bad.yaml]"
    );
    assert_eq!(
        file_error("bad.yaml", "plugins: 3\n"),
        "<dir>/bad.yaml: 1 problem in the configuration:\n  \
         - plugins: expected a table of settings (attention, optimizer, checkpoint, offload, memory, search_paths, policy, lock_file), got an integer [<dir>/bad.yaml]"
    );
    assert_eq!(
        file_error(
            "bad.yaml",
            "plugins:\n  search_paths: [a, 2, '']\n  optimizer: [adamw]\n  memory: {name: 3}\n  policy: 1\n"
        ),
        "<dir>/bad.yaml: 5 problems in the configuration:\n  \
         - plugins.search_paths[1]: expected a path, got an integer [<dir>/bad.yaml]\n  \
         - plugins.search_paths[2]: the path is empty [<dir>/bad.yaml]\n  \
         - plugins.optimizer: expected a plugin name or a table {name: <plugin>, <option>: <value>, ...}, got a list [<dir>/bad.yaml]\n  \
         - plugins.memory.name: expected a plugin name, got an integer [<dir>/bad.yaml]\n  \
         - plugins.policy: expected one of open, warn, vetted, got an integer [<dir>/bad.yaml]"
    );
    assert_eq!(
        file_error("bad.yaml", "plugins:\n  search_paths: target/release\n"),
        "<dir>/bad.yaml: 1 problem in the configuration:\n  \
         - plugins.search_paths: expected a list of paths, got a string (write [target/release] for a single path) [<dir>/bad.yaml]"
    );
    // A section with every line commented out is empty, not an error.
    let dir = tempfile::tempdir().unwrap();
    let path = write(&dir, "ok.yaml", "plugins:\n  # optimizer: lion\n");
    assert_eq!(ConfigLoader::new().file(&path).load().unwrap().config(), &Config::default());
}

#[test]
fn environment_problems() {
    let err = ConfigLoader::new()
        .env([("AVA__PLUGINS__OPTIMZER", "lion"), ("AVA__PLUGINS____X", "1"), ("AVA__PLUGINS__POLICY", "{a: [")])
        .load()
        .unwrap_err();
    let lines: Vec<String> = err.problems().iter().map(ToString::to_string).collect();
    assert_eq!(lines.len(), 3, "{err}");
    assert_eq!(
        lines[0],
        "plugins.optimzer: unknown key (did you mean 'plugins.optimizer'?) [env AVA__PLUGINS__OPTIMZER]"
    );
    assert_eq!(
        lines[1],
        "plugins.policy: not a valid YAML value: while parsing a node, did not find expected node content [env AVA__PLUGINS__POLICY]"
    );
    assert_eq!(
        lines[2],
        "malformed variable name: levels are separated by exactly two underscores, as in AVA__PLUGINS__POLICY [env AVA__PLUGINS____X]"
    );
}

#[test]
fn file_not_found_suggests_a_near_name() {
    let dir = tempfile::tempdir().unwrap();
    write(&dir, "tiny.yaml", "");
    let err = ConfigLoader::new().file(dir.path().join("tiny.yml")).load().unwrap_err();
    assert!(matches!(err, ConfigError::NotFound { .. }));
    assert_eq!(
        error_text(Err(err), dir.path()),
        "config file <dir>/tiny.yml not found (did you mean <dir>/tiny.yaml?); the recipes in configs/ are ready to use, \
         and `ava config show` prints the built-in defaults"
    );
    let err = ConfigLoader::new().file(dir.path().join("absent.yaml")).load().unwrap_err();
    assert_eq!(
        error_text(Err(err), dir.path()),
        "config file <dir>/absent.yaml not found; the recipes in configs/ are ready to use, and `ava config show` prints the built-in defaults"
    );
}

#[test]
fn syntax_errors_name_file_and_line() {
    assert_eq!(
        file_error("bad.yaml", "plugins:\n  optimizer: lion\n  memory: [thresholds\n"),
        "<dir>/bad.yaml:4:1: YAML syntax error: while parsing a flow sequence, expected ',' or ']'"
    );
    assert_eq!(
        file_error("bad.toml", "[plugins]\noptimizer = \"lion\"\nmemory = \n"),
        "<dir>/bad.toml:3:10: TOML syntax error: string values must be quoted, expected literal string"
    );
    assert_eq!(
        file_error("bad.yaml", "# a comment\nplugins:\n  optimizer: lion: x\n"),
        "<dir>/bad.yaml:3:18: YAML syntax error: mapping values are not allowed in this context"
    );
    assert_eq!(
        file_error("bad.yaml", "- a\n- b\n"),
        "<dir>/bad.yaml: YAML syntax error: the top level must be a table of sections, not a list"
    );
    assert_eq!(
        file_error("bad.json", "{}"),
        "config file <dir>/bad.json: unknown format (the name must end in .yaml, .yml or .toml)"
    );
}

#[test]
fn malformed_set_arguments() {
    let cases = [
        (
            "plugins.optimizer",
            "--set 'plugins.optimizer': expected section.key=value, e.g. --set plugins.optimizer=lion",
        ),
        (
            "=lion",
            "--set '=lion': the key before '=' is empty; expected section.key=value, e.g. --set plugins.optimizer=lion",
        ),
        (
            "plugins..optimizer=lion",
            "--set 'plugins..optimizer=lion': the key 'plugins..optimizer' has an empty part; levels are separated by single dots, e.g. plugins.memory.critical",
        ),
    ];
    for (arg, message) in cases {
        let err = ConfigLoader::new().set(arg).load().unwrap_err();
        assert!(matches!(err, ConfigError::BadSet { .. }));
        assert_eq!(err.to_string(), message);
    }
    let err = ConfigLoader::new().set("plugins.optimizer={name: lion").load().unwrap_err();
    assert!(err.to_string().starts_with("--set 'plugins.optimizer={name: lion': not a valid YAML value: "), "{err}");
}

// ---------------------------------------------------------------------------------------
// Layers and origins

#[test]
fn layers_override_in_order_and_keep_origins() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(
        &dir,
        "run.yaml",
        "plugins:\n  optimizer: lion\n  policy: warn\n  lock_file: file.lock\n  search_paths: [from/file]\n",
    );
    let env = [
        ("AVA__PLUGINS__POLICY", "vetted"),
        ("AVA__PLUGINS__LOCK_FILE", "env.lock"),
        ("AVA_PLUGIN_PATH", "/not/config"),
        ("PATH", "/bin"),
    ];
    let loaded = ConfigLoader::new()
        .file(&path)
        .env(env)
        .set("plugins.lock_file=set.lock")
        .catalog(&FakeCatalog)
        .load()
        .unwrap();
    let plugins = &loaded.config().plugins;
    assert_eq!(plugins.attention.name, "standard");
    assert_eq!(plugins.optimizer.name, "lion");
    assert_eq!(plugins.policy, VettingPolicy::Vetted);
    assert_eq!(plugins.lock_file, PathBuf::from("set.lock"));
    assert_eq!(plugins.search_paths, vec![PathBuf::from("from/file")]);

    let origins: Vec<(String, String)> = loaded
        .entries()
        .into_iter()
        .filter(|e| e.path.starts_with("plugins."))
        .map(|e| (e.path, e.origin.to_string()))
        .collect();
    let file = path.display().to_string();
    let expect = |p: &str, o: &str| (p.to_string(), o.to_string());
    assert_eq!(
        origins,
        vec![
            expect("plugins.attention", "default"),
            expect("plugins.optimizer", &file),
            expect("plugins.checkpoint", "default"),
            expect("plugins.offload", "default"),
            expect("plugins.memory", "default"),
            expect("plugins.search_paths", &file),
            expect("plugins.policy", "env AVA__PLUGINS__POLICY"),
            expect("plugins.lock_file", "--set plugins.lock_file=set.lock"),
        ]
    );
    assert_eq!(loaded.origin("plugins.policy"), Some(&Origin::Env("AVA__PLUGINS__POLICY".into())));
    assert_eq!(loaded.origin("plugins.optimizer"), Some(&Origin::File(path.clone())));
    assert_eq!(loaded.file(), Some(path.as_path()));
    assert_eq!(loaded.origin("plugins.nothing"), None);
}

#[test]
fn later_set_wins_and_env_values_are_yaml() {
    let loaded = ConfigLoader::new()
        .env([("AVA__PLUGINS__SEARCH_PATHS", "[a, b]"), ("AVA__PLUGINS__MEMORY__CRITICAL", "0.9")])
        .sets(["plugins.optimizer=sgd", "plugins.optimizer=lion"])
        .load()
        .unwrap();
    let plugins = &loaded.config().plugins;
    assert_eq!(plugins.optimizer, PluginSelection::new("lion"));
    assert_eq!(plugins.search_paths, vec![PathBuf::from("a"), PathBuf::from("b")]);
    assert_eq!(plugins.memory, PluginSelection::new("thresholds").with_option("critical", 0.9));
}

#[test]
fn set_nested_keys_and_tables() {
    let loaded = ConfigLoader::new()
        .set("plugins.optimizer={name: lion, betas: [0.9, 0.98]}")
        .set("plugins.optimizer.lr=1e-4")
        .set("plugins.memory.critical=0.9")
        .catalog(&FakeCatalog)
        .load()
        .unwrap();
    let config = loaded.config();
    assert_eq!(config.plugins.optimizer.name, "lion");
    assert_eq!(config.plugins.optimizer.options_json(), r#"{"betas":[0.9,0.98],"lr":0.0001}"#);
    assert_eq!(config.plugins.memory.options_json(), r#"{"critical":0.9}"#);
    assert_eq!(loaded.origin("plugins.memory.name"), Some(&Origin::Default));
    assert_eq!(loaded.origin("plugins.memory.critical"), Some(&Origin::Set("plugins.memory.critical=0.9".into())));
    assert_eq!(
        loaded.origin("plugins.optimizer.betas"),
        Some(&Origin::Set("plugins.optimizer={name: lion, betas: [0.9, 0.98]}".into()))
    );

    // A bare name replaces the options of the plugin below; so does a table naming another.
    let dir = tempfile::tempdir().unwrap();
    let path = write(
        &dir,
        "run.yaml",
        "plugins:\n  optimizer: {name: lion, lr: 0.001}\n  memory: {name: thresholds, warn: 0.8}\n",
    );
    let loaded = ConfigLoader::new()
        .file(&path)
        .set("plugins.optimizer=sgd")
        .set("plugins.memory={name: thresholds, critical: 0.95}")
        .catalog(&FakeCatalog)
        .load()
        .unwrap();
    assert_eq!(loaded.config().plugins.optimizer, PluginSelection::new("sgd"));
    assert_eq!(
        loaded.config().plugins.memory,
        PluginSelection::new("thresholds").with_option("warn", 0.8).with_option("critical", 0.95)
    );
    let loaded = ConfigLoader::new().file(&path).set("plugins.optimizer={name: adamw}").load().unwrap();
    assert_eq!(loaded.config().plugins.optimizer, PluginSelection::new("adamw"));

    // A scalar replaces a table and a table a scalar.
    let err = ConfigLoader::new().set("plugins.search_paths.x=1").load().unwrap_err();
    assert_eq!(
        err.to_string(),
        "1 problem in the configuration:\n  - plugins.search_paths: expected a list of paths, got a table [--set plugins.search_paths.x=1]"
    );
}

#[test]
fn toml_files_load_like_yaml() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(
        &dir,
        "run.toml",
        "# a TOML config\n[plugins]\noptimizer = { name = \"lion\", betas = [0.9, 0.98] }\npolicy = \"warn\"\n\n[plugins.memory]\nname = \"thresholds\"\ncritical = 0.9\n",
    );
    let loaded = ConfigLoader::new().file(&path).catalog(&FakeCatalog).load().unwrap();
    let plugins = &loaded.config().plugins;
    assert_eq!(plugins.optimizer, PluginSelection::new("lion").with_option("betas", json!([0.9, 0.98])));
    assert_eq!(plugins.memory, PluginSelection::new("thresholds").with_option("critical", 0.9));
    assert_eq!(plugins.policy, VettingPolicy::Warn);
    assert_eq!(loaded.origin("plugins.memory.critical"), Some(&Origin::File(path)));

    assert_eq!(
        file_error("bad.toml", "[plugins]\noptimzer = \"lion\"\nsearch_paths = 3\n"),
        "<dir>/bad.toml: 2 problems in the configuration:\n  \
         - plugins.optimzer: unknown key (did you mean 'plugins.optimizer'?) [<dir>/bad.toml]\n  \
         - plugins.search_paths: expected a list of paths, got an integer [<dir>/bad.toml]"
    );
}

#[test]
fn plugin_checks_after_loading() {
    let loaded = ConfigLoader::new().set("plugins.optimizer=lino").load().unwrap();
    let problems = loaded.validate_plugins(&FakeCatalog);
    assert_eq!(problems.len(), 1);
    assert_eq!(
        problems[0].to_string(),
        "plugins.optimizer: unknown optimizer 'lino' (did you mean 'lion'?); installed: adamw, lion, sgd [--set plugins.optimizer=lino]"
    );
    assert_eq!(
        loaded.check_plugins(&FakeCatalog).unwrap_err().to_string(),
        format!("1 problem in the configuration:\n  - {}", problems[0])
    );
    // Without origins, on the typed config.
    let problems = loaded.config().validate_plugins(&FakeCatalog);
    assert_eq!(problems[0].origin, None);
    assert_eq!(
        problems[0].to_string(),
        "plugins.optimizer: unknown optimizer 'lino' (did you mean 'lion'?); installed: adamw, lion, sgd"
    );
    assert!(Config::default().validate_plugins(&FakeCatalog).is_empty());
    assert!(ConfigLoader::new().load().unwrap().check_plugins(&FakeCatalog).is_ok());
}

// ---------------------------------------------------------------------------------------
// config show

#[test]
fn show_as_yaml_and_json() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(&dir, "run.yaml", "plugins:\n  optimizer: {name: lion, betas: [0.9, 0.98]}\n");
    let loaded = ConfigLoader::new()
        .file(&path)
        .env([("AVA__PLUGINS__POLICY", "warn")])
        .set("plugins.memory.critical=0.9")
        .set("plugins.lock_file='1.0'")
        .load()
        .unwrap();
    let yaml = loaded.to_yaml().replace(&dir.path().display().to_string(), "<dir>");
    assert!(yaml.starts_with(
        "# The effective Ava configuration: built-in defaults < config file < AVA__* environment < --set.\n"
    ));
    // The engine sections come first; the plugins section is the last.
    let plugins = &yaml[yaml.find("\nplugins:").expect("a plugins section") + 1..];
    assert_eq!(
        plugins,
        "\
plugins:
  attention: standard             # from: default
  optimizer:
    name: lion                    # from: <dir>/run.yaml
    betas: [0.9, 0.98]            # from: <dir>/run.yaml
  checkpoint: none                # from: default
  offload: ram                    # from: default
  memory:
    name: thresholds              # from: default
    critical: 0.9                 # from: --set plugins.memory.critical=0.9
  search_paths: []                # from: default
  policy: warn                    # from: env AVA__PLUGINS__POLICY
  lock_file: '1.0'                # from: --set plugins.lock_file='1.0'
"
    );
    // It reads back as the same configuration.
    let shown = write(&dir, "shown.yaml", &loaded.to_yaml());
    assert_eq!(ConfigLoader::new().file(&shown).load().unwrap().config(), loaded.config());

    let json = loaded.to_json();
    assert_eq!(
        json["plugins.memory.critical"],
        json!({"value": 0.9, "origin": "--set plugins.memory.critical=0.9", "layer": "set"})
    );
    assert_eq!(json["plugins.attention"], json!({"value": "standard", "origin": "default", "layer": "default"}));
    assert_eq!(json["plugins.optimizer.betas"]["layer"], "file");
    let keys: Vec<&String> = json.as_object().unwrap().keys().collect();
    assert_eq!(keys.first().map(|k| k.as_str()), Some("model.from"));
    assert_eq!(keys.len(), loaded.entries().len());
}

#[test]
fn yaml_values_round_trip() {
    for value in [
        json!("lion"),
        json!("true"),
        json!("1.5"),
        json!("0x10"),
        json!(""),
        json!("a: b"),
        json!("#x"),
        json!("it's"),
        json!("~"),
        json!("-x"),
        json!("null"),
        json!("a,b"),
        json!("[x]"),
        json!("two words"),
        json!("line\nbreak"),
        json!("/opt/ava/plugins"),
        json!(1e-8),
        json!(3),
        json!(-2.5),
        json!(false),
        json!([0.9, 0.98]),
        json!({"name": "lion", "betas": [0.9, 0.98], "note": "x, y"}),
    ] {
        let text = yaml_flow(&value);
        assert_eq!(parse_yaml_value(&text).unwrap(), value, "{text}");
    }
    assert_eq!(parse_value("[0.9, 0.98]").unwrap(), json!([0.9, 0.98]));
    assert!(parse_value("[0.9").unwrap_err().starts_with("not a valid YAML value: "));
    assert_eq!(selection_yaml(&PluginSelection::new("lion").with_option("lr", 0.001)), "{name: lion, lr: 0.001}");
    assert_eq!(yaml_flow(&json!("lion")), "lion");
    assert_eq!(yaml_flow(&json!("true")), "'true'");
    let selection = PluginSelection::parse("{name: lion, betas: [0.9, 0.98]}").unwrap();
    assert_eq!(selection.to_string(), "{name: lion, betas: [0.9, 0.98]}");
    assert_eq!(PluginSelection::parse("sgd").unwrap(), PluginSelection::new("sgd"));
    assert_eq!(
        PluginSelection::parse("{lr: 1}").unwrap_err(),
        "a plugin table needs a 'name': write {name: <plugin>, <option>: <value>, ...}"
    );
    assert_eq!(serde_json::to_value(&selection).unwrap(), json!({"name": "lion", "betas": [0.9, 0.98]}));
}

// ---------------------------------------------------------------------------------------
// Editing (ava plugins enable / disable)

const COMMENTED_YAML: &str = "\
# Recipe: tiny model on the synthetic corpus.
# run: ava train --config configs/tiny.yaml

plugins:
  # flash attention keeps one number per row
  attention: flash   # needs the plugin library
  checkpoint: none

# more settings come later
";

#[test]
fn yaml_enable_then_disable_gives_back_the_same_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(&dir, "tiny.yaml", COMMENTED_YAML);
    let lion = PluginSelection::new("lion").with_option("betas", json!([0.9, 0.98]));

    assert_eq!(set_plugin_selection(&path, PluginKind::Optimizer, Some(&lion)).unwrap(), EditOutcome::Changed);
    let edited = fs::read_to_string(&path).unwrap();
    assert_eq!(
        edited,
        COMMENTED_YAML
            .replace("  checkpoint: none\n", "  checkpoint: none\n  optimizer: {name: lion, betas: [0.9, 0.98]}\n")
    );
    assert_eq!(ConfigLoader::new().file(&path).load().unwrap().config().plugins.optimizer, lion);

    assert_eq!(set_plugin_selection(&path, PluginKind::Optimizer, Some(&lion)).unwrap(), EditOutcome::Unchanged);
    assert_eq!(set_plugin_selection(&path, PluginKind::Optimizer, None).unwrap(), EditOutcome::Changed);
    assert_eq!(fs::read_to_string(&path).unwrap(), COMMENTED_YAML);
    assert_eq!(set_plugin_selection(&path, PluginKind::Optimizer, None).unwrap(), EditOutcome::Unchanged);

    // A file without a plugins section gets one, and loses it again.
    let bare = "# nothing here yet\n";
    let path = write(&dir, "bare.yml", bare);
    set_plugin_selection(&path, PluginKind::Memory, Some(&PluginSelection::new("thresholds"))).unwrap();
    assert_eq!(fs::read_to_string(&path).unwrap(), "# nothing here yet\nplugins:\n  memory: thresholds\n");
    set_plugin_selection(&path, PluginKind::Memory, None).unwrap();
    assert_eq!(fs::read_to_string(&path).unwrap(), bare);
}

#[test]
fn yaml_replacing_keeps_comments() {
    let dir = tempfile::tempdir().unwrap();
    let text = "\
plugins:
  # the attention kernel
  attention:        # picked for long contexts
    name: sliding-window
    window: 256
  memory: thresholds  # default
";
    let path = write(&dir, "run.yaml", text);
    set_plugin_selection(&path, PluginKind::Attention, Some(&PluginSelection::new("flash"))).unwrap();
    set_plugin_selection(
        &path,
        PluginKind::Memory,
        Some(&PluginSelection::new("thresholds").with_option("critical", 0.9)),
    )
    .unwrap();
    assert_eq!(
        fs::read_to_string(&path).unwrap(),
        "\
plugins:
  # the attention kernel
  attention: flash        # picked for long contexts
  memory: {name: thresholds, critical: 0.9}  # default
"
    );
    set_plugin_selection(&path, PluginKind::Attention, None).unwrap();
    assert_eq!(
        fs::read_to_string(&path).unwrap(),
        "plugins:\n  # the attention kernel\n  memory: {name: thresholds, critical: 0.9}  # default\n"
    );
}

#[test]
fn editing_creates_a_missing_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("new.yaml");
    assert_eq!(set_plugin_selection(&path, PluginKind::Optimizer, None).unwrap(), EditOutcome::Unchanged);
    assert!(!path.exists());
    assert_eq!(
        set_plugin_selection(&path, PluginKind::Optimizer, Some(&PluginSelection::new("lion"))).unwrap(),
        EditOutcome::Created
    );
    let text = fs::read_to_string(&path).unwrap();
    assert!(text.starts_with("# Ava configuration, created by `ava plugins enable`.\n"), "{text}");
    assert!(text.ends_with("\nplugins:\n  optimizer: lion\n"), "{text}");
    assert_eq!(ConfigLoader::new().file(&path).load().unwrap().config().plugins.optimizer.name, "lion");

    let path = dir.path().join("new.toml");
    set_plugin_selection(&path, PluginKind::Optimizer, Some(&PluginSelection::new("lion").with_option("lr", 0.001)))
        .unwrap();
    let text = fs::read_to_string(&path).unwrap();
    assert!(text.starts_with("# Ava configuration, created by `ava plugins enable`.\n"), "{text}");
    assert!(text.ends_with("[plugins]\noptimizer = { name = \"lion\", lr = 0.001 }\n"), "{text}");
    assert_eq!(
        ConfigLoader::new().file(&path).load().unwrap().config().plugins.optimizer,
        PluginSelection::new("lion").with_option("lr", 0.001)
    );
}

#[test]
fn editing_refuses_what_it_cannot_do_safely() {
    let dir = tempfile::tempdir().unwrap();
    let flow = "plugins: {attention: flash}  # flow style\n";
    let path = write(&dir, "flow.yaml", flow);
    let err = set_plugin_selection(&path, PluginKind::Optimizer, Some(&PluginSelection::new("lion"))).unwrap_err();
    assert!(matches!(err, ConfigError::Edit { .. }));
    assert_eq!(
        err.to_string().replace(&dir.path().display().to_string(), "<dir>"),
        "cannot edit <dir>/flow.yaml: line 1: `plugins:` has its value on the same line ({attention: flash}); only block-style \
         sections (one key per line) can be edited — rewrite it that way, or edit the file by hand; the file was left unchanged"
    );
    assert_eq!(fs::read_to_string(&path).unwrap(), flow);

    // An edit that would not read back as intended is not written: here the whole mapping is
    // indented, so the appended section would not be part of it.
    let indented = "  other: 1\n";
    let path = write(&dir, "indented.yaml", indented);
    let err = set_plugin_selection(&path, PluginKind::Optimizer, Some(&PluginSelection::new("lion"))).unwrap_err();
    assert!(matches!(err, ConfigError::Edit { .. }), "{err}");
    assert_eq!(fs::read_to_string(&path).unwrap(), indented);

    // A file with a syntax error is reported, not edited.
    let broken = "plugins:\n  optimizer: [\n";
    let path = write(&dir, "broken.yaml", broken);
    let err = set_plugin_selection(&path, PluginKind::Optimizer, Some(&PluginSelection::new("lion"))).unwrap_err();
    assert!(matches!(err, ConfigError::Syntax { .. }), "{err}");
    assert_eq!(fs::read_to_string(&path).unwrap(), broken);
}

const COMMENTED_TOML: &str = "\
# Recipe in TOML.

[plugins]
# flash attention keeps one number per row
attention = \"flash\"   # needs the plugin library
checkpoint = \"none\"

# data settings come later
[data]
seed = 1
";

#[test]
fn toml_enable_then_disable_gives_back_the_same_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(&dir, "run.toml", COMMENTED_TOML);
    let lion = PluginSelection::new("lion").with_option("betas", json!([0.9, 0.98]));
    set_plugin_selection(&path, PluginKind::Optimizer, Some(&lion)).unwrap();
    let edited = fs::read_to_string(&path).unwrap();
    assert_eq!(
        edited,
        COMMENTED_TOML.replace(
            "checkpoint = \"none\"\n",
            "checkpoint = \"none\"\noptimizer = { name = \"lion\", betas = [0.9, 0.98] }\n"
        )
    );
    set_plugin_selection(&path, PluginKind::Optimizer, None).unwrap();
    assert_eq!(fs::read_to_string(&path).unwrap(), COMMENTED_TOML);

    // Without a [plugins] table.
    let bare = "# just a comment\n[data]\nseed = 1\n";
    let path = write(&dir, "bare.toml", bare);
    set_plugin_selection(&path, PluginKind::Memory, Some(&PluginSelection::new("thresholds"))).unwrap();
    assert_eq!(fs::read_to_string(&path).unwrap(), format!("{bare}\n[plugins]\nmemory = \"thresholds\"\n"));
    set_plugin_selection(&path, PluginKind::Memory, None).unwrap();
    assert_eq!(fs::read_to_string(&path).unwrap(), bare);
}

#[test]
fn toml_replacing_keeps_comments_and_table_style() {
    let dir = tempfile::tempdir().unwrap();
    let text = "\
[plugins]
attention = \"standard\"  # the default

# memory policy
[plugins.memory]
name = \"thresholds\"
critical = 0.97
";
    let path = write(&dir, "run.toml", text);
    set_plugin_selection(&path, PluginKind::Attention, Some(&PluginSelection::new("flash"))).unwrap();
    set_plugin_selection(
        &path,
        PluginKind::Memory,
        Some(&PluginSelection::new("thresholds").with_option("critical", 0.9)),
    )
    .unwrap();
    assert_eq!(
        fs::read_to_string(&path).unwrap(),
        "\
[plugins]
attention = \"flash\"  # the default

# memory policy
[plugins.memory]
name = \"thresholds\"
critical = 0.9
"
    );
    let config = ConfigLoader::new().file(&path).load().unwrap().into_config();
    assert_eq!(config.plugins.memory.options_json(), r#"{"critical":0.9}"#);

    // Removing a key keeps the comment above it, in place.
    set_plugin_selection(&path, PluginKind::Attention, None).unwrap();
    let text = fs::read_to_string(&path).unwrap();
    assert!(text.contains("# memory policy\n[plugins.memory]"), "{text}");
    assert!(!text.contains("attention"), "{text}");
}

#[test]
fn toml_removal_keeps_comments_above_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let text = "[plugins]\n# the optimizer we like\noptimizer = \"lion\"\n# keep\nmemory = \"thresholds\"\n\n# next\n[data]\nseed = 1\n";
    let path = write(&dir, "run.toml", text);
    set_plugin_selection(&path, PluginKind::Optimizer, None).unwrap();
    assert_eq!(
        fs::read_to_string(&path).unwrap(),
        "[plugins]\n# the optimizer we like\n# keep\nmemory = \"thresholds\"\n\n# next\n[data]\nseed = 1\n"
    );
    set_plugin_selection(&path, PluginKind::Memory, None).unwrap();
    assert_eq!(fs::read_to_string(&path).unwrap(), "# the optimizer we like\n# keep\n\n# next\n[data]\nseed = 1\n");
}

/// `offload.tiers`: shares as percentages or fractions that add up to 100%, one tier
/// besides ram; every problem named with the key.
#[test]
fn offload_tiers_are_read_and_checked() {
    let load = |tiers: &str| ConfigLoader::new().sets([format!("offload.tiers={tiers}").as_str()]).load();
    let c = load("[ram: 60%, nvme: 40%]").unwrap().into_config();
    assert_eq!((c.offload.tiers.resident(false), c.offload.tiers.resident(true)), (0.6, 0.0));
    assert_eq!((c.offload.tiers.pinned(false), c.offload.tiers.pinned(true)), (0.0, 0.6));
    // `device` and `ram` are places: on a CPU run one memory, on a GPU run the GPU's and the
    // host's; neither is a tier.
    let places = load("[device: 30%, ram: 50%, nvme: 20%]").unwrap().into_config().offload.tiers;
    assert_eq!((places.resident(false), places.resident(true), places.pinned(true)), (0.8, 0.3, 0.5));
    assert_eq!(places.offloaded().map(|t| t.name.as_str()), Some("nvme"));
    assert_eq!(Config::default().offload.tiers, crate::config::Tiers::on_device());
    let streamed = c.offload.tiers.offloaded().unwrap();
    assert_eq!((streamed.name.as_str(), streamed.fraction), ("nvme", 0.4));
    assert_eq!(serde_json::to_value(&c.offload.tiers).unwrap(), serde_json::json!([{"ram": "60%"}, {"nvme": "40%"}]));
    assert!(load("[ram: 0.25, nvme: 0.75]").unwrap().into_config().offload.tiers.offloaded().is_some());
    assert!(load("[ram: 100%]").unwrap().into_config().offload.tiers.offloaded().is_none());
    for (tiers, problem) in [
        ("[ram: 50%, nvme: 40%]", "offload.tiers: the shares add up to 90%, not 100%"),
        (
            "[ram: 150%]",
            "offload.tiers: entry 0 (ram): the share must be a percentage such as 40% or a fraction in [0, 1], got '150%'",
        ),
        ("[ram: 50%, ram: 50%]", "offload.tiers: entry 1: 'ram' is listed twice"),
        ("[nvme: 50%, int8: 50%]", "offload.tiers: 2 offload tiers named (nvme, int8)"),
        ("[nvme: 50%, int8: 50%, device: 0%]", "offload.tiers: 2 offload tiers named (nvme, int8)"),
        ("nvme", "offload.tiers: expected a list of tier shares such as [device: 60%, nvme: 40%], got a string"),
    ] {
        let e = load(tiers).unwrap_err().to_string();
        assert!(e.contains(problem), "{tiers}: {e}");
    }
}

/// `train.nan_policy` is `stop` by default, reads `skip`, and a bad word is named with the
/// words it takes.
#[test]
fn nan_policy_defaults_to_stop_and_names_its_words() {
    let config = ConfigLoader::new().load().unwrap().into_config();
    assert_eq!(config.train.nan_policy, super::NanPolicy::Stop);
    let config = ConfigLoader::new().set("train.nan_policy=skip").load().unwrap().into_config();
    assert_eq!(config.train.nan_policy, super::NanPolicy::Skip);
    let err = file_error("bad.yaml", "train:\n  nan_policy: ignore\n");
    assert!(err.contains("train.nan_policy: ") && err.contains("stop") && err.contains("skip"), "{err}");
}

// Outside input (issue 20): bounded before it is loaded, non-finite numbers by key path.

/// A "billion laughs" document: 9 levels of 9 aliases, under 600 bytes, 9^9 values expanded.
fn alias_bomb() -> String {
    let mut s = String::from("a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n");
    for i in 1..9 {
        let p = i - 1;
        s.push_str(&format!("a{i}: &a{i} [*a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}]\n"));
    }
    s
}

#[test]
fn an_alias_bomb_file_is_refused_before_it_is_expanded() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(&dir, "bomb.yaml", &alias_bomb());
    let err = ConfigLoader::new().file(&path).load().unwrap_err();
    assert!(matches!(err, ConfigError::Refused { line: Some(6), .. }), "{err:?}");
    let text = err.to_string();
    assert!(text.contains("bomb.yaml:6: the YAML expands to more than 100000 values"), "{text}");
    // The editor reads the same way.
    let err = set_plugin_selection(&path, PluginKind::Optimizer, Some(&PluginSelection::new("lion"))).unwrap_err();
    assert!(matches!(err, ConfigError::Refused { .. }), "{err}");
}

#[test]
fn an_alias_bomb_in_a_set_value_or_a_variable_names_it() {
    let flow = "[&a [&b [&c [&d [&e [x,x,x,x,x,x,x,x,x,x],*e,*e,*e,*e,*e,*e,*e,*e,*e],*d,*d,*d,*d,*d,*d,*d,*d,*d],\
                *c,*c,*c,*c,*c,*c,*c,*c,*c],*b,*b,*b,*b,*b,*b,*b,*b,*b],*a,*a,*a,*a,*a,*a,*a,*a,*a]";
    let err = ConfigLoader::new().set(format!("train.lr={flow}")).load().unwrap_err().to_string();
    assert!(err.starts_with("--set 'train.lr=") && err.contains("the YAML expands to more than 100000"), "{err}");
    let err = ConfigLoader::new().env([("AVA__TRAIN__LR", flow)]).load().unwrap_err().to_string();
    assert!(err.contains("train.lr: the YAML expands to more than 100000") && err.contains("AVA__TRAIN__LR"), "{err}");
}

#[test]
fn non_finite_numbers_are_refused_at_their_key_path() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(&dir, "nan.yaml", "train:\n  lr: .nan\n");
    let err = ConfigLoader::new().file(&path).load().unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "{}:2: train.lr: .nan is not a finite number; write a finite number (e.g. 0.001 or 1e30)",
            path.display()
        )
    );
    let err = ConfigLoader::new().set("train.lr=.inf").load().unwrap_err().to_string();
    assert!(err.contains("--set 'train.lr=.inf': train.lr: .inf is not a finite number"), "{err}");
    let err = ConfigLoader::new().set("plugins.optimizer={name: lion, betas: [0.9, -.inf]}").load().unwrap_err();
    assert!(err.to_string().contains("plugins.optimizer.betas[1]: -.inf is not a finite number"), "{err}");
    let err = ConfigLoader::new().env([("AVA__TRAIN__LR", "1e999")]).load().unwrap_err().to_string();
    assert!(err.contains("train.lr: 1e999 is not a finite number"), "{err}");
    let path = write(&dir, "nan.toml", "[train]\nlr = nan\n");
    let err = ConfigLoader::new().file(&path).load().unwrap_err().to_string();
    assert!(err.ends_with("nan.toml: train.lr: NaN is not a finite number; write a finite number"), "{err}");
}

#[test]
fn a_fifo_or_a_device_as_the_config_file_is_refused_without_blocking() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo.yaml");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let err = ConfigLoader::new().file(&fifo).load().unwrap_err().to_string();
    assert!(
        err.ends_with("fifo.yaml: is a FIFO (named pipe), not a regular file; name a regular file instead"),
        "{err}"
    );
    let zero = dir.path().join("zero.yaml");
    std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
    let err = ConfigLoader::new().file(&zero).load().unwrap_err().to_string();
    assert!(err.contains("is a character device"), "{err}");
}
