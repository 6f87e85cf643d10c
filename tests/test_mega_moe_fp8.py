"""Spec of the FP8 Mega MoE layer (`deep_gemm.fp8_mega_moe` and its backward through
`mega_moe_backward`): every output within 1.5x of the FP8 recipe's own error against the
float64 spec (`megamoe_bwd.reference_fp8`), on a CPU with the kernels emulated and on a GPU;
the weights' FP8 copies cached until a weight changes; CUDA-graph capture and torch.compile;
bad input refused before any work.
"""
from __future__ import annotations

import contextlib
import os
import sys
import weakref

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import deep_gemm  # noqa: E402
from deep_gemm.moe import build_routing_layout  # noqa: E402
from deep_gemm.moe.fp8 import fp8_moe_forward, fp8_weights, invalidate_fp8_weights  # noqa: E402
from deep_gemm.moe.forward import MegaMoEHandle  # noqa: E402
from deep_gemm.testing import same_bits  # noqa: E402
from emulated_kernels import patch_kernels  # noqa: E402
from megamoe_bwd import make_moe_inputs, mega_moe_backward  # noqa: E402
from megamoe_bwd.reference import reference_backward, reference_forward, relative_error  # noqa: E402
from megamoe_bwd.reference_fp8 import reference_backward_fp8, reference_forward_fp8  # noqa: E402

HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
requires_sm90 = pytest.mark.skipif(not HAS_SM90, reason="needs an sm_90 GPU")
OUTPUTS = ("y", "dx", "dtopk_weights", "dl1", "dl2")
# (T, H, I, E, K, routing, empty-slot fraction): ragged groups, empty slots and experts, one hot expert, T = 1
CASES = [
    (100, 256, 128, 8, 4, "uniform", 0.0),
    (100, 256, 128, 8, 4, "uniform", 0.3),
    (64, 128, 256, 16, 2, "skewed", 0.0),  # experts without tokens
    (50, 256, 128, 4, 2, "one_hot", 0.1),
    (1, 128, 128, 4, 2, "uniform", 0.0),
]


@pytest.fixture
def emulated_gemms(monkeypatch):
    patch_kernels(monkeypatch.setattr)


def _emulated_layer(x, topk_idx, topk_weights, l1, l2, dy):
    """The FP8 layer's own orchestration on the CPU (kernels emulated, quantization by its
    PyTorch reference): y, dx, dtopk_weights, dl1, dl2."""
    layout = build_routing_layout(topk_idx, topk_weights, l1.shape[0])
    y = torch.empty_like(x)
    h = fp8_moe_forward(x, layout, topk_weights, fp8_weights(l1), fp8_weights(l2), y)
    handle = MegaMoEHandle(layout, x, h, recipe="fp8")
    return (y, *mega_moe_backward(dy, l1, l2, handle))


def _gpu_layer(x, topk_idx, topk_weights, l1, l2, dy):
    y, handle = deep_gemm.fp8_mega_moe(x, topk_idx, topk_weights, l1, l2, training=True)
    return (y, *mega_moe_backward(dy, l1, l2, handle))


def _errors(layer, case, device):
    """{output: (the layer's error, the FP8 reference's error)} against the float64 spec."""
    T, H, I, E, K, routing, empty = case
    p = make_moe_inputs(T, H, I, E, K, device=device, routing=routing, empty_slot_frac=empty, seed=T + H + E)
    args = [p[n] for n in ("x", "topk_idx", "topk_weights", "l1", "l2", "dy")]
    ours = layer(*args)
    f64 = [t.double() if t.is_floating_point() else t for t in args]
    spec = (reference_forward(*f64[:5]), *reference_backward(*f64))
    recipe = (reference_forward_fp8(*args[:5]), *reference_backward_fp8(*args))
    return {name: (relative_error(o.double(), s), relative_error(r.double(), s))
            for name, o, r, s in zip(OUTPUTS, ours, recipe, spec)}


@pytest.mark.parametrize("case", CASES, ids=[f"{c[5]}-T{c[0]}-empty{c[6]}" for c in CASES])
def test_emulated_layer_meets_the_fp8_bar(emulated_gemms, case):
    for name, (ours, recipe) in _errors(_emulated_layer, case, "cpu").items():
        assert ours <= 1.5 * recipe, f"{name}: {ours:.3e} against the FP8 recipe's {recipe:.3e}"


# GPU only (the emulated float64 reference of a 2048-wide layer is slow on the CPU): K of 2048 and
# 768 (the 30B shape's H and I), 8 of 32 experts, skewed
GPU_CASES = CASES + [(512, 2048, 768, 32, 8, "skewed", 0.1)]


@requires_sm90
@pytest.mark.parametrize("case", GPU_CASES, ids=[f"{c[5]}-T{c[0]}-H{c[1]}-empty{c[6]}" for c in GPU_CASES])
def test_layer_meets_the_fp8_bar(case):
    for name, (ours, recipe) in _errors(_gpu_layer, case, "cuda").items():
        assert ours <= 1.5 * recipe, f"{name}: {ours:.3e} against the FP8 recipe's {recipe:.3e}"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_sm90)])
@pytest.mark.parametrize("tokens,empty", [(0, 0.0), (16, 1.0)], ids=["T0", "every-slot-empty"])
def test_no_tokens_or_no_routed_slot_give_zeros(request, device, tokens, empty):
    """T = 0, or every slot -1: every expert empty, outputs of the right shapes, all zeros."""
    if device == "cpu":
        request.getfixturevalue("emulated_gemms")
    p = make_moe_inputs(tokens, 128, 128, 4, 2, device=device, empty_slot_frac=empty, seed=0)
    layer = _emulated_layer if device == "cpu" else _gpu_layer
    outputs = layer(*(p[n] for n in ("x", "topk_idx", "topk_weights", "l1", "l2", "dy")))
    shapes = ((tokens, 128), (tokens, 128), (tokens, 2), (4, 256, 128), (4, 128, 128))
    for name, out, shape in zip(OUTPUTS, outputs, shapes):
        assert tuple(out.shape) == shape and not out.any(), name


@requires_sm90
def test_the_fp8_layer_is_deterministic():
    """Two forwards and backwards on the same inputs give the same bits (no atomics anywhere)."""
    p = make_moe_inputs(256, 1024, 512, 8, 4, device="cuda", routing="skewed", empty_slot_frac=0.1, seed=3)
    args = [p[n] for n in ("x", "topk_idx", "topk_weights", "l1", "l2", "dy")]
    first, second = _gpu_layer(*args), _gpu_layer(*args)
    for name, a, b in zip(OUTPUTS, first, second):
        assert same_bits(a, b), name


def test_the_fp8_recipe_is_near_the_spec_and_not_equal_to_it():
    """The reference the bar is drawn from: FP8's error, a few percent, not bf16's, not zero."""
    errors = _errors(lambda *a: (reference_forward(*a[:5]), *reference_backward(*a)), CASES[0], "cpu")
    for name, (_, recipe) in errors.items():
        assert 1e-3 < recipe < 1e-1, f"{name}: {recipe:.3e}"


def test_fp8_weights_are_cached_until_the_weight_changes():
    w = torch.randn(2, 128, 256, dtype=torch.bfloat16)
    first = fp8_weights(w)
    assert fp8_weights(w) is first
    with torch.no_grad():
        w.mul_(2)  # an in-place update (as an optimizer step makes) bumps the version counter
    second = fp8_weights(w)
    assert second is not first
    assert torch.equal(second.scales, first.scales * 2)


@contextlib.contextmanager
def weight_copies(policy):
    """`policy` for the FP8 weight copies inside the block, the one before it after."""
    previous = deep_gemm.get_fp8_weight_copies()
    deep_gemm.set_fp8_weight_copies(policy)
    try:
        yield
    finally:
        deep_gemm.set_fp8_weight_copies(previous)


@pytest.fixture
def per_call_copies():
    with weight_copies(deep_gemm.Fp8WeightCopies.PER_CALL):
        yield


def test_per_call_copies_are_new_at_every_call_and_never_cached(per_call_copies):
    w = torch.randn(2, 128, 256, dtype=torch.bfloat16)
    first = weakref.ref(fp8_weights(w))
    second = fp8_weights(w)
    assert first() is None and torch.equal(second.data.view(torch.uint8), fp8_weights(w).data.view(torch.uint8))
    assert deep_gemm.get_fp8_weight_copies() is deep_gemm.Fp8WeightCopies.PER_CALL


def test_per_gemm_copies_hold_the_forward_orientation_and_are_never_cached():
    from deep_gemm.moe.fp8 import fp8_dgrad_weights, kept_dgrad_weights
    w = torch.randn(2, 128, 256, dtype=torch.bfloat16)
    both = fp8_weights(w)
    with weight_copies(deep_gemm.Fp8WeightCopies.PER_GEMM):
        forward = fp8_weights(w)
        assert forward.data_t is None and fp8_weights(w) is not forward
        assert kept_dgrad_weights(forward, forward) is None
        data_t, scales_t = fp8_dgrad_weights(w)  # (the backward's own, made from w)
    assert torch.equal(forward.data.view(torch.uint8), both.data.view(torch.uint8))
    assert torch.equal(data_t.view(torch.uint8), both.data_t.view(torch.uint8))
    assert torch.equal(scales_t, both.scales.transpose(1, 2))


def test_a_backward_without_the_forwards_copies_caches_none(emulated_gemms):
    """A forward under PER_GEMM keeps no copy; its backward makes its own whatever the policy is
    by then (here PER_STEP again), and caches none."""
    from deep_gemm.moe import fp8 as moe_fp8
    p = make_moe_inputs(64, 128, 128, 4, 2, seed=7)
    x, topk_idx, topk_weights, l1, l2, dy = (p[n] for n in ("x", "topk_idx", "topk_weights", "l1", "l2", "dy"))
    layout = build_routing_layout(topk_idx, topk_weights, l1.shape[0])
    with weight_copies(deep_gemm.Fp8WeightCopies.PER_GEMM):
        h = fp8_moe_forward(x, layout, topk_weights, fp8_weights(l1), fp8_weights(l2), torch.empty_like(x))
    invalidate_fp8_weights()
    mega_moe_backward(dy, l1, l2, MegaMoEHandle(layout, x, h, recipe="fp8"))
    assert len(moe_fp8._weight_cache) == 0


@pytest.mark.parametrize("policy", [deep_gemm.Fp8WeightCopies.PER_CALL, deep_gemm.Fp8WeightCopies.PER_GEMM])
def test_switching_away_from_per_step_drops_the_cached_copies(policy):
    w = torch.randn(2, 128, 256, dtype=torch.bfloat16)
    cached = weakref.ref(fp8_weights(w))
    with weight_copies(policy):
        assert cached() is None
    assert fp8_weights(w) is fp8_weights(w)


def test_the_copies_policy_is_an_fp8_weight_copies():
    with pytest.raises(TypeError, match="Fp8WeightCopies"):
        deep_gemm.set_fp8_weight_copies("per_call")
    assert deep_gemm.get_fp8_weight_copies() is deep_gemm.Fp8WeightCopies.PER_STEP


@pytest.mark.parametrize("policy", [deep_gemm.Fp8WeightCopies.PER_CALL, deep_gemm.Fp8WeightCopies.PER_GEMM])
def test_emulated_layer_gives_the_same_outputs_with_uncached_copies(emulated_gemms, policy):
    p = make_moe_inputs(100, 256, 128, 8, 4, routing="skewed", seed=3)
    args = [p[n] for n in ("x", "topk_idx", "topk_weights", "l1", "l2", "dy")]
    per_step = _emulated_layer(*args)
    with weight_copies(policy):
        uncached = _emulated_layer(*args)
    for name, a, b in zip(OUTPUTS, per_step, uncached):
        assert torch.equal(a, b), name


def test_the_backward_writes_x_columns_into_the_consumed_h(emulated_gemms, monkeypatch):
    """x's columns for dl1 take the memory of h, dead once the SwiGLU backward has read it (here
    h is 1 MiB, the columns 0.31 MiB); the gradients are those of a backward that keeps h."""
    import megamoe_bwd.backward as backward
    p = make_moe_inputs(512, 128, 128, 4, 4, seed=5)
    x, topk_idx, topk_weights, l1, l2, dy = (p[n] for n in ("x", "topk_idx", "topk_weights", "l1", "l2", "dy"))
    quantize_columns, storages = backward.fp8_quantize_columns, []

    def recorded(*args, out_storage=None, **kwargs):
        storages.append(out_storage)
        return quantize_columns(*args, out_storage=out_storage, **kwargs)

    monkeypatch.setattr(backward, "fp8_quantize_columns", recorded)
    results = {}
    for keep in (False, True):
        layout = build_routing_layout(topk_idx, topk_weights, l1.shape[0])
        h = fp8_moe_forward(x, layout, topk_weights, fp8_weights(l1), fp8_weights(l2), torch.empty_like(x))
        version, storages[:] = h._version, []
        results[keep] = mega_moe_backward(dy, l1, l2, MegaMoEHandle(layout, x, h, recipe="fp8"), keep_handle=keep)
        assert storages[-1] is (None if keep else h)
        assert (h._version > version) != keep  # (a saved copy of h cannot be read silently)
    for name, a, b in zip(OUTPUTS[1:], results[False], results[True]):
        assert torch.equal(a, b), name


@requires_sm90
@pytest.mark.parametrize("policy", [deep_gemm.Fp8WeightCopies.PER_CALL, deep_gemm.Fp8WeightCopies.PER_GEMM])
def test_uncached_copies_do_not_outlive_the_backward(policy):
    """Through autograd, PER_CALL and PER_GEMM leave nothing allocated once the gradients are taken
    away (the forward's copies go with the forward, the data gradients' with the backward), with
    the direct calls' outputs and gradients, bit for bit."""
    from megamoe_bwd import mega_moe
    p = make_moe_inputs(512, 256, 256, 8, 4, device="cuda", seed=4)
    leaves = [p[n].detach().requires_grad_(n != "topk_idx") for n in ("x", "topk_idx", "topk_weights", "l1", "l2")]
    with weight_copies(policy):
        y = mega_moe(*leaves, fp8=True)
        y.backward(p["dy"])
        direct = _gpu_layer(*(p[n] for n in ("x", "topk_idx", "topk_weights", "l1", "l2", "dy")))
        for name, a, b in zip(OUTPUTS, direct, (y, *(leaves[i].grad for i in (0, 2, 3, 4)))):
            assert torch.equal(a.to(b.dtype), b), name
        del y, direct
        for t in leaves:
            t.grad = None
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        y = mega_moe(*leaves, fp8=True)
        y.backward(p["dy"])
        del y
        for t in leaves:
            t.grad = None
        assert torch.cuda.memory_allocated() == before


def _peak_fwd_bwd_bytes(leaves, dy, fp8: bool) -> int:
    """Peak bytes allocated above what is alive before one autograd fwd+bwd (after one warm-up)."""
    from megamoe_bwd import mega_moe
    for _ in range(2):
        for t in leaves:
            t.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        mega_moe(*leaves, fp8=fp8).backward(dy)
        torch.cuda.synchronize()
    for t in leaves:
        t.grad = None
    return torch.cuda.max_memory_allocated() - base


@requires_sm90
def test_per_gemm_copies_keep_the_peak_at_most_bf16s():
    """At the Qwen3-30B-A3B shape (16384 tokens), an FP8 fwd+bwd with PER_GEMM copies peaks no
    higher than the bf16 layer's (issue 19's memory bar)."""
    p = make_moe_inputs(16384, 2048, 768, 128, 8, device="cuda", seed=6)
    leaves = [p[n].detach().requires_grad_(n != "topk_idx") for n in ("x", "topk_idx", "topk_weights", "l1", "l2")]
    bf16 = _peak_fwd_bwd_bytes(leaves, p["dy"], fp8=False)
    with weight_copies(deep_gemm.Fp8WeightCopies.PER_GEMM):
        fp8 = _peak_fwd_bwd_bytes(leaves, p["dy"], fp8=True)
    assert fp8 <= bf16, (fp8 / 2**30, bf16 / 2**30)


@pytest.mark.parametrize("inter,hidden", [(192, 256), (128, 320)])
def test_dims_must_be_multiples_of_128(inter, hidden):
    p = make_moe_inputs(4, hidden, inter, 4, 2, seed=0)
    with pytest.raises(ValueError, match="must be a multiple of 128"):
        deep_gemm.fp8_mega_moe(p["x"], p["topk_idx"], p["topk_weights"], p["l1"], p["l2"])


def test_cpu_tensors_are_refused():
    p = make_moe_inputs(4, 128, 128, 4, 2, seed=0)
    args = [p[n] for n in ("x", "topk_idx", "topk_weights", "l1", "l2")]
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        deep_gemm.fp8_mega_moe(*args)
    from megamoe_bwd import mega_moe
    with pytest.raises(ValueError, match="runs on CUDA tensors"):  # (not the dispatcher's "no CPU kernel")
        mega_moe(*args, fp8=True)


@pytest.mark.parametrize("bad,error,match", [
    (dict(x=lambda p: p["x"].tolist()), TypeError, "x must be"),  # (not an AttributeError from a size check)
    (dict(y=lambda p: p["x"], training=lambda p: True), ValueError, "y overlaps x in memory"),
    (dict(y=lambda p: p["x"]), ValueError, "runs on CUDA tensors"),  # in inference y may be x
])
def test_the_fp8_forward_refuses_bad_input_clearly(bad, error, match):
    p = make_moe_inputs(4, 128, 128, 4, 2, seed=0)
    args = {n: p[n] for n in ("x", "topk_idx", "topk_weights", "l1", "l2")}
    args.update({name: make(p) for name, make in bad.items()})
    with pytest.raises(error, match=match):
        deep_gemm.fp8_mega_moe(**args)


@pytest.mark.parametrize("kwargs,match", [
    (dict(hidden=192, intermediate=128), "multiples of 128"),
    (dict(hidden=256, intermediate=128, group=object()), "not 'nccl'"),  # (no buffer: the NCCL exchange)
])
def test_the_module_refuses_what_fp8_cannot_run(kwargs, match):
    from megamoe_bwd import MegaMoE
    with pytest.raises(ValueError, match=match):
        MegaMoE(8, fp8=True, **kwargs)


@requires_sm90
def test_autograd_layer_in_fp8_is_the_direct_calls():
    """`megamoe_bwd.mega_moe(..., fp8=True)` through autograd gives the direct calls' outputs and
    gradients, bit for bit (the layer is deterministic)."""
    from megamoe_bwd import mega_moe
    p = make_moe_inputs(100, 256, 128, 8, 4, device="cuda", seed=1)
    direct = _gpu_layer(*(p[n] for n in ("x", "topk_idx", "topk_weights", "l1", "l2", "dy")))
    leaves = {n: p[n].detach().clone().requires_grad_(n != "topk_idx") for n in ("x", "topk_idx", "topk_weights", "l1", "l2")}
    y = mega_moe(*leaves.values(), fp8=True)
    y.backward(p["dy"])
    through = (y, leaves["x"].grad, leaves["topk_weights"].grad, leaves["l1"].grad, leaves["l2"].grad)
    for name, a, b in zip(OUTPUTS, direct, through):
        assert torch.equal(a.to(b.dtype), b), name


@requires_sm90
def test_the_fp8_layer_captures_into_a_cuda_graph(weight_quantizations):
    """No host sync on the FP8 path: forward and backward capture into one CUDA graph (the
    weights are quantized inside it, once each: `fp8_weights` bypasses its cache under capture and
    the backward reads the forward's copies), and the replay gives the eager step's outputs bit
    for bit."""
    from deep_gemm.testing import eager_and_graph_replay
    p = make_moe_inputs(256, 256, 256, 8, 4, device="cuda", routing="skewed", empty_slot_frac=0.1, seed=5)
    args = [p[n] for n in ("x", "topk_idx", "topk_weights", "l1", "l2", "dy")]
    eager, captured = eager_and_graph_replay(lambda: _gpu_layer(*args))
    for name, a, b in zip(OUTPUTS, eager, captured):
        assert torch.equal(a, b), name
    assert weight_quantizations.count(True) == 2, weight_quantizations  # l1 and l2, in the captured step


@requires_sm90
def test_a_captured_autograd_step_quantizes_each_weight_once(weight_quantizations):
    """`megamoe_bwd.mega_moe(..., fp8=True)` and its backward captured into one CUDA graph: the
    backward op gets the forward's weight copies through the forward op's outputs."""
    from deep_gemm.testing import eager_and_graph_replay
    from megamoe_bwd import mega_moe
    p = make_moe_inputs(256, 256, 256, 8, 4, device="cuda", seed=8)
    leaves = [p[n].detach().requires_grad_(n != "topk_idx") for n in ("x", "topk_idx", "topk_weights", "l1", "l2")]

    def step():
        for t in leaves:
            t.grad = None
        y = mega_moe(*leaves, fp8=True)
        y.backward(p["dy"])
        # (y detached: its graph would keep the leaves' gradient accumulators, made on the eager
        # step's stream, into the capture)
        return [y.detach()] + [t.grad for t in leaves if t.requires_grad]

    eager, captured = eager_and_graph_replay(step)
    for name, a, b in zip(OUTPUTS, eager, captured):
        assert torch.equal(a, b), name
    assert weight_quantizations.count(True) == 2, weight_quantizations


def test_the_backward_multiplies_by_the_forward_weight_copies(emulated_gemms):
    """The handle keeps the forward's FP8 copies: weights changed after the forward (which would
    renew the cache) do not change dx, as autograd's gradient of the forward's weights."""
    p = make_moe_inputs(100, 256, 128, 8, 4, seed=7)
    x, topk_idx, topk_weights, l1, l2, dy = (p[n] for n in ("x", "topk_idx", "topk_weights", "l1", "l2", "dy"))

    def dx(change_weights: bool) -> torch.Tensor:
        layout = build_routing_layout(topk_idx, topk_weights, l1.shape[0])
        w1, w2 = fp8_weights(l1), fp8_weights(l2)
        h = fp8_moe_forward(x, layout, topk_weights, w1, w2, torch.empty_like(x))
        handle = MegaMoEHandle(layout, x, h, recipe="fp8", dgrad_weights=(w1.transposed_operand(),
                                                                         w2.transposed_operand()))
        if change_weights:
            with torch.no_grad():
                l1.mul_(2), l2.mul_(2)
        return mega_moe_backward(dy, l1, l2, handle)[0]

    before = dx(False)
    assert torch.equal(dx(True), before)


@requires_sm90
def test_torch_compile_keeps_the_fp8_op_whole():
    from megamoe_bwd import mega_moe
    p = make_moe_inputs(64, 256, 128, 4, 2, device="cuda", seed=6)
    args = [p[n] for n in ("x", "topk_idx", "topk_weights", "l1", "l2")]
    compiled = torch.compile(lambda *a: mega_moe(*a, fp8=True), fullgraph=True)
    assert torch.equal(compiled(*args), mega_moe(*args, fp8=True))


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_sm90)])
def test_an_optimizer_step_renews_the_fp8_weights(device, fused):
    """Fused optimizers leave version counters alone: the step itself invalidates the copies."""
    w = torch.nn.Parameter(torch.randn(2, 128, 256, device=device, dtype=torch.bfloat16))
    before = fp8_weights(w)
    w.grad = torch.randn_like(w)
    torch.optim.AdamW([w], lr=1e-2, fused=fused).step()
    after = fp8_weights(w)
    assert after is not before and not torch.equal(after.data.view(torch.uint8), before.data.view(torch.uint8))
    assert fp8_weights(w) is after


def test_an_optimizer_step_frees_the_stale_copies_before_it_runs():
    w = torch.nn.Parameter(torch.randn(2, 128, 256, dtype=torch.bfloat16))
    stale = weakref.ref(fp8_weights(w).data)
    w.grad = torch.randn_like(w)
    seen_during_step = []

    class Probe(torch.optim.SGD):
        def step(self, closure=None):
            seen_during_step.append(stale() is None)
            return super().step(closure)

    Probe([w], lr=1e-2).step()
    assert seen_during_step == [True]


def test_a_weight_whose_storage_moves_is_quantized_again():
    w = torch.randn(2, 128, 256, dtype=torch.bfloat16)
    first = fp8_weights(w)
    w.data = w.data * 2  # new storage, no in-place write: the cache key's address changes
    second = fp8_weights(w)
    assert second is not first and torch.equal(second.scales, first.scales * 2)


def test_an_inference_tensors_copy_is_renewed_by_an_explicit_invalidation():
    """An inference tensor has no version counter: its copy stays until `invalidate_fp8_weights`
    (or a storage move), as `fp8_weights` documents."""
    with torch.inference_mode():
        w = torch.randn(2, 128, 256, dtype=torch.bfloat16)
        first = fp8_weights(w)
        w.mul_(2)
        assert fp8_weights(w) is first
    invalidate_fp8_weights()
    assert torch.equal(fp8_weights(w).scales, first.scales * 2)


def test_writes_through_data_need_an_explicit_invalidation():
    w = torch.randn(2, 128, 256, dtype=torch.bfloat16)
    before = fp8_weights(w)
    w.data.mul_(2)  # (bumps no version counter)
    assert fp8_weights(w) is before
    invalidate_fp8_weights()
    assert torch.equal(fp8_weights(w).scales, before.scales * 2)


@pytest.mark.parametrize("tokens,topk,experts,hidden,inter,match", [
    (4, 2, 1025, 128, 128, "at most 1024 experts"),
    (2**20, 8, 8, 2048, 256, "fewer than 2\\^31 elements"),  # [T * K, H] = 2^23 x 2^11
])
def test_sizes_the_fp8_backward_cannot_take_are_refused_in_the_forward(tokens, topk, experts, hidden, inter, match):
    meta = dict(device="meta")
    with pytest.raises(ValueError, match=match):
        deep_gemm.fp8_mega_moe(torch.empty(tokens, hidden, dtype=torch.bfloat16, **meta),
                               torch.empty(tokens, topk, dtype=torch.int64, **meta),
                               torch.empty(tokens, topk, **meta),
                               torch.empty(experts, 2 * inter, hidden, dtype=torch.bfloat16, **meta),
                               torch.empty(experts, hidden, inter, dtype=torch.bfloat16, **meta))


@requires_sm90
def test_the_blockwise_layer_is_more_accurate_than_the_torch_rowwise_fp8_moe():
    """Against the float64 spec, every output of ours within 1.5x of the torchao-style rowwise
    FP8 MoE's error (`megamoe_bwd.baseline.fp8_rowwise_moe`, the benchmark's FP8 baseline)."""
    from megamoe_bwd.baseline import fp8_rowwise_moe
    p = make_moe_inputs(256, 256, 128, 8, 4, device="cuda", seed=3)
    args = [p[n] for n in ("x", "topk_idx", "topk_weights", "l1", "l2", "dy")]
    ours = _gpu_layer(*args)
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in args[:5]]
    y = fp8_rowwise_moe(*leaves)
    y.backward(args[5])
    theirs = (y, leaves[0].grad, leaves[2].grad, leaves[3].grad, leaves[4].grad)
    f64 = [t.double() if t.is_floating_point() else t for t in args]
    spec = (reference_forward(*f64[:5]), *reference_backward(*f64))
    for name, o, t, s in zip(OUTPUTS, ours, theirs, spec):
        ours_err, theirs_err = relative_error(o.double(), s), relative_error(t.double(), s)
        assert ours_err <= 1.5 * theirs_err, f"{name}: ours {ours_err:.3e}, torch rowwise {theirs_err:.3e}"



# (T, I, E, K, routing, empty-slot fraction): experts of every size, one hot expert, T = 1
SWIGLU_BWD_CASES = [
    (300, 256, 8, 4, "uniform", 0.2),
    (200, 128, 16, 2, "skewed", 0.0),
    (150, 384, 4, 2, "one_hot", 0.1),
    (1, 128, 4, 2, "uniform", 0.0),
]


@requires_sm90
@pytest.mark.parametrize("power_of_two", [False, True])
@pytest.mark.parametrize("case", SWIGLU_BWD_CASES, ids=[f"{c[4]}-T{c[0]}-I{c[1]}" for c in SWIGLU_BWD_CASES])
def test_the_fused_swiglu_backward_is_the_bf16_kernel_then_the_quantization(case, power_of_two):
    """`moe_swiglu_bwd_fp8` writes what `moe_swiglu_bwd_bf16` followed by `fp8_quantize_columns`
    (dz as rows and columns, w * act as columns) writes, bit for bit; row_dw up to the order of
    its fp32 sum."""
    from deep_gemm.moe.kernels import moe_swiglu_bwd_bf16
    from deep_gemm.moe.kernels_fp8 import moe_swiglu_bwd_fp8
    from deep_gemm.quant import fp8_quantize_columns
    from deep_gemm.testing import poisoned_allocations
    T, inter, E, K, routing, empty = case
    p = make_moe_inputs(T, 128, inter, E, K, device="cuda", routing=routing, empty_slot_frac=empty, seed=T + inter)
    layout = build_routing_layout(p["topk_idx"], p["topk_weights"], E)
    gen = torch.Generator(device="cuda").manual_seed(T)
    h = torch.randn(layout.num_slots, 2 * inter, device="cuda", generator=gen).bfloat16()
    d_act = torch.randn(layout.num_slots, inter, device="cuda", generator=gen).bfloat16()
    dz, act_weighted, ref_row_dw = moe_swiglu_bwd_bf16(h, d_act, layout)
    ref_rows, ref_dz = fp8_quantize_columns(dz, layout.offsets, with_rows=True, power_of_two_scales=power_of_two)
    _, ref_act = fp8_quantize_columns(act_weighted, layout.offsets, power_of_two_scales=power_of_two)
    with poisoned_allocations(64 * h.numel()) as poisoned:
        rows, dz_cols, act_cols, row_dw = moe_swiglu_bwd_fp8(h, d_act, layout, power_of_two_scales=power_of_two)
        assert all(poisoned(t) for t in (rows.data, dz_cols.data, act_cols.data, row_dw))
    routed, used = int(layout.offsets[-1]), int(ref_dz.padded_offsets[-1])
    assert same_bits(rows.data[:routed], ref_rows.data[:routed]) and same_bits(rows.scales[:routed], ref_rows.scales[:routed])
    for ours, ref in ((dz_cols, ref_dz), (act_cols, ref_act)):
        assert same_bits(ours.padded_offsets, ref.padded_offsets)
        assert same_bits(ours.data[:, :used], ref.data[:, :used])
        assert same_bits(ours.scales[:used // 128], ref.scales[:used // 128])
    torch.testing.assert_close(row_dw[:routed], ref_row_dw[:routed], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("h_shape,d_act_shape,dtype,error,match", [
    ((6, 256), (6, 128), torch.float32, TypeError, "bfloat16"),
    ((6, 200), (6, 100), torch.bfloat16, ValueError, "multiple of 128"),
    ((6, 512), (6, 128), torch.bfloat16, ValueError, "2I"),
    ((5, 256), (5, 128), torch.bfloat16, ValueError, "2I"),  # not the layout's 6 slots
])
def test_the_fused_swiglu_backward_refuses_bad_input_before_any_launch(h_shape, d_act_shape, dtype, error, match):
    from deep_gemm.moe.kernels_fp8 import moe_swiglu_bwd_fp8
    from deep_gemm.moe.layout import build_routing_layout_torch
    layout = build_routing_layout_torch(torch.tensor([[0, 1], [1, 2], [2, 0]]), torch.ones(3, 2), 3)
    with pytest.raises(error, match=match):
        moe_swiglu_bwd_fp8(torch.zeros(h_shape, dtype=dtype), torch.zeros(d_act_shape, dtype=dtype), layout)
