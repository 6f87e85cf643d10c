#pragma once
// The FP8 GEMMs' mainloop (blockwise scales, docs/DESIGN.md "Blockwise FP8"): each stage holds one
// 128-deep k-block, whose four k32 MMAs go into fresh registers that are then added to the fp32
// sum times the block's scales. Hopper's FP8 MMAs add their products with reduced precision;
// promoting every 128 of K keeps the sum fp32. The producer side is pipeline.cuh's.
#include <cstdint>
#include "pipeline.cuh"
#include "wgmma_fp8.cuh"

namespace deep_gemm::mma {

constexpr uint32_t BLOCK_K_FP8 = 128;  // one 128-byte swizzle row of e4m3
constexpr uint32_t kFp8ReleasesPerCta = kNumMathThreads / 32;  // every math warp releases a stage itself

// The scales of a thread's two accumulator rows (mma/wgmma_fp8.cuh: accumulator i is in row
// lane / 4 + 8 * ((i / 2) % 2) of its warp's 16): `scale(stage, k_block)` returns them for the
// k-block, products of A's and B's scales. It runs while the block's MMAs are in flight and may
// read the stage (e.g. A's scales in shared memory): each warp releases the stage only after it.
// `before_mma(stage)` runs after the stage has landed and before any MMA reads it.
template <uint32_t BLOCK_N, uint32_t kNumStages, typename Smem, typename Scale, typename BeforeMMA>
__device__ __forceinline__ void consume_k_blocks_fp8(const Smem& smem, PipelineState& pipe, uint32_t num_k_blocks,
                                                     uint32_t a_offset, float (&acc)[BLOCK_N / 2],
                                                     const Scale& scale, const BeforeMMA& before_mma) {
    float part[BLOCK_N / 2];
    const bool releases = ptx::lane_idx() == 0;
    for (uint32_t k_block = 0; k_block < num_k_blocks; ++k_block) {
        smem.full(pipe.stage)->wait(pipe.phase);
        before_mma(pipe.stage);
        warpgroup_fence_operand(part);
        warpgroup_arrive();
        #pragma unroll
        for (uint32_t k = 0; k < BLOCK_K_FP8 / 32; ++k)
            WGMMAFp8<BLOCK_N>::mma(make_operand_desc<Major::kKMajor>(smem.a(pipe.stage) + a_offset, k),
                                   make_operand_desc<Major::kKMajor>(smem.b(pipe.stage), k), part, k > 0);
        warpgroup_commit_batch();
        warpgroup_fence_operand(part);
        const float2 s = scale(pipe.stage, k_block);
        warpgroup_wait<0>();
        if (releases)
            smem.empty(pipe.stage)->arrive();
        #pragma unroll
        for (uint32_t i = 0; i < BLOCK_N / 2; ++i)
            acc[i] = fmaf(part[i], (i / 2) % 2 ? s.y : s.x, acc[i]);
        pipe.template advance<kNumStages>();
    }
}

}  // namespace deep_gemm::mma
