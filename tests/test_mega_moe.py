"""Spec of the Mega MoE layer (forward, backward, autograd) against the reference.

CPU: the orchestration (routing layout, gathers, SwiGLU and its backward, combine, the
routing-weight gradient) in float64 with emulated grouped GEMMs must equal the reference to
1e-10, and rows the kernels leave unwritten (NaN here) must never leak into a result.
GPU: every output within the accuracy bar (<= 1.5x the error of the bf16 torch._grouped_mm
MoE, both against the float64 reference), on fresh random inputs; autograd, torch.compile,
determinism. `python tests/test_mega_moe.py` prints the GPU table.
"""
from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deep_gemm  # noqa: E402
from deep_gemm.moe import MegaMoEHandle, build_routing_layout  # noqa: E402
from deep_gemm.moe.forward import check_expert_ids, moe_forward  # noqa: E402
from deep_gemm.moe.fp8 import fp8_moe_forward, fp8_weights  # noqa: E402
from deep_gemm.testing import eager_and_graph_replay, emulate, view_of_memory  # noqa: E402
from emulated_kernels import PAIRS, patch_kernels  # noqa: E402
from megamoe_bwd import MegaMoE, mega_moe, mega_moe_backward  # noqa: E402
from megamoe_bwd.testing import accuracy  # noqa: E402
from megamoe_bwd.reference import make_moe_inputs, reference_backward, reference_forward, relative_error  # noqa: E402

HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
requires_sm90 = pytest.mark.skipif(not HAS_SM90, reason="needs an sm_90 GPU")

ORCHESTRATION_CASES = [  # (T, H, I, E, K, routing, empty_slot_frac); I = 64: SwiGLU after GEMM1, not in it
    (1, 64, 64, 4, 1, "uniform", 0.0),
    (7, 64, 64, 4, 2, "uniform", 0.3),
    (64, 128, 64, 8, 4, "skewed", 0.0),
    (33, 64, 128, 8, 4, "one_hot", 0.2),
    (16, 64, 64, 8, 2, "uniform", 1.0),  # every slot empty
    (0, 64, 64, 4, 2, "uniform", 0.0),  # no tokens
]


@pytest.fixture
def emulated_gemms(monkeypatch):
    patch_kernels(monkeypatch.setattr)


@pytest.mark.parametrize("T,H,I,E,K,routing,empty", ORCHESTRATION_CASES)
def test_orchestration_matches_reference(emulated_gemms, T, H, I, E, K, routing, empty):
    p = make_moe_inputs(T, H, I, E, K, dtype=torch.float64, routing=routing, empty_slot_frac=empty)
    p["topk_weights"] = p["topk_weights"].double()  # fp32 values: the layout keeps weights in fp32
    layout = build_routing_layout(p["topk_idx"], p["topk_weights"], E)
    y = torch.empty_like(p["x"])
    h = moe_forward(p["x"], layout, p["topk_weights"], p["l1"], p["l2"], y)
    dx, dw, dl1, dl2 = mega_moe_backward(p["dy"], p["l1"], p["l2"], MegaMoEHandle(layout, p["x"], h),
                                         weight_grad_dtype=torch.float64)
    ref_y = reference_forward(p["x"], p["topk_idx"], p["topk_weights"], p["l1"], p["l2"])
    ref = reference_backward(p["x"], p["topk_idx"], p["topk_weights"], p["l1"], p["l2"], p["dy"])
    for name, out, expected in zip(("y", "dx", "dtopk_weights", "dl1", "dl2"), (y, dx, dw, dl1, dl2), (ref_y, *ref)):
        assert relative_error(out, expected) < 1e-10, name
    assert torch.all(dw[p["topk_idx"] < 0] == 0)


def test_backward_consumes_its_handle_unless_kept(emulated_gemms):
    """The backward writes dz over the handle's h (less peak memory), so a handle serves one
    backward; keep_handle=True keeps it for more, with the same results."""
    p = make_moe_inputs(33, 64, 64, 8, 4, dtype=torch.float64, routing="skewed", empty_slot_frac=0.2)
    layout = build_routing_layout(p["topk_idx"], p["topk_weights"], 8)
    h = moe_forward(p["x"], layout, p["topk_weights"], p["l1"], p["l2"], torch.empty_like(p["x"]))
    kept = MegaMoEHandle(layout, p["x"], h.clone())
    first = mega_moe_backward(p["dy"], p["l1"], p["l2"], kept, weight_grad_dtype=torch.float64, keep_handle=True)
    second = mega_moe_backward(p["dy"], p["l1"], p["l2"], kept, weight_grad_dtype=torch.float64, keep_handle=True)
    handle = MegaMoEHandle(layout, p["x"], h)
    consumed = mega_moe_backward(p["dy"], p["l1"], p["l2"], handle, weight_grad_dtype=torch.float64)
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(first, second, consumed))
    with pytest.raises(ValueError, match="consumed"):
        mega_moe_backward(p["dy"], p["l1"], p["l2"], handle)


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values at an address one element past a 16-byte boundary."""
    return torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view(t.shape).copy_(t)


def _non_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


# (what is wrong, how the arguments of mega_moe_backward become so, the exception)
BAD_BACKWARD_ARGS = [
    ("no handle", lambda a: a.update(handle=None), TypeError),
    ("a handle of no recipe", lambda a: a.update(handle=dataclasses.replace(a["handle"], recipe="fp16")), ValueError),
    ("dy's dtype", lambda a: a.update(dy=a["dy"].half()), TypeError),
    ("dy's shape", lambda a: a.update(dy=a["dy"][:-1]), ValueError),
    ("dy elsewhere", lambda a: a.update(dy=torch.empty_like(a["dy"], device="meta")), ValueError),
    ("l1 with fewer experts", lambda a: a.update(l1=a["l1"][:-1]), ValueError),
    ("l1 with another I", lambda a: a.update(l1=a["l1"][:, :-64].contiguous()), ValueError),
    ("l2 with another I", lambda a: a.update(l2=a["l2"][:, :, :-64].contiguous()), ValueError),
    ("l1's dtype", lambda a: a.update(l1=a["l1"].half()), TypeError),
    ("l2 not contiguous", lambda a: a.update(l2=_non_contiguous(a["l2"])), ValueError),
    ("l2 misaligned", lambda a: a.update(l2=_misaligned(a["l2"])), ValueError),
    ("dl1's dtype", lambda a: a.update(dl1=a["dl1"].half()), TypeError),
    ("dl2's shape", lambda a: a.update(dl2=a["dl2"][:, :-8].contiguous()), ValueError),
    ("dl1 not contiguous", lambda a: a.update(dl1=_non_contiguous(a["dl1"])), ValueError),
    ("dl2 misaligned", lambda a: a.update(dl2=_misaligned(a["dl2"])), ValueError),
    ("dl1 elsewhere", lambda a: a.update(dl1=torch.empty_like(a["dl1"], device="meta")), ValueError),
    ("weight_grad_dtype", lambda a: a.update(weight_grad_dtype=torch.float16), TypeError),
    ("keep_handle", lambda a: a.update(keep_handle="yes"), TypeError),
    ("dl1 over l1", lambda a: _share_memory(a, "dl1", "l1"), ValueError),
    ("dl2 over dy", lambda a: _share_memory(a, "dl2", "dy"), ValueError),
]


def _share_memory(args: dict, output: str, source: str) -> None:
    """args[output] becomes a new tensor whose first bytes hold args[source], and args[source] a
    view of them (the same values): an output over an input."""
    buffer = torch.zeros_like(args[output])
    view = view_of_memory(buffer, args[source].shape, args[source].dtype).copy_(args[source])
    args.update({output: buffer, source: view})


def _backward_problem(device: str, recipe: str = "bf16") -> dict:
    """A forward's handle and the arguments of a correct backward that accumulates into
    existing dl1, dl2: float64 with the emulated kernels on a CPU (bf16 for the FP8 recipe), bf16
    (fp32 gradients) on a GPU."""
    dtype = torch.float64 if device == "cpu" and recipe == "bf16" else torch.bfloat16
    p = make_moe_inputs(33, 128, 128, 8, 4, dtype=dtype, device=device, routing="skewed", empty_slot_frac=0.2)
    args = [p[n] for n in ("x", "topk_idx", "topk_weights", "l1", "l2")]
    if device == "cpu":
        layout = build_routing_layout(p["topk_idx"], p["topk_weights"], 8)
        if recipe == "fp8":
            h = fp8_moe_forward(p["x"], layout, p["topk_weights"], fp8_weights(p["l1"]), fp8_weights(p["l2"]),
                                torch.empty_like(p["x"]))
        else:
            h = moe_forward(p["x"], layout, p["topk_weights"], p["l1"], p["l2"], torch.empty_like(p["x"]))
        handle = MegaMoEHandle(layout, p["x"], h, recipe=recipe)
    else:
        _, handle = (deep_gemm.fp8_mega_moe if recipe == "fp8" else deep_gemm.bf16_mega_moe)(*args, training=True)
    grad_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return dict(dy=p["dy"], l1=p["l1"], l2=p["l2"], handle=handle, weight_grad_dtype=grad_dtype, keep_handle=False,
                dl1=torch.randn(p["l1"].shape, dtype=grad_dtype, device=device),
                dl2=torch.randn(p["l2"].shape, dtype=grad_dtype, device=device))


def _call_backward(args: dict):
    args = dict(args)
    return mega_moe_backward(args.pop("dy"), args.pop("l1"), args.pop("l2"), args.pop("handle"), **args)


def _state(args: dict) -> list:
    """Copies of everything a backward could change: the handle's tensors and every tensor argument."""
    handle = args["handle"] if isinstance(args["handle"], MegaMoEHandle) else None
    tensors = [t for t in args.values() if isinstance(t, torch.Tensor) and t.device.type != "meta"]
    if handle is not None:
        layout = handle.layout
        tensors += [handle.x, handle.h, layout.offsets, layout.row_token, layout.row_weight, layout.slot_row,
                    layout.slot_valid]
    return [(t, t.clone()) for t in tensors]


@pytest.mark.parametrize("recipe", ["bf16", "fp8"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_sm90)])
@pytest.mark.parametrize("what,make_bad,error", BAD_BACKWARD_ARGS, ids=[b[0] for b in BAD_BACKWARD_ARGS])
def test_a_rejected_backward_changes_nothing_and_a_corrected_retry_is_right(request, device, recipe, what, make_bad,
                                                                            error):
    if device == "cpu":
        request.getfixturevalue("emulated_gemms")
    good = _backward_problem(device, recipe)
    kept = dict(good, handle=dataclasses.replace(good["handle"], h=good["handle"].h.clone()),
                dl1=good["dl1"].clone(), dl2=good["dl2"].clone())
    expected = _call_backward(kept)  # the same backward, on copies, never rejected
    bad = dict(good)
    make_bad(bad)
    h = good["handle"].h
    before = _state(good) + _state(bad)
    with pytest.raises(error):
        _call_backward(bad)
    assert good["handle"].h is h, "the handle was consumed"
    for t, copy in before:  # (rows no kernel writes hold NaN in the emulations)
        assert torch.equal(t, copy) or torch.allclose(t, copy, rtol=0, atol=0, equal_nan=True), \
            "a rejected call changed a tensor"
    retried = _call_backward(good)
    for name, a, b in zip(("dx", "dtopk_weights", "dl1", "dl2"), retried, expected):
        assert torch.equal(a, b), name
    assert retried[2] is good["dl1"] and retried[3] is good["dl2"], "gradients accumulate into the given tensors"


def test_emulations_take_the_kernels_arguments():
    # The CPU tests swap the kernels for emulations; a signature drift would hide GPU-only bugs.
    import inspect
    for kernel, emulation in PAIRS:
        real, emulated = inspect.signature(kernel).parameters, inspect.signature(emulation).parameters
        takes_any_keyword = any(p.kind is p.VAR_KEYWORD for p in emulated.values())
        for name, param in real.items():
            assert name in emulated or (takes_any_keyword and param.kind is param.KEYWORD_ONLY), (kernel, name)
        for name, param in emulated.items():  # what callers may pass to the emulation, the kernel takes too
            assert param.kind is param.VAR_KEYWORD or name in real, (kernel, name)


def test_layout_of_non_contiguous_routing_is_contiguous():
    topk_idx = torch.tensor([[2, 0, 1], [0, 1, -1], [1, 1, 0], [2, 2, 2]]).t().contiguous().t()
    layout = build_routing_layout(topk_idx, torch.rand(4, 3, dtype=torch.float64).t().contiguous().t(), 3)
    assert layout.slot_valid.is_contiguous() and layout.slot_row.is_contiguous()
    assert layout.row_weight.dtype == torch.float32
    assert torch.equal(layout.slot_valid, topk_idx >= 0)


def test_layout_offsets_and_inverse():
    topk_idx = torch.tensor([[2, -1], [0, 2], [-1, -1], [1, 0]])
    layout = build_routing_layout(topk_idx, torch.ones(4, 2), 3)
    assert layout.offsets.tolist() == [0, 2, 3, 5]
    assert layout.row_token[:5].tolist() == [1, 3, 3, 0, 1]  # token order inside each expert
    assert torch.equal(layout.row_token[layout.slot_row.flatten()], torch.arange(4).repeat_interleave(2))
    assert layout.row_weight[5:].eq(0).all()


def test_expert_id_check_raises_before_launch():
    with pytest.raises(ValueError, match="outside"):
        check_expert_ids(torch.tensor([[0, 5]]), 4, sync=True)
    check_expert_ids(torch.tensor([[0, -1, 3]]), 4, sync=True)


def _bf16_problem(T=8, H=64, I=64, E=4, K=2):
    p = make_moe_inputs(T, H, I, E, K, dtype=torch.bfloat16)
    return [p["x"], p["topk_idx"], p["topk_weights"], p["l1"], p["l2"]]


@pytest.mark.parametrize("mutate,error,match", [
    (lambda a: a.__setitem__(0, a[0].float()), TypeError, "x must be a bf16"),
    (lambda a: a.__setitem__(1, a[1].int()), TypeError, "int64"),
    (lambda a: a.__setitem__(3, a[3][:, :64].contiguous()), ValueError, "weights do not match"),
    (lambda a: a.__setitem__(2, a[2][:, :1].contiguous()), ValueError, "must both be"),
    (lambda a: a.__setitem__(4, a[4].transpose(1, 2).contiguous().transpose(1, 2)), ValueError, "contiguous"),
    (lambda a: a.__setitem__(3, _misaligned(a[3])), ValueError, "16-byte aligned"),
    (lambda a: a.append(torch.empty(8, 64)), TypeError, "y must have dtype"),
    (lambda a: a.append(torch.empty(7, 64, dtype=torch.bfloat16)), ValueError, "y must be"),
    (lambda a: a.append(_misaligned(torch.empty(8, 64, dtype=torch.bfloat16))), ValueError, "y must be 16-byte"),
    (lambda a: a.append(a[3].view(-1)[:8 * 64].view(8, 64)), ValueError, "y overlaps l1 in memory"),
    (lambda a: a.__setitem__(0, a[0].tolist()), TypeError, "x must be"),
    (lambda a: None, ValueError, "CUDA"),
])
def test_forward_rejects_bad_input(mutate, error, match):
    args = _bf16_problem()
    mutate(args)
    with pytest.raises(error, match=match):
        deep_gemm.bf16_mega_moe(*args)


@pytest.mark.parametrize("training,match", [(True, "y overlaps x in memory"), (False, "CUDA")])
def test_y_may_be_x_in_inference_only(training, match):
    """The combine writes y after every read of x; in training the handle keeps x for the backward."""
    args = _bf16_problem()
    with pytest.raises(ValueError, match=match):
        deep_gemm.bf16_mega_moe(*args, y=args[0], training=training)


@pytest.mark.parametrize("kwargs,match", [
    (dict(backend="nvlnk"), "unknown backend"),
    (dict(backend="deep_ep"), "needs the process group"),
    (dict(buffer=object()), "needs the process group"),
])
def test_module_rejects_an_impossible_exchange(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MegaMoE(num_experts=8, hidden=64, intermediate=64, **kwargs)


def test_dims_must_be_multiples_of_64():
    with pytest.raises(ValueError, match="multiple of 64"):
        deep_gemm.bf16_mega_moe(*_bf16_problem(H=96))


# ---------------------------------------------------------------- GPU

GPU_CASES = [  # (label, T, H, I, E, K, routing, empty_slot_frac): the standard shapes scaled down
    ("30B-like", 512, 2048, 768, 16, 8, "uniform", 0.0),
    ("235B-like", 256, 4096, 1536, 16, 8, "skewed", 0.0),
    ("V3-like", 256, 7168, 2048, 32, 8, "uniform", 0.0),
    ("empty slots", 200, 1024, 512, 8, 4, "uniform", 0.25),
    ("one hot expert", 300, 1024, 512, 8, 4, "one_hot", 0.0),
    ("T=1", 1, 1024, 512, 8, 4, "uniform", 0.0),
    ("T=77", 77, 1024, 256, 8, 2, "skewed", 0.1),
]


def _accuracy(T, H, I, E, K, routing, empty):
    return accuracy(deep_gemm.bf16_mega_moe, mega_moe_backward, T, H, I, E, K, routing, empty)


@requires_sm90
@pytest.mark.parametrize("label,T,H,I,E,K,routing,empty", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_accuracy_bar(label, T, H, I, E, K, routing, empty):
    for name, (ours, base) in _accuracy(T, H, I, E, K, routing, empty).items():
        assert ours <= 1.5 * base + 1e-6, f"{name}: ours {ours:.2e} vs baseline {base:.2e}"


@requires_sm90
@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("K,H", [(6, 1024), (10, 264)], ids=["K6", "K10-ragged-H"])
def test_combine_kernel(weighted, K, H):
    """Every slot group (K > 8 takes two) and a row whose chunks end inside a warp."""
    from deep_gemm.moe.kernels import moe_combine_bf16
    topk_idx = make_moe_inputs(1000, 64, 64, 16, K, device="cuda", empty_slot_frac=0.2)["topk_idx"]
    weights = torch.rand(1000, K, device="cuda")
    layout = build_routing_layout(topk_idx, weights, 16)
    rows = torch.randn(1000 * K, H, device="cuda", dtype=torch.bfloat16)
    rows[layout.slot_row[~layout.slot_valid]] = float("nan")  # rows of empty slots are never read
    out = moe_combine_bf16(rows, layout, weights if weighted else None, torch.empty(1000, H, device="cuda",
                                                                                   dtype=torch.bfloat16))
    expected = emulate.moe_combine(rows, layout, weights if weighted else None,
                                   torch.empty(1000, H, device="cuda", dtype=torch.float64))
    assert relative_error(out, expected) < 4e-3


@requires_sm90
def test_combine_adds_partial_sums_of_other_gpus():
    """out[t] = weighted sum over t's slots + sum_j addend[j, t] (addend blocks may be longer than T)."""
    from deep_gemm.moe.kernels import moe_combine_bf16
    T, H, J = 300, 512, 3
    topk_idx = make_moe_inputs(T, 64, 64, 16, 4, device="cuda", empty_slot_frac=0.2)["topk_idx"]
    weights = torch.rand(T, 4, device="cuda")
    layout = build_routing_layout(topk_idx, weights, 16)
    rows = torch.randn(4 * T, H, device="cuda", dtype=torch.bfloat16)
    addend = torch.randn(J, T + 20, H, device="cuda", dtype=torch.bfloat16)
    out = moe_combine_bf16(rows, layout, weights, torch.empty(T, H, device="cuda", dtype=torch.bfloat16),
                           addend=addend)
    expected = emulate.moe_combine(rows, layout, weights, torch.empty(T, H, device="cuda", dtype=torch.float64),
                                   addend=addend)
    assert relative_error(out, expected) < 4e-3


@requires_sm90
def test_wait_flags_orders_what_follows_after_the_landed_rows():
    """ep_wait_flags returns (on the stream) once every flag is set, then resets them: here the
    rows are NaN until another stream copies them in from pinned host memory (a copy engine,
    as another GPU's would be) after a sleep and sets the flags, the later block first. One
    thread waits: a kernel queued on another stream after it (the sleep) still runs."""
    from deep_gemm.jit.runtime import stream_write_u32
    from deep_gemm.moe.kernels import ep_wait_flags, moe_combine_bf16
    T, H, J = 300, 256, 2
    layout = build_routing_layout(make_moe_inputs(T, 64, 64, 16, 4, device="cuda")["topk_idx"],
                                  torch.rand(T, 4, device="cuda"), 16)
    rows = torch.randn(4 * T, H, device="cuda", dtype=torch.bfloat16)
    real = torch.randn(J, T, H, device="cuda", dtype=torch.bfloat16)
    landing = real.cpu().pin_memory()
    addend = torch.full_like(real, float("nan"))
    flags = torch.zeros(J, dtype=torch.int32, device="cuda")
    sources = torch.tensor([5, 6], dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # (not after the wait below: it would never end)
    torch.cuda._sleep(1)  # loads the sleep kernel now: a first launch waits for running kernels to end
    torch.cuda.synchronize()
    ep_wait_flags(flags, sources, 60_000)
    out = moe_combine_bf16(rows, layout, None, torch.empty(T, H, device="cuda", dtype=torch.bfloat16), addend=addend)
    with torch.cuda.stream(side):
        for j in (1, 0):
            torch.cuda._sleep(20_000_000)
            addend[j].copy_(landing[j], non_blocking=True)
            stream_write_u32(flags[j:].data_ptr(), 1, rows.device.index)
    torch.cuda.current_stream().wait_stream(side)
    expected = emulate.moe_combine(rows, layout, None, torch.empty(T, H, device="cuda", dtype=torch.float64),
                                   addend=real)
    assert not torch.isnan(out).any(), "a row was read before its flag was set"
    assert relative_error(out, expected) < 4e-3
    assert flags.tolist() == [0, 0], "the flags are reset for the next exchange"


@requires_sm90
def test_combine_and_wait_reject_bad_input():
    from deep_gemm.moe.kernels import ep_wait_flags, moe_combine_bf16
    layout = build_routing_layout(torch.tensor([[0, 1]], device="cuda"), torch.ones(1, 2, device="cuda"), 2)
    rows, out = (torch.zeros(n, 8, device="cuda", dtype=torch.bfloat16) for n in (2, 1))
    with pytest.raises(ValueError, match="addend must be"):
        moe_combine_bf16(rows, layout, None, out, addend=torch.zeros(1, 8, device="cuda", dtype=torch.bfloat16))
    flags = torch.zeros(2, device="cuda", dtype=torch.int32)
    with pytest.raises(ValueError, match="sources must be"):
        ep_wait_flags(flags, flags[:1], 1000)
    with pytest.raises(ValueError, match="timeout_ms"):
        ep_wait_flags(flags, flags, 0)


def _routed_layout(T=600, K=6, E=16, empty=0.2):
    p = make_moe_inputs(T, 64, 64, E, K, device="cuda", empty_slot_frac=empty)
    return build_routing_layout(p["topk_idx"], p["topk_weights"], E)


@requires_sm90
def test_swiglu_kernels():
    from deep_gemm.moe.kernels import moe_swiglu_bwd_bf16, moe_swiglu_fwd_bf16
    layout = _routed_layout()
    routed = int(layout.offsets[-1])
    h = torch.randn(layout.num_slots, 2 * 768, device="cuda", dtype=torch.bfloat16)
    d_act = torch.randn(layout.num_slots, 768, device="cuda", dtype=torch.bfloat16)
    act = moe_swiglu_fwd_bf16(h, layout.offsets)
    dz, act_weighted, row_dw = moe_swiglu_bwd_bf16(h, d_act, layout)
    ref_act = emulate.moe_swiglu_fwd(h.double(), layout.offsets)
    ref_dz, ref_act_weighted, ref_dw = emulate.moe_swiglu_bwd(h.double(), d_act.double(), layout)
    assert relative_error(act[:routed], ref_act[:routed]) < 4e-3
    assert relative_error(act_weighted[:routed], ref_act_weighted[:routed]) < 4e-3
    assert relative_error(dz[:routed], ref_dz[:routed]) < 4e-3
    assert relative_error(row_dw[:routed], ref_dw[:routed]) < 1e-4
    # Written over its inputs, bitwise the same.
    h_in, d_act_in = h.clone(), d_act.clone()
    dz_in, act_weighted_in, row_dw_in = moe_swiglu_bwd_bf16(h_in, d_act_in, layout, dz=h_in, act_weighted=d_act_in)
    assert dz_in.data_ptr() == h_in.data_ptr() and act_weighted_in.data_ptr() == d_act_in.data_ptr()
    assert torch.equal(dz_in[:routed], dz[:routed]) and torch.equal(act_weighted_in[:routed], act_weighted[:routed])
    assert torch.equal(row_dw_in[:routed], row_dw[:routed])


@requires_sm90
def test_gather_kernel_copies_the_routed_rows():
    from deep_gemm.moe.kernels import moe_gather_rows_bf16
    layout = _routed_layout()
    routed = int(layout.offsets[-1])
    src = torch.randn(600, 1024, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(moe_gather_rows_bf16(src, layout)[:routed], emulate.moe_gather_rows(src, layout)[:routed])


@requires_sm90
@pytest.mark.parametrize("T,K,E,routing,empty", [
    (1, 1, 1, "uniform", 0.0),
    (7, 3, 5, "uniform", 0.3),
    (600, 6, 16, "uniform", 0.2),
    (3000, 8, 128, "skewed", 0.05),  # one hot expert
    (16384, 8, 128, "uniform", 0.0),  # 30B: many chunks
    (5000, 8, 1024, "uniform", 0.1),  # the most experts the kernels sort
    (40, 4, 8, "uniform", 1.0),  # every slot empty
    (0, 4, 8, "uniform", 0.0),
])
def test_routing_kernels_build_the_torch_layout(T, K, E, routing, empty):
    """Our counting sort gives the stable argsort's layout, element for element."""
    from deep_gemm.moe.kernels import moe_routing_layout
    from deep_gemm.moe.layout import build_routing_layout_torch
    p = make_moe_inputs(T, 64, 64, E, K, device="cuda", routing=routing, empty_slot_frac=empty)
    idx = p["topk_idx"]
    if T > 1:  # ids past E are empty slots as well (the caller reports them)
        idx = torch.where(torch.rand(idx.shape, device="cuda") < 0.01, E + 3, idx)
    ours = moe_routing_layout(idx, p["topk_weights"], E)
    ref = build_routing_layout_torch(idx, p["topk_weights"], E)
    for name in ("offsets", "row_token", "row_weight", "slot_row", "slot_valid"):
        a, b = getattr(ours, name), getattr(ref, name)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name


@requires_sm90
def test_zero_tokens():
    x, idx, w, l1, l2 = (t.cuda() for t in _bf16_problem(T=0, H=128, I=128))
    y, handle = deep_gemm.bf16_mega_moe(x, idx, w, l1, l2, training=True)
    dx, dw, dl1, dl2 = mega_moe_backward(torch.empty_like(y), l1, l2, handle)
    assert y.shape == (0, 128) and dx.shape == (0, 128) and dw.shape == (0, 2)
    assert not dl1.any() and not dl2.any()


@requires_sm90
def test_deterministic():
    p = make_moe_inputs(256, 1024, 512, 8, 4, device="cuda", routing="skewed")
    outs = []
    for _ in range(2):
        y, handle = deep_gemm.bf16_mega_moe(p["x"], p["topk_idx"], p["topk_weights"], p["l1"], p["l2"], training=True)
        outs.append((y, *mega_moe_backward(p["dy"], p["l1"], p["l2"], handle)))
    assert all(torch.equal(a, b) for a, b in zip(*outs))


@requires_sm90
def test_autograd_module_matches_direct_api():
    torch.manual_seed(0)
    module = MegaMoE(8, 1024, 512, device="cuda")
    p = make_moe_inputs(128, 1024, 512, 8, 4, device="cuda", empty_slot_frac=0.1)
    x = p["x"].clone().requires_grad_()
    w = p["topk_weights"].clone().requires_grad_()
    y = module(x, p["topk_idx"], w)
    y.backward(p["dy"])
    y_direct, handle = deep_gemm.bf16_mega_moe(p["x"], p["topk_idx"], p["topk_weights"], module.l1, module.l2,
                                               training=True)
    dx, dw, dl1, dl2 = mega_moe_backward(p["dy"], module.l1.detach(), module.l2.detach(), handle,
                                         weight_grad_dtype=torch.bfloat16)
    assert torch.equal(y, y_direct) and torch.equal(x.grad, dx) and torch.equal(w.grad, dw)
    assert torch.equal(module.l1.grad, dl1) and torch.equal(module.l2.grad, dl2)


@requires_sm90
def test_a_second_backward_through_the_graph_raises():
    """The first backward overwrites the saved h; autograd sees it and refuses a second one."""
    p = make_moe_inputs(64, 512, 256, 4, 2, device="cuda")
    x = p["x"].clone().requires_grad_()
    y = mega_moe(x, p["topk_idx"], p["topk_weights"], p["l1"], p["l2"])
    y.backward(p["dy"], retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward(p["dy"])



def test_new_weight_gradients_are_allocated_at_their_gemms():
    """A new gradient comes into being when its GEMM asks for it (so it is not alive through the
    backward's steps before), once; a given one is accumulated into."""
    from megamoe_bwd.backward import weight_grads
    l1, l2, given = torch.zeros(2, 4, 8), torch.zeros(2, 8, 2), torch.ones(2, 8, 2, dtype=torch.bfloat16)
    grads = weight_grads(l1, l2, torch.float32, dl2=given)
    assert grads.dl1 is None and not grads.accumulate_dl1
    assert grads.get_dl2() is given and grads.accumulate_dl2
    assert grads.dtypes() == (torch.float32, torch.bfloat16)
    dl1 = grads.get_dl1()
    assert dl1.shape == l1.shape and dl1.dtype == torch.float32 and grads.get_dl1() is dl1

@requires_sm90
def test_cuda_graph_capture():
    # No host sync anywhere on the path: forward and backward capture into one CUDA graph.
    p = make_moe_inputs(256, 1024, 512, 8, 4, device="cuda", routing="skewed", empty_slot_frac=0.1)
    args = (p["x"], p["topk_idx"], p["topk_weights"], p["l1"], p["l2"])

    def step():
        y, handle = deep_gemm.bf16_mega_moe(*args, training=True)
        return (y, *mega_moe_backward(p["dy"], p["l1"], p["l2"], handle))

    eager, captured = eager_and_graph_replay(step)
    assert all(torch.equal(a, b) for a, b in zip(eager, captured))


@requires_sm90
def test_torch_compile_keeps_the_op_whole():
    p = make_moe_inputs(64, 512, 256, 4, 2, device="cuda")
    compiled = torch.compile(mega_moe, fullgraph=True)
    y = compiled(p["x"], p["topk_idx"], p["topk_weights"], p["l1"], p["l2"])
    assert torch.equal(y, mega_moe(p["x"], p["topk_idx"], p["topk_weights"], p["l1"], p["l2"]))


if __name__ == "__main__":
    if not HAS_SM90:
        sys.exit("needs an sm_90 GPU")
    print(f"{'case':<16} {'output':<14} {'ours':>9} {'baseline':>9} {'ratio':>6}")
    for label, *case in GPU_CASES:
        for name, (ours, base) in _accuracy(*case).items():
            print(f"{label:<16} {name:<14} {ours:>9.2e} {base:>9.2e} {ours / max(base, 1e-30):>6.2f}")
