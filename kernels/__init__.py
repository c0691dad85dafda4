"""Attention and cache ops. Contract and shapes: ../shared/DESIGN.md, "Kernels".

Today every op is the pure-torch reference (`reference.py`), which is the CPU
path and the oracle for the Triton kernels that the GPU path will add.
"""

from folio.kernels.reference import (AttentionPlan, copy_blocks, kv_bytes_per_token, paged_attention,
                                     plan_attention, swap_blocks, write_kv)

__all__ = ["write_kv", "paged_attention", "copy_blocks", "swap_blocks", "plan_attention", "AttentionPlan",
           "kv_bytes_per_token"]
