"""deep_gemm: Hopper (sm_90a) bf16 and blockwise-FP8 grouped GEMMs and the fused Mixture-of-Experts layer.

Kernels are CUDA C++ compiled at run time (see `deep_gemm.jit`); importing this package
needs no GPU.
"""
from .gemm import (
    k_grouped_bf16_gemm_tn_contiguous,
    k_grouped_fp8_gemm_tn_contiguous,
    m_grouped_bf16_gemm_nn_contiguous,
    m_grouped_bf16_gemm_nt_contiguous,
    m_grouped_bf16_gemm_nt_swiglu_contiguous,
    m_grouped_fp8_gemm_nt_contiguous,
    m_grouped_fp8_gemm_nt_swiglu_contiguous,
)
from .moe import Fp8WeightCopies, bf16_mega_moe, fp8_mega_moe, get_fp8_weight_copies, set_fp8_weight_copies
from .utils import get_num_sms, set_num_sms

# The backward, the autograd layer and expert parallelism live in the sibling package
# `megamoe_bwd`, which builds on this one. This hook re-exports them lazily, so deep_gemm's own
# modules never import it.
_REEXPORTS = {
    "mega_moe_backward": "megamoe_bwd",
    "mega_moe": "megamoe_bwd",
    "MegaMoE": "megamoe_bwd",
    "get_symm_buffer_for_mega_moe": "megamoe_bwd.ep",
}


def __getattr__(name: str):
    if name in _REEXPORTS:
        import importlib
        return getattr(importlib.import_module(_REEXPORTS[name]), name)
    raise AttributeError(f"module 'deep_gemm' has no attribute {name!r}")


__all__ = [
    "bf16_mega_moe",
    "fp8_mega_moe",
    "Fp8WeightCopies",
    "set_fp8_weight_copies",
    "get_fp8_weight_copies",
    "get_symm_buffer_for_mega_moe",
    "mega_moe_backward",
    "mega_moe",
    "MegaMoE",
    "get_num_sms",
    "set_num_sms",
    "m_grouped_bf16_gemm_nt_contiguous",
    "m_grouped_bf16_gemm_nn_contiguous",
    "m_grouped_bf16_gemm_nt_swiglu_contiguous",
    "k_grouped_bf16_gemm_tn_contiguous",
    "m_grouped_fp8_gemm_nt_contiguous",
    "m_grouped_fp8_gemm_nt_swiglu_contiguous",
    "k_grouped_fp8_gemm_tn_contiguous",
]
