#pragma once
// Combine of an MoE layer's routed rows back into token order:
//   out[t] = sum over valid slots k of w[t, k] * rows[slot_row[t, k]]   (w = 1 without weights)
// bf16 in and out, fp32 sums in slot order (deterministic, no atomics). One CTA per token at
// a time; each thread owns 16-byte column chunks, so every row read is coalesced.
#include <cstdint>
#include <cuda_bf16.h>
#include "../ptx/vec.cuh"

namespace deep_gemm {

struct MoECombineParams {
    const __nv_bfloat16* rows;  // [T * K, H], routed-row order
    const int64_t* slot_row;    // [T, K]: routed row of each slot
    const bool* slot_valid;     // [T, K]: false on empty slots (their rows are never read)
    const float* weights;       // [T, K], or null for an unweighted sum
    __nv_bfloat16* out;         // [T, H]
    uint32_t num_tokens, hidden, num_topk;
};

template <uint32_t kNumThreads>
__device__ __forceinline__ void moe_combine_impl(const MoECombineParams& p) {
    constexpr uint32_t kVec = ptx::kBF16PerVec;
    const uint32_t num_chunks = p.hidden / kVec;
    for (uint32_t token = blockIdx.x; token < p.num_tokens; token += gridDim.x) {
        for (uint32_t chunk = threadIdx.x; chunk < num_chunks; chunk += kNumThreads) {
            float acc[kVec] = {};
            for (uint32_t k = 0; k < p.num_topk; ++k) {
                const uint64_t slot = static_cast<uint64_t>(token) * p.num_topk + k;
                if (not p.slot_valid[slot])
                    continue;
                const float w = p.weights != nullptr ? p.weights[slot] : 1.0f;
                float v[kVec];
                ptx::load_bf16x8(p.rows + p.slot_row[slot] * p.hidden + chunk * kVec, v);
                #pragma unroll
                for (uint32_t i = 0; i < kVec; ++i)
                    acc[i] += w * v[i];
            }
            ptx::store_bf16x8(p.out + static_cast<uint64_t>(token) * p.hidden + chunk * kVec, acc);
        }
    }
}

}  // namespace deep_gemm
