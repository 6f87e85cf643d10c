#pragma once
// The warp-specialised GEMM pipeline shared by every Hopper kernel here: shared-memory
// stages filled by one TMA thread and drained by WGMMA warpgroups, handshaking on mbarriers.
#include <cstdint>
#include "../ptx/barrier.cuh"
#include "../ptx/tma.cuh"
#include "../ptx/trace.cuh"
#include "../ptx/utils.cuh"
#include "wgmma.cuh"

namespace deep_gemm::mma {

constexpr uint32_t BLOCK_K = 64;  // one 128-byte swizzle row of bf16
constexpr uint32_t kNumMathThreads = 256;  // two math warpgroups, 64 rows of the tile each
constexpr uint32_t kNumProducerThreads = 128;  // one producer warpgroup
constexpr uint32_t kNumThreads = kNumMathThreads + kNumProducerThreads;
constexpr uint32_t kProducerRegs = 40, kMathRegs = 232;  // 40*128 + 232*256 <= 64K registers

struct PipelineState {
    uint32_t stage = 0, phase = 0;

    template <uint32_t kNumStages>
    __device__ __forceinline__ void advance() {
        if (++stage == kNumStages)
            stage = 0, phase ^= 1;
    }
};

// Dynamic shared memory: A stages, B stages, `kScaleBytes` a stage for its scales (FP8 only; the
// weight gradient's with their TF32 tiles),
// `kExtraBytes` for the epilogue, then barriers.
template <uint32_t BLOCK_M, uint32_t BLOCK_N, uint32_t kNumStages, uint32_t kExtraBytes, uint32_t kScaleBytes = 0>
struct GemmSmem {
    static constexpr uint32_t kBytesA = BLOCK_M * kSwizzleBytes;  // 128-byte rows: 64 bf16 or 128 fp8 of K
    static constexpr uint32_t kBytesB = BLOCK_N * kSwizzleBytes;
    static constexpr uint32_t kBytesPerStage = kBytesA + kBytesB + kScaleBytes;
    static constexpr uint32_t kOffsetScales = kNumStages * (kBytesA + kBytesB);
    // (the epilogue's swizzled staging needs 1024-byte alignment)
    static constexpr uint32_t kOffsetExtra = ptx::ceil_div(kOffsetScales + kNumStages * kScaleBytes, 1024u) * 1024;
    static constexpr uint32_t kOffsetBarriers = kOffsetExtra + kExtraBytes;
    static constexpr uint32_t kTotalBytes = kOffsetBarriers + 2 * kNumStages * sizeof(ptx::MBarrier);
    static_assert(kBytesA % 1024 == 0 and kBytesB % 1024 == 0, "swizzle atoms need 1024-byte alignment");
    static_assert(kScaleBytes % 128 == 0 and kExtraBytes % 16 == 0 and kOffsetExtra % 1024 == 0);

    uint8_t* base;

    __device__ __forceinline__ uint8_t* a(uint32_t stage) const { return base + stage * kBytesA; }
    __device__ __forceinline__ uint8_t* b(uint32_t stage) const { return base + kNumStages * kBytesA + stage * kBytesB; }
    __device__ __forceinline__ float* scales(uint32_t stage) const {
        return reinterpret_cast<float*>(base + kOffsetScales + stage * kScaleBytes);
    }
    __device__ __forceinline__ uint8_t* extra() const { return base + kOffsetExtra; }
    __device__ __forceinline__ ptx::MBarrier* full(uint32_t stage) const {
        return reinterpret_cast<ptx::MBarrier*>(base + kOffsetBarriers) + stage;
    }
    __device__ __forceinline__ ptx::MBarrier* empty(uint32_t stage) const { return full(kNumStages + stage); }

    // Thread 0 only: full barriers complete on the TMA bytes and the producer's arrival (plus
    // one cp.async arrival per copying thread), empty ones on `releases_per_cta` arrivals (both
    // math warpgroups, or their eight warps) of each of the `num_ctas` CTAs whose loads fill this
    // CTA's stages (a cluster sharing B).
    __device__ __forceinline__ void init_barriers(uint32_t num_copy_threads, uint32_t num_ctas,
                                                  uint32_t releases_per_cta = kNumMathThreads / 128) const {
        #pragma unroll
        for (uint32_t s = 0; s < kNumStages; ++s) {
            full(s)->init(1 + num_copy_threads);
            empty(s)->init(releases_per_cta * num_ctas);
        }
        ptx::fence_barrier_init();
    }
};

// Every GEMM kernel's start: the producer thread prefetches the tensor maps, thread 0
// initialises the barriers (empty ones counting `kReleasesPerCta` arrivals a CTA), and the CTA (the cluster, with kClusterSize > 1) syncs before any
// role touches them. Each full barrier counts `kNumCopyThreads` arrivals more: producer threads
// that also fill stages with cp.async (see produce_k_blocks), or the FP8 weight gradient's
// converter warps (one arrival each a stage).
template <uint32_t kNumCopyThreads, uint32_t kClusterSize = 1, uint32_t kReleasesPerCta = kNumMathThreads / 128,
          typename Smem>
__device__ __forceinline__ void start_gemm(const Smem& smem, const CUtensorMap* tensor_map_a,
                                           const CUtensorMap* tensor_map_b) {
    static_assert(kNumCopyThreads <= kNumProducerThreads);
    if (threadIdx.x == kNumMathThreads) {
        ptx::prefetch_tma_descriptor(tensor_map_a);
        ptx::prefetch_tma_descriptor(tensor_map_b);
    }
    if (threadIdx.x == 0)
        smem.init_barriers(kNumCopyThreads, kClusterSize, kReleasesPerCta);
    if constexpr (kClusterSize > 1)
        ptx::cluster_sync();
    else
        __syncthreads();
    DG_TRACE(4, 1);
    timeline::start();
}

// Every thread's last step with kClusterSize > 1: no CTA leaves while another may still load
// into its shared memory or arrive on its barriers.
template <uint32_t kClusterSize>
__device__ __forceinline__ void finish_gemm() {
    if constexpr (kClusterSize > 1)
        ptx::cluster_sync();
}

// The first `kNumK16` k16 slices of a stage's MMAs into `acc`.
template <uint32_t BLOCK_N, uint32_t kNumK16, Major kMajorA, Major kMajorB>
__device__ __forceinline__ void issue_mmas(const uint8_t* a_tile, const uint8_t* b_tile, float (&acc)[BLOCK_N / 2]) {
    #pragma unroll
    for (uint32_t k = 0; k < kNumK16; ++k) {
        WGMMA<BLOCK_N>::template mma<kMajorA == Major::kMNMajor, kMajorB == Major::kMNMajor>(
            make_operand_desc<kMajorA>(a_tile, k), make_operand_desc<kMajorB>(b_tile, k), acc, true);
    }
}

// One math warpgroup's mainloop over `num_k_blocks` stages into `acc` (64 x BLOCK_N).
// `a_offset` selects the warpgroup's 64 rows inside the A tile. `before_mma(stage, k_block)`
// runs after the stage has landed and before any MMA reads it. The last block issues only its
// first `num_k16_last` k16 slices (1-4: the rest lie past a ragged group's end); it runs
// outside the loop, so that the loop's blocks stay one straight chain of MMAs. The MMAs of
// block k stay in flight while block k+1 is issued; a stage is released once the MMAs reading
// it are done. With kClusterSize > 1 the stage is released in every CTA of the cluster (their
// producers multicast into this CTA's stages).
template <uint32_t BLOCK_N, uint32_t kNumStages, Major kMajorA, Major kMajorB, uint32_t kClusterSize = 1,
          typename Smem, typename BeforeMMA>
__device__ __forceinline__ void consume_k_blocks(const Smem& smem, PipelineState& pipe, uint32_t num_k_blocks,
                                                 uint32_t a_offset, float (&acc)[BLOCK_N / 2],
                                                 const BeforeMMA& before_mma, uint32_t num_k16_last = BLOCK_K / 16) {
    const auto release = [&](uint32_t stage) {
        if constexpr (kClusterSize == 1) {
            smem.empty(stage)->arrive();
        } else {
            #pragma unroll
            for (uint32_t cta = 0; cta < kClusterSize; ++cta)
                smem.empty(stage)->arrive_in_cta(cta);
        }
    };
    // One thread per warpgroup releases stages. (No warp shuffle here: a shuffle reached by
    // one lane only, e.g. behind a short-circuit, deadlocks the warp.)
    const bool releases = threadIdx.x % 128 == 0;
#ifdef DG_DEBUG_TRACE
    const uint32_t kTraceSlot = threadIdx.x % 128 == 0 ? 1 + threadIdx.x / 128 : 15;  // 15: scratch
#endif
    uint32_t prev_stage = 0;
    const auto consume = [&](uint32_t k_block, const auto& issue) {
        DG_TRACE(kTraceSlot, 1000 + k_block);
        smem.full(pipe.stage)->wait(pipe.phase);
        DG_TRACE(kTraceSlot, 2000 + k_block);
        before_mma(pipe.stage, k_block);

        warpgroup_fence_operand(acc);
        warpgroup_arrive();
        issue(smem.a(pipe.stage) + a_offset, smem.b(pipe.stage));
        warpgroup_commit_batch();
        warpgroup_fence_operand(acc);

        warpgroup_wait<1>();
        DG_TRACE(kTraceSlot, 3000 + k_block);
        if (k_block > 0 and releases)
            release(prev_stage);
        prev_stage = pipe.stage;
        pipe.template advance<kNumStages>();
    };
    for (uint32_t k_block = 0; k_block + 1 < num_k_blocks; ++k_block) {
        consume(k_block, [&](const uint8_t* a, const uint8_t* b) {
            issue_mmas<BLOCK_N, BLOCK_K / 16, kMajorA, kMajorB>(a, b, acc);
        });
    }
    if (num_k_blocks > 0) {
        consume(num_k_blocks - 1, [&](const uint8_t* a, const uint8_t* b) {
            switch (num_k16_last) {
                case 1: issue_mmas<BLOCK_N, 1, kMajorA, kMajorB>(a, b, acc); break;
                case 2: issue_mmas<BLOCK_N, 2, kMajorA, kMajorB>(a, b, acc); break;
                case 3: issue_mmas<BLOCK_N, 3, kMajorA, kMajorB>(a, b, acc); break;
                default: issue_mmas<BLOCK_N, BLOCK_K / 16, kMajorA, kMajorB>(a, b, acc); break;
            }
        });
    }
    warpgroup_wait<0>();
    if (num_k_blocks > 0 and releases)
        release(prev_stage);
}

// The producer's loop: waits for a free stage, then `issue_loads(stage, k_block, bar)`
// starts the copies that fill it and complete on `bar`; the `leader` announces the
// `kTxBytes` the TMA engine will deliver. Run by the leader alone (TMA only), or by every
// thread that copies with cp.async as well: each ends its part of `issue_loads` with
// ptx::cp_async_arrive_noinc(bar). The leader first runs `publish(stage, k_block)`: what it
// writes into the stage with plain stores, its arrival releases to the consumers (NoPublish:
// nothing).
template <uint32_t kNumStages, uint32_t kTxBytes, typename Smem, typename Publish, typename IssueLoads>
__device__ __forceinline__ void produce_k_blocks(const Smem& smem, PipelineState& pipe, uint32_t num_k_blocks,
                                                 bool leader, const Publish& publish, const IssueLoads& issue_loads) {
    for (uint32_t k_block = 0; k_block < num_k_blocks; ++k_block) {
        DG_TRACE(0, 1000 + k_block);
        smem.empty(pipe.stage)->wait(pipe.phase ^ 1);
        timeline::mark(timeline::kLoadsIssued, k_block);
        ptx::MBarrier* bar = smem.full(pipe.stage);
        if (leader) {
            publish(pipe.stage, k_block);
            bar->arrive_and_expect_tx(kTxBytes);
        }
        issue_loads(pipe.stage, k_block, bar);
        DG_TRACE(0, 2000 + k_block);
        pipe.template advance<kNumStages>();
    }
}

struct NoPublish {
    __device__ __forceinline__ void operator()(uint32_t, uint32_t) const {}
};

// The producer's walk over its scheduler's tiles, one tile ahead: for each tile (in `tile`),
// `produce(publish)`, whose publish(stage, k_block) leaves the next tile and whether there is one
// (Scheduler::Tile::publish) at `slot(stage)` of the tile's first stage, where the math warpgroups
// read it instead of walking to it (docs/PERF.md, "Decisions": tiles from the producer).
template <typename Scheduler, typename Slot, typename Produce>
__device__ __forceinline__ void produce_tiles_publishing_next(Scheduler& scheduler, typename Scheduler::Tile& tile,
                                                              const Slot& slot, const Produce& produce) {
    typename Scheduler::Tile upcoming;
    for (bool more = scheduler.next(tile); more; tile = upcoming) {
        more = scheduler.next(upcoming);
        produce([&](uint32_t stage, uint32_t k_block) {
            if (k_block == 0)
                upcoming.publish(slot(stage), more);
        });
    }
}

template <uint32_t kNum>
__device__ __forceinline__ void zero_accum(float (&acc)[kNum]) {
    #pragma unroll
    for (uint32_t i = 0; i < kNum; ++i)
        acc[i] = 0.0f;
}

}  // namespace deep_gemm::mma
