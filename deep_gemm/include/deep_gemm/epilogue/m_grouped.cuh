#pragma once
// Epilogue policies of the m-grouped GEMMs: how a math warpgroup's 64 x BLOCK_N accumulators
// leave. A policy gives
//   Columns          which columns of D a tile holds, as the B rows its loads read;
//   kStagingBytes    shared memory per warpgroup (a multiple of 1024, the swizzle's alignment);
//   prefetch(p)      its tensor maps, once per CTA by one thread;
//   store(acc, p, rows, staging, barrier_id)   one tile's share (`barrier_id`: a named barrier
//                    of this warpgroup's 128 threads);
//   drain()          before the kernel exits: bulk stores still in flight.
// Params are the kernel's: d, n, tensor_map_d (and act, tensor_map_act for SwiGLU).
#include <cstdint>
#include <cuda_bf16.h>
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
    ptx::ceil_div(StagedBF16<BLOCK_N>::kBytesPerWarpgroup > SwizzledStaging<__nv_bfloat16>::kBytesPerWarpgroup
                      ? StagedBF16<BLOCK_N>::kBytesPerWarpgroup
                      : SwizzledStaging<__nv_bfloat16>::kBytesPerWarpgroup,
                  1024u) * 1024;

// Before a synchronous store: the staging may still feed the warpgroup's earlier tensor stores.
__device__ __forceinline__ void wait_staging_free(uint32_t barrier_id) {
    if (threadIdx.x % 128 == 0)
        ptx::bulk_wait_group_read<0>();
    ptx::named_barrier_sync(barrier_id, 128);
}

// D = acc in bf16, by tensor stores that overlap the warpgroup's next tile of MMAs.
template <uint32_t BLOCK_N>
struct BF16TensorStore {
    using Columns = ContiguousColumns;
    static constexpr uint32_t kStagingBytes = kTensorStoreStagingBytes<BLOCK_N>;

    template <typename Params>
    __device__ __forceinline__ static void prefetch(const Params& p) {
        ptx::prefetch_tma_descriptor(&p.tensor_map_d);
    }

    template <typename Params>
    __device__ __forceinline__ static void store(const float (&acc)[BLOCK_N / 2], const Params& p,
                                                 const WarpgroupRows& rows, uint8_t* staging, uint32_t barrier_id) {
        if (rows.count >= 64) {
            store_tile_tma<BLOCK_N, __nv_bfloat16, false>(acc, staging, barrier_id, &p.tensor_map_d, rows.n_begin,
                                                          rows.first, 0);
        } else {
            wait_staging_free(barrier_id);
            store_bf16_staged<BLOCK_N>(acc, staging, barrier_id, p.d + static_cast<uint64_t>(rows.first) * p.n + rows.n_begin,
                                       p.n, rows.count, p.n - rows.n_begin);
        }
    }

    __device__ __forceinline__ static void drain() { drain_bulk_stores(); }
};

// The MoE's first GEMM (B = l1 [G, 2I, K], gate rows then up rows): D = h = [gate | up] and
// act = silu(gate) * up [M, I], from the fp32 accumulators, by tensor stores.
template <uint32_t BLOCK_N>
struct SwiGLUTensorStore {
    static_assert(BLOCK_N == 256, "a tile pairs 128 gate with 128 up columns");
    using Columns = GateUpColumns;
    static constexpr uint32_t kStagingBytes = kTensorStoreStagingBytes<BLOCK_N>;

    template <typename Params>
    __device__ __forceinline__ static void prefetch(const Params& p) {
        ptx::prefetch_tma_descriptor(&p.tensor_map_d);
        ptx::prefetch_tma_descriptor(&p.tensor_map_act);
    }

    // (act is computed over the gate accumulators once h is out: 64 registers fewer at the peak)
    template <typename Params>
    __device__ __forceinline__ static void store(float (&acc)[BLOCK_N / 2], const Params& p, const WarpgroupRows& rows,
                                                 uint8_t* staging, uint32_t barrier_id) {
        constexpr uint32_t kHalf = BLOCK_N / 4;  // accumulators per thread of each half
        const bool tensor_stores = rows.count >= 64;
        if (not tensor_stores)
            wait_staging_free(barrier_id);
        float (&gate)[kHalf] = *reinterpret_cast<float (*)[kHalf]>(acc);
        const float (&up)[kHalf] = *reinterpret_cast<const float (*)[kHalf]>(acc + kHalf);
        const uint32_t inter = p.n / 2, col = rows.n_begin / 2;
        __nv_bfloat16* h = p.d + static_cast<uint64_t>(rows.first) * p.n + col;
        if (tensor_stores) {
            store_tile_tma<BLOCK_N / 2, __nv_bfloat16, false>(gate, staging, barrier_id, &p.tensor_map_d, col, rows.first, 0);
            store_tile_tma<BLOCK_N / 2, __nv_bfloat16, false>(up, staging, barrier_id, &p.tensor_map_d, inter + col,
                                                              rows.first, 0);
        } else {
            store_bf16_staged<BLOCK_N / 2>(gate, staging, barrier_id, h, p.n, rows.count, BLOCK_N / 2);
            store_bf16_staged<BLOCK_N / 2>(up, staging, barrier_id, h + inter, p.n, rows.count, BLOCK_N / 2);
        }
        #pragma unroll
        for (uint32_t i = 0; i < kHalf; ++i)
            gate[i] = swiglu(gate[i], up[i]);
        if (tensor_stores) {
            store_tile_tma<BLOCK_N / 2, __nv_bfloat16, false>(gate, staging, barrier_id, &p.tensor_map_act, col,
                                                              rows.first, 0);
        } else {
            store_bf16_staged<BLOCK_N / 2>(gate, staging, barrier_id, p.act + static_cast<uint64_t>(rows.first) * inter + col,
                                           inter, rows.count, BLOCK_N / 2);
        }
    }

    __device__ __forceinline__ static void drain() { drain_bulk_stores(); }
};

}  // namespace deep_gemm::epilogue
