//! With the `cuda` feature: the built-ins' GPU kernels built to PTX for src/builtin/cuda.rs
//! (see ava-cuda-build for nvcc and the target): the optimizers' steps (kernels/optim.cu)
//! without fused multiply-adds, so they give the CPU's bits, and standard's dense attention
//! (kernels/attention.cu). Without the feature nothing is built.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        ava_cuda_build::ptx_with("kernels/optim.cu", "optim.ptx", &["--fmad=false"]);
        ava_cuda_build::ptx("kernels/attention.cu", "attention.ptx");
    }
}
