#pragma once
// SwiGLU, a = silu(g) * u, and its derivative, in fp32.
#include "../ptx/utils.cuh"

namespace deep_gemm::epilogue {

// The approximate division is one MUFU.RCP: an IEEE `1.0f / d` calls a slow-path subroutine
// whenever d > 2^126 (x < -87), and a warp pays it if any lane does. For such d it returns 0,
// the sigmoid's limit. e^-x as `__expf(-x)` computes it (one FMUL by -log2(e), one MUFU.EX2),
// flushed to zero below the normal range: 1 + e^-x is then 1 either way, so the sigmoid's bits
// are `__expf`'s without its range test and scalings.
__device__ __forceinline__ float sigmoid(float x) {
    return __fdividef(1.0f, 1.0f + ptx::ex2_approx_ftz(x * -1.44269504088896341f));
}

struct SwiGLUGrad {
    float act, d_gate, d_up;
};

// Forward value and gradients given dL/da = `d_act`.
__device__ __forceinline__ SwiGLUGrad swiglu_grad(float gate, float up, float d_act) {
    const float s = sigmoid(gate), silu = gate * s;
    return {silu * up, d_act * up * s * (1.0f + gate * (1.0f - s)), d_act * silu};
}

__device__ __forceinline__ float swiglu(float gate, float up) { return gate * sigmoid(gate) * up; }

}  // namespace deep_gemm::epilogue
