"""Spec of the grouped GEMMs: every output element matches an fp32 matmul of the group.

GPU cases draw fresh random data, poison the output with NaN first, and check that rows
outside every group stay untouched. Input validation runs anywhere (errors come before any
launch). `python tests/test_grouped_gemm.py` prints one line per case.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deep_gemm  # noqa: E402
from deep_gemm.gemm import common as gemm_common, k_grouped_bf16, m_grouped_bf16  # noqa: E402
from deep_gemm.testing import offsets_from_sizes, random_group_sizes, relative_error, view_of_memory  # noqa: E402

HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
requires_sm90 = pytest.mark.skipif(not HAS_SM90, reason="needs an sm_90 GPU")

BF16_TOL = 4e-3  # bf16 rounding of the output dominates (~1.5e-3)
FP32_TOL = 1e-5  # fp32 output: only summation order differs

# (group sizes, N, K): ragged, empty, single-row, one huge group, tails in N and K.
M_GROUPED_CASES = [
    ([0, 1, 127, 128, 129, 300, 0, 1000], 256, 512),
    ([1], 128, 64),
    ([5000], 384, 2048),
    ([0, 0, 0], 256, 128),
    ([37, 0, 500], 136, 72),
    ("uniform", 1536, 2048),
    ("skewed", 768, 1024),
    # 300 groups of 0-3 rows, then a huge one: a CTA's next tile lies many groups on (the
    # scheduler's walk), and the huge group's tiles go N blocks fastest
    ([g % 4 for g in range(300)] + [9000], 512, 256),
]

K_GROUPED_CASES = [  # (group sizes, M, N)
    ([0, 1, 63, 64, 65, 300, 0, 1000], 256, 512),
    ([1], 128, 128),
    ([7000], 384, 256),
    ([0, 0], 256, 256),
    ([37, 0, 500], 136, 264),
    ("uniform", 1536, 2048),
    ("skewed", 768, 1024),
]


def _sizes(spec, num_groups: int = 32, total: int = 8192) -> list[int]:
    return random_group_sizes(total, num_groups, spec) if isinstance(spec, str) else list(spec)


def _ref_m_grouped(a, b, sizes, nn: bool):
    out, start = [], 0
    for g, s in enumerate(sizes):
        w = b[g].float() if nn else b[g].float().T
        out.append(a[start:start + s].float() @ w)
        start += s
    return torch.cat(out)


def _config_id(config) -> str:
    return f"bn{config.label}"


M_CONFIGS = m_grouped_bf16.all_configs()


def _gathered(rows: int, cols: int):
    """(source, index, rows picked): rows picked with repeats from a source of another height;
    the middle index is out of range, so that row reads zeros."""
    source = torch.randn(max(rows // 3, 1), cols, device="cuda", dtype=torch.bfloat16)
    index = torch.randint(0, source.shape[0], (rows,), device="cuda")
    index[rows // 2:rows // 2 + 1] = source.shape[0]
    padded = torch.cat([source, source.new_zeros(1, cols)])
    return source, index, padded[index]


def _run_m_grouped(spec, n, k, nn: bool, config, gather: bool = False):
    sizes = _sizes(spec)
    m = sum(sizes) + 3  # 3 trailing rows belong to no group: must stay untouched
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    index = None
    if gather:
        source, index, a = _gathered(m, k)
    b = torch.randn(len(sizes), *((k, n) if nn else (n, k)), device="cuda", dtype=torch.bfloat16) / k**0.5
    d = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    fn = deep_gemm.m_grouped_bf16_gemm_nn_contiguous if nn else deep_gemm.m_grouped_bf16_gemm_nt_contiguous
    fn(source if gather else a, b, d, offsets_from_sizes(sizes), a_row_index=index, config=config)
    torch.cuda.synchronize()
    rows = sum(sizes)
    err = relative_error(d[:rows], _ref_m_grouped(a, b, sizes, nn)) if rows else 0.0
    untouched = bool(torch.isnan(d[rows:]).all())
    return sizes, err, untouched


@requires_sm90
@pytest.mark.parametrize("gather", [False, True], ids=["rows", "gathered_rows"])
@pytest.mark.parametrize("config", M_CONFIGS, ids=_config_id)
@pytest.mark.parametrize("nn", [False, True], ids=["nt", "nn"])
@pytest.mark.parametrize("spec,n,k", M_GROUPED_CASES)
def test_m_grouped(spec, n, k, nn, config, gather):
    if nn and k % 64:
        pytest.skip("nn layout needs K % 64 == 0")
    sizes, err, untouched = _run_m_grouped(spec, n, k, nn, config, gather)
    assert err < BF16_TOL, f"sizes={sizes[:8]}... err={err}"
    assert untouched, "rows outside every group were written"


def _run_k_grouped(spec, m, n, out_dtype, accumulate, config):
    sizes = _sizes(spec)
    rows = sum(sizes)
    a = torch.randn(rows, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    offsets = offsets_from_sizes(sizes)
    ref = torch.stack([a[s:e].float().T @ b[s:e].float() for s, e in zip(offsets[:-1].tolist(), offsets[1:].tolist())])
    if accumulate:
        d = torch.randn(len(sizes), m, n, device="cuda").to(out_dtype)
        ref += d.float()
    else:
        d = torch.full((len(sizes), m, n), float("nan"), device="cuda", dtype=out_dtype)
    deep_gemm.k_grouped_bf16_gemm_tn_contiguous(a, b, d, offsets, accumulate=accumulate, config=config)
    torch.cuda.synchronize()
    return sizes, relative_error(d, ref)


K_VARIANTS = [(dtype, accumulate, config) for dtype in (torch.float32, torch.bfloat16) for accumulate in (False, True)
              for config in k_grouped_bf16.all_configs(dtype)]


@requires_sm90
@pytest.mark.parametrize("out_dtype,accumulate,config", K_VARIANTS,
                         ids=[f"{str(t)[6:]}_{'acc' if a else 'set'}_{_config_id(c)}" for t, a, c in K_VARIANTS])
@pytest.mark.parametrize("spec,m,n", K_GROUPED_CASES)
def test_k_grouped(spec, m, n, out_dtype, accumulate, config):
    sizes, err = _run_k_grouped(spec, m, n, out_dtype, accumulate, config)
    tol = FP32_TOL if out_dtype == torch.float32 else BF16_TOL
    assert err < tol, f"sizes={sizes[:8]}... err={err}"


@requires_sm90
@pytest.mark.parametrize("gather", [False, True], ids=["rows", "gathered_rows"])
@pytest.mark.parametrize("sizes,inter,k", [([0, 1, 127, 300, 1000], 128, 512), ("uniform", 768, 2048), ([5000], 256, 72)])
def test_m_grouped_swiglu_epilogue(sizes, inter, k, gather):
    sizes = _sizes(sizes)
    m = sum(sizes) + 3
    source = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    index = torch.randint(0, m, (m,), device="cuda") if gather else None
    a = source[index] if gather else source
    b = torch.randn(len(sizes), 2 * inter, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    h = torch.full((m, 2 * inter), float("nan"), device="cuda", dtype=torch.bfloat16)
    act = torch.full((m, inter), float("nan"), device="cuda", dtype=torch.bfloat16)
    deep_gemm.m_grouped_bf16_gemm_nt_swiglu_contiguous(source, b, h, act, offsets_from_sizes(sizes), a_row_index=index)
    torch.cuda.synchronize()
    rows = sum(sizes)
    ref_h = _ref_m_grouped(a, b, sizes, False)
    gate, up = ref_h.chunk(2, dim=-1)
    assert relative_error(h[:rows], ref_h) < BF16_TOL
    assert relative_error(act[:rows], torch.nn.functional.silu(gate) * up) < BF16_TOL
    assert torch.isnan(h[rows:]).all() and torch.isnan(act[rows:]).all()


def _passes_problem(num_groups: int, num_passes: int, k: int, rows_per_pass: int = 700):
    """Runs (g, s) of ragged sizes (some empty) and a gathered source in which pass s's rows
    come from block s: ``(sizes [G * S], source [S * P, k], index)``."""
    sizes = torch.randint(0, 300, (num_groups * num_passes,)).tolist()
    sizes[1] = 0
    passes = [s % num_passes for s, size in enumerate(sizes) for _ in range(size)]
    index = torch.tensor(passes, dtype=torch.int64) * rows_per_pass + torch.randint(0, rows_per_pass, (len(passes),))
    source = torch.randn(num_passes * rows_per_pass, k, device="cuda", dtype=torch.bfloat16)
    return sizes, source, index.cuda()


@requires_sm90
@pytest.mark.parametrize("swiglu", [False, True], ids=["nt", "nt_swiglu"])
@pytest.mark.parametrize("num_passes", [1, 2, 8])
def test_m_grouped_passes(num_passes, swiglu):
    """Rows in runs (group, pass): run (g, s) multiplies with B[g], whatever the pass."""
    num_groups, n, k = 6, 512, 256
    sizes, source, index = _passes_problem(num_groups, num_passes, k)
    m = sum(sizes)
    b = torch.randn(num_groups, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    d = torch.full((m + 3, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    index = torch.cat([index, index.new_zeros(3)])  # 3 rows past every run: untouched
    flags = torch.ones(num_passes, dtype=torch.int32, device="cuda")
    passes = dict(num_passes=num_passes, ready_flags=flags)
    if swiglu:
        act = torch.full((m + 3, n // 2), float("nan"), device="cuda", dtype=torch.bfloat16)
        deep_gemm.m_grouped_bf16_gemm_nt_swiglu_contiguous(source, b, d, act, offsets_from_sizes(sizes),
                                                            a_row_index=index, **passes)
    else:
        deep_gemm.m_grouped_bf16_gemm_nt_contiguous(source, b, d, offsets_from_sizes(sizes), a_row_index=index,
                                                    **passes)
    run_group = [g for g in range(num_groups) for _ in range(num_passes)]
    ref = torch.cat([source[index[:m]][sum(sizes[:r]):sum(sizes[:r + 1])].float() @ b[run_group[r]].float().T
                     for r in range(len(sizes))])
    assert relative_error(d[:m], ref) < BF16_TOL
    assert torch.isnan(d[m:]).all()
    if swiglu:
        gate, up = ref.chunk(2, dim=-1)
        assert relative_error(act[:m], torch.nn.functional.silu(gate) * up) < BF16_TOL
        assert torch.isnan(act[m:]).all()


@requires_sm90
@pytest.mark.parametrize("config", M_CONFIGS, ids=_config_id)
@pytest.mark.parametrize("b_mn_major", [False, True], ids=["nt", "nn"])
@pytest.mark.parametrize("num_passes", [2, 4])
def test_m_grouped_pass_range_computes_those_passes_only(num_passes, b_mn_major, config):
    """A launch over passes [begin, end) writes their runs and leaves every other row alone; two
    launches that cover all passes equal one launch over them (bitwise)."""
    num_groups, n, k = 5, 384, 256
    sizes, source, index = _passes_problem(num_groups, num_passes, k)
    a, offsets = source[index], offsets_from_sizes(sizes)
    shape = (num_groups, k, n) if b_mn_major else (num_groups, n, k)
    b = torch.randn(shape, device="cuda", dtype=torch.bfloat16) / k**0.5
    gemm = deep_gemm.m_grouped_bf16_gemm_nn_contiguous if b_mn_major else deep_gemm.m_grouped_bf16_gemm_nt_contiguous
    whole = torch.full((a.shape[0], n), float("nan"), device="cuda", dtype=torch.bfloat16)
    gemm(a, b, whole, offsets, num_passes=num_passes, config=config)
    split = torch.full_like(whole, float("nan"))
    gemm(a, b, split, offsets, num_passes=num_passes, pass_range=(1, num_passes), config=config)
    row_pass = torch.tensor([s % num_passes for s, size in enumerate(sizes) for _ in range(size)], device="cuda")
    assert torch.isnan(split[row_pass == 0]).all(), "pass 0 was not in the range"
    assert torch.equal(split[row_pass > 0], whole[row_pass > 0])
    gemm(a, b, split, offsets, num_passes=num_passes, pass_range=(0, 1), config=config)
    assert torch.equal(split, whole)


@requires_sm90
def test_m_grouped_passes_wait_for_their_rows():
    """A pass's rows are read only after its flag is set: here they are NaN until another stream
    copies them in from pinned host memory (a copy engine: the waiting GEMM may hold every SM)
    after a sleep and then sets the flag, while the GEMM already runs."""
    from deep_gemm.jit.runtime import stream_write_u32
    num_groups, num_passes, n, k, per_pass = 4, 3, 256, 512, 700
    sizes, source, index = _passes_problem(num_groups, num_passes, k, per_pass)
    real = source.clone()
    landing = real.cpu().pin_memory()
    source[per_pass:] = float("nan")  # passes 1 and 2 not landed yet
    b = torch.randn(num_groups, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    d = torch.empty(sum(sizes), n, device="cuda", dtype=torch.bfloat16)
    flags = torch.zeros(num_passes, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for s in (2, 1):  # the later pass lands first
            torch.cuda._sleep(20_000_000)
            source[s * per_pass:(s + 1) * per_pass].copy_(landing[s * per_pass:(s + 1) * per_pass], non_blocking=True)
            stream_write_u32(flags[s:].data_ptr(), 1, source.device.index)
    deep_gemm.m_grouped_bf16_gemm_nt_contiguous(source, b, d, offsets_from_sizes(sizes), a_row_index=index,
                                                num_passes=num_passes, ready_flags=flags)
    torch.cuda.current_stream().wait_stream(side)
    run_group = [g for g in range(num_groups) for _ in range(num_passes)]
    ref = torch.cat([real[index][sum(sizes[:r]):sum(sizes[:r + 1])].float() @ b[run_group[r]].float().T
                     for r in range(len(sizes))])
    assert not torch.isnan(d).any(), "a pass was read before its flag was set"
    assert relative_error(d, ref) < BF16_TOL


@requires_sm90
def test_launch_from_a_thread_with_no_current_context():
    """Autograd runs backward passes on worker threads, which may have no driver context
    current yet: a launch there (of a kernel loaded on another thread, with operands whose TMA
    descriptors are encoded there) must still work."""
    import threading

    from cuda.bindings import driver as cu
    a = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(2, 256, 128, device="cuda", dtype=torch.bfloat16)
    d = [torch.empty(256, 256, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    offsets = offsets_from_sizes([100, 156])
    deep_gemm.m_grouped_bf16_gemm_nt_contiguous(a, b, d[0], offsets)  # loads the kernel on this thread
    a_new = a.clone()  # a buffer no descriptor has been encoded for yet
    torch.cuda.synchronize()
    errors = []

    def launch_unbound() -> None:
        try:
            assert cu.cuCtxSetCurrent(cu.CUcontext())[0] == cu.CUresult.CUDA_SUCCESS  # no context current
            deep_gemm.m_grouped_bf16_gemm_nt_contiguous(a_new, b, d[1], offsets)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    thread = threading.Thread(target=launch_unbound)
    thread.start()
    thread.join()
    assert not errors, errors
    assert torch.equal(d[0], d[1])


@requires_sm90
def test_deterministic():
    sizes = random_group_sizes(4096, 16, "skewed")
    a = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(16, 512, 1024, device="cuda", dtype=torch.bfloat16)
    offsets = offsets_from_sizes(sizes)
    outs = []
    for _ in range(2):
        d = torch.empty(4096, 512, device="cuda", dtype=torch.bfloat16)
        deep_gemm.m_grouped_bf16_gemm_nt_contiguous(a, b, d, offsets)
        w = torch.empty(16, 1024, 512, device="cuda")
        deep_gemm.k_grouped_bf16_gemm_tn_contiguous(a, d, w, offsets)
        outs.append((d, w))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@requires_sm90
def test_no_groups_and_no_rows():
    a = torch.randn(0, 128, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(2, 256, 128, device="cuda", dtype=torch.bfloat16)
    d = torch.empty(0, 256, device="cuda", dtype=torch.bfloat16)
    deep_gemm.m_grouped_bf16_gemm_nt_contiguous(a, b, d, offsets_from_sizes([0, 0]))
    w = torch.full((2, 128, 256), float("nan"), device="cuda")
    deep_gemm.k_grouped_bf16_gemm_tn_contiguous(a, a.new_empty(0, 256), w, offsets_from_sizes([0, 0]))
    assert torch.count_nonzero(w) == 0


# ---- input validation: a clear exception before any launch (runs without a GPU) ----

def _bf16(*shape):
    return torch.zeros(*shape, dtype=torch.bfloat16)


def _offs(*sizes):
    return offsets_from_sizes(sizes, device="cpu")


@pytest.mark.parametrize("args,error,match", [
    ((_bf16(8, 64).float(), _bf16(1, 32, 64), _bf16(8, 32), _offs(8)), TypeError, "a must have dtype"),
    ((_bf16(8, 64), _bf16(32, 64), _bf16(8, 32), _offs(8)), ValueError, "b must be 3-D"),
    ((_bf16(8, 64), _bf16(2, 32, 64), _bf16(8, 32), _offs(8)), ValueError, "groups"),
    ((_bf16(8, 64), _bf16(1, 32, 48), _bf16(8, 32), _offs(8)), ValueError, "contraction sizes differ"),
    ((_bf16(8, 64), _bf16(1, 32, 64), _bf16(8, 40), _offs(8)), ValueError, "d must have shape"),
    ((_bf16(8, 60), _bf16(1, 32, 60), _bf16(8, 32), _offs(8)), ValueError, "K = 60 must be a multiple of 8"),
    ((_bf16(8, 64), _bf16(1, 36, 64), _bf16(8, 36), _offs(8)), ValueError, "N = 36 must be a multiple of 8"),
    ((_bf16(64, 8).t(), _bf16(1, 32, 64), _bf16(8, 32), _offs(8)), ValueError, "contiguous"),
    ((_bf16(8, 64), _bf16(1, 32, 64), _bf16(8, 32), _offs(8).long()), TypeError, "group_offsets must have dtype"),
    ((_bf16(8, 64), _bf16(1, 32, 64), _bf16(8, 32), _offs(8)), ValueError, "CUDA"),
])
def test_m_grouped_rejects_bad_input(args, error, match):
    with pytest.raises(error, match=match):
        deep_gemm.m_grouped_bf16_gemm_nt_contiguous(*args)


_A8 = _bf16(8, 64)


@pytest.mark.parametrize("args,match", [
    ((_A8, _bf16(1, 64, 64), _A8, _offs(8)), "d overlaps a in memory"),  # in place over its own input
    ((_A8, _bf16(1, 64, 64), _bf16(16, 64)[8:], _offs(8)), "CUDA"),  # d beside a: the devices' check is next
])
def test_m_grouped_refuses_an_output_over_an_input(args, match):
    with pytest.raises(ValueError, match=match):
        deep_gemm.m_grouped_bf16_gemm_nt_contiguous(*args)


def test_swiglu_outputs_must_not_overlap():
    h = _bf16(8, 256)
    act = view_of_memory(h, (8, 128), torch.bfloat16)  # act over h's first rows
    with pytest.raises(ValueError, match="h overlaps act in memory"):
        deep_gemm.m_grouped_bf16_gemm_nt_swiglu_contiguous(_A8, _bf16(1, 256, 64), h, act, _offs(8))


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_passes=0), "num_passes must be in"),
    (dict(num_passes=33), "num_passes must be in"),
    (dict(num_passes=2), "not a multiple of num_passes"),
    (dict(num_passes=3, ready_flags=torch.ones(2, dtype=torch.int32)), "ready_flags needs 3 entries"),
    (dict(num_passes=3, pass_range=(2, 2)), "pass_range must satisfy"),
    (dict(num_passes=3, pass_range=(0, 4)), "pass_range must satisfy"),
])
def test_m_grouped_passes_reject_bad_input(kwargs, match):
    a, b, d = _bf16(8, 64), _bf16(1, 32, 64), _bf16(8, 32)
    offsets = _offs(4, 4, 0) if kwargs["num_passes"] != 2 else _offs(8)
    with pytest.raises(ValueError, match=match):
        deep_gemm.m_grouped_bf16_gemm_nt_contiguous(a, b, d, offsets, **kwargs)


def test_row_index_must_be_int64():
    with pytest.raises(TypeError, match="a_row_index must have dtype"):
        deep_gemm.m_grouped_bf16_gemm_nt_contiguous(_bf16(8, 64), _bf16(1, 32, 64), _bf16(8, 32), _offs(8),
                                                    a_row_index=torch.zeros(8, dtype=torch.int32))


def test_swiglu_epilogue_shapes():
    with pytest.raises(ValueError, match="multiple of 256"):
        deep_gemm.m_grouped_bf16_gemm_nt_swiglu_contiguous(_bf16(8, 64), _bf16(1, 128, 64), _bf16(8, 128),
                                                           _bf16(8, 64), _offs(8))
    with pytest.raises(ValueError, match="act must have shape"):
        deep_gemm.m_grouped_bf16_gemm_nt_swiglu_contiguous(_bf16(8, 64), _bf16(1, 256, 64), _bf16(8, 256),
                                                           _bf16(8, 64), _offs(8))


def test_nn_needs_k_multiple_of_64():
    with pytest.raises(ValueError, match="multiple of 64"):
        deep_gemm.m_grouped_bf16_gemm_nn_contiguous(_bf16(8, 72), _bf16(1, 72, 32), _bf16(8, 32), _offs(8))


@pytest.mark.parametrize("args,error,match", [
    ((_bf16(8, 64), _bf16(8, 32), _bf16(1, 64, 32).half(), _offs(8)), TypeError, "d must have dtype"),
    ((_bf16(8, 64), _bf16(9, 32), torch.zeros(1, 64, 32), _offs(8)), ValueError, "same number of rows"),
    ((_bf16(8, 64), _bf16(8, 32), torch.zeros(2, 64, 32), _offs(8)), ValueError, "d must have shape"),
    ((_bf16(8, 60), _bf16(8, 32), torch.zeros(1, 60, 32), _offs(8)), ValueError, "M = 60"),
    ((_bf16(8, 64), _bf16(8, 32), torch.zeros(1, 64, 32), _offs(8)), ValueError, "CUDA"),
])
def test_k_grouped_rejects_bad_input(args, error, match):
    with pytest.raises(error, match=match):
        deep_gemm.k_grouped_bf16_gemm_tn_contiguous(*args)


def test_k_grouped_refuses_d_over_an_operand():
    b = torch.zeros(1, 64, 32)  # fp32 d's memory, read as b's rows too
    with pytest.raises(ValueError, match="d overlaps b in memory"):
        deep_gemm.k_grouped_bf16_gemm_tn_contiguous(_bf16(8, 64), view_of_memory(b, (8, 32), torch.bfloat16), b,
                                                    _offs(8))


@requires_sm90
@pytest.mark.parametrize("num_sms", [2, 3, 5])
def test_k_grouped_multicast_with_few_sms(monkeypatch, num_sms):
    """Clusters of two CTAs under an SM cap: whole clusters only, every tile still computed."""
    monkeypatch.setattr(deep_gemm.utils, "_num_sms", num_sms)
    config = k_grouped_bf16.make_k_grouped_config(256, multicast_b=True)
    sizes, err = _run_k_grouped([37, 0, 500, 300], 384, 512, torch.float32, False, config)
    assert err < FP32_TOL, f"sizes={sizes} err={err}"


@requires_sm90
def test_k_grouped_default_config_without_multicast(monkeypatch):
    """The default (B multicast for fp32) falls back to single CTAs where clusters can't run:
    one SM allowed."""
    monkeypatch.setattr(deep_gemm.utils, "_num_sms", 1)
    sizes, err = _run_k_grouped([37, 0, 500, 300], 384, 512, torch.float32, False, None)
    assert err < FP32_TOL, f"sizes={sizes} err={err}"


@pytest.mark.parametrize("m,n,dtype,multicast,expected", [
    (4096, 7168, torch.float32, True, "256tm"), (1536, 2048, torch.float32, True, "256tm"),
    (3072, 4096, torch.bfloat16, True, "256tm"), (1536, 2048, torch.bfloat16, True, "256t"),
    (4096, 7168, torch.float32, False, "256t4"), (3072, 4096, torch.bfloat16, False, "256t4"),
    (1536, 2048, torch.float32, False, "256t"), (2048, 128, torch.float32, True, "128t")])
def test_k_grouped_default_config(m, n, dtype, multicast, expected):
    """Measured choices (docs/PERF.md, "Decisions"): B multicast for fp32 and for large bf16 outputs, else four
    staging buffers from 4M output elements on."""
    assert k_grouped_bf16.get_config(m, n, dtype, multicast).label == expected


class _ClusterKernel:  # what grid_size reads of a kernel launched in clusters
    cluster_size = 2

    def __init__(self, resident: int):
        self.resident = resident

    def max_resident_blocks(self, device: int) -> int:
        return self.resident


@pytest.mark.parametrize("num_sms,resident,num_tiles,expected", [
    (132, 132, 1000, 132), (132, 120, 1000, 120), (131, 132, 1000, 130), (132, 132, 5, 10), (3, 132, 1000, 2)])
def test_grid_size_counts_whole_resident_clusters(monkeypatch, num_sms, resident, num_tiles, expected):
    monkeypatch.setattr(gemm_common, "get_num_sms", lambda device: num_sms)
    assert gemm_common.grid_size(_ClusterKernel(resident), num_tiles, 0) == expected


def test_grid_size_rejects_a_cluster_wider_than_the_sm_cap(monkeypatch):
    monkeypatch.setattr(gemm_common, "get_num_sms", lambda device: 1)
    with pytest.raises(ValueError, match="clusters of 2"):
        gemm_common.grid_size(_ClusterKernel(132), 10, 0)


def test_num_sms_cap():
    with pytest.raises(ValueError):
        deep_gemm.set_num_sms(0)


def test_a_temporary_sm_cap_never_raises_an_outer_one_and_is_undone_on_error(monkeypatch):
    from deep_gemm import utils
    monkeypatch.setattr(utils, "_num_sms", None)
    with utils.num_sms_capped(100):
        assert utils._num_sms == 100
        with utils.num_sms_capped(120):  # an outer cap holds
            assert utils._num_sms == 100
        assert utils._num_sms == 100
    assert utils._num_sms is None
    with pytest.raises(RuntimeError), utils.num_sms_capped(16):
        raise RuntimeError("a failed launch")
    assert utils._num_sms is None
    with pytest.raises(ValueError, match="positive"), utils.num_sms_capped(0):
        pass


if __name__ == "__main__":
    if not HAS_SM90:
        sys.exit("needs an sm_90 GPU")
    print(f"{'kernel':<8} {'config':>12} {'N':>5} {'K':>5} {'groups':>6} {'rows':>6} {'rel.err':>9} untouched")
    for spec, n, k in M_GROUPED_CASES:
        for nn in (False, True):
            if nn and k % 64:
                continue
            for config in M_CONFIGS:
                sizes, err, untouched = _run_m_grouped(spec, n, k, nn, config)
                print(f"{'nn' if nn else 'nt':<8} {_config_id(config):>12} {n:>5} {k:>5} {len(sizes):>6} {sum(sizes):>6} {err:>9.2e} {untouched}")
    for spec, m, n in K_GROUPED_CASES:
        for out_dtype, accumulate, config in K_VARIANTS:
            sizes, err = _run_k_grouped(spec, m, n, out_dtype, accumulate, config)
            print(f"{'tn':<8} {_config_id(config):>12} {n:>5} {m:>5} {len(sizes):>6} {sum(sizes):>6} {err:>9.2e} "
                  f"{str(out_dtype)[6:]}{' acc' if accumulate else ''}")
