//! The low-memory training modes through the trainer: the optimizer step inside backward
//! updates every parameter exactly as the step after backward does (f32 weights, bf16
//! weights rounded stochastically or with compensation; tied embeddings, recomputed blocks,
//! experts), holds no whole-model gradients, and running out of memory inside it stops the
//! run without saving a half-stepped model; bf16 weights without masters take half the
//! parameter memory and still learn; the modes' bad combinations are refused by name.

#[global_allocator]
static A: ava_train::memory::CountingAlloc = ava_train::memory::CountingAlloc;

use ava_plugins::Registry;
use ava_train::config::Config;
use ava_train::train::{Silent, StepRecord, TrainError, TrainOptions, Trainer};

/// The counting allocator and the hard limit are process-wide: one trainer at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

mod common;

fn config(out: &std::path::Path, sets: &[&str]) -> Config {
    let base = [
        "model.num_layers=3",
        "train.micro_batch_size=4",
        "train.gradient_accumulation_steps=1",
        "train.grad_clip=0",
        "train.warmup_steps=2",
        "train.lr=0.01",
        "train.max_steps=5",
        "train.eval_every=0",
        "checkpoints.every=0",
    ];
    let sets: Vec<&str> = base.into_iter().chain(sets.iter().copied()).collect();
    common::tiny_config(out, &sets)
}

fn trainer(config: &Config) -> Trainer {
    Trainer::new(config, &Registry::builtins(), &TrainOptions::default()).unwrap()
}

/// Every weight's bytes as stored (bf16 weights compared bit for bit).
fn stored(t: &Trainer) -> Vec<(String, Vec<u8>)> {
    let named = t.model().named_tensors();
    ava_train::model::tensors_to_safetensors(&named).map(|b| vec![("all".to_string(), b)]).unwrap()
}

fn run(t: &mut Trainer, steps: usize) -> Vec<StepRecord> {
    (0..steps).map(|_| t.train_step().unwrap()).collect()
}

#[test]
fn the_step_inside_backward_updates_exactly_as_the_step_after_it() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let cases: &[&[&str]] = &[
        &[],
        &["model.tie_embeddings=true", "plugins.checkpoint=full"],
        &["train.precision=bf16", "train.master_weights=none"],
        &["train.precision=bf16", "train.master_weights=kahan", "model.tie_embeddings=true"],
        &["train.precision=bf16", "train.master_weights=f32", "plugins.checkpoint=full"],
        &["train.precision=bf16", "train.master_weights=none", "model.moe.num_experts=4", "model.moe.top_k=1"],
    ];
    for sets in cases {
        let after = config(dir.path(), sets);
        let inside = config(dir.path(), &[*sets, &["train.step_in_backward=true"]].concat());
        let (mut a, mut b) = (trainer(&after), trainer(&inside));
        let (ra, rb) = (run(&mut a, 5), run(&mut b, 5));
        for (x, y) in ra.iter().zip(&rb) {
            assert_eq!(x.loss.to_bits(), y.loss.to_bits(), "{sets:?}: step {} loss", x.step);
            // The norm is summed in f64 inside the step op, parameter by parameter as they arrive.
            assert!((x.grad_norm - y.grad_norm).abs() <= 1e-5 * x.grad_norm, "{sets:?}: {x:?} {y:?}");
        }
        assert!(stored(&a) == stored(&b), "{sets:?}: the weights differ");
        assert!(a.optimizer_state() == b.optimizer_state(), "{sets:?}: the optimizer state differs");
        // And the steps did something: the loss moved.
        assert!(ra[4].loss < ra[0].loss, "{sets:?}: {} -> {}", ra[0].loss, ra[4].loss);
    }
}

#[test]
fn the_step_inside_backward_holds_no_whole_model_gradients() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    // Every block recomputed, as a large model trains: then the gradients, not the
    // activations, decide the peak (without checkpointing it comes early in backward,
    // before most gradients exist, and stepping inside backward saves nothing there).
    let sets = [
        "model.hidden_size=128",
        "model.intermediate_size=256",
        "model.num_layers=4",
        "train.max_steps=3",
        "plugins.checkpoint=full",
    ];
    // What the step holds beyond the weights, the state and the data: gradients (counted as
    // such after backward; inside it, the few in flight are part of the activations' peak).
    let working = |extra: &[&str]| {
        let mut t = trainer(&config(dir.path(), &[&sets[..], extra].concat()));
        let m = run(&mut t, 3)[2].memory;
        (m.grads + m.activations, t.model().spec().num_params() as u64)
    };
    let (after, n) = working(&[]);
    let (inside, _) = working(&["train.step_in_backward=true"]);
    // At least half of the 4 · N bytes of f32 gradients never exist at once (measured: 65%;
    // the peak inside is a recomputed block's backward, its gradients in flight).
    assert!(inside + 2 * n < after, "gradients + activations after backward {after}, inside {inside}, 4·N = {}", 4 * n);
    // bf16 weights without masters: 2 bytes a parameter instead of 4 + 2.
    let mut half =
        trainer(&config(dir.path(), &[&sets[..], &["train.precision=bf16", "train.master_weights=none"]].concat()));
    let r = run(&mut half, 1);
    assert_eq!(r[0].memory.params, 2 * n);
}

#[test]
fn bf16_weights_without_masters_learn_like_f32_masters() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let sets = ["train.max_steps=40", "train.lr=0.003", "train.precision=bf16"];
    let last = |extra: &[&str]| {
        let mut t = trainer(&config(dir.path(), &[&sets[..], extra].concat()));
        run(&mut t, 40).last().unwrap().loss
    };
    let masters = last(&["train.master_weights=f32"]);
    let stochastic = last(&["train.master_weights=none"]);
    let kahan = last(&["train.master_weights=kahan"]);
    let first = {
        let mut t = trainer(&config(dir.path(), &sets));
        run(&mut t, 1)[0].loss
    };
    for (name, loss) in [("stochastic rounding", stochastic), ("kahan", kahan)] {
        assert!(loss < first * 0.9, "{name}: {first} -> {loss}");
        assert!((loss / masters - 1.0).abs() < 0.02, "{name}: {loss}, f32 masters {masters}");
    }
}

#[test]
fn out_of_memory_inside_backward_stops_and_saves_nothing() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), &["train.step_in_backward=true", "train.max_steps=4", "checkpoints.every=2"]);
    let mut t = Trainer::new(&cfg, &Registry::builtins(), &TrainOptions { oom_at_step: Some(3), ..Default::default() })
        .unwrap();
    let err = t.run(&TrainOptions::default(), &mut Silent).unwrap_err();
    assert!(matches!(err, TrainError::OutOfMemoryInBackward { step: 3, saved: 2, .. }), "{err:?}");
    let text = err.to_string();
    assert!(text.contains("train.step_in_backward") && text.contains("the last checkpoint (step 2"), "{text}");
    // Step 2's checkpoint is there, nothing after it.
    let ckpts: Vec<String> = std::fs::read_dir(dir.path().join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step"))
        .collect();
    assert_eq!(ckpts.len(), 1, "{ckpts:?}");
    assert!(ckpts[0].ends_with('2'), "{ckpts:?}");
    // Resumed from it, the run ends as a straight one does.
    let resume = TrainOptions { resume: Some("latest".into()), ..Default::default() };
    let mut resumed = Trainer::new(&cfg, &Registry::builtins(), &resume).unwrap();
    resumed.run(&resume, &mut Silent).unwrap();
    let straight_dir = tempfile::tempdir().unwrap();
    let mut straight = trainer(&config(
        straight_dir.path(),
        &["train.step_in_backward=true", "train.max_steps=4", "checkpoints.every=2"],
    ));
    straight.run(&TrainOptions::default(), &mut Silent).unwrap();
    assert!(stored(&resumed) == stored(&straight));
}

#[test]
fn the_modes_bad_combinations_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let refused = |sets: &[&str]| {
        Trainer::new(&config(dir.path(), sets), &Registry::builtins(), &TrainOptions::default())
            .unwrap_err()
            .to_string()
    };
    let e = refused(&["train.master_weights=none"]);
    assert!(e.contains("train.master_weights: none") && e.contains("set train.precision: bf16"), "{e}");
    let e = refused(&["train.precision=bf16", "train.master_weights=tier"]);
    assert!(e.contains("offload.tiers keeps all of it where the run computes") && e.contains("plugins.offload"), "{e}");
    // Every problem at once.
    let e = refused(&[
        "train.step_in_backward=true",
        "train.gradient_accumulation_steps=2",
        "train.grad_clip=1",
        "train.precision=f16",
    ]);
    for key in ["train.gradient_accumulation_steps is 2", "train.grad_clip (1)", "train.precision: f16"] {
        assert!(e.contains(key), "{key}: {e}");
    }
    assert_eq!(e.matches("\n  - ").count(), 3, "{e}");
}

/// A checkpoint streams into its files: saving one holds a tensor's copy at a time (and the
/// file buffer), not a copy of the weights and of the optimizer state, so a run whose state
/// fills memory can still save; what it saves is the same as the whole-buffer encoding.
#[test]
fn saving_a_checkpoint_holds_one_tensor_at_a_time() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    // Wide enough that the weights and state (~25 MiB of f32) dwarf the file buffer.
    let cfg = config(
        dir.path(),
        &["model.hidden_size=256", "model.intermediate_size=704", "model.num_heads=4", "model.num_kv_heads=4"],
    );
    let mut t = trainer(&cfg);
    run(&mut t, 1);
    let named = t.model().named_tensors();
    let largest = named.iter().map(|(_, w)| (w.elem_count() * 4) as u64).max().unwrap();
    let weights: u64 = named.iter().map(|(_, w)| (w.elem_count() * 4) as u64).sum();
    drop(named);
    let before = ava_train::memory::current();
    ava_train::memory::reset_peak();
    let saved = t.save_checkpoint().unwrap();
    let grew = ava_train::memory::peak() - before;
    println!("saving grew memory by {grew} bytes; largest tensor {largest}, weights {weights} (state 2x that)");
    assert!(grew < largest + (3 << 20), "saving held {grew} bytes (largest tensor {largest})");
    assert!(grew < weights / 4, "saving held {grew} bytes against {weights} of weights");
    let file = std::fs::read(saved.join("model.safetensors")).unwrap();
    assert_eq!(file, ava_train::model::tensors_to_safetensors(&t.model().named_tensors()).unwrap());
    ava_train::save::verify(&saved).unwrap();
}
