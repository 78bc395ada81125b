// Kernels that exercise the emulator itself (tests/emulator.rs): barriers, shuffles, ballots,
// the tensor-core fragments, and the faults the emulator reports.
#include <ava/common.cuh>

// out[block] = Σ x over the block's slice, through block_sum (shuffles, shared memory, barriers).
extern "C" __global__ void block_sums(const float *x, float *out, int n) {
    __shared__ float scratch[32];
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const float s = block_sum(i < n ? x[i] : 0.0f, scratch);
    if (threadIdx.x == 0) out[blockIdx.x] = s;
}

// Per lane: its value from lane ^ 5, lane + 3 (down), lane - 2 (up), lane 7, and the ballot of
// odd values.
extern "C" __global__ void shuffles(const int *x, int *out) {
    const int v = x[threadIdx.x], l = threadIdx.x & 31;
    int *o = out + threadIdx.x * 5;
    o[0] = __shfl_xor_sync(0xffffffffu, v, 5);
    o[1] = __shfl_down_sync(0xffffffffu, v, 3);
    o[2] = __shfl_up_sync(0xffffffffu, v, 2);
    o[3] = __shfl_sync(0xffffffffu, v, 7);
    o[4] = (int)__ballot_sync(0xffffffffu, v & 1);
    (void)l;
}

// Each thread writes its index to shared memory and reads its neighbour's without a barrier
// between: the result depends on the order the threads run in.
extern "C" __global__ void racy(int *out) {
    __shared__ int cell[64];
    cell[threadIdx.x] = threadIdx.x;
    out[threadIdx.x] = cell[(threadIdx.x + 1) % blockDim.x];
}

// The same with the barrier: the same result in any order.
extern "C" __global__ void fenced(int *out) {
    __shared__ int cell[64];
    cell[threadIdx.x] = threadIdx.x;
    __syncthreads();
    out[threadIdx.x] = cell[(threadIdx.x + 1) % blockDim.x];
}

// Half of warp 0 waits at __syncthreads while its other half waits in a shuffle (threads that
// return count as arrived at a barrier, as on the device).
extern "C" __global__ void divergent(int *out) {
    if (threadIdx.x < 16) __syncthreads();
    else if (threadIdx.x < 32) out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 1);
    else __syncthreads();
}

// Lanes 16.. return before the warp's shuffle.
extern "C" __global__ void early_return(int *out) {
    if ((threadIdx.x & 31) >= 16) return;
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 1);
}

// One warp: D (16 × 8) = A (16 × 16) · B (16 × 8) with A row-major, B given as Bᵀ (8 × 16)
// row-major, both bf16 in shared memory loaded by ldmatrix (B's two 8 × 8 halves of k), and
// D stored row-major as f32. Also V (16 × 8, rows = k) loaded with .trans as B.
extern "C" __global__ void mma_tile(const bf16 *a, const bf16 *bt, const bf16 *v, float *d, float *dv) {
    AVA_DYNAMIC_SHARED(smem);
    bf16 *sa = reinterpret_cast<bf16 *>(smem);        // 16 × 16
    bf16 *sb = sa + 256;                              // 8 × 16
    bf16 *sv = sb + 128;                              // 16 × 8
    for (int i = threadIdx.x; i < 256; i += 32) sa[i] = a[i];
    for (int i = threadIdx.x; i < 128; i += 32) sb[i] = bt[i], sv[i] = v[i];
    __syncwarp();
    const int l = threadIdx.x;
    uint32_t fa[4], fb[4], fv[4];
    // A: matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15).
    ava_emu::ldmatrix_x4<false>(fa, sa + ((l % 8) + 8 * ((l / 8) % 2)) * 16 + 8 * (l / 16));
    // Bᵀ: matrices (n 0-7, k 0-7), (n 0-7, k 8-15), and the same twice more.
    ava_emu::ldmatrix_x4<false>(fb, sb + (l % 8) * 16 + 8 * ((l / 8) % 2));
    // V: matrices (k 0-7, n 0-7), (k 8-15, n 0-7), twice, transposed.
    ava_emu::ldmatrix_x4<true>(fv, sv + ((l % 8) + 8 * ((l / 8) % 2)) * 8);
    float acc[4] = {0, 0, 0, 0}, accv[4] = {0, 0, 0, 0};
    ava_emu::mma16816<bf16>(acc, fa, fb[0], fb[1]);
    ava_emu::mma16816<bf16>(accv, fa, fv[0], fv[1]);
    const int g = l / 4, t = l % 4;
    for (int i = 0; i < 4; ++i) {
        const int row = g + 8 * (i / 2), col = 2 * t + (i % 2);
        d[row * 8 + col] = acc[i];
        dv[row * 8 + col] = accv[i];
    }
}

// ldmatrix on an address outside shared memory.
extern "C" __global__ void ldmatrix_global(const bf16 *a) {
    uint32_t r[4];
    ava_emu::ldmatrix_x4<false>(r, a + (threadIdx.x % 8) * 8);
}

// Each warp writes its cells, then reads the other warp's after only a __syncwarp: in the
// lockstep order both warps have written by then, in the serial order the first warp to run
// reads cells nobody wrote yet.
extern "C" __global__ void cross_warp(int *out) {
    AVA_DYNAMIC_SHARED(smem);
    int *cell = reinterpret_cast<int *>(smem);
    cell[threadIdx.x] = threadIdx.x + 1000 * blockIdx.x;
    __syncwarp();
    out[blockIdx.x * 64 + threadIdx.x] = cell[(threadIdx.x + 32) % 64];
}

// The same with __syncthreads: one result in either order.
extern "C" __global__ void cross_warp_fenced(int *out) {
    AVA_DYNAMIC_SHARED(smem);
    int *cell = reinterpret_cast<int *>(smem);
    cell[threadIdx.x] = threadIdx.x + 1000 * blockIdx.x;
    __syncthreads();
    out[blockIdx.x * 64 + threadIdx.x] = cell[(threadIdx.x + 32) % 64];
}

// Reads a __shared__ static before writing it: what it sees is another block's leftovers.
extern "C" __global__ void stale_static(int *out) {
    __shared__ int cell[64];
    out[blockIdx.x * 64 + threadIdx.x] = cell[threadIdx.x];
    __syncthreads();
    cell[threadIdx.x] = blockIdx.x + 1;
}

// A block sum through `scratch` (32 floats), as common.cuh's block_sum, with or without the
// barrier before lane 0 writes: a second call must not overwrite scratch[0] before every warp
// has read the first call's result from it.
template <bool FENCED> __device__ float sum_of(float v, float *scratch) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if (FENCED) __syncthreads();
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

// Two rows of blockDim.x values summed one after the other; each thread writes both sums.
template <bool FENCED> __device__ void two_sums_of(const float *x, float *out) {
    __shared__ float scratch[32];
    const float a = sum_of<FENCED>(x[threadIdx.x], scratch);
    const float b = sum_of<FENCED>(x[blockDim.x + threadIdx.x], scratch);
    out[2 * threadIdx.x] = a;
    out[2 * threadIdx.x + 1] = b;
}
extern "C" __global__ void two_sums(const float *x, float *out) { two_sums_of<true>(x, out); }
extern "C" __global__ void two_sums_unfenced(const float *x, float *out) { two_sums_of<false>(x, out); }

// Half of a warp at __syncwarp while the other half shuffles: no warp operation they share.
extern "C" __global__ void mixed_warp_ops(int *out) {
    int v = threadIdx.x;
    if ((threadIdx.x & 31) < 16) {
        __syncwarp();
        v = __shfl_xor_sync(0xffffffffu, v, 1);
    } else {
        v = __shfl_xor_sync(0xffffffffu, v, 1);
        __syncwarp();
    }
    out[threadIdx.x] = v;
}

// A shuffle from lane + 16 in a block of 48 threads: warp 1's lanes 16.. do not exist.
extern "C" __global__ void partial_warp_shuffle(int *out) {
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 16);
}
