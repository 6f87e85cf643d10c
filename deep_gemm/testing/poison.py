from contextlib import contextmanager
from typing import Callable, Iterator

import torch

_SMALL_SEGMENT = 2 << 20  # the caching allocator serves requests up to 1 MB from 2 MB segments


@contextmanager
def poisoned_allocations(num_bytes: int, value: int = 0xFF, device: str = "cuda") -> Iterator[Callable[[torch.Tensor], bool]]:
    """Leaves the CUDA caching allocator's free memory filled with byte `value` (0xFF: NaN in
    bf16, fp32 and float8_e4m3fn), so that tensors a function allocates inside the block start
    out poisoned: `num_bytes` for large tensors, one 2 MB segment for those up to 1 MB. Yields a
    check, `poisoned(t)`: whether t's storage lies in the poisoned memory (tests assert it, so
    that a change in the allocator's behaviour cannot silently turn the poisoning off)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    large = torch.full((max(num_bytes, _SMALL_SEGMENT + 1),), value, dtype=torch.uint8, device=device)
    small = [torch.full((_SMALL_SEGMENT // 2,), value, dtype=torch.uint8, device=device) for _ in range(2)]
    ranges = [(t.data_ptr(), t.data_ptr() + t.numel()) for t in (large, *small)]
    del large, small

    def poisoned(t: torch.Tensor) -> bool:
        begin = t.untyped_storage().data_ptr()
        end = begin + t.untyped_storage().nbytes()
        return any(lo <= begin and end <= hi for lo, hi in ranges)

    yield poisoned
