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

    // Arrive on the barrier at this one's address in CTA `cta` of the cluster (this CTA's own
    // included). The default (CTA-scope) release: a cluster-scope one costs a GPU-wide fence
    // per arrive, and what must precede the arrive (WGMMA reads of the stage) is ordered by
    // wgmma.wait_group already.
    __device__ __forceinline__ void arrive_in_cta(uint32_t cta) {
        uint32_t remote;
        asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(smem_addr(this)), "r"(cta));
        asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" :: "r"(remote) : "memory");
    }

    // Arrive and announce the bytes the TMA engine will deliver into this phase.
    __device__ __forceinline__ void arrive_and_expect_tx(uint32_t bytes) {
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
                     :: "r"(smem_addr(this)), "r"(bytes) : "memory");
    }

    // Blocks until the phase with parity `phase` has completed. A wait that outlasts
    // kTimeoutCycles (~10 s) traps (the launch fails) instead of hanging the GPU forever.
    __device__ __forceinline__ void wait(uint32_t phase) {
        constexpr long long kTimeoutCycles = 1ll << 34;
        const long long start = clock64();
        while (not try_wait(phase)) {
            if (clock64() - start > kTimeoutCycles)
                __trap();
        }
    }

    __device__ __forceinline__ bool try_wait(uint32_t phase) {
        uint32_t done;
        asm volatile(
            "{\n"
            ".reg .pred p;\n"
            "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
            "selp.u32 %0, 1, 0, p;\n"
            "}\n" : "=r"(done) : "r"(smem_addr(this)), "r"(phase) : "memory");
        return done != 0;
    }
};

// Makes barrier initialisation visible to the async proxy before any TMA uses it.
__device__ __forceinline__ void fence_barrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

}  // namespace deep_gemm::ptx
