#pragma once
// Expert-parallel token exchange over NVLink: rows pushed into other ranks' symmetric buffers
// through their peer addresses (the built-in path's dispatch and combine). For each i < n:
//   r = src_row[i] (i when null); dst_rows[dst_rank[i]][dst_row[i]] = src[r]   (H bf16)
// and, when given, `f32_cols` fp32 and `i32_cols` int32 values of row r of `f32` / `i32`
// written alongside at row dst_row[i] of the ranks' `dst_f32` / `dst_i32` regions. Entries
// with dst_row < 0, or i >= *num_valid when given, are skipped; without `src` only the fp32 /
// int32 values move. One warp per entry, 16-byte accesses for the row.
#include <cstdint>
#include <cuda_bf16.h>
#include "../ptx/vec.cuh"

namespace deep_gemm {

struct EpPushRowsParams {
    const __nv_bfloat16* src;     // [*, H], or null
    const int64_t* src_row;       // [n], or null: row i
    const int32_t* dst_rank;      // [n]
    const int64_t* dst_row;       // [n]: row in the destination region, < 0: not sent
    const uint64_t* dst_rows;     // [world]: address of each rank's destination row region
    const float* f32;             // [*, f32_cols], or null
    const uint64_t* dst_f32;      // [world]: each rank's fp32 region ([*, f32_cols])
    const int32_t* i32;           // [*, i32_cols], or null
    const uint64_t* dst_i32;      // [world]: each rank's int32 region ([*, i32_cols])
    const int* num_valid;         // on the GPU, or null: entries i >= *num_valid are skipped
    uint32_t n, hidden, f32_cols, i32_cols;
};

template <uint32_t kNumThreads>
__device__ __forceinline__ void ep_push_rows_impl(const EpPushRowsParams& p) {
    constexpr uint32_t kWarps = kNumThreads / 32;
    const uint32_t lane = threadIdx.x % 32, num_vecs = p.hidden / 8;
    const uint32_t n = p.num_valid != nullptr ? min(p.n, static_cast<uint32_t>(max(*p.num_valid, 0))) : p.n;
    for (uint32_t i = blockIdx.x * kWarps + threadIdx.x / 32; i < n; i += gridDim.x * kWarps) {
        const int64_t row = p.dst_row[i];
        if (row < 0)
            continue;
        const int32_t rank = p.dst_rank[i];
        const int64_t src_row = p.src_row != nullptr ? p.src_row[i] : i;
        if (p.src != nullptr)
            ptx::copy_row_warp(reinterpret_cast<const uint4*>(p.src + src_row * p.hidden),
                               reinterpret_cast<uint4*>(reinterpret_cast<__nv_bfloat16*>(p.dst_rows[rank]) + row * p.hidden),
                               num_vecs, lane);
        if (p.f32 != nullptr) {
            for (uint32_t c = lane; c < p.f32_cols; c += 32)
                reinterpret_cast<float*>(p.dst_f32[rank])[row * p.f32_cols + c] = p.f32[src_row * p.f32_cols + c];
        }
        if (p.i32 != nullptr) {
            for (uint32_t c = lane; c < p.i32_cols; c += 32)
                reinterpret_cast<int32_t*>(p.dst_i32[rank])[row * p.i32_cols + c] = p.i32[src_row * p.i32_cols + c];
        }
    }
}

}  // namespace deep_gemm
