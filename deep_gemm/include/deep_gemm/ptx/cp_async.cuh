#pragma once
// cp.async: row gathers into 128-byte-swizzled tiles, the loads a TMA box cannot express (rows
// picked by an index), completing on the same mbarriers as the TMA loads; and plain copies into
// shared memory that complete by group.
#include <cstdint>
#include "barrier.cuh"
#include "utils.cuh"

namespace deep_gemm::ptx {

// 16 bytes global -> shared, bypassing L1; `valid` false writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem_addr(smem)), "l"(gmem), "r"(valid ? 16u : 0u) : "memory");
}

// 4 bytes global -> shared (through L1: scales are small and re-read); `valid` false writes zeros.
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
                 :: "r"(smem_addr(smem)), "l"(gmem), "r"(valid ? 4u : 0u) : "memory");
}

// Closes the group of this thread's cp.async issued since the last commit.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most N of this thread's committed groups are still in flight.
template <uint32_t N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory"); }

// cp_async_wait<n> for an n known once the caller's loop is unrolled (n < 8).
__device__ __forceinline__ void cp_async_wait_unrolled(uint32_t n) {
    switch (n) {
        case 0: cp_async_wait<0>(); break;
        case 1: cp_async_wait<1>(); break;
        case 2: cp_async_wait<2>(); break;
        case 3: cp_async_wait<3>(); break;
        case 4: cp_async_wait<4>(); break;
        case 5: cp_async_wait<5>(); break;
        case 6: cp_async_wait<6>(); break;
        default: cp_async_wait<7>(); break;
    }
}

// One arrival on `bar` once every cp.async this thread issued so far has landed. `noinc`:
// the arrival is part of the barrier's expected count (see mma::GemmSmem::init_barriers).
__device__ __forceinline__ void cp_async_arrive_noinc(MBarrier* bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" :: "r"(smem_addr(bar)) : "memory");
}

// Byte offset of 16-byte piece `piece` (0..7) of 128-byte line `line` inside a tile whose
// base is 1024-byte aligned, in the layout TMA's 128-byte swizzle writes.
__device__ __forceinline__ uint32_t swizzle_128b_offset(uint32_t line, uint32_t piece) {
    return line * 128 + ((piece ^ (line % 8)) * 16);
}

}  // namespace deep_gemm::ptx
