#pragma once
// cp.async row gathers into 128-byte-swizzled tiles: the loads a TMA box cannot express
// (rows picked by an index), completing on the same mbarriers as the TMA loads.
#include <cstdint>
#include <cuda_bf16.h>
#include "barrier.cuh"
#include "utils.cuh"

namespace deep_gemm::ptx {

// 16 bytes global -> shared, bypassing L1; `valid` false writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem_addr(smem)), "l"(gmem), "r"(valid ? 16u : 0u) : "memory");
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

// Filling the 64 K rows of an MN-major tile of kCols columns (kCols / 64 chunks of 64 K rows x
// 128 bytes, kChunkBytes apart) from gathered rows, by the 128 threads of the producer
// warpgroup: K row r is row index[min(k + r, num_index - 1)] of `src` ([src_rows, ld] bf16),
// columns [col_begin, col_begin + kCols). Thread t copies 16-byte piece t % (kCols / 8) of K
// rows t / (kCols / 8) + step * i, so a warp reads whole rows. Each warp needs 16 indices:
// 16 lanes load one each (`load_index`, issued a k-block ahead so that its latency overlaps
// the previous copies) and `copy` shuffles them to the lanes that copy the rows. Columns
// past `num_cols` and indices outside [0, src_rows) read zeros. ld % 8 == 0, indices < 2**31.
template <uint32_t kCols, uint32_t kChunkBytes>
struct MNMajorRowGather {
    static constexpr uint32_t kPieces = kCols / 8, kRowStep = 128 / kPieces, kRowsPerWarp = 32 / kPieces;
    static_assert(kRowsPerWarp * (64 / kRowStep) == 16, "one index per lane of a half warp");

    // Lane l (mod 16) of warp w loads the index of K row w * kRowsPerWarp + l % kRowsPerWarp +
    // kRowStep * (l / kRowsPerWarp). Returned raw: nothing waits for the load until `copy`.
    __device__ __forceinline__ static int64_t load_index(const int64_t* index, uint32_t num_index, uint32_t k,
                                                         uint32_t t) {
        const uint32_t l = t % 16, row = (t / 32) * kRowsPerWarp + l % kRowsPerWarp + kRowStep * (l / kRowsPerWarp);
        return __ldg(index + min(k + row, num_index - 1));
    }

    __device__ __forceinline__ static void copy(uint8_t* tile, const __nv_bfloat16* src, uint32_t src_rows,
                                                uint32_t ld, int64_t loaded_index, uint32_t col_begin,
                                                uint32_t num_cols, uint32_t t) {
        const int32_t my_src = loaded_index >= 0 and loaded_index < src_rows ? static_cast<int32_t>(loaded_index) : -1;
        const uint32_t lane = t % 32, warp_row = (t / 32) * kRowsPerWarp, piece = t % kPieces;
        const uint32_t col = col_begin + piece * 8;
        uint8_t* chunk = tile + (piece / 8) * kChunkBytes;
        #pragma unroll
        for (uint32_t i = 0; i < 64 / kRowStep; ++i) {
            const int32_t s = __shfl_sync(0xffffffff, my_src, i * kRowsPerWarp + lane / kPieces);
            const uint32_t row = warp_row + lane / kPieces + kRowStep * i;
            const bool valid = s >= 0 and col < num_cols;
            cp_async_16(chunk + swizzle_128b_offset(row, piece % 8), src + static_cast<uint64_t>(valid ? s : 0) * ld + col,
                        valid);
        }
    }
};

}  // namespace deep_gemm::ptx
