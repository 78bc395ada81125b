//! One writer per output, and no wait that a signal cannot end, end to end through `ava`:
//! two `ava data prepare` runs into one `--out` never both write there (the loser is refused
//! at once, naming the holder, and the winner's corpus verifies); and `ava train` stuck
//! waiting for a batch that never comes stops within seconds of a SIGTERM, saying why,
//! with only complete checkpoints on disk, and resumes from them.

use std::fs;
use std::path::Path;
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use ava_data::prepare::{LOCK_FILE, OutLock};

mod common;

use common::{ava, ava_command, checkpoint, json_of, losses, ok, train_small, train_small_command, usage_error};

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `files` text files of distinct words under `dir`.
fn write_text(dir: &Path, salt: usize, files: usize) {
    fs::create_dir_all(dir).unwrap();
    for i in 0..files {
        let text: String = (0..3000).map(|w| format!("w{salt}x{} ", (i * 7919 + w * 104_729) % 997)).collect();
        fs::write(dir.join(format!("part-{i:02}.txt")), text).unwrap();
    }
}

fn prepare_args(input: &str) -> Vec<&str> {
    vec!["data", "prepare", input, "--out", "corpus", "--shard-tokens", "5000", "--val-fraction", "0.1"]
}

/// The corpus verifies, lists exactly the inputs of `input`, and holds nothing else of a
/// corpus than what its manifest lists (the lock file aside).
#[track_caller]
fn assert_corpus_of(dir: &Path, input: &str) {
    let out = ok(ava(dir, &["data", "verify", "corpus"]));
    assert!(String::from_utf8_lossy(&out.stdout).contains("shards match their checksums"));
    let info = json_of(&ok(ava(dir, &["--format", "json", "data", "info", "corpus"])));
    let inputs = info["manifest"]["inputs"].as_array().unwrap();
    assert!(!inputs.is_empty());
    for i in inputs {
        let path = i["path"].as_str().unwrap_or_else(|| panic!("{i}"));
        assert!(path.contains(&format!("{input}/")), "{path} is not from {input}");
    }
    let listed: Vec<&str> =
        info["manifest"]["shards"].as_array().unwrap().iter().map(|s| s["file"].as_str().unwrap()).collect();
    for entry in fs::read_dir(dir.join("corpus")).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        assert!(name == "manifest.json" || name == LOCK_FILE || listed.contains(&name.as_str()), "stray {name}");
    }
}

#[test]
fn a_prepare_into_a_directory_another_one_holds_is_refused_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    write_text(&dir.path().join("a"), 1, 8);
    write_text(&dir.path().join("b"), 2, 8);
    // This test process holds the lock, as a running prepare does.
    let held = OutLock::acquire(&dir.path().join("corpus")).unwrap();
    let err = usage_error(ava(dir.path(), &prepare_args("b")));
    assert!(err.contains("corpus is in use by another ava data prepare (pid "), "{err}");
    assert!(err.contains(&format!("pid {}", std::process::id())) && err.contains("command: "), "{err}");
    assert!(err.contains(&format!("kill {}", std::process::id())) && err.contains("choose another --out"), "{err}");
    let names: Vec<_> = fs::read_dir(dir.path().join("corpus")).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, [LOCK_FILE], "the refused prepare wrote nothing");
    drop(held);

    // Free again: the lock file left behind blocks nothing and is not taken for a stranger's.
    ok(ava(dir.path(), &prepare_args("a")));
    assert_corpus_of(dir.path(), "a");
}

#[test]
fn two_concurrent_prepares_with_different_inputs_never_both_write_the_directory() {
    let dir = tempfile::tempdir().unwrap();
    write_text(&dir.path().join("a"), 1, 30);
    write_text(&dir.path().join("b"), 2, 30);
    let spawn = |input: &str| {
        ava_command(dir.path(), &prepare_args(input)).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()
    };
    let (a, b) = (spawn("a"), spawn("b"));
    let (pid_a, pid_b) = (a.id(), b.id());
    let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    // However they interleave, one prepares and the other is refused: while the first holds
    // the directory (naming it), or after, because the directory holds another corpus.
    let winners: Vec<&str> =
        [("a", &a), ("b", &b)].iter().filter(|(_, o)| o.status.success()).map(|(n, _)| *n).collect();
    assert_eq!(winners.len(), 1, "a: {}\nb: {}", stderr(&a), stderr(&b));
    let (winner, loser, winner_pid) = if winners[0] == "a" { ("a", &b, pid_a) } else { ("b", &a, pid_b) };
    let err = usage_error(Output { status: loser.status, stdout: loser.stdout.clone(), stderr: loser.stderr.clone() });
    let busy = err.contains(&format!("is in use by another ava data prepare (pid {winner_pid}"));
    let other = err.contains("holds a") && err.contains("corpus prepared from other inputs or options");
    assert!(busy || other, "{err}");
    assert_corpus_of(dir.path(), winner);
}

#[test]
fn sigterm_during_a_stuck_wait_for_data_stops_within_seconds_saying_why() {
    use std::os::unix::process::ExitStatusExt;
    let dir = tempfile::tempdir().unwrap();
    // Two micro-batches a step: steps 1 to 3 read batches 0 to 5; step 4 waits for batch 6
    // forever. Two loader workers: the wait is the consumer's, in the loader.
    let args = ["--max-steps", "6", "--set", "data.num_workers=2", "--set", "checkpoints.every=2"];
    let mut child = train_small_command(dir.path(), "run", &args)
        .env("AVA_TEST_STALL_LOADER_AT_BATCH", "6")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let run = dir.path().join("run");
    // Wait for step 3 in metrics.jsonl: the run is then stuck in step 4's wait.
    let deadline = Instant::now() + Duration::from_secs(300);
    let steps = || {
        let text = fs::read_to_string(run.join("metrics.jsonl")).unwrap_or_default();
        text.lines().filter(|l| l.contains("\"type\":\"step\"")).count()
    };
    while steps() < 3 {
        assert!(child.try_wait().unwrap().is_none(), "ava train ended before step 3");
        assert!(Instant::now() < deadline, "no 3 steps after 5 minutes");
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: kill with the pid of our own child, which has not been waited for yet.
    assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) }, 0);
    // It must end on its own (a generous bound: the wait notices within a second).
    let sent = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if sent.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("ava train still runs 60 s after SIGTERM: the wait swallowed it");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(143), "{err} ({:?})", out.status.signal());
    assert!(
        err.contains(
            "interrupted by SIGTERM while waiting, after step 3: stopped while waiting for the data loader: batch 6 of \
             the train split was not ready after"
        ),
        "{err}"
    );
    assert!(err.contains("continue the run with:") && err.contains("--resume latest"), "{err}");
    // Nothing of step 4; step 3, consistent (nothing of step 4 was applied), saved whole.
    assert_eq!(losses(&run).last().unwrap().0, 3);
    assert_eq!(fs::read_to_string(run.join("checkpoints/latest")).unwrap().trim(), "step-00000003");
    for entry in fs::read_dir(run.join("checkpoints")).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        assert!(!name.contains("tmp"), "a partial checkpoint was left: {name}");
    }
    assert!(checkpoint(&run, 3).join("manifest.json").is_file() && !run.join("model").exists());

    // Without the hang it resumes from there to the end.
    ok(train_small(dir.path(), "run", &["--max-steps", "6", "--set", "data.num_workers=2", "--resume", "latest"]));
    assert_eq!(losses(&run).iter().map(|l| l.0).collect::<Vec<_>>(), [1, 2, 3, 4, 5, 6]);
}
