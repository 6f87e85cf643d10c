#pragma once
// M-grouped bf16 GEMM on Hopper: D[rows of g] = A[rows of g] @ op(B[g]), groups of rows of A back
// to back with arbitrary sizes, read on the GPU from `group_offsets` (scheduler::MGroupedScheduler,
// which also splits each group into passes).
//   B K-major  ("nt"): B is [G, N, K]  -> D = A @ B[g].T   (forward)
//   B MN-major ("nn"): B is [G, K, N]  -> D = A @ B[g]     (data gradient)
// Persistent and warp-specialised: a producer warpgroup (its thread 0 loads B by TMA; A as the
// Producer policy says, producer/rows.cuh) and two WGMMA math warpgroups of 64 rows each, whose
// accumulators leave as the Epilogue policy says (epilogue/m_grouped.cuh). A tile of pass s > 0
// is loaded once ready_flags[s] is set (comm::PassGate).
#include <cuda.h>
#include <cuda_bf16.h>
#include "../comm/flags.cuh"
#include "../epilogue/m_grouped.cuh"
#include "../mma/pipeline.cuh"
#include "../producer/rows.cuh"
#include "../scheduler/grouped.cuh"

namespace deep_gemm {

// alignas(128): the size the launcher packs whether cuda.h aligns CUtensorMap to 128 (CUDA 13) or 64.
struct alignas(128) MGroupedGemmParams {
    CUtensorMap tensor_map_a;    // A [M, K]; box {64 (K), 128 rows} (producer::TmaRows)
    CUtensorMap tensor_map_b;    // K-major: [G * N, K], box {64, BLOCK_N / Columns::kNumBoxes}; MN-major: [G * K, N], box {64, 64}
    CUtensorMap tensor_map_d;    // D as [1, M, N]; box {64 (N), 64 rows, 1}
    CUtensorMap tensor_map_act;  // act as [1, M, N / 2], the same box (SwiGLU only)
    __nv_bfloat16* d;            // [M, N]
    __nv_bfloat16* act;          // [M, N / 2] (SwiGLU only)
    const int* group_offsets;    // [G * num_passes + 1]
    const int64_t* a_row_index;  // [M] (producer::GatheredRows)
    const __nv_bfloat16* a;      // the source rows [a_rows, K] (producer::GatheredRows)
    const int* ready_flags;      // [num_passes] or null
    uint32_t m, n, k, num_groups, a_rows, num_passes, pass_begin, pass_end;
};

template <uint32_t BLOCK_N, uint32_t kNumStages, mma::Major kMajorB, typename Producer, typename Epilogue>
struct Sm90BF16MGroupedGemm {
    static constexpr uint32_t BLOCK_M = 128;
    using Smem = mma::GemmSmem<BLOCK_M, BLOCK_N, kNumStages, 2 * Epilogue::kStagingBytes>;
    using Columns = typename Epilogue::Columns;
    static constexpr uint32_t kNumThreads = mma::kNumThreads;
    static constexpr uint32_t kSmemBytes = Smem::kTotalBytes;
    static_assert(Epilogue::kStagingBytes % 1024 == 0, "each warpgroup's staging starts 1024-byte aligned");
    static_assert(kMajorB == mma::Major::kKMajor or Columns::kNumBoxes == 1, "MN-major B loads whole column chunks");

    __device__ __forceinline__ static void run(const MGroupedGemmParams& p) {
        using namespace mma;
        using Scheduler = scheduler::MGroupedScheduler<BLOCK_M, BLOCK_N>;
        extern __shared__ __align__(1024) uint8_t smem_buffer[];
        const Smem smem{smem_buffer};
        const uint32_t num_k_blocks = ptx::ceil_div(p.k, BLOCK_K);

        start_gemm<Producer::kNumCopyThreads>(smem, &p.tensor_map_a, &p.tensor_map_b);
        if (threadIdx.x == 0)  // once per CTA, for the stores the math warpgroups issue
            Epilogue::prefetch(p);

        Scheduler scheduler(p.group_offsets, p.num_groups, p.num_passes, p.pass_begin, p.pass_end, p.m, p.n);
        typename Scheduler::Tile tile;
        PipelineState pipe;

        if (threadIdx.x >= kNumMathThreads) {
            ptx::warpgroup_reg_dealloc<kProducerRegs>();
            DG_TRACE(5, 1);
            const uint32_t t = threadIdx.x - kNumMathThreads;
            if (Producer::kNumCopyThreads == 0 and t != 0)  // TMA alone: thread 0 issues every load
                return;
            constexpr uint32_t kTxBytes = (Producer::kNumCopyThreads > 0 ? 0 : Smem::kBytesA) + Smem::kBytesB;
            comm::PassGate gate;
            while (scheduler.next(tile)) {
                gate.wait_for(p.ready_flags, tile.pass);
                const auto rows = Producer::begin(p, tile.row_begin, tile.num_rows, t);
                produce_k_blocks<kNumStages, kTxBytes>(smem, pipe, num_k_blocks, t == 0, NoPublish{}, [&](uint32_t stage, uint32_t k_block, ptx::MBarrier* bar) {
                    const uint32_t k = k_block * BLOCK_K;
                    Producer::load(smem.a(stage), p, rows, k, bar, t);
                    if (t == 0)
                        load_b(smem.b(stage), p, tile, k, bar);
                });
            }
        } else {
            ptx::warpgroup_reg_alloc<kMathRegs>();
            DG_TRACE(threadIdx.x % 128 == 0 ? 6 + threadIdx.x / 128 : 15, 1);
            const uint32_t wg = ptx::warpgroup_idx();
            uint8_t* staging = smem.extra() + wg * Epilogue::kStagingBytes;
            float acc[BLOCK_N / 2];
            while (scheduler.next(tile)) {
                const uint32_t row = wg * 64;
                const epilogue::WarpgroupRows rows{tile.row_begin + row, tile.num_rows > row ? tile.num_rows - row : 0,
                                                   tile.n_begin};
                zero_accum(acc);
                consume_k_blocks<BLOCK_N, kNumStages, Major::kKMajor, kMajorB>(
                    smem, pipe, num_k_blocks, row * kSwizzleBytes, acc, [](uint32_t, uint32_t) {
                        if constexpr (Producer::kNumCopyThreads > 0)  // cp.async wrote A through the generic proxy
                            ptx::fence_view_async_shared();
                    });
                Epilogue::store(acc, p, rows, staging, 1 + wg);
                DG_TRACE(threadIdx.x % 128 == 0 ? 10 + wg : 15, 1 + tile.n_begin);
            }
            Epilogue::drain();
        }
    }

    // B's share of a stage: K-major, the Columns' boxes of B rows; MN-major, 64-wide column chunks.
    template <typename Tile>
    __device__ __forceinline__ static void load_b(uint8_t* smem_b, const MGroupedGemmParams& p, const Tile& tile,
                                                  uint32_t k, ptx::MBarrier* bar) {
        using namespace mma;
        if constexpr (kMajorB == Major::kKMajor) {
            constexpr uint32_t kBoxRows = BLOCK_N / Columns::kNumBoxes;
            #pragma unroll
            for (uint32_t j = 0; j < Columns::kNumBoxes; ++j)
                ptx::tma_load_2d(smem_b + j * kBoxRows * kSwizzleBytes, &p.tensor_map_b, bar, k,
                                 tile.group * p.n + Columns::box_row(j, tile.n_begin, p.n));
        } else {
            #pragma unroll
            for (uint32_t j = 0; j < BLOCK_N / 64; ++j)
                ptx::tma_load_2d(smem_b + j * kMNChunkBytes, &p.tensor_map_b, bar, tile.n_begin + j * 64,
                                 tile.group * p.k + k);
        }
    }
};

}  // namespace deep_gemm
