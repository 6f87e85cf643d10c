"""Starting one process per rank (tests, benchmarks), with NVLink multicast off."""
from __future__ import annotations

import os
import socket
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# NVLink multicast / NVLS is never used: it can take a shared host's GPUs down (docs/DESIGN.md, "Rules").
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def disable_multicast() -> None:
    """Sets the three no-multicast variables (unless the caller already set them)."""
    for key, value in NO_MULTICAST_ENV.items():
        os.environ.setdefault(key, value)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world: int, port: int, backend: str, fn: Callable, args: tuple) -> None:
    disable_multicast()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:  # CPU ranks share the machine's cores; each at torch's default thread count oversubscribes them
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def launch(fn: Callable, num_processes: int, *args, backend: str | None = None) -> None:
    """Runs ``fn(rank, world, *args)`` in `num_processes` spawned processes joined in the
    default process group: NCCL, one GPU each, when there are enough GPUs, else gloo on the
    CPU (each rank with its share of the cores' threads). An exception in any rank is raised here."""
    disable_multicast()
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= num_processes else "gloo"
    mp.spawn(_worker, args=(num_processes, _free_port(), backend, fn, args), nprocs=num_processes, join=True)
