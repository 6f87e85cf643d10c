#pragma once
// Producer policies of the m-grouped GEMMs: how a stage's A tile (128 rows x 128 bytes of K,
// K-major, 128-byte swizzle) is filled. B always comes by TMA from the producer's thread 0.
//   kNumCopyThreads   producer threads whose cp.async copies complete on the stage's full
//                     barrier (0: A comes by TMA and counts among thread 0's bytes); WGMMA must
//                     fence before reading what cp.async wrote (generic proxy);
//   Rows              per-tile state, from begin(p, row_begin, num_rows, t) (t: producer thread);
//   load(smem_a, p, rows, k, bar, t)   one stage's loads, completing on `bar`.
// Params are the kernel's: tensor_map_a, or a, a_row_index, a_rows and k.
#include <cstdint>
#include <cuda_bf16.h>
#include "../ptx/barrier.cuh"
#include "../ptx/cp_async.cuh"
#include "../ptx/tma.cuh"

namespace deep_gemm::producer {

// Rows of A back to back: one TMA box a stage.
struct TmaRows {
    static constexpr uint32_t kNumCopyThreads = 0;

    struct Rows {
        uint32_t begin;
    };

    template <typename Params>
    __device__ __forceinline__ static Rows begin(const Params&, uint32_t row_begin, uint32_t, uint32_t) {
        return {row_begin};
    }

    template <typename Params>
    __device__ __forceinline__ static void load(uint8_t* smem_a, const Params& p, const Rows& rows, uint32_t k,
                                                ptx::MBarrier* bar, uint32_t) {
        ptx::tma_load_2d(smem_a, &p.tensor_map_a, bar, k, rows.begin);
    }
};

// Row i of A is row a_row_index[i] of the source `a` [a_rows, K] of T (128-byte tile rows: 64 bf16
// or 128 fp8 of K): cp.async by the whole producer warpgroup. Thread t copies 16-byte piece
// t % 8 of tile rows t / 8 + 16 j (j < 8), so each warp reads four whole 128-byte rows per
// cp.async. Lane l of warp w holds the source of tile row `row_of(t)` = 4 w + l % 4 + 16 (l / 4)
// (-1: zeros, for rows past the group and indices out of range); the lanes that copy a row fetch
// it with a shuffle.
template <typename T>
struct GatheredRowsOf {
    static constexpr uint32_t kNumCopyThreads = 128;
    static constexpr uint32_t kPerPiece = 16 / sizeof(T);

    struct Rows {
        int32_t src;
    };

    // (begin spells it out: through this call nvcc schedules the bf16 kernels' setup differently)
    __device__ __forceinline__ static uint32_t row_of(uint32_t t) {
        const uint32_t lane = t % 32;
        return 4 * (t / 32) + lane % 4 + 16 * (lane / 4);
    }

    template <typename Params>
    __device__ __forceinline__ static Rows begin(const Params& p, uint32_t row_begin, uint32_t num_rows, uint32_t t) {
        const uint32_t lane = t % 32, row = 4 * (t / 32) + lane % 4 + 16 * (lane / 4);
        const int64_t src = row < num_rows ? __ldg(p.a_row_index + row_begin + row) : -1;
        return {src >= 0 and src < p.a_rows ? static_cast<int32_t>(src) : -1};
    }

    template <typename Params>
    __device__ __forceinline__ static void load(uint8_t* smem_a, const Params& p, const Rows& rows, uint32_t k,
                                                ptx::MBarrier* bar, uint32_t t) {
        const uint32_t col = k + (t % 8) * kPerPiece;  // K % kPerPiece == 0: a piece is all in or all out
        const T* a = reinterpret_cast<const T*>(p.a);
        #pragma unroll
        for (uint32_t i = 0; i < 128 / 16; ++i) {
            const int32_t src = __shfl_sync(0xffffffff, rows.src, 4 * i + (t % 32) / 8);
            const bool valid = src >= 0 and col < p.k;
            ptx::cp_async_16(smem_a + ptx::swizzle_128b_offset(t / 8 + 16 * i, t % 8),
                             a + static_cast<uint64_t>(valid ? src : 0) * p.k + col, valid);
        }
        ptx::cp_async_arrive_noinc(bar);
    }
};

using GatheredRows = GatheredRowsOf<__nv_bfloat16>;

// FP8 A (the FP8 GEMMs): the rows as the base policy loads them, plus the 128 row scales of the
// stage's k-block (scale block k / 128) into `smem_scales`. Params add tensor_map_scales_a (the
// scales [K / 128][a_rows], row stride a_scales_ld), a_scales and a_scales_ld.
//   kScaleTxBytes        what the scales add to thread 0's TMA bytes;
//   scale_offset(row)    where the scale of a tile's first row (row `row` of A) sits in the stage.
// room for 132 A scales (Fp8TmaRows), then the m-grouped kernel's B scales; a 128-byte multiple
constexpr uint32_t kFp8ScaleStageBytes = 640;

// Rows back to back: the scales by TMA too (rows past the tensor read as zeros). A TMA box whose
// innermost coordinate is not 16-byte aligned faults (illegal instruction), and a ragged group's
// tile starts anywhere: the box starts at the row rounded down to 4 and holds 132 scales.
struct Fp8TmaRows : TmaRows {
    static constexpr uint32_t kScaleBoxRows = 128 + 4;
    static constexpr uint32_t kScaleTxBytes = kScaleBoxRows * sizeof(float);
    static_assert(kScaleTxBytes <= kFp8ScaleStageBytes);

    __device__ __forceinline__ static uint32_t scale_offset(uint32_t row) { return row % 4; }

    template <typename Params>
    __device__ __forceinline__ static void load(uint8_t* smem_a, float* smem_scales, const Params& p, const Rows& rows,
                                                uint32_t k, ptx::MBarrier* bar, uint32_t t) {
        TmaRows::load(smem_a, p, rows, k, bar, t);
        ptx::tma_load_2d(smem_scales, &p.tensor_map_scales_a, bar, rows.begin - scale_offset(rows.begin), k / 128);
    }
};

// Gathered rows: each producer thread also copies the scale of the row whose source it holds.
struct Fp8GatheredRows : GatheredRowsOf<uint8_t> {
    static constexpr uint32_t kScaleTxBytes = 0;

    __device__ __forceinline__ static uint32_t scale_offset(uint32_t) { return 0; }

    template <typename Params>
    __device__ __forceinline__ static void load(uint8_t* smem_a, float* smem_scales, const Params& p, const Rows& rows,
                                                uint32_t k, ptx::MBarrier* bar, uint32_t t) {
        const uint64_t scale = static_cast<uint64_t>(k / 128) * p.a_scales_ld + (rows.src >= 0 ? rows.src : 0);
        ptx::cp_async_4(smem_scales + row_of(t), p.a_scales + scale, rows.src >= 0);  // (before the arrival)
        GatheredRowsOf<uint8_t>::load(smem_a, p, rows, k, bar, t);
    }
};

}  // namespace deep_gemm::producer
