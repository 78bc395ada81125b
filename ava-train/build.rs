//! With the `cuda` feature: the fused ops' CUDA kernels (kernels/fused.cu) built to PTX for
//! src/model/fused/cuda.rs (see ava-cuda-build for nvcc and the target). Without the feature
//! nothing is built and no toolkit is needed.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        ava_cuda_build::ptx("kernels/fused.cu", "fused.ptx");
    }
}
