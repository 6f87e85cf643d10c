#pragma once
// bf16 -> float8_e4m3fn quantization for the blockwise FP8 GEMMs (docs/DESIGN.md, "Blockwise
// FP8"). Both kernels walk 128 x 128 tiles of a bf16 matrix, persistent CTAs of 256 threads:
//   Fp8QuantizeActivations  rows [M, K] -> fp8 rows with one scale per 1 x 128 (the GEMMs' A), and/or
//                           a transposed copy [K, Mp] with one scale per 128 x 1, per group of rows
//                           (the weight gradients' operands; each group's tokens padded with zeros
//                           to a multiple of 128, so that a scale block never holds two groups);
//   Fp8QuantizeWeights      [G, N, K] -> fp8 with one scale per 128 x 128 block, in both orientations.
// A tile's rows are loaded once, 16-byte accesses, eight in flight per thread; the activations'
// kernel loads a tile while it quantizes the one before (two tiles in registers, two CTAs an SM).
// The transposed copy and the column scales come from a bf16 copy of the tile in shared memory.
#include <cstdint>
#include <cuda_bf16.h>
#include "../ptx/fp8.cuh"
#include "../ptx/utils.cuh"
#include "../ptx/vec.cuh"

namespace deep_gemm {

namespace fp8_quantize {

constexpr uint32_t kTile = 128;
constexpr uint32_t kNumThreads = 256;
constexpr uint32_t kRowsPerPass = kNumThreads / 16;  // 16 threads hold one 128-wide row (16 bytes each)
constexpr uint32_t kNumPasses = kTile / kRowsPerPass;
constexpr uint32_t kMaxGroups = 1024;

// A tile in registers, as loaded (bf16): thread t holds columns 8 (t % 16) .. + 8 of rows
// t / 16 + 16 i, i < 8.
struct TileRegs {
    uint4 raw[kNumPasses];

    __device__ __forceinline__ static uint32_t row(uint32_t i) { return i * kRowsPerPass + threadIdx.x / 16; }
    __device__ __forceinline__ static uint32_t col() { return (threadIdx.x % 16) * ptx::kBF16PerVec; }

    // Rows r < num_rows from `src` (row r at src + r * ld), zeros below; all loads in flight at once.
    __device__ __forceinline__ void load(const __nv_bfloat16* src, uint64_t ld, uint32_t num_rows) {
        load_rows(src, ld, num_rows, [](uint32_t r) { return static_cast<int64_t>(r); });
    }

    // Row r < num_rows from src + source_of(r) * ld (a negative source: zeros), zeros below.
    template <typename SourceOf>
    __device__ __forceinline__ void load_rows(const __nv_bfloat16* src, uint64_t ld, uint32_t num_rows,
                                              const SourceOf& source_of) {
        #pragma unroll
        for (uint32_t i = 0; i < kNumPasses; ++i) {
            const int64_t source = row(i) < num_rows ? source_of(row(i)) : -1;
            raw[i] = source >= 0 ? __ldg(reinterpret_cast<const uint4*>(src + source * ld + col()))
                                 : make_uint4(0, 0, 0, 0);
        }
    }

    // amax of row(i) over the tile's 128 columns (the 16 threads holding the row agree).
    __device__ __forceinline__ float row_amax(uint32_t i) const {
        float x[ptx::kBF16PerVec], amax = 0.0f;
        ptx::bf16x8_to_float(raw[i], x);
        #pragma unroll
        for (uint32_t j = 0; j < ptx::kBF16PerVec; ++j)
            amax = fmaxf(amax, fabsf(x[j]));
        #pragma unroll
        for (uint32_t lanes = 8; lanes > 0; lanes /= 2)
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, lanes));
        return amax;
    }

    // Row(i)'s eight values times `inv` (1 / scale) as e4m3, to `dst` (8 bytes).
    __device__ __forceinline__ void store_fp8(uint32_t i, float inv, uint8_t* dst) const {
        float x[ptx::kBF16PerVec];
        ptx::bf16x8_to_float(raw[i], x);
        *reinterpret_cast<uint2*>(dst) = make_uint2(ptx::pack_e4m3x4(x[0] * inv, x[1] * inv, x[2] * inv, x[3] * inv),
                                                    ptx::pack_e4m3x4(x[4] * inv, x[5] * inv, x[6] * inv, x[7] * inv));
    }

    // The tile into `smem` [128][128] bf16, for column reads.
    __device__ __forceinline__ void to_smem(__nv_bfloat16* smem) const {
        #pragma unroll
        for (uint32_t i = 0; i < kNumPasses; ++i)
            ptx::st_shared_v4(smem + row(i) * kTile + col(), raw[i]);
    }
};

// Where a tile of the activations lies: its 128-row block (of the padded columns, for the
// transposed copy), its 128-column block, and the rows of x it reads.
struct TileCoords {
    uint32_t block, kb, row_begin, num_rows;
};

// Thread t's share of a tile's columns in shared memory: columns 2 (t % 64) and 2 (t % 64) + 1 of
// the 32 rows from 32 (t / 64) (a warp reads one 128-byte row at a time: no bank conflicts).
struct ColumnPair {
    static constexpr uint32_t kRows = kTile / (kNumThreads / 64);
    __nv_bfloat162 x[kRows];  // row r: (column col(), column col() + 1)

    __device__ __forceinline__ static uint32_t col() { return 2 * (threadIdx.x % 64); }
    __device__ __forceinline__ static uint32_t first_row() { return kRows * (threadIdx.x / 64); }

    __device__ __forceinline__ void load(const __nv_bfloat16* smem) {
        #pragma unroll
        for (uint32_t r = 0; r < kRows; ++r)
            x[r] = *reinterpret_cast<const __nv_bfloat162*>(smem + (first_row() + r) * kTile + col());
    }

    // amax over the kRows rows of each column: (column col(), column col() + 1).
    __device__ __forceinline__ float2 amax() const {
        float2 m = make_float2(0.0f, 0.0f);
        #pragma unroll
        for (uint32_t r = 0; r < kRows; ++r) {
            const float2 v = __bfloat1622float2(x[r]);
            m.x = fmaxf(m.x, fabsf(v.x)), m.y = fmaxf(m.y, fabsf(v.y));
        }
        return m;
    }

    // Column `which` (0: col(), 1: col() + 1), its kRows values times `inv` (1 / scale) as e4m3,
    // to `dst` (kRows bytes).
    __device__ __forceinline__ void store_fp8(uint32_t which, float inv, uint8_t* dst) const {
        #pragma unroll
        for (uint32_t r = 0; r < kRows; r += 16) {
            uint4 out;
            uint32_t* words = reinterpret_cast<uint32_t*>(&out);
            #pragma unroll
            for (uint32_t w = 0; w < 4; ++w) {
                float v[4];
                #pragma unroll
                for (uint32_t j = 0; j < 4; ++j) {
                    const float2 pair = __bfloat1622float2(x[r + 4 * w + j]);
                    v[j] = (which == 0 ? pair.x : pair.y) * inv;
                }
                words[w] = ptx::pack_e4m3x4(v[0], v[1], v[2], v[3]);
            }
            *reinterpret_cast<uint4*>(dst + r) = out;
        }
    }
};

}  // namespace fp8_quantize

struct Fp8QuantizeActivationsParams {
    const void* x;           // [M, K], or [x_rows, K] with row_index: bf16, or e4m3 (Fp8RowsSource)
    const float* x_scales;   // e4m3 x's 1 x 128 scales, x_scales[kb * x_scales_ld + row] (Fp8RowsSource)
    const int64_t* row_index;  // [M] or null: row m is x's row row_index[m] (outside [0, x_rows): zeros)
    const int* offsets;      // [G + 1] row groups (transposed copy only)
    uint8_t* q;              // [M, K] e4m3, or null
    float* scales;           // [K / 128][scales_ld]: scales[kb * scales_ld + m] for row m, columns 128 kb..
    uint8_t* qt;             // [K, mp] e4m3, or null: column p of group g is its row p - padded[g]
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

// Without `qt`, tiles walk rows 128 at a time and `offsets` is not read. With it, tiles walk the
// padded columns of qt: tile b's rows are rows padded[g] - offsets[g] + 128 b.. of group g, the
// rows past the group's end read as zeros (so qt's padding is zeros) and are not written to q.
template <typename ScaleRule, typename Source = fp8_quantize::Bf16RowsSource>
struct Fp8QuantizeActivations {
    static constexpr uint32_t kNumThreads = fp8_quantize::kNumThreads;

    __device__ __forceinline__ static void run(const Fp8QuantizeActivationsParams& p) {
        using namespace fp8_quantize;
        __shared__ __align__(16) __nv_bfloat16 tile_smem[kTile * kTile];
        __shared__ int padded[kMaxGroups + 1];
        __shared__ float col_amax[kNumThreads / 64][kTile];
        const bool transposed = p.qt != nullptr;
        if (transposed)
            padded_offsets(p, padded);
        __syncthreads();

        const uint32_t num_k_blocks = p.k / kTile;
        const uint32_t num_row_blocks = transposed ? static_cast<uint32_t>(padded[p.num_groups]) / kTile
                                                   : ptx::ceil_div(p.m, kTile);
        const uint32_t num_tiles = num_row_blocks * num_k_blocks;
        // Each tile's rows are loaded while the tile before it is quantized and stored (two tiles
        // in registers), so that a CTA always has loads in flight.
        const auto coords = [&](uint32_t t) {
            TileCoords c{t / num_k_blocks, t % num_k_blocks, 0, 0};
            c.row_begin = c.block * kTile, c.num_rows = min(kTile, p.m - min(c.row_begin, p.m));
            if (transposed) {
                const uint32_t g = group_of(padded, p.num_groups, c.block * kTile);
                const uint32_t begin = clamped(p.offsets, g, 0, p.m), end = clamped(p.offsets, g + 1, begin, p.m);
                c.row_begin = begin + c.block * kTile - padded[g];
                c.num_rows = min(kTile, end - min(c.row_begin, end));
            }
            return c;
        };
        const auto load = [&](TileRegs& regs, const TileCoords& c) { Source::load(regs, p, c); };
        TileCoords next_coords{};
        TileRegs next;
        if (blockIdx.x < num_tiles)
            next_coords = coords(blockIdx.x), load(next, next_coords);
        for (uint32_t t = blockIdx.x; t < num_tiles; t += gridDim.x) {
            const TileCoords c = next_coords;
            const uint32_t block = c.block, kb = c.kb, row_begin = c.row_begin, num_rows = c.num_rows;
            const TileRegs regs = next;
            if (t + gridDim.x < num_tiles)
                next_coords = coords(t + gridDim.x), load(next, next_coords);

            if (p.q != nullptr) {
                #pragma unroll
                for (uint32_t i = 0; i < kNumPasses; ++i) {
                    const float scale = ScaleRule::of(regs.row_amax(i));
                    const uint32_t r = TileRegs::row(i);
                    if (r < num_rows) {
                        regs.store_fp8(i, __frcp_rn(scale), p.q + static_cast<uint64_t>(row_begin + r) * p.k + kb * kTile + TileRegs::col());
                        if (threadIdx.x % 16 == 0)
                            p.scales[static_cast<uint64_t>(kb) * p.scales_ld + row_begin + r] = scale;
                    }
                }
            }
            if (transposed) {
                regs.to_smem(tile_smem);
                __syncthreads();
                ColumnPair cols;
                cols.load(tile_smem);
                const uint32_t quarter = threadIdx.x / 64;
                const float2 mine = cols.amax();
                col_amax[quarter][ColumnPair::col()] = mine.x;
                col_amax[quarter][ColumnPair::col() + 1] = mine.y;
                __syncthreads();
                float amax[2] = {0.0f, 0.0f};
                #pragma unroll
                for (uint32_t j = 0; j < kNumThreads / 64; ++j)
                    amax[0] = fmaxf(amax[0], col_amax[j][ColumnPair::col()]),
                    amax[1] = fmaxf(amax[1], col_amax[j][ColumnPair::col() + 1]);
                const float scale[2] = {ScaleRule::of(amax[0]), ScaleRule::of(amax[1])};
                const uint32_t c = kb * kTile + ColumnPair::col();
                const uint64_t qt_col = static_cast<uint64_t>(block) * kTile + ColumnPair::first_row();
                cols.store_fp8(0, __frcp_rn(scale[0]), p.qt + static_cast<uint64_t>(c) * p.mp + qt_col);
                cols.store_fp8(1, __frcp_rn(scale[1]), p.qt + static_cast<uint64_t>(c + 1) * p.mp + qt_col);
                if (quarter == 0)
                    *reinterpret_cast<float2*>(p.scales_t + static_cast<uint64_t>(block) * p.k + c) =
                        make_float2(scale[0], scale[1]);
                __syncthreads();  // tile_smem and col_amax are free for the next tile
            }
        }
    }

    __device__ __forceinline__ static uint32_t clamped(const int* offsets, uint32_t i, uint32_t lo, uint32_t hi) {
        return min(max(static_cast<uint32_t>(max(__ldg(offsets + i), 0)), lo), hi);
    }

    // padded[g] = sum over g' < g of group g' rounded up to 128 rows (an exclusive scan, each
    // thread over up to kMaxGroups / kNumThreads groups); CTA 0 also writes it out for the GEMMs.
    __device__ __forceinline__ static void padded_offsets(const Fp8QuantizeActivationsParams& p, int* padded) {
        using namespace fp8_quantize;
        __shared__ int warp_sums[kNumThreads / 32];
        constexpr uint32_t kPerThread = kMaxGroups / kNumThreads;
        const uint32_t first = threadIdx.x * kPerThread;
        int sizes[kPerThread], sum = 0;
        #pragma unroll
        for (uint32_t j = 0; j < kPerThread; ++j) {
            const uint32_t g = first + j;
            sizes[j] = 0;
            if (g < p.num_groups) {
                const uint32_t begin = clamped(p.offsets, g, 0, p.m);
                sizes[j] = static_cast<int>(ptx::ceil_div(clamped(p.offsets, g + 1, begin, p.m) - begin, kTile) * kTile);
            }
            sum += sizes[j];
        }
        const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
        int inclusive = sum;
        #pragma unroll
        for (uint32_t d = 1; d < 32; d *= 2) {
            const int other = __shfl_up_sync(0xffffffff, inclusive, d);
            if (lane >= d)
                inclusive += other;
        }
        if (lane == 31)
            warp_sums[warp] = inclusive;
        __syncthreads();
        int before = inclusive - sum;
        for (uint32_t w = 0; w < warp; ++w)
            before += warp_sums[w];
        #pragma unroll
        for (uint32_t j = 0; j < kPerThread; ++j) {
            if (first + j < p.num_groups)
                padded[first + j] = before;
            before += sizes[j];
        }
        if (threadIdx.x == kNumThreads - 1)  // (its `before` now holds every group)
            padded[p.num_groups] = before;
        __syncthreads();
        if (blockIdx.x == 0) {
            for (uint32_t g = threadIdx.x; g <= p.num_groups; g += kNumThreads)
                p.padded_offsets[g] = padded[g];
        }
    }

    // The group whose padded columns hold column `col` (< padded[G]): the last g with padded[g] <= col.
    __device__ __forceinline__ static uint32_t group_of(const int* padded, uint32_t num_groups, uint32_t col) {
        uint32_t lo = 0, hi = num_groups;  // padded[lo] <= col < padded[hi]
        while (hi - lo > 1) {
            const uint32_t mid = (lo + hi) / 2;
            if (static_cast<uint32_t>(padded[mid]) <= col)
                lo = mid;
            else
                hi = mid;
        }
        return lo;
    }
};

struct Fp8QuantizeWeightsParams {
    const __nv_bfloat16* w;  // [G, N, K]
    uint8_t* q;              // [G, N, K] e4m3
    uint8_t* qt;             // [G, K, N] e4m3: q's transpose, with the same scales
    float* scales;           // [G, N / 128, K / 128]
    uint32_t num_groups, n, k;
};

template <typename ScaleRule>
struct Fp8QuantizeWeights {
    static constexpr uint32_t kNumThreads = fp8_quantize::kNumThreads;

    __device__ __forceinline__ static void run(const Fp8QuantizeWeightsParams& p) {
        using namespace fp8_quantize;
        __shared__ __align__(16) __nv_bfloat16 tile_smem[kTile * kTile];
        __shared__ float warp_amax[kNumThreads / 32];
        const uint32_t num_n_blocks = p.n / kTile, num_k_blocks = p.k / kTile;
        const uint32_t num_tiles = p.num_groups * num_n_blocks * num_k_blocks;
        for (uint32_t t = blockIdx.x; t < num_tiles; t += gridDim.x) {
            const uint32_t g = t / (num_n_blocks * num_k_blocks), nb = t / num_k_blocks % num_n_blocks,
                           kb = t % num_k_blocks;
            const uint64_t group_base = static_cast<uint64_t>(g) * p.n * p.k;
            TileRegs regs;
            regs.load(p.w + group_base + static_cast<uint64_t>(nb) * kTile * p.k + kb * kTile, p.k, kTile);
            regs.to_smem(tile_smem);
            float amax = 0.0f;
            #pragma unroll
            for (uint32_t i = 0; i < kNumPasses; ++i)
                amax = fmaxf(amax, regs.row_amax(i));
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, 16));
            if (threadIdx.x % 32 == 0)
                warp_amax[threadIdx.x / 32] = amax;
            __syncthreads();
            #pragma unroll
            for (uint32_t w = 0; w < kNumThreads / 32; ++w)
                amax = fmaxf(amax, warp_amax[w]);
            const float scale = ScaleRule::of(amax), inv = __frcp_rn(scale);

            #pragma unroll
            for (uint32_t i = 0; i < kNumPasses; ++i)
                regs.store_fp8(i, inv, p.q + group_base + static_cast<uint64_t>(nb * kTile + TileRegs::row(i)) * p.k +
                                             kb * kTile + TileRegs::col());
            ColumnPair cols;
            cols.load(tile_smem);
            const uint64_t qt_row = static_cast<uint64_t>(kb) * kTile + ColumnPair::col();
            const uint32_t qt_col = nb * kTile + ColumnPair::first_row();
            cols.store_fp8(0, inv, p.qt + group_base + qt_row * p.n + qt_col);
            cols.store_fp8(1, inv, p.qt + group_base + (qt_row + 1) * p.n + qt_col);
            if (threadIdx.x == 0)
                p.scales[(static_cast<uint64_t>(g) * num_n_blocks + nb) * num_k_blocks + kb] = scale;
            __syncthreads();  // tile_smem and warp_amax are free for the next tile
        }
    }
};

}  // namespace deep_gemm
