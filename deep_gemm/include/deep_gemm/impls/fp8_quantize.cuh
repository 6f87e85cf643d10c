#pragma once
// bf16 -> float8_e4m3fn quantization for the blockwise FP8 GEMMs (docs/DESIGN.md, "Blockwise
// FP8"). The kernels walk 128 x 128 tiles of a bf16 matrix, CTAs of 256 threads:
//   Fp8QuantizeActivations  rows [M, K] -> a transposed copy [K, Mp] with one scale per 128 x 1, per
//                           group of rows (the weight gradients' operands; each group's tokens padded
//                           with zeros to a multiple of 128, so that a scale block never holds two
//                           groups), and, when asked, fp8 rows with one scale per 1 x 128 from the
//                           same loads;
//   Fp8QuantizeRows         rows [M, K] -> fp8 rows with one scale per 1 x 128 (the GEMMs' A);
//   Fp8QuantizeWeights      [G, N, K] -> fp8 with one scale per 128 x 128 block, in both orientations
//                           or in one (`WeightCopies`).
// A tile's rows are loaded once, 16-byte accesses, eight in flight per thread, one tile in
// registers at a time: several CTAs an SM keep loads in flight while others quantize (their grids
// and CTAs an SM: quant/kernels.py). The transposed copy and the column scales come from a bf16
// copy of the tile in shared memory; the copy leaves through an e4m3 stage there in whole 128-byte
// rows (`TransposedStage`).
#include <cstdint>
#include <cuda_bf16.h>
#include "../quant/tiles.cuh"

namespace deep_gemm {

namespace fp8_quantize {

// Where a tile of the activations lies: its 128-row block (of the padded columns, for the
// transposed copy), its 128-column block, and the rows of x it reads.
struct TileCoords {
    uint32_t block, kb, row_begin, num_rows;
};

}  // namespace fp8_quantize

struct Fp8QuantizeActivationsParams {
    const void* x;           // [M, K], or [x_rows, K] with row_index: bf16, or e4m3 (Fp8RowsSource)
    const float* x_scales;   // e4m3 x's 1 x 128 scales, x_scales[kb * x_scales_ld + row] (Fp8RowsSource)
    const int64_t* row_index;  // [M] or null: row m is x's row row_index[m] (outside [0, x_rows): zeros)
    const int* offsets;      // [G + 1] row groups (the transposed copy's)
    uint8_t* q;              // [M, K] e4m3, or null
    float* scales;           // [K / 128][scales_ld]: scales[kb * scales_ld + m] for row m, columns 128 kb..
    uint8_t* qt;             // [K, mp] e4m3 (Fp8QuantizeActivations): column p of group g is its row p - padded[g]
    float* scales_t;         // [mp / 128, K]: one per 128 columns of qt and row of it
    int* padded_offsets;     // [G + 1]: group g's columns of qt, [padded[g], padded[g + 1]), multiples of 128
    uint32_t m, k, num_groups, scales_ld, mp, x_rows, x_scales_ld;
};

namespace fp8_quantize {

// Where the activations' kernel reads its rows: `load(regs, p, coords)` fills a tile's registers
// with bf16 values, rows past coords.num_rows (and rows whose index lies outside x) as zeros.
// bf16 rows, read as they are.
struct Bf16RowsSource {
    __device__ __forceinline__ static void load(TileRegs& regs, const Fp8QuantizeActivationsParams& p,
                                                const TileCoords& c) {
        const auto* x = static_cast<const __nv_bfloat16*>(p.x);
        if (p.row_index == nullptr) {
            regs.load(x + static_cast<uint64_t>(c.row_begin) * p.k + c.kb * kTile, p.k, c.num_rows);
        } else {
            regs.load_rows(x + c.kb * kTile, p.k, c.num_rows, [&](uint32_t r) {
                const int64_t source = __ldg(p.row_index + c.row_begin + r);
                return source < static_cast<int64_t>(p.x_rows) ? source : int64_t{-1};
            });
        }
    }
};

// e4m3 rows with their 1 x 128 scales, dequantized in the loads and rounded to bf16: the values
// `deep_gemm.quant.reference.dequantize_rows(...).bfloat16()` gives (for rows whose bf16 copy
// is not at hand, e.g. other ranks' tokens after an FP8 exchange).
struct Fp8RowsSource {
    __device__ __forceinline__ static void load(TileRegs& regs, const Fp8QuantizeActivationsParams& p,
                                                const TileCoords& c) {
        const auto* x = static_cast<const uint8_t*>(p.x);
        #pragma unroll
        for (uint32_t i = 0; i < kNumPasses; ++i) {
            const uint32_t r = TileRegs::row(i);
            int64_t source = -1;
            if (r < c.num_rows) {
                source = p.row_index == nullptr ? static_cast<int64_t>(c.row_begin + r) : __ldg(p.row_index + c.row_begin + r);
                source = source < static_cast<int64_t>(p.x_rows) ? source : int64_t{-1};
            }
            float v[ptx::kBF16PerVec];
            if (source >= 0) {
                const float scale = __ldg(p.x_scales + static_cast<uint64_t>(c.kb) * p.x_scales_ld + source);
                ptx::unpack_e4m3x8(__ldg(reinterpret_cast<const uint2*>(x + source * p.k + c.kb * kTile + TileRegs::col())), v);
                #pragma unroll
                for (uint32_t j = 0; j < ptx::kBF16PerVec; ++j)
                    v[j] *= scale;
                regs.raw[i] = ptx::float_to_bf16x8(v);
            } else {
                regs.raw[i] = make_uint4(0, 0, 0, 0);
            }
        }
    }
};

}  // namespace fp8_quantize

// Tiles walk the padded columns of qt: tile b's rows are rows padded[g] - offsets[g] + 128 b.. of
// group g, the rows past the group's end read as zeros (so qt's padding is zeros) and are not
// written to q (the rows, when asked for; the rows alone are Fp8QuantizeRows').
template <typename ScaleRule, typename Source = fp8_quantize::Bf16RowsSource>
struct Fp8QuantizeActivations {
    static constexpr uint32_t kNumThreads = fp8_quantize::kNumThreads;

    __device__ __forceinline__ static void run(const Fp8QuantizeActivationsParams& p) {
        using namespace fp8_quantize;
        __shared__ __align__(16) ColumnSmem column_smem;
        __shared__ int padded[kMaxGroups + 1];
        padded_offsets(p.offsets, p.num_groups, p.m, padded, p.padded_offsets);

        const uint32_t num_k_blocks = p.k / kTile;
        const uint32_t num_tiles = static_cast<uint32_t>(padded[p.num_groups]) / kTile * num_k_blocks;
        const auto coords = [&](uint32_t t) {
            TileCoords c{t / num_k_blocks, t % num_k_blocks, 0, 0};
            padded_block_rows(padded, p.offsets, p.num_groups, p.m, c.block, c.row_begin, c.num_rows);
            return c;
        };
        for (uint32_t t = blockIdx.x; t < num_tiles; t += gridDim.x) {
            const TileCoords c = coords(t);
            const uint32_t block = c.block, kb = c.kb, row_begin = c.row_begin, num_rows = c.num_rows;
            TileRegs regs;
            Source::load(regs, p, c);

            if (p.q != nullptr)
                store_rows_fp8<ScaleRule>(regs, num_rows, p.q + static_cast<uint64_t>(row_begin) * p.k + kb * kTile, p.k,
                                          p.scales + static_cast<uint64_t>(kb) * p.scales_ld + row_begin);
            store_columns_fp8<ScaleRule>(regs, column_smem, p.qt + static_cast<uint64_t>(kb) * kTile * p.mp + block * kTile,
                                         p.mp, p.scales_t + static_cast<uint64_t>(block) * p.k + kb * kTile);
        }
    }
};

// Rows only, from bf16 rows read as they are (`fp8_quantize_rows`): launched one CTA a tile (the
// loop serves smaller grids), no shared memory, no group scan: the activations' kernel's rows
// without its persistent walk (docs/PERF.md, "Decisions": FP8 quantization grids).
template <typename ScaleRule>
struct Fp8QuantizeRows {
    static constexpr uint32_t kNumThreads = fp8_quantize::kNumThreads;

    __device__ __forceinline__ static void run(const Fp8QuantizeActivationsParams& p) {
        using namespace fp8_quantize;
        const auto* x = static_cast<const __nv_bfloat16*>(p.x);
        const uint32_t num_k_blocks = p.k / kTile;
        const uint32_t num_tiles = ptx::ceil_div(p.m, kTile) * num_k_blocks;
        for (uint32_t t = blockIdx.x; t < num_tiles; t += gridDim.x) {
            const uint32_t row_begin = t / num_k_blocks * kTile, kb = t % num_k_blocks;
            const uint32_t num_rows = min(kTile, p.m - row_begin);
            const uint64_t offset = static_cast<uint64_t>(row_begin) * p.k + kb * kTile;
            TileRegs regs;
            regs.load(x + offset, p.k, num_rows);
            store_rows_fp8<ScaleRule>(regs, num_rows, p.q + offset, p.k,
                                      p.scales + static_cast<uint64_t>(kb) * p.scales_ld + row_begin);
        }
    }
};

struct Fp8QuantizeWeightsParams {
    const __nv_bfloat16* w;  // [G, N, K]
    uint8_t* q;              // [G, N, K] e4m3 (written if Copies::kForward)
    uint8_t* qt;             // [G, K, N] e4m3: q's transpose, with the same scales (if Copies::kTransposed)
    float* scales;           // [G, N / 128, K / 128]
    uint32_t num_groups, n, k;
};

namespace fp8_quantize {

// Which copies of a weight the weights' kernel writes: the forward's ([G, N, K]), the data
// gradient's transpose ([G, K, N]), or both from one read of the bf16 weight.
template <bool kForward_, bool kTransposed_>
struct WeightCopies {
    static constexpr bool kForward = kForward_, kTransposed = kTransposed_;
};
using BothWeightCopies = WeightCopies<true, true>;
using ForwardWeightCopy = WeightCopies<true, false>;
using TransposedWeightCopy = WeightCopies<false, true>;

}  // namespace fp8_quantize

// The transposed copy leaves through shared memory in whole 128-byte rows (`TransposedStage`).
template <typename ScaleRule, typename Copies = fp8_quantize::BothWeightCopies>
struct Fp8QuantizeWeights {
    static constexpr uint32_t kNumThreads = fp8_quantize::kNumThreads;
    struct Smem {
        __nv_bfloat16 tile[fp8_quantize::kTile * fp8_quantize::kTile];
        uint8_t stage[fp8_quantize::TransposedStage::kBytes];
        float warp_amax[kNumThreads / 32];
    };
    static constexpr uint32_t kSmemBytes = sizeof(Smem);

    __device__ __forceinline__ static void run(const Fp8QuantizeWeightsParams& p) {
        using namespace fp8_quantize;
        extern __shared__ __align__(16) uint8_t smem_buffer[];
        Smem& smem = *reinterpret_cast<Smem*>(smem_buffer);
        const uint32_t num_n_blocks = p.n / kTile, num_k_blocks = p.k / kTile;
        const uint32_t num_tiles = p.num_groups * num_n_blocks * num_k_blocks;
        for (uint32_t t = blockIdx.x; t < num_tiles; t += gridDim.x) {
            const uint32_t g = t / (num_n_blocks * num_k_blocks), nb = t / num_k_blocks % num_n_blocks,
                           kb = t % num_k_blocks;
            const uint64_t group_base = static_cast<uint64_t>(g) * p.n * p.k;
            TileRegs regs;
            regs.load(p.w + group_base + static_cast<uint64_t>(nb) * kTile * p.k + kb * kTile, p.k, kTile);
            if constexpr (Copies::kTransposed)
                regs.to_smem(smem.tile);
            float amax = regs.warp_amax();
            if (threadIdx.x % 32 == 0)
                smem.warp_amax[threadIdx.x / 32] = amax;
            __syncthreads();
            #pragma unroll
            for (uint32_t w = 0; w < kNumThreads / 32; ++w)
                amax = fmaxf(amax, smem.warp_amax[w]);
            const float scale = ScaleRule::of(amax), inv = ptx::reciprocal_of_scale(scale);

            if constexpr (Copies::kForward) {
                #pragma unroll
                for (uint32_t i = 0; i < kNumPasses; ++i)
                    regs.store_fp8(i, inv, p.q + group_base + static_cast<uint64_t>(nb * kTile + TileRegs::row(i)) * p.k +
                                                 kb * kTile + TileRegs::col());
            }
            if (threadIdx.x == 0)
                p.scales[(static_cast<uint64_t>(g) * num_n_blocks + nb) * num_k_blocks + kb] = scale;
            if constexpr (Copies::kTransposed) {
                ColumnPair cols;
                cols.load(smem.tile);
                cols.stage_fp8(0, inv, smem.stage);
                cols.stage_fp8(1, inv, smem.stage);
                __syncthreads();
                TransposedStage::store(smem.stage, p.qt + group_base + static_cast<uint64_t>(kb) * kTile * p.n +
                                                       nb * kTile, p.n);
            }
            __syncthreads();  // the tile, the stage and warp_amax are free for the next tile
        }
    }
};

}  // namespace deep_gemm
