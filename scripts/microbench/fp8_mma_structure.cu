// The FP8 m-grouped mainloop's MMA structure alone (docs/PERF.md, session 42): two math warpgroups a
// CTA, one CTA an SM, issue the four k32 MMAs of a 128-deep k-block into fresh registers, wait for
// them and promote them into fp32 sums, over and over, on fixed random e4m3 operands in shared memory:
// no loads, no stage ring, no epilogue. Prints clocks a k-block and the share of the tensor cores'
// FP8 rate (4096 MACs a clock an SM) per product width, with and without MMA turns.
//   nvcc -std=c++17 -O3 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
//        -I deep_gemm/include scripts/microbench/fp8_mma_structure.cu -o /tmp/fp8_mma_structure
//   /tmp/fp8_mma_structure [ms a launch]   (5: bursts; 400: the power-capped steady state)
// (Every product is promoted: ptxas drops MMAs whose products are never read.) kScaleMma: the FP8 weight
// gradient's k-block (docs/PERF.md, session 49): before the FP8 MMAs, in a batch of its own, the
// m64n128k8 TF32 MMA that makes each accumulator's row x column scale product (mma::tc_scales, its A
// and B tiles and the zero tile fixed in shared memory), and the promotion multiplies by those.
#include "timing.cuh"
#include <deep_gemm/mma/wgmma.cuh>
#include <deep_gemm/mma/wgmma_fp8.cuh>
#include <deep_gemm/mma/wgmma_tf32.cuh>
#include <deep_gemm/ptx/utils.cuh>

using namespace deep_gemm;
using namespace deep_gemm::mma;

// The TF32 scale tiles (kScaleMma): A's 128 rows and B's 128 columns, 16 bytes each (k = 0..3), then a
// zero tile for k = 4..7, as mma::tc_scales lays them out in a stage.
constexpr int kTileBytesTf32 = 128 * 16;

template <int N, int kProducts, bool kTurns, bool kScaleMma = false>
__global__ void __launch_bounds__(256, 1) bench(int iters, float* out, long long* cycles) {
    static_assert(not kScaleMma or (N == 128 and kProducts == 1), "the weight gradient's 128 x 128 k-block");
    extern __shared__ __align__(1024) uint8_t smem[];
    constexpr int kBytesA = 2 * 64 * 128, kBytesB = kProducts * N * 128;
    for (int i = threadIdx.x; i < (kBytesA + kBytesB) / 4; i += blockDim.x) {
        reinterpret_cast<uint32_t*>(smem)[i] = random_e4m3x4(i, blockIdx.x * 97u);
    }
    float* scales = reinterpret_cast<float*>(smem + kBytesA + kBytesB);
    for (int i = threadIdx.x; i < 256; i += blockDim.x)
        scales[i] = 1.0f + 0.001f * i;
    uint8_t* tf32_tiles = smem + kBytesA + kBytesB + 1024;  // A's, B's, then the zero tile
    if constexpr (kScaleMma) {
        for (int i = threadIdx.x; i < 3 * kTileBytesTf32 / 4; i += blockDim.x)
            reinterpret_cast<float*>(tf32_tiles)[i] = i < 2 * kTileBytesTf32 / 4 ? 1.0f + 0.001f * (i % 97) : 0.0f;
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    const uint32_t wg = threadIdx.x / 128;
    const uint64_t desc_a = warp_uniform_desc(make_operand_desc<Major::kKMajor>(smem + wg * 64 * 128, 0));
    const uint64_t desc_b = warp_uniform_desc(make_operand_desc<Major::kKMajor>(smem + kBytesA, 0));
    const uint32_t tiles = ptx::smem_addr(tf32_tiles), zeros = tiles + 2 * kTileBytesTf32;
    const uint32_t tile_a = tiles + wg * 64 * 16, tile_b = tiles + kTileBytesTf32;
    const uint64_t desc_sa = warp_uniform_desc(make_unswizzled_desc(tile_a, zeros - tile_a, 128));
    const uint64_t desc_sb = warp_uniform_desc(make_unswizzled_desc(tile_b, zeros - tile_b, 128));
    float part[N / 2], products[kScaleMma ? N / 2 : 1];
    float acc[kProducts * N / 2];
    #pragma unroll
    for (int i = 0; i < kProducts * N / 2; ++i)
        acc[i] = 0.0f;
    if (kTurns and wg == 1)
        ptx::named_barrier_arrive(9, 256);
    const long long start = clock64();
    for (int it = 0; it < iters; ++it) {
        #pragma unroll
        for (int p = 0; p < kProducts; ++p) {
            const float s = ptx::ld_shared_f32(scales + (it + p) % 256);
            if (kTurns)
                ptx::named_barrier_sync(8 + (wg ^ 1), 256);
            if constexpr (kScaleMma) {
                warpgroup_arrive();
                WGMMATf32<128>::mma(desc_sa, desc_sb, products);
                warpgroup_commit_batch();
                warpgroup_fence_operand(products);
            }
            warpgroup_fence_operand(part);
            warpgroup_arrive();
            #pragma unroll
            for (int k = 0; k < 4; ++k)
                WGMMAFp8<N>::mma(advance_desc(desc_a, k * 32), advance_desc(desc_b, p * N * 128 + k * 32), part, k > 0);
            warpgroup_commit_batch();
            if (kTurns)
                ptx::named_barrier_arrive(8 + wg, 256);
            warpgroup_fence_operand(part);
            warpgroup_wait<0>();
            warpgroup_fence_operand(part);
            if constexpr (kScaleMma) {
                warpgroup_fence_operand(products);
                #pragma unroll
                for (int i = 0; i < N / 2; ++i)
                    acc[i] = fmaf(part[i], products[i], acc[i]);
            } else {
                #pragma unroll
                for (int i = 0; i < N / 2; ++i)
                    acc[p * N / 2 + i] = fmaf(part[i], s, acc[p * N / 2 + i]);
            }
        }
    }
    const long long stop = clock64();
    if (kTurns and wg == 0)
        ptx::named_barrier_sync(9, 256);
    float sum = 0.0f;
    #pragma unroll
    for (int i = 0; i < kProducts * N / 2; ++i)
        sum += acc[i];
    out[blockIdx.x * 256 + threadIdx.x] = sum;
    if (threadIdx.x == 0)
        cycles[blockIdx.x] = stop - start;
}

template <int N, int kProducts, bool kTurns, bool kScaleMma = false>
void run(const char* name, int num_sms, float* out, long long* cycles, double target_ms) {
    constexpr int smem = 2 * 64 * 128 + kProducts * N * 128 + 1024 + (kScaleMma ? 3 * kTileBytesTf32 : 0);
    auto kernel = bench<N, kProducts, kTurns, kScaleMma>;
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    const Timing t = time_launches(name, num_sms, cycles, target_ms,
                                   [&](int iters) { kernel<<<num_sms, 256, smem>>>(iters, out, cycles); });
    const double macs_per_kblock = 2.0 * kProducts * 64 * N * 128;  // both warpgroups
    printf("%-40s %6.0f ms  %8.1f clk/k-block  %5.1f%% of 4096 MAC/clk  %5.0f MHz  %6.0f TFLOPS\n", name, t.ms,
           t.cycles_per_iter, 100.0 * macs_per_kblock / (4096.0 * t.cycles_per_iter), t.mhz,
           2.0 * macs_per_kblock * t.iters * num_sms / (t.ms * 1e9));
}

int main(int argc, char** argv) {
    const double target_ms = argc > 1 ? atof(argv[1]) : 50.0;
    int num_sms = 0;
    cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, 0);
    float* out;
    long long* cycles;
    cudaMalloc(&out, num_sms * 256 * sizeof(float));
    cudaMalloc(&cycles, num_sms * sizeof(long long));
    printf("target %.0f ms a launch, %d CTAs of two math warpgroups\n", target_ms, num_sms);
    run<128, 1, false>("64 x 128 products, one a k-block", num_sms, out, cycles, target_ms);
    run<128, 1, true>("64 x 128 products, one a k-block, turns", num_sms, out, cycles, target_ms);
    run<128, 2, false>("64 x 128 products, two a k-block", num_sms, out, cycles, target_ms);
    run<128, 2, true>("64 x 128 products, two a k-block, turns", num_sms, out, cycles, target_ms);
    run<192, 1, false>("64 x 192 products, one a k-block", num_sms, out, cycles, target_ms);
    run<192, 1, true>("64 x 192 products, one a k-block, turns", num_sms, out, cycles, target_ms);
    // (% of the FP8 rate counts the FP8 MACs only: the TF32 MMA is a quarter more tensor time at most)
    run<128, 1, false, true>("64 x 128, TF32 scale products (wgrad)", num_sms, out, cycles, target_ms);
    run<128, 1, true, true>("64 x 128, TF32 scale products, turns", num_sms, out, cycles, target_ms);
    return 0;
}
