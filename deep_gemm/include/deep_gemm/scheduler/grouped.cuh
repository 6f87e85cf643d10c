#pragma once
// Persistent tile schedulers for grouped GEMMs. Every CTA walks tiles blockIdx.x,
// blockIdx.x + gridDim.x, ...; the producer warp and the math warpgroups each run their own
// copy and see the same sequence. Group boundaries are read on the GPU (no host sync) and
// clamped to the tensor, so malformed offsets can never touch memory out of range.
#include <cstdint>
#include "../ptx/utils.cuh"

namespace deep_gemm::scheduler {

// a / d and a % d by a float reciprocal and a correction: the walk between two tiles, which the
// tensor cores wait for, is a dependent chain, and an integer division is ~20 instructions of it
// (docs/PERF.md, "Decisions": scheduler arithmetic).
struct Divisor {
    uint32_t d;
    float inv;

    __device__ __forceinline__ explicit Divisor(uint32_t d) : d(d), inv(__fdividef(1.0f, static_cast<float>(d))) {}

    // The quotient, and the remainder in `rem` (d > 0).
    __device__ __forceinline__ uint32_t divide(uint32_t a, uint32_t& rem) const {
        uint32_t q = static_cast<uint32_t>(static_cast<float>(a) * inv);  // (within a few of a / d)
        int r = static_cast<int>(a - q * d);  // (tile indices and counts are below 2^31)
        while (r < 0)
            --q, r += static_cast<int>(d);
        while (r >= static_cast<int>(d))
            ++q, r -= static_cast<int>(d);
        rem = static_cast<uint32_t>(r);
        return q;
    }
};

// Groups of rows of A (and of D) back to back: group g owns rows [offsets[g], offsets[g+1]).
// Tiles are ordered by group; inside a group, CTAs running at the same time share A's rows and
// B's columns in L2, and the operand that is larger for the group streams past while the
// smaller one stays in L2: when the group has at most as many rows as N (both rounded up to
// whole tiles: B, the weights, is larger), the tiles reading one column block of B come
// together (M blocks fastest), otherwise those reading one row block of A (N blocks fastest; a
// hot expert's rows). With few rows per group, M blocks fastest read each expert's weights from
// HBM about once (docs/PERF.md, "Decisions": tile order).
//
// With S > 1 passes, each group's rows are split into S runs, back to back: offsets has G * S + 1
// entries and run (g, s) owns rows [offsets[g * S + s], offsets[g * S + s + 1]). Tiles are then
// ordered by pass first (all groups' runs of pass 0, then of pass 1, ...), so rows that arrive
// late (an expert-parallel exchange fills pass s > 0) are reached last. Only the passes in
// [pass_begin, pass_end) are walked: a GEMM may run its passes in several launches.
template <uint32_t BLOCK_M, uint32_t BLOCK_N>
struct MGroupedScheduler {
    struct Tile {
        uint32_t group, pass, row_begin, num_rows, n_begin;

        // The tile as a producer leaves it in a stage for the math warpgroups, with whether there
        // is one (`slot`: 32 bytes, 16-byte aligned; docs/PERF.md, "Decisions": tiles from the
        // producer). read() fills what the math warpgroups use: no pass (the group only feeds the
        // timeline's marks).
        __device__ __forceinline__ void publish(uint8_t* slot, bool more) const {
            ptx::st_shared_v4(slot, make_uint4(more, row_begin, num_rows, n_begin));
            ptx::st_shared_v4(slot + 16, make_uint4(group, pass, 0, 0));
        }
        __device__ __forceinline__ bool read(const uint8_t* slot) {
            const uint4 a = ptx::ld_shared_v4(slot);
            row_begin = a.y, num_rows = a.z, n_begin = a.w;
            group = reinterpret_cast<const uint32_t*>(slot)[4];
            return a.x != 0;
        }
    };

    const int* offsets;
    uint32_t num_groups, num_passes, num_n_blocks, num_rows_total, run_end;
    Divisor n_blocks;
    // run = pass * num_groups + group: the walk's position, its group and pass counted along
    uint32_t next_tile, run, group = 0, pass, run_tile_begin = 0;
    uint32_t run_row_begin = 0, run_row_end = 0, run_num_m_blocks = 0, run_num_tiles = 0;

    __device__ __forceinline__ MGroupedScheduler(const int* offsets, uint32_t num_groups, uint32_t num_passes,
                                                 uint32_t pass_begin, uint32_t pass_end, uint32_t m, uint32_t n)
        : offsets(offsets), num_groups(num_groups), num_passes(num_passes), num_n_blocks(ptx::ceil_div(n, BLOCK_N)),
          num_rows_total(m), run_end(min(pass_end, num_passes) * num_groups), n_blocks(max(num_n_blocks, 1u)),
          next_tile(blockIdx.x), run(pass_begin * num_groups), pass(pass_begin) {
        load_run();
    }

    __device__ __forceinline__ void load_run() {
        if (run >= run_end)
            return;
        const uint32_t slot = group * num_passes + pass;
        run_row_begin = ptx::clamped_offset(offsets, slot, 0, num_rows_total);
        run_row_end = ptx::clamped_offset(offsets, slot + 1, run_row_begin, num_rows_total);
        run_num_m_blocks = ptx::ceil_div(run_row_end - run_row_begin, BLOCK_M);
        run_num_tiles = run_num_m_blocks * num_n_blocks;
    }

    __device__ __forceinline__ bool next(Tile& tile) {
        const uint32_t idx = next_tile;
        next_tile += gridDim.x;
        while (run < run_end and idx >= run_tile_begin + run_num_tiles) {
            run_tile_begin += run_num_tiles;
            ++run;
            if (++group == num_groups)
                group = 0, ++pass;
            load_run();
        }
        if (run >= run_end)
            return false;
        const uint32_t local = idx - run_tile_begin;
        uint32_t m_block, n_block;
        if (run_num_m_blocks * BLOCK_M <= num_n_blocks * BLOCK_N)  // M blocks fastest
            n_block = Divisor(run_num_m_blocks).divide(local, m_block);
        else
            m_block = n_blocks.divide(local, n_block);
        tile.group = group;
        tile.pass = pass;
        tile.row_begin = run_row_begin + m_block * BLOCK_M;
        tile.num_rows = min(BLOCK_M, run_row_end - tile.row_begin);
        tile.n_begin = n_block * BLOCK_N;
        return true;
    }
};

// Weight-gradient style: every group produces a full M x N output, contracting over its own
// rows [offsets[g], offsets[g+1]) of A and B. Tiles are ordered by group so that CTAs running
// at the same time read the same rows. With kClusterM > 1, a cluster of kClusterM CTAs
// (consecutive blockIdx.x) walks the tiles together: its CTAs take kClusterM consecutive M
// blocks at the same N block, so that they share (multicast) B's tile; an M block past M still
// loads and multiplies (its share of B feeds the others), its rows are clipped at the store.
template <uint32_t BLOCK_M, uint32_t BLOCK_N, uint32_t kClusterM = 1>
struct KGroupedScheduler {
    struct Tile {
        uint32_t group, m_begin, n_begin, k_begin, k_end;

        // As MGroupedScheduler::Tile's.
        __device__ __forceinline__ void publish(uint8_t* slot, bool more) const {
            ptx::st_shared_v4(slot, make_uint4(more, group, m_begin, n_begin));
            ptx::st_shared_v4(slot + 16, make_uint4(k_begin, k_end, 0, 0));
        }
        __device__ __forceinline__ bool read(const uint8_t* slot) {
            const uint4 a = ptx::ld_shared_v4(slot), b = ptx::ld_shared_v4(slot + 16);
            group = a.y, m_begin = a.z, n_begin = a.w, k_begin = b.x, k_end = b.y;
            return a.x != 0;
        }
    };

    const int* offsets;
    uint32_t num_groups, num_n_blocks, num_tiles_per_group, num_rows_total;
    uint32_t next_tile;

    __device__ __forceinline__ KGroupedScheduler(const int* offsets, uint32_t num_groups, uint32_t m, uint32_t n,
                                                 uint32_t rows)
        : offsets(offsets), num_groups(num_groups), num_n_blocks(ptx::ceil_div(n, BLOCK_N)),
          num_tiles_per_group(ptx::ceil_div(m, BLOCK_M * kClusterM) * ptx::ceil_div(n, BLOCK_N)),
          num_rows_total(rows), next_tile(blockIdx.x / kClusterM) {}

    // Past the next tile without reading it (another copy of the walk told this one what it is).
    __device__ __forceinline__ void skip() { next_tile += gridDim.x / kClusterM; }

    __device__ __forceinline__ bool next(Tile& tile) {
        const uint32_t idx = next_tile;
        next_tile += gridDim.x / kClusterM;
        if (idx >= num_groups * num_tiles_per_group)
            return false;
        tile.group = idx / num_tiles_per_group;
        const uint32_t local = idx % num_tiles_per_group;
        const uint32_t m_block = (local / num_n_blocks) * kClusterM + (kClusterM > 1 ? ptx::cluster_cta_rank() : 0);
        tile.m_begin = m_block * BLOCK_M;
        tile.n_begin = (local % num_n_blocks) * BLOCK_N;
        tile.k_begin = ptx::clamped_offset(offsets, tile.group, 0, num_rows_total);
        tile.k_end = ptx::clamped_offset(offsets, tile.group + 1, tile.k_begin, num_rows_total);
        return true;
    }
};

}  // namespace deep_gemm::scheduler
