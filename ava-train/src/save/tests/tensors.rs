//! safetensors encoding of named buffers.

use std::collections::BTreeMap;

use crate::save::{BufDType, NamedBuffer, SaveError, from_safetensors, to_safetensors};

fn buffer(name: &str, dtype: BufDType, shape: &[usize]) -> NamedBuffer {
    let n = shape.iter().product::<usize>() * dtype.size();
    // Distinct bytes per tensor, so a swapped or shifted payload is caught.
    let seed = name.len() as u8;
    NamedBuffer { name: name.into(), dtype, shape: shape.to_vec(), data: (0..n).map(|i| seed ^ (i as u8)).collect() }
}

fn sample() -> Vec<NamedBuffer> {
    vec![
        buffer("model.layers.0.self_attn.q_proj.weight", BufDType::BF16, &[3, 5]),
        buffer("model.embed_tokens.weight", BufDType::F32, &[7, 3]),
        buffer("model.layers.0.input_layernorm.weight", BufDType::F16, &[3]),
        buffer("optimizer.step", BufDType::I64, &[]),
        buffer("lm_head.weight", BufDType::F64, &[2, 2]),
        buffer("data.rng_state", BufDType::U8, &[13]),
        buffer("data.position", BufDType::U32, &[1]),
        buffer("empty", BufDType::F32, &[0, 4]),
    ]
}

#[test]
fn round_trip_is_exact_and_sorted_by_name() {
    let buffers = sample();
    let metadata: BTreeMap<String, String> =
        [("format".to_string(), "pt".to_string()), ("ava.step".to_string(), "12".to_string())].into();
    let bytes = to_safetensors(&buffers, Some(metadata.clone())).unwrap();
    let (back, meta) = from_safetensors(&bytes).unwrap();
    let mut expected = buffers.clone();
    expected.sort_by(|a, b| a.name.cmp(&b.name));
    assert_eq!(back, expected, "names, dtypes, shapes and bytes survive");
    assert_eq!(meta, Some(metadata.clone()));
    // Encoding the decoded buffers gives the same bytes, whatever the input order.
    assert_eq!(to_safetensors(&back, Some(metadata.clone())).unwrap(), bytes);
    let mut reversed = buffers;
    reversed.reverse();
    assert_eq!(to_safetensors(&reversed, Some(metadata)).unwrap(), bytes);
}

#[test]
fn without_metadata_matches_the_safetensors_crate_byte_for_byte() {
    let buffers = sample();
    let ours = to_safetensors(&buffers, None).unwrap();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = buffers
        .iter()
        .map(|b| {
            let dtype = match b.dtype {
                BufDType::F32 => safetensors::Dtype::F32,
                BufDType::F16 => safetensors::Dtype::F16,
                BufDType::BF16 => safetensors::Dtype::BF16,
                BufDType::F64 => safetensors::Dtype::F64,
                BufDType::U8 => safetensors::Dtype::U8,
                BufDType::U32 => safetensors::Dtype::U32,
                BufDType::I64 => safetensors::Dtype::I64,
            };
            (b.name.clone(), safetensors::tensor::TensorView::new(dtype, b.shape.clone(), &b.data).unwrap())
        })
        .collect();
    assert_eq!(ours, safetensors::serialize(views, None).unwrap());
    let (back, meta) = from_safetensors(&ours).unwrap();
    assert_eq!((back.len(), meta), (8, None));
}

#[test]
fn data_is_aligned_to_its_dtype() {
    let bytes = to_safetensors(&sample(), None).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    assert_eq!(header_len % 8, 0);
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    for (name, view) in st.iter() {
        let offset = view.data().as_ptr() as usize - bytes.as_ptr() as usize;
        assert_eq!(offset % (view.dtype().bitsize() / 8).max(1), 0, "{name} at {offset}");
    }
}

#[test]
fn inconsistent_buffers_are_refused_with_the_tensor_name() {
    let mut short = buffer("model.norm.weight", BufDType::F32, &[4]);
    short.data.pop();
    let err = to_safetensors(&[short], None).unwrap_err();
    assert!(matches!(err, SaveError::BadBuffer { .. }));
    assert!(err.to_string().contains("model.norm.weight") && err.to_string().contains("need 16 bytes"), "{err}");

    let twice = buffer("a", BufDType::U8, &[1]);
    let err = to_safetensors(&[twice.clone(), twice], None).unwrap_err();
    assert!(err.to_string().contains("more than once"), "{err}");

    let err = to_safetensors(&[buffer("__metadata__", BufDType::U8, &[1])], None).unwrap_err();
    assert!(err.to_string().contains("reserved"), "{err}");
}

#[test]
fn damaged_or_foreign_files_are_refused() {
    let bytes = to_safetensors(&sample(), None).unwrap();
    let err = from_safetensors(&bytes[..bytes.len() - 1]).unwrap_err();
    assert!(matches!(err, SaveError::Safetensors { .. }), "{err}");
    assert!(from_safetensors(b"short").is_err());

    let i32_tensor = safetensors::tensor::TensorView::new(safetensors::Dtype::I32, vec![1], &[0, 0, 0, 0]).unwrap();
    let foreign = safetensors::serialize([("x", i32_tensor)], None).unwrap();
    let err = from_safetensors(&foreign).unwrap_err();
    assert!(err.to_string().contains("tensor 'x' has dtype I32"), "{err}");
}
