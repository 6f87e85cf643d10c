"""What the Hopper GEMM launchers share: tile constants, shared-memory sizing, kernel sources."""
from __future__ import annotations

from dataclasses import dataclass

from ..jit.runtime import Kernel, build_kernel
from ..utils import get_num_sms

BLOCK_M = 128
BLOCK_K = 64
NUM_THREADS = 384  # two math warpgroups + one TMA producer warpgroup
SMEM_LIMIT = 232448  # bytes of dynamic shared memory a CTA may use on sm_90
MAX_STAGES = 8


@dataclass(frozen=True)
class GemmConfig:
    """One compiled variant of a grouped GEMM kernel.

    block_n: tile width (the tile is 128 x block_n); num_stages: pipeline depth;
    async_store: epilogue drained by 1-D bulk copies (one per row) overlapping the next tile's
    MMAs; tma_store: drained by tensor TMA stores (one per 128-byte column chunk) likewise,
    staged in `store_buffers` buffers per warpgroup; smem_bytes: dynamic shared memory the
    variant needs; multicast_b: CTAs in clusters of two (two M blocks, one N block) that each
    load half of B's tile for both (k-grouped only).
    """

    block_n: int
    num_stages: int
    async_store: bool
    smem_bytes: int
    tma_store: bool = False
    store_buffers: int = 2
    multicast_b: bool = False

    @property
    def cluster_size(self) -> int:
        return 2 if self.multicast_b else 1

    @property
    def label(self) -> str:
        """Short name for tables and test ids: block_n, then `a` (async store) or `t` (TMA store),
        then the store buffers when not two, then `m` (B multicast): `256t4m`."""
        buffers = str(self.store_buffers) if self.tma_store and self.store_buffers != 2 else ""
        return (f"{self.block_n}{'a' if self.async_store else ''}{'t' if self.tma_store else ''}{buffers}"
                f"{'m' if self.multicast_b else ''}")


def make_config(block_n: int, async_store: bool, epilogue_bytes: int, tma_store: bool = False,
                store_buffers: int = 2, multicast_b: bool = False) -> GemmConfig:
    """The deepest pipeline that fits next to `epilogue_bytes` of epilogue shared memory."""
    per_stage = (BLOCK_M + block_n) * BLOCK_K * 2 + 2 * 8  # A and B tiles, full and empty barriers
    num_stages = min(MAX_STAGES, (SMEM_LIMIT - epilogue_bytes) // per_stage)
    if num_stages < 2:
        raise ValueError(f"block_n={block_n} with async_store={async_store} does not fit in shared memory")
    return GemmConfig(block_n, num_stages, async_store, epilogue_bytes + num_stages * per_stage, tma_store,
                      store_buffers, multicast_b)


def swizzled_staging_bytes(num_buffers: int = 2) -> int:
    """Mirrors epilogue::SwizzledStaging: two warpgroups x `num_buffers` 64-row x 128-byte buffers."""
    return 2 * num_buffers * 64 * 128


def row_staging_bytes(block_n: int, elem_bytes: int) -> int:
    """Mirrors epilogue::RowStaging: two warpgroups x 64 rows x (one <= 256-byte column chunk + 16 bytes)."""
    return 2 * 64 * (min(block_n * elem_bytes, 256) + 16)


def build_gemm_kernel(header: str, params_type: str, impl: str, template_args: list, smem_bytes: int,
                      cluster_size: int = 1) -> Kernel:
    """A GEMM kernel entry (NUM_THREADS threads, one CTA per SM) running `impl<args>`."""
    return build_kernel(header, params_type, impl, template_args, NUM_THREADS, smem_bytes, cluster_size)


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
