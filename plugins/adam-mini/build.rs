//! With the `cuda` feature: kernels/adam_mini.cu built to PTX (see ava-cuda-build for nvcc and
//! the target), which src/gpu.rs embeds. Without the feature nothing is built and no CUDA is
//! needed.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        // No fused multiply-adds: the CPU's `step` rounds each product, so the GPU gives its bits.
        ava_cuda_build::ptx_with("kernels/adam_mini.cu", "adam_mini.ptx", &["--fmad=false"]);
    }
}
