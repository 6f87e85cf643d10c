"""Expert parallelism: experts spread over the ranks of a process group (expert e lives on
rank e // E_local), tokens exchanged between ranks."""
from .baseline import all_to_all_moe
from .launch import launch
from .nccl import ep_mega_moe_nccl
from .deepep import ep_mega_moe_deep_ep, make_deep_ep_buffer
from .nvlink import ep_mega_moe_nvlink

__all__ = ["all_to_all_moe", "ep_mega_moe_deep_ep", "ep_mega_moe_nccl", "ep_mega_moe_nvlink", "launch",
           "make_deep_ep_buffer"]
