#pragma once
// Bulk tensor copies (TMA) between global and shared memory, and 1-D bulk stores.
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

// `tma_load_2d` into the same shared-memory offset of every CTA of the cluster named in
// `cta_mask`; each destination CTA's barrier at `bar`'s offset gets the bytes it received.
__device__ __forceinline__ void tma_load_2d_multicast(void* smem, const CUtensorMap* desc, MBarrier* bar,
                                                      int32_t inner, int32_t outer, uint16_t cta_mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
        " [%0], [%1, {%3, %4}], [%2], %5;\n"
        :: "r"(smem_addr(smem)), "l"(reinterpret_cast<uint64_t>(desc)), "r"(smem_addr(bar)),
           "r"(inner), "r"(outer), "h"(cta_mask)
        : "memory");
}

// 1-D bulk copy of `bytes` (a multiple of 16) from shared to global memory, or with
// `kReduceAdd` an element-wise `dst += src` done by the memory system (fp32 or bf16).
// Completion is tracked per thread with bulk groups (`bulk_commit_group`, `bulk_wait_*`).
template <typename T, bool kReduceAdd>
__device__ __forceinline__ void bulk_store(T* dst, const void* smem_src, uint32_t bytes) {
    if constexpr (not kReduceAdd) {
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n"
                     :: "l"(dst), "r"(smem_addr(smem_src)), "r"(bytes) : "memory");
    } else if constexpr (sizeof(T) == 4) {
        asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                     :: "l"(dst), "r"(smem_addr(smem_src)), "r"(bytes) : "memory");
    } else {
        asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.noftz.bf16 [%0], [%1], %2;\n"
                     :: "l"(dst), "r"(smem_addr(smem_src)), "r"(bytes) : "memory");
    }
}

// Stores the shared-memory box of `desc` at (c0, c1, c2) (innermost first) to global memory,
// or with `kReduceAdd` adds it element-wise there (fp32 only here); parts outside the tensor
// are not written. Tracked like bulk_store (bulk groups, per thread).
template <bool kReduceAdd>
__device__ __forceinline__ void tma_store_3d(const CUtensorMap* desc, const void* smem_src,
                                             int32_t c0, int32_t c1, int32_t c2) {
    if constexpr (kReduceAdd) {
        asm volatile("cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4}], [%1];\n"
                     :: "l"(reinterpret_cast<uint64_t>(desc)), "r"(smem_addr(smem_src)), "r"(c0), "r"(c1), "r"(c2)
                     : "memory");
    } else {
        asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n"
                     :: "l"(reinterpret_cast<uint64_t>(desc)), "r"(smem_addr(smem_src)), "r"(c0), "r"(c1), "r"(c2)
                     : "memory");
    }
}

__device__ __forceinline__ void bulk_commit_group() {
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}

// Waits until this thread's bulk groups, all but the newest N, have read their shared memory.
template <int N>
__device__ __forceinline__ void bulk_wait_group_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" :: "n"(N) : "memory");
}

// Waits until this thread's bulk groups, all but the newest N, have fully completed.
template <int N>
__device__ __forceinline__ void bulk_wait_group() {
    asm volatile("cp.async.bulk.wait_group %0;\n" :: "n"(N) : "memory");
}

}  // namespace deep_gemm::ptx
