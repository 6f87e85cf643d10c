#pragma once
// 16-byte vectors of 8 bf16 values, converted to and from fp32, for the memory-bound kernels.
#include <cstdint>
#include <cuda_bf16.h>

namespace deep_gemm::ptx {

constexpr uint32_t kBF16PerVec = 8;

__device__ __forceinline__ void load_bf16x8(const __nv_bfloat16* ptr, float (&out)[kBF16PerVec]) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(ptr));
    const auto* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
    #pragma unroll
    for (uint32_t i = 0; i < kBF16PerVec / 2; ++i) {
        const float2 v = __bfloat1622float2(pairs[i]);
        out[2 * i] = v.x, out[2 * i + 1] = v.y;
    }
}

__device__ __forceinline__ void store_bf16x8(__nv_bfloat16* ptr, const float (&in)[kBF16PerVec]) {
    uint4 raw;
    auto* pairs = reinterpret_cast<__nv_bfloat162*>(&raw);
    #pragma unroll
    for (uint32_t i = 0; i < kBF16PerVec / 2; ++i)
        pairs[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
    *reinterpret_cast<uint4*>(ptr) = raw;
}

}  // namespace deep_gemm::ptx
