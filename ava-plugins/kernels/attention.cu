// The built-in attention kernel `standard` on NVIDIA GPUs: the dense algorithm of
// ava-kernels/src/attention (the CPU reference), one query row per block. It saves the
// probabilities P (B, H, Tq, Tk) f32 for backward, as on the CPU; backward keeps
// dS = P ∘ (dP − rowsum(dO ∘ O)) in the workspace (B, H, Tq, Tk) f32, so the key-side
// gradients are sums over rows in a fixed order (no atomics: the same bits every run).
//
//   S = scale · Q Kᵀ, masked: query i (position p = i + Tk − Tq) sees key j when j <= p
//   (causal) and, with segments, segments[b][j] == segments[b][p]
//   P = softmax(S)   O = P V
//   dP = dO Vᵀ   dS = P ∘ (dP − Δ), Δ_i = Σ_j P_ij dP_ij   dQ = scale · dS K
//   dK = scale · dSᵀ Q   dV = Pᵀ dO   (summed over the query heads of a key/value head)
//
// This is the reference on the GPU, not the fast path: `flash` is. Inputs and outputs are in
// the run's compute type (f32, bf16 or f16), computed in f32.

#include <ava/common.cuh>

// Largest head dimension the row kernels hold in shared memory.
#define MAX_D 256

// Whether query i sees key j of sequence b.
__device__ __forceinline__ bool visible(int i, int j, int Tq, int Tk, int causal, const unsigned int *segments, int b) {
    const int p = i + Tk - Tq;
    if (causal && j > p) return false;
    if (segments && segments[(size_t)b * Tk + j] != segments[(size_t)b * Tk + p]) return false;
    return true;
}

// Forward. Launch: grid (B·H·Tq), block (ROW_THREADS = 128), one query row a block.
// q, out (B, H, Tq, D); k, v (B, Hkv, Tk, D); P (B, H, Tq, Tk) f32; segments (B, Tk) or NULL.
template <typename T>
__device__ void dense_fwd(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                          const unsigned int *__restrict__ segments, T *__restrict__ out, float *__restrict__ P, int H,
                          int Hkv, int Tq, int Tk, int D, int causal, float scale) {
    __shared__ float scratch[32];
    __shared__ float qs[MAX_D];
    const size_t row = blockIdx.x; // (b, h, i)
    const int i = (int)(row % Tq);
    const int h = (int)((row / Tq) % H);
    const int b = (int)(row / ((size_t)Tq * H));
    const int hk = h / (H / Hkv);
    const T *qr = q + row * D;
    const T *kb = k + ((size_t)b * Hkv + hk) * Tk * D;
    const T *vb = v + ((size_t)b * Hkv + hk) * Tk * D;
    float *pr = P + row * Tk;
    for (int d = threadIdx.x; d < D; d += blockDim.x) qs[d] = load(qr[d]);
    __syncthreads();
    float m = -INFINITY;
    for (int j = threadIdx.x; j < Tk; j += blockDim.x) {
        float s = -INFINITY;
        if (visible(i, j, Tq, Tk, causal, segments, b)) {
            s = 0.0f;
            const T *kr = kb + (size_t)j * D;
            for (int d = 0; d < D; d++) s += qs[d] * load(kr[d]);
            s *= scale;
        }
        pr[j] = s;
        m = fmaxf(m, s);
    }
    m = block_max(m, scratch);
    float sum = 0.0f;
    for (int j = threadIdx.x; j < Tk; j += blockDim.x) {
        const float e = pr[j] == -INFINITY ? 0.0f : expf(pr[j] - m);
        pr[j] = e;
        sum += e;
    }
    sum = block_sum(sum, scratch);
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (int j = threadIdx.x; j < Tk; j += blockDim.x) pr[j] *= inv;
    __syncthreads();
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float o = 0.0f;
        for (int j = 0; j < Tk; j++) o += pr[j] * load(vb[(size_t)j * D + d]);
        out[row * D + d] = store<T>(o);
    }
}

// Backward, query side: dS into the workspace and dQ. Launch: as dense_fwd.
// dout, out, dq (B, H, Tq, D); dS (B, H, Tq, Tk) f32.
template <typename T>
__device__ void dense_bwd_rows(const T *__restrict__ k, const T *__restrict__ v, const T *__restrict__ out,
                               const T *__restrict__ dout, const float *__restrict__ P, float *__restrict__ dS,
                               T *__restrict__ dq, int H, int Hkv, int Tq, int Tk, int D, float scale) {
    __shared__ float scratch[32];
    __shared__ float dos[MAX_D];
    const size_t row = blockIdx.x;
    const int h = (int)((row / Tq) % H);
    const int b = (int)(row / ((size_t)Tq * H));
    const int hk = h / (H / Hkv);
    const T *kb = k + ((size_t)b * Hkv + hk) * Tk * D;
    const T *vb = v + ((size_t)b * Hkv + hk) * Tk * D;
    const float *pr = P + row * Tk;
    float *sr = dS + row * Tk;
    float delta = 0.0f; // Δ_i = dO_i · O_i (= Σ_j P_ij dP_ij)
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        const float g = load(dout[row * D + d]);
        dos[d] = g;
        delta += g * load(out[row * D + d]);
    }
    delta = block_sum(delta, scratch); // also orders the writes of dos before the reads
    for (int j = threadIdx.x; j < Tk; j += blockDim.x) {
        const float p = pr[j];
        float ds = 0.0f;
        if (p != 0.0f) {
            float dp = 0.0f;
            const T *vr = vb + (size_t)j * D;
            for (int d = 0; d < D; d++) dp += dos[d] * load(vr[d]);
            ds = p * (dp - delta);
        }
        sr[j] = ds;
    }
    __syncthreads();
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float g = 0.0f;
        for (int j = 0; j < Tk; j++) g += sr[j] * load(kb[(size_t)j * D + d]);
        dq[row * D + d] = store<T>(g * scale);
    }
}

// Backward, key side: dK and dV of one key row of one key/value head, summed over its query
// heads and rows in order. Launch: grid (B·Hkv·Tk), block (ROW_THREADS).
// q, dout (B, H, Tq, D); dk, dv (B, Hkv, Tk, D); P, dS (B, H, Tq, Tk) f32.
template <typename T>
__device__ void dense_bwd_keys(const T *__restrict__ q, const T *__restrict__ dout, const float *__restrict__ P,
                               const float *__restrict__ dS, T *__restrict__ dk, T *__restrict__ dv, int H, int Hkv,
                               int Tq, int Tk, int D, float scale) {
    const size_t key_row = blockIdx.x; // (b, hk, j)
    const int j = (int)(key_row % Tk);
    const int hk = (int)((key_row / Tk) % Hkv);
    const int b = (int)(key_row / ((size_t)Tk * Hkv));
    const int group = H / Hkv;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float gk = 0.0f, gv = 0.0f;
        for (int g = 0; g < group; g++) {
            const size_t head = (size_t)b * H + hk * group + g;
            for (int i = 0; i < Tq; i++) {
                const size_t r = head * Tq + i;
                const float p = P[r * Tk + j];
                if (p == 0.0f) continue;
                gk += dS[r * Tk + j] * load(q[r * D + d]);
                gv += p * load(dout[r * D + d]);
            }
        }
        dk[key_row * D + d] = store<T>(gk * scale);
        dv[key_row * D + d] = store<T>(gv);
    }
}

#define DENSE(T, S)                                                                                               \
    extern "C" __global__ void dense_fwd_##S(const T *q, const T *k, const T *v, const unsigned int *segments,    \
                                             T *out, float *P, int H, int Hkv, int Tq, int Tk, int D, int causal, \
                                             float scale) {                                                       \
        dense_fwd<T>(q, k, v, segments, out, P, H, Hkv, Tq, Tk, D, causal, scale);                                \
    }                                                                                                             \
    extern "C" __global__ void dense_bwd_rows_##S(const T *k, const T *v, const T *out, const T *dout,            \
                                                  const float *P, float *dS, T *dq, int H, int Hkv, int Tq,       \
                                                  int Tk, int D, float scale) {                                   \
        dense_bwd_rows<T>(k, v, out, dout, P, dS, dq, H, Hkv, Tq, Tk, D, scale);                                  \
    }                                                                                                             \
    extern "C" __global__ void dense_bwd_keys_##S(const T *q, const T *dout, const float *P, const float *dS,     \
                                                  T *dk, T *dv, int H, int Hkv, int Tq, int Tk, int D,            \
                                                  float scale) {                                                  \
        dense_bwd_keys<T>(q, dout, P, dS, dk, dv, H, Hkv, Tq, Tk, D, scale);                                      \
    }

DENSE(float, f32)
DENSE(bf16, bf16)
DENSE(f16, f16)
