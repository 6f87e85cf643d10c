"""Spec of the integrations: transformers' experts backend ("megamoe") and the TorchTitan-style
experts module.

CPU, float64, the layer's own orchestration on emulated kernels: the backend gives the HF
experts' eager forward and every gradient (input, router, both weights), a gate/up swap would
fail that comparison, ids of E or more are empty slots, and what the layer cannot run is refused.
The TorchTitan module equals TorchTitan's math and keeps its state-dict keys.
GPU: training steps of a small Qwen3-MoE with transformers' default experts backend and ours
(logits and gradients within the accuracy bar against float64, losses within 2%), under
torch.compile (the FP8 backend's weight copies still made once a step there) and with gradient
checkpointing; the TorchTitan module within the bar.
"""
from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install -e '.[test]')")

import megamoe_bwd.autograd  # noqa: E402
import megamoe_bwd.module  # noqa: E402
from emulated_kernels import emulated_mega_moe, patch_kernels  # noqa: E402
from megamoe_bwd.integrations import transformers as hf_backend  # noqa: E402
from megamoe_bwd.integrations.torchtitan import GroupedExperts  # noqa: E402
from megamoe_bwd.reference import reference_forward, relative_error  # noqa: E402
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts, Qwen3MoeSparseMoeBlock  # noqa: E402

HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
requires_sm90 = pytest.mark.skipif(not HAS_SM90, reason="needs an sm_90 GPU")


@pytest.fixture
def emulated_layer(monkeypatch):
    """The fused layer on the CPU: its orchestration with the kernels' emulations."""
    patch_kernels(monkeypatch.setattr)
    monkeypatch.setattr(megamoe_bwd.autograd, "mega_moe", emulated_mega_moe)
    monkeypatch.setattr(megamoe_bwd.module, "mega_moe", emulated_mega_moe)


def _config(**overrides) -> Qwen3MoeConfig:
    sizes = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                 norm_topk_prob=True)
    return Qwen3MoeConfig(**{**sizes, **overrides})


def _moe_block(dtype=torch.float64, device="cpu", seed=0) -> Qwen3MoeSparseMoeBlock:
    """A Qwen3-MoE block (router + experts) with random weights (the router's are zeros at init)."""
    block = Qwen3MoeSparseMoeBlock(_config()).to(device=device, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    for p in block.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=dtype) / p.shape[-1] ** 0.5)
    return block


def _run_block(block, backend: str, x: torch.Tensor, dy: torch.Tensor) -> dict:
    """y and every gradient of one forward and backward of `block` with experts `backend`."""
    block.experts.config._experts_implementation = backend
    block.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    y = block(x)
    y.backward(dy)
    return {"y": y.detach(), "dx": x.grad, "router": block.gate.weight.grad,
            "gate_up_proj": block.experts.gate_up_proj.grad, "down_proj": block.experts.down_proj.grad}


def test_backend_matches_the_eager_experts(emulated_layer):
    block = _moe_block()
    x, dy = torch.randn(2, 9, 64, dtype=torch.float64), torch.randn(2, 9, 64, dtype=torch.float64)
    eager, ours = _run_block(block, "eager", x, dy), _run_block(block, hf_backend.NAME, x, dy)
    for name in eager:
        assert relative_error(ours[name], eager[name]) < 1e-10, name


@pytest.mark.parametrize("config_class,model_class", [
    ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"), ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    ("MixtralConfig", "MixtralForCausalLM"), ("OlmoeConfig", "OlmoeForCausalLM")])
def test_whole_models_match_their_eager_experts(emulated_layer, config_class, model_class):
    """One layer of each architecture, float64: logits and every parameter's gradient."""
    config = getattr(transformers, config_class)()
    sizes = dict(vocab_size=256, hidden_size=64, intermediate_size=64, moe_intermediate_size=64,
                 shared_expert_intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, num_experts=8, num_local_experts=8, num_experts_per_tok=2)
    for key, value in sizes.items():
        if hasattr(config, key):
            setattr(config, key, value)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).double()
    for p in model.parameters():
        p.data.normal_(0.0, 0.1)
    tokens = torch.randint(0, 256, (2, 9))
    results = {}
    for backend in ("eager", hf_backend.NAME):
        model.set_experts_implementation(backend)
        model.zero_grad(set_to_none=True)
        out = model(input_ids=tokens, labels=tokens)
        out.loss.backward()
        results[backend] = (out.logits.detach(), torch.cat([p.grad.flatten() for p in model.parameters()]))
    for i, name in enumerate(("logits", "gradients")):
        assert relative_error(results[hf_backend.NAME][i], results["eager"][i]) < 1e-10, name


def test_a_gate_up_swap_fails_the_comparison(emulated_layer):
    """The comparison above has the power to see the layout: with the gate and up rows of each
    expert swapped for our side only, the outputs disagree."""
    block = _moe_block()
    x, dy = torch.randn(2, 9, 64, dtype=torch.float64), torch.randn(2, 9, 64, dtype=torch.float64)
    eager = _run_block(block, "eager", x, dy)
    swapped = copy.deepcopy(block)
    inter = swapped.experts.gate_up_proj.shape[1] // 2
    swapped.experts.gate_up_proj.data = torch.cat([swapped.experts.gate_up_proj.data[:, inter:],
                                                   swapped.experts.gate_up_proj.data[:, :inter]], dim=1)
    ours = _run_block(swapped, hf_backend.NAME, x, dy)
    assert relative_error(ours["y"], eager["y"]) > 0.1


def test_ids_of_e_or_more_are_empty_slots(emulated_layer):
    experts = _moe_block().experts
    x = torch.randn(12, 64, dtype=torch.float64)
    idx = torch.randint(0, 8, (12, 2))
    idx[::3, 1] = 8  # another rank's slot, as transformers marks it under expert parallelism
    weights = torch.rand(12, 2, dtype=torch.float64)
    y = hf_backend.megamoe_experts_forward(experts, x, idx, weights)
    expected = reference_forward(x, torch.where(idx >= 8, -1, idx), weights, experts.gate_up_proj.detach(),
                                 experts.down_proj.detach())
    assert relative_error(y, expected) < 1e-10


def _experts_of(model: str, config_class: str, experts_class: str, **sizes) -> torch.nn.Module:
    import importlib
    config = getattr(importlib.import_module(f"transformers.models.{model}.configuration_{model}"), config_class)(**sizes)
    return getattr(importlib.import_module(f"transformers.models.{model}.modeling_{model}"), experts_class)(config)


@pytest.mark.parametrize("make,match", [
    (lambda: _experts_of("gpt_oss", "GptOssConfig", "GptOssExperts", hidden_size=64, intermediate_size=64,
                         num_local_experts=4), "expert biases; transposed expert weights; interleaved"),
    (lambda: _experts_of("deepseek_v4", "DeepseekV4Config", "DeepseekV4Experts", hidden_size=64,
                         moe_intermediate_size=64, n_routed_experts=4), "a custom gate"),
    (lambda: _experts_of("nemotron_h", "NemotronHConfig", "NemotronHExperts", hidden_size=64,
                         moe_intermediate_size=64, n_routed_experts=4), "experts without a gate"),
    (lambda: Qwen3MoeExperts(_config(hidden_act="gelu")), "the activation GELUActivation"),
])
def test_what_the_layer_cannot_run_is_refused(make, match):
    experts = make()
    x, idx, weights = torch.randn(4, 64), torch.zeros(4, 2, dtype=torch.int64), torch.ones(4, 2)
    with pytest.raises(ValueError, match=match):
        hf_backend.megamoe_experts_forward(experts, x, idx, weights)


def test_the_backend_is_registered():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    assert ALL_EXPERTS_FUNCTIONS[hf_backend.NAME] is hf_backend.megamoe_experts_forward
    model = Qwen3MoeForCausalLM(_config())
    model.set_experts_implementation(hf_backend.NAME)
    assert model.model.layers[0].mlp.experts.config._experts_implementation == hf_backend.NAME


def test_the_fp8_backend_is_registered():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    assert ALL_EXPERTS_FUNCTIONS[hf_backend.FP8_NAME] is hf_backend.megamoe_fp8_experts_forward
    with pytest.raises(ValueError, match=f"the '{hf_backend.FP8_NAME}' experts backend cannot run .*multiples of 128"):
        hf_backend.megamoe_fp8_experts_forward(Qwen3MoeExperts(_config()), torch.randn(4, 64),
                                               torch.zeros(4, 2, dtype=torch.int64), torch.ones(4, 2))


def titan_math(x, scores, expert_ids, w1, w2, w3):
    """TorchTitan's experts: per expert w2 @ (silu(w1 @ x) * (w3 @ x)), scores applied after."""
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        token, slot = (expert_ids == e).nonzero(as_tuple=True)
        h = F.silu(x[token] @ w1[e].T) * (x[token] @ w3[e].T)
        out = out.index_add(0, token, (h @ w2[e].T) * scores[token, slot, None])
    return out


def _titan_problem(device, dtype, num_experts=8, dim=128, hidden_dim=64, tokens=40, topk=2):
    experts = GroupedExperts(num_experts, dim, hidden_dim, device=device).to(dtype)
    x = torch.randn(tokens, dim, device=device, dtype=dtype)
    expert_ids = torch.rand(tokens, num_experts, device=device).argsort(dim=1)[:, :topk]
    scores = torch.rand(tokens, topk, device=device, dtype=torch.float32).softmax(-1)
    return experts, x, scores, expert_ids


def test_torchtitan_module_is_torchtitans_math(emulated_layer):
    experts, x, scores, expert_ids = _titan_problem("cpu", torch.float64)
    scores = scores.double()
    leaves = [t.clone().requires_grad_() for t in (x, scores)]
    y = experts(leaves[0], leaves[1], expert_ids)
    dy = torch.randn_like(y)
    y.backward(dy)
    w1, w2, w3 = (w.detach().clone().requires_grad_() for w in (experts.w1, experts.w2, experts.w3))
    ref_leaves = [t.clone().requires_grad_() for t in (x, scores)]
    ref = titan_math(ref_leaves[0], ref_leaves[1], expert_ids, w1, w2, w3)
    ref.backward(dy)
    assert relative_error(y, ref) < 1e-10
    for name, ours, theirs in (("dx", leaves[0].grad, ref_leaves[0].grad), ("dscores", leaves[1].grad, ref_leaves[1].grad),
                               ("dw1", experts.l1.grad[:, :64], w1.grad), ("dw3", experts.l1.grad[:, 64:], w3.grad),
                               ("dw2", experts.l2.grad, w2.grad)):
        assert relative_error(ours, theirs) < 1e-10, name


def test_torchtitan_module_in_fp8_is_the_fp8_layer(emulated_layer):
    """`GroupedExperts(..., fp8=True)` runs the layer's FP8 recipe on its weights: the outputs and
    gradients of `mega_moe(..., fp8=True)` on the same tensors, bit for bit; dims not multiples of
    128 are refused."""
    experts, x, scores, expert_ids = _titan_problem("cpu", torch.bfloat16, dim=256, hidden_dim=128)
    fp8_experts = GroupedExperts(8, 256, 128, fp8=True).to(torch.bfloat16)
    fp8_experts.load_state_dict(experts.state_dict())
    leaves = [t.clone().requires_grad_() for t in (x, scores)]
    y = fp8_experts(leaves[0], leaves[1], expert_ids)
    dy = torch.randn_like(y)
    y.backward(dy)
    l1, l2 = (w.detach().clone().requires_grad_() for w in (experts.l1, experts.l2))
    ref_leaves = [t.clone().requires_grad_() for t in (x, scores)]
    ref = emulated_mega_moe(ref_leaves[0], expert_ids, ref_leaves[1], l1, l2, fp8=True)
    ref.backward(dy)
    for ours, theirs in ((y, ref), (leaves[0].grad, ref_leaves[0].grad), (leaves[1].grad, ref_leaves[1].grad),
                         (fp8_experts.l1.grad, l1.grad), (fp8_experts.l2.grad, l2.grad)):
        assert torch.equal(ours, theirs)
    with pytest.raises(ValueError, match="multiples of 128"):
        GroupedExperts(8, 128, 64, fp8=True)


def test_torchtitan_module_keeps_torchtitans_state_dict():
    experts = GroupedExperts(4, 128, 64)
    state = experts.state_dict()
    assert sorted(state) == ["w1", "w2", "w3"] and tuple(state["w1"].shape) == (4, 64, 128)
    other = GroupedExperts(4, 128, 64)
    other.load_state_dict({"w1": state["w1"].clone(), "w2": state["w2"].clone(), "w3": state["w3"].clone()})
    assert torch.equal(other.l1, experts.l1) and torch.equal(other.w3, experts.w3) and torch.equal(other.w2, experts.w2)
    assert other.w1.data_ptr() == other.l1.data_ptr(), "w1 is a view of the fused parameter"


# ---------------------------------------------------------------- GPU

def _small_model(backend: str, seed: int = 0) -> Qwen3MoeForCausalLM:
    """A two-layer bf16 Qwen3-MoE with the layer's limits (H, I multiples of 64; I = 128 runs
    SwiGLU in GEMM1's epilogue), random weights from `seed`."""
    torch.manual_seed(seed)
    config = _config(hidden_size=256, moe_intermediate_size=128, num_hidden_layers=2, head_dim=64, num_experts=16,
                     num_experts_per_tok=4)
    model = Qwen3MoeForCausalLM(config).to(device="cuda", dtype=torch.bfloat16)
    model.set_experts_implementation(backend)
    return model


def _with_backend(model: Qwen3MoeForCausalLM, backend: str, dtype=torch.bfloat16) -> Qwen3MoeForCausalLM:
    """A copy of `model` (the same weights, in `dtype`) whose experts run on `backend`."""
    other = copy.deepcopy(model).to(dtype)
    other.set_experts_implementation(backend)
    return other


def _loss_and_grads(model, tokens):
    """(loss, logits, every parameter's gradient, flattened into one vector) of one step."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=tokens, labels=tokens, use_cache=False)  # (as train_moe.py: no KV cache in training)
    out.loss.backward()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    return out.loss.detach(), out.logits.detach(), torch.cat([g.flatten().double() for g in grads])


@requires_sm90
def test_training_steps_match_the_default_backend():
    """One step: the logits and every gradient of ours and of transformers' default (grouped_mm)
    backend, both bf16, against the same weights in float64; ours within 1.5x the default's
    error. Then four AdamW steps of each: the losses stay within 2% of each other."""
    tokens = torch.randint(0, 256, (4, 256), device="cuda")
    model = _small_model("grouped_mm")
    reference = _loss_and_grads(_with_backend(model, "eager", torch.float64), tokens)  # bf16 weights, float64 math
    runs = {}
    for backend in ("grouped_mm", hf_backend.NAME):
        copy_ = _with_backend(model, backend)
        runs[backend] = (_loss_and_grads(copy_, tokens), copy_)
    for i, name in ((1, "logits"), (2, "gradients")):  # (the scalar loss: within 2% below)
        ours = relative_error(runs[hf_backend.NAME][0][i], reference[i])
        base = relative_error(runs["grouped_mm"][0][i], reference[i])
        assert ours <= 1.5 * base + 1e-6, f"{name}: ours {ours:.2e} vs default backend {base:.2e}"
    losses = {}
    for backend, (_, model) in runs.items():
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(4):
            loss, _, _ = _loss_and_grads(model, tokens)
            optimizer.step()
            losses.setdefault(backend, []).append(loss.item())
    for ours, base in zip(losses[hf_backend.NAME], losses["grouped_mm"]):
        assert abs(ours - base) <= 0.02 * abs(base), losses


@requires_sm90
def test_fp8_backend_trains_like_the_bf16_one():
    """The issue's training bar at test scale: four AdamW steps with "megamoe_fp8" stay within 2%
    of the bf16 backend's losses, and every expert weight gets a finite gradient."""
    tokens = torch.randint(0, 256, (4, 256), device="cuda")
    model = _small_model(hf_backend.NAME)
    losses = {}
    for backend in (hf_backend.NAME, hf_backend.FP8_NAME):
        copy_ = _with_backend(model, backend)
        optimizer = torch.optim.AdamW(copy_.parameters(), lr=1e-3)
        for step in range(4):
            loss, _, _ = _loss_and_grads(copy_, tokens)
            if step == 0:
                experts = copy_.model.layers[0].mlp.experts
                assert all(p.grad is not None and bool(p.grad.isfinite().all())
                           for p in (experts.gate_up_proj, experts.down_proj))
            optimizer.step()
            losses.setdefault(backend, []).append(loss.item())
    for fp8, bf16 in zip(losses[hf_backend.FP8_NAME], losses[hf_backend.NAME]):
        assert abs(fp8 - bf16) <= 0.02 * abs(bf16), losses


@requires_sm90
@pytest.mark.timeout(240)  # two models compiled, forward and backward
def test_torch_compile():
    """The model compiled, backward included, meets the accuracy bar: against float64, its logits
    and gradients within 1.5x the error of the default backend compiled the same way (inductor
    fuses the other layers' bf16 ops, which moves both away from eager by bf16's rounding)."""
    tokens = torch.randint(0, 256, (2, 128), device="cuda")
    model = _small_model(hf_backend.NAME)
    _, reference_logits, reference_grads = _loss_and_grads(_with_backend(model, "eager", torch.float64), tokens)
    runs = {}
    for backend in ("grouped_mm", hf_backend.NAME):
        compiled = _with_backend(model, backend)
        compiled.forward = torch.compile(compiled.forward)
        runs[backend] = _loss_and_grads(compiled, tokens)
    for i, name, ref in ((1, "logits", reference_logits), (2, "gradients", reference_grads)):
        ours, base = relative_error(runs[hf_backend.NAME][i], ref), relative_error(runs["grouped_mm"][i], ref)
        assert ours <= 1.5 * base + 1e-6, f"{name}: ours compiled {ours:.2e} vs the default compiled {base:.2e}"


@requires_sm90
@pytest.mark.timeout(240)  # one model compiled, forward and backward
def test_torch_compile_fp8(weight_quantizations):
    """"megamoe_fp8" compiled (`train_moe.py --compile`): its logits and gradients within 1.5x the
    error of the same backend eager against float64, and its FP8 weight copies still cached per
    optimizer step: two compiled steps without an optimizer step quantize each expert weight once,
    and one after a step quantizes it again."""
    tokens = torch.randint(0, 256, (2, 128), device="cuda")
    model = _small_model(hf_backend.FP8_NAME)
    _, reference_logits, reference_grads = _loss_and_grads(_with_backend(model, "eager", torch.float64), tokens)
    eager = _loss_and_grads(_with_backend(model, hf_backend.FP8_NAME), tokens)
    compiled = _with_backend(model, hf_backend.FP8_NAME)
    for layer in compiled.model.layers:  # (as train_moe.py --compile)
        layer.compile()
    weight_quantizations.clear()
    runs = [_loss_and_grads(compiled, tokens) for _ in range(2)]
    num_weights = 2 * len(compiled.model.layers)  # gate_up_proj and down_proj of each layer
    assert len(weight_quantizations) == num_weights, weight_quantizations
    torch.optim.SGD(compiled.parameters(), lr=1e-3).step()
    _loss_and_grads(compiled, tokens)
    assert len(weight_quantizations) == 2 * num_weights, weight_quantizations
    for i, name, ref in ((1, "logits", reference_logits), (2, "gradients", reference_grads)):
        ours, base = relative_error(runs[0][i], ref), relative_error(eager[i], ref)
        assert ours <= 1.5 * base + 1e-6, f"{name}: compiled {ours:.2e} vs eager {base:.2e}"
    assert torch.equal(runs[0][1], runs[1][1]), "two compiled forwards on the same copies differ"


@requires_sm90
def test_gradient_checkpointing():
    tokens = torch.randint(0, 256, (2, 128), device="cuda")
    model = _small_model(hf_backend.NAME)
    eager_loss, _, eager_grads = _loss_and_grads(model, tokens)
    checkpointed = _with_backend(model, hf_backend.NAME)
    checkpointed.gradient_checkpointing_enable()
    checkpointed.train()
    loss, _, grads = _loss_and_grads(checkpointed, tokens)  # (attention's backward need not be bitwise repeatable)
    loss_err, grads_err = relative_error(loss.reshape(1), eager_loss.reshape(1)), relative_error(grads, eager_grads)
    assert loss_err < 1e-3 and grads_err < 1e-2, f"loss {loss.item()} vs {eager_loss.item()}, gradients' error {grads_err:.2e}"


@requires_sm90
def test_torchtitan_module_meets_the_accuracy_bar():
    """GroupedExperts in bf16 against TorchTitan's math in float64; the yardstick is that math in
    bf16 (what TorchTitan computes with torch._grouped_mm)."""
    experts, x, scores, expert_ids = _titan_problem("cuda", torch.bfloat16, num_experts=16, dim=1024, hidden_dim=512,
                                                    tokens=512, topk=4)
    y = experts(x, scores, expert_ids)
    w1, w2, w3 = (w.detach() for w in (experts.w1, experts.w2, experts.w3))
    ref = titan_math(x.double(), scores.double(), expert_ids, w1.double(), w2.double(), w3.double())
    base = titan_math(x, scores.to(x.dtype), expert_ids, w1, w2, w3)
    assert relative_error(y, ref) <= 1.5 * relative_error(base, ref) + 1e-6
