//! Data-parallel training on ranks that are threads of this process (the in-process
//! collectives, the same trait the MPI group implements): for ZeRO stages 0 to 3,
//! 2 ranks × micro-batch B train like 1 process × micro-batch 2B; from stage 1 each rank
//! holds half of the optimizer state, at stage 3 only its own parameters' values too; a
//! checkpoint written by 2 ranks resumes on 1, 2 and 3 ranks, and with another stage,
//! continuing as the run that was not interrupted.
//!
//! Tolerance: the ranks' gradients are summed across ranks and then halved, where one
//! process sums over the whole batch inside its kernels; the order of f32 additions differs,
//! so per-step losses agree to 1e-5 relative and weights after 4 AdamW steps to 2e-5
//! absolute (they differ from the first step in the last bits; Adam's normalized update
//! keeps that at the level of f32 rounding times the learning rate and the steps, and how
//! large depends on the matmul kernel's order of additions: 1.1e-5 at most with the `gemm`
//! crate's AVX-512 kernels, under 1e-5 with its AVX2 ones).

use std::sync::Arc;

use ava_plugins::Registry;
use ava_train::config::Config;
use ava_train::dist::{Collectives, thread_group};
use ava_train::train::{TrainOptions, Trainer};

mod common;

fn config(out: &std::path::Path, sets: &[String]) -> Config {
    let base = [
        "data.seq_len=16",
        "train.max_steps=4",
        "train.warmup_steps=1",
        "train.eval_every=0",
        "train.eval_batches=2",
        "train.threads=1",
        "checkpoints.every=2",
    ];
    let sets: Vec<&str> = base.into_iter().chain(sets.iter().map(String::as_str)).collect();
    common::tiny_config(out, &sets)
}

/// What a rank saw: each step's loss, and the final weights.
#[derive(Debug, Clone)]
struct Outcome {
    losses: Vec<f64>,
    /// Each step's gradient norm (Adam's update hides a wrongly scaled gradient; this does not).
    norms: Vec<f64>,
    weights: Vec<Vec<f32>>,
    state_bytes: u64,
    /// The most state one parameter has.
    largest: u64,
    val_loss: Option<f64>,
}

fn weights(t: &Trainer) -> Vec<Vec<f32>> {
    t.consolidated_weights()
        .unwrap()
        .iter()
        .map(|(_, w)| w.flatten_all().unwrap().to_dtype(candle_core::DType::F32).unwrap().to_vec1().unwrap())
        .collect()
}

/// Trains `config` on `world` thread ranks up to step `until` (at most `train.max_steps`),
/// saving every `checkpoints.every` steps (rank 0 writes; the others send it their state),
/// resuming from `resume` if given; returns every rank's outcome.
fn train_until(world: usize, config: &Config, resume: Option<&str>, until: u64) -> Vec<Outcome> {
    let groups = thread_group(world);
    std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|g| {
                s.spawn(move || {
                    let group: Arc<dyn Collectives> = Arc::new(g);
                    let options =
                        TrainOptions { group: Some(group), resume: resume.map(str::to_string), ..Default::default() };
                    let mut t = Trainer::new(config, &Registry::builtins(), &options).unwrap();
                    let state_bytes = t.optimizer_state().held_bytes();
                    let per_param = t.optimizer_state().buffers.iter().map(|b| b.iter().map(|b| b.spec.bytes()).sum());
                    let largest = per_param.max().unwrap_or(0);
                    let (mut losses, mut norms) = (Vec::new(), Vec::new());
                    let last = until.min(config.train.max_steps);
                    while t.step() < last {
                        let record = t.train_step().unwrap();
                        losses.push(record.loss);
                        norms.push(record.grad_norm);
                        if t.step().is_multiple_of(config.checkpoints.every) {
                            t.save_checkpoint().unwrap();
                        }
                    }
                    let val_loss = Some(t.evaluate().unwrap().val_loss);
                    if config.distributed.zero_stage == 3 && t.zero().size() > 1 {
                        // Only the rank's own parameters hold values between steps.
                        let held: usize = t.model().params().iter().map(|p| p.var.elem_count()).sum();
                        let total = t.model().spec().num_params();
                        assert!(held > 0 && held < total, "stage 3 rank holds {held} of {total} weights");
                    }
                    Outcome { losses, norms, weights: weights(&t), state_bytes, largest, val_loss }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a rank panicked")).collect()
    })
}

fn train(world: usize, config: &Config, resume: Option<&str>) -> Vec<Outcome> {
    train_until(world, config, resume, u64::MAX)
}

fn assert_close(a: &Outcome, b: &Outcome, what: &str) {
    assert_eq!(a.losses.len(), b.losses.len(), "{what}: steps");
    for (x, y) in a.losses.iter().zip(&b.losses) {
        assert!((x - y).abs() <= 1e-5 * y.abs(), "{what}: loss {x} vs {y}");
    }
    for (x, y) in a.norms.iter().zip(&b.norms) {
        assert!((x - y).abs() <= 1e-5 * y.abs(), "{what}: gradient norm {x} vs {y}");
    }
    let (va, vb) = (a.val_loss.unwrap(), b.val_loss.unwrap());
    assert!((va - vb).abs() <= 1e-5 * vb.abs(), "{what}: validation loss {va} vs {vb}");
    let mut worst = 0f32;
    for (wa, wb) in a.weights.iter().zip(&b.weights) {
        for (x, y) in wa.iter().zip(wb) {
            worst = worst.max((x - y).abs());
        }
    }
    assert!(worst <= 2e-5, "{what}: weights differ by up to {worst}");
}

fn sets(stage: u8, micro: usize, extra: &[&str]) -> Vec<String> {
    let mut v = vec![format!("distributed.zero_stage={stage}"), format!("train.micro_batch_size={micro}")];
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

#[test]
fn two_ranks_train_like_one_process_with_the_whole_batch_at_every_stage() {
    for extra in [&[][..], &["train.gradient_accumulation_steps=2", "train.grad_clip=0.05"][..]] {
        let dir = tempfile::tempdir().unwrap();
        let one = train(1, &config(&dir.path().join("one"), &sets(0, 4, extra)), None).remove(0);
        for stage in 0..=3u8 {
            let out = dir.path().join(format!("stage{stage}"));
            let ranks = train(2, &config(&out, &sets(stage, 2, extra)), None);
            for (r, o) in ranks.iter().enumerate() {
                assert_close(o, &one, &format!("stage {stage} rank {r} {extra:?}"));
            }
            // Every rank ends with the same weights, bit for bit.
            assert!(ranks[0].weights == ranks[1].weights, "stage {stage}: the ranks' weights differ");
            let total = one.state_bytes;
            if stage == 0 {
                assert!(ranks.iter().all(|o| o.state_bytes == total), "stage 0 keeps all of the state on each rank");
            } else {
                // Split by whole parameters: each half within one parameter's state of even.
                assert_eq!(ranks[0].state_bytes + ranks[1].state_bytes, total);
                for o in &ranks {
                    assert!(
                        o.state_bytes.abs_diff(total / 2) <= o.largest,
                        "stage {stage}: {} of {total}",
                        o.state_bytes
                    );
                    assert!(o.state_bytes < total, "stage {stage}: a rank holds all of the state");
                }
            }
        }
    }
}

/// Stage 2 reduce-scatters during backward, one bucket after another as stretches finish:
/// with every block recomputed (a stretch per block), buckets far smaller than a block's
/// gradients (several in flight), MoE experts that some rank's tokens may not reach, and
/// accumulation, the ranks still train like one process with the whole batch. (That an
/// expert no rank's tokens reached stays without a gradient, as alone, is what keeps the
/// weights equal to one process's: a zero gradient would still move it through Adam.)
/// Stage 3 does the same while gathering each block's weights before its forward and again
/// before its recomputation, with tied embeddings (one weight used in two stretches).
#[test]
fn stages_two_and_three_reduce_stretch_by_stretch_during_backward_like_one_process() {
    let extra = [
        "plugins.checkpoint=full",
        "distributed.bucket_size=4KiB",
        "model.moe.num_experts=4",
        // Top-2: with top-1 the renormalized gate is p/p = 1 and the router's gradient only
        // rounding noise, which Adam would scale up to full-size steps.
        "model.moe.top_k=2",
        // The load-balancing loss is not linear in the batch (each rank's router statistics
        // are its own), so it is off for a comparison with one process.
        "model.moe.aux_loss_weight=0",
        "train.gradient_accumulation_steps=2",
    ];
    for tied in [false, true] {
        let mut extra = extra.to_vec();
        if tied {
            extra.push("model.tie_embeddings=true");
        }
        let dir = tempfile::tempdir().unwrap();
        let one = train(1, &config(&dir.path().join("one"), &sets(0, 4, &extra)), None).remove(0);
        for stage in [2u8, 3] {
            let ranks = train(2, &config(&dir.path().join(format!("two-{stage}")), &sets(stage, 2, &extra)), None);
            for (r, o) in ranks.iter().enumerate() {
                assert_close(o, &one, &format!("stage {stage} rank {r} tied {tied}"));
            }
            assert!(ranks[0].weights == ranks[1].weights, "stage {stage}: the ranks' weights differ");
        }
    }
}

#[test]
fn a_checkpoint_of_two_ranks_resumes_on_one_and_on_two_with_any_stage() {
    let dir = tempfile::tempdir().unwrap();
    let straight = train(2, &config(&dir.path().join("straight"), &sets(1, 2, &[])), None).remove(0);
    // Stopped after step 2 (of 4: the schedule is the same) at stage 1 and at stage 3 (whose
    // rank 0 asks the other for its weights as it writes), then resumed to step 4.
    for saved in [1u8, 3] {
        let first = dir.path().join(format!("first-{saved}"));
        train_until(2, &config(&first, &sets(saved, 2, &[])), None, 2);
        let checkpoint = first.join("checkpoints").join("step-00000002");
        let resume = checkpoint.to_str().unwrap();
        for (world, stage, micro) in [(2usize, 1u8, 2usize), (2, 2, 2), (2, 3, 2), (2, 0, 2), (1, 0, 4)] {
            let out = dir.path().join(format!("resumed-{saved}-{world}-{stage}"));
            let resumed = train(world, &config(&out, &sets(stage, micro, &[])), Some(resume)).remove(0);
            let tail = Outcome {
                losses: straight.losses[2..].to_vec(),
                norms: straight.norms[2..].to_vec(),
                ..straight.clone()
            };
            if world == 2 {
                // The same ranks: the same numbers, bit for bit, whatever the stage.
                assert_eq!(resumed.losses, tail.losses, "{world} ranks, stage {stage}");
                assert_eq!(resumed.norms, tail.norms, "{world} ranks, stage {stage}");
                assert!(resumed.weights == straight.weights, "{world} ranks, stage {stage}: weights");
            } else {
                assert_close(&resumed, &tail, &format!("{world} rank, stage {stage}"));
            }
        }
    }
}

/// A checkpoint of 2 ranks at stage 3 resumes on 3 ranks, keeping the global micro-batch
/// (2 × 3 = 3 × 2 sequences): it continues as the run that was not interrupted, within the
/// reduction-order tolerance, and the 3 ranks end with the same weights.
#[test]
fn a_checkpoint_of_two_ranks_resumes_on_three() {
    let dir = tempfile::tempdir().unwrap();
    let straight = train(2, &config(&dir.path().join("straight"), &sets(3, 3, &[])), None).remove(0);
    let first = dir.path().join("first");
    train_until(2, &config(&first, &sets(3, 3, &[])), None, 2);
    let checkpoint = first.join("checkpoints").join("step-00000002");
    let resumed = train(3, &config(&dir.path().join("three"), &sets(3, 2, &[])), Some(checkpoint.to_str().unwrap()));
    let tail =
        Outcome { losses: straight.losses[2..].to_vec(), norms: straight.norms[2..].to_vec(), ..straight.clone() };
    for (r, o) in resumed.iter().enumerate() {
        assert_close(o, &tail, &format!("3 ranks, rank {r}"));
    }
    assert!(resumed.windows(2).all(|w| w[0].weights == w[1].weights), "the 3 ranks' weights differ");
}

#[test]
fn a_changed_global_batch_is_refused_naming_the_keys() {
    let dir = tempfile::tempdir().unwrap();
    let first = dir.path().join("first");
    train_until(2, &config(&first, &sets(0, 2, &[])), None, 2);
    let resume = first.join("checkpoints").join("step-00000002");
    // One process with micro-batch 2 would read half the batch the two ranks read.
    let options = TrainOptions { resume: Some(resume.display().to_string()), ..Default::default() };
    let e = Trainer::new(&config(&dir.path().join("r"), &sets(0, 2, &[])), &Registry::builtins(), &options)
        .unwrap_err()
        .to_string();
    assert!(e.contains("global micro-batch (train.micro_batch_size × ranks): 2 × 2 = 4 -> 2 × 1 = 2"), "{e}");
    assert!(e.contains("resume with train.micro_batch_size: 4"), "{e}");
}

#[test]
fn modes_that_cannot_work_on_several_ranks_are_refused_on_every_rank() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), &sets(2, 2, &["train.step_in_backward=true", "train.grad_clip=0"]));
    let errors: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = thread_group(2)
            .into_iter()
            .map(|g| {
                let cfg = &cfg;
                s.spawn(move || {
                    let options = TrainOptions { group: Some(Arc::new(g)), ..Default::default() };
                    Trainer::new(cfg, &Registry::builtins(), &options).unwrap_err().to_string()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for e in errors {
        assert!(e.contains("train.step_in_backward is not supported with 2 ranks"), "{e}");
    }
}

/// `estimate_on` predicts the state of the rank holding the most, as the trainer splits it;
/// stage 0 (and one rank) the whole state.
#[test]
fn the_estimate_for_a_rank_holds_the_largest_share_of_the_state() {
    let dir = tempfile::tempdir().unwrap();
    let registry = Registry::builtins();
    for stage in 0..=3u8 {
        let cfg = config(&dir.path().join(format!("e{stage}")), &sets(stage, 2, &[]));
        let ranks = train_until(2, &cfg, None, 1);
        let spec = ava_train::train::model_spec(&cfg).unwrap();
        let optimizer = registry.optimizer("adamw", "{}").unwrap();
        let attention = registry.attention("standard", "{}").unwrap();
        let checkpoint = registry.checkpoint("none", "{}").unwrap();
        let plugins = ava_train::estimate::Plugins {
            optimizer: optimizer.as_ref(),
            attention: attention.as_ref(),
            checkpoint: checkpoint.as_ref(),
        };
        let est = ava_train::estimate::estimate_on(&spec, &cfg, &plugins, 2).unwrap();
        let largest = ranks.iter().map(|o| o.state_bytes).max().unwrap();
        assert_eq!(est.breakdown.optimizer, largest, "stage {stage}");
        let alone = ava_train::estimate::estimate_on(&spec, &cfg, &plugins, 1).unwrap();
        let total: u64 = if stage == 0 { ranks[0].state_bytes } else { ranks.iter().map(|o| o.state_bytes).sum() };
        assert_eq!(alone.breakdown.optimizer, total, "stage {stage}, one rank holds it all");
    }
}

/// Ranks reading a prepared corpus (a mixture of two, shuffled) take disjoint rows of each
/// global batch: two ranks of 2 train like one process of 4, and a checkpoint of the two
/// resumes on one with the same losses.
#[test]
fn ranks_read_disjoint_shares_of_a_prepared_mixture_like_one_process() {
    use ava_train::data::prepare::{self, Invalid, PrepareOptions, Reading, Silent};
    let dir = tempfile::tempdir().unwrap();
    for (name, salt) in [("a", 7usize), ("b", 13)] {
        let text = dir.path().join(format!("text-{name}"));
        std::fs::create_dir_all(&text).unwrap();
        for i in 0..12 {
            let body: String = (0..600).map(|w| format!("{name}{} ", (i * salt + w * 31) % 97)).collect();
            std::fs::write(text.join(format!("{i:02}.txt")), body).unwrap();
        }
        let options = PrepareOptions {
            inputs: vec![text],
            out: dir.path().join(name),
            tokenizer: None,
            eos: None,
            bos: None,
            reading: Reading { separator: None, field: "text".into(), invalid: Invalid::Error },
            val_fraction: 0.2,
            shard_tokens: 5000,
            force: false,
        };
        prepare::prepare(&options, &mut Silent).unwrap();
    }
    let mix = format!("data.mix=[{}: 60%, {}: 40%]", dir.path().join("a").display(), dir.path().join("b").display());
    let extra = ["data.source=shards", mix.as_str(), "model.vocab_size=257"];
    let one = train(1, &config(&dir.path().join("one"), &sets(0, 4, &extra)), None).remove(0);
    let two_dir = dir.path().join("two");
    let ranks = train(2, &config(&two_dir, &sets(0, 2, &extra)), None);
    for (r, o) in ranks.iter().enumerate() {
        assert_close(o, &one, &format!("rank {r}"));
    }
    // The two ranks' checkpoint at step 2, resumed on one process of 4.
    let resumed_cfg = config(&two_dir, &sets(0, 4, &extra));
    let step2 = two_dir.join("checkpoints").join(ava_train::save::step_dir_name(2));
    let resumed = train(1, &resumed_cfg, Some(step2.to_str().unwrap())).remove(0);
    assert_eq!(resumed.losses.len(), 2);
    for (x, y) in resumed.losses.iter().zip(&one.losses[2..]) {
        assert!((x - y).abs() <= 1e-5 * y.abs(), "resumed loss {x} vs {y}");
    }
}
