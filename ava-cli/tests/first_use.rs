//! What a new user meets first: a memory budget kept from step 1, commands printed to go on
//! that run as printed, resumes that say what is wrong, an offload tier that is said to hold
//! nothing, a small corpus that trains, and numbers with their units.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::{ava, json_of, ok, train_small, usage_error};
use serde_json::Value;

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The command after `marker` on its line of `text` (a printed follow-up), run as printed by
/// a POSIX shell in `dir`, without the test's `AVA*` variables.
fn run_printed(dir: &Path, text: &str, marker: &str) -> Output {
    let line = text.lines().find(|l| l.contains(marker)).unwrap_or_else(|| panic!("no {marker:?} in:\n{text}"));
    let command = line.split_once(marker).unwrap().1.trim().trim_end_matches(')');
    let mut cmd = Command::new("sh");
    cmd.arg("-c").arg(command).current_dir(dir);
    for (key, _) in std::env::vars() {
        if key.starts_with("AVA") {
            cmd.env_remove(key);
        }
    }
    cmd.output().expect("sh runs")
}

/// The `type: step` records of a run's metrics.
fn steps(run: &Path) -> Vec<Value> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|v| v["type"] == "step")
        .map(|v| v["data"].clone())
        .collect()
}

/// The estimated peak of the small run at micro-batch `micro` (accumulation keeping the
/// global batch of 8).
fn estimated_peak(dir: &Path, micro: usize, extra: &[&str]) -> u64 {
    let mut args = vec!["--format".to_string(), "json".into(), "estimate".into()];
    for s in common::SMALL.iter().chain(extra) {
        args.extend(["--set".into(), s.to_string()]);
    }
    args.extend([
        "--set".into(),
        format!("train.micro_batch_size={micro}"),
        "--set".into(),
        format!("train.gradient_accumulation_steps={}", 8 / micro),
    ]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    json_of(&ok(ava(dir, &args)))["breakdown"]["peak"].as_u64().unwrap()
}

/// A budget the configured micro-batch (4) does not fit but a smaller one does: the run
/// starts at the smaller one, says so in one line, keeps the global batch, and its measured
/// peak stays under the budget from step 1, so the memory policy never shrinks it again.
#[test]
fn a_step_over_the_budget_starts_at_a_micro_batch_that_fits() {
    let dir = tempfile::tempdir().unwrap();
    let (at4, at1) = (estimated_peak(dir.path(), 4, &[]), estimated_peak(dir.path(), 1, &[]));
    assert!(at1 < at4, "{at1} {at4}");
    // Well above micro-batch 1's peak (the loader's batches stay whole), below micro-batch 4's.
    let budget = at4 - 1;
    let out = ok(train_small(
        dir.path(),
        "run",
        &["--max-steps", "3", "--set", &format!("memory.budget={budget}"), "--set", "memory.hard_limit=0"],
    ));
    let err = stderr(&out);
    let line = err.lines().find(|l| l.contains("would peak at")).unwrap_or_else(|| panic!("{err}"));
    assert!(line.contains("micro-batch 4 would peak at") && line.contains("starting at micro-batch"), "{line}");
    assert!(line.contains("the same 8 sequences a step"), "{line}");
    let records = steps(&dir.path().join("run"));
    assert_eq!(records.len(), 3);
    let first = records[0]["micro_batch"].as_u64().unwrap();
    for r in &records {
        assert_eq!(r["micro_batch"].as_u64().unwrap(), first, "the micro-batch was shrunk again: {r}");
        assert!(first < 4, "{r}");
        assert!(r["memory"]["peak"].as_u64().unwrap() <= budget, "step {}: over the budget {budget}: {r}", r["step"]);
        // The policy may warn (the peak can pass its 92% level below the budget), never act.
        let events = r["memory_events"].as_array().map(Vec::as_slice).unwrap_or_default();
        assert!(events.iter().all(|e| e.as_str().is_some_and(|e| e.contains("(warning"))), "the policy acted: {r}");
    }
}

/// A budget not even micro-batch 1 fits: refused before anything is allocated (exit 2),
/// with the plan's fastest settings that fit as a command, which runs as printed.
#[test]
fn a_budget_nothing_fits_is_refused_with_a_command_that_fits() {
    let dir = tempfile::tempdir().unwrap();
    // Long sequences, so that activations dominate and recomputing them makes room.
    let long = ["data.seq_len=256"];
    let at1 = estimated_peak(dir.path(), 1, &long);
    let budget = at1 * 9 / 10;
    let budget_set = format!("memory.budget={budget}");
    let out = train_small(dir.path(), "run", &["--max-steps", "2", "--set", long[0], "--set", &budget_set]);
    let err = usage_error(out);
    assert!(err.contains("even at micro-batch 1 (estimated"), "{err}");
    assert!(!dir.path().join("run").exists(), "a refused run leaves no directory (not even its lock)");
    assert!(err.contains("the fastest settings that fit, as `ava plan --budget"), "{err}");
    let suggested = err.lines().skip_while(|l| !l.ends_with("train with them:")).nth(1).expect(&err).to_string();
    // The plan command is for this run's settings, and runs as printed.
    let plan = err.lines().skip_while(|l| !l.ends_with("or see every plan that fits:")).nth(1).expect(&err).to_string();
    assert!(plan.contains(&format!(" plan --budget {budget} --set ")), "{plan}");
    assert!(plan.contains("--set data.seq_len=256") && plan.contains(&format!("--set {budget_set}")), "{plan}");
    let planned = run_printed(dir.path(), &format!("go: {plan}"), "go: ");
    assert!(planned.status.success(), "{}", stderr(&planned));
    let ran = run_printed(dir.path(), &format!("go: {suggested}"), "go: ");
    let ran_err = stderr(&ran);
    assert!(ran.status.success(), "{ran_err}");
    for r in steps(&dir.path().join("run")) {
        assert!(r["memory"]["peak"].as_u64().unwrap() <= budget, "{r}");
    }
}

/// The commands the summary prints to go on carry the options that name the run, and run as
/// printed: "continue with" resumes the same directory; a finished run says so (exit 2) with
/// the command that trains it longer, which does.
#[test]
fn printed_follow_up_commands_run_as_printed() {
    let dir = tempfile::tempdir().unwrap();
    let out = ok(train_small(dir.path(), "runs/hint", &["--max-steps", "6", "--steps", "2"]));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(text.contains("train.out_dir=runs/hint"), "{text}");
    let resumed = run_printed(dir.path(), &text, "continue with: ");
    let resumed_err = stderr(&resumed);
    assert!(resumed.status.success(), "{resumed_err}");
    assert!(resumed_err.contains("resumed from runs/hint/checkpoints/step-00000002"), "{resumed_err}");
    assert!(!dir.path().join("runs/default").exists(), "the hint named another run");
    // Finish it, then ask to resume it: it is at max_steps.
    ok(train_small(dir.path(), "runs/hint", &["--max-steps", "6", "--resume", "latest"]));
    let again = train_small(dir.path(), "runs/hint", &["--max-steps", "6", "--resume", "latest"]);
    let err = usage_error(again);
    assert!(err.contains("is at step 6, and train.max_steps is 6: the run is finished"), "{err}");
    // The command is on the line after "e.g.:".
    let command = err.lines().skip_while(|l| !l.ends_with("e.g.:")).nth(1).expect(&err).to_string();
    assert!(command.contains("--set train.max_steps=12") && command.ends_with("--resume latest"), "{command}");
    let longer = run_printed(dir.path(), &format!("go: {command}"), "go: ");
    assert!(longer.status.success(), "{}", stderr(&longer));
    assert_eq!(steps(&dir.path().join("runs/hint")).last().unwrap()["step"], 12, "trained to the doubled max_steps");
}

/// Resume errors are usage errors; a changed optimizer is summarized (a line per kind of
/// buffer, not one per tensor), and --fresh-optimizer keeps the weights with a new state.
#[test]
fn resume_errors_say_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let err = usage_error(train_small(dir.path(), "run", &["--resume", "nowhere"]));
    assert!(err.contains("nowhere is not a checkpoint: it does not exist"), "{err}");
    ok(train_small(dir.path(), "run", &["--max-steps", "4", "--steps", "2"]));
    let sgd = ["--max-steps", "4", "--resume", "latest", "--set", "plugins.optimizer={name: sgd, momentum: 0.9}"];
    // The changed optimizer alone: the first refusal names the flag that resumes.
    let err = usage_error(train_small(dir.path(), "run", &sgd));
    assert!(err.contains("pass --fresh-optimizer to train on with the new optimizer"), "{err}");
    assert!(!err.contains("--force"), "{err}");
    let err = usage_error(train_small(dir.path(), "run", &[&sgd[..], &["--set", "train.seed=9"]].concat()));
    assert!(err.contains("pass --force --fresh-optimizer to resume anyway"), "{err}");
    let err = usage_error(train_small(dir.path(), "run", &[&sgd[..], &["--force"]].concat()));
    assert!(err.contains("does not match the optimizer (it was trained with adamw)"), "{err}");
    assert!(err.lines().count() < 10, "a summary, not a line per tensor:\n{err}");
    assert!(err.contains("tensors (e.g. "), "{err}");
    assert!(err.contains("--fresh-optimizer"), "{err}");
    let out = ok(train_small(dir.path(), "run", &[&sgd[..], &["--fresh-optimizer"]].concat()));
    assert!(stderr(&out).contains("resumed from"), "{}", stderr(&out));
    assert_eq!(steps(&dir.path().join("run")).last().unwrap()["step"], 4);
}

/// Selecting an offload tier that nothing goes through is said; `plugins enable offload nvme`
/// writes the tier a share of the state too, and `disable` removes both.
#[test]
fn an_offload_tier_that_holds_nothing_is_said_and_enable_gives_it_the_state() {
    ava_tests::workspace_plugins_dir();
    let dir = tempfile::tempdir().unwrap();
    let disk = dir.path().join("disk");
    let selects = format!("plugins.offload={{name: nvme, path: {}}}", disk.display());
    let out = ok(train_small(dir.path(), "run", &["--max-steps", "1", "--set", &selects]));
    let err = stderr(&out);
    assert!(err.contains("plugins.offload selects 'nvme', but nothing goes through it"), "{err}");
    assert!(err.contains("offload.tiers"), "{err}");

    let path = format!("path={}", disk.display());
    ok(ava(dir.path(), &["plugins", "enable", "offload", "nvme", "--set", &path]));
    let written = std::fs::read_to_string(dir.path().join("ava.yaml")).unwrap();
    assert!(
        written.contains("offload: {name: nvme, path: ") && written.contains("tiers: [{nvme: '100%'}]"),
        "{written}"
    );
    let out = ok(train_small(dir.path(), "enabled", &["--max-steps", "1"]));
    let err = stderr(&out);
    assert!(err.contains("(100%) streams through nvme") && !err.contains("nothing goes through it"), "{err}");
    ok(ava(dir.path(), &["plugins", "disable", "offload"]));
    let written = std::fs::read_to_string(dir.path().join("ava.yaml")).unwrap();
    assert!(!written.contains("nvme") && !written.contains("tiers"), "{written}");
}

/// Forty small files: prepare holds one out for validation, and the command it prints trains
/// on them as printed, without validation when the held-out text is shorter than a sequence.
#[test]
fn a_small_corpus_trains_with_the_command_prepare_prints() {
    let dir = tempfile::tempdir().unwrap();
    let inputs = dir.path().join("texts");
    std::fs::create_dir(&inputs).unwrap();
    for i in 0..40 {
        let line = format!("File {i} says hello to the world, and a few more words about things. ");
        std::fs::write(inputs.join(format!("f{i:02}.txt")), line.repeat(2)).unwrap();
    }
    let out = ok(ava(dir.path(), &["data", "prepare", "texts", "--out", "corpus"]));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(text.contains("(39 train / 1 validation)"), "{text}");
    let line = text.lines().find(|l| l.starts_with("train on it with: ")).expect(&text);
    assert!(line.contains("--set model.vocab_size=257"), "{line}");
    let command = line.trim_start_matches("train on it with: ").replacen("ava ", "", 1);
    let printed = format!("go: {} {command} --max-steps 2 --set data.seq_len=256", env!("CARGO_BIN_EXE_ava"));
    let ran = run_printed(dir.path(), &printed, "go: ");
    let err = stderr(&ran);
    assert!(ran.status.success(), "{err}");
    assert!(err.contains("Training runs without validation"), "{err}");
    assert!(err.contains("prepare it with a larger --val-fraction, or shorten data.seq_len"), "{err}");
    assert_eq!(steps(&dir.path().join("runs/corpus")).last().unwrap()["step"], 2);

    // One document: no share of it can be held out, and the warning says what would.
    std::fs::write(dir.path().join("one.txt"), "one long document of words. ".repeat(200)).unwrap();
    ok(ava(dir.path(), &["data", "prepare", "one.txt", "--out", "one"]));
    let sets = ["--set", "data.source=shards", "--set", "data.path=one", "--set", "model.vocab_size=257"];
    let ran =
        ok(ava(dir.path(), &[&["train", "--max-steps", "1", "--set", "train.out_dir=runs/one"][..], &sets].concat()));
    let err = stderr(&ran);
    assert!(err.contains("the corpus is one document: cut its text into documents"), "{err}");
    assert!(!err.contains("--val-fraction"), "{err}");
}

/// The numbers say their units: the memory line in MiB for a small run, `ava report` of a
/// byte metric in units, and --steps 1 reports a rate.
#[test]
fn numbers_come_with_their_units() {
    let dir = tempfile::tempdir().unwrap();
    let out = ok(train_small(dir.path(), "one", &["--max-steps", "1"]));
    let err = stderr(&out);
    let memory = err.lines().find(|l| l.starts_with("[step 1] memory")).expect(&err);
    assert!(memory.contains(" MiB of 2.00 GiB ("), "{memory}");
    assert!(!memory.contains("0.00,") && !memory.contains("x allocated"), "{memory}");
    assert!(memory.contains("RSS ") && memory.contains("(pages the OS counts resident"), "{memory}");
    let summary = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(!summary.contains("0.00 tokens/s"), "{summary}");
    assert!(err.contains("[step 1/1] loss"), "{err}");
    // Steps say where the run is and, from the second, when it should end.
    let out = ok(train_small(dir.path(), "run", &["--max-steps", "3"]));
    let err = stderr(&out);
    assert!(err.contains("[step 1/3] loss") && err.contains("[step 2/3, eta "), "{err}");
    // What the RSS is, said once: on the first memory line, not on every one.
    let memory: Vec<&str> = err.lines().filter(|l| l.contains("] memory ")).collect();
    assert_eq!(memory.len(), 3, "{err}");
    assert!(memory[0].contains("(pages the OS counts resident"), "{err}");
    assert!(memory[1..].iter().all(|l| l.contains("RSS ") && !l.contains("pages the OS")), "{err}");
    let report = ok(ava(dir.path(), &["report", "run", "--metric", "memory.peak"]));
    let table = String::from_utf8_lossy(&report.stdout).into_owned();
    assert!(table.contains("memory.peak by step (bytes;") && table.contains(" MiB"), "{table}");
}

/// `ava plan --keep` pins what it names; the user's optimizer ranks first and another one is
/// shown with its measured cost; `--write` gives the run a directory of its own, never one
/// that holds a run.
#[test]
fn plan_keeps_what_it_is_told_and_writes_a_fresh_run_directory() {
    let dir = tempfile::tempdir().unwrap();
    let small = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/small.yaml");
    let small = small.to_str().unwrap();
    let plan = |extra: &[&str]| {
        let mut args = vec!["--format", "json", "plan", "--budget", "200MiB", "-c", small, "--top", "50"];
        args.extend_from_slice(extra);
        json_of(&ok(ava(dir.path(), &args)))
    };
    let all = plan(&[]);
    let optimizers: Vec<&str> =
        all["configs"].as_array().unwrap().iter().map(|c| c["optimizer"].as_str().unwrap()).collect();
    let first_other = optimizers.iter().position(|o| *o != "adamw").unwrap_or(optimizers.len());
    assert!(optimizers[first_other..].iter().all(|o| *o != "adamw"), "adamw plans rank first: {optimizers:?}");
    let kept = plan(&["--keep", "plugins.optimizer,attention"]);
    for c in kept["configs"].as_array().unwrap() {
        assert_eq!((c["optimizer"].as_str(), c["attention"].as_str()), (Some("adamw"), Some("standard")), "{c}");
    }
    let err = usage_error(ava(dir.path(), &["plan", "--budget", "200MiB", "--keep", "train.lr"]));
    assert!(
        err.contains("--keep train.lr: not a setting the plan searches; it searches train.micro_batch_size"),
        "{err}"
    );

    ok(ava(dir.path(), &["plan", "--budget", "200MiB", "-c", small, "--write", "fit.yaml"]));
    let written = std::fs::read_to_string(dir.path().join("fit.yaml")).unwrap();
    assert!(written.contains("out_dir: runs/fit "), "{written}");
    std::fs::create_dir_all(dir.path().join("runs/fit")).unwrap();
    std::fs::write(dir.path().join("runs/fit/metrics.jsonl"), "{}\n").unwrap();
    ok(ava(dir.path(), &["plan", "--budget", "200MiB", "-c", small, "--write", "fit.yaml"]));
    let written = std::fs::read_to_string(dir.path().join("fit.yaml")).unwrap();
    assert!(written.contains("out_dir: runs/fit-2 "), "{written}");
}

/// `config show` with `model.from` shows the folder's architecture, from its config.json; a
/// named config file says it leaves ./ava.yaml unread; an OS error is said once.
#[test]
fn config_shows_what_the_run_will_use() {
    let dir = tempfile::tempdir().unwrap();
    let folder = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/generate/tiny-llama");
    let from = format!("model.from={}", folder.display());
    let out = ok(ava(dir.path(), &["config", "show", "--set", &from]));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let vocab = text.lines().find(|l| l.trim_start().starts_with("vocab_size:")).expect(&text);
    assert!(vocab.contains("vocab_size: 320") && vocab.contains("config.json (model.from)"), "{vocab}");

    std::fs::write(dir.path().join("ava.yaml"), "plugins:\n  optimizer: sgd\n").unwrap();
    std::fs::write(dir.path().join("other.yaml"), "train:\n  max_steps: 5\n").unwrap();
    let out = ok(ava(dir.path(), &["estimate", "-c", "other.yaml"]));
    assert!(stderr(&out).contains("note: ./ava.yaml is not read: other.yaml is the config file"), "{}", stderr(&out));

    let err = ava(dir.path(), &["data", "prepare", "missing.txt", "--out", "corpus"]);
    let err = stderr(&err);
    assert_eq!(err.matches("No such file or directory").count(), 1, "{err}");
}

/// A long step or evaluation says how far it is while it runs (after 10 s of it, then every
/// 10 s; here at every micro-batch, through the test hook), so a minutes-long step is not
/// silent.
#[test]
fn long_steps_and_evaluations_say_how_far_they_are() {
    let dir = tempfile::tempdir().unwrap();
    let out = common::train_small_command(dir.path(), "run", &["--max-steps", "1", "--set", "train.eval_batches=3"])
        .env("AVA_TEST_WORK_PROGRESS_SECS", "0")
        .output()
        .unwrap();
    let err = stderr(&ok(out));
    assert!(err.contains("[step 1] 1/2 micro-batches done, "), "{err}");
    assert!(err.contains("[step 1] evaluating: 1/3 batches done, ") && err.contains("evaluating: 2/3"), "{err}");
    // At the default pace a short run says nothing of the kind.
    let quiet = stderr(&ok(train_small(dir.path(), "quiet", &["--max-steps", "1"])));
    assert!(!quiet.contains("micro-batches done"), "{quiet}");
}
