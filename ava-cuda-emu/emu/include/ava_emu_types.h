// The device types a kernel file names, for the CPU emulator (see ava_emu.h): CUDA's vector
// types (float2, uint4, ...) and bf16/f16 with the conversions the kernels call. Conversions
// to bf16/f16 round to nearest with ties to even, as the device's `_rn` intrinsics and the
// CPU engine's `Stored::store` do, so a kernel's stored bits can be compared exactly.
#pragma once

#include <stdint.h>
#include <string.h>

#define AVA_EMU_VEC2(name, T)                                                                              \
    struct alignas(2 * sizeof(T)) name {                                                                    \
        T x, y;                                                                                             \
    };                                                                                                      \
    inline name make_##name(T x, T y) { return name{x, y}; }
#define AVA_EMU_VEC4(name, T)                                                                              \
    struct alignas(4 * sizeof(T) > 16 ? 16 : 4 * sizeof(T)) name {                                          \
        T x, y, z, w;                                                                                       \
    };                                                                                                      \
    inline name make_##name(T x, T y, T z, T w) { return name{x, y, z, w}; }

AVA_EMU_VEC2(float2, float)
AVA_EMU_VEC2(double2, double)
AVA_EMU_VEC2(int2, int)
AVA_EMU_VEC2(uint2, unsigned int)
AVA_EMU_VEC4(float4, float)
AVA_EMU_VEC4(int4, int)
AVA_EMU_VEC4(uint4, unsigned int)

struct uint3 {
    unsigned int x, y, z;
};
struct dim3 {
    unsigned int x = 1, y = 1, z = 1;
};

namespace ava_emu {
inline uint32_t bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
inline float from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
} // namespace ava_emu

// bf16: the top 16 bits of an f32.
struct __nv_bfloat16 {
    uint16_t x;
};
struct alignas(4) __nv_bfloat162 {
    __nv_bfloat16 x, y;
};
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    const uint32_t u = ava_emu::bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{(uint16_t)((u >> 16) | 0x40u)}; // quiet NaN
    return __nv_bfloat16{(uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}
inline float __bfloat162float(__nv_bfloat16 b) { return ava_emu::from_bits((uint32_t)b.x << 16); }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { return __nv_bfloat16{u}; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.x; }
inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) {
    return __nv_bfloat162{__float2bfloat16_rn(lo), __float2bfloat16_rn(hi)};
}

// f16 through GCC's _Float16 (IEEE binary16; its conversions round to nearest, ties to even).
struct __half {
    uint16_t x;
};
struct alignas(4) __half2 {
    __half x, y;
};
inline __half __float2half_rn(float f) {
    _Float16 h = (_Float16)f;
    __half r;
    memcpy(&r.x, &h, 2);
    return r;
}
inline float __half2float(__half h) {
    _Float16 v;
    memcpy(&v, &h.x, 2);
    return (float)v;
}
inline __half __ushort_as_half(unsigned short u) { return __half{u}; }
inline unsigned short __half_as_ushort(__half h) { return h.x; }
inline __half2 __floats2half2_rn(float lo, float hi) { return __half2{__float2half_rn(lo), __float2half_rn(hi)}; }
