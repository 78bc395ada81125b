//! The fused ops on an NVIDIA GPU against the same ops on the CPU, on the same inputs: each
//! forward value and each gradient (through candle's backward, a random upstream gradient).
//!
//! Run on a machine with a GPU (CI only compiles this target):
//!   source tools/cuda-build-env.sh   # where no CUDA toolkit is installed
//!   cargo test -p ava-train --features cuda --test gpu_ops
//! or build it here with `--no-run` and run the binary on the GPU machine.
//!
//! Tolerances: f32 atol 1e-4 + rtol 1e-3 (the issue's); bf16 and f16 inputs are rounded the
//! same on both sides, so the difference is the f32 arithmetic inside the op (summation order,
//! `expf` against the CPU's fast exp) plus one rounding of the output: bf16 atol 1e-2 + rtol
//! 1e-2 (two units in the last place), f16 atol 2e-3 + rtol 2e-3. Stochastic rounding is bit
//! for bit: both sides draw the same bits from (seed, index). So are Kahan's compensated
//! rounding and widening, alone and inside the engine's optimizer step.

mod common;

use std::sync::Arc;

use ava_train::model::fused::{self, RopeTables};
use ava_train::model::{Param, ParamDef, ParamRole, RopeScaling, RopeSpec, head_loss, ops};
use ava_train::train::rounding::Half;
use ava_train::train::{HostState, OptimizerState, PinnedHome, step_param};
use candle_core::{DType, Device, Result, Tensor, Var};
use half::{bf16, f16};

/// The GPU, or a panic saying these tests need one.
fn gpu() -> Device {
    Device::new_cuda(0).unwrap_or_else(|e| {
        panic!("these tests run on an NVIDIA GPU, and none could be opened ({e}); CI only compiles them")
    })
}

/// `n` values in [-scale, scale), a pure function of `seed` (the kernels' test generator).
fn data(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    ava_kernels::testing::Rng(seed).vec(n).into_iter().map(|x| x * scale).collect()
}

/// Tolerances (atol, rtol) for a type.
fn tolerance(dtype: DType) -> (f32, f32) {
    match dtype {
        DType::F32 => (1e-4, 1e-3),
        DType::BF16 => (1e-2, 1e-2),
        DType::F16 => (2e-3, 2e-3),
        other => panic!("no tolerance for {other:?}"),
    }
}

/// Where `gpu` and `cpu` disagree beyond the tolerance of `dtype`, if they do: the worst
/// element, and for a (B, H, T, D) tensor which of its rows and columns are wrong (a kernel's
/// tiling shows in them: rows also modulo 64, the tensor-core kernels' tile (the f32 kernels'
/// 32-row tiles show in it too), columns by head dimension).
fn mismatch(what: &str, gpu: &Tensor, cpu: &Tensor, dtype: DType) -> Option<String> {
    if gpu.dims() != cpu.dims() || gpu.dtype() != cpu.dtype() {
        let (a, b) = ((gpu.dims(), gpu.dtype()), (cpu.dims(), cpu.dtype()));
        return Some(format!("{what}: {a:?} on the GPU, {b:?} on the CPU"));
    }
    let a = gpu.to_device(&Device::Cpu).and_then(|t| t.to_dtype(DType::F32)).and_then(|t| t.flatten_all()).unwrap();
    let b = cpu.to_dtype(DType::F32).and_then(|t| t.flatten_all()).unwrap();
    let (a, b) = (a.to_vec1::<f32>().unwrap(), b.to_vec1::<f32>().unwrap());
    let (atol, rtol) = tolerance(dtype);
    let mut worst: Option<(usize, f32)> = None;
    let mut bad = Vec::new();
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        let excess = (x - y).abs() - (atol + rtol * y.abs());
        if excess > 0.0 || x.is_nan() != y.is_nan() {
            bad.push(i);
            if worst.is_none_or(|(_, e)| excess > e) {
                worst = Some((i, excess));
            }
        }
    }
    let (i, _) = worst?;
    let mut e = format!(
        "{what} ({dtype:?}): element {i} is {} on the GPU, {} on the CPU (atol {atol}, rtol {rtol}); {} of {} elements \
         differ",
        a[i],
        b[i],
        bad.len(),
        a.len()
    );
    if let &[_, _, t, d] = gpu.dims() {
        let rows: std::collections::BTreeSet<usize> = bad.iter().map(|i| i / d % t).collect();
        let in_tile: std::collections::BTreeSet<usize> = rows.iter().map(|r| r % 64).collect();
        let cols: std::collections::BTreeSet<usize> = bad.iter().map(|i| i % d).collect();
        e += &format!("; rows {} (mod 64: {}); columns {} of {d}", ranges(&rows), ranges(&in_tile), ranges(&cols));
    }
    Some(e)
}

/// A set of indices as ranges, "0-15, 32, 40-47" (the first 12 ranges).
fn ranges(set: &std::collections::BTreeSet<usize>) -> String {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for &i in set {
        match runs.last_mut() {
            Some((_, end)) if *end + 1 == i => *end = i,
            _ => runs.push((i, i)),
        }
    }
    let shown: Vec<String> =
        runs.iter().take(12).map(|&(a, b)| if a == b { a.to_string() } else { format!("{a}-{b}") }).collect();
    let more = if runs.len() > 12 { format!(", … ({} ranges)", runs.len()) } else { String::new() };
    format!("{}{more}", shown.join(", "))
}

/// The failure report itself (no GPU needed): the worst element, how many differ, and which
/// rows (also modulo 64) and columns of a (B, H, T, D) tensor.
#[test]
fn a_mismatch_names_the_rows_and_columns_that_differ() {
    let (t, d) = (130, 8);
    let cpu = Tensor::zeros((1, 2, t, d), DType::F32, &Device::Cpu).unwrap();
    let mut wrong = vec![0f32; 2 * t * d];
    for head in 0..2 {
        for row in [3, 4, 5, 67, 129] {
            wrong[(head * t + row) * d + 6] = 0.5;
        }
    }
    wrong[(t + 4) * d + 6] = 2.0;
    let gpu = Tensor::from_slice(&wrong, (1, 2, t, d), &Device::Cpu).unwrap();
    let e = mismatch("dq", &gpu, &cpu, DType::F32).unwrap();
    assert_eq!(
        e,
        "dq (F32): element 1078 is 2 on the GPU, 0 on the CPU (atol 0.0001, rtol 0.001); 10 of 2080 elements differ; \
         rows 3-5, 67, 129 (mod 64: 1, 3-5); columns 6 of 8"
    );
    assert_eq!(mismatch("dq", &cpu, &cpu, DType::F32), None);
    let many: std::collections::BTreeSet<usize> = (0..40).map(|i| 2 * i).collect();
    assert!(ranges(&many).ends_with("20, 22, … (40 ranges)"), "{}", ranges(&many));
}

/// A tensor of `dtype` from f32 values, on `dev`.
fn tensor(values: &[f32], shape: &[usize], dtype: DType, dev: &Device) -> Tensor {
    Tensor::from_slice(values, shape, &Device::Cpu)
        .and_then(|t| t.to_dtype(dtype))
        .and_then(|t| t.to_device(dev))
        .unwrap()
}

/// Runs `op` on the inputs (as Vars) on each device, back-propagates `Σ out ∘ up` for the
/// same random `up`, and compares the output and every input's gradient.
fn compare(name: &str, inputs: &[(Vec<f32>, Vec<usize>)], dtype: DType, op: impl Fn(&[Tensor]) -> Result<Tensor>) {
    let failed = check(name, inputs, dtype, op);
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

/// [`compare`], returning what failed (an error, or each tensor that differs) instead of
/// stopping at the first: the flash tests run every case and report them all.
fn check(
    name: &str,
    inputs: &[(Vec<f32>, Vec<usize>)],
    dtype: DType,
    op: impl Fn(&[Tensor]) -> Result<Tensor>,
) -> Vec<String> {
    let run = |dev: &Device| -> Result<(Tensor, Vec<Tensor>)> {
        let vars =
            inputs.iter().map(|(v, s)| Var::from_tensor(&tensor(v, s, dtype, dev))).collect::<Result<Vec<_>>>()?;
        let tensors: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let out = op(&tensors)?;
        let up = tensor(&data(out.elem_count(), 99, 1.0), out.dims(), out.dtype(), dev);
        let grads = out.mul(&up)?.to_dtype(DType::F32)?.sum_all()?.backward()?;
        let g = vars.iter().map(|v| grads.get(v.as_tensor()).expect("a gradient for every input").clone()).collect();
        Ok((out, g))
    };
    let (gpu, cpu) = match (run(&gpu()), run(&Device::Cpu)) {
        (Ok(g), Ok(c)) => (g, c),
        (g, c) => {
            let errors = [("GPU", g.err()), ("CPU", c.err())];
            return errors.into_iter().filter_map(|(at, e)| Some(format!("{name} on the {at}: {}", e?))).collect();
        }
    };
    let mut failed: Vec<String> = mismatch(&format!("{name}: output"), &gpu.0, &cpu.0, dtype).into_iter().collect();
    for (i, (a, b)) in gpu.1.iter().zip(&cpu.1).enumerate() {
        failed.extend(mismatch(&format!("{name}: gradient of input {i}"), a, b, dtype));
    }
    failed
}

const TYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

#[test]
fn rms_norm_matches_the_cpu() {
    // 300 rows: several blocks of the backward's row groups (16), and a row size that is not a
    // multiple of the block (256) nor of a warp; 4100 columns: a backward block wider than 256
    // threads (each holds at most 8 columns), with a ragged last column; 8192 columns: the
    // widest row the backward takes, a block of 1024 threads (Llama-70B's width).
    for (rows, d) in [(3, 8), (300, 130), (70, 2048), (40, 4100), (20, 8192)] {
        for dtype in TYPES {
            let inputs = [(data(rows * d, 1, 2.0), vec![rows, d]), (data(d, 2, 1.0), vec![d])];
            compare(&format!("rms_norm ({rows}, {d})"), &inputs, dtype, |t| fused::rms_norm(&t[0], &t[1], 1e-5));
        }
    }
}

#[test]
fn swiglu_matches_the_cpu() {
    for n in [1, 1000, 65_537] {
        for dtype in TYPES {
            let inputs = [(data(n, 3, 4.0), vec![n]), (data(n, 4, 2.0), vec![n])];
            compare(&format!("swiglu ({n})"), &inputs, dtype, |t| fused::swiglu_gate(&t[0], &t[1]));
        }
    }
}

#[test]
fn heads_with_every_rotary_matches_the_cpu() {
    let (b, t, c, d) = (2, 7, 3, 16);
    let yarn = RopeScaling::Yarn {
        factor: 4.0,
        original_max_position: 4,
        attention_factor: None,
        beta_fast: 32.0,
        beta_slow: 1.0,
        mscale: 0.0,
        mscale_all_dim: 0.0,
        truncate: true,
    };
    let specs = [
        RopeSpec::plain(10_000.0),
        RopeSpec { theta: 500.0, scaling: RopeScaling::Linear { factor: 2.0 } },
        RopeSpec { theta: 500.0, scaling: yarn },
    ];
    // Packed documents restart positions inside a sequence.
    let positions: Arc<[u32]> = (0..b * t).map(|i| ((i % t) % 4) as u32).collect();
    for spec in specs {
        let tables = RopeTables::new(t, d, &spec).unwrap();
        for dtype in TYPES {
            let inputs = [(data(b * t * c * d, 5, 1.0), vec![b * t, c * d])];
            for pos in [None, Some(&positions)] {
                let what = format!("split_heads {:?} positions {}", spec.scaling, pos.is_some());
                compare(&what, &inputs, dtype, |x| fused::split_heads(&x[0], b, t, c, Some(&tables), pos));
            }
            compare("split_heads without rotation", &inputs, dtype, |x| fused::split_heads(&x[0], b, t, c, None, None));
            let heads = [(data(b * c * t * d, 6, 1.0), vec![b, c, t, d])];
            compare("merge_heads", &heads, dtype, |x| fused::merge_heads(&x[0]));
        }
    }
}

#[test]
fn cross_entropy_matches_the_cpu() {
    // A vocabulary that is not a multiple of the block, and one of Llama's size.
    for (n, v) in [(5, 300), (16, 32_000)] {
        let targets: Vec<u32> = (0..n as u32).map(|i| (i * 7919) % v as u32).collect();
        for dtype in TYPES {
            let inputs = [(data(n * v, 7, 8.0), vec![n, v])];
            // The loss is an f32 scalar whichever the logits' type; compare it at f32's tolerance
            // for f32 logits, at the logits' otherwise.
            compare(&format!("cross_entropy ({n}, {v})"), &inputs, dtype, |x| {
                ops::cross_entropy(&x[0], &targets)?.to_dtype(dtype)
            });
        }
    }
}

/// The token embedding (`fused::embedding`): the rows looked up and the table's gradient are
/// the CPU's bits (both add a row's tokens in position order in f32 and round once), for a
/// vocabulary of Llama's size, a token at every third position, most of the table absent.
#[test]
fn embedding_matches_the_cpu_bit_for_bit() {
    let (v, d, n) = (32_000, 64, 4096);
    let ids: Vec<u32> = (0..n as u32).map(|i| if i % 3 == 0 { 7 } else { (i * 7919) % v as u32 }).collect();
    for dtype in TYPES {
        let run = |dev: &Device| -> Result<[Vec<u32>; 2]> {
            let table = Var::from_tensor(&tensor(&data(v * d, 31, 1.0), &[v, d], dtype, dev))?;
            let tokens = Tensor::from_slice(&ids, (2, n / 2), dev)?;
            let out = fused::embedding(table.as_tensor(), &tokens)?;
            let up = tensor(&data(n * d, 32, 1.0), &[n, d], dtype, dev);
            let grads = out.mul(&up)?.to_dtype(DType::F32)?.sum_all()?.backward()?;
            let bits = |t: &Tensor| -> Result<Vec<u32>> {
                Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?.iter().map(|x| x.to_bits()).collect())
            };
            Ok([bits(&out)?, bits(grads.get(table.as_tensor()).expect("the table's gradient"))?])
        };
        let (on_gpu, on_cpu) = (run(&gpu()).unwrap(), run(&Device::Cpu).unwrap());
        for (what, g, c) in [("rows", &on_gpu[0], &on_cpu[0]), ("table gradient", &on_gpu[1], &on_cpu[1])] {
            let differ = g.iter().zip(c).filter(|(a, b)| a != b).count();
            assert_eq!(differ, 0, "embedding {dtype:?}: {differ} of {} elements of the {what} differ", g.len());
        }
    }
}

#[test]
fn a_target_outside_the_vocabulary_is_an_error_on_the_gpu_too() {
    let logits = tensor(&data(2 * 10, 8, 1.0), &[2, 10], DType::F32, &gpu());
    let err = ops::cross_entropy(&logits, &[3, 10]).unwrap_err().to_string();
    assert!(err.contains("target token 10 is outside the vocabulary of 10"), "{err}");
}

/// The LM head and the loss in blocks of rows (`model::head_loss`): one block (dW from the
/// linear layer's own backward), and several, whose dW cuBLAS adds into one f32 sum (f32
/// output, beta = 1), a last block shorter than the others included; against the CPU.
#[test]
fn head_loss_in_blocks_matches_the_cpu() {
    let (n, d, v) = (300, 64, 1000);
    let targets: Vec<u32> = (0..n as u32).map(|i| (i * 7919) % v as u32).collect();
    for dtype in TYPES {
        for rows in [n, 128, 100] {
            let inputs = [(data(n * d, 11, 1.0), vec![n, d]), (data(v * d, 12, 0.2), vec![v, d])];
            compare(&format!("head_loss ({n}, {d}) × ({v}, {d}) in blocks of {rows}"), &inputs, dtype, |t| {
                head_loss(&t[0], &t[1], &targets, rows, 1)?.to_dtype(dtype)
            });
        }
    }
}

#[test]
fn linear_matches_the_cpu() {
    let (n, k, m) = (33, 96, 80);
    for dtype in TYPES {
        let inputs = [(data(n * k, 9, 1.0), vec![n, k]), (data(m * k, 10, 0.2), vec![m, k])];
        compare("linear", &inputs, dtype, |t| fused::linear(&t[0], &t[1], 1));
    }
}

#[test]
fn cast_and_add_match_the_cpu() {
    let n = 4099;
    for dtype in [DType::BF16, DType::F16] {
        let inputs = [(data(n, 11, 3.0), vec![n]), (data(n, 12, 3.0), vec![n])];
        compare("add", &inputs, dtype, |t| fused::add(&t[0], &t[1]));
        let inputs = [(data(n, 13, 3.0), vec![n])];
        compare("cast to f32 and back", &inputs, dtype, |t| fused::cast(&fused::cast(&t[0], DType::F32)?, dtype));
    }
}

/// The root a recomputed stretch's backward starts from (`fused::seed`): its forward on the
/// GPU is one f32 zero, and backward from it hands the given gradient to the stretch's end
/// bit for bit, through the op before it.
#[test]
fn backward_from_the_seed_hands_back_the_given_gradient_on_the_gpu() {
    let dev = gpu();
    let (b, t, d) = (2, 37, 64);
    for dtype in TYPES {
        let x = Var::from_tensor(&tensor(&data(b * t * d, 14, 1.0), &[b, t, d], dtype, &dev)).unwrap();
        let out = fused::add(x.as_tensor(), x.as_tensor()).unwrap(); // d out / d x = 2: exact
        let g = tensor(&data(b * t * d, 15, 1.0), &[b, t, d], dtype, &dev);
        let root = fused::seed(&out, &g).unwrap();
        assert_eq!(root.to_dtype(DType::F32).unwrap().to_vec0::<f32>().unwrap(), 0.0);
        let dx = root.backward().unwrap().get(x.as_tensor()).unwrap().to_device(&Device::Cpu).unwrap();
        let want = g.affine(2.0, 0.0).unwrap().to_device(&Device::Cpu).unwrap();
        let bits = |t: &Tensor| t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(bits(&dx), bits(&want), "{dtype:?}");
    }
}

/// The engine's device keeps what its pool reserved across a synchronization (the driver's
/// default gives it back at each one, and a step synchronizes twice), and an out-of-memory
/// back-off's release gives it back: the card's used memory (`cuMemGetInfo`) after freeing
/// 1 GiB and synchronizing, then after `release_unused`.
#[test]
fn the_pool_keeps_its_reserve_until_released() {
    use ava_train::memory::device::{read, release_unused};
    let Device::Cuda(dev) = ava_train::device::open(ava_train::device::DeviceSpec::Cuda(0)).unwrap() else {
        panic!("cuda:0 opens a GPU")
    };
    let gib = 1u64 << 30;
    let big = Tensor::zeros((gib / 4) as usize, DType::F32, &Device::Cuda(dev.clone())).unwrap();
    let with = read(&dev).unwrap().card_used;
    drop(big);
    candle_core::backend::BackendDevice::synchronize(&dev).unwrap();
    let kept = read(&dev).unwrap().card_used;
    assert!(
        kept + (64 << 20) >= with,
        "the pool gave its reserve back: {with} bytes in use before the free, {kept} after"
    );
    release_unused(&dev).unwrap();
    let released = read(&dev).unwrap().card_used;
    assert!(
        released + gib / 2 <= kept,
        "release_unused kept the reserve: {kept} bytes in use before, {released} after"
    );
}

#[test]
fn stochastic_rounding_is_bit_for_bit_the_cpus() {
    use ava_train::train::rounding::round_stochastic;
    // Values between neighbours, exact ones, zeros, specials and f16's subnormals and overflow.
    let mut values = data(300_001, 14, 5.0);
    values.extend([0.0, -0.0, 1.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 3.0e-6, -7.0e-8, 65_519.0, 70_000.0]);
    let seed = 0x5eed_1234_abcd;
    let on_gpu = Tensor::from_slice(&values, values.len(), &gpu()).unwrap();

    let mut cpu = vec![bf16::ZERO; values.len()];
    round_stochastic(&values, &mut cpu, seed, 2);
    let g = fused::round_stochastic(&on_gpu, DType::BF16, seed).unwrap().to_vec1::<bf16>().unwrap();
    let differ = g.iter().zip(&cpu).position(|(a, b)| a.to_bits() != b.to_bits() && !(a.is_nan() && b.is_nan()));
    assert_eq!(differ, None, "bf16: first differing element {differ:?}");

    let mut cpu = vec![f16::ZERO; values.len()];
    round_stochastic(&values, &mut cpu, seed, 2);
    let g = fused::round_stochastic(&on_gpu, DType::F16, seed).unwrap().to_vec1::<f16>().unwrap();
    let differ = g.iter().zip(&cpu).position(|(a, b)| a.to_bits() != b.to_bits() && !(a.is_nan() && b.is_nan()));
    assert_eq!(differ, None, "f16: first differing element {differ:?}");
}

/// The built-in `standard` kernel through the engine's attention op (the contract's device
/// calls, launched on candle's stream) against the same on the CPU: causal, grouped-query
/// (4 query heads per key/value head), with and without packed documents.
#[test]
fn standard_attention_matches_the_cpu() {
    let registry = ava_plugins::Registry::builtins();
    let kernel = registry.attention("standard", "{}").unwrap();
    let (b, h, hkv, t, d) = (2, 8, 2, 37, 64);
    let segments: Arc<[u32]> = (0..b * t).map(|i| ((i % t) / 10) as u32).collect();
    for dtype in TYPES {
        let inputs = [
            (data(b * h * t * d, 20, 1.0), vec![b, h, t, d]),
            (data(b * hkv * t * d, 21, 1.0), vec![b, hkv, t, d]),
            (data(b * hkv * t * d, 22, 1.0), vec![b, hkv, t, d]),
        ];
        for segs in [None, Some(&segments)] {
            let what = format!("standard attention, documents {}", segs.is_some());
            compare(&what, &inputs, dtype, |x| {
                ava_train::model::attention(&kernel, "standard", &x[0], &x[1], &x[2], segs, 2)
            });
        }
    }
}

/// `flash` (FlashAttention-2, kernels/flash.cu in ava-kernels) through the engine's attention
/// op against the same kernel on the CPU: causal, grouped-query, with and without packed
/// documents; head dims 64, 80 (padded to 96 in the tiles) and 128; lengths that end inside a
/// tile and span several (the f32 tiles are 32, the bf16/f16 ones 64). Every case runs and
/// every failure is reported, each with the rows and columns that differ: which of out, dq, dk
/// and dv is wrong, and where in the tiles, says which kernel and which fragment to look at.
#[test]
fn flash_attention_matches_the_cpu() {
    use ava_kernels::attention::{Kernel, Masking};
    let kernel: Arc<dyn ava_core::AttentionKernel> = Arc::new(Kernel::flash(Masking::Plain));
    assert!(Kernel::flash(Masking::Plain).runs_on_cuda());
    let (mut failed, mut cases) = (Vec::new(), 0);
    for (b, h, hkv, t, d) in [(2, 8, 2, 37, 64), (1, 4, 4, 200, 128), (1, 2, 1, 70, 80)] {
        let segments: Arc<[u32]> = (0..b * t).map(|i| ((i % t) / 23) as u32).collect();
        for dtype in TYPES {
            let inputs = [
                (data(b * h * t * d, 30, 1.0), vec![b, h, t, d]),
                (data(b * hkv * t * d, 31, 1.0), vec![b, hkv, t, d]),
                (data(b * hkv * t * d, 32, 1.0), vec![b, hkv, t, d]),
            ];
            for segs in [None, Some(&segments)] {
                let what = format!("flash attention (B {b}, H {h}/{hkv}, T {t}, D {d}), documents {}", segs.is_some());
                cases += 1;
                failed.extend(check(&what, &inputs, dtype, |x| {
                    ava_train::model::attention(&kernel, "flash", &x[0], &x[1], &x[2], segs, 2)
                }));
            }
        }
    }
    assert!(failed.is_empty(), "{} failures in {cases} cases:\n{}", failed.len(), failed.join("\n"));
}

/// `flash` at the lengths training at long context runs, against the CPU: 4K and 8K tokens
/// (64 key tiles of the tensor-core kernels, 128 and 256 of the f32 ones), grouped-query
/// attention 4:1 with head dim 64 and without grouping at 128, one sequence with two
/// documents. The inputs are scaled to 0.5 so the softmax is neither flat nor one-hot over
/// thousands of keys.
#[test]
fn flash_attention_matches_the_cpu_at_long_sequences() {
    use ava_kernels::attention::{Kernel, Masking};
    let kernel: Arc<dyn ava_core::AttentionKernel> = Arc::new(Kernel::flash(Masking::Plain));
    let (mut failed, mut cases) = (Vec::new(), 0);
    for (h, hkv, t, d) in [(4, 1, 4096, 64), (2, 2, 8192, 128)] {
        let segments: Arc<[u32]> = (0..t).map(|i| u32::from(i >= t / 3)).collect();
        for dtype in TYPES {
            let inputs = [
                (data(h * t * d, 33, 0.5), vec![1, h, t, d]),
                (data(hkv * t * d, 34, 0.5), vec![1, hkv, t, d]),
                (data(hkv * t * d, 35, 0.5), vec![1, hkv, t, d]),
            ];
            for segs in [None, Some(&segments)] {
                let what = format!("flash attention (H {h}/{hkv}, T {t}, D {d}), documents {}", segs.is_some());
                cases += 1;
                failed.extend(check(&what, &inputs, dtype, |x| {
                    ava_train::model::attention(&kernel, "flash", &x[0], &x[1], &x[2], segs, 16)
                }));
            }
        }
    }
    assert!(failed.is_empty(), "{} failures in {cases} cases:\n{}", failed.len(), failed.join("\n"));
}

/// Flash on the GPU gives the same bits on every run (its sums run in a fixed order: no
/// atomics), which exact resume on the GPU needs.
#[test]
fn flash_attention_is_deterministic() {
    use ava_kernels::attention::{Kernel, Masking};
    let kernel: Arc<dyn ava_core::AttentionKernel> = Arc::new(Kernel::flash(Masking::Plain));
    let (b, h, hkv, t, d) = (1, 8, 2, 300, 64);
    let dev = gpu();
    let run = || {
        let q = Var::from_tensor(&tensor(&data(b * h * t * d, 40, 1.0), &[b, h, t, d], DType::BF16, &dev)).unwrap();
        let k = tensor(&data(b * hkv * t * d, 41, 1.0), &[b, hkv, t, d], DType::BF16, &dev);
        let v = tensor(&data(b * hkv * t * d, 42, 1.0), &[b, hkv, t, d], DType::BF16, &dev);
        let out = ava_train::model::attention(&kernel, "flash", q.as_tensor(), &k, &v, None, 2).unwrap();
        let loss = out.to_dtype(DType::F32).and_then(|o| o.sqr()).and_then(|o| o.sum_all()).unwrap();
        let g = loss.backward().unwrap().get(q.as_tensor()).unwrap().clone();
        let bits = |x: &Tensor| x.flatten_all().unwrap().to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap();
        (bits(&out), bits(&g))
    };
    let first = run();
    for _ in 0..3 {
        assert!(run() == first, "flash on the GPU gave different bits on a second run");
    }
}

/// The gradient norm's sums of squares on the GPU (the engine's two-pass kernel) against the
/// CPU's, for an empty tensor, one element, and sizes past one block and past the grid's
/// stride; the same bits on a second run (fixed order).
#[test]
fn sums_of_squares_match_the_cpu() {
    let dev = gpu();
    for n in [0, 1, 1000, 3_000_001] {
        for dtype in TYPES {
            let x = data(n, 50, 1.0);
            let (g, c) = (tensor(&x, &[n], dtype, &dev), tensor(&x, &[n], dtype, &Device::Cpu));
            let on_gpu = ava_train::model::fused::sums_of_squares(&[&g, &g]).unwrap();
            let on_cpu = c.to_dtype(DType::F64).unwrap().sqr().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap();
            let tol = 1e-5 * on_cpu + 1e-6;
            assert!((f64::from(on_gpu[0]) - on_cpu).abs() <= tol, "n {n} {dtype:?}: {} vs {on_cpu}", on_gpu[0]);
            assert_eq!(on_gpu[0].to_bits(), on_gpu[1].to_bits(), "n {n} {dtype:?}: two runs differ");
        }
    }
    // Tensors of several sizes in one call (two launches for all): each sum the bits of its
    // own call.
    let sizes = [257, 0, 3_000_001, 1, 1000];
    for dtype in TYPES {
        let ts: Vec<Tensor> = sizes.iter().map(|&n| tensor(&data(n, n as u64, 1.0), &[n], dtype, &dev)).collect();
        let all = ava_train::model::fused::sums_of_squares(&ts.iter().collect::<Vec<_>>()).unwrap();
        for ((t, n), s) in ts.iter().zip(sizes).zip(&all) {
            let alone = ava_train::model::fused::sums_of_squares(&[t]).unwrap()[0];
            assert_eq!(s.to_bits(), alone.to_bits(), "n {n} {dtype:?}: {s} among others, {alone} alone");
        }
    }
}

/// Fails naming `what` and the first differing element unless the half values `gpu` and
/// `cpu` are the same bits (NaN where the other is NaN: the GPU's conversions write the
/// canonical NaN, the CPU's keep the payload).
fn same_halves<H: Half>(what: &str, gpu: &[H], cpu: &[H]) {
    assert_eq!(gpu.len(), cpu.len(), "{what}: lengths differ");
    let bits = |h: &H| bytemuck::cast::<H, u16>(*h);
    let differ =
        (gpu.iter().zip(cpu)).position(|(a, b)| bits(a) != bits(b) && !(a.widen().is_nan() && b.widen().is_nan()));
    assert_eq!(differ, None, "{what}: first differing element {differ:?}");
}

/// `round_compensated` and `widen_compensated` of `values` into `dtype` (`H`) on the GPU
/// against `train::rounding`'s on the CPU, bit for bit.
fn kahan_kernels_match<H: Half + candle_core::WithDType>(values: &[f32], dtype: DType) {
    use ava_train::train::rounding::{round_compensated, widen};
    let (n, dev) = (values.len(), gpu());
    let (mut h, mut c) = (vec![H::nearest(0.0); n], vec![H::nearest(0.0); n]); // (n,) each
    round_compensated(values, &mut h, &mut c);
    let on_gpu = Tensor::from_slice(values, n, &dev).unwrap();
    let (gh, gc) = fused::round_compensated(&on_gpu, dtype).unwrap();
    same_halves(&format!("{dtype:?}: the rounded weights"), &gh.to_vec1::<H>().unwrap(), &h);
    same_halves(&format!("{dtype:?}: the compensation"), &gc.to_vec1::<H>().unwrap(), &c);

    // What the CPU stored, widened back: h + c in f32.
    let mut wide = vec![0f32; n]; // (n,) f32
    widen(&h, Some(&c), &mut wide);
    let (th, tc) = (Tensor::from_slice(&h, n, &dev).unwrap(), Tensor::from_slice(&c, n, &dev).unwrap());
    let g = fused::widen_compensated(&th, &tc).unwrap().to_vec1::<f32>().unwrap();
    let differ = g.iter().zip(&wide).position(|(a, b)| a.to_bits() != b.to_bits() && !(a.is_nan() && b.is_nan()));
    assert_eq!(differ, None, "{dtype:?}: widened with the compensation, first differing element {differ:?}");
}

/// `master_weights: kahan`'s kernels (`round_compensated_*`, `widen_compensated_*`) give the
/// CPU's bits in bf16 and f16: values between neighbours, ties to even of both parities at
/// each type's unit in the last place, exact ones, zeros, f32's, bf16's and f16's subnormals,
/// f16's overflow and f32's extremes, infinities and NaN.
#[test]
fn kahan_rounding_is_bit_for_bit_the_cpus() {
    let mut values = data(300_001, 15, 5.0);
    let ties = |ulp: f32| [1.0 + ulp / 2.0, 1.0 + 1.5 * ulp, -(1.0 + ulp / 2.0), -(1.0 + 1.5 * ulp)];
    values.extend(ties(2f32.powi(-7)));
    values.extend(ties(2f32.powi(-10)));
    values.extend([0.0, -0.0, 1.0, 3.0e-6, -7.0e-8, 1.0e-40, -3.0e-39, 65_519.0, 70_000.0, -1.0e6]);
    values.extend([f32::MAX, f32::MIN_POSITIVE, f32::INFINITY, f32::NEG_INFINITY, f32::NAN]);
    kahan_kernels_match::<bf16>(&values, DType::BF16);
    kahan_kernels_match::<f16>(&values, DType::F16);
}

/// Five steps of `master_weights: kahan` through the engine's optimizer step
/// (`train::step_param`, AdamW, weight decay from the second step) on a `dtype` parameter of
/// 70 001 elements, from the same weights and gradients on each device: after every step the
/// weights and the whole optimizer state (AdamW's moments and the `ava.kahan` compensation)
/// are the same bits on the GPU as on the CPU. `home`: the GPU's state in page-locked host
/// memory, uploaded for each step and written back (`offload.tiers: [ram: 100%]`).
fn kahan_steps_match(dtype: DType, compensation: ava_core::DType, home: Option<PinnedHome>) {
    use ava_core::StepContext;
    use ava_plugins::builtin::adamw::AdamW;
    let n = 70_001;
    let def = ParamDef {
        name: "model.layers.0.mlp.up_proj.weight".into(),
        shape: vec![n],
        role: ParamRole::Matrix,
        block: Some(0),
    };
    let init = data(n, 21, 1.0);
    let param =
        |dev: &Device| Param { def: def.clone(), var: Var::from_tensor(&tensor(&init, &[n], dtype, dev)).unwrap() };
    let (on_cpu, on_gpu) = (param(&Device::Cpu), param(&gpu()));
    let (mut adam_cpu, mut adam_gpu) = (AdamW::default(), AdamW::default());
    let host = HostState::Compensation(compensation);
    let no_master = |_: &Param| Vec::new();
    let allocate = |opt: &AdamW, p: &Param| {
        OptimizerState::allocate_with(opt, std::slice::from_ref(p), "adamw", host, None, &no_master).unwrap()
    };
    let (mut cpu_state, mut gpu_state) = (allocate(&adam_cpu, &on_cpu), allocate(&adam_gpu, &on_gpu));
    let Device::Cuda(cuda) = on_gpu.var.device() else { unreachable!("the parameter was made on the GPU") };
    gpu_state.place_on(cuda, home, &|_| def.name.clone()).unwrap();
    let what = format!("{dtype:?}, state {}", if home.is_some() { "in host memory" } else { "on the device" });
    for step in 1..=5u64 {
        let ctx = StepContext {
            step,
            lr: 1e-3 * step as f64,
            weight_decay: if step > 1 { 0.1 } else { 0.0 },
            threads: 1,
            grad_scale: 1.0,
        };
        let g = Tensor::from_slice(&data(n, 30 + step, 0.5), n, &Device::Cpu).unwrap(); // (n,) f32
        let g_gpu = g.to_device(on_gpu.var.device()).unwrap();
        cpu_state
            .for_each(&[0], |_, bufs| step_param(&mut adam_cpu, "adamw", &on_cpu, &g, bufs, ctx, 0).map(|_| ()))
            .unwrap();
        gpu_state
            .for_each(&[0], |_, bufs| step_param(&mut adam_gpu, "adamw", &on_gpu, &g_gpu, bufs, ctx, 0).map(|_| ()))
            .unwrap();
        let bits = |p: &Param| p.var.as_tensor().to_device(&Device::Cpu).unwrap().to_dtype(DType::F32).unwrap();
        let (w_gpu, w_cpu) = (bits(&on_gpu).to_vec1::<f32>().unwrap(), bits(&on_cpu).to_vec1::<f32>().unwrap());
        let differ = w_gpu.iter().zip(&w_cpu).position(|(a, b)| a.to_bits() != b.to_bits());
        assert_eq!(differ, None, "{what}, step {step}: the weights differ first at element {differ:?}");
        assert!(gpu_state == cpu_state, "{what}, step {step}: the optimizer state or the compensation differs");
    }
}

/// `master_weights: kahan` on the GPU is the CPU's step bit for bit (AdamW's own GPU step is,
/// ava-plugins' gpu_optim): bf16 and f16 weights, the compensation on the device and in
/// page-locked host memory.
#[test]
fn kahan_steps_on_the_gpu_are_the_cpus_bit_for_bit() {
    let pinned = Some(PinnedHome { on_device: 0.0, prefetch: 0 });
    for home in [None, pinned] {
        kahan_steps_match(DType::BF16, ava_core::DType::BF16, home);
        kahan_steps_match(DType::F16, ava_core::DType::F16, home);
    }
}

/// The step inside backward on the GPU queues each gradient's Σ g² on the device and reads
/// them all once backward ends (no synchronization per parameter): a NaN gradient still
/// fails the step naming the parameter, and nothing of the step is saved.
#[test]
fn step_in_backward_names_a_nan_gradient_from_the_sums_read_after_backward() {
    use ava_train::train::{Silent, TrainError, TrainOptions, Trainer};
    let _ = gpu();
    let dir = tempfile::tempdir().unwrap();
    let sets = [
        "train.device=cuda",
        "train.precision=fp32",
        "train.micro_batch_size=4",
        "train.max_steps=6",
        "train.eval_every=0",
        "train.log_every=1",
        "train.step_in_backward=true",
        "train.grad_clip=0",
        "checkpoints.every=2",
    ];
    let config = common::tiny_config(dir.path(), &sets);
    let options = TrainOptions { nan_grad_at_steps: Some(3..4), ..Default::default() };
    let mut t = Trainer::new(&config, &ava_plugins::Registry::builtins(), &options).unwrap();
    let err = t.run(&options, &mut Silent).unwrap_err();
    let text = err.to_string();
    let TrainError::FailedInBackward { step: 3, saved: 2, source } = &err else { panic!("{text}") };
    assert!(matches!(**source, TrainError::NonFiniteInBackward { step: 3, .. }), "{text}");
    // The second gradient to arrive, named as on the CPU (nan_policy.rs): the sums read after
    // backward keep each one's parameter.
    assert!(text.contains("the gradient of model.layers.0.self_attn.q_proj.weight is NaN at step 3"), "{text}");
    assert!(!dir.path().join("checkpoints/step-00000003").exists());
}
