#pragma once
// What both microbenchmarks share: fixed random e4m3 bytes, and the timing of a kernel whose CTAs
// each record the clocks of their timed loop in cycles[blockIdx.x].
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <vector>
#include <cuda_runtime.h>

// A hash of `i` and `salt`, and four random e4m3 values without NaN (|x| < 448) made from it.
__host__ __device__ __forceinline__ uint32_t random_u32(uint32_t i, uint32_t salt) {
    uint32_t h = (i * 2654435761u) ^ salt;
    h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    return h;
}
__host__ __device__ __forceinline__ uint32_t random_e4m3x4(uint32_t i, uint32_t salt) {
    return random_u32(i, salt) & 0x77777777u;
}

struct Timing {
    float ms;                // the last launch's
    int iters;               // its loop trips
    double cycles_per_iter;  // averaged over the CTAs
    double mhz;              // the SM clock those cycles imply
};

// Launches `launch(iters)` (num_sms CTAs) with iters grown until a launch takes about target_ms.
template <typename Launch>
Timing time_launches(const char* name, int num_sms, const long long* cycles, double target_ms, const Launch& launch) {
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0), cudaEventCreate(&e1);
    int iters = 256;
    float ms = 0.0f;
    for (int round = 0; round < 8; ++round) {
        cudaEventRecord(e0);
        launch(iters);
        cudaEventRecord(e1);
        cudaEventSynchronize(e1);
        cudaEventElapsedTime(&ms, e0, e1);
        if (cudaGetLastError() != cudaSuccess) { printf("%s: launch failed\n", name); exit(1); }
        if (ms >= 0.8 * target_ms) break;
        iters = static_cast<int>(iters * target_ms / (ms > 0.01f ? ms : 0.01f));
    }
    std::vector<long long> c(num_sms);
    cudaMemcpy(c.data(), cycles, num_sms * sizeof(long long), cudaMemcpyDeviceToHost);
    double cyc = 0;
    for (long long x : c) cyc += x;
    cyc /= num_sms;
    return {ms, iters, cyc / iters, cyc / (ms * 1e3)};
}
