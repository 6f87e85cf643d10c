"""Spec of the blockwise-FP8 grouped GEMMs: m-grouped (forward, data gradient) and k-grouped
(weight gradients, on the column copies).

Kernel exactness: against an fp32 product of the dequantized operands, relative error <= 2e-3,
or 1.25x a perfect kernel's where the output's own rounding comes near 2e-3 (`exact_bar`). Recipe accuracy: against the fp32 product of the original bf16
operands, no worse than PyTorch's rowwise FP8 grouped GEMM on the same data. GPU cases draw fresh
random data in ragged, empty, single-row and one-huge groups and poison the output with NaN
first: rows outside every group must stay NaN. Bad input is refused before any launch (runs
anywhere). `python tests/test_fp8_gemm.py` prints one line per case.
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deep_gemm  # noqa: E402
from deep_gemm.utils import num_sms_capped  # noqa: E402
from deep_gemm.quant import (empty_fp8_rows, fp8_quantize_columns, fp8_quantize_rows, fp8_quantize_weights,  # noqa: E402
                             reference)
from deep_gemm.testing import (offsets_from_sizes, random_group_sizes, relative_error, same_bits,  # noqa: E402
                               torch_fp8_rowwise_grouped_mm, view_of_memory)

HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
requires_sm90 = pytest.mark.skipif(not HAS_SM90, reason="needs an sm_90 GPU")

EXACT_TOL = 2e-3  # against the exact product of the dequantized operands


def exact_bar(exact: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> float:
    """2e-3, or 1.25x the error of a perfect kernel (the exact product rounded once to
    out_dtype) where that comes near it: rounding alone costs a bf16 output 1.66e-3 (relative,
    10^6 random values) and a 1 x 128 one 1.94e-3, and a one-row output of ours measured 2.09e-3."""
    return max(EXACT_TOL, 1.25 * relative_error(exact.to(out_dtype).float(), exact))

# (group sizes, N, K): ragged with every kind of tail, empty groups, one row, one huge group.
CASES = [
    ([0, 1, 127, 128, 129, 300, 0, 1000], 256, 512),
    ([1], 128, 128),
    ([5000], 384, 2048),
    ([0, 0, 0], 256, 128),
    ("uniform", 1536, 2048),
    ("skewed", 768, 1024),
    # 300 groups of 0-3 rows, then a huge one: a CTA's next tile lies many groups on (the
    # scheduler's walk), and the huge group's tiles go N blocks fastest
    ([g % 4 for g in range(300)] + [9000], 512, 256),
]


def _sizes(spec, num_groups: int = 32, total: int = 8192) -> list[int]:
    return random_group_sizes(total, num_groups, spec) if isinstance(spec, str) else list(spec)


def _problem(spec, n: int, k: int, data_gradient: bool = False):
    """(sizes, bf16 A [M + 3, K], bf16 weights, B as the GEMM reads it ([G, N, K]), its FP8 pair):
    the data gradient's weights are [G, K, N] and the GEMM reads their transposed copy."""
    sizes = _sizes(spec)
    a = torch.randn(sum(sizes) + 3, k, device="cuda", dtype=torch.bfloat16)  # 3 rows in no group
    shape = (len(sizes), k, n) if data_gradient else (len(sizes), n, k)
    w = (torch.randn(*shape, device="cuda") * torch.exp2(torch.randint(-3, 3, shape[:2] + (1,), device="cuda"))
         / k**0.5).to(torch.bfloat16)
    q = fp8_quantize_weights(w)
    if data_gradient:
        return sizes, a, w.transpose(1, 2), q.transposed_operand(), q
    return sizes, a, w, (q.data, q.scales), q


def _reference(a: torch.Tensor, b: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """fp32 ``A[rows of g] @ B[g].T`` for b ``[G, N, K]``."""
    out, start = [], 0
    for g, s in enumerate(sizes):
        out.append(a[start:start + s].float() @ b[g].float().T)
        start += s
    return torch.cat(out) if out else a.new_zeros(0, b.shape[1], dtype=torch.float32)


def _dequantized_b(b_fp8: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    data, scales = b_fp8
    return data.float() * scales.repeat_interleave(128, dim=1).repeat_interleave(128, dim=2)


def _run(spec, n, k, data_gradient=False, gather=False):
    sizes, a, b, b_fp8, _ = _problem(spec, n, k, data_gradient)
    offsets = offsets_from_sizes(sizes)
    rows = sum(sizes)
    index = None
    if gather:  # rows picked with repeats from a source of another height; one index out of range
        source = a[:max(rows // 3, 1)].contiguous()
        index = torch.randint(0, source.shape[0], (a.shape[0],), device="cuda")
        index[a.shape[0] // 2] = source.shape[0]
        a = torch.cat([source, source.new_zeros(1, k)])[index]
        a_fp8 = fp8_quantize_rows(source)
    else:
        a_fp8 = fp8_quantize_rows(a)
    d = torch.full((a.shape[0], n), float("nan"), device="cuda", dtype=torch.bfloat16)
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a_fp8.data, a_fp8.scales), b_fp8, d, offsets, a_row_index=index)
    torch.cuda.synchronize()
    a_deq = reference.dequantize_rows(a_fp8)
    if gather:
        a_deq = torch.cat([a_deq, a_deq.new_zeros(1, k)])[index]
    ref = _reference(a_deq, _dequantized_b(b_fp8), sizes)
    exact = (relative_error(d[:rows], ref), exact_bar(ref)) if rows else (0.0, EXACT_TOL)
    return sizes, a, b, offsets, d, exact


@requires_sm90
@pytest.mark.parametrize("gather", [False, True], ids=["rows", "gathered_rows"])
@pytest.mark.parametrize("data_gradient", [False, True], ids=["forward", "data_gradient"])
@pytest.mark.parametrize("spec,n,k", CASES)
def test_product_of_the_dequantized_operands(spec, n, k, data_gradient, gather):
    sizes, _, _, _, d, (exact, bar) = _run(spec, n, k, data_gradient, gather)
    assert exact <= bar, f"sizes={sizes[:8]}... error {exact:.2e}, bar {bar:.2e}"
    assert bool(torch.isnan(d[sum(sizes):]).all()), "rows outside every group were written"


@requires_sm90
@pytest.mark.parametrize("gather", [False, True], ids=["rows", "gathered_rows"])
@pytest.mark.parametrize("num_sms", [1, 3])
def test_many_tiles_on_few_sms(num_sms, gather):
    """With few SMs each CTA walks many tiles of ragged and empty groups, and the two math
    warpgroups' turns at issuing their MMAs (TMA rows) carry from tile to tile: every row is
    written, as the product of the dequantized operands."""
    sizes = [(g % 5) * 70 for g in range(40)]  # up to 3 tiles of rows a group, a fifth of the groups empty
    with num_sms_capped(num_sms):
        *_, (exact, bar) = _run(sizes, 512, 384, gather=gather)
    assert exact <= bar, f"error {exact:.2e}, bar {bar:.2e}"


@requires_sm90
@pytest.mark.parametrize("data_gradient", [False, True], ids=["forward", "data_gradient"])
@pytest.mark.parametrize("spec,n,k", [("uniform", 1536, 2048), ("skewed", 2048, 768), ([5000], 384, 2048)])
def test_blockwise_recipe_is_at_least_as_accurate_as_torch_rowwise(spec, n, k, data_gradient):
    """Against the fp32 product of the bf16 operands; the data gradient multiplies by the weights'
    transposed copy (the same 128 x 128 blocks and scales as the forward's)."""
    sizes, a, b, offsets, d, _ = _run(spec, n, k, data_gradient)
    rows = sum(sizes)
    exact = _reference(a, b, sizes)
    ours = relative_error(d[:rows], exact)
    theirs = relative_error(torch_fp8_rowwise_grouped_mm(a[:rows], b.contiguous(), offsets), exact)
    assert ours <= theirs, f"blockwise {ours:.2e} vs rowwise {theirs:.2e}"


@requires_sm90
@pytest.mark.parametrize("gather", [False, True], ids=["rows", "gathered_rows"])
def test_256_wide_tiles_equal_128_wide_ones_bit_for_bit(monkeypatch, gather):
    """Every output element is the same sum either way (the same k-blocks, promoted in order)."""
    from deep_gemm.gemm import m_grouped_fp8
    sizes, n, k = [0, 1, 127, 128, 129, 300, 0, 1000], 512, 1024
    a = torch.randn(sum(sizes) + 3, k, device="cuda", dtype=torch.bfloat16)
    a_fp8 = fp8_quantize_rows(a)
    w = fp8_quantize_weights(torch.randn(len(sizes), n, k, device="cuda", dtype=torch.bfloat16))
    index = torch.randint(0, a.shape[0], (a.shape[0],), device="cuda") if gather else None
    offsets = offsets_from_sizes(sizes)
    outs = []
    for width in (256, 128):
        monkeypatch.setattr(m_grouped_fp8, "get_config", lambda _, width=width: m_grouped_fp8.CONFIGS[width])
        d = torch.full((a.shape[0], n), float("nan"), device="cuda", dtype=torch.bfloat16)
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a_fp8.data, a_fp8.scales), (w.data, w.scales), d, offsets,
                                                   a_row_index=index)
        outs.append(d)
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))


# Group sizes for the SwiGLU epilogues: every kind of tail, one huge group, and 300 groups of 0-3
# rows before a huge one (a CTA's next tile many groups on).
SWIGLU_SIZES = {
    "tails": [0, 1, 63, 64, 65, 127, 128, 129, 300, 0, 1000],
    "one-huge": [5000],
    "tiny-then-huge": [g % 4 for g in range(300)] + [9000],
}


@requires_sm90
@pytest.mark.parametrize("sizes", SWIGLU_SIZES.values(), ids=SWIGLU_SIZES.keys())
@pytest.mark.parametrize("gather", [False, True], ids=["rows", "gathered_rows"])
def test_swiglu_epilogue_writes_the_gemm_and_silu_gate_times_up(gather, sizes):
    """h is the plain GEMM's output bit for bit; act = silu(gate) * up from the fp32 sums."""
    inter, k = 256, 512
    a = torch.randn(sum(sizes) + 3, k, device="cuda", dtype=torch.bfloat16)
    a_fp8 = fp8_quantize_rows(a)
    w = fp8_quantize_weights((torch.randn(len(sizes), 2 * inter, k, device="cuda") / k**0.5).to(torch.bfloat16))
    index = torch.randint(0, a.shape[0], (a.shape[0],), device="cuda") if gather else None
    offsets, rows = offsets_from_sizes(sizes), sum(sizes)
    plain = torch.full((a.shape[0], 2 * inter), float("nan"), device="cuda", dtype=torch.bfloat16)
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a_fp8.data, a_fp8.scales), (w.data, w.scales), plain, offsets,
                                               a_row_index=index)
    h, act = torch.full_like(plain, float("nan")), torch.full((a.shape[0], inter), float("nan"), device="cuda",
                                                             dtype=torch.bfloat16)
    deep_gemm.m_grouped_fp8_gemm_nt_swiglu_contiguous((a_fp8.data, a_fp8.scales), (w.data, w.scales), h, act, offsets,
                                                      a_row_index=index)
    assert torch.equal(h.view(torch.int16), plain.view(torch.int16))
    assert bool(act[rows:].isnan().all()) and not bool(act[:rows].isnan().any())
    a_deq = reference.dequantize_rows(a_fp8)
    if gather:
        a_deq = a_deq[index]
    exact = _reference(a_deq, _dequantized_b((w.data, w.scales)), sizes)
    ref_act = torch.nn.functional.silu(exact[:, :inter]) * exact[:, inter:]
    assert relative_error(act[:rows], ref_act) <= exact_bar(ref_act)


def _poisoned_fp8_rows(m: int, k: int):
    """Fp8Rows outputs filled with NaN (0xFF bytes in the data), scales in their GEMM layout."""
    out = empty_fp8_rows(m, k, "cuda")
    out.data.view(torch.uint8).fill_(0xFF)
    out.scales.fill_(float("nan"))
    return out


@requires_sm90
@pytest.mark.parametrize("sizes", SWIGLU_SIZES.values(), ids=SWIGLU_SIZES.keys())
@pytest.mark.parametrize("gather", [False, True], ids=["rows", "gathered_rows"])
def test_swiglu_epilogue_quantizes_act_as_fp8_quantize_rows_does(gather, sizes):
    """act as an e4m3 (data, scales) pair is fp8_quantize_rows of the bf16 act, bit for bit, and h
    is unchanged; groups empty, of one row, ending inside a warpgroup's 64 rows or a tile's 128;
    zero rows (scale 1); M not a multiple of 4 (the scales' column stride rounded up); rows
    outside every group left unwritten in the data and the scales."""
    inter, k = 384, 512
    rows = sum(sizes)
    a = torch.randn(rows + 2, k, device="cuda", dtype=torch.bfloat16)
    a[5] = 0
    a_fp8 = fp8_quantize_rows(a)
    w = fp8_quantize_weights((torch.randn(len(sizes), 2 * inter, k, device="cuda") / k**0.5).to(torch.bfloat16))
    index = None
    if gather:  # repeats, and one index past the data: a zero row
        index = torch.randint(0, a.shape[0], (a.shape[0],), device="cuda")
        index[7] = a.shape[0]
    offsets = offsets_from_sizes(sizes)
    gemm = functools.partial(deep_gemm.m_grouped_fp8_gemm_nt_swiglu_contiguous, (a_fp8.data, a_fp8.scales),
                             (w.data, w.scales), group_offsets=offsets, a_row_index=index)
    h_bf16 = torch.full((a.shape[0], 2 * inter), float("nan"), device="cuda", dtype=torch.bfloat16)
    act_bf16 = torch.full((a.shape[0], inter), float("nan"), device="cuda", dtype=torch.bfloat16)
    gemm(h=h_bf16, act=act_bf16)
    h, act = torch.full_like(h_bf16, float("nan")), _poisoned_fp8_rows(a.shape[0], inter)
    gemm(h=h, act=(act.data, act.scales))
    expected = fp8_quantize_rows(act_bf16[:rows].contiguous())
    assert same_bits(h, h_bf16)
    assert same_bits(act.data[:rows], expected.data)
    assert same_bits(act.scales[:rows], expected.scales)
    assert bool((act.data[rows:].view(torch.uint8) == 0xFF).all()) and bool(act.scales[rows:].isnan().all())
    zero_row = 7 if gather else 5
    assert bool((expected.scales[zero_row] == 1).all()), "a zero row's scales are 1"


@requires_sm90
def test_swiglu_epilogue_with_fp8_act_in_passes_gives_the_bits_of_one_pass():
    """The expert-parallel forward's GEMM1: rows gathered, in 2 passes per group (flags set), act
    in e4m3: h and act bit for bit as one pass over the same groups computes them."""
    run_sizes, inter, k = [0, 0, 1, 0, 60, 70, 30, 34, 0, 200], 256, 256
    sizes = [run_sizes[2 * g] + run_sizes[2 * g + 1] for g in range(5)]
    rows = sum(sizes)
    a_fp8 = fp8_quantize_rows(torch.randn(rows // 2 + 1, k, device="cuda", dtype=torch.bfloat16))
    index = torch.randint(0, a_fp8.data.shape[0], (rows,), device="cuda")
    w = fp8_quantize_weights((torch.randn(5, 2 * inter, k, device="cuda") / k**0.5).to(torch.bfloat16))
    outputs = []
    for offsets, passes in ((offsets_from_sizes(sizes), 1), (offsets_from_sizes(run_sizes), 2)):
        h = torch.full((rows, 2 * inter), float("nan"), device="cuda", dtype=torch.bfloat16)
        act = _poisoned_fp8_rows(rows, inter)
        flags = torch.ones(passes, dtype=torch.int32, device="cuda")
        deep_gemm.m_grouped_fp8_gemm_nt_swiglu_contiguous((a_fp8.data, a_fp8.scales), (w.data, w.scales), h,
                                                          (act.data, act.scales), offsets, a_row_index=index,
                                                          num_passes=passes, ready_flags=flags)
        outputs.append((h, act))
    (h1, act1), (h2, act2) = outputs
    assert not bool(h1.isnan().any()) and not bool(act1.scales.isnan().any()), "one pass wrote every row"
    assert same_bits(h2, h1)
    assert same_bits(act2.data, act1.data) and same_bits(act2.scales, act1.scales)


@requires_sm90
def test_passes_wait_for_flags_and_pass_ranges_compute_only_theirs():
    """5 groups x 2 passes; flags already set (nothing to wait for); then one pass per launch."""
    run_sizes = [0, 0, 1, 0, 60, 70, 30, 34, 0, 200]
    sizes = [run_sizes[2 * g] + run_sizes[2 * g + 1] for g in range(5)]
    a = torch.randn(sum(run_sizes), 256, device="cuda", dtype=torch.bfloat16)
    w = fp8_quantize_weights(torch.randn(5, 128, 256, device="cuda", dtype=torch.bfloat16))
    a_fp8 = fp8_quantize_rows(a)
    run_offsets = offsets_from_sizes(run_sizes)
    ref = _reference(reference.dequantize_rows(a_fp8), _dequantized_b((w.data, w.scales)), sizes)
    flags = torch.ones(2, dtype=torch.int32, device="cuda")
    d = torch.full((a.shape[0], 128), float("nan"), device="cuda", dtype=torch.bfloat16)
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a_fp8.data, a_fp8.scales), (w.data, w.scales), d, run_offsets,
                                               num_passes=2, ready_flags=flags)
    assert relative_error(d, ref) <= exact_bar(ref)
    d.fill_(float("nan"))
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a_fp8.data, a_fp8.scales), (w.data, w.scales), d, run_offsets,
                                               num_passes=2, pass_range=(1, 2))
    second = torch.zeros(a.shape[0], dtype=torch.bool, device="cuda")
    for run, (lo, hi) in enumerate(zip(run_offsets[:-1].tolist(), run_offsets[1:].tolist())):
        second[lo:hi] = run % 2 == 1
    assert bool(torch.isnan(d[~second]).all()) and not bool(torch.isnan(d[second]).any())
    assert relative_error(d[second], ref[second]) <= exact_bar(ref[second])


# Run in a process of its own (`test_gathered_passes_read_their_rows_only_after_their_flags`): a
# pass read before its rows land gives NaNs, but a wait that never ends traps the kernel, and a trap
# leaves the process's CUDA context unusable for every later test.
_LANDING = r"""
import sys
import torch
import deep_gemm
from deep_gemm.jit.runtime import stream_write_u32
from deep_gemm.quant import empty_fp8_rows, fp8_quantize_rows, fp8_quantize_weights
from deep_gemm.testing import offsets_from_sizes, same_bits

swiglu = sys.argv[1] == "swiglu"
torch.manual_seed(0)
num_passes, per_pass, n, k = 3, 700, 256, 512
run_sizes = [120, 0, 300, 7, 200, 64, 0, 150, 90, 33, 1, 256]  # runs (group, pass): 4 groups x 3 passes
run_pass = [r % num_passes for r, size in enumerate(run_sizes) for _ in range(size)]
index = (torch.tensor(run_pass) * per_pass + torch.randint(0, per_pass, (len(run_pass),))).cuda()
rows = fp8_quantize_rows(torch.randn(num_passes * per_pass, k, device="cuda", dtype=torch.bfloat16))
w = fp8_quantize_weights(torch.randn(len(run_sizes) // num_passes, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5)
offsets, m = offsets_from_sizes(run_sizes), sum(run_sizes)


def gemm(flags):
    passes = dict(a_row_index=index, num_passes=num_passes, ready_flags=flags)
    if swiglu:
        h, act = torch.empty(m, n, device="cuda", dtype=torch.bfloat16), empty_fp8_rows(m, n // 2, "cuda")
        deep_gemm.m_grouped_fp8_gemm_nt_swiglu_contiguous((rows.data, rows.scales), (w.data, w.scales), h,
                                                          (act.data, act.scales), offsets, **passes)
        return h, act.data, act.scales
    d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous((rows.data, rows.scales), (w.data, w.scales), d, offsets, **passes)
    return (d,)


landed = gemm(torch.ones(num_passes, dtype=torch.int32, device="cuda"))
data = rows.data.view(torch.uint8)
landing = data.cpu().pin_memory()
data[per_pass:].fill_(0xFF)  # passes 1 and 2: e4m3 NaN bytes until they land
flags = torch.zeros(num_passes, dtype=torch.int32, device="cuda")
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):  # one sleep, queued before the GEMM; the copies and flags need no SM
    torch.cuda._sleep(20_000_000)
    for s in (2, 1):  # the later pass lands first
        data[s * per_pass:(s + 1) * per_pass].copy_(landing[s * per_pass:(s + 1) * per_pass], non_blocking=True)
        stream_write_u32(flags[s:].data_ptr(), 1, data.device.index)
late = gemm(flags)
torch.cuda.current_stream().wait_stream(side)
torch.cuda.synchronize()
print("same bits" if all(same_bits(a, b) for a, b in zip(landed, late)) else "differ")
"""


@requires_sm90
@pytest.mark.parametrize("form", ["plain", "swiglu"])
def test_gathered_passes_read_their_rows_only_after_their_flags(form):
    """As over NVLink (GEMM1 of the FP8 exchange): each later pass's e4m3 rows are NaN bytes until
    another stream copies them in from pinned host memory (a copy engine) and sets the pass's flag,
    while the GEMM already runs on pass 0; the outputs are those of a run with every row in place."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # (this checkout's deep_gemm first)
    run = subprocess.run([sys.executable, "-c", _LANDING, form], capture_output=True, text=True, timeout=180, cwd=root)
    assert run.returncode == 0 and run.stdout.strip().endswith("same bits"), run.stdout + run.stderr


# Weight gradients: (group sizes, M, N).
K_CASES = [
    ([0, 1, 127, 128, 129, 300, 0, 1000], 256, 512),
    ([1], 128, 128),
    ([5000], 384, 256),
    ([0, 0], 256, 256),
    ("uniform", 1536, 2048),
    ("skewed", 768, 1024),
]


def _run_k_grouped(spec, m, n, out_dtype, accumulate):
    sizes = _sizes(spec)
    offsets = offsets_from_sizes(sizes)
    rows = sum(sizes)
    x_a = torch.randn(rows, m, device="cuda", dtype=torch.bfloat16)
    x_b = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    _, a = fp8_quantize_columns(x_a, offsets)
    _, b = fp8_quantize_columns(x_b, offsets)
    deq_a, deq_b = (reference.dequantize_columns(c, offsets.cpu(), rows).cuda() for c in (a, b))
    bounds = list(zip(offsets[:-1].tolist(), offsets[1:].tolist()))
    exact = torch.stack([deq_a[lo:hi].T @ deq_b[lo:hi] for lo, hi in bounds])
    recipe = torch.stack([x_a[lo:hi].float().T @ x_b[lo:hi].float() for lo, hi in bounds])
    if accumulate:
        d = torch.randn(len(sizes), m, n, device="cuda").to(out_dtype)
        if out_dtype == torch.bfloat16:  # the product is rounded to bf16, then the sum (a bf16 reduce-add)
            exact = (exact.to(out_dtype) + d).float()
        else:
            exact = exact + d
        recipe = recipe + d.float()
    else:
        d = torch.full((len(sizes), m, n), float("nan"), device="cuda", dtype=out_dtype)
    deep_gemm.k_grouped_fp8_gemm_tn_contiguous((a.data, a.scales), (b.data, b.scales), d, a.padded_offsets,
                                               accumulate=accumulate)
    torch.cuda.synchronize()
    return sizes, (relative_error(d, exact), exact_bar(exact, out_dtype)), relative_error(d, recipe)


K_VARIANTS = [(dtype, accumulate) for dtype in (torch.float32, torch.bfloat16) for accumulate in (False, True)]


@requires_sm90
@pytest.mark.parametrize("out_dtype,accumulate", K_VARIANTS,
                         ids=[f"{str(t)[6:]}_{'acc' if a else 'set'}" for t, a in K_VARIANTS])
@pytest.mark.parametrize("spec,m,n", K_CASES)
def test_weight_gradient_is_the_product_of_the_dequantized_columns(spec, m, n, out_dtype, accumulate):
    """Every group written (an empty one: zeros, or unchanged when accumulating)."""
    sizes, (exact, bar), _ = _run_k_grouped(spec, m, n, out_dtype, accumulate)
    assert exact <= bar, f"sizes={sizes[:8]}... error {exact:.2e}, bar {bar:.2e}"


@requires_sm90
def test_weight_gradient_scale_products_are_fp32_exact():
    """The row x column scale products, which the tensor cores make from TF32 parts (hi + lo of
    each scale, the lo x lo term left out: ~2^-21), are within 2e-6 of the exact ones for scales
    over eight binades: with every e4m3 value 1, D[m, n] is 128 times the sum over the k-blocks
    of a's scale (k-block, m) times b's (k-block, n)."""
    m, n, rows = 256, 384, 512
    ones = lambda width: torch.ones(width, rows, device="cuda").to(torch.float8_e4m3fn)  # noqa: E731
    scales_a = torch.exp2(torch.rand(rows // 128, m, device="cuda") * 8 - 4)
    scales_b = torch.exp2(torch.rand(rows // 128, n, device="cuda") * 8 - 4)
    d = torch.full((1, m, n), float("nan"), device="cuda")
    offsets = torch.tensor([0, rows], device="cuda", dtype=torch.int32)
    deep_gemm.k_grouped_fp8_gemm_tn_contiguous((ones(m), scales_a), (ones(n), scales_b), d, offsets)
    exact = 128 * (scales_a.double().T @ scales_b.double())
    assert ((d[0].double() - exact) / exact).abs().max().item() < 2e-6


@requires_sm90
@pytest.mark.parametrize("out_dtype,accumulate", K_VARIANTS,
                         ids=[f"{str(t)[6:]}_{'acc' if a else 'set'}" for t, a in K_VARIANTS])
@pytest.mark.parametrize("num_sms", [1, 3])
def test_weight_gradient_walks_many_groups_on_few_sms(num_sms, out_dtype, accumulate):
    """With few SMs each CTA walks many tiles, finding the next one (one or more groups on, some
    empty) and storing the last one while the current one's first MMAs run, an empty group's
    zeros too; every tile of every group is written once, the last groups' (empty) included."""
    sizes = [(g % 5) * 70 for g in range(40)] + [0, 0]  # 4 tiles a group, a fifth of the groups empty
    with num_sms_capped(num_sms):
        _, (exact, bar), _ = _run_k_grouped(sizes, 256, 256, out_dtype, accumulate)
    assert exact <= bar, f"error {exact:.2e}, bar {bar:.2e}"


def _columns(rows=300, width=256, sizes=(100, 200), device="cpu"):
    offsets = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32, device=device)
    _, c = fp8_quantize_columns(torch.randn(rows, width, dtype=torch.bfloat16, device=device), offsets)
    return c


_COLS_A, _COLS_B = _columns(), _columns(width=128)


@pytest.mark.parametrize("a,b,d,error", [
    ((_COLS_A.data, _COLS_A.scales), (_COLS_B.data.float(), _COLS_B.scales), torch.empty(2, 256, 128), "float8_e4m3fn"),
    ((_COLS_A.data, _COLS_A.scales[:1]), (_COLS_B.data, _COLS_B.scales), torch.empty(2, 256, 128), "scales must have shape"),
    ((_COLS_A.data, _COLS_A.scales), (_COLS_B.data[:, :128].contiguous(), _COLS_B.scales[:1].contiguous()),
     torch.empty(2, 256, 128), "same padded rows"),
    ((_COLS_A.data, _COLS_A.scales), (_COLS_B.data, _COLS_B.scales), torch.empty(2, 128, 256), "d must have shape"),
    ((_COLS_A.data, _COLS_A.scales), (_COLS_B.data, _COLS_B.scales), torch.empty(2, 256, 128, dtype=torch.half),
     "dtype"),
    (_COLS_A.data, (_COLS_B.data, _COLS_B.scales), torch.empty(2, 256, 128), "pair"),
    ((_COLS_A.data[:192].contiguous(), _COLS_A.scales[:, :192].contiguous()), (_COLS_B.data, _COLS_B.scales),
     torch.empty(2, 192, 128), "192 must be a multiple of 128"),
    ((_COLS_A.data, _COLS_A.scales.T.contiguous().T), (_COLS_B.data, _COLS_B.scales), torch.empty(2, 256, 128),
     "contiguous"),
    ((_COLS_A.data, _COLS_A.scales), (_COLS_B.data, _COLS_B.scales), torch.empty(2, 256, 128), "CUDA"),  # devices last
])
def test_weight_gradient_refuses_bad_input_before_any_launch(a, b, d, error):
    with pytest.raises((TypeError, ValueError), match=error):
        deep_gemm.k_grouped_fp8_gemm_tn_contiguous(a, b, d, _COLS_A.padded_offsets)


def test_weight_gradient_accumulate_is_a_bool():
    with pytest.raises(TypeError, match="accumulate must be a bool"):
        deep_gemm.k_grouped_fp8_gemm_tn_contiguous((_COLS_A.data, _COLS_A.scales), (_COLS_B.data, _COLS_B.scales),
                                                   torch.empty(2, 256, 128), _COLS_A.padded_offsets, accumulate=1)


def _operands(m=256, n=256, k=256, g=2, device="cpu"):
    a = fp8_quantize_rows(torch.randn(m, k, dtype=torch.bfloat16, device=device))
    w = fp8_quantize_weights(torch.randn(g, n, k, dtype=torch.bfloat16, device=device))
    d = torch.empty(m, n, dtype=torch.bfloat16, device=device)
    offsets = torch.tensor([0, m // 2, m], dtype=torch.int32, device=device)
    return (a.data, a.scales), (w.data, w.scales), d, offsets


def _bad(**change):
    """The GEMM on CPU operands with one part replaced (devices are checked last, so every other
    check runs here)."""
    a, b, d, offsets = _operands()
    a, b = change.get("a", a), change.get("b", b)
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous(a, b, change.get("d", d), change.get("offsets", offsets))


_A, _B, _D, _OFFSETS = _operands()


@pytest.mark.parametrize("change,error", [
    (dict(a=(_A[0].float(), _A[1])), "float8_e4m3fn"),
    (dict(b=(_B[0].to(torch.bfloat16), _B[1])), "float8_e4m3fn"),
    (dict(d=_D.float()), "bfloat16"),
    (dict(a=(_A[0], _A[1].contiguous())), "column-major"),  # row-major scales
    (dict(a=(_A[0], _A[1][:, :1])), "a_scales must have shape"),
    (dict(a=(_A[0], _A[1].double())), "float32"),
    (dict(b=(_B[0], _B[1][:, :, :1])), "b_scales must have shape"),
    (dict(b=(_B[0], _B[1].half())), "float32"),
    (dict(b=(_B[0][:, :, :128].contiguous(), _B[1])), "contraction sizes differ"),
    (dict(a=_A[0]), "a must be a \\(data, scales\\) pair"),
    (dict(a=(fp8_quantize_rows(torch.randn(256, 512, dtype=torch.bfloat16)).data[:, :256], _A[1])), "contiguous"),
    (dict(offsets=torch.tensor([0, 256], dtype=torch.int32)), "groups"),
    (dict(a=(torch.empty(256 * 256 + 16, dtype=torch.float8_e4m3fn)[1:256 * 256 + 1].view(256, 256), _A[1])),
     "16-byte aligned"),
])
def test_bad_input_is_refused_before_any_launch(change, error):
    with pytest.raises((TypeError, ValueError), match=error):
        _bad(**change)


_BUFFER = torch.zeros(2 * _D.numel(), dtype=torch.bfloat16)  # d's bytes twice


@pytest.mark.parametrize("change,error", [
    (dict(a=(view_of_memory(_D, _A[0].shape, torch.float8_e4m3fn), _A[1])), "d overlaps a in memory"),
    (dict(b=(view_of_memory(_D, _B[0].shape, torch.float8_e4m3fn), _B[1])), "d overlaps b in memory"),
    (dict(offsets=view_of_memory(_D, (3,), torch.int32, offset=_D.numel())), "d overlaps group_offsets"),
    # one buffer, d in its first half and a in its second: no overlap (the devices' check is next)
    (dict(d=view_of_memory(_BUFFER, _D.shape, torch.bfloat16),
          a=(view_of_memory(_BUFFER, _A[0].shape, torch.float8_e4m3fn, offset=2 * _D.numel()), _A[1])), "CUDA"),
])
def test_an_output_over_an_input_is_refused_before_any_launch(change, error):
    """A kernel writing memory it reads races: d over an operand or the offsets is refused; d
    beside them in one buffer is not."""
    if "d" not in change:
        change["d"] = _D
    with pytest.raises((TypeError, ValueError), match=error):
        _bad(**change)


def test_the_swiglu_outputs_must_not_overlap_each_other():
    a, _, _, offsets = _operands()
    w = fp8_quantize_weights(torch.randn(2, 256, 256, dtype=torch.bfloat16))
    h = torch.empty(256, 256, dtype=torch.bfloat16)
    act = (view_of_memory(h, (256, 128), torch.float8_e4m3fn), empty_fp8_rows(256, 128, "cpu").scales)
    with pytest.raises(ValueError, match="h overlaps act in memory"):
        deep_gemm.m_grouped_fp8_gemm_nt_swiglu_contiguous(a, (w.data, w.scales), h, act, offsets)


def test_the_weight_gradient_refuses_d_over_an_operand():
    d = torch.empty(2, 256, 128)
    a = (view_of_memory(d, _COLS_A.data.shape, torch.float8_e4m3fn), _COLS_A.scales)
    with pytest.raises(ValueError, match="d overlaps a in memory"):
        deep_gemm.k_grouped_fp8_gemm_tn_contiguous(a, (_COLS_B.data, _COLS_B.scales), d, _COLS_A.padded_offsets)


def test_k_and_n_must_be_multiples_of_128():
    a = fp8_quantize_rows(torch.randn(8, 128, dtype=torch.bfloat16))
    w = torch.zeros(1, 136, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="N = 136 must be a multiple of 128"):
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a.data, a.scales), (w, torch.ones(1, 2, 1)),
                                                   torch.empty(8, 136, dtype=torch.bfloat16),
                                                   torch.tensor([0, 8], dtype=torch.int32))


def test_cpu_tensors_are_refused_last():
    with pytest.raises(ValueError, match="CUDA"):
        _bad()


def test_the_swiglu_gemm_needs_whole_gate_and_up_blocks():
    a = (torch.zeros(4, 128, dtype=torch.float8_e4m3fn), torch.ones(1, 4).T)
    b = (torch.zeros(1, 384, 128, dtype=torch.float8_e4m3fn), torch.ones(1, 3, 1))
    h, act = torch.zeros(4, 384, dtype=torch.bfloat16), torch.zeros(4, 192, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="pairs 128 gate with 128 up columns"):
        deep_gemm.m_grouped_fp8_gemm_nt_swiglu_contiguous(a, b, h, act, torch.tensor([0, 4], dtype=torch.int32))


_ACT = empty_fp8_rows(256, 128, "cpu")
_ODD_STRIDE = torch.empty(1, 257)[:, :256].T  # column stride 257: not a multiple of 4


@pytest.mark.parametrize("act,error", [
    ((_ACT.data.view(torch.uint8), _ACT.scales), "act must have dtype torch.float8_e4m3fn"),
    ((torch.empty(256, 128, dtype=torch.bfloat16), _ACT.scales), "act must have dtype torch.float8_e4m3fn"),
    (_ACT.data, "an e4m3 act needs its scales"),
    ((_ACT.data,), "act must be a \\(data, scales\\) pair"),
    ((_ACT.data[:, :64].contiguous(), _ACT.scales), "act must have shape \\(256, 128\\)"),
    ((_ACT.data, _ACT.scales.double()), "act's scales must have dtype torch.float32"),
    ((_ACT.data, _ACT.scales[:128]), "act's scales must have shape \\(256, 1\\)"),
    ((_ACT.data, torch.empty(256, 1)), "column-major"),  # [M, 1] row-major: column stride 1
    ((_ACT.data, _ODD_STRIDE), "column-major"),
    ((_ACT.data, _ACT.scales), "CUDA"),  # a valid act: devices are checked last
])
def test_swiglu_act_in_fp8_refuses_bad_outputs_before_any_launch(act, error):
    a, _, _, offsets = _operands()
    w = fp8_quantize_weights(torch.randn(2, 256, 256, dtype=torch.bfloat16))
    h = torch.empty(256, 256, dtype=torch.bfloat16)
    with pytest.raises((TypeError, ValueError), match=error):
        deep_gemm.m_grouped_fp8_gemm_nt_swiglu_contiguous(a, (w.data, w.scales), h, act, offsets)


if __name__ == "__main__":
    if not HAS_SM90:
        sys.exit("needs an sm_90 GPU")
    print(f"{'weight gradient case':<34} {'out':<14} {'rows':>6} {'exact err':>9} {'vs bf16 (ours)':>14}")
    for spec, m, n in K_CASES:
        sizes, (exact, _), recipe = _run_k_grouped(spec, m, n, torch.float32, False)
        label = str(spec if isinstance(spec, str) else spec[:4]) + f" M={m} N={n}"
        print(f"{label:<34} {'fp32':<14} {sum(sizes):>6} {exact:>9.2e} {recipe:>14.2e}")
    print(f"{'case':<34} {'kind':<14} {'rows':>6} {'exact err':>9} {'vs bf16 (ours)':>14} {'torch rowwise':>13}")
    for spec, n, k in CASES:
        for data_gradient in (False, True):
            sizes, a, b, offsets, d, (exact, _) = _run(spec, n, k, data_gradient)
            rows = sum(sizes)
            ref = _reference(a, b, sizes)
            ours = relative_error(d[:rows], ref) if rows else 0.0
            theirs = (relative_error(torch_fp8_rowwise_grouped_mm(a[:rows], b.contiguous(), offsets), ref)
                      if rows and not data_gradient else float("nan"))
            label = str(spec if isinstance(spec, str) else spec[:4]) + f" N={n} K={k}"
            print(f"{label:<34} {'dgrad' if data_gradient else 'fwd':<14} {rows:>6} {exact:>9.2e} {ours:>14.2e} "
                  f"{theirs:>13.2e}")
