#pragma once
// K-grouped bf16 GEMM on Hopper (weight gradients): D[g] = A[rows of g].T @ B[rows of g],
// A [rows, M] and B [rows, N] with groups of rows back to back and arbitrary sizes (read on
// the GPU from `group_offsets`); D [G, M, N] in fp32 or bf16, optionally accumulated into.
// Both operands are MN-major. Persistent and warp-specialised like the M-grouped kernel.
// With kGatherA (kGatherB), row r of A (B) is row a_row_index[r] (b_row_index[r]) of the
// source matrix, gathered with cp.async by the whole producer warpgroup; the other operand
// still comes by TMA. With kMulticastB, CTAs run in clusters of two that take two M blocks at
// the same N block: each loads half of B's tile and multicasts it to both, a third less L2
// traffic per tile (groups of a few hundred rows make tiles of a few k-blocks, whose loads
// start to outrun the MMAs).
#include <cuda.h>
#include <cuda_bf16.h>
#include <type_traits>
#include "../epilogue/store.cuh"
#include "../mma/pipeline.cuh"
#include "../ptx/cp_async.cuh"
#include "../ptx/tma.cuh"
#include "../scheduler/grouped.cuh"

namespace deep_gemm {

struct KGroupedGemmParams {
    CUtensorMap tensor_map_a;  // A [rows, M]; box {64 (M), 64 rows} (unused with kGatherA)
    CUtensorMap tensor_map_b;  // B [rows, N]; box {64 (N), 64 rows} (unused with kGatherB)
    CUtensorMap tensor_map_d;  // D [G, M, N]; box {128 bytes of N, 64 (M), 1} (kTmaStore only)
    void* d;                   // [G, M, N], OutT
    const int* group_offsets;  // [G + 1]
    const int64_t* a_row_index;  // [rows] with kGatherA, else unused
    const int64_t* b_row_index;  // [rows] with kGatherB, else unused
    const __nv_bfloat16* a;      // with kGatherA: the source rows [a_rows, M]
    const __nv_bfloat16* b;      // with kGatherB: the source rows [b_rows, N]
    uint32_t m, n, rows, num_groups, a_rows, b_rows;
};

// kAsyncStore: the epilogue drains through bulk copies (reduce-adds with kAccumulate) that
// overlap the next tile's MMAs (epilogue::store_rows_async) instead of direct stores.
// kTmaStore: through one tensor store (fp32: or reduce-add) per 128-byte column chunk instead
// (epilogue::store_tile_tma), staged in kNumStoreBuffers buffers per warpgroup; bf16
// accumulation is not among its variants. More buffers keep more of a tile's output in flight
// while the next tile computes, at the cost of pipeline stages: short groups (tiles of few
// k-blocks, fp32 most of all) measured fastest with 4 (half an fp32 tile, three stages).
template <uint32_t BLOCK_N, uint32_t kNumStages, typename OutT, bool kAccumulate, bool kAsyncStore, bool kTmaStore,
          bool kGatherA, bool kGatherB, uint32_t kNumStoreBuffers = 2, bool kMulticastB = false>
__device__ __forceinline__ void sm90_bf16_k_grouped_gemm_impl(const KGroupedGemmParams& p) {
    using namespace mma;
    constexpr uint32_t BLOCK_M = 128, kClusterSize = kMulticastB ? 2 : 1;
    static_assert(not (kMulticastB and kGatherB), "B's rows come by TMA to be multicast");
    static_assert(not kTmaStore or (not kAsyncStore and (std::is_same_v<OutT, float> or not kAccumulate)));
    constexpr uint32_t kStagingBytes = kTmaStore   ? epilogue::SwizzledStaging<OutT, kNumStoreBuffers>::kBytesPerWarpgroup
                                       : kAsyncStore ? epilogue::RowStaging<BLOCK_N, OutT>::kBytesPerWarpgroup : 0;
    using Smem = GemmSmem<BLOCK_M, BLOCK_N, kNumStages, 2 * kStagingBytes>;
    using Scheduler = scheduler::KGroupedScheduler<BLOCK_M, BLOCK_N, kClusterSize>;

    extern __shared__ __align__(1024) uint8_t smem_buffer[];
    const Smem smem{smem_buffer};

    constexpr bool kGather = kGatherA or kGatherB;
    start_gemm<kGather, kClusterSize>(smem, &p.tensor_map_a, &p.tensor_map_b);
    const uint32_t cta_rank = kMulticastB ? ptx::cluster_cta_rank() : 0;

    Scheduler scheduler(p.group_offsets, p.num_groups, p.m, p.n, p.rows);
    typename Scheduler::Tile tile;
    PipelineState pipe;

    if (threadIdx.x >= kNumMathThreads) {
        ptx::warpgroup_reg_dealloc<kProducerRegs>();
        DG_TRACE(5, 1);
        const uint32_t t = threadIdx.x - kNumMathThreads;
        if (not kGather and t != 0) {  // idle, but present for the cluster's last sync
            finish_gemm<kClusterSize>();
            return;
        }
        constexpr uint32_t kTxBytes = (kGatherA ? 0 : Smem::kBytesA) + (kGatherB ? 0 : Smem::kBytesB);
        using GatherA = ptx::MNMajorRowGather<BLOCK_M, kMNChunkBytes>;
        using GatherB = ptx::MNMajorRowGather<BLOCK_N, kMNChunkBytes>;
        while (scheduler.next(tile)) {
            const uint32_t num_k_blocks = ptx::ceil_div(tile.k_end - tile.k_begin, BLOCK_K);
            // Row indices of gathered operands, loaded one k-block ahead of their copies.
            int64_t next_a = 0, next_b = 0;
            if (kGatherA and num_k_blocks > 0)
                next_a = GatherA::load_index(p.a_row_index, p.rows, tile.k_begin, t);
            if (kGatherB and num_k_blocks > 0)
                next_b = GatherB::load_index(p.b_row_index, p.rows, tile.k_begin, t);
            produce_k_blocks<kNumStages, kTxBytes>(smem, pipe, num_k_blocks, t == 0, [&](uint32_t stage, uint32_t k_block, ptx::MBarrier* bar) {
                const uint32_t k = tile.k_begin + k_block * BLOCK_K;
                // Gathered K rows past the group are zero-filled by the math warpgroups before use.
                const int64_t index_a = next_a, index_b = next_b;
                if (k_block + 1 < num_k_blocks) {
                    if constexpr (kGatherA)
                        next_a = GatherA::load_index(p.a_row_index, p.rows, k + BLOCK_K, t);
                    if constexpr (kGatherB)
                        next_b = GatherB::load_index(p.b_row_index, p.rows, k + BLOCK_K, t);
                }
                if constexpr (kGatherA)
                    GatherA::copy(smem.a(stage), p.a, p.a_rows, p.m, index_a, tile.m_begin, p.m, t);
                if constexpr (kGatherB)
                    GatherB::copy(smem.b(stage), p.b, p.b_rows, p.n, index_b, tile.n_begin, p.n, t);
                if constexpr (kGather) {
                    ptx::cp_async_arrive_noinc(bar);
                    if (t != 0)
                        return;
                }
                if constexpr (not kGatherB) {  // with kMulticastB, CTA r loads the boxes j with j % 2 == r for both
                    #pragma unroll
                    for (uint32_t j = 0; j < BLOCK_N / 64; ++j) {
                        if constexpr (kMulticastB) {
                            if (j % 2 == cta_rank)
                                ptx::tma_load_2d_multicast(smem.b(stage) + j * kMNChunkBytes, &p.tensor_map_b, bar,
                                                           tile.n_begin + j * 64, k, 0b11);
                        } else {
                            ptx::tma_load_2d(smem.b(stage) + j * kMNChunkBytes, &p.tensor_map_b, bar, tile.n_begin + j * 64, k);
                        }
                    }
                }
                if constexpr (not kGatherA) {
                    #pragma unroll
                    for (uint32_t j = 0; j < BLOCK_M / 64; ++j)
                        ptx::tma_load_2d(smem.a(stage) + j * kMNChunkBytes, &p.tensor_map_a, bar, tile.m_begin + j * 64, k);
                }
            });
        }
    } else {
        ptx::warpgroup_reg_alloc<kMathRegs>();
        DG_TRACE(threadIdx.x % 128 == 0 ? 6 + threadIdx.x / 128 : 15, 1);
        const uint32_t wg = threadIdx.x / 128;
        uint8_t* staging = smem.extra() + wg * kStagingBytes;
        float acc[BLOCK_N / 2];
        while (scheduler.next(tile)) {
            const uint32_t num_rows = tile.k_end - tile.k_begin;
            const uint32_t num_k_blocks = ptx::ceil_div(num_rows, BLOCK_K);
            if (kAccumulate and num_k_blocks == 0)
                continue;  // an empty group adds nothing

            // The last block of a group reads past the group's end (into the next group's
            // rows). Its k16 slices wholly past the end are skipped; the rows past the end in
            // the slice that holds it are zeroed in both tiles. Each K row is one 128-byte line
            // per chunk (its swizzle only permutes the line's 16-byte pieces). Thread t zeroes
            // piece t % 8 of chunk t / 8 % kNumChunks in every kRowsPerPass-th row: no run-time
            // division.
            const uint32_t valid_in_last = num_rows - (num_k_blocks - 1) * BLOCK_K;
            const uint32_t num_k16_last = ptx::ceil_div(valid_in_last, 16u);
            const auto zero_tail = [&](uint32_t stage, uint32_t k_block) {
                if constexpr (kGather)  // cp.async wrote through the generic proxy; WGMMA reads the async one
                    ptx::fence_view_async_shared();
                if (k_block + 1 != num_k_blocks or valid_in_last % 16 == 0)
                    return;
                constexpr uint32_t kNumChunks = (BLOCK_M + BLOCK_N) / 64, kPiecesPerRow = kNumChunks * 8;
                constexpr uint32_t kRowsPerPass = kNumMathThreads / kPiecesPerRow;
                const uint32_t chunk = threadIdx.x / 8 % kNumChunks;
                uint8_t* line = (chunk < BLOCK_M / 64 ? smem.a(stage) + chunk * kMNChunkBytes
                                                      : smem.b(stage) + (chunk - BLOCK_M / 64) * kMNChunkBytes) +
                                (threadIdx.x % 8) * 16;
                if (threadIdx.x < kRowsPerPass * kPiecesPerRow) {
                    for (uint32_t r = valid_in_last + threadIdx.x / kPiecesPerRow; r < num_k16_last * 16; r += kRowsPerPass)
                        ptx::st_shared_v4(line + r * kSwizzleBytes, make_uint4(0, 0, 0, 0));
                }
                ptx::fence_view_async_shared();
                ptx::named_barrier_sync(1, kNumMathThreads);
            };

            zero_accum(acc);
            consume_k_blocks<BLOCK_N, kNumStages, Major::kMNMajor, Major::kMNMajor, kClusterSize>(
                smem, pipe, num_k_blocks, wg * kMNChunkBytes, acc, zero_tail, num_k16_last);

            const uint32_t row = tile.m_begin + wg * 64, valid_rows = row < p.m ? p.m - row : 0;
            OutT* d = static_cast<OutT*>(p.d) + (static_cast<uint64_t>(tile.group) * p.m + min(row, p.m)) * p.n + tile.n_begin;
            if constexpr (kTmaStore)  // barrier 1 is the zero-fill's; 2 and 3 are per warpgroup
                epilogue::store_tile_tma<BLOCK_N, OutT, kAccumulate, kNumStoreBuffers>(acc, staging, 2 + wg, &p.tensor_map_d,
                                                                                       tile.n_begin, row, tile.group);
            else if constexpr (kAsyncStore)
                epilogue::store_rows_async<BLOCK_N, OutT, kAccumulate>(acc, staging, 2 + wg, d, p.n, valid_rows, p.n - tile.n_begin);
            else
                epilogue::store_direct<BLOCK_N, OutT, kAccumulate>(acc, d, p.n, valid_rows, p.n - tile.n_begin);
            DG_TRACE(threadIdx.x % 128 == 0 ? 10 + wg : 15, 1 + tile.n_begin);
        }
        if constexpr (kAsyncStore or kTmaStore)
            epilogue::store_rows_async_drain();
    }
    finish_gemm<kClusterSize>();
}

}  // namespace deep_gemm
