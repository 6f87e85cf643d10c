from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from cuda.bindings import driver as cu

from ..jit.runtime import check

_SMALL_SEGMENT = 2 << 20  # the caching allocator serves requests up to 1 MB from 2 MB segments


def _free_blocks(device: int) -> list[tuple[int, int]]:
    """(address, bytes) of every block the caching allocator holds free on `device`."""
    blocks = []
    for segment in torch.cuda.memory_snapshot():
        if segment["device"] != device:
            continue
        address = segment["address"]
        for block in segment["blocks"]:
            if block["state"] == "inactive":
                blocks.append((address, block["size"]))
            address += block["size"]
    return blocks


@contextmanager
def poisoned_allocations(num_bytes: int, value: int = 0xFF, device: str = "cuda") -> Iterator[Callable[[torch.Tensor], bool]]:
    """Fills every block the CUDA caching allocator holds free with byte `value` (0xFF: NaN in
    bf16, fp32 and float8_e4m3fn), after reserving fresh segments of `num_bytes` (large
    tensors) and 2 MB (those up to 1 MB), so that tensors a function allocates inside the block
    start out poisoned. Yields a check, `poisoned(t)`: whether t's storage lies in the poisoned
    memory (tests assert it, so that a change in the allocator cannot silently turn it off)."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    torch.cuda.synchronize(index)
    torch.cuda.empty_cache()
    reserved = [torch.empty(max(num_bytes, _SMALL_SEGMENT + 1), dtype=torch.uint8, device=index),
                torch.empty(_SMALL_SEGMENT // 2, dtype=torch.uint8, device=index)]
    del reserved
    ranges = _free_blocks(index)
    for address, size in ranges:
        check(cu.cuMemsetD8(address, value, size))
    torch.cuda.synchronize(index)
    ranges = [(address, address + size) for address, size in ranges]

    def poisoned(t: torch.Tensor) -> bool:
        begin = t.untyped_storage().data_ptr()
        end = begin + t.untyped_storage().nbytes()
        return any(lo <= begin and end <= hi for lo, hi in ranges)

    yield poisoned
