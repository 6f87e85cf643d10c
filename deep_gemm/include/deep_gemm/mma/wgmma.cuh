#pragma once
// Warpgroup MMA plumbing: shared-memory matrix descriptors and the async-group fences.
#include <cstdint>
#include "../ptx/utils.cuh"
#include "wgmma_bf16.cuh"

namespace deep_gemm::mma {

// Operand tiles live in shared memory in the 128-byte-swizzled layout TMA writes
// (`CU_TENSOR_MAP_SWIZZLE_128B`, 64 bf16 = 128 bytes along the box's inner dimension).
constexpr uint32_t kSwizzleBytes = 128;
constexpr uint32_t kSwizzleElems = kSwizzleBytes / 2;  // bf16

// How a tile's contraction (K) dimension is laid out.
//   kKMajor:  rows of MN, each row 64 K-elements (128 B); 8-row groups 1024 B apart.
//   kMNMajor: 64-wide MN chunks of [64 K rows][64 MN]: each K row is 128 B of MN elements;
//             chunks are `kMNChunkBytes` apart, 8-row K groups 1024 B apart.
enum class Major { kKMajor, kMNMajor };

constexpr uint32_t kMNChunkBytes = 64 * kSwizzleBytes;  // one TMA box of 64 (MN) x 64 (K)

// The descriptor of a K-major tile without swizzle at shared-memory address `addr` (PTX ISA
// "matrix descriptor format", layout type 0): 8-row x 16-byte core matrices (128 contiguous bytes
// each), `leading_byte_offset` apart along K and `stride_byte_offset` apart along M/N.
__device__ __forceinline__ uint64_t make_unswizzled_desc(uint32_t addr, uint32_t leading_byte_offset,
                                                         uint32_t stride_byte_offset) {
    return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) |                  // start address, bits 0-13
           static_cast<uint64_t>((leading_byte_offset & 0x3FFFF) >> 4) << 16 |
           static_cast<uint64_t>((stride_byte_offset & 0x3FFFF) >> 4) << 32;
}

// The descriptor of a tile in the 128-byte-swizzled layout (layout type 1), its offsets as above.
__device__ __forceinline__ uint64_t make_smem_desc(const void* ptr, uint32_t leading_byte_offset,
                                                   uint32_t stride_byte_offset) {
    return make_unswizzled_desc(ptx::smem_addr(ptr), leading_byte_offset, stride_byte_offset) |
           static_cast<uint64_t>(1) << 62;
}

// The descriptor of the same layout `bytes` (a multiple of 16) further on: shared-memory
// addresses stay below 2^18, so the start-address field does not carry into the next, and a
// 32-bit add of the low word does (the high word, strides and swizzle, is left as it is).
__device__ __forceinline__ uint64_t advance_desc(uint64_t desc, uint32_t bytes) {
    const uint32_t lo = static_cast<uint32_t>(desc) + (bytes >> 4);
    return (desc >> 32 << 32) | lo;
}

// `desc` with its low word (the start address; the high word is the layout's constant) taken
// from lane 0: for a descriptor every lane computes alike, so the compiler knows it is warp-uniform.
__device__ __forceinline__ uint64_t warp_uniform_desc(uint64_t desc) {
    return (desc >> 32 << 32) | __shfl_sync(0xffffffff, static_cast<uint32_t>(desc), 0);
}

// Descriptor of the k16 slice `k` of a tile whose swizzle atoms start at `tile`: the tile's
// descriptor advanced, so that a loop over k builds one descriptor and adds to it.
template <Major kMajor>
__device__ __forceinline__ uint64_t make_operand_desc(const void* tile, uint32_t k) {
    if constexpr (kMajor == Major::kKMajor) {
        // Inside a 128-byte swizzle row, k16 slices sit 32 bytes apart; the hardware applies the
        // XOR pattern on the final address, so a plain offset is right.
        return advance_desc(make_smem_desc(tile, 0, 1024), k * 32);
    } else {
        // k16 = two 8-row groups; successive 64-wide MN chunks are kMNChunkBytes apart.
        return advance_desc(make_smem_desc(tile, kMNChunkBytes, 1024), k * 16 * kSwizzleBytes);
    }
}

__device__ __forceinline__ void warpgroup_arrive() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void warpgroup_commit_batch() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

template <int N>
__device__ __forceinline__ void warpgroup_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory");
}

// Keeps the compiler from moving accumulator reads/writes across async wgmma boundaries.
template <uint32_t kNum>
__device__ __forceinline__ void warpgroup_fence_operand(float (&d)[kNum]) {
    #pragma unroll
    for (uint32_t i = 0; i < kNum; ++i)
        asm volatile("" : "+f"(d[i]) :: "memory");
}

}  // namespace deep_gemm::mma
