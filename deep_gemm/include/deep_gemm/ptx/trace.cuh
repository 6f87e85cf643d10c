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
// DG_TIMELINE_START() once before its warpgroups diverge.
namespace deep_gemm::timeline {
constexpr unsigned int kCtas = 8, kTracks = 3, kRecords = 4096;
// (scripts/timeline.py decodes these)
enum Event : unsigned int { kTileStart = 1, kStageLanded = 2, kMainloopEnd = 3, kEpilogueEnd = 4, kLoadsIssued = 5 };
}  // namespace deep_gemm::timeline
#ifdef DG_TIMELINE
__device__ unsigned long long* dg_timeline;
__device__ __forceinline__ unsigned int& dg_timeline_count(unsigned int track) {
    __shared__ unsigned int count[deep_gemm::timeline::kTracks];
    return count[track];
}
#define DG_TIMELINE_START()                                                    \
    do {                                                                       \
        if (threadIdx.x % 128 == 0 && threadIdx.x / 128 < deep_gemm::timeline::kTracks)     \
            dg_timeline_count(threadIdx.x / 128) = 0;                          \
    } while (0)
#define DG_TIMELINE(event, tag)                                                \
    do {                                                                       \
        const unsigned int track_ = threadIdx.x / 128;                         \
        if (blockIdx.x < deep_gemm::timeline::kCtas && threadIdx.x % 128 == 0 && track_ < deep_gemm::timeline::kTracks) { \
            unsigned int& n_ = dg_timeline_count(track_);                      \
            if (n_ < deep_gemm::timeline::kRecords) {                                       \
                unsigned long long* r_ = dg_timeline +                         \
                    2ull * ((blockIdx.x * deep_gemm::timeline::kTracks + track_) * deep_gemm::timeline::kRecords + n_++); \
                r_[0] = clock64();                                             \
                r_[1] = (static_cast<unsigned long long>(deep_gemm::timeline::event) << 24) | ((tag) & 0xffffffu); \
            }                                                                  \
        }                                                                      \
    } while (0)
#else
#define DG_TIMELINE_START() do {} while (0)
#define DG_TIMELINE(event, tag) do {} while (0)
#endif
