//! A run's own files as outside input, through the `ava` binary: a `metrics.jsonl` with an
//! overlong line or very many steps (`ava report` reads it line by line and keeps a bounded
//! number of points), and a checkpoint whose `trainer.json` puts the data position past
//! anything the loader can index (refused at resume, exit code 2, before any loader thread
//! starts: it used to hang).

mod common;

use std::fs;
use std::path::Path;

use common::{ava, json_of, ok, usage_error};
use serde_json::Value;

fn step_line(step: u64, loss: f64) -> String {
    format!(
        r#"{{"type":"step","data":{{"step":{step},"loss":{loss:?},"micro_batch":4,"memory":{{"params":1,"grads":2,"optimizer":3,"data":4,"activations":5,"peak":{},"budget":0}}}}}}"#,
        100 + step % 50
    )
}

#[test]
fn report_skips_an_overlong_line_naming_the_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    fs::create_dir_all(&run).unwrap();
    let huge = format!(r#"{{"type":"step","data":{{"step":2,"pad":"{}"}}}}"#, "z".repeat(5 << 20));
    fs::write(run.join("metrics.jsonl"), [step_line(1, 5.0), huge, step_line(3, 4.0)].join("\n")).unwrap();
    let out = ok(ava(dir.path(), &["--format", "json", "report", "run"]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("run/metrics.jsonl:2: a line of more than 1048576 bytes, skipped"), "{stderr}");
    let json = json_of(&out);
    assert_eq!((json["steps"].as_u64(), json["last_loss"][1].as_f64()), (Some(3), Some(4.0)));
    let out = ok(ava(dir.path(), &["--format", "json", "report", "run", "--metric", "loss"]));
    assert!(String::from_utf8_lossy(&out.stderr).contains(":2: a line of more than"));
    assert_eq!(json_of(&out)["runs"][0]["points"], serde_json::json!([[1, 5.0], [3, 4.0]]));
}

#[test]
fn report_of_a_long_run_keeps_a_bounded_number_of_points() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    fs::create_dir_all(&run).unwrap();
    let n = 30_000u64;
    let text: Vec<String> = (1..=n).map(|s| step_line(s, 10.0 / s as f64)).collect();
    fs::write(run.join("metrics.jsonl"), text.join("\n")).unwrap();
    let out = ok(ava(dir.path(), &["--format", "json", "report", "run", "--metric", "loss"]));
    let points = json_of(&out)["runs"][0]["points"].as_array().unwrap().len();
    assert!(points <= ava_train::train::metrics::MAX_POINTS + 2, "{points} points kept");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("every 8th step is kept"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = ok(ava(dir.path(), &["--format", "json", "report", "run"]));
    let json = json_of(&out);
    assert_eq!(json["steps"].as_u64(), Some(n), "the summary reads every record");
    assert_eq!(json["peak_step"].as_u64(), Some(49));
}

/// Rewrites `file` in checkpoint `ckpt` with `edit`, and its size and checksum in the
/// checkpoint's manifest, as someone crafting a checkpoint would.
fn craft(ckpt: &Path, file: &str, edit: impl FnOnce(&mut Value)) {
    use sha2::Digest;
    let mut v: Value = serde_json::from_slice(&fs::read(ckpt.join(file)).unwrap()).unwrap();
    edit(&mut v);
    let bytes = serde_json::to_vec(&v).unwrap();
    fs::write(ckpt.join(file), &bytes).unwrap();
    let mut m: Value = serde_json::from_slice(&fs::read(ckpt.join("manifest.json")).unwrap()).unwrap();
    m["files"][file]["sha256"] = Value::from(hex(&sha2::Sha256::digest(&bytes)));
    m["files"][file]["bytes"] = Value::from(bytes.len());
    fs::write(ckpt.join("manifest.json"), serde_json::to_vec(&m).unwrap()).unwrap();
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn a_trainer_json_position_past_the_data_is_refused_at_resume() {
    let dir = tempfile::tempdir().unwrap();
    ok(common::train_small(dir.path(), "out", &["--max-steps", "2"]));
    let ckpt = common::checkpoint(&dir.path().join("out"), 2);
    // Past the last 64-bit sequence index (it used to hang the loader's threads).
    let position = u64::MAX - 2;
    craft(&ckpt, "trainer.json", |v| v["data_position"] = Value::from(position));
    let err = usage_error(common::train_small(dir.path(), "out", &["--max-steps", "4", "--resume", "latest"]));
    let expected = format!("data_position is {position}: {position} batches of 4 sequences are past the last 64-bit");
    assert!(err.contains(&format!("out/checkpoints/step-00000002/trainer.json: {expected}")), "{err}");
    assert!(err.contains("this checkpoint is damaged or from another run; resume from an older one"), "{err}");
    craft(&ckpt, "trainer.json", |v| v["data_position"] = Value::from(4));
    ok(common::train_small(dir.path(), "out", &["--max-steps", "4", "--resume", "latest"]));
}

/// A checkpoint whose step was edited in both its trainer.json and its manifest (checksums
/// made to match) is refused: its directory is still named for the step it was written at.
#[test]
fn a_checkpoint_step_edited_in_both_files_is_refused_at_resume() {
    let dir = tempfile::tempdir().unwrap();
    ok(common::train_small(dir.path(), "out", &["--max-steps", "2"]));
    let ckpt = common::checkpoint(&dir.path().join("out"), 2);
    craft(&ckpt, "trainer.json", |v| v["step"] = Value::from(9));
    let manifest = ckpt.join("manifest.json");
    let mut m: Value = serde_json::from_slice(&fs::read(&manifest).unwrap()).unwrap();
    m["step"] = Value::from(9);
    fs::write(&manifest, serde_json::to_vec(&m).unwrap()).unwrap();
    let err = usage_error(common::train_small(dir.path(), "out", &["--max-steps", "12", "--resume", "latest"]));
    assert!(
        err.contains("its directory is named for step 2, but its manifest and step say 9: edited after it was written"),
        "{err}"
    );
}
