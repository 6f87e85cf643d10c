#pragma once
// Epilogue policies of the k-grouped GEMM (weight gradients): how a math warpgroup's 64 x BLOCK_N
// accumulators of one group's output D[g] [M, N] leave, written over D or added to it. A policy
// gives
//   kAccumulates     D += acc (an empty group then leaves D[g] as it is) rather than D = acc;
//   kOutBytes        bytes of one element of D;
//   kStagingBytes    shared memory per warpgroup;
//   prefetch(p)      its tensor maps, once per CTA by one thread;
//   store(acc, p, group, row, n_begin, staging, barrier_id)   rows from `row` of D[group], which
//                    may reach past M (those are not written);
//   drain()          before the kernel exits: bulk stores still in flight.
// Params are the kernel's: d, m, n, tensor_map_d.
#include <cstdint>
#include <type_traits>
#include "../ptx/tma.cuh"
#include "store.cuh"

namespace deep_gemm::epilogue {

enum class Output { kOverwrite, kAccumulate };

// One tensor store (or reduce-add, fp32 only) per 128-byte column chunk, staged in
// kNumBuffers swizzled buffers: more keep more of a tile in flight while the next one computes,
// at the cost of pipeline stages.
template <uint32_t BLOCK_N, typename OutT, Output kOutput, uint32_t kNumBuffers>
struct TensorStores {
    static constexpr bool kAccumulates = kOutput == Output::kAccumulate;
    static constexpr uint32_t kOutBytes = sizeof(OutT);
    static_assert(not kAccumulates or std::is_same_v<OutT, float>, "tensor reduce-adds are used for fp32 only");
    static constexpr uint32_t kStagingBytes = SwizzledStaging<OutT, kNumBuffers>::kBytesPerWarpgroup;

    template <typename Params>
    __device__ __forceinline__ static void prefetch(const Params& p) {
        ptx::prefetch_tma_descriptor(&p.tensor_map_d);
    }

    template <typename Params>
    __device__ __forceinline__ static void store(const float (&acc)[BLOCK_N / 2], const Params& p, uint32_t group,
                                                 uint32_t row, uint32_t n_begin, uint8_t* staging, uint32_t barrier_id) {
        store_tile_tma<BLOCK_N, OutT, kAccumulates, kNumBuffers>(acc, staging, barrier_id, &p.tensor_map_d, n_begin, row,
                                                                 group);
    }

    __device__ __forceinline__ static void drain() { drain_bulk_stores(); }
};

// One 1-D bulk copy (or bulk reduce-add) per row and column chunk: the accumulating bf16
// output, which tensor reduce-adds do not serve here.
template <uint32_t BLOCK_N, typename OutT, Output kOutput>
struct RowCopies {
    static constexpr bool kAccumulates = kOutput == Output::kAccumulate;
    static constexpr uint32_t kOutBytes = sizeof(OutT);
    static constexpr uint32_t kStagingBytes = RowStaging<BLOCK_N, OutT>::kBytesPerWarpgroup;

    template <typename Params>
    __device__ __forceinline__ static void prefetch(const Params&) {}

    template <typename Params>
    __device__ __forceinline__ static void store(const float (&acc)[BLOCK_N / 2], const Params& p, uint32_t group,
                                                 uint32_t row, uint32_t n_begin, uint8_t* staging, uint32_t barrier_id) {
        const uint32_t valid_rows = row < p.m ? p.m - row : 0;
        OutT* d = static_cast<OutT*>(p.d) + (static_cast<uint64_t>(group) * p.m + min(row, p.m)) * p.n + n_begin;
        store_rows_async<BLOCK_N, OutT, kAccumulates>(acc, staging, barrier_id, d, p.n, valid_rows, p.n - n_begin);
    }

    __device__ __forceinline__ static void drain() { drain_bulk_stores(); }
};

}  // namespace deep_gemm::epilogue
