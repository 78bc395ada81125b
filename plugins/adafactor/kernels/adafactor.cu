// Adafactor on NVIDIA GPUs, for `step_cuda` in src/gpu.rs: the CPU step of src/lib.rs and
// src/reduce.rs, operation for operation, on the same state (the optional f32 first moment,
// the f32 row and column averages or the per-element average, the u32 count), so that a step
// on the GPU gives the CPU's bits and a checkpoint moves between devices without changing the
// run.
//
// What makes the bits equal:
// - build.rs compiles this file with --fmad=false (no fused multiply-adds, in f32 or f64: the
//   CPU rounds every product) and nvcc's defaults: IEEE division and square root, no flush of
//   subnormals to zero, no fast math;
// - every expression is the CPU's, in its order, in the same type (f32 or f64);
// - every sum is added in the CPU's order (src/reduce.rs): a row tile's terms (a vector's
//   chunk of 1024) in 32 strided f32 lanes, one warp's (`lanes_in_order`); a column in f32
//   over blocks of 64 rows, the blocks in f64 in order; Σθ², Σ U² and Σ R in the 32-ary tree
//   (`tree_sum`, ava/common.cuh) over the per-tile-row, per-chunk or per-row values;
// - 1 − t^decay_rate takes `pow_t`, the CPU's `reduce::pow` line for line (no libm).
//
// The launches, per parameter, all on the host's stream:
//   adafactor_count                         the parameter's step count t += 1 (saturating)
//   a matrix (rank ≥ 2, a batch of [rows, cols]):
//     adafactor_rows                        R, and each tile row's Σθ²
//     adafactor_cols                        C, its reciprocals; and mean(R) per matrix
//     adafactor_usq                         each tile row's Σ U²
//   a vector (rank ≤ 1):
//     adafactor_full                        V, and each chunk's Σ U² and Σθ²
//   adafactor_scalars                       the trees, lr_t, the clip: the update's scale
//   adafactor_apply_factored | adafactor_apply_full     θ (and the first moment)
// The plugin's scratch (src/gpu.rs's `Layout`) holds the per-tile-row (per-chunk) values, the
// trees' levels, mean(R), the columns' reciprocals and the scalars.

#include <ava/common.cuh>
#include <math.h>
#include <stdint.h>

// Columns per tile of a row's sums (`TILE` in src/lib.rs): a row's average is rounded to f32
// after each tile.
#define TILE 4096
// Rows per f32 block of a column's sum (`ROW_BLOCK`).
#define ROW_BLOCK 64
// Elements per chunk of a vector's sums (`reduce::CHUNK`).
#define CHUNK 1024
// Warps (rows, chunks) per block of adafactor_rows, adafactor_usq, adafactor_full.
#define WARPS 8
// Row blocks per round of adafactor_cols: its warps, each a block of 64 rows.
#define COL_GROUPS 8

// `reduce::pow`: t^e for t >= 1 and e < 0 as exp(e·ln t), from f64 operations that round as
// the CPU's do. The constants are fdlibm's ln2_hi and ln2_lo, 1/ln 2 and √2 rounded to f64.
__device__ double pow_t(double t, double e) {
    const unsigned long long bits = (unsigned long long)__double_as_longlong(t);
    int k = (int)((bits >> 52) & 0x7ff) - 1023;
    double m = __longlong_as_double((long long)((bits & ((1ull << 52) - 1)) | (1023ull << 52)));
    if (m > __longlong_as_double(0x3FF6A09E667F3BCDll)) {
        m *= 0.5;
        k += 1;
    }
    const double ln2_hi = __longlong_as_double(0x3FE62E42FEE00000ll);
    const double ln2_lo = __longlong_as_double(0x3DEA39EF35793C76ll);
    const double s = (m - 1.0) / (m + 1.0);
    const double z = s * s;
    double p = 1.0 / 23.0;
    for (int i = 10; i >= 0; --i) p = p * z + 1.0 / (double)(2 * i + 1);
    const double kd = (double)k;
    const double ln = kd * ln2_hi + (kd * ln2_lo + 2.0 * s * p);
    const double x = e * ln;
    if (x < -708.0) return 0.0;
    const double j = floor(x * __longlong_as_double(0x3FF71547652B82FEll) + 0.5);
    const double r = (x - j * ln2_hi) - j * ln2_lo;
    double q = 1.0;
    for (int i = 17; i >= 1; --i) q = 1.0 + r / (double)i * q;
    return q * __longlong_as_double((long long)((unsigned long long)((long long)j + 1023) << 52));
}

// β2_t = 1 − t^decay_rate from the updated count (after adafactor_count), as `SecondMoment`:
// keep = β2_t, add = 1 − β2_t.
__device__ void second_moment(const unsigned int *count, double decay_rate, double *keep, double *add) {
    const double beta2 = 1.0 - pow_t((double)count[0], decay_rate);
    *keep = beta2;
    *add = 1.0 - beta2;
}

// count[0] += 1, saturating (`t[0].saturating_add(1)`). Launch: grid (1), block (1).
extern "C" __global__ void adafactor_count(unsigned int *count) {
    if (count[0] != 0xffffffffu) count[0] += 1;
}

// Pass 1 of a matrix, its rows (`SecondMoment::factored`, `accumulate_row`): a warp per row of
// the batch's rows_total = batch·rows; per column tile, Σ g² (and Σθ² when scale_w) in the
// warp's 32 lanes, then R_i ← keep·R_i + add·(Σ/cols + eps1) at the first tile and
// R_i + add·Σ/cols at the next ones, rounded to f32 after each; the tile row's Σθ² into
// w2[(b·tiles + tile)·rows + i], the CPU's order of its tree.
// Launch: grid (ceil(rows_total / 8)), block (256). w, g (rows_total·cols,) f32; r
// (rows_total,) f32; w2 (rows_total·tiles,) f64; count (1,) u32.
extern "C" __global__ void __launch_bounds__(256)
    adafactor_rows(const float *__restrict__ w, const float *__restrict__ g, float *__restrict__ r,
                   double *__restrict__ w2, const unsigned int *__restrict__ count, size_t rows_total, size_t rows,
                   size_t cols, double decay_rate, double eps1, int scale_w) {
    __shared__ double s_keep, s_add;
    if (threadIdx.x == 0) second_moment(count, decay_rate, &s_keep, &s_add);
    __syncthreads();
    const double keep = s_keep, add = s_add;
    const unsigned int lane = threadIdx.x & 31;
    const size_t q = (size_t)blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (q >= rows_total) return; // the whole warp
    const size_t b = q / rows, i = q % rows, tiles = (cols + TILE - 1) / TILE;
    const float *gr = g + q * cols, *wr = w + q * cols;
    float rq = r[q];
    for (size_t tile = 0; tile < tiles; ++tile) {
        const size_t j0 = tile * TILE, width = cols - j0 < TILE ? cols - j0 : TILE;
        float gl = 0.0f, wl = 0.0f;
        for (size_t j = lane; j < width; j += 32) {
            const float x = gr[j0 + j];
            gl += x * x;
            if (scale_w) {
                const float y = wr[j0 + j];
                wl += y * y;
            }
        }
        const double part = lanes_in_order(gl) / (double)cols;
        const double old = (double)rq;
        rq = (float)(tile == 0 ? keep * old + add * (part + eps1) : old + add * part);
        if (scale_w) {
            const double sw = lanes_in_order(wl);
            if (lane == 0) w2[(b * tiles + tile) * rows + i] = sw;
        }
    }
    if (lane == 0) r[q] = rq;
}

// Pass 1 of a matrix, its columns: per column j, Σ g² over each block of 64 rows in f32 (rows
// in order), those in f64 (blocks in order), then C_j ← keep·C_j + add·(Σ/rows + eps1) in
// f64, rounded to f32; with it 1/C_j and 1/√C_j (f64, rounded to f32) for passes 2 and 3.
// A block takes 32 columns, its 8 warps 8 row blocks at a time (warp k the k-th), and warp 0
// adds their sums in order. The last block of each matrix computes mean(R) instead (R is final:
// adafactor_rows ran): the tree over R's rows, over rows (`reduce::tree_mean`).
// Launch: grid (batch · (ceil(cols / 32) + 1)), block (256). g (batch·rows·cols,) f32;
// r (batch·rows,) f32; c, inv_c, inv_sqrt_c (batch·cols,) f32; mean_r (batch,) f64;
// ra (batch·ceil(rows / 32),) and rb (batch·ceil(rows / 1024),) f64 for mean(R)'s tree.
extern "C" __global__ void __launch_bounds__(256)
    adafactor_cols(const float *__restrict__ g, float *__restrict__ c, const float *__restrict__ r,
                   float *__restrict__ inv_c, float *__restrict__ inv_sqrt_c, double *__restrict__ mean_r,
                   double *__restrict__ ra, double *__restrict__ rb, const unsigned int *__restrict__ count,
                   size_t rows, size_t cols, double decay_rate, double eps1) {
    const size_t col_blocks = (cols + 31) / 32;
    const size_t b = blockIdx.x / (col_blocks + 1), cb = blockIdx.x % (col_blocks + 1);
    if (cb == col_blocks) {
        const float *rr = r + b * rows;
        const size_t na = (rows + 31) / 32, nb = (rows + 1023) / 1024;
        const double sum = tree_sum([&](size_t i) { return (double)rr[i]; }, rows, ra + b * na, rb + b * nb);
        if (threadIdx.x == 0) mean_r[b] = sum / (double)rows;
        return;
    }
    __shared__ double s_keep, s_add;
    __shared__ float part[COL_GROUPS][32];
    if (threadIdx.x == 0) second_moment(count, decay_rate, &s_keep, &s_add);
    __syncthreads();
    const unsigned int lane = threadIdx.x & 31, group = threadIdx.x >> 5;
    const size_t j = cb * 32 + lane;
    const bool live = j < cols;
    const float *gm = g + b * rows * cols;
    const size_t row_blocks = (rows + ROW_BLOCK - 1) / ROW_BLOCK;
    double acc = 0.0;
    for (size_t first = 0; first < row_blocks; first += COL_GROUPS) {
        const size_t blk = first + group;
        float s = 0.0f;
        if (live && blk < row_blocks) {
            const size_t end = blk * ROW_BLOCK + ROW_BLOCK < rows ? blk * ROW_BLOCK + ROW_BLOCK : rows;
            for (size_t i = blk * ROW_BLOCK; i < end; ++i) {
                const float x = gm[i * cols + j];
                s += x * x;
            }
        }
        part[group][lane] = s;
        __syncthreads();
        if (group == 0)
            for (unsigned int k = 0; k < COL_GROUPS && first + k < row_blocks; ++k) acc += (double)part[k][lane];
        __syncthreads();
    }
    if (group == 0 && live) {
        const size_t at = b * cols + j;
        const float cj = (float)(s_keep * (double)c[at] + s_add * (acc / (double)rows + eps1));
        c[at] = cj;
        inv_c[at] = (float)(1.0 / (double)cj);
        inv_sqrt_c[at] = (float)(1.0 / sqrt((double)cj));
    }
}

// Pass 2 of a matrix (`factored_sum_sq`, `weighted_sum_sq`): a warp per row; per column tile,
// Σ g²·(1/C_j) in the warp's 32 lanes (f32), times mean(R)/R_i in f64, into
// u2[(b·tiles + tile)·rows + i].
// Launch: grid (ceil(rows_total / 8)), block (256). g (rows_total·cols,) f32; r (rows_total,)
// f32; inv_c (batch·cols,) f32; mean_r (batch,) f64; u2 (rows_total·tiles,) f64.
extern "C" __global__ void __launch_bounds__(256)
    adafactor_usq(const float *__restrict__ g, const float *__restrict__ r, const float *__restrict__ inv_c,
                  const double *__restrict__ mean_r, double *__restrict__ u2, size_t rows_total, size_t rows,
                  size_t cols) {
    const unsigned int lane = threadIdx.x & 31;
    const size_t q = (size_t)blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (q >= rows_total) return; // the whole warp
    const size_t b = q / rows, i = q % rows, tiles = (cols + TILE - 1) / TILE;
    const double ratio = mean_r[b] / (double)r[q];
    const float *gr = g + q * cols, *ic = inv_c + b * cols;
    for (size_t tile = 0; tile < tiles; ++tile) {
        const size_t j0 = tile * TILE, width = cols - j0 < TILE ? cols - j0 : TILE;
        float acc = 0.0f;
        for (size_t j = lane; j < width; j += 32) {
            const float x = gr[j0 + j];
            acc += x * x * ic[j0 + j];
        }
        const double ws = lanes_in_order(acc);
        if (lane == 0) u2[(b * tiles + tile) * rows + i] = ws * ratio;
    }
}

// Pass 1 of a vector (`SecondMoment::full`): a warp per chunk of 1024 elements; per element
// V ← keep·V + add·(g² + eps1) in f32, then Σ g²/V (and Σθ² when scale_w) in the warp's 32
// lanes, into u2[chunk] and w2[chunk].
// Launch: grid (ceil(ceil(n / 1024) / 8)), block (256). w, g, v (n,) f32; w2, u2
// (ceil(n / 1024),) f64; count (1,) u32.
extern "C" __global__ void __launch_bounds__(256)
    adafactor_full(const float *__restrict__ w, const float *__restrict__ g, float *__restrict__ v,
                   double *__restrict__ w2, double *__restrict__ u2, const unsigned int *__restrict__ count, size_t n,
                   double decay_rate, double eps1, int scale_w) {
    __shared__ double s_keep, s_add;
    if (threadIdx.x == 0) second_moment(count, decay_rate, &s_keep, &s_add);
    __syncthreads();
    const float keep = (float)s_keep, add = (float)s_add, eps = (float)eps1;
    const unsigned int lane = threadIdx.x & 31;
    const size_t chunk = (size_t)blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (chunk >= (n + CHUNK - 1) / CHUNK) return; // the whole warp
    const size_t start = chunk * CHUNK, len = n - start < CHUNK ? n - start : CHUNK;
    float ul = 0.0f, wl = 0.0f;
    for (size_t j = lane; j < len; j += 32) {
        const size_t i = start + j;
        const float gi = g[i];
        const float vi = keep * v[i] + add * (gi * gi + eps);
        v[i] = vi;
        ul += gi * gi / vi;
        if (scale_w) {
            const float wi = w[i];
            wl += wi * wi;
        }
    }
    const double su = lanes_in_order(ul), sw = lanes_in_order(wl);
    if (lane == 0) {
        u2[chunk] = su;
        w2[chunk] = sw;
    }
}

// The update's scalars (src/lib.rs: `step_size` and `Apply`): θ's scale over the update.
struct Scalars {
    double scale; // lr_t / max(1, rms(U) / clip_threshold)
    float decay;  // 1 − λ·lr_t
};

// Σθ² (when scale_parameter) and Σ U² as trees over the `len` values of pass 1 and 2, then
// lr_t = (relative_step ? min(warmup_init ? 1e-6·t : 1e-2, 1/√t) : lr) · (scale_parameter ?
// max(eps2, √(Σθ²/n)) : 1), rms(U) = √(Σ U²/n), into *out.
// Launch: grid (1), block (1024). w2, u2 (len,) f64 (w2 unread without scale_parameter); ta
// (ceil(len / 32),) and tb (ceil(len / 1024),) f64; count (1,) u32.
extern "C" __global__ void __launch_bounds__(1024)
    adafactor_scalars(const double *__restrict__ w2, const double *__restrict__ u2, size_t len,
                      double *__restrict__ ta, double *__restrict__ tb, const unsigned int *__restrict__ count,
                      size_t n, double lr, double wd, double eps2, double clip_threshold, int relative_step,
                      int warmup_init, int scale_parameter, Scalars *__restrict__ out) {
    const double sum_w2 = scale_parameter ? tree_sum([&](size_t i) { return w2[i]; }, len, ta, tb) : 0.0;
    const double sum_u2 = tree_sum([&](size_t i) { return u2[i]; }, len, ta, tb);
    if (threadIdx.x != 0) return;
    const double t = (double)count[0];
    const double base = relative_step ? fmin(warmup_init ? 1e-6 * t : 1e-2, 1.0 / sqrt(t)) : lr;
    const double lr_t = scale_parameter ? base * fmax(eps2, sqrt(sum_w2 / (double)n)) : base;
    const double rms_u = sqrt(sum_u2 / (double)n);
    out->scale = lr_t / fmax(rms_u / clip_threshold, 1.0);
    out->decay = (float)(1.0 - wd * lr_t);
}

// Pass 3 of a matrix (`Apply::factored`): row_i = scale·√(mean(R)/R_i) in f64, rounded to f32
// once per row; per element u = row_i·g·(1/√C_j), then θ ← θ·decay − u, or with a first moment
// M ← β1·M + (1 − β1)·u, θ ← θ·decay − M (m NULL: none).
// Launch: grid (batch·rows, ceil(cols / 256)), block (256). w, g, m (batch·rows·cols,) f32;
// r (batch·rows,) f32; inv_sqrt_c (batch·cols,) f32; mean_r (batch,) f64.
extern "C" __global__ void __launch_bounds__(256)
    adafactor_apply_factored(float *__restrict__ w, const float *__restrict__ g, float *__restrict__ m,
                             const float *__restrict__ r, const float *__restrict__ inv_sqrt_c,
                             const double *__restrict__ mean_r, const Scalars *__restrict__ k, size_t rows,
                             size_t cols, float b1) {
    __shared__ float s_row;
    const size_t q = blockIdx.x, b = q / rows;
    if (threadIdx.x == 0) s_row = (float)(k->scale * sqrt(mean_r[b] / (double)r[q]));
    __syncthreads();
    const size_t j = (size_t)blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= cols) return;
    const size_t at = q * cols + j;
    const float decay = k->decay;
    const float u = s_row * g[at] * inv_sqrt_c[b * cols + j];
    if (m) {
        const float mi = b1 * m[at] + (1.0f - b1) * u;
        m[at] = mi;
        w[at] = w[at] * decay - mi;
    } else {
        w[at] = w[at] * decay - u;
    }
}

// Pass 3 of a vector (`Apply::full`): u = scale·g/√V (scale rounded to f32), then as
// adafactor_apply_factored. Launch: grid (ceil(n / 256)), block (256). w, g, m, v (n,) f32.
extern "C" __global__ void __launch_bounds__(256)
    adafactor_apply_full(float *__restrict__ w, const float *__restrict__ g, float *__restrict__ m,
                         const float *__restrict__ v, const Scalars *__restrict__ k, size_t n, float b1) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float scale = (float)k->scale, decay = k->decay;
    const float u = scale * g[i] / sqrtf(v[i]);
    if (m) {
        const float mi = b1 * m[i] + (1.0f - b1) * u;
        m[i] = mi;
        w[i] = w[i] * decay - mi;
    } else {
        w[i] = w[i] * decay - u;
    }
}
