// Adam-mini on NVIDIA GPUs, for `step_cuda` in src/gpu.rs: the CPU step of src/lib.rs,
// operation for operation, on the same state (the f32 first moment, one f32 second moment per
// block, the u32 count), so that a step on the GPU gives the CPU's bits and a checkpoint moves
// between devices without changing the run.
//
// What makes the bits equal:
// - build.rs compiles this file with --fmad=false (no fused multiply-adds, in f32 or f64: the
//   CPU rounds every product) and nvcc's defaults: IEEE division and square root, no flush of
//   subnormals to zero, no fast math;
// - every expression is the CPU's, in its order, in the same type; the bias corrections use
//   LLVM's powi (ava/common.cuh), as Rust's f64::powi;
// - a block's Σ g² is added in the CPU's order (`sum_sq`): chunks of 1024 elements, a chunk in
//   32 strided f64 lanes (one warp's) added in lane order, the chunks in the 32-ary tree
//   (`tree_sum`, ava/common.cuh).
//
// The launches, per parameter, all on the host's stream:
//   adam_mini_count                      the parameter's step count t += 1 (saturating)
//   blocks of one element (`adam_names`, or a one-column matrix): adam_mini_adam (AdamW)
//   larger blocks:
//     adam_mini_chunks                   each chunk's Σ g² (into the plugin's scratch)
//     adam_mini_blocks                   per block: the tree, v, and the block's step scale
//     adam_mini_update                   m and θ

#include <ava/common.cuh>
#include <math.h>
#include <stdint.h>

// Elements per chunk of a block's Σ g² (`CHUNK` in src/lib.rs).
#define CHUNK 1024
// Warps (chunks) per block of adam_mini_chunks.
#define WARPS 8

// The bias corrections from the updated count, in f64 as the CPU step computes them: lr/bc1
// and √bc2, with the count as an i32 (`i32::try_from(t).unwrap_or(i32::MAX)`).
struct Corrections {
    double step_size, bc2_sqrt;
};

__device__ Corrections corrections(unsigned int count, double lr, double beta1, double beta2) {
    const int t = count > 0x7fffffffu ? 0x7fffffff : (int)count;
    Corrections c;
    c.step_size = lr / (1.0 - powi(beta1, t));
    c.bc2_sqrt = sqrt(1.0 - powi(beta2, t));
    return c;
}

// count[0] += 1, saturating (`t[0].saturating_add(1)`). Launch: grid (1), block (1).
extern "C" __global__ void adam_mini_count(unsigned int *count) {
    if (count[0] != 0xffffffffu) count[0] += 1;
}

// Blocks of one element: AdamW in the CPU's f32 arithmetic (lr/bc1 and √bc2 rounded to f32),
// after adam_mini_count. Launch: grid (ceil(n / 256)), block (256). w, g, m, v (n,) f32;
// count (1,) u32.
extern "C" __global__ void __launch_bounds__(256)
    adam_mini_adam(float *__restrict__ w, const float *__restrict__ g, float *__restrict__ m, float *__restrict__ v,
                   const unsigned int *__restrict__ count, size_t n, double lr, double beta1, double beta2,
                   double eps, float decay) {
    __shared__ float s_step, s_bc2;
    if (threadIdx.x == 0) {
        const Corrections c = corrections(count[0], lr, beta1, beta2);
        s_step = (float)c.step_size;
        s_bc2 = (float)c.bc2_sqrt;
    }
    __syncthreads();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float b1 = (float)beta1, b2 = (float)beta2, e = (float)eps;
    const float gi = g[i];
    const float mi = b1 * m[i] + (1.0f - b1) * gi;
    const float vi = b2 * v[i] + (1.0f - b2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    w[i] = w[i] * decay - s_step * mi / (sqrtf(vi) / s_bc2 + e);
}

// Each chunk's Σ g² (`sum_sq`'s leaves): a warp per chunk of 1024 elements of a block (the
// last chunk of a block may be shorter); lane k adds the squares of elements k, k + 32, … in
// f64, in order; the lanes in lane order. Chunk c of block b into sums[b·chunks + c].
// Launch: grid (ceil(blocks·chunks / 8)), block (256). g (blocks·size,) f32; sums
// (blocks·chunks,) f64.
extern "C" __global__ void __launch_bounds__(256)
    adam_mini_chunks(const float *__restrict__ g, double *__restrict__ sums, size_t size, size_t chunks,
                     size_t total) {
    const unsigned int lane = threadIdx.x & 31;
    const size_t q = (size_t)blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (q >= total) return; // the whole warp
    const size_t b = q / chunks, c = q % chunks;
    const size_t len = size - c * CHUNK < CHUNK ? size - c * CHUNK : CHUNK;
    const float *x = g + b * size + c * CHUNK;
    double acc = 0.0;
    for (size_t j = lane; j < len; j += 32) {
        const double xj = (double)x[j];
        acc += xj * xj;
    }
    const double s = lanes_in_order(acc);
    if (lane == 0) sums[q] = s;
}

// Per block b: Σ g² as the tree over its chunks' sums, then v_b ← β2·v_b + (1 − β2)·Σ/size in
// f64, rounded to f32, and the block's scale (lr/bc1)/(√v_b/√bc2 + ε) in f64, rounded to f32.
// After adam_mini_count and adam_mini_chunks.
// Launch: grid (blocks), block (32, or 256 above 1024 chunks a block). sums (blocks·chunks,)
// f64; ta (blocks·ceil(chunks / 32),) and tb (blocks·ceil(chunks / 1024),) f64 for the trees;
// v, scales (blocks,) f32; count (1,) u32.
extern "C" __global__ void __launch_bounds__(256)
    adam_mini_blocks(const double *__restrict__ sums, double *__restrict__ ta, double *__restrict__ tb,
                     float *__restrict__ v, float *__restrict__ scales, const unsigned int *__restrict__ count,
                     size_t size, size_t chunks, double lr, double beta1, double beta2, double eps) {
    const size_t b = blockIdx.x;
    const size_t na = (chunks + 31) / 32, nb = (chunks + 1023) / 1024;
    const double *s = sums + b * chunks;
    const double sum = tree_sum([&](size_t i) { return s[i]; }, chunks, ta + b * na, tb + b * nb);
    if (threadIdx.x != 0) return;
    const Corrections c = corrections(count[0], lr, beta1, beta2);
    const double mean = sum / (double)size;
    const float vb = (float)(beta2 * (double)v[b] + (1.0 - beta2) * mean);
    v[b] = vb;
    scales[b] = (float)(c.step_size / (sqrt((double)vb) / c.bc2_sqrt + eps));
}

// m ← β1·m + (1 − β1)·g, θ ← θ·decay − scale_b·m, with scale_b its block's (adam_mini_blocks).
// Launch: grid (ceil(n / 256)), block (256). w, g, m (n,) f32; scales (n / size,) f32.
extern "C" __global__ void __launch_bounds__(256)
    adam_mini_update(float *__restrict__ w, const float *__restrict__ g, float *__restrict__ m,
                     const float *__restrict__ scales, size_t n, size_t size, float b1, float decay) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float mi = b1 * m[i] + (1.0f - b1) * g[i];
    m[i] = mi;
    w[i] = w[i] * decay - scales[i / size] * mi;
}
