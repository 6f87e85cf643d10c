"""Autograd for the single-GPU Mega MoE layer: `torch.library` custom ops (so `torch.compile`
keeps them whole instead of breaking the graph) and the functional `mega_moe`."""
from __future__ import annotations

import torch

from ._kernels import (Fp8WeightCopies, MegaMoEHandle, RoutingLayout, bf16_mega_moe, check_bool, fp8_mega_moe,
                       get_fp8_weight_copies)

from .backward import mega_moe_backward

Tensor = torch.Tensor


def _fp8_copy_shapes(l1: torch.Tensor, kept: bool) -> list[tuple[tuple, torch.dtype]]:
    """Shapes and dtypes of the forward op's last four outputs: where an FP8 forward keeps its
    copies of l1 and l2 for the data gradients (`kept`), those copies as the data gradients read
    them (each `Fp8Weights`' data_t and its scales ``[E, N / 128, K / 128]``), else four empty
    tensors (bf16, or FP8 under `Fp8WeightCopies.PER_GEMM`: the backward makes its own)."""
    num_experts, two_inter, hidden = l1.shape
    inter, e4m3 = two_inter // 2, torch.float8_e4m3fn
    if not kept:
        return [((0,), e4m3), ((0,), torch.float32)] * 2
    return [((num_experts, hidden, two_inter), e4m3), ((num_experts, two_inter // 128, hidden // 128), torch.float32),
            ((num_experts, inter, hidden), e4m3), ((num_experts, hidden // 128, inter // 128), torch.float32)]


@torch.library.custom_op("megamoe::forward", mutates_args=(), device_types="cuda")
def _forward_op(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, l1: torch.Tensor,
                l2: torch.Tensor, fp8: bool = False, keep_copies: bool = False
                ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    # (keep_copies: whether the FP8 forward keeps its weight copies for the backward, as the
    # copies' policy said when the op was called; the fake below needs it)
    y, handle = (fp8_mega_moe if fp8 else bf16_mega_moe)(x, topk_idx, topk_weights, l1, l2, training=True)
    layout = handle.layout
    if (handle.dgrad_weights is not None) != keep_copies:
        raise RuntimeError("the FP8 weight copies' policy changed inside a call of megamoe::forward")
    if keep_copies:  # (aliases of the cached copies, not the cache's own tensor objects)
        copies = [t.detach() for (data_t, scales_t) in handle.dgrad_weights for t in (data_t, scales_t.transpose(1, 2))]
    else:
        copies = [x.new_empty(shape, dtype=dtype) for shape, dtype in _fp8_copy_shapes(l1, False)]
    return (y, handle.h, layout.offsets, layout.row_token, layout.row_weight, layout.slot_row, layout.slot_valid,
            *copies)


@_forward_op.register_fake
def _(x, topk_idx, topk_weights, l1, l2, fp8=False, keep_copies=False):
    (num_tokens, hidden), (num_experts, two_inter, _) = x.shape, l1.shape
    num_slots = num_tokens * topk_idx.shape[1]
    return (x.new_empty(num_tokens, hidden), x.new_empty(num_slots, two_inter),
            x.new_empty(num_experts + 1, dtype=torch.int32), x.new_empty(num_slots, dtype=torch.int64),
            x.new_empty(num_slots, dtype=torch.float32), topk_idx.new_empty(topk_idx.shape),
            topk_idx.new_empty(topk_idx.shape, dtype=torch.bool),
            *(x.new_empty(shape, dtype=dtype) for shape, dtype in _fp8_copy_shapes(l1, keep_copies)))


@torch.library.custom_op("megamoe::backward", mutates_args=("h",), device_types="cuda")
def _backward_op(dy: torch.Tensor, x: torch.Tensor, l1: torch.Tensor, l2: torch.Tensor, h: torch.Tensor,
                 offsets: torch.Tensor, row_token: torch.Tensor, row_weight: torch.Tensor, slot_row: torch.Tensor,
                 slot_valid: torch.Tensor, l1_data_t: torch.Tensor, l1_scales: torch.Tensor, l2_data_t: torch.Tensor,
                 l2_scales: torch.Tensor, fp8: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    # (FP8: the data gradients multiply by the forward's weight copies where it kept them, else
    # by copies the backward makes, the same bits)
    kept = fp8 and l1_data_t.numel() > 0
    dgrad_weights = ((l1_data_t, l1_scales.transpose(1, 2)), (l2_data_t, l2_scales.transpose(1, 2))) if kept else None
    handle = MegaMoEHandle(RoutingLayout(offsets, row_token, row_weight, slot_row, slot_valid), x, h,
                           recipe="fp8" if fp8 else "bf16", dgrad_weights=dgrad_weights)
    # Gradients take the parameters' dtype (autograd would cast them to it anyway).
    return mega_moe_backward(dy.contiguous(), l1, l2, handle, weight_grad_dtype=l1.dtype)


@_backward_op.register_fake
def _(dy, x, l1, l2, h, offsets, row_token, row_weight, slot_row, slot_valid, l1_data_t, l1_scales, l2_data_t,
      l2_scales, fp8=False):
    return (torch.empty_like(x), slot_row.new_empty(slot_row.shape, dtype=torch.float32), torch.empty_like(l1),
            torch.empty_like(l2))


def _setup_context(ctx, inputs, output):
    x, _, topk_weights, l1, l2, fp8, _ = inputs
    ctx.save_for_backward(x, l1, l2, *output[1:])
    ctx.topk_weights_dtype, ctx.fp8 = topk_weights.dtype, fp8
    # Only y reaches users; zero gradients for the saved outputs (h alone is 2I bf16 per
    # routed slot) would be filled for nothing.
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, *unused_grads):
    if dy is None:
        return None, None, None, None, None, None
    x, l1, l2, *saved = ctx.saved_tensors
    dx, dtopk_weights, dl1, dl2 = torch.ops.megamoe.backward(dy, x, l1, l2, *saved, ctx.fp8)
    return dx, None, dtopk_weights.to(ctx.topk_weights_dtype), dl1, dl2, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def mega_moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, l1: torch.Tensor,
             l2: torch.Tensor, *, fp8: bool = False) -> torch.Tensor:
    """Differentiable Mixture-of-Experts layer on one GPU (see `deep_gemm.bf16_mega_moe` for the contract).

    Gradients flow to `x`, `topk_weights`, `l1` and `l2` (in their dtypes). Shapes:
    x ``[T, H]`` bf16, topk_idx ``[T, K]`` int64 (``-1`` = empty), topk_weights ``[T, K]``,
    l1 ``[E, 2I, H]`` bf16, l2 ``[E, H, I]`` bf16; returns y ``[T, H]`` bf16. `fp8` runs the
    expert GEMMs of the forward and the backward in blockwise FP8 (`deep_gemm.fp8_mega_moe`;
    H and I multiples of 128); parameters, inputs and gradients keep their dtypes.
    """
    check_bool(fp8=fp8)
    if isinstance(x, torch.Tensor) and x.device.type == "cpu":  # (fake and meta tensors go on to the op's fake)
        raise ValueError("mega_moe runs on CUDA tensors, got x on the CPU")
    keep_copies = fp8 and get_fp8_weight_copies() is not Fp8WeightCopies.PER_GEMM
    return torch.ops.megamoe.forward(x, topk_idx, topk_weights, l1, l2, fp8, keep_copies)[0]
