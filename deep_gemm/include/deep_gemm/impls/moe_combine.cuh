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
#include "../ptx/utils.cuh"
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
    // Slots are read in groups whose row loads are all issued before the first is summed: a
    // load-then-add loop over the slots keeps one 16-byte load in flight per thread, far
    // under HBM bandwidth (docs/PERF.md, "Decisions": combine).
    static constexpr uint32_t kGroup = 8;

    // A group of a token's slots as a warp holds them: lane l has slot k0 + l % kGroup's source row
    // (-1: an empty slot or none, whose row is never read) and weight; the others take them by
    // shuffles, so that a warp loads each slot's metadata once, not every thread.
    struct Slots {
        int64_t row;
        float weight;
    };

    __device__ __forceinline__ static Slots load_slots(const MoECombineParams& p, uint32_t token, uint32_t k0) {
        const uint32_t k = k0 + ptx::lane_idx() % kGroup;
        Slots s{-1, 0.0f};
        if (token < p.num_tokens and k < p.num_topk) {
            const uint64_t slot = static_cast<uint64_t>(token) * p.num_topk + k;
            if (p.slot_valid[slot])
                s = {p.slot_row[slot], p.weights != nullptr ? p.weights[slot] : 1.0f};
        }
        return s;
    }

    __device__ __forceinline__ static void run(const MoECombineParams& p) {
        constexpr uint32_t kVec = ptx::kBF16PerVec;
        const uint32_t num_chunks = p.hidden / kVec;
        // The next token's first slots load while this token's rows do (their latency would
        // otherwise come before every token's row loads).
        Slots next = load_slots(p, blockIdx.x, 0);
        for (uint32_t token = blockIdx.x; token < p.num_tokens; token += gridDim.x) {
            const Slots first = next;
            next = load_slots(p, token + gridDim.x, 0);
            __nv_bfloat16* out = p.out + static_cast<uint64_t>(token) * p.hidden;
            // (every lane of a warp runs the loop, for the shuffles; lanes past the row load nothing)
            for (uint32_t base = 0; base < num_chunks; base += kNumThreads) {
                const uint32_t chunk = base + threadIdx.x;
                const bool in_row = chunk < num_chunks;
                float acc[kVec] = {};
                for (uint32_t k0 = 0; k0 < p.num_topk; k0 += kGroup) {
                    const Slots mine = k0 == 0 ? first : load_slots(p, token, k0);
                    uint4 raw[kGroup];
                    float w[kGroup];
                    bool valid[kGroup];
                    #pragma unroll
                    for (uint32_t j = 0; j < kGroup; ++j) {
                        const int64_t row = __shfl_sync(0xffffffff, mine.row, j);
                        w[j] = __shfl_sync(0xffffffff, mine.weight, j);
                        valid[j] = in_row and row >= 0;
                        if (valid[j])
                            raw[j] = __ldg(reinterpret_cast<const uint4*>(p.rows + row * p.hidden + chunk * kVec));
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
                if (not in_row)
                    continue;
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
