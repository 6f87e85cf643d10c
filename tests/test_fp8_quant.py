"""Spec of the FP8 quantization (deep_gemm.quant): blockwise e4m3 with fp32 scales.

On the CPU: the PyTorch reference's recipe (a block's largest magnitude maps onto 448; the
dequantized values within e4m3's rounding; the layouts the GEMMs read) and the input checks. On
the GPU: the kernels equal the reference bit for bit, on fresh random data in ragged, empty,
single-row and one-huge groups, into allocations poisoned with NaN first.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deep_gemm.utils import num_sms_capped  # noqa: E402
from deep_gemm.quant import (Fp8Rows, fp8_quantize_columns, fp8_quantize_rows, fp8_quantize_weights,  # noqa: E402
                             padded_group_width)
from deep_gemm.quant import reference  # noqa: E402
from deep_gemm.testing import (offsets_from_sizes, poisoned_allocations, random_group_sizes, same_bits,  # noqa: E402
                                same_written_columns)

HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
requires_sm90 = pytest.mark.skipif(not HAS_SM90, reason="needs an sm_90 GPU")

# (group sizes, K): ragged with tails of every kind, empty groups, one row, one huge group.
GROUP_CASES = [
    ([0, 1, 127, 128, 129, 300, 0, 1000], 256),
    ([1], 128),
    ([5000], 2048),
    ([0, 0, 0], 128),
    ("uniform", 768),
    ("skewed", 2048),
]


def _sizes(spec, num_groups: int = 32, total: int = 4096) -> list[int]:
    return random_group_sizes(total, num_groups, spec) if isinstance(spec, str) else spec


def _activations(m: int, k: int, device="cpu") -> torch.Tensor:
    """Rows with magnitudes spread over many binades, a zero row and a zero block."""
    x = torch.randn(m, k) * torch.exp2(torch.randint(-12, 6, (m, 1)).float())
    if m > 2:
        x[1] = 0
        x[2, :128] = 0
    return x.to(torch.bfloat16).to(device)


def _within_e4m3_rounding(deq: torch.Tensor, x: torch.Tensor, scale: torch.Tensor) -> bool:
    """|deq - x| <= |x| / 16 (3 mantissa bits) + the subnormal step (2^-9 of a scale unit)."""
    return bool(((deq - x).abs() <= x.abs() / 16 + scale * 2.0**-9).all())


@pytest.mark.parametrize("power_of_two", [False, True])
def test_rows_scale_each_1x128_block_onto_e4m3_range(power_of_two):
    x = _activations(300, 512).float()
    rows = fp8_quantize_rows(x.to(torch.bfloat16), power_of_two_scales=power_of_two)
    assert rows.data.dtype == torch.float8_e4m3fn and rows.data.shape == (300, 512)
    assert rows.scales.shape == (300, 4) and rows.scales.stride() == (1, 300)  # column-major, ld = align(M, 4)
    amax = x.reshape(300, 4, 128).abs().amax(dim=2)
    block_max = rows.data.float().reshape(300, 4, 128).abs().amax(dim=2)
    if power_of_two:
        assert bool((torch.frexp(rows.scales).mantissa == 0.5).all())  # powers of two
        nonzero = amax > 0  # the smallest power of two at or above amax / 448
        assert bool((rows.scales[nonzero] >= amax[nonzero] / 448).all())
        assert bool((rows.scales[nonzero] < amax[nonzero] / 224).all())
    else:
        assert bool((block_max[amax > 0] == 448).all())  # the largest magnitude lands on 448
    assert bool((rows.scales[amax == 0] == 1).all()) and bool((block_max[amax == 0] == 0).all())
    scale = rows.scales.repeat_interleave(128, dim=1)
    assert _within_e4m3_rounding(reference.dequantize_rows(rows), x, scale)


def test_a_block_of_tiny_values_keeps_them():
    """amax / 448 below the smallest normal fp32 would make the reciprocal inf: the scale stops there."""
    x = torch.full((1, 128), 1e-37).to(torch.bfloat16)
    x[0, 0] = 3e-38
    rows = fp8_quantize_rows(x)
    assert rows.scales.item() == 2.0**-126
    assert torch.allclose(reference.dequantize_rows(rows), x.float(), rtol=1 / 16, atol=0)


def test_the_kernels_scale_division_rounds_as_ieee_for_every_significand():
    """The kernels take amax / 448 as q = RN(amax * RN(1/448)), r = FMA(-q, 448, amax) and
    RN(q + r * RN(1/448)) by one FMA (ptx::amax_over_e4m3_max). Emulated exactly here for every
    float32 significand (amax in [1, 2)), it is the IEEE quotient; every step scales by a power
    of two with amax, so it is for every amax whose quotient is a normal float. Without the
    correction, 55% of them would be one unit off."""
    a = torch.arange(0x3F800000, 0x40000000, dtype=torch.int64).to(torch.int32).view(torch.float32)
    inv = torch.tensor(1 / 448, dtype=torch.float32)
    q = (a * inv).double()  # RN32(a * inv)
    r = a.double() - q * 448  # exact in float64 (both terms on a 2^-27 grid)
    assert bool((r.float().double() == r).all())  # the FMA's rounding of r changes nothing
    # q + r * inv exactly, in integer units of 2^-59, then rounded to float32's grid (2^-32 below
    # 2^-8, 2^-31 from there), ties to even
    units = lambda x, e: (x * 2.0**e).long()  # noqa: E731  (exact: x is on the 2^-e grid)
    exact = units(q, 33) * 2**26 + units(r, 27) * int(inv.item() * 2.0**32)
    grid = torch.where(exact >= 2**51, 2**28, 2**27)
    below = torch.div(exact, grid, rounding_mode="floor")
    twice_rest = 2 * (exact - below * grid)
    up = (twice_rest > grid) | ((twice_rest == grid) & (below % 2 == 1))
    ieee = (a / torch.tensor(448.0)).double()
    assert torch.equal((below + up.long()) * grid, units(ieee, 59))
    assert int((units(q, 59) != units(ieee, 59)).sum()) > 2**22


@requires_sm90
def test_scales_of_every_bf16_amax_are_the_ieee_quotients():
    """A 1 x 128 block for each positive bf16 value (subnormals, +inf) as its amax: the kernel's
    scale is the reference's, amax / 448 by IEEE division, at least 2^-126."""
    amax = torch.arange(1, 0x7F81, dtype=torch.int16).view(torch.bfloat16)  # (0x7F80: +inf)
    x = torch.zeros(len(amax), 128, dtype=torch.bfloat16)
    x[:, 5] = amax
    rows = fp8_quantize_rows(x.cuda())
    assert same_bits(rows.scales[:, 0], reference.scale_of(amax.float(), power_of_two=False))


def _blocks_of_every_bf16_amax() -> torch.Tensor:
    """[32639, 128] bf16: row i's largest magnitude is the (i + 1)-th positive finite bf16 value
    (subnormals first), beside that value times fractions of both signs down to a 64th."""
    amax = torch.arange(1, 0x7F80, dtype=torch.int16).view(torch.bfloat16).float()
    fractions = torch.cat([torch.linspace(-1.0, 1.0, 64), 1.0 / torch.arange(1, 65)])
    return (amax[:, None] * fractions[None, :]).to(torch.bfloat16)


@requires_sm90
@pytest.mark.parametrize("power_of_two", [False, True])
def test_every_bf16_amax_quantizes_its_block_as_the_reference(power_of_two):
    """Every scale a bf16 block can have, and its reciprocal, give the reference's e4m3 bytes: in
    1 x 128 rows, in 128 x 1 columns and in 128 x 128 weight blocks."""
    x = _blocks_of_every_bf16_amax()
    _assert_rows_equal(fp8_quantize_rows(x.cuda(), power_of_two_scales=power_of_two),
                       reference.fp8_quantize_rows_torch(x, power_of_two_scales=power_of_two))
    xt = torch.cat([x, torch.zeros(1, 128, dtype=x.dtype)]).t().contiguous()  # [128, 32640]: a column a row of x
    offsets = torch.tensor([0, 128], dtype=torch.int32)
    _, cols = fp8_quantize_columns(xt.cuda(), offsets.cuda(), power_of_two_scales=power_of_two)
    _, ref = reference.fp8_quantize_columns_torch(xt, offsets, power_of_two_scales=power_of_two)
    assert same_written_columns(cols, ref)
    blocks = x[::128]  # 255 of the amaxes, one 128 x 128 block each: its rows all this row of x
    w = blocks.reshape(1, 1, -1).expand(1, 128, -1).contiguous()
    ours, ref_w = (fp8_quantize_weights(w.cuda(), power_of_two_scales=power_of_two),
                   reference.fp8_quantize_weights_torch(w, power_of_two_scales=power_of_two))
    assert same_bits(ours.scales, ref_w.scales) and same_bits(ours.data, ref_w.data)
    assert same_bits(ours.data_t, ref_w.data_t)


def test_rows_scales_are_padded_to_a_multiple_of_four_rows():
    rows = fp8_quantize_rows(_activations(5, 256))
    assert rows.scales.shape == (5, 2) and rows.scales.stride() == (1, 8)


@pytest.mark.parametrize("sizes,k", GROUP_CASES)
def test_columns_transpose_each_group_padded_to_128_rows(sizes, k):
    sizes = _sizes(sizes)
    offsets = offsets_from_sizes(sizes, "cpu")
    x = _activations(sum(sizes), k)
    rows, cols = fp8_quantize_columns(x, offsets, with_rows=True)
    width = padded_group_width(x.shape[0], len(sizes))
    assert cols.data.shape == (k, width) and cols.scales.shape == (width // 128, k)
    padded = [0]
    for s in sizes:
        padded.append(padded[-1] + -(-s // 128) * 128)
    assert cols.padded_offsets.tolist() == padded and padded[-1] <= width
    for g, s in enumerate(sizes):  # each group's padding is zeros, so it adds nothing to a product
        assert bool((cols.data[:, padded[g] + s:padded[g + 1]].float() == 0).all())
    deq = reference.dequantize_columns(cols, offsets, x.shape[0])
    scale = torch.zeros_like(deq)
    for g, (begin, end) in enumerate(reference.group_bounds(offsets, x.shape[0])):
        blocks = cols.scales[padded[g] // 128:padded[g + 1] // 128]  # [blocks of the group, K]
        scale[begin:end] = blocks.repeat_interleave(128, dim=0)[:end - begin]
    assert _within_e4m3_rounding(deq, x.float(), scale)
    assert torch.equal(rows.data.view(torch.uint8), fp8_quantize_rows(x).data.view(torch.uint8))


def test_a_column_scale_never_spans_two_groups():
    """A tiny group next to a large one keeps its own scales: its values survive."""
    x = torch.cat([torch.full((3, 128), 1e-3), torch.full((200, 128), 1e3)]).to(torch.bfloat16)
    _, cols = fp8_quantize_columns(x, offsets_from_sizes([3, 200], "cpu"))
    assert torch.allclose(reference.dequantize_columns(cols, offsets_from_sizes([3, 200], "cpu"), 203)[:3],
                          x[:3].float(), rtol=1 / 16)


@pytest.mark.parametrize("power_of_two", [False, True])
def test_weights_one_scale_per_128x128_block_in_both_orientations(power_of_two):
    w = (torch.randn(3, 256, 384) * torch.exp2(torch.randint(-8, 4, (3, 256, 1)).float())).to(torch.bfloat16)
    out = fp8_quantize_weights(w, power_of_two_scales=power_of_two)
    assert out.data.shape == (3, 256, 384) and out.data_t.shape == (3, 384, 256) and out.scales.shape == (3, 2, 3)
    assert torch.equal(out.data_t.view(torch.uint8), out.data.transpose(1, 2).view(torch.uint8))
    scale = out.scales.repeat_interleave(128, dim=1).repeat_interleave(128, dim=2)
    assert _within_e4m3_rounding(reference.dequantize_weights(out), w.float(), scale)


def test_weights_in_one_orientation_are_that_half_of_both():
    w = torch.randn(2, 256, 128).to(torch.bfloat16)
    both = fp8_quantize_weights(w)
    data, data_t = fp8_quantize_weights(w, which="data"), fp8_quantize_weights(w, which="data_t")
    assert data.data_t is None and data_t.data is None
    assert torch.equal(data.data.view(torch.uint8), both.data.view(torch.uint8))
    assert torch.equal(data_t.data_t.view(torch.uint8), both.data_t.view(torch.uint8))
    assert torch.equal(data.scales, both.scales) and torch.equal(data_t.scales, both.scales)
    with pytest.raises(ValueError, match="without their transposed copy"):
        data.transposed_operand()


@pytest.mark.parametrize("call,error", [
    (lambda: fp8_quantize_rows(torch.zeros(4, 128)), "dtype"),
    (lambda: fp8_quantize_rows(torch.zeros(4, 200, dtype=torch.bfloat16)), "multiple of 128"),
    (lambda: fp8_quantize_rows(torch.zeros(4, 256, dtype=torch.bfloat16)[:, :128]), "contiguous"),
    (lambda: fp8_quantize_rows(torch.zeros(2, 4, 128, dtype=torch.bfloat16)), "2-D"),
    (lambda: fp8_quantize_columns(torch.zeros(4, 128, dtype=torch.bfloat16), torch.tensor([0, 4])), "int32"),
    (lambda: fp8_quantize_columns(torch.zeros(4, 128, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.int32)),
     "1 to 1024 groups"),
    (lambda: fp8_quantize_columns(torch.zeros(4, 128, dtype=torch.bfloat16), torch.zeros(1026, dtype=torch.int32)),
     "1 to 1024 groups"),
    (lambda: fp8_quantize_weights(torch.zeros(2, 100, 128, dtype=torch.bfloat16)), "multiple of 128"),
    (lambda: fp8_quantize_weights(torch.zeros(100, 128, dtype=torch.bfloat16)), "3-D"),
    (lambda: fp8_quantize_weights(torch.zeros(1, 128, 128, dtype=torch.bfloat16), which="rows"), "which must be"),
    (lambda: fp8_quantize_columns(torch.zeros(4, 128, dtype=torch.bfloat16), torch.tensor([0, 4], dtype=torch.int32),
                                  row_index=torch.zeros(4, dtype=torch.int32)), "int64"),
    # flags are bools: a truthy string would pick power-of-two scales (other bits) without a word
    (lambda: fp8_quantize_rows(torch.zeros(4, 128, dtype=torch.bfloat16), power_of_two_scales="no"),
     "power_of_two_scales must be a bool"),
    (lambda: fp8_quantize_weights(torch.zeros(1, 128, 128, dtype=torch.bfloat16), power_of_two_scales=1),
     "power_of_two_scales must be a bool"),
    (lambda: fp8_quantize_columns(torch.zeros(4, 128, dtype=torch.bfloat16), torch.tensor([0, 4], dtype=torch.int32),
                                  with_rows="yes"), "with_rows must be a bool"),
    # on the CPU too, every tensor on x's device
    (lambda: fp8_quantize_columns(torch.zeros(4, 128, dtype=torch.bfloat16),
                                  torch.tensor([0, 4], dtype=torch.int32, device="meta")), "group_offsets is on meta"),
    (lambda: fp8_quantize_columns(torch.zeros(4, 128, dtype=torch.bfloat16), torch.tensor([0, 4], dtype=torch.int32),
                                  row_index=torch.zeros(4, dtype=torch.int64, device="meta")), "row_index is on meta"),
])
def test_bad_input_is_refused_with_a_clear_error(call, error):
    with pytest.raises((TypeError, ValueError), match=error):
        call()


def _columns_in_storage(x: torch.Tensor, offsets: torch.Tensor, storage: torch.Tensor, **kwargs):
    """fp8_quantize_columns into `storage`, beside the same call without it."""
    _, placed = fp8_quantize_columns(x, offsets, out_storage=storage, **kwargs)
    _, fresh = fp8_quantize_columns(x, offsets, **kwargs)
    return placed, fresh


def test_columns_can_be_written_into_a_dead_buffers_memory():
    """`out_storage` (any dtype, here bf16 like a consumed h) holds the columns' data: the same
    values as a new tensor's, at the buffer's address."""
    x, offsets = _activations(300, 256), offsets_from_sizes([100, 0, 200], "cpu")
    storage = torch.full((400, 400), float("nan"), dtype=torch.bfloat16)
    placed, fresh = _columns_in_storage(x, offsets, storage)
    assert placed.data.data_ptr() == storage.data_ptr() and placed.data.shape == fresh.data.shape
    assert same_bits(placed.data, fresh.data) and same_bits(placed.scales, fresh.scales)
    assert same_bits(placed.padded_offsets, fresh.padded_offsets)


def _x_inside(storage: torch.Tensor) -> torch.Tensor:
    """A [4, 128] bf16 x living in storage's first bytes."""
    return storage.view(torch.uint8)[:1024].view(torch.bfloat16).view(4, 128)


@pytest.mark.parametrize("storage,x_inside,error", [  # (4 rows in one group: [128, 256] e4m3, 32768 bytes)
    (torch.zeros(32767, dtype=torch.uint8), False, "holds 32767 bytes, the columns need 32768"),
    (torch.zeros(32784, dtype=torch.uint8)[1:], False, "16-byte aligned"),
    (torch.zeros(512, 128, dtype=torch.uint8)[:, ::2], False, "contiguous"),
    (torch.zeros(65536, dtype=torch.uint8), True, "overlaps x"),
    (torch.zeros(32768, dtype=torch.uint8, device="meta"), False, "is on meta"),
    ([0] * 32768, False, "torch.Tensor"),
])
def test_bad_storage_is_refused_and_left_untouched(storage, x_inside, error):
    x = _x_inside(storage) if x_inside else torch.zeros(4, 128, dtype=torch.bfloat16)
    before = storage.clone() if isinstance(storage, torch.Tensor) and not storage.is_meta else None
    with pytest.raises((TypeError, ValueError), match=error):
        fp8_quantize_columns(x, torch.tensor([0, 4], dtype=torch.int32), out_storage=storage)
    if before is not None:
        assert torch.equal(storage, before)


def _row_index(num_rows: int, source_rows: int, device="cpu") -> torch.Tensor:
    """Rows picked with repeats from a source of another height, two of them out of range."""
    index = torch.randint(0, max(source_rows, 1), (num_rows,), device=device)
    if num_rows > 2:
        index[num_rows // 2], index[num_rows // 3] = source_rows, -1
    return index


def test_gathered_columns_are_the_columns_of_the_gathered_rows():
    x = _activations(300, 256)
    index = _row_index(500, 300)
    offsets = offsets_from_sizes([100, 0, 250, 150], "cpu")
    gathered = torch.where(((index >= 0) & (index < 300))[:, None], x[index.clamp(0, 299)], 0)
    rows, cols = fp8_quantize_columns(x, offsets, row_index=index, with_rows=True)
    ref_rows, ref = fp8_quantize_columns(gathered, offsets, with_rows=True)
    assert same_bits(cols.data, ref.data) and same_bits(cols.scales, ref.scales)
    assert same_bits(rows.data, ref_rows.data) and same_bits(rows.scales, ref_rows.scales)


# GPU: the kernels against the reference, bit for bit.

def _assert_rows_equal(out: Fp8Rows, ref: Fp8Rows, valid_rows=slice(None)):
    assert same_bits(out.data[valid_rows], ref.data[valid_rows])
    assert same_bits(out.scales[valid_rows], ref.scales[valid_rows])


@requires_sm90
@pytest.mark.parametrize("power_of_two", [False, True])
@pytest.mark.parametrize("m,k", [(1, 128), (300, 512), (4096, 2048), (129, 7168)])
def test_rows_kernel_equals_the_reference(m, k, power_of_two):
    x = _activations(m, k)
    with poisoned_allocations(8 * m * k) as poisoned:
        out = fp8_quantize_rows(x.cuda(), power_of_two_scales=power_of_two)
        assert poisoned(out.data) and poisoned(out.scales)
    _assert_rows_equal(out, reference.fp8_quantize_rows_torch(x, power_of_two_scales=power_of_two))


@requires_sm90
def test_rows_kernel_walks_many_tiles_under_an_sm_cap():
    """Launched one CTA a tile, except under `set_num_sms`, where a few CTAs walk every tile."""
    x = _activations(1000, 1024)
    with num_sms_capped(1), poisoned_allocations(8 * x.numel()) as poisoned:
        out = fp8_quantize_rows(x.cuda())
        assert poisoned(out.data) and poisoned(out.scales)
    _assert_rows_equal(out, reference.fp8_quantize_rows_torch(x))


@requires_sm90
@pytest.mark.parametrize("power_of_two", [False, True])
@pytest.mark.parametrize("sizes,k", GROUP_CASES)
def test_columns_kernel_equals_the_reference(sizes, k, power_of_two):
    sizes = _sizes(sizes)
    x = _activations(sum(sizes), k)
    offsets = offsets_from_sizes(sizes, "cpu")
    ref_rows, ref = reference.fp8_quantize_columns_torch(x, offsets, with_rows=True, power_of_two_scales=power_of_two)
    for with_rows in (True, False):
        with poisoned_allocations(16 * (x.numel() + 128 * len(sizes) * k)) as poisoned:
            rows, cols = fp8_quantize_columns(x.cuda(), offsets.cuda(), with_rows=with_rows,
                                              power_of_two_scales=power_of_two)
            assert poisoned(cols.data) and poisoned(cols.scales)
        assert same_bits(cols.padded_offsets, ref.padded_offsets)
        assert same_written_columns(cols, ref)
        if with_rows:
            _assert_rows_equal(rows, ref_rows)
        else:
            assert rows is None


@requires_sm90
@pytest.mark.parametrize("pow2", [False, True], ids=["fp32_scales", "pow2_scales"])
@pytest.mark.parametrize("sizes,k", GROUP_CASES[:4])
def test_gathered_columns_kernel_equals_the_reference(sizes, k, pow2):
    sizes = _sizes(sizes)
    x = _activations(max(sum(sizes) // 2, 1), k)
    index = _row_index(sum(sizes), x.shape[0])
    offsets = offsets_from_sizes(sizes, "cpu")
    ref_rows, ref = reference.fp8_quantize_columns_torch(x, offsets, row_index=index, with_rows=True,
                                                         power_of_two_scales=pow2)
    with poisoned_allocations(16 * (index.numel() * k + 128 * len(sizes) * k)) as poisoned:
        rows, cols = fp8_quantize_columns(x.cuda(), offsets.cuda(), row_index=index.cuda(), with_rows=True,
                                          power_of_two_scales=pow2)
        assert poisoned(cols.data) and poisoned(cols.scales)
    assert same_written_columns(cols, ref)
    _assert_rows_equal(rows, ref_rows, slice(0, sum(sizes)))


@requires_sm90
@pytest.mark.parametrize("gather", [False, True], ids=["rows", "gathered_rows"])
@pytest.mark.parametrize("sizes", [
    [2000, 5000, 0, 130, 1, 4000, 256, 900],
    [3000] * 3,
    [(g * 37) % 200 + 130 for g in range(1024)],
], ids=["ragged", "equal", "1024_groups"])
def test_columns_kernel_equals_the_reference_on_many_or_large_groups(sizes, gather):
    """Groups of a few blocks beside groups of many, three equal ones of 24 blocks, and the most
    groups the kernel takes: each block quantized once, bit for bit the reference."""
    x = _activations(sum(sizes) if not gather else max(sum(sizes) // 3, 1), 256)
    index = _row_index(sum(sizes), x.shape[0]) if gather else None
    offsets = offsets_from_sizes(sizes, "cpu")
    ref_rows, ref = reference.fp8_quantize_columns_torch(x, offsets, row_index=index, with_rows=True)
    rows, cols = fp8_quantize_columns(x.cuda(), offsets.cuda(), row_index=None if index is None else index.cuda(),
                                      with_rows=True)
    assert same_written_columns(cols, ref)
    _assert_rows_equal(rows, ref_rows, slice(0, sum(sizes)))


@requires_sm90
def test_columns_kernel_writes_into_the_storage_it_is_given():
    x = _activations(2000, 512).cuda()
    offsets = offsets_from_sizes(random_group_sizes(2000, 16, "skewed"), "cuda")
    index = _row_index(2000, 2000, "cuda")
    storage = torch.full((2000, 1024), float("nan"), dtype=torch.bfloat16, device="cuda")
    placed, fresh = _columns_in_storage(x, offsets, storage, row_index=index)
    assert placed.data.data_ptr() == storage.data_ptr()
    assert same_written_columns(placed, fresh)


@requires_sm90
def test_columns_kernel_leaves_rows_outside_every_group_unwritten():
    x = _activations(400, 256)
    offsets = torch.tensor([0, 100, 250], dtype=torch.int32)  # rows 250.. belong to no group
    with poisoned_allocations(1 << 24) as poisoned:
        rows, cols = fp8_quantize_columns(x.cuda(), offsets.cuda(), with_rows=True)
        assert poisoned(rows.data)
    assert bool(rows.data[250:].float().isnan().all()) and bool(rows.scales[250:].isnan().all())
    ref_rows, _ = reference.fp8_quantize_columns_torch(x, offsets, with_rows=True)
    _assert_rows_equal(rows, ref_rows, slice(0, 250))


@requires_sm90
@pytest.mark.parametrize("power_of_two", [False, True])
@pytest.mark.parametrize("g,n,k", [(1, 128, 128), (3, 256, 384), (8, 1536, 2048), (2, 7168, 2048)])
def test_weights_kernel_equals_the_reference(g, n, k, power_of_two):
    w = (torch.randn(g, n, k) * torch.exp2(torch.randint(-8, 4, (g, n, 1)).float())).to(torch.bfloat16)
    with poisoned_allocations(4 * w.numel()) as poisoned:
        out = fp8_quantize_weights(w.cuda(), power_of_two_scales=power_of_two)
        assert poisoned(out.data) and poisoned(out.data_t)
    ref = reference.fp8_quantize_weights_torch(w, power_of_two_scales=power_of_two)
    assert same_bits(out.data, ref.data) and same_bits(out.data_t, ref.data_t) and same_bits(out.scales, ref.scales)


@requires_sm90
@pytest.mark.parametrize("pow2", [False, True], ids=["fp32_scales", "pow2_scales"])
@pytest.mark.parametrize("which", ["data", "data_t"])
@pytest.mark.parametrize("g,n,k", [(1, 128, 128), (3, 256, 384), (2, 7168, 2048)])
def test_weights_kernel_in_one_orientation_equals_the_reference(g, n, k, which, pow2):
    w = (torch.randn(g, n, k) * torch.exp2(torch.randint(-8, 4, (g, n, 1)).float())).to(torch.bfloat16)
    with poisoned_allocations(4 * w.numel()) as poisoned:
        out = fp8_quantize_weights(w.cuda(), which=which, power_of_two_scales=pow2)
        assert poisoned(getattr(out, which)) and poisoned(out.scales)
    assert getattr(out, "data_t" if which == "data" else "data") is None
    ref = reference.fp8_quantize_weights_torch(w, power_of_two_scales=pow2)
    assert same_bits(getattr(out, which), getattr(ref, which)) and same_bits(out.scales, ref.scales)


@requires_sm90
def test_empty_inputs_launch_nothing_or_only_the_offsets():
    x = torch.empty(0, 256, dtype=torch.bfloat16, device="cuda")
    assert fp8_quantize_rows(x).data.shape == (0, 256)
    _, cols = fp8_quantize_columns(x, torch.zeros(5, dtype=torch.int32, device="cuda"))
    assert cols.padded_offsets.tolist() == [0] * 5
    assert fp8_quantize_weights(torch.empty(0, 128, 128, dtype=torch.bfloat16, device="cuda")).data.numel() == 0


def _fp8_rows(m: int, k: int, device="cpu") -> Fp8Rows:
    """Quantized rows whose scales' column stride exceeds their rows (the layout received rows have)."""
    rows = reference.fp8_quantize_rows_torch(_activations(m, k))
    storage = torch.full((k // 128, m + 7), float("nan"))
    storage[:, :m] = rows.scales.T
    return Fp8Rows(rows.data.to(device), storage.to(device)[:, :m].T)


def test_columns_of_fp8_rows_are_those_of_the_rows_dequantized():
    """On the CPU by the reference: the FP8 rows' bf16 values (dequantized, rounded once), quantized."""
    rows, index = _fp8_rows(300, 256), _row_index(500, 300)
    offsets = offsets_from_sizes([100, 0, 250, 150], "cpu")
    bf16 = reference.dequantize_rows(rows).to(torch.bfloat16)
    _, ours = fp8_quantize_columns(rows, offsets, row_index=index)
    _, ref = reference.fp8_quantize_columns_torch(bf16, offsets, row_index=index)
    assert same_bits(ours.data, ref.data) and same_bits(ours.scales, ref.scales)


@pytest.mark.parametrize("scales,match", [
    (torch.zeros(8, 2), "column-major"),  # row-major
    (torch.zeros(2, 8).T.contiguous().T[:, :1], "must be"),  # one column of two
    (torch.zeros(2, 8, dtype=torch.float16).T, "float32"),
])
def test_fp8_rows_with_malformed_scales_are_refused(scales, match):
    data = torch.zeros(8, 256, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=match):
        fp8_quantize_columns(Fp8Rows(data, scales), torch.tensor([0, 8], dtype=torch.int32))


@requires_sm90
@pytest.mark.parametrize("pow2", [False, True], ids=["fp32_scales", "pow2_scales"])
@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("sizes,k", [([0, 1, 127, 128, 129, 300, 0, 1000], 256), ("skewed", 2048), ([5000], 256)])
def test_columns_kernel_from_fp8_rows_equals_the_reference(sizes, k, gather, pow2):
    sizes = _sizes(sizes)
    rows = _fp8_rows(sum(sizes) + 5, k)
    index = _row_index(sum(sizes), rows.data.shape[0]) if gather else None
    offsets = offsets_from_sizes(sizes, "cpu")
    bf16 = reference.dequantize_rows(rows).to(torch.bfloat16)[: None if gather else sum(sizes)]
    _, ref = reference.fp8_quantize_columns_torch(bf16, offsets, row_index=index, power_of_two_scales=pow2)
    source = rows if gather else Fp8Rows(rows.data[:sum(sizes)], rows.scales[:sum(sizes)])
    with poisoned_allocations(16 * (sum(sizes) + 128 * len(sizes)) * k) as poisoned:
        _, cols = fp8_quantize_columns(Fp8Rows(source.data.cuda(), source.scales.cuda()), offsets.cuda(),
                                       row_index=None if index is None else index.cuda(), power_of_two_scales=pow2)
        assert poisoned(cols.data) and poisoned(cols.scales)
    assert same_bits(cols.padded_offsets, ref.padded_offsets)
    assert same_written_columns(cols, ref)
