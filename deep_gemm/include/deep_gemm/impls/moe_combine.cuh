#pragma once
// Combine of an MoE layer's routed rows back into token order:
//   out[t] = sum over valid slots k of w[t, k] * rows[slot_row[t, k]]   (w = 1 without weights)
//            + sum over j of addend[j][t]                                (with addends)
// bf16 in and out, fp32 sums in slot order, then addend order (deterministic, no atomics). One
// CTA per token at a time; each thread owns 16-byte column chunks, so every row read is
// coalesced. Addends are partial sums other GPUs computed for these tokens (expert
// parallelism), landed before this kernel starts (see ep_wait_flags.cuh).
#include <cstdint>
#include <cuda_bf16.h>
#include "../ptx/vec.cuh"

namespace deep_gemm {

struct MoECombineParams {
    const __nv_bfloat16* rows;     // [T * K, H], routed-row order
    const int64_t* slot_row;       // [T, K]: routed row of each slot
    const bool* slot_valid;        // [T, K]: false on empty slots (their rows are never read)
    const float* weights;          // [T, K], or null for an unweighted sum
    __nv_bfloat16* out;            // [T, H]
    const __nv_bfloat16* addend;   // [num_addends, addend_stride, H] (addend_stride >= T), or null
    uint32_t num_tokens, hidden, num_topk, num_addends, addend_stride;
};

template <uint32_t kNumThreads>
struct MoECombine {
    __device__ __forceinline__ static void run(const MoECombineParams& p) {
        constexpr uint32_t kVec = ptx::kBF16PerVec;
        // Slots are read in groups whose row loads are all issued before the first is summed: a
        // load-then-add loop over the slots keeps one 16-byte load in flight per thread, far
        // under HBM bandwidth (docs/PERF.md, "Decisions": combine).
        constexpr uint32_t kGroup = 8;
        const uint32_t num_chunks = p.hidden / kVec;
        for (uint32_t token = blockIdx.x; token < p.num_tokens; token += gridDim.x) {
            __nv_bfloat16* out = p.out + static_cast<uint64_t>(token) * p.hidden;
            const uint64_t first_slot = static_cast<uint64_t>(token) * p.num_topk;
            for (uint32_t chunk = threadIdx.x; chunk < num_chunks; chunk += kNumThreads) {
                float acc[kVec] = {};
                for (uint32_t k0 = 0; k0 < p.num_topk; k0 += kGroup) {
                    uint4 raw[kGroup];
                    float w[kGroup];
                    bool valid[kGroup];
                    #pragma unroll
                    for (uint32_t j = 0; j < kGroup; ++j) {
                        const uint64_t slot = first_slot + k0 + j;
                        valid[j] = k0 + j < p.num_topk and p.slot_valid[slot];
                        w[j] = valid[j] and p.weights != nullptr ? p.weights[slot] : 1.0f;
                        if (valid[j])
                            raw[j] = __ldg(reinterpret_cast<const uint4*>(p.rows + p.slot_row[slot] * p.hidden + chunk * kVec));
                    }
                    #pragma unroll
                    for (uint32_t j = 0; j < kGroup; ++j) {
                        if (not valid[j])
                            continue;
                        float v[kVec];
                        ptx::bf16x8_to_float(raw[j], v);
                        #pragma unroll
                        for (uint32_t i = 0; i < kVec; ++i)
                            acc[i] += w[j] * v[i];
                    }
                }
                for (uint32_t j = 0; j < p.num_addends; ++j) {
                    // Through L2 only: another GPU's copy engine wrote these rows.
                    const uint64_t row = static_cast<uint64_t>(j) * p.addend_stride + token;
                    float v[kVec];
                    ptx::bf16x8_to_float(__ldcg(reinterpret_cast<const uint4*>(p.addend + row * p.hidden + chunk * kVec)), v);
                    #pragma unroll
                    for (uint32_t i = 0; i < kVec; ++i)
                        acc[i] += v[i];
                }
                ptx::store_bf16x8(out + chunk * kVec, acc);
            }
        }
    }
};

}  // namespace deep_gemm
