#pragma once
// float8_e4m3fn conversion and the scale rules of the blockwise FP8 recipe (docs/DESIGN.md,
// "Blockwise FP8"): a block of values with largest magnitude `amax` is stored as
// fp8(x * (1 / scale)), the reciprocal rounded once, and read back as fp8 * scale.
#include <cstdint>

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

// The smallest normal fp32: a subnormal scale's reciprocal would be inf (0 * inf = NaN).
constexpr float kMinScale = 1.17549435e-38f;

// The scale that maps `amax` onto e4m3's largest value, at least kMinScale; 1 for an all-zero block.
struct Fp32Scale {
    __device__ __forceinline__ static float of(float amax) {
        return amax > 0.0f ? fmaxf(amax / kE4M3Max, kMinScale) : 1.0f;
    }
};

// Fp32Scale rounded up to a power of two, so that x / scale and fp8 * scale are exact scalings.
struct Pow2Scale {
    __device__ __forceinline__ static float of(float amax) {
        const uint32_t bits = __float_as_uint(Fp32Scale::of(amax));  // (a normal, positive float)
        return __uint_as_float((bits + 0x7FFFFFu) & 0xFF800000u);
    }
};

}  // namespace deep_gemm::ptx
