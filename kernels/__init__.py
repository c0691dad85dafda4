"""Attention and cache ops. Contract and shapes: ../shared/DESIGN.md, "Kernels".

Each op has a pure-torch reference (`reference.py`: the oracle, and the CPU path
where no C++ compiler is found) and a Triton kernel (`paged_attention.py`, `write_kv.py`,
`copy_blocks.py`: the GPU path); on CPU, decode attention runs in C++ (`cpu_attention.py`). `backend.get_ops(device)` picks the implementation; the names exported
here are the references. `attention_plan.py`: what attention derives once per step from
the batch's layout, for every layer.
"""

from folio.kernels.attention_plan import AttentionPlan, kv_bytes_per_token, plan_attention
from folio.kernels.backend import KernelOps, get_ops
from folio.kernels.reference import copy_blocks, paged_attention, swap_blocks, write_kv

__all__ = ["write_kv", "paged_attention", "copy_blocks", "swap_blocks", "plan_attention", "AttentionPlan",
           "kv_bytes_per_token", "get_ops", "KernelOps"]
