#pragma once
// float8_e4m3fn conversion and the scale rules of the blockwise FP8 recipe (docs/DESIGN.md,
// "Blockwise FP8"): a block of values with largest magnitude `amax` is stored as
// fp8(x * (1 / scale)), the reciprocal rounded once, and read back as fp8 * scale.
#include <cstdint>
#include <cuda_fp16.h>

namespace deep_gemm::ptx {

constexpr float kE4M3Max = 448.0f;

// Two floats to two e4m3 values, round to nearest even, saturating at +-448: `lo` in the low byte.
__device__ __forceinline__ uint16_t pack_e4m3x2(float lo, float hi) {
    uint16_t out;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(out) : "f"(hi), "f"(lo));
    return out;
}

// Four floats to four e4m3 values, element 0 in the low byte.
__device__ __forceinline__ uint32_t pack_e4m3x4(float a, float b, float c, float d) {
    return static_cast<uint32_t>(pack_e4m3x2(a, b)) | (static_cast<uint32_t>(pack_e4m3x2(c, d)) << 16);
}

// Eight e4m3 values (element 0 in the low byte) as floats, exactly (through f16, which holds them).
__device__ __forceinline__ void unpack_e4m3x8(const uint2& packed, float (&out)[8]) {
    const uint32_t words[2] = {packed.x, packed.y};
    #pragma unroll
    for (uint32_t w = 0; w < 2; ++w) {
        #pragma unroll
        for (uint32_t half = 0; half < 2; ++half) {
            uint32_t f16x2;
            const uint16_t pair = static_cast<uint16_t>(words[w] >> (16 * half));
            asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(f16x2) : "h"(pair));
            const float2 v = __half22float2(*reinterpret_cast<const __half2*>(&f16x2));
            out[4 * w + 2 * half] = v.x, out[4 * w + 2 * half + 1] = v.y;
        }
    }
}

// The smallest normal fp32: a subnormal scale's reciprocal would be inf (0 * inf = NaN).
constexpr float kMinScale = 1.17549435e-38f;

// amax / kE4M3Max, rounded as the IEEE division rounds for every finite amax whose quotient is a
// normal float: the product with RN(1 / 448) and one FMA correction, a few instructions where the
// division takes a range check and a slow path (tests/test_fp8_quant.py checks every significand).
__device__ __forceinline__ float amax_over_e4m3_max(float amax) {
    constexpr float kInv = 1.0f / kE4M3Max;
    const float q = __fmul_rn(amax, kInv);
    return __fmaf_rn(__fmaf_rn(-q, kE4M3Max, amax), kInv, q);
}

// The scale that maps `amax` onto e4m3's largest value, at least kMinScale; 1 for an all-zero block
// (and a NaN amax), infinite for an infinite one, as the IEEE division gives it.
struct Fp32Scale {
    __device__ __forceinline__ static float of(float amax) {
        const float scale = fmaxf(amax_over_e4m3_max(amax), kMinScale);  // (selects, not branches)
        return amax > 0.0f ? (amax < INFINITY ? scale : amax) : 1.0f;
    }
};

// Fp32Scale rounded up to a power of two, so that x / scale and fp8 * scale are exact scalings.
struct Pow2Scale {
    __device__ __forceinline__ static float of(float amax) {
        const uint32_t bits = __float_as_uint(Fp32Scale::of(amax));  // (a normal, positive float)
        return __uint_as_float((bits + 0x7FFFFFu) & 0xFF800000u);
    }
};

// 1 / scale rounded once, as the IEEE reciprocal (`__frcp_rn`) rounds it, for a scale of the rules
// above (a normal float below 2^126, or inf): the approximate reciprocal and one Newton step, which
// is the IEEE reciprocal's own path for that range, without its range check and slow-path call;
// 0 for an infinite scale (tests/test_fp8_quant.py checks every scale a bf16 amax gives).
__device__ __forceinline__ float reciprocal_of_scale(float scale) {
    float approx;
    asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(approx) : "f"(scale));
    const float residual = __fmaf_rn(approx, scale, -1.0f);
    const float inv = __fmaf_rn(approx, -residual, approx);
    return scale < INFINITY ? inv : 0.0f;
}

}  // namespace deep_gemm::ptx
