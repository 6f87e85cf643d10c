#pragma once
// Gathers rows into routed-row order, with a weighted copy alongside:
//   out[r] = src[row_token[r]] (skipped when out is null),
//   out_weighted[r] = row_weight[r] * src[row_token[r]]
// for the routed rows r < *num_rows. bf16, 16-byte accesses, one pass over the source rows.
#include <cstdint>
#include <cuda_bf16.h>
#include "../ptx/vec.cuh"

namespace deep_gemm {

struct MoEGatherRowsParams {
    const __nv_bfloat16* src;    // [T, H]
    const int64_t* row_token;    // [R]
    const float* row_weight;     // [R]
    __nv_bfloat16* out;          // [R, H], or null
    __nv_bfloat16* out_weighted; // [R, H]
    const int* num_rows;         // on the GPU: the routed-row count (the layout's offsets[E])
    uint32_t hidden;
};

template <uint32_t kNumThreads>
__device__ __forceinline__ void moe_gather_rows_impl(const MoEGatherRowsParams& p) {
    constexpr uint32_t kVec = ptx::kBF16PerVec;
    const uint32_t chunks_per_row = p.hidden / kVec;
    const uint64_t num_chunks = static_cast<uint64_t>(*p.num_rows) * chunks_per_row;
    for (uint64_t idx = blockIdx.x * kNumThreads + threadIdx.x; idx < num_chunks; idx += gridDim.x * kNumThreads) {
        const uint64_t row = idx / chunks_per_row, col = (idx % chunks_per_row) * kVec;
        float v[kVec], weighted[kVec];
        ptx::load_bf16x8(p.src + p.row_token[row] * p.hidden + col, v);
        const float w = p.row_weight[row];
        #pragma unroll
        for (uint32_t i = 0; i < kVec; ++i)
            weighted[i] = w * v[i];
        if (p.out != nullptr)
            ptx::store_bf16x8(p.out + row * p.hidden + col, v);
        ptx::store_bf16x8(p.out_weighted + row * p.hidden + col, weighted);
    }
}

}  // namespace deep_gemm
