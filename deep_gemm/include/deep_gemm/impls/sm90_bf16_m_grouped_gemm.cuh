#pragma once
// M-grouped bf16 GEMM on Hopper: D[rows of g] = A[rows of g] @ op(B[g]), groups of rows of A
// back to back with arbitrary sizes (read on the GPU from `group_offsets`). With kGatherA,
// row i of A is row a_row_index[i] of the source matrix, gathered by the TMA loads (one
// single-row copy per row, issued by the producer warp's 32 lanes). With kSwiGLU (the MoE's
// first GEMM, B = l1 [G, 2I, K] with gate rows then up rows), each 256-wide tile holds 128
// gate columns and the matching 128 up columns, and the epilogue writes both halves of
// D = h [M, 2I] and also act = silu(gate) * up into d_aux [M, I].
//   B K-major  ("nt"): B is [G, N, K]  -> D = A @ B[g].T   (forward)
//   B MN-major ("nn"): B is [G, K, N]  -> D = A @ B[g]     (data gradient)
// Persistent and warp-specialised: one TMA producer thread, two WGMMA math warpgroups.
#include <cuda.h>
#include <cuda_bf16.h>
#include "../epilogue/activation.cuh"
#include "../epilogue/store.cuh"
#include "../mma/pipeline.cuh"
#include "../ptx/tma.cuh"
#include "../scheduler/grouped.cuh"

namespace deep_gemm {

struct MGroupedGemmParams {
    CUtensorMap tensor_map_a;  // A [M, K]; box {64 (K), 128 rows} (kGatherA: the source rows, box {64, 1})
    CUtensorMap tensor_map_b;  // K-major: [G * N, K], box {64, BLOCK_N}; MN-major: [G * K, N], box {64, 64}
    __nv_bfloat16* d;          // [M, N]
    __nv_bfloat16* d_aux;      // [M, N / 2] with kSwiGLU, else unused
    const int* group_offsets;  // [G + 1]
    const int64_t* a_row_index;  // [M] with kGatherA, else unused
    uint32_t m, n, k, num_groups;
};

// kAsyncStore: the epilogue drains through bulk copies that overlap the next tile's MMAs
// (epilogue::store_rows_async) instead of 16-byte stores by the math threads.
template <uint32_t BLOCK_N, uint32_t kNumStages, mma::Major kMajorB, bool kAsyncStore, bool kGatherA, bool kSwiGLU>
__device__ __forceinline__ void sm90_bf16_m_grouped_gemm_impl(const MGroupedGemmParams& p) {
    using namespace mma;
    static_assert(not kSwiGLU or (BLOCK_N == 256 and kMajorB == Major::kKMajor and not kAsyncStore),
                  "the SwiGLU epilogue pairs 128 gate with 128 up columns, staged synchronously");
    constexpr uint32_t BLOCK_M = 128;
    constexpr uint32_t kStagingBytes = kAsyncStore ? epilogue::RowStaging<BLOCK_N, __nv_bfloat16>::kBytesPerWarpgroup
                                                   : epilogue::StagedBF16<BLOCK_N>::kBytesPerWarpgroup;
    using Smem = GemmSmem<BLOCK_M, BLOCK_N, kNumStages, 2 * kStagingBytes>;
    using Scheduler = scheduler::MGroupedScheduler<BLOCK_M, BLOCK_N>;

    extern __shared__ __align__(1024) uint8_t smem_buffer[];
    const Smem smem{smem_buffer};
    const uint32_t num_k_blocks = ptx::ceil_div(p.k, BLOCK_K);

    start_gemm(smem, &p.tensor_map_a, &p.tensor_map_b);

    Scheduler scheduler(p.group_offsets, p.num_groups, p.m, p.n);
    typename Scheduler::Tile tile;
    PipelineState pipe;

    if (threadIdx.x >= kNumMathThreads) {
        ptx::warpgroup_reg_dealloc<kProducerRegs>();
        DG_TRACE(5, 1);
        constexpr uint32_t kNumLoaders = kGatherA ? 32 : 1, kRowsPerLoader = kGatherA ? BLOCK_M / 32 : 1;
        if (threadIdx.x >= kNumMathThreads + kNumLoaders)
            return;
        const uint32_t lane = threadIdx.x - kNumMathThreads;
        while (scheduler.next(tile)) {
            // Source rows of this lane's A rows (rows past the group are loaded but never stored).
            int32_t a_rows[kRowsPerLoader];
            if constexpr (kGatherA) {
                #pragma unroll
                for (uint32_t i = 0; i < kRowsPerLoader; ++i)
                    a_rows[i] = static_cast<int32_t>(__ldg(p.a_row_index + min(tile.row_begin + lane + 32 * i, p.m - 1)));
            }
            produce_k_blocks<kNumStages, kGatherA>(smem, pipe, num_k_blocks, [&](uint32_t stage, uint32_t k_block, ptx::MBarrier* bar) {
                const uint32_t k = k_block * BLOCK_K;
                if constexpr (kGatherA) {
                    // The 128-byte swizzle follows the shared-memory address, so single-row
                    // copies at their row's offset build the same tile as one 128-row copy.
                    #pragma unroll
                    for (uint32_t i = 0; i < kRowsPerLoader; ++i)
                        ptx::tma_load_2d(smem.a(stage) + (lane + 32 * i) * kSwizzleBytes, &p.tensor_map_a, bar, k, a_rows[i]);
                    if (lane != 0)
                        return;
                } else {
                    ptx::tma_load_2d(smem.a(stage), &p.tensor_map_a, bar, k, tile.row_begin);
                }
                if constexpr (kSwiGLU) {  // 128 gate rows of B, then the matching 128 up rows
                    const uint32_t gate_row = tile.group * p.n + tile.n_begin / 2;
                    ptx::tma_load_2d(smem.b(stage), &p.tensor_map_b, bar, k, gate_row);
                    ptx::tma_load_2d(smem.b(stage) + 128 * kSwizzleBytes, &p.tensor_map_b, bar, k, gate_row + p.n / 2);
                } else if constexpr (kMajorB == Major::kKMajor) {
                    ptx::tma_load_2d(smem.b(stage), &p.tensor_map_b, bar, k, tile.group * p.n + tile.n_begin);
                } else {
                    #pragma unroll
                    for (uint32_t j = 0; j < BLOCK_N / 64; ++j)
                        ptx::tma_load_2d(smem.b(stage) + j * kMNChunkBytes, &p.tensor_map_b, bar,
                                         tile.n_begin + j * 64, tile.group * p.k + k);
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
            zero_accum(acc);
            consume_k_blocks<BLOCK_N, kNumStages, Major::kKMajor, kMajorB>(
                smem, pipe, num_k_blocks, wg * 64 * kSwizzleBytes, acc, [](uint32_t, uint32_t) {});
            const uint32_t row = wg * 64, num_rows = tile.num_rows > row ? tile.num_rows - row : 0;
            __nv_bfloat16* d = p.d + static_cast<uint64_t>(tile.row_begin + row) * p.n + tile.n_begin;
            if constexpr (kSwiGLU) {
                // Accumulators 0..63 hold the gate columns, 64..127 the up columns at the same
                // positions (see mma/wgmma_bf16.cuh), so each thread pairs them in registers.
                const float (&gate)[64] = *reinterpret_cast<const float (*)[64]>(acc);
                const float (&up)[64] = *reinterpret_cast<const float (*)[64]>(acc + 64);
                const uint32_t inter = p.n / 2, col = tile.n_begin / 2;
                __nv_bfloat16* h = p.d + static_cast<uint64_t>(tile.row_begin + row) * p.n + col;
                epilogue::store_bf16_staged<128>(gate, staging, 1 + wg, h, p.n, num_rows, 128);
                epilogue::store_bf16_staged<128>(up, staging, 1 + wg, h + inter, p.n, num_rows, 128);
                float act[64];
                #pragma unroll
                for (uint32_t i = 0; i < 64; ++i)
                    act[i] = epilogue::swiglu(gate[i], up[i]);
                epilogue::store_bf16_staged<128>(act, staging, 1 + wg,
                                                 p.d_aux + static_cast<uint64_t>(tile.row_begin + row) * inter + col,
                                                 inter, num_rows, 128);
            } else if constexpr (kAsyncStore)
                epilogue::store_rows_async<BLOCK_N, __nv_bfloat16, false>(acc, staging, 1 + wg, d, p.n, num_rows, p.n - tile.n_begin);
            else
                epilogue::store_bf16_staged<BLOCK_N>(acc, staging, 1 + wg, d, p.n, num_rows, p.n - tile.n_begin);
            DG_TRACE(threadIdx.x % 128 == 0 ? 10 + wg : 15, 1 + tile.n_begin);
        }
        if constexpr (kAsyncStore)
            epilogue::store_rows_async_drain();
    }
}

}  // namespace deep_gemm
