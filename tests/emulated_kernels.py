"""Swaps every kernel the MoE orchestration calls for its PyTorch emulation
(`deep_gemm.testing.emulate`), in every module of deep_gemm and megamoe_bwd that holds it, so
the orchestration runs on a CPU in any dtype; and `emulated_mega_moe`, the differentiable layer
on that path."""
import sys
from typing import Callable

import torch

import deep_gemm
import megamoe_bwd  # noqa: F401  (imports the modules that hold kernels, the EP ones included)
from deep_gemm.moe import MegaMoEHandle, build_routing_layout, kernels, kernels_fp8
from deep_gemm.moe.forward import moe_forward
from deep_gemm.moe.fp8 import fp8_moe_forward, fp8_weights
from deep_gemm.testing import emulate
from megamoe_bwd import mega_moe_backward

# (kernel, its emulation): every kernel the orchestration calls.
PAIRS = [
    (deep_gemm.m_grouped_bf16_gemm_nt_contiguous, emulate.m_grouped_gemm_nt),
    (deep_gemm.m_grouped_bf16_gemm_nn_contiguous, emulate.m_grouped_gemm_nn),
    (deep_gemm.m_grouped_bf16_gemm_nt_swiglu_contiguous, emulate.m_grouped_gemm_nt_swiglu),
    (deep_gemm.k_grouped_bf16_gemm_tn_contiguous, emulate.k_grouped_gemm_tn),
    (deep_gemm.m_grouped_fp8_gemm_nt_contiguous, emulate.m_grouped_fp8_gemm_nt),
    (deep_gemm.m_grouped_fp8_gemm_nt_swiglu_contiguous, emulate.m_grouped_fp8_gemm_nt_swiglu),
    (deep_gemm.k_grouped_fp8_gemm_tn_contiguous, emulate.k_grouped_fp8_gemm_tn),
    (kernels.moe_combine_bf16, emulate.moe_combine),
    (kernels.moe_gather_rows_bf16, emulate.moe_gather_rows),
    (kernels.moe_swiglu_fwd_bf16, emulate.moe_swiglu_fwd),
    (kernels.moe_swiglu_bwd_bf16, emulate.moe_swiglu_bwd),
    (kernels_fp8.moe_swiglu_bwd_fp8, emulate.moe_swiglu_bwd_fp8),
    (kernels.ep_wait_flags, emulate.ep_wait_flags),
]


def patch_kernels(setattr_fn: Callable = setattr) -> None:
    """Replaces each kernel by its emulation wherever a module of the two packages holds it,
    with `setattr_fn` (pytest's monkeypatch.setattr to undo it)."""
    emulation_of = {id(kernel): emulation for kernel, emulation in PAIRS}
    for name, module in list(sys.modules.items()):
        if module is None or name.split(".")[0] not in ("deep_gemm", "megamoe_bwd"):
            continue
        for attr, value in list(vars(module).items()):
            if id(value) in emulation_of:
                setattr_fn(module, attr, emulation_of[id(value)])


class EmulatedMegaMoE(torch.autograd.Function):
    """`megamoe_bwd.mega_moe` on the CPU, in any dtype: the layer's own orchestration (routing
    layout, `moe_forward`, `mega_moe_backward`) on the kernels' emulations (`patch_kernels` first)."""

    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, l1, l2, fp8=False):
        layout = build_routing_layout(topk_idx, topk_weights, l1.shape[0])
        y, x = torch.empty_like(x), x.contiguous()
        if fp8:  # (bf16 inputs: the quantization takes bf16)
            h = fp8_moe_forward(x, layout, topk_weights, fp8_weights(l1), fp8_weights(l2), y)
        else:
            h = moe_forward(x, layout, topk_weights, l1, l2, y)
        ctx.handle = MegaMoEHandle(layout, x, h, recipe="fp8" if fp8 else "bf16")
        ctx.save_for_backward(l1, l2)
        ctx.weights_dtype = topk_weights.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        l1, l2 = ctx.saved_tensors
        dx, dtopk_weights, dl1, dl2 = mega_moe_backward(dy.contiguous(), l1, l2, ctx.handle, weight_grad_dtype=l1.dtype)
        return dx, None, dtopk_weights.to(ctx.weights_dtype), dl1, dl2, None


def emulated_mega_moe(x, topk_idx, topk_weights, l1, l2, *, fp8=False):
    """`megamoe_bwd.mega_moe`'s signature, on `EmulatedMegaMoE`."""
    return EmulatedMegaMoE.apply(x, topk_idx, topk_weights, l1, l2, fp8)
