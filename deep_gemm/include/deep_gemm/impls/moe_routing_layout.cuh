#pragma once
// The routing layout (deep_gemm/moe/layout.py): the T * K (token, slot) pairs sorted by expert,
// stably (slot order within an expert), empty slots (ids outside [0, E)) last. A counting sort
// in three launches, deterministic (no atomics whose order shows in the result):
//   count: each warp counts the keys of its chunk of slots;
//   scan:  one CTA turns the counts into each chunk's first row per key (within the key),
//          and the keys' totals into the offsets;
//   place: each warp walks its chunk in slot order, 32 slots at a time, ranking equal keys
//          with __match_any_sync, and writes every slot's row.
// Key e < E is expert e; key E collects the empty slots.
#include <cstdint>

namespace deep_gemm {

constexpr uint32_t kRoutingMaxKeys = 1025;  // E <= 1024 (the launcher checks)
constexpr uint32_t kRoutingBatch = 8;  // loads issued together before their values are used

struct MoERoutingParams {
    const int64_t* topk_idx;    // [N = T * K] expert ids
    const float* topk_weights;  // [N]
    int* chunk_counts;          // [num_chunks, E + 1]: counts (count), then first rows (scan)
    int* offsets;               // [E + 1]: expert e's rows start at offsets[e]; offsets[E] = valid rows
    int64_t* row_token;         // [N]
    float* row_weight;          // [N], 0 on empty slots
    int64_t* slot_row;          // [N]
    bool* slot_valid;           // [N]
    uint32_t num_slots, num_topk, num_experts, slots_per_chunk, num_chunks;
};

__device__ __forceinline__ uint32_t routing_key(const MoERoutingParams& p, uint32_t slot) {
    const int64_t id = p.topk_idx[slot];
    return id >= 0 and id < p.num_experts ? static_cast<uint32_t>(id) : p.num_experts;
}

// One chunk of slots per warp.
template <uint32_t kNumThreads>
__device__ __forceinline__ void moe_routing_count_impl(const MoERoutingParams& p) {
    __shared__ int counts[kNumThreads / 32][kRoutingMaxKeys];
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, num_keys = p.num_experts + 1;
    const uint32_t chunk = blockIdx.x * (kNumThreads / 32) + warp;
    if (chunk >= p.num_chunks)
        return;
    int* count = counts[warp];
    for (uint32_t k = lane; k < num_keys; k += 32)
        count[k] = 0;
    __syncwarp();
    const uint32_t begin = chunk * p.slots_per_chunk, end = min(begin + p.slots_per_chunk, p.num_slots);
    for (uint32_t slot = begin + lane; slot < end; slot += 32)
        atomicAdd(count + routing_key(p, slot), 1);
    __syncwarp();
    for (uint32_t k = lane; k < num_keys; k += 32)
        p.chunk_counts[static_cast<uint64_t>(chunk) * num_keys + k] = count[k];
}

__device__ __forceinline__ int warp_inclusive_scan(int value, uint32_t lane) {
    #pragma unroll
    for (uint32_t d = 1; d < 32; d *= 2) {
        const int v = __shfl_up_sync(0xffffffff, value, d);
        value += lane >= d ? v : 0;
    }
    return value;
}

// One CTA: per key, one warp scans the chunks' counts (each lane a run of chunks); then
// warp 0 scans the keys' totals into the offsets.
template <uint32_t kNumThreads>
__device__ __forceinline__ void moe_routing_scan_impl(const MoERoutingParams& p) {
    __shared__ int totals[kRoutingMaxKeys];
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, num_keys = p.num_experts + 1;
    const uint32_t run = (p.num_chunks + 31) / 32, run_begin = min(lane * run, p.num_chunks);
    const uint32_t run_end = min(run_begin + run, p.num_chunks);
    for (uint32_t k = warp; k < num_keys; k += kNumThreads / 32) {
        int* column = p.chunk_counts + k;
        const auto at = [&](uint32_t c) { return column + static_cast<uint64_t>(c) * num_keys; };
        int sum = 0;
        for (uint32_t c0 = run_begin; c0 < run_end; c0 += kRoutingBatch) {  // loads in flight together
            int n[kRoutingBatch];
            #pragma unroll
            for (uint32_t j = 0; j < kRoutingBatch; ++j)
                n[j] = c0 + j < run_end ? *at(c0 + j) : 0;
            #pragma unroll
            for (uint32_t j = 0; j < kRoutingBatch; ++j)
                sum += n[j];
        }
        const int inclusive = warp_inclusive_scan(sum, lane);
        int running = inclusive - sum;
        for (uint32_t c0 = run_begin; c0 < run_end; c0 += kRoutingBatch) {
            int n[kRoutingBatch];
            #pragma unroll
            for (uint32_t j = 0; j < kRoutingBatch; ++j)
                n[j] = c0 + j < run_end ? *at(c0 + j) : 0;
            #pragma unroll
            for (uint32_t j = 0; j < kRoutingBatch; ++j) {
                if (c0 + j < run_end)
                    *at(c0 + j) = running;
                running += n[j];
            }
        }
        if (lane == 31)
            totals[k] = inclusive;
    }
    __syncthreads();
    if (warp == 0) {  // offsets has E + 1 entries: key E (the empty slots) starts at offsets[E]
        int start = 0;
        for (uint32_t k0 = 0; k0 < num_keys; k0 += 32) {
            const int total = k0 + lane < num_keys ? totals[k0 + lane] : 0;
            const int inclusive = warp_inclusive_scan(total, lane);
            if (k0 + lane < num_keys)
                p.offsets[k0 + lane] = start + inclusive - total;
            start += __shfl_sync(0xffffffff, inclusive, 31);
        }
    }
}

// One chunk per warp, in slot order: a slot's row is its key's start, plus the chunk's first
// row for that key, plus the slots of that key before it in the chunk.
template <uint32_t kNumThreads>
__device__ __forceinline__ void moe_routing_place_impl(const MoERoutingParams& p) {
    __shared__ int counts[kNumThreads / 32][kRoutingMaxKeys];
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, num_keys = p.num_experts + 1;
    const uint32_t chunk = blockIdx.x * (kNumThreads / 32) + warp;
    if (chunk >= p.num_chunks)
        return;
    int* seen = counts[warp];
    const int* first = p.chunk_counts + static_cast<uint64_t>(chunk) * num_keys;
    for (uint32_t k = lane; k < num_keys; k += 32)
        seen[k] = p.offsets[k] + first[k];
    __syncwarp();
    const uint32_t begin = chunk * p.slots_per_chunk, end = min(begin + p.slots_per_chunk, p.num_slots);
    for (uint32_t base = begin; base < end; base += 32 * kRoutingBatch) {
        uint32_t keys[kRoutingBatch];  // a batch of rounds' loads in flight together
        float weights[kRoutingBatch];
        #pragma unroll
        for (uint32_t b = 0; b < kRoutingBatch; ++b) {
            const uint32_t slot = base + 32 * b + lane;
            keys[b] = slot < end ? routing_key(p, slot) : num_keys;  // num_keys: a key no slot has
            weights[b] = slot < end ? p.topk_weights[slot] : 0.0f;
        }
        #pragma unroll
        for (uint32_t b = 0; b < kRoutingBatch; ++b) {
            const uint32_t slot = base + 32 * b + lane, key = keys[b];
            const bool in_range = slot < end;
            const uint32_t peers = __match_any_sync(0xffffffff, key);
            const int row = in_range ? seen[key] + __popc(peers & ((1u << lane) - 1)) : 0;
            __syncwarp();
            if (in_range and lane == __ffs(peers) - 1)
                seen[key] += __popc(peers);
            __syncwarp();
            if (in_range) {
                const bool valid = key < p.num_experts;
                p.slot_row[slot] = row;
                p.slot_valid[slot] = valid;
                p.row_token[row] = slot / p.num_topk;
                p.row_weight[row] = valid ? weights[b] : 0.0f;
            }
        }
    }
}

}  // namespace deep_gemm
