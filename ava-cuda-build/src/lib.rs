//! # ava-cuda-build: CUDA C to PTX in a build script
//!
//! Ava's kernels are CUDA C compiled to PTX by nvcc at build time (as candle-kernels does)
//! and loaded at run time by the driver, which compiles the PTX for the card it finds. A
//! build script calls [`ptx`] once per source file, behind the crate's `cuda` feature:
//!
//! ```no_run
//! // build.rs
//! if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
//!     ava_cuda_build::ptx("kernels/fused.cu", "fused.ptx");
//! }
//! ```
//!
//! and the crate embeds the result with
//! `include_str!(concat!(env!("OUT_DIR"), "/fused.ptx"))`.
//!
//! Every file is compiled with this crate's `include/` on the include path, so kernels share
//! `#include <ava/common.cuh>`: loads that widen bf16/f16 to f32, stores that round once,
//! block-wide sums and maxima in a fixed order, and LLVM's `powi` (the optimizers' bias
//! corrections, as Rust's `f64::powi` computes them).
//!
//! nvcc is `$NVCC`, else `$CUDA_ROOT/bin/nvcc`, else `nvcc` on PATH. The target is
//! `compute_$CUDA_COMPUTE_CAP` (80 A100, 89 RTX 4090, 90 H100/H200), else the first GPU's as
//! nvidia-smi reports it. Ava's `tools/cuda-build-env.sh` sets both on a machine without a
//! toolkit (nvcc from PyPI).

use std::env;
use std::path::PathBuf;
use std::process::Command;

/// Compiles `source` (relative to the crate's root) to `$OUT_DIR/<out_name>` as PTX, and
/// tells cargo to rebuild when the source, `CUDA_COMPUTE_CAP`, `NVCC` or `CUDA_ROOT` change.
/// On failure it prints what went wrong and how to fix it, and exits the build script.
pub fn ptx(source: &str, out_name: &str) -> PathBuf {
    ptx_with(source, out_name, &[])
}

/// [`ptx`] with more nvcc flags, e.g. `--fmad=false` for kernels that must give the CPU's
/// bits (no fused multiply-adds).
pub fn ptx_with(source: &str, out_name: &str, flags: &[&str]) -> PathBuf {
    println!("cargo:rerun-if-changed={source}");
    println!("cargo:rerun-if-changed={}", include_dir().join("ava/common.cuh").display());
    for var in ["CUDA_COMPUTE_CAP", "NVCC", "CUDA_ROOT"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let cap = compute_cap().unwrap_or_else(|why| fail(source, &why));
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR for build scripts")).join(out_name);
    let nvcc = nvcc();
    let status = Command::new(&nvcc)
        .args(["--ptx", "-O3", "-std=c++17", &format!("-arch=compute_{cap}")])
        .arg(format!("-I{}", include_dir().display()))
        .args(flags)
        .arg("-o")
        .arg(&out)
        .arg(source)
        .status()
        .unwrap_or_else(|e| {
            fail(
                source,
                &format!(
                    "cannot run nvcc ({}): {e}; install a CUDA 12.4+ toolkit, or `source tools/cuda-build-env.sh` \
                     in Ava's checkout (nvcc from PyPI), or point NVCC at an nvcc",
                    nvcc.display()
                ),
            )
        });
    if !status.success() {
        fail(source, &format!("nvcc could not build it for compute_{cap} ({status}); its errors are above"));
    }
    out
}

/// This crate's `include/`: `<ava/common.cuh>` (loads, stores, block reductions, `powi`) for every
/// kernel file.
pub fn include_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("include")
}

/// The nvcc to run.
fn nvcc() -> PathBuf {
    if let Some(p) = env::var_os("NVCC") {
        return p.into();
    }
    if let Some(root) = env::var_os("CUDA_ROOT") {
        let p = PathBuf::from(root).join("bin/nvcc");
        if p.exists() {
            return p;
        }
    }
    "nvcc".into()
}

/// `CUDA_COMPUTE_CAP` as nvcc writes it (`90`; `9.0` is accepted too), else the first GPU's.
fn compute_cap() -> Result<String, String> {
    let help = "set CUDA_COMPUTE_CAP to the card's compute capability (80 A100, 89 RTX 4090, 90 H100/H200)";
    let text = match env::var("CUDA_COMPUTE_CAP") {
        Ok(v) => v,
        Err(_) => {
            let out = Command::new("nvidia-smi")
                .args(["--query-gpu=compute_cap", "--format=csv,noheader"])
                .output()
                .map_err(|_| format!("CUDA_COMPUTE_CAP is not set and there is no nvidia-smi to ask: {help}"))?;
            String::from_utf8_lossy(&out.stdout).lines().next().unwrap_or("").to_string()
        }
    };
    parse_cap(&text).ok_or_else(|| format!("'{}' is not a compute capability: {help}", text.trim()))
}

/// `90` from `90` or `9.0`; `None` for anything else.
fn parse_cap(text: &str) -> Option<String> {
    let cap: String = text.trim().chars().filter(|c| *c != '.').collect();
    (cap.len() >= 2 && cap.len() <= 3 && cap.bytes().all(|b| b.is_ascii_digit())).then_some(cap)
}

fn fail(source: &str, why: &str) -> ! {
    eprintln!("error: building {source} to PTX: {why}");
    std::process::exit(1)
}

#[cfg(test)]
mod tests {
    use super::parse_cap;

    #[test]
    fn compute_capabilities_are_read_as_nvcc_writes_them() {
        assert_eq!(parse_cap("90").as_deref(), Some("90"));
        assert_eq!(parse_cap(" 8.9\n").as_deref(), Some("89"));
        assert_eq!(parse_cap("100").as_deref(), Some("100"));
        for bad in ["", "9", "sm_90", "9.x", "12345"] {
            assert_eq!(parse_cap(bad), None, "{bad:?}");
        }
    }
}
