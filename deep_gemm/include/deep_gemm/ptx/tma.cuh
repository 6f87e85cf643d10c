#pragma once
// Bulk tensor copies (TMA) from global to shared memory, completing on an mbarrier.
#include <cuda.h>
#include <cstdint>
#include "barrier.cuh"

namespace deep_gemm::ptx {

__device__ __forceinline__ void prefetch_tma_descriptor(const CUtensorMap* desc) {
    asm volatile("prefetch.tensormap [%0];\n" :: "l"(reinterpret_cast<uint64_t>(desc)) : "memory");
}

// Loads the 2-D box at (inner, outer) of `desc` into `smem`; signals `bar` when the bytes land.
// Out-of-range elements are filled with zeros by the hardware.
__device__ __forceinline__ void tma_load_2d(void* smem, const CUtensorMap* desc, MBarrier* bar,
                                            int32_t inner, int32_t outer) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4}], [%2];\n"
        :: "r"(smem_addr(smem)), "l"(reinterpret_cast<uint64_t>(desc)), "r"(smem_addr(bar)),
           "r"(inner), "r"(outer)
        : "memory");
}

}  // namespace deep_gemm::ptx
