#pragma once
// The end of an expert-parallel exchange: waits until every flag is set (each by another GPU's
// copy engine, after the rows it guards have landed here), then resets them for the next
// exchange. One thread waits, so the kernels queued after it start with every SM free and
// see the landed rows (they run after this kernel's system-scope acquire). A wait longer than
// timeout_ms fails with a message naming the rank that did not send.
#include <cassert>
#include <cstdint>
#include "../comm/flags.cuh"

namespace deep_gemm {

struct EpWaitFlagsParams {
    int* flags;          // [num_flags]
    const int* sources;  // [num_flags]: the rank that sets each flag
    uint32_t num_flags, timeout_ms;
};

// A device printf would need a stack frame (local memory); an assertion's message is a
// constant string, so there is one per rank of a node.
__device__ __forceinline__ void fail_waiting_for(int rank) {
#define DG_NO_RESULTS_FROM(r) \
    case r: __assert_fail("deep_gemm ep_wait_flags: rank " #r " sent nothing within DG_EP_BARRIER_TIMEOUT_MS " \
                          "(did it skip this layer call?)", __FILE__, __LINE__, __func__); break;
    switch (rank) {
        DG_NO_RESULTS_FROM(0) DG_NO_RESULTS_FROM(1) DG_NO_RESULTS_FROM(2) DG_NO_RESULTS_FROM(3)
        DG_NO_RESULTS_FROM(4) DG_NO_RESULTS_FROM(5) DG_NO_RESULTS_FROM(6) DG_NO_RESULTS_FROM(7)
        default: __assert_fail("deep_gemm ep_wait_flags: a rank >= 8 sent nothing within DG_EP_BARRIER_TIMEOUT_MS",
                               __FILE__, __LINE__, __func__);
    }
#undef DG_NO_RESULTS_FROM
    __trap();
}

template <uint32_t kNumThreads>
struct EpWaitFlags {
    __device__ __forceinline__ static void run(const EpWaitFlagsParams& p) {
        if (threadIdx.x != 0 or blockIdx.x != 0)
            return;
        const uint64_t timeout_ns = static_cast<uint64_t>(p.timeout_ms) * 1'000'000ull;
        for (uint32_t j = 0; j < p.num_flags; ++j) {
            comm::wait_global_flag(p.flags + j, timeout_ns, [&] { fail_waiting_for(p.sources[j]); });
            p.flags[j] = 0;
        }
    }
};

}  // namespace deep_gemm
