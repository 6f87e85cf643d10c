"""Mega MoE forward in blockwise FP8 (docs/DESIGN.md, "Blockwise FP8" and "The FP8 layer"), one
GPU: x quantized per token -> GEMM1 in FP8 (rows gathered in its loads, SwiGLU and the activation's
per-row quantization in its epilogue) -> GEMM2 in FP8 -> weighted combine in bf16. Parameters stay bf16;
their FP8 copies come from `fp8_weights`, made once per change of the weight (or per call:
`Fp8WeightCopies`).
"""
from __future__ import annotations

import enum
from typing import Optional

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from ..gemm import m_grouped_fp8_gemm_nt_contiguous, m_grouped_fp8_gemm_nt_swiglu_contiguous
from ..quant import Fp8Weights, empty_fp8_rows, fp8_quantize_rows, fp8_quantize_weights
from ..quant.kernels import MAX_GROUPS, quantization_fits
from .forward import MegaMoEHandle, prepare_forward
from .kernels import moe_combine_bf16
from .layout import RoutingLayout

# H and I must be multiples of this: every FP8 operand is scaled per 128 contraction elements.
FP8_DIM_MULTIPLE = 128


class Fp8WeightCopies(enum.Enum):
    """How long the FP8 copies of the expert weights live (`set_fp8_weight_copies`).

    PER_STEP (the default): each weight's copy, both orientations, is cached from the first
    forward after an optimizer step to the next step, so every micro-batch's forward and backward
    reuse it: 2 bytes per parameter through the step, one quantization per step.

    PER_CALL: each forward makes the copies and nothing caches them; the forward's orientation is
    freed when the forward returns, the data gradients' (1 byte per parameter) when its backward
    has run: less memory wherever a step has one micro-batch (whose weights change before the next
    forward anyway), one quantization per micro-batch otherwise.

    PER_GEMM: each orientation is made just before the GEMMs that read it and freed after them:
    the forward's copies by the forward (the forward orientation only), each data gradient's
    transposed copy by the backward just before its GEMM (the same bits). Nothing is held from
    the forward to the backward: the layer's peak measured no higher than bf16's at the 30B and
    235B shapes, at one more read of each bf16 weight per forward and backward (docs/PERF.md,
    "Decisions": FP8 weight copies)."""

    PER_STEP = "per_step"
    PER_CALL = "per_call"
    PER_GEMM = "per_gemm"


_copies = Fp8WeightCopies.PER_STEP
# weight -> (its storage pointer and version counter when quantized, its FP8 copy); by identity,
# and gone with the weight (PER_STEP)
_weight_cache = WeakIdKeyDictionary()
_step_hook = None


def set_fp8_weight_copies(policy: Fp8WeightCopies) -> None:
    """Sets how long the FP8 layer's weight copies live, for every FP8 forward from now on
    (`Fp8WeightCopies`); PER_CALL and PER_GEMM also drop the cached copies (neither reads them,
    and PER_GEMM is the policy that keeps the peak at bf16's)."""
    global _copies
    if not isinstance(policy, Fp8WeightCopies):
        raise TypeError(f"policy must be an Fp8WeightCopies, got {type(policy).__name__}")
    _copies = policy
    if policy is not Fp8WeightCopies.PER_STEP:
        invalidate_fp8_weights()


def get_fp8_weight_copies() -> Fp8WeightCopies:
    """The policy `set_fp8_weight_copies` set (PER_STEP by default)."""
    return _copies


def invalidate_fp8_weights() -> None:
    """Drops every cached FP8 weight copy (its memory is freed unless a pending backward holds
    it): call it after changing expert weights in a way that neither an optimizer step nor the
    version counter reveals (writes through ``p.data``, another framework's fused update, any
    in-place change of an inference tensor)."""
    _weight_cache.clear()


def fp8_weights(w: torch.Tensor) -> Fp8Weights:
    """The FP8 copy of an expert weight ``[E, N, K]`` bf16 (`deep_gemm.quant.fp8_quantize_weights`:
    both orientations, 128 x 128 scales), cached with the tensor (`Fp8WeightCopies.PER_STEP`, the
    default), so that a training step quantizes each weight once, for the forward, the backward
    and every micro-batch; with PER_CALL a new copy, not cached.

    The cached copy is made again after any `torch.optim` optimizer's step (a global pre-step hook,
    registered at the first call, drops every copy before the step runs, so that their memory
    is the step's: fused optimizers update parameters without bumping their version counters),
    after any other in-place change of the weight that bumps its version counter (``copy_``
    under ``no_grad``), when its storage moves, and after `invalidate_fp8_weights`. An inference
    tensor (made under ``torch.inference_mode``) has no version counter: its copy is made again
    only when its storage moves or after `invalidate_fp8_weights`, which a caller changing it in
    place must call. While a CUDA graph is being captured it is always made (inside the graph, so
    every replay quantizes the weight as it then is). The copy holds 2 bytes per parameter, from
    the first forward after a step to the next step. With PER_GEMM the copy holds the forward's
    orientation only (its ``data_t`` is None: the backward makes its own, `fp8_dgrad_weights`)."""
    global _step_hook
    if _step_hook is None:
        _step_hook = register_optimizer_step_pre_hook(lambda *_: invalidate_fp8_weights())
    if _copies is Fp8WeightCopies.PER_GEMM:
        return fp8_quantize_weights(w, which="data")
    if _copies is Fp8WeightCopies.PER_CALL or (w.is_cuda and torch.cuda.is_current_stream_capturing()):
        return fp8_quantize_weights(w)
    key = (w.data_ptr(), -1 if w.is_inference() else w._version)
    cached = _weight_cache.get(w)
    if cached is None or cached[0] != key:
        cached = (key, fp8_quantize_weights(w))
        _weight_cache[w] = cached
    return cached[1]


def kept_dgrad_weights(w1: Fp8Weights, w2: Fp8Weights) -> Optional[tuple]:
    """What a forward keeps for its backward's data gradients: l1's and l2's transposed operands
    (`Fp8Weights.transposed_operand`) from its copies, or None under PER_GEMM (the backward then
    makes each just before its GEMM, `fp8_dgrad_weights`)."""
    if w1.data_t is None or w2.data_t is None:
        return None
    return w1.transposed_operand(), w2.transposed_operand()


def fp8_dgrad_weights(w: torch.Tensor, kept: Optional[tuple[torch.Tensor, torch.Tensor]] = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """B of a data gradient's FP8 GEMM for expert weight w ``[E, N, K]`` bf16: ``(data_t [E, K,
    N] e4m3, scales [E, K / 128, N / 128])``. `kept` (the forward's, `kept_dgrad_weights`) if
    given; else a new transposed copy alone, never cached, whatever the policy is by the time
    the backward runs (a forward under PER_GEMM, or a handle made by hand): the bits of the
    forward's copy either way."""
    if kept is not None:
        return kept
    return fp8_quantize_weights(w, which="data_t").transposed_operand()


def fp8_moe_forward(x: torch.Tensor, layout: RoutingLayout, topk_weights: torch.Tensor, w1: Fp8Weights,
                    w2: Fp8Weights, y: torch.Tensor) -> torch.Tensor:
    """The FP8 forward on a built layout: writes `y`, returns GEMM1's output h ``[T * K, 2I]``
    bf16 (what the backward keeps, as in bf16)."""
    num_slots, two_inter, hidden = layout.num_slots, w1.data.shape[1], x.shape[1]
    xq = fp8_quantize_rows(x)
    h, act = x.new_empty(num_slots, two_inter), empty_fp8_rows(num_slots, two_inter // 2, x.device)
    m_grouped_fp8_gemm_nt_swiglu_contiguous((xq.data, xq.scales), (w1.data, w1.scales), h, (act.data, act.scales),
                                            layout.offsets, a_row_index=layout.row_token)
    out = x.new_empty(num_slots, hidden)
    m_grouped_fp8_gemm_nt_contiguous((act.data, act.scales), (w2.data, w2.scales), out, layout.offsets)
    moe_combine_bf16(out, layout, topk_weights, y)
    return h


def check_fp8_sizes(x: torch.Tensor, topk_idx: torch.Tensor, l1: torch.Tensor) -> None:
    """What the FP8 backward's quantization passes take, checked in the forward (so that a
    backward never stops halfway): at most MAX_GROUPS experts (the column quantization's
    group scan), and fewer than 2^31 elements in its largest operand, [T * K, max(H, 2I)]. For
    arguments `check_moe_inputs` has passed."""
    num_experts, two_inter, hidden = l1.shape
    if num_experts > MAX_GROUPS:
        raise ValueError(f"fp8_mega_moe takes at most {MAX_GROUPS} experts, got {num_experts}")
    if not quantization_fits(x.shape[0] * topk_idx.shape[1], max(hidden, two_inter)):
        raise ValueError(f"fp8_mega_moe quantizes [T * K, max(H, 2I)] = [{x.shape[0] * topk_idx.shape[1]}, "
                         f"{max(hidden, two_inter)}] in one pass, which takes fewer than 2^31 elements")


def fp8_mega_moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, l1: torch.Tensor,
                 l2: torch.Tensor, y: Optional[torch.Tensor] = None, *, training: bool = False,
                 check_ids: bool = False) -> tuple[torch.Tensor, Optional[MegaMoEHandle]]:
    """`deep_gemm.bf16_mega_moe` with the expert GEMMs in blockwise FP8: the same arguments,
    shapes and dtypes (bf16 in and out, bf16 weights), the same contract within the FP8
    recipe's accuracy (docs/DESIGN.md, "Blockwise FP8"). H and I must be multiples of 128.

    x and the SwiGLU activation are quantized per 1 x 128, the weights per 128 x 128
    (`fp8_weights`), as `set_fp8_weight_copies` says: cached until a weight changes (PER_STEP, the
    default), made by every call (PER_CALL), or each orientation just before its GEMM (PER_GEMM).
    With `training`, the handle (recipe "fp8") makes `mega_moe_backward` run the backward in FP8
    as well.
    """
    x, y, layout = prepare_forward(x, topk_idx, topk_weights, l1, l2, y, training, check_ids, "fp8_mega_moe",
                                   FP8_DIM_MULTIPLE, check_more=lambda: check_fp8_sizes(x, topk_idx, l1))
    w1, w2 = fp8_weights(l1), fp8_weights(l2)
    h = fp8_moe_forward(x, layout, topk_weights, w1, w2, y)
    if not training:
        return y, None
    return y, MegaMoEHandle(layout=layout, x=x, h=h, recipe="fp8", dgrad_weights=kept_dgrad_weights(w1, w2))
