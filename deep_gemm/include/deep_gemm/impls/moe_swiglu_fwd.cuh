#pragma once
// act[r] = silu(h[r, :I]) * h[r, I:] for the routed rows r < *num_rows (rows of empty slots,
// past the last expert, are skipped). bf16 in and out, fp32 math, 16-byte accesses.
#include <cstdint>
#include <cuda_bf16.h>
#include "../epilogue/activation.cuh"
#include "../ptx/vec.cuh"

namespace deep_gemm {

struct MoESwiGLUFwdParams {
    const int* num_rows;     // on the GPU: the routed-row count (the layout's offsets[E])
    const __nv_bfloat16* h;  // [R, 2I]: gate | up
    __nv_bfloat16* act;      // [R, I]
    uint32_t inter;
};

template <uint32_t kNumThreads>
struct MoESwiGLUFwd {
    __device__ __forceinline__ static void run(const MoESwiGLUFwdParams& p) {
        constexpr uint32_t kVec = ptx::kBF16PerVec;
        const uint32_t chunks_per_row = p.inter / kVec;
        const uint64_t num_chunks = static_cast<uint64_t>(*p.num_rows) * chunks_per_row;
        for (uint64_t idx = blockIdx.x * kNumThreads + threadIdx.x; idx < num_chunks; idx += gridDim.x * kNumThreads) {
            const uint64_t row = idx / chunks_per_row, col = (idx % chunks_per_row) * kVec;
            float gate[kVec], up[kVec], act[kVec];
            ptx::load_bf16x8(p.h + row * 2 * p.inter + col, gate);
            ptx::load_bf16x8(p.h + row * 2 * p.inter + p.inter + col, up);
            #pragma unroll
            for (uint32_t i = 0; i < kVec; ++i)
                act[i] = epilogue::swiglu(gate[i], up[i]);
            ptx::store_bf16x8(p.act + row * p.inter + col, act);
        }
    }
};

}  // namespace deep_gemm
