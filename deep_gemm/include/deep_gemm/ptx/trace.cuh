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

// What the FP8 mainloop's math warpgroups wait for, summed in clocks over a launch (Waits): a stage's
// loads, an MMA batch, the other warpgroup's turn; the work beside a tile's first MMAs (the next
// tile, the last tile's epilogue); all clocks inside the mainloop; the k-blocks; and the clocks of
// the math warpgroups' scheduler walks (a Span, beside the first MMAs or not); the MMA issue itself
// (fence to commit: whether issuing waits for the tensor cores). record_waits()
// writes each sum as one record, event kWaitsBase + its index, in the track's last records.
enum Wait : unsigned int { kWaitStage = 0, kWaitMma, kWaitTurn, kBesideFirst, kInMainloop, kKBlocks, kScheduler, kIssue, kNumWaits };
constexpr unsigned int kWaitsBase = 16;

#ifdef DG_TIMELINE
__device__ __forceinline__ bool records() {
    return blockIdx.x < kCtas and threadIdx.x % 128 == 0 and threadIdx.x / 128 < kTracks;
}

__device__ __forceinline__ unsigned int& count() {
    __shared__ unsigned int counts[kTracks];
    return counts[threadIdx.x / 128];
}

__device__ __forceinline__ unsigned int* wait_sums() {
    __shared__ unsigned int sums[kTracks][kNumWaits];
    return sums[threadIdx.x / 128];
}

__device__ __forceinline__ void start() {
    if (records()) {
        count() = 0;
        for (unsigned int w = 0; w < kNumWaits; ++w)
            wait_sums()[w] = 0;
    }
}

__device__ __forceinline__ void mark(Event event, unsigned int tag) {
    if (records() and count() < kRecords) {
        unsigned long long* r = dg_timeline + 2ull * ((blockIdx.x * kTracks + threadIdx.x / 128) * kRecords + count()++);
        r[0] = clock64();
        r[1] = (static_cast<unsigned long long>(event) << 24) | (tag & 0xffffffu);
    }
}

__device__ __forceinline__ void add_wait(Wait w, unsigned int clocks) {
    if (records())
        wait_sums()[w] += clocks;
}

// One mainloop call's waits: a stage's and the MMAs' summed in registers and shared when it ends,
// the others added to the warpgroup's shared sums as they end (more sums in registers spill in
// the weight gradient's build).
struct Waits {
    unsigned int sum[kWaitMma + 1] = {}, since = 0, entered = static_cast<unsigned int>(clock());

    __device__ __forceinline__ explicit Waits(unsigned int num_k_blocks) { add_wait(kKBlocks, num_k_blocks); }
    __device__ __forceinline__ void begin() { since = static_cast<unsigned int>(clock()); }
    __device__ __forceinline__ void end(Wait w) {
        const unsigned int clocks = static_cast<unsigned int>(clock()) - since;
        if (w <= kWaitMma)
            sum[w] += clocks;
        else
            add_wait(w, clocks);
    }
    __device__ __forceinline__ ~Waits() {
        add_wait(kInMainloop, static_cast<unsigned int>(clock()) - entered);
        for (unsigned int w = 0; w <= kWaitMma; ++w)
            add_wait(static_cast<Wait>(w), sum[w]);
    }
};

// Clocks from its construction to end(), added to one sum.
struct Span {
    unsigned int since = static_cast<unsigned int>(clock());
    __device__ __forceinline__ void end(Wait w) { add_wait(w, static_cast<unsigned int>(clock()) - since); }
};

__device__ __forceinline__ void record_waits() {
    if (records()) {
        count() = min(count(), kRecords - kNumWaits);
        for (unsigned int w = 0; w < kNumWaits; ++w)
            mark(static_cast<Event>(kWaitsBase + w), wait_sums()[w]);
    }
}
#else
__device__ __forceinline__ void start() {}
__device__ __forceinline__ void mark(Event, unsigned int) {}
struct Waits {
    __device__ __forceinline__ explicit Waits(unsigned int) {}
    __device__ __forceinline__ void begin() {}
    __device__ __forceinline__ void end(Wait) {}
};
struct Span {
    __device__ __forceinline__ void end(Wait) {}
};
__device__ __forceinline__ void record_waits() {}
#endif

}  // namespace deep_gemm::timeline
