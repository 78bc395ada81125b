//! `tools/gpu-session.sh run` against a fake GPU machine: stand-ins for `nvidia-smi`,
//! `python3` (PyTorch's reference scripts), the `ava` binary and the GPU test binaries, each
//! printing what the real one prints. What a run on the GPU machine gives back is at most 8
//! files two folders deep in `$OUT` and the last 12,000 characters printed; these tests hold
//! the script to that: exactly `summary.txt` and `logs.tar.xz` in `$OUT`, the summary (every
//! test binary's verdict, each benchmark's headline beside PyTorch's and the ratio) printed
//! last and whole, every log in the archive, and both written again after every part, so a
//! run killed midway keeps what it finished.

use std::{
    fs,
    os::unix::{fs::PermissionsExt, process::CommandExt},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use ava_tests::repo_root;

/// What the device tool gives back of a run's output.
const SCREEN_LIMIT: usize = 12_000;

/// libtest's output for a passing binary of `n` tests.
fn passing(n: usize) -> String {
    let mut s = format!("echo 'running {n} tests'\n");
    for i in 0..n {
        s.push_str(&format!("echo 'test case_{i} ... ok'\n"));
    }
    s.push_str(&format!(
        "echo 'test result: ok. {n} passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 1.00s'\n"
    ));
    s
}

/// `ava`: `bench train` prints the headline lines of the real one (19,474 tokens/s plain,
/// 9,944 checkpointed: the H200's numbers of 2026-11-26), `estimate` its last line, `bench
/// attention` the device table, `train` a loss line and a metrics file; with
/// AVA_CUDA_KERNEL_TIMES set, two launches' times. `slow_bench` seconds of sleep first.
fn fake_ava(slow_bench: u32) -> String {
    format!(
        r#"
if [ -n "${{AVA_CUDA_KERNEL_TIMES:-}}" ]; then
    printf 'flash\tflash_fwd_bf16_d64\t32x256x1\t128\t0.5000\n' >>"$AVA_CUDA_KERNEL_TIMES"
    printf 'adamw\tadamw_step\t1024x1x1\t256\t0.1000\n' >>"$AVA_CUDA_KERNEL_TIMES"
fi
case "$1 $2" in
"bench train")
    sleep {slow_bench}
    case "$*" in *checkpoint=full*) tok=9944; step=823.8; peak='19.58 GiB' ;; *) tok=19474; step=420.7; peak='32.21 GiB' ;; esac
    echo 'bench: 1100.05M parameters, 8192 tokens/step'
    echo 'device             cuda:0, FAKE H200'
    echo "tokens/s           $tok (from the median step)"
    echo "step time          $step ms median (mean 421.0, fastest 419.0, slowest 423.0)"
    echo "device peak        $peak (the memory pool's high-water mark over the last step) — params 4.10 GiB"
    echo 'predicted step     400.0 ms on H200 by the GPU model (matmul 300.0); measured/predicted ×1.05'
    echo '  backward: autograd (all)              335.0 ms/step   70.0%'
    ;;
"estimate -c") echo 'peak 32.99 GiB (predicted)' ;;
"bench attention")
    echo 'attention B=1 H=32 Hkv=4 D=64 causal, bf16, cuda:0 (FAKE), median of 10 repeats'
    echo 'T      kernel  fwd ms  TFLOP/s  fwd+bwd ms  TFLOP/s  ×standard  saved    ×standard  device peak  max err'
    echo '2048   flash   0.381   90.1     6.520       20.0     -          32 KiB   -          10 MiB       1.5e-2'
    echo '8192   flash   4.120   133.0    41.50       48.0     -          128 KiB  -          40 MiB       -'
    ;;
"train --set")
    for a in "$@"; do case "$a" in train.out_dir=*) out=${{a#train.out_dir=}} ;; esac; done
    mkdir -p "$out" && echo '{{"step": 100}}' >"$out/metrics.jsonl"
    echo 'step 100: loss 1.2301, val 1.1918 (floor 1.1500)'
    ;;
*) echo "fake ava: unexpected arguments: $*" >&2; exit 2 ;;
esac
"#
    )
}

/// `python3`: PyTorch's reference scripts' JSON lines (45,546 / 36,456 / 52,000 tokens/s).
const FAKE_PYTHON: &str = r#"
case "$(basename "$1")" in
torch_ref.py)
    case "$*" in *--ckpt*) tok=36456.0 ;; *--compile*) tok=52000.0 ;; *) tok=45546.0 ;; esac
    echo 'a warning PyTorch prints first'
    echo "{\"shape\": \"1b\", \"step_ms\": 179.86, \"tokens_per_s\": $tok, \"peak_alloc_gib\": 35.93}"
    ;;
attn_ref.py)
    echo '{"seq": 2048, "fwd_ms": 0.122, "fwd_bwd_ms": 0.452, "device": "FAKE"}'
    echo '{"seq": 8192, "fwd_ms": 1.05, "fwd_bwd_ms": 3.94, "device": "FAKE"}'
    ;;
*) echo "fake python3: unexpected arguments: $*" >&2; exit 2 ;;
esac
"#;

/// A fake GPU machine: DIR as `gpu-session.sh build` leaves it (binaries, reference
/// scripts, BUILT_AT), and a folder of stand-ins to put first on PATH.
struct FakeMachine {
    _root: tempfile::TempDir,
    dir: PathBuf,
    bin: PathBuf,
    out: PathBuf,
    work: PathBuf,
}

fn script(path: &Path, body: &str) {
    fs::write(path, format!("#!/usr/bin/env bash\n{body}")).unwrap();
    fs::set_permissions(path, fs::Permissions::from_mode(0o755)).unwrap();
}

impl FakeMachine {
    /// Every test binary passes but `gpu_optim` (one failure, with its panic) and
    /// `gpu_adam_mini` (crashes before a verdict); `gpu_ops` sleeps `slow_ops` seconds first.
    fn new(slow_ops: u32, slow_bench: u32) -> Self {
        let root = tempfile::tempdir().unwrap();
        let (dir, bin, out, work) =
            (root.path().join("gpu-run"), root.path().join("bin"), root.path().join("out"), root.path().join("work"));
        for d in [&dir, &bin] {
            fs::create_dir_all(d).unwrap();
        }
        script(&bin.join("nvidia-smi"), "echo 'NVIDIA H200 (fake), 143771 MiB, 580.159.04'");
        script(&bin.join("python3"), FAKE_PYTHON);
        script(&dir.join("ava"), &fake_ava(slow_bench));
        for name in ["torch_ref.py", "attn_ref.py"] {
            fs::write(dir.join(name), "# stands in for ../shared/gpu's script\n").unwrap();
        }
        fs::write(dir.join("BUILT_AT"), "built from 0123abc, 0 paths changed since, 2026-11-28T00:00:00Z\n").unwrap();
        for name in ["gpu_attention", "gpu_train", "gpu_lion", "gpu_adam_8bit", "gpu_adafactor"] {
            script(&dir.join(name), &passing(3));
        }
        script(&dir.join("gpu_ops"), &format!("sleep {slow_ops}\n{}", passing(12)));
        script(
            &dir.join("gpu_optim"),
            "echo 'running 3 tests'
echo 'test adamw_step_matches_the_cpu ... FAILED'
echo 'test sgd_step_matches_the_cpu ... ok'
echo 'test wrong_buffers_are_refused ... ok'
echo 'failures:'
echo \"thread 'adamw_step_matches_the_cpu' panicked at ava-plugins/tests/gpu_optim.rs:40:5:\"
echo 'adamw differs from the CPU at element 3: 0.25 against 0.5'
echo 'test result: FAILED. 2 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.50s'
exit 101",
        );
        script(
            &dir.join("gpu_adam_mini"),
            "echo 'running 4 tests'\necho 'test a_case ... ok'\necho 'Segmentation fault (core dumped)'\nexit 139",
        );
        FakeMachine { _root: root, dir, bin, out, work }
    }

    /// `tools/gpu-session.sh run DIR OUT` with the stand-ins first on PATH, in a process
    /// group of its own.
    fn command(&self, deadline: u32, parts: Option<&str>) -> Command {
        let mut cmd = Command::new("bash");
        cmd.arg(repo_root().join("tools/gpu-session.sh")).arg("run").arg(&self.dir).arg(&self.out);
        cmd.current_dir(repo_root());
        let path = format!("{}:{}", self.bin.display(), std::env::var("PATH").unwrap_or_default());
        cmd.env("PATH", path).env("AVA_GPU_DEADLINE", deadline.to_string()).env("AVA_GPU_WORK", &self.work);
        match parts {
            Some(p) => cmd.env("AVA_GPU_PARTS", p),
            None => cmd.env_remove("AVA_GPU_PARTS"),
        };
        cmd.stdin(Stdio::null()).process_group(0);
        cmd
    }

    /// The files in OUT, by path relative to it (folders walked).
    fn out_files(&self) -> Vec<String> {
        fn walk(base: &Path, d: &Path, acc: &mut Vec<String>) {
            for e in fs::read_dir(d).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    walk(base, &p, acc);
                } else {
                    acc.push(p.strip_prefix(base).unwrap().display().to_string());
                }
            }
        }
        let mut files = Vec::new();
        walk(&self.out, &self.out, &mut files);
        files.sort();
        files
    }

    fn summary(&self) -> String {
        fs::read_to_string(self.out.join("summary.txt")).expect("OUT/summary.txt")
    }

    /// The archive's member names (`tar -tJf`).
    fn archived(&self) -> Vec<String> {
        let out = Command::new("tar").arg("-tJf").arg(self.out.join("logs.tar.xz")).output().unwrap();
        assert!(
            out.status.success(),
            "logs.tar.xz is not a readable archive: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap().lines().map(str::to_string).collect()
    }
}

#[test]
fn a_run_gives_back_one_summary_printed_last_and_one_archive() {
    let m = FakeMachine::new(0, 0);
    let out = m.command(400, None).output().unwrap();
    let screen = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the run failed ({}):\n{screen}", out.status);
    assert_eq!(m.out_files(), ["logs.tar.xz", "summary.txt"], "OUT holds only the summary and the archive");

    let summary = m.summary();
    assert!(screen.len() < SCREEN_LIMIT, "the run printed {} characters:\n{screen}", screen.len());
    assert!(
        String::from_utf8_lossy(&out.stdout).trim_end().ends_with(summary.trim_end()),
        "the summary is not the last thing printed:\n{screen}"
    );
    for want in [
        "NVIDIA H200 (fake), 143771 MiB",
        "built from 0123abc",
        "gpu_ops: ok, 12 passed, 0 failed",
        "gpu_optim: FAILED, 2 passed, 1 failed: adamw_step_matches_the_cpu",
        "adamw differs from the CPU at element 3",
        "gpu_adam_mini: NO VERDICT (Segmentation fault (core dumped); exit status 139)",
        "; before it: 1 passed",
        "gpu_attention: ok, 3 passed, 0 failed",
        "gpu_adafactor: ok, 3 passed, 0 failed",
        "Ava      19474 tokens/s, step 420.7 ms, peak 32.21 GiB, measured/predicted ×1.05",
        "PyTorch  45546.0 tokens/s, step 179.86 ms, peak 35.93 GiB allocated",
        "Ava / PyTorch tokens/s: 0.43x",
        "Ava / PyTorch tokens/s: 0.27x",
        "Ava plain / compile: 0.37x",
        "estimate (checkpoint none): peak 32.99 GiB (predicted)",
        "flash_fwd_bf16_d64",
        "tiny-cuda-flash: step 100: loss 1.2301, val 1.1918",
    ] {
        assert!(summary.contains(want), "the summary lacks {want:?}:\n{summary}");
    }
    // flash against SDPA, T by T: 0.452 / 6.520 and 3.94 / 41.50.
    let rows: Vec<&str> = summary
        .lines()
        .filter(|l| l.trim_start().starts_with("2048 ") || l.trim_start().starts_with("8192 "))
        .collect();
    assert_eq!(rows.len(), 2, "one attention row per T:\n{summary}");
    assert!(rows[0].ends_with("0.07x") && rows[1].ends_with("0.09x"), "{rows:?}");

    let archived = m.archived();
    for want in [
        "logs/gpu_ops.log",
        "logs/gpu_optim.log",
        "logs/bench-1b-none.txt",
        "logs/torch-1b--ckpt.log",
        "logs/attn-torch.txt",
        "logs/kernels-1b.tsv",
        "logs/tiny-cuda-standard.metrics.jsonl",
        "summary.txt",
    ] {
        assert!(archived.iter().any(|a| a == want), "logs.tar.xz lacks {want}: {archived:?}");
    }
    assert!(
        !archived.iter().any(|a| a.contains("runs/")),
        "training run folders stay out of the archive: {archived:?}"
    );
}

#[test]
fn a_run_past_its_deadline_skips_what_is_left_and_says_so() {
    // gpu_ops takes 12 of the 30 seconds: what comes after has under 20 left.
    let m = FakeMachine::new(12, 0);
    let out = m.command(30, Some("ops bench tests")).output().unwrap();
    let screen = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{screen}");
    let summary = m.summary();
    assert!(summary.contains("gpu_ops: ok, 12 passed"), "{summary}");
    assert!(summary.contains("Ava      no result: skipped ("), "{summary}");
    assert!(summary.contains("gpu_train: NO VERDICT (skipped ("), "{summary}");
    assert!(summary.contains("PyTorch  not run"), "{summary}");
    assert!(summary.contains("parts asked: ops bench tests"), "{summary}");
}

#[test]
fn a_run_killed_midway_keeps_what_it_finished() {
    // The bench hangs; the run is killed (SIGKILL: no trap runs) once gpu_ops is packed.
    let m = FakeMachine::new(0, 60);
    let mut child = m.command(400, Some("ops bench")).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    let start = Instant::now();
    while !m.out.join("summary.txt").exists() || !m.summary().contains("gpu_ops: ok") {
        assert!(start.elapsed() < Duration::from_secs(30), "no summary after gpu_ops within 30 s");
        std::thread::sleep(Duration::from_millis(100));
    }
    // SAFETY: kill(2) on the process group the child leads; no memory is involved.
    unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
    child.wait().unwrap();
    assert!(m.summary().contains("gpu_ops: ok, 12 passed"));
    assert!(m.archived().iter().any(|a| a == "logs/gpu_ops.log"));
    assert!(m.out_files().len() <= 8, "{:?}", m.out_files());
}
