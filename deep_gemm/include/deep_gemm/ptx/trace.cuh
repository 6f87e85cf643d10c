#pragma once
// Checkpoints for debugging hangs. With DG_DEBUG_TRACE defined (DG_JIT_DEBUG_TRACE=1), CTA 0
// writes progress values into host-mapped memory that the host reads while the kernel runs.
#ifdef DG_DEBUG_TRACE
__device__ unsigned int* dg_trace;
#define DG_TRACE(slot, value)                                                  \
    do {                                                                       \
        if (blockIdx.x == 0) {                                                 \
            *reinterpret_cast<volatile unsigned int*>(dg_trace + (slot)) = (value); \
            __threadfence_system();                                            \
        }                                                                      \
    } while (0)
#else
#define DG_TRACE(slot, value) do {} while (0)
#endif

// Clock timelines for profiling (DG_JIT_TIMELINE=1 defines DG_TIMELINE): in CTAs below
// timeline::kCtas, the first thread of each warpgroup (track = warpgroup index) records
// (clock64, event << 24 | tag) pairs, up to timeline::kRecords a track, into the device buffer
// dg_timeline that the host attaches (deep_gemm.jit.runtime.timeline_buffer). Each kernel calls
// timeline::start() once before its warpgroups diverge. Without DG_TIMELINE both are empty.
#ifdef DG_TIMELINE
__device__ unsigned long long* dg_timeline;
#endif

namespace deep_gemm::timeline {

constexpr unsigned int kCtas = 8, kTracks = 3, kRecords = 4096;
enum Event : unsigned int { kTileStart = 1, kStageLanded = 2, kMainloopEnd = 3, kEpilogueEnd = 4, kLoadsIssued = 5 };

#ifdef DG_TIMELINE
__device__ __forceinline__ bool records() {
    return blockIdx.x < kCtas and threadIdx.x % 128 == 0 and threadIdx.x / 128 < kTracks;
}

__device__ __forceinline__ unsigned int& count() {
    __shared__ unsigned int counts[kTracks];
    return counts[threadIdx.x / 128];
}

__device__ __forceinline__ void start() {
    if (records())
        count() = 0;
}

__device__ __forceinline__ void mark(Event event, unsigned int tag) {
    if (records() and count() < kRecords) {
        unsigned long long* r = dg_timeline + 2ull * ((blockIdx.x * kTracks + threadIdx.x / 128) * kRecords + count()++);
        r[0] = clock64();
        r[1] = (static_cast<unsigned long long>(event) << 24) | (tag & 0xffffffu);
    }
}
#else
__device__ __forceinline__ void start() {}
__device__ __forceinline__ void mark(Event, unsigned int) {}
#endif

}  // namespace deep_gemm::timeline
