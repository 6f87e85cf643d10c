// The 256-wide FP8 m-grouped mainloop's skeleton (docs/PERF.md, session 42): the kernel's tile (128 x 256,
// two 64 x 128 products a warpgroup and k-block, in turns) and stage ring (three stages of a 128-deep
// k-block, full and empty barriers, a producer thread), with the promotion, but no scheduler, scales
// or epilogue. kMode 0: the producer only arrives (no bytes); 1: each stage's 48 KB by two 1-D bulk
// copies from a 16 MB (L2-resident) region; 2: the same from 2 GB; 3: by two 2-D TMA boxes with the
// kernel's 128-byte swizzle from two 16 MB tensors. Both products promote into one set of 64 sums
// (two sets, as the kernel keeps, spill in this skeleton). kAblate (mode 0 only) takes pieces of the
// handshake out, one bit each, to find which of them cost the clocks between this skeleton and the
// structure benchmark (docs/PERF.md, session 49): kFixedStage, every k-block's MMAs and scales read
// stage 0 (the barriers still go round the ring); kNoFullWait, no wait on the full barrier; kNoRelease,
// no arrival on the empty one (with kNoFullWait; the producer then does nothing); kOneScale,
// one scale load a product (the structure benchmark's) instead of the row and block scales and their
// products; kPerThreadWarpgroup (any mode), the warpgroup index per thread as session 42's skeleton
// had it, not uniform.
//   nvcc -std=c++17 -O3 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
//        -I deep_gemm/include scripts/microbench/fp8_mainloop_ring.cu -o /tmp/fp8_mainloop_ring -lcuda
//   /tmp/fp8_mainloop_ring [ms a launch]   (5: bursts; 400: the power-capped steady state)
#include <cuda.h>
#include "timing.cuh"
#include <deep_gemm/ptx/tma.cuh>
#include <deep_gemm/mma/wgmma.cuh>
#include <deep_gemm/mma/wgmma_fp8.cuh>
#include <deep_gemm/ptx/barrier.cuh>
#include <deep_gemm/ptx/utils.cuh>

using namespace deep_gemm;
using namespace deep_gemm::mma;

constexpr int kBytesA = 128 * 128, kBytesB = 256 * 128, kScaleBytes = 1024;
constexpr int kStageBytes = kBytesA + kBytesB + kScaleBytes;

__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, ptx::MBarrier* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 :: "r"(ptx::smem_addr(dst)), "l"(src), "r"(bytes), "r"(ptx::smem_addr(bar)) : "memory");
}

__global__ void fill_random(uint32_t* p, uint64_t n) {
    for (uint64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        p[i] = random_e4m3x4(static_cast<uint32_t>(i), 0);
    }
}

struct Maps { CUtensorMap a, b; };

enum Ablate : int { kFixedStage = 1, kNoFullWait = 2, kNoRelease = 4, kOneScale = 8, kPerThreadWarpgroup = 16 };

template <int kStages, int kMode, bool kWarpRelease, int kAblate = 0>
__global__ void __launch_bounds__(384, 1) bench(int iters, const uint8_t* src, uint64_t src_blocks, float* out,
                                                long long* cycles, const __grid_constant__ Maps maps) {
    extern __shared__ __align__(1024) uint8_t smem[];
    ptx::MBarrier* full = reinterpret_cast<ptx::MBarrier*>(smem + kStages * kStageBytes);
    ptx::MBarrier* empty = full + kStages;
    // fixed random e4m3 operands in every stage (kMode 0 never overwrites them)
    for (int i = threadIdx.x; i < kStages * kStageBytes / 4; i += blockDim.x) {
        const uint32_t h = random_u32(i, blockIdx.x * 97u);
        const bool scale = (i * 4) % kStageBytes >= kBytesA + kBytesB;
        reinterpret_cast<uint32_t*>(smem)[i] = scale ? __float_as_uint(1.0f + (h & 255) * 1e-3f) : (h & 0x77777777u);
    }
    if (threadIdx.x == 0) {
        for (int s = 0; s < kStages; ++s)
            full[s].init(1), empty[s].init(kWarpRelease ? 8 : 256);
        ptx::fence_barrier_init();
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    if (threadIdx.x >= 256) {
        ptx::warpgroup_reg_dealloc<40>();
        if (threadIdx.x == 256 and not (kAblate & kNoRelease)) {  // (no releases: nothing would free a stage)
            int stage = 0, phase = 0;
            for (int it = 0; it < iters; ++it) {
                empty[stage].wait(phase ^ 1);
                if constexpr (kMode == 0) {
                    full[stage].arrive();
                } else if constexpr (kMode == 3) {  // 2-D swizzled TMA boxes from [8192, 2048] e4m3 tensors (16 MB each)
                    full[stage].arrive_and_expect_tx(kBytesA + kBytesB);
                    const int k = (it % 16) * 128, tile = it / 16;
                    ptx::tma_load_2d(smem + stage * kStageBytes, &maps.a, &full[stage], k, ((blockIdx.x + tile) % 64) * 128);
                    ptx::tma_load_2d(smem + stage * kStageBytes + kBytesA, &maps.b, &full[stage], k,
                                     ((blockIdx.x * 3 + tile) % 32) * 256);
                } else {
                    full[stage].arrive_and_expect_tx(kBytesA + kBytesB);
                    const uint64_t block = (static_cast<uint64_t>(it) * 131 + blockIdx.x * 7) % src_blocks;
                    const uint8_t* base = src + block * (kBytesA + kBytesB);
                    bulk_load(smem + stage * kStageBytes, base, kBytesA, &full[stage]);
                    bulk_load(smem + stage * kStageBytes + kBytesA, base + kBytesA, kBytesB, &full[stage]);
                }
                if (++stage == kStages)
                    stage = 0, phase ^= 1;
            }
        }
    } else {
        ptx::warpgroup_reg_alloc<232>();
        // (uniform, as the kernel makes it; kPerThreadWarpgroup: threadIdx.x / 128, as session 42 built
        // this skeleton, which ptxas recomputed from the thread index every k-block, with a shuffle of
        // the stage index)
        const uint32_t wg = (kAblate & kPerThreadWarpgroup) ? threadIdx.x / 128 : ptx::warpgroup_idx();
        const uint32_t row = wg * 64 + (threadIdx.x % 128 / 32) * 16 + ptx::lane_idx() / 4;
        const uint64_t desc_a0 = warp_uniform_desc(make_operand_desc<Major::kKMajor>(smem + wg * 64 * 128, 0));
        const uint64_t desc_b0 = warp_uniform_desc(make_operand_desc<Major::kKMajor>(smem + kBytesA, 0));
        float part[64], acc[64];  // (both products promote into one set: 128 would spill here)
        #pragma unroll
        for (int i = 0; i < 64; ++i)
            acc[i] = 0.0f;
        if (wg == 1)
            ptx::named_barrier_arrive(9, 256);
        int stage = 0, phase = 0;
        const long long start = clock64();
        for (int it = 0; it < iters; ++it) {
            const uint32_t s = (kAblate & kFixedStage) ? 0 : __shfl_sync(0xffffffff, stage, 0);
            const float* scales = reinterpret_cast<const float*>(smem + s * kStageBytes + kBytesA + kBytesB);
            #pragma unroll
            for (int p = 0; p < 2; ++p) {
                if (p == 0 and not (kAblate & kNoFullWait))
                    full[stage].wait(phase);
                // (the row and block scales read from the stage as the kernel reads them; never rewritten)
                float r0, r1;
                if constexpr ((kAblate & kOneScale) != 0) {
                    r0 = r1 = ptx::ld_shared_f32(scales + (it + p) % 256);
                } else {
                    const float b = ptx::ld_shared_f32(scales + 200 + p);
                    r0 = ptx::ld_shared_f32(scales + row) * b, r1 = ptx::ld_shared_f32(scales + row + 8) * b;
                }
                ptx::named_barrier_sync(8 + (wg ^ 1), 256);
                warpgroup_fence_operand(part);
                warpgroup_arrive();
                #pragma unroll
                for (int k = 0; k < 4; ++k)
                    WGMMAFp8<128>::mma(advance_desc(desc_a0, s * kStageBytes + k * 32),
                                       advance_desc(desc_b0, s * kStageBytes + p * 128 * 128 + k * 32), part, k > 0);
                warpgroup_commit_batch();
                ptx::named_barrier_arrive(8 + wg, 256);
                warpgroup_fence_operand(part);
                warpgroup_wait<0>();
                warpgroup_fence_operand(part);
                if (p == 1) {
                    if constexpr (kWarpRelease) {
                        __syncwarp();
                        if (ptx::lane_idx() == 0)
                            empty[stage].arrive();
                    } else if constexpr ((kAblate & kNoRelease) == 0) {
                        empty[stage].arrive();
                    }
                    if (++stage == kStages)
                        stage = 0, phase ^= 1;
                }
                #pragma unroll
                for (int i = 0; i < 64; ++i)
                    acc[i] = fmaf(part[i], ((i / 2) % 2) ? r1 : r0, acc[i]);
            }
        }
        const long long stop = clock64();
        if (wg == 0)
            ptx::named_barrier_sync(9, 256);
        #pragma unroll
        for (int i = 0; i < 64; ++i)
            out[(blockIdx.x * 256 + threadIdx.x) * 128 + i] = acc[i];
        if (threadIdx.x == 0)
            cycles[blockIdx.x] = stop - start;
    }
}

template <int kStages, int kMode, bool kWarpRelease, int kAblate = 0>
void run(const char* name, int num_sms, const uint8_t* src, uint64_t src_blocks, float* out, long long* cycles,
         double target_ms, const Maps& maps) {
    constexpr int smem = kStages * kStageBytes + 2 * kStages * 8;
    static_assert((kAblate & ~kPerThreadWarpgroup) == 0 or kMode == 0, "the ablations feed no bytes");
    static_assert(not (kAblate & kNoRelease) or (kAblate & kNoFullWait), "without releases the ring stops");
    auto kernel = bench<kStages, kMode, kWarpRelease, kAblate>;
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    const Timing t = time_launches(name, num_sms, cycles, target_ms, [&](int iters) {
        kernel<<<num_sms, 384, smem>>>(iters, src, src_blocks, out, cycles, maps);
    });
    const double macs = 2.0 * 2 * 64 * 128 * 128;  // a k-block: both warpgroups, two products
    printf("%-44s %5.0f ms %8.1f clk/k-block %6.1f%% of peak a clock %5.0f MHz %6.0f TFLOPS %6.2f TB/s loaded\n", name, t.ms,
           t.cycles_per_iter, 100.0 * macs / (4096.0 * t.cycles_per_iter), t.mhz,
           2.0 * macs * t.iters * num_sms / (t.ms * 1e9), kMode ? 48.0 * 1024 * t.iters * num_sms / (t.ms * 1e9) : 0.0);
}

int main(int argc, char** argv) {
    const double target_ms = argc > 1 ? atof(argv[1]) : 50.0;
    int num_sms = 0;
    cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, 0);
    const uint64_t block = kBytesA + kBytesB, big_blocks = (2ull << 30) / block, l2_blocks = (16ull << 20) / block;
    uint8_t* src;
    cudaMalloc(&src, big_blocks * block);
    fill_random<<<1024, 256>>>(reinterpret_cast<uint32_t*>(src), big_blocks * block / 4);
    float* out;
    long long* cycles;
    cudaMalloc(&out, num_sms * 256 * 128 * sizeof(float));
    cudaMalloc(&cycles, num_sms * sizeof(long long));
    // two [8192, 2048] e4m3 tensors inside src (the first 32 MB), 128-byte swizzle, boxes {128, 128} and {128, 256}
    Maps maps;
    const auto encode = [&](CUtensorMap* map, const uint8_t* base, uint32_t box_rows) {
        cuuint64_t dims[2] = {2048, 8192}, strides[1] = {2048};
        cuuint32_t box[2] = {128, box_rows}, elem[2] = {1, 1};
        CUresult r = cuTensorMapEncodeTiled(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<uint8_t*>(base), dims, strides,
                                            box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
        if (r != CUDA_SUCCESS) { printf("encode failed %d\n", r); exit(1); }
    };
    encode(&maps.a, src, 128);
    encode(&maps.b, src + (16 << 20), 256);
    printf("target %.0f ms a launch, %d CTAs; 128 x 256 tile, k-block 128, turns, promotion\n", target_ms, num_sms);
    run<3, 0, false>("3 stages, no loads, thread releases", num_sms, src, l2_blocks, out, cycles, target_ms, maps);
    run<3, 0, true>("3 stages, no loads, warp releases", num_sms, src, l2_blocks, out, cycles, target_ms, maps);
    run<3, 0, false, kPerThreadWarpgroup>("  + warpgroup index per thread (session 42's)", num_sms, src, l2_blocks,
                                           out, cycles, target_ms, maps);
    // the handshake's pieces taken out (no loads, thread releases)
    run<3, 0, false, kFixedStage>("  - every k-block on stage 0", num_sms, src, l2_blocks, out, cycles, target_ms, maps);
    run<3, 0, false, kNoFullWait>("  - no full wait", num_sms, src, l2_blocks, out, cycles, target_ms, maps);
    run<3, 0, false, kNoFullWait | kNoRelease>("  - no full wait, no release", num_sms, src, l2_blocks, out, cycles,
                                                target_ms, maps);
    run<3, 0, false, kOneScale>("  - one scale a product", num_sms, src, l2_blocks, out, cycles, target_ms, maps);
    run<3, 0, false, kFixedStage | kNoFullWait | kNoRelease>("  - stage 0, no full wait, no release", num_sms, src,
                                                              l2_blocks, out, cycles, target_ms, maps);
    run<3, 0, false, kFixedStage | kNoFullWait | kNoRelease | kOneScale>("  - all four", num_sms, src, l2_blocks, out,
                                                                          cycles, target_ms, maps);
    run<3, 1, false>("3 stages, L2 loads (16 MB), thread releases", num_sms, src, l2_blocks, out, cycles, target_ms, maps);
    run<3, 1, true>("3 stages, L2 loads (16 MB), warp releases", num_sms, src, l2_blocks, out, cycles, target_ms, maps);
    run<4, 1, false>("4 stages, L2 loads (16 MB), thread releases", num_sms, src, l2_blocks, out, cycles, target_ms, maps);
    run<3, 3, false>("3 stages, 2-D TMA boxes (32 MB), thread releases", num_sms, src, l2_blocks, out, cycles, target_ms, maps);
    run<3, 3, false, kPerThreadWarpgroup>("  + warpgroup index per thread (session 42's)", num_sms, src, l2_blocks,
                                           out, cycles, target_ms, maps);
    run<3, 2, false>("3 stages, loads from 2 GB, thread releases", num_sms, src, big_blocks, out, cycles, target_ms, maps);
    return 0;
}
