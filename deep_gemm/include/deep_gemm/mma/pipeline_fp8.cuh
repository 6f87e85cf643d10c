#pragma once
// The FP8 GEMMs' mainloop (blockwise scales, docs/DESIGN.md "Blockwise FP8"): each stage holds one
// 128-deep k-block, whose four k32 MMAs go into fresh registers that are then added to the fp32
// sum times the block's scales. Hopper's FP8 MMAs add their products with reduced precision;
// promoting every 128 of K keeps the sum fp32. The producer side is pipeline.cuh's.
#include <cstdint>
#include <type_traits>
#include <utility>
#include "pipeline.cuh"
#include "wgmma.cuh"
#include "wgmma_fp8.cuh"
#include "wgmma_tf32.cuh"

namespace deep_gemm::mma {

constexpr uint32_t BLOCK_K_FP8 = 128;  // one 128-byte swizzle row of e4m3
// Every math thread releases a stage itself, after its own reads of the stage's scales: measured as
// fast as one lane a warp behind a __syncwarp (docs/PERF.md, "Decisions": stage releases), which
// compute-sanitizer's racecheck cannot follow.
constexpr uint32_t kFp8ReleasesPerCta = kNumMathThreads;

// A thread's share of a k-block's scales, which `promote` applies: acc += part * scale (acc =
// part * scale with kFresh, the tile's first k-block where nothing zeroed acc). The
// accumulator layout is mma/wgmma_fp8.cuh's: accumulator i is in row lane / 4 + 8 * ((i / 2) % 2)
// of its warp's 16 and column (i / 4) * 8 + (lane % 4) * 2 + i % 2.

// A math thread's first accumulator row inside the 128-row tile (the second is 8 below): its
// warpgroup's 64 rows, its warp's 16 of them, lane / 4.
__device__ __forceinline__ uint32_t accumulator_row() {
    return threadIdx.x / 128 * 64 + (threadIdx.x % 128 / 32) * 16 + ptx::lane_idx() / 4;
}

// One scale per row (A's per row, times the tile's one B scale): the forward and data gradient.
struct RowScales {
    float row[2];

    template <bool kFresh = false, uint32_t kNum>
    __device__ __forceinline__ void promote(const float (&part)[kNum], float (&acc)[kNum]) const {
        #pragma unroll
        for (uint32_t i = 0; i < kNum; ++i)
            acc[i] = kFresh ? part[i] * row[(i / 2) % 2] : fmaf(part[i], row[(i / 2) % 2], acc[i]);
    }
};

// The weight gradient's k-block scales (both operands per 128 x 1), their products row scale x
// column scale made by the tensor cores: one m64n128k8 TF32 MMA a warpgroup a k-block, issued
// ahead of the k-block's FP8 MMAs, so that the promotion is one FFMA an accumulator with no
// scale loads or multiplies in the math warps (docs/PERF.md, "Decisions": FP8 weight gradient).
// Each fp32 scale x is split into TF32 parts hi = rna(x) and lo = rna(x - hi); the MMA sums
// hi_r hi_c + hi_r lo_c + lo_r hi_c over k = 0..2 (A's row r: (hi, hi, lo, 0); B's column c:
// (hi, lo, hi, 0)), within ~2^-21 of the fp32 product. A (128 x 8, both warpgroups' rows) and B
// (128 x 8) are K-major tiles without swizzle in the stage: row i's k = 0..3 are the 16 bytes at
// i * 16, its k = 4..7 come from one zero tile. The scales come by TMA into a ring of their own,
// kRawSlots k-blocks deep, ahead of the stages; two converter warps (A's tile, B's) write a
// stage's tiles as soon as the stage's previous MMAs are done, while its operands' loads are in
// flight, and arrive on its full barrier, which thus completes with the operands' bytes and three
// arrivals.
namespace tc_scales {

constexpr uint32_t kRows = 128;  // the tile's rows, and its columns
constexpr uint32_t kOffsetA = 0, kOffsetB = kRows * 16;
constexpr uint32_t kStageBytes = kOffsetB + kRows * 16;  // a stage's tiles
// Outside the stages: the zero tile, the scales' ring (a slot: a k-block's 128 row scales, then
// its 128 column scales), then its full and empty barriers.
constexpr uint32_t kRawSlots = 8, kRawBytes = 2 * kRows * sizeof(float);
constexpr uint32_t kZeroBytes = kRows * 16, kOffsetRaw = kZeroBytes;
constexpr uint32_t kOffsetRawBarriers = kOffsetRaw + kRawSlots * kRawBytes;
constexpr uint32_t kExtraBytes = kOffsetRawBarriers + 2 * kRawSlots * sizeof(uint64_t);

__device__ __forceinline__ void split(float x, uint32_t& hi, uint32_t& lo) {
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(hi) : "f"(x));
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(lo) : "f"(x - __uint_as_float(hi)));
}

// A converter warp's work on one k-block, from its ring slot `raw` into its stage's `tiles`
// (kStageBytes): the A tile (`part` 0: the row scales) or the B tile (1: the column scales), then
// a fence that shows it to the tensor cores (the async proxy) before the caller's arrival. Every
// load is issued before the first store (the stores' "memory" clobbers would otherwise wait for
// each load in turn): the tiles' latency adds to the stage's (docs/PERF.md, "Decisions": FP8
// weight gradient).
__device__ __forceinline__ void convert(const uint8_t* raw_slot, uint8_t* tiles, uint32_t part) {
    constexpr uint32_t kPerLane = kRows / 32;
    const uint32_t lane = ptx::lane_idx();
    const float* raw = reinterpret_cast<const float*>(raw_slot) + part * kRows;
    uint8_t* tile = tiles + (part == 0 ? kOffsetA : kOffsetB);
    float x[kPerLane];
    #pragma unroll
    for (uint32_t i = 0; i < kPerLane; ++i)  // (lanes on consecutive rows: no bank conflicts)
        x[i] = ptx::ld_shared_f32(raw + lane + 32 * i);
    #pragma unroll
    for (uint32_t i = 0; i < kPerLane; ++i) {
        uint32_t hi, lo;
        split(x[i], hi, lo);
        ptx::st_shared_v4(tile + (lane + 32 * i) * 16, part == 0 ? make_uint4(hi, hi, lo, 0) : make_uint4(hi, lo, hi, 0));
    }
    ptx::fence_view_async_shared();
    __syncwarp();
}

// A math warpgroup's side: the products of each k-block, issued by `issue`.
struct Products {
    float s[64];  // accumulator layout

    // Once the stage has landed, before the k-block's FP8 MMAs: its products' MMA (its own batch).
    // `tiles`: the stage's kStageBytes; `zeros`: the zero tile.
    __device__ __forceinline__ void issue(const uint8_t* tiles, const uint8_t* zeros) {
        const uint32_t a = ptx::smem_addr(tiles + kOffsetA + ptx::warpgroup_idx() * 64 * 16);
        const uint32_t b = ptx::smem_addr(tiles + kOffsetB), z = ptx::smem_addr(zeros);
        // (k = 4..7: the zero tile, the leading offset on; 8-row core matrices 128 bytes apart)
        const uint64_t desc_a = warp_uniform_desc(make_unswizzled_desc(a, z - a, 128));
        const uint64_t desc_b = warp_uniform_desc(make_unswizzled_desc(b, z - b, 128));
        warpgroup_arrive();
        WGMMATf32<128>::mma(desc_a, desc_b, s);
        warpgroup_commit_batch();
        warpgroup_fence_operand(s);
    }

    // After the wait for both batches: acc += part * s (acc = part * s with kFresh).
    template <bool kFresh = false>
    __device__ __forceinline__ void promote(const float (&part)[64], float (&acc)[64]) {
        warpgroup_fence_operand(s);
        #pragma unroll
        for (uint32_t i = 0; i < 64; ++i)
            acc[i] = kFresh ? part[i] * s[i] : fmaf(part[i], s[i], acc[i]);
    }
};

// consume_k_blocks_fp8's `scales` for them: the one Products, whatever the k-block (a functor, not
// a lambda, which the compiler's front end warns of as returning a reference to a local).
struct Every {
    Products& products;
    __device__ __forceinline__ Products& operator()(uint32_t, uint32_t, uint32_t) const { return products; }
};

}  // namespace tc_scales

// f(std::integral_constant<uint32_t, c>) for each c of the sequence, in order.
template <uint32_t... kCols, typename F>
__device__ __forceinline__ void for_each_product(std::integer_sequence<uint32_t, kCols...>, const F& f) {
    (f(std::integral_constant<uint32_t, kCols>{}), ...);
}

// Turns policies of consume_k_blocks_fp8 (`turns`): when each math warpgroup issues its MMAs.
//
// IssueTurns: the two warpgroups' MMA batches in strict turns (warpgroup 0, 1, 0, 1, ...), each
// waiting for the other's previous batch to be issued, so that the tensor cores run one
// warpgroup's batch while the other waits for and promotes its last one; without turns both
// issue at once, their batches complete together, and both promote while the tensor cores idle.
// Where it pays: docs/PERF.md, "Decisions": MMA turns. Named barriers kTurnBarrier (warpgroup 0
// issued) and kTurnBarrier + 1 (warpgroup 1 issued), every arrival matched: warpgroup 1 arrives
// once at the start (`prime`), warpgroup 0 takes that last arrival in `finish`.
struct IssueTurns {
    static constexpr uint32_t kTurnBarrier = 8;
    uint32_t wg;

    __device__ __forceinline__ explicit IssueTurns(uint32_t wg) : wg(wg) {}
    __device__ __forceinline__ void prime() const {
        if (wg == 1)
            ptx::named_barrier_arrive(kTurnBarrier + 1, kNumMathThreads);
    }
    __device__ __forceinline__ void before_issue() const {
        ptx::named_barrier_sync(kTurnBarrier + (wg ^ 1), kNumMathThreads);
    }
    __device__ __forceinline__ void after_issue() const {
        ptx::named_barrier_arrive(kTurnBarrier + wg, kNumMathThreads);
    }
    __device__ __forceinline__ void finish() const {
        if (wg == 0)
            ptx::named_barrier_sync(kTurnBarrier + 1, kNumMathThreads);
    }
};

// Without turns: each warpgroup issues as soon as its stage has landed.
struct NoTurns {
    __device__ __forceinline__ explicit NoTurns(uint32_t) {}
    __device__ __forceinline__ void prime() const {}
    __device__ __forceinline__ void before_issue() const {}
    __device__ __forceinline__ void after_issue() const {}
    __device__ __forceinline__ void finish() const {}
};

// How a warpgroup learns that the next stage has landed. WaitAtIssue: it waits on the stage's
// full barrier just before the stage's first MMAs. ProbeAtRelease: it probes the barrier once it
// has released the previous stage, so that the probe's latency passes beside the promotion's FFMAs,
// and waits at the issue only if the stage had not landed then (docs/PERF.md, "Decisions": where
// the weight gradient waits for a stage). The caller keeps it across tiles, as it keeps its
// PipelineState: a tile's last probe is of the next tile's first stage.
struct WaitAtIssue {
    __device__ __forceinline__ void probe(ptx::MBarrier*, uint32_t) {}
    __device__ __forceinline__ void wait(ptx::MBarrier* full, uint32_t phase) { full->wait(phase); }
};

struct ProbeAtRelease {
    bool landed = false;

    __device__ __forceinline__ void probe(ptx::MBarrier* full, uint32_t phase) { landed = full->try_wait(phase); }
    __device__ __forceinline__ void wait(ptx::MBarrier* full, uint32_t phase) {
        if (not landed)
            full->wait(phase);
        landed = false;
    }
};

// One math warpgroup's FP8 mainloop over 64 x BLOCK_N, in products of kProductN columns (m64nNk32
// MMAs; e.g. BLOCK_N = 256 in two of 128, the accumulators of the second after the first's, which
// is the m64n256 layout the epilogues read). `scales(stage, k_block, cols)` returns the scales of a
// k-block's product `cols` (RowScales, tc_scales::Products); it runs while that product's MMAs are in
// flight and may read the stage (scales in shared memory), the promotion may not: each thread
// releases the stage once the k-block's last MMAs are done, before promoting them, so that the
// producer refills it while this warpgroup promotes. `before_mma(stage)` runs after the stage has
// landed and before any MMA reads it; `after_first()` once the tile's first MMAs are issued (work
// that then overlaps them, e.g. the scheduler's next tile; also called when there is no k-block).
// `turns` (IssueTurns, NoTurns) is called around each batch of MMAs issued; `stage_wait`
// (WaitAtIssue, ProbeAtRelease) is how the warpgroup waits for a stage.
// kNumProductSets = 2 (one product a k-block only) alternates two sets of fresh
// products: block k + 1's MMAs are issued before block k is promoted, so the tensor cores have
// work queued while this warpgroup waits and promotes. With 1, each product is issued, awaited and
// promoted in turn (kProductN / 2 registers fewer). kFirstOverwrites (one product set only): block
// 0's promotion overwrites acc, which the caller need not zero (e.g. while `after_first` still
// stores it); it needs num_k_blocks >= 1 (the launchers refuse K = 0), else acc keeps old sums.
template <uint32_t BLOCK_N, uint32_t kProductN, uint32_t kNumStages, uint32_t kNumProductSets,
          typename Turns, bool kFirstOverwrites, typename StageWait, typename Smem, typename Scales, typename BeforeMMA, typename AfterFirst>
__device__ __forceinline__ void consume_k_blocks_fp8(const Smem& smem, PipelineState& pipe, uint32_t num_k_blocks,
                                                     uint32_t a_offset, float (&acc)[BLOCK_N / 2],
                                                     const Scales& scales, const BeforeMMA& before_mma,
                                                     const AfterFirst& after_first, const Turns& turns,
                                                     StageWait& stage_wait) {
    constexpr uint32_t kProduct = kProductN / 2;  // a thread's accumulators of one 64 x kProductN product
    constexpr uint32_t kNumProducts = BLOCK_N / kProductN;
    static_assert(BLOCK_N % kProductN == 0 and
                  (kNumProductSets == 1 or (kNumProductSets == 2 and kNumProducts == 1 and not kFirstOverwrites)));
    timeline::mark(timeline::kTileStart, num_k_blocks);
    timeline::Waits waits(num_k_blocks);
    const auto beside_first = [&] { waits.begin(), after_first(), waits.end(timeline::kBesideFirst); };
    using Part = float[kProduct];  // (cicc 13.0 crashes on the bound written in the lambdas' parameters)
    Part part0, part1;
    // Stage 0's descriptors, made once: a stage's are these advanced by its offset. Their low
    // words come from lane 0 (a shuffle), so that the compiler keeps them in uniform registers
    // and the MMAs read them there, not through a move from vector registers each.
    const uint64_t desc_a0 = warp_uniform_desc(make_operand_desc<Major::kKMajor>(smem.a(0) + a_offset, 0));
    const uint64_t desc_b0 = warp_uniform_desc(make_operand_desc<Major::kKMajor>(smem.b(0), 0));
    PipelineState next = pipe;  // the stage the next MMAs read; `pipe` is the next to promote
    // Product `cols` (a std::integral_constant) of the next stage's k-block; the first waits for
    // the stage, the last moves on to the next.
    const auto issue = [&](Part& part, auto cols) {
        constexpr uint32_t kCols = decltype(cols)::value;
        // (the descriptors are made before the wait, so the first MMA issues right after it)
        const uint32_t stage = __shfl_sync(0xffffffff, next.stage, 0);  // (uniform too, as the bases)
        const uint64_t desc_a = advance_desc(desc_a0, stage * Smem::kBytesA);
        const uint64_t desc_b = advance_desc(desc_b0, stage * Smem::kBytesB + kCols * kProductN * kSwizzleBytes);
        if constexpr (kCols == 0) {
            waits.begin();
            stage_wait.wait(smem.full(next.stage), next.phase);
            waits.end(timeline::kWaitStage);
            timeline::mark(timeline::kStageLanded, next.stage);
            before_mma(next.stage);
        }
        waits.begin();
        turns.before_issue();
        waits.end(timeline::kWaitTurn);
        warpgroup_fence_operand(part);
        waits.begin();
        warpgroup_arrive();
        #pragma unroll
        for (uint32_t k = 0; k < BLOCK_K_FP8 / 32; ++k)  // k32 slices, 32 bytes apart in the swizzle row
            WGMMAFp8<kProductN>::mma(advance_desc(desc_a, k * 32), advance_desc(desc_b, k * 32), part, k > 0);
        warpgroup_commit_batch();
        waits.end(timeline::kIssue);
        turns.after_issue();
        warpgroup_fence_operand(part);
        if constexpr (kCols + 1 == kNumProducts)
            next.template advance<kNumStages>();
    };
    // Product `cols` of block k_block (issued) into acc, once at most `newer` (0 or 1) newer MMA
    // batches are left in flight; after the block's last product's MMAs the stage is released.
    const auto promote = [&](auto newer, Part& part, uint32_t k_block, auto cols, auto fresh) {
        constexpr uint32_t kCols = decltype(cols)::value;
        auto&& s = scales(pipe.stage, k_block, kCols);  // (a reference where the scales hold MMA outputs)
        waits.begin();
        warpgroup_wait<decltype(newer)::value>();
        waits.end(timeline::kWaitMma);
        warpgroup_fence_operand(part);
        if constexpr (kCols + 1 == kNumProducts) {
            smem.empty(pipe.stage)->arrive();
            pipe.template advance<kNumStages>();
            stage_wait.probe(smem.full(next.stage), next.phase);
        }
        s.template promote<decltype(fresh)::value>(part, *reinterpret_cast<Part*>(acc + kCols * kProduct));
    };
    constexpr std::integral_constant<int, 1> kOneNewer;
    constexpr std::integral_constant<int, 0> kNoneNewer;
    constexpr std::integral_constant<uint32_t, 0> kFirst;
    constexpr std::integral_constant<bool, false> kAdd;
    constexpr std::integral_constant<bool, kFirstOverwrites> kFirstBlock;
    if (num_k_blocks == 0) {
        beside_first();
        return;
    }
    if constexpr (kNumProductSets == 1) {
        for_each_product(std::make_integer_sequence<uint32_t, kNumProducts>{}, [&](auto cols) {
            issue(part0, cols);
            if constexpr (decltype(cols)::value == 0)
                beside_first();
            promote(kNoneNewer, part0, 0, cols, kFirstBlock);
        });
        for (uint32_t k_block = 1; k_block < num_k_blocks; ++k_block)
            for_each_product(std::make_integer_sequence<uint32_t, kNumProducts>{}, [&](auto cols) {
                issue(part0, cols), promote(kNoneNewer, part0, k_block, cols, kAdd);
            });
        return;
    }
    // Which products are in flight must not depend on the path taken (ptxas serializes the MMAs
    // otherwise): the loop starts and ends each pair with block k_block's in part0, the tail drains.
    issue(part0, kFirst);
    beside_first();
    uint32_t k_block = 0;
    for (; k_block + 2 < num_k_blocks; k_block += 2) {
        issue(part1, kFirst);
        promote(kOneNewer, part0, k_block, kFirst, kAdd);
        issue(part0, kFirst);
        promote(kOneNewer, part1, k_block + 1, kFirst, kAdd);
    }
    if (k_block + 1 < num_k_blocks) {
        issue(part1, kFirst);
        promote(kOneNewer, part0, k_block, kFirst, kAdd);
        promote(kNoneNewer, part1, k_block + 1, kFirst, kAdd);
    } else {
        promote(kNoneNewer, part0, k_block, kFirst, kAdd);
    }
}

}  // namespace deep_gemm::mma
