//! `ava train` guarding a run, end to end: garbage in is an error, not exit 0 (NaN weights
//! in a Hugging Face folder, a learning rate that makes the loss NaN, settings that cannot
//! work together); one run per output directory (a second run is refused naming the holder,
//! a fresh run does not mix with an earlier one unless --overwrite, a stale lock file blocks
//! nothing); and Ctrl-C or SIGTERM saves a checkpoint of the step reached, exits 130 or 143
//! and prints the command that resumes, which continues bit-exactly.

use std::path::Path;
use std::process::{Child, Output};
use std::time::{Duration, Instant};

use ava_train::model::{Model, ModelSpec, save_hf_folder};
use ava_train::run_dir::{LOCK_FILE, RunLock};

mod common;

use common::{checkpoint, losses, ok, safetensors_header, train_small, train_small_command, usage_error};

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Exit code 1 and the stderr text.
#[track_caller]
fn runtime_error(o: Output) -> String {
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "expected exit code 1, got {}:\n{err}", o.status);
    err
}

#[test]
fn nan_weights_in_a_hugging_face_folder_are_refused_naming_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let kernel = ava_plugins::Registry::builtins().attention("standard", "{}").unwrap();
    let model = Model::new(ModelSpec::llama(256, 32, 2, 2, 1, 64), 1, 16, kernel, "standard", 1).unwrap();
    let from = dir.path().join("hf");
    save_hf_folder(&from, model.spec(), &model.named_tensors()).unwrap();
    // A NaN written over the third value of one tensor (f32, little-endian).
    let file = from.join("model.safetensors");
    let header = safetensors_header(&file);
    let name = "model.layers.1.mlp.up_proj.weight";
    let start = header[name]["data_offsets"][0].as_u64().unwrap() as usize;
    let mut bytes = std::fs::read(&file).unwrap();
    let at = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize + start + 2 * 4;
    bytes[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(&file, bytes).unwrap();

    let set_from = format!("model.from={}", from.display());
    let err = usage_error(train_small(dir.path(), "run", &["--set", &set_from, "--max-steps", "2"]));
    assert!(err.contains(&format!("the weights in {} hold values that are not finite", from.display())), "{err}");
    assert!(
        err.contains(&format!("{name}: 1 of 2048 values are NaN or infinite (the first, element 2, is NaN)")),
        "{err}"
    );
    assert!(!dir.path().join("run/checkpoints").exists());
}

#[test]
fn a_learning_rate_that_makes_the_loss_nan_stops_naming_the_step_and_the_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    // SGD at lr 1e3 without clipping diverges within a few steps.
    let diverge = [
        "--max-steps",
        "60",
        "--set",
        "plugins.optimizer=sgd",
        "--set",
        "train.lr=1000",
        "--set",
        "train.warmup_steps=0",
        "--set",
        "train.grad_clip=0",
    ];
    let err = runtime_error(train_small(dir.path(), "run", &diverge));
    assert!(err.contains("is NaN") || err.contains("is infinite"), "{err}");
    assert!(err.contains("Nothing of the step was applied or saved"), "{err}");
    assert!(err.contains("Lower train.lr"), "{err}");
    let run = dir.path().join("run");
    let step: u64 = err
        .split("error: step ")
        .nth(1)
        .and_then(|s| s.split(':').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no step named: {err}"));
    assert!(!checkpoint(&run, step).exists(), "nothing of step {step} is saved");
    assert!(!run.join("model").exists());
    let saved = step - 1 - (step - 1) % 2; // checkpoints.every: 2
    if saved > 0 {
        assert!(err.contains(&format!("the last checkpoint, run/checkpoints/step-{saved:08}, is intact")), "{err}");
        // It loads and verifies (its weights are finite, if far gone at this learning rate).
        let again = [&diverge[..], &["--resume", "latest", "--steps", "0"]].concat();
        let resumed = ok(train_small(dir.path(), "run", &again));
        assert!(stderr(&resumed).contains(&format!("continuing at step {}", saved + 1)), "{}", stderr(&resumed));
    } else {
        assert!(err.contains("no checkpoint was saved yet"), "{err}");
    }

    // An absurd learning rate does not get that far.
    let err = usage_error(train_small(dir.path(), "other", &["--set", "train.lr=1e30"]));
    assert!(err.contains("train.lr: ") && err.contains("is out of range: must be between 0 and 1000"), "{err}");
}

#[test]
fn nan_policy_skip_with_step_in_backward_is_refused_naming_both_keys() {
    let dir = tempfile::tempdir().unwrap();
    let sets = [
        "--set",
        "train.step_in_backward=true",
        "--set",
        "train.gradient_accumulation_steps=1",
        "--set",
        "train.grad_clip=0",
        "--set",
        "train.nan_policy=skip",
    ];
    let err = usage_error(train_small(dir.path(), "run", &sets));
    assert!(err.contains("but train.nan_policy is skip: set train.nan_policy: stop"), "{err}");
    assert!(err.contains("or train.step_in_backward: false"), "{err}");
    let err = usage_error(train_small(dir.path(), "run", &["--set", "train.nan_policy=ignore"]));
    assert!(err.contains("train.nan_policy"), "{err}");
}

#[test]
fn a_second_run_on_a_directory_in_use_is_refused_naming_the_holder() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let held = RunLock::acquire(&run).unwrap();
    let err = usage_error(train_small(dir.path(), "run", &["--max-steps", "2"]));
    assert!(err.contains(&format!("the run directory run is in use by another ava train (pid {}", std::process::id())));
    assert!(err.contains(&format!("kill -INT {}", std::process::id())), "{err}");
    assert!(err.contains("another train.out_dir"), "{err}");
    assert!(!run.join("metrics.jsonl").exists(), "the refused run wrote nothing");
    drop(held);

    // A lock file left by a process that is gone blocks nothing.
    std::fs::write(run.join(LOCK_FILE), "pid 999999999\nhost elsewhere\nstarted 0\n").unwrap();
    ok(train_small(dir.path(), "run", &["--max-steps", "2"]));
    let text = std::fs::read_to_string(run.join(LOCK_FILE)).unwrap();
    assert!(!text.contains("999999999"), "the new holder is written: {text}");
}

#[test]
fn a_fresh_run_into_an_earlier_one_is_refused_unless_overwrite() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    ok(train_small(dir.path(), "run", &["--max-steps", "4"]));
    std::fs::write(run.join("notes.txt"), "mine").unwrap();
    let before = std::fs::read(run.join("metrics.jsonl")).unwrap();
    let err = usage_error(train_small(dir.path(), "run", &["--max-steps", "2"]));
    assert!(err.contains("run holds an earlier run (metrics.jsonl, checkpoints, model)"), "{err}");
    assert!(err.contains("--resume latest, start again with --overwrite (deletes metrics.jsonl, checkpoints, model)"));
    assert_eq!(std::fs::read(run.join("metrics.jsonl")).unwrap(), before, "the refused run touched nothing");

    // --overwrite starts again: only the new run's files, and the user's own file kept.
    ok(train_small(dir.path(), "run", &["--max-steps", "2", "--overwrite"]));
    assert_eq!(losses(&run).iter().map(|l| l.0).collect::<Vec<_>>(), [1, 2]);
    assert!(checkpoint(&run, 2).is_dir() && !checkpoint(&run, 4).exists());
    assert!(run.join("notes.txt").is_file());
    // --resume still continues it; --overwrite does not go with --resume.
    ok(train_small(dir.path(), "run", &["--max-steps", "4", "--resume", "latest"]));
    usage_error(train_small(dir.path(), "run", &["--max-steps", "4", "--resume", "latest", "--overwrite"]));
}

/// Waits until the run's metrics.jsonl has `steps` step records (the child still running).
fn wait_for_steps(child: &mut Child, run: &Path, steps: usize) {
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap_or_default();
        if text.lines().filter(|l| l.contains("\"type\":\"step\"")).count() >= steps {
            return;
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("ava train ended ({status}) before {steps} steps");
        }
        assert!(Instant::now() < deadline, "no {steps} steps in metrics.jsonl after 10 minutes");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Starts a run of `max_steps`, sends `signal` once a few steps are logged, and returns its
/// output and the step it stopped at (its latest checkpoint).
fn interrupt(dir: &Path, out: &str, max_steps: &str, signal: libc::c_int) -> (Output, u64) {
    let args = ["--max-steps", max_steps, "--set", "checkpoints.every=100"];
    let mut child = train_small_command(dir, out, &args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let run = dir.join(out);
    wait_for_steps(&mut child, &run, 3);
    // SAFETY: kill with the pid of our own child, which has not been waited for yet.
    assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, signal) }, 0);
    let output = child.wait_with_output().unwrap();
    let latest = std::fs::read_to_string(run.join("checkpoints/latest")).unwrap();
    let step = latest.trim().trim_start_matches("step-").parse().unwrap();
    (output, step)
}

#[test]
fn ctrl_c_saves_the_step_reached_and_the_printed_command_resumes_bit_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let max = "300";
    let (out, step) = interrupt(dir.path(), "split", max, libc::SIGINT);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(130), "{err}");
    let run = dir.path().join("split");
    assert!((3..300).contains(&step), "{err}");
    assert!(checkpoint(&run, step).join("manifest.json").is_file());
    assert_eq!(losses(&run).last().unwrap().0, step, "the last logged step is the one saved");
    assert!(err.contains(&format!("interrupted by SIGINT at step {step}: checkpoint ")), "{err}");
    assert!(err.contains(" --max-steps 300 --set checkpoints.every=100 --resume latest"), "{err}");
    // Answered when it came, before the step under way finished.
    let answer = err.lines().position(|l| l.starts_with("SIGINT: stopping after step ")).expect(&err);
    let saved = err.lines().position(|l| l.contains(&format!("checkpoint {}", run.display()))).unwrap_or(usize::MAX);
    assert!(answer < saved, "{err}");
    assert!(err.contains("then saving a checkpoint; Ctrl-C again to quit at once without saving"), "{err}");
    assert!(!run.join("model").exists(), "an interrupted run has no final model");

    ok(train_small(dir.path(), "split", &["--max-steps", max, "--set", "checkpoints.every=100", "--resume", "latest"]));
    ok(train_small(dir.path(), "straight", &["--max-steps", max, "--set", "checkpoints.every=100"]));
    let straight = dir.path().join("straight");
    for file in ["model.safetensors", "optimizer.safetensors", "trainer.json"] {
        let x = std::fs::read(checkpoint(&straight, 300).join(file)).unwrap();
        let y = std::fs::read(checkpoint(&run, 300).join(file)).unwrap();
        assert!(x == y, "{file} differs between the straight and the interrupted run");
    }
    assert_eq!(losses(&straight), losses(&run), "losses differ");
}

/// A second Ctrl-C quits at once, saying what it did; the last complete checkpoint stays the
/// one `latest` names.
#[test]
fn a_second_ctrl_c_quits_at_once_and_says_so() {
    use std::os::unix::process::ExitStatusExt;
    let dir = tempfile::tempdir().unwrap();
    // Steps long enough (about 0.1 s) that the second signal comes while one runs.
    let args = [
        "--max-steps",
        "100000",
        "--set",
        "checkpoints.every=2",
        "--set",
        "data.seq_len=256",
        "--set",
        "model.hidden_size=128",
        "--set",
        "model.intermediate_size=256",
    ];
    let mut child = train_small_command(dir.path(), "run", &args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let run = dir.path().join("run");
    wait_for_steps(&mut child, &run, 3);
    for _ in 0..2 {
        // SAFETY: kill with the pid of our own child, which has not been waited for yet.
        assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) }, 0);
        // Delivered before the next (two pending SIGINTs would be one).
        std::thread::sleep(Duration::from_millis(5));
    }
    let out = child.wait_with_output().unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.signal(), Some(libc::SIGINT), "{err}");
    assert!(err.contains("SIGINT: stopping after step "), "{err}");
    assert!(
        err.contains("SIGINT again: quitting now, without saving this step; the last complete checkpoint is intact"),
        "{err}"
    );
    let latest = std::fs::read_to_string(run.join("checkpoints/latest")).unwrap();
    assert!(run.join("checkpoints").join(latest.trim()).join("manifest.json").is_file());
}

#[test]
fn sigterm_saves_and_exits_143() {
    let dir = tempfile::tempdir().unwrap();
    let (out, step) = interrupt(dir.path(), "run", "100000", libc::SIGTERM);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(143), "{err}");
    assert!(checkpoint(&dir.path().join("run"), step).join("manifest.json").is_file());
    assert!(err.contains(&format!("interrupted by SIGTERM at step {step}")), "{err}");
}
