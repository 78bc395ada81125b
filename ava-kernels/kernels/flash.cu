// FlashAttention-2 (Dao 2023) on NVIDIA GPUs: the `flash` kernel's device side, the same math
// as src/attention/flash.rs (the CPU reference its tests compare against).
//
//   S = scale · Q Kᵀ, masked: query i (position p = i + Tk − Tq) sees key j when j <= p
//   (causal) and, with packed documents, segments[b][j] == segments[b][p]
//   forward:  per query tile, key tiles in order with an online softmax; saves only
//             lse_i = m_i + log l_i (B, H, Tq) f32, never the Tq × Tk probabilities
//   backward: P recomputed from lse; Δ_i = Σ_d dO_id O_id;  dS = P ∘ (dP − Δ), dP = dO Vᵀ
//             dQ = scale · dS K (one block per query tile, key tiles in order)
//             dK = scale · dSᵀ Q, dV = Pᵀ dO (one block per key tile and query head, its
//             query tiles in order; with grouped-query attention the heads' shares are added
//             over the group in head order by a last kernel)
//
// The backward is two kernels instead of FA2's one with atomic adds into dQ: each gradient is
// summed by one block in a fixed order, so a step gives the same bits every run (exact resume)
// at the price of computing S and dP twice.
//
// Tiles live in shared memory. For bf16/f16 the tile products run on the tensor cores (raw
// mma.sync m16n8k16, f32 accumulation; score tiles never leave the registers); for f32 on the
// CUDA cores with f32 products, so f32 matches the CPU to rounding. Inputs are read in their
// stored type, everything is computed in f32, P and dS are rounded to the input type only as
// the tensor cores' operands (as FA2 does).
//
// Head dimensions up to MAX_D; D is padded in shared memory (zeros) to a multiple of 16 for
// f32 and to the kernel's bucket, a multiple of 32, for bf16/f16.
// Every block has THREADS threads; the dynamic shared memory a launch needs is the regions each
// kernel carves (named beside its launch shape), which src/attention/cuda.rs's `Smem` adds up.

#include <ava/common.cuh>

#define MAX_D 128
#define WARPS 4
#define THREADS (WARPS * 32)

// Whether query i sees key j of a sequence with segments `seg` (NULL: no documents).
__device__ __forceinline__ bool visible(int i, int j, int Tq, int Tk, int causal, const unsigned int *seg) {
    if (i >= Tq || j >= Tk) return false;
    const int p = i + Tk - Tq;
    if (causal && j > p) return false;
    if (seg && seg[j] != seg[p]) return false;
    return true;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The f32 kernels' tiles: D padded to 16 (their leading dimensions add a skew against bank
// conflicts).
__device__ __forceinline__ int padded(int D) { return (D + 15) & ~15; }

// Shared-memory carving: consecutive regions, each 128-byte aligned.
struct Carver {
    unsigned char *base;
    size_t at;
    template <typename U> __device__ U *take(size_t n) {
        at = (at + 127) & ~(size_t)127;
        U *p = reinterpret_cast<U *>(base + at);
        at += n * sizeof(U);
        return p;
    }
};

// ---- Tile products in shared memory -------------------------------------------------------
// C (M × N f32, row-major, ldc) = (or += with ACC) A (M × K) · B (K × N), where
// A(i, k) = A_COL ? a[i + k·lda] : a[i·lda + k] and B(k, j) = B_COL ? b[k + j·ldb] : b[k·ldb + j].
// M, N, K multiples of 16. Called by the whole block; no barrier inside.

template <typename T, bool A_COL, bool B_COL, bool ACC> struct Mm;

// f32: CUDA cores, one output element a thread at a time, products summed in k order.
template <bool A_COL, bool B_COL, bool ACC> struct Mm<float, A_COL, B_COL, ACC> {
    __device__ static void run(int M, int N, int K, const float *a, int lda, const float *b, int ldb, float *c,
                               int ldc) {
        for (int e = threadIdx.x; e < M * N; e += THREADS) {
            const int i = e / N, j = e % N;
            float s = ACC ? c[(size_t)i * ldc + j] : 0.0f;
            for (int k = 0; k < K; k++) {
                const float x = A_COL ? a[i + (size_t)k * lda] : a[(size_t)i * lda + k];
                const float y = B_COL ? b[k + (size_t)j * ldb] : b[(size_t)k * ldb + j];
                s = fmaf(x, y, s);
            }
            c[(size_t)i * ldc + j] = s;
        }
    }
};

// Rows r0.. of src (rows × D, row-major, `n` rows exist) into dst (rows × DP, ld), zeros past
// the last row and past D.
template <typename T>
__device__ void load_tile(T *dst, int ld, const T *src, int D, int r0, int n, int rows, int DP) {
    for (int e = threadIdx.x; e < rows * DP; e += THREADS) {
        const int r = e / DP, d = e % DP;
        dst[r * ld + d] = (r0 + r < n && d < D) ? src[(size_t)(r0 + r) * D + d] : store<T>(0.0f);
    }
}

// Per-row f32 values of rows r0.. (zero past n).
__device__ void load_rows(float *dst, const float *src, int r0, int n, int rows) {
    for (int r = threadIdx.x; r < rows; r += THREADS) dst[r] = r0 + r < n ? src[r0 + r] : 0.0f;
}

// ---- Forward --------------------------------------------------------------------------------
// Launch: grid (ceil(Tq / BR), B·H), block THREADS, dynamic shared memory: Smem::forward.
// q, out (B, H, Tq, D); k, v (B, Hkv, Tk, D); lse (B, H, Tq) f32; segments (B, Tk) or NULL.
template <typename T, int BR, int BC>
__device__ void fwd(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                    const unsigned int *__restrict__ segments, T *__restrict__ out, float *__restrict__ lse, int H,
                    int Hkv, int Tq, int Tk, int D, int causal, float scale) {
    AVA_DYNAMIC_SHARED(smem);
    const int DP = padded(D), LT = DP + 8, LP = BC + 8, LS = BC + 4, LF = DP + 4;
    Carver cv{smem, 0};
    T *sQ = cv.take<T>(BR * LT);      // (BR, DP) queries of this tile
    T *sK = cv.take<T>(BC * LT);      // (BC, DP) keys of the current key tile
    T *sV = cv.take<T>(BC * LT);      // (BC, DP) values
    T *sP = cv.take<T>(BR * LP);      // (BR, BC) probabilities, unnormalized
    float *sS = cv.take<float>(BR * LS); // (BR, BC) scores
    float *sO = cv.take<float>(BR * LF); // (BR, DP) output, unnormalized
    float *sM = cv.take<float>(BR);   // (BR,) running max
    float *sL = cv.take<float>(BR);   // (BR,) running sum

    const int qt = gridDim.x - 1 - blockIdx.x; // the longest (causal) tiles first
    const int bh = blockIdx.y, b = bh / H, h = bh % H, hk = h / (H / Hkv);
    const int i0 = qt * BR;
    const T *qb = q + (size_t)bh * Tq * D;
    const T *kb = k + ((size_t)b * Hkv + hk) * Tk * D;
    const T *vb = v + ((size_t)b * Hkv + hk) * Tk * D;
    const unsigned int *seg = segments ? segments + (size_t)b * Tk : nullptr;

    load_tile(sQ, LT, qb, D, i0, Tq, BR, DP);
    for (int e = threadIdx.x; e < BR * LF; e += THREADS) sO[e] = 0.0f;
    for (int r = threadIdx.x; r < BR; r += THREADS) {
        sM[r] = -INFINITY;
        sL[r] = 0.0f;
    }
    const int last_row = min(i0 + BR, Tq) - 1;
    const int key_tiles = (Tk + BC - 1) / BC;
    const int nkt = causal ? min(key_tiles, (last_row + Tk - Tq) / BC + 1) : key_tiles;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int kt = 0; kt < nkt; kt++) {
        const int j0 = kt * BC;
        __syncthreads(); // the previous tile's readers are done
        load_tile(sK, LT, kb, D, j0, Tk, BC, DP);
        load_tile(sV, LT, vb, D, j0, Tk, BC, DP);
        __syncthreads();
        Mm<T, false, true, false>::run(BR, BC, DP, sQ, LT, sK, LT, sS, LS);
        __syncthreads();
        // Online softmax: a warp per row, BC / 32 columns a lane.
        for (int r = warp; r < BR; r += WARPS) {
            const int i = i0 + r;
            float s[BC / 32];
            float mx = -INFINITY;
#pragma unroll
            for (int u = 0; u < BC / 32; u++) {
                const int c = lane + 32 * u;
                s[u] = visible(i, j0 + c, Tq, Tk, causal, seg) ? sS[r * LS + c] * scale : -INFINITY;
                mx = fmaxf(mx, s[u]);
            }
            mx = warp_max(mx);
            const float m_old = sM[r];
            const float m_new = fmaxf(m_old, mx);
            const float alpha = m_new == -INFINITY ? 1.0f : expf(m_old - m_new);
            float sum = 0.0f;
#pragma unroll
            for (int u = 0; u < BC / 32; u++) {
                const float p = s[u] == -INFINITY ? 0.0f : expf(s[u] - m_new);
                sum += p;
                sP[r * LP + lane + 32 * u] = store<T>(p);
            }
            sum = warp_sum(sum);
            __syncwarp();
            if (lane == 0) {
                sM[r] = m_new;
                sL[r] = sL[r] * alpha + sum;
            }
            for (int d = lane; d < DP; d += 32) sO[r * LF + d] *= alpha;
        }
        __syncthreads();
        Mm<T, false, false, true>::run(BR, DP, BC, sP, LP, sV, LT, sO, LF);
    }
    __syncthreads();
    T *ob = out + (size_t)bh * Tq * D;
    for (int e = threadIdx.x; e < BR * D; e += THREADS) {
        const int r = e / D, d = e % D;
        if (i0 + r >= Tq) continue;
        const float l = sL[r];
        ob[(size_t)(i0 + r) * D + d] = store<T>(l > 0.0f ? sO[r * LF + d] / l : 0.0f);
    }
    for (int r = threadIdx.x; r < BR; r += THREADS) {
        if (i0 + r < Tq) lse[(size_t)bh * Tq + i0 + r] = sL[r] > 0.0f ? sM[r] + logf(sL[r]) : -INFINITY;
    }
}

// ---- Backward -------------------------------------------------------------------------------
// Δ (B, H, Tq) f32 = rowsum(dO ∘ O). Launch: grid (ceil(B·H·Tq / WARPS)), block THREADS, a
// warp per row.
template <typename T>
__device__ void bwd_delta(const T *__restrict__ out, const T *__restrict__ dout, float *__restrict__ delta,
                          size_t rows, int D) {
    const size_t r = (size_t)blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (r >= rows) return;
    float s = 0.0f;
    for (int d = threadIdx.x & 31; d < D; d += 32) s += load(out[r * D + d]) * load(dout[r * D + d]);
    s = warp_sum(s);
    if ((threadIdx.x & 31) == 0) delta[r] = s;
}

// P and dS of one (query tile, key tile) pair from S and dP: p = exp(scale·s − lse),
// ds = p ∘ (dp − Δ). Masked entries are 0 in both.
template <typename T, int BR, int BC>
__device__ void probabilities(const float *sS, const float *sdP, int LS, const float *sLse, const float *sDelta,
                              T *sP, T *sdS, int LP, int i0, int j0, int Tq, int Tk, int causal,
                              const unsigned int *seg, float scale) {
    for (int e = threadIdx.x; e < BR * BC; e += THREADS) {
        const int r = e / BC, c = e % BC;
        float p = 0.0f;
        if (visible(i0 + r, j0 + c, Tq, Tk, causal, seg)) p = expf(sS[r * LS + c] * scale - sLse[r]);
        if (sP) sP[r * LP + c] = store<T>(p);
        sdS[r * LP + c] = store<T>(p * (sdP[r * LS + c] - sDelta[r]));
    }
}

// dQ. Launch: grid (ceil(Tq / BR), B·H), block THREADS, dynamic shared memory: Smem::backward_q.
template <typename T, int BR, int BC>
__device__ void bwd_q(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                      const unsigned int *__restrict__ segments, const T *__restrict__ dout,
                      const float *__restrict__ lse, const float *__restrict__ delta, T *__restrict__ dq, int H,
                      int Hkv, int Tq, int Tk, int D, int causal, float scale) {
    AVA_DYNAMIC_SHARED(smem);
    const int DP = padded(D), LT = DP + 8, LP = BC + 8, LS = BC + 4, LF = DP + 4;
    Carver cv{smem, 0};
    T *sQ = cv.take<T>(BR * LT);          // (BR, DP)
    T *sdO = cv.take<T>(BR * LT);         // (BR, DP)
    T *sK = cv.take<T>(BC * LT);          // (BC, DP)
    T *sV = cv.take<T>(BC * LT);          // (BC, DP)
    T *sdS = cv.take<T>(BR * LP);         // (BR, BC)
    float *sS = cv.take<float>(BR * LS);  // (BR, BC)
    float *sdP = cv.take<float>(BR * LS); // (BR, BC)
    float *sdQ = cv.take<float>(BR * LF); // (BR, DP)
    float *sLse = cv.take<float>(BR);     // (BR,)
    float *sDelta = cv.take<float>(BR);   // (BR,)

    const int qt = gridDim.x - 1 - blockIdx.x;
    const int bh = blockIdx.y, b = bh / H, h = bh % H, hk = h / (H / Hkv);
    const int i0 = qt * BR;
    const T *kb = k + ((size_t)b * Hkv + hk) * Tk * D;
    const T *vb = v + ((size_t)b * Hkv + hk) * Tk * D;
    const unsigned int *seg = segments ? segments + (size_t)b * Tk : nullptr;

    load_tile(sQ, LT, q + (size_t)bh * Tq * D, D, i0, Tq, BR, DP);
    load_tile(sdO, LT, dout + (size_t)bh * Tq * D, D, i0, Tq, BR, DP);
    load_rows(sLse, lse + (size_t)bh * Tq, i0, Tq, BR);
    load_rows(sDelta, delta + (size_t)bh * Tq, i0, Tq, BR);
    for (int e = threadIdx.x; e < BR * LF; e += THREADS) sdQ[e] = 0.0f;
    const int last_row = min(i0 + BR, Tq) - 1;
    const int key_tiles = (Tk + BC - 1) / BC;
    const int nkt = causal ? min(key_tiles, (last_row + Tk - Tq) / BC + 1) : key_tiles;
    for (int kt = 0; kt < nkt; kt++) {
        const int j0 = kt * BC;
        __syncthreads();
        load_tile(sK, LT, kb, D, j0, Tk, BC, DP);
        load_tile(sV, LT, vb, D, j0, Tk, BC, DP);
        __syncthreads();
        Mm<T, false, true, false>::run(BR, BC, DP, sQ, LT, sK, LT, sS, LS);
        Mm<T, false, true, false>::run(BR, BC, DP, sdO, LT, sV, LT, sdP, LS);
        __syncthreads();
        probabilities<T, BR, BC>(sS, sdP, LS, sLse, sDelta, (T *)nullptr, sdS, LP, i0, j0, Tq, Tk, causal, seg,
                                 scale);
        __syncthreads();
        Mm<T, false, false, true>::run(BR, DP, BC, sdS, LP, sK, LT, sdQ, LF);
    }
    __syncthreads();
    T *dqb = dq + (size_t)bh * Tq * D;
    for (int e = threadIdx.x; e < BR * D; e += THREADS) {
        const int r = e / D, d = e % D;
        if (i0 + r < Tq) dqb[(size_t)(i0 + r) * D + d] = store<T>(scale * sdQ[r * LF + d]);
    }
}

// dK and dV. Without partials (dk_part NULL: no grouped-query attention): launch grid
// (ceil(Tk / BC), B·Hkv), a block per key tile writing dK, dV. With grouped-query attention,
// grid (ceil(Tk / BC), B·H): a block per key tile and query head, writing that head's share
// to dk_part, dv_part (B, H, Tk, D) f32, which bwd_kv_sum adds over the group in order (a
// block per key/value head would leave most of the GPU idle: B·Hkv·Tk/BC blocks).
// Block THREADS, dynamic shared memory: Smem::backward_kv.
template <typename T, int BR, int BC>
__device__ void bwd_kv(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                       const unsigned int *__restrict__ segments, const T *__restrict__ dout,
                       const float *__restrict__ lse, const float *__restrict__ delta, T *__restrict__ dk,
                       T *__restrict__ dv, float *__restrict__ dk_part, float *__restrict__ dv_part, int H, int Hkv,
                       int Tq, int Tk, int D, int causal, float scale) {
    AVA_DYNAMIC_SHARED(smem);
    const int DP = padded(D), LT = DP + 8, LP = BC + 8, LS = BC + 4, LF = DP + 4;
    Carver cv{smem, 0};
    T *sK = cv.take<T>(BC * LT);          // (BC, DP)
    T *sV = cv.take<T>(BC * LT);          // (BC, DP)
    T *sQ = cv.take<T>(BR * LT);          // (BR, DP)
    T *sdO = cv.take<T>(BR * LT);         // (BR, DP)
    T *sP = cv.take<T>(BR * LP);          // (BR, BC)
    T *sdS = cv.take<T>(BR * LP);         // (BR, BC)
    float *sS = cv.take<float>(BR * LS);  // (BR, BC)
    float *sdP = cv.take<float>(BR * LS); // (BR, BC)
    float *sdK = cv.take<float>(BC * LF); // (BC, DP)
    float *sdV = cv.take<float>(BC * LF); // (BC, DP)
    float *sLse = cv.take<float>(BR);     // (BR,)
    float *sDelta = cv.take<float>(BR);   // (BR,)

    const int kt = blockIdx.x, group = H / Hkv;
    const bool split = dk_part != nullptr;
    const int b = split ? blockIdx.y / H : blockIdx.y / Hkv;
    const int h_first = split ? blockIdx.y % H : (blockIdx.y % Hkv) * group;
    const int hk = h_first / group, heads = split ? 1 : group;
    const size_t bk = (size_t)b * Hkv + hk;
    const int j0 = kt * BC;
    const unsigned int *seg = segments ? segments + (size_t)b * Tk : nullptr;
    load_tile(sK, LT, k + (size_t)bk * Tk * D, D, j0, Tk, BC, DP);
    load_tile(sV, LT, v + (size_t)bk * Tk * D, D, j0, Tk, BC, DP);
    for (int e = threadIdx.x; e < BC * LF; e += THREADS) {
        sdK[e] = 0.0f;
        sdV[e] = 0.0f;
    }
    // The first query that sees key j0 has position j0 (causal).
    const int first = causal ? max(0, j0 - (Tk - Tq)) / BR : 0;
    const int query_tiles = (Tq + BR - 1) / BR;
    for (int g = 0; g < heads; g++) {
        const size_t bh = (size_t)b * H + h_first + g;
        for (int qt = first; qt < query_tiles; qt++) {
            const int i0 = qt * BR;
            __syncthreads();
            load_tile(sQ, LT, q + bh * Tq * D, D, i0, Tq, BR, DP);
            load_tile(sdO, LT, dout + bh * Tq * D, D, i0, Tq, BR, DP);
            load_rows(sLse, lse + bh * Tq, i0, Tq, BR);
            load_rows(sDelta, delta + bh * Tq, i0, Tq, BR);
            __syncthreads();
            Mm<T, false, true, false>::run(BR, BC, DP, sQ, LT, sK, LT, sS, LS);
            Mm<T, false, true, false>::run(BR, BC, DP, sdO, LT, sV, LT, sdP, LS);
            __syncthreads();
            probabilities<T, BR, BC>(sS, sdP, LS, sLse, sDelta, sP, sdS, LP, i0, j0, Tq, Tk, causal, seg, scale);
            __syncthreads();
            Mm<T, true, false, true>::run(BC, DP, BR, sP, LP, sdO, LT, sdV, LF);  // dV += Pᵀ dO
            Mm<T, true, false, true>::run(BC, DP, BR, sdS, LP, sQ, LT, sdK, LF); // dK += dSᵀ Q
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < BC * D; e += THREADS) {
        const int c = e / D, d = e % D;
        if (j0 + c >= Tk) continue;
        if (split) {
            const size_t at = ((size_t)blockIdx.y * Tk + j0 + c) * D + d;
            dk_part[at] = sdK[c * LF + d];
            dv_part[at] = sdV[c * LF + d];
        } else {
            const size_t at = (bk * Tk + j0 + c) * D + d;
            dk[at] = store<T>(scale * sdK[c * LF + d]);
            dv[at] = store<T>(sdV[c * LF + d]);
        }
    }
}

// dK = scale · Σ_g dk_part, dV = Σ_g dv_part over the query heads of each key/value head, in
// head order. Launch: grid (ceil(B·Hkv·Tk·D / 256)), block 256, an element a thread.
template <typename T>
__device__ void bwd_kv_sum(const float *__restrict__ dk_part, const float *__restrict__ dv_part, T *__restrict__ dk,
                           T *__restrict__ dv, size_t n, int group, size_t per_head, float scale) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const size_t bk = i / per_head, rest = i % per_head;
    const float *pk = dk_part + bk * group * per_head + rest;
    const float *pv = dv_part + bk * group * per_head + rest;
    float sk = 0.0f, sv = 0.0f;
    for (int g = 0; g < group; g++) {
        sk += pk[g * per_head];
        sv += pv[g * per_head];
    }
    dk[i] = store<T>(scale * sk);
    dv[i] = store<T>(sv);
}

// ---- bf16/f16: the tensor cores, a warp owning 16 rows ----------------------------------------
// The same three passes for half-precision inputs, organized as FlashAttention-2 does: each of
// a block's four warps owns 16 rows (queries in forward and dQ, keys in dK/dV) and keeps its
// accumulators (O, dQ or dK and dV) in registers across the key (or query) tiles. Only the K/V
// (or Q/dO) tiles the warps share are loaded between barriers; the score tiles (S, P, dP, dS)
// stay in registers too (below). The head dimension is a template parameter (ND 16-column
// blocks, D padded to a multiple of 32), so the accumulator arrays stay in registers.

#define TQ 64 // rows a block: 4 warps × 16
#define TK 64 // the shared tile's rows (keys in forward and dQ, queries in dK/dV)

namespace tc {
// Rows r0.. of src (n rows × D) into dst (rows × DP, ld), zeros past n and D; 16-byte copies
// when D and src allow.
template <typename T>
__device__ void load_tile(T *dst, int ld, const T *src, int D, int r0, int n, int rows, int DP) {
    const int per = 16 / sizeof(T); // elements a 16-byte copy
    if (D % per == 0 && ((uintptr_t)src & 15) == 0) {
        const int chunks = DP / per;
        for (int e = threadIdx.x; e < rows * chunks; e += THREADS) {
            const int r = e / chunks, d = (e % chunks) * per;
            uint4 v = make_uint4(0, 0, 0, 0);
            if (r0 + r < n && d < D) v = *reinterpret_cast<const uint4 *>(src + (size_t)(r0 + r) * D + d);
            *reinterpret_cast<uint4 *>(dst + r * ld + d) = v;
        }
    } else {
        ::load_tile(dst, ld, src, D, r0, n, rows, DP);
    }
}

} // namespace tc

// log2(e): the backward kernels compute exp(x) as exp2(x · log2 e).
#define LOG2E 1.4426950408889634f

// ---- Raw mma.sync: the score tiles never leave the registers ---------------------------------
// WMMA's fragments are opaque, so a row's maximum and sum would need S in shared memory. The
// PTX ISA documents mma.sync.m16n8k16's register layouts instead (lane = 4·g + t): C/D holds
// (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1); A holds (g, 2t..2t+1), (g+8, 2t..2t+1),
// (g, 2t+8..2t+9), (g+8, 2t+8..2t+9), two halves a register, the lower column in the low
// bits; B holds (k 2t..2t+1, n g), (k 2t+8..2t+9, n g). So a row is spread over the four lanes
// of a quad (two shuffles reduce it), and two adjacent 8-key blocks of S's accumulators are,
// packed to the input type, exactly P's A operand for those 16 keys (FlashAttention-2's
// trick): no shared memory between S and O. Operands come from shared memory by ldmatrix
// (each lane gives one row's address of one of four 8 × 8 matrices; .trans for V, whose
// rows are the keys, the product's k).
namespace mma {
// Two f32 as two halves of one register, rounded to nearest (ties to even) as store<T>.
template <typename T> __device__ __forceinline__ uint32_t pack(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack<bf16>(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi); // .x (low bits) = lo
    return *reinterpret_cast<uint32_t *>(&v);
}
template <> __device__ __forceinline__ uint32_t pack<f16>(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}

// d (16 × 8 f32) += a (16 × 16) · b (16 × 8), inputs bf16 or f16, f32 accumulation.
template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
#ifdef AVA_EMULATE // the CPU emulator's warp-level mma (ava-cuda-emu), for tests without a GPU
template <>
__device__ __forceinline__ void mma16816<bf16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    ava_emu::mma16816<bf16>(d, a, b0, b1);
}
template <>
__device__ __forceinline__ void mma16816<f16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    ava_emu::mma16816<f16>(d, a, b0, b1);
}
template <bool TRANS> __device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void *row) {
    ava_emu::ldmatrix_x4<TRANS>(r, row);
}
#else
template <>
__device__ __forceinline__ void mma16816<bf16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma16816<f16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8 × 8 matrices of 16-bit elements from shared memory, lane l giving the address of
// row l % 8 of matrix l / 8; lane l receives (row l/4, columns 2(l%4), 2(l%4)+1) of each,
// or with TRANS (rows 2(l%4), 2(l%4)+1, column l/4).
template <bool TRANS> __device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void *row) {
    const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(row));
    if (TRANS) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(at)
                     : "memory");
    } else {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(at)
                     : "memory");
    }
}
#endif
} // namespace mma

// Forward. Launch: grid (ceil(Tq / TQ), B·H), block THREADS, dynamic shared memory Smem::forward
// (sQ, sK, sV). Each warp owns 16 query rows: its Q as A fragments (loaded once), S (16 × TK)
// and O (16 × DP) as accumulators, and per lane the maximum m and the partial sum l of its two
// rows (g and g + 8), the sum over the quad taken at the end. Tiles wholly inside the causal
// triangle, the sequence and one document skip the mask.
template <typename T, int ND>
__device__ void fwd_tc(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                       const unsigned int *__restrict__ segments, T *__restrict__ out, float *__restrict__ lse, int H,
                       int Hkv, int Tq, int Tk, int D, int causal, float scale) {
    using mma::ldsm_x4;
    using mma::mma16816;
    AVA_DYNAMIC_SHARED(smem);
    constexpr int DP = ND * 16, LT = DP + 8;
    constexpr int NB = TK / 8; // S's 8-key column blocks
    constexpr int OB = DP / 8; // O's 8-column blocks
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    Carver cv{smem, 0};
    T *sQ = cv.take<T>(TQ * LT); // (TQ, DP)
    T *sK = cv.take<T>(TK * LT); // (TK, DP)
    T *sV = cv.take<T>(TK * LT); // (TK, DP)

    const int qt = gridDim.x - 1 - blockIdx.x;
    const int bh = blockIdx.y, b = bh / H, h = bh % H, hk = h / (H / Hkv);
    const int i0 = qt * TQ, w0 = i0 + warp * 16; // the block's and this warp's first query
    const int rows[2] = {w0 + g, w0 + g + 8};    // this lane's two query rows
    const T *kb = k + ((size_t)b * Hkv + hk) * Tk * D;
    const T *vb = v + ((size_t)b * Hkv + hk) * Tk * D;
    const unsigned int *seg = segments ? segments + (size_t)b * Tk : nullptr;
    tc::load_tile(sQ, LT, q + (size_t)bh * Tq * D, D, i0, Tq, TQ, DP);
    __syncthreads();
    uint32_t qa[ND][4]; // this warp's Q (16, DP) as A fragments of 16 columns
#pragma unroll
    for (int kk = 0; kk < ND; kk++) ldsm_x4<false>(qa[kk], sQ + (warp * 16 + (lane & 15)) * LT + kk * 16 + (lane >> 4) * 8);
    float o[OB][4]; // this warp's (16, DP) output, unnormalized
#pragma unroll
    for (int ob = 0; ob < OB; ob++) o[ob][0] = o[ob][1] = o[ob][2] = o[ob][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

    const int last_row = min(i0 + TQ, Tq) - 1;
    const int key_tiles = (Tk + TK - 1) / TK;
    const int nkt = causal ? min(key_tiles, (last_row + Tk - Tq) / TK + 1) : key_tiles;
    for (int kt = 0; kt < nkt; kt++) {
        const int j0 = kt * TK;
        __syncthreads();
        tc::load_tile(sK, LT, kb, D, j0, Tk, TK, DP);
        tc::load_tile(sV, LT, vb, D, j0, Tk, TK, DP);
        __syncthreads();
        float s[NB][4]; // S (16, TK) = Q_w Kᵀ
#pragma unroll
        for (int nb = 0; nb < NB; nb++) s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < ND; kk++) {
#pragma unroll
            for (int nb = 0; nb < NB; nb += 2) { // keys nb·8 .. nb·8 + 15: B = Kᵀ, K's rows as given
                uint32_t kf[4];
                ldsm_x4<false>(kf, sK + (nb * 8 + (lane & 7) + ((lane >> 4) << 3)) * LT + kk * 16 + ((lane >> 3) & 1) * 8);
                mma16816<T>(s[nb], qa[kk], kf[0], kf[1]);
                mma16816<T>(s[nb + 1], qa[kk], kf[2], kf[3]);
            }
        }
        // Mask and scale; each row's maximum over the quad.
        const bool whole = !seg && w0 + 16 <= Tq && j0 + TK <= Tk && (!causal || j0 + TK - 1 <= w0 + Tk - Tq);
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int nb = 0; nb < NB; nb++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int j = j0 + nb * 8 + 2 * t + (e & 1);
                const float x = whole || visible(rows[e >> 1], j, Tq, Tk, causal, seg) ? s[nb][e] * scale : -INFINITY;
                s[nb][e] = x;
                mx[e >> 1] = fmaxf(mx[e >> 1], x);
            }
        }
        float alpha[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            const float m_new = fmaxf(m[r], mx[r]);
            alpha[r] = m_new == -INFINITY ? 1.0f : expf(m[r] - m_new);
            m[r] = m_new;
        }
        // P = exp(S − m) in place; l = alpha l + this lane's Σ P; O = diag(alpha) O.
        float sum[2] = {0.0f, 0.0f};
#pragma unroll
        for (int nb = 0; nb < NB; nb++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float p = s[nb][e] == -INFINITY ? 0.0f : expf(s[nb][e] - m[e >> 1]);
                s[nb][e] = p;
                sum[e >> 1] += p;
            }
        }
#pragma unroll
        for (int r = 0; r < 2; r++) l[r] = l[r] * alpha[r] + sum[r];
#pragma unroll
        for (int ob = 0; ob < OB; ob++) {
            o[ob][0] *= alpha[0];
            o[ob][1] *= alpha[0];
            o[ob][2] *= alpha[1];
            o[ob][3] *= alpha[1];
        }
        // O += P V, 16 keys at a time: P's A fragment is S's blocks 2kk and 2kk + 1, packed.
#pragma unroll
        for (int kk = 0; kk < TK / 16; kk++) {
            const uint32_t pa[4] = {mma::pack<T>(s[2 * kk][0], s[2 * kk][1]), mma::pack<T>(s[2 * kk][2], s[2 * kk][3]),
                                    mma::pack<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                    mma::pack<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int ob = 0; ob < OB; ob += 2) { // columns ob·8 .. ob·8 + 15: B = V, keys as k
                uint32_t vf[4];
                ldsm_x4<true>(vf, sV + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LT + ob * 8 + (lane >> 4) * 8);
                mma16816<T>(o[ob], pa, vf[0], vf[1]);
                mma16816<T>(o[ob + 1], pa, vf[2], vf[3]);
            }
        }
    }
    // l over the quad; O / l, and lse = m + log l.
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
    const float inv[2] = {l[0] > 0.0f ? 1.0f / l[0] : 0.0f, l[1] > 0.0f ? 1.0f / l[1] : 0.0f};
    T *ob_ = out + (size_t)bh * Tq * D;
#pragma unroll
    for (int ob = 0; ob < OB; ob++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int i = rows[e >> 1], d = ob * 8 + 2 * t + (e & 1);
            if (i < Tq && d < D) ob_[(size_t)i * D + d] = store<T>(o[ob][e] * inv[e >> 1]);
        }
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        if (t == 0 && rows[r] < Tq) lse[(size_t)bh * Tq + rows[r]] = l[r] > 0.0f ? m[r] + logf(l[r]) : -INFINITY;
    }
}

// The backward on mma.sync too. It needs no reductions over a row (P comes from the saved lse,
// dS from Δ), so each lane computes P and dS on its own accumulator elements, and dS (or Pᵀ and
// dSᵀ), packed as the forward packs P, is the A operand of the next product: nothing of a score
// tile leaves the registers. The A fragments of the warp's own rows (Q and dO here, K and V in
// dK/dV) are loaded from shared memory per 16 columns as a product needs them; B fragments by
// ldmatrix from the shared tile, plain where the tile's rows are the product's n (Kᵀ, Vᵀ, Qᵀ,
// dOᵀ) and .trans where they are its k (K, Q, dO).

// A fragments of 16 rows from `tile` (ld LT), columns kk·16 .. kk·16 + 15, rows r0 .. r0 + 15.
template <int LT, typename T>
__device__ __forceinline__ void a_frag(uint32_t (&a)[4], const T *tile, int r0, int kk) {
    const int lane = threadIdx.x & 31;
    mma::ldsm_x4<false>(a, tile + (r0 + (lane & 15)) * LT + kk * 16 + (lane >> 4) * 8);
}

// B fragments of Mᵀ for two 8-row blocks of `tile` (its rows n0 .. n0 + 15 are the product's n,
// its columns kk·16 .. kk·16 + 15 the k): b[0..1] for rows n0.., b[2..3] for rows n0 + 8...
template <int LT, typename T>
__device__ __forceinline__ void bt_frag(uint32_t (&b)[4], const T *tile, int n0, int kk) {
    const int lane = threadIdx.x & 31;
    mma::ldsm_x4<false>(b, tile + (n0 + (lane & 7) + ((lane >> 4) << 3)) * LT + kk * 16 + ((lane >> 3) & 1) * 8);
}

// B fragments of M for two 8-column blocks (its rows k0 .. k0 + 15 are the product's k, its
// columns c0 .. c0 + 15 the n): b[0..1] for columns c0.., b[2..3] for columns c0 + 8...
template <int LT, typename T>
__device__ __forceinline__ void b_frag(uint32_t (&b)[4], const T *tile, int k0, int c0) {
    const int lane = threadIdx.x & 31;
    mma::ldsm_x4<true>(b, tile + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * LT + c0 + (lane >> 4) * 8);
}

// The A fragment of 16 columns kk·16 .. kk·16 + 15 of a (16 × TK) accumulator tile x, packed.
template <typename T, int NB>
__device__ __forceinline__ void pack_a(uint32_t (&a)[4], const float (&x)[NB][4], int kk) {
    a[0] = mma::pack<T>(x[2 * kk][0], x[2 * kk][1]);
    a[1] = mma::pack<T>(x[2 * kk][2], x[2 * kk][3]);
    a[2] = mma::pack<T>(x[2 * kk + 1][0], x[2 * kk + 1][1]);
    a[3] = mma::pack<T>(x[2 * kk + 1][2], x[2 * kk + 1][3]);
}

// The backward's two score products of a tile: x = A Bᵀ and y = C Eᵀ (16 × TK each), A and C
// the warp's 16 rows from r0 of their tiles, B and E tiles of TK rows, over DP columns.
template <typename T, int ND, int LT, int NB>
__device__ __forceinline__ void products_t(float (&x)[NB][4], float (&y)[NB][4], const T *a, const T *b, const T *c,
                                           const T *e, int r0) {
#pragma unroll
    for (int nb = 0; nb < NB; nb++) {
#pragma unroll
        for (int i = 0; i < 4; i++) x[nb][i] = y[nb][i] = 0.0f;
    }
#pragma unroll
    for (int kk = 0; kk < ND; kk++) {
        uint32_t af[4], cf[4];
        a_frag<LT>(af, a, r0, kk);
        a_frag<LT>(cf, c, r0, kk);
#pragma unroll
        for (int nb = 0; nb < NB; nb += 2) {
            uint32_t bf[4], ef[4];
            bt_frag<LT>(bf, b, nb * 8, kk);
            bt_frag<LT>(ef, e, nb * 8, kk);
            mma::mma16816<T>(x[nb], af, bf[0], bf[1]);
            mma::mma16816<T>(x[nb + 1], af, bf[2], bf[3]);
            mma::mma16816<T>(y[nb], cf, ef[0], ef[1]);
            mma::mma16816<T>(y[nb + 1], cf, ef[2], ef[3]);
        }
    }
}

// Stores a (16 × DP) accumulator's rows r0 + g, r0 + g + 8 (those below `rows`), columns below
// D, times `scale`, into a row-major U matrix of ld D.
template <typename U, int OB>
__device__ __forceinline__ void store_acc(const float (&acc)[OB][4], U *out, int r0, int rows, int D, float scale) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int ob = 0; ob < OB; ob++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int r = r0 + g + (e >> 1) * 8, d = ob * 8 + 2 * t + (e & 1);
            if (r < rows && d < D) out[(size_t)r * D + d] = store<U>(scale * acc[ob][e]);
        }
    }
}

// dQ. Launch: grid (ceil(Tq / TQ), B·H), block THREADS, dynamic shared memory Smem::backward_q
// (sQ, sdO, sK, sV). A warp owns 16 queries: per key tile S = Q Kᵀ and dP = dO Vᵀ as
// accumulators, P and dS on them in place, then dQ += dS K from the packed dS. Tiles wholly
// inside the causal triangle, the sequence and one document skip the mask.
template <typename T, int ND>
__device__ void bwd_q_tc(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                         const unsigned int *__restrict__ segments, const T *__restrict__ dout,
                         const float *__restrict__ lse, const float *__restrict__ delta, T *__restrict__ dq, int H,
                         int Hkv, int Tq, int Tk, int D, int causal, float scale) {
    using mma::mma16816;
    AVA_DYNAMIC_SHARED(smem);
    constexpr int DP = ND * 16, LT = DP + 8, NB = TK / 8, OB = DP / 8;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    Carver cv{smem, 0};
    T *sQ = cv.take<T>(TQ * LT);  // (TQ, DP)
    T *sdO = cv.take<T>(TQ * LT); // (TQ, DP)
    T *sK = cv.take<T>(TK * LT);  // (TK, DP)
    T *sV = cv.take<T>(TK * LT);  // (TK, DP)

    const int qt = gridDim.x - 1 - blockIdx.x;
    const int bh = blockIdx.y, b = bh / H, h = bh % H, hk = h / (H / Hkv);
    const int i0 = qt * TQ, w0 = i0 + warp * 16;
    const int rows[2] = {w0 + g, w0 + g + 8}; // this lane's two queries
    const T *kb = k + ((size_t)b * Hkv + hk) * Tk * D;
    const T *vb = v + ((size_t)b * Hkv + hk) * Tk * D;
    const unsigned int *seg = segments ? segments + (size_t)b * Tk : nullptr;
    tc::load_tile(sQ, LT, q + (size_t)bh * Tq * D, D, i0, Tq, TQ, DP);
    tc::load_tile(sdO, LT, dout + (size_t)bh * Tq * D, D, i0, Tq, TQ, DP);
    // This lane's rows' lse (in log2 units) and Δ, fixed for the kernel.
    float lse2[2], dlt[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        lse2[r] = rows[r] < Tq ? lse[(size_t)bh * Tq + rows[r]] * LOG2E : 0.0f;
        dlt[r] = rows[r] < Tq ? delta[(size_t)bh * Tq + rows[r]] : 0.0f;
    }
    const float scale2 = scale * LOG2E;
    float acc[OB][4]; // this warp's (16, DP) dQ / scale
#pragma unroll
    for (int ob = 0; ob < OB; ob++) acc[ob][0] = acc[ob][1] = acc[ob][2] = acc[ob][3] = 0.0f;

    const int last_row = min(i0 + TQ, Tq) - 1;
    const int key_tiles = (Tk + TK - 1) / TK;
    const int nkt = causal ? min(key_tiles, (last_row + Tk - Tq) / TK + 1) : key_tiles;
    for (int kt = 0; kt < nkt; kt++) {
        const int j0 = kt * TK;
        __syncthreads();
        tc::load_tile(sK, LT, kb, D, j0, Tk, TK, DP);
        tc::load_tile(sV, LT, vb, D, j0, Tk, TK, DP);
        __syncthreads();
        float s[NB][4], dp[NB][4]; // S = Q_w Kᵀ, dP = dO_w Vᵀ (16, TK)
        products_t<T, ND, LT>(s, dp, sQ, sK, sdO, sV, warp * 16);
        // P = exp2(S·scale·log2e − lse·log2e) where visible, dS = P ∘ (dP − Δ), into s.
        const bool whole = !seg && w0 + 16 <= Tq && j0 + TK <= Tk && (!causal || j0 + TK - 1 <= w0 + Tk - Tq);
#pragma unroll
        for (int nb = 0; nb < NB; nb++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int r = e >> 1, j = j0 + nb * 8 + 2 * t + (e & 1);
                float p = 0.0f;
                if (whole || visible(rows[r], j, Tq, Tk, causal, seg)) p = exp2f(s[nb][e] * scale2 - lse2[r]);
                s[nb][e] = p * (dp[nb][e] - dlt[r]);
            }
        }
        // dQ += dS K, 16 keys at a time.
#pragma unroll
        for (int kk = 0; kk < TK / 16; kk++) {
            uint32_t da[4];
            pack_a<T>(da, s, kk);
#pragma unroll
            for (int ob = 0; ob < OB; ob += 2) {
                uint32_t kf[4];
                b_frag<LT>(kf, sK, kk * 16, ob * 8);
                mma16816<T>(acc[ob], da, kf[0], kf[1]);
                mma16816<T>(acc[ob + 1], da, kf[2], kf[3]);
            }
        }
    }
    store_acc<T>(acc, dq + (size_t)bh * Tq * D, w0, Tq, D, scale);
}

// dK and dV: a warp owns 16 keys; the shared tiles are the query tiles (Q, dO) with their lse
// and Δ. Grids and the partial sums as bwd_kv's. Per query tile Sᵀ = K_w Qᵀ and dPᵀ = V_w dOᵀ
// as accumulators (a fragment's columns are queries), Pᵀ and dSᵀ on them, then dV += Pᵀ dO and
// dK += dSᵀ Q from them packed. Dynamic shared memory Smem::backward_kv (sK, sV, sQ, sdO, sLse,
// sDelta).
template <typename T, int ND>
__device__ void bwd_kv_tc(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                          const unsigned int *__restrict__ segments, const T *__restrict__ dout,
                          const float *__restrict__ lse, const float *__restrict__ delta, T *__restrict__ dk,
                          T *__restrict__ dv, float *__restrict__ dk_part, float *__restrict__ dv_part, int H,
                          int Hkv, int Tq, int Tk, int D, int causal, float scale) {
    using mma::mma16816;
    AVA_DYNAMIC_SHARED(smem);
    constexpr int DP = ND * 16, LT = DP + 8, NB = TK / 8, OB = DP / 8;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    Carver cv{smem, 0};
    T *sK = cv.take<T>(TQ * LT);           // (TQ keys, DP)
    T *sV = cv.take<T>(TQ * LT);           // (TQ keys, DP)
    T *sQ = cv.take<T>(TK * LT);           // (TK queries, DP)
    T *sdO = cv.take<T>(TK * LT);          // (TK queries, DP)
    float *sLse = cv.take<float>(TK);      // (TK,) in log2 units
    float *sDelta = cv.take<float>(TK);    // (TK,)

    const int kt = blockIdx.x, group = H / Hkv;
    const bool split = dk_part != nullptr;
    const int b = split ? blockIdx.y / H : blockIdx.y / Hkv;
    const int h_first = split ? blockIdx.y % H : (blockIdx.y % Hkv) * group;
    const int hk = h_first / group, heads = split ? 1 : group;
    const size_t bk = (size_t)b * Hkv + hk;
    const int j0 = kt * TQ, w0 = j0 + warp * 16; // the block's and this warp's first key
    const int key0 = w0 + g;                     // this lane's two keys: key0, key0 + 8
    const unsigned int *seg = segments ? segments + (size_t)b * Tk : nullptr;
    tc::load_tile(sK, LT, k + bk * Tk * D, D, j0, Tk, TQ, DP);
    tc::load_tile(sV, LT, v + bk * Tk * D, D, j0, Tk, TQ, DP);
    const float scale2 = scale * LOG2E;
    float gk[OB][4], gv[OB][4]; // this warp's (16 keys, DP) dK / scale and dV
#pragma unroll
    for (int ob = 0; ob < OB; ob++) {
#pragma unroll
        for (int e = 0; e < 4; e++) gk[ob][e] = gv[ob][e] = 0.0f;
    }
    const int first = causal ? max(0, j0 - (Tk - Tq)) / TK : 0;
    const int query_tiles = (Tq + TK - 1) / TK;
    for (int hg = 0; hg < heads; hg++) {
        const size_t bh = (size_t)b * H + h_first + hg;
        for (int qt = first; qt < query_tiles; qt++) {
            const int i0 = qt * TK;
            __syncthreads();
            tc::load_tile(sQ, LT, q + bh * Tq * D, D, i0, Tq, TK, DP);
            tc::load_tile(sdO, LT, dout + bh * Tq * D, D, i0, Tq, TK, DP);
            for (int r = threadIdx.x; r < TK; r += THREADS) {
                const bool in = i0 + r < Tq;
                sLse[r] = in ? lse[bh * Tq + i0 + r] * LOG2E : 0.0f;
                sDelta[r] = in ? delta[bh * Tq + i0 + r] : 0.0f;
            }
            __syncthreads();
            float s[NB][4], dp[NB][4]; // Sᵀ = K_w Qᵀ, dPᵀ = V_w dOᵀ (16 keys, TK queries)
            products_t<T, ND, LT>(s, dp, sK, sQ, sV, sdO, warp * 16);
            // Every (key, query) of this warp's tile visible: no documents, whole keys and
            // queries, and the warp's last key at or before the tile's first query's last
            // visible key.
            const bool whole = !seg && w0 + 16 <= Tk && i0 + TK <= Tq && (!causal || w0 + 15 <= i0 + Tk - Tq);
            // Pᵀ into s, dSᵀ = Pᵀ ∘ (dPᵀ − Δ) into dp.
#pragma unroll
            for (int nb = 0; nb < NB; nb++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int c = nb * 8 + 2 * t + (e & 1); // the query in the tile
                    float p = 0.0f;
                    if (whole || visible(i0 + c, key0 + (e >> 1) * 8, Tq, Tk, causal, seg))
                        p = exp2f(s[nb][e] * scale2 - sLse[c]);
                    s[nb][e] = p;
                    dp[nb][e] = p * (dp[nb][e] - sDelta[c]);
                }
            }
            // dV += Pᵀ dO, dK += dSᵀ Q, 16 queries at a time.
#pragma unroll
            for (int kk = 0; kk < TK / 16; kk++) {
                uint32_t pa[4], da[4];
                pack_a<T>(pa, s, kk);
                pack_a<T>(da, dp, kk);
#pragma unroll
                for (int ob = 0; ob < OB; ob += 2) {
                    uint32_t of[4], qf[4];
                    b_frag<LT>(of, sdO, kk * 16, ob * 8);
                    b_frag<LT>(qf, sQ, kk * 16, ob * 8);
                    mma16816<T>(gv[ob], pa, of[0], of[1]);
                    mma16816<T>(gv[ob + 1], pa, of[2], of[3]);
                    mma16816<T>(gk[ob], da, qf[0], qf[1]);
                    mma16816<T>(gk[ob + 1], da, qf[2], qf[3]);
                }
            }
        }
    }
    if (split) {
        store_acc<float>(gk, dk_part + (size_t)blockIdx.y * Tk * D, w0, Tk, D, 1.0f);
        store_acc<float>(gv, dv_part + (size_t)blockIdx.y * Tk * D, w0, Tk, D, 1.0f);
    } else {
        store_acc<T>(gk, dk + bk * Tk * D, w0, Tk, D, scale);
        store_acc<T>(gv, dv + bk * Tk * D, w0, Tk, D, 1.0f);
    }
}

// Entry points. Every type: flash_bwd_delta_{S}, flash_bwd_kv_sum_{S}. f32 (CUDA cores, 32 × 32
// tiles, any D up to MAX_D): flash_{fwd,bwd_q,bwd_kv}_f32. bf16/f16 (tensor cores, 64-row
// tiles): flash_{fwd,bwd_q,bwd_kv}_{bf16,f16}_d{32,64,96,128}, D padded up to that.
#define FLASH_ANY(T, S)                                                                                            \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                         \
        flash_bwd_delta_##S(const T *out, const T *dout, float *delta, unsigned long long rows, int D) {         \
        bwd_delta<T>(out, dout, delta, (size_t)rows, D);                                                           \
    }                                                                                                              \
    extern "C" __global__ void flash_bwd_kv_sum_##S(const float *dk_part, const float *dv_part, T *dk, T *dv,     \
                                                    unsigned long long n, int group, unsigned long long per_head,  \
                                                    float scale) {                                                 \
        bwd_kv_sum<T>(dk_part, dv_part, dk, dv, (size_t)n, group, (size_t)per_head, scale);                        \
    }

#define FLASH_F32(BR, BC)                                                                                          \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                         \
        flash_fwd_f32(const float *q, const float *k, const float *v, const unsigned int *segments, float *out,   \
                      float *lse, int H, int Hkv, int Tq, int Tk, int D, int causal, float scale) {               \
        fwd<float, BR, BC>(q, k, v, segments, out, lse, H, Hkv, Tq, Tk, D, causal, scale);                         \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                         \
        flash_bwd_q_f32(const float *q, const float *k, const float *v, const unsigned int *segments,             \
                        const float *dout, const float *lse, const float *delta, float *dq, int H, int Hkv,       \
                        int Tq, int Tk, int D, int causal, float scale) {                                          \
        bwd_q<float, BR, BC>(q, k, v, segments, dout, lse, delta, dq, H, Hkv, Tq, Tk, D, causal, scale);           \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                         \
        flash_bwd_kv_f32(const float *q, const float *k, const float *v, const unsigned int *segments,            \
                         const float *dout, const float *lse, const float *delta, float *dk, float *dv,           \
                         float *dk_part, float *dv_part, int H, int Hkv, int Tq, int Tk, int D, int causal,       \
                         float scale) {                                                                            \
        bwd_kv<float, BR, BC>(q, k, v, segments, dout, lse, delta, dk, dv, dk_part, dv_part, H, Hkv, Tq, Tk, D,    \
                              causal, scale);                                                                      \
    }

#define FLASH_TC(T, S, W)                                                                                          \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                         \
        flash_fwd_##S##_d##W(const T *q, const T *k, const T *v, const unsigned int *segments, T *out, float *lse, \
                             int H, int Hkv, int Tq, int Tk, int D, int causal, float scale) {                     \
        fwd_tc<T, W / 16>(q, k, v, segments, out, lse, H, Hkv, Tq, Tk, D, causal, scale);                          \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                         \
        flash_bwd_q_##S##_d##W(const T *q, const T *k, const T *v, const unsigned int *segments, const T *dout,   \
                               const float *lse, const float *delta, T *dq, int H, int Hkv, int Tq, int Tk, int D, \
                               int causal, float scale) {                                                          \
        bwd_q_tc<T, W / 16>(q, k, v, segments, dout, lse, delta, dq, H, Hkv, Tq, Tk, D, causal, scale);            \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                         \
        flash_bwd_kv_##S##_d##W(const T *q, const T *k, const T *v, const unsigned int *segments, const T *dout,  \
                                const float *lse, const float *delta, T *dk, T *dv, float *dk_part,               \
                                float *dv_part, int H, int Hkv, int Tq, int Tk, int D, int causal, float scale) {  \
        bwd_kv_tc<T, W / 16>(q, k, v, segments, dout, lse, delta, dk, dv, dk_part, dv_part, H, Hkv, Tq, Tk, D,     \
                             causal, scale);                                                                       \
    }

FLASH_ANY(float, f32)
FLASH_ANY(bf16, bf16)
FLASH_ANY(f16, f16)
FLASH_F32(32, 32)
FLASH_TC(bf16, bf16, 32)
FLASH_TC(bf16, bf16, 64)
FLASH_TC(bf16, bf16, 96)
FLASH_TC(bf16, bf16, 128)
FLASH_TC(f16, f16, 32)
FLASH_TC(f16, f16, 64)
FLASH_TC(f16, f16, 96)
FLASH_TC(f16, f16, 128)
