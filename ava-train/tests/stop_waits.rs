//! A stop asked while ranks wait outside a step's work: two ranks that are threads of this
//! process, rank 1's data loader hung on a batch (the test hook), rank 0 waiting for rank 1
//! in a collective. Once the stop flag is set, both return an interrupted run saying which
//! wait it ended (rank 1 the loader's, rank 0 the other ranks'), instead of rank 0 waiting
//! out the collective timeout; nothing is saved (a step may be half applied on a rank), so
//! the latest checkpoint stays the last complete one.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use ava_plugins::Registry;
use ava_train::config::Config;
use ava_train::dist::{Collectives, thread_group};
use ava_train::train::{RunSummary, TrainOptions, Trainer};

mod common;

fn config(out: &Path) -> Config {
    let sets = [
        "data.seq_len=16",
        "train.max_steps=6",
        "train.gradient_accumulation_steps=1",
        "train.warmup_steps=1",
        "train.eval_every=0",
        "train.log_every=1",
        "train.threads=1",
        "checkpoints.every=2",
    ];
    common::tiny_config(out, &sets)
}

/// Sets `stop` once step 2's checkpoint is the latest (rank 1 then hangs in step 3's wait
/// for its batch 2, and rank 0 soon waits for it).
fn stop_after_step_two(out: &Path, stop: &AtomicBool) {
    let deadline = Instant::now() + Duration::from_secs(300);
    while std::fs::read_to_string(out.join("checkpoints/latest")).unwrap_or_default().trim() != "step-00000002" {
        assert!(Instant::now() < deadline, "no checkpoint of step 2 after 5 minutes");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Time for rank 0 to reach step 3's first collective (a few milliseconds of work).
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::SeqCst);
}

#[test]
fn a_stop_ends_a_rank_hung_on_data_and_the_rank_waiting_for_it() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let config = config(&out);
    let stop = Arc::new(AtomicBool::new(false));
    let summaries: Vec<RunSummary> = std::thread::scope(|s| {
        let ranks: Vec<_> = thread_group(2)
            .into_iter()
            .map(|g| {
                let (config, stop) = (&config, stop.clone());
                s.spawn(move || {
                    let rank = g.rank();
                    let group: Arc<dyn Collectives> = Arc::new(g);
                    let options = TrainOptions {
                        group: Some(group),
                        stop: Some(stop),
                        stall_loader_at_batch: (rank == 1).then_some(2),
                        ..Default::default()
                    };
                    let mut t = Trainer::new(config, &Registry::builtins(), &options).unwrap();
                    t.run(&options, &mut ava_train::train::Silent).unwrap()
                })
            })
            .collect();
        stop_after_step_two(&out, &stop);
        ranks.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, summary) in summaries.iter().enumerate() {
        assert!(summary.interrupted, "rank {rank}: {summary:?}");
        assert_eq!(summary.step, 2, "rank {rank}");
    }
    let waits: Vec<&str> = summaries.iter().map(|s| s.interrupted_while.as_deref().unwrap_or("")).collect();
    assert!(waits[1].starts_with("stopped while waiting for the data loader: batch 2 of the train split"), "{waits:?}");
    assert!(waits[0].starts_with("stopped while waiting for the other ranks: ranks [1] had not joined"), "{waits:?}");
    assert_eq!(summaries[0].checkpoint.as_deref(), Some(out.join("checkpoints/step-00000002").to_str().unwrap()));
    let names: Vec<String> = std::fs::read_dir(out.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(!names.iter().any(|n| n.contains("00000003") || n.contains("tmp")), "{names:?}");
}
