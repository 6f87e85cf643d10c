"""Launcher of the MoE combine kernel (impls/moe_combine.cuh)."""
from __future__ import annotations

import functools
from typing import Optional

import torch

from ..jit.runtime import build_kernel, pack_params
from ..utils import get_num_sms
from .layout import RoutingLayout

_NUM_THREADS = 256


@functools.lru_cache(maxsize=None)
def _kernel():
    return build_kernel("moe_combine.cuh", "MoECombineParams", "moe_combine_impl", [_NUM_THREADS], _NUM_THREADS, 0)


def moe_combine_bf16(rows: torch.Tensor, layout: RoutingLayout, weights: Optional[torch.Tensor],
                     out: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_{valid k} w[t, k] * rows[slot_row[t, k]]`` (w = 1 if `weights` is None).

    rows ``[T * K, H]`` bf16 in routed-row order (rows of empty slots are never read), out
    ``[T, H]`` bf16, weights ``[T, K]`` (summed in fp32). H must be a multiple of 8.
    Deterministic: slots are summed in order, without atomics.
    """
    num_tokens, num_topk = layout.slot_row.shape
    hidden = rows.shape[1]
    if rows.dtype != torch.bfloat16 or out.dtype != torch.bfloat16 or tuple(out.shape) != (num_tokens, hidden) \
            or not out.is_contiguous():
        raise ValueError(f"rows must be bf16 [T*K, H] and out a contiguous bf16 [{num_tokens}, {hidden}]")
    if hidden % 8:
        raise ValueError(f"H = {hidden} must be a multiple of 8")
    if num_tokens == 0:
        return out
    rows = rows.contiguous()
    if weights is not None:
        weights = weights.to(torch.float32).contiguous()
    slot_row, slot_valid = layout.slot_row.contiguous(), layout.slot_valid.contiguous()
    params = pack_params([], [rows.data_ptr(), slot_row.data_ptr(), slot_valid.data_ptr(),
                              0 if weights is None else weights.data_ptr(), out.data_ptr()],
                         [num_tokens, hidden, num_topk])
    device = rows.device.index
    _kernel().launch(params, min(num_tokens, 8 * get_num_sms(device)), device)
    return out
