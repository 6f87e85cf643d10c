#pragma once
// The pieces of the FP8 quantization kernels (impls/fp8_quantize.cuh, impls/moe_swiglu_bwd_fp8.cuh):
// a 128 x 128 bf16 tile in registers (or copied into shared memory in the same layout), its rows
// quantized per 1 x 128 from registers, its columns per 128 x 1 through a bf16 copy in shared
// memory and out through a transposed e4m3 stage there, and the groups' padded offsets of the
// transposed copies (each group's rows padded with zeros to a multiple of 128, so that a scale
// block never holds two groups). 256 threads a CTA.
#include <cstdint>
#include <cuda_bf16.h>
#include "../ptx/cp_async.cuh"
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

// The largest magnitude of a piece's eight bf16 values, in bf16 pairs: (over the even elements,
// over the odd). Exact (the values are bf16); a NaN is passed over, as fmaxf passes it.
__device__ __forceinline__ __nv_bfloat162 piece_amax2(const uint4& piece) {
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&piece);
    return __hmax2(__hmax2(__habs2(pairs[0]), __habs2(pairs[1])), __hmax2(__habs2(pairs[2]), __habs2(pairs[3])));
}

// The amax of two rows over their 128 columns, each from its 16 threads' pieces of 8 values (16
// bytes of bf16): (row of `a`, row of `b`), in one shuffle chain for both. The 16 threads agree;
// an all-NaN or all-zero row gives 0, as fmaxf from 0 does.
__device__ __forceinline__ float2 row_amax2(const uint4& a, const uint4& b) {
    const __nv_bfloat162 ma = piece_amax2(a), mb = piece_amax2(b);
    __nv_bfloat162 amax = __hmax2(__lows2bfloat162(ma, mb), __highs2bfloat162(ma, mb));
    #pragma unroll
    for (uint32_t lanes = 8; lanes > 0; lanes /= 2)
        amax = __hmax2(amax, __shfl_xor_sync(0xffffffff, amax, lanes));
    return __bfloat1622float2(__hmax2(amax, __float2bfloat162_rn(0.0f)));
}

// A piece's eight values times `inv` (1 / scale) as e4m3, to `dst` (8 bytes).
__device__ __forceinline__ void store_piece_fp8(const uint4& piece, float inv, uint8_t* dst) {
    float x[ptx::kBF16PerVec];
    ptx::bf16x8_to_float(piece, x);
    *reinterpret_cast<uint2*>(dst) = make_uint2(ptx::pack_e4m3x4(x[0] * inv, x[1] * inv, x[2] * inv, x[3] * inv),
                                                ptx::pack_e4m3x4(x[4] * inv, x[5] * inv, x[6] * inv, x[7] * inv));
}

// A tile in registers, as loaded (bf16): thread t holds columns 8 (t % 16) .. + 8 of rows
// t / 16 + 16 i, i < 8 (piece i).
struct TileRegs {
    uint4 raw[kNumPasses];

    __device__ __forceinline__ static uint32_t row(uint32_t i) { return i * kRowsPerPass + threadIdx.x / 16; }
    __device__ __forceinline__ static uint32_t col() { return (threadIdx.x % 16) * ptx::kBF16PerVec; }
    // Where piece i lies in a [128][128] bf16 copy of the tile.
    __device__ __forceinline__ static uint32_t smem_offset(uint32_t i) { return row(i) * kTile + col(); }

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

    // `load`'s piece i into `smem` [128][128] bf16 instead of registers, by cp.async: each thread
    // copies the pieces it would load, so after its cp.async wait it may read them unsynchronized.
    __device__ __forceinline__ static void copy_piece_async(__nv_bfloat16* smem, const __nv_bfloat16* src,
                                                            uint64_t ld, uint32_t num_rows, uint32_t i) {
        const bool valid = row(i) < num_rows;
        ptx::cp_async_16(smem + smem_offset(i), src + (valid ? row(i) : 0) * ld + col(), valid);
    }

    // The amax of the warp's share of the tile (its 32 lanes' pieces of every pass); the lanes agree.
    __device__ __forceinline__ float warp_amax() const {
        __nv_bfloat162 amax = piece_amax2(raw[0]);
        #pragma unroll
        for (uint32_t i = 1; i < kNumPasses; ++i)
            amax = __hmax2(amax, piece_amax2(raw[i]));
        amax = __hmax2(amax, __lowhigh2highlow(amax));
        #pragma unroll
        for (uint32_t lanes = 16; lanes > 0; lanes /= 2)
            amax = __hmax2(amax, __shfl_xor_sync(0xffffffff, amax, lanes));
        return __low2float(__hmax2(amax, __float2bfloat162_rn(0.0f)));
    }

    // Row(i)'s eight values times `inv` (1 / scale) as e4m3, to `dst` (8 bytes).
    __device__ __forceinline__ void store_fp8(uint32_t i, float inv, uint8_t* dst) const {
        store_piece_fp8(raw[i], inv, dst);
    }

    // The tile into `smem` [128][128] bf16, for column reads.
    __device__ __forceinline__ void to_smem(__nv_bfloat16* smem) const {
        #pragma unroll
        for (uint32_t i = 0; i < kNumPasses; ++i)
            ptx::st_shared_v4(smem + smem_offset(i), raw[i]);
    }
};

// A tile's transposed e4m3 copy in shared memory, [128][128] bytes, so that it leaves in whole
// 128-byte rows (eight threads a row) instead of 16 bytes to each of 32 rows a warp store. Row c's
// 16-byte chunk j lies at chunk j ^ (c / 2 % 8): ColumnPair's threads, two rows apart, then write
// to distinct banks.
struct TransposedStage {
    static constexpr uint32_t kBytes = kTile * kTile;

    __device__ __forceinline__ static uint32_t offset(uint32_t row, uint32_t chunk) {
        return row * kTile + (chunk ^ (row / 2 % 8)) * 16;
    }

    // The staged tile to dst (row c at dst + c * ld). Every thread of the CTA calls it, after a
    // CTA barrier behind the staging.
    __device__ __forceinline__ static void store(const uint8_t* stage, uint8_t* dst, uint64_t ld) {
        #pragma unroll
        for (uint32_t i = threadIdx.x; i < kTile * kTile / 16; i += kNumThreads) {
            const uint32_t row = i / 8, chunk = i % 8;
            *reinterpret_cast<uint4*>(dst + row * ld + chunk * 16) = ptx::ld_shared_v4(stage + offset(row, chunk));
        }
    }
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

    // amax over the kRows rows of each column: (column col(), column col() + 1). In bf16 pairs (one
    // max a pair, exact: the values are bf16; a NaN is passed over, as fmaxf does).
    __device__ __forceinline__ float2 amax() const {
        __nv_bfloat162 m = __float2bfloat162_rn(0.0f);
        #pragma unroll
        for (uint32_t r = 0; r < kRows; ++r)
            m = __hmax2(m, __habs2(x[r]));
        return __bfloat1622float2(m);
    }

    // Column `which` (0: col(), 1: col() + 1), its kRows values times `inv` (1 / scale) as e4m3,
    // into a transposed tile in shared memory (`TransposedStage`): column c is its row c.
    __device__ __forceinline__ void stage_fp8(uint32_t which, float inv, uint8_t* stage) const {
        const uint32_t c = col() + which;
        #pragma unroll
        for (uint32_t r = 0; r < kRows; r += 16)
            ptx::st_shared_v4(stage + TransposedStage::offset(c, (first_row() + r) / 16), packed_fp8(which, inv, r));
    }

private:
    // Rows r .. r + 16 of column `which`, times `inv`, as 16 e4m3 bytes.
    __device__ __forceinline__ uint4 packed_fp8(uint32_t which, float inv, uint32_t r) const {
        uint4 out;
        uint32_t* words = reinterpret_cast<uint32_t*>(&out);
        #pragma unroll
        for (uint32_t w = 0; w < 4; ++w) {
            float v[4];
            #pragma unroll
            for (uint32_t j = 0; j < 4; ++j) {
                const float2 pair = ptx::bf16x2_to_float2(x[r + 4 * w + j]);
                v[j] = (which == 0 ? pair.x : pair.y) * inv;
            }
            words[w] = ptx::pack_e4m3x4(v[0], v[1], v[2], v[3]);
        }
        return out;
    }
};


// Row r's piece (of TileRegs' layout), if r < num_rows, times `inv` (1 / scale) as e4m3 to
// q + r * ld, the scale to scales[r].
__device__ __forceinline__ void store_scaled_row_fp8(const uint4& piece, float scale, float inv, uint32_t r,
                                                     uint32_t num_rows, uint8_t* q, uint64_t ld, float* scales) {
    if (r < num_rows) {
        store_piece_fp8(piece, inv, q + r * ld + TileRegs::col());
        if (threadIdx.x % 16 == 0)
            scales[r] = scale;
    }
}

// Two row pieces quantized per 1 x 128, their amax in one shuffle chain: piece j of row rows[j] to
// q[j], its scale to scales[j] (store_scaled_row_fp8). Every lane of the warp calls it (the row
// amax is a full-warp shuffle).
template <typename ScaleRule>
__device__ __forceinline__ void store_row_pair_fp8(const uint4 (&pieces)[2], const uint32_t (&rows)[2],
                                                   uint32_t num_rows, uint8_t* const (&q)[2], uint64_t ld,
                                                   float* const (&scales)[2]) {
    const float2 amax = row_amax2(pieces[0], pieces[1]);
    const float scale[2] = {ScaleRule::of(amax.x), ScaleRule::of(amax.y)};
    #pragma unroll
    for (uint32_t j = 0; j < 2; ++j)
        store_scaled_row_fp8(pieces[j], scale[j], ptx::reciprocal_of_scale(scale[j]), rows[j], num_rows, q[j], ld,
                             scales[j]);
}

// Rows r < num_rows of the tile quantized per 1 x 128 (two rows a shuffle chain): row r to q + r * ld
// (128 bytes), its scale to scales[r]. The reciprocal is `__frcp_rn` (the same bits as
// reciprocal_of_scale): with the short form, ptxas under the activations' kernel's 64 registers
// loads its gathered rows' indices one after another, slower (docs/PERF.md, "Decisions": FP8
// quantization grids). Every thread of the CTA calls it.
template <typename ScaleRule>
__device__ __forceinline__ void store_rows_fp8(const TileRegs& regs, uint32_t num_rows, uint8_t* q, uint64_t ld,
                                               float* scales) {
    static_assert(kNumPasses % 2 == 0, "passes go in pairs");
    #pragma unroll
    for (uint32_t i = 0; i < kNumPasses; i += 2) {
        const float2 amax = row_amax2(regs.raw[i], regs.raw[i + 1]);
        const float scale[2] = {ScaleRule::of(amax.x), ScaleRule::of(amax.y)};
        #pragma unroll
        for (uint32_t j = 0; j < 2; ++j)
            store_scaled_row_fp8(regs.raw[i + j], scale[j], __frcp_rn(scale[j]), TileRegs::row(i + j), num_rows, q, ld,
                                 scales);
    }
}

// Shared memory of the column quantization: the tile, and each quarter's column amax.
struct ColumnSmem {
    __nv_bfloat16 tile[kTile * kTile];
    float col_amax[kNumThreads / 64][kTile];
};
static_assert(sizeof(ColumnSmem) % 16 == 0, "arrays of them keep each tile 16-byte aligned for 16-byte copies");

// A tile's column quantization in two halves, between which the CTA syncs: this thread's
// columns' amax over its quarter of the rows, into smem.col_amax ...
__device__ __forceinline__ void column_amax_to_smem(ColumnSmem& smem, const ColumnPair& cols) {
    const float2 mine = cols.amax();
    smem.col_amax[threadIdx.x / 64][ColumnPair::col()] = mine.x;
    smem.col_amax[threadIdx.x / 64][ColumnPair::col() + 1] = mine.y;
}

// ... then the quarters' amax combined, and the columns quantized into `stage` (a
// TransposedStage), their scales to scales[c] for column c.
template <typename ScaleRule>
__device__ __forceinline__ void stage_columns_with_amax(const ColumnSmem& smem, const ColumnPair& cols, uint8_t* stage,
                                                        float* scales) {
    float amax[2] = {0.0f, 0.0f};
    #pragma unroll
    for (uint32_t j = 0; j < kNumThreads / 64; ++j)
        amax[0] = fmaxf(amax[0], smem.col_amax[j][ColumnPair::col()]),
        amax[1] = fmaxf(amax[1], smem.col_amax[j][ColumnPair::col() + 1]);
    const float scale[2] = {ScaleRule::of(amax[0]), ScaleRule::of(amax[1])};
    cols.stage_fp8(0, ptx::reciprocal_of_scale(scale[0]), stage);
    cols.stage_fp8(1, ptx::reciprocal_of_scale(scale[1]), stage);
    if (threadIdx.x / 64 == 0)
        *reinterpret_cast<float2*>(scales + ColumnPair::col()) = make_float2(scale[0], scale[1]);
}

// Where a tile's transposed column copy goes: column c to qt + c * ld, its scale to scales[c].
struct ColumnDst {
    uint8_t* qt;
    float* scales;
};

// The columns of the kNum tiles in tiles[t].tile (written by any of the CTA's threads before the
// call) quantized per 128 x 1 and transposed, to dst(t) (a ColumnDst; 128 bytes a column). Each
// tile is read from shared memory twice (for its amax, then to quantize it) rather than synced
// over three times each; the copies leave through two TransposedStages in the last tile's memory
// (free once every thread holds its columns), two tiles at a time. Every thread of the CTA calls
// it; the tiles are free again when it returns.
template <typename ScaleRule, uint32_t kNum, typename Dst>
__device__ __forceinline__ void store_smem_columns_fp8(ColumnSmem* tiles, uint64_t ld, const Dst& dst) {
    static_assert(sizeof(ColumnSmem::tile) >= 2 * TransposedStage::kBytes, "a tile's memory holds two stages");
    __syncthreads();
    ColumnPair cols;
    #pragma unroll
    for (uint32_t t = 0; t < kNum; ++t) {
        cols.load(tiles[t].tile);
        column_amax_to_smem(tiles[t], cols);
    }
    __syncthreads();
    uint8_t* stages = reinterpret_cast<uint8_t*>(tiles[kNum - 1].tile);
    #pragma unroll
    for (uint32_t t = kNum; t > 0; t = t > 2 ? t - 2 : 0) {  // tiles t - 1 and t - 2
        #pragma unroll
        for (uint32_t s = 0; s < 2 && s < t; ++s) {
            if (t - 1 - s + 1 < kNum)  // (the last tile's columns are still in registers)
                cols.load(tiles[t - 1 - s].tile);
            stage_columns_with_amax<ScaleRule>(tiles[t - 1 - s], cols, stages + s * TransposedStage::kBytes,
                                               dst(t - 1 - s).scales);
        }
        __syncthreads();
        #pragma unroll
        for (uint32_t s = 0; s < 2 && s < t; ++s)
            TransposedStage::store(stages + s * TransposedStage::kBytes, dst(t - 1 - s).qt, ld);
        __syncthreads();  // the stages (and, after the last pair, the tiles) are free
    }
}

// The tile's columns quantized per 128 x 1 and transposed, through smem (store_smem_columns_fp8):
// column c to qt + c * ld, its scale to scales[c].
template <typename ScaleRule>
__device__ __forceinline__ void store_columns_fp8(const TileRegs& regs, ColumnSmem& smem, uint8_t* qt, uint64_t ld,
                                                  float* scales) {
    regs.to_smem(smem.tile);
    store_smem_columns_fp8<ScaleRule, 1>(&smem, ld, [&](uint32_t) { return ColumnDst{qt, scales}; });
}

// padded[g] = sum over g' < g of group g' (rows offsets[g'] .. offsets[g' + 1], clamped to m) rounded
// up to 128 rows: an exclusive scan, each thread over up to kMaxGroups / kNumThreads groups. CTA 0
// also writes it to `out` for the GEMMs. Every thread calls it; `padded` is ready when it returns.
__device__ __forceinline__ void padded_offsets(const int* offsets, uint32_t num_groups, uint32_t m, int* padded,
                                               int* out) {
    __shared__ int warp_sums[kNumThreads / 32];
    constexpr uint32_t kPerThread = kMaxGroups / kNumThreads;
    const uint32_t first = threadIdx.x * kPerThread;
    int sizes[kPerThread], sum = 0;
    #pragma unroll
    for (uint32_t j = 0; j < kPerThread; ++j) {
        const uint32_t g = first + j;
        sizes[j] = 0;
        if (g < num_groups) {
            const uint32_t begin = ptx::clamped_offset(offsets, g, 0, m);
            sizes[j] = static_cast<int>(ptx::ceil_div(ptx::clamped_offset(offsets, g + 1, begin, m) - begin, kTile) * kTile);
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
        if (first + j < num_groups)
            padded[first + j] = before;
        before += sizes[j];
    }
    if (threadIdx.x == kNumThreads - 1)  // (its `before` now holds every group)
        padded[num_groups] = before;
    __syncthreads();
    if (blockIdx.x == 0) {
        for (uint32_t g = threadIdx.x; g <= num_groups; g += kNumThreads)
            out[g] = padded[g];
    }
}

// The group whose padded rows hold padded row `row` (< padded[G]): the last g with padded[g] <= row.
__device__ __forceinline__ uint32_t group_of(const int* padded, uint32_t num_groups, uint32_t row) {
    uint32_t lo = 0, hi = num_groups;  // padded[lo] <= row < padded[hi]
    while (hi - lo > 1) {
        const uint32_t mid = (lo + hi) / 2;
        if (static_cast<uint32_t>(padded[mid]) <= row)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

// The rows of padded block `block` (128 padded rows of one group): the first real row and how
// many of the 128 are real (the rest are the group's zero padding).
__device__ __forceinline__ void padded_block_rows(const int* padded, const int* offsets, uint32_t num_groups,
                                                  uint32_t m, uint32_t block, uint32_t& row_begin, uint32_t& num_rows) {
    const uint32_t g = group_of(padded, num_groups, block * kTile);
    const uint32_t begin = ptx::clamped_offset(offsets, g, 0, m), end = ptx::clamped_offset(offsets, g + 1, begin, m);
    row_begin = begin + block * kTile - padded[g];
    num_rows = min(kTile, end - min(row_begin, end));
}

}  // namespace fp8_quantize

}  // namespace deep_gemm
