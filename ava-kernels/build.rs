//! With the `cuda` feature: kernels/flash.cu built to PTX for src/attention/cuda.rs (see
//! ava-cuda-build for nvcc and the target). Without the feature nothing is built.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        ava_cuda_build::ptx("kernels/flash.cu", "flash.ptx");
    }
}
