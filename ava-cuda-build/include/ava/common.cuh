// Device helpers every Ava kernel file shares (`#include <ava/common.cuh>`; ava-cuda-build
// puts this directory on nvcc's include path): loads that widen the stored type to f32,
// stores that round once to nearest (ties to even), block-wide reductions, and LLVM's powi.

#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;
typedef __half f16;

#ifndef AVA_EMULATE
// A kernel's dynamic shared memory, 128-byte aligned. The CPU emulator (ava-cuda-emu, which
// defines AVA_EMULATE) gives its own arena under the same name.
#define AVA_DYNAMIC_SHARED(name) extern __shared__ __align__(128) unsigned char name[]
#endif

__device__ __forceinline__ float load(float v) { return v; }
__device__ __forceinline__ float load(bf16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float load(f16 v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T store(float v);
template <> __device__ __forceinline__ float store<float>(float v) { return v; }
template <> __device__ __forceinline__ bf16 store<bf16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ f16 store<f16>(float v) { return __float2half_rn(v); }

// LLVM's powi (compiler-rt __powidf2), which Rust's f64::powi calls: the same products in the
// same order, so an optimizer's bias corrections match the CPU's to the bit (build with
// --fmad=false, as the optimizer kernels are).
__device__ inline double powi(double a, int b) {
    const bool recip = b < 0;
    double r = 1.0;
    while (true) {
        if (b & 1) r *= a;
        b /= 2;
        if (b == 0) break;
        a *= a;
    }
    return recip ? 1.0 / r : r;
}

// The sum of `v` over the block, returned to every thread. blockDim.x a multiple of 32, at
// most 1024; `scratch` holds 32 floats. Lanes and warps are added in a fixed order.
__device__ __forceinline__ float block_sum(float v, float *scratch) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    __syncthreads(); // the previous call's readers are done with scratch
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float s = lane < warps ? scratch[lane] : 0.0f;
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) scratch[0] = s;
    }
    __syncthreads();
    return scratch[0];
}

// The maximum of `v` over the block, returned to every thread (as block_sum).
__device__ __forceinline__ float block_max(float v, float *scratch) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float s = lane < warps ? scratch[lane] : -INFINITY;
        for (int o = 16; o > 0; o >>= 1) s = fmaxf(s, __shfl_xor_sync(0xffffffffu, s, o));
        if (lane == 0) scratch[0] = s;
    }
    __syncthreads();
    return scratch[0];
}

// The 32 lanes' values of a warp added in f64 in lane order (0 + lane 0 + lane 1 + … + lane
// 31), returned to every lane. All 32 lanes must call it. The CPU adds its 32 lane
// accumulators in the same order, so both give the same bits.
template <typename T> __device__ __forceinline__ double lanes_in_order(T v) {
    double sum = 0.0;
    for (int j = 0; j < 32; ++j) sum += (double)__shfl_sync(0xffffffffu, v, j);
    return sum;
}

// The sum of `len` f64 values, load(0) … load(len − 1), in one fixed 32-ary tree: groups of
// 32 consecutive values each added in index order from 0, then those sums grouped the same
// way, and so on up to one value (a short last group adds what it has; one value is itself).
// A level's groups are added in parallel by the block's threads. `a` holds ceil(len / 32)
// doubles, `b` ceil(len / 1024); levels alternate between them. Every thread of the block
// calls it and gets the sum. The optimizer plugins' CPU steps add the same tree (a running
// sum per level), so both give the same bits.
template <typename Load> __device__ double tree_sum(Load load, size_t len, double *a, double *b) {
    if (len == 0) return 0.0;
    if (len == 1) return load(0);
    size_t cur = (len + 31) / 32;
    for (size_t j = threadIdx.x; j < cur; j += blockDim.x) {
        double s = 0.0;
        for (size_t i = j * 32; i < j * 32 + 32 && i < len; ++i) s += load(i);
        a[j] = s;
    }
    __syncthreads();
    double *src = a, *dst = b;
    while (cur > 1) { // the same on every thread
        const size_t groups = (cur + 31) / 32;
        for (size_t j = threadIdx.x; j < groups; j += blockDim.x) {
            double s = 0.0;
            for (size_t i = j * 32; i < j * 32 + 32 && i < cur; ++i) s += src[i];
            dst[j] = s;
        }
        __syncthreads();
        double *t = src;
        src = dst;
        dst = t;
        cur = groups;
    }
    const double sum = src[0];
    __syncthreads(); // every thread has read it before a next call writes a or b
    return sum;
}
