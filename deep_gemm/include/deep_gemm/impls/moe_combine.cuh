#pragma once
// Combine of an MoE layer's routed rows back into token order:
//   out[t] = sum over valid slots k of w[t, k] * rows[slot_row[t, k]]   (w = 1 without weights)
//            + sum over j of addend[j][t]                                (with addends)
// bf16 in and out, fp32 sums in slot order, then addend order (deterministic, no atomics). One
// CTA per token at a time; each thread owns 16-byte column chunks, so every row read is
// coalesced. Addends are partial sums other GPUs computed for these tokens (expert
// parallelism); with `addend_ready`, block j is read only once addend_ready[j] != 0 (its
// writer, another GPU's copy engine, sets the flag after the rows): the kernel waits ~10 s at
// most, then fails with a message naming the rank it waited on.
#include <cstdint>
#include <cassert>
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
    const int* addend_ready;       // [num_addends] or null: flags to wait on before reading the addends
    const int* addend_source;      // [num_addends]: the rank each block comes from (for the timeout message)
    uint32_t num_tokens, hidden, num_topk, num_addends, addend_stride;
};

// Stops the kernel with a message naming `rank`. A device printf would need a stack frame
// (local memory); an assertion's message is a constant string, so there is one per rank of a
// node.
__device__ __forceinline__ void fail_waiting_for(int rank) {
#define DG_NO_RESULTS_FROM(r) \
    case r: __assert_fail("deep_gemm moe_combine: no results from rank " #r " after ~10 s (did it skip this layer?)", \
                          __FILE__, __LINE__, __func__); break;
    switch (rank) {
        DG_NO_RESULTS_FROM(0) DG_NO_RESULTS_FROM(1) DG_NO_RESULTS_FROM(2) DG_NO_RESULTS_FROM(3)
        DG_NO_RESULTS_FROM(4) DG_NO_RESULTS_FROM(5) DG_NO_RESULTS_FROM(6) DG_NO_RESULTS_FROM(7)
        default: __assert_fail("deep_gemm moe_combine: no results from a rank >= 8 after ~10 s", __FILE__, __LINE__,
                               __func__);
    }
#undef DG_NO_RESULTS_FROM
    __trap();
}

__device__ __forceinline__ void wait_for_rank(const int* flag, int rank) {
    constexpr long long kTimeoutCycles = 1ll << 34;  // ~10 s
    const long long start = clock64();
    int value = 0;
    while (true) {
        asm volatile("ld.acquire.sys.global.b32 %0, [%1];\n" : "=r"(value) : "l"(flag) : "memory");
        if (value != 0)
            return;
        if (clock64() - start > kTimeoutCycles)
            fail_waiting_for(rank);
        __nanosleep(256);
    }
}

template <uint32_t kNumThreads>
__device__ __forceinline__ void moe_combine_impl(const MoECombineParams& p) {
    constexpr uint32_t kVec = ptx::kBF16PerVec;
    // Slots are read in groups whose row loads are all issued before the first is summed: a
    // load-then-add loop over the slots kept one 16-byte load in flight per thread and reached
    // 1.6 TB/s at H = 4096 (measured).
    constexpr uint32_t kGroup = 8;
    const uint32_t num_chunks = p.hidden / kVec;
    if (p.addend_ready != nullptr) {
        if (threadIdx.x == 0) {
            for (uint32_t j = 0; j < p.num_addends; ++j)
                wait_for_rank(p.addend_ready + j, p.addend_source[j]);
        }
        __syncthreads();
    }
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
                // L2, not L1: another GPU wrote these rows while this kernel may have been running.
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

}  // namespace deep_gemm
