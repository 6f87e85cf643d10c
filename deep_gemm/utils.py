"""Device properties and input checks shared by every launcher."""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Iterator, Optional

import torch

_num_sms: Optional[int] = None


@functools.lru_cache(maxsize=None)
def device_num_sms(device: int) -> int:
    """The device's SM count (`get_num_sms` applies the cap of `set_num_sms`)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def set_num_sms(num_sms: int) -> None:
    """Caps the GEMMs' persistent CTAs (one an SM) at `num_sms`, e.g. to leave SMs to communication.
    The memory-bound kernels (quantization, the SwiGLU passes, the combine) launch a few CTAs a
    capped SM (up to 16), which the hardware may place on any SM: a cap on their parallelism, not
    on the SMs they touch."""
    if not isinstance(num_sms, int) or num_sms <= 0:
        raise ValueError(f"num_sms must be a positive int, got {num_sms!r}")
    global _num_sms
    _num_sms = num_sms


@contextlib.contextmanager
def num_sms_capped(num_sms: int) -> Iterator[None]:
    """Within the block, kernels launched use at most `num_sms` SMs (never more than an outer
    `set_num_sms` cap allows); the cap before the block, or none, is restored after it. Read at
    each launch: a kernel launched inside the block keeps its grid after it."""
    if not isinstance(num_sms, int) or num_sms <= 0:
        raise ValueError(f"num_sms must be a positive int, got {num_sms!r}")
    global _num_sms
    previous = _num_sms
    _num_sms = num_sms if previous is None else min(previous, num_sms)
    try:
        yield
    finally:
        _num_sms = previous


def get_num_sms(device: Optional[int] = None) -> int:
    """SMs the kernels use: the device's count, or the cap from `set_num_sms` if lower."""
    total = device_num_sms(torch.cuda.current_device() if device is None else device)
    return total if _num_sms is None else min(_num_sms, total)


def env_flag(name: str) -> bool:
    """Whether the environment variable `name` is on: set to anything but "", "0", "false", "off"
    or "no" (any case). Every DG_* switch reads its value through this."""
    return os.environ.get(name, "0").strip().lower() not in ("", "0", "false", "off", "no")


@functools.lru_cache(maxsize=None)
def print_configs_enabled() -> bool:
    """DG_PRINT_CONFIGS, read once: launchers ask on every call."""
    return env_flag("DG_PRINT_CONFIGS")


def check_tensor(name: str, t: torch.Tensor, dtype: torch.dtype | tuple[torch.dtype, ...], ndim: int) -> None:
    """Raises TypeError/ValueError unless `t` is a contiguous, 16-byte aligned tensor of
    `dtype` and rank `ndim`. Devices are checked separately (`check_cuda_devices`), last."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (row-major)")
    if t.data_ptr() % 16 != 0:
        raise ValueError(f"{name} must be 16-byte aligned")


def check_cuda_devices(**tensors: torch.Tensor) -> torch.device:
    """Raises ValueError unless all tensors are on one CUDA device; returns it."""
    device = None
    for name, t in tensors.items():
        if t.device.type != "cuda":
            raise ValueError(f"{name} must be on a CUDA device, got {t.device}")
        if device is None:
            device = t.device
        elif t.device != device:
            raise ValueError(f"{name} is on {t.device}, the other tensors on {device}")
    return device


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """``[first, last + 1)``: the bytes of memory the elements of `t` reach (strided views: the
    whole span up to the last element)."""
    begin = t.data_ptr()
    if t.is_contiguous():
        return begin, begin + t.numel() * t.element_size()
    last = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
    return begin, begin + (last + 1) * t.element_size()


def check_disjoint(outputs: dict[str, Optional[torch.Tensor]], inputs: dict[str, Optional[torch.Tensor]]) -> None:
    """Raises ValueError if an output's memory overlaps an input's or another output's (byte spans,
    on the same device; None and empty tensors skipped): a kernel writing what it reads gives a
    race, not an error. Each span is computed once (this runs before every launch)."""
    spans = [(name, *byte_span(t), t) for group in (outputs, inputs) for name, t in group.items()
             if t is not None and t.numel()]
    num_outputs = sum(1 for t in outputs.values() if t is not None and t.numel())
    for i in range(num_outputs):
        name, begin, end, t = spans[i]
        for other, u_begin, u_end, u in spans[i + 1:]:
            if begin < u_end and u_begin < end and u.device == t.device:
                raise ValueError(f"{name} overlaps {other} in memory: outputs must not share memory with "
                                 f"inputs or with each other")


def check_bool(**flags: object) -> None:
    """Raises TypeError unless every keyword's value is a bool (a truthy string or number would
    silently pick a path)."""
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")


def check_multiple(name: str, value: int, multiple: int) -> None:
    if value % multiple != 0:
        raise ValueError(f"{name} = {value} must be a multiple of {multiple}")


def check_group_offsets(group_offsets: torch.Tensor) -> int:
    """Checks the int32 [G + 1] offsets tensor; returns G. Values stay on the GPU (no sync)."""
    check_tensor("group_offsets", group_offsets, torch.int32, 1)
    if group_offsets.numel() < 1:
        raise ValueError("group_offsets must have G + 1 >= 1 entries")
    return group_offsets.numel() - 1
