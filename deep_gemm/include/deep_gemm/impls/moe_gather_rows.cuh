#pragma once
// The routed rows of a token matrix, copied in routed-row order:
//   out[r] = src[row_token[r]]   for r < *num_rows (rows of empty slots are left unwritten)
// so that the copy costs only the rows the GEMMs read (with expert parallelism most slots of
// a received token belong to other ranks). One warp per row, 16-byte accesses.
#include <cstdint>
#include <cuda_bf16.h>
#include "../ptx/vec.cuh"

namespace deep_gemm {

struct MoEGatherRowsParams {
    const __nv_bfloat16* src;   // [T, H]
    const int64_t* row_token;   // [R]
    __nv_bfloat16* out;         // [R, H]
    const int* num_rows;        // on the GPU: the routed-row count (the layout's offsets[E])
    uint32_t hidden;
};

template <uint32_t kNumThreads>
struct MoEGatherRows {
    __device__ __forceinline__ static void run(const MoEGatherRowsParams& p) {
        constexpr uint32_t kWarps = kNumThreads / 32;
        const uint32_t lane = threadIdx.x % 32, num_vecs = p.hidden / 8, num_rows = *p.num_rows;
        for (uint32_t r = blockIdx.x * kWarps + threadIdx.x / 32; r < num_rows; r += gridDim.x * kWarps) {
            ptx::copy_row_warp(reinterpret_cast<const uint4*>(p.src + p.row_token[r] * p.hidden),
                               reinterpret_cast<uint4*>(p.out + static_cast<uint64_t>(r) * p.hidden), num_vecs, lane);
        }
    }
};

}  // namespace deep_gemm
