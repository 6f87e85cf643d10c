"""deep_gemm: Hopper (sm_90a) bf16 grouped GEMMs and the fused Mixture-of-Experts layer.

Kernels are CUDA C++ compiled at run time (see `deep_gemm.jit`); importing this package
needs no GPU.
"""
from .gemm import (
    k_grouped_bf16_gemm_tn_contiguous,
    m_grouped_bf16_gemm_nn_contiguous,
    m_grouped_bf16_gemm_nt_contiguous,
)
from .utils import get_num_sms, set_num_sms

__all__ = [
    "get_num_sms",
    "set_num_sms",
    "m_grouped_bf16_gemm_nt_contiguous",
    "m_grouped_bf16_gemm_nn_contiguous",
    "k_grouped_bf16_gemm_tn_contiguous",
]
