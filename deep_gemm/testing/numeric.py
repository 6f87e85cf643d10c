import torch


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` (Frobenius), computed in float64 on ``ref``'s device.

    Returns ``inf`` if ``out`` holds any NaN/Inf (so NaN never passes a bar), and
    ``||out||`` when ``||ref|| == 0``. Raises if shapes differ or ``ref`` is not finite.
    """
    if out.shape != ref.shape:
        raise ValueError(f"shape mismatch: out {tuple(out.shape)} vs ref {tuple(ref.shape)}")
    ref64 = ref.detach().to(torch.float64)
    if not bool(torch.isfinite(ref64).all()):
        raise ValueError("reference holds NaN/Inf")
    out64 = out.detach().to(device=ref.device, dtype=torch.float64)
    if not bool(torch.isfinite(out64).all()):
        return float("inf")
    ref_norm = torch.linalg.vector_norm(ref64).item()
    if ref_norm == 0.0:
        return torch.linalg.vector_norm(out64).item()
    return torch.linalg.vector_norm(out64 - ref64).item() / ref_norm


_SAME_SIZE_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same bits (same shape, each element's bytes compared, so a NaN
    equals the same NaN), on the CPU."""
    if a.shape != b.shape or a.element_size() != b.element_size():
        return False
    as_ints = lambda t: t.detach().cpu().contiguous().view(_SAME_SIZE_INTS[t.element_size()])  # noqa: E731
    return torch.equal(as_ints(a), as_ints(b))


def same_written_columns(out, ref) -> bool:
    """Whether two `deep_gemm.quant.Fp8Columns` hold the same bits in the columns `ref`'s groups
    use (up to ``ref.padded_offsets[-1]``), data and scales; past them each holds whatever its
    memory held."""
    used = int(ref.padded_offsets[-1])
    return (same_bits(out.data[:, :used], ref.data[:, :used])
            and same_bits(out.scales[:used // 128], ref.scales[:used // 128]))


def view_of_memory(t: torch.Tensor, shape: tuple, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
    """A tensor of `shape` and `dtype` over t's memory from its byte `offset` on (contiguous t):
    an output over an input, for the input checks' tests."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if offset + nbytes > t.numel() * t.element_size():
        raise ValueError(f"{nbytes} bytes from byte {offset} do not fit in t's {t.numel() * t.element_size()}")
    return t.view(-1).view(torch.uint8)[offset:offset + nbytes].view(dtype).view(shape)
