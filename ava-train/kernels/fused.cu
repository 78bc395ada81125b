// The engine's fused ops on NVIDIA GPUs: the same math as the CPU ops in
// ava-train/src/model/fused/ (and the cross-entropy of model/ops.rs, the stochastic rounding of
// train/rounding.rs), one kernel per fused step, each with its launch shape beside it.
//
// Built to PTX by ava-train's build script (nvcc --ptx, `cuda` feature only) and loaded through
// src/model/fused/cuda.rs; each op's kernels are launched beside the op (src/model/fused/
// norm/cuda.rs, swiglu/, rope/, embedding/), the rest from fused/cuda.rs itself. Values are
// read in their stored type (f32, bf16 or f16), computed in f32 and rounded once when
// written, as on the CPU.
// Reductions that feed a weight's gradient add per-block partial sums in a fixed order
// (deterministic: no atomics).

#include <ava/common.cuh>

// ---- RMSNorm: y = x · r · w, r = 1 / sqrt(mean(x²) + ε) per row ----

template <typename T> __device__ float inv_rms(const T *__restrict__ x, int d, float eps, float *scratch) {
    float ss = 0.0f;
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        const float v = load(x[j]);
        ss += v * v;
    }
    ss = block_sum(ss, scratch);
    return 1.0f / sqrtf(ss / (float)d + eps);
}

// Launch: grid (rows), block (NORM_THREADS = 256). x, y (rows, d); w (d,).
template <typename T>
__device__ void rms_norm_fwd(const T *__restrict__ x, const T *__restrict__ w, T *__restrict__ y, int d, float eps) {
    __shared__ float scratch[32];
    const size_t row = blockIdx.x;
    const T *xr = x + row * d;
    T *yr = y + row * d;
    const float r = inv_rms(xr, d, eps, scratch);
    for (int j = threadIdx.x; j < d; j += blockDim.x) yr[j] = store<T>(load(xr[j]) * r * load(w[j]));
}

// Columns of a row one thread of RMSNorm's backward holds in registers: rows of up to
// NORM_BWD_COLS · 1024 elements (the launcher picks the block's width from d).
#define NORM_BWD_COLS 8

// Σ of two values over the block, returned to every thread (block_sum for a pair: one
// round of barriers for both).
__device__ __forceinline__ float2 block_sum2(float2 v, float2 *scratch) {
    for (int o = 16; o > 0; o >>= 1) {
        v.x += __shfl_xor_sync(0xffffffffu, v.x, o);
        v.y += __shfl_xor_sync(0xffffffffu, v.y, o);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    __syncthreads(); // the previous call's readers are done with scratch
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float2 s = lane < warps ? scratch[lane] : make_float2(0.0f, 0.0f);
        for (int o = 16; o > 0; o >>= 1) {
            s.x += __shfl_xor_sync(0xffffffffu, s.x, o);
            s.y += __shfl_xor_sync(0xffffffffu, s.y, o);
        }
        if (lane == 0) scratch[0] = s;
    }
    __syncthreads();
    return scratch[0];
}

// dx = r·(g∘w) − x·r³·Σ(g∘w∘x)/d for each row; this block's share of dw = Σ_rows g∘x·r
// written to partial[blockIdx.x] (f32), later added in block order by `column_sums`.
// Each thread owns the columns j = threadIdx.x + k·blockDim.x (k < NORM_BWD_COLS): it reads
// a row's x and g once into registers, both sums of the row (Σx² for r, Σ g∘w∘x) take one
// block reduction, and its share of dw stays in registers until the block's rows are done
// (no atomics: the sums' order is fixed, so the bits are the same every run).
// Launch: grid (ceil(rows / rows_per_block)), block (a multiple of 32, at least
// ceil(d / NORM_BWD_COLS), at most 1024: the entry point's __launch_bounds__(1024) keeps its
// registers under 64 a thread, or a 1024-thread block would not fit an SM's register file).
// x, g, dx (rows, d); w (d,); partial (gridDim.x, d) f32.
template <typename T>
__device__ void rms_norm_bwd(const T *__restrict__ x, const T *__restrict__ w, const T *__restrict__ g,
                             T *__restrict__ dx, float *__restrict__ partial, int rows, int d, float eps,
                             int rows_per_block) {
    __shared__ float2 scratch[32];
    const int t = threadIdx.x, nt = blockDim.x;
    const int first = blockIdx.x * rows_per_block;
    const int last = min(rows, first + rows_per_block);
    const float inv_d = 1.0f / (float)d;
    float xv[NORM_BWD_COLS], gv[NORM_BWD_COLS], acc[NORM_BWD_COLS];
#pragma unroll
    for (int k = 0; k < NORM_BWD_COLS; k++) acc[k] = 0.0f;
    for (int row = first; row < last; row++) {
        const T *xr = x + (size_t)row * d;
        const T *gr = g + (size_t)row * d;
        T *dr = dx + (size_t)row * d;
        float2 sums = make_float2(0.0f, 0.0f); // (Σ x², Σ g∘w∘x) of this thread's columns
#pragma unroll
        for (int k = 0; k < NORM_BWD_COLS; k++) {
            const int j = t + k * nt;
            xv[k] = j < d ? load(xr[j]) : 0.0f;
            gv[k] = j < d ? load(gr[j]) : 0.0f;
            const float wj = j < d ? load(w[j]) : 0.0f;
            sums.x += xv[k] * xv[k];
            sums.y += gv[k] * wj * xv[k];
        }
        sums = block_sum2(sums, scratch);
        const float r = 1.0f / sqrtf(sums.x * inv_d + eps);
        const float c = r * r * r * sums.y * inv_d;
#pragma unroll
        for (int k = 0; k < NORM_BWD_COLS; k++) {
            const int j = t + k * nt;
            if (j < d) {
                dr[j] = store<T>(r * gv[k] * load(w[j]) - xv[k] * c);
                acc[k] += gv[k] * xv[k] * r;
            }
        }
    }
    float *part = partial + (size_t)blockIdx.x * d;
#pragma unroll
    for (int k = 0; k < NORM_BWD_COLS; k++) {
        const int j = t + k * nt;
        if (j < d) part[j] = acc[k];
    }
}

// out[j] = Σ_b partial[b][j], added in b order, rounded once.
// Launch: grid (ceil(d / 256)), block (256). partial (blocks, d) f32; out (d,).
template <typename T> __device__ void column_sums(const float *__restrict__ partial, T *__restrict__ out, int blocks, int d) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= d) return;
    float s = 0.0f;
    for (int b = 0; b < blocks; b++) s += partial[(size_t)b * d + j];
    out[j] = store<T>(s);
}

// ---- SwiGLU gate: h = silu(g) ∘ u; with s = σ(g): dg = dh∘u∘s∘(1 + g(1 − s)), du = dh∘g∘s ----

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// Launch: grid (ceil(n / 256)), block (256), one element a thread. g, u, h (n,).
template <typename T> __device__ void swiglu_fwd(const T *__restrict__ g, const T *__restrict__ u, T *__restrict__ h, size_t n) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float gv = load(g[i]);
    h[i] = store<T>(gv * sigmoid(gv) * load(u[i]));
}

// Launch: as swiglu_fwd. g, u, dh, dg, du (n,).
template <typename T>
__device__ void swiglu_bwd(const T *__restrict__ g, const T *__restrict__ u, const T *__restrict__ dh, T *__restrict__ dg,
                           T *__restrict__ du, size_t n) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float gv = load(g[i]), uv = load(u[i]), d = load(dh[i]);
    const float s = sigmoid(gv);
    dg[i] = store<T>(d * uv * s * (1.0f + gv * (1.0f - s)));
    du[i] = store<T>(d * gv * s);
}

// ---- heads: split (B·T, C·D) → (B, C, T, D) with the rotary embedding, and merge back ----
//
// Rotate-half layout: element j of a head row pairs with j + D/2. Forward (transposed = 0):
// (a, b) → (a·cos₁ − b·sin₁, b·cos₂ + a·sin₂); backward (transposed = 1) applies the transposed
// rotation: (a, b) → (a·cos₁ + b·sin₂, b·cos₂ − a·sin₁). cos and sin are the tables (P, D) in
// f32, row `pos` for token (b, t), pos = positions[b·T + t] when given (packed documents,
// generation), else t. Without tables (cos == NULL) the rows are copied.
//
// Launch: grid (ceil(B·C·T·W / 256)), block (256), one thread per (head row, w) with
// W = D/2 when rotating (the thread writes both halves' element) or D when copying.
template <typename T>
__device__ void heads(const T *__restrict__ src, T *__restrict__ dst, const float *__restrict__ cos,
                      const float *__restrict__ sin, const unsigned int *__restrict__ positions, int B, int C, int Tn,
                      int D, int merge, int transposed) {
    const int W = cos ? D / 2 : D;
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)B * C * Tn * W) return;
    const int w = (int)(i % W);
    const size_t head_row = i / W; // the row's index in (B, C, T) order
    const int t = (int)(head_row % Tn);
    const int c = (int)((head_row / Tn) % C);
    const int b = (int)(head_row / ((size_t)Tn * C));
    const size_t split_row = ((size_t)b * C + c) * Tn + t; // in (B, C, T, D)
    const size_t token_row = ((size_t)b * Tn + t) * C + c; // in (B, T, C, D)
    const size_t s0 = (merge ? split_row : token_row) * D;
    const size_t d0 = (merge ? token_row : split_row) * D;
    if (!cos) {
        dst[d0 + w] = src[s0 + w];
        return;
    }
    const int h = D / 2;
    const size_t pos = positions ? positions[(size_t)b * Tn + t] : (size_t)t;
    const float *cr = cos + pos * D, *sr = sin + pos * D;
    const float a = load(src[s0 + w]), bv = load(src[s0 + h + w]);
    if (transposed) {
        dst[d0 + w] = store<T>(a * cr[w] + bv * sr[h + w]);
        dst[d0 + h + w] = store<T>(bv * cr[h + w] - a * sr[w]);
    } else {
        dst[d0 + w] = store<T>(a * cr[w] - bv * sr[w]);
        dst[d0 + h + w] = store<T>(bv * cr[h + w] + a * sr[h + w]);
    }
}

// ---- cross-entropy per row: loss = logsumexp(x) − x[target], computed in f32 ----

// Launch: grid (rows), block (CE_THREADS = 256). logits (rows, V); targets, loss (rows,).
template <typename T>
__device__ void cross_entropy_fwd(const T *__restrict__ logits, const unsigned int *__restrict__ targets,
                                  float *__restrict__ loss, int V) {
    __shared__ float scratch[32];
    const size_t row = blockIdx.x;
    const T *x = logits + row * V;
    float m = -INFINITY;
    for (int j = threadIdx.x; j < V; j += blockDim.x) m = fmaxf(m, load(x[j]));
    m = block_max(m, scratch);
    float s = 0.0f;
    for (int j = threadIdx.x; j < V; j += blockDim.x) s += expf(load(x[j]) - m);
    s = block_sum(s, scratch);
    if (threadIdx.x == 0) loss[row] = m + logf(s) - load(x[targets[row]]);
}

// grad = (softmax(x) − onehot(target)) · grad_loss[row], in the logits' type.
// Launch: as cross_entropy_fwd. logits, grad (rows, V); targets, grad_loss (rows,).
template <typename T>
__device__ void cross_entropy_bwd(const T *__restrict__ logits, const unsigned int *__restrict__ targets,
                                  const float *__restrict__ grad_loss, T *__restrict__ grad, int V) {
    __shared__ float scratch[32];
    const size_t row = blockIdx.x;
    const T *x = logits + row * V;
    T *gr = grad + row * V;
    float m = -INFINITY;
    for (int j = threadIdx.x; j < V; j += blockDim.x) m = fmaxf(m, load(x[j]));
    m = block_max(m, scratch);
    float s = 0.0f;
    for (int j = threadIdx.x; j < V; j += blockDim.x) s += expf(load(x[j]) - m);
    s = block_sum(s, scratch);
    const float lse = logf(s);
    const float scale = grad_loss[row];
    const unsigned int target = targets[row];
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        float v = expf(load(x[j]) - m - lse) * scale;
        if ((unsigned int)j == target) v -= scale;
        gr[j] = store<T>(v);
    }
}

// ---- the token embedding's backward: each table row the sum of its tokens' gradient rows ----

// dw[t] = Σ g[p] over the positions p of token t, in ascending p, summed in f32 and rounded
// once; zero for a token that does not occur. The host sorted the positions by token:
// token t's are order[offsets[t] .. offsets[t + 1]]. Each block owns one table row and each
// thread its columns, so no two threads write one element (no atomics: the bits are the CPU
// op's, which adds in the same order).
// Launch: grid (V), block (EMBED_THREADS = 256, fewer for narrow rows). g (N, d);
// offsets (V + 1,), order (N,) u32; dw (V, d).
template <typename T>
__device__ void embedding_bwd(const T *__restrict__ g, const unsigned int *__restrict__ offsets,
                              const unsigned int *__restrict__ order, T *__restrict__ dw, int d) {
    const size_t t = blockIdx.x;
    const unsigned int first = offsets[t], last = offsets[t + 1];
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        float s = 0.0f;
        for (unsigned int k = first; k < last; k++) s += load(g[(size_t)order[k] * d + j]);
        dw[t * d + j] = store<T>(s);
    }
}

// ---- stochastic rounding of f32 into bf16/f16, bits from (seed, index) as on the CPU ----

__device__ __forceinline__ unsigned long long mix(unsigned long long z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ unsigned int random16(unsigned long long seed, size_t j) {
    const unsigned long long bits = mix(seed ^ ((unsigned long long)(j / 4) * 0xd1b54a32d192ed03ull));
    return (unsigned int)((bits >> (16 * (j % 4))) & 0xffffu);
}

// Launch: grid (ceil(n / 256)), block (256). x (n,) f32; out (n,).
extern "C" __global__ void round_stochastic_bf16(const float *__restrict__ x, bf16 *__restrict__ out, size_t n,
                                                 unsigned long long seed) {
    const size_t j = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= n) return;
    const float v = x[j];
    if (!isfinite(v)) {
        out[j] = __float2bfloat16_rn(v);
        return;
    }
    // bf16 is the top half of an f32: 16 random bits added below the cut carry into the kept
    // half with probability (the dropped bits) / 2¹⁶, then truncation.
    const unsigned int b = (__float_as_uint(v) + random16(seed, j)) >> 16;
    out[j] = __ushort_as_bfloat16((unsigned short)b);
}

// The f16 bit pattern one step towards +∞ (`up`) or −∞ from `h` (finite).
__device__ __forceinline__ unsigned short next_bits(unsigned short h, bool up) {
    const bool negative = (h & 0x8000u) != 0;
    if ((h & 0x7fffu) == 0) return up ? 0x0001u : 0x8001u;
    return (up != negative) ? (unsigned short)(h + 1) : (unsigned short)(h - 1);
}

// Launch: as round_stochastic_bf16.
extern "C" __global__ void round_stochastic_f16(const float *__restrict__ x, f16 *__restrict__ out, size_t n,
                                                unsigned long long seed) {
    const size_t j = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= n) return;
    const float v = x[j];
    const f16 near = __float2half_rn(v);
    const float nf = __half2float(near);
    if (!isfinite(nf) || nf == v) {
        out[j] = near;
        return;
    }
    const f16 other = __ushort_as_half(next_bits(__half_as_ushort(near), v > nf));
    const float of = __half2float(other);
    const float lo = v > nf ? nf : of, hi = v > nf ? of : nf;
    if (!isfinite(hi)) {
        out[j] = near;
        return;
    }
    const double p_up = (double)((v - lo) / (hi - lo));
    const bool up = ((double)random16(seed, j) + 0.5) / 65536.0 < p_up;
    const float pick = up ? hi : lo;
    out[j] = pick == nf ? near : other;
}

// x (an f32 master) rounded to the nearest half value, ties to even (`store`, the CPU's
// `rounding::round_nearest`): the resident copy of `master_weights: tier`.
// Launch: grid (ceil(n / 256)), block (256). x (n,) f32; out (n,).
template <typename T> __device__ void round_nearest(const float *__restrict__ x, T *__restrict__ out, size_t n) {
    const size_t j = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j < n) out[j] = store<T>(x[j]);
}

// x widened to f32 (a half parameter's values, for the optimizer's f32 step).
// Launch: grid (ceil(n / 256)), block (256). x, out (n,).
template <typename T> __device__ void widen(const T *__restrict__ x, float *__restrict__ out, size_t n) {
    const size_t j = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j < n) out[j] = load(x[j]);
}

// Launch: as round_nearest. x (n,) f32; out (n,) bf16.
extern "C" __global__ void round_nearest_bf16(const float *x, bf16 *out, size_t n) { round_nearest<bf16>(x, out, n); }

// Launch: as round_nearest. x (n,) f32; out (n,) f16.
extern "C" __global__ void round_nearest_f16(const float *x, f16 *out, size_t n) { round_nearest<f16>(x, out, n); }

// Launch: as widen. x (n,) bf16; out (n,) f32.
extern "C" __global__ void widen_bf16(const bf16 *x, float *out, size_t n) { widen<bf16>(x, out, n); }

// Launch: as widen. x (n,) f16; out (n,) f32.
extern "C" __global__ void widen_f16(const f16 *x, float *out, size_t n) { widen<f16>(x, out, n); }

// ---- Kahan-compensated weights (`master_weights: kahan`), as train/rounding.rs on the CPU ----
//
// A parameter is stored as h (its half values) and c (what rounding h lost, itself rounded,
// in the same half type). The step widens h + c into an f32 scratch, the optimizer steps the
// scratch, and x, the result, is stored back as h = nearest(x) and c = nearest(x − h): both
// roundings to nearest, ties to even (`store`, as the CPU's `half` from_f32), and x − h is
// exact in f32, so both devices keep the same bits. Plain adds: no multiply for the
// compiler to fuse.

// out[j] = h[j] + c[j] in f32 (`rounding::widen` with a compensation).
// Launch: grid (ceil(n / 256)), block (256). h, c (n,); out (n,) f32.
template <typename T>
__device__ void widen_compensated(const T *__restrict__ h, const T *__restrict__ c, float *__restrict__ out, size_t n) {
    const size_t j = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j < n) out[j] = load(h[j]) + load(c[j]);
}

// h[j] = nearest(x[j]), c[j] = nearest(x[j] − h[j]) (`rounding::round_compensated`).
// Launch: grid (ceil(n / 256)), block (256). x (n,) f32; h, c (n,).
template <typename T>
__device__ void round_compensated(const float *__restrict__ x, T *__restrict__ h, T *__restrict__ c, size_t n) {
    const size_t j = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= n) return;
    const float v = x[j];
    const T near = store<T>(v);
    h[j] = near;
    c[j] = store<T>(v - load(near));
}

// Launch: as widen_compensated. h, c (n,) bf16; out (n,) f32.
extern "C" __global__ void widen_compensated_bf16(const bf16 *h, const bf16 *c, float *out, size_t n) {
    widen_compensated<bf16>(h, c, out, n);
}

// Launch: as widen_compensated. h, c (n,) f16; out (n,) f32.
extern "C" __global__ void widen_compensated_f16(const f16 *h, const f16 *c, float *out, size_t n) {
    widen_compensated<f16>(h, c, out, n);
}

// Launch: as round_compensated. x (n,) f32; h, c (n,) bf16.
extern "C" __global__ void round_compensated_bf16(const float *x, bf16 *h, bf16 *c, size_t n) {
    round_compensated<bf16>(x, h, c, n);
}

// Launch: as round_compensated. x (n,) f32; h, c (n,) f16.
extern "C" __global__ void round_compensated_f16(const float *x, f16 *h, f16 *c, size_t n) {
    round_compensated<f16>(x, h, c, n);
}

// ---- Σ x² of each of many tensors (a step's gradient norm): blocks a tensor, then one, in a fixed order ----

// Block `b` of `blocks`' share of Σ x² over x (n,) (elements strided over the blocks), in
// every thread of the block.
template <typename T>
__device__ float sumsq_share(const T *__restrict__ x, size_t n, unsigned int b, unsigned int blocks, float *scratch) {
    float s = 0.0f;
    for (size_t i = (size_t)b * blockDim.x + threadIdx.x; i < n; i += (size_t)blocks * blockDim.x) {
        const float v = load(x[i]);
        s += v * v;
    }
    return block_sum(s, scratch);
}

// Each block's share of Σ x² for many tensors in one launch (a step's gradients): tensor i
// (at ptrs[i], lens[i] elements) owns the blocks first[i] .. first[i + 1] (one per 256
// elements, at most SUMSQ_BLOCKS, at least one) and strides its elements over them, so a
// tensor's partial sums do not depend on the others in the launch. Each block finds its
// tensor by a binary search of `first`.
// Launch: grid (first[tensors]), block (256). ptrs, lens (tensors,) u64; first (tensors + 1,)
// u32; partial (first[tensors],) f32.
template <typename T>
__device__ void sumsq_many_partial(const unsigned long long *__restrict__ ptrs, const unsigned long long *__restrict__ lens,
                                   const unsigned int *__restrict__ first, int tensors, float *__restrict__ partial) {
    __shared__ float scratch[32];
    const unsigned int b = blockIdx.x;
    int lo = 0, hi = tensors; // first[lo] <= b < first[hi]
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (first[mid] <= b) lo = mid;
        else hi = mid;
    }
    const float s = sumsq_share((const T *)ptrs[lo], lens[lo], b - first[lo], first[lo + 1] - first[lo], scratch);
    if (threadIdx.x == 0) partial[b] = s;
}

// Σ partial[b] over `blocks` partial sums, in block order, in every thread of the block.
__device__ float sumsq_total(const float *__restrict__ partial, int blocks, float *scratch) {
    float s = 0.0f;
    for (int b = threadIdx.x; b < blocks; b += blockDim.x) s += partial[b];
    return block_sum(s, scratch);
}

// out[i] = Σ of tensor i's partial sums in block order, a block per tensor.
// Launch: grid (tensors), block (256). partial (first[tensors],) f32; first (tensors + 1,)
// u32; out (tensors,) f32.
extern "C" __global__ void sumsq_many_final(const float *__restrict__ partial, const unsigned int *__restrict__ first,
                                            float *__restrict__ out) {
    __shared__ float scratch[32];
    const unsigned int i = blockIdx.x;
    const float s = sumsq_total(partial + first[i], (int)(first[i + 1] - first[i]), scratch);
    if (threadIdx.x == 0) out[i] = s;
}

// ---- the entry points, one per element type ----

#define FUSED_OPS(T, S)                                                                                           \
    extern "C" __global__ void rms_norm_fwd_##S(const T *x, const T *w, T *y, int d, float eps) {               \
        rms_norm_fwd<T>(x, w, y, d, eps);                                                                         \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(1024) rms_norm_bwd_##S(const T *x, const T *w, const T *g, T *dx, float *partial,       \
                                                int rows, int d, float eps, int rows_per_block) {                 \
        rms_norm_bwd<T>(x, w, g, dx, partial, rows, d, eps, rows_per_block);                                      \
    }                                                                                                             \
    extern "C" __global__ void column_sums_##S(const float *partial, T *out, int blocks, int d) {                 \
        column_sums<T>(partial, out, blocks, d);                                                                  \
    }                                                                                                             \
    extern "C" __global__ void swiglu_fwd_##S(const T *g, const T *u, T *h, size_t n) { swiglu_fwd<T>(g, u, h, n); } \
    extern "C" __global__ void swiglu_bwd_##S(const T *g, const T *u, const T *dh, T *dg, T *du, size_t n) {      \
        swiglu_bwd<T>(g, u, dh, dg, du, n);                                                                       \
    }                                                                                                             \
    extern "C" __global__ void heads_##S(const T *src, T *dst, const float *cos, const float *sin,                \
                                         const unsigned int *positions, int B, int C, int Tn, int D, int merge,   \
                                         int transposed) {                                                        \
        heads<T>(src, dst, cos, sin, positions, B, C, Tn, D, merge, transposed);                                  \
    }                                                                                                             \
    extern "C" __global__ void cross_entropy_fwd_##S(const T *logits, const unsigned int *targets, float *loss,   \
                                                     int V) {                                                     \
        cross_entropy_fwd<T>(logits, targets, loss, V);                                                           \
    }                                                                                                             \
    extern "C" __global__ void cross_entropy_bwd_##S(const T *logits, const unsigned int *targets,                \
                                                     const float *grad_loss, T *grad, int V) {                    \
        cross_entropy_bwd<T>(logits, targets, grad_loss, grad, V);                                                \
    }                                                                                                             \
    extern "C" __global__ void sumsq_many_partial_##S(const unsigned long long *ptrs, const unsigned long long *lens, \
                                                      const unsigned int *first, int tensors, float *partial) {   \
        sumsq_many_partial<T>(ptrs, lens, first, tensors, partial);                                               \
    }                                                                                                             \
    extern "C" __global__ void embedding_bwd_##S(const T *g, const unsigned int *offsets,                         \
                                                 const unsigned int *order, T *dw, int d) {                       \
        embedding_bwd<T>(g, offsets, order, dw, d);                                                               \
    }

FUSED_OPS(float, f32)
FUSED_OPS(bf16, bf16)
FUSED_OPS(f16, f16)
