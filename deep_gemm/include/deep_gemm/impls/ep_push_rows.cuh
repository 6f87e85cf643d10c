#pragma once
// Expert-parallel token exchange over NVLink: rows pushed into other ranks' symmetric buffers
// through their peer addresses (the built-in path's dispatch and combine).
//   dst_rows[dst_rank[i]][dst_row[i]] = src[src_row[i]]   (H bf16; src_row = i when null)
// with an optional fp32 and int32 value per row written alongside. Rows with dst_row < 0, or
// i >= *num_valid when given, are skipped. One warp per row, 16-byte accesses.
#include <cstdint>
#include <cuda_bf16.h>

namespace deep_gemm {

struct EpPushRowsParams {
    const __nv_bfloat16* src;     // [*, H]
    const int64_t* src_row;       // [n], or null: row i
    const int32_t* dst_rank;      // [n]
    const int64_t* dst_row;       // [n]: row in the destination region, < 0: not sent
    const uint64_t* dst_rows;     // [world]: address of each rank's destination row region
    const float* f32;             // [n], or null
    const uint64_t* dst_f32;      // [world]: each rank's fp32 region, indexed by dst_row
    const int32_t* i32;           // [n], or null
    const uint64_t* dst_i32;      // [world]: each rank's int32 region, indexed by dst_row
    const int* num_valid;         // on the GPU, or null: rows i >= *num_valid are skipped
    uint32_t n, hidden;
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
        const auto* from = reinterpret_cast<const uint4*>(p.src + src_row * p.hidden);
        auto* to = reinterpret_cast<uint4*>(reinterpret_cast<__nv_bfloat16*>(p.dst_rows[rank]) + row * p.hidden);
        for (uint32_t v = lane; v < num_vecs; v += 32)
            to[v] = __ldg(from + v);
        if (lane == 0 and p.f32 != nullptr)
            reinterpret_cast<float*>(p.dst_f32[rank])[row] = p.f32[i];
        if (lane == 0 and p.i32 != nullptr)
            reinterpret_cast<int32_t*>(p.dst_i32[rank])[row] = p.i32[i];
    }
}

}  // namespace deep_gemm
