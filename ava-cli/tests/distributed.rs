//! `mpirun -np 2 ava train` end to end, over the system's Open MPI (built only with
//! `--features mpi`; `.ci/run` installs Open MPI and runs these). The in-process ranks of
//! `ava-train/tests/distributed.rs` check the numbers closely; these check the launch, the
//! MPI collectives and what a user sees:
//!
//! - 2 ranks × micro-batch B train like 1 process × micro-batch 2B, for ZeRO stages 0–3,
//!   with adamw and adam-8bit: per-step losses within 1e-5 relative (f32 sums over the ranks
//!   in another order than one process's); stages 0 and 1 write the same checkpoint bytes,
//!   and so do stages 2 and 3 (stage 2 reduces each micro-batch as backward finishes it, so
//!   with accumulation its sums are added in another order than stage 1's; stage 3's rank 0
//!   asks the other rank for its weights as it writes);
//! - a checkpoint of 2 ranks resumes on 1 process (micro-batch 2B), on 2 ranks (bit for bit)
//!   and on 2 ranks at another stage, including from and to stage 3;
//! - a rank killed mid-run makes the job exit non-zero within 30 s naming it, and the last
//!   checkpoint stays intact (resuming from it works);
//! - each rank's measured peak memory is within 5% of `ava estimate --world-size 2 --rank r`,
//!   at every stage (gradient- and state-heavy sizes: kilobytes of allocator jitter against
//!   tens of megabytes);
//! - a config that cannot work is refused by every rank, naming the keys, exit 2;
//! - `ava train --nproc 2` is the same as mpirun.
#![cfg(feature = "mpi")]

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{SMALL, checkpoint, losses, ok};

/// `mpirun -np N ava train` with the [`SMALL`] settings into `dir/out`, plus `extra`.
fn mpirun(n: usize, dir: &Path, out: &str, extra: &[&str]) -> Command {
    let mut cmd = Command::new("mpirun");
    cmd.args(["-np", &n.to_string(), "--oversubscribe"]);
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        cmd.arg("--allow-run-as-root");
    }
    cmd.arg(env!("CARGO_BIN_EXE_ava")).arg("train");
    for s in SMALL {
        cmd.args(["--set", s]);
    }
    cmd.args(["--set", &format!("train.out_dir={out}"), "--set", "train.threads=1"]);
    cmd.args(extra).current_dir(dir).env("NO_COLOR", "1");
    for (key, _) in std::env::vars() {
        if key.starts_with("AVA") {
            cmd.env_remove(key);
        }
    }
    cmd
}

fn plugins() -> String {
    ava_tests::workspace_plugins_dir_with(&["ava-cli/mpi"]).display().to_string()
}

fn one_process(dir: &Path, out: &str, extra: &[&str]) -> Output {
    let mut args = vec!["--set", "train.micro_batch_size=8", "--set", "train.threads=1"];
    args.extend(extra);
    common::train_small(dir, out, &args)
}

#[track_caller]
fn assert_losses_close(a: &[(u64, f64)], b: &[(u64, f64)], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: {a:?} vs {b:?}");
    for ((sa, x), (sb, y)) in a.iter().zip(b) {
        assert_eq!(sa, sb);
        assert!((x - y).abs() <= 1e-5 * y.abs(), "{what}: step {sa}: {x} vs {y}");
    }
}

#[test]
fn two_ranks_train_like_one_process_at_every_stage_with_adamw_and_adam_8bit() {
    let paths = format!("plugins.search_paths=[{}]", plugins());
    let dir = tempfile::tempdir().unwrap();
    for optimizer in ["adamw", "{name: adam-8bit, min_8bit_size: 256, block_size: 64}"] {
        let opt = format!("plugins.optimizer={optimizer}");
        let common = ["--max-steps", "3", "--set", &opt, "--set", &paths];
        let single = format!("one-{}", optimizer.len());
        ok(one_process(dir.path(), &single, &common));
        let reference = losses(&dir.path().join(&single));
        let mut bytes = Vec::new();
        for stage in 0..=3 {
            let out = format!("two-{}-{stage}", optimizer.len());
            let stage_set = format!("distributed.zero_stage={stage}");
            let o = mpirun(2, dir.path(), &out, &common).args(["--set", &stage_set]).output().unwrap();
            let o = ok(o);
            let stderr = String::from_utf8_lossy(&o.stderr);
            assert!(stderr.contains("2 ranks over MPI (Open MPI"), "{stderr}");
            assert!(stderr.contains(&format!("ZeRO stage {stage}")), "{stderr}");
            assert_losses_close(&losses(&dir.path().join(&out)), &reference, &format!("{optimizer} stage {stage}"));
            let ckpt = checkpoint(&dir.path().join(&out), 3);
            let files = ["model.safetensors", "optimizer.safetensors"];
            bytes.push(files.map(|f| std::fs::read(ckpt.join(f)).unwrap()));
        }
        assert!(bytes[0] == bytes[1], "{optimizer}: stages 0 and 1 wrote different checkpoints");
        assert!(bytes[2] == bytes[3], "{optimizer}: stages 2 and 3 wrote different checkpoints");
    }
}

#[test]
fn a_checkpoint_of_two_ranks_resumes_on_one_process_and_on_two_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let stage = |s: u8| ["--set".to_string(), format!("distributed.zero_stage={s}")];
    ok(mpirun(2, dir.path(), "straight", &["--max-steps", "4"]).args(stage(2)).output().unwrap());
    // (run, stage saved at, ranks resumed on, stage resumed at)
    let runs = [
        ("on-two", 2, 2, 2),
        ("on-two-stage-1", 2, 2, 1),
        ("on-two-stage-3", 2, 2, 3),
        ("from-stage-3", 3, 2, 2),
        ("on-one", 2, 1, 0),
    ];
    for (run, saved_stage, world, resumed_stage) in runs {
        let first = ["--max-steps", "4", "--steps", "2"];
        ok(mpirun(2, dir.path(), run, &first).args(stage(saved_stage)).output().unwrap());
        let resume = ["--max-steps", "4", "--resume", "latest"];
        let o = if world == 2 {
            mpirun(2, dir.path(), run, &resume).args(stage(resumed_stage)).output().unwrap()
        } else {
            one_process(dir.path(), run, &resume)
        };
        let stderr = String::from_utf8_lossy(&ok(o).stderr).into_owned();
        assert!(stderr.contains("continuing at step 3"), "{stderr}");
        let (a, b) = (losses(&dir.path().join("straight")), losses(&dir.path().join(run)));
        // Stages 2 and 3 compute the same numbers; stage 1 adds in another order.
        if resumed_stage >= 2 {
            assert_eq!(a, b, "resumed on 2 ranks");
            let model = |r: &str| std::fs::read(checkpoint(&dir.path().join(r), 4).join("model.safetensors")).unwrap();
            assert!(model("straight") == model(run), "resumed on 2 ranks: final weights differ");
        } else {
            assert_losses_close(&b, &a, &format!("resumed on {world} ranks at stage {resumed_stage}"));
        }
    }
}

/// The pid of rank `rank` among `mpirun`'s children (Open MPI starts a job on one machine
/// as its direct children, each told its rank in OMPI_COMM_WORLD_RANK).
fn rank_pid(mpirun: u32, rank: usize) -> Option<u32> {
    let children = std::fs::read_to_string(format!("/proc/{mpirun}/task/{mpirun}/children")).ok()?;
    children.split_whitespace().filter_map(|p| p.parse::<u32>().ok()).find(|pid| {
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        environ.split(|&b| b == 0).any(|kv| kv == format!("OMPI_COMM_WORLD_RANK={rank}").as_bytes())
    })
}

#[test]
fn a_killed_rank_stops_the_job_naming_it_and_the_last_checkpoint_is_intact() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let mut child = mpirun(2, dir.path(), "run", &["--max-steps", "100000", "--set", "checkpoints.every=1"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait for a checkpoint, then kill rank 1 in the middle of training.
    let deadline = Instant::now() + Duration::from_secs(120);
    while !checkpoint(&run, 2).join("manifest.json").is_file() {
        assert!(Instant::now() < deadline, "no checkpoint within 120 s");
        std::thread::sleep(Duration::from_millis(50));
    }
    let pid = rank_pid(child.id(), 1).expect("rank 1 among mpirun's children");
    // SAFETY: kill has no memory preconditions.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
    let killed = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(killed.elapsed() < Duration::from_secs(30), "the job still runs 30 s after rank 1 was killed");
        std::thread::sleep(Duration::from_millis(50));
    };
    let stderr = std::io::read_to_string(child.stderr.take().unwrap()).unwrap();
    assert!(!status.success(), "{stderr}");
    assert!(stderr.contains("process rank 1") && stderr.contains("signal 9"), "{stderr}");
    // The newest complete checkpoint loads (its files match its manifest) and training goes on.
    let o = ok(mpirun(2, dir.path(), "run", &["--max-steps", "100000", "--steps", "1", "--resume", "latest"])
        .output()
        .unwrap());
    assert!(String::from_utf8_lossy(&o.stderr).contains("resumed from"), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn a_config_that_cannot_work_is_refused_by_every_rank_with_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let o = mpirun(2, dir.path(), "run", &["--set", "train.step_in_backward=true"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{stderr}");
    for rank in 0..2 {
        let said = format!("error: rank {rank} of 2: ");
        assert!(
            stderr.contains(&said) && stderr.contains("train.step_in_backward is not supported with 2 ranks"),
            "{stderr}"
        );
    }
    // A busy run directory is rank 0's alone to see; the other rank stops too.
    let run = dir.path().join("run");
    std::fs::create_dir_all(&run).unwrap();
    std::fs::write(run.join("metrics.jsonl"), "{}\n").unwrap();
    let o = mpirun(2, dir.path(), "run", &[]).output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("error: rank 0 of 2:") && stderr.contains("holds an earlier run"), "{stderr}");
    assert!(stderr.contains("error: rank 1 of 2: another rank could not start the run"), "{stderr}");
}

#[test]
fn nproc_runs_the_same_command_under_mpirun() {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = common::train_small_command(dir.path(), "run", &["--max-steps", "1", "--set", "train.threads=1"]);
    let o = ok(cmd.args(["--nproc", "2"]).output().unwrap());
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(stderr.contains("2 ranks over MPI"), "{stderr}");
    assert_eq!(losses(&dir.path().join("run")).len(), 1);
}

#[test]
fn each_ranks_peak_is_within_five_percent_of_its_estimate_at_every_stage() {
    let dir = tempfile::tempdir().unwrap();
    // Width 256: the parameters, gradients and state (tens of MB) dominate; small buckets.
    let size = [
        "model.hidden_size=256",
        "model.intermediate_size=704",
        "model.num_heads=4",
        "model.num_kv_heads=4",
        "model.vocab_size=256",
        "data.seq_len=32",
        "train.micro_batch_size=1",
        "distributed.bucket_size=2MiB",
    ];
    // Every stage as is, and stages 2 and 3 with every block recomputed (stage 3 then holds
    // one gathered block at a time; the buckets of each micro-batch land before the next).
    let runs = [(0, "none"), (1, "none"), (2, "none"), (3, "none"), (2, "full"), (3, "full")];
    for (stage, checkpoint) in runs {
        let stage_set = format!("distributed.zero_stage={stage}");
        let checkpoint_set = format!("plugins.checkpoint={checkpoint}");
        let sets = [stage_set.as_str(), checkpoint_set.as_str()];
        let mut args = vec!["--max-steps", "3"];
        for s in size.iter().chain(&sets) {
            args.extend(["--set", s]);
        }
        let out = format!("peaks-{stage}-{checkpoint}");
        ok(mpirun(2, dir.path(), &out, &args).output().unwrap());
        let metrics = std::fs::read_to_string(dir.path().join(&out).join("metrics.jsonl")).unwrap();
        let mut measured = [0u64; 2];
        for line in metrics.lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            for (r, p) in v["data"]["rank_peaks"].as_array().into_iter().flatten().enumerate() {
                measured[r] = measured[r].max(p.as_u64().unwrap());
            }
        }
        for (r, &m) in measured.iter().enumerate() {
            let mut est = std::process::Command::new(env!("CARGO_BIN_EXE_ava"));
            est.args(["--format", "json", "estimate", "--world-size", "2", "--rank", &r.to_string()]);
            for s in common::SMALL.iter().chain(&size).chain(&sets) {
                est.args(["--set", s]);
            }
            let est = common::json_of(&ok(est.current_dir(dir.path()).output().unwrap()));
            let predicted = est["breakdown"]["peak"].as_u64().unwrap();
            let off = m as f64 / predicted as f64 - 1.0;
            let what = format!("stage {stage} checkpoint {checkpoint} rank {r}");
            println!("{what}: measured {m}, estimated {predicted} ({:+.1}%)", 100.0 * off);
            assert!(m > 0 && off.abs() <= 0.05, "{what}: measured {m} vs estimated {predicted}");
        }
    }
}
