#pragma once
// The stores the epilogue policies are built from: a math warpgroup's 64 x BLOCK_N fp32
// accumulators to global memory, through shared memory. Accumulator layout: mma/wgmma_bf16.cuh.
#include <cstdint>
#include <cuda_bf16.h>
#include <type_traits>
#include <cuda.h>
#include "../ptx/tma.cuh"
#include "../ptx/utils.cuh"

namespace deep_gemm::epilogue {

// This thread's first accumulator row within its warpgroup's 64 (the second is 8 below).
__device__ __forceinline__ uint32_t warpgroup_accumulator_row() {
    return ((threadIdx.x % 128) / 32) * 16 + ptx::lane_idx() / 4;
}

// Calls `visit(r, c, i)` for each pair of columns (c, c + 1) of column chunk `chunk` (kChunkN
// columns; c counts from the chunk's first) that this thread holds, in row r, as accumulators
// i and i + 1 of its warpgroup's 64 x BLOCK_N tile (r is the first row for (i / 2) % 2 == 0,
// else 8 below it).
template <uint32_t kChunkN, typename Visit>
__device__ __forceinline__ void for_each_column_pair(uint32_t chunk, Visit visit) {
    const uint32_t row = warpgroup_accumulator_row(), col = (ptx::lane_idx() % 4) * 2;
    #pragma unroll
    for (uint32_t j = 0; j < kChunkN / 8; ++j) {  // j: a group of 8 columns
        const uint32_t i = (chunk * kChunkN / 8 + j) * 4;
        #pragma unroll
        for (uint32_t half = 0; half < 2; ++half)
            visit(row + half * 8, j * 8 + col, i + half * 2);
    }
}

// Writes column chunk `chunk` (kChunkN columns) of this thread's share of a warpgroup's
// 64 x BLOCK_N accumulators to shared memory as OutT: the pair of columns at byte offset `byte`
// of row r (both within the chunk) goes to `addr(r, byte)`, which picks the staging layout.
template <uint32_t kChunkN, typename OutT, uint32_t kNumAcc, typename Addr>
__device__ __forceinline__ void stage_chunk(const float (&acc)[kNumAcc], uint32_t chunk, Addr addr) {
    for_each_column_pair<kChunkN>(chunk, [&](uint32_t r, uint32_t c, uint32_t i) {
        uint8_t* ptr = addr(r, c * static_cast<uint32_t>(sizeof(OutT)));
        if constexpr (std::is_same_v<OutT, float>)
            ptx::st_shared_v2(ptr, acc[i], acc[i + 1]);
        else
            ptx::st_shared_u32(ptr, ptx::pack_bf16x2(acc[i], acc[i + 1]));
    });
}

// Bytes of shared memory one warpgroup needs for `store_bf16_staged`.
template <uint32_t BLOCK_N>
struct StagedBF16 {
    static constexpr uint32_t kChunkN = BLOCK_N < 128 ? BLOCK_N : 128;
    // A 16-byte pad per row spreads the 8 rows a warp writes at once over all 32 banks.
    static constexpr uint32_t kRowBytes = kChunkN * 2 + 16;
    static constexpr uint32_t kBytesPerWarpgroup = 64 * kRowBytes;
    static_assert(BLOCK_N % kChunkN == 0);
};

// bf16 output through shared memory, so global stores are full 16-byte, row-contiguous
// writes; only the first `num_rows` rows and columns below `n` are written (ragged groups).
// `barrier_id` names a barrier private to this warpgroup.
template <uint32_t BLOCK_N>
__device__ __forceinline__ void store_bf16_staged(const float (&acc)[BLOCK_N / 2], uint8_t* staging,
                                                  uint32_t barrier_id, __nv_bfloat16* d, uint32_t ld_d,
                                                  uint32_t num_rows, uint32_t num_cols) {
    using Layout = StagedBF16<BLOCK_N>;
    constexpr uint32_t kChunkN = Layout::kChunkN, kRowBytes = Layout::kRowBytes;
    constexpr uint32_t kPiecesPerRow = kChunkN * 2 / 16;
    const uint32_t thread = threadIdx.x % 128;

    #pragma unroll
    for (uint32_t chunk = 0; chunk < BLOCK_N / kChunkN; ++chunk) {
        stage_chunk<kChunkN, __nv_bfloat16>(acc, chunk, [&](uint32_t r, uint32_t byte) {
            return staging + r * kRowBytes + byte;
        });
        ptx::named_barrier_sync(barrier_id, 128);

        #pragma unroll
        for (uint32_t i = 0; i < 64 * kPiecesPerRow / 128; ++i) {
            const uint32_t idx = i * 128 + thread;
            const uint32_t r = idx / kPiecesPerRow, c = chunk * kChunkN + (idx % kPiecesPerRow) * 8;
            const uint4 v = ptx::ld_shared_v4(staging + r * kRowBytes + (idx % kPiecesPerRow) * 16);
            if (r < num_rows and c < num_cols)
                *reinterpret_cast<uint4*>(d + static_cast<uint64_t>(r) * ld_d + c) = v;
        }
        ptx::named_barrier_sync(barrier_id, 128);
    }
}

// Shared memory one warpgroup needs for `store_rows_async`: 64 rows of one column chunk
// (256 bytes: 128 bf16 or 64 fp32 columns), each padded by 16 bytes so the rows a warp writes
// at once fall on different banks.
template <uint32_t BLOCK_N, typename OutT>
struct RowStaging {
    static constexpr uint32_t kChunkN = BLOCK_N < 256 / sizeof(OutT) ? BLOCK_N : 256 / sizeof(OutT);
    static constexpr uint32_t kRowBytes = kChunkN * sizeof(OutT) + 16;
    static constexpr uint32_t kBytesPerWarpgroup = 64 * kRowBytes;
    static_assert(BLOCK_N % kChunkN == 0);
};

// Asynchronous epilogue: each column chunk of the accumulators goes to shared memory, then one
// 1-D bulk copy per row (a bulk reduce-add with `kAccumulate`) drains it to global memory.
// The last chunk's copies overlap the warpgroup's next tile of MMAs; a chunk's staging is
// reused once the copies before it have read it. Only rows below `num_rows` and columns
// below `num_cols` are written. `barrier_id` names a barrier private to this warpgroup. Call
// `drain_bulk_stores` before the kernel exits. (Accumulating into bf16 rounds twice, the staged
// value and the sum: within one bf16 ulp of rounding once.)
template <uint32_t BLOCK_N, typename OutT, bool kAccumulate>
__device__ __forceinline__ void store_rows_async(const float (&acc)[BLOCK_N / 2], uint8_t* staging,
                                                 uint32_t barrier_id, OutT* d, uint32_t ld_d,
                                                 uint32_t num_rows, uint32_t num_cols) {
    using Layout = RowStaging<BLOCK_N, OutT>;
    constexpr uint32_t kChunkN = Layout::kChunkN, kRowBytes = Layout::kRowBytes;
    const uint32_t thread = threadIdx.x % 128;

    #pragma unroll
    for (uint32_t chunk = 0; chunk < BLOCK_N / kChunkN; ++chunk) {
        if (thread < 64)  // thread t copies row t
            ptx::bulk_wait_group_read<0>();
        ptx::named_barrier_sync(barrier_id, 128);

        stage_chunk<kChunkN, OutT>(acc, chunk, [&](uint32_t r, uint32_t byte) {
            return staging + r * kRowBytes + byte;
        });
        ptx::fence_view_async_shared();  // the bulk copies read through the async proxy
        ptx::named_barrier_sync(barrier_id, 128);

        const uint32_t first_col = chunk * kChunkN;
        if (thread < min(num_rows, 64u) and first_col < num_cols) {
            const uint32_t bytes = min(num_cols - first_col, kChunkN) * static_cast<uint32_t>(sizeof(OutT));
            ptx::bulk_store<OutT, kAccumulate>(d + static_cast<uint64_t>(thread) * ld_d + first_col,
                                               staging + thread * kRowBytes, bytes);
        }
        if (thread < 64)
            ptx::bulk_commit_group();
    }
}

// Shared memory one warpgroup needs for `store_tile_tma`: kNumBuffers buffers of 64 rows x 128
// bytes (64 bf16 or 32 fp32 columns), in the 128-byte swizzle of the tensor map (1024-byte
// aligned).
template <typename OutT, uint32_t kNumBuffers = 2>
struct SwizzledStaging {
    static constexpr uint32_t kChunkN = 128 / sizeof(OutT);
    static constexpr uint32_t kBufferBytes = 64 * 128;
    static constexpr uint32_t kBytesPerWarpgroup = kNumBuffers * kBufferBytes;
};

// Byte `byte` of row r in a 64-row x 128-byte buffer (1024-byte aligned) laid out in the tensor
// maps' 128-byte swizzle: row r's 16-byte pieces are permuted by r % 8, so that the 8 rows a
// warp writes at once fall on different banks.
__device__ __forceinline__ uint8_t* swizzled_128b(uint8_t* buffer, uint32_t r, uint32_t byte) {
    return buffer + r * 128 + (((byte / 16) ^ (r % 8)) * 16) + byte % 16;
}

// How a column chunk (128 bytes of OutT columns) of this thread's share of a warpgroup's
// 64 x BLOCK_N accumulators reaches its swizzled staging buffer (64 rows, 1024-byte aligned):
// `Stores::stage<OutT>(acc, chunk, buffer)`.
//
// PairStores: each pair of columns by one 4-byte (bf16) or 8-byte (fp32) store.
struct PairStores {
    template <typename OutT, uint32_t kNumAcc>
    __device__ __forceinline__ static void stage(const float (&acc)[kNumAcc], uint32_t chunk, uint8_t* buffer) {
        stage_chunk<SwizzledStaging<OutT>::kChunkN, OutT>(acc, chunk, [&](uint32_t r, uint32_t byte) {
            return swizzled_128b(buffer, r, byte);
        });
    }
};

// MatrixStores: bf16 by stmatrix, each instruction two 8-column groups of the warp's 16 rows, 16
// bytes a thread: a quarter of PairStores' store instructions in the same bank wavefronts, and
// one swizzled address a thread rather than one a store (docs/PERF.md, "Decisions": m-grouped
// epilogue; the SwiGLU epilogues keep PairStores). fp32 as PairStores.
struct MatrixStores {
    template <typename OutT, uint32_t kNumAcc>
    __device__ __forceinline__ static void stage(const float (&acc)[kNumAcc], uint32_t chunk, uint8_t* buffer) {
        if constexpr (std::is_same_v<OutT, float>) {
            PairStores::stage<float>(acc, chunk, buffer);
        } else {
            static_assert(std::is_same_v<OutT, __nv_bfloat16>);
            const uint32_t lane = ptx::lane_idx();
            // This lane's row (matrices 1 and 3 are the warp's lower 8 rows) and 8-column group
            // (matrices 2 and 3 the second of a pair); r % 8 == lane % 8 picks the swizzle. A row's
            // 16-byte pieces are address bits 4-6 (the buffer is 1024-byte aligned), so piece p of
            // the swizzled row is its address XOR p * 16.
            const uint32_t r = (threadIdx.x % 128 / 32) * 16 + (lane / 8 % 2) * 8 + lane % 8;
            const uint32_t row = (ptx::smem_addr(buffer) + r * 128) | (((lane / 16) ^ (lane % 8)) * 16);
            #pragma unroll
            for (uint32_t j = 0; j < 8; j += 2) {  // pairs of 8-column groups
                const uint32_t i = (chunk * 8 + j) * 4;  // the pair's first accumulator (mma/wgmma_fp8.cuh's layout)
                ptx::stmatrix_x4(row ^ (j * 16), ptx::pack_bf16x2(acc[i], acc[i + 1]),
                                 ptx::pack_bf16x2(acc[i + 2], acc[i + 3]), ptx::pack_bf16x2(acc[i + 4], acc[i + 5]),
                                 ptx::pack_bf16x2(acc[i + 6], acc[i + 7]));
            }
        }
    }
};

// Until the warpgroup's earlier tensor stores have read its staging (thread 0 waits, all sync).
__device__ __forceinline__ void wait_staging_free(uint32_t barrier_id) {
    if (threadIdx.x % 128 == 0)
        ptx::bulk_wait_group_read<0>();
    ptx::named_barrier_sync(barrier_id, 128);
}

// Asynchronous epilogue through tensor stores: each 128-byte-wide column chunk of the
// warpgroup's 64 x BLOCK_N accumulators goes to a swizzled buffer (the 8 rows a warp writes at
// once are spread over the banks), then one 3-D TMA store of `desc` at (n, m, g) drains it
// (a reduce-add with `kAccumulate`, fp32 only); the hardware clips rows and columns past the
// tensor's ends. Chunks go in batches of kNumBuffers / 2, one fence and two barriers each; the
// two halves of the buffers take batches in turn, so a batch is written while the previous
// one drains, and the last batch's stores overlap the next tile's MMAs. Thread 0 of the
// warpgroup issues the stores: call `drain_bulk_stores` before the kernel exits. `Stores`
// (MatrixStores, PairStores) writes the buffers.
template <uint32_t BLOCK_N, typename OutT, bool kAccumulate, uint32_t kNumBuffers = 2, typename Stores = MatrixStores>
__device__ __forceinline__ void store_tile_tma(const float (&acc)[BLOCK_N / 2], uint8_t* staging, uint32_t barrier_id,
                                               const CUtensorMap* desc, uint32_t n, uint32_t m, uint32_t g) {
    using Layout = SwizzledStaging<OutT, kNumBuffers>;
    constexpr uint32_t kNumChunks = BLOCK_N / Layout::kChunkN, kBatch = kNumBuffers / 2;
    static_assert(BLOCK_N % Layout::kChunkN == 0 and kNumBuffers % 2 == 0);
    // Batch b of every tile uses half b % 2: the turn continues across tiles.
    static_assert(kNumChunks % kNumBuffers == 0, "a tile's chunks fill the buffers a whole number of times");
    static_assert(not kAccumulate or std::is_same_v<OutT, float>, "tensor reduce-add is used for fp32 only");
    const uint32_t thread = threadIdx.x % 128;

    #pragma unroll
    for (uint32_t batch = 0; batch < kNumChunks / kBatch; ++batch) {
        uint8_t* half = staging + (batch % 2) * kBatch * Layout::kBufferBytes;
        if (thread == 0)  // one bulk group per batch: the one that last read this half (two back) is done with it
            ptx::bulk_wait_group_read<1>();
        ptx::named_barrier_sync(barrier_id, 128);

        #pragma unroll
        for (uint32_t i = 0; i < kBatch; ++i) {
            Stores::template stage<OutT>(acc, batch * kBatch + i, half + i * Layout::kBufferBytes);
        }
        ptx::fence_view_async_shared();  // the tensor stores read through the async proxy
        ptx::named_barrier_sync(barrier_id, 128);
        if (thread == 0) {
            #pragma unroll
            for (uint32_t i = 0; i < kBatch; ++i)
                ptx::tma_store_3d<kAccumulate>(desc, half + i * Layout::kBufferBytes,
                                               n + (batch * kBatch + i) * Layout::kChunkN, m, g);
            ptx::bulk_commit_group();
        }
    }
}

// `store_tile_tma` with the warpgroup's whole 64 x BLOCK_N share staged at once, in
// BLOCK_N / kChunkN buffers: one fence and two barriers a tile rather than a fence and two
// barriers a chunk (docs/PERF.md, "Decisions": whole-tile staging). The buffers are reused a
// tile later, once the stores before have read them.
template <uint32_t BLOCK_N, typename OutT>
__device__ __forceinline__ void store_whole_tile_tma(const float (&acc)[BLOCK_N / 2], uint8_t* staging,
                                                     uint32_t barrier_id, const CUtensorMap* desc, uint32_t n,
                                                     uint32_t m, uint32_t g) {
    using Layout = SwizzledStaging<OutT, BLOCK_N / SwizzledStaging<OutT>::kChunkN>;
    constexpr uint32_t kNumChunks = BLOCK_N / Layout::kChunkN;
    wait_staging_free(barrier_id);
    #pragma unroll
    for (uint32_t i = 0; i < kNumChunks; ++i) {
        MatrixStores::stage<OutT>(acc, i, staging + i * Layout::kBufferBytes);
    }
    ptx::fence_view_async_shared();  // the tensor stores read through the async proxy
    ptx::named_barrier_sync(barrier_id, 128);
    if (threadIdx.x % 128 == 0) {
        #pragma unroll
        for (uint32_t i = 0; i < kNumChunks; ++i)
            ptx::tma_store_3d<false>(desc, staging + i * Layout::kBufferBytes, n + i * Layout::kChunkN, m, g);
        ptx::bulk_commit_group();
    }
}

__device__ __forceinline__ void drain_bulk_stores() {
    if (threadIdx.x % 128 < 64)
        ptx::bulk_wait_group<0>();
}

}  // namespace deep_gemm::epilogue
