from typing import Optional, Sequence

import torch


def offsets_from_sizes(sizes: Sequence[int], device: str | torch.device = "cuda") -> torch.Tensor:
    """int32 ``[G + 1]`` prefix offsets (0 first) of `sizes`."""
    offsets = [0]
    for s in sizes:
        offsets.append(offsets[-1] + int(s))
    return torch.tensor(offsets, dtype=torch.int32, device=device)


def random_group_sizes(total: int, num_groups: int, routing: str = "uniform", max_size: Optional[int] = None,
                       generator: Optional[torch.Generator] = None) -> list[int]:
    """Group sizes summing to `total`.

    uniform: multinomial over equal weights (near total / G each, ragged).
    skewed: Zipf-like weights 1 / (rank + 1), ranks shuffled; sizes capped at `max_size`
    (an expert sees each token at most once), the excess spread over the other groups.
    """
    if routing == "uniform":
        weights = torch.ones(num_groups)
    elif routing == "skewed":
        weights = 1.0 / (torch.randperm(num_groups, generator=generator).double() + 1.0)
    else:
        raise ValueError(f"unknown routing {routing!r}")
    sizes = torch.multinomial(weights.float(), total, replacement=True, generator=generator)
    sizes = torch.bincount(sizes, minlength=num_groups)
    if max_size is not None:
        for _ in range(num_groups):
            excess = (sizes - max_size).clamp(min=0)
            if excess.sum() == 0:
                break
            sizes -= excess
            room = (max_size - sizes).clamp(min=0).double()
            extra = torch.multinomial(room, int(excess.sum()), replacement=True, generator=generator)
            sizes += torch.bincount(extra, minlength=num_groups)
    return sizes.tolist()
