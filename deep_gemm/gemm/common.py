"""What the Hopper GEMM launchers share: tile constants, pipeline depth from the shared-memory
budget, the config type and the grid size."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..jit.runtime import Kernel
from ..utils import get_num_sms

BLOCK_M = 128
BLOCK_K = 64
NUM_THREADS = 384  # two math warpgroups + one producer warpgroup (mma/pipeline.cuh)
SMEM_LIMIT = 232448  # bytes of dynamic shared memory a CTA may use on sm_90
MAX_STAGES = 8
_BARRIER_BYTES = 8  # one mbarrier


@dataclass(frozen=True)
class GemmConfig:
    """One compiled variant of a grouped GEMM kernel.

    block_n: tile width (the tile is 128 x block_n); num_stages: pipeline depth; smem_bytes:
    dynamic shared memory (stages, epilogue staging, barriers); store_buffers: 64-row x
    128-byte staging buffers per math warpgroup that its tensor stores cycle through (the
    k-grouped GEMMs; the m-grouped epilogue policies fix their own);
    multicast_b: CTAs in clusters of two (two M blocks, one N block) that each load half of B's
    tile for both (k-grouped only); row_copies: the epilogue drains through one bulk copy per
    row instead of tensor stores (the k-grouped GEMM's accumulating bf16 output).
    """

    block_n: int
    num_stages: int
    smem_bytes: int
    store_buffers: int = 2
    multicast_b: bool = False
    row_copies: bool = False

    @property
    def cluster_size(self) -> int:
        return 2 if self.multicast_b else 1

    @property
    def label(self) -> str:
        """Short name for tables and test ids: block_n, then `t` (tensor stores; with their buffer
        count when not two, and `m` for B multicast) or `a` (row copies): `256t4`, `256tm`."""
        if self.row_copies:
            return f"{self.block_n}a"
        buffers = "" if self.store_buffers == 2 else str(self.store_buffers)
        return f"{self.block_n}t{buffers}{'m' if self.multicast_b else ''}"


def make_config(block_n: int, staging_bytes_per_warpgroup: int, scale_bytes_per_stage: int = 0, extra_bytes: int = 0,
                **kwargs) -> GemmConfig:
    """The deepest pipeline that fits beside the two math warpgroups' epilogue staging (each
    warpgroup's `staging_bytes_per_warpgroup`) and the kernel's own `extra_bytes` after it, as the
    kernels' mma::GemmSmem lays it out (FP8: with `scale_bytes_per_stage` for the scales)."""
    epilogue_bytes = 2 * staging_bytes_per_warpgroup + extra_bytes

    def total(num_stages: int) -> int:
        # A and B tiles of 128-byte rows (64 bf16 or 128 fp8 of K), the scales padded to 1024
        # bytes (the epilogue's alignment), the staging and extra bytes, full and empty barriers
        scales = -(-num_stages * scale_bytes_per_stage // 1024) * 1024
        return num_stages * (BLOCK_M + block_n) * 128 + scales + epilogue_bytes + num_stages * 2 * _BARRIER_BYTES

    num_stages = max((s for s in range(1, MAX_STAGES + 1) if total(s) <= SMEM_LIMIT), default=0)
    if num_stages < 2:
        raise ValueError(f"block_n={block_n} with {epilogue_bytes} bytes of staging does not fit in shared memory")
    return GemmConfig(block_n, num_stages, total(num_stages), **kwargs)


def swizzled_staging_bytes(num_buffers: int) -> int:
    """epilogue::SwizzledStaging: `num_buffers` 64-row x 128-byte buffers (one warpgroup)."""
    return num_buffers * 64 * 128


def staged_bf16_bytes(block_n: int) -> int:
    """epilogue::StagedBF16: 64 rows x (<= 128 bf16 columns + a 16-byte pad) (one warpgroup)."""
    return 64 * (min(block_n, 128) * 2 + 16)


def row_staging_bytes(block_n: int, elem_bytes: int) -> int:
    """epilogue::RowStaging: 64 rows x (one <= 256-byte column chunk + a 16-byte pad) (one warpgroup)."""
    return 64 * (min(block_n * elem_bytes, 256) + 16)


_OUT_TYPES = {torch.float32: "float", torch.bfloat16: "__nv_bfloat16"}


def k_grouped_epilogue(config: GemmConfig, out_dtype: torch.dtype, accumulate: bool) -> str:
    """The k-grouped GEMMs' epilogue policy (epilogue/k_grouped.cuh) for `config`: row copies or
    tensor stores, written over D or added to it."""
    out_type, output = _OUT_TYPES[out_dtype], f"deep_gemm::epilogue::Output::{'kAccumulate' if accumulate else 'kOverwrite'}"
    if config.row_copies:
        return f"deep_gemm::epilogue::RowCopies<{config.block_n}, {out_type}, {output}>"
    return f"deep_gemm::epilogue::TensorStores<{config.block_n}, {out_type}, {output}, {config.store_buffers}>"


def grid_size(kernel: Kernel, num_tiles: int, device: int) -> int:
    """CTAs to launch for `num_tiles` tiles (counted per cluster): one per SM at most, in whole
    clusters, no more clusters than are resident at once (a cluster lives in one GPC)."""
    cluster = kernel.cluster_size
    num_ctas = min(get_num_sms(device), max(cluster * num_tiles, 1))
    if cluster > 1:
        num_ctas = min(num_ctas, kernel.max_resident_blocks(device)) // cluster * cluster
        if num_ctas == 0:
            raise ValueError(f"a config with clusters of {cluster} CTAs needs {cluster} SMs at once "
                             f"(set_num_sms: {get_num_sms(device)}); pick a config without B multicast")
    return num_ctas


def fp8_operand(name: str, operand) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 GEMM operand: a ``(data, scales)`` pair (checked by the caller)."""
    if not (isinstance(operand, (tuple, list)) and len(operand) == 2):
        raise TypeError(f"{name} must be a (data, scales) pair, got {type(operand).__name__}")
    return operand[0], operand[1]
