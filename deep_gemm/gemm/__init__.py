"""The grouped GEMMs: m-grouped (forward, data gradients) and k-grouped (weight gradients), bf16 and
blockwise FP8."""
from .k_grouped_bf16 import k_grouped_bf16_gemm_tn_contiguous
from .m_grouped_bf16 import (
    m_grouped_bf16_gemm_nn_contiguous,
    m_grouped_bf16_gemm_nt_contiguous,
    m_grouped_bf16_gemm_nt_swiglu_contiguous,
)
from .k_grouped_fp8 import k_grouped_fp8_gemm_tn_contiguous
from .m_grouped_fp8 import m_grouped_fp8_gemm_nt_contiguous, m_grouped_fp8_gemm_nt_swiglu_contiguous
