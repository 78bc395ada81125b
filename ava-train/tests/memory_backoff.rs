//! Running out of memory and memory pressure, through the trainer: an allocation failure at
//! step k halves the micro-batch and retries the step on the same samples, with the
//! gradients of a run at the smaller micro-batch and one optimizer step; at the smallest
//! micro-batch the run saves a checkpoint and stops, losing nothing; and pressure that
//! comes and goes with the micro-batch changes it a bounded number of times.

#[global_allocator]
static A: ava_train::memory::CountingAlloc = ava_train::memory::CountingAlloc;

mod common;

use ava_plugins::Registry;
use ava_train::config::Config;
use ava_train::train::{Silent, StepRecord, TrainError, TrainOptions, Trainer};

/// The counting allocator and the hard limit are process-wide: one trainer at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The tiny model (no loader thread allocating beside the measurements) with `sets` on top.
fn config(out: &std::path::Path, sets: &[&str]) -> Config {
    let base = [
        "train.micro_batch_size=8",
        "train.gradient_accumulation_steps=2",
        "train.max_steps=6",
        "train.eval_every=0",
        "checkpoints.every=0",
        "memory.budget=1GiB",
    ];
    common::tiny_config(out, &[&base[..], sets].concat())
}

fn trainer(config: &Config, options: TrainOptions) -> Trainer {
    Trainer::new(config, &Registry::builtins(), &options).unwrap()
}

/// Every weight's values, in order.
fn weights(t: &Trainer) -> Vec<Vec<f32>> {
    t.model()
        .named_tensors()
        .iter()
        .map(|(_, w)| w.flatten_all().unwrap().to_dtype(candle_core::DType::F32).unwrap().to_vec1().unwrap())
        .collect()
}

#[test]
fn out_of_memory_at_step_k_retries_it_at_half_the_micro_batch() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), &[]);
    let k = 3;

    // The run that runs out of memory in the first micro-step of step k.
    let mut oom = trainer(&cfg, TrainOptions { oom_at_step: Some(k), ..Default::default() });
    let records: Vec<StepRecord> = (1..=k).map(|_| oom.train_step().unwrap()).collect();
    // The reference: the same steps, the micro-batch halved by hand before step k.
    let mut reference = trainer(&cfg, TrainOptions::default());
    let mut before_k = Vec::new();
    for step in 1..=k {
        if step == k {
            assert!(reference.shrink_micro_batch());
        }
        before_k.push(reference.train_step().unwrap());
    }
    // And one that never shrinks, to show the comparison tells them apart.
    let mut plain = trainer(&cfg, TrainOptions::default());
    for _ in 1..=k {
        plain.train_step().unwrap();
    }

    let at_k = &records[k as usize - 1];
    assert!(records[..k as usize - 1].iter().all(|r| r.backoffs.is_empty() && r.micro_batch == 8));
    assert_eq!(at_k.backoffs.len(), 1, "{:?}", at_k.backoffs);
    let b = &at_k.backoffs[0];
    assert_eq!((b.micro_batch, b.retry_micro_batch, at_k.micro_batch), (8, 4, 4));
    // The abandoned attempt's partial gradients and graph are gone: memory is back where
    // it was before its first micro-step, to the byte.
    assert!(b.crossed_at > b.held_before, "{b:?}");
    assert_eq!(b.held_after, b.held_before, "memory after the abandoned attempt: {b:?}");

    // One optimizer step per step, and the gradients of the run at micro-batch 4: the same
    // loss, weights and optimizer state, bit for bit.
    assert_eq!(oom.step(), k);
    assert_eq!(at_k.loss, before_k[k as usize - 1].loss);
    assert!(weights(&oom) == weights(&reference), "the retried step differs from a step at micro-batch 4");
    assert!(oom.optimizer_state() == reference.optimizer_state(), "the optimizer state differs");
    assert!(weights(&plain) != weights(&reference), "micro-batch 4 and 8 give identical weights: no test");
    // The same samples: the loader is where a run without the failure is, and stays in step.
    assert_eq!(oom.data_position(), plain.data_position());
    assert_eq!(oom.data_position(), u64::from(k as u32) * 2);
    let (next, next_ref) = (oom.train_step().unwrap(), reference.train_step().unwrap());
    assert_eq!(next.loss, next_ref.loss);
    assert!(weights(&oom) == weights(&reference));
}

/// A step off the `log_every` grid where the micro-batch was halved is still written to
/// metrics.jsonl, with its back-off and event, so the report sees the change; steps with
/// nothing to say stay off the grid.
#[test]
fn a_back_off_off_the_log_grid_is_still_logged() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), &["train.log_every=5", "train.max_steps=7"]);
    let mut t = trainer(&cfg, TrainOptions { oom_at_step: Some(2), ..Default::default() });
    t.run(&TrainOptions::default(), &mut Silent).unwrap();
    let metrics = std::fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
    let steps: Vec<serde_json::Value> = metrics
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["type"] == "step")
        .map(|v| v["data"].clone())
        .collect();
    let numbers: Vec<u64> = steps.iter().map(|s| s["step"].as_u64().unwrap()).collect();
    assert_eq!(numbers, [2, 5, 7], "step 2 (the back-off), the grid's 5 and the last");
    assert_eq!(steps[0]["micro_batch"], 4);
    assert_eq!(steps[0]["backoffs"][0]["micro_batch"], 8);
    assert_eq!(steps[0]["backoffs"][0]["retry_micro_batch"], 4);
    assert!(steps[0]["memory_events"][0].as_str().unwrap().starts_with("out of memory at step 2"), "{:?}", steps[0]);

    let run = ava_train::train::metrics::read_run(&dir.path().join("metrics.jsonl")).unwrap();
    assert_eq!(run.steps[0].backoffs.len(), 1, "the report reads the back-off back");
}

#[test]
fn out_of_memory_at_the_smallest_micro_batch_saves_and_stops_losing_nothing() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), &["train.micro_batch_size=1", "train.max_steps=4"]);
    let mut oom = trainer(&cfg, TrainOptions { oom_at_step: Some(3), ..Default::default() });
    let summary = oom.run(&TrainOptions::default(), &mut Silent).unwrap();
    let stopped = summary.stopped.clone().expect("the run stops");
    assert!(
        stopped.starts_with("out of memory at step 3: an allocation took the count to ")
            && stopped.contains("with the micro-batch at 1, the smallest it can be halved to; lower data.seq_len"),
        "{stopped}"
    );
    assert_eq!((summary.step, oom.step()), (2, 2));
    assert!(summary.checkpoint.as_deref().is_some_and(|c| c.ends_with("step-00000002")), "{summary:?}");
    assert!(summary.model_dir.is_none());

    // Resumed and out of memory again at once: it stops at the checkpoint it resumed from.
    let again = TrainOptions { resume: Some("latest".into()), oom_at_step: Some(3), ..Default::default() };
    let summary = trainer(&cfg, again.clone()).run(&again, &mut Silent).unwrap();
    assert!(summary.stopped.is_some() && summary.checkpoint.as_deref().is_some_and(|c| c.ends_with("step-00000002")));

    // Resumed, it finishes exactly as a run that never failed.
    let resume = TrainOptions { resume: Some("latest".into()), ..Default::default() };
    let mut resumed = trainer(&cfg, resume.clone());
    assert_eq!(resumed.step(), 2);
    resumed.run(&resume, &mut Silent).unwrap();
    let other = tempfile::tempdir().unwrap();
    let mut plain =
        trainer(&config(other.path(), &["train.micro_batch_size=1", "train.max_steps=4"]), TrainOptions::default());
    plain.run(&TrainOptions::default(), &mut Silent).unwrap();
    assert!(weights(&resumed) == weights(&plain), "the resumed run differs from one that never ran out of memory");
}

#[test]
fn a_hard_limit_below_the_budget_is_refused() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), &["memory.hard_limit=512MiB"]);
    let e = Trainer::new(&cfg, &Registry::builtins(), &TrainOptions::default()).unwrap_err();
    assert!(matches!(e, TrainError::Invalid(_)));
    assert_eq!(
        e.to_string(),
        "memory.hard_limit (512MiB) is below memory.budget (1GiB): the memory policy acts at fractions of the \
         budget, so memory would run out before it could; lower memory.budget or raise memory.hard_limit"
    );
}

/// A budget the step's peak crosses at `critical` at micro-batch 8 and stays under
/// `target` at 4: the policy shrinks, then after `restore_after` calm steps restores, and
/// so on. The changes are bounded by the hysteresis: one shrink and one restore per
/// `restore_after + 1` steps.
#[test]
fn pressure_that_comes_and_goes_changes_the_micro_batch_a_bounded_number_of_times() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    // A longer sequence, so activations (which the micro-batch scales) dominate the peak.
    let sets = ["data.seq_len=256", "model.num_layers=4", "train.log_every=1"];
    let peak_at = |micro: &str| {
        let cfg = config(dir.path(), &[&sets[..], &[micro]].concat());
        let mut t = trainer(&cfg, TrainOptions::default());
        t.train_step().unwrap();
        t.train_step().unwrap().memory.peak
    };
    let (p8, p4) = (peak_at("train.micro_batch_size=8"), peak_at("train.micro_batch_size=4"));
    // Wide bands, so run-to-run noise cannot move a step across one: micro-batch 8 at 80%
    // of the budget (critical from 70%, emergency from 99%), 4 under the 50% target.
    let budget = (p8 as f64 / 0.8) as u64;
    assert!((p4 as f64) < 0.45 * budget as f64, "micro-batch 4 peaks at {p4}, 8 at {p8}: too close to test");

    for (restore_after, steps) in [(3u64, 24u64), (1000, 24)] {
        let budget_set = format!("memory.budget={budget}");
        let policy = format!(
            "plugins.memory={{name: thresholds, target: 0.5, warning: 0.6, critical: 0.7, emergency: 0.99, \
             restore_after: {restore_after}}}"
        );
        let max_steps = format!("train.max_steps={steps}");
        let cfg = config(dir.path(), &[&sets[..], &[&budget_set, &policy, &max_steps]].concat());
        let mut t = trainer(&cfg, TrainOptions::default());
        let mut sizes = vec![t.micro_batch()];
        let summary = t.run(&TrainOptions::default(), &mut Silent).unwrap();
        assert!(summary.stopped.is_none(), "{summary:?}");
        let metrics = std::fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
        for line in metrics.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()) {
            if line["type"] == "step" {
                sizes.push(line["data"]["micro_batch"].as_u64().unwrap() as usize);
            }
        }
        let changes = sizes.windows(2).filter(|w| w[0] != w[1]).count() as u64;
        println!("restore_after {restore_after}: micro-batches {sizes:?}, {changes} changes");
        // Each cycle: a shrink after a step at 8, restore_after calm steps at 4, a restore.
        let bound = 2 * steps.div_ceil(restore_after + 1);
        assert!(changes <= bound, "{changes} changes over {steps} steps, bound {bound}: {sizes:?}");
        assert!(changes >= 1, "the pressure never shrank the micro-batch: {sizes:?}");
        if restore_after >= steps {
            assert_eq!(changes, 1, "{sizes:?}");
        } else {
            assert!(changes >= bound - 2, "it should keep cycling: {sizes:?}");
        }
    }
}
