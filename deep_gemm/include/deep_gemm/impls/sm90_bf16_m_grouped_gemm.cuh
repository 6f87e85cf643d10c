#pragma once
// M-grouped bf16 GEMM on Hopper: D[rows of g] = A[rows of g] @ op(B[g]), groups of rows of A
// back to back with arbitrary sizes (read on the GPU from `group_offsets`). With kGatherA,
// row i of A is row a_row_index[i] of the source matrix, gathered with cp.async by the whole
// producer warpgroup (B still comes by TMA). With kSwiGLU (the MoE's
// first GEMM, B = l1 [G, 2I, K] with gate rows then up rows), each 256-wide tile holds 128
// gate columns and the matching 128 up columns, and the epilogue writes both halves of
// D = h [M, 2I] and also act = silu(gate) * up into d_aux [M, I]. With kSwiGLUBwd (the MoE
// backward's first GEMM, D = dy_rows @ l2[e] = dL/d(act) before the routing weight w), the
// epilogue runs the SwiGLU backward instead of storing D: from h = d_aux [M, 2I] it writes
// dz = d[gate | up] of w * D over h, w * act into d, and each row's <D, act> over the tile's
// columns into row_dw_part[row, n_tile] (summed over tiles by the caller: deterministic).
// With num_passes S > 1, group_offsets splits each group's rows into S runs (see
// scheduler::MGroupedScheduler), tiles go pass by pass, and the producer waits for
// ready_flags[s] before reading A for a tile of pass s > 0: the MoE's expert-parallel forward
// starts on its own tokens while other ranks' tokens are still being copied in. A launch runs
// only the passes in [pass_begin, pass_end): the expert-parallel GEMM2 finishes other ranks'
// rows first, so that their results leave while it works on this rank's own.
//   B K-major  ("nt"): B is [G, N, K]  -> D = A @ B[g].T   (forward)
//   B MN-major ("nn"): B is [G, K, N]  -> D = A @ B[g]     (data gradient)
// Persistent and warp-specialised: one TMA producer thread (a warpgroup with kGatherA), two
// WGMMA math warpgroups.
#include <cuda.h>
#include <cuda_bf16.h>
#include "../epilogue/activation.cuh"
#include "../epilogue/store.cuh"
#include "../mma/pipeline.cuh"
#include "../ptx/cp_async.cuh"
#include "../ptx/tma.cuh"
#include "../scheduler/grouped.cuh"

namespace deep_gemm {

struct MGroupedGemmParams {
    CUtensorMap tensor_map_a;  // A [M, K]; box {64 (K), 128 rows} (unused with kGatherA)
    CUtensorMap tensor_map_b;  // K-major: [G * N, K], box {64, BLOCK_N}; MN-major: [G * K, N], box {64, 64}
    CUtensorMap tensor_map_d;  // D as [1, M, N]; box {64 (N), 64 rows, 1} (kTmaStore only)
    CUtensorMap tensor_map_aux;  // d_aux as [1, M, N / 2], the same box (kTmaStore with kSwiGLU only)
    __nv_bfloat16* d;          // [M, N]
    __nv_bfloat16* d_aux;      // [M, N / 2] with kSwiGLU; h [M, 2N] (in, then dz) with kSwiGLUBwd
    const int* group_offsets;  // [G * num_passes + 1]
    const int64_t* a_row_index;  // [M] with kGatherA, else unused
    const __nv_bfloat16* a;      // with kGatherA: the source rows [a_rows, K]
    const float* row_weight;     // [M] with kSwiGLUBwd
    float* row_dw_part;          // [M, ceil(N / BLOCK_N)] with kSwiGLUBwd
    const int* ready_flags;      // [num_passes] or null: A's rows of pass s > 0 are read once ready_flags[s] != 0
    uint32_t m, n, k, num_groups, a_rows, num_passes, pass_begin, pass_end;
};

// kAsyncStore: the epilogue drains through bulk copies that overlap the next tile's MMAs
// (epilogue::store_rows_async) instead of 16-byte stores by the math threads. kTmaStore (also
// with kSwiGLU): through tensor stores (epilogue::store_tile_tma) that likewise overlap; a
// warpgroup whose 64 rows are not all in the group (a group's last tile) stores synchronously
// instead, since a tensor store would write the next group's rows.
template <uint32_t BLOCK_N, uint32_t kNumStages, mma::Major kMajorB, bool kAsyncStore, bool kGatherA, bool kSwiGLU,
          bool kSwiGLUBwd = false, bool kTmaStore = false>
__device__ __forceinline__ void sm90_bf16_m_grouped_gemm_impl(const MGroupedGemmParams& p) {
    using namespace mma;
    static_assert(not kSwiGLU or (BLOCK_N == 256 and kMajorB == Major::kKMajor and not kAsyncStore),
                  "the SwiGLU epilogue pairs 128 gate with 128 up columns, staged or by tensor stores");
    static_assert(not kSwiGLUBwd or (not kSwiGLU and not kAsyncStore), "one epilogue at a time");
    static_assert(not kTmaStore or not (kAsyncStore or kSwiGLUBwd), "one epilogue at a time");
    constexpr uint32_t BLOCK_M = 128;
    constexpr uint32_t kSyncStagingBytes = epilogue::StagedBF16<BLOCK_N>::kBytesPerWarpgroup;
    constexpr uint32_t kTmaStagingBytes = epilogue::SwizzledStaging<__nv_bfloat16>::kBytesPerWarpgroup;
    // Each warpgroup's staging starts 1024-byte aligned (the tensor stores' swizzle).
    constexpr uint32_t kStagingBytes =
        kAsyncStore ? epilogue::RowStaging<BLOCK_N, __nv_bfloat16>::kBytesPerWarpgroup
        : kTmaStore ? ptx::ceil_div(kSyncStagingBytes > kTmaStagingBytes ? kSyncStagingBytes : kTmaStagingBytes, 1024u) * 1024
                    : kSyncStagingBytes;
    static_assert(not kTmaStore or kStagingBytes % 1024 == 0);
    using Smem = GemmSmem<BLOCK_M, BLOCK_N, kNumStages, 2 * kStagingBytes>;
    using Scheduler = scheduler::MGroupedScheduler<BLOCK_M, BLOCK_N>;

    extern __shared__ __align__(1024) uint8_t smem_buffer[];
    const Smem smem{smem_buffer};
    const uint32_t num_k_blocks = ptx::ceil_div(p.k, BLOCK_K);

    start_gemm<kGatherA>(smem, &p.tensor_map_a, &p.tensor_map_b);
    if (kTmaStore and threadIdx.x == 0) {  // once per CTA, for the stores the math warpgroups issue
        ptx::prefetch_tma_descriptor(&p.tensor_map_d);
        if constexpr (kSwiGLU)
            ptx::prefetch_tma_descriptor(&p.tensor_map_aux);
    }

    Scheduler scheduler(p.group_offsets, p.num_groups, p.num_passes, p.pass_begin, p.pass_end, p.m, p.n);
    typename Scheduler::Tile tile;
    PipelineState pipe;

    if (threadIdx.x >= kNumMathThreads) {
        ptx::warpgroup_reg_dealloc<kProducerRegs>();
        DG_TRACE(5, 1);
        const uint32_t t = threadIdx.x - kNumMathThreads;
        if (not kGatherA and t != 0)
            return;
        // With kGatherA, thread t copies 16-byte piece t % 8 of tile rows t / 8 + 16 i (i < 8),
        // so each warp reads four whole 128-byte rows per cp.async. Lane l of warp w holds the
        // source of tile row 4 w + l % 4 + 16 (l / 4) (-1: zeros, for rows past the group and
        // indices out of range); the lanes that copy a row fetch it with a shuffle.
        constexpr uint32_t kTxBytes = kGatherA ? Smem::kBytesB : Smem::kBytesPerStage;
        uint32_t passes_ready = 1;  // bit s: ready_flags[s] seen set (pass 0 never waits)
        while (scheduler.next(tile)) {
            if (p.ready_flags != nullptr and not (passes_ready >> tile.pass & 1)) {
                ptx::wait_global_flag(p.ready_flags + tile.pass);
                passes_ready |= 1u << tile.pass;
            }
            int32_t my_src = -1;
            if constexpr (kGatherA) {
                const uint32_t lane = t % 32, row = 4 * (t / 32) + lane % 4 + 16 * (lane / 4);
                const int64_t src = row < tile.num_rows ? __ldg(p.a_row_index + tile.row_begin + row) : -1;
                my_src = src >= 0 and src < p.a_rows ? static_cast<int32_t>(src) : -1;
            }
            produce_k_blocks<kNumStages, kTxBytes>(smem, pipe, num_k_blocks, t == 0, [&](uint32_t stage, uint32_t k_block, ptx::MBarrier* bar) {
                const uint32_t k = k_block * BLOCK_K;
                if constexpr (kGatherA) {
                    const uint32_t col = k + (t % 8) * 8;  // K % 8 == 0: a piece is all in or all out
                    #pragma unroll
                    for (uint32_t i = 0; i < BLOCK_M / 16; ++i) {
                        const int32_t src = __shfl_sync(0xffffffff, my_src, 4 * i + (t % 32) / 8);
                        const bool valid = src >= 0 and col < p.k;
                        ptx::cp_async_16(smem.a(stage) + ptx::swizzle_128b_offset(t / 8 + 16 * i, t % 8),
                                         p.a + static_cast<uint64_t>(valid ? src : 0) * p.k + col, valid);
                    }
                    ptx::cp_async_arrive_noinc(bar);
                    if (t != 0)
                        return;
                } else {
                    ptx::tma_load_2d(smem.a(stage), &p.tensor_map_a, bar, k, tile.row_begin);
                }
                if constexpr (kSwiGLU) {  // 128 gate rows of B, then the matching 128 up rows
                    const uint32_t gate_row = tile.group * p.n + tile.n_begin / 2;
                    ptx::tma_load_2d(smem.b(stage), &p.tensor_map_b, bar, k, gate_row);
                    ptx::tma_load_2d(smem.b(stage) + 128 * kSwizzleBytes, &p.tensor_map_b, bar, k, gate_row + p.n / 2);
                } else if constexpr (kMajorB == Major::kKMajor) {
                    ptx::tma_load_2d(smem.b(stage), &p.tensor_map_b, bar, k, tile.group * p.n + tile.n_begin);
                } else {
                    #pragma unroll
                    for (uint32_t j = 0; j < BLOCK_N / 64; ++j)
                        ptx::tma_load_2d(smem.b(stage) + j * kMNChunkBytes, &p.tensor_map_b, bar,
                                         tile.n_begin + j * 64, tile.group * p.k + k);
                }
            });
        }
    } else {
        ptx::warpgroup_reg_alloc<kMathRegs>();
        DG_TRACE(threadIdx.x % 128 == 0 ? 6 + threadIdx.x / 128 : 15, 1);
        const uint32_t wg = threadIdx.x / 128;
        uint8_t* staging = smem.extra() + wg * kStagingBytes;
        float acc[BLOCK_N / 2];
        while (scheduler.next(tile)) {
            const uint32_t row = wg * 64, num_rows = tile.num_rows > row ? tile.num_rows - row : 0;
            if constexpr (kSwiGLUBwd)
                epilogue::prefetch_swiglu_bwd_inputs<BLOCK_N>(p.d_aux, p.n, tile.row_begin + row, num_rows, tile.n_begin);
            zero_accum(acc);
            consume_k_blocks<BLOCK_N, kNumStages, Major::kKMajor, kMajorB>(
                smem, pipe, num_k_blocks, wg * 64 * kSwizzleBytes, acc, [](uint32_t, uint32_t) {
                    if constexpr (kGatherA)  // cp.async wrote A through the generic proxy; WGMMA reads the async one
                        ptx::fence_view_async_shared();
                });
            __nv_bfloat16* d = p.d + static_cast<uint64_t>(tile.row_begin + row) * p.n + tile.n_begin;
            // Tensor stores write whole 64-row boxes: only for a warpgroup whose rows are all in the group.
            const bool tensor_stores = kTmaStore and num_rows >= 64;
            if (kTmaStore and not tensor_stores) {  // the staging may still feed earlier tensor stores
                if (threadIdx.x % 128 == 0)
                    ptx::bulk_wait_group_read<0>();
                ptx::named_barrier_sync(1 + wg, 128);
            }
            if constexpr (kSwiGLU) {
                // Accumulators 0..63 hold the gate columns, 64..127 the up columns at the same
                // positions (see mma/wgmma_bf16.cuh), so each thread pairs them in registers.
                const float (&gate)[64] = *reinterpret_cast<const float (*)[64]>(acc);
                const float (&up)[64] = *reinterpret_cast<const float (*)[64]>(acc + 64);
                const uint32_t inter = p.n / 2, col = tile.n_begin / 2, first_row = tile.row_begin + row;
                float act[64];
                #pragma unroll
                for (uint32_t i = 0; i < 64; ++i)
                    act[i] = epilogue::swiglu(gate[i], up[i]);
                if (tensor_stores) {
                    epilogue::store_tile_tma<128, __nv_bfloat16, false>(gate, staging, 1 + wg, &p.tensor_map_d, col,
                                                                        first_row, 0);
                    epilogue::store_tile_tma<128, __nv_bfloat16, false>(up, staging, 1 + wg, &p.tensor_map_d,
                                                                        inter + col, first_row, 0);
                    epilogue::store_tile_tma<128, __nv_bfloat16, false>(act, staging, 1 + wg, &p.tensor_map_aux, col,
                                                                        first_row, 0);
                } else {
                    __nv_bfloat16* h = p.d + static_cast<uint64_t>(first_row) * p.n + col;
                    epilogue::store_bf16_staged<128>(gate, staging, 1 + wg, h, p.n, num_rows, 128);
                    epilogue::store_bf16_staged<128>(up, staging, 1 + wg, h + inter, p.n, num_rows, 128);
                    epilogue::store_bf16_staged<128>(act, staging, 1 + wg, p.d_aux + static_cast<uint64_t>(first_row) * inter + col,
                                                     inter, num_rows, 128);
                }
            } else if constexpr (kSwiGLUBwd) {
                epilogue::swiglu_bwd_direct<BLOCK_N>(acc, p.d_aux, p.d, p.row_weight, p.row_dw_part, p.n,
                                                     tile.row_begin + row, num_rows, tile.n_begin);
            } else if constexpr (kAsyncStore) {
                epilogue::store_rows_async<BLOCK_N, __nv_bfloat16, false>(acc, staging, 1 + wg, d, p.n, num_rows, p.n - tile.n_begin);
            } else if (tensor_stores) {
                epilogue::store_tile_tma<BLOCK_N, __nv_bfloat16, false>(acc, staging, 1 + wg, &p.tensor_map_d,
                                                                        tile.n_begin, tile.row_begin + row, 0);
            } else {
                epilogue::store_bf16_staged<BLOCK_N>(acc, staging, 1 + wg, d, p.n, num_rows, p.n - tile.n_begin);
            }
            DG_TRACE(threadIdx.x % 128 == 0 ? 10 + wg : 15, 1 + tile.n_begin);
        }
        if constexpr (kAsyncStore or kTmaStore)
            epilogue::store_rows_async_drain();
    }
}

}  // namespace deep_gemm
