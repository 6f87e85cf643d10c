#pragma once
// The routing layout (deep_gemm/moe/layout.py): the T * K (token, slot) pairs sorted by expert,
// stably (slot order within an expert), empty slots (ids outside [0, E)) last. A counting sort
// in three launches, deterministic (no atomics whose order shows in the result):
//   count: each warp counts the keys of its chunk of slots;
//   scan:  one CTA per key turns that key's counts into each chunk's first row within the key,
//          and writes the key's total;
//   place: each CTA scans the totals into the keys' first rows (the offsets); each warp walks
//          its chunk in slot order, 32 slots at a time, ranking equal keys with
//          __match_any_sync, and writes every slot's row.
// Key e < E is expert e; key E collects the empty slots.
#include <cstdint>

namespace deep_gemm {

constexpr uint32_t kRoutingMaxKeys = 1025;  // E <= 1024 (the launcher checks)
constexpr uint32_t kRoutingBatch = 8;  // loads issued together before their values are used

struct MoERoutingParams {
    const int64_t* topk_idx;    // [N = T * K] expert ids
    const float* topk_weights;  // [N]
    int* chunk_counts;          // [E + 1, num_chunks]: counts (count), then first rows within the key (scan)
    int* key_totals;            // [E + 1]
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
struct MoERoutingCount {
    __device__ __forceinline__ static void run(const MoERoutingParams& p) {
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
            p.chunk_counts[static_cast<uint64_t>(k) * p.num_chunks + chunk] = count[k];
    }
};

__device__ __forceinline__ int warp_inclusive_scan(int value, uint32_t lane) {
    #pragma unroll
    for (uint32_t d = 1; d < 32; d *= 2) {
        const int v = __shfl_up_sync(0xffffffff, value, d);
        value += lane >= d ? v : 0;
    }
    return value;
}

// Exclusive scan over the CTA; `total` gets the sum of every thread's value.
template <uint32_t kNumThreads>
__device__ __forceinline__ int block_exclusive_scan(int value, int& total) {
    constexpr uint32_t kWarps = kNumThreads / 32;
    __shared__ int warp_starts[kWarps], block_total;
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int inclusive = warp_inclusive_scan(value, lane);
    if (lane == 31)
        warp_starts[warp] = inclusive;
    __syncthreads();
    if (warp == 0) {
        const int sum = lane < kWarps ? warp_starts[lane] : 0;
        const int scanned = warp_inclusive_scan(sum, lane);
        if (lane < kWarps)
            warp_starts[lane] = scanned - sum;
        if (lane == kWarps - 1)
            block_total = scanned;
    }
    __syncthreads();
    total = block_total;
    return warp_starts[warp] + inclusive - value;
}

// One CTA per key: an exclusive scan of the key's counts over the chunks (each thread a run).
template <uint32_t kNumThreads>
struct MoERoutingScan {
    __device__ __forceinline__ static void run(const MoERoutingParams& p) {
        int* counts = p.chunk_counts + static_cast<uint64_t>(blockIdx.x) * p.num_chunks;
        const uint32_t run = (p.num_chunks + kNumThreads - 1) / kNumThreads;
        const uint32_t begin = min(threadIdx.x * run, p.num_chunks), end = min(begin + run, p.num_chunks);
        int sum = 0;
        for (uint32_t c0 = begin; c0 < end; c0 += kRoutingBatch) {  // loads in flight together
            int n[kRoutingBatch];
            #pragma unroll
            for (uint32_t j = 0; j < kRoutingBatch; ++j)
                n[j] = c0 + j < end ? counts[c0 + j] : 0;
            #pragma unroll
            for (uint32_t j = 0; j < kRoutingBatch; ++j)
                sum += n[j];
        }
        int total;
        int running = block_exclusive_scan<kNumThreads>(sum, total);
        for (uint32_t c0 = begin; c0 < end; c0 += kRoutingBatch) {
            int n[kRoutingBatch];
            #pragma unroll
            for (uint32_t j = 0; j < kRoutingBatch; ++j)
                n[j] = c0 + j < end ? counts[c0 + j] : 0;
            #pragma unroll
            for (uint32_t j = 0; j < kRoutingBatch; ++j) {
                if (c0 + j < end)
                    counts[c0 + j] = running;
                running += n[j];
            }
        }
        if (threadIdx.x == 0)
            p.key_totals[blockIdx.x] = total;
    }
};

// One chunk per warp, in slot order: a slot's row is its key's start, plus the chunk's first
// row for that key, plus the slots of that key before it in the chunk.
template <uint32_t kNumThreads>
struct MoERoutingPlace {
    __device__ __forceinline__ static void run(const MoERoutingParams& p) {
        __shared__ int counts[kNumThreads / 32][kRoutingMaxKeys];
        __shared__ int key_start[kRoutingMaxKeys];
        const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, num_keys = p.num_experts + 1;
        for (uint32_t k = threadIdx.x; k < num_keys; k += kNumThreads)
            key_start[k] = p.key_totals[k];
        __syncthreads();
        if (warp == 0) {  // the keys' first rows, from their totals (CTA 0 also writes the offsets)
            int start = 0;
            for (uint32_t k0 = 0; k0 < num_keys; k0 += 32) {
                const int total = k0 + lane < num_keys ? key_start[k0 + lane] : 0;
                const int inclusive = warp_inclusive_scan(total, lane);
                if (k0 + lane < num_keys) {
                    key_start[k0 + lane] = start + inclusive - total;
                    if (blockIdx.x == 0)  // offsets has E + 1 entries: key E (the empty slots) starts at offsets[E]
                        p.offsets[k0 + lane] = start + inclusive - total;
                }
                start += __shfl_sync(0xffffffff, inclusive, 31);
            }
        }
        __syncthreads();
        const uint32_t chunk = blockIdx.x * (kNumThreads / 32) + warp;
        if (chunk >= p.num_chunks)
            return;
        int* seen = counts[warp];
        for (uint32_t k = lane; k < num_keys; k += 32)
            seen[k] = key_start[k] + p.chunk_counts[static_cast<uint64_t>(k) * p.num_chunks + chunk];
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
};

}  // namespace deep_gemm
