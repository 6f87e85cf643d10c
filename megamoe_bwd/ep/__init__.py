"""Expert parallelism: experts spread over the ranks of a process group (expert e lives on rank
e // E_local), tokens exchanged between ranks. Every path runs the single-GPU layer's steps
(deep_gemm.moe, megamoe_bwd.backward) around its exchange; read top-down:

    launch.py     start one process per rank, NVLink multicast off
    symm.py       the symmetric buffer of the NVLink path (one per model, collective)
    exchange.py   the NVLink exchange: token counts, pulls by the copy engines, results back
    nvlink.py     ep_mega_moe_nvlink: the layer over that exchange, forward and backward
    fp8_steps.py  the FP8 layer's steps on exchanged rows, shared by:
    deepep.py     ep_mega_moe_deep_ep: the layer over DeepEP's dispatch and combine (optional)
    alltoall.py   dispatch / combine over all_to_all_single, shared by:
    nccl.py       ep_mega_moe_nccl: our layer between them
    baseline.py   all_to_all_moe: the TorchTitan-style baseline
"""
from .baseline import all_to_all_moe
from .deepep import ep_mega_moe_deep_ep, make_deep_ep_buffer
from .launch import launch
from .nccl import ep_mega_moe_nccl
from .nvlink import ep_mega_moe_nvlink
from .symm import SymmBuffer, get_symm_buffer_for_mega_moe

__all__ = ["SymmBuffer", "all_to_all_moe", "ep_mega_moe_deep_ep", "ep_mega_moe_nccl", "ep_mega_moe_nvlink",
           "get_symm_buffer_for_mega_moe", "launch", "make_deep_ep_buffer"]
