"""Attention and cache ops. Contract and shapes: ../shared/DESIGN.md, "Kernels".

Today every op is the pure-torch reference (`reference.py`), which is the CPU
path and the oracle for the Triton kernels that the GPU path will add.
"""

from folio.kernels.reference import copy_blocks, paged_attention, swap_blocks, write_kv

__all__ = ["write_kv", "paged_attention", "copy_blocks", "swap_blocks"]
