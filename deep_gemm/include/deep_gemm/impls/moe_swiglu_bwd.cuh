#pragma once
// The MoE backward between its two data-gradient GEMMs, one pass per routed row r:
//   act = silu(g) * u                    (recomputed from h = [g | u])
//   act_weighted[r] = w[r] * act         (dl2's operand: dl2[e] = dy_e^T @ act_weighted_e)
//   row_dw[r] = <d_act[r], act>          (the routing-weight gradient of the row)
//   dz[r] = d[g | u] of w[r] * <d_act, act>  (SwiGLU backward of the weighted gradient)
// Rows of empty slots (r >= *num_rows) are skipped. One CTA per row at a time; the row sum
// is reduced in a fixed order (deterministic).
#include <cstdint>
#include <cuda_bf16.h>
#include "../epilogue/activation.cuh"
#include "../ptx/vec.cuh"

namespace deep_gemm {

struct MoESwiGLUBwdParams {
    const __nv_bfloat16* h;      // [R, 2I]
    const __nv_bfloat16* d_act;  // [R, I]: dy @ l2[e], before the routing weight
    const float* row_weight;     // [R]
    __nv_bfloat16* dz;           // [R, 2I]
    __nv_bfloat16* act_weighted; // [R, I]
    float* row_dw;               // [R]
    const int* num_rows;         // on the GPU: the routed-row count (the layout's offsets[E])
    uint32_t inter;
};

template <uint32_t kNumThreads>
struct MoESwiGLUBwd {
    __device__ __forceinline__ static void run(const MoESwiGLUBwdParams& p) {
        constexpr uint32_t kVec = ptx::kBF16PerVec, kNumWarps = kNumThreads / 32;
        __shared__ float warp_sums[kNumWarps];
        const uint32_t num_rows = *p.num_rows, chunks_per_row = p.inter / kVec;
        for (uint32_t row = blockIdx.x; row < num_rows; row += gridDim.x) {
            const uint64_t h_row = static_cast<uint64_t>(row) * 2 * p.inter, a_row = static_cast<uint64_t>(row) * p.inter;
            const float w = p.row_weight[row];
            float dot = 0.0f;
            for (uint32_t chunk = threadIdx.x; chunk < chunks_per_row; chunk += kNumThreads) {
                const uint32_t col = chunk * kVec;
                float gate[kVec], up[kVec], d_act[kVec], act[kVec], d_gate[kVec], d_up[kVec];
                ptx::load_bf16x8(p.h + h_row + col, gate);
                ptx::load_bf16x8(p.h + h_row + p.inter + col, up);
                ptx::load_bf16x8(p.d_act + a_row + col, d_act);
                #pragma unroll
                for (uint32_t i = 0; i < kVec; ++i) {
                    const epilogue::SwiGLUGrad g = epilogue::swiglu_grad(gate[i], up[i], w * d_act[i]);
                    act[i] = w * g.act, d_gate[i] = g.d_gate, d_up[i] = g.d_up;
                    dot += d_act[i] * g.act;
                }
                ptx::store_bf16x8(p.act_weighted + a_row + col, act);
                ptx::store_bf16x8(p.dz + h_row + col, d_gate);
                ptx::store_bf16x8(p.dz + h_row + p.inter + col, d_up);
            }
            #pragma unroll
            for (uint32_t offset = 16; offset > 0; offset /= 2)
                dot += __shfl_xor_sync(0xffffffff, dot, offset);
            if (threadIdx.x % 32 == 0)
                warp_sums[threadIdx.x / 32] = dot;
            __syncthreads();
            if (threadIdx.x == 0) {
                float sum = 0.0f;
                #pragma unroll
                for (uint32_t i = 0; i < kNumWarps; ++i)
                    sum += warp_sums[i];
                p.row_dw[row] = sum;
            }
            __syncthreads();
        }
    }
};

}  // namespace deep_gemm
