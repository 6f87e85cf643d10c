"""Swaps every kernel the MoE orchestration calls for its PyTorch emulation
(`deep_gemm.testing.emulate`), so the orchestration runs on a CPU in any dtype."""
from typing import Callable

import deep_gemm.moe.forward as moe_forward_module
import megamoe_bwd.backward as moe_backward_module
import deep_gemm.moe.ep as ep_module
from deep_gemm.testing import emulate

REPLACEMENTS = [
    (moe_forward_module, "m_grouped_bf16_gemm_nt_contiguous", emulate.m_grouped_gemm_nt),
    (moe_forward_module, "m_grouped_bf16_gemm_nt_swiglu_contiguous", emulate.m_grouped_gemm_nt_swiglu),
    (moe_forward_module, "moe_combine_bf16", emulate.moe_combine),
    (moe_forward_module, "moe_swiglu_fwd_bf16", emulate.moe_swiglu_fwd),
    (moe_forward_module, "moe_gather_rows_bf16", emulate.moe_gather_rows),
    (moe_backward_module, "moe_combine_bf16", emulate.moe_combine),
    (moe_backward_module, "moe_swiglu_bwd_bf16", emulate.moe_swiglu_bwd),
    (moe_backward_module, "m_grouped_bf16_gemm_nn_contiguous", emulate.m_grouped_gemm_nn),
    (moe_backward_module, "m_grouped_bf16_gemm_nn_swiglu_bwd_contiguous", emulate.m_grouped_gemm_nn_swiglu_bwd),
    (moe_backward_module, "k_grouped_bf16_gemm_tn_contiguous", emulate.k_grouped_gemm_tn),
    (ep_module, "moe_combine_bf16", emulate.moe_combine),
    (ep_module, "ep_wait_flags", emulate.ep_wait_flags),
]


def patch_kernels(setattr_fn: Callable = setattr) -> None:
    """Applies every replacement with `setattr_fn` (pytest's monkeypatch.setattr to undo them)."""
    for module, name, emulation in REPLACEMENTS:
        setattr_fn(module, name, emulation)
