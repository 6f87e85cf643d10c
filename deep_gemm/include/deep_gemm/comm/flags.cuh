#pragma once
// Flags in global memory that another agent sets once the data they guard has landed: a stream
// memory operation after a copy that needs no SM of this GPU (from another GPU's memory or from
// pinned host memory: the expert-parallel exchange). So a waiting kernel may hold every SM.
#include <cstdint>
#include "../ptx/utils.cuh"

namespace deep_gemm::comm {

// Spins until the int at `flag` is non-zero, then makes the data it guards visible to this
// thread's later loads, TMA ones included. After `timeout_ns` it calls `on_timeout()`, which
// must not return (it traps), instead of hanging.
template <typename OnTimeout>
__device__ __forceinline__ void wait_global_flag(const int* flag, uint64_t timeout_ns, OnTimeout on_timeout) {
    const uint64_t start = ptx::global_timer_ns();
    while (true) {
        int value;
        asm volatile("ld.acquire.sys.global.b32 %0, [%1];\n" : "=r"(value) : "l"(flag) : "memory");
        if (value != 0)
            break;
        if (ptx::global_timer_ns() - start > timeout_ns)
            on_timeout();
        __nanosleep(256);
    }
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

// The same, trapping after ~10 s (like ptx::MBarrier::wait).
__device__ __forceinline__ void wait_global_flag(const int* flag) {
    wait_global_flag(flag, 10'000'000'000ull, [] { __trap(); });
}

// A GEMM's rows that arrive in passes: pass s > 0 may be read once flags[s] != 0 (pass 0 never
// waits; no flags, nothing waits). Each flag is read until it is first seen set. The flags are
// passed to each wait rather than kept: in kernel-parameter space they take no register of the
// producer's small budget.
struct PassGate {
    uint32_t seen = 1;  // bit s: flags[s] seen set

    __device__ __forceinline__ void wait_for(const int* flags, uint32_t pass) {
        if (flags != nullptr and not (seen >> pass & 1)) {
            wait_global_flag(flags + pass);
            seen |= 1u << pass;
        }
    }
};

}  // namespace deep_gemm::comm
