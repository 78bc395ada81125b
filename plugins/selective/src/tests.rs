//! The modes' decisions, their option errors, and the budget search against a brute force
//! over every plan.

use super::*;
use crate::plan::{fewest_recomputed, peak};

use BlockDecision::{Keep as K, Recompute as R, Segment as S};

fn build(json: &str) -> Result<Selective, PluginError> {
    ava_core::ffi::build::<Selective>(json, &HostContext::default())
}

fn uniform(n: u32, activation: u64, input: u64) -> Vec<BlockFacts> {
    (0..n)
        .map(|index| BlockFacts {
            index,
            activation_bytes: activation,
            input_bytes: input,
            parameter_bytes: 1 << 16,
            forward_flops: 1 << 24,
        })
        .collect()
}

const NO_BUDGET: CheckpointContext = CheckpointContext { budget_bytes: 0, offload_available: false };

#[test]
fn every_and_layers_pick_their_blocks() {
    let blocks = uniform(5, 100, 10);
    let every2 = build(r#"{"every": 2}"#).unwrap();
    assert_eq!(every2.decide(&blocks, &NO_BUDGET).unwrap(), [R, K, R, K, R]);
    let every1 = build(r#"{"every": 1}"#).unwrap();
    assert_eq!(every1.decide(&blocks, &NO_BUDGET).unwrap(), [R; 5]);
    let layers = build(r#"{"layers": [3, 1]}"#).unwrap();
    assert_eq!(layers.mode, Mode::Layers(vec![1, 3]));
    assert_eq!(layers.decide(&blocks, &NO_BUDGET).unwrap(), [K, R, K, R, K]);
    let none = build(r#"{"layers": []}"#).unwrap();
    assert_eq!(none.decide(&blocks, &NO_BUDGET).unwrap(), [K; 5]);
}

#[test]
fn sqrt_cuts_segments_of_the_ceiling_of_the_root() {
    assert_eq!([1, 2, 3, 4, 5, 8, 9, 10, 16, 17].map(sqrt_segment), [1, 2, 2, 2, 3, 3, 3, 4, 4, 5]);
    assert_eq!(sqrt_segment(0), 1);
    let sqrt = build(r#"{"sqrt": true}"#).unwrap();
    assert_eq!(sqrt.mode, Mode::Sqrt);
    assert_eq!(sqrt.decide(&uniform(8, 100, 10), &NO_BUDGET).unwrap(), [R, S, S, R, S, S, R, S]);
    assert_eq!(sqrt.decide(&uniform(4, 100, 10), &NO_BUDGET).unwrap(), [R, S, R, S]);
    assert_eq!(sqrt.decide(&uniform(1, 100, 10), &NO_BUDGET).unwrap(), [R]);
    for n in 1..40 {
        let plan = sqrt.decide(&uniform(n, 100, 10), &NO_BUDGET).unwrap();
        ava_core::check_plan(&plan, n as usize).unwrap();
    }
    let e = build(r#"{"sqrt": false}"#).unwrap_err().to_string();
    assert!(e.contains("option 'sqrt': false chooses no mode"), "{e}");
    let e = build(r#"{"sqrt": true, "every": 2}"#).unwrap_err().to_string();
    assert!(e.contains("options 'every' and 'sqrt' each choose a mode"), "{e}");
}

/// A segment holds nothing above its input, and is rebuilt whole in backward: with blocks
/// of 100 and inputs of 10, segments of 3 peak at what is below the top segment plus 300,
/// more than recomputing each block alone (inputs below plus 100).
#[test]
fn a_segment_peaks_when_it_is_rebuilt() {
    let blocks = uniform(8, 100, 10);
    // [R S S] [R S S] [R S]: held below the segments 0, 10, 20.
    assert_eq!(peak(&blocks, &[R, S, S, R, S, S, R, S]), (310, 3));
    assert_eq!(peak(&blocks, &[R; 8]), (170, 7));
    // The last segment can be the peak: [R] [R S S S S S S] rebuilds 700 above 10.
    assert_eq!(peak(&blocks, &[R, R, S, S, S, S, S, S]), (710, 1));
    // A kept stretch ends a segment: [R S] K K peaks at the top block over 10 + 100 held,
    // above the segment's rebuild (200).
    assert_eq!(peak(&blocks[..4], &[R, S, K, K]), (210, 3));
    assert_eq!(peak(&blocks[..3], &[R, S, K]), (200, 0));
}

#[test]
fn a_block_the_model_does_not_have_is_refused_with_the_block_count() {
    let e = build(r#"{"layers": [0, 4, 8]}"#).unwrap().decide(&uniform(6, 100, 10), &NO_BUDGET).unwrap_err();
    assert_eq!(e.message.as_str(), "option 'layers': the model has 6 blocks (0..=5), so block 8 does not exist");
}

#[test]
fn options_are_checked_all_at_once() {
    let e = build(r#"{"every": 0, "layers": [-1, 2, 2]}"#).unwrap_err().to_string();
    assert!(e.contains("options 'every' and 'layers' each choose a mode: give one of them"), "{e}");
    assert!(e.contains("option 'every': 0 must be at least 1"), "{e}");
    let e = build(r#"{"layers": [-1, 2, 2]}"#).unwrap_err().to_string();
    assert!(e.contains("option 'layers': -1 is not a block index (0 or more)"), "{e}");
    assert!(e.contains("option 'layers': block 2 is listed twice"), "{e}");
    let e = build(r#"{"budget": 0}"#).unwrap_err().to_string();
    assert!(e.contains("option 'budget': must be more than 0 bytes"), "{e}");
    let e = build(r#"{"budget": "lots"}"#).unwrap_err().to_string();
    assert!(e.contains("budget"), "{e}");
    assert_eq!(build(r#"{"budget": "1.5GiB"}"#).unwrap().mode, Mode::Budget(Some(3 << 29)));
}

/// Four blocks of 100 bytes with inputs of 10: keeping all peaks at 3·100 + 100; each
/// recomputed block (from the bottom) saves 90; the top one never helps.
#[test]
fn budget_recomputes_the_fewest_blocks_that_fit() {
    let blocks = uniform(4, 100, 10);
    assert_eq!(peak(&blocks, &[K; 4]), (400, 3));
    for (budget, want) in [
        (400, vec![K, K, K, K]),
        (399, vec![R, K, K, K]),
        (310, vec![R, K, K, K]),
        (309, vec![R, R, K, K]),
        (130, vec![R, R, R, K]),
    ] {
        let plan = fewest_recomputed(&blocks, budget).unwrap();
        assert_eq!(plan, want, "budget {budget}");
        assert!(peak(&blocks, &plan).0 <= budget);
    }
    let e = fewest_recomputed(&blocks, 129).unwrap_err();
    assert!(
        e.message.as_str().starts_with(
            "the activation budget 129 B cannot be met: recomputing every block that helps still needs 130 B"
        ),
        "{e}"
    );
}

#[test]
fn budget_comes_from_the_option_or_else_from_the_engine() {
    let blocks = uniform(4, 1 << 20, 1 << 10);
    let with_ctx = CheckpointContext { budget_bytes: 7 << 19, offload_available: false }; // 3.5 MiB
    let auto = build("{}").unwrap();
    assert_eq!(auto.mode, Mode::Budget(None));
    assert_eq!(auto.decide(&blocks, &with_ctx).unwrap(), [R, K, K, K]);
    // The option wins over the engine's budget.
    let explicit = build(r#"{"budget": "2MiB"}"#).unwrap();
    assert_eq!(explicit.decide(&blocks, &with_ctx).unwrap(), [R, R, R, K]);
    let e = auto.decide(&blocks, &NO_BUDGET).unwrap_err();
    assert!(e.message.as_str().starts_with("no budget: give the option"), "{e}");
}

/// A brute force over all 2^L plans, equal and unequal blocks: the search finds a plan
/// exactly when one fits, and recomputes as few blocks as the best one.
#[test]
fn budget_search_against_every_plan() {
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut next = |m: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % m
    };
    for trial in 0..300 {
        let n = 1 + next(7) as u32;
        let blocks: Vec<BlockFacts> = if trial % 3 == 0 {
            uniform(n, 50 + next(100), 1 + next(20))
        } else {
            (0..n)
                .map(|index| BlockFacts {
                    index,
                    activation_bytes: 20 + next(200),
                    input_bytes: 1 + next(30),
                    parameter_bytes: 0,
                    forward_flops: 1,
                })
                .collect()
        };
        let all_kept = peak(&blocks, &vec![K; n as usize]).0;
        let budget = next(all_kept + 1);
        let best = (0u32..1 << n)
            .map(|mask| (0..n).map(|i| if mask >> i & 1 == 1 { R } else { K }).collect::<Vec<_>>())
            .filter(|p| peak(&blocks, p).0 <= budget)
            .map(|p| p.iter().filter(|&&d| d == R).count())
            .min();
        match (fewest_recomputed(&blocks, budget), best) {
            (Ok(plan), Some(best)) => {
                assert!(peak(&blocks, &plan).0 <= budget, "{blocks:?} budget {budget}: {plan:?} does not fit");
                let count = plan.iter().filter(|&&d| d == R).count();
                assert_eq!(count, best, "{blocks:?} budget {budget}: {plan:?}");
            }
            (Err(_), None) => {}
            (got, best) => panic!("{blocks:?} budget {budget}: search {got:?}, brute force {best:?}"),
        }
    }
}

/// `offload: true` parks the kept inputs in the tier: the same blocks, `offload` for
/// `recompute`; segments still start at them. Without a tier it is refused.
#[test]
fn offload_parks_the_recomputed_blocks_inputs() {
    use BlockDecision::Offload as O;
    let blocks = uniform(5, 100, 10);
    let with_tier = CheckpointContext { budget_bytes: 0, offload_available: true };
    let every2 = build(r#"{"every": 2, "offload": true}"#).unwrap();
    assert_eq!(every2.decide(&blocks, &with_tier).unwrap(), [O, K, O, K, O]);
    let sqrt = build(r#"{"sqrt": true, "offload": true}"#).unwrap();
    let plan = sqrt.decide(&blocks, &with_tier).unwrap();
    assert_eq!(plan, [O, S, S, O, S]);
    ava_core::check_plan(&plan, 5).unwrap();
    let e = every2.decide(&blocks, &NO_BUDGET).unwrap_err();
    assert_eq!(e.message.as_str(), "option 'offload': the engine offers no offload tier here; leave the option out");
}
