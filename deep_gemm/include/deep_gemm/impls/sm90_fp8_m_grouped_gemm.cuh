#pragma once
// M-grouped blockwise-FP8 GEMM on Hopper: D[rows of g] = A[rows of g] @ B[g].T in bf16, from e4m3
// operands with fp32 scales (docs/DESIGN.md, "Blockwise FP8"): A [M, K] per 1 x 128, B [G, N, K]
// per 128 x 128. The forward runs it on the weights, the data gradient on their transposed copy
// (both operands of FP8 WGMMA are K-major). The same structure as the bf16 kernel: persistent,
// warp-specialised, scheduler::MGroupedScheduler's tiles and passes, comm::PassGate, A's rows by
// the Producer policy (with their scales), the Epilogue policy (bf16 out; SwiGLU's act in bf16 or
// e4m3); the mainloop promotes every 128-deep k-block into fp32 with its scales
// (mma/pipeline_fp8.cuh).
#include <cuda.h>
#include <cuda_bf16.h>
#include "../comm/flags.cuh"
#include "../epilogue/m_grouped.cuh"
#include "../mma/pipeline_fp8.cuh"
#include "../producer/rows.cuh"
#include "../scheduler/grouped.cuh"

namespace deep_gemm {

struct alignas(128) MGroupedFp8GemmParams {
    CUtensorMap tensor_map_a;         // A [a_rows, K] e4m3; box {128 (K), 128 rows}
    CUtensorMap tensor_map_b;         // B as [G * N, K] e4m3; box {128, BLOCK_N / Epilogue::Columns::kNumBoxes}
    CUtensorMap tensor_map_d;         // D as [1, M, N] bf16; box {64 (N), 64 rows, 1}
    CUtensorMap tensor_map_scales_a;  // A's scales as [K / 128][a_rows] fp32 (row stride a_scales_ld); box {132, 1}
    CUtensorMap tensor_map_act;       // act as [1, M, N / 2]: bf16, box {64, 64, 1} (epilogue::SwiGLUTensorStore),
                                      // or e4m3, box {128, 64, 1} (epilogue::SwiGLUFp8ActTensorStore)
    __nv_bfloat16* d;                 // [M, N]
    __nv_bfloat16* act;               // [M, N / 2] (epilogue::SwiGLUTensorStore)
    uint8_t* act_fp8;                 // [M, N / 2] e4m3 (epilogue::SwiGLUFp8ActTensorStore)
    float* act_scales;                // act_fp8's per 1 x 128: (m, kb) at act_scales[kb * act_scales_ld + m]
    const int* group_offsets;         // [G * num_passes + 1]
    const int64_t* a_row_index;       // [M] (producer::Fp8GatheredRows)
    const uint8_t* a;                 // the source rows [a_rows, K] (producer::Fp8GatheredRows)
    const float* a_scales;            // [K / 128][a_scales_ld] (producer::Fp8GatheredRows)
    const float* b_scales;            // B's scale of (g, n block, k block) at g * stride_g + n * stride_n + k * stride_k
    const int* ready_flags;           // [num_passes] or null
    uint32_t m, n, k, num_groups, a_rows, num_passes, pass_begin, pass_end;
    uint32_t a_scales_ld, b_scales_stride_g, b_scales_stride_n, b_scales_stride_k, act_scales_ld;
};

// Turns: mma::IssueTurns or mma::NoTurns (the math warpgroups' MMA batches in turns or not;
// mma/pipeline_fp8.cuh).
template <uint32_t BLOCK_N, uint32_t kNumStages, typename Producer, typename Epilogue, typename Turns>
struct Sm90FP8MGroupedGemm {
    static constexpr uint32_t BLOCK_M = 128;
    static_assert(BLOCK_N == 128 or BLOCK_N == 256, "one B scale block per 128 columns and k-block");
    // Two sets of fresh products fit the registers beside 64 accumulators, not beside 128.
    static constexpr uint32_t kNumProductSets = BLOCK_N == 128 ? 2 : 1;
    // A tile's epilogue runs while the next tile's first product is in flight, whose promotion
    // then overwrites acc (no zeroed sums live beside the leaving ones): where the epilogue fits the
    // registers beside one product (docs/PERF.md, "Decisions": epilogue beside the next tile).
    static constexpr bool kEpilogueBesideNextTile = kNumProductSets == 1 and Epilogue::kFitsBesideProduct;
    using Smem = mma::GemmSmem<BLOCK_M, BLOCK_N, kNumStages, 2 * Epilogue::kStagingBytes,
                              producer::kFp8ScaleStageBytes>;
    static constexpr uint32_t kNumThreads = mma::kNumThreads;
    static constexpr uint32_t kSmemBytes = Smem::kTotalBytes;
    static_assert(Epilogue::kStagingBytes % 1024 == 0, "each warpgroup's staging starts 1024-byte aligned");
    // B's tile comes in boxes of rows (the Epilogue's Columns: one, or gate and up); each
    // 128-column product lies in one box and has one B scale block.
    using Columns = typename Epilogue::Columns;
    static constexpr uint32_t kBoxRowsB = BLOCK_N / Columns::kNumBoxes;
    static_assert(kBoxRowsB % 128 == 0, "a product's 128 B rows lie in one box");

    // The first B row (of the group's N) of the tile's 128-column product `cols`.
    __device__ __forceinline__ static uint32_t product_row(uint32_t cols, uint32_t n_begin, uint32_t n) {
        return Columns::box_row(cols * 128 / kBoxRowsB, n_begin, n) + cols * 128 % kBoxRowsB;
    }

    // Each product's B scale rides in the stage beside A's scales, copied by producer thread 0, so
    // that the math warpgroups read it from shared memory rather than wait on an L2 read per product.
    static constexpr uint32_t kBScaleSlot = 144;  // (floats: past Fp8TmaRows' 132 A scales)
    static_assert(Producer::kScaleTxBytes <= kBScaleSlot * sizeof(float) and kBScaleSlot >= BLOCK_M,
                  "the B scales lie past every A scale a producer writes");
    static_assert((kBScaleSlot + BLOCK_N / 128) * sizeof(float) <= producer::kFp8ScaleStageBytes);
    // Tiles from the producer: its thread walks the scheduler one tile ahead and leaves the next
    // tile (and whether there is one) in each tile's first stage, past the B scales, where the math
    // warpgroups read it rather than walk the groups themselves beside the tile's first MMAs (the
    // walk's dependent loads left the tensor cores idle). With TMA rows in 256-wide tiles only: the
    // gathered rows' producers and the 128-wide one spill when they walk ahead, and their math
    // warpgroups walk as before (docs/PERF.md, "Decisions": tiles from the producer).
    static constexpr bool kTilesFromProducer = Producer::kNumCopyThreads == 0 and BLOCK_N == 256;
    static constexpr uint32_t kTileSlot = 148;  // (floats; 16-byte aligned, 32 bytes: Scheduler::Tile::publish)
    static_assert(kTileSlot >= kBScaleSlot + BLOCK_N / 128 and kTileSlot % 4 == 0 and
                  (kTileSlot + 8) * sizeof(float) <= producer::kFp8ScaleStageBytes);
    __device__ __forceinline__ static uint8_t* tile_slot(float* scales) {
        return reinterpret_cast<uint8_t*>(scales + kTileSlot);
    }

    // The math warpgroups' registers: 224 with TMA rows, where ptxas's schedule at that cap ran the
    // 30B forwards 4-5% faster than at 232 (spills at neither), and 232 with gathered rows, whose
    // SwiGLU form at 224 took 3-4% longer (docs/PERF.md, "Decisions": math registers).
    // (setmaxnreg only moves the registers the launch gave: 65536 / 384 a thread, rounded down to 8)
    static constexpr uint32_t kMathRegsFp8 = Producer::kNumCopyThreads == 0 ? 224 : mma::kMathRegs;
    static_assert(mma::kProducerRegs * mma::kNumProducerThreads + kMathRegsFp8 * mma::kNumMathThreads <=
                  65536 / mma::kNumThreads / 8 * 8 * mma::kNumThreads);

    // Thread 0's cp.async arrival on each full barrier: the copy threads' own, or one more.
    static constexpr uint32_t kNumCopyArrivals = Producer::kNumCopyThreads > 0 ? Producer::kNumCopyThreads : 1;

    __device__ __forceinline__ static void run(const MGroupedFp8GemmParams& p) {
        using namespace mma;
        using Scheduler = scheduler::MGroupedScheduler<BLOCK_M, BLOCK_N>;
        extern __shared__ __align__(1024) uint8_t smem_buffer[];
        const Smem smem{smem_buffer};
        const uint32_t num_k_blocks = p.k / BLOCK_K_FP8;

        start_gemm<kNumCopyArrivals, 1, kFp8ReleasesPerCta>(smem, &p.tensor_map_a, &p.tensor_map_b);
        if (threadIdx.x == 0)  // once per CTA, for the stores the math warpgroups issue
            Epilogue::prefetch(p);

        Scheduler scheduler(p.group_offsets, p.num_groups, p.num_passes, p.pass_begin, p.pass_end, p.m, p.n);
        typename Scheduler::Tile tile;
        PipelineState pipe;

        if (threadIdx.x >= kNumMathThreads) {
            ptx::warpgroup_reg_dealloc<kProducerRegs>();
            const uint32_t t = threadIdx.x - kNumMathThreads;
            if (Producer::kNumCopyThreads == 0 and t != 0)  // TMA alone: thread 0 issues every load
                return;
            if (Producer::kNumCopyThreads == 0)
                ptx::prefetch_tma_descriptor(&p.tensor_map_scales_a);
            constexpr uint32_t kTxBytes =
                (Producer::kNumCopyThreads > 0 ? 0 : Smem::kBytesA) + Smem::kBytesB + Producer::kScaleTxBytes;
            comm::PassGate gate;
            // (front end warning 549 on `tile` below is spurious: the lambda runs after scheduler.next fills it)
#pragma nv_diag_suppress 549
            const auto produce_tile = [&](const auto& publish) {
                gate.wait_for(p.ready_flags, tile.pass);
                const auto rows = Producer::begin(p, tile.row_begin, tile.num_rows, t);
                produce_k_blocks<kNumStages, kTxBytes>(smem, pipe, num_k_blocks, t == 0, publish, [&](uint32_t stage, uint32_t k_block, ptx::MBarrier* bar) {
                    const uint32_t k = k_block * BLOCK_K_FP8;
                    if (t == 0) {  // (before the copy threads' arrival, which then covers these copies)
                        #pragma unroll
                        for (uint32_t cols = 0; cols < BLOCK_N / 128; ++cols)
                            ptx::cp_async_4(smem.scales(stage) + kBScaleSlot + cols,
                                            p.b_scales + static_cast<uint64_t>(tile.group) * p.b_scales_stride_g +
                                                product_row(cols, tile.n_begin, p.n) / 128 * p.b_scales_stride_n +
                                                k_block * p.b_scales_stride_k, true);
                        if constexpr (Producer::kNumCopyThreads == 0)
                            ptx::cp_async_arrive_noinc(bar);
                    }
                    Producer::load(smem.a(stage), smem.scales(stage), p, rows, k, bar, t);
                    if (t == 0)
                        #pragma unroll
                        for (uint32_t j = 0; j < Columns::kNumBoxes; ++j)
                            ptx::tma_load_2d(smem.b(stage) + j * kBoxRowsB * kSwizzleBytes, &p.tensor_map_b, bar, k,
                                             tile.group * p.n + Columns::box_row(j, tile.n_begin, p.n));
                });
            };
#pragma nv_diag_default 549
            if constexpr (kTilesFromProducer) {
                produce_tiles_publishing_next(scheduler, tile, [&](uint32_t stage) { return tile_slot(smem.scales(stage)); },
                                              produce_tile);
            } else {
                while (scheduler.next(tile))
                    produce_tile(NoPublish{});
            }
        } else {
            ptx::warpgroup_reg_alloc<kMathRegsFp8>();
            const uint32_t wg = ptx::warpgroup_idx();
            uint8_t* staging = smem.extra() + wg * Epilogue::kStagingBytes;
            const uint32_t scale_row = accumulator_row();
            float acc[BLOCK_N / 2];
            const Turns turns(wg);
            turns.prime();
            WaitAtIssue stage_wait;
            // The first tile is walked to; each next one is read from its predecessor's first stage
            // (kTilesFromProducer) or walked to while that tile's first MMAs run, and the previous
            // tile's epilogue is stored there too with kEpilogueBesideNextTile.
            typename Scheduler::Tile upcoming;
            bool more = scheduler.next(tile);
            epilogue::WarpgroupRows done{0, 0, 0};  // the previous tile's rows, if `pending` (kEpilogueBesideNextTile)
            bool pending = false;
            while (more) {
                const uint32_t row = wg * 64;
                const epilogue::WarpgroupRows rows{tile.row_begin + row, tile.num_rows > row ? tile.num_rows - row : 0,
                                                   tile.n_begin};
                if constexpr (not kEpilogueBesideNextTile)
                    zero_accum(acc);
                consume_k_blocks_fp8<BLOCK_N, 128, kNumStages, kNumProductSets, Turns, kEpilogueBesideNextTile>(
                    smem, pipe, num_k_blocks, row * kSwizzleBytes, acc,
                    [&](uint32_t stage, uint32_t, uint32_t cols) {
                        const float b = smem.scales(stage)[kBScaleSlot + cols];
                        const float* a = smem.scales(stage) + Producer::scale_offset(tile.row_begin) + scale_row;
                        return RowScales{{a[0] * b, a[8] * b}};
                    },
                    [](uint32_t) {
                        if constexpr (Producer::kNumCopyThreads > 0)  // cp.async wrote A through the generic proxy
                            ptx::fence_view_async_shared();
                    },
                    [&] {
                        timeline::Span walk;
                        if constexpr (kTilesFromProducer)
                            more = upcoming.read(tile_slot(smem.scales(pipe.stage)));  // (the tile's first stage)
                        else
                            more = scheduler.next(upcoming);
                        walk.end(timeline::kScheduler);
                        if constexpr (kEpilogueBesideNextTile) {
                            if (pending) {
                                Epilogue::store(acc, p, done, staging, 1 + wg);
                                timeline::mark(timeline::kEpilogueEnd, tile.group);
                            }
                        }
                    }, turns, stage_wait);
                timeline::mark(timeline::kMainloopEnd, tile.group);
                if constexpr (kEpilogueBesideNextTile) {
                    done = rows, pending = true;
                } else {
                    Epilogue::store(acc, p, rows, staging, 1 + wg);
                    timeline::mark(timeline::kEpilogueEnd, tile.group);
                }
                tile = upcoming;
            }
            if constexpr (kEpilogueBesideNextTile) {
                if (pending)
                    Epilogue::store(acc, p, done, staging, 1 + wg);
            }
            turns.finish();
            timeline::record_waits();
            Epilogue::drain();
        }
    }
};

}  // namespace deep_gemm
