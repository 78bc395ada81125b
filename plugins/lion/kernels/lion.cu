// Lion's step on NVIDIA GPUs, for `step_cuda` in src/lib.rs: the f32 arithmetic of the CPU's
// `step`, in the same order, one thread per element. build.rs compiles it with --fmad=false
// (no fused multiply-adds: the CPU rounds each product) and nvcc's default correctly rounded
// arithmetic (no fast math, no flush to zero), so a step on the GPU gives the CPU's bits and a
// checkpoint moves between devices without changing the run.

// torch.sign by comparisons: −1, 0 or +1 (±0 stays itself, NaN stays NaN), as `sign` in
// src/lib.rs.
__device__ __forceinline__ float sign(float x) { return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : x); }

// g ← g·mul + add (the clipping factor as the host's scaled copy computed it:
// StepContext::grad_affine); c = β1·m + (1 − β1)·g;  θ ← θ·decay − lr·sign(c);
// m ← β2·m + (1 − β2)·g, with decay = 1 − lr·λ computed in f32 by the host as the CPU step does.
// Launch: grid (ceil(n / 256)), block (256), one thread per element. w, g, m (n,) f32.
extern "C" __global__ void lion_step(float *__restrict__ w, const float *__restrict__ g, float *__restrict__ m,
                                     size_t n, float lr, float decay, float beta1, float beta2, float mul,
                                     float add) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float gi = g[i] * mul + add, mi = m[i];
    const float c = beta1 * mi + (1.0f - beta1) * gi;
    w[i] = w[i] * decay - lr * sign(c);
    m[i] = beta2 * mi + (1.0f - beta2) * gi;
}
