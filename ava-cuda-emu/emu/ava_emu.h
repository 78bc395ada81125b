// Included before a CUDA C kernel file (`-include ava_emu.h`) to compile it as C++ for the
// CPU emulator (runtime.cpp, driven from Rust by the ava-cuda-emu crate): CUDA's keywords
// become plain C++, a block's threads become fibers that run one at a time between barriers,
// `__shared__` variables become statics (blocks run one after another), and the warp-level
// operations (shuffles, `__syncwarp`, `ldmatrix`, `mma.sync`) exchange values between the 32
// fibers of a warp as the PTX ISA specifies. The kernel's own source is compiled unchanged
// but for its inline PTX, which a kernel file wraps in `#ifdef AVA_EMULATE` (see flash.cu's
// `mma` namespace). Only full-warp masks are emulated.
#pragma once

#define AVA_EMULATE 1

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "ava_emu_types.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// Blocks run one after another, so a block's shared variables can be statics.
#define __shared__ static
// A kernel's dynamic shared memory (`extern __shared__ T name[]` on the device): the
// emulator's arena of the launch's size, filled with 0xff bytes (NaN floats) at each block.
#define AVA_DYNAMIC_SHARED(name) unsigned char *const name = ava_emu_dynamic_shared()

extern "C" {
// The running fiber's indices and the launch's shape (set by the scheduler at each switch).
extern uint3 ava_emu_thread_idx, ava_emu_block_idx;
extern dim3 ava_emu_block_dim, ava_emu_grid_dim;
unsigned char *ava_emu_dynamic_shared();
// `__syncthreads()`: the fiber waits until every thread of the block arrives.
void ava_emu_sync_block();
// The fiber waits until every lane of its warp arrives at a warp operation; `op` names it
// (`__syncwarp`, a shuffle, ...), and lanes waiting at different operations fail the launch.
void ava_emu_sync_warp(const char *op);
// Posts `mine` (an address on the caller's stack) for the warp's operation `op` and waits
// for every lane; returns the 32 lanes' addresses (null for a lane the block does not have).
// The caller reads what it needs, then calls ava_emu_sync_warp(AVA_EMU_EXCHANGED) before its
// value may go out of scope.
const void *const *ava_emu_warp_post(const void *mine, const char *op);
// Fails the launch with `why` (the fiber does not return).
[[noreturn]] void ava_emu_fail(const char *why);
// Whether [p, p + n) lies in the launch's dynamic shared memory.
int ava_emu_in_shared(const void *p, size_t n);
}

#define threadIdx ava_emu_thread_idx
#define blockIdx ava_emu_block_idx
#define blockDim ava_emu_block_dim
#define gridDim ava_emu_grid_dim
#define warpSize 32

inline void __syncthreads() { ava_emu_sync_block(); }

// The warp operation every lane ends an exchange with, once it has read the others' values.
#define AVA_EMU_EXCHANGED "the end of a warp exchange"

namespace ava_emu {
inline unsigned lane() { return (threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)) & 31u; }
inline void full(unsigned mask, const char *op) {
    if (mask != 0xffffffffu) ava_emu_fail(op); // the message names the operation
}
// Lane `src`'s value of `v` in the warp operation `op` (every lane calls it).
template <typename T> T from_lane(const T &v, unsigned src, const char *op) {
    const void *const *slots = ava_emu_warp_post(&v, op);
    if (!slots[src & 31u]) ava_emu_fail("a shuffle reads a lane the block does not have");
    const T r = *static_cast<const T *>(slots[src & 31u]);
    ava_emu_sync_warp(AVA_EMU_EXCHANGED);
    return r;
}
} // namespace ava_emu

inline void __syncwarp(unsigned mask = 0xffffffffu) {
    ava_emu::full(mask, "__syncwarp with a partial mask is not emulated");
    ava_emu_sync_warp("__syncwarp");
}
template <typename T> T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    ava_emu::full(mask, "__shfl_sync with a partial mask is not emulated");
    const unsigned l = ava_emu::lane(), base = l & ~(unsigned)(width - 1);
    return ava_emu::from_lane(v, base + ((unsigned)src & (unsigned)(width - 1)), "__shfl_sync");
}
template <typename T> T __shfl_xor_sync(unsigned mask, T v, int m, int width = 32) {
    ava_emu::full(mask, "__shfl_xor_sync with a partial mask is not emulated");
    const unsigned l = ava_emu::lane(), t = l ^ (unsigned)m;
    // A source outside the lane's group of `width` gives the lane's own value.
    return ava_emu::from_lane(v, (t & ~(unsigned)(width - 1)) == (l & ~(unsigned)(width - 1)) ? t : l,
                              "__shfl_xor_sync");
}
template <typename T> T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32) {
    ava_emu::full(mask, "__shfl_down_sync with a partial mask is not emulated");
    const unsigned l = ava_emu::lane();
    return ava_emu::from_lane(v, (l % width) + d < (unsigned)width ? l + d : l, "__shfl_down_sync");
}
template <typename T> T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32) {
    ava_emu::full(mask, "__shfl_up_sync with a partial mask is not emulated");
    const unsigned l = ava_emu::lane();
    return ava_emu::from_lane(v, (l % width) >= d ? l - d : l, "__shfl_up_sync");
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
    ava_emu::full(mask, "__ballot_sync with a partial mask is not emulated");
    const int mine = pred != 0;
    const void *const *slots = ava_emu_warp_post(&mine, "__ballot_sync");
    unsigned r = 0;
    for (unsigned j = 0; j < 32; ++j)
        if (slots[j] && *static_cast<const int *>(slots[j])) r |= 1u << j;
    ava_emu_sync_warp(AVA_EMU_EXCHANGED);
    return r;
}
inline int __any_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) != 0; }
inline int __all_sync(unsigned mask, int pred) { return __ballot_sync(mask, !pred) == 0; }

// The device's integer and float min/max overloads.
#define AVA_EMU_MINMAX(T)                                                                                  \
    inline T min(T a, T b) { return b < a ? b : a; }                                                        \
    inline T max(T a, T b) { return a < b ? b : a; }
AVA_EMU_MINMAX(int)
AVA_EMU_MINMAX(unsigned int)
AVA_EMU_MINMAX(long)
AVA_EMU_MINMAX(unsigned long)
AVA_EMU_MINMAX(long long)
AVA_EMU_MINMAX(unsigned long long)
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }

// The device's math intrinsics with their host equivalents (the fast `__` forms at full
// precision: a kernel whose result depends on their error has no exact CPU reference anyway).
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
inline unsigned __float_as_uint(float f) { return ava_emu::bits(f); }
inline float __uint_as_float(unsigned u) { return ava_emu::from_bits(u); }
inline int __float_as_int(float f) { return (int)ava_emu::bits(f); }
inline float __int_as_float(int i) { return ava_emu::from_bits((uint32_t)i); }
inline long long __double_as_longlong(double d) {
    long long r;
    memcpy(&r, &d, 8);
    return r;
}
inline double __longlong_as_double(long long v) {
    double r;
    memcpy(&r, &v, 8);
    return r;
}
inline int __double2hiint(double d) { return (int)(__double_as_longlong(d) >> 32); }
inline int __double2loint(double d) { return (int)(__double_as_longlong(d) & 0xffffffffll); }
inline double __hiloint2double(int hi, int lo) {
    return __longlong_as_double((long long)(((unsigned long long)(unsigned)hi << 32) | (unsigned)lo));
}
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }

namespace ava_emu {
// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 on a warp: D (16 × 8) +=
// A (16 × 16) · B (16 × 8). Fragments as the PTX ISA lays them out (g = lane / 4, t = lane %
// 4): A's registers {a0 a1} (row g, cols 2t, 2t+1), {a2 a3} (row g+8), {a4 a5} (row g, cols
// 2t+8, 2t+9), {a6 a7} (row g+8, cols 2t+8, 2t+9); B's {b0 b1} (rows 2t, 2t+1, col g), {b2 b3}
// (rows 2t+8, 2t+9); C/D's c0 c1 (row g, cols 2t, 2t+1), c2 c3 (row g+8). The lower-indexed
// element of a pair is the register's low 16 bits. Products are exact in f32 for 8-bit
// mantissas; the 16 terms are added in k order.
struct MmaFrag {
    uint32_t a[4];
    uint32_t b[2];
};
template <typename T> float half_at(uint32_t reg, unsigned hi) {
    T v;
    const uint16_t h = (uint16_t)(hi ? reg >> 16 : reg & 0xffffu);
    memcpy(&v, &h, 2);
    if constexpr (sizeof(T) == 2 && __is_same(T, __nv_bfloat16)) return __bfloat162float(v);
    else return __half2float(v);
}
template <typename T> void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    const MmaFrag mine{{a[0], a[1], a[2], a[3]}, {b0, b1}};
    const void *const *slots = ava_emu_warp_post(&mine, "mma.sync");
    for (unsigned j = 0; j < 32; ++j)
        if (!slots[j]) ava_emu_fail("mma.sync on a warp with missing lanes");
    auto frag = [&](unsigned l) -> const MmaFrag & { return *static_cast<const MmaFrag *>(slots[l]); };
    const unsigned l = lane(), g = l / 4, t = l % 4;
    for (unsigned i = 0; i < 4; ++i) {
        const unsigned row = g + 8 * (i / 2), col = 2 * t + (i % 2);
        float acc = d[i];
        for (unsigned k = 0; k < 16; ++k) {
            const unsigned al = (row % 8) * 4 + (k % 8) / 2, areg = (row >= 8) + 2 * (k >= 8);
            const unsigned bl = col * 4 + (k % 8) / 2, breg = k >= 8;
            acc += half_at<T>(frag(al).a[areg], k % 2) * half_at<T>(frag(bl).b[breg], k % 2);
        }
        d[i] = acc;
    }
    ava_emu_sync_warp(AVA_EMU_EXCHANGED);
}
// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lane l gives the address of row l % 8 of
// matrix l / 8 (16 bytes, 16-byte aligned, in shared memory); lane l receives in r[j] matrix
// j's (row l/4, cols 2(l%4), 2(l%4)+1), or with TRANS (rows 2(l%4), 2(l%4)+1, col l/4).
template <bool TRANS> void ldmatrix_x4(uint32_t (&r)[4], const void *row) {
    if (((uintptr_t)row & 15u) != 0) ava_emu_fail("ldmatrix: a row address is not 16-byte aligned");
    if (!ava_emu_in_shared(row, 16)) ava_emu_fail("ldmatrix: a row lies outside the block's shared memory");
    const void *const *slots = ava_emu_warp_post(&row, TRANS ? "ldmatrix.trans" : "ldmatrix");
    for (unsigned j = 0; j < 32; ++j)
        if (!slots[j]) ava_emu_fail("ldmatrix on a warp with missing lanes");
    auto elem = [&](unsigned m, unsigned rr, unsigned c) -> uint32_t {
        const uint16_t *p = static_cast<const uint16_t *>(*static_cast<const void *const *>(slots[8 * m + rr]));
        return p[c];
    };
    const unsigned l = lane();
    for (unsigned m = 0; m < 4; ++m) {
        const uint32_t lo = TRANS ? elem(m, 2 * (l % 4), l / 4) : elem(m, l / 4, 2 * (l % 4));
        const uint32_t hi = TRANS ? elem(m, 2 * (l % 4) + 1, l / 4) : elem(m, l / 4, 2 * (l % 4) + 1);
        r[m] = lo | (hi << 16);
    }
    ava_emu_sync_warp(AVA_EMU_EXCHANGED);
}
} // namespace ava_emu
