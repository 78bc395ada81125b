// The built-in optimizers' steps on NVIDIA GPUs: the same f32 arithmetic, in the same order,
// as src/builtin/adamw.rs and src/builtin/sgd.rs on the CPU. Built with --fmad=false (no
// fused multiply-adds the CPU does not do either) and CUDA's correctly rounded division and
// square root, so a step on the GPU gives the CPU's bits: a checkpoint moves between devices
// without changing the run.
//
// The per-parameter update count (`step`, one u32) lives on the device with the other state;
// a one-thread kernel advances it, in stream order, before (AdamW) or after (SGD, which reads
// "first update" from it) the element kernel.

#include <ava/common.cuh>
#include <stdint.h>

// powi: LLVM's, from ava/common.cuh (the CPU's f64::powi, bit for bit).

// count[0] += 1, saturating. Launch: grid (1), block (1).
extern "C" __global__ void count_update(unsigned int *count) {
    if (count[0] != 0xffffffffu) count[0] += 1;
}

// AdamW (torch.optim.AdamW), after count_update, on g·mul + add (the clipping factor as the
// host's scaled copy computed it: StepContext::grad_affine):
//   θ ← θ·(1 − lr·λ) − lr/bc1 · m / (√v / √bc2 + ε),  m, v the updated moments,
//   v replaced by max(v_max, v) with amsgrad (v_max == NULL without).
// Launch: grid (ceil(n / 256)), block (256). w, g, m, v, v_max (n,) f32; count (1,) u32.
extern "C" __global__ void adamw_step(float *__restrict__ w, const float *__restrict__ g, float *__restrict__ m,
                                      float *__restrict__ v, float *__restrict__ v_max,
                                      const unsigned int *__restrict__ count, size_t n, double lr, double weight_decay,
                                      double beta1, double beta2, double eps, float mul, float add) {
    __shared__ float scalars[3]; // step_size, √bc2, decay
    if (threadIdx.x == 0) {
        // The parameter's update number in i32, as the CPU's powi takes it.
        const unsigned int c = count[0];
        const int t = c > 0x7fffffffu ? 0x7fffffff : (int)c;
        scalars[0] = (float)(lr / (1.0 - powi(beta1, t)));
        scalars[1] = (float)sqrt(1.0 - powi(beta2, t));
        scalars[2] = (float)(1.0 - lr * weight_decay);
    }
    __syncthreads();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float step_size = scalars[0], bc2_sqrt = scalars[1], decay = scalars[2];
    const float b1 = (float)beta1, b2 = (float)beta2, e = (float)eps;
    const float gi = g[i] * mul + add;
    const float mi = b1 * m[i] + (1.0f - b1) * gi;
    const float vi = b2 * v[i] + (1.0f - b2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    float denom = vi;
    if (v_max) {
        denom = fmaxf(v_max[i], vi);
        v_max[i] = denom;
    }
    w[i] = w[i] * decay - step_size * mi / (sqrtf(denom) / bc2_sqrt + e);
}

// SGD without momentum (torch.optim.SGD): θ ← θ − lr·((g·mul + add) + λθ).
// Launch: grid (ceil(n / 256)), block (256). w, g (n,) f32.
extern "C" __global__ void sgd_step(float *__restrict__ w, const float *__restrict__ g, size_t n, float lr, float wd,
                                    float mul, float add) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float gi = (g[i] * mul + add) + wd * w[i];
    w[i] = w[i] - lr * gi;
}

// SGD with momentum, before count_update: g ← (g·mul + add) + λθ; b ← g at the parameter's
// first update (count 0), else μ·b + (1 − dampening)·g; θ ← θ − lr·(g + μ·b if nesterov,
// else b).
// Launch: grid (ceil(n / 256)), block (256). w, g, b (n,) f32; count (1,) u32.
extern "C" __global__ void sgd_momentum_step(float *__restrict__ w, const float *__restrict__ g,
                                             float *__restrict__ b, const unsigned int *__restrict__ count, size_t n,
                                             float lr, float wd, float mu, float keep, int nesterov,
                                             float mul, float add) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const bool first = count[0] == 0;
    const float gi = (g[i] * mul + add) + wd * w[i];
    const float bi = first ? gi : mu * b[i] + keep * gi;
    b[i] = bi;
    const float d = nesterov ? gi + mu * bi : bi;
    w[i] = w[i] - lr * d;
}
