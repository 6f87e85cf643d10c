#pragma once
// SwiGLU, a = silu(g) * u, and its derivative, in fp32; the SwiGLU-backward GEMM epilogue.
#include <cstdint>
#include <cuda_bf16.h>
#include "../ptx/utils.cuh"

namespace deep_gemm::epilogue {

// The approximate division is one MUFU.RCP: an IEEE `1.0f / d` calls a slow-path subroutine
// whenever d > 2^126 (x < -87), and a warp pays it if any lane does. For such d it returns 0,
// the sigmoid's limit.
__device__ __forceinline__ float sigmoid(float x) { return __fdividef(1.0f, 1.0f + __expf(-x)); }

struct SwiGLUGrad {
    float act, d_gate, d_up;
};

// Forward value and gradients given dL/da = `d_act`.
__device__ __forceinline__ SwiGLUGrad swiglu_grad(float gate, float up, float d_act) {
    const float s = sigmoid(gate), silu = gate * s;
    return {silu * up, d_act * up * s * (1.0f + gate * (1.0f - s)), d_act * silu};
}

__device__ __forceinline__ float swiglu(float gate, float up) { return gate * sigmoid(gate) * up; }

// Pulls the g, u columns `swiglu_bwd_direct` will read for a warpgroup's rows into L2 while the
// tile's MMAs run: each thread one 128-byte line per 64 columns of one half of one row.
template <uint32_t BLOCK_N>
__device__ __forceinline__ void prefetch_swiglu_bwd_inputs(const __nv_bfloat16* h, uint32_t n, uint32_t first_row,
                                                           uint32_t num_rows, uint32_t col0) {
    const uint32_t thread = threadIdx.x % 128, r = thread / 2;
    if (r >= num_rows)
        return;
    const __nv_bfloat16* half = h + static_cast<uint64_t>(first_row + r) * 2 * n + (thread % 2) * n;
    #pragma unroll
    for (uint32_t c = 0; c < BLOCK_N; c += 64) {
        if (col0 + c < n)
            asm volatile("prefetch.global.L2 [%0];" :: "l"(half + col0 + c));
    }
}

// The SwiGLU backward on a warpgroup's 64 x BLOCK_N accumulators D = dL/d(act) (before the
// routing weight w), rows from `first_row` (the first `num_rows` exist), columns from `col0` of
// N: reads g, u from h [*, 2N] (gate columns, then up), writes dz = d[g | u] of w * D over them,
// w * act into act_weighted [*, N], and <D, act> over these columns into
// row_dw_part[row, col0 / BLOCK_N]. Each thread reads and writes its own accumulators' bf16
// pairs in place (layout: mma/wgmma_bf16.cuh), `kBatch` column groups of loads in flight (L2
// hits after `prefetch_swiglu_bwd_inputs`).
template <uint32_t BLOCK_N>
__device__ __forceinline__ void swiglu_bwd_direct(const float (&acc)[BLOCK_N / 2], __nv_bfloat16* h,
                                                  __nv_bfloat16* act_weighted, const float* row_weight,
                                                  float* row_dw_part, uint32_t n, uint32_t first_row,
                                                  uint32_t num_rows, uint32_t col0) {
    constexpr uint32_t kBatch = 8;  // more spills at BLOCK_N = 256 (168 registers at compile time)
    const uint32_t lane = ptx::lane_idx(), num_n_tiles = (n + BLOCK_N - 1) / BLOCK_N;
    #pragma unroll
    for (uint32_t half = 0; half < 2; ++half) {
        const uint32_t r = ((threadIdx.x % 128) / 32) * 16 + lane / 4 + half * 8;
        const bool row_ok = r < num_rows;
        const uint64_t row = first_row + r;
        const float w = row_ok ? row_weight[row] : 0.0f;
        __nv_bfloat16* h_row = h + row * 2 * n;
        float dot = 0.0f;
        #pragma unroll
        for (uint32_t j0 = 0; j0 < BLOCK_N / 8; j0 += kBatch) {
            uint32_t gate2[kBatch], up2[kBatch];
            #pragma unroll
            for (uint32_t b = 0; b < kBatch; ++b) {
                const uint32_t c = col0 + (j0 + b) * 8 + (lane % 4) * 2;
                if (row_ok and c < n) {
                    gate2[b] = *reinterpret_cast<const uint32_t*>(h_row + c);
                    up2[b] = *reinterpret_cast<const uint32_t*>(h_row + n + c);
                }
            }
            #pragma unroll
            for (uint32_t b = 0; b < kBatch; ++b) {
                const uint32_t c = col0 + (j0 + b) * 8 + (lane % 4) * 2;
                if (not (row_ok and c < n))
                    continue;
                const float2 gate = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&gate2[b]));
                const float2 up = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&up2[b]));
                const uint32_t i = (j0 + b) * 4 + half * 2;
                const SwiGLUGrad g0 = swiglu_grad(gate.x, up.x, w * acc[i]);
                const SwiGLUGrad g1 = swiglu_grad(gate.y, up.y, w * acc[i + 1]);
                dot += acc[i] * g0.act;
                dot += acc[i + 1] * g1.act;
                *reinterpret_cast<uint32_t*>(h_row + c) = ptx::pack_bf16x2(g0.d_gate, g1.d_gate);
                *reinterpret_cast<uint32_t*>(h_row + n + c) = ptx::pack_bf16x2(g0.d_up, g1.d_up);
                *reinterpret_cast<uint32_t*>(act_weighted + row * n + c) = ptx::pack_bf16x2(w * g0.act, w * g1.act);
            }
        }
        // The four lanes holding a row's columns, in a fixed order.
        dot += __shfl_xor_sync(0xffffffff, dot, 1);
        dot += __shfl_xor_sync(0xffffffff, dot, 2);
        if (row_ok and lane % 4 == 0)
            row_dw_part[row * num_n_tiles + col0 / BLOCK_N] = dot;
    }
}

}  // namespace deep_gemm::epilogue
