"""The symmetric buffer of the built-in expert-parallel path: one allocation of the same size
on every rank of a process group, each rank's copy addressable by the others (PyTorch
symmetric memory over NVLink), which the copy engines read from and write into directly.

One buffer serves every MoE layer of a model (layers use it one after another); it is
sized for the largest layer and the most tokens a rank will hold.
"""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .._kernels import moe_kernels as kernels

# A barrier that waits longer than this fails the launch (and with it the CUDA context) instead
# of hanging when a rank died. Generous: a rank may be compiling kernels or saving a checkpoint.
BARRIER_TIMEOUT_MS = int(os.environ.get("DG_EP_BARRIER_TIMEOUT_MS", 600_000))
_ALIGN = 256


@dataclass(frozen=True)
class PeerRegion:
    """One region of every rank's buffer: `tensors[r]` is rank r's copy as mapped in this
    process (peer memory: copies into and out of it run on the copy engines)."""

    tensors: tuple


def _regions(world: int, max_tokens: int, num_topk: int, hidden: int) -> list:
    """(name, shape, dtype) of every region."""
    return [
        # This rank's tokens, read by the others (the caller may stage its inputs here).
        ("x", (max_tokens, hidden), torch.bfloat16),
        ("topk_idx", (max_tokens, num_topk), torch.int64),
        ("topk_weights", (max_tokens, num_topk), torch.float32),
        ("dy", (max_tokens, hidden), torch.bfloat16),  # the backward's dy, read by the others
        ("num_tokens", (world,), torch.int32),  # each rank's token count
        ("calls", (world,), torch.int64),  # which exchange each rank is in (exchange.announce_call)
        # Partial results for this rank's tokens from each other rank (block s - 1: from rank
        # rank - s), their routing-weight gradients, and the flags their senders set once landed.
        ("back", ((world - 1) * max_tokens, hidden), torch.bfloat16),
        ("back_dw", ((world - 1) * max_tokens, num_topk), torch.float32),
        ("arrived", (world - 1,), torch.int32),
    ]


def _layout(regions: list) -> tuple[dict, int]:
    offsets, size = {}, 0
    for name, shape, dtype in regions:
        offsets[name] = size
        size += -(-math.prod(shape) * dtype.itemsize // _ALIGN) * _ALIGN
    return offsets, size


def _carve(storage: torch.Tensor, regions: list, offsets: dict) -> dict:
    views = {}
    for name, shape, dtype in regions:
        nbytes = math.prod(shape) * dtype.itemsize
        views[name] = storage[offsets[name]:offsets[name] + nbytes].view(dtype).view(shape)
    return views


class SymmBuffer:
    """The buffer of `get_symm_buffer_for_mega_moe`. `local` holds this rank's regions by
    name (the caller may fill ``local["x"]``, ``local["topk_idx"]`` and ``local["topk_weights"]``);
    `region(name)` gives the region across ranks for the exchange's copies; `barrier()` is a
    stream-ordered barrier of the group."""

    def __init__(self, storages: list, rank: int, group: Optional[dist.ProcessGroup], num_experts: int,
                 max_tokens: int, num_topk: int, hidden: int, barrier: Callable[[], None]):
        world = len(storages)
        if num_experts % world:
            raise ValueError(f"{num_experts} experts do not split evenly over {world} ranks")
        self.rank, self.world, self.group = rank, world, group
        self.num_experts, self.num_local_experts = num_experts, num_experts // world
        self.max_tokens, self.num_topk, self.hidden = max_tokens, num_topk, hidden
        self._regions = _regions(world, max_tokens, num_topk, hidden)
        offsets, _ = _layout(self._regions)
        self._peers = [_carve(s, self._regions, offsets) for s in storages]
        self.local = self._peers[rank]
        self._barrier = barrier
        self.num_calls = 0  # exchanges this rank has started (exchange.announce_call)
        self.failure: Optional[str] = None  # why an exchange stopped midway (see `exchange`)
        self._constants: dict = {}
        self._regions_by_name = {name: PeerRegion(tuple(peer[name] for peer in self._peers))
                                 for name, _, _ in self._regions}
        # This rank's own (not shared) arrival flags and copy stream (exchange.pull_tokens); none on the CPU.
        device = self.local["x"].device
        self.ready_flags = torch.zeros(world, dtype=torch.int32, device=device) if device.type == "cuda" else None
        self.copy_stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None

    @staticmethod
    def nbytes(world: int, max_tokens: int, num_topk: int, hidden: int) -> int:
        return _layout(_regions(world, max_tokens, num_topk, hidden))[1]

    def constant(self, key: tuple, make: Callable[[], object]):
        """``make()``, computed once per key and kept (index tensors that depend only on the
        buffer's shape and a token count: fewer small launches per call). Not kept when made
        during CUDA-graph capture, where its kernels have not run yet."""
        if key in self._constants:
            return self._constants[key]
        value = make()
        if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            self._constants[key] = value
        return value

    @contextlib.contextmanager
    def exchange(self):
        """Wraps one exchange (a layer's forward or backward on this buffer): raises if an
        earlier one stopped midway, and remembers it if this one does. Its flags and regions
        are then in an unknown state (other ranks may have sent into it, or wait for this one),
        so the buffer must not be used again: make a new one after recovering the group."""
        if self.failure is not None:
            raise RuntimeError(f"an earlier exchange on this buffer stopped midway ({self.failure}); "
                               "make a new buffer")
        try:
            yield
        except BaseException as e:
            self.failure = f"{type(e).__name__}: {e}"
            raise

    def region(self, name: str) -> PeerRegion:
        return self._regions_by_name[name]

    def fp8_region(self, name: str) -> tuple[PeerRegion, PeerRegion]:
        """A token region ("x", "dy": bf16 ``[M, H]``) as the FP8 exchange fills it, in the same
        bytes: every rank's rows quantized per 1 x 128, data ``[M, H]`` float8_e4m3fn and scales
        ``[H / 128, M]`` fp32 (the GEMMs' column-major layout, one row per 128 columns). H is a
        multiple of 128, so both fit in the bf16 rows' 2 bytes an element."""
        if self.hidden % 128:
            raise ValueError(f"the FP8 exchange needs H a multiple of 128, got {self.hidden}")
        m, h = self.max_tokens, self.hidden
        raw = [t.view(torch.uint8).view(-1) for t in self.region(name).tensors]
        data = tuple(r[:m * h].view(torch.float8_e4m3fn).view(m, h) for r in raw)
        scales = tuple(r[m * h:m * h + 4 * m * (h // 128)].view(torch.float32).view(h // 128, m) for r in raw)
        return PeerRegion(data), PeerRegion(scales)

    def barrier(self) -> None:
        self._barrier()

    def check_fits(self, num_tokens: int, num_topk: int, hidden: int) -> None:
        if num_tokens > self.max_tokens or num_topk != self.num_topk or hidden != self.hidden:
            raise ValueError(f"the buffer holds up to {self.max_tokens} tokens of K = {self.num_topk}, "
                             f"H = {self.hidden}; got {num_tokens} tokens, K = {num_topk}, H = {hidden}")


def get_symm_buffer_for_mega_moe(group: Optional[dist.ProcessGroup], num_experts: int, num_max_tokens_per_rank: int,
                                 num_topk: int, hidden: int, intermediate_hidden: int) -> SymmBuffer:
    """Allocates (collectively: every rank of `group` must call it with the same arguments)
    the symmetric buffer of the built-in NVLink expert-parallel MoE.

    Args:
        group: the expert-parallel process group (None: the default group); one GPU per rank,
            all GPUs of one node (NVLink peers).
        num_experts: experts of the whole layer; rank r holds ``[r * E / world, (r + 1) * E / world)``.
        num_max_tokens_per_rank: the most tokens any rank passes to one layer call.
        num_topk: K, slots per token.
        hidden: H.
        intermediate_hidden: I (the buffer itself holds no intermediate activations).

    Returns a `SymmBuffer` of about ``(world + 1) * T * H * 2`` bytes per rank (T =
    num_max_tokens_per_rank); reuse it for every layer. Every exchange copies whole regions of
    T rows from each rank, so T should be close to the tokens a rank actually passes. Also
    compiles the exchange's small kernels now, so that fewer compile while the others wait
    (ranks wait at most DG_EP_BARRIER_TIMEOUT_MS, default 10 min, for each other, in barriers
    and for each other's results; the GEMMs compile on first use). NVLink multicast stays off
    (TORCH_SYMM_MEM_DISABLE_MULTICAST=1 unless set).
    """
    # intermediate_hidden is part of the upstream-style signature: nothing of size I is exchanged.
    for name, value in (("num_experts", num_experts), ("num_max_tokens_per_rank", num_max_tokens_per_rank),
                        ("num_topk", num_topk), ("hidden", hidden), ("intermediate_hidden", intermediate_hidden)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # never multicast (docs/DESIGN.md, "Rules")
    import torch.distributed._symmetric_memory as symm_mem

    group = group or dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if num_experts % world:
        raise ValueError(f"{num_experts} experts do not split evenly over {world} ranks")
    nbytes = SymmBuffer.nbytes(world, num_max_tokens_per_rank, num_topk, hidden)
    storage = symm_mem.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", torch.cuda.current_device()))
    handle = symm_mem.rendezvous(storage, group.group_name)
    # The allocation may sit inside a pool segment: peers' copies are at the same offset.
    offset = getattr(handle, "offset", 0)
    if handle.buffer_ptrs[rank] + offset != storage.data_ptr():
        raise RuntimeError("symmetric memory: this rank's buffer is not where the handle says")
    # Whether get_buffer adds the allocation's offset itself is not documented: this rank's own
    # mapping tells.
    own = handle.get_buffer(rank, (nbytes,), torch.uint8, 0).data_ptr()
    if own not in (storage.data_ptr(), storage.data_ptr() - offset):
        raise RuntimeError("symmetric memory: get_buffer does not map this rank's buffer")
    extra = 0 if own == storage.data_ptr() else offset
    storages = [storage if r == rank else handle.get_buffer(r, (nbytes,), torch.uint8, extra) for r in range(world)]
    for name in ("moe_combine", "moe_swiglu_fwd", "moe_swiglu_bwd", "ep_wait_flags"):
        kernels.get_kernel(name)  # compiled now, not while the other ranks wait (see the docstring)
    buffer = SymmBuffer(storages, rank, group, num_experts, num_max_tokens_per_rank, num_topk, hidden,
                        barrier=lambda: handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS))
    buffer.handle = handle  # keeps the mapping alive
    return buffer
