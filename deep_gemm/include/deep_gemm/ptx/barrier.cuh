#pragma once
// mbarrier helpers: the handshake between the TMA producer and the WGMMA consumers.
#include <cstdint>
#include "utils.cuh"

namespace deep_gemm::ptx {

struct alignas(8) MBarrier {
    uint64_t state;

    __device__ __forceinline__ void init(uint32_t arrive_count) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(smem_addr(this)), "r"(arrive_count));
    }

    __device__ __forceinline__ void arrive() {
        asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(smem_addr(this)) : "memory");
    }

    // Arrive and announce the bytes the TMA engine will deliver into this phase.
    __device__ __forceinline__ void arrive_and_expect_tx(uint32_t bytes) {
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
                     :: "r"(smem_addr(this)), "r"(bytes) : "memory");
    }

    // Blocks until the phase with parity `phase` has completed.
    __device__ __forceinline__ void wait(uint32_t phase) {
        asm volatile(
            "{\n"
            ".reg .pred done;\n"
            "WAIT_LOOP:\n"
            "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
            "@!done bra WAIT_LOOP;\n"
            "}\n" :: "r"(smem_addr(this)), "r"(phase) : "memory");
    }
};

// Makes barrier initialisation visible to the async proxy before any TMA uses it.
__device__ __forceinline__ void fence_barrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

}  // namespace deep_gemm::ptx
