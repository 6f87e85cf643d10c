"""Tests of the reference MoE (the spec) and of the ``torch._grouped_mm`` baseline.

Runs as a script (``python tests/test_reference.py`` prints a table of cases and errors)
and under pytest. The CPU checks use float64: the explicit-formula backward must match
torch.autograd through ``reference_forward``, and ``reference_forward`` must match a
naive per-(token, slot) loop. The baseline checks need CUDA and are skipped without it.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

try:
    import megamoe_bwd  # noqa: F401
except ImportError:  # run from a checkout without installing: use the repo root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megamoe_bwd.baseline import grouped_mm_moe
from megamoe_bwd.reference import (
    make_moe_inputs,
    reference_backward,
    reference_forward,
    relative_error,
)

Inputs = dict[str, torch.Tensor]
OUTPUTS = ("y", "dx", "dw", "dl1", "dl2")
FP64_TOL = 1e-10
BF16_TOL = 2e-2


# ----------------------------------------------------------------------------- cases
def _empty_some_tokens(inp: Inputs) -> None:
    """Every slot of every third token is empty."""
    inp["topk_idx"][::3] = -1


def _all_empty(inp: Inputs) -> None:
    inp["topk_idx"].fill_(-1)


def _unused_experts(inp: Inputs) -> None:
    """Route only to the first half of the experts (the rest get no tokens)."""
    T, K = inp["topk_idx"].shape
    half = inp["l1"].shape[0] // 2
    device = inp["topk_idx"].device
    inp["topk_idx"] = torch.rand(T, half, device=device).argsort(dim=1)[:, :K]


def _duplicate_expert(inp: Inputs) -> None:
    """Two slots of one token to the same expert: contributions must add up."""
    inp["topk_idx"][:, 1] = inp["topk_idx"][:, 0]


@dataclass(frozen=True)
class Case:
    T: int
    H: int
    I: int
    E: int
    K: int
    routing: str = "uniform"
    empty_slot_frac: float = 0.0
    edit: Callable[[Inputs], None] | None = field(default=None, compare=False)

    @property
    def name(self) -> str:
        s = f"T{self.T}-H{self.H}-I{self.I}-E{self.E}-K{self.K}-{self.routing}"
        if self.empty_slot_frac:
            s += f"-empty{self.empty_slot_frac}"
        if self.edit is not None:
            s += "-" + self.edit.__name__.strip("_")
        return s

    def inputs(self, dtype: torch.dtype = torch.float64, device: str = "cpu") -> Inputs:
        inp = make_moe_inputs(
            self.T, self.H, self.I, self.E, self.K, dtype=dtype, device=device,
            routing=self.routing, empty_slot_frac=self.empty_slot_frac,
        )
        if self.edit is not None:
            self.edit(inp)
        return inp


CPU_CASES: list[Case] = [
    # shape sweep
    *(Case(T, H, I, E, K) for T in (1, 7, 64) for (H, I) in ((16, 8), (32, 24))
      for (E, K) in ((4, 1), (8, 2), (8, 4))),
    # empty slots, whole empty tokens, every slot empty
    Case(64, 32, 24, 8, 4, empty_slot_frac=0.3),
    Case(7, 16, 8, 4, 2, empty_slot_frac=0.3),
    Case(64, 32, 24, 8, 4, empty_slot_frac=0.3, edit=_empty_some_tokens),
    Case(7, 16, 8, 4, 2, edit=_all_empty),
    # routing laws
    Case(64, 32, 24, 8, 4, routing="one_hot"),
    Case(64, 32, 24, 8, 2, routing="skewed"),
    Case(64, 16, 8, 8, 4, routing="skewed", empty_slot_frac=0.3),
    Case(64, 16, 8, 4, 1, routing="one_hot", empty_slot_frac=0.3),
    # experts with no tokens (also T=1 leaves most experts idle)
    Case(64, 32, 24, 8, 2, edit=_unused_experts),
    Case(1, 32, 8, 8, 2, routing="skewed"),
    Case(7, 16, 8, 4, 2, edit=_duplicate_expert),
]

GPU_CASES: list[Case] = [
    Case(256, 256, 128, 8, 4),
    Case(512, 512, 256, 16, 4, routing="skewed", empty_slot_frac=0.2),
    Case(255, 256, 128, 8, 2, routing="one_hot", edit=_empty_some_tokens),
    Case(64, 128, 64, 16, 2, edit=_unused_experts),
]


# ----------------------------------------------------------------------------- helpers
def _cast(inp: Inputs, dtype: torch.dtype) -> Inputs:
    """Floating tensors (topk_weights too) to ``dtype``; topk_idx unchanged."""
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in inp.items()}


def _naive_forward(inp: Inputs) -> torch.Tensor:
    """Independent oracle for the forward: one (token, slot) at a time."""
    x, idx, w, l1, l2 = (inp[k] for k in ("x", "topk_idx", "topk_weights", "l1", "l2"))
    I = l2.shape[2]
    y = torch.zeros_like(x)
    for t, k in idx.ge(0).nonzero().tolist():
        e = int(idx[t, k])
        g, u = l1[e, :I] @ x[t], l1[e, I:] @ x[t]
        y[t] += w[t, k].to(x.dtype) * (l2[e] @ (F.silu(g) * u))
    return y


def _autograd_reference(inp: Inputs) -> dict[str, torch.Tensor]:
    """y and its gradients from torch.autograd through reference_forward."""
    leaves = {k: inp[k].clone().requires_grad_() for k in ("x", "topk_weights", "l1", "l2")}
    y = reference_forward(leaves["x"], inp["topk_idx"], leaves["topk_weights"],
                          leaves["l1"], leaves["l2"])
    wrt = [leaves[k] for k in ("x", "topk_weights", "l1", "l2")]
    if y.requires_grad:
        grads = torch.autograd.grad(y, wrt, inp["dy"], allow_unused=True, materialize_grads=True)
    else:  # every slot empty: y is a constant, all gradients are zero
        grads = tuple(torch.zeros_like(t) for t in wrt)
    return dict(zip(OUTPUTS, (y.detach(), *grads)))


def _explicit_reference(inp: Inputs) -> dict[str, torch.Tensor]:
    y = reference_forward(inp["x"], inp["topk_idx"], inp["topk_weights"], inp["l1"], inp["l2"])
    return dict(zip(OUTPUTS, (y, *reference_backward(**inp))))


def _baseline(inp: Inputs) -> dict[str, torch.Tensor]:
    """grouped_mm_moe output and its autograd gradients."""
    leaves = {k: inp[k].clone().requires_grad_() for k in ("x", "topk_weights", "l1", "l2")}
    y = grouped_mm_moe(leaves["x"], inp["topk_idx"], leaves["topk_weights"],
                       leaves["l1"], leaves["l2"])
    grads = torch.autograd.grad(y, [leaves[k] for k in ("x", "topk_weights", "l1", "l2")],
                                inp["dy"])
    return dict(zip(OUTPUTS, (y.detach(), *grads)))


def _errors(out: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    return {k: relative_error(out[k], ref[k]) for k in OUTPUTS}


def check_reference_case(case: Case) -> dict[str, float]:
    """Explicit backward vs autograd, reference forward vs naive loop (float64, CPU)."""
    inp = _cast(case.inputs(), torch.float64)
    explicit = _explicit_reference(inp)
    errs = _errors(explicit, _autograd_reference(inp))
    errs["y"] = max(errs["y"], relative_error(explicit["y"], _naive_forward(inp)))
    # dtopk_weights is exactly 0 on empty slots (not merely small).
    empty = inp["topk_idx"] < 0
    assert bool((explicit["dw"][empty] == 0).all()), "dtopk_weights nonzero on an empty slot"
    # Experts without tokens get exactly zero weight gradients.
    used = torch.zeros(inp["l1"].shape[0], dtype=torch.bool)
    used[inp["topk_idx"][~empty]] = True
    assert bool((explicit["dl1"][~used] == 0).all() and (explicit["dl2"][~used] == 0).all())
    return errs


def check_baseline_case(case: Case) -> dict[str, float]:
    """bf16 grouped_mm_moe (forward + autograd backward) vs the float32 reference on GPU."""
    inp = case.inputs(dtype=torch.bfloat16, device="cuda")
    return _errors(_baseline(inp), _explicit_reference(_cast(inp, torch.float32)))


# ----------------------------------------------------------------------------- pytest
@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.name)
def test_reference_matches_autograd(case: Case) -> None:
    errs = check_reference_case(case)
    bad = {k: v for k, v in errs.items() if not v < FP64_TOL}
    assert not bad, f"{case.name}: relative errors above {FP64_TOL}: {bad}"


def test_reference_output_dtypes() -> None:
    inp = _cast(make_moe_inputs(8, 16, 8, 4, 2, seed=0), torch.float64)
    inp["topk_weights"] = inp["topk_weights"].float()  # the contract's fp32 weights
    dx, dw, dl1, dl2 = reference_backward(**inp)
    assert (dx.dtype, dw.dtype, dl1.dtype, dl2.dtype) == (
        torch.float64, torch.float32, torch.float64, torch.float64)
    assert (dx.shape, dw.shape, dl1.shape, dl2.shape) == (
        (8, 16), (8, 2), (4, 16, 16), (4, 16, 8))


def test_reference_rejects_bad_input() -> None:
    inp = _cast(make_moe_inputs(8, 16, 8, 4, 2, seed=0), torch.float64)
    args = [inp[k] for k in ("x", "topk_idx", "topk_weights", "l1", "l2")]
    with pytest.raises(ValueError, match="topk_idx values"):
        reference_forward(args[0], args[1].clamp(max=3) + 1, *args[2:])
    with pytest.raises(TypeError, match="dtype"):
        reference_forward(args[0].float(), *args[1:])
    with pytest.raises(TypeError, match="int64"):
        reference_forward(args[0], args[1].int(), *args[2:])


@pytest.mark.parametrize("routing", ["uniform", "skewed", "one_hot"])
def test_make_moe_inputs(routing: str) -> None:
    T, H, I, E, K = 512, 16, 8, 16, 4
    inp = make_moe_inputs(T, H, I, E, K, routing=routing, seed=0)
    shapes = {k: tuple(v.shape) for k, v in inp.items()}
    assert shapes == {"x": (T, H), "topk_idx": (T, K), "topk_weights": (T, K),
                      "l1": (E, 2 * I, H), "l2": (E, H, I), "dy": (T, H)}
    assert inp["x"].dtype == inp["l1"].dtype == inp["l2"].dtype == inp["dy"].dtype == torch.bfloat16
    assert inp["topk_idx"].dtype == torch.int64 and inp["topk_weights"].dtype == torch.float32
    idx = inp["topk_idx"]
    assert bool(((idx >= 0) & (idx < E)).all())
    assert bool((idx.sort(dim=1).values.diff(dim=1) > 0).all()), "experts not distinct per token"
    torch.testing.assert_close(inp["topk_weights"].sum(-1), torch.ones(T))
    counts = torch.bincount(idx.flatten(), minlength=E)
    if routing == "one_hot":
        assert bool((idx == 0).any(dim=1).all())
    if routing == "skewed":
        assert counts[0] > 2 * counts[-1], f"not skewed: {counts.tolist()}"


def test_make_moe_inputs_empty_slots() -> None:
    idx = make_moe_inputs(1000, 16, 8, 8, 4, empty_slot_frac=0.3, seed=0)["topk_idx"]
    frac = (idx == -1).float().mean().item()
    assert 0.25 < frac < 0.35, frac
    assert bool((make_moe_inputs(4, 16, 8, 8, 4, empty_slot_frac=1.0)["topk_idx"] == -1).all())


def test_make_moe_inputs_randomness() -> None:
    a, b = make_moe_inputs(16, 16, 8, 8, 2), make_moe_inputs(16, 16, 8, 8, 2)
    assert not torch.equal(a["x"], b["x"]) and not torch.equal(a["l1"], b["l1"])
    c, d = make_moe_inputs(16, 16, 8, 8, 2, seed=7), make_moe_inputs(16, 16, 8, 8, 2, seed=7)
    assert all(torch.equal(c[k], d[k]) for k in c)


def test_relative_error() -> None:
    ref = torch.tensor([3.0, 4.0])
    assert relative_error(ref, ref) == 0.0
    assert relative_error(torch.tensor([3.0, 3.0]), ref) == pytest.approx(0.2)
    assert relative_error(torch.tensor([float("nan"), 4.0]), ref) == float("inf")
    assert relative_error(torch.tensor([float("inf"), 4.0]), ref) == float("inf")
    assert relative_error(ref.bfloat16(), ref.double()) == 0.0
    assert relative_error(ref, torch.zeros(2)) == pytest.approx(5.0)
    with pytest.raises(ValueError):
        relative_error(ref, torch.zeros(3))


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@requires_cuda
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_grouped_mm_baseline(case: Case) -> None:
    errs = check_baseline_case(case)
    bad = {k: v for k, v in errs.items() if not v < BF16_TOL}
    assert not bad, f"{case.name}: relative errors above {BF16_TOL}: {bad}"


@requires_cuda
def test_grouped_mm_baseline_empty_slot_grad() -> None:
    inp = make_moe_inputs(128, 128, 64, 8, 4, device="cuda", empty_slot_frac=0.3)
    dw = _baseline(inp)["dw"]
    assert bool((dw[inp["topk_idx"] < 0] == 0).all())


# ----------------------------------------------------------------------------- script
def _print_table(title: str, cases: list[Case], check: Callable[[Case], dict[str, float]],
                 tol: float) -> bool:
    print(f"\n{title} (pass: every relative error < {tol:g})")
    print(f"{'case':<60}" + "".join(f"{k:>11}" for k in OUTPUTS) + "  ok")
    all_ok = True
    for case in cases:
        errs = check(case)
        ok = all(v < tol for v in errs.values())
        all_ok &= ok
        print(f"{case.name:<60}" + "".join(f"{errs[k]:>11.2e}" for k in OUTPUTS)
              + ("  yes" if ok else "  NO"))
    return all_ok


def main() -> int:
    ok = _print_table("reference vs autograd, float64 CPU", CPU_CASES,
                      check_reference_case, FP64_TOL)
    if torch.cuda.is_available():
        ok &= _print_table("torch._grouped_mm baseline (bf16) vs float32 reference, GPU",
                           GPU_CASES, check_baseline_case, BF16_TOL)
    else:
        print("\nno CUDA GPU: grouped_mm baseline checks skipped")
    print("\nall passed" if ok else "\nFAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
