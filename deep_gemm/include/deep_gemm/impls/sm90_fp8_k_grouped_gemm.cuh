#pragma once
// K-grouped blockwise-FP8 GEMM on Hopper (weight gradients): D[g] = A_g @ B_g.T, contracting over
// group g's rows (tokens), from the transposed, column-quantized copies of deep_gemm.quant's
// Fp8Columns (docs/DESIGN.md, "Blockwise FP8"): A [M, Mp] and B [N, Mp] e4m3, K-major, each
// group's tokens padded with zeros to a multiple of 128 (group_offsets: the padded offsets), one
// scale per 128 tokens x 1 column of each. D [G, M, N] fp32 or bf16, written or added to as the
// k-grouped Epilogue policy says (epilogue/k_grouped.cuh). Scheduler and epilogue are the bf16
// kernel's; the mainloop promotes every 128-token block with its row and column scales, whose
// products the tensor cores make (mma/pipeline_fp8.cuh, tc_scales). Every operand, scales
// included, comes by TMA: A and B from one producer thread into the stages, the scales from another
// into a ring of their own ahead of them; two more producer warps turn each k-block's scales into
// the products' TF32 tiles in its stage.
#include <cuda.h>
#include <cuda_bf16.h>
#include "../epilogue/k_grouped.cuh"
#include "../mma/pipeline_fp8.cuh"
#include "../ptx/tma.cuh"
#include "../scheduler/grouped.cuh"

namespace deep_gemm {

struct alignas(128) KGroupedFp8GemmParams {
    CUtensorMap tensor_map_a;         // A [M, rows] e4m3; box {128 (tokens), 128 (M)}
    CUtensorMap tensor_map_b;         // B [N, rows] e4m3; box {128, BLOCK_N}
    CUtensorMap tensor_map_d;         // D [G, M, N]; box {128 bytes of N, 64 (M), 1} (epilogue::TensorStores)
    CUtensorMap tensor_map_scales_a;  // A's scales [rows / 128][M] fp32; box {128, 1}
    CUtensorMap tensor_map_scales_b;  // B's scales [rows / 128][N] fp32; box {BLOCK_N, 1}
    void* d;                          // [G, M, N]
    const int* group_offsets;         // [G + 1], multiples of 128 (the padded offsets)
    uint32_t m, n, rows, num_groups;
};

template <uint32_t BLOCK_N, uint32_t kNumStages, typename Epilogue>
struct Sm90FP8KGroupedGemm {
    static constexpr uint32_t BLOCK_M = 128;
    static_assert(BLOCK_M == mma::tc_scales::kRows and BLOCK_N == mma::tc_scales::kRows);
    // A stage's TF32 tiles of its scales; after the two warpgroups' staging, the zero tile and the
    // scales' ring (mma::tc_scales)
    // (and, past them, the next tile's slot: the A and B producer walks one tile ahead and leaves
    // the next tile (Scheduler::Tile::publish) in each tile's first stage, where the math
    // warpgroups read it beside the tile's first MMAs instead of walking to it (the group offsets'
    // loads; docs/PERF.md, "Decisions": tiles from the producer). An empty group's tile has no
    // stage: after it the math warpgroups walk again.)
    static constexpr uint32_t kTileSlotBytes = 128;
    static constexpr uint32_t kScaleBytes = mma::tc_scales::kStageBytes + kTileSlotBytes;
    static constexpr uint32_t kRawScaleBytes = mma::tc_scales::kRawBytes;
    static constexpr uint32_t kExtraBytes = 2 * Epilogue::kStagingBytes + mma::tc_scales::kExtraBytes;
    static_assert((2 * Epilogue::kStagingBytes + mma::tc_scales::kOffsetRaw) % 128 == 0,
                  "the scales' ring slots are TMA destinations");
    using Smem = mma::GemmSmem<BLOCK_M, BLOCK_N, kNumStages, kExtraBytes, kScaleBytes>;
    static constexpr uint32_t kNumThreads = mma::kNumThreads;
    static constexpr uint32_t kSmemBytes = Smem::kTotalBytes;
    // One 128-column product a k-block, one set of them (docs/PERF.md, "Decisions": FP8 weight
    // gradient): its scale products are one TF32 MMA's.
    static constexpr uint32_t kProductN = 128;
    static_assert(BLOCK_N == kProductN, "one product a k-block: one TF32 MMA of its scales");
    static constexpr uint32_t kNumProductSets = 1;
    // A bf16 tile is stored beside the next tile's first products (docs/PERF.md, "Decisions":
    // epilogue beside the next tile); an fp32 one before them, whose staging needs the registers
    // that the first products' scales then hold.
    static constexpr bool kStoreBeside = Epilogue::kOutBytes == 2;

    __device__ __forceinline__ static void run(const KGroupedFp8GemmParams& p) {
        using namespace mma;
        using Scheduler = scheduler::KGroupedScheduler<BLOCK_M, BLOCK_N>;
        extern __shared__ __align__(1024) uint8_t smem_buffer[];
        const Smem smem{smem_buffer};
        // (the zero tile and the ring: functions, so that no address stays live across roles)
        const auto zeros = [&] { return smem.extra() + 2 * Epilogue::kStagingBytes; };
        const auto raw = [&](uint32_t slot) { return zeros() + tc_scales::kOffsetRaw + slot * kRawScaleBytes; };
        const auto raw_full = [&](uint32_t slot) {  // a slot's scales landed (the scale producer's arrival)
            return reinterpret_cast<ptx::MBarrier*>(zeros() + tc_scales::kOffsetRawBarriers) + slot;
        };
        const auto raw_empty = [&](uint32_t slot) {  // a slot's scales read (both converters' arrivals)
            return raw_full(tc_scales::kRawSlots + slot);
        };
        const auto stage_tiles = [&](uint32_t stage) { return reinterpret_cast<uint8_t*>(smem.scales(stage)); };
        const auto tile_slot = [&](uint32_t stage) { return stage_tiles(stage) + tc_scales::kStageBytes; };
        if (threadIdx.x == 0) {
            for (uint32_t s = 0; s < tc_scales::kRawSlots; ++s)
                raw_full(s)->init(1), raw_empty(s)->init(2);  // (fenced with the others in start_gemm)
        }
        // (full barriers: two arrivals more, the converter warps')
        start_gemm<2, 1, kFp8ReleasesPerCta>(smem, &p.tensor_map_a, &p.tensor_map_b);
        if (threadIdx.x == 0)
            Epilogue::prefetch(p);

        Scheduler scheduler(p.group_offsets, p.num_groups, p.m, p.n, p.rows);
        typename Scheduler::Tile tile;
        PipelineState pipe;

        if (threadIdx.x >= kNumMathThreads) {
            ptx::warpgroup_reg_dealloc<kProducerRegs>();
            // Warp 0: A and B; warps 1 and 2: the converters (A's tiles, B's); warp 3: the scales.
            // Each walks every k-block in the same order.
            const uint32_t role = threadIdx.x / 32 - kNumMathThreads / 32;
            PipelineState ring;  // the scales' ring slot
            if (role == 1 or role == 2) {
                const uint32_t converter = role - 1;
                if (converter == 0) {
                    for (uint32_t i = 0; i < tc_scales::kZeroBytes / 16; i += 32)  // (fenced in convert)
                        ptx::st_shared_v4(zeros() + (i + ptx::lane_idx()) * 16, make_uint4(0, 0, 0, 0));
                }
                while (scheduler.next(tile)) {
                    for (uint32_t k = tile.k_begin; k < tile.k_end; k += BLOCK_K_FP8) {
                        raw_full(ring.stage)->wait(ring.phase);
                        smem.empty(pipe.stage)->wait(pipe.phase ^ 1);  // the stage's last tiles read
                        tc_scales::convert(raw(ring.stage), stage_tiles(pipe.stage), converter);
                        if (ptx::lane_idx() == 0)
                            smem.full(pipe.stage)->arrive(), raw_empty(ring.stage)->arrive();
                        pipe.template advance<kNumStages>();
                        ring.template advance<tc_scales::kRawSlots>();
                    }
                }
                return;
            }
            if (role == 3) {
                if (ptx::lane_idx() != 0)
                    return;
                ptx::prefetch_tma_descriptor(&p.tensor_map_scales_a);
                ptx::prefetch_tma_descriptor(&p.tensor_map_scales_b);
                while (scheduler.next(tile)) {
                    for (uint32_t k = tile.k_begin; k < tile.k_end; k += BLOCK_K_FP8) {
                        raw_empty(ring.stage)->wait(ring.phase ^ 1);
                        ptx::MBarrier* bar = raw_full(ring.stage);
                        bar->arrive_and_expect_tx(kRawScaleBytes);
                        float* slot = reinterpret_cast<float*>(raw(ring.stage));
                        ptx::tma_load_2d(slot, &p.tensor_map_scales_a, bar, tile.m_begin, k / BLOCK_K_FP8);
                        ptx::tma_load_2d(slot + BLOCK_M, &p.tensor_map_scales_b, bar, tile.n_begin, k / BLOCK_K_FP8);
                        ring.template advance<tc_scales::kRawSlots>();
                    }
                }
                return;
            }
            if (threadIdx.x != kNumMathThreads)
                return;
            produce_tiles_publishing_next(scheduler, tile, tile_slot, [&](const auto& publish) {
                if ((tile.k_begin | tile.k_end) % BLOCK_K_FP8 != 0)
                    __trap();  // not the padded offsets: a scale block would hold two groups
                const uint32_t num_k_blocks = (tile.k_end - tile.k_begin) / BLOCK_K_FP8;
                produce_k_blocks<kNumStages, Smem::kBytesA + Smem::kBytesB>(smem, pipe, num_k_blocks, true, publish, [&](uint32_t stage, uint32_t k_block, ptx::MBarrier* bar) {
                    const uint32_t k = tile.k_begin + k_block * BLOCK_K_FP8;
                    ptx::tma_load_2d(smem.a(stage), &p.tensor_map_a, bar, k, tile.m_begin);
                    ptx::tma_load_2d(smem.b(stage), &p.tensor_map_b, bar, k, tile.n_begin);
                });
            });
        } else {
            ptx::warpgroup_reg_alloc<kMathRegs>();
            const uint32_t wg = ptx::warpgroup_idx();
            uint8_t* staging = smem.extra() + wg * Epilogue::kStagingBytes;
            float acc[BLOCK_N / 2];
            tc_scales::Products scales;  // the k-block's, issued before its FP8 MMAs
            ProbeAtRelease stage_wait;   // (across tiles: a tile's last probe is of the next one's first stage)
            // The next tile is found while this tile's first MMAs run, and the previous tile's
            // epilogue runs beside them too (kStoreBeside) or just before: the first k-block's
            // promotion then overwrites acc (docs/PERF.md, "Decisions": epilogue beside the next
            // tile). (Found after the epilogue instead, ptxas gives this code none of setmaxnreg's
            // extra registers: it spills.)
            typename Scheduler::Tile upcoming;
            bool more = scheduler.next(tile), pending = false;
            uint32_t done_group = 0, done_m = 0, done_n = 0;  // the tile whose store is pending
            const auto store = [&](uint32_t group, uint32_t m_begin, uint32_t n_begin) {
                Epilogue::store(acc, p, group, m_begin + wg * 64, n_begin, staging, 2 + wg);
                timeline::mark(timeline::kEpilogueEnd, group);
            };
            const auto defer_store = [&](const typename Scheduler::Tile& t) {  // acc holds t's sums
                done_group = t.group, done_m = t.m_begin, done_n = t.n_begin, pending = true;
            };
            for (;;) {
                const uint32_t num_k_blocks = more ? (tile.k_end - tile.k_begin) / BLOCK_K_FP8 : 0;
                if (not more or (num_k_blocks == 0 and not Epilogue::kAccumulates)) {
                    if (pending)
                        store(done_group, done_m, done_n);
                    if (not more)
                        break;
                    zero_accum(acc);  // an empty group: zeros, stored beside the next tile's product
                    defer_store(tile);
                    more = scheduler.next(tile);
                    continue;
                }
                if (num_k_blocks == 0) {  // an empty group adds nothing
                    more = scheduler.next(tile);
                    continue;
                }
                if (not kStoreBeside and pending)
                    store(done_group, done_m, done_n), pending = false;
                consume_k_blocks_fp8<BLOCK_N, kProductN, kNumStages, kNumProductSets, NoTurns, true>(
                    smem, pipe, num_k_blocks, wg * 64 * kSwizzleBytes, acc,
                    tc_scales::Every{scales},
                    [&](uint32_t stage) {
                        scales.issue(stage_tiles(stage), zeros());
                    },
                    [&] {
                        timeline::Span walk;
                        more = upcoming.read(tile_slot(pipe.stage));  // (the tile's first stage)
                        scheduler.skip();
                        walk.end(timeline::kScheduler);
                        if (kStoreBeside and pending)
                            store(done_group, done_m, done_n);
                    },
                    NoTurns(0), stage_wait);
                timeline::mark(timeline::kMainloopEnd, tile.group);
                defer_store(tile);
                tile = upcoming;
            }
            timeline::record_waits();
            Epilogue::drain();
        }
    }
};

}  // namespace deep_gemm
