//! The optimizer state's homes: where a parameter's state lives between steps is one value,
//! set by the allocation (a tier) and by the move to a GPU (page-locked host memory), never
//! both; a build without the `cuda` feature refuses the move by name.

use ava_plugins::builtin::adamw::AdamW;
use ava_plugins::builtin::ram::RamTier;
use candle_core::{Device, Var};

use super::*;
use crate::model::{ParamDef, ParamRole};

/// Three parameters of 64, 32 and 16 elements on the CPU.
fn params() -> Vec<Param> {
    [64usize, 32, 16]
        .iter()
        .enumerate()
        .map(|(i, &n)| Param {
            def: ParamDef { name: format!("p{i}"), shape: vec![n], role: ParamRole::Matrix, block: Some(0) },
            var: Var::zeros(n, candle_core::DType::F32, &Device::Cpu).unwrap(),
        })
        .collect()
}

/// AdamW's state for `params`, the share past `in_ram` streamed through a `ram` tier.
fn allocate(params: &[Param], in_ram: Option<f64>) -> OptimizerState {
    let placement =
        in_ram.map(|in_ram| Placement { tier: Arc::new(RamTier::new(None)), name: "ram".into(), in_ram, prefetch: 1 });
    OptimizerState::allocate_with(&AdamW::default(), params, "adamw", HostState::Nothing, placement, &widened).unwrap()
}

#[test]
fn without_a_tier_every_parameters_state_is_here() {
    let params = params();
    let state = allocate(&params, None);
    assert!((0..3).all(|i| !state.is_streamed(i)));
    assert!(state.tier().is_none());
    assert_eq!((state.streamed_bytes(), state.pinned_bytes()), (0, 0));
    // Held in 8-byte words: AdamW's 4-byte step count takes 8.
    assert_eq!(state.resident_bytes(), state.bytes() + 3 * 4, "all of it held in memory");
}

#[test]
fn a_tier_homes_the_share_past_the_one_kept_in_memory() {
    let params = params();
    // AdamW keeps two f32 moments and a 4-byte step count per parameter: 908 bytes, of which
    // the first parameter's 516 stay.
    let state = allocate(&params, Some(0.5));
    assert_eq!(state.bytes(), 908);
    assert_eq!((0..3).map(|i| state.is_streamed(i)).collect::<Vec<_>>(), [false, true, true]);
    assert!(state.tier().is_some());
    assert_eq!(state.streamed_bytes(), (32 + 16) * 8 + 2 * 4);
    // Held in 8-byte words: the count takes 8.
    assert_eq!(state.resident_bytes(), 64 * 8 + 8, "the streamed state holds no memory between steps");
}

#[test]
fn the_step_visits_the_kept_and_the_tiered_state_which_comes_back_exactly() {
    let params = params();
    let mut state = allocate(&params, Some(0.5));
    let mut seen = Vec::new();
    let stats = state
        .for_each(&[0, 1, 2], |i, bufs| {
            seen.push(i);
            for b in bufs.iter_mut() {
                b.bytes_mut().fill(i as u8 + 1);
            }
            Ok(())
        })
        .unwrap();
    assert_eq!(seen, [0, 1, 2], "the kept parameter first, then the streamed ones in order");
    let moved = (32 + 16) * 8 + 2 * 8; // the streamed parameters' words
    assert_eq!((stats.read_bytes, stats.written_bytes), (moved, moved));
    for i in 0..3 {
        for j in 0..state.buffers[i].len() {
            let bytes = state.buffer_bytes(i, j).unwrap();
            assert!(bytes.iter().all(|&b| b == i as u8 + 1), "parameter {i} buffer {j}");
        }
    }
    assert_eq!(state.resident_bytes(), 64 * 8 + 8, "each streamed buffer freed once the tier has it");
}

/// The stand-in `CudaDevice` of a build without the feature: a value only a caller can make
/// by hand, as the runs never do.
#[cfg(not(feature = "cuda"))]
#[test]
fn a_build_without_cuda_refuses_to_place_the_state_on_a_gpu() {
    let params = params();
    let dev = candle_core::CudaDevice;
    let names = |i: usize| format!("p{i}");
    let home = Some(PinnedHome { on_device: 0.5, prefetch: 1 });

    let err = allocate(&params, None).place_on(&dev, None, &names).unwrap_err().to_string();
    assert!(err.contains("optimizer state on a GPU needs a build with the cuda feature"), "{err}");
    // All of it in the tier: no buffer to move, and still refused.
    let mut state = allocate(&params, Some(0.0));
    let err = state.place_on(&dev, None, &names).unwrap_err().to_string();
    assert!(err.contains("optimizer state on a GPU needs a build with the cuda feature"), "{err}");
    assert!(state.gpu.is_none(), "nothing moved");
    let err = allocate(&params, None).place_on(&dev, home, &names).unwrap_err().to_string();
    assert!(err.contains("page-locked host memory needs a build with the cuda feature"), "{err}");
    let err = allocate(&params, Some(0.5)).place_on(&dev, home, &names).unwrap_err().to_string();
    assert!(
        err.contains("streams through the tier 'ram', so none of it can also be homed in page-locked host memory"),
        "{err}"
    );
}
