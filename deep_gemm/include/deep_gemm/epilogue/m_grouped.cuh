#pragma once
// Epilogue policies of the m-grouped GEMMs: how a math warpgroup's 64 x BLOCK_N accumulators
// leave. A policy gives
//   Columns          which columns of D a tile holds, as the B rows its loads read;
//   kStagingBytes    shared memory per warpgroup (a multiple of 1024, the swizzle's alignment);
//   prefetch(p)      its tensor maps, once per CTA by one thread;
//   store(acc, p, rows, staging, barrier_id)   one tile's share (`barrier_id`: a named barrier
//                    of this warpgroup's 128 threads);
//   drain()          before the kernel exits: bulk stores still in flight;
//   kFitsBesideProduct  store() fits the registers left beside an FP8 product in flight (the FP8
//                    kernel then runs it during the next tile's first MMAs).
// Params are the kernel's: d, n, tensor_map_d (and act, tensor_map_act for SwiGLU; act_fp8,
// act_scales, act_scales_ld for its e4m3 act).
#include <cstdint>
#include <cuda_bf16.h>
#include "../ptx/fp8.cuh"
#include "../ptx/tma.cuh"
#include "../ptx/utils.cuh"
#include "activation.cuh"
#include "store.cuh"

namespace deep_gemm::epilogue {

// A warpgroup's rows of a tile: `count` of its 64 rows from global row `first` lie in the group
// (fewer on a group's last tile), its columns start at `n_begin`.
struct WarpgroupRows {
    uint32_t first, count, n_begin;
};

// A tile's columns are BLOCK_N consecutive columns of D.
struct ContiguousColumns {
    static constexpr uint32_t kNumBoxes = 1;
    __device__ __forceinline__ static uint32_t box_row(uint32_t, uint32_t n_begin, uint32_t) { return n_begin; }
};

// D = [gate | up] (N = 2I): a tile holds BLOCK_N / 2 gate columns and the matching up columns,
// loaded as two boxes of B rows; accumulators [0, BLOCK_N / 4) hold the gate columns and the
// next BLOCK_N / 4 the up ones at the same positions (mma/wgmma_bf16.cuh), so each thread
// pairs them in registers.
struct GateUpColumns {
    static constexpr uint32_t kNumBoxes = 2;
    __device__ __forceinline__ static uint32_t box_row(uint32_t box, uint32_t n_begin, uint32_t n) {
        return box * (n / 2) + n_begin / 2;
    }
};

// Staging for tensor stores and, on a group's last tile, for the synchronous stores of the
// rows that end inside the warpgroup's 64 (a tensor store writes whole boxes, which would
// reach into the next group's rows).
template <uint32_t BLOCK_N>
constexpr uint32_t kTensorStoreStagingBytes =
    ptx::ceil_div(ptx::max_of(StagedBF16<BLOCK_N>::kBytesPerWarpgroup,
                              SwizzledStaging<__nv_bfloat16>::kBytesPerWarpgroup), 1024u) * 1024;

// D = acc in bf16, by tensor stores that overlap the warpgroup's next tile of MMAs. `Tma` is
// the tensor store of a full 64-row share: in batches of chunks through two buffers
// (ChunkedTma), or all at once (WholeTileTma, BLOCK_N / 64 buffers of 8 KB).
struct ChunkedTma {
    template <uint32_t BLOCK_N>
    static constexpr uint32_t kBytes = SwizzledStaging<__nv_bfloat16>::kBytesPerWarpgroup;
    template <uint32_t BLOCK_N>
    __device__ __forceinline__ static void store(const float (&acc)[BLOCK_N / 2], uint8_t* staging,
                                                 uint32_t barrier_id, const CUtensorMap* desc, uint32_t n, uint32_t m) {
        store_tile_tma<BLOCK_N, __nv_bfloat16, false>(acc, staging, barrier_id, desc, n, m, 0);
    }
};
struct WholeTileTma {
    template <uint32_t BLOCK_N>
    static constexpr uint32_t kBytes = SwizzledStaging<__nv_bfloat16, BLOCK_N / 64>::kBytesPerWarpgroup;
    template <uint32_t BLOCK_N>
    __device__ __forceinline__ static void store(const float (&acc)[BLOCK_N / 2], uint8_t* staging,
                                                 uint32_t barrier_id, const CUtensorMap* desc, uint32_t n, uint32_t m) {
        store_whole_tile_tma<BLOCK_N, __nv_bfloat16>(acc, staging, barrier_id, desc, n, m, 0);
    }
};

template <uint32_t BLOCK_N, typename Tma = ChunkedTma>
struct BF16TensorStore {
    using Columns = ContiguousColumns;
    static constexpr bool kFitsBesideProduct = true;
    static constexpr uint32_t kStagingBytes = ptx::max_of(kTensorStoreStagingBytes<BLOCK_N>, Tma::template kBytes<BLOCK_N>);

    template <typename Params>
    __device__ __forceinline__ static void prefetch(const Params& p) {
        ptx::prefetch_tma_descriptor(&p.tensor_map_d);
    }

    template <typename Params>
    __device__ __forceinline__ static void store(const float (&acc)[BLOCK_N / 2], const Params& p,
                                                 const WarpgroupRows& rows, uint8_t* staging, uint32_t barrier_id) {
        if (rows.count >= 64) {
            Tma::template store<BLOCK_N>(acc, staging, barrier_id, &p.tensor_map_d, rows.n_begin, rows.first);
        } else {
            wait_staging_free(barrier_id);
            store_bf16_staged<BLOCK_N>(acc, staging, barrier_id, p.d + static_cast<uint64_t>(rows.first) * p.n + rows.n_begin,
                                       p.n, rows.count, p.n - rows.n_begin);
        }
    }

    __device__ __forceinline__ static void drain() { drain_bulk_stores(); }
};

// The MoE's first GEMM (B = l1 [G, 2I, K], gate rows then up rows): D = h = [gate | up] and
// act = silu(gate) * up [M, I], from the fp32 accumulators, by tensor stores. Both SwiGLU
// epilogues stage by PairStores (docs/PERF.md, "Decisions": m-grouped epilogue).
template <uint32_t BLOCK_N>
struct SwiGLUTensorStore {
    static_assert(BLOCK_N == 256, "a tile pairs 128 gate with 128 up columns");
    using Columns = GateUpColumns;
    static constexpr bool kFitsBesideProduct = false;  // (ptxas spills: the act's arithmetic)
    static constexpr uint32_t kStagingBytes = kTensorStoreStagingBytes<BLOCK_N>;
    static constexpr uint32_t kHalf = BLOCK_N / 4;  // accumulators per thread of each half

    template <typename Params>
    __device__ __forceinline__ static void prefetch(const Params& p) {
        ptx::prefetch_tma_descriptor(&p.tensor_map_d);
        ptx::prefetch_tma_descriptor(&p.tensor_map_act);
    }

    template <typename Params>
    __device__ __forceinline__ static void store(float (&acc)[BLOCK_N / 2], const Params& p, const WarpgroupRows& rows,
                                                 uint8_t* staging, uint32_t barrier_id) {
        const bool tensor_stores = rows.count >= 64;
        if (not tensor_stores)
            wait_staging_free(barrier_id);
        const float (&act)[kHalf] = store_h_then_swiglu(acc, p, rows, staging, barrier_id, tensor_stores);
        const uint32_t inter = p.n / 2, col = rows.n_begin / 2;
        if (tensor_stores) {
            store_tile_tma<BLOCK_N / 2, __nv_bfloat16, false, 2, PairStores>(act, staging, barrier_id,
                                                                         &p.tensor_map_act, col, rows.first, 0);
        } else {
            store_bf16_staged<BLOCK_N / 2>(act, staging, barrier_id, p.act + static_cast<uint64_t>(rows.first) * inter + col,
                                           inter, rows.count, BLOCK_N / 2);
        }
    }

    __device__ __forceinline__ static void drain() { drain_bulk_stores(); }

    // h's gate and up columns out (by tensor stores, or else synchronously for the first
    // rows.count rows, the staging free), then act = silu(gate) * up in fp32 over the gate
    // accumulators, which it returns (act once h is out: 64 registers fewer at the peak).
    template <typename Params>
    __device__ __forceinline__ static auto store_h_then_swiglu(float (&acc)[BLOCK_N / 2], const Params& p,
                                                               const WarpgroupRows& rows, uint8_t* staging,
                                                               uint32_t barrier_id, bool tensor_stores)
        -> float (&)[kHalf] {
        float (&gate)[kHalf] = *reinterpret_cast<float (*)[kHalf]>(acc);
        const float (&up)[kHalf] = *reinterpret_cast<const float (*)[kHalf]>(acc + kHalf);
        const uint32_t inter = p.n / 2, col = rows.n_begin / 2;
        __nv_bfloat16* h = p.d + static_cast<uint64_t>(rows.first) * p.n + col;
        if (tensor_stores) {
            store_tile_tma<BLOCK_N / 2, __nv_bfloat16, false, 2, PairStores>(gate, staging, barrier_id,
                                                                         &p.tensor_map_d, col, rows.first, 0);
            store_tile_tma<BLOCK_N / 2, __nv_bfloat16, false, 2, PairStores>(up, staging, barrier_id,
                                                                         &p.tensor_map_d, inter + col, rows.first, 0);
        } else {
            store_bf16_staged<BLOCK_N / 2>(gate, staging, barrier_id, h, p.n, rows.count, BLOCK_N / 2);
            store_bf16_staged<BLOCK_N / 2>(up, staging, barrier_id, h + inter, p.n, rows.count, BLOCK_N / 2);
        }
        #pragma unroll
        for (uint32_t i = 0; i < kHalf; ++i)
            gate[i] = swiglu(gate[i], up[i]);
        return gate;
    }
};

// SwiGLUTensorStore with act written as e4m3 [M, I] and one fp32 scale per 1 x 128 (act_scales
// (m, kb) at act_scales[kb * act_scales_ld + m]): a tile's 128 act columns are one scale block,
// and the 4 lanes of a quad hold its rows. Bit for bit deep_gemm.quant.fp8_quantize_rows (with
// ScaleRule) of the bf16 act SwiGLUTensorStore writes: each value rounded to bf16, the row's
// amax, ScaleRule's scale, fp8(value * (1 / scale)) with the reciprocal rounded once.
template <uint32_t BLOCK_N, typename ScaleRule>
struct SwiGLUFp8ActTensorStore : SwiGLUTensorStore<BLOCK_N> {
    static constexpr uint32_t kHalf = SwiGLUTensorStore<BLOCK_N>::kHalf;
    // A warpgroup's share is staged whole, h's four 64-column chunks then the e4m3 act, and leaves
    // by one batch of tensor stores (one fence, two barriers; docs/PERF.md, "Decisions":
    // whole-tile staging), or, on a group's last rows, by synchronous row copies from the same
    // buffers. It fits the registers beside the next tile's first product: the SwiGLU is computed
    // in the loop that rounds act, after h is staged (each up accumulator dies there).
    static constexpr bool kFitsBesideProduct = true;
    using Buffers = SwizzledStaging<__nv_bfloat16, BLOCK_N / 64 + 1>;
    static constexpr uint32_t kStagingBytes = Buffers::kBytesPerWarpgroup;
    static_assert(BLOCK_N / 2 == SwizzledStaging<uint8_t>::kChunkN, "the tile's e4m3 act columns fill one buffer");

    template <typename Params>
    __device__ __forceinline__ static void store(float (&acc)[BLOCK_N / 2], const Params& p, const WarpgroupRows& rows,
                                                 uint8_t* staging, uint32_t barrier_id) {
        constexpr uint32_t kChunkN = SwizzledStaging<__nv_bfloat16>::kChunkN, kHChunks = BLOCK_N / kChunkN;
        const auto buffer = [&](uint32_t i) { return staging + i * Buffers::kBufferBytes; };
        wait_staging_free(barrier_id);  // (the previous tile's stores, issued a mainloop ago)
        float (&gate)[kHalf] = *reinterpret_cast<float (*)[kHalf]>(acc);
        const float (&up)[kHalf] = *reinterpret_cast<const float (*)[kHalf]>(acc + kHalf);
        #pragma unroll
        for (uint32_t i = 0; i < kHChunks / 2; ++i) {  // gate's chunks in buffers 0.., then up's
            PairStores::stage<__nv_bfloat16>(gate, i, buffer(i));
            PairStores::stage<__nv_bfloat16>(up, i, buffer(kHChunks / 2 + i));
        }

        float (&act)[kHalf] = gate;
        float amax[2] = {0.0f, 0.0f};  // of this thread's two rows
        // Each pair of a row's values rounded to bf16 by one pack: the one-value conversion (F2F)
        // runs on the quarter-rate pipe the sigmoid's MUFUs keep busy (docs/PERF.md, "Decisions":
        // SwiGLU in GEMM1's epilogue). (The intrinsics, not ptx::pack_bf16x2's inline asm, with which
        // ptxas spills 816-1,048 bytes here.)
        #pragma unroll
        for (uint32_t i = 0; i < kHalf; i += 2) {
            const __nv_bfloat162 pair = __floats2bfloat162_rn(swiglu(gate[i], up[i]), swiglu(gate[i + 1], up[i + 1]));
            act[i] = __low2float(pair), act[i + 1] = __high2float(pair);
            amax[(i / 2) % 2] = fmaxf(amax[(i / 2) % 2], fmaxf(fabsf(act[i]), fabsf(act[i + 1])));
        }
        float scale[2], inv[2];
        #pragma unroll
        for (uint32_t half = 0; half < 2; ++half) {
            #pragma unroll
            for (uint32_t lanes = 1; lanes < 4; lanes *= 2)  // the quad holding the row
                amax[half] = fmaxf(amax[half], __shfl_xor_sync(0xffffffff, amax[half], lanes));
            scale[half] = ScaleRule::of(amax[half]), inv[half] = ptx::reciprocal_of_scale(scale[half]);
        }

        // Scales are a 32nd of the e4m3 bytes: direct stores, 8 lanes' rows (32 bytes) at a time.
        const uint32_t row = warpgroup_accumulator_row(), inter = p.n / 2, col = rows.n_begin / 2;
        if (ptx::lane_idx() % 4 == 0) {
            float* scales = p.act_scales + static_cast<uint64_t>(col / 128) * p.act_scales_ld + rows.first;
            #pragma unroll
            for (uint32_t half = 0; half < 2; ++half) {
                if (row + half * 8 < rows.count)
                    scales[row + half * 8] = scale[half];
            }
        }

        // The e4m3 tile, swizzled as the tensor map reads it.
        uint8_t* act_buffer = buffer(kHChunks);
        for_each_column_pair<BLOCK_N / 2>(0, [&](uint32_t r, uint32_t c, uint32_t i) {
            const float s = inv[(i / 2) % 2];
            ptx::st_shared_u16(swizzled_128b(act_buffer, r, c), ptx::pack_e4m3x2(act[i] * s, act[i + 1] * s));
        });
        ptx::fence_view_async_shared();  // a tensor store reads through the async proxy
        ptx::named_barrier_sync(barrier_id, 128);
        // h's column of buffer i (< kHChunks), and act's (buffer kHChunks)
        const auto first_column = [&](uint32_t i) {
            return i == kHChunks ? col : (i < kHChunks / 2 ? col : inter + col) + (i % (kHChunks / 2)) * kChunkN;
        };
        const uint32_t thread = threadIdx.x % 128;
        if (rows.count >= 64) {
            if (thread == 0) {
                #pragma unroll
                for (uint32_t i = 0; i < kHChunks; ++i)
                    ptx::tma_store_3d<false>(&p.tensor_map_d, buffer(i), first_column(i), rows.first, 0);
                ptx::tma_store_3d<false>(&p.tensor_map_act, act_buffer, col, rows.first, 0);
                ptx::bulk_commit_group();
            }
        } else {
            // A group's last rows: thread t copies half of row t / 2 of every buffer, 4 x 16 bytes
            // each, if the row is below rows.count (the next tile's wait_staging_free keeps the
            // staging until then).
            const uint32_t r = thread / 2, first_byte = (thread % 2) * 64;
            if (r < rows.count) {
                const uint64_t m = rows.first + r;
                #pragma unroll
                for (uint32_t i = 0; i <= kHChunks; ++i) {
                    uint8_t* dst = i == kHChunks ? p.act_fp8 + m * inter + col
                                                 : reinterpret_cast<uint8_t*>(p.d + m * p.n + first_column(i));
                    #pragma unroll
                    for (uint32_t byte = first_byte; byte < first_byte + 64; byte += 16)
                        *reinterpret_cast<uint4*>(dst + byte) = ptx::ld_shared_v4(swizzled_128b(buffer(i), r, byte));
                }
            }
        }
    }
};

}  // namespace deep_gemm::epilogue
