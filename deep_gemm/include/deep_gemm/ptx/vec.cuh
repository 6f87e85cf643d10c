#pragma once
// 16-byte vectors of 8 bf16 values, converted to and from fp32, for the memory-bound kernels.
#include <cstdint>
#include <cuda_bf16.h>

namespace deep_gemm::ptx {

constexpr uint32_t kBF16PerVec = 8;

// A bf16 pair as two floats, exactly: each value's 16 bits become a float's high half, by one
// shift and one mask (`__bfloat1622float2` takes a byte permute and a shift for the high one).
__device__ __forceinline__ float2 bf16x2_to_float2(uint32_t pair) {
    return make_float2(__uint_as_float(pair << 16), __uint_as_float(pair & 0xffff0000u));
}

__device__ __forceinline__ float2 bf16x2_to_float2(const __nv_bfloat162& pair) {
    return bf16x2_to_float2(*reinterpret_cast<const uint32_t*>(&pair));
}

__device__ __forceinline__ void bf16x8_to_float(const uint4& raw, float (&out)[kBF16PerVec]) {
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
    #pragma unroll
    for (uint32_t i = 0; i < kBF16PerVec / 2; ++i) {
        const float2 v = bf16x2_to_float2(words[i]);
        out[2 * i] = v.x, out[2 * i + 1] = v.y;
    }
}

__device__ __forceinline__ void load_bf16x8(const __nv_bfloat16* ptr, float (&out)[kBF16PerVec]) {
    bf16x8_to_float(__ldg(reinterpret_cast<const uint4*>(ptr)), out);
}

// Eight floats rounded to bf16 (to nearest even), packed.
__device__ __forceinline__ uint4 float_to_bf16x8(const float (&in)[kBF16PerVec]) {
    uint4 raw;
    auto* pairs = reinterpret_cast<__nv_bfloat162*>(&raw);
    #pragma unroll
    for (uint32_t i = 0; i < kBF16PerVec / 2; ++i)
        pairs[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
    return raw;
}

__device__ __forceinline__ void store_bf16x8(__nv_bfloat16* ptr, const float (&in)[kBF16PerVec]) {
    *reinterpret_cast<uint4*>(ptr) = float_to_bf16x8(in);
}

// One warp copies a row of `num_vecs` 16-byte vectors, 8 loads in flight per lane before
// their stores (a load-store loop keeps one in flight: the pointers may alias).
__device__ __forceinline__ void copy_row_warp(const uint4* from, uint4* to, uint32_t num_vecs, uint32_t lane) {
    constexpr uint32_t kUnroll = 8;
    for (uint32_t base = lane; base < num_vecs; base += 32 * kUnroll) {
        uint4 v[kUnroll];
        #pragma unroll
        for (uint32_t u = 0; u < kUnroll; ++u) {
            if (base + 32 * u < num_vecs)
                v[u] = __ldg(from + base + 32 * u);
        }
        #pragma unroll
        for (uint32_t u = 0; u < kUnroll; ++u) {
            if (base + 32 * u < num_vecs)
                to[base + 32 * u] = v[u];
        }
    }
}

}  // namespace deep_gemm::ptx
