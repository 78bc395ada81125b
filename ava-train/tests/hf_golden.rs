//! Hugging Face folders against transformers' own logits.
//!
//! Provenance: every folder under `tests/hf/` (config.json, model.safetensors and
//! expected.safetensors with the input ids and logits) was written by transformers 5.24.0 on
//! torch 2.15.0 (CPU, f32, eager attention) with `tests/hf/make_goldens.py`, which says how to
//! run it; folders named `-v4` carry transformers 4's RoPE fields (`rope_theta` +
//! `rope_scaling`), the others transformers 5's `rope_parameters`. The tolerance is the one
//! this project uses against autograd in f32 (atol 1e-4, rtol 1e-3).
//!
//! Each test also shows it could fail: with the config field under test dropped (RoPE back to
//! plain θ 10000, no window), the logits move far past the tolerance.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ava_core::AttentionKernel;
use ava_kernels::attention::{Kernel, Masking};
use ava_plugins::Registry;
use ava_train::model::{
    Arch, Generator, Model, ModelSpec, RopeScaling, RopeSpec, load_hf_folder, read_hf_config, save_hf_folder,
    tensors_from_safetensors,
};
use candle_core::{DType, Tensor};

fn folder(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/hf").join(case)
}

/// The (B, T) input ids and (B·T, V) logits transformers computed.
fn expected(dir: &Path) -> (Tensor, Vec<f32>) {
    let path = dir.join("expected.safetensors");
    let t = tensors_from_safetensors(&std::fs::read(&path).unwrap(), &path).unwrap();
    let ids = t["input_ids"].to_dtype(DType::U32).unwrap();
    let logits = t["logits"].flatten_all().unwrap().to_vec1::<f32>().unwrap();
    (ids, logits)
}

/// The attention a spec calls for: standard causal, or the sliding-window kernel.
fn kernel(spec: &ModelSpec) -> (Arc<dyn AttentionKernel>, &'static str) {
    match spec.sliding_window {
        Some(w) => (Arc::new(Kernel::flash(Masking::Window(w))), "sliding-window"),
        None => (Registry::builtins().attention("standard", "{}").unwrap(), "standard"),
    }
}

/// Ava's logits for the folder's weights under `spec`, with `kernel`.
fn logits(dir: &Path, spec: ModelSpec, kernel: (Arc<dyn AttentionKernel>, &str), ids: &Tensor) -> Vec<f32> {
    let (_, tensors) = load_hf_folder(dir).unwrap();
    let t = ids.dims()[1];
    let model = Model::from_tensors(spec, tensors, dir, t, kernel.0, kernel.1, 1).unwrap();
    let (out, _) = model.forward(&model.weights(DType::F32).unwrap(), ids, None).unwrap();
    out.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

/// The largest |a − b| and whether every element is within atol 1e-4 + rtol 1e-3.
fn compare(a: &[f32], b: &[f32]) -> (f32, bool) {
    assert_eq!(a.len(), b.len());
    let worst = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max);
    (worst, a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-4 + 1e-3 * y.abs()))
}

/// Loads `case`, checks its logits match transformers', and that `ablate` (the field under
/// test undone) does not.
fn golden(case: &str, check_spec: impl Fn(&ModelSpec), ablate: Option<fn(ModelSpec) -> ModelSpec>) {
    let dir = folder(case);
    let config = read_hf_config(&dir.join("config.json")).unwrap_or_else(|e| panic!("{case}: {e}"));
    check_spec(&config.spec);
    let (ids, want) = expected(&dir);
    let got = logits(&dir, config.spec.clone(), kernel(&config.spec), &ids);
    let (worst, ok) = compare(&got, &want);
    println!("{case}: max |Ava − transformers| = {worst:.2e}");
    assert!(ok, "{case}: logits differ from transformers' by up to {worst}");
    if let Some(ablate) = ablate {
        let without = ablate(config.spec.clone());
        let (moved, _) = compare(&logits(&dir, without.clone(), kernel(&without), &ids), &want);
        println!("{case}: without the field under test, max difference {moved:.2e}");
        assert!(moved > 1e-2, "{case}: the golden does not depend on the field under test ({moved})");
    }
}

fn plain_rope(s: ModelSpec) -> ModelSpec {
    ModelSpec { rope: RopeSpec::plain(10000.0), ..s }
}

#[test]
fn llama_rope_theta_in_rope_parameters() {
    golden("llama-theta-v5", |s| assert_eq!(s.rope, RopeSpec::plain(500000.0)), Some(plain_rope));
}

#[test]
fn llama_linear_scaling_in_the_oldest_rope_scaling_form() {
    let linear = RopeSpec { theta: 10000.0, scaling: RopeScaling::Linear { factor: 4.0 } };
    golden("llama-linear-v4", |s| assert_eq!(s.rope, linear), Some(plain_rope));
}

#[test]
fn llama_dynamic_ntk_past_max_position_embeddings() {
    let dynamic = RopeSpec { theta: 10000.0, scaling: RopeScaling::Dynamic { factor: 2.0, max_position: 8 } };
    golden("llama-dynamic-v5", |s| assert_eq!(s.rope, dynamic), Some(plain_rope));
}

#[test]
fn llama3_scaling() {
    golden(
        "llama3-v4",
        |s| assert!(matches!(s.rope.scaling, RopeScaling::Llama3 { original_max_position: 64, .. })),
        Some(plain_rope),
    );
}

#[test]
fn yarn_untruncated_in_rope_parameters() {
    golden(
        "llama-yarn-v5",
        |s| assert!(matches!(s.rope.scaling, RopeScaling::Yarn { truncate: false, attention_factor: None, .. })),
        Some(plain_rope),
    );
}

#[test]
fn yarn_with_mscale_and_betas() {
    golden(
        "llama-yarn-mscale-v4",
        |s| {
            assert!(matches!(
                s.rope.scaling,
                RopeScaling::Yarn { mscale: 1.0, mscale_all_dim: 0.5, beta_fast: 16.0, .. }
            ))
        },
        Some(plain_rope),
    );
}

#[test]
fn llama_attention_and_mlp_bias_with_a_separate_head_size_and_tied_head() {
    golden(
        "llama-bias-headdim-tied-v5",
        |s| {
            assert!(s.bias.qkv && s.bias.o && s.bias.mlp && s.tie_embeddings);
            assert_eq!((s.head_dim, s.hidden / s.heads), (24, 16));
        },
        None,
    );
}

#[test]
fn mistral_sliding_window() {
    golden(
        "mistral-window-v5",
        |s| assert_eq!((s.arch, s.sliding_window), (Arch::Mistral, Some(6))),
        Some(|s| ModelSpec { sliding_window: None, ..s }),
    );
}

#[test]
fn mixtral_experts() {
    golden(
        "mixtral-v5",
        |s| {
            let moe = s.moe.unwrap();
            assert_eq!((s.arch, moe.experts, moe.top_k, s.eps), (Arch::Mixtral, 4, 2, 1e-5));
            assert_eq!(moe.aux_weight, 0.0, "output_router_logits is false: transformers trains without the loss");
        },
        None,
    );
}

#[test]
fn qwen2_qkv_bias() {
    golden(
        "qwen2-v4",
        |s| {
            assert_eq!(s.arch, Arch::Qwen2);
            assert!(s.bias.qkv && !s.bias.o && !s.bias.mlp);
            assert_eq!(s.rope, RopeSpec::plain(1e6));
        },
        Some(plain_rope),
    );
}

/// Every golden folder (all ten), sorted.
fn all_folders() -> Vec<PathBuf> {
    let mut cases: Vec<_> = std::fs::read_dir(folder(""))
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("config.json").is_file())
        .collect();
    cases.sort();
    assert_eq!(cases.len(), 10);
    cases
}

/// Every golden folder, written back by Ava, reads back to the same spec and the same
/// logits, and carries RoPE in both forms. With `AVA_HF_WRITE_DIR` set, the written folders
/// (with their expected.safetensors) are kept there for `make_goldens.py --check`, which
/// loads them in transformers 4 and 5.
#[test]
fn folders_written_back_keep_their_math_in_both_forms() {
    let keep = std::env::var_os("AVA_HF_WRITE_DIR").map(PathBuf::from);
    for dir in all_folders() {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let (spec, tensors) = load_hf_folder(&dir).unwrap();
        let (ids, want) = expected(&dir);
        let model = Model::from_tensors(spec.clone(), tensors, &dir, ids.dims()[1], kernel(&spec).0, "k", 1).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let out = keep.as_ref().map_or_else(|| tmp.path().to_path_buf(), |k| k.join(&name));
        save_hf_folder(&out, model.spec(), &model.named_tensors()).unwrap();
        std::fs::copy(dir.join("expected.safetensors"), out.join("expected.safetensors")).unwrap();
        let written: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
        assert_eq!(written["rope_theta"], written["rope_parameters"]["rope_theta"], "{name}");
        assert_eq!(written["rope_parameters"]["rope_type"], spec.rope.type_name(), "{name}");
        assert_eq!(written["rope_scaling"].is_null(), spec.rope.scaling == RopeScaling::Default, "{name}");
        let back = read_hf_config(&out.join("config.json")).unwrap();
        assert_eq!(back.spec, spec, "{name}");
        assert!(back.notes.is_empty(), "{name}: {:?}", back.notes);
        let (worst, ok) = compare(&logits(&out, back.spec.clone(), kernel(&back.spec), &ids), &want);
        assert!(ok, "{name} written back: {worst}");
    }
}

/// Every golden folder's name, its model (for sequences of its length), the first row of its
/// ids and transformers' logits for them (that row's first, then the other rows').
fn golden_rows() -> Vec<(String, Model, Vec<u32>, Vec<f32>)> {
    all_folders()
        .into_iter()
        .map(|dir| {
            let name = dir.file_name().unwrap().to_string_lossy().to_string();
            let (spec, tensors) = load_hf_folder(&dir).unwrap();
            let (ids, want) = expected(&dir);
            let t = ids.dims()[1];
            let model = Model::from_tensors(spec.clone(), tensors, &dir, t, kernel(&spec).0, "k", 1).unwrap();
            (name, model, ids.get(0).unwrap().to_vec1().unwrap(), want)
        })
        .collect()
}

/// Generation's KV cache (ava_train::model::Generator): for every golden folder, the logits
/// it gives at each position, fed a prompt of three tokens and then one token at a time, are
/// transformers' logits for the same sequence (its first row), within the same tolerance. The
/// folders cover GQA, tied heads with biases and a separate head size, a sliding window, MoE
/// and every RoPE scaling (each position rotated by its own angle from the cache's tables).
#[test]
fn kv_cache_generation_gives_transformers_logits_at_every_position() {
    for (name, model, row, want) in golden_rows() {
        let t = row.len();
        let mut generator = Generator::new(&model, t).unwrap();
        let mut got = generator.feed_all(&row[..3]).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for &id in &row[3..] {
            got.extend(generator.feed(&[id]).unwrap());
        }
        assert_eq!(generator.len(), t);
        let (worst, ok) = compare(&got, &want[..got.len()]);
        println!("{name}: KV-cache logits, max |Ava − transformers| = {worst:.2e}");
        assert!(ok, "{name}: the KV cache's logits differ from transformers' by up to {worst}");
    }
}

/// A stretch fed in chunks of rows (as a long prompt is, so its attention never grows with the
/// square of its length) gives transformers' logits at every position too: chunks of 2 and 3
/// rows, whose edges fall inside every folder's sliding window and between its positions.
#[test]
fn a_stretch_fed_in_chunks_gives_transformers_logits() {
    for (name, model, row, want) in golden_rows() {
        let (t, vocab) = (row.len(), model.spec().vocab);
        for rows in [2, 3] {
            let mut generator = Generator::new(&model, t).unwrap().with_max_chunk(rows);
            let got = generator.feed_all(&row).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(generator.len(), t);
            let (worst, ok) = compare(&got, &want[..got.len()]);
            assert!(ok, "{name}, chunks of {rows}: the logits differ from transformers' by up to {worst}");
            // The last position's logits alone, as generation asks for them after a prompt.
            let mut generator = Generator::new(&model, t).unwrap().with_max_chunk(rows);
            let last = generator.feed(&row).unwrap();
            assert_eq!(last.len(), vocab);
            let (worst, ok) = compare(&last, &want[(t - 1) * vocab..t * vocab]);
            assert!(ok, "{name}, chunks of {rows}: the last logits differ from transformers' by up to {worst}");
        }
    }
}

/// A folder whose weights are PyTorch pickles is refused by name, saying how to convert them
/// (a pickle is never loaded: loading one runs the code in it).
#[test]
fn pytorch_pickles_are_refused_with_how_to_convert_them() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::copy(folder("llama-theta-v5").join("config.json"), tmp.path().join("config.json")).unwrap();
    std::fs::write(tmp.path().join("pytorch_model.bin"), b"not read").unwrap();
    let err = load_hf_folder(tmp.path()).expect_err("refused").to_string();
    assert!(err.contains("the weights are PyTorch pickles (pytorch_model.bin), which Ava does not read"), "{err}");
    assert!(err.contains("save_pretrained(") && err.contains("safe_serialization=True"), "{err}");
}
