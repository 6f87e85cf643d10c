#pragma once
// Small PTX wrappers shared by every kernel: lane/warp ids, register budgets, fences.
#include <cstdint>

namespace deep_gemm::ptx {

__device__ __forceinline__ uint32_t lane_idx() {
    uint32_t lane;
    asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
    return lane;
}

// The thread's warpgroup, as a value the compiler knows is the same across the warp: the MMA
// descriptors built from it then stay in uniform registers (threadIdx.x / 128 alone does not).
__device__ __forceinline__ uint32_t warpgroup_idx() {
    return __shfl_sync(0xffffffff, threadIdx.x / 128, 0);
}

// Nanoseconds of the GPU's global timer (coarse ticks): for timeouts.
__device__ __forceinline__ uint64_t global_timer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// 2^x by the MUFU alone, results below the normal range flushed to zero (`__expf` without
// --use_fast_math adds a range test and two scalings to keep them).
__device__ __forceinline__ float ex2_approx_ftz(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

// Warp index that the compiler knows is uniform across the warp.
__device__ __forceinline__ uint32_t warp_idx() {
    return __shfl_sync(0xffffffff, threadIdx.x / 32, 0);
}

// Register re-balancing between warpgroups (sm_90a). Needs a register cap at kernel entry,
// i.e. `__launch_bounds__(threads, 1)`.
template <uint32_t kRegs>
__device__ __forceinline__ void warpgroup_reg_alloc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(kRegs));
}

template <uint32_t kRegs>
__device__ __forceinline__ void warpgroup_reg_dealloc() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(kRegs));
}

// Generic-proxy writes to shared memory become visible to the async proxy (TMA, WGMMA).
__device__ __forceinline__ void fence_view_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Named barrier over `num_threads` threads (a multiple of 32); id 0 is __syncthreads.
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t num_threads) {
    asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(num_threads) : "memory");
}

// Arrive on a named barrier without waiting (the other `num_threads` minus these wait in
// named_barrier_sync).
__device__ __forceinline__ void named_barrier_arrive(uint32_t id, uint32_t num_threads) {
    asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(num_threads) : "memory");
}

__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

__device__ __forceinline__ void st_shared_u16(void* ptr, uint16_t value) {
    asm volatile("st.shared.u16 [%0], %1;\n" :: "r"(smem_addr(ptr)), "h"(value) : "memory");
}

__device__ __forceinline__ void st_shared_u32(void* ptr, uint32_t value) {
    asm volatile("st.shared.u32 [%0], %1;\n" :: "r"(smem_addr(ptr)), "r"(value) : "memory");
}

__device__ __forceinline__ void st_shared_v2(void* ptr, float x, float y) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" :: "r"(smem_addr(ptr)), "f"(x), "f"(y) : "memory");
}

__device__ __forceinline__ uint4 ld_shared_v4(const void* ptr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(smem_addr(ptr)));
    return v;
}

__device__ __forceinline__ float2 ld_shared_v2(const void* ptr) {
    float2 v;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(smem_addr(ptr)));
    return v;
}

__device__ __forceinline__ float ld_shared_f32(const void* ptr) {
    float v;
    asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(smem_addr(ptr)));
    return v;
}

__device__ __forceinline__ void st_shared_v4(void* ptr, uint4 v) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n"
                 :: "r"(smem_addr(ptr)), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// stmatrix .x4: four 8 x 8 b16 matrices to shared memory. Lanes 8q..8q+7 give the addresses of matrix
// q's eight 16-byte rows; each thread's value q is its pair of matrix q (row lane / 4, columns
// 2 (lane % 4) and the next), the layout of an MMA accumulator's 8 x 8 pieces.
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t v0, uint32_t v1, uint32_t v2, uint32_t v3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 :: "r"(addr), "r"(v0), "r"(v1), "r"(v2), "r"(v3) : "memory");
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
    uint32_t out;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(out) : "f"(hi), "f"(lo));
    return out;
}

// This CTA's rank in its thread-block cluster.
__device__ __forceinline__ uint32_t cluster_cta_rank() {
    uint32_t rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    return rank;
}

// Every thread of every CTA of the cluster: what each did before is visible to all after
// (shared memory of the cluster included). Not `.aligned`: threads of a warp may reach it apart.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\n"
                 "barrier.cluster.wait.acquire;\n" ::: "memory");
}

template <typename T>
__host__ __device__ constexpr T ceil_div(T a, T b) { return (a + b - 1) / b; }

template <typename T>
__host__ __device__ constexpr T max_of(T a, T b) { return a > b ? a : b; }

// offsets[i] clamped into [lo, hi] (negative offsets read as 0): group boundaries read on the GPU
// can never reach out of range, whatever the caller passed.
__device__ __forceinline__ uint32_t clamped_offset(const int* offsets, uint32_t i, uint32_t lo, uint32_t hi) {
    return min(max(static_cast<uint32_t>(max(__ldg(offsets + i), 0)), lo), hi);
}

}  // namespace deep_gemm::ptx
