//! A run's TensorBoard event files, read back by a reader written here from the format's
//! description alone (TensorFlow's `record_writer.cc` framing, the protocol buffer wire format,
//! the `Event`/`Summary` field numbers), sharing no code with the writer: a bitwise CRC-32C,
//! a varint decoder. The scalars are `metrics.jsonl`'s values at the same steps; a resumed
//! run's files hold each step once; `train.log.tensorboard: false` writes none.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ava_plugins::Registry;
use ava_train::config::Config;
use ava_train::train::{Reporter, Silent, TrainOptions, Trainer};

fn config(out: &Path, sets: &[&str]) -> Config {
    let base = [
        "train.micro_batch_size=4",
        "train.max_steps=6",
        "train.eval_every=3",
        "train.sample_every=3",
        "train.sample_tokens=8",
        "train.log_every=1",
        "checkpoints.every=2",
    ];
    common::tiny_config(out, &[&base[..], sets].concat())
}

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), one bit at a time.
fn crc32c(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 { (crc >> 1) ^ 0x82F6_3B78 } else { crc >> 1 };
        }
    }
    !crc
}

fn masked(bytes: &[u8]) -> u32 {
    let c = crc32c(bytes);
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// The protocol buffer fields of `msg`: (number, wire type, the varint or the 4/8 bytes as a
/// number, the length-delimited bytes).
fn fields(mut msg: &[u8]) -> Vec<(u64, u8, u64, Vec<u8>)> {
    fn varint(b: &mut &[u8]) -> u64 {
        let (mut v, mut shift) = (0u64, 0);
        loop {
            let byte = b[0];
            *b = &b[1..];
            v |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return v;
            }
            shift += 7;
        }
    }
    let mut out = Vec::new();
    while !msg.is_empty() {
        let key = varint(&mut msg);
        let (number, wire) = (key >> 3, (key & 7) as u8);
        match wire {
            0 => out.push((number, wire, varint(&mut msg), Vec::new())),
            1 => {
                out.push((number, wire, u64::from_le_bytes(msg[..8].try_into().unwrap()), Vec::new()));
                msg = &msg[8..];
            }
            2 => {
                let len = varint(&mut msg) as usize;
                out.push((number, wire, 0, msg[..len].to_vec()));
                msg = &msg[len..];
            }
            5 => {
                out.push((number, wire, u64::from(u32::from_le_bytes(msg[..4].try_into().unwrap())), Vec::new()));
                msg = &msg[4..];
            }
            other => panic!("wire type {other} in an event"),
        }
    }
    out
}

/// What a run's event files hold: the file versions, and per step its scalars and texts
/// by tag (a tag logged twice at a step is an error: a step is in the files once).
#[derive(Default, Debug)]
struct Events {
    versions: Vec<String>,
    scalars: BTreeMap<(i64, String), f32>,
    texts: BTreeMap<(i64, String), String>,
}

fn event_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_str().unwrap().contains("tfevents"))
        .collect();
    files.sort();
    files
}

fn read_events(dir: &Path) -> Events {
    let mut events = Events::default();
    for file in event_files(dir) {
        let bytes = std::fs::read(&file).unwrap();
        let mut at = 0;
        while at < bytes.len() {
            let len_bytes = &bytes[at..at + 8];
            let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
            assert_eq!(u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap()), masked(len_bytes));
            let data = &bytes[at + 12..at + 12 + len];
            let crc = u32::from_le_bytes(bytes[at + 12 + len..at + 16 + len].try_into().unwrap());
            assert_eq!(crc, masked(data), "{} at {at}", file.display());
            at += 16 + len;
            let event = fields(data);
            let step = event.iter().find(|f| f.0 == 2).map_or(0, |f| f.2 as i64);
            assert!(event.iter().any(|f| f.0 == 1 && f.1 == 1), "every event has its wall time");
            for (number, _, _, bytes) in event {
                match number {
                    3 => events.versions.push(String::from_utf8(bytes).unwrap()),
                    5 => {
                        for (_, _, _, value) in fields(&bytes).into_iter().filter(|f| f.0 == 1) {
                            let value = fields(&value);
                            let tag = value.iter().find(|f| f.0 == 1).map(|f| String::from_utf8(f.3.clone()).unwrap());
                            let tag = tag.expect("a value has a tag");
                            if let Some(simple) = value.iter().find(|f| f.0 == 2) {
                                let old = events.scalars.insert((step, tag.clone()), f32::from_bits(simple.2 as u32));
                                assert!(old.is_none(), "{tag} logged twice at step {step}");
                            } else {
                                let tensor = &value.iter().find(|f| f.0 == 8).expect("a scalar or a tensor").3;
                                let tensor = fields(tensor);
                                assert!(tensor.iter().any(|f| f.0 == 1 && f.2 == 7), "a DT_STRING tensor");
                                let string = tensor.into_iter().find(|f| f.0 == 8).expect("a string").3;
                                // metadata (9) → plugin_data (1) → plugin_name (1): "text".
                                let metadata = &value.iter().find(|f| f.0 == 9).expect("a text's metadata").3;
                                let plugin = &fields(metadata).into_iter().find(|f| f.0 == 1).expect("plugin data").3;
                                let name = fields(plugin).into_iter().find(|f| f.0 == 1).expect("a plugin name").3;
                                assert_eq!(name, b"text");
                                let old = events.texts.insert((step, tag.clone()), String::from_utf8(string).unwrap());
                                assert!(old.is_none(), "{tag} logged twice at step {step}");
                            }
                        }
                    }
                    _ => {}
                }
            }
        }
    }
    events
}

/// metrics.jsonl's `key` of each line of `kind`, by step.
fn metric(dir: &Path, kind: &str, key: &str) -> BTreeMap<i64, f64> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["type"] == kind)
        .map(|v| (v["data"]["step"].as_i64().unwrap(), v["data"][key].as_f64().unwrap()))
        .collect()
}

fn scalar(events: &Events, tag: &str) -> BTreeMap<i64, f32> {
    events.scalars.iter().filter(|((_, t), _)| t == tag).map(|((s, _), v)| (*s, *v)).collect()
}

/// `metrics.jsonl`'s values rounded to the event files' f32.
fn as_f32(values: BTreeMap<i64, f64>) -> BTreeMap<i64, f32> {
    values.into_iter().map(|(s, v)| (s, v as f32)).collect()
}

#[test]
fn a_runs_scalars_are_its_metrics_at_the_same_steps() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = Trainer::new(&config(dir.path(), &[]), &Registry::builtins(), &TrainOptions::default()).unwrap();
    t.run(&TrainOptions::default(), &mut Silent).unwrap();
    assert_eq!(event_files(dir.path()).len(), 1);
    let events = read_events(dir.path());
    assert_eq!(events.versions, ["brain.Event:2"]);
    for (tag, key) in [
        ("train/loss", "loss"),
        ("train/lr", "lr"),
        ("train/grad_norm", "grad_norm"),
        ("train/tokens_per_sec", "tokens_per_sec"),
        ("train/micro_batch", "micro_batch"),
    ] {
        let expected = as_f32(metric(dir.path(), "step", key));
        assert_eq!(expected.keys().copied().collect::<Vec<_>>(), [1, 2, 3, 4, 5, 6]);
        assert_eq!(scalar(&events, tag), expected, "{tag}");
    }
    let peaks: BTreeMap<i64, f32> = std::fs::read_to_string(dir.path().join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["type"] == "step")
        .map(|v| {
            let peak = v["data"]["memory"]["peak"].as_u64().unwrap();
            (v["data"]["step"].as_i64().unwrap(), (peak as f64 / 1048576.0) as f32)
        })
        .collect();
    assert_eq!(scalar(&events, "memory/peak_mib"), peaks);
    assert_eq!(scalar(&events, "eval/val_loss"), as_f32(metric(dir.path(), "eval", "val_loss")));
    assert_eq!(scalar(&events, "eval/val_loss").len(), 2, "steps 3 and 6");
    // Texts: the samples, as string tensors for the text plugin.
    let samples: BTreeMap<i64, String> = std::fs::read_to_string(dir.path().join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["type"] == "sample")
        .map(|v| (v["data"]["step"].as_i64().unwrap(), v["data"]["text"].as_str().unwrap().to_string()))
        .collect();
    let texts: BTreeMap<i64, String> =
        events.texts.iter().filter(|((_, t), _)| t == "samples/text").map(|((s, _), v)| (*s, v.clone())).collect();
    assert_eq!(samples.keys().copied().collect::<Vec<_>>(), [3, 6]);
    assert_eq!(texts, samples);
}

#[test]
fn a_resumed_run_holds_each_step_once() {
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path(), &[]);
    let mut t = Trainer::new(&config, &Registry::builtins(), &TrainOptions::default()).unwrap();
    // Six steps, checkpoints at 2, 4 and 6; then the run goes on from the one at 4, as after a
    // crash at step 6 that lost the last checkpoint: steps 5 and 6 are logged twice over.
    t.run(&TrainOptions::default(), &mut Silent).unwrap();
    let first = read_events(dir.path());
    let resume = TrainOptions {
        resume: Some(dir.path().join("checkpoints/step-00000004").display().to_string()),
        ..Default::default()
    };
    assert!(dir.path().join("checkpoints/step-00000004").is_dir(), "the checkpoint this test resumes");
    let mut t = Trainer::new(&config, &Registry::builtins(), &resume).unwrap();
    t.run(&TrainOptions::default(), &mut Silent).unwrap();
    let second = read_events(dir.path());
    let steps = |e: &Events| scalar(e, "train/loss").keys().copied().collect::<Vec<_>>();
    assert_eq!(steps(&first), [1, 2, 3, 4, 5, 6]);
    assert_eq!(steps(&second), [1, 2, 3, 4, 5, 6], "read_events fails on a step logged twice");
    assert_eq!(event_files(dir.path()).len(), 2, "the first run's file kept up to step 4, and the resumed run's");
    assert_eq!(second.versions.len(), 2);
    let losses = |e: &Events| scalar(e, "train/loss").into_iter().filter(|(s, _)| *s <= 4).collect::<Vec<_>>();
    assert_eq!(losses(&first), losses(&second), "steps up to the checkpoint are the first run's");
    assert_eq!(scalar(&second, "train/loss"), as_f32(metric(dir.path(), "step", "loss")));
}

#[test]
fn turned_off_no_event_file_is_written_and_no_abandoned_step_is_left() {
    let dir = tempfile::tempdir().unwrap();
    let off = config(dir.path(), &["train.log.tensorboard=false", "train.max_steps=2"]);
    let mut t = Trainer::new(&off, &Registry::builtins(), &TrainOptions::default()).unwrap();
    t.run(&TrainOptions::default(), &mut Silent).unwrap();
    assert!(event_files(dir.path()).is_empty());
    assert!(dir.path().join("metrics.jsonl").is_file());

    // Four steps with the events on, then resumed from step 2 with them off: steps 3 and 4
    // leave the event files as they leave metrics.jsonl.
    let dir = tempfile::tempdir().unwrap();
    let on = config(dir.path(), &["train.max_steps=4"]);
    Trainer::new(&on, &Registry::builtins(), &TrainOptions::default())
        .unwrap()
        .run(&TrainOptions::default(), &mut Silent)
        .unwrap();
    let off = config(dir.path(), &["train.max_steps=4", "train.log.tensorboard=false"]);
    let resume = TrainOptions {
        resume: Some(dir.path().join("checkpoints/step-00000002").display().to_string()),
        ..Default::default()
    };
    Trainer::new(&off, &Registry::builtins(), &resume).unwrap().run(&TrainOptions::default(), &mut Silent).unwrap();
    assert_eq!(scalar(&read_events(dir.path()), "train/loss").keys().copied().collect::<Vec<_>>(), [1, 2]);
    assert_eq!(event_files(dir.path()).len(), 1);
}

/// Keeps the warnings a run gives.
#[derive(Default)]
struct Warnings(Vec<String>);

impl Reporter for Warnings {
    fn warn(&mut self, message: &str) {
        self.0.push(message.to_string());
    }
}

#[test]
fn an_event_file_that_cannot_be_written_is_warned_about_and_the_run_goes_on() {
    // A directory where an event file of Ava's name would be read back.
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("events.out.tfevents.1.planted.000.ava")).unwrap();
    let config = config(dir.path(), &["train.max_steps=2"]);
    let mut warnings = Warnings::default();
    let mut t = Trainer::new(&config, &Registry::builtins(), &TrainOptions::default()).unwrap();
    let summary = t.run(&TrainOptions::default(), &mut warnings).unwrap();
    assert_eq!(summary.step, 2, "the run trained");
    let said: Vec<&String> = warnings.0.iter().filter(|w| w.contains("TensorBoard events")).collect();
    assert_eq!(said.len(), 1, "{:?}", warnings.0);
    assert!(said[0].contains("could not open an event file in"), "{}", said[0]);
    assert!(said[0].contains("train.log.tensorboard: false turns them off"), "{}", said[0]);
    assert!(event_files(dir.path()).iter().all(|p| p.is_dir()), "no event file written");
}
