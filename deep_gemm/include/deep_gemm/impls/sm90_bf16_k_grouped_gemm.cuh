#pragma once
// K-grouped bf16 GEMM on Hopper (weight gradients): D[g] = A[rows of g].T @ B[rows of g], A [rows, M]
// and B [rows, N] with groups of rows back to back and arbitrary sizes (read on the GPU from
// `group_offsets`); D [G, M, N] fp32 or bf16, written or added to as the Epilogue policy says
// (epilogue/k_grouped.cuh). Both operands are MN-major and come by TMA. Persistent and
// warp-specialised like the m-grouped kernel. With kClusterSize = 2 the CTAs of a cluster take
// two M blocks at the same N block and each loads half of B's tile for both (TMA multicast
// inside the cluster): a third less L2 traffic per tile, which short groups (tiles of a few
// k-blocks, whose loads start to outrun the MMAs) need.
#include <cuda.h>
#include <cuda_bf16.h>
#include "../epilogue/k_grouped.cuh"
#include "../mma/pipeline.cuh"
#include "../ptx/tma.cuh"
#include "../scheduler/grouped.cuh"

namespace deep_gemm {

// alignas(128): the size the launcher packs whether cuda.h aligns CUtensorMap to 128 (CUDA 13) or 64.
struct alignas(128) KGroupedGemmParams {
    CUtensorMap tensor_map_a;  // A [rows, M]; box {64 (M), 64 rows}
    CUtensorMap tensor_map_b;  // B [rows, N]; box {64 (N), 64 rows}
    CUtensorMap tensor_map_d;  // D [G, M, N]; box {128 bytes of N, 64 (M), 1} (epilogue::TensorStores)
    void* d;                   // [G, M, N]
    const int* group_offsets;  // [G + 1]
    uint32_t m, n, rows, num_groups;
};

template <uint32_t BLOCK_N, uint32_t kNumStages, uint32_t kClusterSize, typename Epilogue>
struct Sm90BF16KGroupedGemm {
    static constexpr uint32_t BLOCK_M = 128;
    using Smem = mma::GemmSmem<BLOCK_M, BLOCK_N, kNumStages, 2 * Epilogue::kStagingBytes>;
    static constexpr uint32_t kNumThreads = mma::kNumThreads;
    static constexpr uint32_t kSmemBytes = Smem::kTotalBytes;
    static_assert(kClusterSize == 1 or kClusterSize == 2, "B is shared by at most two CTAs");

    __device__ __forceinline__ static void run(const KGroupedGemmParams& p) {
        using namespace mma;
        using Scheduler = scheduler::KGroupedScheduler<BLOCK_M, BLOCK_N, kClusterSize>;
        extern __shared__ __align__(1024) uint8_t smem_buffer[];
        const Smem smem{smem_buffer};

        start_gemm<0, kClusterSize>(smem, &p.tensor_map_a, &p.tensor_map_b);
        if (threadIdx.x == 0)
            Epilogue::prefetch(p);
        const uint32_t cta_rank = kClusterSize > 1 ? ptx::cluster_cta_rank() : 0;

        Scheduler scheduler(p.group_offsets, p.num_groups, p.m, p.n, p.rows);
        typename Scheduler::Tile tile;
        PipelineState pipe;

        if (threadIdx.x >= kNumMathThreads) {
            ptx::warpgroup_reg_dealloc<kProducerRegs>();
            DG_TRACE(5, 1);
            if (threadIdx.x != kNumMathThreads) {  // idle, but present for the cluster's last sync
                finish_gemm<kClusterSize>();
                return;
            }
            while (scheduler.next(tile)) {
                const uint32_t num_k_blocks = ptx::ceil_div(tile.k_end - tile.k_begin, BLOCK_K);
                produce_k_blocks<kNumStages, Smem::kBytesPerStage>(smem, pipe, num_k_blocks, true, NoPublish{}, [&](uint32_t stage, uint32_t k_block, ptx::MBarrier* bar) {
                    const uint32_t k = tile.k_begin + k_block * BLOCK_K;
                    // With a cluster, CTA r loads the boxes j with j % 2 == r for both.
                    #pragma unroll
                    for (uint32_t j = 0; j < BLOCK_N / 64; ++j) {
                        if constexpr (kClusterSize > 1) {
                            if (j % 2 == cta_rank)
                                ptx::tma_load_2d_multicast(smem.b(stage) + j * kMNChunkBytes, &p.tensor_map_b, bar,
                                                           tile.n_begin + j * 64, k, 0b11);
                        } else {
                            ptx::tma_load_2d(smem.b(stage) + j * kMNChunkBytes, &p.tensor_map_b, bar, tile.n_begin + j * 64, k);
                        }
                    }
                    #pragma unroll
                    for (uint32_t j = 0; j < BLOCK_M / 64; ++j)
                        ptx::tma_load_2d(smem.a(stage) + j * kMNChunkBytes, &p.tensor_map_a, bar, tile.m_begin + j * 64, k);
                });
            }
        } else {
            ptx::warpgroup_reg_alloc<kMathRegs>();
            DG_TRACE(threadIdx.x % 128 == 0 ? 6 + threadIdx.x / 128 : 15, 1);
            const uint32_t wg = ptx::warpgroup_idx();
            uint8_t* staging = smem.extra() + wg * Epilogue::kStagingBytes;
            float acc[BLOCK_N / 2];
            while (scheduler.next(tile)) {
                const uint32_t num_rows = tile.k_end - tile.k_begin;
                const uint32_t num_k_blocks = ptx::ceil_div(num_rows, BLOCK_K);
                if (Epilogue::kAccumulates and num_k_blocks == 0)
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
                // Barrier 1 is the zero fill's; 2 and 3 are per warpgroup.
                Epilogue::store(acc, p, tile.group, tile.m_begin + wg * 64, tile.n_begin, staging, 2 + wg);
                DG_TRACE(threadIdx.x % 128 == 0 ? 10 + wg : 15, 1 + tile.n_begin);
            }
            Epilogue::drain();
        }
        finish_gemm<kClusterSize>();
    }
};

}  // namespace deep_gemm
