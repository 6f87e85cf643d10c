#pragma once
// The FP8 MoE backward between its two data-gradient GEMMs: impls/moe_swiglu_bwd.cuh's SwiGLU
// backward with its outputs quantized in the same pass, in the forms the FP8 GEMMs read:
//   dz rows               [R, 2I] e4m3, one scale per 1 x 128       (dx's GEMM)
//   dz columns            [2I, Rp] e4m3, 128 x 1 per expert's rows  (dl1's)
//   act_weighted columns  [I, Rp] e4m3, 128 x 1 per expert's rows   (dl2's)
//   row_dw                [R] fp32, <d_act, act> of each row
// Every value is rounded to bf16 before it is quantized, so that the FP8 outputs equal those of
// impls/fp8_quantize.cuh applied to the bf16 kernel's dz and act_weighted, bit for bit; neither
// bf16 tensor is written. CTAs walk the 128-row blocks of the experts' padded rows (rows past an
// expert's end read as zeros, so the column copies' padding is zeros), each block's I / 128
// column blocks in turn, keeping the rows' <d_act, act> in registers across them.
#include <cstdint>
#include <cuda_bf16.h>
#include "../epilogue/activation.cuh"
#include "../quant/tiles.cuh"

namespace deep_gemm {

struct MoESwiGLUBwdFp8Params {
    const __nv_bfloat16* h;      // [R, 2I]: [gate | up]
    const __nv_bfloat16* d_act;  // [R, I]: dy @ l2[e], before the routing weight
    const float* row_weight;     // [R]
    const int* offsets;          // [E + 1]: expert e's rows are offsets[e] .. offsets[e + 1]
    uint8_t* dz_q;               // [R, 2I]
    float* dz_scales;            // [2I / 128][scales_ld]: dz_scales[kb * scales_ld + r]
    uint8_t* dz_qt;              // [2I, mp]: column p of expert e is its row p - padded[e]
    float* dz_scales_t;          // [mp / 128, 2I]
    uint8_t* act_qt;             // [I, mp]
    float* act_scales_t;         // [mp / 128, I]
    int* padded_offsets;         // [E + 1]: expert e's columns of the copies, multiples of 128
    float* row_dw;               // [R]
    uint32_t m, inter, num_groups, scales_ld, mp;
};

template <typename ScaleRule>
struct MoESwiGLUBwdFp8 {
    static constexpr uint32_t kNumThreads = fp8_quantize::kNumThreads;

    __device__ __forceinline__ static void run(const MoESwiGLUBwdFp8Params& p) {
        using namespace fp8_quantize;
        __shared__ __align__(16) ColumnSmem column_smem;
        __shared__ int padded[kMaxGroups + 1];
        padded_offsets(p.offsets, p.num_groups, p.m, padded, p.padded_offsets);

        const uint32_t num_blocks = static_cast<uint32_t>(padded[p.num_groups]) / kTile;
        const uint32_t num_k_blocks = p.inter / kTile;
        const uint64_t h_ld = 2 * static_cast<uint64_t>(p.inter);
        for (uint32_t block = blockIdx.x; block < num_blocks; block += gridDim.x) {
            uint32_t row_begin, num_rows;
            padded_block_rows(padded, p.offsets, p.num_groups, p.m, block, row_begin, num_rows);
            float weight[kNumPasses], dot[kNumPasses];
            #pragma unroll
            for (uint32_t i = 0; i < kNumPasses; ++i) {
                const uint32_t r = TileRegs::row(i);
                weight[i] = r < num_rows ? __ldg(p.row_weight + row_begin + r) : 0.0f;
                dot[i] = 0.0f;
            }
            for (uint32_t kb = 0; kb < num_k_blocks; ++kb) {
                // gate, up and d_act in, dz's two halves and act_weighted out, in the same registers
                TileRegs gate, up, d_act;
                const __nv_bfloat16* h = p.h + row_begin * h_ld + kb * kTile;
                gate.load(h, h_ld, num_rows);
                up.load(h + p.inter, h_ld, num_rows);
                d_act.load(p.d_act + static_cast<uint64_t>(row_begin) * p.inter + kb * kTile, p.inter, num_rows);
                #pragma unroll
                for (uint32_t i = 0; i < kNumPasses; ++i) {
                    float g[ptx::kBF16PerVec], u[ptx::kBF16PerVec], da[ptx::kBF16PerVec];
                    ptx::bf16x8_to_float(gate.raw[i], g);
                    ptx::bf16x8_to_float(up.raw[i], u);
                    ptx::bf16x8_to_float(d_act.raw[i], da);
                    #pragma unroll
                    for (uint32_t j = 0; j < ptx::kBF16PerVec; ++j) {  // (moe_swiglu_bwd.cuh's arithmetic)
                        const epilogue::SwiGLUGrad s = epilogue::swiglu_grad(g[j], u[j], weight[i] * da[j]);
                        dot[i] += da[j] * s.act;
                        g[j] = s.d_gate, u[j] = s.d_up, da[j] = weight[i] * s.act;
                    }
                    gate.raw[i] = ptx::float_to_bf16x8(g);
                    up.raw[i] = ptx::float_to_bf16x8(u);
                    d_act.raw[i] = ptx::float_to_bf16x8(da);
                }
                uint8_t* dz_rows = p.dz_q + row_begin * h_ld + kb * kTile;
                float* dz_row_scales = p.dz_scales + static_cast<uint64_t>(kb) * p.scales_ld + row_begin;
                store_rows_fp8<ScaleRule>(gate, num_rows, dz_rows, h_ld, dz_row_scales);
                store_rows_fp8<ScaleRule>(up, num_rows, dz_rows + p.inter, h_ld,
                                          dz_row_scales + static_cast<uint64_t>(num_k_blocks) * p.scales_ld);
                const uint64_t col = static_cast<uint64_t>(block) * kTile, mp = p.mp;
                float* dz_col_scales = p.dz_scales_t + block * h_ld + kb * kTile;
                store_columns_fp8<ScaleRule>(gate, column_smem, p.dz_qt + kb * kTile * mp + col, mp, dz_col_scales);
                store_columns_fp8<ScaleRule>(up, column_smem, p.dz_qt + (p.inter + kb * kTile) * mp + col, mp,
                                             dz_col_scales + p.inter);
                store_columns_fp8<ScaleRule>(d_act, column_smem, p.act_qt + kb * kTile * mp + col, mp,
                                             p.act_scales_t + static_cast<uint64_t>(block) * p.inter + kb * kTile);
            }
            // each row's sum over its 16 threads, in a fixed order (deterministic)
            #pragma unroll
            for (uint32_t i = 0; i < kNumPasses; ++i) {
                #pragma unroll
                for (uint32_t lanes = 8; lanes > 0; lanes /= 2)
                    dot[i] += __shfl_xor_sync(0xffffffff, dot[i], lanes);
                const uint32_t r = TileRegs::row(i);
                if (threadIdx.x % 16 == 0 && r < num_rows)
                    p.row_dw[row_begin + r] = dot[i];
            }
        }
    }
};

}  // namespace deep_gemm
