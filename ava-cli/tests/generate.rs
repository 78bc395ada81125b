//! `ava generate` and `ava eval` end to end.
//!
//! Provenance of the golden: `tests/generate/tiny-llama/` (a tiny Llama with a byte-level BPE
//! tokenizer.json) and `tests/generate/expected.json` (each prompt's ids and the ids
//! transformers' greedy `generate` gives after it) were written by transformers 5.24.0 on
//! torch 2.15.0 (CPU, f32) with `tests/generate/make_golden.py`, which says how to run it and
//! how the weights' seed was chosen so that every greedy step wins by a margin of at least
//! 1e-3 (ids, not text, are compared: a random model's text is not UTF-8).

mod common;

use std::path::Path;

use common::{ava, json_of, ok, train_small, usage_error};
use serde_json::Value;

fn golden_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/generate")
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
}

/// Greedy generation with the KV cache gives transformers' tokens, prompt tokenized alike.
#[test]
fn greedy_tokens_are_the_ones_transformers_generates() {
    let golden: Value = serde_json::from_slice(&std::fs::read(golden_dir().join("expected.json")).unwrap()).unwrap();
    let model = golden_dir().join("tiny-llama");
    let dir = tempfile::tempdir().unwrap();
    for case in golden["cases"].as_array().unwrap() {
        let prompt = case["prompt"].as_str().unwrap();
        let n = case["max_new_tokens"].as_u64().unwrap().to_string();
        let out = ok(ava(
            dir.path(),
            &[
                "--format",
                "json",
                "generate",
                model.to_str().unwrap(),
                "--prompt",
                prompt,
                "--greedy",
                "--max-tokens",
                &n,
            ],
        ));
        let got = json_of(&out);
        assert_eq!(ids(&got["prompt_ids"]), ids(&case["prompt_ids"]), "{prompt}: the prompt's ids");
        assert_eq!(ids(&got["ids"]), ids(&case["generated_ids"]), "{prompt}: the generated ids");
        assert_eq!(got["stop"], "length");
    }
}

/// A finished run's model/ carries its tokenizer and end-of-text ids: generating from the run
/// and from the folder alone give the same text, the same seed the same text again, and a
/// sampled run is reproducible; `ava eval RUN` gives the validation loss the run reported.
#[test]
fn a_trained_run_generates_and_evaluates_from_its_folder() {
    let dir = tempfile::tempdir().unwrap();
    ok(train_small(dir.path(), "run", &["--max-steps", "6", "--set", "train.eval_batches=2"]));
    let run = dir.path().join("run");
    let model = run.join("model");
    assert!(model.join("tokenizer.json").is_file());
    let generation: Value =
        serde_json::from_slice(&std::fs::read(model.join("generation_config.json")).unwrap()).unwrap();
    assert_eq!(generation["bos_token_id"], u64::from(b'\n'), "synthetic sequences open with a newline");
    let config: Value = serde_json::from_slice(&std::fs::read(model.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["bos_token_id"], generation["bos_token_id"]);

    let generate = |what: &Path, extra: &[&str]| {
        let mut args = vec!["--format", "json", "generate", what.to_str().unwrap(), "--max-tokens", "20"];
        args.extend_from_slice(extra);
        json_of(&ok(ava(dir.path(), &args)))
    };
    let from_run = generate(&run, &["--seed", "3"]);
    let from_folder = generate(&model, &["--seed", "3"]);
    assert_eq!(from_run["ids"], from_folder["ids"]);
    assert_eq!(from_run["text"], from_folder["text"]);
    assert_eq!(ids(&from_run["ids"]).len(), 20);
    assert_eq!(ids(&from_run["prompt_ids"]), vec![u64::from(b'\n')], "an empty prompt starts a document");
    let other_seed = generate(&run, &["--seed", "4"]);
    assert_ne!(from_run["ids"], other_seed["ids"], "the seed draws the tokens");
    // The byte tokenizer: the text is the ids' bytes.
    let bytes: Vec<u8> = ids(&from_run["ids"]).into_iter().map(|b| b as u8).collect();
    assert_eq!(from_run["text"], String::from_utf8_lossy(&bytes).as_ref());
    // A prompt is encoded to its bytes.
    let prompted = generate(&run, &["--prompt", "abc", "--greedy"]);
    assert_eq!(ids(&prompted["prompt_ids"]), vec![97, 98, 99]);

    let reported = std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .rfind(|v| v["type"] == "eval")
        .unwrap()["data"]["val_loss"]
        .as_f64()
        .unwrap();
    let eval = json_of(&ok(ava(dir.path(), &["--format", "json", "eval", run.to_str().unwrap()])));
    let loss = eval["loss"].as_f64().unwrap();
    assert!((loss - reported).abs() < 1e-4, "ava eval {loss} vs the run's {reported}");
    assert!((eval["perplexity"].as_f64().unwrap() - loss.exp()).abs() < 1e-9);
}

/// Bad input is refused by name with what to do.
#[test]
fn what_is_not_a_model_or_a_sampling_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let err = usage_error(ava(dir.path(), &["generate", "nowhere"]));
    assert!(err.contains("nowhere is not a model: it does not exist"), "{err}");
    let model = golden_dir().join("tiny-llama");
    let m = model.to_str().unwrap();
    let err = usage_error(ava(dir.path(), &["generate", m, "--top-p", "0"]));
    assert!(err.contains("--top-p 0: must be above 0 and at most 1"), "{err}");
    let err = usage_error(ava(dir.path(), &["generate", m, "--max-tokens", "0"]));
    assert!(err.contains("--max-tokens must be at least 1"), "{err}");
    let err = usage_error(ava(dir.path(), &["eval", m]));
    assert!(err.contains("pass the data to evaluate on, --data DIR"), "{err}");
}

/// Sizes are checked against what the model and the machine allow before anything is
/// allocated: the tokens asked for and the prompt against the model's context (128 positions
/// here), `--max-tokens` at the top of its range without a panic, a long prompt refused
/// rather than run whole, `--threads` within training's bound, and eval's `--seq-len` alike.
#[test]
fn sizes_past_the_model_or_the_machine_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let model = golden_dir().join("tiny-llama");
    let m = model.to_str().unwrap();
    for n in ["4294967296", "18446744073709551615", "128"] {
        let err = usage_error(ava(dir.path(), &["generate", m, "--prompt", "a", "--max-tokens", n]));
        assert!(err.contains(&format!("{n} tokens after a prompt of 1 need")), "{err}");
        assert!(err.contains("the model's context is 128 positions"), "{err}");
        assert!(err.contains("generate at most 127 tokens (--max-tokens)"), "{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    // The context's last position is still given.
    let out = json_of(&ok(ava(
        dir.path(),
        &["--format", "json", "generate", m, "--prompt", "a", "--max-tokens", "127", "--ignore-eos"],
    )));
    assert_eq!(ids(&out["ids"]).len(), 127);
    let long = "word ".repeat(4000);
    let err = usage_error(ava(dir.path(), &["generate", m, "--prompt", &long]));
    assert!(err.contains("shorten the prompt to fewer than 128 tokens"), "{err}");
    for cmd in [&["generate", m][..], &["eval", m]] {
        let mut args = cmd.to_vec();
        args.extend(["--threads", "100000"]);
        let err = usage_error(ava(dir.path(), &args));
        assert!(err.contains("must be a number from 0 (one per core) to 1024"), "{err}");
    }
    let err = usage_error(ava(dir.path(), &["eval", m, "--seq-len", "18446744073709551615"]));
    assert!(err.contains("--seq-len 18446744073709551615 is longer than the model runs"), "{err}");
    assert!(err.contains("use --seq-len 128 or less"), "{err}");
}

/// Sets every value of tensor `name` (f32) in a safetensors file to `value`.
fn set_tensor(file: &Path, name: &str, value: f32) {
    let mut bytes = std::fs::read(file).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    let entry = &header[name];
    assert_eq!(entry["dtype"], "F32", "{name}: {entry}");
    let [start, end] = [0, 1].map(|i| entry["data_offsets"][i].as_u64().unwrap() as usize + 8 + header_len);
    for chunk in bytes[start..end].chunks_exact_mut(4) {
        chunk.copy_from_slice(&value.to_le_bytes());
    }
    std::fs::write(file, bytes).unwrap();
}

/// A model whose numbers overflow (finite weights of 3e38) has no loss to give: eval says so
/// and fails, rather than printing a NaN loss with success.
#[test]
fn a_model_that_overflows_fails_its_evaluation() {
    let dir = tempfile::tempdir().unwrap();
    ok(train_small(dir.path(), "run", &["--max-steps", "2"]));
    set_tensor(&dir.path().join("run/model/model.safetensors"), "model.norm.weight", 3e38);
    let out = ava(dir.path(), &["eval", "run"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("of the validation split is NaN") || err.contains("of the validation split is inf"), "{err}");
    assert!(err.contains("the model's numbers overflow"), "{err}");
}

/// A copy of the golden tiny Llama's folder at `dir/name`.
fn golden_copy(dir: &Path, name: &str) -> std::path::PathBuf {
    let folder = dir.join(name);
    std::fs::create_dir(&folder).unwrap();
    for entry in std::fs::read_dir(golden_dir().join("tiny-llama")).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), folder.join(entry.file_name())).unwrap();
    }
    folder
}

/// A model folder whose tokenizer.json is a FIFO, a link to a device or a dangling link is
/// refused naming it (quickly, without reading the device), never read with bytes instead.
#[test]
fn a_tokenizer_json_that_is_no_file_is_refused_not_replaced_by_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let folder = golden_copy(dir.path(), "m");
    let tokenizer = folder.join("tokenizer.json");
    let fifo = std::ffi::CString::new(tokenizer.to_str().unwrap()).unwrap();
    for plant in ["fifo", "/dev/zero", "/nowhere"] {
        std::fs::remove_file(&tokenizer).unwrap();
        if plant == "fifo" {
            // SAFETY: a NUL-terminated path.
            assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        } else {
            std::os::unix::fs::symlink(plant, &tokenizer).unwrap();
        }
        let err = usage_error(ava(dir.path(), &["generate", folder.to_str().unwrap(), "--max-tokens", "2"]));
        assert!(err.contains("tokenizer.json"), "{plant}: {err}");
    }
}

/// A model folder whose config.json holds absurd values is the user's input to fix: exit 2,
/// as `ava train` gives for the same file.
#[test]
fn a_model_folder_with_an_absurd_config_is_a_usage_error() {
    let dir = tempfile::tempdir().unwrap();
    let folder = golden_copy(dir.path(), "m");
    let config = folder.join("config.json");
    let mut v: Value = serde_json::from_slice(&std::fs::read(&config).unwrap()).unwrap();
    v["num_attention_heads"] = Value::from(3);
    std::fs::write(&config, serde_json::to_vec(&v).unwrap()).unwrap();
    for cmd in ["generate", "eval"] {
        let err = usage_error(ava(dir.path(), &[cmd, folder.to_str().unwrap()]));
        assert!(err.contains("num_attention_heads") || err.contains("heads"), "{cmd}: {err}");
    }
}
