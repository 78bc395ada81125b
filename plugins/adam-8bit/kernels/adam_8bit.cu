// Block-wise 8-bit AdamW on NVIDIA GPUs, for `step_cuda` in src/gpu.rs: the CPU step of
// src/lib.rs, src/kernel.rs and src/quant.rs, operation for operation, on the same state
// (u8 codes, one f32 absmax per block and moment, the u32 count, the f32 norm history), so
// that a step on the GPU gives the CPU's bits and a checkpoint moves between devices without
// changing the run.
//
// What makes the bits equal:
// - build.rs compiles this file with --fmad=false (no fused multiply-adds, in f32 or f64: the
//   CPU rounds every product) and nvcc's defaults: IEEE division and square root, no flush of
//   subnormals to zero, no fast math;
// - every expression is the CPU's, in its order (`Scalars::adam_8bit`, `Scalars::adam`,
//   `Scalars::new` in f64 with LLVM's powi);
// - decoding reads the map's own 256 values (passed in by the host from `QuantMap::values`);
// - encoding finds the code the CPU's lookup table finds (see `encode_signed` below and
//   `quant::tests::the_gpus_search_is_the_lookup_table`);
// - a block's absmax is a maximum, which does not depend on the order it is taken in;
// - the gradient's Σ g² (percentile clipping) is added in the one fixed order the CPU uses
//   too (`sum_of_squares` in src/lib.rs: sequential sums of 32, a 32-ary tree above them).
//
// One launch sequence per parameter, all on the host's stream:
//   adam8_count                           the parameter's step count t += 1 (saturating)
//   adam8_sumsq + adam8_clip              with percentile clipping only: Σ g², the history,
//                                         the clipping factor (into the plugin's scratch)
//   adam8_block_step_<PER> | adam8_full_step   the update (8-bit or fp32 moments)

#include <ava/common.cuh>
#include <math.h>
#include <stdint.h>

#define CODES 256
#define HISTORY 100
// The Σ g² tree's fan-in: each sum adds 32 values of the level below, in index order.
#define FAN 32
// Elements per adam8_sumsq block: three levels of the tree (32 · 32 · 32).
#define SUMSQ_SPAN 32768

// powi: LLVM's, from ava/common.cuh (the CPU's f64::powi, bit for bit).

// The step's constants from the updated count, as `Scalars::new` computes them: in f64, then
// rounded to f32 once each.
struct Scalars {
    float b1, b2, eps;
    float step_size, bc2_sqrt;  // the fp32 path: lr/bc1 and √bc2
    float step_bc2, eps_bc2;    // the 8-bit path: lr/bc1·√bc2 and ε·√bc2
    float decay;                // 1 − lr·λ
    float clip;                 // percentile clipping's factor on the gradient
};

__device__ Scalars scalars(unsigned int count, const float *clip, double lr, double wd, double beta1, double beta2,
                           double eps) {
    // The update number in i32, as the CPU's powi takes it.
    const int t = count > 0x7fffffffu ? 0x7fffffff : (int)count;
    const double bc2_sqrt = sqrt(1.0 - powi(beta2, t));
    Scalars s;
    s.b1 = (float)beta1;
    s.b2 = (float)beta2;
    s.eps = (float)eps;
    s.step_size = (float)(lr / (1.0 - powi(beta1, t)));
    s.bc2_sqrt = (float)bc2_sqrt;
    s.step_bc2 = (float)(lr / (1.0 - powi(beta1, t)) * bc2_sqrt);
    s.eps_bc2 = (float)(eps * bc2_sqrt);
    s.decay = (float)(1.0 - lr * wd);
    s.clip = clip ? *clip : 1.0f;
    return s;
}

// count[0] += 1, saturating (`step[0].saturating_add(1)`). Launch: grid (1), block (1).
extern "C" __global__ void adam8_count(unsigned int *count) {
    if (count[0] != 0xffffffffu) count[0] += 1;
}

// Σ g² in f64, the first three levels of the tree: block b adds elements
// [b·32768, (b + 1)·32768) and writes partial[b]. Level 1: each thread adds the squares of 32
// consecutive elements in order; level 2: 32 consecutive level-1 sums in order (one warp's);
// level 3: the block's 32 level-2 sums in order. Elements past n count as 0, which adds
// nothing (x + 0 = x for every sum here, none being −0), so ragged ends match the CPU's.
// Launch: grid (ceil(n / 32768)), block (256). g (n,) f32; partial (grid,) f64.
extern "C" __global__ void __launch_bounds__(256) adam8_sumsq(const float *__restrict__ g, size_t n, double *__restrict__ partial) {
    __shared__ float tile[8][FAN][FAN + 1]; // a warp's 1024 elements; +1: no bank conflicts
    __shared__ double level2[FAN];
    const unsigned int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const size_t base = (size_t)blockIdx.x * SUMSQ_SPAN;
    for (unsigned int round = 0; round < 4; ++round) {
        const unsigned int group = round * 8 + warp; // the level-2 group within the block
        const size_t start = base + (size_t)group * (FAN * FAN);
        // Coalesced: row k holds level-1 chunk k's 32 elements.
        for (unsigned int k = 0; k < FAN; ++k) {
            const size_t i = start + k * FAN + lane;
            tile[warp][k][lane] = i < n ? g[i] : 0.0f;
        }
        __syncwarp();
        double chunk = 0.0; // level 1: this lane's chunk
        for (unsigned int j = 0; j < FAN; ++j) {
            const double x = tile[warp][lane][j];
            chunk += x * x; // exact in f64: a 24-bit significand squared
        }
        double sum = 0.0; // level 2: the warp's chunks in lane order (every lane the same)
        for (unsigned int j = 0; j < FAN; ++j) sum += __shfl_sync(0xffffffffu, chunk, j);
        if (lane == 0) level2[group] = sum;
        __syncwarp(); // the tile is read before the next round overwrites it
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        double sum = 0.0; // level 3
        for (unsigned int j = 0; j < FAN; ++j) sum += level2[j];
        partial[blockIdx.x] = sum;
    }
}

// The rest of the tree over adam8_sumsq's `len` partial sums, then `percentile_scale`: the
// norm² into history[(t − 1) mod 100], the p-th percentile of the min(t, 100) recorded, and
// the factor √(limit / norm²) when the norm² is above it (else 1) written to *clip.
// scratch: the partials (len) and room for the next level (ceil(len / 32)); levels alternate
// between the two. Launch: grid (1), block (1024). history (100,) f32; count (1,) u32.
extern "C" __global__ void __launch_bounds__(1024) adam8_clip(double *__restrict__ scratch, size_t len, float *__restrict__ history,
                                      const unsigned int *__restrict__ count, unsigned int p, float *__restrict__ clip) {
    double *src = scratch, *dst = scratch + len;
    size_t cur = len;
    while (cur > 1) { // the same on every thread
        const size_t groups = (cur + FAN - 1) / FAN;
        for (size_t j = threadIdx.x; j < groups; j += blockDim.x) {
            double sum = 0.0;
            for (unsigned int k = 0; k < FAN; ++k) {
                const size_t i = j * FAN + k;
                if (i < cur) sum += src[i];
            }
            dst[j] = sum;
        }
        __syncthreads();
        double *t = src;
        src = dst;
        dst = t;
        cur = groups;
    }
    if (threadIdx.x != 0) return;
    const double norm2 = cur == 1 ? src[0] : 0.0;
    const unsigned int t = count[0]; // >= 1: adam8_count ran
    history[(t - 1) % HISTORY] = (float)norm2;
    const unsigned int seen = t < HISTORY ? t : HISTORY;
    // The recorded norms sorted by f32::total_cmp (insertion sort: the order is total, so any
    // sort gives the CPU's sequence).
    int key[HISTORY];
    for (unsigned int i = 0; i < seen; ++i) {
        const int b = __float_as_int(history[i]);
        const int k = b ^ (int)((unsigned int)(b >> 31) >> 1);
        unsigned int j = i;
        for (; j > 0 && key[j - 1] > k; --j) key[j] = key[j - 1];
        key[j] = k;
    }
    unsigned int at = p * seen / 100;
    if (at > seen - 1) at = seen - 1;
    const int k = key[at];
    const double limit = (double)__int_as_float(k ^ (int)((unsigned int)(k >> 31) >> 1));
    *clip = norm2 > limit && norm2 > 0.0 ? (float)sqrt(limit / norm2) : 1.0f;
}

// The fp32 path (tensors under min_8bit_size, names in fp32_state): `Scalars::adam`, which is
// adamw's arithmetic on the clipped gradient. After adam8_count (and adam8_clip with clipping;
// clip == NULL without).
// Launch: grid (ceil(n / 256)), block (256). w, g, m, v (n,) f32; count (1,) u32.
extern "C" __global__ void __launch_bounds__(256) adam8_full_step(float *__restrict__ w, const float *__restrict__ g, float *__restrict__ m,
                                           float *__restrict__ v, const unsigned int *__restrict__ count,
                                           const float *__restrict__ clip, size_t n, double lr, double wd,
                                           double beta1, double beta2, double eps) {
    __shared__ Scalars k;
    if (threadIdx.x == 0) k = scalars(count[0], clip, lr, wd, beta1, beta2, eps);
    __syncthreads();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float gi = g[i] * k.clip;
    const float mi = k.b1 * m[i] + (1.0f - k.b1) * gi;
    const float vi = k.b2 * v[i] + (1.0f - k.b2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    w[i] = w[i] * k.decay - k.step_size * mi / (sqrtf(vi) / k.bc2_sqrt + k.eps);
}

// The two maps' values, sorted (`QuantMap::values`): a code is an index. Passed by value.
struct Maps {
    float signed_values[CODES];
    float unsigned_values[CODES];
};

// How many of the 256 sorted `mids` are below a (a >= 0, not NaN): the branch-free binary
// search, 8 probes. The entries past the map's midpoints are +inf, never below a.
__device__ __forceinline__ unsigned int below(const float *mids, float a) {
    unsigned int lo = 0;
#pragma unroll
    for (unsigned int step = 128; step > 0; step >>= 1)
        if (mids[lo + step - 1] < a) lo += step;
    return lo;
}

// `QuantMap::encode` of the signed map. Its lookup table gives a non-negative |x| the code
// 128 + (how many midpoints between the non-negative values are below |x|): each bucket's
// entry is that count at the bucket's start, and its one comparison adds the midpoint inside
// the bucket, if any. Below the first bucket no midpoint lies (the smallest is 5e-7), above
// 1.0 every one does, and NaN, whose bits fall in the last bucket, takes the top code. A
// negative x takes the mirrored code 255 − c. mids[i] = ½(values[128 + i] + values[129 + i])
// for i < 127, +inf after.
__device__ __forceinline__ uint8_t encode_signed(const float *mids, float x) {
    const float a = fabsf(x);
    const unsigned int c = a != a ? 255u : 128u + below(mids, a);
    return (uint8_t)(x < 0.0f ? 255u - c : c);
}

// `QuantMap::encode` of the unsigned map: as encode_signed from code 0, and a negative x
// takes code 0 (the value 0). mids[i] = ½(values[i] + values[i + 1]) for i < 255, +inf after.
__device__ __forceinline__ uint8_t encode_unsigned(const float *mids, float x) {
    const float a = fabsf(x);
    const unsigned int c = a != a ? 255u : below(mids, a);
    return (uint8_t)(x < 0.0f ? 0u : c);
}

// The 8-bit path, one thread block per quantization block of `block` elements (the last may
// be shorter), after adam8_count (and adam8_clip with clipping; clip == NULL without):
//   m = signed[m_code]·absmax_m, v = unsigned[v_code]·absmax_v        dequantize
//   `Scalars::adam_8bit`: the moments, then θ                        fp32 Adam
//   absmax_m = max |m|, absmax_v = max v over the block              new maxima
//   codes of m·(1/absmax_m) and v·(1/absmax_v) (0 below f32's normal range)   requantize
// PER elements a thread (block = PER · blockDim.x), kept in registers in between: one kernel
// per PER (adam8_block_step_<PER> below), so the default block of 256 (PER 1) does not hold
// the registers of 4096 (PER 16).
template <unsigned int PER>
__device__ __forceinline__ void block_step(float *__restrict__ w, const float *__restrict__ g,
                                           uint8_t *__restrict__ m_codes, uint8_t *__restrict__ v_codes,
                                           float *__restrict__ absmax_m, float *__restrict__ absmax_v,
                                           const unsigned int *__restrict__ count, const float *__restrict__ clip,
                                           size_t n, unsigned int block, double lr, double wd, double beta1,
                                           double beta2, double eps, const Maps &maps) {
    __shared__ float s_values[CODES], u_values[CODES]; // decode: code → value
    __shared__ float s_mids[CODES], u_mids[CODES];     // encode: the midpoints, searched
    __shared__ float scratch[32];                      // block_max
    __shared__ Scalars k;
    const unsigned int tid = threadIdx.x, threads = blockDim.x;
    for (unsigned int i = tid; i < CODES; i += threads) {
        s_values[i] = maps.signed_values[i];
        u_values[i] = maps.unsigned_values[i];
    }
    if (tid == 0) k = scalars(count[0], clip, lr, wd, beta1, beta2, eps);
    __syncthreads();
    for (unsigned int i = tid; i < CODES; i += threads) {
        // As `QuantMap::from_values`: 0.5 · (values[c] + values[c + 1]) in f32.
        s_mids[i] = i < 127 ? 0.5f * (s_values[128 + i] + s_values[129 + i]) : INFINITY;
        u_mids[i] = i < 255 ? 0.5f * (u_values[i] + u_values[i + 1]) : INFINITY;
    }
    const size_t start = (size_t)blockIdx.x * block;
    const size_t rest = n - start;
    const unsigned int len = rest < block ? (unsigned int)rest : block;
    const float am = absmax_m[blockIdx.x], av = absmax_v[blockIdx.x];
    float ms[PER], vs[PER];           // this thread's new moments (registers)
    float max_m = 0.0f, max_v = 0.0f; // as the CPU's fold, from 0
#pragma unroll
    for (unsigned int e = 0; e < PER; ++e) {
        const unsigned int j = tid + e * threads;
        if (j < len) {
            const size_t i = start + j;
            // `Scalars::adam_8bit(w, g, signed.decode(mc) * am, unsigned.decode(vc) * av)`
            const float m_old = s_values[m_codes[i]] * am;
            const float v_old = u_values[v_codes[i]] * av;
            const float gi = g[i] * k.clip;
            const float m = k.b1 * m_old + (1.0f - k.b1) * gi;
            const float v = k.b2 * v_old + (1.0f - k.b2) * gi * gi;
            w[i] = w[i] * k.decay - k.step_bc2 * m / (sqrtf(v) + k.eps_bc2);
            ms[e] = m;
            vs[e] = v;
            // f32::max: a NaN is passed over (see src/gpu.rs on NaN gradients).
            max_m = fmaxf(max_m, fabsf(m));
            max_v = fmaxf(max_v, v);
        }
    }
    // Every thread has read am and av (block_max synchronizes) before thread 0 stores.
    max_m = block_max(max_m, scratch);
    max_v = block_max(max_v, scratch);
    if (tid == 0) {
        absmax_m[blockIdx.x] = max_m;
        absmax_v[blockIdx.x] = max_v;
    }
    // Below the normal range 1/max overflows; such a block is stored as zeros.
    const float inv_m = max_m >= 1.17549435e-38f ? 1.0f / max_m : 0.0f;
    const float inv_v = max_v >= 1.17549435e-38f ? 1.0f / max_v : 0.0f;
#pragma unroll
    for (unsigned int e = 0; e < PER; ++e) {
        const unsigned int j = tid + e * threads;
        if (j < len) {
            const size_t i = start + j;
            m_codes[i] = encode_signed(s_mids, ms[e] * inv_m);
            v_codes[i] = encode_unsigned(u_mids, vs[e] * inv_v);
        }
    }
}

// Launch: grid (ceil(n / block)), block (min(block, 256)), with PER = block / min(block, 256)
// in the name: adam8_block_step_1 for blocks of 64 to 256, _2, _4, _8, _16 for 512 to 4096.
// w, g (n,) f32; m_codes, v_codes (n,) u8; absmax_m, absmax_v (grid,) f32; count (1,) u32;
// clip NULL or one f32.
#define BLOCK_STEP(PER)                                                                                              \
    extern "C" __global__ void __launch_bounds__(256) adam8_block_step_##PER(                                        \
        float *__restrict__ w, const float *__restrict__ g, uint8_t *__restrict__ m_codes,                           \
        uint8_t *__restrict__ v_codes, float *__restrict__ absmax_m, float *__restrict__ absmax_v,                   \
        const unsigned int *__restrict__ count, const float *__restrict__ clip, size_t n, unsigned int block,       \
        double lr, double wd, double beta1, double beta2, double eps, Maps maps) {                                   \
        block_step<PER>(w, g, m_codes, v_codes, absmax_m, absmax_v, count, clip, n, block, lr, wd, beta1, beta2, eps, \
                        maps);                                                                                       \
    }
BLOCK_STEP(1)
BLOCK_STEP(2)
BLOCK_STEP(4)
BLOCK_STEP(8)
BLOCK_STEP(16) // MAX_BLOCK (4096) over 256 threads
