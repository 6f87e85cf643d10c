#pragma once
// SwiGLU, a = silu(g) * u, and its derivative, in fp32.

namespace deep_gemm::epilogue {

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }

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
