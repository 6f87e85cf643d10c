"""Expert parallelism: experts spread over the ranks of a process group (expert e lives on
rank e // E_local), tokens exchanged between ranks."""
from .baseline import all_to_all_moe
from .launch import launch

__all__ = ["all_to_all_moe", "launch"]
