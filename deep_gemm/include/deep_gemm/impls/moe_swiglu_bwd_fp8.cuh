#pragma once
// The FP8 MoE backward between its two data-gradient GEMMs: impls/moe_swiglu_bwd.cuh's SwiGLU
// backward with its outputs quantized in the same pass, in the forms the FP8 GEMMs read:
//   dz rows               [R, 2I] e4m3, one scale per 1 x 128       (dx's GEMM)
//   dz columns            [2I, Rp] e4m3, 128 x 1 per expert's rows  (dl1's)
//   act_weighted columns  [I, Rp] e4m3, 128 x 1 per expert's rows   (dl2's)
//   row_dw                [R] fp32, <d_act, act> of each row
// Every value is rounded to bf16 before it is quantized, so that the FP8 outputs equal those of
// impls/fp8_quantize.cuh applied to the bf16 kernel's dz and act_weighted, bit for bit; neither
// bf16 tensor is written. A CTA takes a 128-row block of the experts' padded rows (rows past an
// expert's end read as zeros, so the column copies' padding is zeros), each block's I / 128
// column blocks in turn, keeping the rows' <d_act, act> in registers across them. A column
// block's gate, up and d_act come by cp.async into shared memory (no registers held while they
// load; one group a pass of rows, so the first rows are computed while the last still load) and
// are turned into dz's halves and act_weighted there in place, one 8-value piece at a time; the
// column copies are quantized from there. Two CTAs an SM: one computes while the other's loads
// are in flight. Launched one CTA a block (the loop serves smaller grids).
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
    static_assert(fp8_quantize::kNumPasses <= 8, "cp_async_wait_unrolled waits for up to 7 groups");
    struct Smem {
        fp8_quantize::ColumnSmem tiles[3];  // gate -> dz's gate half, up -> dz's up half, d_act -> act_weighted
        float weight[fp8_quantize::kTile];  // the block's row weights (zeros past its rows)
    };
    static constexpr uint32_t kSmemBytes = sizeof(Smem);

    __device__ __forceinline__ static void run(const MoESwiGLUBwdFp8Params& p) {
        using namespace fp8_quantize;
        extern __shared__ __align__(16) uint8_t smem_buffer[];
        Smem& smem = *reinterpret_cast<Smem*>(smem_buffer);
        ColumnSmem* tiles = smem.tiles;
        __shared__ int padded[kMaxGroups + 1];
        padded_offsets(p.offsets, p.num_groups, p.m, padded, p.padded_offsets);

        const uint32_t num_blocks = static_cast<uint32_t>(padded[p.num_groups]) / kTile;
        const uint32_t num_k_blocks = p.inter / kTile;
        const uint64_t h_ld = 2 * static_cast<uint64_t>(p.inter);
        for (uint32_t block = blockIdx.x; block < num_blocks; block += gridDim.x) {
            uint32_t row_begin, num_rows;
            padded_block_rows(padded, p.offsets, p.num_groups, p.m, block, row_begin, num_rows);
            if (threadIdx.x < kTile)  // (committed with the first column block's tiles)
                ptx::cp_async_4(smem.weight + threadIdx.x,
                                p.row_weight + row_begin + (threadIdx.x < num_rows ? threadIdx.x : 0),
                                threadIdx.x < num_rows);
            float dot[kNumPasses];
            #pragma unroll
            for (uint32_t i = 0; i < kNumPasses; ++i)
                dot[i] = 0.0f;
            for (uint32_t kb = 0; kb < num_k_blocks; ++kb) {
                // (shared memory is free: the last column quantization ended with a barrier)
                // one cp.async group a pass, so that pass i starts once its own pieces have landed
                const __nv_bfloat16* h = p.h + row_begin * h_ld + kb * kTile;
                const __nv_bfloat16* d_act = p.d_act + static_cast<uint64_t>(row_begin) * p.inter + kb * kTile;
                #pragma unroll
                for (uint32_t i = 0; i < kNumPasses; ++i) {
                    TileRegs::copy_piece_async(tiles[0].tile, h, h_ld, num_rows, i);
                    TileRegs::copy_piece_async(tiles[1].tile, h + p.inter, h_ld, num_rows, i);
                    TileRegs::copy_piece_async(tiles[2].tile, d_act, p.inter, num_rows, i);
                    ptx::cp_async_commit();
                }
                uint8_t* dz_rows = p.dz_q + row_begin * h_ld + kb * kTile;
                float* dz_row_scales = p.dz_scales + static_cast<uint64_t>(kb) * p.scales_ld + row_begin;
                #pragma unroll
                for (uint32_t i = 0; i < kNumPasses; ++i) {
                    ptx::cp_async_wait_unrolled(kNumPasses - 1 - i);  // (each thread reads back only its own pieces)
                    if (kb == 0 and i == 0)
                        __syncthreads();  // but the weights, in the first group, were copied by others
                    uint4 piece[3];
                    float g[ptx::kBF16PerVec], u[ptx::kBF16PerVec], da[ptx::kBF16PerVec];
                    #pragma unroll
                    for (uint32_t t = 0; t < 3; ++t)
                        piece[t] = ptx::ld_shared_v4(tiles[t].tile + TileRegs::smem_offset(i));
                    ptx::bf16x8_to_float(piece[0], g);
                    ptx::bf16x8_to_float(piece[1], u);
                    ptx::bf16x8_to_float(piece[2], da);
                    const float weight = smem.weight[TileRegs::row(i)];
                    #pragma unroll
                    for (uint32_t j = 0; j < ptx::kBF16PerVec; ++j) {  // (moe_swiglu_bwd.cuh's arithmetic)
                        const epilogue::SwiGLUGrad s = epilogue::swiglu_grad(g[j], u[j], weight * da[j]);
                        dot[i] += da[j] * s.act;
                        g[j] = s.d_gate, u[j] = s.d_up, da[j] = weight * s.act;
                    }
                    piece[0] = ptx::float_to_bf16x8(g);
                    piece[1] = ptx::float_to_bf16x8(u);
                    piece[2] = ptx::float_to_bf16x8(da);
                    const uint32_t r = TileRegs::row(i);
                    float* up_row_scales = dz_row_scales + static_cast<uint64_t>(num_k_blocks) * p.scales_ld;
                    store_row_pair_fp8<ScaleRule>({piece[0], piece[1]}, {r, r}, num_rows, {dz_rows, dz_rows + p.inter},
                                                  h_ld, {dz_row_scales, up_row_scales});
                    #pragma unroll
                    for (uint32_t t = 0; t < 3; ++t)
                        ptx::st_shared_v4(tiles[t].tile + TileRegs::smem_offset(i), piece[t]);
                }
                // tiles 0 and 1: dz's gate and up halves (columns kb and I / 128 + kb of dz); 2: act_weighted
                store_smem_columns_fp8<ScaleRule, 3>(tiles, p.mp, [&](uint32_t t) {
                    const uint64_t c = (t == 1 ? p.inter : 0) + kb * kTile;
                    return t < 2 ? ColumnDst{p.dz_qt + c * p.mp + block * kTile, p.dz_scales_t + block * h_ld + c}
                                 : ColumnDst{p.act_qt + c * p.mp + block * kTile,
                                             p.act_scales_t + static_cast<uint64_t>(block) * p.inter + c};
                });
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
